"""Co-location directives for jobs: ``throttle_point()`` and ``Latency``.

Training calls :func:`throttle_point` once per iteration. It reports the iteration to the
node's gpud (at most every ``report_every_s``) and sleeps so that the job runs at the duty
cycle gpud tells it: after an iteration that took ``t`` seconds at duty ``d`` it sleeps
``t * (1 - d) / d``, in slices of ``report_every_s``, asking gpud between them. MPS thread
limits are fixed when the CUDA context is created; sleeping is the lever that acts at once
(GPUColo does the same). Inference reports latencies with
``Latency().observe(seconds)``; they are sent in batches (a second's requests, up to 4096),
by a thread of the ``Latency``'s own: ``observe()`` never waits for gpud, so a gpud that
accepts the call and never answers holds that thread for :data:`CALL_TIMEOUT_S` per report,
never a request being served. Up to ``max_pending`` reports (8) wait for the thread; past
it the oldest is dropped, as is a report whose call fails, and ``Latency.dropped`` counts
the requests so lost. A report sent more than ``flush_every_s`` (and :data:`CALL_TIMEOUT_S`;
at most :data:`HELD_UNAGED_MAX_S`) after it was made says its age, as a batch held through
a quiet spell does. ``flush()``
sends what is held and waits (a bounded time) for the thread; ``close()`` then ends the
thread, dropping (and counting) the reports its flush left waiting when its time ran
out: call one before exit
to wait longer than the exit's own close, 1 s in all. A forked child starts with none of
its parent's batch, reports, thread or locks, and reports none of its parent's
iterations, under a process id of its own.

The job, the daemon's socket and the run's report token come from the environment ``gpuctl
run`` sets (``GPUD_JOB``, ``GPUD_SOCKET``, ``GPUD_REPORT_TOKEN``). Without a daemon the calls do nothing: a job must never
fail because its node's gpud is away, nor stay throttled by one that is gone: a directive
lapses :data:`DIRECTIVE_HOLD_S` after gpud last answered. Nor without gRPC: where it
cannot be loaded or its channel made, a ``Throttle`` (the one ``throttle_point()`` makes)
and a ``Latency`` are inert, each with a warning logged and the reason in its
``last_error``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import operator
import os
import sys
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from gpud.client.progress import load_grpc, token_metadata

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/gpud/gpud.sock"
# The longest latency gpud takes: a report over an hour is no request an online service
# served, but a unit mistake or garbage, which would have the guard evict training. A report
# holding any sample outside [0, MAX_LATENCY_S] (NaN too) is refused whole.
MAX_LATENCY_S = 3600.0
# The oldest a latency report may say its requests are: beyond every window gpud reads
# latencies over (6 windows of at most an hour), so a batch a quiet service held longer is
# sent saying this much and counts for nothing, as it would at its true age. gpud refuses a
# report claiming an age outside [0, MAX_REPORT_AGE_S] (NaN too).
MAX_REPORT_AGE_S = 86400.0
# How long a directive outlives gpud's last answer: longer than the slowest restart systemd
# lets gpud make (systemd/gpud.service: a deadlocked gpud answers nothing for up to
# WatchdogSec=30s before systemd stops it, then TimeoutStopSec=30s to stop, RestartSec=2s,
# and TimeoutStartSec=90s to start: 152 s), after which gpud restores the guards' duties
# from colo.json, so the service stays protected through it. The price: past the hold no
# guard watches the service (a start extended beyond it, as while MIG instances are
# rebuilt, runs the training at full speed beside it until gpud answers), and before it a
# training job held at the floor runs 20 times slower for that long when gpud is gone for
# good.
DIRECTIVE_HOLD_S = 180.0
# With calls failing, one is always tried this long before the hold runs out (one call's
# wait), whatever the back-off: a gpud back inside the hold is heard before its directive
# lapses, and a directive lapses only once that call failed too.
HOLD_LAST_CALL_S = 1.0
# How long a throttle point waits for gpud's answer. A gpud that accepts the call and never
# answers (stopped, deadlocked) costs the training loop this much at each call, so calls
# that fail are spaced out (REPORT_BACKOFF_MAX_S).
CALL_TIMEOUT_S = 1.0
# After a failed call the next is tried twice as late as the one before, from
# ``report_every_s`` (at least CALL_TIMEOUT_S) up to this: a gpud that never answers then
# costs a loop at most CALL_TIMEOUT_S per REPORT_BACKOFF_MAX_S (about 3 %). This much is
# also the longest a gpud back from a restart may wait to be heard: the time a tighter
# directive of a guard it restored takes to reach the training job.
REPORT_BACKOFF_MAX_S = 30.0
# The least time a Latency's sender thread waits with nothing to send before it ends.
SENDER_IDLE_MIN_S = 5.0
# The longest a batch may be held through a quiet spell, or a report wait for the sender
# thread, and still be counted from its arrival, whatever ``flush_every_s`` (an infinite one
# too): six of gpud's default latency windows (10 s), so a spike held for minutes by a
# service that only flushes now and then is not read as what its GPU does now.
HELD_UNAGED_MAX_S = 60.0


def _check_interval(owner: str, name: str, seconds: float) -> None:
    """Refuses an interval between calls to gpud that is no finite number of seconds >= 0,
    naming ``owner``'s argument ``name``: NaN or inf would stop the calls for good (no time
    is ever that far on), a negative one means nothing; 0 calls at every point or
    request."""
    if not 0.0 <= seconds < math.inf:
        raise ValueError(f"{owner} {name} must be a finite number of seconds >= 0, not {seconds!r}")


def _check_count(owner: str, name: str, count: int) -> int:
    """The count ``count`` as an ``int``: any integer type (a numpy one too) that is >= 1;
    refuses others (a bool, a float), naming ``owner``'s argument ``name``."""
    try:
        whole = operator.index(count)
    except TypeError:
        whole = 0  # no integer at all
    if isinstance(count, bool) or whole < 1:
        raise ValueError(f"{owner} {name} must be a whole number >= 1, not {count!r}")
    return whole


