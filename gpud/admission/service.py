"""The admission queue in the daemon: persisted with the jobs, run on every tick.

Tables (in the daemon's ``state.db``, beside ``jobs`` and ``job_reservations``):

- ``admission_queue``: one row per queued request, in ``seq`` order. A row becomes
  ``started`` in the same SQLite transaction that adds its reservation, so a restart of gpud
  (or a crash at any point) neither loses a queued job nor starts one twice; a waiting
  ``gpuctl run`` finds its entry again after the restart. A row whose holder process is
  gone (the waiting ``gpuctl`` was killed) is marked ``left`` on the next tick.
- ``job_history``: one row per reservation: when it was asked for, started, ended, the
  quote it was given, and how it ended (its command's exit status, or what released it:
  :class:`~gpud.jobs.ends.EndCause`). The quotes are estimated from it; ``gpuctl jobs
  history --json`` exports it. ``admission.history_keep`` bounds it: the ended rows past the
  newest that many go, oldest first; a run still running keeps its row however old. A run
  ``gpuctl jobs rm --force`` removed ends at the removal until its ``gpuctl run`` reports
  the command's exit (``reported_at``): the row then ends there, as the run did, and is
  kept past the bound until then.

Every reservation, queued or not, passes :meth:`AdmissionService.gate`: a job that fits now
still waits if starting it could delay the head of the queue.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import secrets
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from gpud.admission.classes import ClassView, ClassViews
from gpud.admission.estimate import Record, residual_of_waits
from gpud.admission.feasibility import classify, resolve_configs
from gpud.admission.history import HistoryMirror
from gpud.admission.model import (
    NEVER_READ,
    NO_JOB,
    Demand,
    Device,
    FitCheck,
    Holding,
    Loads,
    Request,
    Unfeasible,
    Vec,
    serving_devices,
)
from gpud.admission.node import from_targets
from gpud.admission.passes import Inline, Passes
from gpud.admission.placement_fit import PlacementFit
from gpud.admission.queue import Queued, admission_pass
from gpud.admission.quote import Running, job_quote, overdue
from gpud.config import AdmissionConfig, FileStamp, file_stamp
from gpud.errors import FailedPrecondition, GpudError, NotFound, ResourceExhausted, Unavailable
from gpud.events import EventLog
from gpud.histogram import Histogram
from gpud.jobs.ends import NO_STATUS, EndCause, RunEnd
from gpud.jobs.placement import DeviceLoad, Reservation, ThreadsFull
from gpud.jobs.registry import JobKind, JobSpec
from gpud.jobs.service import (
    JobService,
    NotPlacedOn,
    RunRequest,
    request_arguments,
    unhealthy_text,
)
from gpud.mig.layout import DeviceLayout, MigConfigFile, load_config
from gpud.mps.manager import MpsManager, MpsTarget
from gpud.mps.procs import real_uid, runs, start_ticks, stat_fields
from gpud.shared import MAX_THREADS_PERCENT, started_not_left, user_name, user_names
from gpud.store import StateStore
from gpud.telemetry.sampler import critical_xid_reason

log = logging.getLogger(__name__)

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS admission_queue (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        job TEXT NOT NULL,
        request TEXT NOT NULL,
        holder_pid INTEGER,
        holder_start INTEGER,
        enqueued_at REAL NOT NULL,
        quote_s REAL,
        state TEXT NOT NULL,
        reservation TEXT,
        changed_at REAL NOT NULL,
        left_why TEXT,
        holder_uid INTEGER,
        left_by TEXT,
        request_id TEXT,
        asked TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS admission_queue_state ON admission_queue (state, seq)",
    """CREATE TABLE IF NOT EXISTS job_history (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job TEXT NOT NULL,
        reservation TEXT NOT NULL UNIQUE,
        request_class TEXT NOT NULL,
        request TEXT NOT NULL,
        queued_at REAL NOT NULL,
        started_at REAL NOT NULL,
        ended_at REAL,
        quote_s REAL,
        exit_code INTEGER,
        exit_signal INTEGER,
        end_cause TEXT,
        reported_at REAL,
        holder_uid INTEGER
    )""",
    "CREATE INDEX IF NOT EXISTS job_history_queued ON job_history (queued_at)",
)
# Columns added since the first version of these tables: an older state.db gets them at start.
ADDED = {
    "job_history": ("exit_code", "exit_signal", "end_cause", "reported_at", "holder_uid"),
    "admission_queue": ("left_why", "holder_uid", "left_by", "request_id", "asked"),
}

QUEUED, STARTED, LEFT = "queued", "started", "left"
OFF = "the admission queue is off (admission.enabled = false)"
OPERATOR_LEFT = "gpuctl queue --leave took it out"
JOB_REMOVED_LEFT = "the job was removed (gpuctl jobs rm --force)"
# Started and left rows are kept this long for a waiting gpuctl to read, then dropped.
DONE_KEEP_S = 3600.0
# Placement requests whose classification is kept beyond the queue's: the jobs added and
# run meanwhile (every distinct --memory size a sweep asks is one), dropped past it.
DEMANDS_KEEP = 256
# the history window's class views: (the mirror's members and the window they were made
# for, the request of each class in the window, the views)
_Window = tuple[tuple[tuple[int, int, int], float], dict[str, Request], ClassViews]
# gpud_admission_wait_seconds' buckets, seconds
WAIT_BUCKETS = (1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)


@dataclass(frozen=True, slots=True)
class Entry:
    id: str
    seq: int
    job: str
    request: RunRequest
    enqueued_at: float
    quote_s: float | None
    state: str
    reservation: str | None
    changed_at: float
    # /proc/PID/stat's start time of request.holder_pid when queued (None: not read)
    holder_start: int | None = None
    # why it left, where gpud took it out for a reason its waiting gpuctl should be told
    left_why: str = ""
    # the real UID of request.holder_pid when queued (None: no holder, /proc did not say,
    # or queued by an earlier gpud version)
    holder_uid: int | None = None
    # who took it out: an operator (OPERATOR_LEFT), its own gpuctl run as it stopped, the
    # job's removal (JOB_REMOVED_LEFT) or its holder gone ("" where gpud took it out for a
    # left_why, or an earlier gpud version did)
    left_by: str = ""
    # request_of(request), and its class key: made once (every listing of the queue asks
    # them of every entry)
    placement: Request = field(init=False, compare=False, repr=False)
    request_class: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        placement = request_of(self.request)
        object.__setattr__(self, "placement", placement)
        object.__setattr__(self, "request_class", placement.describe())


@dataclass(frozen=True, slots=True)
class EntryView:
    """An entry as ``gpuctl`` shows it."""

    entry: Entry
    position: int  # 1 = head; 0 when not queued
    waited_s: float
    quote_s: float | None  # remaining; inf: unbounded; None: nothing known loads its pool
    unfeasible: Unfeasible | None
    reservation: Reservation | None
    env: dict[str, str]
    # what it waits for besides other jobs: unhealthy GPUs of its pool, or why its last
    # start failed (no DSCP tag left, ...)
    waiting_on: str = ""
    # the runs holding its devices, where every one has run past its estimated run time:
    # no wait is quoted (quote_s None), these are named instead
    overdue: tuple[Running, ...] = ()
    # the unhealthy GPUs of its pool, where too few healthy devices are left in it: it
    # waits for them to answer again, which no run time tells, so no wait is quoted
    unhealthy: str = ""


@dataclass(frozen=True, slots=True)
class HistoryRow:
    job: str
    request_class: str
    request: RunRequest
    reservation: str
    queued_at: float
    started_at: float
    ended_at: float | None
    quote_s: float | None
    # how it ended (gpud.jobs.ends): None while it runs, or when it ended before gpud kept it
    exit_code: int | None = None
    exit_signal: int | None = None
    end_cause: str | None = None
    # when a removed run's gpuctl reported its command's exit (the end moved there); None
    # for every other run, and a removed run that has not reported
    reported_at: float | None = None
    # the real UID of the run's holder, from its reservation at the start (None: unknown)
    holder_uid: int | None = None
    row_id: int = 0  # its place in the history, for paging (newer runs have higher ones)

    def record(self) -> Record:
        return Record(
            self.job,
            self.request_class,
            self.queued_at,
            self.started_at,
            self.ended_at,
            self.quote_s,
        )


def request_of(r: RunRequest | JobSpec) -> Request:
    return Request(
        devices=tuple(r.devices),
        mig_profile=r.mig_profile,
        gpu_count=r.gpu_count,
        memory_bytes=r.memory_bytes,
        threads_percent=r.threads_percent,
    )


# Kept in its own column (admission_queue.request_id), never in the stored request: a gpud
# from before request ids, started on this database, reads each stored request back as a
# RunRequest of its own fields.
_NOT_STORED = ("request_id",)
_STORED_FIELDS = frozenset(f.name for f in fields(RunRequest))


def run_request_to_json(r: RunRequest) -> str:
    """``r`` as admission_queue.request and job_history.request keep it: its fields but
    the request id."""
    data = asdict(r)
    for name in _NOT_STORED:
        del data[name]
    data["kind"] = r.kind.value if r.kind is not None else None
    data["devices"] = list(r.devices)
    return json.dumps(data, sort_keys=True)


def run_request_from_json(text: str) -> RunRequest:
    """A stored request (:func:`run_request_to_json`) read back; a key this gpud has no
    field for (written by a newer gpud before a downgrade) is left out."""
    data = {k: v for k, v in json.loads(text).items() if k in _STORED_FIELDS}
    data["kind"] = JobKind(data["kind"]) if data.get("kind") else None
    data["devices"] = tuple(data.get("devices", ()))
    data["advised_devices"] = tuple(data.get("advised_devices", ()))
    return RunRequest(**data)


class AdmissionService:
    def __init__(
        self,
        store: StateStore,
        jobs: JobService,
        mps: MpsManager,
        events: EventLog,
        config: AdmissionConfig,
        *,
        products: Callable[[], Mapping[int, str]] = dict,
        mig_layouts: Callable[[], Mapping[str, Mapping[int, DeviceLayout]]] | None = None,
        fit_for: Callable[[Sequence[Device]], FitCheck] = PlacementFit,
        proc_root: Path = Path("/proc"),
        read_stat: Callable[[int, Path], list[str] | None] = stat_fields,
        clock: Callable[[], float] = time.time,
        passes: Callable[[Callable[[], None]], Passes] = Inline,
    ) -> None:
        self._store = store
        self._jobs = jobs
        self._mps = mps
        self._events = events
        self.config = config
        self._products = products
        self._mig_layouts = mig_layouts or self._layouts_from_file
        self._fit_for = fit_for
        self._proc_root = proc_root
        self._read_stat = read_stat  # /proc/<pid>/stat's fields: a holder's check
        self._clock = clock
        self._starting: Entry | None = None
        self._start_failures: dict[str, str] = {}  # entry -> why it could not start last
        # (entry, why) said at WARNING: once each while it is queued, as its GPU comes and goes
        self._start_said: set[tuple[str, str]] = set()
        self._fit: tuple[tuple[Device, ...], FitCheck] | None = None
        self._demands: dict[Request, Demand | Unfeasible] = {}
        self._views_cache: tuple[object, dict[str, ClassView]] | None = None
        self._mirror = HistoryMirror(
            lambda text: request_of(run_request_from_json(text)), removed=EndCause.REMOVED.value
        )
        # the window's requests and class views, by the rows it holds
        self._window: _Window | None = None
        self._window_at = -math.inf  # the clock when the window was last made or changed
        self._quote_error: tuple[object, tuple[float, int]] | None = None
        self._kept_lock = threading.Lock()  # the three above and the kept history
        self._decoded: dict[tuple[object, ...], Entry] = {}  # by row, the last read's
        # Little's law on the daemon's own measurements: the integral of the queue length.
        self._area = 0.0
        self._area_since: float | None = None
        self._last_length = 0
        self._last_tick: float | None = None
        # told once entries changed state (started, left), outside every transaction: a
        # waiting GetEntry answers then (set from any thread, so they must not block)
        self._listeners: list[Callable[[], None]] = []
        self._changed = False  # an entry changed state since the listeners were last told
        # waits of the runs started since gpud started: gpud_admission_wait_seconds
        self.waits = Histogram(WAIT_BUCKETS)
        store.ensure_schema(SCHEMA, added=ADDED)
        self._end_unrecorded()
        with jobs.locked():
            self._drop_if_off()
        jobs.add_observer(self._observe)
        jobs.add_late_end(self._removed_run_ended)
        jobs.add_removal_hook(self._job_removed)
        # devices freed (a release, a job removed, a holder gone) or an entry left: the next
        # queued job starts now, not at the next tick, and its waiting gpuctl is told at
        # once. ``passes`` runs those passes (the daemon's: on a thread of its own, asks
        # coalesced, so the call that freed or left returns once its own change is kept).
        self.passes = passes(self.tick)
        jobs.add_freed_hook(self.passes.ask)
        jobs.gate = self.gate
        jobs.refuse_never = self.refuse_never

    def _end_unrecorded(self) -> None:
        """End the history rows of runs whose reservation is gone though the row says they
        run: a gpud that kept no job history (an earlier version, started on this state
        directory in between) released them. They end now, as far as this gpud can tell
        (``unrecorded``), rather than run for good in ``gpuctl jobs history`` and the
        quotes."""
        held = {r.id for r in self._jobs.reservations.held()}
        with self._store.transaction() as conn:
            rows = conn.execute("SELECT reservation FROM job_history WHERE ended_at IS NULL")
            gone = [str(row[0]) for row in rows.fetchall() if row[0] not in held]
            conn.executemany(
                "UPDATE job_history SET ended_at = MAX(started_at, ?), end_cause = ?"
                " WHERE reservation = ? AND ended_at IS NULL",
                [(self._clock(), EndCause.UNRECORDED.value, reservation) for reservation in gone],
            )
        if gone:
            log.warning(
                "job history: %d run(s) ended while a gpud that kept no history ran (%s): "
                "ended now",
                len(gone),
                ", ".join(gone[:8]),
            )

    # -- devices and fit ------------------------------------------------------------------
    def fit(self) -> FitCheck | None:
        """What fits, over the devices the daemon sees now (None before the first sample)."""
        limits = self._mps.all_limits()
        memory = {u: n.memory_bytes for u, n in limits.items() if n.memory_bytes is not None}
        # as the jobs service places: a thread share narrows a job's only where MPS serves
        threads = {
            u: n.threads_percent
            for u, n in limits.items()
            if n.threads_percent is not None and self._mps.enabled
        }
        devices = tuple(from_targets(self._mps.targets(), self._products(), memory, threads))
        if not devices:
            return None
        if self._fit is None or self._fit[0] != devices:
            self._fit = (devices, self._fit_for(devices))
            self._demands = {}
        return self._fit[1]

    def _layouts_from_file(self) -> Mapping[str, Mapping[int, DeviceLayout]]:
        return {}

    def set_mig_file_layouts(
        self, layouts: Callable[[], Mapping[str, Mapping[int, DeviceLayout]]]
    ) -> None:
        self._mig_layouts = layouts

    def classify(self, request: Request, fit: FitCheck) -> Demand | Unfeasible:
        cached = self._demands.get(request)
        if isinstance(cached, Demand):
            return cached
        verdict = classify(
            request,
            fit,
            configs=self._mig_layouts(),
            products=self._products(),
            fit_for=self._fit_for,
            config_file=str(self.config.mig_config or ""),
        )
        self._demands[request] = verdict
        return verdict

    def holdings(self) -> list[Holding]:
        """What the reservations hold, the memory processes use beyond them (another user's
        process holds what no reservation does), and more than the whole of every unhealthy
        GPU's devices (over capacity, so that even a request that sets no limits finds no
        room there): a queued job waits for the GPU to answer again rather than start on it."""
        out = []
        sick = self._jobs.unhealthy()
        for t in self._mps.targets():
            if t.gpu in sick:
                full = Vec(t.memory_total_bytes + 1, MAX_THREADS_PERCENT + 1)
                out.append(Holding(f"unhealthy:{t.uuid}", (t.uuid,), full, name=NO_JOB))
        for r in self._jobs.reservations.held():
            threads = r.threads_percent or 0
            uid = r.uid if self._mps.enabled else None  # MPS off: users share devices
            if r.memory_bytes is not None:
                out.append(Holding(r.id, r.devices, Vec(r.memory_bytes, threads), uid, name=r.job))
                continue
            # no limit of its own: on each device the MPS default its client started with
            for uuid in r.devices:
                memory = r.memory_on(uuid, lambda u: self._mps.limits(u).memory_bytes) or 0
                out.append(Holding(r.id, (uuid,), Vec(memory, threads), uid, name=r.job))
        for uuid, used in sorted(self._jobs.unreserved_memory().items()):
            out.append(Holding(f"unreserved:{uuid}", (uuid,), Vec(used, 0), name=NO_JOB))
        return out

    # -- queue rows -----------------------------------------------------------------------
    def entries(self, state: str | None = QUEUED) -> list[Entry]:
        with self._store.transaction() as conn:
            if state is None:
                rows = conn.execute("SELECT * FROM admission_queue ORDER BY seq").fetchall()
            else:
                rows = conn.execute(
                    "SELECT * FROM admission_queue WHERE state = ? ORDER BY seq", (state,)
                ).fetchall()
        # rows unchanged since the last read keep their entry (a row's every column is its
        # key): a listing reads every row, and decoding each request again was most of its
        # cost with hundreds queued. Reads from several threads at once only miss.
        decoded, kept = self._decoded, {}
        for r in rows:
            key = tuple(r)
            kept[key] = decoded.get(key) or _entry(r)
        self._decoded = kept
        return list(kept.values())

    def entry(self, entry_id: str) -> Entry:
        with self._store.transaction() as conn:
            row = conn.execute("SELECT * FROM admission_queue WHERE id = ?", (entry_id,)).fetchone()
        if row is None:
            raise NotFound(f"no queue entry {entry_id!r}")
        return _entry(row)

    def add_listener(self, changed: Callable[[], None]) -> None:
        """``changed()`` is called, from whichever thread made the change and after it was
        committed, once queue entries changed state; it must not block."""
        self._listeners.append(changed)

    def _tell(self) -> None:
        if self._changed:
            self._changed = False
            for changed in self._listeners:
                changed()

    def _set_state(
        self,
        entry_id: str,
        state: str,
        reservation: str | None = None,
        *,
        why: str | None = None,
        by: str | None = None,
    ) -> None:
        self._changed = True
        with self._store.transaction() as conn:
            conn.execute(
                "UPDATE admission_queue SET state = ?, reservation = ?, changed_at = ?,"
                " left_why = ?, left_by = ? WHERE id = ?",
                (state, reservation, self._clock(), why, by, entry_id),
            )

    def _drop_if_off(self) -> None:
        """With the queue off (``admission.enabled = false``: at a start on a state
        directory an earlier gpud queued entries in, or by a reload), no queued entry
        starts: each leaves, saying so in an event and to its waiting ``gpuctl run``
        (``left_why``), as a new ``gpuctl run`` is refused rather than queued."""
        if self.config.enabled:
            return
        for e in self.entries():
            self._set_state(e.id, LEFT, why=OFF)
            self._events.emit(
                "admission.leave",
                f"job {e.job} left the queue: {OFF}; nothing was started",
                job=e.job,
                entry=e.id,
            )

    # -- API ------------------------------------------------------------------------------
    def enqueue(self, request: RunRequest, *, keep_unfeasible: bool = False) -> EntryView:
        """Queue ``request``; its entry as it is now. With a ``request.request_id``, an entry
        kept for that id (queued, or ended less than DONE_KEEP_S ago) is answered as it is
        now, nothing queued again: the same call tried again after its answer was lost. The
        same id with other fields (or another ``keep_unfeasible``) is refused
        (FailedPrecondition naming the id)."""
        if not self.config.enabled:
            raise FailedPrecondition(OFF)
        asked = json.dumps(
            {"request": request_arguments(request), "keep_unfeasible": keep_unfeasible},
            sort_keys=True,
        )
        entry_id = self._enqueue(
            self._jobs.resolved(request), keep_unfeasible=keep_unfeasible, asked=asked
        )
        self.tick()
        return self.view(entry_id)

    def _queued_for(self, request_id: str, asked: str) -> str | None:
        """The id of the entry kept for the caller's ``request_id``, asked as ``asked``;
        None when none is kept."""
        with self._store.transaction() as conn:
            row = conn.execute(
                "SELECT id, job, asked FROM admission_queue WHERE request_id = ? ORDER BY seq",
                (request_id,),
            ).fetchone()
        if row is None:
            return None
        if row["asked"] != asked:
            raise FailedPrecondition(
                f"request id {request_id!r} was given to queue entry {row['id']} of job"
                f" {row['job']} with other fields: a new entry needs a new request id"
            )
        log.info(
            "job %s: queue entry %s asked again with request id %s: answered as kept",
            row["job"],
            row["id"],
            request_id,
        )
        return str(row["id"])

    def _enqueue(self, request: RunRequest, *, keep_unfeasible: bool, asked: str) -> str:
        """:meth:`enqueue` up to the entry kept; its id."""
        with self._jobs.locked():
            if (
                request.request_id
                and (kept := self._queued_for(request.request_id, asked)) is not None
            ):
                return kept
            # A new job is registered in its entry's transaction: a crash or a refusal
            # before then leaves no job behind.
            job, new = self._jobs.job_for(request)
            fit = self.fit()
            if fit is None:
                raise Unavailable("no GPU seen yet: the daemon is starting, retry shortly")
            spec = _effective(job, request)
            verdict = self.classify(request_of(spec), fit)
            if isinstance(verdict, Unfeasible) and not keep_unfeasible:
                # pinned to the UUID a GPU not read since gpud started was last seen with:
                # refused as the run would be, naming that GPU, not as a device not here
                self._jobs.refuse_last_seen(spec)
                raise _never(job.name, verdict, self._whole_down(spec, fit))
            queued = self.entries()
            if len(queued) >= self.config.max_queue:
                raise ResourceExhausted(
                    f"job {job.name!r} cannot be queued: the admission queue is full"
                    f" ({len(queued)} jobs waiting, admission.max_queue = {self.config.max_queue})"
                )
            stored = replace(
                request,
                request_id="",  # its entry's: the reservation it starts is the queue's
                devices=spec.devices,
                mig_profile=spec.mig_profile,
                gpu_count=spec.gpu_count,
                threads_percent=spec.threads_percent,
                memory_bytes=spec.memory_bytes,
                client_priority=spec.client_priority,
            )
            entry_id = secrets.token_hex(6)
            now = self._clock()
            holder_start, holder_uid = (
                (
                    # read as each pass reads it, so a pass compares like with like
                    self._holder_start(request.holder_pid),
                    real_uid(request.holder_pid, self._proc_root),
                )
                if request.holder_pid
                else (None, None)
            )
            sick = self._jobs.unhealthy()
            views = self._views(fit, [*queued, _draft(entry_id, job.name, stored, now)], sick)
            quote, _ = (
                (None, ())
                if isinstance(verdict, Demand) and self._waits_for_sick(verdict, sick)
                else self._quote(
                    views,
                    request_of(spec),
                    _classes(queued),
                    waited_s=0.0,
                    running=self._running(views, now),
                )
            )
            with self._store.transaction() as conn:
                if new:
                    job = self._jobs.registry.add(job)
                conn.execute(
                    "INSERT INTO admission_queue (id, job, request, holder_pid, holder_start,"
                    " holder_uid, enqueued_at, quote_s, state, changed_at, request_id, asked)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        entry_id,
                        job.name,
                        run_request_to_json(stored),
                        request.holder_pid,
                        holder_start,
                        holder_uid,
                        now,
                        quote if quote is not None and math.isfinite(quote) else None,
                        QUEUED,
                        now,
                        request.request_id or None,
                        asked if request.request_id else None,
                    ),
                )
        if new:
            self._jobs.say_added(job)
        self._events.emit(
            "admission.queue",
            f"job {job.name} queued ({request_of(spec).label()})",
            job=job.name,
            entry=entry_id,
            quote_s=quote if quote is not None and math.isfinite(quote) else None,
        )
        return entry_id

    def _waits_for_sick(self, demand: Demand, sick: NotPlacedOn) -> bool:
        """Whether ``demand``'s pool has too few healthy devices left (no quote holds)."""
        return bool(sick) and bool(_unhealthy_in(demand, sick, self._mps.targets()))

    def leave(self, entry_id: str, *, stopped_by: str | None = None) -> EntryView:
        """Take a queued entry out. ``stopped_by``: its own ``gpuctl run`` leaves as it
        stops, sent that signal ("" when not known), and is answered the entry as it is
        whatever its state (one that started as it left: the run releases its reservation).
        None: an operator takes it out (``gpuctl queue --leave ID``); an entry no longer
        queued is refused (FailedPrecondition), saying what it is now: started (its
        reservation and devices, which the job goes on using), ended, or left already."""
        by = OPERATOR_LEFT
        if stopped_by is not None:
            by = f"its gpuctl run was stopped{f' ({stopped_by})' if stopped_by else ''}"
        why = "" if stopped_by is None else f": {by}"
        with self._jobs.locked():
            entry = self.entry(entry_id)
            if entry.state == QUEUED:
                self._set_state(entry_id, LEFT, by=by)
                self._events.emit(
                    "admission.leave",
                    f"job {entry.job} left the queue{why}",
                    job=entry.job,
                    entry=entry_id,
                )
                self._tell()  # committed: the waiting runs move up now, not after the pass
        if entry.state == QUEUED:
            self.passes.ask()  # the entries it held back may start now
        view = self.view(entry_id)
        if entry.state != QUEUED and stopped_by is None:
            raise FailedPrecondition(self._not_left(view))
        return view

    def _not_left(self, view: EntryView) -> str:
        """Why an operator's leave of an entry no longer queued took nothing out."""
        entry = view.entry
        if entry.state == STARTED:
            r = view.reservation
            return started_not_left(entry.job, entry.id, r.id if r else "", r.devices if r else ())
        ago = max(0.0, self._clock() - entry.changed_at)
        said = entry.left_why or entry.left_by
        why = f": {said}" if said else ""
        return (
            f"job {entry.job} ({entry.id}) did not leave the queue: it left it already,"
            f" {ago:.0f} s ago{why}"
        )

    def _job_removed(self, job: str, force: bool) -> None:
        """A job is being removed (under the placement lock): its queued entries would
        otherwise start it again once its devices free. Without ``force`` that is refused
        (a `gpuctl run` may be waiting in one); with it they leave the queue, in the
        removal's transaction (their events are said once it committed): nothing to do
        once committed."""
        mine = [e for e in self.entries() if e.job == job]
        if not mine:
            return
        ids = ", ".join(e.id for e in mine)
        if not force:
            raise FailedPrecondition(
                f"job {job!r} is queued ({ids}): `gpuctl queue --leave ID` takes it out, or "
                f"`gpuctl jobs rm --force {job}` removes the job and its place in the queue"
            )
        for e in mine:
            self._set_state(e.id, LEFT, by=JOB_REMOVED_LEFT)
            self._events.emit(
                "admission.leave",
                f"job {job} left the queue: the job was removed",
                job=job,
                entry=e.id,
            )

    def view(self, entry_id: str) -> EntryView:
        """The entry as it is now: queued, with its place and quote as the listing gives
        them; otherwise as it ended, with the reservation it started in."""
        entry = self.entry(entry_id)
        if entry.state == QUEUED:
            # the queue is read apart from the entry, with no lock between: the pass
            # thread may have started it, or a Leave taken it out, in the meantime
            mine = (v for v in self._queue_views(entry_id) if v.entry.id == entry_id)
            queued = next(mine, None)
            if queued is not None:
                return queued
            entry = self.entry(entry_id)
        return self._ended_view(entry)

    def _ended_view(self, entry: Entry) -> EntryView:
        reservation = None
        env: dict[str, str] = {}
        if entry.reservation:
            try:
                reservation = self._jobs.reservations.get(entry.reservation)
                env = self._jobs.env_for(reservation)
            except NotFound:
                reservation = None
        return EntryView(
            entry,
            0,
            _waited(entry.changed_at, entry),
            None,
            None,
            reservation,
            env,
            waiting_on=entry.left_why,
        )

    def queue_views(self) -> list[EntryView]:
        """Queued entries in order, quotable first, with positions and remaining quotes."""
        return self._queue_views(None)

    def _queue_views(self, only: str | None) -> list[EntryView]:
        """:meth:`queue_views`, or with ``only`` an entry's id, that entry's view alone (as
        the listing gives it): the entries ahead count by class, and no other entry's quote
        or WHY NOT is made. The Enqueue and Leave answers, a GetEntry without ``wait_s``, a
        waiting call's entry missing from the listing it read (it ended, or came after it)
        ask for one entry: making every entry's took an enqueue time that grew with the
        queue. Calls that wait with ``wait_s`` share one whole listing per queue change
        (the API's ``_queued``)."""
        queued = self.entries()
        fit = self.fit()
        now = self._clock()
        if fit is None:
            return [
                EntryView(e, i + 1, _waited(now, e), None, None, None, {})
                for i, e in enumerate(queued)
            ]
        sick = self._jobs.unhealthy()  # once: the class models and the WHY NOT agree
        views = self._views(fit, queued, sick)
        targets = self._mps.targets() if sick else []
        out: list[EntryView] = []
        unfeasible: list[EntryView] = []
        head: Entry | None = None  # the first quotable entry, which the others wait behind
        ahead_classes: Counter[str] = Counter()
        held = _Held(self._jobs, sick, user_names())  # each user looked up once
        running = self._running(views, now, held.loads()) if queued else []
        position = 0
        for e in queued:
            verdict = self.classify(e.placement, fit)
            if isinstance(verdict, Unfeasible):
                if only in (None, e.id):
                    unfeasible.append(EntryView(e, 0, _waited(now, e), None, verdict, None, {}))
                continue
            position += 1
            if only in (None, e.id):
                down = _unhealthy_in(verdict, sick, targets)
                quote, late = (
                    (None, ())
                    if down
                    else self._quote(
                        views, e.placement, ahead_classes, waited_s=_waited(now, e), running=running
                    )
                )
                out.append(
                    EntryView(
                        e,
                        position,
                        _waited(now, e),
                        quote,
                        None,
                        None,
                        {},
                        waiting_on=down or self._start_failures.get(e.id, "") or held.why(e, head),
                        overdue=late,
                        unhealthy=down,
                    )
                )
            head = head or e
            ahead_classes[e.request_class] += 1
        return out + unfeasible

    def lengths(self) -> tuple[int, int]:
        """How many queued entries are quotable and how many can never start here as the
        node is: :meth:`queue_views`' counts, without the rest of each view."""
        queued = self.entries()
        fit = self.fit()
        if fit is None:
            return len(queued), 0
        unfeasible = sum(
            1 for e in queued if isinstance(self.classify(e.placement, fit), Unfeasible)
        )
        return len(queued) - unfeasible, unfeasible

    def explain(self) -> list[ClassView]:
        fit = self.fit()
        if fit is None:
            return []
        return list(self._views(fit, self.entries()).values())

    def _views(
        self, fit: FitCheck, queued: Sequence[Entry], sick: NotPlacedOn | None = None
    ) -> dict[str, ClassView]:
        """The class models, over the GPUs that answer (a GPU lost, hung or held by a MIG
        apply serves no job now); made again when the history, the queue's classes, the
        devices, the GPUs no job is placed on or the second change (every waiting ``gpuctl`` polls, every scrape asks). The
        history is read from :class:`HistoryMirror` (only what changed since the last time)
        and what does not move with the time is kept while the window holds the same runs
        (:class:`ClassViews`): a second's quotes cost the runs still running, not every run
        in the window. ``sick``: :meth:`JobService.unhealthy`, where the caller read it."""
        with self._kept_lock:  # asked from every thread: the kept history moves on in place
            now = self._clock()
            window_s = self.config.history_window_s
            with self._store.transaction() as conn:
                self._mirror.refresh(conn)
            members = self._mirror.members(now - window_s, now)
            # a GPU that does not answer serves no class: K_EFF counts the others
            sick = self._jobs.unhealthy() if sick is None else sick
            down = {gpu: unhealthy_text(sick.only({gpu})) for gpu in sick}
            key = (
                members,
                _classes_of(queued),
                id(fit),
                int(now),
                window_s,
                frozenset(down.items()),
            )
            if self._views_cache is not None and self._views_cache[0] == key:
                return self._views_cache[1]
            window = self._window
            if window is None or window[0] != (members, window_s):
                window = self._window_changed(members, window_s, now)
                if window is None:
                    requests: dict[str, Request] = {}
                    records = []
                    for record, request in self._mirror.since(now - window_s):
                        requests[record.request_class] = request
                        records.append(record)
                    made = ClassViews(records, now=now, window_s=window_s)
                    window = ((members, window_s), requests, made)
                self._window = window
            self._window_at = now
            _, requests, made = window
            requests = dict(requests)
            for e in queued:
                requests[e.request_class] = e.placement
            views = made.at(fit, requests, now=now, down=down)
            self._views_cache = (key, views)
            return views

    def _window_changed(
        self, members: tuple[int, int, int], window_s: float, now: float
    ) -> _Window | None:
        """The window's views brought up to date with the runs started, ended and pruned
        since they were made, and the runs that left the window since: the same views as
        made afresh, for the runs' cost rather than the window's. None where they must be
        made afresh (``members``: the mirror's now; a run entered the window otherwise
        than by starting, as when the clock stepped back)."""
        if self._window is None or now < self._window_at:
            # the clock stepped back: runs that had left the window (or were queued after
            # the time it now says) are in it again, which no change names
            return None
        (kept, kept_window_s), requests, made = self._window
        changes = self._mirror.changes_since(kept[0]) if kept_window_s == window_s else None
        if changes is None:
            return None
        self._window = None  # until the change is known complete: a failure leaves no half
        try:
            changed = made.change([(old, new) for old, new, _ in changes], now=now)
        except Exception:  # made afresh instead: the quotes never rest on half a change
            log.exception("admission: the quote views are made afresh")
            return None
        if not changed:
            return None
        # the views hold runs of the history in the window, and as many as it holds
        if len(made) != members[2] - members[1]:
            return None
        since = now - window_s
        requests = dict(requests)
        for old, new, request in changes:
            if old is None and new is not None and new.queued_at >= since:
                requests[new.request_class] = request
        # in the order made afresh would give (the quotes sum the classes' loads in it),
        # without those none of whose runs is left
        requests = {key: requests[key] for key in made.classes()}
        return ((members, window_s), requests, made)

    def _running(
        self,
        views: Mapping[str, ClassView],
        now: float,
        loads: Mapping[str, DeviceLoad] | None = None,
    ) -> list[tuple[frozenset[str], Running]]:
        """What holds devices now, with the devices: each reservation with how long it has
        run and its class's mean run time, and memory used beyond reservations (no end
        known). ``loads``: :meth:`JobService.loads` where the caller read it already (it
        reads every GPU process's ``/proc``)."""
        with self._kept_lock:
            classes = self._mirror.running()
        out = []
        for r in self._jobs.reservations.held():
            key = classes.get(r.id)
            view = views.get(key) if key is not None else None
            stats = view.stats if view is not None else None
            estimate = stats.mean_service_s if stats is not None and stats.completions else None
            out.append(
                (frozenset(r.devices), Running(r.job, max(now - r.created_at, 0.0), estimate))
            )
        if loads is None:
            loads = self._jobs.loads()
        for uuid, load in loads.items():
            if load.unreserved_bytes > 0:
                out.append((frozenset((uuid,)), Running("", 0.0, None)))
        return out

    def _quote(
        self,
        views: Mapping[str, ClassView],
        request: Request,
        ahead: Mapping[str, int],
        *,
        waited_s: float,
        running: Sequence[tuple[frozenset[str], Running]] = (),
    ) -> tuple[float | None, tuple[Running, ...]]:
        """The quote, or the runs on its devices that have all run past their estimated run
        times (then no quote: the model's figure rests on run times they disprove).
        ``ahead``: how many entries of each class (:attr:`Entry.request_class`) wait
        ahead of it; those whose devices that serve now (:attr:`ClassView.serving`) overlap
        its own count (per class, not per entry: a listing asks this of every entry).
        ``running``: what holds devices (:meth:`_running`); only the runs on its devices
        that serve now count."""
        view = views.get(request.describe())
        if view is None or view.quote is None:
            return None, ()
        # the devices that serve now: a run on a GPU that does not answer (past its
        # estimate, as a hung one leaves it) holds none of what this class waits for
        pool = view.serving
        overlapping = 0
        for key, count in ahead.items():
            other = views.get(key)
            if other is not None and pool & other.serving:
                overlapping += count
        mine = [r for devices, r in running if devices & pool]
        quote = job_quote(view.quote, ahead=overlapping, waited_s=waited_s, running=mine)
        late = overdue(mine)
        if late and math.isfinite(quote):
            return None, late
        return quote, ()

    # -- the gate and the tick ------------------------------------------------------------
    def refuse_never(self, spec: JobSpec) -> None:
        """Refuse a job that can never start on this node as it is (FailedPrecondition, not
        as taken for now); also where nothing is reserved (``gpuctl env``)."""
        fit = self.fit()
        if fit is not None:
            self._refuse_never(spec, fit)

    def _refuse_never(self, spec: JobSpec, fit: FitCheck) -> None:
        verdict = self.classify(request_of(spec), fit)
        if isinstance(verdict, Unfeasible):
            raise _never(spec.name, verdict, self._whole_down(spec, fit))

    def _whole_down(self, spec: JobSpec, fit: FitCheck) -> str:
        """For a refusal of ``spec`` as one that can never start, where it asks for whole
        GPUs: the GPUs not in MIG mode that take no job now (lost, hung, held off), which
        the refusal counted all the same: each may answer again, yet the node would still
        lack what the job asks; empty where none is such."""
        if spec.devices or spec.mig_profile is not None:
            return ""
        whole = self._jobs.unhealthy().only({d.gpu for d in fit.devices() if not d.is_mig})
        return _counted_down(whole)

    def gate(self, spec: JobSpec, uid: int | None = None) -> tuple[str, ...] | None:
        """Where a job asking to start now may go: as if it joined the queue's tail. A job
        that can never start here is refused as such (not as taken for now), queue or not.
        With the queue off (``admission.enabled = false``) nothing is ahead of it, and its
        memory and thread share are checked all the same. ``uid``: its user, where MPS is
        on (:meth:`JobService.placement_uid`): the devices reservations of other users hold
        take no job of it (a control daemon serves one user at a time)."""
        fit = self.fit()
        if fit is None:
            return None
        self._refuse_never(spec, fit)
        request = request_of(spec)
        queued = self.entries() if self.config.enabled else []
        candidate = Queued("\0new", request, 1 << 62, self._clock(), uid, spec.name)
        holdings = self.holdings()
        result = admission_pass(
            [self._queued(e) for e in queued] + [candidate],
            fit,
            holdings,
            backfill=self.config.backfill,
            demands=self._demands,
        )
        for s in result.starts:
            if s.id == candidate.id:
                return s.devices
        if uid is not None and any(h.uid not in (None, uid) for h in holdings):
            # the reservation's own placement names the other user, where that is why
            self._jobs.choose(spec, uid=uid)
        free = self._free_for(request, fit, holdings)
        if not free:
            # it fits on none of its devices, queue or not: what holds them is why, which
            # the reservation's own placement names for one device, and WHY NOT for each
            try:
                self._jobs.choose(spec, uid=uid)
            except ResourceExhausted as err:
                held = _Held(self._jobs, self._jobs.unhealthy()).holders(spec, said=_said(err))
                if held:
                    raise ResourceExhausted(f"{err}; {held}") from None
                raise
        ahead = [e for e in queued if e.id not in result.unfeasible]
        waiting = len([e for e in ahead if _needs_any(self._demands.get(e.placement), free)])
        if waiting:
            raise ResourceExhausted(
                f"job {spec.name!r} ({request.label()}) waits behind {waiting} queued"
                " job(s) that need its devices"
            )
        if ahead:
            # none of them needs the devices it fits on: with backfill off the pass stops at
            # the head, and no job behind it starts, whatever it would take
            head = next((e for e in ahead if e.id == result.head), None)
            behind = f", {head.job} ({head.id})" if head is not None else ""
            why = (
                f": backfill is off (admission.backfill = false), none passes the head{behind}"
                if not self.config.backfill
                else f" (none needs the devices it fits on), behind the head{behind}"
            )
            raise ResourceExhausted(
                f"job {spec.name!r} ({request.label()}) waits behind {len(ahead)} queued"
                f" job(s){why}"
            )
        # Nothing queued: the reservation's own placement names the numbers, if it refuses.
        # It places from the same loads, so it refuses too; where it does not, the gate's
        # loads and placement's differ, and saying so beats starting on what the gate refused.
        chosen = self._jobs.choose(spec, uid=uid)
        log.warning(
            "admission gate and placement disagree: the gate finds no room for job %r (%s),"
            " placement would put it on %s",
            spec.name,
            request.label(),
            ", ".join(d.uuid for d in chosen),
        )
        raise ResourceExhausted(
            f"job {spec.name!r} ({request.label()}) does not fit now by the admission gate's"
            f" count of its devices' loads, though placement finds room on"
            f" {', '.join(d.uuid for d in chosen)}: the two counts differ (gpud logs it)"
        )

    def _free_for(
        self, request: Request, fit: FitCheck, holdings: Sequence[Holding]
    ) -> frozenset[str]:
        """The devices ``request`` would start on now were nothing queued (empty: it fits
        nowhere, whatever waits): with the devices a pass alone with it places it on, every
        device of its pool with room for its demand (what it may wait behind); ``holdings``
        (:meth:`holdings`) fill every device of a GPU no job is placed on, so none of those
        has room."""
        alone = admission_pass(
            [Queued("\0alone", request, 0, 0.0)], fit, holdings, demands=self._demands
        )
        if not alone.starts:
            return frozenset()
        demand = self._demands.get(request)
        loads = Loads.of(holdings)
        room = {
            d.uuid
            for d in fit.devices()
            if isinstance(demand, Demand)
            and d.uuid in demand.pool
            and (loads.get(d.uuid) + demand.on(d.uuid)).fits_in(d.capacity)
        }
        return frozenset(alone.starts[0].devices) | room

    def _queued(self, e: Entry) -> Queued:
        """``e`` for a pass, with its user where MPS is on (its holder's real UID, as read
        when it queued)."""
        uid = self._jobs.placement_uid(e.request.holder_pid, e.holder_uid)
        return Queued(e.id, e.placement, e.seq, e.enqueued_at, uid, e.job)

    def tick(self) -> None:
        """Drop entries whose holder is gone; start what fits, in order, with backfill.
        Run by the daemon's loop, by an enqueue in its caller's thread, and by ``passes``
        once devices free or an entry leaves (a release, a removal, a holder gone, a leave):
        passes never overlap (each holds the placement lock), and none runs inside a
        transaction (the reservations it makes ask the MPS manager, whose lock comes first)."""
        try:
            self._pass()
        finally:
            with self._jobs.locked():
                self._tell()

    def _pass(self) -> None:
        with self._jobs.locked():
            self._drop_if_off()
            now = self._clock()  # under the lock: concurrent passes account in order
            queued = self.entries()
            self._account(now, len(queued))
            # each holder's /proc/<pid>/stat read once a pass, however many entries it
            # holds (one gpuctl, or one client, queues many): the pass checks every entry
            fields_of = functools.cache(lambda pid: self._read_stat(pid, self._proc_root))
            gone = False
            for e in queued:
                pid = e.request.holder_pid
                # the start time was read with the entry: a PID reused since is not its holder
                if pid and not runs(pid, e.holder_start, fields_of=fields_of):
                    # a second leave says who took it out (a kill -9 of its gpuctl run)
                    self._set_state(e.id, LEFT, by=f"holder pid {pid} is gone")
                    self._events.emit(
                        "admission.leave",
                        f"job {e.job} left the queue: holder pid {pid} is gone",
                        job=e.job,
                        entry=e.id,
                    )
                    gone = True
            if gone:  # else the rows just read are the queue still (the lock is held)
                queued = self.entries()
            self._trim_demands(queued)
            fit = self.fit()
            if fit is None or not queued:
                self._prune(now)
                return
            result = admission_pass(
                [self._queued(e) for e in queued],
                fit,
                self.holdings(),
                backfill=self.config.backfill,
                demands=self._demands,
            )
            by_id = {e.id: e for e in queued}
            self._start_said = {s for s in self._start_said if s[0] in by_id}
            # why a start failed holds for the entries tried again now; one the pass no
            # longer places waits for what holds its devices, which WHY NOT says instead
            placed = {s.id for s in result.starts}
            self._start_failures = {i: w for i, w in self._start_failures.items() if i in placed}
            for s in result.starts:
                self._start(by_id[s.id], s.devices, backfilled=s.backfilled)
            self._account(now, len(queued) - len(result.starts))
            self._prune(now)

    def _trim_demands(self, queued: list[Entry]) -> None:
        """Forget the classifications of requests no queued entry makes, once there are
        :data:`DEMANDS_KEEP` more of them than entries: each is made again when asked."""
        if len(self._demands) > len(queued) + DEMANDS_KEEP:
            # walk the queue, not the dict: a listing's classify() may add to it meanwhile
            held = self._demands
            self._demands = {e.placement: held[e.placement] for e in queued if e.placement in held}

    def _holder_start(self, pid: int) -> int | None:
        """Field 22 of ``/proc/<pid>/stat`` (clock ticks since boot), read through
        ``read_stat``; None when procfs does not say."""
        fields = self._read_stat(pid, self._proc_root)
        return None if fields is None else start_ticks(fields)

    def _start(self, entry: Entry, devices: tuple[str, ...], *, backfilled: bool) -> None:
        self._starting = entry
        try:
            self._jobs.ensure_tag(entry.job)  # before the transaction: see ensure_tag
            # No transaction around the reservation: it would be held while the reservation
            # asks the MPS manager, whose lock comes before the store's (a deadlock with
            # `gpuctl mps set`). The entry is marked started in the reservation's own
            # transaction (_observe), so the two are still kept or lost together.
            launch = self._jobs.reserve(
                replace(entry.request, devices=devices, mig_profile=None, gpu_count=None),
                admitted=True,
            )
        except GpudError as err:
            # tried again every tick: said once per entry and reason (and by gpuctl queue)
            why = f"could not start: {err}"
            said = (entry.id, why) in self._start_said
            self._start_said.add((entry.id, why))
            self._start_failures[entry.id] = why
            log.log(
                logging.DEBUG if said else logging.WARNING,
                "queued job %s could not start on %s: %s",
                entry.job,
                devices,
                err,
            )
            return
        finally:
            self._starting = None
        self._events.emit(
            "admission.start",
            f"job {entry.job} started from the queue after"
            f" {_waited(self._clock(), entry):.1f} s{' (backfilled)' if backfilled else ''}",
            job=entry.job,
            entry=entry.id,
            reservation=launch.reservation.id,
            devices=list(devices),
            gpus=self._jobs.gpu_indexes(devices),
        )

    def _removed_run_ended(self, reservation_id: str, end: RunEnd) -> bool:
        """The end of a run whose reservation ``gpuctl jobs rm --force`` released while it
        ran, as its ``gpuctl run`` reports it once the command has exited: the row the
        removal ended now ends here, when the command did (what the quotes take for its
        run time), with its exit status if the report has one, beside its cause
        (``removed``); once. False when no such row waits for it. A report tried again
        through a gpud restart ends the row when it was first tried."""
        now = self._clock()
        with self._store.transaction() as conn:
            # a row of an earlier gpud that kept an exit status, but no reported_at, has
            # had its report
            kept = conn.execute(
                "UPDATE job_history SET ended_at = MAX(started_at, ?), reported_at = ?,"
                " exit_code = ?, exit_signal = ? WHERE reservation = ? AND end_cause = ?"
                " AND reported_at IS NULL AND exit_code IS NULL AND exit_signal IS NULL",
                (
                    now - end.since_end_s,
                    now,
                    end.exit_code,
                    end.exit_signal,
                    reservation_id,
                    EndCause.REMOVED.value,
                ),
            )
        return kept.rowcount > 0

    def _observe(
        self, what: str, reservation: Reservation, spec: JobSpec, end: RunEnd | None
    ) -> None:
        """Inside the reservation's transaction: the job history follows every reservation."""
        now = self._clock()
        with self._store.transaction() as conn:
            if what == "release":
                end = end or NO_STATUS
                # a release tried again through a gpud restart: the run ended at the first try
                conn.execute(
                    "UPDATE job_history SET ended_at = MAX(started_at, ?), exit_code = ?,"
                    " exit_signal = ?, end_cause = ? WHERE reservation = ? AND ended_at IS NULL",
                    (
                        now - end.since_end_s,
                        end.exit_code,
                        end.exit_signal,
                        end.cause.value,
                        reservation.id,
                    ),
                )
                return
            entry = self._starting
            if entry is not None:
                self._set_state(entry.id, STARTED, reservation.id)
            placed = entry.request if entry is not None else _run_request(spec)
            if placed.kind is None:  # a queued request takes the job's kind, as it ran
                placed = replace(placed, kind=spec.kind)
            request = request_of(placed)
            queued_at = entry.enqueued_at if entry is not None else reservation.created_at
            # never after the start: the wall clock may have stepped back between the two
            queued_at = min(queued_at, reservation.created_at)
            added = conn.execute(
                "INSERT OR IGNORE INTO job_history (job, reservation, request_class, request,"
                " queued_at, started_at, quote_s, holder_uid) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    reservation.job,
                    reservation.id,
                    request.describe(),
                    run_request_to_json(placed),
                    queued_at,
                    reservation.created_at,
                    entry.quote_s if entry is not None else None,
                    reservation.uid,
                ),
            )
            if added.rowcount:
                self.waits.observe(reservation.created_at - queued_at)

    def _account(self, now: float, length: int) -> None:
        if self._last_tick is not None:
            self._area += self._last_length * max(0.0, now - self._last_tick)
        else:
            self._area_since = now
        self._last_tick = now
        self._last_length = length

    def _prune(self, now: float) -> None:
        with self._store.transaction() as conn:
            conn.execute(
                "DELETE FROM admission_queue WHERE state != ? AND changed_at < ?",
                (QUEUED, now - DONE_KEEP_S),
            )
            # a run still running keeps its row, however old: its end is yet to be kept
            # there, and the quotes count what it holds by its class; so does a run
            # `gpuctl jobs rm --force` removed while its command still runs, until its
            # `gpuctl run` reports the command's exit (_removed_run_ended)
            conn.execute(
                "DELETE FROM job_history WHERE id <= (SELECT MAX(id) FROM job_history) - ?"
                " AND ended_at IS NOT NULL AND (end_cause IS NOT ? OR reported_at IS NOT NULL"
                " OR exit_code IS NOT NULL OR exit_signal IS NOT NULL)",
                (self.config.history_keep, EndCause.REMOVED.value),
            )

    # -- history and metrics --------------------------------------------------------------
    def now(self) -> float:
        return self._clock()

    def history(
        self, *, since: float | None = None, limit: int | None = None, before: int | None = None
    ) -> list[HistoryRow]:
        """Oldest first (the newest ``limit`` when given; only rows older than the row id
        ``before`` when given)."""
        query = "SELECT * FROM job_history"
        where: list[str] = []
        args: list[object] = []
        if since is not None:
            where.append("queued_at >= ?")
            args.append(since)
        if before is not None:
            where.append("id < ?")
            args.append(before)
        if where:
            query += " WHERE " + " AND ".join(where)
        query += " ORDER BY id DESC"
        if limit is not None:
            query += " LIMIT ?"
            args.append(limit)
        with self._store.transaction() as conn:
            rows = conn.execute(query, args).fetchall()
        return [_history(r) for r in reversed(rows)]

    def quote_error(self) -> tuple[float, int]:
        """The mean of observed minus quoted wait over the window's runs that were quoted
        (0 when none), and how many: from the history kept for the quotes, made again only
        when the window's runs change (every scrape asks; reading and decoding the window
        took seconds at admission.history_keep runs)."""
        with self._kept_lock:
            now = self._clock()
            since = now - self.config.history_window_s
            with self._store.transaction() as conn:
                self._mirror.refresh(conn)
            key = self._mirror.members(since, math.inf)
            if self._quote_error is None or self._quote_error[0] != key:
                errors = [
                    r.started_at - r.queued_at - r.quote_s
                    for r, _ in self._mirror.since(since)
                    if r.quote_s is not None and r.started_at is not None
                ]
                mean = sum(errors) / len(errors) if errors else 0.0
                self._quote_error = (key, (mean, len(errors)))
            return self._quote_error[1]

    def littles_residual(self) -> float | None:
        """``|L - lambda W| / L`` since the daemon started: ``L`` from the queue length it
        saw on its ticks, ``lambda W`` from the history's waits (None until a queue formed)."""
        if self._area_since is None or self._last_tick is None or self._area <= 0:
            return None
        start, end = self._area_since, self._last_tick
        # summed by SQLite: every scrape asks, and the history since the start may hold
        # admission.history_keep runs (decoding each row took seconds at 100000)
        with self._store.transaction() as conn:
            (total,) = conn.execute(
                "SELECT TOTAL(MIN(started_at, ?) - MAX(queued_at, ?)) FROM job_history"
                " WHERE queued_at >= ? AND MIN(started_at, ?) > MAX(queued_at, ?)",
                (end, start, start, end, start),
            ).fetchone()
        return residual_of_waits(total, self._area, start=start, end=end)


