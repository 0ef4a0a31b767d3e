"""Wait-time quotes: each request class is an M/G/k queue (arXiv 2607.28223).

A class's servers are its ``k_eff`` (:mod:`gpud.admission.packing`). The classes that share
devices with it load those servers too: a job of class ``j`` occupies ``1/k_j`` of its own
pool, so it takes ``|pool_j & pool_c| / (k_j |pool_c|)`` of class ``c``'s pool, and the
utilisation ``c`` sees is ``rho_c = sum_j lambda_j E[S_j] |pool_j & pool_c| / (k_j |pool_c|)``.
Seen in units of class-``c`` servers, the offered load is ``a = rho_c k_c`` and the service
time that frees a server is the capacity-weighted mixture of the sharing classes' service
times (mean ``S``, squared coefficient of variation ``cs2``). The quote is the Allen-Cunneen
approximation of the M/G/k mean wait,

    W_c = C(k_c, a) * S / (k_c - a) * f(k_c, rho, cs2)

with ``C`` the Erlang-C probability of waiting (Poisson arrivals: ``ca2 = 1``), so
``C * S / (k - a)`` is the M/M/k wait, and ``f`` the service-variability factor
(:func:`variability_factor`). For ``cs2 >= 1`` it is Allen-Cunneen's ``(1 + cs2) / 2``:
exact for one server (Pollaczek-Khinchine) and in heavy traffic, above the M/G/k wait in
light traffic. For ``cs2 < 1`` Allen-Cunneen under-estimates with few servers at moderate
load, and plain Erlang C (``f = 1``) quotes such pools up to twice their wait; the factor
there interpolates linearly in ``rho`` (Burman and Smith's light/heavy-traffic
interpolation) between the two limits the theory gives:

- heavy traffic (``rho -> 1``): ``(1 + cs2) / 2``;
- light traffic (``rho -> 0``): a rare arrival that waits finds ``k`` busy servers and waits
  for the first to free, the least of ``k`` residual service times: ``S / (k + 1)`` for
  deterministic service against ``S / k`` for exponential, so ``k / (k + 1)``, and
  ``1 - (1 - cs2) / (k + 1)`` interpolating linearly in ``cs2`` (above the exact value for
  gamma service times, so conservative).

Both limits are ``(1 + cs2) / 2`` for one server: M/G/1 stays exact.
``rho_c >= 1``: the queue grows without bound and the quote is infinite.

Servers that free up in pieces. When requests of different sizes share devices, FIFO leaves
capacity idle while a large job waits for enough of it: the pool does less work than ``k``
servers would. The *packing efficiency* ``eta`` (:func:`packing_efficiency`) is the share of
the pool's capacity busy while jobs wait for it, from the history (1 for a pool of one size:
whenever someone waits, every server is busy). The quote uses ``rho / eta``: the load against
the capacity the pool really puts to work.

Estimated, not known. The load comes from ``n`` ended runs of the classes on the pool; its
relative standard error is about ``sigma = sqrt((1 + cs2) / n)`` (arrival count and service
times both vary). By the delta method the wait's log then has standard error
``e * sigma``, ``e = d ln W / d ln rho`` the wait's elasticity in the load, which depends on
the servers and the load (``1 / (1 - rho)`` for one server; Erlang C's own rise adds to it
with more). The quote is the one-sided 95 % upper confidence bound,
``W (1 + 1.645 e sigma)``: a short history gives a cautious quote, a long one a tight one.
(Taking the load itself ``z`` standard errors up instead compounds the curvature of
``1 / (1 - rho)``: with two servers at 0.9 one standard error already added 26 %.)

Why the quote is not short. Three things could make it so, and each is dealt with apart:

- *The model.* It is exact for one server (Pollaczek-Khinchine) and for exponential service
  (Erlang C). Otherwise no formula in two moments is exact for M/G/k (the mean wait over
  service distributions with the same two moments spans a range: Gupta, Harchol-Balter,
  Dai and Zwart, "On the inapproximability of M/G/K", 2010), but ``(1 + cs2) / 2`` is the
  heavy-traffic limit, exact as ``rho -> 1`` for any ``k``, and lies above the wait in
  light traffic (for ``cs2 < 1`` the interpolation above sees to it). Long simulations of
  M/G/k FIFO queues with gamma service (``python -m tools.admission reference``: 2 to 7
  servers, ``cs2`` 0.25 to 4) put the formula at or above the exact mean wait at every load
  (at it, within the simulation's precision, where Erlang C is exact), most above it in
  light traffic and within a few per cent near saturation, where it meets the limit it is
  exact in. The model error shrinks as the load grows, so a margin that grew with the
  load (its elasticity) would add a constant nobody derived.
- *The estimate.* The load comes from a finite history: the confidence bound above.
- *The history.* The rate is arrivals over the span they came in. Near saturation the wait
  is so steep in the load that a small error there is a large one in the quote: at 0.95 a
  history whose span also counted its queue draining after the last arrival (1.5 % more
  time) made the quotes 30 % short.

Considered and not used: proven upper bounds for multi-server queues (Kingman's and
Brumelle's for GI/G/k, or the GI/M/1 queue that bounds GI/M/k stochastically) hold for any
service distribution but are of the order of one fast server's wait, several times the
M/M/k wait at moderate load (M/M/1 with five times the service rate waits 3.8 times as long
as M/M/5 at 0.5): they break the "within 2x" a useful quote needs, and blending one in by
load takes a weight no theory gives. Whitt's and Kimura's system interpolations bring the
estimate closer to the exact wait, from above or below, with no sign guarantee.

Classes whose devices overlap wait in one FIFO order (backfill lets a job by only where it
cannot delay the head, which is rare when sizes share devices), so a class is quoted no less
than any class it shares devices with: a small job queued behind a large one waits for it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class ClassModel:
    key: str
    arrival_rate: float
    mean_service_s: float
    scv_service: float
    k_eff: int
    pool: frozenset[str]
    efficiency: float = 1.0  # packing efficiency of the pool, (0, 1]
    runs: int = 0  # ended runs the service moments come from


@dataclass(frozen=True, slots=True)
class ClassQuote:
    key: str
    wait_s: float  # mean wait; inf when the class's pool is overloaded
    rho: float  # offered utilisation of its pool
    servers: int
    mean_service_s: float  # of the mixture that frees this class's servers
    scv_service: float
    efficiency: float = 1.0


MIN_EFFICIENCY = 0.05
CONFIDENCE_Z = 1.645  # one-sided 95 % upper confidence bound, in standard errors


def packing_efficiency(
    jobs: Sequence[tuple[float, float | None, float | None, float]], *, now: float
) -> float:
    """Share of a pool's capacity in use while some job waits for it.

    ``jobs``: ``(queued_at, started_at, ended_at, share)`` of each job of the classes on the
    pool, ``share`` its fraction of the pool's capacity; ``None``: not yet (counted to
    ``now``). 1 when nobody waited."""
    events: list[_Event] = []
    for queued, started, ended, share in jobs:
        begin = now if started is None else started
        if begin > queued:
            events.append((queued, len(events), 0, 0.0, 1))
            events.append((begin, len(events), 0, 0.0, -1))
        if started is not None:
            events.append((started, len(events), 0, share, 0))
            events.append((now if ended is None else ended, len(events), 0, -share, 0))
    events.sort(key=_time)
    return _Sweep().run(events).efficiency()


# (time, order, step, capacity change, waiting change): ``order``, the event's place in the
# list made, which the stable sort by time keeps among the events of one time (in
# :class:`PackingEfficiency`: its job's rank, one tuple shared by the job's events, then
# ``step``, its place among them: a tuple of its own per event cost half the sweep's memory
# at admission.history_keep runs)
_Event = tuple[float, Any, int, float, int]


def _time(e: _Event) -> float:
    return e[0]


class _Sweep:
    """:func:`packing_efficiency`'s pass over the events in time order, where it stands."""

    __slots__ = ("busy", "last", "used", "waiters", "waiting")

    def __init__(self) -> None:
        self.busy = self.waiting = 0.0
        self.used = 0.0
        self.waiters = 0
        # the first event's time: nobody waits before it, so no span before it counts
        self.last = 0.0

    def copy(self) -> _Sweep:
        out = _Sweep()
        out.busy, out.waiting, out.used = self.busy, self.waiting, self.used
        out.waiters, out.last = self.waiters, self.last
        return out

    def run(self, events: Iterable[_Event]) -> _Sweep:
        busy, waiting, used, waiters, last = (
            self.busy,
            self.waiting,
            self.used,
            self.waiters,
            self.last,
        )
        for t, _, _, d_use, d_wait in events:
            if waiters > 0 and t > last:
                busy += used * (t - last)
                waiting += t - last
            last = t
            used += d_use
            waiters += d_wait
        self.busy, self.waiting, self.used, self.waiters, self.last = (
            busy,
            waiting,
            used,
            waiters,
            last,
        )
        return self

    def efficiency(self) -> float:
        return min(self.busy / self.waiting, 1.0) if self.waiting > 0 else 1.0


