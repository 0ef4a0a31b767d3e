"""Co-location end to end, as an operator sees it: a real gpud on a simulated node, a
training job and an inference service started with ``gpuctl run`` (the workload models of
tools/colo_workload.py), the simulated node showing their processes, the SLO guard and the
interference predictor at work, metrics through promtool, a lost GPU and a daemon killed
with SIGKILL."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import BIN, RunningDaemon, start_daemon, stop_daemon

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def wait_for(predicate: Callable[[], object], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError("condition not reached in time")


def show(daemon: RunningDaemon) -> dict[str, object]:
    data: dict[str, object] = json.loads(daemon.gpuctl("--json", "colo", "show").stdout)
    return data


def placement(daemon: RunningDaemon, job: str) -> dict[str, object] | None:
    found = [p for p in show(daemon)["placements"] if p["job"] == job]  # type: ignore[attr-defined]
    return found[0] if found else None


class Jobs:
    """``gpuctl run`` processes started by the test, ended by it whatever happens."""

    def __init__(self, daemon: RunningDaemon, logs: Path) -> None:
        self.daemon = daemon
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def run(self, job: str, *args: str) -> subprocess.Popen[bytes]:
        with (self.logs / f"{job}.log").open("wb") as log:
            proc = subprocess.Popen(
                [BIN / "gpuctl", "--socket", self.daemon.socket, "run", "--job", job, *args],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # gpuctl forwards it to the workload
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[RunningDaemon, Jobs]]:
    daemon = start_daemon(
        tmp_path / "g", "--simulate", "H100-SXM5-80GB:2", config_text="[colocate]\ntick_s = 1.0\n"
    )
    jobs = Jobs(daemon, tmp_path)
    try:
        yield daemon, jobs
    finally:
        jobs.stop()
        stop_daemon(daemon)


def test_colocation_end_to_end_on_a_simulated_node(
    node: tuple[RunningDaemon, Jobs], tmp_path: Path
) -> None:
    daemon, jobs = node
    gpus = json.loads(daemon.gpuctl("gpus", "--json").stdout)["gpus"]
    gpu0 = gpus[0]["uuid"]
    workload = [sys.executable, "-m", "tools.colo_workload"]
    train = jobs.run("train-a", "--devices", gpu0, "--", *workload, "training", "--seconds", "300")

    # The simulated node shows the training's process: its memory, its SMs busy, its input
    # batches coming in over PCIe (2 GB/s by the model).
    def training_on_gpu0() -> bool:
        g = json.loads(daemon.gpuctl("gpus", "--json").stdout)["gpus"][0]
        return bool(
            g["memory"]["used_bytes"] >= 16 * GIB
            and g["utilization"]["gpu_ratio"] > 0.8
            and g["pcie"]["rx_bytes_per_second"] > 1.9e9
        )

    wait_for(training_on_gpu0)
    listed = json.loads(daemon.gpuctl("--json", "jobs", "ls", "train-a").stdout)["jobs"][0]
    assert [p["used_memory_bytes"] for p in listed["processes"]] == [16 * GIB]
    time.sleep(6)  # a few of its reports alone: its rate alone is what slowdown is taken over

    daemon.gpuctl("jobs", "add", "chat", "--kind", "inference", "--slo-p99-ms", "50")
    chat = jobs.run("chat", "--devices", gpu0, "--", *workload, "inference", "--seconds", "300")

    def observed() -> bool:
        p = placement(daemon, "train-a")
        return p is not None and p["observed_speed"] is not None

    wait_for(observed, timeout=90)
    shown = show(daemon)
    train_view = placement(daemon, "train-a")
    assert train_view is not None
    speed = float(train_view["observed_speed"])  # type: ignore[arg-type]
    # the workload model slows training by 1 / (1 + 0.8 * a) next to the service, whose
    # activity a is 0.7 of the device at full load times its utilization (100 requests/s
    # at a rate of 400 / (1 + 1.5 * 0.9) = 170 next to unthrottled training: 0.41), 0.75
    assert 0.6 < speed < 0.95, shown
    assert int(shown["predictor_samples"]) > 0  # type: ignore[call-overload]
    (guard,) = shown["guards"]  # type: ignore[misc]
    assert guard["job"] == "chat" and guard["gpu"] == 0 and guard["p99_ms"] is not None

    # gpuctl jobs explains the same, per job; and the tables pipe into head.
    listed = {j["name"]: j for j in json.loads(daemon.gpuctl("--json", "jobs").stdout)["jobs"]}
    assert listed["train-a"]["colo"]["gpu"] == 0
    assert listed["chat"]["colo"]["guard"]["slo_ms"] == 50
    for command in ("colo show", "jobs"):
        piped = subprocess.run(
            f"'{BIN / 'gpuctl'}' --socket '{daemon.socket}' {command} | head -1",
            shell=True,
            capture_output=True,
            text=True,
            check=False,
        )
        assert piped.returncode == 0 and piped.stderr == "" and piped.stdout.startswith("JOB")

    text = daemon.metrics()
    assert 'gpud_colo_observed_speed_ratio{job="train-a"}' in text
    assert 'gpud_colo_guard_p99_latency_seconds{job="chat"}' in text
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (Debian package prometheus)"
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr

    # GPU 0 falls off the bus: its jobs fail as CUDA programs would, gpuctl releases them,
    # and co-location has nothing left there; GPU 1 is untouched.
    daemon.gpuctl("sim", "fault", "--gpu", "0", "lost")
    assert train.wait(timeout=60) == 1 and chat.wait(timeout=60) == 1
    wait_for(lambda: not show(daemon)["placements"])
    advice = json.loads(daemon.gpuctl("--json", "colo", "advise", "next").stdout)
    assert advice["gpu"] == 1

    # SIGKILL and restart: the fault stays with GPU 0.
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(timeout=10)
    if daemon.notify is not None:
        daemon.notify.close()
    again = start_daemon(
        daemon.root, "--simulate", "H100-SXM5-80GB:2", config_text="[colocate]\ntick_s = 1.0\n"
    )
    jobs.daemon = again
    try:
        gpus = json.loads(again.gpuctl("gpus", "--json").stdout)["gpus"]
        assert gpus[0]["healthy"] is False and "lost" in gpus[0]["reason"].lower()
        assert gpus[1]["healthy"] is True
    finally:
        stop_daemon(again)


MIG_LAYOUT = """version: v1
mig-configs:
  split:
    - devices: [1]
      mig-enabled: true
      mig-devices:
        "1g.10gb": 2
        "3g.40gb": 1
    - devices: [0]
      mig-enabled: false
