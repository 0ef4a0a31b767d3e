"""The job registry: what ``gpuctl jobs add/rm/ls`` manage, one row per job in ``jobs``.

A job is a name the node knows a workload by: its kind (training or inference), owner, where
it runs (pinned GPU/MIG UUIDs, or a MIG profile, or a number of whole GPUs, placed when it is
reserved), its MPS client limits and, for inference, its latency SLO. Jobs outlive the
processes that run them and the daemon itself.
"""

from __future__ import annotations

import json
import logging
import re
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from gpud.errors import AlreadyExists, InvalidArgument, NotFound
from gpud.mps import protocol
from gpud.shared import MAX_SLO_MS, MIN_SLO_MS, check_owner, check_slo_ms, shown
from gpud.store import StateStore

log = logging.getLogger(__name__)


SCHEMA = (
    """CREATE TABLE IF NOT EXISTS jobs (
        name TEXT PRIMARY KEY,
        kind TEXT NOT NULL,
        owner TEXT NOT NULL,
        devices TEXT NOT NULL,
        mig_profile TEXT,
        gpu_count INTEGER,
        threads_percent INTEGER,
        memory_bytes INTEGER,
        client_priority INTEGER,
        slo_p99_ms REAL,
        created_at REAL NOT NULL
    )""",
)

# Names go into environment variables, cgroup names and Prometheus labels. Matched whole
# (fullmatch): "$" alone would take a name ending in a newline.
MAX_NAME = 63  # characters of a job name
_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{MAX_NAME - 1}}}")
# "1g.10gb", "1g.10gb+me", "1g.10gb+me.all", "1g.10gb-me", "1c.3g.40gb" (a compute instance)
_MIG_PROFILE = re.compile(r"(\d+c\.)?\d+g\.\d+gb([+-][a-z]+(\.[a-z]+)?)?")

# A device as gpuctl takes it: a GPU index (0), GPU:MIG (0:1), a GPU-/MIG- UUID (an older
# driver's MIG-GPU-<uuid>/1/0 too). Never a control character: it is shown and logged.
_DEVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9:/_.-]{0,95}")

# CUDA_MPS_CLIENT_PRIORITY: 0 is NORMAL, 1 is BELOW_NORMAL.
PRIORITY_NORMAL = 0
PRIORITY_BELOW_NORMAL = 1


