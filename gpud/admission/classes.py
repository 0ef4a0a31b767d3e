"""Per-class view of the node: packing (``k_eff``, binding dimension), history statistics
and the M/G/k quote, for every request class seen in the history or the queue."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from gpud.admission.estimate import ClassStats, Estimate, Record
from gpud.admission.model import Demand, FitCheck, Request, Unfeasible
from gpud.admission.packing import Packing, pack
from gpud.admission.quote import (
    ClassModel,
    ClassQuote,
    PackingEfficiency,
    class_quotes,
    packing_efficiency,
)


@dataclass(frozen=True, slots=True)
class ClassView:
    key: str
    request: Request
    demand: Demand | Unfeasible
    packing: Packing | None  # None when unfeasible
    stats: ClassStats | None  # None: not in the history window
    quote: ClassQuote | None  # None: unfeasible, never waits, or no run has ended yet


def class_views(
    fit: FitCheck,
    requests: Mapping[str, Request],
    records: Sequence[Record],
    *,
    now: float,
    window_s: float | None = None,
) -> dict[str, ClassView]:
    """``requests`` maps class keys (as in the records) to their request."""
    return ClassViews(records, now=now, window_s=window_s).at(fit, requests, now=now)


class ClassViews:
    """:func:`class_views` over the records of one window, asked again as the time moves on
    (the queue's listings and every scrape ask each second): the statistics and the sweeps
    of the packing efficiency that do not move with the time are made once for these
    records. ``now`` given here chooses the records as :func:`class_views` does; asking
    at another time gives what :func:`class_views` gives at that time for the same records
    (as long as no record enters or leaves the window in between)."""

    def __init__(
        self, records: Sequence[Record], *, now: float, window_s: float | None = None
    ) -> None:
        since = -math.inf if window_s is None else now - window_s
        self._window_s = window_s
        in_window = [r for r in records if r.queued_at >= since]
        self._estimate = Estimate([r for r in in_window if r.queued_at <= now])
        self._by_class: dict[str, list[Record]] = {}
        self._where: dict[int, int] = {}  # id() of each record -> its index in its class
        for r in in_window:
            rs = self._by_class.setdefault(r.request_class, [])
            self._where[id(r)] = len(rs)
            rs.append(r)
        # a record that has not started (none from the history): efficiency made afresh
        self._unstarted = any(r.started_at is None for r in in_window)
        # changes are taken in (:meth:`change`) only where the window holds every record
        # the estimate does (none queued after ``now``, a clock stepped back)
        self._changeable = not self._unstarted and all(r.queued_at <= now for r in in_window)
        self._oldest = min((r.queued_at for r in in_window), default=math.inf)
        # the pool's efficiency sweeps, by the classes on it and their shares
        self._sweeps: dict[tuple[tuple[str, float], ...], PackingEfficiency] = {}

    def change(self, changes: Sequence[tuple[Record | None, Record]], *, now: float) -> bool:
        """Take in records added after the others (``(None, record)``, oldest first) and
        records changed in place (``(old, new)``: a run that ended), as made afresh from
        the records with these changes at ``now`` would be (the same figures): each costs
        its class's run times and the sweeps' events since it, not the window. False (the
        views are left unusable: make them afresh) where they cannot: a record of the
        window left it (``now`` moved past its queued time), or one is not from the history
        (not started, or queued after ``now``). The caller sees to it that no record it
        does not give entered the window (a clock stepped back)."""
        since = -math.inf if self._window_s is None else now - self._window_s
        if not self._changeable or self._oldest < since:
            return False
        for old, new in changes:
            if new.started_at is None or new.queued_at > now:
                self._changeable = False
                return False
            if old is None:
                if new.queued_at < since:
                    continue  # before the window: made afresh, it would not hold it
                rs = self._by_class.setdefault(new.request_class, [])
                index = len(rs)
                rs.append(new)
                self._oldest = min(self._oldest, new.queued_at)
            else:
                found = self._where.pop(id(old), None)
                if found is None:
                    if old.queued_at < since:
                        continue  # before the window
                    self._changeable = False  # not a record these views were given
                    return False
                if (old.request_class, old.queued_at) != (new.request_class, new.queued_at):
                    self._changeable = False
                    return False
                index = found
                self._by_class[new.request_class][index] = new
            self._where[id(new)] = index
            self._estimate.change(old, new, index)
            for sharing, sweep in self._sweeps.items():
                for rank, (key, share) in enumerate(sharing):
                    if key == new.request_class:
                        if old is not None:
                            sweep.remove(_job(old, share), (rank, index))
                        sweep.add(_job(new, share), (rank, index))
        return True

    def at(
        self, fit: FitCheck, requests: Mapping[str, Request], *, now: float
    ) -> dict[str, ClassView]:
        devices = {d.uuid: d for d in fit.devices()}
        stats = self._estimate.at(now)
        demands = {key: fit.demand(r) for key, r in requests.items()}
        packings = {key: pack(d, devices) for key, d in demands.items() if isinstance(d, Demand)}
        models = []
        for key, p in packings.items():
            s = stats.get(key)
            d = demands[key]
            if p.k_eff and s is not None and s.mean_service_s is not None and isinstance(d, Demand):
                models.append(
                    ClassModel(
                        key,
                        s.arrival_rate,
                        s.mean_service_s,
                        s.scv_service,
                        p.k_eff,
                        frozenset(d.pool),
                        runs=s.completions,
                    )
                )
        models = self._with_efficiency(models, now=now)
        quotes = class_quotes(models, horizon_s=self._window_s)
        return {
            key: ClassView(key, r, demands[key], packings.get(key), stats.get(key), quotes.get(key))
            for key, r in sorted(requests.items())
        }

    def _with_efficiency(self, models: Sequence[ClassModel], *, now: float) -> list[ClassModel]:
        """Each model with the packing efficiency of its pool, from the records in the
        window."""
        out = []
        for c in models:
            sharing = tuple(
                (j.key, len(j.pool & c.pool) / (j.k_eff * len(c.pool)))
                for j in models
                if j.pool & c.pool
            )
            sweep = self._sweeps.get(sharing)
            if sweep is None:
                jobs = [
                    (r.queued_at, r.started_at, r.ended_at, share)
                    for key, share in sharing
                    for r in self._by_class.get(key, ())
                ]
                if self._unstarted:  # not from the history: asked afresh
                    out.append(replace(c, efficiency=packing_efficiency(jobs, now=now)))
                    continue
                ranks = [
                    (rank, index)
                    for rank, (key, _) in enumerate(sharing)
                    for index in range(len(self._by_class.get(key, ())))
                ]
                # every one started (not self._unstarted)
                sweep = self._sweeps[sharing] = PackingEfficiency(jobs, ranks)  # type: ignore[arg-type]
            efficiency = sweep.at(now)
            out.append(replace(c, efficiency=efficiency))
        return out


def _job(r: Record, share: float) -> tuple[float, float, float | None, float]:
    """``r`` as a job of a packing efficiency's sweep (started: see ClassViews.change)."""
    assert r.started_at is not None
    return (r.queued_at, r.started_at, r.ended_at, share)
