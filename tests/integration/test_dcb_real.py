"""The dcb backend against iproute2's real ``dcb`` in a network namespace (created and
deleted here). No virtual netdev has DCB ops, so what the kernel answers for a NIC without
DCB and for a missing netdev is what is held here; the writes are held against a fake dcb in
tests/unit/test_dcb.py."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from functools import partial

import pytest

from netshaper.dcb import DcbAppBackend, DcbError, NicMap
from netshaper.ethtool import link_type
from netshaper.tc_netlink import netns_socket

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(shutil.which("dcb") is None, reason="needs iproute2's dcb"),
]


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"gdcb{os.getpid()}{uuid.uuid4().hex[:4]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(
            ["ip", "-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
            check=True,
        )
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_a_netdev_without_dcb_is_an_error_naming_it(ns: str) -> None:
    backend = DcbAppBackend(netns=ns)
    with pytest.raises(DcbError) as err:
        backend.apply("v0", {26: 7})
    assert err.value.netdev == "v0"
    assert str(err.value).startswith("v0: app show failed (exit 1)")
    assert str(err.value).endswith(
        "Operation not supported (the netdev's driver has no DCB support)"
    )
    assert err.value.command == f"dcb -n {ns} -j app show dev v0 dscp-prio"


def test_every_netdev_is_tried_and_each_failure_named(ns: str) -> None:
    nic = NicMap(DcbAppBackend(netns=ns), ["v0", "gone0"])
    with pytest.raises(DcbError) as err:
        nic.apply({26: 7, 10: 5})
    assert err.value.netdev == "v0, gone0"
    assert "2 of 2 netdev(s) not written" in str(err.value)
    with pytest.raises(DcbError, match=r"gone0: app show failed \(exit 1\): .*No such device"):
        DcbAppBackend(netns=ns).current("gone0")


def test_the_loopback_renamed_is_refused_by_its_link_type_in_gpuds_namespace(ns: str) -> None:
    """``ip link set lo name lb0`` in gpud's namespace, lb0 listed: the kernel's link type
    there (ARPHRD_LOOPBACK) keeps dcb off it; v0 is still tried."""
    subprocess.run(["ip", "-n", ns, "link", "set", "lo", "name", "lb0"], check=True)
    code = (
        "from netshaper.dcb import DcbAppBackend, DcbError, NicMap\n"
        "try:\n"
        "    NicMap(DcbAppBackend(), ['lb0', 'v0']).apply({26: 7})\n"
        "except DcbError as err:\n"
        "    print(err)\n"
    )
    said = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    # v0 tried: refused by the kernel (no DCB ops on a veth), not left out
    assert "lb0, v0: 2 of 2 netdev(s) not written" in said, said
    assert "lb0: the loopback (ARPHRD_LOOPBACK, type 772), named lb0" in said


def test_the_loopback_renamed_in_dcbs_namespace_is_refused_by_its_link_type_there(
    ns: str,
) -> None:
    """``dcb -n NETNS`` and ``ip -n NETNS link set lo name lb0``: with no ``link_type``
    given, lb0's link type is read inside NETNS (ARPHRD_LOOPBACK there, no such netdev
    in gpud's), so dcb is never run for it; v0 is still tried."""
    subprocess.run(["ip", "-n", ns, "link", "set", "lo", "name", "lb0"], check=True)
    argvs: list[list[str]] = []

    def runner(argv: list[str]) -> subprocess.CompletedProcess[str]:
        argvs.append(argv)
        return subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)

    with pytest.raises(DcbError) as err:
        NicMap(DcbAppBackend(netns=ns, runner=runner), ["lb0", "v0"]).apply({26: 7})
    said = str(err.value)
    assert "lb0, v0: 2 of 2 netdev(s) not written" in said, said
    assert "lb0: the loopback (ARPHRD_LOOPBACK, type 772), named lb0" in said, said
    assert argvs == [["dcb", "-n", ns, "-j", "app", "show", "dev", "v0", "dscp-prio"]]


def test_a_link_type_asked_of_a_missing_namespace_is_none_and_creates_none() -> None:
    name = f"gdcbnone{os.getpid()}{uuid.uuid4().hex[:4]}"
    opener = partial(netns_socket, name, socket.AF_INET, socket.SOCK_DGRAM)
    assert link_type("lo", open_socket=opener) is None
    assert not os.path.exists(f"/run/netns/{name}")
