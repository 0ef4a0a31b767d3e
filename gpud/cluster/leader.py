"""The leader's soft state and the global order (pure: no I/O, injected time).

The leader keeps the latest :class:`NodeReport` of every node. Each round
(:meth:`Aggregator.compute`) it folds them per job -- a job's progress is that of its
slowest worker, its faults are the union of its nodes' faults -- runs LEVELLER over every
job in the cluster, and answers each node with the levels, tags and attributes of its jobs.

Tags are cluster-wide: one DSCP codepoint per job on every node, from one
:class:`~netshaper.tags.TagAllocator` seeded from the :class:`TagStore` (etcd), so a new
leader hands out the same tags; a node elected leader again with no other leadership
since its own (it applied no other leader's order meanwhile) writes back the tags it held
that etcd lost (``held``: restored from a snapshot, wiped); a gpud restarted meanwhile
holds none. A job no node has reported
for ``release_after_s`` gives its tag back (a job a node reports but whose name this leader
refuses, left out of the report, counts as reported: an older leader may have tagged it,
and the node marks its traffic with that tag), and sooner where a node marks another job with it (the node handed the tag
of a job idle there to a job about to run): the tags nodes mark running jobs with are
followed, not ordered back. DSCP has 64 codepoints: once the pool is used up, further jobs get no
cluster tag (:attr:`Aggregator.untagged`) and keep the tag their nodes gave them; their
levels are still global. Everything else is rebuilt from the nodes' next reports after a failover.

Levels carry over a failover too: each node reports the level its applied order gives each
job, and the first round seeds LEVELLER with them (:meth:`Aggregator.compute`), so a new
leader keeps the levels in force where rates allow instead of ranking ties afresh.
"""

from __future__ import annotations

import gc
import itertools
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpud.cluster.model import (
    LEFT_OUT_KEPT,
    MAX_FAULTS_LEFT_OUT,
    MAX_JOB_FAULTS,
    JobAttributes,
    NodeReport,
    Order,
    by_turns,
    fair_shares,
)
from gpud.cluster.ports import TagStore
from gpud.errors import DuplicateNode
from netshaper.leveller import Leveller
from netshaper.tags import DEFAULT_RESERVED, TagAllocator

# One job's reports folded over its nodes: a list indexed by these (a list literal per
# job is several times cheaper to build and to update than an object with attributes).
(
    _RATE,
    _IPS,
    _SLOWEST,
    _NODES,
    _DSCP,
    _PIN,
    _UNHEALTHY,
    _XIDS,
    _LINKS_DOWN,
    _DROPS,
    _TX,
    _CRITICAL,
    _RANKED,
    _CUT,
) = range(14)
# _DSCP: the tag a node already marks the job with; _PIN: an operator's pin on one of its
# nodes; _LINKS_DOWN: a list, None while empty (the usual case); _UNHEALTHY, _XIDS,
# _CRITICAL: the same, of (node, its entries) until the round cuts them (_fair_faults);
# _RANKED: some node ranks it (it did not end, or stop and fall silent, on all of them);
# _CUT: the fault entries its nodes cut from their own reports
_Fold = list[Any]
_new_tuple = tuple.__new__
_FORMER = 8  # replaced instances remembered per node (restarts)


class RoundCut(Exception):
    """A round ended at a stop before its order (:meth:`Aggregator.compute`'s ``cut``)."""


def _uncut() -> bool:
    return False


@dataclass(frozen=True, slots=True)
class NodeSeen:
    node: str
    age_s: float
    jobs: int
    applied_epoch: int
    build: str = ""  # of its latest report ("" from a gpud older than the field)


