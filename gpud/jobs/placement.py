"""Reservations: which GPUs or MIG devices a running job holds, and with what limits.

A reservation is made when a job starts (``gpuctl run``, or ``gpuctl env --reserve``) and
released when it ends. It names its holder process (PID and start time): a holder that
disappears without releasing (killed launcher) is noticed by :meth:`Reservations.reap` on the
next tick, so nothing stays reserved by a dead process.

Placement is pure (:func:`choose_devices`): given the devices, what is reserved on each and
the request, pick the devices or refuse with the numbers. Memory is the accounted resource:
the MPS pinned memory limits of the reservations on a device never add up to more than the
device has. A request that sets no memory limit gets, on a device with an MPS default pinned
memory limit (``gpuctl mps set --memory``, ``set_default_device_pinned_mem_limit``), that
limit, as its MPS client would: it asks for it there, and its reservation records and counts
it until it ends (a client keeps the limit it started with when the default changes later).

Users: an MPS control daemon serves one user at a time (it starts the MPS server as the user
of its first client; a client of another user waits in its CUDA initialisation until every
client of that server has ended). A reservation keeps the real UID of its holder process, and
with MPS on a job of a known user is not placed on a device that holds a reservation of a
known other user (:mod:`colocate.users`, the rule co-location's planner keeps too): another
device that fits takes it, or it is refused naming that user.

Threads: the MPS active thread shares (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) of the
reservations on a device never add up to more than :data:`MAX_THREADS_PERCENT`; a device
without room for a job's share is no candidate for it, so it is not counted among the idle
ones either. ``gpuctl env``'s preview and the admission gate both place through
:func:`choose_devices` with these loads, so both name the same devices.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from colocate.users import other_users, shared_under_mps
from gpud.errors import NotFound, ResourceExhausted
from gpud.jobs.registry import JobSpec
from gpud.mps.manager import MpsTarget
from gpud.mps.procs import real_uid, runs, start_time
from gpud.shared import MAX_THREADS_PERCENT, format_size, user_name
from gpud.store import StateStore

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS job_reservations (
        id TEXT PRIMARY KEY,
        job TEXT NOT NULL,
        devices TEXT NOT NULL,
        threads_percent INTEGER,
        memory_bytes INTEGER,
        client_priority INTEGER NOT NULL,
        holder_pid INTEGER,
        holder_start INTEGER,
        created_at REAL NOT NULL,
        default_memory TEXT,
        report_token TEXT,
        holder_uid INTEGER,
        request_id TEXT,
        request TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS job_reservations_job ON job_reservations (job)",
)
# columns of job_reservations that earlier versions lack: NULL in their rows
ADDED = {
    "job_reservations": (
        "default_memory",
        "report_token",
        "holder_uid",
        "request_id",
        "request",
    )
}


@dataclass(frozen=True, slots=True)
class Asked:
    """The caller's request id of a reservation and what it was made for: ``arguments``,
    the request's fields as the jobs service compares them, and ``created_job``, whether
    that reservation registered its job (what the first answer said)."""

    request_id: str
    arguments: str
    created_job: bool


@dataclass(frozen=True, slots=True)
class Reservation:
    id: str
    job: str
    devices: tuple[str, ...]  # GPU / MIG UUIDs, in CUDA_VISIBLE_DEVICES order
    threads_percent: int | None
    memory_bytes: int | None  # per device
    client_priority: int
    holder_pid: int | None  # None: held until released explicitly
    created_at: float
    # Without a memory limit of its own: (device UUID, the MPS default memory limit in force
    # there when it was made) for each device that had one, what its MPS client is pinned
    # to. None: made by an earlier version, which kept no such record: it counts each
    # device's default in force now.
    defaults: tuple[tuple[str, int], ...] | None = None
    # The secret its run proves its reports with (GPUD_REPORT_TOKEN): kept with the row, so
    # a restarted gpud still takes them. "": made by an earlier version, which gave none.
    report_token: str = field(default="", repr=False)
    # The real UID of its holder process when it was made; None: unknown (no holder, the
    # holder's /proc unreadable, or made by an earlier version, which kept none).
    uid: int | None = None

    def memory_on(self, uuid: str, default_memory: Callable[[str], int | None]) -> int | None:
        """The memory it holds on device ``uuid``: its own limit, else the default it
        started with (``default_memory(uuid)``, the default now, where it kept none)."""
        if self.memory_bytes is not None:
            return self.memory_bytes
        if self.defaults is None:
            return default_memory(uuid)
        return dict(self.defaults).get(uuid)


@dataclass(frozen=True, slots=True)
class DeviceLoad:
    """What reservations hold on one device, and ``unreserved_bytes``: the memory its GPU
    processes use beyond them (another user's process, a job's past its reservation there;
    NVML's ``usedGpuMemory`` of each, as ``nvidia-smi`` lists it). ``defaulted``: the job of
    each reservation there that sets no memory limit of its own and was made by an earlier
    version, which recorded no default for it: ``memory_bytes`` counts the device's default
    now for it. ``users``: (UID, job) of each reservation there whose holder's user is
    known. ``threads_percent``: the MPS active thread shares of the reservations there
    added up (0 for one that sets none), whatever their user; ``shares``: (job, share) of
    each reservation there that sets one, which a refusal for want of threads names."""

    memory_bytes: int
    jobs: tuple[str, ...]
    unreserved_bytes: int = 0
    defaulted: tuple[str, ...] = ()
    users: tuple[tuple[int, str], ...] = ()
    threads_percent: int = 0
    shares: tuple[tuple[str, int], ...] = ()


class ThreadsFull(ResourceExhausted):
    """A refusal of :func:`choose_devices` that names devices without room for the job's
    MPS active thread share, with the jobs whose shares hold them. ``named``: the UUIDs of
    the devices whose holders the message names already (those, and the one it refuses for
    memory or another user beside them), so a caller that lists holders leaves them out."""

    def __init__(self, message: str, *, named: Collection[str]) -> None:
        super().__init__(message)
        self.named = frozenset(named)


def device_loads(reserved: Mapping[tuple[str, str], int]) -> dict[str, DeviceLoad]:
    """Per device, from :meth:`Reservations.reserved`: the memory reserved and the jobs."""
    memory: dict[str, int] = {}
    jobs: dict[str, list[str]] = {}
    for (uuid, job), n in reserved.items():
        memory[uuid] = memory.get(uuid, 0) + n
        jobs.setdefault(uuid, []).append(job)
    return {u: DeviceLoad(memory[u], tuple(sorted(j))) for u, j in jobs.items()}


def choose_devices(
    spec: JobSpec,
    devices: Sequence[MpsTarget],
    loads: Mapping[str, DeviceLoad],
    *,
    memory_bytes: int | None,
    default_memory: Callable[[str], int | None] = lambda _: None,
    uid: int | None = None,
    name_of: Callable[[int], str] = user_name,
    default_threads: Callable[[str], int | None] = lambda _: None,
    whole_left_out: int = 0,
) -> tuple[MpsTarget, ...]:
    """Where ``spec`` goes: its pinned devices, else one MIG device of ``spec.mig_profile``,
    else ``spec.gpu_count`` whole GPUs (default 1). The least loaded fitting devices win.

    ``memory_bytes`` None asks, on each device, for its MPS default pinned memory limit
    (``default_memory(uuid)``), or for nothing where it has none.

    ``uid``: the user the job's processes run as, given where MPS serves the devices (None:
    unknown, or MPS off). A device where a reservation of another known user is held does
    not take it (its MPS control daemon serves one user at a time); where no other device
    fits, or a pinned device is such, it is refused naming that user (``name_of``).

    Among devices that fit, one whose MPS defaults (``default_threads``, ``default_memory``:
    ``set_default_active_thread_percentage``, ``set_default_device_pinned_mem_limit``) are
    at least the job's own ``threads_percent`` and ``memory_bytes`` comes first: an MPS
    client only narrows its server's limits, so on a device with lower defaults the job would
    get those, not what it asks (``gpuctl run`` warns when it lands on one all the same).
    Then, only where the idle devices that fit (no reservation of a known user) number no
    more than the job wants, one where a reservation of ``uid`` is held, even with more
    jobs (its MPS server runs as that user already: taking the last idle ones would leave
    none for another user); then the one with the fewest distinct jobs
    (``DeviceLoad.jobs``), then the most free memory. So one user's runs that set no limits
    spread over all but the last idle GPU: on four GPUs the fourth shares a GPU serving its
    user and one stays idle. The admission queue places through this function too, so both
    order devices alike.

    A device where ``spec.threads_percent`` would take the thread shares held there
    (``DeviceLoad.threads_percent``) over :data:`MAX_THREADS_PERCENT` is no candidate: it is
    left out before the idle devices are counted, and a pinned one is refused.

    ``whole_left_out``: the GPUs not in MIG mode the node has besides ``devices`` (lost or
    hung, or held off by a MIG apply): a refusal for want of whole GPUs counts them, and
    says how many of them take jobs now.

    Raises :class:`NotFound` for devices the node does not have and
    :class:`ResourceExhausted`, with the numbers, when none has room for what it asks.
    """
    by_uuid = {d.uuid: d for d in devices}
    empty = DeviceLoad(0, ())

    def asks(d: MpsTarget) -> int | None:
        return memory_bytes if memory_bytes is not None else default_memory(d.uuid)

    def free(d: MpsTarget) -> int:
        load = loads.get(d.uuid, empty)
        return d.memory_total_bytes - load.memory_bytes - load.unreserved_bytes

    def fits(d: MpsTarget) -> bool:
        need = asks(d)
        return need is None or free(d) >= need

    def refusal(d: MpsTarget) -> ResourceExhausted:
        load = loads.get(d.uuid, empty)
        holders = f" by {', '.join(load.jobs)}" if load.jobs else ""
        outside = (
            f", {format_size(load.unreserved_bytes)} used beyond reservations"
            if load.unreserved_bytes
            else ""
        )
        default = " (its MPS default memory limit)" if memory_bytes is None else ""
        return ResourceExhausted(
            f"job {spec.name!r} asks {format_size(asks(d) or 0)}{default} on {d.uuid}"
            f" ({d.profile}):"
            f" {format_size(load.memory_bytes)} reserved{holders}{outside} of"
            f" {format_size(d.memory_total_bytes)}, {format_size(max(free(d), 0))} free"
        )

    def others(d: MpsTarget) -> dict[int, tuple[str, ...]]:
        """The other users whose reservations ``d``'s MPS server serves, with their jobs."""
        return other_users(loads.get(d.uuid, empty).users, uid)

    def shared(d: MpsTarget) -> ResourceExhausted:
        held = others(d)
        ends = " and ".join(f"{j}'s" for j in sorted({j for js in held.values() for j in js}))
        return ResourceExhausted(
            f"job {spec.name!r} (uid {uid}) asks {d.uuid}: it is"
            f" {shared_under_mps(held, name_of)}: {spec.name}'s CUDA processes would wait"
            f" there until {ends} end"
        )

    threads = spec.threads_percent or 0

    def has_threads(d: MpsTarget) -> bool:
        return loads.get(d.uuid, empty).threads_percent + threads <= MAX_THREADS_PERCENT

    def short_of_threads(full: Sequence[MpsTarget]) -> str:
        def held(d: MpsTarget) -> str:
            load = loads.get(d.uuid, empty)
            # only the jobs that hold a share: one without takes none of the device's SMs
            shares = [(job, share) for job, share in load.shares if share > 0]
            jobs = ", ".join(j if len(shares) == 1 else f"{j} ({s}%)" for j, s in shares)
            holders = f" by {jobs}" if jobs else ""
            return f"{d.uuid} ({load.threads_percent}% held{holders})"

        return (
            f"{threads}% of the threads of {', '.join(held(d) for d in full)}: the MPS"
            f" thread shares there would add up to over {MAX_THREADS_PERCENT}%"
        )

    def oversubscribed(full: Sequence[MpsTarget]) -> ThreadsFull:
        return ThreadsFull(
            f"job {spec.name!r} asks {short_of_threads(full)}", named=[d.uuid for d in full]
        )

    def besides(
        err: ResourceExhausted, d: MpsTarget, full: Sequence[MpsTarget]
    ) -> ResourceExhausted:
        """``err``, refusing ``d``, with the devices left out for want of threads: the job
        waits for those too."""
        if not full:
            return err
        return ThreadsFull(
            f"{err}; and {short_of_threads(full)}", named=[d.uuid, *(f.uuid for f in full)]
        )

    if spec.devices:
        chosen = []
        for uuid in spec.devices:
            if uuid not in by_uuid:
                raise NotFound(f"job {spec.name!r}: no GPU or MIG device {uuid} on this node")
            if not fits(by_uuid[uuid]):
                raise refusal(by_uuid[uuid])
            if others(by_uuid[uuid]):
                raise shared(by_uuid[uuid])
            if not has_threads(by_uuid[uuid]):
                raise oversubscribed([by_uuid[uuid]])
            chosen.append(by_uuid[uuid])
        return tuple(chosen)

    def narrowed(d: MpsTarget) -> bool:
        """The device's MPS defaults are below what the job asks for itself."""
        threads, memory = default_threads(d.uuid), default_memory(d.uuid)
        return (
            spec.threads_percent is not None
            and threads is not None
            and spec.threads_percent > threads
        ) or (memory_bytes is not None and memory is not None and memory_bytes > memory)

    def serves(d: MpsTarget) -> bool:
        """A reservation of the job's own user holds ``d``: its MPS server runs as them."""
        return uid is not None and any(u == uid for u, _ in loads.get(d.uuid, empty).users)

    def order_by(join: bool) -> Callable[[MpsTarget], tuple[bool, bool, int, int, int, int]]:
        def order(d: MpsTarget) -> tuple[bool, bool, int, int, int, int]:
            load = loads.get(d.uuid, empty)
            first = join and not serves(d)
            return (narrowed(d), first, len(load.jobs), -free(d), d.gpu, d.mig or 0)

        return order

    if spec.mig_profile is not None:
        pool = [d for d in devices if d.mig is not None and d.profile == spec.mig_profile]
        if not pool:
            have = sorted({d.profile for d in devices if d.mig is not None})
            raise NotFound(
                f"job {spec.name!r}: no MIG device of profile {spec.mig_profile} on this node"
                f" (MIG profiles here: {', '.join(have) or 'none'})"
            )
        want = 1
    else:
        pool = [d for d in devices if d.mig is None]
        want = spec.gpu_count or 1
        if len(pool) < want:
            whole = len(pool) + whole_left_out
            now = f", {len(pool)} of them taking jobs now" if whole_left_out else ""
            raise ResourceExhausted(
                f"job {spec.name!r} asks {want} whole GPU{'s' if want > 1 else ''}; this node "
                f"has {whole} GPU{'' if whole == 1 else 's'} not in MIG mode{now}"
            )
    # A device without room for the job's thread share takes no part, not even as an idle
    # one: counted, it would spread a user's runs onto the last device another could take.
    full = [d for d in pool if not has_threads(d)]
    if full:
        pool = [d for d in pool if has_threads(d)]
        if len(pool) < want:
            raise oversubscribed(full)
    # A control daemon serves one user at a time: a user's runs join a device already
    # serving them, even one with more jobs, only where taking the idle ones (no known user)
    # would leave none idle for another user; with idle devices to spare they spread.
    idle = [d for d in pool if fits(d) and not loads.get(d.uuid, empty).users]
    pool.sort(key=order_by(len(idle) <= want))
    fitting = [d for d in pool if fits(d)]
    if len(fitting) < want:
        blocked = [d for d in pool if not fits(d)]
        # name a device the request would fit were less held there; with none, the largest
        could = [d for d in blocked if d.memory_total_bytes >= (asks(d) or 0)]
        named = (
            max(could, key=free)
            if could
            else max(blocked, key=lambda d: (d.memory_total_bytes, free(d)))
        )
        raise besides(refusal(named), named, full)
    alone = [d for d in fitting if not others(d)]
    if len(alone) < want:
        busy = next(d for d in fitting if others(d))
        raise besides(shared(busy), busy, full)
    return tuple(alone[:want])


