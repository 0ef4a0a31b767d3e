"""Weights inside a level: each job's share of the level's bandwidth, by its demand (pure).

Jobs on one level (a group of near-equal progress, or neighbours when there are more jobs
than levels) share that level's bandwidth by DRR over their HTB leaves. Equal quanta give
each job the same bytes per second, which is equal progress only for jobs that move the
same bytes per contention-free iteration. Weighing a job by its demand ``d_j = B_j / T*_j``
(bytes per iteration over its iteration time alone) makes the level's split proportional
to what each job needs, so a backlogged level's jobs progress alike -- the split that
reaches ``G / sum_j d_j`` on a shared bottleneck.

Weights are relative to the largest demand and rounded to ``1/steps`` (never below
``1/steps``), so a demand estimate that wanders by a percent rewrites no class.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

DEFAULT_STEPS = 32


def demand_weights(demand: Mapping[str, float], steps: int = DEFAULT_STEPS) -> dict[str, float]:
    """job -> weight in (0, 1] from job -> demand (bytes/s at full progress; jobs with a
    demand that is not a positive finite number are left out: they weigh 1)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    known = {j: d for j, d in demand.items() if math.isfinite(d) and d > 0}
    if not known:
        return {}
    top = max(known.values())
    return {j: max(1, round(d / top * steps)) / steps for j, d in sorted(known.items())}
