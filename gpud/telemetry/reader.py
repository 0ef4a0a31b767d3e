"""Reads one GPU and its MIG devices into a :class:`GpuSample`; runs on that GPU's worker thread.

Per tick this makes, for a GPU (``nvidia-smi -q -i N`` territory): memory, utilization, power,
temperature, clocks, volatile ECC counts, PCIe throughput, NVLink counters, compute processes
and MIG mode; and for each MIG device (``nvidia-smi -q -i N:M``): memory and processes.
Identity (``nvidia-smi -L``) is read once, and the MIG device list again only when it may have
changed (see :class:`GpuReader`), because listing MIG devices costs several driver calls each.

Error policy, per call:

- ``NotSupported``: the field is ``None`` and is not asked again for ``unsupported_retry_s``
  (a GPU in MIG mode answers NotSupported for utilization on every tick otherwise).
- ``GpuLost``: stop reading this GPU for this tick; the sample is unhealthy.
- any other ``BackendError``: that field is ``None``, the rest is still read, the sample is
  unhealthy with the first failing call as the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from gpud.backend.port import GpuBackend, GpuIdentity, MigDeviceIdentity, MigMode, MigReading
from gpud.errors import BackendError, GpuLost, NotSupported
from gpud.telemetry.snapshot import GpuSample, MigSample

log = logging.getLogger(__name__)

# GpuBackend method -> GpuSample field, in the order they are read.
_GPU_FIELDS: tuple[tuple[str, str], ...] = (
    ("memory", "memory"),
    ("utilization", "utilization"),
    ("power_watts", "power_watts"),
    ("temperature_celsius", "temperature_celsius"),
    ("clocks", "clocks"),
    ("ecc_errors", "ecc"),
    ("pcie_throughput", "pcie"),
    ("nvlink_throughput_bytes", "nvlink_bytes"),
    ("processes", "processes"),
)
_MIG_FIELD = ("mig_mode", "mig_mode")  # only on MIG-capable GPUs

_Call = tuple[Callable[[int], Any], str, str]  # bound method, method name, sample field


def placeholder_identity(index: int) -> GpuIdentity:
    """What a GPU is shown as before its identity could ever be read (lost at start-up)."""
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


class _Unsupported:
    """Fields the device answered NotSupported for, and when to ask again."""

    __slots__ = ("_clock", "_retry_s", "_until")

    def __init__(self, clock: Callable[[], float], retry_s: float) -> None:
        self._clock = clock
        self._retry_s = retry_s
        self._until: dict[str, float] = {}

    def skip(self, key: str) -> bool:
        until = self._until.get(key)
        if until is None:
            return False
        if self._clock() >= until:
            del self._until[key]
            return False
        return True

    def mark(self, key: str) -> None:
        self._until[key] = self._clock() + self._retry_s

    def clear(self) -> None:
        self._until.clear()

    def __bool__(self) -> bool:
        return bool(self._until)


class GpuReader:
    """All driver reads for one GPU. Not thread-safe: only its worker thread calls ``read``.

    The MIG device list is re-read when MIG mode changes, when a MIG device read fails (the
    device was destroyed), when :meth:`refresh_identity` was called (gpud changed the layout
    itself), and every ``identity_refresh_s`` (someone ran ``nvidia-smi mig`` by hand).
    """

    def __init__(
        self,
        backend: GpuBackend,
        index: int,
        *,
        clock: Callable[[], float],
        unsupported_retry_s: float,
        identity_refresh_s: float,
    ) -> None:
        self.index = index
        self._backend = backend
        self._clock = clock
        self._identity_refresh_s = identity_refresh_s
        self._unsupported = _Unsupported(clock, unsupported_retry_s)
        # Bound once: the per-tick loop is what the sampler's overhead is made of.
        plain = tuple((getattr(backend, m), m, f) for m, f in _GPU_FIELDS)
        self._calls: tuple[_Call, ...] = plain
        self._calls_mig: tuple[_Call, ...] = (
            *plain,
            (backend.mig_mode, *_MIG_FIELD),
        )
        # Read from the sampler thread too (for timed-out samples): plain reference swaps.
        self.identity: GpuIdentity | None = None
        self._mig: tuple[MigDeviceIdentity, ...] | None = None
        self._mig_read_at = 0.0
        self._mig_current: bool | None = None
        self._refresh_requested = False
        # A failed sample keeps the time of the last good one, so its age keeps growing.
        self._last_good_at = clock()

    def refresh_identity(self) -> None:
        """Re-read identity and the MIG device list on the next read (any thread)."""
        self._refresh_requested = True

    def read(self) -> GpuSample:
        backend = self._backend
        gpu = self.index
        if self._refresh_requested:
            self._refresh_requested = False
            self.identity = None
            self._mig = None
            self._unsupported.clear()
        identity = self.identity
        if identity is None:
            try:
                identity = backend.identity(gpu)
            except BackendError as err:
                return self._failed(placeholder_identity(gpu), _reason("identity", err))
            self.identity = identity

        values: dict[str, Any] = {}
        reason = ""
        unsupported = self._unsupported
        for fn, method, name in self._calls_mig if identity.mig_capable else self._calls:
            if unsupported and unsupported.skip(method):
                continue
            try:
                values[name] = fn(gpu)
            except NotSupported:
                unsupported.mark(method)
            except GpuLost as err:
                return self._failed(identity, _reason(method, err))
            except BackendError as err:
                reason = reason or _reason(method, err)
        processes = values.get("processes")
        values["processes"] = tuple(processes) if processes else ()

        mig_mode: MigMode | None = values.get("mig_mode")
        mig_samples: tuple[MigSample, ...] = ()
        if mig_mode is not None:
            if mig_mode.current != self._mig_current:
                # Entering or leaving MIG mode changes what the GPU supports (utilization).
                if self._mig_current is not None:
                    self._unsupported.clear()
                self._mig_current = mig_mode.current
                self._mig = None
            if mig_mode.current:
                try:
                    mig_samples = self._read_mig(gpu)
                except GpuLost as err:
                    return self._failed(identity, _reason("mig_devices", err))
                except BackendError as err:
                    reason = reason or _reason("mig_devices", err)

        now = self._clock()
        self._last_good_at = now
        return GpuSample(
            identity=identity,
            healthy=not reason,
            reason=reason,
            sampled_at=now,
            mig_devices=mig_samples,
            **values,
        )

    def _read_mig(self, gpu: int) -> tuple[MigSample, ...]:
        backend = self._backend
        now = self._clock()
        devices = self._mig
        if devices is None or now - self._mig_read_at >= self._identity_refresh_s:
            devices = tuple(backend.mig_devices(gpu))
            self._mig = devices
            self._mig_read_at = now
        readings = backend.mig_readings(gpu, [dev.mig for dev in devices])
        samples: list[MigSample] = []
        for dev, reading in zip(devices, readings, strict=True):
            if isinstance(reading, MigReading):
                samples.append(MigSample(dev, reading.memory, reading.processes))
            else:
                # Most likely destroyed since the list was read: list again next tick.
                self._mig = None
                samples.append(MigSample(dev, None, ()))
        return tuple(samples)

    def _failed(self, identity: GpuIdentity, reason: str) -> GpuSample:
        # Re-read the MIG list once the GPU answers again: it may have been reset.
        self._mig = None
        return GpuSample(
            identity=identity, healthy=False, reason=reason, sampled_at=self._last_good_at
        )

    @property
    def last_good_at(self) -> float:
        """Monotonic time of the last read that completed (the reader's creation before)."""
        return self._last_good_at


def _reason(call: str, err: BackendError) -> str:
    if isinstance(err, GpuLost):
        return f"GPU lost ({call}): {err}"
    return f"{call} failed: {err}"
