"""Who runs the admission passes that freed devices and queue leaves ask for.

A release, a forced removal, a holder found gone and a leave each ask for a pass once their
change is committed. :class:`PassRunner` (the daemon's) runs them on a thread of its own, so
the call that asked returns at once, and coalesces them: asks that arrive while a pass runs
lead to exactly one more pass after it, however many they are. :class:`Inline` runs the pass
in the asking thread, before the ask returns (deterministic tests).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

Pass = Callable[[], None]


class Passes(Protocol):
    def ask(self) -> None:
        """A pass is wanted, after what the caller committed; never raises."""

    def close(self, timeout_s: float = 0.0) -> None:
        """No more passes; wait at most ``timeout_s`` for one running to end."""


class Inline:
    """Each ask runs a pass at once, in the asking thread."""

    def __init__(self, run: Pass) -> None:
        self._run = run

    def ask(self) -> None:
        try:
            self._run()
        except Exception:  # what asked stands; the next tick tries again
            log.exception("admission pass failed")

    def close(self, timeout_s: float = 0.0) -> None:
        return None


class PassRunner:
    """Runs asked passes one at a time on a daemon thread, started on an ask and ended once
    no ask is left (no thread lingers while nothing is asked)."""

    def __init__(self, run: Pass, name: str = "gpud-admission") -> None:
        self._run = run
        self._name = name
        self._cond = threading.Condition()
        self._asked = False
        self._thread: threading.Thread | None = None
        self._closed = False

    def ask(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._asked = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._asked or self._closed:
                    self._thread = None
                    self._cond.notify_all()
                    return
                self._asked = False  # asks from now on lead to one more pass
            try:
                self._run()
            except Exception:  # the next tick tries again
                log.exception("admission pass failed")

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until no pass is asked or running; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._thread is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
