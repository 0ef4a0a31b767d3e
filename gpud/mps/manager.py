"""MPS control daemons for every GPU (or MIG device when MIG is on), their desired limits and
their health.

Desired state is one row per device in the ``mps_limits`` table (threads percent, pinned
memory limit, enabled), written by ``gpuctl mps set``. Each :meth:`MpsManager.reconcile`
(one per daemon tick, off the event loop) makes the processes match it:

- a device without a running daemon gets one (``nvidia-cuda-mps-control -d``) and the limits
  are written (``set_default_active_thread_percentage``, ``set_default_device_pinned_mem_limit``)
  and read back; a daemon that died is restarted the same way, with a backoff after failures
  (one that keeps dying sooner than ``backoff_max_s`` after its start, a crash loop, waits
  longer before each restart: :meth:`MpsManager._ended`; ``mps.crash_loop_ended`` once one
  stays up that long); a start that fails is said once per trouble (:meth:`MpsManager._start`);
- every ``health_interval_s`` the daemon is queried; a daemon that does not answer
  ``max_failures`` times in a row is killed and restarted; limits that drifted are re-applied.
  Devices are reconciled at once, each on a thread of its own: a hung daemon (its GPU hung,
  say) costs the pass one query timeout however many hang, and no other device's check waits
  behind it. The first failed check says so (``mps.hung`` when the daemon does not answer,
  ``mps.check_failed`` otherwise, naming the GPU; later ones are warnings in the log, the
  last ``mps.unresponsive`` with its error), and ``mps.recovered`` when it answers again.
  A device whose GPU is unhealthy in the sample, for any reason ``gpuctl gpus`` shows (a
  critical XID not cleared, lost, not answering, ...: what the jobs service places no job
  by) gets no new daemon, nor a restart of one that exited (``mps.start_skipped``, once as
  the skip begins, naming the jobs reserving the device; the status says why); one running
  when its GPU turned unhealthy is left running and checked, its clients may be draining.
  The first pass that sees the GPU healthy again starts it (one whose starts were failing
  before, once their back-off allows: a flapping GPU does not reset it).
  With MPS off, a pass checks a device until it is found running no daemon (one an earlier
  run with MPS on left there is stopped first), and leaves it alone from then on;
- a device that disappeared (a MIG instance destroyed) or was disabled loses its daemon
  (``quit``, then SIGTERM and SIGKILL). One that outlives SIGKILL (stuck in the driver) is
  never taken for stopped: ``mps.stop_failed`` names it once, its record, directories and
  cgroup stay, and later passes try again with back-off (:meth:`MpsManager._try_stop`).
  A MIG apply stops the daemons of the MIG devices it destroys first, and the whole-GPU
  daemon of a GPU it enables MIG mode on (:meth:`MpsManager.released`). A daemon that does
  not answer is SIGKILLed; one that outlives that too is kept and tried again alike
  (:meth:`MpsManager._kill`), never checked, adopted or doubled meanwhile; so is one whose
  pipe directory was deleted under it (:meth:`MpsManager._kill_orphan`), also one found at
  start that an earlier gpud, killed since, ran there (:meth:`MpsManager._end_lost`).

Defaults reach only MPS servers started later, so a change is also sent to every running
server (``set_active_thread_percentage <PID>``, ``set_device_pinned_mem_limit <PID> 0``),
which affects that server's new clients.

A daemon found running at start (gpud restarted) is adopted, not started twice. gpud's stop
leaves the daemons running (:meth:`MpsManager.leave`): jobs using MPS keep their servers
through a restart (an upgrade, a setting that needs one), and the next start adopts them with
their limits. Only a device gone, MPS disabled (for the device, or ``mps.enabled = false``,
whose next start stops any left) or an operator's change stops a daemon. Each daemon is
recorded in ``mps_daemons`` (PID, start time, pipe directory, cgroup), so that a start with
another ``daemon.run_dir`` stops those left under the old one, and one with another
``traffic.cgroup_parent`` moves them (:meth:`MpsManager._take_over`); a control daemon gpud
did not start is reported, never stopped (:meth:`MpsManager._report_others`).

Under systemd everything left in the unit's cgroup is killed at its stop (``KillMode=mixed``),
the MPS servers a daemon spawned (its children) with it: so each daemon is moved, as soon as it
started, into a cgroup of its own, ``<cgroup2 mount>/<traffic.cgroup_parent>/gpud-mps-<uuid>``
(beside the jobs' ``gpud-job-<name>``; the parent holds no process, as cgroup v2 wants), and
the servers it spawns later start there. The directory is removed when its daemon is stopped
for good. Without a writable cgroup v2 the daemons stay in gpud's cgroup (said once in the
log) and, under systemd, end with gpud's stop.

Limits set on a MIG device are also kept by where the device is, in ``mps_mig_limits``: the
GPU's UUID, the GPU instance's placement and the profile. A GPU reset or a reboot re-creates
the instances with new MIG UUIDs; when a device with no limits of its own shows up where a
device with limits was, those limits become its own (``mps.limits_restored``) and its daemon
gets them, as for any device.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

from gpud.backend.port import GpuIdentity
from gpud.errors import (
    BackendError,
    DriverTimeout,
    FailedPrecondition,
    GpudError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StateError,
)
from gpud.events import EventLog
from gpud.mps import procs, protocol
from gpud.mps.daemon import DEFAULT_BASE_ENV, RUN_CONTROL, ControlDaemon, How, Run, device_dir
from gpud.mps.procs import start_time
from gpud.net.cgroups import JobCgroups
from gpud.shared import format_size, mps_unhealthy_wait
from gpud.store import StateStore
from gpud.telemetry.snapshot import Snapshot

log = logging.getLogger(__name__)

# Devices reconciled at once. Each thread mostly waits on a control client, and a node has at
# most 8 GPUs x 7 MIG devices = 56 daemons: all of them fit, so a pass waits one query
# timeout however many daemons hang.
MAX_PARALLEL = 64
# seconds ``gpuctl mps set`` waits on a daemon (for the device's lock, then per command):
# twice this stays under gpuctl's own 10 s deadline, so a daemon that has just hung is named
# in the answer instead of gpuctl saying that gpud did not answer
REQUEST_TIMEOUT_S = 2.0
# seconds before re-created MIG devices' limits are moved again after the state database
# could not be written (a full disk): the sampler's listener observes every tick
RESTORE_RETRY_S = 30.0
# each control daemon's cgroup: <cgroup2 mount>/<traffic.cgroup_parent>/gpud-mps-<uuid>
CGROUP_PREFIX = "gpud-mps-"

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS mps_limits (
        uuid TEXT PRIMARY KEY,
        gpu_index INTEGER NOT NULL,
        enabled INTEGER NOT NULL DEFAULT 1,
        active_thread_percentage INTEGER,
        pinned_mem_limit_bytes INTEGER,
        updated_at REAL NOT NULL
    )""",
    # The last limits set on a MIG device, by where it is: they outlive its MIG UUID.
    """CREATE TABLE IF NOT EXISTS mps_mig_limits (
        gpu_uuid TEXT NOT NULL,
        placement_start INTEGER NOT NULL,
        placement_size INTEGER NOT NULL,
        profile TEXT NOT NULL,
        mig_uuid TEXT NOT NULL,
        PRIMARY KEY (gpu_uuid, placement_start, placement_size, profile)
    )""",
    # The daemon gpud last started or adopted for each device, and where: what it looks for
    # at its next start, whatever daemon.run_dir and traffic.cgroup_parent are then.
    """CREATE TABLE IF NOT EXISTS mps_daemons (
        uuid TEXT PRIMARY KEY,
        pid INTEGER NOT NULL,
        start_time INTEGER,
        pipe_dir TEXT NOT NULL,
        cgroup TEXT NOT NULL
    )""",
)


@dataclass(frozen=True, slots=True)
class MpsTarget:
    """A device that gets its own control daemon: a whole GPU, or one MIG device."""

    uuid: str
    gpu: int
    mig: int | None  # MIG device index on the GPU, None for the whole GPU
    profile: str  # MIG profile ("3g.40gb"), or the GPU's product for a whole GPU
    memory_total_bytes: int
    gpu_uuid: str = ""  # the GPU of a MIG device
    placement: tuple[int, int] | None = None  # its GPU instance's (start, size), when known
    gpu_unhealthy: str = ""  # why the GPU under it is unhealthy; "" when it is healthy
    # of a GPU not read since gpud started (no ``uuid``): the UUID an earlier run read, ""
    # where none did; a name it is still asked by, never one limits are kept under
    last_seen_uuid: str = ""

    @property
    def slot(self) -> tuple[str, int, int, str] | None:
        """Where a MIG device is (GPU UUID, placement, profile): what survives re-creation."""
        if self.mig is None or self.placement is None or not self.gpu_uuid:
            return None
        return (self.gpu_uuid, self.placement[0], self.placement[1], self.profile)


@dataclass(frozen=True, slots=True)
class MpsLimits:
    """Desired defaults of one device's daemon. ``None``: the driver's own default (100 %
    threads; no memory limit)."""

    threads_percent: int | None = None
    memory_bytes: int | None = None
    enabled: bool = True


@dataclass(frozen=True, slots=True)
class Reserved:
    """What reservations hold on one device as ``gpuctl mps set`` checks a new default:
    ``memory_bytes`` in all, counting the default now in force for each reservation that
    follows it (one an earlier version made without a memory limit of its own, which kept
    no record of the default it started with: ``defaulted``, the jobs holding them)."""

    memory_bytes: int = 0
    defaulted: tuple[str, ...] = ()


# Placement held still (no reservation is added meanwhile), and what
# reservations hold on a device (UUID) read under it.
Placement = Callable[[], AbstractContextManager[object]]
ReservedOn = Callable[[str], Reserved]


@dataclass(frozen=True, slots=True)
class MpsDeviceStatus:
    target: MpsTarget
    desired: MpsLimits
    running: bool  # mps is enabled on the node and this device
    up: bool  # the daemon answered its last health check
    pid: int | None
    pipe_dir: Path
    observed_threads_percent: float | None
    observed_memory_bytes: int | None
    servers: tuple[int, ...]
    restarts: int
    last_error: str
    # its daemon's starts that failed since gpud started (``nvidia-cuda-mps-control -d``
    # exiting non-zero, or not coming up)
    failed_starts: int = 0
    # from set_limits only: whether it changed the threads or memory default the device had
    # (one its running MPS servers' clients keep till they exit); False in any other status
    limits_changed: bool = False


@dataclass(slots=True)
class _Device:
    daemon: ControlDaemon
    # held while talking to the daemon (seconds when it hangs): never with the manager's lock
    io: threading.RLock = field(default_factory=threading.RLock)
    # the command in flight under ``io``: when it gives up on the daemon (the manager's
    # clock) and its name, one value so that a reader without the lock sees the two of one
    # command (None: none is in flight); a stop that finds it already past by
    # ``request_timeout_s`` gives up on the lock early (:meth:`MpsManager._io_for_stop`)
    in_flight: tuple[float, str] | None = None
    started: bool = False  # started or adopted by this process at least once
    up: bool = False
    restarts: int = 0
    failures: int = 0  # consecutive failed health checks or starts
    # when its running daemon was started by this process (the manager's clock; None: none
    # runs, or it was adopted, or stopped by gpud): one that ends sooner than the longest
    # back-off after it is one more of a crash loop (``crashes``)
    up_since: float | None = None
    # daemons started in a row that died (or were killed for not answering) sooner than the
    # longest back-off after their start: each restart waits longer (:meth:`MpsManager._ended`)
    crashes: int = 0
    # a failed start was said (``mps.start_failed``) and the device has not run well since
    # (up ``backoff_max_s``), nor been stopped or disabled: its later failed starts, a
    # daemon that started between them or not, are the same trouble, not said again, unless
    # they fail otherwise
    start_trouble: bool = False
    # the error the last said ``mps.start_failed`` gave, its numbers aside: a start failing
    # with another is news
    start_error_said: str = ""
    # its starts that failed since gpud started, said or not: the count the next
    # ``mps.start_failed`` gives
    failed_starts: int = 0
    requested: bool = False  # limits changed while it did not answer: the next check applies
    next_start_at: float = 0.0
    next_check_at: float = 0.0
    last_error: str = ""
    # when a start was last passed over for its GPU's health (the manager's clock; None:
    # it is not): said once (``mps.start_skipped``) as the skip begins, not on every pass
    skipped_at: float | None = None
    # what ``last_error`` said as the skip began (a failed start's error): the skip's wait
    # stands in for it while it lasts, and it is said again after, while its starts back off
    before_skip: str = ""
    # when the last skip ended, its GPU healthy again, since one was said
    # (``mps.start_skipped``; None: the next skip is said): a GPU that flaps is one outage,
    # said once, as its start failures are kept across a short skip
    # (:meth:`MpsManager._skip_start`)
    skip_said_till: float | None = None
    # its last daemon was killed by gpud for not answering (``mps.unresponsive``), not one
    # that exited: a restart passed over for its GPU's health says so
    killed_unanswering: bool = False
    # why its daemon, SIGKILLed for not answering, outlived it: the passes try again
    # (:meth:`MpsManager._kill`) instead of checking or adopting it, till it has gone
    killing: str = ""
    # lost daemons that outlived SIGKILL, beside its orphan (:meth:`ControlDaemon.orphan`)
    # or left by a simulated reboot, PID -> start time (:func:`procs.start_time`): none is
    # started beside them (:meth:`MpsManager._kill_orphan`) till they have gone
    stuck: dict[int, int | None] = field(default_factory=dict)
    observed_threads: float | None = None
    observed_memory: int | None = None
    servers: tuple[int, ...] = field(default_factory=tuple)


