"""The node's traffic service: progress reports in, priorities on the wire out.

Each tick (:meth:`TrafficService.tick`, the daemon's ``traffic`` step)::

    registered jobs ──> tags (persisted; released when a job is removed) ──> cgroups
    reports ──> ProgressTracker.rates ──> Leveller (or the cluster's order) ──> job -> level
        (every registered job's progress is kept and shown; only tagged jobs are ranked)
    (links, tags, levels, shares) ──> tcplan.plan ──> per interface: diff with the kernel
        ──> the fewest tc operations, one batch      (drift: repaired and logged as events)
    job cgroups + tags ──> gpud's nftables table    (packets of `gpuctl run` jobs marked)
    level -> NIC priority ──> the RDMA NIC's DSCP -> priority map (dcb app, or dry-run;
        written by a worker thread with the latest map: the tick never waits for the NIC)
    class counters ──> per-job and per-level bytes, packets, drops

Each interface is enforced on its own: a missing interface, a kernel without HTB or a
netlink error is that interface's error (shown by ``gpuctl net show`` and in metrics), and
the others stay enforced. A missing ``nft`` is the marking's error, nothing else's.

Restarts: the kernel keeps the last tree and the nftables table (``kill -9`` included).
The next start reads them back and adopts them: levels found in the kernel hold for jobs
whose progress is not known again yet, so nothing is rebuilt or reshuffled; the first pass
removes what belonged to jobs gone meanwhile and says what it kept and removed (event
``net.takeover``). On a clean stop, ``traffic.shutdown = "fail-static"`` (the default)
leaves everything in force; ``"restore"`` deletes gpud's root qdisc and table and
re-installs the root the interface had before gpud first took it
(:class:`gpud.net.shaped.ShapedInterfaces` keeps it across restarts), but on a netdev
deleted and created again since then, which never had it, removes gpud's tree only. An
interface an earlier run shaped that is no longer configured loses gpud's root at start.

Thread-safety: reports and API calls come from gRPC worker threads, the tick from the loop's
worker thread; one lock guards the state, another the nftables table, whose ``nft`` runs
outside the first. The NIC map is written by a worker thread of its own (``dcb`` talks to
the NIC's firmware): the tick hands it the latest map and goes on.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from gpud.config import TrafficConfig, parse_rate
from gpud.errors import (
    DscpPoolExhausted,
    FailedPrecondition,
    GpudError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from gpud.events import EventLog
from gpud.net.cgroups import JobCgroups
from gpud.net.enforce import AdoptedLike, CountersLike, MarkPort, RdmaPort, RestoredLike, TcPort
from gpud.net.latest import LatestWorker
from gpud.net.port import (
    JobTraffic,
    LinkEnforcement,
    LocalReport,
    OrderResult,
    TrafficCounters,
    TrafficSummary,
)
from gpud.net.shaped import ShapedInterfaces
from gpud.net.tagstore import TagStore
from gpud.pidns import local_pid
from gpud.shared import (
    MAX_IDEAL_S,
    MAX_SESSION_CHARS,
    MIN_IDEAL_S,
    check_text,
    first_few,
    format_number,
)
from netshaper import tcplan
from netshaper.dcb import DcbError, MapResult
from netshaper.ethtool import ifindex, link_running, link_speed_mbps
from netshaper.leveller import Leveller, LevellerConfig
from netshaper.nftables import DEFAULT_TABLE, FAMILY
from netshaper.progress import ProgressConfig, ProgressTracker
from netshaper.weights import demand_weights

log = logging.getLogger(__name__)

# a removed job's cgroup that still holds processes: how many of their PIDs an event names
_PIDS_SHOWN = 8
_UNTAGGED_SHOWN = 8  # jobs left without a tag in one pass, told one event each
_QUIET_SHOWN = 8  # jobs a spent pool's refusal names as held by their quiet time
_CHAINS_SHOWN = 8  # chains not gpud's removed from its nftables table, named in the event
# a job's demand is known once this many iterations were counted against its bytes
_DEMAND_MIN_ITERATIONS = 3
# a job's declared contention-free iteration time (ReportProgress) is held to
# gpud.shared's range, as gpuctl checks it too; the tracker takes a step faster than the
# minimum for a counter that leapt
# seconds between tries of a NIC map write that failed, while the map wanted stays the same
RDMA_RETRY_S = 10.0
# seconds between read-backs of a NIC map that was written (one `dcb app show` per netdev)
RDMA_RECHECK_S = 30.0
# seconds between two net.marking events that say gpud's nftables table was removed
# outside gpud: a firewall that flushes the whole ruleset on every tick is said once, then
# counted, not said once a tick (each restore is counted: gpud_net_marking_restores_total)
MARKING_RESTORE_SAID_EVERY_S = 60.0
# the index ``link_rate`` holds a rate under when the netdev was made again between its
# two ifindex reads (no ifindex is negative)
_REMADE = -1
# seconds the wall clock may run ahead of the monotonic one between two reads before the
# difference is time the node did not run (a suspend) or a clock stepped forward (behind
# it by as much: the wall clock stepped back)
CLOCK_GAP_S = 1.0
# a job that reports less often than traffic.idle_after_s is idle only after this many of
# its usual intervals between reports without one: one report missed is no end
QUIET_INTERVALS = 2.0
# ... but after no more than this many traffic.idle_after_s: a job that once reported
# seldom (a long pause, twice) neither holds a level nor keeps a tag from others for hours
QUIET_CAP_IDLES = 10.0
# reports that arrive within this of the one before them are one arrival (a batch: a job's
# processes reporting a moment apart): their interval is none of the job's cadence
_ONE_ARRIVAL_S = 0.5
# ... for at most this long from the batch's first (and traffic.idle_after_s over
# QUIET_INTERVALS, see TrafficService.__init__): reports that never pause are an arrival
# each, whose short interval is the job's cadence
_ARRIVAL_MAX_S = 5.0
# how far a late report's stamp, mapped on the monotonic clock, may fall after the newest
# report's: NTP slews the wall clock up to 500 ppm against the monotonic one, so a batch
# sent again seconds after it was taken maps a few ms off where it first did. A restart
# reports seconds after the newest report at the least
_LATE_SLACK_S = 0.05
# the most sessions of one job reporting at once (its ranks, each a Progress): one more is
# refused, so that a client making a session per report cannot grow gpud's memory. A node
# of 16 GPUs split into 7 MIG instances each runs 112 ranks, a rank to an instance: 256
# leaves room; each report looks at the job's live sessions
MAX_JOB_SESSIONS = 256
# a session silent for longer than this many of its usual intervals between arrivals (and
# at least _DROPOUT_MIN_S) while another of its job reports has dropped out: ranks of one
# job step together, so one that stopped reporting has stopped
_DROPOUT_INTERVALS = 3.0
_DROPOUT_MIN_S = 1.0


def leveller_config(t: TrafficConfig) -> LevellerConfig:
    """The policy ``[traffic]`` sets: each node's local leveller and the cluster leader's
    use the same levels and knobs."""
    return LevellerConfig(
        levels=t.levels,
        threshold=t.threshold,
        max_age_s=t.max_age_s,
        hysteresis=t.hysteresis,
        min_share=t.min_share,
        group_tolerance=t.group_tolerance,
    )


@dataclass(frozen=True, slots=True)
class Report:
    """One progress report, as the API receives it."""

    job: str
    iterations: int
    timestamp: float  # unix seconds
    ideal_s: float | None = None
    session: str = ""


@dataclass(frozen=True, slots=True)
class Rejected:
    index: int
    job: str
    error: GpudError


@dataclass
class InterfaceStatus:
    name: str
    rate_bps: int = 0
    enforced: bool = False
    error: str = ""
    repairs: int = 0


class _Pending(NamedTuple):
    """A new session's first report, below its job's count: until the session's next
    arrival tells whether it restarted the job or is a rank behind."""

    iterations: int
    stamp: float  # its own stamp (unix seconds: the wall clock of the reporting process)
    heard_at: float  # when it arrived (gpud's monotonic clock)


class _Session(NamedTuple):
    """One session's last report (a ``Progress``: one process, one rank of its job)."""

    iterations: int
    stamp: float  # its own stamp (unix seconds), to know a report sent again for one
    last_report_at: float  # its newest stamp on the monotonic clock (_JobReports)
    heard_at: float  # when it arrived (the monotonic clock)
    # its last interval between arrivals (reports of one batch are one arrival); None: one
    # arrival so far
    usual_s: float | None = None
    # a new session whose first report was below the job's count: that report
    pending: _Pending | None = None

    def dropped_out(self, heard: float) -> bool:
        """Whether this session, silent since, has dropped out of its job when another
        session of it reports at ``heard`` (the monotonic clock)."""
        usual = self.usual_s if self.usual_s is not None else 0.0
        return heard - self.heard_at > max(_DROPOUT_MIN_S, _DROPOUT_INTERVALS * usual)


@dataclass
class _JobReports:
    # the job's count, as the tracker has it: the lowest of its live sessions' once that
    # passes it (ranks of one job: its count is its slowest rank's), or a restart's
    iterations: int
    # the session the count started from: the job's first, or the one that restarted it
    session: str
    # the newest stamp, on the service's monotonic clock: the arrival less how far the stamp
    # was behind the wall clock then. Shown mapped back to wall time at each read, so a wall
    # clock stepped back later neither puts the last report in the future nor makes it look
    # fresh for as long as the step
    last_report_at: float
    heard_at: float  # when the last report arrived (the service's monotonic clock)
    ideal_s: float | None = None
    # the last interval between two arrivals, and the job's usual one: the shorter of its
    # last two (one long silence is no cadence; two in a row are). None: not known yet
    interval_s: float | None = None
    usual_interval_s: float | None = None
    # when the first report of the last arrival (a batch) arrived; intervals run from it
    arrived_at: float = 0.0
    # told of as net.slow_reports: said once while gpud knows the job
    slow_said: bool = False
    # its sessions heard within traffic.progress_window_s (and since its last run ended),
    # the least recently heard first: reporting together, they are ranks of the job, not
    # restarts of it. Shared by the job's entries as it reports (only read under the lock)
    sessions: dict[str, _Session] = field(default_factory=dict)
    # the stamp the progress tracker was last told: it ignores one older than its newest
    told_at: float = -math.inf
    # the last count reported without a session (one shell-driven reporter) since the job
    # last restarted: such a report may not go below it
    bare: int | None = None

    @property
    def cadence_s(self) -> float | None:
        """The interval its quiet time is judged by: the usual one, or the one interval
        known while only one is."""
        return self.interval_s if self.usual_interval_s is None else self.usual_interval_s


def _intervals(
    prev: _JobReports | None, heard: float, longest: float
) -> tuple[float | None, float | None, float]:
    """The last interval between arrivals, the usual one (:class:`_JobReports`) and the
    last arrival's start, once a report arrives at ``heard`` after ``prev``. A report
    within :data:`_ONE_ARRIVAL_S` of the one before it joins that one's arrival (a batch),
    unless the batch began ``longest`` seconds ago or more: reports that never pause are
    an arrival each ``longest`` seconds, a short interval, not the one before them kept
    for good. Intervals run from an arrival's first report."""
    if prev is None:
        return None, None, heard
    if heard - prev.heard_at < _ONE_ARRIVAL_S and heard - prev.arrived_at < longest:
        return prev.interval_s, prev.usual_interval_s, prev.arrived_at
    interval = heard - prev.arrived_at
    usual = None if prev.interval_s is None else min(interval, prev.interval_s)
    return interval, usual, heard


def _progressed(now: _JobReports | None, end: float, then: _JobReports | None) -> bool:
    """Whether ``now`` (a job's last report) is progress after its run ended at ``end``
    with ``then`` its last report: stamped after the end, with more iterations or from
    another session. A report that only repeats the count (a last flush) is none."""
    return (
        now is not None
        and now.last_report_at > end
        and (then is None or now.iterations > then.iterations or now.session != then.session)
    )


class _Count(NamedTuple):
    """The job's count once one of its sessions reported (:func:`_job_count`)."""

    iterations: int
    session: str  # the session the count started from
    told: tuple[tuple[int, float], ...]  # (count, stamp) the progress tracker is told
    # the job restarted: its sessions that go on (those of the restarted job); empty: none
    restarted: tuple[str, ...] = ()


def _a_rank_beside(pending: _Pending, others: Iterable[_Session]) -> bool:
    """Whether any of ``others`` (a job's other live sessions) was heard since a moment
    (:data:`_ONE_ARRIVAL_S`) before the first report (``pending``) of a session that was
    below the job's count: ranks of one job report in the same cadence, a dead
    predecessor does not, so that session is a rank behind and restarts nothing."""
    since = pending.heard_at - _ONE_ARRIVAL_S
    return any(s.heard_at >= since for s in others)


def _job_count(
    prev: _JobReports | None, sessions: dict[str, _Session], session: str, heard: float
) -> _Count:
    """The job's count once ``session`` reported at ``heard`` (``sessions``: those heard
    within the window since its last run ended, that report among them).

    Its ranks' sessions move together, their counts a little apart: the job's count is
    their lowest live one's once that passes it, as synchronous training moves at its
    slowest rank's pace; a rank behind it (one just started) does not take it back. A
    session silent past a few of its intervals while this one reports has dropped out
    (:meth:`_Session.dropped_out`). The count goes back (the job restarted from a
    checkpoint) where every live session is below it, or where a new session's first
    report was below it (pending) and no other session was heard between that report (or
    a moment before it: :data:`_ONE_ARRIVAL_S`) and its next: ranks of one job report in
    the same cadence, a dead predecessor does not. That restart counts from the new
    session's first report."""
    me = sessions[session]
    if prev is None:
        return _Count(me.iterations, session, ((me.iterations, me.stamp),))
    names = [name for name, s in sessions.items() if name == session or not s.dropped_out(heard)]
    live = [sessions[name] for name in names]
    if (
        me.pending is not None
        and heard - me.pending.heard_at > _ONE_ARRIVAL_S
        and not _a_rank_beside(me.pending, (s for s in live if s is not me))
    ):
        told = ((me.pending.iterations, me.pending.stamp), (me.iterations, me.stamp))
        return _Count(me.iterations, session, told, (session,))
    lowest = min(live, key=lambda s: (s.iterations, -s.stamp))
    if max(s.iterations for s in live) < prev.iterations:
        lowest_told = ((lowest.iterations, lowest.stamp),)
        return _Count(lowest.iterations, session, lowest_told, tuple(names))
    if lowest.iterations > prev.iterations:
        return _Count(lowest.iterations, prev.session, ((lowest.iterations, lowest.stamp),))
    if prev.session not in sessions and me.iterations >= prev.iterations:
        # the session the count started from is gone (its run ended): the count goes on
        # from this one, which is progress after that end though it repeats the count
        return _Count(prev.iterations, session, ())
    return _Count(prev.iterations, prev.session, ())


