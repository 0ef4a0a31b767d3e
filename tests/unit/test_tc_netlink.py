"""TcNetlink's error handling and caching, over a double of the netlink socket.

The real kernel is exercised in tests/integration/test_tc_netlink.py; here the double
plays a kernel without HTB on one interface, which no test machine can be made into.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from netshaper import tcplan as tp
from netshaper.tc_netlink import (
    NLM_F_DUMP_INTR,
    NLM_F_MULTI,
    NLMSG_DONE,
    RTM_DELQDISC,
    RTM_GETLINK,
    RTM_GETQDISC,
    RTM_NEWQDISC,
    RTM_NEWTCLASS,
    TC_H_ROOT,
    Ack,
    InterfaceResult,
    TcError,
    TcNetlink,
    _answer,
    netns_socket,
)

LINKS = {"eth0": 1, "eth1": 2}


def _ifinfo(index: int, name: str, kind: int = 1) -> memoryview:
    """An RTM_NEWLINK answer: ``kind`` is ifi_type (ARPHRD_ETHER unless said)."""
    attr_payload = name.encode() + b"\0"
    attr = struct.pack("=HH", 4 + len(attr_payload), 3) + attr_payload
    attr += b"\0" * (-len(attr) % 4)
    return memoryview(struct.pack("=BxHiII", 0, kind, index, 0, 0) + attr)


def _ifname(body: bytes) -> str:
    """The IFLA_IFNAME of an RTM_GETLINK request (ifinfomsg, then that one attribute)."""
    return body[16 + 4 :].split(b"\0")[0].decode()


@dataclass
class NoHtbOnEth1:
    """eth1's kernel has no HTB: the root qdisc request fails, and so does what follows."""

    dumps: list[tuple[int, int]] = field(default_factory=list)  # (type, ifindex)
    sent: list[tuple[int, int]] = field(default_factory=list)

    def request(self, msgs: Sequence[tuple[int, int, bytes]]) -> list[Ack]:
        acks = []
        for i, (mtype, _flags, body) in enumerate(msgs):
            (ifindex,) = struct.unpack_from("=i", body, 4)
            self.sent.append((mtype, ifindex))
            if ifindex == 2 and mtype == RTM_NEWQDISC:
                acks.append(Ack(i, errno.ENOENT, "Specified qdisc kind is unknown."))
            elif ifindex == 2:
                acks.append(Ack(i, errno.EINVAL, "Specified class not found."))
            else:
                acks.append(Ack(i, 0, None))
        return acks

    def get(self, mtype: int, body: bytes) -> tuple[list[memoryview], Ack | None]:
        assert mtype == RTM_GETLINK
        name = _ifname(body)
        if name not in LINKS:
            return [], Ack(0, errno.ENODEV, None)
        return [_ifinfo(LINKS[name], name)], None

    def dump(self, mtype: int, body: bytes) -> tuple[list[memoryview], Ack | None]:
        (ifindex,) = struct.unpack_from("=i", body, 4)
        self.dumps.append((mtype, ifindex))
        return [], None  # no root qdisc yet

    def close(self) -> None:
        pass


def test_missing_htb_is_a_clear_error_for_that_interface_only() -> None:
    nl = NoHtbOnEth1()
    tc = TcNetlink(transport=nl)
    plan = tp.plan({"eth0": 10**9, "eth1": 10**9, "eth7": 10**9}, {"a": 26}, {"a": 0}, [0.1] * 4)
    result = tc.sync(plan)
    assert set(result.errors) == {"eth1", "eth7"}
    err = result.errors["eth1"]
    assert str(err) == (
        "eth1: the kernel has no HTB qdisc (sch_htb) (tc qdisc replace dev eth1 root handle "
        "6764: htb default 2): Specified qdisc kind is unknown."
    )
    assert (err.iface, err.errno) == ("eth1", errno.ENOENT)
    assert str(result.errors["eth7"]) == "eth7: no such network interface"
    assert result.interfaces["eth0"].error is None and len(result.interfaces["eth0"].ops) == 10

    # next tick, a changed plan: eth0's goes out from what the adapter knows (no read
    # first); eth1 is read and tried again
    nl.dumps.clear()
    nl.sent.clear()
    moved = tp.plan({"eth0": 10**9, "eth1": 10**9}, {"a": 26}, {"a": 2}, [0.1] * 4)
    assert tc.sync(moved).interfaces["eth0"].ops == (
        "class add dev eth0 parent 6764:12 classid 6764:121a htb rate 1000000bit ceil "
        "1000000000bit burst 131072b cburst 131072b quantum 60000 prio 2",
        "filter change dev eth0 parent 6764: protocol all prio 1 handle 800::35 u32 match u32 "
        "0x40680000 0xf0fc0000 at 0 flowid 6764:121a",
        "filter change dev eth0 parent 6764: protocol all prio 1 handle 800::36 u32 match u32 "
        "0x66800000 0xffc00000 at 0 flowid 6764:121a",
        "class del dev eth0 classid 6764:101a",
    )
    assert {i for _, i in nl.dumps} == {2}
    assert {i for _, i in nl.sent} == {1, 2}
    tc.close()