def _needs_any(demand: Demand | Unfeasible | None, devices: frozenset[str]) -> bool:
    """Whether a queued run of ``demand`` may take any of ``devices`` (not known: it may)."""
    return not isinstance(demand, Demand) or not devices.isdisjoint(demand.pool)


def _never(job: str, verdict: Unfeasible, down: str = "") -> FailedPrecondition:
    """``down``: the GPUs the verdict counted that take no job now (:meth:`AdmissionService._whole_down`)."""
    remedy = f"; {verdict.remedy}" if verdict.remedy else ""
    counted = f". {down}" if down else ""
    return FailedPrecondition(
        f"job {job!r} can never start on this node as it is: {verdict.reason}{remedy}{counted}"
    )


def _counted_down(down: NotPlacedOn) -> str:
    """One sentence for each GPU (the first four; past them, how many more) a
    never-starting request's refusal counted though it takes no job now: what the driver
    answered of it (:attr:`NotPlacedOn.down`: lost, its uncleared critical XIDs) and what
    brings it back, the node drained said once. Any other reason (not answering, a fault
    NVML advises on, a failed call) is quoted whole: its words carry their own advice. A GPU
    held off by a MIG apply keeps its why: it comes back alone."""
    said: list[str] = []
    drain = "drain the node and "
    for gpu, reason in sorted(down.items())[:4]:
        counted = f"GPU {gpu}, counted all the same,"
        if gpu in down.held:
            said.append(
                f"{counted} is held and takes no job for now (it comes back alone): {reason}"
            )
            continue
        d = down.down[gpu]
        codes = f"Xid{'s' if len(d.xids) > 1 else ''} {', '.join(map(str, d.xids))}"
        if d.lost:
            has = f" and has {codes}" if d.xids else ""
            # a reset leaves the XIDs gpud keeps; a reboot empties them (run_dir)
            clear = f", then gpuctl xid clear {gpu}," if d.xids else ""
            said.append(
                f"{counted} is lost{has} and takes no job now: {drain}reset it"
                f" (nvidia-smi --gpu-reset -i {gpu}){clear} or reboot it"
            )
            drain = ""
        elif d.xids and d.reason == critical_xid_reason(d.xids):
            them = "they are" if len(d.xids) > 1 else "it is"
            said.append(
                f"{counted} has {codes} and takes no job now: once {them} dealt with, clear"
                f" its {codes.partition(' ')[0]} (gpuctl xid clear {gpu})"
            )
        else:
            said.append(f"{counted} is unhealthy and takes no job now: {reason}")
    more = f"; {len(down) - 4} more" if len(down) > 4 else ""
    return "; ".join(said) + more


