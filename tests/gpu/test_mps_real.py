"""gpud's MPS control daemons on the real driver: one starts for the GPU, takes the limits
``gpuctl mps set`` gives it, serves a job's CUDA client, and is gone when gpud stops. MPS
needs no change of compute mode, MIG mode, clocks or power, and leaves the GPU as it was."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from gpud.mps.procs import alive
from gpud.mps.protocol import CONTROL_SOCKET, PID_FILE
from gpud.net.cgroups import find_cgroup2
from gpud.shared import GIB
from tests.integration.conftest import RunningDaemon, start_daemon, stop_daemon
from tools.simdaemon import kill_mps_daemons

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
    umask = os.umask(0o027)  # as systemd/gpud.service starts gpud
    try:
        daemon = start_daemon(
            tmp_path / "g",
            config_text='[mig]\non_start = "report"\n[mps]\nenabled = true\n',
            run_dir=run_dir,
        )
    finally:
        os.umask(umask)
    pid_file: Path | None = None
    try:
        dev = _wait_up(daemon)
        assert dev["up"], dev["last_error"]
        pipe = Path(dev["pipe_directory"])
        pid_file = pipe / PID_FILE
        assert dev["observed_threads_percent"] == 100.0
        # a memory limit never set reads back as nothing (no limit)
        assert dev.get("observed_memory_limit_bytes") is None, dev
        # the daemon's PID file is where gpud reads it, and its control socket lets clients
        # of every user connect whatever gpud's umask (the unit sets 0027)
        assert int(pid_file.read_text().split()[0]) == dev["pid"]
        control = pipe / CONTROL_SOCKET
        assert stat.S_ISSOCK(control.stat().st_mode), sorted(p.name for p in pipe.iterdir())
        assert control.stat().st_mode & 0o006 == 0o006, oct(control.stat().st_mode)
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
            # Without a limit of its own the client keeps to the daemon's default, set for
            # device 0 as the daemon sees it (CUDA_VISIBLE_DEVICES=<uuid>), not the NVML index.
            ran = daemon.gpuctl(
                "run", "--job", "mps-default", "--gpus", "1", "--", "env",
                "-u", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", sys.executable, "-c", _CLIENT,
            )  # fmt: skip
            free, servers, _ = ran.stdout.split()[-3:]
            assert 0 < int(free) <= 20 * GIB, f"the client may take {free} bytes under 20 GiB"
    finally:
        # gpud's stop leaves the control daemon running (for the jobs using it: the next
        # start adopts it), out of gpud's cgroup; the test then stops it with `quit`, as the
        # README says to when taking gpud off a node (nothing else: no mode is changed).
        assert stop_daemon(daemon, leave_mps=True) == 0
        try:
            if pid_file is not None and pid_file.exists():
                pid = int(pid_file.read_text().split()[0])
                assert alive(pid), "gpud's stop ended the control daemon"
                if find_cgroup2() is not None:  # out of gpud's cgroup, into its own
                    own = Path(f"/proc/{pid}/cgroup").read_text()
                    uuid = pid_file.parent.parent.name
                    assert f"/gpud-mps-{uuid}\n" in own, own
        finally:
            _quit(pid_file)
            shutil.rmtree(run_dir, ignore_errors=True)


def _quit(pid_file: Path | None) -> None:
    """Stop the control daemon gpud left (``quit``), as an operator would when taking gpud
    off a node, and remove its cgroup."""
    if pid_file is None:
        return
    kill_mps_daemons(pid_file.parent, quit_first=True)
    mount = find_cgroup2()
    if mount is None:
        return
    cgroup = mount / "gpud" / f"gpud-mps-{pid_file.parent.parent.name}"
    for _ in range(50):
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