"""


def test_a_tight_slo_service_gets_a_mig_instance_from_gpuctl_run(
    node: tuple[RunningDaemon, Jobs], tmp_path: Path
) -> None:
    daemon, jobs = node
    layout = tmp_path / "mig.yaml"
    layout.write_text(MIG_LAYOUT)
    daemon.gpuctl("mig", "apply", "-f", str(layout), "-c", "split")
    workload = [sys.executable, "-m", "tools.colo_workload"]
    jobs.run("train-a", "--", *workload, "training", "--seconds", "300")
    wait_for(lambda: placement(daemon, "train-a") is not None)
    train_view = placement(daemon, "train-a")
    assert train_view is not None and train_view["gpu"] == 0  # a whole GPU, not the MIG one

    daemon.gpuctl(
        "jobs", "add", "chat", "--kind", "inference", "--slo-p99-ms", "20", "--memory", "6GiB"
    )
    chat = jobs.run("chat", "--", *workload, "inference", "--seconds", "300")
    wait_for(lambda: placement(daemon, "chat") is not None)
    chat_view = placement(daemon, "chat")
    assert chat_view is not None
    assert chat_view["gpu"] == 1 and chat_view["mig_profile"] == "1g.10gb", chat_view
    log = (tmp_path / "chat.log").read_text()
    assert "tight SLO" in log and "MIG instance 1g.10gb on GPU 1" in log, log

    # The simulated node runs the service's process in that instance, with its 6 GiB.
    def on_the_instance() -> bool:
        shown = daemon.gpuctl("mig", "show").stdout
        return "(chat)" in shown and "6.0 / 9.8" in shown

    wait_for(on_the_instance)
    listed = json.loads(daemon.gpuctl("--json", "jobs", "ls", "chat").stdout)["jobs"][0]
    assert listed["colo"]["guard"]["reason"] == "no training on its GPU"
    assert listed["reservations"][0]["devices"][0].startswith("MIG-")
    assert chat.poll() is None


def test_processes_of_no_job_count_in_the_advice(node: tuple[RunningDaemon, Jobs]) -> None:
    """Another user's process (a simulated workload behind a PID no job claims) holds 40 GiB
    and half the SMs of each GPU: no GPU is called free, the advice predicts the slowdown
    beside it, and a job that would not fit beside its memory is not placed."""
    daemon, _ = node
    strangers = [subprocess.Popen(["sleep", "300"]) for _ in range(2)]
    try:
        for gpu, proc in enumerate(strangers):
            daemon.gpuctl(
                "sim", "workload", "start", "--gpu", str(gpu), "--pid", str(proc.pid),
                "--memory", "40GiB", "--sm", "0.5",
            )  # fmt: skip

        def advice(memory: str) -> dict[str, object]:
            out = daemon.gpuctl("--json", "colo", "advise", "x", "--memory", memory).stdout
            data: dict[str, object] = json.loads(out)
            return data

        wait_for(lambda: "does not know" in str(advice("30GiB").get("reason")))
        fits = advice("30GiB")
        assert float(fits["predicted_speed"]) < 0.9, fits  # type: ignore[arg-type]
        too_big = advice("50GiB")
        assert too_big["gpu"] == -1 and "memory" in str(too_big["reason"]), too_big
        assert show(daemon)["unattributed_processes"] == {"0": 1, "1": 1}
        shown = daemon.gpuctl("colo", "show").stdout
        assert "processes of no job (their memory held, their GPU never free): GPU 0: 1" in shown
    finally:
        for proc in strangers:
            daemon.gpuctl("sim", "workload", "stop", "--pid", str(proc.pid), check=False)
            proc.kill()
            proc.wait()


def test_memory_the_driver_does_not_report_per_process_is_counted_once(
    node: tuple[RunningDaemon, Jobs],
) -> None:
    """Where NVML gives no per-process memory (``usedGpuMemory`` not available), a job's
    use is its reservation, not its reservation and again memory held by someone else: a
    30 GiB job still fits beside another 30 GiB job on an 80 GiB GPU."""
    daemon, jobs = node
    gpus = json.loads(daemon.gpuctl("gpus", "--json").stdout)["gpus"]
    for g in gpus:
        daemon.gpuctl("sim", "fault", "--gpu", str(g["index"]), "not-supported", "process_memory")
    for g in gpus:
        jobs.run(
            f"on{g['index']}", "--kind", "inference", "--devices", g["uuid"], "--memory", "30GiB",
            "--", "sleep", "300",
        )  # fmt: skip

    def listed() -> bool:
        out = json.loads(daemon.gpuctl("--json", "jobs", "ls").stdout)["jobs"]
        procs = [p for j in out for p in j["processes"]]
        return len(procs) == 2 and all(p["used_memory_bytes"] is None for p in procs)

    wait_for(listed)
    wait_for(
        lambda: all(
            g["memory"]["used_bytes"] >= 30 * GIB
            for g in json.loads(daemon.gpuctl("gpus", "--json").stdout)["gpus"]
        )
    )
    out = daemon.gpuctl("--json", "colo", "advise", "x", "--memory", "30GiB").stdout
    advice = json.loads(out)
    assert advice["gpu"] in (0, 1), advice["reason"]
    assert show(daemon)["unattributed_processes"] == {}


def test_gpuctl_run_waits_for_co_location_and_starts_when_room_comes(
    node: tuple[RunningDaemon, Jobs], tmp_path: Path
) -> None:
    """Both GPUs hold a 60 GiB job: a 30 GiB job fits beside neither, so `gpuctl run` of a
    job that names no place waits, saying why, and starts once a GPU has room."""
    daemon, jobs = node
    big = [jobs.run(f"big{i}", "--memory", "60GiB", "--", "sleep", "300") for i in range(2)]
    wait_for(lambda: len(show(daemon)["placements"]) == 2)  # type: ignore[arg-type]
    marker = tmp_path / "ran"
    small = jobs.run("small", "--memory", "30GiB", "--", "touch", str(marker))
    log = tmp_path / "small.log"
    wait_for(lambda: "waiting for co-location: GPU 0: memory" in log.read_text())
    time.sleep(2)
    assert small.poll() is None and not marker.exists()
    # Operators see who waits, and why.
    (waiter,) = show(daemon)["waiting"]  # type: ignore[misc]
    assert waiter["job"] == "small" and "memory" in waiter["reason"], waiter
    assert "waiting for a GPU (gpuctl run): small for " in daemon.gpuctl("colo", "show").stdout
    # ... and `gpuctl queue`, where operators look for whatever waits, says it too.
    queued = daemon.gpuctl("queue").stdout
    (beside,) = json.loads(daemon.gpuctl("queue", "--json").stdout)["colo_waiting"]
    assert beside["job"] == "small" and "memory" in beside["reason"], beside
    assert beside["waiting_on"] == "co-location" and beside["since_unix_seconds"] > 0
    assert f" {beside['id']}  small " in queued and "co-location: GPU 0: memory" in queued
    big[0].send_signal(signal.SIGTERM)  # gpuctl forwards it; the reservation goes
    wait_for(lambda: small.poll() is not None)
    assert small.returncode == 0 and marker.exists()
    assert "small on GPU" in log.read_text()
