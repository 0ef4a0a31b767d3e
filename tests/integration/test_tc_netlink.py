"""TcNetlink against the real kernel, in network namespaces created (and deleted) here.

Two namespaces: ``snd`` holds the interfaces gpud shapes (``a0``, ``a1``; their peers
``b0``, ``b1`` live in ``rcv``). What the kernel holds is read back with ``tc`` itself
(``tc -s class show``, ``tc filter show``), not only through the adapter's decoder.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpud.config import TrafficConfig
from gpud.events import EventLog
from gpud.net.service import TrafficService, job_pool
from gpud.net.tagstore import TagStore
from gpud.store import StateStore
from netshaper import tcplan as tp
from netshaper.tc_netlink import (
    RTM_DELQDISC,
    Ack,
    AdoptedState,
    TcError,
    TcNetlink,
    _Netlink,
)

pytestmark = pytest.mark.integration

GBIT = 10**9
SHARES = [0.05] * 4
TAGS = {"alpha": 26, "beta": 34, "gamma": 10}
FOREIGN_U32 = (
    *("filter", "add", "dev", "a0", "parent", "6764:", "protocol", "ip", "prio", "9"),
    *("u32", "match", "u32", "0", "0", "flowid", "6764:2"),
)


def _run(*args: str, check: bool = True) -> str:
    r = subprocess.run(args, capture_output=True, text=True, check=False, timeout=60)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {r.returncode}: {r.stderr}")
    return r.stdout


@dataclass
class Net:
    snd: str
    rcv: str

    def tc(self, *args: str, check: bool = True) -> str:
        return _run("tc", "-n", self.snd, *args, check=check)

    def classes(self, dev: str) -> dict[str, dict[str, str]]:
        """``tc -s class show``: classid -> {parent, prio, sent_bytes, sent_pkts}."""
        out: dict[str, dict[str, str]] = {}
        current: dict[str, str] = {}
        for line in self.tc("-s", "class", "show", "dev", dev).splitlines():
            if m := re.match(r"class htb (\S+) (root|parent (\S+))", line):
                current = {"parent": m.group(3) or "root"}
                if p := re.search(r" prio (\d+)", line):
                    current["prio"] = p.group(1)
                out[m.group(1)] = current
            elif m := re.match(r"\s*Sent (\d+) bytes (\d+) pkt", line):
                current["bytes"], current["pkts"] = m.group(1), m.group(2)
        return out

    def filters(self, dev: str) -> dict[str, tuple[str, str]]:
        """``tc filter show``: u32 handle -> (flowid, match)."""
        out: dict[str, tuple[str, str]] = {}
        handle = flowid = ""
        for line in self.tc("filter", "show", "dev", dev).splitlines():
            if m := re.search(r"fh (\S+) .*flowid (\S+)", line):
                handle, flowid = m.group(1), m.group(2)
            elif (m := re.match(r"\s*match (\S+) at 0", line)) and handle:
                out[handle] = (flowid, m.group(1))
        return out

    def send_udp(self, tos: int, count: int = 20, *, ipv6: bool = False) -> None:
        """UDP datagrams from ``snd`` to ``rcv`` over a0 with the given TOS/traffic class."""
        dst = "fd00:6764::2" if ipv6 else "10.67.64.2"
        code = (
            "import socket,sys\n"
            f"fam = socket.AF_INET6 if {ipv6} else socket.AF_INET\n"
            "s = socket.socket(fam, socket.SOCK_DGRAM)\n"
            f"s.setsockopt(socket.IPPROTO_IPV6 if {ipv6} else socket.IPPROTO_IP,"
            f" socket.IPV6_TCLASS if {ipv6} else socket.IP_TOS, {tos})\n"
            f"for _ in range({count}): s.sendto(b'x' * 1000, ('{dst}', 9))\n"
        )
        _run("ip", "netns", "exec", self.snd, sys.executable, "-c", code)


@pytest.fixture
def net() -> Iterator[Net]:
    if os.geteuid() != 0 or shutil.which("tc") is None:
        pytest.skip("needs root and iproute2")
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
    n = Net(f"gpud-tc-s-{tag}", f"gpud-tc-r-{tag}")
    _run("ip", "netns", "add", n.snd)
    try:
        _run("ip", "netns", "add", n.rcv)
        for i in (0, 1):
            _run(
                "ip",
                "-n",
                n.snd,
                "link",
                "add",
                f"a{i}",
                "type",
                "veth",
                "peer",
                "name",
                f"b{i}",
                "netns",
                n.rcv,
            )
            _run("ip", "-n", n.snd, "link", "set", f"a{i}", "up")
            _run("ip", "-n", n.rcv, "link", "set", f"b{i}", "up")
        _run("ip", "-n", n.snd, "addr", "add", "10.67.64.1/24", "dev", "a0")
        _run("ip", "-n", n.rcv, "addr", "add", "10.67.64.2/24", "dev", "b0")
        _run("ip", "-n", n.snd, "addr", "add", "fd00:6764::1/64", "dev", "a0", "nodad")
        _run("ip", "-n", n.rcv, "addr", "add", "fd00:6764::2/64", "dev", "b0", "nodad")
        _run("ip", "-n", n.snd, "link", "set", "lo", "up")
        _run("ip", "-n", n.rcv, "link", "set", "lo", "up")
        yield n
    finally:
        _run("ip", "netns", "del", n.snd, check=False)
        _run("ip", "netns", "del", n.rcv, check=False)


@pytest.fixture
def adapter(net: Net) -> Iterator[TcNetlink]:
    tc = TcNetlink(netns=net.snd)
    try:
        yield tc
    finally:
        tc.close()


def plan(levels: dict[str, int], ifaces: tuple[str, ...] = ("a0",)) -> tp.TcPlan:
    return tp.plan(dict.fromkeys(ifaces, GBIT), TAGS, levels, SHARES)


def test_sync_installs_the_tree_as_tc_shows_it(net: Net, adapter: TcNetlink) -> None:
    result = adapter.sync(plan({"alpha": 0, "beta": 2}))
    assert result.ok, result.errors
    assert "htb 6764: root" in net.tc("qdisc", "show", "dev", "a0") and "default 0x2" in net.tc(
        "qdisc", "show", "dev", "a0"
    )
    classes = net.classes("a0")
    assert classes["6764:1"]["parent"] == "root"
    assert classes["6764:2"] == classes["6764:2"] | {"parent": "6764:1", "prio": "7"}
    assert classes["6764:101a"]["parent"] == "6764:10"
    assert classes["6764:1222"]["parent"] == "6764:12" and classes["6764:1222"]["prio"] == "2"
    assert "6764:100a" not in classes  # gamma has no level: default class
    assert net.filters("a0") == {
        "800::35": ("6764:101a", "40680000/f0fc0000"),
        "800::36": ("6764:101a", "66800000/ffc00000"),
        "800::45": ("6764:1222", "40880000/f0fc0000"),
        "800::46": ("6764:1222", "68800000/ffc00000"),
    }
    # what tc shows is what the adapter reads: nothing left to do
    assert adapter.drift(plan({"alpha": 0, "beta": 2})).op_count == 0
    assert "a1" not in net.tc("qdisc", "show", "dev", "a1") or "htb" not in net.tc(
        "qdisc", "show", "dev", "a1"
    )  # never an interface outside the plan


def test_tagged_packets_land_in_the_job_class_and_move_with_its_level(
    net: Net, adapter: TcNetlink
) -> None:
    assert adapter.sync(plan({"alpha": 0, "beta": 1})).ok
    net.send_udp(26 << 2, 20)
    net.send_udp(26 << 2 | 1, 5, ipv6=True)  # ECN bits set: still the job's class
    net.send_udp(0, 7)  # untagged
    classes = net.classes("a0")
    assert int(classes["6764:101a"]["pkts"]) >= 25
    assert classes["6764:1122"]["pkts"] == "0"
    assert int(classes["6764:2"]["pkts"]) >= 7
    counters = adapter.counters("a0")
    assert counters[0x6764101A].packets == int(classes["6764:101a"]["pkts"])
    assert counters[0x6764101A].bytes == int(classes["6764:101a"]["bytes"])

    # alpha drops to level 3: one leaf moves, its filters follow, nothing else changes
    result = adapter.sync(plan({"alpha": 3, "beta": 1}))
    assert result.ok and result.op_count == 4, result.interfaces["a0"].ops
    classes = net.classes("a0")
    assert "6764:101a" not in classes
    assert classes["6764:131a"]["parent"] == "6764:13" and classes["6764:131a"]["prio"] == "3"
    assert net.filters("a0")["800::35"][0] == "6764:131a"
    net.send_udp(26 << 2, 9)
    assert int(net.classes("a0")["6764:131a"]["pkts"]) >= 9


def test_live_tcp_traffic_follows_a_level_change(net: Net, adapter: TcNetlink) -> None:
    if shutil.which("iperf3") is None:
        pytest.skip("needs iperf3")
    assert adapter.sync(plan({"alpha": 1, "beta": 0})).ok
    server = subprocess.Popen(
        ["ip", "netns", "exec", net.rcv, "iperf3", "-s", "-B", "10.67.64.2", "-p", "5201"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.3)
        client = subprocess.Popen(
            [
                *("ip", "netns", "exec", net.snd, "iperf3", "-c", "10.67.64.2", "-p", "5201"),
                *("--tos", str(26 << 2), "-t", "4", "-b", "50M"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        time.sleep(1.5)
        before = int(net.classes("a0")["6764:111a"]["bytes"])
        assert before > 0
        assert adapter.sync(plan({"alpha": 0, "beta": 1})).ok  # mid-flow
        out, _ = client.communicate(timeout=30)
        assert client.returncode == 0, out
        assert int(net.classes("a0")["6764:101a"]["bytes"]) > 1_000_000
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_drift_restores_a_deleted_root_and_tampered_parts(net: Net, adapter: TcNetlink) -> None:
    want = plan({"alpha": 0, "beta": 1})
    assert adapter.sync(want).ok
    net.tc("qdisc", "del", "dev", "a0", "root")
    result = adapter.drift(want)
    assert result.ok
    assert result.restored["a0"][0] == "re-installed HTB root 6764:"
    assert net.classes("a0")["6764:101a"]["parent"] == "6764:10"
    assert len(net.filters("a0")) == 4

    net.tc(
        "class", "change", "dev", "a0", "classid", "6764:11", "htb", "rate", "3mbit", "prio", "1"
    )
    net.tc("filter", "del", "dev", "a0", "parent", "6764:", "prio", "1", "handle", "800::36", "u32")
    net.tc(*FOREIGN_U32)
    result = adapter.drift(want)
    assert result.ok, result.errors
    restored = result.restored["a0"]
    assert "reset class 6764:11 (level 1)" in restored
    assert "re-added ipv6 filter DSCP 26 -> 6764:101a" in restored
    assert adapter.drift(want).op_count == 0


def test_errors_stay_with_their_interface(net: Net, adapter: TcNetlink) -> None:
    # a1 holds a qdisc whose handle collides with ours: the kernel refuses our root there
    net.tc("qdisc", "add", "dev", "a1", "root", "handle", "1:", "htb")
    net.tc("class", "add", "dev", "a1", "parent", "1:", "classid", "1:1", "htb", "rate", "1gbit")
    net.tc("qdisc", "add", "dev", "a1", "parent", "1:1", "handle", "6764:", "pfifo")
    want = tp.plan({"a0": GBIT, "a1": GBIT, "nosuch0": GBIT}, TAGS, {"alpha": 0}, SHARES)
    result = adapter.sync(want)
    assert set(result.errors) == {"a1", "nosuch0"}
    assert str(result.errors["nosuch0"]) == "nosuch0: no such network interface"
    a1 = result.errors["a1"]
    assert isinstance(a1, TcError) and a1.iface == "a1" and a1.errno
    assert a1.op is not None and a1.op.startswith("qdisc replace dev a1 root handle 6764: htb")
    assert str(a1).startswith("a1: netlink error")
    # a0 is enforced all the same, and stays so on the next tick
    assert net.classes("a0")["6764:101a"]["parent"] == "6764:10"
    again = adapter.sync(want)
    assert set(again.errors) == {"a1", "nosuch0"} and again.interfaces["a0"].ops == ()
    # once the conflict is gone, a1 is enforced on the next tick
    net.tc("qdisc", "del", "dev", "a1", "root")
    assert set(adapter.sync(want).errors) == {"nosuch0"}
    assert net.classes("a1")["6764:101a"]["parent"] == "6764:10"


def test_a_restart_adopts_the_tree_and_restore_brings_back_the_original(net: Net) -> None:
    net.tc("qdisc", "replace", "dev", "a0", "root", "pfifo_fast")  # a veth's default: noqueue
    want = plan({"alpha": 0, "beta": 1})
    first = TcNetlink(netns=net.snd)
    found = first.adopt(["a0"])["a0"]
    assert not isinstance(found, TcError)
    assert not found.ours and found.original is not None and found.original.kind == "pfifo_fast"
    assert first.sync(want).ok
    first.close()  # as if killed: nothing torn down
    shown = net.tc("-s", "class", "show", "dev", "a0")

    second = TcNetlink(netns=net.snd)
    try:
        adopted = second.adopt(["a0"])["a0"]
        assert not isinstance(adopted, TcError) and adopted.ours
        assert second.sync(want).op_count == 0
        assert net.tc("-s", "class", "show", "dev", "a0").count("class htb") == shown.count(
            "class htb"
        )
        second.restore("a0", found.original)
        assert "htb" not in net.tc("qdisc", "show", "dev", "a0")
        assert net.tc("qdisc", "show", "dev", "a0").startswith("qdisc pfifo_fast ")
    finally:
        second.close()


def _index(net: Net, iface: str) -> str:
    return _run("ip", "-n", net.snd, "-o", "link", "show", iface).split(":")[0]


@contextmanager
def _shaping(
    net: Net, store: StateStore, ifaces: tuple[str, ...], pin: int
) -> Iterator[TrafficService]:
    """A gpud shaping ``ifaces`` of ``net`` with job alpha pinned at level ``pin``, after
    its start and first pass; killed on leaving (nothing torn down)."""
    config = TrafficConfig(
        enabled=True, interfaces=ifaces, link_rates=tuple(f"{i}=1gbit" for i in ifaces)
    )
    tc = TcNetlink(netns=net.snd)
    try:
        service = TrafficService(
            config,
            tags=TagStore(store, pool=job_pool(config)),
            events=EventLog(None),
            jobs=lambda: ["alpha"],
            active=lambda: {"alpha"},
            tc=tc,
            link_index=lambda iface: int(_index(net, iface)),
        )
        service.start()
        service.pin("alpha", pin)
        service.tick()
        yield service
    finally:
        tc.close()


def test_a_job_left_under_two_level_classes_keeps_each_leaf_and_its_counts(
    net: Net, tmp_path: Path
) -> None:
    """Job alpha's leaf under level class 3 on a1 and under 1 on a0, as a gpud killed in
    the middle of a sync moving it leaves it: the next gpud's first pass moves neither
    (each keeps its class, its queue and its kernel counters), and counts from them."""
    store = StateStore(tmp_path / "state")
    with _shaping(net, store, ("a1",), pin=3):
        pass
    with _shaping(net, store, ("a0",), pin=1) as service:
        dscp = service.tags.allocations()["alpha"]
    leaves = {"a0": f"6764:11{dscp:02x}", "a1": f"6764:13{dscp:02x}"}
    net.send_udp(dscp << 2, 20)  # over a0: sent before the restart, not counted after it
    before = {i: int(net.classes(i)[leaf]["pkts"]) for i, leaf in leaves.items()}
    with _shaping(net, store, ("a0", "a1"), pin=1) as service:
        for iface, leaf in leaves.items():
            assert int(net.classes(iface)[leaf]["pkts"]) == before[iface]
            assert {flowid for flowid, _ in net.filters(iface).values()} == {leaf}
        net.send_udp(dscp << 2, 10)
        service.tick()
        (alpha,) = service.view().jobs
        assert alpha.counters.packets == int(net.classes("a0")[leaves["a0"]]["pkts"]) - before["a0"]


def test_restore_on_a_netdev_made_again_leaves_the_root_the_kernel_gave_it(
    net: Net, adapter: TcNetlink
) -> None:
    net.tc("qdisc", "replace", "dev", "a0", "root", "pfifo_fast")
    found = adapter.adopt(["a0"])["a0"]
    assert not isinstance(found, TcError) and found.original is not None
    assert adapter.sync(plan({"alpha": 0})).ok
    old = _index(net, "a0")
    _run("ip", "-n", net.snd, "link", "del", "a0")
    _run("ip", "-n", net.snd, "link", "add", "a0", "type", "veth", "peer", "name", "b9")
    for dev in ("a0", "b9"):
        _run("ip", "-n", net.snd, "link", "set", dev, "up")
    new = _index(net, "a0")
    # the pfifo_fast was the old a0's: the new one keeps its noqueue
    assert adapter.restore("a0", found.original).replaced == f"ifindex {new}, was {old}"
    assert net.tc("qdisc", "show", "dev", "a0").startswith("qdisc noqueue ")


def _made_again(net: Net) -> None:
    """a0 deleted and created again: another ifindex, the kernel's noqueue root."""
    _run("ip", "-n", net.snd, "link", "del", "a0")
    _run("ip", "-n", net.snd, "link", "add", "a0", "type", "veth", "peer", "name", "b9")
    for dev in ("a0", "b9"):
        _run("ip", "-n", net.snd, "link", "set", dev, "up")


