"""A worker thread that runs one function with the latest value it was given.

The traffic tick hands the NIC's DSCP -> priority map to one: ``dcb`` talks to the NIC's
firmware and can hang (up to its timeout, per netdev), and the tick, which enforces tc every
pass, must not wait for it. A value given while a run is on replaces any still waiting, so
the NIC gets the newest map next, never a backlog of stale ones.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class LatestWorker(Generic[T]):
    """Runs ``fn(value)`` on its own daemon thread (started on the first :meth:`submit`),
    one run at a time, always with the latest value submitted. ``fn`` reports its own
    failures; an exception it lets out is logged and the worker goes on."""

    def __init__(self, fn: Callable[[T], None], *, name: str) -> None:
        self._fn = fn
        self._name = name
        self._cond = threading.Condition()
        self._pending: tuple[T] | None = None
        self._running = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, value: T) -> None:
        with self._cond:
            if self._closed:
                return
            self._pending = (value,)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def idle(self) -> bool:
        """Nothing running and nothing waiting."""
        with self._cond:
            return not self._running and self._pending is None

    def wait_idle(self, timeout: float) -> bool:
        """Wait until :meth:`idle` (what was submitted has run); False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._running and self._pending is None, timeout=timeout
            )

    def close(self) -> None:
        """Run nothing more (a run on goes to its end on the daemon thread)."""
        with self._cond:
            self._closed = True
            self._pending = None
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._closed:
                    return
                assert self._pending is not None
                (value,), self._pending = self._pending, None
                self._running = True
            try:
                self._fn(value)
            except Exception:
                log.exception("%s failed", self._name)
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()
