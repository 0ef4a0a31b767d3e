"""``gpuctl jobs add/rm/ls``: the job registry.

::

    gpuctl jobs add infer-a --kind inference --mig 3g.40gb --threads 40 --memory 20GiB --slo-p99-ms 25
    gpuctl jobs ls                # also `gpuctl jobs`: with each job's co-location state
    gpuctl jobs rm infer-a [--force]
    gpuctl jobs add train-b --gpus 2 --memory 70GiB --queue   # start it when it fits
    gpuctl jobs history [--limit N] [--json]                  # runs: asked, started, ended, how
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from gpud.cli.asking import Stop, asked_once, enqueued_once
from gpud.cli.context import (
    JOB_NAME,
    THREADS_PERCENT,
    THREADS_RANGE,
    UINT32,
    CliError,
    Context,
    Subparsers,
    given,
    integer,
    size,
    slo_ms,
)
from gpud.cli.output import NA, message_to_dict, seconds
from gpud.cli.queue import colo_waiter_dict, show_colo
from gpud.errors import ERROR_TABLE, AlreadyExists, InvalidArgument
from gpud.shared import (
    MIN_SLO_MS,
    check_owner,
    format_size,
    parse_size,
    user_name,
)
from gpud.v1 import colo_pb2, mps_pb2, mps_pb2_grpc, queue_pb2, queue_pb2_grpc
from gpud.v1 import jobs_pb2 as pb
from gpud.v1 import jobs_pb2_grpc as pb_grpc

EXIT_EXISTS = ERROR_TABLE[AlreadyExists][1]
# how a --devices item names a GPU or MIG device by UUID, as gpud keeps it
UUID_PREFIXES = ("GPU-", "MIG-")
HEADERS = (
    "JOB",
    "KIND",
    "OWNER",
    "USER",
    "PLACEMENT",
    "THREADS",
    "MEMORY",
    "SLO P99",
    "RESERVED ON",
    "GPU MEM USED",
)
# Co-location state per job (``gpuctl colo show`` explains the node as a whole).
COLO_HEADERS = ("COLO ON", "SHARE", "DUTY", "GUARD")
KINDS = ("training", "inference")
GPU_COUNT = integer(1, 2**32 - 1)  # a job asks one GPU at least


def kind_value(name: str | None) -> pb.JobKind.ValueType:
    """``training`` -> ``JOB_KIND_TRAINING``; None -> unspecified (the daemon's default)."""
    return pb.JobKind.Value(f"JOB_KIND_{name.upper()}") if name else pb.JOB_KIND_UNSPECIFIED


def kind_name(value: int) -> str:
    for name in KINDS:
        if kind_value(name) == value:
            return name
    return "?"


_GIVEN_OWNER = given("a user name")


def _owner(text: str) -> str:
    """An argparse ``type``: an owner as the daemon takes it (:func:`gpud.shared.check_owner`),
    so that a bad one is a usage error naming the flag (exit 2) before gpuctl asks gpud
    anything (``gpuctl run`` asks for co-location advice first)."""
    _GIVEN_OWNER(text)  # an unset variable: not "your user name"
    try:
        return check_owner(text, field="")
    except InvalidArgument as err:
        raise argparse.ArgumentTypeError(str(err)) from None


_DEVICES = "devices: indexes (0, 0:1) or UUIDs, comma-separated"


def devices(text: str) -> list[str]:
    """An argparse ``type``: ``--devices``, split on commas, each item without the blanks
    around it (``"0, 1"`` is ``0,1``). A value that names no device at all (``''``, ``,``),
    an unset variable most likely and not "anywhere", is a usage error naming the flag; so
    is an empty item among named ones (``0,,1``, ``0,``: ``"$A,$B"`` with ``B`` unset),
    rather than a job quietly given fewer devices than meant."""
    items = [d.strip() for d in text.split(",")]
    if not any(items):
        raise argparse.ArgumentTypeError(f"give {_DEVICES}, got {text!r}")
    if "" in items:
        where = items.index("") + 1
        raise argparse.ArgumentTypeError(f"item {where} of {text!r} is empty: give {_DEVICES}")
    return items


def add_placement_options(parser: argparse.ArgumentParser) -> None:
    """``--kind``, ``--mig | --gpus | --devices``, ``--threads``, ``--memory``, ``--priority``."""
    parser.add_argument("--kind", choices=KINDS, help="training (default) or inference")
    parser.add_argument(
        "--owner",
        type=_owner,
        help="who runs it (one line of up to 128 printable characters; default: your user name)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--mig",
        type=given("a MIG profile such as 3g.40gb"),
        metavar="PROFILE",
        help="one MIG device of this profile, e.g. 3g.40gb",
    )
    where.add_argument("--gpus", type=GPU_COUNT, metavar="N", help="N whole GPUs")
    where.add_argument(
        "--devices",
        type=devices,
        metavar="DEVICE,...",
        help="these GPU / MIG devices: indexes (0, 0:1) or UUIDs",
    )
    parser.add_argument(
        "--threads",
        type=THREADS_PERCENT,
        metavar="PERCENT",
        help=f"MPS active thread percentage, {THREADS_RANGE}",
    )
    parser.add_argument(
        "--memory",
        type=size,
        metavar="SIZE",
        help="MPS pinned memory limit per device, e.g. 20GiB",
    )
    parser.add_argument(
        "--priority",
        type=integer(0, 1),
        metavar="{0,1}",
        help="MPS client priority: 0 normal, 1 below normal",
    )


def register(subparsers: Subparsers) -> None:
    jobs = subparsers.add_parser(
        "jobs", help="the job registry, and where co-location put each job (default: ls)"
    )
    jobs.set_defaults(run=run_ls, name=None)
    commands = jobs.add_subparsers(dest="jobs_command", metavar="COMMAND")
    add = commands.add_parser("add", help="register a job")
    add.add_argument("name", type=JOB_NAME)
    add_placement_options(add)
    add.add_argument(
        "--slo-p99-ms",
        type=slo_ms,
        metavar="MS",
        help=f"inference p99 latency SLO, {MIN_SLO_MS:g} ms up to an hour",
    )
    add.add_argument(
        "--queue",
        action="store_true",
        help="also queue it: reserve its devices when they free (release with jobs rm --force)",
    )
    add.set_defaults(run=run_add)
    rm = commands.add_parser("rm", help="remove a job")
    rm.add_argument("name", type=JOB_NAME)
    rm.add_argument(
        "--force",
        action="store_true",
        help="also release its reservations and stop its runs (SIGTERM; SIGKILL 10 s later)",
    )
    rm.set_defaults(run=run_rm)
    ls = commands.add_parser("ls", help="list jobs, their reservations and GPU memory use")
    ls.add_argument("name", nargs="?", type=JOB_NAME)
    ls.set_defaults(run=run_ls)
    history = commands.add_parser(
        "history", help="job runs: when asked, started, ended, and how they ended"
    )
    history.add_argument("--limit", type=UINT32, metavar="N", help="the newest N runs")
    history.set_defaults(run=run_history)


def placement(job: pb.Job) -> str:
    if job.devices:
        return ",".join(job.devices)
    if job.HasField("mig_profile"):
        return f"mig {job.mig_profile}"
    return f"{job.gpu_count if job.HasField('gpu_count') else 1} GPU"


def caller_name() -> str:
    """The user name of gpuctl's real UID (``id -un``), else the number: the owner a job
    gets when ``--owner`` is not given. A label: gpud cannot check it (gRPC tells it
    nothing of who calls on the socket)."""
    return user_name(os.getuid())


def owner_of(args: argparse.Namespace) -> str:
    """``--owner``, else the caller's user name (:func:`caller_name`)."""
    return str(args.owner or "") or caller_name()


if TYPE_CHECKING:  # named only in annotations
    # a `gpuctl run` waiting for a job: in the admission queue, or for co-location beside it
    WaitingRun = queue_pb2.QueueEntry | colo_pb2.ColoWaiter
    W = TypeVar("W", queue_pb2.QueueEntry, colo_pb2.ColoWaiter)


def holders(job: pb.Job, waiting: Sequence[WaitingRun] = ()) -> str:
    """The users whose runs hold the job's reservations (``holder_user``), then those
    whose runs only wait for it (``waiting``: as ``gpuctl queue`` shows them), each
    ``USER (waits)``: ``alice,bob (waits)``; ``-`` when none is known (no reservation and
    no run waiting, no holder, or its ``/proc`` unread)."""
    held = {r.holder_user for r in job.reservations if r.HasField("holder_uid")}
    waits = {w.holder_user for w in waiting if w.HasField("holder_uid")} - held
    return ",".join([*sorted(held), *(f"{u} (waits)" for u in sorted(waits))]) or "-"


def job_row(job: pb.Job, waiting: Sequence[WaitingRun] = ()) -> tuple[str, ...]:
    reserved = sorted({d for r in job.reservations for d in r.devices})
    used = sum(p.used_memory_bytes for p in job.processes if p.HasField("used_memory_bytes"))
    return (
        job.name,
        kind_name(job.kind),
        job.owner or "-",
        holders(job, waiting),
        placement(job),
        f"{job.threads_percent}%" if job.HasField("threads_percent") else "-",
        format_size(job.memory_limit_bytes) if job.HasField("memory_limit_bytes") else "-",
        f"{job.slo_p99_ms:g} ms" if job.HasField("slo_p99_ms") else "-",
        ",".join(reserved) or "-",
        format_size(used) if job.processes else "-",
    )


def fill_placement(msg: pb.Job | pb.ReserveRequest, args: argparse.Namespace) -> None:
    """Copy the options of :func:`add_placement_options` into a Job or a ReserveRequest."""
    if args.mig is not None:  # never '': refused as a usage error (given)
        msg.mig_profile = args.mig
    if args.gpus is not None:
        msg.gpu_count = args.gpus
    if args.devices is not None:  # a list, never empty (devices)
        msg.devices.extend(args.devices)
    if args.threads is not None:
        msg.threads_percent = args.threads
    if args.memory is not None:
        msg.memory_limit_bytes = args.memory
    if args.priority is not None:
        msg.client_priority = args.priority


def mps_options(args: argparse.Namespace) -> list[str]:
    """The MPS options given: they act only where an MPS control daemon serves the job."""
    given = {"--threads": args.threads, "--memory": args.memory, "--priority": args.priority}
    return [name for name, value in given.items() if value is not None]


def no_effect(options: list[str], why: str) -> str:
    return f"warning: {'/'.join(options)} will have no effect: {why}"


def _show_mps(ctx: Context) -> mps_pb2.ShowMpsResponse | None:
    """The MPS daemons, for a warning: None when gpud cannot say (the warning is a courtesy;
    the command itself goes on)."""
    try:
        resp: mps_pb2.ShowMpsResponse = ctx.call(
            ctx.stub(mps_pb2_grpc.MpsStub).ShowMps, mps_pb2.ShowMpsRequest()
        )
    except CliError:
        return None
    return resp


def warn_if_mps_off(ctx: Context, args: argparse.Namespace) -> None:
    """Warn when MPS options are given on a node whose gpud runs no MPS daemons."""
    options = mps_options(args)
    if not options:
        return
    resp = _show_mps(ctx)
    if resp is not None and not resp.mps_enabled:
        ctx.out.note(
            no_effect(
                options,
                "MPS is off on this node (gpud's mps.enabled = false); the job's processes run"
                " as ordinary CUDA clients",
            )
        )


def warn_if_mps_down(ctx: Context, env: dict[str, str]) -> None:
    """Warn when the MPS control daemon a job is sent to (``CUDA_MPS_PIPE_DIRECTORY``) is down:
    CUDA then runs the job's processes without MPS, and without the device's MPS limits. Also
    when the job's own thread or memory limit is above the device's MPS default: a client's
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` only narrow
    the limits of the MPS server it joins, which start from the daemon's defaults."""
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
    resp = _show_mps(ctx) if pipe else None
    for dev in resp.devices if resp is not None else ():
        if dev.pipe_directory != pipe:
            continue
        if not dev.up:
            why = f" ({dev.last_error})" if dev.last_error else ""
            print(
                f"gpuctl: warning: the MPS control daemon of {dev.uuid} is down{why}: the job's"
                " processes run without MPS and without its thread and memory limits",
                file=sys.stderr,
            )
            continue
        for said in _above_mps_defaults(dev, env):
            print(f"gpuctl: warning: {said}", file=sys.stderr)


def _above_mps_defaults(dev: mps_pb2.MpsDevice, env: dict[str, str]) -> list[str]:
    """What of the job's MPS limits (``env``) its client cannot have on ``dev``: the part
    above the device's default, which the client's MPS server holds it to."""
    said = []
    asked = env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "")
    if dev.HasField("threads_percent") and asked.isdigit() and int(asked) > dev.threads_percent:
        said.append(
            f"--threads {asked} is above the MPS default of {dev.uuid}"
            f" ({dev.threads_percent} %): an MPS client only narrows its server's thread"
            f" limit, so the job's processes get {dev.threads_percent} %"
            " (raise it with gpuctl mps set --threads)"
        )
    limit = _client_memory_limit(env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", ""))
    if dev.HasField("memory_limit_bytes") and limit is not None and limit > dev.memory_limit_bytes:
        default = format_size(dev.memory_limit_bytes)
        said.append(
            f"--memory {format_size(limit)} is above the MPS default memory limit of"
            f" {dev.uuid} ({default}): an MPS client only narrows its server's limit, so the"
            f" job's processes may allocate {default} at most"
            " (raise it with gpuctl mps set --memory)"
        )
    return said


def _client_memory_limit(value: str) -> int | None:
    """Device 0's limit in ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (``0=20G``), in bytes."""
    for part in value.split(","):
        dev, _, size = part.partition("=")
        if dev.strip() == "0":
            try:
                return parse_size(size)
            except InvalidArgument:
                return None
    return None


def run_add(ctx: Context, args: argparse.Namespace) -> int:
    job = pb.Job(
        name=args.name,
        kind=kind_value(args.kind or "training"),
        owner=owner_of(args),
    )
    fill_placement(job, args)
    if args.slo_p99_ms is not None:
        job.slo_p99_ms = args.slo_p99_ms
    # gpud's clock stamps the job it registers: one registered before this (less a second
    # for the clocks of two processes) was not registered by a try of this gpuctl
    started = time.time()
    stop = Stop()  # no signal sets it: Ctrl-C ends a wait to ask again as it ends gpuctl
    tries = _Tries()
    try:
        resp = _added_once(ctx, job, stop, started, tries)
        warn_if_mps_off(ctx, args)
        if not args.queue:
            entry = None
        else:
            # the entry's own id: a try again after a lost answer gets the entry gpud made
            request = pb.ReserveRequest(job=args.name, request_id=str(uuid.uuid4()))
            entry = enqueued_once(
                ctx, request, stop, keep_unfeasible=True, tried=tries.enqueue_tried
            )
    except KeyboardInterrupt:
        said = tries.stopped(job.name)
        if said:
            print(f"gpuctl: {said}", file=sys.stderr, flush=True)
        return 130
    finally:
        stop.close()
    if entry is not None:
        if not entry.unfeasible_reason:  # else the queued line says why
            warn_never(ctx, resp)
        if ctx.out.json:
            ctx.out.print_json({"job": resp.job, "entry": entry})
        else:
            ctx.out.print_table(HEADERS, [job_row(resp.job)])
            ctx.out.print(queued_line(entry))
        return 0
    warn_never(ctx, resp)
    if ctx.out.json:
        ctx.out.print_json(resp.job)
    else:
        ctx.out.print_table(HEADERS, [job_row(resp.job)])
    return 0


class _Tries:
    """How many times ``gpuctl jobs add`` asked gpud to register the job and to queue it:
    more than once, a try whose answer was lost may have done it."""

    def __init__(self) -> None:
        self.add = 0
        self.enqueue = 0

    def enqueue_tried(self) -> None:
        self.enqueue += 1

    def stopped(self, name: str) -> str:
        """What a Ctrl-C while asking again leaves unknown: empty where no answer was lost."""
        if self.enqueue > 1:
            return (
                f"stopped while asking again: job {name} is registered, and may have been"
                f" queued by the try whose answer was lost (gpuctl queue)"
            )
        if self.add > 1 and self.enqueue == 0:
            return (
                f"stopped while asking again: job {name} may have been registered by the try"
                f" whose answer was lost (gpuctl jobs ls {name})"
            )
        return ""


def _added_once(
    ctx: Context, job: pb.Job, stop: Stop, started: float, tries: _Tries
) -> pb.AddJobResponse:
    """``job`` registered (``Jobs.AddJob``), asked again when an answer was lost as
    :func:`asked_once` asks. gpud keeps no request id for a job: a try again that finds the
    job (ALREADY_EXISTS) takes it as made by the lost try when gpud holds it as this
    gpuctl asked (:func:`same_job`, its ``--devices`` indexes read as the UUIDs gpud
    keeps), registered no earlier than a second before ``started`` (the wall time before
    the first try) and holding no reservation, said on stderr; otherwise the job is
    someone else's and its ALREADY_EXISTS stands, saying so."""

    def add_job(c: Context) -> Any:
        tries.add += 1
        return c.stub(pb_grpc.JobsStub).AddJob

    try:
        resp: pb.AddJobResponse = asked_once(ctx, add_job, pb.AddJobRequest(job=job), stop)
        return resp
    except CliError as err:
        if tries.add == 1 or err.exit_code != EXIT_EXISTS:
            raise
        try:
            listed: pb.ListJobsResponse = ctx.call(
                ctx.stub(pb_grpc.JobsStub).ListJobs, pb.ListJobsRequest(name=job.name)
            )
        except CliError as failed:
            raise CliError(
                f"{err}, found registered when asked again after a lost answer; listing it"
                f" to tell whether that lost try registered it failed: {failed}",
                failed.exit_code,
                error=failed.error,
                status=failed.status,
            ) from failed
        held = listed.jobs[0] if len(listed.jobs) == 1 else None
        why = _not_made(ctx, held, job, started)
        if why:
            raise CliError(
                f"{err}, {why}: not by its try whose answer was lost (gpuctl jobs ls {job.name})",
                err.exit_code,
                error=err.error,
                status=err.status,
            ) from err
    ctx.out.note(
        f"job {job.name} exists as asked: registered by the try whose answer was lost,"
        f" taken as made; gpud's warnings on it, if any, came in that answer (gpuctl env"
        f" --job {job.name} says why a job can never start here; gpuctl jobs ls {job.name})"
    )
    return pb.AddJobResponse(job=held)


def _not_made(ctx: Context, held: pb.Job | None, asked: pb.Job, started: float) -> str:
    """Why the job gpud holds (``held``, None: not listed) is not the one this gpuctl's lost
    try registered; empty when it may be."""
    if held is not None and held.created_unix_seconds < started - 1.0:
        return "registered before this gpuctl asked"
    if held is not None and held.reservations:
        return f"holding reservation {held.reservations[0].id} already"
    given = device_uuids(ctx, asked.devices)
    if held is None or given is None:
        return "registered otherwise than this gpuctl asked"
    resolved = pb.Job()
    resolved.CopyFrom(asked)
    del resolved.devices[:]
    resolved.devices.extend(given)
    return "" if same_job(held, resolved) else "registered otherwise than this gpuctl asked"


def device_uuids(ctx: Context, devices: Sequence[str]) -> list[str] | None:
    """``devices`` as gpud keeps them in a job: an index (``0``, ``0:1``) as the UUID of
    the GPU or MIG device it names now (``Mps.ShowMps``: every device gpud serves, as it
    resolves them; a GPU with one device only, its MIG device, is named by its index), a
    UUID as given. None when an index names none, or gpud cannot say."""
    if all(d.startswith(UUID_PREFIXES) for d in devices):
        return list(devices)
    shown = _show_mps(ctx)
    if shown is None:
        return None
    uuids = []
    for name in devices:
        if name.startswith(UUID_PREFIXES):
            uuids.append(name)
            continue
        gpu, sep, mig = name.partition(":")
        found = [d for d in shown.devices if str(d.gpu) == gpu]
        if sep:
            found = [d for d in found if d.HasField("mig") and str(d.mig) == mig]
        if len(found) != 1 or not found[0].HasField("uuid"):
            return None
        uuids.append(found[0].uuid)
    return uuids


def same_job(held: pb.Job, asked: pb.Job) -> bool:
    """Whether gpud holds the job ``held`` as AddJob was asked ``asked``: kind, owner,
    placement (``asked``'s devices as UUIDs: :func:`device_uuids`), MPS limits, priority,
    SLO."""
    kept = pb.Job()
    kept.CopyFrom(held)
    for field in ("created_unix_seconds", "reservations", "processes", "unhealthy_gpus"):
        kept.ClearField(field)  # gpud's, not the caller's
    return kept == asked


def warn_never(ctx: Context, resp: pb.AddJobResponse) -> None:
    """gpud's warnings on a job registered that can never start on this node as it is
    (``gpuctl run`` refuses it until a MIG layout or GPU comes that hosts it)."""
    for said in resp.warnings:
        ctx.out.note(f"warning: {said}")


def queued_line(entry: queue_pb2.QueueEntry) -> str:
    """One line on a queue entry, as ``gpuctl run`` and ``jobs add --queue`` print it."""
    if entry.state == queue_pb2.ENTRY_STATE_STARTED:
        return f"job {entry.job} started (reservation {entry.reservation.id})"
    if entry.unfeasible_reason:
        remedy = f"; {entry.remedy}" if entry.remedy else ""
        return f"job {entry.job} queued ({entry.id}) but cannot start here: {entry.unfeasible_reason}{remedy}"
    if entry.unhealthy:
        quote = f"no wait can be quoted: it waits for its GPUs to answer again ({entry.unhealthy})"
    elif entry.unbounded:
        quote = "no bound on the wait (its devices are overloaded)"
    elif entry.overdue:
        runs = ", ".join(
            f"{r.job} (estimated {seconds(r.estimate_seconds)})" for r in entry.overdue
        )
        quote = f"no wait can be quoted: what holds its devices has run past its estimate: {runs}"
    elif entry.HasField("quote_seconds"):
        quote = f"expected wait {seconds(entry.quote_seconds)}"
    else:
        quote = "no history to quote a wait from yet"
    return f"job {entry.job} queued ({entry.id}): position {entry.position}, {quote}"


HISTORY_HEADERS = ("JOB", "USER", "REQUEST", "QUEUED", "WAITED", "QUOTED", "RAN", "EXIT")
# What ended a run whose gpuctl run reported no exit status (HistoryRecord.end_cause).
END_CAUSES = {
    "released": "released with no status",
    "removed": "jobs rm --force",
    "holder-gone": "holder gone (gpuctl killed)",
    "holder-gone-at-start": "holder gone when gpud started",
    "unrecorded": "ended under an earlier gpud",
}


def how_it_ended(r: queue_pb2.HistoryRecord) -> str:
    """Its command's exit status (``3``), the signal that killed it (``SIGTERM``), or ``-``
    and what ended the run instead; ``-`` alone while it runs or when gpud did not record
    it (a run that ended before gpud kept how). A run removed while it ran has both:
    ``SIGTERM jobs rm --force``."""
    cause = END_CAUSES.get(r.end_cause, r.end_cause)
    if r.HasField("exit_code"):
        status = str(r.exit_code)
    elif r.HasField("exit_signal"):
        try:
            status = signal.Signals(r.exit_signal).name
        except ValueError:
            status = f"signal {r.exit_signal}"
    else:
        return f"{NA} {cause}" if cause else NA
    return f"{status} {cause}" if r.end_cause == "removed" else status


# Records asked for at once: a page stays well under gRPC's 4 MiB a message however many
# runs the history keeps (admission.history_keep, up to 10 million, + the runs still running).
HISTORY_PAGE = 2000


def fetch_history(ctx: Context, limit: int | None) -> queue_pb2.HistoryResponse:
    """The newest ``limit`` runs (all when None), newest first, a page at a time. A gpud
    that predates paging answers the first request with all of them."""
    stub = ctx.stub(queue_pb2_grpc.QueueStub)
    records: list[queue_pb2.HistoryRecord] = []
    request = queue_pb2.HistoryRequest()
    while True:
        left = HISTORY_PAGE if limit is None else limit - len(records)
        request.page_size = min(HISTORY_PAGE, left)
        if limit is not None:
            request.limit = request.page_size
        page: queue_pb2.HistoryResponse = ctx.call(stub.History, request)
        records.extend(page.records)
        if not page.HasField("next_before") or (limit is not None and left <= HISTORY_PAGE):
            return queue_pb2.HistoryResponse(records=records)
        request.before = page.next_before


def run_history(ctx: Context, args: argparse.Namespace) -> int:
    resp = fetch_history(ctx, args.limit)
    if ctx.out.json:
        ctx.out.print_json(resp)
        return 0
    rows = []
    for r in resp.records:
        queued = datetime.datetime.fromtimestamp(r.queued_unix_seconds).strftime(
            "%Y-%m-%d %H:%M:%S"
        )
        # durations shown at least 0, also in rows an older gpud wrote across a clock step
        ran = (
            seconds(max(0.0, r.ended_unix_seconds - r.started_unix_seconds))
            if r.HasField("ended_unix_seconds")
            else "running"
        )
        quoted = seconds(r.quote_seconds) if r.HasField("quote_seconds") else "-"
        waited = seconds(max(0.0, r.started_unix_seconds - r.queued_unix_seconds))
        user = r.holder_user if r.HasField("holder_uid") else "-"
        rows.append((r.job, user, r.request, queued, waited, quoted, ran, how_it_ended(r)))
    ctx.out.print_table(HISTORY_HEADERS, rows)
    return 0


def run_rm(ctx: Context, args: argparse.Namespace) -> int:
    request = pb.RemoveJobRequest(name=args.name, force=args.force)
    resp: pb.RemoveJobResponse = ctx.call(ctx.stub(pb_grpc.JobsStub).RemoveJob, request)
    if ctx.out.json:
        ctx.out.print_json(resp.job)
    else:
        ctx.out.print(f"removed job {resp.job.name}")
    return 0


def run_ls(ctx: Context, args: argparse.Namespace) -> int:
    request = pb.ListJobsRequest()
    if args.name:
        request.name = args.name
    resp: pb.ListJobsResponse = ctx.call(ctx.stub(pb_grpc.JobsStub).ListJobs, request)
    shown = show_colo(ctx)
    colo = colo_state(shown)
    queued = queued_entries(ctx)
    colo_waiting = _by_job(shown.waiting if shown is not None else ())
    if ctx.out.json:
        out = message_to_dict(resp)
        for job in out["jobs"]:
            name = job["name"]
            job["colo"] = colo.get(name)
            # as gpuctl queue --json lists them (its entries, its colo_waiting): whose runs
            # wait for the job, holder_uid and holder_user
            job["queue_entries"] = [message_to_dict(e) for e in queued.get(name, ())]
            job["colo_waiting"] = [colo_waiter_dict(w) for w in colo_waiting.get(name, ())]
        ctx.out.print_json(out)
    else:
        rows = []
        for j in resp.jobs:
            waiting = [*queued.get(j.name, ()), *colo_waiting.get(j.name, ())]
            rows.append(job_row(j, waiting) + colo_row(colo.get(j.name)))
        ctx.out.print_table(HEADERS + COLO_HEADERS, rows)
        for line in unhealthy_lines(resp.jobs):
            ctx.out.print(line)
    return 0


def unhealthy_lines(jobs: Iterable[pb.Job]) -> list[str]:
    """Under the table: each job that holds a device of an unhealthy GPU, the GPU and why."""
    lines = []
    for job in jobs:
        for entry in job.unhealthy_gpus:
            gpu, _, why = entry.partition(": ")
            lines.append(f"job {job.name}: {gpu} unhealthy: {why}")
    return lines


def queued_entries(ctx: Context) -> dict[str, list[queue_pb2.QueueEntry]]:
    """Job -> its entries still waiting in the admission queue, in the queue's order (as
    ``gpuctl queue`` lists them); empty when the queue cannot be asked (an older gpud)."""
    try:
        resp: queue_pb2.ListQueueResponse = ctx.call(
            ctx.stub(queue_pb2_grpc.QueueStub).ListQueue, queue_pb2.ListQueueRequest()
        )
    except CliError:
        return {}
    return _by_job(e for e in resp.entries if e.state == queue_pb2.ENTRY_STATE_QUEUED)


def _by_job(waiting: Iterable[W]) -> dict[str, list[W]]:
    out: dict[str, list[W]] = {}
    for w in waiting:
        out.setdefault(w.job, []).append(w)
    return out


def colo_state(resp: colo_pb2.ShowColoResponse | None) -> dict[str, dict[str, Any]]:
    """Job -> its co-location state (placement, share, duty, guard) from ``gpuctl colo
    show``'s answer ``resp``; empty when the daemon's co-location loop cannot be asked
    (None) or is off."""
    if resp is None or not resp.enabled:
        return {}
    state: dict[str, dict[str, Any]] = {}
    for p in resp.placements:
        entry = message_to_dict(p)
        del entry["job"]
        entry["guard"] = None
        state.setdefault(p.job, entry)
    for g in resp.guards:
        guard = message_to_dict(g)
        del guard["job"]
        if g.job in state:
            state[g.job]["guard"] = guard
    # a training job is guarded by the inference jobs it shares a GPU with
    for job, entry in state.items():
        if entry["kind"] == "training" and entry["duty"] < 1.0:
            entry["throttled_by"] = sorted(
                j
                for j, other in state.items()
                if other["guard"] is not None and other["gpu"] == entry["gpu"] and j != job
            )
    return state


def colo_row(entry: dict[str, Any] | None) -> tuple[str, ...]:
    if entry is None:
        return (NA, NA, NA, NA)
    where = f"GPU {entry['gpu']}" if entry["gpu"] >= 0 else "waiting"
    if entry["mig_profile"]:
        where += f" mig {entry['mig_profile']}"
    share = "instance" if entry["mig_profile"] else f"{entry['sm_share']:.0%}"
    duty = f"{entry['duty']:.0%}" if entry["kind"] == "training" else NA
    guard = entry["guard"]
    if entry.get("evict"):
        state = "evicted: checkpoint and leave"
    elif guard is not None:
        p99 = f"{guard['p99_ms']:.1f}" if guard["p99_ms"] is not None else NA
        state = f"{guard['action']} p99 {p99}/{guard['slo_ms']:g} ms"
    elif entry.get("throttled_by"):
        state = f"throttled for {','.join(entry['throttled_by'])}"
    else:
        state = NA
    return (where, share, duty, state)