class Reservations:
    """The ``job_reservations`` table."""

    def __init__(
        self,
        store: StateStore,
        *,
        proc_root: Path = Path("/proc"),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._proc_root = proc_root
        self._clock = clock
        store.ensure_schema(SCHEMA, added=ADDED)

    def reserved(
        self,
        default_memory: Callable[[str], int | None] = lambda _: None,
        *,
        held: Sequence[Reservation] | None = None,
    ) -> dict[tuple[str, str], int]:
        """Memory reserved per (device UUID, job) by ``held`` (default: :meth:`held` read
        now). A reservation without a memory limit counts the MPS default limit it started
        with (:meth:`Reservation.memory_on`), or nothing."""
        out: dict[tuple[str, str], int] = {}
        for r in self.held() if held is None else held:
            for uuid in r.devices:
                limit = r.memory_on(uuid, default_memory)
                out[(uuid, r.job)] = out.get((uuid, r.job), 0) + (limit or 0)
        return out

    def add(
        self,
        job: str,
        devices: Sequence[str],
        *,
        threads_percent: int | None,
        memory_bytes: int | None,
        client_priority: int,
        holder_pid: int | None,
        defaults: Mapping[str, int] | None = None,
        holder_uid: int | None = None,
        asked: Asked | None = None,
    ) -> Reservation:
        """``defaults``: without ``memory_bytes``, the MPS default memory limit of each
        device that has one, as placement counted it (it is counted so until it ends).
        ``holder_uid``: the holder's real UID as placement read it; None reads it now from
        ``/proc/<holder_pid>/status`` (unknown without a holder). ``asked``: the caller's
        request id, kept with the row for :meth:`asked` while it is held."""
        rid = secrets.token_hex(6)
        token = secrets.token_urlsafe()
        recorded = None if memory_bytes is not None else dict(defaults or {})
        holder_start = start_time(holder_pid, self._proc_root) if holder_pid else None
        if holder_uid is None and holder_pid:
            holder_uid = real_uid(holder_pid, self._proc_root)
        created = self._clock()
        with self._store.transaction() as conn:
            conn.execute(
                "INSERT INTO job_reservations (id, job, devices, threads_percent, memory_bytes,"
                " client_priority, holder_pid, holder_start, created_at, default_memory,"
                " report_token, holder_uid, request_id, request)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    rid,
                    job,
                    json.dumps(list(devices)),
                    threads_percent,
                    memory_bytes,
                    client_priority,
                    holder_pid,
                    holder_start,
                    created,
                    None if recorded is None else json.dumps(recorded, sort_keys=True),
                    token,
                    holder_uid,
                    None if asked is None else asked.request_id,
                    None if asked is None else _asked_json(asked),
                ),
            )
        return Reservation(
            rid,
            job,
            tuple(devices),
            threads_percent,
            memory_bytes,
            client_priority,
            holder_pid,
            created,
            None if recorded is None else _defaults(recorded),
            token,
            holder_uid,
        )

    def get(self, rid: str) -> Reservation:
        with self._store.transaction() as conn:
            row = conn.execute("SELECT * FROM job_reservations WHERE id = ?", (rid,)).fetchone()
        if row is None:
            raise NotFound(f"no reservation {rid!r}")
        return _reservation(row)

    def asked(self, request_id: str) -> tuple[Reservation, Asked] | None:
        """The reservation held that was made for the caller's ``request_id``, with what
        it was asked for; None when none held now was (never made, or released since)."""
        with self._store.transaction() as conn:
            row = conn.execute(
                "SELECT * FROM job_reservations WHERE request_id = ? ORDER BY created_at",
                (request_id,),
            ).fetchone()
        if row is None:
            return None
        stored = json.loads(row["request"])
        return _reservation(row), Asked(
            request_id, str(stored["arguments"]), bool(stored["created_job"])
        )

    def held(self, job: str | None = None) -> list[Reservation]:
        """The reservations held (of ``job``, where given), oldest first, read through
        ``store.transaction()``: the writer's connection and lock, so a read takes its turn
        with every write and sees each reservation and release made before it began,
        including one in this thread's open transaction not yet committed, and none rolled
        back. The traffic tick's count of run starts and ends (``gpud.net.wiring``) is
        correct only so: never read them through ``store.reading()``, whose snapshot holds
        only what was committed (within it, this reads that snapshot)."""
        with self._store.transaction() as conn:
            if job is None:
                rows = conn.execute("SELECT * FROM job_reservations ORDER BY created_at").fetchall()
            else:
                rows = conn.execute(
                    "SELECT * FROM job_reservations WHERE job = ? ORDER BY created_at", (job,)
                ).fetchall()
        return [_reservation(r) for r in rows]

    def job_of_token(self, token: str) -> str | None:
        """The job of the reservation whose report token is ``token``; None when no
        reservation held now has it (a released or reaped run's, a made-up one)."""
        if not token:
            return None
        with self._store.transaction() as conn:
            row = conn.execute(
                "SELECT job FROM job_reservations WHERE report_token = ?", (token,)
            ).fetchone()
        return None if row is None else str(row["job"])

    def release(self, rid: str) -> Reservation:
        with self._store.transaction() as conn:
            reservation = self.get(rid)
            conn.execute("DELETE FROM job_reservations WHERE id = ?", (rid,))
        return reservation

    def release_job(self, job: str) -> list[Reservation]:
        with self._store.transaction() as conn:
            held = self.held(job)
            conn.execute("DELETE FROM job_reservations WHERE job = ?", (job,))
        return held

    def reap(self) -> list[Reservation]:
        """Release reservations whose holder process is gone (or its PID was reused)."""
        gone: list[Reservation] = []
        with self._store.transaction() as conn:
            rows = conn.execute(
                "SELECT * FROM job_reservations WHERE holder_pid IS NOT NULL"
            ).fetchall()
            for row in rows:
                pid, started = row["holder_pid"], row["holder_start"]
                if runs(pid, started, self._proc_root):
                    continue
                conn.execute("DELETE FROM job_reservations WHERE id = ?", (row["id"],))
                gone.append(_reservation(row))
        return gone


def _asked_json(asked: Asked) -> str:
    return json.dumps(
        {"arguments": asked.arguments, "created_job": asked.created_job}, sort_keys=True
    )


def _defaults(recorded: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((str(u), int(n)) for u, n in recorded.items()))


def _reservation(row: sqlite3.Row) -> Reservation:
    recorded = row["default_memory"]
    return Reservation(
        id=row["id"],
        job=row["job"],
        devices=tuple(json.loads(row["devices"])),
        threads_percent=row["threads_percent"],
        memory_bytes=row["memory_bytes"],
        client_priority=row["client_priority"],
        holder_pid=row["holder_pid"],
        created_at=row["created_at"],
        defaults=None if recorded is None else _defaults(json.loads(recorded)),
        report_token=row["report_token"] or "",
        uid=row["holder_uid"],
    )
