"""A stand-in for the ``pynvml`` module that drives a simulated node.

``FakeNvml`` answers the pynvml calls gpud makes with the same function names, argument
order, error classes (``NVMLError`` and its ``NVMLError_*`` subclasses with pynvml's numeric
``.value``), constants and return shapes (objects with pynvml's struct field names). Calls
that fill caller-allocated arrays (``nvmlDeviceGetGpuInstancePossiblePlacements``,
``nvmlDeviceGetGpuInstances``, ``nvmlGpuInstanceGetComputeInstances``) take the same
arguments as pynvml: a ctypes array made from the module's own ``c_nvml*`` types (or None
to ask for the count) and ``ctypes.byref(c_uint())`` for the count.

What the driver would keep lives here: MIG mode (current and pending: on A100 a change
becomes current only at a GPU reset, :meth:`FakeNvml.sim_reset`, or a reboot,
:meth:`FakeNvml.sim_reboot`; on H100/H200 at once when no process holds the GPU, as the
product's ``mig_mode_needs_reset`` says), GPU and compute instances, running processes, and injected faults (a lost or slow GPU, one that requires a reset, or slow
MIG changes, are a state of the device, not of the process watching it). With a ``state_file`` the MIG state and the
faults are written there atomically after every change and read back at start, so a daemon
restart finds the instances and the faults as it left them (``nvidia-smi mig -lgi`` after
``systemctl restart gpud``).

NVLink counters are per link, as the driver keeps them: ``nvmlDeviceGetFieldValues``
answers ``NVML_FI_DEV_NVLINK_LINK_COUNT`` and the throughput fields
``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX`` for each link (``scopeId`` = link index; the
GPU's traffic is split over its links), an error for a link the GPU does not have, and
NotSupported for other fields. PCIe and NVLink carry what the processes on the GPU move
(:class:`LinkTraffic`; a process declared without it moves traffic in proportion to its SM
activity), PCIe capped at the product's link (``nvmlDeviceGetMaxPcieLinkGeneration`` /
``Width``). Deliberately not modelled: graphics processes, vGPU, clocks events.

The ``sim_*`` methods are the simulation's own controls (faults, workloads, reboot), used
by :mod:`gpud.backend.sim`; no NVML function starts with ``sim_``.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import math
import threading
import time
import uuid as uuidlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, Final, NamedTuple

from gpud.backend import products
from gpud.errors import (
    AlreadyExists,
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from gpud.files import write_atomically
from gpud.shared import format_number

MiB = 1024 * 1024

# ---------------------------------------------------------------------------------------
# Constants, with nvml.h / pynvml values.

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_CLOCK_VIDEO = 3
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_FI_DEV_NVLINK_LINK_COUNT = 91
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
NVML_VALUE_NOT_AVAILABLE_uint = 0xFFFFFFFF

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1

NVML_GPU_INSTANCE_PROFILE_1_SLICE = 0x0
NVML_GPU_INSTANCE_PROFILE_2_SLICE = 0x1
NVML_GPU_INSTANCE_PROFILE_3_SLICE = 0x2
NVML_GPU_INSTANCE_PROFILE_4_SLICE = 0x3
NVML_GPU_INSTANCE_PROFILE_7_SLICE = 0x4
NVML_GPU_INSTANCE_PROFILE_8_SLICE = 0x5
NVML_GPU_INSTANCE_PROFILE_6_SLICE = 0x6
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 = 0x7
NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1 = 0x8
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 = 0x9
NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX = 0xA
NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX = 0xB
NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX = 0xC
NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME = 0xD
NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME = 0xE
NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME = 0xF
NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME = 0x10
NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX = 0x11
NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12

NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE = 0x0
NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE = 0x1
NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE = 0x2
NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE = 0x3
NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE = 0x4
NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE = 0x5
NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE = 0x6
NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1 = 0x7
NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE_NVL = 0x8
NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 0x9
NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0x0

nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypePState = 0x4
nvmlEventTypeXidCriticalError = 0x8
nvmlEventTypeClock = 0x10
nvmlEventTypeNone = 0x0
nvmlEventTypeAll = 0x1F

_SUPPORTED_EVENTS = (
    nvmlEventTypeSingleBitEccError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypePState
    | nvmlEventTypeXidCriticalError
    | nvmlEventTypeClock
)

# ---------------------------------------------------------------------------------------
# Error classes, built like pynvml's: NVMLError(value) returns the matching subclass, and
# each subclass can be raised without arguments.

_ERROR_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_IN_USE: "In use by another client",
    NVML_ERROR_INSUFFICIENT_RESOURCES: "Insufficient Resources",
    NVML_ERROR_INVALID_STATE: "Invalid State",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """pynvml's base error: ``.value`` is the NVML return code."""

    _value_: ClassVar[int | None] = None
    _by_value: ClassVar[dict[int, type[NVMLError]]] = {}
    value: int

    def __new__(cls, value: int | None = None) -> NVMLError:
        klass = cls
        if cls._value_ is not None:
            value = cls._value_
        elif value is not None:
            klass = NVMLError._by_value.get(value, cls)
        obj = Exception.__new__(klass)
        obj.value = NVML_ERROR_UNKNOWN if value is None else value
        return obj

    def __init__(self, value: int | None = None) -> None:
        super().__init__(self.value)

    def __str__(self) -> str:
        return _ERROR_STRINGS.get(self.value, f"NVML Error with code {self.value}")


class NVMLError_Uninitialized(NVMLError):
    _value_ = NVML_ERROR_UNINITIALIZED


class NVMLError_InvalidArgument(NVMLError):
    _value_ = NVML_ERROR_INVALID_ARGUMENT


class NVMLError_NotSupported(NVMLError):
    _value_ = NVML_ERROR_NOT_SUPPORTED


class NVMLError_NoPermission(NVMLError):
    _value_ = NVML_ERROR_NO_PERMISSION


class NVMLError_AlreadyInitialized(NVMLError):
    _value_ = NVML_ERROR_ALREADY_INITIALIZED


class NVMLError_NotFound(NVMLError):
    _value_ = NVML_ERROR_NOT_FOUND


class NVMLError_InsufficientSize(NVMLError):
    _value_ = NVML_ERROR_INSUFFICIENT_SIZE


class NVMLError_DriverNotLoaded(NVMLError):
    _value_ = NVML_ERROR_DRIVER_NOT_LOADED


class NVMLError_Timeout(NVMLError):
    _value_ = NVML_ERROR_TIMEOUT


class NVMLError_LibraryNotFound(NVMLError):
    _value_ = NVML_ERROR_LIBRARY_NOT_FOUND


class NVMLError_FunctionNotFound(NVMLError):
    _value_ = NVML_ERROR_FUNCTION_NOT_FOUND


class NVMLError_GpuIsLost(NVMLError):
    _value_ = NVML_ERROR_GPU_IS_LOST


class NVMLError_InsufficientPower(NVMLError):
    _value_ = NVML_ERROR_INSUFFICIENT_POWER


class NVMLError_IrqIssue(NVMLError):
    _value_ = NVML_ERROR_IRQ_ISSUE


class NVMLError_CorruptedInforom(NVMLError):
    _value_ = NVML_ERROR_CORRUPTED_INFOROM


class NVMLError_ResetRequired(NVMLError):
    _value_ = NVML_ERROR_RESET_REQUIRED


class NVMLError_LibRmVersionMismatch(NVMLError):
    _value_ = NVML_ERROR_LIB_RM_VERSION_MISMATCH


class NVMLError_InUse(NVMLError):
    _value_ = NVML_ERROR_IN_USE


class NVMLError_NoData(NVMLError):
    _value_ = NVML_ERROR_NO_DATA


class NVMLError_InsufficientResources(NVMLError):
    _value_ = NVML_ERROR_INSUFFICIENT_RESOURCES


class NVMLError_InvalidState(NVMLError):
    _value_ = NVML_ERROR_INVALID_STATE


class NVMLError_Unknown(NVMLError):
    _value_ = NVML_ERROR_UNKNOWN


for _cls in NVMLError.__subclasses__():
    assert _cls._value_ is not None
    NVMLError._by_value[_cls._value_] = _cls


class SimulatedCrash(BaseException):
    """Raised by the simulated driver after an injected number of mutations.

    A BaseException so that no ``except Exception`` on the way up swallows it: it stands
    for the daemon dying right after the driver applied (and persisted) a change.
    """


