"""``gpuctl status``: is the daemon up, on what, and how fresh is its telemetry."""

from __future__ import annotations

import argparse

from gpud.cli.context import Context, Subparsers
from gpud.cli.output import NA, seconds
from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("status", help="daemon and node summary")
    parser.set_defaults(run=run)


def run(ctx: Context, args: argparse.Namespace) -> int:
    resp: pb.GetStatusResponse = ctx.call(
        ctx.stub(pb_grpc.NodeStub).GetStatus, pb.GetStatusRequest()
    )
    if ctx.out.json:
        ctx.out.print_json(resp)
        return 0
    age = (
        f"{seconds(resp.last_sample_age_seconds)} ago"
        if resp.HasField("last_sample_age_seconds")
        else "none yet"
    )
    if resp.HasField("last_tick_seconds"):
        age += f" (tick took {seconds(resp.last_tick_seconds)})"
    rows = [
        (
            "gpud",
            f"{resp.version} on {resp.hostname}" + (" (simulated node)" if resp.simulated else ""),
        ),
        ("backend", f"{resp.backend}, driver {resp.driver_version or NA}"),
        ("uptime", seconds(resp.uptime_seconds)),
        ("gpus", f"{resp.gpu_count} ({resp.healthy_gpu_count} healthy)"),
        ("last sample", age),
    ]
    width = max(len(k) for k, _ in rows) + 1
    for key, value in rows:
        ctx.out.print(f"{key + ':':<{width}} {value}")
    for line in resp.unhealthy_gpus:
        gpu, _, why = line.partition(": ")
        ctx.out.print(f"{gpu} unhealthy: {why}")
    return 0