def targets_from_snapshot(
    snapshot: Snapshot,
    previous: Iterable[MpsTarget] = (),
    mig_gpus: Mapping[int, str] = {},
) -> list[MpsTarget]:
    """One target per GPU, or per MIG device of a GPU whose MIG mode is on. An unhealthy
    GPU that could not be read (lost, hung, or with its MIG devices unread:
    ``mig_devices_read`` False, one that needs a reset) keeps its ``previous`` targets: its
    sample says nothing of its MIG devices, and taking it for a GPU without them would stop
    their daemons and start one on the faulty GPU.

    ``mig_gpus``: the GPUs last known in MIG mode, index -> UUID (:func:`mig_gpus_of`). A
    lost or hung GPU answers no MIG mode (NVML reads none of a GPU off the bus); one last
    known in MIG mode with no MIG devices (none created yet) has no target until it is read
    again: it is no whole GPU, and jobs asking whole GPUs must not count it as one."""
    before: dict[int, list[MpsTarget]] = {}
    for t in previous:
        before.setdefault(t.gpu, []).append(t)
    targets: list[MpsTarget] = []
    for gpu in snapshot.gpus:
        ident = gpu.identity
        unhealthy = "" if gpu.healthy else (gpu.reason or "unhealthy")
        kept = [
            replace(t, gpu_unhealthy=unhealthy)
            for t in before.get(ident.index, ())
            if not ident.uuid or ident.uuid in (t.uuid, t.gpu_uuid)
        ]
        # one that needs a reset still says its MIG mode, but its MIG devices were not read;
        # an empty list read is a layout (all destroyed), not a reason to keep the old one
        unread = gpu.mig_mode is None or not gpu.mig_devices_read
        if not gpu.healthy and unread and kept:
            targets += kept
        elif not gpu.healthy and gpu.mig_mode is None and _last_in_mig(ident, mig_gpus):
            continue
        elif gpu.mig_mode is not None and gpu.mig_mode.current:
            for mig in gpu.mig_devices:
                m = mig.identity
                pl = m.gpu_instance_placement
                targets.append(
                    MpsTarget(
                        m.uuid,
                        m.gpu,
                        m.mig,
                        m.profile_name,
                        m.memory_total_bytes,
                        gpu_uuid=ident.uuid,
                        placement=(pl.start, pl.size) if pl is not None else None,
                        gpu_unhealthy=unhealthy,
                    )
                )
        else:
            seen = gpu.last_seen.uuid if gpu.last_seen is not None and not ident.uuid else ""
            targets.append(
                MpsTarget(
                    ident.uuid,
                    ident.index,
                    None,
                    ident.product,
                    ident.memory_total_bytes,
                    gpu_unhealthy=unhealthy,
                    last_seen_uuid=seen,
                )
            )
    return targets


def mig_gpus_of(snapshot: Snapshot, before: Mapping[int, str] = {}) -> dict[int, str]:
    """The snapshot's GPUs in MIG mode (``nvidia-smi -q``'s "MIG Mode: Current"), index ->
    UUID, with those of ``before`` (the last result) that are unhealthy and answered no MIG
    mode: a lost or hung GPU keeps the mode it was last read in, till it is read again."""
    known: dict[int, str] = {}
    for gpu in snapshot.gpus:
        ident = gpu.identity
        if gpu.mig_mode is not None:
            if gpu.mig_mode.current:
                known[ident.index] = ident.uuid
        elif not gpu.healthy and _last_in_mig(ident, before):
            known[ident.index] = before[ident.index]
    return known


def _last_in_mig(ident: GpuIdentity, mig_gpus: Mapping[int, str]) -> bool:
    # by index and UUID: a GPU not read since gpud started has no UUID, and its index alone
    # is all there is to go by
    uuid = mig_gpus.get(ident.index)
    return uuid is not None and (not ident.uuid or uuid == ident.uuid)


def device_names(targets: Iterable[MpsTarget]) -> str:
    """The index forms people type, not UUIDs: ``0, 1, 2:0..6`` (GPU 2's MIG devices 0 to
    6), ``3:0,2`` where they are not consecutive."""
    by_gpu: dict[int, list[int]] = {}
    whole: set[int] = set()
    for t in targets:
        if t.mig is None:
            whole.add(t.gpu)
        else:
            by_gpu.setdefault(t.gpu, []).append(t.mig)
    names = []
    for gpu in sorted(whole | by_gpu.keys()):
        if gpu in whole:
            names.append(str(gpu))
        migs = sorted(by_gpu.get(gpu, ()))
        if len(migs) > 2 and migs == list(range(migs[0], migs[-1] + 1)):
            names.append(f"{gpu}:{migs[0]}..{migs[-1]}")
        elif migs:
            names.append(f"{gpu}:" + ",".join(str(m) for m in migs))
    return ", ".join(names)


