"""The running daemon: one reconcile loop of isolated steps, plus the servers.

Life of a daemon (``Daemon.run``)::

    open state (SQLite) and event log
    start: sampler (own threads) -> /metrics (own thread) -> gRPC (event loop)
    start-up reconcile (MIG layouts, MPS daemons)
    READY=1
    every tick_s: each step runs isolated (a failing step logs, rate-limited, and the loop
        continues); WATCHDOG=1 after each pass, and between the steps of a long
        one; SIGHUP -> reload config
    SIGTERM/SIGINT: STOPPING=1, stop gRPC, MPS, metrics, sampler; exit 0

The backend (the real NVML adapter, or the same adapter over the simulated node) and the
MPS control binary are chosen by the composition root, :mod:`gpud.main`, and handed in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import math
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gpud import __version__, files
from gpud import build as build_id
from gpud.admission.api import QueueServicer
from gpud.admission.metrics import AdmissionMetrics
from gpud.admission.passes import PassRunner
from gpud.admission.service import SCHEMA as ADMISSION_SCHEMA
from gpud.admission.service import AdmissionService, mig_file_layouts
from gpud.api.access import ReportTokens
from gpud.api.gate import CallGate
from gpud.api.node import NodeServicer
from gpud.api.ports import FaultPort, NodeInfo, ReloadState, StateFiles
from gpud.api.server import ApiServer
from gpud.backend.port import GpuBackend, GpuIdentity
from gpud.cluster.metrics import ClusterMetrics
from gpud.cluster.nodeview import DaemonNodeView
from gpud.cluster.runtime import ClusterRuntime
from gpud.colo.api import ColoServicer, Registered
from gpud.colo.metrics import ColoMetrics
from gpud.colo.service import ColoService, RunningJob
from gpud.config import (
    ClusterConfig,
    Config,
    FileStamp,
    Layers,
    TrafficConfig,
    file_stamp,
    overridden,
    parse_address,
    socket_gid,
    value_of,
)
from gpud.dirlock import DirLocks
from gpud.errors import ConfigError, GpudError, Unavailable
from gpud.events import EventLog
from gpud.jobs.api import JobsServicer
from gpud.jobs.attribution import memory_by_job
from gpud.jobs.metrics import JobMetrics
from gpud.jobs.placement import SCHEMA as PLACEMENT_SCHEMA
from gpud.jobs.registry import SCHEMA as JOBS_SCHEMA
from gpud.jobs.service import JobService
from gpud.jobs.stops import SCHEMA as STOPS_SCHEMA
from gpud.loopstats import LoopMetrics, LoopStats
from gpud.metrics import Collector, build_registry
from gpud.metrics_http import METRICS_POLL_S, start_metrics_server, stop_metrics_server
from gpud.mig.api import MigServicer
from gpud.mig.manager import MigManager
from gpud.mig.metrics import MigMetrics
from gpud.mig.store import SCHEMA as MIG_SCHEMA
from gpud.mps.api import MpsServicer
from gpud.mps.manager import SCHEMA as MPS_SCHEMA
from gpud.mps.manager import MpsManager
from gpud.mps.metrics import MpsMetrics
from gpud.net.api import NetServicer
from gpud.net.cgroups import JobCgroups
from gpud.net.metrics import TrafficMetrics
from gpud.net.port import TrafficSummary
from gpud.net.service import leveller_config
from gpud.net.shaped import SCHEMA as SHAPED_SCHEMA
from gpud.net.tagstore import SCHEMA as TAGS_SCHEMA
from gpud.net.wiring import open_traffic
from gpud.notify import Notifier, while_starting
from gpud.reach import reach_warnings
from gpud.store import DB_NAME, StateStore, declared_tables, worst_refusals_s
from gpud.telemetry.sampler import Sampler, tick_bound_s
from gpud.telemetry.seen import SCHEMA as SEEN_SCHEMA
from gpud.telemetry.seen import SeenGpus
from gpud.telemetry.seen import identity as seen_identity
from gpud.telemetry.snapshot import ClearedXids, SeenIdentity, Snapshot
from gpud.threads import EXIT_GRACE_S, on_daemon_thread, wait_first

if TYPE_CHECKING:
    from gpud.backend.sim import SimNode, Workload
    from gpud.jobs.placement import Reservation

log = logging.getLogger(__name__)
T = TypeVar("T")

# every table gpud's features make in the state database: a first start cut short (killed,
# power lost) commits some of them, each in a transaction of its own, so a database an
# earlier gpud wrote (no application_id) holds one or more of them, any of them
STATE_TABLES = declared_tables(
    SEEN_SCHEMA,
    MPS_SCHEMA,
    STOPS_SCHEMA,
    JOBS_SCHEMA,
    PLACEMENT_SCHEMA,
    ADMISSION_SCHEMA,
    MIG_SCHEMA,
    TAGS_SCHEMA,
    SHAPED_SCHEMA,
)

# Changing these needs a restart; a reload that changes them says so and keeps the old value.
RESTART_KEYS = (
    "daemon.state_dir",
    "daemon.run_dir",
    "telemetry.history",
    "telemetry.call_timeout_s",
    "backend.kind",
    "backend.simulate",
    "metrics.enabled",
    "metrics.address",
    "api.socket",
    "api.socket_group",
    "api.tcp_address",
    "api.tcp_access",
    "mig.drain_timeout_s",
    "mps.enabled",
    "mps.control_binary",
    # the traffic service is built once, with its backends and interfaces
    *(f"traffic.{f.name}" for f in dataclasses.fields(TrafficConfig)),
    # so is the cluster: election, peer API, etcd client
    *(f"cluster.{f.name}" for f in dataclasses.fields(ClusterConfig)),
)


# seconds a stop waits for a running MIG apply (within STOP_BUDGET_S; cut short by a second
# SIGTERM/SIGINT)
MIG_STOP_WAIT_S = 20.0
# seconds of the stop budget the calls that change the node (a MIG apply, a reservation or
# its release, MPS limits: gpud finishes them whether or not their callers still wait) are
# waited for, to answer their callers before the API stops; new starts are refused meanwhile
# (UNAVAILABLE "gpud is stopping"; releases are taken: gpud.api.gate). Past it, or once the
# loop pass is given up (PASS_STOP_WAIT_S, waited for at the same time), or at a second
# SIGTERM/SIGINT, their callers are cut off: gpuctl says the outcome is unknown, and the
# stop goes on (an apply's plan is kept: the next start finishes it)
CALL_STOP_WAIT_S = 18.0
# seconds of the stop budget the calls given up on (or whose callers the API's grace cut
# off) are waited for once cancelled: they end at their next await, a worker thread's
# result dropped ("METHOD (its caller gone): cut at the stop")
CUT_CALLS_WAIT_S = 0.5
# seconds the whole stop may take: every wait in it (the MIG apply, colo.json, a traffic
# tick, nft, dcb, MPS control daemons, the sampler) takes what is left of this, so that the store
# and the driver are closed before systemd's SIGKILL at TimeoutStopSec (30 s in
# systemd/gpud.service); each shutdown hook still gets STOP_HOOK_FLOOR_S once it is spent,
# the /metrics listener its poll interval to stop, the event log's flush half of
# STOP_CLOSE_WAIT_S, the store and the driver STOP_CLOSE_WAIT_S each, and the process
# EXIT_GRACE_S for its worker threads, so the worst stop is this plus those
# (Daemon.worst_stop_s: 28.0 s). A second SIGTERM/SIGINT ends the
# wait under way, skips the hooks left, and gives each close STOP_CUT_CLOSE_S
STOP_BUDGET_S = 20.0
# seconds of the stop budget an admission pass running at the stop is waited for: the loop
# pass it is part of, then one on the pass runner's thread, each at most this. What a pass
# cut short changed stays whole or absent (each start and leave is one store transaction);
# the next start's pass picks up the queue where it is
PASS_STOP_WAIT_S = 5.0
# seconds each shutdown hook gets even when the budget is spent: quitting the MPS control
# daemons or giving up the cluster's leadership takes milliseconds when nothing hangs
STOP_HOOK_FLOOR_S = 1.0
# seconds of the stop budget the co-location state's last write (colo.json) is waited for:
# a small file, flushed; one a hung disk holds is left on its thread, and the stop goes on
COLO_SAVE_WAIT_S = 2.0
# seconds the stop waits for the store's close (its locks, held by a transaction or a read
# of a pass left running, at most half of it; then SQLite's checkpoint) and then for the
# driver's (``nvmlShutdown``, which can hang on a GPU that stopped answering); past that each
# is left on its daemon thread and gpud exits: every committed transaction is already in the
# WAL, which the next open reads
STOP_CLOSE_WAIT_S = 1.0
# the same after a second SIGTERM/SIGINT, whether it came before the close or during it (at
# most this more, within STOP_CLOSE_WAIT_S): a close that needs no waiting still ends
STOP_CUT_CLOSE_S = 0.1

# seconds a pass waits for the traffic tick it started (it takes milliseconds when the
# kernel and nft answer); see Daemon._traffic_step
TRAFFIC_WAIT_S = 2.0
# seconds a pass waits for the MPS reconcile it started (milliseconds while the control
# daemons answer; hung ones take one query timeout, 10 s, however many: they are checked at
# once)
MPS_WAIT_S = 2.0
# With a watchdog (WatchdogSec=30s in systemd/gpud.service), a pass feeds it between its
# steps once this share of WatchdogSec has passed since the last feed: a pass held up by
# hung helpers (nft, dcb, MPS control daemons, another process's lock on the state
# database) is still a loop that moves, and systemd must not kill it; a step that never
# returns feeds it no more, and systemd kills gpud at WatchdogSec. The traffic and MPS
# steps wait for their task at most this share too, so that one step and the interval
# before it fit in WatchdogSec (Daemon.worst_watchdog_gap_s)
WATCHDOG_FEED_SHARE = 0.25


# what the worst gap between two WATCHDOG=1 leaves of WatchdogSec, at least: the loop's turns
# and the datagram's way to systemd
WATCHDOG_MARGIN_S = 2.0


# The loop's steps, in order: MIG first (it changes the devices), then MPS per device, then
# jobs; the simulated node's jobs (``--simulate``, the last field: only there) end before the
# cluster's order, which comes before the traffic step that enforces it in the same pass.
# Each with the daemon's coroutine that runs it.
_STEPS: tuple[tuple[str, Callable[[Daemon], Callable[[], Awaitable[None]]], bool], ...] = (
    ("state", lambda d: d._state_step, False),
    ("socket", lambda d: d._socket_step, False),
    ("seen", lambda d: d._seen_step, False),
    ("mig", lambda d: d._mig_step, False),
    ("mps", lambda d: d._mps_step, False),
    ("jobs", lambda d: d._jobs_step, False),
    ("admission", lambda d: d._admission_step, False),
    ("colo", lambda d: d._colo_step, False),
    ("sim-jobs", lambda d: d._sim_jobs_step, True),
    ("cluster", lambda d: d.cluster.tick, False),
    ("traffic", lambda d: d._traffic_step, False),
)


def _loop_steps(
    simulated: bool,
) -> list[tuple[str, Callable[[Daemon], Callable[[], Awaitable[None]]]]]:
    return [(name, run) for name, run, sim_only in _STEPS if simulated or not sim_only]


def loop_steps(*, simulated: bool) -> tuple[str, ...]:
    """The loop's steps' names, in order, on a simulated node (``--simulate``) or not."""
    return tuple(name for name, _ in _loop_steps(simulated))


def loop_interval_s(tick_s: float, watchdog_s: float | None) -> float:
    """Seconds between loop passes: ``daemon.tick_s``, but half ``WatchdogSec`` at most when
    systemd watches gpud (``watchdog_s``; None when it does not)."""
    return tick_s if watchdog_s is None else min(tick_s, watchdog_s / 2)


def overrun_wait_s(floor_s: float, tick_s: float, watchdog_s: float | None) -> float:
    """Seconds a pass waits for the traffic tick or the MPS reconcile it started: ``floor_s``,
    or the loop's interval if longer (the result is taken in the pass that started it), but
    no more than ``WATCHDOG_FEED_SHARE`` of ``WatchdogSec`` when systemd watches gpud."""
    wait = max(floor_s, loop_interval_s(tick_s, watchdog_s))
    if watchdog_s is not None:
        wait = min(wait, max(floor_s, watchdog_s * WATCHDOG_FEED_SHARE))
    return wait


def worst_watchdog_gap_s(
    watchdog_s: float, *, tick_s: float, sample_s: float, refusals_s: float
) -> float:
    """Seconds between two ``WATCHDOG=1`` at worst (see :meth:`Daemon.worst_watchdog_gap_s`):
    the interval or the feed share of ``watchdog_s``, then the longest step that returns
    (``sample_s``: one tick's wait for hung GPUs; ``refusals_s``: the state database's
    refused writes of a pass)."""
    longest_step = max(
        overrun_wait_s(TRAFFIC_WAIT_S, tick_s, watchdog_s),
        overrun_wait_s(MPS_WAIT_S, tick_s, watchdog_s),
        2 * sample_s + refusals_s,
    )
    return max(loop_interval_s(tick_s, watchdog_s), watchdog_s * WATCHDOG_FEED_SHARE) + longest_step


def config_watchdog_warning(
    config: Config, watchdog_s: float | None, gap_s: float | None = None
) -> str | None:
    """Why systemd may kill a gpud whose loop still moves, when the worst wait between two
    ``WATCHDOG=1`` leaves less than ``WATCHDOG_MARGIN_S`` of ``watchdog_s`` (the unit's
    ``WatchdogSec=``, as ``WATCHDOG_USEC`` gives it): the keys that make the gap, and the
    ``WatchdogSec=`` that fits it. ``gap_s``: a running daemon's worst gap
    (:meth:`Daemon.worst_watchdog_gap_s`); None before a daemon runs (``gpud
    --check-config``): ``config``'s, with the state database's default waits and the loop's
    steps for the configured backend. None when it fits, or when systemd does not watch
    gpud (``watchdog_s`` None)."""
    if watchdog_s is None:
        return None
    if gap_s is None:
        steps = loop_steps(simulated=config.backend.kind == "sim")
        gap_s = worst_watchdog_gap_s(
            watchdog_s,
            tick_s=config.daemon.tick_s,
            sample_s=tick_bound_s(config.telemetry.interval_s, config.telemetry.call_timeout_s),
            refusals_s=worst_refusals_s(len(steps)),
        )
    if gap_s <= watchdog_s - WATCHDOG_MARGIN_S:
        return None
    t = config.telemetry
    least = math.ceil(gap_s + WATCHDOG_MARGIN_S)
    return (
        f"a loop pass held up by a GPU that stopped answering, hung helpers and another"
        f" process's lock on the state database can go {gap_s:.1f} s without feeding the"
        f" systemd watchdog (WatchdogSec={watchdog_s:g}s, less a {WATCHDOG_MARGIN_S:g} s"
        f" margin): systemd may kill gpud while it still works. The gap grows with"
        f" telemetry.interval_s ({t.interval_s:g} s) and telemetry.call_timeout_s"
        f" ({t.call_timeout_s:g} s): a pass may wait min(call_timeout_s, interval_s / 2) for"
        f" the GPUs four times; and with daemon.tick_s ({config.daemon.tick_s:g} s) up to half"
        f" WatchdogSec. Give the unit WatchdogSec={least}s or more (systemctl edit gpud:"
        f" [Service] WatchdogSec={least}s), or lower telemetry.call_timeout_s or"
        f" telemetry.interval_s"
    )


class Overrun:
    """A blocking part of a pass, run on a daemon thread and waited for a while at most: one
    that hangs in a program gpud runs (``nft``, ``dcb``, an MPS control daemon; bounded only
    by its own timeout) must not hold back the other steps and the systemd watchdog. One
    still running is not waited for again, and none starts meanwhile; the pass that finds it
    ended starts the next one. Its error is the step's."""

    def __init__(self, name: str, clock: Callable[[], float]) -> None:
        self.name = name
        self._clock = clock
        self.task: asyncio.Future[None] | None = None
        self._started = 0.0
        self._said = False

    async def run(self, fn: Callable[[], None], wait_s: float) -> None:
        task = self.task
        if task is not None:
            if not task.done():
                running = self._clock() - self._started
                if running >= 10 and not self._said:
                    self._said = True
                    log.warning(
                        "%s step running for %.0f s: the other steps go on", self.name, running
                    )
                return
            self.task, self._said = None, False
        ended = task.exception() if task is not None else None
        task = self.task = asyncio.ensure_future(on_daemon_thread(fn))
        self._started = self._clock()
        await asyncio.wait({task}, timeout=wait_s)
        if task.done():
            self.task = None
            error = task.exception()  # retrieved even when an earlier run's error is raised
            ended = ended or error
        if ended is not None:
            raise ended

    async def end(self, timeout_s: float) -> None:
        """At the stop: wait up to ``timeout_s`` for the run under way, if any; its error is
        logged as a warning, not left for asyncio to print as a task's exception never
        retrieved (with its traceback) when the process exits. One still running after that
        is left to the exit (its error, if any, is retrieved then, unsaid)."""
        task, self.task = self.task, None
        if task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=timeout_s)
        except TimeoutError:
            pass
        except Exception as err:
            log.warning("%s step failed as gpud stopped: %s", self.name, err)


