"""The node's side of a job's attributes: the GPUs it holds here and their health.

Reads the job registry's reservations (which GPU / MIG UUIDs each job holds) and the
sampler's latest snapshot (GPUs found lost or hung, last XID per GPU). A MIG device is
unhealthy when its GPU is. Link state is the kernel's ``operstate`` of the interfaces the
traffic service enforces (``cat /sys/class/net/IF/operstate``): a job's traffic leaves
through them, so one that is down is down for every job on the node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from gpud.jobs.placement import Reservation
from gpud.telemetry.snapshot import Snapshot


class DaemonNodeView:
    def __init__(
        self,
        reservations: Callable[[], Iterable[Reservation]],
        snapshot: Callable[[], Snapshot | None],
        *,
        interfaces: Iterable[str] = (),
        sysfs_root: Path = Path("/sys"),
    ) -> None:
        self._reservations = reservations
        self._snapshot = snapshot
        self._interfaces = tuple(interfaces)
        self._sysfs = sysfs_root

    def links_up(self) -> bool | None:
        """False if an enforced interface is not up, None without any (or unreadable)."""
        if not self._interfaces:
            return None
        for name in self._interfaces:
            try:
                state = (self._sysfs / "class" / "net" / name / "operstate").read_text().strip()
            except OSError:
                return False  # gone
            # "unknown": drivers (veth peers in some kernels, tun) that do not report it
            if state not in ("up", "unknown"):
                return False
        return True

    def job_gpus(self) -> Mapping[str, tuple[str, ...]]:
        held: dict[str, list[str]] = {}
        for r in self._reservations():
            devices = held.setdefault(r.job, [])
            devices.extend(d for d in r.devices if d not in devices)
        return {job: tuple(devices) for job, devices in sorted(held.items())}

    def unhealthy_gpus(self) -> Mapping[str, str]:
        snap = self._snapshot()
        bad: dict[str, str] = {}
        for g in snap.gpus if snap is not None else ():
            if not g.healthy:
                reason = g.reason or "unhealthy"
                bad[g.identity.uuid] = reason
                for m in g.mig_devices:
                    bad[m.identity.uuid] = reason
        return bad

    def last_xids(self) -> Mapping[str, int]:
        snap = self._snapshot()
        xids: dict[str, int] = {}
        for g in snap.gpus if snap is not None else ():
            if g.last_xid is not None:
                xids[g.identity.uuid] = g.last_xid
                for m in g.mig_devices:
                    xids[m.identity.uuid] = g.last_xid
        return xids
