"""The histogram of admission waits (asked to started), counted as runs start.

Prometheus reads a histogram's buckets as counters: they may start again at zero (a gpud
restart) but never go down within a run, or ``rate()`` and ``histogram_quantile`` see a
reset. So the waits are counted here as each run starts, not recomputed from the pruned,
windowed job history on every scrape.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

BUCKETS = (1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)


@dataclass(frozen=True)
class WaitCounts:
    """Cumulative counts per upper bound of :data:`BUCKETS` (``le``), all, and their sum."""

    buckets: tuple[int, ...]
    count: int
    sum_s: float


class WaitHistogram:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._per_bucket = [0] * (len(BUCKETS) + 1)  # the last: above every bound
        self._sum = 0.0

    def observe(self, wait_s: float) -> None:
        wait_s = max(0.0, wait_s)  # a clock stepped back between asking and starting
        with self._lock:
            self._per_bucket[bisect.bisect_left(BUCKETS, wait_s)] += 1
            self._sum += wait_s

    def counts(self) -> WaitCounts:
        with self._lock:
            per, total = list(self._per_bucket), self._sum
        cumulative, running = [], 0
        for n in per[:-1]:
            running += n
            cumulative.append(running)
        return WaitCounts(tuple(cumulative), sum(per), total)
