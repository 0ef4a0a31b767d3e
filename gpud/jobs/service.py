"""Jobs as the API and the daemon's tick use them: registry, reservations, environment,
attribution, over one :class:`~gpud.mps.manager.MpsManager` (which knows the devices, their
memory and their MPS daemons).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

from gpud.backend.products import KNOWN_MIG_PROFILES, PRODUCTS, mig_profile_names
from gpud.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from gpud.events import EventLog
from gpud.jobs import leftovers
from gpud.jobs.attribution import Attributor, ProcessUse, memory_by_job
from gpud.jobs.ends import NO_STATUS, EndCause, RunEnd
from gpud.jobs.env import build_env
from gpud.jobs.placement import (
    Asked,
    DeviceLoad,
    Reservation,
    Reservations,
    choose_devices,
    device_loads,
)
from gpud.jobs.registry import JobKind, JobRegistry, JobSpec, validate_spec
from gpud.jobs.stops import RunStop, RunStops, StopReason
from gpud.mps.manager import MpsManager, MpsTarget
from gpud.mps.procs import real_uid, stat_fields
from gpud.pidns import local_pid
from gpud.store import StateStore
from gpud.telemetry.snapshot import Snapshot

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # a force-removed job's run: SIGTERM, then SIGKILL this much later


@dataclass(frozen=True, slots=True)
class RunRequest:
    """What ``gpuctl run`` asks for; ``None`` fields take the registered job's values."""

    job: str
    kind: JobKind | None = None
    owner: str = ""
    mig_profile: str | None = None
    gpu_count: int | None = None
    devices: tuple[str, ...] = ()
    threads_percent: int | None = None
    memory_bytes: int | None = None
    client_priority: int | None = None
    holder_pid: int | None = None
    # the PID namespace holder_pid is numbered in (its /proc/self/ns/pid inode); None:
    # gpud's own. :meth:`JobService.resolved` makes it gpud's.
    holder_pid_namespace: int | None = None
    # Co-location's advice for this run: where neither the request nor the registered job
    # names a place or a thread share. Never registered with the job.
    advised_devices: tuple[str, ...] = ()
    advised_threads_percent: int | None = None
    # The caller's id for this reservation: a repeat with the same id is answered with the
    # reservation it made, not made again (:meth:`JobService.reserve`). "": none.
    request_id: str = ""


def request_arguments(request: RunRequest) -> str:
    """``request``'s fields but its id, as a repeat of it must give them again: the same
    text for the same fields, whatever the order they were given in."""
    fields = asdict(replace(request, request_id=""))
    del fields["request_id"]
    return json.dumps(fields, sort_keys=True)


# Called inside the transaction that adds ("reserve") or removes ("release") a reservation,
# with the job as placed (its request, before the placement override) and, on release, how
# the run ended (None on reserve).
ReservationObserver = Callable[[str, Reservation, JobSpec, RunEnd | None], None]
# Called under the placement lock, inside the removal's store transaction, as a job is
# removed, with its name and whether --force was given: it raises to refuse the removal, or
# lets go of what it keeps for the job in the store. What it keeps elsewhere (in memory) it
# lets go of in the callable it returns, called once the transaction committed (never when
# the commit failed: the job stays, and so must the rest).
RemovalHook = Callable[[str, bool], Callable[[], None] | None]
# Called when a run's end comes after its reservation went (``gpuctl jobs rm --force``
# released it while the run ran; its ``gpuctl run`` reports the command's exit once it has
# exited, with its status or, when it has none, without), with the reservation's id and
# that end: True when it kept the end for that run.
LateEnd = Callable[[str, RunEnd], bool]
# Where a job may start now, given its effective spec and the user its processes run as
# (None: unknown, or MPS off: see JobService.placement_uid): its devices; raise
# ResourceExhausted (the admission queue's own check, so that no job jumps the queue); None:
# no opinion.
Gate = Callable[[JobSpec, int | None], tuple[str, ...] | None]
# Called once devices may have freed (a release, a removal, holders found gone), after the
# change is committed, outside the placement lock and every transaction, in the caller's
# thread: the admission queue starts what fits now rather than at its next tick. What it
# raises is logged, never the caller's: the change is kept, and the tick tries again.
FreedHook = Callable[[], None]
# Called once a reservation is committed (never when the commit failed: it was never made),
# under the placement lock, outside the transaction: it must not wait on a lock of its own,
# and must not raise (what it raises is logged: the reservation stands and is answered).
ReservedHook = Callable[[Reservation], None]


@dataclass(frozen=True, slots=True)
class Launch:
    job: JobSpec
    reservation: Reservation
    env: dict[str, str]
    created_job: bool


