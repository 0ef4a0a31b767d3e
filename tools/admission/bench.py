"""``python -m tools.admission bench --json``: the admission queue against queueing theory.

For each utilisation, independent arrival sequences (:mod:`tools.admission.workload`; ten by
default, run in parallel) each run through the discrete-event simulation with backfill, the
first three also in strict FIFO order. Each starts from an empty node, so the first
``WARMUP_FRACTION`` of its jobs are not observed: the whole-GPU pool (an M/M/5 queue)
simulated alone with its share of 30,000 jobs, 600 times (``python -m tools.admission
reference --jobs 5300 --replications 600 --warmup W``), waits 0.97x its exact mean at 0.95
after a 10 % warm-up and 0.98x after 30 % (each +-4 %), 1.00x at 0.9.

One run's mean wait is a noisy estimate of the long-run mean a quote is for (waits come in
long bursts, more so near saturation), chiefly because the run's own load strays from the
target: a sequence that drew 1 % more work than ``rho`` waits some 20-30 % longer at 0.95.
The simulation knows the load it drew, so each class's observed mean wait is the *control
variate* estimate over the replications (Lavenberg and Welch): the per-replication mean
waits regressed on the work that arrived for the class's pool, relative to the target, and
read at the target (relative error 0): ``mean(Y) - b mean(X)``, with its 95 % Student-t
interval (``n - 2`` degrees of freedom, the regression intercept's standard error); with
fewer than five replications the plain mean (see :func:`_controlled_mean`). This is
the mean wait at the target load, which is what a quote from a long history claims; it
narrows the interval two- to threefold where waits follow the load closely (the whole-GPU
pool) and never widens it by more than the lost degree of freedom.

The quotes come from the histories laid end to end, as one node's, on the *arrival* clock:
each sequence begins one mean inter-arrival time after the last arrival of the one before.
Laying them end to end on the simulation's own clock would insert each sequence's drain
(its queue emptying after the last arrival, 10,000-20,000 s at 0.95) as time with no
arrivals, which a node that keeps receiving jobs never sees: the history's arrival rate came
out 1.5-2 % low at 0.95 and, at the wait's elasticity to the load there (20-30), the quotes
30 % short. Reported:

- ``littles_residual``: ``|L - lambda W| / L`` on the backfill runs (the largest), ``L`` integrated from
  the queue's own length and ``lambda W`` from the per-job waits;
- ``quote_over_observed``: the smallest, over classes, of the class's quote (from the
  simulated histories, as the daemon computes it) over its observed mean wait: >= 1 means
  every class's quote was conservative (``--detail`` prints each class, its interval, the
  quote over the interval's upper end and whether the quote is above it, and the plain
  mean of the per-replication means with its interval);
- ``backfill_over_fifo_wait``: mean wait with backfill over mean wait in strict FIFO;
- ``wait_slope``: the slope of log(mean wait) against log(1 / (1 - rho)) (1: wait grows
  like 1 / (1 - rho));
- an unbounded quote (the pool's load, after the packing efficiency, is at or
  over its capacity) and its ratio print as ``null``;
- ``pass_ms``: one admission pass over 1,000 queued jobs on the full 8-GPU node (median of
  repeated passes).
"""

from __future__ import annotations

import math
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from gpud.admission.classes import ClassView, class_views
from gpud.admission.estimate import Record, littles_residual
from gpud.admission.model import Demand, Holding
from gpud.admission.placement_fit import PlacementFit
from gpud.admission.queue import Queued, admission_pass
from tools.admission.sim import simulate
from tools.admission.workload import (
    CLASSES,
    MIXES,
    arrival_rates,
    bench_node,
    generate,
    shared_node,
)

UTILIZATIONS = (0.5, 0.7, 0.8, 0.9, 0.95)
WARMUP_FRACTION = 0.3
MIN_CONTROLLED = 5  # replications for the control variate (loss factor at most 1.5)


