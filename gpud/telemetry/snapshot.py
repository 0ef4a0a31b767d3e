"""Immutable telemetry snapshots: what every consumer (metrics, API, policies) reads.

A :class:`Snapshot` is one sampling tick over every GPU and MIG device. A reading the device
does not support is ``None``; a GPU whose reads failed is ``healthy=False`` with ``reason``
and keeps its last good readings' identity so that it stays visible.

The samples, built for every GPU and MIG device on every tick, are ``NamedTuple``s like the
readings in them (:mod:`gpud.backend.port`): immutable, and cheap to build. A MIG device's
sample is the backend's :class:`MigReading` itself (identity, memory, processes), not a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from gpud.backend.port import (
    Clocks,
    EccCounts,
    GpuIdentity,
    MemoryInfo,
    MigMode,
    MigReading,
    PcieThroughput,
    ProcessInfo,
    Utilization,
)

MigSample = MigReading
"""One MIG device at one tick: its identity, memory and processes, as the backend read them
(``memory`` is None and ``processes`` empty when the device could not be read; ``memory`` is
kept and ``processes_read`` False when only its process list could not be read; ``memory``
is None with ``memory_error`` saying why, and the processes kept, when only its memory could
not be read)."""


@dataclass(frozen=True, slots=True)
class CriticalXid:
    """One critical XID code a GPU raised and nobody has cleared yet (``gpuctl xid clear``,
    or a GPU reset). Each code is kept apart, so a second fault on the GPU is never hidden
    behind the first, and clearing one leaves the others."""

    xid: int
    count: int  # times raised since the GPU was last reset or the code cleared
    first_seen: float  # Unix time; 0.0 when unknown (kept by a gpud that did not record it)
    last_seen: float  # never before first_seen, whatever the wall clock did in between
    uuid: str = ""  # the GPU's UUID when it was raised; "" when it could not be read then
    # the GPU's model (NVML's name) with that UUID: the metrics name the board by the pair,
    # the same series after a restart that cannot read the GPU
    model: str = ""

    def __post_init__(self) -> None:
        # a wall clock stepped back between two raises (or in a state file read back)
        if self.last_seen < self.first_seen:
            object.__setattr__(self, "last_seen", self.first_seen)


class ClearedXids(NamedTuple):
    """What clearing a GPU's critical XIDs did: the codes cleared, and those it still has."""

    cleared: tuple[int, ...]
    remaining: tuple[int, ...]


class SeenIdentity(NamedTuple):
    """A GPU's UUID, NVML name, PCI address and gpud's product key: as read now, or as an
    earlier run of gpud last read them (:mod:`gpud.telemetry.seen`); "" where never known
    (``product`` also where the run that kept the others did not keep it)."""

    uuid: str
    name: str
    pci_bus_id: str
    product: str = ""


# GPU index -> how an earlier run last saw it, for each GPU never read in this one (the
# daemon's, from the latest snapshot): what `gpuctl mig show` and `mps show` name it by
LastSeenSource = Callable[[], Mapping[int, SeenIdentity]]


class GpuSample(NamedTuple):
    """One GPU at one tick. ``sampled_at`` is the monotonic time its reads completed: of a
    GPU lost, hung or faulty (``READING_FAULTS``: a reading answered "GPU lost", "reset
    required", ...), the time of its last good read, and the sample then has none of the
    tick's numeric readings. A faulty GPU that is not lost keeps its process list and MIG
    mode, which the driver still answers and its reset needs; its MIG devices are not read
    (``mig_devices_read``)."""

    identity: GpuIdentity
    healthy: bool
    reason: str  # empty when healthy; else why (e.g. "GPU lost", "driver call timed out")
    sampled_at: float
    memory: MemoryInfo | None = None
    utilization: Utilization | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None
    clocks: Clocks | None = None
    ecc: EccCounts | None = None
    pcie: PcieThroughput | None = None
    processes: tuple[ProcessInfo, ...] = ()
    mig_mode: MigMode | None = None
    mig_devices: tuple[MigSample, ...] = ()
    xid_events_total: int = 0
    last_xid: int | None = None
    nvlink_bytes: tuple[int, int] | None = None  # (tx, rx) counters summed over links
    # uncleared critical XIDs, the first raised first; last_xid is the latest XID of any kind
    critical_xids: tuple[CriticalXid, ...] = ()
    # how an earlier run last saw the GPU; set only while its identity was never read in
    # this one (lost or hung since before gpud started)
    last_seen: SeenIdentity | None = None
    # True when the driver listed the GPU's processes this tick; else (NotSupported, the
    # call failed, the GPU lost or hung) ``processes`` is empty without meaning that none run
    processes_read: bool = False
    # why the driver did not list them, when the GPU was read (NotSupported, a driver
    # error); "" when it did, or when the GPU was not read (``reason`` says why)
    processes_error: str = ""
    # False when the driver gives gpud no XID events for the GPU: xid_events_total is then
    # no count of its XIDs
    xids_watched: bool = True
    # False when the GPU's MIG devices were not read this tick (the GPU lost, hung or faulty,
    # or their list or readings failed): ``mig_devices`` is then empty without meaning that
    # none exist; True also of a GPU not in MIG mode
    mig_devices_read: bool = True
    # True when a driver call for the GPU answered NVML_ERROR_GPU_IS_LOST this tick (it
    # fell off the bus): only a reset or a reboot brings it back, whatever ``reason`` says
    lost: bool = False

    def known(self) -> SeenIdentity:
        """The UUID, name, PCI address and product that name the GPU to an operator (metrics
        labels, ``gpuctl gpus``): as read in this run, else as last seen; "" where never
        known."""
        if self.last_seen is not None and not self.identity.uuid:
            return self.last_seen
        ident = self.identity
        return SeenIdentity(ident.uuid, ident.name, ident.pci_bus_id, ident.product)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every GPU at one tick. ``wall_time`` is Unix time; ``monotonic`` orders snapshots."""

    wall_time: float
    monotonic: float
    gpus: tuple[GpuSample, ...]
    tick_seconds: float  # how long the tick took
    driver_version: str | None = None  # nvidia-smi's "Driver Version"; None until read

    def gpu(self, index: int) -> GpuSample | None:
        for g in self.gpus:
            if g.identity.index == index:
                return g
        return None

    def by_uuid(self, uuid: str) -> GpuSample | MigSample | None:
        for g in self.gpus:
            if g.identity.uuid == uuid:
                return g
            for m in g.mig_devices:
                if m.identity.uuid == uuid:
                    return m
        return None