class JobService:
    def __init__(
        self,
        store: StateStore,
        events: EventLog,
        mps: MpsManager,
        *,
        socket_path: Path,
        proc_root: Path = Path("/proc"),
        cgroup_pattern: str | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        lock: AbstractContextManager[object] | None = None,
        products: Callable[[], Mapping[int, str]] = lambda: {},
    ) -> None:
        """``clock``: Unix time, what is stored. ``monotonic``: what a grace this process
        gives is measured by (the wall clock steps). ``lock``: the placement lock (a
        re-entrant one; default a new ``threading.RLock``), which comes before the MPS
        manager's lock and the state store's. ``products``: GPU index -> product key of
        the node's GPUs ("" where unknown), whose MIG tables a job's profile is checked
        against."""
        self._products = products
        self.store = store  # the API's short reads use its reading connection
        self._clock = clock
        # released runs whose processes left get SIGKILL, kept across restarts
        self._stops = RunStops(store, longest_wait_s=STOP_GRACE_S, monotonic=monotonic)
        self.registry = JobRegistry(store, clock=clock)
        self.reservations = Reservations(store, proc_root=proc_root, clock=clock)
        self._events = events
        self._mps = mps
        self._socket_path = socket_path
        self._proc_root = proc_root
        self._attributor = (
            Attributor(proc_root=proc_root, cgroup_pattern=cgroup_pattern)
            if cgroup_pattern
            else Attributor(proc_root=proc_root)
        )
        # placement is check-then-insert, and so is `gpuctl mps set --memory`
        self._lock = lock if lock is not None else threading.RLock()
        self._uses: list[ProcessUse] = []
        # device UUID -> memory used, of the devices whose processes NVML did not list
        self._unlisted: dict[str, int] = {}
        # GPU index -> why, and what the driver answered, as of the newest snapshot
        # observed (swapped whole: the lock-free readers see one snapshot's)
        self._down: dict[int, GpuDown] = {}
        # GPU index -> why no job is placed there for now (a MIG apply changes its
        # instances), one why per hold, the newest last: see placing_none_on (swapped
        # whole, under _lock)
        self._held_off: dict[int, tuple[str, ...]] = {}
        # the newest snapshot's monotonic whose health was taken; held only to take one
        self._health_lock = threading.Lock()
        self._health_at: float | None = None
        self._observers: list[ReservationObserver] = []
        self._removal_hooks: list[RemovalHook] = []
        self._late_ends: list[LateEnd] = []
        self._freed_hooks: list[FreedHook] = []
        self._reserved_hooks: list[ReservedHook] = []
        self._waiting_kind: Callable[[str], str | None] = lambda job: None
        self.gate: Gate | None = None
        # a job that can never start here, refused as such where no gate runs (a preview)
        self.refuse_never: Callable[[JobSpec], None] = lambda spec: None
        self._tag_of: Callable[[str], int] | None = None
        self._tag_held: Callable[[str], int | None] = lambda job: None
        self._tag_starting: Callable[[str], AbstractContextManager[None]] = lambda job: (
            nullcontext()
        )
        # a holder found gone at the first tick died while gpud was down (or before it began)
        self._ticked = False

    def add_observer(self, observer: ReservationObserver) -> None:
        self._observers.append(observer)

    def add_removal_hook(self, hook: RemovalHook) -> None:
        self._removal_hooks.append(hook)

    def add_late_end(self, keep: LateEnd) -> None:
        self._late_ends.append(keep)

    def add_freed_hook(self, hook: FreedHook) -> None:
        self._freed_hooks.append(hook)

    def add_reserved_hook(self, hook: ReservedHook) -> None:
        self._reserved_hooks.append(hook)

    def _reserved(self, reservation: Reservation) -> None:
        for hook in self._reserved_hooks:
            try:
                hook(reservation)
            except Exception:  # committed: the run is answered its reservation
                log.exception("job %s: after reservation %s", reservation.job, reservation.id)

    def _freed(self) -> None:
        for hook in self._freed_hooks:
            try:
                hook()
            except Exception:  # the release stands; the next tick tries again
                log.exception("after devices freed")

    def set_waiting(self, kind_of: Callable[[str], str | None]) -> None:
        """Where runs wait whose job is not registered yet: a ``gpuctl run`` the
        co-location loop told to wait registers its job only once it reserves.
        ``kind_of(job)``: the kind of the job such a run waits for, else None. ``gpuctl jobs
        rm`` finds the job there (a removal hook then stops the wait)."""
        self._waiting_kind = kind_of

    def _released(self, reservation: Reservation, end: RunEnd) -> None:
        job = self.registry.find(reservation.job)
        for observer in self._observers:
            observer(
                "release", reservation, job if job is not None else JobSpec(reservation.job), end
            )

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold placement still (no reservation is added meanwhile)."""
        with self._lock:
            yield

    def set_tagger(
        self,
        tag_of: Callable[[str], int],
        held: Callable[[str], int | None],
        starting: Callable[[str], AbstractContextManager[None]] | None = None,
    ) -> None:
        """Where jobs get their DSCP tag (the traffic service, which is built after this
        service): ``tag_of`` hands one out (or raises ResourceExhausted), ``held`` reads the
        one a job holds; inside ``starting(job)`` a tag handed to a job not registered yet
        is kept (a run tags a new job before the transaction that registers it). Without a
        tagger launch environments carry no tag."""
        self._tag_of = tag_of
        self._tag_held = held
        if starting is not None:
            self._tag_starting = starting

    def ensure_tag(self, job: str) -> None:
        """Give ``job`` its DSCP tag now (none left: ResourceExhausted). Call it holding no
        store transaction: the traffic service's lock is taken before the store's."""
        if self._tag_of is not None:
            self._tag_of(job)

    def device_uuids(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """Devices as people name them (``0``, ``0:1``, as ``gpuctl mps`` takes them) or by
        UUID, as UUIDs; a UUID the node lacks is kept as given (placement says so), the UUID
        an earlier run last read for a GPU not read since gpud started included (one hung
        then answers with it again; till then placement refuses it as on that GPU:
        :meth:`refuse_last_seen`), and a GPU in MIG mode is refused by UUID as by index.
        An index the node lacks (``9``, or ``0:5`` before a MIG apply makes it), or that
        names a GPU not read since gpud started, is refused: it is kept as the UUID it names
        now, and names none, which the refusal says."""

        def uuid(name: str) -> str:
            try:
                target = self._mps.resolve(name)
            except NotFound as err:
                if name.startswith(("GPU-", "MIG-")):
                    return name
                raise NotFound(
                    f"{err}: an index names a device of this node as it is now (a job keeps"
                    " the UUID it names); give a UUID, or a MIG profile (--mig), to register"
                    " a job ahead of a layout"
                ) from None
            if not target.uuid and name.startswith("GPU-"):
                # the UUID an earlier run read there: a job may be registered ahead on it,
                # as on any UUID the node lacks
                return name
            if not target.uuid:  # lost or hung since before gpud started: no UUID to keep
                # the reason may say the UUID an earlier run read ("last seen as ..."): this
                # run has read none, and the index names the GPU there now, whichever it is
                raise FailedPrecondition(
                    f"device {name} is on GPU {target.gpu}, which is unhealthy:"
                    f" {target.gpu_unhealthy or 'unhealthy'} (not read since gpud started:"
                    f" GPU {target.gpu} names no UUID until it answers)"
                )
            return target.uuid

        return tuple(uuid(n) for n in names)

    def resolved(self, request: RunRequest) -> RunRequest:
        """``request`` with its devices as UUIDs (:meth:`device_uuids`) and its holder PID
        as gpud numbers processes (:func:`gpud.pidns.local_pid`)."""
        if request.holder_pid is not None and request.holder_pid_namespace is not None:
            holder = local_pid(
                request.holder_pid,
                request.holder_pid_namespace,
                self._proc_root,
                field="holder_pid",
            )
            request = replace(request, holder_pid=holder, holder_pid_namespace=None)
        if not request.devices:
            return request
        return replace(request, devices=self.device_uuids(request.devices))

    def job_of(self, pid: int) -> str | None:
        """The job ``pid`` belongs to (by its ``GPUD_JOB`` or cgroup), or None."""
        return self._attributor.job_of(pid)[0]

    # -- registry --------------------------------------------------------------------------
    def add(self, spec: JobSpec) -> JobSpec:
        self.check_mig_profile(spec.mig_profile)
        if spec.devices:
            spec = replace(spec, devices=self.device_uuids(spec.devices))
        job = self.registry.add(spec)
        self.say_added(job)
        return job

    def check_mig_profile(self, profile: str | None) -> None:
        """Refuse (InvalidArgument) a MIG profile that no product gpud knows has, naming
        the profiles of this node's GPUs. Taken while a GPU here is of a product gpud has
        no table for (its own table may have it), or before the GPUs were read."""
        if profile is None or profile in KNOWN_MIG_PROFILES:
            return
        keys = sorted(set(self._products().values()))
        if not keys or any(k not in PRODUCTS for k in keys):
            return
        gi = list(dict.fromkeys(g.name for k in keys for g in PRODUCTS[k].mig_profiles))
        ci = [n for k in keys for n in mig_profile_names(PRODUCTS[k]) if n not in gi]
        takes = f"take {', '.join(gi)}" if gi else "have no MIG"
        if ci:  # a compute instance of one: "1c.3g.40gb"
            takes += f", or a compute instance of one ({ci[0]}, ...)"
        raise InvalidArgument(
            f"{profile!r} is a MIG profile of no GPU gpud knows; this node's GPUs"
            f" ({', '.join(keys)}) {takes}",
            field="mig",
        )

    def cannot_start(self, spec: JobSpec) -> str | None:
        """Why ``spec`` can never start on this node as it is now (the admission queue's
        verdict: the GPUs it asks are not here, no device has its MIG profile), or None.
        A job may be registered all the same: a MIG layout applied later may host it."""
        with self._lock:
            try:
                self.refuse_never(spec)
            except FailedPrecondition as err:
                return str(err)
        return None

    def say_added(self, job: JobSpec) -> None:
        """The event of ``job`` registered (once its transaction committed)."""
        self._events.emit("job.add", f"job {job.name} ({job.kind}) registered", job=job.name)

    def remove(self, name: str, *, force: bool = False) -> JobSpec:
        if self.store.in_transaction():
            # The removal hooks' callables let go of what they keep in memory for the job
            # (co-location takes its footprints as removed for good) once the transaction
            # below committed: nested in one, it would commit only when that one ends, and
            # its rollback would keep a job the hooks already let go of.
            raise RuntimeError(f"job {name!r}: removed within an open store transaction")
        with self._lock:
            held = self.reservations.held(name)
            if held and not force:
                raise FailedPrecondition(
                    f"job {name!r} holds {len(held)} reservation(s)"
                    f" ({', '.join(r.id for r in held)}): they go when its runs end, or "
                    f"`gpuctl jobs rm --force {name}` releases them and stops its runs"
                )
            registered = self.registry.find(name)
            # not registered: only a run waiting to be placed knows it (a hook stops that)
            waiting = self._waiting_kind(name) if registered is None else None
            if registered is None and waiting is None:
                raise NotFound(f"no job {name!r}")  # before any hook lets go of anything
            kill_at = self._clock() + STOP_GRACE_S
            # One transaction: a crash keeps the job, its queue entries and its
            # reservations, or none of them (a job gone whose runs still hold their
            # reservations could not be removed again). The hooks' events (the queue
            # entries that left) are said once it is committed.
            committed: list[Callable[[], None]] = []
            with self._events.until_committed(), self.store.transaction():
                for hook in self._removal_hooks:
                    if (then := hook(name, force)) is not None:
                        committed.append(then)
                job = (
                    self.registry.remove(name)
                    if registered is not None
                    else JobSpec(name, JobKind(waiting or JobKind.TRAINING))
                )
                released = self.reservations.release_job(name)
                for r in released:
                    self._released(r, RunEnd(EndCause.REMOVED))
                    self._stops.schedule(
                        RunStop(r.id, name, StopReason.REMOVED, kill_at, r.holder_pid),
                        wait_s=STOP_GRACE_S,
                    )
            for then in committed:  # still under the placement lock, which comes first
                try:
                    then()
                except Exception:  # the removal stands
                    log.exception("after job %s was removed", name)
        self._events.emit("job.remove", f"job {name} removed", job=name)
        for r in released:
            # its runs must not go on using what nothing reserves now: SIGTERM to their
            # processes (the command exits, its gpuctl ends what it left), SIGKILL to what
            # is left after STOP_GRACE_S (the tick, from the store: a restart keeps it)
            told = leftovers.kill(r.id, signal.SIGTERM, self._proc_root, holder=r.holder_pid)
            if not told:
                self._stops.done(r.id)
                continue
            self._events.emit(
                "job.stop",
                f"job {name} removed with --force: SIGTERM to {len(told)} process(es) of "
                f"its run {r.id}, SIGKILL after {STOP_GRACE_S:g} s to any left",
                job=name,
                reservation=r.id,
                pids=told,
            )
        self._freed()
        return job

    def loads(self) -> dict[str, DeviceLoad]:
        """Per device: what reservations hold (memory, jobs, users, thread shares), and the
        memory its GPU processes used beyond that at the last tick
        (:meth:`unreserved_memory`)."""
        reservations = self.reservations.held()  # one read for the memory and the jobs
        reserved = self.reservations.reserved(self._defaults(), held=reservations)
        held = device_loads(reserved)
        empty = DeviceLoad(0, ())
        beyond = self._unreserved(reserved)
        defaulted: dict[str, list[str]] = {}
        users: dict[str, set[tuple[int, str]]] = {}
        threads: dict[str, int] = {}
        shares: dict[str, list[tuple[str, int]]] = {}
        for r in reservations:
            for uuid in r.devices:
                threads[uuid] = threads.get(uuid, 0) + (r.threads_percent or 0)
                if r.threads_percent:
                    shares.setdefault(uuid, []).append((r.job, r.threads_percent))
            if r.memory_bytes is None and r.defaults is None:  # made by an earlier version
                for uuid in r.devices:
                    defaulted.setdefault(uuid, []).append(r.job)
            if r.uid is not None:
                for uuid in r.devices:
                    users.setdefault(uuid, set()).add((r.uid, r.job))
        return {
            uuid: replace(
                held.get(uuid, empty),
                unreserved_bytes=beyond.get(uuid, 0),
                defaulted=tuple(sorted(defaulted.get(uuid, ()))),
                users=tuple(sorted(users.get(uuid, ()))),
                threads_percent=threads.get(uuid, 0),
                shares=tuple(sorted(shares.get(uuid, ()))),
            )
            for uuid in held.keys() | beyond.keys()
        }

    def placement_uid(self, holder_pid: int | None, known: int | None = None) -> int | None:
        """The user placement keeps a run's devices to: its holder's real UID where MPS is
        on (a control daemon serves one user at a time); None (no constraint) with MPS off,
        without a holder, or where ``/proc`` does not say. ``known``: the UID read when the
        run queued (an admission pass asks it of every queued entry): ``/proc`` is read
        only where it is None."""
        if not self._mps.enabled or not holder_pid:
            return None
        return known if known is not None else real_uid(holder_pid, self._proc_root)

    def run_uid(self, holder_pid: int | None, namespace: int | None = None) -> int | None:
        """:meth:`placement_uid` of a run not reserved yet, whose holder is ``holder_pid``
        of PID namespace ``namespace`` (as a :class:`RunRequest` names it): the user
        co-location's advice for it keeps to. FailedPrecondition when gpud sees no such
        process in that namespace."""
        if holder_pid is None or not self._mps.enabled:
            return None  # placement keeps users apart only where MPS serves the devices
        local = local_pid(holder_pid, namespace, self._proc_root, field="holder_pid")
        return self.placement_uid(local)

    def _default_memory(self, uuid: str) -> int | None:
        return self._mps.limits(uuid).memory_bytes

    def _default_threads(self, uuid: str) -> int | None:
        """The device's MPS default thread share where MPS serves it (None with MPS off: no
        server narrows a job's share then)."""
        return self._mps.limits(uuid).threads_percent if self._mps.enabled else None

    def _defaults(self) -> Callable[[str], int | None]:
        """:meth:`_default_memory` of every device from one read of the limits (a metrics
        scrape counts every reservation's devices)."""
        limits = self._mps.all_limits()
        return lambda uuid: limits[uuid].memory_bytes if uuid in limits else None

    def unreserved_memory(self) -> dict[str, int]:
        """Device UUID -> the memory its processes used at the last tick beyond what
        reservations hold for them: all of a process of no job (another user's, one started
        outside gpud), and what a job's processes on the device use past the job's
        reservations there (none, or no memory limit: all of it). gpud's MPS servers are
        left out (their clients are counted), and so are a process whose memory NVML does
        not report (``usedGpuMemory`` not available) and one that has exited since the tick
        (no ``/proc/<pid>``, or a zombie). On a device whose processes NVML could not list,
        what its memory use is beyond every reservation there counts instead (all of its
        memory when that could not be read either): the device is not taken for idle."""
        return self._unreserved(self.reservations.reserved(self._defaults()))

    def _unreserved(self, reserved: Mapping[tuple[str, str], int]) -> dict[str, int]:
        servers = {pid for st in self._mps.last_status() for pid in st.servers}
        used: dict[tuple[str, str | None], int] = {}
        for u in self.process_uses():
            if u.used_memory_bytes is None or u.pid in servers:
                continue
            # The tick's snapshot is up to a tick old: a run that just ended is still in it,
            # and its memory is free once its process is gone (the next run of the same
            # GPU must not wait a tick for it).
            fields = stat_fields(u.pid, self._proc_root)
            if fields is None or fields[0] in ("Z", "X"):
                continue
            used[(u.device, u.job)] = used.get((u.device, u.job), 0) + u.used_memory_bytes
        out: dict[str, int] = {}
        for (uuid, job), n in used.items():
            beyond = n - (reserved.get((uuid, job), 0) if job is not None else 0)
            if beyond > 0:
                out[uuid] = out.get(uuid, 0) + beyond
        for uuid, n in self._unlisted.items():
            beyond = n - sum(v for (u, _), v in reserved.items() if u == uuid)
            if beyond > 0:
                out[uuid] = max(out.get(uuid, 0), beyond)
        return out

    # -- reservations ----------------------------------------------------------------------
    def job_for(self, request: RunRequest) -> tuple[JobSpec, bool]:
        """The registered job ``request`` names, or (True: new) the job it would register:
        a new job is registered in the transaction of its first reservation or queue entry,
        so that a refusal or a crash before then leaves none behind."""
        with self._lock:
            self.check_mig_profile(request.mig_profile)
            job = self.registry.find(request.job)
            created = job is None
            if job is None:
                job = JobSpec(
                    name=request.job,
                    kind=request.kind or JobKind.TRAINING,
                    owner=request.owner,
                    devices=request.devices,
                    mig_profile=request.mig_profile,
                    gpu_count=request.gpu_count,
                    threads_percent=request.threads_percent,
                    memory_bytes=request.memory_bytes,
                    client_priority=request.client_priority,
                )
                validate_spec(job)
            elif request.kind is not None and request.kind is not job.kind:
                raise InvalidArgument(
                    f"job {job.name!r} is registered as {job.kind}, not {request.kind}",
                    field="kind",
                )
            return job, created

    def reserve(
        self, request: RunRequest, *, preview: bool = False, admitted: bool = False
    ) -> Launch:
        """Register the job if new, place it, record the reservation (unless ``preview``),
        and return the environment to launch it with. Unless ``admitted`` (started by the
        admission queue itself), the :attr:`gate` decides where it may start.

        With a ``request_id``, a reservation held that was made for it is answered as it was
        then (nothing is placed, registered or said again): the same call tried again after
        its answer was lost. Asked with other fields, it is refused (FailedPrecondition
        naming the id)."""
        asked = (
            None
            if preview or admitted or not request.request_id
            else Asked(request.request_id, request_arguments(request), False)
        )
        request = self.resolved(request)
        # A new job is registered in its first reservation's transaction: a crash or a
        # refusal before then leaves no job behind. With traffic on it is tagged before
        # that transaction (the traffic service's lock comes before the store's): the tag
        # of a job still unregistered goes at the traffic service's next tick. A preview
        # takes none: it changes nothing, and its environment carries the tag the job
        # holds already, if any.
        with nullcontext() if preview else self._tag_starting(request.job):
            # the queue tags before it starts one
            if self._tag_of is not None and not admitted and not preview:
                self.job_for(request)  # a request refused as such is not tagged
                self.ensure_tag(request.job)  # none left: refused before it holds anything
            with self._lock:
                if asked is not None and (done := self._made_for(asked)) is not None:
                    return done
                job, registered = self.job_for(request)
                # what was asked: the history's request (co-location's advice places this
                # run only, on a device no replay or other node has)
                placed = _override(job, request)
                effective = _advised(placed, request)
                sick = self.unhealthy()  # once: the check and the placement agree
                self._refuse_unhealthy(effective, sick)
                uid = self.placement_uid(request.holder_pid)
                if preview:
                    self.refuse_never(effective)
                elif self.gate is not None and not admitted:
                    where = self.gate(effective, uid)
                    if where is not None:
                        effective = replace(
                            effective, devices=where, mig_profile=None, gpu_count=None
                        )
                if not self._mps.targets():
                    raise Unavailable("no GPU seen yet: the daemon is starting, retry shortly")
                chosen = self.choose(effective, uid=uid, sick=sick)
                uuids = tuple(d.uuid for d in chosen)
                # none of its own: each device's default, as placed, is its MPS client's
                defaults = (
                    None
                    if effective.memory_bytes is not None
                    else {u: n for u in uuids if (n := self._default_memory(u)) is not None}
                )
                if preview:
                    reservation = Reservation(
                        "", job.name, uuids, effective.threads_percent, effective.memory_bytes,
                        effective.effective_priority, None, 0.0,
                        None if defaults is None else tuple(sorted(defaults.items())),
                    )  # fmt: skip
                else:
                    with self.store.transaction():
                        if registered:
                            job = self.registry.add(job)
                        reservation = self.reservations.add(
                            job.name,
                            uuids,
                            threads_percent=effective.threads_percent,
                            memory_bytes=effective.memory_bytes,
                            client_priority=effective.effective_priority,
                            holder_pid=request.holder_pid,
                            defaults=defaults,
                            holder_uid=uid,
                            asked=None if asked is None else replace(asked, created_job=registered),
                        )
                        for observer in self._observers:
                            observer("reserve", reservation, placed, None)
                    self._reserved(reservation)
                    if registered:
                        self.say_added(job)
                    self._events.emit(
                        "job.reserve",
                        f"job {job.name} reserved {', '.join(uuids)}",
                        job=job.name,
                        reservation=reservation.id,
                        devices=list(uuids),
                        gpus=sorted({d.gpu for d in chosen}),
                        holder_pid=request.holder_pid,
                    )
            env = self.env_for(reservation)  # its tag still kept, if a new job's
        return Launch(job, reservation, env, registered)

    def _made_for(self, asked: Asked) -> Launch | None:
        """What the reservation held that was made for ``asked.request_id`` answered,
        with the environment it has now; None when none held was made for it."""
        found = self.reservations.asked(asked.request_id)
        if found is None:
            return None
        reservation, first = found
        if first.arguments != asked.arguments:
            raise FailedPrecondition(
                f"request id {asked.request_id!r} was given to reservation {reservation.id}"
                f" of job {reservation.job} with other fields: a new reservation needs a new"
                " request id"
            )
        log.info(
            "job %s: reservation %s asked again with request id %s: answered as made",
            reservation.job,
            reservation.id,
            asked.request_id,
        )
        job = self.registry.get(reservation.job)
        return Launch(job, reservation, self.env_for(reservation), first.created_job)

    def gpu_indexes(self, devices: Sequence[str]) -> list[int]:
        """The NVML indexes of the GPUs ``devices`` (GPU or MIG device UUIDs) are on, as
        last listed, for events (``gpuctl events --gpu 0``); a device not listed is left out."""
        return sorted({t.gpu for u in devices if (t := self._mps.target(u)) is not None})

    def unhealthy(self) -> NotPlacedOn:
        """GPU index -> why it is unhealthy (lost, not answering, a critical Xid), as of
        the newest snapshot observed (:meth:`observe_health`; the daemon observes each of
        the sampler's as it is taken), or why no job is placed there for now
        (:meth:`placing_none_on`, told apart by :attr:`NotPlacedOn.held`): no job is placed
        there, and a queued one waits. :attr:`NotPlacedOn.down` has what the driver
        answered of each unhealthy GPU: whether a call answered GPU lost, its critical XIDs."""
        held, down = self._held_off, self._down
        return NotPlacedOn(
            {i: d.reason for i, d in down.items()},
            {i: whys[-1] for i, whys in held.items()},
            down=down,
        )

    @contextmanager
    def placing_none_on(self, gpus: Mapping[int, str]) -> Iterator[None]:
        """Place no job on ``gpus`` (index -> why: a MIG apply destroys and creates their
        instances, and a run given a MIG device UUID the driver then destroys finds it
        gone) while the context lasts: a run pinned there is refused naming why, one that
        names none goes elsewhere, a queued one waits. Marked under the placement lock: a
        reservation being placed as it is entered is committed before it returns, so the
        caller's check of the reservations that follows sees it. Once it ends, the
        admission queue is asked for a pass."""
        with self._lock:
            held = self._held_off
            self._held_off = {**held, **{i: (*held.get(i, ()), w) for i, w in gpus.items()}}
        try:
            yield
        finally:
            with self._lock:
                # a GPU another hold still keeps (nested holds) stays held, saying that one's why
                left = {i: _without(whys, gpus.get(i)) for i, whys in self._held_off.items()}
                self._held_off = {i: whys for i, whys in left.items() if whys}
            self._freed()

    def unhealthy_devices(self) -> dict[tuple[int, int | None], tuple[str, str]]:
        """(GPU index, MIG device index or None) -> (UUID, ``"GPU N: reason"``) for each
        device on an unhealthy GPU, as of the newest snapshot observed. By index: every GPU never read
        (lost or hung since before gpud started) has the UUID "", and each is kept. Without
        a lock (both sources are swapped whole): for reads on the event loop, which a
        reservation or an MPS pass holding a lock must not hold back."""
        sick = {i: d.reason for i, d in self._down.items()}
        return {
            (s.target.gpu, s.target.mig): (
                s.target.uuid,
                f"GPU {s.target.gpu}: {sick[s.target.gpu]}",
            )
            for s in self._mps.last_status()
            if s.target.gpu in sick
        }

    def targets(self) -> list[MpsTarget]:
        """Every device a job may be placed on, healthy or not (``gpuctl mps show``)."""
        return self._mps.targets()

    def healthy_targets(self, sick: Mapping[int, str] | None = None) -> list[MpsTarget]:
        """The devices a job may be placed on: every MPS target but those of unhealthy GPUs
        (``sick``: :meth:`unhealthy`, read once by the caller) and those whose UUID is not
        known (a GPU never read since gpud started, until the MPS manager observes it)."""
        sick = self.unhealthy() if sick is None else sick
        return [t for t in self._mps.targets() if t.uuid and t.gpu not in sick]

    def choose(
        self,
        spec: JobSpec,
        now: tuple[Sequence[MpsTarget], Mapping[str, DeviceLoad]] | None = None,
        *,
        uid: int | None = None,
        sick: NotPlacedOn | None = None,
    ) -> tuple[MpsTarget, ...]:
        """:func:`choose_devices` among the healthy devices, with what is reserved now
        (``now``: those devices and loads, read once by a caller that asks for many); a
        refusal names the unhealthy GPUs it left out, and why, and a ``--mig`` profile whose
        every device is on such a GPU is refused as a wait for it (``ResourceExhausted``),
        not as one the node lacks. ``uid``: the run's user, from
        :meth:`placement_uid`. ``sick``: :meth:`unhealthy`, read once by the caller (that
        ``now`` was read with)."""
        sick = self.unhealthy() if sick is None else sick
        targets, loads = now if now is not None else (self.healthy_targets(sick), self.loads())
        # a whole GPU that does not answer now is still one the node has: a run that asks
        # for it waits for it, and its refusal counts it as not taking jobs now
        offered = {t.gpu for t in targets if t.mig is None}
        left_out = {t.gpu for t in self._mps.targets() if t.mig is None} - offered if sick else ()
        try:
            return choose_devices(
                spec,
                targets,
                loads,
                memory_bytes=spec.memory_bytes,
                default_memory=self._default_memory,
                uid=uid,
                default_threads=self._default_threads,
                whole_left_out=len(left_out),
            )
        except ResourceExhausted as err:
            if not sick:
                raise
            raise ResourceExhausted(f"{err} ({unhealthy_text(sick)})") from err
        except NotFound as err:
            refusal = self._profile_left_out(spec, sick)
            if refusal is None:
                raise
            raise refusal from err

    def _profile_left_out(self, spec: JobSpec, sick: NotPlacedOn) -> ResourceExhausted | None:
        """Why a ``--mig`` request finds no device of its profile among those a job may be
        placed on, where the node has some, each on a GPU left out (``sick``:
        :meth:`unhealthy`): they exist, and the job waits for their GPU to be placed on again
        (None: the node has none of the profile)."""
        if spec.mig_profile is None or not sick:
            return None
        gpus = sorted(
            {
                t.gpu
                for t in self._mps.targets()
                if t.mig is not None and t.profile == spec.mig_profile and t.gpu in sick
            }
        )
        if not gpus:
            return None
        return ResourceExhausted(
            f"job {spec.name!r}: the MIG devices of profile {spec.mig_profile} are on "
            + "; ".join(_left_out(gpu, sick) for gpu in gpus)
        )

    def _refuse_unhealthy(self, spec: JobSpec, sick: NotPlacedOn) -> None:
        """A job pinned to an unhealthy GPU's device (``sick``: :meth:`unhealthy`) is
        refused at once; one that names no device waits (``ResourceExhausted``) while no
        healthy GPU is left."""
        if not sick:
            return
        targets = {t.uuid: t for t in self._mps.targets()}
        for uuid in spec.devices or ():
            t = targets.get(uuid)
            if t is not None and t.gpu in sick:
                raise FailedPrecondition(
                    f"job {spec.name!r}: {uuid} is on {_left_out(t.gpu, sick)}"
                )
        self.refuse_last_seen(spec, sick)
        if not spec.devices and targets and all(t.gpu in sick for t in targets.values()):
            raise ResourceExhausted(
                f"job {spec.name!r}: no healthy GPU on this node now ({unhealthy_text(sick)})"
            )

    def refuse_last_seen(self, spec: JobSpec, sick: NotPlacedOn | None = None) -> None:
        """A job pinned to the UUID an earlier run last read for a GPU not read since gpud
        started (lost or hung before it; no GPU read since answers with that UUID) is
        refused (FailedPrecondition) as on that GPU, which is unhealthy, not as on a device
        the node lacks: the driver has answered with no UUID there yet. ``sick``:
        :meth:`unhealthy`, read once by the caller."""
        sick = self.unhealthy() if sick is None else sick
        for uuid in spec.devices or ():
            if not uuid.startswith("GPU-"):
                continue
            t = self._mps.last_seen_on(uuid)
            if t is not None and t.gpu in sick:
                raise FailedPrecondition(
                    f"job {spec.name!r}: {uuid} was last seen on {_left_out(t.gpu, sick)}"
                    f" (not read since gpud started: GPU {t.gpu} names no UUID until it"
                    " answers)"
                )

    def env_for(self, reservation: Reservation) -> dict[str, str]:
        pipes = {uuid: self._mps.pipe_dir(uuid) for uuid in reservation.devices}
        dscp = self._tag_held(reservation.job) if self._tag_of is not None else None
        return build_env(reservation, socket_path=self._socket_path, pipe_dirs=pipes, dscp=dscp)

    def env(
        self,
        name: str,
        *,
        holder_pid: int | None = None,
        holder_pid_namespace: int | None = None,
    ) -> dict[str, str]:
        """``gpuctl env --job NAME``: the environment of the job's latest reservation, or of
        where it would be placed now (a preview: nothing is reserved, and no DSCP tag is
        taken; ``GPUD_DSCP`` only if the job holds one already).

        ``holder_pid`` (of ``holder_pid_namespace``): the process its run would be held by
        (``gpuctl env``'s own): with MPS on the preview is placed for that process's real
        UID (:meth:`placement_uid`), as the run's reservation is; None, or a process gpud
        cannot see in that namespace, previews for no known user."""
        self.registry.get(name)
        held = self.reservations.held(name)
        if held:
            return self.env_for(held[-1])
        # the holder matters only where MPS keeps users apart (no /proc scan otherwise)
        request = RunRequest(
            job=name,
            holder_pid=holder_pid if self._mps.enabled else None,
            holder_pid_namespace=holder_pid_namespace,
        )
        try:
            request = self.resolved(request)
        except FailedPrecondition:
            # a caller in a PID namespace gpud cannot see: previewed for no known user, as
            # an older gpuctl's is (a preview reserves nothing, so it is not refused for it)
            request = RunRequest(job=name)
        return self.reserve(request, preview=True).env

    def release(self, reservation_id: str, end: RunEnd = NO_STATUS) -> Reservation | None:
        """Release a reservation; ``end``: how its run ended, for the job history. None: a
        reservation ``gpuctl jobs rm --force`` released while its run ran, whose end comes
        now (once, with an exit status or none): kept for that run beside what ended it.
        Any other reservation not held raises NotFound."""
        with self.store.transaction():
            try:
                reservation = self.reservations.release(reservation_id)
            except NotFound:
                kept = False
                for keep in self._late_ends:
                    kept = keep(reservation_id, end) or kept
                if not kept:
                    raise
                return None
            self._released(reservation, end)
        self._events.emit(
            "job.release",
            f"job {reservation.job} released {', '.join(reservation.devices)}",
            job=reservation.job,
            reservation=reservation.id,
            gpus=self.gpu_indexes(reservation.devices),
        )
        self._freed()
        return reservation

    # -- the tick --------------------------------------------------------------------------
    def tick(self, snapshot: Snapshot | None) -> None:
        """Attribute the snapshot's processes and take the GPUs' health from it; release
        reservations of dead holders. The snapshot first: it needs no write, so a transaction
        refused (another process's lock on the state database, a full disk) does not keep a
        newly unhealthy GPU from admission and ``gpuctl jobs`` until a write works again."""
        if snapshot is not None:
            self.observe(snapshot)
        now = self._clock()
        gone = RunEnd(EndCause.HOLDER_GONE if self._ticked else EndCause.GONE_AT_START)
        self._ticked = True
        with self.store.transaction():
            reaped = self.reservations.reap()
            for r in reaped:
                self._released(r, gone)
                # The kernel killed the run's command with gpuctl (PR_SET_PDEATHSIG); what
                # the command left running goes the same way: nothing reserves its devices.
                self._stops.schedule(RunStop(r.id, r.job, StopReason.HOLDER_GONE, now))
            due = self._stops.due(now)  # one transaction a tick for both
        for r in reaped:
            self._events.emit(
                "job.release",
                f"job {r.job} released {', '.join(r.devices)}: holder pid {r.holder_pid} is gone",
                job=r.job,
                reservation=r.id,
                gpus=self.gpu_indexes(r.devices),
            )
        if reaped:
            self._freed()
        for stop in due:
            self._kill_leftovers(stop)

    def observe(self, snapshot: Snapshot) -> None:
        """Take the GPUs' processes and health (:meth:`observe_health`) from ``snapshot``:
        whose processes `gpuctl jobs` lists under each job."""
        uses = self._attributor.attribute(snapshot)
        unlisted: dict[str, int] = {}
        for g in snapshot.gpus:
            if g.mig_mode is not None and g.mig_mode.current:
                for m in g.mig_devices:
                    if not m.processes_read:
                        # its memory unknown too: all of it is taken for used, not for free
                        unlisted[m.identity.uuid] = (
                            m.memory.used_bytes
                            if m.memory is not None
                            else m.identity.memory_total_bytes
                        )
            elif not g.processes_read and g.memory is not None and g.identity.uuid:
                unlisted[g.identity.uuid] = g.memory.used_bytes
        with self._lock:
            self._uses = uses
            self._unlisted = unlisted
        self.observe_health(snapshot)

    def observe_health(self, snapshot: Snapshot) -> None:
        """Take the GPUs' health from ``snapshot``: what admission refuses unhealthy GPUs
        by, what ``gpuctl jobs`` marks, and a ``job.gpu_unhealthy``/``job.gpu_recovered``
        event for each job on a GPU whose health changed. The daemon calls it after each of
        the sampler's ticks, on the sampling thread, once the MPS manager has observed the
        same snapshot (so a GPU that answers again is placed on with the UUID it has now).
        A snapshot older than one observed before is passed over (a loop pass that read it
        before the sampler's next tick). It takes no placement lock, which a reservation holds:
        only its own, and under it, while it tells jobs of a change, the MPS manager's
        lock and the store's reader (:meth:`StateStore.reading`): it never waits for a
        write to end."""
        down = _down(snapshot)
        with self._health_lock:
            if self._health_at is not None and snapshot.monotonic < self._health_at:
                return
            self._health_at = snapshot.monotonic
            before, self._down = self._down, down
            if down.keys() != before.keys():
                uuids = {g.identity.index: g.known().uuid for g in snapshot.gpus}
                sick = {i: d.reason for i, d in down.items()}
                self._tell_jobs_on(before.keys(), sick, uuids)

    def _tell_jobs_on(
        self, before: Collection[int], sick: Mapping[int, str], uuids: Mapping[int, str]
    ) -> None:
        """An event for each job holding a device of a GPU that went unhealthy or answers
        again: `gpu.unhealthy` names the GPU alone, and `gpuctl events --kind job.` is
        where a job's owner looks. Its reservation stays either way: its run may well go
        on (a hung GPU often comes back), and it ends as any run does."""
        gpu_of = {t.uuid: t.gpu for t in self._mps.targets() if t.uuid}
        # on the sampler's thread: read on the reader connection, never waiting for a write
        with self.store.reading():
            held = self.reservations.held()
        for r in held:
            gpus = sorted({gpu_of[d] for d in r.devices if d in gpu_of})
            for gpu in gpus:
                if gpu in sick and gpu not in before:
                    self._events.emit(
                        "job.gpu_unhealthy",
                        f"job {r.job}: GPU {gpu} under it is unhealthy: {sick[gpu]}; its "
                        "reservation stays until its run ends",
                        job=r.job,
                        gpu=gpu,
                        uuid=uuids.get(gpu, ""),
                        reservation=r.id,
                        reason=sick[gpu],
                    )
                elif gpu in before and gpu not in sick:
                    self._events.emit(
                        "job.gpu_recovered",
                        f"job {r.job}: GPU {gpu} under it answers again",
                        job=r.job,
                        gpu=gpu,
                        uuid=uuids.get(gpu, ""),
                        reservation=r.id,
                    )

    def _kill_leftovers(self, stop: RunStop) -> None:
        killed = leftovers.kill(stop.run, signal.SIGKILL, self._proc_root, holder=stop.holder)
        self._stops.done(stop.run)
        if not killed:
            return
        what = (
            "its gpuctl run left running"
            if stop.reason is StopReason.HOLDER_GONE
            else f"of its run still running {STOP_GRACE_S:g} s after SIGTERM"
        )
        self._events.emit(
            "job.kill",
            f"job {stop.job}: killed {len(killed)} process(es) {what}"
            f" (pid {', '.join(map(str, killed[:8]))})",
            job=stop.job,
            reservation=stop.run,
            pids=killed,
        )

    def process_uses(self) -> list[ProcessUse]:
        """The latest tick's GPU processes with their jobs. Without the service's lock (the
        tick swaps the list whole): a reservation holding the lock through its commit must
        not hold back a read on the event loop."""
        return list(self._uses)

    def unattributed_uses(self) -> list[ProcessUse]:
        """The latest tick's GPU processes of no job, less the MPS servers gpud runs:
        another user's process, or one whose job neither its environ nor its cgroup names."""
        servers = {pid for st in self._mps.last_status() for pid in st.servers}
        return [u for u in self.process_uses() if u.job is None and u.pid not in servers]

    def memory_by_job(self) -> dict[tuple[str, str], int]:
        return memory_by_job(self.process_uses())


