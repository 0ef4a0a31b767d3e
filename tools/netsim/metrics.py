"""Progress metrics over the measurement window, and running a scenario under policies.

A job's progress rate is ``T* x iterations completed / elapsed`` inside
``[warmup_s, duration_s]``, where elapsed is the part of the window the job was running
(so late arrivals and early leavers are measured on their own lifetime). Counting whole
iterations makes it pessimistic by at most one iteration per window, for every policy
alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tools.netsim.bound import Bound, fluid_bound
from tools.netsim.engine import JobRun, RunResult, Simulation, job_infos
from tools.netsim.policies import POLICY_NAMES, make_policy
from tools.netsim.scenario import Scenario


@dataclass(frozen=True)
class PolicyMetrics:
    min_progress: float
    mean_progress: float
    jain: float
    efficiency: float
    level_changes: int
    jobs: Mapping[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "min_progress": self.min_progress,
            "mean_progress": self.mean_progress,
            "jain": self.jain,
            "efficiency": self.efficiency,
            "level_changes": self.level_changes,
            "jobs": dict(self.jobs),
        }


@dataclass(frozen=True)
class ScenarioReport:
    scenario: str
    policies: Mapping[str, PolicyMetrics]
    bound: Bound
    runs: Mapping[str, RunResult]

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "policies": {name: m.to_dict() for name, m in self.policies.items()},
            "bound": {"min_progress": self.bound.min_progress, "jobs": dict(self.bound.jobs)},
        }


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one takes everything."""
    if not values:
        return 0.0
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares > 0 else 1.0


def job_rate(run: JobRun, window: tuple[float, float]) -> float | None:
    """Progress rate of one job inside ``window``; ``None`` if it never ran there."""
    lo = max(window[0], run.start_s)
    hi = min(window[1], run.end_s)
    if hi <= lo:
        return None
    done = sum(1 for t in run.completions if lo < t <= hi)
    return run.ideal_s * done / (hi - lo)


def summarize(result: RunResult, scenario: Scenario) -> PolicyMetrics:
    window = (scenario.warmup_s, scenario.duration_s)
    rates = {}
    for job_id in sorted(result.jobs):
        rate = job_rate(result.jobs[job_id], window)
        if rate is not None:
            rates[job_id] = rate
    values = list(rates.values())
    return PolicyMetrics(
        min_progress=min(values, default=0.0),
        mean_progress=sum(values) / len(values) if values else 0.0,
        jain=jain(values),
        efficiency=sum(values),
        level_changes=result.level_changes,
        jobs=rates,
    )


def run_scenario(scenario: Scenario, policies: Iterable[str] = POLICY_NAMES) -> ScenarioReport:
    """Simulate ``scenario`` under each policy and compute the bound."""
    infos = job_infos(scenario)
    runs: dict[str, RunResult] = {}
    metrics: dict[str, PolicyMetrics] = {}
    for name in policies:
        result = Simulation(scenario, make_policy(name)).run()
        runs[name] = result
        metrics[name] = summarize(result, scenario)
    return ScenarioReport(
        scenario=scenario.name, policies=metrics, bound=fluid_bound(scenario, infos), runs=runs
    )


def geomean(values: Iterable[float]) -> float:
    """Geometric mean; zeros are floored at 1e-6 so one starved job does not erase a row."""
    vals = [max(v, 1e-6) for v in values]
    if not vals:
        return 0.0
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def windowed_rates(run: JobRun, times: Sequence[float], window_s: float) -> list[float | None]:
    """Progress rate over the trailing ``window_s`` at each of ``times`` (for plots)."""
    out: list[float | None] = []
    comps = run.completions
    for t in times:
        lo = max(t - window_s, run.start_s)
        hi = min(t, run.end_s)
        if hi - lo < window_s / 2:
            out.append(None)
            continue
        done = sum(1 for c in comps if lo < c <= hi)
        out.append(run.ideal_s * done / (hi - lo))
    return out
