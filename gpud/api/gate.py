"""The calls that change the node, counted while they run, so that a stop answers them.

A stop (``systemctl stop/restart gpud``) that cut off a ``gpuctl mig apply`` at the API's
short grace left gpuctl saying the outcome was unknown (exit 3) while gpud went on with the
apply on its worker thread and finished it. So at a stop the daemon closes the gate: a new
call that would start something on the node (:data:`STARTS`: a MIG apply, a reservation, a
queue entry, MPS limits, a job added or removed, a traffic pin or placement, a simulated
fault or workload, an XID cleared, a MIG layout forgotten) is refused with
``UNAVAILABLE`` ("gpud is stopping"), and the changing calls already running are waited for (:meth:`CallGate.drained`, bounded
by the daemon's ``CALL_STOP_WAIT_S``, cut short by :meth:`CallGate.cut`) so that their
callers get their answers before the server stops. The calls that end something
(:data:`ENDS`: ``Release``, ``Leave``) are still taken while the gate is closed, and
counted while they run: a ``gpuctl run`` told to stop with gpud (node shutdown) releases
its reservation and has its exit status kept. Reads, jobs' reports, ``Advise`` and a dry
run of an apply change nothing and are served throughout, uncounted.

::

    gate = CallGate()
    ApiServer(path, gate=gate, servicers=[...])
    ...
    gate.close()                          # new starts: UNAVAILABLE "gpud is stopping"
    await gate.drained(18.0)              # True: every running one was answered
    gate.cut()                            # (a second SIGTERM) drained() returns at once
    await gate.cut_held(0.5)              # what still runs is cancelled at its next await
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Final, Literal

from gpud.errors import Unavailable

APPLY_MIG: Final = "/gpud.v1.Mig/ApplyMig"

# the calls that start something on the node: refused once gpud is stopping
STARTS: Final = frozenset(
    {
        APPLY_MIG,  # unless a dry run
        "/gpud.v1.Jobs/AddJob",
        "/gpud.v1.Jobs/RemoveJob",
        "/gpud.v1.Jobs/Reserve",
        "/gpud.v1.Queue/Enqueue",
        "/gpud.v1.Mps/SetMpsLimits",
        "/gpud.v1.Net/PinLevel",
        "/gpud.v1.Net/PlaceProcess",
        "/gpud.v1.Node/InjectFault",
        "/gpud.v1.Node/RebootSim",
        "/gpud.v1.Node/SimWorkload",
        "/gpud.v1.Node/ClearXid",
        "/gpud.v1.Mig/ForgetMig",
    }
)
# the calls that end what a start began: taken while gpud is stopping, and waited for
ENDS: Final = frozenset({"/gpud.v1.Jobs/Release", "/gpud.v1.Queue/Leave"})

Kind = Literal["starts", "ends"] | None
# how often cut_held looks whether the cut calls' threads ended
THREAD_POLL_S: Final = 0.01
# a held call's work still on threads (gpud.threads.WorkStart.threads)
Threads = Callable[[], "list[concurrent.futures.Future[Any]]"]


def call_kind(method: str, request: Any) -> Kind:
    """``"starts"`` for a call of :data:`STARTS` (an apply that is not a dry run),
    ``"ends"`` for one of :data:`ENDS`, None for one that changes nothing."""
    if method == APPLY_MIG and getattr(request, "dry_run", False):
        return None
    if method in STARTS:
        return "starts"
    if method in ENDS:
        return "ends"
    return None


class CallGate:
    """Counts the running calls that ``kind(method, request)`` names; refuses new
    ``"starts"`` once :meth:`close` was called. Used from the server's event loop only."""

    def __init__(self, kind: Callable[[str, Any], Kind] = call_kind) -> None:
        self._kind = kind
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._cut = asyncio.Event()
        self._closed = False
        # the changing calls' work that runs on when its caller goes away (interceptors),
        # each with what says which of its threads still run
        self._held: dict[asyncio.Future[Any], Threads] = {}
        # those of calls ended (cut) while a thread of theirs still ran
        self._left: list[Threads] = []
        # the threads a cut_held waited for to its deadline: a later one (the stop's second)
        # does not wait for them again, so a hung driver call holds the stop up once; kept
        # per thread, so one a call started since (its cleanup's) is still waited for
        self._waited: set[concurrent.futures.Future[Any]] = set()

    @property
    def running(self) -> int:
        return self._running

    def closed(self) -> bool:
        """Whether gpud is stopping (safe to call from any thread)."""
        return self._closed

    def close(self) -> None:
        self._closed = True

    def cut(self) -> None:
        """Stop now: :meth:`drained` no longer waits (a second SIGTERM or SIGINT); the stop
        then cuts what still runs (:meth:`cut_held`)."""
        self._cut.set()

    def hold(self, work: asyncio.Future[Any], threads: Threads = list) -> None:
        """``work`` (a changing call's, run on should its caller go away) is cancelled by
        :meth:`cut_held` while it runs; ``threads()``: its work still on threads (a worker
        in ``service.release()``, the driver), which cancelling ``work`` does not end."""
        # the calls whose threads all ended are dropped, or over gpud's uptime they would
        # pile up here; one with a thread still running (hung in the driver, say) is kept
        self._left = [left for left in self._left if left()]
        self._held[work] = threads

        def ended(work: asyncio.Future[Any]) -> None:
            if threads():
                self._left.append(threads)
            self._held.pop(work, None)

        work.add_done_callback(ended)

    async def cut_held(self, timeout_s: float) -> int:
        """Once the stop gives up waiting for them: cancel the calls' work still running (at
        its next ``await``) and wait up to ``timeout_s`` for it to end, and for its threads
        (a worker thread already in the driver or the store, which a cancel does not stop),
        before the event log, the store and the driver close under it. Threads an earlier
        call waited for to its end are not waited for again (those started since are). How
        many were cut."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        running = [work for work in self._held if not work.done()]
        for work in running:
            work.cancel()
        if running:
            await asyncio.wait(running, timeout=max(0.0, timeout_s))
        # polled, not awaited through wrap_future: a thread that ends after the loop closed
        # leaves no callback (nor an unretrieved error) behind; looked up again each time, so
        # a thread handed work meanwhile (a cut call's cleanup) is waited for too
        pending = self._unwaited()
        while pending and loop.time() < deadline:
            await asyncio.sleep(THREAD_POLL_S)
            pending = self._unwaited()
        self._waited = {thread for thread in self._waited if not thread.done()} | pending
        return len(running)

    def _unwaited(self) -> set[concurrent.futures.Future[Any]]:
        """The held and cut calls' threads still running that no cut_held waited for yet
        (the cut calls whose threads all ended are dropped on the way)."""
        running: set[concurrent.futures.Future[Any]] = set()
        left: list[Threads] = []
        for threads in self._left:
            theirs = [thread for thread in threads() if not thread.done()]
            if theirs:
                left.append(threads)
            running.update(theirs)
        self._left = left
        for threads in self._held.values():
            running.update(thread for thread in threads() if not thread.done())
        return running - self._waited

    @contextlib.contextmanager
    def call(self, method: str, request: Any = None) -> Iterator[None]:
        """Around a call's handler: counted while it runs if it changes the node; a start is
        refused with :class:`Unavailable` once the gate is closed."""
        kind = self._kind(method, request)
        if kind is None:
            yield
            return
        if kind == "starts" and self._closed:
            name = method.rsplit("/", 1)[-1]
            raise Unavailable(
                f"gpud is stopping: {name} was not started; run it again once gpud is back"
                " (systemctl status gpud)"
            )
        self._running += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()

    async def drained(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no counted call runs, or until :meth:`cut`; False
        if some still do."""
        idle = asyncio.ensure_future(self._idle.wait())
        cut = asyncio.ensure_future(self._cut.wait())
        try:
            await asyncio.wait(
                {idle, cut}, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            idle.cancel()
            cut.cancel()
        return self._running == 0