def run(
    jobs: int = 30000,
    *,
    seed: int = 1,
    detail: bool = False,
    mix: str = "pools",
    replications: int = 3,
    workers: int = 1,
    fifo_replications: int = 3,
    utilizations: tuple[float, ...] = UTILIZATIONS,
) -> dict[str, Any]:
    """``replications`` independent arrival sequences (seeds ``seed``, ``seed + 1``, ...) per
    utilisation, run on ``workers`` processes: each class's observed mean wait is the control
    variate estimate over its per-replication means, read at the target load, with its 95 %
    Student-t interval; the quotes come from the histories laid end to end on the arrival
    clock. The first ``fifo_replications`` also run in strict FIFO."""
    classes = MIXES[mix]
    devices = bench_node() if mix == "pools" else shared_node()
    fit = PlacementFit(devices)
    requests = {c.name: c.request for c in classes}
    out: dict[str, Any] = {"utilizations": {}}
    mean_waits = []
    tasks = [
        (rho, seed + r, jobs, mix, r < fifo_replications)
        for rho in utilizations
        for r in range(replications)
    ]
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            runs = list(pool.map(_replicate, *zip(*tasks, strict=True)))
    else:
        runs = [_replicate(*t) for t in tasks]
    for i, rho in enumerate(utilizations):
        reps = runs[i * replications : (i + 1) * replications]
        history, now = _history(reps)
        views = class_views(fit, requests, history, now=now)
        rates = arrival_rates(devices, rho, classes)
        work_rates = {c.name: rates[c.name] * c.mean_service_s for c in classes}
        ratios: dict[str, float] = {}
        quoted: dict[str, float] = {}
        intervals: dict[str, tuple[float, float]] = {}
        plain: dict[str, tuple[float, float]] = {}
        for key in sorted({k for rep in reps for k in rep.observed}):
            kept = [rep for rep in reps if rep.observed.get(key)]
            means = [statistics.fmean(rep.observed[key]) for rep in kept]
            weights = _pool_weights(views, key)
            expected = sum(w * work_rates[j] for j, w in weights.items())
            # The work that arrived for the pool, relative to the target's (mean 0).
            drawn = [
                sum(w * rep.work.get(j, 0.0) for j, w in weights.items()) / rep.window / expected
                - 1.0
                if rep.window > 0 and expected > 0
                else 0.0
                for rep in kept
            ]
            plain[key] = (statistics.fmean(means), _half_width(means))
            intervals[key] = _controlled_mean(means, drawn)
            view = views[key].quote
            quoted[key] = view.wait_s if view is not None else math.inf
            mean = intervals[key][0]
            ratios[key] = quoted[key] / mean if mean > 0 else math.inf
        mean_waits.append(statistics.fmean(m for m, _ in intervals.values()))
        bf_waits = [w for rep in reps if rep.fifo_waits for w in rep.all_waits]
        fifo_waits = [w for rep in reps for w in rep.fifo_waits]
        row: dict[str, Any] = {
            "littles_residual": max(rep.residual for rep in reps),
            "quote_over_observed": min(ratios.values()),
            "backfill_over_fifo_wait": statistics.fmean(bf_waits) / statistics.fmean(fifo_waits),
        }
        if detail:
            upper = {
                k: quoted[k] / (m + h) if m + h > 0 else math.inf for k, (m, h) in intervals.items()
            }
            row["quote_over_observed_upper"] = min(upper.values())
            row["max_half_width_ratio"] = max(
                h / m if m > 0 else 0.0 for m, h in intervals.values()
            )
            row["classes"] = {
                key: {
                    "quote_s": quoted[key],
                    "observed_s": intervals[key][0],
                    "observed_ci95_s": [
                        intervals[key][0] - intervals[key][1],
                        intervals[key][0] + intervals[key][1],
                    ],
                    "half_width_ratio": intervals[key][1] / intervals[key][0]
                    if intervals[key][0] > 0
                    else 0.0,
                    "observed_plain_s": plain[key][0],
                    "observed_plain_ci95_s": [
                        plain[key][0] - plain[key][1],
                        plain[key][0] + plain[key][1],
                    ],
                    "quote_over_observed": ratios[key],
                    "quote_over_observed_upper": upper[key],
                    "quote_above_interval": quoted[key] >= sum(intervals[key]),
                    "k_eff": views[key].packing.k_eff if views[key].packing else None,  # type: ignore[union-attr]
                }
                for key in sorted(intervals)
            }
        out["utilizations"][f"{rho:g}"] = row
    xs = [math.log(1.0 / (1.0 - rho)) for rho in utilizations]
    ys = [math.log(w) for w in mean_waits]
    out["wait_slope"] = _slope(xs, ys)
    out["pass_ms"] = pass_ms(PlacementFit(bench_node()))
    return out


@dataclass(frozen=True, slots=True)
class _Replication:
    observed: dict[str, list[float]]  # class -> waits after the warm-up (backfill)
    work: dict[str, float]  # class -> service time of its jobs arriving after the warm-up
    window: float  # from the first observed arrival to the last arrival
    records: list[Record]
    start: float
    end: float
    residual: float
    all_waits: list[float]  # every job's wait with backfill
    fifo_waits: list[float]  # every job's wait in strict FIFO (empty if not run)


