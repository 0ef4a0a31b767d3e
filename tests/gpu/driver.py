"""Helpers of the real-GPU tests."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any


def driver_processes(nv: Any) -> str:
    """What the driver lists on GPU 0, for a failure's message or the record: its compute
    processes, its MPS clients (pid, memory) and ``nvidia-smi``'s view."""
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    lines = []
    for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
        try:
            listed: list[object] = [(p.pid, p.usedGpuMemory) for p in getattr(nv, name)(handle)]
        except Exception as err:  # not supported on every driver
            listed = [repr(err)]
        lines.append(f"{name}: {listed}")
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, check=False)
        lines.append(smi.stdout)
    return "\n".join(lines)
