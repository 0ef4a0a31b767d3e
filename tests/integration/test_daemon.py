"""gpud as operators run it: a real process on a simulated node, driven by gpuctl,
scraped over HTTP, checked by promtool, signalled like systemd does."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpud.mps.procs import alive
from tests.integration.conftest import BIN, RunningDaemon, start_daemon, stop_daemon

pytestmark = pytest.mark.integration


def gpus(daemon: RunningDaemon) -> list[dict[str, object]]:
    data = json.loads(daemon.gpuctl("gpus", "--json").stdout)
    result: list[dict[str, object]] = data["gpus"]
    return result


def wait_for(predicate: object, timeout: float = 20.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError("condition not reached in time")


def test_serves_eight_simulated_gpus(gpud_sim: RunningDaemon) -> None:
    listed = gpus(gpud_sim)
    assert len(listed) == 8
    for gpu in listed:
        assert gpu["product"] == "H100-SXM5-80GB"
        assert gpu["healthy"] is True
        assert isinstance(gpu["memory"], dict)
        assert gpu["memory"]["total_bytes"] > 80 * 10**9
        assert gpu["power_watts"] is not None
    status = gpud_sim.gpuctl("status")
    assert "8" in status.stdout
    table = gpud_sim.gpuctl("gpus").stdout
    assert "H100-SXM5-80GB" in table


def test_ready_and_watchdog_are_sent(gpud_sim: RunningDaemon) -> None:
    messages = gpud_sim.notifications(timeout=3.0)
    assert any("READY=1" in m for m in messages), messages
    time.sleep(1.5)
    assert any("WATCHDOG=1" in m for m in messages + gpud_sim.notifications(timeout=2.0))


def test_metrics_pass_promtool(gpud_sim: RunningDaemon, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (Debian package prometheus)"
    text = gpud_sim.metrics()
    assert "gpud_gpu_memory_used_bytes{" in text
    assert "process_resident_memory_bytes" in text
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_faults_leave_the_daemon_serving(gpud_sim: RunningDaemon) -> None:
    gpud_sim.gpuctl("sim", "fault", "--gpu", "0", "lost")
    gpud_sim.gpuctl("sim", "fault", "--gpu", "1", "not-supported", "power")
    gpud_sim.gpuctl("sim", "fault", "--gpu", "2", "slow", "30")

    def faults_visible() -> bool:
        listed = {g["index"]: g for g in gpus(gpud_sim)}
        return (
            listed[0]["healthy"] is False
            and listed[1]["power_watts"] is None
            and listed[2]["healthy"] is False
        )

    wait_for(faults_visible, timeout=30)
    # The hung GPU is not answering from the first tick, in the same words past
    # call_timeout_s (5 s); no tick waits for it longer than half an interval.
    assert gpus(gpud_sim)[2]["reason"] == "not answering: a driver call is outstanding"

    def past_call_timeout() -> bool:
        return float(gpus(gpud_sim)[2]["sample_age_seconds"]) > 6  # type: ignore[arg-type]

    wait_for(past_call_timeout, timeout=30)
    assert gpus(gpud_sim)[2]["reason"] == "not answering: a driver call is outstanding"
    listed = {g["index"]: g for g in gpus(gpud_sim)}
    assert "lost" in str(listed[0]["reason"]).lower()
    assert listed[1]["healthy"] is True
    for index in range(3, 8):
        assert listed[index]["healthy"] is True
        assert float(listed[index]["sample_age_seconds"]) < 3.0  # type: ignore[arg-type]
    text = gpud_sim.metrics()
    assert "gpud_gpu_healthy{" in text
    healthy_lines = [ln for ln in text.splitlines() if ln.startswith("gpud_gpu_healthy{")]
    assert any('gpu="0"' in ln and ln.endswith(" 0.0") for ln in healthy_lines), healthy_lines
    gpud_sim.gpuctl("sim", "fault", "--gpu", "0", "clear")
    gpud_sim.gpuctl("sim", "fault", "--gpu", "1", "clear")


def test_sigterm_stops_cleanly(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "g", "--simulate", "A100-SXM4-40GB:2")
    assert len(gpus(daemon)) == 2
    daemon.notifications(timeout=1.0)
    code = stop_daemon(daemon)
    assert code == 0, daemon.log.read_text()
    assert not daemon.socket.exists()


def test_sighup_reload_keeps_good_config_on_bad_file(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "g", "--simulate", "A100-SXM4-40GB:1")
    try:
        config = daemon.root / "gpud.toml"
        config.write_text("[telemetry]\ninterval = 5\n")
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "config.reload_failed" in daemon.gpuctl("events").stdout)
        assert "telemetry.interval" in daemon.gpuctl("events").stdout
        assert daemon.proc.poll() is None
        config.write_text("[telemetry]\ninterval_s = 0.5\n")
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "config reloaded" in daemon.gpuctl("events").stdout)
        assert len(gpus(daemon)) == 1
    finally:
        stop_daemon(daemon)


def test_bad_config_stops_start_naming_key_and_file(tmp_path: Path) -> None:
    config = tmp_path / "gpud.toml"
    config.write_text("[metrics]\nport = 1\n")
    gpud = Path(__import__("sys").executable).with_name("gpud")
    result = subprocess.run(
        [str(gpud), "--config", str(config), "--simulate"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert f"{config}:metrics.port" in result.stderr


def test_gpuctl_without_daemon_says_so(tmp_path: Path) -> None:
    gpuctl = Path(__import__("sys").executable).with_name("gpuctl")
    result = subprocess.run(
        [str(gpuctl), "--socket", str(tmp_path / "none.sock"), "status"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 3
    assert "not running" in result.stderr


MIG_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "mig-parted" / "config.yaml"


def test_mig_layout_survives_restart_and_is_recreated_after_reboot(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "g", "--simulate", "A100-SXM4-40GB:2")
    mig = ("-f", str(MIG_CONFIGS), "-c", "all-balanced")
    try:
        daemon.gpuctl("mig", "apply", *mig, "--skip-reset")  # A100: MIG mode pending a reset
        assert daemon.gpuctl("mig", "assert", *mig, check=False).returncode == 1
        daemon.gpuctl("sim", "reboot")  # the reset: the daemon then creates the instances
        wait_for(lambda: daemon.gpuctl("mig", "assert", *mig, check=False).returncode == 0)
        wait_for(lambda: all(g["mig_devices"] for g in gpus(daemon)))
        # A crash of the daemon: the driver keeps the instances and the new daemon adopts them.
        daemon.proc.kill()
        daemon.proc.wait()
    finally:
        stop_daemon(daemon)
    again = start_daemon(tmp_path / "g", "--simulate", "A100-SXM4-40GB:2")
    try:
        assert again.gpuctl("mig", "assert", *mig, check=False).returncode == 0
        uuids = [d["uuid"] for g in gpus(again) for d in g["mig_devices"]]  # type: ignore[attr-defined]
        events = json.loads(again.gpuctl("events", "--json").stdout)["events"]
        kinds = [e["kind"] for e in events]
        since_restart = kinds[len(kinds) - 1 - kinds[::-1].index("daemon.start") :]
        assert not [k for k in since_restart if k.startswith("mig.apply")], since_restart
        again.gpuctl("sim", "reboot")

        def listed() -> list[str]:
            return [d["uuid"] for g in gpus(again) for d in g["mig_devices"]]  # type: ignore[attr-defined]

        # The listing is the last sample's: first see the reboot in it, then the instances back.
        wait_for(lambda: listed() != uuids)
        wait_for(lambda: again.gpuctl("mig", "assert", *mig, check=False).returncode == 0)
        wait_for(lambda: len(listed()) == len(uuids))
        assert set(listed()).isdisjoint(uuids)  # new instances, new UUIDs
    finally:
        stop_daemon(again)


def test_mps_limits_held_restarted_and_handed_to_jobs(tmp_path: Path) -> None:
    # MPS control sockets live under the run dir: keep it short (unix socket path limit).
    short = Path(tempfile.mkdtemp(prefix="gpud-", dir="/tmp"))

    def start() -> RunningDaemon:
        return start_daemon(
            tmp_path / "g",
            "--simulate",
            "H100-SXM5-80GB:2",
            config_text="[mps]\nenabled = true\n",
            run_dir=short,
        )

    daemon = start()

    def devices() -> dict[int, dict[str, object]]:
        shown = json.loads(daemon.gpuctl("mps", "show", "--json").stdout)
        return {d["gpu"]: d for d in shown["devices"]}

    try:
        wait_for(lambda: all(d["up"] for d in devices().values()))
        daemon.gpuctl("mps", "set", "--gpu", "0", "--threads", "40", "--memory", "20GiB")
        daemon.gpuctl("mps", "set", "--gpu", "1", "--threads", "70", "--memory", "50GiB")
        held = devices()
        assert held[0]["observed_threads_percent"] == 40.0
        assert held[0]["observed_memory_limit_bytes"] == 20 << 30
        assert held[1]["observed_threads_percent"] == 70.0
        # The control daemon dies: gpud restarts it with the same limits.
        old_pid = int(held[0]["pid"])  # type: ignore[call-overload]
        os.kill(old_pid, signal.SIGKILL)
        wait_for(lambda: devices()[0]["pid"] not in (None, old_pid) and devices()[0]["up"], 40)
        again = devices()[0]
        assert again["observed_threads_percent"] == 40.0
        assert again["observed_memory_limit_bytes"] == 20 << 30
        assert int(again["restarts"]) >= 1  # type: ignore[call-overload]
        # A job gets its device and its limits in the environment.
        child = daemon.gpuctl(
            "run",
            "--job",
            "probe",
            "--gpus",
            "1",
            "--threads",
            "30",
            "--memory",
            "10GiB",
            "--",
            sys.executable,
            "-c",
            "import json, os; print(json.dumps(dict(os.environ)))",
        )
        env = json.loads(child.stdout)
        assert env["GPUD_JOB"] == "probe"
        assert env["CUDA_VISIBLE_DEVICES"].startswith("GPU-")
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10G"
        assert env["CUDA_MPS_PIPE_DIRECTORY"].endswith(f"{env['CUDA_VISIBLE_DEVICES']}/pipe")
        # Over-subscription is refused with the numbers, and the command does not run.
        device = env["CUDA_VISIBLE_DEVICES"]
        hold = ("--devices", device, "--memory")
        gpuctl = (str(BIN / "gpuctl"), "--socket", str(daemon.socket))
        holder = subprocess.Popen(
            [*gpuctl, "run", "--job", "hold", *hold, "50GiB", "--", "sleep", "60"]
        )
        try:
            wait_for(lambda: "hold" in daemon.gpuctl("mps", "show").stdout)
            refused = daemon.gpuctl(
                "run",
                "--job",
                "big",
                *hold,
                "40GiB",
                "--no-wait",
                "--",
                "touch",
                str(tmp_path / "ran"),
                check=False,
            )
            assert refused.returncode == 7, refused.stderr
            assert "50GiB reserved by hold" in refused.stderr, refused.stderr
            assert not (tmp_path / "ran").exists()
        finally:
            holder.terminate()
            holder.wait(timeout=30)
        before = {d["uuid"]: d["pid"] for d in devices().values()}
        # A restart (an upgrade, say) leaves the control daemons running for the jobs that
        # use them, and the next gpud adopts them with their limits.
        stop_daemon(daemon, leave_mps=True)
        assert daemon.log.read_text().count("leaving 2 MPS control daemons running") == 1
        for pid in before.values():
            assert alive(int(pid)), "gpud's stop left its control daemons running"  # type: ignore[call-overload]
        daemon = start()
        wait_for(lambda: all(d["up"] for d in devices().values()))
        after = devices()
        assert {d["uuid"]: d["pid"] for d in after.values()} == before
        assert after[0]["observed_threads_percent"] == 40.0
        assert after[0]["observed_memory_limit_bytes"] == 20 << 30
        assert after[1]["observed_threads_percent"] == 70.0
        events = json.loads(daemon.gpuctl("events", "--json").stdout)["events"]
        kinds = [e["kind"] for e in events]
        assert "mps.leave" in kinds
        assert kinds[kinds.index("mps.leave") :].count("mps.adopt") == 2
    finally:
        stop_daemon(daemon)
        shutil.rmtree(short, ignore_errors=True)


def test_processes_on_gpus_are_attributed_to_their_jobs(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "g", "--simulate", "H100-SXM5-80GB:2")
    gpuctl = (str(BIN / "gpuctl"), "--socket", str(daemon.socket))
    job = subprocess.Popen([*gpuctl, "run", "--job", "train-a", "--gpus", "1", "--", "sleep", "60"])
    try:

        def child() -> int | None:
            for line in subprocess.run(
                ["pgrep", "-P", str(job.pid)], capture_output=True, text=True, check=False
            ).stdout.split():
                return int(line)
            return None

        wait_for(lambda: child() is not None)
        pid = child()
        assert pid is not None
        # The launched command becomes a (simulated) CUDA process on GPU 0.
        daemon.gpuctl(
            "sim", "workload", "start", "--gpu", "0", "--pid", str(pid), "--memory", "12GiB"
        )

        def used() -> object:
            jobs = json.loads(daemon.gpuctl("jobs", "ls", "--json").stdout)["jobs"]
            return next(j for j in jobs if j["name"] == "train-a")["processes"]

        # (the simulated node's workload model may have listed it first, with the default
        # memory of a training job; the operator's declaration replaces it)
        wait_for(lambda: [p["used_memory_bytes"] for p in used()] == [12 << 30])  # type: ignore[attr-defined]
        (proc,) = used()  # type: ignore[misc]
        assert proc["pid"] == pid and proc["used_memory_bytes"] == 12 << 30
        assert proc["gpu"] == 0 and proc["device"].startswith("GPU-")
        assert proc["source"] == "environ"  # found by the GPUD_JOB gpuctl run gave it
    finally:
        job.terminate()
        job.wait(timeout=30)
        stop_daemon(daemon)


HELD_OUT = """\
version: v1
mig-configs:
  custom-balanced:
    - devices: all
      mig-enabled: true
      mig-devices:
        "3g.20gb": 1
        "2g.10gb": 1
        "1g.5gb": 2
