"""What the node's traffic service offers the rest of gpud (the cluster leader in particular).

The cluster layer talks to the node's traffic service only through :class:`TrafficPort`::

    report = traffic.local_report()          # every tick: jobs here, their progress and tags
    ...send it to the leader, get back (epoch, levels, tags)...
    result = traffic.apply_order(epoch, levels, tags)
    if not result.applied: ...               # stale epoch: result.reason says why
    traffic.clear_order()                    # grace period over: back to the local policy

Without any order the node runs its local :class:`netshaper.leveller.Leveller` over its own
jobs each tick (the fallback, and the whole story on a lone node). An applied order stays in
force, whatever the local policy thinks, until a newer order replaces it or
:meth:`TrafficPort.clear_order` hands control back; a job the order does not name gets the
local policy's level for it, so a job that started after the leader's last round is not left
unprioritised.

:class:`FakeTraffic` is a public in-memory implementation for tests of the callers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class LinkEnforcement:
    """One of ``traffic.interfaces``: is its HTB tree in the kernel, and if not, why."""

    name: str
    enforced: bool
    error: str = ""


@dataclass(frozen=True, slots=True)
class TrafficSummary:
    """Traffic enforcement in brief, for ``gpuctl status``: read without waiting for a
    traffic pass in progress."""

    enabled: bool
    interfaces: tuple[LinkEnforcement, ...] = ()
    marking_error: str = ""
    marking: bool = True  # traffic.marking: whether packets are marked by cgroup at all
    rdma_backend: str = "none"  # traffic.rdma_backend
    rdma_error: str = ""  # why the RDMA DSCP map is not in force ("" when it is)


@dataclass(frozen=True, slots=True)
class TrafficCounters:
    """What a job (or level) sent through the enforced interfaces, summed over them; read
    from the HTB leaf classes (``tc -s class show dev IF``)."""

    bytes: int = 0
    packets: int = 0
    drops: int = 0


@dataclass(frozen=True, slots=True)
class JobTraffic:
    """One job on this node as the traffic service sees it.

    ``rate`` is the normalized progress rate (contention-free / observed iteration time,
    in (0, 1]; None until known); ``level`` the level in force (0 = highest priority; None:
    the job is in the default class); ``dscp`` its stable tag.
    """

    job: str
    dscp: int
    level: int | None
    rate: float | None
    iterations: int | None
    iteration_s: float | None
    contention_free_iteration_s: float | None
    # when the newest progress report was stamped, as wall time now: the stamp is kept on
    # the monotonic clock, so a wall clock stepped back since never puts it in the future
    last_report_unix_s: float | None
    pinned_level: int | None = None
    # the level the job is pinned to, beyond a lowered ``traffic.levels``: ``pinned_level``
    # is the lowest level, which it holds until the levels are raised again or it is re-pinned
    pin_clamped_from: int | None = None
    cgroup: str = ""
    counters: TrafficCounters = field(default_factory=TrafficCounters)
    # no progress for more than ``gap_spacings`` of its usual spacings (SIGSTOP, a
    # debugger): seconds since its last progress; None while it runs (or is not known)
    stopped_s: float | None = None
    # stopped, and no report for ``traffic.idle_after_s`` either: not ranked, so it holds no
    # level (unless pinned) until it reports again
    unranked: bool = False
    # its last run ended this many seconds ago (its reservation was released, or its
    # holder died) and it holds none now, with no progress since: not stopped, done. None
    # while it runs, or where gpud saw no run of it end
    ended_s: float | None = None


@dataclass(frozen=True, slots=True)
class LocalReport:
    """This node's jobs at one instant (``at``: unix seconds), for the leader.

    ``epoch`` is the epoch of the cluster order in force (0: the local policy decides);
    ``levels`` is how many priority levels the node enforces; ``adopted`` job -> the level
    its tc class held when gpud started (the levels its tc tree held, read from the
    kernel: the run before's order, or its local policy's; of a job whose interfaces held
    different levels, the highest priority) and still holds, until the first cluster order
    since the start is applied -- also while a start into a partition (LOCAL mode) runs
    the local policy, for the jobs it has not moved: what a new leader starts from rather
    than ranking those jobs afresh.
    """

    at: float
    jobs: tuple[JobTraffic, ...]
    epoch: int
    levels: int
    adopted: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class OrderResult:
    """What :meth:`TrafficPort.apply_order` did: ``applied`` False with ``reason`` for a
    refused order (stale epoch, bad level or tag); ``retagged`` names the jobs whose tag
    changed (their running processes keep the old TOS until restarted, except where gpud
    marks them by cgroup)."""

    applied: bool
    epoch: int
    reason: str = ""
    retagged: tuple[str, ...] = ()


class TrafficPort(Protocol):
    """The node's traffic service, as the cluster layer uses it. Thread-safe."""

    def local_report(self) -> LocalReport:
        """The jobs on this node with their progress, tags, levels and counters."""
        ...

    def apply_order(
        self,
        epoch: int,
        levels: Mapping[str, int],
        tags: Mapping[str, int] | None = None,
        *,
        restart: bool = False,
    ) -> OrderResult:
        """Apply a global order: ``levels`` job -> level (0 highest), and optionally
        cluster-unique ``tags`` job -> DSCP. Refused (nothing changes) when ``epoch`` is
        lower than the newest order applied, unless ``restart`` (the epochs started again
        lower: etcd went back); takes effect on the next tick. Jobs this node does not know
        are ignored."""
        ...

    def clear_order(self) -> None:
        """Hand the levels back to the local policy (no leader within the grace period)."""
        ...


class FakeTraffic:
    """An in-memory :class:`TrafficPort`: jobs are set by the test, orders are recorded."""

    def __init__(self, jobs: tuple[JobTraffic, ...] = (), *, levels: int = 8) -> None:
        self.jobs = jobs
        self.levels = levels
        self.epoch = 0
        self.order: dict[str, int] | None = None
        self.tags: dict[str, int] = {}
        self.clock = 0.0
        self.adopted: dict[str, int] = {}  # levels found in the kernel at start

    def local_report(self) -> LocalReport:
        return LocalReport(
            at=self.clock,
            jobs=self.jobs,
            epoch=self.epoch,
            levels=self.levels,
            adopted=self.adopted,
        )

    def apply_order(
        self,
        epoch: int,
        levels: Mapping[str, int],
        tags: Mapping[str, int] | None = None,
        *,
        restart: bool = False,
    ) -> OrderResult:
        if epoch < self.epoch and not restart:
            return OrderResult(False, self.epoch, f"stale epoch {epoch} < {self.epoch}")
        self.epoch = epoch
        self.order = dict(levels)
        self.adopted = {}  # the order is in force: the start's levels are not
        self.tags.update(tags or {})
        return OrderResult(True, epoch)

    def clear_order(self) -> None:
        self.order = None