def _override(job: JobSpec, request: RunRequest) -> JobSpec:
    """The job with this run's placement and limits, where the request gives them."""
    changes: dict[str, object] = {}
    if request.devices or request.mig_profile is not None or request.gpu_count is not None:
        changes.update(
            devices=request.devices, mig_profile=request.mig_profile, gpu_count=request.gpu_count
        )
    for name in ("threads_percent", "memory_bytes", "client_priority"):
        value = getattr(request, name)
        if value is not None:
            changes[name] = value
    return validate_spec(replace(job, **changes)) if changes else job  # type: ignore[arg-type]


def _advised(job: JobSpec, request: RunRequest) -> JobSpec:
    """The job with co-location's advice where it names no place or thread share."""
    changes: dict[str, object] = {}
    placed = job.devices or job.mig_profile is not None or job.gpu_count is not None
    if request.advised_devices and not placed:
        changes["devices"] = request.advised_devices
    if request.advised_threads_percent is not None and job.threads_percent is None:
        changes["threads_percent"] = request.advised_threads_percent
    return validate_spec(replace(job, **changes)) if changes else job  # type: ignore[arg-type]


class GpuDown(NamedTuple):
    """An unhealthy GPU as a snapshot had it: its health reason, whether a driver call
    answered NVML_ERROR_GPU_IS_LOST (only a reset or a reboot brings it back), and the codes
    of its uncleared critical XIDs (gpud's own reset, ``gpuctl xid clear`` or a reboot, which
    empties the run directory they are kept in, clears them; the driver's reset does not):
    what a refusal's advice is chosen by, never the reason's words. A lost GPU with XIDs is
    told "reset it (nvidia-smi --gpu-reset -i N), then gpuctl xid clear N, or reboot it"."""

    reason: str
    lost: bool = False
    xids: tuple[int, ...] = ()


