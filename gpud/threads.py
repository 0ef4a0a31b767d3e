"""Blocking calls awaited from the event loop on threads that never hold up gpud's exit, and
the loops' waits for the first of several events."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# seconds gpud's exit waits, once its event loop closed, for the loop's worker threads to
# end; one still stuck (in a driver call that hangs) is left, and the process exits
EXIT_GRACE_S = 1.0


async def on_daemon_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a daemon thread of its own, awaited. Not the loop's executor: for calls
    that may hang in a program gpud runs (``nft``, ``dcb``, a control daemon) or in the
    driver (a GPU that starts hanging mid-command under a MIG apply), which ``asyncio.run``
    would otherwise wait for at exit, past the stop's budget (and systemd's SIGKILL)."""
    loop = asyncio.get_running_loop()
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
