"""Asking gpud once for what must be made once: a reservation or a queue entry (gpuctl run,
gpuctl jobs add --queue), asked again with the same request id when its answer was lost,
and a job's registration (gpuctl jobs add). Also the stop a signal sets while gpuctl waits."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from gpud.cli.context import EXIT_NOT_RUNNING, CliError, Context
from gpud.v1 import jobs_pb2 as pb
from gpud.v1 import queue_pb2, queue_pb2_grpc

# the first try again; each after waits twice as long, up to RELEASE_RETRY_MAX_S (a try
# while gpud is away is a refused connect() on a local socket)
RELEASE_RETRY_S = 0.25
RELEASE_RETRY_MAX_S = 2.0
# How many times in all `gpuctl run` asks gpud for a reservation whose answer did not come
# (each with the same request id, which gpud reserves once)
RESERVE_TRIES = 3
# How long after a Reserve or Enqueue got no answer `gpuctl run` keeps asking a gpud that
# is not running: a restart in progress (RestartSec=2s in gpud.service, then its start)
RESERVE_RESTART_WAIT_S = 30.0


class Stop:
    """Set by a signal handler, waited on by the main thread: a flag and a byte on a pipe,
    which the handler sets without a lock. A ``threading.Event`` set from a handler waits
    for its own lock whenever the signal lands while the main thread holds it (inside
    ``Event.wait``, between two polls): gpuctl then hangs, and every later SIGTERM or
    Ctrl-C waits behind it, until SIGKILL."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        # what ends a wait without setting it (an answer came: wake), drained by the wait
        self._woken, self._wake = os.pipe()
        os.set_blocking(self._woken, False)
        os.set_blocking(self._wake, False)
        self.signum: int | None = None  # the first signal that set it (None: Ctrl-C raised)
        self._set = False
        # the handlers its own replaced: put back by whatever takes the signals over next
        self.previous: dict[signal.Signals, Any] = {}

    def set(self, signum: int | None = None) -> None:
        if self.signum is None:
            self.signum = signum
        self._set = True
        with contextlib.suppress(BlockingIOError):  # a byte there already wakes the wait
            os.write(self._write, b"s")

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Whether it is set, after up to ``timeout`` seconds (at once once it is, or
        :meth:`wake` was called). A signal during select() runs the handler, and select()
        goes on (PEP 475) to find the byte it wrote."""
        if not self._set:
            import select  # imported here: only a waiting `gpuctl run` pays for it

            ready, _, _ = select.select([self._read, self._woken], [], [], max(timeout, 0.0))
            if self._woken in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._woken, 64)
        return self._set

    def wait_until(self, until: float, clock: Callable[[], float] = time.monotonic) -> bool:
        """Whether it is set, by ``until`` (read on ``clock``), at once once it is; a wake
        does not end this wait."""
        while not self._set and (left := until - clock()) > 0:
            self.wait(left)
        return self._set

    def wake(self) -> None:
        """From any thread: end the wait under way (or the next) without setting it."""
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake, b"w")

    def close(self) -> None:
        for fd in (self._read, self._write, self._woken, self._wake):
            os.close(fd)


class StoppedAsking(Exception):
    """A signal (``stop``) ended the asking again of :func:`asked_once` after a try that may
    have reached gpud: the run stops before its command started, as on a signal in any
    other wait before it (what such a try made names this gpuctl as its holder, and gpud
    lets it go once gpuctl exits)."""


def asked_once(
    ctx: Context,
    method: Callable[[Context], Any],
    request: pb.ReserveRequest | pb.AddJobRequest,
    stop: Stop,
    *,
    message: object | None = None,
    restart_wait_s: float = RESERVE_RESTART_WAIT_S,
    clock: Callable[[], float] = time.monotonic,
) -> Any:
    """``method(ctx)`` (a stub's method on the channel open then) called
    with ``message`` (default ``request``), asked again when a try may have reached gpud
    and no answer came (:attr:`CliError.unanswered`: past ``--timeout``, gpud went away
    during the call or closed the connection as it stopped), up to RESERVE_TRIES such tries
    in all: gpud keeps ``request.request_id`` with the reservation or queue entry it made
    and answers a try again with it, so a first try whose answer was lost is not done
    twice (an AddJobRequest has no id: a try again finds the job the lost try registered,
    ALREADY_EXISTS, which the caller judges). After such a try, a gpud not running (restarting) is asked again RELEASE_RETRY_S
    later, then less often (up to RELEASE_RETRY_MAX_S), for up to ``restart_wait_s`` after
    that try (by ``clock``); a signal (``stop``) ends the asking. A refusal gpud sent (its
    own UNAVAILABLE: starting, stopping, its database full) and a gpud not running at the
    first try are raised at once. The last failure is raised as gpud's error; what a try
    of ``gpuctl run`` may have made names that gpuctl as its holder, and gpud lets it go
    once it exits. :class:`StoppedAsking` when a signal ends the asking again."""
    asked_as, once = _asked_as(request)
    tries = 1
    away_since: float | None = None  # when a try that may have reached gpud got no answer
    interval = RELEASE_RETRY_S
    waiting = False  # said that it waits for gpud to be back
    while True:
        try:
            # The stub is taken for each try: a wait through a gpud restart has closed the
            # channel it started on.
            return ctx.call(method(ctx), request if message is None else message)
        except CliError as err:
            if stop.is_set():
                if away_since is not None:  # asking again: not this try's error to say
                    raise StoppedAsking from err
                raise
            if err.unanswered:
                if tries == RESERVE_TRIES:
                    raise
                tries += 1
                away_since, interval, waiting = clock(), RELEASE_RETRY_S, False
                _asking_again(err, asked_as, once)
            elif (
                away_since is None
                or err.exit_code != EXIT_NOT_RUNNING
                or err.error  # gpud's own refusal: it runs, and said no
                or clock() - away_since >= restart_wait_s
            ):
                raise
            elif not waiting:
                waiting = True
                _asking_again(
                    err,
                    asked_as,
                    f"while it restarts, for up to {restart_wait_s:g} s (Ctrl-C stops)",
                )
            ctx.close()  # a fresh channel: gpud may have restarted
            if stop.wait_until(clock() + interval, clock):
                raise StoppedAsking from err
            interval = min(RELEASE_RETRY_MAX_S, interval * 2)


def _asked_as(request: pb.ReserveRequest | pb.AddJobRequest) -> tuple[str, str]:
    """What a try again asks for, and how gpud keeps it from being made twice."""
    if isinstance(request, pb.AddJobRequest):
        return f"to register job {request.job.name}", "(a job it registered then is taken as made)"
    return f"as request {request.request_id}", "(gpud does it once)"


def _asking_again(err: CliError, asked_as: str, how: str) -> None:
    """Says on stderr why a Reserve, Enqueue or AddJob is asked again, in a sentence of its
    own after ``err``'s."""
    print(
        f"gpuctl: {str(err).rstrip('.')}. Asking again {asked_as} {how}.",
        file=sys.stderr,
        flush=True,
    )


def enqueued_once(
    ctx: Context,
    request: pb.ReserveRequest,
    stop: Stop,
    *,
    keep_unfeasible: bool = False,
    tried: Callable[[], object] | None = None,
) -> queue_pb2.QueueEntry:
    """``request`` queued (``Queue.Enqueue``) as :func:`asked_once` asks: with its
    ``request_id``, a lost answer's try again is answered the entry the first try made.
    ``tried`` is called before each try."""

    def enqueue(c: Context) -> Any:
        if tried is not None:
            tried()
        return _enqueue(c)

    entry: queue_pb2.QueueEntry = asked_once(
        ctx,
        enqueue,
        request,
        stop,
        message=queue_pb2.EnqueueRequest(request=request, keep_unfeasible=keep_unfeasible),
    )
    return entry


def _enqueue(ctx: Context) -> Any:
    return ctx.stub(queue_pb2_grpc.QueueStub).Enqueue
