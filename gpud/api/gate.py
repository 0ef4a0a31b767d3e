"""The calls that change the node, counted while they run, so that a stop answers them.

A stop (``systemctl stop/restart gpud``) that cut off a ``gpuctl mig apply`` at the API's
short grace left gpuctl saying the outcome was unknown (exit 3) while gpud went on with the
apply on its worker thread and finished it. So at a stop the daemon closes the gate: a new
call that would change the node (every method but the reads and jobs' own reports,
:data:`gpud.api.access.TCP_READ_METHODS`) is refused with ``UNAVAILABLE`` ("gpud is
stopping"), and those already running are waited for (:meth:`CallGate.drained`, bounded by
the daemon's ``CALL_STOP_WAIT_S``) so that their callers get their answers before the
server stops. Reads go on being served meanwhile.

::

    gate = CallGate()
    ApiServer(path, gate=gate, servicers=[...])
    ...
    gate.close()                          # new changes: UNAVAILABLE "gpud is stopping"
    await gate.drained(18.0)              # True: every running one was answered
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

from gpud.api.access import TCP_READ_METHODS
from gpud.errors import Unavailable


def changes_node(method: str) -> bool:
    """Whether ``method`` (``/gpud.v1.Mig/ApplyMig``) is one the gate counts: not a read
    nor a job's own report."""
    return method not in TCP_READ_METHODS


class CallGate:
    """Counts the running calls that ``tracked(method)`` names; refuses new ones once
    :meth:`close` was called. Used from the server's event loop only."""

    def __init__(self, tracked: Callable[[str], bool] = changes_node) -> None:
        self._tracked = tracked
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False

    @property
    def running(self) -> int:
        return self._running

    def closed(self) -> bool:
        """Whether gpud is stopping (safe to call from any thread)."""
        return self._closed

    def close(self) -> None:
        self._closed = True

    @contextlib.contextmanager
    def call(self, method: str) -> Iterator[None]:
        """Around a call's handler: counted while it runs, or refused with
        :class:`Unavailable` once the gate is closed."""
        if not self._tracked(method):
            yield
            return
        if self._closed:
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
        """Wait up to ``timeout_s`` until no counted call runs; False if some still do."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, timeout_s))
        return self._running == 0
