"""SLO guard: keep an inference service's p99 latency within its SLO next to training.

Each tick the guard compares the service's latest p99 with its SLO. When p99 comes within
``margin`` of the SLO it cuts the duty cycle of the training jobs on that GPU at once
(multiplicative decrease, ``decrease``); while p99 stays comfortably below (under
``(1 - 2 * margin) * slo``) it gives duty back slowly (additive increase, ``increase``).
When the duty cycle is already at its floor and p99 still breaks the SLO for
``evict_after`` ticks in a row, the guard asks for the training on that GPU to be evicted
and says why. Training applies the duty cycle cooperatively: ``gpud.client.throttle_point``
sleeps ``(1 - duty) / duty`` of each iteration's time (MPS thread limits are fixed when a
CUDA context is created, so sleeping is the lever that acts now).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class GuardAction(StrEnum):
    HOLD = "hold"
    THROTTLE = "throttle"
    RECOVER = "recover"
    EVICT = "evict"


@dataclass(frozen=True)
class GuardParams:
    margin: float = 0.2
    decrease: float = 0.5
    increase: float = 0.1
    min_duty: float = 0.05
    evict_after: int = 2

    def __post_init__(self) -> None:
        if not 0.0 < self.margin < 0.5:
            raise ValueError(f"guard margin {self.margin} outside (0, 0.5)")
        if not 0.0 < self.decrease < 1.0:
            raise ValueError(f"guard decrease {self.decrease} outside (0, 1)")
        if not 0.0 < self.increase <= 1.0:
            raise ValueError(f"guard increase {self.increase} outside (0, 1]")
        if not 0.0 < self.min_duty <= 1.0:
            raise ValueError(f"guard min_duty {self.min_duty} outside (0, 1]")


@dataclass(frozen=True)
class GuardDecision:
    service: str
    duty: float
    action: GuardAction
    reason: str


@dataclass
class ServiceGuard:
    """The guard's state for one inference service."""

    service: str
    slo_s: float
    params: GuardParams = field(default_factory=GuardParams)
    duty: float = 1.0
    breaches_at_floor: int = 0
    last: GuardDecision | None = None

    def tick(self, p99_s: float | None) -> GuardDecision:
        """One guard step from the latest p99 (None: no requests in the window)."""
        p = self.params
        if p99_s is None:
            decision = GuardDecision(
                self.service, self.duty, GuardAction.HOLD, "no latency reports"
            )
        elif p99_s >= (1.0 - p.margin) * self.slo_s:
            if self.duty <= p.min_duty + 1e-9 and p99_s > self.slo_s:
                self.breaches_at_floor += 1
            else:
                self.breaches_at_floor = 0
            if self.breaches_at_floor >= p.evict_after:
                self.breaches_at_floor = 0
                self.duty = 1.0  # the training goes; whatever comes next starts afresh
                decision = GuardDecision(
                    self.service,
                    0.0,
                    GuardAction.EVICT,
                    f"p99 {p99_s * 1e3:.1f} ms over SLO {self.slo_s * 1e3:.1f} ms with training "
                    f"at the minimum duty cycle {p.min_duty:.2f}: evict training from this GPU",
                )
            else:
                self.duty = max(p.min_duty, self.duty * p.decrease)
                decision = GuardDecision(
                    self.service,
                    self.duty,
                    GuardAction.THROTTLE,
                    f"p99 {p99_s * 1e3:.1f} ms within {p.margin:.0%} of SLO "
                    f"{self.slo_s * 1e3:.1f} ms: training duty cut to {self.duty:.2f}",
                )
        elif p99_s < (1.0 - 2 * p.margin) * self.slo_s and self.duty < 1.0:
            self.breaches_at_floor = 0
            self.duty = min(1.0, self.duty + p.increase)
            decision = GuardDecision(
                self.service,
                self.duty,
                GuardAction.RECOVER,
                f"p99 {p99_s * 1e3:.1f} ms well under SLO: training duty back to {self.duty:.2f}",
            )
        else:
            self.breaches_at_floor = 0
            decision = GuardDecision(self.service, self.duty, GuardAction.HOLD, "p99 within band")
        self.last = decision
        return decision

    def retune(self, params: GuardParams) -> None:
        """New parameters (a reload): a duty under the new floor is lifted to it at once."""
        self.params = params
        self.duty = max(self.duty, params.min_duty)

    def start_at(self, duty: float) -> None:
        """Start afresh at ``duty`` (at least the floor): what the guard learned was about
        other training than the service has beside it now."""
        self.duty = min(1.0, max(self.params.min_duty, duty))
        self.breaches_at_floor = 0
        self.last = None  # a cut made beside other training is no decision about this duty

    def reset(self) -> None:
        """Training left the GPU (or the loop was switched off): nothing to throttle any
        more, and no decision made before holds (its duty is not the one in force)."""
        self.duty = 1.0
        self.breaches_at_floor = 0
        self.last = None