# ---------------------------------------------------------------------------------------
# ctypes types callers allocate, as pynvml defines them. Instance handles are Python
# objects here, so their array element type is py_object.


class c_nvmlGpuInstancePlacement_t(ctypes.Structure):
    _fields_ = (("start", ctypes.c_uint), ("size", ctypes.c_uint))


class c_nvmlComputeInstancePlacement_t(ctypes.Structure):
    _fields_ = (("start", ctypes.c_uint), ("size", ctypes.c_uint))


c_nvmlDevice_t = ctypes.py_object
c_nvmlGpuInstance_t = ctypes.py_object
c_nvmlComputeInstance_t = ctypes.py_object


def _deref(ref: Any) -> Any:
    """The object behind ``byref(x)`` / ``pointer(x)`` / ``x``."""
    obj = getattr(ref, "_obj", None)
    if obj is not None:
        return obj
    contents = getattr(ref, "contents", None)
    return contents if contents is not None else ref


# ---------------------------------------------------------------------------------------
# Driver-side state.


@dataclass(slots=True)
class _Ci:
    id: int
    profile: products.CiProfileSpec
    start: int  # in the GPU instance's compute slices
    serial: int  # bumps on every creation: a recreated instance gets a new MIG UUID


@dataclass(slots=True)
class _Gi:
    id: int
    profile: products.GiProfileSpec
    start: int  # in memory slices
    cis: dict[int, _Ci] = field(default_factory=dict)

    @property
    def used_compute(self) -> set[int]:
        return {
            s for ci in self.cis.values() for s in range(ci.start, ci.start + ci.profile.slices)
        }


class LinkTraffic(NamedTuple):
    """What a simulated process moves over its GPU's links, in bytes/s: PCIe out of the GPU
    (NVML's TX) and into it (RX), NVLink sent and received."""

    pcie_tx: float = 0.0
    pcie_rx: float = 0.0
    nvlink_tx: float = 0.0
    nvlink_rx: float = 0.0


# A process declared without its traffic moves this much at full SM activity, in
# proportion to its activity: bulk copies both ways, and the GPU's peers over NVLink.
PCIE_TX_AT_FULL_LOAD = 9_000_000 * 1024.0
PCIE_RX_AT_FULL_LOAD = 7_000_000 * 1024.0
NVLINK_SHARE_AT_FULL_LOAD = 0.4  # of the product's NVLink bandwidth; RX 0.9 of TX


@dataclass(slots=True)
class _Proc:
    pid: int
    gpu: int
    gi: int | None
    ci: int | None
    used_bytes: int
    sm_ratio: float
    traffic: LinkTraffic | None = None  # None: in proportion to its SM activity
    # the operator's (`gpuctl sim workload start`): kept in the state file, so that it
    # outlives gpud as a CUDA process does; a workload model's is started again each tick
    declared: bool = False
    # the host process a declared PID was when declared (its start time in /proc, in clock
    # ticks since boot), or None: no such host process then (a made-up PID), and nothing
    # ends it but a stop or a reboot
    host: int | None = None


def _mig_device_required(gpu: int, devices: int) -> InvalidArgument:
    """The refusal of a process started on a GPU in MIG mode with no MIG device named: a
    CUDA process runs on one of its MIG devices there, never on the GPU as a whole."""
    if not devices:
        return InvalidArgument(
            f"GPU {gpu} is in MIG mode and has no MIG devices: no process runs on it until a"
            " MIG apply creates some",
            field="mig",
        )
    span = "0" if devices == 1 else f"0..{devices - 1}"
    return InvalidArgument(
        f"GPU {gpu} is in MIG mode: a process runs on one of its MIG devices; name one:"
        f" a MIG device index, {span}, or its MIG UUID",
        field="mig",
    )


# What the driver still answers for a GPU that requires a reset: what it learnt when it
# probed the GPU (``nvidia-smi -L`` still lists it). Every other query answers
# NVML_ERROR_RESET_REQUIRED.
_KEPT_WHILE_RESET_REQUIRED: Final = frozenset({"handle", "uuid", "name", "index", "pci"})


class _GpuFaults:
    __slots__ = ("errors", "lost", "not_supported", "reset_required", "slow_mig_s", "slow_s")

    def __init__(self) -> None:
        self.lost = False
        self.reset_required = False
        self.not_supported: set[str] = set()
        self.errors: set[str] = set()  # readings that fail with NVML_ERROR_UNKNOWN
        self.slow_s = 0.0
        self.slow_mig_s = 0.0  # added to each call that changes MIG; reads stay fast


class _Gpu:
    """A GPU handle (what ``nvmlDeviceGetHandleByIndex`` returns) and its driver state."""

    __slots__ = (
        "bus_id",
        "ecc_corrected",
        "ecc_uncorrected",
        "gis",
        "index",
        "load",
        "mig_current",
        "mig_handles",
        "mig_pending",
        "nvlink_last",
        "nvlink_rx_kib",
        "nvlink_tx_kib",
        "procs",
        "serial",
        "spec",
        "traffic",
        "used_bytes",
        "uuid",
    )

    def __init__(self, index: int, spec: products.ProductSpec, uuid: str, bus_id: str) -> None:
        self.index = index
        self.spec = spec
        self.uuid = uuid
        self.bus_id = bus_id
        self.mig_current = False
        self.mig_pending = False
        self.gis: dict[int, _Gi] = {}
        self.serial = 0
        self.procs: list[_Proc] = []
        self.used_bytes = 0
        self.load = 0.0
        self.traffic = LinkTraffic()  # the sum over its processes
        self.ecc_corrected = 0
        self.ecc_uncorrected = 0
        self.nvlink_tx_kib = 0.0
        self.nvlink_rx_kib = 0.0
        self.nvlink_last: float | None = None
        self.mig_handles: dict[tuple[int, int, int], _MigDevice] = {}

    def __repr__(self) -> str:
        return f"<sim GPU {self.index} {self.spec.key}>"


class _MigDevice:
    """A MIG device handle: one compute instance seen as a device."""

    __slots__ = ("ci", "gi", "gpu", "serial", "uuid")

    def __init__(self, gpu: _Gpu, gi: int, ci: int, serial: int, uuid: str) -> None:
        self.gpu = gpu
        self.gi = gi
        self.ci = ci
        self.serial = serial
        self.uuid = uuid

    def __repr__(self) -> str:
        return f"<sim MIG device {self.uuid}>"


class _GiHandle:
    __slots__ = ("gpu", "id")

    def __init__(self, gpu: _Gpu, gi_id: int) -> None:
        self.gpu = gpu
        self.id = gi_id


class _CiHandle:
    __slots__ = ("gi", "gpu", "id")

    def __init__(self, gpu: _Gpu, gi_id: int, ci_id: int) -> None:
        self.gpu = gpu
        self.gi = gi_id
        self.id = ci_id


class _EventSet:
    __slots__ = ("cond", "queue", "registered")

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queue: deque[SimpleNamespace] = deque()
        self.registered: dict[int, int] = {}  # gpu index -> event type mask


def _gi_id_for(start: int, size: int) -> int:
    """GPU instance id for a placement, numbered as the driver does (a buddy tree).

    7g is 0, the halves 1-2, the quarters 3-6, the eighths 7-14: ``nvidia-smi mig -cgi
    19,19,19,19,19,19,19`` creates GPU instances 7..13.
    """
    return {8: 0, 4: 1 + start // 4, 2: 3 + start // 2, 1: 7 + start}[size]


def _stable_uuid(*parts: object) -> str:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return str(uuidlib.UUID(bytes=digest[:16], version=4))


_BUS_NUMBERS = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)  # an HGX 8-GPU board


