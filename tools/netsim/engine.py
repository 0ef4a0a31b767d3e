"""Event-driven, flow-level simulation of training jobs sharing links.

A job iterates: compute for ``compute_s``, then send its flows; the iteration ends when
the compute and every flow are done. With ``overlap`` > 0 the flows start early, so that
that fraction of the contention-free communication hides under compute.

Rates are recomputed (:func:`tools.netsim.fluid.allocate`) only when something changes
what competes -- a flow starts or finishes, a job's level changes -- and time jumps
straight to the next flow completion or timer (compute end, job start or stop, policy
tick). Everything is deterministic: no randomness, ties broken by insertion order.

The policy sees what the daemon would: at every tick (and when a job arrives or leaves)
it is asked for levels; it can read each job's last iteration report and what the job
declared. Baselines may also read scheduling inputs their designs assume (flow sizes,
compute time), through the same :class:`View`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from tools.netsim.fluid import allocate, waterfill
from tools.netsim.scenario import JobSpec, Scenario

# A flow is done when this fraction of its bytes is left: float error after jumping to
# its computed completion time must not leave it running for a sliver of a byte.
_DONE_FRACTION = 1e-9

_START, _COMM, _COMPUTE, _STOP, _TICK, _BEGIN = range(6)

# A paced job up to this fraction of its period late starts at once (see Decision.pace).
PACE_SLACK = 0.05


@dataclass(frozen=True)
class JobInfo:
    """Static facts about a job, known before it runs.

    ``ideal_s``: contention-free iteration time (the job alone on the network).
    ``link_seconds``: per link, the seconds one iteration's bytes take at full capacity.
    ``link_bytes``: per link, the bytes one iteration sends across it.
    """

    spec: JobSpec
    ideal_s: float
    comm_ideal_s: float
    comm_offset_s: float
    link_bytes: Mapping[str, float]
    link_seconds: Mapping[str, float]


@dataclass(frozen=True)
class Decision:
    """A policy's answer: job -> level (0 highest) and level -> minimum link share."""

    levels: Mapping[str, int]
    shares: tuple[float, ...] = ()
    per_job: bool = False
    """How a level's bandwidth is split: per flow (False: the kernel's default qdisc and
    TCP's per-flow fairness) or per job (True: gpud's HTB tree, where each job has its own
    leaf class under its level with equal quanta, so jobs on one level share per job and
    a job's flows share its part). Per job is modelled at each flow's first link (the
    sending host's interface, where the tree sits): a job's flows that start on one link
    weigh one job together."""
    weights: Mapping[str, float] = field(default_factory=dict)
    """With ``per_job``: job -> its weight against the other jobs of its level (gpud's
    demand weights, :mod:`netshaper.weights`); absent jobs weigh 1."""
    pace: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Optional pacing (CASSINI's time shifts): job -> (first slot, period).

    A paced job starts an iteration only on its grid ``first + m * period``: at once if a
    slot passed less than ``PACE_SLACK`` of a period ago, otherwise at the next slot (so
    a job knocked off its phase waits once and is back on it). Jobs absent are unpaced.
    """


class View(Protocol):
    """What a policy may read about the running simulation."""

    @property
    def levels(self) -> int: ...

    def active_jobs(self) -> list[str]: ...

    def info(self, job_id: str) -> JobInfo: ...

    def report(self, job_id: str) -> tuple[int, float]:
        """(iterations completed, when the last one completed -- or the start time)."""
        ...

    def remaining_link_seconds(self, job_id: str) -> dict[str, float]:
        """Per link, seconds at full capacity for what is left of this iteration's bytes."""
        ...

    def coflow_since(self, job_id: str) -> float | None:
        """When the job's current communication phase began; ``None`` while it has none."""
        ...

    def link_capacity(self, link: str) -> float:
        """The link's capacity in bytes/s."""
        ...

    def leveller_knobs(self) -> Mapping[str, float]:
        """The scenario's traffic knobs for LEVELLER (empty: netshaper's defaults)."""
        ...


class Policy(Protocol):
    """A scheduling policy. ``reorder_on_coflows``: also ask it when a job's
    communication phase (a coflow) starts or ends, not only on ticks and arrivals."""

    name: str
    reorder_on_coflows: bool

    def decide(self, now: float, view: View) -> Decision: ...


@dataclass
class _Flow:
    job: int
    links: tuple[int, ...]
    weight: int
    size: float
    remaining: float
    rate: float = 0.0


@dataclass
class _Job:
    idx: int
    info: JobInfo
    groups: tuple[tuple[tuple[int, ...], int, float], ...]  # (links, weight, bytes/flow)
    running: bool = False
    done: bool = False
    epoch: int = 0
    iteration: int = 0
    last_report_at: float = 0.0
    compute_done: bool = False
    comm_started: bool = False
    comm_started_at: float = 0.0
    pace: tuple[float, float] | None = None
    flows: list[_Flow] = field(default_factory=list)
    completions: list[float] = field(default_factory=list)
    end_s: float | None = None


@dataclass(frozen=True)
class JobRun:
    """What one job did in one run."""

    job_id: str
    start_s: float
    end_s: float  # when it stopped, or the scenario's end
    ideal_s: float
    completions: tuple[float, ...]


@dataclass(frozen=True)
class RunResult:
    policy: str
    jobs: Mapping[str, JobRun]
    level_changes: int  # inside [warmup_s, duration_s]
    events: int


def job_infos(scenario: Scenario) -> dict[str, JobInfo]:
    """Static facts (ideal iteration time, per-link load) of every job of ``scenario``."""
    link_index = {name: i for i, name in enumerate(scenario.links)}
    caps = [scenario.link_bytes_per_s(name) for name in scenario.links]
    out: dict[str, JobInfo] = {}
    for spec in scenario.jobs:
        groups = _groups(spec, link_index)
        comm = _alone_comm_s(groups, caps)
        offset = max(0.0, spec.compute_s - spec.overlap * comm)
        ideal = max(spec.compute_s, offset + comm)
        link_bytes: dict[str, float] = {}
        for f in spec.flows:
            for hop in f.path:
                link_bytes[hop] = link_bytes.get(hop, 0.0) + f.bytes * f.count
        out[spec.id] = JobInfo(
            spec=spec,
            ideal_s=ideal,
            comm_ideal_s=comm,
            comm_offset_s=offset,
            link_bytes=link_bytes,
            link_seconds={k: v / scenario.link_bytes_per_s(k) for k, v in link_bytes.items()},
        )
    return out


def _groups(
    spec: JobSpec, link_index: Mapping[str, int]
) -> tuple[tuple[tuple[int, ...], int, float], ...]:
    """Merge a job's identical flows (same path and size) into weighted groups."""
    merged: dict[tuple[tuple[int, ...], float], int] = {}
    for f in spec.flows:
        key = (tuple(link_index[h] for h in f.path), f.bytes)
        merged[key] = merged.get(key, 0) + f.count
    return tuple((links, count, size) for (links, size), count in merged.items())


def _alone_comm_s(
    groups: tuple[tuple[tuple[int, ...], int, float], ...], caps: list[float]
) -> float:
    """How long a job's flows take with the network to themselves."""
    paths = [g[0] for g in groups]
    weights = [float(g[1]) for g in groups]
    left = [g[2] for g in groups]
    live = list(range(len(groups)))
    t = 0.0
    while live:
        rates = waterfill([paths[i] for i in live], [weights[i] for i in live], caps)
        dt = min(left[i] / r for i, r in zip(live, rates, strict=True))
        t += dt
        for i, r in zip(live, rates, strict=True):
            left[i] -= r * dt
        live = [i for i in live if left[i] > groups[i][2] * _DONE_FRACTION]
    return t


class Simulation:
    """One scenario under one policy. Call :meth:`run` once."""

    def __init__(self, scenario: Scenario, policy: Policy) -> None:
        self._sc = scenario
        self._policy = policy
        self._link_index = {name: i for i, name in enumerate(scenario.links)}
        self._caps = [scenario.link_bytes_per_s(name) for name in scenario.links]
        infos = job_infos(scenario)
        self._jobs = [
            _Job(idx=i, info=infos[spec.id], groups=_groups(spec, self._link_index))
            for i, spec in enumerate(scenario.jobs)
        ]
        self._by_id = {j.info.spec.id: j for j in self._jobs}
        self._now = 0.0
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._active: list[_Flow] = []
        self._dirty = False
        self._levels: dict[str, int] = {}
        self._shares: tuple[float, ...] = ()
        self._per_job = False
        self._weights: dict[str, float] = {}
        self._level_changes = 0
        self._events = 0
        self._on_coflows = bool(getattr(policy, "reorder_on_coflows", False))
        self._coflow_event = False

    # -- View ---------------------------------------------------------------------------
    @property
    def levels(self) -> int:
        return self._sc.levels

    def active_jobs(self) -> list[str]:
        return sorted(j.info.spec.id for j in self._jobs if j.running)

    def info(self, job_id: str) -> JobInfo:
        return self._by_id[job_id].info

    def report(self, job_id: str) -> tuple[int, float]:
        job = self._by_id[job_id]
        return job.iteration, job.last_report_at

    def remaining_link_seconds(self, job_id: str) -> dict[str, float]:
        job = self._by_id[job_id]
        if not job.comm_started:
            return dict(job.info.link_seconds)
        names = list(self._sc.links)
        out: dict[str, float] = {}
        for f in job.flows:
            for link in f.links:
                name = names[link]
                out[name] = out.get(name, 0.0) + f.remaining * f.weight / self._caps[link]
        return out

    def link_capacity(self, link: str) -> float:
        return self._sc.link_bytes_per_s(link)

    def leveller_knobs(self) -> Mapping[str, float]:
        return self._sc.leveller

    def coflow_since(self, job_id: str) -> float | None:
        job = self._by_id[job_id]
        if not job.comm_started or not job.flows:
            return None
        return job.comm_started_at

    # -- running ------------------------------------------------------------------------
    def run(self) -> RunResult:
        sc = self._sc
        for job in self._jobs:
            self._push(job.info.spec.start_s, _START, job)
            if job.info.spec.stop_s is not None:
                self._push(job.info.spec.stop_s, _STOP, job)
        ticks = math.floor(sc.duration_s / sc.update_interval_s + 1e-9)
        self._tick_k = 0
        self._ticks = ticks
        self._push(0.0, _TICK, None)
        end = sc.duration_s
        while True:
            t_next = self._heap[0][0] if self._heap else math.inf
            for f in self._active:
                if f.rate > 0:
                    t = self._now + f.remaining / f.rate
                    t_next = min(t_next, t)
            if t_next > end:
                self._advance(end)
                break
            self._advance(t_next)
            self._events += 1
            self._finish_flows()
            while self._heap and self._heap[0][0] <= self._now:
                _, _, kind, idx, epoch = heapq.heappop(self._heap)
                self._on_timer(kind, idx, epoch)
            if self._coflow_event:
                self._coflow_event = False
                self._decide()
            if self._dirty:
                self._reallocate()
        runs: dict[str, JobRun] = {}
        for job in self._jobs:
            spec = job.info.spec
            if spec.start_s >= end:
                continue
            runs[spec.id] = JobRun(
                job_id=spec.id,
                start_s=spec.start_s,
                end_s=min(end, job.end_s if job.end_s is not None else end),
                ideal_s=job.info.ideal_s,
                completions=tuple(job.completions),
            )
        return RunResult(
            policy=self._policy.name,
            jobs=runs,
            level_changes=self._level_changes,
            events=self._events,
        )

    def _push(self, t: float, kind: int, job: _Job | None) -> None:
        idx, epoch = (job.idx, job.epoch) if job is not None else (-1, 0)
        heapq.heappush(self._heap, (t, self._seq, kind, idx, epoch))
        self._seq += 1

    def _advance(self, t: float) -> None:
        dt = t - self._now
        if dt > 0:
            for f in self._active:
                if f.rate > 0:
                    f.remaining -= f.rate * dt
        self._now = max(self._now, t)

    def _finish_flows(self) -> None:
        done = [f for f in self._active if f.remaining <= f.size * _DONE_FRACTION]
        if not done:
            return
        self._active = [f for f in self._active if f.remaining > f.size * _DONE_FRACTION]
        self._dirty = True
        for f in done:
            job = self._jobs[f.job]
            job.flows.remove(f)
            if not job.flows:
                self._coflow_event = self._on_coflows
                self._maybe_complete(job)

    def _on_timer(self, kind: int, idx: int, epoch: int) -> None:
        if kind == _TICK:
            self._decide()
            self._tick_k += 1
            if self._tick_k <= self._ticks:
                self._push(self._tick_k * self._sc.update_interval_s, _TICK, None)
            return
        job = self._jobs[idx]
        if job.done or (kind in (_COMM, _COMPUTE, _BEGIN) and epoch != job.epoch):
            return  # a timer of an iteration the job no longer runs
        if kind == _START:
            job.running = True
            job.last_report_at = self._now
            self._start_iteration(job)
            self._decide()
        elif kind == _STOP:
            self._stop(job)
            self._decide()
        elif kind == _COMM:
            self._start_comm(job)
        elif kind == _BEGIN:
            self._start_iteration(job)
        elif kind == _COMPUTE:
            job.compute_done = True
            self._maybe_complete(job)

    def _start_iteration(self, job: _Job) -> None:
        info = job.info
        job.compute_done = info.spec.compute_s <= 0
        job.comm_started = False
        if not job.compute_done:
            self._push(self._now + info.spec.compute_s, _COMPUTE, job)
        if info.comm_offset_s <= 0:
            self._start_comm(job)
        else:
            self._push(self._now + info.comm_offset_s, _COMM, job)

    def _start_comm(self, job: _Job) -> None:
        job.comm_started = True
        job.comm_started_at = self._now
        self._coflow_event = self._coflow_event or self._on_coflows
        job.flows = [
            _Flow(job=job.idx, links=links, weight=w, size=size, remaining=size)
            for links, w, size in job.groups
        ]
        if job.flows:
            self._active.extend(job.flows)
            self._dirty = True
        else:
            self._maybe_complete(job)

    def _maybe_complete(self, job: _Job) -> None:
        if not (job.compute_done and job.comm_started and not job.flows):
            return
        job.iteration += 1
        job.last_report_at = self._now
        job.completions.append(self._now)
        limit = job.info.spec.iterations
        if limit is not None and job.iteration >= limit:
            self._stop(job)
            self._decide()
            return
        job.epoch += 1
        self._next_iteration(job)

    def _next_iteration(self, job: _Job) -> None:
        """Start the next iteration now, or at the job's next pacing slot."""
        if job.pace is None:
            self._start_iteration(job)
            return
        first, period = job.pace
        now = self._now
        m = max(0, math.ceil((now - first) / period - PACE_SLACK))
        slot = first + m * period
        if slot > now + 1e-9:
            job.comm_started = False
            job.flows = []
            self._push(slot, _BEGIN, job)
        else:
            self._start_iteration(job)

    def _stop(self, job: _Job) -> None:
        job.done = True
        job.running = False
        job.end_s = self._now
        job.epoch += 1
        if job.flows:
            gone = {id(f) for f in job.flows}
            self._active = [f for f in self._active if id(f) not in gone]
            job.flows = []
            self._dirty = True

    def _decide(self) -> None:
        decision = self._policy.decide(self._now, self)
        in_window = self._now >= self._sc.warmup_s
        new_levels = dict(decision.levels)
        for job_id, level in new_levels.items():
            old = self._levels.get(job_id)
            if old is not None and old != level:
                self._dirty = True
                if in_window:
                    self._level_changes += 1
            elif old is None:
                self._dirty = True
        self._levels = new_levels
        for job in self._jobs:
            pace = decision.pace.get(job.info.spec.id)
            job.pace = pace
        if decision.shares != self._shares:
            self._shares = decision.shares
            self._dirty = True
        if decision.per_job != self._per_job or decision.weights != self._weights:
            self._per_job = decision.per_job
            self._weights = dict(decision.weights)
            self._dirty = True

    def _reallocate(self) -> None:
        self._dirty = False
        if not self._active:
            return
        names = [j.info.spec.id for j in self._jobs]
        paths: list[tuple[int, ...]] = []
        weights: list[float] = []
        levels: list[int] = []
        member: list[int] = []
        lowest = self._sc.levels - 1
        # per job: a class per (job, path, level), its flows weighing their share of the
        # job's flows on their first link; per flow: flows of a path and level are alike
        per_job = self._per_job
        width: dict[tuple[int, int], float] = {}
        if per_job:
            for f in self._active:
                k = (f.job, f.links[0])
                width[k] = width.get(k, 0.0) + f.weight
        keys: dict[tuple[tuple[int, ...], int, int], int] = {}
        scale: list[float] = []
        for f in self._active:
            level = self._levels.get(names[f.job], lowest)
            key = (f.links, level, f.job if per_job else -1)
            ci = keys.get(key)
            if ci is None:
                ci = len(paths)
                keys[key] = ci
                paths.append(f.links)
                weights.append(0.0)
                levels.append(level)
                scale.append(
                    self._weights.get(names[f.job], 1.0) / width[(f.job, f.links[0])]
                    if per_job
                    else 1.0
                )
            weights[ci] += f.weight * scale[ci]
            member.append(ci)
        rates = allocate(paths, weights, levels, self._caps, self._shares)
        for f, ci in zip(self._active, member, strict=True):
            f.rate = rates[ci] * scale[ci]
