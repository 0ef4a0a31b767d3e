"""The clock that deadlines of safety are kept on: one that counts the time the host was
suspended.

Linux's ``CLOCK_MONOTONIC`` (``time.monotonic``) stops while the host is suspended;
``CLOCK_BOOTTIME`` runs on, as etcd's clock and the other nodes' do. A leader that leads
until ``last renewal sent + 3/4 TTL`` by the monotonic clock would, resumed after a suspend
longer than its lease, still count itself leading while etcd expired the lease and another
node leads: two leaders. By :data:`elapsed` it stops leading the moment it resumes.

Where no ``CLOCK_BOOTTIME`` exists (not Linux), :data:`elapsed` is ``time.monotonic``,
which on macOS (``mach_absolute_time``) stops across a sleep too. Both never go back.

Timers that must *not* count a suspend (a job's stall: its processes were frozen too) stay
on the monotonic clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

Clock = Callable[[], float]

WAKE_S = 1.0
"""The longest a wait for a time on :data:`elapsed` blocks at once: the timeouts of the
kernel's waits (a condition variable, ``poll``, the event loop's timers) run on
``CLOCK_MONOTONIC``, which stops while the host is suspended, so a wait that is cut into
such slices ends at most this long after a resume past its time, not its full length later."""


class Timers(Protocol):
    def call_later(self, delay: float, callback: Callable[[], object], /) -> object: ...


def _pick() -> Clock:
    boottime: int | None = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is None:
        return time.monotonic
    try:
        time.clock_gettime(boottime)
    except OSError:  # a kernel without it (before Linux 2.6.39)
        return time.monotonic
    clock_id = boottime

    def boot_clock() -> float:
        """Seconds since boot, the host's suspends included (``CLOCK_BOOTTIME``)."""
        return time.clock_gettime(clock_id)

    return boot_clock


elapsed: Clock = _pick()
"""Seconds on a clock that never goes back and counts the host's suspends (see above)."""


def call_after(
    timers: Timers, delay_s: float, callback: Callable[[], object], clock: Clock
) -> None:
    """Call ``callback`` on ``timers`` (the event loop) once ``delay_s`` have passed on
    ``clock``: woken every :data:`WAKE_S` at most to read it, as the loop's own timers run
    on ``CLOCK_MONOTONIC`` and would count none of a suspend."""
    due = clock() + delay_s

    def check() -> None:
        left = due - clock()
        if left <= 0:
            callback()
        else:
            timers.call_later(min(left, WAKE_S), check)

    check()
