"""``gpuctl gpus``: every GPU and MIG device with its latest sample (``nvidia-smi`` style)."""

from __future__ import annotations

import argparse

from gpud.cli.context import Context, Subparsers, gpu_index
from gpud.cli.output import NA, UNKNOWN, gib, last_seen, percent
from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc

HEADERS = ("GPU", "MODEL", "UUID", "HEALTH", "MEM GiB", "UTIL", "POWER", "TEMP", "MIG")


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("gpus", help="GPUs and MIG devices with their latest sample")
    parser.add_argument("--gpu", type=gpu_index, metavar="INDEX", help="only this GPU")
    parser.set_defaults(run=run)


def short_uuid(uuid: str) -> str:
    """ "GPU-8c1b2f3a-..." -> "GPU-8c1b2f3a": enough to tell GPUs apart on one node."""
    prefix, _, rest = uuid.partition("-")
    return f"{prefix}-{rest[:8]}" if rest else uuid[:12]


def mig_mode(gpu: pb.Gpu) -> str:
    if not gpu.HasField("mig_mode"):
        return NA
    current = "on" if gpu.mig_mode.current else "off"
    if gpu.mig_mode.pending != gpu.mig_mode.current:
        pending = "on" if gpu.mig_mode.pending else "off"
        return f"{current} ({pending} after reset)"
    return current


def memory(m: pb.Memory, present: bool) -> str:
    return f"{gib(m.used_bytes)} / {gib(m.total_bytes)}" if present else NA


def model(gpu: pb.Gpu) -> str:
    """gpud's product key; else NVML's name; "?" for a GPU that never answered. A GPU not
    read since gpud started shows what an earlier run last read, marked as such: its
    product key, or its name where that run did not keep the key."""
    shown = gpu.product or gpu.name
    if not shown:
        return UNKNOWN
    # set once the GPU answered in this run (an older gpud sent 0, absent on the wire, else)
    return last_seen(shown, gpu.HasField("memory_total_bytes"))


def gpu_row(gpu: pb.Gpu) -> tuple[str, ...]:
    health = "ok" if gpu.healthy else "UNHEALTHY"
    return (
        str(gpu.index),
        model(gpu),
        short_uuid(gpu.uuid) if gpu.uuid else UNKNOWN,
        health,
        memory(gpu.memory, gpu.HasField("memory")),
        percent(gpu.utilization.gpu_ratio) if gpu.HasField("utilization") else NA,
        f"{gpu.power_watts:.0f} W" if gpu.HasField("power_watts") else NA,
        f"{gpu.temperature_celsius:.0f} C" if gpu.HasField("temperature_celsius") else NA,
        mig_mode(gpu),
    )


def mig_row(dev: pb.MigDevice) -> tuple[str, ...]:
    return (
        f"  {dev.gpu}:{dev.mig}",
        dev.profile_name,
        short_uuid(dev.uuid),
        "",
        memory(dev.memory, dev.HasField("memory")),
        "",
        "",
        "",
        f"gi {dev.gpu_instance_id} ci {dev.compute_instance_id}",
    )


def run(ctx: Context, args: argparse.Namespace) -> int:
    request = pb.ListGpusRequest()
    if args.gpu is not None:
        request.gpu = args.gpu
    resp: pb.ListGpusResponse = ctx.call(ctx.stub(pb_grpc.NodeStub).ListGpus, request)
    if ctx.out.json:
        ctx.out.print_json(resp)
        return 0
    rows: list[tuple[str, ...]] = []
    for gpu in resp.gpus:
        rows.append(gpu_row(gpu))
        rows.extend(mig_row(dev) for dev in gpu.mig_devices)
    ctx.out.print_table(HEADERS, rows)
    # reasons are long driver messages: below the table, so the columns stay readable
    for gpu in resp.gpus:
        if not gpu.healthy:
            ctx.out.print(f"GPU {gpu.index} unhealthy: {gpu.reason or 'unknown reason'}")
    return 0