def _taken_over_pfifo_fast_then_made_again(net: Net) -> AdoptedState:
    """A first run (its adapter closed: gpud stopped) took a0 over pfifo_fast and put its
    tree on it; then a0 is deleted and created again. What that run's adopt found."""
    net.tc("qdisc", "replace", "dev", "a0", "root", "pfifo_fast")
    first = TcNetlink(netns=net.snd)
    try:
        found = first.adopt(["a0"])["a0"]
        assert not isinstance(found, TcError) and found.original is not None
        assert str(found.ifindex) == _index(net, "a0")
        assert first.sync(plan({"alpha": 0})).ok
    finally:
        first.close()
    _made_again(net)  # gpud's tree went with the old a0
    return found


def test_a_restore_by_a_fresh_adapter_leaves_a_root_that_is_not_gpuds(net: Net) -> None:
    found = _taken_over_pfifo_fast_then_made_again(net)
    second = TcNetlink(netns=net.snd)
    try:
        done = second.restore("a0", found.original)  # it never saw the old a0
        assert not done.ours and done.root is not None and done.root.kind == "noqueue"
        assert net.tc("qdisc", "show", "dev", "a0").startswith("qdisc noqueue ")
        net.tc("qdisc", "replace", "dev", "a0", "root", "handle", "5:", "bfifo")
        assert not second.restore("a0", found.original).ours
        assert net.tc("qdisc", "show", "dev", "a0").startswith("qdisc bfifo 5: root")
    finally:
        second.close()