class _Channel:
    def __init__(self, socket: str | None = None, token: str | None = None) -> None:
        self._socket = socket or os.environ.get("GPUD_SOCKET", DEFAULT_SOCKET)
        self.metadata = token_metadata(token)  # each call carries the run's report token
        self._stub: Any = None

    def stub(self) -> Any:
        if self._stub is None:
            import grpc

            from gpud.v1 import colo_pb2_grpc

            self._stub = colo_pb2_grpc.ColocationStub(
                grpc.insecure_channel(f"unix://{self._socket}")
            )
        return self._stub

    def load(self, outcome: str = "nothing is reported") -> str:
        """Import all of gRPC that the calls use (making a channel imports the rest; it
        connects only at its first call), in the thread that asks, and forget the channel:
        the calls make their own. "" when loaded, else why not, ending with ``outcome``
        (never raises: see :func:`load_grpc`)."""

        def load() -> bool:
            import grpc

            grpc.insecure_channel(f"unix://{self._socket}").close()
            return True

        generated = ("gpud.v1.colo_pb2", "gpud.v1.colo_pb2_grpc")
        return load_grpc(load, self._socket, generated, outcome=outcome).why

    def forget(self) -> None:
        """Connect anew at the next call (in a forked child: the parent's channel is its own)."""
        self._stub = None


