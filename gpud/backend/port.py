"""What gpud needs from the GPU driver, as a small Protocol and plain values.

Two implementations exist: :class:`gpud.backend.nvml.NvmlBackend` (the one module that talks to
``pynvml``) and the same class driven by the simulated node's fake ``pynvml`` module
(:mod:`gpud.backend.sim`). Everything above this port sees only these types.

Conventions:
- GPUs are addressed by NVML index; MIG devices by ``(gpu, mig)`` where ``mig`` is the MIG
  device index on that GPU (``nvmlDeviceGetMigDeviceHandleByIndex``).
- Units are in the field names; values are numbers, never display strings.
- A field the device does not support raises :class:`gpud.errors.NotSupported`; a lost GPU
  raises :class:`gpud.errors.GpuLost`. Callers decide what ``None`` means in a snapshot.
- Calls may block (the real driver can hang): call them off the event loop.
- Readings (what the sampler builds every tick: memory, utilization, processes, ...) are
  ``NamedTuple``s: immutable and equal by value like the frozen dataclasses used for the rest,
  at a third of the cost to build. Like any tuple they also compare equal to a plain tuple
  of the same values; compare them with their own kind.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple, Protocol

from gpud.errors import BackendError


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    """``nvidia-smi -L`` plus the PCI ids: what does not change while the GPU is present."""

    index: int
    uuid: str  # "GPU-8c1b..."
    name: str  # as NVML reports it, e.g. "NVIDIA H100 80GB HBM3"
    product: str  # gpud's product key, e.g. "H100-SXM5-80GB" (from name + memory)
    pci_bus_id: str  # "00000000:18:00.0"
    pci_device_id: int  # NVML's combined id, e.g. 0x233010DE (device << 16 | vendor)
    memory_total_bytes: int
    mig_capable: bool
    # The PCIe link to the host at its best (``nvidia-smi -q``: "Max" under "GPU Link Info",
    # what the GPU and its slot allow together); None where NVML does not say.
    pcie_link_gen: int | None = None
    pcie_link_width: int | None = None

    @property
    def read(self) -> bool:
        """False for :func:`unknown_identity`: the GPU never answered ``nvmlDeviceGetUUID``
        and the rest, so its zero size, PCI id and MIG capability are no facts (NVML always
        gives a GPU it read a UUID)."""
        return bool(self.uuid)


def unknown_identity(index: int) -> GpuIdentity:
    """What a GPU is known as before its identity could ever be read (lost at start-up)."""
    return GpuIdentity(
        index=index,
        uuid="",
        name="",
        product="",
        pci_bus_id="",
        pci_device_id=0,
        memory_total_bytes=0,
        mig_capable=False,
    )


class MemoryInfo(NamedTuple):
    total_bytes: int
    used_bytes: int
    free_bytes: int


class Utilization(NamedTuple):
    """``nvmlDeviceGetUtilizationRates``: percent of the last sample period, as ratios 0..1."""

    gpu_ratio: float
    memory_ratio: float


class Clocks(NamedTuple):
    sm_mhz: int
    memory_mhz: int


class EccCounts(NamedTuple):
    """Volatile ECC error counts since the driver loaded."""

    corrected: int
    uncorrected: int


class PcieThroughput(NamedTuple):
    tx_bytes_per_second: float
    rx_bytes_per_second: float


class ProcessInfo(NamedTuple):
    """A compute process as ``nvmlDeviceGetComputeRunningProcesses`` lists it."""

    pid: int
    used_memory_bytes: int | None  # None where the driver does not say
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


class MigMode(NamedTuple):
    """``nvidia-smi -q`` MIG mode: current and pending (pending differs until a GPU reset)."""

    current: bool
    pending: bool

    @property
    def reset_pending(self) -> bool:
        return self.current != self.pending


@dataclass(frozen=True, slots=True)
class Placement:
    """A GPU instance placement: ``start`` and ``size`` in memory slices (``nvidia-smi mig -lgipp``)."""

    start: int
    size: int

    @property
    def slices(self) -> range:
        return range(self.start, self.start + self.size)


@dataclass(frozen=True, slots=True)
class ComputeInstanceProfile:
    """``nvidia-smi mig -lcip``: one compute instance profile of a GPU instance profile."""

    id: int  # NVML's profile id as returned in the profile info
    profile: int  # NVML's profile constant (NVML_COMPUTE_INSTANCE_PROFILE_*)
    name: str  # "1c.3g.40gb", or "3g.40gb" for the full-size CI
    slice_count: int
    instance_count: int
    multiprocessor_count: int


@dataclass(frozen=True, slots=True)
class GpuInstanceProfile:
    """``nvidia-smi mig -lgip``: one GPU instance profile of a product."""

    id: int  # NVML's profile id (e.g. 19 for 1g.10gb on H100)
    profile: int  # NVML's profile constant (NVML_GPU_INSTANCE_PROFILE_*)
    name: str  # "1g.10gb", "1g.10gb+me", "3g.40gb", ...
    slice_count: int  # compute (SM) slices
    memory_bytes: int
    memory_slices: int  # placement size in memory slices
    instance_count: int  # how many fit on an empty GPU
    multiprocessor_count: int
    copy_engine_count: int
    decoder_count: int
    encoder_count: int
    jpeg_count: int
    ofa_count: int


@dataclass(frozen=True, slots=True)
class ComputeInstanceInfo:
    id: int
    profile_id: int
    placement: Placement


@dataclass(frozen=True, slots=True)
class GpuInstanceInfo:
    id: int
    profile_id: int
    placement: Placement
    compute_instances: tuple[ComputeInstanceInfo, ...] = ()


@dataclass(frozen=True, slots=True)
class MigDeviceIdentity:
    """One MIG device (a compute instance seen as a device): ``nvidia-smi -L`` MIG lines."""

    gpu: int
    mig: int  # index among the GPU's MIG devices
    uuid: str  # "MIG-..."
    gpu_instance_id: int
    compute_instance_id: int
    gpu_instance_profile_id: int
    profile_name: str  # "1g.10gb"
    memory_total_bytes: int
    multiprocessor_count: int
    # Where its GPU instance sits (``nvidia-smi mig -lgi``); with the GPU and the profile it
    # names the device across re-creations, which give it a new UUID. None where unknown.
    gpu_instance_placement: Placement | None = None


class MigReading(NamedTuple):
    """One MIG device's memory and compute processes (``nvidia-smi -q -i N:M -d MEMORY,PIDS``),
    with the device they were read from. ``memory`` is None and ``processes`` empty when the
    device could not be read (most likely destroyed since it was listed). The process list
    fails on its own (NotSupported, a driver error): ``processes_read`` is then False,
    ``processes_error`` says why and ``processes`` is empty without meaning that none run,
    while ``memory`` is kept. The memory query fails on its own the same way: ``memory`` is
    then None, ``memory_error`` says why, and the processes are kept."""

    identity: MigDeviceIdentity
    memory: MemoryInfo | None
    processes: tuple[ProcessInfo, ...]
    # nvmlDeviceGetComputeRunningProcesses answered this tick; no default, so that a reading
    # built without saying so does not pass for a device whose processes were not listed
    processes_read: bool
    processes_error: str = ""  # why it did not, when the device itself was read
    memory_error: str = ""  # why nvmlDeviceGetMemoryInfo did not, when the device was read


class MigReadings(NamedTuple):
    """A GPU's MIG devices, from one :meth:`GpuBackend.mig_readings` call."""

    devices: tuple[MigReading, ...]  # in the order asked
    errors: tuple[tuple[int, BackendError], ...] = ()  # (mig, error) of the unread devices