def test_a_restore_does_not_put_a_root_recorded_on_another_ifindex(net: Net) -> None:
    found = _taken_over_pfifo_fast_then_made_again(net)
    second = TcNetlink(netns=net.snd)  # a restart whose adopt did not see the old a0
    try:
        assert second.sync(plan({"alpha": 0})).ok  # gpud's tree on the new a0
        done = second.restore("a0", found.original, ifindex=found.ifindex)
        assert done.ours and done.replaced == f"ifindex {_index(net, 'a0')}, was {found.ifindex}"
        assert net.tc("qdisc", "show", "dev", "a0").startswith("qdisc noqueue ")
    finally:
        second.close()


def test_rates_above_32_bits_of_bytes_per_second(net: Net, adapter: TcNetlink) -> None:
    # 400 Gbit/s = 5e10 bytes/s: needs the kernel's 64-bit rate attributes
    want = tp.plan({"a0": 400 * GBIT}, TAGS, {"alpha": 0}, SHARES)
    assert adapter.sync(want).ok
    shown = net.tc("class", "show", "dev", "a0")
    assert re.search(r"class htb 6764:1 root rate 400Gbit ceil 400Gbit", shown), shown
    assert re.search(r"class htb 6764:10 parent 6764:1 rate 20Gbit ceil 400Gbit", shown), shown
    assert adapter.drift(want).op_count == 0  # read back as planned


