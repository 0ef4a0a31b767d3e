"""``gpuctl net``: jobs' network priorities, tags and counters; progress reports.

::

    gpuctl net show                       # jobs, levels, interfaces (table)
    gpuctl net show --json
    gpuctl net report --job train-a --iterations 1200 [--timestamp UNIX] [--ideal 0.35]
    gpuctl net pin --job train-a --level 0
    gpuctl net unpin --job train-a

``report`` is for shell-driven jobs and tests (Python jobs use ``gpud.client.Progress``);
its timestamp defaults to now. A bad report (unknown job, iterations going backwards, a
timestamp in the future) exits non-zero with the reason and changes nothing. With gpud's
``traffic.enabled = false``, ``report``, ``pin`` and ``unpin`` are refused (exit 6): nothing
would act on them; a ``pin`` or ``unpin`` of an unknown job is still exit 4 (not found).
"""

from __future__ import annotations

import argparse
import sys
import time

from gpud.cli.context import (
    JOB_NAME,
    UINT32,
    UINT64,
    Context,
    Subparsers,
    described,
    given,
    number,
)
from gpud.cli.output import NA, cell_first_few, seconds
from gpud.errors import InvalidArgument
from gpud.shared import MAX_IDEAL_S, MAX_SESSION_CHARS, MIN_IDEAL_S, check_text
from gpud.v1 import net_pb2 as pb
from gpud.v1 import net_pb2_grpc as pb_grpc

JOB_HEADERS = (
    "JOB",
    "DSCP",
    "LEVEL",
    "STATE",
    "PROGRESS",
    "ITER",
    "ITER TIME",
    "REPORT AGE",
    "SENT",
    "PKTS",
    "DROPS",
)
LEVEL_HEADERS = ("LEVEL", "MIN SHARE", "JOBS", "SENT", "PKTS", "DROPS")
IFACE_HEADERS = ("INTERFACE", "RATE", "ENFORCED", "REPAIRS", "ERROR")
# a level's jobs in the table: this many by name, the rest counted (each job's row gives its
# level, and --json lists them all), so that a crowded level does not widen every row
LEVEL_JOBS_SHOWN = 8
# a job in use without a DSCP tag (traffic.dscp_pool is in use): its row's flag
NO_TAG = "no tag"

# ``--level``: gpud checks it against ``traffic.levels``; here, what a level is
_level = described(UINT32, "a level: 0 (the highest priority) up to traffic.levels - 1")
# ``--timestamp``: NaN, infinities and times before 1970 refused here, naming the flag,
# rather than by gpud naming the API field; gpud holds it to its own clock (not in the future)
_timestamp = described(
    number(0, sys.float_info.max, above=True), "unix seconds: a finite number over 0"
)


def register(subparsers: Subparsers) -> None:
    net = subparsers.add_parser(
        "net", help="network priorities, DSCP tags, progress reports (default: show)"
    )
    net.set_defaults(run=run_show)
    commands = net.add_subparsers(dest="net_command", metavar="COMMAND")
    show = commands.add_parser("show", help="jobs, levels, interfaces and counters")
    show.set_defaults(run=run_show)
    report = commands.add_parser("report", help="report a job's completed iterations")
    report.add_argument("--job", required=True, type=JOB_NAME, metavar="NAME")
    report.add_argument("--iterations", required=True, type=UINT64, metavar="N")
    report.add_argument("--timestamp", type=_timestamp, metavar="UNIX", help="default: now")
    # the range ReportProgress takes
    report.add_argument(
        "--ideal",
        type=number(MIN_IDEAL_S, MAX_IDEAL_S),
        metavar="SECONDS",
        help=f"contention-free iteration time, {MIN_IDEAL_S:g} to {MAX_IDEAL_S:g}",
    )
    report.add_argument(
        "--session",
        type=_session,
        help=f"a restarted job's new session id (up to {MAX_SESSION_CHARS} printable characters)",
    )
    report.set_defaults(run=run_report)
    pin = commands.add_parser("pin", help="fix a job's level (0 = highest priority)")
    pin.add_argument("--job", required=True, type=JOB_NAME, metavar="NAME")
    pin.add_argument("--level", required=True, type=_level, metavar="LEVEL")
    pin.set_defaults(run=run_pin)
    unpin = commands.add_parser("unpin", help="give a job's level back to the policy")
    unpin.add_argument("--job", required=True, type=JOB_NAME, metavar="NAME")
    unpin.set_defaults(run=run_pin, level=None)