"""


def test_a100_layout_applied_with_a_reset_and_a_gpu_lost_across_restarts(tmp_path: Path) -> None:
    layout = tmp_path / "held-out.yaml"
    layout.write_text(HELD_OUT)
    mig = ("-f", str(layout), "-c", "custom-balanced")
    root = tmp_path / "g"
    daemon = start_daemon(root, "--simulate", "A100-SXM4-40GB:2")
    try:
        # A100: enabling MIG needs a GPU reset; gpud resets and creates the instances.
        applied = daemon.gpuctl("mig", "apply", *mig)
        assert "custom-balanced: success" in applied.stdout
        assert daemon.gpuctl("mig", "assert", *mig, check=False).returncode == 0
        daemon.gpuctl("sim", "fault", "--gpu", "1", "lost")
        daemon.proc.kill()  # gpud dies; GPU 1 stays lost (device state)
        daemon.proc.wait()
    finally:
        stop_daemon(daemon)
    again = start_daemon(root, "--simulate", "A100-SXM4-40GB:2")
    try:
        listed = gpus(again)
        assert listed[0]["healthy"] is True and listed[1]["healthy"] is False
        show = again.gpuctl("mig", "show", check=False)
        assert show.returncode == 11
        # lost before this start: named as an earlier run last saw it
        assert "GPU 1 A100-SXM4-40GB (last seen) GPU-" in show.stdout
        assert ": faulty: GPU lost" in show.stdout
        assert "GPU 0 A100-SXM4-40GB" in show.stdout
        checked = again.gpuctl("mig", "assert", *mig, check=False)
        assert checked.returncode == 11 and "the GPUs that answer match" in checked.stdout
        again.gpuctl("sim", "fault", "--gpu", "1", "clear")
        # Falling off the bus posted Xid 79 (critical), which outlives the restart: GPU 1
        # stays unhealthy, with the XID in the reason, until it is cleared (or reset).
        wait_for(lambda: "critical Xid 79" in str(gpus(again)[1]["reason"]))
        cleared = again.gpuctl("xid", "clear", "1")
        assert "GPU 1: critical Xid 79 cleared" in cleared.stdout
        wait_for(lambda: all(g["healthy"] for g in gpus(again)))
        # GPU 1 kept its instances through the fault: the desired layout holds.
        assert again.gpuctl("mig", "assert", *mig, check=False).returncode == 0
    finally:
        stop_daemon(again)
