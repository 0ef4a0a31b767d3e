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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

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


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    total_bytes: int
    used_bytes: int
    free_bytes: int


@dataclass(frozen=True, slots=True)
class Utilization:
    """``nvmlDeviceGetUtilizationRates``: percent of the last sample period, as ratios 0..1."""

    gpu_ratio: float
    memory_ratio: float


@dataclass(frozen=True, slots=True)
class Clocks:
    sm_mhz: int
    memory_mhz: int


@dataclass(frozen=True, slots=True)
class EccCounts:
    """Volatile ECC error counts since the driver loaded."""

    corrected: int
    uncorrected: int


@dataclass(frozen=True, slots=True)
class PcieThroughput:
    tx_bytes_per_second: float
    rx_bytes_per_second: float


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A compute process as ``nvmlDeviceGetComputeRunningProcesses`` lists it."""

    pid: int
    used_memory_bytes: int | None  # None where the driver does not say
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass(frozen=True, slots=True)
class MigMode:
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


@dataclass(frozen=True, slots=True)
class MigReading:
    """One MIG device's memory and compute processes, read together."""

    memory: MemoryInfo
    processes: tuple[ProcessInfo, ...]


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

    def mig_readings(self, gpu: int, migs: Sequence[int]) -> list[MigReading | BackendError]:
        """Memory and processes of MIG devices ``migs`` of ``gpu``, each device's handle
        resolved once. A device whose reads fail gets its error in its place; a lost GPU
        raises :class:`gpud.errors.GpuLost`."""
        ...

    def utilization(self, gpu: int) -> Utilization: ...  # NotSupported on MIG-enabled GPUs

    def power_watts(self, gpu: int) -> float: ...

    def temperature_celsius(self, gpu: int) -> float: ...

    def clocks(self, gpu: int) -> Clocks: ...

    def ecc_errors(self, gpu: int) -> EccCounts: ...

    def pcie_throughput(self, gpu: int) -> PcieThroughput: ...

    def nvlink_throughput_bytes(self, gpu: int) -> tuple[int, int]: ...  # (tx, rx) counters

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

    # events
    def wait_events(self, timeout_s: float) -> list[GpuEvent]: ...

    def close(self) -> None: ...
