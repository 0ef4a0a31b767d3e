"""The NVML adapter: the one module of gpud that talks to ``pynvml``.

``NvmlBackend`` implements :class:`gpud.backend.port.GpuBackend` over a module that looks
like ``pynvml``: the real one (:func:`open_real_backend`) or the simulated node's
:class:`gpud.backend.sim.FakeNvml`, so the code that talks to a real driver is the code the
tests run. Every ``NVMLError`` becomes the project's own tree (:mod:`gpud.errors`) at this
edge, chosen by the error's numeric ``.value`` so it works for both modules::

    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_DEPRECATED               -> NotSupported (the installed driver lacks the entry
                                           point pynvml calls, or no longer serves it; the
                                           ``_v3`` process listing, which drivers before
                                           R510 lack, falls back to ``_v2`` instead)
    NVML_ERROR_GPU_IS_LOST              -> GpuLost
    NVML_ERROR_TIMEOUT                  -> DriverTimeout
    NVML_ERROR_INSUFFICIENT_RESOURCES   -> InsufficientResources
    NVML_ERROR_NOT_FOUND                -> DeviceNotFound
    NVML_ERROR_IN_USE                   -> InUse
    NVML_ERROR_UNINITIALIZED, DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND,
    LIB_RM_VERSION_MISMATCH             -> DriverNotLoaded (what to check said: nvidia-smi,
                                           lsmod, the container runtime)
    NVML_ERROR_NO_PERMISSION            -> NoPermission (naming gpud's uid and what to do: a
                                           device node it may not open, a root-only call)
    NVML_ERROR_RESET_REQUIRED, IRQ_ISSUE,
    INSUFFICIENT_POWER, CORRUPTED_INFOROM
                                        -> GpuFault (``problem``: "reset required", ...)
    anything else                       -> BackendError (``code`` keeps the NVML value)

MIG queries go the way NVML requires: a profile *constant*
(``NVML_GPU_INSTANCE_PROFILE_*``) gives ``nvmlDeviceGetGpuInstanceProfileInfo``, whose ``.id``
is the profile id every later call takes (``nvidia-smi mig -lgip`` prints that id). The
580-series driver answers those with MIG mode off too (older drivers only while it is on);
compute-instance profiles are read from an existing
GPU instance (``nvidia-smi mig -gi N -lcip``). Compute-instance profile ids equal the
``NVML_COMPUTE_INSTANCE_PROFILE_*`` constants.

Handles, identities and profile tables are cached (they do not change while the GPU is
present); per-reading calls go straight to NVML so a sampling tick costs little more than
the bare calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final

from gpud.backend.port import (
    Clocks,
    ComputeInstanceInfo,
    ComputeInstanceProfile,
    EccCounts,
    EventKind,
    GpuEvent,
    GpuIdentity,
    GpuInstanceInfo,
    GpuInstanceProfile,
    GpuReadings,
    MemoryInfo,
    MigDeviceIdentity,
    MigMode,
    MigReading,
    MigReadings,
    PcieThroughput,
    Placement,
    ProcessInfo,
    Utilization,
)
from gpud.backend.products import product_key_for
from gpud.errors import (
    GPU_FAULTS,
    READING_FAULTS,
    BackendError,
    DeviceNotFound,
    DriverNotLoaded,
    DriverTimeout,
    GpuFault,
    GpuLost,
    InsufficientResources,
    InUse,
    NoPermission,
    NotSupported,
)

log = logging.getLogger(__name__)

MiB: Final = 1024 * 1024
_NOT_AVAILABLE_UINT: Final = 0xFFFFFFFF

# NVML return codes (nvml.h), fixed by the C API.
_ERROR_CLASSES: Final[dict[int, type[BackendError]]] = {
    1: DriverNotLoaded,  # UNINITIALIZED
    3: NotSupported,
    4: NoPermission,
    6: DeviceNotFound,
    8: GpuFault,  # INSUFFICIENT_POWER
    9: DriverNotLoaded,  # DRIVER_NOT_LOADED
    10: DriverTimeout,
    11: GpuFault,  # IRQ_ISSUE
    12: DriverNotLoaded,  # LIBRARY_NOT_FOUND
    13: NotSupported,  # FUNCTION_NOT_FOUND: this driver has no such call
    14: GpuFault,  # CORRUPTED_INFOROM
    15: GpuLost,
    16: GpuFault,  # RESET_REQUIRED
    18: DriverNotLoaded,  # LIB_RM_VERSION_MISMATCH
    19: InUse,
    23: InsufficientResources,
    26: NotSupported,  # DEPRECATED: a call this driver no longer serves
}
# What each GpuFault means (its ``problem``) and what the operator does about it, as NVML's
# reference describes the code.
_FAULT_PROBLEMS: Final[dict[int, tuple[str, str]]] = {
    8: (
        "insufficient power",
        "its external power cables are not properly attached: check them (power the node off)",
    ),
    11: (
        "interrupt issue",
        "the kernel driver detected an interrupt (IRQ) problem with the GPU: see `dmesg`;"
        " drain the node and reset the GPU or reboot",
    ),
    14: (
        "corrupted infoROM",
        "the GPU's infoROM is corrupted: drain the node and have the board serviced",
    ),
    16: (
        "reset required",
        "drain the node and reset the GPU (`nvidia-smi --gpu-reset -i {gpu}`) or reboot",
    ),
}
# DriverNotLoaded: what the code means and what to check.
_NO_DRIVER: Final[dict[int, str]] = {
    1: "NVML is not initialised",
    9: "the NVIDIA kernel driver is not loaded: check `nvidia-smi` and `lsmod | grep nvidia`"
    " (modprobe nvidia), and that gpud starts after the driver",
    12: "libnvidia-ml.so.1 cannot be found or loaded: is the NVIDIA driver installed"
    " (`nvidia-smi`)? In a container, run it with the NVIDIA container runtime"
    " (`--gpus`, `--runtime=nvidia`) so that the library and /dev/nvidia* are mounted",
    18: "the NVML library and the loaded kernel driver are of different versions (a driver"
    " upgraded without a reboot): reboot, or reload the nvidia kernel modules",
}
_NO_PERMISSION: Final = 4
_MIG_CHANGE: Final = re.compile(r"(Create|Destroy)(Gpu|Compute)Instance|SetMigMode")
_SKIP_PROFILE: Final = (NotSupported, DeviceNotFound)  # "not on this product"
_INVALID_ARGUMENT: Final = 2
_NOT_SUPPORTED: Final = 3
_FUNCTION_NOT_FOUND: Final = 13

# Field ids for NVLink data throughput counters (KiB), nvml.h. Each is per link: the field
# value's ``scopeId`` is the link index, so a GPU's traffic is the sum over its links.
_FI_NVLINK_LINK_COUNT: Final = 91
_FI_NVLINK_TX: Final = 138
_FI_NVLINK_RX: Final = 139
_NVLINK_MAX_LINKS: Final = 18  # NVML_NVLINK_MAX_LINKS of the drivers for A100/H100/H200

_EVENT_KINDS: Final[dict[int, EventKind]] = {
    0x8: EventKind.XID,
    0x2: EventKind.ECC_DOUBLE_BIT,
    0x1: EventKind.ECC_SINGLE_BIT,
    0x4: EventKind.PSTATE,
    0x10: EventKind.CLOCK,
}
_XID_EVENT: Final = 0x8  # nvmlEventTypeXidCriticalError
_WANTED_EVENTS: Final = _XID_EVENT | 0x2 | 0x1
REGISTER_WAIT_S: Final = 0.5
"""How long a new event set waits for the GPUs' registrations before its first wait."""
REREGISTER_S: Final = 30.0
"""How often a GPU that was faulty (lost, hung, in need of an operator) when it last
registered for events tries again."""