class JobKind(StrEnum):
    TRAINING = "training"
    INFERENCE = "inference"


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One registered job. Unset fields (``None``, ``()``) mean "decide at reservation"."""

    name: str
    kind: JobKind = JobKind.TRAINING
    owner: str = ""
    devices: tuple[str, ...] = ()  # pinned GPU / MIG UUIDs
    mig_profile: str | None = None  # place on one MIG device of this profile ("3g.40gb")
    gpu_count: int | None = None  # place on this many whole GPUs
    threads_percent: int | None = None  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
    memory_bytes: int | None = None  # CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, per device
    client_priority: int | None = None  # CUDA_MPS_CLIENT_PRIORITY; default by kind
    slo_p99_ms: float | None = None  # inference only
    created_at: float = 0.0

    @property
    def effective_priority(self) -> int:
        """Inference clients run at NORMAL priority, training BELOW_NORMAL, unless set."""
        if self.client_priority is not None:
            return self.client_priority
        return PRIORITY_NORMAL if self.kind is JobKind.INFERENCE else PRIORITY_BELOW_NORMAL


def validate_spec(spec: JobSpec) -> JobSpec:
    """Check every field; raise :class:`InvalidArgument` naming the first wrong one."""
    check_name(spec.name)
    check_owner(spec.owner)
    check_devices(spec.devices)
    if not isinstance(spec.kind, JobKind):
        raise InvalidArgument(f"{spec.kind!r} is not training or inference", field="kind")
    if spec.mig_profile is not None and not _MIG_PROFILE.fullmatch(spec.mig_profile):
        raise InvalidArgument(
            f"{spec.mig_profile!r} is not a MIG profile like 3g.40gb", field="mig"
        )
    if spec.gpu_count is not None and spec.gpu_count < 1:
        raise InvalidArgument(f"{spec.gpu_count} GPUs: need at least 1", field="gpus")
    chosen = [
        n
        for n, v in (("devices", spec.devices), ("mig", spec.mig_profile), ("gpus", spec.gpu_count))
        if v
    ]
    if len(chosen) > 1:
        raise InvalidArgument(f"give only one of {', '.join(chosen)}", field=chosen[1])
    if len(set(spec.devices)) != len(spec.devices):
        raise InvalidArgument("a device is listed twice", field="devices")
    if spec.threads_percent is not None:
        protocol.check_percent(spec.threads_percent)
    if spec.memory_bytes is not None:
        protocol.format_memory(spec.memory_bytes)
    if spec.client_priority is not None and spec.client_priority not in (0, 1):
        raise InvalidArgument("0 (normal) or 1 (below normal)", field="priority")
    if spec.slo_p99_ms is not None:
        if spec.kind is not JobKind.INFERENCE:
            raise InvalidArgument("only inference jobs have a latency SLO", field="slo_p99_ms")
        check_slo_ms(spec.slo_p99_ms)
    return spec


def check_devices(devices: Sequence[str]) -> tuple[str, ...]:
    """Each of ``devices`` written as a device is (``_DEVICE``), else InvalidArgument."""
    for device in devices:
        if not _DEVICE.fullmatch(device):
            raise InvalidArgument(
                f"{device!r} is not a device: a GPU index (0), GPU:MIG (0:1) or a GPU-/MIG- UUID",
                field="devices",
            )
    return tuple(devices)


def check_name(name: str, *, field: str = "name") -> str:
    """A job name as the registry takes it; ``field`` names the request field it came in.
    A refused name is echoed back, its first :data:`MAX_NAME` characters and its length
    when it is longer (a name of 100000 characters is not said whole)."""
    if not _NAME.fullmatch(name):
        raise InvalidArgument(
            f"{shown(name, MAX_NAME)}: letters, digits, '_', '.', '-' (up to {MAX_NAME},"
            " starting alphanumeric)",
            field=field,
        )
    return name


class JobRegistry:
    """CRUD over the ``jobs`` table."""

    def __init__(self, store: StateStore, *, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._clock = clock
        store.ensure_schema(SCHEMA)
        self._clamp_slos()

    def _clamp_slos(self) -> None:
        """Bring each stored p99 SLO outside what :func:`check_slo_ms` takes now to the
        nearest end of that range, in the row, with a warning naming the job: a job an
        earlier gpud registered with a tighter SLO (it took anything above zero) would
        otherwise have every question that carries its SLO (``gpuctl colo advise``, the
        advice ``gpuctl run`` asks for) refused until it was registered again. None could
        be met or measured below the floor, so the guard loses nothing it could keep."""
        with self._store.transaction() as conn:
            rows = conn.execute(
                "SELECT name, slo_p99_ms FROM jobs WHERE slo_p99_ms < ? OR slo_p99_ms > ?",
                (MIN_SLO_MS, MAX_SLO_MS),
            ).fetchall()
            for row in rows:
                slo = min(max(row["slo_p99_ms"], MIN_SLO_MS), MAX_SLO_MS)
                conn.execute("UPDATE jobs SET slo_p99_ms = ? WHERE name = ?", (slo, row["name"]))
                log.warning(
                    "job %s: its stored p99 SLO %g ms is outside %g..%.0f ms; it is %g ms now"
                    " (`gpuctl jobs rm %s` and `gpuctl jobs add` again to choose another)",
                    row["name"],
                    row["slo_p99_ms"],
                    MIN_SLO_MS,
                    MAX_SLO_MS,
                    slo,
                    row["name"],
                )

    def add(self, spec: JobSpec) -> JobSpec:
        spec = validate_spec(spec)
        stored = replace(spec, created_at=self._clock())
        try:
            with self._store.transaction() as conn:
                conn.execute(
                    "INSERT INTO jobs (name, kind, owner, devices, mig_profile, gpu_count,"
                    " threads_percent, memory_bytes, client_priority, slo_p99_ms, created_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    _row(stored),
                )
        except sqlite3.IntegrityError:
            raise AlreadyExists(f"job {spec.name!r} exists") from None
        return stored

    def get(self, name: str) -> JobSpec:
        with self._store.transaction() as conn:
            row = conn.execute("SELECT * FROM jobs WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise NotFound(f"no job {name!r}")
        return _spec(row)

    def find(self, name: str) -> JobSpec | None:
        try:
            return self.get(name)
        except NotFound:
            return None

    def all(self) -> list[JobSpec]:
        with self._store.transaction() as conn:
            rows = conn.execute("SELECT * FROM jobs ORDER BY name").fetchall()
        return [_spec(r) for r in rows]

    def names(self) -> list[str]:
        """The names of :meth:`all`, in the same order, without reading the rest of each
        row (the traffic and cluster ticks ask for them every pass)."""
        with self._store.transaction() as conn:
            return [r[0] for r in conn.execute("SELECT name FROM jobs ORDER BY name")]

    def registrations(self) -> dict[str, float]:
        """Each job's name with when it was registered (``created_at``): a name removed
        and added again is another registration, told apart by it."""
        with self._store.transaction() as conn:
            rows = conn.execute("SELECT name, created_at FROM jobs ORDER BY name")
            return {r[0]: r[1] for r in rows}

    def remove(self, name: str) -> JobSpec:
        with self._store.transaction() as conn:
            spec = self.get(name)
            conn.execute("DELETE FROM jobs WHERE name = ?", (name,))
        return spec


def _row(spec: JobSpec) -> tuple[object, ...]:
    return (
        spec.name,
        spec.kind.value,
        spec.owner,
        json.dumps(list(spec.devices)),
        spec.mig_profile,
        spec.gpu_count,
        spec.threads_percent,
        spec.memory_bytes,
        spec.client_priority,
        spec.slo_p99_ms,
        spec.created_at,
    )


def _spec(row: sqlite3.Row) -> JobSpec:
    return JobSpec(
        name=row["name"],
        kind=JobKind(row["kind"]),
        owner=row["owner"],
        devices=tuple(json.loads(row["devices"])),
        mig_profile=row["mig_profile"],
        gpu_count=row["gpu_count"],
        threads_percent=row["threads_percent"],
        memory_bytes=row["memory_bytes"],
        client_priority=row["client_priority"],
        slo_p99_ms=row["slo_p99_ms"],
        created_at=row["created_at"],
    )
