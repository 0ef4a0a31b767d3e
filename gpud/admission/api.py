"""``gpud.v1.Queue``: the admission queue over the API (``gpuctl run`` when a job must
wait, ``gpuctl jobs add --queue``, ``gpuctl queue``, ``gpuctl jobs history``).

Calls touch SQLite and /proc: they run in a worker thread, off the event loop. A GetEntry
that waits (``wait_s``) waits on the event loop, holding no thread, for the service to say
entries changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from gpud.admission.classes import ClassView
from gpud.admission.model import Demand, Unfeasible
from gpud.admission.service import (
    OFF,
    QUEUED,
    STARTED,
    AdmissionService,
    EntryView,
    HistoryRow,
    request_of,
)
from gpud.api.access import ReportTokens
from gpud.api.validate import int_range, non_empty, optional, optional_pid, request_id
from gpud.errors import InvalidArgument, NotFound
from gpud.jobs.api import kind_from_pb, reservation_message
from gpud.jobs.env import REPORT_TOKEN_VAR
from gpud.jobs.registry import check_devices, check_name
from gpud.jobs.service import RunRequest
from gpud.shared import (
    WAITING_ON_COLOCATION,
    check_owner,
    shown,
    user_name,
    user_names,
)
from gpud.v1 import jobs_pb2
from gpud.v1 import queue_pb2 as pb
from gpud.v1 import queue_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from gpud.colo.service import WaiterView

MAX_DEVICES = 64
# GetEntryRequest.wait_s: the longest a GetEntry waits for its entry to change, and what it
# leaves of the call's deadline for the answer to travel back
MAX_ENTRY_WAIT_S = 5.0
ENTRY_WAIT_MARGIN_S = 0.5
# how old a read of the queue a waiting GetEntry may answer from, when nothing changed since
SHARED_READ_S = 0.5
# A waiting GetEntry whose entry moved up (still queued) answers this long after the move it
# first saw, with its position then: a start or a leave moves every run behind it, and the
# runs answered at once all asked again at once, on the CPUs the next run needed to start
# (a start, or a leave of the entry, is answered at once all the same).
MOVED_ANSWER_S = 1.0
_STATE = {QUEUED: pb.ENTRY_STATE_QUEUED, STARTED: pb.ENTRY_STATE_STARTED}


def run_request(request: jobs_pb2.ReserveRequest) -> RunRequest:
    # the fields of EnqueueRequest.request, named as the caller set them
    int_range(len(request.devices), 0, MAX_DEVICES, field="request.devices")
    return RunRequest(
        job=check_name(request.job),
        kind=kind_from_pb(request.kind),
        owner=check_owner(request.owner),
        mig_profile=optional(request, "mig_profile"),
        gpu_count=optional(request, "gpu_count"),
        devices=check_devices(request.devices),
        threads_percent=optional(request, "threads_percent"),
        memory_bytes=optional(request, "memory_limit_bytes"),
        client_priority=optional(request, "client_priority"),
        holder_pid=optional_pid(request, "holder_pid"),
        holder_pid_namespace=optional(request, "holder_pid_namespace"),
        request_id=request_id(request.request_id, field="request.request_id"),
    )


def reserve_request(r: RunRequest) -> jobs_pb2.ReserveRequest:
    msg = jobs_pb2.ReserveRequest(job=r.job, owner=r.owner, devices=list(r.devices))
    if r.kind is not None:
        msg.kind = (
            jobs_pb2.JOB_KIND_INFERENCE
            if r.kind.value == "inference"
            else jobs_pb2.JOB_KIND_TRAINING
        )
    for field, value in (
        ("mig_profile", r.mig_profile),
        ("gpu_count", r.gpu_count),
        ("threads_percent", r.threads_percent),
        ("memory_limit_bytes", r.memory_bytes),
        ("client_priority", r.client_priority),
    ):
        if value is not None:
            setattr(msg, field, value)
    return msg


def entry_message(v: EntryView, name_of: Callable[[int], str] = user_name) -> pb.QueueEntry:
    """``name_of``: a user's name by UID (:func:`user_names` for a listing)."""
    e = v.entry
    msg = pb.QueueEntry(
        id=e.id,
        job=e.job,
        request=e.placement.label(),
        state=_STATE.get(e.state, pb.ENTRY_STATE_LEFT),
        position=v.position,
        enqueued_unix_seconds=e.enqueued_at,
        waited_seconds=v.waited_s,
        env=v.env,
    )
    if v.quote_s is not None:
        if math.isinf(v.quote_s):
            msg.unbounded = True
        else:
            msg.quote_seconds = v.quote_s
    if v.unfeasible is not None:
        msg.unfeasible_reason = v.unfeasible.reason
        msg.remedy = v.unfeasible.remedy
    if v.reservation is not None:
        msg.reservation.CopyFrom(reservation_message(v.reservation))
    if e.request.holder_pid is not None:
        msg.holder_pid = e.request.holder_pid
    if e.holder_uid is not None:
        msg.holder_uid = e.holder_uid
        msg.holder_user = name_of(e.holder_uid)
    msg.waiting_on = v.waiting_on
    msg.unhealthy = v.unhealthy
    for r in v.overdue:
        msg.overdue.add(job=r.job, ran_seconds=r.ran_s, estimate_seconds=r.estimate_s or 0.0)
    return msg


