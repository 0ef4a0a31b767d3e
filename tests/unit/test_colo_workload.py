"""The training workload model of the simulated node (tools/colo_workload.py) leaves when gpud
evicts it, as a job that checkpoints and exits does, so that its process gives back the
memory the eviction was for."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpud.client.colo import Throttle
from gpud.v1 import colo_pb2, colo_pb2_grpc
from tools.colo_workload import EX_TEMPFAIL, Evicted, training

REPO = Path(__file__).resolve().parents[2]
REASON = "GPU 0 memory 78000 MiB over its limit 77000 MiB: evict the newest training job"


class Evicts(colo_pb2_grpc.ColocationServicer):
    """A co-location loop that answers each throttle point with an eviction."""

    def __init__(self) -> None:
        self.points = 0

    def ThrottlePoint(
        self, request: colo_pb2.ThrottlePointRequest, context: Any
    ) -> colo_pb2.ThrottlePointResponse:
        self.points += 1
        return colo_pb2.ThrottlePointResponse(duty=0.01, evict=True, reason=REASON)


@pytest.fixture
def evicting_gpud(tmp_path: Path) -> Iterator[tuple[Path, Evicts]]:
    socket = tmp_path / "g.sock"
    loop = Evicts()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    colo_pb2_grpc.add_ColocationServicer_to_server(loop, server)
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    try:
        yield socket, loop
    finally:
        server.stop(grace=None)


def test_an_evicted_training_workload_exits_and_says_why(
    evicting_gpud: tuple[Path, Evicts],
) -> None:
    socket, loop = evicting_gpud
    env = {**os.environ, "GPUD_SOCKET": str(socket), "GPUD_JOB": "train-a"}
    # without the eviction it would iterate the whole 30 s and exit 0
    args = ["training", "--iteration-s", "0.01", "--seconds", "30"]
    done = subprocess.run(
        [sys.executable, "-m", "tools.colo_workload", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == EX_TEMPFAIL, done.stderr
    assert f"evicted by gpud: {REASON}; leaving" in done.stderr
    assert loop.points == 1


def test_training_leaves_at_the_throttle_point_that_brings_the_eviction() -> None:
    answers = iter([(0.5, False, "guard of chat: p99 over SLO"), (0.01, True, REASON)])
    throttle = Throttle(
        "train-a", report_every_s=0.0, sleep=lambda _: None, call=lambda *_: next(answers)
    )
    iterations: list[float] = []
    ticks = itertools.count(step=0.01)  # without the eviction it would end after 1000 calls

    with pytest.raises(Evicted, match="evict the newest training job"):
        training(
            0.05,
            0.8,
            10.0,
            throttle_point=throttle.point,
            directive=lambda: (throttle.duty, throttle.evict, throttle.reason),
            neighbours=lambda: 0.0,
            sleep=iterations.append,
            clock=lambda: next(ticks),
        )
    assert iterations == [0.05, 0.05]  # the iteration told to throttle, then the evicted one