@dataclass
class RenamingLinks:
    """A kernel whose interfaces are looked up by name and can be renamed between ticks;
    no interface holds a qdisc, and every tc request succeeds."""

    links: dict[str, int] = field(default_factory=lambda: {"eth0": 1})
    sent: list[tuple[int, int]] = field(default_factory=list)  # (type, ifindex)
    loopbacks: set[str] = field(default_factory=set)  # names whose ifi_type is 772
    dumped: list[int] = field(default_factory=list)  # the ifindex of each tc dump

    def request(self, msgs: Sequence[tuple[int, int, bytes]]) -> list[Ack]:
        for mtype, _flags, body in msgs:
            (ifindex,) = struct.unpack_from("=i", body, 4)
            self.sent.append((mtype, ifindex))
        return [Ack(i, 0, None) for i in range(len(msgs))]

    def get(self, mtype: int, body: bytes) -> tuple[list[memoryview], Ack | None]:
        assert mtype == RTM_GETLINK
        name = _ifname(body)
        if not name:  # by index
            (index,) = struct.unpack_from("=i", body, 4)
            by_index = {i: n for n, i in self.links.items()}
            if index not in by_index:
                return [], Ack(0, errno.ENODEV, None)
            name = by_index[index]
        if name not in self.links:
            return [], Ack(0, errno.ENODEV, None)
        return [_ifinfo(self.links[name], name, 772 if name in self.loopbacks else 1)], None

    def dump(self, mtype: int, body: bytes) -> tuple[list[memoryview], Ack | None]:
        if mtype == RTM_GETLINK:
            return [_ifinfo(i, n) for n, i in self.links.items()], None
        (ifindex,) = struct.unpack_from("=i", body, 4)
        self.dumped.append(ifindex)
        return [], None

    def close(self) -> None:
        pass


def test_a_renamed_interface_is_not_shaped_under_its_old_name() -> None:
    nl = RenamingLinks()
    tc = TcNetlink(transport=nl)
    plan = tp.plan({"eth0": 10**9}, {"a": 26}, {"a": 0}, [0.1] * 4)
    assert tc.sync(plan).ok and {i for _, i in nl.sent} == {1}

    # eth0 is renamed: the interface gpud shaped is not eth0 any more, and is left alone
    nl.links = {"old0": 1}
    nl.sent.clear()
    result = tc.drift(plan)
    assert str(result.errors["eth0"]) == (
        "eth0: no such network interface (renamed to old0, ifindex 1: gpud leaves old0 alone)"
    )
    assert nl.sent == []

    # a new eth0 appears (another ifindex): that one is shaped, the old one never again
    nl.links = {"old0": 1, "eth0": 7}
    for _ in range(2):
        result = tc.sync(plan)
        assert result.ok, result.errors
    assert {i for _, i in nl.sent} == {7}
    # one look-up per interface and pass, even when the plan goes out from the cache
    moved = tp.plan({"eth0": 10**9}, {"a": 26}, {"a": 2}, [0.1] * 4)
    nl.links = {"eth0": 9}
    nl.sent.clear()
    assert tc.sync(moved).ok
    assert {i for _, i in nl.sent} == {9}
    assert tc.counters("eth0") == {}
    tc.close()


def test_the_loopback_under_another_name_is_refused_by_its_link_type() -> None:
    """``ip link set lo name lb0`` and lb0 in traffic.interfaces: the name passes the
    config's check, the kernel's ARPHRD_LOOPBACK does not, and nothing is sent to it."""
    nl = RenamingLinks(links={"lb0": 1}, loopbacks={"lb0"})
    tc = TcNetlink(transport=nl)
    (found,) = tc.adopt(["lb0"]).values()
    assert isinstance(found, TcError) and str(found).startswith(
        "lb0: the loopback (ARPHRD_LOOPBACK, type 772), named lb0: shaping it slows"
    )
    plan = tp.plan({"lb0": 10**9}, {"a": 26}, {"a": 0}, [0.1] * 4)
    assert "ARPHRD_LOOPBACK" in str(tc.sync(plan).errors["lb0"])
    assert nl.sent == [] and nl.dumped == []
    tc.close()


