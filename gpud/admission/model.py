"""What admission reasons about: requests, holdings, per-device demand vectors, devices.

Every device (a whole GPU or one MIG device, as ``nvidia-smi -L`` lists them) has a
capacity vector ``(memory bytes, MPS active thread percent)``: the device's framebuffer and
100 %. A request asks, on each of ``count`` distinct devices of its *pool* (its pinned
devices, the MIG devices of its profile, or the GPUs not in MIG mode), for a demand vector:
its MPS pinned memory limit (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) and its active thread
percentage (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``), 0 where it sets none. A request that
sets no memory limit asks, on a device with an MPS default pinned memory limit
(``gpuctl mps set --memory``), for that limit: it is what MPS pins its client to there, so
its demand may differ from device to device (:meth:`Demand.on`). A request that sets
neither, on devices without a default, shares them with anything, as MPS clients do, and
never waits.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from gpud.shared import format_size

DIMENSIONS = ("memory", "threads")


@dataclass(frozen=True, slots=True, order=True)
class Vec:
    """A per-device resource vector: MPS pinned memory (bytes) and active threads (%)."""

    memory: int = 0
    threads: int = 0

    def __add__(self, other: Vec) -> Vec:
        return Vec(self.memory + other.memory, self.threads + other.threads)

    def __sub__(self, other: Vec) -> Vec:
        return Vec(self.memory - other.memory, self.threads - other.threads)

    def fits_in(self, capacity: Vec) -> bool:
        return self.memory <= capacity.memory and self.threads <= capacity.threads

    def is_zero(self) -> bool:
        return self.memory == 0 and self.threads == 0

    def as_dict(self) -> dict[str, int]:
        return {"memory": self.memory, "threads": self.threads}


ZERO = Vec()


@dataclass(frozen=True, slots=True)
class Request:
    """A job's placement request, as ``gpuctl run`` gives it (see ``JobSpec``)."""

    devices: tuple[str, ...] = ()  # pinned GPU / MIG UUIDs
    mig_profile: str | None = None  # one MIG device of this profile
    gpu_count: int | None = None  # this many whole GPUs (default 1)
    memory_bytes: int | None = None  # per device
    threads_percent: int | None = None

    @property
    def per_device(self) -> Vec:
        return Vec(self.memory_bytes or 0, self.threads_percent or 0)

    def on(self, device: Device) -> Vec:
        """What it asks on ``device``: its memory limit, else the device's MPS default."""
        memory = self.memory_bytes if self.memory_bytes is not None else device.default_memory
        return Vec(memory or 0, self.threads_percent or 0)

    def describe(self) -> str:
        """The request's class key (``1 GPU 60GiB 50%``, ``mig 1g.10gb 1.5GiB``): the quotes
        are estimated per class, and ``job_history`` keeps each run's key, so its format
        stays as state databases have it (a new one would start every class afresh).
        What the operator sees is :meth:`label`."""
        memory = None if self.memory_bytes is None else f"{self.memory_bytes / 2**30:g}GiB"
        return self._text(memory)

    def label(self) -> str:
        """The request as gpuctl shows it (REQUEST in ``gpuctl queue``, ``gpuctl jobs
        history``), sizes as an operator writes them: ``1 GPU 60GiB 50%``,
        ``mig 1g.10gb 1536MiB``, ``1 GPU 4194304TiB`` (not ``4.29497e+09GiB``)."""
        return self._text(None if self.memory_bytes is None else format_size(self.memory_bytes))

    def _text(self, memory: str | None) -> str:
        if self.devices:
            where = ",".join(self.devices)
        elif self.mig_profile is not None:
            where = f"mig {self.mig_profile}"
        else:
            where = f"{self.gpu_count or 1} GPU"
        parts = [where]
        if memory is not None:
            parts.append(memory)
        if self.threads_percent is not None:
            parts.append(f"{self.threads_percent}%")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class Device:
    """One GPU or MIG device admission may place on."""

    uuid: str
    gpu: int
    mig: int | None  # MIG device index; None for a whole GPU
    profile: str  # MIG profile ("1g.10gb") or the GPU's product
    capacity: Vec
    # False for a GPU never read (lost or hung since before gpud started) whose product is
    # not known either: its memory is no fact, so no request is unfeasible for want of it
    size_known: bool = True
    # its MPS default pinned memory limit: what a client that sets none is pinned to
    default_memory: int | None = None
    # its MPS default thread share where MPS serves it: a client's own share only narrows it
    default_threads: int | None = None

    @property
    def is_mig(self) -> bool:
        return self.mig is not None


NO_JOB: Final = None
"""A :class:`Holding`'s ``name`` for what holds a device without being a job there: the
memory processes use beyond reservations, an unhealthy GPU's fill."""


