"""Faults injected into the simulated driver, as operators rehearse them.

Each fault shows up where a real one would: a lost GPU makes every NVML call on it (and on
its MIG devices) raise ``NVMLError_GpuIsLost`` and posts XID 79 ("GPU has fallen off the
bus"); a GPU that requires a reset makes every query that reaches it answer
``NVML_ERROR_RESET_REQUIRED`` while the driver still names it (handle, UUID, name, PCI
info: ``nvidia-smi -L`` lists it), until it is reset; a NotSupported field makes that one query raise ``NVMLError_NotSupported``; an
erroring reading (``ERRORS``) makes that one query fail with ``NVMLError_Unknown``; a slow GPU
makes each call on it block, like a driver call stuck in the kernel; slow MIG changes make
only the calls that change MIG (create or destroy a GPU or compute instance, set MIG mode)
take longer, as they do on a busy driver, while reads answer at once (telemetry keeps the
GPU healthy, and a long apply can be interrupted between its steps); an XID is delivered to
``nvmlEventSetWait``. ``crash_after_mutations`` kills the caller (``SimulatedCrash``) right
after the n-th driver mutation has taken effect and been persisted.

Faults are device state: with the node's state file they outlive a gpud restart (a GPU lost
before gpud starts stays lost), until :meth:`FaultInjector.clear`, a GPU reset (``nvidia-smi
--gpu-reset``, :meth:`FakeNvml.sim_reset`) or a reboot.
"""

from __future__ import annotations

from typing import Final

from gpud.backend.sim.fakenvml import (
    FakeNvml,
    SimulatedCrash,
    nvmlEventTypeDoubleBitEccError,
    nvmlEventTypeXidCriticalError,
)
from gpud.shared import format_number

__all__ = ["ERRORS", "FIELDS", "FaultInjector", "SimulatedCrash"]

# Field name -> the NVML calls it makes NotSupported (``process_memory``: the value the
# driver leaves NVML_VALUE_NOT_AVAILABLE, as some drivers and modes do, the call answers).
FIELDS: Final[dict[str, str]] = {
    "power": "nvmlDeviceGetPowerUsage",
    "temperature": "nvmlDeviceGetTemperature",
    "clocks": "nvmlDeviceGetClockInfo",
    "ecc": "nvmlDeviceGetTotalEccErrors",
    "pcie": "nvmlDeviceGetPcieThroughput",
    "nvlink": "nvmlDeviceGetFieldValues",
    "utilization": "nvmlDeviceGetUtilizationRates",
    "memory": "nvmlDeviceGetMemoryInfo",
    "processes": "nvmlDeviceGetComputeRunningProcesses",
    "process_memory": "usedGpuMemory of nvmlDeviceGetComputeRunningProcesses",
    "mig": "nvmlDeviceGetMigMode and the MIG instance calls",
    "events": "nvmlDeviceRegisterEvents",
}

# Reading -> the NVML call that fails with NVML_ERROR_UNKNOWN while the rest of the device
# answers (a driver that trips on one query: ``nvidia-smi -q -i 0:1 -d MEMORY`` says
# "Unknown Error").
ERRORS: Final[dict[str, str]] = {
    "mig_memory": "nvmlDeviceGetMemoryInfo on the GPU's MIG devices",
}

# The longest a slow call may hang: past every deadline gpud has, and within what time.sleep
# takes (a longer one fails each call with OverflowError instead of hanging it).
MAX_SLOW_SECONDS: Final = 24 * 3600.0

XID_FALLEN_OFF_BUS: Final = 79
XID_DBE: Final = 48  # double-bit ECC error


def _slow_seconds(seconds: float) -> float:
    if not 0 <= seconds <= MAX_SLOW_SECONDS:
        raise ValueError(f"must be in 0..{MAX_SLOW_SECONDS:g} s, got {format_number(seconds)}")
    return float(seconds)


