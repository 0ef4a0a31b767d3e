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
from tools.netsim.policies import POLICY_NAMES, expand, make_policy
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
    jobs: int = 0  # the most jobs present at once
    levels: int = 8

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "jobs": self.jobs,
            "levels": self.levels,
            "policies": {name: m.to_dict() for name, m in self.policies.items()},
            "bound": {
                "min_progress": self.bound.min_progress,
                "upper": self.bound.upper,
                "jobs": dict(self.bound.jobs),
            },
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


def simulate(scenario: Scenario, policy: str) -> RunResult:
    """One run of ``scenario`` under the policy (reading) named ``policy``."""
    return Simulation(scenario, make_policy(policy)).run()


def run_scenario(
    scenario: Scenario, policies: Iterable[str] = POLICY_NAMES, workers: int = 1
) -> ScenarioReport:
    """Simulate ``scenario`` under each policy (families expand to all their readings)."""
    return run_scenarios([scenario], policies, workers)[0]


def run_scenarios(
    scenarios: Sequence[Scenario], policies: Iterable[str] = POLICY_NAMES, workers: int = 1
) -> list[ScenarioReport]:
    """Every (scenario, policy) run, in ``workers`` processes; results do not depend on it."""
    names = expand(list(policies))
    tasks = [(sc, name) for sc in scenarios for name in names]
    if workers > 1 and len(tasks) > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(simulate, *zip(*tasks, strict=True), chunksize=1))
    else:
        results = [simulate(sc, name) for sc, name in tasks]
    reports = []
    for i, sc in enumerate(scenarios):
        runs = dict(zip(names, results[i * len(names) : (i + 1) * len(names)], strict=True))
        reports.append(
            ScenarioReport(
                scenario=sc.name,
                policies={n: summarize(r, sc) for n, r in runs.items()},
                bound=fluid_bound(sc, job_infos(sc)),
                runs=runs,
                jobs=peak_jobs(sc),
                levels=sc.levels,
            )
        )
    return reports


def peak_jobs(scenario: Scenario) -> int:
    """The most jobs present at once (by their start and stop times)."""
    edges = sorted(
        [(j.start_s, 1) for j in scenario.jobs]
        + [(j.stop_s, -1) for j in scenario.jobs if j.stop_s is not None],
        key=lambda e: (e[0], e[1]),
    )
    peak = now = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


def geomean(values: Iterable[float]) -> float:
    """Geometric mean, exactly: 0 when any value is 0 (see :func:`positive_geomean`)."""
    vals = list(values)
    if not vals or min(vals) <= 0:
        return 0.0
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def positive_geomean(values: Iterable[float]) -> tuple[float, int]:
    """(geometric mean of the values above 0, how many are 0) -- zeros reported, not floored."""
    vals = list(values)
    pos = [v for v in vals if v > 0]
    return geomean(pos), len(vals) - len(pos)


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
