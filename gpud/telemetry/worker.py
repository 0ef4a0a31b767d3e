"""A one-thread worker, so that a driver call that hangs on one GPU starves no other.

A hung NVML call cannot be cancelled: the thread stays inside the driver until it returns.
The thread is a daemon thread so that a GPU hung in the driver cannot keep the process from
exiting (``concurrent.futures.ThreadPoolExecutor`` joins its threads at interpreter exit).

Jobs return nothing: a job reports its result itself (:class:`gpud.telemetry.dispatch._Pass`
stores results and releases a lock), which spares the sampler a ``Future`` per tick.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Worker:
    """Runs submitted callables one at a time on its own daemon thread."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._closed = False
        self._closing = threading.Lock()  # a submit and a close: one before the other
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object]) -> bool:
        """Run ``fn`` after the jobs before it; what it raises is logged, not returned. False,
        and ``fn`` never runs, once the worker was closed."""
        with self._closing:
            if self._closed:
                return False
            self._jobs.put(fn)
            return True

    def close(self, timeout_s: float = 0.0) -> None:
        """Stop after the jobs already submitted; wait at most ``timeout_s`` (a hung call may
        never end)."""
        with self._closing:
            if not self._closed:
                self._closed = True
                self._jobs.put(None)
        if timeout_s > 0:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        get = self._jobs.get
        while True:
            fn = get()
            if fn is None:
                return
            try:
                fn()
            except BaseException:  # a job must report its own errors; keep the thread alive
                log.exception("job %r on %s failed", fn, self._thread.name)
