"""``gpuctl mps show`` / ``gpuctl mps set``: MPS control daemons and their limits.

::

    gpuctl mps show
    gpuctl mps set --gpu 0 --threads 40 --memory 20GiB
    gpuctl mps set --gpu MIG-5c6e... --clear-memory
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from gpud.cli.context import THREADS_PERCENT, THREADS_RANGE, Context, Subparsers, given, size
from gpud.cli.output import NA, UNKNOWN, cell_first_few, last_seen
from gpud.shared import format_size, mps_unhealthy_wait
from gpud.v1 import mps_pb2 as pb
from gpud.v1 import mps_pb2_grpc as pb_grpc

HEADERS = (
    "DEVICE",
    "PROFILE",
    "UUID",
    "DAEMON",
    "PID",
    "THREADS",
    "MEMORY LIMIT",
    "RESERVED",
    "JOBS",
    "RESTARTS",
)


def register(subparsers: Subparsers) -> None:
    mps = subparsers.add_parser("mps", help="MPS control daemons and their limits (default: show)")
    mps.set_defaults(run=run_show, gpu=None)
    commands = mps.add_subparsers(dest="mps_command", metavar="COMMAND")
    show = commands.add_parser("show", help="every device's daemon and limits")
    device = given("a GPU or MIG device: its UUID, index or GPU:MIG")
    show.add_argument("--gpu", type=device, metavar="UUID|INDEX|GPU:MIG", help="only this device")
    show.set_defaults(run=run_show)
    set_ = commands.add_parser("set", help="set a device's default limits")
    set_.add_argument(
        "--gpu", required=True, type=device, metavar="UUID|INDEX|GPU:MIG", help="the device"
    )
    threads = set_.add_mutually_exclusive_group()
    threads.add_argument(
        "--threads",
        type=THREADS_PERCENT,
        metavar="PERCENT",
        help=f"active thread percentage, {THREADS_RANGE}",
    )
    threads.add_argument("--clear-threads", action="store_true", help="back to 100%%")
    memory = set_.add_mutually_exclusive_group()
    memory.add_argument(
        "--memory", type=size, metavar="SIZE", help="pinned device memory limit, e.g. 20GiB"
    )
    memory.add_argument("--clear-memory", action="store_true", help="no memory limit")
    enable = set_.add_mutually_exclusive_group()
    enable.add_argument(
        "--enable", dest="enabled", action="store_const", const=True, help="run a daemon"
    )
    enable.add_argument(
        "--disable", dest="enabled", action="store_const", const=False, help="stop its daemon"
    )
    set_.set_defaults(run=run_set)


def unhealthy_notes(devices: Iterable[pb.MpsDevice]) -> list[str]:
    """One line per unhealthy GPU under the devices, with why: a reason is a sentence or
    two (a lost GPU's last-seen identity, its XIDs), too long for a table cell."""
    seen: dict[int, str] = {}
    for d in devices:
        if d.gpu_unhealthy:
            seen.setdefault(d.gpu, d.gpu_unhealthy)
    return [f"GPU {gpu} unhealthy: {why}" for gpu, why in sorted(seen.items())]


# jobs named in a device's row; many jobs sharing one GPU under MPS would widen every row
JOBS_SHOWN = 8


def device_row(d: pb.MpsDevice) -> tuple[str, ...]:
    if d.up_unknown:  # a GPU never read: its daemons, if any, run on untouched
        daemon = f"unknown ({d.up_unknown})"
    elif not d.enabled:
        daemon = "off"
    elif d.up:
        # up yet waiting (its limits to be moved, a memory limit to be removed): said too
        daemon = f"up{': ' + d.last_error if d.last_error else ''}"
    else:
        daemon = f"DOWN{': ' + d.last_error if d.last_error else ''}"
    # why: under the table (unhealthy_notes). A daemon gpud passes over for it says so
    # already; one down for another reason (limits waiting to be moved, an earlier daemon
    # that would not stop) is marked, though none runs there either
    if d.gpu_unhealthy and d.last_error != mps_unhealthy_wait(d.gpu):
        daemon += f" (GPU {d.gpu} unhealthy)"
    threads = f"{d.threads_percent}%" if d.HasField("threads_percent") else "100% (default)"
    memory = format_size(d.memory_limit_bytes) if d.HasField("memory_limit_bytes") else "none"
    return (
        f"{d.gpu}:{d.mig}" if d.HasField("mig") else str(d.gpu),
        # a GPU never read (lost or hung since gpud started): its product as an earlier run
        # last read it, as `gpuctl gpus` shows it; unset (or "" from an older gpud) if none did
        last_seen(d.profile, d.HasField("memory_total_bytes")) or UNKNOWN,
        d.uuid or UNKNOWN,
        daemon,
        str(d.pid) if d.HasField("pid") else NA,
        threads,
        # a GPU never read has no known size: not a device of 0 bytes
        f"{memory} of "
        + (format_size(d.memory_total_bytes) if d.HasField("memory_total_bytes") else UNKNOWN),
        format_size(d.reserved_memory_bytes) if d.reserved_memory_bytes else "-",
        cell_first_few(d.jobs, JOBS_SHOWN),
        str(d.restarts),
    )


def run_show(ctx: Context, args: argparse.Namespace) -> int:
    request = pb.ShowMpsRequest()
    if args.gpu is not None:
        request.device = args.gpu
    resp: pb.ShowMpsResponse = ctx.call(ctx.stub(pb_grpc.MpsStub).ShowMps, request)
    if ctx.out.json:
        ctx.out.print_json(resp)
        return 0
    if not resp.mps_enabled:
        ctx.out.print(
            "MPS is off on this node (mps.enabled = false): limits are kept, no daemon runs."
        )
    ctx.out.print_table(HEADERS, [device_row(d) for d in resp.devices])
    _print_notes(ctx, resp.devices)
    return 0


def _print_notes(ctx: Context, devices: Iterable[pb.MpsDevice]) -> None:
    """Under the table: why each GPU under its devices is unhealthy."""
    notes = unhealthy_notes(devices)
    if notes:
        ctx.out.print("")
        for note in notes:
            ctx.out.print(note)


def kept_by_clients(d: pb.MpsDevice) -> str:
    """What a limit change leaves as it was, "" when nothing: the control daemon passes it
    to its running MPS servers (``set_active_thread_percentage PID``,
    ``set_device_pinned_mem_limit PID``), and a server gives it to the clients that connect
    after it; a client already connected keeps the limits it connected with until it exits.
    A server runs only while it has clients."""
    if not d.up or not d.server_pids:
        return ""
    device = f"MIG device {d.gpu}:{d.mig}" if d.HasField("mig") else f"GPU {d.gpu}"
    servers = ", ".join(map(str, d.server_pids))
    plural = "s" if len(d.server_pids) > 1 else ""
    return (
        f"{device} ({d.uuid or UNKNOWN}): the clients of MPS server{plural} {servers} that run"
        " now keep the limits they connected with; the new ones reach clients that connect"
        " from now on"
    )


def run_set(ctx: Context, args: argparse.Namespace) -> int:
    request = pb.SetMpsLimitsRequest(
        device=args.gpu, clear_threads=args.clear_threads, clear_memory=args.clear_memory
    )
    if args.threads is not None:
        request.threads_percent = args.threads
    if args.memory is not None:
        request.memory_limit_bytes = args.memory
    if args.enabled is not None:
        request.enabled = args.enabled
    resp: pb.SetMpsLimitsResponse = ctx.call(ctx.stub(pb_grpc.MpsStub).SetMpsLimits, request)
    # a gpud that predates ``limits_changed``: any limit asked for may have changed one
    changed = (
        resp.limits_changed
        if resp.HasField("limits_changed")
        else any(
            v is not None
            for v in (
                args.threads,
                args.memory,
                args.clear_threads or None,
                args.clear_memory or None,
            )
        )
    )
    kept = kept_by_clients(resp.device) if changed else ""
    if kept:
        ctx.out.note(kept)
    if ctx.out.json:
        ctx.out.print_json(resp)
    else:
        # limits set on a faulty GPU's device are kept for when it answers: say why it doesn't
        ctx.out.print_table(HEADERS, [device_row(resp.device)])
        _print_notes(ctx, [resp.device])
    return 0