def test_a_restore_finds_the_netdev_renamed_away_by_its_ifindex() -> None:
    """Shaped as eth0, renamed old0 before the stop: the restore reads (and would remove
    gpud's root from) ifindex 1 under its new name, and says the name."""
    nl = RenamingLinks()
    tc = TcNetlink(transport=nl)
    plan = tp.plan({"eth0": 10**9}, {"a": 26}, {"a": 0}, [0.1] * 4)
    assert tc.sync(plan).ok
    nl.links = {"old0": 1, "eth1": 2}
    nl.dumped.clear()
    done = tc.restore("eth0", None)
    assert done.renamed == "old0" and not done.replaced and set(nl.dumped) == {1}
    # the name is not taken for that netdev after: a pass on eth0 still finds none
    assert "renamed to old0" in str(tc.sync(plan).errors["eth0"])
    tc.close()


def test_drift_lines_name_filters_and_qdiscs_as_tc_shows_them() -> None:
    ops = (
        tp.TcOp(tp.OpKind.DELETE_FILTER, "eth0", root=0x67640000, filter_handle=0x80000800),
        tp.TcOp(
            tp.OpKind.DELETE_FILTER, "eth0", root=0x67640000, filter_protocol=0x0800, filter_prio=5
        ),
        tp.TcOp(
            tp.OpKind.DELETE_QDISC,
            "eth0",
            root=0x67640000,
            qdisc=tp.ChildQdisc(0x6764111A, 0x200000, "bfifo"),
        ),
        tp.TcOp(tp.OpKind.DELETE_ROOT, "eth0", root=0x67640000),
        tp.TcOp(tp.OpKind.REPLACE_ROOT, "eth0", root=0x67640000, default_classid=0x67640002),
    )
    assert InterfaceResult("eth0", ops, drift=True).restored == (
        "removed u32 filter 800::800 (pref 1)",
        "removed every filter of pref 5 (protocol ip)",
        "removed bfifo qdisc 20: under class 6764:111a (back to HTB's default queue)",
        "removed a root qdisc that held gpud's handle 6764:",
        "re-installed HTB root 6764:",
    )


@dataclass
class RaceOnFirstBatch(RenamingLinks):
    """The first tc batch after ``race`` is set fails (another tool wrote the interface
    between gpud's read and its batch); the retry succeeds."""

    race: bool = False

    def request(self, msgs: Sequence[tuple[int, int, bytes]]) -> list[Ack]:
        acks = super().request(msgs)
        if self.race:
            self.race = False
            return [Ack(0, errno.EEXIST, "Exclusivity flag on, cannot modify."), *acks[1:]]
        return acks


def test_a_netdev_made_again_is_still_named_when_its_batch_was_tried_twice() -> None:
    nl = RaceOnFirstBatch()
    tc = TcNetlink(transport=nl)
    assert tc.sync(tp.plan({"eth0": 10**9}, {"a": 26}, {"a": 0}, [0.1] * 4)).ok
    nl.links = {"eth0": 7}  # deleted and created again between two passes
    nl.race = True
    moved = tp.plan({"eth0": 10**9}, {"a": 26}, {"a": 2}, [0.1] * 4)
    result = tc.sync(moved)
    assert result.ok, result.errors
    assert not nl.race  # the first batch failed, and a second went out
    assert result.interfaces["eth0"].replaced == "ifindex 7, was 1"
    tc.close()


def _root_qdisc(index: int, kind: str, handle: int) -> memoryview:
    """A root qdisc as an RTM_GETQDISC dump gives it: tcmsg, then TCA_KIND."""
    payload = kind.encode() + b"\0"
    attr = struct.pack("=HH", 4 + len(payload), 1) + payload
    attr += b"\0" * (-len(attr) % 4)
    return memoryview(struct.pack("=BxxxiIII", 0, index, handle, TC_H_ROOT, 0) + attr)


@dataclass
class BlindAfterReinstall(RenamingLinks):
    """eth0 holds gpud's HTB root; deleting it leaves none dumped, re-installing a root
    works, and the read after that fails (ENOBUFS: the socket's buffer overran)."""

    root: tuple[str, int] | None = ("htb", tp.ROOT_MAJOR << 16)
    reinstalled: bool = False

    def request(self, msgs: Sequence[tuple[int, int, bytes]]) -> list[Ack]:
        for mtype, _flags, _body in msgs:
            if mtype == RTM_DELQDISC:
                self.root = None
            elif mtype == RTM_NEWQDISC:
                self.reinstalled = True
        return super().request(msgs)

    def dump(self, mtype: int, body: bytes) -> tuple[list[memoryview], Ack | None]:
        if mtype != RTM_GETQDISC:
            return super().dump(mtype, body)
        if self.reinstalled:
            raise OSError(errno.ENOBUFS, os.strerror(errno.ENOBUFS))
        return ([_root_qdisc(1, *self.root)] if self.root else []), None


def test_a_root_re_installed_whose_read_back_fails_is_still_restored() -> None:
    nl = BlindAfterReinstall()
    tc = TcNetlink(transport=nl)
    done = tc.restore("eth0", tp.RootQdisc("pfifo_fast", 0))
    assert (done.ours, done.replaced, done.root) == (True, "", None)
    assert nl.reinstalled
    tc.close()