class Aggregator:
    """Node reports in, one global :class:`Order` out. See the module docstring."""

    def __init__(
        self,
        *,
        leader: str,
        leveller: Leveller,
        tags: TagStore,
        node_timeout_s: float,
        release_after_s: float | None = None,
        reserved: Iterable[int] = DEFAULT_RESERVED,
        after: tuple[int, int] = (0, 0),
        lease: int = 0,
        held: Mapping[str, int] | None = None,
    ) -> None:
        """``after``: the (epoch, seq) of the last order an earlier aggregator of this
        leader computed; a round of the same epoch continues its sequence (the nodes have
        applied those orders and would refuse lower numbers as stale). ``lease``: the etcd
        lease ID the leader key is held on (0 without etcd), signed into every order so
        that the nodes tell this leadership from another of the same epoch. ``held``: the
        tags this leader held in its previous leadership, no other leadership having come
        since (so a tag etcd lacks was lost by etcd: restored from a snapshot, wiped, not
        released by a successor), whatever the epoch: each one the tag store lacks, on a
        DSCP no stored tag holds, is taken up again and written back by
        the first round that saves (:attr:`republished`), so that the job keeps its DSCP
        and the next leader reads it."""
        self.leader = leader
        self._lease = lease
        self._leveller = leveller
        self._tag_store = tags
        self._reserved = frozenset(reserved)
        self._allocator: TagAllocator | None = None
        self._held = dict(held or {})
        self._unsaved: dict[str, int] = {}  # held tags taken up again, not yet written back
        self.republished: dict[str, int] = {}  # the held tags the last round wrote back
        self.node_timeout_s = node_timeout_s
        self.release_after_s = (
            release_after_s if release_after_s is not None else 3 * node_timeout_s
        )
        # node -> (received at, report, the job names it left out (refused) as _remembered
        # keeps them): written by receive() from any thread, read by a round from a copy;
        # each write is one dict assignment, so a round never reads a report with another
        # report's left-out names, nor drops one without the other
        self._reports: dict[str, tuple[float, NodeReport, frozenset[str]]] = {}
        # held by receive()'s write and a round's drop of a silent node's report: without
        # it, a report arriving between the drop's check and its removal was removed
        self._lock = threading.Lock()
        self._peers: dict[str, str] = {}  # node -> the address its latest report came from
        self._former: dict[str, dict[str, None]] = {}  # node -> instances a newer one replaced
        self._job_seen: dict[str, float] = {}
        self._epoch, self._seq = after
        self._included: set[str] = set()  # nodes whose reports the last order folded in
        self.untagged: tuple[str, ...] = ()  # jobs of the last round left without a tag
        self.order: Order | None = None

    def receive(
        self, report: NodeReport, now: float, *, peer: str = "", left_out: Sequence[str] = ()
    ) -> list[str]:
        """Keep ``report`` as the node's latest (``peer``: where it came from), and
        ``left_out``, the names of the jobs taken out of it (refused): a tag one of them
        holds (an older leader's, in etcd) stays held while the node reports it so, as
        the node marks the job's packets with that DSCP. Returns the names of
        ``left_out`` not remembered from the node's previous report (those to log: the
        node sends them every tick; of more than 64 names, some are new each time).

        Raises :class:`~gpud.errors.DuplicateNode` for a report of an instance that a newer one
        replaced under the same node name while the newer one still reports: two gpuds
        share the name, and taking both would make the node's jobs flap between them.
        """
        node = report.node
        previous = self._reports.get(node)
        if previous is not None and previous[1].instance != report.instance:
            former = self._former.setdefault(node, {})
            if report.instance in former and now - previous[0] <= self.node_timeout_s:
                other = self._peers.get(node) or "another address"
                raise DuplicateNode(
                    f"node {node!r} is reported by two gpuds, this one and the one at "
                    f"{other}: give each its own cluster.node (names compare without case)",
                    node=node,
                )
            # a restart: the newest instance is the node from now on
            former.pop(report.instance, None)
            former[previous[1].instance] = None
            if len(former) > _FORMER:
                del former[next(iter(former))]
        said = previous[2] if previous is not None else frozenset()
        kept = self._remembered(left_out) if left_out else frozenset()
        with self._lock:
            self._reports[node] = (now, report, kept)
        if peer:
            self._peers[node] = peer
        return [name for name in left_out if name not in said]

    def _remembered(self, names: Sequence[str]) -> frozenset[str]:
        """The names of ``names`` to remember: the first LEFT_OUT_KEPT (each logged once)
        and every one holding a tag (its node marks its packets with that DSCP, and
        :func:`_follow_nodes` must not hand it to another job). Until a round has read the
        tags (the first after a failover, or after a failed save) which names hold one is
        not known: all are kept, at most a report's job bound (CLUSTER_MAX_JOBS)."""
        allocator = self._allocator
        if allocator is None:
            return frozenset(names)
        kept = set(itertools.islice(names, LEFT_OUT_KEPT))
        kept.update(name for name in names if allocator.get(name) is not None)
        return frozenset(kept)

    def included_others(self) -> bool:
        """Whether the last order folded in the report of a node other than the leader."""
        return bool(self._included - {self.leader})

    def nodes(self, now: float) -> list[NodeSeen]:
        """Nodes heard from within the node timeout, by name."""
        return [
            NodeSeen(name, now - t, len(r.jobs), r.applied_epoch, r.build)
            for name, (t, r, _) in sorted(self._reports.items())
            if now - t <= self.node_timeout_s
        ]

    def _tags(self, now: float) -> TagAllocator:
        if self._allocator is None:
            existing = self._tag_store.load()
            taken = set(existing.values())
            self._unsaved = {
                job: dscp
                for job, dscp in self._held.items()
                if job not in existing and dscp not in taken and dscp not in self._reserved
            }
            existing = {**existing, **self._unsaved}
            self._allocator = TagAllocator(reserved=self._reserved, existing=existing)
            # a stored tag counts as seen now: one no node reports (its job ended while no
            # leader ran, or before the last one released it) goes after release_after_s
            for job in existing:
                self._job_seen.setdefault(job, now)
        return self._allocator

    def compute(
        self,
        epoch: int,
        now: float,
        *,
        wall: float | None = None,
        cut: Callable[[], bool] = _uncut,
    ) -> Order:
        """The global order of this round, computed in ``epoch``.

        ``cut`` is asked before each call of the tag store (etcd, slow when it is) and
        once the tags are saved: True (the cluster stops) raises :class:`RoundCut` and
        the round computes no order (:attr:`republished` still lists the held tags a save
        that committed before the cut wrote back). A save under way is not cut: it is one etcd
        transaction (a round puts and deletes the keys of tagged jobs only, 64 at most
        each, the DSCP codepoints; a job the pool had no codepoint for has no key), so
        etcd holds all of the round's tags or none of them.

        ``wall`` (Unix time) stamps the attributes; ``now`` (any clock that never goes back;
        the agent's counts the host's suspends) ages the reports. Raises whatever the tag store raises: an order whose tags are not
        persisted is never handed out (the previous one stays :attr:`order`).

        The first round that ranks seeds the leveller with the levels in force
        (:func:`seed_levels` of the reports it folds in), so a leader that takes over keeps
        them where the rates allow.
        """
        # A round allocates a few objects per job and frees none of them in cycles; with
        # 10^5 live reports, the collections those allocations trigger would cost more
        # than the round itself (measured: 2x), so the cyclic collector waits until the end.
        paused = gc.isenabled()
        gc.disable()
        try:
            return self._compute(epoch, now, wall, cut)
        finally:
            if paused:
                gc.enable()

    def _compute(
        self, epoch: int, now: float, wall: float | None, cut: Callable[[], bool]
    ) -> Order:
        # this round's alone, also when it is cut (said by the caller once the save commits)
        self.republished = {}
        folds: dict[str, _Fold] = {}
        get = folds.get
        pinned: list[str] = []  # jobs some node reported a pin for
        # a copy: reports may arrive (another thread) while the round runs
        reports = list(self._reports.items())
        included: set[str] = set()
        for name, entry in reports:
            seen, report, _ = entry
            if now - seen > self.node_timeout_s:
                # soft state: it comes back with its next report (unless it came meanwhile)
                with self._lock:
                    if self._reports.get(name) is entry:
                        self._reports.pop(name, None)
                continue
            included.add(name)
            for jr in report.jobs:
                job = jr.job
                rate = jr.progress_rate
                ips = jr.iterations_per_s
                f = get(job)
                if f is None:
                    slowest = "" if rate is None else name
                    f = [rate, ips, slowest, [name], jr.dscp, None, None, None, None, 0, 0, None]
                    f.append(not jr.unranked)  # _RANKED
                    f.append(jr.faults_left_out)  # _CUT
                    folds[job] = f
                else:
                    f[_NODES].append(name)
                    if jr.faults_left_out:
                        f[_CUT] = min(f[_CUT] + jr.faults_left_out, MAX_FAULTS_LEFT_OUT)
                    if not jr.unranked:
                        f[_RANKED] = True
                    if f[_DSCP] is None:
                        f[_DSCP] = jr.dscp
                    if rate is not None:
                        low = f[_RATE]
                        if low is None or rate < low:
                            f[_RATE] = rate
                            f[_SLOWEST] = name
                    if ips is not None:
                        low = f[_IPS]
                        if low is None or ips < low:
                            f[_IPS] = ips
                tx = jr.tx_bytes
                if tx:
                    f[_TX] += tx
                if jr.drops:
                    f[_DROPS] += jr.drops
                # cut to MAX_JOB_FAULTS once every node is in (_fair_faults)
                if jr.unhealthy_gpus:
                    if f[_UNHEALTHY] is None:
                        f[_UNHEALTHY] = []
                    f[_UNHEALTHY].append((name, jr.unhealthy_gpus))
                if jr.xids:
                    if f[_XIDS] is None:
                        f[_XIDS] = []
                    f[_XIDS].append((name, jr.xids))
                if jr.critical_xids:
                    if f[_CRITICAL] is None:
                        f[_CRITICAL] = []
                    f[_CRITICAL].append((name, jr.critical_xids))
                if jr.link_up is False:
                    if f[_LINKS_DOWN] is None:
                        f[_LINKS_DOWN] = []
                    f[_LINKS_DOWN].append(name)
                if jr.pinned_level is not None:
                    if f[_PIN] is None:
                        pinned.append(job)
                    f[_PIN] = jr.pinned_level

        if cut():
            raise RoundCut(f"the round of epoch {epoch} was cut before it read the tags")
        allocator = self._tags(now)
        before = allocator.allocations()
        for job in self._unsaved:  # held, but lost by etcd: saved as if allocated now
            before.pop(job, None)
        # jobs nodes run with names this leader refuses: the tag one holds marks its packets
        running = {
            job
            for name, (_, _, left_out) in reports
            if name in included
            for job in left_out
            if job not in folds
        }
        dropped = _follow_nodes(allocator, folds, running)
        free = len(allocator.pool) - len(allocator.allocations())
        untagged: list[str] = []
        seen_at = self._job_seen
        for job in running:
            if allocator.get(job) is not None:
                seen_at[job] = now
        for job, f in folds.items():
            seen_at[job] = now
            if allocator.get(job) is not None:
                continue
            if free <= 0:
                untagged.append(job)  # no codepoint left: it keeps its node-local tag
                continue
            # keep the tag nodes already mark with, where it is free: no retagging
            if f[_DSCP] is None or not allocator.claim(job, f[_DSCP]):
                allocator.tag(job)
            free -= 1
        released = []
        if len(seen_at) > len(folds):  # some job was not reported this round
            gone = [
                job
                for job, t in seen_at.items()
                if now - t > self.release_after_s and job not in folds
            ]
            for job in gone:
                del seen_at[job]
            # only a job that holds a tag has a key in etcd: deleting none for the jobs
            # the pool had no codepoint for keeps a save within one transaction
            released = [job for job in gone if allocator.get(job) is not None]
        for job in released:
            allocator.release(job)
        after = allocator.allocations()
        allocated = {j: d for j, d in after.items() if before.get(j) != d}
        if allocated or released or dropped:
            try:
                if cut():
                    raise RoundCut(f"the round of epoch {epoch} was cut before it saved the tags")
                self._tag_store.save(allocated, released + [j for j in dropped if j not in after])
            except Exception:
                self._allocator = None  # re-read what the store holds next round
                raise
            self.republished = {j: d for j, d in allocated.items() if self._unsaved.get(j) == d}
            self._unsaved = {}
        if cut():  # the tags are saved (or none changed): etcd and the allocator agree
            raise RoundCut(f"the round of epoch {epoch} was cut after it saved the tags")

        self._sync_pins({j: folds[j][_PIN] for j in pinned})
        leveller = self._leveller
        if leveller.last is None:  # its first ranking: from the levels in force
            live = (r for name, (_, r, _) in reports if name in included)
            leveller.seed(seed_levels(live, leveller.config.levels))
        # a job no node ranks (ended, or stopped and silent, everywhere) holds no level: its
        # last rate, decayed to its gap limit, would rank it slow and push live jobs down
        assignment = leveller.update(
            now,
            {j: f[_RATE] for j, f in folds.items() if f[_RANKED] or f[_PIN] is not None},
        )
        stamp = now if wall is None else wall
        self._included = included
        levels = assignment.levels
        if epoch != self._epoch:
            self._epoch, self._seq = epoch, 0
        self._seq += 1
        get_level, get_tag = levels.get, after.get
        # tuple.__new__ builds the NamedTuple without a call of its Python-level __new__
        attributes = {}
        for job, f in folds.items():
            unhealthy, cut_unhealthy = _fair_faults(f[_UNHEALTHY], "/")
            xids, cut_xids = _fair_faults(f[_XIDS], ":")
            critical, cut_critical = _fair_faults(f[_CRITICAL], "/")
            attributes[job] = _new_tuple(
                JobAttributes,
                (
                    job,
                    epoch,
                    get_level(job),
                    get_tag(job),
                    f[_RATE],
                    f[_IPS],
                    f[_SLOWEST],
                    tuple(f[_NODES]),
                    unhealthy,
                    xids,
                    () if f[_LINKS_DOWN] is None else tuple(f[_LINKS_DOWN]),
                    f[_DROPS],
                    f[_TX],
                    stamp,
                    critical,
                    min(cut_unhealthy + cut_xids + cut_critical + f[_CUT], MAX_FAULTS_LEFT_OUT),
                ),
            )
        self.untagged = tuple(untagged)
        self.order = Order(
            epoch=epoch,
            seq=self._seq,
            leader=self.leader,
            levels=levels,  # LEVELLER's own copy
            tags={j: after[j] for j in folds if j in after},
            shares=assignment.shares,
            attributes=attributes,
            computed_at=stamp,
            lease=self._lease,
        )
        return self.order

    def held(self) -> dict[str, int]:
        """job -> DSCP of every tag this leadership holds (what etcd lists under
        ``<prefix>/tags/`` once its rounds are saved)."""
        return {} if self._allocator is None else self._allocator.allocations()

    def _sync_pins(self, reported: dict[str, int]) -> None:
        """An operator's pin on any node holds for the job everywhere."""
        leveller = self._leveller
        levels = leveller.config.levels
        pins = {j: lv for j, lv in reported.items() if 0 <= lv < levels}
        for job in leveller.pins():
            if job not in pins:
                leveller.unpin(job)
        for job, level in pins.items():
            leveller.pin(job, level)

    def answer(self, node: str) -> Order | None:
        """The latest order, cut to the jobs ``node`` reported; None until an order has
        folded in a report of ``node`` (a new leader's first answers)."""
        order, included = self.order, self._included
        if order is None or node not in included:
            return None
        entry = self._reports.get(node)
        jobs = [jr.job for jr in entry[1].jobs] if entry is not None else []
        return order.for_jobs(jobs)


