"""``python -m tools.admission bench --json``: the admission queue against queueing theory.

For each utilisation, three independent arrival sequences (:mod:`tools.admission.workload`)
each run through the discrete-event simulation twice, with backfill and in strict FIFO
order; waits are pooled over the three (one run's mean wait is noisy: waits come in bursts),
and the quotes come from the three histories laid end to end, as one node's. Reported:

- ``littles_residual``: ``|L - lambda W| / L`` on the backfill runs (the largest), ``L`` integrated from
  the queue's own length and ``lambda W`` from the per-job waits;
- ``quote_over_observed``: the smallest, over classes, of the class's quote (from the
  simulated histories, as the daemon computes it) over its observed mean wait: >= 1 means
  every class's quote was conservative (``--detail`` prints each class);
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
    seed: int = 1,
    detail: bool = False,
    mix: str = "pools",
    replications: int = 3,
) -> dict[str, Any]:
    """``replications`` independent arrival sequences (seeds ``seed``, ``seed + 1``, ...) per
    utilisation: observed waits are pooled over them; the quotes come from their histories
    laid end to end."""
    classes = MIXES[mix]
    devices = bench_node() if mix == "pools" else shared_node()
    fit = PlacementFit(devices)
    requests = {c.name: c.request for c in classes}
    out: dict[str, Any] = {"utilizations": {}}
    mean_waits = []
    for rho in UTILIZATIONS:
        observed: dict[str, list[float]] = {}
        history: list[Record] = []
        offset = 0.0
        residual = 0.0
        bf_waits: list[float] = []
        fifo_waits: list[float] = []
        for replication in range(replications):
            trace = generate(devices, rho, jobs, seed + replication, classes)
            bf = simulate(trace, fit, backfill=True)
            fifo = simulate(trace, fit, backfill=False)
            # Observed waits after a warm-up, as a steady-state quote describes.
            for r in bf.records[int(len(bf.records) * WARMUP_FRACTION) :]:
                if r.wait_s is not None:
                    observed.setdefault(r.request_class, []).append(r.wait_s)
            # One node's history: the replications one after the other.
            history.extend(_shifted(r, offset - bf.start, replication) for r in bf.records)
            offset += bf.end - bf.start
            residual = max(
                residual, littles_residual(bf.records, bf.queue_area, start=bf.start, end=bf.end)
            )
            bf_waits.extend(r.wait_s or 0.0 for r in bf.records)
            fifo_waits.extend(
                r.wait_s if r.wait_s is not None else fifo.end - r.queued_at for r in fifo.records
            )
        views = class_views(fit, requests, history, now=offset)
        ratios = {}
        quoted: dict[str, float] = {}
        for key, waits in observed.items():
            mean = statistics.fmean(waits)
            view = views[key].quote
            quoted[key] = view.wait_s if view is not None else math.inf
            ratios[key] = quoted[key] / mean if mean > 0 else math.inf
        mean_waits.append(statistics.fmean(w for ws in observed.values() for w in ws))
        row: dict[str, Any] = {
            "littles_residual": residual,
            "quote_over_observed": min(ratios.values()),
            "backfill_over_fifo_wait": statistics.fmean(bf_waits) / statistics.fmean(fifo_waits),
        }
        if detail:
            row["classes"] = {
                key: {
                    "quote_s": quoted[key],
                    "observed_s": statistics.fmean(observed[key]),
                    "quote_over_observed": ratios[key],
                    "k_eff": views[key].packing.k_eff if views[key].packing else None,  # type: ignore[union-attr]
                }
                for key in sorted(observed)
            }
        out["utilizations"][f"{rho:g}"] = row
    xs = [math.log(1.0 / (1.0 - rho)) for rho in UTILIZATIONS]
    ys = [math.log(w) for w in mean_waits]
    out["wait_slope"] = _slope(xs, ys)
    out["pass_ms"] = pass_ms(PlacementFit(bench_node()))
    return out


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
