"""LEVELLER: the slowest jobs get the highest network priority, lazily, over K levels.

Input: each job's normalized progress rate (``netshaper.progress``), ``None`` where not
known yet. Output: a :class:`LevelAssignment` -- job -> level (0 is the highest priority)
and level -> minimum share of every link -- that the enforcement layer turns into HTB
classes (TCP) and a DSCP -> priority map (RDMA).

Ranking is greedy: sort by rate (ties by job id, so the result is deterministic), then cut
the order into ``min(K, n)`` contiguous buckets of near-equal size; the slowest bucket gets
level 0. With more jobs than levels, neighbours in rate share a level and, inside it, the
link's max-min sharing.

Near-equal jobs share a level (``group_tolerance`` > 0): walking the order from the
slowest, a job joins the group of the job before it while its rate is within the
tolerance (relative) of that group's slowest rate, or equals the previous job's rate; each
group takes one level, slowest group on level 0 (with more groups than levels, neighbouring
groups merge, cut where the job-count buckets would cut). Inside a level every job keeps
its own HTB leaf (quanta by demand, ``netshaper.weights``), so the kernel shares the group
*per job* instead of rotating strict priorities among jobs that are equally behind. It is
off by default: jobs of equal demand sharing a level tend to stay in step, where strict
levels stagger their communication phases. Groups have hysteresis too: jobs that were
one group stay together while within ``(1 + group_tolerance)(1 + hysteresis)`` of the
group's slowest, so a group does not split and merge as rates jitter. That is the only
hysteresis with grouping on: two jobs that cross in rate meet inside the tolerance, where
they share a level, before they trade places, so the swaps below are not needed (and
would split equal jobs).

Updates are lazy, because every change is a netlink or NIC-map write and, worse, a change
of who is preempted:

* re-rank only when a job's rate moved more than ``threshold`` (relative) from the rate it
  had at the last re-rank, when jobs come or go, when overrides change, or when
  ``max_age_s`` has passed;
* on a re-rank (without grouping), a job keeps its previous level while its rate stays
  within the fresh bucket's rate range widened by ``hysteresis`` (relative), so a job near
  a bucket edge does not flap; it keeps it by swapping with a job that fits the level it
  leaves, so levels keep their fresh sizes (never two jobs on one level while levels are
  free).

Guarantees (tested as properties): whenever job ``a`` sits at a strictly lower priority
than job ``b``, ``r_a >= r_b * (1-h) / (1+h)`` right after a re-rank and
``r_a >= r_b * (1-h)(1-t) / ((1+h)(1+t))`` at any time in between (``h`` hysteresis, ``t``
threshold); the output depends only on the inputs. With grouping on, right after a
re-rank the slowest group (every job within the tolerance of the slowest) is on level 0,
jobs with equal rates share a level, and stationary rates change no level.

No starvation: each level keeps ``min_share`` of every link (HTB's guaranteed ``rate``),
whatever the order; only the rest is handed out by strict priority.

Operator overrides: :meth:`Leveller.pin` fixes a job's level; :meth:`Leveller.exclude`
leaves a job out of the assignment (the enforcement layer keeps it in the default class).

A new policy object can take over levels already in force (:meth:`Leveller.seed`, say
from a previous cluster leader): its first re-rank treats them as the previous levels, so
the rules above keep each job where it is while its rate fits, instead of re-breaking ties
by job id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MAX_LEVELS = 8  # what commodity NICs and switches offer (802.1p / PFC priorities)
MIN_LEVELS = 2


@dataclass(frozen=True)
class LevellerConfig:
    """Knobs of the policy; see the module docstring for what each one buys.

    ``min_share`` is either one fraction for every level or one per level (length
    ``levels``); the fractions must sum to at most 1. ``unknown_rate`` is the rate assumed
    for a job with no estimate yet: 0 puts newcomers at the top until they have one, which
    also lets a job that learns its contention-free time learn it under good conditions.
    """

    levels: int = MAX_LEVELS
    threshold: float = 0.1
    max_age_s: float = 10.0
    hysteresis: float = 0.02
    min_share: float | tuple[float, ...] = 0.02
    unknown_rate: float = 0.0
    group_tolerance: float = 0.0

    def __post_init__(self) -> None:
        if not MIN_LEVELS <= self.levels <= MAX_LEVELS:
            raise ValueError(f"levels must be in [{MIN_LEVELS}, {MAX_LEVELS}], got {self.levels}")
        if not self.threshold >= 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        if not self.max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0, got {self.max_age_s}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis must be in [0, 1), got {self.hysteresis}")
        if not 0 <= self.group_tolerance <= 1:
            raise ValueError(f"group_tolerance must be in [0, 1], got {self.group_tolerance}")
        if not 0 <= self.unknown_rate <= 1:
            raise ValueError(f"unknown_rate must be in [0, 1], got {self.unknown_rate}")
        shares = self.shares()
        if any(s < 0 for s in shares) or sum(shares) > 1 + 1e-9:
            raise ValueError(f"min_share must be >= 0 and sum to <= 1, got {shares}")

    def shares(self) -> tuple[float, ...]:
        """Minimum share of each link per level, index = level."""
        if isinstance(self.min_share, tuple):
            if len(self.min_share) != self.levels:
                raise ValueError(
                    f"min_share has {len(self.min_share)} entries for {self.levels} levels"
                )
            return self.min_share
        return (float(self.min_share),) * self.levels


@dataclass(frozen=True)
class LevelAssignment:
    """One decision of the policy.

    ``levels``: job -> level, 0 = highest priority (excluded jobs are absent).
    ``shares``: level -> minimum fraction of every link that level keeps.
    ``rates``: the rates the decision used (unknown ones replaced by ``unknown_rate``).
    ``changes``: jobs that were already assigned and now have a different level.
    ``reranked``: whether this update re-ranked or kept the previous order.
    """

    at: float
    levels: Mapping[str, int]
    shares: tuple[float, ...]
    rates: Mapping[str, float]
    changes: int
    reranked: bool
    excluded: frozenset[str] = field(default_factory=frozenset)


class Leveller:
    """The stateful, deterministic policy. Call :meth:`update` once per tick."""

    def __init__(self, config: LevellerConfig | None = None) -> None:
        self._config = config or LevellerConfig()
        self._shares = self._config.shares()
        self._pins: dict[str, int] = {}
        self._excluded: set[str] = set()
        self._overrides_changed = False
        self._levels: dict[str, int] = {}
        self._group_of: dict[str, str] = {}  # job -> first job of its group, last re-rank
        self._seeded_groups: dict[str, str] = {}  # one reading of seed()'s, until a re-rank
        self._ref_rates: dict[str, float] = {}
        self._last_rerank: float | None = None
        self._total_changes = 0
        self._last: LevelAssignment | None = None

    @property
    def config(self) -> LevellerConfig:
        return self._config

    @property
    def total_changes(self) -> int:
        """Level changes over the lifetime of this policy object."""
        return self._total_changes

    @property
    def last(self) -> LevelAssignment | None:
        return self._last

    def groups(self) -> dict[str, str]:
        """job -> the first (slowest) job of its group at the last re-rank (grouping on)."""
        return dict(self._group_of)

    def pin(self, job_id: str, level: int) -> None:
        """Keep ``job_id`` at ``level`` whatever its rate, until :meth:`unpin`."""
        if not 0 <= level < self._config.levels:
            raise ValueError(f"{job_id}: level must be in [0, {self._config.levels}), got {level}")
        if self._pins.get(job_id) != level:
            self._pins[job_id] = level
            self._overrides_changed = True

    def unpin(self, job_id: str) -> None:
        if self._pins.pop(job_id, None) is not None:
            self._overrides_changed = True

    def exclude(self, job_id: str) -> None:
        """Leave ``job_id`` out of every assignment, until :meth:`include`."""
        if job_id not in self._excluded:
            self._excluded.add(job_id)
            self._overrides_changed = True

    def include(self, job_id: str) -> None:
        if job_id in self._excluded:
            self._excluded.discard(job_id)
            self._overrides_changed = True

    def pins(self) -> dict[str, int]:
        return dict(sorted(self._pins.items()))

    def excluded(self) -> frozenset[str]:
        return frozenset(self._excluded)

    def seed(self, levels: Mapping[str, int]) -> None:
        """Take ``levels`` (job -> level) as the levels in force; before the first update.

        The first re-rank then treats them as the previous levels: a job keeps its seeded
        level while its rate fits it (hysteresis), so jobs of equal or unknown rates keep
        theirs, and :attr:`LevelAssignment.changes` counts moves away from them. With
        grouping on, the group hysteresis takes the jobs seeded on one level as one
        previous group, or none as a group, whichever moves fewer of them. Jobs absent
        from ``levels`` are ranked as newcomers; seeded jobs absent from the first update
        are forgotten. Raises ``ValueError`` for a level outside ``[0, levels)`` and
        ``RuntimeError`` once :meth:`update` has run.
        """
        if self._last is not None:
            raise RuntimeError("seed() must come before the first update()")
        k = self._config.levels
        for job, level in levels.items():
            if not 0 <= level < k:
                raise ValueError(f"{job}: level must be in [0, {k}), got {level}")
        self._levels = dict(levels)
        # one reading of the seed's groups: every seeded level one group (named by its
        # first job by id); the first re-rank weighs it against no groups at all
        first: dict[int, str] = {}
        for job in sorted(levels):
            first.setdefault(levels[job], job)
        self._seeded_groups = {job: first[level] for job, level in levels.items()}

    def update(self, now: float, rates: Mapping[str, float | None]) -> LevelAssignment:
        """Decide levels for the jobs in ``rates`` (the jobs present now) at ``now``."""
        cfg = self._config
        excluded = frozenset(j for j in rates if j in self._excluded)
        unknown = _clamp(cfg.unknown_rate)
        eff: dict[str, float] = {}  # by job id, which _rerank relies on
        for j in sorted(rates):
            if j in excluded:
                continue
            r = rates[j]
            # a rate already inside (0, 1) is its own clamp: skip the two calls
            eff[j] = unknown if r is None else r if 0.0 < r < 1.0 else _clamp(r)
        if self._needs_rerank(now, eff):
            if self._seeded_groups and self._config.group_tolerance > 0:
                new_levels = self._rerank_seeded(eff)
            else:
                new_levels = self._rerank(eff)
            self._seeded_groups = {}
            self._ref_rates = dict(eff)
            self._last_rerank = now
            self._overrides_changed = False
            reranked = True
        else:
            new_levels = {j: self._levels[j] for j in eff}
            reranked = False
        old = self._levels
        changes = sum(1 for j, lv in new_levels.items() if lv != old.get(j, lv))
        self._total_changes += changes
        self._levels = new_levels
        self._last = LevelAssignment(
            at=now,
            levels=dict(new_levels),
            shares=self._shares,
            rates=eff,
            changes=changes,
            reranked=reranked,
            excluded=excluded,
        )
        return self._last

    def _rerank_seeded(self, eff: Mapping[str, float]) -> dict[str, int]:
        """The first re-rank after a seed, with grouping on.

        Levels do not say which level-mates were one group (held together by the group
        hysteresis) and which shared a level only for want of levels, and either reading
        alone can move a job the other keeps: re-rank under both -- each seeded level one
        group, or no groups -- and keep the one that moves fewer jobs off their seeded
        levels (the first, on a tie).
        """
        previous = self._levels
        self._group_of = dict(self._seeded_groups)
        joined = self._rerank(eff)
        joined_groups = self._group_of
        self._group_of = {}
        apart = self._rerank(eff)

        def moved(levels: Mapping[str, int]) -> int:
            return sum(1 for j, lv in levels.items() if lv != previous.get(j, lv))

        if moved(joined) <= moved(apart):
            self._group_of = joined_groups
            return joined
        return apart

    def _needs_rerank(self, now: float, eff: Mapping[str, float]) -> bool:
        if self._last_rerank is None or self._overrides_changed:
            return True
        if eff.keys() != self._levels.keys():
            return True
        if now - self._last_rerank >= self._config.max_age_s:
            return True
        t = self._config.threshold
        for j, r in eff.items():
            ref = self._ref_rates[j]
            if abs(r - ref) > t * ref:
                return True
        return False

    def _rerank(self, eff: Mapping[str, float]) -> dict[str, int]:
        """Levels by job id; ``eff`` must come by job id (as :meth:`update` builds it)."""
        levels: dict[str, int] = {j: lv for j, lv in self._pins.items() if j in eff}
        # by (rate, job id): a stable sort by rate alone of jobs that come by job id
        # (comparing floats only is several times cheaper than comparing tuples)
        free = eff if not levels else [j for j in eff if j not in levels]
        order = sorted(free, key=eff.__getitem__)
        cfg = self._config
        if cfg.group_tolerance > 0:
            # groups carry their own hysteresis, and jobs that cross in rate meet inside
            # the tolerance (where they share a level) before they trade places: no swaps
            groups = near_groups(
                order,
                eff,
                cfg.group_tolerance,
                hysteresis=cfg.hysteresis,
                previous=self._group_of,
            )
            self._group_of = {j: g[0] for g in groups for j in g}
            levels.update(levels_of_groups(groups, cfg.levels))
            return {j: levels[j] for j in eff}
        fresh = rank_levels(order, cfg.levels)
        # each fresh level is a contiguous run of ``order``: its rates span its first job's
        # to its last job's
        n = len(order)
        used = min(cfg.levels, n)
        lo: dict[int, float] = {}
        hi: dict[int, float] = {}
        for lv in range(used):
            lo[lv] = eff[order[-(-lv * n // used)]]
            hi[lv] = eff[order[-(-(lv + 1) * n // used) - 1]]
        h = self._config.hysteresis
        rate = eff  # of the jobs in ``order`` (pinned ones never move)
        place = dict(fresh)

        def fits(r: float, lv: int) -> bool:
            return lv in lo and lo[lv] * (1 - h) <= r <= hi[lv] * (1 + h)

        # A job keeps its previous level while its rate fits that level's fresh range
        # (widened by h). Levels keep their fresh sizes: a job that keeps a level it was not
        # freshly given swaps with a job there that fits the level it leaves, so no level
        # doubles up (with n <= K, two jobs never share a level). Every job ends within h
        # of its level's range, which is what bounds inversions.
        previous = self._levels
        settled: set[str] = set()
        movers: list[tuple[int, float, str, int]] = []
        for j in order:
            prev = previous.get(j)
            lv = fresh[j]
            if prev == lv:
                settled.add(j)
            elif prev is not None and fits(rate[j], prev):
                movers.append((abs(prev - lv), rate[j], j, prev))
        movers.sort()
        for _, r, j, prev in movers:
            if j in settled:
                continue
            here = place[j]
            partners = [
                x
                for x, lv in place.items()
                if lv == prev and x not in settled and fits(rate[x], here)
            ]
            if partners:
                x = min(partners, key=lambda x: (abs(rate[x] - r), x))
                place[j], place[x] = prev, here
                settled.add(j)
                if self._levels.get(x) == here:
                    settled.add(x)
        levels.update(place)
        return {j: levels[j] for j in eff}  # every job of eff has a level, by job id


def rank_levels(ordered: Sequence[str], levels: int) -> dict[str, int]:
    """Compress an order (highest priority first) into ``levels`` contiguous buckets.

    With ``n <= levels`` jobs each gets its own level 0..n-1; otherwise bucket ``k`` holds
    ranks ``[k*n/levels, (k+1)*n/levels)``, so bucket sizes differ by at most one. The
    baselines in the simulator compress their orders the same way.
    """
    n = len(ordered)
    used = min(levels, n)
    return {j: (rank * used) // n for rank, j in enumerate(ordered)}


def group_levels(
    ordered: Sequence[str],
    rates: Mapping[str, float],
    levels: int,
    tolerance: float,
    *,
    hysteresis: float = 0.0,
    previous: Mapping[str, str] | None = None,
) -> dict[str, int]:
    """Near-equal neighbours of an order (slowest first) on one level each group.

    Groups are :func:`near_groups`'. Group ``i`` gets level ``i`` while groups fit in
    ``levels``; with more groups, a group starts a new level where :func:`rank_levels`
    would start one at its first job, or where the levels left are just enough for the
    groups left, so ``min(levels, groups)`` levels are used and every level is a
    contiguous run.
    """
    return levels_of_groups(
        near_groups(ordered, rates, tolerance, hysteresis=hysteresis, previous=previous), levels
    )


def near_groups(
    ordered: Sequence[str],
    rates: Mapping[str, float],
    tolerance: float,
    *,
    hysteresis: float = 0.0,
    previous: Mapping[str, str] | None = None,
) -> list[list[str]]:
    """Cut an order (slowest first) into groups of near-equal rates.

    A job joins the group before it when its rate equals the previous job's, is at most
    ``(1 + tolerance)`` times the group's first (slowest) rate, or -- when ``previous``
    (job -> the first job of its group at the last cut) puts it in one group with that
    first job -- at most ``(1 + tolerance)(1 + hysteresis)`` times it.
    """
    prev = previous or {}
    groups: list[list[str]] = []
    anchor = last = 0.0
    for j in ordered:
        r = rates[j]
        if groups:
            first = groups[-1][0]
            limit = anchor * (1 + tolerance)
            p = prev.get(j)
            if p is not None and p == prev.get(first):
                limit *= 1 + hysteresis
            if r == last or r <= limit:
                groups[-1].append(j)
                last = r
                continue
        groups.append([j])
        anchor = last = r
    return groups


def levels_of_groups(groups: Sequence[Sequence[str]], levels: int) -> dict[str, int]:
    """Levels for groups in order (see :func:`group_levels`)."""
    n, g = sum(len(x) for x in groups), len(groups)
    used = min(levels, n)
    out: dict[str, int] = {}
    level = 0
    rank = 0
    for i, group in enumerate(groups):
        if i:
            by_rank = (rank * used) // n
            if by_rank > level or g - i <= levels - 1 - level:
                level += 1
        for j in group:
            out[j] = level
        rank += len(group)
    return out


def _clamp(rate: float) -> float:
    return min(1.0, max(0.0, rate))
