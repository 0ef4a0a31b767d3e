"""Blocking calls awaited from the event loop on threads that never hold up gpud's exit, the
loop's worker pool that says when an API call's work began on it, and the loops' waits for
the first of several events."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# seconds gpud's exit waits, once its event loop closed, for the loop's worker threads to
# end; one still stuck (in a driver call that hangs) is left, and the process exits
EXIT_GRACE_S = 1.0


class WorkStart:
    """Whether a call's work began on a thread. Its work waits in :class:`StartTellingExecutor`'s
    queue once :meth:`queued`; :meth:`begin` (the worker, as it takes the work) and
    :meth:`drop` (the loop, its caller gone) race under a lock, and only the first wins.
    Work handed to any other pool or thread is taken as begun: nothing says when it does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued = False
        self._begun = False
        self._dropped = False

    @property
    def begun(self) -> bool:
        with self._lock:
            return self._begun

    def queued(self) -> None:
        with self._lock:
            self._queued = True

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


# the call whose work the loop hands to a thread now (None outside a held API call):
# asyncio.to_thread submits from the awaiting task's context, so the pool reads it there
WORK_START: contextvars.ContextVar[WorkStart | None] = contextvars.ContextVar(
    "gpud_work_start", default=None
)


class StartTellingExecutor(ThreadPoolExecutor):
    """The loop's worker pool: work submitted under a :data:`WORK_START` marks it begun as a
    worker takes it, and is skipped (never run) when the call dropped it while it queued
    behind busy workers."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        start = WORK_START.get()
        if start is None:
            return super().submit(fn, *args, **kwargs)
        start.queued()

        def run() -> T:
            if not start.begin():
                raise asyncio.CancelledError  # its caller went away before a worker was free
            return fn(*args, **kwargs)

        return super().submit(run)


async def on_daemon_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a daemon thread of its own, awaited. Not the loop's executor: for calls
    that may hang in a program gpud runs (``nft``, ``dcb``, a control daemon) or in the
    driver (a GPU that starts hanging mid-command under a MIG apply), which ``asyncio.run``
    would otherwise wait for at exit, past the stop's budget (and systemd's SIGKILL)."""
    loop = asyncio.get_running_loop()
    start = WORK_START.get()
    if start is not None:
        start.begin()  # its thread starts now, not behind others
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
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, result, err)

    threading.Thread(
        target=call, name=f"gpud:{getattr(fn, '__qualname__', 'call')}", daemon=True
    ).start()
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
