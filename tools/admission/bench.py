"""``python -m tools.admission bench --json``: the admission queue against queueing theory.

For each utilisation, one arrival sequence (:mod:`tools.admission.workload`) runs through
the discrete-event simulation twice, with backfill and in strict FIFO order. Reported:

- ``littles_residual``: ``|L - lambda W| / L`` on the backfill run, ``L`` integrated from
  the queue's own length and ``lambda W`` from the per-job waits;
- ``quote_over_observed``: the smallest, over classes, of the class's quote (from the
  simulated history, as the daemon computes it) over its observed mean wait: >= 1 means
  every class's quote was conservative (``--detail`` prints each class);
- ``backfill_over_fifo_wait``: mean wait with backfill over mean wait in strict FIFO;
- ``wait_slope``: the slope of log(mean wait) against log(1 / (1 - rho)) (1: wait grows
  like 1 / (1 - rho));
- ``pass_ms``: one admission pass over 1,000 queued jobs on the full 8-GPU node (median of
  repeated passes).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from gpud.admission.classes import class_views
from gpud.admission.estimate import littles_residual
from gpud.admission.model import Holding
from gpud.admission.placement_fit import PlacementFit
from gpud.admission.queue import Queued, admission_pass
from tools.admission.sim import simulate
from tools.admission.workload import CLASSES, MIXES, bench_node, generate, shared_node

UTILIZATIONS = (0.5, 0.7, 0.8, 0.9, 0.95)
WARMUP_FRACTION = 0.1


def run(
    jobs: int = 30000, seed: int = 1, detail: bool = False, mix: str = "pools"
) -> dict[str, Any]:
    classes = MIXES[mix]
    devices = bench_node() if mix == "pools" else shared_node()
    fit = PlacementFit(devices)
    requests = {c.name: c.request for c in classes}
    out: dict[str, Any] = {"utilizations": {}}
    mean_waits = []
    for rho in UTILIZATIONS:
        trace = generate(devices, rho, jobs, seed, classes)
        bf = simulate(trace, fit, backfill=True)
        fifo = simulate(trace, fit, backfill=False)
        views = class_views(fit, requests, bf.records, now=bf.end)
        # Observed waits after a warm-up, as a steady-state quote describes.
        warm = bf.records[int(len(bf.records) * WARMUP_FRACTION) :]
        observed: dict[str, list[float]] = {}
        for r in warm:
            if r.wait_s is not None:
                observed.setdefault(r.request_class, []).append(r.wait_s)
        ratios = {}
        for key, waits in observed.items():
            quote = views[key].quote
            mean = statistics.fmean(waits)
            ratios[key] = quote.wait_s / mean if quote is not None and mean > 0 else math.inf
        bf_wait = statistics.fmean(r.wait_s or 0.0 for r in bf.records)
        fifo_wait = statistics.fmean(
            (r.wait_s if r.wait_s is not None else fifo.end - r.queued_at) for r in fifo.records
        )
        mean_waits.append(statistics.fmean(w for ws in observed.values() for w in ws))
        row: dict[str, Any] = {
            "littles_residual": littles_residual(
                bf.records, bf.queue_area, start=bf.start, end=bf.end
            ),
            "quote_over_observed": min(ratios.values()),
            "backfill_over_fifo_wait": bf_wait / fifo_wait,
        }
        if detail:
            row["classes"] = {
                key: {
                    "quote_s": views[key].quote.wait_s if views[key].quote else None,  # type: ignore[union-attr]
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