# a job's place among the jobs of a sweep (their order), and of an event in the sweep
Rank = tuple[int, ...]
MARK_EVERY = 1024  # events swept between two marks a change may sweep again from


def _place(e: _Event) -> tuple[float, Rank, int]:
    return (e[0], e[1], e[2])


class PackingEfficiency:
    """:func:`packing_efficiency` of jobs that have all started, asked again and again as
    ``now`` moves on: the events before ``now`` that do not move with it are swept once
    (and from where the last answer stood), so an answer costs the runs still running and
    the events since, not the history. The same sums in the same order: the same figure.

    A job added or changed (:meth:`add`, :meth:`remove`: a run started, a run that ended)
    puts its events where a sweep made afresh would have them (``rank``: where the job
    stands among the jobs, as their order in ``jobs``, every rank of one length: the ties of
    one time are taken in that order) and sweeps again from the last mark before the first
    of them (one is kept every :data:`MARK_EVERY` events swept), not from the first event."""

    def __init__(
        self,
        jobs: Sequence[tuple[float, float, float | None, float]],
        ranks: Sequence[Rank] | None = None,
        *,
        mark_every: int = MARK_EVERY,
    ) -> None:
        self._mark_every = mark_every
        self._fixed: list[_Event] = []  # all but the ends of the runs still running
        self._running: dict[Rank, float] = {}  # rank -> capacity change at its end (``now``)
        self._freed: dict[float, float] = {}  # share -> -share
        # the length every rank has (None: no job yet): a longer rank sorts after a shorter
        # one it begins with, so mixed lengths would order ties unlike a fresh sweep
        self._rank_len: int | None = None
        if jobs:
            self._rank_len = 1 if ranks is None else len(ranks[0])
        for i, job in enumerate(jobs):
            for event in self._events(job, (i,) if ranks is None else ranks[i]):
                self._fixed.append(event)
        self._fixed.sort(key=_time)  # stable: the ties of one time in the jobs' order
        self._done = 0  # the events swept: those before ``self._until``
        self._until = -math.inf
        self._sweep = _Sweep()
        self._marks: list[_Sweep] = []  # where the sweep stood after each MARK_EVERY events

    def _events(self, job: tuple[float, float, float | None, float], rank: Rank) -> list[_Event]:
        """The job's fixed events; a run still running is kept in ``_running`` instead."""
        queued, started, ended, share = job
        out: list[_Event] = []
        if started > queued:
            out.append((queued, rank, 0, 0.0, 1))
            out.append((started, rank, 1, 0.0, -1))
        out.append((started, rank, 2, share, 0))
        # the few shares of the classes, each negated once: not a float per run
        freed = self._freed.setdefault(share, -share)
        if ended is None:
            self._running[rank] = freed
        else:
            out.append((ended, rank, 3, freed, 0))
        return out

    def add(self, job: tuple[float, float, float | None, float], rank: Rank) -> None:
        """A job the sweep made afresh would have at ``rank``, as long as every rank."""
        if self._rank_len is None:
            self._rank_len = len(rank)
        elif len(rank) != self._rank_len:
            raise ValueError(
                f"rank {rank} has {len(rank)} parts, the sweep's ranks {self._rank_len}"
            )
        for event in self._events(job, rank):
            at = bisect.bisect_right(self._fixed, _place(event), key=_place)
            self._fixed.insert(at, event)
            self._back_to(at)

    def remove(self, job: tuple[float, float, float | None, float], rank: Rank) -> None:
        """The job :meth:`add` (or ``jobs``) gave at ``rank``, as given."""
        for event in self._events(job, rank):
            at = bisect.bisect_left(self._fixed, _place(event), key=_place)
            if at == len(self._fixed) or self._fixed[at] != event:
                raise ValueError(f"no job {job} at {rank} to remove")
            del self._fixed[at]
            self._back_to(at)
        self._running.pop(rank, None)

    def _back_to(self, index: int) -> None:
        """Events from ``index`` on changed: the sweep goes back to the last mark before."""
        if index >= self._done:
            return
        kept = index // self._mark_every
        del self._marks[kept:]
        self._done = kept * self._mark_every
        self._sweep = self._marks[-1].copy() if self._marks else _Sweep()
        self._until = (
            math.nextafter(self._fixed[self._done - 1][0], math.inf) if self._done else -math.inf
        )

    def at(self, now: float) -> float:
        if now < self._until:  # the clock stepped back: sweep again from the start
            self._done, self._sweep, self._marks = 0, _Sweep(), []
        fixed, done = self._fixed, self._done
        end = bisect.bisect_left(fixed, now, lo=done, key=_time)
        while done < end:
            step = min(end, (done // self._mark_every + 1) * self._mark_every)
            self._sweep.run(fixed[done:step])
            done = step
            if done % self._mark_every == 0:
                self._marks.append(self._sweep.copy())
        self._done, self._until = end, now
        rest = fixed[end:] + [(now, rank, 3, change, 0) for rank, change in self._running.items()]
        rest.sort(key=_place)
        return self._sweep.copy().run(rest).efficiency()


_NEGLIGIBLE = 1e-15  # a waiting probability below this is taken as it stands


def erlang_c(k: int, a: float) -> float:
    """Probability that an arrival waits in M/M/k with offered load ``a`` (< k) Erlangs."""
    if k <= 0:
        return 1.0
    if a <= 0:
        return 0.0
    if a >= k:
        return 1.0
    b = 1.0  # Erlang B by its stable recursion
    for i in range(1, k + 1):
        b = a * b / (i + a * b)
        # past i = a each step shrinks b, so k b / (k - a) bounds the answer from here on:
        # a small request on a big node (k in the millions, a few Erlangs) stops here
        # rather than stepping to k. 0, not the bound: a higher load, whose b is larger at
        # every step, stops no earlier, so the answer stays monotone in the load.
        if i > a and k * b < _NEGLIGIBLE * (k - a):
            return 0.0
    return k * b / (k - a * (1.0 - b))


def variability_factor(k: int, rho: float, scv: float) -> float:
    """M/G/k mean wait over M/M/k's, for service times of squared CV ``scv`` at per-server
    utilisation ``rho``: Allen-Cunneen's ``(1 + scv) / 2`` from ``scv = 1`` up; below it,
    linear in ``rho`` from the light-traffic limit ``1 - (1 - scv) / (k + 1)`` to that."""
    heavy = (1.0 + scv) / 2.0
    if scv >= 1.0:
        return heavy
    rho = min(max(rho, 0.0), 1.0)
    light = 1.0 - (1.0 - scv) / (max(k, 1) + 1)
    return rho * heavy + (1.0 - rho) * light


def mgk_wait(k: int, a: float, mean_s: float, scv: float) -> float:
    """Mean wait of M/G/k (Poisson arrivals) with offered load ``a`` Erlangs: the M/M/k wait
    times :func:`variability_factor`."""
    if a >= k:
        return math.inf
    return erlang_c(k, a) * mean_s / (k - a) * variability_factor(k, a / k, max(scv, 0.0))


def upper_wait(k: int, rho: float, mean_s: float, scv: float, spread: float) -> float:
    """The M/G/k mean wait at per-server load ``rho``, raised to its one-sided upper
    confidence bound when ``rho`` is known only to a relative standard error ``spread``:
    by the delta method, ``ln W`` has standard error ``e * spread``, ``e = d ln W / d ln rho``
    (taken numerically: it depends on ``k``, ``rho`` and, through Erlang C, grows like
    ``1 / (1 - rho)``)."""
    wait = mgk_wait(k, rho * k, mean_s, scv)
    if math.isinf(wait) or wait <= 0 or spread <= 0:
        return wait
    step = min(1e-4, (1.0 - rho) / 2)
    up = mgk_wait(k, rho * (1 + step) * k, mean_s, scv)
    down = mgk_wait(k, rho * (1 - step) * k, mean_s, scv)
    elasticity = (math.log(up) - math.log(down)) / (2 * step) if down > 0 else 0.0
    return wait * (1.0 + CONFIDENCE_Z * elasticity * spread)


def class_quotes(
    classes: Sequence[ClassModel],
    *,
    horizon_s: float | None = None,
    unseen: Sequence[ClassModel] = (),
) -> dict[str, ClassQuote]:
    """Each class's quote. A mean wait longer than ``horizon_s`` (the history the model is
    fitted from) is no quote but an overload: at a load within rounding of 1 the M/G/k wait
    is finite only in arithmetic (a pool that is saturated flips between an infinite wait
    and 10^17 s), and nothing measured supports a wait longer than what was watched.

    ``unseen``: classes no run of which is in the history (a request queued for the first
    time), on their own packing (``k_eff``, pool, packing efficiency). Such a class's own
    arrival rate is unknown, and its run times are not what it waits for: it is quoted the
    wait of its servers under the load the ``classes`` put on its pool (its own taken as
    none), and no less than any of them it shares devices with, as they wait in one FIFO
    order. A class whose pool none of ``classes`` loads gets no quote (nothing is known of
    what frees its devices); it raises no other class's quote (at no rate it is never
    ahead of them in the model)."""
    # what loads a pool, and the longest wait of the classes sharing one, made once per
    # distinct pool: a history of many classes on few pools (a sweep's memory sizes, each
    # its own class) costs classes x pools, not classes squared
    loads: dict[frozenset[str], _PoolLoad | None] = {}
    out: dict[str, ClassQuote] = {}
    for c in classes:
        out[c.key] = _class_quote(c, classes, horizon_s, loads) or ClassQuote(
            c.key, 0.0, 0.0, c.k_eff, c.mean_service_s, c.scv_service
        )
    by_key = {c.key: c for c in classes}
    longest: dict[frozenset[str], float] = {}
    for key, q in out.items():
        pool = by_key[key].pool
        longest[pool] = max(longest.get(pool, q.wait_s), q.wait_s)
    shared: dict[frozenset[str], float] = {}
    quotes = {}
    for key, q in out.items():
        pool = by_key[key].pool
        if pool not in shared:
            shared[pool] = max(w for other, w in longest.items() if other & pool)
        quotes[key] = replace(q, wait_s=shared[pool])
    for c in unseen:
        if c.key in quotes or (own := _class_quote(c, classes, horizon_s, loads)) is None:
            continue
        sharing = [quotes[j.key].wait_s for j in classes if j.pool & c.pool]
        quotes[c.key] = replace(own, wait_s=max([own.wait_s, *sharing]))
    return quotes


@dataclass(frozen=True, slots=True)
class _PoolLoad:
    """What ``classes`` put on one pool: utilisation, runs, and their service mixture."""

    rho: float
    runs: int
    mean: float
    scv: float


def _pool_load(pool: frozenset[str], classes: Sequence[ClassModel]) -> _PoolLoad | None:
    weights: list[tuple[float, ClassModel]] = []
    rho = 0.0
    runs = 0
    for j in classes:
        overlap = len(j.pool & pool)
        if not overlap or j.k_eff <= 0:
            continue
        share = overlap / (j.k_eff * len(pool))
        rho += j.arrival_rate * j.mean_service_s * share
        weights.append((j.arrival_rate * share, j))
        runs += j.runs
    total = sum(w for w, _ in weights)
    if total <= 0:
        return None
    mean = sum(w * j.mean_service_s for w, j in weights) / total
    second = sum(w * j.mean_service_s**2 * (1 + j.scv_service) for w, j in weights) / total
    scv = max(second / mean**2 - 1.0, 0.0) if mean > 0 else 0.0
    return _PoolLoad(rho, runs, mean, scv)


def _class_quote(
    c: ClassModel,
    classes: Sequence[ClassModel],
    horizon_s: float | None,
    loads: dict[frozenset[str], _PoolLoad | None],
) -> ClassQuote | None:
    """``c``'s wait under the load ``classes`` put on its pool, before the FIFO order's
    maximum (:func:`class_quotes`); None where none of them loads it. ``loads``: each
    pool's load, made at its first class."""
    if c.pool not in loads:
        loads[c.pool] = _pool_load(c.pool, classes)
    load = loads[c.pool]
    if load is None:
        return None
    rho, runs, mean, scv = load.rho, load.runs, load.mean, load.scv
    eta = min(max(c.efficiency, MIN_EFFICIENCY), 1.0)
    spread = min(math.sqrt((1.0 + scv) / max(runs, 1)), 1.0)
    wait = upper_wait(c.k_eff, rho / eta, mean, scv, spread)
    if horizon_s is not None and wait > horizon_s:
        wait = math.inf
    return ClassQuote(c.key, wait, rho, c.k_eff, mean, scv, eta)


@dataclass(frozen=True, slots=True)
class Running:
    """A run holding devices a queued job needs: how long it has run, and the mean run
    time of its class (None: no run of its class has ended in the window, so none is
    known)."""

    job: str
    ran_s: float
    estimate_s: float | None


def overdue(running: Sequence[Running]) -> tuple[Running, ...]:
    """The runs a queued job waits on, where every one has run past its estimated run
    time: the model's figure then rests on run times these runs already disprove, and no
    wait is knowable. Empty where any of them (or none at all) is still within its
    estimate, or has none."""
    if not running or any(r.estimate_s is None or r.ran_s < r.estimate_s for r in running):
        return ()
    return tuple(running)


def job_quote(
    quote: ClassQuote, *, ahead: int, waited_s: float, running: Sequence[Running] = ()
) -> float:
    """What a queued job is told: its class's mean wait less what it has waited, and never
    less than the time for ``ahead + 1`` server releases (``ahead`` jobs before it in
    pools it shares), nor than what the runs holding its devices (``running``) are expected
    to run still until ``ahead + 1`` of them have ended (a long run of another class is
    not hidden behind the pool's mean)."""
    if math.isinf(quote.wait_s):
        return math.inf
    by_position = (ahead + 1) * quote.mean_service_s / max(quote.servers, 1)
    left = sorted(max(r.estimate_s - r.ran_s, 0.0) for r in running if r.estimate_s is not None)
    by_running = left[ahead] if len(left) > ahead and len(left) == len(running) else 0.0
    return max(quote.wait_s - waited_s, by_position, by_running)