def _bytes(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s" if bps else NA


def _pool_refusal(job: pb.NetJob) -> str:
    """Why ``job`` has no tag, without its name: the pool's refusal, the same for each job."""
    return job.error.removeprefix("no DSCP tag: ").removeprefix(f"job {job.job!r}: ")


def _state(job: pb.NetJob) -> str:
    """A job's STATE: ended (its last run ended, none runs now) and how long ago, stopped
    (no progress for over the gap limit) and for how long, or running; unknown before its
    first progress report."""
    if job.HasField("ended_seconds"):
        return f"ended {seconds(job.ended_seconds)} ago"
    if job.HasField("stopped_seconds"):
        return f"stopped {seconds(job.stopped_seconds)}"
    return "running" if job.HasField("iterations") else NA


def _stopped_note(job: pb.NetJob, spacings: float) -> str:
    """Under the table: what a stopped job's level is, and why."""
    why = (
        f"{job.job}: stopped {seconds(job.stopped_seconds)}: no progress for over"
        f" {spacings:g} iterations' time (SIGSTOP, a debugger?)"
    )
    if job.stopped_unranked:
        return (
            f"{why} and no report for traffic.idle_after_s: holds no level (its traffic is in"
            " the default class) until it reports progress"
        )
    if job.HasField("pinned_level"):
        return f"{why}: keeps its pinned level"
    return f"{why}: its progress rate is held where the stop began"


def _shaped_nothing(resp: pb.ShowNetResponse) -> str:
    """What gpud does on a node that shapes no interface."""
    does = ["tags", *(() if resp.marking_off else ("marking",))]
    if resp.rdma_backend != "none":
        does.append("the RDMA map")
    listed = ", ".join(does[:-1]) + f" and {does[-1]}" if len(does) > 1 else does[0]
    return f"interfaces: none (traffic.interfaces is empty): no HTB tree anywhere; {listed} only"


def _marking(resp: pb.ShowNetResponse) -> str:
    """The marking's state: off (a setting), its error, or ok; with how many times gpud's
    table was found removed outside gpud and written again (the restores tell of a
    firewall flushing the ruleset, which the marking being ok now does not)."""
    if resp.marking_off:
        return "off (traffic.marking = false)"
    restores = f" (restores: {resp.marking_restores})" if resp.marking_restores else ""
    return (resp.marking_error or "ok") + restores


def run_show(ctx: Context, args: argparse.Namespace) -> int:
    resp: pb.ShowNetResponse = ctx.call(ctx.stub(pb_grpc.NetStub).ShowNet, pb.ShowNetRequest())
    if ctx.out.json:
        ctx.out.print_json(resp)
        return 0
    if not resp.enabled:
        ctx.out.print("traffic enforcement is off (set [traffic] enabled = true in gpud.toml)")
        return 0
    rows = []
    untagged = [j for j in resp.jobs if j.error]
    clamped = [j for j in resp.jobs if j.HasField("pinned_level_clamped_from")]
    for j in resp.jobs:
        progress = (
            _state(j),
            f"{j.progress_rate:.2f}" if j.HasField("progress_rate") else NA,
            str(j.iterations) if j.HasField("iterations") else NA,
            seconds(j.iteration_s) if j.HasField("iteration_s") else NA,
            seconds(j.last_report_age_seconds) if j.HasField("last_report_age_seconds") else NA,
        )
        if j.error:  # in use without a tag (why: once under the table); no class of its own
            rows.append((j.job, NA, f"default ({NO_TAG})", *progress, NA, NA, NA))
            continue
        level = str(j.level) if j.HasField("level") else "default"
        if j.HasField("pinned_level_clamped_from"):
            level += f" (pinned {j.pinned_level_clamped_from}, clamped)"
        elif j.HasField("pinned_level"):
            level += " (pinned)"
        counters = (_bytes(j.counters.bytes), str(j.counters.packets), str(j.counters.drops))
        rows.append((j.job, str(j.dscp), level, *progress, *counters))
    ctx.out.print_table(JOB_HEADERS, rows)
    for j in resp.jobs:
        if j.HasField("stopped_seconds"):
            ctx.out.print(_stopped_note(j, resp.stop_after_spacings))
    if untagged:
        ctx.out.print(
            f"{NO_TAG}: {len(untagged)} job(s) in use hold no DSCP tag (their traffic is in"
            f" the default class until a tag frees): {_pool_refusal(untagged[0])}"
        )
    if resp.idle_untagged_jobs:
        ctx.out.print(
            f"{resp.idle_untagged_jobs} idle job(s) hold no tag (gpuctl jobs ls lists them):"
            " not shown, each takes one when it runs"
        )
    for j in clamped:
        ctx.out.print(
            f"{j.job}: pinned to level {j.pinned_level_clamped_from}, beyond traffic.levels ="
            f" {len(resp.levels)}: held at level {j.pinned_level} until traffic.levels is"
            " raised again (gpuctl net pin replaces it)"
        )
    ctx.out.print()
    ctx.out.print_table(
        LEVEL_HEADERS,
        [
            (
                str(lv.level),
                f"{lv.min_share:.0%}",
                cell_first_few(lv.jobs, LEVEL_JOBS_SHOWN),
                _bytes(lv.counters.bytes),
                str(lv.counters.packets),
                str(lv.counters.drops),
            )
            for lv in resp.levels
        ],
    )
    ctx.out.print()
    if resp.interfaces:
        ctx.out.print_table(
            IFACE_HEADERS,
            [
                (
                    i.name,
                    _rate(i.rate_bits_per_second),
                    "yes" if i.enforced else "no",
                    str(i.repairs),
                    i.error or NA,
                )
                for i in resp.interfaces
            ],
        )
    else:  # a bare header would read as "none enforced yet"
        ctx.out.print(_shaped_nothing(resp))
    ctx.out.print()
    order = resp.order_source + (f" (epoch {resp.epoch})" if resp.epoch else "")
    ctx.out.print(f"order: {order}; level changes: {resp.level_changes_total}")
    ctx.out.print(f"marking by cgroup (nftables): {_marking(resp)}")
    if resp.rdma_backend != "none":
        repairs = f" (repairs: {resp.rdma_repairs})" if resp.rdma_repairs else ""
        ctx.out.print(f"RDMA DSCP map ({resp.rdma_backend}): {resp.rdma_error or 'ok'}{repairs}")
    return 0


_GIVEN_SESSION = given("a session id")


def _session(text: str) -> str:
    """An argparse ``type``: a session as the daemon takes it (:func:`gpud.shared.check_text`),
    so that a bad one is a usage error naming the flag (exit 2), never sent."""
    _GIVEN_SESSION(text)  # an unset variable: not "no new session"
    try:
        return check_text(text, field="", max_len=MAX_SESSION_CHARS)
    except InvalidArgument as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def run_report(ctx: Context, args: argparse.Namespace) -> int:
    request = pb.ReportProgressRequest(
        job=args.job,
        iterations=args.iterations,
        timestamp_unix_seconds=args.timestamp if args.timestamp is not None else time.time(),
        session=args.session or "",
    )
    if args.ideal is not None:
        request.contention_free_iteration_s = args.ideal
    ctx.call(ctx.stub(pb_grpc.NetStub).ReportProgress, request)
    if ctx.out.json:
        ctx.out.print_json({"job": args.job, "iterations": args.iterations, "accepted": True})
    return 0


def run_pin(ctx: Context, args: argparse.Namespace) -> int:
    request = pb.PinLevelRequest(job=args.job)
    if args.level is not None:  # UINT32: never below 0
        request.level = args.level
    resp: pb.PinLevelResponse = ctx.call(ctx.stub(pb_grpc.NetStub).PinLevel, request)
    if ctx.out.json:
        ctx.out.print_json(resp.job)
    else:
        what = f"pinned to level {args.level}" if args.level is not None else "unpinned"
        ctx.out.print(f"job {resp.job.job} (DSCP {resp.job.dscp}) {what}")
    return 0