def _down(snapshot: Snapshot) -> dict[int, GpuDown]:
    """GPU index -> how it is unhealthy, of each unhealthy GPU of ``snapshot``."""
    return {
        g.identity.index: GpuDown(
            g.reason or "unhealthy", g.lost, tuple(c.xid for c in g.critical_xids)
        )
        for g in snapshot.gpus
        if not g.healthy
    }


class NotPlacedOn(dict[int, str]):
    """GPU index -> why no job is placed there now: it is unhealthy, or it is only held off
    (:attr:`held`: a MIG apply is changing its instances; the GPU answers, and takes jobs
    again once the change ends). One read (:meth:`JobService.unhealthy`) carries both, so a
    refusal's wording agrees with the check it follows."""

    def __init__(
        self,
        unhealthy: Mapping[int, str],
        held_off: Mapping[int, str],
        *,
        down: Mapping[int, GpuDown] | None = None,
    ) -> None:
        """``down``: what the driver answered of the unhealthy GPUs (:attr:`down`), where
        known."""
        super().__init__({**held_off, **unhealthy})
        self.held = frozenset(held_off.keys() - unhealthy.keys())
        known = down or {}
        # each unhealthy GPU's as the snapshot had it; one the caller knew no more of than
        # its reason: neither lost nor with a critical XID known
        self.down = {i: known.get(i, GpuDown(w)) for i, w in unhealthy.items()}

    def only(self, gpus: Collection[int]) -> NotPlacedOn:
        """Those of ``gpus`` it names, each as it names it."""
        return NotPlacedOn(
            {i: w for i, w in self.items() if i in gpus and i not in self.held},
            {i: w for i, w in self.items() if i in gpus and i in self.held},
            down=self.down,
        )