@dataclass
class RefusedReinstall(BlindAfterReinstall):
    """The delete of gpud's root acked, the re-install of the original refused (EPERM)."""

    def request(self, msgs: Sequence[tuple[int, int, bytes]]) -> list[Ack]:
        acks = super().request(msgs)
        return [
            Ack(a.seq, errno.EPERM, None) if mtype == RTM_NEWQDISC else a
            for a, (mtype, _f, _b) in zip(acks, msgs, strict=True)
        ]


@dataclass
class BlindAfterDelete(BlindAfterReinstall):
    """The delete of gpud's root acked, and every read after it fails (ENOBUFS)."""

    def dump(self, mtype: int, body: bytes) -> tuple[list[memoryview], Ack | None]:
        if mtype == RTM_GETQDISC and self.root is None:
            raise OSError(errno.ENOBUFS, os.strerror(errno.ENOBUFS))
        return super().dump(mtype, body)


@dataclass
class BlindAfterDeleteRefused(BlindAfterDelete, RefusedReinstall):
    """The read after the delete fails, and the re-install of the original is refused."""


@pytest.mark.parametrize(
    ("kernel", "said"),
    [
        pytest.param(RefusedReinstall, "", id="read_after_the_delete"),
        pytest.param(
            BlindAfterDeleteRefused,
            "; gpud's tree is deleted, but the read of the root after the delete failed: ENOBUFS",
            id="read_after_the_delete_failed",
        ),
    ],
)
def test_a_refused_re_install_says_gpuds_tree_is_removed_and_any_read_that_failed(
    kernel: type[RefusedReinstall], said: str
) -> None:
    nl = kernel()
    tc = TcNetlink(transport=nl)
    with pytest.raises(TcError) as refused:
        tc.restore("eth0", tp.RootQdisc("pfifo_fast", 0))
    assert str(refused.value) == (
        f"eth0: cannot re-install the original pfifo_fast root: EPERM{said}"
        " (tc qdisc replace dev eth0 root pfifo_fast)"
    )
    assert nl.root is None  # gpud's tree deleted: the kernel's default root is there
    assert (refused.value.tree_left, refused.value.tree_removed) == (False, True)
    tc.close()


def test_a_failed_read_after_the_delete_still_puts_the_original_back() -> None:
    nl = BlindAfterDelete()
    tc = TcNetlink(transport=nl)
    done = tc.restore("eth0", tp.RootQdisc("pfifo_fast", 0))
    assert (done.ours, done.replaced, done.root) == (True, "", None)
    assert nl.reinstalled and nl.root is None
    tc.close()
    # no original recorded: the kernel's default root is what gpud gives back
    nl = BlindAfterDelete()
    tc = TcNetlink(transport=nl)
    assert tc.restore("eth0").ours and not nl.reinstalled
    tc.close()


def _with_mac(info: memoryview, mac: bytes) -> memoryview:
    """An RTM_NEWLINK answer with IFLA_ADDRESS ``mac`` added."""
    attr = struct.pack("=HH", 4 + len(mac), 1) + mac
    return memoryview(bytes(info) + attr + b"\0" * (-len(attr) % 4))


GPUD_ROOT = ("htb", tp.ROOT_MAJOR << 16)


@dataclass
class ShapedLinks(RenamingLinks):
    """Netdevs by name, each with a MAC (``macs``, by name) and a root qdisc (``roots``, by
    ifindex: gpud's HTB unless said); deleting a root leaves none, and ``dump_fails`` is
    the errno every qdisc dump fails with (an OSError) while set."""

    macs: dict[str, bytes] = field(default_factory=dict)
    roots: dict[int, tuple[str, int]] = field(default_factory=dict)
    dump_fails: int = 0
    deleted: list[tuple[int, int]] = field(default_factory=list)  # (ifindex, tcm_handle)

    def get(self, mtype: int, body: bytes) -> tuple[list[memoryview], Ack | None]:
        msgs, err = super().get(mtype, body)
        if msgs:
            (index,) = struct.unpack_from("=i", msgs[0], 4)
            name = {i: n for n, i in self.links.items()}[index]
            msgs = [_with_mac(msgs[0], self.macs.get(name, bytes(6)))]
        return msgs, err

    def request(self, msgs: Sequence[tuple[int, int, bytes]]) -> list[Ack]:
        for mtype, _flags, body in msgs:
            (index, handle) = struct.unpack_from("=iI", body, 4)
            if mtype == RTM_DELQDISC:
                self.deleted.append((index, handle))
                self.roots.pop(index, None)
            elif mtype == RTM_NEWQDISC:
                self.roots[index] = GPUD_ROOT
        return super().request(msgs)

    def dump(self, mtype: int, body: bytes) -> tuple[list[memoryview], Ack | None]:
        if mtype != RTM_GETQDISC:
            return super().dump(mtype, body)
        if self.dump_fails:
            raise OSError(self.dump_fails, os.strerror(self.dump_fails))
        (index,) = struct.unpack_from("=i", body, 4)
        self.dumped.append(index)
        return [_root_qdisc(i, *root) for i, root in self.roots.items() if i == index], None


