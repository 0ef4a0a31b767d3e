"""``gpuctl run`` in a PID namespace of its own (as in a container, gpud's socket
bind-mounted): gpud holds the reservation by the host PID of that gpuctl."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import BIN, RunningDaemon, start_daemon, stop_daemon

pytestmark = pytest.mark.integration


def wait_for(check: Callable[[], object], what: str, timeout: float = 30.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"{what}: not in {timeout:g}s")


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def reservations(daemon: RunningDaemon) -> list[dict[str, object]]:
    jobs = json.loads(daemon.gpuctl("--json", "jobs", "ls").stdout)["jobs"]
    return [r for j in jobs for r in j["reservations"]]


def test_a_run_in_its_own_pid_namespace_holds_its_reservation_by_its_host_pid(
    tmp_path: Path,
) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1)")
    daemon = start_daemon(tmp_path / "g", "--simulate", "H100-SXM5-80GB:1")
    run: subprocess.Popen[bytes] | None = None
    holder = 0
    try:
        gpuctl = [str(BIN / "gpuctl"), "--socket", str(daemon.socket)]
        command = [*gpuctl, "run", "--job", "pa", "--gpus", "1", "--", "sleep", "300"]
        with (tmp_path / "run.log").open("wb") as log:
            run = subprocess.Popen(
                ["unshare", "--pid", "--fork", "--mount-proc", *command],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        unshare = run.pid
        # unshare forks gpuctl, PID 1 of the new namespace
        (holder,) = wait_for(lambda: children(unshare), "gpuctl started")  # type: ignore[misc]
        nspid = Path(f"/proc/{holder}/status").read_text().split("NSpid:")[1].split("\n")[0]
        assert nspid.split() == [str(holder), "1"]
        (held,) = wait_for(lambda: reservations(daemon), "reserved")  # type: ignore[misc]
        assert held["holder_pid"] == holder  # not 1: the host's init, which never exits
        os.kill(holder, signal.SIGKILL)  # its namespace's processes (the sleep) die with it
        wait_for(lambda: not reservations(daemon), "released once its holder is gone")
        events = daemon.gpuctl("events").stdout
        assert f"holder pid {holder} is gone" in events, events
    finally:
        if holder:
            with contextlib.suppress(ProcessLookupError):
                os.kill(holder, signal.SIGKILL)
        if run is not None:
            run.kill()
            run.wait(timeout=30)
        stop_daemon(daemon)