def test_filters_work_in_whatever_hash_table_the_kernel_gives_them(
    net: Net, adapter: TcNetlink
) -> None:
    assert adapter.sync(plan({})).ok  # the tree, no job yet
    # someone's u32 filter comes first: it takes hash table 800, so ours will be 801
    net.tc(*FOREIGN_U32)
    first = adapter.sync(plan({"alpha": 0}))  # the adapter has not seen it yet
    assert first.ok, first.errors
    assert set(net.filters("a0")) == {"800::800", "801::35", "801::36"}
    # the next pass reads the handles back, removes the stranger, re-points 801::35/36
    moved = adapter.sync(plan({"alpha": 2}))
    assert moved.ok and moved.op_count == 5, moved.interfaces["a0"].ops
    assert net.filters("a0") == {
        "801::35": ("6764:121a", "40680000/f0fc0000"),
        "801::36": ("6764:121a", "66800000/ffc00000"),
    }
    assert adapter.drift(plan({"alpha": 2})).op_count == 0


def test_a_failure_early_in_the_batch_does_not_stop_the_rest(net: Net, adapter: TcNetlink) -> None:
    # a0's operations come first in the batch and all fail; a1's follow and must all apply
    net.tc("qdisc", "add", "dev", "a0", "root", "handle", "1:", "htb")
    net.tc("class", "add", "dev", "a0", "parent", "1:", "classid", "1:1", "htb", "rate", "1gbit")
    net.tc("qdisc", "add", "dev", "a0", "parent", "1:1", "handle", "6764:", "pfifo")
    want = tp.plan({"a0": GBIT, "a1": GBIT}, TAGS, {"alpha": 0, "beta": 1}, SHARES)
    result = adapter.sync(want)
    assert set(result.errors) == {"a0"}
    assert result.errors["a0"].op is not None and "qdisc replace dev a0" in result.errors["a0"].op
    assert len(net.filters("a1")) == 4
    assert net.classes("a1")["6764:1122"]["parent"] == "6764:11"
    assert adapter.drift(tp.plan({"a1": GBIT}, TAGS, {"alpha": 0, "beta": 1}, SHARES)).op_count == 0


