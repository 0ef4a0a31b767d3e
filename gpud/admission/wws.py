"""The Weighted Wait-Time Score (WWS): one bounded number for how long a node makes jobs
wait, rewarding typical and tail wait alike.

    WWS = (1 - u) * (w_typ / (1 + mean_wait / S) + w_tail / (1 + p95_wait / S))

``S`` is the trace's mean service time (waits are measured in units of a typical job's
run, so the score does not depend on the trace's time scale), ``u`` the fraction of jobs
the node can never run (their wait is infinite: they score 0), and ``w_typ = w_tail = 1/2``.

Why this form: each term maps a wait in ``[0, inf)`` onto ``(0, 1]`` with ``1/(1 + x)``, so
the score is bounded in ``[0, 1]`` (1: nobody waits; 1/2 per term when jobs wait one mean
run), monotone in both waits, and dominated by neither: a long tail with a short mean and a
uniformly moderate wait are both penalised. Equal weights: the typical user's experience
(mean) and the unlucky user's (p95) count alike; a different balance is a different
``weights`` argument.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

WEIGHTS = (0.5, 0.5)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1), linear between order statistics."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def wws(
    waits: Sequence[float],
    *,
    mean_service_s: float,
    unfeasible_fraction: float = 0.0,
    weights: tuple[float, float] = WEIGHTS,
) -> float:
    """The score of waits ``waits`` (of the jobs that ran), in ``[0, 1]``."""
    if not 0.0 <= unfeasible_fraction <= 1.0:
        raise ValueError(f"unfeasible_fraction {unfeasible_fraction} is not in [0, 1]")
    if not waits:
        return 0.0 if unfeasible_fraction > 0 else 1.0
    scale = mean_service_s if mean_service_s > 0 else 1.0
    typical = sum(waits) / len(waits) / scale
    tail = percentile(waits, 0.95) / scale
    w_typ, w_tail = weights
    score = w_typ / (1.0 + typical) + w_tail / (1.0 + tail)
    return (1.0 - unfeasible_fraction) * score / (w_typ + w_tail)