MAC_A, MAC_B = bytes.fromhex("0200000000aa"), bytes.fromhex("0200000000bb")
BOTH = tp.plan({"eth0": 10**9, "eth1": 10**9}, {"a": 26}, {"a": 0}, [0.1] * 4)


def _shaped_pair() -> tuple[ShapedLinks, TcNetlink]:
    """eth0 (ifindex 1) and eth1 (ifindex 2), both shaped by one pass."""
    nl = ShapedLinks(links={"eth0": 1, "eth1": 2}, macs={"eth0": MAC_A, "eth1": MAC_B})
    tc = TcNetlink(transport=nl)
    assert tc.sync(BOTH).ok
    assert set(nl.roots) == {1, 2}
    return nl, tc


def test_a_restore_leaves_a_netdev_made_with_the_old_ones_ifindex() -> None:
    """eth0 deleted, and another netdev (another MAC) made with its ifindex under a name
    gpud never shaped: that one is not eth0 renamed, and nothing is sent to it."""
    nl, tc = _shaped_pair()
    nl.links = {"z0": 1, "eth1": 2}
    nl.macs["z0"] = bytes.fromhex("0200000000cc")
    nl.roots[1] = ("pfifo_fast", 0)  # a new netdev has the kernel's root, never gpud's
    refused = (
        "eth0: no such network interface (ifindex 1 is now z0, MAC 02:00:00:00:00:cc, was"
        " 02:00:00:00:00:aa: not taken for eth0)"
    )
    assert str(tc.drift(BOTH).errors["eth0"]) == refused
    try:
        done = tc.restore("eth0", tp.RootQdisc("pfifo_fast", 0))
    except TcError as err:
        assert str(err) == refused
    else:
        raise AssertionError(f"restored on z0: {done}")
    assert 1 not in [i for i, _ in nl.deleted] and nl.roots[1] == ("pfifo_fast", 0)
    tc.close()


@pytest.mark.parametrize("first", ["eth0", "eth1"])
@pytest.mark.parametrize("a_pass_between", [True, False])
def test_a_netdev_renamed_onto_another_shaped_name_is_restored_as_that_name(
    first: str, a_pass_between: bool
) -> None:
    """``ip link del eth1; ip link set eth0 name eth1``, both in the config: the netdev is
    eth1's now, restored by eth1's restore alone, whichever name is restored first."""
    nl, tc = _shaped_pair()
    nl.links = {"eth1": 1}
    nl.macs["eth1"] = MAC_A
    if a_pass_between:
        order = BOTH if first == "eth0" else replace(BOTH, interfaces=BOTH.interfaces[::-1])
        result = tc.sync(order)
        assert str(result.errors["eth0"]) == (
            "eth0: no such network interface (renamed to eth1, ifindex 1: now eth1, shaped as eth1)"
        )
    nl.deleted.clear()  # (the pass, where the double dumps no classes, rebuilds eth1)
    done: dict[str, object] = {}
    for iface in (first, "eth1" if first == "eth0" else "eth0"):
        try:
            done[iface] = tc.restore(iface, tp.RootQdisc("pfifo_fast", 0))
        except TcError as err:
            done[iface] = str(err)
    assert done["eth0"] == (
        "eth0: no such network interface (renamed to eth1, ifindex 1: now eth1, shaped as eth1)"
    )
    eth1 = done["eth1"]
    assert not isinstance(eth1, str) and eth1.ours and eth1.renamed == ""
    assert [i for i, _ in nl.deleted] == [1]
    tc.close()


ONE = tp.plan({"eth0": 10**9}, {"a": 26}, {"a": 0}, [0.1] * 4)


def _shaped_then_renamed() -> tuple[ShapedLinks, TcNetlink]:
    """eth0 (ifindex 1) shaped by one pass, then renamed old0 (its MAC kept)."""
    nl = ShapedLinks(macs={"eth0": MAC_A})
    tc = TcNetlink(transport=nl)
    assert tc.sync(ONE).ok
    nl.links = {"old0": 1}
    nl.macs["old0"] = MAC_A
    return nl, tc


