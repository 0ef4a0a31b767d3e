"""The MIG manager: validate, plan and apply layouts safely; reconcile; show; export.

One :class:`MigManager` per daemon. Every mutating driver call goes through it, serialised
by a lock (an apply made while another runs is refused, naming it), in this order for an
apply:

1. resolve the named config for each GPU and validate it against the GPU's own tables
   (nothing is touched when any GPU's layout is impossible);
2. plan every GPU (:mod:`gpud.mig.plan`);
3. check that no instance to be destroyed runs processes (``nvidia-smi`` "Processes" table,
   per MIG device) or is reserved by a job whose process has not opened it yet (the driver
   lists nothing there, and the run would find its device gone); refuse with
   :class:`~gpud.errors.Busy` naming pids and jobs, or wait for
   them to leave (``drain``), or go ahead (``force``: each GPU's outcome names the
   reservations whose devices it destroyed); a GPU whose processes cannot be listed is left
   alone unless ``force`` (nothing shows that it is idle). From before these checks until
   its steps end, no job is placed on the GPUs it changes (``hold_placement``);
4. persist the desired layouts and the plan in one transaction, then run the steps, each
   step re-planned from what the driver has, so that a crash at any point is finished by
   :meth:`MigManager.reconcile` at the next start without orphaned or duplicated instances.
   Before a GPU's steps, the MPS control daemons of the MIG devices they destroy are stopped
   (``release``), and so is the whole-GPU daemon of a GPU they enable MIG mode on (the
   driver enables it only on a GPU no process holds; on a product whose change waits for a
   reset, only when the apply resets the GPU); where one would not stop, the GPU is
   ``failed`` with no step taken.

A dry run makes steps 1 to 3 (the busy checks once: it does not drain) and stops there: it
answers what the apply would (``busy`` where the apply would be refused, ``faulty`` GPUs
left alone, ``partial``; ``reset_pending`` with ``skip_reset`` where a MIG mode change would
wait for a GPU reset; ``failed`` where, forced, processes would keep it pending and the
driver would refuse the reset) with each GPU's steps, the GPU reset the apply makes among
them, and changes nothing.

A MIG mode change the driver can only make at the next GPU reset (``nvidia-smi -mig 1``
answering "pending", as on A100) is finished by resetting the GPU (``nvidia-smi --gpu-reset
-i N``, :meth:`GpuBackend.reset_gpu`) once the busy checks above allow it, and the instances
are created in the same apply, as ``nvidia-mig-parted apply`` does. With ``skip_reset`` (or a
backend that cannot reset) the change is reported as ``reset_pending`` and the instances are
created by the first reconcile after a reset or reboot. Hopper makes the change at once.

Faults stay with the GPU that has them: a GPU the last telemetry sample found unhealthy
(lost, not answering) is not called at all, and one that fails while being read or changed
is reported ``faulty`` with the reason, while every other GPU is shown, applied and
reconciled as usual; an apply that left a faulty GPU alone is a ``partial`` result. Every
read of a GPU (an apply's plans, its busy checks and the re-read before each GPU's steps;
``show``, ``assert``, ``export`` and reconcile) is waited for until telemetry finds the GPU
hung, or its deadline if that comes first (see :meth:`MigManager._bounded`): for an apply's
reads, one driver call left unanswered that long, not the read's many calls together (a
slow host is not a hung GPU), and on a GPU the apply has begun to change, that alone
(:data:`ReadWait`); the steps that change MIG are waited for however long the
driver takes.

An apply whose caller has gone (``still_wanted`` answers False), or that gpud's stop finds
(``stopping`` answers True), is not started if it had not started, nor if it was still
draining (logged as stopped while draining, before any change); one that had started is
finished, and logged as finished after its caller had gone if the caller had.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, NamedTuple, TypeVar, cast

from gpud.backend.port import (
    GpuBackend,
    GpuIdentity,
    GpuInstanceInfo,
    MigDeviceIdentity,
    ProcessInfo,
    unknown_identity,
)
from gpud.backend.products import lookup
from gpud.errors import (
    GPU_FAULTS,
    BackendError,
    Busy,
    DriverTimeout,
    FailedPrecondition,
    GpudError,
    GpuFault,
    GpuLost,
    InvalidArgument,
    NotFound,
    NotSupported,
    StateError,
)
from gpud.events import EventLog
from gpud.mig.layout import DeviceLayout, MigConfigFile, export_config
from gpud.mig.plan import (
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    GpuActual,
    GpuPlan,
    SetMigMode,
    Step,
    actual_layout,
    describe_difference,
    plan_gpu,
    reset_step,
    steps_before_reset,
)
from gpud.mig.results import ApplyResult, ApplyStats, GpuOutcome
from gpud.mig.store import ApplyOptions, DesiredRecord, InflightRecord, MigStore
from gpud.mig.validate import ProfileTable, load_table, reference_table, validate_layout
from gpud.mig.view import GpuView, JobResolver, faulty_view, gpu_view, read_actual
from gpud.shared import format_number
from gpud.store import StateStore
from gpud.telemetry.snapshot import LastSeenSource, SeenIdentity

log = logging.getLogger(__name__)

T = TypeVar("T")

ReconcileMode = Literal["reconcile", "report"]

ReadWait = Literal["in_all", "each_call", "changing"]
"""How :meth:`MigManager._bounded` waits for a GPU's read: ``in_all``, ``timeout_s`` for
the whole read; ``each_call`` (an apply's), ``timeout_s`` for each of its driver calls; both
until telemetry finds the GPU faulty if that comes first. ``changing``: as ``each_call``,
for a GPU the apply has begun to change, whatever telemetry finds meanwhile: its sample of
the GPU waits behind the apply's own driver changes, and a read given up on would leave the
layout half made; a GPU that hangs is still given up on after ``timeout_s``, and one lost
fails its calls."""

ReadAwait = Callable[[threading.Condition, float, frozenset[int]], object]
"""How :meth:`MigManager._bounded` waits for its GPUs' reads: ``wait(done, timeout_s, gpus)``
returns once ``done`` (held) is notified, as each read answers, or once ``timeout_s`` has
passed on the manager's ``monotonic`` clock; ``gpus``: the indexes of the GPUs whose reads
it still waits for (the default, :func:`_await_answer`, waits on ``done`` alone)."""


def _await_answer(done: threading.Condition, timeout_s: float, gpus: frozenset[int]) -> bool:
    """:data:`ReadAwait` on ``time.monotonic``: ``done.wait(timeout_s)``."""
    return done.wait(timeout_s)


Release = Callable[[list[str]], AbstractContextManager[Mapping[str, str]]]
"""Stop the MPS control daemons of the MIG devices (UUIDs) about to be destroyed, and start
none for them while the context lasts; it yields, by UUID, why one still has a daemon (it
would not stop)."""

ByDevice = Mapping[str, Sequence[str]]
"""Device UUID (a GPU or a MIG device) -> the jobs that hold a reservation on it."""

Reserved = Callable[[], ByDevice]
"""The jobs that hold a reservation, by device UUID (a GPU or a MIG device). Called once per
round of an apply's busy checks, on the apply's own thread, never on a GPU's read: a state
database slow to answer is never taken for a GPU that does not answer. A store error raises
:class:`StateError` naming the database."""


class ReservedBy(NamedTuple):
    """A job's reservation on a device an apply would destroy, with no process of the job
    listed there: its run has its ``CUDA_VISIBLE_DEVICES`` and may open the device at any
    moment, and the driver refuses nothing until it does."""

    job: str


Holder = ProcessInfo | ReservedBy
"""What holds a device an apply would destroy: a process the driver lists, or a job's
reservation."""

HoldPlacement = Callable[[Mapping[int, str]], AbstractContextManager[object]]
"""Place no job on the GPUs (index -> why) while the context lasts. Entered once no
reservation is being placed (it takes the placement lock to mark them): a reservation
placed before is committed, and the busy check that follows sees it; none is placed after,
until the context ends."""

Faults = Callable[[], Mapping[int, str]]
"""GPU index -> why it is faulty: the GPUs the last telemetry sample found unhealthy."""

NOT_ANSWERING = "not answering: an earlier driver call on it is still outstanding"

# Seconds an incomplete MIG table is kept. The driver lists compute instance profiles only
# from an existing GPU instance of their profile, so a GPU of 7 x 1g.10gb has no complete
# table: without this each reconcile pass read every such GPU's tables again (one
# ``-lgip``, a ``-lgipp`` and a ``-lcip`` per profile: about 15 calls a GPU). Kept this
# long, or until this process changes the GPU; then read again, for an instance another
# tool created may let the driver list more.
INCOMPLETE_TABLE_S = 60.0
# How long `forget` waits for the manager's lock: a reconcile step holds it for milliseconds
# each tick; an apply is refused before this wait (see MigManager.forget).
FORGET_WAIT_S = 2.0


def _fault_reason(err: BackendError) -> str:
    if isinstance(err, GpuLost):
        return f"GPU lost: {err}"
    if isinstance(err, GpuFault):
        return f"{err.problem}: {err}"
    return str(err)


class MigManager:
    """MIG partitions of one node. Build once at the composition root::

    manager = MigManager(backend, state_store, event_log, job_resolver=jobs.job_of_pid)
    manager.reconcile("reconcile")  # at start, then on every tick
    """

    def __init__(
        self,
        backend: GpuBackend,
        store: StateStore,
        events: EventLog,
        *,
        job_resolver: JobResolver | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        read_wait: ReadAwait = _await_answer,
        drain_poll_s: float = 1.0,
        on_change: Callable[[int], None] | None = None,
        faults: Faults | None = None,
        quiesce: Callable[[], AbstractContextManager[object]] | None = None,
        on_reset: Callable[[int], None] | None = None,
        read_timeout_s: float = 5.0,
        release: Release | None = None,
        release_active: Callable[[], bool] | None = None,
        reserved: Reserved | None = None,
        hold_placement: HoldPlacement | None = None,
        after_change: Callable[[], None] | None = None,
        last_seen: LastSeenSource = dict,
        read_identities: Callable[[], Mapping[int, GpuIdentity]] = dict,
    ) -> None:
        """``on_change(gpu)`` is called after each driver change on a GPU (the sampler then
        re-reads its MIG devices at once); ``faults()`` names the GPUs not to call (see
        :data:`Faults`); a GPU reset runs inside ``quiesce()`` (no other driver calls
        meanwhile: the backend lets go of the driver for it) and is followed by
        ``on_reset(gpu)``. An apply waits for each of a GPU's reads (its plan, its process
        lists, the re-read before its steps) while the driver answers each of their calls
        within ``read_timeout_s`` (the daemon passes ``telemetry.call_timeout_s``: a GPU
        slower than that is hung by telemetry's own measure) and leaves one that has not
        answered alone. ``release``: the MPS
        control daemons of the MIG devices a GPU's steps destroy, and the GPU's own where
        they enable MIG mode (its UUID among the MIG devices'), are stopped first; where
        one would not stop, none of that GPU's steps is run (it is ``failed``, naming it).
        ``release_active()``: whether there are MPS control daemons to stop now (MPS on);
        without it, whenever ``release`` is given. ``reserved()``: the jobs holding a
        reservation, by device; what an apply would destroy counts as busy while one does,
        as with a process on it (the driver sees no process yet, so it would refuse nothing).
        ``hold_placement``: an apply (not a dry run) marks the GPUs it changes before its
        busy checks and keeps each marked until its own steps end, so that no reservation
        (``gpuctl run``, a queued job started) lands on an instance between the check and
        its destroy step (the reconcile step that resumes or retries an apply holds each GPU
        it changes so too). ``after_change()``: after an apply's steps (or a reconcile
        step's) changed a GPU, still within its hold, the GPUs are read again (the daemon
        samples and takes the devices jobs are placed on from that sample): placement
        reopens on the instances the driver has now, never on one the steps destroyed. One
        that raises is logged: the apply was made. A read's deadline is on ``monotonic``,
        and ``read_wait`` (:data:`ReadAwait`) waits for its answers: given one, the other.
        ``last_seen()``: how an earlier run last saw each GPU never read in this one (its
        product checks the layout an apply saves for it while it is faulty).
        ``read_identities()``: each GPU's identity as telemetry last read it in this run
        (``nvmlDeviceGetUUID`` and the rest answered): a faulty GPU this manager never read
        (lost before start, then back on the bus with its XID 79 uncleared) is named by it.
        """
        self._last_seen = last_seen
        self._read_identities = read_identities
        # each of a bounded read's driver calls notes its answer (see _bounded)
        self._reading = threading.local()
        self._backend = cast(GpuBackend, _Answering(backend, self._reading))
        self._release = release
        self._release_active = release_active
        self._on_change = on_change
        self._faults = faults
        self._quiesce = quiesce
        self._on_reset = on_reset
        self._read_timeout_s = read_timeout_s
        self._known: dict[int, GpuIdentity] = {}
        self._stuck: set[int] = set()  # GPUs with a `show` read still in the driver
        self._stuck_lock = threading.Lock()
        self._store = MigStore(store)
        self._events = events
        self._jobs = job_resolver
        self._reserved = reserved
        self._hold_placement = hold_placement
        self._after_change = after_change
        self._monotonic = monotonic
        self._wall = wall
        self._sleep = sleep
        self._read_wait = read_wait
        self._drain_poll_s = drain_poll_s
        self._lock = threading.RLock()
        # the apply (not a dry run) running now: its config and when it began; guarded by
        # _applying_lock, which is never held while waiting for _lock
        self._applying: tuple[str, float] | None = None
        self._applying_lock = threading.Lock()
        self._last_report: dict[str, str] = {}
        # the config of an apply this process ran that failed: its plan stays in flight and
        # reconcile retries it (not an apply interrupted by a crash, to be resumed)
        self._failed_apply: str | None = None
        # with mig.on_start = "report": the apply left unfinished, how to finish it
        self._unfinished: str | None = None
        self._tables: dict[str, ProfileTable] = {}
        # UUID -> an incomplete table and when it was read: see INCOMPLETE_TABLE_S
        self._partial: dict[str, tuple[ProfileTable, float]] = {}
        self._view: list[GpuView] | None = None
        self._view_at = float("-inf")
        # when each GPU shown faulty but answering again was last read on its own (see
        # _refresh_view)
        self._reread_at: dict[int, float] = {}
        self._outcomes: list[GpuOutcome] = []
        self.stats = ApplyStats()
        # driver changes made by this process (read from other threads: start-up tells
        # systemd a long reconcile is still moving)
        self.steps_taken = 0
        # GPU index -> driver changes made to it by this process (see _holding)
        self._changes: dict[int, int] = {}

    # ---------------------------------------------------------------- reading the driver

    def _gpus(self) -> tuple[list[GpuIdentity], dict[int, str]]:
        """Every GPU, by index, and why the faulty ones are faulty. A GPU telemetry found
        unhealthy, or with a read still stuck in the driver, is not called; one whose
        identity cannot be read is faulty. Identities are remembered (they do not change
        while the GPU is present), so a faulty GPU keeps the UUID and product it had."""
        faults = self._faulty_now()
        out = []
        read: Mapping[int, GpuIdentity] | None = None
        for i in range(self._backend.gpu_count()):
            if i not in faults:
                try:
                    self._known[i] = self._backend.identity(i)
                except BackendError as err:
                    faults[i] = f"identity: {_fault_reason(err)}"
            gpu = self._known.get(i)
            if gpu is None and i in faults:
                # not called, never read by this manager: as telemetry last read it, if it did
                read = self._read_identities() if read is None else read
                told = read.get(i)
                gpu = told if told is not None and told.read and told.index == i else None
            out.append(gpu or unknown_identity(i))
        return out, faults

    def _unread(
        self, ids: Sequence[GpuIdentity], faults: Mapping[int, str], indices: Iterable[int]
    ) -> dict[int, str]:
        """Of ``indices``, each GPU index where no UUID read now says which GPU is there, and
        why: a faulty GPU never read (lost since before gpud started), or an index beyond
        the driver's GPU count (``nvmlDeviceGetCount``) where a GPU was known, by an earlier
        run (``last_seen``) or by telemetry (``read_identities``, or faulty now): a GPU gone
        from the bus, which may come back. An index never known beyond the count has none."""
        wanted = set(indices)
        beyond = {i for i in wanted if i >= len(ids)}
        known = {*self._last_seen(), *self._read_identities(), *faults} if beyond else set()
        out = {i: faults[i] for i in wanted - beyond if not ids[i].uuid and i in faults}
        for i in sorted(beyond & known):
            out[i] = faults.get(i) or (
                f"gone from the bus: the driver counts {len(ids)} GPU(s), none at index {i}"
            )
        return out

    def _faulty_now(self) -> dict[int, str]:
        """The GPUs not to call now: found faulty by telemetry, or with a read of ours still
        stuck in the driver (:data:`NOT_ANSWERING`)."""
        faults = dict(self._faults()) if self._faults is not None else {}
        return {**self._stuck_now(), **faults}

    def _stuck_now(self) -> dict[int, str]:
        """The GPUs with a read of ours still stuck in the driver (:data:`NOT_ANSWERING`)."""
        with self._stuck_lock:
            return dict.fromkeys(self._stuck, NOT_ANSWERING)

    def _identities(self) -> list[GpuIdentity]:
        """The GPUs that are not faulty."""
        ids, faults = self._gpus()
        return [g for g in ids if g.index not in faults]

    def _actual(self, gpu: GpuIdentity) -> GpuActual:
        return read_actual(self._backend, gpu)

    def _table(self, gpu: GpuIdentity) -> ProfileTable | None:
        """The GPU's own MIG tables (read once, they do not change while it is present), or
        the product's published table while MIG mode is off and the driver lists none."""
        if not gpu.mig_capable:
            return None
        cached = self._tables.get(gpu.uuid)
        if cached is not None:
            return cached
        now = self._monotonic()
        partial = self._partial.get(gpu.uuid)
        if partial is not None and now - partial[1] < INCOMPLETE_TABLE_S:
            return partial[0]
        try:
            table = load_table(self._backend, gpu.index)
        except NotSupported:
            return reference_table(gpu)
        if table.from_device:
            self._tables[gpu.uuid] = table
            self._partial.pop(gpu.uuid, None)
        else:
            self._partial[gpu.uuid] = (table, now)
        return table

    def _plan(
        self, gpu: GpuIdentity, layout: DeviceLayout, table: ProfileTable | None
    ) -> tuple[GpuActual, GpuPlan]:
        actual = self._actual(gpu)
        if layout.mig_enabled and table is None:
            if not gpu.mig_capable:
                raise InvalidArgument(
                    f"GPU {gpu.index} ({gpu.product}): does not support MIG", field="mig-enabled"
                )
            steps: tuple[Step, ...] = () if actual.mode.pending else (SetMigMode(gpu.index, True),)
            return actual, GpuPlan(gpu.index, steps, reset_pending=True)
        return actual, plan_gpu(actual, layout, table)

    # ---------------------------------------------------------------- busy checks

    def _busy(
        self, gpu: GpuIdentity, actual: GpuActual, plan: GpuPlan, *, reset: bool, reserved: ByDevice
    ) -> tuple[list[MigDeviceIdentity], list[tuple[str, Holder]]]:
        """What ``plan`` destroys (:meth:`_doomed`) and the processes on it (``nvidia-smi``
        "Processes" per MIG device), each with what it runs on. A MIG mode change made at
        once (Hopper), and a GPU reset (``reset``: the plan waits for one and gpud may do
        it), disturb every process on the GPU; a change left pending until a reset (A100
        without ``reset``: ``--skip-reset``) disturbs none until that reset, only the
        instances the plan destroys. A device a job has reserved is busy too, named by
        that job, unless a process of the job already shows there."""
        doomed, mode_change = self._doomed(gpu, actual, plan, reset=reset)
        found: dict[int, tuple[str, Holder]] = {}
        for md in doomed:
            for p in self._backend.processes(gpu.index, md.mig):
                found.setdefault(p.pid, (_where(md), p))
        if mode_change:
            for p in self._backend.processes(gpu.index):
                found.setdefault(p.pid, ("the whole GPU", p))
        held = [found[pid] for pid in sorted(found)]
        places = _places(gpu, doomed, mode_change)
        return doomed, held + self._reservations(places, held, reserved)

    def _reserved_destroyed(
        self,
        plans: dict[int, tuple[GpuActual, GpuPlan]],
        by_index: dict[int, GpuIdentity],
        *,
        reset: bool,
    ) -> dict[int, list[tuple[str, Holder]]]:
        """For a forced apply, before its steps: the jobs' reservations on what each plan
        destroys, by GPU, which the force goes past (read as the busy checks are, and left
        out for a GPU that does not answer). Their runs were handed devices the driver will
        not have: each GPU's outcome names them."""
        if self._reserved is None:
            return {}
        reserved = self._reserved_now()

        def listed(gpu: GpuIdentity) -> list[tuple[str, Holder]]:
            actual, plan = plans[gpu.index]
            doomed, mode_change = self._doomed(gpu, actual, plan, reset=reset)
            return self._reservations(_places(gpu, doomed, mode_change), [], reserved)

        todo = [by_index[i] for i in sorted(plans)]
        answers = self._bounded(todo, listed, self._read_timeout_s, "reserved")
        return {i: got for i, got in answers.items() if isinstance(got, list) and got}

    def _reserved_now(self) -> ByDevice:
        """The jobs' reservations by device UUID, read now on the calling thread (the
        apply's): once per round, for the per-GPU reads to look up."""
        return {} if self._reserved is None else self._reserved()

    def _reservations(
        self,
        places: list[tuple[str, str]],
        held: list[tuple[str, Holder]],
        reserved: ByDevice,
    ) -> list[tuple[str, Holder]]:
        """The jobs' reservations (``reserved``, by UUID) on ``places`` ((where, device
        UUID)) whose job runs no process listed in ``held``: a run reserved but not yet on
        the device."""
        running = {self._job_of(p) for _, p in held}
        out: list[tuple[str, Holder]] = []
        for where, uuid in places:
            for job in reserved.get(uuid, ()):
                if job not in running:
                    running.add(job)
                    out.append((where, ReservedBy(job)))
        return out

    def _job_of(self, holder: Holder) -> str | None:
        if isinstance(holder, ReservedBy):
            return holder.job
        return self._jobs(holder.pid) if self._jobs is not None else None

    def _doomed(
        self, gpu: GpuIdentity, actual: GpuActual, plan: GpuPlan, *, reset: bool
    ) -> tuple[list[MigDeviceIdentity], bool]:
        """The MIG devices ``plan`` destroys (every one where it changes the MIG mode now, or
        a GPU reset may: see :meth:`_busy`), and whether it does either."""
        gis = plan.destroyed_gpu_instances()
        cis = plan.destroyed_compute_instances()
        mode_change = _mode_changes_now(gpu, actual, plan, reset=reset)
        if not actual.mode.current or not (gis or cis or mode_change):
            return [], mode_change
        return [
            md
            for md in self._backend.mig_devices(gpu.index)
            if mode_change
            or md.gpu_instance_id in gis
            or (md.gpu_instance_id, md.compute_instance_id) in cis
        ], mode_change

    def _busy_or_unlisted(
        self, gpu: GpuIdentity, actual: GpuActual, plan: GpuPlan, *, reset: bool, reserved: ByDevice
    ) -> tuple[list[MigDeviceIdentity], list[tuple[str, Holder]]] | str:
        """:meth:`_busy`, or why the GPU's processes cannot be listed (a driver that does not
        support the query, say): gpud cannot tell that what the plan destroys is idle, so
        the GPU is left alone unless forced. A GPU that is lost or hangs still raises."""
        try:
            return self._busy(gpu, actual, plan, reset=reset, reserved=reserved)
        except GPU_FAULTS:
            raise
        except BackendError as err:
            return f"cannot list its processes: {err} (apply with --force to change it anyway)"

    def _busy_parts(
        self,
        busy: dict[int, list[tuple[str, Holder]]],
        ids: dict[int, GpuIdentity],
    ) -> tuple[list[int], list[str], list[str]]:
        """The pids, their jobs, and one line per process naming where it runs."""
        pids: list[int] = []
        jobs: list[str] = []
        parts = []
        for gpu, entries in sorted(busy.items()):
            for where, p in entries:
                job = self._job_of(p)
                if not isinstance(p, ReservedBy):
                    pids.append(p.pid)
                if job is not None and job not in jobs:
                    jobs.append(job)
                parts.append(f"GPU {gpu} ({ids[gpu].product}) {where}: {self._who(p)}")
        return pids, jobs, parts

    def _who(self, holder: Holder) -> str:
        """ "pid 4242 (job train-7)", "pid 4243", or "reserved by job train-8 (no process
        of it there yet)"."""
        if isinstance(holder, ReservedBy):
            return f"reserved by job {holder.job} (no process of it there yet)"
        return _who(holder.pid, self._job_of(holder))

    def _pids(self, entries: list[tuple[str, Holder]]) -> str:
        """The processes, each with its job: "pid 4242 (job train-7), pid 4243"."""
        return ", ".join(self._who(p) for _, p in entries)

    def _busy_error(
        self,
        busy: dict[int, list[tuple[str, Holder]]],
        ids: dict[int, GpuIdentity],
        waited_s: float | None,
    ) -> Busy:
        pids, jobs, parts = self._busy_parts(busy, ids)
        reserved = any(isinstance(p, ReservedBy) for e in busy.values() for _, p in e)
        if waited_s is not None:
            what = (
                "processes or reservations still there" if reserved else "processes still running"
            )
            head = f"{what} after draining for {waited_s:.0f}s"
            # drain was asked for: what is left is a longer drain or force
            hint = "stop them, drain longer (--drain-timeout) or force"
        else:
            what = "running processes or jobs' reservations" if reserved else "running processes"
            head = f"refusing to destroy instances with {what}"
            hint = "use drain or force"
        return Busy(f"{head}: {'; '.join(parts)} ({hint})", pids=tuple(pids), jobs=tuple(jobs))

    # ---------------------------------------------------------------- apply

    def apply(
        self,
        config: MigConfigFile,
        name: str,
        *,
        options: ApplyOptions | None = None,
        dry_run: bool = False,
        still_wanted: Callable[[], bool] | None = None,
        stopping: Callable[[], bool] | None = None,
    ) -> ApplyResult:
        """Apply config ``name`` of ``config`` to this node's GPUs. See the module docstring;
        ``still_wanted()`` says whether the caller still waits for the result,
        ``stopping()`` whether gpud is stopping. One made while another apply (not a dry
        run) runs is refused with :class:`FailedPrecondition` naming it: it would wait for
        that one's drain and steps unseen, then undo them."""
        opts = options or ApplyOptions()
        start = self._monotonic()
        wanted = still_wanted or (lambda: True)
        stop = stopping or (lambda: False)
        with (
            self._only_apply(name, start, dry_run=dry_run),
            self._lock,
            contextlib.ExitStack() as holding,
        ):
            try:
                result = self._apply(
                    config,
                    name,
                    opts,
                    dry_run,
                    start=start,
                    wanted=wanted,
                    stopping=stop,
                    holding=holding,
                )
            except (InvalidArgument, NotFound) as err:
                # A GPU index the node lacks is a bad request, not a failed apply.
                self._finish(name, "invalid", start, str(err))
                raise
            except Busy as err:
                self._finish(name, "busy", start, str(err))
                raise
            except GpudError as err:
                self._finish(name, "failed", start, str(err))
                raise
        return result

    def _left_alone_desired(
        self,
        layouts: Mapping[int, DeviceLayout],
        faulty: Mapping[int, str],
        ids: Sequence[GpuIdentity],
        where: str,
    ) -> tuple[dict[str, tuple[int, DeviceLayout]], dict[int, str]]:
        """The layouts the config gives the GPUs an apply leaves alone as faulty, by UUID:
        their desired layouts too, so that the reconcile step brings each there once it
        answers, not back to what an earlier apply wanted; and, by GPU index, why one keeps
        its earlier desired layout instead (for its line in the apply's answer).

        Each is checked against its product's profile table as a healthy GPU's layout is
        (the table the driver gave it, else the published one): a layout it cannot take is
        refused (:class:`InvalidArgument` naming ``where``, the GPU and the profile), not
        saved for the reconcile step to fail on once it answers. A GPU lost since before
        gpud started has no UUID read from the driver: with a product an earlier run saw
        (``last_seen``), the record of the UUID that run read there is its own (a board
        replaced at that index leaves the old board's record behind, not its own), and
        where no run saw a UUID there, its index's newest record (no GPU read now has that
        UUID) is the GPU it most likely is, as the reconcile step takes it (with no such
        record it stays unmanaged); with no product seen its layout cannot be checked and
        its record is left as it was. A GPU never read that only a ``device-filter`` may name (its PCI
        device id unknown) keeps its record too, and is told so."""
        seen = self._last_seen()
        stored = _unread_records(self._store.desired(), {g.uuid for g in ids if g.uuid}, seen)
        out: dict[str, tuple[int, DeviceLayout]] = {}
        unchanged: dict[int, str] = {}
        for i in sorted(faulty):
            if i not in layouts:
                unchanged[i] = (
                    "its product unknown: the config's device-filter cannot be judged;"
                    " its desired layout is unchanged"
                )
                continue
            gpu = ids[i] if ids[i].read else _seen_identity(i, seen.get(i))
            if gpu is None:
                unchanged[i] = (
                    "its product unknown: the config's layout for it cannot be checked;"
                    " its desired layout is unchanged"
                )
                continue
            _check_layout(gpu, layouts[i], self._tables.get(gpu.uuid), where)
            if ids[i].read:
                out[gpu.uuid] = (i, layouts[i])
            elif i in stored:
                out[stored[i].gpu_uuid] = (i, layouts[i])
            else:
                unchanged[i] = "its UUID never read and no earlier apply recorded it: unmanaged"
        return out, unchanged

    @contextlib.contextmanager
    def _only_apply(self, name: str, start: float, *, dry_run: bool) -> Iterator[None]:
        """Refuse the apply (or dry run) of ``name`` while another apply runs: it would wait
        for that one's drain and steps unseen, then plan from what it left (undoing it),
        and neither caller would be told. A refused apply is logged as not started."""
        with self._applying_lock:
            if self._applying is not None:
                other, since = self._applying
                refusal = FailedPrecondition(
                    f"an apply of {other} is in flight (started {max(0.0, start - since):.0f} s"
                    " ago): wait for it to end (gpuctl mig show) and apply again"
                )
                if not dry_run:
                    self._not_started(name, start, str(refusal), client_gone=False)
                raise refusal
            if not dry_run:
                self._applying = (name, start)
        try:
            yield
        finally:
            if not dry_run:
                with self._applying_lock:
                    self._applying = None

    def _finish(self, name: str, result: str, start: float, detail: str, **fields: object) -> float:
        duration = self._monotonic() - start
        self.stats.record(result, duration)
        fields = {k: v for k, v in fields.items() if v is not None}  # None: does not apply
        self._events.emit(
            "mig.apply",
            f"apply {name}: {result}{': ' + detail if detail else ''}",
            config=name,
            result=result,
            duration_s=round(duration, 3),
            **fields,
        )
        return duration

    def _apply(
        self,
        config: MigConfigFile,
        name: str,
        opts: ApplyOptions,
        dry_run: bool,
        *,
        start: float,
        wanted: Callable[[], bool],
        stopping: Callable[[], bool],
        holding: contextlib.ExitStack[bool | None],
    ) -> ApplyResult:
        """:meth:`apply` under its lock; ``holding``: where it holds placement off the GPUs it
        changes, each until it converged, the rest (a GPU found faulty) until :meth:`apply`
        ends."""
        ids, faults = self._gpus()
        by_index = {g.index: g for g in ids}
        layouts = config.layouts(name, ids, faults=faults)
        # a GPU never read may or may not be one the config's device filters name: faulty
        faulty = {i: faults[i] for i in [*layouts, *config.unjudged(name, ids)] if i in faults}
        healthy = [by_index[i] for i in sorted(layouts) if i not in faulty]
        planned = self._plan_bounded(healthy, layouts)
        plans = _answers(healthy, planned, faulty, config.where(name))
        # after planning: a GPU found faulty there is left alone too
        left_desired, unchanged = self._left_alone_desired(layouts, faulty, ids, config.where(name))

        def left_alone() -> tuple[GpuOutcome, ...]:
            return tuple(
                GpuOutcome(
                    i,
                    by_index[i].uuid,
                    (),
                    False,
                    "faulty",
                    f"GPU {i}{_product(by_index[i])} is faulty, left alone: {reason}"
                    + (f"; {unchanged[i]}" if i in unchanged else ""),
                )
                for i, reason in sorted(faulty.items())
            )

        reset = not opts.skip_reset
        if dry_run:
            # the checks the apply makes before it starts, once (a dry run does not drain)
            busy = {} if opts.force else self._check_idle(plans, by_index, faulty, reset=reset)
            held = self._holders(plans, by_index) if opts.force else {}
            return self._preview(
                name, plans, by_index, busy=busy, held=held, opts=opts, left_alone=left_alone()
            )

        if stopping():  # it waited behind a reconcile
            return self._not_started(
                name, start, "gpud was stopping before it started", client_gone=not wanted()
            )
        if not wanted():  # it waited behind a reconcile, or its planning was slow
            return self._not_started(name, start, "the client had gone before it started")
        drain_start = self._monotonic()

        def go_on() -> bool:
            return wanted() and not stopping()

        # before the busy checks: a run placed on an instance after them would find it
        # destroyed under it, and one placed during a drain would keep it from ending. One
        # hold per GPU, let go once that GPU converged (and was read again): a GPU that
        # converged takes jobs while the ones after it change, though a GPU slow to change
        # (an A100's reset, a hung call) keeps those after it held until its turn ends
        holds: dict[int, contextlib.ExitStack[bool | None]] = {}
        for i, (_, p) in sorted(plans.items()):
            if not p.empty:
                holds[i] = holding.enter_context(contextlib.ExitStack())
                holds[i].enter_context(
                    self._holding({i: f"a MIG apply of {name} is changing its instances"})
                )
        if not opts.force and not self._wait_idle(plans, by_index, opts, go_on, faulty):
            # cancelled (gpuctl interrupted, or gpud stopping) while processes still ran
            waited = self._monotonic() - drain_start
            gone = not wanted()
            return self._not_started(
                name,
                start,
                f"stopped while draining, after {waited:.0f}s waiting for processes to leave, "
                f"before any change ({'the client had gone' if gone else 'gpud was stopping'})",
                client_gone=gone,
            )

        # what force goes past: runs handed a device the steps destroy, told in the outcome
        destroyed = self._reserved_destroyed(plans, by_index, reset=reset) if opts.force else {}
        all_steps = [s for _, (_, p) in sorted(plans.items()) for s in p.steps]
        # an apply a crash, a stop or a failure left in flight: this one takes its place
        # (its layouts are no longer wanted, and neither reconcile nor a start resumes it)
        prior = self._store.inflight()
        self._store.begin_apply(
            name,
            {
                **left_desired,
                **{by_index[i].uuid: (i, layouts[i]) for i in plans},
            },
            all_steps,
            opts,
            self._wall(),
            # nothing to do (no step, no reset pending): no plan for a next start to resume
            inflight=not all(p.empty for _, p in plans.values()),
        )
        self._unfinished = None  # this apply replaces it
        outcomes: list[GpuOutcome] = list(left_alone())
        for i in sorted(plans):
            # telemetry may have found it hung while the GPUs before it were applied
            if (reason := self._faulty_now().get(i)) is not None:
                where = f"GPU {i}{_product(by_index[i])}"
                detail = f"{where} is faulty, left alone: {reason}"
                outcomes.append(GpuOutcome(i, by_index[i].uuid, (), False, "faulty", detail))
                continue
            outcomes.append(
                self._converge(
                    by_index[i],
                    layouts[i],
                    force=True,
                    reset=reset,
                    read_timeout_s=self._read_timeout_s,
                    wait="each_call",
                )
            )
            if i in holds:
                holds.pop(i).close()
        outcomes = sorted(
            (self._past_reservations(o, destroyed, by_index) for o in outcomes),
            key=lambda o: o.gpu,
        )
        failed = any(o.status == "failed" for o in outcomes)
        self._failed_apply = name if failed else None
        if not failed:
            self._store.finish_apply()
        if failed:
            result = "failed"
        elif any(o.status == "faulty" for o in outcomes):
            result = "partial"
        elif any(o.reset_pending for o in outcomes):
            result = "reset_pending"
        elif any(o.steps for o in outcomes):
            result = "success"
        else:
            result = "noop"
        detail = "; ".join(o.detail for o in outcomes if o.detail)
        if prior is not None:
            note = (
                f"replaces the unfinished apply of {prior.config_name} ({prior.steps_done} of"
                f" {len(prior.steps)} steps done)"
            )
            detail = f"{note}; {detail}" if detail else note
        gone = not wanted()
        if gone:
            detail = (
                f"{detail}; finished after the client had gone"
                if detail
                else ("finished after the client had gone")
            )
        duration = self._finish(
            name,
            result,
            start,
            detail,
            gpus={o.gpu: o.status for o in outcomes},
            steps=sum(len(o.steps) for o in outcomes),
            client_gone=gone,
            replaced=prior.config_name if prior is not None else None,
        )
        return ApplyResult(name, result, tuple(outcomes), duration)

    def _past_reservations(
        self,
        outcome: GpuOutcome,
        destroyed: dict[int, list[tuple[str, Holder]]],
        by_index: dict[int, GpuIdentity],
    ) -> GpuOutcome:
        """``outcome``, naming the reservations its forced steps destroyed the devices of
        (``destroyed``: :meth:`_reserved_destroyed`): they stay held, for their runs to
        release, and those runs find no such device."""
        held = destroyed.get(outcome.gpu)
        if not held or not outcome.steps:
            return outcome
        parts = "; ".join(self._busy_parts({outcome.gpu: held}, by_index)[2])
        note = (
            f"{parts}: destroyed by the forced apply; its run finds no such device (release"
            " the reservation and run again)"
        )
        detail = f"{outcome.detail}; {note}" if outcome.detail else note
        return dataclasses.replace(outcome, detail=detail)

    def _preview(
        self,
        name: str,
        plans: dict[int, tuple[GpuActual, GpuPlan]],
        by_index: dict[int, GpuIdentity],
        *,
        busy: dict[int, list[tuple[str, Holder]]],
        held: dict[int, list[tuple[str, Holder]]],
        opts: ApplyOptions,
        left_alone: tuple[GpuOutcome, ...],
    ) -> ApplyResult:
        """A dry run's answer, from the plans and busy checks the apply would have: each GPU
        ``ok``, ``differs`` (with the steps the apply would take), ``reset_pending``, ``busy``
        (processes run on what it would destroy: the apply would be refused, the result is
        ``busy``), ``failed`` or ``faulty`` (left alone: the result is ``partial``). With
        ``drain`` the dry run does not wait: a GPU with processes names those the apply would
        wait for.

        A MIG mode change the GPU makes at its next reset (A100, a change already pending, or
        with ``force`` one that processes holding the GPU (``held``) keep pending) stops the
        apply there: with ``skip_reset`` the GPU is ``reset_pending`` with the steps before
        it; otherwise the steps list the GPU reset the apply makes, then the rest, or the GPU
        is ``failed`` where the driver would refuse the reset (processes hold the GPU)."""
        refused = bool(busy) and not opts.drain
        preview = list(left_alone)
        for i, (actual, plan) in sorted(plans.items()):
            gpu = by_index[i]
            where = f"GPU {i}{_product(gpu)}"
            status, details = ("ok" if plan.empty else "differs"), []
            steps = tuple(s.describe() for s in plan.steps)
            holders = held.get(i, [])
            before_reset = steps_before_reset(
                actual, plan, mode_needs_reset=_mode_needs_reset(gpu) or bool(holders)
            )
            if i in busy and refused:
                status = "busy"
                details.append(str(self._busy_error({i: busy[i]}, by_index, None)))
            elif i in busy:
                waits = "; ".join(self._busy_parts({i: busy[i]}, by_index)[2])
                details.append(
                    f"would first wait up to {opts.timeout_s:g} s for {_leaving(busy[i])}: {waits}"
                )
            if before_reset is not None and status != "busy":
                stopped = tuple(s.describe() for s in before_reset)
                who = self._pids(holders)
                if opts.skip_reset:
                    status, steps = "reset_pending", stopped
                    details.append(
                        _pending(where) + (f" (processes hold it: {who})" if who else "")
                    )
                elif holders:
                    status, steps = "failed", stopped
                    details.append(
                        f"{where}: the GPU reset would be refused while processes run on it "
                        f"({who}): the MIG mode change would be left pending (stop them, or "
                        "--skip-reset to leave it pending without failing)"
                    )
                else:
                    steps = (*stopped, reset_step(i), *steps[len(stopped) :])
            pending = status == "reset_pending"
            preview.append(GpuOutcome(i, gpu.uuid, steps, pending, status, "; ".join(details)))
        preview.sort(key=lambda o: o.gpu)
        if refused:
            result = "busy"
        elif any(o.status == "failed" for o in preview):
            result = "failed"
        elif left_alone:
            result = "partial"
        elif all(o.status == "ok" for o in preview):
            result = "noop"
        elif any(o.reset_pending for o in preview):
            result = "reset_pending"
        else:
            result = "success"
        return ApplyResult(name, result, tuple(preview), 0.0, True)

    def _holders(
        self, plans: dict[int, tuple[GpuActual, GpuPlan]], by_index: dict[int, GpuIdentity]
    ) -> dict[int, list[tuple[str, Holder]]]:
        """For a forced dry run: the processes on each GPU whose MIG mode the plan changes
        (they keep the change pending, on Hopper too) or whose pending change would need a
        reset (the driver refuses it while they run). Read as the busy checks are
        (:meth:`_bounded`); a GPU whose processes cannot be listed has none named, as the
        forced apply does not list them either."""

        def mode_change(gpu: GpuIdentity, actual: GpuActual, plan: GpuPlan) -> bool:
            # at the reset the apply may make: a change now, or one pending until then
            return actual.mode.reset_pending or _mode_changes_now(gpu, actual, plan, reset=True)

        todo = [
            by_index[i] for i, (a, p) in sorted(plans.items()) if mode_change(by_index[i], a, p)
        ]

        def listed(gpu: GpuIdentity) -> list[tuple[str, Holder]]:
            return [("the whole GPU", p) for p in self._backend.processes(gpu.index)]

        answers = self._bounded(todo, listed, self._read_timeout_s, "busy", wait="each_call")
        return {i: got for i, got in answers.items() if isinstance(got, list) and got}

    def _not_started(
        self, name: str, start: float, why: str, *, client_gone: bool = True
    ) -> ApplyResult:
        duration = self._finish(name, "not_started", start, why, client_gone=client_gone)
        return ApplyResult(name, "not_started", (), duration)

    def _wait_idle(
        self,
        plans: dict[int, tuple[GpuActual, GpuPlan]],
        by_index: dict[int, GpuIdentity],
        opts: ApplyOptions,
        wanted: Callable[[], bool],
        faulty: dict[int, str],
    ) -> bool:
        """Wait (``drain``) until nothing the plans disturb runs processes, or refuse with
        :class:`Busy`; False when the caller went away while waiting. A GPU that turns
        faulty meanwhile is moved from ``plans`` to ``faulty``: the others go on."""
        deadline = self._monotonic() + opts.timeout_s
        started = self._monotonic()
        reset = not opts.skip_reset
        while True:
            busy = self._check_idle(plans, by_index, faulty, reset=reset)
            if not busy:
                return True
            if not opts.drain:
                raise self._busy_error(busy, by_index, None)
            if self._monotonic() >= deadline:
                raise self._busy_error(busy, by_index, self._monotonic() - started)
            if not wanted():
                return False
            log.info(
                "draining MIG instances: waiting for %s",
                "; ".join(self._busy_parts(busy, by_index)[2]),
            )
            self._sleep(min(self._drain_poll_s, max(0.0, deadline - self._monotonic())))

    def _check_idle(
        self,
        plans: dict[int, tuple[GpuActual, GpuPlan]],
        by_index: dict[int, GpuIdentity],
        faulty: dict[int, str],
        *,
        reset: bool,
    ) -> dict[int, list[tuple[str, Holder]]]:
        """One round of an apply's busy checks: the processes on what each plan disturbs, by
        GPU. A GPU found faulty (lost, hung, or its processes cannot be listed) is moved from
        ``plans`` to ``faulty``: it is left alone and the others go on. The process lists
        are reads: each GPU's is waited for as its plan was (:meth:`_bounded`), so a GPU
        that hangs after its plan was read holds neither the apply nor the other GPUs."""
        busy = {}
        todo = dict(plans)  # what the reads use, while ``plans`` loses the faulty GPUs
        reserved = self._reserved_now()

        def listed(gpu: GpuIdentity) -> list[tuple[str, Holder]] | str:
            actual, plan = todo[gpu.index]
            found = self._busy_or_unlisted(gpu, actual, plan, reset=reset, reserved=reserved)
            return found if isinstance(found, str) else found[1]

        answers = self._bounded(
            [by_index[i] for i in sorted(todo)],
            listed,
            self._read_timeout_s,
            "busy",
            wait="each_call",
        )
        for i, b in sorted(answers.items()):
            if isinstance(b, GPU_FAULTS):  # lost, hung, or found so meanwhile: not waited for
                log.warning("GPU %d turned faulty while checking for processes: %s", i, b)
                faulty[i] = _fault_reason(b)
                del plans[i]
            elif isinstance(b, Exception):
                raise b
            elif isinstance(b, str):  # not waited on: listing again would not help
                log.warning("GPU %d left alone: %s", i, b)
                faulty[i] = b
                del plans[i]
            elif b:
                busy[i] = b
        return busy

    def _converge(
        self,
        gpu: GpuIdentity,
        layout: DeviceLayout,
        *,
        force: bool,
        reset: bool,
        read_timeout_s: float,
        retry: bool = False,
        wait: ReadWait = "in_all",
    ) -> GpuOutcome:
        """Run the plan for one GPU, re-planning after a MIG mode change took effect; with
        ``reset``, a mode change pending a GPU reset is finished by resetting the GPU.
        ``retry``: reconcile's, on a later tick, of an apply that failed or was cut off (see
        :meth:`_busy_read` for one that was forced).

        Each round reads the driver first, so a step that already took effect (before a
        crash, say) is never repeated. Those reads, and the process listing of the busy
        check, are waited for as :meth:`_bounded` waits (``read_timeout_s``, or until
        telemetry finds the GPU hung): a GPU that hangs then is ``faulty`` without a step
        run. The steps themselves (``nvidia-smi mig -cgi/-dci/-dgi``, ``-mig``, a reset)
        are waited for however long the driver takes: one given up on could not be told
        apart from one not made, and the next round would plan on a guess.
        """
        done: list[str] = []
        where = f"GPU {gpu.index}{_product(gpu)}"

        def faulty(err: BackendError) -> GpuOutcome:
            log.warning("MIG step failed on GPU %d: %s", gpu.index, err)
            detail = f"{where} is faulty: {_fault_reason(err)}"
            return GpuOutcome(gpu.index, gpu.uuid, tuple(done), False, "faulty", detail)

        for _ in range(4):
            try:
                # the driver is read again each round: the GPU may have been lost meanwhile
                actual, plan = self._read(
                    gpu,
                    lambda g: self._plan(g, layout, self._table(g)),
                    read_timeout_s,
                    "plan",
                    wait=_begun(wait, done),
                )
            except GPU_FAULTS as err:
                return faulty(err)
            except InvalidArgument as err:
                return GpuOutcome(gpu.index, gpu.uuid, tuple(done), False, "failed", str(err))
            if not plan.steps and not plan.reset_pending:
                return GpuOutcome(
                    gpu.index, gpu.uuid, tuple(done), False, "changed" if done else "ok"
                )
            try:
                found = self._busy_read(
                    gpu,
                    actual,
                    plan,
                    reset,
                    read_timeout_s,
                    force=force,
                    retry=retry,
                    wait=_begun(wait, done),
                )
            except GPU_FAULTS as err:
                return faulty(err)
            except StateError as err:  # the jobs' reservations: the database, not the GPU
                return GpuOutcome(
                    gpu.index, gpu.uuid, tuple(done), False, "failed", f"{where}: {err}"
                )
            if isinstance(found, str):
                detail = f"{where} is faulty, left alone: {found}"
                return GpuOutcome(gpu.index, gpu.uuid, tuple(done), False, "faulty", detail)
            doomed, busy = found
            if busy and force:
                _, _, parts = self._busy_parts({gpu.index: busy}, {gpu.index: gpu})
                detail = (
                    f"{'; '.join(parts)}: the forced apply waits for"
                    f" {'it' if len(parts) == 1 else 'them'} to leave what it destroys; the"
                    " MPS control daemons there are left running until then (reconcile tries"
                    " again)"
                )
                return GpuOutcome(gpu.index, gpu.uuid, tuple(done), False, "busy", detail)
            if busy:
                refusal = self._busy_error({gpu.index: busy}, {gpu.index: gpu}, None)
                return GpuOutcome(gpu.index, gpu.uuid, tuple(done), False, "busy", str(refusal))
            release = self._release or (lambda uuids: contextlib.nullcontext({}))
            held = [md.uuid for md in doomed]
            if _enables_mig(gpu, actual, plan, reset=reset) and self._releasing():
                held.append(gpu.uuid)  # its whole-GPU daemon would keep MIG off
            with release(held) as stuck:
                if stuck:
                    under = (
                        "MIG mode is not enabled under it"
                        if gpu.uuid in stuck
                        else "its instance is not destroyed under it"
                    )
                    detail = (
                        f"{where}: {'; '.join(stuck.values())}: {under} and no step is taken"
                        " on the GPU (reconcile tries again; a GPU reset or a reboot ends a"
                        " daemon stuck in the driver)"
                    )
                    return GpuOutcome(gpu.index, gpu.uuid, tuple(done), False, "failed", detail)
                try:
                    pending = (
                        self._run(gpu, plan, done, actual.mode.current) if plan.steps else True
                    )
                    if pending and reset:
                        pending = not self._reset(gpu, done)
                except GPU_FAULTS as err:
                    return faulty(err)
                except GpudError as err:
                    log.warning("MIG step failed on GPU %d: %s", gpu.index, err)
                    return GpuOutcome(
                        gpu.index, gpu.uuid, tuple(done), False, "failed", f"{where}: {err}"
                    )
            if pending:
                return GpuOutcome(
                    gpu.index, gpu.uuid, tuple(done), True, "reset_pending", _pending(where)
                )
        return GpuOutcome(
            gpu.index, gpu.uuid, tuple(done), False, "failed", f"GPU {gpu.index}: did not converge"
        )

    def _busy_read(
        self,
        gpu: GpuIdentity,
        actual: GpuActual,
        plan: GpuPlan,
        reset: bool,
        timeout_s: float,
        *,
        force: bool,
        retry: bool = False,
        wait: ReadWait = "in_all",
    ) -> tuple[list[MigDeviceIdentity], list[tuple[str, Holder]]] | str:
        """:meth:`_busy_or_unlisted`, waited for as :meth:`_bounded` waits. ``force``: no
        process is listed (none is in the way), and what the steps destroy is read only
        where their MPS daemons are to be stopped first (:meth:`_releasing`).

        A forced apply's ``retry`` (reconcile's, every tick) where MPS daemons are stopped
        first lists the processes all the same: while some run on what the steps destroy
        (the driver would refuse again), it answers them and no daemon is stopped, rather
        than stopping a job's daemon on every tick for a refusal and starting it again
        after. Where they cannot be listed it goes on as forced. What it waits for is what
        :meth:`_busy` lists: for a plan that changes the MIG mode now or resets the GPU,
        every process on the GPU, so the retry waits while any job runs anywhere on it
        (the change stops them all; stopping every MPS daemon of the GPU on every tick
        would disturb each of them)."""
        releasing = self._releasing()
        if not force or (retry and releasing):
            reserved = self._reserved_now()
            found = self._read(
                gpu,
                lambda g: self._busy_or_unlisted(g, actual, plan, reset=reset, reserved=reserved),
                timeout_s,
                "busy",
                wait=wait,
            )
            if not force or not isinstance(found, str):
                return found
        if not releasing:
            return [], []
        doomed, _ = self._read(
            gpu,
            lambda g: self._doomed(g, actual, plan, reset=reset),
            timeout_s,
            "doomed",
            wait=wait,
        )
        return doomed, []

    def _releasing(self) -> bool:
        """Whether MPS control daemons are stopped before a GPU's steps (MPS on)."""
        if self._release is None:
            return False
        return self._release_active is None or self._release_active()

    def _reset(self, gpu: GpuIdentity, done: list[str]) -> bool:
        """Reset the GPU so that its pending MIG mode becomes current; False when the
        backend cannot reset. The driver refuses while processes run on the GPU."""
        quiet = self._quiesce() if self._quiesce is not None else contextlib.nullcontext()
        try:
            with quiet:
                self._backend.reset_gpu(gpu.index)
        except NotSupported as err:
            log.info("GPU %d: cannot reset (%s); MIG mode change left pending", gpu.index, err)
            return False
        done.append(reset_step(gpu.index))
        self._events.emit(
            "mig.reset",
            f"GPU {gpu.index}: reset to make its pending MIG mode current",
            gpu=gpu.index,
            uuid=gpu.uuid,
        )
        if self._on_reset is not None:
            self._on_reset(gpu.index)
        self._changed(gpu.index)
        return True

    def _run(self, gpu: GpuIdentity, plan: GpuPlan, done: list[str], mig_on: bool) -> bool:
        """Run steps until the plan ends or a MIG mode change waits for a reset (returns True)."""
        for step in plan.steps:
            if isinstance(step, CreateGpuInstance | CreateComputeInstance) and not mig_on:
                return True  # instances wait for the MIG mode change to take effect
            if isinstance(step, SetMigMode):
                mode = self._backend.set_mig_mode(step.gpu, step.enabled)
                done.append(step.describe())
                self._changed(gpu.index)
                self._mark(gpu.index)
                # Pending until a reset, or taken effect: then re-plan from what the driver has.
                return mode.current != step.enabled
            self._do(step)
            done.append(step.describe())
            self._changed(gpu.index)
            self._mark(gpu.index)
        return False

    def _changed(self, gpu: int) -> None:
        self._changes[gpu] = self._changes.get(gpu, 0) + 1
        # an instance of a profile that had none may now list its compute instance profiles
        for uuid, (table, _) in list(self._partial.items()):
            if table.identity.index == gpu:
                self._partial.pop(uuid, None)
        self.refresh_view()
        if self._on_change is not None:
            self._on_change(gpu)

    def _mark(self, gpu: int) -> None:
        """Count a step that took effect on GPU ``gpu``. Its record in the store is only a
        progress count (recovery re-reads the GPU from the driver): one refused (another
        process's lock, a full disk) fails neither the step nor the apply."""
        self.steps_taken += 1
        try:
            self._store.step_done()
        except StateError as err:
            log.warning("MIG step on GPU %d took effect; its progress not recorded: %s", gpu, err)

    def _do(self, step: Step) -> None:
        b = self._backend
        if isinstance(step, DestroyComputeInstance):
            b.destroy_compute_instance(step.gpu, step.gpu_instance_id, step.compute_instance_id)
        elif isinstance(step, DestroyGpuInstance):
            b.destroy_gpu_instance(step.gpu, step.gpu_instance_id)
        elif isinstance(step, CreateGpuInstance):
            b.create_gpu_instance(step.gpu, step.profile_id, step.placement)
        elif isinstance(step, CreateComputeInstance):
            gi = self._gi_at(step)
            b.create_compute_instance(step.gpu, gi.id, step.profile_id)
        else:  # SetMigMode is handled by _run
            raise AssertionError(step)

    def _gi_at(self, step: CreateComputeInstance) -> GpuInstanceInfo:
        for gi in self._backend.gpu_instances(step.gpu):
            if (
                gi.profile_id == step.gpu_instance_profile_id
                and gi.placement == step.gpu_instance_placement
            ):
                return gi
        raise NotFound(
            f"GPU {step.gpu}: no GPU instance at placement {step.gpu_instance_placement}"
        )

    # ---------------------------------------------------------------- assert / reconcile

    def assert_config(self, config: MigConfigFile, name: str) -> list[str]:
        """Differences between the healthy GPUs and config ``name`` (empty: they match)."""
        return self.check(config, name)[0]

    def check(
        self, config: MigConfigFile, name: str, *, timeout_s: float | None = None
    ) -> tuple[list[str], dict[int, str]]:
        """Differences between the GPUs and config ``name``, and the GPUs the config names
        that could not be checked (faulty: index -> reason). Each GPU is read as an apply
        reads its plan (:meth:`_bounded`, within ``timeout_s``, by default
        ``read_timeout_s``): a GPU that hangs before telemetry notices is not checked, as
        not answering, and the others are."""
        ids, faults = self._gpus()
        layouts = config.layouts(name, ids, faults=faults)
        # a GPU never read may or may not be one the config's device filters name: faulty
        faulty = {i: faults[i] for i in [*layouts, *config.unjudged(name, ids)] if i in faults}
        healthy = [ids[i] for i in sorted(layouts) if i not in faulty]
        wait_s = self._read_timeout_s if timeout_s is None else timeout_s
        answered = self._bounded(
            healthy, lambda g: self._differences({g: layouts[g.index]}), wait_s, "assert"
        )
        diffs = _answers(healthy, answered, faulty, config.where(name))
        diff = [line for i in sorted(diffs) for line in diffs[i]]
        return diff, dict(sorted(faulty.items()))

    def _differences(self, layouts: dict[GpuIdentity, DeviceLayout]) -> list[str]:
        out = []
        for gpu, layout in sorted(layouts.items(), key=lambda kv: kv[0].index):
            table = self._table(gpu)
            actual, plan = self._plan(gpu, layout, table)
            if not plan.empty:
                out.append(f"{describe_difference(actual, layout, table, plan)} [{gpu.product}]")
        return out

    # How often reconcile re-reads every GPU's instances for `latest_view` (metrics) when
    # nothing changed: a full `show` is dozens of driver calls per GPU, too many for every
    # tick. Live per-device memory is in the telemetry metrics (gpud_mig_device_*).
    VIEW_REFRESH_S = 10.0
    # Bounds the view's driver reads, so that a GPU that hangs before telemetry notices it
    # cannot hold the reconcile step (and the watchdog behind it) for long.
    VIEW_TIMEOUT_S = 2.0
    # How often a GPU shown faulty in the view (telemetry found it so, or its read failed)
    # that answers now is read again on its own between refreshes: a GPU whose health flaps
    # costs no more than this.
    VIEW_REREAD_S = 5.0
    # How often a read waiting for a GPU (_bounded) looks whether telemetry found it hung: a
    # small part of a telemetry tick (1 s by default), the snapshot read costs microseconds.
    FAULT_POLL_S = 0.05

    def refresh_view(self) -> None:
        """Have the next :meth:`reconcile` re-read every GPU's instances for the view."""
        self._view_at = float("-inf")

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a running apply to end; False if it still runs."""
        if not self._lock.acquire(timeout=timeout_s):
            return False
        self._lock.release()
        return True

    def reconcile_unless_busy(self, mode: ReconcileMode = "reconcile") -> list[GpuOutcome] | None:
        """:meth:`reconcile`, or None at once while an apply holds the GPUs: an apply can
        run for minutes (a drain waits up to its timeout), and the daemon's loop, its
        watchdog and its stop must not wait for it. The apply converges the GPUs itself."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self.reconcile(mode)
        finally:
            self._lock.release()

    def reconcile(self, mode: ReconcileMode = "reconcile") -> list[GpuOutcome]:
        """Bring every managed GPU to its desired layout (``"reconcile"``), or only report how
        it differs (``"report"``). Call at start and on every tick; cheap when nothing differs.

        Faulty GPUs (unhealthy in the last telemetry sample: lost, or hung in the driver; or
        failing now) are not touched; they are reported ``faulty`` until they answer. A MIG
        mode change pending a reset is finished by a reset only when an interrupted apply
        asked for it.

        Instances with running processes are not destroyed, unless an interrupted apply was
        started with ``force``; such a GPU is reported ``busy`` and retried next time.

        ``"report"`` changes nothing, an interrupted (or failed) apply included: that is
        reported instead (:meth:`unfinished`, a ``mig.unfinished`` event).
        """
        began = self._monotonic()
        with self._lock:
            inflight = self._store.inflight()
            desired = self._store.desired()
            all_ids, faults = self._gpus()
            ids = {g.uuid: g for g in all_ids if g.uuid}
            checked = self._check_bounded(
                [
                    (ids[u], r.layout)
                    for u, r in desired.items()
                    if u in ids and ids[u].index not in faults
                ]
            )
            if (
                inflight is not None
                and mode == "reconcile"  # report changes nothing, the store included
                and _nothing_to_resume(inflight, desired, ids, faults, checked)
            ):
                # written by an earlier gpud for an apply that had nothing to do
                self._store.finish_apply()
                log.info(
                    "dropped the in-flight apply of %s: it has no step and no GPU reset is"
                    " pending, so there is nothing to resume",
                    inflight.config_name,
                )
                inflight = None
            force = inflight is not None and inflight.options.force
            reset = inflight is not None and not inflight.options.skip_reset
            self._note_unfinished(inflight if mode == "report" else None)
            if inflight is not None and mode == "reconcile" and "inflight" not in self._last_report:
                done = f"{inflight.steps_done}/{len(inflight.steps)} steps were done"
                if self._failed_apply == inflight.config_name:
                    self._events.emit(
                        "mig.retry",
                        f"retrying the failed apply of {inflight.config_name} on every tick "
                        f"until it converges or another layout is applied ({done})",
                        config=inflight.config_name,
                    )
                else:
                    self._events.emit(
                        "mig.resume",
                        f"resuming the interrupted apply of {inflight.config_name} ({done})",
                        config=inflight.config_name,
                    )
                self._last_report["inflight"] = inflight.config_name
            outcomes: list[GpuOutcome] = []
            newest = _newest_unread(desired.values(), ids)
            unread = self._unread(all_ids, faults, {r.gpu_index for r in desired.values()})
            for uuid, record in sorted(desired.items(), key=lambda kv: kv[1].gpu_index):
                gpu = ids.get(uuid)
                i = record.gpu_index
                if gpu is None and i in unread:
                    # Lost before its identity was ever read: most likely the GPU its index's
                    # newest record names. An older one there is likely of a GPU replaced
                    # since, but with no UUID read at that index nothing says so: it is left
                    # alone too (not "missing", no layout_matches 0), and neither is acted on.
                    reason = unread[i]
                    if newest[i].gpu_uuid != uuid:
                        reason += (
                            f"; its UUID never read, it is most likely {newest[i].gpu_uuid}"
                            f" (recorded there last), not {uuid}"
                        )
                    outcomes.append(_left_alone(i, uuid, f"GPU {i}", reason))
                    continue
                if gpu is None:
                    outcomes.append(
                        GpuOutcome(
                            record.gpu_index,
                            uuid,
                            (),
                            False,
                            "missing",
                            f"GPU {uuid} is not present",
                        )
                    )
                    continue
                name = f"GPU {gpu.index}{_product(gpu)}"
                if gpu.index in faults:
                    outcomes.append(_left_alone(gpu.index, uuid, name, faults[gpu.index]))
                    continue
                plan = checked[gpu.index]
                if isinstance(plan, _GivenUp):  # hung: not waited for, not called again
                    outcomes.append(_left_alone(gpu.index, uuid, name, str(plan)))
                elif isinstance(plan, GpuPlan) and plan.empty:
                    outcomes.append(GpuOutcome(gpu.index, uuid, (), False, "ok"))
                else:  # differs, or the check failed: the same calls again, for the outcome
                    outcomes.append(self._reconcile_gpu(gpu, record, mode, force, reset))
            for o in outcomes:
                self._report(o)
            converged = all(
                o.status in ("ok", "changed", "reset_pending", "missing") for o in outcomes
            )
            if inflight is not None and mode == "reconcile" and converged:
                self._store.finish_apply()
                self._last_report.pop("inflight", None)
                if self._failed_apply == inflight.config_name:
                    # this process's apply, counted as failed when it ended: not again
                    self._failed_apply = None
                    self._events.emit(
                        "mig.apply",
                        f"apply {inflight.config_name}: finished by the reconcile step's"
                        " retries after it failed",
                        config=inflight.config_name,
                        result="retried",
                    )
                else:
                    self._events.emit(
                        "mig.apply",
                        f"apply {inflight.config_name}: finished after a restart",
                        config=inflight.config_name,
                        result="resumed",
                    )
                    # counted as an apply of its own (the one cut off was never counted);
                    # its duration is this start's part of it
                    self.stats.record("resumed", self._monotonic() - began)
            self._outcomes = outcomes
            self._refresh_view(self._monotonic())
            return outcomes

    def unfinished(self) -> str | None:
        """With ``mig.on_start = "report"``: the apply a gpud stop or crash (or a failure)
        left unfinished, which reconcile does not resume, and the command that finishes it;
        None when there is none (or reconcile resumes it)."""
        return self._unfinished

    def _note_unfinished(self, inflight: InflightRecord | None) -> None:
        """Report an in-flight apply that reconcile leaves alone ("report" mode): a warning
        and a ``mig.unfinished`` event once, :meth:`unfinished` while it lasts."""
        note = None
        if inflight is not None:
            o = inflight.options
            flags = "".join(
                f" {flag}"
                for flag, on in (
                    ("--drain", o.drain),
                    ("--force", o.force),
                    ("--skip-reset", o.skip_reset),
                )
                if on
            )
            how = "failed" if self._failed_apply == inflight.config_name else "was interrupted"
            note = (
                f"the apply of {inflight.config_name} {how} after {inflight.steps_done} of "
                f'{len(inflight.steps)} steps and is left unfinished: mig.on_start = "report" '
                "changes no MIG layout; finish it with `gpuctl mig apply -f FILE "
                f"-c {inflight.config_name}{flags}` (FILE: the layout file it came from), or "
                'set mig.on_start = "reconcile" and restart gpud'
            )
            if note != self._unfinished:
                self._events.emit(
                    "mig.unfinished",
                    note,
                    config=inflight.config_name,
                    steps_done=inflight.steps_done,
                    steps=len(inflight.steps),
                )
        self._unfinished = note

    def latest_view(self) -> list[GpuView]:
        """What the last reconcile saw (read now if there was none, as :meth:`show` reads:
        a scrape before the first reconcile, or after its read failed, must not hang on a
        GPU telemetry has not found hung yet): for metrics."""
        view = self._view
        return view if view is not None else self.show()

    def last_outcomes(self) -> list[GpuOutcome]:
        """The managed GPUs' statuses from the last reconcile."""
        return list(self._outcomes)

    def _reconcile_gpu(
        self,
        gpu: GpuIdentity,
        record: DesiredRecord,
        mode: ReconcileMode,
        force: bool,
        reset: bool,
    ) -> GpuOutcome:
        try:
            if mode == "report":
                diff = self._read(
                    gpu,
                    lambda g: self._differences({g: record.layout}),
                    self.VIEW_TIMEOUT_S,
                    "check",
                )
                if diff:
                    return GpuOutcome(gpu.index, gpu.uuid, (), False, "differs", diff[0])
                return GpuOutcome(gpu.index, gpu.uuid, (), False, "ok")
            # held as an apply holds it: a run placed between the busy check and a destroy
            # step would be given an instance the driver no longer has
            why = f"a MIG reconcile to {record.config_name} is changing its instances"
            with self._holding({gpu.index: why}):
                return self._converge(
                    gpu,
                    record.layout,
                    force=force,
                    reset=reset,
                    read_timeout_s=self.VIEW_TIMEOUT_S,
                    retry=True,
                )
        except GPU_FAULTS as err:
            return GpuOutcome(
                gpu.index,
                gpu.uuid,
                (),
                False,
                "faulty",
                f"GPU {gpu.index}{_product(gpu)} is faulty: {_fault_reason(err)}",
            )
        except GpudError as err:
            return GpuOutcome(
                gpu.index, gpu.uuid, (), False, "failed", f"GPU {gpu.index} ({gpu.product}): {err}"
            )

    @contextlib.contextmanager
    def _holding(self, gpus: Mapping[int, str]) -> Iterator[None]:
        """Placement held off ``gpus`` (index -> why) while the context lasts, where
        ``hold_placement`` was given. Where the driver changed one of them meanwhile, the
        GPUs are read again (``after_change``) before the hold ends: placement reopens on
        the instances the driver has now, never on one just destroyed (the sampler would
        read them only at its next tick). One that raises is logged: the change was made."""
        before = {i: self._changes.get(i, 0) for i in gpus}
        hold = self._hold_placement(gpus) if self._hold_placement is not None else None
        with hold if hold is not None else contextlib.nullcontext():
            try:
                yield
            finally:
                changed = [i for i, n in before.items() if self._changes.get(i, 0) != n]
                if changed and self._after_change is not None:
                    try:
                        self._after_change()
                    except Exception:
                        log.exception(
                            "reading the GPUs again after GPU %s changed failed (%s)",
                            ", ".join(map(str, changed)),
                            "; ".join(gpus[i] for i in changed),
                        )

    def _report(self, o: GpuOutcome) -> None:
        """One event per change of a GPU's reconcile status (not one per tick)."""
        key = f"{o.uuid}:{o.status}:{o.detail}"
        if o.status == "changed":
            self._events.emit(
                "mig.reconcile",
                f"GPU {o.gpu}: reconciled to its desired layout",
                gpu=o.gpu,
                uuid=o.uuid,
                steps=list(o.steps),
            )
        elif o.status != "ok" and self._last_report.get(o.uuid) != key:
            # a detail that names the GPU already says it all ("GPU 1 ... is faulty: ...")
            named = o.detail.startswith((f"GPU {o.gpu} ", f"GPU {o.gpu}:"))
            self._events.emit(
                "mig.drift",
                o.detail if named else f"GPU {o.gpu}: {o.status}: {o.detail}",
                gpu=o.gpu,
                uuid=o.uuid,
                status=o.status,
            )
        self._last_report[o.uuid] = key

    # ---------------------------------------------------------------- show / export

    def desired(self) -> dict[str, DesiredRecord]:
        return self._store.desired()

    def forget(self, uuid: str, *, gone: bool = False) -> DesiredRecord:
        """Drop the desired layout recorded under ``uuid``, of a GPU no longer present (a
        board replaced or removed: ``nvidia-smi -L`` lists no such UUID): reconcile stops
        reporting it ``missing`` and its ``gpud_mig_layout_matches`` goes at once. Nothing
        is asked of the driver beyond the GPUs' identities; the record is returned.

        :class:`NotFound` where no layout is recorded under ``uuid``;
        :class:`FailedPrecondition` while an apply or a reconcile step runs (it may record
        one; forget never waits for it), where a GPU read now has that UUID, naming its
        index, or where no UUID is read at the record's index that says which GPU is there
        (a GPU lost since before gpud started, or gone from the bus: the driver counts no GPU
        at an index where one was known): it may be that very GPU, so its layout is kept
        until it answers. ``gone``: the operator says the board gone from the bus is removed
        for good, so its record is dropped; only where the driver counts no GPU at its index
        (a GPU merely lost at an index it still counts is refused: it may answer again), and
        while every GPU the driver counts has a UUID read (NVML numbers GPUs in PCI order: a
        board moves down an index once one below it is removed, so an unread GPU may be it).

        The lock is waited for up to ``FORGET_WAIT_S`` (a reconcile step holds it for
        milliseconds each tick), never for an apply: one marks itself in ``_applying``
        before it waits for the lock, and that is checked again once the lock is held."""
        self._refuse_while_applying(uuid)
        if not self._lock.acquire(timeout=FORGET_WAIT_S):
            # An apply holds the lock for minutes (a drain waits up to its timeout): waiting
            # for it would outlast gpuctl's deadline, then drop what the apply just recorded.
            raise FailedPrecondition(
                f"busy: an apply, a dry run or a reconcile runs: forget {uuid} once it ends"
                " (gpuctl mig show)"
            )
        try:
            # an apply that marked itself after the check above waits for the lock: refused
            # the same, not raced
            self._refuse_while_applying(uuid)
            record = self._store.desired().get(uuid)
            if record is None:
                raise NotFound(f"no MIG layout is recorded for {uuid} (gpuctl mig show)")
            ids, faults = self._gpus()
            present = next((g for g in ids if g.uuid == uuid), None)
            if present is not None:
                raise FailedPrecondition(
                    f"{uuid} is GPU {present.index}{_product(present)}, present now: its"
                    " layout is managed (apply another config to change it)"
                )
            i = record.gpu_index
            beyond = i >= len(ids)
            if gone and not beyond:
                raise FailedPrecondition(
                    f"--gone: the driver counts GPU {i} ({len(ids)} GPU(s)): it is not gone from"
                    f" the bus; forget {uuid} without --gone (refused while the GPU there is"
                    " faulty: it may be that GPU and answer again)"
                )
            if gone:
                self._refuse_gone_while_unread(uuid, ids, faults)
            why = None if gone else self._unread(ids, faults, [i]).get(i)
            if why is not None:
                hint = (
                    "if the board is removed for good, forget it with --gone"
                    if beyond
                    else f"forget it once another GPU answers at index {i}"
                )
                raise FailedPrecondition(
                    f"GPU {i} is faulty ({why}), its UUID not read since gpud started: the layout"
                    f" recorded for {uuid} there is kept until it answers; {hint}"
                )
            self._store.forget([uuid])
            self._outcomes = [o for o in self._outcomes if o.uuid != uuid]
            self._events.emit(
                "mig.forgotten",
                f"forgot the MIG layout of {record.config_name} recorded for {uuid}"
                f" (GPU {record.gpu_index} then), a GPU not present"
                + (" (gone from the bus, removed for good)" if gone else ""),
                gpu=record.gpu_index,
                uuid=uuid,
                config=record.config_name,
                gone=gone,
            )
            return record
        finally:
            self._lock.release()

    def _refuse_gone_while_unread(
        self, uuid: str, ids: Sequence[GpuIdentity], faults: Mapping[int, str]
    ) -> None:
        """Refuse ``forget --gone`` of ``uuid`` while a GPU the driver counts has no UUID
        read (by this manager or telemetry): NVML numbers GPUs in PCI order, so a board
        at a higher index moves down once one below it is removed, and that unread GPU
        may be this very board, still on the bus."""
        unread = self._unread(ids, faults, range(len(ids)))
        if not unread:
            return
        first, *others = sorted(unread)
        also = f"; also unread: GPU {', '.join(map(str, others))}" if others else ""
        raise FailedPrecondition(
            f"GPU {first} is faulty and unread: it may be this board at a new index;"
            f" forget --gone once it answers ({unread[first]}{also}); the layout recorded"
            f" for {uuid} is kept"
        )

    def _refuse_while_applying(self, uuid: str) -> None:
        with self._applying_lock:
            if self._applying is not None:
                raise FailedPrecondition(
                    f"an apply of {self._applying[0]} is in flight: forget {uuid} once it"
                    " ends (gpuctl mig show)"
                )

    def layouts(self) -> tuple[dict[int, DeviceLayout], dict[int, str]]:
        """The current layout of every GPU that answers, in mig-parted's terms, and why the
        others are left out: faulty before the call, its reads failing now, or no answer
        within ``VIEW_TIMEOUT_S`` (each GPU is read as :meth:`show` reads it)."""
        ids, faults = self._gpus()
        healthy = [g for g in ids if g.index not in faults]

        def read(gpu: GpuIdentity) -> DeviceLayout:
            return actual_layout(self._actual(gpu), self._table(gpu) if gpu.mig_capable else None)

        answered = self._bounded(healthy, read, self.VIEW_TIMEOUT_S, "export")
        out = {}
        for gpu in healthy:
            got = answered[gpu.index]
            if isinstance(got, BackendError):  # _GivenUp included: not waited for
                faults[gpu.index] = _fault_reason(got)
            elif isinstance(got, Exception):  # a bug: named on that GPU, logged
                log.error("reading GPU %d for mig export failed", gpu.index, exc_info=got)
                faults[gpu.index] = f"internal error: {got}"
            else:
                out[gpu.index] = got
        return out, faults

    def export(self, name: str = "current") -> tuple[str, dict[int, str]]:
        """The current layout as a mig-parted config named ``name``, of the GPUs that
        answer (by index, never ``devices: all`` while one is left out), and the GPUs left
        out with why; the YAML names them in comments, for whoever reads the file later."""
        layouts, faults = self.layouts()
        text = export_config(name, layouts, gpu_count=self._backend.gpu_count())
        notes = "".join(f"# GPU {i} left out: {why}\n" for i, why in sorted(faults.items()))
        return notes + text, faults

    def show(self, *, timeout_s: float | None = None) -> list[GpuView]:
        """Every GPU: MIG mode, instances with MIG UUIDs and processes, profiles and
        placements; a faulty GPU with its reason instead (:attr:`GpuView.fault`).

        Each GPU is read on a thread of its own and a GPU that has not answered within
        ``timeout_s`` (by default ``read_timeout_s``), or that telemetry finds hung before
        then, is shown as not answering (:meth:`_bounded`): a driver call that hangs delays
        the answer by no more than that, and that GPU gets no new call until the stuck one
        returns."""
        ids, faults = self._gpus()
        desired = self._store.desired()
        healthy = [g for g in ids if g.index not in faults]
        # one never read since gpud started has no UUID: its layout is the record of the
        # UUID an earlier run read there, else its index's newest record's (the one
        # reconcile brings it to once it answers, and an apply replaces)
        unread = _unread_records(desired, {g.uuid for g in ids if g.uuid}, self._last_seen())
        views = {
            i: faulty_view(
                ids[i],
                desired.get(ids[i].uuid) if ids[i].uuid else unread.get(i),
                reason,
            )
            for i, reason in faults.items()
        }
        wait_s = self._read_timeout_s if timeout_s is None else timeout_s
        views.update(self._read_views(healthy, desired, wait_s))
        return [views[i] for i in sorted(views)]

    def _read_views(
        self, gpus: list[GpuIdentity], desired: Mapping[str, DesiredRecord], wait_s: float
    ) -> Iterator[tuple[int, GpuView]]:
        """:meth:`show`'s reads of ``gpus``, each GPU's view by its index."""

        def read(gpu: GpuIdentity) -> GpuView:
            try:
                return gpu_view(
                    self._backend, gpu, self._table(gpu), desired.get(gpu.uuid), self._jobs
                )
            except BackendError as err:
                return faulty_view(gpu, desired.get(gpu.uuid), _fault_reason(err))

        return self._read_bounded(gpus, read, wait_s, desired)

    def _refresh_view(self, now: float) -> None:
        """Keep :meth:`latest_view` the driver's state without a full :meth:`show` per
        reconcile: every ``VIEW_REFRESH_S`` every GPU is read again. Between, a GPU
        telemetry finds faulty gets its fault in place of what was read (no driver call: its
        instances and reset state, read before, are no state of it now), and one shown faulty
        (so found, or its read failed) that answers now is read again, alone, at most every
        ``VIEW_REREAD_S`` (a GPU whose health flaps would have every GPU read, dozens of
        driver calls each, at every reconcile)."""
        faulty = self._faulty_now()
        if self._view is None or now - self._view_at >= self.VIEW_REFRESH_S:
            try:
                self._view = self.show(timeout_s=self.VIEW_TIMEOUT_S)
                self._view_at = now
            except GpudError as err:
                log.warning("cannot read MIG instances: %s", err)
                self._view_at = now  # retried at the next refresh, not every tick
            return
        views = {v.identity.index: v for v in self._view}
        for i, reason in faulty.items():
            v = views.get(i)
            if v is not None and v.fault != reason:
                views[i] = faulty_view(v.identity, v.desired, reason)
        # shown faulty (as telemetry found it, or as its read failed) but answering now
        due = [
            v.identity
            for i, v in sorted(views.items())
            if v.fault
            and i not in faulty
            and now - self._reread_at.get(i, float("-inf")) >= self.VIEW_REREAD_S
        ]
        if due:
            for gpu in due:
                self._reread_at[gpu.index] = now
            try:
                desired = self._store.desired()
                for i, view in self._read_views(due, desired, self.VIEW_TIMEOUT_S):
                    views[i] = view
            except GpudError as err:
                log.warning("cannot read MIG instances: %s", err)
        self._view = [views[i] for i in sorted(views)]

    def _plan_bounded(
        self, gpus: list[GpuIdentity], layouts: Mapping[int, DeviceLayout]
    ) -> dict[int, tuple[GpuActual, GpuPlan] | Exception]:
        """Each GPU's plan for an apply, waited for as :meth:`_bounded` waits, within
        ``read_timeout_s``: a GPU that hangs before telemetry notices must not hold the
        apply (and every other GPU behind it)."""

        def plan(gpu: GpuIdentity) -> tuple[GpuActual, GpuPlan]:
            return self._plan(gpu, layouts[gpu.index], self._table(gpu))

        return self._bounded(gpus, plan, self._read_timeout_s, "plan", wait="each_call")

    def _check_bounded(
        self, layouts: list[tuple[GpuIdentity, DeviceLayout]]
    ) -> dict[int, GpuPlan | Exception]:
        """Each GPU's plan toward its layout, waited for as :meth:`_bounded` waits, within
        ``VIEW_TIMEOUT_S``: a GPU that hangs before telemetry notices must not hold the
        reconcile step, and the daemon's other steps and watchdog behind it."""
        by_index = {gpu.index: layout for gpu, layout in layouts}

        def plan(gpu: GpuIdentity) -> GpuPlan:
            return self._plan(gpu, by_index[gpu.index], self._table(gpu))[1]

        return self._bounded([gpu for gpu, _ in layouts], plan, self.VIEW_TIMEOUT_S, "check")

    def _read(
        self,
        gpu: GpuIdentity,
        call: Callable[[GpuIdentity], T],
        timeout_s: float,
        what: str,
        *,
        wait: ReadWait = "in_all",
    ) -> T:
        """:meth:`_bounded` for one GPU: what ``call(gpu)`` returned, or what it raised, or
        :class:`_GivenUp` when it was not waited for (or not made)."""
        got = self._bounded([gpu], call, timeout_s, what, wait=wait)[gpu.index]
        if isinstance(got, Exception):
            raise got
        return got

    def _bounded(
        self,
        gpus: list[GpuIdentity],
        call: Callable[[GpuIdentity], T],
        timeout_s: float,
        what: str,
        *,
        wait: ReadWait = "in_all",
    ) -> dict[int, T | Exception]:
        """``call(gpu)`` for each GPU on a thread of its own: by GPU index, what it returned
        or raised, or :class:`_GivenUp` (a :class:`DriverTimeout`, with why) for a GPU that
        was not waited for, as ``wait`` says (:data:`ReadWait`), on the manager's
        ``monotonic`` clock (``read_wait``: :data:`ReadAwait`). A GPU is waited for
        ``timeout_s`` in all; with ``each_call`` (an apply's reads), as long as the backend
        answers each of the read's calls on it (one ``nvidia-smi mig -lgi``, ``-lci``,
        process list...) within ``timeout_s`` of the one before, telemetry's measure of a
        hung GPU: a read of many calls, each answered, on a host whose gpud gets little CPU
        is slow, not hung, and given up on mid-apply would leave the GPU's layout half made.
        It is waited for no longer once telemetry finds it faulty (looked at every
        ``FAULT_POLL_S``, its reason given), except ``changing``; a GPU not to be called now
        (:meth:`_faulty_now`; with ``changing``, only one with a read of ours still stuck) is
        not called at all. A call not waited for stays on its own thread, and later calls
        leave its GPU alone until it returns.

        Only for reads (``nvidia-smi mig -lgi``, ``-lci``, the process lists), which change
        nothing in the driver: one that returns late is only a late answer. A change left
        running in the driver could not be told apart from one not made, so an apply's
        steps never run through here."""
        answered: dict[int, T | Exception] = {}
        results: dict[int, T | Exception] = {}
        finished: set[int] = set()  # guarded by _stuck_lock
        done = threading.Condition()
        started = self._monotonic()
        # GPU index -> when the driver last answered a call of its read
        answer_at: dict[int, float] = {}

        def run(gpu: GpuIdentity) -> None:
            result: T | Exception
            self._reading.answered = lambda: answer_at.__setitem__(gpu.index, self._monotonic())
            try:
                result = call(gpu)
            except Exception as err:
                result = err
            with done:
                results[gpu.index] = result
                done.notify_all()
            with self._stuck_lock:
                finished.add(gpu.index)
                self._stuck.discard(gpu.index)

        heeded = self._faults is not None and wait != "changing"
        not_now = self._faulty_now() if heeded else self._stuck_now()
        called = [g for g in gpus if g.index not in not_now]
        for gpu in gpus:
            if gpu.index in not_now:
                answered[gpu.index] = _GivenUp(not_now[gpu.index], gpu=gpu.index)
        for gpu in called:
            # Daemon threads: one stuck in the driver must not keep the daemon from exiting.
            threading.Thread(
                target=run, args=(gpu,), name=f"gpud-mig-{what}-{gpu.index}", daemon=True
            ).start()
        given_up: dict[int, str] = {}  # GPU index -> why it is no longer waited for
        while True:
            telemetry = dict(self._faults()) if self._faults is not None and heeded else {}
            with done:
                now = self._monotonic()
                deadlines = []
                waiting = set()
                for gpu in called:
                    if gpu.index in results or gpu.index in given_up:
                        continue
                    since = answer_at.get(gpu.index, started) if wait != "in_all" else started
                    deadline = since + timeout_s
                    if gpu.index in telemetry:
                        given_up[gpu.index] = telemetry[gpu.index]
                    elif deadline <= now:
                        given_up[gpu.index] = _no_answer(timeout_s)
                    else:
                        deadlines.append(deadline)
                        waiting.add(gpu.index)
                if not deadlines:
                    answered.update(results)
                    break
                left = min(deadlines) - now
                wait_s = min(left, self.FAULT_POLL_S) if heeded else left
                self._read_wait(done, wait_s, frozenset(waiting))
        for gpu in called:
            if gpu.index not in answered:
                answered[gpu.index] = _GivenUp(given_up[gpu.index], gpu=gpu.index)
        with self._stuck_lock:
            self._stuck.update(g.index for g in called if g.index not in finished)
        return answered

    def _read_bounded(
        self,
        gpus: list[GpuIdentity],
        read: Callable[[GpuIdentity], GpuView],
        timeout_s: float,
        desired: Mapping[str, DesiredRecord],
    ) -> Iterator[tuple[int, GpuView]]:
        answered = self._bounded(gpus, read, timeout_s, "show")
        for gpu in gpus:
            view = answered[gpu.index]
            if isinstance(view, _GivenUp):  # hung, or found hung by telemetry meanwhile
                view = faulty_view(gpu, desired.get(gpu.uuid), str(view))
            elif isinstance(view, Exception):  # a bug: shown on that GPU, logged
                log.error("reading GPU %d for mig show failed", gpu.index, exc_info=view)
                view = faulty_view(gpu, desired.get(gpu.uuid), f"internal error: {view}")
            yield gpu.index, view


class _Answering:
    """The backend, each call of which, once the driver answers it (or refuses it), tells
    the bounded read on the calling thread, if any (see :meth:`MigManager._bounded`)."""

    def __init__(self, backend: GpuBackend, reading: threading.local) -> None:
        self._backend = backend
        self._reading = reading

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            finally:
                answered = getattr(self._reading, "answered", None)
                if answered is not None:
                    answered()

        return call


class _GivenUp(DriverTimeout):
    """A read of a GPU that :meth:`MigManager._bounded` did not wait for (no answer in
    time, or telemetry found the GPU faulty meanwhile) or did not make (the GPU is not to
    be called now); the message is why, as the GPU's fault reason."""


def _answers(
    gpus: list[GpuIdentity],
    answered: Mapping[int, T | Exception],
    faulty: dict[int, str],
    where: str,
) -> dict[int, T]:
    """What each GPU's read for an apply or an assert gave (:meth:`MigManager._bounded`),
    by GPU index. A GPU lost, hung or not waited for (:class:`_GivenUp`) goes to ``faulty``
    with why; a layout the GPU cannot take is refused naming ``where`` (the config); any
    other error is raised."""
    out: dict[int, T] = {}
    for gpu in gpus:
        got = answered[gpu.index]
        if isinstance(got, GPU_FAULTS):
            faulty[gpu.index] = _fault_reason(got)
        elif isinstance(got, InvalidArgument):
            raise InvalidArgument(f"{where}: {got}") from got
        elif isinstance(got, Exception):
            raise got
        else:
            out[gpu.index] = got
    return out


def _leaving(held: list[tuple[str, Holder]]) -> str:
    """What a drain waits for on ``held``: "processes to leave", "reservations to be
    released", or both."""
    kinds = {isinstance(h, ReservedBy) for _, h in held}
    if kinds == {True}:
        return "reservations to be released"
    return (
        "processes to leave"
        if kinds == {False}
        else "processes to leave and reservations to be released"
    )


def _where(md: MigDeviceIdentity) -> str:
    """A MIG device as a busy check names it: "1g.10gb GPU instance 7 (MIG-...)"."""
    return f"{md.profile_name} GPU instance {md.gpu_instance_id} ({md.uuid})"


def _places(
    gpu: GpuIdentity, doomed: list[MigDeviceIdentity], whole: bool
) -> list[tuple[str, str]]:
    """(where, device UUID) of what a plan destroys: its MIG devices, and the GPU itself
    where it changes the MIG mode (``whole``: a job may hold the GPU whole)."""
    places = [(_where(md), md.uuid) for md in doomed]
    return [*places, ("the whole GPU", gpu.uuid)] if whole else places


def _begun(wait: ReadWait, done: list[str]) -> ReadWait:
    """How an apply waits for a GPU's reads once ``done`` steps were made on it."""
    return "changing" if wait == "each_call" and done else wait


def _who(pid: int, job: str | None) -> str:
    return f"pid {pid}" + (f" (job {job})" if job else "")


def _no_answer(timeout_s: float) -> str:
    # to a tenth of a second, as a person reads it: a whole deadline whole ("3600 s"); one
    # under a second to two significant digits, so that 0.01 s is not said as "0 s"
    digits = 1 if timeout_s <= 0 else max(1, 1 - math.floor(math.log10(timeout_s)))
    return f"not answering: no answer from the driver within {format_number(round(timeout_s, digits))} s"


def _nothing_to_resume(
    inflight: InflightRecord,
    desired: Mapping[str, DesiredRecord],
    ids: Mapping[str, GpuIdentity],
    faults: Mapping[int, str],
    checked: Mapping[int, GpuPlan | Exception],
) -> bool:
    """Whether the in-flight plan has nothing left for a resume to do: no step, and no MIG
    mode change pending a reset that the resume would make (``skip_reset``: it makes none;
    otherwise every managed GPU present answered, none with one pending). An apply with
    nothing to do records no plan; an earlier gpud recorded one with no steps."""
    if inflight.steps:
        return False
    if inflight.options.skip_reset:
        return True
    if any((ids[u].index if u in ids else r.gpu_index) in faults for u, r in desired.items()):
        # a faulty GPU's mode is not known, one lost before its identity was read included
        return False
    return all(isinstance(p, GpuPlan) and not p.reset_pending for p in checked.values())


def _newest_unread(
    records: Iterable[DesiredRecord], read: Container[str]
) -> dict[int, DesiredRecord]:
    """By GPU index, the newest of ``records`` whose UUID no GPU read now has (``read``):
    the GPU a GPU never read at that index most likely is. A GPU replaced there (a new
    UUID at the same index, ``nvidia-smi -L``) leaves its record behind, older."""
    out: dict[int, DesiredRecord] = {}
    for r in records:
        if r.gpu_uuid not in read and (
            r.gpu_index not in out or r.updated_at >= out[r.gpu_index].updated_at
        ):
            out[r.gpu_index] = r
    return out


def _unread_records(
    desired: Mapping[str, DesiredRecord], read: Container[str], seen: Mapping[int, SeenIdentity]
) -> dict[int, DesiredRecord]:
    """By GPU index, the record of each GPU never read since gpud started: that of the UUID
    an earlier run read at that index (``seen``; none where no apply recorded that UUID,
    as for a board replaced there, whose predecessor's record is not its own), else, where
    no run saw a UUID there (or the one it saw is read now, elsewhere), the index's newest
    record no GPU read now has (:func:`_newest_unread`)."""
    out = _newest_unread(desired.values(), read)
    for i, was in seen.items():
        if not was.uuid or was.uuid in read:
            continue
        if (record := desired.get(was.uuid)) is not None:
            out[i] = record
        else:
            out.pop(i, None)
    return out


def _left_alone(index: int, uuid: str, name: str, reason: str) -> GpuOutcome:
    """The outcome of a GPU that reconcile does not call while it is faulty."""
    return GpuOutcome(
        index,
        uuid,
        (),
        False,
        "faulty",
        f"{name} is faulty: {reason}: not reconciled until it answers again",
    )


def _enables_mig(gpu: GpuIdentity, actual: GpuActual, plan: GpuPlan, *, reset: bool) -> bool:
    """Whether ``plan`` turns MIG mode on now (``nvidia-smi -i N -mig 1`` on a product that
    switches at once, or the GPU reset that makes an enable current: ``reset``), which the
    driver does only on a GPU no process holds, an MPS control daemon's server included. On
    a product whose change waits for a reset (A100), ``-mig 1`` without one only makes it
    pending, whatever holds the GPU."""
    return not actual.mode.current and _mode_changes_now(gpu, actual, plan, reset=reset)


def _mode_changes_now(gpu: GpuIdentity, actual: GpuActual, plan: GpuPlan, *, reset: bool) -> bool:
    """Whether ``plan`` changes the GPU's current MIG mode now: a ``SetMigMode`` step on a
    product that switches at once (Hopper: ``nvidia-smi -i N -mig 1`` answers at once), or
    the GPU reset that makes a pending mode current (``reset``: the plan waits for one and
    gpud may do it, as ``nvidia-smi --gpu-reset -i N`` does). On a product whose change
    waits for a reset (A100), the step alone only makes it pending."""
    if reset and plan.reset_pending:
        return True
    return not _mode_needs_reset(gpu) and any(
        isinstance(s, SetMigMode) and s.enabled != actual.mode.current for s in plan.steps
    )


def _pending(where: str) -> str:
    """The detail of a GPU whose MIG mode change waits for a GPU reset."""
    return f"{where}: MIG mode change pending a GPU reset"


def _mode_needs_reset(gpu: GpuIdentity) -> bool:
    """Whether the GPU's product makes a MIG mode change at its next reset (A100) rather than
    at once (Hopper). A product gpud does not know is taken to switch at once: only the
    driver's answer to the change tells, and the apply reports it."""
    spec = lookup(gpu.product) if gpu.product else None
    return spec is not None and spec.mig_mode_needs_reset


def _product(gpu: GpuIdentity) -> str:
    return f" ({gpu.product})" if gpu.product else ""


def _seen_identity(index: int, seen: SeenIdentity | None) -> GpuIdentity | None:
    """GPU ``index`` as an earlier run last saw it, for checking a layout against its
    product's published profile table; None where that run did not keep its product."""
    if seen is None or not seen.product:
        return None
    spec = lookup(seen.product)
    return dataclasses.replace(
        unknown_identity(index),
        uuid=seen.uuid,
        name=seen.name,
        product=seen.product,
        pci_bus_id=seen.pci_bus_id,
        # the product's, as NVML reports it (nvmlDeviceGetMemoryInfo().total)
        memory_total_bytes=spec.memory_mib << 20 if spec else 0,
        mig_capable=spec is not None and spec.mig_capable,
    )


def _check_layout(
    gpu: GpuIdentity, layout: DeviceLayout, table: ProfileTable | None, where: str
) -> None:
    """Refuse ``layout`` for ``gpu`` (not called: it is faulty) as an apply refuses it for
    a GPU it plans: with ``table`` (the driver's, read earlier) or the product's published
    one, :class:`InvalidArgument` naming ``where`` (the config), the GPU and the profile."""
    if not layout.mig_enabled:
        return
    table = table or reference_table(gpu)
    try:
        if table is not None:
            validate_layout(table, layout)
        elif not gpu.mig_capable:
            raise InvalidArgument(
                f"GPU {gpu.index} ({gpu.product}): does not support MIG", field="mig-enabled"
            )
    except InvalidArgument as err:
        raise InvalidArgument(f"{where}: {err}") from err