class FaultInjector:
    """Inject and clear faults on a simulated node's GPUs. Thread-safe."""

    def __init__(self, nvml: FakeNvml) -> None:
        self._nvml = nvml

    def _check_gpu(self, gpu: int) -> None:
        if not 0 <= gpu < self._nvml.sim_gpu_count:
            raise ValueError(f"no GPU {gpu} (the node has {self._nvml.sim_gpu_count})")

    def lose(self, gpu: int) -> None:
        """The GPU falls off the bus: every call on it raises ``NVMLError_GpuIsLost``."""
        self._check_gpu(gpu)
        with self._nvml.sim_locked():  # not between a start's check and the start
            self._nvml.sim_faults(gpu).lost = True
        self._nvml.sim_faults_changed()
        self._nvml.sim_event(gpu, nvmlEventTypeXidCriticalError, XID_FALLEN_OFF_BUS)

    def reset_required(self, gpu: int) -> None:
        """The GPU requires a reset (``nvidia-smi -q``: "GPU requires reset"): every query
        that reaches it, its MIG devices' included, raises ``NVML_ERROR_RESET_REQUIRED``
        until it is reset or the fault is cleared; its handle, UUID, name and PCI info still
        answer."""
        self._check_gpu(gpu)
        with self._nvml.sim_locked():  # not between a start's check and the start
            self._nvml.sim_faults(gpu).reset_required = True
        self._nvml.sim_faults_changed()

    def not_supported(self, gpu: int, field: str) -> None:
        """One field's query raises ``NVMLError_NotSupported`` (see ``FIELDS``)."""
        self._check_gpu(gpu)
        if field not in FIELDS:
            raise ValueError(f"unknown field {field!r}; known: {', '.join(sorted(FIELDS))}")
        self._nvml.sim_faults(gpu).not_supported.add(field)
        self._nvml.sim_faults_changed()

    def error(self, gpu: int, reading: str) -> None:
        """One reading's query fails with ``NVMLError_Unknown`` (see ``ERRORS``)."""
        self._check_gpu(gpu)
        if reading not in ERRORS:
            raise ValueError(f"unknown reading {reading!r}; known: {', '.join(sorted(ERRORS))}")
        self._nvml.sim_faults(gpu).errors.add(reading)
        self._nvml.sim_faults_changed()

    def slow(self, gpu: int, seconds: float) -> None:
        """Every call on the GPU blocks ``seconds`` first (a hung driver call)."""
        self._check_gpu(gpu)
        with self._nvml.sim_locked():  # not between a start's check and the start
            self._nvml.sim_faults(gpu).slow_s = _slow_seconds(seconds)
        self._nvml.sim_faults_changed()

    def slow_mig(self, gpu: int, seconds: float) -> None:
        """Each call that changes MIG on the GPU (``nvidia-smi mig -cgi/-dgi/-cci/-dci``,
        ``-mig``) takes ``seconds`` longer; reads are not slowed."""
        self._check_gpu(gpu)
        self._nvml.sim_faults(gpu).slow_mig_s = _slow_seconds(seconds)
        self._nvml.sim_faults_changed()

    def xid(
        self,
        gpu: int,
        code: int,
        *,
        gpu_instance: int | None = None,
        compute_instance: int | None = None,
    ) -> None:
        """Post an XID event, as the driver logs ``NVRM: Xid (PCI:...): <code>``."""
        self._check_gpu(gpu)
        self._nvml.sim_event(
            gpu, nvmlEventTypeXidCriticalError, int(code), gpu_instance, compute_instance
        )

    def ecc_double_bit(self, gpu: int) -> None:
        """An uncorrectable ECC error: the volatile count rises and an event is posted."""
        self._check_gpu(gpu)
        self._nvml.sim_event(gpu, nvmlEventTypeDoubleBitEccError, 0)

    def clear(self, gpu: int | None = None) -> None:
        """Clear the faults of ``gpu`` (all GPUs when None); the crash trigger too for all."""
        if gpu is None:
            self._nvml.sim_crash_after(None)
        else:
            self._check_gpu(gpu)
        self._nvml.sim_clear_faults(gpu)

    def crash_after_mutations(self, n: int) -> None:
        """Raise ``SimulatedCrash`` once the n-th mutation from now has taken effect."""
        if n < 1:
            raise ValueError("n must be >= 1")
        self._nvml.sim_crash_after(n)

    def active(self) -> dict[int, dict[str, object]]:
        """The current faults per GPU, for display: ``{0: {"lost": True}, ...}``."""
        out: dict[int, dict[str, object]] = {}
        for gpu, f in sorted(self._nvml.sim_fault_table().items()):
            entry: dict[str, object] = {}
            if f.lost:
                entry["lost"] = True
            if f.reset_required:
                entry["reset_required"] = True
            if f.not_supported:
                entry["not_supported"] = sorted(f.not_supported)
            if f.errors:
                entry["errors"] = sorted(f.errors)
            if f.slow_s:
                entry["slow_seconds"] = f.slow_s
            if f.slow_mig_s:
                entry["slow_mig_seconds"] = f.slow_mig_s
            if entry:
                out[gpu] = entry
        return out
