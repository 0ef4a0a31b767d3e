"""The co-location loop on live snapshots: the colocate planner, SLO guards and directives.

Every ``[colocate] tick_s`` the daemon calls :meth:`ColoService.tick` with the latest
telemetry snapshot. It reads the jobs that hold reservations (their GPU, MPS limits,
declared memory and SLO), the memory NVML shows per GPU, the latency samples inference
jobs reported (``gpud.client.Latency``) and the iterations training jobs reported at each
``gpud.client.throttle_point()``. From these it runs each inference job's SLO guard, asks
the planner for a plan (evictions for memory, the duty cycle each training job may run
at), refines shapes and the interference predictor from the observed iteration rates, and
emits an event when a decision changes. ``gpuctl run`` asks :meth:`advise` where a new job
goes; ``gpuctl colo show`` reads :meth:`show`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import secrets
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from colocate import (
    GpuView,
    GuardAction,
    GuardParams,
    InterferencePredictor,
    JobFeatures,
    JobKind,
    JobView,
    MigMemory,
    MigOption,
    Placement,
    Plan,
    Planner,
    PlannerParams,
    ServiceGuard,
    Shape,
)
from gpud.backend.port import GpuIdentity, MigDeviceIdentity, Utilization
from gpud.backend.products import lookup
from gpud.client.colo import MAX_LATENCY_S, MAX_REPORT_AGE_S
from gpud.colo.host import HostUsage
from gpud.colo.links import NvlinkRates, pcie_capacity, pcie_ratio
from gpud.config import ColocateConfig
from gpud.errors import ColocationOff, FailedPrecondition, InvalidArgument, LeftQueue, NotFound
from gpud.events import EventLog
from gpud.files import STATE_FILE_MODE, keep_aside, write_atomically
from gpud.shared import MAX_PEAK_LOAD, check_slo_ms, first_few, shown, user_name
from gpud.telemetry.snapshot import GpuSample, Snapshot

log = logging.getLogger(__name__)

MAX_LATENCY_SAMPLES = 4096  # per report, and per job kept in the window
# A median response under a microsecond is a timer that read nothing, not a service: its
# rate (ln 2 over it) would be absurd, or infinite, and no longer fit in colo.json.
MIN_MEDIAN_LATENCY_S = 1e-6
MAX_ITERATIONS = 10**9  # per throttle point: iterations since the one before
# A footprint learned alone is an average of its readings: their mean while they are few,
# then an exponential average that forgets a reading over this time (each weighs the time
# it stands for, at most a tick: 1 - exp(-tick_s / LEARN_TAU_S), a tenth at the default
# 5 s). A run's last ticks (a checkpoint, its teardown) do not stand for what it does.
LEARN_TAU_S = 50.0
MAX_READINGS = 1000  # counted per footprint (a bound: the time weight rules long before)
# A footprint with fewer SMs busy than this shows a run that idled alone, not what the job
# does: advice plans a new run of it with the prior instead.
MIN_LEARNED_SM = 0.05
# A job alone this long with none of its processes seen on its device is said in the log.
UNSEEN_SAY_S = 60.0
# What the loop learned of a job no longer running is kept this long (the job may run
# again under its name), then forgotten: a daemon up for months holds only recent jobs.
FORGET_AFTER_S = 3600.0
# How far the predictor's clock may run on before colo.json is written for it alone.
CLOCK_WRITE_S = 60.0
MIG_COMPUTE_SLICES = 7  # A100, H100, H200: a MIG profile's SMs are slices of seven
RATE_WINDOW_S = 10.0
# A new duty reaches training at its next throttle point (gpud.client reports every second);
# latencies reported before then, and fewer than this many, say nothing about it yet.
DIRECTIVE_DELAY_S = 1.0
# A job's company changed: measuring starts this much later. The newcomer's process is
# starting up (or the leaver's winding down), and reports made each second still carry work
# done before the change: taken at once, they count the old company's speed for the new.
SETTLE_S = 2.0
# gpud.client.Latency sends what it collected once a second; a service silent for twice as
# long has served nothing since its last report.
REPORT_PERIOD_S = 1.0
REPORT_GAP_S = 2.0 * REPORT_PERIOD_S
# A service of little traffic serves fewer than MIN_FRESH_SAMPLES requests in the latency
# window: its guard's p99 at a duty reaches back as far as this many windows to find them.
QUIET_WINDOWS = 6
# A training job's processes (its ranks) report in one cadence: a process the job has not
# had is another rank while another process of it reported within this many of its own
# intervals between reports (at least RANK_QUIET_S), and otherwise one started again in
# the place of one that is gone, whose progress is not the new one's.
RANK_QUIET_INTERVALS = 3.0
RANK_QUIET_S = 3.0 * REPORT_PERIOD_S
# The processes a job's reports are told apart by: a job of more ranks than this (or a
# process id sent at random per point) has its oldest forgotten, so they cost bounded memory.
MAX_JOB_PROCESSES = 256
# The longest process id gpud keeps (the client sends 32 hex digits).
MAX_PROCESS_ID = 64
MIN_FRESH_SAMPLES = 20  # a training job's rate is measured over at most this much recent time
# An inference service alone whose utilization is under this teaches no features.
MIN_SERVICE_ACTIVITY = 0.05
GIB = 1 << 30


@dataclass(frozen=True)
class RunningJob:
    """A job holding a reservation on one device, as the jobs service knows it (a job on
    several devices is one of these per device)."""

    name: str
    kind: str  # "training" | "inference"
    gpu: int
    threads_percent: int | None = None
    memory_bytes: int | None = None  # declared (MPS pinned limit), per device
    slo_p99_ms: float | None = None
    # NVML, attributed to the job's processes; None where the driver reports no
    # per-process memory for them
    memory_used: int | None = 0
    peak_load: float = 0.0
    device: str = ""  # the GPU or MIG device UUID it runs on
    mig_profile: str | None = None  # when that device is a MIG instance: its profile
    pids: tuple[int, ...] = ()  # its processes NVML lists on that device
    # when its reservation was made (``job_reservations.created_at``): among jobs this loop
    # first sees run together (all of them, after gpud restarts), the earlier came first
    reserved_at: float | None = None
    # the real UID of the run holding the reservation where placement keeps users apart
    # (``job_reservations.holder_uid``; None: unknown, or MPS off)
    uid: int | None = None
    # when its job was registered (``jobs.created_at``): which registration of the name
    # runs (one removed and added again is another workload); None: not known
    registered_at: float | None = None


@dataclass(frozen=True)
class Directive:
    duty: float
    evict: bool
    reason: str


@dataclass
class _DeviceState:
    """A job on one of its devices (a job on several GPUs has one each)."""

    # its footprint there, alone, at full speed, at the MPS share it runs at (``share``):
    # what the loop plans it with while it runs so (its SM activity: its knee)
    features: JobFeatures | None = None
    share: float = 1.0
    # its footprint there at a whole GPU's share: at less, its readings are what the share
    # let it use, no footprint on a whole GPU; advice plans a new run of it with this
    whole: JobFeatures | None = None
    # the readings each of the two averages, and when the last was taken (None: before
    # a restart): see _follow
    n: int = 0
    at: float | None = None
    whole_n: int = 0
    whole_at: float | None = None
    side: JobFeatures | None = None  # memory share and host use at the last tick (sm unused)

    def learn(self, reading: JobFeatures, share: float, now: float, tick_s: float) -> None:
        """This tick's reading at ``share``: ``features`` follows it (one at another share
        starts them afresh), ``whole`` too where the share is a whole GPU's."""
        if share != self.share:
            self.features, self.n, self.at = None, 0, None
        self.share = share
        self.features, self.n = _follow(
            self.features, self.n, self.at, reading, now=now, tick_s=tick_s
        )
        self.at = now
        if share >= 1.0:
            self.whole, self.whole_n = _follow(
                self.whole, self.whole_n, self.whole_at, reading, now=now, tick_s=tick_s
            )
            self.whole_at = now

    def forget(self) -> None:
        self.features, self.share, self.n, self.at = None, 1.0, 0, None
        self.whole, self.whole_n, self.whole_at = None, 0, None


def _follow(
    before: JobFeatures | None,
    n: int,
    at: float | None,
    reading: JobFeatures,
    *,
    now: float,
    tick_s: float,
) -> tuple[JobFeatures, int]:
    """An average of ``n`` readings, the last taken ``at``, moved towards ``reading``, and
    how many it now averages: by ``1/n`` (their mean) or by the time the reading stands for
    (``dt``, since the last, at most a tick: a gap in learning, a checkpoint, does not let
    one reading replace the rest), ``1 - exp(-dt / LEARN_TAU_S)``, whichever is more."""
    n = min(MAX_READINGS, n + 1)
    if before is None:
        return reading, 1
    dt = tick_s if at is None else max(0.0, min(now - at, tick_s))
    w = max(1.0 / n, 1.0 - math.exp(-dt / LEARN_TAU_S))
    return (
        JobFeatures(
            sm=before.sm + w * (reading.sm - before.sm),
            mem_bw=before.mem_bw + w * (reading.mem_bw - before.mem_bw),
            pcie=before.pcie + w * (reading.pcie - before.pcie),
            nvlink=before.nvlink + w * (reading.nvlink - before.nvlink),
        ),
        n,
    )


@dataclass
class _JobState:
    latency: deque[tuple[float, float]] = field(
        default_factory=lambda: deque(maxlen=MAX_LATENCY_SAMPLES)
    )
    # (time, requests in it) per latency report: the load counts every request a busy
    # service served, of which ``latency`` keeps the last MAX_LATENCY_SAMPLES only
    reports: deque[tuple[float, int]] = field(
        default_factory=lambda: deque(maxlen=MAX_LATENCY_SAMPLES)
    )
    # (time, iterations so far, duty told at that report: what it ran at until the next);
    # a report of no iteration is a point only where it told another duty
    progress: deque[tuple[float, int, float]] = field(default_factory=lambda: deque(maxlen=64))
    # it called throttle_point: a job that reports, its first iteration still running (a
    # compile, an evaluation) or not, is judged by its progress, never as one that never does
    reporting: bool = False
    # each process (ThrottlePointRequest.process) that reported: (when it last did, the
    # time between its last two reports), the oldest dropped past MAX_JOB_PROCESSES
    processes: dict[str, tuple[float, float]] = field(default_factory=dict)
    # the reservation time (RunningJob.reserved_at, the earliest of its devices') of the
    # run its progress is of; None: not known, or it does not run
    run: float | None = None
    # alone on all its devices: training's iterations per busy second (duty taken out); an
    # inference service's M/M/1 service rate (requests/s, see ColoService.service_rate)
    alone_rate: float | None = None
    # what it ran at when alone_rate was measured (:func:`_config`): a rate at another
    # share or in another instance is no yardstick for its slowdown; None: not known (a
    # file from before this was kept), taken as the same
    alone_config: str | None = None
    # a training job's rate alone at each MPS share it ran at on one GPU (share -> rate):
    # from two shares on, its shape's knee is what they show (Shape.observe)
    alone_rates: dict[float, float] = field(default_factory=dict)
    # its devices and who shared each at the last tick: (device, neighbour or "")
    company: frozenset[tuple[str, str]] | None = None
    guard_since: float = float("-inf")  # inference: latencies from here on see the new duty
    # inference: the (its device, training job) pairs sharing its SMs when its guard last
    # acted: its duty is evidence about that company only; None: not known (a file from
    # before this was kept), taken as the same
    guard_company: frozenset[tuple[str, str]] | None = None
    since: float = float("-inf")  # when that company last changed
    devices: dict[str, _DeviceState] = field(default_factory=dict)  # by _place()
    windows: int = 0
    windows_ok: int = 0
    seen: float = float("-inf")  # when it last ran, reported or was read back from the file
    # when this loop first saw it run, since it last stopped: the training job that came
    # last is the one an eviction takes; None while it does not run
    arrived: float | None = None
    rank: int = 0  # its place in the arrival order of the jobs running now
    evicted: bool = False  # the loop evicted it, and it has not run again since
    # what it ran as when its footprints and rates were learned (training, inference);
    # None: not known (a file from before this was kept), taken as the same
    kind: str | None = None
    # since when it ran alone with none of its processes seen (None: they were, or it
    # shares its device), and whether the log said so this run
    unseen_since: float | None = None
    unseen_said: bool = False
    # the registration it was learned under (RunningJob.registered_at); None: not known
    # (a file from before this was kept, or it has not run since), taken as the same
    registered_at: float | None = None
    # the most device memory NVML showed its processes use this run, per device (_place),
    # with the run's reservation time (RunningJob.reserved_at): memory a job gave back (a
    # cache shrunk between bursts) it takes again, so work placed beside it counts that, not
    # the lull's reading; a new run, even one that began between two ticks, starts afresh
    memory_peaks: dict[str, tuple[float | None, int]] = field(default_factory=dict)

    def learned(self, place: str) -> JobFeatures | None:
        """Its footprint on that device; else what it showed on another of its devices (a
        job's ranks do alike), or before the loop kept features per device; else None."""
        here = self.devices.get(place)
        if here is not None and here.features is not None:
            return here.features
        for key in sorted(self.devices):
            if self.devices[key].features is not None:
                return self.devices[key].features
        return None

    def new_run(self, now: float) -> None:
        """A run ended, or another began: what the last one reported (its iterations, that
        it reports, its processes, the company its rate was read in) is not the next
        one's, whose rate is read from its own iterations once it settled, and whose first
        process is no rank beside the last run's."""
        self.progress.clear()
        self.processes.clear()
        self.reporting = False
        self.company, self.since = None, now + SETTLE_S

    def unlearn(self) -> None:
        """Forget what it showed: its footprints and rates alone, measured afresh."""
        for ds in self.devices.values():
            ds.forget()
        self.devices.pop("", None)
        self.alone_rate, self.alone_config, self.alone_rates = None, None, {}
        self.company = None

    def alone(self, kind: str) -> JobFeatures | None:
        """What a new run of the job, as ``kind``, is planned with: the most it showed of
        each resource alone on any of its devices (the safe side: the run's device is not
        known yet), measured at a whole GPU's share (``whole``); None when it showed none
        as that kind, or next to nothing (a run that idled alone tells nothing of one that
        works)."""
        if self.kind not in (None, kind):
            return None
        seen = [ds.whole for ds in self.devices.values() if ds.whole is not None]
        if not seen:
            return None
        most = JobFeatures(
            sm=max(f.sm for f in seen),
            mem_bw=max(f.mem_bw for f in seen),
            pcie=max(f.pcie for f in seen),
            nvlink=max(f.nvlink for f in seen),
        )
        return most if most.sm >= MIN_LEARNED_SM else None


def _footprint(f: JobFeatures) -> dict[str, Any]:
    """A footprint as the state file keeps it."""
    return {"sm": f.sm, "mem_bw": f.mem_bw, "pcie": f.pcie, "nvlink": f.nvlink}


def _kept(path: Path) -> tuple[str, Path | None]:
    """Keep an unreadable state file aside (the next save starts afresh over it); says where,
    and where it is (None: left in place)."""
    aside = keep_aside(path)
    return (f"the file is kept as {aside}" if aside else "the file is left in place"), aside


def _unclocked(data: Mapping[str, Any]) -> tuple[dict[str, Any], float, dict[str, float]]:
    """A state as the file keeps it, less what moves with the loop's clock alone: the
    predictor's clock and each ended job's ``idle_s``, given apart (written with the next
    change, or once they moved on enough, not every tick)."""
    predictor = dict(data["predictor"])
    clock = float(predictor.pop("clock_s", 0.0))
    jobs = {
        name: {k: v for k, v in job.items() if k != "idle_s"} for name, job in data["jobs"].items()
    }
    idle = {
        name: float(job["idle_s"] or 0.0) for name, job in data["jobs"].items() if "idle_s" in job
    }
    return {**data, "jobs": jobs, "predictor": predictor}, clock, idle


def _saved_number(value: object, key: str, low: float, high: float = math.inf) -> float:
    """A number of the state file, finite and within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key}: a number expected, not {_value(value)}")
    try:
        x = float(value)
    except OverflowError:  # an int JSON holds with more digits than a float's range
        raise ValueError(f"{key}: out of range (outside [{low:g}, {high:g}])") from None
    if not (math.isfinite(x) and low <= x <= high):
        raise ValueError(f"{key}: {_value(value)} outside [{low:g}, {high:g}]")
    return x


def _saved_features(f: Mapping[str, Any], where: str) -> JobFeatures:
    """A footprint of the state file (``where``: its key, for the error)."""
    for key in ("sm", "mem_bw"):
        if key not in f:
            raise ValueError(f"{where}.{key}: missing")
    return JobFeatures(
        sm=_saved_number(f["sm"], f"{where}.sm", 0.0, 1.0),
        mem_bw=_saved_number(f["mem_bw"], f"{where}.mem_bw", 0.0, 1.0),
        pcie=_saved_number(f.get("pcie") or 0.0, f"{where}.pcie", 0.0, 1.0),
        nvlink=_saved_number(f.get("nvlink") or 0.0, f"{where}.nvlink", 0.0, 1.0),
    )


def _saved_company(value: object, key: str) -> frozenset[tuple[str, str]]:
    """A guard's company in the state file: [device, training job] pairs."""
    if not isinstance(value, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in value
    ):
        raise ValueError(f"{key}: [device, job] pairs expected, not {_value(value)}")
    return frozenset((p[0], p[1]) for p in value)


def _question(v: JobView, hold_s: float) -> Hashable:
    """What the planner weighs of a job asking for advice: two passes over the same
    askers give the same answers."""
    shape = v.shape
    return (
        v.job_id,
        v.order,
        shape.kind.value,
        shape.reserve_bytes(),
        shape.needed_bytes(),
        shape.slo_s,
        shape.curve.knee,
        shape.curve.peak,
        v.peak_load,
        v.features,
        v.evicted,
        v.waited_s >= hold_s,
        v.user,
        v.user_name,
    )


class _Off(NamedTuple):
    """A waiting run dropped for its silence, remembered for its next question: when (the
    loop's clock) it was dropped, its job, since when it waited, its last question, and
    whether it asked without an id."""

    at: float
    job: str
    since: float
    last: float
    anonymous: bool


def _off(at: float, w: _Waiter) -> _Off:
    return _Off(at, w.job, w.since, w.last, w.anonymous)


class _Left(NamedTuple):
    """A waiting run taken out of the wait, remembered for its next question: when (the
    loop's clock, and ``wall``: Unix time) it was taken out, its job, and whether it asked
    without an id."""

    at: float
    job: str
    anonymous: bool
    wall: float


class _Removed(NamedTuple):
    """A job removed while a run of it waited (or was dropped), remembered for that run's
    next question: when (the loop's clock, and ``wall``: Unix time), and whether with
    ``--force``."""

    at: float
    forced: bool
    wall: float


_Kept = TypeVar("_Kept", bound=tuple[Any, ...])