def test_a_sync_repairs_what_changed_behind_its_back(net: Net, adapter: TcNetlink) -> None:
    assert adapter.sync(plan({"alpha": 0, "beta": 1})).ok
    net.tc("qdisc", "del", "dev", "a0", "root")
    # the plan changes in the same tick: the cached view is stale, the ops fail, the
    # interface is read again and rebuilt in the same call
    result = adapter.sync(plan({"alpha": 2, "beta": 1}))
    assert result.ok, result.errors
    assert result.restored["a0"][0] == "re-installed HTB root 6764:"
    assert net.classes("a0")["6764:121a"]["parent"] == "6764:12"
    assert net.filters("a0")["800::35"][0] == "6764:121a"


def test_a_sync_of_an_unchanged_plan_checks_the_kernel(net: Net, adapter: TcNetlink) -> None:
    want = tp.plan({"a0": GBIT, "nosuch0": GBIT}, TAGS, {"alpha": 0}, SHARES)
    assert set(adapter.sync(want).errors) == {"nosuch0"}
    net.tc("qdisc", "del", "dev", "a0", "root")
    result = adapter.sync(want)  # same plan: a0 is read and repaired, as drift would
    assert set(result.errors) == {"nosuch0"}
    assert result.restored["a0"][0] == "re-installed HTB root 6764:"
    assert net.classes("a0")["6764:101a"]["parent"] == "6764:10"