class _Held:
    """Why a queued entry waits while its devices are healthy: what holds them (the
    numbers a refused reservation gives), or, where it would fit now, the head it may not
    pass. The node's devices and loads are read once, at the first entry that asks, and
    placement is asked once per shape of request (the devices, MIG profile, GPU count,
    memory and thread share it asks, and its user where MPS is on: all that placement reads
    besides the job's name, which its refusal names: the answer is kept with a stand-in
    name and said with each entry's own)."""

    STAND_IN = "\0job"
    NAMED = 4  # the held devices named in full; past them, how many more

    def __init__(
        self, jobs: JobService, sick: NotPlacedOn, name_of: Callable[[int], str] = user_name
    ) -> None:
        """``sick``: :meth:`JobService.unhealthy`, as the caller read it for every entry;
        ``name_of``: a user's name by UID, for the holders it names."""
        self._jobs = jobs
        self._sick = sick
        self._name_of = name_of
        self._now: tuple[list[MpsTarget], dict[str, DeviceLoad]] | None = None
        self._loads: dict[str, DeviceLoad] | None = None
        self._refused: dict[tuple[object, ...], str | None] = {}

    def loads(self) -> dict[str, DeviceLoad]:
        """:meth:`JobService.loads`, read once."""
        if self._loads is None:
            self._loads = self._jobs.loads()
        return self._loads

    def why(self, e: Entry, head: Entry | None) -> str:
        if self._now is None:
            self._now = (self._jobs.healthy_targets(self._sick), self.loads())
        r = e.request
        uid = self._jobs.placement_uid(r.holder_pid, e.holder_uid)
        shape = (r.devices, r.mig_profile, r.gpu_count, r.memory_bytes, r.threads_percent, uid)
        if shape not in self._refused:
            try:
                spec = _effective(JobSpec(self.STAND_IN), r)
                self._jobs.choose(spec, self._now, uid=uid, sick=self._sick)
                self._refused[shape] = None
            except (ResourceExhausted, NotFound) as err:
                held = self.holders(spec, said=_said(err))
                self._refused[shape] = f"{err}; {held}" if held else str(err)
        refused = self._refused[shape]
        if refused is not None:
            named = refused.replace(repr(self.STAND_IN), repr(e.job))
            return named.replace(self.STAND_IN, e.job)  # unquoted too (a user refusal)
        return f"behind {head.job} ({head.id})" if head is not None else ""

    def holders(self, spec: JobSpec, *, said: frozenset[str] = frozenset()) -> str:
        """Where more than one device ``spec`` could take is held, each with its holders
        (``GPU 0 held by a (alice), GPU 1 held by b (bob)``; past :attr:`NAMED`, ``and N
        more``): a refusal's numbers name one device, and the job waits for any of them.
        ``said``: the devices (UUIDs) whose holders the refusal names itself (one short of
        threads names each such device): the others held alone are named, if any."""
        if self._now is None:
            self._now = (self._jobs.healthy_targets(self._sick), self.loads())
        targets, loads = self._now
        if spec.devices:
            pool = [t for t in targets if t.uuid in spec.devices]
        elif spec.mig_profile is not None:
            pool = [t for t in targets if t.mig is not None and t.profile == spec.mig_profile]
        else:
            pool = [t for t in targets if t.mig is None]
        held = [
            (t, loads[t.uuid])
            for t in sorted(pool, key=lambda t: (t.gpu, t.mig or 0))
            if t.uuid in loads and loads[t.uuid].jobs and t.uuid not in said
        ]
        if len(held) < (1 if said else 2):
            return ""
        named = []
        for t, load in held[: self.NAMED]:
            users = dict((job, uid) for uid, job in load.users)
            jobs = " and ".join(
                f"{job} ({self._name_of(users[job])})" if job in users else job for job in load.jobs
            )
            where = f"GPU {t.gpu}" if t.mig is None else f"GPU {t.gpu} MIG {t.mig}"
            named.append(f"{where} held by {jobs}")
        more = f" and {len(held) - self.NAMED} more" if len(held) > self.NAMED else ""
        return ", ".join(named) + more


