"""Observations counted into fixed buckets as they are made: the counters behind a
Prometheus histogram (``gpud.metrics.histogram_family`` exports them).

Prometheus reads a histogram's buckets as counters: they may start again at zero (a gpud
restart) but never go down within a run, or ``rate()`` and ``histogram_quantile`` see a
reset. So they are counted as things happen, never recomputed from a window of records.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HistogramCounts:
    """Cumulative counts per upper bound (``le``), all observations, and their sum."""

    bounds: tuple[float, ...]
    buckets: tuple[int, ...]
    count: int
    sum: float


class Histogram:
    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self._lock = threading.Lock()
        self._per_bucket = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self._sum = 0.0

    def observe(self, value: float) -> None:
        with self._lock:
            self._per_bucket[bisect_left(self.bounds, value)] += 1
            self._sum += value

    def counts(self) -> HistogramCounts:
        with self._lock:
            per, total = list(self._per_bucket), self._sum
        cumulative, running = [], 0
        for n in per[:-1]:
            running += n
            cumulative.append(running)
        return HistogramCounts(self.bounds, tuple(cumulative), sum(per), total)
