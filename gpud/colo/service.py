"""The co-location loop on live snapshots: the colocate planner, SLO guards and directives.

Every ``[colocate] tick_s`` the daemon calls :meth:`ColoService.tick` with the latest
telemetry snapshot. It reads the jobs that hold reservations (their GPU, MPS limits,
declared memory and SLO), the memory NVML shows per GPU, the latency samples inference
jobs reported (``gpud.client.Latency``) and the iterations training jobs reported at each
``gpud.client.throttle_point()``. From these it runs each inference job's SLO guard, asks
the planner for a plan (evictions for memory, the duty cycle each training job may run
at), refines shapes and the interference predictor from the observed iteration rates, and
emits an event when a decision changes. ``gpuctl run`` asks :meth:`advise` where a new job
goes; ``gpuctl colo show`` reads :meth:`show`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from colocate import (
    GpuView,
    GuardAction,
    GuardParams,
    InterferencePredictor,
    JobFeatures,
    JobKind,
    JobView,
    Plan,
    Planner,
    PlannerParams,
    ServiceGuard,
    Shape,
)
from gpud.config import ColocateConfig
from gpud.errors import InvalidArgument
from gpud.events import EventLog
from gpud.telemetry.snapshot import Snapshot

MAX_LATENCY_SAMPLES = 4096  # per report, and per job kept in the window
GIB = 1 << 30


@dataclass(frozen=True)
class RunningJob:
    """A job holding a reservation, as the jobs service knows it."""

    name: str
    kind: str  # "training" | "inference"
    gpu: int
    threads_percent: int | None = None
    memory_bytes: int | None = None  # declared (MPS pinned limit), per device
    slo_p99_ms: float | None = None
    memory_used: int = 0  # NVML, attributed to the job's processes
    peak_load: float = 0.0


@dataclass(frozen=True)
class Directive:
    duty: float
    evict: bool
    reason: str


@dataclass
class _JobState:
    latency: deque[tuple[float, float]] = field(
        default_factory=lambda: deque(maxlen=MAX_LATENCY_SAMPLES)
    )
    progress: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))
    alone_rate: float | None = None
    features: JobFeatures | None = None
    windows: int = 0
    windows_ok: int = 0


@dataclass(frozen=True)
class GuardView:
    job: str
    gpu: int
    slo_ms: float
    p99_ms: float | None
    duty: float
    action: str
    reason: str
    attainment: float


@dataclass(frozen=True)
class ColoView:
    """What ``gpuctl colo show`` prints."""

    enabled: bool
    plan: Plan | None
    plan_age_s: float
    running: tuple[RunningJob, ...]
    duty: dict[str, float]
    observed_speed: dict[str, float]
    guards: tuple[GuardView, ...]
    predictor_samples: int
    predictor_mae: float


PRIOR = JobFeatures(sm=0.8, mem_bw=0.6)


class ColoService:
    def __init__(
        self,
        config: ColocateConfig,
        events: EventLog,
        *,
        running: Callable[[], Sequence[RunningJob]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._events = events
        self._running = running
        self._clock = clock
        self._lock = threading.RLock()
        self.predictor = InterferencePredictor()
        self._jobs: dict[str, _JobState] = {}
        self._guards: dict[str, ServiceGuard] = {}
        self._directives: dict[str, Directive] = {}
        self._plan: Plan | None = None
        self._plan_at = 0.0
        self._last_running: tuple[RunningJob, ...] = ()
        self._observed: dict[str, float] = {}
        self.configure(config)

    def configure(self, config: ColocateConfig) -> None:
        """(Re)apply the [colocate] settings; learned state is kept."""
        with self._lock:
            self.config = config
            self._planner = Planner(
                self.predictor,
                PlannerParams(
                    memory_headroom=config.memory_headroom,
                    max_slowdown=config.max_slowdown,
                    max_jobs_per_gpu=config.max_jobs_per_gpu,
                    slo_margin=config.slo_margin,
                ),
            )
            self._guard_params = GuardParams(
                margin=config.slo_margin,
                decrease=config.guard_decrease,
                increase=config.guard_increase,
                min_duty=config.min_duty,
            )
            for g in self._guards.values():
                g.params = self._guard_params

    # -- reports from jobs --------------------------------------------------------------------
    def report_latency(self, job: str, seconds: Sequence[float]) -> None:
        if len(seconds) > MAX_LATENCY_SAMPLES:
            raise InvalidArgument(
                f"at most {MAX_LATENCY_SAMPLES} samples per report, got {len(seconds)}"
            )
        if any(not (math.isfinite(s) and s >= 0) for s in seconds):
            raise InvalidArgument(f"job {job}: latency samples must be finite and >= 0 seconds")
        now = self._clock()
        with self._lock:
            st = self._jobs.setdefault(job, _JobState())
            st.latency.extend((now, s) for s in seconds)

    def throttle_point(self, job: str, iterations: int) -> Directive:
        """Record a training job's progress; return the duty cycle it should run at."""
        now = self._clock()
        with self._lock:
            st = self._jobs.setdefault(job, _JobState())
            total = (st.progress[-1][1] if st.progress else 0) + max(0, iterations)
            st.progress.append((now, total))
            return self._directives.get(job, Directive(1.0, False, "no directive"))

    def p99(self, job: str) -> float | None:
        now = self._clock()
        with self._lock:
            st = self._jobs.get(job)
            if st is None:
                return None
            window = [s for t, s in st.latency if now - t <= self.config.latency_window_s]
        if not window:
            return None
        window.sort()
        return window[min(len(window) - 1, math.ceil(0.99 * len(window)) - 1)]

    def _rate(self, st: _JobState) -> float | None:
        if len(st.progress) < 2:
            return None
        (t0, i0), (t1, i1) = st.progress[0], st.progress[-1]
        return (i1 - i0) / (t1 - t0) if t1 > t0 else None

    # -- the loop -----------------------------------------------------------------------------
    def tick(self, snapshot: Snapshot | None) -> Plan | None:
        if snapshot is None or not self.config.enabled:
            return None
        running = tuple(self._running())
        with self._lock:
            gpus = [
                GpuView(
                    index=g.identity.index,
                    memory_total=g.memory.total_bytes if g.memory else 0,
                    memory_used=g.memory.used_bytes if g.memory else 0,
                )
                for g in snapshot.gpus
                if g.healthy and g.memory is not None
            ]
            per_gpu: dict[int, list[RunningJob]] = {}
            for r in running:
                per_gpu.setdefault(r.gpu, []).append(r)
            self._learn(snapshot, per_gpu)
            duty_by_gpu, evict_by_gpu = self._guard_step(running, per_gpu)
            views = [self._view(r) for r in running]
            plan = self._planner.plan(gpus, views, duty_by_gpu, evict_by_gpu)
            self._apply(plan)
            self._plan, self._plan_at, self._last_running = plan, self._clock(), running
            return plan

    def _learn(self, snapshot: Snapshot, per_gpu: dict[int, list[RunningJob]]) -> None:
        self._observed = {}
        for gpu, members in per_gpu.items():
            sample = snapshot.gpu(gpu)
            for r in members:
                st = self._jobs.setdefault(r.name, _JobState())
                rate = self._rate(st)
                if len(members) == 1 and sample is not None and sample.utilization is not None:
                    # Alone: the device's activity is the job's footprint.
                    u = sample.utilization
                    st.features = JobFeatures(sm=u.gpu_ratio, mem_bw=u.memory_ratio)
                    if rate is not None and r.kind == "training":
                        st.alone_rate = rate
                    continue
                if r.kind != "training" or rate is None or not st.alone_rate:
                    continue
                speed = min(1.0, rate / st.alone_rate)
                self._observed[r.name] = speed
                others = [self._features(o) for o in members if o.name != r.name]
                self.predictor.observe(self._features(r), others, speed)

    def _features(self, r: RunningJob) -> JobFeatures:
        st = self._jobs.get(r.name)
        return st.features if st is not None and st.features is not None else PRIOR

    def _guard_step(
        self, running: Sequence[RunningJob], per_gpu: dict[int, list[RunningJob]]
    ) -> tuple[dict[int, float], dict[int, str]]:
        duty: dict[int, float] = {}
        evict: dict[int, str] = {}
        for r in running:
            if r.kind != "inference" or not r.slo_p99_ms:
                continue
            g = self._guards.get(r.name)
            if g is None:
                g = self._guards[r.name] = ServiceGuard(
                    r.name, r.slo_p99_ms / 1e3, self._guard_params
                )
            p99 = self.p99(r.name)
            st = self._jobs.setdefault(r.name, _JobState())
            if p99 is not None:
                st.windows += 1
                st.windows_ok += int(p99 <= g.slo_s)
            if not any(o.kind == "training" for o in per_gpu.get(r.gpu, [])):
                g.reset()
                continue
            before = g.duty
            d = g.tick(p99)
            if d.action is GuardAction.EVICT:
                evict[r.gpu] = d.reason
                self._events.emit("colo.evict", d.reason, job=r.name, gpu=r.gpu)
            else:
                duty[r.gpu] = min(duty.get(r.gpu, 1.0), d.duty)
                if d.action is GuardAction.THROTTLE and before != d.duty:
                    self._events.emit("colo.throttle", d.reason, job=r.name, gpu=r.gpu)
        return duty, evict

    def _view(self, r: RunningJob) -> JobView:
        kind = JobKind.INFERENCE if r.kind == "inference" else JobKind.TRAINING
        memory = r.memory_bytes or r.memory_used or 0
        shape = Shape.prior(
            r.name,
            kind,
            memory_bytes=memory,
            slo_s=r.slo_p99_ms / 1e3 if r.slo_p99_ms else None,
            knee=self._features(r).sm if self._jobs.get(r.name, _JobState()).features else None,
        )
        shape.observe_memory(r.memory_used)
        return JobView(
            job_id=r.name,
            shape=shape,
            features=self._features(r),
            gpu=r.gpu,
            sm_share=(r.threads_percent or 100) / 100.0,
            memory_used=r.memory_used,
            peak_load=r.peak_load,
            duty=self._directives.get(r.name, Directive(1.0, False, "")).duty,
        )

    def _apply(self, plan: Plan) -> None:
        new = {d.job_id: Directive(d.duty, d.evict, d.reason) for d in plan.directives}
        for job, d in new.items():
            old = self._directives.get(job)
            if d.evict and (old is None or not old.evict):
                self._events.emit("colo.evict", d.reason, job=job)
            elif old is not None and abs(old.duty - d.duty) > 1e-9:
                self._events.emit(
                    "colo.duty",
                    f"job {job} duty {old.duty:.2f} -> {d.duty:.2f}: {d.reason}",
                    job=job,
                )
        self._directives = new

    # -- questions ----------------------------------------------------------------------------
    def advise(
        self,
        job: str,
        *,
        kind: str = "training",
        memory_bytes: int | None = None,
        slo_p99_ms: float | None = None,
        sm_activity: float | None = None,
        peak_load: float = 0.0,
        snapshot: Snapshot | None = None,
    ) -> tuple[int, float, int, str | None, float, str]:
        """(gpu or -1, SM share, memory limit, MIG profile, predicted speed, reason)."""
        if kind not in ("training", "inference"):
            raise InvalidArgument(f"job {job}: kind must be training or inference, not {kind!r}")
        if sm_activity is not None and not 0.0 < sm_activity <= 1.0:
            raise InvalidArgument(f"job {job}: sm_activity {sm_activity} outside (0, 1]")
        running = tuple(self._running())
        with self._lock:
            gpus = (
                [
                    GpuView(g.identity.index, g.memory.total_bytes, g.memory.used_bytes)
                    for g in snapshot.gpus
                    if g.healthy and g.memory is not None
                ]
                if snapshot is not None
                else []
            )
            jk = JobKind.INFERENCE if kind == "inference" else JobKind.TRAINING
            features = (
                JobFeatures(sm=sm_activity, mem_bw=min(1.0, sm_activity)) if sm_activity else PRIOR
            )
            shape = Shape.prior(
                job,
                jk,
                memory_bytes=memory_bytes or 8 * GIB,
                knee=sm_activity,
                slo_s=slo_p99_ms / 1e3 if slo_p99_ms else None,
            )
            new = JobView(job, shape, features, order=float("inf"), peak_load=peak_load)
            planner = Planner(self.predictor, self._planner.params)
            plan = planner.plan(gpus, [*(self._view(r) for r in running), new])
            for p in plan.placements:
                if p.job_id == job:
                    return (
                        p.gpu,
                        p.sm_share,
                        p.memory_limit_bytes,
                        p.mig_profile,
                        p.predicted_speed,
                        p.reason,
                    )
            return (-1, 0.0, 0, None, 0.0, plan.waiting.get(job, "no GPU in the snapshot"))

    def show(self) -> ColoView:
        with self._lock:
            guards = []
            for name, g in sorted(self._guards.items()):
                r = next((x for x in self._last_running if x.name == name), None)
                st = self._jobs.get(name, _JobState())
                p99 = self.p99(name)
                guards.append(
                    GuardView(
                        job=name,
                        gpu=r.gpu if r else -1,
                        slo_ms=g.slo_s * 1e3,
                        p99_ms=p99 * 1e3 if p99 is not None else None,
                        duty=g.duty,
                        action=g.last.action.value if g.last else "hold",
                        reason=g.last.reason if g.last else "no training on its GPU",
                        attainment=st.windows_ok / st.windows if st.windows else 1.0,
                    )
                )
            stats = self.predictor.stats()
            return ColoView(
                enabled=self.config.enabled,
                plan=self._plan,
                plan_age_s=self._clock() - self._plan_at if self._plan else 0.0,
                running=self._last_running,
                duty={k: d.duty for k, d in self._directives.items()},
                observed_speed=dict(self._observed),
                guards=tuple(guards),
                predictor_samples=stats.samples,
                predictor_mae=stats.mean_abs_error,
            )