class Throttle:
    """The state behind :func:`throttle_point`; one per process (or per test). A forked
    child keeps the directive it was told, not the parent's iterations waiting to be
    reported, nor its gRPC channel."""

    def __init__(
        self,
        job: str | None = None,
        *,
        socket: str | None = None,
        report_every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        call: Callable[[str, int], tuple[float, bool, str]] | None = None,
        token: str | None = None,
        hold_s: float = DIRECTIVE_HOLD_S,
    ) -> None:
        """``report_every_s``: the least time between reports to gpud (0: at every
        point; a negative, infinite or NaN one is refused naming it). ``hold_s``: how long after gpud last answered
        its directive still holds (a
        restart's silence; a negative or NaN one is refused naming it); past it, said once
        on stderr, the job runs at full duty, not evicted, until gpud
        answers again. ``call(job, iterations)``: one report (default: the
        ``ThrottlePoint`` RPC, waiting at most :data:`CALL_TIMEOUT_S`). A call that fails
        (raises) is tried again twice as late each time, up to
        :data:`REPORT_BACKOFF_MAX_S`, so a gpud that accepts calls and answers none costs
        the loop at most one call's wait per that much time; one more is tried
        :data:`HOLD_LAST_CALL_S` before the hold runs out, and the directive lapses only
        once that one failed. The first point reports no iteration (the one it counts goes
        with the next report): no sleep follows it, so until the next point the job runs
        at full duty whatever gpud told it, and gpud, which takes the duty it told out of
        the time between reports, would read it as that much faster. Each
        ``ThrottlePoint`` carries this throttle's process id (``ThrottlePointRequest.process``,
        random, a forked child's its own): gpud tells a process started again within one
        run, whose rate it reads from its own iterations, not across the gap from the
        last one's, from another rank of the job reporting beside it. Without ``call``,
        gRPC is loaded before the first call, in the thread of the :meth:`point` that makes
        it (nothing is imported here): where it cannot be (missing, broken, half-imported
        at the fork that made this process, whose import would wait for good) or its
        channel made, the throttle is inert, never raising nor waiting on that import: no
        call is made, the job runs at full duty, a warning is logged and
        :attr:`last_error` says why ("" while it reports, and while gpud is away)."""
        if not hold_s >= 0.0:  # NaN too
            raise ValueError(f"Throttle hold_s must be a number of seconds >= 0, not {hold_s!r}")
        _check_interval("Throttle", "report_every_s", report_every_s)
        self.job = job or os.environ.get("GPUD_JOB", "")
        self._channel = _Channel(socket, token)
        self._hold = hold_s
        self._answered = clock()  # when gpud last told the job its directive
        self._every = report_every_s
        self._clock = clock
        self._sleep = sleep
        self._call = call or self._grpc_call
        self._last: float | None = None
        self._last_report = float("-inf")
        self._interval = report_every_s  # until the next report: longer after failures
        self._failing = False  # the last call failed
        self._pending = 0
        self._process = uuid.uuid4().hex  # which process of the job reports
        self.duty = 1.0
        self.evict = False
        self.reason = ""
        # why gRPC could not be loaded; "" while it reports, and while gpud is away
        self.last_error = ""
        # gRPC is loaded by the first call (the default one), then never tried again
        self._load_pending = call is None
        self._inert = False  # no gRPC: no call is ever made
        _THROTTLES.add(self)

    def _forked(self) -> None:
        """In a forked child: the iterations waiting are the parent's to report, and its
        gRPC channel is the parent's, and so is its process id."""
        self._pending = 0
        self._process = uuid.uuid4().hex
        self._channel.forget()

    def _grpc_call(self, job: str, iterations: int) -> tuple[float, bool, str]:
        from gpud.v1 import colo_pb2

        r = self._channel.stub().ThrottlePoint(
            colo_pb2.ThrottlePointRequest(job=job, iterations=iterations, process=self._process),
            timeout=CALL_TIMEOUT_S,
            metadata=self._channel.metadata,
        )
        return r.duty, r.evict, r.reason

    def _due(self, now: float) -> bool:
        """Whether to ask gpud now: ``report_every_s`` (longer after failures) since the
        last call, or, calls failing with a directive to keep, the hold about to run out
        and no call tried since it was. gRPC is loaded before the first such call, on the
        thread that makes it (the training loop's)."""
        if not self.job or self._inert:  # no gRPC: nothing to ask with
            return False
        last_call = self._answered + self._hold - HOLD_LAST_CALL_S
        held = self.duty < 1.0 or self.evict
        due = now - self._last_report >= self._interval or (
            self._failing and held and now >= last_call > self._last_report
        )
        return due and self._loaded()

    def _loaded(self) -> bool:
        """Whether gRPC is there for the default call, imported now at the first: on the
        thread about to call (never on one that only reads :func:`directive`, beside a
        main thread that forks workers: a fork mid-import leaves the child's grpc
        half-imported for good). Where it cannot be, the throttle turns inert for good."""
        if self._load_pending:
            self._load_pending = False
            self.last_error = self._channel.load(
                "this process runs at full duty, not throttled by gpud"
            )
            if self.last_error:
                self._inert = True
                log.warning("job %s is not throttled: %s", self.job, self.last_error)
        return not self._inert

    def _report(self, now: float, iterations: int) -> None:
        self._last_report = now
        try:
            self.duty, self.evict, self.reason = self._call(self.job, iterations)
        except Exception:  # the daemon may be away: keep the last directive a while
            self._failing = True
            self._interval = min(
                REPORT_BACKOFF_MAX_S, 2.0 * max(self._interval, self._every, CALL_TIMEOUT_S)
            )
            return
        self.duty = min(1.0, max(0.01, self.duty))
        self._pending -= iterations
        self._answered = now
        self._failing = False
        self._interval = self._every

    def _lapse(self, now: float) -> None:
        """Past the hold since gpud last answered (its calls failing since, the one tried
        just before the hold ran out too), its directive lapses: checked at every point,
        not only when a backed-off call is tried."""
        silent = now - self._answered
        tried = self._last_report >= self._answered + self._hold - HOLD_LAST_CALL_S
        if self._failing and silent > self._hold and tried and (self.duty < 1.0 or self.evict):
            self.duty, self.evict = 1.0, False
            self.reason = (
                f"gpud has not answered for {silent:.0f} s: its directive lapsed, "
                "running at full duty until it answers"
            )
            # Once a lapse: from here the job runs beside a service no guard watches.
            print(f"gpud.client: job {self.job}: {self.reason}", file=sys.stderr, flush=True)

    def point(self) -> float:
        """Call once per iteration; returns the seconds slept."""
        now = self._clock()
        self._pending += 1
        was_evicted = self.evict
        if self._due(now):
            self._report(now, self._pending if self._last is not None else 0)
        self._lapse(now)
        slept = 0.0
        # An eviction is returned at once, so that the job checkpoints and leaves now: at
        # its duty (0.01) the sleep would hold it for 99 iterations' time first, still
        # holding the memory or SMs it was evicted for. A job that goes on regardless is
        # held at that duty from its next iteration.
        told_now = self.evict and not was_evicted
        if self._last is not None and self.duty < 1.0 and not told_now:
            slept = self._hold_duty(now - self._last)
        self._last = self._clock()
        return slept

    def _hold_duty(self, busy: float) -> float:
        """Sleeps so that ``busy`` seconds of work ran at the duty gpud asks, in slices of
        ``report_every_s`` (at least :data:`CALL_TIMEOUT_S`), reporting between them as a
        point does: a duty gpud changes, or one that lapses, mid-sleep takes hold within a
        slice, not after the whole sleep (at duty 0.01, 99 times the iteration). A new
        eviction ends the sleep at once, as at a point. Returns the seconds slept."""
        slept = 0.0
        step = max(self._every, CALL_TIMEOUT_S)
        while (left := busy * (1.0 - self.duty) / self.duty - slept) > 1e-9:
            piece = min(left, step)
            self._sleep(piece)
            slept += piece
            now = self._clock()
            if self._due(now):
                was_evicted = self.evict
                self._report(now, self._pending)
                if self.evict and not was_evicted:
                    break
            self._lapse(now)
        return slept


