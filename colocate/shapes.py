"""Resource shapes: a job as a family of feasible configurations with predicted performance.

A configuration is what the driver enforces for a job on one GPU: an SM share (the MPS
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` of its client, or a MIG instance's share of the
GPU's SMs), the device memory it may pin, and the memory-bandwidth share it is expected to
use. Performance follows a saturating curve: a job that keeps a fraction ``knee`` of the
SMs busy when alone runs at full speed with any share at or above the knee and slows
sub-linearly (exponent ``gamma``) below it.

Training performance is iterations/s. Inference performance is the request rate it can
sustain with its p99 latency within the SLO, from an M/M/1 approximation: the p99 of the
response time is ``ln(100) / (mu - lambda)``, so the sustainable load is
``mu - ln(100) / slo``.

Shapes start from what the job declares, or from conservative priors (the whole GPU is
needed, memory is declared plus a margin; an inference service holds its SLO at its peak
alone with some headroom, see :func:`prior_service_rate`), and are refined online from the
throughput gpud measures against the share the job had.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

P99_FACTOR = math.log(100.0)

# MPS thread shares a planner considers; 1.0 means uncapped.
DEFAULT_SHARES: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25)

# An inference service that does not declare its speed: one request takes this long on a
# whole GPU (a batched forward pass of a mid-size model on a data-centre GPU) ...
PRIOR_SERVICE_TIME_S = 0.02
# ... unless its SLO says it must be faster: a service deployed with an SLO holds it at its
# declared peak on a whole GPU, and is assumed to with this much to spare (the service
# rate, net of the SLO's queueing term, this many times what the SLO and peak need).
PRIOR_SERVICE_HEADROOM = 1.5


class JobKind(StrEnum):
    TRAINING = "training"
    INFERENCE = "inference"


@dataclass(frozen=True)
class MigOption:
    """A MIG instance the planner may give a job: its profile, its share of the whole GPU's
    SMs and its memory."""

    profile: str
    sm_fraction: float
    memory_bytes: int


@dataclass(frozen=True)
class Config:
    """One feasible configuration of a job on a GPU.

    ``sm_share``: MPS active thread fraction (1.0 = uncapped) or the MIG instance's SM share.
    ``mig_profile``: the MIG profile name when the job gets an instance, else None.
    ``memory_bytes``: device memory to reserve. ``bw_share``: expected fraction of the
    device's memory bandwidth. ``perf``: predicted performance alone with this share.
    """

    sm_share: float
    memory_bytes: int
    bw_share: float
    perf: float
    mig_profile: str | None = None


@dataclass
class Curve:
    """Performance against SM share: ``peak * min(1, share / knee) ** gamma``."""

    peak: float
    knee: float = 1.0
    gamma: float = 0.85

    def perf(self, share: float) -> float:
        if share <= 0.0:
            return 0.0
        return float(self.peak * min(1.0, share / self.knee) ** self.gamma)

    def relative(self, share: float) -> float:
        """Performance at ``share`` over performance with the whole GPU."""
        return self.perf(share) / self.peak if self.peak > 0 else 0.0


def prior_service_rate(slo_s: float | None, peak_load: float = 0.0) -> float:
    """Requests/s an inference service of unknown speed is assumed to serve on a whole GPU.

    ``1 / PRIOR_SERVICE_TIME_S``, or more where its SLO and peak load need more: a service
    holds its declared SLO at its declared peak alone on a GPU (else it could not be
    deployed), with ``PRIOR_SERVICE_HEADROOM``. So it is placeable alone, its tightness
    follows its SLO (a 50 ms SLO is a few service times, a 2 s one hundreds) and its load,
    and it shares SMs only where the predicted slowdown stays within that headroom.
    """
    base = 1.0 / PRIOR_SERVICE_TIME_S
    if not slo_s or slo_s <= 0:
        return max(base, PRIOR_SERVICE_HEADROOM * max(0.0, peak_load))
    return max(base, PRIOR_SERVICE_HEADROOM * (P99_FACTOR / slo_s + max(0.0, peak_load)))


@dataclass(frozen=True)
class Observation:
    share: float
    throughput: float


_KNEE_GRID = tuple(k / 20 for k in range(2, 21))


@dataclass
class Shape:
    """A job's family of configurations and the model behind it.

    ``memory_bytes`` is the reservation the planner uses: the larger of what the job
    declared (plus ``memory_margin``) and the largest footprint NVML has shown for its
    processes (plus the same margin).
    """

    job_id: str
    kind: JobKind
    curve: Curve
    memory_bytes: int
    bw_intensity: float = 0.3
    slo_s: float | None = None
    memory_margin: float = 0.15
    observed_peak_bytes: int = 0
    history: deque[Observation] = field(default_factory=lambda: deque(maxlen=64))

    @classmethod
    def prior(
        cls,
        job_id: str,
        kind: JobKind,
        *,
        memory_bytes: int,
        peak: float | None = None,
        knee: float | None = None,
        bw_intensity: float | None = None,
        slo_s: float | None = None,
        peak_load: float = 0.0,
    ) -> Shape:
        """A shape from declarations; what is not declared is assumed conservatively.

        Unknown knee: the job needs the whole GPU (1.0). Unknown bandwidth intensity: 0.5,
        so that it is not paired with heavy jobs blindly. Unknown peak: training 1.0
        (relative); inference, the service rate of :func:`prior_service_rate`, from its SLO
        and its declared ``peak_load`` (requests/s).
        """
        if peak is None or peak <= 0:
            peak = prior_service_rate(slo_s, peak_load) if kind is JobKind.INFERENCE else 1.0
        return cls(
            job_id=job_id,
            kind=kind,
            curve=Curve(peak=peak, knee=knee or 1.0),
            memory_bytes=memory_bytes,
            bw_intensity=0.5 if bw_intensity is None else bw_intensity,
            slo_s=slo_s,
        )

    # -- memory -------------------------------------------------------------------------
    def needed_bytes(self) -> int:
        """Device memory the job needs: declared or seen, whichever is larger."""
        return max(self.memory_bytes, self.observed_peak_bytes)

    def reserve_bytes(self) -> int:
        """Device memory to hold for this job beside others: :meth:`needed_bytes` plus the
        margin that keeps its growth from reaching them."""
        return int(self.needed_bytes() * (1.0 + self.memory_margin))

    def observe_memory(self, used_bytes: int) -> None:
        self.observed_peak_bytes = max(self.observed_peak_bytes, used_bytes)

    # -- performance --------------------------------------------------------------------
    def perf(self, share: float) -> float:
        """Training: iterations/s. Inference: sustainable req/s within the SLO."""
        mu = self.curve.perf(share)
        if self.kind is JobKind.INFERENCE and self.slo_s:
            return max(0.0, mu - P99_FACTOR / self.slo_s)
        return mu

    def service_rate(self, share: float) -> float:
        return self.curve.perf(share)

    def share_for_load(self, load: float, shares: tuple[float, ...] = DEFAULT_SHARES) -> float:
        """The smallest share whose sustainable load covers ``load`` (1.0 when none does)."""
        for s in sorted(shares):
            if self.perf(s) >= load:
                return s
        return 1.0

    def configs(
        self,
        shares: tuple[float, ...] = DEFAULT_SHARES,
        mig: tuple[MigOption, ...] = (),
    ) -> list[Config]:
        """Every MPS share in ``shares`` and every MIG option whose memory holds the job."""
        mem = self.reserve_bytes()
        out = [
            Config(
                sm_share=s,
                memory_bytes=mem,
                bw_share=min(1.0, self.bw_intensity * self.curve.relative(s)),
                perf=self.perf(s),
            )
            for s in shares
        ]
        for m in mig:
            if m.memory_bytes >= mem:
                out.append(
                    Config(
                        sm_share=m.sm_fraction,
                        memory_bytes=m.memory_bytes,
                        bw_share=min(1.0, self.bw_intensity * self.curve.relative(m.sm_fraction)),
                        perf=self.perf(m.sm_fraction),
                        mig_profile=m.profile,
                    )
                )
        return out

    def observe(self, share: float, throughput: float, interference: float = 1.0) -> None:
        """Refine the curve from a measured throughput at ``share``.

        ``interference`` is the slowdown factor (in (0, 1]) the job was predicted to suffer
        from its co-runners at the time; the observation is divided by it so that the shape
        stays a property of the job alone. The peak follows an EWMA; the knee is the grid
        value that best explains the recent history (least squares), once shares vary.
        """
        if share <= 0.0 or throughput < 0.0 or interference <= 0.0:
            return
        alone = throughput / interference
        self.history.append(Observation(share, alone))
        implied_peak = alone / max(1e-9, self.curve.relative(share))
        self.curve.peak = 0.8 * self.curve.peak + 0.2 * implied_peak
        if len({round(o.share, 3) for o in self.history}) < 2:
            return
        best_knee, best_err = self.curve.knee, math.inf
        for k in _KNEE_GRID:
            c = Curve(peak=1.0, knee=k, gamma=self.curve.gamma)
            # Closed-form least-squares peak for this knee, then the residual.
            num = sum(o.throughput * c.relative(o.share) for o in self.history)
            den = sum(c.relative(o.share) ** 2 for o in self.history)
            peak = num / den if den > 0 else self.curve.peak
            err = sum((o.throughput - peak * c.relative(o.share)) ** 2 for o in self.history)
            if err < best_err - 1e-12:
                best_knee, best_err = k, err
        self.curve.knee = best_knee
