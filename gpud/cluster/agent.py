"""The node's cluster agent: one step of the daemon's loop, plus what the servicers ask.

Each tick (:meth:`ClusterAgent.tick`)::

    report = this node's jobs (traffic service) + their GPUs and faults (node view)
             + their levels in the cluster order in force (a new leader starts from them)
    leading?  fold the reports received since the last round with ours -> global order
              (tags persisted first), answer peers with it from now on, apply our share;
              a new leader only collects reports for its first settle_s (see _lead)
    else      send the report to the leader the election names (mTLS) -> its order; if
              that one does not lead and names another, to that one (a hint, checked:
              see _follow)
    Fence: apply only an order whose epoch is >= the newest applied (one of the same epoch
    on another leader key lease only from the leader etcd names: a fresh etcd)
    no order for longer than fresh_s: "holding" (the last order stays); for longer than
    grace_s: "local" (TrafficPort.clear_order: the node's own leveller decides again)

Peers' reports arrive through :meth:`receive` (the peer servicer) between ticks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpud.clock import elapsed
from gpud.cluster import election as store
from gpud.cluster import problems
from gpud.cluster.certexpiry import CertExpiry, CertWatch
from gpud.cluster.convert import MAX_GPUS, MAX_XIDS
from gpud.cluster.election import Election, LeaderInfo
from gpud.cluster.etcd import NOSPACE, NOSPACE_ADVICE
from gpud.cluster.fencing import FailStatic, Fence, Mode
from gpud.cluster.leader import Aggregator, NodeSeen, RoundCut
from gpud.cluster.model import (
    JobAttributes,
    JobReport,
    LeftOutJob,
    NodeReport,
    Order,
    by_turns,
    fair_shares,
    left_out_said,
    node_name,
)
from gpud.cluster.ports import NodeView, StoreAlarms, TagStore
from gpud.cluster.problems import Problem, ProblemBoard, Writer
from gpud.errors import (
    DuplicateNode,
    FailedPrecondition,
    GpudError,
    HandshakeFailed,
    InvalidArgument,
    LeaderNotReady,
    NotLeader,
    PermissionDenied,
    StoreFull,
)
from gpud.events import EventLog
from gpud.net.port import TrafficPort
from gpud.shared import CLUSTER_MAX_REPORT_GPUS, CLUSTER_MAX_REPORT_XIDS
from netshaper.leveller import Leveller, LevellerConfig

log = logging.getLogger(__name__)

RETRY_S = 0.2  # a follower's next report when the leader had no order for it yet
# how often a node reads etcd's alarms: a follower writes to etcd rarely, so it would not
# otherwise learn that etcd refuses writes (and that no successor could be elected)
ALARM_CHECK_S = 10.0

# What kind of error ``last_error`` is (``last_error_kind``; "" with none), for gpuctl and
# scripts to branch on rather than on the message's words.
LEADER_UNREACHABLE = "leader_unreachable"  # the report to the leader failed
TLS_HANDSHAKE = "tls_handshake"  # ... in the TLS handshake: a certificate refused
REPORT_REFUSED = "report_refused"  # the leader answered, refusing the report (its words)
LEADER_NOT_READY = "leader_not_ready"  # ... the leader restarted within its old lease
NOT_LEADER = "not_leader"  # ... the node etcd names does not lead
DUPLICATE_NODE = "duplicate_node"  # ... another gpud reports under this node's name
LEADER_KEY_HELD = "leader_key_held"  # etcd names this node, another gpud holds the key
ORDER_REFUSED = "order_refused"  # the traffic service refused the leader's order
STALE_ORDER = "stale_order"  # the fence refused it: older than the order in force
LEADER_ROUND = "leader_round"  # this leader's round failed (its tags not saved)
STORE_FULL = "store_full"  # ... as etcd is out of space (alarm NOSPACE)
OWN_CERTIFICATE = "own_certificate"  # this node's certificate expired: peers refuse it


def report_error_kind(err: GpudError) -> str:
    """The ``last_error_kind`` of a report the leader did not answer with an order."""
    if isinstance(err, DuplicateNode):
        return DUPLICATE_NODE
    if isinstance(err, LeaderNotReady):
        return LEADER_NOT_READY
    if isinstance(err, NotLeader):
        return NOT_LEADER
    if isinstance(err, HandshakeFailed):
        return TLS_HANDSHAKE
    if isinstance(err, (InvalidArgument, PermissionDenied)):
        return REPORT_REFUSED
    return LEADER_UNREACHABLE


# gone once this node leads: what report_error_kind gives (about reaching the leader: no
# leader to reach but itself), and no other holder of its key
LEADER_KINDS = frozenset(
    {
        LEADER_UNREACHABLE,
        REPORT_REFUSED,
        TLS_HANDSHAKE,
        LEADER_NOT_READY,
        NOT_LEADER,
        DUPLICATE_NODE,
        LEADER_KEY_HELD,
    }
)


class PeerTransport(Protocol):
    async def report(self, address: str, leader: str, report: NodeReport) -> Order | None:
        """Send ``report`` to the leader at ``address``; its order (None: none yet).
        Raises :class:`~gpud.errors.Unavailable` when it cannot be reached, and
        :class:`~gpud.errors.NotLeader` (with the leader it knows of) when it does not
        lead."""
        ...

    async def nodes(self, address: str, leader: str) -> list[NodeSeen]:
        """The nodes the leader has heard from."""
        ...


@dataclass(frozen=True, slots=True)
class LeaderHint:
    """The leader a follower reports to instead of the one the election names: the one
    that leader named when it refused the report (:class:`NotLeader`), and since when (a
    Unix time) this node reports there."""

    leader: str
    address: str
    since: float


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    election: str
    node: str
    info: LeaderInfo
    mode: Mode
    applied_epoch: int
    applied_seq: int
    last_order_age_s: float | None
    grace_s: float
    rejected_orders: int
    nodes: tuple[NodeSeen, ...]
    jobs: tuple[JobAttributes, ...]
    last_error: str = ""
    last_error_kind: str = ""  # LEADER_UNREACHABLE...: what last_error is ("" with none)
    problems: tuple[Problem, ...] = ()  # every node's, as published in etcd
    # whether ``problems`` can be trusted, in store_state's words: "ok"; "unreachable" or
    # "refused" (not read: unknown); "full" (no node can record one); "" with no etcd
    problems_state: str = ""
    etcd_alarms: tuple[str, ...] = ()  # raised on etcd as last read, e.g. ("NOSPACE",)
    etcd_alarms_read: bool = False  # the last read of them succeeded (none yet: False)
    certificates: tuple[CertExpiry, ...] = ()  # the peer API's and etcd's, when they expire
    # the leader this node reports to while it is not the one ``info`` names (None: it is)
    hint: LeaderHint | None = None


def _codes(held: Iterable[str], critical: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """``JobReport.xids``: the uncleared critical XID codes under the devices ``held``, round
    robin over them, at most as many as an older leader takes (the codes alone are a
    summary for it, whose cut ``critical_xids`` lists in full: not counted as left out)."""
    return tuple(by_turns(critical.get(u, ()) for u in held)[:MAX_GPUS])


def _pairs(held: Iterable[str], critical: Mapping[str, tuple[int, ...]]) -> tuple[str, ...]:
    """``JobReport.critical_xids``: ``uuid:code`` of each device held, each code, round robin
    over the devices (:func:`trim_report` cuts them to as many as the leader takes)."""
    return tuple(by_turns([f"{u}:{x}" for x in critical.get(u, ())] for u in held))


# A job's fields that the leader bounds (gpud.cluster.convert's) and _codes does not cut,
# and those bounds.
_JOB_BOUNDS = (("critical_xids", MAX_XIDS),)
# A report's fields that the leader bounds summed over its jobs (gpud.api.validate's
# TOTAL_LIMITS), and those bounds: one past them would be refused whole, every tick.
_REPORT_TOTALS = (
    ("gpus", CLUSTER_MAX_REPORT_GPUS),
    ("unhealthy_gpus", CLUSTER_MAX_REPORT_GPUS),
    ("xids", CLUSTER_MAX_REPORT_GPUS),
    ("critical_xids", CLUSTER_MAX_REPORT_XIDS),
)
# the fields whose entries a job's faults_left_out counts (as the leader's does)
_FAULTS = frozenset(("unhealthy_gpus", "xids", "critical_xids"))


def trim_report(jobs: Sequence[JobReport]) -> tuple[list[JobReport], dict[str, int]]:
    """``jobs`` with each field of ``_JOB_BOUNDS`` within its bound, and each of
    ``_REPORT_TOTALS`` within its bound summed over them (each job an even share,
    :func:`fair_shares`, the front of its list, which :func:`_pairs` and :func:`_codes`
    list round robin over its devices), so that the leader never refuses this node's
    report for its fault lists; each job's ``faults_left_out`` counts the fault entries
    cut of it. Also returns how many entries of each field were cut (none: empty)."""
    trimmed = list(jobs)
    cut: dict[str, int] = {}
    left_out = [0] * len(trimmed)
    for name, most in _JOB_BOUNDS:
        for i, j in enumerate(trimmed):
            over = len(getattr(j, name)) - most
            if over > 0:
                trimmed[i] = dataclasses.replace(j, **{name: getattr(j, name)[:most]})
                cut[name] = cut.get(name, 0) + over
                left_out[i] += over
    for name, most in _REPORT_TOTALS:
        sizes = [len(getattr(j, name)) for j in trimmed]
        if sum(sizes) <= most:
            continue
        shares = fair_shares(sizes, most)
        cut[name] = cut.get(name, 0) + sum(sizes) - most
        for i, (size, n) in enumerate(zip(sizes, shares, strict=True)):
            if n < size:
                trimmed[i] = dataclasses.replace(
                    trimmed[i], **{name: getattr(trimmed[i], name)[:n]}
                )
                if name in _FAULTS:
                    left_out[i] += size - n
    return [
        dataclasses.replace(j, faults_left_out=j.faults_left_out + n) if n else j
        for j, n in zip(trimmed, left_out, strict=True)
    ], cut


def _same(a: JobAttributes, b: JobAttributes | None) -> bool:
    """Equal but for when it was computed (a new round that changed nothing)."""
    return b is not None and a._replace(computed_at=0, epoch=0) == b._replace(
        computed_at=0, epoch=0
    )


class ClusterAgent:
    """See the module docstring."""

    def __init__(
        self,
        *,
        node: str,
        election_kind: str,
        election: Election,
        traffic: TrafficPort,
        view: NodeView,
        tag_store: Callable[[int, int], TagStore],
        leveller: LevellerConfig,
        reserved_tags: Iterable[int],
        peers: PeerTransport | None,
        grace_s: float,
        fresh_s: float,
        node_timeout_s: float,
        settle_s: float = 0.0,
        events: EventLog | None = None,
        clock: Callable[[], float] = elapsed,
        wall: Callable[[], float] = time.time,
        instance: str | None = None,
        build: str = "",
        credential_problem: Callable[[float], str] | None = None,
        problems: ProblemBoard | None = None,
        alarms: StoreAlarms | None = None,
        certs: CertWatch | None = None,
        gpud: str | None = None,
    ) -> None:
        self.node = node_name(node)
        self.instance = os.urandom(8).hex() if instance is None else instance
        # who publishes this node's problem, for an operator to find the gpud: "<host> pid
        # <pid>" (two gpuds under one node name are told apart by it)
        self.gpud = f"{socket.gethostname()} pid {os.getpid()}" if gpud is None else gpud
        self.build = build  # the code this gpud runs (gpud.build), sent in each report
        self._report_trimmed = False  # the last report was cut to the cluster's bounds
        self.election_kind = election_kind
        self.election = election
        self._traffic = traffic
        self._view = view
        self._tag_store = tag_store
        self._leveller = leveller
        self._reserved = tuple(reserved_tags)
        self._peers = peers
        self._node_timeout_s = node_timeout_s
        self._settle_s = settle_s
        self._events = events
        # counts the host's suspends (gpud.clock): a follower's last order and the
        # leader's view of each node's last report age across one
        self._clock = clock
        self._wall = wall
        self.fence = Fence()
        self.fail_static = FailStatic(grace_s, fresh_s=fresh_s)
        self._lock = threading.Lock()  # swapping the aggregator (a new epoch, stepping down)
        self._aggregator: Aggregator | None = None
        # (epoch, lease) the aggregator's tag store guards its writes with: a fresh etcd
        # numbers revisions from 1 again, so the same epoch on a new lease is a new leadership
        self._agg_leadership = (0, 0)
        self._issued = (0, 0)  # (epoch, seq) of the last order this node computed
        # ((epoch, lease), job -> DSCP): the tags this node's last leadership held. While no
        # other leadership has come since (its orders clear them, _apply; so does the
        # election naming another node in a higher epoch, seen_leader), etcd should hold
        # them: a later leadership of this node writes back those etcd lost (restored, wiped)
        self._held: tuple[tuple[int, int], dict[str, int]] = ((0, 0), {})
        self._settled_at = 0.0  # (clock) when this leadership may hand out its first order
        self._led_at: float | None = None  # (clock) this leadership's last round
        self.mode = Mode.LOCAL
        self.order: Order | None = None  # the newest applied order (this node's share)
        self._order_cleared = False  # the local policy decides again (grace period over)
        self.last_error = ""
        self.last_error_kind = ""  # LEADER_UNREACHABLE...: what last_error is
        self._duplicates: set[str] = set()  # node names two gpuds were found to share
        # ((leader, epoch) the election names, the leader that one named instead)
        self._hint: tuple[tuple[str, int], LeaderHint] | None = None
        # '' or why peers refuse this node's certificate at a Unix time (expired since start)
        self._credential_problem = credential_problem or (lambda now: "")
        self._credential_logged = ""
        self._problems = problems
        # the problem last published (message, kind, mode; "" cleared; its key:
        # _key_instance), and when
        self._published: tuple[str, str, str] = ("", "", "")
        self._published_at = 0.0  # (clock) when the problem entry was last written
        self._problem_since = 0.0  # (wall) when last_error took its current text
        self._problem_text = ""
        self._alarms = alarms
        self._certs = certs
        self.etcd_alarms: tuple[str, ...] = ()
        # False until read, and after a failed read: ``etcd_alarms`` is not known, not none
        self.etcd_alarms_read = False
        self._alarms_read_at: float | None = None  # (clock) none yet
        self._changed = asyncio.Event()
        self._tick_lock = asyncio.Lock()
        self._stopping = False  # gpud is stopping: no report to the leader, nothing published
        self._ended = False  # the cluster stops (end_rounds): no round at all, a leader's too
        # an extra round after DELAY seconds (the runtime schedules it; a no-op by default)
        self.request_round: Callable[[float], None] = lambda delay: None

    # -- the tick ------------------------------------------------------------------------

    def retime(self, *, fresh_s: float, settle_s: float) -> None:
        """New ``fresh_s`` and ``settle_s`` (the daemon's tick was reloaded)."""
        self.fail_static.fresh_s = fresh_s
        self._settle_s = settle_s

    def local_report(self) -> NodeReport:
        """This node's jobs: traffic (progress, tag, counters) joined with GPUs and faults."""
        traffic = self._traffic.local_report()
        gpus = self._view.job_gpus()
        unhealthy = self._view.unhealthy_gpus()
        critical = self._view.critical_xids()
        link_up = self._view.links_up()
        # The levels of the cluster order in force, for a new leader to start from: none
        # once the local policy decides again, nor while an order newer than the one in
        # force (the traffic service refused it) would stamp them with its epoch. Before
        # the first order since the start, the levels its tc tree held, as the traffic
        # service found them in the kernel (the run before's order, or its local
        # policy's), as of epoch 0 -- also while a start into a partition runs the local
        # policy, for the jobs it has not moved: a new leader then keeps those jobs'
        # levels where rates allow, rather than rank jobs of unknown rates by job id, then
        # again once their rates are known. A leader that stays does not read them.
        order, epoch = self.order, self.fence.epoch  # read once: _apply may run meanwhile
        applied: Mapping[str, int] = (
            order.levels
            if order is not None and not self._order_cleared and order.epoch == epoch
            else traffic.adopted
            if order is None and not self._order_cleared and epoch == 0
            else {}
        )
        jobs: dict[str, JobReport] = {}
        for jt in traffic.jobs:
            if jt.level is None and jt.rate is None and jt.job not in gpus:
                continue  # idle here (no reports, no GPUs): not ranked, as locally
            held = gpus.get(jt.job, ())
            jobs[jt.job] = JobReport(
                job=jt.job,
                progress_rate=jt.rate,
                iterations_per_s=1.0 / jt.iteration_s if jt.iteration_s else None,
                dscp=jt.dscp,
                gpus=held,
                unhealthy_gpus=tuple(u for u in held if u in unhealthy),
                xids=_codes(held, critical),
                critical_xids=_pairs(held, critical),
                link_up=link_up,
                tx_bytes=jt.counters.bytes,
                drops=jt.counters.drops,
                pinned_level=jt.pinned_level,
                applied_level=applied.get(jt.job),
                # as the local ranking: an ended job, or one stopped and silent, holds no
                # level (a pin aside), however slow its last rate reads
                unranked=(jt.ended_s is not None or jt.unranked) and jt.pinned_level is None,
            )
        for job, held in gpus.items():
            if job not in jobs:  # holds GPUs here but sends no traffic (yet)
                jobs[job] = JobReport(
                    job=job,
                    gpus=held,
                    unhealthy_gpus=tuple(u for u in held if u in unhealthy),
                    xids=_codes(held, critical),
                    critical_xids=_pairs(held, critical),
                    applied_level=applied.get(job),
                )
        sent, cut = trim_report([jobs[j] for j in sorted(jobs)])
        if cut and not self._report_trimmed:  # said once, not every tick it lasts
            log.warning(
                "cluster: this node's report cut to the cluster's bounds, each job an even "
                "share: %s",
                ", ".join(f"{n} of {name}" for name, n in cut.items()),
            )
        self._report_trimmed = bool(cut)
        return NodeReport(
            node=self.node,
            jobs=tuple(sent),
            applied_epoch=epoch,
            instance=self.instance,
            build=self.build,
        )

    def seen_leader(self) -> None:
        """The election names a new leader or epoch (its ``on_change``, on the election's
        thread): another node's leadership in an epoch above this node's last one may have
        released or moved the tags this node held, whether or not this node ever accepted
        its orders (cut off from it), so etcd's tags are the truth from now on. A leader key
        of a lower epoch (left in a snapshot etcd was restored from) forgets none."""
        self._forget_held(self.election.state())

    def _forget_held(self, info: LeaderInfo) -> None:
        with self._lock:
            (epoch, _), tags = self._held
            if tags and info.leader and info.leader != self.node and info.epoch > epoch:
                self._held = ((0, 0), {})

    async def tick(self) -> None:
        """One round: the daemon's step, and at once when the leader changes. Once gpud is
        stopping (:meth:`begin_stop`) only a leader's, until the cluster's stop gives up
        its leadership (:meth:`end_rounds`); checked again once the round before ended."""
        if not self._may_round():
            return
        async with self._tick_lock:
            if self._may_round():
                await self._tick()

    def _may_round(self) -> bool:
        return not self._ended and (not self._stopping or self.election.state().leading)

    def begin_stop(self) -> None:
        """gpud is stopping: no new report to the leader, and this node's problem is no
        longer published (the stop withdraws it). A leader goes on with its rounds: its
        nodes get orders until it gives up the leadership (:meth:`end_rounds`), and a
        successor is elected at once rather than once its lease expires."""
        self._stopping = True

    def end_rounds(self) -> None:
        """The cluster stops (before it gives up the leadership): no round at all from now,
        and a round under way computes no order: a leader's stops before its next call of
        etcd (a save of its tags under way, one transaction, ends first), and one that
        computed its order already applies none of it once the leadership is given up."""
        self.begin_stop()
        self._ended = True

    def _rounds_ended(self) -> bool:
        return self._ended

    @property
    def round_running(self) -> bool:
        """A round is under way (a report on its way, a leader's round, its order to
        apply)."""
        return self._tick_lock.locked()

    async def finish_rounds(self, timeout_s: float) -> bool:
        """At a stop: start no report to the leader (:meth:`begin_stop`), and wait up to
        ``timeout_s`` for the round running (a report on its way, its order to apply) to
        end; False if it still runs (it is then left running: its thread cannot be cut
        off, and what it would do once the cluster stopped is skipped)."""
        self.begin_stop()
        try:
            await asyncio.wait_for(self._tick_lock.acquire(), timeout=timeout_s)
        except TimeoutError:
            return False
        self._tick_lock.release()
        return True

    async def _tick(self) -> None:
        info = self.election.state()
        self._forget_held(info)  # a leader change the election saw between rounds too
        report = await asyncio.to_thread(self.local_report)
        if self._stopping and not info.leading:
            return  # gpud stopped meanwhile: no report to the leader
        problem = self._credential_problem(self._wall())
        self._check_certificates()
        if problem != self._credential_logged:  # once, not every round
            if problem:
                log.error("cluster: %s", problem)
            self._credential_logged = problem
        if info.leading:
            if self.last_error_kind in LEADER_KINDS:
                # it leads: no leader to reach but itself (the previous one's error would
                # stay published while the new leadership settles)
                self._set_error(problem, OWN_CERTIFICATE if problem else "")
            try:
                # none once the cluster stops (it gives up the leadership). A round already
                # leading then ends at its next etcd call (_lead), and an order it computed
                # is not applied (no longer leading)
                order = (
                    None
                    if self._ended
                    else await asyncio.to_thread(self._lead, info.epoch, info.lease, report)
                )
            except GpudError as err:
                full = isinstance(err, StoreFull)
                self._note_error(
                    f"leader round failed: {err}", STORE_FULL if full else LEADER_ROUND
                )
                if full:
                    self._alarms_read_at = None  # read the alarms in this round
                order = None
            if order is None and (wait := self._settled_at - self._clock()) > 0:
                # a new leadership, or one resumed: its first round once it has settled,
                # not a tick later
                self.request_round(wait)
            if (
                order is not None
                and self.election.state().leading
                and self._apply(order.for_jobs(j.job for j in report.jobs), info)
            ):
                # peers cannot connect to a leader whose certificate expired: say why
                self._set_error(problem, OWN_CERTIFICATE if problem else "")
        else:
            with self._lock:
                self._aggregator = None  # soft state: a later leadership starts afresh
            if info.leader and info.leader != self.node and info.address and self._peers:
                await self._follow(info, report, problem)
            elif info.leader == self.node:
                self._note_error(
                    f"the leader key names {self.node} at {info.address or '?'}, but this gpud "
                    "does not hold it: another gpud under the same cluster.node (names "
                    "compare without case), or this one's previous run until its lease expires",
                    LEADER_KEY_HELD,
                )
            elif not info.leader:
                # none to report to (etcd names no leader): an error about the last one is
                # no longer the node's problem; the election's detail says why none leads
                self._set_error(problem, OWN_CERTIFICATE if problem else "")
        if self._ended:
            return  # the cluster stopped meanwhile: no etcd call (the alarms) after a cut
        self._update_mode(info)
        await self._read_alarms()
        if not self._stopping:  # the stop withdraws it (close)
            await self._publish_problem()

    async def _follow(self, info: LeaderInfo, report: NodeReport, problem: str) -> None:
        """Report to the leader and apply its answer.

        The leader is the one the election names, unless that one answered that it does
        not lead and named another (:class:`NotLeader`): this node's view of etcd is
        behind the refusing node's (etcd unreachable from here, or the watch not fired
        yet), and a follower cut off from etcd would otherwise hold and then fall back to
        its local policy although a leader is reachable. The name is only a hint, checked
        before it is trusted: the report goes over mutual TLS to a certificate that must
        name that node (a member of the cluster); the node answers only while it leads by
        its own lease in etcd; and its order passes the fence only with an epoch >= the
        newest applied and, of the same epoch on another lease, not at all (never as "the
        leader etcd names now", which only this node's own election says). One hop: a hinted node that names yet another is not followed.
        The hint holds while the election names the same leader in the same epoch; a
        failure drops it.
        """
        assert self._peers is not None
        named = (info.leader, info.epoch)
        hint = self._hinted(info)
        self._hint = None if hint is None else self._hint
        leader, address = (hint.leader, hint.address) if hint else (info.leader, info.address)
        try:
            order = await self._peers.report(address, leader, report)
        except GpudError as err:
            if (
                isinstance(err, NotLeader)
                and hint is None
                and err.address
                and err.leader not in ("", info.leader, self.node)
            ):
                log.info(
                    "cluster: %s does not lead (etcd names it here): reporting to %s at %s, "
                    "the leader it names",
                    info.leader,
                    err.leader,
                    err.address,
                )
                self._hint = (named, LeaderHint(err.leader, err.address, self._wall()))
                await self._follow(info, report, problem)  # once: a hint is not followed on
                return
            self._hint = None
            # the handshake error says little ("Socket closed"); an expired certificate
            # of this node is known here, so the error names it
            self._note_error(f"{err}; {problem}" if problem else str(err), report_error_kind(err))
            return
        if order is None:  # a new leader has not folded our report in yet
            self.request_round(RETRY_S)
        elif not self._apply(order, info):  # its own error: stale, or refused
            if hint is not None:
                self._hint = None  # an order the fence refused: no better than the election's
            return
        self._set_error("", "")  # the leader answered: nothing keeps this node from it

    def _hinted(self, info: LeaderInfo) -> LeaderHint | None:
        """The leader followed instead of the one ``info`` names, if any: a hint holds only
        while the election names the same leader in the same epoch."""
        hint = self._hint  # read once: a round may replace it meanwhile
        if info.leading or hint is None or hint[0] != (info.leader, info.epoch):
            return None
        return hint[1]

    def _check_certificates(self) -> None:
        """A certificate expiring within two weeks (or expired): logged and an event, once
        (the files are read once an hour at most)."""
        if self._certs is None:
            return
        for message in self._certs.check(self._wall()):
            log.warning("cluster: %s", message)
            if self._events is not None:
                self._events.emit("cluster.certificate_expiry", message)

    async def _read_alarms(self) -> None:
        """etcd's alarms, every ``ALARM_CHECK_S``, and every round while one is raised so
        that the node sees its disarm at once; a change is logged and an event."""
        if self._alarms is None:
            return
        now = self._clock()
        last = self._alarms_read_at
        if not self.etcd_alarms and last is not None and now - last < ALARM_CHECK_S:
            return
        self._alarms_read_at = now
        try:
            alarms = await asyncio.to_thread(self._alarms.alarms)
        except GpudError as err:  # etcd unreachable: the election's detail says so
            log.debug("cluster: cannot read etcd's alarms: %s", err)
            # what was read stays in the status, but no gauge says it is raised now: a
            # node cut off from etcd would hold the cluster's alarm alert after a disarm
            self.etcd_alarms_read = False
            return
        self.etcd_alarms_read = True
        if alarms == self.etcd_alarms:
            return
        self.etcd_alarms = alarms
        if NOSPACE in alarms:
            message = NOSPACE_ADVICE
        elif alarms:
            message = f"etcd raised the alarm {', '.join(alarms)} (etcdctl alarm list)"
        else:
            message = "etcd's alarms are cleared: it accepts writes again"
        (log.error if alarms else log.info)("cluster: %s", message)
        if self._events is not None:
            self._events.emit("cluster.etcd_alarm", message, alarms=",".join(alarms))

    async def _publish_problem(self) -> None:
        """This node's ``last_error`` where every node can read it (:mod:`problems`): on a
        change, and again every ``REPUBLISH_S`` while it lasts (its lease)."""
        if self._problems is None:
            return
        message, kind = self.last_error, self.last_error_kind
        # the entry's lease runs on etcd's clock: republished by this node's clock that
        # never goes back, as a wall clock stepped back (NTP, date -s) would hold it back
        # past its lease; the wall clock says only since when the problem lasts
        now = self._clock()
        mode = self.mode.value if message else ""  # said with a problem, republished on a change
        if message != self._problem_text:
            self._problem_text, self._problem_since = message, self._wall()
        if (message, kind, mode) == self._published and (
            not message or now - self._published_at < problems.REPUBLISH_S
        ):
            return
        board, was = self._problems, self._key_instance(*self._published[:2])
        instance = self._key_instance(message, kind)
        try:
            if message and self._published[0] and instance != was:
                # the entry changes key (refused as a duplicate, or no longer): the one
                # under the old key goes, or it would linger for its lease; only as far as
                # this process's lease still holds it (the other gpud may have written it)
                await asyncio.to_thread(board.clear, self.node, instance=was)
            if message:
                by = Writer(instance, mode, self.gpud)
                await asyncio.to_thread(
                    board.publish, self.node, message, self._problem_since, kind, by
                )
            else:
                await asyncio.to_thread(board.clear, self.node, instance=was)
        except GpudError as err:  # etcd unreachable: the election's detail says so
            log.debug("cluster: cannot publish this node's problem: %s", err)
            return
        self._published, self._published_at = (message, kind, mode), now

    def _key_instance(self, message: str, kind: str) -> str:
        """The instance a problem ``message`` of ``kind`` is published under: this gpud's
        where the leader refused it as a second one under the node's name (the gpud it
        takes keeps the node's own entry), else none. Not with leader_key_held: the key's
        holder may as well be this gpud's own previous run (killed while it led), which
        gpud cannot tell from another gpud."""
        return self.instance if message and kind == DUPLICATE_NODE else ""

    async def close(self) -> None:
        """A clean stop: withdraw this node's published problem at once, so that no node
        lists it for the rest of its lease (a killed gpud cannot; its lease expires)."""
        if self._problems is None:
            return
        try:
            await asyncio.to_thread(self._problems.close)
        except GpudError as err:
            log.warning("cluster: cannot withdraw this node's problem from etcd: %s", err)

    async def node_problems(self) -> tuple[list[Problem], str]:
        """Every node's published problem (none with ``election = "single"``), and why they
        could not be read, in store_state's words ("" when read: the caller judges the
        list by its own reading of the election, :meth:`status_with_nodes`)."""
        if self._problems is None:
            return [], ""
        try:
            return await asyncio.to_thread(self._problems.read), ""
        except GpudError as err:
            log.debug("cluster: cannot read the nodes' problems: %s", err)
            return [], store.store_state(err)

    def _note_error(self, message: str, kind: str) -> None:
        """``message`` as ``last_error`` (logged when it changed), ``kind`` what it is."""
        if message != self.last_error:
            log.warning("cluster: %s", message)
        self._set_error(message, kind)

    def _set_error(self, message: str, kind: str) -> None:
        self.last_error, self.last_error_kind = message, kind

    def _lead(self, epoch: int, lease: int, report: NodeReport) -> Order | None:
        """A leader's round: the order of ``epoch``, or None while a new leadership settles.

        A new leader knows only its own report. An order computed from it would rank the
        jobs of this node alone, and applying or handing it out would change levels on
        the wire for the moment until the other nodes' reports arrive: so for ``settle_s``
        (one tick plus the report timeout) after it begins leading, a new leader only
        collects reports, answers "no order yet", and every node, this one included,
        keeps its last order. Every live node reports within that time: once per tick,
        each report within the report timeout. Time alone ends the wait, so a node that
        never reports (the old leader, killed) cannot keep the cluster without an order.

        A leadership resumed from a suspend within its lease waits as long again: by the
        clock that counts the suspend, every other node's report is too old to count, and
        an order at once would rank this node's jobs alone. It waits only when its last
        order folded in other nodes and none of their reports is fresh now: a round that
        came late (a slow daemon pass) while they kept reporting orders at once.
        """
        now = self._clock()
        with self._lock:
            agg = self._aggregator
            new_leadership = agg is None or self._agg_leadership != (epoch, lease)
            last = now if self._led_at is None else self._led_at
            if agg is None or new_leadership:
                agg = self._aggregator = Aggregator(
                    leader=self.node,
                    leveller=Leveller(self._leveller),
                    tags=self._tag_store(epoch, lease),
                    node_timeout_s=self._node_timeout_s,
                    reserved=self._reserved,
                    # leading the same epoch again (a renewal came late, then etcd renewed
                    # the lease): its sequence goes on, or every node would refuse it
                    after=self._issued,
                    lease=lease,
                    # no other leader seen by this node since its last leadership (or _held
                    # would be empty): a tag etcd lacks was lost by etcd (restored from a
                    # snapshot, wiped), not released by a successor, whatever the epoch
                    held=self._held[1],
                )
                self._agg_leadership = (epoch, lease)
                resumed = False
            else:
                # its last round is older than the node timeout, and so is every other
                # node's report, though its last order had some: the host was suspended
                resumed = (
                    now - last > self._node_timeout_s
                    and agg.included_others()
                    and not any(n.node != self.node for n in agg.nodes(now))
                )
            if new_leadership or resumed:
                self._settled_at = now + self._settle_s
            if self._settle_s > 0 and new_leadership:
                log.info(
                    "cluster: leading epoch %d; the first order in %.1f s, once the "
                    "nodes have reported (the last order stays in force until then)",
                    epoch,
                    self._settle_s,
                )
            elif self._settle_s > 0 and resumed:
                log.info(
                    "cluster: no round of epoch %d for %.1f s (a suspend?); the next order in "
                    "%.1f s, once the nodes have reported again",
                    epoch,
                    now - last,
                    self._settle_s,
                )
            self._led_at = now
        # Outside the lock: peers' reports keep arriving (on the event loop) while the
        # round computes; a report is one dict assignment, and a round reads a copy.
        agg.receive(report, now)
        if now < self._settled_at:
            return None
        try:
            # a stop (end_rounds) cuts the round between its etcd calls, slow as etcd is,
            # rather than wait for them all: the leadership is given up next
            order = agg.compute(epoch, now, wall=self._wall(), cut=self._rounds_ended)
        except RoundCut as cut:
            log.info("cluster: %s: the cluster stops", cut)
            if agg.republished:  # cut after the save that wrote them back: etcd has them
                self._say_republished(agg.republished)
            return None
        self._issued = (order.epoch, order.seq)
        with self._lock:  # seen_leader may forget the last leadership's meanwhile
            self._held = ((epoch, lease), agg.held())
        if agg.republished:
            self._say_republished(agg.republished)
        return order

    def _say_republished(self, tags: Mapping[str, int]) -> None:
        listed = ", ".join(f"{job}={dscp}" for job, dscp in sorted(tags.items()))
        count = f"{len(tags)} DSCP tag{'s' if len(tags) > 1 else ''}"
        message = (
            f"etcd had lost {count} this node gave out in its last leadership, no other "
            "leader seen by this node since (restored from a snapshot, or a new etcd): "
            f"written back, {listed}"
        )
        log.warning("cluster: %s", message)
        if self._events is not None:
            self._events.emit("cluster.tags_republished", message, jobs=len(tags))

    def receive(
        self, report: NodeReport, *, peer: str = "", left_out: Sequence[LeftOutJob] = ()
    ) -> Order | None:
        """A peer's report (peer servicer; ``peer``: its address): kept for the next
        round; the answer is the latest order for its jobs, None until a round has
        included it. ``left_out``: the jobs the servicer took out of it, their names
        refused (logged in one line when one is new to the node's last report)."""
        info = self.election.state()
        if report.node != node_name(report.node):
            # one node however a peer spells it (an older gpud sends cluster.node as
            # configured): keyed, compared and shown in lower case
            report = dataclasses.replace(report, node=node_name(report.node))
        with self._lock:
            agg = self._aggregator
        if not info.leading:
            if info.leader == self.node:
                # restarted within its previous run's lease (an upgrade, a kill -9): no
                # hint, the node that reports knows the key's holder already
                raise LeaderNotReady(
                    f"{self.node} does not lead yet: the leader key still names it, held by "
                    "its previous run (or another gpud under the same cluster.node) until "
                    "that lease expires, within cluster.lease_ttl_s"
                )
            leader = f"; the leader is {info.leader} at {info.address}" if info.leader else ""
            raise NotLeader(
                f"{self.node} does not lead{leader}", leader=info.leader, address=info.address
            )
        if agg is None:
            # elected a moment ago, its first round not begun: "no order yet", as while
            # it settles (the node reports again shortly); the round begins now
            self.request_round(0.0)
            return None
        try:
            if report.node == self.node:
                raise DuplicateNode(
                    f"node {report.node!r} is reported by two gpuds, this one and the leader "
                    f"at {info.address}: give each its own cluster.node (names compare "
                    "without case)",
                    node=report.node,
                )
            new = agg.receive(report, self._clock(), peer=peer, left_out=[j.job for j in left_out])
        except FailedPrecondition as err:
            if report.node not in self._duplicates:  # once: it is refused every tick
                self._duplicates.add(report.node)
                log.warning("cluster: refused a report from %s: %s", peer or "?", err)
            raise
        if new:  # the node sends them every tick: said when one is new to its last report
            fresh = set(new)
            log.warning(
                "cluster: left %d job(s) out of the report of node %s (%s), its other jobs"
                " taken, no order naming them; new since its last report: %s",
                len(left_out),
                report.node,
                peer or "?",
                left_out_said([j for j in left_out if j.job in fresh]),
            )
        answer = agg.answer(report.node)
        if answer is None and self._clock() >= self._settled_at:
            # a node new to this leader (a failover): fold it in now, not at the next tick
            # (a leadership still settling has its round scheduled already)
            self.request_round(0.0)
        return answer

    def seen_nodes(self) -> list[NodeSeen]:
        """Nodes heard from (peer servicer; the leader only)."""
        info = self.election.state()
        with self._lock:
            agg = self._aggregator
            if not info.leading or agg is None:
                raise FailedPrecondition(f"{self.node} does not lead")
            return agg.nodes(self._clock())

    async def status_with_nodes(self) -> ClusterStatus:
        """:meth:`status`, with every node's published problem; on a follower, with the node
        list asked of the leader it reports to (the hinted one while it follows a hint)."""
        status = self.status()
        found, unread = await self.node_problems()
        state = ""
        if self._problems is not None:
            # the list can be trusted (ClusterStatus.problems_state) unless unread, or etcd
            # is out of space (no node can record a new one), by the status's own reading
            full = NOSPACE in status.etcd_alarms or status.info.store_state == store.STORE_FULL
            state = unread or (store.STORE_FULL if full else store.STORE_OK)
        status = dataclasses.replace(status, problems=tuple(found), problems_state=state)
        info, hint = status.info, status.hint
        leader, address = (hint.leader, hint.address) if hint else (info.leader, info.address)
        if info.leading or not (leader and address and self._peers):
            return status
        try:
            nodes = await self._peers.nodes(address, leader)
        except GpudError:
            return status  # the leader is unreachable: the mode and detail say so
        return dataclasses.replace(status, nodes=tuple(nodes))

    def read_order(self, node: str, jobs: Iterable[str]) -> Order | None:
        info = self.election.state()
        with self._lock:
            agg = self._aggregator
            if not info.leading or agg is None:
                raise FailedPrecondition(f"{self.node} does not lead")
            order = agg.order
        return order.for_jobs(jobs) if order is not None else None

    def _apply(self, order: Order, info: LeaderInfo) -> bool:
        """Apply ``order``; False if it was stale or the traffic service refused it.
        ``info``: the election's view the order was asked under."""
        newest = self.fence.epoch
        leader = node_name(order.leader)  # an older leader signs as configured
        elected = info.epoch if leader == (self.node if info.leading else info.leader) else 0
        other = self.fence.other_leadership(order)
        if not self.fence.admit(order, elected=elected):
            rejected = f"order {order.epoch}.{order.seq} (epoch.seq) from {order.leader or '?'}"
            if other:  # a fresh etcd gave another leader key this epoch: seqs do not compare
                why = (
                    f"epoch {order.epoch} on lease {order.lease:x} is not the leadership etcd"
                    f" names (lease {self.fence.lease:x} is in force)"
                )
            else:
                why = f"{self.fence.epoch}.{self.fence.seq}, newer, is in force"
            log.warning("cluster: rejected %s: %s", rejected, why)
            if self._events is not None:
                self._events.emit(
                    "cluster.stale_order",
                    f"rejected {rejected}: {why}",
                    epoch=order.epoch,
                    leader=order.leader,
                )
            # no contact: the node holds the order in force, then falls back to its local
            # policy, and says why (logged above, every time)
            self._set_error(f"rejected the {rejected}: {why}", STALE_ORDER)
            return False
        if (order.epoch, order.lease) != self._held[0] and self._held[1]:
            # another leadership came after this node's: it may have released or moved
            # the tags this node held, so etcd's are the truth from now on
            self._held = ((0, 0), {})
        restart = order.epoch < newest
        if restart:
            log.warning(
                "cluster: etcd names %s the leader in epoch %d, below the newest applied, %d: "
                "etcd's revisions went back (restored from a snapshot, or a new etcd); "
                "following it",
                order.leader,
                order.epoch,
                newest,
            )
        result = self._traffic.apply_order(order.epoch, order.levels, order.tags, restart=restart)
        if not result.applied:
            # The previous order stays in force: not a contact, so the node holds it and
            # then falls back to its local policy rather than claim to follow an order it
            # does not enforce (a leader with more levels or another DSCP pool).
            self._note_error(
                f"traffic service refused the order of epoch {order.epoch} from "
                f"{order.leader or '?'}: {result.reason}",
                ORDER_REFUSED,
            )
            return False
        previous = self.order
        # a new leader or epoch: another lease of the same epoch is another leadership
        new_leadership = previous is None or (previous.epoch, previous.lease) != (
            order.epoch,
            order.lease,
        )
        changed = (
            previous is None
            or new_leadership
            or set(previous.attributes) != set(order.attributes)
            or any(not _same(a, previous.attributes.get(j)) for j, a in order.attributes.items())
        )
        self.order = order
        self._order_cleared = False
        self.fail_static.contact(self._clock())
        if new_leadership and self._events is not None:
            self._events.emit(
                "cluster.epoch",
                f"applying the orders of {order.leader}, epoch {order.epoch}",
                epoch=order.epoch,
                leader=order.leader,
            )
        if changed:  # wake the attribute watchers
            self._changed.set()
            self._changed = asyncio.Event()
        return True

    def _update_mode(self, info: LeaderInfo) -> None:
        # the leader key naming this node while this gpud does not hold it is no leader
        # to follow: another gpud under the same name, or this one's previous run
        followable = bool(info.leader) and info.leader != self.node
        mode = self.fail_static.mode(self._clock(), leading=info.leading, leader_known=followable)
        if mode == self.mode:
            return
        previous, self.mode = self.mode, mode
        if mode is Mode.LOCAL and self.order is not None:
            self._traffic.clear_order()
            self._order_cleared = True
        message = {
            Mode.LEADER: "leading the cluster",
            Mode.FOLLOWER: "following the cluster leader",
            Mode.HOLDING: "no leader reachable: keeping the last order",
            Mode.LOCAL: "no leader within the grace period: local policy",
        }[mode]
        log.info("cluster: %s (was %s)", message, previous.value)
        if self._events is not None:
            self._events.emit(
                "cluster.mode",
                message,
                mode=mode.value,
                previous=previous.value,
                epoch=self.fence.epoch,
            )

    # -- reads ---------------------------------------------------------------------------

    def attributes(self, jobs: Iterable[str] = ()) -> tuple[int, int, list[JobAttributes]]:
        """(epoch, seq, attributes) of this node's jobs as of the last applied order."""
        order = self.order
        if order is None:
            return 0, 0, []
        wanted = set(jobs)
        return (
            order.epoch,
            order.seq,
            [a for j, a in sorted(order.attributes.items()) if not wanted or j in wanted],
        )

    async def watch(
        self, jobs: Iterable[str] = ()
    ) -> AsyncIterator[tuple[int, int, list[JobAttributes]]]:
        """The attributes now, then again each time an applied order changes them."""
        wanted = list(jobs)
        last: tuple[int, int, list[JobAttributes]] | None = None
        while True:
            changed = self._changed
            current = self.attributes(wanted)
            if (
                last is None
                or current[0] != last[0]
                or any(not _same(a, b) for a, b in zip(current[2], last[2], strict=False))
                or len(current[2]) != len(last[2])
            ):
                last = current
                yield current
            await changed.wait()

    def status(self) -> ClusterStatus:
        info = self.election.state()
        now = self._clock()
        last = self.fail_static.last_contact
        with self._lock:
            agg = self._aggregator if info.leading else None
            nodes = tuple(agg.nodes(now)) if agg is not None else ()
            everything = agg.order if agg is not None else None
        source = everything if everything is not None else self.order
        jobs = tuple(sorted(source.attributes.values(), key=lambda a: a.job)) if source else ()
        return ClusterStatus(
            election=self.election_kind,
            node=self.node,
            info=info,
            mode=self.mode,
            applied_epoch=self.fence.epoch,
            applied_seq=self.fence.seq,
            last_order_age_s=None if last is None else now - last,
            grace_s=self.fail_static.grace_s,
            rejected_orders=self.fence.rejected,
            nodes=nodes,
            jobs=jobs,
            last_error=self.last_error,
            last_error_kind=self.last_error_kind,
            etcd_alarms=self.etcd_alarms,
            etcd_alarms_read=self.etcd_alarms_read,
            certificates=self._certs.expiries(self._wall()) if self._certs is not None else (),
            hint=self._hinted(info),
        )

    def levels(self) -> Mapping[str, int]:
        return dict(self.order.levels) if self.order is not None else {}
