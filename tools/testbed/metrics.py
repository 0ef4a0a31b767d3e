"""What a testbed phase achieved, from each job's iteration completion times (pure).

* progress of job j: its iteration rate over the window times its contention-free
  iteration time T*_j (1.0 = as fast as alone);
* ``min_progress``: the slowest job's progress (what LEVELLER maximises);
* ``jain``: Jain's index over the jobs' progress, (sum x)^2 / (n sum x^2);
* ``efficiency``: bytes the jobs completed over the window, over what the link's measured
  goodput G could carry in it;
* ``ceiling``: G / sum_j d_j with d_j = B_j / T*_j, the job's demand alone: no scheduler
  can give every job more progress than that (capped at 1).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class JobSpec:
    """One emulated job: ``conns`` TCP connections, ``nbytes`` per iteration, compute time."""

    name: str
    conns: int
    nbytes: int
    compute_s: float


def parse_jobs(spec: str) -> list[JobSpec]:
    """``NAME:CONNS:MB:COMPUTE_MS,...`` (``a:1:4:40,b:16:4:40``)."""
    jobs = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        fields = part.split(":")
        if len(fields) != 4:
            raise ValueError(f"{part!r}: need NAME:CONNS:MB:COMPUTE_MS")
        name, conns, mb, compute = fields
        try:
            job = JobSpec(name, int(conns), int(float(mb) * 1_000_000), float(compute) / 1000.0)
        except ValueError:
            raise ValueError(f"{part!r}: CONNS is an integer, MB and COMPUTE_MS numbers") from None
        if not name.replace("-", "").isalnum() or not 1 <= job.conns <= 64 or job.nbytes < 1:
            raise ValueError(f"{part!r}: a name, 1..64 connections and some bytes")
        if job.compute_s < 0:
            raise ValueError(f"{part!r}: COMPUTE_MS must be >= 0")
        jobs.append(job)
    if len({j.name for j in jobs}) != len(jobs):
        raise ValueError("job names must differ")
    if not jobs:
        raise ValueError("no jobs")
    return jobs


def ceiling(jobs: Sequence[JobSpec], ideal_s: Mapping[str, float], goodput_bps: float) -> float:
    demand = sum(j.nbytes * 8 / ideal_s[j.name] for j in jobs)
    return min(1.0, goodput_bps / demand)


def completed(times: Sequence[float], t: float) -> float:
    """Iterations completed by ``t``, counting the one in progress by the fraction of its
    duration elapsed (completion times are sorted; none after the last one is counted)."""
    i = bisect.bisect_right(times, t)
    if i == 0 or i == len(times):
        return float(i)
    before, after = times[i - 1], times[i]
    return i + (t - before) / (after - before)


def progress(times: Sequence[float], ideal_s: float, t0: float, t1: float) -> float:
    """Iterations per second over (t0, t1], times ``ideal_s``: the share of its speed alone
    the job kept. Iterations straddling the window's edges count by fraction, so a window
    holding a few dozen iterations is not quantised to whole ones."""
    return (completed(times, t1) - completed(times, t0)) / (t1 - t0) * ideal_s


def jain(values: Sequence[float]) -> float:
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 0.0


def summarize(
    jobs: Sequence[JobSpec],
    times: Mapping[str, Sequence[float]],
    ideal_s: Mapping[str, float],
    goodput_bps: float,
    *,
    t0: float,
    t1: float,
) -> dict[str, object]:
    per_job = {j.name: progress(times[j.name], ideal_s[j.name], t0, t1) for j in jobs}
    carried = sum(sum(1 for t in times[j.name] if t0 < t <= t1) * j.nbytes * 8 for j in jobs)
    return {
        "min_progress": round(min(per_job.values()), 4),
        "jain": round(jain(list(per_job.values())), 4),
        "efficiency": round(carried / (goodput_bps * (t1 - t0)), 4),
        "progress": {k: round(v, 4) for k, v in per_job.items()},
    }


def series(
    times: Sequence[float], ideal_s: float, start: float, end: float, step: float = 1.0
) -> list[tuple[float, float]]:
    """(seconds since ``start``, progress over the preceding ``step``) for the plot."""
    out = []
    t = start + step
    while t <= end + 1e-9:
        out.append((t - start, progress(times, ideal_s, t - step, t)))
        t += step
    return out