class MpsManager:
    """Every device's control daemon. See the module docstring.

    ``enabled=False`` (``mps.enabled = false``) keeps limits settable and persisted but runs
    no daemon. ``control_command`` is the control program and any leading arguments.

    Talking to a daemon holds only that device's lock, so a daemon that hangs (up to
    ``timeout_s`` per command) holds up neither the status nor the other devices' changes
    and checks; never are two commands sent to one daemon at once. ``request_timeout_s``
    bounds what an operator's change waits on a daemon; ``parallel``, how many devices a
    pass reconciles at once.

    ``cgroups``: where each daemon gets a cgroup of its own (prefix :data:`CGROUP_PREFIX`),
    None to leave them in gpud's; ``no_cgroups``: why there is none, said once in the log
    at the first daemon started ("" says nothing: a simulated node, tests).
    ``others_root``: daemons gpud did not start are reported where their pipe directory is
    under it (tests: their own directory, not every test's on the machine).
    ``snapshot_clock``: the clock the snapshots' ``monotonic`` is read from (the sampler's).
    ``holding()``: the jobs holding a reservation, by device UUID (a GPU or a MIG device),
    named when a device's daemon is passed over for its GPU's health.
    ``run_control``: how ``nvidia-cuda-mps-control`` is run (:class:`gpud.mps.daemon.ControlDaemon`).
    """

    def __init__(
        self,
        store: StateStore,
        events: EventLog,
        run_dir: Path,
        control_command: Sequence[str] = ("nvidia-cuda-mps-control",),
        *,
        enabled: bool = True,
        base_env: Mapping[str, str] = DEFAULT_BASE_ENV,
        timeout_s: float = 10.0,
        health_interval_s: float = 10.0,
        max_failures: int = 3,
        backoff_max_s: float = 60.0,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        parallel: int = MAX_PARALLEL,
        proc_root: Path = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
        snapshot_clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        cgroups: JobCgroups | None = None,
        no_cgroups: str = "",
        others_root: Path = Path("/"),
        alive: Callable[[int, Path], bool] = procs.alive,
        holding: Callable[[], Mapping[str, Sequence[str]]] = dict,
        run_control: Run = RUN_CONTROL,
    ) -> None:
        self._run_control = run_control
        self._holding = holding
        self._store = store
        self._alive = alive
        # Daemons that outlived SIGKILL, by device UUID: (failed stops, when to try again).
        self._stop_tries: dict[str, tuple[int, float]] = {}
        # Devices whose daemon an earlier run left under another run dir and that would not
        # stop (UUID -> the record's run dir): theirs is not started meanwhile.
        self._moved: dict[str, Path] = {}
        self._take_over_at: float | None = None  # when to try stopping those again
        self._sweep_at = 0.0  # when to sweep again, after a daemon there would not stop
        # MIG devices about to be destroyed (see released): no daemon is started for them
        self._held: set[str] = set()
        # Devices a MIG apply released, by when it ended (``snapshot_clock``): no daemon is
        # started for them from a snapshot sampled before (it shows them as they were)
        self._released_at: dict[str, float] = {}
        # When the last simulated reboot ended (``snapshot_clock``): no MIG device's daemon is
        # started from a snapshot sampled before, those the reboot did not know of included
        # (created meanwhile by a MIG apply), which it destroyed all the same
        self._rebooted_at: float | None = None
        self._observed: Snapshot | None = None  # the newest snapshot observed
        self._snapshot_clock = snapshot_clock
        self._others_root = others_root
        self._cgroups = cgroups
        self._no_cgroups = no_cgroups
        self._cgroup_said = False  # why daemons stay in gpud's cgroup, said once
        self._events = events
        self._run_dir = run_dir
        self._command = list(control_command)
        self.enabled = enabled
        self._base_env = dict(base_env)
        self._timeout_s = timeout_s
        self._health_interval_s = health_interval_s
        self._max_failures = max_failures
        self._backoff_max_s = backoff_max_s
        self._request_timeout_s = request_timeout_s
        self._parallel = parallel
        self._proc_root = proc_root
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.RLock()  # the state below; never held while a daemon is asked
        self._pass = threading.Lock()  # one reconcile pass at a time
        self._targets: dict[str, MpsTarget] = {}
        # GPUs lost or hung before they were ever read: no UUID to key them by
        self._unread: tuple[MpsTarget, ...] = ()
        # GPUs in MIG mode, index -> UUID: one with no MIG devices has no target, yet exists;
        # one lost or hung since stays, as last read, till it is read again (mig_gpus_of)
        self._mig_gpus: dict[int, str] = {}
        self._seen: set[str] = set()  # device UUIDs of the last observe
        # a failed move of re-created MIG devices' limits: when it is tried again (see
        # observe), and why it failed (what the refusal of a change meanwhile names)
        self._restore: tuple[float, StateError] | None = None
        # the re-created MIG devices whose move waits for that try: no daemon is started
        # for them meanwhile (their limits are not known yet)
        self._restoring: set[str] = set()
        self._devices: dict[str, _Device] = {}
        # With MPS off: devices found running no daemon. None is ever started for them while
        # it is off (mps.enabled needs a restart), so a pass leaves them alone: no thread,
        # no PID file read. A device new to the pass (a MIG device re-created) is checked
        # once, and a daemon an earlier run left there is stopped then.
        self._idle: set[str] = set()
        self._last_status: tuple[MpsDeviceStatus, ...] = ()
        self._all_read = False  # the last snapshot read every GPU
        self._swept = False  # directories of devices gone before this start removed
        self._looked = False  # daemons of earlier runs, and others', looked for (first pass)
        store.ensure_schema(SCHEMA)

    # -- desired state ---------------------------------------------------------------------
    def limits(self, uuid: str) -> MpsLimits:
        with self._store.transaction() as conn:
            row = conn.execute(
                "SELECT enabled, active_thread_percentage, pinned_mem_limit_bytes"
                " FROM mps_limits WHERE uuid = ?",
                (uuid,),
            ).fetchone()
        if row is None:
            return MpsLimits()
        return MpsLimits(row[1], row[2], bool(row[0]))

    def all_limits(self) -> dict[str, MpsLimits]:
        with self._store.transaction() as conn:
            rows = conn.execute(
                "SELECT uuid, enabled, active_thread_percentage, pinned_mem_limit_bytes"
                " FROM mps_limits"
            ).fetchall()
        return {r[0]: MpsLimits(r[2], r[3], bool(r[1])) for r in rows}

    def set_limits(
        self,
        device: str,
        *,
        threads_percent: int | None = None,
        memory_bytes: int | None = None,
        clear_threads: bool = False,
        clear_memory: bool = False,
        enabled: bool | None = None,
        placement: Placement = nullcontext,
        reserved: ReservedOn = lambda uuid: Reserved(),
    ) -> MpsDeviceStatus:
        """Persist new defaults for ``device`` (UUID, GPU index, or ``GPU:MIG``) and apply
        them to its daemon now. Fields left ``None`` keep their value; ``clear_*`` go back to
        the driver's default. A daemon that did not answer its last health check is not
        waited on, and one that has just hung is waited on ``request_timeout_s`` at most
        (the status returned says so, naming the device): it gets them when it answers
        again, or is restarted with them.

        ``reserved(uuid)`` is what jobs already hold on the device (:class:`Reserved`), read
        inside ``placement()``, which also holds through the check and the save: no
        reservation is made between them (a run reserving meanwhile would be counted at a
        default the check did not see). The placement lock comes before this manager's lock
        and the state store's.

        A reservation without a memory limit of its own counts the default it was made
        under (its MPS client's) until it ends, whatever the default becomes: a higher
        default may not exceed the device's memory beside what is reserved, or a run without
        a limit could not start there (:class:`ResourceExhausted`). Those an earlier version made
        (``Reserved.defaulted``) kept no such record and count the default now in force:
        for them the new default counts instead, for each, beside what the others reserve,
        and it is neither lowered nor cleared while they hold the device
        (:class:`FailedPrecondition`): their MPS clients keep the limit they started with.
        """
        target = self._resolve_read(device)
        dev = self._device(target.uuid)
        if clear_memory and dev.up and self.limits(target.uuid).memory_bytes is not None:
            self._refuse_clear_while_serving(target, dev)
        with placement():  # the desired limits only: no daemon is asked in here
            held = reserved(target.uuid)
            reserved_memory_bytes, defaulted_jobs = held.memory_bytes, held.defaulted
            with self._lock:
                self._refuse_while_limits_wait(target)
                old = self.limits(target.uuid)
                new = old
                if clear_threads:
                    new = replace(new, threads_percent=None)
                elif threads_percent is not None:
                    new = replace(new, threads_percent=protocol.check_percent(threads_percent))
                if clear_memory or memory_bytes is not None:
                    self._refuse_lower(target, old.memory_bytes, memory_bytes, defaulted_jobs)
                if clear_memory:
                    new = replace(new, memory_bytes=None)
                elif memory_bytes is not None:
                    own = reserved_memory_bytes - len(defaulted_jobs) * (old.memory_bytes or 0)
                    raising = old.memory_bytes is None or memory_bytes > old.memory_bytes
                    self._check_memory(target, memory_bytes, own, defaulted_jobs, raising=raising)
                    new = replace(new, memory_bytes=memory_bytes)
                if enabled is not None:
                    new = replace(new, enabled=enabled)
                self._save_limits(target, new)
        changed = _client_limits(old) != _client_limits(new)
        if self.enabled and (dev.up or dev.daemon.pid() is None):
            if not self._reconcile_device(
                target, force_check=True, requested=True, timeout_s=self._request_timeout_s
            ):
                dev.requested = True
                self.status()
                return replace(
                    self._status(target, self.limits(target.uuid)),
                    limits_changed=changed,
                    up=False,
                    last_error=f"the MPS control daemon of {_label(target)} is still busy with"
                    f" a command after {self._request_timeout_s:g} s; it gets the limits once"
                    " it answers, or is restarted with them",
                )
        else:
            dev.requested = True
        self.status()
        return replace(self._status(target, self.limits(target.uuid)), limits_changed=changed)

    def _refuse_while_limits_wait(self, target: MpsTarget) -> None:
        """A re-created MIG device whose limits wait to be moved to it (:meth:`observe`):
        what it holds is not known yet, so a change (fields left out keep their value)
        could neither be made on it nor told from drift once they are moved. Under the
        manager's lock, as :meth:`observe` changes what waits."""
        restore = self._restore
        if target.uuid not in self._restoring or restore is None:
            return
        at, err = restore
        if self._store.refuses_until_restart():
            # every later try is refused as well: waiting for one does not help
            then = "no move is made before gpud restarts: set them after the restart"
        else:
            left = max(0.0, at - self._clock())
            then = f"the move is tried again in {left:.0f} s: set them once it is made"
        raise FailedPrecondition(
            f"{_label(target)} ({target.uuid}): {_limits_wait(str(err))}, so"
            f" what it holds is not known yet; {then}"
        )

    def _save_limits(self, target: MpsTarget, new: MpsLimits) -> None:
        with self._store.transaction() as conn:
            conn.execute(
                "INSERT INTO mps_limits (uuid, gpu_index, enabled, active_thread_percentage,"
                " pinned_mem_limit_bytes, updated_at) VALUES (?, ?, ?, ?, ?, ?)"
                " ON CONFLICT(uuid) DO UPDATE SET gpu_index = excluded.gpu_index,"
                " enabled = excluded.enabled,"
                " active_thread_percentage = excluded.active_thread_percentage,"
                " pinned_mem_limit_bytes = excluded.pinned_mem_limit_bytes,"
                " updated_at = excluded.updated_at",
                (
                    target.uuid,
                    target.gpu,
                    int(new.enabled),
                    new.threads_percent,
                    new.memory_bytes,
                    time.time(),
                ),
            )
            if target.slot is not None:
                conn.execute(
                    "INSERT OR REPLACE INTO mps_mig_limits (gpu_uuid, placement_start,"
                    " placement_size, profile, mig_uuid) VALUES (?, ?, ?, ?, ?)",
                    (*target.slot, target.uuid),
                )
        self._events.emit(
            "mps.limits",
            f"MPS limits of {target.uuid}: threads {_pct(new.threads_percent)},"
            f" memory {_mem(new.memory_bytes)}",
            **_where(target),
            threads_percent=new.threads_percent,
            memory_bytes=new.memory_bytes,
            enabled=new.enabled,
        )

    @staticmethod
    def _refuse_lower(
        target: MpsTarget, old: int | None, new: int | None, defaulted: Sequence[str]
    ) -> None:
        """Reservations an earlier version made without a memory limit of their own hold
        the device, counted at its default now: the default their MPS clients started with
        stays theirs, so one lower (or none) would count them at less than they may pin."""
        if not defaulted or old is None or (new is not None and new >= old):
            return
        change = "cleared" if new is None else f"lowered to {format_size(new)}"
        raise FailedPrecondition(
            f"{target.uuid}: default limit {format_size(old)} held by"
            f" {len(defaulted)} reservation(s) without a memory limit of their own made"
            f" before gpud recorded each run's default ({', '.join(defaulted)}): their MPS"
            f" clients keep it, so it can be {change} once they end"
        )

    def _check_memory(
        self,
        target: MpsTarget,
        memory_bytes: int,
        reserved: int,
        defaulted: Sequence[str],
        *,
        raising: bool,
    ) -> None:
        """``reserved``: what the reservations not in ``defaulted`` hold on the device; the
        default counts for each of ``defaulted`` (or once, for the next, where none, when
        ``raising`` it: a lower one fits where the one before did)."""
        protocol.format_memory(memory_bytes)  # MPS's own minimum
        total = target.memory_total_bytes
        if memory_bytes > total:
            raise ResourceExhausted(
                f"{target.uuid}: a pinned memory limit of {format_size(memory_bytes)} exceeds"
                f" the device's {format_size(total)}"
            )
        held = memory_bytes * len(defaulted)
        if defaulted and held + reserved > total:
            mine = (
                f" + reserved by the others {format_size(reserved)}"
                f" = {format_size(held + reserved)}"
                if reserved
                else ""
            )
            raise ResourceExhausted(
                f"{target.uuid}: default limit {format_size(memory_bytes)} x"
                f" {len(defaulted)} reservation(s) without a memory limit of their own made"
                f" before gpud recorded each run's default ({', '.join(defaulted)})"
                f" = {format_size(held)}{mine}"
                f" exceeds the device's {format_size(total)}"
            )
        if not defaulted and raising and reserved and memory_bytes + reserved > total:
            raise ResourceExhausted(
                f"{target.uuid}: default limit {format_size(memory_bytes)} + reserved by jobs"
                f" {format_size(reserved)} = {format_size(memory_bytes + reserved)} exceeds"
                f" the device's {format_size(total)}"
            )

    # -- devices ---------------------------------------------------------------------------
    def targets(self) -> list[MpsTarget]:
        with self._lock:
            return sorted(
                [*self._targets.values(), *self._unread],
                key=lambda t: (t.gpu, t.mig if t.mig is not None else -1),
            )

    def target(self, uuid: str) -> MpsTarget | None:
        with self._lock:
            return self._targets.get(uuid)

    def resolve(self, device: str) -> MpsTarget:
        """A target from a UUID (``GPU-...``/``MIG-...``), a GPU index (``0``) or ``GPU:MIG``
        (``0:1``, MIG device 1 of GPU 0). A GPU not read since gpud started (lost or hung
        before it: NVML answers no UUID for it) is its target with no ``uuid`` by its index,
        or by the UUID an earlier run read where no GPU read now has that UUID (it is matched
        after every check of the GPUs read now); a MIG device of it is refused as unhealthy,
        with how the GPU was seen."""
        with self._lock:
            if device in self._targets:
                return self._targets[device]
            gpu_text, sep, mig_text = device.partition(":")
            if gpu_text.isdigit() and (not sep or mig_text.isdigit()):
                gpu = int(gpu_text)
                mig = int(mig_text) if sep else None
                found = [t for t in self.targets() if t.gpu == gpu]
                if mig is None and len(found) > 1:
                    names = device_names(found)
                    raise InvalidArgument(
                        f"GPU {gpu} is in MIG mode; name one of its MIG devices: {names}",
                        field="gpu",
                    )
                for t in found:
                    if t.mig == mig or (mig is None and len(found) == 1):
                        return t
            migs = [t for t in self._targets.values() if t.gpu_uuid == device]
            if device.startswith("GPU-") and migs:
                raise InvalidArgument(
                    f"GPU {migs[0].gpu} ({device}) is in MIG mode; name one of its MIG"
                    f" devices: {device_names(migs)}",
                    field="gpu",
                )
            with_devices = {t.gpu for t in self.targets()}
            for index, gpu_uuid in self._mig_gpus.items():
                if index in with_devices:
                    continue
                if device == gpu_uuid or (gpu_text.isdigit() and int(gpu_text) == index):
                    raise FailedPrecondition(
                        f"GPU {index} ({gpu_uuid}) is in MIG mode and has no MIG devices:"
                        " create some (gpuctl mig apply) or turn its MIG mode off"
                    )
            self._refuse_unread(device, gpu_text, mig_text if sep else None)
            last_seen = self.last_seen_on(device)
            if last_seen is not None:
                return last_seen
            known = device_names(self.targets()) or "none yet"
            raise NotFound(f"no GPU or MIG device {device!r} (known: {known}; or a GPU-/MIG- UUID)")

    def last_seen_on(self, device: str) -> MpsTarget | None:
        """:meth:`resolve`'s last resort, and how placement tells a job pinned there: the GPU
        not read since gpud started that an earlier run last read as ``device`` (a ``GPU-``
        UUID), or None. That record is kept by index, so after boards are swapped or
        renumbered the UUID may be a GPU that answers now at another index: a GPU read in
        this run with that UUID is never taken for it."""
        with self._lock:
            read = {*self._targets, *self._mig_gpus.values()}
            read.update(t.gpu_uuid for t in self._targets.values() if t.gpu_uuid)
            if device in read:
                return None
            return next((t for t in self._unread if t.last_seen_uuid == device != ""), None)

    def _refuse_unread(self, device: str, gpu_text: str, mig_text: str | None) -> None:
        """:meth:`resolve` of a ``GPU:MIG`` ``device`` that names no target:
        :class:`FailedPrecondition` where its GPU has not been read since gpud started (its
        MIG mode and devices are not known till it answers)."""
        if mig_text is None or not (gpu_text.isdigit() and mig_text.isdigit()):
            return
        for t in self._unread:
            if t.gpu == int(gpu_text):
                raise FailedPrecondition(
                    f"device {device} is on GPU {t.gpu}, which is unhealthy:"
                    f" {t.gpu_unhealthy or 'unhealthy'} (not read since gpud started: its MIG"
                    " devices are not known until it answers)"
                )

    def _resolve_read(self, device: str) -> MpsTarget:
        """:meth:`resolve`, refusing a GPU never read: limits are kept by UUID, and it has
        none yet."""
        target = self.resolve(device)
        if not target.uuid:
            # its reason may say the UUID an earlier run read ("last seen as ..."): limits
            # go by the UUID the GPU answers with, which this run has not heard
            gpu = f"GPU {target.gpu}"
            if device == target.last_seen_uuid:  # the GPU there now may be another board
                gpu = f"{device} was last seen on {gpu}, which"
            raise FailedPrecondition(
                f"{gpu} has not been read since gpud started"
                f" ({target.gpu_unhealthy or 'unhealthy'}): it takes no MPS limits until it"
                " answers with its UUID"
            )
        return target

    def pipe_dir(self, uuid: str) -> Path | None:
        """Where clients of ``uuid`` reach its daemon, or None when MPS is off for it."""
        with self._lock:
            dev = self._devices.get(uuid)
            if not self.enabled or dev is None or not self.limits(uuid).enabled:
                return None
            return dev.daemon.pipe_dir

    def status(self) -> list[MpsDeviceStatus]:
        limits = self.all_limits()  # one read for every device, not one each
        with self._lock:
            status = [self._status(t, limits.get(t.uuid, MpsLimits())) for t in self.targets()]
            self._last_status = tuple(status)
            return status

    def last_status(self) -> tuple[MpsDeviceStatus, ...]:
        """The status as of the end of the last reconcile or change, without waiting for a
        pass in progress (for scrapes)."""
        return self._last_status

    def _status(self, target: MpsTarget, desired: MpsLimits) -> MpsDeviceStatus:
        dev = self._device(target.uuid)
        pid = None if target.uuid in self._idle else dev.daemon.pid()
        return MpsDeviceStatus(
            target=target,
            desired=desired,
            running=self.enabled and desired.enabled,
            up=dev.up and pid is not None,
            pid=pid,
            pipe_dir=dev.daemon.pipe_dir,
            observed_threads_percent=dev.observed_threads,
            observed_memory_bytes=dev.observed_memory,
            servers=dev.servers,
            restarts=dev.restarts,
            last_error=dev.last_error,
            failed_starts=dev.failed_starts,
        )

    def _device(self, uuid: str) -> _Device:
        with self._lock:
            dev = self._devices.get(uuid)
            if dev is None:
                dev = self._devices[uuid] = _Device(self._daemon(uuid))
            return dev

    def _daemon(self, uuid: str, run_dir: Path | None = None) -> ControlDaemon:
        return ControlDaemon(
            uuid,
            run_dir or self._run_dir,
            self._command,
            base_env=self._base_env,
            timeout_s=self._timeout_s,
            proc_root=self._proc_root,
            sleep=self._sleep,
            clock=self._clock,
            place=functools.partial(self._place, uuid),
            alive=self._alive,
            run=self._run_control,
        )

    def _place(self, uuid: str, pid: int) -> None:
        """Move the daemon just started into its own cgroup (see the module docstring)."""
        if self._cgroups is None:
            self._say_cgroup(self._no_cgroups)
            return
        try:
            self._cgroups.place(uuid, pid)
        except NotFound:
            pass  # it died already: its start fails, and says why
        except (GpudError, OSError) as err:
            self._say_cgroup(str(err))

    def _say_cgroup(self, why: str) -> None:
        with self._lock:
            if not why or self._cgroup_said:
                return
            self._cgroup_said = True
        log.warning(
            "MPS control daemons stay in gpud's own cgroup (%s): under systemd they, and the"
            " MPS jobs they serve, end when gpud stops or restarts",
            why,
        )

    def _remove_cgroup(self, uuid: str, cgroups: JobCgroups | None = None) -> None:
        """Remove the cgroup of a daemon stopped for good, once its servers have left it;
        ``cgroups``: the tree it is in, when not the current one."""
        cgroups = cgroups or self._cgroups
        if cgroups is None or not cgroups.dir(uuid).exists():
            return
        deadline = self._clock() + 2.0
        while not cgroups.remove(uuid):
            if not cgroups.dir(uuid).exists():
                return
            if self._clock() >= deadline:
                log.warning("cannot remove %s: processes remain in it", cgroups.dir(uuid))
                return
            self._sleep(0.05)

    # -- the loop --------------------------------------------------------------------------
    def observe_snapshot(self, snapshot: Snapshot) -> None:
        """:meth:`observe` the snapshot's devices, and note its GPUs in MIG mode (``nvidia-smi
        -q``'s "MIG Mode: Current"), so that one with no MIG device is named as such.

        A snapshot older than one observed before is passed over: a pass that took it
        before a MIG apply ended, and waited behind the pass of a newer one, would see the
        devices as they were before the apply (a GPU still whole) once the newer one had let
        go of what the apply released, and start a daemon there.

        Called on two threads (the sampler's listener after each tick, and the loop's pass),
        it holds the MPS lock throughout, the store's after it (:meth:`observe`): the check
        and what it observes are one step, so an older snapshot's devices never replace a
        newer one's. The snapshot observed last is not taken again (the pass after the
        listener's)."""
        with self._lock:
            observed = self._observed
            if observed is not None and snapshot.monotonic < observed.monotonic:
                return
            if snapshot is not observed:
                mig_gpus = mig_gpus_of(snapshot, self._mig_gpus)
                self.observe(targets_from_snapshot(snapshot, self.targets(), mig_gpus))
                self._mig_gpus = mig_gpus
                # Only then are this node's devices all known: see _sweep.
                self._all_read = all(g.healthy and g.identity.uuid for g in snapshot.gpus)
                # last: one whose observe failed is observed again (the pass after it)
                self._observed = snapshot
            self._released_at = {
                u: t for u, t in self._released_at.items() if snapshot.monotonic < t
            }
            if self._rebooted_at is not None and snapshot.monotonic >= self._rebooted_at:
                self._rebooted_at = None

    def observe(self, targets: Iterable[MpsTarget]) -> None:
        """Replace the known devices (from the latest snapshot); a re-created MIG device gets
        the limits its place had (see the module docstring). A state database that cannot be
        written then (a full disk) is logged once: the move is tried again every
        RESTORE_RETRY_S, until it is made, and no daemon is started for those devices
        meanwhile. Once none of them is left (destroyed before their move), a later failure
        is logged anew."""
        with self._lock:
            targets = list(targets)
            self._targets = {t.uuid: t for t in targets if t.uuid}
            self._unread = tuple(t for t in targets if not t.uuid)
            new = [
                t for t in self._targets.values() if t.slot is not None and t.uuid not in self._seen
            ]
            if not new:
                self._restore = None  # none waits: those that did are gone
            elif self._restore is None or self._clock() >= self._restore[0]:
                try:
                    self._restore_mig_limits(new)
                except StateError as err:
                    if self._restore is None:
                        log.warning(
                            "MPS: the limits of re-created MIG devices were not moved to them"
                            " (tried again every %.0f s): %s",
                            RESTORE_RETRY_S,
                            err,
                        )
                    self._restore = (self._clock() + RESTORE_RETRY_S, err)
                else:
                    if self._restore is not None:
                        log.info("MPS: the limits of re-created MIG devices were moved to them")
                    self._restore = None
            # those whose move is still to be made are new again at the next observe
            self._restoring = {t.uuid for t in new} if self._restore is not None else set()
            self._seen = set(self._targets) - self._restoring

    def _restore_mig_limits(self, targets: list[MpsTarget]) -> None:
        with self._events.until_committed(), self._store.transaction() as conn:
            for t in targets:
                assert t.slot is not None
                row = conn.execute(
                    "SELECT mig_uuid FROM mps_mig_limits WHERE gpu_uuid = ? AND"
                    " placement_start = ? AND placement_size = ? AND profile = ?",
                    t.slot,
                ).fetchone()
                if row is None or row[0] == t.uuid:
                    continue
                old_uuid = row[0]
                if old_uuid in self._targets:
                    continue  # the old device is still there (a second device, same place)
                if conn.execute("SELECT 1 FROM mps_limits WHERE uuid = ?", (t.uuid,)).fetchone():
                    continue  # it has limits of its own
                moved = conn.execute(
                    "UPDATE mps_limits SET uuid = ?, gpu_index = ?, updated_at = ? WHERE uuid = ?",
                    (t.uuid, t.gpu, time.time(), old_uuid),
                ).rowcount
                conn.execute(
                    "UPDATE mps_mig_limits SET mig_uuid = ? WHERE gpu_uuid = ? AND"
                    " placement_start = ? AND placement_size = ? AND profile = ?",
                    (t.uuid, *t.slot),
                )
                if not moved:
                    continue
                limits = self.limits(t.uuid)
                self._events.emit(
                    "mps.limits_restored",
                    f"MPS limits of the {t.profile} MIG device at placement"
                    f" {t.slot[1]}:{t.slot[2]} of GPU {t.gpu} re-applied after it was"
                    f" re-created ({old_uuid} -> {t.uuid}): threads"
                    f" {_pct(limits.threads_percent)}, memory {_mem(limits.memory_bytes)}",
                    **_where(t),
                    previous_uuid=old_uuid,
                    placement=f"{t.slot[1]}:{t.slot[2]}",
                    profile=t.profile,
                    threads_percent=limits.threads_percent,
                    memory_bytes=limits.memory_bytes,
                )

    def reconcile(self, snapshot: Snapshot | None = None) -> None:
        """One pass: start, check, restart or stop each device's daemon, every device at
        once (see the module docstring): the pass lasts as long as its slowest device. Each
        device is isolated: a failure is logged and recorded in its status, and the others
        go on."""
        with self._pass:
            if snapshot is not None:
                self.observe_snapshot(snapshot)
            if not self._looked:
                # before any daemon starts: one of an earlier run elsewhere would be a second
                self._looked = True
                self._take_over()
                found = list(self._control_daemons())  # /proc, walked once for both
                self._end_lost(found)
                self._report_others(found)
            elif self._take_over_at is not None and self._clock() >= self._take_over_at:
                self._take_over(set(self._moved))
            with self._lock:
                # "": the status's entry of GPUs never read, which run no daemon
                gone = [u for u in self._devices if u and u not in self._targets]
                self._idle.intersection_update(self._targets)
                known = [t for t in self._targets.values() if t.uuid not in self._idle]
            calls: list[tuple[str, Callable[[], object]]] = [
                (t.uuid, functools.partial(self._reconcile_device, t)) for t in known
            ]
            calls += [
                (u, functools.partial(self._stop_device, u, reason="device gone", remove=True))
                for u in gone
            ]
            _all_at_once(calls, self._parallel)
            # with MPS off too: an earlier run with it on may have left daemons there
            if not self._swept and self._all_read and self._clock() >= self._sweep_at:
                self._sweep()
            self.status()

    # -- daemons of earlier runs, and of others -------------------------------------------
    def _cgroup_of(self, uuid: str) -> str:
        """The cgroup directory the device's daemon is in now, "" when it has none."""
        if self._cgroups is None:
            return ""
        path = self._cgroups.dir(uuid)
        return str(path) if path.is_dir() else ""

    def _record(self, uuid: str, pid: int | None) -> None:
        """Note the daemon gpud started or adopted for ``uuid``: see :meth:`_take_over`.
        ``pid`` 0: one about to start, noted before it runs, so that a gpud killed before
        it noted the PID finds that daemon (by the PID file in its pipe directory) at its
        next start, whatever its ``daemon.run_dir`` is then."""
        if pid is None:
            return
        row = (
            uuid,
            pid,
            start_time(pid, self._proc_root) if pid else None,
            str(device_dir(self._run_dir, uuid) / "pipe"),
            self._cgroup_of(uuid) if pid else str(self._cgroups_dir(uuid) or ""),
        )
        self._note("INSERT OR REPLACE INTO mps_daemons VALUES (?, ?, ?, ?, ?)", row)

    def _forget(self, uuid: str) -> None:
        """No daemon runs for ``uuid`` any more: its record goes, and so do the failed stops
        of one that would not stop (a later one stuck there is said again)."""
        with self._lock:
            self._stop_tries.pop(uuid, None)
        self._note("DELETE FROM mps_daemons WHERE uuid = ?", (uuid,))

    def _note(self, sql: str, row: tuple[object, ...]) -> None:
        """Write a daemon's record. A record is a hint for a later start (a changed run
        dir): a state database that cannot be written (a full disk) stops no daemon from
        starting or stopping, it is logged."""
        try:
            with self._store.transaction() as conn:
                conn.execute(sql, row)
        except StateError as err:
            log.warning("MPS: the record of a control daemon was not kept: %s", err)

    def _cgroups_at(self, directory: Path) -> JobCgroups | None:
        """The cgroup tree of a daemon's recorded cgroup ``directory`` (another
        traffic.cgroup_parent's)."""
        if self._cgroups is None:
            return None
        cgroups = copy.copy(self._cgroups)
        cgroups.base = directory.parent
        return cgroups

    def _take_over(self, only: set[str] | None = None) -> None:
        """At the first pass, before any daemon starts: the daemons an earlier run recorded.

        One whose pipe directory is not this run's (``daemon.run_dir`` changed) is stopped,
        and its directories and cgroup removed: every client gpud sends to the device from
        now on gets this run's pipe directory, and a second control daemon for one GPU
        would fail or split the clients. One still in another cgroup
        (``traffic.cgroup_parent`` changed) is adopted as ever, and moved, its MPS servers
        with it, into this run's.

        One that would not stop (:meth:`_try_stop`) keeps its record and directories, its
        device gets no daemon of this run beside it, and a later pass tries again (``only``:
        those devices)."""
        with self._store.transaction() as conn:
            rows = conn.execute(
                "SELECT uuid, pid, start_time, pipe_dir, cgroup FROM mps_daemons"
            ).fetchall()
        self._take_over_at = None
        for uuid, pid, ticks, pipe_dir, cgroup in rows:
            if only is not None and uuid not in only:
                continue
            old_run = _recorded_run_dir(uuid, pipe_dir)
            if old_run is None:
                # not a directory gpud makes: nothing there is gpud's to stop or remove
                log.warning(
                    "ignoring the recorded MPS control daemon of %s (pid %s): its pipe"
                    " directory %r is not <run_dir>/mps/%s/pipe",
                    uuid,
                    pid,
                    pipe_dir,
                    uuid,
                )
                self._forget(uuid)
                continue
            old_cgroups = self._cgroups_at(Path(cgroup)) if cgroup else None
            daemon = self._daemon(uuid, old_run)
            running = self._recorded_pid(daemon, pid, ticks)
            if old_run == self._run_dir:
                if (
                    running is not None
                    and old_cgroups is not None
                    and cgroup != str(self._cgroups_dir(uuid))
                ):
                    self._move_cgroup(uuid, running, old_cgroups)
                continue
            if running is not None:
                # one that lost its pipe directory gets no quit (none reaches it): SIGKILL
                lost = daemon.pid() != running
                how = self._try_stop(
                    daemon,
                    running,
                    f"it was started in {pipe_dir}, outside daemon.run_dir {self._run_dir}, and"
                    " none is started for the device beside it until it stops",
                    kill=lost,
                )
                if how is None:
                    with self._lock:
                        self._moved[uuid] = old_run
                        retry_at = self._stop_tries[uuid][1]
                    if self._take_over_at is None or retry_at < self._take_over_at:
                        self._take_over_at = retry_at
                    continue
                self._events.emit(
                    "mps.stop_moved",
                    f"stopped the MPS control daemon of {uuid} (pid {running}) that an earlier run"
                    f" started in {pipe_dir}, outside daemon.run_dir {self._run_dir} (changed"
                    f" since): its clients could no longer be sent there;"
                    f" {f'{_LOST}: SIGKILL ended it' if lost else _HOW_SAID[how]}",
                    uuid=uuid,
                    pid=running,
                    how=how,
                    pipe_dir=pipe_dir,
                    cgroup=cgroup,
                )
            daemon.remove_directory()
            with contextlib.suppress(OSError):
                (old_run / "mps").rmdir()
            if old_cgroups is not None:
                self._remove_cgroup(uuid, old_cgroups)
            self._forget(uuid)
            with self._lock:
                self._moved.pop(uuid, None)

    def _recorded_pid(self, daemon: ControlDaemon, pid: int, ticks: int | None) -> int | None:
        """The running daemon a record names: its PID while that process started when
        recorded, else the one the PID file in its pipe directory names (one started by a
        gpud killed before it recorded it, pid 0, or while the state database could not be
        written, under its predecessor's record). Never a process that only reuses the PID;
        but where another gpud now uses that pipe directory (simulated nodes with the same
        UUIDs), the daemon its PID file names is that gpud's."""
        found = daemon.pid()
        if pid > 0 and ticks is not None:
            if self._alive(pid, self._proc_root) and start_time(pid, self._proc_root) == ticks:
                return pid
            return None if found == pid else found
        return found

    def _cgroups_dir(self, uuid: str) -> Path | None:
        return None if self._cgroups is None else self._cgroups.dir(uuid)

    def _move_cgroup(self, uuid: str, pid: int, old: JobCgroups) -> None:
        """Move an adopted daemon and its MPS servers out of the cgroup an earlier run put
        them in (another traffic.cgroup_parent), into this run's, and remove the old one."""
        moved = old.pids(uuid)
        for each in moved:
            self._place(uuid, each)
        self._remove_cgroup(uuid, old)
        self._events.emit(
            "mps.cgroup_moved",
            f"moved the MPS control daemon of {uuid} (pid {pid}) and its MPS servers from"
            f" {old.dir(uuid)} into {self._cgroups_dir(uuid)} (traffic.cgroup_parent changed)",
            uuid=uuid,
            pid=pid,
            previous_cgroup=str(old.dir(uuid)),
            cgroup=str(self._cgroups_dir(uuid)),
        )

    def _control_daemons(self) -> Iterator[tuple[int, str, dict[str, str]]]:
        """The MPS control daemons that run, found in /proc by their command line
        (``nvidia-cuda-mps-control -d``, or this manager's program): each one's PID, pipe
        directory (its environment's ``CUDA_MPS_PIPE_DIRECTORY``) and environment."""
        names = {"nvidia-cuda-mps-control", os.path.basename(self._command[-1])}
        try:
            entries = [e for e in self._proc_root.iterdir() if e.name.isdigit()]
        except OSError:
            return
        for entry in entries:
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if "-d" not in (a.decode(errors="replace") for a in argv[1:]) or not any(
                    os.path.basename(a.decode(errors="replace")) in names for a in argv[:2]
                ):
                    continue
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            env = dict(v.decode(errors="replace").partition("=")[::2] for v in environ if v)
            yield int(entry.name), env.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps", env

    def _ours(self, found: Iterable[tuple[int, str, dict[str, str]]]) -> Iterator[tuple[int, str]]:
        """Those of the daemons ``found`` running (:meth:`_control_daemons`) that this gpud
        runs, their pipe directory ``<run_dir>/mps/<uuid>/pipe`` under its run dir: each
        one's PID and device UUID."""
        for pid, pipe_dir, _ in found:
            uuid = Path(pipe_dir).parent.name
            if _recorded_run_dir(uuid, pipe_dir) == self._run_dir:
                yield pid, uuid

    def _end_lost(self, found: Iterable[tuple[int, str, dict[str, str]]]) -> None:
        """At the first pass, before any daemon starts: the daemons ``found`` running
        (:meth:`_control_daemons`) under this run's ``<run_dir>/mps`` that no PID file names
        (their pipe directory, or the PID file in it, deleted while an earlier gpud, killed
        since, ran them: no client reaches them, no record of this run knows them, yet each
        holds its device) become their device's lost daemon (:meth:`ControlDaemon.lost`).
        This very pass stops them as any daemon that lost its pipe directory, all at once: a
        known device's before its new daemon starts (:meth:`_kill_orphan`), a device gone's
        with its record, directories and cgroup (:meth:`_stop_device`). One that outlives
        SIGKILL stays its device's orphan: no daemon is started beside it, and later passes
        try again.

        One beside another daemon of its device (one a PID file names, adopted or stopped
        as ever, or a second lost one) cannot be its lost daemon too: it is SIGKILLed here
        (:meth:`_end_orphan`), or said to outlive that (``mps.stop_failed``) and kept as
        stuck (``_Device.stuck``): no daemon is started beside it either."""
        for pid, uuid in self._ours(found):
            with self._lock:
                known = self._devices.get(uuid)
            # one a PID file names is adopted, or stopped, as ever: no device for it here
            if (known.daemon if known is not None else self._daemon(uuid)).pid() == pid:
                continue
            dev = self._device(uuid)
            with dev.io:
                if dev.daemon.pid() is None and dev.daemon.orphan() is None:
                    dev.daemon.lost(pid)
                    continue
                ticks = start_time(pid, self._proc_root)
                stake = f"{_LOST}, beside the device's daemon"
                if self._end_orphan(uuid, dev, pid, stake) is None:
                    dev.stuck[pid] = ticks

    def _report_others(self, found: Iterable[tuple[int, str, dict[str, str]]]) -> None:
        """Say (once, at the first pass) which MPS control daemons of those ``found``
        running (:meth:`_control_daemons`) gpud did not start (:meth:`_ours`), each with
        its pipe directory. They are left running: gpud cannot tell what relies on them."""
        found = list(found)
        ours = {pid for pid, _ in self._ours(found)}
        for pid, pipe_dir, env in found:
            if pid in ours or not Path(pipe_dir).is_relative_to(self._others_root):
                continue
            device = env.get("CUDA_VISIBLE_DEVICES", "")
            self._events.emit(
                "mps.other_daemon",
                f"an MPS control daemon gpud did not start runs (pid {pid}, pipe"
                f" directory {pipe_dir}, CUDA_VISIBLE_DEVICES={device or '(unset)'}): left"
                " running; a second control daemon for one GPU fails or splits its clients",
                pid=pid,
                pipe_dir=pipe_dir,
                devices=device,
            )

    def _sweep(self) -> None:
        """Once, at the first pass that read every GPU, MPS on or off: stop the daemons of
        devices gone while gpud was not running (a MIG instance destroyed meanwhile, a GPU
        gone) and remove their directories. Before every GPU has answered, a directory may be
        the device of a GPU not read yet, whose daemon is adopted once it answers."""
        mps_dir = self._run_dir / "mps"
        with self._lock:
            known = set(self._targets) | set(self._devices)
        try:
            names = sorted(p.name for p in mps_dir.iterdir() if p.is_dir())
        except FileNotFoundError:
            names = []
        except OSError as err:
            log.warning("cannot list %s: %s", mps_dir, err.strerror)
            return
        stuck: dict[str, float] = {}  # daemons that would not stop: when to try again
        for uuid in names:
            if uuid in known:
                continue
            daemon = self._daemon(uuid)
            pid = daemon.pid()
            if pid is not None:
                how = self._try_stop(
                    daemon, pid, "its device is gone; its record and directories are kept"
                )
                if how is None:
                    with self._lock:
                        stuck[uuid] = self._stop_tries[uuid][1]
                    continue
                self._stopped(uuid, pid, "device gone while gpud was not running", how)
            self._forget(uuid)
            daemon.remove_directory()
            self._remove_cgroup(uuid)
        if self._cgroups is not None:
            for uuid in self._cgroups.jobs():
                if uuid not in known and uuid not in stuck:
                    self._remove_cgroup(uuid)
        if stuck:
            self._sweep_at = min(stuck.values())  # a later pass sweeps again
            return
        self._swept = True

    @contextlib.contextmanager
    def _io_within(self, dev: _Device, wait_s: float | None) -> Iterator[bool]:
        """Hold ``dev``'s lock, waiting ``wait_s`` at most (None: as long as it takes);
        yields whether it is held."""
        held = dev.io.acquire(timeout=-1 if wait_s is None else wait_s)
        try:
            yield held
        finally:
            if held:
                dev.io.release()

    @contextlib.contextmanager
    def _io_for_stop(self, dev: _Device, wait_s: float | None) -> Iterator[str]:
        """Hold ``dev``'s lock for a stop: yields "" once held, else why it was not (None:
        it waits as long as it takes).

        The stop waits ``timeout_s`` + ``wait_s`` at most from when it asked, the longest one
        command to the daemon may take and then ``wait_s``: however many commands the
        holder sends one after another, and whatever it does between them (its database
        write, an event), the wait ends there; a ``quit`` (and the SIGTERM and SIGKILL after
        it) is said in flight as one command (:meth:`_try_stop`). It gives up ``wait_s``
        after it asked when the command in flight is known hung: sent with a timeout
        (``_Device.in_flight``) that has passed by ``wait_s`` and still not returned, its
        control client stuck in the driver."""
        if wait_s is None:
            with dev.io:
                yield ""
            return
        asked = self._clock()
        cap = asked + self._timeout_s + wait_s
        while True:
            seen = dev.in_flight
            until = cap if seen is None else min(cap, max(asked, seen[0]) + wait_s)
            held = dev.io.acquire(timeout=max(0.0, until - self._clock()))
            # the wait ran to its end for the command seen (or for none): it is over, unless
            # the holder went on to another command meanwhile, one not yet past its timeout
            if held or dev.in_flight == seen or self._clock() >= cap:
                break
        try:
            yield "" if held else self._busy(dev, self._clock() - asked)
        finally:
            if held:
                dev.io.release()

    def _busy(self, dev: _Device, waited_s: float) -> str:
        """Why a stop did not get ``dev``'s lock in ``waited_s``: the command in flight to its
        daemon, when one is."""
        in_flight = dev.in_flight
        if in_flight is None:
            return f"busy: another operation on its daemon held it for {waited_s:.3g} s"
        answer_by, command = in_flight
        late = self._clock() - answer_by
        if late > 0:
            return (
                f"busy: its command '{command}' has not returned {late:.3g} s past its own"
                f" timeout (its control client stuck in the driver); the stop waited"
                f" {waited_s:.3g} s"
            )
        return (
            f"busy: its command '{command}' was still in flight after the stop waited"
            f" {waited_s:.3g} s, the longest wait a stop gives one command to it"
        )

    @contextlib.contextmanager
    def _answering(
        self, dev: _Device, command: str, timeout_s: float | None = None
    ) -> Iterator[None]:
        """``command`` to ``dev``'s daemon (its lock held) in flight: it gives up on the
        daemon ``timeout_s`` on (None: the daemon's ``timeout_s``), as a stop waiting for the
        lock reads (``_Device.in_flight``)."""
        wait = self._timeout_s if timeout_s is None else timeout_s
        dev.in_flight = (self._clock() + wait, command)
        try:
            yield
        finally:
            dev.in_flight = None

    def _query(self, dev: _Device, command: str, timeout_s: float | None = None) -> str:
        """:meth:`ControlDaemon.query` ``command``, its lock held, said in flight
        (:meth:`_answering`)."""
        with self._answering(dev, command, timeout_s):
            return dev.daemon.query(command, timeout_s=timeout_s)

    def _reconcile_device(
        self,
        target: MpsTarget,
        *,
        force_check: bool = False,
        requested: bool = False,
        timeout_s: float | None = None,
    ) -> bool:
        """``requested``: the operator just changed the limits, so a difference from what
        the daemon holds is the change itself, not drift. ``timeout_s``: how long to wait
        for the device's lock (another command to it), and then for each command of a
        check; False when the lock was not had in time."""
        dev = self._device(target.uuid)
        with self._io_within(dev, timeout_s) as held:
            if held:
                self._reconcile_locked(
                    target, dev, force_check=force_check, requested=requested, timeout_s=timeout_s
                )
            return held

    def _reconcile_locked(
        self,
        target: MpsTarget,
        dev: _Device,
        *,
        force_check: bool,
        requested: bool,
        timeout_s: float | None,
    ) -> None:
        with self._lock:
            restoring = self.enabled and target.uuid in self._restoring
        # With MPS off no limits are needed: a pass then reads nothing from the state
        # database (one write-locked transaction per device and tick otherwise: 64 a second
        # on a node of 8 GPUs with 7 MIG devices each, each holding up the API's).
        # A device whose limits wait to be moved to it (observe) has none known (None): what
        # the state database says of it (the defaults) is not what it gets, so no daemon is
        # started and none is given limits meanwhile; one already running (adopted at a
        # start) is checked, killed when it hangs and said down when it dies all the same.
        desired = (
            None
            if restoring
            else self.limits(target.uuid)
            if self.enabled
            else MpsLimits(enabled=False)
        )
        if not target.gpu_unhealthy:
            # whichever way this pass goes on (disabled, its limits moved, an orphan): the
            # status no longer says a wait that is over
            self._end_skip(target, dev)
        if desired is not None and not desired.enabled:
            self._end_skip(target, dev)  # an off daemon waits for nothing
            # after _end_skip, which dates the outage: the operator turned it off, so a
            # later skip is news
            dev.skip_said_till = None
            # so are its failed starts: turned on again, it starts at once, and a start
            # that fails is said anew
            dev.failures, dev.next_start_at, dev.start_trouble = 0, 0.0, False
            # one that lost its pipe directory (orphan, stuck) is stopped too: it holds the
            # device
            if dev.daemon.pid() is not None or dev.daemon.orphan() is not None or dev.stuck:
                self._stop_device(target.uuid, reason="disabled")
                return
            # none ran to stop (one dead in a crash loop's back-off, say): the disable ends
            # its loop all the same, as a stop does, so that turned on again its daemon is a
            # first start and no loop is said over a minute later
            dev.up_since, dev.crashes, dev.started = None, 0, False
            if not self.enabled:
                with self._lock:
                    self._idle.add(target.uuid)
            return
        now = self._clock()
        if dev.daemon.pid() is None:
            self._ended(target, dev, now)
            if not self._kill_orphan(target.uuid, dev):
                return
            dev.killing = ""
            with self._lock:
                held = (
                    target.uuid in self._held
                    or target.uuid in self._released_at
                    or (target.mig is not None and self._rebooted_at is not None)
                )
                moved = self._moved.get(target.uuid)
            if moved is not None:
                dev.last_error = (
                    f"the MPS control daemon an earlier run left under {moved} would not"
                    " stop: none is started beside it"
                )
                return
            if desired is None:
                # one gpud stopped (a MIG apply, a reboot) is not started since: its stop was
                # said, and it did not exit unasked
                if dev.started and (dev.up or dev.failures):
                    # no restart says it meanwhile: said here, once
                    self._events.emit(
                        "mps.exited",
                        f"the MPS control daemon of {_label(target)} ({target.uuid}) exited;"
                        f" {_LIMITS_WAIT}, and none is started until they are",
                        **_where(target),
                    )
                dev.up = False
                dev.failures = 0
                dev.last_error = _LIMITS_WAIT
                return
            if target.gpu_unhealthy:
                self._skip_start(target, dev)
                return
            if held or now < dev.next_start_at:
                return
            self._start(target, dev, desired)
            return
        self._end_skip(target, dev)  # one runs there (adopted): it is no longer passed over
        if dev.up_since is not None and now - dev.up_since >= self._backoff_max_s:
            self._ran_well(target, dev, now - dev.up_since)
        if dev.killing:
            # gone or not, nothing of it is checked or adopted: the next pass starts the
            # device's new daemon once it has gone
            self._kill(dev, dev.killing)
            return
        if not dev.started:
            dev.started = True
            dev.skip_said_till, dev.killed_unanswering = None, False
            pid = dev.daemon.pid()
            if pid is not None:
                # one started by an earlier gpud version, or by a gpud killed before it
                # moved it, still in gpud's cgroup: its later servers start in its own
                self._place(target.uuid, pid)
                self._record(target.uuid, pid)
            self._events.emit(
                "mps.adopt",
                f"adopted the running MPS control daemon of {_label(target)} ({target.uuid})",
                **_where(target),
                pid=pid,
            )
            force_check = True
        if force_check or now >= dev.next_check_at:
            self._check(
                target, dev, desired, requested=requested or dev.requested, timeout_s=timeout_s
            )

    def _backoff(self, failures: int) -> float:
        """Seconds before the next start after ``failures`` in a row (failed starts and
        daemons that died young): 1 s, doubling, up to ``backoff_max_s``."""
        return min(self._backoff_max_s, 2.0 ** min(max(failures, 1) - 1, 16))

    def _ended(self, target: MpsTarget, dev: _Device, now: float) -> None:
        """The daemon this process started is gone (its PID file names no live process): one
        that stayed up ``backoff_max_s`` is restarted at once, as it always was; one that
        ended sooner is one more of a crash loop: the first is restarted at once, the next
        after 1 s, then 2, 4, ... up to ``backoff_max_s``, until one stays up that long. Each restart still counts
        (``gpud_mps_daemon_restarts_total``); the loop is said (``mps.crash_loop``, with how
        many in a row) as it begins, at the second, and again each time the count doubles,
        instead of an ``mps.restart`` for every death, and its end once one stays up
        (:meth:`_ran_well`)."""
        if dev.up_since is None:
            return
        lived, dev.up_since = now - dev.up_since, None
        if lived >= self._backoff_max_s:
            self._ran_well(target, dev, lived, ended=True)
            return
        dev.crashes += 1
        # the first that died young is restarted at once, as any that exited: one death is
        # no loop yet
        delay = 0.0 if dev.crashes == 1 else self._backoff(dev.crashes - 1)
        dev.next_start_at = max(dev.next_start_at, now + delay)
        if dev.crashes < 2 or dev.crashes & (dev.crashes - 1):
            return
        self._events.emit(
            "mps.crash_loop",
            f"the MPS control daemon of {_label(target)} ({target.uuid}) ended {lived:.0f} s"
            f" after its start, {dev.crashes} in a row within {self._backoff_max_s:g} s: each"
            f" restart now waits twice as long, up to {self._backoff_max_s:g} s (the next in"
            f" {delay:g} s), until one stays up {self._backoff_max_s:g} s; said again at"
            f" {2 * dev.crashes} in a row",
            **_where(target),
            crashes=dev.crashes,
            up_s=round(lived, 1),
            retry_in_s=delay,
            restarts=dev.restarts,
        )

    def _ran_well(
        self, target: MpsTarget, dev: _Device, lived: float, *, ended: bool = False
    ) -> None:
        """The daemon gpud started ran ``backoff_max_s`` (``lived``; ``ended``: it has
        exited since, seen only now): the next that dies is restarted at once again, and the
        next start that fails is a new trouble, said anew (``mps.start_failed``). A crash
        loop it ends is said over (``mps.crash_loop_ended``, with the deaths in a row it
        took, each of which was restarted), as its beginning was said."""
        dev.start_trouble = False
        crashes, dev.crashes = dev.crashes, 0
        if crashes < 2:
            return  # one that died young is no loop: none was said
        ran, then = (
            (f"ran {lived:.0f} s before it exited", "it is restarted at once")
            if ended
            else (f"has run {lived:.0f} s", "the next that dies is restarted at once")
        )
        self._events.emit(
            "mps.crash_loop_ended",
            f"the MPS control daemon of {_label(target)} ({target.uuid}) {ran}: its crash"
            f" loop is over after {crashes} in a row that ended within"
            f" {self._backoff_max_s:g} s of their start; {then}",
            **_where(target),
            crashes=crashes,
            up_s=round(lived, 1),
            restarts=dev.restarts,
        )

    def _skip_start(self, target: MpsTarget, dev: _Device) -> None:
        """Start no control daemon on a device whose GPU is unhealthy in the sample, for
        any reason ``gpuctl gpus`` shows (a critical XID not cleared, lost, not answering,
        ...): the jobs service places no job there, and a new daemon would only open the
        faulty GPU. The status says why (``last_error``); ``mps.start_skipped`` says so once
        as the skip begins, naming the jobs reserving the device (their clients find no
        daemon until then). A GPU that flaps is one outage: a skip that begins less than
        ``backoff_max_s`` after the last one ended (said or not) is not said again, unless
        a daemon of the device started or was adopted, or the device was disabled, since
        the last said. One already running is never stopped for it (its clients may be
        draining): this is reached only when none runs. The next pass that sees the GPU
        healthy (after ``gpuctl xid clear``, or once it answers again) starts it, or, where
        its starts were failing before, once their back-off allows (:meth:`_end_skip`)."""
        dev.up = False
        if dev.skipped_at is not None:
            dev.last_error = mps_unhealthy_wait(target.gpu)
            return
        dev.before_skip, dev.last_error = dev.last_error, mps_unhealthy_wait(target.gpu)
        said_till = dev.skip_said_till
        if said_till is not None and self._clock() - said_till < self._backoff_max_s:
            dev.skipped_at = self._clock()
            return
        # read before the skip is recorded, and never raising: the skip is said whatever
        # the jobs' reservations hold
        jobs = self._holding_jobs(target)
        dev.skipped_at = self._clock()
        # one that ran before (it exited, or was killed for not answering) is not restarted
        ran = (
            "was killed for not answering and is not restarted"
            if dev.killed_unanswering
            else "exited and is not restarted"
            if dev.started
            else "is not started"
        )
        # a `gpuctl run` reserving the device is not told otherwise that its daemon is gone
        lose = (
            "; the jobs holding it were not read"
            if jobs is None
            else f"; job {jobs[0]} loses MPS until then"
            if len(jobs) == 1
            else f"; jobs {', '.join(jobs)} lose MPS until then"
        )
        self._events.emit(
            "mps.start_skipped",
            f"the MPS control daemon of {_label(target)} ({target.uuid})"
            f" {ran} while GPU {target.gpu} is unhealthy: {target.gpu_unhealthy}; it starts"
            f" once the GPU is healthy again{lose if jobs != [] else ''}",
            **_where(target),
            reason=target.gpu_unhealthy,
            jobs=None if jobs is None else list(jobs),
        )

    def _holding_jobs(self, target: MpsTarget) -> Sequence[str] | None:
        """The jobs holding a reservation on ``target``, as ``gpuctl mps show`` lists them;
        None when they cannot be read, for whatever reason (a state database unreadable or
        corrupt, a reservation that does not parse), not the none of a device no job holds:
        the event is said all the same, its ``jobs`` null."""
        try:
            return list(self._holding().get(target.uuid, ()))
        except Exception as err:  # whatever it is, the skip is said
            log.warning(
                "the jobs reserving %s (GPU %d) were not read from the state database: %s: %s",
                target.uuid,
                target.gpu,
                type(err).__name__,
                err,
            )
            return None

    def _end_skip(self, target: MpsTarget, dev: _Device) -> None:
        """A device passed over for its GPU's health (:meth:`_skip_start`) no longer is: its
        status stops saying so; a later skip is said anew once this one ended
        ``backoff_max_s`` before it (:meth:`_skip_start`). Its start failures are kept:
        a start that was backing off (a control binary that does not run) resumes when its
        time comes, with its back-off growing and ``mps.start_failed`` not said again, however
        often its GPU flaps. Only a skip that outlasted ``backoff_max_s`` starts afresh, as
        after a stop: the first start after it that fails is ``mps.start_failed`` anew (what
        was said before a long outage is not taken to cover it), retried in 1 s. While they
        back off, the status says the failed start's error again, as before the skip (a
        short skip does not leave a device that cannot start ``DOWN`` with no reason)."""
        if dev.skipped_at is None:
            return
        skipped_at, dev.skipped_at = dev.skipped_at, None
        dev.skip_said_till = self._clock()
        before, dev.before_skip = dev.before_skip, ""
        if self._clock() - skipped_at >= self._backoff_max_s:
            dev.next_start_at = 0.0
            dev.failures = dev.crashes = 0
            dev.start_trouble = False
        if dev.last_error == mps_unhealthy_wait(target.gpu):
            dev.last_error = before if dev.failures else ""

    def _start(self, target: MpsTarget, dev: _Device, desired: MpsLimits) -> None:
        """Start the device's control daemon (``nvidia-cuda-mps-control -d``) and write
        ``desired`` to it. A start that fails is retried with back-off and said once per
        trouble (``mps.start_failed``, with the device's failed starts so far): not again
        until one fails with another error (its numbers aside), a daemon of the device ran
        ``backoff_max_s`` (:meth:`_ran_well`), the device was stopped or disabled, or a skip
        for its GPU's health outlasted ``backoff_max_s`` (:meth:`_end_skip`); a daemon that
        starts between failures and dies sooner does not end it. Each failed start is
        counted (``gpud_mps_daemon_start_failures_total``)."""
        restart = dev.started
        # the servers the daemon before was last seen with, read before the new daemon's
        # (none yet) replace them: what a restart says its clients lost
        lost_servers = dev.servers if restart else ()
        # the new daemon's PID file exists before its limits are applied: until then a
        # status read in between is not up (it would show the old limits and restart count)
        dev.up = False
        try:
            self._record(target.uuid, 0)  # where, before it runs: see _record
            # `-d`, then its first answer: up to three of its timeouts
            with self._answering(dev, "nvidia-cuda-mps-control -d", dev.daemon.start_s):
                pid = dev.daemon.start()
            self._apply(target, dev, desired, servers=())
        except GpudError as err:
            dev.up = False
            dev.failures += 1
            dev.failed_starts += 1
            dev.last_error = str(err)
            delay = self._backoff(dev.failures + dev.crashes)
            dev.next_start_at = self._clock() + delay
            # its numbers aside (KiB free, a pid, a timeout), so that an error that only
            # counts on is the same trouble
            error = _DIGITS.sub("N", str(err))
            if not dev.start_trouble or error != dev.start_error_said:
                # once per trouble: a daemon that starts now and then and dies young does
                # not end it, only one that runs well, or a stop; a start failing otherwise
                # (its binary gone, the disk full) is another trouble, said too
                dev.start_trouble, dev.start_error_said = True, error
                count = dev.failed_starts
                self._events.emit(
                    "mps.start_failed",
                    f"MPS control daemon of {_label(target)} ({target.uuid}) did not start:"
                    f" {err} ({count} failed start{'' if count == 1 else 's'} of the device"
                    f" since gpud started); retried in {delay:g} s, not said again until it"
                    f" has run {self._backoff_max_s:g} s or is stopped",
                    **_where(target),
                    retry_in_s=delay,
                    failed_starts=count,
                )
            self._kill(dev, "a new one is started once it has gone")
            return
        dev.started = True
        dev.skip_said_till, dev.killed_unanswering = None, False
        self._record(target.uuid, pid)
        with self._lock:  # one that would not stop before is gone: a new one is said anew
            self._stop_tries.pop(target.uuid, None)
        dev.failures = 0
        dev.last_error = ""
        dev.up_since = self._clock()
        dev.next_check_at = self._clock() + self._health_interval_s
        if restart:
            dev.restarts += 1
        dev.up = True  # last: what a status read sees up is all there
        if not restart:
            self._events.emit(
                "mps.start",
                f"started the MPS control daemon of {_label(target)} ({target.uuid}, pid"
                f" {pid}) with threads {_pct(desired.threads_percent)}, memory"
                f" {_mem(desired.memory_bytes)}",
                **_where(target),
                pid=pid,
                restarts=dev.restarts,
            )
            return
        if dev.crashes > 1:
            return  # one of a crash loop: mps.crash_loop counts them (the metric each)
        # the daemon before (dead, or killed for not answering) took its MPS servers with it,
        # and their clients' contexts: nothing else tells a job that its processes lost them
        jobs = self._holding_jobs(target)
        lost = _restart_loss(jobs, lost_servers)
        self._events.emit(
            "mps.restart",
            f"restarted the MPS control daemon of {_label(target)} ({target.uuid}, pid {pid})"
            f" with threads {_pct(desired.threads_percent)}, memory {_mem(desired.memory_bytes)}"
            f"{lost}",
            **_where(target),
            pid=pid,
            restarts=dev.restarts,
            jobs=None if jobs is None else list(jobs),
            servers=list(lost_servers),
        )

    def _check(
        self,
        target: MpsTarget,
        dev: _Device,
        desired: MpsLimits | None,
        *,
        requested: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        """Query the daemon, each command waited on ``timeout_s`` (default: the daemon's);
        re-apply limits that differ from the desired ones (None: its limits wait to be
        moved to it, so only its health is checked)."""
        dev.next_check_at = self._clock() + self._health_interval_s
        try:
            threads, memory, servers = self._read(dev, timeout_s)
            if desired is not None and desired.memory_bytes is None and memory is not None:
                # it answered: whatever waits below, its failures are no longer consecutive
                self._answered(target, dev)
                # MPS has no command that removes a memory limit: only a new daemon forgets
                # it, and only once no server (and so no client) depends on this one.
                if servers:
                    dev.last_error = "memory limit removal waits for MPS servers to exit"
                    return
                pid = dev.daemon.pid()
                if (
                    pid is not None
                    and self._try_stop(dev, pid, "its memory limit stays until it does") is None
                ):
                    dev.last_error = (
                        f"the MPS control daemon (pid {pid}) would not stop to remove its"
                        " memory limit"
                    )
                    return
                self._events.emit(
                    "mps.restart_to_clear",
                    f"restarting the idle MPS control daemon of {_label(target)}"
                    f" ({target.uuid}) to remove its memory limit",
                    **_where(target),
                )
                dev.started = False  # not a failure restart
                self._start(target, dev, desired)
                return
            if desired is not None and not _matches(desired, threads, memory):
                if not requested:
                    self._events.emit(
                        "mps.drift",
                        f"MPS limits of {_label(target)} ({target.uuid}) differ from the"
                        f" desired ones (threads {threads:g} %, memory {_mem(memory)});"
                        " re-applying",
                        **_where(target),
                    )
                self._apply(target, dev, desired, servers=servers, timeout_s=timeout_s)
            else:
                dev.servers = tuple(servers)
        except GpudError as err:
            dev.failures += 1
            dev.last_error = str(err)
            dev.up = False
            name = f"MPS control daemon of {_label(target)} ({target.uuid})"
            if 1 < dev.failures < self._max_failures:
                # the first is said by its event, the last by mps.unresponsive: the journal
                # holds each failure once
                log.warning("%s failed health check %d: %s", name, dev.failures, err)
            if dev.failures == 1:
                hung = isinstance(err, DriverTimeout)
                self._events.emit(
                    "mps.hung" if hung else "mps.check_failed",
                    f"{name} {'does not answer' if hung else 'failed its health check'}: {err}",
                    **_where(target),
                    error=str(err),
                )
            if dev.failures >= self._max_failures:
                # while its limits wait to be moved no new one starts: not said as a restart;
                # nor on an unhealthy GPU, till it is healthy (_skip_start)
                if desired is None:
                    then, said = (
                        "a new one starts once its limits are moved",
                        f"killing it; {_LIMITS_WAIT}, and a new one starts once they are",
                    )
                elif target.gpu_unhealthy:
                    then, said = (
                        f"it is restarted once it has gone and GPU {target.gpu} is healthy",
                        f"killing it; it is restarted once GPU {target.gpu} is healthy",
                    )
                else:
                    then, said = "it is restarted once it has gone", "killing it to restart"
                self._events.emit(
                    "mps.unresponsive",
                    f"{name} failed {dev.failures} health checks, the last: {err}; {said}",
                    **_where(target),
                    error=str(err),
                )
                dev.killed_unanswering = True
                self._kill(dev, then)
                dev.failures = 0
            return
        self._answered(target, dev)
        if desired is None:
            dev.last_error = _LIMITS_WAIT
            return
        # Limits set while this check ran are not yet applied: the next check applies them.
        if self.limits(target.uuid) == desired:
            dev.requested = False
        dev.last_error = ""

    def _answered(self, target: MpsTarget, dev: _Device) -> None:
        """The daemon answered its health check: up, its failed checks no longer in a row
        (``mps.recovered`` after any)."""
        if dev.failures:
            self._events.emit(
                "mps.recovered",
                f"MPS control daemon of {_label(target)} ({target.uuid}) answers again after"
                f" {dev.failures} failed health check{'s' if dev.failures > 1 else ''}",
                **_where(target),
            )
        dev.failures = 0
        dev.up = True

    def _read(
        self, dev: _Device, timeout_s: float | None = None
    ) -> tuple[float, int | None, list[int]]:
        q = functools.partial(self._query, dev, timeout_s=timeout_s)
        cmd = protocol.get_default_active_thread_percentage()
        threads = protocol.parse_percent(cmd, q(cmd))
        cmd = protocol.get_default_device_pinned_mem_limit(0)
        memory = protocol.parse_memory(cmd, q(cmd))
        cmd = protocol.get_server_list()
        servers = protocol.parse_server_list(cmd, q(cmd))
        dev.observed_threads, dev.observed_memory, dev.servers = threads, memory, tuple(servers)
        return threads, memory, servers

    def _apply(
        self,
        target: MpsTarget,
        dev: _Device,
        desired: MpsLimits,
        *,
        servers: Sequence[int],
        timeout_s: float | None = None,
    ) -> None:
        """Write the defaults, push them to running servers, and read them back."""
        q = functools.partial(self._query, dev, timeout_s=timeout_s)
        percent, num_bytes = desired.threads_percent or 100, desired.memory_bytes
        # (command, the percentage or bytes it sets: what the daemon may echo back)
        sets: list[tuple[str, int | None, int | None]] = [
            (protocol.set_default_active_thread_percentage(percent), percent, None)
        ]
        if num_bytes is not None:
            sets.append(
                (protocol.set_default_device_pinned_mem_limit(0, num_bytes), None, num_bytes)
            )
        for pid in servers:
            sets.append((protocol.set_active_thread_percentage(pid, percent), percent, None))
            if num_bytes is not None:
                sets.append(
                    (protocol.set_device_pinned_mem_limit(pid, 0, num_bytes), None, num_bytes)
                )
        for cmd, pct, size in sets:
            protocol.parse_set(cmd, q(cmd), percent=pct, num_bytes=size)
        threads, memory, _ = self._read(dev, timeout_s)
        if not _matches(desired, threads, memory):
            raise BackendError(
                f"MPS control daemon holds threads {threads:g} %, memory {_mem(memory)} after"
                f" setting threads {_pct(desired.threads_percent)}, memory"
                f" {_mem(desired.memory_bytes)}",
                uuid=target.uuid,
            )

    def _refuse_clear_while_serving(self, target: MpsTarget, dev: _Device) -> None:
        cmd = protocol.get_server_list()
        wait = self._request_timeout_s
        try:
            with self._io_within(dev, wait) as held:
                if not held:  # another command to it has not returned
                    raise DriverTimeout(f"busy for over {wait:g}s", uuid=target.uuid, call=cmd)
                if not self.enabled or dev.daemon.pid() is None:
                    return
                answer = self._query(dev, cmd, timeout_s=wait)
        except DriverTimeout as err:
            raise DriverTimeout(
                f"the MPS control daemon of {_label(target)} ({target.uuid}) did not answer"
                f" within {wait:g} s: whether MPS servers serve clients is unknown, so the"
                " memory limit is kept",
                gpu=target.gpu,
                uuid=target.uuid,
                call=cmd,
            ) from err
        servers = protocol.parse_server_list(cmd, answer)
        if servers:
            raise FailedPrecondition(
                f"{target.uuid}: removing the memory limit restarts its MPS control daemon,"
                f" and MPS servers {', '.join(map(str, servers))} still serve clients"
            )

    def _stop_device(
        self,
        uuid: str,
        *,
        reason: str,
        remove: bool = False,
        wait_s: float | None = None,
        quit_s: float | None = None,
    ) -> int | None:
        """Stop the device's daemon; ``remove``: its device is gone, and so go its
        directories. The PID of a daemon that would not stop (:meth:`_try_stop`), None when
        none runs: then its record, cgroup and directories are kept, and the next call (a
        later pass) tries again. ``wait_s``: the wait for the device's lock, held by another
        operation on its daemon, is ``timeout_s`` + ``wait_s`` at most, ``wait_s`` for a command
        known hung (:meth:`_io_for_stop`; :class:`DriverTimeout` naming the command after;
        None: as long as it takes); ``quit_s``: for its ``quit``."""
        with self._lock:
            dev = self._devices.get(uuid)
        if dev is None:
            return None
        with self._io_for_stop(dev, wait_s) as busy:
            if busy:
                raise DriverTimeout(busy, uuid=uuid, call=protocol.quit_())
            pid = dev.daemon.pid()
            stake = f"it was to stop ({reason}); its record is kept"
            how: How | None = None
            if pid is None and (pid := dev.daemon.orphan()) is not None:
                # one that lost its pipe directory: left running, it would hold the device
                # with no record
                how = self._end_orphan(uuid, dev, pid, stake, reason=reason)
            elif pid is not None:
                how = self._try_stop(dev, pid, stake, quit_s)
                if how is not None:
                    self._stopped(uuid, pid, reason, how)
            if pid is None or how is not None:
                # its other lost daemons that outlived SIGKILL hold the device too
                pid = self._end_stuck(uuid, dev, stake, reason=reason)
            if pid is not None:
                dev.up = False
                dev.last_error = f"the MPS control daemon (pid {pid}) would not stop"
                return pid
            dev.up = False
            dev.killing = ""
            dev.started = False
            dev.killed_unanswering = False
            # a stop that went as planned ends the daemon's run of failed checks, and any
            # crash loop: the next start is a first start, said if it fails and backed off
            # from the shortest delay
            dev.failures = 0
            dev.up_since, dev.crashes = None, 0
            dev.start_trouble = False
            self._forget(uuid)
            self._remove_cgroup(uuid)
            if remove:
                dev.daemon.remove_directory()
        with self._lock:
            if uuid not in self._targets and self._devices.get(uuid) is dev:
                del self._devices[uuid]
        return None

    def _try_stop(
        self,
        device_or_daemon: _Device | ControlDaemon,
        pid: int,
        stake: str,
        quit_s: float | None = None,
        *,
        kill: bool = False,
    ) -> How | None:
        """:meth:`ControlDaemon.stop` the daemon ``pid`` of ``device_or_daemon`` (``quit_s``:
        see there), or ``kill`` it (:meth:`ControlDaemon.kill`: it does not answer): how it
        went, None while it runs. A device's stop or kill is said in flight
        (:meth:`_answering`) as long as it may take (:meth:`ControlDaemon.stop_s`,
        :attr:`ControlDaemon.kill_s`), so that a stop waiting for its lock meanwhile names
        it: a stop as ``quit`` throughout, the SIGTERM and SIGKILL after an ignored ``quit``
        included, a kill as ``SIGKILL PID``. A bare daemon is one found at start, before any
        device, whose lock none waits for. One that outlives SIGKILL (stuck in the driver)
        is said once, until it is gone (``mps.stop_failed``, ``stake``: what waits on it)
        and tried again no sooner than a backoff (5 s, doubling, up to ``backoff_max_s``):
        till then this answers None at once, without signalling it."""
        dev = device_or_daemon
        daemon = dev if isinstance(dev, ControlDaemon) else dev.daemon
        uuid = daemon.uuid
        with self._lock:
            failures, retry_at = self._stop_tries.get(uuid, (0, 0.0))
        if failures and self._clock() < retry_at:
            return None
        command, bound = (
            (f"SIGKILL {pid}", daemon.kill_s)
            if kill
            else (protocol.quit_(), daemon.stop_s(quit_s=quit_s))
        )
        with (
            contextlib.nullcontext()
            if isinstance(dev, ControlDaemon)
            else self._answering(dev, command, bound)
        ):
            how = daemon.kill(pid) if kill else daemon.stop(pid=pid, quit_s=quit_s)
        if how is not None:
            with self._lock:
                self._stop_tries.pop(uuid, None)
            return how
        failures += 1
        delay = min(self._backoff_max_s, 5.0 * 2.0 ** min(failures - 1, 16))
        with self._lock:
            self._stop_tries[uuid] = (failures, self._clock() + delay)
            target = self._targets.get(uuid)
        name = f"{_label(target)} ({uuid})" if target is not None else uuid
        if failures > 1:
            log.warning("the MPS control daemon of %s (pid %d) still runs", name, pid)
            return None
        self._events.emit(
            "mps.stop_failed",
            f"the MPS control daemon of {name} (pid {pid}) is still running after"
            f" {'SIGKILL' if kill else 'quit, SIGTERM and SIGKILL'}: {stake}, and gpud tries"
            f" again every {self._backoff_max_s:g} s at most. A process stuck in the driver"
            f" (State: D in /proc/{pid}/status) goes only with a GPU reset or a reboot",
            **_where(target, uuid),
            pid=pid,
            retry_in_s=delay,
        )
        return None

    def _kill(self, dev: _Device, stake: str) -> bool:
        """SIGKILL the device's daemon that does not answer (or did not come up), through
        :meth:`_try_stop`: whether it is gone. One that outlives SIGKILL is never taken for
        gone: it is said once (``mps.stop_failed``, ``stake``: what waits on it), and each
        later pass tries again (with :meth:`_try_stop`'s backoff) instead of checking it,
        adopting it or starting another beside it."""
        pid = dev.daemon.pid()
        if pid is None or self._try_stop(dev, pid, stake, kill=True) is not None:
            dev.killing = ""
            return True
        dev.killing = stake
        dev.up = False
        dev.last_error = f"the MPS control daemon (pid {pid}) outlived SIGKILL"
        return False

    def _kill_orphan(self, uuid: str, dev: _Device) -> bool:
        """Before another daemon starts for the device: :meth:`_end_orphan` its daemon whose
        pipe directory was deleted (no PID file names it, no client reaches it, yet it holds
        the device), if one runs: whether none such runs now. No daemon is started beside
        one that outlives SIGKILL."""
        stake = f"{_LOST}; none is started beside it until it has gone"
        pid = dev.daemon.orphan()
        if pid is not None and self._end_orphan(uuid, dev, pid, stake) is not None:
            # gpud ended it, said as mps.stop: it neither exited unasked nor failed a check
            dev.up = False
            dev.failures = 0
            pid = None
        if pid is None:
            pid = self._end_stuck(uuid, dev, stake)
        if pid is None:
            return True
        dev.last_error = (
            f"the MPS control daemon (pid {pid}) lost its pipe directory and outlived"
            " SIGKILL: none is started beside it"
        )
        return False

    def _end_stuck(self, uuid: str, dev: _Device, stake: str, *, reason: str = "") -> int | None:
        """:meth:`_end_orphan` the device's other lost daemons that outlived SIGKILL
        (``_Device.stuck``), those still running: one gone, or whose PID another process
        took since (its start time differs), is dropped. The PID of one still running after
        (None: none is)."""
        for pid, ticks in list(dev.stuck.items()):
            now = start_time(pid, self._proc_root)
            reused = None not in (now, ticks) and now != ticks
            if (
                reused
                or not self._alive(pid, self._proc_root)
                or self._end_orphan(uuid, dev, pid, stake, reason=reason) is not None
            ):
                del dev.stuck[pid]
        return next(iter(dev.stuck), None)

    def _end_orphan(
        self, uuid: str, dev: _Device, pid: int, stake: str, *, reason: str = ""
    ) -> How | None:
        """SIGKILL, through :meth:`_try_stop`, the device's daemon ``pid`` that lost its pipe
        directory: no ``quit`` can reach it, and none (nor SIGTERM) is sent. Said as
        ``mps.stop`` (``reason``, then that it lost its pipe directory); one that outlives
        SIGKILL is said as any other (``mps.stop_failed``, once, ``stake``: what waits on
        it), leaves the device down, and is tried again with its backoff. How it went, None
        while it runs."""
        how = self._try_stop(dev, pid, stake, kill=True)
        if how is None:
            dev.up = False
            return None
        why = f"{reason}; {_LOST}" if reason else _LOST
        self._stopped(uuid, pid, why, how, said="SIGKILL ended it")
        return how

    def _stopped(
        self, uuid: str, pid: int, reason: str, how: How, *, said: str | None = None
    ) -> None:
        """Say that the daemon ``pid`` of ``uuid`` was stopped, and ``how`` (``said``: in
        other words than a stop's)."""
        self._events.emit(
            "mps.stop",
            f"stopped the MPS control daemon of {uuid} ({reason}): {said or _HOW_SAID[how]}",
            uuid=uuid,
            pid=pid,
            how=how,
        )

    @contextlib.contextmanager
    def released(self, uuids: Iterable[str]) -> Iterator[dict[str, str]]:
        """For a MIG apply about to destroy the MIG devices ``uuids`` (of one GPU), or to
        enable MIG mode on the GPU ``uuids`` names (its whole-GPU daemon holds it: the driver
        enables MIG only on a GPU no process holds): stop their daemons and start none for
        them while the context lasts (a pass meanwhile would start them again), nor after
        it from a snapshot sampled before it ended (``snapshot_clock``: the clock of
        :attr:`Snapshot.monotonic`), which shows the devices as they were: a GPU still whole
        that the apply put into MIG mode, a MIG device it destroyed. Yields, by
        UUID, why a device still has one (it would not stop, or another operation on it held
        it past the stop's wait: its instance must not be destroyed, nor MIG enabled, under
        it); the others' daemons are gone. With MPS off, none is stopped (and none
        started): it yields nothing.

        The devices whose daemon would not stop before are tried first; while one still
        runs, no other daemon of the GPU is stopped (the GPU's steps are not taken anyway:
        the others go on serving their jobs). The stops run at once. Each waits for its
        daemon's lock, held by another operation on it (a health check: gpud's loop sends
        its commands one after another), ``timeout_s`` + ``request_timeout_s`` at most from
        when it asked (12 s by default: the longest one command may take, then
        ``request_timeout_s``), however many commands that operation sends meanwhile
        (:meth:`_io_for_stop`): a slow answer under load is waited for, while a command
        already past its own timeout by ``request_timeout_s`` whose control client has not
        returned (stuck in the driver) fails the GPU ``request_timeout_s`` after the stop
        asked. Its ``quit`` is waited on ``request_timeout_s`` (then SIGTERM and SIGKILL,
        :meth:`ControlDaemon.stop`), so that a hung daemon holds the apply, and the daemon's
        loop pass behind it, seconds, not minutes."""
        if not self.enabled:
            yield {}
            return
        uuids = list(dict.fromkeys(uuids))
        with self._lock:
            self._held.update(uuids)
            known = [u for u in uuids if u in self._stop_tries]
        try:
            stuck = self._stop_all(known)
            if not stuck:
                stuck = self._stop_all([u for u in uuids if u not in known])
            yield stuck
        finally:
            ended = self._snapshot_clock()
            with self._lock:
                self._held.difference_update(uuids)
                self._released_at.update(dict.fromkeys(uuids, ended))

    def _stop_all(self, uuids: list[str]) -> dict[str, str]:
        """:meth:`released`'s stops of ``uuids``, all at once: by UUID, why one still runs."""
        stuck: dict[str, str] = {}
        wait = self._request_timeout_s

        def stop(uuid: str) -> None:
            self._device(uuid)
            target = self.target(uuid)
            whole = not uuid.startswith("MIG-")  # a GPU's: known or not (no sample yet)
            try:
                pid = self._stop_device(
                    uuid,
                    reason="MIG mode is being enabled on its GPU"
                    if whole
                    else "its MIG device is being destroyed",
                    wait_s=wait,
                    quit_s=wait,
                )
            except GpudError as err:
                why = f"({uuid}) was not stopped: {err}"
            else:
                if pid is None:
                    return
                why = f"({uuid}, pid {pid}) would not stop (see the mps.stop_failed event)"
            name = _label(target) if target is not None else "GPU" if whole else "MIG device"
            with self._lock:
                stuck[uuid] = f"the MPS control daemon of {name} {why}"

        _all_at_once([(u, functools.partial(stop, u)) for u in uuids], self._parallel)
        return {u: stuck[u] for u in uuids if u in stuck}

    def start_server(self, device: str, uid: int) -> list[int]:
        """``start_server -uid UID`` (MPS servers otherwise start with their first client);
        returns the server list."""
        target = self._resolve_read(device)
        dev = self._device(target.uuid)
        with dev.io:
            cmd = protocol.start_server(uid)
            protocol.parse_empty(cmd, self._query(dev, cmd))
            cmd = protocol.get_server_list()
            servers = protocol.parse_server_list(cmd, self._query(dev, cmd))
            dev.servers = tuple(servers)
            return servers

    @contextlib.contextmanager
    def rebooting(self) -> Iterator[int]:
        """A reboot of the simulated node under a running gpud (``gpuctl sim reboot``): as a
        real reboot does, it ends every control daemon gpud runs (those with their pipe
        directory under its ``<run_dir>/mps``, the lost ones too, and those an earlier run
        left under another ``daemon.run_dir`` that its records name, each by its PID and
        start time or PID file: :meth:`_recorded_elsewhere`), their MPS servers with
        them, at once (SIGKILL: no ``quit``, no stop event), and gpud then starts as after
        a real reboot: no device's daemon counts as started, restarted or failing, so the
        next pass starts each anew (``mps.start``). Yields how many ended, holding the pass
        and every device's lock till the context ends: the node is rebooted and sampled
        again in it, and nothing (a pass, ``gpuctl mps set``, a server started) starts a
        daemon meanwhile that would outlive the reboot. A pass waiting with a snapshot
        sampled before passes over it (:meth:`observe_snapshot`), and every MIG device is
        held as the reboot destroyed it, those created meanwhile (by a MIG apply) that it
        did not know of too: no MIG device's daemon is started from such a snapshot,
        whether or not the reboot's own sample was taken.

        One that outlives SIGKILL (stuck in the driver) is not counted: its device keeps
        it as one that outlived a kill (:meth:`_kill`, or :meth:`_kill_orphan` where no PID
        file names it), so the next pass says ``mps.stop_failed`` and tries again, and no
        daemon is adopted or started beside it meanwhile."""
        with self._pass, contextlib.ExitStack() as held:  # no pass checks or starts one
            try:
                yield self._end_all(held)
            finally:
                ended = self._snapshot_clock()
                with self._lock:
                    self._rebooted_at = ended

    def _end_all(self, held: contextlib.ExitStack) -> int:
        """:meth:`rebooting`'s kills, all at once, and each device reset in place (anything
        talking to it holds it: it sees the reset, never a second device for one daemon).
        Every device's lock is taken first, into ``held``, so that none starts a daemon
        after the daemons running have been listed; the status then shows none running."""
        with self._lock:
            # a device known but never reconciled too: a change could start its first one
            devices = {u: self._device(u) for u in [*self._devices, *self._targets]}
            self._idle.clear()
        for dev in devices.values():
            held.enter_context(dev.io)  # a command to its daemon returns first
        found = list(self._control_daemons())
        pids: dict[str, list[int]] = {}
        for pid, uuid in self._ours(found):
            pids.setdefault(uuid, []).append(pid)
            if uuid not in devices:
                devices[uuid] = held.enter_context(_held(self._device(uuid)))
        ended: list[int] = []
        # those an earlier run left under another daemon.run_dir (not stopped yet: this
        # run's first pass is still to come, or one would not stop) end with the rest
        old = self._recorded_elsewhere()

        def end_old(pid: int, uuid: str, run: Path) -> None:
            if self._daemon(uuid, run).kill(pid) is not None:
                with self._lock:
                    ended.append(pid)

        def reboot(uuid: str, dev: _Device) -> None:
            named = dev.daemon.pid()
            ticks = {p: start_time(p, self._proc_root) for p in pids.get(uuid, ())}
            stuck = [(p, p == named) for p in pids.get(uuid, ()) if dev.daemon.kill(p) is None]
            _reset(dev)
            with self._lock:
                ended.extend(p for p in pids.get(uuid, ()) if p not in dict(stuck))
                if not stuck:
                    self._stop_tries.pop(uuid, None)
            for pid, has_pid_file in stuck:
                # no mps.adopt, no daemon beside it: the next pass tries again, and says
                # mps.stop_failed
                dev.last_error = f"the MPS control daemon (pid {pid}) outlived SIGKILL"
                if has_pid_file:
                    dev.killing = "a new one is started once it has gone"
                else:  # each lost one, however many
                    dev.stuck[pid] = ticks[pid]

        calls = [(u, functools.partial(reboot, u, dev)) for u, dev in devices.items()]
        calls += [(u, functools.partial(end_old, p, u, r)) for p, u, r in old]
        _all_at_once(calls, self._parallel)
        with self._lock:
            moved = bool(self._moved)
        if moved:
            # theirs may have ended: the next pass takes over now, not after the backoff
            self._take_over_at = self._clock()
        self.status()  # what /metrics and the jobs read (last_status): none of them runs
        return len(ended)

    def _recorded_elsewhere(self) -> list[tuple[int, str, Path]]:
        """The running daemons, ``(PID, device UUID, run dir)``, that the records of daemons
        (``mps_daemons``) name under another ``daemon.run_dir``: each by its recorded PID
        and start time, or the PID file in its pipe directory, as :meth:`_take_over` finds
        them: never one of a device no record names there, but the PID file's daemon of a
        recorded device whose own has gone, whoever started it (see :meth:`_recorded_pid`)."""
        try:
            with self._store.read() as conn:
                rows = conn.execute(
                    "SELECT uuid, pid, start_time, pipe_dir FROM mps_daemons"
                ).fetchall()
        except StateError as err:
            log.warning("MPS: the records of control daemons were not read: %s", err)
            return []
        old = []
        for uuid, pid, ticks, pipe_dir in rows:
            run = _recorded_run_dir(uuid, pipe_dir)
            if run is None or run == self._run_dir:
                continue
            running = self._recorded_pid(self._daemon(uuid, run), pid, ticks)
            if running is not None:
                old.append((running, uuid, run))
        return old

    def leave(self) -> None:
        """At gpud's stop: leave every daemon running for the jobs that use it (the next
        start adopts them); say how many, once (the event goes to the log too)."""
        with self._lock:
            devices = list(self._devices.values())
        running = sum(1 for dev in devices if dev.daemon.pid() is not None)
        if running:
            message = (
                f"leaving {running} MPS control daemon{'s' if running > 1 else ''} running for"
                " the jobs that use them: the next start adopts them"
            )
            self._events.emit("mps.leave", message, daemons=running)  # logged with it

    def stop(self) -> None:
        """``quit`` every daemon this manager runs (gpud's own stop leaves them:
        :meth:`leave`)."""
        with self._lock:
            uuids = list(self._devices)
        for uuid in uuids:
            try:
                self._stop_device(uuid, reason="gpud stopping")
            except GpudError as err:
                log.warning("stopping MPS on %s: %s", uuid, err)


def _all_at_once(calls: Sequence[tuple[str, Callable[[], object]]], limit: int) -> None:
    """Run each ``(device UUID, call)`` on a thread of its own, ``limit`` at a time at most,
    and wait for all. A device's :class:`GpudError` is logged; any other error (a bug) is
    raised once every call has ended.

    Daemon threads, not a ``ThreadPoolExecutor``: a control client stuck past its timeout
    (killed but not yet reaped) must not keep gpud from exiting, and the executor joins its
    threads at interpreter exit."""
    slots = threading.BoundedSemaphore(max(1, limit))
    bugs: list[BaseException] = []

    def run(uuid: str, call: Callable[[], object]) -> None:
        try:
            call()
        except GpudError as err:
            log.warning("MPS on %s: %s", uuid or "a GPU never read", err)
        except Exception as err:
            log.exception("MPS on %s failed", uuid or "a GPU never read")
            bugs.append(err)
        finally:
            slots.release()

    threads = []
    for uuid, call in calls:
        slots.acquire()
        thread = threading.Thread(
            target=run, args=(uuid, call), name=f"gpud-mps-{uuid or 'unread'}", daemon=True
        )
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    if bugs:
        raise bugs[0]


@contextlib.contextmanager
def _held(dev: _Device) -> Iterator[_Device]:
    """``dev``, its lock held."""
    with dev.io:
        yield dev


def _reset(dev: _Device) -> None:
    """Everything of ``dev`` but its daemon and lock as a new device's: as after a reboot."""
    for f in fields(_Device):
        # its failed starts are counted since gpud started (mps.start_failed)
        if f.name not in ("daemon", "io", "failed_starts"):
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            setattr(dev, f.name, default)


def _recorded_run_dir(uuid: str, pipe_dir: str) -> Path | None:
    """The ``daemon.run_dir`` of a recorded pipe directory, ``<run_dir>/mps/<uuid>/pipe``;
    None for any other path (not absolute, another device's, too short)."""
    path = Path(pipe_dir)
    if not path.is_absolute() or len(path.parents) < 4 or ".." in path.parts:
        return None
    if path.name != "pipe" or path.parent.name != uuid or path.parents[1].name != "mps":
        return None
    return path.parents[2]


# Why a daemon that no PID file names any more is stopped: see :meth:`MpsManager._end_orphan`.
_LOST = "it lost its pipe directory"
_DIGITS = re.compile(r"\d+")  # what a start error says twice alike (mps.start_failed)


def _limits_wait(why: str) -> str:
    """Why a re-created MIG device's daemon is neither started nor given limits (see
    MpsManager.observe), with what refused the move's write."""
    return f"its MPS limits wait to be moved ({why})"


# ... as a device's status says it: one line, the same on every pass
_LIMITS_WAIT = _limits_wait("state database not writable")


# How a stop event says that the daemon went (its field ``how``).
_HOW_SAID: Mapping[How, str] = {
    "quit": "it quit when asked",
    "sigterm": "it ignored quit; SIGTERM ended it",
    "sigkill": "it ignored quit and SIGTERM; SIGKILL ended it",
    "exited": "it exited unasked",
}


def _label(target: MpsTarget) -> str:
    """How people name the device: ``GPU 3``, or ``MIG device 3:1 on GPU 3``."""
    if target.mig is None:
        return f"GPU {target.gpu}"
    return f"MIG device {target.gpu}:{target.mig} on GPU {target.gpu}"


def _where(target: MpsTarget | None, uuid: str = "") -> dict[str, object]:
    """An event's fields naming the device: ``gpu`` (its GPU's index) and ``uuid`` (the
    device's own UUID); a MIG device's also ``mig`` (its index on the GPU) and, as the
    metrics label them, ``gpu_uuid`` and ``mig_uuid``. ``target`` None: a device no longer
    known (gone), named by its ``uuid`` alone."""
    where: dict[str, object] = {"uuid": uuid}
    if target is None:
        return where
    where = {"uuid": target.uuid, "gpu": target.gpu}
    if target.mig is not None:
        where["mig"] = target.mig
        where["mig_uuid"] = target.uuid
        if target.gpu_uuid:
            where["gpu_uuid"] = target.gpu_uuid
    return where


def _client_limits(limits: MpsLimits) -> tuple[int, int | None]:
    """The thread percentage and memory limit an MPS client gets under ``limits``: the
    driver's default of 100 % and a limit set to 100 % are one."""
    return limits.threads_percent or 100, limits.memory_bytes


def _restart_loss(jobs: Sequence[str] | None, servers: Sequence[int]) -> str:
    """What an ``mps.restart`` message adds on what the daemon before took with it: its MPS
    servers (the pids its last answer listed), and with them their clients' contexts, or
    none when no server ran; and the jobs holding the device then (None: not read)."""
    held = (
        "the jobs holding the device were not read"
        if jobs is None
        else ""
        if not jobs
        else f"job {jobs[0]} held the device"
        if len(jobs) == 1
        else f"jobs {', '.join(jobs)} held the device"
    )
    if not servers:
        if not held:
            return ""
        if jobs is None:
            return f"; {held}, and no MPS server ran"
        return f"; {held} with no MPS server running"
    pids = (
        f"server (pid {servers[0]})"
        if len(servers) == 1
        else f"servers (pids {', '.join(map(str, servers))})"
    )
    clients = (
        "its MPS clients"
        if jobs is not None and len(jobs) == 1
        else "their MPS clients"
        if jobs
        else "the MPS clients"
    )
    lost = f"{clients} lost their {pids} with the daemon before"
    if jobs is None:
        return f"; {lost}; {held}"
    return f"; {held}: {lost}" if jobs else f"; no job held the device: {lost}"


def _matches(desired: MpsLimits, threads: float, memory: int | None) -> bool:
    if abs(threads - (desired.threads_percent or 100)) > 0.05:
        return False
    if desired.memory_bytes is None:
        return memory is None
    shown = protocol.displayed_memory(desired.memory_bytes)
    return memory == protocol.parse_memory("", shown)


def _pct(value: int | None) -> str:
    return "100 % (default)" if value is None else f"{value} %"


def _mem(value: int | None) -> str:
    return "unlimited" if value is None else format_size(value)