def _without(whys: tuple[str, ...], why: str | None) -> tuple[str, ...]:
    """``whys`` less its newest ``why`` (unchanged where it has none)."""
    if why is None or why not in whys:
        return whys
    at = len(whys) - 1 - whys[::-1].index(why)
    return whys[:at] + whys[at + 1 :]


def _left_out(gpu: int, sick: NotPlacedOn) -> str:
    """``GPU N, which is unhealthy: why``, or for a GPU held off (a MIG apply in flight: it
    is not unhealthy, and is placed on again once the change ends) ``GPU N, where no job is
    placed now: why``."""
    state = "where no job is placed now" if gpu in sick.held else "which is unhealthy"
    return f"GPU {gpu}, {state}: {sick[gpu]}"


def unhealthy_text(sick: NotPlacedOn) -> str:
    """``GPU 1 unhealthy: why; …`` for the first four of ``sick``: how a refused run and a
    queued entry's WHY NOT name the GPUs no job is placed on. One only held off (a MIG apply
    changing its instances) is ``GPU 0 held: why``: it answers, and takes jobs again once
    the apply ends."""
    more = f"; {len(sick) - 4} more" if len(sick) > 4 else ""
    return (
        "; ".join(
            f"GPU {i} {'held' if i in sick.held else 'unhealthy'}: {r}"
            for i, r in sorted(sick.items())[:4]
        )
        + more
    )
