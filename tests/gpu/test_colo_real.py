"""The co-location loop on a real GPU: a CUDA training job and a CUDA inference service
share one GPU under MPS, started with ``gpuctl run``. gpud learns the training's speed alone
from its throttle points and its features from NVML's utilization, then sees the service
join: the training's observed speed beside it, the service's p99 from its latency reports,
the predictor's first errors. Nothing changes MIG mode, compute mode, clocks or power."""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.driver import driver_processes
from tests.integration.conftest import BIN, RunningDaemon, start_daemon, stop_daemon

pytestmark = pytest.mark.gpu

# A training step: bf16 matrix products that keep the SMs busy for some milliseconds, then
# the throttle point, as in a training loop.
TRAIN = """
import torch
from gpud import client
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
while True:
    for _ in range(8):
        b = a @ a
    torch.cuda.synchronize()
    client.throttle_point()
"""

# A service: requests arrive at 200/s (Poisson), each is a small batch of products; its
# latency, counted from its arrival (queueing included), is reported once a second.
SERVE = """
import random, time, torch
from gpud import client
lat = client.Latency()
x = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
y = x @ x  # cuBLAS starts up before the first request
torch.cuda.synchronize()
rng = random.Random(1)
due = time.monotonic()
while True:
    due += rng.expovariate(200.0)
    pause = due - time.monotonic()
    if pause > 0:
        time.sleep(pause)
    for _ in range(4):
        y = x @ x
    torch.cuda.synchronize()
    lat.observe(time.monotonic() - due)
"""


def wait_for(what: str, predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(1.0)


def show(daemon: RunningDaemon) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(daemon.gpuctl("--json", "colo", "show").stdout)
    return data


def placed(daemon: RunningDaemon, job: str) -> dict[str, Any] | None:
    return next((p for p in show(daemon)["placements"] if p["job"] == job), None)


def test_training_beside_a_service_on_a_real_gpu(real_nvml: Any, tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("no CUDA client here (PyTorch is not installed)")
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("nvidia-cuda-mps-control is not installed")
    run_dir = Path(tempfile.mkdtemp(prefix="gpud-colo-", dir="/tmp"))  # short MPS pipe paths
    daemon = start_daemon(
        tmp_path / "g",
        config_text='[mig]\non_start = "report"\n[mps]\nenabled = true\n[colocate]\ntick_s = 1.0\n',
        run_dir=run_dir,
    )
    gpu0 = json.loads(daemon.gpuctl("gpus", "--json").stdout)["gpus"][0]["uuid"]
    procs: list[subprocess.Popen[bytes]] = []

    def run(job: str, script: str) -> None:
        gpuctl = [str(BIN / "gpuctl"), "--socket", str(daemon.socket), "run", "--job", job]
        command = [*gpuctl, "--devices", gpu0, "--memory", "8GiB", "--", sys.executable, "-c"]
        with (tmp_path / f"{job}.log").open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [*command, script],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def alive() -> bool:
        for job, proc in zip(("train", "chat"), procs, strict=False):
            assert proc.poll() is None, (tmp_path / f"{job}.log").read_text()
        return True

    try:
        run("train", TRAIN)
        wait_for("the training placed", lambda: alive() and placed(daemon, "train") is not None, 90)
        time.sleep(10)  # throttle points alone: its speed alone, its features from NVML
        daemon.gpuctl("jobs", "add", "chat", "--kind", "inference", "--slo-p99-ms", "50")
        run("chat", SERVE)

        def shared() -> bool:
            train = placed(daemon, "train")
            guards = [g for g in show(daemon)["guards"] if g["job"] == "chat"]
            return bool(
                alive()
                and train is not None
                and train["observed_speed"] is not None
                and guards
                and guards[0]["p99_ms"] is not None
            )

        wait_for("the training observed beside the service", shared, 120)
        shown = show(daemon)
        print(json.dumps(shown, indent=1))
        print(driver_processes(real_nvml))
        print(daemon.gpuctl("colo", "show").stdout)
        print(daemon.gpuctl("jobs").stdout)
        print(daemon.gpuctl("mps", "show").stdout)
        train = placed(daemon, "train")
        assert train is not None and train["gpu"] == 0
        assert 0.05 < float(train["observed_speed"]) < 1.2, train
        assert int(shown["predictor_samples"]) > 0, shown
        (guard,) = [g for g in shown["guards"] if g["job"] == "chat"]
        assert 0 < float(guard["p99_ms"]) < 10_000, guard
        listed = {j["name"]: j for j in json.loads(daemon.gpuctl("--json", "jobs").stdout)["jobs"]}
        for job in ("train", "chat"):
            found = listed[job]["processes"]
            assert found and found[0]["source"] == "environ", listed[job]
            assert (found[0]["used_memory_bytes"] or 0) > 0, listed[job]
        # The guard at work for half a minute, for the record: over its SLO, it throttles.
        timeline = []
        for _ in range(30):
            (guard,) = [g for g in show(daemon)["guards"] if g["job"] == "chat"]
            timeline.append((guard["p99_ms"], guard["duty"], guard["action"]))
            time.sleep(1.0)
        print("p99 ms, training duty, action:", timeline)
        over = [duty for p99, duty, _ in timeline if p99 is not None and p99 > 50]
        assert not over or min(over) < 1.0, timeline
        text = daemon.metrics()
        assert 'gpud_colo_observed_speed_ratio{job="train"}' in text
        assert 'gpud_colo_guard_p99_latency_seconds{job="chat"}' in text
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # gpuctl forwards it and releases the GPU
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        assert stop_daemon(daemon) == 0
        shutil.rmtree(run_dir, ignore_errors=True)
