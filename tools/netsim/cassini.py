"""CASSINI-style time shifts: interleave the communication phases of jobs that share links.

CASSINI (NSDI'24) draws each job's iteration as a circle whose arcs are its communication
phases, lays the circles of the jobs that share a link on one "unified circle" (its
perimeter a common multiple of their iteration times) and rotates them so that the
bandwidth they ask for at any moment fits the link; each job is then started with that time
shift. This is the same idea on the simulator's jobs:

* jobs are grouped by shared links (connected components); a job alone needs no shift;
* the unified circle's perimeter is ``m x`` the longest contention-free iteration time
  (``m`` in 1..4, the one that stretches the other jobs least); a job repeats
  ``floor(perimeter / T*)`` times on it, so its paced period is at least ``T*``; groups
  whose best circle would stretch some job by more than :data:`MAX_STRETCH` are left
  unshifted (CASSINI places compatible jobs together; for incompatible ones it has no
  answer but sharing);
* on a circle of :data:`BINS` bins, each job's communication arcs load their links at the
  job's contention-free rate; shifts are chosen greedily (heaviest communicator first,
  then one pass of re-placing each job) to minimize the demand above capacity summed over
  links and bins (normalized by capacity);
* the plan is kept only if it leaves at most 10% of the overflow that no shifts leave: the
  jobs must fit taking turns. Pacing jobs that cannot fit would only add waits.

The simulator enforces a plan through :attr:`tools.netsim.engine.Decision.pace`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from tools.netsim.engine import JobInfo

BINS = 240
MAX_CANDIDATES = 60
MAX_STRETCH = 1.1
MAX_LEFT = 0.1
LOOSE_STRETCH = 1.3
LOOSE_LEFT = 1.0


def components(infos: Mapping[str, JobInfo]) -> list[list[str]]:
    """Groups of jobs joined by shared links (jobs with no traffic are left out)."""
    parent = {j: j for j in infos if infos[j].link_bytes}

    def root(j: str) -> str:
        while parent[j] != j:
            parent[j] = parent[parent[j]]
            j = parent[j]
        return j

    owner: dict[str, str] = {}
    for j in sorted(parent):
        for link in infos[j].link_bytes:
            if link in owner:
                parent[root(j)] = root(owner[link])
            else:
                owner[link] = j
    groups: dict[str, list[str]] = {}
    for j in sorted(parent):
        groups.setdefault(root(j), []).append(j)
    return sorted(groups.values())


def unified_circle(periods: Mapping[str, float]) -> tuple[float, dict[str, int]]:
    """(perimeter, repetitions per job) that stretches the jobs' periods least."""
    longest = max(periods.values())
    best: tuple[float, float, dict[str, int]] | None = None
    for mult in (1, 2, 3, 4):
        perimeter = mult * longest
        reps = {j: max(1, math.floor(perimeter / t + 1e-9)) for j, t in periods.items()}
        stretch = max(perimeter / reps[j] / t for j, t in periods.items())
        if best is None or stretch < best[0] - 1e-9:
            best = (stretch, perimeter, reps)
    assert best is not None
    return best[1], best[2]


class _Circle:
    """Per-link demand (fractions of capacity) over the bins of a unified circle."""

    def __init__(self, links: list[str]) -> None:
        self.load = {link: [0.0] * BINS for link in links}

    def delta(self, arcs: list[int], rates: Mapping[str, float], sign: float = 1.0) -> float:
        """Change in overflow if a job with these arc bins and per-link rates is added."""
        total = 0.0
        for link, r in rates.items():
            row = self.load[link]
            for b in arcs:
                before = row[b]
                after = before + sign * r
                total += max(0.0, after - 1.0) - max(0.0, before - 1.0)
        return total

    def add(self, arcs: list[int], rates: Mapping[str, float], sign: float = 1.0) -> None:
        for link, r in rates.items():
            row = self.load[link]
            for b in arcs:
                row[b] += sign * r

    def overflow(self) -> float:
        return sum(max(0.0, v - 1.0) for row in self.load.values() for v in row)


def _arcs(info: JobInfo, shift_bins: int, reps: int, perimeter: float) -> list[int]:
    """The bins a job's communication covers on the circle, shifted by ``shift_bins``."""
    period = perimeter / reps
    length = max(1, round(info.comm_ideal_s / perimeter * BINS))
    out: list[int] = []
    for k in range(reps):
        start = shift_bins + round((info.comm_offset_s + k * period) / perimeter * BINS)
        out.extend((start + i) % BINS for i in range(min(length, BINS)))
    return out


def plan_shifts(
    now: float,
    infos: Mapping[str, JobInfo],
    capacity: Mapping[str, float],
    *,
    max_stretch: float = MAX_STRETCH,
    max_left: float = MAX_LEFT,
) -> dict[str, tuple[float, float]]:
    """Pacing per job, ``(first slot, period)``, for the jobs worth shifting.

    ``max_stretch`` and ``max_left`` loosen or tighten the two rules above (the ``loose``
    reading paces any group whose overflow the shifts reduce at all)."""
    pace: dict[str, tuple[float, float]] = {}
    for group in components(infos):
        if len(group) < 2:
            continue
        periods = {j: infos[j].ideal_s for j in group}
        perimeter, reps = unified_circle(periods)
        if any(perimeter / reps[j] > max_stretch * periods[j] for j in group):
            continue
        rates = {
            j: {
                link: b / infos[j].comm_ideal_s / capacity[link]
                for link, b in infos[j].link_bytes.items()
            }
            for j in group
        }
        links = sorted({link for j in group for link in infos[j].link_bytes})
        plain = _Circle(links)
        for j in group:
            plain.add(_arcs(infos[j], 0, reps[j], perimeter), rates[j])
        before = plain.overflow()
        if before <= 0:
            continue
        circle = _Circle(links)
        shift: dict[str, int] = {}
        heavy_first = sorted(group, key=lambda j: (-infos[j].comm_ideal_s / periods[j], j))
        for rnd in range(2):
            for j in heavy_first:
                if rnd:
                    circle.add(_arcs(infos[j], shift[j], reps[j], perimeter), rates[j], -1.0)
                span = max(1, round(BINS / reps[j]))
                step = max(1, span // MAX_CANDIDATES)
                best_s, best_d = 0, math.inf
                for s in range(0, span, step):
                    d = circle.delta(_arcs(infos[j], s, reps[j], perimeter), rates[j])
                    if d < best_d - 1e-12:
                        best_s, best_d = s, d
                shift[j] = best_s
                circle.add(_arcs(infos[j], best_s, reps[j], perimeter), rates[j])
        if circle.overflow() > max_left * before - 1e-12:
            continue
        for j in group:
            pace[j] = (now + shift[j] / BINS * perimeter, perimeter / reps[j])
    return pace