def _node_of(part: tuple[str, Sequence[object]]) -> str:
    return part[0]


def _fair_faults(
    parts: list[tuple[str, Sequence[object]]] | None, sep: str
) -> tuple[tuple[str, ...], int]:
    """One job's fault list over its nodes (``node<sep>entry``), at most
    :data:`MAX_JOB_FAULTS` of them, and how many were cut: each node an even share
    (:func:`fair_shares`), so that one node reporting a thousand faults first hides no
    other node's, listed round robin (each node's first entry, in node name order whatever
    order their reports arrived in, so a new leader keeps the same; then each one's second
    ...), so that the front of the list, which :meth:`Order.for_jobs` keeps of a job past
    its share of an order, is an even share of each node's too."""
    if parts is None:
        return (), 0
    if len(parts) == 1:  # the usual case: nothing to interleave
        node, entries = parts[0]
        kept = tuple(f"{node}{sep}{x}" for x in entries[:MAX_JOB_FAULTS])
        return kept, len(entries) - len(kept)
    parts.sort(key=_node_of)
    shares = fair_shares([len(entries) for _, entries in parts], MAX_JOB_FAULTS)
    per_node = [
        [f"{node}{sep}{x}" for x in entries[:n]]
        for (node, entries), n in zip(parts, shares, strict=True)
    ]
    kept = tuple(by_turns(per_node))
    return kept, sum(len(entries) for _, entries in parts) - len(kept)


