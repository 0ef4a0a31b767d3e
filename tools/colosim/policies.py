"""The policies compared on the same trace.

- ``exclusive``: one job per GPU, FIFO. Each service owns a GPU.
- ``static-mps``: every GPU split into two equal MPS slots (50% of the SMs, half the memory
  as the pinned-memory limit), as the Kubernetes device plugin's MPS sharing does. A job
  goes to a free slot whose memory holds its declaration, spreading over GPUs first (the
  default scheduler's least-allocated scoring); a job declaring more than half a GPU takes
  a whole empty one. Services take one slot each. Backfill: any queued job that fits goes.
- ``time-slicing``: two replicas per GPU, round-robin time slices; a job is placed only
  where the declared memory of everything on the GPU still fits (the baseline at its best:
  the plain device plugin does not check). Spread first, backfill.
- ``colocate``: gpud's policy, built on the ``colocate`` library. It sees only the
  observation (telemetry) and learns features, shapes and interference itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from colocate import (
    GpuView,
    InterferencePredictor,
    JobFeatures,
    JobKind,
    JobView,
    Planner,
    PlannerParams,
    ServiceGuard,
    Shape,
)
from colocate.guard import GuardAction
from tools.colosim.engine import Actions, JobObs, Observation
from tools.colosim.scenario import P99


def _services_first(
    obs: Observation, acts: Actions, slots: dict[int, int], share: float, limit: int | None
) -> None:
    """Give each pending service its own GPU (the GPU with the fewest occupants)."""
    for p in obs.pending:
        if p.kind != "inference":
            continue
        gpu = min(range(obs.gpu_count), key=lambda g: (slots.get(g, 0), g))
        acts.starts.append((p.id, gpu, share, limit))
        slots[gpu] = slots.get(gpu, 0) + 2


@dataclass
class Exclusive:
    name: str = "exclusive"
    sharing: str = "mps"

    def tick(self, obs: Observation) -> Actions:
        acts = Actions()
        used = {r.gpu: 1 for r in obs.running if r.gpu is not None}
        _services_first(obs, acts, used, 1.0, None)
        free = [g for g in range(obs.gpu_count) if not used.get(g)]
        for p in obs.pending:
            if p.kind == "training" and free:
                acts.starts.append((p.id, free.pop(0), 1.0, None))
        return acts


@dataclass
class Sliced:
    """Two jobs per GPU: static MPS slots, or time-slicing replicas."""

    name: str
    sharing: str
    slots: int = 2

    def tick(self, obs: Observation) -> Actions:
        acts = Actions()
        occ: dict[int, int] = {}
        mem: dict[int, int] = {}
        for r in obs.running:
            if r.gpu is not None:
                occ[r.gpu] = occ.get(r.gpu, 0) + (
                    self.slots if r.share >= 1.0 and r.kind == "training" else 1
                )
                mem[r.gpu] = mem.get(r.gpu, 0) + r.declared_mem
        slot_mem = obs.gpu_memory // self.slots
        mps = self.sharing == "mps"
        for p in obs.pending:
            if p.kind != "inference":
                continue
            gpu = min(range(obs.gpu_count), key=lambda g: (occ.get(g, 0), g))
            acts.starts.append((p.id, gpu, 1.0 / self.slots, slot_mem if mps else None))
            occ[gpu] = occ.get(gpu, 0) + 1
            mem[gpu] = mem.get(gpu, 0) + p.declared_mem
        for p in obs.pending:
            if p.kind != "training":
                continue
            order = sorted(range(obs.gpu_count), key=lambda g: (occ.get(g, 0), g))
            for g in order:
                n = occ.get(g, 0)
                if mps:
                    if p.declared_mem <= slot_mem and n < self.slots:
                        acts.starts.append((p.id, g, 1.0 / self.slots, slot_mem))
                        occ[g] = n + 1
                        break
                    if p.declared_mem > slot_mem and n == 0:
                        acts.starts.append((p.id, g, 1.0, None))
                        occ[g] = self.slots
                        break
                elif n < self.slots and mem.get(g, 0) + p.declared_mem <= obs.gpu_memory:
                    acts.starts.append((p.id, g, 1.0, None))
                    occ[g] = n + 1
                    mem[g] = mem.get(g, 0) + p.declared_mem
                    break
        return acts


@dataclass
class _Profile:
    """What the policy has learned about a job type from telemetry."""

    features: JobFeatures
    peak_rate: float | None = None
    samples: int = 0


# Before anything is seen of a type: assume a heavy job, so that it is not paired blindly.
PRIOR_FEATURES = JobFeatures(sm=0.8, mem_bw=0.6, host_cpu=0.1)


@dataclass
class Colocate:
    """gpud's co-location policy on the simulator's telemetry."""

    name: str = "colocate"
    sharing: str = "mps"
    lookahead: int = 16
    replan_every: int = 6
    params: PlannerParams = field(default_factory=PlannerParams)
    predictor: InterferencePredictor = field(default_factory=InterferencePredictor)
    profiles: dict[str, _Profile] = field(default_factory=dict)
    shapes: dict[str, Shape] = field(default_factory=dict)
    guards: dict[str, ServiceGuard] = field(default_factory=dict)
    service_features: dict[str, JobFeatures] = field(default_factory=dict)
    _ticks: int = 0
    _last_now: float | None = None
    _members: dict[int, frozenset[str]] = field(default_factory=dict)
    _evicted: set[str] = field(default_factory=set)  # evicted, not running again yet
    _last_sig: tuple[int, int] = (0, 0)
    planner: Planner | None = None

    def __post_init__(self) -> None:
        self.planner = Planner(self.predictor, self.params)

    # -- learning from telemetry --------------------------------------------------------------
    def _learn(self, obs: Observation) -> None:
        by_gpu: dict[int, list[JobObs]] = {}
        for r in obs.running:
            if r.gpu is not None:
                by_gpu.setdefault(r.gpu, []).append(r)
        previous, self._members = (
            self._members,
            {g: frozenset(r.id for r in ms) for g, ms in by_gpu.items()},
        )
        for g, members in by_gpu.items():
            # Rates are over the last interval: learn only from a GPU whose set of jobs was
            # the same then, and whose jobs all make progress (a job starting up shows no
            # iterations yet, and its neighbours do not feel it).
            if previous.get(g) != self._members[g] or any(
                r.kind == "training" and r.rate <= 0 for r in members
            ):
                continue
            self._learn_service(members)
            trainees = [r for r in members if r.kind == "training" and r.rate > 0]
            for r in trainees:
                shape = self._shape(r)
                shape.observe_memory(r.mem_used)
                prof = self.profiles.setdefault(r.type, _Profile(PRIOR_FEATURES))
                alone = len(members) == 1 and r.share >= 1.0 and r.duty >= 1.0
                if alone:
                    # Alone and unthrottled: telemetry shows the job's own footprint.
                    a = 0.3 if prof.samples else 1.0
                    prof.peak_rate = (
                        r.rate if prof.peak_rate is None else (1 - a) * prof.peak_rate + a * r.rate
                    )
                    f = prof.features
                    prof.features = JobFeatures(
                        sm=(1 - a) * f.sm + a * r.sm_util,
                        mem_bw=(1 - a) * f.mem_bw + a * r.bw_util,
                        host_cpu=(1 - a) * f.host_cpu + a * r.host_cpu,
                    )
                    prof.samples += 1
                    shape.curve.knee = max(0.05, prof.features.sm)
                    continue
                if prof.peak_rate is None or prof.samples == 0:
                    continue
                speed = r.rate / prof.peak_rate
                rel = shape.curve.relative(r.share) * max(r.duty, 1e-3)
                me = self._keyed(r).scaled(rel)
                others = [self._footprint(o) for o in members if o.id != r.id]
                self.predictor.observe(me, others, min(1.0, speed / max(rel, 1e-3)))

    def _learn_service(self, members: list[JobObs]) -> None:
        """A service's footprint at full load, and its slowdown next to training, from its
        request rate, utilization and p99 (mu_eff = load + ln(100) / p99)."""
        for r in members:
            if r.kind != "inference" or r.rate <= 0:
                continue
            mu = _service_mu(r)
            self.service_features[r.id] = JobFeatures(
                sm=min(1.0, r.sm_util * mu / r.rate),
                mem_bw=min(1.0, r.bw_util * mu / r.rate),
                host_cpu=r.host_cpu,
            )
            others = [self._footprint(o) for o in members if o.id != r.id]
            if not others or r.p99_s is None or not 0 < r.p99_s < 1e9:
                continue
            speed = (r.load + P99 / r.p99_s) / mu
            me = replace(self.service_features[r.id], key=r.type).scaled(min(1.0, r.load / mu))
            self.predictor.observe(me, others, min(1.0, speed))

    def _features(self, r: JobObs) -> JobFeatures:
        if r.kind == "inference":
            return self.service_features.get(r.id, PRIOR_FEATURES)
        prof = self.profiles.get(r.type)
        if prof and prof.samples:
            return prof.features
        if r.declared_sm is not None:
            return JobFeatures(sm=r.declared_sm, mem_bw=r.declared_bw or 0.5, host_cpu=0.1)
        return PRIOR_FEATURES

    def _keyed(self, r: JobObs) -> JobFeatures:
        """Features with the job's class, under which the predictor learns its pairs."""
        return replace(self._features(r), key=r.type)

    def _footprint(self, r: JobObs) -> JobFeatures:
        if r.kind == "inference":
            busy = min(1.0, r.rate / _service_mu(r))
            return JobFeatures(
                sm=r.sm_util, mem_bw=r.bw_util, host_cpu=r.host_cpu, presence=busy, key=r.type
            )
        f = self._keyed(r)
        return f.scaled(min(1.0, r.share / max(f.sm, 1e-3)) * r.duty)

    def _shape(self, r: JobObs) -> Shape:
        s = self.shapes.get(r.id)
        if s is None:
            if r.kind == "inference":
                s = Shape.prior(r.id, JobKind.INFERENCE, memory_bytes=r.declared_mem, slo_s=r.slo_s)
            else:
                f = self._features(r)
                s = Shape.prior(
                    r.id,
                    JobKind.TRAINING,
                    memory_bytes=r.declared_mem,
                    knee=None if f is PRIOR_FEATURES else f.sm,
                    bw_intensity=None if f is PRIOR_FEATURES else f.mem_bw,
                )
            self.shapes[r.id] = s
        if r.kind == "training":
            prof = self.profiles.get(r.type)
            if prof and prof.samples:
                # What the type showed alone is the best knee this job has.
                s.curve.knee = max(0.05, prof.features.sm)
        return s

    def _view(self, r: JobObs, i: int, duty: float, now: float) -> JobView:
        """The job as the planner sees it (``i``: its place in this tick's list). A
        service's features are kept at full load (:meth:`_learn_service`), and the planner
        scales them to its load of now, as gpud does."""
        shape = self._shape(r)
        if r.kind == "inference":
            # Inference: a service rate curve from its type's telemetry is what gpud has;
            # here the service declares its rate and SLO, as a deployment would.
            shape.curve.peak = _service_mu(r)
            shape.curve.knee = 0.55
        return JobView(
            job_id=r.id,
            shape=shape,
            features=self._keyed(r),
            gpu=r.gpu,
            sm_share=r.share,
            duty=duty,
            memory_used=r.mem_used,
            load=r.load,
            peak_load=r.peak_load,
            order=-1.0 if r.kind == "inference" else r.arrival_s + i * 1e-9,
            waited_s=now - r.arrival_s if r.gpu is None else 0.0,
            evicted=r.gpu is None and r.id in self._evicted,
        )

    # -- one tick -----------------------------------------------------------------------------
    def tick(self, obs: Observation) -> Actions:
        assert self.planner is not None
        self._ticks += 1
        if self._last_now is not None:
            self.predictor.advance(obs.now - self._last_now)
        self._last_now = obs.now
        self._evicted.difference_update(r.id for r in obs.running)
        self._learn(obs)
        acts = Actions()
        duty_by_gpu: dict[int, float] = {}
        evict_by_gpu: dict[int, str] = {}
        for r in obs.running:
            if r.kind != "inference" or r.gpu is None or r.slo_s is None:
                continue
            g = self.guards.setdefault(r.id, ServiceGuard(r.id, r.slo_s))
            colocated = any(o.gpu == r.gpu and o.kind == "training" for o in obs.running)
            if not colocated:
                g.reset()
                continue
            d = g.tick(r.p99_s if r.p99_s is None or r.p99_s < 1e9 else 1e9)
            if d.action is GuardAction.EVICT:
                evict_by_gpu[r.gpu] = d.reason
            else:
                duty_by_gpu[r.gpu] = min(duty_by_gpu.get(r.gpu, 1.0), d.duty)
        for r in obs.running:
            if r.kind == "training" and r.gpu is not None:
                if r.gpu in evict_by_gpu:
                    acts.evict.append(r.id)
                    self._evicted.add(r.id)
                else:
                    acts.duty[r.id] = duty_by_gpu.get(r.gpu, 1.0)

        # The head of the queue in arrival order: the planner places each job where it fits
        # best; a job that fits nowhere waits without blocking those behind it.
        pending = list(obs.pending[: self.lookahead])
        sig = (len(obs.running), len(obs.pending))
        mem_pressure = any(
            u > obs.gpu_memory * (1 - self.params.memory_headroom) for u in obs.gpu_mem_used
        )
        if not mem_pressure and (
            not pending or (sig == self._last_sig and self._ticks % self.replan_every)
        ):
            return acts
        self._last_sig = sig
        views = [
            self._view(r, i, acts.duty.get(r.id, r.duty), obs.now)
            for i, r in enumerate([*obs.running, *pending])
        ]
        gpus = [
            GpuView(index=g, memory_total=obs.gpu_memory, memory_used=obs.gpu_mem_used[g])
            for g in range(obs.gpu_count)
        ]
        plan = self.planner.plan(gpus, views, duty_by_gpu, evict_by_gpu)
        for p in plan.placements:
            acts.starts.append((p.job_id, p.gpu, p.sm_share, None))
        for directive in plan.directives:
            if directive.evict and directive.job_id not in acts.evict:
                acts.evict.append(directive.job_id)
                self._evicted.add(directive.job_id)
        return acts


def _service_mu(r: JobObs) -> float:
    from tools.colosim.workloads import SERVICE_TYPES

    return SERVICE_TYPES[r.type].mu


POLICY_NAMES = ("exclusive", "static-mps", "time-slicing", "colocate")


def make(name: str) -> Exclusive | Sliced | Colocate:
    if name == "exclusive":
        return Exclusive()
    if name == "static-mps":
        return Sliced("static-mps", "mps")
    if name == "time-slicing":
        return Sliced("time-slicing", "timeslice")
    if name == "colocate":
        return Colocate()
    raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")
