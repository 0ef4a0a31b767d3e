"""Simulated compute processes: what ``nvidia-smi`` lists under "Processes".

A started process holds device memory and drives the SMs of its GPU or MIG device: it
appears in ``nvmlDeviceGetComputeRunningProcesses`` and moves memory used, utilization,
power, temperature, clocks and PCIe/NVLink throughput until it is stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpud.backend.sim.fakenvml import FakeNvml


@dataclass(frozen=True, slots=True)
class Workload:
    pid: int
    gpu: int
    gpu_instance_id: int | None
    compute_instance_id: int | None
    used_memory_bytes: int
    sm_ratio: float


class Workloads:
    """Start and stop simulated processes. Thread-safe."""

    def __init__(self, nvml: FakeNvml) -> None:
        self._nvml = nvml

    def start(
        self,
        gpu: int,
        pid: int,
        used_memory_bytes: int,
        sm_ratio: float,
        mig: int | str | None = None,
    ) -> None:
        """Run ``pid`` on ``gpu`` (or its MIG device: index or ``MIG-`` UUID).

        ``sm_ratio`` is the share of the device's SMs it keeps busy (0..1).
        """
        if not 0 <= gpu < self._nvml.sim_gpu_count:
            raise ValueError(f"no GPU {gpu} (the node has {self._nvml.sim_gpu_count})")
        if used_memory_bytes < 0 or not 0.0 <= sm_ratio <= 1.0:
            raise ValueError("used_memory_bytes must be >= 0 and sm_ratio within 0..1")
        self._nvml.sim_start_process(gpu, pid, used_memory_bytes, sm_ratio, mig)

    def stop(self, pid: int) -> bool:
        """Stop ``pid``; False if it was not running."""
        return self._nvml.sim_stop_process(pid)

    def update(self, pid: int, used_memory_bytes: int, sm_ratio: float) -> bool:
        """Change the memory and SM activity of running ``pid``; False if it does not run."""
        if used_memory_bytes < 0 or not 0.0 <= sm_ratio <= 1.0:
            raise ValueError("used_memory_bytes must be >= 0 and sm_ratio within 0..1")
        return self._nvml.sim_update_process(pid, used_memory_bytes, sm_ratio)

    def lost_gpus(self) -> set[int]:
        """The GPUs injected as lost (fallen off the bus)."""
        return {gpu for gpu, f in self._nvml.sim_fault_table().items() if f.lost}

    def list(self) -> list[Workload]:
        return [
            Workload(p.pid, p.gpu, p.gi, p.ci, p.used_bytes, p.sm_ratio)
            for p in sorted(self._nvml.sim_processes(), key=lambda p: p.pid)
        ]
