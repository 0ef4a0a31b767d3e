"""Waiting on processes in tests: a condition polled until it holds, a process's state."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def until(done: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Poll ``done`` until it holds; fail naming ``what`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def proc_state(pid: int) -> str:
    """``/proc/PID/stat``'s state letter: ``T`` stopped, ``Z`` ended, not yet waited for."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