def test_an_interface_renamed_away_is_left_alone(net: Net, adapter: TcNetlink) -> None:
    want = plan({"alpha": 0})
    assert adapter.sync(want).ok
    index = adapter.ifindex("a0")
    _run("ip", "-n", net.snd, "link", "set", "a0", "name", "old0")
    result = adapter.drift(want)
    # the error says where the tree went (the index gpud shaped is old0 now, with it)
    renamed = (
        f"a0: no such network interface (renamed to old0, ifindex {index}, gpud's tree still"
        " on it: gpud leaves old0 alone)"
    )
    assert str(result.errors["a0"]) == renamed
    assert str(adapter.sync(want).errors["a0"]) == renamed  # the same each tick: one event
    assert "htb 6764:" in net.tc("qdisc", "show", "dev", "old0")
    net.tc("qdisc", "del", "dev", "old0", "root")  # no longer gpud's to repair
    assert str(adapter.sync(want).errors["a0"]) == (
        f"a0: no such network interface (renamed to old0, ifindex {index}: gpud leaves old0 alone)"
    )
    # a new a0 (another index) is shaped; old0 is not touched again
    _run("ip", "-n", net.snd, "link", "add", "a0", "type", "veth", "peer", "name", "b9")
    assert adapter.sync(want).ok
    assert adapter.drift(want).ok
    assert net.classes("a0")["6764:101a"]["parent"] == "6764:10"
    assert "htb" not in net.tc("qdisc", "show", "dev", "old0")
    adapter.restore("a0")
    assert "htb" not in net.tc("qdisc", "show", "dev", "a0")
    # deleted, not renamed: no other name to point at
    _run("ip", "-n", net.snd, "link", "del", "a0")
    assert str(adapter.sync(want).errors["a0"]) == "a0: no such network interface"


def _veth(net: Net, name: str, *extra: str) -> None:
    """A veth ``name`` in ``snd`` (its peer in ``rcv``), up; ``extra``: ``index N``."""
    peer = f"p{uuid.uuid4().hex[:6]}"
    _run("ip", "-n", net.snd, "link", "add", name, *extra, "type", "veth", "peer", "name", peer)
    _run("ip", "-n", net.snd, "link", "set", peer, "netns", net.rcv)
    _run("ip", "-n", net.snd, "link", "set", name, "up")


def test_a_restore_leaves_a_netdev_made_with_a_renamed_ones_ifindex(
    net: Net, adapter: TcNetlink
) -> None:
    """a0 renamed x0 and deleted, a1 deleted and made again with a0's old ifindex and
    shaped: restoring a0 touches nothing (a1's tree stays), restoring a1 gives a1 back."""
    net.tc("qdisc", "replace", "dev", "a0", "root", "pfifo_fast")
    net.tc("qdisc", "replace", "dev", "a1", "root", "bfifo")
    both = plan({"alpha": 0}, ("a0", "a1"))
    assert adapter.sync(both).ok
    index = _index(net, "a0")
    _run("ip", "-n", net.snd, "link", "set", "a0", "name", "x0")
    _run("ip", "-n", net.snd, "link", "del", "x0")
    _run("ip", "-n", net.snd, "link", "del", "a1")
    _veth(net, "a1", "index", index)
    assert _index(net, "a1") == index
    result = adapter.sync(both)
    assert set(result.errors) == {"a0"}
    # another netdev (another MAC) on that ifindex, a1's: not a0 renamed, and said so
    refused = (
        rf"^a0: no such network interface \(ifindex {index} is now a1, MAC [0-9a-f:]{{17}},"
        r" was [0-9a-f:]{17}: not taken for a0\)$"
    )
    assert re.match(refused, str(result.errors["a0"]))
    with pytest.raises(TcError, match=refused) as left_alone:
        adapter.restore("a0", tp.RootQdisc("pfifo_fast", 0))
    assert left_alone.value.tree_left is False  # a1's tree, given back by a1's restore
    assert "htb 6764:" in net.tc("qdisc", "show", "dev", "a1")
    done = adapter.restore("a1", tp.RootQdisc("bfifo", 0))
    assert done.ours and done.renamed == "" and "htb" not in net.tc("qdisc", "show", "dev", "a1")