class _Quiet(NamedTuple):
    """A job not in use (:meth:`TrafficService._quiet_left`)."""

    since: float  # when it was last used (the monotonic clock)
    left_s: float  # until it counts as idle; below 0: idle now


def _idle_since(quiet: Mapping[str, _Quiet | None]) -> dict[str, float]:
    """The jobs of ``quiet`` idle now, and since when."""
    return {job: q.since for job, q in quiet.items() if q is not None and q.left_s < 0}


def _sent_since(last: TrafficCounters | None, now: TrafficCounters) -> TrafficCounters:
    """What a class sent between two reads of its kernel counters: all of ``now`` when it
    was not read before or was made again since (its bytes went down: the kernel's counters
    start at 0 with a new class)."""
    base = last if last is not None and now.bytes >= last.bytes else TrafficCounters()
    return TrafficCounters(
        now.bytes - base.bytes, max(0, now.packets - base.packets), max(0, now.drops - base.drops)
    )


def _plus(a: TrafficCounters, b: TrafficCounters) -> TrafficCounters:
    return TrafficCounters(a.bytes + b.bytes, a.packets + b.packets, a.drops + b.drops)


class _WrittenNicMap:
    """What gpud last wrote in each netdev's APP table, to tell a change another tool
    made (``dcb app`` by hand, a DCBX agent) from gpud's own and from a table lost with
    its netdev (a driver reset, a VF re-created: back with an empty table)."""

    def __init__(self) -> None:
        self._every: dict[int, int] = {}  # on each netdev not apart
        # netdevs a write failed on since the last that held there: what of gpud's is
        # still known on each (``dcb`` may have written or not, the netdev may have gone)
        self._apart: dict[str, dict[int, int]] = {}
        self._all_apart = False  # a write failed without saying on which netdevs

    def write_backs(self, results: Iterable[MapResult]) -> int:
        """The entries of ``results`` that held, before the write, another priority than
        gpud last wrote for their DSCP, whatever gpud wants there now. An entry absent
        from a netdev a write failed on since is its lost table, not another tool's; a
        netdev made again since (``remade``) is a new one, of which nothing is known."""
        count = 0
        for r in results:
            if r.remade is not None:
                continue
            apart = self._all_apart or r.netdev in self._apart
            known = self._apart.get(r.netdev, self._every)
            for dscp in r.changed:
                last, held = known.get(dscp), tuple(r.before.get(dscp, ()))
                if last is not None and held != (last,) and (held or not apart):
                    count += 1
        return count

    def wrote(self, want: Mapping[int, int], failed: Iterable[str] | None = ()) -> None:
        """``want`` is in force on every netdev but ``failed`` (None: not said which)."""
        if failed is None:
            self._every = _kept(self._every, want)
            self._apart = {n: _kept(m, want) for n, m in self._apart.items()}
            self._all_apart = True
            return
        self._apart = {n: _kept(self._apart.get(n, self._every), want) for n in failed}
        self._every, self._all_apart = dict(want), False


def _kept(known: Mapping[int, int], want: Mapping[int, int]) -> dict[int, int]:
    # a write that failed may or may not have changed an entry it moved: only one it
    # wanted where it was is still known as gpud's
    return {d: p for d, p in known.items() if want.get(d) == p}


@dataclass(frozen=True)
class NetView:
    """Everything ``gpuctl net show`` prints."""

    enabled: bool
    jobs: tuple[JobTraffic, ...]
    shares: tuple[float, ...]
    level_counters: Mapping[int, TrafficCounters]
    interfaces: tuple[InterfaceStatus, ...]
    level_changes_total: int
    order_source: str
    epoch: int
    marking_error: str
    rdma_backend: str
    rdma_error: str
    untagged: Mapping[str, str] = field(default_factory=dict)
    """Registered jobs in use without a tag (``traffic.dscp_pool`` ran out), and why."""
    untagged_jobs: tuple[JobTraffic, ...] = ()
    """Those jobs' rows, by name: their progress as they report it; ``dscp`` 0 (the DSCP of
    untagged traffic) and no level, as their traffic is in the default class, whose counters
    are no job's."""
    idle_untagged: int = 0
    """Registered jobs without a tag that are not in use (they take one when they run)."""
    marking: bool = True
    """``traffic.marking``: whether gpud marks packets by cgroup at all."""
    rdma_repairs: int = 0
    """Writes of the NIC DSCP -> priority map that found an entry changed outside gpud
    (``dcb app show`` listing another priority, or none, on a DSCP gpud wrote on that
    netdev) and wrote it back."""
    marking_restores: int = 0
    """Times gpud's nftables table was found removed outside gpud (``nft flush ruleset``)
    and written again, each counted whether its ``net.marking`` event was said or not."""
    gap_spacings: float = 20.0
    """How many of its usual spacings a job goes without progress before it is stopped
    (``traffic.progress_gap_spacings``)."""


JobSource = Callable[[], Sequence[str]]
"""The registered jobs' names."""
ActiveSource = Callable[[], set[str]]
"""Jobs that hold a reservation now."""
LinkSpeed = Callable[[str], tuple[int | None, str]]
"""An interface's speed in Mb/s (None: unknown), and what gave it (for messages); raises
NotFound when there is no such interface, LinkDown when it has no speed because its link
is down."""


class LinkDown(FailedPrecondition):
    """The interface is there, its link down (no carrier, or set down by ``ip link``): the
    kernel gives it no speed until it is up again."""


def ethtool_speed(
    iface: str,
    *,
    speed: Callable[[str], int | None] = link_speed_mbps,
    running: Callable[[str], bool | None] = link_running,
) -> tuple[int | None, str]:
    """The link's speed as gpud's own network namespace sees it: /sys may be another
    namespace's (gpud started under ``nsenter --net=``), where the name is another link.
    A NIC without carrier reports SPEED_UNKNOWN to ``SIOCETHTOOL`` and no IFF_RUNNING."""
    mbit = speed(iface)
    if mbit is None:
        up = running(iface)
        if up is None:
            raise NotFound(f"{iface}: no such network interface")
        if not up:
            # a NIC whose cable or switch port is down at start: its speed comes with the
            # link, so the operator waits for it rather than pinning a rate in the config
            raise LinkDown(
                f"{iface}: link down (no carrier, or set down), so no speed to shape to:"
                " enforced once it is up (or set traffic.link_rates)"
            )
    return mbit, "ethtool"


def job_pool(config: TrafficConfig) -> frozenset[int]:
    from gpud.net.tagstore import parse_pool

    return parse_pool(config.dscp_pool, {*config.reserved_dscp, config.cnp_dscp})


