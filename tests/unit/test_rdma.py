"""RDMA discovery: sysfs on a fake tree, and pyverbs through a double of pyverbs.device.

Both sources describe the same two mlx5 devices and must return equal values.
"""

from __future__ import annotations

import importlib.util
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from netshaper.rdma import ROCE_V1, ROCE_V2, Gid, RoceTarget, SysfsDiscovery, roce_v2_targets
from netshaper.rdma_verbs import VerbsDiscovery, VerbsUnavailable, open_discovery

SYSFS = str(Path(__file__).parents[1] / "data" / "sysfs-rdma")
LL0 = "fe80:0000:0000:0000:0e42:a1ff:fe12:3456"
LL1 = "fe80:0000:0000:0000:0e42:a1ff:fe12:3457"
V4 = "0000:0000:0000:0000:0000:ffff:0a00:0001"


def test_sysfs_discovery_reads_devices_ports_and_gids() -> None:
    devs = SysfsDiscovery(SYSFS).devices()
    assert [d.name for d in devs] == ["mlx5_0", "mlx5_1"]
    d0, d1 = devs
    assert (d0.node_guid, d0.fw_ver, d0.netdevs) == ("0c42:a103:0012:3456", "28.39.1002", ("eth2",))
    (p0,) = d0.ports
    assert (p0.port, p0.state, p0.active, p0.link_layer, p0.roce, p0.rate_gbps) == (
        1,
        "ACTIVE",
        True,
        "Ethernet",
        True,
        200.0,
    )
    assert p0.gids == (  # index 4 is unset (all zeros) and skipped
        Gid(0, LL0, ROCE_V1, "eth2"),
        Gid(1, LL0, ROCE_V2, "eth2"),
        Gid(2, V4, ROCE_V1, "eth2"),
        Gid(3, V4, ROCE_V2, "eth2"),
    )
    assert [g.ip for g in p0.roce_v2_gids] == ["fe80::e42:a1ff:fe12:3456", "10.0.0.1"]
    (p1,) = d1.ports
    assert (p1.state, p1.active, p1.rate_gbps, p1.netdevs) == ("DOWN", False, 10.0, ("eth3",))


def test_roce_v2_targets_are_the_netdevs_to_map() -> None:
    assert roce_v2_targets(SysfsDiscovery(SYSFS).devices()) == (
        RoceTarget("eth2", "mlx5_0", 1, active=True),
        RoceTarget("eth3", "mlx5_1", 1, active=False),
    )


def test_no_rdma_stack_means_no_devices(tmp_path: Path) -> None:
    assert SysfsDiscovery(str(tmp_path)).devices() == ()


# --- a double of pyverbs.device with the same two devices -----------------------------


@dataclass
class _Entry:
    gid: str
    gid_index: int
    port_num: int
    gid_type: int
    ndev_ifindex: int

    def gid_str(self) -> str:
        return self.gid


@dataclass
class _Port:
    state: int
    link_layer: int


@dataclass
class _Attr:
    phys_port_cnt: int
    node_guid: int
    fw_version: str


@dataclass
class _Dev:
    name: bytes
    attr: _Attr
    ports: dict[int, _Port]
    gids: list[_Entry] = field(default_factory=list)


class FakeVerbs:
    IFINDEX = {7: "eth2", 8: "eth3"}

    def __init__(self) -> None:
        self.devs = {
            "mlx5_0": _Dev(
                b"mlx5_0",
                _Attr(1, 0x0C42A10300123456, "28.39.1002"),
                {1: _Port(4, 2)},
                [
                    _Entry(LL0, 0, 1, 1, 7),
                    _Entry(LL0, 1, 1, 2, 7),
                    _Entry(V4, 2, 1, 1, 7),
                    _Entry(V4, 3, 1, 2, 7),
                ],
            ),
            "mlx5_1": _Dev(
                b"mlx5_1",
                _Attr(1, 0x0C42A10300123457, "28.39.1002"),
                {1: _Port(1, 2)},
                [_Entry(LL1, 0, 1, 1, 8), _Entry(LL1, 1, 1, 2, 8)],
            ),
        }
        self.opened: list[str] = []

    def get_device_list(self) -> list[_Dev]:
        return list(self.devs.values())

    def Context(self, *, name: str) -> Any:  # pyverbs' own name
        verbs = self
        dev = self.devs[name]
        self.opened.append(name)

        class _Ctx:
            def __enter__(self) -> _Ctx:
                return self

            def __exit__(self, *exc: object) -> None:
                verbs.opened.remove(name)

            def query_device(self) -> _Attr:
                return dev.attr

            def query_port(self, n: int) -> _Port:
                return dev.ports[n]

            def query_gid_table(self, max_entries: int) -> list[_Entry]:
                return dev.gids[:max_entries]

        return _Ctx()


