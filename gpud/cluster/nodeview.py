"""The node's side of a job's attributes: the GPUs it holds here and their health.

Reads the job registry's reservations (which GPU / MIG UUIDs each job holds) and the
sampler's latest snapshot (GPUs found lost or hung, each GPU's uncleared critical XIDs). A
MIG device is unhealthy, and has the critical XIDs, of its GPU. A GPU not read since gpud
started goes by the UUID it was last seen with: the one its jobs hold. Link state is the
kernel's state of the interfaces the traffic service enforces, as gpud's own network
namespace sees them (``ip link show IF``: ``state UP``, or ``UNKNOWN`` for a driver that
reports none): a job's traffic leaves through them, so one that is down is down for every
job on the node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from gpud.jobs.placement import Reservation
from gpud.telemetry.snapshot import GpuSample, Snapshot
from netshaper import ethtool

T = TypeVar("T")


class DaemonNodeView:
    def __init__(
        self,
        reservations: Callable[[], Iterable[Reservation]],
        snapshot: Callable[[], Snapshot | None],
        *,
        interfaces: Iterable[str] = (),
        link_running: Callable[[str], bool | None] = ethtool.link_running,
    ) -> None:
        self._reservations = reservations
        self._snapshot = snapshot
        self._interfaces = tuple(interfaces)
        self._link_running = link_running

    def links_up(self) -> bool | None:
        """False if an enforced interface is not up or gone, None without any."""
        if not self._interfaces:
            return None
        return all(self._link_running(name) for name in self._interfaces)

    def job_gpus(self) -> Mapping[str, tuple[str, ...]]:
        held: dict[str, list[str]] = {}
        for r in self._reservations():
            devices = held.setdefault(r.job, [])
            devices.extend(d for d in r.devices if d not in devices)
        return {job: tuple(devices) for job, devices in sorted(held.items())}

    def unhealthy_gpus(self) -> Mapping[str, str]:
        return self._by_device(lambda g: None if g.healthy else g.reason or "unhealthy")

    def critical_xids(self) -> Mapping[str, tuple[int, ...]]:
        return self._by_device(lambda g: tuple(c.xid for c in g.critical_xids) or None)

    def _by_device(self, value: Callable[[GpuSample], T | None]) -> dict[str, T]:
        """UUID of each GPU and of its MIG devices -> ``value`` of the GPU, where not None."""
        snap = self._snapshot()
        out: dict[str, T] = {}
        for g in snap.gpus if snap is not None else ():
            found = value(g)
            if found is not None:
                out[g.known().uuid] = found
                for m in g.mig_devices:
                    out[m.identity.uuid] = found
        return out