def test_a_failed_dump_keeps_what_the_renamed_error_says_of_gpuds_tree() -> None:
    """The running error is one event while it holds: a dump that fails (ENOBUFS) says
    what the last one saw; with none seen before, that it is unknown and why."""
    nl, tc = _shaped_then_renamed()
    nl.dump_fails = errno.ENOBUFS
    unknown = (
        "eth0: no such network interface (renamed to old0, ifindex 1, gpud's tree on it"
        " unknown (cannot read tc state: ENOBUFS): gpud leaves old0 alone)"
    )
    assert str(tc.drift(ONE).errors["eth0"]) == unknown
    nl.dump_fails = 0
    still = (
        "eth0: no such network interface (renamed to old0, ifindex 1, gpud's tree still on"
        " it: gpud leaves old0 alone)"
    )
    assert str(tc.drift(ONE).errors["eth0"]) == still
    nl.dump_fails = errno.ENOBUFS
    assert str(tc.drift(ONE).errors["eth0"]) == still
    tc.close()


def test_a_restore_deletes_only_gpuds_root_and_says_when_it_changed_since_the_read() -> None:
    """The delete names gpud's handle 6764:, so the kernel refuses a root swapped in after
    the read (EINVAL, "Invalid handle") rather than deleting it."""
    nl = ShapedLinks(roots={1: GPUD_ROOT})
    tc = TcNetlink(transport=nl)
    assert tc.restore("eth0").ours
    assert nl.deleted == [(1, tp.ROOT_MAJOR << 16)]
    tc.close()

    class Swapped(ShapedLinks):
        def request(self, msgs: Sequence[tuple[int, int, bytes]]) -> list[Ack]:
            if msgs[0][0] == RTM_DELQDISC:
                return [Ack(0, errno.EINVAL, "Invalid handle")]
            return super().request(msgs)

    tc = TcNetlink(transport=Swapped(roots={1: GPUD_ROOT}))
    try:
        tc.restore("eth0")
    except TcError as err:
        assert str(err) == (
            "eth0: cannot delete the HTB root: the root qdisc is no longer gpud's HTB 6764:"
            " (replaced or removed since it was read; the kernel answered EINVAL): left as"
            " it is (tc qdisc del dev eth0 root handle 6764:): Invalid handle"
        )
    else:
        raise AssertionError("a refused delete was taken for done")
    tc.close()


def _reply(mtype: int, flags: int, seq: int, payload: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(payload), mtype, flags, seq, 0) + payload


def _dumped(*chunks: bytes) -> tuple[list[memoryview], Ack | None]:
    """What ``_answer`` makes of the kernel's reply to request 7, ``chunks`` one recv each."""
    replies = list(chunks)
    return _answer(lambda: replies.pop(0), 7)


def test_a_dump_the_kernel_says_was_interrupted_is_a_read_error() -> None:
    cls = _reply(RTM_NEWTCLASS, NLM_F_MULTI | NLM_F_DUMP_INTR, 7, b"\0" * 20)
    done = _reply(NLMSG_DONE, NLM_F_MULTI | NLM_F_DUMP_INTR, 7, struct.pack("=i", 0))
    bodies, err = _dumped(cls, done)
    assert len(bodies) == 1
    assert err is not None and err.errno == errno.EINTR
    assert err.detail == "dump interrupted by a change"


def test_a_dump_read_whole_is_its_bodies_without_an_error() -> None:
    late = _reply(RTM_NEWTCLASS, NLM_F_MULTI | NLM_F_DUMP_INTR, 6, b"\0" * 20)  # request 6's
    cls = _reply(RTM_NEWTCLASS, NLM_F_MULTI, 7, b"\0" * 20)
    done = _reply(NLMSG_DONE, NLM_F_MULTI, 7, struct.pack("=i", 0))
    bodies, err = _dumped(late + cls, done)
    assert len(bodies) == 1 and err is None


def test_a_renamed_netdev_whose_mac_changed_is_restored_where_gpuds_tree_is() -> None:
    """``ip link set eth0 name x0; ip link set x0 address 02:11:22:33:44:55`` (a veth, a
    bond taking its slave's MAC): the MAC alone does not tell another netdev, gpud's root
    on the index does, so the restore deletes it there."""
    nl, tc = _shaped_pair()
    nl.links = {"x0": 1, "eth1": 2}
    nl.macs["x0"] = bytes.fromhex("021122334455")
    assert str(tc.drift(BOTH).errors["eth0"]) == (
        "eth0: no such network interface (renamed to x0, ifindex 1, gpud's tree still on it:"
        " gpud leaves x0 alone)"
    )
    nl.deleted.clear()  # (the pass, where the double dumps no classes, rebuilds eth1)
    done = tc.restore("eth0", tp.RootQdisc("pfifo_fast", 0))
    assert done.ours and done.renamed == "x0"
    assert nl.deleted == [(1, tp.ROOT_MAJOR << 16)]
    tc.close()