class GpuReadings(NamedTuple):
    """A whole GPU's per-tick readings (``nvidia-smi -q -i N``), from one
    :meth:`GpuBackend.gpu_readings` call. A reading that was skipped, is not supported or
    failed is ``None`` (``processes``: empty); each failure is in ``errors`` as
    ``(reading, error)``, ``reading`` being the field's name."""

    memory: MemoryInfo | None = None
    utilization: Utilization | None = None  # NotSupported on MIG-enabled GPUs
    power_watts: float | None = None
    temperature_celsius: float | None = None
    clocks: Clocks | None = None
    ecc: EccCounts | None = None
    pcie: PcieThroughput | None = None
    nvlink_bytes: tuple[int, int] | None = None  # (tx, rx) counters, all links
    processes: tuple[ProcessInfo, ...] = ()
    mig_mode: MigMode | None = None  # NotSupported on GPUs without MIG
    errors: tuple[tuple[str, BackendError], ...] = ()


READINGS: tuple[str, ...] = GpuReadings._fields[:-1]
"""The names of :class:`GpuReadings`' readings, in the order they are read."""


class EventKind(Enum):
    XID = "xid"
    ECC_DOUBLE_BIT = "ecc_double_bit"
    ECC_SINGLE_BIT = "ecc_single_bit"
    PSTATE = "pstate"
    CLOCK = "clock"


