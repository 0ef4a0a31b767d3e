"""Workload models behind simulated processes, for ``gpud --simulate`` demos.

::

    python -m tools.colo_workload training [--iteration-s 0.05]
    python -m tools.colo_workload inference [--rate 100] [--mu 400]

``training`` iterates (a sleep stands for the GPU work) and calls
``gpud.client.throttle_point()`` after each iteration, so the duty cycle gpud tells it is
what it runs at. ``inference`` serves ``--rate`` requests/s and reports each request's
latency with ``gpud.client.Latency``: latencies are drawn from an M/M/1 queue whose service
rate ``--mu`` is cut by the training that shares its GPU, in proportion to that training's
duty cycle (read from gpud, ``gpuctl colo show``) -- the simulated node has no real SMs to
contend for, so the interference is modelled here. Both run until killed (or ``--seconds``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import time

from gpud import client


def training(iteration_s: float, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(iteration_s)
        client.throttle_point()


def _neighbour_duty(socket: str, job: str) -> float:
    """Sum of the duty cycles of training jobs on this job's GPU, from gpud."""
    import grpc

    from gpud.v1 import colo_pb2, colo_pb2_grpc

    with grpc.insecure_channel(f"unix://{socket}") as ch:
        resp = colo_pb2_grpc.ColocationStub(ch).ShowColo(colo_pb2.ShowColoRequest(), timeout=1.0)
    mine = [p.gpu for p in resp.placements if p.job == job]
    return sum(
        p.duty for p in resp.placements if p.kind == "training" and mine and p.gpu == mine[0]
    )


def inference(rate: float, mu: float, slowdown: float, seconds: float) -> None:
    job = os.environ.get("GPUD_JOB", "")
    socket = os.environ.get("GPUD_SOCKET", "/run/gpud/gpud.sock")
    lat = client.Latency()
    rng = random.Random(1)
    end = time.monotonic() + seconds
    duty = 0.0
    while time.monotonic() < end:
        with contextlib.suppress(Exception):  # gpud away: keep the last reading
            duty = _neighbour_duty(socket, job)
        mu_eff = mu / (1.0 + slowdown * duty)
        for _ in range(int(rate)):
            spare = max(mu_eff - rate, 1.0)
            lat.observe(rng.expovariate(spare))
        lat.flush()
        time.sleep(1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="kind", required=True)
    t = sub.add_parser("training")
    t.add_argument("--iteration-s", type=float, default=0.05)
    t.add_argument("--seconds", type=float, default=3600.0)
    i = sub.add_parser("inference")
    i.add_argument("--rate", type=float, default=100.0, help="requests/s")
    i.add_argument("--mu", type=float, default=400.0, help="service rate alone, requests/s")
    i.add_argument("--slowdown", type=float, default=1.5, help="rate loss per unit of duty")
    i.add_argument("--seconds", type=float, default=3600.0)
    args = ap.parse_args()
    if args.kind == "training":
        training(args.iteration_s, args.seconds)
    else:
        inference(args.rate, args.mu, args.slowdown, args.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
