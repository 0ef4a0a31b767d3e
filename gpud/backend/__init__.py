"""GPU backends: the port (``port.GpuBackend``), the NVML adapter and the simulated node."""
