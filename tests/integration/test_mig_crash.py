"""gpud killed (SIGKILL) in the middle of `gpuctl mig apply`, on a simulated node whose MIG
changes are slowed (`gpuctl sim fault slow-mig`), and started again on the same state."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from gpud.mps.procs import PID_MAX
from tests.integration.conftest import BIN, RunningDaemon, start_daemon, stop_daemon
from tests.integration.test_daemon import MIG_CONFIGS, gpus, wait_for

pytestmark = pytest.mark.integration

NODE = ("--simulate", "H100-SXM5-80GB:2")
STEP_S = 0.2  # each MIG change takes this long
TICK = "[daemon]\ntick_s = 0.2\n"  # reconcile every 0.2 s
# a PID no host process has (Linux hands out PIDs below PID_MAX): its declared process runs
# until stopped, whatever runs on the machine
NO_HOST = str(PID_MAX)


def driver_state(daemon: RunningDaemon) -> list[list[dict[str, Any]]]:
    """Each GPU's instances as the simulated driver keeps them (``nvidia-smi mig -lgi``)."""
    data = json.loads((daemon.root / "run" / "sim" / "node.json").read_text())
    return [g["gpu_instances"] for g in data["gpus"]]


def events(daemon: RunningDaemon) -> list[dict[str, Any]]:
    """The event log, oldest first (it outlives the daemon)."""
    data = json.loads(daemon.gpuctl("events", "--json", "--limit", "1000").stdout)
    found: list[dict[str, Any]] = data["events"]
    return found


def apply_in_background(daemon: RunningDaemon, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(BIN / "gpuctl"), "--socket", str(daemon.socket), "mig", "apply", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def kill(daemon: RunningDaemon) -> None:
    daemon.proc.kill()
    daemon.proc.wait()
    stop_daemon(daemon)


def mig(name: str) -> tuple[str, ...]:
    return ("-f", str(MIG_CONFIGS), "-c", name)


def test_kill_mid_apply_resumes_and_a_kill_while_draining_changes_nothing(
    tmp_path: Path,
) -> None:
    root = tmp_path / "g"
    daemon = start_daemon(root, *NODE, config_text=TICK)
    try:
        daemon.gpuctl("mig", "apply", *mig("all-balanced"))
        balanced = driver_state(daemon)
        for gpu in ("0", "1"):
            daemon.gpuctl("sim", "fault", "--gpu", gpu, "slow-mig", str(STEP_S))
        client = apply_in_background(daemon, *mig("all-1g.10gb"))

        def gpu1_half_done() -> bool:
            gpu0, gpu1 = driver_state(daemon)
            seven = len(gpu0) == 7 and all(gi["compute_instances"] for gi in gpu0)
            return seven and gpu1 != balanced[1] and len(gpu1) >= 3

        # only the changes are slow: telemetry's reads answer, the GPUs stay healthy
        assert all(g["healthy"] for g in gpus(daemon))
        deadline = time.monotonic() + 15
        while not gpu1_half_done():
            assert time.monotonic() < deadline, driver_state(daemon)
            time.sleep(0.02)
        seen = len(events(daemon))
        kill(daemon)  # SIGKILL, some of GPU 1's steps done
        said = client.communicate(timeout=10)[0]
        assert client.returncode == 3 and "went away during the call" in said, said
    finally:
        kill(daemon)
    gpu0_done, gpu1_half = driver_state(daemon)
    assert len(gpu1_half) < 7 or not all(gi["compute_instances"] for gi in gpu1_half)

    again = start_daemon(root, *NODE, config_text=TICK)
    try:
        wait_for(
            lambda: again.gpuctl("mig", "assert", *mig("all-1g.10gb"), check=False).returncode == 0,
            15,
        )
        gpu0, gpu1 = driver_state(again)
        assert gpu0 == gpu0_done  # GPU 0 was done: its instances (and UUIDs) are kept
        for instances in (gpu0, gpu1):  # seven 1g instances, one compute instance each
            assert sorted(gi["start"] for gi in instances) == list(range(7))
            assert all(len(gi["compute_instances"]) == 1 for gi in instances)
        # the start reconciles before it serves: these come before `daemon.start`
        logged = {e["kind"]: str(e["message"]) for e in events(again)[seen:]}
        assert "resuming the interrupted apply of all-1g.10gb" in logged["mig.resume"]
        assert logged["mig.reconcile"] == "GPU 1: reconciled to its desired layout"
        assert logged["mig.apply"] == "apply all-1g.10gb: finished after a restart"
        shown = json.loads(again.gpuctl("mig", "show", "--json").stdout)
        assert [len(g["instances"]) for g in shown["gpus"]] == [7, 7]

        # Now a drain that waits for a process: killed before it changed anything.
        again.gpuctl("sim", "workload", "start", "--gpu", "0", "--mig", "0", "--pid", NO_HOST)
        client = apply_in_background(
            again, *mig("all-balanced"), "--drain", "--drain-timeout", "60"
        )
        wait_for(lambda: "draining MIG instances" in again.log.read_text(), 10)
        before = driver_state(again)
        seen = len(events(again))
        kill(again)
        said = client.communicate(timeout=10)[0]
        assert client.returncode == 3 and "went away during the call" in said, said
    finally:
        kill(again)
    third = start_daemon(root, *NODE, config_text=TICK)
    try:
        assert third.gpuctl("mig", "assert", *mig("all-1g.10gb"), check=False).returncode == 0
        time.sleep(0.5)  # reconcile ticks
        assert driver_state(third) == before
        kinds = [e["kind"] for e in events(third)[seen:]]
        assert not [k for k in kinds if k.startswith(("mig.resume", "mig.apply", "mig.retry"))]
    finally:
        stop_daemon(third)
