"""``python -m tools.admission bench --json``: the admission queue against queueing theory.

For each utilisation, independent arrival sequences (:mod:`tools.admission.workload`; ten by
default, run in parallel) each run through the discrete-event simulation with backfill, the
first three also in strict FIFO order. One run's mean wait is a noisy estimate of the
long-run mean a quote is for (waits come in bursts, more so near saturation): each class's
observed mean wait is the mean of its per-replication means, with a 95 % Student-t
confidence interval over them (``--detail``). The quotes come from the histories laid end to
end, as one node's. Reported:

- ``littles_residual``: ``|L - lambda W| / L`` on the backfill runs (the largest), ``L`` integrated from
  the queue's own length and ``lambda W`` from the per-job waits;
- ``quote_over_observed``: the smallest, over classes, of the class's quote (from the
  simulated histories, as the daemon computes it) over its observed mean wait: >= 1 means
  every class's quote was conservative (``--detail`` prints each class, its interval, the
  quote over the interval's upper end and whether the quote is above it);
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

from gpud.admission.classes import class_views
from gpud.admission.estimate import Record, littles_residual
from gpud.admission.model import Holding
from gpud.admission.placement_fit import PlacementFit
from gpud.admission.queue import Queued, admission_pass
from tools.admission.sim import simulate
from tools.admission.workload import CLASSES, MIXES, bench_node, generate, shared_node

UTILIZATIONS = (0.5, 0.7, 0.8, 0.9, 0.95)
WARMUP_FRACTION = 0.1


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
    utilisation, run on ``workers`` processes: each class's observed mean wait is the mean of
    its per-replication means, with a 95 % Student-t interval over them; the quotes come from
    the histories laid end to end. The first ``fifo_replications`` also run in strict FIFO."""
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
        rep_means: dict[str, list[float]] = {}
        history: list[Record] = []
        offset = 0.0
        for replication, rep in enumerate(reps):
            for key, waits in rep.observed.items():
                rep_means.setdefault(key, []).append(statistics.fmean(waits))
            # One node's history: the replications one after the other.
            history.extend(_shifted(r, offset - rep.start, replication) for r in rep.records)
            offset += rep.end - rep.start
        views = class_views(fit, requests, history, now=offset)
        ratios: dict[str, float] = {}
        quoted: dict[str, float] = {}
        intervals: dict[str, tuple[float, float]] = {}
        for key, means in rep_means.items():
            mean = statistics.fmean(means)
            intervals[key] = (mean, _half_width(means))
            view = views[key].quote
            quoted[key] = view.wait_s if view is not None else math.inf
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
                    "quote_over_observed": ratios[key],
                    "quote_over_observed_upper": upper[key],
                    "quote_above_interval": quoted[key] >= sum(intervals[key]),
                    "k_eff": views[key].packing.k_eff if views[key].packing else None,  # type: ignore[union-attr]
                }
                for key in sorted(rep_means)
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
    # Observed waits after a warm-up, as a steady-state quote describes.
    for r in bf.records[int(len(bf.records) * WARMUP_FRACTION) :]:
        if r.wait_s is not None:
            observed.setdefault(r.request_class, []).append(r.wait_s)
    fifo_waits: list[float] = []
    if fifo:
        f = simulate(trace, fit, backfill=False)
        fifo_waits = [r.wait_s if r.wait_s is not None else f.end - r.queued_at for r in f.records]
    return _Replication(
        observed,
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
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.960
    return t * statistics.stdev(means) / math.sqrt(n)


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
    holdings = [Holding(f"run{i}", (d.uuid,), d.capacity) for i, d in enumerate(fit.devices())]
    queue = [Queued(f"q{i}", CLASSES[i % len(CLASSES)].request, i, float(i)) for i in range(queued)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        admission_pass(queue, fit, holdings, backfill=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000.0
