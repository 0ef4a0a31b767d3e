"""Planner: telemetry, jobs and shapes in; placements, limits and directives out.

One pass:

1. Memory first. Each GPU holds ``total * (1 - headroom)`` at most. A GPU whose observed
   use already crosses that line loses its newest training job (evicted, with the reason)
   before anything else is decided, as long as another job is left there to protect (a job
   alone may fill its GPU). Memory NVML shows in use beyond the jobs' own (processes of no
   job gpud knows, MPS servers, an evicted job still leaving) is held as it is. A job in a
   MIG instance is held to the instance's memory by the hardware: it is neither evicted
   for the GPU's memory nor refused an instance for what the GPU's other instances hold,
   and an instance's resources are its own (no price rations them). Jobs that share one
   GPU instance (its compute instances' MIG devices too) share its memory as jobs share a
   whole GPU's: its use (NVML's reading, or its jobs' known memory if more; only the known
   memory where the driver does not say what one of them uses, since that job is never a
   reason to evict) over its memory less the headroom costs the newest training job in it
   of known memory its place.
2. Options. For every pending job and every GPU: the configurations its shape allows, each
   scored by the predicted gain in normalized progress -- its own predicted speed (shape x
   interference predictor against the residents) minus the speed the residents would lose,
   each training job's speed weighed by the SMs it keeps busy (``activity_weight``).
   An option is dropped when it would push any job under ``1 / max_slowdown`` of its speed
   alone, an inference service under its load of now (plus margin) within its SLO, or
   under its declared peak with the training beside it throttled to ``peak_duty`` (the
   duty the SLO guard cuts it to at a burst), or the GPU's memory over its limit. A free
   GPU is always the best option for a job (sharing is for work that would otherwise
   wait). A GPU whose MPS server serves another user (``JobView.user``: a running job
   of another user shares its SMs, even one evicted this pass, which has yet to leave;
   or a job of another user placed there ahead of it in this pass) offers it no share of
   the whole GPU, only a free MIG instance (a server of its own): that user's jobs would
   hold its CUDA processes until they end (:mod:`colocate.users`).
3. Prices. :class:`colocate.prices.ShadowPrices` turns the options into per-job choices
   under per-GPU prices on SMs, memory and bandwidth.
   A training job with no option anywhere (typically one that needs a GPU alone) that was
   evicted to protect others, or has waited ``head_hold_s``, has a GPU held for it: the one
   where it would fit alone with the fewest jobs now; no other pending training job is
   placed there, so the GPU drains and the job gets it, rather than waiting while later
   jobs keep every GPU partly taken (EASY backfilling's reservation for the queue's head).
   One job at a time, the first in arrival order.
4. Commit. In arrival order, each job takes its priced choice if it still holds against
   what was committed before it (hard memory check, slowdown caps), else its next best
   valid option, else it waits, with the reason. A job whose MIG instance went to a job
   ahead of it may re-pick, on that GPU, the instance it would take among those still
   free there (a larger one may hold it): after every ranked option that slows no one (a
   free instance, a free GPU), so that it takes neither a larger instance a job behind it
   may need nor a smaller one while one it ranked higher is free; before an MPS share of a
   GPU where jobs or processes of no known job run, which would slow them while an
   instance stays empty.
5. Directives. Running training jobs get the duty cycle the SLO guards allow on their GPU;
   evictions carry the guard's or the memory check's reason.

A running job on several GPUs is one view per GPU (the same ``job_id``, each with its
footprint on that device). It runs at the pace of its slowest GPU: one directive, at the
lowest duty the guards allow on any of them; its predicted speed the lowest of its GPUs';
an eviction on one GPU (memory, a guard) takes it off all of them.

An inference service whose SLO is tight (shorter than ``tight_slo_service_times`` service
times at full speed) is given a MIG instance when a GPU has a free one that covers its peak,
whatever runs in that GPU's other instances: hard isolation rather than an MPS share that a
neighbour's bursts can still hurt. On a GPU in MIG mode every job's only option is a free
instance: a service the smallest that serves its peak, a training job the smallest where its
shape predicts its best speed, at least ``1 / max_slowdown`` of its speed on a whole GPU
(an instance's speed is the shape's at the instance's SM fraction: it shares nothing).
Jobs in MIG instances do not count towards ``max_jobs_per_gpu``, which caps the jobs
sharing SMs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from colocate.interference import InterferencePredictor, JobFeatures
from colocate.prices import Option, ShadowPrices
from colocate.shapes import DEFAULT_SHARES, P99_FACTOR, JobKind, MigOption, Shape
from colocate.users import other_users, shared_under_mps


@dataclass(frozen=True)
class PlannerParams:
    memory_headroom: float = 0.05
    max_slowdown: float = 2.0
    min_gain: float = 0.15
    max_jobs_per_gpu: int = 3
    slo_margin: float = 0.2
    sm_oversubscription: float = 0.3
    tight_slo_service_times: float = 8.0
    shares: tuple[float, ...] = DEFAULT_SHARES
    # Caps are checked against the speed each job reaches in this fraction of predictions
    # like it (the predictor's recent errors on pairs as well known as these).
    error_quantile: float = 0.9
    # A service's declared peak must hold with the training beside it at this duty cycle:
    # the SLO guard throttles training at a burst (two halvings from full duty), so a
    # service GPU can hold training that its peak could not live beside at full speed.
    peak_duty: float = 0.25
    # How much a training job's speed counts in proportion to its SM activity alone, in the
    # gain that ranks and admits sharing: 0 counts normalized progress only, so a pair of
    # jobs that barely touch the SMs looks as good as a pair that fills them; 1 counts the
    # SM work done only. Between the two, sharing goes where it puts idle SMs to work and
    # the jobs' progress still counts.
    activity_weight: float = 0.75
    # A training job that has waited this long with no option on any GPU has one held for
    # it, as an evicted job has at once (see the module docstring); inf: only evicted ones.
    # Off by default: in a backlog every head has waited, and a GPU held for one drains
    # (prod-backlog-4, scant errors forgotten after 1800 s: utilization 1.55 x exclusive at
    # 300 s, 1.61 x without).
    head_hold_s: float = float("inf")

    def __post_init__(self) -> None:
        if not 0.0 <= self.memory_headroom < 0.5:
            raise ValueError(f"memory_headroom {self.memory_headroom} outside [0, 0.5)")
        if self.max_slowdown < 1.0:
            raise ValueError(f"max_slowdown {self.max_slowdown} below 1")
        if not 0.5 <= self.error_quantile < 1.0:
            raise ValueError(f"error_quantile {self.error_quantile} outside [0.5, 1)")
        if not 0.0 < self.peak_duty <= 1.0:
            raise ValueError(f"peak_duty {self.peak_duty} outside (0, 1]")
        if self.max_jobs_per_gpu < 1:
            raise ValueError(f"max_jobs_per_gpu {self.max_jobs_per_gpu} below 1")
        if not 0.0 <= self.activity_weight <= 1.0:
            raise ValueError(f"activity_weight {self.activity_weight} outside [0, 1]")
        if not self.head_hold_s >= 0.0:
            raise ValueError(f"head_hold_s {self.head_hold_s} below 0")


@dataclass(frozen=True)
class MigMemory:
    """One GPU instance's memory, shared by the MIG devices of its compute instances
    (``nvidia-smi mig -lci``: a ``1c.3g.40gb`` and a ``2c.3g.40gb`` share one 3g.40gb's).
    ``devices``: their MIG device UUIDs; ``total``: the instance's memory; ``used``: NVML's
    reading of it (``nvidia-smi -q -i N:M -d MEMORY``), None where it was not read."""

    devices: tuple[str, ...]
    total: int
    used: int | None = None


@dataclass(frozen=True)
class GpuView:
    """A GPU as the planner sees it: memory from NVML, the MIG instances it could offer."""

    index: int
    memory_total: int
    memory_used: int = 0
    mig_options: tuple[MigOption, ...] = ()
    # Compute processes of no job gpud knows: their footprint (None: there are none). The
    # planner predicts every job's speed beside it and never calls the GPU free.
    foreign: JobFeatures | None = None
    # Whether a job may have a share of the whole GPU: not in MIG mode (``nvidia-smi -q``
    # "MIG Mode: Current Enabled"), where only its instances can be given.
    whole: bool = True
    # Every MIG instance the GPU has, free or taken (one per profile is enough): what a
    # job could have there once the jobs in them end (``nvidia-smi mig -lgi``).
    mig_layout: tuple[MigOption, ...] = ()
    # Every GPU instance's memory, which the jobs in its MIG devices share (one per GPU
    # instance, ``nvidia-smi mig -lgi``, whose compute instances are each a MIG device).
    mig_memory: tuple[MigMemory, ...] = ()

    def layout(self) -> tuple[MigOption, ...]:
        """The GPU's MIG instances: :attr:`mig_layout` and the free ones."""
        return (*self.mig_layout, *self.mig_options)


@dataclass
class JobView:
    """A job as the planner sees it. ``gpu`` None: pending.

    ``features``: its footprint alone (telemetry, or the prior) at full speed: a training
    job's at full duty, an inference service's at full load (busy all the time, utilization
    1: what it showed alone over the utilization it had then, see :meth:`activity`).
    ``load``/``peak_load``: an inference service's request rate now and the peak it must
    absorb. ``memory_used``: what NVML reports its processes use on the device
    (``nvmlDeviceGetComputeRunningProcesses``); None where the driver does not say.
    """

    job_id: str
    shape: Shape
    features: JobFeatures
    gpu: int | None = None
    sm_share: float = 1.0
    mig_profile: str | None = None
    duty: float = 1.0
    memory_used: int | None = 0
    load: float = 0.0
    peak_load: float = 0.0
    order: float = 0.0  # arrival order (smaller first)
    waited_s: float = 0.0  # pending: seconds it has waited
    evicted: bool = False  # pending: it ran, and a plan evicted it (memory, an SLO guard)
    device: str = ""  # the GPU or MIG device UUID it runs on ("" when not known)
    # the UID its processes run as, where MPS keeps users apart (None: unknown, or MPS
    # off: it bars no one, and nothing bars it), and that user's name for the reasons
    # ("": the number)
    user: int | None = None
    user_name: str = ""

    @property
    def kind(self) -> JobKind:
        return self.shape.kind

    def activity(self, share: float | None = None, duty: float | None = None) -> float:
        """The fraction of :attr:`features` the job shows at a cap and duty cycle: training
        its relative speed times its duty; an inference service its utilization at its load
        of now (``rho = load / service rate`` at that share, at most 1) times its relative
        speed. Dividing what a job showed alone by this gives its features."""
        s = self.sm_share if share is None else share
        d = self.duty if duty is None else duty
        if self.kind is JobKind.INFERENCE:
            mu = self.shape.service_rate(s)
            rho = min(1.0, self.load / mu) if mu > 0 else 1.0
            return rho * self.shape.curve.relative(s)
        return self.shape.curve.relative(s) * d

    def footprint(self, share: float | None = None, duty: float | None = None) -> JobFeatures:
        """Features at a cap and duty cycle (an inference service's at its load of now)."""
        return self.features.scaled(self.activity(share, duty))

    def reserve_bytes(self) -> int:
        """The device memory held for a running job beside others: its shape's reservation,
        raised to what NVML shows its processes use plus the same margin where that is
        more. A job outgrew its declaration where no MPS limit holds it; the plan counts
        that whether or not the caller fed the reading to :meth:`Shape.observe_memory`."""
        seen = int((self.memory_used or 0) * (1.0 + self.shape.memory_margin))
        return max(self.shape.reserve_bytes(), seen)

    def memory_accounted(self) -> int:
        """The device memory counted as the job's own: what NVML reports, or, where the
        driver does not say, its whole reservation (so the GPU's used memory is not
        counted once as the job's reservation and again as held by someone else)."""
        return self.shape.reserve_bytes() if self.memory_used is None else self.memory_used


@dataclass(frozen=True)
class Placement:
    job_id: str
    gpu: int
    sm_share: float
    memory_limit_bytes: int
    predicted_speed: float
    reason: str
    mig_profile: str | None = None

    @property
    def thread_percentage(self) -> int:
        """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` for the job's client."""
        return max(1, min(100, round(self.sm_share * 100)))


@dataclass(frozen=True)
class Directive:
    job_id: str
    duty: float
    evict: bool
    reason: str


@dataclass(frozen=True)
class Convergence:
    iterations: int
    residual: float
    converged: bool


def _tenths_of_gib(n: int) -> float:
    return round(n / 2**30, 1)


def _gib(n: int) -> str:
    return f"{_tenths_of_gib(n):g} GiB"


def _at_peak(job: JobView) -> str | None:
    """Where ``job`` is reserved at more than NVML shows it use now (the most it showed in
    its run, which it may take again), what a refusal says of it, else None: the memory a
    refusal counts is far more than ``nvidia-smi`` shows. Only a peak above both what the
    job declared (it is held at that anyway) and what it uses now by the 0.1 GiB a refusal
    prints is named: one it would print as no more ("peak 10 GiB (now 10 GiB)") is not
    why the job is refused."""
    if job.memory_used is None:
        return None
    most = max(job.shape.memory_bytes, job.memory_used)
    if _tenths_of_gib(job.shape.observed_peak_bytes) <= _tenths_of_gib(most):
        return None
    return (
        f"{job.job_id} holds its run's peak {_gib(job.shape.observed_peak_bytes)} "
        f"(now {_gib(job.memory_used)})"
    )


def _held_at_peak(gpu: _Gpu) -> list[str]:
    """The jobs sharing ``gpu``'s memory held at their run's peak (:func:`_at_peak`)."""
    return [held for j, _, mig in gpu.residents if mig is None and (held := _at_peak(j))]


@dataclass(frozen=True)
class Plan:
    placements: tuple[Placement, ...]
    waiting: Mapping[str, str]
    directives: tuple[Directive, ...]
    prices: Mapping[tuple[int, str], float]
    convergence: Convergence
    predicted_speed: Mapping[str, float]
    memory_reserved: Mapping[int, int]
    # Options refused this pass, per pending job: by the jobs already on the GPU and the
    # check that refused them (one of REFUSALS).
    refused_for: Mapping[str, Mapping[tuple[int, str], int]] = field(default_factory=dict)

    @property
    def refused(self) -> dict[tuple[int, str], int]:
        """:attr:`refused_for` over every pending job."""
        total: Counter[tuple[int, str]] = Counter()
        for counts in self.refused_for.values():
            total.update(counts)
        return dict(total)


# The SM activity alone at which a training job's speed counts 1 in a gain. Lighter jobs
# count less, so min_gain asks more progress of them: at the production mix's mean activity
# (0.31, docs/colocate.md) and the default weight, a unit of speed counts 0.72.
_ACTIVITY_REF = 0.5


@dataclass(frozen=True)
class _Eval:
    ok: bool
    gain: float
    speed: float
    reason: str
    # Which check refused it: one of REFUSALS.
    check: str = ""


# What can refuse an option, as counted in Plan.refused.
REFUSALS: tuple[str, ...] = (
    "instance taken",
    "memory",
    "two services",
    "jobs per GPU",
    "service share",
    "service SLO",
    "slowdown cap",
    "gain",
    "user",  # the GPU's MPS server serves another user (colocate.users)
)


@dataclass
class _Gpu:
    view: GpuView
    residents: list[tuple[JobView, float, str | None]] = field(default_factory=list)
    reserved: int = 0
    # MIG instances given to jobs placed this pass (the view lists the free ones).
    taken_migs: list[str] = field(default_factory=list)
    # The jobs its whole GPU's MPS server serves: the running ones (an evicted job's
    # still, until it has left) and those placed there this pass.
    served: list[JobView] = field(default_factory=list)

    def barred(self, job: JobView) -> str:
        """Why ``job`` may have no share of the whole GPU: its MPS server serves another
        user's jobs ("": it may)."""
        others = other_users(((j.user, j.job_id) for j in self.served), job.user)
        if not others:
            return ""
        names = {j.user: j.user_name for j in self.served if j.user_name}
        return f"GPU {self.view.index}: " + shared_under_mps(others, lambda u: names.get(u, str(u)))

    def limit(self, headroom: float) -> int:
        """The memory the plan may put on this GPU: its total less the headroom."""
        return int(self.view.memory_total * (1.0 - headroom))

    def free_migs(self) -> list[MigOption]:
        """The MIG instances still free: the view's, less those placed this pass."""
        taken = list(self.taken_migs)
        out = []
        for m in self.view.mig_options:
            if m.profile in taken:
                taken.remove(m.profile)
            else:
                out.append(m)
        return out

    def busy(self) -> bool:
        """Jobs, or compute processes of no job gpud knows, run on it: a share slows them."""
        return bool(self.residents) or self.view.foreign is not None

    def shared(self) -> int:
        """Jobs that share the GPU's SMs (those in MIG instances are isolated)."""
        return sum(1 for _, _, mig in self.residents if mig is None)

    def inference_share(self) -> float:
        """SMs the inference services here need at their peak (their MPS caps stay at 100%)."""
        return sum(
            j.shape.share_for_load(j.peak_load)
            for j, _, mig in self.residents
            if j.kind is JobKind.INFERENCE and mig is None
        )


class Planner:
    """Stateful across passes only through its prices and the predictor it is given."""

    def __init__(
        self,
        predictor: InterferencePredictor,
        params: PlannerParams | None = None,
        prices: ShadowPrices | None = None,
    ) -> None:
        self.predictor = predictor
        self.params = params or PlannerParams()
        self.prices = prices or ShadowPrices()
        # The residents' speeds of one GPU as they are, for every option weighed there:
        # kept for one pass, by who the residents are.
        self._before: dict[tuple[object, ...], list[float]] = {}

    # -- evaluation -----------------------------------------------------------------------
    def _speeds(
        self,
        members: Sequence[tuple[JobView, float, str | None]],
        *,
        training_duty: float | None = None,
        foreign: JobFeatures | None = None,
    ) -> list[float]:
        """Predicted speed (over alone, full GPU) of each member of a GPU's set; with
        ``training_duty``, with the training members throttled to at most that duty;
        ``foreign``: the footprint of the GPU's processes of no known job, beside them all."""
        return self._predict(members, training_duty=training_duty, foreign=foreign)[0]

    def _predict(
        self,
        members: Sequence[tuple[JobView, float, str | None]],
        *,
        training_duty: float | None = None,
        foreign: JobFeatures | None = None,
    ) -> tuple[list[float], list[float]]:
        """:meth:`_speeds`, and the speed each member reaches in ``error_quantile`` of
        predictions like it (one prediction serves both)."""
        feats = [
            j.footprint(s, None)
            if training_duty is None or j.kind is not JobKind.TRAINING
            else j.footprint(s, min(j.duty, training_duty))
            for j, s, _ in members
        ]
        speeds: list[float] = []
        bounds: list[float] = []
        for i, (j, s, mig) in enumerate(members):
            rel = j.shape.curve.relative(s)
            if mig is not None:  # a MIG instance is isolated from its neighbours
                speeds.append(rel)
                bounds.append(rel)
                continue
            others = [f for k, f in enumerate(feats) if k != i and members[k][2] is None]
            if foreign is not None:
                others.append(foreign)
            sp, low = self.predictor.speed_and_bound(feats[i], others, self.params.error_quantile)
            speeds.append(rel * sp)
            bounds.append(rel * low)
        return speeds, bounds

    def _evaluate(self, gpu: _Gpu, job: JobView, share: float, mig: str | None) -> _Eval:
        p = self.params
        if mig is not None and all(m.profile != mig for m in gpu.free_migs()):
            # given to a job ahead of it this pass
            return _Eval(False, 0.0, 0.0, f"MIG instance {mig} is taken", "instance taken")
        limit = gpu.limit(p.memory_headroom)
        need = self._memory_need(gpu, job, mig)
        # A MIG instance's memory is its own (the job must fit in it, see _instance_for):
        # what the GPU's other instances hold cannot crowd it.
        if mig is None and gpu.reserved + need > limit:
            free = max(0, limit - gpu.reserved) >> 20
            return _Eval(
                False,
                0.0,
                0.0,
                f"memory: needs {need >> 20} MiB, {free} MiB free under the limit"
                + "".join(f"; {held}" for held in _held_at_peak(gpu)),
                "memory",
            )
        if (
            job.kind is JobKind.INFERENCE
            and mig is None
            and any(j.kind is JobKind.INFERENCE and m is None for j, _, m in gpu.residents)
        ):
            # Two latency-critical services cannot throttle each other: never on one GPU
            # without MIG isolation.
            return _Eval(
                False, 0.0, 0.0, "another inference service is already here", "two services"
            )
        if mig is None and gpu.shared() >= p.max_jobs_per_gpu:
            # The cap is on jobs sharing SMs: an isolated MIG instance adds none.
            return _Eval(False, 0.0, 0.0, f"already {gpu.shared()} jobs", "jobs per GPU")
        if (
            job.kind is JobKind.TRAINING
            and mig is None
            # A training job's MPS share is fixed when it starts: it leaves the service the
            # SMs for its peak, whatever the throttle does to its duty.
            and share > 1.0 - gpu.inference_share() + 1e-9
        ):
            return _Eval(
                False,
                0.0,
                0.0,
                "share would cut into an inference service's share",
                "service share",
            )
        foreign = gpu.view.foreign
        key = (gpu.view.index, *((id(j), sh, m) for j, sh, m in gpu.residents))
        before = self._before.get(key)
        if before is None:
            before = self._before[key] = self._speeds(gpu.residents, foreign=foreign)
        members = [*gpu.residents, (job, share, mig)]
        after, low = self._predict(members, foreign=foreign)
        throttled = (
            self._speeds(members, training_duty=p.peak_duty, foreign=foreign)
            if len(members) > 1 and any(j.kind is JobKind.INFERENCE for j, _, _ in members)
            else after
        )
        floor = 1.0 / p.max_slowdown
        for (j, s, _), sp, mid in zip(members, low, throttled, strict=True):
            if j.kind is JobKind.INFERENCE:
                if (
                    (len(members) == 1 and foreign is None)
                    or mig is not None
                    or in_mig_instance(j, members)
                ):
                    continue  # alone or isolated: as good as this GPU gets
                # Interference only (the share is the service's own choice); the SLO's
                # queueing term is not scaled. The declared peak (diurnal peak times a burst)
                # must hold at the speed predicted with the training throttled to
                # peak_duty, as the guard throttles it when the peak comes; the load of
                # now, with the SLO margin, at the speed reached in error_quantile of
                # predictions like this one, with the training at its present duty.
                rel = max(j.shape.curve.relative(s), 1e-9)
                queueing = P99_FACTOR / j.shape.slo_s if j.shape.slo_s else 0.0
                peak = j.shape.service_rate(s) * mid / rel - queueing
                now = j.shape.service_rate(s) * sp / rel - queueing
                if peak < j.peak_load or now < j.load * (1.0 + p.slo_margin):
                    why = (
                        f"{j.job_id} would not hold its peak load {j.peak_load:g}/s within "
                        f"its SLO with training throttled to duty {p.peak_duty:g}"
                        if peak < j.peak_load
                        else f"{j.job_id} would not hold its load of now {j.load:g}/s "
                        f"+ {p.slo_margin:.0%} within its SLO beside the training"
                    )
                    return _Eval(False, 0.0, 0.0, why, "service SLO")
            elif sp < floor:
                # The cap is on what happens: checked at the speed's lower bound.
                return _Eval(
                    False,
                    0.0,
                    0.0,
                    f"{j.job_id} would slow below 1/{p.max_slowdown:g}",
                    "slowdown cap",
                )
        # The gain too is counted pessimistically: the newcomer at its lower bound, the
        # residents' losses down to theirs. A third job rarely adds more than the error.
        worth = [self._worth(j) for j, _, _ in members]
        lost = sum(w * (b - a) for w, b, a in zip(worth[:-1], before, low[:-1], strict=True))
        gain = worth[-1] * low[-1] - lost
        return _Eval(True, gain, after[-1], "")

    def _worth(self, job: JobView) -> float:
        """What one unit of the job's normalized speed counts for in a gain.

        A training job at the reference SM activity counts 1, one that keeps more SMs busy
        more; an inference service always 1 (its SLO, not its SMs, is what matters).
        """
        w = self.params.activity_weight
        if job.kind is not JobKind.TRAINING:
            return 1.0
        return (1.0 - w) + w * min(1.0, job.features.sm) / _ACTIVITY_REF

    # -- one pass -------------------------------------------------------------------------
    def plan(
        self,
        gpus: Sequence[GpuView],
        jobs: Sequence[JobView],
        guard_duty: Mapping[int, float] | None = None,
        guard_evict: Mapping[int, str] | None = None,
    ) -> Plan:
        """Place pending jobs and direct running ones; see the module docstring."""
        p = self.params
        self._before = {}
        state = {g.index: _Gpu(g) for g in gpus}
        running = [j for j in jobs if j.gpu is not None and j.gpu in state]
        pending = sorted((j for j in jobs if j.gpu is None), key=lambda j: (j.order, j.job_id))
        for j in running:
            assert j.gpu is not None
            g = state[j.gpu]
            g.residents.append((j, j.sm_share, j.mig_profile))
            g.reserved += j.reserve_bytes()
            if j.mig_profile is None:
                g.served.append(j)
        for g in state.values():
            # What NVML shows beyond the jobs' own use stays taken, whoever holds it.
            g.reserved += max(
                0, g.view.memory_used - sum(j.memory_accounted() for j, _, _ in g.residents)
            )

        directives: list[Directive] = []
        evicted: set[str] = set()
        # Memory an evicted job still holds until it exits, per GPU (NVML still shows it).
        freed: dict[int, int] = {}
        freed_in: dict[str, int] = {}  # the same per device, as NVML reports it there

        def evict(job: JobView, reason: str) -> None:
            # A job on several GPUs leaves them all: it is one process group.
            for h in state.values():
                for gone in self._drop(h, job.job_id):
                    freed[h.view.index] = freed.get(h.view.index, 0) + gone.memory_accounted()
                    freed_in[gone.device] = freed_in.get(gone.device, 0) + (gone.memory_used or 0)
                    h.reserved += gone.memory_accounted()  # held until the job has left
            evicted.add(job.job_id)
            directives.append(Directive(job.job_id, 0.0, True, reason))

        def shed(
            gpu: int,
            members: Sequence[JobView],
            victims: Iterable[JobView],
            used: int,
            cap: int,
            *,
            size: Callable[[JobView], int],
        ) -> None:
            """Evict the newest of ``victims`` while ``used`` is over ``cap`` and another of
            ``members`` is left there (a job alone may fill what it has: eviction protects
            the others, not the job); each takes ``size`` of its views among ``members``
            off ``used``, as ``used`` counts it. ``members`` in one MIG instance: the
            reason names it."""
            for victim in sorted(victims, key=lambda j: (-j.order, j.job_id)):
                left = {j.job_id for j in members if j.job_id not in evicted}
                if used <= cap or len(left) <= 1:
                    break
                if victim.job_id not in left:  # gone with another of its views
                    continue
                where = f"GPU {gpu}"
                if victim.mig_profile is not None:
                    where += f" MIG instance {victim.mig_profile} ({victim.device})"
                evict(
                    victim,
                    f"{where} memory {used >> 20} MiB over its limit {cap >> 20} MiB: "
                    f"evict the newest training job{' there' if victim.mig_profile else ''}",
                )
                used -= sum(size(j) for j in members if j.job_id == victim.job_id)

        # 1. memory: the observed use over the limit costs the newest training job its place.
        for g in state.values():
            shed(
                g.view.index,
                [j for j, _, _ in g.residents],
                # A job in a MIG instance is held to the instance's memory by the hardware:
                # it crowds no one on the GPU.
                [j for j, _, mig in g.residents if j.kind is JobKind.TRAINING and mig is None],
                max(
                    g.view.memory_used - freed.get(g.view.index, 0),
                    sum(j.memory_used or 0 for j, _, _ in g.residents),  # as observed
                ),
                g.limit(p.memory_headroom),
                size=JobView.memory_accounted,
            )
            # Jobs sharing one GPU instance share its memory as jobs share a whole GPU's:
            # one that grows crowds the others there, so the same rule holds per instance.
            for inst, members in _instances(g):
                inside = [j for j in members if j.job_id not in evicted]
                known = sum(j.memory_used or 0 for j in inside)
                shed(
                    g.view.index,
                    inside,
                    # where the driver does not say what a job uses, nothing says it crowds
                    # the others: it is never a reason to evict, nor is it evicted for it
                    [j for j in inside if j.kind is JobKind.TRAINING and j.memory_used is not None],
                    # NVML's reading of the instance counts what such a job holds too, and
                    # that would cost a job of known memory its place: then only the known
                    # memory counts
                    known
                    if inst.used is None or any(j.memory_used is None for j in members)
                    else max(inst.used - sum(freed_in.get(d, 0) for d in inst.devices), known),
                    int(inst.total * (1.0 - p.memory_headroom)),
                    size=lambda j: j.memory_used or 0,
                )
            if guard_evict and g.view.index in guard_evict:
                for j, _, mig in list(g.residents):
                    if (
                        j.kind is JobKind.TRAINING
                        and j.job_id not in evicted
                        and _beside_service(g, j, mig)
                    ):
                        evict(j, guard_evict[g.view.index])

        # 2. options per pending job.
        options: dict[str, list[Option]] = {}
        refused_for: dict[str, dict[tuple[int, str], int]] = {}
        for job in pending:
            opts: list[Option] = []
            mine = refused_for.setdefault(job.job_id, {})
            for g in state.values():
                candidates = self._candidates(job, g)
                if candidates and candidates[0][1] is None and g.barred(job):
                    key = (len(g.residents), "user")  # its shares, refused once
                    mine[key] = mine.get(key, 0) + 1
                    continue
                for share, mig in candidates:
                    ev = self._evaluate(g, job, share, mig)
                    check = (
                        ev.check
                        if not ev.ok
                        else "gain"
                        if mig is None and g.residents and ev.gain < p.min_gain
                        else ""
                    )
                    if check:
                        key = (len(g.residents), check)
                        mine[key] = mine.get(key, 0) + 1
                        continue
                    opts.append(
                        Option(
                            gpu=g.view.index,
                            utility=ev.gain,
                            # An instance's SMs, memory and bandwidth are its own: it
                            # takes nothing the GPU's prices ration.
                            demand={}
                            if mig is not None
                            else {
                                "sm": job.footprint(share, 1.0).sm,
                                "mem": self._memory_need(g, job, mig) / g.view.memory_total,
                                "bw": job.footprint(share, 1.0).mem_bw,
                            },
                            tag=(share, mig),
                        )
                    )
            if self._tight(job) and any(isinstance(o.tag, tuple) and o.tag[1] for o in opts):
                # A tight service that a MIG instance holds: isolation (an instance, or a
                # GPU of its own) rather than an MPS share next to jobs whose bursts it
                # would feel.
                opts = [
                    o
                    for o in opts
                    if not state[o.gpu].residents or (isinstance(o.tag, tuple) and o.tag[1])
                ]
            options[job.job_id] = opts
        held = self._hold_for_head(pending, options, state)
        if held is not None:
            head, gpu = held
            for job in pending:
                if job.job_id != head.job_id and job.kind is JobKind.TRAINING:
                    options[job.job_id] = [o for o in options[job.job_id] if o.gpu != gpu]

        # 3. prices over what is left on each GPU.
        capacity: dict[tuple[int, str], float] = {}
        for g in state.values():
            feats = [j.footprint(s, None) for j, s, _ in g.residents]
            capacity[(g.view.index, "sm")] = max(
                0.0, 1.0 + p.sm_oversubscription - sum(f.sm for f in feats)
            )
            capacity[(g.view.index, "bw")] = max(
                0.0, 1.0 + p.sm_oversubscription - sum(f.mem_bw for f in feats)
            )
            capacity[(g.view.index, "mem")] = max(
                0.0, (1.0 - p.memory_headroom) - g.reserved / g.view.memory_total
            )
        result = self.prices.solve(options, capacity)

        # 4. commit in arrival order, re-checking against what is already committed.
        placements: list[Placement] = []
        waiting: dict[str, str] = {}
        for job in pending:
            opts = options[job.job_id]
            if not opts:
                waiting[job.job_id] = self._why_not(job, state)
                if held is not None and held[0] is job:
                    why = "evicted" if job.evicted else f"waited {job.waited_s:.0f} s"
                    waiting[job.job_id] = (
                        f"GPU {held[1]} held for it ({why}): " + waiting[job.job_id]
                    )
                continue
            first = result.choices.get(job.job_id)
            ranked = sorted(
                range(len(opts)),
                key=lambda i: (
                    -(
                        opts[i].utility
                        - sum(
                            result.prices.get((opts[i].gpu, r), 0.0) * d
                            for r, d in opts[i].demand.items()
                        )
                    )
                ),
            )
            if first is not None:
                ranked.remove(first)
                ranked.insert(0, first)
            placed = False
            for gpu, share, mig in self._attempts(job, [opts[i] for i in ranked], state):
                g = state[gpu]
                ev = self._evaluate(g, job, share, mig)
                if not ev.ok or (mig is None and g.residents and ev.gain < p.min_gain):
                    continue
                reason = self._reason(job, g, share, mig, ev)
                g.residents.append((job, share, mig))
                g.reserved += job.shape.reserve_bytes()
                if mig is not None:
                    g.taken_migs.append(mig)
                else:
                    g.served.append(job)
                placements.append(
                    Placement(
                        job_id=job.job_id,
                        gpu=gpu,
                        sm_share=share,
                        memory_limit_bytes=min(
                            job.shape.reserve_bytes(), g.limit(p.memory_headroom)
                        ),
                        predicted_speed=ev.speed,
                        reason=reason,
                        mig_profile=mig,
                    )
                )
                placed = True
                break
            if not placed:
                gpus_of = {o.gpu for o in opts}
                ahead = sorted({p.job_id for p in placements if p.gpu in gpus_of})
                why = "its options went to jobs ahead of it: " + ", ".join(ahead)
                # and where that was another user's, whose server it may not share now
                barred = [b for i in sorted(gpus_of) if (b := state[i].barred(job))]
                waiting[job.job_id] = "; ".join([why, *barred])

        # 5. directives for running training jobs: one per job, at the lowest duty the
        # guards allow on any of its GPUs (a job on several GPUs runs at one pace).
        duty = guard_duty or {}
        told: dict[str, Directive] = {}
        for g in state.values():
            for j, _, mig in g.residents:
                if j.kind is not JobKind.TRAINING or j.gpu is None:
                    continue
                # A guard acts on the training that shares its service's SMs: not on a job
                # in another MIG instance, which its service cannot feel.
                d = duty.get(g.view.index, 1.0) if _beside_service(g, j, mig) else 1.0
                before = told.get(j.job_id)
                if before is None or d < before.duty:
                    why = (
                        f"SLO guard on GPU {g.view.index} holds training at duty {d:.2f}"
                        if d < 1.0
                        else "no SLO pressure"
                    )
                    told[j.job_id] = Directive(j.job_id, d, False, why)
        directives.extend(told.values())

        # A job on several GPUs goes at the pace of its slowest.
        predicted: dict[str, float] = {}
        for g in state.values():
            speeds = self._speeds(g.residents, foreign=g.view.foreign)
            for (j, _, _), sp in zip(g.residents, speeds, strict=True):
                predicted[j.job_id] = min(sp, predicted.get(j.job_id, sp))
        return Plan(
            placements=tuple(placements),
            waiting=waiting,
            directives=tuple(directives),
            prices=result.prices,
            convergence=_convergence(result.iterations, result.residual, result.converged),
            predicted_speed=predicted,
            memory_reserved={i: g.reserved for i, g in state.items()},
            refused_for=refused_for,
        )

    # -- helpers --------------------------------------------------------------------------
    def _attempts(
        self, job: JobView, ranked: Sequence[Option], state: Mapping[int, _Gpu]
    ) -> Iterator[tuple[int, float, str | None]]:
        """(GPU, SM share, MIG profile) to try for the job at commit, best first.

        Its ranked options, as they were weighed, skipping those taken this pass by jobs
        ahead of it; and on each GPU whose MIG instance went to a job ahead of it, the
        instance it would take of those still free there (a larger one may hold it). A
        re-pick was never weighed against its other options: it must not take a GPU's
        larger instance from a job behind it, nor leave an instance it ranked higher free,
        so it comes after the ranked options that slow no one (free instances, a free GPU)
        ranked above the first MPS share of a GPU where jobs, or processes of no job gpud
        knows, run; and before that share, as sharing is for work that would otherwise
        wait and a free instance slows no one.
        """
        tries: list[tuple[int, float, str | None]] = []
        lost: list[int] = []
        for o in ranked:
            share, mig = o.tag if isinstance(o.tag, tuple) else (1.0, None)
            g = state[o.gpu]
            if mig is None and g.barred(job):
                continue  # a job of another user was placed there ahead of it
            if mig is not None and all(m.profile != mig for m in g.free_migs()):
                if o.gpu not in lost:
                    lost.append(o.gpu)
                continue
            tries.append((o.gpu, share, mig))
        repicks = [
            (gpu, m.sm_fraction, m.profile)
            for gpu in lost
            if (m := self._instance_for(job, state[gpu].free_migs())) is not None
        ]
        shares = (i for i, (gpu, _, mig) in enumerate(tries) if mig is None and state[gpu].busy())
        cut = next(shares, len(tries))
        yield from tries[:cut]
        # a re-pick may be an instance the job ranked too: tried once, at the first place
        # it comes (the pass's state does not change between tries, nor its answer)
        before = {(gpu, mig) for gpu, _, mig in tries[:cut]}
        picked = [r for r in repicks if (r[0], r[2]) not in before]
        yield from picked
        again = {(gpu, mig) for gpu, _, mig in picked}
        yield from (t for t in tries[cut:] if (t[0], t[2]) not in again)

    def _hold_for_head(
        self,
        pending: Sequence[JobView],
        options: Mapping[str, list[Option]],
        state: Mapping[int, _Gpu],
    ) -> tuple[JobView, int] | None:
        """The first training job in arrival order with no option that was evicted or has
        waited ``head_hold_s``, and the GPU to hold for it: where it fits alone, with the
        fewest jobs (then the least memory reserved) now; None when there is none."""
        head = next(
            (
                j
                for j in pending
                if j.kind is JobKind.TRAINING
                and not options[j.job_id]
                and (j.evicted or j.waited_s >= self.params.head_hold_s)
            ),
            None,
        )
        if head is None:
            return None
        need = head.shape.needed_bytes()
        fits = [
            g
            for g in state.values()
            if g.view.whole
            and g.view.foreign is None
            and not g.barred(head)
            and need <= g.limit(self.params.memory_headroom)
        ]
        if not fits:
            return None
        g = min(fits, key=lambda g: (len(g.residents), g.reserved, g.view.index))
        return head, g.view.index

    def _candidates(self, job: JobView, g: _Gpu) -> list[tuple[float, str | None]]:
        """(SM share, MIG profile or None) the job could have on the GPU, best first."""
        if self._tight(job) or not g.view.whole:
            # A free MIG instance is isolated hardware, whoever else is on the GPU; on a
            # GPU in MIG mode it is all a job can have.
            m = self._instance_for(job, g.free_migs())
            if m is not None:
                return [(m.sm_fraction, m.profile)]
            if not g.view.whole:
                return []
        if job.kind is JobKind.INFERENCE or not g.residents:
            return [(1.0, None)]
        return [(s, None) for s in self.params.shares]

    def _instance_for(self, job: JobView, instances: Sequence[MigOption]) -> MigOption | None:
        """The MIG instance the job would take among ``instances``, None when none will do.

        It must hold the job's memory reservation. An inference service takes the smallest
        that serves its peak with the SLO margin. A training job takes the smallest of those
        where its shape predicts its best speed, and only where that speed is at least
        ``1 / max_slowdown`` of its speed on a whole GPU (the cap a shared GPU is held to).
        """
        fits = [m for m in instances if m.memory_bytes >= job.shape.reserve_bytes()]
        if job.kind is JobKind.INFERENCE:
            need = job.peak_load * (1 + self.params.slo_margin)
            fits = [m for m in fits if job.shape.perf(m.sm_fraction) >= need]
        else:
            speed = job.shape.curve.relative
            fits = [m for m in fits if speed(m.sm_fraction) >= 1.0 / self.params.max_slowdown]
            best = max((speed(m.sm_fraction) for m in fits), default=0.0)
            fits = [m for m in fits if speed(m.sm_fraction) >= best - 1e-9]
        return min(fits, key=lambda m: (m.sm_fraction, m.memory_bytes), default=None)

    def _tight(self, job: JobView) -> bool:
        """An inference SLO shorter than ``tight_slo_service_times`` service times."""
        if job.kind is not JobKind.INFERENCE or job.shape.slo_s is None:
            return False
        svc = 1.0 / max(job.shape.service_rate(1.0), 1e-9)
        return job.shape.slo_s < self.params.tight_slo_service_times * svc

    def _drop(self, g: _Gpu, job_id: str) -> list[JobView]:
        """Take the job off the GPU; its views that were there."""
        gone = [j for j, _, _ in g.residents if j.job_id == job_id]
        g.residents = [r for r in g.residents if r[0].job_id != job_id]
        g.reserved -= sum(j.reserve_bytes() for j in gone)
        return gone

    @staticmethod
    def _memory_need(gpu: _Gpu, job: JobView, mig: str | None) -> int:
        """The memory a job must find free: with its growth margin beside others; alone on
        a GPU, only what it needs, as its growth can reach nobody else."""
        if not gpu.busy() and mig is None:
            return job.shape.needed_bytes()
        return job.shape.reserve_bytes()

    def _why_not(self, job: JobView, state: Mapping[int, _Gpu]) -> str:
        if not state:
            return "no GPU to place it on (none is healthy)"
        need = job.shape.needed_bytes()
        largest = max(g.limit(self.params.memory_headroom) for g in state.values())
        if need > largest:
            # Waiting would not help: say so rather than list what is busy now.
            return (
                f"never fits on this node: needs {need >> 20} MiB, and no GPU holds more "
                f"than {largest >> 20} MiB under the {self.params.memory_headroom:.0%} "
                "memory headroom"
            )
        if not any(g.view.whole for g in state.values()):
            # Only an instance will do, and when none of the layout's would, waiting for one
            # to come free would not help. (``state`` holds the healthy GPUs: one that is
            # lost is the jobs service's to weigh, which queues a job for it.)
            layout = {m.profile: m for g in state.values() for m in g.view.layout()}
            if self._instance_for(job, list(layout.values())) is None:
                return (
                    "never fits on this node: every healthy GPU is in MIG mode, and no MIG "
                    f"instance there ({', '.join(sorted(layout)) or 'none'}) "
                    + self._instance_terms(job)
                    + (f"; {held}" if (held := _at_peak(job)) else "")
                )
        reasons = []
        terms_said = False  # a MIG GPU's part says what an instance must hold
        for g in state.values():
            candidates = self._candidates(job, g)
            if not candidates:
                free = sorted({m.profile for m in g.free_migs()})
                terms_said |= bool(free)
                why = (
                    f"no free instance ({', '.join(free)}) {self._instance_terms(job)}"
                    if free
                    else "every instance is taken"
                )
                reasons.append(f"GPU {g.view.index}: in MIG mode: {why}")
                continue
            share, mig = candidates[0]
            if mig is None and (barred := g.barred(job)):
                reasons.append(barred)
                continue
            ev = self._evaluate(g, job, share, mig)
            reasons.append(
                f"GPU {g.view.index}: {ev.reason or f'gain {ev.gain:.2f} under {self.params.min_gain:g}'}"
            )
        # the job held at its run's peak (what an instance must hold) said once, not in
        # every MIG GPU's part
        held = _at_peak(job) if terms_said else None
        return (
            "; ".join(reasons[:4])
            + ("; ..." if len(reasons) > 4 else "")
            + (f"; {held}" if held else "")
        )

    def _instance_terms(self, job: JobView) -> str:
        """What an instance must offer the job (see :meth:`_instance_for`); a refusal adds,
        once, where its memory is its run's peak (:func:`_at_peak`)."""
        mib = job.shape.reserve_bytes() >> 20
        if job.kind is JobKind.INFERENCE:
            return (
                f"holds its {mib} MiB and serves its peak {job.peak_load:g}/s "
                f"+ {self.params.slo_margin:.0%} within its SLO"
            )
        return (
            f"holds its {mib} MiB and gives it 1/{self.params.max_slowdown:g} of its speed "
            "on a whole GPU"
        )

    def _reason(self, job: JobView, g: _Gpu, share: float, mig: str | None, ev: _Eval) -> str:
        if mig is not None and self._tight(job):
            return (
                f"tight SLO ({job.shape.slo_s:g} s): MIG instance {mig} on GPU {g.view.index} "
                "for hard isolation"
            )
        if mig is not None:
            what = (
                f"the smallest free one that serves its peak {job.peak_load:g}/s within its SLO"
                if job.kind is JobKind.INFERENCE
                else f"predicted speed {ev.speed:.2f} of its speed on a whole GPU"
            )
            return f"GPU {g.view.index} is in MIG mode: MIG instance {mig}, {what}"
        if not g.busy():
            return f"GPU {g.view.index} is free: exclusive"
        if not g.residents:
            return (
                f"GPU {g.view.index} holds no job but processes gpud does not know: predicted "
                f"speed {ev.speed:.2f} beside them"
            )
        names = ", ".join(j.job_id for j, _, _ in g.residents)
        return (
            f"shares GPU {g.view.index} with {names} at {share:.0%} SMs: predicted speed "
            f"{ev.speed:.2f}, net gain {ev.gain:.2f}"
        )


def _beside_service(g: _Gpu, job: JobView, mig: str | None) -> bool:
    """Whether ``job`` shares SMs with an inference service on ``g``: both on the whole
    GPU's SMs, or in the same MIG device."""
    return any(
        o.kind is JobKind.INFERENCE
        and ((m is None and mig is None) or (bool(job.device) and o.device == job.device))
        for o, _, m in g.residents
    )


def _instances(g: _Gpu) -> list[tuple[MigMemory, list[JobView]]]:
    """Each GPU instance of ``g`` that several of its jobs share, with those jobs. A job
    whose MIG device is in no instance the GPU's view lists (one made since the list was
    read) shares that device alone with the jobs in it, whose memory is its profile's;
    where the GPU's layout has no such profile, nothing says what they may hold."""
    instances = list(g.view.mig_memory)
    where = {d: inst for inst in instances for d in inst.devices}
    sizes = {m.profile: m.memory_bytes for m in g.view.layout()}
    inside: dict[int, list[JobView]] = {}
    for j, _, mig in g.residents:
        if mig is None or not j.device:
            continue
        inst = where.get(j.device)
        if inst is None and sizes.get(mig):
            inst = where[j.device] = MigMemory((j.device,), sizes[mig])
            instances.append(inst)
        if inst is not None:
            inside.setdefault(id(inst), []).append(j)
    return [
        (inst, inside[id(inst)])
        for inst in instances
        if len({j.job_id for j in inside.get(id(inst), [])}) > 1
    ]


def in_mig_instance(job: JobView, members: Sequence[tuple[JobView, float, str | None]]) -> bool:
    """Whether ``job`` sits in a MIG instance among ``members``."""
    return any(m is job and mig is not None for m, _, mig in members)


def _convergence(iterations: int, residual: float, converged: bool) -> Convergence:
    return Convergence(iterations=iterations, residual=residual, converged=converged)
