"""How a hung GPU affects the others' samples, on a running ``gpud --simulate`` node.

::

    .venv/bin/python -m tools.bench_faults [--interval 1.0] [--call-timeout 5.7] [--hang 5.7]

Two scenarios on eight simulated GPUs, each watched through the API every 0.1 s:

- one GPU's driver calls hang for ``--hang`` seconds: the largest sample age of the other
  seven GPUs while it hangs (target: at most twice the interval), and how long after the
  hang began the hung GPU stopped being reported healthy;
- all eight hang: how long ``GetStatus`` still counted them healthy (reads late together
  keep their GPUs' health up to ``--call-timeout``, as on a host starved of CPU).

Ages are reported as multiples of the interval (the ratio is what the target is about).
Each scenario's figures are printed as it ends. A SIGTERM or SIGINT stops it: gpud stopped,
its directory removed, the scenarios done so far reported, "cut short by SIGNAL", dying by it (128 +
its number).
"""

from __future__ import annotations

import argparse
import math
import time

import grpc

from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc
from tools.simdaemon import cut_short, exit_as, restores_signals, simulated_gpud, stopped_by_signal

GPUS = 8


def slow(stub: pb_grpc.NodeStub, gpu: int, seconds: float) -> None:
    kind = pb.FAULT_KIND_SLOW if seconds else pb.FAULT_KIND_CLEAR
    stub.InjectFault(pb.InjectFaultRequest(gpu=gpu, kind=kind, seconds=seconds), timeout=30)


def wait_all_healthy(stub: pb_grpc.NodeStub) -> None:
    deadline = time.monotonic() + 60
    while stub.GetStatus(pb.GetStatusRequest(), timeout=10).healthy_gpu_count != GPUS:
        if time.monotonic() > deadline:
            raise RuntimeError("the GPUs did not come back healthy")
        time.sleep(0.1)


def one_hung(stub: pb_grpc.NodeStub, hang_s: float) -> tuple[float, float]:
    """(largest age of the other GPUs' samples, seconds until the hung GPU was unhealthy)."""
    wait_all_healthy(stub)
    start = time.monotonic()
    slow(stub, 3, hang_s)
    worst = 0.0
    unhealthy_after: float | None = None
    while time.monotonic() - start < hang_s:
        resp = stub.ListGpus(pb.ListGpusRequest(), timeout=10)
        now = time.monotonic() - start
        for g in resp.gpus:
            if g.index == 3:
                if not g.healthy and unhealthy_after is None:
                    unhealthy_after = now
            else:
                worst = max(worst, g.sample_age_seconds)  # now - when it was read
        time.sleep(0.1)
    slow(stub, 3, 0)
    return worst, float("nan") if unhealthy_after is None else unhealthy_after


def all_hung(stub: pb_grpc.NodeStub, hang_s: float) -> float:
    """Seconds ``GetStatus`` still said every GPU was healthy after all began to hang."""
    wait_all_healthy(stub)
    start = time.monotonic()
    for gpu in range(GPUS):
        slow(stub, gpu, hang_s)
    counted = float("nan")
    while time.monotonic() - start < hang_s:
        if stub.GetStatus(pb.GetStatusRequest(), timeout=10).healthy_gpu_count < GPUS:
            counted = time.monotonic() - start
            break
        time.sleep(0.1)
    for gpu in range(GPUS):
        slow(stub, gpu, 0)
    return counted


@restores_signals
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--call-timeout", type=float, default=5.7)
    parser.add_argument("--hang", type=float, default=5.7)
    args = parser.parse_args(argv)
    config = (
        f"[telemetry]\ninterval_s = {args.interval}\ncall_timeout_s = {args.call_timeout}\n"
        "[daemon]\ntick_s = 1.0\n"
    )
    done = 0
    with (
        stopped_by_signal() as stopped,
        simulated_gpud(f"H100-SXM5-80GB:{GPUS}", config_text=config) as daemon,
        grpc.insecure_channel(f"unix:{daemon.socket}") as channel,
    ):
        print(
            f"interval {args.interval:g} s, call timeout {args.call_timeout:g} s,"
            f" hang {args.hang:g} s",
            flush=True,
        )
        stub = pb_grpc.NodeStub(channel)
        worst, unhealthy_after = one_hung(stub, args.hang)
        print(
            f"one GPU hung: others' largest sample age {worst:.2f} s"
            f" = {worst / args.interval:.2f} x interval (target <= 2)"
        )
        print(
            f"one GPU hung: reported not healthy {unhealthy_after:.2f} s after the hang began",
            flush=True,
        )
        done += 1
        counted = all_hung(stub, args.hang)
        # reads late together keep their GPUs' health up to the call timeout (a starved host)
        took = f"all the {args.hang:g} s hang" if math.isnan(counted) else f"{counted:.2f} s"
        print(f"all {GPUS} hung: status counted them healthy for {took}", flush=True)
        done += 1
    if stopped.by:
        return cut_short(stopped.by, f"{done} of 2 scenarios")
    return 0


if __name__ == "__main__":
    exit_as(main())