def class_message(v: ClassView) -> pb.ClassModel:
    msg = pb.ClassModel(request=v.request.label(), left_out=v.left_out)
    if isinstance(v.demand, Unfeasible):
        msg.unfeasible_reason = v.demand.reason
    if v.packing is not None:
        if v.packing.k_eff is not None:
            msg.k_eff = v.packing.k_eff
        msg.binding = v.packing.binding or ""
        msg.pool_devices = v.packing.pool_size
        for name, k in v.packing.vector.items():
            msg.dimensions.add(name=name, k=k)
    if v.stats is not None:
        msg.arrival_rate_per_second = v.stats.arrival_rate
        msg.history_runs = v.stats.arrivals
    if v.quote is not None:
        msg.mean_service_seconds = v.quote.mean_service_s
        msg.scv_service = v.quote.scv_service
        msg.utilization = v.quote.rho
        msg.packing_efficiency = v.quote.efficiency
        if math.isinf(v.quote.wait_s):
            msg.unbounded = True
        else:
            msg.quote_seconds = v.quote.wait_s
    elif isinstance(v.demand, Demand) and v.stats is not None and v.stats.mean_service_s:
        msg.mean_service_seconds = v.stats.mean_service_s
        msg.scv_service = v.stats.scv_service
    return msg


def history_message(h: HistoryRow, name_of: Callable[[int], str] = user_name) -> pb.HistoryRecord:
    """``name_of``: a user's name by UID (:func:`user_names` for a page of them)."""
    msg = pb.HistoryRecord(
        job=h.job,
        request=request_of(h.request).label(),
        reservation=h.reservation,
        queued_unix_seconds=h.queued_at,
        started_unix_seconds=h.started_at,
        placement=reserve_request(h.request),
    )
    if h.ended_at is not None:
        msg.ended_unix_seconds = h.ended_at
    if h.quote_s is not None:
        msg.quote_seconds = h.quote_s
    if h.exit_code is not None:
        msg.exit_code = h.exit_code
    if h.exit_signal is not None:
        msg.exit_signal = h.exit_signal
    msg.end_cause = h.end_cause or ""
    if h.reported_at is not None:
        msg.reported_unix_seconds = h.reported_at
    if h.holder_uid is not None:
        msg.holder_uid = h.holder_uid
        msg.holder_user = name_of(h.holder_uid)
    return msg


def waiter_message(w: WaiterView, now_unix: float) -> pb.QueueEntry:
    """A ``gpuctl run`` that waited for co-location (outside the queue: no position, no
    request shape, no quote), taken out: as Leave answers it."""
    msg = pb.QueueEntry(
        id=w.id,
        job=w.job,
        state=pb.ENTRY_STATE_LEFT,
        enqueued_unix_seconds=now_unix - w.waited_s,
        waited_seconds=w.waited_s,
        waiting_on=WAITING_ON_COLOCATION,
    )
    if w.uid is not None:
        msg.holder_uid = w.uid
        msg.holder_user = user_name(w.uid)
    return msg


def _signal_name(value: str | None) -> str | None:
    """LeaveRequest.stopped_by as the event may say it: a signal's name (``SIGTERM``) or
    "", nothing longer or with other characters (it goes into the event log's text)."""
    if value is not None and (len(value) > 16 or not (value == "" or value.isalnum())):
        raise InvalidArgument("must be a signal's name, such as SIGTERM", field="stopped_by")
    return value


def _entry_id(request: pb.GetEntryRequest | pb.LeaveRequest) -> str:
    """The request's ``id``, a queue entry's or a co-location waiter's (12 hex digits each):
    one of other characters can be neither, and a newline or an escape sequence in it
    would reach the NotFound message, and the terminal of whoever asked, as it came."""
    entry_id = non_empty(request.id, field="id", max_len=64)
    if not (entry_id.isascii() and entry_id.isalnum()):
        raise InvalidArgument(
            f"{shown(entry_id, 64)}: an entry id is letters and digits (gpuctl queue lists them)",
            field="id",
        )
    return entry_id