_default: dict[str, Throttle] = {}
# the one lock guarding it, in a list so that a forked child puts its own in its place
_default_lock = [threading.Lock()]
# Every Throttle not yet collected: a forked child reports none of its parent's iterations.
_THROTTLES: weakref.WeakSet[Throttle] = weakref.WeakSet()


def _throttle() -> Throttle:
    with _default_lock[0]:
        if "process" not in _default:
            _default["process"] = Throttle()
        return _default["process"]


def throttle_point() -> float:
    """Once per training iteration: report progress, sleep the duty cycle gpud asks for."""
    return _throttle().point()


def directive() -> tuple[float, bool, str]:
    """The latest directive (duty, evict, reason). When ``evict`` is set, gpud needs this
    GPU back (an SLO or memory could not be held otherwise): checkpoint and exit."""
    t = _throttle()
    return t.duty, t.evict, t.reason


# One latency report: (seconds, when its earliest request began, held through a quiet
# spell, when it left observe()).
_Report = tuple[list[float], float, bool, float]
# Every Latency not yet collected: closed at exit, made afresh in a forked child.
_LIVE: weakref.WeakSet[Latency] = weakref.WeakSet()
# Every inert Latency (no gRPC) not yet collected: a forked child's drops none of the parent's.
_INERT: weakref.WeakSet[Latency] = weakref.WeakSet()


