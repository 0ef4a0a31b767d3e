"""Arrival rate and service-time moments per request class, from the node's job history.

A history record is one job run: when it asked (``queued_at``; the same as ``started_at``
for a job that started at once), when it started and, once it ended, when. Rates count
arrivals in the window over the span from the first of them to now; that first arrival
opens the span and is not one of those counted in it (the Poisson count over
``(first, now]``): counted, a first run that started at once and still runs made its
class's load exactly 1 (one arrival over its own run time so far), and a job queued behind
it was told its devices were overloaded. Service moments use the runs
that ended in the window. A class none of
whose runs has ended yet uses how long its runs have been running (a lower bound), so that
a long first run still weighs on the quotes of the jobs waiting for its devices.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Record:
    job: str
    request_class: str
    queued_at: float
    started_at: float | None
    ended_at: float | None
    quote_s: float | None = None

    @property
    def wait_s(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.queued_at

    @property
    def service_s(self) -> float | None:
        if self.started_at is None or self.ended_at is None:
            return None
        return self.ended_at - self.started_at


@dataclass(frozen=True, slots=True)
class ClassStats:
    arrivals: int
    arrival_rate: float  # per second
    completions: int
    mean_service_s: float | None
    scv_service: float  # squared coefficient of variation; 1 until two runs have ended
    mean_wait_s: float | None


def estimate(
    records: Iterable[Record], *, now: float, window_s: float | None = None
) -> dict[str, ClassStats]:
    """Per-class statistics over ``[now - window_s, now]`` (all history when None)."""
    since = -math.inf if window_s is None else now - window_s
    return Estimate([r for r in records if r.queued_at >= since and r.queued_at <= now]).at(now)


class Estimate:
    """:func:`estimate` over records already chosen (those in the window): what does not
    depend on the time is worked out once, so asking it again at a later ``now`` (with the
    same records) costs the runs still running, not the history. A record added after the
    others or changed in place (:meth:`change`) costs its class's run times, not the
    history: the figures are those of the records made afresh in that order. So does a
    record that leaves (:meth:`remove`), with the window's first told again (:meth:`open`)."""

    def __init__(self, chosen: Sequence[Record]) -> None:
        by_class: dict[str, list[Record]] = {}
        for r in chosen:
            by_class.setdefault(r.request_class, []).append(r)
        first = min(chosen, key=lambda r: r.queued_at) if chosen else None
        self._first = None if first is None else first.queued_at
        self._opener = None if first is None else first.request_class  # uncounted
        self._classes = {
            key: _Moments(rs, uncounted=int(key == self._opener))
            for key, rs in sorted(by_class.items())
        }

    def change(self, old: Record | None, new: Record, index: int) -> None:
        """``new`` in place of ``old`` (at ``index`` among the records of its class), or,
        ``old`` None, after every record given so far (``index``: its class's count)."""
        key = new.request_class
        if old is None and (self._first is None or new.queued_at < self._first):
            # min() keeps the first of equal times: a later record opens only if earlier
            self._first, opener = new.queued_at, self._opener
            self._opener = key
            if opener in self._classes:
                self._classes[opener].uncounted = 0
        moments = self._classes.get(key)
        if moments is None:
            moments = _Moments([], uncounted=0)
            self._classes = dict(sorted({**self._classes, key: moments}.items()))
        moments.change(old, new, index)
        moments.uncounted = int(key == self._opener)

    def remove(self, old: Record, index: int) -> None:
        """``old``, at ``index`` among the records of its class, leaves (the others keep
        their indices; a class none of whose records is left is gone, as made afresh)."""
        moments = self._classes[old.request_class]
        moments.change(old, None, index)
        if not moments.arrivals:
            del self._classes[old.request_class]

    def open(self, first: Record | None) -> None:
        """``first`` opens the span (the first record by queued time, the first given of
        equal times; None: none is left)."""
        self._first = None if first is None else first.queued_at
        self._opener = None if first is None else first.request_class
        for key, moments in self._classes.items():
            moments.uncounted = int(key == self._opener)

    def at(self, now: float) -> dict[str, ClassStats]:
        if self._first is None:
            return {}
        span = max(now - self._first, 1e-9)
        return {key: m.at(span, now) for key, m in self._classes.items()}


