"""The fluid max-min upper bound on progress rates.

With every job's communication spread evenly over its iteration, job ``j`` at progress
rate ``r_j`` loads link ``l`` with ``bytes_on_link_j * r_j / T*_j`` bytes/s. Any schedule's
long-run rates satisfy ``sum_j bytes_on_link_j * r_j / T*_j <= capacity_l`` and
``r_j <= 1``, so the max-min fair point of that polytope -- found exactly by progressive
filling over ``r_j`` -- bounds every policy's minimum progress rate from above.

When jobs arrive and leave, the set of competitors changes; the bound is then computed on
each stretch of constant membership and each job's bound is its time-average over its
active part of the measurement window. (Jobs limited by ``iterations`` leave when the
fluid rates would finish them.) Only the constant-membership form is a strict upper
bound; with churn it is the natural piecewise extension and is reported as such: a
schedule can give a job less while it competes and more once its rivals left, and beat
it (staggered-8 does).

``upper`` is an upper bound for every scenario, churn included. Let job ``j`` be active
for ``A_j`` seconds of the window and keep average rate ``r_j``: it completes ``r_j A_j /
T*_j`` iterations and sends ``B_lj`` bytes over link ``l`` for each. For any interval
``I`` of the window, the jobs active only inside ``I`` send all of that inside ``I``, so
``min_j r_j * sum_{j inside I} B_lj A_j / T*_j <= C_l |I|``; with ``r_j <= 1``,

    upper = min(1, min over links l and intervals I of C_l |I| / sum_{j inside I} B_lj A_j / T*_j)

over the intervals between membership changes (jobs limited by ``iterations``, whose
active time depends on the schedule, are left out of the sums: that only loosens it).
With constant membership it is the first water level of the progressive filling, so it
equals ``min_progress`` there. What no fluid bound counts: at most one iteration per job
straddles each edge of the window (a relative error of about ``T*/window``, under 0.5% on
the built-in suite).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tools.netsim.engine import JobInfo, job_infos
from tools.netsim.scenario import Scenario


@dataclass(frozen=True)
class Bound:
    min_progress: float
    jobs: Mapping[str, float]
    upper: float = 1.0  # an upper bound on any schedule's min_progress (module docstring)


def progressive_fill(
    demand: Mapping[str, Mapping[str, float]], capacity: Mapping[str, float]
) -> dict[str, float]:
    """Max-min ``r`` with ``r_j <= 1`` and ``sum_j demand[j][l] * r_j <= capacity[l]``.

    ``demand[j][l]``: bytes/s job ``j`` puts on link ``l`` at ``r_j = 1``.
    """
    rates = dict.fromkeys(demand, 0.0)
    unfrozen = set(demand)
    residual = dict(capacity)
    level = 0.0
    while unfrozen:
        # The next event: some link fills, or everyone reaches 1.
        step = 1.0 - level
        tight: list[str] = []
        for link, cap in residual.items():
            load = sum(demand[j].get(link, 0.0) for j in unfrozen)
            if load <= 0:
                continue
            room = max(cap, 0.0) / load
            if room < step - 1e-12:
                step, tight = room, [link]
            elif abs(room - step) <= 1e-12:
                tight.append(link)
        for link in residual:
            residual[link] -= step * sum(demand[j].get(link, 0.0) for j in unfrozen)
        level += step
        if not tight:
            for j in unfrozen:
                rates[j] = level
            break
        done = {j for j in unfrozen if any(demand[j].get(link, 0.0) > 0 for link in tight)}
        for j in done:
            rates[j] = level
        unfrozen -= done
    return rates


def fluid_bound(scenario: Scenario, infos: Mapping[str, JobInfo] | None = None) -> Bound:
    """The bound on ``scenario``: per-job rates averaged over the measurement window."""
    infos = infos or job_infos(scenario)
    capacity = {name: scenario.link_bytes_per_s(name) for name in scenario.links}
    demand = {
        j: {link: b / info.ideal_s for link, b in info.link_bytes.items()}
        for j, info in infos.items()
    }
    end = scenario.duration_s
    w0 = scenario.warmup_s
    start = {j.id: j.start_s for j in scenario.jobs}
    stop = {j.id: (j.stop_s if j.stop_s is not None else math.inf) for j in scenario.jobs}
    left_iters = {
        j.id: float(j.iterations) if j.iterations is not None else math.inf for j in scenario.jobs
    }
    integral = dict.fromkeys(infos, 0.0)
    active_time = dict.fromkeys(infos, 0.0)
    t = 0.0
    while t < end:
        active = sorted(j for j in infos if start[j] <= t < stop[j] and left_iters[j] > 0)
        boundaries: Sequence[float] = [x for x in [*start.values(), *stop.values(), end] if x > t]
        t_next = min(boundaries)
        rates = progressive_fill({j: demand[j] for j in active}, capacity)
        for j in active:
            # Iteration-limited jobs may finish inside this stretch.
            speed = rates[j] / infos[j].ideal_s
            if speed > 0 and math.isfinite(left_iters[j]):
                t_next = min(t_next, t + left_iters[j] / speed)
        for j in active:
            left_iters[j] -= rates[j] / infos[j].ideal_s * (t_next - t)
            if left_iters[j] <= 1e-9:
                stop[j] = min(stop[j], t_next)
                left_iters[j] = 0.0
            overlap = max(0.0, min(t_next, end) - max(t, w0))
            integral[j] += rates[j] * overlap
            active_time[j] += overlap
        t = t_next
    jobs = {j: integral[j] / active_time[j] for j in sorted(infos) if active_time[j] > 0}
    return Bound(
        min_progress=min(jobs.values(), default=0.0),
        jobs=jobs,
        upper=interval_bound(scenario, infos),
    )


def interval_bound(scenario: Scenario, infos: Mapping[str, JobInfo]) -> float:
    """``upper`` of the module docstring: a bound no schedule's min_progress exceeds."""
    w0, end = scenario.warmup_s, scenario.duration_s
    span: dict[str, tuple[float, float]] = {}
    for spec in scenario.jobs:
        if spec.iterations is not None:
            continue
        a = max(spec.start_s, w0)
        b = min(spec.stop_s if spec.stop_s is not None else end, end)
        if b > a:
            span[spec.id] = (a, b)
    edges = sorted({w0, end, *(x for ab in span.values() for x in ab)})
    best = 1.0
    for i, lo in enumerate(edges):
        for hi in edges[i + 1 :]:
            inside = [j for j, (a, b) in span.items() if lo <= a and b <= hi]
            if not inside:
                continue
            for link in scenario.links:
                load = sum(
                    infos[j].link_bytes.get(link, 0.0)
                    * (span[j][1] - span[j][0])
                    / infos[j].ideal_s
                    for j in inside
                )
                if load > 0:
                    best = min(best, scenario.link_bytes_per_s(link) * (hi - lo) / load)
    return best
