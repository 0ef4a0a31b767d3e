"""Per-class view of the node: packing (``k_eff``, binding dimension), history statistics
and the M/G/k quote, for every request class seen in the history or the queue."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from gpud.admission.estimate import ClassStats, Estimate, Record
from gpud.admission.model import (
    NEVER_READ,
    Demand,
    FitCheck,
    Request,
    Unfeasible,
    serving_devices,
)
from gpud.admission.packing import Packing, pack
from gpud.admission.quote import (
    ClassModel,
    ClassQuote,
    PackingEfficiency,
    class_quotes,
    packing_efficiency,
)


@dataclass(frozen=True, slots=True)
class ClassView:
    key: str
    request: Request
    demand: Demand | Unfeasible
    packing: Packing | None  # None when unfeasible
    stats: ClassStats | None  # None: not in the history window
    quote: ClassQuote | None  # None: unfeasible, never waits, or nothing known loads its pool
    # the GPUs of its pool that serve no job now (lost, hung, held by a MIG apply, never
    # read), as ``down`` of :meth:`ClassViews.at` names them: ``packing`` counts the others
    left_out: str = ""
    # the devices of its pool that serve it now (``packing``'s): all of ``demand``'s but
    # those on the GPUs ``left_out`` names; empty when unfeasible
    serving: frozenset[str] = frozenset()


def class_views(
    fit: FitCheck,
    requests: Mapping[str, Request],
    records: Sequence[Record],
    *,
    now: float,
    window_s: float | None = None,
    down: Mapping[int, str] | None = None,
) -> dict[str, ClassView]:
    """``requests`` maps class keys (as in the records) to their request; ``down``: as
    :meth:`ClassViews.at` takes it."""
    return ClassViews(records, now=now, window_s=window_s).at(fit, requests, now=now, down=down)


class ClassViews:
    """:func:`class_views` over the records of one window, asked again as the time moves on
    (the queue's listings and every scrape ask each second): the statistics and the sweeps
    of the packing efficiency that do not move with the time are made once for these
    records. ``now`` given here chooses the records as :func:`class_views` does; asking
    at another time gives what :func:`class_views` gives at that time for the same records
    (as long as no record enters or leaves the window in between, or :meth:`change` is told
    of it)."""

    def __init__(
        self, records: Sequence[Record], *, now: float, window_s: float | None = None
    ) -> None:
        since = -math.inf if window_s is None else now - window_s
        self._window_s = window_s
        in_window = [r for r in records if r.queued_at >= since]
        self._estimate = Estimate([r for r in in_window if r.queued_at <= now])
        # each class's records in their order; None where one left (its place is its rank
        # in the sweeps: the others keep theirs)
        self._by_class: dict[str, list[Record | None]] = {}
        self._where: dict[int, int] = {}  # id() of each record -> its index in its class
        for r in in_window:
            rs = self._by_class.setdefault(r.request_class, [])
            self._where[id(r)] = len(rs)
            rs.append(r)
        self._live = {key: len(rs) for key, rs in self._by_class.items()}  # not left
        self._gone = 0  # places left None
        self._head: dict[str, int] = {}  # no record of its class before it is left
        # made at the first change (views made afresh each time need neither): the window's
        # records by queued time, ties in their order (the first leaves first), and the
        # place of each in their order (by id())
        self._given: list[Record] | None = in_window
        self._order: list[tuple[float, int, Record]] = []
        self._seq: dict[int, int] = {}
        self._count = len(in_window)
        self._left = 0  # records that left since (a record added comes after every place)
        # a record that has not started (none from the history): efficiency made afresh
        self._unstarted = any(r.started_at is None for r in in_window)
        # changes are taken in (:meth:`change`) only where the window holds every record
        # the estimate does (none queued after ``now``, a clock stepped back)
        self._changeable = not self._unstarted and all(r.queued_at <= now for r in in_window)
        # the pool's efficiency sweeps, by the classes on it and their shares
        self._sweeps: dict[tuple[tuple[str, float], ...], PackingEfficiency] = {}

    def __len__(self) -> int:
        """The records in the window."""
        return self._count

    def classes(self) -> list[str]:
        """The classes of the records in the window, in the order their first records come
        (the order of the classes made afresh from them)."""
        self._ordered()
        firsts = []
        for key, rs in self._by_class.items():
            head = self._head.get(key, 0)
            while rs[head] is None:  # records leave oldest first, mostly: kept for the next
                head += 1
            self._head[key] = head
            firsts.append((self._seq[id(rs[head])], key))
        return [key for _, key in sorted(firsts)]

    def change(self, changes: Sequence[tuple[Record | None, Record | None]], *, now: float) -> bool:
        """Take in records added after the others (``(None, record)``, oldest first),
        records changed in place (``(old, new)``: a run that ended) and records removed
        (``(old, None)``: pruned), and let the records queued before the window's start at
        ``now`` leave, as made afresh from the records with these changes at ``now`` would be
        (the same figures): each costs its class's run times and the sweeps' events since
        it (one that leaves, the sweeps' events from the window's start), not the window.
        False (the views are left unusable: make them afresh) where they cannot: a record
        is not from the history (not started, or queued after ``now``), a clock stepped
        back past one, or as many records have left as remain (made afresh, the places they
        left are given back). The caller sees to it that no record it does not give entered
        the window (a clock stepped back: the window then holds fewer than the history
        says, :meth:`__len__`)."""
        since = -math.inf if self._window_s is None else now - self._window_s
        if not self._changeable:
            return False
        self._ordered()
        if self._order and self._order[-1][0] > now:
            return False
        cut = bisect.bisect_left(self._order, since, key=_queued)
        for _, _, r in self._order[:cut]:
            self._leave(r)
        del self._order[:cut]
        for old, new in changes:
            if new is None:
                assert old is not None
                if not self._remove(old, since):
                    self._changeable = False
                    return False
                continue
            if new.started_at is None or new.queued_at > now:
                self._changeable = False
                return False
            if old is None:
                if new.queued_at < since:
                    continue  # before the window: made afresh, it would not hold it
                rs = self._by_class.setdefault(new.request_class, [])
                index = len(rs)
                rs.append(new)
                self._live[new.request_class] = self._live.get(new.request_class, 0) + 1
                seq = self._seq[id(new)] = len(self._seq) + self._left
                self._count += 1
                bisect.insort(self._order, (new.queued_at, seq, new), key=_ordered)
            else:
                found = self._where.pop(id(old), None)
                if found is None:
                    if old.queued_at < since:
                        continue  # before the window
                    self._changeable = False  # not a record these views were given
                    return False
                if (old.request_class, old.queued_at) != (new.request_class, new.queued_at):
                    self._changeable = False
                    return False
                index, seq = found, self._seq.pop(id(old))
                self._by_class[new.request_class][index] = new
                at = bisect.bisect_left(self._order, (old.queued_at, seq), key=_ordered)
                self._order[at] = (new.queued_at, seq, new)
                self._seq[id(new)] = seq
            self._where[id(new)] = index
            self._estimate.change(old, new, index)
            self._resweep(old, new, index)
        if self._gone > self._count:
            self._changeable = False  # made afresh, the places left None are given back
            return False
        self._estimate.open(self._order[0][2] if self._order else None)
        return True

    def _ordered(self) -> None:
        if self._given is not None:
            self._order = [(r.queued_at, seq, r) for seq, r in enumerate(self._given)]
            self._order.sort()  # by time, then place: a Record is never compared
            self._seq = {id(r): seq for _, seq, r in self._order}
            self._given = None

    def _remove(self, old: Record, since: float) -> bool:
        """``old`` pruned: it leaves (False where it is not a record these views hold, nor
        one from before the window)."""
        if id(old) not in self._where:
            return old.queued_at < since  # before the window, or left it already
        at = bisect.bisect_left(self._order, (old.queued_at, self._seq[id(old)]), key=_ordered)
        del self._order[at]
        self._leave(old)
        return True

    def _leave(self, r: Record) -> None:
        """``r`` leaves (its place in ``_order`` is the caller's)."""
        index = self._where.pop(id(r))
        del self._seq[id(r)]
        self._left += 1
        self._count -= 1
        key = r.request_class
        self._by_class[key][index] = None
        self._live[key] -= 1
        self._gone += 1
        if not self._live[key]:  # made afresh, its next record would be its first
            del self._live[key]
            self._head.pop(key, None)
            self._gone -= len(self._by_class.pop(key))
        self._estimate.remove(r, index)
        self._resweep(r, None, index)

    def _resweep(self, old: Record | None, new: Record | None, index: int) -> None:
        """The sweeps of the pools ``old`` (then ``new``) is on, with ``new`` in its place."""
        r = new if new is not None else old
        assert r is not None
        for sharing, sweep in self._sweeps.items():
            for rank, (key, share) in enumerate(sharing):
                if key == r.request_class:
                    if old is not None:
                        sweep.remove(_job(old, share), (rank, index))
                    if new is not None:
                        sweep.add(_job(new, share), (rank, index))

    def at(
        self,
        fit: FitCheck,
        requests: Mapping[str, Request],
        *,
        now: float,
        down: Mapping[int, str] | None = None,
    ) -> dict[str, ClassView]:
        """``down``: GPU index -> how to name it (``GPU 0 unhealthy: GPU lost``), of each GPU
        no job is placed on now (:meth:`~gpud.jobs.service.JobService.unhealthy`): it serves
        no class while it does not answer, so each class is packed (``k_eff``) and modelled
        on the devices of its pool on the others alone, and names those it left out."""
        devices = {d.uuid: d for d in fit.devices()}
        stats = self._estimate.at(now)
        demands = {key: fit.demand(r) for key, r in requests.items()}
        serving: dict[str, Demand] = {}
        left_out: dict[str, str] = {}
        for key, d in demands.items():
            if isinstance(d, Demand):
                serving[key], left_out[key] = _serving(d, fit, down or {})
        # a pool with fewer devices that answer than a run of its class takes serves none of
        # its class now, whatever it asks: pack() would sum one device's copies as if the
        # run's other devices were found on it
        packings = {
            key: pack(d, devices) if len(d.pool) >= d.count else Packing(0, {}, None, len(d.pool))
            for key, d in serving.items()
        }
        models = []
        unseen = []  # no run in the window: quoted from the load of the others on its pool
        for key, p in packings.items():
            s = stats.get(key)
            d = serving[key]
            if not p.k_eff:
                continue
            if s is not None and s.mean_service_s is not None:
                models.append(
                    ClassModel(
                        key,
                        s.arrival_rate,
                        s.mean_service_s,
                        s.scv_service,
                        p.k_eff,
                        frozenset(d.pool),
                        runs=s.completions,
                    )
                )
            else:
                unseen.append(ClassModel(key, 0.0, 0.0, 1.0, p.k_eff, frozenset(d.pool)))
        models = self._with_efficiency(models, now=now)
        unseen = self._with_efficiency(unseen, now=now, among=models)
        quotes = class_quotes(models, horizon_s=self._window_s, unseen=unseen)
        return {
            key: ClassView(
                key,
                r,
                demands[key],
                packings.get(key),
                stats.get(key),
                quotes.get(key),
                left_out.get(key, ""),
                frozenset(serving[key].pool) if key in serving else frozenset(),
            )
            for key, r in sorted(requests.items())
        }

    def _with_efficiency(
        self,
        models: Sequence[ClassModel],
        *,
        now: float,
        among: Sequence[ClassModel] | None = None,
    ) -> list[ClassModel]:
        """Each model with the packing efficiency of its pool, from the records in the
        window of the classes on it (``among``: of these, for classes with no record)."""
        out = []
        # made once per distinct pool: many classes on few pools (a sweep's memory sizes,
        # each its own class) cost classes x pools, not classes squared
        by_pool: dict[frozenset[str], float] = {}
        for c in models:
            efficiency = by_pool.get(c.pool)
            if efficiency is None:
                efficiency = by_pool[c.pool] = self._efficiency(
                    c.pool, models if among is None else among, now=now
                )
            out.append(replace(c, efficiency=efficiency))
        return out

    def _efficiency(
        self, pool: frozenset[str], classes: Sequence[ClassModel], *, now: float
    ) -> float:
        """The packing efficiency of ``pool`` from the records in the window of the
        ``classes`` on it."""
        sharing = tuple(
            (j.key, len(j.pool & pool) / (j.k_eff * len(pool))) for j in classes if j.pool & pool
        )
        sweep = self._sweeps.get(sharing)
        if sweep is None:
            jobs = [
                (r.queued_at, r.started_at, r.ended_at, share)
                for key, share in sharing
                for r in self._by_class.get(key, ())
                if r is not None
            ]
            if self._unstarted:  # not from the history: asked afresh
                return packing_efficiency(jobs, now=now)
            ranks = [
                (rank, index)
                for rank, (key, _) in enumerate(sharing)
                for index, r in enumerate(self._by_class.get(key, ()))
                if r is not None
            ]
            # every one started (not self._unstarted)
            sweep = self._sweeps[sharing] = PackingEfficiency(jobs, ranks)  # type: ignore[arg-type]
        return sweep.at(now)


def _serving(demand: Demand, fit: FitCheck, down: Mapping[int, str]) -> tuple[Demand, str]:
    """``demand`` on the devices of its pool that answer now (:func:`serving_devices`), and
    how the GPUs it left out are named (``down``'s words; a GPU never read, that ``down``
    does not name, as such)."""
    if not down and "" not in demand.pool:
        return demand, ""
    devices = fit.devices()
    kept, gone = serving_devices(
        demand.pool,
        {d.uuid: d.gpu for d in devices if d.uuid},
        {d.gpu for d in devices if not d.uuid},
        down.keys(),
    )
    if len(kept) == len(demand.pool):
        return demand, ""
    serving = replace(
        demand,
        pool=kept,
        by_device=tuple((u, v) for u, v in demand.by_device if u in kept),
    )
    return serving, "; ".join(down.get(g, f"GPU {g} {NEVER_READ}") for g in sorted(gone))


def _queued(entry: tuple[float, int, Record]) -> float:
    return entry[0]


def _ordered(entry: tuple[float, int, Record]) -> tuple[float, int]:
    return entry[0], entry[1]


def _job(r: Record, share: float) -> tuple[float, float, float | None, float]:
    """``r`` as a job of a packing efficiency's sweep (started: see ClassViews.change)."""
    assert r.started_at is not None
    return (r.queued_at, r.started_at, r.ended_at, share)
