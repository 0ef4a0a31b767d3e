"""RDMA discovery through pyverbs (rdma-core's Python binding) -- the only pyverbs importer.

pyverbs is optional: it is not on PyPI (Debian: ``python3-pyverbs``; the virtual
environment needs ``--system-site-packages``). :func:`open_discovery` is what the
composition root calls once: pyverbs when it imports, else ``rdma.SysfsDiscovery``.

What it asks the driver (the calls ``ibv_devinfo -v`` makes)::

    ibv_get_device_list()                      -> device names (mlx5_0, ...)
    ibv_query_device()                         -> phys_port_cnt, fw_ver, node_guid
    ibv_query_port(port)                       -> state (4 = ACTIVE), link_layer (2 = Ethernet)
    ibv_query_gid_table()                      -> index, GID, type (2 = RoCE v2), ndev ifindex

The link rate is read from sysfs (``ports/<n>/rate``), which verbs only give as enum pairs.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from types import ModuleType
from typing import Any

from netshaper.rdma import (
    ROCE_V1,
    ROCE_V2,
    Gid,
    RdmaDevice,
    RdmaDiscovery,
    RdmaPort,
    SysfsDiscovery,
)

log = logging.getLogger(__name__)

IBV_PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
IBV_LINK_LAYER_ETHERNET = 2
IBV_GID_TYPE_ROCE_V2 = 2
GID_TABLE_MAX = 1024


class VerbsUnavailable(Exception):
    """pyverbs cannot be imported (rdma-core's Python binding is not installed)."""


def _import_pyverbs() -> Any:
    try:
        import pyverbs.device as verbs_device
    except ImportError as err:
        raise VerbsUnavailable(f"pyverbs is not installed: {err}") from err
    return verbs_device


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _guid(v: Any) -> str | None:
    if isinstance(v, int):
        h = f"{v:016x}"
        return ":".join(h[i : i + 4] for i in range(0, 16, 4))
    return _text(v) if v else None


class VerbsDiscovery:
    """Lists RDMA devices through pyverbs.

    ``verbs`` is the ``pyverbs.device`` module (or a double with ``get_device_list`` and
    ``Context``); ``ifname`` maps a netdev ifindex to its name; ``sysfs_root`` is where
    the link rate is read.
    """

    def __init__(
        self,
        verbs: ModuleType | Any | None = None,
        *,
        ifname: Callable[[int], str] = socket.if_indextoname,
        sysfs_root: str = "/sys",
    ) -> None:
        self._verbs = verbs if verbs is not None else _import_pyverbs()
        self._ifname = ifname
        self._sysfs = SysfsDiscovery(sysfs_root)
        self._failed: set[str] = set()  # devices whose verbs failure was logged
        self._unlisted = False  # verbs' device list failed, and that was logged

    def devices(self) -> tuple[RdmaDevice, ...]:
        """Every device verbs lists; one verbs cannot open or query (``/dev/infiniband``
        closed to this process, as under a unit with ``DevicePolicy=closed``, or a device in
        a bad state) is described from sysfs instead, which names the same GIDs; so is every
        device when verbs cannot list them (no ``ib_uverbs`` in the kernel)."""
        described = self._sysfs.devices()
        from_sysfs = {d.name: d for d in described}
        try:
            listed = self._verbs.get_device_list()
        # ibv_get_device_list() fails (pyverbs: PyverbsRDMAError "Failed to get devices
        # list") where the kernel has no RDMA stack (ib_uverbs not loaded): rdma-core
        # installed on a node without RDMA is no reason to stop; sysfs says what there is
        except Exception as err:
            if not self._unlisted:
                log.info("RDMA devices from sysfs: verbs lists none (%s)", err)
            self._unlisted = True
            return described
        self._unlisted = False
        rates = {(d.name, p.port): p.rate_gbps for d in from_sysfs.values() for p in d.ports}
        out = []
        for dev in listed:
            name = _text(dev.name)
            try:
                out.append(self._device(name, rates))
            # pyverbs raises its own PyverbsRDMAError (errno inside) and PyverbsError:
            # whatever verbs says, sysfs still describes the device
            except Exception as err:
                if name not in self._failed:
                    log.warning("RDMA device %s: verbs cannot read it (%s); using sysfs", name, err)
                self._failed.add(name)
                if name in from_sysfs:
                    out.append(from_sysfs[name])
            else:
                self._failed.discard(name)
        return tuple(sorted(out, key=lambda d: d.name))

    def _device(self, name: str, rates: dict[tuple[str, int], float | None]) -> RdmaDevice:
        with self._verbs.Context(name=name) as ctx:
            attr = ctx.query_device()
            by_port: dict[int, list[Gid]] = {}
            for e in ctx.query_gid_table(GID_TABLE_MAX):
                netdev = None
                if e.ndev_ifindex:
                    try:
                        netdev = self._ifname(e.ndev_ifindex)
                    except OSError:
                        netdev = None
                gtype = ROCE_V2 if e.gid_type == IBV_GID_TYPE_ROCE_V2 else ROCE_V1
                by_port.setdefault(e.port_num, []).append(
                    Gid(e.gid_index, e.gid_str(), gtype, netdev)
                )
            ports = []
            for n in range(1, attr.phys_port_cnt + 1):
                pa = ctx.query_port(n)
                ports.append(
                    RdmaPort(
                        device=name,
                        port=n,
                        state=IBV_PORT_STATES.get(pa.state, "UNKNOWN"),
                        link_layer="Ethernet"
                        if pa.link_layer == IBV_LINK_LAYER_ETHERNET
                        else "InfiniBand",
                        rate_gbps=rates.get((name, n)),
                        gids=tuple(sorted(by_port.get(n, []), key=lambda g: g.index)),
                    )
                )
        netdevs = tuple(sorted({g.netdev for p in ports for g in p.gids if g.netdev}))
        return RdmaDevice(
            name, _guid(attr.node_guid), _text(attr.fw_version), tuple(ports), netdevs
        )


def open_discovery(sysfs_root: str = "/sys") -> RdmaDiscovery:
    """pyverbs when it is installed, else sysfs (said once in the log)."""
    try:
        return VerbsDiscovery(sysfs_root=sysfs_root)
    except VerbsUnavailable as err:
        log.info("RDMA discovery from sysfs (%s)", err)
        return SysfsDiscovery(sysfs_root)
