"""What a MIG apply or reconcile reports, per GPU and in all, and the counters behind
``gpud_mig_apply_total`` and ``gpud_mig_apply_duration_seconds``."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from gpud.histogram import Histogram, HistogramCounts

# Apply outcomes, the ``result`` label of ``gpud_mig_apply_total``. ``partial``: the healthy
# GPUs were applied, a faulty one (lost, not answering) was left alone. ``not_started``: its
# client had gone (or gpud was stopping) before it could start: it waited behind a
# reconcile, or drained, waiting for processes to leave; or it was refused because another
# apply was in flight; nothing was changed.
# ``busy``: refused, processes run on what it would destroy (counted when an apply raises
# Busy; a dry run that foresees a refusal answers so, and is not counted).
RESULTS = (
    "success",
    "noop",
    "reset_pending",
    "partial",
    "invalid",
    "busy",
    "failed",
    "not_started",
    "resumed",  # an apply interrupted by a crash, finished by the next start
)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass(frozen=True, slots=True)
class GpuOutcome:
    gpu: int
    uuid: str
    steps: tuple[str, ...]  # what was done (or would be done, for a dry run)
    reset_pending: bool
    # "ok", "changed", "reset_pending", "busy", "differs", "failed", "missing", "faulty"
    status: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ApplyResult:
    config_name: str
    result: str  # one of RESULTS
    gpus: tuple[GpuOutcome, ...]
    duration_s: float
    dry_run: bool = False


@dataclass
class ApplyStats:
    """Counters behind ``gpud_mig_apply_total`` and ``gpud_mig_apply_duration_seconds``."""

    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESULTS, 0))
    durations: Histogram = field(default_factory=lambda: Histogram(DURATION_BUCKETS))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, result: str, duration_s: float) -> None:
        with self.lock:
            self.totals[result] = self.totals.get(result, 0) + 1
            self.durations.observe(duration_s)

    def snapshot(self) -> tuple[dict[str, int], HistogramCounts]:
        with self.lock:
            return dict(self.totals), self.durations.counts()
