"""A one-thread worker per GPU, so that a driver call that hangs on one GPU starves no other.

A hung NVML call cannot be cancelled: the thread stays inside the driver until it returns.
The thread is a daemon thread so that a GPU hung in the driver cannot keep the process from
exiting (``concurrent.futures.ThreadPoolExecutor`` joins its threads at interpreter exit).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Callable[[], Any], "Future[Any]"]


class Worker:
    """Runs submitted callables one at a time on its own daemon thread."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        return future

    def close(self, timeout_s: float = 0.0) -> None:
        """Stop after the current job; wait at most ``timeout_s`` (a hung call may never end)."""
        self._jobs.put(None)
        if timeout_s > 0:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as err:  # handed to the caller through the future
                future.set_exception(err)
            else:
                future.set_result(result)