def test_verbs_discovery_agrees_with_sysfs() -> None:
    verbs = FakeVerbs()
    found = VerbsDiscovery(verbs, ifname=FakeVerbs.IFINDEX.__getitem__, sysfs_root=SYSFS).devices()
    assert found == SysfsDiscovery(SYSFS).devices()
    assert verbs.opened == []  # every context closed


def test_a_device_verbs_cannot_open_is_read_from_sysfs(caplog: pytest.LogCaptureFixture) -> None:
    """/dev/infiniband closed to gpud (a unit's DevicePolicy=closed): opening the device
    fails with EPERM; sysfs still names its GIDs and netdevs, and the other device is read
    through verbs."""
    verbs = FakeVerbs()
    opened = verbs.Context

    def context(*, name: str) -> Any:
        if name == "mlx5_0":
            raise PermissionError(1, "Failed to open device mlx5_0")
        return opened(name=name)

    verbs.Context = context  # type: ignore[method-assign]
    discovery = VerbsDiscovery(verbs, ifname=FakeVerbs.IFINDEX.__getitem__, sysfs_root=SYSFS)
    for _ in range(2):
        assert discovery.devices() == SysfsDiscovery(SYSFS).devices()
    assert [r.getMessage() for r in caplog.records if "mlx5_0" in r.getMessage()] == [
        "RDMA device mlx5_0: verbs cannot read it ([Errno 1] Failed to open device mlx5_0);"
        " using sysfs"
    ]  # said once, not every tick


def test_devices_verbs_cannot_list_are_read_from_sysfs(caplog: pytest.LogCaptureFixture) -> None:
    """rdma-core installed where the kernel has no RDMA stack: ibv_get_device_list() fails
    (pyverbs raises "Failed to get devices list"); discovery is sysfs's, said once."""
    verbs = FakeVerbs()

    def no_list() -> list[Any]:
        raise OSError("Failed to get devices list")

    verbs.get_device_list = no_list  # type: ignore[method-assign]
    discovery = VerbsDiscovery(verbs, ifname=FakeVerbs.IFINDEX.__getitem__, sysfs_root=SYSFS)
    caplog.set_level("INFO", logger="netshaper.rdma_verbs")
    for _ in range(2):
        assert discovery.devices() == SysfsDiscovery(SYSFS).devices()
    assert [r.getMessage() for r in caplog.records] == [
        "RDMA devices from sysfs: verbs lists none (Failed to get devices list)"
    ]


@pytest.mark.skipif(importlib.util.find_spec("pyverbs") is None, reason="needs python3-pyverbs")
@pytest.mark.skipif(Path("/sys/class/infiniband").exists(), reason="this machine has RDMA")
def test_the_real_pyverbs_on_a_node_without_rdma_devices(tmp_path: Path) -> None:
    """rdma-core's own binding (``tools/setup.sh --dev`` installs it), on a machine without
    an RDMA stack: discovery answers what sysfs holds instead of raising."""
    assert isinstance(open_discovery(str(tmp_path)), VerbsDiscovery)
    assert VerbsDiscovery(sysfs_root=str(tmp_path)).devices() == ()
    assert VerbsDiscovery(sysfs_root=SYSFS).devices() == SysfsDiscovery(SYSFS).devices()


def test_open_discovery_falls_back_to_sysfs() -> None:
    if importlib.util.find_spec("pyverbs") is None:
        with pytest.raises(VerbsUnavailable):
            VerbsDiscovery()
        assert isinstance(open_discovery(SYSFS), SysfsDiscovery)
    else:  # pragma: no cover - only where rdma-core's binding is installed
        assert isinstance(open_discovery(SYSFS), VerbsDiscovery)


def test_gid_ip_of_a_non_address() -> None:
    assert Gid(0, "not-a-gid", ROCE_V2, None).ip is None
    assert ipaddress.ip_address(Gid(0, V4, ROCE_V2, None).ip or "") == ipaddress.ip_address(
        "10.0.0.1"
    )
