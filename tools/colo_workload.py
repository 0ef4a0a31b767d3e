"""Workload models for ``gpud --simulate`` demos: a training job and an inference service.

::

    python -m tools.colo_workload training [--iteration-s 0.05] [--slowdown 0.8]
    python -m tools.colo_workload inference [--rate 100] [--mu 400] [--slowdown 1.5]

Run them with ``gpuctl run``. The simulated node shows each as a GPU process of its job with
the memory it declared and the SM activity of its kind and duty cycle, or load
(:mod:`gpud.backend.sim.jobmodels`); these programs supply the rest of what a real job
does on a shared GPU:

- ``training`` iterates (a sleep of ``--iteration-s`` stands for the GPU work) and calls
  ``gpud.client.throttle_point()`` after each iteration, so it runs at the duty cycle gpud
  tells it;
- ``inference`` serves ``--rate`` requests/s and reports each request's latency with
  ``gpud.client.Latency``: latencies are drawn from an M/M/1 queue with service rate
  ``--mu``.

The simulated node has no SMs to contend for, so interference is modelled here, and gpud
never sees this model: each second a program reads from gpud (``gpuctl colo show``) which
jobs share its device and at which duty cycle, sums their SM activity ``a`` (the same
activity the simulated node shows for them: a training job's from its share and duty, an
inference service's from its utilization, its load over the service rate it has now,
which it writes each second where its neighbours read it, :func:`activity_file`), and slows
down by ``1 + slowdown * a`` (training: longer iterations; inference: a lower service
rate). Jobs on separate MIG instances do not interfere. Both run until killed (or ``--seconds``); like a CUDA program
they fail (exit 1) once gpud reports their GPU lost. ``training`` leaves at the first throttle
point that brings an eviction, as a job that checkpoints and exits does, freeing the memory its
process holds on the device: it says why on stderr and exits 75 (``EX_TEMPFAIL``: it did not
finish and may run again).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gpud import client
from gpud.backend.sim.jobmodels import sm_activity, utilization

SOCKET = os.environ.get("GPUD_SOCKET", "/run/gpud/gpud.sock")
JOB = os.environ.get("GPUD_JOB", "")
# its MPS share, as gpuctl run sets it: it caps the SMs the job keeps busy
_THREADS = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "")
THREADS = int(_THREADS) if _THREADS.isdigit() else None
# sysexits' "try again later": an evicted job did not finish, and may run again
EX_TEMPFAIL = 75


class GpuLost(Exception):
    """What CUDA reports once the device fell off the bus (Xid 79): the job cannot go on."""


def activity_file(socket: str, job: str) -> Path:
    """Where an inference service of the node at ``socket`` keeps its SM activity of now."""
    digest = hashlib.sha256(socket.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"colo_workload-{digest}" / f"{job}.activity"


def publish_activity(socket: str, job: str, activity: float) -> None:
    path = activity_file(socket, job)
    try:
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}")
        tmp.write_text(f"{activity:.4f}")
        tmp.replace(path)
    except OSError:
        pass  # its neighbours take it as busy all the time


def unpublish_activity(socket: str, job: str) -> None:
    path = activity_file(socket, job)
    with contextlib.suppress(OSError):
        path.unlink()
        path.parent.rmdir()  # the last service of the node


def published_activity(socket: str, job: str) -> float:
    """An inference neighbour's SM activity; its full-load one until it said."""
    try:
        return float(activity_file(socket, job).read_text())
    except (OSError, ValueError):
        return sm_activity("inference")