def test_a_renamed_netdev_given_another_mac_is_restored_where_gpuds_tree_is(
    net: Net, adapter: TcNetlink
) -> None:
    """``ip link set a0 name x0; ip link set x0 address 02:11:22:33:44:55``: a veth has
    no permanent MAC, so the MAC gpud saw is gone, but gpud's tree on the index is the
    netdev gpud shaped, and the restore removes it there."""
    net.tc("qdisc", "replace", "dev", "a0", "root", "pfifo_fast")
    assert adapter.sync(plan({"alpha": 0})).ok
    _run("ip", "-n", net.snd, "link", "set", "a0", "name", "x0")
    _run("ip", "-n", net.snd, "link", "set", "x0", "address", "02:11:22:33:44:55")
    done = adapter.restore("a0", tp.RootQdisc("pfifo_fast", 0))
    assert done.ours and done.renamed == "x0"
    assert "htb" not in net.tc("qdisc", "show", "dev", "x0")


@pytest.mark.parametrize("first", ["a0", "a1"])
def test_a_netdev_renamed_onto_another_configured_name_is_that_names_to_restore(
    net: Net, adapter: TcNetlink, first: str
) -> None:
    """``ip link del a1; ip link set a0 name a1``, both configured: whichever name a pass
    and the stop take first, a0's restore leaves the netdev to a1's."""
    names = (first, "a1" if first == "a0" else "a0")
    both = plan({"alpha": 0}, names)
    assert adapter.sync(both).ok
    index = _index(net, "a0")
    _run("ip", "-n", net.snd, "link", "del", "a1")
    _run("ip", "-n", net.snd, "link", "set", "a0", "name", "a1")
    assert str(adapter.sync(both).errors["a0"]) == (
        f"a0: no such network interface (renamed to a1, ifindex {index}: now a1, shaped as a1)"
    )
    outcome: dict[str, str] = {}
    for iface in names:
        try:
            done = adapter.restore(iface)
            outcome[iface] = f"ours={done.ours} renamed={done.renamed!r}"
        except TcError as err:
            outcome[iface] = str(err)
    assert outcome == {
        "a0": (
            f"a0: no such network interface (renamed to a1, ifindex {index}: now a1, shaped as a1)"
        ),
        "a1": "ours=True renamed=''",
    }
    assert "htb" not in net.tc("qdisc", "show", "dev", "a1")


def test_a_netdev_renamed_onto_an_adopted_name_before_any_pass_is_that_names(
    net: Net, adapter: TcNetlink
) -> None:
    """A start adopts a0 and a1 (gpud's trees from an earlier run), then ``ip link del
    a1; ip link set a0 name a1`` and a stop before the first pass: a1's restore gives the
    netdev back, a0's leaves it to a1's and says nothing of gpud's stays."""
    assert adapter.sync(plan({"alpha": 0}, ("a0", "a1"))).ok
    fresh = TcNetlink(netns=net.snd)
    try:
        assert all(a.ours for a in fresh.adopt(["a0", "a1"]).values() if not isinstance(a, TcError))
        index = _index(net, "a0")
        _run("ip", "-n", net.snd, "link", "del", "a1")
        _run("ip", "-n", net.snd, "link", "set", "a0", "name", "a1")
        with pytest.raises(TcError) as refused:
            fresh.restore("a0")
        assert str(refused.value) == (
            f"a0: no such network interface (renamed to a1, ifindex {index}: now a1, shaped as a1)"
        )
        assert refused.value.tree_left is False
        assert "htb 6764:" in net.tc("qdisc", "show", "dev", "a1")
        assert fresh.restore("a1").ours
        assert "htb" not in net.tc("qdisc", "show", "dev", "a1")
    finally:
        fresh.close()


def test_a_netdev_deleted_while_shaped_leaves_nothing_to_its_restore(
    net: Net, adapter: TcNetlink
) -> None:
    assert adapter.sync(plan({"alpha": 0})).ok
    _run("ip", "-n", net.snd, "link", "del", "a0")
    with pytest.raises(TcError) as gone:
        adapter.restore("a0")
    assert (gone.value.errno, gone.value.tree_left) == (errno.ENODEV, False)


