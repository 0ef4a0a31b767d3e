"""gpud on the real driver, read-only: it starts, lists every GPU with live readings and
serves metrics that pass promtool. No MIG layout is desired and MPS stays off, so the daemon
changes nothing on the GPUs."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpud.shared import GIB
from tests.gpu.driver import driver_processes
from tests.integration.conftest import BIN, start_daemon, stop_daemon

pytestmark = pytest.mark.gpu


def test_daemon_lists_real_gpus(real_nvml: Any, tmp_path: Path) -> None:
    count = real_nvml.nvmlDeviceGetCount()
    daemon = start_daemon(tmp_path / "g", config_text='[mig]\non_start = "report"\n')
    try:
        listed = json.loads(daemon.gpuctl("gpus", "--json").stdout)["gpus"]
        assert len(listed) == count
        for gpu in listed:
            assert gpu["uuid"].startswith("GPU-")
            assert gpu["healthy"], gpu["reason"]
            assert gpu["memory"]["total_bytes"] > 0
        status = json.loads(daemon.gpuctl("status", "--json").stdout)
        assert status["backend"] == "nvml"
        promtool = shutil.which("promtool")
        if promtool:
            result = subprocess.run(
                [promtool, "check", "metrics"],
                input=daemon.metrics(),
                capture_output=True,
                text=True,
                check=False,
            )
            assert result.returncode == 0, result.stdout + result.stderr
    finally:
        assert stop_daemon(daemon) == 0


# Holds 1 GiB on the GPU, says so through a file, and waits to be ended.
_HOLDER = """
import pathlib, sys, time, torch
x = torch.ones(2**30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
pathlib.Path(sys.argv[1]).touch()
time.sleep(120)
"""


def test_a_jobs_cuda_process_is_listed_and_attributed(real_nvml: Any, tmp_path: Path) -> None:
    """NVML's process list reaches ``gpuctl gpus``, and the process started by ``gpuctl run``
    is attributed to its job (``GPUD_JOB`` in /proc/PID/environ) with its memory."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("no CUDA client here (PyTorch is not installed)")
    daemon = start_daemon(tmp_path / "g", config_text='[mig]\non_start = "report"\n')
    ready = tmp_path / "ready"
    holder = subprocess.Popen(
        [str(BIN / "gpuctl"), "--socket", str(daemon.socket), "run", "--job", "holder",
         "--gpus", "1", "--", sys.executable, "-c", _HOLDER, str(ready)],
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert holder.poll() is None, f"the CUDA client exited {holder.returncode}"
            assert time.monotonic() < deadline, "the CUDA client never allocated its memory"
            time.sleep(0.2)
        # A reading of gpud's may be up to a sampling interval older than the allocation.
        deadline = time.monotonic() + 20
        while True:
            gpus = json.loads(daemon.gpuctl("gpus", "--json").stdout)["gpus"]
            listed = [p for g in gpus for p in g["processes"]]
            jobs = json.loads(daemon.gpuctl("jobs", "--json").stdout)["jobs"]
            (job,) = [j for j in jobs if j["name"] == "holder"]
            held = [p for p in job.get("processes", []) if (p["used_memory_bytes"] or 0) >= GIB]
            if held and any((p["used_memory_bytes"] or 0) >= GIB for p in listed):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(1)
        seen = f"gpud: {listed}\n{driver_processes(real_nvml)}\n{daemon.log.read_text()[-3000:]}"
        assert any((p["used_memory_bytes"] or 0) >= GIB for p in listed), seen
        attributed = job.get("processes", [])
        assert attributed and attributed[0]["source"] == "environ", job
        assert attributed[0]["used_memory_bytes"] >= GIB, attributed
    finally:
        holder.terminate()  # gpuctl run passes it on to the job and releases the GPU
        holder.wait(timeout=30)
        assert stop_daemon(daemon) == 0