def neighbour_activity(socket: str, job: str) -> float:
    """The SM activity of the other jobs on this job's device, as gpud places them; raises
    :class:`GpuLost` when gpud reports its GPU lost."""
    import grpc

    from gpud.v1 import colo_pb2, colo_pb2_grpc, node_pb2, node_pb2_grpc

    with grpc.insecure_channel(f"unix://{socket}") as ch:
        resp = colo_pb2_grpc.ColocationStub(ch).ShowColo(colo_pb2.ShowColoRequest(), timeout=1.0)
        mine = next((p for p in resp.placements if p.job == job), None)
        if mine is None:
            return 0.0  # not placed yet
        gpus = node_pb2_grpc.NodeStub(ch).ListGpus(node_pb2.ListGpusRequest(), timeout=1.0)
    for g in gpus.gpus:
        if g.index == mine.gpu and not g.healthy and "lost" in g.reason.lower():
            raise GpuLost(f"GPU {g.index}: {g.reason}")
    if mine.HasField("mig_profile"):
        return 0.0  # a MIG instance of its own
    return sum(
        sm_activity(p.kind, p.duty, round(p.sm_share * 100))
        if p.kind == "training"
        else published_activity(socket, p.job)
        for p in resp.placements
        if p.job != job and p.gpu == mine.gpu and not p.HasField("mig_profile")
    )


class Neighbours:
    """:func:`neighbour_activity`, read at most once a second; the last reading while gpud
    is away."""

    def __init__(self) -> None:
        self.activity = 0.0
        self._at = float("-inf")

    def read(self) -> float:
        now = time.monotonic()
        if now - self._at >= 1.0:
            self._at = now
            try:
                self.activity = neighbour_activity(SOCKET, JOB)
            except GpuLost:
                raise
            except Exception:  # gpud away: keep the last reading
                pass
        return self.activity


class Evicted(Exception):
    """gpud evicted the training job (an SLO guard or its GPU's memory): it leaves, as a job
    that checkpoints and exits does, and so gives back the memory its process holds."""


def training(
    iteration_s: float,
    slowdown: float,
    seconds: float,
    *,
    throttle_point: Callable[[], float] = client.throttle_point,
    directive: Callable[[], tuple[float, bool, str]] = client.directive,
    neighbours: Callable[[], float] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Iterate until ``seconds`` have passed; raises :class:`Evicted` at the first
    throttle point whose directive evicts the job."""
    busy = neighbours or Neighbours().read
    end = clock() + seconds
    while clock() < end:
        sleep(iteration_s * (1.0 + slowdown * busy()))
        throttle_point()
        _, evict, reason = directive()
        # its process holds the GPU memory until it exits: going on at duty 0.01 would keep
        # what the eviction was for
        if evict:
            raise Evicted(reason)


def inference(rate: float, mu: float, slowdown: float, seconds: float) -> None:
    lat = client.Latency()
    rng = random.Random(1)
    end = time.monotonic() + seconds
    neighbours = Neighbours()
    # gpuctl run forwards SIGTERM: leave as a served process would, its activity file too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while time.monotonic() < end:
            mu_eff = mu / (1.0 + slowdown * neighbours.read())
            # what the simulated node shows for it, for its neighbours' model
            busy = utilization(rate, mu_eff)
            publish_activity(SOCKET, JOB, sm_activity("inference", 1.0, THREADS, busy))
            spare = max(mu_eff - rate, 1.0)
            for _ in range(int(rate)):
                lat.observe(rng.expovariate(spare))
            lat.flush()
            time.sleep(1.0)
    finally:
        unpublish_activity(SOCKET, JOB)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="kind", required=True)
    t = sub.add_parser("training")
    t.add_argument("--iteration-s", type=float, default=0.05)
    t.add_argument("--slowdown", type=float, default=0.8, help="time added per unit of activity")
    t.add_argument("--seconds", type=float, default=3600.0)
    i = sub.add_parser("inference")
    i.add_argument("--rate", type=float, default=100.0, help="requests/s")
    i.add_argument("--mu", type=float, default=400.0, help="service rate alone, requests/s")
    i.add_argument("--slowdown", type=float, default=1.5, help="rate loss per unit of activity")
    i.add_argument("--seconds", type=float, default=3600.0)
    args = ap.parse_args()
    try:
        if args.kind == "training":
            training(args.iteration_s, args.slowdown, args.seconds)
        else:
            inference(args.rate, args.mu, args.slowdown, args.seconds)
    except GpuLost as err:
        print(f"colo_workload: CUDA error: {err}", file=sys.stderr)
        return 1
    except Evicted as err:
        print(f"colo_workload: evicted by gpud: {err}; leaving", file=sys.stderr)
        return EX_TEMPFAIL
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
