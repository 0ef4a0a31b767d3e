"""``python -m tools.admission reference --json``: the quote's M/G/k formula against the
exact mean wait of each benchmark pool, by long simulation of the pool alone.

Each class of the ``pools`` mix (:mod:`tools.admission.workload`) has its devices to itself,
so its pool is exactly an M/G/k FIFO queue: Poisson arrivals, ``k_eff`` servers, gamma
service times of the class's mean and CV. That queue needs no admission code to simulate:
the ``n``-th job starts when it arrives or when the earliest of the ``k`` servers frees,
whichever is later (Kiefer and Wolfowitz's recursion), so millions of jobs take seconds and
give the steady-state mean wait to within a few per cent even at 0.95, which the admission
benchmark's replications cannot. Each utilisation runs ``replications`` independent
sequences of ``jobs`` jobs, the first ``warmup`` of each discarded (it starts empty; 20 % by
default); the mean wait is the mean of the sequences' means, with a 95 % Student-t interval.
With the benchmark's sequence length and warm-up (``--jobs 5300 --warmup 0.3``: the
whole-GPU class's share of 30,000 jobs) it also measures how far a sequence that starts
empty falls short of the steady state.

``formula_over_reference`` is :func:`gpud.admission.quote.mgk_wait` at the true load,
servers and service moments over that mean: the quote's model error alone, without the
estimation from a history (>= 1: the formula is above the exact wait).
"""

from __future__ import annotations

import heapq
import random
import statistics
from typing import Any

from gpud.admission.model import Demand
from gpud.admission.packing import pack
from gpud.admission.placement_fit import PlacementFit
from gpud.admission.quote import mgk_wait
from tools.admission.bench import UTILIZATIONS, _half_width
from tools.admission.workload import CLASSES, bench_node

WARMUP_FRACTION = 0.2


def mgk_fifo_mean_wait(
    k: int,
    rho: float,
    mean_s: float,
    cv: float,
    *,
    jobs: int,
    rng: random.Random,
    warmup: float = WARMUP_FRACTION,
) -> float:
    """Mean wait of one M/G/k FIFO sequence (gamma service) after its warm-up."""
    rate = rho * k / mean_s
    shape = 1.0 / (cv * cv)
    free = [0.0] * k  # when each server next frees
    now = 0.0
    total = 0.0
    skip = min(int(jobs * warmup), jobs - 1)
    for i in range(jobs):
        now += rng.expovariate(rate)
        start = max(now, heapq.heappop(free))
        if i >= skip:
            total += start - now
        heapq.heappush(free, start + rng.gammavariate(shape, mean_s / shape))
    return total / (jobs - skip)


def run(
    jobs: int = 300_000,
    *,
    seed: int = 1,
    replications: int = 10,
    utilizations: tuple[float, ...] = UTILIZATIONS,
    warmup: float = WARMUP_FRACTION,
) -> dict[str, Any]:
    devices = bench_node()
    fit = PlacementFit(devices)
    by_uuid = {d.uuid: d for d in devices}
    out: dict[str, Any] = {"classes": {}, "utilizations": {}}
    for c in CLASSES:
        demand = fit.demand(c.request)
        assert isinstance(demand, Demand)
        k = pack(demand, by_uuid).k_eff
        assert k
        rows = {}
        for rho in utilizations:
            means = [
                mgk_fifo_mean_wait(
                    k,
                    rho,
                    c.mean_service_s,
                    c.cv,
                    jobs=jobs,
                    rng=random.Random(seed + r),
                    warmup=warmup,
                )
                for r in range(replications)
            ]
            mean, half = statistics.fmean(means), _half_width(means)
            formula = mgk_wait(k, rho * k, c.mean_service_s, c.cv**2)
            rows[f"{rho:g}"] = {
                "reference_s": mean,
                "reference_ci95_s": [mean - half, mean + half],
                "formula_s": formula,
                "formula_over_reference": formula / mean,
                "formula_over_reference_ci95": [formula / (mean + half), formula / (mean - half)],
            }
        out["classes"][c.name] = {"k_eff": k, "scv": c.cv**2, "utilizations": rows}
    for rho in utilizations:
        ratios = [cls["utilizations"][f"{rho:g}"] for cls in out["classes"].values()]
        out["utilizations"][f"{rho:g}"] = {
            "formula_over_reference_min": min(r["formula_over_reference"] for r in ratios),
            "formula_over_reference_max": max(r["formula_over_reference"] for r in ratios),
        }
    return out