@dataclass(frozen=True, slots=True)
class Holding:
    """What one running job holds: the same demand vector on each of its devices.
    ``uid``: the user its processes run as, where MPS serves the devices and it is known
    (a control daemon serves one user at a time: no job of another user goes there).
    ``name`` (keyword, always given): the name of the job it is a run of, or
    :data:`NO_JOB`. Placement orders devices by the distinct job names on each, as the
    reservation's own placement counts them: two runs of one job on a device are one job
    there, and a :data:`NO_JOB` holding is none."""

    job: str
    devices: tuple[str, ...]
    per_device: Vec
    uid: int | None = None
    name: str | None = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class Demand:
    """A request reduced to vectors: ``count`` distinct devices of ``pool``, each with
    ``per_device`` free, or what ``by_device`` names for it (a request without a memory limit
    on a device with an MPS default one)."""

    pool: tuple[str, ...]
    per_device: Vec
    count: int
    by_device: tuple[tuple[str, Vec], ...] = ()

    def on(self, uuid: str) -> Vec:
        """What it asks on device ``uuid``."""
        for u, v in self.by_device:
            if u == uuid:
                return v
        return self.per_device


NEVER_READ = "never read since gpud started"  # how a GPU of UUID "" is named where left out


def serving_devices(
    pool: Sequence[str], gpu_of: Mapping[str, int], unread: Collection[int], down: Collection[int]
) -> tuple[tuple[str, ...], frozenset[int]]:
    """The devices of ``pool`` that serve a job now, and the GPUs of those that do not.
    ``gpu_of``: device UUID -> its GPU's index (a MIG device's is its parent's); ``down``:
    the GPUs no job is placed on now (lost, hung, held by a MIG apply), each device on them
    left out. A device of UUID "" stands for every GPU never read since gpud started
    (``unread``): no job is placed on it until the driver reports its UUID, so it serves
    none, whether ``down`` names its GPUs or not. A UUID ``gpu_of`` lacks serves."""
    kept = []
    gone: set[int] = set()
    for u in pool:
        gpu = gpu_of.get(u)
        if not u:
            gone |= set(unread)
        elif gpu is not None and gpu in down:
            gone.add(gpu)
        else:
            kept.append(u)
    return tuple(kept), frozenset(gone)


@dataclass(frozen=True, slots=True)
class Unfeasible:
    """Why a request can never start on this node as it is, and what would change that."""

    reason: str
    remedy: str = ""


@dataclass(slots=True)
class Loads:
    """Per-device sums of holdings, the holdings on each device, the names of the jobs among
    them (``names``) and the known users of what holds each (``users``: (UID, the
    holding's job name, or its ``job`` id where it is :data:`NO_JOB`))."""

    total: dict[str, Vec] = field(default_factory=dict)
    on: dict[str, list[Vec]] = field(default_factory=dict)
    names: dict[str, set[str]] = field(default_factory=dict)
    users: dict[str, set[tuple[int, str]]] = field(default_factory=dict)

    @classmethod
    def of(cls, holdings: Sequence[Holding]) -> Loads:
        loads = cls()
        for h in holdings:
            loads.add(h)
        return loads

    def add(self, holding: Holding) -> None:
        for uuid in holding.devices:
            self.total[uuid] = self.total.get(uuid, ZERO) + holding.per_device
            self.on.setdefault(uuid, []).append(holding.per_device)
            if holding.name is not NO_JOB:
                self.names.setdefault(uuid, set()).add(holding.name)
            if holding.uid is not None:
                who = (holding.uid, holding.name or holding.job)
                self.users.setdefault(uuid, set()).add(who)

    def get(self, uuid: str) -> Vec:
        return self.total.get(uuid, ZERO)


class FitCheck(Protocol):
    """What fits: the node's devices, a request's demand, and where it goes now.

    :class:`gpud.admission.placement_fit.PlacementFit` answers with the reservation code's
    own placement; any answer must be *monotone*: a request that fits some loads also fits
    any smaller loads (the backfill guarantee in :mod:`gpud.admission.queue` rests on it).
    """

    def devices(self) -> Sequence[Device]: ...

    def demand(self, request: Request) -> Demand | Unfeasible:
        """The request's demand, or why no state of the node can ever host it."""
        ...

    def place(
        self,
        request: Request,
        loads: Mapping[str, Vec],
        *,
        allowed: Collection[str] | None,
        names: Mapping[str, Collection[str]] | None = None,
        users: Mapping[str, Collection[tuple[int, str]]] | None = None,
        uid: int | None = None,
    ) -> tuple[str, ...] | None:
        """Devices for ``request`` now (only among ``allowed``, when given), or None.
        ``names``, ``users``: the names of the jobs holding each device and their known
        users (:attr:`Loads.names`, :attr:`Loads.users`); ``uid``: the request's user, where
        MPS serves the devices. Among the devices that fit, the order is the reservation's
        own (:func:`gpud.jobs.placement.choose_devices`): the least held first, so runs
        that set no limits (a zero load) spread rather than pile onto the first device
        listed; but where the idle devices that fit (no known user) number no more than the
        request wants, one already serving ``uid`` first (its MPS control daemon serves that
        user: the last idle device stays open to others)."""
        ...


_SLICES = re.compile(r"^(?:\d+c\.)?(\d+)g\.")


def mig_slices(profile: str) -> int | None:
    """Compute slices of a MIG profile name ("3g.40gb" -> 3), None for a whole GPU."""
    m = _SLICES.match(profile)
    return int(m.group(1)) if m else None