def _said(err: Exception) -> frozenset[str]:
    """The devices whose holders placement's refusal ``err`` names itself."""
    return err.named if isinstance(err, ThreadsFull) else frozenset()


def _effective(job: JobSpec, request: RunRequest) -> JobSpec:
    if request.devices or request.mig_profile is not None or request.gpu_count is not None:
        job = replace(
            job,
            devices=request.devices,
            mig_profile=request.mig_profile,
            gpu_count=request.gpu_count,
        )
    for name in ("threads_percent", "memory_bytes", "client_priority"):
        value = getattr(request, name)
        if value is not None:
            job = replace(job, **{name: value})
    return job


def _run_request(spec: JobSpec) -> RunRequest:
    return RunRequest(
        job=spec.name,
        kind=spec.kind,
        owner=spec.owner,
        mig_profile=spec.mig_profile,
        gpu_count=spec.gpu_count,
        devices=spec.devices,
        threads_percent=spec.threads_percent,
        memory_bytes=spec.memory_bytes,
        client_priority=spec.client_priority,
    )


def _waited(now: float, e: Entry) -> float:
    """How long ``e`` has waited by ``now`` (wall time): at least 0, however the wall clock
    stepped back since it was queued."""
    return max(0.0, now - e.enqueued_at)


def _classes_of(entries: Sequence[Entry]) -> tuple[str, ...]:
    return tuple(sorted({e.request_class for e in entries}))


