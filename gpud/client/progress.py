"""Training progress reports to the local gpud, from inside the training loop.

::

    from gpud.client import Progress

    progress = Progress()            # job, socket, token: GPUD_JOB / GPUD_SOCKET /
                                     # GPUD_REPORT_TOKEN (gpuctl run)
    for batch in loader:
        train_step(batch)
        progress.step()              # ~0.2 us: a counter, a clock read and a deque append
    progress.close()                 # optional: flushes what is left (also done at exit)

:meth:`Progress.step` never blocks and never raises (and may be called from several threads):
it records ``(iterations, time)`` in a bounded buffer, and a background thread sends the buffer
to gpud
(``gpud.v1.Net/ReportProgressBatch``) every ``flush_interval_s``. When the daemon is down or
restarting the buffer keeps the newest ``max_buffer`` reports and drops the oldest
(:attr:`Progress.dropped` counts them), and the reports arrive within a fraction of a
second of gpud listening again, whether it started after the job or restarted under it: the
thread's call waits inside gRPC for the channel to connect (no report is built or sent in the
meantime), and the channel tries to connect a few times a second (``_RECONNECT_MAX_MS``), a
failed ``connect()`` on a local socket each. A call that fails at once (gpud refusing it
whole, an error of its own) is retried with a back-off. Reports that gpud rejects (e.g. a job it does not know,
another job's), or a call it refuses whole (invalid; over TCP without the run's
``GPUD_REPORT_TOKEN``), are dropped and counted in :attr:`Progress.rejected`,
with the reason in :attr:`Progress.last_error`. While gpud is away, :attr:`Progress.last_error`
says so as of the sender thread's last try (one every ``call_timeout_s``): ``gpud
unreachable at /run/gpud/gpud.sock since 2026-12-05 21:45:03 (12 s): 60 reports buffered,
0 dropped (the buffer keeps the newest 10000)``; once gpud is back, for how long it was
away and how many reports that outage dropped. A gpud that is connected but answers no call
within ``call_timeout_s`` (overloaded, stopped in a debugger) is said apart: ``gpud at
/run/gpud/gpud.sock did not answer within 2 s (call_timeout_s) since ...``. A socket closed to
the job's user (not root, not in gpud's ``api.socket_group``) is said as such: ``permission
denied on gpud's socket /run/gpud/gpud.sock to uid 1001 (run the job as root or as a member
of gpud's api.socket_group) since ...``. A socket path that holds a regular file or a
directory (``$GPUD_SOCKET`` set wrong) is said with it: ``gpud unreachable at /tmp/gpud (a
regular file, not a socket: $GPUD_SOCKET or socket= names gpud's socket, api.socket in its
configuration) since ...`` (``target=`` named instead where one was given; ``a component of
the path is a regular file`` where a directory above the socket is a file).

On a node where a launcher starts one process per GPU (torchrun, DeepSpeed and Accelerate
set ``$LOCAL_RANK``), only local rank 0 reports by default: the ranks of a job step
together, one rank's count is the job's pace, and ranks reporting apart would interleave
counts stamped microseconds apart, which skews the iteration time gpud learns. The other
ranks' ``Progress`` are inert (no thread, no socket; ``active=True`` makes one report).

A process forked from one that reports (PyTorch DataLoader workers, ``multiprocessing`` with
the fork start method) holds an inert copy: its steps are not sent (the parent sends its
own) and its exit does not wait for gpud. Create a new ``Progress`` in a child that reports:
a ``Progress`` imports gRPC and makes its channel (which connects at its first call) in the
thread that makes it, never in its sender thread, so a fork during a ``Progress``'s own work
never leaves the child a half-imported gRPC. A child forked while another thread of the
program was inside gRPC's import would wait for good on that module's lock: a ``Progress``
made there is inert, and :attr:`Progress.last_error` says gRPC was half-imported at a fork.
Where gRPC cannot be loaded (missing, broken) or its channel made (a socket path that is not
valid UTF-8), a ``Progress`` is inert too, with a warning logged and the reason in
:attr:`Progress.last_error`: a job never fails for its reports. Such a ``Progress`` (one
made where gRPC was half-imported at a fork too) counts each step in
:attr:`Progress.dropped`, as a ``Latency`` counts its requests, and its :meth:`Progress.flush`
returns True at once: every report is accounted for, as dropped.

What is buffered is sent by :meth:`Progress.close`, which the interpreter's exit runs
(waiting at most a second or two per live ``Progress`` for a gpud that is away); a process
that ends without running exit handlers (``os._exit``, SIGKILL, a signal it does not handle)
loses them (those of the last ``flush_interval_s``, and while gpud is away all it buffered),
and gpud learns its count from the next report of the job. After the close, what it could
not send is counted in :attr:`Progress.dropped`, a :meth:`Progress.step` still counts (never
blocking nor raising), its report dropped and counted likewise, and
:meth:`Progress.flush` returns True at once; but a try of the sender that the close could
not wait for may send yet: until it ends, ``dropped`` counts as the sender does and
``flush`` waits for it (up to its ``timeout``, or ``call_timeout_s`` and a second).

Each ``Progress`` is one *session*: a job restarted from a checkpoint may report a lower
iteration count than its previous process did (pass ``start=`` to continue counting).
Sessions that report at once (ranks with ``active=True``) are ranks of one job, not
restarts: gpud counts the job at its lowest rank's count and pace.

Only the standard library and ``grpc`` (with the generated ``gpud.v1`` messages) are used.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import stat
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

JOB_VAR = "GPUD_JOB"
SOCKET_VAR = "GPUD_SOCKET"
# the run's secret (gpud.jobs.env), sent with each call as the metadata TOKEN_KEY
# (gpud.api.access): over TCP gpud takes no report without it
TOKEN_VAR = "GPUD_REPORT_TOKEN"
TOKEN_KEY = "gpud-report-token"
# set by torchrun, DeepSpeed and Accelerate: a process's rank among its node's
RANK_VAR = "LOCAL_RANK"
DEFAULT_SOCKET = Path("/run/gpud/gpud.sock")
# Reports per call: the API's bound on a repeated field (gpud.api.validate.MAX_REPEATED),
# which also keeps a call of long job names well within its bound on a request's size.
MAX_BATCH = 256
_MAX_BACKOFF_S = 5.0
# gRPC's reconnect back-off grows to 120 s by default, so a report could wait minutes after
# a long outage; capped, a job finds gpud back within this, at a failed connect() per try.
_RECONNECT_MAX_MS = 250
# a connect() to tell a slow gpud from an absent one, after a call ran to its deadline
_PROBE_S = 0.5
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", _RECONNECT_MAX_MS),
)


class Progress:
    """Reports a job's completed iterations to gpud; see the module docstring.

    ``job`` defaults to ``$GPUD_JOB``, ``socket`` to ``$GPUD_SOCKET`` or
    ``/run/gpud/gpud.sock``; ``target`` (a gRPC target such as ``"unix:/run/gpud/gpud.sock"``
    or ``"127.0.0.1:50051"``) overrides the socket. ``contention_free_iteration_s`` is the
    iteration time the job has alone on the network, when profiled (gpud learns it
    otherwise). ``token`` defaults to ``$GPUD_REPORT_TOKEN`` (``gpuctl run`` sets it): it
    proves to gpud that the reports come from the job's run. ``active``: whether this one reports; by default unless ``$LOCAL_RANK`` names
    a rank other than 0. ``wait(event, timeout)``: the sender thread's pause before each try,
    ended early by a flush or close (``threading.Event.wait``); each try is a gRPC call.
    """

    def __init__(
        self,
        job: str | None = None,
        *,
        socket: Path | str | None = None,
        target: str | None = None,
        contention_free_iteration_s: float | None = None,
        start: int = 0,
        flush_interval_s: float = 0.2,
        max_buffer: int = 10_000,
        call_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        active: bool | None = None,
        token: str | None = None,
        wait: Callable[[threading.Event, float], bool] = threading.Event.wait,
    ) -> None:
        name = job or os.environ.get(JOB_VAR, "")
        if not name:
            raise ValueError(f"no job name: pass job= or run under gpuctl run (${JOB_VAR})")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        if max_buffer < 1:
            raise ValueError(f"max_buffer must be >= 1, got {max_buffer}")
        if contention_free_iteration_s is not None and not contention_free_iteration_s > 0:
            raise ValueError("contention_free_iteration_s must be > 0")
        self.job = name
        # what names gpud's socket, for an operator to set right where it names no socket
        self._named_by = "target=" if target is not None else f"${SOCKET_VAR} or socket="
        if target is None:
            path = Path(socket or os.environ.get(SOCKET_VAR) or DEFAULT_SOCKET)
            target = f"unix:{path.absolute()}"
        self.target = target
        self._metadata = token_metadata(token)
        # where gpud is, as an operator names it: the socket's path, or the target given
        self._where = target.removeprefix("unix:")
        self.session = os.urandom(8).hex()
        self._dropped = 0
        # gRPC could not be loaded or its channel made: every step's report is dropped
        self._unreported = False
        self.rejected = 0
        self.sent = 0
        self.last_error = ""
        self._ideal = contention_free_iteration_s
        self._count = start
        self._clock = clock
        self._interval = flush_interval_s
        self._timeout = call_timeout_s
        self._wait = wait
        self._max_buffer = max_buffer
        # step() appends here (a deque append is atomic); the sender thread drains it.
        self._queue: deque[tuple[int, float]] = deque(maxlen=max_buffer)
        self._appended = 0  # reports step() made, to count what maxlen dropped
        self._highest = start  # the highest count drained (the sender thread's)
        self._drained = 0
        self._pending: deque[tuple[int, float]] = deque()  # drained, not yet accepted
        # reports step() made that the sender has accounted for (sent, rejected or dropped,
        # last_error said): flush() waits on this, not on _pending, which empties before the
        # try that emptied it has counted them (set under _flushed)
        self._settled = 0
        self._stop = threading.Event()
        # closed and its sender ended (the sender sets it on its way out): what is not sent
        # by now never will be, and is dropped
        self._closed = False
        self._wake = threading.Event()
        self._flushed = threading.Condition()
        self._channel: Any = None
        # close() and the sender take the channel under it: a stub made on a channel
        # closed meanwhile crashes gRPC (a segfault), so a sender close() left behind makes
        # its own instead
        self._channel_lock = threading.Lock()
        # while gpud is away: since when (the clock's time) and how many were dropped before
        self._away: tuple[float, int] | None = None
        # whether the last failed try met a slow gpud, or a socket that refuses this user
        # (else gpud was unreachable)
        self._slow = False
        self._denied = False
        # what the socket's path holds where it is no socket (a regular file): said with
        # the unreachable gpud, as the path, not gpud, is then what is wrong
        self._not_socket = ""
        self._thread = threading.Thread(target=self._run, name=f"gpud-progress-{name}", daemon=True)
        _made.add(self)  # a forked child makes a copy of each, live or not
        self.active = active if active is not None else os.environ.get(RANK_VAR, "0") in ("", "0")
        if not self.active:
            self._stop.set()  # another rank reports: steps are counted, never sent
            return
        # The channel (it connects at the first call) is made here, in the caller's thread,
        # before the sender starts: that imports all of gRPC the sender uses. A sender that
        # imported it at its first send raced the program's own imports (a half-imported
        # grpc killed the thread), and a fork meanwhile (a DataLoader worker) left the
        # child's grpc half-imported for good: a Progress made there never sent.
        self._channel, why, _ = load_grpc(
            lambda: _grpc_modules()[0].insecure_channel(target, options=_CHANNEL_OPTIONS),
            self._where,
            ("gpud.v1.net_pb2", "gpud.v1.net_pb2_grpc"),
        )
        if self._channel is None:
            # a job never fails for its reports: this one counts steps and sends none
            self.last_error = why
            log.warning("progress of %s is not reported: %s", name, why)
            self._unreported = True
            self._stop.set()
            return
        self._thread.start()
        atexit.register(self.close)

    @property
    def iterations(self) -> int:
        return self._count

    @property
    def dropped(self) -> int:
        """Reports made by :meth:`step` that gpud will never be sent: the oldest, past
        ``max_buffer`` while gpud is away; where gRPC could not be loaded or its channel
        made (:attr:`last_error` says why), every one, as a ``Latency`` counts its
        requests then; once :meth:`close` stopped the sender, every one not sent nor
        rejected by then (gpud away at the close) and every step after it, once the sender
        ended: until a try the close could not wait for ends (it may send yet), as the
        sender counts them, the reports it still holds not among them. A rank that does not
        report (``active=False``) and a forked copy drop none: their steps are not theirs
        to send."""
        if self._unreported:
            return self._appended
        if self._closed:
            return self._appended - self.sent - self.rejected
        return self._dropped

    def step(self, n: int = 1) -> None:
        """``n`` more iterations completed now. Never blocks, never raises, closed or not:
        after :meth:`close` the count goes on (:attr:`iterations`) and the report, which no
        sender is left to send, is counted in :attr:`dropped`."""
        self._count += n
        self._queue.append((self._count, self._clock()))
        self._appended += 1

    def flush(self, timeout: float | None = None) -> bool:
        """Send what is buffered now; True once everything so far was sent (or rejected or
        dropped) and the try that did it has counted it: :attr:`sent`, :attr:`rejected` and
        :attr:`last_error` say so when it returns. False at ``timeout`` (gpud away, say).
        After :meth:`close`, True at once: nothing is left to send, what was not sent (at the
        close, or stepped since) is counted in :attr:`dropped`; but while a sender the close
        could not wait for still runs (a try it began before the close), it waits up to
        ``timeout`` for it to end (``call_timeout_s`` and a second if None), False if it has
        not."""
        target = self._appended
        if not self.active:
            return True  # nothing of this rank's is to be sent
        if self._stop.is_set():  # closed, or a forked copy: nothing more is sent
            if self._thread.is_alive() and self._thread is not threading.current_thread():
                # a sender the close left behind, still trying: its call ends within
                # call_timeout_s; one stuck before it (in an import) is not waited for on end
                bound = self._timeout + 1.0 if timeout is None else timeout
                self._thread.join(bound)
            # without gRPC, or closed, every report not sent is dropped, and so accounted for
            return self._unreported or self._closed or self._settled >= target
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._flushed:
            self._wake.set()
            while self._settled < target:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._flushed.wait(left if left is not None else 0.5)
                self._wake.set()
        return True

    def close(self, timeout: float = 1.0) -> None:
        """Flush (up to ``timeout`` seconds) and stop the sender thread, waiting for it up to
        ``timeout`` again: twice ``timeout`` in all at most. Idempotent. What is not sent by
        then (gpud away) never is: it is counted in :attr:`dropped`, as is each
        :meth:`step` after the close (which still never blocks nor raises), and a
        :meth:`flush` after it returns True at once, everything accounted for. A sender
        still in a try when the join gives up (stuck in an import, say) may send that try
        yet: until it ends, :attr:`dropped` counts as the sender does (never less than it
        said at the close) and it closes the channel it may make."""
        if self._stop.is_set():
            return
        self.flush(timeout)
        self._stop.set()
        self._wake.set()
        with self._channel_lock:
            channel, self._channel = self._channel, None
            if channel is not None:
                channel.close()  # ends a call still waiting for gpud at once, not at its deadline
        self._thread.join(timeout)
        atexit.unregister(self.close)

    def _forked(self) -> None:
        """In a forked child: the sender thread is not there, its locks may have been held at
        the fork and the buffer is the parent's to send. Nothing is sent from here (the copy
        reports as a rank that does not: ``active`` False, nothing dropped, its own steps
        counted, an inert parent's too); the parent's gRPC channel is left alone (closing it
        in a child hangs)."""
        self.active = False
        self._dropped = 0
        self._unreported = False
        self._closed = False  # the parent's close: the copy is inert, as if never closed
        self._stop = threading.Event()
        self._stop.set()
        self._wake = threading.Event()
        self._flushed = threading.Condition()
        self._channel_lock = threading.Lock()
        self._queue = deque(maxlen=self._max_buffer)
        self._pending = deque()
        self._appended = self._drained = self._settled = 0
        self._channel = None
        atexit.unregister(self.close)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the sender thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._send_until_closed()
        finally:
            # the sender, not close(), marks the close done: a sender the close could not
            # wait for may still make a channel (close() closed and dropped its) and send;
            # until here dropped counts as the sender does, so that late send never lowers it
            with self._channel_lock:
                channel, self._channel = self._channel, None
                if channel is not None:
                    channel.close()
            self._closed = True

    def _send_until_closed(self) -> None:
        backoff = self._interval
        while not self._stop.is_set():
            self._wait(self._wake, backoff)
            self._wake.clear()
            # should this try find gpud away: its outage began here, with these dropped before
            tried, dropped = self._clock(), self.dropped
            self._drain()
            if not self._pending:
                backoff = self._interval
                self._settle()
                continue
            started = time.monotonic()
            said = self.last_error
            try:
                self._send()
                backoff = self._interval
                self._back(rejected=self.last_error != said)
            except Exception as err:  # any transport failure: keep the reports, retry later
                self.last_error = self._unreachable(err, tried, dropped)
                backoff = self._backoff(backoff, time.monotonic() - started)
            self._settle()

    def _unreachable(self, err: Exception, tried: float, dropped: int) -> str:
        """:attr:`last_error` for a try begun at ``tried`` (the clock's time), with
        ``dropped`` reports dropped before it, that failed with ``err``. The gRPC errors of a gpud that is away (no socket, nothing listening,
        a restart) are ``DEADLINE_EXCEEDED``, the call having waited for the channel to
        connect (or a gpud that answered nothing within ``call_timeout_s``), or
        ``UNAVAILABLE``: said as gpud unreachable since the first such try, with what the
        buffer holds and what the outage dropped. A ``DEADLINE_EXCEEDED`` while the channel
        is connected is a gpud that is there but did not answer in time: said so, with the
        deadline."""
        import grpc

        if not isinstance(err, grpc.RpcError):
            return str(err)
        code = err.code()
        if code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
            return str(err)
        if self._away is None:
            self._away = (tried, dropped)
        since, dropped = self._away
        refused = self._connect_error()
        self._slow = code == grpc.StatusCode.DEADLINE_EXCEEDED and refused is None
        self._denied = isinstance(refused, PermissionError)
        self._not_socket = _not_a_socket(self.target) if refused is not None else ""
        why = "" if code == grpc.StatusCode.DEADLINE_EXCEEDED else f" ({err.details()})"
        return (
            f"{self._failing(since)} ({self._since(since):.0f} s){why}:"
            f" {len(self._pending)} reports buffered, {self.dropped - dropped} dropped"
            f" (the buffer keeps the newest {self._max_buffer})"
        )

    def _failing(self, since: float, *, was: bool = False) -> str:
        """What kept reports from gpud since ``since``: gpud not there, too slow, or its
        socket closed to this process's user."""
        if self._denied:
            return (
                f"permission denied on gpud's socket {self._where} to uid {os.getuid()}"
                " (run the job as root or as a member of gpud's api.socket_group)"
                f" {'from' if was else 'since'} {_local(since)}"
            )
        if self._slow:
            within = f"did not answer within {self._timeout:g} s (call_timeout_s)"
            return f"gpud at {self._where} {within} {'from' if was else 'since'} {_local(since)}"
        where = self._where
        if self._not_socket:
            where += (
                f" ({self._not_socket}: {self._named_by} names gpud's socket, api.socket in"
                " its configuration)"
            )
        if was:
            return f"gpud was unreachable at {where} from {_local(since)}"
        return f"gpud unreachable at {where} since {_local(since)}"

    def _since(self, since: float) -> float:
        """Seconds from ``since`` to now, at least 0: the wall clock may have stepped back."""
        return max(0.0, self._clock() - since)

    def _connect_error(self) -> OSError | ValueError | None:
        """None when gpud's socket takes a connection now, else why not (``PermissionError``:
        the socket or a directory above it is closed to this user): a ``connect()``, closed
        at once (what ``gpuctl status`` would meet). gRPC's own view of the channel is not asked: watching
        it takes a thread that calls into gRPC, which keeps a fork (DataLoader workers) from
        running gRPC's fork handlers."""
        import socket

        target = self.target
        try:
            if (path := _unix_path(target)) is not None:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.settimeout(_PROBE_S)
                    sock.connect(path)
            else:
                host, _, port = target.rpartition("/")[2].rpartition(":")
                socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_S).close()
        except (OSError, ValueError) as err:
            return err
        return None

    def _back(self, *, rejected: bool) -> None:
        """gpud answered: :attr:`last_error` says for how long it was away, if it was,
        unless it ``rejected`` reports just now (that reason is the one to read)."""
        if self._away is None:
            return
        since, dropped = self._away
        self._away = None
        if rejected:
            return
        self.last_error = (
            f"{self._failing(since, was=True)} for {self._since(since):.0f} s:"
            f" {self.dropped - dropped} reports dropped meanwhile"
        )

    def _backoff(self, backoff: float, waited: float) -> float:
        """The wait before the next try after one that failed in ``waited`` seconds.

        A call that ran to its deadline spent it waiting for gpud (or on a slow gpud): that
        was its back-off, and the next call waits for the channel at once, so a report goes
        out as soon as gpud listens. One that failed sooner backs off, up to 5 s."""
        if waited >= self._timeout:
            return self._interval
        return min(_MAX_BACKOFF_S, max(backoff * 2, 0.05))

    def _settle(self) -> None:
        """After a try, its counts and last_error set: with nothing left pending, all that
        was drained is accounted for, and a waiting flush() may return."""
        with self._flushed:
            if not self._pending:
                self._settled = self._drained
            self._flushed.notify_all()

    def _drain(self) -> None:
        upto = self._appended  # everything counted here is in the queue or popped below
        while True:
            try:
                count, at = self._queue.popleft()
            except IndexError:
                break
            # step() from several threads may append a count after a higher one (read
            # before the other thread's step, appended after it): by then that many were done
            self._highest = max(self._highest, count)
            self._pending.append((self._highest, at))
        self._drained = upto
        over = len(self._pending) - self._max_buffer
        for _ in range(max(0, over)):
            self._pending.popleft()
        self._dropped = max(0, upto - self.sent - self.rejected - len(self._pending))

    def _send(self) -> None:
        grpc, net_pb2, net_pb2_grpc = _grpc_modules()
        with self._channel_lock:
            if self._channel is None:
                self._channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
            stub = net_pb2_grpc.NetStub(self._channel)
        while self._pending:
            batch = [self._pending[i] for i in range(min(MAX_BATCH, len(self._pending)))]
            reports = []
            for count, at in batch:
                r = net_pb2.ReportProgressRequest(
                    job=self.job, iterations=count, timestamp_unix_seconds=at, session=self.session
                )
                if self._ideal is not None:
                    r.contention_free_iteration_s = self._ideal
                reports.append(r)
            try:
                # while gpud is away the call waits for the channel to connect instead of
                # failing at once: it goes out the moment gpud listens; not once close()
                # stopped the sender (this try woken by it), whose join would give up on it
                resp = stub.ReportProgressBatch(
                    net_pb2.ReportProgressBatchRequest(reports=reports),
                    timeout=self._timeout,
                    wait_for_ready=not self._stop.is_set(),
                    metadata=self._metadata,
                )
            except grpc.RpcError as err:
                refused = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)
                if err.code() not in refused:
                    raise  # gpud down, restarting, slow: kept and sent again
                # refused whole (invalid; over TCP without the run's token): sending it
                # again would be refused again, and block the reports after it for good
                for _ in batch:
                    self._pending.popleft()
                self._rejected_all(len(batch), err.details() or "invalid argument")
                continue
            for _ in batch:
                self._pending.popleft()
            self.sent += resp.accepted
            if resp.rejected:
                self._rejected_all(len(resp.rejected), resp.rejected[0].message)

    def _rejected_all(self, n: int, message: str) -> None:
        self.rejected += n
        if message != self.last_error:
            log.warning("gpud rejected progress reports of %s: %s", self.job, message)
        self.last_error = message


