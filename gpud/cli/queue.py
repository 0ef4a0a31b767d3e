"""``gpuctl queue``: the node's admission queue.

::

    gpuctl queue [ls]            position, id, job, user (of its waiting gpuctl run),
                                 request, time waited, quote; unfeasible
                                 last; then the runs waiting for co-location (outside the
                                 queue: no position, no quote), with their ids
    gpuctl queue --explain       and per request class: k_eff per resource, the binding one,
                                 arrival rate, service time, utilisation, packing
                                 efficiency, mean wait; under it, the GPUs each class's
                                 k_eff left out (lost, hung, held by a MIG apply)
    gpuctl queue --leave ID      take a queued entry, or a run waiting for co-location, out
                                 (one that started already is refused, exit 6: it runs on)
    gpuctl queue --json
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from gpud.cli.context import EXIT_USAGE, CliError, Context, Subparsers, given
from gpud.cli.output import message_to_dict, seconds
from gpud.errors import ERROR_TABLE, FailedPrecondition
from gpud.shared import WAITING_ON_COLOCATION, started_not_left
from gpud.v1 import colo_pb2, colo_pb2_grpc
from gpud.v1 import queue_pb2 as pb
from gpud.v1 import queue_pb2_grpc as pb_grpc

HEADERS = ("POS", "ID", "JOB", "USER", "REQUEST", "WAITED", "QUOTE", "WHY NOT")
CLASS_HEADERS = (
    "REQUEST",
    "K_EFF",
    "K PER RESOURCE",
    "BINDING",
    "RUNS",
    "ARRIVALS/H",
    "MEAN SERVICE",
    "CV2",
    "RHO",
    "PACKING",
    "MEAN WAIT",
)


def register(subparsers: Subparsers) -> None:
    queue = subparsers.add_parser("queue", help="the admission queue: positions and quotes")
    queue.add_argument(
        "--explain", action="store_true", help="the queueing model of each request class"
    )
    add_leave(queue, default=None)
    queue.set_defaults(run=run_queue, queue_command=None)
    # `gpuctl queue ls`, as `gpuctl jobs ls`: the listing, which plain `gpuctl queue` shows
    commands = queue.add_subparsers(dest="queue_command", metavar="COMMAND")
    ls = commands.add_parser("ls", help="the queue's entries (the default)")
    ls.add_argument(
        "--explain",
        action="store_true",
        default=argparse.SUPPRESS,  # given before `ls`, it holds
        help="the queueing model of each request class",
    )
    # given after `ls` too, so that either order is refused alike (run_queue), not as an
    # unrecognized argument
    add_leave(ls, default=argparse.SUPPRESS)
    ls.set_defaults(run=run_queue)


def add_leave(parser: argparse.ArgumentParser, *, default: object) -> None:
    parser.add_argument(
        "--leave",
        type=given("an entry id (gpuctl queue lists them)"),
        default=default,
        metavar="ID",
        help="take this entry out of the queue, or this run out of its wait for co-location",
    )


def quote_text(entry: pb.QueueEntry) -> str:
    if entry.unfeasible_reason:
        return "never"
    if entry.unbounded:
        return "unbounded"
    if entry.overdue:
        return "overdue"
    if entry.unhealthy:  # WHY NOT names the GPUs it waits for
        return "no quote"
    if entry.HasField("quote_seconds"):
        return seconds(entry.quote_seconds)
    return "no history"


def entry_row(e: pb.QueueEntry) -> tuple[str, ...]:
    why = (e.unfeasible_reason + (f" ({e.remedy})" if e.remedy else "")) or e.waiting_on
    if e.overdue:
        late = ", ".join(
            f"{r.job} ran {seconds(r.ran_seconds)}, estimated {seconds(r.estimate_seconds)}"
            for r in e.overdue
        )
        why = f"{why}; past the estimate: {late}" if why else f"past the estimate: {late}"
    return (
        str(e.position) if e.position else "-",
        e.id,
        e.job,
        e.holder_user if e.HasField("holder_uid") else "-",
        e.request,
        seconds(e.waited_seconds),
        quote_text(e),
        why or "-",
    )


def waiter_row(w: colo_pb2.ColoWaiter) -> tuple[str, ...]:
    return (
        "-",
        w.id or "-",  # a gpud that names no waiter ids
        w.job,
        w.holder_user if w.HasField("holder_uid") else "-",
        "-",
        seconds(w.waited_seconds),
        "-",
        f"{WAITING_ON_COLOCATION}: {w.reason}",
    )


def class_row(c: pb.ClassModel) -> tuple[str, ...]:
    if c.unfeasible_reason:
        return (c.request, "0", "-", "-", str(c.history_runs), "-", "-", "-", "-", "-", "never")
    wait = "unbounded" if c.unbounded else "-"
    if c.HasField("quote_seconds"):
        wait = seconds(c.quote_seconds)
    return (
        c.request,
        str(c.k_eff) if c.HasField("k_eff") else "any",
        " ".join(f"{d.name}={d.k}" for d in c.dimensions) or "-",
        c.binding or "-",
        str(c.history_runs),
        f"{c.arrival_rate_per_second * 3600:.2f}",
        seconds(c.mean_service_seconds) if c.mean_service_seconds else "-",
        f"{c.scv_service:.2f}",
        f"{c.utilization:.2f}",
        f"{c.packing_efficiency:.0%}" if c.packing_efficiency else "-",
        wait,
    )


def left_out_lines(classes: Sequence[pb.ClassModel]) -> list[str]:
    """Under ``--explain``'s table: for each class whose K_EFF left GPUs of its pool out
    (they serve no job now), which and why."""
    return [
        f"{c.request}: K_EFF counts the GPUs that answer, leaving out {c.left_out}"
        for c in classes
        if c.left_out
    ]


def run_queue(ctx: Context, args: argparse.Namespace) -> int:
    stub = ctx.stub(pb_grpc.QueueStub)
    if args.leave is not None and args.queue_command == "ls":
        raise CliError("--leave takes an entry out and lists nothing: drop ls", EXIT_USAGE)
    if args.leave is not None:  # an empty ID is an error to report, not the listing
        left: pb.QueueEntry = ctx.call(stub.Leave, pb.LeaveRequest(id=args.leave))
        if left.state == pb.ENTRY_STATE_STARTED:  # a gpud before the one that refuses it
            reservation = left.reservation
            said = started_not_left(left.job, left.id, reservation.id, reservation.devices)
            raise CliError(said, ERROR_TABLE[FailedPrecondition][1])
        if ctx.out.json:
            ctx.out.print_json(left)
        elif left.waiting_on == WAITING_ON_COLOCATION:
            ctx.out.print(f"job {left.job} ({left.id}) left its wait for co-location")
        else:
            ctx.out.print(f"job {left.job} ({left.id}) left the queue")
        return 0
    resp: pb.ListQueueResponse = ctx.call(stub.ListQueue, pb.ListQueueRequest(explain=args.explain))
    colo = colo_waiters(ctx)
    if ctx.out.json:
        doc = message_to_dict(resp)
        doc["colo_waiting"] = [colo_waiter_dict(w) for w in colo]
        ctx.out.print_json(doc)
        return 0
    rows = [entry_row(e) for e in resp.entries] + [waiter_row(w) for w in colo]
    ctx.out.print_table(HEADERS, rows)
    if colo:
        ctx.out.print(
            f"{WAITING_ON_COLOCATION}: runs waiting for the loop to name a GPU, outside "
            "this queue, first come first served (gpuctl colo show); --leave ID takes one out"
        )
    if resp.off:
        ctx.out.print(f"{resp.off}: gpuctl run fails instead of waiting")
    if args.explain:
        ctx.out.print()
        ctx.out.print_table(CLASS_HEADERS, [class_row(c) for c in resp.classes])
        for line in left_out_lines(resp.classes):
            ctx.out.print(line)
    return 0


def colo_waiters(ctx: Context) -> list[colo_pb2.ColoWaiter]:
    """The `gpuctl run`s waiting for the co-location loop to name a GPU, in the order it
    serves them (the order they came). They wait beside the queue, not in it: they have no
    position there, and the queue's order does not hold them. Empty on a gpud whose loop
    does not answer."""
    resp = show_colo(ctx)
    return list(resp.waiting) if resp is not None else []


def colo_waiter_dict(w: colo_pb2.ColoWaiter) -> dict[str, Any]:
    """A run waiting for co-location as ``--json`` lists it, beside the queue's entries."""
    return {**message_to_dict(w), "waiting_on": WAITING_ON_COLOCATION}


def show_colo(ctx: Context) -> colo_pb2.ShowColoResponse | None:
    """``gpuctl colo show``'s answer; None when the co-location loop cannot be asked."""
    try:
        resp: colo_pb2.ShowColoResponse = ctx.call(
            ctx.stub(colo_pb2_grpc.ColocationStub).ShowColo, colo_pb2.ShowColoRequest()
        )
    except CliError:
        return None
    return resp
