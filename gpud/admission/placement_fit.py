"""Admission's "what fits", answered by the reservation code's own placement.

:func:`gpud.jobs.placement.choose_devices` accounts MPS pinned memory per device; this adds
the MPS active thread share (the percentages of the clients on a device add up to at most
100 %), so that a request that sets ``--threads`` queues instead of over-subscribing SMs:
placement itself keeps that sum (:attr:`~gpud.jobs.placement.DeviceLoad.threads_percent`),
given here as the loads hold it, so the gate and ``gpuctl env``'s preview choose alike.
A request without a memory limit asks for each device's MPS default limit
(:attr:`~gpud.admission.model.Device.default_memory`) there, as placement does.
Both checks are monotone in the loads, as :class:`~gpud.admission.model.FitCheck` asks.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from gpud.admission.model import (
    ZERO,
    Demand,
    Device,
    Request,
    Unfeasible,
    Vec,
)
from gpud.errors import NotFound, ResourceExhausted
from gpud.jobs.placement import DeviceLoad, choose_devices
from gpud.jobs.registry import JobSpec
from gpud.mps.manager import MpsTarget
from gpud.shared import MAX_THREADS_PERCENT, format_size


class PlacementFit:
    """:class:`~gpud.admission.model.FitCheck` over a fixed list of devices."""

    def __init__(self, devices: Sequence[Device]) -> None:
        self._devices = tuple(devices)
        self._by_uuid = {d.uuid: d for d in self._devices}
        self._targets = {
            d.uuid: MpsTarget(d.uuid, d.gpu, d.mig, d.profile, d.capacity.memory)
            for d in self._devices
        }

    def devices(self) -> Sequence[Device]:
        return self._devices

    def _default_memory(self, uuid: str) -> int | None:
        return self._by_uuid[uuid].default_memory

    def _default_threads(self, uuid: str) -> int | None:
        return self._by_uuid[uuid].default_threads

    def demand(self, request: Request) -> Demand | Unfeasible:
        need = request.per_device
        if need.threads > MAX_THREADS_PERCENT:
            return Unfeasible(
                f"asks {need.threads}% of a device's threads; {MAX_THREADS_PERCENT}% is all"
            )
        if request.devices:
            missing = [u for u in request.devices if u not in self._by_uuid]
            if missing:
                return Unfeasible(f"no GPU or MIG device {', '.join(missing)} on this node")
            devices = [self._by_uuid[u] for u in request.devices]
            count = len(devices)
        elif request.mig_profile is not None:
            devices = [d for d in self._devices if d.is_mig and d.profile == request.mig_profile]
            count = 1
            if not devices:
                have = sorted({d.profile for d in self._devices if d.is_mig})
                return Unfeasible(
                    f"no MIG device of profile {request.mig_profile} on this node"
                    f" (MIG profiles here: {', '.join(have) or 'none'})"
                )
        else:
            devices = [d for d in self._devices if not d.is_mig]
            count = request.gpu_count or 1
            if len(devices) < count:
                whole = len(devices)
                return Unfeasible(
                    f"asks {count} whole GPU{'s' if count > 1 else ''}; this node has {whole}"
                    f" GPU{'' if whole == 1 else 's'} not in MIG mode (name a MIG profile:"
                    " gpuctl run --mig)"
                )
        pool = tuple(d.uuid for d in devices)
        # by device, not by UUID (every GPU never read has the UUID ""); one of unknown size
        # may take the request when it answers again: that is a wait, not a proof
        roomy = [d for d in devices if not d.size_known or request.on(d).fits_in(d.capacity)]
        if len(roomy) < count:
            largest = max(d.capacity.memory for d in devices)
            return Unfeasible(
                f"asks {format_size(need.memory)} on each of {count} device(s);"
                f" {len(roomy)} of them have that much (largest: {format_size(largest)})"
            )
        by_device = tuple((d.uuid, request.on(d)) for d in devices if request.on(d) != need)
        return Demand(pool, need, count, by_device)

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
        candidates = [
            self._targets[d.uuid] for d in self._devices if allowed is None or d.uuid in allowed
        ]
        held, known = names or {}, users or {}
        # placement leaves out the devices without room for the thread share itself, before
        # it counts the idle ones, as it does for gpuctl env's preview from the same loads
        device_loads = {
            uuid: DeviceLoad(
                loads.get(uuid, ZERO).memory,
                tuple(sorted(held.get(uuid, ()))),
                users=tuple(sorted(known.get(uuid, ()))),
                threads_percent=loads.get(uuid, ZERO).threads,
            )
            for uuid in loads.keys() | held.keys() | known.keys()
        }
        spec = JobSpec(
            name="queued",
            devices=request.devices,
            mig_profile=request.mig_profile,
            gpu_count=request.gpu_count,
            threads_percent=request.threads_percent,
        )
        try:
            chosen = choose_devices(
                spec,
                candidates,
                device_loads,
                memory_bytes=request.memory_bytes,
                default_memory=self._default_memory,
                default_threads=self._default_threads,
                uid=uid,
            )
        except (NotFound, ResourceExhausted):
            return None
        return tuple(d.uuid for d in chosen)
