"""The policies compared: ``fair``, ``sincronia``, ``crux`` and ``leveller``.

* ``fair``: one level, per-flow max-min -- what TCP or DCQCN sharing gives.
* ``sincronia``: Sincronia's Bottleneck-Select-Scale-Iterate (BSSI) order over each job's
  remaining bytes of the current iteration (a job is a coflow), recomputed every tick:
  repeatedly take the most loaded link, put last the job with the most bytes there per
  unit of (scaled) weight, scale the others' weights. Compressed to K levels.
* ``crux``: GPU intensity -- compute work per iteration (``gpus * compute_s``) over the
  job's time on its bottleneck link -- highest first. Compressed to K levels.
* ``leveller``: :mod:`netshaper` itself, fed iteration reports at every tick, exactly as
  the daemon feeds it.

All multi-level policies run on the same enforcement: strict priority between levels, with
the per-level minimum shares of :class:`netshaper.LevellerConfig`'s defaults (HTB
guaranteed rates), so the comparison is between orders, not between enforcement models.
``sincronia-strict`` and ``crux-strict`` run the baselines as designed, with no minimum
shares (a starved job then makes no progress at all). Every policy compresses its order
into levels with :func:`netshaper.rank_levels` (contiguous, near-equal buckets).
"""

from __future__ import annotations

from collections.abc import Callable

from netshaper import Leveller, LevellerConfig, ProgressTracker, rank_levels
from netshaper.progress import ProgressConfig
from tools.netsim.engine import Decision, Policy, View

POLICY_NAMES = ("fair", "sincronia", "crux", "leveller")
EXTRA_POLICY_NAMES = ("sincronia-strict", "crux-strict")


def _shares(view: View, strict: bool) -> tuple[float, ...]:
    return () if strict else LevellerConfig(levels=view.levels).shares()


class FairPolicy:
    """Everyone at level 0."""

    name = "fair"

    def decide(self, now: float, view: View) -> Decision:
        return Decision(levels=dict.fromkeys(view.active_jobs(), 0))


class CruxPolicy:
    """Highest GPU intensity first (ties by job id)."""

    def __init__(self, *, strict: bool = False) -> None:
        self.name = "crux-strict" if strict else "crux"
        self._strict = strict

    def decide(self, now: float, view: View) -> Decision:
        def key(job_id: str) -> tuple[float, str]:
            info = view.info(job_id)
            busiest = max(info.link_seconds.values(), default=0.0)
            work = info.spec.gpus * info.spec.compute_s
            intensity = work / busiest if busiest > 0 else float("inf")
            return (-intensity, job_id)

        order = sorted(view.active_jobs(), key=key)
        return Decision(levels=rank_levels(order, view.levels), shares=_shares(view, self._strict))


class SincroniaPolicy:
    """BSSI ordering of the jobs' remaining bytes, re-ordered every tick."""

    def __init__(self, *, strict: bool = False) -> None:
        self.name = "sincronia-strict" if strict else "sincronia"
        self._strict = strict

    def decide(self, now: float, view: View) -> Decision:
        jobs = view.active_jobs()
        demand = {j: view.remaining_link_seconds(j) for j in jobs}
        return Decision(
            levels=rank_levels(bssi_order(demand), view.levels), shares=_shares(view, self._strict)
        )


def bssi_order(demand: dict[str, dict[str, float]]) -> list[str]:
    """Sincronia's BSSI: an order of coflows (first = highest priority), unit weights.

    ``demand[job][link]``: the job's load on the link (seconds at full capacity).
    Deterministic: ties go to the lexicographically larger id being placed last.
    """
    unscheduled = sorted(demand)
    weight = dict.fromkeys(unscheduled, 1.0)
    reverse: list[str] = []
    while unscheduled:
        load: dict[str, float] = {}
        for j in unscheduled:
            for link, d in demand[j].items():
                load[link] = load.get(link, 0.0) + d
        if not load or max(load.values()) <= 0:
            # Nothing left to send: the rest keep id order, ahead of what is placed.
            reverse.extend(reversed(unscheduled))
            break
        bottleneck = max(sorted(load), key=lambda link: load[link])
        on_b = [j for j in unscheduled if demand[j].get(bottleneck, 0.0) > 0]
        last = min(on_b, key=lambda j: (weight[j] / demand[j][bottleneck], _neg(j)))
        reverse.append(last)
        unscheduled.remove(last)
        d_last = demand[last][bottleneck]
        for j in unscheduled:
            weight[j] -= weight[last] * demand[j].get(bottleneck, 0.0) / d_last
    return list(reversed(reverse))


def _neg(job_id: str) -> tuple[int, ...]:
    """Sort key that orders ids descending."""
    return tuple(-ord(c) for c in job_id)


class LevellerPolicy:
    """netshaper's ProgressTracker + Leveller, fed like the daemon feeds them."""

    name = "leveller"

    def __init__(
        self, config: LevellerConfig | None = None, progress: ProgressConfig | None = None
    ) -> None:
        self._config = config
        self._progress = progress
        self._tracker: ProgressTracker | None = None
        self._leveller: Leveller | None = None
        self._known: set[str] = set()

    def decide(self, now: float, view: View) -> Decision:
        if self._leveller is None or self._tracker is None:
            self._leveller = Leveller(self._config or LevellerConfig(levels=view.levels))
            self._tracker = ProgressTracker(self._progress)
        tracker = self._tracker
        active = view.active_jobs()
        for gone in self._known - set(active):
            tracker.forget(gone)
        for job_id in active:
            if job_id not in self._known:
                info = view.info(job_id)
                declared = info.ideal_s if info.spec.declare_ideal else None
                tracker.register(job_id, now=view.report(job_id)[1], ideal_s=declared)
            count, at = view.report(job_id)
            tracker.report(job_id, count, at)
        self._known = set(active)
        assignment = self._leveller.update(now, tracker.rates(now, active))
        return Decision(levels=assignment.levels, shares=assignment.shares)


def make_policy(name: str) -> Policy:
    """A fresh policy object by name (each run needs its own state)."""
    factories: dict[str, Callable[[], Policy]] = {
        "fair": FairPolicy,
        "sincronia": SincroniaPolicy,
        "crux": CruxPolicy,
        "leveller": LevellerPolicy,
        "sincronia-strict": lambda: SincroniaPolicy(strict=True),
        "crux-strict": lambda: CruxPolicy(strict=True),
    }
    try:
        return factories[name]()
    except KeyError:
        names = ", ".join(POLICY_NAMES + EXTRA_POLICY_NAMES)
        raise ValueError(f"unknown policy {name!r}; choose from {names}") from None