class TrafficService:
    """See the module docstring. Implements :class:`gpud.net.port.TrafficPort`."""

    def __init__(
        self,
        config: TrafficConfig,
        *,
        tags: TagStore,
        events: EventLog,
        jobs: JobSource,
        active: ActiveSource = set,
        tc: TcPort | None = None,
        marker: MarkPort | None = None,
        cgroups: JobCgroups | None = None,
        rdma: RdmaPort | None = None,
        shaped: ShapedInterfaces | None = None,
        marking_error: str = "",
        rdma_error: str = "",
        link_speed: LinkSpeed = ethtool_speed,
        link_index: Callable[[str], int | None] = ifindex,
        proc_root: Path = Path("/proc"),
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: Unix time, what progress reports are stamped with. ``monotonic``:
        what ages are measured with (idle jobs, the levels' re-rank, the NIC map's retry),
        so a stepped wall clock neither holds them back nor hurries them. ``link_index``:
        a netdev's ifindex in gpud's network namespace (None: none by that name), which
        tells the netdev a link rate was read on from one made again under its name."""
        self.config = config
        self.tags = tags
        self._events = events
        self._jobs = jobs
        self._active = active
        self._tc = tc
        self._marker = marker
        self._cgroups = cgroups
        self._rdma = rdma
        self._shaped = shaped
        self._link_speed = link_speed
        self._link_index = link_index
        self._proc = proc_root
        self._clock = clock
        self._monotonic = monotonic
        self._lock = threading.RLock()
        self._io_lock = threading.Lock()  # the nftables table: one writer
        self._leveller = Leveller(leveller_config(config))
        self._tracker = ProgressTracker(
            ProgressConfig(
                window_s=config.progress_window_s,
                stall_iterations=config.progress_stall_iterations,
                long_window_s=config.progress_long_window_s,
                long_weight=config.progress_long_weight,
                gap_spacings=config.progress_gap_spacings,
            )
        )
        self._reports: dict[str, _JobReports] = {}
        # the longest arrival (a batch, see _intervals): reports that never pause are an
        # arrival this often, a cadence whose QUIET_INTERVALS fit in traffic.idle_after_s,
        # so that their quiet time is traffic.idle_after_s itself and never lengthened
        self._arrival_max_s = min(_ARRIVAL_MAX_S, config.idle_after_s / QUIET_INTERVALS)
        self._levels: dict[str, int] = {}
        self._level_changes = 0
        self._order: dict[str, int] | None = None
        self._epoch = 0
        self._adopted: dict[str, int] = {}  # levels found in the kernel at start
        self._ordered = False  # a cluster order was applied since the start
        # interface -> "ifindex NEW, was OLD": the name is another netdev's than the one
        # whose root qdisc gpud recorded (its original is not put on the new one)
        self._replaced: dict[str, str] = {}
        # gpud's tc objects found at start per interface, and whether gpud's nftables table
        # is still to be found: the first pass that enforces them says what it kept and
        # removed of what the run before left (event net.takeover)
        self._found: dict[str, tcplan.InterfaceState] = {}
        self._marks_found = False
        # job -> interface -> the level class its leaf sits under there: a level change
        # only changes the leaf's prio, in place (see netshaper.tcplan). Kept per interface:
        # a gpud killed in the middle of a sync that moved a leaf leaves it under one level
        # class on the interfaces synced and under another on the rest, and each is kept
        # where it is (its class and counters with it) rather than moved to one home
        self._homes: dict[str, dict[str, int]] = {}
        self._originals: dict[str, tcplan.RootQdisc | None] = {}
        self._last_plan: tcplan.TcPlan | None = None
        self._applied: dict[str, tcplan.InterfacePlan] = {}  # last plan in force, per iface
        # interface -> (the pass that last repaired it, passes running that did): another
        # tool that changes it back before every pass is said twice (net.drift), not once
        # a pass. Only a repair on the very next pass continues the run: a pass between
        # that moved the plan, failed or read no link rate says nothing of the tree's
        # fate, and two unrelated changes around it are each said plainly
        self._tc_pass = 0
        self._drift_run: dict[str, tuple[int, int]] = {}
        self._ifaces = {name: InterfaceStatus(name) for name in config.interfaces}
        # the rate each link's speed last gave, and the ifindex it was read on
        self._link_bps: dict[str, tuple[int | None, int]] = {}
        self._ever_enforced: set[str] = set()
        # (iface, job) -> what its leaves sent there while the job held them, from the
        # readings below: one sum per job, which survives its leaf being made again
        self._counters: dict[tuple[str, str], TrafficCounters] = {}
        # iface -> classid -> the kernel's counters of each job leaf at the last read. Kept
        # per class, not per job: a tag handed to another job at the same home level keeps
        # the class and its counters (netshaper.tcplan.diff), and the job taking it counts
        # from the class's reading then, not from 0 (what the job before sent, again).
        # Simpler than deleting and adding the class for its new job: no tc operation,
        # and no gap in shaping while the class is away
        self._last_read: dict[str, dict[int, TrafficCounters]] = {}
        # interfaces whose tree a run before left (adopted at start): their first reading
        # is the baseline, what the leaves carry from before gpud started is not counted
        self._baseline_due: set[str] = set()
        # interfaces the start could not read (missing, EBUSY, ENOBUFS): read again before
        # any pass on them, which would otherwise replace a root gpud never saw (so never
        # recorded) and count the leaves of a tree left by the run before from 0
        self._adopt_due: set[str] = set()
        # what each level's leaves sent since gpud started, each read counted at the level
        # its job had while it was sent: not the sum of the jobs at the level now, which
        # goes down when a job moves off it or goes (a Prometheus counter never does)
        self._level_sent: dict[int, TrafficCounters] = {}
        # iface -> job -> its level in the plan last enforced there: a pass that failed on
        # an interface left the kernel's levels as they were
        self._sent_at: dict[str, dict[str, int]] = {}
        self._demand_base: dict[str, tuple[int, int]] = {}  # job -> (bytes, iterations)
        self._marking_error = marking_error
        self._marking_ok = False
        # tables written again after a removal outside gpud: all of them, those since the
        # last net.marking that said one, the rules the last one wrote, and when (monotonic)
        # that event was said
        self._marking_restores = 0
        self._restores_unsaid = 0
        self._restore_rules = 0
        self._restore_said_at: float | None = None
        self._rdma_error = rdma_error
        self._rdma_map = _WrittenNicMap()
        # writes running that wrote the map back (the NIC map's worker's own): an agent
        # that changes it before every check is said twice, not once a write
        self._rdma_drift_run = 0
        self._rdma_repairs = 0  # writes that wrote an agent's change back, said or not
        self._rdma_posted: dict[int, int] | None = None  # as last handed to the worker
        self._rdma_tried_at = float("-inf")
        self._rdma_writer = LatestWorker(self._write_rdma, name="gpud-nic-map")
        self._known_jobs: set[str] = set()
        self._untagged: dict[str, str] = {}  # job -> why it has no tag (the pool ran out)
        self._cgroup_busy: set[str] = set()  # removed jobs whose cgroup still holds processes
        self._cgroup_seen: set[str] = set()  # tagged jobs whose cgroup the last pass found
        self._started_at = monotonic()
        self._clocks: tuple[float, float] | None = None  # (wall, monotonic) as last read
        self._tagged_at: dict[str, float] = {}  # job -> when it was last given its tag (monotonic)
        # job -> runs starting it (see starting): its tag is kept though it is not registered
        self._starting: dict[str, int] = {}
        # job -> when its last run ended (the monotonic clock; see run_ended) and its
        # reports then. A leaf lock: the jobs service says so inside its store transaction,
        # which the tick waits for holding self._lock
        self._ends: dict[str, tuple[float, _JobReports | None]] = {}
        # job -> when its last run ended: its sessions heard before it are no ranks of the
        # job any more. Unlike _ends, kept while a new run of it holds a reservation
        self._cutoffs: dict[str, float] = {}
        self._ends_lock = threading.Lock()
        # the jobs holding a reservation at the last tick: what views (net show, /metrics,
        # the cluster's report) judge "ended" by, so that none of them reads the store
        self._held: frozenset[str] = frozenset()
        # job -> the count of runs said (self._runs_said) at the last run start or end said
        # of it, and whether it was a start; under self._ends_lock. A start (run_started:
        # its devices reserved) is held now, though the last tick's read did not see it,
        # until a tick whose read began after it (a reservation rolled back is not in that
        # read) or that sees it held. An end (run_ended, no other run of the job holding)
        # is kept until a tick whose read of the reservations began after it: the tick
        # leaves out of its read those ended while it read
        self._runs: dict[str, tuple[int, bool]] = {}
        self._runs_said = 0  # run starts and ends said (run_started, run_ended)
        self.accepted_reports = 0
        self.rejected_reports = 0
        if config.enabled:
            # the store keeps the operator's level: only its use is clamped (see _pins), so
            # raising traffic.levels again brings the pin back
            lowest = config.levels - 1
            for job, level in sorted(self.tags.pins().items()):
                if level <= lowest:
                    continue
                message = (
                    f"job {job} was pinned to level {level}, beyond traffic.levels ="
                    f" {config.levels}: pinned to level {lowest}"
                )
                log.warning("traffic: %s", message)
                self._events.emit("net.pin", message, job=job, level=lowest, pinned=level)

    # -- progress reports ------------------------------------------------------------------
    def report(self, r: Report) -> None:
        """Check and record one report; raises (and changes nothing) when it is bad."""
        try:
            self._report(r)
        except GpudError:
            with self._lock:
                self.rejected_reports += 1
            raise

    def _report(self, r: Report) -> None:
        # nothing ranks jobs while traffic is off: a report accepted would read as acted on
        self._refuse_while_off("progress reports are not used")
        now = self._clock()
        if not r.job:
            raise InvalidArgument("must not be empty", field="job")
        if not math.isfinite(r.timestamp) or r.timestamp <= 0:
            raise InvalidArgument(
                f"must be unix seconds, got {r.timestamp}", field="timestamp_unix_seconds"
            )
        if r.timestamp > now + self.config.future_tolerance_s:
            raise InvalidArgument(
                f"{r.timestamp - now:.4g} s in the future (clock skew? allowed:"
                f" {self.config.future_tolerance_s:g} s)",
                field="timestamp_unix_seconds",
            )
        if r.ideal_s is not None and (
            not math.isfinite(r.ideal_s) or not MIN_IDEAL_S <= r.ideal_s <= MAX_IDEAL_S
        ):
            # a job that claims a microscopic iteration time would rank as the slowest
            # job for good, whatever it did
            raise InvalidArgument(
                f"must be {MIN_IDEAL_S:g}..{MAX_IDEAL_S:g} seconds, got {format_number(r.ideal_s)}",
                field="contention_free_iteration_s",
            )
        check_text(r.session, field="session", max_len=MAX_SESSION_CHARS)
        with self._lock:
            self._watch_clocks()
            if r.job not in self._known_jobs:
                self._require_job(r.job)
            self._known_jobs.add(r.job)
            prev = self._reports.get(r.job)
            heard = self._monotonic()
            stamped = heard - max(0.0, now - r.timestamp)
            own = prev.sessions.get(r.session) if prev is not None else None
            if own is not None and self._late(r, own, stamped):
                # a batch Progress sent again when gpud took it after the call's deadline:
                # nothing new, taken and not counted as an arrival (an arrival counted
                # would make the job's usual interval between reports that of the resend)
                self.accepted_reports += 1
                return
            # without a session (one shell-driven reporter), against the last such report
            before = own.iterations if own is not None else None
            if not r.session and prev is not None:
                before = prev.bare
            silent = (
                prev is not None
                and heard - prev.heard_at > self._quiet_s(prev)
                and r.job not in self._held_now()
            )
            waiting = None
            if before is not None and r.iterations < before:
                waiting = self._restart_awaiting(r, prev, heard, silent=silent)
                # at or above the restart's count, and not in the arrival of its first
                # report (one round of the job's reports): its next report, which
                # restarts the job (decided here: a report let through below the last
                # one without a session is one the count restarts from)
                if waiting is None or not (
                    waiting[1].iterations <= r.iterations
                    and heard - waiting[1].heard_at > _ONE_ARRIVAL_S
                ):
                    awaits = (
                        ""
                        if waiting is None
                        else f"; session {waiting[0]}'s restart awaits its next report"
                    )
                    raise InvalidArgument(
                        f"job {r.job!r}: {r.iterations} iterations after {before}"
                        f" (going backwards; a restarted job reports from a new session{awaits})",
                        field="iterations",
                    )
            sessions = self._live_sessions(r, prev, heard, silent=silent)
            mine = self._session_report(r, prev, own, stamped, heard)
            if waiting is not None:
                # the shell job that restarted with --session goes on without one: this is
                # that session's next report, the restarted job's count from now on
                sessions.pop(waiting[0], None)
                mine = mine._replace(pending=waiting[1])
            sessions.pop(r.session, None)  # the most recently heard last
            sessions[r.session] = mine
            if r.ideal_s is not None and (prev is None or prev.ideal_s != r.ideal_s):
                self._tracker.register(r.job, now=now, ideal_s=r.ideal_s)
            count = _job_count(prev, sessions, r.session, heard)
            told_at = prev.told_at if prev is not None else -math.inf
            for iterations, stamp in count.told:
                # a rank's stamp may be older than the newest the tracker has (another
                # rank's): told as that, it would be ignored as late
                told_at = max(told_at, stamp)
                self._tracker.report(r.job, iterations, told_at)
            if count.restarted:
                sessions = {name: sessions[name] for name in count.restarted}
                sessions[r.session] = mine._replace(pending=None)
            elif mine.pending is not None and heard - mine.pending.heard_at > _ONE_ARRIVAL_S:
                sessions[r.session] = mine._replace(pending=None)  # a rank behind
            bare = prev.bare if prev is not None and not count.restarted else None
            if prev is not None and silent:
                # it ended with its reports (see _ended_at): only progress runs it again.
                # An end it has progressed past (it ran again, then fell silent again) is
                # over: this one replaces it, else the count it reached since would read
                # as progress after the old end
                with self._ends_lock:
                    known = self._ends.get(r.job)
                    if known is None or _progressed(prev, *known):
                        self._ends[r.job] = (prev.heard_at, prev)
            interval, usual, arrived = _intervals(prev, heard, self._arrival_max_s)
            said = self._say_slow_reports(r.job, usual, said=prev is not None and prev.slow_said)
            self._reports[r.job] = _JobReports(
                count.iterations,
                count.session,
                max(stamped, prev.last_report_at) if prev else stamped,
                heard,
                r.ideal_s if r.ideal_s is not None else (prev.ideal_s if prev else None),
                interval,
                usual,
                arrived,
                said,
                sessions,
                told_at,
                bare if r.session else r.iterations,
            )
            self.accepted_reports += 1

    @staticmethod
    def _session_report(
        r: Report, prev: _JobReports | None, own: _Session | None, stamped: float, heard: float
    ) -> _Session:
        """``r``'s session once ``r`` arrived at ``heard`` (``own``: its last report, if
        live; ``stamped``: ``r``'s stamp on the monotonic clock)."""
        if own is None:
            below = prev is not None and r.iterations < prev.iterations
            pending = _Pending(r.iterations, r.timestamp, heard) if below else None
            return _Session(r.iterations, r.timestamp, stamped, heard, None, pending)
        gap = heard - own.heard_at
        return _Session(
            r.iterations,
            r.timestamp,
            max(stamped, own.last_report_at),
            heard,
            gap if gap > _ONE_ARRIVAL_S else own.usual_s,
            own.pending,
        )

    def _restart_awaiting(
        self, r: Report, prev: _JobReports | None, heard: float, *, silent: bool
    ) -> tuple[str, _Pending] | None:
        """The live session of ``r``'s job (heard within ``traffic.progress_window_s``,
        after the job's last run ended: :meth:`_prune`) whose restart awaits its next
        report (:attr:`_Session.pending`; the most recently heard), when ``r``, a report
        without a session (``gpuctl net report`` without ``--session``) arriving at
        ``heard``, is below the last such report: a shell job restarted with ``--session``
        soon after its last report without one, then reporting without it again. A session
        whose restart can no longer follow (another live session heard since its first
        report: it is a rank behind) awaits nothing. None where ``r`` has a session or no
        restart awaits. ``silent``: the job fell silent before ``r`` (no other session
        is live then)."""
        if r.session or prev is None:
            return None
        live = dict(prev.sessions)  # a report refused changes nothing
        self._prune(r.job, live, heard)
        # the reporter without a session is the one reporting; the dropped out are no ranks
        others = {
            name: s for name, s in live.items() if name and not silent and not s.dropped_out(heard)
        }
        for name, s in reversed(live.items()):
            ranks = (o for n, o in others.items() if n != name)
            if s.pending is not None and not _a_rank_beside(s.pending, ranks):
                return name, s.pending
        return None

    def _live_sessions(
        self, r: Report, prev: _JobReports | None, heard: float, *, silent: bool
    ) -> dict[str, _Session]:
        """``r``'s job's sessions other than ``r``'s that are live when ``r`` arrives at
        ``heard``: heard within ``traffic.progress_window_s``, after the job's last run
        ended, and not before a silence that ended it (``silent``). Sessions reporting
        together are ranks of one job: a new one with a lower count is a rank behind, not a
        restart, while any of the job's sessions is live. Raises ResourceExhausted when
        ``r`` is a new session over :data:`MAX_JOB_SESSIONS` live ones that have not
        dropped out (:meth:`_Session.dropped_out`; those that have are forgotten to make
        room) (call under the lock)."""
        if prev is None or silent:
            return {}
        live = prev.sessions
        self._prune(r.job, live, heard)
        if r.session not in live and len(live) >= MAX_JOB_SESSIONS:
            # ranks that stopped reporting hold no room from ones reporting now
            for name in [name for name, s in live.items() if s.dropped_out(heard)]:
                del live[name]
        if r.session not in live and len(live) >= MAX_JOB_SESSIONS:
            window = self._tracker.config.window_s
            raise ResourceExhausted(
                f"job {r.job!r}: {len(live)} sessions reported within"
                f" traffic.progress_window_s ({window:g} s), at most {MAX_JOB_SESSIONS}:"
                f" session {r.session!r} refused (each process reporting makes one Progress,"
                " not one per report)"
            )
        return live

    def _prune(self, job: str, sessions: dict[str, _Session], now: float) -> None:
        """Drop ``job``'s sessions that are not live at ``now`` (the monotonic clock):
        heard longer than ``traffic.progress_window_s`` ago, or before its last run ended
        (:meth:`run_ended`; kept past the tick that sees a new run held). ``sessions`` runs
        from the least recently heard, so this stops at the first live one."""
        window = self._tracker.config.window_s
        with self._ends_lock:
            cutoff = self._cutoffs.get(job, -math.inf)
            known = self._ends.get(job)
        if known is not None:
            cutoff = max(cutoff, known[0])
        while sessions:
            name, oldest = next(iter(sessions.items()))
            if now - oldest.heard_at <= window and oldest.heard_at > cutoff:
                return
            del sessions[name]

    @staticmethod
    def _late(r: Report, own: _Session, stamped: float) -> bool:
        """Whether ``r`` is one of its job's reports gpud already took, sent again
        (``own``: the newest of ``r``'s session; ``stamped``: ``r``'s stamp on the
        monotonic clock). Only a session (``Progress`` sends one per process) tells that a
        report is one the process sent before: without one, a lower count is a restart
        whatever its stamp. A lower count stamped before the session's newest is late only
        where its stamp maps on the monotonic clock to no later than the newest's: after
        the wall clock steps back, a report sent since is stamped before the newest too,
        but maps after it."""
        if not r.session:
            return False
        if r.iterations == own.iterations and r.timestamp == own.stamp:
            return True  # the newest itself, the last of its batch
        return (
            r.iterations < own.iterations
            and r.timestamp < own.stamp
            and stamped <= own.last_report_at + _LATE_SLACK_S
        )

    def _quiet_s(self, reports: _JobReports) -> float:
        """How long ``reports``' job may go without a report before it counts as idle
        (not ranked; ended when no run of it holds a reservation; its tag free to hand
        over): ``traffic.idle_after_s``, or :data:`QUIET_INTERVALS` of its usual interval
        between reports where that is longer (its one interval while only one is known),
        so that a job reporting less often than ``traffic.idle_after_s`` does not end and
        run again at each report; at most :data:`QUIET_CAP_IDLES` ``traffic.idle_after_s``,
        so one reporting less often than that does."""
        return self._quiet_for(reports.cadence_s)

    def _quiet_for(self, interval: float | None) -> float:
        """:meth:`_quiet_s` of a job whose usual interval between reports is ``interval``."""
        idle = self.config.idle_after_s
        if interval is None:
            return idle
        return max(idle, min(QUIET_INTERVALS * interval, QUIET_CAP_IDLES * idle))

    def _say_slow_reports(self, job: str, usual: float | None, *, said: bool) -> bool:
        """Event ``net.slow_reports``, once while gpud knows the job (``said``: it was
        told of since), when its usual interval between reports is known to exceed
        ``traffic.idle_after_s`` (call under the lock). Whether it was told of now or
        before."""
        idle = self.config.idle_after_s
        if said or usual is None or usual <= idle:
            return said
        quiet = self._quiet_for(usual)
        capped = (
            f" (at most {QUIET_CAP_IDLES:g} times traffic.idle_after_s)"
            if quiet < QUIET_INTERVALS * usual
            else ""
        )
        # capped below one interval, the quiet time ends it before each next report
        between = ", so it ends and runs again at each report" if quiet < usual else ""
        self._events.emit(
            "net.slow_reports",
            f"job {job} reports every {usual:.0f} s, less often than traffic.idle_after_s"
            f" ({idle:g} s): it counts as idle after {quiet:.0f} s without a report{capped}"
            f"{between}"
            " (raise traffic.idle_after_s, or report more often)",
            job=job,
            interval_s=round(usual, 3),
            quiet_s=round(quiet, 3),
        )
        return True

    def report_batch(self, reports: Sequence[Report]) -> tuple[int, list[Rejected]]:
        rejected = []
        for i, r in enumerate(reports):
            try:
                self.report(r)
            except GpudError as err:
                rejected.append(Rejected(i, r.job, err))
        return len(reports) - len(rejected), rejected

    def run_ended(self, job: str, since_end_s: float = 0.0, *, others_held: bool = False) -> None:
        """A run of ``job`` ended ``since_end_s`` seconds ago (its reservation was released,
        or its holder found gone). Until the job holds a reservation again or makes progress
        after it, ``gpuctl net show`` says it ended rather than stopped. ``others_held``:
        another run of the job still holds a reservation: the job runs on, and nothing
        changes. Takes no lock but its own: the jobs service calls it inside its store
        transaction (its reports are read without the state lock: each report replaces the
        job's entry whole).

        The views (``gpuctl net show``, /metrics, the cluster's report) count the job as
        ended from here on, without its level; the kernel keeps its tc leaf and nftables
        rule until the next tick, which counts the job as ended even where its read of the
        reservations was made before the release committed."""
        if others_held:
            # the job runs on: a run of it reserved since the last tick is still held
            return
        end = self._monotonic() - max(0.0, since_end_s)
        with self._ends_lock:
            self._ends[job] = (end, self._reports.get(job))
            # its sessions heard before are dead, also once a tick sees a new run held
            self._cutoffs[job] = end
            # the last tick's read of the reservations still has it: read by the views, it
            # would say the job runs, at its level, until the next tick
            self._held = self._held - {job}
            self._runs_said += 1
            self._runs[job] = (self._runs_said, False)

    def run_started(self, job: str) -> None:
        """A run of ``job`` reserved its devices: it has not ended, and holds a reservation
        from now on for every view (whatever the last tick saw). Takes no lock but its own,
        as :meth:`run_ended`."""
        with self._ends_lock:
            # its end is kept: this reservation may yet be rolled back (a disk full), and
            # the tick drops the end once its read sees the job held. Its count goes: a
            # tick whose read began before the end and sees the job held may be seeing
            # this run, which the tick after reads again either way
            self._runs_said += 1
            self._runs[job] = (self._runs_said, True)

    def _held_now(self) -> frozenset[str]:
        """The jobs holding a reservation: those the last tick saw, and those whose run
        started since (:meth:`run_started`), without reading the store."""
        with self._ends_lock:
            return self._held | {job for job, (_, started) in self._runs.items() if started}

    def _ended_at(self, job: str, active: Set[str]) -> float | None:
        """When ``job``'s last run ended (the monotonic clock), where it holds no
        reservation (``active``: the jobs that do) and made no progress since; else None.
        Progress is a report stamped after the end with more iterations than the job had
        reported at the end, or from another session: a report that only repeats the
        count (a last flush after the end) is none.

        A job gpud sees only through its reports (``gpuctl net report``, no run of it
        holding a reservation) ends with its reports: once it has sent none for
        ``traffic.idle_after_s`` (or twice its usual interval between reports, where that
        is longer: :meth:`_quiet_s`) it ended when gpud heard the last one (nothing of it is
        known to run, so it is not taken for stopped), until it reports progress again
        (:meth:`report` notes that end as a run's)."""
        if job in active:
            return None
        ended = self._run_end(job)
        if ended is not None:
            return ended
        now = self._reports.get(job)
        if now is not None and self._monotonic() - now.heard_at > self._quiet_s(now):
            return now.heard_at
        return None

    def _run_end(self, job: str) -> float | None:
        """When ``job``'s last run ended (:meth:`run_ended`, or its reports ended, see
        :meth:`report`), where it made no progress since; else None. Whether a run of it
        holds a reservation is the caller's to know."""
        with self._ends_lock:
            ended = self._ends.get(job)
        if ended is None or _progressed(self._reports.get(job), *ended):
            return None
        return ended[0]

    # -- the cluster's port ----------------------------------------------------------------
    def apply_order(
        self,
        epoch: int,
        levels: Mapping[str, int],
        tags: Mapping[str, int] | None = None,
        *,
        restart: bool = False,
    ) -> OrderResult:
        with self._lock:
            if epoch < self._epoch and not restart:
                return OrderResult(False, self._epoch, f"stale epoch {epoch} < {self._epoch}")
            for job, level in levels.items():
                if not 0 <= level < self.config.levels:
                    return OrderResult(
                        False,
                        self._epoch,
                        f"job {job!r}: level {level} not in [0, {self.config.levels})",
                    )
            retagged: list[str] = []
            # traffic off: nothing here marks or shapes by tag, and the tick that gives
            # tags back does not run, so the leader's tags (it tags every job holding
            # GPUs, on any node) are not kept, nor said as net.retag
            if tags and self.config.enabled:
                known = set(self._jobs())
                try:
                    retagged = self.tags.set_tags({j: d for j, d in tags.items() if j in known})
                except GpudError as err:
                    return OrderResult(False, self._epoch, str(err))
                for job in retagged:
                    dscp = self.tags.get(job)
                    self._events.emit(
                        "net.retag",
                        f"job {job} tagged DSCP {dscp} by the cluster"
                        if dscp is not None
                        else f"job {job} gave up its DSCP tag to a job the cluster gave it to"
                        " (it gets a free one when it needs one)",
                        job=job,
                        dscp=dscp,
                    )
            self._order = dict(levels)
            self._epoch = epoch
            self._ordered = True
            return OrderResult(True, epoch, retagged=tuple(retagged))

    def clear_order(self) -> None:
        with self._lock:
            if self._order is not None:
                self._events.emit("net.order", "cluster order cleared: local policy decides")
            self._order = None

    def local_report(self) -> LocalReport:
        now = self._clock()
        with self._lock:
            return LocalReport(
                at=now,
                jobs=self._job_views(now, self._held_now()),
                epoch=self._epoch if self._order is not None else 0,
                levels=self.config.levels,
                adopted=self._still_adopted(),
            )

    def _still_adopted(self) -> dict[str, int]:
        """The levels found in the kernel at start that its tc classes still hold, until
        the first cluster order since then (call under the lock). A gpud started again
        has no order yet; the run before's, read back from the tree, is what the new
        leader starts from: ranked afresh, jobs of equal (or unknown) rates would trade
        levels by job id, then trade back once the rates are known -- two tc changes on
        each live job for nothing."""
        if self._ordered:
            return {}
        return {j: lv for j, lv in self._adopted.items() if self._levels.get(j) == lv}

    # -- operator API ----------------------------------------------------------------------
    def _refuse_while_off(self, what: str) -> None:
        """Refuse an operator's or a job's write that nothing would act on."""
        if not self.config.enabled:
            raise FailedPrecondition(
                f"traffic enforcement is off on this node (traffic.enabled = false): {what}"
            )

    def _require_job(self, job: str) -> None:
        """NotFound unless ``job`` is one of the node's jobs, naming where they are listed."""
        if job not in self._jobs():
            raise NotFound(f"no job {job!r} on this node (gpuctl jobs ls)")

    def pin(self, job: str, level: int | None) -> JobTraffic:
        """Pin ``job`` to ``level`` (None: unpin). Refused while traffic is off: the pin
        would be kept but nothing enforces a level. An unknown job is NotFound first, off
        or not: the more basic error (a typo in the name) is the one to fix first."""
        self._require_job(job)
        self._refuse_while_off("no level is enforced, a pin would change nothing")
        if level is not None and not 0 <= level < self.config.levels:
            raise InvalidArgument(f"must be in [0, {self.config.levels - 1}]", field="level")
        with self._lock:
            self.tag(job)
            self.tags.pin(job, level)
            self._events.emit(
                "net.pin",
                f"job {job} pinned to level {level}"
                if level is not None
                else f"job {job} unpinned",
                job=job,
                level=level,
            )
            return self._job_view(job, self._clock(), self._held_now())

    def now(self) -> float:
        return self._clock()

    def place(self, job: str, pid: int, namespace: int | None = None) -> str:
        """Move ``pid`` into the job's cgroup (``gpuctl run``); "" when marking is off.
        ``namespace``: the PID namespace ``pid`` is numbered in (:func:`gpud.pidns.local_pid`),
        None for gpud's own.

        Only a process started for the job may be moved: its environment must carry
        ``GPUD_JOB=<job>`` (what ``gpuctl run`` sets), so the socket's users cannot move
        other people's processes. When ``nft`` fails, the process is moved all the same
        and FailedPrecondition says its packets are unmarked until nft works again.
        """
        if pid <= 1:
            raise InvalidArgument(f"{pid} is not a job's process", field="pid")
        self._require_job(job)
        if not self.config.enabled or not self.config.marking:
            return ""
        pid = local_pid(pid, namespace, self._proc, field="pid")
        try:
            environ = (self._proc / str(pid) / "environ").read_bytes().split(b"\0")
        except FileNotFoundError:
            raise NotFound(f"no process {pid}") from None
        except OSError as err:
            raise PermissionDenied(f"cannot read process {pid}: {err.strerror}") from err
        if f"GPUD_JOB={job}".encode() not in environ:
            raise PermissionDenied(f"process {pid} was not started for job {job!r} (GPUD_JOB)")
        if self._cgroups is None:
            raise FailedPrecondition(f"cannot mark job traffic by cgroup: {self._marking_error}")
        self.tag(job)
        path = self._cgroups.place(job, pid)
        with self._io_lock:
            self._sync_marks()
            failed = self._marking_error
        if failed:
            # the process stays in its cgroup: the rule follows on the first tick nft works
            # again. Until then its packets leave unmarked, which `gpuctl run` says.
            raise FailedPrecondition(
                f"{failed} (the process is in {path}: its packets are marked once nft works again)"
            )
        return str(path)

    def summary(self) -> TrafficSummary:
        """Each interface's enforcement and the marking's, as the last pass left them: read
        without the state lock, which a pass holds while tc runs (``gpuctl status`` is a
        health check and waits for no pass). The interfaces are fixed at start. Marking
        turned off (``traffic.marking = false``) is a setting, not a fault: no error."""
        return TrafficSummary(
            enabled=self.config.enabled,
            interfaces=tuple(
                LinkEnforcement(i.name, i.enforced, i.error) for i in self._ifaces.values()
            ),
            marking_error=self._marking_error if self.config.marking else "",
            marking=self.config.marking,
            rdma_backend=self.config.rdma_backend,
            rdma_error=self._rdma_error,
        )

    def view(self) -> NetView:
        now = self._clock()
        with self._lock:
            held = self._held_now()
            jobs = self._job_views(now, held)
            return NetView(
                enabled=self.config.enabled,
                jobs=jobs,
                shares=self._leveller.config.shares(),
                level_counters=dict(self._level_sent),
                interfaces=tuple(
                    InterfaceStatus(i.name, i.rate_bps, i.enforced, i.error, i.repairs)
                    for i in self._ifaces.values()
                ),
                level_changes_total=self._level_changes,
                order_source="cluster" if self._order is not None else "local",
                epoch=self._epoch if self._order is not None else 0,
                marking_error=self._marking_error,
                rdma_backend=self.config.rdma_backend,
                rdma_error=self._rdma_error,
                untagged=dict(self._untagged),
                untagged_jobs=tuple(self._job_view(j, now, held) for j in sorted(self._untagged)),
                # as of the last tick's registry
                idle_untagged=len(self._known_jobs - {j.job for j in jobs} - self._untagged.keys()),
                marking=self.config.marking,
                rdma_repairs=self._rdma_repairs,
                marking_restores=self._marking_restores,
                gap_spacings=self._tracker.config.gap_spacings,
            )

    def _job_views(self, now: float, held: Set[str]) -> tuple[JobTraffic, ...]:
        """The tagged jobs' rows, "ended" judged by ``held`` (:meth:`_held_now`)."""
        return tuple(self._job_view(j, now, held) for j in sorted(self.tags.allocations()))

    def _job_view(self, job: str, now: float, active: Set[str]) -> JobTraffic:
        reports = self._reports.get(job)
        ended = self._ended_at(job, active)
        prog = self._tracker.progress(job, now) if job in self._tracker.jobs() else None
        total = TrafficCounters()
        for (_, j), c in self._counters.items():
            if j == job:
                total = _plus(total, c)
        pinned, lowest = self.tags.pins().get(job), self.config.levels - 1
        # a run that ended is no stop: nothing of it runs to be stopped
        stopped = prog is not None and prog.stopped and ended is None
        cgroup = ""
        if self._cgroups is not None and self._cgroups.dir(job).is_dir():
            cgroup = str(self._cgroups.dir(job))
        return JobTraffic(
            job=job,
            dscp=self.tags.allocations().get(job, 0),
            # an end since the last tick: the tick that follows ranks it no more (a pin
            # aside), and what it held is not counted as held meanwhile
            level=self._levels.get(job) if ended is None or pinned is not None else None,
            rate=prog.rate if prog else None,
            iterations=prog.iterations if prog else None,
            iteration_s=prog.period_s if prog else None,
            contention_free_iteration_s=prog.ideal_s if prog else None,
            last_report_unix_s=(
                now - (self._monotonic() - reports.last_report_at) if reports else None
            ),
            pinned_level=None if pinned is None else min(pinned, lowest),
            pin_clamped_from=pinned if pinned is not None and pinned > lowest else None,
            cgroup=cgroup,
            counters=total,
            stopped_s=prog.stalled_s if prog is not None and stopped else None,
            unranked=stopped and pinned is None and self._stopped_silent(job, now),
            ended_s=None if ended is None else max(0.0, self._monotonic() - ended),
        )

    # -- the tick --------------------------------------------------------------------------
    def tick(self) -> None:
        """One pass; see the module docstring. Never raises for one interface's trouble."""
        if not self.config.enabled:
            return
        now = self._clock()
        with self._lock:
            # read under the lock: a run that registered its job after a read made outside
            # it (and tagged it since, see starting) would lose its tag here
            registered = list(self._jobs())
            self._known_jobs = set(registered)
            self._watch_clocks()
            self._sync_tags(registered)
            levels = self._decide(now, registered)
            heard = self._monotonic()
            for job, reports in self._reports.items():
                self._prune(job, reports.sessions, heard)  # those of a job gone quiet too
            self._record_changes(levels)
            tags = self.tags.allocations()
            self._enforce_tc(tags, levels, self._weights(now, tags))
        # nft can hang (up to its 10 s timeout): outside the state lock, so that reports,
        # gpuctl net show and tagging go on meanwhile; dcb runs on a worker of its own
        with self._io_lock:
            self._sync_marks()
        self._enforce_rdma(tags, levels)

    def _sync_tags(self, registered: list[str]) -> None:
        present = set(registered) | self._starting.keys()  # a run starting one registers it
        for job in sorted(set(self.tags.allocations()) - present):
            self.tags.release(job)
            self._forget(job)
            # removed, or never registered: a run that tagged its new job was refused, or
            # gpud stopped before the transaction that registers it
            self._events.emit(
                "net.release",
                f"job {job} is not registered (removed, or its run never started):"
                " DSCP tag released",
                job=job,
            )
        # a job removed while it held no tag (the pool was spent) has none to release, but
        # may have reported progress: what was learnt of it goes as well, or it would stay
        # for good and a job added again under its name would inherit its iteration count
        for job in sorted(self._learnt() - present):
            self._forget(job)
        # a job may have been tagged since (gpuctl run, the admission queue, the cluster)
        for job in [j for j in self._untagged if j not in present or self.tags.get(j) is not None]:
            del self._untagged[job]
        untagged = [job for job in registered if self.tags.get(job) is None]
        idle = self._idle_since(untagged) if untagged else {}
        fresh: list[str] = []  # jobs this pass leaves without a tag
        # why the first job in use went without a tag: the same for the rest of the pass,
        # as no tag frees while the lock is held (each one's try would cost a transaction
        # and a look at every held job, hundreds of times a tick)
        spent: DscpPoolExhausted | None = None
        for job in untagged:
            if job in idle:
                # not in use: it takes a free tag, but none over from another job
                self._untagged.pop(job, None)
                if self.tags.full():
                    continue
            try:
                if job in idle:
                    dscp = self.tags.tag(job)
                elif spent is not None:
                    raise DscpPoolExhausted(spent.reason, job=job)
                else:
                    dscp = self._tag(job)
            except DscpPoolExhausted as err:
                if job in idle:  # the last free tag went meanwhile
                    continue
                spent = spent or err
                # the job goes untagged (its traffic in the default class) until a tag
                # frees; the others stay enforced
                if job not in self._untagged:
                    fresh.append(job)
                self._untagged[job] = f"no DSCP tag: {err}"
                continue
            self._untagged.pop(job, None)
            self._events.emit("net.tag", f"job {job} tagged DSCP {dscp}", job=job, dscp=dscp)
        if spent is not None:
            self._say_untagged(fresh, spent.reason)
        if self._cgroups is not None:
            self._cgroup_busy -= present  # a job added again under the name
            for job in self._cgroups.jobs():
                if job not in present:
                    self._remove_cgroup(job)  # retried every tick while processes remain

    def _say_untagged(self, fresh: Sequence[str], reason: str) -> None:
        """Event ``net.untagged`` for the jobs one pass left without a tag (``reason``:
        why, the same for all): one each for the first :data:`_UNTAGGED_SHOWN`, then one
        for the rest together, naming them all in ``names`` (``gpuctl events --job``
        finds it). A start with a spent pool counts every registered job as in use for
        ``traffic.idle_after_s``: one event each would bury the event history under
        hundreds of the same line."""
        for job in fresh[:_UNTAGGED_SHOWN]:
            self._events.emit(
                "net.untagged",
                f"job {job!r}: {reason}: its traffic is in the default class until a tag frees",
                job=job,
            )
        rest = list(fresh[_UNTAGGED_SHOWN:])
        if not rest:
            return
        self._events.emit(
            "net.untagged",
            f"{len(rest)} more job(s) have no DSCP tag ({first_few(rest, _UNTAGGED_SHOWN)}):"
            f" {reason}: their traffic is in the default class until a tag frees (gpuctl"
            " net show lists them)",
            jobs=len(rest),
            names=rest,
        )

    def _remove_cgroup(self, job: str) -> None:
        """Remove a removed job's cgroup; while processes remain in it (they left the
        command's process group and environment, so nothing stopped them), say so once."""
        assert self._cgroups is not None
        if self._cgroups.remove(job):
            self._cgroup_busy.discard(job)
            return
        pids = self._cgroups.pids(job)
        if not pids or job in self._cgroup_busy:
            return
        self._cgroup_busy.add(job)
        shown = first_few(pids, _PIDS_SHOWN)
        self._events.emit(
            "net.cgroup_busy",
            f"job {job} is removed, but {len(pids)} process(es) remain in its cgroup"
            f" {self._cgroups.dir(job)} (PID {shown}): their packets are no longer marked,"
            " and the cgroup is removed once they exit",
            job=job,
            processes=len(pids),
        )

    def _learnt(self) -> set[str]:
        """The jobs :meth:`_forget` has something of."""
        with self._ends_lock:
            ended = {*self._ends, *self._cutoffs}
        return {
            *ended,
            *self._tagged_at,
            *self._tracker.jobs(),
            *self._reports,
            *self._levels,
            *self._demand_base,
            *self._homes,
            *(job for _, job in self._counters),
        }

    def _forget(self, job: str) -> None:
        """Drop all the service learnt of ``job`` (the job is gone)."""
        self._forget_class(job)
        self._tracker.forget(job)
        self._reports.pop(job, None)
        with self._ends_lock:
            self._ends.pop(job, None)
            self._cutoffs.pop(job, None)

    def _forget_class(self, job: str) -> None:
        """Drop what went with ``job``'s tag (its tag went to another job): its level, leaf
        and counters. Its progress stays: it is the job's, which may run on untagged. The
        kernel's last reading of its leaf stays (``_last_read``): a job given the same
        class counts on from it."""
        self._tagged_at.pop(job, None)
        self._levels.pop(job, None)
        self._demand_base.pop(job, None)
        self._homes.pop(job, None)
        for key in [k for k in self._counters if k[1] == job]:
            del self._counters[key]

    @contextmanager
    def starting(self, job: str) -> Iterator[None]:
        """Around a run's start (``gpuctl run``): a job tagged inside it (:meth:`tag`) keeps
        its tag though it is not registered yet, as a new job is registered only in its
        first reservation's transaction. A run refused, or cut short by a crash, leaves the
        tag of a job still unregistered to the next tick, which releases it."""
        with self._lock:
            self._starting[job] = self._starting.get(job, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._starting.pop(job) - 1
                if left:
                    self._starting[job] = left

    def tag(self, job: str) -> int:
        """The job's DSCP tag, allocated and persisted on first use (``gpuctl run``,
        the admission queue, the tick; ``gpuctl env`` takes none).

        Tags are held by registered jobs, so a node that has seen many jobs can run out of
        ``traffic.dscp_pool``. Then the tag of the job idle longest is handed over: a job
        holding no reservation, not pinned, with no process in its cgroup, and with neither
        a progress report nor a call here that gave it its tag for ``traffic.idle_after_s``
        (nor since gpud started; a job that reports less often: for twice its usual
        interval between reports, at most :data:`QUIET_CAP_IDLES` times that, see
        :meth:`_quiet_s`). A job whose run ended waits as long: its tag is not handed over
        at its end, so a run of it tagged just before (``gpuctl run`` tags, then reserves)
        starts with it, and one started again soon after finds it. It gets a new tag when
        it runs again. Raises
        DscpPoolExhausted when every tag is held by a job in use (a refused call counts as
        nothing: the job does not start).
        """
        with self._lock:
            dscp = self._tag(job)
            # about to run: its tag is not handed over. A job refused is not marked: nothing
            # of it starts, so it neither holds back the tags of jobs that stop nor takes
            # one (a tick hands it a free tag only, as any idle job)
            self._tagged_at[job] = self._monotonic()
            return dscp

    def _tag(self, job: str) -> int:
        """:meth:`tag` without marking ``job`` as about to run; call it holding the lock."""
        dscp = self._take_tag(job)
        self._untagged.pop(job, None)  # left without one by an earlier tick: it has one now
        return dscp

    def _take_tag(self, job: str) -> int:
        try:
            return self.tags.tag(job)
        except DscpPoolExhausted as err:
            held = self.tags.allocations()
            now = self._monotonic()
            quiet = self._quiet_left([j for j in held if j != job], now)
            idle = _idle_since(quiet)
            if not idle:
                why = self._why_none_idle(quiet, now)
                raise DscpPoolExhausted(f"{err.reason}{why}", job=job) from err
            holder = min(idle, key=lambda j: (idle[j], j))  # idle longest
            dscp = held[holder]
            self.tags.release(holder)
            self._forget_class(holder)
            self._events.emit(
                "net.reclaim",
                f"job {holder} idle: its DSCP tag {dscp} goes to job {job}"
                " (traffic.dscp_pool is in use)",
                job=holder,
                dscp=dscp,
            )
            return self.tags.tag(job)

    def _why_none_idle(self, holders: Mapping[str, _Quiet | None], now: float) -> str:
        """Why no held tag can be handed over, for DscpPoolExhausted: ``holders``, the jobs
        holding them, none idle at ``now`` (:meth:`_quiet_left`)."""
        wait = self.config.idle_after_s
        up = now - self._started_at
        if up <= wait:
            # nothing counts as idle yet: gpud does not know what ran before it started
            return (
                f"; gpud started {up:.0f} s ago, and a job counts as idle only"
                f" traffic.idle_after_s ({wait:g} s) after that: tags of jobs idle since then"
                f" are handed over in {max(1.0, wait - up):.0f} s (or widen"
                " traffic.dscp_pool, or remove jobs: gpuctl jobs rm)"
            )
        quiet = []  # held past traffic.idle_after_s by a longer quiet time
        for job, left in sorted(holders.items()):
            reports = self._reports.get(job)
            if left is None or reports is None:
                continue  # one in use is not idle in any time
            silent = now - reports.heard_at
            if not wait < silent <= self._quiet_s(reports):
                continue
            quiet.append(
                f"job {job} (a report every {reports.cadence_s or 0.0:.0f} s:"
                f" idle in {left.left_s:.0f} s)"
            )
        named = f": {first_few(quiet, _QUIET_SHOWN)}" if quiet else ""
        return (
            f", each by a job that runs, is pinned, or was given its tag, ended a run or"
            f" reported in the last {wait:g} s (traffic.idle_after_s), or, reporting less"
            " often, within twice"
            f" its usual interval between reports, at most {QUIET_CAP_IDLES:g} times"
            f" traffic.idle_after_s{named}; widen traffic.dscp_pool or remove jobs"
            " (gpuctl jobs rm)"
        )

    def _pins(self) -> dict[str, int]:
        """The operators' pins as enforced: one beyond a lowered ``traffic.levels`` holds
        the lowest level while it is lowered (the store keeps the level it was set to)."""
        lowest = self.config.levels - 1
        return {job: min(level, lowest) for job, level in self.tags.pins().items()}

    def _idle_since(self, jobs: Sequence[str]) -> dict[str, float]:
        """Those of ``jobs`` not in use, and since when (the monotonic clock): see
        :meth:`_quiet_left`."""
        return _idle_since(self._quiet_left(jobs, self._monotonic()))

    def _quiet_left(self, jobs: Sequence[str], now: float) -> dict[str, _Quiet | None]:
        """Each of ``jobs``, None where it is in use (a reservation, a pin, a process in
        its cgroup), else when it was last used and how long until it counts as idle: no
        progress report, tag handed out or run ended for ``traffic.idle_after_s`` (nor
        since gpud started), nor a report for the job's :meth:`_quiet_s`. A job whose run
        ended is no exception: a run of it may have been given its tag again before the end
        was said (``gpuctl run`` tags before it reserves) and would start without it, and a
        user running it again at once would find its tag gone."""
        active = self._active()
        pins = self.tags.pins()
        out: dict[str, _Quiet | None] = {}
        for job in jobs:
            if job in active or job in pins:
                out[job] = None
                continue
            reports = self._reports.get(job)
            # a run's reservation is use up to its release: a job that ran for hours
            # without a report is not idle the moment it ends
            ended = self._run_end(job)
            since = max(self._started_at, self._tagged_at.get(job, 0.0), ended or 0.0)
            left = self.config.idle_after_s - (now - since)
            if reports is not None:
                left = max(left, self._quiet_s(reports) - (now - reports.heard_at))
                since = max(since, reports.heard_at)
            # the cgroup is read last: a job counted in use already costs no read
            busy = self._cgroups is not None and self._cgroups.busy(job)
            out[job] = None if busy else _Quiet(since, left)
        return out

    def _watch_clocks(self) -> None:
        """Cut the time the node did not run out of every job's progress (call under the
        lock): the wall clock, which stamps reports, runs on through a suspend where the
        monotonic one stops, and steps forward alone. Counted, it would be a stall of every
        job, ranked by how long each one's iterations are. A wall clock stepped back ends
        every job's clamp of what the tracker is told to its last told stamp
        (:attr:`_JobReports.told_at`): held there, every report until the clock caught up
        would be told at one stamp, the job's pace before the step kept for its own."""
        wall, mono = self._clock(), self._monotonic()
        if self._clocks is not None:
            wall0, mono0 = self._clocks
            gap = (wall - wall0) - (mono - mono0)
            if gap < -CLOCK_GAP_S:
                # the next report, a higher count stamped before the last told, is told
                # at its own stamp: the tracker takes it for the step and starts the
                # job's window again from it
                for reports in self._reports.values():
                    reports.told_at = -math.inf
            if gap > CLOCK_GAP_S:
                log.info(
                    "traffic: the wall clock ran %.0f s ahead of the monotonic clock (a"
                    " suspend, or the clock stepped forward): not counted as any job's stall",
                    gap,
                )
                # what the last read saw was stamped before wall0 + (mono - mono0), what
                # ran after the gap from then on (the gap being longer than that interval)
                self._tracker.skip(wall - gap, wall)
        self._clocks = (wall, mono)

    def _decide(self, now: float, registered: list[str]) -> dict[str, int]:
        with self._ends_lock:
            read_from = self._runs_said
        active_res = self._active()
        with self._ends_lock:
            # a run that ended while the store was read, its release after the read: the
            # read still holds it. Those ended before are in the read (the store's writes
            # and reads take turns)
            late = {j for j, (n, started) in self._runs.items() if n > read_from and not started}
            active_res = active_res - late
            self._held = frozenset(active_res)
            # a job this read sees held runs: its last end is over (not before, as the
            # reservation that said it started may have been rolled back)
            for job in active_res & self._ends.keys():
                del self._ends[job]
            # a run started before this read began is in it, or was rolled back; one this
            # read saw is in it: neither is kept apart any longer
            self._runs = {
                j: (n, started)
                for j, (n, started) in self._runs.items()
                if n > read_from and not (started and j in active_res)
            }
        active = []
        heard = self._monotonic()
        for job in registered:
            if self.tags.get(job) is None:
                # no tag, no class of its own to prioritise: its traffic is in the default
                # class, and a place in the ranking would push tagged jobs down a level
                continue
            reports = self._reports.get(job)
            # a job whose run ended has no traffic left to rank, however lately it reported
            recent = (
                reports is not None
                and heard - reports.heard_at <= self._quiet_s(reports)
                and self._ended_at(job, active_res) is None
            )
            if job in self.tags.pins() or (
                (job in active_res or recent) and not self._stopped_silent(job, now)
            ):
                active.append(job)
        pins = self._pins()
        for job, level in pins.items():
            self._leveller.pin(job, level)
        for job in self._leveller.pins():
            if job not in pins:
                self._leveller.unpin(job)
        rates = {
            j: (self._tracker.progress(j, now).rate if j in self._tracker.jobs() else None)
            for j in active
        }
        assignment = self._leveller.update(heard, rates)
        levels = dict(assignment.levels)
        if self._adopted:
            for job in levels:
                if rates.get(job) is None and job in self._adopted and job not in pins:
                    levels[job] = self._adopted[job]
        if self._order is not None:
            for job in levels:
                if job in self._order and job not in pins:
                    levels[job] = self._order[job]
        return levels

    def _stopped_silent(self, job: str, now: float) -> bool:
        """Whether ``job`` reported, then stopped (past its gap limit) and has sent no
        report for ``traffic.idle_after_s``: it holds no level, reservation or not (a pin
        aside), as its stall says nothing of the network; its traffic, if any, is the
        default class's until it reports."""
        reports = self._reports.get(job)
        if reports is None or self._monotonic() - reports.heard_at <= self._quiet_s(reports):
            return False
        return job in self._tracker.jobs() and self._tracker.progress(job, now).stopped

    def _weights(self, now: float, tags: Mapping[str, int]) -> dict[str, float]:
        """Each job's weight inside its level, by its demand: the bytes its leaves carried
        per iteration since it was first seen with both, over its contention-free time."""
        if not self.config.weigh_by_demand:
            return {}
        sent: dict[str, int] = {}
        for (_, job), c in self._counters.items():
            sent[job] = sent.get(job, 0) + c.bytes
        tracked = set(self._tracker.jobs())
        demand: dict[str, float] = {}
        for job in tags:
            if job not in tracked:
                continue
            prog = self._tracker.progress(job, now)
            if prog.iterations is None or prog.ideal_s is None:
                continue
            nbytes, iters = sent.get(job, 0), prog.iterations
            base = self._demand_base.get(job)
            if base is None or iters < base[1] or nbytes < base[0]:  # new, or restarted
                self._demand_base[job] = (nbytes, iters)
                continue
            if iters - base[1] >= _DEMAND_MIN_ITERATIONS and nbytes > base[0]:
                demand[job] = (nbytes - base[0]) / (iters - base[1]) / prog.ideal_s
        return demand_weights(demand)

    def _record_changes(self, levels: dict[str, int]) -> None:
        moved = {
            j: (self._levels[j], lv)
            for j, lv in levels.items()
            if j in self._levels and self._levels[j] != lv
        }
        if moved:
            self._level_changes += len(moved)
            summary = ", ".join(f"{j} {a}->{b}" for j, (a, b) in sorted(moved.items()))
            self._events.emit("net.levels", f"levels changed: {summary}", changes=len(moved))
        self._levels = levels

    # -- enforcement -----------------------------------------------------------------------
    def link_rate(self, iface: str) -> int:
        """Bit/s of ``iface``: ``traffic.link_rates``, else the link's speed (while it has
        none, the last the same netdev had in this run: not one deleted and made again
        under the name, which the kernel gives another ifindex)."""
        for entry in self.config.link_rates:
            name, _, rate = entry.partition("=")
            if name == iface:
                return parse_rate(rate)
        # the ifindex on both sides of the speed: a netdev made again between the reads
        # (another ifindex) neither gets the old one's rate nor has its speed kept as the
        # old one's
        before = self._link_index(iface)
        failed: NotFound | LinkDown | None = None
        try:
            mbit, speed = self._link_speed(iface)
        except (NotFound, LinkDown) as err:
            mbit, speed, failed = None, "", err
        index = self._link_index(iface)
        held = self._held_bps(iface, index if before == index else _REMADE)
        if failed is not None and held is None:
            raise failed
        if mbit is None or mbit <= 0:
            if held is not None:
                # it had a speed in this run: a NIC whose link went down has none until
                # it is up again. The tree stays at the last rate (and drift is still
                # repaired); an interface gone or renamed away is for tc to name
                return held
            raise FailedPrecondition(
                f"{iface}: link rate unknown ({speed} gives none): set traffic.link_rates"
            )
        bps = mbit * 1_000_000
        if not tcplan.LINK_BPS_MIN <= bps <= tcplan.LINK_BPS_MAX:
            raise FailedPrecondition(
                f"{iface}: {tcplan.link_rate_range(bps)} ({speed} says {mbit} Mb/s):"
                " set traffic.link_rates"
            )
        if before == index:
            self._link_bps[iface] = (index, bps)
        return bps

    def _held_bps(self, iface: str, index: int | None) -> int | None:
        """The rate ``iface``'s speed last gave, while the netdev it was read on is the one
        on the name now (the name gone now, index None, is for tc to name); ``_REMADE``:
        made again while its speed was read, so none is held."""
        held = self._link_bps.get(iface)
        if held is None or index == _REMADE:
            return None
        was, bps = held
        if index is not None and was != index:
            # another netdev under the name (a veth or VF made again): its speed is its own,
            # also after one whose index was not known when its speed was kept
            del self._link_bps[iface]
            return None
        return bps

    def start(self) -> None:
        """Adopt what the kernel holds from before (call once, before the first tick):
        nothing is torn down, the levels found hold until progress is known again, and the
        policy (and, until its first order, the cluster leader) starts from them."""
        if not self.config.enabled or self._tc is None:
            return
        adopted: dict[str, int] = {}
        disagree: set[str] = set()
        with self._lock:
            tags = self.tags.allocations()
            for iface, found in self._tc.adopt(self.config.interfaces).items():
                if isinstance(found, Exception):
                    self._fail(self._ifaces[iface], _describe(iface, found))
                    self._adopt_due.add(iface)
                    continue
                self._take(iface, found)
                for job, level in self._levels_in(found.state, tags).items():
                    # a kill -9 between two interfaces' syncs leaves a job at two levels:
                    # the highest priority (the lowest level) is the one kept, as the
                    # cluster leader's seed_levels breaks ties, not the last interface's
                    was = adopted.get(job, level)
                    if was != level:
                        disagree.add(job)
                    adopted[job] = min(was, level)
                for job, home in self._levels_in(found.state, tags, homes=True).items():
                    self._homes.setdefault(job, {})[iface] = home
            self._adopted = adopted
            if self._leveller.last is None:
                # the policy starts from the levels in force, as a new cluster leader does:
                # jobs whose rates tie (or fit their level) keep it once they report again,
                # rather than trade levels by job id -- a tc change on each for nothing
                k = self._leveller.config.levels
                self._leveller.seed({j: lv for j, lv in adopted.items() if 0 <= lv < k})
            self._marks_found = True
            # what the kernel enforces until the first tick decides: without it a job found
            # at its level reads as in the default class (no level) meanwhile
            self._levels = dict(adopted)
            if adopted:
                split = "".join(
                    f"; {job}'s interfaces held different levels: {adopted[job]} kept"
                    for job in sorted(disagree)
                )
                self._events.emit(
                    "net.adopt",
                    f"adopted the levels of {len(adopted)} job(s) from the kernel{split}",
                )
            self._unshape_dropped()

    def _take(self, iface: str, found: AdoptedLike) -> None:
        """What gpud keeps of ``iface`` as read before its first pass: the root to give
        back, and gpud's tree, if it is there, to take over and count from."""
        self._originals[iface] = self._original(iface, found)
        if found.original is None and found.state.root is not None:  # gpud's tree
            self._found[iface] = found.state
            self._baseline_due.add(iface)

    def _adopt_late(self, tags: Mapping[str, int]) -> None:
        """Read the interfaces the start could not, before their first pass. The levels
        found are not taken (the start's window for them is over: the jobs' levels now are
        decided), the home level of a job's leaf on that interface is, so that its class
        and its counters stay there whatever home its leaves have on the others."""
        if not self._adopt_due or self._tc is None:
            return
        for iface, found in self._tc.adopt(sorted(self._adopt_due)).items():
            if isinstance(found, Exception):
                self._fail(self._ifaces[iface], _describe(iface, found))
                continue
            self._adopt_due.discard(iface)
            self._take(iface, found)
            for job, home in self._levels_in(found.state, tags, homes=True).items():
                self._homes.setdefault(job, {}).setdefault(iface, home)

    def _original(self, iface: str, found: AdoptedLike) -> tcplan.RootQdisc | None:
        """The root qdisc ``iface`` had before gpud took it. ``found.original`` is the root
        seen at start when it is not gpud's: gpud's tree was removed meanwhile (or never
        there), so what is there now is what gpud replaces. Where gpud's tree is still in
        place the kernel no longer shows what was there before: the one recorded when gpud
        first took the interface (None: not known, the kernel's default comes back on
        restore). A record of another ifindex than the netdev's now is dropped: the netdev
        was deleted and created again since (while gpud was stopped, or missing at its
        start), and gpud's tree on it, if any, was built on the kernel's default root. An
        older gpud's record (no ifindex) found under gpud's tree is given the netdev's."""
        if self._shaped is None:
            return found.original
        if found.original is not None:
            self._shaped.set_original(iface, found.original, found.ifindex)
            return found.original
        was = self._shaped.original_ifindex(iface)
        if was is not None and was != found.ifindex:
            log.info(
                "traffic: %s is ifindex %d, its recorded root qdisc from before gpud was"
                " ifindex %d's: dropped",
                iface,
                found.ifindex,
                was,
            )
            self._shaped.forget_original(iface)
            return None
        recorded = self._shaped.original(iface)
        if was is None and recorded is not None and found.state.root is not None:
            # an older gpud's row (no ifindex) under gpud's tree: the tree is on this
            # netdev, so is the record from now on, and a netdev made again later is told
            self._shaped.set_original(iface, recorded, found.ifindex)
        return recorded

    def _restore_failed(self, iface: str, logged: str, said: str, message: str) -> None:
        """A restore of ``iface`` that left it otherwise than before gpud: a warning
        (``logged``) and a ``net.interface_error`` event (``said``), both ending in
        ``message``, the error."""
        log.warning("traffic: %s: %s", logged, message)
        self._events.emit(
            "net.interface_error", f"{said}: {message}", interface=iface, reason=message
        )

    def _say_not_put_back(self, iface: str, doing: str, message: str) -> None:
        """A restore deleted gpud's root from ``iface`` and the kernel refused the original
        root's re-install: the netdev has the kernel's default root. ``doing``: what the
        restore was for, as the event says it."""
        self._restore_failed(
            iface,
            f"original root not put back on {iface}",
            f"{doing}: gpud's tree removed, the original root not put back",
            message,
        )

    def _unshape_dropped(self) -> None:
        """Remove gpud's root from the interfaces an earlier run shaped that are no longer
        in ``traffic.interfaces`` (a root that is not gpud's HTB is left as it is)."""
        if self._shaped is None or self._tc is None:
            return
        for iface in sorted(self._shaped.all() - set(self.config.interfaces)):
            original = self._shaped.original(iface)
            try:
                done = self._tc.restore(
                    iface, original, ifindex=self._shaped.original_ifindex(iface)
                )
            except Exception as err:
                message = _describe(iface, err)
                if _not_put_back(err):
                    # nothing of gpud's left to retry on: the record goes
                    self._say_not_put_back(iface, "not in traffic.interfaces any more", message)
                elif _tree_may_stay(err):
                    log.warning("traffic: cannot remove gpud's tree: %s", message)
                    self._events.emit(
                        "net.interface_error",
                        f"not in traffic.interfaces any more, but gpud's tree stays: {message}",
                        interface=iface,
                        reason=message,
                    )
                    continue
                else:
                    log.info(
                        "traffic: nothing to remove from %s, not in traffic.interfaces any"
                        " more: %s",
                        iface,
                        message,
                    )
            else:
                self._events.emit(
                    "net.unshaped",
                    f"{iface}: not in traffic.interfaces any more: "
                    + _unshaped(original, done, done.replaced),
                    interface=iface,
                )
            self._shaped.discard(iface)

    def _levels_in(
        self, state: tcplan.InterfaceState, tags: Mapping[str, int], *, homes: bool = False
    ) -> dict[str, int]:
        """Job -> level (the leaf's prio) of the job leaves ``state`` holds, or with
        ``homes`` the level class each leaf sits under."""
        by_tag = {d: j for j, d in tags.items()}
        out: dict[str, int] = {}
        # a sync cut short in a move leaves a job two leaves here (the new one added, the
        # old not yet deleted): the one its filters send its packets to is taken (last),
        # so the first pass keeps that one and deletes the other, moving no packet again.
        # Cut between its two filter changes, the IPv4 filter points to the new leaf and
        # the IPv6 one to the old (tcplan.diff re-points IPv4 first): the IPv4 filter's
        # leaf is the one the sync was moving to, so it ranks above the IPv6 filter's
        aim = {f.flowid: 1 for _, f in state.filters if f.family is tcplan.Family.IPV6}
        aim |= {f.flowid: 2 for _, f in state.filters if f.family is tcplan.Family.IPV4}
        for c in sorted(state.classes, key=lambda c: aim.get(c.classid, 0)):
            leaf = tcplan.parse_leaf(c.classid)
            if leaf is None or leaf[1] not in by_tag or not 0 <= leaf[0] < self.config.levels:
                continue
            level = leaf[0] if homes else c.prio
            if 0 <= level < self.config.levels:
                out[by_tag[leaf[1]]] = level
        return out

    def _enforce_tc(
        self,
        tags: Mapping[str, int],
        levels: Mapping[str, int],
        weights: Mapping[str, float] | None = None,
    ) -> None:
        if self._tc is None:
            return
        self._tc_pass += 1
        self._adopt_late(tags)
        links: dict[str, int] = {}
        for iface, status in self._ifaces.items():
            if iface in self._adopt_due:  # still unread: its error is the adopt's
                continue
            try:
                links[iface] = status.rate_bps = self.link_rate(iface)
            except GpudError as err:
                self._fail(status, str(err))
        if not links:
            return
        try:
            plan = tcplan.plan(
                links,
                tags,
                {j: lv for j, lv in levels.items() if j in tags},
                self._leveller.config.shares(),
                tcplan.TcOptions(
                    default_share=self.config.default_share, top_share=self.config.top_share
                ),
                weights={j: w for j, w in (weights or {}).items() if j in levels},
                interface_homes={
                    iface: {
                        j: self._homes.setdefault(j, {}).setdefault(iface, lv)
                        for j, lv in levels.items()
                        if j in tags
                    }
                    for iface in links
                },
            )
        except ValueError as err:
            for iface in links:
                self._fail(self._ifaces[iface], f"{iface}: cannot plan: {err}")
            return
        # A new plan is sent as a difference from what was last seen; an unchanged plan is
        # checked against a fresh read of the kernel, and what differs is drift.
        # Per interface, operations sent while its plan had not changed are drift repairs
        # (sync also re-reads an interface whose plan is unchanged).
        result = self._tc.drift(plan) if plan == self._last_plan else self._tc.sync(plan)
        self._last_plan = plan if all(r.error is None for r in result.interfaces.values()) else None
        for iface, res in result.interfaces.items():
            status = self._ifaces[iface]
            want = plan.interface(iface)
            # the job leaves of this interface: their classids may differ from another's
            by_class = {c.classid: c.job for c in want.classes if c.job is not None}
            unchanged = self._applied.get(iface) == want
            found = self._found.pop(iface, None) if res.error is None else None
            if res.replaced:
                self._netdev_replaced(iface, res.replaced)
            if res.error is not None:
                self._applied.pop(iface, None)
                self._fail(status, _describe(iface, res.error))
                continue
            self._applied[iface] = want
            # what the leaves send from now on is sent at this pass's levels; what they sent
            # since the last read, at those enforced before. Taken before the read below:
            # this pass's levels are in the kernel whether or not it reads, so where the read
            # fails the next one counts all it finds at them (a pass's worth of blur)
            sent_at = self._sent_at.get(iface, {})
            self._sent_at[iface] = {job: lv for job, lv in levels.items() if job in tags}
            if found is not None and not res.replaced:
                self._say_adopted_tc(iface, found, res.tc_ops)
            elif res.ops and (unchanged or (res.replaced and not status.error)):
                status.repairs += 1
                run = 1
                if not res.replaced:
                    # a netdev made again is no tool's fight: always said, and no run
                    last, before = self._drift_run.get(iface, (0, 0))
                    run = before + 1 if last == self._tc_pass - 1 else 1
                    self._drift_run[iface] = (self._tc_pass, run)
                # a netdev deleted and created again between two passes (a driver reset,
                # a runtime re-making it), or between the start's adopt and the first pass,
                # lost gpud's tree with it: not another tool's change, nor a takeover.
                # Said whether or not the plan moved in that pass; one a pass saw missing
                # (status.error) is said by net.interface alone, as enforced again.
                why = (
                    f"another netdev by that name ({res.replaced}): gpud's tree built on it"
                    f" again, {len(res.ops)} tc object(s)"
                    if res.replaced
                    else f"restored {len(res.ops)} tc object(s) changed outside gpud"
                )
                if run == 2:
                    # a tool fighting gpud (its own root or filters put back by a timer, a
                    # network manager): each pass still repairs, `gpuctl net show` counts
                    log.warning("traffic: %s: changed outside gpud on every pass", iface)
                    why = (
                        "changed outside gpud again on 2 passes running: another tool keeps"
                        " changing it; gpud restores it on every pass, said again once a"
                        " pass finds it as gpud left it: " + why
                    )
                if run <= 2:
                    self._events.emit(
                        "net.drift",
                        f"{iface}: {why}: " + "; ".join(res.restored or res.ops)[:500],
                        interface=iface,
                        operations=len(res.ops),
                    )
            try:
                counters = self._tc.counters(iface)
            except Exception as err:
                self._fail(status, _describe(iface, err))
                continue
            if status.error:
                was = status.error.removeprefix(f"{iface}: ")
                again = f" again (was: {was})" if iface in self._ever_enforced else ""
                self._events.emit(
                    "net.interface", f"{iface}: enforced{again}", interface=iface, was=was
                )
            self._ever_enforced.add(iface)
            if self._shaped is not None:
                self._shaped.add(iface)
            status.enforced, status.error = True, ""
            self._count_sent(iface, counters, by_class, sent_at, levels)

    def _count_sent(
        self,
        iface: str,
        counters: Mapping[int, CountersLike],
        by_class: Mapping[int, str],
        sent_at: Mapping[str, int],
        levels: Mapping[str, int],
    ) -> None:
        """Add what each job leaf on ``iface`` sent since the last read (``counters``: the
        kernel's now) to its job and to the level in ``sent_at``, the one enforced while it
        was sent (a job not in it: just tagged, at its level now)."""
        read = {
            cid: TrafficCounters(raw.bytes, raw.packets, raw.drops)
            for cid, raw in counters.items()
            if cid in by_class
        }
        last = read if iface in self._baseline_due else self._last_read.get(iface, {})
        # the classes still planned keep their last reading where this read lacks them (a
        # dump cut short): the next read that has them counts from it, not from 0. One out
        # of the plan is dropped: deleted and made again later, it starts at 0
        kept = {cid: r for cid, r in last.items() if cid in by_class and cid not in read}
        self._last_read[iface] = {**kept, **read}
        self._baseline_due.discard(iface)
        for cid, now in read.items():
            job = by_class[cid]
            sent = _sent_since(last.get(cid), now)
            key = (iface, job)
            self._counters[key] = _plus(self._counters.get(key, TrafficCounters()), sent)
            at = sent_at.get(job, levels.get(job))
            if at is not None:
                self._level_sent[at] = _plus(self._level_sent.get(at, TrafficCounters()), sent)

    def _netdev_replaced(self, iface: str, replaced: str) -> None:
        """``iface`` names another netdev since gpud took it (``replaced``: "ifindex NEW,
        was OLD"). The root qdisc recorded as there before gpud was the old netdev's: a
        restore leaves the new one the root the kernel gave it, across a restart too."""
        self._replaced[iface] = replaced
        self._found.pop(iface, None)  # the tree adopted at start went with the old netdev
        # and so did its classes' counters: the new tree's start at 0, so its first read
        # is counted whole, whichever pass makes it (not a baseline, nor less the old's)
        self._baseline_due.discard(iface)
        self._last_read.pop(iface, None)
        if self._shaped is not None:
            self._shaped.forget_original(iface)

    def _say_adopted_tc(
        self, iface: str, found: tcplan.InterfaceState, ops: Sequence[tcplan.TcOp]
    ) -> None:
        """The first pass that enforced ``iface`` since the start, on the ``found`` tree
        gpud's run before left: what it kept, removed (stale: a job gone meanwhile; all of
        it when the tree was rebuilt), changed and added (event ``net.takeover``)."""
        objects = _objects(found)
        removed = _removed(found, ops)
        kinds = [op.kind for op in ops]
        changed = kinds.count(tcplan.OpKind.CHANGE_CLASS) + kinds.count(tcplan.OpKind.CHANGE_FILTER)
        added = sum(
            kinds.count(k)
            for k in (tcplan.OpKind.REPLACE_ROOT, tcplan.OpKind.ADD_CLASS, tcplan.OpKind.ADD_FILTER)
        )
        rebuilt = tcplan.OpKind.REPLACE_ROOT in kinds
        stale = [" ".join(op.tc_args()) for op in ops if op.kind in _DELETES]
        self._events.emit(
            "net.takeover",
            f"{iface}: took over gpud's tc tree from before the start: kept"
            f" {objects - removed} of {objects} object(s), removed {removed}"
            + (" (the tree rebuilt)" if rebuilt else " stale")
            + (f" ({'; '.join(stale)[:300]})" if stale and not rebuilt else "")
            + f", changed {changed}, added {added}",
            interface=iface,
            kept=objects - removed,
            removed=removed,
            changed=changed,
            added=added,
        )

    def _fail(self, status: InterfaceStatus, message: str) -> None:
        """``status`` is not enforced, because of ``message``. One event when it breaks
        (and one, ``net.interface``, when it is enforced again): the reason may read
        differently from one pass to the next while it stays broken (the interface
        vanishing mid-batch, then missing), which only updates what ``gpuctl net show``
        says."""
        if not status.error:
            log.warning("traffic: %s", message)
            self._events.emit("net.interface_error", message, interface=status.name, reason=message)
        elif status.error != message:
            log.info("traffic: still not enforced: %s", message)
        status.enforced, status.error = False, message

    def _sync_marks(self) -> None:
        if self._marker is None or self._cgroups is None or not self.config.marking:
            return
        marks = []
        for job, dscp in sorted(self.tags.allocations().items()):
            mark = self._cgroups.mark(job, dscp)
            if mark is not None:
                marks.append(mark)
            elif job in self._cgroup_seen and self.tags.get(job) == dscp:
                # gpud removes a job's cgroup only with the job, after releasing its tag:
                # someone else removed it (its processes moved out first), so nothing is
                # left to mark. The tag is read again: place() runs this outside the state
                # lock, while a tick may release a removed job's tag and remove its cgroup
                # after the allocations above were read.
                self._events.emit(
                    "net.cgroup_gone",
                    f"job {job}: its cgroup {self._cgroups.dir(job)} was removed outside"
                    " gpud: its packets are no longer marked (its next gpuctl run makes the"
                    " cgroup again)",
                    job=job,
                )
        self._cgroup_seen = {m.job for m in marks}
        try:
            result = self._marker.sync(marks)
        except Exception as err:
            message = f"nftables: {err}"
            # restores held within the minute happened before this failure: said first,
            # or they would read as a new flush after the pair, or go unsaid while nft fails
            self._say_restores(False, at_once=True)
            if message != self._marking_error:
                log.warning("traffic: %s", message)
                self._events.emit("net.marking_error", message)
            self._marking_error = message
            self._marking_ok = False
            return
        if result.foreign:
            # one warning each time: the chains go with the table, a new one is new news
            message = (
                f"nftables: removed chain(s) {first_few(result.foreign, _CHAINS_SHOWN)} not"
                f" gpud's from table {FAMILY} {DEFAULT_TABLE} (they could undo the marks)"
            )
            log.warning("traffic: %s", message)
            self._events.emit("net.marking", message, restores=0)
        found, self._marks_found = self._marks_found, False
        restored = False
        if found and (not result.created or result.rebuilt):
            # a table rebuilt kept nothing (as a tc tree rebuilt); none found: a first start
            stale = result.removed
            self._events.emit(
                "net.takeover",
                "nftables: took over gpud's table from before the start: kept"
                f" {len(result.kept)} rule(s), removed {len(stale)}"
                + (" (the table rebuilt)" if result.rebuilt else " stale")
                + (f" ({'; '.join(stale)[:300]})" if stale and not result.rebuilt else "")
                + f", added {len(result.added)}",
                interface="",
                kept=len(result.kept),
                removed=len(result.removed),
                changed=0,
                added=len(result.added),
            )
        if self._marking_error:
            # the pair of the net.marking_error event: the log says when marking came back
            log.info("traffic: nftables marking in force again")
            self._events.emit(
                "net.marking",
                f"nftables marking in force again (was: {self._marking_error})",
                restores=0,
            )
        elif result.created and not result.rebuilt and self._marking_ok:
            # written by this run and gone since its last pass: a firewall reload flushed
            # the whole ruleset, and the jobs' packets (if any job is marked) left unmarked
            # until now
            restored = True
            self._marking_restores += 1
            self._restores_unsaid += 1
            self._restore_rules = len(result.added)
        elif result.changed and self._marking_ok and not result.foreign:
            self._events.emit(
                "net.marking",
                f"nftables table updated: +{len(result.added)} -{len(result.removed)} rule(s)"
                + (" (table recreated)" if result.created else ""),
                restores=0,
            )
        self._marking_error = ""
        self._marking_ok = True
        self._say_restores(restored)

    def _say_restores(self, restored: bool, *, at_once: bool = False) -> None:
        """Say the restores of gpud's table not said yet (``restored``: this pass made
        one): the first at once, then those that follow within
        ``MARKING_RESTORE_SAID_EVERY_S`` of it in one event once that time is up, with
        their count (``restores``), on whichever pass comes next. ``at_once``: say
        them now, within the minute or not (an ``nft`` that failed, gpud's stop)."""
        if not self._restores_unsaid:
            return
        now = self._monotonic()
        said_at = self._restore_said_at
        if not at_once and said_at is not None and now - said_at < MARKING_RESTORE_SAID_EVERY_S:
            return
        count, rules = self._restores_unsaid, self._restore_rules
        table = f"table {FAMILY} {DEFAULT_TABLE}"
        if said_at is None or (count == 1 and restored):
            message = (
                f"nftables: {table} removed outside gpud (nft flush ruleset, a firewall"
                f" reload?): written again, {rules} rule(s)"
            )
            if rules:
                message += ": the jobs' packets went unmarked until this pass"
        else:
            message = (
                f"nftables: {table} removed outside gpud again, {count} time(s) in the last"
                f" {now - said_at:.0f} s (a firewall flushing the ruleset on a timer?):"
                f" written again on each pass that found it gone, the last with {rules}"
                " rule(s)"
                + (": the jobs' packets went unmarked until each" if rules else "")
                + f"; said at most once every {MARKING_RESTORE_SAID_EVERY_S:.0f} s while it"
                " goes on (gpud_net_marking_restores_total counts each)"
            )
        if rules:
            log.warning("traffic: %s", message)
        self._events.emit("net.marking", message, restores=count)
        self._restores_unsaid, self._restore_said_at = 0, now

    def _enforce_rdma(self, tags: Mapping[str, int], levels: Mapping[str, int]) -> None:
        """Hand the map the levels want to the NIC map's worker: the tick never waits for
        ``dcb``. While the map stays the same, a failed write is tried again every
        ``RDMA_RETRY_S``, and one that held is read back every ``RDMA_RECHECK_S`` (what
        someone else changed is written back: event ``net.rdma_drift``)."""
        if self._rdma is None:
            return
        prios = self.config.level_priorities or tuple(7 - lv for lv in range(self.config.levels))
        want = {tags[j]: prios[lv] for j, lv in levels.items() if j in tags}
        now = self._monotonic()
        due = RDMA_RETRY_S if self._rdma_error else RDMA_RECHECK_S
        again = self._rdma_writer.idle() and now - self._rdma_tried_at >= due
        if want == self._rdma_posted and not again:
            return
        self._rdma_posted, self._rdma_tried_at = want, now
        self._rdma_writer.submit(want)

    def _write_rdma(self, want: dict[int, int]) -> None:
        """The NIC map's worker: one write of ``want`` (``dcb app replace`` per netdev).

        An entry that held, before the write, another priority than gpud last wrote on
        that netdev was changed outside gpud (``dcb app`` by hand, a DCBX agent): a
        write-back, counted whatever else the write did, and on the netdevs written when
        others failed. An entry missing from a netdev a write failed on since, or from one
        made again since (another ifindex), went with its table (the netdev reset or
        re-created), not with another tool. A write with
        no write-back ends the agent's run, so does one that fails."""
        assert self._rdma is not None
        try:
            written: Sequence[MapResult] = self._rdma.apply(want)
        except Exception as err:
            done = err.written if isinstance(err, DcbError) else ()
            self._log_rdma(done)
            if self._rdma_map.write_backs(done):
                self._rdma_repairs += 1
            self._rdma_map.wrote(want, err.failed if isinstance(err, DcbError) else None)
            message = f"rdma: {err}"
            if message != self._rdma_error:
                self._events.emit("net.rdma_error", message)
            self._rdma_error = message
            # a write that failed saw nothing of the agent on some netdev: what it
            # finds after is new
            self._rdma_drift_run = 0
            return
        self._log_rdma(written)
        changes = sum(len(r.changed) for r in written)
        back = self._rdma_map.write_backs(written)
        self._rdma_map.wrote(want)
        was, self._rdma_error = self._rdma_error, ""
        remade = "".join(
            f"; {r.netdev} was made again (ifindex {r.remade[0]}, was {r.remade[1]}): its"
            " map written"
            for r in written
            if r.remade is not None
        )
        if back:
            self._rdma_repairs += 1
        if was or not back:
            self._rdma_drift_run = 0  # as gpud wrote it, or after a write that saw nothing
        if was:  # the pair of the net.rdma_error event
            self._events.emit(
                "net.rdma",
                f"NIC DSCP -> priority map written on every netdev again (was: {was})"
                + (f"; {changes} change(s)" if changes else "")
                + (f", {back} of them changed outside gpud and written back" if back else "")
                + remade,
            )
            return
        if back:
            self._rdma_drift_run += 1
            again = (
                " again on 2 writes running: another agent (a DCBX one, lldpad) keeps"
                " changing it; gpud writes it back each time, said again once a write"
                " finds it as gpud wrote it"
                if self._rdma_drift_run == 2
                else ""
            )
            if self._rdma_drift_run <= 2:
                self._events.emit(
                    "net.rdma_drift",
                    f"NIC DSCP -> priority map changed outside gpud{again}: {back}"
                    " entr" + ("y" if back == 1 else "ies") + " written back",
                )
        if changes > back:
            self._events.emit(
                "net.rdma", f"NIC DSCP -> priority map: {changes - back} change(s){remade}"
            )

    @staticmethod
    def _log_rdma(written: Iterable[MapResult]) -> None:
        for result in written:
            for line in result.lines():
                log.info("rdma: %s", line)

    def settle(self, timeout: float) -> bool:
        """Wait until the NIC map the last tick wanted is written, or failed; False when
        ``dcb`` is still at it after ``timeout`` seconds."""
        return self._rdma_writer.wait_idle(timeout)

    def shutdown(self) -> None:
        """``traffic.shutdown``: leave everything (fail-static) or restore the interfaces;
        then close the netlink socket. The NIC map the last tick wanted is waited for up
        to 5 s (fail-static leaves the last priorities, on the NIC too). Restores of gpud's
        nftables table not said yet (within a minute of the last said) are said first."""
        self._rdma_writer.wait_idle(5.0)
        self._rdma_writer.close()
        # restores of gpud's table held within the minute are said before the stop, not lost
        with self._io_lock:
            self._say_restores(False, at_once=True)
        try:
            if self.config.enabled and self.config.shutdown == "restore":
                self._restore()
        finally:
            if self._tc is not None:
                self._tc.close()

    def _restore(self) -> None:
        for iface in self.config.interfaces:
            if self._tc is not None:
                original, recorded_at = self._to_restore(iface)
                was = self._replaced.get(iface, "")
                try:
                    done = self._tc.restore(iface, None if was else original, ifindex=recorded_at)
                except Exception as err:
                    message = _describe(iface, err)
                    if not _tree_may_stay(err) and not _not_put_back(err):
                        # no netdev by that name, or its tree is another name's to restore:
                        # nothing of gpud's is left behind here
                        log.info("traffic: nothing to restore on %s: %s", iface, message)
                        continue
                    if _not_put_back(err):
                        # gpud's tree is gone, the kernel's default root in its place:
                        # nothing of gpud's is left for the next start to take or remove
                        self._say_not_put_back(iface, "traffic.shutdown = restore", message)
                        if self._shaped is not None:
                            self._shaped.discard(iface)
                        continue
                    # a failed delete or replace, or a refusal where gpud's tree was seen
                    # or could not be read: the operator is told where it may stay
                    self._restore_failed(
                        iface,
                        f"cannot restore {iface}",
                        "traffic.shutdown = restore, not done",
                        message,
                    )
                    continue
                # a netdev renamed away is restored by its ifindex: gpud's tree went with it,
                # unless someone removed it there, when nothing was restored
                there = "restored there" if done.ours else "found there"
                renamed = (
                    f"renamed to {done.renamed} since gpud shaped it, {there}: "
                    if done.renamed
                    else ""
                )
                self._events.emit(
                    "net.unshaped",
                    f"{iface}: traffic.shutdown = restore: {renamed}"
                    + _unshaped(original, done, done.replaced or was),
                    interface=iface,
                )
                if self._shaped is not None:
                    self._shaped.discard(iface)
        if self._marker is not None:
            try:
                self._marker.delete()
            except Exception as err:
                log.warning("traffic: cannot delete the nftables table: %s", err)

    def _to_restore(self, iface: str) -> tuple[tcplan.RootQdisc | None, int | None]:
        """The root qdisc to give ``iface`` back, and the ifindex it was recorded on (None:
        no need to say, or not known). One adopted at start is the netdev the adapter looked
        up then, which it compares the name against itself. One the start could not read
        (missing, EBUSY, ENOBUFS) and no pass read since has only the record, and the
        record's ifindex: no pass touched it either (one is only made after a read), so
        the kernel holds what the run before left, and the restore puts the record back
        only where that is gpud's HTB root (another root is left as it is)."""
        if iface in self._originals:
            return self._originals[iface], None
        if self._shaped is None:
            return None, None
        return self._shaped.original(iface), self._shaped.original_ifindex(iface)


def _unshaped(original: tcplan.RootQdisc | None, done: RestoredLike, replaced: str) -> str:
    """What a restore did, for its event (``replaced``: the netdev is another one since
    gpud took the name, "ifindex NEW, was OLD")."""
    if replaced:
        return _kept_new_root(original, replaced, done)
    if not done.ours:
        return (
            f"gpud's HTB root was not there: the root qdisc found ({_root_name(done.root)})"
            " is left as it is"
        )
    return f"gpud's HTB root removed, {_restored_root(original)}"


def _root_name(root: tcplan.RootQdisc | None) -> str:
    """``tc qdisc show``'s kind and handle; the kind alone where the handle is 0 (the
    kernel's own, unnumbered root). None is a netdev that dumps no root: one not up since
    it was made, or whose root was deleted while it was down (the kernel's ``noqueue`` is
    dumped like any other root)."""
    if root is None:
        return "none (a netdev not up since it was made, or its root deleted while down)"
    return f"{root.kind} {tcplan.format_qdisc_handle(root.handle)}" if root.handle else root.kind


def _restored_root(original: tcplan.RootQdisc | None) -> str:
    """What a restore gave the interface back, for its event."""
    if original is None:
        return "the kernel's default root qdisc is back (the one before gpud was not recorded)"
    return f"its root qdisc from before gpud is back: {_root_name(original)} (default options)"


def _kept_new_root(original: tcplan.RootQdisc | None, replaced: str, done: RestoredLike) -> str:
    """What a restore did on a netdev made again since gpud took the name, for its event
    (``done.root``: the root the kernel gave the new netdev)."""
    now = done.root
    old = (
        f"; the old netdev's {_root_name(original)} is not put on it"
        if original is not None and (now is None or now.kind != original.kind)
        else ""
    )
    tree = "gpud's HTB root removed from it" if done.ours else "gpud's tree went with the old one"
    return (
        f"another netdev by that name since gpud took it ({replaced}): {tree},"
        f" the root qdisc the kernel gave it is left{old}"
    )


def _tree_may_stay(err: Exception) -> bool:
    """Whether gpud's tree may be left on a netdev by a restore that raised ``err``: not
    where the adapter says none is (``TcError.tree_left`` False: no netdev by that name,
    or its index another name's to restore); anything else may have left it."""
    return getattr(err, "tree_left", None) is not False


def _not_put_back(err: Exception) -> bool:
    """Whether a restore that raised ``err`` deleted gpud's tree and only failed to put the
    original root back (``TcError.tree_removed``): the netdev has the kernel's default."""
    return getattr(err, "tree_removed", False) is True


def _describe(iface: str, err: Exception) -> str:
    if isinstance(err, OSError) and err.errno == 19:
        return f"{iface}: no such interface"
    text = str(err) or type(err).__name__
    return text if text.startswith(iface) else f"{iface}: {text}"


def _objects(state: tcplan.InterfaceState) -> int:
    """The tc objects of gpud's tree ``state`` holds: its root, classes, filters and child
    qdiscs (filters it does not recognise included)."""
    return (
        (state.root is not None)
        + len(state.classes)
        + len(state.filters)
        + len(state.foreign_filters)
        + len(state.child_qdiscs)
    )


_DELETES = (
    tcplan.OpKind.DELETE_CLASS,
    tcplan.OpKind.DELETE_FILTER,
    tcplan.OpKind.DELETE_QDISC,
    tcplan.OpKind.DELETE_ROOT,
)


def _removed(state: tcplan.InterfaceState, ops: Sequence[tcplan.TcOp]) -> int:
    """How many of the objects of ``state`` (:func:`_objects`) ``ops`` remove: all when
    they replace the root; else the classes deleted with the qdiscs under them, the
    qdiscs deleted, and the filters each filter deletion matches (one deletes every
    unrecognised filter of its priority and protocol when it names no handle)."""
    kinds = {op.kind for op in ops}
    if kinds & {tcplan.OpKind.REPLACE_ROOT, tcplan.OpKind.DELETE_ROOT}:
        return _objects(state)
    classes = {op.cls.classid for op in ops if op.kind is tcplan.OpKind.DELETE_CLASS and op.cls}
    qdiscs = sum(op.kind is tcplan.OpKind.DELETE_QDISC for op in ops)
    filters = [(tcplan.FILTER_PRIO, tcplan.ETH_P_ALL, h) for h, _ in state.filters]
    deletes = [
        (op.filter_prio, op.filter_protocol, op.filter_handle)
        for op in ops
        if op.kind is tcplan.OpKind.DELETE_FILTER
    ]
    return (
        len(classes)
        + qdiscs
        + sum(q.parent in classes for q in state.child_qdiscs)
        + sum(
            any(p == dp and proto == dproto and dh in (0, h) for dp, dproto, dh in deletes)
            for p, proto, h in (*filters, *state.foreign_filters)
        )
    )