@dataclass(frozen=True, slots=True)
class GpuEvent:
    """One ``nvmlEventSetWait`` result."""

    gpu: int
    kind: EventKind
    xid: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    detail: dict[str, str] = field(default_factory=dict)


class GpuBackend(Protocol):
    """The driver as gpud sees it. See the module docstring for conventions."""

    def driver_version(self) -> str: ...

    def gpu_count(self) -> int: ...

    def identity(self, gpu: int) -> GpuIdentity: ...

    # readings: GPU or MIG device (mig=None: the whole GPU)
    def memory(self, gpu: int, mig: int | None = None) -> MemoryInfo: ...

    def processes(self, gpu: int, mig: int | None = None) -> list[ProcessInfo]: ...

    def gpu_readings(self, gpu: int, skip: Collection[str] = frozenset()) -> GpuReadings:
        """Every reading of :data:`READINGS` but those in ``skip``, each failing on its own
        (see :class:`GpuReadings`): the sampler's one call per GPU and tick. A lost GPU ends
        the call: :class:`gpud.errors.GpuLost` is the last of ``errors`` and every reading is
        empty. A GPU that needs an operator (:class:`gpud.errors.GpuFault`, reset required,
        ...) in a reading has every numeric reading empty, and its processes and MIG mode
        read still. Errors of the GPU as a whole (no such index) raise as from the other
        methods."""
        ...

    def mig_readings(self, gpu: int, devices: Sequence[MigDeviceIdentity]) -> MigReadings:
        """Memory and processes of ``devices`` (MIG devices of ``gpu``, by their ``mig``
        index), each device's handle resolved once: the sampler's one call per MIG GPU and
        tick. A device whose reads fail is read as empty (see :class:`MigReading`) with its
        error in ``errors``, and so is one whose index now holds another device (the driver
        numbers MIG devices among those that exist: one created or destroyed since
        ``devices`` were listed moves the others), never with that other's readings; a GPU that is lost or needs an operator raises (one of
        :data:`gpud.errors.READING_FAULTS`)."""
        ...

    # MIG
    def mig_mode(self, gpu: int) -> MigMode: ...

    def set_mig_mode(self, gpu: int, enabled: bool) -> MigMode: ...

    def mig_devices(self, gpu: int) -> list[MigDeviceIdentity]: ...

    def gpu_instance_profiles(self, gpu: int) -> list[GpuInstanceProfile]: ...

    def compute_instance_profiles(
        self, gpu: int, gpu_instance_profile_id: int
    ) -> list[ComputeInstanceProfile]: ...

    def gpu_instance_placements(
        self, gpu: int, gpu_instance_profile_id: int
    ) -> list[Placement]: ...

    def gpu_instances(self, gpu: int) -> list[GpuInstanceInfo]: ...

    def create_gpu_instance(
        self, gpu: int, gpu_instance_profile_id: int, placement: Placement
    ) -> GpuInstanceInfo: ...

    def destroy_gpu_instance(self, gpu: int, gpu_instance_id: int) -> None: ...

    def create_compute_instance(
        self, gpu: int, gpu_instance_id: int, compute_instance_profile_id: int
    ) -> ComputeInstanceInfo: ...

    def destroy_compute_instance(
        self, gpu: int, gpu_instance_id: int, compute_instance_id: int
    ) -> None: ...

    def reset_gpu(self, gpu: int) -> None:
        """``nvidia-smi --gpu-reset -i N``: a pending MIG mode becomes current, MIG instances
        are gone, volatile ECC counts are cleared, a lost GPU may come back. The driver
        refuses (:class:`gpud.errors.InUse`) while a process runs on the GPU; NotSupported
        where the backend cannot reset. Other calls must not run meanwhile (the backend lets
        go of its own driver handles for the reset)."""
        ...

    # events
    def wait_events(self, timeout_s: float) -> list[GpuEvent]: ...

    def xid_watched(self, gpu: int) -> bool:
        """Whether the GPU's XIDs reach :meth:`wait_events` (False where the driver gives
        no XID events for it)."""
        ...

    def close(self) -> None: ...
