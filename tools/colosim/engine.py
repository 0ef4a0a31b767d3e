"""Time-stepped simulation of one GPU node under one policy. Deterministic.

Every ``tick_s`` the engine (1) releases arrivals into the queue, (2) shows the policy an
:class:`Observation` -- what gpud's telemetry would show: per job its iteration rate,
per-process SM and memory-controller activity, memory used, host CPU; per service its
request rate and last-interval p99; per GPU memory used -- and applies its
:class:`Actions` (starts with an SM share and a memory limit, duty cycles, graceful
evictions), (3) advances every job by its true speed from :mod:`tools.colosim.truth` (or,
for time-slicing, by round-robin time shares), (4) grows memory and counts OOM events
itself: a GPU whose jobs' memory exceeds the device, or a job past its MPS pinned-memory
limit, kills the job that grew (training restarts from its last checkpoint; a service is
down for a minute), (5) scores each service's p99 for the interval against its SLO.

Utilization is counted by progress: each job adds its SM activity alone times the
fraction of its alone speed it actually achieves; a service adds its activity times the
load it serves over its full-GPU rate.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tools.colosim.scenario import P99, JobSpec, Scenario, ServiceSpec, Trace
from tools.colosim.truth import Member, TrueInterference
from tools.colosim.workloads import SERVICE_TYPES, TRAIN_TYPES

GIB = float(1 << 30)
CHECKPOINT_S = 600.0  # training checkpoints every 10 minutes of run time
RESTART_S = 30.0  # a (re)start costs this much time before progress resumes
SERVICE_DOWN_S = 60.0
TIMESLICE_OVERHEAD = 0.04  # per extra context: switches and cache refills
MEM_RAMP_S = 600.0


@dataclass(frozen=True)
class JobObs:
    id: str
    type: str
    kind: str  # "training" | "inference"
    gpu: int | None
    share: float
    duty: float
    declared_mem: int
    mem_used: int
    rate: float  # iterations/s (training) or requests/s served (inference)
    sm_util: float
    bw_util: float
    host_cpu: float
    arrival_s: float
    load: float = 0.0
    p99_s: float | None = None
    slo_s: float | None = None
    peak_load: float = 0.0
    declared_sm: float | None = None
    declared_bw: float | None = None


@dataclass(frozen=True)
class Observation:
    now: float
    gpu_count: int
    gpu_memory: int
    gpu_mem_used: tuple[int, ...]
    running: tuple[JobObs, ...]
    pending: tuple[JobObs, ...]


@dataclass
class Actions:
    starts: list[tuple[str, int, float, int | None]] = field(default_factory=list)
    duty: dict[str, float] = field(default_factory=dict)
    evict: list[str] = field(default_factory=list)


class Policy(Protocol):
    name: str
    sharing: str  # "mps" or "timeslice"

    def tick(self, obs: Observation) -> Actions: ...


@dataclass
class _Job:
    spec: JobSpec
    gpu: int | None = None
    share: float = 1.0
    mem_limit: int | None = None
    duty: float = 1.0
    done: float = 0.0
    checkpoint: float = 0.0
    ran_s: float = 0.0  # since the last (re)start
    first_start: float | None = None
    finish: float | None = None
    warm_until: float = 0.0
    speed: float = 0.0

    def mem(self) -> float:
        t = self.spec.ttype
        ramp = min(1.0, self.ran_s / MEM_RAMP_S)
        return t.mem_gib * GIB * (0.6 + (self.spec.mem_factor - 0.6) * ramp)


@dataclass
class _Service:
    spec: ServiceSpec
    gpu: int | None = None
    share: float = 1.0
    mem_limit: int | None = None
    down_until: float = 0.0
    speed: float = 1.0
    load: float = 0.0
    p99: float | None = None
    served: float = 0.0

    def mem(self) -> float:
        t = SERVICE_TYPES[self.spec.type]
        frac = min(1.0, self.load / max(self.spec.peak_load, 1e-9))
        return (t.weights_gib + t.kv_gib * frac) * GIB

    def declared(self) -> int:
        t = SERVICE_TYPES[self.spec.type]
        return int((t.weights_gib + t.kv_gib) * GIB)


@dataclass
class RunResult:
    policy: str
    gpu_util: float
    train_throughput: float
    jct: list[float]
    stretch: list[float]  # time from first start to finish over the time alone
    unfinished: int
    slo: dict[str, float]
    oom_events: int
    evictions: int
    end_s: float
    # Time series for plots: (t, util, {service: p99}) every tick; (finish_s, jct) per job.
    series: list[tuple[float, float, dict[str, float | None]]]
    finishes: list[tuple[float, float]]


def _type_rate(name: str) -> float:
    """Iterations/s alone on a whole GPU: a fixed, type-specific number (policies learn it)."""
    return 2.0 + (sum(map(ord, name)) % 17) / 2.0


def service_load(spec: ServiceSpec, bursts: Sequence[tuple[float, float]], t: float) -> float:
    base = spec.mean_load * spec.capacity
    load = base * (1.0 + spec.diurnal_amp * math.sin(2 * math.pi * t / spec.period_s))
    if any(a <= t < b for a, b in bursts):
        load *= spec.burst_factor
    return max(0.0, load)


def simulate(
    scenario: Scenario, trace: Trace, policy: Policy, *, series: bool = False
) -> RunResult:
    truth = TrueInterference(seed=scenario.interference_seed)
    noise = random.Random(trace.noise_seed)
    dt = scenario.tick_s
    cap = int(scenario.gpu_memory_gib * GIB)
    jobs = {j.id: _Job(j) for j in trace.jobs}
    services = {s.name: _Service(s) for s in scenario.services}
    arrivals = sorted(trace.jobs, key=lambda j: (j.arrival_s, j.id))
    pending: list[str] = []
    next_arrival = 0
    horizon = scenario.duration_s * max(8.0, 4.0 * scenario.load)
    util_sum, work_in_window = 0.0, 0.0
    slo_ok = dict.fromkeys(services, 0)
    slo_n = dict.fromkeys(services, 0)
    ooms = evictions = 0
    out_series: list[tuple[float, float, dict[str, float | None]]] = []
    now = 0.0
    last_obs: dict[str, JobObs] = {}
    while now < horizon:
        while next_arrival < len(arrivals) and arrivals[next_arrival].arrival_s <= now:
            pending.append(arrivals[next_arrival].id)
            next_arrival += 1
        active = [j for j in jobs.values() if j.gpu is not None]
        if (
            next_arrival >= len(arrivals)
            and not pending
            and not active
            and now >= scenario.duration_s
        ):
            break
        for s in services.values():
            s.load = service_load(s.spec, trace.bursts.get(s.spec.name, ()), now)

        # -- the policy's turn ---------------------------------------------------------------
        obs = _observe(
            scenario,
            now=now,
            cap=cap,
            jobs=jobs,
            services=services,
            pending=pending,
            last=last_obs,
        )
        acts = policy.tick(obs)
        for jid in acts.evict:
            if jid in jobs and jobs[jid].gpu is not None:
                j = jobs[jid]
                j.gpu, j.checkpoint = None, j.done  # graceful: checkpoint first
                pending.insert(0, jid)
                evictions += 1
        pending.sort(key=lambda i: (jobs[i].spec.arrival_s, i))
        for jid, gpu, share, limit in acts.starts:
            if not 0 <= gpu < scenario.gpu_count:
                continue
            if jid in services and services[jid].gpu is None:
                s = services[jid]
                s.gpu, s.share, s.mem_limit = gpu, share, limit
            elif jid in jobs and jobs[jid].gpu is None and jid in pending:
                j = jobs[jid]
                pending.remove(jid)
                j.gpu, j.share, j.mem_limit, j.duty = gpu, share, limit, 1.0
                j.ran_s, j.warm_until = 0.0, now + RESTART_S
                if j.first_start is None:
                    j.first_start = now
        for jid, d in acts.duty.items():
            if jid in jobs:
                jobs[jid].duty = min(1.0, max(0.0, d))

        # -- speeds --------------------------------------------------------------------------
        per_gpu: dict[int, list[tuple[str, Member]]] = {}
        for j in jobs.values():
            if j.gpu is not None:
                t = j.spec.ttype
                duty = j.duty if now >= j.warm_until else 0.0
                per_gpu.setdefault(j.gpu, []).append(
                    (j.spec.id, Member(t.name, t.sm, t.bw, t.cpu, j.share, duty, t.gamma))
                )
        for s in services.values():
            if s.gpu is not None and now >= s.down_until:
                st = SERVICE_TYPES[s.spec.type]
                rho = min(1.0, s.load / st.mu)
                per_gpu.setdefault(s.gpu, []).append(
                    (s.spec.name, Member(st.name, st.sm, st.bw, st.cpu, s.share, rho, 0.85, False))
                )
        speed: dict[str, float] = {}
        for members in per_gpu.values():
            if policy.sharing == "timeslice":
                busy = [m for _, m in members if m.duty > 0]
                k = max(1, len(busy))
                frac = (1.0 / k) * (1.0 - TIMESLICE_OVERHEAD * (k - 1))
                for name, m in members:
                    speed[name] = (
                        frac * (m.duty if m.throttled else 1.0)
                        if k > 1
                        else (m.duty if m.throttled else 1.0)
                    )
            else:
                for (name, _), sp in zip(
                    members, truth.speeds([m for _, m in members]), strict=True
                ):
                    speed[name] = sp

        # -- memory and OOM ------------------------------------------------------------------
        mem_gpu = [0.0] * scenario.gpu_count
        for j in jobs.values():
            if j.gpu is not None:
                j.ran_s += dt
                mem_gpu[j.gpu] += j.mem()
        for s in services.values():
            if s.gpu is not None:
                mem_gpu[s.gpu] += s.mem()
        for j in list(jobs.values()):
            if j.gpu is None:
                continue
            over_limit = j.mem_limit is not None and j.mem() > j.mem_limit
            if over_limit or mem_gpu[j.gpu] > cap:
                # The newest grower on an over-full device is the one whose allocation fails.
                growers = [o for o in jobs.values() if o.gpu == j.gpu and o.ran_s < MEM_RAMP_S + dt]
                if (
                    over_limit
                    or not growers
                    or j is max(growers, key=lambda o: (-o.ran_s, o.spec.id))
                ):
                    ooms += 1
                    mem_gpu[j.gpu] -= j.mem()
                    j.gpu, j.done = None, j.checkpoint
                    pending.append(j.spec.id)
        for s in services.values():
            if s.gpu is not None and (
                mem_gpu[s.gpu] > cap or (s.mem_limit is not None and s.mem() > s.mem_limit)
            ):
                ooms += 1
                s.down_until = now + SERVICE_DOWN_S
                mem_gpu[s.gpu] -= s.mem()

        # -- progress ------------------------------------------------------------------------
        util = [0.0] * scenario.gpu_count
        for j in jobs.values():
            if j.gpu is None:
                j.speed = 0.0
                continue
            sp = speed.get(j.spec.id, 0.0)
            j.speed = sp
            step = min(sp * dt, j.spec.work_s - j.done)
            j.done += step
            if now < scenario.duration_s:
                work_in_window += step
            util[j.gpu] += j.spec.ttype.sm * sp
            if j.ran_s - dt < CHECKPOINT_S * math.floor(j.ran_s / CHECKPOINT_S) <= j.ran_s:
                j.checkpoint = j.done
            if j.done >= j.spec.work_s - 1e-9:
                j.finish = now + (step / sp if sp > 0 else dt)
                j.gpu = None
        p99s: dict[str, float | None] = {}
        for s in services.values():
            st = SERVICE_TYPES[s.spec.type]
            if s.gpu is None:
                s.p99, s.served = None, 0.0
                p99s[s.spec.name] = None
                continue
            if now < s.down_until:
                s.p99, s.served = math.inf, 0.0
            else:
                mu = st.mu * speed.get(s.spec.name, 1.0)
                s.served = min(s.load, mu)
                # Sampling noise of a p99 measured over one interval (same draws for every
                # policy: the generator is seeded by the trace).
                wobble = math.exp(noise.gauss(0.0, 0.08))
                s.p99 = P99 / (mu - s.load) * wobble if mu > s.load * 1.0001 else math.inf
            util[s.gpu] += st.sm * s.served / st.mu
            slo_n[s.spec.name] += 1
            slo_ok[s.spec.name] += int(s.p99 <= st.slo_s)
            p99s[s.spec.name] = s.p99
        if now < scenario.duration_s:
            util_sum += sum(min(1.0, u) for u in util) / scenario.gpu_count
        if series:
            out_series.append((now, sum(min(1.0, u) for u in util) / scenario.gpu_count, p99s))
        last_obs = {}
        for j in jobs.values():
            if j.gpu is not None:
                last_obs[j.spec.id] = _job_obs(j, noise)
        now += dt

    window_ticks = max(1, math.ceil(scenario.duration_s / dt))
    finished = [j for j in jobs.values() if j.finish is not None]
    return RunResult(
        policy=policy.name,
        gpu_util=util_sum / window_ticks,
        train_throughput=work_in_window / scenario.duration_s,
        jct=[j.finish - j.spec.arrival_s for j in finished if j.finish is not None],
        stretch=[
            (j.finish - j.first_start) / (j.spec.work_s + RESTART_S)
            for j in finished
            if j.finish is not None and j.first_start is not None
        ],
        unfinished=len(jobs) - len(finished),
        slo={k: slo_ok[k] / max(1, slo_n[k]) for k in services},
        oom_events=ooms,
        evictions=evictions,
        end_s=now,
        series=out_series,
        finishes=sorted(
            (j.finish, j.finish - j.spec.arrival_s) for j in finished if j.finish is not None
        ),
    )


def _job_obs(j: _Job, noise: random.Random) -> JobObs:
    t = j.spec.ttype
    sp = j.speed
    return JobObs(
        id=j.spec.id,
        type=t.name,
        kind="training",
        gpu=j.gpu,
        share=j.share,
        duty=j.duty,
        declared_mem=int(t.mem_gib * GIB),
        mem_used=int(j.mem()),
        rate=_type_rate(t.name) * sp * math.exp(noise.gauss(0.0, 0.02)),
        sm_util=min(1.0, t.sm * sp),
        bw_util=min(1.0, t.bw * sp),
        host_cpu=t.cpu * sp,
        arrival_s=j.spec.arrival_s,
        declared_sm=j.spec.declared_sm,
        declared_bw=j.spec.declared_bw,
    )


def _observe(
    scenario: Scenario,
    *,
    now: float,
    cap: int,
    jobs: Mapping[str, _Job],
    services: Mapping[str, _Service],
    pending: Sequence[str],
    last: Mapping[str, JobObs],
) -> Observation:
    mem = [0] * scenario.gpu_count
    running: list[JobObs] = []
    for j in jobs.values():
        if j.gpu is None:
            continue
        o = last.get(j.spec.id)
        if o is None or o.gpu != j.gpu:
            o = JobObs(
                id=j.spec.id,
                type=j.spec.type,
                kind="training",
                gpu=j.gpu,
                share=j.share,
                duty=j.duty,
                declared_mem=int(j.spec.ttype.mem_gib * GIB),
                mem_used=int(j.mem()),
                rate=0.0,
                sm_util=0.0,
                bw_util=0.0,
                host_cpu=0.0,
                arrival_s=j.spec.arrival_s,
                declared_sm=j.spec.declared_sm,
                declared_bw=j.spec.declared_bw,
            )
        running.append(o)
        mem[j.gpu] += int(j.mem())
    svc_pending: list[JobObs] = []
    for s in services.values():
        st = SERVICE_TYPES[s.spec.type]
        o = JobObs(
            id=s.spec.name,
            type=st.name,
            kind="inference",
            gpu=s.gpu,
            share=s.share,
            duty=1.0,
            declared_mem=s.declared(),
            mem_used=int(s.mem()),
            rate=s.served,
            sm_util=st.sm * s.served / st.mu,
            bw_util=st.bw * s.served / st.mu,
            host_cpu=st.cpu,
            arrival_s=0.0,
            load=s.load,
            p99_s=s.p99,
            slo_s=st.slo_s,
            peak_load=s.spec.peak_load,
        )
        if s.gpu is None:
            svc_pending.append(o)
        else:
            running.append(o)
            mem[s.gpu] += int(s.mem())
    queued = [
        JobObs(
            id=jid,
            type=jobs[jid].spec.type,
            kind="training",
            gpu=None,
            share=1.0,
            duty=1.0,
            declared_mem=int(jobs[jid].spec.ttype.mem_gib * GIB),
            mem_used=0,
            rate=0.0,
            sm_util=0.0,
            bw_util=0.0,
            host_cpu=0.0,
            arrival_s=jobs[jid].spec.arrival_s,
            declared_sm=jobs[jid].spec.declared_sm,
            declared_bw=jobs[jid].spec.declared_bw,
        )
        for jid in pending
    ]
    return Observation(
        now=now,
        gpu_count=scenario.gpu_count,
        gpu_memory=cap,
        gpu_mem_used=tuple(mem),
        running=tuple(running),
        pending=tuple(svc_pending + queued),
    )


__all__ = ["TRAIN_TYPES", "Actions", "JobObs", "Observation", "Policy", "RunResult", "simulate"]