def _same_handle(a: Any, b: Any) -> bool:
    """Whether two NVML device handles name one device. pynvml's handles are ctypes pointers,
    and the ``device`` of an ``nvmlEventSetWait`` result is a new pointer object each time,
    which ``==`` (identity, for ctypes pointers) tells apart from the cached handle."""
    if a is b:
        return True
    try:
        va = ctypes.cast(a, ctypes.c_void_p).value
        vb = ctypes.cast(b, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return bool(a == b)
    return va is not None and va == vb


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _moved(gpu: int, dev: MigDeviceIdentity, now_uuid: str) -> DeviceNotFound:
    return DeviceNotFound(
        f"MIG device {dev.mig} of GPU {gpu} is {now_uuid} now, not {dev.uuid} "
        f"(GPU instance {dev.gpu_instance_id}): the MIG devices changed since they were listed",
        gpu=gpu,
        uuid=dev.uuid,
        call="nvmlDeviceGetUUID",
    )


def _opt_uint(value: int) -> int | None:
    return None if value == _NOT_AVAILABLE_UINT else int(value)


# Builds a NamedTuple from a tuple of all its fields without a call of its Python-level
# ``__new__`` (namedtuple's own ``_make`` does the same): half the cost, which the readings
# built for every GPU and MIG device on every tick add up to. Only for the per-tick readings,
# each with every field given in order; ``test_gpu_readings_*`` compare them with readings
# built the usual way.
_new: Final = tuple.__new__


def _processes(procs: Any) -> tuple[ProcessInfo, ...]:
    """pynvml's process structs (``usedGpuMemory`` already None where NVML does not say)."""
    out = []
    for p in procs:
        gi = p.gpuInstanceId
        ci = p.computeInstanceId
        out.append(
            _new(
                ProcessInfo,
                (
                    p.pid,
                    p.usedGpuMemory,
                    None if gi == _NOT_AVAILABLE_UINT else gi,
                    None if ci == _NOT_AVAILABLE_UINT else ci,
                ),
            )
        )
    return tuple(out)


class _Fast:
    """The NVML functions and constants of the per-tick readings, looked up once: fetched
    from the module on every call they would cost a good part of a cheap NVML call."""

    __slots__ = (
        "CLOCK_MEM",
        "CLOCK_SM",
        "ECC_CORRECTED",
        "ECC_UNCORRECTED",
        "ECC_VOLATILE",
        "PCIE_RX",
        "PCIE_TX",
        "TEMPERATURE_GPU",
        "_nv",
        "clock",
        "ecc",
        "field_values",
        "memory",
        "mig_handle",
        "mig_mode",
        "pcie",
        "power",
        "processes",
        "temperature",
        "utilization",
        "uuid",
    )

    def __init__(self, nv: Any) -> None:
        self.memory = nv.nvmlDeviceGetMemoryInfo
        self.utilization = nv.nvmlDeviceGetUtilizationRates
        self.power = nv.nvmlDeviceGetPowerUsage
        self.temperature = nv.nvmlDeviceGetTemperature
        self.clock = nv.nvmlDeviceGetClockInfo
        self.ecc = nv.nvmlDeviceGetTotalEccErrors
        self.pcie = nv.nvmlDeviceGetPcieThroughput
        self.field_values = nv.nvmlDeviceGetFieldValues
        self._nv = nv
        self.processes = self._processes_newest
        self.mig_mode = nv.nvmlDeviceGetMigMode
        self.mig_handle = nv.nvmlDeviceGetMigDeviceHandleByIndex
        self.uuid = nv.nvmlDeviceGetUUID
        self.TEMPERATURE_GPU = nv.NVML_TEMPERATURE_GPU
        self.CLOCK_SM = nv.NVML_CLOCK_SM
        self.CLOCK_MEM = nv.NVML_CLOCK_MEM
        self.ECC_CORRECTED = nv.NVML_MEMORY_ERROR_TYPE_CORRECTED
        self.ECC_UNCORRECTED = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        self.ECC_VOLATILE = nv.NVML_VOLATILE_ECC
        self.PCIE_TX = nv.NVML_PCIE_UTIL_TX_BYTES
        self.PCIE_RX = nv.NVML_PCIE_UTIL_RX_BYTES

    def _processes_newest(self, handle: Any) -> Any:
        """pynvml's process listing goes to ``nvmlDeviceGetComputeRunningProcesses_v3``,
        which drivers before R510 lack (FUNCTION_NOT_FOUND): those list the same processes
        through ``_v2``, taken from then on."""
        nv = self._nv
        try:
            return nv.nvmlDeviceGetComputeRunningProcesses(handle)
        except nv.NVMLError as err:
            if err.value != _FUNCTION_NOT_FOUND:
                raise
        self.processes = nv.nvmlDeviceGetComputeRunningProcesses_v2
        return self.processes(handle)


def product_key(name: str, memory_total_bytes: int) -> str:
    """gpud's product key for a GPU NVML calls ``name`` ("H100-SXM5-80GB").

    Known products get their key from the product table; others a sanitized name with the
    memory size ("NVIDIA L40S", 46068 MiB -> "L40S-45GB").
    """
    key = product_key_for(name, memory_total_bytes)
    if key is not None:
        return key
    base = re.sub(r"^NVIDIA\s+", "", name.strip(), flags=re.IGNORECASE)
    base = re.sub(r"[^A-Za-z0-9]+", "-", base).strip("-").upper() or "GPU"
    if not re.search(r"\d+GB", base):
        base += f"-{round(memory_total_bytes / (1024**3))}GB"
    return base


class NvmlBackend:
    """:class:`gpud.backend.port.GpuBackend` over a ``pynvml``-shaped module.

    ``nvml`` is ``pynvml`` or a ``FakeNvml``; the constructor calls ``nvmlInit`` and
    ``close()`` calls ``nvmlShutdown``. Safe to call from several threads: NVML is, and the
    caches only ever fill in values that do not change.
    """

    def __init__(
        self,
        nvml: Any,
        *,
        reset: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        uid: int | None = None,
    ) -> None:
        """``reset(gpu)`` resets a GPU (``nvidia-smi --gpu-reset -i N``; NVML has no call
        for it); without it :meth:`reset_gpu` is NotSupported. ``clock`` times a faulty GPU's
        next registration for events (:data:`REREGISTER_S`). ``uid``: the user gpud runs
        as, named when the driver refuses it (NVML_ERROR_NO_PERMISSION)."""
        self._nv = nvml
        self._clock = clock
        self._reset = reset
        self._uid = uid
        self._events_lock = threading.Lock()
        self._registry_lock = threading.Lock()  # the event set and the GPUs registering on it
        self._registering: set[int] = set()
        # GPUs whose last registration ended without XID events (not supported, failed)
        self._xid_unwatched: set[int] = set()
        # GPUs lost when they last registered: when each registers again
        self._reregister_at: dict[int, float] = {}
        self._error: type[BaseException] = nvml.NVMLError
        self._call(None, nvml.nvmlInit)
        self._count = int(self._call(None, nvml.nvmlDeviceGetCount))
        self._driver = _text(self._call(None, nvml.nvmlSystemGetDriverVersion))
        self._fast = _Fast(nvml)
        self._handles: list[Any] = [None] * self._count
        self._uuids: dict[int, str] = {}
        self._identities: dict[int, GpuIdentity] = {}
        self._gi_tables: dict[int, dict[int, tuple[GpuInstanceProfile, list[Placement]]]] = {}
        self._ci_tables: dict[tuple[str, int], list[ComputeInstanceProfile]] = {}
        self._mig_ids: dict[tuple[int, int, str], MigDeviceIdentity] = {}
        self._nvlink_fields_cache: dict[int, tuple[tuple[int, int], ...]] = {}
        # per GPU, each link's last (tx, rx) KiB: a link that misses a read counts with it
        self._nvlink_last: dict[int, dict[int, tuple[int, int]]] = {}
        self._event_set: Any = None
        self._closed = False

    # -- plumbing ----------------------------------------------------------------------------

    def _translate(
        self, err: BaseException, gpu: int | None, fn: Callable[..., Any] | str
    ) -> BackendError:
        code = getattr(err, "value", None)
        if not isinstance(code, int):
            code = None
        cls = _ERROR_CLASSES.get(code, BackendError) if code is not None else BackendError
        call = fn if isinstance(fn, str) else getattr(fn, "__name__", repr(fn))
        where = f" on GPU {gpu}" if gpu is not None else ""
        message = f"{call} failed{where}: {err}"
        uuid = self._uuids.get(gpu) if gpu is not None else None
        if code == _NO_PERMISSION:
            message += f": {self._no_permission(gpu, call)}"
        elif code in _NO_DRIVER:
            message += f": {_NO_DRIVER[code]}"
        fault = _FAULT_PROBLEMS.get(code) if code is not None else None
        if fault is not None:
            problem, advice = fault
            return GpuFault(
                f"{message}: {advice.format(gpu='N' if gpu is None else gpu)}",
                problem=problem,
                gpu=gpu,
                uuid=uuid,
                call=call,
                code=code,
            )
        return cls(message, gpu=gpu, uuid=uuid, call=call, code=code)

    def _no_permission(self, gpu: int | None, call: str) -> str:
        """What NVML_ERROR_NO_PERMISSION means for ``call``, and what to do."""
        who = "gpud" if self._uid is None else f"gpud runs as uid {self._uid}"
        if call in ("nvmlInit", "nvmlInitWithFlags", "nvmlDeviceGetHandleByIndex"):
            node = "/dev/nvidiactl" if gpu is None else f"GPU {gpu}'s device node (/dev/nvidia*)"
            return (
                f"no permission to use {node} ({who}): run gpud as root, or give its user"
                " read-write access to /dev/nvidiactl and /dev/nvidia* (their group, e.g."
                " video); in a container, pass the devices in (the NVIDIA container runtime)"
            )
        what = "MIG changes" if _MIG_CHANGE.search(call) else "this call"
        return f"not permitted ({who}): the driver allows {what} to root only; run gpud as root"

    def _call(self, gpu: int | None, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._error as err:
            raise self._translate(err, gpu, fn) from err

    def _handle(self, gpu: int) -> Any:
        if not 0 <= gpu < self._count:
            raise DeviceNotFound(f"no GPU {gpu}: NVML sees {self._count}", gpu=gpu)
        h = self._handles[gpu]
        if h is None:
            h = self._call(gpu, self._nv.nvmlDeviceGetHandleByIndex, gpu)
            self._handles[gpu] = h
        return h

    def _mig_handle(self, gpu: int, mig: int) -> Any:
        return self._call(gpu, self._nv.nvmlDeviceGetMigDeviceHandleByIndex, self._handle(gpu), mig)

    def _device(self, gpu: int, mig: int | None) -> Any:
        return self._handle(gpu) if mig is None else self._mig_handle(gpu, mig)

    # -- system and identity -----------------------------------------------------------------

    def driver_version(self) -> str:
        """``nvidia-smi --query-gpu=driver_version``."""
        return self._driver

    def gpu_count(self) -> int:
        return self._count

    def identity(self, gpu: int) -> GpuIdentity:
        """``nvidia-smi -L`` plus PCI ids and memory size; cached."""
        ident = self._identities.get(gpu)
        if ident is not None:
            return ident
        nv = self._nv
        h = self._handle(gpu)
        uuid = _text(self._call(gpu, nv.nvmlDeviceGetUUID, h))
        self._uuids[gpu] = uuid
        name = _text(self._call(gpu, nv.nvmlDeviceGetName, h))
        pci = self._call(gpu, nv.nvmlDeviceGetPciInfo, h)
        total = int(self._call(gpu, nv.nvmlDeviceGetMemoryInfo, h).total)
        try:
            self._call(gpu, nv.nvmlDeviceGetMigMode, h)
            mig_capable = True
        except NotSupported:
            mig_capable = False
        link_gen = self._link(gpu, nv.nvmlDeviceGetMaxPcieLinkGeneration, h)
        link_width = self._link(gpu, nv.nvmlDeviceGetMaxPcieLinkWidth, h)
        ident = GpuIdentity(
            index=gpu,
            uuid=uuid,
            name=name,
            product=product_key(name, total),
            pci_bus_id=_text(pci.busId),
            pci_device_id=int(pci.pciDeviceId),
            memory_total_bytes=total,
            mig_capable=mig_capable,
            pcie_link_gen=link_gen,
            pcie_link_width=link_width,
        )
        self._identities[gpu] = ident
        return ident

    def _link(self, gpu: int, fn: Callable[..., Any], h: Any) -> int | None:
        """A PCIe link property, None where the driver does not give it (a vGPU, an old
        driver); a GPU that is lost, hung or needs an operator (GpuFault) raises as for the
        other identity reads, so that no identity without its link is remembered."""
        try:
            return int(self._call(gpu, fn, h))
        except GPU_FAULTS:
            raise
        except BackendError:
            return None

    # -- readings ----------------------------------------------------------------------------
    #
    # The sampler's hot path: ``gpu_readings`` and ``mig_readings`` run for every GPU on every
    # tick, so they call the NVML functions bound once in ``__init__`` directly, each in its
    # own ``try``, with no per-reading indirection. pynvml already returns Python ints for
    # every value read here (ctypes integer fields convert on access), so they are stored as
    # they come.

    def memory(self, gpu: int, mig: int | None = None) -> MemoryInfo:
        """``nvidia-smi --query-gpu=memory.total,memory.used,memory.free`` (or the MIG device's),
        read with ``nvmlDeviceGetMemoryInfo`` (v1): ``used`` is ``total - free``, the memory the
        driver reserves included (some 600 MiB on an idle H200), so that what is not used is
        what a process can still allocate."""
        m = self._call(gpu, self._nv.nvmlDeviceGetMemoryInfo, self._device(gpu, mig))
        return MemoryInfo(m.total, m.used, m.free)

    def processes(self, gpu: int, mig: int | None = None) -> list[ProcessInfo]:
        """``nvidia-smi --query-compute-apps=pid,used_memory`` for the GPU or MIG device."""
        procs = self._call(gpu, self._fast.processes, self._device(gpu, mig))
        return list(_processes(procs))

    def gpu_readings(self, gpu: int, skip: Collection[str] = frozenset()) -> GpuReadings:
        """``nvidia-smi -q -i N`` minus what does not change: every reading of
        :class:`GpuReadings` not in ``skip``, with one handle lookup. A GPU that needs an
        operator (:class:`GpuFault`: NVML_ERROR_RESET_REQUIRED, ...) in a numeric reading is
        asked none of the others, and its numbers are None; its processes and MIG mode are
        still read (what ``nvidia-smi --gpu-reset`` waits for, and what it switches)."""
        h = self._handle(gpu)
        f = self._fast
        error = self._error
        errors: list[tuple[str, BackendError]] = []
        memory = utilization = power = temperature = clocks = ecc = pcie = nvlink = None
        mig_mode = None
        processes: tuple[ProcessInfo, ...] = ()
        try:
            try:
                if "memory" not in skip:
                    try:
                        m = f.memory(h)
                        memory = _new(MemoryInfo, (m.total, m.used, m.free))
                    except error as err:
                        self._read_failed(errors, gpu, "memory", f.memory, err)
                if "utilization" not in skip:
                    try:
                        u = f.utilization(h)
                        utilization = _new(Utilization, (u.gpu / 100.0, u.memory / 100.0))
                    except error as err:
                        self._read_failed(errors, gpu, "utilization", f.utilization, err)
                if "power_watts" not in skip:
                    try:
                        power = f.power(h) / 1000.0  # mW
                    except error as err:
                        self._read_failed(errors, gpu, "power_watts", f.power, err)
                if "temperature_celsius" not in skip:
                    try:
                        temperature = float(f.temperature(h, f.TEMPERATURE_GPU))
                    except error as err:
                        self._read_failed(errors, gpu, "temperature_celsius", f.temperature, err)
                if "clocks" not in skip:
                    try:
                        clocks = _new(Clocks, (f.clock(h, f.CLOCK_SM), f.clock(h, f.CLOCK_MEM)))
                    except error as err:
                        self._read_failed(errors, gpu, "clocks", f.clock, err)
                if "ecc" not in skip:
                    try:
                        ecc = _new(
                            EccCounts,
                            (
                                f.ecc(h, f.ECC_CORRECTED, f.ECC_VOLATILE),
                                f.ecc(h, f.ECC_UNCORRECTED, f.ECC_VOLATILE),
                            ),
                        )
                    except error as err:
                        self._read_failed(errors, gpu, "ecc", f.ecc, err)
                if "pcie" not in skip:
                    try:
                        pcie = _new(
                            PcieThroughput,
                            (f.pcie(h, f.PCIE_TX) * 1024.0, f.pcie(h, f.PCIE_RX) * 1024.0),
                        )
                    except error as err:
                        self._read_failed(errors, gpu, "pcie", f.pcie, err)
                if "nvlink_bytes" not in skip:
                    try:
                        fields = self._nvlink_fields(gpu, h)
                        nvlink = self._nvlink(gpu, f.field_values(h, fields) if fields else ())
                    except error as err:
                        self._read_failed(errors, gpu, "nvlink_bytes", f.field_values, err)
            except GpuFault:
                # The GPU needs an operator: what it answers for its numbers is no reading
                # to trust, so they are not asked. What it holds still is: the processes
                # that keep a reset from running, and the MIG mode the reset switches.
                memory = utilization = power = temperature = clocks = ecc = pcie = None
                nvlink = None
            if "processes" not in skip:
                try:
                    procs = f.processes(h)
                    if procs:
                        processes = _processes(procs)
                except error as err:
                    self._read_failed(errors, gpu, "processes", f.processes, err, stop=GpuLost)
            if "mig_mode" not in skip:
                try:
                    current, pending = f.mig_mode(h)
                    mig_mode = _new(MigMode, (bool(current), bool(pending)))
                except error as err:
                    self._read_failed(errors, gpu, "mig_mode", f.mig_mode, err, stop=GpuLost)
        except GpuLost:
            return GpuReadings(errors=tuple(errors))
        return _new(
            GpuReadings,
            (
                memory,
                utilization,
                power,
                temperature,
                clocks,
                ecc,
                pcie,
                nvlink,
                processes,
                mig_mode,
                tuple(errors) if errors else (),
            ),
        )

    def _read_failed(
        self,
        errors: list[tuple[str, BackendError]],
        gpu: int,
        reading: str,
        fn: Callable[..., Any],
        err: BaseException,
        *,
        stop: type[BackendError] | tuple[type[BackendError], ...] = READING_FAULTS,
    ) -> None:
        """Note a failed reading; an error of ``stop`` (by default the GPU lost or in need
        of an operator) is raised as well, to end the readings :meth:`gpu_readings` takes."""
        translated = self._translate(err, gpu, fn)
        errors.append((reading, translated))
        if isinstance(translated, stop):
            raise translated from err

    def mig_readings(self, gpu: int, devices: Sequence[MigDeviceIdentity]) -> MigReadings:
        """``nvidia-smi -q -i N:M -d MEMORY,PIDS`` over ``devices``: one handle lookup, one
        memory and one process query per device. A memory or process query that fails
        (NotSupported, a driver error) leaves the device's other reading: see
        :class:`MigReading`. Only a device whose handle cannot be had, or whose index now
        holds another device (its UUID is not the one listed: ``DeviceNotFound``), is in
        ``errors``. A
        fault of the GPU itself (:data:`gpud.errors.READING_FAULTS`: lost, in need of an
        operator) raises: it is the GPU's, not one device's reading's."""
        parent = self._handle(gpu)
        f = self._fast
        get_handle = f.mig_handle
        get_memory = f.memory
        get_procs = f.processes
        error = self._error
        get_uuid = f.uuid
        out: list[MigReading] = []
        errors: list[tuple[int, BackendError]] = []
        for dev in devices:
            h = None
            try:
                h = get_handle(parent, dev.mig)
                now_uuid = _text(get_uuid(h))
            except error as err:
                translated = self._translate(err, gpu, get_handle if h is None else get_uuid)
                if isinstance(translated, READING_FAULTS):
                    raise translated from err
                out.append(MigReading(dev, None, (), False))
                errors.append((dev.mig, translated))
                continue
            if now_uuid != dev.uuid:
                # The driver numbers MIG devices among those that exist now: one destroyed
                # or created since the list was read moves another onto this index, whose
                # readings are not this device's.
                out.append(MigReading(dev, None, (), False))
                errors.append((dev.mig, _moved(gpu, dev, now_uuid)))
                continue
            # The device answers: a query that fails leaves only its own reading unknown.
            memory: MemoryInfo | None = None
            memory_error = ""
            try:
                m = get_memory(h)
            except error as err:
                translated = self._translate(err, gpu, get_memory)
                if isinstance(translated, READING_FAULTS):
                    raise translated from err
                memory_error = str(translated)
            else:
                memory = _new(MemoryInfo, (m.total, m.used, m.free))
            try:
                procs = get_procs(h)
            except error as err:
                translated = self._translate(err, gpu, get_procs)
                if isinstance(translated, READING_FAULTS):
                    raise translated from err
                out.append(
                    _new(MigReading, (dev, memory, (), False, str(translated), memory_error))
                )
                continue
            out.append(
                _new(
                    MigReading,
                    (dev, memory, _processes(procs) if procs else (), True, "", memory_error),
                )
            )
        return MigReadings(tuple(out), tuple(errors) if errors else ())

    # Single readings, not part of the port (the sampler reads them all in one
    # `gpu_readings` call): for the real-GPU tier and for checking `gpu_readings` against
    # an independent read of each field.

    def utilization(self, gpu: int) -> Utilization:
        """``utilization.gpu`` / ``utilization.memory``; NotSupported on MIG-enabled GPUs."""
        u = self._call(gpu, self._nv.nvmlDeviceGetUtilizationRates, self._handle(gpu))
        return Utilization(gpu_ratio=u.gpu / 100.0, memory_ratio=u.memory / 100.0)

    def power_watts(self, gpu: int) -> float:
        """``power.draw`` (NVML reports milliwatts)."""
        return int(self._call(gpu, self._nv.nvmlDeviceGetPowerUsage, self._handle(gpu))) / 1000.0

    def temperature_celsius(self, gpu: int) -> float:
        """``temperature.gpu``."""
        nv = self._nv
        return float(
            self._call(gpu, nv.nvmlDeviceGetTemperature, self._handle(gpu), nv.NVML_TEMPERATURE_GPU)
        )

    def clocks(self, gpu: int) -> Clocks:
        """``clocks.sm`` and ``clocks.mem`` in MHz."""
        nv = self._nv
        h = self._handle(gpu)
        sm = self._call(gpu, nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
        mem = self._call(gpu, nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
        return Clocks(sm_mhz=int(sm), memory_mhz=int(mem))

    def ecc_errors(self, gpu: int) -> EccCounts:
        """``ecc.errors.corrected.volatile.total`` and the uncorrected count."""
        nv = self._nv
        h = self._handle(gpu)
        fn = nv.nvmlDeviceGetTotalEccErrors
        corrected = self._call(
            gpu, fn, h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC
        )
        uncorrected = self._call(
            gpu, fn, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
        )
        return EccCounts(corrected=int(corrected), uncorrected=int(uncorrected))

    def pcie_throughput(self, gpu: int) -> PcieThroughput:
        """``nvidia-smi dmon -s t``: PCIe TX/RX over the last 20 ms (NVML says KB/s, 1 KB = 1024 B)."""
        nv = self._nv
        h = self._handle(gpu)
        tx = self._call(gpu, nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_TX_BYTES)
        rx = self._call(gpu, nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_RX_BYTES)
        return PcieThroughput(tx_bytes_per_second=tx * 1024.0, rx_bytes_per_second=rx * 1024.0)

    def nvlink_throughput_bytes(self, gpu: int) -> tuple[int, int]:
        """NVLink data counters (tx, rx) in bytes, summed over all links: the totals of
        ``nvidia-smi nvlink -gt d``.

        Read with ``nvmlDeviceGetFieldValues(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX)``, one
        value per link (``scopeId`` = link index); NotSupported where the GPU has no NVLink.
        """
        fn = self._nv.nvmlDeviceGetFieldValues
        h = self._handle(gpu)
        fields = self._nvlink_fields(gpu, h)
        values = self._call(gpu, fn, h, fields) if fields else ()
        try:
            return self._nvlink(gpu, values)
        except self._error as err:
            raise self._translate(err, gpu, fn) from err

    def _nvlink_fields(self, gpu: int, h: Any) -> tuple[tuple[int, int], ...]:
        """``(field id, link)`` for the TX and RX counters of every link of the GPU: the
        link count (``NVML_FI_DEV_NVLINK_LINK_COUNT``) read once, the driver's maximum when
        it cannot say (links it does not have then answer with an error and are skipped).
        None at all for a GPU without NVLink: one that counts no links, or whose driver does
        not support the count."""
        fields = self._nvlink_fields_cache.get(gpu)
        if fields is not None:
            return fields
        links = _NVLINK_MAX_LINKS
        try:
            (count,) = self._fast.field_values(h, (_FI_NVLINK_LINK_COUNT,))
        except self._error:  # a lost GPU, say: try again next time
            read = False
        else:
            read = True
            if count.nvmlReturn == _NOT_SUPPORTED or (
                not count.nvmlReturn and count.value.uiVal == 0
            ):
                links = 0
            elif not count.nvmlReturn and 0 < count.value.uiVal <= 64:
                links = int(count.value.uiVal)
        fields = tuple(
            (fid, link) for link in range(links) for fid in (_FI_NVLINK_TX, _FI_NVLINK_RX)
        )
        if read:
            self._nvlink_fields_cache[gpu] = fields
        return fields

    def _nvlink(self, gpu: int, values: Any) -> tuple[int, int]:
        """(tx, rx) bytes summed over the links (pairs of TX, RX values, one pair per link).
        A link that does not answer this time counts with the values it last answered (none
        if it never did), so that the sum, a counter, does not drop for one read and jump
        back on the next; when no link answers, the first field's error raises NVMLError
        (NotSupported where the GPU has no links to read)."""
        last = self._nvlink_last.setdefault(gpu, {})
        answered = False
        first_error = 0
        for i in range(0, len(values), 2):
            t, r = values[i], values[i + 1]
            if t.nvmlReturn or r.nvmlReturn:
                first_error = first_error or t.nvmlReturn or r.nvmlReturn
                continue
            answered = True
            last[i // 2] = (t.value.ullVal, r.value.ullVal)
        if not values:
            raise self._nv.NVMLError(_NOT_SUPPORTED)
        if not answered:
            raise self._nv.NVMLError(first_error or _INVALID_ARGUMENT)
        tx = sum(t for t, _ in last.values())
        rx = sum(r for _, r in last.values())
        return tx * 1024, rx * 1024

    # -- MIG mode ----------------------------------------------------------------------------

    def mig_mode(self, gpu: int) -> MigMode:
        """``nvidia-smi --query-gpu=mig.mode.current,mig.mode.pending``."""
        current, pending = self._call(gpu, self._nv.nvmlDeviceGetMigMode, self._handle(gpu))
        return MigMode(current=bool(current), pending=bool(pending))

    def set_mig_mode(self, gpu: int, enabled: bool) -> MigMode:
        """``nvidia-smi -i N -mig 1|0``. The change may stay pending until a GPU reset."""
        nv = self._nv
        mode = nv.NVML_DEVICE_MIG_ENABLE if enabled else nv.NVML_DEVICE_MIG_DISABLE
        self._call(gpu, nv.nvmlDeviceSetMigMode, self._handle(gpu), mode)
        self._gi_tables.pop(gpu, None)
        return self.mig_mode(gpu)

    # -- MIG profiles ------------------------------------------------------------------------

    def _gi_table(self, gpu: int) -> dict[int, tuple[GpuInstanceProfile, list[Placement]]]:
        table = self._gi_tables.get(gpu)
        if table is not None:
            return table
        nv = self._nv
        h = self._handle(gpu)
        table = {}
        count = int(getattr(nv, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0x12))
        refused: NotSupported | None = None
        for constant in range(count):
            try:
                info = self._call(gpu, nv.nvmlDeviceGetGpuInstanceProfileInfo, h, constant)
            except _SKIP_PROFILE as err:
                refused = err if isinstance(err, NotSupported) else refused
                continue
            except BackendError as err:
                if err.code == _INVALID_ARGUMENT:  # a constant this driver does not know
                    continue
                raise
            placements = self._placements(gpu, h, int(info.id))
            name = _text(getattr(info, "name", b"")).removeprefix("MIG ").strip()
            profile = GpuInstanceProfile(
                id=int(info.id),
                profile=constant,
                name=name or f"{info.sliceCount}g.{round(info.memorySizeMB / 1024)}gb",
                slice_count=int(info.sliceCount),
                memory_bytes=int(info.memorySizeMB) * MiB,
                memory_slices=placements[0].size if placements else 0,
                instance_count=int(info.instanceCount),
                multiprocessor_count=int(info.multiprocessorCount),
                copy_engine_count=int(info.copyEngineCount),
                decoder_count=int(info.decoderCount),
                encoder_count=int(info.encoderCount),
                jpeg_count=int(info.jpegCount),
                ofa_count=int(info.ofaCount),
            )
            table[profile.id] = (profile, placements)
        if not table:
            # A GPU without MIG, or a driver that answers only while MIG mode is on.
            raise NotSupported(
                f"GPU {gpu} offers no MIG profiles (MIG mode off or not MIG-capable)",
                gpu=gpu,
                uuid=self._uuids.get(gpu),
                call="nvmlDeviceGetGpuInstanceProfileInfo",
                code=refused.code if refused else None,
            )
        self._gi_tables[gpu] = table
        return table

    def _placements(self, gpu: int, h: Any, profile_id: int) -> list[Placement]:
        nv = self._nv
        fn = nv.nvmlDeviceGetGpuInstancePossiblePlacements
        count = ctypes.c_uint(0)
        self._call(gpu, fn, h, profile_id, None, ctypes.byref(count))
        if not count.value:
            return []
        arr = (nv.c_nvmlGpuInstancePlacement_t * count.value)()
        self._call(gpu, fn, h, profile_id, arr, ctypes.byref(count))
        return [
            Placement(start=int(arr[i].start), size=int(arr[i].size)) for i in range(count.value)
        ]

    def _gi_profile(self, gpu: int, profile_id: int) -> GpuInstanceProfile:
        entry = self._gi_table(gpu).get(profile_id)
        if entry is None:
            raise NotSupported(
                f"GPU instance profile id {profile_id} is not offered by GPU {gpu}",
                gpu=gpu,
                uuid=self._uuids.get(gpu),
                call="nvmlDeviceGetGpuInstanceProfileInfo",
            )
        return entry[0]

    def gpu_instance_profiles(self, gpu: int) -> list[GpuInstanceProfile]:
        """``nvidia-smi mig -i N -lgip``. The 580-series driver answers with MIG mode off too;
        a driver that answers only with MIG mode on raises NotSupported."""
        return [p for p, _ in self._gi_table(gpu).values()]

    def gpu_instance_placements(self, gpu: int, gpu_instance_profile_id: int) -> list[Placement]:
        """``nvidia-smi mig -i N -lgipp``: where a profile may be placed, in memory slices."""
        self._gi_profile(gpu, gpu_instance_profile_id)
        return list(self._gi_table(gpu)[gpu_instance_profile_id][1])

    def _gi_handles(self, gpu: int, profile: GpuInstanceProfile) -> list[Any]:
        nv = self._nv
        count = ctypes.c_uint(0)
        arr = (nv.c_nvmlGpuInstance_t * max(1, profile.instance_count))()
        self._call(
            gpu,
            nv.nvmlDeviceGetGpuInstances,
            self._handle(gpu),
            profile.id,
            arr,
            ctypes.byref(count),
        )
        return [arr[i] for i in range(count.value)]

    def _ci_table(
        self, gpu: int, gi_profile: GpuInstanceProfile, gi_handle: Any
    ) -> list[ComputeInstanceProfile]:
        key = (self.identity(gpu).product, gi_profile.id)
        cached = self._ci_tables.get(key)
        if cached is not None:
            return cached
        nv = self._nv
        out = []
        count = int(getattr(nv, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 0x9))
        shared = nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        for constant in range(count):
            try:
                info = self._call(
                    gpu,
                    nv.nvmlGpuInstanceGetComputeInstanceProfileInfo,
                    gi_handle,
                    constant,
                    shared,
                )
            except _SKIP_PROFILE:
                continue
            except BackendError as err:
                if err.code == _INVALID_ARGUMENT:
                    continue
                raise
            name = _text(getattr(info, "name", b"")).removeprefix("MIG ").strip()
            slices = int(info.sliceCount)
            out.append(
                ComputeInstanceProfile(
                    id=int(info.id),
                    profile=constant,
                    name=name
                    or (
                        gi_profile.name
                        if slices == gi_profile.slice_count
                        else f"{slices}c.{gi_profile.name}"
                    ),
                    slice_count=slices,
                    instance_count=int(info.instanceCount),
                    multiprocessor_count=int(info.multiprocessorCount),
                )
            )
        self._ci_tables[key] = out
        return out

    def compute_instance_profiles(
        self, gpu: int, gpu_instance_profile_id: int
    ) -> list[ComputeInstanceProfile]:
        """``nvidia-smi mig -i N -gi G -lcip`` for a GPU instance profile.

        NVML reads these from a GPU instance, so one of that profile must exist on some GPU
        of the same product (the answer is cached per product); otherwise DeviceNotFound.
        """
        profile = self._gi_profile(gpu, gpu_instance_profile_id)
        cached = self._ci_tables.get((self.identity(gpu).product, profile.id))
        if cached is not None:
            return list(cached)
        handles = self._gi_handles(gpu, profile)
        if not handles:
            raise DeviceNotFound(
                f"GPU {gpu} has no {profile.name} GPU instance to read compute instance profiles from",
                gpu=gpu,
                uuid=self._uuids.get(gpu),
                call="nvmlGpuInstanceGetComputeInstanceProfileInfo",
            )
        return list(self._ci_table(gpu, profile, handles[0]))

    # -- MIG instances -----------------------------------------------------------------------

    def _gi_info(self, gpu: int, gi_handle: Any, profile: GpuInstanceProfile) -> GpuInstanceInfo:
        nv = self._nv
        info = self._call(gpu, nv.nvmlGpuInstanceGetInfo, gi_handle)
        cis: list[ComputeInstanceInfo] = []
        for ci_profile in self._ci_table(gpu, profile, gi_handle):
            count = ctypes.c_uint(0)
            arr = (nv.c_nvmlComputeInstance_t * max(1, ci_profile.instance_count))()
            self._call(
                gpu,
                nv.nvmlGpuInstanceGetComputeInstances,
                gi_handle,
                ci_profile.id,
                arr,
                ctypes.byref(count),
            )
            for i in range(count.value):
                cis.append(self._ci_info(gpu, arr[i]))
        return GpuInstanceInfo(
            id=int(info.id),
            profile_id=int(info.profileId),
            placement=Placement(start=int(info.placement.start), size=int(info.placement.size)),
            compute_instances=tuple(sorted(cis, key=lambda c: c.id)),
        )

    def _ci_info(self, gpu: int, ci_handle: Any) -> ComputeInstanceInfo:
        info = self._call(gpu, self._nv.nvmlComputeInstanceGetInfo, ci_handle)
        return ComputeInstanceInfo(
            id=int(info.id),
            profile_id=int(info.profileId),
            placement=Placement(start=int(info.placement.start), size=int(info.placement.size)),
        )

    def gpu_instances(self, gpu: int) -> list[GpuInstanceInfo]:
        """``nvidia-smi mig -i N -lgi`` with each instance's ``-lci``."""
        out = []
        for profile, _ in self._gi_table(gpu).values():
            for h in self._gi_handles(gpu, profile):
                out.append(self._gi_info(gpu, h, profile))
        return sorted(out, key=lambda g: g.id)

    def create_gpu_instance(
        self, gpu: int, gpu_instance_profile_id: int, placement: Placement
    ) -> GpuInstanceInfo:
        """``nvidia-smi mig -i N -cgi <id>`` at an explicit placement (start:size)."""
        nv = self._nv
        profile = self._gi_profile(gpu, gpu_instance_profile_id)
        p = nv.c_nvmlGpuInstancePlacement_t()
        p.start = placement.start
        p.size = placement.size
        h = self._call(
            gpu,
            nv.nvmlDeviceCreateGpuInstanceWithPlacement,
            self._handle(gpu),
            profile.id,
            ctypes.byref(p),
        )
        return self._gi_info(gpu, h, profile)

    def _gi_by_id(self, gpu: int, gpu_instance_id: int) -> Any:
        return self._call(
            gpu, self._nv.nvmlDeviceGetGpuInstanceById, self._handle(gpu), gpu_instance_id
        )

    def destroy_gpu_instance(self, gpu: int, gpu_instance_id: int) -> None:
        """``nvidia-smi mig -i N -dgi -gi G`` (InUse while compute instances remain)."""
        self._call(gpu, self._nv.nvmlGpuInstanceDestroy, self._gi_by_id(gpu, gpu_instance_id))

    def create_compute_instance(
        self, gpu: int, gpu_instance_id: int, compute_instance_profile_id: int
    ) -> ComputeInstanceInfo:
        """``nvidia-smi mig -i N -gi G -cci <id>``."""
        gi = self._gi_by_id(gpu, gpu_instance_id)
        ci = self._call(
            gpu, self._nv.nvmlGpuInstanceCreateComputeInstance, gi, compute_instance_profile_id
        )
        return self._ci_info(gpu, ci)

    def destroy_compute_instance(
        self, gpu: int, gpu_instance_id: int, compute_instance_id: int
    ) -> None:
        """``nvidia-smi mig -i N -gi G -dci -ci C`` (InUse while processes run on it)."""
        nv = self._nv
        gi = self._gi_by_id(gpu, gpu_instance_id)
        ci = self._call(gpu, nv.nvmlGpuInstanceGetComputeInstanceById, gi, compute_instance_id)
        self._call(gpu, nv.nvmlComputeInstanceDestroy, ci)

    # -- MIG devices -------------------------------------------------------------------------

    def mig_devices(self, gpu: int) -> list[MigDeviceIdentity]:
        """The MIG lines of ``nvidia-smi -L`` for one GPU, in MIG device index order."""
        nv = self._nv
        h = self._handle(gpu)
        try:
            current, _ = self._call(gpu, nv.nvmlDeviceGetMigMode, h)
        except NotSupported:
            return []
        if not current:
            return []
        out = []
        for index in range(int(self._call(gpu, nv.nvmlDeviceGetMaxMigDeviceCount, h))):
            try:
                mh = self._call(gpu, nv.nvmlDeviceGetMigDeviceHandleByIndex, h, index)
            except DeviceNotFound:
                continue  # an empty slot
            uuid = _text(self._call(gpu, nv.nvmlDeviceGetUUID, mh))
            ident = self._mig_ids.get((gpu, index, uuid))
            if ident is None:
                ident = self._mig_identity(gpu, index, uuid, h, mh)
                self._mig_ids[(gpu, index, uuid)] = ident
            out.append(ident)
        return out

    def _mig_identity(self, gpu: int, index: int, uuid: str, h: Any, mh: Any) -> MigDeviceIdentity:
        nv = self._nv
        gi_id = int(self._call(gpu, nv.nvmlDeviceGetGpuInstanceId, mh))
        ci_id = int(self._call(gpu, nv.nvmlDeviceGetComputeInstanceId, mh))
        attrs = self._call(gpu, nv.nvmlDeviceGetAttributes, mh)
        gi_slices = int(attrs.gpuInstanceSliceCount)
        ci_slices = int(attrs.computeInstanceSliceCount)
        memory_mib = int(attrs.memorySizeMB)
        table = self._gi_table(gpu)
        profile: GpuInstanceProfile | None = None
        placement: Placement | None = None
        try:
            info = self._call(
                gpu,
                nv.nvmlGpuInstanceGetInfo,
                self._call(gpu, nv.nvmlDeviceGetGpuInstanceById, h, gi_id),
            )
            entry = table.get(int(info.profileId))
            profile = entry[0] if entry else None
            placement = Placement(int(info.placement.start), int(info.placement.size))
        except BackendError:
            # Reading GPU instances may need privileges; fall back to matching the table.
            pass
        if profile is None:
            candidates = [p for p, _ in table.values() if p.slice_count == gi_slices]
            candidates.sort(key=lambda p: (abs(p.memory_bytes // MiB - memory_mib), p.jpeg_count))
            profile = candidates[0] if candidates else None
        gi_name = profile.name if profile else f"{gi_slices}g.{round(memory_mib / 1024)}gb"
        return MigDeviceIdentity(
            gpu=gpu,
            mig=index,
            uuid=uuid,
            gpu_instance_id=gi_id,
            compute_instance_id=ci_id,
            gpu_instance_profile_id=profile.id if profile else -1,
            profile_name=gi_name if ci_slices >= gi_slices else f"{ci_slices}c.{gi_name}",
            memory_total_bytes=memory_mib * MiB,
            multiprocessor_count=int(attrs.multiprocessorCount),
            gpu_instance_placement=placement,
        )

    # -- events ------------------------------------------------------------------------------

    def _events(self) -> Any:
        """The event set, made on first use (and after a reset), with each GPU registered
        on it by a thread of its own: a GPU that does not answer stays out of it until it
        does, and no other GPU's events wait for it."""
        with self._registry_lock:
            es = self._event_set
            if es is None:
                es = self._event_set = self._call(None, self._nv.nvmlEventSetCreate)
                self._reregister_at.clear()
                # A GPU still stuck registering on an earlier set moves to this one when it
                # answers.
                starting = [g for g in range(self._count) if g not in self._registering]
            else:
                # a GPU lost at its last registration joins the set once it answers again
                now = self._clock()
                starting = [
                    g
                    for g, at in self._reregister_at.items()
                    if at <= now and g not in self._registering
                ]
                if not starting:
                    return es
            for g in starting:
                self._reregister_at.pop(g, None)
            self._registering.update(starting)
        threads = [
            threading.Thread(
                target=self._register, args=(gpu, es), name=f"gpud-events-{gpu}", daemon=True
            )
            for gpu in starting
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + REGISTER_WAIT_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return es

    def _register(self, gpu: int, es: Any) -> None:
        """``nvmlDeviceRegisterEvents`` of one GPU on ``es``; again on whichever set replaced
        it meanwhile (a reset may also have failed the call), until the set it tried is still
        the current one."""
        nv = self._nv
        while True:
            xids = False
            try:
                h = self._handle(gpu)
                supported = int(self._call(gpu, nv.nvmlDeviceGetSupportedEventTypes, h))
                if supported & _WANTED_EVENTS:
                    self._call(gpu, nv.nvmlDeviceRegisterEvents, h, supported & _WANTED_EVENTS, es)
                    xids = bool(supported & _XID_EVENT)
            except Exception as err:  # a GPU without events (or faulty) has none to wait for
                if not isinstance(err, BackendError):
                    log.exception("registering GPU %d for events failed", gpu)
                # lost, hung or in need of an operator: registered again once it answers
                lost = isinstance(err, GPU_FAULTS)
            else:
                lost = False
            with self._registry_lock:
                if lost:
                    self._reregister_at[gpu] = self._clock() + REREGISTER_S
                else:  # registered again (on a new set): no retry due
                    self._reregister_at.pop(gpu, None)
                if xids:
                    self._xid_unwatched.discard(gpu)
                else:
                    self._xid_unwatched.add(gpu)
                current = self._event_set
                if current is None or current is es:
                    self._registering.discard(gpu)
                    return
                es = current

    def _drop_event_set(self) -> None:
        """``nvmlEventSetFree``, unless a registration still in the driver holds the set:
        then it is left behind (the next wait makes a new one)."""
        with self._registry_lock:
            es, self._event_set = self._event_set, None
            free = es is not None and not self._registering
        if free:
            with contextlib.suppress(self._error):
                self._nv.nvmlEventSetFree(es)

    def _gpu_of(self, device: Any) -> int:
        """The index of an event's device handle. It runs under the events lock, so it asks
        the driver nothing about other GPUs: one that does not answer would hold up every
        GPU's events."""
        for i, h in enumerate(self._handles):
            if h is not None and _same_handle(h, device):
                return i
        try:
            uuid = _text(self._nv.nvmlDeviceGetUUID(device))
        except self._error:
            return -1
        for i in range(self._count):
            if self._uuids.get(i) == uuid:
                return i
        return -1

    def xid_watched(self, gpu: int) -> bool:
        """False once registering the GPU for XID events ended without them (the driver
        does not support them for it, or the GPU did not answer): its XIDs never reach
        :meth:`wait_events`. True before the first registration ends."""
        with self._registry_lock:
            return gpu not in self._xid_unwatched

    def wait_events(self, timeout_s: float) -> list[GpuEvent]:
        """XID and ECC events (``nvmlEventSetWait``), waiting up to ``timeout_s`` for the first."""
        with self._events_lock:
            return self._wait_events(timeout_s)

    def _wait_events(self, timeout_s: float) -> list[GpuEvent]:
        nv = self._nv
        es = self._events()
        out: list[GpuEvent] = []
        timeout_ms = max(0, int(timeout_s * 1000))
        rebuilt = False
        while True:
            try:
                data = self._call(None, nv.nvmlEventSetWait, es, timeout_ms)
            except DriverTimeout:
                break
            except GpuLost as err:
                # The set answers this at every wait while a GPU on it is lost, and NVML does
                # not say which one. A new set leaves out each GPU that does not answer its
                # registration (retried every REREGISTER_S): the others' events go on.
                if rebuilt:
                    break  # a lost GPU registered again; the next wait tries anew
                log.warning("GPU events: %s; registering the GPUs again", err)
                self._drop_event_set()
                es = self._events()
                rebuilt = True
                continue
            kind = _EVENT_KINDS.get(int(data.eventType))
            if kind is not None:
                out.append(
                    GpuEvent(
                        gpu=self._gpu_of(data.device),
                        kind=kind,
                        xid=int(data.eventData) if kind is EventKind.XID else None,
                        gpu_instance_id=_opt_uint(data.gpuInstanceId),
                        compute_instance_id=_opt_uint(data.computeInstanceId),
                    )
                )
            timeout_ms = 0  # drain what is queued, without waiting again
        return out

    # -- reset -------------------------------------------------------------------------------

    def reset_gpu(self, gpu: int) -> None:
        """``nvidia-smi --gpu-reset -i N`` through the injected runner. The driver refuses a
        reset while any client holds the GPU open, NVML clients included, so this backend
        lets go of NVML for it (event set freed, ``nvmlShutdown``) and initialises it again
        after, with fresh handles. The caller keeps other calls off meanwhile."""
        if self._reset is None:
            raise NotSupported("GPU reset is not available on this backend", gpu=gpu)
        self._handle(gpu)  # no such GPU: DeviceNotFound before anything is let go
        nv = self._nv
        with self._events_lock:
            self._drop_event_set()
            with contextlib.suppress(self._error):
                nv.nvmlShutdown()
            try:
                self._reset(gpu)
            finally:
                self._call(None, nv.nvmlInit)
                self._handles = [None] * self._count
                self._mig_ids = {k: v for k, v in self._mig_ids.items() if k[0] != gpu}
                self._nvlink_last.pop(gpu, None)  # a reset starts the counters again

    def close(self) -> None:
        """Free the event set and ``nvmlShutdown``; errors on the way out are ignored."""
        if self._closed:
            return
        self._closed = True
        nv = self._nv
        self._drop_event_set()
        with contextlib.suppress(self._error):
            nv.nvmlShutdown()


def open_real_backend(
    reset: Callable[[int], None] | None = None, uid: int | None = None, nvml: Any = None
) -> NvmlBackend:
    """The backend over the installed driver (``libnvidia-ml.so.1`` via ``pynvml``, or
    ``nvml`` when given: a module double); ``reset`` and ``uid`` as for :class:`NvmlBackend`.

    Raises DriverNotLoaded when pynvml is missing or NVML cannot be initialised (no driver,
    no library), NoPermission when the driver refuses gpud's user.
    """
    if nvml is not None:
        return NvmlBackend(nvml, reset=reset, uid=uid)
    try:
        import pynvml
    except ImportError as err:
        raise DriverNotLoaded(f"pynvml (nvidia-ml-py) is not installed: {err}") from err
    return NvmlBackend(pynvml, reset=reset, uid=uid)