class _SwapBeforeDelete:
    """The real socket, with the root of ``iface`` replaced by ``bfifo`` just before the
    first root delete goes out (another tool between gpud's read and its delete)."""

    def __init__(self, net: Net, iface: str) -> None:
        self._nl = _Netlink(net.snd)
        self._net, self._iface = net, iface

    def request(self, msgs: Sequence[tuple[int, int, bytes]]) -> list[Ack]:
        if msgs and msgs[0][0] == RTM_DELQDISC:
            self._net.tc("qdisc", "replace", "dev", self._iface, "root", "bfifo")
        return self._nl.request(msgs)

    def get(self, mtype: int, body: bytes) -> tuple[list[memoryview], Ack | None]:
        return self._nl.get(mtype, body)

    def dump(self, mtype: int, body: bytes) -> tuple[list[memoryview], Ack | None]:
        return self._nl.dump(mtype, body)

    def close(self) -> None:
        self._nl.close()


def test_a_restore_leaves_a_root_put_on_between_its_read_and_its_delete(net: Net) -> None:
    """The kernel takes the delete with gpud's handle, and refuses it for another root."""
    adapter = TcNetlink(transport=_SwapBeforeDelete(net, "a0"))
    try:
        assert adapter.sync(plan({"alpha": 0})).ok
        with pytest.raises(TcError, match=r"no longer gpud's HTB 6764:.*EINVAL"):
            adapter.restore("a0")
        assert net.tc("qdisc", "show", "dev", "a0").startswith("qdisc bfifo ")
    finally:
        adapter.close()


def test_a_qdisc_put_under_a_leaf_is_removed_once(net: Net, adapter: TcNetlink) -> None:
    want = plan({"alpha": 0, "beta": 1})
    assert adapter.sync(want).ok
    net.tc("qdisc", "replace", "dev", "a0", "parent", "6764:101a", "handle", "20:", "bfifo")
    result = adapter.sync(want)  # an unchanged plan: the kernel is read and checked
    assert result.ok, result.errors
    assert result.restored["a0"] == (
        "removed bfifo qdisc 20: under class 6764:101a (back to HTB's default queue)",
    )
    assert "bfifo" not in net.tc("qdisc", "show", "dev", "a0")
    assert adapter.sync(want).op_count == 0  # HTB's own default queue is no drift
    net.send_udp(26 << 2)
    assert int(net.classes("a0")["6764:101a"]["pkts"]) >= 20


def test_a_root_re_added_with_our_handle_is_rebuilt(net: Net, adapter: TcNetlink) -> None:
    want = plan({"alpha": 0})
    assert adapter.sync(want).ok
    net.tc("qdisc", "del", "dev", "a0", "root")
    net.tc("qdisc", "add", "dev", "a0", "root", "handle", "6764:", "htb", "default", "5")
    net.tc(*FOREIGN_U32)
    result = adapter.sync(want)
    assert result.ok, result.errors
    assert result.restored["a0"][:2] == (
        "removed a root qdisc that held gpud's handle 6764:",
        "re-installed HTB root 6764:",
    )
    assert "default 0x2" in net.tc("qdisc", "show", "dev", "a0")
    assert adapter.sync(want).op_count == 0


def test_link_state_is_read_in_the_callers_network_namespace(net: Net) -> None:
    """The cluster's node view under ``nsenter --net=``, the way gpud is started in a
    namespace: /sys is still the host's there (its eth0 is the host's, a0 is not in it)."""
    code = (
        "from gpud.cluster.nodeview import DaemonNodeView\n"
        "for names in (('a0',), ('eth0',), ('a0', 'a1')):\n"
        "    print(DaemonNodeView(list, lambda: None, interfaces=names).links_up())\n"
    )

    def links_up() -> list[str]:
        out = _run("nsenter", f"--net=/run/netns/{net.snd}", sys.executable, "-c", code)
        return out.split()

    assert links_up() == ["True", "False", "True"]
    _run("ip", "-n", net.rcv, "link", "set", "b1", "down")  # a1 loses its carrier
    deadline = time.monotonic() + 5  # the kernel's link watch takes up to a second
    while (state := links_up()) != ["True", "False", "False"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.1)


def test_a_namespace_that_does_not_exist_is_named_and_not_made() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    name = f"gpud-tc-typo-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    path = f"/run/netns/{name}"
    try:
        with pytest.raises(FileNotFoundError, match=f"network namespace '{name}' does not exist"):
            TcNetlink(netns=name)
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):  # the old code made one: leave none behind
            _run("ip", "netns", "del", name, check=False)