def test_a_dropped_name_restored_at_start_is_not_taken_for_a_shaped_one() -> None:
    """A name restored as dropped from traffic.interfaces (missing, ``old1``) is not one
    gpud shapes: eth0 renamed onto it later is eth0's, said so and restored as eth0."""
    nl, tc = _shaped_pair()
    try:
        tc.restore("old1")
    except TcError as err:
        assert err.errno == errno.ENODEV
    else:
        raise AssertionError("old1 restored, though no netdev bears that name")
    nl.links = {"old1": 1, "eth1": 2}
    nl.macs["old1"] = MAC_A
    assert str(tc.drift(BOTH).errors["eth0"]) == (
        "eth0: no such network interface (renamed to old1, ifindex 1, gpud's tree still on"
        " it: gpud leaves old1 alone)"
    )
    nl.deleted.clear()  # (the pass, where the double dumps no classes, rebuilds eth1)
    done = tc.restore("eth0", tp.RootQdisc("pfifo_fast", 0))
    assert done.ours and done.renamed == "old1" and [i for i, _ in nl.deleted] == [1]
    tc.close()


def test_of_two_names_that_found_one_index_the_later_look_up_restores_it() -> None:
    """``ip link set eth1 name eth1old; ip link set eth0 name eth1``, a pass (eth1 is
    ifindex 1 now), then ``ip link set eth1 name x0``: the netdev is eth1's, restored by
    eth1's restore; eth0's says whose it is."""
    nl, tc = _shaped_pair()
    nl.links = {"eth1old": 2, "eth1": 1}
    nl.macs.update(eth1old=MAC_B, eth1=MAC_A)
    assert "shaped as eth1" in str(tc.sync(BOTH).errors["eth0"])
    nl.links = {"eth1old": 2, "x0": 1}
    nl.macs["x0"] = MAC_A
    nl.deleted.clear()
    try:
        tc.restore("eth0", None)
    except TcError as err:
        assert str(err) == (
            "eth0: no such network interface (ifindex 1 is now x0, eth1's at gpud's last"
            " look-up, restored as eth1: not taken for eth0)"
        )
    else:
        raise AssertionError("eth0 restored ifindex 1, eth1's since the last pass")
    done = tc.restore("eth1", None)
    assert done.ours and done.renamed == "x0" and [i for i, _ in nl.deleted] == [1]
    tc.close()


def test_a_netdev_gone_during_the_tree_read_is_not_said_to_hold_gpuds_tree() -> None:
    """ENODEV on the qdisc dump of the renamed netdev: it is gone, so gpud's tree with it;
    only a dump failing for a while (ENOBUFS, EINTR) keeps the last answer."""
    nl, tc = _shaped_then_renamed()
    assert "gpud's tree still on it" in str(tc.drift(ONE).errors["eth0"])
    nl.dump_fails = errno.ENODEV
    assert str(tc.drift(ONE).errors["eth0"]) == (
        "eth0: no such network interface (renamed to old0, ifindex 1: gpud leaves old0 alone)"
    )
    tc.close()


def test_a_netdev_renamed_onto_an_adopted_name_before_the_first_pass_is_that_names() -> None:
    """gpud adopts eth0 and eth1, then ``ip link del eth1; ip link set eth0 name eth1`` and
    a stop before any pass: the names adopted are the ones gpud shapes, so the netdev is
    eth1's, restored by eth1's restore, not under its old name."""
    nl = ShapedLinks(
        links={"eth0": 1, "eth1": 2},
        macs={"eth0": MAC_A, "eth1": MAC_B},
        roots={1: GPUD_ROOT, 2: GPUD_ROOT},
    )
    tc = TcNetlink(transport=nl)
    assert all(not isinstance(a, TcError) for a in tc.adopt(["eth0", "eth1"]).values())
    nl.links = {"eth1": 1}
    nl.macs["eth1"] = MAC_A
    with pytest.raises(TcError) as refused:
        tc.restore("eth0", tp.RootQdisc("pfifo_fast", 0))
    assert str(refused.value) == (
        "eth0: no such network interface (renamed to eth1, ifindex 1: now eth1, shaped as eth1)"
    )
    assert refused.value.tree_left is False
    assert nl.deleted == []
    done = tc.restore("eth1", tp.RootQdisc("pfifo_fast", 0))
    assert done.ours and done.renamed == ""
    assert [i for i, _ in nl.deleted] == [1]
    tc.close()


def test_a_restore_says_whether_gpuds_tree_may_stay_where_it_did_nothing() -> None:
    """``tree_left``: False where no netdev bears the name or another netdev without
    gpud's root holds the index; None where that netdev's tc state cannot be read."""
    nl, tc = _shaped_pair()
    with pytest.raises(TcError) as missing:
        tc.restore("a9")
    assert (missing.value.errno, missing.value.tree_left) == (errno.ENODEV, False)

    nl.links = {"z0": 1, "eth1": 2}
    nl.macs["z0"] = bytes.fromhex("0200000000cc")
    nl.roots[1] = ("pfifo_fast", 0)  # a new netdev: the kernel's root, never gpud's
    with pytest.raises(TcError) as other:
        tc.restore("eth0")
    assert "not taken for eth0" in str(other.value) and other.value.tree_left is False

    nl.dump_fails = errno.EPERM
    with pytest.raises(TcError) as unread:
        tc.restore("eth0")
    assert "gpud's tree on it unknown" in str(unread.value)
    assert unread.value.tree_left is None
    tc.close()