class SampledFaults:
    """The simulated node's faults, an injected XID answered once the sampler has taken it in
    (the driver posts it to the event thread, which may not have run yet when the sample
    that follows the injection is taken: ``gpuctl xid`` would not show it)."""

    def __init__(self, faults: FaultPort, sampler: Sampler, wait_s: float = 2.0) -> None:
        self._faults = faults
        self._sampler = sampler
        self._wait_s = wait_s

    def xid(self, gpu: int, code: int) -> object:
        before = self._sampler.events_handled()
        done = self._faults.xid(gpu, code)
        self._sampler.wait_events_handled(before + 1, self._wait_s)
        return done

    def lose(self, gpu: int) -> object:
        return self._faults.lose(gpu)

    def reset_required(self, gpu: int) -> object:
        return self._faults.reset_required(gpu)

    def not_supported(self, gpu: int, field: str) -> object:
        return self._faults.not_supported(gpu, field)

    def error(self, gpu: int, reading: str) -> object:
        return self._faults.error(gpu, reading)

    def slow(self, gpu: int, seconds: float) -> object:
        return self._faults.slow(gpu, seconds)

    def slow_mig(self, gpu: int, seconds: float) -> object:
        return self._faults.slow_mig(gpu, seconds)

    def clear(self, gpu: int) -> object:
        return self._faults.clear(gpu)

    def active(self) -> object:
        return self._faults.active()


