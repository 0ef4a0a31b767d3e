"""RDMA devices as gpud sees them, and their discovery from sysfs.

What matters for enforcement: which RDMA ports carry RoCE v2 (the only RoCE whose packets
have an IP header, hence a DSCP field the NIC and switches can classify on), and which
netdevs they sit on -- the NIC's DSCP -> priority map is written per netdev (``dcb app``,
see ``netshaper.dcb``). InfiniBand ports have no DSCP; they are listed and skipped.

Two sources, the same types:

* :class:`SysfsDiscovery` (here, no library): ``<sysfs_root>/class/infiniband/<dev>/``::

      node_guid                         0c42:a103:0012:3456
      fw_ver                            28.39.1002
      device/net/<netdev>/              the PCI function's netdevs
      ports/<n>/state                   "4: ACTIVE" / "1: DOWN"
      ports/<n>/link_layer              "Ethernet" / "InfiniBand"
      ports/<n>/rate                    "200 Gb/sec (4X HDR)"
      ports/<n>/gids/<i>                "0000:0000:0000:0000:0000:ffff:0a00:0001"
      ports/<n>/gid_attrs/types/<i>     "RoCE v2" / "IB/RoCE v1"
      ports/<n>/gid_attrs/ndevs/<i>     "eth2"

  (``rdma link show`` and ``show_gids`` print the same.)
* ``netshaper.rdma_verbs.VerbsDiscovery`` through pyverbs (``ibv_query_port``,
  ``ibv_query_gid_table``), when rdma-core's Python binding is installed.

``sysfs_root`` is a parameter so tests run on a small tree (``tests/data/sysfs-rdma``).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

ROCE_V2 = "RoCE v2"
ROCE_V1 = "IB/RoCE v1"
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


@dataclass(frozen=True)
class Gid:
    """One populated GID table entry of a port."""

    index: int
    gid: str
    type: str  # "RoCE v2", "IB/RoCE v1" (RoCE v1 or plain IB)
    netdev: str | None

    @property
    def roce_v2(self) -> bool:
        return self.type == ROCE_V2

    @property
    def ip(self) -> str | None:
        """The IP address the GID stands for (RoCE), IPv4-mapped ones as IPv4."""
        try:
            addr = ipaddress.IPv6Address(self.gid)
        except ValueError:
            return None
        return str(addr.ipv4_mapped) if addr.ipv4_mapped else str(addr)


@dataclass(frozen=True)
class RdmaPort:
    """One port of an RDMA device (``ibv_devinfo -d DEV -i PORT``)."""

    device: str
    port: int
    state: str  # "ACTIVE", "DOWN", "INIT", ...
    link_layer: str  # "Ethernet" (RoCE) or "InfiniBand"
    rate_gbps: float | None
    gids: tuple[Gid, ...] = ()

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def roce(self) -> bool:
        return self.link_layer == "Ethernet"

    @property
    def roce_v2_gids(self) -> tuple[Gid, ...]:
        return tuple(g for g in self.gids if g.roce_v2)

    @property
    def netdevs(self) -> tuple[str, ...]:
        return tuple(sorted({g.netdev for g in self.gids if g.netdev}))


@dataclass(frozen=True)
class RdmaDevice:
    """One RDMA device (``rdma dev show``): ports and the netdevs of its PCI function."""

    name: str
    node_guid: str | None
    fw_ver: str | None
    ports: tuple[RdmaPort, ...]
    netdevs: tuple[str, ...] = ()


class RdmaDiscovery(Protocol):
    """Lists the node's RDMA devices; sysfs and pyverbs implement it."""

    def devices(self) -> tuple[RdmaDevice, ...]: ...


@dataclass(frozen=True)
class RoceTarget:
    """A netdev whose NIC map must carry the DSCP -> priority entries, and why."""

    netdev: str
    device: str
    port: int
    active: bool


def roce_v2_targets(devices: Iterable[RdmaDevice]) -> tuple[RoceTarget, ...]:
    """The netdevs behind RoCE v2 GIDs, one per netdev, sorted. Down ports are included
    (their map is written too, so it holds when the link comes up) and marked."""
    seen: dict[str, RoceTarget] = {}
    for dev in devices:
        for port in dev.ports:
            if not port.roce:
                continue
            for gid in port.roce_v2_gids:
                if gid.netdev and gid.netdev not in seen:
                    seen[gid.netdev] = RoceTarget(gid.netdev, dev.name, port.port, port.active)
    return tuple(sorted(seen.values(), key=lambda t: t.netdev))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:  # unset GID attributes read as EINVAL; missing files as ENOENT
        return None


def _state(text: str | None) -> str:
    # "4: ACTIVE" -> "ACTIVE"
    if not text:
        return "UNKNOWN"
    return text.split(":", 1)[-1].strip()


def _rate(text: str | None) -> float | None:
    # "200 Gb/sec (4X HDR)" -> 200.0
    if not text:
        return None
    try:
        return float(text.split()[0])
    except (ValueError, IndexError):
        return None


def _numeric_entries(path: str) -> list[int]:
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit())


class SysfsDiscovery:
    """Reads ``<sysfs_root>/class/infiniband``; no library needed."""

    def __init__(self, sysfs_root: str = "/sys") -> None:
        self._base = os.path.join(sysfs_root, "class", "infiniband")

    def devices(self) -> tuple[RdmaDevice, ...]:
        try:
            names = sorted(os.listdir(self._base))
        except OSError:
            return ()  # no RDMA stack loaded: no devices
        return tuple(self._device(n) for n in names)

    def _device(self, name: str) -> RdmaDevice:
        d = os.path.join(self._base, name)
        ports = tuple(
            self._port(name, os.path.join(d, "ports", str(n)), n)
            for n in _numeric_entries(os.path.join(d, "ports"))
        )
        try:
            netdevs = tuple(sorted(os.listdir(os.path.join(d, "device", "net"))))
        except OSError:
            netdevs = ()
        return RdmaDevice(
            name,
            _read(os.path.join(d, "node_guid")),
            _read(os.path.join(d, "fw_ver")),
            ports,
            netdevs,
        )

    def _port(self, device: str, p: str, n: int) -> RdmaPort:
        gids: list[Gid] = []
        for i in _numeric_entries(os.path.join(p, "gids")):
            gid = _read(os.path.join(p, "gids", str(i)))
            if not gid or gid == ZERO_GID:
                continue
            gtype = _read(os.path.join(p, "gid_attrs", "types", str(i))) or ROCE_V1
            ndev = _read(os.path.join(p, "gid_attrs", "ndevs", str(i))) or None
            gids.append(Gid(i, gid, gtype, ndev))
        return RdmaPort(
            device=device,
            port=n,
            state=_state(_read(os.path.join(p, "state"))),
            link_layer=_read(os.path.join(p, "link_layer")) or "InfiniBand",
            rate_gbps=_rate(_read(os.path.join(p, "rate"))),
            gids=tuple(gids),
        )