def test_a_netdev_deleted_while_gpud_ran_leaves_no_tree_to_its_restore() -> None:
    nl, tc = _shaped_pair()
    nl.links = {"eth1": 2}
    with pytest.raises(TcError) as gone:
        tc.restore("eth0")
    assert (gone.value.errno, gone.value.tree_left) == (errno.ENODEV, False)
    tc.close()


@dataclass
class IndexUnread(ShapedLinks):
    """A kernel whose look-ups by index fail (``fails``: an OSError's errno, or with
    ``acked`` the error ack's) while the look-up by name answers."""

    fails: int = errno.ENOBUFS
    acked: bool = False

    def get(self, mtype: int, body: bytes) -> tuple[list[memoryview], Ack | None]:
        if _ifname(body):
            return super().get(mtype, body)
        if self.acked:
            return [], Ack(0, self.fails, None)
        raise OSError(self.fails, os.strerror(self.fails))


@pytest.mark.parametrize("acked", [False, True])
def test_a_renamed_netdev_unread_by_its_ifindex_may_keep_gpuds_tree(acked: bool) -> None:
    """eth0 shaped, ``ip link set eth0 name old0``, and the look-up of ifindex 1 fails
    (ENOBUFS): that is not "no such netdev", gpud's tree may stay on old0."""
    nl = IndexUnread(macs={"eth0": MAC_A}, acked=acked)
    tc = TcNetlink(transport=nl)
    assert tc.sync(ONE).ok
    nl.links = {"old0": 1}
    with pytest.raises(TcError) as unread:
        tc.restore("eth0")
    assert str(unread.value) == (
        "eth0: no such network interface; the netdev on ifindex 1 unread: ENOBUFS"
    )
    assert (unread.value.errno, unread.value.tree_left) == (errno.ENODEV, None)
    assert 1 not in [i for i, _ in nl.deleted]
    nl.fails = errno.ENODEV  # the index gone too: nothing of gpud's left
    with pytest.raises(TcError) as gone:
        tc.restore("eth0")
    assert (str(gone.value), gone.value.tree_left) == ("eth0: no such network interface", False)
    tc.close()


def test_a_netdev_restored_under_a_later_looked_up_name_leaves_no_tree_to_the_first() -> None:
    """eth0 renamed old1, a name restored as dropped from traffic.interfaces: old1's
    restore gave the netdev back, so eth0's refusal leaves nothing of gpud's."""
    nl, tc = _shaped_pair()
    nl.links = {"old1": 1, "eth1": 2}
    nl.macs["old1"] = MAC_A
    assert tc.restore("old1").ours
    with pytest.raises(TcError) as refused:
        tc.restore("eth0")
    assert "old1's at gpud's last look-up, restored as old1" in str(refused.value)
    assert refused.value.tree_left is False
    tc.close()


def test_what_was_seen_of_gpuds_tree_is_kept_for_the_names_indexes_only() -> None:
    """eth0 renamed away and made again many times while gpud runs: each renamed-away
    netdev's tree is read once for its error, and not remembered past the next look-up
    of eth0 on its new ifindex."""
    nl = ShapedLinks(links={"eth0": 1})
    tc = TcNetlink(transport=nl)
    for index in range(1, 40):
        nl.links = {"eth0": index}
        assert tc.drift(ONE).ok
        nl.links = {f"old{index}": index}
        assert "gpud leaves" in str(tc.drift(ONE).errors["eth0"])
    assert set(tc._tree_seen) == {39}
    tc.close()


@pytest.mark.parametrize(
    ("under", "kind", "why"),
    [
        ("file/ns", NotADirectoryError, "Not a directory"),
        ("file", OSError, ""),  # root: setns(2) refuses a file that is no namespace
    ],
)
def test_a_namespace_that_cannot_be_entered_is_named_once(
    tmp_path: Path, under: str, kind: type[OSError], why: str
) -> None:
    """A namespace path ``open(2)`` or ``setns(2)`` refuses is an OSError of its errno that
    names the namespace, once: not pyroute2's bare "failed to open netns", nor the path
    a second time after the message."""
    (tmp_path / "file").write_text("")
    netns = str(tmp_path / under)
    with pytest.raises(kind) as info:
        netns_socket(netns, socket.AF_NETLINK, socket.SOCK_RAW)
    message = str(info.value)
    assert message.startswith(f"[Errno {info.value.errno}] network namespace {netns!r}")
    assert message.count(netns) == 1 and why in message