def _follow_nodes(
    allocator: TagAllocator, folds: dict[str, _Fold], running: Collection[str] = ()
) -> list[str]:
    """Give each job the tag a node marks it with where this leader holds that tag for no
    job a node marks with it now; returns the jobs that lost their tag to it. A job of
    ``running`` (left out of its node's report) keeps its tag: its node may mark it with
    it, the report does not say.

    A node hands the tag of a job idle there to a job about to run (``traffic.dscp_pool``
    used up) and tags the idle job anew when it runs again, while this leader still holds
    the old tags until ``release_after_s``. Ordering the old ones back would move the DSCP
    of jobs that run, under them, and of the jobs that run with their tags in turn. A tag
    that a node marks its holder here with stays with it: two nodes gave one DSCP to two
    jobs, and the leader's choice keeps the tags unique across the cluster.
    """
    dropped: list[str] = []
    for job, f in folds.items():
        dscp = f[_DSCP]
        if dscp is None or dscp not in allocator.pool:
            continue
        holder = allocator.owner(dscp)
        if holder == job:
            continue
        if holder is None:
            if allocator.get(job) is None:
                continue  # a job new here: the round claims the tag for it
        elif (holder in folds and folds[holder][_DSCP] == dscp) or holder in running:
            continue
        else:
            allocator.release(holder)
            dropped.append(holder)
        allocator.release(job)
        allocator.claim(job, dscp)
    return dropped


def seed_levels(reports: Iterable[NodeReport], levels: int) -> dict[str, int]:
    """job -> the level in force for it, as ``reports`` say (for :meth:`Leveller.seed`).

    A job reported by several nodes takes the level of the newest applied epoch, the
    highest priority among nodes of that epoch (their orders can differ by a round);
    levels outside ``[0, levels)`` (an order of a leader with more levels) are left out.
    """
    best: dict[str, tuple[int, int]] = {}  # job -> (epoch, -level), the greatest wins
    for report in reports:
        epoch = report.applied_epoch
        for jr in report.jobs:
            level = jr.applied_level
            if level is None or not 0 <= level < levels:
                continue
            key = (epoch, -level)
            seen = best.get(jr.job)
            if seen is None or key > seen:
                best[jr.job] = key
    return {job: -key[1] for job, key in best.items()}