class _Moments:
    """One class's statistics but for the time: the arrival rate's span, and the run times
    so far of a class none of whose runs has ended."""

    def __init__(self, records: Sequence[Record], *, uncounted: int) -> None:
        self._records: list[Record | None] = list(records)  # None: one that left
        self.arrivals = len(self._records)
        self.uncounted = uncounted
        self._left = False  # a record left: the waits and run times are made again
        waits = [w for r in records if (w := r.wait_s) is not None]
        self._waits = len(waits)
        self._wait_total = _total(waits)
        self._services()

    def _services(self) -> None:
        services = [s for r in self._records if r is not None and (s := r.service_s) is not None]
        self._completions = len(services)
        # a class none of whose runs ended: the runs' starts, for their run times so far
        self._started = (
            []
            if services
            else [r.started_at for r in self._records if r is not None and r.started_at is not None]
        )
        self._moments = _mean_scv(services) if services else None

    def change(self, old: Record | None, new: Record | None, index: int) -> None:
        """As :meth:`Estimate.change`: the waits are summed on (a record added comes last;
        a record changed keeps its start), the run times made again where they change; a
        record that leaves (``new`` None) has both made again from the records left."""
        if new is None:  # made again when next asked: several may leave at once
            self._records[index] = None
            self.arrivals -= 1
            self._left = True
            return
        self._again()
        if old is None:
            self.arrivals += 1
            self._records.append(new)
            if (w := new.wait_s) is not None:
                self._waits += 1
                self._wait_total += w
            if new.service_s is None:
                if self._moments is None and new.started_at is not None:
                    self._started.append(new.started_at)
                return
        else:
            self._records[index] = new
            if old.wait_s != new.wait_s:  # not from the history (a start never moves)
                self._waits_again()
            if old.service_s == new.service_s and old.started_at == new.started_at:
                return
        self._services()

    def _again(self) -> None:
        if self._left:
            self._left = False
            self._waits_again()
            self._services()

    def _waits_again(self) -> None:
        waits = [w for r in self._records if r is not None and (w := r.wait_s) is not None]
        self._waits, self._wait_total = len(waits), _total(waits)

    def at(self, span: float, now: float) -> ClassStats:
        self._again()
        moments = self._moments
        if moments is None:
            moments = _mean_scv([now - s for s in self._started if now > s])
        mean, scv = moments
        return ClassStats(
            arrivals=self.arrivals,
            arrival_rate=(self.arrivals - self.uncounted) / span,
            completions=self._completions,
            mean_service_s=mean,
            scv_service=scv,
            mean_wait_s=self._wait_total / self._waits if self._waits else None,
        )


def _total(values: Iterable[float]) -> float:
    """The sum of ``values`` added one after another (so a running total kept as values come
    is the same float)."""
    total = 0.0
    for v in values:
        total += v
    return total


def _mean_scv(services: Sequence[float]) -> tuple[float | None, float]:
    mean = sum(services) / len(services) if services else None
    scv = 1.0
    if mean and len(services) >= 2:
        var = sum((s - mean) ** 2 for s in services) / (len(services) - 1)
        scv = var / mean**2
    return mean, scv


def littles_residual(
    records: Sequence[Record], queue_area: float, *, start: float, end: float
) -> float:
    """``|L - lambda W| / L`` over ``[start, end]``: ``queue_area`` is the integral of the
    queue length measured by the queue itself; ``lambda W`` comes from the records' waits
    (a job still waiting at ``end`` counts its wait so far)."""
    total = 0.0
    for r in records:
        began = r.started_at if r.started_at is not None and r.started_at <= end else end
        lo, hi = max(r.queued_at, start), min(began, end)
        if hi > lo:
            total += hi - lo
    return residual_of_waits(total, queue_area, start=start, end=end)


def residual_of_waits(total: float, queue_area: float, *, start: float, end: float) -> float:
    """:func:`littles_residual` from ``total``, the waits' sum within ``[start, end]``."""
    span = end - start
    if queue_area <= 0 or span <= 0:
        return 0.0
    lam_w = total / span
    ell = queue_area / span
    return abs(ell - lam_w) / ell
