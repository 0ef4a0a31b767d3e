"""Blocking calls awaited from the event loop on threads that never hold up gpud's exit, the
loop's worker pool that says when an API call's work began on it, and the loops' waits for
the first of several events."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# seconds gpud's exit waits, once its event loop closed, for the loop's worker threads to
# end; one still stuck (in a driver call that hangs) is left, and the process exits
EXIT_GRACE_S = 1.0


class WorkStart:
    """Whether a held API call's work began, and the threads that run it.

    The call may be dropped (:meth:`drop`, its caller gone) only while none of it ran: its
    first step on the loop ended (:meth:`first_step_over`) with its one change handed to the
    loop's pool (:class:`StartTellingExecutor`) and still queued behind busy workers. Any
    other first wait (another pool, a daemon thread of its own, a sleep) or a second step
    makes it begun: a step of it may have run, so it runs to its end. The loop-side code of
    its first step, up to its first suspension (not its first ``await``: awaiting a lock no
    one holds, or a coroutine that does not wait, goes on in the same step), is taken to
    change nothing, so a held servicer's first step hands its change on at once
    (``asyncio.to_thread``, :func:`on_daemon_thread`). :meth:`begin`
    (the worker, as it takes the work) and :meth:`drop` (the loop) race under a lock, and only
    the first wins. Only the call's own task (:meth:`own`) queues droppable work: a task it
    starts carries :data:`WORK_START` too, but its work is never skipped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued = False
        self._begun = False
        self._dropped = False
        self._first_step_over = False
        # weak: the task's context holds this (WORK_START), and a cycle would keep each
        # changing call's task, its request and its frames until the cyclic collector ran
        self._owner: weakref.ref[asyncio.Task[Any]] | None = None
        self._threads: list[Future[Any]] = []

    @property
    def begun(self) -> bool:
        with self._lock:
            return self._begun

    def own(self) -> None:
        """The running task is the call's own: only its work may be dropped."""
        task = asyncio.current_task()
        self._owner = None if task is None else weakref.ref(task)

    def owned_here(self) -> bool:
        """Whether the caller runs in the call's own task (False on a worker thread)."""
        # a collected owner reads as None, and so does current_task() in a loop callback:
        # that is no task of the call's
        owner = None if self._owner is None else self._owner()
        try:
            return owner is not None and asyncio.current_task() is owner
        except RuntimeError:  # no loop in this thread: a worker that submits more
            return False

    def first_step_over(self) -> None:
        """The call's task ended its first step: work handed on from now is after one."""
        with self._lock:
            self._first_step_over = True
            if not self._queued:
                self._begun = not self._dropped

    def queued(self) -> bool:
        """Its work was queued for a worker: True while it may still be dropped (False
        once dropped: what the task hands on after, its cleanup, runs)."""
        with self._lock:
            if self._dropped:
                return False
            if self._first_step_over:
                self._begun = not self._dropped
            else:
                self._queued = True
            return not self._begun

    def begin(self) -> bool:
        """The work may run: False once :meth:`drop` won (the thread must not run it)."""
        with self._lock:
            if not self._dropped:
                self._begun = True
            return self._begun

    def drop(self) -> bool:
        """None of the call's work is to run: True only while all of it so far waits in the
        queue (none begun, nothing run elsewhere)."""
        with self._lock:
            if self._queued and not self._begun:
                self._dropped = True
            return self._dropped

    def running_on(self, thread: Future[Any]) -> None:
        """``thread`` (a worker's or a daemon thread's) runs some of the call's work."""
        with self._lock:
            self._threads = [t for t in self._threads if not t.done()]
            self._threads.append(thread)

    def threads(self) -> list[Future[Any]]:
        """The call's work still running (or queued) on threads: what a stop waits for
        before the store and the driver close under it."""
        with self._lock:
            self._threads = [t for t in self._threads if not t.done()]
            return list(self._threads)


# the call whose work the loop hands to a thread now (None outside a held API call):
# asyncio.to_thread submits from the awaiting task's context, so the pool reads it there
WORK_START: contextvars.ContextVar[WorkStart | None] = contextvars.ContextVar(
    "gpud_work_start", default=None
)


class StartTellingExecutor(ThreadPoolExecutor):
    """The loop's worker pool: work a held call's own task submits under a
    :data:`WORK_START` marks it begun as a worker takes it, and is skipped (never run) when
    the call dropped it while it queued behind busy workers. Its tasks' work is only
    recorded, so that a stop waits for it."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        start = WORK_START.get()
        if start is None:
            return super().submit(fn, *args, **kwargs)
        if not start.owned_here():
            start.begin()
            future = super().submit(fn, *args, **kwargs)
        elif start.queued():

            def run() -> T:
                if not start.begin():
                    # its caller went away before a worker was free
                    raise concurrent.futures.CancelledError
                return fn(*args, **kwargs)

            future = super().submit(run)
        else:
            future = super().submit(fn, *args, **kwargs)
        start.running_on(future)
        return future


async def on_daemon_thread(
    fn: Callable[[], T], spawn: Callable[..., threading.Thread] = threading.Thread
) -> T:
    """``fn()`` on a daemon thread of its own, awaited. Not the loop's executor: for calls
    that may hang in a program gpud runs (``nft``, ``dcb``, a control daemon) or in the
    driver (a GPU that starts hanging mid-command under a MIG apply), which ``asyncio.run``
    would otherwise wait for at exit, past the stop's budget (and systemd's SIGKILL).
    ``spawn`` makes the thread (``threading.Thread``)."""
    loop = asyncio.get_running_loop()
    start = WORK_START.get()
    ended: Future[None] = Future()
    if start is not None:
        start.begin()  # its thread starts now, not behind others
        start.running_on(ended)
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, err: BaseException | None) -> None:
        if done.done():
            return  # the caller stopped waiting
        if err is not None:
            done.set_exception(err)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def call() -> None:
        result: T | None = None
        err: BaseException | None = None
        try:
            result = fn()
        except BaseException as exc:
            err = exc
        ended.set_result(None)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, result, err)

    try:
        spawn(target=call, name=f"gpud:{getattr(fn, '__qualname__', 'call')}", daemon=True).start()
    except BaseException:
        # no thread (the process is out of threads): a stop must not wait for one
        ended.set_result(None)
        raise
    return await done


async def wait_first(*events: asyncio.Event, timeout: float | None = None) -> None:
    """Until one of ``events`` is set or ``timeout`` seconds have passed (None: no limit);
    the caller looks at which ones are set. A wait cancelled leaves nothing behind."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
