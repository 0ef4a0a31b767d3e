"""The policies compared: ``fair``, the baselines under each of their readings, ``leveller``.

* ``fair``: one level, per-flow max-min -- what TCP or DCQCN sharing gives.
* ``sincronia``: Sincronia's Bottleneck-Select-Scale-Iterate (BSSI) order over the coflows
  present -- a job's current communication phase is a coflow, its remaining bytes the
  demand -- re-ordered when a coflow arrives or completes and on every tick. Ties go to
  the older coflow (earlier arrival first, then the job's start, then its id). Jobs with
  no coflow in flight hold no level slot: they wait at the lowest level, and their next
  coflow re-orders at once.
* ``crux``: Crux's priority ``k_j x I_j``: GPU intensity ``I_j`` -- compute work per
  iteration (``gpus x compute_s``) over the job's time on its bottleneck link -- times a
  per-job correction factor ``k_j``, the share of the job's communication that is exposed
  (not hidden under compute) when it runs alone, ``(T* - compute_s) / comm_s`` floored at
  0.05. Jobs with no traffic come last. Besides the generic compressions it has its own,
  ``aware`` (:func:`contention_aware_levels`).
* ``cassini``: fair sharing, with CASSINI-style time shifts that interleave the
  communication phases of jobs sharing links (:mod:`tools.netsim.cassini`); two readings:
  ``cassini`` paces only groups that fit taking turns, ``cassini-loose`` any group the
  shifts help at all.
* ``leveller``: :mod:`netshaper` itself, fed iteration reports at every tick, exactly as
  the daemon feeds it, with gpud's defaults (near-equal jobs share a level:
  ``traffic.group_tolerance``) unless the scenario sets its knobs.

Every policy that sets levels runs on gpud's HTB tree, where each job has its own leaf under
its level: a level's bandwidth is shared per job (``Decision.per_job``), equally for the
baselines, by demand for ``leveller`` (gpud's ``traffic.weigh_by_demand``: the bytes a job
sends per iteration over its ``T*``, which the daemon measures and the simulator knows).
``fair`` and ``cassini`` use no tree: the kernel's default qdisc, per-flow sharing.

A baseline's order becomes levels in more than one way, and the result depends on it. So
each order-based baseline runs under every *reading*: compression ``even`` (contiguous
near-equal buckets, :func:`netshaper.rank_levels`, what LEVELLER does), ``top`` (the first
K-1 in order each alone on a level, the rest sharing the lowest) and, for Crux, ``aware``;
each with the per-level minimum shares of :class:`netshaper.LevellerConfig`'s defaults (HTB
guaranteed rates, as LEVELLER runs) or ``strict`` (pure strict priority, as designed).
Reading names are ``FAMILY-COMPRESSION[-strict]``; the suite compares LEVELLER with the best
reading of each scenario.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from gpud.config import TrafficConfig
from netshaper import Leveller, LevellerConfig, ProgressTracker, rank_levels
from netshaper.progress import ProgressConfig
from netshaper.weights import demand_weights
from tools.netsim.cassini import LOOSE_LEFT, LOOSE_STRETCH, plan_shifts
from tools.netsim.engine import Decision, Policy, View

COMPRESSIONS: dict[str, tuple[str, ...]] = {
    "sincronia": ("even", "top"),
    "crux": ("even", "top", "aware"),
}


def readings(family: str) -> tuple[str, ...]:
    """Every reading of an order-based baseline, e.g. ``crux-aware-strict``."""
    return tuple(
        f"{family}-{c}{suffix}" for c in COMPRESSIONS[family] for suffix in ("", "-strict")
    )


BASELINES: dict[str, tuple[str, ...]] = {
    "sincronia": readings("sincronia"),
    "crux": readings("crux"),
    "cassini": ("cassini", "cassini-loose"),
}
POLICY_NAMES = ("fair", "sincronia", "crux", "cassini", "leveller")
READING_NAMES = tuple(r for family in BASELINES.values() for r in family)

CRUX_MIN_CORRECTION = 0.05


def expand(names: Sequence[str]) -> list[str]:
    """Family names replaced by all their readings, duplicates dropped, order kept."""
    out: list[str] = []
    for name in names:
        for n in BASELINES.get(name, (name,)):
            if n not in out:
                out.append(n)
    return out


def family_of(name: str) -> str:
    """``crux-top-strict`` -> ``crux``; ``fair`` -> ``fair``."""
    for family, names in BASELINES.items():
        if name in names:
            return family
    return name


def top_levels(ordered: Sequence[str], levels: int) -> dict[str, int]:
    """The first ``levels - 1`` jobs each alone on a level, all others on the lowest."""
    return {j: min(rank, levels - 1) for rank, j in enumerate(ordered)}


def contention_aware_levels(
    ordered: Sequence[str],
    links: Mapping[str, frozenset[str]],
    priority: Mapping[str, float],
    levels: int,
) -> dict[str, int]:
    """Crux's compression: only jobs that share a link need different levels.

    Lay the order out as layers -- a job goes one layer below the lowest higher-priority
    job it shares a link with, so jobs that never meet share layers freely -- and, when
    there are more layers than levels, merge contiguous layers into ``levels`` groups so
    that the sum over contending pairs left on one level of ``|ln P_i - ln P_j|`` is least
    (dynamic programming over the layers). Inversions between contending jobs never arise;
    only ties do, between the jobs whose priorities differ least.
    """
    layer: dict[str, int] = {}
    for idx, j in enumerate(ordered):
        depth = 0
        for i in ordered[:idx]:
            if links[i] & links[j]:
                depth = max(depth, layer[i] + 1)
        layer[j] = depth
    depth_count = max(layer.values(), default=-1) + 1
    if depth_count <= levels:
        return layer
    # pair[lo][hi]: cost of contending pairs whose layers are lo <= hi.
    pair = [[0.0] * depth_count for _ in range(depth_count)]
    for a, i in enumerate(ordered):
        for j in ordered[a + 1 :]:
            if links[i] & links[j]:
                lo, hi = sorted((layer[i], layer[j]))
                gap = abs(math.log((priority[i] + 1e-12) / (priority[j] + 1e-12)))
                pair[lo][hi] += gap + 1e-3
    # cost[a][b]: pairs with both layers in [a, b].
    cost = [[0.0] * depth_count for _ in range(depth_count)]
    for a in range(depth_count):
        run = 0.0
        for b in range(a, depth_count):
            run += sum(pair[lo][b] for lo in range(a, b + 1))
            cost[a][b] = run
    inf = math.inf
    # best[k][b]: layers 0..b in k+1 groups; cut[k][b]: first layer of the last group.
    best = [[inf] * depth_count for _ in range(levels)]
    cut = [[0] * depth_count for _ in range(levels)]
    for b in range(depth_count):
        best[0][b] = cost[0][b]
    for k in range(1, levels):
        for b in range(k, depth_count):
            for a in range(k, b + 1):
                c = best[k - 1][a - 1] + cost[a][b]
                if c < best[k][b] - 1e-12:
                    best[k][b], cut[k][b] = c, a
    group_of = [0] * depth_count
    b, k = depth_count - 1, levels - 1
    while k >= 0:
        a = cut[k][b] if k else 0
        for x in range(a, b + 1):
            group_of[x] = k
        b, k = a - 1, k - 1
    return {j: group_of[layer[j]] for j in ordered}


def _shares(view: View, strict: bool) -> tuple[float, ...]:
    return () if strict else LevellerConfig(levels=view.levels).shares()


def _compress(ordered: Sequence[str], levels: int, compression: str) -> dict[str, int]:
    if compression == "top":
        return top_levels(ordered, levels)
    return rank_levels(ordered, levels)


class FairPolicy:
    """Everyone at level 0."""

    name = "fair"
    reorder_on_coflows = False

    def decide(self, now: float, view: View) -> Decision:
        return Decision(levels=dict.fromkeys(view.active_jobs(), 0))


def crux_priority(view: View, job_id: str) -> float:
    """``k_j x gpus x compute_s / bottleneck seconds`` (0 for a job with no traffic)."""
    info = view.info(job_id)
    busiest = max(info.link_seconds.values(), default=0.0)
    if busiest <= 0:
        return 0.0
    exposed = 1.0
    if info.comm_ideal_s > 0:
        exposed = (info.ideal_s - info.spec.compute_s) / info.comm_ideal_s
    k = min(1.0, max(CRUX_MIN_CORRECTION, exposed))
    return k * info.spec.gpus * info.spec.compute_s / busiest


class CruxPolicy:
    """Highest corrected GPU intensity first (ties by job id); static per membership."""

    reorder_on_coflows = False

    def __init__(self, compression: str = "even", *, strict: bool = False) -> None:
        if compression not in COMPRESSIONS["crux"]:
            raise ValueError(f"unknown compression {compression!r}")
        self.name = f"crux-{compression}" + ("-strict" if strict else "")
        self._compression = compression
        self._strict = strict
        self._members: tuple[str, ...] | None = None
        self._levels: dict[str, int] = {}

    def decide(self, now: float, view: View) -> Decision:
        jobs = tuple(view.active_jobs())
        if jobs != self._members:
            self._members = jobs
            prio = {j: crux_priority(view, j) for j in jobs}
            # Jobs with no traffic need no priority: they go last.
            order = sorted(jobs, key=lambda j: (prio[j] <= 0, -prio[j], j))
            if self._compression == "aware":
                links = {j: frozenset(view.info(j).link_bytes) for j in jobs}
                self._levels = contention_aware_levels(order, links, prio, view.levels)
            else:
                self._levels = _compress(order, view.levels, self._compression)
        return Decision(levels=self._levels, shares=_shares(view, self._strict), per_job=True)


class SincroniaPolicy:
    """BSSI over the coflows in flight, re-ordered on coflow arrivals and completions."""

    reorder_on_coflows = True

    def __init__(self, compression: str = "even", *, strict: bool = False) -> None:
        if compression not in COMPRESSIONS["sincronia"]:
            raise ValueError(f"unknown compression {compression!r}")
        self.name = f"sincronia-{compression}" + ("-strict" if strict else "")
        self._compression = compression
        self._strict = strict

    def decide(self, now: float, view: View) -> Decision:
        jobs = view.active_jobs()
        since = {j: view.coflow_since(j) for j in jobs}
        arrival = {j: (s, view.info(j).spec.start_s) for j, s in since.items() if s is not None}
        demand = {j: view.remaining_link_seconds(j) for j in arrival}
        levels = _compress(bssi_order(demand, arrival), view.levels, self._compression)
        lowest = view.levels - 1
        for j in jobs:
            levels.setdefault(j, lowest)
        return Decision(levels=levels, shares=_shares(view, self._strict), per_job=True)


def bssi_order(
    demand: Mapping[str, Mapping[str, float]],
    arrival: Mapping[str, tuple[float, ...]] | None = None,
) -> list[str]:
    """Sincronia's BSSI: an order of coflows (first = highest priority), unit weights.

    ``demand[job][link]``: the coflow's load on the link (seconds at full capacity);
    ``arrival[job]``: when it arrived (any comparable tuple). Ties go to the older coflow
    (the newer one is placed last), then to the smaller id.
    """
    ages = arrival or {}
    # age_rank: 0 for the oldest; the newest has the largest and is placed last on ties.
    by_age = sorted(demand, key=lambda j: (ages.get(j, ()), j))
    age_rank = {j: i for i, j in enumerate(by_age)}
    unscheduled = set(demand)
    weight = dict.fromkeys(demand, 1.0)
    load: dict[str, float] = {}
    users: dict[str, list[str]] = {}
    for j in by_age:
        for link, d in demand[j].items():
            if d > 0:
                load[link] = load.get(link, 0.0) + d
                users.setdefault(link, []).append(j)
    reverse: list[str] = []
    while unscheduled:
        live = [(v, link) for link, v in load.items() if v > 1e-15]
        if not live:
            # Nothing left to send: the rest oldest first, ahead of what is placed.
            reverse.extend(sorted(unscheduled, key=lambda j: -age_rank[j]))
            break
        bottleneck = max(live, key=lambda x: (x[0], x[1]))[1]
        last = ""
        best: tuple[float, int] | None = None
        for j in users[bottleneck]:
            if j in unscheduled:
                key = (weight[j] / demand[j][bottleneck], -age_rank[j])
                if best is None or key < best:
                    best, last = key, j
        reverse.append(last)
        unscheduled.discard(last)
        for link, d in demand[last].items():
            if d > 0:
                load[link] -= d
        d_last = demand[last][bottleneck]
        w_last = weight[last]
        for j in users[bottleneck]:
            if j in unscheduled:
                weight[j] -= w_last * demand[j][bottleneck] / d_last
    return list(reversed(reverse))


class CassiniPolicy:
    """One level; time shifts re-planned whenever jobs come or go. ``loose``: pace any
    group the shifts help at all, stretching periods up to 30%."""

    reorder_on_coflows = False

    def __init__(self, *, loose: bool = False) -> None:
        self.name = "cassini-loose" if loose else "cassini"
        self._loose = loose
        self._members: tuple[str, ...] | None = None
        self._pace: dict[str, tuple[float, float]] = {}

    def decide(self, now: float, view: View) -> Decision:
        jobs = tuple(view.active_jobs())
        if jobs != self._members:
            self._members = jobs
            infos = {j: view.info(j) for j in jobs}
            links = {link for info in infos.values() for link in info.link_bytes}
            capacity = {link: view.link_capacity(link) for link in links}
            if self._loose:
                self._pace = plan_shifts(
                    now, infos, capacity, max_stretch=LOOSE_STRETCH, max_left=LOOSE_LEFT
                )
            else:
                self._pace = plan_shifts(now, infos, capacity)
        return Decision(levels=dict.fromkeys(jobs, 0), pace=self._pace)


class LevellerPolicy:
    """netshaper's ProgressTracker + Leveller, fed like the daemon feeds them."""

    name = "leveller"
    reorder_on_coflows = False

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
            knobs = dict(view.leveller_knobs())
            knobs.setdefault("group_tolerance", TrafficConfig().group_tolerance)
            window = knobs.pop("progress_window_s", None)
            weight = knobs.pop("progress_long_weight", None)
            config = self._config or LevellerConfig(levels=view.levels, **knobs)
            progress = self._progress
            if progress is None and (window or weight is not None):
                # a zero or absent window keeps netshaper's, as a scenario without it does
                defaults = ProgressConfig()
                progress = ProgressConfig(
                    window_s=window or defaults.window_s,
                    long_weight=defaults.long_weight if weight is None else weight,
                )
            self._leveller = Leveller(config)
            self._tracker = ProgressTracker(progress)
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
        weights: dict[str, float] = {}
        if TrafficConfig().weigh_by_demand:
            # what the daemon measures: the bytes a job sends per iteration, over T*
            weights = demand_weights(
                {
                    j: sum(f.bytes * f.count for f in view.info(j).spec.flows)
                    / view.info(j).ideal_s
                    for j in active
                }
            )
        return Decision(
            levels=assignment.levels, shares=assignment.shares, per_job=True, weights=weights
        )


def _reading_factory(name: str) -> Callable[[], Policy] | None:
    family, _, rest = name.partition("-")
    strict = rest.endswith("-strict")
    compression = rest.removesuffix("-strict")
    if family == "sincronia" and compression in COMPRESSIONS["sincronia"]:
        return lambda: SincroniaPolicy(compression, strict=strict)
    if family == "crux" and compression in COMPRESSIONS["crux"]:
        return lambda: CruxPolicy(compression, strict=strict)
    return None


def make_policy(name: str) -> Policy:
    """A fresh policy object by reading name (each run needs its own state)."""
    factories: dict[str, Callable[[], Policy]] = {
        "fair": FairPolicy,
        "cassini": CassiniPolicy,
        "cassini-loose": lambda: CassiniPolicy(loose=True),
        "leveller": LevellerPolicy,
    }
    factory = factories.get(name) or _reading_factory(name)
    if factory is None:
        names = ", ".join(("fair", "leveller", *READING_NAMES))
        raise ValueError(f"unknown policy {name!r}; choose from {names}")
    return factory()