class FakeNvml:
    """The simulated driver, shaped like the ``pynvml`` module. See the module docstring."""

    def __init__(
        self,
        gpus: Sequence[products.ProductSpec],
        *,
        state_file: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        seed: int = 0,
        driver_version: str = "550.90.07",
    ) -> None:
        self._clock = clock
        self._sleep = sleep  # how an injected slow call hangs, as the driver's ioctl would
        self._state_file = state_file
        self._driver_version = driver_version
        self._driver_major = int(driver_version.split(".", maxsplit=1)[0])
        self._lock = threading.RLock()
        self._initialized = 0
        self._faults: dict[int, _GpuFaults] = {}
        self._crash_after: int | None = None
        self._event_sets: list[_EventSet] = []
        # (pid, GPU): a process with contexts on several GPUs is listed on each, as by NVML
        self._procs: dict[tuple[int, int], _Proc] = {}
        self._gpus: list[_Gpu] = []
        for i, spec in enumerate(gpus):
            bus = _BUS_NUMBERS[i] if i < len(_BUS_NUMBERS) else 0x100 + i
            bus_id = (
                f"00000000:{bus:02X}:00.0"
                if bus < 0x100
                else f"{bus >> 8:08X}:{bus & 0xFF:02X}:00.0"
            )
            uuid = "GPU-" + _stable_uuid("gpu", seed, i, spec.key)
            self._gpus.append(_Gpu(i, spec, uuid, bus_id))
        self._by_uuid = {g.uuid: g for g in self._gpus}
        if state_file is not None and state_file.exists():
            self._load(state_file)

    # -- persistence ---------------------------------------------------------------------

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
            saved = [g["product"] for g in data["gpus"]]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(
                f"simulated device state is unreadable: {err}", path=str(path)
            ) from err
        spec = [g.spec.key for g in self._gpus]
        if saved != spec:
            raise ConfigError(
                f"simulated device state is for GPUs {saved}, but the node is {spec}; "
                "remove the file or simulate the same GPUs",
                path=str(path),
            )
        try:
            for gpu, g in zip(self._gpus, data["gpus"], strict=True):
                gpu.mig_current = bool(g["mig_current"])
                gpu.mig_pending = bool(g["mig_pending"])
                gpu.serial = int(g["serial"])
                for gi_d in g["gpu_instances"]:
                    gi_prof = gpu.spec.gi_profile_by_id(int(gi_d["profile_id"]))
                    if gi_prof is None:
                        raise ValueError(f"unknown GPU instance profile {gi_d['profile_id']}")
                    gi = _Gi(int(gi_d["id"]), gi_prof, int(gi_d["start"]))
                    ci_profiles = {c.constant: c for c in gpu.spec.ci_profiles(gi_prof)}
                    for ci_d in gi_d["compute_instances"]:
                        ci_prof = ci_profiles[int(ci_d["profile_id"])]
                        gi.cis[int(ci_d["id"])] = _Ci(
                            int(ci_d["id"]), ci_prof, int(ci_d["start"]), int(ci_d["serial"])
                        )
                    gpu.gis[gi.id] = gi
            for key, f_d in data.get("faults", {}).items():
                f = _GpuFaults()
                f.lost = bool(f_d.get("lost", False))
                f.reset_required = bool(f_d.get("reset_required", False))
                f.not_supported = {str(x) for x in f_d.get("not_supported", ())}
                f.errors = {str(x) for x in f_d.get("errors", ())}
                f.slow_s = float(f_d.get("slow_s", 0.0))
                f.slow_mig_s = float(f_d.get("slow_mig_s", 0.0))
                self._faults[int(key)] = f
            for p_d in data.get("processes", ()):
                self._restore_process(p_d)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(
                f"simulated device state is invalid: {err!r}", path=str(path)
            ) from err

    def _restore_process(self, p_d: Mapping[str, Any]) -> None:
        """A declared process of the state file, on its GPU (and GPU and compute instance,
        which the file restored before it); one whose instance is gone is gone too."""
        index = int(p_d["gpu"])
        if not 0 <= index < len(self._gpus):
            raise ValueError(f"process {p_d['pid']}: no GPU {index}")
        gpu = self._gpus[index]
        gi, ci = p_d.get("gi"), p_d.get("ci")
        host = p_d.get("host")
        proc = _Proc(
            int(p_d["pid"]),
            index,
            None if gi is None else int(gi),
            None if ci is None else int(ci),
            int(p_d["used_bytes"]),
            float(p_d["sm_ratio"]),
            declared=True,
            host=None if host is None else int(host),
        )
        if proc.gi is not None and (proc.gi not in gpu.gis or proc.ci not in gpu.gis[proc.gi].cis):
            return
        self._procs[(proc.pid, index)] = proc
        gpu.procs = [*gpu.procs, proc]
        self._recompute(gpu)

    def _persist(self) -> None:
        path = self._state_file
        if path is None:
            return
        data = {
            "version": 1,
            "gpus": [
                {
                    "product": g.spec.key,
                    "uuid": g.uuid,
                    "mig_current": g.mig_current,
                    "mig_pending": g.mig_pending,
                    "serial": g.serial,
                    "gpu_instances": [
                        {
                            "id": gi.id,
                            "profile_id": gi.profile.id,
                            "start": gi.start,
                            "compute_instances": [
                                {
                                    "id": ci.id,
                                    "profile_id": ci.profile.constant,
                                    "start": ci.start,
                                    "serial": ci.serial,
                                }
                                for ci in sorted(gi.cis.values(), key=lambda c: c.id)
                            ],
                        }
                        for gi in sorted(g.gis.values(), key=lambda x: x.id)
                    ],
                }
                for g in self._gpus
            ],
            "faults": {
                str(i): {
                    "lost": f.lost,
                    "reset_required": f.reset_required,
                    "not_supported": sorted(f.not_supported),
                    "errors": sorted(f.errors),
                    "slow_s": f.slow_s,
                    "slow_mig_s": f.slow_mig_s,
                }
                for i, f in sorted(self._faults.items())
                if f.lost
                or f.reset_required
                or f.not_supported
                or f.errors
                or f.slow_s
                or f.slow_mig_s
            },
            "processes": [
                {
                    "pid": p.pid,
                    "gpu": p.gpu,
                    "gi": p.gi,
                    "ci": p.ci,
                    "used_bytes": p.used_bytes,
                    "sm_ratio": p.sm_ratio,
                    "host": p.host,
                }
                for _, p in sorted(self._procs.items())
                if p.declared
            ],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(data, indent=1))

    def _mutated(self) -> None:
        """After a mutation took effect: persist, then maybe die as injected."""
        self._persist()
        if self._crash_after is not None:
            self._crash_after -= 1
            if self._crash_after <= 0:
                self._crash_after = None
                raise SimulatedCrash("simulated crash after a driver mutation")

    # -- common checks -------------------------------------------------------------------

    def _check(self, gpu: _Gpu, what: str) -> None:
        if not self._initialized:
            raise NVMLError_Uninitialized()
        f = self._faults.get(gpu.index)
        if f is None:
            return
        if f.slow_s:
            self._sleep(f.slow_s)  # a driver call that hangs for a while
        if f.lost:
            raise NVMLError_GpuIsLost()
        if f.reset_required and what not in _KEPT_WHILE_RESET_REQUIRED:
            raise NVMLError(NVML_ERROR_RESET_REQUIRED)
        if what in f.not_supported:
            raise NVMLError_NotSupported()

    def _slow_mig(self, gpu: _Gpu) -> None:
        """A call that changes MIG (``nvidia-smi mig -cgi/-dgi/-cci/-dci``, ``-mig``) takes
        its injected time, outside the lock: reads of the GPU meanwhile answer at once."""
        f = self._faults.get(gpu.index)
        if f is not None and f.slow_mig_s:
            self._sleep(f.slow_mig_s)

    def _gpu(self, handle: object, what: str) -> _Gpu:
        """A whole-GPU handle; MIG device handles are NotSupported for ``what``."""
        if isinstance(handle, _Gpu):
            self._check(handle, what)
            return handle
        if isinstance(handle, _MigDevice):
            self._check(handle.gpu, what)
            raise NVMLError_NotSupported()
        raise NVMLError_InvalidArgument()

    def _any(self, handle: object, what: str) -> tuple[_Gpu, _MigDevice | None]:
        if isinstance(handle, _Gpu):
            self._check(handle, what)
            return handle, None
        if isinstance(handle, _MigDevice):
            gpu = handle.gpu
            self._check(gpu, what)
            gi = gpu.gis.get(handle.gi)
            ci = gi.cis.get(handle.ci) if gi is not None else None
            if ci is None or ci.serial != handle.serial or not gpu.mig_current:
                raise NVMLError_InvalidArgument()  # the instance behind it is gone
            return gpu, handle
        raise NVMLError_InvalidArgument()

    def _gi(self, handle: object) -> tuple[_Gpu, _Gi]:
        if not isinstance(handle, _GiHandle):
            raise NVMLError_InvalidArgument()
        self._check(handle.gpu, "mig")
        gi = handle.gpu.gis.get(handle.id)
        if gi is None:
            raise NVMLError_InvalidArgument()
        return handle.gpu, gi

    def _noise(self, gpu: _Gpu, salt: float) -> float:
        """Small deterministic wobble in -1..1 from the clock, so readings look alive."""
        return math.sin(self._clock() * 0.7 + gpu.index * 1.3 + salt)

    # -- init / system -------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._initialized += 1

    def nvmlInitWithFlags(self, flags: int) -> None:
        self._initialized += 1

    def nvmlShutdown(self) -> None:
        if not self._initialized:
            raise NVMLError_Uninitialized()
        self._initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        if not self._initialized:
            raise NVMLError_Uninitialized()
        return self._driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        return "12." + self._driver_version

    def nvmlDeviceGetCount(self) -> int:
        if not self._initialized:
            raise NVMLError_Uninitialized()
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Gpu:
        if not self._initialized:
            raise NVMLError_Uninitialized()
        if not 0 <= index < len(self._gpus):
            raise NVMLError_InvalidArgument()
        gpu = self._gpus[index]
        f = self._faults.get(index)
        if f is not None and f.slow_s:
            self._sleep(f.slow_s)
        # A lost GPU still has a handle: the first query on it answers GPU_IS_LOST, as the
        # real driver does (``nvmlDeviceGetUUID failed on GPU 2: GPU is lost``).
        return gpu

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Gpu | _MigDevice:
        if not self._initialized:
            raise NVMLError_Uninitialized()
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        gpu = self._by_uuid.get(text)
        if gpu is not None:
            self._check(gpu, "handle")
            return gpu
        for g in self._gpus:
            with self._lock:
                migs = self._mig_list(g)
            for mig in migs:
                if mig.uuid == text:
                    self._check(g, "handle")
                    return mig
        raise NVMLError_NotFound()

    # -- identity ------------------------------------------------------------------------

    def nvmlDeviceGetName(self, handle: object) -> str:
        gpu, mig = self._any(handle, "name")
        if mig is None:
            return gpu.spec.nvml_name
        return f"{gpu.spec.nvml_name} MIG {self._mig_profile_name(gpu, mig)}"

    def nvmlDeviceGetUUID(self, handle: object) -> str:
        gpu, mig = self._any(handle, "uuid")
        return gpu.uuid if mig is None else mig.uuid

    def nvmlDeviceGetIndex(self, handle: object) -> int:
        return self._gpu(handle, "index").index

    def nvmlDeviceGetPciInfo(self, handle: object) -> SimpleNamespace:
        gpu = self._gpu(handle, "pci")
        bus = int(gpu.bus_id.split(":")[1], 16)
        return SimpleNamespace(
            busIdLegacy=gpu.bus_id.encode(),
            busId=gpu.bus_id.encode(),  # bytes, as in pynvml's struct
            domain=0,
            bus=bus,
            device=0,
            pciDeviceId=gpu.spec.pci_device_id,
            pciSubSystemId=0x16C110DE,
        )

    nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo

    # -- readings ------------------------------------------------------------------------

    def nvmlDeviceGetMemoryInfo(
        self, handle: object, version: int | None = None
    ) -> SimpleNamespace:
        gpu, mig = self._any(handle, "memory")
        if mig is not None:
            f = self._faults.get(gpu.index)
            if f is not None and "mig_memory" in f.errors:
                raise NVMLError_Unknown()  # this one query fails; the device answers others
        total, reserved, used = self._memory(gpu, None if mig is None else mig.gi)
        if version:
            return SimpleNamespace(
                version=version, total=total, reserved=reserved, free=total - used, used=used
            )
        return SimpleNamespace(total=total, free=total - used, used=used)

    nvmlDeviceGetMemoryInfo_v2 = nvmlDeviceGetMemoryInfo

    @staticmethod
    def _memory(gpu: _Gpu, gi: int | None) -> tuple[int, int, int]:
        """(total, reserved, used) bytes of the GPU, or of its GPU instance ``gi``."""
        if gi is None:
            total = gpu.spec.memory_mib * MiB
            reserved = gpu.spec.reserved_mib * MiB
            if gpu.mig_current:
                reserved += len(gpu.gis) * 13 * MiB  # each GPU instance's own bookkeeping
            return total, reserved, min(total, gpu.used_bytes + reserved)
        total = gpu.gis[gi].profile.memory_mib * MiB
        reserved = 13 * MiB
        held = sum(p.used_bytes for p in gpu.procs if p.gi == gi)
        return total, reserved, min(total, reserved + held)

    def nvmlDeviceGetUtilizationRates(self, handle: object) -> SimpleNamespace:
        gpu = self._gpu(handle, "utilization")
        if gpu.mig_current:
            raise NVMLError_NotSupported()  # as on a real MIG-enabled A100/H100
        if gpu.load <= 0.0:
            return SimpleNamespace(gpu=0, memory=0)
        util = min(100, max(1, round(100 * min(1.0, gpu.load) - 2 + 2 * self._noise(gpu, 0.0))))
        return SimpleNamespace(gpu=util, memory=min(100, round(util * 0.55)))

    def nvmlDeviceGetPowerUsage(self, handle: object) -> int:
        gpu = self._gpu(handle, "power")
        spec = gpu.spec
        load = min(1.0, gpu.load)
        watts = spec.power_idle_w + (spec.power_limit_w - spec.power_idle_w) * 0.92 * load
        return int((watts + 1.5 * self._noise(gpu, 1.0)) * 1000)  # mW

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: object) -> int:
        return self._gpu(handle, "power").spec.power_limit_w * 1000

    def nvmlDeviceGetTemperature(self, handle: object, sensor: int) -> int:
        gpu = self._gpu(handle, "temperature")
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError_InvalidArgument()
        return round(31 + 42 * min(1.0, gpu.load) + 0.6 * self._noise(gpu, 2.0))

    def nvmlDeviceGetClockInfo(self, handle: object, type: int) -> int:
        gpu = self._gpu(handle, "clocks")
        spec = gpu.spec
        if type in (NVML_CLOCK_SM, NVML_CLOCK_GRAPHICS):
            if gpu.load <= 0.0:
                return spec.sm_clock_idle_mhz
            # boost falls off a little under full load (power/thermal headroom)
            return int(spec.sm_clock_max_mhz - 120 * min(1.0, gpu.load))
        if type == NVML_CLOCK_MEM:
            return spec.mem_clock_mhz
        if type == NVML_CLOCK_VIDEO:
            return 1000
        raise NVMLError_InvalidArgument()

    def nvmlDeviceGetTotalEccErrors(self, handle: object, errorType: int, counterType: int) -> int:
        gpu = self._gpu(handle, "ecc")
        if errorType == NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return gpu.ecc_corrected
        if errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return gpu.ecc_uncorrected
        raise NVMLError_InvalidArgument()

    def nvmlDeviceGetPcieThroughput(self, device: object, counter: int) -> int:
        gpu = self._gpu(device, "pcie")
        if counter not in (NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES):
            raise NVMLError_InvalidArgument()
        t = gpu.traffic
        moved = t.pcie_tx if counter == NVML_PCIE_UTIL_TX_BYTES else t.pcie_rx
        capacity = products.pcie_bytes_per_second(gpu.spec.pcie_gen, gpu.spec.pcie_lanes) or 0.0
        kb = min(moved, capacity) / 1024  # KB/s, 1 KB = 1024 B, as NVML counts
        # the driver's own chatter (doorbells, interrupts, telemetry) on an idle link
        return max(0, int(kb + 20_000 + 15_000 * self._noise(gpu, 3.0 + counter)))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, device: object) -> int:
        return self._gpu(device, "pcie").spec.pcie_gen

    def nvmlDeviceGetMaxPcieLinkWidth(self, device: object) -> int:
        return self._gpu(device, "pcie").spec.pcie_lanes

    def nvmlDeviceGetFieldValues(
        self, handle: object, fieldIds: Sequence[int]
    ) -> list[SimpleNamespace]:
        gpu = self._gpu(handle, "nvlink")
        now = self._clock()
        with self._lock:
            if gpu.nvlink_last is not None and now > gpu.nvlink_last:
                # the counters integrate the processes' traffic (KiB), at most the links'
                cap = gpu.spec.nvlink_gbps * 1e9
                dt = now - gpu.nvlink_last
                gpu.nvlink_tx_kib += min(cap, gpu.traffic.nvlink_tx) / 1024 * dt
                gpu.nvlink_rx_kib += min(cap, gpu.traffic.nvlink_rx) / 1024 * dt
            gpu.nvlink_last = now
            tx, rx = int(gpu.nvlink_tx_kib), int(gpu.nvlink_rx_kib)
        links = gpu.spec.nvlink_links
        out = []
        for item in fieldIds:
            fid, scope = item if isinstance(item, tuple) else (item, 0)
            value: int | None = None
            ret = NVML_ERROR_NOT_SUPPORTED
            vtype = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            if fid == NVML_FI_DEV_NVLINK_LINK_COUNT:
                value, ret, vtype = links, NVML_SUCCESS, NVML_VALUE_TYPE_UNSIGNED_INT
            elif fid in (
                NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
            ):
                if 0 <= scope < links:
                    total = tx if fid == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX else rx
                    # An even split, the remainder on link 0: the links sum to the total.
                    value = total // links + (total % links if scope == 0 else 0)
                    ret = NVML_SUCCESS
                else:
                    ret = NVML_ERROR_INVALID_ARGUMENT
            out.append(
                SimpleNamespace(
                    fieldId=fid,
                    scopeId=scope,
                    timestamp=int(now * 1e6),
                    latencyUsec=0,
                    valueType=vtype,
                    nvmlReturn=ret,
                    value=SimpleNamespace(ullVal=value or 0, uiVal=value or 0),
                )
            )
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> list[SimpleNamespace]:
        """pynvml's call, which goes to ``nvmlDeviceGetComputeRunningProcesses_v3``: a driver
        older than R510 has no such entry point, and pynvml raises FunctionNotFound."""
        if self._driver_major < 510:
            raise NVMLError_FunctionNotFound()
        return self.nvmlDeviceGetComputeRunningProcesses_v2(handle)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: object) -> list[SimpleNamespace]:
        gpu, mig = self._any(handle, "processes")
        na = NVML_VALUE_NOT_AVAILABLE_uint
        f = self._faults.get(gpu.index)
        # pynvml turns NVML_VALUE_NOT_AVAILABLE_ulonglong into None
        hidden = f is not None and "process_memory" in f.not_supported
        return [
            SimpleNamespace(
                pid=p.pid,
                usedGpuMemory=None if hidden else p.used_bytes,
                gpuInstanceId=na if p.gi is None else p.gi,
                computeInstanceId=na if p.ci is None else p.ci,
            )
            for p in gpu.procs
            if mig is None or (p.gi == mig.gi and p.ci == mig.ci)
        ]

    nvmlDeviceGetComputeRunningProcesses_v3 = nvmlDeviceGetComputeRunningProcesses

    # -- MIG mode --------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, device: object) -> list[int]:
        gpu = self._gpu(device, "mig")
        if not gpu.spec.mig_capable:
            raise NVMLError_NotSupported()
        return [int(gpu.mig_current), int(gpu.mig_pending)]

    def nvmlDeviceSetMigMode(self, device: object, mode: int) -> int:
        """Sets the *pending* mode; returns the activation status, as pynvml does.

        On A100 (``mig_mode_needs_reset``) the change needs a GPU reset (or reboot) to become
        current, so the activation status is ``NVML_ERROR_RESET_REQUIRED`` until
        :meth:`sim_reset` or :meth:`sim_reboot`. Hopper and later switch at once when no
        process holds the GPU; with one running the change stays pending, as on A100.
        """
        gpu = self._gpu(device, "mig")
        if not gpu.spec.mig_capable:
            raise NVMLError_NotSupported()
        if mode not in (NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_ENABLE):
            raise NVMLError_InvalidArgument()
        self._slow_mig(gpu)
        with self._lock:
            if mode == NVML_DEVICE_MIG_DISABLE and gpu.gis:
                raise NVMLError_InUse()  # instances still exist: destroy them first
            gpu.mig_pending = mode == NVML_DEVICE_MIG_ENABLE
            if not gpu.spec.mig_mode_needs_reset and not gpu.procs:
                gpu.mig_current = gpu.mig_pending
            status = (
                NVML_SUCCESS if gpu.mig_pending == gpu.mig_current else NVML_ERROR_RESET_REQUIRED
            )
            self._mutated()
        return status

    # -- GPU instances ----------------------------------------------------------------------

    def _mig_gpu(self, device: object) -> _Gpu:
        gpu = self._gpu(device, "mig")
        if not gpu.spec.mig_capable or not gpu.mig_current:
            raise NVMLError_NotSupported()  # NVML: "device doesn't have MIG mode enabled"
        return gpu

    def _mig_capable_gpu(self, device: object) -> _Gpu:
        """The profile tables: the 580-series driver answers them with MIG mode off too."""
        gpu = self._gpu(device, "mig")
        if not gpu.spec.mig_capable:
            raise NVMLError_NotSupported()
        return gpu

    def _gi_profile(self, gpu: _Gpu, profile_id: int) -> products.GiProfileSpec:
        prof = gpu.spec.gi_profile_by_id(profile_id)
        if prof is None:
            raise NVMLError_InvalidArgument()
        return prof

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: object, profile: int, version: int = 2
    ) -> SimpleNamespace:
        gpu = self._mig_capable_gpu(device)
        if not 0 <= profile < NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise NVMLError_InvalidArgument()
        prof = gpu.spec.gi_profile_by_constant(profile)
        if prof is None:
            raise NVMLError_NotSupported()
        return SimpleNamespace(
            version=0x02000098 if version == 2 else 0,
            id=prof.id,
            isP2pSupported=0,
            sliceCount=prof.slices,
            instanceCount=prof.instance_count,
            multiprocessorCount=prof.sm,
            copyEngineCount=prof.copy_engines,
            decoderCount=prof.decoders,
            encoderCount=prof.encoders,
            jpegCount=prof.jpegs,
            ofaCount=prof.ofas,
            memorySizeMB=prof.memory_mib,
            name=f"MIG {prof.name}".encode(),
        )

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: object, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        gpu = self._mig_capable_gpu(device)
        prof = self._gi_profile(gpu, profileId)
        count = _deref(countRef)
        if placementsRef is not None:
            if len(placementsRef) < len(prof.starts):
                raise NVMLError_InsufficientSize()
            for i, (start, size) in enumerate(prof.placements):
                placementsRef[i].start = start
                placementsRef[i].size = size
        count.value = len(prof.starts)
        return NVML_SUCCESS

    nvmlDeviceGetGpuInstancePossiblePlacements_v2 = nvmlDeviceGetGpuInstancePossiblePlacements

    def _free_placements(self, gpu: _Gpu, prof: products.GiProfileSpec) -> list[int]:
        """Starts where ``prof`` fits now (memory slices free, compute and count left)."""
        used_mem = {
            s
            for gi in gpu.gis.values()
            for s in range(gi.start, gi.start + gi.profile.memory_slices)
        }
        used_compute = sum(gi.profile.slices for gi in gpu.gis.values())
        # The one "+me" instance takes the media engines: 1g+me and 7g need them all.
        same = sum(1 for gi in gpu.gis.values() if gi.profile.id == prof.id)
        if same >= prof.instance_count or used_compute + prof.slices > products.COMPUTE_SLICES:
            return []
        return [
            s for s in prof.starts if not used_mem.intersection(range(s, s + prof.memory_slices))
        ]

    def _remaining(self, gpu: _Gpu, prof: products.GiProfileSpec) -> int:
        used_mem = {
            s
            for gi in gpu.gis.values()
            for s in range(gi.start, gi.start + gi.profile.memory_slices)
        }
        compute_left = products.COMPUTE_SLICES - sum(gi.profile.slices for gi in gpu.gis.values())
        count_left = prof.instance_count - sum(
            1 for gi in gpu.gis.values() if gi.profile.id == prof.id
        )
        n = 0
        for s in prof.starts:  # starts are ascending and same-sized: first fit is optimal
            span = set(range(s, s + prof.memory_slices))
            if span & used_mem:
                continue
            used_mem |= span
            n += 1
        return max(0, min(n, count_left, compute_left // prof.slices))

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: object, profileId: int) -> int:
        gpu = self._mig_gpu(device)
        prof = self._gi_profile(gpu, profileId)
        with self._lock:
            return self._remaining(gpu, prof)

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: object, profileId: int, placement: Any
    ) -> _GiHandle:
        gpu = self._mig_gpu(device)
        prof = self._gi_profile(gpu, profileId)
        pl = _deref(placement)
        start, size = int(pl.start), int(pl.size)
        if (start, size) not in prof.placements:
            raise NVMLError_InvalidArgument()
        self._slow_mig(gpu)
        with self._lock:
            if start not in self._free_placements(gpu, prof):
                raise NVMLError_InsufficientResources()
            gi = _Gi(_gi_id_for(start, size), prof, start)
            gpu.gis[gi.id] = gi
            handle = _GiHandle(gpu, gi.id)
            self._mutated()
        return handle

    def nvmlDeviceCreateGpuInstance(self, device: object, profileId: int) -> _GiHandle:
        gpu = self._mig_gpu(device)
        prof = self._gi_profile(gpu, profileId)
        with self._lock:
            free = self._free_placements(gpu, prof)
            if not free:
                raise NVMLError_InsufficientResources()
            placement = c_nvmlGpuInstancePlacement_t(free[-1], prof.memory_slices)
        return self.nvmlDeviceCreateGpuInstanceWithPlacement(device, profileId, placement)

    def nvmlDeviceGetGpuInstances(
        self, device: object, profileId: int, gpuInstancesRef: Any, countRef: Any
    ) -> int:
        gpu = self._mig_gpu(device)
        self._gi_profile(gpu, profileId)
        count = _deref(countRef)
        with self._lock:
            ids = sorted(gi.id for gi in gpu.gis.values() if gi.profile.id == profileId)
        if gpuInstancesRef is not None:
            if len(gpuInstancesRef) < len(ids):
                raise NVMLError_InsufficientSize()
            for i, gi_id in enumerate(ids):
                gpuInstancesRef[i] = _GiHandle(gpu, gi_id)
        count.value = len(ids)
        return NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceById(self, device: object, gpuInstanceId: int) -> _GiHandle:
        gpu = self._mig_gpu(device)
        if gpuInstanceId not in gpu.gis:
            raise NVMLError_NotFound()
        return _GiHandle(gpu, gpuInstanceId)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: object) -> SimpleNamespace:
        gpu, gi = self._gi(gpuInstance)
        return SimpleNamespace(
            device=gpu,
            id=gi.id,
            profileId=gi.profile.id,
            placement=SimpleNamespace(start=gi.start, size=gi.profile.memory_slices),
        )

    def nvmlGpuInstanceDestroy(self, gpuInstance: object) -> int:
        gpu, gi = self._gi(gpuInstance)
        self._slow_mig(gpu)
        with self._lock:
            if gi.cis:
                raise NVMLError_InUse()  # compute instances first (nvidia-smi mig -dci)
            del gpu.gis[gi.id]
            self._mutated()
        return NVML_SUCCESS

    # -- compute instances ------------------------------------------------------------------

    def _ci_profile(self, gpu: _Gpu, gi: _Gi, profile: int) -> products.CiProfileSpec:
        if not 0 <= profile < NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise NVMLError_InvalidArgument()
        for c in gpu.spec.ci_profiles(gi.profile):
            if c.constant == profile:
                return c
        raise NVMLError_NotSupported()

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: object, profile: int, engProfile: int, version: int = 2
    ) -> SimpleNamespace:
        gpu, gi = self._gi(device)
        if engProfile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise NVMLError_InvalidArgument()
        c = self._ci_profile(gpu, gi, profile)
        share = c.slices / gi.profile.slices
        return SimpleNamespace(
            version=0x02000088 if version == 2 else 0,
            id=c.constant,
            sliceCount=c.slices,
            instanceCount=c.instance_count,
            multiprocessorCount=c.sm,
            sharedCopyEngineCount=gi.profile.copy_engines,
            sharedDecoderCount=gi.profile.decoders,
            sharedEncoderCount=gi.profile.encoders,
            sharedJpegCount=gi.profile.jpegs if share == 1 else 0,
            sharedOfaCount=gi.profile.ofas if share == 1 else 0,
            name=f"MIG {c.name}".encode(),
        )

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    def _ci_free_starts(self, gi: _Gi, c: products.CiProfileSpec) -> list[int]:
        used = gi.used_compute
        return [
            s
            for s in products.CI_STARTS[c.slices]
            if s + c.slices <= gi.profile.slices and not used.intersection(range(s, s + c.slices))
        ]

    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
        self, gpuInstance: object, profileId: int
    ) -> int:
        gpu, gi = self._gi(gpuInstance)
        c = self._ci_profile(gpu, gi, profileId)
        with self._lock:
            used = set(gi.used_compute)
            n = 0
            for s in products.CI_STARTS[c.slices]:
                span = set(range(s, s + c.slices))
                if s + c.slices <= gi.profile.slices and not span & used:
                    used |= span
                    n += 1
            return n

    def nvmlGpuInstanceCreateComputeInstance(
        self, gpuInstance: object, profileId: int
    ) -> _CiHandle:
        gpu, gi = self._gi(gpuInstance)
        c = self._ci_profile(gpu, gi, profileId)
        self._slow_mig(gpu)
        with self._lock:
            free = self._ci_free_starts(gi, c)
            if not free:
                raise NVMLError_InsufficientResources()
            ci_id = next(i for i in range(len(gi.cis) + 1) if i not in gi.cis)
            gpu.serial += 1
            # Like the driver, pack small instances from the top so a larger one still fits
            # at the bottom (1c.3g then 2c.3g both fit a 3g).
            gi.cis[ci_id] = _Ci(ci_id, c, free[-1], gpu.serial)
            handle = _CiHandle(gpu, gi.id, ci_id)
            self._mutated()
        return handle

    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: object, profileId: int, computeInstancesRef: Any, countRef: Any
    ) -> int:
        gpu, gi = self._gi(gpuInstance)
        self._ci_profile(gpu, gi, profileId)
        count = _deref(countRef)
        with self._lock:
            ids = sorted(ci.id for ci in gi.cis.values() if ci.profile.constant == profileId)
        if computeInstancesRef is not None:
            if len(computeInstancesRef) < len(ids):
                raise NVMLError_InsufficientSize()
            for i, ci_id in enumerate(ids):
                computeInstancesRef[i] = _CiHandle(gpu, gi.id, ci_id)
        count.value = len(ids)
        return NVML_SUCCESS

    def nvmlGpuInstanceGetComputeInstanceById(
        self, gpuInstance: object, computeInstanceId: int
    ) -> _CiHandle:
        gpu, gi = self._gi(gpuInstance)
        if computeInstanceId not in gi.cis:
            raise NVMLError_NotFound()
        return _CiHandle(gpu, gi.id, computeInstanceId)

    def _ci(self, handle: object) -> tuple[_Gpu, _Gi, _Ci]:
        if not isinstance(handle, _CiHandle):
            raise NVMLError_InvalidArgument()
        self._check(handle.gpu, "mig")
        gi = handle.gpu.gis.get(handle.gi)
        ci = gi.cis.get(handle.id) if gi is not None else None
        if gi is None or ci is None:
            raise NVMLError_InvalidArgument()
        return handle.gpu, gi, ci

    def nvmlComputeInstanceGetInfo(self, computeInstance: object) -> SimpleNamespace:
        gpu, gi, ci = self._ci(computeInstance)
        return SimpleNamespace(
            device=gpu,
            gpuInstance=_GiHandle(gpu, gi.id),
            id=ci.id,
            profileId=ci.profile.constant,
            placement=SimpleNamespace(start=ci.start, size=ci.profile.slices),
        )

    nvmlComputeInstanceGetInfo_v2 = nvmlComputeInstanceGetInfo

    def nvmlComputeInstanceDestroy(self, computeInstance: object) -> int:
        gpu, gi, ci = self._ci(computeInstance)
        self._slow_mig(gpu)
        with self._lock:
            if any(p.gi == gi.id and p.ci == ci.id for p in gpu.procs):
                raise NVMLError_InUse()  # a CUDA context still lives on it
            del gi.cis[ci.id]
            gpu.mig_handles.pop((gi.id, ci.id, ci.serial), None)
            self._mutated()
        return NVML_SUCCESS

    # -- MIG devices ------------------------------------------------------------------------

    def _mig_list(self, gpu: _Gpu) -> list[_MigDevice]:
        """MIG devices in index order (by GPU instance id, then compute instance id)."""
        if not gpu.mig_current:
            return []
        out = []
        for gi_id in sorted(gpu.gis):
            gi = gpu.gis[gi_id]
            for ci_id in sorted(gi.cis):
                ci = gi.cis[ci_id]
                key = (gi_id, ci_id, ci.serial)
                h = gpu.mig_handles.get(key)
                if h is None:
                    h = _MigDevice(
                        gpu, gi_id, ci_id, ci.serial, "MIG-" + _stable_uuid("mig", gpu.uuid, *key)
                    )
                    gpu.mig_handles[key] = h
                out.append(h)
        return out

    def _mig_profile_name(self, gpu: _Gpu, mig: _MigDevice) -> str:
        gi = gpu.gis[mig.gi]
        return gi.cis[mig.ci].profile.name

    def nvmlDeviceGetMaxMigDeviceCount(self, device: object) -> int:
        gpu = self._gpu(device, "mig")
        if not gpu.spec.mig_capable:
            raise NVMLError_NotSupported()
        return products.COMPUTE_SLICES

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: object, index: int) -> _MigDevice:
        gpu = self._gpu(device, "mig")
        if not gpu.spec.mig_capable:
            raise NVMLError_NotSupported()
        with self._lock:
            migs = self._mig_list(gpu)
        if not 0 <= index < len(migs):
            raise NVMLError_NotFound()
        return migs[index]

    def nvmlDeviceIsMigDeviceHandle(self, device: object) -> int:
        if isinstance(device, _MigDevice):
            return 1
        if isinstance(device, _Gpu):
            return 0
        raise NVMLError_InvalidArgument()

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: object) -> _Gpu:
        if not isinstance(migDevice, _MigDevice):
            raise NVMLError_InvalidArgument()
        gpu, _ = self._any(migDevice, "handle")
        return gpu

    def _mig_handle(self, device: object) -> tuple[_Gpu, _MigDevice]:
        if not isinstance(device, _MigDevice):
            if isinstance(device, _Gpu):
                self._check(device, "mig")
            raise NVMLError_InvalidArgument()
        gpu, mig = self._any(device, "mig")
        assert mig is not None
        return gpu, mig

    def nvmlDeviceGetGpuInstanceId(self, device: object) -> int:
        return self._mig_handle(device)[1].gi

    def nvmlDeviceGetComputeInstanceId(self, device: object) -> int:
        return self._mig_handle(device)[1].ci

    def nvmlDeviceGetAttributes(self, device: object) -> SimpleNamespace:
        gpu, mig = self._any(device, "attributes")
        if mig is None:
            return SimpleNamespace(
                multiprocessorCount=gpu.spec.sm_count,
                sharedCopyEngineCount=0,
                sharedDecoderCount=0,
                sharedEncoderCount=0,
                sharedJpegCount=0,
                sharedOfaCount=0,
                gpuInstanceSliceCount=products.COMPUTE_SLICES,
                computeInstanceSliceCount=products.COMPUTE_SLICES,
                memorySizeMB=gpu.spec.memory_mib,
            )
        gi = gpu.gis[mig.gi]
        ci = gi.cis[mig.ci]
        return SimpleNamespace(
            multiprocessorCount=ci.profile.sm,
            sharedCopyEngineCount=gi.profile.copy_engines,
            sharedDecoderCount=gi.profile.decoders,
            sharedEncoderCount=gi.profile.encoders,
            sharedJpegCount=gi.profile.jpegs,
            sharedOfaCount=gi.profile.ofas,
            gpuInstanceSliceCount=gi.profile.slices,
            computeInstanceSliceCount=ci.profile.slices,
            memorySizeMB=gi.profile.memory_mib,
        )

    nvmlDeviceGetAttributes_v2 = nvmlDeviceGetAttributes

    # -- events -----------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> _EventSet:
        if not self._initialized:
            raise NVMLError_Uninitialized()
        es = _EventSet()
        with self._lock:
            self._event_sets.append(es)
        return es

    def nvmlDeviceGetSupportedEventTypes(self, handle: object) -> int:
        self._gpu(handle, "events")
        return _SUPPORTED_EVENTS

    def nvmlDeviceRegisterEvents(self, handle: object, eventTypes: int, eventSet: object) -> None:
        gpu = self._gpu(handle, "events")
        if not isinstance(eventSet, _EventSet):
            raise NVMLError_InvalidArgument()
        if eventTypes & ~_SUPPORTED_EVENTS:
            raise NVMLError_NotSupported()
        with eventSet.cond:
            eventSet.registered[gpu.index] = eventSet.registered.get(gpu.index, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet: object, timeoutms: int) -> SimpleNamespace:
        """The next event, waiting up to ``timeoutms``; ``NVMLError_Timeout`` if none came.

        Once its queue is empty, a set a lost GPU is registered on answers
        ``NVMLError_GpuIsLost`` at every call, as NVML's does ("a GPU has fallen off the bus"),
        without saying which GPU: only a set without that GPU waits again."""
        if not isinstance(eventSet, _EventSet):
            raise NVMLError_InvalidArgument()
        # (the faults' lock is never taken under the set's: a reboot takes them the other way)
        with eventSet.cond:
            if eventSet.queue:
                return eventSet.queue.popleft()
        self._raise_if_lost(eventSet)
        with eventSet.cond:
            if not eventSet.queue and timeoutms > 0:
                eventSet.cond.wait(timeoutms / 1000.0)
            if eventSet.queue:
                return eventSet.queue.popleft()
        self._raise_if_lost(eventSet)
        raise NVMLError_Timeout()

    def _raise_if_lost(self, eventSet: _EventSet) -> None:
        registered = list(eventSet.registered)
        with self._lock:
            lost = any((f := self._faults.get(g)) is not None and f.lost for g in registered)
        if lost:
            raise NVMLError_GpuIsLost()

    nvmlEventSetWait = nvmlEventSetWait_v2

    def nvmlEventSetFree(self, eventSet: object) -> None:
        with self._lock:
            if eventSet in self._event_sets:
                self._event_sets.remove(eventSet)

    # -- simulation controls (not part of NVML) --------------------------------------------------

    @property
    def sim_gpu_count(self) -> int:
        return len(self._gpus)

    def sim_product(self, gpu: int) -> products.ProductSpec:
        return self._gpus[gpu].spec

    def sim_faults(self, gpu: int) -> _GpuFaults:
        """The fault record of ``gpu``, created on first use (callers hold no lock)."""
        if not 0 <= gpu < len(self._gpus):
            raise IndexError(f"no GPU {gpu}")
        with self._lock:
            f = self._faults.get(gpu)
            if f is None:
                f = self._faults[gpu] = _GpuFaults()
            return f

    def sim_clear_faults(self, gpu: int | None = None) -> None:
        with self._lock:
            if gpu is None:
                self._faults.clear()
            else:
                self._faults.pop(gpu, None)
            self._persist()

    @contextlib.contextmanager
    def sim_locked(self) -> Iterator[None]:
        """Hold the node's lock: no fault comes on and no process starts or stops meanwhile
        but the holder's (for a check and the changes it decides, made as one)."""
        with self._lock:
            yield

    def sim_faults_changed(self) -> None:
        """Persist the faults after a change made through :meth:`sim_faults`."""
        self.sim_persist()

    def sim_persist(self) -> None:
        """Write the state file (again: its directory was removed while gpud ran)."""
        with self._lock:
            self._persist()

    def sim_fault_table(self) -> dict[int, _GpuFaults]:
        with self._lock:
            return dict(self._faults)

    def sim_crash_after(self, n: int | None) -> None:
        with self._lock:
            self._crash_after = n

    def sim_event(
        self, gpu: int, event_type: int, data: int, gi: int | None = None, ci: int | None = None
    ) -> None:
        """Queue an event (e.g. an XID) for every event set registered for it on ``gpu``."""
        g = self._gpus[gpu]
        na = NVML_VALUE_NOT_AVAILABLE_uint
        with self._lock:
            sets = list(self._event_sets)
        for es in sets:
            with es.cond:
                if es.registered.get(gpu, 0) & event_type:
                    es.queue.append(
                        SimpleNamespace(
                            device=g,
                            eventType=event_type,
                            eventData=data,
                            gpuInstanceId=na if gi is None else gi,
                            computeInstanceId=na if ci is None else ci,
                        )
                    )
                    es.cond.notify_all()
        if event_type == nvmlEventTypeDoubleBitEccError:
            g.ecc_uncorrected += 1
        elif event_type == nvmlEventTypeSingleBitEccError:
            g.ecc_corrected += 1

    def sim_resolve_mig(self, gpu: int, mig: int | str) -> tuple[int, int]:
        """(GPU instance id, compute instance id) of a MIG device index or MIG UUID
        (``nvidia-smi -L`` lists both); NotFound when the GPU has no such device, as for an
        unknown MIG device anywhere else."""
        g = self._gpus[gpu]
        with self._lock:
            migs = self._mig_list(g)
        if isinstance(mig, int):
            if not 0 <= mig < len(migs):
                raise NotFound(f"GPU {gpu} has no MIG device {mig} ({len(migs)} exist)")
            return migs[mig].gi, migs[mig].ci
        for m in migs:
            if m.uuid == mig:
                return m.gi, m.ci
        raise NotFound(f"GPU {gpu} has no MIG device {mig}")

    def sim_start_process(
        self,
        gpu: int,
        pid: int,
        used_bytes: int,
        sm_ratio: float,
        mig: int | str | None = None,
        *,
        traffic: LinkTraffic | None = None,
        declared: bool = False,
        host: int | None = None,
    ) -> None:
        """Run ``pid`` on the GPU (or its MIG device), holding ``used_bytes``, keeping
        ``sm_ratio`` of the device's SMs busy and moving ``traffic`` (None: in proportion to
        its SM activity). ``declared``: the operator's, kept in the state file. A process may run on several GPUs (a context on each, as a job
        spanning GPUs has), once per GPU: AlreadyExists when ``pid`` runs there already.
        ResourceExhausted when the device has not ``used_bytes`` free (as cudaMalloc fails).
        FailedPrecondition on a GPU that is lost, requires a reset or hangs (a fault of the
        device: no CUDA context can be made there). ``host``: see :class:`_Proc`."""
        g = self._gpus[gpu]
        # one critical section from the check to the insert: two starts of one PID at once
        # (the operator's and a workload model's) would otherwise both pass the check, and
        # the second would replace the first's process in _procs but not in g.procs
        with self._lock:
            if (refusal := self.sim_start_refusal(gpu)) is not None:
                raise refusal
            if (pid, gpu) in self._procs:
                raise AlreadyExists(f"pid {pid} already runs on GPU {gpu}")
            gi = ci = None
            if mig is not None:
                gi, ci = self.sim_resolve_mig(gpu, mig)  # the lock is reentrant
            elif g.mig_current:
                raise _mig_device_required(gpu, len(self._mig_list(g)))
            total, _, used = self._memory(g, gi)
            if int(used_bytes) > total - used:
                # cudaMalloc fails: the process gets no context there (a real one would
                # stop on the error; a model retries when memory frees)
                where = f"GPU {gpu}" + ("" if gi is None else f" GPU instance {gi}")
                raise ResourceExhausted(
                    f"out of memory on {where}: {int(used_bytes) >> 20} MiB asked, "
                    f"{(total - used) >> 20} MiB free"
                )
            proc = _Proc(
                pid, gpu, gi, ci, int(used_bytes), float(sm_ratio), traffic, declared, host
            )
            self._procs[(pid, gpu)] = proc
            g.procs = [*g.procs, proc]
            self._recompute(g)
            if declared:
                self._persist()

    def sim_start_refusal(self, gpu: int) -> FailedPrecondition | None:
        """What :meth:`sim_start_process` raises on ``gpu`` for its injected faults (no
        process starts on a GPU that is lost, requires a reset or hangs), or None."""
        with self._lock:
            f = self._faults.get(gpu)
            if f is None:
                return None
            if f.lost:
                why = "has fallen off the bus (sim fault lost)"
            elif f.reset_required:
                why = "requires a reset (sim fault reset-required)"
            elif f.slow_s:
                why = f"hangs in every driver call (sim fault slow {format_number(f.slow_s)} s)"
            else:
                return None
        return FailedPrecondition(f"GPU {gpu} {why}: no process starts on it")

    def _proc_keys(self, pid: int, gpu: int | None) -> list[tuple[int, int]]:
        return [k for k in self._procs if k[0] == pid and (gpu is None or k[1] == gpu)]

    def sim_stop_process(self, pid: int, gpu: int | None = None) -> bool:
        """Stop ``pid`` on ``gpu`` (None: on every GPU it runs on); False if it ran on none."""
        with self._lock:
            keys = self._proc_keys(pid, gpu)
            declared = False
            for key in keys:
                proc = self._procs.pop(key)
                declared = declared or proc.declared
                g = self._gpus[proc.gpu]
                g.procs = [p for p in g.procs if p.pid != pid]
                self._recompute(g)
            if declared:
                self._persist()
            return bool(keys)

    def sim_update_process(
        self,
        pid: int,
        used_bytes: int,
        sm_ratio: float,
        traffic: LinkTraffic | None = None,
        *,
        gpu: int | None = None,
    ) -> bool:
        """Change what a running process uses on ``gpu`` (None: on every GPU it runs on),
        in place (no moment without it); False if ``pid`` does not run there."""
        with self._lock:
            keys = self._proc_keys(pid, gpu)
            for key in keys:
                old = self._procs[key]
                proc = _Proc(
                    pid,
                    old.gpu,
                    old.gi,
                    old.ci,
                    int(used_bytes),
                    float(sm_ratio),
                    traffic,
                    old.declared,
                    old.host,
                )
                self._procs[key] = proc
                g = self._gpus[proc.gpu]
                g.procs = [proc if p.pid == pid else p for p in g.procs]
                self._recompute(g)
            return bool(keys)

    def sim_processes(self) -> list[_Proc]:
        with self._lock:
            return list(self._procs.values())

    def _recompute(self, g: _Gpu) -> None:
        # Readers see these numbers without a lock: each is replaced, not mutated.
        g.used_bytes = sum(p.used_bytes for p in g.procs)
        nvlink_full = g.spec.nvlink_gbps * 1e9 * NVLINK_SHARE_AT_FULL_LOAD
        busy = 0.0
        traffic = [0.0, 0.0, 0.0, 0.0]
        for p in g.procs:
            if g.mig_current:
                # each process drives its compute instance; the GPU is the slice-weighted sum
                if p.gi is None or p.gi not in g.gis:
                    continue
                gi = g.gis[p.gi]
                ci = gi.cis.get(p.ci) if p.ci is not None else None
                slices = ci.profile.slices if ci else gi.profile.slices
                share = min(1.0, p.sm_ratio) * slices / products.COMPUTE_SLICES
            else:
                share = p.sm_ratio
            busy += share
            t = p.traffic
            if t is None:
                share = min(1.0, share)
                t = LinkTraffic(
                    PCIE_TX_AT_FULL_LOAD * share,
                    PCIE_RX_AT_FULL_LOAD * share,
                    nvlink_full * share,
                    nvlink_full * 0.9 * share,
                )
            traffic = [a + b for a, b in zip(traffic, t, strict=True)]
        g.load = min(1.0, busy)
        g.traffic = LinkTraffic(*traffic)

    def _reset_gpu(self, g: _Gpu) -> None:
        g.gis.clear()
        g.mig_handles.clear()
        g.mig_current = g.mig_pending
        g.ecc_corrected = g.ecc_uncorrected = 0
        self._faults.pop(g.index, None)  # a reset brings a lost or hung GPU back

    def sim_reset(self, gpu: int) -> None:
        """``nvidia-smi --gpu-reset -i N``: the pending MIG mode becomes current, instances
        are gone, volatile ECC counts and faults are cleared. Refused with
        ``NVMLError_InUse`` while a process runs on the GPU (nvidia-smi: "In use by another
        client"); a lost GPU can be reset. Like ``nvidia-smi``, it needs no NVML handle of
        the caller's."""
        g = self._gpus[gpu]
        with self._lock:
            if g.procs:
                raise NVMLError_InUse()
            self._reset_gpu(g)
            self._recompute(g)
            self._mutated()

    def sim_reboot(self) -> None:
        """A node reboot or driver reload: instances and processes go, pending MIG mode
        applies, injected faults are gone (as is the device state they stood for)."""
        with self._lock:
            self._procs.clear()
            for g in self._gpus:
                g.procs = []
                self._reset_gpu(g)
                self._recompute(g)
            self._faults.clear()
            for es in self._event_sets:
                with es.cond:
                    es.queue.clear()
            self._persist()


# Expose the constants, error classes and ctypes types as attributes, as the module does.
for _name, _value in list(globals().items()):
    if (
        _name.startswith(("NVML_", "nvmlEventType", "NVMLError", "c_nvml"))
        or _name == "SimulatedCrash"
    ):
        setattr(FakeNvml, _name, _value)
