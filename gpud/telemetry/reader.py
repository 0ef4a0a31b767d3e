"""Reads one GPU and its MIG devices into a :class:`GpuSample`; runs on that GPU's worker thread.

Per tick this makes, for a GPU (``nvidia-smi -q -i N`` territory): memory, utilization, power,
temperature, clocks, volatile ECC counts, PCIe throughput, NVLink counters, compute processes
and MIG mode, in one :meth:`GpuBackend.gpu_readings` call; and for each MIG device
(``nvidia-smi -q -i N:M``): memory and processes, in one :meth:`GpuBackend.mig_readings` call.
Identity (``nvidia-smi -L``) is read once, and the MIG device list again only when it may have
changed (see :class:`GpuReader`), because listing MIG devices costs several driver calls each.

Error policy, per reading:

- ``NotSupported``: the field is ``None`` and is not asked again for ``unsupported_retry_s``
  (a GPU in MIG mode answers NotSupported for utilization on every tick otherwise).
- ``NoPermission`` (a reading only root may take, NVML_ERROR_NO_PERMISSION): as NotSupported,
  and said once in the log; the GPU stays healthy.
- ``GpuLost``: stop reading this GPU for this tick; the sample is unhealthy.
- ``GpuFault`` (reset required, interrupt issue, insufficient power, corrupted infoROM): as
  ``GpuLost``, with the reason led by what the GPU needs ("reset required (memory): ..."):
  the sample has none of the tick's numeric readings, and its ``sampled_at`` stays that of
  the last good read, so ``gpud_gpu_sample_age_seconds`` grows. It keeps the process list
  and the MIG mode the driver still answers: they are what the operator's reset needs
  (``nvidia-smi --gpu-reset`` refuses while processes hold the GPU; the pending MIG mode is
  what the reset switches), not readings that age. Its MIG devices are not read.
- ``DriverTimeout`` (NVML_ERROR_TIMEOUT, a call given a timeout that passed): that reading's
  error alone, as any other below. A GPU hung in a call is found by the call not returning.
- any other ``BackendError``: that field is ``None``, the rest is still read, the sample is
  unhealthy with the first failing reading as the reason.
- a MIG device whose process list fails (NotSupported or not) keeps its memory reading; its
  ``processes_read`` is False with the error, and the GPU's health is that of its other reads.
- a MIG device read that fails with a fault of the GPU itself (``READING_FAULTS``: a MIG
  device answering "reset required", say) is the GPU's, as above: the sample is unhealthy
  with that reason, with no MIG devices (a GPU lost has no MIG mode either). It says
  nothing of them: its ``mig_devices_read`` is False, as whenever the MIG devices were not
  read (the GPU lost, hung or faulty, their list or readings failing), and the last known
  ones stay where they are kept (the MPS targets), not taken for gone. A GPU unhealthy for
  another reading whose MIG devices were read lists those there are: none when all were
  destroyed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpud.backend.port import (
    GpuBackend,
    GpuIdentity,
    GpuReadings,
    MigDeviceIdentity,
    unknown_identity,
)
from gpud.errors import (
    READING_FAULTS,
    BackendError,
    GpuFault,
    GpuLost,
    NoPermission,
    NotSupported,
)
from gpud.telemetry.snapshot import GpuSample, MigSample

log = logging.getLogger(__name__)

_NOT_MIG_CAPABLE = frozenset({"mig_mode"})  # readings never asked of a GPU without MIG


placeholder_identity = unknown_identity
"""What a GPU is shown as before its identity could ever be read (lost at start-up)."""


class _Unsupported:
    """Readings the device answered NotSupported for, and when to ask again.

    ``skip`` is the set to pass to ``gpu_readings``; it is rebuilt only when a reading is
    marked or one's retry time comes, so a tick pays one comparison for it.
    """

    __slots__ = ("_always", "_next_retry", "_retry_s", "_until", "skip")

    def __init__(self, retry_s: float, always: frozenset[str] = frozenset()) -> None:
        self._retry_s = retry_s
        self._always = always
        self._until: dict[str, float] = {}
        self._next_retry = float("inf")
        self.skip = always

    def expire(self, now: float) -> None:
        """Ask again, from ``now`` on, for the readings whose retry time has come."""
        if now < self._next_retry:
            return
        self._until = {k: t for k, t in self._until.items() if now < t}
        self._rebuild()

    def mark(self, key: str, now: float) -> None:
        self._until[key] = now + self._retry_s
        self._rebuild()

    def clear(self) -> None:
        self._until.clear()
        self._rebuild()

    def _rebuild(self) -> None:
        self.skip = self._always.union(self._until)
        self._next_retry = min(self._until.values(), default=float("inf"))


class GpuReader:
    """All driver reads for one GPU. Not thread-safe: only its worker thread calls ``read``.

    The MIG device list is re-read when MIG mode changes, at once in the same tick when a
    MIG device read fails (the device was destroyed, or another moved onto its index), when :meth:`refresh_identity` was called (gpud changed the layout
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
        self._unsupported_retry_s = unsupported_retry_s
        self._unsupported = _Unsupported(unsupported_retry_s)
        # Read from the sampler thread too (for timed-out samples): plain reference swaps.
        self.identity: GpuIdentity | None = None
        self._identity_stale = False  # refresh_identity asked: read it again, keep it till then
        self._mig: tuple[MigDeviceIdentity, ...] | None = None
        self._mig_read_at = 0.0
        self._mig_current: bool | None = None
        self._refresh_requested = False
        self._processes_error = ""  # why the process list last failed
        self._refused: set[str] = set()  # readings the driver refused gpud's user, said once
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
            self._identity_stale = True
            self._mig = None
        identity = self.identity
        if identity is None or self._identity_stale:
            try:
                identity = backend.identity(gpu)
            except BackendError as err:
                # Asked again until it answers. One read before keeps what was read: the
                # board's size and MIG capability, not a placeholder's zeros.
                known = self.identity or placeholder_identity(gpu)
                return self._failed(
                    known, _reason(identity_read(err), err), lost=isinstance(err, GpuLost)
                )
            self.identity = identity
            self._identity_stale = False
            # New identity, fresh view of what the GPU supports.
            self._unsupported = _Unsupported(
                self._unsupported_retry_s,
                frozenset() if identity.mig_capable else _NOT_MIG_CAPABLE,
            )

        now = self._clock()
        unsupported = self._unsupported
        unsupported.expire(now)
        try:
            r = backend.gpu_readings(gpu, unsupported.skip)
        except BackendError as err:
            return self._failed(identity, _reason("readings", err), lost=isinstance(err, GpuLost))
        reason = ""
        processes_read = "processes" not in unsupported.skip
        # while skipped, the NotSupported that marked it is still why they are not listed
        processes_error = "" if processes_read else self._processes_error
        fault: tuple[str, BackendError] | None = None  # the first reading the GPU faulted
        lost = False
        if r.errors:
            for name, error in r.errors:
                if name == "processes":
                    processes_read = False
                    processes_error = self._processes_error = str(error)
                if isinstance(error, NotSupported):
                    unsupported.mark(name, now)
                elif isinstance(error, NoPermission):
                    unsupported.mark(name, now)
                    if name not in self._refused:
                        self._refused.add(name)
                        log.warning("GPU %d: %s not read: %s", gpu, name, error)
                elif isinstance(error, READING_FAULTS):
                    # The GPU's own fault, not one reading's: the numbers it answered this
                    # tick are no reading to trust (the driver may hand back what it last
                    # had), and the sample keeps the time of the last good one, as when
                    # lost. What it holds (processes, MIG mode) is what its reset needs.
                    fault = fault or (name, error)
                    lost = lost or isinstance(error, GpuLost)
                else:
                    reason = reason or _reason(name, error)
        if fault is not None:
            return self._faulted(
                identity, *fault, r, listed=processes_read, unlisted=processes_error, lost=lost
            )

        mig_mode = r.mig_mode
        mig_samples: tuple[MigSample, ...] = ()
        mig_read = True
        if mig_mode is not None:
            if mig_mode.current != self._mig_current:
                # Entering or leaving MIG mode changes what the GPU supports (utilization).
                if self._mig_current is not None:
                    unsupported.clear()
                self._mig_current = mig_mode.current
                self._mig = None
            if mig_mode.current:
                try:
                    mig_samples = self._read_mig(gpu, now)
                except READING_FAULTS as err:
                    lost = isinstance(err, GpuLost)
                    return self._faulted(
                        identity,
                        "mig_devices",
                        err,
                        r,
                        listed=processes_read,
                        unlisted=processes_error,
                        lost=lost,
                    )
                except BackendError as err:
                    reason = reason or _reason("mig_devices", err)
                    mig_read = False

        done = self._clock()
        self._last_good_at = done
        return GpuSample(
            identity=identity,
            healthy=not reason,
            reason=reason,
            sampled_at=done,
            memory=r.memory,
            utilization=r.utilization,
            power_watts=r.power_watts,
            temperature_celsius=r.temperature_celsius,
            clocks=r.clocks,
            ecc=r.ecc,
            pcie=r.pcie,
            processes=r.processes,
            mig_mode=mig_mode,
            mig_devices=mig_samples,
            nvlink_bytes=r.nvlink_bytes,
            processes_read=processes_read,
            processes_error=processes_error,
            mig_devices_read=mig_read,
        )

    def _read_mig(self, gpu: int, now: float) -> tuple[MigSample, ...]:
        devices = self._mig
        if devices is None or now - self._mig_read_at >= self._identity_refresh_s:
            devices, listed = self._list_mig(gpu, now), True
        else:
            listed = False
        readings = self._backend.mig_readings(gpu, devices)
        if readings.errors and not listed:
            # Most likely destroyed or moved since the list was read (a device created or
            # destroyed renumbers the others): list them again now, so that the sample shows
            # the devices there are, not for one tick a removed one. (A device whose memory
            # or process list alone failed was read, and is no error here.)
            readings = self._backend.mig_readings(gpu, self._list_mig(gpu, now))
        if readings.errors:
            self._mig = None  # still: list again next tick
        return readings.devices

    def _list_mig(self, gpu: int, now: float) -> tuple[MigDeviceIdentity, ...]:
        devices = self._mig = tuple(self._backend.mig_devices(gpu))
        self._mig_read_at = now
        return devices

    def _faulted(
        self,
        identity: GpuIdentity,
        name: str,
        error: BackendError,
        r: GpuReadings,
        *,
        listed: bool,
        unlisted: str,
        lost: bool,
    ) -> GpuSample:
        """:meth:`_failed` for a GPU whose reading ``name`` answered a fault of the GPU: a
        lost GPU (``lost``: that or another reading answered GpuLost) answered nothing; one
        that needs an operator keeps its MIG mode as ``r`` read it, and its process list
        when the driver ``listed`` it (else ``unlisted`` says why not)."""
        failed = self._failed(identity, _reason(name, error), lost=lost)
        if lost:
            return failed
        return failed._replace(
            processes=r.processes if listed else (),
            processes_read=listed,
            processes_error=unlisted,
            mig_mode=r.mig_mode,
        )

    def _failed(self, identity: GpuIdentity, reason: str, *, lost: bool) -> GpuSample:
        # Re-read the MIG list once the GPU answers again: it may have been reset.
        self._mig = None
        return GpuSample(
            identity=identity,
            healthy=False,
            reason=reason,
            lost=lost,
            sampled_at=self._last_good_at,
            mig_devices_read=False,
        )

    @property
    def last_good_at(self) -> float:
        """Monotonic time of the last read that completed (the reader's creation before)."""
        return self._last_good_at


# The identity's NVML calls that read what a sample's readings read too, by the readings'
# names: a GPU refused at its first read is said as it would be at any later one
# (``reset required (memory): nvmlDeviceGetMemoryInfo failed``); the other identity calls
# (handle, UUID, name, PCI info, the PCIe link's generation and width) read who the GPU is,
# and say "identity": "pcie" is the later readings' PCIe throughput, another call
_IDENTITY_READS = {
    "nvmlDeviceGetMemoryInfo": "memory",
    "nvmlDeviceGetMigMode": "mig_mode",
}


def identity_read(err: BackendError) -> str:
    """The read of a GPU's identity that ``err`` failed (the driver call it names,
    ``err.call``), as an unhealthy reason's label names it."""
    return _IDENTITY_READS.get(err.call or "", "identity")


def _reason(call: str, err: BackendError) -> str:
    if isinstance(err, GpuLost):
        return f"GPU lost ({call}): {err}"
    if isinstance(err, GpuFault):
        return f"{err.problem} ({call}): {err}"
    return f"{call} failed: {err}"