def _grpc_modules() -> tuple[Any, Any, Any]:
    """``grpc`` and the generated ``gpud.v1.net_pb2`` and ``net_pb2_grpc``, imported on
    first use: a job that makes no active ``Progress`` (a rank that does not report) never
    loads them."""
    import grpc

    from gpud.v1 import net_pb2, net_pb2_grpc

    return grpc, net_pb2, net_pb2_grpc


class Loaded(NamedTuple):
    """What :func:`load_grpc` found: ``value``, what ``load()`` made (None where gRPC could
    not be loaded or its channel made); ``why`` not ("" when loaded); ``error``, the
    exception behind it (None for a half-import, or when loaded)."""

    value: Any
    why: str
    error: Exception | None


def load_grpc(
    load: Callable[[], Any],
    where: str,
    modules: Sequence[str],
    *,
    outcome: str = "nothing is reported",
) -> Loaded:
    """gRPC and the generated ``modules`` the caller uses (``gpud.v1.colo_pb2``, ...)
    imported here, in the caller's thread, then ``load()`` (makes a channel to gpud at
    ``where``, its socket's path or target): what it made, or why not: gRPC or one of
    ``modules`` missing or broken, a path the channel cannot take (one not valid UTF-8), or
    gRPC or one of ``modules`` half-imported at the fork that made this process (a thread of
    the parent was inside its import: the child's import would wait for good on that
    module's lock, which no thread of the child holds; a module of gpud.v1 the caller does
    not import, half-imported there, is no matter); the reason ends with ``outcome``, what
    the caller does without gRPC. Never raises: a client made in a training program must not
    end it."""
    needed = ("grpc", *modules)
    half = [
        name
        for name in _half_at_fork
        if _within(name, needed) and _importing(sys.modules.get(name))
    ]
    if half:
        return Loaded(
            None,
            f"gRPC was half-imported at a fork ({half[0]}, imported by another thread of"
            f" the parent then): {outcome}",
            None,
        )
    for name in needed:
        try:
            importlib.import_module(name)
        except Exception as err:  # a missing or broken grpc must not end the job
            generated = "" if name == "grpc" else f"{name}, gpud's generated code: "
            return Loaded(None, f"gRPC not loaded ({generated}{err!r}): {outcome}", err)
    try:
        return Loaded(load(), "", None)
    except Exception as err:  # e.g. a path not valid UTF-8
        return Loaded(
            None,
            f"no gRPC channel to gpud at {where!r} (${SOCKET_VAR}, socket= or target=):"
            f" {err!r}: {outcome}",
            err,
        )