EVENTS_NAME = "events.jsonl"
COLO_NAME = "colo.json"


def close_state_files(state_dir: Path) -> list[str]:
    """Take from the state directory and its files what others may read beyond their modes
    (:mod:`gpud.files`): a directory an earlier gpud created under ``umask 022`` is 0755 and
    its ``state.db`` 0644, readable with every reservation's report token by any local user.
    Logs one warning naming those it changed (none: nothing said); returns them."""
    db = state_dir / DB_NAME
    closed = files.tighten_all(
        [
            (state_dir, files.STATE_DIR_MODE),
            *((db.with_name(db.name + end), files.DB_MOST) for end in ("", "-wal", "-shm")),
            *(
                (state_dir / name, files.STATE_FILE_MODE)
                for name in (EVENTS_NAME, EVENTS_NAME + ".1", COLO_NAME)
            ),
        ]
    )
    if closed:
        log.warning("closed to other users what an earlier start left open: %s", ", ".join(closed))
    return closed


@dataclass
class Failing:
    """The failures of one isolated part of gpud's work, each run of it apart: logged as a
    warning once per ``interval_s`` at most (with its traceback unless it is a
    :class:`GpudError`), and, after one that was logged, its working again (INFO)."""

    what: str
    runs: str = "passes"  # what its runs are called in the log
    failures: int = 0
    last_warning: float = float("-inf")
    failed_runs: int = 0
    """Failed runs in a row (0: the last run worked)."""
    failing_since: float = 0.0
    """When they began (while ``failed_runs``); a warning logged since (``last_warning``
    not before it) has their end logged too."""

    def failed(self, err: Exception, started: float, now: float, interval_s: float) -> None:
        self.failures += 1
        if not self.failed_runs:
            self.failing_since = started
        self.failed_runs += 1
        if now - self.last_warning >= interval_s:
            self.last_warning = now
            log.warning(
                "%s failed (%d failures so far): %s",
                self.what,
                self.failures,
                err,
                exc_info=not isinstance(err, GpudError),
            )

    def worked(self, now: float) -> None:
        """End the run of failures, if any; say so if its failure was said."""
        if not self.failed_runs:
            return
        if self.last_warning >= self.failing_since:
            log.info(
                "%s works again, after %d failed %s over %.0f s",
                self.what,
                self.failed_runs,
                self.runs,
                now - self.failing_since,
            )
        self.failed_runs = 0

    def call(
        self, act: Callable[[], object], clock: Callable[[], float], interval_s: float
    ) -> None:
        """Run ``act``; a failure is noted and logged as above, not raised."""
        started = clock()
        try:
            act()
        except Exception as err:
            self.failed(err, started, clock(), interval_s)
        else:
            self.worked(started)


@dataclass
class Step:
    """One isolated part of a loop pass."""

    name: str
    run: Callable[[], Awaitable[None]]
    failing: Failing = field(init=False)

    def __post_init__(self) -> None:
        self.failing = Failing(f"step {self.name}")


