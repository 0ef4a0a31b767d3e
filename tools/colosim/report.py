"""Runs a scenario under every policy over several seeds and reduces it to the JSON report.

Per policy and seed: ``gpu_util`` (by progress, over the arrival window), ``avg_jct_s`` and
``p95_jct_s`` (arrival to completion), ``max_slowdown`` (the largest time from a job's
first start to its completion over its work alone), ``train_throughput`` (training work
done in the arrival window, in GPU-seconds alone per second), ``slo_attainment`` (mean over
services of the fraction of intervals whose p99 met the SLO), ``worst_service_slo`` (the
worst service), ``oom_events`` (counted by the simulator). The report holds the median of
each over the seeds, and ``worst_max_slowdown``, the largest ``max_slowdown`` of any seed;
every policy runs on the same seeded traces. Beside them,
``vs_exclusive`` compares each policy with exclusive trace by trace: the median over seeds of
its utilization and throughput over exclusive's on the same trace, and of exclusive's
average JCT over its own (a paired comparison, which the ratio of two medians is not: their
medians may come from different traces).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from tools.colosim.engine import RunResult, simulate
from tools.colosim.policies import POLICY_NAMES, make
from tools.colosim.scenario import Scenario

METRICS = (
    "gpu_util",
    "avg_jct_s",
    "p95_jct_s",
    "max_slowdown",
    "train_throughput",
    "slo_attainment",
    "worst_service_slo",
    "oom_events",
)


def _p95(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(0.95 * len(s)))]


def summarize(r: RunResult) -> dict[str, float]:
    slo = list(r.slo.values())
    return {
        "gpu_util": r.gpu_util,
        "avg_jct_s": statistics.fmean(r.jct) if r.jct else 0.0,
        "p95_jct_s": _p95(r.jct),
        "max_slowdown": max(r.stretch, default=1.0),
        "train_throughput": r.train_throughput,
        "slo_attainment": statistics.fmean(slo) if slo else 1.0,
        "worst_service_slo": min(slo, default=1.0),
        "oom_events": r.oom_events,
    }


def run_scenario(
    scenario: Scenario, seeds: int = 3, policies: Sequence[str] = POLICY_NAMES
) -> dict[str, Any]:
    """The run object ``colosim run --json`` prints: medians over ``seeds`` seeded traces."""
    per: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
    for seed in range(seeds):
        trace = scenario.trace(seed)
        for p in policies:
            per[p].append(summarize(simulate(scenario, trace, make(p))))
    out: dict[str, dict[str, float | int]] = {}
    for p, rows in per.items():
        med: dict[str, float | int] = {}
        for m in METRICS:
            v = statistics.median(r[m] for r in rows)
            med[m] = int(v) if m == "oom_events" else round(v, 4)
        # A cap on every job's stretch holds only if it holds on every trace.
        med["worst_max_slowdown"] = round(max(r["max_slowdown"] for r in rows), 4)
        out[p] = med
    report: dict[str, Any] = {
        "scenario": scenario.name,
        "regime": scenario.regime,
        "load": scenario.load,
        "policies": out,
    }
    if "exclusive" in per:
        report["vs_exclusive"] = {
            p: paired(per["exclusive"], rows) for p, rows in per.items() if p != "exclusive"
        }
    return report


def paired(
    exclusive: Sequence[dict[str, float]], policy: Sequence[dict[str, float]]
) -> dict[str, float]:
    """Medians over seeds of the policy against exclusive on the same trace: utilization and
    throughput ratios, and how many times shorter its average JCT is."""

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("inf")

    pairs = list(zip(exclusive, policy, strict=True))
    return {
        "gpu_util": round(
            statistics.median(ratio(c["gpu_util"], e["gpu_util"]) for e, c in pairs), 4
        ),
        "train_throughput": round(
            statistics.median(
                ratio(c["train_throughput"], e["train_throughput"]) for e, c in pairs
            ),
            4,
        ),
        "avg_jct_s": round(
            statistics.median(ratio(e["avg_jct_s"], c["avg_jct_s"]) for e, c in pairs), 4
        ),
    }