def _classes(entries: Sequence[Entry]) -> Counter[str]:
    return Counter(e.request_class for e in entries)


def _draft(entry_id: str, job: str, request: RunRequest, now: float) -> Entry:
    return Entry(entry_id, 1 << 62, job, request, now, None, QUEUED, None, now)


def _entry(row: sqlite3.Row) -> Entry:
    return Entry(
        id=row["id"],
        seq=row["seq"],
        job=row["job"],
        request=run_request_from_json(row["request"]),
        enqueued_at=row["enqueued_at"],
        quote_s=row["quote_s"],
        state=row["state"],
        reservation=row["reservation"],
        changed_at=row["changed_at"],
        holder_start=row["holder_start"],
        left_why=row["left_why"] or "",
        holder_uid=row["holder_uid"],
        left_by=row["left_by"] or "",
    )


def _history(row: sqlite3.Row) -> HistoryRow:
    return HistoryRow(
        job=row["job"],
        request_class=row["request_class"],
        request=run_request_from_json(row["request"]),
        reservation=row["reservation"],
        queued_at=row["queued_at"],
        started_at=row["started_at"],
        ended_at=row["ended_at"],
        quote_s=row["quote_s"],
        exit_code=row["exit_code"],
        exit_signal=row["exit_signal"],
        end_cause=row["end_cause"],
        reported_at=row["reported_at"],
        holder_uid=row["holder_uid"],
        row_id=row["id"],
    )


