"""Per-class view of the node: packing (``k_eff``, binding dimension), history statistics
and the M/G/k quote, for every request class seen in the history or the queue."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from gpud.admission.estimate import ClassStats, Record, estimate
from gpud.admission.model import Demand, FitCheck, Request, Unfeasible
from gpud.admission.packing import Packing, pack
from gpud.admission.quote import ClassModel, ClassQuote, class_quotes, packing_efficiency


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
    devices = {d.uuid: d for d in fit.devices()}
    stats = estimate(records, now=now, window_s=window_s)
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
    models = _with_efficiency(models, records, now=now, window_s=window_s)
    quotes = class_quotes(models, horizon_s=window_s)
    return {
        key: ClassView(key, r, demands[key], packings.get(key), stats.get(key), quotes.get(key))
        for key, r in sorted(requests.items())
    }


def _with_efficiency(
    models: Sequence[ClassModel],
    records: Sequence[Record],
    *,
    now: float,
    window_s: float | None,
) -> list[ClassModel]:
    """Each model with the packing efficiency of its pool, from the records in the window."""
    since = now - window_s if window_s is not None else None
    by_class: dict[str, list[Record]] = {}
    for r in records:
        if since is None or r.queued_at >= since:
            by_class.setdefault(r.request_class, []).append(r)
    out = []
    for c in models:
        jobs: list[tuple[float, float | None, float | None, float]] = []
        for j in models:
            overlap = len(j.pool & c.pool)
            if not overlap:
                continue
            share = overlap / (j.k_eff * len(c.pool))
            jobs.extend(
                (r.queued_at, r.started_at, r.ended_at, share) for r in by_class.get(j.key, ())
            )
        out.append(replace(c, efficiency=packing_efficiency(jobs, now=now)))
    return out
