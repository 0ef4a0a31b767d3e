"""Values that travel between a node and the leader (plain, immutable, no I/O).

A node's :class:`NodeReport` carries what it sees of each of its jobs (:class:`JobReport`);
the leader answers with an :class:`Order`: the epoch it was computed in, each reported
job's global level and cluster-wide DSCP tag, and the job's :class:`JobAttributes`
aggregated over every node that runs it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from gpud.shared import shown

# Fault entries (``unhealthy_gpus``, ``xids``, ``critical_xids``: ``node/uuid:code``, 513
# characters at most) the leader keeps per job and list, and hands one node in all of its
# order's attributes, whatever its peers reported, so that an order's faults stay within
# some 4 MiB, a quarter of the peer port's 16 MiB message limit past which the node would
# get no order at all. A job faulted on every device of a hundred nodes may pass them (two
# uncleared codes a GPU, or 7 MIG devices a GPU, each listing its GPU's codes): the leader
# then keeps an even share of each of its nodes' entries (fair_shares, taken from its nodes
# round robin, by_turns), an order an even share of each of its jobs' (xids, the codes
# alone, cut before critical_xids and unhealthy_gpus), and JobAttributes.faults_left_out
# counts what was cut.
MAX_JOB_FAULTS = 1024
MAX_ORDER_FAULTS = 8192
# uint32, faults_left_out's wire type: a job's count is the sum over its nodes, each of
# which chooses its own, so the leader saturates it here rather than fail to build the order
MAX_FAULTS_LEFT_OUT = 2**32 - 1

_T = TypeVar("_T")
# a gap of by_turns' shorter lists: its entries may be None themselves
_GAP: Any = object()


def fair_shares(sizes: Sequence[int], budget: int) -> list[int]:
    """How many of each of ``sizes`` entries to keep so that at most ``budget`` are kept
    in all: as if one were taken from each in turn until the budget is spent, so each keeps
    an even share, one needing less than its share leaves the rest to the others, and the
    first ones get the one left over. Every size, where their sum is within the budget."""
    if sum(sizes) <= budget:
        return list(sizes)
    shares = list(sizes)
    left, waiting = budget, len(sizes)
    by_size = sorted(range(len(sizes)), key=sizes.__getitem__)
    for k, i in enumerate(by_size):
        if sizes[i] * waiting > left:  # this one and all larger get the even share
            share, extra = divmod(left, waiting)
            for rank, j in enumerate(sorted(by_size[k:])):
                shares[j] = share + (rank < extra)
            break
        left -= sizes[i]
        waiting -= 1
    return shares


def by_turns(lists: Iterable[Sequence[_T]]) -> list[_T]:
    """The entries of ``lists`` round robin: each one's first, then each one's second...,
    so that any front of the result keeps an even share of each (as :func:`fair_shares`
    counts them)."""
    return [
        x for turn in itertools.zip_longest(*lists, fillvalue=_GAP) for x in turn if x is not _GAP
    ]


def node_name(name: str) -> str:
    """The cluster's form of a node name: lower case. Node names are DNS names, which
    compare without case (RFC 4343), as TLS matches them against a certificate: ``Node-A``
    and ``node-a`` are one host, so one node (and two gpuds under them are a duplicate)."""
    return name.lower()


@dataclass(frozen=True, slots=True)
class JobReport:
    """One job as one node sees it.

    ``progress_rate`` is the normalized rate (contention-free iteration time / observed
    iteration time, 1.0 = uncontended), ``None`` until known; ``dscp`` the tag this node
    marks the job's packets with; ``gpus`` the GPU / MIG UUIDs the job holds here and
    ``unhealthy_gpus`` those of them the last telemetry tick found lost or hung;
    ``critical_xids`` ``uuid:code`` for every uncleared critical XID of the GPU under each
    of them (a MIG device has its GPU's), ``xids`` the codes alone (what a leader of an
    older gpud reads; such a node sends there the last XID of any kind instead); ``link_up``
    whether the job's interfaces are up (None: not known); ``tx_bytes`` / ``drops`` the
    counters of the job's class on this node; ``pinned_level`` a level an operator pinned
    the job to on this node; ``applied_level`` the job's level in the cluster order in force
    here (the one of :attr:`NodeReport.applied_epoch`; None: the order names no level for
    it, or none is in force; a gpud started again, before its first order, the level its
    tc class held at the start, as of epoch 0), which a new leader starts from; ``unranked`` that the job
    holds no level on this node (its run ended, or it stopped and fell silent; never with
    a pin): the leader ranks it only where another node reports it ranked;
    ``faults_left_out`` how many entries of ``unhealthy_gpus``, ``xids`` and
    ``critical_xids`` this node cut to the report's bounds (the leader adds them into
    :attr:`JobAttributes.faults_left_out`).
    """

    job: str
    progress_rate: float | None = None
    iterations_per_s: float | None = None
    dscp: int | None = None
    gpus: tuple[str, ...] = ()
    unhealthy_gpus: tuple[str, ...] = ()
    xids: tuple[int, ...] = ()
    link_up: bool | None = None
    tx_bytes: int = 0
    drops: int = 0
    pinned_level: int | None = None  # an operator's pin on this node (gpuctl net pin)
    applied_level: int | None = None  # its level in the order in force here
    critical_xids: tuple[str, ...] = ()
    unranked: bool = False  # ended or stopped and silent here: no level (False: older gpud)
    faults_left_out: int = 0  # fault entries this node cut to the report's bounds


@dataclass(frozen=True, slots=True)
class NodeReport:
    """Everything one node tells the leader on one tick.

    ``node`` is compared in :func:`node_name` form; ``instance`` is random per gpud process: a new one under a known node name is a
    restart, an old one reporting again means two gpuds share the name. ``build`` is the
    digest of the code the node's gpud runs (:mod:`gpud.build`; "" from a gpud older than
    it): the leader keeps it per node, so a rolling upgrade's progress shows.
    """

    node: str
    jobs: tuple[JobReport, ...] = ()
    applied_epoch: int = 0
    instance: str = ""
    build: str = ""


class LeftOutJob(NamedTuple):
    """A job the leader left out of a node's report, its name refused (``reason``: the
    leader's words, naming the field); the rest of the report is taken."""

    job: str
    reason: str