def _wait_s(request: pb.GetEntryRequest, remaining: float | None) -> float:
    """How long a GetEntry may wait for its entry to change: ``wait_s`` (checked), at most
    MAX_ENTRY_WAIT_S, and ENTRY_WAIT_MARGIN_S short of the deadline (``remaining``)."""
    wait: float | None = optional(request, "wait_s")
    if wait is None:
        return 0.0
    if not math.isfinite(wait) or wait < 0:
        raise InvalidArgument("must be a number of seconds, 0 or more", field="wait_s")
    wait = min(wait, MAX_ENTRY_WAIT_S)
    if remaining is not None:
        wait = min(wait, remaining - ENTRY_WAIT_MARGIN_S)
    return max(0.0, wait)


async def wait_for_change(changed: asyncio.Event, timeout: float) -> None:
    """On the event loop: until ``changed`` is set or ``timeout`` seconds have passed."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(changed.wait(), timeout)


class _Changes:
    """When queue entries changed: set from any thread (the service's listener), waited on
    by the GetEntry calls on the event loop. Each change sets the event the waiters hold
    and puts a fresh one in its place. The waiting calls share one read of the queued
    entries per change (``queued``): a change wakes every waiter, and each reading the
    whole queue for itself made a change cost O(waiters) reads of O(queue) each."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        # the read of the queued entries made while this event was current, when it began
        self._read: tuple[asyncio.Event, float, asyncio.Future[dict[str, pb.QueueEntry]]] | None
        self._read = None

    def current(self) -> asyncio.Event:
        """On the event loop: the event the next change sets."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._event is None:
            self._loop, self._event = loop, asyncio.Event()
        return self._event

    async def queued(
        self, event: asyncio.Event, read: Callable[[], dict[str, pb.QueueEntry]]
    ) -> dict[str, pb.QueueEntry]:
        """On the event loop, ``event`` being current: the queued entries by id, from one
        ``read`` in a worker thread begun since ``event`` became current and at most
        SHARED_READ_S ago, which the calls asking meanwhile share (one call cancelled
        leaves the read to the others)."""
        now = self._clock()
        if self._read is None or self._read[0] is not event or now - self._read[1] > SHARED_READ_S:
            future = asyncio.ensure_future(asyncio.to_thread(read))
            # read by whoever waits on it; a failure nobody waits for is not logged as lost
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._read = (event, now, future)
        return await asyncio.shield(self._read[2])

    def tell(self) -> None:
        """From any thread: entries changed."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing waits
                loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = asyncio.Event()


class QueueServicer(pb_grpc.QueueServicer):
    def __init__(
        self,
        service: AdmissionService,
        *,
        leave_waiter: Callable[[str, str | None], WaiterView | None] = lambda w, by: None,
        wall: Callable[[], float] = time.time,
        moved_answer_s: float = MOVED_ANSWER_S,
        tokens: ReportTokens | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[asyncio.Event, float], Awaitable[None]] = wait_for_change,
    ) -> None:
        """``leave_waiter``: takes a ``gpuctl run`` waiting for co-location out of its
        wait by its id (None: no run waits with it), so that `gpuctl queue --leave ID`
        takes out whatever `gpuctl queue` lists; its second argument is the signal that
        stopped the run leaving by itself (LeaveRequest.stopped_by), None for an operator.
        ``tokens``: who may see a started run's report token (:mod:`gpud.api.access`).
        ``clock`` (monotonic seconds) and ``wait`` (until the change event is set or a time
        limit passes) pace the waiting GetEntry calls."""
        self._service = service
        self._tokens = tokens or ReportTokens()
        self._leave_waiter = leave_waiter
        self._wall = wall
        self._moved_answer_s = moved_answer_s
        self._clock = clock
        self._wait = wait
        self._changes = _Changes(clock)
        if service is not None:  # a test's servicer may be given its service later
            service.add_listener(self.entries_changed)

    def entries_changed(self) -> None:
        """From any thread: queue entries changed (the service's listener); the waiting
        GetEntry calls read theirs again."""
        self._changes.tell()

    def register(self, server: Any) -> None:
        """Add this service to a ``grpc.aio.Server`` (an ``ApiServer`` registrar)."""
        pb_grpc.add_QueueServicer_to_server(self, server)

    async def Enqueue(self, request: pb.EnqueueRequest, context: Any) -> pb.QueueEntry:  # noqa: N802
        def enqueue() -> pb.QueueEntry:
            return entry_message(
                self._service.enqueue(
                    run_request(request.request), keep_unfeasible=request.keep_unfeasible
                )
            )

        return await asyncio.to_thread(enqueue)

    async def GetEntry(self, request: pb.GetEntryRequest, context: Any) -> pb.QueueEntry:  # noqa: N802
        """The entry; a started run's environment without its report token for a caller
        who may not see it (a read over TCP)."""
        entry = await self._entry(request, context)
        if REPORT_TOKEN_VAR not in entry.env or self._tokens.reveals(context):
            return entry
        shown = pb.QueueEntry()
        shown.CopyFrom(entry)  # a waiting call's entry may be shared with others
        del shown.env[REPORT_TOKEN_VAR]
        return shown

    async def _entry(self, request: pb.GetEntryRequest, context: Any) -> pb.QueueEntry:
        """With ``wait_s``: answers once the entry is no longer queued, MOVED_ANSWER_S after
        it was first seen moved up (with its position then), or after ``wait_s``; each
        change of the queue reads it again, one read in a worker thread shared by every
        waiting call (an entry no longer queued is read alone)."""
        entry_id = _entry_id(request)

        def get() -> pb.QueueEntry:
            return entry_message(self._service.view(entry_id))

        wait = _wait_s(request, context.time_remaining())
        if wait <= 0:
            return await asyncio.to_thread(get)
        until = self._clock() + wait
        position: int | None = None
        moved_at: float | None = None
        while True:
            changed = self._changes.current()  # before the read: a change during it counts
            entry = (await self._changes.queued(changed, self._queued)).get(entry_id)
            if entry is None:
                entry = await asyncio.to_thread(get)
            if position is None:
                position = entry.position
            now = self._clock()
            if entry.state != pb.ENTRY_STATE_QUEUED or now >= until:
                return entry
            if entry.position != position and moved_at is None:
                moved_at = now
            left = until - now
            if moved_at is not None:
                if now >= moved_at + self._moved_answer_s:
                    return entry
                left = min(left, moved_at + self._moved_answer_s - now)
            await self._wait(changed, left)

    def _queued(self) -> dict[str, pb.QueueEntry]:
        name_of = user_names()
        return {v.entry.id: entry_message(v, name_of) for v in self._service.queue_views()}

    async def Leave(self, request: pb.LeaveRequest, context: Any) -> pb.QueueEntry:  # noqa: N802
        def leave() -> pb.QueueEntry:
            entry_id = _entry_id(request)
            stopped_by = _signal_name(optional(request, "stopped_by"))
            waiter = self._leave_waiter(entry_id, stopped_by)
            if waiter is not None:
                return waiter_message(waiter, self._wall())
            try:
                return entry_message(self._service.leave(entry_id, stopped_by=stopped_by))
            except NotFound as err:
                # the id may have been a co-location waiter's: gpuctl queue lists both
                raise NotFound(
                    f"no queue entry or run waiting for co-location {entry_id!r} (gpuctl queue"
                    " lists them)"
                ) from err

        return await asyncio.to_thread(leave)

    async def ListQueue(self, request: pb.ListQueueRequest, context: Any) -> pb.ListQueueResponse:  # noqa: N802
        def list_queue() -> pb.ListQueueResponse:
            name_of = user_names()
            resp = pb.ListQueueResponse(
                entries=[entry_message(v, name_of) for v in self._service.queue_views()],
                off="" if self._service.config.enabled else OFF,
            )
            if request.explain:
                resp.classes.extend(class_message(v) for v in self._service.explain())
            return resp

        return await asyncio.to_thread(list_queue)

    async def History(self, request: pb.HistoryRequest, context: Any) -> pb.HistoryResponse:  # noqa: N802
        def history() -> pb.HistoryResponse:
            page = optional(request, "page_size")
            name_of = user_names()
            if page is None:
                rows = self._service.history(limit=optional(request, "limit"))
                return pb.HistoryResponse(
                    records=[history_message(h, name_of) for h in reversed(rows)]
                )
            if page == 0:
                return pb.HistoryResponse()
            # one more than the page: whether older records are left
            rows = self._service.history(limit=page + 1, before=optional(request, "before"))
            kept = rows[-page:]
            resp = pb.HistoryResponse(records=[history_message(h, name_of) for h in reversed(kept)])
            if len(rows) > page:
                resp.next_before = kept[0].row_id
            return resp

        return await asyncio.to_thread(history)