def _forget_old(kept: dict[str, _Kept], now: float, most: int, keep_s: float | None = None) -> None:
    """Drop the oldest of ``kept`` (each stamped first with when it came, in the order
    they came) past ``keep_s`` (default :data:`DROPPED_KEEP_S`) or beyond ``most``, from
    the front: no walk over the rest."""
    keep_s = DROPPED_KEEP_S if keep_s is None else keep_s
    while kept:
        key, first = next(iter(kept.items()))
        if len(kept) <= most and now - first[0] <= keep_s:
            return
        del kept[key]


def _keep_newest(
    kept: dict[str, _Kept],
    key: str,
    entry: _Kept,
    now: float,
    most: int,
    *,
    keep_s: float | None = None,
) -> None:
    """Keep ``entry`` under ``key`` as the newest of ``kept`` (last: kept in the order
    they came, which :func:`_forget_old` relies on), the oldest past its limits dropped."""
    kept.pop(key, None)
    kept[key] = entry
    _forget_old(kept, now, most, keep_s)


@dataclass(frozen=True)
class _Gone:
    """A job's removal: when (``wall``: on the clock reservations are stamped with,
    ``at``: on the loop's), and which removal it was (``seq``: a read of the reservations
    begun after it lists none of the job's from before it)."""

    wall: float
    at: float
    seq: int


BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def read_boot_id(path: Path = BOOT_ID_PATH) -> str | None:
    """The kernel's id of the running boot (``/proc/sys/kernel/random/boot_id``, new at
    each boot); None where it cannot be read, said in the log (gpud reads it once, at
    start)."""
    try:
        boot = path.read_text().strip()
    except OSError as err:
        why = err.strerror or str(err)
    else:
        if boot:
            return boot
        why = "empty"
    log.warning("boot id unreadable (%s: %s): leaves and removals are read by Unix time", path, why)
    return None


_Entry = TypeVar("_Entry")


SKIPPED_SUFFIX = ".skipped"


class _SkippedCopy:
    """The state file as read, copied once to ``<name>.skipped`` beside it when an entry of
    it is skipped: the next save writes the file without that entry, and what it held stays
    for an operator to recover by hand (an earlier copy is replaced). Another name than the
    ``.unreadable`` a whole file not read is renamed to: the two are kept apart."""

    def __init__(self, path: Path, text: str) -> None:
        self._path, self._text = path, text
        self._said: str | None = None

    def made(self) -> str:
        """Copy the file, the first time; says where it went, or why it is not there."""
        if self._said is None:
            aside = self._path.with_name(self._path.name + SKIPPED_SUFFIX)
            try:
                write_atomically(aside, self._text, mode=STATE_FILE_MODE)
            except OSError as err:
                self._said = f"the file could not be copied to {aside}: {err.strerror or err}"
            else:
                self._said = f"the file as read is copied to {aside}"
        return self._said


def _saved_entries(
    path: Path,
    data: Mapping[str, Any],
    key: str,
    read: Callable[[str, Any], _Entry | None],
    aside: _SkippedCopy,
) -> list[_Entry]:
    """The entries of the state file's object ``key`` as ``read`` makes them (None: not
    kept). One it refuses is logged, naming the file and its key, and skipped, the file as
    read copied ``aside`` first: the rest, and the rest of the file, are kept."""
    saved = data.get(key) or {}
    if not isinstance(saved, dict):
        log.error(
            "co-location state %s: %s is not an object (%s): not read; %s",
            path,
            key,
            _value(saved),
            aside.made(),
        )
        return []
    read_: list[_Entry] = []
    for name, entry in saved.items():
        try:
            one = read(str(name), entry)
        except ValueError as err:
            log.error(
                "co-location state %s: %s.%s not read (%s): skipped; %s",
                path,
                key,
                _key(name),
                err,
                aside.made(),
            )
            continue
        if one is not None:
            read_.append(one)
    return read_


def _write_state(path: Path, text: str) -> None:
    """The state file's default writer: atomically, readable by its owner alone."""
    write_atomically(path, text, mode=STATE_FILE_MODE)


def _learned(st: _JobState) -> dict[str, Any]:
    """What a job showed, as :meth:`ColoService._state` writes it: its kind, alone rates
    and footprints per device."""
    devices: dict[str, Any] = {}
    for place, ds in sorted(st.devices.items()):
        if (f := ds.features) is not None:
            devices[place] = {**_footprint(f), "share": ds.share}
            if ds.whole is not None:
                devices[place]["whole"] = _footprint(ds.whole)
    return {
        "kind": st.kind,
        "registered_at": st.registered_at,
        "alone_rate": st.alone_rate,
        "alone_config": st.alone_config,
        "alone_rates": {str(k): v for k, v in st.alone_rates.items()},
        "devices": devices,
    }


def _working(st: _JobState, now: float) -> bool:
    """Whether a training job that reports its progress works now: its company settled,
    and it reported an iteration within ``RATE_WINDOW_S`` or twice the time between its
    last two (an iteration of its pace, its throttled sleep with it), whichever is longer.
    One that reported no iteration yet does not: its first may be a compile."""
    if now <= st.since:
        return False
    points = st.progress
    # the points an iteration was reported at, not those that only told another duty
    ends = [p[0] for i, p in enumerate(points) if i == 0 or p[1] > points[i - 1][1]]
    if not ends:
        return False
    gap = ends[-1] - ends[-2] if len(ends) >= 2 else 0.0
    return now - ends[-1] <= max(RATE_WINDOW_S, 2 * gap)


def _of_its_pace(points: Sequence[tuple[float, int, float]], ends: Sequence[int], at: int) -> bool:
    """Whether the stretch from the iteration that ended at ``points[at]`` to the next one
    is of the job's pace: its running time (the throttle's sleeps taken out) within
    ``RATE_WINDOW_S`` or twice that of the stretch before it, as :func:`_working` judges,
    so that a checkpoint or a restart is not read as iterations. The first iteration read
    has no stretch before it to judge by, and is taken."""
    after = [i for i in ends if i > at]
    k = ends.index(at)
    if not after or not k:
        return True

    def running(a: int, b: int) -> float:
        return sum((q[0] - p[0]) * p[2] for p, q in itertools.pairwise(points[a : b + 1]))

    return running(at, after[0]) <= max(RATE_WINDOW_S, 2 * running(ends[k - 1], at))


def _config(jobs: Sequence[RunningJob]) -> str:
    """What a job runs at on its devices, as its rate depends on it: its MIG profile or
    MPS thread percentage on each ("50%", "MIG 3g.40gb")."""
    return ", ".join(
        sorted(
            f"MIG {r.mig_profile}" if r.mig_profile else f"{r.threads_percent or 100}%"
            for r in jobs
        )
    )


def _share_of(config: str) -> float:
    """The MPS share a :func:`_config` names: "30%", "30%, 30%": 0.3; shares that differ
    ("100%, 30%"), their least, so that no whole GPU's footprint is taken from them;
    anything else (a MIG instance, none) a whole GPU's."""
    shares = [_percent(p) for p in config.split(", ")]
    if None in shares:
        return 1.0
    return min(s or 100 for s in shares) / 100.0


def _percent(part: str) -> int | None:
    """The MPS thread percentage one device's part of a :func:`_config` names ("30%": 30);
    None for anything else (a MIG instance). Only ASCII digits count: ``str.isdigit`` takes
    "²" too, which ``int`` refuses."""
    digits = part.removesuffix("%")
    if digits == part or not (0 < len(digits) <= 3 and digits.isascii() and digits.isdigit()):
        return None
    return int(digits)


def _saved_config(config: object, where: str) -> str:
    """An ``alone_config`` of the state file, as :func:`_config` writes it: each device's
    part an MPS thread percentage from 1 to 100 ("50%") or a MIG instance ("MIG 3g.40gb"),
    joined by ", " (``where``: its key, for the error)."""
    if isinstance(config, str) and all(
        p.startswith("MIG ") or 0 < (_percent(p) or 0) <= 100 for p in config.split(", ")
    ):
        return config
    raise ValueError(
        f"{where}: a text like '50%' or 'MIG 3g.40gb' expected (MPS shares from 1% to"
        f" 100%), not {_value(config)}"
    )


# The longest state file key (a job's name, a waiting run's id, a device) a message repeats
# as it is: a job name is 63 characters at most; a longer key is a hand edit, or a hostile
# file, and is shortened (a 1 MB key would be a 1 MB journal line, twice over).
_KEY_CHARS = 64


def _key(key: object) -> str:
    """A key of the state file as a message names it: as it is when it is no longer than a
    key gpud writes, else its start and its length (:func:`gpud.shared.shown`)."""
    text = str(key)
    return text if len(text) <= _KEY_CHARS else shown(text, _KEY_CHARS)


def _value(value: object) -> str:
    """A value of the state file as an error repeats it: a long one shortened (a hand edit
    may hold thousands of characters)."""
    if isinstance(value, str):
        return shown(value, 40)
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


def _place(r: RunningJob) -> str:
    """The key of a job's device: its UUID (GPU or MIG), else its GPU index."""
    return r.device or f"GPU {r.gpu}"


def _memory_totals(snapshot: Snapshot) -> dict[str, int]:
    """The memory of each device of the healthy GPUs NVML read: by GPU UUID, by ``GPU N``
    (:func:`_place`'s keys) and by MIG device UUID (the instance's own memory). A size the
    driver reports as 0 (a MIG device's, read while it is being made) is left out, as
    unknown: bounding a job's reading by it would take its run's peak for 0; a job in such
    an instance is bounded by its GPU's memory."""
    totals: dict[str, int] = {}
    for g in snapshot.gpus:
        if not g.healthy or g.memory is None or g.memory.total_bytes <= 0:
            continue
        totals[g.identity.uuid] = totals[f"GPU {g.identity.index}"] = g.memory.total_bytes
        for m in g.mig_devices:
            if m.identity.memory_total_bytes > 0:
                totals[m.identity.uuid] = m.identity.memory_total_bytes
    return totals


@dataclass(frozen=True)
class Advice:
    """Where a new job should go: ``gpu`` -1 means wait (``reason`` says why)."""

    gpu: int
    sm_share: float
    memory_limit_bytes: int
    mig_profile: str | None  # a MIG instance of this profile rather than an MPS share
    device: str  # the GPU or MIG device UUID to reserve ("" when waiting)
    predicted_speed: float
    reason: str
    # the waiting asker's id while it waits (``gpuctl queue --leave ID``), else ""
    waiter_id: str = ""


@dataclass(frozen=True)
class GuardView:
    job: str
    gpu: int
    slo_ms: float
    p99_ms: float | None  # over the latency window
    duty: float
    action: str
    reason: str
    attainment: float
    # over the reports since the training's duty last changed: what the guard acts on
    p99_at_duty_ms: float | None = None


@dataclass(frozen=True)
class ColoView:
    """What ``gpuctl colo show`` prints."""

    enabled: bool
    plan: Plan | None
    plan_age_s: float
    running: tuple[RunningJob, ...]
    duty: dict[str, float]
    observed_speed: dict[str, float]
    guards: tuple[GuardView, ...]
    predictor_samples: int
    predictor_mae: float
    faulty: dict[int, str] = field(default_factory=dict)  # GPU -> why it is left alone
    # job -> what it is told now: the plan's directive, or an eviction that still stands
    directives: dict[str, Directive] = field(default_factory=dict)
    # the p90 margin (log-speed) per standing of a prediction's pairs ("0", "1+", "30+")
    predictor_margins: dict[str, float] = field(default_factory=dict)
    predictor_margin_errors: dict[str, int] = field(default_factory=dict)
    # the last advice: the job, and its options refused by (jobs on the GPU, check)
    refused_job: str = ""
    refused: dict[tuple[int, str], int] = field(default_factory=dict)
    # GPU index -> processes of no job there (MPS servers aside)
    strangers: dict[int, int] = field(default_factory=dict)
    # each gpuctl run waiting for advice, in the order it is served
    waiting: tuple[WaiterView, ...] = ()


PRIOR = JobFeatures(sm=0.8, mem_bw=0.6)
# A waiting gpuctl run asks every 1-4 s: one silent this long has gone (Ctrl-C, killed).
WAITER_GONE_S = 10.0
# How long a waiting run dropped for its silence is remembered, and a `gpuctl queue
# --leave` or `gpuctl jobs rm` that took it out: one that was only stopped (Ctrl-Z)
# and asks again within it is told what happened to it meanwhile, or waits again from
# then, behind the runs that came while gpud listed it no more.
DROPPED_KEEP_S = 86400.0
# How many such runs are remembered at most, dropped and taken out each (the oldest go
# first): a client asking under ever new ids and then falling silent costs no more.
DROPPED_KEEP_MAX = 10_000
# How long a run that took itself out of the wait as it stopped (Ctrl-C, SIGTERM: its
# process exits) is remembered: only a question of it already on its way comes later. Not
# written to colo.json: its process is gone.
STOPPED_LEFT_KEEP_S = 60.0
# How long an operator's leave waits for colo.json to hold it (a write of the loop's
# tick may be under way): its RPC answers once it is on disk, or after this, saying so.
LEAVE_WRITE_S = 2.0
# A run dropped for its silence that asks again within this of its last question was not
# stopped but late (gpud slow to answer its last question, which it waits for before its
# next 1-4 s): it keeps its place. Silent longer, it was stopped (Ctrl-Z) and waits again
# from then.
WAITER_STOPPED_S = 30.0
# A planning pass made for advice answers the same question again for this long: every run
# that waits asks every few seconds, and each question plans them all.
ADVICE_REUSE_S = 1.0
# The layout of colo.json this gpud writes and reads; a file without one was written before
# it was kept, in this layout.
STATE_FILE_VERSION = 1
# A run given a place reserves it at once (gpuctl run): until its reservation shows, or for
# this long at most, later advice counts it there, so that runs asking together are not all
# told that one GPU is free.
PROMISE_S = 10.0
# How long a user's name, once looked up, names its UID: each waiting run asks every few
# seconds, and each question names the users of every whole GPU's MPS server.
NAME_TTL_S = 60.0


@dataclass
class _Promise:
    """The place advice gave a run that reserves it at once, as a running entry, until a
    reservation of its job made since shows (``shown``: that reservation's stamp)."""

    place: RunningJob
    at: float  # the loop's clock
    wall: float  # Unix time, as reservations are stamped (RunningJob.reserved_at)
    shown: float | None = None


@dataclass
class _Waiter:
    """A ``gpuctl run`` told to wait that keeps asking: its job, since when, its last ask,
    why it waits, the job as the planner saw it (planned again with every later ask, ahead
    of the askers that came after it), and its id (``gpuctl queue --leave ID``). Two runs
    of one job are two waiters, each with its own id, as they are two queue entries.
    ``anonymous``: it asks without an id (a gpuctl that predates them), so its next
    question is known by its job alone."""

    job: str
    since: float
    last: float
    reason: str
    view: JobView
    id: str
    anonymous: bool = False
    uid: int | None = None  # its run's user (:meth:`ColoService.advise`'s ``uid``)


class WaiterView(NamedTuple):
    """A ``gpuctl run`` waiting for advice, as ``gpuctl queue`` and ``gpuctl colo show``
    list it."""

    job: str
    waited_s: float
    reason: str
    id: str  # what `gpuctl queue --leave` takes
    uid: int | None = None  # its run's user, where its question named the holder's PID


def new_waiter_id() -> str:
    """An id of the admission queue's form (12 hex digits): `gpuctl queue --leave`
    takes either."""
    return secrets.token_hex(6)


def _headline(reason: str) -> str:
    """What a GPU's health reason says first: "GPU lost (memory)" of "GPU lost (memory):
    nvmlDeviceGetMemoryInfo failed ...; critical Xid 79: ...", "not answering" of "not
    answering: ...; last seen as ... at 00000000:5D:00.0" (a PCI bus id has colons too)."""
    return reason.partition("; ")[0].partition(":")[0]


def _waiter_id(asked: str | None) -> str | None:
    """The id a waiting run says it was given (before a gpud restart), if of that form."""
    if asked is None or len(asked) != 12 or asked.strip("0123456789abcdef"):
        return None
    return asked


def _mig_sm_fraction(instance: MigDeviceIdentity, gpu: GpuIdentity) -> float | None:
    """The share of the whole GPU's SMs a MIG device has: its SMs over the product's
    (``nvmlDeviceGetAttributes`` multiprocessorCount; an H100's 3g.40gb has 60 of 132, its
    4g.40gb 64), else its slices of seven (``3g.40gb`` -> 3/7, ``1c.3g.40gb`` -> 1/7); None
    for a name that is no MIG profile."""
    spec = lookup(gpu.product)
    if spec is not None and instance.multiprocessor_count > 0:
        return min(1.0, instance.multiprocessor_count / spec.sm_count)
    head = instance.profile_name.partition(".")[0]
    if not head.endswith(("c", "g")):
        return None
    slices = head[:-1]
    if not slices.isdigit() or not 0 < int(slices) <= MIG_COMPUTE_SLICES:
        return None
    return int(slices) / MIG_COMPUTE_SLICES


def _services(running: Sequence[RunningJob]) -> dict[str, list[RunningJob]]:
    """The inference services among ``running`` that have an SLO, each with its devices (a
    job registered before SLOs were bounded may hold an infinite one: it has no guard)."""
    services: dict[str, list[RunningJob]] = {}
    for r in running:
        if r.kind == "inference" and r.slo_p99_ms and math.isfinite(r.slo_p99_ms):
            services.setdefault(r.name, []).append(r)
    return services


def _shares_device(a: RunningJob, b: RunningJob) -> bool:
    """Whether two jobs on one GPU contend: on the whole GPU, or in the same MIG instance
    (separate MIG instances are isolated)."""
    if a.mig_profile is None and b.mig_profile is None:
        return True
    return bool(a.device) and a.device == b.device