class Latency:
    """Inference latency reports: ``lat = Latency(); lat.observe(0.012)`` per request.

    :meth:`observe` never waits for gpud: it appends to the batch, and a batch due to go is
    handed to a sender thread (started at the first report, one per ``Latency`` and process)
    that makes the call. A gpud that accepts the call and never answers (stopped,
    deadlocked) holds that thread for the call's deadline, not the request being served.
    Reports waiting for the thread are bounded (``max_pending`` batches): past it the
    oldest is dropped; a report whose call fails is dropped too (gpud may be away; a job
    never fails for it). :attr:`dropped` counts the requests so lost.

    The thread ends after ``idle_s`` with nothing to send (the next report starts another)
    and holds the ``Latency`` only weakly, so one dropped is collected. At interpreter exit
    every live ``Latency`` is closed (waiting :data:`CALL_TIMEOUT_S` for all of them, also
    where their calls are made on the exiting thread: see :meth:`call_timeout`); call
    :meth:`close` before then to wait longer. A forked child starts with nothing of the
    parent's: no batch, no reports waiting, no thread, locks and gRPC channel anew (gRPC
    itself is loaded when the ``Latency`` is made, on the thread that makes it, never by a
    sender thread: a fork during that import would leave it half-loaded in the child).
    Where gRPC cannot be loaded (missing, broken, half-imported at the fork that made this
    process) or its channel made (a socket path that is not valid UTF-8), the ``Latency`` is
    inert, never raising: :attr:`last_error` says why (a warning is logged), each request is
    counted in :attr:`dropped`, and no thread starts nor waits at exit."""

    def __init__(
        self,
        job: str | None = None,
        *,
        socket: str | None = None,
        flush_every_s: float = 1.0,
        max_batch: int = 4096,
        max_pending: int = 8,
        clock: Callable[[], float] = time.monotonic,
        send: Callable[[str, list[float], float | None], None] | None = None,
        token: str | None = None,
        background: bool = True,
        idle_s: float | None = None,
        start: Callable[[Callable[[], None], str], None] | None = None,
    ) -> None:
        """``flush_every_s``: the least time between reports (0: each request alone; inf:
        only when flushed or ``max_batch`` fills; a negative or NaN one is refused naming
        it). ``max_batch``, ``max_pending``: the most requests a report holds, the most
        reports waiting for the sender thread (each a whole number >= 1 of any integer
        type, else refused naming it).
        ``send(job, seconds, age_s)``: one report (default: the ``ReportLatency`` RPC
        to gpud, waiting at most :data:`CALL_TIMEOUT_S`); ``age_s`` the seconds since the
        earliest of its requests began, for a batch held through a quiet spell, or one
        that waited for the sender thread more than ``flush_every_s`` (and more than
        :data:`CALL_TIMEOUT_S`; an infinite one: :data:`HELD_UNAGED_MAX_S`), else None (gpud counts it from arrival).
        ``background=False`` sends on the thread that observes, waiting for gpud's answer
        there (for a caller already off the request path). ``idle_s``: how long the sender
        thread waits with nothing to send before it ends (default ten ``flush_every_s``,
        at least :data:`SENDER_IDLE_MIN_S`). ``start(target, name)`` runs ``target`` on a
        new thread (default: a daemon ``threading.Thread``); where it cannot (the pids
        cgroup's limit, interpreter shutdown) that one report is sent on the calling
        thread and the reports waiting are dropped and counted."""
        # inf is no interval but a choice: send only when flushed or max_batch fills
        if not flush_every_s >= 0.0:  # NaN too
            raise ValueError(
                f"Latency flush_every_s must be a number of seconds >= 0, not {flush_every_s!r}"
            )
        max_batch = _check_count("Latency", "max_batch", max_batch)
        max_pending = _check_count("Latency", "max_pending", max_pending)
        self.job = job or os.environ.get("GPUD_JOB", "")
        self._channel = _Channel(socket, token)
        self._every = flush_every_s
        # past this a held or waiting report says its age (an infinite interval too)
        self._quiet = min(flush_every_s, HELD_UNAGED_MAX_S)
        self._max = max_batch
        self._clock = clock
        self._send = send or self._grpc_send
        self._background = background
        idle = max(10 * flush_every_s, SENDER_IDLE_MIN_S) if idle_s is None else idle_s
        # a wait past TIMEOUT_MAX (an infinite flush_every_s, an idle_s given) raises in
        # the thread
        self._idle = min(idle, threading.TIMEOUT_MAX)
        self._start = start or _start_daemon
        self._max_pending = max_pending
        self._senders = 0  # sender threads started: each one's number
        self._fresh()
        # why nothing is reported ("" while reports go to gpud): gRPC could not be loaded
        self.last_error = ""
        if send is None:
            # gRPC loaded here, in the caller's thread, not by the sender at its first call:
            # a fork meanwhile (a pre-forking server's worker) would leave the child's grpc
            # half-imported for good, and every report of the child's would be dropped
            self.last_error = self._channel.load()
        if self.last_error:
            # a service never fails for its reports: observe() counts them as dropped
            log.warning("latency of %s is not reported: %s", self.job, self.last_error)
            _INERT.add(self)  # a forked child counts its own requests only
            return
        _LIVE.add(self)

    def _fresh(self) -> None:
        """The state of one process: at construction, and in a forked child, where the
        parent's thread is not there, its locks may have been held at the fork, what it
        held is the parent's to send and its gRPC channel is not to be used."""
        self._batch: list[float] = []
        self._began = math.inf  # when the batch's earliest request began, by ``clock``
        self._newest = -math.inf  # when the batch's newest request finished
        self._last = self._clock()
        self._lock = threading.Lock()
        self.dropped = 0  # requests whose report was not delivered: overflow or a failed call
        # reports for the sender thread: (seconds, began, aged, taken) with ``taken`` when
        # the batch left observe(), so that one delivered late says its age
        self._pending: deque[_Report] = deque()
        # calls in flight: an old thread's (past a close() that timed out) counts too
        self._sending = 0
        self._ready = threading.Condition()
        self._sender = 0  # the number of the sender thread that runs; 0: none
        self._ending = False  # closed: that thread ends once nothing waits for it
        # the exit's deadline, by its clock: no call waits past it (None: not exiting)
        self._until: tuple[float, Callable[[], float]] | None = None
        self._channel.forget()

    def call_timeout(self) -> float:
        """The longest the next call may wait for gpud: :data:`CALL_TIMEOUT_S`, less as
        the interpreter's exit nears its deadline, so that every report made at exit waits
        one call's deadline in all (a ``send`` given should wait no longer). At or past
        that deadline, 0: the report is dropped and counted, not sent."""
        if self._until is None:
            return CALL_TIMEOUT_S
        deadline, clock = self._until
        return max(0.0, min(CALL_TIMEOUT_S, deadline - clock()))

    def _grpc_send(self, job: str, seconds: list[float], age_s: float | None) -> None:
        from gpud.v1 import colo_pb2

        self._channel.stub().ReportLatency(
            colo_pb2.ReportLatencyRequest(job=job, seconds=seconds, age_s=age_s),
            timeout=self.call_timeout(),
            metadata=self._channel.metadata,
        )

    def observe(self, seconds: float) -> None:
        """One request's latency, in seconds. One gpud would refuse (negative: a clock that
        stepped back; NaN; over ``MAX_LATENCY_S``) is dropped here, so that the rest of its
        batch is not refused with it. The batch, this request with it, is sent once
        ``flush_every_s`` passed since the last send, and gpud counts it from its arrival.
        Only a batch held through a quiet spell (its newest request finished more than
        ``flush_every_s``, at most :data:`HELD_UNAGED_MAX_S`, before this one) goes on its own, saying its age: gpud counts it
        from when its earliest request began, so a GPU's hang then, or the loop off, is not
        read as what the GPU does now; this request follows it at once, counted from its
        arrival. What is held at exit is sent then (waiting up to :data:`CALL_TIMEOUT_S`).
        Never waits for gpud (unless ``background=False``, or no thread can start) and
        never raises."""
        if self.last_error:  # no gRPC: no thread, no call, nothing waits at exit
            with self._lock:  # observe() may be called from several threads
                self.dropped += 1
            return
        seconds = float(seconds)
        if not 0.0 <= seconds <= MAX_LATENCY_S:
            return
        with self._lock:
            now = self._clock()
            held = None
            if self._batch and now - self._newest > self._quiet:
                held = self._take(now, aged=True)
            self._batch.append(seconds)
            self._began = min(self._began, now - seconds)
            self._newest = now
            taken = None
            if held or len(self._batch) >= self._max or now - self._last >= self._every:
                taken = self._take(now, aged=False)
        for report in (held, taken):
            if report is not None:
                self._deliver(report)

    def flush(self, timeout: float = 2 * CALL_TIMEOUT_S) -> bool:
        """Send what was collected now: saying its age if it was held through a quiet
        spell (its newest request finished more than ``flush_every_s``, at most
        :data:`HELD_UNAGED_MAX_S`, ago), and wait up
        to ``timeout`` seconds for the sender thread to deliver every report so far. True
        once none is left waiting nor in a call (delivered, or dropped and counted in
        :attr:`dropped`)."""
        with self._lock:
            now = self._clock()
            taken = self._take(now, aged=now - self._newest > self._quiet)
        self._deliver(taken)
        with self._ready:
            return self._ready.wait_for(lambda: not self._pending and not self._sending, timeout)

    def close(self, timeout: float = 2 * CALL_TIMEOUT_S) -> bool:
        """:meth:`flush`, then end the sender thread (a call still in gpud ends at its
        deadline). Reports still waiting for it when ``timeout`` ran out (behind a call
        gpud does not answer) are never sent: they are dropped and counted in
        :attr:`dropped`. A report another thread handed over after the flush is sent by
        the thread, which then ends (a non-daemon one no longer holds the interpreter's
        exit); a report made after that is sent by a new thread."""
        done = self.flush(timeout)
        with self._ready:
            if not done:
                self._drop_waiting()
            # a report another thread handed over since flush() returned is no report left
            # behind a hung call: the sender thread sends it, then ends, not waiting idle
            # (with an infinite flush_every_s for ever, which keeps a non-daemon one's
            # interpreter from exiting)
            if not self._pending:
                self._sender = 0
            else:
                self._ending = True
            self._ready.notify_all()
        return done

    def _take(self, now: float, *, aged: bool) -> _Report:
        """The batch, when its earliest request began, whether it is ``aged`` and ``now``,
        the batch emptied. Under the lock."""
        report = (self._batch, self._began, aged, now)
        self._batch = []
        self._began, self._newest, self._last = math.inf, -math.inf, now
        return report

    def _deliver(self, report: _Report) -> None:
        if not (report[0] and self.job):
            return
        if not self._background:
            self._call(report)
            return
        with self._ready:
            if self._sender or self._start_sender():
                if len(self._pending) >= self._max_pending:
                    self.dropped += len(self._pending.popleft()[0])
                self._pending.append(report)
                self._ready.notify_all()
                return
            self._sending += 1
        self._call_in_flight(report)

    def _start_sender(self) -> bool:
        """Start a sender thread (the first report, the first since :meth:`close` or an
        idle end); False where none can start. Under ``_ready``."""
        self._senders += 1
        self._sender = self._senders
        self._ending = False
        try:
            self._start(
                functools.partial(_send_for, weakref.ref(self), self._sender),
                f"gpud-latency-{self.job}",
            )
        except RuntimeError:  # "can't start new thread": the pids limit, shutdown
            # no thread will send what waits: dropped; the report at hand goes on this one
            self._sender = 0
            self._drop_waiting()
            return False
        return True

    def _drop_waiting(self) -> None:
        """The reports waiting for a sender thread that none will send: dropped and
        counted. Under ``_ready``."""
        self.dropped += sum(len(waiting[0]) for waiting in self._pending)
        self._pending.clear()

    def _next(self, me: int) -> _Report | None:
        """The report sender thread ``me`` sends next, counted in flight; None once it is
        to end: closed (once what close() left it is sent), or ``idle_s`` passed with
        nothing to send."""
        with self._ready:
            while self._sender == me and not self._pending:
                # closed, what close() left sent: no idle wait (with an infinite
                # flush_every_s for ever)
                ended = self._ending or not self._ready.wait(self._idle)
                if ended and not self._pending:
                    self._sender = 0  # the next report starts another
            if self._sender != me:
                return None
            self._sending += 1
            return self._pending.popleft()

    def _call_in_flight(self, report: _Report) -> None:
        """:meth:`_call` for a report counted in ``_sending``, that count then lowered."""
        try:
            self._call(report)
        finally:
            with self._ready:
                self._sending -= 1
                self._ready.notify_all()

    def _call(self, report: _Report) -> None:
        """One report; its age (clamped to ``MAX_REPORT_AGE_S``) where it was held through
        a quiet spell or waited longer than ``flush_every_s`` (at most
        :data:`HELD_UNAGED_MAX_S`; at least a call's deadline) to
        be sent. Never raises: a failure of the clock or the call drops and counts it, as
        does the exit's deadline passed (:meth:`call_timeout`)."""
        batch, began, aged, taken = report
        try:
            if self.call_timeout() <= 0.0:
                raise TimeoutError("past the exit's deadline")
            now = self._clock()
            late = now - taken > max(self._quiet, CALL_TIMEOUT_S)
            age = min(MAX_REPORT_AGE_S, max(0.0, now - began)) if aged or late else None
            self._send(self.job, batch, age)
        except Exception:  # the daemon may be away: drop the batch, never fail the job
            with self._ready:
                self.dropped += len(batch)


