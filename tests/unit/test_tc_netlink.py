"""TcNetlink's error handling and caching, over a double of the netlink socket.

The real kernel is exercised in tests/integration/test_tc_netlink.py; here the double
plays a kernel without HTB on one interface, which no test machine can be made into.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

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