def _within(name: str, modules: Sequence[str]) -> bool:
    """Whether importing ``modules`` takes the module ``name``: one of them, a package
    above one (``gpud.v1``) or a module inside one (``grpc._channel``)."""
    return any(
        name == module or name.startswith(f"{module}.") or module.startswith(f"{name}.")
        for module in modules
    )


def _importing(module: object) -> bool:
    """Whether ``module`` is in the middle of its import (its module lock held)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


# the gRPC modules (and gpud.v1's) that were half-imported when this process was forked (set in the child)
_half_at_fork: list[str] = []


def token_metadata(token: str | None = None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that carries ``token`` (default: ``$GPUD_REPORT_TOKEN``); None
    without one (a job started by other means reports on the socket only)."""
    token = token if token is not None else os.environ.get(TOKEN_VAR, "")
    return ((TOKEN_KEY, token),) if token else None


def _unix_path(target: str) -> str | None:
    """The socket's path of a ``unix:`` gRPC target (``unix:PATH``, ``unix:///PATH``); None
    for another (TCP) target."""
    if not target.startswith("unix:"):
        return None
    path = target.removeprefix("unix:")
    return "/" + path.lstrip("/") if path.startswith("//") else path


def _not_a_socket(target: str) -> str:
    """What the path of a ``unix:`` ``target`` holds where it exists and is no socket (``a
    regular file, not a socket``, ``a directory, ...``, ``a file, ...``) or where a
    component of it is a regular file (``stat()``: ENOTDIR), else "" (a socket, nothing
    there, a path the kernel cannot take, a TCP target): a connect() to it is refused as if
    no gpud listened."""
    if (path := _unix_path(target)) is None:
        return ""
    try:
        mode = os.stat(path).st_mode
    except NotADirectoryError:
        return "a component of the path is a regular file"
    except (OSError, ValueError):  # ValueError: a NUL in the path, which no syscall takes
        return ""
    if stat.S_ISSOCK(mode):
        return ""
    if stat.S_ISREG(mode):
        return "a regular file, not a socket"
    return f"{'a directory' if stat.S_ISDIR(mode) else 'a file'}, not a socket"


def _local(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


# every Progress not yet collected, live or inert: a forked child holds a copy of each
_made: weakref.WeakSet[Progress] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    _half_at_fork[:] = [
        name
        for name, module in list(sys.modules.items())
        if name.partition(".")[0] == "grpc" or name.startswith("gpud.v1")
        if _importing(module)
    ]
    for progress in list(_made):
        progress._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