def _send_for(ref: weakref.ref[Latency], me: int) -> None:
    """Sender thread number ``me`` of a :class:`Latency`: one call at a time, oldest report
    first, until it is closed, idle or collected (held only while it sends or waits)."""
    while (lat := ref()) is not None and (report := lat._next(me)) is not None:
        lat._call_in_flight(report)
        del lat


def _start_daemon(target: Callable[[], None], name: str) -> None:
    # a daemon: a gpud that never answers must not keep the job from exiting
    threading.Thread(target=target, name=name, daemon=True).start()


def _close_at_exit(
    live: Iterable[Latency] | None = None, clock: Callable[[], float] = time.monotonic
) -> None:
    """Send what every live :class:`Latency` holds (``live``: those of :data:`_LIVE`), as
    the interpreter exits: all handed to their threads first, then waited for
    :data:`CALL_TIMEOUT_S` in all, by ``clock``, so that a gpud that never answers delays a
    job's exit by one call's deadline, however many it made. Where the reports are sent on
    this thread (``background=False``; 3.12+, which starts no thread at shutdown) each call
    waits only what is left of that deadline, and one made after it is dropped and
    counted."""
    live = list(_LIVE if live is None else live)
    deadline = clock() + CALL_TIMEOUT_S
    for lat in live:
        lat._until = (deadline, clock)
    for lat in live:
        lat.flush(timeout=0)
    for lat in live:
        lat.close(timeout=max(0.0, deadline - clock()))


def _fresh_in_child() -> None:
    # the parent's process-wide Throttle is the parent's (its iterations, its count of
    # reports) and its lock may have been held by another of the parent's threads at the
    # fork: the child makes its own at its first throttle_point()
    _default_lock[0] = threading.Lock()
    _default.clear()
    for t in list(_THROTTLES):
        t._forked()
    for lat in [*_LIVE, *_INERT]:
        lat._fresh()


atexit.register(_close_at_exit)
os.register_at_fork(after_in_child=_fresh_in_child)