class ColoService:
    def __init__(
        self,
        config: ColocateConfig,
        events: EventLog,
        *,
        running: Callable[[], Sequence[RunningJob]],
        holding: Callable[[], set[str]] | None = None,
        strangers: Callable[[], Mapping[int, int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        host: HostUsage | None = None,
        state_file: Path | None = None,
        default_memory: Callable[[], Mapping[int, int]] | None = None,
        name_of: Callable[[int], str] = user_name,
        wall: Callable[[], float] = time.time,
        write: Callable[[Path, str], None] | None = None,
        registered: Callable[[], Mapping[str, float | None]] | None = None,
        remember: int = DROPPED_KEEP_MAX,
        boot_id: Callable[[], str | None] = read_boot_id,
        leave_write_s: float = LEAVE_WRITE_S,
    ) -> None:
        """``host``: reads the CPU and memory use of the jobs' process trees (default: the
        host's ``/proc``). ``state_file``: where what the loop learned about running jobs
        (alone rates and footprints, guard and training duties) outlives the daemon, so that
        a restart neither forgets a shared job's alone rate nor lets throttled training run
        at full duty until the guard cuts it again. ``strangers``: per GPU index, how many
        compute processes NVML lists there that belong to no job (nor to an MPS server);
        the planner predicts every job's speed beside them and never calls that GPU free.
        ``default_memory``: per GPU index, its MPS default pinned memory limit (``gpuctl mps
        set --memory``), where it has one: what a new run that sets no memory is planned at
        there. ``name_of``: a UID's user name, for the reason a GPU is barred to a run
        (:meth:`advise`), asked with the loop's lock free. ``holding``: the jobs that hold a
        reservation now (default: those ``running`` lists), read by the first :meth:`show`
        after :meth:`reservations_freed` said some went, so that a run that ended is not
        shown placed until the next pass; a show (``/metrics``, ``gpuctl colo show``) with
        none gone since reads nothing. ``wall``: Unix time, what reservations are stamped
        with (:attr:`RunningJob.reserved_at`). ``write``: how the state file is written
        (default: atomically, :func:`write_atomically`). ``registered``: the jobs registered
        now (the jobs service's registry), each name with when it was registered
        (``jobs.created_at``; None: not known), asked once as the state file is read: what
        it holds of any other job, or of a job registered at another time than the file
        says (the name was removed and added again after the file's last write, gpud killed
        before the next one), is dropped, so a job added again under its name is not
        planned with the removed one's footprints, alone rate and duties (default: all
        are kept). ``remember``: how many waiting runs dropped for their silence, and how
        many taken out, are remembered at most for their next question (the oldest go
        first). ``boot_id``: the kernel's id of the running boot (default:
        :func:`read_boot_id`), read once: the leaves and removals colo.json holds are read
        on the loop's ``clock`` (``time.monotonic``: kept by the kernel from boot) as it
        wrote them when written on this boot, and forgotten when written on another (no
        gpuctl run outlives a reboot). ``leave_write_s``: how long an operator's leave
        waits for colo.json to hold it (a write of the tick under way) before it answers."""
        self._remember = remember
        self._boot = boot_id()  # one for the process's life
        self._name_of = name_of
        self._names: dict[int, tuple[str, float]] = {}  # UID -> its name, when looked up
        self._wall = wall
        self._holding = holding or (lambda: {r.name for r in running()})
        # the jobs of the last pass that still hold a reservation; None: some went since
        # (reservations_freed), the next show reads which (holding)
        self._held: frozenset[str] | None = frozenset()
        self._freed = 0  # reservations_freed calls so far
        self._events = events
        self._running = running
        self._default_memory = default_memory if default_memory is not None else dict
        self._strangers = strangers if strangers is not None else dict
        self._host = host if host is not None else HostUsage(clock=clock)
        self._nvlink = NvlinkRates()
        self._clock = clock
        self._lock = threading.RLock()
        self.predictor = InterferencePredictor()
        self._jobs: dict[str, _JobState] = {}
        self._guards: dict[str, ServiceGuard] = {}
        # services whose guard acted beside training at the last tick: any other takes up
        # its guard's duty again (a restart, back from a pause or from not running) only
        # beside the company it was set in
        self._guarding: set[str] = set()
        # (under _lock) when a reload last switched the loop on: no tick ran while it was
        # off, so nothing told a guard that a GPU hung under its service then, and what a
        # service reported before this is no evidence of the training's doing
        self._on_since = float("-inf")
        self._directives: dict[str, Directive] = {}
        self._plan: Plan | None = None
        self._plan_at = 0.0
        self._last_tick: float | None = None
        self._last_running: tuple[RunningJob, ...] = ()
        # the jobs running as the loop last read them, at every tick (one standing still
        # too) and, until the first, as colo.json wrote them: a removal writes what these
        # show (directives, guards) and every other job as ended
        self._running_names: tuple[str, ...] = ()
        self._observed: dict[str, float] = {}
        self._faulty: dict[int, str] = {}  # GPU -> why, at the last tick
        # inference services all of whose GPUs were faulty at the last tick (or when the
        # state file was last written, until the first tick): guards paused
        self._paused_services: set[str] = set()
        # the last advice: its job and the options its plan refused (only advice has
        # pending jobs: the loop's own plans direct running ones)
        self._refused: tuple[str, Mapping[tuple[int, str], int]] = ("", {})
        # the last pass made for advice: (the question, when, the plan)
        self._advice_pass: tuple[Hashable, float, Plan] | None = None
        self.advice_passes = 0  # planning passes made for advice
        # askers told to wait that keep asking (gpuctl run), by waiter id: a run asks with
        # the id it was told, so two runs of one job are two waiters
        self._waiting: dict[str, _Waiter] = {}
        # (job, waiter id) -> the place advice gave a run that reserves it (``reserving``):
        # two runs of one job are two places
        self._promised: dict[tuple[str, str], _Promise] = {}
        # (job, stamp, devices) of reservations made since the last question: a deque, as
        # the jobs service appends from inside its write transaction without the lock
        self._made: deque[tuple[str, float, tuple[str, ...]]] = deque()
        # job -> when `gpuctl jobs rm` removed it while a run of it waited (--force) or was
        # dropped, and whether forced: that run's next question is answered NotFound (kept
        # DROPPED_KEEP_S, in the order removed)
        self._removed: dict[str, _Removed] = {}
        # job -> when (Unix time) `gpuctl jobs rm` removed it: a list of reservations read
        # before that, and its stopping processes' reports, are not learned from (nor is
        # the job kept) until a reservation made after it shows the job added again
        self._gone: dict[str, _Gone] = {}
        self._removals = 0  # removals committed so far (_Gone.seq)
        # waiter id -> when `gpuctl queue --leave ID` took that run out of the wait: its
        # next question is answered LeftQueue (kept DROPPED_KEEP_S, `remember` at most,
        # in the order taken out)
        self._left: dict[str, _Left] = {}
        # waiter id -> when the run took itself out as it stopped (Ctrl-C, SIGTERM): only a
        # question already on its way is answered LeftQueue (kept STOPPED_LEFT_KEEP_S, not
        # written to colo.json: the process has exited)
        self._stopped: dict[str, _Left] = {}
        # waiter id -> the run dropped for its silence (kept as _left is): a run stopped
        # meanwhile may ask again with that id
        self._dropped: dict[str, _Off] = {}
        self._state_file = state_file
        self._write = write or _write_state
        self._states = 0  # (under _lock) states built for the file so far
        # One write at a time, and never one of a state older than the last written: the
        # tick writes what it built under the loop's lock after letting go of it, and a
        # removal may build and write a newer one meanwhile (from the gRPC thread). Nobody
        # waits for another's write: the newest state not yet written waits in _pending,
        # and whoever holds _save_lock writes it once its own write is done.
        self._save_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending: tuple[int, dict[str, Any]] | None = None  # (under _pending_lock)
        # (set under _lock) the stop's state: it and every newer one are written whole, so
        # that a tick the stop gave up, which builds its state after the stop's and may
        # write first, does not leave out the clock the stop's would have written
        self._whole_from: float = math.inf
        self._saved: dict[str, Any] | None = None
        self._saved_clock = 0.0
        self._saved_idle: dict[str, float] = {}  # ended jobs' idle_s the file holds
        # (under _lock) the state that holds the loop's switch-off, once the loop is off
        # (0: it is on): the next state built from the reload that switched it off, saved
        # once the file holds it or a newer one, built again each off tick, and at the
        # stop, until then (a write refused by a full disk, no tick since the reload)
        self._off_state = 0
        self._save_error = ""  # why the last write failed ("": it did not)
        # Told each time a write is done (or failed): an operator's leave waits, up to
        # leave_write_s, until the state it built, or a newer one, is on disk.
        self._written = threading.Condition()
        # (set under _save_lock and _written) the newest state whose write is done
        self._tried_state = 0
        self._on_disk_state = 0  # (under _written) the newest state the file holds
        self._leave_write_s = leave_write_s
        self.config = config  # what configure switches from: nothing at the start
        self.configure(config)
        if state_file is not None:
            self._load(state_file, registered)
            if not config.enabled:
                # started off on a file a loop that was on wrote: off at once, as a reload
                # switches it, so a stop before the first tick writes it too
                with self._lock:
                    self._switch_off()
                    self._off_state = self._states + 1

    def configure(self, config: ColocateConfig) -> None:
        """(Re)apply the [colocate] settings; learned state is kept. A reload that switches
        the loop off switches it off at once (:meth:`_switch_off`), as one that raises
        ``min_duty`` lifts the guards' duties at once: training asking its duty (the
        job's throttle point) is told 1.0 from then, and a stop before the next tick
        writes the switch-off to colo.json."""
        with self._lock:
            if self.config.enabled and not config.enabled:
                self._switch_off()
                # the next state built holds it (one a tick built before is older)
                self._off_state = self._states + 1
            elif config.enabled:
                self._off_state = 0
                if not self.config.enabled:
                    # A report that says its age is counted from its earliest request, so
                    # the switch-on itself would do for it; one that says none (gpud.client
                    # sends a batch not held through a quiet spell so, as does an older
                    # client) is counted from its arrival and holds requests served up to
                    # two periods before (each request within a period of the one before,
                    # the batch sent at the first a period after the last send): the margin
                    # keeps those out, at the cost of two seconds' wait for the rest.
                    self._on_since = self._clock() + REPORT_GAP_S
            self.config = config
            self.predictor.scant_memory_s = config.scant_margin_memory_s
            self._planner = Planner(
                self.predictor,
                PlannerParams(
                    memory_headroom=config.memory_headroom,
                    max_slowdown=config.max_slowdown,
                    max_jobs_per_gpu=config.max_jobs_per_gpu,
                    slo_margin=config.slo_margin,
                    # The guard never throttles below its floor: the peak must hold there.
                    peak_duty=max(config.peak_duty, config.min_duty),
                    activity_weight=config.activity_weight,
                    head_hold_s=config.head_hold_s or math.inf,
                ),
            )
            self._guard_params = GuardParams(
                margin=config.slo_margin,
                decrease=config.guard_decrease,
                increase=config.guard_increase,
                min_duty=config.min_duty,
            )
            for g in self._guards.values():
                g.retune(self._guard_params)

    # -- reports from jobs --------------------------------------------------------------------
    def report_latency(
        self, job: str, seconds: Sequence[float], age_s: float | None = None
    ) -> None:
        """An inference service's latencies (the ``ReportLatency`` RPC), counted from now;
        a batch held through a quiet spell says its age (``gpud.client.Latency``: seconds
        since its earliest request began), and is counted from then, so that it is not
        taken for what its GPU does when it arrives, but never from before the job's
        newest report (its stamps stay in time order)."""
        if age_s is not None and not 0.0 <= age_s <= MAX_REPORT_AGE_S:  # NaN too
            raise InvalidArgument(
                f"job {job}: latency report age_s {age_s} s outside "
                f"[0, {MAX_REPORT_AGE_S:g}] seconds"
            )
        if len(seconds) > MAX_LATENCY_SAMPLES:
            raise InvalidArgument(
                f"job {job}: at most {MAX_LATENCY_SAMPLES} latency samples per report, "
                f"got {len(seconds)}"
            )
        bad = next((s for s in seconds if not 0.0 <= s <= MAX_LATENCY_S), None)  # NaN too
        if bad is not None:
            raise InvalidArgument(
                f"job {job}: latency sample {bad} s outside [0, {MAX_LATENCY_S:g}] seconds"
            )
        with self._lock:
            now = self._clock()
            if job in self._gone:  # removed: its processes' last reports
                return
            st = self._jobs.setdefault(job, _JobState())
            st.seen = now
            # A held batch, whole, from its earliest request: one served before a cut reached
            # the training, or while the loop was off, is never judged as after it. Never
            # before the job's newest report (kept when a switch-off clears the latencies):
            # the window slices, the latest ``at_least`` and load() read each job's stamps in
            # time order. Only several replicas under one job report out of order, and they
            # can only make a held batch count as later, never earlier, than the job's last.
            newest = st.reports[-1][0] if st.reports else -math.inf
            served = max(now - (age_s or 0.0), newest)
            st.latency.extend((served, s) for s in seconds)
            if seconds:
                st.reports.append((served, len(seconds)))

    def throttle_point(self, job: str, iterations: int, *, process: str = "") -> Directive:
        """Record a training job's progress; return the duty cycle it should run at. A
        report of 0 iterations (the client asks between the slices of a throttled sleep)
        is kept as a point only where the duty it is told differs from the last point's:
        the rest of the sleep runs at the new one, and :meth:`_rate` charges each stretch
        at the duty told at its start. Any report marks the job as one that reports.
        ``process``: the reporting process's id (``ThrottlePointRequest.process``; empty:
        an older client, whose reports all count as one process's). A process the job has
        not had, no other of it reporting lately, was started again in the place of one
        that is gone: the progress reported before is that one's, and the job's rate is
        read from the new one's iterations on. One beside others reporting is another
        rank, and the job's progress goes on (:meth:`_new_process`)."""
        if not 0 <= iterations <= MAX_ITERATIONS:
            raise InvalidArgument(
                f"job {job}: {iterations} iterations since the last throttle point, "
                f"outside [0, {MAX_ITERATIONS}]"
            )
        if len(process) > MAX_PROCESS_ID:
            raise InvalidArgument(
                f"job {job}: throttle point process id of {len(process)} characters, "
                f"over {MAX_PROCESS_ID}"
            )
        now = self._clock()
        with self._lock:
            if job in self._gone:  # removed, stopping: told to run on, its progress not kept
                return Directive(1.0, False, "job removed")
            st = self._jobs.setdefault(job, _JobState())
            st.seen = now
            if self.config.enabled:
                d = self._directives.get(job, Directive(1.0, False, "no directive"))
            else:
                d = Directive(1.0, False, "co-location is off")
            st.reporting = True
            if process and self._new_process(st, process, now):
                st.progress.clear()
                st.since = max(st.since, now)
            if iterations > 0 or (st.progress and st.progress[-1][2] != d.duty):
                total = (st.progress[-1][1] if st.progress else 0) + iterations
                st.progress.append((now, total, d.duty))
            return d

    @staticmethod
    def _new_process(st: _JobState, process: str, now: float) -> bool:
        """Note a report of ``process``; True where it starts the job afresh: a process the
        job has not had while none of its others reported within RANK_QUIET_INTERVALS of
        its own intervals (at least RANK_QUIET_S). A rank's retries after calls that timed
        out on its side carry the id gpud already has, and start nothing afresh."""
        seen = st.processes
        last = seen.pop(process, None)
        if last is not None:
            seen[process] = (now, now - last[0])
            return False
        afresh = not any(
            now - at <= max(RANK_QUIET_S, RANK_QUIET_INTERVALS * gap) for at, gap in seen.values()
        )
        seen[process] = (now, 0.0)
        while len(seen) > MAX_JOB_PROCESSES:
            del seen[next(iter(seen))]  # the one that reported longest ago
        return afresh

    def duty(self, job: str) -> float:
        """The duty cycle the job is told to run at now (1.0: unthrottled)."""
        with self._lock:
            d = self._directives.get(job)
            return d.duty if d is not None else 1.0

    def p99(self, job: str, *, since: float = float("-inf"), min_samples: int = 1) -> float | None:
        """The job's p99 latency over the window (reports after ``since`` only); None with
        fewer than ``min_samples`` reports. Where the window holds fewer, the latest
        ``min_samples`` reports up to ``QUIET_WINDOWS`` windows back count: a service of
        little traffic is measured over as long as its requests take to come."""
        window = self._latencies(job, since, at_least=min_samples)
        if not window or len(window) < min_samples:
            return None
        window.sort()
        return window[min(len(window) - 1, math.ceil(0.99 * len(window)) - 1)]

    def _latencies(self, job: str, since: float, *, at_least: int = 0) -> list[float]:
        """The job's latency reports within the window and after ``since``, in seconds;
        with fewer than ``at_least`` there, the latest ``at_least`` within
        ``QUIET_WINDOWS`` windows."""
        now = self._clock()
        with self._lock:
            st = self._jobs.get(job)
            if st is None:
                return []
            window = self.config.latency_window_s
            inside = [s for t, s in st.latency if now - t <= window and t > since]
            if len(inside) >= at_least:
                return inside
            reach = QUIET_WINDOWS * window
            return [s for t, s in st.latency if now - t <= reach and t > since][-at_least:]

    def _rate(self, st: _JobState, now: float) -> float | None:
        """Iterations per second of running time, the throttle's sleeps taken out, since
        the job's company on its GPU last changed (at most ``RATE_WINDOW_S`` back), from
        the end of the last iteration at or before that start and after the change, while
        the stretch from it is of the job's pace (:func:`_of_its_pace`): a job whose
        iteration and sleep take longer than the window is read over its last whole one.
        Else from the first iteration's end inside the window. None where no iteration was
        reported after that point: a window inside one throttled sleep says nothing of the
        job's speed."""
        start = max(st.since, now - RATE_WINDOW_S)
        pts = list(st.progress)
        # read from an iteration's end, never from a point that only told another duty
        # (the sleep before it would go uncounted): the last one at or before the start,
        # in the job's present company, while the stretch from it to the next is of the
        # job's pace (not a checkpoint, a restart or a stall read as the job crawling);
        # else the first one inside the window
        ends = [i for i, p in enumerate(pts) if i == 0 or p[1] > pts[i - 1][1]]
        inside = [i for i in ends if st.since <= pts[i][0] <= start]
        first = inside[-1] if inside and _of_its_pace(pts, ends, inside[-1]) else None
        if first is None:
            first = next((i for i in ends if pts[i][0] > start), None)
            if first is None:
                return None
        points = pts[first:]
        busy = sum((b[0] - a[0]) * a[2] for a, b in itertools.pairwise(points))
        done = points[-1][1] - points[0][1]
        return done / busy if busy > 0 and done > 0 else None

    def service_rate(self, job: str, *, since: float = float("-inf")) -> float | None:
        """An inference service's speed: its M/M/1 service rate, from the latencies it
        reported after ``since`` (within the window) and its load. An M/M/1 queue's response
        time is exponential with rate ``mu - lambda`` (the model of ``colocate.shapes``), so
        its median is ``ln 2 / (mu - lambda)`` and ``mu = lambda + ln 2 / median``. The
        median, not the mean or the p99, because one slow request (a long prompt, a GC
        pause) moves it least; the load corrects for the queueing, so that intervals at
        different loads compare. None with fewer than ``MIN_FRESH_SAMPLES`` reports, or a
        median under ``MIN_MEDIAN_LATENCY_S``."""
        window = self._latencies(job, since)
        if len(window) < MIN_FRESH_SAMPLES:
            return None
        median = statistics.median(window)
        if median < MIN_MEDIAN_LATENCY_S:
            return None
        return self.load(job) + math.log(2) / median

    def rate_at_share(self, r: RunningJob) -> float:
        """An inference service's rate (requests/s) at its share on that device: the one it
        shows (:meth:`service_rate`, over the whole window, as its p99 shown is: what the
        simulated device serves it at, not a guard's judgement, so latencies from before a
        cut, a hang or the loop's switch-on count too), else its shape's at its share (what
        it declared, or the prior)."""
        measured = self.service_rate(r.name)
        if measured is not None:
            return measured
        with self._lock:
            view = self._view(r)
        return view.shape.service_rate(view.sm_share)

    def load(self, job: str) -> float:
        """An inference job's request rate: latencies reported per second over the window.

        Each report holds the requests served since the one before it (``gpud.client``
        flushes every second), so the rate is the requests in the reports after the window's
        first over the time since it: counting the first too, or dividing by the window,
        reads up to one report period per window high or low. Requests are counted per
        report, not from the latencies kept (a service busier than MAX_LATENCY_SAMPLES a
        second would read as that). The span ends at the last report, or ``REPORT_GAP_S``
        before now if that is later: a service that stopped reporting stopped serving. It is
        a report period at least: reports close together (a batch held through a quiet spell,
        counted from when it was served, and the next) are not ``1/span`` requests a second.
        One report alone stands for the report period before it."""
        now = self._clock()
        with self._lock:
            st = self._jobs.get(job)
            if st is None:
                return 0.0
            cut = now - self.config.latency_window_s
            reports = [(t, n) for t, n in st.reports if t > cut]
        if not reports:
            return 0.0
        first = reports[0][0]
        later = sum(n for t, n in reports if t > first)
        end = max(reports[-1][0], now - REPORT_GAP_S)
        if later == 0:
            served = sum(n for _, n in reports)
            return served / max(REPORT_PERIOD_S, end - first + REPORT_PERIOD_S)
        return later / max(end - first, REPORT_PERIOD_S)

    # -- the loop -----------------------------------------------------------------------------
    def tick(self, snapshot: Snapshot | None) -> Plan | None:
        self.waiting()  # runs that stopped asking go (an event says so) though none lists them
        if snapshot is None or not self.config.enabled:
            with self._lock:
                removals = self._removals
            running = tuple(self._running())
            with self._lock:
                # a job added again is one no more removed
                running = self._present(running, removals)
                self._running_names = tuple(r.name for r in running)
                # The loop stands still: the time until it runs again does not age what
                # the predictor learned, as the time gpud is down does not.
                self._last_tick = None
                if self.config.enabled:
                    return None
                self._switch_off()
                if self._off_state and self._holds(self._off_state):
                    return None
                # once the file holds it: a restart then tells training no duty of the
                # guards', nor restores them, and says the switch-off no more
                state = self._state(self._running_names)
                self._off_state = state[0] if state is not None else 0
            self._save(state)
            return None
        with self._lock:
            freed, removals = self._freed, self._removals
        running = tuple(self._running())
        with self._lock:
            if not self.config.enabled:
                # a reload switched the loop off meanwhile (configure): it stays off
                return None
            running = self._present(running, removals)
            # A GPU that is lost or does not answer runs nothing anyone can measure: its
            # jobs keep their directives and guards as they were, out of the plan, until it
            # answers again (or their processes end and gpud releases them).
            self._faulty = {
                # "GPU lost (memory): ..." -> "lost (memory)": said after "GPU N"
                g.identity.index: _headline(g.reason).removeprefix("GPU ") or "unhealthy"
                for g in snapshot.gpus
                if not g.healthy
            }
            now = self._clock()
            self._note_arrivals(running, now, _memory_totals(snapshot))
            if self._last_tick is not None:
                # The time gpud was down does not age what the predictor learned.
                self.predictor.advance(now - self._last_tick)
            self._last_tick = now
            live = tuple(r for r in running if r.gpu not in self._faulty)
            self._hold_paused_guards(running, live, now)
            gpus, _ = self._gpu_views(snapshot, live)
            per_gpu: dict[int, list[RunningJob]] = {}
            for r in live:
                per_gpu.setdefault(r.gpu, []).append(r)
            self._learn(snapshot, per_gpu)
            uuids = {g.identity.index: g.known().uuid for g in snapshot.gpus}
            self._ensure_guards(running)
            p99s = self._count_attainment(running)
            duty_by_gpu, evict_by_gpu = self._guard_step(live, per_gpu, uuids, p99s)
            views = [self._view(r) for r in live]
            plan = self._planner.plan(gpus, views, duty_by_gpu, evict_by_gpu)
            held = {r.name for r in running if r.gpu in self._faulty}
            self._apply(
                plan, keep=held, present={r.name for r in live}, paused=self._paused(running)
            )
            self._plan, self._plan_at, self._last_running = plan, self._clock(), running
            self._running_names = tuple(r.name for r in running)
            # a reservation that went while ``running`` was read may be in it
            self._held = frozenset(r.name for r in running) if freed == self._freed else None
            self._forget(running)
            state = self._state(r.name for r in running)
        # The disk flush waits outside the lock: latency reports and `colo show` do not.
        self._save(state)
        return plan

    def _present(self, running: Sequence[RunningJob], removals: int) -> tuple[RunningJob, ...]:
        """``running`` without the reservations of removed jobs (read before the removal
        committed); a job's reservation made after its removal (it was added again) ends
        that. ``removals``: how many removals had committed when ``running`` was read.
        Under the lock."""
        now = self._clock()
        for r in running:
            gone = self._gone.get(r.name)
            if gone is None or r.reserved_at is None:
                continue
            # made after the removal, or read after it committed (the wall clock may have
            # stepped back since). The jobs service commits the removal of the job's
            # reservations before it calls the hook that counts the removal, under its
            # placement lock across both: a read begun after the count lists none of the
            # job's reservations from before it.
            if r.reserved_at > gone.wall or gone.seq <= removals:
                del self._gone[r.name]
        # a removal an hour old: no reservation read before it is still about
        self._gone = {j: g for j, g in self._gone.items() if now - g.at <= FORGET_AFTER_S}
        return tuple(r for r in running if r.name not in self._gone)

    def _switch_off(self) -> None:
        """The loop is off (a reload): no guard watches any service, so no training stays
        throttled or evicted by what one decided; switched on again, guards start afresh:
        at full duty, paused by no GPU fault, and beside no training they remember (nor
        does colo.json hold any of it). Under the lock."""
        for job, told in sorted(self._directives.items()):
            if told.evict or told.duty < 1.0:
                self._events.emit(
                    "colo.duty",
                    f"job {job} duty {0.0 if told.evict else told.duty:.2f} -> 1.00: "
                    "co-location is off",
                    job=job,
                )
        self._directives = {}
        self._guarding.clear()
        for name in self._paused_services:
            # what a paused service reported is the fault's doing: a guard switched on
            # again starts afresh, with no pause to tell it to wait those latencies out
            if (paused := self._jobs.get(name)) is not None:
                paused.latency.clear()
        self._paused_services.clear()
        for st in self._jobs.values():
            st.guard_company = None
        for name, g in self._guards.items():
            g.reset()
            self._jobs.setdefault(name, _JobState()).guard_since = float("-inf")

    def _note_arrivals(
        self, running: Sequence[RunningJob], now: float, totals: Mapping[str, int]
    ) -> None:
        """When each running job was first seen running: a job that stopped (an eviction, a
        restart) arrives anew when it runs again, and its progress starts afresh (as where
        it ended and began again between two ticks: another reservation time). Jobs first seen in the same tick (all of
        them after gpud restarts) arrived in the order of their reservations. ``totals``:
        the memory of each device of a healthy GPU (:func:`_memory_totals`), which bounds
        the reading of a job there its run's peak takes."""
        reserved: dict[str, float] = {}
        for r in running:
            st = self._jobs.setdefault(r.name, _JobState())
            if r.registered_at is not None:
                st.registered_at = r.registered_at
            if st.arrived is None:
                st.arrived = now
                # an eviction that still stands (the job has not left yet: gpud restarted
                # while it checkpointed) is not a new run
                told = self._directives.get(r.name)
                st.evicted = st.evicted and told is not None and told.evict
            reserved.setdefault(r.name, math.inf)
            if r.reserved_at is not None:
                reserved[r.name] = min(reserved[r.name], r.reserved_at)
        for name, at in reserved.items():
            st = self._jobs[name]
            run = at if at < math.inf else None
            if None not in (run, st.run) and run != st.run:  # ended and began between ticks
                st.new_run(now)
            st.run = run if run is not None else st.run
        for name, st in self._jobs.items():
            if name not in reserved:
                if st.arrived is not None:  # its run ended
                    st.new_run(now)
                st.run = None
                st.arrived = None
                st.unseen_since, st.unseen_said = None, False
                st.memory_peaks.clear()
        for r in running:
            total = totals.get(_place(r), totals.get(f"GPU {r.gpu}"))
            # A reading from a GPU that does not answer, or beyond the device's memory, is
            # the driver's garbage, not the job's: one would hold the device for the run.
            if r.memory_used and total is not None:
                peaks = self._jobs[r.name].memory_peaks
                run, peak = peaks.get(_place(r), (r.reserved_at, 0))
                if run != r.reserved_at:  # another run: the last one's peak is not its own
                    peak = 0
                peaks[_place(r)] = (r.reserved_at, max(peak, min(r.memory_used, total)))
        order = sorted(reserved, key=lambda n: (self._jobs[n].arrived, reserved[n], n))
        for rank, name in enumerate(order):
            self._jobs[name].rank = rank

    def _forget(self, running: Sequence[RunningJob]) -> None:
        """Drop what the loop holds of jobs that have not run for ``FORGET_AFTER_S``."""
        now = self._clock()
        names = {r.name for r in running}
        for name in names:
            self._jobs.setdefault(name, _JobState()).seen = now
        for name in [n for n, st in self._jobs.items() if now - st.seen > FORGET_AFTER_S]:
            del self._jobs[name]
            self._guards.pop(name, None)

    def holds(self, job: str) -> bool:
        """Whether the job holds a reservation on this node (it runs, or is about to): as
        of the last tick, else asked afresh (a job that has just started)."""
        with self._lock:
            if any(r.name == job for r in self._last_running):
                return True
        return any(r.name == job for r in self._running())

    # -- what outlives a restart ----------------------------------------------------------------
    def _load(
        self, path: Path, registered: Callable[[], Mapping[str, float | None]] | None
    ) -> None:
        """Read back what :meth:`_save` wrote. A file that is not the loop's (unreadable, not
        JSON, another shape) is logged and the loop starts afresh; a predictor state that
        does not validate is logged and the predictor starts afresh, the jobs' state kept.
        Jobs that ``registered`` does not list, or lists registered at another time, are
        dropped (their removal committed, the file not written since)."""
        try:
            text = path.read_text()
            data = json.loads(text)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as err:
            self._unreadable(path, f"co-location state {path} not read ({err}): starting afresh")
            return
        try:
            if not isinstance(data, dict):
                raise ValueError('not a co-location state: no "jobs" object')
            version = data.get("version", STATE_FILE_VERSION)
            if type(version) is not int or version != STATE_FILE_VERSION:
                # another gpud's layout (one gpud was downgraded from), whatever its shape:
                # its fields may mean what this one would misread
                raise ValueError(
                    f"version {_value(version)}: this gpud reads version {STATE_FILE_VERSION}"
                )
            if not isinstance(data.get("jobs"), dict):
                raise ValueError('not a co-location state: no "jobs" object')
            aside = _SkippedCopy(path, text)
            skipped = self._load_jobs(path, data["jobs"], aside)
            whole = self._load_evicted(path, data, skipped, aside) and not skipped
            self._load_off(path, data, aside)
            if registered is not None:
                self._drop_unregistered(path, registered())
            # those it wrote as running (a job that had ended, with how long ago it ran)
            self._running_names = tuple(
                n for n, saved in data["jobs"].items() if n in self._jobs and "idle_s" not in saved
            )
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            self._unreadable(path, f"co-location state {path} not read ({err}): starting afresh")
            self._jobs.clear()
            self._directives.clear()
            self._guards.clear()
            self._paused_services.clear()
            self._left.clear()
            self._removed.clear()
            return
        saved = data.get("predictor")
        if saved is None:
            return  # written before the predictor was kept: it starts afresh
        try:
            self.predictor = InterferencePredictor.from_dict(saved)
        except ValueError as err:
            self._unreadable(
                path,
                f"co-location state {path}: interference predictor not restored ({err}): it"
                " starts afresh",
            )
            return
        self.configure(self.config)  # the planner predicts with the restored one
        if not whole:
            return  # the first save writes the file without the entries not read
        # read whole: the file holds this state already, and a stop before anything changed
        # (a start that fails at once, again and again) writes nothing
        self._saved, self._saved_clock, self._saved_idle = _unclocked(data)

    def _load_jobs(self, path: Path, jobs: Mapping[str, Any], aside: _SkippedCopy) -> set[str]:
        """Each job's saved state (:meth:`_load_job`). One not read (a hand edit, a bug: a
        value out of its range, of another type) is logged, naming the file and its key,
        and skipped, as if gpud had not seen the job: its footprints, rates, duty, eviction
        and guard start afresh, the other jobs' kept. The file as read is copied ``aside``
        first, as the next save writes it without the job. Returns the jobs skipped."""
        skipped: set[str] = set()
        for key, saved in jobs.items():
            name = str(key)
            try:
                self._load_job(name, saved)
            except (ValueError, KeyError, TypeError, AttributeError, ArithmeticError) as err:
                # what it read of the job before the bad value is dropped with it
                self._forget_job(name)
                skipped.add(name)
                log.error(
                    "co-location state %s: jobs.%s not read (%s): that job starts afresh; %s",
                    path,
                    _key(name),
                    err if isinstance(err, ValueError) else f"jobs.{_key(name)}: {err!r}",
                    aside.made(),
                )
        return skipped

    def _load_evicted(
        self, path: Path, data: Mapping[str, Any], skipped: set[str], aside: _SkippedCopy
    ) -> bool:
        """The jobs the file says the loop evicted, less those ``skipped`` (a job whose
        entry was not read is one gpud has not seen: no GPU is held for a run of it). A
        value that is not a list, or an entry of it that is not a job's name, is logged,
        naming the file, and not read, the file as read copied ``aside`` first: no GPU is
        held for a rerun of the jobs it would name, while the evictions their own entries
        keep (``jobs.NAME.evict``) are still told; the rest of the file is read. Says
        whether the list was read whole."""
        evicted = data.get("evicted", [])  # absent from files written before it was kept
        unread = (
            [] if not isinstance(evicted, list) else [n for n in evicted if not isinstance(n, str)]
        )
        if not isinstance(evicted, list) or unread:
            whole = not isinstance(evicted, list)
            log.error(
                "co-location state %s: evicted %s (job names expected, not %s): no GPU is held"
                " for a rerun of %s (evictions already told stand); %s",
                path,
                "not read" if whole else "entries skipped",
                f"[{first_few(map(_value, unread), 5)}]" if not whole else _value(evicted),
                "an evicted job" if whole else "the jobs they stand for",
                aside.made(),
            )
        if not isinstance(evicted, list):
            return False
        for name in evicted:
            if isinstance(name, str) and name not in skipped:
                st = self._jobs.setdefault(name, _JobState())
                st.evicted, st.seen = True, self._clock()
        return not unread

    def _load_off(self, path: Path, data: Mapping[str, Any], aside: _SkippedCopy) -> None:
        """The waiting runs taken out and the jobs removed under a waiting run, as
        :meth:`_state` wrote them (absent from files written before they were kept).
        Written on this boot, each is as old on the loop's clock as it was written; on
        another, none is kept: no gpuctl run waits across a reboot. A file that names no
        boot (its id unknown when written), or an entry with no clock, is read by its Unix
        times, none later than now: a wall clock stepped back since does not make one
        recent again. An entry not read is logged, naming the file and its key, and
        skipped, the file as read copied ``aside`` first: the rest of the file is kept."""
        now, wall = self._clock(), self._wall()
        boot, saved_boot = self._boot, data.get("boot_id")
        if saved_boot is not None and not isinstance(saved_boot, str):
            log.error(
                "co-location state %s: boot_id is not a string (%s): its leaves and removals"
                " are read by Unix time",
                path,
                _value(saved_boot),
            )
            saved_boot = None
        if isinstance(saved_boot, str) and boot is not None and saved_boot != boot:
            if data.get("left") or data.get("removed"):
                log.info(
                    "co-location state %s: written on another boot (%s, now %s): its leaves"
                    " and removals of waiting runs are forgotten",
                    path,
                    _value(saved_boot),
                    boot,
                )
            return
        same = saved_boot is not None and saved_boot == boot

        def at(where: str, unix: Any, kept: Any) -> float | None:
            """When an entry came, on the loop's clock, from its Unix time and the loop's
            clock ``kept`` (null: not known when written); None: not to be kept."""
            t = _saved_number(unix, f"{where}.wall", 0.0)
            if same and kept is not None:
                # the loop's clock counts from boot: one ahead of now is not of this boot
                saved = _saved_number(kept, f"{where}.clock", -math.inf)
                if saved <= now:
                    return saved
                ahead = f"on the loop's clock {saved:g} s, now {now:g} s"
            elif t <= wall:
                return now - (wall - t)
            else:
                ahead = f"Unix time {t:.0f}, now {wall:.0f}"
            log.info("co-location state %s: %s dated after now (%s): not kept", path, where, ahead)
            return None

        def one_left(wid: str, saved: Any) -> tuple[float, str, _Left] | None:
            where = f"left.{_key(wid)}"
            # three: a gpud from before the loop's clock was kept wrote it, read by Unix time
            if not (isinstance(saved, list) and len(saved) in (3, 4) and isinstance(saved[0], str)):
                raise ValueError(
                    f"[job, Unix time, anonymous(, clock)] expected, not {_value(saved)}"
                )
            if not isinstance(saved[2], bool):
                raise ValueError(f"anonymous is true or false, not {_value(saved[2])}")
            came = at(where, saved[1], saved[3] if len(saved) == 4 else None)
            return (
                None
                if came is None
                else (came, wid, _Left(came, saved[0], saved[2], float(saved[1])))
            )

        def one_removed(job: str, saved: Any) -> tuple[float, str, _Removed] | None:
            # two: a gpud from before the loop's clock was kept wrote it, read by Unix time
            if not (
                isinstance(saved, list) and len(saved) in (2, 3) and isinstance(saved[1], bool)
            ):
                raise ValueError(f"[Unix time, forced(, clock)] expected, not {_value(saved)}")
            came = at(f"removed.{_key(job)}", saved[0], saved[2] if len(saved) == 3 else None)
            return None if came is None else (came, job, _Removed(came, saved[1], float(saved[0])))

        left = _saved_entries(path, data, "left", one_left, aside)
        removed = _saved_entries(path, data, "removed", one_removed, aside)
        self._left = {wid: off for _, wid, off in sorted(left)}
        self._removed = {job: r for _, job, r in sorted(removed)}
        _forget_old(self._left, now, self._remember)
        _forget_old(self._removed, now, self._remember)

    def _drop_unregistered(self, path: Path, registered: Mapping[str, float | None]) -> None:
        """Forget what the state file held of jobs not ``registered``, or registered at
        another time than it says: removed after its last write (the removal writes it at
        once, but a write that fails, a full disk, is only tried again each tick, and a
        kill -9 may come first), and added again under its name. A job the file names no
        registration of (written before it was kept) is taken as the one registered."""
        gone = sorted(n for n in self._jobs if n not in registered)
        again = sorted(
            n
            for n, st in self._jobs.items()
            if n in registered
            and None not in (st.registered_at, registered[n])
            and st.registered_at != registered[n]
        )
        for name in [*gone, *again]:
            self._forget_job(name)
        if gone:
            log.info(
                "co-location state %s: %s no longer registered, forgotten: %s",
                path,
                "a job" if len(gone) == 1 else f"{len(gone)} jobs",
                ", ".join(map(_key, gone)),
            )
        if again:
            log.info(
                "co-location state %s: %s removed and registered again since its last"
                " write, what the removed one showed forgotten: %s",
                path,
                "a job" if len(again) == 1 else f"{len(again)} jobs",
                ", ".join(map(_key, again)),
            )

    def _forget_job(self, name: str) -> None:
        """Drop all the loop holds of job ``name``, removed: what it showed, its guard, the
        directive it was told (an eviction included) and its guard's pause. A job added
        again under the name is another workload, which inherits none of it. Under the
        lock."""
        self._jobs.pop(name, None)
        self._guards.pop(name, None)
        self._guarding.discard(name)
        self._directives.pop(name, None)
        self._paused_services.discard(name)
        self._running_names = tuple(n for n in self._running_names if n != name)

    def _unreadable(self, path: Path, what: str) -> None:
        """``what`` of the state file ``path`` was not read, and why: said in the log and as
        a ``colo.state_unreadable`` event (as the critical-XID state's is: evictions and
        guards are forgotten), the file kept aside for the operator."""
        kept, aside = _kept(path)
        message = f"{what}; {kept}"
        log.error("%s", message)
        self._events.emit("colo.state_unreadable", message, path=str(path), kept=str(aside or ""))

    def _load_job(self, name: str, saved: dict[str, Any]) -> None:
        """One job's saved state; a value out of its range (a NaN, a negative rate, a
        footprint over the whole device) raises ValueError naming it."""
        key = _key(name)  # as the errors name it
        if not isinstance(saved, dict):
            raise ValueError(f"jobs.{key}: an object expected, not {_value(saved)}")
        st = self._jobs.setdefault(name, _JobState())
        # it ran before the restart (``idle_s`` ago, one that was not running then): kept
        # as long as a job that ran then
        idle = _saved_number(saved.get("idle_s") or 0.0, f"jobs.{key}.idle_s", 0.0)
        st.seen = self._clock() - idle
        # absent from files written before it was kept: taken as the kind it runs as
        if (kind := saved.get("kind")) is not None:
            if kind not in ("training", "inference"):
                raise ValueError(f"jobs.{key}.kind: training or inference, not {_value(kind)}")
            st.kind = kind
        if saved.get("registered_at") is not None:  # absent likewise: taken as the same
            where = f"jobs.{key}.registered_at"
            st.registered_at = _saved_number(saved["registered_at"], where, 0.0)
        if saved.get("alone_rate") is not None:
            st.alone_rate = _saved_number(saved["alone_rate"], f"jobs.{key}.alone_rate", 0.0)
        if (config := saved.get("alone_config")) is not None:
            st.alone_config = _saved_config(config, f"jobs.{key}.alone_config")
        rates = saved.get("alone_rates") or {}
        if not isinstance(rates, dict):
            raise ValueError(f"jobs.{key}.alone_rates: share -> rate expected, not {_value(rates)}")
        for share, rate in rates.items():
            where = f"jobs.{key}.alone_rates.{_key(share)}"
            try:
                x = float(share)
            except ValueError:
                raise ValueError(f"{where}: an MPS share expected") from None
            st.alone_rates[_saved_number(x, where, 0.01, 1.0)] = _saved_number(rate, where, 0.0)
        # footprints per device; a file from before kept one per job: it serves every
        # device until the job shows its own there
        devices = saved.get("devices") or {}
        if not isinstance(devices, dict) or not all(isinstance(f, dict) for f in devices.values()):
            raise ValueError(
                f"jobs.{key}.devices: device -> footprint expected, not {_value(devices)}"
            )
        devices = dict(devices)
        if saved.get("sm") is not None:
            devices[""] = saved
        # a file from before shares were kept: its footprints were learned at the share
        # the job ran at alone, which its rate alone names ("30%") where it ran on one GPU
        shown = _share_of(st.alone_config or "")
        for place, f in devices.items():
            # a file from before kept the job's footprint at its top level
            where = f"jobs.{key}.devices.{_key(place)}" if place else f"jobs.{key}"
            share = _saved_number(f.get("share", shown), f"{where}.share", 0.01, 1.0)
            # a saved footprint is taken as settled: a restart does not let its next
            # reading replace it (the readings it averages are not kept)
            ds = st.devices[str(place)] = _DeviceState(
                features=_saved_features(f, where), share=share, n=MAX_READINGS
            )
            if (whole := f.get("whole")) is not None:
                if not isinstance(whole, dict):
                    raise ValueError(f"{where}.whole: a footprint expected, not {_value(whole)}")
                ds.whole, ds.whole_n = _saved_features(whole, f"{where}.whole"), MAX_READINGS
            elif share >= 1.0:
                # a file from before the whole GPU's footprint was kept apart
                ds.whole, ds.whole_n = ds.features, MAX_READINGS
        if saved.get("duty") is not None:
            duty = _saved_number(saved["duty"], f"jobs.{key}.duty", 0.0, 1.0)
            self._directives[name] = Directive(duty, False, "as before the restart")
        if (why := saved.get("evict")) is not None:
            if not isinstance(why, str):
                raise ValueError(
                    f"jobs.{key}.evict: the eviction's reason expected, not {_value(why)}"
                )
            self._directives[name] = Directive(0.0, True, why)
        if saved.get("guard_duty") is not None and saved.get("slo_s"):
            slo_s = _saved_number(saved["slo_s"], f"jobs.{key}.slo_s", 1e-6)
            g = ServiceGuard(name, slo_s, self._guard_params)
            g.duty = _saved_number(saved["guard_duty"], f"jobs.{key}.guard_duty", 0.0, 1.0)
            # absent from files written before they were kept: no breach counted, the
            # latencies from the restart on see the duty, and the company taken as the same
            breaches = saved.get("guard_breaches") or 0
            if isinstance(breaches, bool) or not isinstance(breaches, int) or breaches < 0:
                raise ValueError(
                    f"jobs.{key}.guard_breaches: a count expected, not {_value(breaches)}"
                )
            g.breaches_at_floor = breaches
            wait = saved.get("guard_wait_s") or 0.0
            wait = _saved_number(wait, f"jobs.{key}.guard_wait_s", 0.0, DIRECTIVE_DELAY_S)
            st.guard_since = self._clock() + wait if wait else float("-inf")
            if (company := saved.get("guard_company")) is not None:
                st.guard_company = _saved_company(company, f"jobs.{key}.guard_company")
            paused = saved.get("guard_paused", False)
            if not isinstance(paused, bool):
                raise ValueError(f"jobs.{key}.guard_paused: true or false, not {_value(paused)}")
            if paused:
                self._paused_services.add(name)
            self._guards[name] = g

    def _state(self, running: Iterable[str]) -> tuple[int, dict[str, Any]] | None:
        """What the loop learned, as :meth:`_save` writes it: the ``running`` jobs' alone rates,
        footprints and duties, and the interference predictor (``to_dict``), after how many
        states were built before it; None without a state file. Under the lock."""
        if self._state_file is None:
            return None
        self._states += 1
        jobs: dict[str, dict[str, Any]] = {}
        now = self._clock()
        for name in running:
            st = self._jobs.get(name)
            g = self._guards.get(name)
            d = self._directives.get(name)
            job = jobs.setdefault(
                name,
                {
                    **_learned(st or _JobState()),
                    "duty": d.duty if d is not None and not d.evict else None,
                    # an eviction stands until the job has left, across a restart too
                    "evict": d.reason if d is not None and d.evict else None,
                    "guard_duty": g.duty if g is not None else None,
                    "slo_s": g.slo_s if g is not None else None,
                },
            )
            if g is not None and st is not None:
                # what the guard's next decision rests on: a breach at the floor counted
                # towards an eviction, the time its last duty reaches the training (a
                # wait, since the loop's clock starts anew with the host), and the company
                # its duty was set in
                job["guard_breaches"] = g.breaches_at_floor
                job["guard_wait_s"] = min(DIRECTIVE_DELAY_S, max(0.0, st.guard_since - now))
                if name in self._paused_services:
                    # paused by its GPUs' fault: should they answer before the restart's
                    # first tick, latencies reported until then are the fault's doing
                    job["guard_paused"] = True
                if st.guard_company is not None:
                    job["guard_company"] = sorted([p, j] for p, j in st.guard_company)
        # jobs not running now: what they showed (advice plans their next run with it),
        # and how long ago they last ran, so that a restart forgets them when it would have
        for name, st in sorted(self._jobs.items()):
            if name not in jobs and st.kind is not None:
                jobs[name] = {**_learned(st), "idle_s": max(0.0, now - st.seen)}
        # jobs it evicted that have not run again since: a run of one has a GPU held for it
        evicted = sorted(n for n, st in self._jobs.items() if st.evicted)
        state: dict[str, Any] = {
            "version": STATE_FILE_VERSION,
            "jobs": jobs,
            "evicted": evicted,
            "predictor": self.predictor.to_dict(),
        }
        # the waiting runs taken out, and the jobs removed under a waiting run, that a run
        # stopped meanwhile is told of when it asks again after a restart: on the loop's
        # clock, read as written on the same boot alone (Unix times for the operator, and
        # where the boot is not known)
        if (self._left or self._removed) and self._boot is not None:
            state["boot_id"] = self._boot
        # the loop's clock is null where the boot is not known: it counts from a boot
        # that no reader could tell is its own
        clocked = self._boot is not None
        if self._left:
            state["left"] = {
                i: [o.job, o.wall, o.anonymous, o.at if clocked else None]
                for i, o in self._left.items()
            }
        if self._removed:
            state["removed"] = {
                j: [r.wall, r.forced, r.at if clocked else None] for j, r in self._removed.items()
            }
        return self._states, state

    def save_at_stop(self, wait_s: float = LEAVE_WRITE_S) -> None:
        """gpud stops (SIGTERM, ``systemctl stop gpud``), its loop and the API's changing
        calls done: write :meth:`_state` once more, as the tick does (``colo.json``
        replaced by a flushed temporary file), predictor clock and ended jobs' ``idle_s``
        included, so that the next start takes up what this one held rather than the last
        tick's write (a write since refused by a full disk, a guard's duty lifted by a
        reload, the predictor's clock written once a minute). With the loop off, only a
        switch-off the file does not hold yet is written (its ticks' writes refused, or no tick
        since the reload that made it); nothing is without a state file, nor when the file
        holds this state already.
        Built under the loop's lock: a tick still running (one the stop gave up waiting
        for) is waited for, and the newer of the two states is what the file keeps, clock
        and all. Waits up to ``wait_s`` in all for the lock and for the file to hold the
        state, written on a daemon thread of its own (or by a write under way when it
        came); a lock held past it, or a write that fails (whatever it raised) or does not
        end (a disk that stopped answering, left to the exit), is logged naming the file
        and why, and the stop goes on."""
        deadline = time.monotonic() + wait_s
        if not self._lock.acquire(timeout=wait_s):
            why = f"a co-location tick or call held its lock for {wait_s:.1f} s"
        else:
            try:
                if not self.config.enabled and (
                    not self._off_state or self._holds(self._off_state)
                ):
                    return
                state = self._state(self._running_names)
                if state is None:
                    return
                # this state and any newer (a tick given up, still running) written whole
                self._whole_from = state[0]
            finally:
                self._lock.release()
            began = threading.Event()
            writer = threading.Thread(
                target=self._save_at_stop,
                args=(state, began),
                name="colo-stop-save",
                daemon=True,
            )
            writer.start()
            why = self._wait_written(
                state[0],
                max(0.0, deadline - time.monotonic()),
                said_s=wait_s,
                writer=(writer, began),
            )
            if why:  # a failed write: its own line, traceback and all, comes first
                writer.join(max(0.0, deadline - time.monotonic()))
        if why:
            log.warning(
                "co-location state %s not written at the stop (%s): the next start reads"
                " what it held before",
                self._state_file,
                why,
            )

    def _save_at_stop(self, state: tuple[int, dict[str, Any]], began: threading.Event) -> None:
        """:meth:`_save` on the stop's own thread (``began`` set once it writes): a write
        that raises what a failed write does not (OSError, ValueError) is logged naming
        the file, as a failed one is, and the stop, told it is done, says it failed and
        why."""
        try:
            self._save(state, began)
        except Exception as err:
            log.warning(
                "co-location state %s not written: %s: %s",
                self._state_file,
                type(err).__name__,
                err,
                exc_info=True,
            )

    def _save(
        self, state: tuple[int, dict[str, Any]] | None, began: threading.Event | None = None
    ) -> None:
        """Write :meth:`_state` when it changed, to a temporary file, flushed and renamed
        over the old one: a crash of gpud or of the host leaves one or the other. The
        predictor's clock alone moving on (and ended jobs' ``idle_s``) is written once every
        ``CLOCK_WRITE_S`` (an idle node would write every tick): a restart takes it up from the last write, as if
        gpud had been down since. A state older than one written already is not written:
        the newer one holds what it knew and more (a job removed since is gone from it).

        It does not wait for a write in progress (a removal's hook runs under the jobs
        service's placement lock): it leaves ``state`` to the writer, which writes the
        newest state left to it straight after its own, and returns. The stop's state
        (:meth:`save_at_stop`), and any newer, is written whole: its predictor's clock
        however little it moved. A write that raises what a failed write does not (not
        OSError nor ValueError) is raised to the caller once the states left to this
        writer meanwhile are written, as a failed write leaves them written too.
        ``began``: set once this caller holds the write (not once it left ``state`` to
        another writer)."""
        if state is None or self._state_file is None:
            return
        with self._pending_lock:
            if self._pending is None or state[0] > self._pending[0]:
                self._pending = state
        raised: Exception | None = None
        while True:
            with self._pending_lock:
                if self._pending is None:
                    break
            # Held: its holder looks for a pending state again once it lets go of the
            # lock, so one left now is written then.
            if not self._save_lock.acquire(blocking=False):
                break
            if began is not None:
                began.set()
            try:
                with self._pending_lock:
                    pending, self._pending = self._pending, None
                if pending is not None and pending[0] > self._tried_state:
                    whole = pending[0] >= self._whole_from
                    written = False
                    try:
                        written = self._write_newest(self._state_file, pending[1], whole=whole)
                    except Exception as err:
                        # not one _write_newest knows (its writer's own fault): a leave or
                        # stop waiting for this state says the write failed and why, and
                        # a newer state left to this writer meanwhile (the stop's, a
                        # leave's) is still written, its caller told when that is done
                        self._save_error = f"{type(err).__name__}: {err}"
                        raised = err
                    finally:
                        with self._written:
                            self._tried_state = pending[0]
                            if written:
                                self._on_disk_state = pending[0]
                            self._written.notify_all()
            finally:
                self._save_lock.release()
        if raised is not None:
            raise raised

    def _wait_written(
        self,
        state: int,
        wait_s: float | None = None,
        *,
        said_s: float | None = None,
        writer: tuple[threading.Thread, threading.Event] | None = None,
    ) -> str:
        """Wait (up to ``wait_s``, default ``leave_write_s``) until the state file holds
        ``state`` or a newer one, written by this thread or by the one that held the write
        when it came: "" once it does, else why not (naming ``said_s``, the caller's whole
        wait, where given, else ``wait_s``). ``writer``: the stop's own write thread and
        the event it sets once it holds the write: the stop's write still runs once it
        does, had not begun while the thread has not come to it (not yet run: the stop's
        budget spent), else another writer holds it. Never under the loop's lock."""
        wait_s = self._leave_write_s if wait_s is None else wait_s
        with self._written:
            if not self._written.wait_for(lambda: self._tried_state >= state, wait_s):
                said = wait_s if said_s is None else said_s
                return f"{self._who_writes(writer)} after {said:.1f} s"
            return "" if self._on_disk_state >= state else self._save_error

    @staticmethod
    def _who_writes(writer: tuple[threading.Thread, threading.Event] | None) -> str:
        """What holds up the file's write, by :meth:`_wait_written`'s ``writer``."""
        if writer is not None:
            thread, began = writer
            if began.is_set():
                return "the stop's write of it still runs"
            # the stop's thread hands its state to a write under way and ends at once:
            # still running, it has not come to its write yet
            if thread.is_alive():
                return "the stop's write of it had not begun"
        return "another write of it still runs"

    def _holds(self, state: int) -> bool:
        """Whether the state file holds ``state`` or a newer one (a write of it done)."""
        with self._written:
            return self._on_disk_state >= state

    def _write_newest(self, path: Path, data: dict[str, Any], *, whole: bool = False) -> bool:
        """:meth:`_save` of a state newer than any written (``whole``: its clock written
        however little it moved). Under the save lock. False: the file does not hold it
        (the write failed, said in the log)."""
        unclocked, clock, idle = _unclocked(data)
        if unclocked == self._saved and not self._clock_moved(clock, idle, whole=whole):
            return True
        try:
            self._write(path, json.dumps(data, allow_nan=False))
            self._saved, self._saved_clock, self._saved_idle = unclocked, clock, idle
            self._save_error = ""
            return True
        except (OSError, ValueError) as err:
            # tried again each tick: said once, not every few seconds of a full disk
            if str(err) != self._save_error:
                log.warning("co-location state %s not written: %s", path, err)
            self._save_error = str(err)
            return False

    def _clock_moved(self, clock: float, idle: Mapping[str, float], *, whole: bool) -> bool:
        """Whether the file is written for the predictor's clock and ended jobs' ``idle_s``
        alone: once either moved :data:`CLOCK_WRITE_S` on since it was written, and the
        stop's (``whole``) for the clock however little it moved. ``idle_s`` keeps to a
        minute even then: a restart remembers an ended job at most that much longer, and a
        start that stops again at once (one crash-looping) does not rewrite the file."""
        if whole and clock != self._saved_clock:
            return True
        return clock - self._saved_clock >= CLOCK_WRITE_S or any(
            abs(t - self._saved_idle.get(name, t)) >= CLOCK_WRITE_S for name, t in idle.items()
        )

    def _learn(self, snapshot: Snapshot, per_gpu: dict[int, list[RunningJob]]) -> None:
        """Alone: the device's activity (SMs, memory controller, PCIe and NVLink throughput
        over the links' capacity) is the job's footprint, and its rate its alone rate.
        Together: its rate over its alone rate is a sample of slowdown for the predictor.
        A training job's rate is per second of running time, so the guard's throttling is
        not taken for interference; an inference service's is its M/M/1 service rate
        (:meth:`service_rate`), measured at the duty its neighbours were last set to.

        A job on several devices has a footprint on each, learned while it is alone on all
        of them (else its pace is another device's). Its rate is one, the pace of its
        slowest device: it teaches the predictor only while it shares just one of its
        devices, with its footprint and company there; shared on several, its observed
        speed shows but which device cost what is not known."""
        now = self._clock()
        self._observed = {}
        host = self._host.sample(
            {
                f"{r.name}\0{_place(r)}": r.pids
                for members in per_gpu.values()
                for r in members
                if r.pids
            }
        )
        # every GPU's NVLink counters, each tick: their growth since the last is the rate
        nvlink = {g.identity.index: self._nvlink.ratio(g) for g in snapshot.gpus if g.healthy}
        # job -> its devices: (the job there, who shares that device, the GPU's reading,
        # whether the job is all the GPU runs)
        placed: dict[str, list[tuple[RunningJob, list[RunningJob], GpuSample | None, bool]]] = {}
        for gpu, members in per_gpu.items():
            sample = snapshot.gpu(gpu)
            total = sample.memory.total_bytes if sample is not None and sample.memory else 0
            for r in members:
                st = self._jobs.setdefault(r.name, _JobState())
                use = host.get(f"{r.name}\0{_place(r)}")
                held = r.memory_used if r.memory_used is not None else r.memory_bytes or 0
                st.devices.setdefault(_place(r), _DeviceState()).side = JobFeatures(
                    sm=0.0,
                    mem_bw=0.0,
                    mem_frac=min(1.0, held / total) if total else 0.0,
                    host_cpu=use.cpu if use is not None else 0.0,
                    rss_frac=use.rss if use is not None else 0.0,
                )
                company = [o for o in members if o.name != r.name and _shares_device(o, r)]
                placed.setdefault(r.name, []).append((r, company, sample, len(members) == 1))
        for name, where in placed.items():
            st = self._jobs[name]
            kind = where[0][0].kind
            if st.kind not in (None, kind):
                # the name runs another workload now (the job was registered again as
                # the other kind): what it showed as the first says nothing of it
                st.unlearn()
            st.kind = kind
            together = (
                frozenset((_place(r), o.name) for r, others, _, _ in where for o in others)
                | frozenset((_place(r), "") for r, _, _, _ in where)
                | {("", _config([r for r, *_ in where]))}
            )
            if together != st.company:
                # a new company (or another set of devices, or another share): measure
                # afresh, once it settled
                st.company, st.since = together, now + SETTLE_S
                continue
            if kind == "training":
                rate = self._rate(st, now)
            else:
                rate = self.service_rate(name, since=max(st.since, self._judged_since(st)))
            shared = [(r, others) for r, others, _, _ in where if others]
            if not shared:
                for r, _, sample, only in where:
                    u = sample.utilization if sample is not None else None
                    if not only:
                        st.unseen_since = None  # not alone: a minute alone is counted anew
                    if sample is None or u is None or r.mig_profile is not None or not only:
                        continue
                    if not (r.pids or r.memory_used):
                        # its reservation held with nothing of it there (it exited, has not
                        # started, or NVML attributes none of its processes to it): the
                        # device's readings are not what it does
                        self._unseen(st, r, now)
                        continue
                    st.unseen_since = None
                    if kind == "training" and st.reporting and not _working(st, now):
                        # training that reports its progress and made none of late (a
                        # checkpoint), or whose company just changed: the device's
                        # readings are not what it does either
                        continue
                    here = st.devices[_place(r)]
                    if self._learn_alone(here, r, sample, u, nvlink.get(r.gpu), now=now):
                        st.devices.pop("", None)  # measured here: what an older file held goes
                if rate is not None:
                    st.alone_rate, st.alone_config = rate, _config([r for r, *_ in where])
                    (r0, *_), *more = where
                    if kind == "training" and not more and r0.mig_profile is None:
                        st.alone_rates[(r0.threads_percent or 100) / 100.0] = rate
                continue
            st.unseen_since = None  # sharing its device: a minute alone is counted anew
            if rate is None or not st.alone_rate:
                continue
            if st.alone_config not in (None, _config([r for r, *_ in where])):
                # its rate alone was at another share, or in another instance: its ratio
                # to today's rate is not the slowdown its company causes
                continue
            speed = min(1.0, rate / st.alone_rate)
            self._observed[name] = speed
            if len(shared) == 1:
                r, others = shared[0]
                footprints = [self._view(o).footprint() for o in others]
                self.predictor.observe(self._view(r).footprint(), footprints, speed)

    def _unseen(self, st: _JobState, r: RunningJob, now: float) -> None:
        """``r`` alone with none of its processes seen on its device this tick: said once
        a run, when that lasted ``UNSEEN_SAY_S`` (NVML attributes them nothing: the job
        learns no footprint, and nothing else says so)."""
        if st.unseen_since is None:
            st.unseen_since = now
        if not st.unseen_said and now - st.unseen_since >= UNSEEN_SAY_S:
            st.unseen_said = True
            log.info(
                "job %s alone on GPU %d for %.0f s with none of its processes seen: "
                "no footprint learned",
                r.name,
                r.gpu,
                UNSEEN_SAY_S,
            )

    def _learn_alone(
        self,
        ds: _DeviceState,
        r: RunningJob,
        sample: GpuSample,
        u: Utilization,
        nvlink: float | None,
        *,
        now: float,
    ) -> bool:
        """Move ``ds``'s footprints towards this tick's readings of ``r`` alone there
        (:meth:`_DeviceState.learn`); whether it learned any."""
        share = (r.threads_percent or 100) / 100.0
        before = ds.features if ds.share == share else None
        reading = self._alone_features(
            r, sample, sm=u.gpu_ratio, mem_bw=u.memory_ratio, nvlink=nvlink, before=before
        )
        if reading is None or reading is before:  # nothing learned this tick
            return False
        ds.learn(reading, share, now, self.config.tick_s)
        return True

    def _alone_features(
        self,
        r: RunningJob,
        sample: GpuSample,
        *,
        sm: float,
        mem_bw: float,
        nvlink: float | None,
        before: JobFeatures | None,
    ) -> JobFeatures | None:
        """A job's footprint from its GPU's readings while it runs there alone, at full
        speed: the readings over :meth:`colocate.JobView.activity` -- a training job's over
        its duty (the guard's throttle), an inference service's over its utilization at the
        load it had (it then shows in the plan, scaled to its load of each moment, what it
        showed at this one). A service serving under ``MIN_SERVICE_ACTIVITY`` of its rate
        teaches nothing (its readings would be mostly noise): what was measured before
        stays. NVLink keeps what was measured before until its counters have grown over
        one interval."""
        if r.kind == "training":
            scale = max(0.01, self.duty(r.name))
        else:
            scale = self._view(r).activity()
            if scale < MIN_SERVICE_ACTIVITY:
                return before
        pcie = pcie_ratio(sample.pcie, pcie_capacity(sample.identity))
        if nvlink is None:
            nvlink = before.nvlink * scale if before is not None else 0.0
        return JobFeatures(
            sm=min(1.0, sm / scale),
            mem_bw=min(1.0, mem_bw / scale),
            pcie=min(1.0, pcie / scale),
            nvlink=min(1.0, nvlink / scale),
        )

    def _features(self, r: RunningJob) -> JobFeatures:
        """Its footprint alone on that device (or the prior), with its memory and host use
        there now."""
        st = self._jobs.get(r.name)
        if st is None:
            return PRIOR
        base = st.learned(_place(r)) or PRIOR
        here = st.devices.get(_place(r))
        side = here.side if here is not None else None
        if side is None:
            return base
        return dataclasses.replace(
            base, mem_frac=side.mem_frac, host_cpu=side.host_cpu, rss_frac=side.rss_frac
        )

    def _hold_paused_guards(
        self, running: Sequence[RunningJob], live: Sequence[RunningJob], now: float
    ) -> None:
        """A service whose GPUs are all faulty: what it reports while they are is the
        fault's doing, not the training's, so once they answer its guard acts only on
        latencies reported after that (and a directive's delay), not on those the window
        still holds from the fault. Under the lock."""
        answering = {r.name for r in live}
        paused = {r.name for r in running if r.kind == "inference" and r.name not in answering}
        for name in (self._paused_services - paused) & answering:
            st = self._jobs.setdefault(name, _JobState())
            st.guard_since = max(st.guard_since, now + DIRECTIVE_DELAY_S)
        self._paused_services = paused

    def _judged_since(self, st: _JobState) -> float:
        """Reports after this are what a service's guard acts on: those since its duty last
        reached the training (or its GPUs answered again) and since the loop was last
        switched on, whichever is later. Under the lock."""
        return max(st.guard_since, self._on_since)

    def _ensure_guards(self, running: Sequence[RunningJob]) -> None:
        """A guard for each inference service in ``running``, on a faulty GPU too (one
        whose GPUs hung before gpud started too, that `gpuctl colo show` lists), holding
        the SLO the service runs with now; once a tick, before anything reads them."""
        for name, where in _services(running).items():
            slo_s = (where[0].slo_p99_ms or 0.0) / 1e3
            g = self._guards.get(name)
            if g is None:
                self._guards[name] = ServiceGuard(name, slo_s, self._guard_params)
            elif g.slo_s != slo_s:
                # registered again with another SLO (or restored from a file that held the
                # one before): the guard holds the one the service runs with now
                g.slo_s = slo_s
                g.breaches_at_floor = 0

    def _count_attainment(self, running: Sequence[RunningJob]) -> dict[str, float | None]:
        """One window of SLO attainment per inference service that reported latencies,
        once a tick: on a faulty GPU too, where its guard is paused, since the latencies
        come from the service and not from the GPU, and a service that misses its SLO
        while its GPU hangs has missed it. Its p99 by name."""
        p99s: dict[str, float | None] = {}
        for name, where in _services(running).items():
            p99 = p99s[name] = self.p99(name)
            if p99 is not None:
                st = self._jobs.setdefault(name, _JobState())
                st.windows += 1
                st.windows_ok += int(p99 <= (where[0].slo_p99_ms or 0.0) / 1e3)
        return p99s

    def _guard_step(
        self,
        running: Sequence[RunningJob],
        per_gpu: dict[int, list[RunningJob]],
        uuids: Mapping[int, str],
        p99s: Mapping[str, float | None],
    ) -> tuple[dict[int, float], dict[int, str]]:
        """Each inference job's guard, once a tick (a service on several devices too),
        over the GPUs where training shares one of its devices. ``uuids``: each GPU's UUID
        by index, for the events; ``p99s``: each service's p99 this tick, by
        :meth:`_count_attainment`; each service's guard, made this tick by
        :meth:`_ensure_guards`."""
        duty: dict[int, float] = {}
        evict: dict[int, str] = {}
        guarding, self._guarding = self._guarding, set()
        for name, where in _services(running).items():
            g = self._guards[name]
            p99 = p99s.get(name)
            st = self._jobs.setdefault(name, _JobState())
            gpus = sorted(
                {
                    r.gpu
                    for r in where
                    if any(
                        o.kind == "training" and _shares_device(o, r)
                        for o in per_gpu.get(r.gpu, [])
                    )
                }
            )
            if not gpus:
                g.reset()
                st.guard_since = float("-inf")
                continue
            company = frozenset(
                (_place(r), o.name)
                for r in where
                for o in per_gpu.get(r.gpu, [])
                if o.kind == "training" and _shares_device(o, r)
            )
            if name not in guarding:
                self._resume_guard(name, g, st, company, gpus[0], uuid=uuids.get(gpus[0], ""))
            st.guard_company = company
            self._guarding.add(name)
            # Act on latencies measured at the duty last set, not on the ones the window
            # still holds from before it: else each tick would cut again for the same spike.
            fresh = self.p99(name, since=self._judged_since(st), min_samples=MIN_FRESH_SAMPLES)
            if fresh is None and p99 is not None:
                # still measuring at the new duty: the last decision holds
                for gpu in gpus:
                    duty[gpu] = min(duty.get(gpu, 1.0), g.duty)
                continue
            before = g.duty
            d = g.tick(fresh)
            if g.duty != before:
                st.guard_since = self._clock() + DIRECTIVE_DELAY_S
            if d.action is GuardAction.EVICT:
                for gpu in gpus:
                    evict[gpu] = d.reason
                    self._events.emit(
                        "colo.evict", d.reason, job=name, gpu=gpu, uuid=uuids.get(gpu, "")
                    )
                continue
            for gpu in gpus:
                duty[gpu] = min(duty.get(gpu, 1.0), d.duty)
            if d.action is GuardAction.THROTTLE and before != d.duty:
                self._events.emit(
                    "colo.throttle",
                    d.reason,
                    job=name,
                    gpu=gpus[0],
                    uuid=uuids.get(gpus[0], ""),
                )
        return duty, evict

    def _resume_guard(
        self,
        name: str,
        g: ServiceGuard,
        st: _JobState,
        company: frozenset[tuple[str, str]],
        gpu: int,
        *,
        uuid: str,
    ) -> None:
        """A guard takes up its duty again (gpud restarted, the service runs again within
        the hour, its GPU answers again). The duty holds beside the training it was learned
        beside, on the same devices, at once. Beside other training, or elsewhere, it is no
        evidence (a duty that sufficed beside a light job is too high beside a heavy one,
        and one a heavy job needed idles a light one): the guard starts afresh at
        ``peak_duty``, where the planner holds the service's declared peak beside any
        training it places there, and gives duty back as p99 shows room."""
        if st.guard_company is None or st.guard_company == company:
            return
        start = self._planner.params.peak_duty
        if g.duty == start and not g.breaches_at_floor:
            return
        was = ", ".join(f"{job} on {place}" for place, job in sorted(st.guard_company))
        now = ", ".join(f"{job} on {place}" for place, job in sorted(company))
        self._events.emit(
            "colo.guard",
            f"job {name}: its guard starts afresh at duty {start:.2f} (colocate.peak_duty), "
            f"not {g.duty:.2f}: that duty was set beside {was or 'no training'}, the "
            f"training beside it now is {now}",
            job=name,
            gpu=gpu,
            uuid=uuid,
        )
        g.start_at(start)
        st.guard_since = self._clock() + DIRECTIVE_DELAY_S

    def _view(
        self, r: RunningJob, names: Mapping[int, str] | None = None, profile: str | None = None
    ) -> JobView:
        """The planner's view of a running job; ``names``: its user's name, where the
        plan gives reasons (:meth:`_user_names`); ``profile``: set for a place promised to
        a run of that job, which does not run there yet: it is planned as a new run of it
        is asked for (:meth:`_JobState.alone`), under its own name (another run of the
        asker's job is planned under another name)."""
        own = r.name if profile is None else profile
        kind = JobKind.INFERENCE if r.kind == "inference" else JobKind.TRAINING
        memory = r.memory_bytes or r.memory_used or 0
        load = self.load(r.name) if kind is JobKind.INFERENCE else 0.0
        st = self._jobs.get(own, _JobState())
        if profile is None:
            # running: its footprint at the share it runs at, whose SM activity is its knee
            # there (at a partial share: all the share let it use)
            features = self._features(r)
            knee = features.sm if st.learned(_place(r)) is not None else None
        else:
            alone = st.alone(r.kind)
            features, knee = alone or PRIOR, alone.sm if alone is not None else None
        shape = Shape.prior(
            r.name,
            kind,
            memory_bytes=memory,
            slo_s=r.slo_p99_ms / 1e3 if r.slo_p99_ms else None,
            knee=knee,
            # what it declared, or serves now if more: it holds that alone (the guard
            # watches that it does)
            peak_load=max(r.peak_load, load),
        )
        if r.memory_used is not None:
            shape.observe_memory(r.memory_used)
        if profile is None:  # running: what it took this run it may take again
            run, peak = st.memory_peaks.get(_place(r), (r.reserved_at, 0))
            shape.observe_memory(peak if run == r.reserved_at else 0)
        self._observe_rates(shape, own)
        return JobView(
            job_id=r.name,
            shape=shape,
            features=features,
            gpu=r.gpu,
            sm_share=(r.threads_percent or 100) / 100.0,
            mig_profile=r.mig_profile,
            memory_used=r.memory_used,
            load=load,
            peak_load=max(r.peak_load, load),
            duty=self._directives.get(r.name, Directive(1.0, False, "")).duty,
            device=r.device,
            order=self._arrived(r.name),
            user=r.uid,
            user_name=(names or {}).get(r.uid, "") if r.uid is not None else "",
        )

    def _observe_rates(self, shape: Shape, job: str) -> None:
        """A training ``job``'s rates alone at two shares or more show ``shape`` how it
        slows with fewer SMs."""
        st = self._jobs.get(job)
        rates = st.alone_rates if st is not None and st.kind in (None, shape.kind.value) else {}
        if shape.kind is JobKind.TRAINING and len(rates) >= 2:
            for share, rate in sorted(rates.items()):
                shape.observe(share, rate)

    def _user_names(
        self, running: Sequence[RunningJob], uid: int | None, now: float
    ) -> dict[int, str]:
        """The names of the users a question's plan may name (``uid``'s, and those of the
        jobs on a whole GPU's MPS server): looked up before the loop's lock is taken, as a
        user database behind the network (LDAP) may take its time to answer, and each
        kept :data:`NAME_TTL_S` (an unknown UID costs a scan of the user database)."""
        uids = {r.uid for r in running if r.mig_profile is None} | {uid}
        names: dict[int, str] = {}
        for u in sorted(x for x in uids if x is not None):
            kept = self._names.get(u)
            if kept is None or now - kept[1] >= NAME_TTL_S:
                kept = self._names[u] = (self._name_of(u), now)
            names[u] = kept[0]
        return names

    def _arrived(self, name: str) -> float:
        st = self._jobs.get(name)
        return float(st.rank) if st is not None and st.arrived is not None else 0.0

    def _gpu_views(
        self, snapshot: Snapshot, running: Sequence[RunningJob]
    ) -> tuple[list[GpuView], dict[tuple[int, str], str]]:
        """The healthy GPUs, each with its MIG instances (one per profile) and the free ones
        it could give a job (one per profile), and where each such option is: (GPU,
        profile) -> MIG device UUID. A GPU in MIG mode offers its instances alone: no job
        has a share of the whole GPU."""
        taken = {r.device for r in running}
        strangers = self._strangers()
        views: list[GpuView] = []
        where: dict[tuple[int, str], str] = {}
        for g in snapshot.gpus:
            if not g.healthy or g.memory is None:
                continue
            index = g.identity.index
            mig_mode = g.mig_mode is not None and g.mig_mode.current
            options: dict[str, MigOption] = {}
            layout: dict[str, MigOption] = {}
            # per GPU instance, which its compute instances' MIG devices share (each reads
            # the instance's memory as its own): their UUIDs, its memory, NVML's use of it
            shared: dict[int, tuple[tuple[str, ...], int, int | None]] = {}
            for m in g.mig_devices:
                ident = m.identity
                devices, total, used = shared.get(ident.gpu_instance_id, ((), 0, None))
                if m.memory is not None:
                    used = max(used or 0, m.memory.used_bytes)
                shared[ident.gpu_instance_id] = (
                    (*devices, ident.uuid),
                    max(total, ident.memory_total_bytes),
                    used,
                )
                fraction = _mig_sm_fraction(ident, g.identity)
                if fraction is None:
                    continue
                instance = MigOption(ident.profile_name, fraction, ident.memory_total_bytes)
                layout.setdefault(ident.profile_name, instance)
                # Free: no job of gpud's holds it, and NVML listed its processes and saw none
                # (a process of no known job holds it as much as a job does).
                busy = ident.uuid in taken or bool(m.processes) or not m.processes_read
                if busy or ident.profile_name in options:
                    continue
                options[ident.profile_name] = instance
                where[(index, ident.profile_name)] = ident.uuid
            foreign = None
            if strangers.get(index, 0):
                u = g.utilization
                alone = not any(r.gpu == index for r in running)
                # Alone there, NVML's utilization is theirs; beside jobs, assume the worst
                # (as for a job never seen).
                foreign = (
                    JobFeatures(sm=u.gpu_ratio, mem_bw=u.memory_ratio)
                    if alone and u is not None
                    else PRIOR
                )
            views.append(
                GpuView(
                    index,
                    g.memory.total_bytes,
                    g.memory.used_bytes,
                    tuple(options.values()),
                    foreign=foreign,
                    whole=not mig_mode,
                    mig_layout=tuple(layout.values()),
                    mig_memory=tuple(MigMemory(*x) for _, x in sorted(shared.items())),
                )
            )
        return views, where

    def _paused(self, running: Sequence[RunningJob]) -> dict[str, tuple[float, int]]:
        """Training job -> the lowest duty a guard paused on a faulty GPU holds it at (the
        guard of a service beside it there), and that GPU."""
        out: dict[str, tuple[float, int]] = {}
        for r in running:
            if r.kind != "training" or r.gpu not in self._faulty:
                continue
            for s in running:
                g = self._guards.get(s.name)
                if s.kind != "inference" or s.gpu != r.gpu or g is None:
                    continue
                if _shares_device(s, r) and g.duty < out.get(r.name, (1.0, -1))[0]:
                    out[r.name] = (g.duty, r.gpu)
        return out

    def _apply(
        self,
        plan: Plan,
        *,
        keep: set[str],
        present: set[str],
        paused: Mapping[str, tuple[float, int]] | None = None,
    ) -> None:
        """The plan's directives become the jobs'; ``keep``'s (jobs on a faulty GPU) stay
        as they were, but for one the plan directs from its other GPUs: that gets the
        plan's, at no more than the duty a guard paused on its faulty GPU holds it at
        (``paused``), so the guards of its GPUs that answer still act on it. An eviction
        stands while the job is ``present``: a job takes a while to checkpoint
        and leave, and the guard that evicted it starts afresh at once, so the next plan
        would tell it to run at full speed next to the service it was evicted for."""
        new = {d.job_id: Directive(d.duty, d.evict, d.reason) for d in plan.directives}
        for job in keep:
            told = new.get(job)
            floor, gpu = (paused or {}).get(job, (1.0, -1))
            if told is not None:
                if not told.evict and floor < told.duty:
                    new[job] = Directive(
                        floor,
                        False,
                        f"SLO guard paused on GPU {gpu} holds training at duty {floor:.2f}",
                    )
            elif job in self._directives:
                new[job] = self._directives[job]
        for job, told in self._directives.items():
            if told.evict and job in present and not (job in new and new[job].evict):
                new[job] = told
        for job, d in new.items():
            old = self._directives.get(job)
            if d.evict and (old is None or not old.evict):
                self._events.emit("colo.evict", d.reason, job=job)
                self._jobs.setdefault(job, _JobState()).evicted = True
            elif old is not None and abs(old.duty - d.duty) > 1e-9:
                self._events.emit(
                    "colo.duty",
                    f"job {job} duty {old.duty:.2f} -> {d.duty:.2f}: {d.reason}",
                    job=job,
                )
        self._directives = new

    # -- questions ----------------------------------------------------------------------------
    def advise(
        self,
        job: str,
        *,
        kind: str = "training",
        memory_bytes: int | None = None,
        slo_p99_ms: float | None = None,
        sm_activity: float | None = None,
        peak_load: float = 0.0,
        snapshot: Snapshot | None = None,
        waiting: bool = False,
        waited_s: float = 0.0,
        waiter_id: str | None = None,
        uid: int | None = None,
        reserving: bool = False,
    ) -> Advice:
        """Where a new job should go now: a whole GPU's MPS share, or a free MIG instance
        (for an inference job with a tight SLO, or on a GPU in MIG mode); nothing is
        reserved. ``waiting``: the asker waits
        for a GPU (``gpuctl run``): a job told to wait is listed by :meth:`show` while it
        keeps asking. ``waited_s``: how long it has waited already, as the asker counts: a
        waiter this loop does not know (gpud restarted) takes its place by it.
        ``waiter_id``: the id it was told (:attr:`Advice.waiter_id`) before, kept through a
        gpud restart as the queue's ids are. gpuctl makes one up for its first waiting
        question: a run with an id of its own waits beside the runs of its job that wait
        already, as a second queue entry does. None (a gpuctl that predates the ids): the
        job's other run that asks without one, if any. ``uid``: the user the run's
        processes run as, where placement keeps users apart (MPS on): a GPU whose MPS server
        serves another user's jobs is not advised (the jobs service would refuse it), only
        a free MIG instance there; None: any GPU. ``reserving``: the asker reserves the
        place it is given at once (``gpuctl run``; a waiting asker does too): until its
        reservation shows, for :data:`PROMISE_S` at most, later advice for other runs (of
        its job too) counts it there (:meth:`_promise`)."""
        now, wall = self._clock(), self._wall()
        gone: list[_Waiter] = []
        try:
            with self._lock:
                told = _waiter_id(waiter_id) if waiting else None
                if waiting and waiter_id is None:
                    known = next(
                        (w for w in self._waiting.values() if w.job == job and w.anonymous), None
                    )
                else:
                    known = self._waiting.get(told) if told is not None else None
                if known is not None and known.job != job:
                    known = None
                # one silent too long is dropped now, as a listing would; not the asker: its
                # question may come late only because gpud answered its last one slowly
                gone = self._forget_gone(now, keep=known.id if known is not None else None)
                back = None
                if known is not None:
                    since, wid = known.since, known.id
                else:
                    since = now - waited_s if waiting else now
                    back = self._dropped.get(told) if told is not None else None
                    free = told is not None and not self._taken(told, job)
                    wid = told if told is not None and free else new_waiter_id()
                if waiting:
                    # listed again: a drop raced with its last question is no drop
                    self._dropped.pop(wid, None)
                if waiting and back is not None and wid == told:
                    # dropped for its silence: what was said of it before it was dropped,
                    # or of its job since, still holds; else, stopped (Ctrl-Z), it waits
                    # again from now, its place gone with its listing (its waited_s counts
                    # the time it was stopped); only slow to ask, it keeps its place
                    # (checked from when it first began to wait: a later start is no
                    # stricter, and with an id of its own it is not anonymous)
                    self._check_not_removed(job, wid, back.since, now)
                    since = back.since if now - back.last <= WAITER_STOPPED_S else now
                elif waiting:
                    self._check_not_removed(job, wid, since, now, anonymous=waiter_id is None)
        finally:
            self._say_gone(gone, now)
        advice, view = self._advice(
            job,
            kind=kind,
            memory_bytes=memory_bytes,
            slo_p99_ms=slo_p99_ms,
            sm_activity=sm_activity,
            peak_load=peak_load,
            snapshot=snapshot,
            since=since if waiting else None,
            now=now,
            waiter=wid if waiting else "",
            uid=uid,
            wid=wid,
        )
        with self._lock:
            if waiting:  # removed while this question was planned: no place, no listing
                self._check_not_removed(job, wid, since, now, anonymous=waiter_id is None)
            if advice.gpu >= 0 and view is not None and (waiting or reserving):
                self._promise(
                    (job, wid),
                    advice,
                    view,
                    slo_p99_ms=slo_p99_ms,
                    peak_load=peak_load,
                    uid=uid,
                    at=(now, wall),
                )
            if not waiting:  # an operator's question, or a run's first: no waiter of it
                return advice
            # listed or placed: a drop while this question was planned is no drop
            self._dropped.pop(wid, None)
            if advice.gpu < 0 and view is not None:
                self._waiting[wid] = _Waiter(
                    job, since, now, advice.reason, view, wid, waiter_id is None, uid
                )
                return dataclasses.replace(advice, waiter_id=wid)
            self._waiting.pop(wid, None)
        return advice

    def _taken(self, wid: str, job: str) -> bool:
        """Whether ``wid`` is another run's than a run of ``job``'s that asks with it: one
        that waits, or of another job, dropped or taken out (its next question is told of
        it: an id read off `gpuctl queue` does not hide that). Under the lock."""
        if wid in self._waiting:
            return True
        return any(
            d is not None and d.job != job
            for d in (self._dropped.get(wid), self._left.get(wid), self._stopped.get(wid))
        )

    def _promise(
        self,
        run: tuple[str, str],
        advice: Advice,
        view: JobView,
        *,
        slo_p99_ms: float | None,
        peak_load: float,
        uid: int | None,
        at: tuple[float, float],
    ) -> None:
        """Count the ``run`` (its job, the id it asks as) where ``advice`` put it, as
        :meth:`_advice` planned it there, until its reservation shows (``at``: the loop's
        clock and Unix time). Under the lock."""
        share = round(advice.sm_share * 100)
        self._promised[run] = _Promise(
            RunningJob(
                run[0],
                view.kind.value,
                advice.gpu,
                threads_percent=share if advice.mig_profile is None and share < 100 else None,
                memory_bytes=view.shape.memory_bytes,  # as planned
                slo_p99_ms=slo_p99_ms,
                memory_used=None,  # nothing of it runs yet: its reservation counts whole
                peak_load=peak_load,
                device=advice.device,
                mig_profile=advice.mig_profile,
                reserved_at=at[1],
                uid=uid,
            ),
            *at,
        )

    def reservation_made(self, job: str, at: float, devices: Sequence[str] = ()) -> None:
        """A reservation of ``job`` was made on ``devices`` (GPU or MIG UUIDs), stamped
        ``at`` (Unix time, as :attr:`RunningJob.reserved_at`): the jobs service tells it as
        it reserves. It stands for the place promised to a run of the job before then on
        one of ``devices``, else for the earliest, as a reservation read from ``running``
        does: a run whose command ended at once (not found, a quick exit) reserves and
        releases between two questions, and no list of reservations ever shows it, so its
        place would otherwise bar the next run, of its job too, for :data:`PROMISE_S`.

        Lock order: called once the store committed the reservation, under the jobs
        service's placement lock, it takes no lock of the loop's (which a planning pass
        holds through its event writes): it is queued, and the loop reads it under its own
        lock at its next question. So a Reserve never waits on a planning pass.

        A notice can only stand for a promise made before it (the promise is recorded
        before the advice is answered), so none is queued while none is open or the loop
        is off: with no run asking for advice (pinned runs, queue starts) the queue would
        otherwise grow by one a reservation. Notices stamped over :data:`PROMISE_S` ago
        are dropped: a promise they could stand for has lapsed."""
        # unlocked reads: a dict or config swapped whole is read whole
        if not self.config.enabled or not self._promised:
            return
        stale = self._wall() - PROMISE_S
        try:
            # only this thread (under the jobs service's placement lock) appends; a
            # question may drain the queue between the look and the pop
            while self._made and self._made[0][1] < stale:
                self._made.popleft()
        except IndexError:
            pass
        self._made.append((job, at, tuple(devices)))

    def _keep_promise_of(self, job: str, stamp: float, devices: Collection[str] = ()) -> None:
        """Have the reservation of ``job`` stamped ``stamp`` on ``devices`` stand for the
        open place promised to it before then on one of those devices, else for the
        earliest, unless it stands for one already. Under the lock."""
        if any(n == job and p.shown == stamp for (n, _), p in self._promised.items()):
            return
        open_ = [
            p
            for (n, _), p in self._promised.items()
            if n == job and p.shown is None and p.wall <= stamp
        ]
        there = [p for p in open_ if p.place.device in devices]
        if there or open_:
            min(there or open_, key=lambda p: p.wall).shown = stamp

    def _promises(
        self, job: str, wid: str, running: Sequence[RunningJob], now: float
    ) -> list[tuple[str, RunningJob]]:
        """The places advice gave runs that have not shown as reservations yet, but the
        asker's own (``job`` asking as ``wid``), each with the name it is planned under: its
        job's, but another run of ``job`` counts under its id, as the planner knows a job by
        its name. Each reservation of a job made since a place
        was promised to it stands for the earliest such place (a job that runs elsewhere
        already is given a second place); a run whose reservation was refused holds its
        place :data:`PROMISE_S` at most. Under the lock."""
        self._promised = {k: p for k, p in self._promised.items() if now - p.at <= PROMISE_S}
        # each reservation once, with all its devices: those told as made (drained here,
        # under the lock), and those listed (a job on several devices once a device)
        made: dict[tuple[str, float], set[str]] = {}
        while self._made:
            told, at, where = self._made.popleft()
            made.setdefault((told, at), set()).update(where)
        for r in running:
            if r.reserved_at is not None:
                made.setdefault((r.name, r.reserved_at), set()).add(r.device)
        for (name, stamp), devices in sorted(made.items(), key=lambda m: m[0]):
            self._keep_promise_of(name, stamp, devices)
        return [
            (name if name != job else f"{job} ({w})", p.place)
            for (name, w), p in self._promised.items()
            if p.shown is None and (name, w) != (job, wid)
        ]

    def _forget_left(self, now: float) -> None:
        """Drop the runs taken out of the wait that are kept no longer, under the lock: what
        is left is what a question or a second leave may be told of."""
        _forget_old(self._left, now, self._remember)
        _forget_old(self._stopped, now, self._remember, STOPPED_LEFT_KEEP_S)

    def _check_not_removed(
        self, job: str, wid: str, since: float, now: float, *, anonymous: bool = False
    ) -> None:
        """NotFound for a waiting asker of ``job`` when `gpuctl jobs rm` (with ``--force``
        while the run was listed, plain or forced once it was dropped for its silence)
        removed the job after it began to wait (a run that began later is another run).
        Under the lock. LeftQueue for the run waiting as ``wid`` that `gpuctl queue
        --leave`, or its own stop, took out; for an ``anonymous`` one (no id to tell), the
        job's anonymous run taken out after it began to wait."""
        # kept as long as a run dropped for its silence is (a stopped one may ask again)
        _forget_old(self._removed, now, self._remember)
        self._forget_left(now)
        removed = self._removed.get(job)
        if removed is not None and since <= removed.at:
            self._waiting.pop(wid, None)
            how = "gpuctl jobs rm --force" if removed.forced else "gpuctl jobs rm"
            raise NotFound(
                f"job {job} was removed ({how}) while its gpuctl run waited "
                "for co-location: nothing was started"
            )
        mine = self._left.get(wid) or self._stopped.get(wid)
        left = (wid, mine) if mine is not None else None
        if anonymous:
            left = next(
                (
                    (i, o)
                    for i, o in itertools.chain(self._left.items(), self._stopped.items())
                    if o.job == job and o.anonymous and since <= o.at
                ),
                None,
            )
        if left is not None and left[1].job == job:
            self._waiting.pop(wid, None)
            raise LeftQueue(
                f"job {job} left the wait for co-location ({left[0]}, gpuctl queue"
                " --leave): nothing was started"
            )

    def _waiters_of(self, job: str, now: float) -> list[_Waiter]:
        """The runs of ``job`` that wait and still ask, first come first. Under the lock."""
        mine = [w for w in self._waiting.values() if w.job == job and now - w.last <= WAITER_GONE_S]
        return sorted(mine, key=lambda w: w.since)

    def waiting_kind(self, job: str) -> str | None:
        """The kind (training, inference) of ``job`` while a ``gpuctl run`` of it waits
        for advice (it registers its job only once it reserves); None when none waits."""
        now = self._clock()
        with self._lock:
            mine = self._waiters_of(job, now)
            return mine[0].view.kind.value if mine else None

    def job_removed(self, job: str, force: bool) -> Callable[[], None]:
        """A removal hook of the jobs service (``gpuctl jobs rm``): a ``gpuctl run`` of
        ``job`` waiting for advice would otherwise go on waiting, and register the job
        again once placed. Without ``force`` that is refused, as for a queued run; with it
        the run's next question is answered NotFound, and it exits without starting, once
        the removal committed (a run dropped for its silence, stopped, is told so too when
        it asks again, the removal forced or not): it is the returned callable that stops
        the wait (a removal whose commit failed keeps the job, and its waiting runs wait
        on). Committed, a
        place advice promised a run of it (``reserving``) holds no GPU any more."""
        now = self._clock()
        with self._lock:
            mine = self._waiters_of(job, now)
            if mine and not force:
                ids = ", ".join(w.id for w in mine)
                raise FailedPrecondition(
                    f"job {job!r} has a gpuctl run waiting for co-location ({ids}, for "
                    f"{now - mine[0].since:.0f} s): Ctrl-C there, `gpuctl queue --leave ID`,"
                    f" or `gpuctl jobs rm --force {job}` stops the wait"
                )

        def committed() -> None:
            at = self._clock()
            with self._lock:
                self._promised = {k: p for k, p in self._promised.items() if k[0] != job}
                # a job added again under its name is another workload: what this one
                # showed (its footprints, rates, kind) is not planned for it, nor is it
                # told what this one was (an eviction, a duty)
                self._forget_job(job)
                self._removals += 1
                self._gone[job] = _Gone(self._wall(), at, self._removals)
                if mine:
                    for w in self._waiters_of(job, at):
                        del self._waiting[w.id]
                # a run of it silent (stopped: Ctrl-Z) is told too, should it ask again
                silent = any(w.job == job for w in self._waiting.values()) or any(
                    o.job == job for o in self._dropped.values()
                )
                if mine or silent:
                    _keep_newest(
                        self._removed, job, _Removed(at, force, self._wall()), at, self._remember
                    )
                # written at once: a kill -9 before the next tick does not bring it back
                state = self._state(self._running_names)
            self._save(state)
            if not mine:
                return
            self._events.emit(
                "colo.leave",
                f"job {job} removed while its gpuctl run waited for co-location",
                job=job,
            )

        return committed

    def leave(self, waiter_id: str, stopped_by: str | None = None) -> WaiterView | None:
        """Take the ``gpuctl run`` waiting with ``waiter_id`` out of the wait (``gpuctl
        queue --leave ID``): its next question is answered LeftQueue, and it exits having
        started nothing, as a queued run taken out does. None when no run waits with that
        id (an admission queue entry's, or one gone). ``stopped_by``: the run itself leaves
        as it stops, sent that signal ("" when not known), and is remembered a minute, for
        a question already on its way; None: an operator took it out, written to colo.json
        at once, so that the run, stopped and continued after a gpud restart, is told: it
        answers once the file holds it (or after ``leave_write_s``, or a failed write,
        saying so in the log: the leave is done in gpud alone)."""
        now = self._clock()
        with self._lock:
            gone = self._forget_gone(now)
            # an hour on, a run that left as it stopped (kept a minute) is not said to have
            # left "3600 s ago": it is as unknown as it is to its next question
            self._forget_left(now)
            w = self._waiting.pop(waiter_id, None)
            # one dropped for its silence (stopped: Ctrl-Z) is taken out too, not to wait
            # again once continued
            off = _off(now, w) if w is not None else self._dropped.pop(waiter_id, None)
            # taken out before: by an operator (kept in _left) or as its run stopped
            before = (
                None
                if off is not None
                else (
                    (self._left.get(waiter_id), "gpuctl queue --leave took it out")
                    if waiter_id in self._left
                    else (self._stopped.get(waiter_id), "its gpuctl run was stopped")
                )
            )
            state = None
            if off is not None:
                taken = _Left(now, off.job, off.anonymous, self._wall())
                if stopped_by is None:
                    _keep_newest(self._left, waiter_id, taken, now, self._remember)
                    # written at once: a restart before the next tick does not let the run,
                    # continued, wait again
                    state = self._state(self._running_names)
                else:
                    # its process has exited: only a question already on its way comes
                    _keep_newest(
                        self._stopped,
                        waiter_id,
                        taken,
                        now,
                        self._remember,
                        keep_s=STOPPED_LEFT_KEEP_S,
                    )
        self._save(state)
        if off is not None and state is not None and self._state_file is not None:
            # the RPC answers once it is on disk: a kill -9 of gpud after does not lose it
            why = self._wait_written(state[0])
            if why:
                log.warning(
                    "co-location state %s: the leave of %s (job %s) not written (%s): done,"
                    " but a gpud restart before the next write forgets it",
                    self._state_file,
                    waiter_id,
                    off.job,
                    why,
                )
        self._say_gone(gone, now)
        if off is None:
            return self._left_already(waiter_id, before, stopped_by, now)
        self._events.emit(
            "colo.leave",
            f"job {off.job} left the wait for co-location ({waiter_id}, gpuctl queue --leave)"
            if stopped_by is None
            else f"job {off.job} left the wait for co-location ({waiter_id}): its gpuctl run "
            f"was stopped{f' ({stopped_by})' if stopped_by else ''}",
            job=off.job,
            entry=waiter_id,
        )
        if w is None:  # dropped: it stopped asking, its reason and user are not kept
            return WaiterView(off.job, now - off.since, "stopped asking", waiter_id)
        return WaiterView(w.job, now - w.since, w.reason, w.id, w.uid)

    @staticmethod
    def _left_already(
        waiter_id: str,
        before: tuple[_Left | None, str] | None,
        stopped_by: str | None,
        now: float,
    ) -> WaiterView | None:
        """A leave of a run that left the wait already (``before``: how it was taken out,
        remembered for a while): the run stopping is answered it, as it is now; an
        operator is refused (FailedPrecondition), told when it left and who took it out,
        as for a queue entry that left. None: no run waited with that id."""
        taken, who = before if before is not None else (None, "")
        if taken is None:
            return None
        ago = f"{max(0.0, now - taken.at):.0f} s ago: {who}"
        if stopped_by is not None:
            return WaiterView(taken.job, 0.0, f"left the wait for co-location {ago}", waiter_id)
        raise FailedPrecondition(
            f"job {taken.job} ({waiter_id}) did not leave the wait for co-location: it left it"
            f" already, {ago}"
        )

    def _off_for(self, waiter: str) -> None:
        """Refuse advice while the loop is off: ``gpuctl run`` then places its job as the
        jobs service does. A run that waited for advice (``waiter``) leaves the wait."""
        with self._lock:
            w = self._waiting.pop(waiter, None) if waiter else None
        if w is not None:
            self._events.emit(
                "colo.leave",
                f"job {w.job} left the wait for co-location ({w.id}): co-location is off,"
                " the jobs service places it",
                job=w.job,
                entry=w.id,
            )
        raise ColocationOff(
            "co-location is off ([colocate] enabled = false): jobs go where the jobs"
            " service places them"
        )

    def _forget_gone(self, now: float, keep: str | None = None) -> list[_Waiter]:
        """Drop the waiters that stopped asking (their gpuctl run was stopped or killed),
        as the queue drops an entry whose holder process is gone, but the one waiting as
        ``keep`` (the asker of the question at hand); for :meth:`_say_gone` once out of
        the lock. Under the lock."""
        gone = [w for w in self._waiting.values() if now - w.last > WAITER_GONE_S and w.id != keep]
        for w in gone:
            del self._waiting[w.id]
            _keep_newest(self._dropped, w.id, _off(now, w), now, self._remember)
        _forget_old(self._dropped, now, self._remember)
        return gone

    def _say_gone(self, gone: Sequence[_Waiter], now: float) -> None:
        for w in gone:
            self._events.emit(
                "colo.leave",
                f"job {w.job} left the wait for co-location ({w.id}): its gpuctl run stopped "
                f"asking {now - w.last:.0f} s ago",
                job=w.job,
                entry=w.id,
            )

    def waiting(self) -> list[WaiterView]:
        """Each ``gpuctl run`` waiting for advice, in the order they are served (the
        order they came): those told to wait that asked again within
        :data:`WAITER_GONE_S`."""
        now = self._clock()
        with self._lock:
            gone = self._forget_gone(now)
            order = sorted(self._waiting.values(), key=lambda w: (w.since, w.job, w.id))
            out = [WaiterView(w.job, now - w.since, w.reason, w.id, w.uid) for w in order]
        self._say_gone(gone, now)
        return out

    def _advice(
        self,
        job: str,
        *,
        kind: str,
        memory_bytes: int | None,
        slo_p99_ms: float | None,
        sm_activity: float | None,
        peak_load: float,
        snapshot: Snapshot | None,
        since: float | None,
        now: float,
        waiter: str = "",
        uid: int | None = None,
        wid: str = "",
    ) -> tuple[Advice, JobView | None]:
        """The advice and the job's view (None when there was no telemetry); ``since``:
        when a waiting asker was first told to wait (None: it does not wait); ``waiter``:
        its id ("" when it does not wait); ``uid``: its run's user (:meth:`advise`);
        ``wid``: the id its place would be promised under (its own place does not bar it)."""
        # each names its field first, as check_slo_ms does: what the gRPC status says first
        if kind not in ("training", "inference"):
            raise InvalidArgument(
                f"must be training or inference, not {kind!r} (job {job})", field="kind"
            )
        if sm_activity is not None and not 0.0 < sm_activity <= 1.0:  # NaN too
            raise InvalidArgument(
                f"{sm_activity} is outside (0, 1] (job {job})", field="sm_activity"
            )
        if slo_p99_ms is not None:
            check_slo_ms(slo_p99_ms)  # as `gpuctl jobs add --slo-p99-ms` is held to
        if not 0.0 <= peak_load <= MAX_PEAK_LOAD:
            raise InvalidArgument(
                f"{peak_load} requests/s is outside [0, {MAX_PEAK_LOAD:g}] (job {job})",
                field="peak_load",
            )
        if not self.config.enabled:
            self._off_for(waiter)
        if snapshot is None:
            return Advice(-1, 0.0, 0, None, "", 0.0, "no telemetry yet"), None
        with self._lock:
            removals = self._removals
        running = tuple(self._running())
        with self._lock:  # the places runs were given that have not reserved yet count
            running = self._present(running, removals)
            promised = self._promises(job, wid, running, now)
        # each planned under its run's name, as a new run of its job: known by the place
        # itself (id -> its job), as the job's running reservations share its name
        profile: dict[int, str] = {}
        for planned_as, place in promised:
            run = dataclasses.replace(place, name=planned_as)
            profile[id(run)] = place.name
            running = (*running, run)
        # read from the state store, so before the loop's lock: a job removal holds the
        # store's while it calls job_removed, which takes the loop's
        defaults = self._default_memory() if memory_bytes is None else {}
        names = self._user_names(running, uid, now)
        with self._lock:
            jk = JobKind.INFERENCE if kind == "inference" else JobKind.TRAINING
            st = self._jobs.get(job)
            # what the asker says it does alone, else what the job showed alone when it ran
            # before (its place, once promised, is planned with that too), else the prior
            learned = st.alone(kind) if st is not None else None
            features = (
                JobFeatures(sm=sm_activity, mem_bw=min(1.0, sm_activity))
                if sm_activity
                else learned or PRIOR
            )

            def asking(memory: int) -> JobView:
                shape = Shape.prior(
                    job,
                    jk,
                    memory_bytes=memory,
                    knee=sm_activity or (learned.sm if learned is not None else None),
                    slo_s=slo_p99_ms / 1e3 if slo_p99_ms else None,
                    peak_load=peak_load,
                )
                self._observe_rates(shape, job)
                return JobView(
                    job,
                    shape,
                    features,
                    order=float("inf") if since is None else since,
                    peak_load=peak_load,
                    waited_s=0.0 if since is None else now - since,
                    # a run of a job the loop evicted, which has not run since
                    evicted=st is not None and st.evicted and st.arrived is None,
                    user=uid,
                    user_name=names.get(uid, "") if uid is not None else "",
                )

            # Every run that waits is planned with it, in the order they came (a new ask
            # comes last): what frees goes to the first that fits there, whichever asks
            # first. A run of an evicted job, or one that waited head_hold_s, that fits
            # nowhere has a GPU held for it, which no later asker is given.
            # Another run of the same job is planned under its id: the planner knows a job
            # by its name, and the asker's own name is the one it must answer for.
            ahead = [
                dataclasses.replace(
                    w.view,
                    job_id=w.job if w.job != job else f"{w.job} ({w.id})",
                    order=w.since,
                    waited_s=now - w.since,
                )
                for w in self._waiting.values()
                if w.id != waiter and now - w.last <= WAITER_GONE_S
            ]
            healthy = {g.identity.index for g in snapshot.gpus if g.healthy}
            running = tuple(r for r in running if r.gpu in healthy)  # the rest stay put
            views = [self._view(r, names, profile.get(id(r))) for r in running]
            gpus, where = self._gpu_views(snapshot, running)
            hold = self._planner.params.head_hold_s
            # A run that sets no --memory is pinned, on each GPU, to that GPU's MPS default
            # limit where it has one (what the jobs service then reserves), else planned
            # at 8 GiB: GPUs of one planned size are planned together, the fastest wins.
            by_size: dict[int, list[GpuView]] = {}
            for g in gpus:
                size = memory_bytes or defaults.get(g.index) or 8 * GIB
                by_size.setdefault(size, []).append(g)
            placement: Placement | None = None
            waiting = ""
            new = asking(memory_bytes or 8 * GIB)
            holding = frozenset(
                (r.name, r.gpu, r.device, r.threads_percent, r.memory_used, r.mig_profile, r.uid)
                for r in running
            )
            for size, some in sorted(by_size.items()) or [(new.shape.memory_bytes, [])]:
                view_new = asking(size)
                same = (
                    snapshot.monotonic,
                    tuple(some),
                    holding,
                    frozenset(_question(v, hold) for v in [*ahead, view_new]),
                )
                found, why = self._place(some, [*views, *ahead], view_new, same)
                if found is not None and (
                    placement is None or found.predicted_speed > placement.predicted_speed
                ):
                    placement, new = found, view_new
                elif placement is None and not waiting:
                    waiting, new = why, view_new
            if placement is None:
                why = waiting or "no GPU has room"
                # The planner weighs the healthy GPUs alone: the faulty ones are named too,
                # or a refusal that lists only busy GPUs hides the free ones that are sick.
                sick = [
                    f"GPU {g.identity.index} unhealthy: {_headline(g.reason) or 'unhealthy'}"
                    for g in snapshot.gpus
                    if not g.healthy
                ]
                if sick:
                    why = "; ".join([why, *sick])
                return Advice(-1, 0.0, 0, None, "", 0.0, why), new
            device = ""
            # the limit the run's MPS client gets: its --memory, else the GPU's MPS default
            # (0: none); the plan's own size adds a margin for growth the client never gets
            limit = placement.memory_limit_bytes
            if placement.mig_profile is not None:
                device = where.get((placement.gpu, placement.mig_profile), "")
            else:
                limit = memory_bytes or defaults.get(placement.gpu, 0)
                if (sample := snapshot.gpu(placement.gpu)) is not None:
                    device = sample.identity.uuid
            advice = Advice(
                placement.gpu,
                placement.sm_share,
                limit,
                placement.mig_profile,
                device,
                placement.predicted_speed,
                placement.reason,
            )
            return advice, new

    def _place(
        self, gpus: list[GpuView], jobs: list[JobView], new: JobView, same: Hashable
    ) -> tuple[Placement | None, str]:
        """``jobs``: the running ones and the askers planned ahead of ``new``. ``same``
        names the question: a pass that answered it less than :data:`ADVICE_REUSE_S` ago
        answers again (every run that waits asks every few seconds, and each question
        plans them all)."""
        now = self._clock()
        kept = self._advice_pass
        if kept is not None and kept[0] == same and now - kept[1] < ADVICE_REUSE_S:
            plan = kept[2]
        else:
            plan = Planner(self.predictor, self._planner.params).plan(gpus, [*jobs, new])
            self._advice_pass = (same, now, plan)
            self.advice_passes += 1
        self._refused = (new.job_id, plan.refused_for.get(new.job_id, {}))
        for p in plan.placements:
            if p.job_id == new.job_id:
                return p, ""
        return None, plan.waiting.get(new.job_id, "no GPU in the snapshot")

    def reservations_freed(self) -> None:
        """Reservations went (a run ended, a job was removed, holders found gone), committed:
        the next :meth:`show` reads which jobs still hold one. (The jobs service's freed
        hook; one added shows at the next pass, as its job's place does.)"""
        with self._lock:
            self._freed += 1
            self._held = None

    def _still_held(self) -> frozenset[str]:
        """The jobs that hold a reservation now, of those the last pass saw: read from
        ``holding`` only when some went since it was last read, else kept (a scrape of
        ``/metrics`` reads no store)."""
        with self._lock:
            held, freed = self._held, self._freed
        if held is not None:
            return held
        held = frozenset(self._holding())  # the store's lock, never under the loop's
        with self._lock:
            if freed == self._freed:  # none went while it was read
                self._held = held
        return held

    def show(self) -> ColoView:
        strangers = self._strangers()
        holding = self._still_held()
        with self._lock:
            # the last pass's jobs, but those whose last reservation went since: a run that
            # ended is no longer placed anywhere, whatever the plan said
            running = tuple(r for r in self._last_running if r.name in holding)
            guards = []
            for name, g in sorted(self._guards.items()):
                views = [x for x in running if x.name == name]
                if not views:
                    continue  # its reservation is gone

                # A service on several GPUs is shown where something bears on its guard: a
                # faulty GPU (paused), else one with training beside it, else its first.
                def beside(x: RunningJob) -> bool:
                    return any(
                        o.kind == "training" and o.gpu == x.gpu and _shares_device(o, x)
                        for o in running
                    )

                r = min(views, key=lambda x: (x.gpu not in self._faulty, not beside(x)))
                st = self._jobs.get(name, _JobState())
                p99 = self.p99(name)
                judged = self._judged_since(st)
                at_duty = self.p99(name, since=judged, min_samples=MIN_FRESH_SAMPLES)
                action = g.last.action.value if g.last else "hold"
                reason = g.last.reason if g.last else "no training on its GPU"
                if g.last is None and beside(r):
                    # switched on, started afresh or just beside training: it judges
                    # none of the window's older reports, and has not judged yet. Counted
                    # as the guard counts them: up to QUIET_WINDOWS windows back
                    reach = QUIET_WINDOWS * self.config.latency_window_s
                    n = len(self._latencies(name, judged, at_least=MIN_FRESH_SAMPLES))
                    if n >= MIN_FRESH_SAMPLES:
                        reason = f"judges its {n} latencies at the next tick"
                    elif (
                        st.arrived is not None and self._clock() - max(judged, st.arrived) >= reach
                    ):
                        # it has reached as far back as it ever does, since it may judge
                        # and since the service ran: no wait brings more
                        reason = f"not guarded: too few requests ({n} in the last {reach:g} s)"
                    else:
                        reason = f"measuring: {n} of the {MIN_FRESH_SAMPLES} latencies it judges on"
                if r.gpu in self._faulty:
                    action, reason = "hold", f"paused: GPU {r.gpu} {self._faulty[r.gpu]}"
                    if p99 is not None and p99 > g.slo_s:
                        reason += f"; p99 {p99 * 1e3:.1f} ms over SLO {g.slo_s * 1e3:.1f} ms"
                guards.append(
                    GuardView(
                        job=name,
                        gpu=r.gpu if r else -1,
                        slo_ms=g.slo_s * 1e3,
                        p99_ms=p99 * 1e3 if p99 is not None else None,
                        duty=g.duty,
                        action=action,
                        reason=reason,
                        attainment=st.windows_ok / st.windows if st.windows else 1.0,
                        p99_at_duty_ms=at_duty * 1e3 if at_duty is not None else None,
                    )
                )
            stats = self.predictor.stats()
            return ColoView(
                enabled=self.config.enabled,
                plan=self._plan,
                plan_age_s=self._clock() - self._plan_at if self._plan else 0.0,
                running=running,
                duty={k: d.duty for k, d in self._directives.items()},
                directives=dict(self._directives),
                observed_speed=dict(self._observed),
                guards=tuple(guards),
                predictor_samples=stats.samples,
                predictor_mae=stats.mean_abs_error,
                faulty=dict(self._faulty),
                predictor_margins=self.predictor.margins(self._planner.params.error_quantile),
                predictor_margin_errors=self.predictor.margin_errors(),
                refused_job=self._refused[0],
                refused=dict(self._refused[1]),
                strangers={g: n for g, n in strangers.items() if n},
                waiting=tuple(self.waiting()),
            )
