"""Values that travel between a node and the leader (plain, immutable, no I/O).

A node's :class:`NodeReport` carries what it sees of each of its jobs (:class:`JobReport`);
the leader answers with an :class:`Order`: the epoch it was computed in, each reported
job's global level and cluster-wide DSCP tag, and the job's :class:`JobAttributes`
aggregated over every node that runs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from gpud.shared import shown


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
    a pin): the leader ranks it only where another node reports it ranked.
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
        """The part of this order that concerns ``jobs``."""
        jobs = tuple(jobs)
        return Order(
            epoch=self.epoch,
            seq=self.seq,
            leader=self.leader,
            levels={j: self.levels[j] for j in jobs if j in self.levels},
            tags={j: self.tags[j] for j in jobs if j in self.tags},
            shares=self.shares,
            attributes={j: self.attributes[j] for j in jobs if j in self.attributes},
            computed_at=self.computed_at,
            lease=self.lease,
        )