# left-out job names remembered per node, to log each once: a node may leave out
# thousands, each of up to 256 characters, in every report (of more, some are logged again)
LEFT_OUT_KEPT = 64
_LEFT_OUT_NAMED = 3  # left-out jobs a log line names; the others it counts
_LEFT_OUT_NAME = 40  # characters of a left-out job's name a log line shows
_LEFT_OUT_REASON = 200  # ... of the reason (it may repeat the name, 256 characters)


def left_out_said(jobs: Sequence[LeftOutJob]) -> str:
    """The first few of ``jobs`` for one log line, each its name shortened and the
    reason, and how many more: a node may leave out thousands, with names of 256
    characters, in every report."""
    named = []
    for job in jobs[:_LEFT_OUT_NAMED]:
        reason = job.reason
        if len(reason) > _LEFT_OUT_REASON:
            reason = reason[:_LEFT_OUT_REASON] + "..."
        named.append(f"{shown(job.job, _LEFT_OUT_NAME)} ({reason})")
    more = len(jobs) - _LEFT_OUT_NAMED
    return ", ".join(named) + (f" and {more} more" if more > 0 else "")


class JobAttributes(NamedTuple):
    """What the cluster knows of one job, as the leader computed it in ``epoch``.

    ``level`` is its global network level (0 = highest priority; None: excluded or not
    ranked yet), ``progress_rate`` the slowest of its nodes' rates and ``slowest_node``
    that node; ``unhealthy_gpus`` are ``node/uuid`` pairs, ``critical_xids``
    ``node/uuid:code`` (every uncleared critical XID of the devices it holds) and ``xids``
    their ``node:code`` over every node that runs it; ``links_down`` the nodes whose interfaces for it are
    down; ``drops`` / ``tx_bytes`` its tag's counters summed over its nodes. (A NamedTuple:
    the leader builds one per job per round, and tuples are the cheapest to build.)
    """

    job: str
    epoch: int
    level: int | None
    dscp: int | None
    progress_rate: float | None
    iterations_per_s: float | None
    slowest_node: str
    nodes: tuple[str, ...]
    unhealthy_gpus: tuple[str, ...]
    xids: tuple[str, ...]
    links_down: tuple[str, ...]
    drops: int
    tx_bytes: int
    computed_at: float
    critical_xids: tuple[str, ...]
    faults_left_out: int = 0


@dataclass(frozen=True, slots=True)
class Order:
    """The leader's answer: levels and tags for jobs, with the epoch that fences it.

    ``seq`` counts orders within a leadership (a node keeps the newest). ``levels`` and
    ``tags`` may cover only the jobs of the node it is addressed to. ``lease``: the etcd
    lease ID the leader holds its key on (0: unknown, an older leader or no etcd): on a
    fresh etcd a new leader key may get the epoch of the one before, never its lease.
    """

    epoch: int
    seq: int
    leader: str
    levels: Mapping[str, int]
    tags: Mapping[str, int]
    shares: tuple[float, ...] = ()
    attributes: Mapping[str, JobAttributes] = field(default_factory=dict)
    computed_at: float = 0.0
    lease: int = 0

    def for_jobs(self, jobs: Iterable[str]) -> Order:
        """The part of this order that concerns ``jobs``, with at most
        :data:`MAX_ORDER_FAULTS` fault entries in all its attributes: each job with faults
        keeps an even share of them (:func:`fair_shares`), cut from its ``xids`` first,
        then its ``critical_xids``, then its ``unhealthy_gpus``, and its
        ``faults_left_out`` counts the entries cut."""
        jobs = tuple(jobs)
        kept = [(j, a) for j in jobs if (a := self.attributes.get(j)) is not None]
        needs = [len(a.unhealthy_gpus) + len(a.xids) + len(a.critical_xids) for _, a in kept]
        attributes = {}
        for (j, a), need, share in zip(
            kept, needs, fair_shares(needs, MAX_ORDER_FAULTS), strict=True
        ):
            if share >= need:
                attributes[j] = a
                continue
            unhealthy = a.unhealthy_gpus[:share]
            critical = a.critical_xids[: share - len(unhealthy)]
            attributes[j] = a._replace(
                unhealthy_gpus=unhealthy,
                xids=a.xids[: share - len(unhealthy) - len(critical)],
                critical_xids=critical,
                faults_left_out=min(a.faults_left_out + need - share, MAX_FAULTS_LEFT_OUT),
            )
        return Order(
            epoch=self.epoch,
            seq=self.seq,
            leader=self.leader,
            levels={j: self.levels[j] for j in jobs if j in self.levels},
            tags={j: self.tags[j] for j in jobs if j in self.tags},
            shares=self.shares,
            attributes=attributes,
            computed_at=self.computed_at,
            lease=self.lease,
        )
