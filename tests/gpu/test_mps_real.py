"""gpud's MPS control daemons on the real driver: one starts for the GPU, takes the limits
``gpuctl mps set`` gives it, serves a job's CUDA client, and is gone when gpud stops. MPS
needs no change of compute mode, MIG mode, clocks or power, and leaves the GPU as it was."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from gpud.mps.procs import alive
from gpud.mps.protocol import PID_FILE
from gpud.shared import GIB
from tests.integration.conftest import RunningDaemon, start_daemon, stop_daemon

pytestmark = pytest.mark.gpu

# Under a pinned-memory limit the driver reports the GPU's whole memory as total and at most
# the limit as free (580 series). While its context is open, the client asks the control
# daemon of its CUDA_MPS_PIPE_DIRECTORY for the MPS servers: the one serving it.
# It also says where NVML lists it while its context is open, which gpud's attribution of
# processes to jobs relies on: in nvmlDeviceGetComputeRunningProcesses (what gpud reads),
# in nvmlDeviceGetMPSComputeRunningProcesses, or neither ("compute", "mps", "-").
_CLIENT = """
import os, subprocess, torch, pynvml
free, total = torch.cuda.mem_get_info()
servers = subprocess.run(
    ["nvidia-cuda-mps-control"], input="get_server_list\\n", capture_output=True, text=True
).stdout.split()
pynvml.nvmlInit()
where = set()
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    if os.getpid() in {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}:
        where.add("compute")
    try:
        if os.getpid() in {p.pid for p in pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h)}:
            where.add("mps")
    except pynvml.NVMLError:
        pass
print(free, ",".join(servers) or "-", ",".join(sorted(where)) or "-")
"""


def _device(daemon: RunningDaemon) -> dict[str, Any]:
    shown = json.loads(daemon.gpuctl("mps", "show", "--json").stdout)
    assert shown["mps_enabled"]
    return dict(shown["devices"][0])


def _wait_up(daemon: RunningDaemon, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        dev = _device(daemon)
        if dev["up"] or time.monotonic() > deadline:
            return dev
        time.sleep(0.5)


def test_mps_limits_reach_the_daemon_and_a_jobs_client(real_nvml: Any, tmp_path: Path) -> None:
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("nvidia-cuda-mps-control is not installed")
    # MPS pipe sockets must fit in 107 bytes: a short run directory
    run_dir = Path(tempfile.mkdtemp(prefix="gpud-mps-", dir="/tmp"))
    daemon = start_daemon(
        tmp_path / "g",
        config_text='[mig]\non_start = "report"\n[mps]\nenabled = true\n',
        run_dir=run_dir,
    )
    pid_file: Path | None = None
    try:
        dev = _wait_up(daemon)
        assert dev["up"], dev["last_error"]
        pid_file = Path(dev["pipe_directory"]) / PID_FILE
        assert dev["observed_threads_percent"] == 100.0
        daemon.gpuctl("mps", "set", "--gpu", "0", "--threads", "40", "--memory", "20GiB")
        dev = _device(daemon)
        assert dev["up"], dev["last_error"]
        assert dev["observed_threads_percent"] == 40.0
        assert dev["observed_memory_limit_bytes"] == 20 * GIB
        if importlib.util.find_spec("torch") is not None:
            ran = daemon.gpuctl(
                "run", "--job", "mps-client", "--gpus", "1", "--threads", "30", "--memory",
                "8GiB", "--", sys.executable, "-c", _CLIENT,
            )  # fmt: skip
            free, servers, listed = ran.stdout.split()[-3:]
            assert 0 < int(free) <= 8 * GIB, f"the client may take {free} bytes under 8 GiB"
            assert servers != "-", "no MPS server served the client"
            assert "compute" in listed.split(","), (
                f"NVML lists the MPS client in {listed}, not among the compute processes gpud"
                " attributes to jobs"
            )
    finally:
        assert stop_daemon(daemon) == 0
        if pid_file is not None and pid_file.exists():
            assert not alive(int(pid_file.read_text().split()[0])), (
                "the control daemon outlived gpud"
            )
        shutil.rmtree(run_dir, ignore_errors=True)