class Daemon:
    """Everything gpud runs, wired from one config. See the module docstring."""

    WARNING_INTERVAL_S = 60.0

    def __init__(
        self,
        config: Config,
        *,
        backend: GpuBackend,
        sim: SimNode | None,
        notifier: Notifier,
        mps_control_command: Sequence[str] | None = None,
        mps_cgroups: JobCgroups | None = None,
        no_mps_cgroups: str = "",
        reload_config: Callable[[], Layers] | None = None,
        file_config: Config | None = None,
        clock: Callable[[], float] = time.monotonic,
        build: str | None = None,
        dir_locks: DirLocks | None = None,
        config_path: str = "",
        config_stamp: FileStamp | None = None,
    ) -> None:
        """``mps_control_command``: the MPS control daemon to run (default
        ``mps.control_binary``); ``mps_cgroups``: where each MPS control daemon gets a cgroup
        of its own, so that it outlives gpud's stop under systemd (None: they stay in gpud's,
        for the reason ``no_mps_cgroups``, said once in the log); ``build``: the identity of
        the code it runs (default :func:`gpud.build.current`, computed now); ``dir_locks``:
        the ``gpud.lock`` files held, made again by the loop when they are removed;
        ``config_path``: the config file, named in the warnings about it at start, and
        looked at by ``gpuctl status`` ("": none); ``config_stamp``: its
        :func:`~gpud.config.file_stamp` taken before ``config`` was read from it;
        ``reload_config``: reads the file again (SIGHUP), as :class:`~gpud.config.Layers`
        (the file's values and, flags over them, the config to run); ``file_config``: the file's own values at start, flags
        not applied (a reload that changes a key a flag sets says so; None: ``config``)."""
        self.config = config
        self._dir_locks = dir_locks
        self.build = build_id.current() if build is None else build
        self.backend = backend
        self.sim = sim
        self._notifier = notifier
        self._reload_config = reload_config
        self._file_config = config if file_config is None else file_config
        self._clock = clock
        self._started = clock()
        self._stop = asyncio.Event()
        self._stop_now = asyncio.Event()  # a second SIGTERM/SIGINT: no more waiting
        self._reload = asyncio.Event()
        self.reload_state = ReloadState()  # gpuctl status: is the running config the file's?
        self._config_path = Path(config_path) if config_path else None
        self._config_stamp = config_stamp  # of the file as last read (at start or reload)
        state_dir = config.daemon.state_dir
        files.make_dirs(state_dir, files.STATE_DIR_MODE)
        files.make_dirs(config.daemon.run_dir, files.RUN_DIR_MODE)
        close_state_files(state_dir)
        self.events = EventLog(state_dir / EVENTS_NAME, clock=time.time, monotonic=clock)
        # its refusals' time: gpuctl status; gpud's tables tell an earlier gpud's database
        # (not stamped with gpud's application_id) from another program's
        self.store = StateStore(state_dir, clock=clock, known_tables=STATE_TABLES)
        self.seen = SeenGpus(self.store)
        self.sampler = Sampler(
            backend,
            interval_s=config.telemetry.interval_s,
            history=config.telemetry.history,
            call_timeout_s=config.telemetry.call_timeout_s,
            events=self.events,
            clock=clock,
            ignored_xids=config.telemetry.ignored_xids,
            # Under the run directory: a reboot (a reset of every GPU) empties it.
            xid_state=config.daemon.run_dir / "xid-faults.json",
            last_seen=self.seen.known,
        )
        self.collector = Collector(
            self.sampler.latest, events=self.events, clock=clock, build=self.build
        )
        self._driver_version = self._read_driver_version()
        self.node_servicer = NodeServicer(
            snapshots=self.sampler.latest,
            node_info=self.node_info,
            events=self.events,
            faults=SampledFaults(sim.faults, self.sampler) if sim is not None else None,
            reboot=self._reboot_sim if sim is not None else None,
            workloads=sim.workloads if sim is not None else None,
            clear_xid=self._clear_xid,
            sample_again=self._sample_again,
            traffic=self._traffic_summary,
            clock=clock,
        )
        self.mps = MpsManager(
            self.store,
            self.events,
            config.daemon.run_dir,
            control_command=list(mps_control_command or [config.mps.control_binary]),
            enabled=config.mps.enabled,
            snapshot_clock=clock,
            cgroups=mps_cgroups,
            no_cgroups=no_mps_cgroups,
            holding=self._jobs_reserving,
        )
        self.jobs = JobService(
            self.store,
            self.events,
            self.mps,
            socket_path=config.socket_path,
            products=self._products,
        )
        # the sampler's listener (_observe_health): each of its parts fails on its own
        self._observing = (
            Failing("the sampler's MPS devices update", runs="ticks"),
            Failing("the sampler's GPU health update", runs="ticks"),
        )
        self.sampler.subscribe(self._observe_health)
        self.admission = AdmissionService(
            self.store,
            self.jobs,
            self.mps,
            self.events,
            config.admission,
            products=self._products,
            passes=PassRunner,
        )
        self._offer_mig_config(config.admission.mig_config)
        self.mig = MigManager(
            backend,
            self.store,
            self.events,
            job_resolver=self.jobs.job_of,
            on_change=self.sampler.refresh_identity,
            faults=self._faulty_gpus,
            quiesce=self.sampler.paused,
            on_reset=self.sampler.gpu_reset,
            read_timeout_s=config.telemetry.call_timeout_s,
            release=self.mps.released,
            release_active=lambda: self.mps.enabled,
            reserved=self._jobs_reserving,
            hold_placement=self.jobs.placing_none_on,
            after_change=self._devices_changed,
            last_seen=self._mig_last_seen,
            # a GPU's identity as the latest sample read it in this run
            read_identities=lambda: {g.index: g for g in self._identities() if g.read},
        )
        self.colo = ColoService(
            config.colocate,
            self.events,
            running=self._colo_running,
            holding=lambda: {r.job for r in self.jobs.reservations.held()},
            strangers=self._colo_strangers,
            default_memory=self._colo_default_memory,
            clock=clock,
            state_file=state_dir / COLO_NAME,
            registered=self.jobs.registry.registrations,
        )
        self._colo_last = float("-inf")
        self.loop_stats = LoopStats()
        # `gpuctl jobs rm` of a job whose `gpuctl run` waits for co-location stops the wait
        self.jobs.add_removal_hook(self.colo.job_removed)
        # a run that ended is not shown placed; `colo show` and /metrics read no store else
        self.jobs.add_freed_hook(self.colo.reservations_freed)
        # a place advice promised a run is its run's once it reserves, should the run
        # end before the loop reads the reservations (a command that fails at once)
        self.jobs.add_reserved_hook(self._colo_reserved)
        self.jobs.set_waiting(self.colo.waiting_kind)
        for source in (
            MigMetrics(self.mig),
            MpsMetrics(self.mps),
            JobMetrics(self.jobs),
            AdmissionMetrics(self.admission),
            ColoMetrics(self.colo),
            LoopMetrics(self.loop_stats),
        ):
            self.collector.add_source(source)
        # Opened before the gRPC server: a netlink socket may fork.
        self.traffic = open_traffic(
            config, self.store, self.events, self.jobs, config_path=config_path
        )
        # every feature's tables were found as declared (traffic's too when it is off):
        # an earlier gpud's database (not stamped) is known as gpud's from now on;
        # another program's never got this far
        self.store.mark_ours()
        if config.traffic.enabled:
            self.jobs.set_tagger(self.traffic.tag, self.traffic.tags.get, self.traffic.starting)
        self.collector.add_source(TrafficMetrics(self.traffic))
        self.cluster: ClusterRuntime = ClusterRuntime(
            config.cluster,
            traffic=self.traffic,
            view=DaemonNodeView(
                self.jobs.reservations.held,
                self.sampler.latest,
                interfaces=config.traffic.interfaces if config.traffic.enabled else (),
            ),
            leveller=leveller_config(config.traffic),
            reserved_tags=set(range(64)) - set(self.traffic.tags.pool),
            tick_s=config.daemon.tick_s,
            events=self.events,
            build=self.build,
        )
        self.collector.add_source(ClusterMetrics(self.cluster.agent))
        tokens = ReportTokens(self.jobs.reservations.job_of_token, config.api.tcp_access)
        self.calls = CallGate()  # the API's calls that change the node, answered at a stop
        self.api = ApiServer(
            config.socket_path,
            socket_group=config.api.socket_group or None,
            tcp_address=config.api.tcp_address or None,
            tcp_access=config.api.tcp_access,
            gate=self.calls,
            servicers=[
                self.node_servicer.register,
                MigServicer(
                    self.mig,
                    default_drain_timeout_s=config.mig.drain_timeout_s,
                    read_timeout_s=config.telemetry.call_timeout_s,
                    last_seen=self._last_seen,
                    stopping=self.calls.closed,
                ).register,
                MpsServicer(
                    self.mps,
                    loads=self.jobs.loads,
                    placement=self.jobs.locked,
                    last_seen=self._last_seen,
                ).register,
                JobsServicer(self.jobs, tokens=tokens).register,
                QueueServicer(self.admission, leave_waiter=self.colo.leave, tokens=tokens).register,
                ColoServicer(
                    self.colo,
                    snapshots=self.sampler.latest,
                    registered=self._registered_job,
                    tokens=tokens,
                    run_uid=self.jobs.run_uid,
                ).register,
                NetServicer(self.traffic, tokens=tokens).register,
                self.cluster.servicer.register,
            ],
        )
        self.steps: list[Step] = []
        self._shutdown: list[Callable[[], Awaitable[None] | None]] = []
        self.stop_budget_s = STOP_BUDGET_S
        self.pass_stop_wait_s = PASS_STOP_WAIT_S
        self.call_stop_wait_s = CALL_STOP_WAIT_S
        self.mig_stop_wait_s = MIG_STOP_WAIT_S
        self.close_wait_s = STOP_CLOSE_WAIT_S
        self._pass: asyncio.Future[None] | None = None  # the loop pass a stop came during
        self._step_now = ""  # the step the loop pass runs
        self._fed = clock()  # the last WATCHDOG=1 (or READY=1)
        for name, run in _loop_steps(simulated=sim is not None):
            self.add_step(name, run(self))
        # the MPS control daemons are left running for the jobs using them: see MpsManager
        self.on_shutdown(self._mps_stop)
        self._traffic = Overrun("traffic", self._clock)
        self._mps = Overrun("mps", self._clock)
        self.on_shutdown(self._traffic_stop)
        self.on_shutdown(self.cluster.stop)
        # first to stop: no admission pass starts once the stop began, and the one running
        # ends before the MPS manager and the store close under it (waited for its share of
        # the stop budget: past that it is left, and the stop goes on)
        self.on_shutdown(lambda: self.admission.passes.close(self.pass_stop_wait_s))
        self.traffic.start()
        # the store's start is done in run(), once its start-up steps wrote: until then a
        # write held up by another process's lock waits to the open's deadline, said once

    def _faulty_gpus(self) -> dict[int, str]:
        """GPU index -> reason, for the GPUs the last sample found unhealthy (lost, not
        answering, ...): MIG calls leave them alone, as a driver call on them could block."""
        snap = self.sampler.latest()
        return {g.identity.index: g.reason for g in snap.gpus if not g.healthy} if snap else {}

    def _jobs_reserving(self) -> dict[str, list[str]]:
        """The jobs holding a reservation, by device UUID (a GPU or a MIG device): a MIG
        apply does not destroy one under them. Read from a snapshot of what is committed
        (:meth:`StateStore.read`, WAL): another process holding the database's write lock
        (a sqlite3 shell's ``BEGIN IMMEDIATE``, a backup) does not hold the apply's busy
        check up; a failed read raises naming ``state.db``."""
        with self.store.read():
            held = self.jobs.reservations.held()
        jobs: dict[str, set[str]] = {}
        for r in held:
            for uuid in r.devices:
                jobs.setdefault(uuid, set()).add(r.job)
        return {uuid: sorted(names) for uuid, names in jobs.items()}

    async def _state_step(self) -> None:
        """The state database's files checked (``rm state.db-wal`` while gpud runs): the
        first pass that finds one removed or replaced saves what the WAL holds into
        ``state.db`` at once, not at the first change refused (a crash meanwhile would lose
        it), and says so in one ``daemon.state_files`` event (its journal line too)."""
        message = await asyncio.to_thread(self.store.check_files)
        if message is not None:
            self.events.emit("daemon.state_files", message, path=str(self.store.path))

    async def _socket_step(self) -> None:
        """The run directory's files made again when they were removed while gpud runs
        (``rm -rf /run/gpud``): ``gpud.lock`` first, so that a second gpud started now is
        refused as "already running", then the API's socket, and a simulated node's state."""
        again = self._dir_locks.keep() if self._dir_locks is not None else []
        if self.sim is not None and self.config.daemon.run_dir in again:
            self.sim.nvml.sim_persist()  # whatever the socket's bind does next
        await self.api.keep_socket()

    async def _mig_step(self) -> None:
        """The MIG reconcile. Where it changes a GPU (a reset alone, a pending MIG mode made
        current, included) the manager reads the devices again before that GPU's hold ends
        (``after_change``: :meth:`_devices_changed`), so the MPS step next works from the
        devices now there, not from the last tick's, as after a `gpuctl mig apply`."""
        await asyncio.to_thread(self.mig.reconcile_unless_busy, self.config.mig.on_start)

    async def _seen_step(self) -> None:
        changes = self.seen.changes(self._identities())
        if changes:
            await asyncio.to_thread(self.seen.remember, changes, time.time())

    async def _mps_step(self) -> None:
        """The MPS reconcile, waited for :meth:`overrun_wait_s` at most: control daemons that
        hang (a hung GPU hangs its daemon's queries too) make it last their 10 s query timeout
        (they are checked at once, not one after another), which would hold back the other
        steps and, past ``WatchdogSec``, the watchdog: see :class:`Overrun`."""
        await self._mps.run(
            lambda: self.mps.reconcile(self.sampler.latest()), self.overrun_wait_s(MPS_WAIT_S)
        )

    async def _jobs_step(self) -> None:
        await asyncio.to_thread(self.jobs.tick, self.sampler.latest())

    async def _admission_step(self) -> None:
        await asyncio.to_thread(self.admission.tick)

    def _identities(self) -> list[GpuIdentity]:
        snap = self.sampler.latest()
        return [g.identity for g in snap.gpus] if snap else []

    def _last_seen(self) -> dict[int, SeenIdentity]:
        """GPU index -> how an earlier run last saw it, for each GPU never read since gpud
        started."""
        snap = self.sampler.latest()
        return {
            g.identity.index: g.last_seen
            for g in (snap.gpus if snap else ())
            if g.last_seen is not None
        }

    def _mig_last_seen(self) -> dict[int, SeenIdentity]:
        """:meth:`_last_seen`, and how an earlier run last saw each GPU index the driver no
        longer counts (``nvmlDeviceGetCount``: the sampler has no slot for it): a GPU gone
        from the bus since then is still known there, so the MIG manager leaves its layout
        alone as faulty instead of taking it for a board removed (``missing``)."""
        counted = self._last_seen()
        snap = self.sampler.latest()
        slots = len(snap.gpus) if snap else 0
        gone = {
            i: told
            for i, kept in dict(self.seen.known).items()
            if i >= slots and (told := seen_identity(kept)) is not None
        }
        return {**gone, **counted}

    def _products(self) -> dict[int, str]:
        """GPU index -> product key; for a GPU never read since gpud started, the product
        an earlier run last saw there ("" where none kept it)."""
        snap = self.sampler.latest()
        return {
            g.identity.index: g.identity.product
            or (g.last_seen.product if g.last_seen is not None else "")
            for g in (snap.gpus if snap else ())
        }

    async def _colo_step(self) -> None:
        # Runs every [colocate] tick_s, not every loop pass.
        now = self._clock()
        if now - self._colo_last < self.config.colocate.tick_s:
            return
        self._colo_last = now
        await asyncio.to_thread(self.colo.tick, self.sampler.latest())

    def _colo_reserved(self, reservation: Reservation) -> None:
        self.colo.reservation_made(reservation.job, reservation.created_at, reservation.devices)

    def _colo_running(self) -> list[RunningJob]:
        """Jobs holding reservations, placed on GPU indices, with their attributed memory."""
        snap = self.sampler.latest()
        index: dict[str, int] = {}
        profiles: dict[str, str] = {}  # MIG device UUID -> its profile
        if snap is not None:
            for g in snap.gpus:
                index[g.identity.uuid] = g.identity.index
                for m in g.mig_devices:
                    index[m.identity.uuid] = g.identity.index
                    profiles[m.identity.uuid] = m.identity.profile_name
        # A lost or hung GPU's sample lists no MIG devices; the MPS targets keep the ones
        # last read, so a job in one stays on its GPU (held there by co-location, shown
        # as left alone) rather than vanishing from the loop as if it had ended.
        for t in self.mps.targets():
            if t.uuid and t.uuid not in index:
                index[t.uuid] = t.gpu
                if t.mig is not None:
                    profiles[t.uuid] = t.profile
        uses = self.jobs.process_uses()  # one tick's reading for memory and PIDs alike
        used = memory_by_job(uses)
        pids: dict[tuple[str, str], list[int]] = {}
        unreported: set[tuple[str, str]] = set()  # a process whose memory NVML does not say
        for u in uses:
            if u.job is not None:
                pids.setdefault((u.job, u.device), []).append(u.pid)
                if u.used_memory_bytes is None:
                    unreported.add((u.job, u.device))
        out = []
        defaults = {u: lim.memory_bytes for u, lim in self.mps.all_limits().items()}
        for r in self.jobs.reservations.held():
            spec = self.jobs.registry.find(r.job)
            for device in r.devices:
                if device not in index:
                    continue
                out.append(
                    RunningJob(
                        name=r.job,
                        kind=spec.kind.value if spec else "training",
                        gpu=index[device],
                        threads_percent=r.threads_percent,
                        # none of its own: its MPS client is pinned to the device's default
                        # it started with
                        memory_bytes=r.memory_on(device, defaults.get),
                        slo_p99_ms=spec.slo_p99_ms if spec else None,
                        memory_used=None
                        if (r.job, device) in unreported
                        else used.get((r.job, device), 0),
                        device=device,
                        mig_profile=profiles.get(device),
                        pids=tuple(pids.get((r.job, device), ())),
                        reserved_at=r.created_at,
                        uid=r.uid,
                        registered_at=spec.created_at if spec else None,
                    )
                )
        return out

    def _colo_default_memory(self) -> dict[int, int]:
        """Per GPU index, the MPS default pinned memory limit of the whole GPU, where it has
        one: what the jobs service reserves there for a run that sets no memory."""
        limits = self.mps.all_limits()
        out: dict[int, int] = {}
        for t in self.mps.targets():
            memory = limits[t.uuid].memory_bytes if t.uuid in limits else None
            if t.mig is None and memory is not None:
                out[t.gpu] = memory
        return out

    def _colo_strangers(self) -> dict[int, int]:
        """Per GPU index: the compute processes of no job gpud knows (MPS servers aside)."""
        return dict(Counter(u.gpu for u in self.jobs.unattributed_uses()))

    def _registered_job(self, job: str) -> Registered | None:
        spec = self.jobs.registry.find(job)
        if spec is None:
            return None
        return Registered(spec.kind.value, spec.slo_p99_ms, spec.memory_bytes)

    async def _sim_jobs_step(self) -> None:
        """On a simulated node: workload models behind the jobs' host processes."""
        await asyncio.to_thread(self._sim_jobs)

    def _sim_jobs(self) -> None:
        from gpud.backend.sim.jobmodels import JobDevice  # a simulated node's only

        assert self.sim is not None
        snap = self.sampler.latest()
        self._sim_ended(self.sim.workloads.end_exited(), snap)
        totals: dict[str, int] = {}
        for g in snap.gpus if snap is not None else ():
            totals[g.identity.uuid] = g.identity.memory_total_bytes
            for m in g.mig_devices:
                totals[m.identity.uuid] = m.identity.memory_total_bytes
        self.sim.jobs.sync(
            [
                JobDevice(
                    job=r.name,
                    kind=r.kind,
                    gpu=r.gpu,
                    mig=r.device if r.mig_profile is not None else None,
                    memory_bytes=r.memory_bytes,
                    memory_total=totals.get(r.device, 0),
                    threads_percent=r.threads_percent,
                    duty=self.colo.duty(r.name),
                    load=self.colo.load(r.name) if r.kind == "inference" else 0.0,
                    service_rate=self.colo.rate_at_share(r) if r.kind == "inference" else None,
                )
                for r in self._colo_running()
            ]
        )

    def _sim_ended(self, ended: list[Workload], snap: Snapshot | None) -> None:
        """A ``sim.workload`` event for each declared process that ended with its host
        process (one per GPU): found by a tick, or when the node was set up (the host
        process exited while no daemon ran)."""
        for w in ended:
            sample = snap.gpu(w.gpu) if snap is not None else None
            self.events.emit(
                "sim.workload",
                f"simulated process {w.pid} ended on GPU {w.gpu}: its host process exited",
                pid=w.pid,
                gpu=w.gpu,
                uuid=sample.known().uuid if sample is not None else "",
            )

    async def _traffic_step(self) -> None:
        """The traffic tick, waited for :meth:`overrun_wait_s` at most (a hung ``nft`` is
        bounded only by its own 10 s timeout): see :class:`Overrun`."""
        await self._traffic.run(self.traffic.tick, self.overrun_wait_s(TRAFFIC_WAIT_S))

    async def _traffic_stop(self) -> None:
        """Let a running traffic tick end before the interfaces are left or restored."""
        await self._traffic.end(timeout_s=30.0)
        await on_daemon_thread(self.traffic.shutdown)

    async def _mps_stop(self) -> None:
        """Let a running MPS reconcile end (a control daemon's query, a write to the state
        database) before the control daemons are left."""
        await self._mps.end(timeout_s=30.0)
        await on_daemon_thread(self.mps.leave)

    def _devices_changed(self) -> None:
        """After a MIG apply: sample again and take the devices jobs are placed on from that
        sample, not from the last tick's (a whole GPU just put into MIG mode, say). A failure
        here is logged: the apply it follows was made, and the next tick samples anyway."""
        snap = self._sample_again()
        if snap is None:
            return
        try:
            self.mps.reconcile(snap)
        except Exception:
            log.exception("the MPS reconcile after a MIG apply failed")

    def _clear_xid(self, gpu: int, xid: int | None) -> ClearedXids:
        """``gpuctl xid clear``, then a sample, so that the answer's next read (``gpuctl xid``,
        ``gpuctl gpus``) shows what is left, not the last tick's. A failed sample is logged:
        the clear was made, and the next tick samples anyway."""
        done = self.sampler.clear_xid(gpu, xid)
        if done.cleared:
            self._sample_again()
        return done

    def _observe_health(self, snap: Snapshot) -> None:
        """After each of the sampler's ticks, on its thread: the devices jobs are placed on,
        then the GPUs' health, from that snapshot. A GPU that answers again takes jobs as
        soon as ``gpuctl status`` counts it healthy, with the UUID it has now, and a GPU
        that fails takes none from then on, rather than a loop pass later. Both are short
        (neither asks an MPS daemon nor takes the placement lock: see
        :meth:`JobService.observe_health`); the loop's MPS and jobs steps take the rest (the
        daemons, the processes) once a pass. Each is isolated: one that fails is logged
        (rate-limited, as a loop step is) and the other still runs."""
        devices, health = self._observing
        devices.call(lambda: self.mps.observe_snapshot(snap), self._clock, self.WARNING_INTERVAL_S)
        health.call(lambda: self.jobs.observe_health(snap), self._clock, self.WARNING_INTERVAL_S)

    def _sample_again(self) -> Snapshot | None:
        """A sample out of turn, after a change the next read must show (a MIG apply, a
        cleared XID, a fault injected into the simulated node): in the API's answers, and in
        what admission and MPS hold of the GPUs (a `gpuctl run` right after `gpuctl xid
        clear` is not refused for the cleared XID). A failure is logged: the change was made,
        and the next tick samples anyway. None once gpud is stopping: the sampler is closed
        then, and the next start samples."""
        try:
            try:
                snap = self.sampler.tick()
            except Unavailable:  # closed
                log.info("not sampling again after a change: gpud is stopping")
                return None
            self.jobs.observe(snap)  # its processes: the sampler's listener took the rest
        except Exception:
            log.exception("sampling again after a change failed")
            return None
        return snap

    def _reboot_sim(self) -> None:
        """A simulated reboot under a running daemon: instances go, and so do the MPS
        control daemons, as on a real node; the next reconcile recreates the desired MIG
        layouts and starts each device's control daemon anew."""
        assert self.sim is not None
        # the pass waits meanwhile, and then passes over a snapshot it took before the
        # reboot: it would start daemons on the MIG devices the reboot destroyed
        with self.mps.rebooting() as ended:
            # nothing in here may take an MPS device's lock: rebooting() holds them all
            try:
                self.sim.reboot()
                self.sampler.gpu_reset()
            except Exception:
                log.warning(
                    "the simulated reboot failed after %d MPS control daemon%s ended",
                    ended,
                    "s" if ended != 1 else "",
                )
                raise
            self._sample_again()  # the API's answer shows it: RebootSim samples no more
        daemons = f", {ended} MPS control daemon{'s' if ended != 1 else ''} ended" if ended else ""
        self.events.emit(
            "sim.reboot",
            f"simulated node rebooted: MIG instances cleared{daemons}",
            mps_daemons_ended=ended,
        )

    def _read_driver_version(self) -> str:
        try:
            return self.backend.driver_version()
        except GpudError as err:
            log.warning("cannot read the driver version: %s", err)
            return ""

    def node_info(self) -> NodeInfo:
        return NodeInfo(
            backend="sim" if self.sim is not None else "nvml",
            driver_version=self._driver_version,
            gpu_count=self._gpu_count(),
            simulated=self.sim is not None,
            started_monotonic=self._started,
            version=__version__,
            build=self.build,
            reload=self._reload_status(),
            state_files=self._state_files(),
            watchdog_warning=self.watchdog_warning() or "",
        )

    def _state_files(self) -> StateFiles:
        """What the state database and the event log could not take, as they last said:
        no file is touched here (a status read never waits for the disk)."""
        refused = self.store.write_problem()
        failing = self.events.write_problem()
        queued, writing = self.events.pending()
        return StateFiles(
            state_db=str(self.store.path),
            event_log=str(self.events.path or ""),
            state_db_error=refused[0] if refused else "",
            state_db_error_monotonic=refused[1] if refused else None,
            event_log_error=failing[1] if failing else "",
            event_log_lines_missing=failing[2] if failing else 0,
            event_log_lines_queued=queued,
            event_log_write_monotonic=writing,
            state_db_write_monotonic=self.store.write_began(),
        )

    def _reload_status(self) -> ReloadState | None:
        """The reloads, and whether the file changed since it was last read: what gpud runs
        is then not what the file says, whatever the last reload did."""
        if self._reload_config is None:
            return None
        changed = (
            self._config_path is not None and file_stamp(self._config_path) != self._config_stamp
        )
        return dataclasses.replace(self.reload_state, file_changed=changed)

    def _gpu_count(self) -> int:
        snap = self.sampler.latest()
        if snap is not None:
            return len(snap.gpus)
        try:
            return self.backend.gpu_count()
        except GpudError:
            return 0

    def _traffic_summary(self) -> TrafficSummary:
        # the traffic service is built after the node's API, which asks it once serving
        return self.traffic.summary()

    def add_step(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        self.steps.append(Step(name, run))

    # -- life ---------------------------------------------------------------------------

    def request_stop(self) -> None:
        """A stop; asked again while stopping (a second SIGTERM or SIGINT), stop now: the
        waits for the running calls and the loop pass end at once."""
        if self._stop.is_set():
            self._stop_now.set()
            self.calls.cut()
        self._stop.set()

    def request_reload(self) -> None:
        self._reload.set()

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT (or :meth:`request_stop`); 0 on a clean stop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        metrics_server = None
        sampler_task = asyncio.create_task(self.sampler.run(self._stop), name="sampler")
        try:
            # One sample first: it finds GPUs that are lost or hang (bounded by
            # call_timeout_s), which the start-up MIG reconcile then leaves alone. MIG layouts
            # converge (or are only reported, as configured) before the API serves.
            await asyncio.to_thread(self.sampler.tick)
            if self.sim is not None:
                # those that ended while no daemon ran, named with the GPUs just read
                self._sim_ended(self.sim.take_ended(), self.sampler.latest())
            # The jobs service learns the unhealthy GPUs from it before the first request.
            await asyncio.to_thread(self.jobs.tick, self.sampler.latest())
            await while_starting(
                asyncio.to_thread(self.mig.reconcile, self.config.mig.on_start),
                self._notifier,
                progress=lambda: self.mig.steps_taken,
                status=lambda n: f"bringing MIG layouts to the desired ones: {n} changes made",
            )
            # the start-up steps wrote (a sqlite3 shell's write that held them up was waited
            # for, said naming the file, as the open waits): from now on such a write is
            # refused within write_wait_s, so that an API call says why
            self.store.start_done()
            if self.config.metrics.enabled:
                host, port = parse_address(
                    self.config.metrics.address, path="config", key="metrics.address"
                )
                registry = build_registry(self.collector)
                try:
                    metrics_server = start_metrics_server(registry, host, port)
                except OSError as err:
                    if err.errno == errno.EADDRINUSE:
                        # another process holds the port, maybe for a moment: not the
                        # config's fault, so exit 1 and let systemd's restart try again
                        raise Unavailable(
                            f"cannot serve /metrics on {host}:{port}: {err.strerror or err}"
                            " (metrics.address; what holds it: ss -ltnp)"
                        ) from err
                    raise ConfigError(
                        f"cannot serve /metrics on {host}:{port}: {err.strerror or err}",
                        key="metrics.address",
                    ) from err
                # the port bound, not the one asked for (0: any free one)
                log.info("serving /metrics on %s:%d", host, metrics_server[0].server_port)
            await self.api.start()
            group = self.config.api.socket_group or None
            for warning in reach_warnings(
                self.config.socket_path,
                self.config.daemon.run_dir,
                group=group,
                gid=None if group is None else socket_gid(group),
                mps=self.config.mps.enabled,
            ):
                log.warning("%s", warning)
            await self.cluster.start()
            log.info("serving gRPC on %s", self.config.socket_path)
            self.events.emit(
                "daemon.start",
                f"gpud {build_id.describe(__version__, self.build)} started",
                backend=self.node_info().backend,
                gpus=self._gpu_count(),
                build=self.build,
            )
            self._notifier.ready(f"serving {self._gpu_count()} GPUs")
            watchdog_warning = self.watchdog_warning()
            if watchdog_warning:  # said once: a node may run well with it
                log.warning("%s", watchdog_warning)
            await self._loop()
        finally:
            self._notifier.stopping()
            log.info("stopping")
            self._stop.set()
            # the daemon's clock (monotonic): the budget's deadline and each wait's share
            stopping_at = self._clock()
            deadline = stopping_at + self.stop_budget_s

            def left(most: float) -> float:
                return max(0.0, min(most, deadline - self._clock()))

            # event watchers (gpuctl events --follow) end their streams now, not at the grace
            self.events.close_watchers()
            self.calls.close()
            # no report to the leader starts now; the cluster round under way (a report in
            # flight, its order to apply) ends meanwhile, a short while, before the
            # cluster's shutdown hook gives up the leadership
            rounds = asyncio.ensure_future(
                self._finish_rounds(left(self.cluster.round_stop_wait_s()))
            )
            await self._answer_calls(left(self.call_stop_wait_s), left(self.pass_stop_wait_s))
            if self.calls.running:
                # given up on: what runs of them is cancelled now (at its next await), for
                # the rest of the stop closes what it would reach
                await self.calls.cut_held(left(CUT_CALLS_WAIT_S))
            await rounds
            with contextlib.suppress(Exception):
                await self.api.stop(grace=left(2.0))
            # what still runs of a call whose caller the stop cut off (an end taken during
            # the grace) ends here, not once the event log, the store and the driver closed
            await self.calls.cut_held(left(CUT_CALLS_WAIT_S))
            # An apply whose client the stop cancelled ends at its next drain poll; one
            # running its steps is let finish, within the unit's TimeoutStopSec, before the
            # driver and the store close under it. Past that, its in-flight plan is kept
            # and the next start finishes it.
            if not await self._mig_idle(left(self.mig_stop_wait_s)):
                log.warning(
                    "a MIG apply is still running: its in-flight plan is kept and the next "
                    "start finishes it"
                )
            # No loop pass and no changing call runs now (one given up goes on: a co-location
            # tick still changing holds the save back, which takes the loop's lock): colo.json
            # gets what co-location holds, not the last tick's write. A share of the
            # budget and no floor: the worst stop stays as it was.
            save_s = left(COLO_SAVE_WAIT_S)
            await self._run_stop(
                # the save's own wait ends first, so that its warning says why
                lambda: self.colo.save_at_stop(save_s * 0.8),
                save_s,
                "colo.save",
            )
            hooks = list(reversed(self._shutdown))
            while hooks and not self._stop_now.is_set():
                hook = hooks.pop(0)
                await self._run_stop(hook, max(STOP_HOOK_FLOOR_S, left(self.stop_budget_s)))
            if hooks:
                self.cluster.cut()  # no round while the store and the driver close
                log.warning(
                    "shutdown: skipped at a second stop (SIGTERM/SIGINT): %s",
                    ", ".join(_name(hook) for hook in hooks),
                )
            if metrics_server is not None:
                # off the loop: shutting down waits for serve_forever's next poll
                server = metrics_server
                await on_daemon_thread(lambda: stop_metrics_server(*server))
            with contextlib.suppress(asyncio.CancelledError, Exception):
                if not await self._unless_cut(
                    sampler_task, 0.0 if self._stop_now.is_set() else left(5.0)
                ):
                    sampler_task.cancel()
            took = self._clock() - stopping_at
            self.events.emit("daemon.stop", "gpud stopped", took_s=round(took, 3))

            # the lines a writer still holds (the file's disk slow), written before the exit:
            # half a close's time (a second SIGTERM/SIGINT cuts it); the flush's own wait ends
            # first, so that its warning (the lines not written) comes before this one's
            def flush() -> None:
                self.events.flush(self._close_wait_s() * 0.4)

            await self._run_stop(
                flush, self.close_wait_s / 2, "events.flush", cut_s=STOP_CUT_CLOSE_S
            )
            # the store waits for its locks half its time (the short one after a second
            # SIGTERM/SIGINT), so that its own warning (a transaction still ran) comes before
            # this wait ends, then SQLite's checkpoint
            await self._run_stop(
                lambda: self.store.close(wait_s=self._close_wait_s() / 2),
                self.close_wait_s,
                "store.close",
                cut_s=STOP_CUT_CLOSE_S,
            )
            await self._run_stop(
                self.backend.close, self.close_wait_s, "backend.close", cut_s=STOP_CUT_CLOSE_S
            )
        return 0

    def _close_wait_s(self) -> float:
        """Seconds the stop waits for a close starting now (see :meth:`_run_stop`)."""
        return STOP_CUT_CLOSE_S if self._stop_now.is_set() else self.close_wait_s

    async def _unless_cut(
        self, task: asyncio.Future[Any], timeout_s: float, *, cut: bool = True
    ) -> bool:
        """Wait up to ``timeout_s`` for ``task`` (with ``cut``: or until a second
        SIGTERM/SIGINT); whether it ended (its result is the caller's to read)."""
        waits: set[asyncio.Future[Any]] = {task}
        if cut:
            waits.add(asyncio.ensure_future(self._stop_now.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits - {task}:
                wait.cancel()
        return task.done()

    async def _run_stop(
        self,
        stop: Callable[[], Awaitable[None] | None],
        timeout: float,
        name: str = "",
        *,
        cut_s: float = 0.0,
    ) -> None:
        """One shutdown step (a hook, a close) on a daemon thread of its own (a blocking one
        holds nothing else back), given ``timeout`` seconds, or ``cut_s`` once a second
        SIGTERM/SIGINT came (before it or while it runs: at most ``cut_s`` more); past that
        it is left running and the stop goes on."""
        name = name or _name(stop)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        async def whole() -> None:
            result = await on_daemon_thread(stop)
            if result is not None:
                await result

        running = asyncio.ensure_future(whole())
        ended = await self._unless_cut(running, timeout)
        if not ended and cut_s > 0 and self._stop_now.is_set():
            left = min(cut_s, deadline - loop.time())
            ended = await self._unless_cut(running, max(0.0, left), cut=False)
        if not ended:
            running.cancel()  # the await only: its thread goes on, and exits with the process
            why = (
                "was left at a second stop (SIGTERM/SIGINT)"
                if self._stop_now.is_set()
                else f"did not end within the {timeout:.1f} s it was given"
            )
            log.warning("shutdown: %s %s; going on", name, why)
            return
        try:
            running.result()
        except Exception:
            log.exception("error during shutdown (%s)", name)

    async def _answer_calls(self, calls_s: float, pass_s: float) -> None:
        """At a stop, with the gate closed: wait up to ``calls_s`` for the running calls
        changing the node to be answered, and meanwhile up to ``pass_s`` for the loop pass
        (:meth:`_end_pass`). A pass given up as stuck (in the driver, say) ends the wait for
        the calls too: those queued behind it (a reservation waiting for the placement lock)
        would not be answered anyway. A second SIGTERM/SIGINT ends both waits at once."""
        ending = asyncio.ensure_future(self._end_pass(pass_s))
        draining = asyncio.ensure_future(self.calls.drained(calls_s))
        done, _ = await asyncio.wait({ending, draining}, return_when=asyncio.FIRST_COMPLETED)
        if ending in done and not ending.result():
            draining.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await draining
            drained = self.calls.running == 0
        else:
            drained = await draining
            await ending
        if not drained:
            log.warning(
                "stop: %d call(s) changing the node still ran: their callers are cut off"
                " (gpuctl says the outcome is unknown); a MIG apply's plan is kept and the"
                " next start finishes it",
                self.calls.running,
            )

    async def _finish_rounds(self, timeout_s: float) -> None:
        """At a stop: wait up to ``timeout_s`` for the cluster round under way (or until a
        second SIGTERM/SIGINT); past that it is left running, and what it would do once the
        cluster stopped (an order computed, a problem published) is skipped."""
        finishing = asyncio.ensure_future(self.cluster.agent.finish_rounds(timeout_s))
        if await self._unless_cut(finishing, timeout_s + 0.1) and finishing.result():
            return
        finishing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await finishing
        if self._stop_now.is_set():
            self.cluster.cut()  # its hook is skipped: no round while the store closes
        if not self.cluster.agent.round_running:
            return  # none ran (two stop requests at once): nothing left running
        why = (
            "at a second stop (SIGTERM/SIGINT)"
            if self._stop_now.is_set()
            else f"{timeout_s:.1f} s into the stop"
        )
        log.warning(
            "stop: a cluster round (a report to the leader, a leader's round) still ran %s: left running",
            why,
        )

    async def _mig_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a running MIG apply to end, or until a second
        SIGTERM/SIGINT; False if it still runs. The wait is on a daemon thread, left to
        time out on its own when the stop goes on without it."""
        if self._stop_now.is_set():
            return self.mig.wait_idle(0)
        idle = asyncio.ensure_future(on_daemon_thread(lambda: self.mig.wait_idle(timeout_s)))
        # the thread's own wait ends it; the second more are for the thread to answer
        if await self._unless_cut(idle, timeout_s + 1):
            return idle.result()
        idle.cancel()
        return False

    async def _end_pass(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the loop pass a stop came during (its admission
        step blocked behind the placement lock, say), or until a second SIGTERM/SIGINT; past
        that it is left running on its worker thread, and the stop goes on: each change of
        its is one store transaction, kept whole or not at all (one it tries once the store
        closed fails whole). False when it was given up."""
        running, self._pass = self._pass, None
        if running is None:
            return True
        if await self._unless_cut(running, timeout_s):
            with contextlib.suppress(Exception):  # its steps log their own failures
                running.result()
            return True
        running.cancel()  # the await only: its thread goes on, and exits with the process
        why = (
            "still ran at a second stop (SIGTERM/SIGINT)"
            if self._stop_now.is_set()
            else f"did not end within {timeout_s:.1f} s"
        )
        log.warning(
            "stop: the loop's %s step %s; going on without it (what it committed is kept"
            " whole, the next start's pass picks up from there)",
            self._step_now,
            why,
        )
        return False

    def on_shutdown(self, stop: Callable[[], Awaitable[None] | None]) -> None:
        self._shutdown.append(stop)

    def worst_stop_s(self) -> float:
        """Seconds the longest stop can take, from the signal to the process's exit: its
        budget, then each shutdown hook's floor once the budget is spent, the /metrics
        listener's stop, the event log's flush, the closes of the store and the driver, and
        the exit's grace for
        worker threads (below the unit's TimeoutStopSec; see STOP_BUDGET_S)."""
        return (
            self.stop_budget_s
            + len(self._shutdown) * STOP_HOOK_FLOOR_S
            + METRICS_POLL_S
            + self.close_wait_s / 2  # the event log's flush
            + 2 * self.close_wait_s
            + EXIT_GRACE_S
        )

    def loop_interval_s(self) -> float:
        """Seconds between loop passes: ``daemon.tick_s`` (as reloaded), and often enough to
        feed the systemd watchdog."""
        return loop_interval_s(self.config.daemon.tick_s, self._notifier.watchdog_s)

    def overrun_wait_s(self, floor_s: float) -> float:
        """Seconds a pass waits for the traffic tick or the MPS reconcile it started (see
        :class:`Overrun` and :func:`overrun_wait_s`)."""
        return overrun_wait_s(floor_s, self.config.daemon.tick_s, self._notifier.watchdog_s)

    def worst_watchdog_gap_s(self) -> float | None:
        """Seconds the longest wait between two ``WATCHDOG=1`` can be while the loop moves
        (None when systemd does not watch gpud): the loop's interval (or, within a pass, the
        share of ``WatchdogSec`` after which a step's end feeds it), then the longest step
        that returns: the traffic or MPS step's wait for its task, or a step that samples
        the GPUs out of turn (behind a tick under way) and meets every refusal the state
        database can make in a pass while another process holds its lock (the first after
        ``write_wait_s``, the others after ``in_use_wait_s``, one per step); a SIGHUP
        reload before a pass feeds it at its end as a step does. With the
        default telemetry waits, below the shipped unit's ``WatchdogSec`` by 2 s or more; a
        step that never returns feeds it no more, and systemd kills gpud."""
        watchdog_s = self._notifier.watchdog_s
        if watchdog_s is None:
            return None
        return worst_watchdog_gap_s(
            watchdog_s,
            tick_s=self.config.daemon.tick_s,
            sample_s=self.sampler.tick_bound_s(),
            refusals_s=self.store.worst_refusals_s(len(self.steps)),
        )

    def watchdog_warning(self) -> str | None:
        """What :func:`config_watchdog_warning` says of this daemon's worst gap between two
        ``WATCHDOG=1`` (None when systemd does not watch gpud, or the gap fits)."""
        return config_watchdog_warning(
            self.config, self._notifier.watchdog_s, self.worst_watchdog_gap_s()
        )

    def _feed_watchdog(self) -> None:
        self._notifier.watchdog()
        self._fed = self._clock()

    def _feed_long_pass(self) -> None:
        """After a step that returned: feed the watchdog if the last feed is
        ``WATCHDOG_FEED_SHARE`` of ``WatchdogSec`` ago (a pass held up by hung helpers)."""
        watchdog_s = self._notifier.watchdog_s
        if watchdog_s is not None and self._clock() - self._fed >= watchdog_s * WATCHDOG_FEED_SHARE:
            self._feed_watchdog()

    async def _loop(self) -> None:
        self._fed = self._clock()  # READY=1 just went: systemd counts from it
        while not self._stop.is_set():
            if self._reload.is_set():
                self._reload.clear()
                await self._reload_off_loop()
                # the reload came between the interval and the first step, out of
                # worst_watchdog_gap_s: its end feeds the watchdog as a step's does
                self._feed_long_pass()
            # a stop does not wait here for the pass (an admission pass blocked behind the
            # placement lock): the stop waits for it a while (_end_pass), within its budget
            steps = asyncio.ensure_future(self.run_steps())
            stop = asyncio.ensure_future(self._stop.wait())
            try:
                await asyncio.wait({steps, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
            if not steps.done():
                self._pass = steps
                return
            steps.result()
            self._feed_watchdog()
            await wait_first(self._stop, self._reload, timeout=self.loop_interval_s())

    async def run_steps(self) -> None:
        """Run every step once; a failing step is logged (rate-limited) and skipped, and
        one whose failure was logged says so (INFO) when it works again. The pass's time
        goes to ``gpud_loop_duration_seconds`` (see :mod:`gpud.loopstats`)."""
        started = self._clock()
        took: list[tuple[str, float]] = []
        for step in self.steps:
            step_started = self._clock()
            self._step_now = step.name
            try:
                await step.run()
            except Exception as err:
                step.failing.failed(err, step_started, self._clock(), self.WARNING_INTERVAL_S)
            else:
                step.failing.worked(step_started)
            took.append((step.name, self._clock() - step_started))
            self._feed_long_pass()
        self.loop_stats.record(self._clock() - started, self.loop_interval_s(), took)

    def _offer_mig_config(self, path: Path | None) -> None:
        """The mig-parted file whose configs the admission queue offers as remedies (none
        without one); the file itself is read again on a use after it changed."""
        self.admission.set_mig_file_layouts(
            mig_file_layouts(path, self._identities) if path is not None else dict
        )

    async def _reload_off_loop(self) -> None:
        """A reload (SIGHUP) whose read and checks of the file (and of the cluster's files)
        run on a thread: the API answers meanwhile. The apply is :meth:`reload`'s."""
        if self._reload_config is None:
            return
        self._notifier.reloading()
        self.reload(await on_daemon_thread(self._read_config))

    def _read_config(self) -> tuple[Layers | GpudError, FileStamp | None]:
        """The file's config, or why it cannot be taken, and the file's stamp taken before
        the read (a file changed meanwhile then shows as changed since)."""
        assert self._reload_config is not None
        stamp = file_stamp(self._config_path) if self._config_path is not None else None
        try:
            return self._reload_config(), stamp
        except GpudError as err:
            return err, stamp

    def reload(self, read: tuple[Layers | GpudError, FileStamp | None] | None = None) -> None:
        """Take the config file again (SIGHUP): ``read``, what :meth:`_read_config` gave
        (None: read it now, on this thread). A bad file keeps the running config and says
        why."""
        if self._reload_config is None:
            return
        if read is None:
            self._notifier.reloading()
            read = self._read_config()
        layers, self._config_stamp = read
        tried = dataclasses.replace(
            self.reload_state, reloads=self.reload_state.reloads + 1, last_monotonic=self._clock()
        )
        if isinstance(layers, GpudError):
            err = layers
            # the keys an earlier reload left waiting for a restart still wait
            self.reload_state = dataclasses.replace(tried, error=str(err))
            log.error("config reload failed, keeping the running config: %s", err)
            config_err = err if isinstance(err, ConfigError) else None
            self.events.emit(
                "config.reload_failed",
                str(err),
                path=(config_err and config_err.path) or "",
                key=(config_err and config_err.key) or "",
            )
            self._notifier.ready("config reload failed; running config kept")
            return
        path = str(self._config_path or "the config file")
        shadowed = overridden(self._file_config, layers, path=path)
        new = layers.final
        kept = []
        for dotted in RESTART_KEYS:
            running = value_of(self.config, dotted)
            if value_of(new, dotted) != running:
                kept.append(dotted)
                section, key = dotted.split(".")
                new = dataclasses.replace(
                    new, **{section: dataclasses.replace(getattr(new, section), **{key: running})}
                )
        if new.admission.mig_config != self.config.admission.mig_config:
            self._offer_mig_config(new.admission.mig_config)
        self.config = new
        self.admission.config = new.admission
        logging.getLogger().setLevel(new.daemon.log_level.upper())
        self.sampler.interval_s = new.telemetry.interval_s
        self.sampler.ignored_xids = frozenset(new.telemetry.ignored_xids)
        self.colo.configure(new.colocate)
        self.cluster.set_tick(new.daemon.tick_s)
        self.reload_state = dataclasses.replace(
            tried, error="", restart_needed=tuple(kept), overridden=tuple(shadowed)
        )
        message = "config reloaded"
        if kept:
            message += f"; needs a restart to change: {', '.join(kept)}"
        if shadowed:
            message += f"; {'; '.join(shadowed)}"
        # taken, as at start (a node may run well with it), but said: a reload that raises
        # daemon.tick_s or telemetry.interval_s is otherwise silent until the next start
        watchdog_warning = self.watchdog_warning()
        if watchdog_warning:
            message += f"; {watchdog_warning}"
        if kept or shadowed or watchdog_warning:
            log.warning(message)
        self.events.emit("config.reload", message, restart_needed=kept, overridden=shadowed)
        self._notifier.ready(message)


def _name(stop: Callable[..., object]) -> str:
    return getattr(stop, "__qualname__", repr(stop))
