"""The suite's comparison: LEVELLER against each baseline's best reading, per scenario group.

A baseline's *best reading* on a scenario is, per metric, the best value any of its
readings reached there (:data:`tools.netsim.policies.BASELINES`); ``best`` is the best over
all baselines' readings. Groups: every scenario, those with at most as many jobs present at
once as levels (``n <= K``: each job can have a level of its own) and those with more.

Geometric means are exact: one scenario at 0 makes a policy's mean 0. Beside it, the mean
over the scenarios above 0 and how many are at 0. LEVELLER's ratio to a reference is the
geometric mean of the per-scenario ratios over the scenarios where both are above 0; the
scenarios where only the reference is 0 (LEVELLER infinitely better) and where LEVELLER is
0 are counted apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tools.netsim.metrics import ScenarioReport, geomean, positive_geomean
from tools.netsim.policies import BASELINES

METRICS = ("min_progress", "jain", "efficiency")

# (label, leveller metric, reference, factor): the reference is "best" (the best baseline
# reading), "fair" or "bound".
TARGETS: tuple[tuple[str, str, str, float], ...] = (
    ("min_progress >= 1.57 x best baseline reading", "min_progress", "best", 1.57),
    ("jain >= 1.17 x best baseline reading", "jain", "best", 1.17),
    ("efficiency >= 0.95 x fair", "efficiency", "fair", 0.95),
    ("min_progress >= 0.85 x bound", "min_progress", "bound", 0.85),
)


# Pseudo-families: every baseline reading, and only the priority orders' readings.
POOLS: dict[str, tuple[str, ...]] = {
    "best": tuple(n for names in BASELINES.values() for n in names),
    "best-prio": BASELINES["sincronia"] + BASELINES["crux"],
}


def best_reading(report: ScenarioReport, family: str, metric: str) -> tuple[str, float] | None:
    """(reading, value) of the family's best reading on this scenario, or None if none ran."""
    names = POOLS.get(family) or BASELINES[family]
    found = [(getattr(report.policies[n], metric), n) for n in names if n in report.policies]
    if not found:
        return None
    value, name = max(found, key=lambda x: (x[0], -names.index(x[1])))
    return name, value


def value(report: ScenarioReport, column: str, metric: str) -> float | None:
    """A column's value on a scenario: a policy, a baseline family (best reading), ``best``
    or ``bound``."""
    if column == "bound":
        return report.bound.min_progress if metric == "min_progress" else None
    if column in BASELINES or column in POOLS:
        found = best_reading(report, column, metric)
        return found[1] if found else None
    if column in report.policies:
        return float(getattr(report.policies[column], metric))
    return None


def columns(reports: Sequence[ScenarioReport]) -> list[str]:
    """fair, the baseline families present, best, leveller -- whichever ran."""
    ran = set(reports[0].policies) if reports else set()
    cols = [c for c in ("fair",) if c in ran]
    fams = [f for f, names in BASELINES.items() if ran & set(names)]
    cols += fams
    if fams:
        cols.append("best")
    if "leveller" in ran:
        cols.append("leveller")
    return cols


def groups(reports: Sequence[ScenarioReport]) -> dict[str, list[ScenarioReport]]:
    return {
        "all": list(reports),
        "n<=K": [r for r in reports if r.jobs <= r.levels],
        "n>K": [r for r in reports if r.jobs > r.levels],
    }


def _ratio(reports: Sequence[ScenarioReport], metric: str, against: str) -> dict[str, Any]:
    ratios: list[float] = []
    ref_zero: list[str] = []
    ours_zero: list[str] = []
    for r in reports:
        ours = value(r, "leveller", metric)
        ref = value(r, against, metric)
        if ours is None or ref is None:
            continue
        if ours <= 0:
            ours_zero.append(r.scenario)
        elif ref <= 0:
            ref_zero.append(r.scenario)
        else:
            ratios.append(ours / ref)
    return {
        "ratio": geomean(ratios) if ratios else None,
        "scenarios": len(ratios),
        "reference_zero": ref_zero,
        "leveller_zero": ours_zero,
        "worst": min(ratios, default=None),
    }


def summary(reports: Sequence[ScenarioReport]) -> dict[str, Any]:
    """Per group: geometric means per column, LEVELLER's ratios; targets over the suite."""
    cols = columns(reports)
    out: dict[str, Any] = {"groups": {}, "targets": []}
    for gname, members in groups(reports).items():
        if not members:
            continue
        means: dict[str, dict[str, Any]] = {}
        for col in [*cols, "bound"]:
            means[col] = {}
            for metric in METRICS:
                vals = [value(r, col, metric) for r in members]
                if any(v is None for v in vals):
                    continue
                nums = [v for v in vals if v is not None]
                pos, zeros = positive_geomean(nums)
                means[col][metric] = {"geomean": geomean(nums), "positive": pos, "zeros": zeros}
        ratios: dict[str, Any] = {}
        if "leveller" in cols:
            extra = ["best-prio"] if "sincronia" in cols and "crux" in cols else []
            for col in [c for c in cols if c != "leveller"] + extra + ["bound"]:
                ratios[col] = _ratio(members, "min_progress", col)
        # No policy beats the bound: its ratio to the best reading caps any policy's ratio.
        headroom = [
            b / v
            for r in members
            if (v := value(r, "best", "min_progress")) and (b := r.bound.min_progress) > 0
        ]
        upper = [r.bound.upper / v for r in members if (v := value(r, "best", "min_progress"))]
        out["groups"][gname] = {
            "scenarios": [r.scenario for r in members],
            "geomean": means,
            "leveller_min_progress_over": ratios,
            "bound_over_best": geomean(headroom) if headroom else None,
            # the valid upper bound over the best reading: no policy's ratio can exceed it
            "upper_over_best": geomean(upper) if upper else None,
            "upper_geomean": geomean([r.bound.upper for r in members]),
        }
    if "leveller" in cols:
        for label, metric, against, factor in TARGETS:
            if against != "bound" and against not in cols:
                continue
            res = _ratio(reports, metric, against)
            ratio = res["ratio"]
            met = ratio is not None and ratio >= factor and not res["leveller_zero"]
            out["targets"].append({"target": label, "factor": factor, "met": met, **res})
        if "fair" in cols:
            below = [
                r.scenario
                for r in reports
                if r.policies["leveller"].min_progress < r.policies["fair"].min_progress
            ]
            out["targets"].append(
                {
                    "target": "min_progress >= fair on every scenario",
                    "scenarios_below": below,
                    "met": not below,
                }
            )
    return out


def winners(reports: Sequence[ScenarioReport]) -> dict[str, int]:
    """How often each reading is the best baseline reading on min_progress."""
    count: dict[str, int] = {}
    for r in reports:
        found = best_reading(r, "best", "min_progress")
        if found:
            count[found[0]] = count.get(found[0], 0) + 1
    return dict(sorted(count.items(), key=lambda kv: (-kv[1], kv[0])))