def mig_file_layouts(
    path: Path,
    gpus: Callable[[], Sequence[object]],
    *,
    load: Callable[[Path], MigConfigFile] = load_config,
) -> Callable[[], Mapping[str, Mapping[int, DeviceLayout]]]:
    """Layouts of every config of a mig-parted file on the node's GPUs. The file (``load``:
    read and parsed) is taken again only when its :func:`~gpud.config.file_stamp` changed
    (the operator edited or replaced it), not on each /metrics scrape or queue listing. An
    unreadable file offers no remedy and logs why, once for each version of it."""
    lock = threading.Lock()  # a scrape's thread and the loop may ask at once
    last: tuple[FileStamp | None, MigConfigFile | None] | None = None  # stamp, what it held

    def layouts() -> Mapping[str, Mapping[int, DeviceLayout]]:
        nonlocal last
        with lock:
            stamp = file_stamp(path)  # before the read: a change meanwhile reads it again
            if last is None or last[0] != stamp:
                try:
                    last = (stamp, load(path))
                except GpudError as err:
                    log.warning("admission.mig_config: %s", err)
                    last = (stamp, None)
            file = last[1]
        if file is None:
            return {}
        return resolve_configs(file, gpus())  # type: ignore[arg-type]

    return layouts


def _unhealthy_in(demand: Demand, sick: NotPlacedOn, targets: Sequence[MpsTarget]) -> str:
    """The GPUs of ``demand``'s pool that serve no job now (:func:`serving_devices`:
    ``sick``, index -> why, and every GPU never read, whose UUID "" no job is placed on),
    when too few of its devices serve: the job waits for them to answer again, not only
    for other jobs. ``targets``: the node's devices."""
    kept, gone = serving_devices(
        demand.pool,
        {t.uuid: t.gpu for t in targets if t.uuid},
        {t.gpu for t in targets if not t.uuid},
        sick.keys(),
    )
    if not gone or len(kept) >= demand.count:
        return ""
    named = unhealthy_text(sick.only(gone))
    unread = "; ".join(f"GPU {g} {NEVER_READ}" for g in sorted(gone - sick.keys()))
    return "; ".join(t for t in (named, unread) if t)