def _replicate(rho: float, seed: int, jobs: int, mix: str, fifo: bool) -> _Replication:
    """One arrival sequence through the simulation: a process-pool task (plain arguments)."""
    devices = bench_node() if mix == "pools" else shared_node()
    fit = PlacementFit(devices)
    trace = generate(devices, rho, jobs, seed, MIXES[mix])
    bf = simulate(trace, fit, backfill=True)
    observed: dict[str, list[float]] = {}
    work: dict[str, float] = {}
    # Observed waits after a warm-up, as a steady-state quote describes.
    kept = bf.records[int(len(bf.records) * WARMUP_FRACTION) :]
    for r in kept:
        if r.wait_s is not None:
            observed.setdefault(r.request_class, []).append(r.wait_s)
        if r.service_s is not None:
            work[r.request_class] = work.get(r.request_class, 0.0) + r.service_s
    window = kept[-1].queued_at - kept[0].queued_at if len(kept) > 1 else 0.0
    fifo_waits: list[float] = []
    if fifo:
        f = simulate(trace, fit, backfill=False)
        fifo_waits = [r.wait_s if r.wait_s is not None else f.end - r.queued_at for r in f.records]
    return _Replication(
        observed,
        work,
        window,
        bf.records,
        bf.start,
        bf.end,
        littles_residual(bf.records, bf.queue_area, start=bf.start, end=bf.end),
        [r.wait_s or 0.0 for r in bf.records],
        fifo_waits,
    )


# Two-sided 95 % quantiles of Student's t by degrees of freedom (beyond 30: the normal's).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def _half_width(means: list[float]) -> float:
    """Half-width of the 95 % confidence interval on the mean of independent replication
    means (infinite from a single replication: it says nothing about its own noise)."""
    n = len(means)
    if n < 2:
        return math.inf
    return _t975(n - 1) * statistics.stdev(means) / math.sqrt(n)


def _t975(df: int) -> float:
    return _T975[df - 1] if df <= len(_T975) else 1.960


def _history(reps: list[_Replication]) -> tuple[list[Record], float]:
    """The replications' records laid end to end as one node's history, on the arrival
    clock: each sequence's first arrival comes one mean inter-arrival time after the last
    arrival of the one before (its drain overlaps the next one's start, as a node that keeps
    receiving jobs would see it). Returns the records and ``now``, one mean inter-arrival
    time after the last arrival."""
    history: list[Record] = []
    offset = 0.0
    for replication, rep in enumerate(reps):
        if not rep.records:
            continue
        first = rep.records[0].queued_at
        span = max(r.queued_at for r in rep.records) - first
        history.extend(_shifted(r, offset - first, replication) for r in rep.records)
        offset += span + span / max(len(rep.records) - 1, 1)
    return history, offset


def _pool_weights(views: dict[str, ClassView], key: str) -> dict[str, float]:
    """Each class's weight in the load of ``key``'s pool, as the quote counts it: a job of
    class ``j`` occupies ``|pool_j & pool_c| / (k_j |pool_c|)`` of it."""
    mine = views[key].demand
    if not isinstance(mine, Demand):
        return {}
    pool = set(mine.pool)
    weights = {}
    for j, view in views.items():
        demand = view.demand
        k = view.packing.k_eff if view.packing is not None else None
        if isinstance(demand, Demand) and k:
            overlap = len(pool & set(demand.pool))
            if overlap:
                weights[j] = overlap / (k * len(pool))
    return weights


def _controlled_mean(ys: list[float], xs: list[float]) -> tuple[float, float]:
    """The mean of ``ys`` at ``x = 0`` by the control-variate regression of ``ys`` on ``xs``
    (whose true mean is 0), and the half-width of its 95 % interval: the intercept of the
    least-squares line and its Student-t interval with ``n - 2`` degrees of freedom. The
    estimated slope costs variance, the more the fewer the points (Lavenberg, Moeller and
    Welch's loss factor ``(n - 2) / (n - 3)``: 2 at four points, infinite at three), so
    with fewer than ``MIN_CONTROLLED`` points, or a control that does not vary, this is the
    plain mean and its interval."""
    n = len(ys)
    mx = statistics.fmean(xs) if xs else 0.0
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < MIN_CONTROLLED or sxx <= 0:
        return statistics.fmean(ys), _half_width(ys)
    my = statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    at_zero = my - slope * mx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
    se = math.sqrt(residual / (n - 2) * (1.0 / n + mx * mx / sxx))
    return at_zero, _t975(n - 2) * se


def _shifted(r: Record, by: float, replication: int) -> Record:
    def move(t: float | None) -> float | None:
        return None if t is None else t + by

    return Record(
        f"{replication}/{r.job}",
        r.request_class,
        r.queued_at + by,
        move(r.started_at),
        move(r.ended_at),
    )


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def pass_ms(fit: PlacementFit, queued: int = 1000, repeats: int = 21) -> float:
    """Median time of one pass over ``queued`` jobs of every class, on a node whose every
    device is full (nothing starts: every job is looked at)."""
    holdings = [
        Holding(f"run{i}", (d.uuid,), d.capacity, name=f"run{i}")
        for i, d in enumerate(fit.devices())
    ]
    queue = [Queued(f"q{i}", CLASSES[i % len(CLASSES)].request, i, float(i)) for i in range(queued)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        admission_pass(queue, fit, holdings, backfill=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000.0
