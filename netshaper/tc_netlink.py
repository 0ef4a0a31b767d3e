"""The tc adapter: applies a :class:`netshaper.tcplan.TcPlan` to the kernel over rtnetlink.

The only module that imports pyroute2. pyroute2 opens the netlink socket (inside a network
namespace if asked: that forks a short-lived child, so open the adapter *before* starting
gRPC servers or threads); the tc messages themselves are encoded and decoded here with
``struct``, because pyroute2's request compiler costs about 0.4 ms per HTB class and a
re-prioritization tick sends up to a few hundred messages.

API (one instance per daemon, not thread-safe; call it from the daemon's traffic step)::

    tc = TcNetlink(netns=None)              # or netns="name" (/run/netns/name)
    found = tc.adopt(["eth0", "eth1"])      # at start: {iface: AdoptedState}
    result = tc.sync(plan)                  # every tick the plan changed: only the diff
    result = tc.drift(plan)                 # every tick: re-read the kernel, restore
    result.ok, result.errors                # {iface: TcError} -- other ifaces enforced
    result.interfaces["eth0"].restored      # what drift put back, as readable lines
    tc.counters("eth0")                     # {classid: ClassCounters} (bytes/packets/drops)
    tc.restore("eth0", found["eth0"].original, ifindex=found["eth0"].ifindex)  # Restored
    tc.close()

What the kernel shows after ``sync`` on ``eth0`` (``tc -s class show dev eth0``; tc prints
``prio`` for leaf classes only; the classes come in hash order)::

    class htb 6764:1 root rate 10Gbit ceil 10Gbit burst 1250000b cburst 1250000b
    class htb 6764:2 parent 6764:1 prio 7 rate 200Mbit ceil 10Gbit ...   (untagged traffic)
    class htb 6764:10 parent 6764:1 rate 200Mbit ceil 10Gbit ...         (level 0, has jobs)
    class htb 6764:11 parent 6764:1 prio 1 rate 200Mbit ceil 10Gbit ...  (level 1, empty)
    class htb 6764:101a parent 6764:10 prio 0 rate 10Mbit ceil 10Gbit ... (DSCP 26's job)
     Sent 58792532 bytes 38834 pkt (dropped 0, overlimits 6 requeues 0)
     backlog 0b 0p requeues 0
     lended: 8 borrowed: 1045 giants: 0

and ``tc filter show dev eth0`` (the ``*`` is tc's, for every u32 filter with a flowid)::

    filter parent 6764: protocol all pref 1 u32 chain 0 fh 800: ht divisor 1
    filter parent 6764: protocol all pref 1 u32 chain 0 fh 800::35 order 53 key ht 800
      bkt 0 *flowid 6764:101a not_in_hw
      match 40680000/f0fc0000 at 0                     (IPv4, DSCP 26)
    filter parent 6764: protocol all pref 1 u32 chain 0 fh 800::36 order 54 key ht 800
      bkt 0 *flowid 6764:101a not_in_hw
      match 66800000/ffc00000 at 0                     (IPv6, DSCP 26)

Behaviour:

* ``sync`` diffs the plan against what this adapter last saw the kernel hold (read from
  the kernel on first use of an interface, after any error, and on every ``drift``); an
  interface where that leaves nothing to do is read and checked instead (so calling
  ``sync`` every tick also repairs drift). It sends every operation of every interface
  in one batch on one socket (several
  ``sendmsg`` calls of up to 64 KiB). Only the last message of each call asks for an
  ack; the kernel answers the others only when they fail, and errors are matched to
  operations by sequence number.
* Errors stay with their interface: an unknown interface, a kernel without HTB or u32, or
  any netlink error is reported as a :class:`TcError` for that interface (with the op and
  the kernel's extended-ack message), and every other interface is still enforced. When
  ``sync``'s operations fail on an interface because it changed behind our back, the
  interface is read again and repaired in the same call.
* ``adopt`` never tears anything down: after ``kill -9`` the next start finds its HTB root
  (handle ``6764:``) and keeps it -- the last priorities stay in force (fail-static) until
  the first ``sync`` changes only what differs. For a foreign root it reports the
  original kind, which ``restore`` can bring back (for our own root it cannot know: the
  daemon keeps the original from the start that first took the interface).
* A qdisc someone attached under one of our classes is drift (deleted: the class gets
  HTB's default queue back, which dumps do not list); a root re-made with our handle is
  deleted before the tree is rebuilt, since the kernel treats a replace of the same
  handle as a change, which HTB refuses.
* Interfaces not in the plan are never touched. An interface is known by its name: each
  pass looks the name up afresh (one ``RTM_GETLINK``), so one renamed away (or deleted and
  created again) is left alone, and whichever interface bears the name now is shaped.
  ``restore`` on another netdev than the one last seen by that name deletes our root
  only: the original it is given was the old netdev's.
"""

from __future__ import annotations

import errno as errno_mod
import os
import socket
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from pyroute2.netns import create_socket

from netshaper.ethtool import ARPHRD_LOOPBACK
from netshaper.tcplan import (
    ETH_P_ALL,
    FILTER_PRIO,
    ROOT_MAJOR,
    ChildQdisc,
    DscpFilter,
    HtbClass,
    InterfacePlan,
    InterfaceState,
    OpKind,
    RootQdisc,
    TcOp,
    TcPlan,
    diff,
    filter_from_key,
    format_handle,
    format_qdisc_handle,
    format_u32_handle,
    protocol_name,
    state_after,
    u32_htid,
)

# --- rtnetlink constants (linux/rtnetlink.h, pkt_sched.h, pkt_cls.h) -------------------
NETLINK_ROUTE = 0
SOL_NETLINK = 270
NETLINK_CAP_ACK = 10
NETLINK_EXT_ACK = 11
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NLM_F_DUMP_INTR = 0x10
NLM_F_REPLACE = 0x100
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
NLM_F_ACK_TLVS = 0x200
NLMSGERR_ATTR_MSG = 1
RTM_NEWLINK = 16
RTM_GETLINK = 18
RTM_NEWQDISC = 36
RTM_DELQDISC = 37
RTM_GETQDISC = 38
RTM_NEWTCLASS = 40
RTM_DELTCLASS = 41
RTM_GETTCLASS = 42
RTM_NEWTFILTER = 44
RTM_DELTFILTER = 45
RTM_GETTFILTER = 46
IFLA_ADDRESS = 1
IFLA_IFNAME = 3
IFLA_PERM_ADDRESS = 54  # the NIC's burnt-in MAC (kernel 5.5+); absent or zero on virtual ones
TCA_KIND = 1
TCA_OPTIONS = 2
TCA_STATS2 = 7
TCA_STATS_BASIC = 1
TCA_STATS_QUEUE = 3
TCA_STATS_PKT64 = 8
TCA_HTB_PARMS = 1
TCA_HTB_INIT = 2
TCA_HTB_RATE64 = 6
TCA_HTB_CEIL64 = 7
TCA_U32_CLASSID = 1
TCA_U32_SEL = 5
TC_H_ROOT = 0xFFFFFFFF
TC_LINKLAYER_ETHERNET = 1
TC_U32_TERMINAL = 1
HTB_VERSION = 3
HTB_R2Q = 10
NLA_F_MASK = 0x3FFF

_NLMSGHDR = struct.Struct("=IHHII")
_TCMSG = struct.Struct("=BxxxiIII")
_IFINFOMSG = struct.Struct("=BxHiII")
_RATESPEC = "BBHhHI"
_HTB_OPT = struct.Struct("=" + _RATESPEC + _RATESPEC + "IIIII")
_HTB_GLOB = struct.Struct("=IIIII")
_U32_SEL = struct.Struct("=BBBxHHhhI")
_U32_KEY = struct.Struct(">IIii")
_NLA = struct.Struct("=HH")
_SEND_CHUNK = 64 * 1024
_RCVBUF = 4 * 1024 * 1024
_TIMEOUT_S = 10.0


class TcError(Exception):
    """tc enforcement failed on one interface.

    ``iface`` names it, ``op`` is the tc command that failed (as ``tc`` would read it, or
    None when the interface could not be read at all), ``errno`` the kernel's error number
    and ``detail`` the kernel's extended-ack message, when it gave one.

    ``tree_left``: whether gpud's HTB root ``6764:`` may stay on a netdev because of it:
    False where none does (no netdev by that name, or its index is another name's to
    restore), True where a refusal saw gpud's root on the netdev it left alone, None
    where it is not known (a failed read or request leaves the root as it was).
    ``tree_removed``: True where a restore deleted gpud's root and only the re-install of
    the original one failed (``tree_left`` False: the netdev has the kernel's default
    root, not the one from before gpud).
    """

    def __init__(
        self,
        iface: str,
        message: str,
        *,
        op: str | None = None,
        errno: int | None = None,
        detail: str | None = None,
        tree_left: bool | None = None,
        tree_removed: bool = False,
    ) -> None:
        text = f"{iface}: {message}"
        if op:
            text += f" (tc {op})"
        if detail:
            text += f": {detail}"
        super().__init__(text)
        self.iface = iface
        self.op = op
        self.errno = errno
        self.detail = detail
        self.tree_left = tree_left
        self.tree_removed = tree_removed


@dataclass(frozen=True)
class InterfaceResult:
    """What one sync or drift pass did on one interface.

    ``tc_ops``: the operations sent; ``ops``: the same as ``tc`` command lines (formatted
    when asked for: a busy tick does not pay for strings nobody reads); ``restored``: for
    drift, what had been changed or removed behind our back and was put back, one line
    each (empty for a plain sync); ``error``: the first failure (the interface is then
    re-read on the next pass); ``replaced``: "ifindex NEW, was OLD" when the name is
    another netdev's since the last pass (deleted and created again between two passes),
    else "".
    """

    iface: str
    tc_ops: tuple[TcOp, ...] = ()
    drift: bool = False
    error: TcError | None = None
    replaced: str = ""

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(" ".join(op.tc_args()) for op in self.tc_ops)

    @property
    def restored(self) -> tuple[str, ...]:
        return tuple(_describe(op) for op in self.tc_ops) if self.drift else ()


@dataclass(frozen=True)
class SyncResult:
    interfaces: Mapping[str, InterfaceResult] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.error is None for r in self.interfaces.values())

    @property
    def errors(self) -> dict[str, TcError]:
        return {i: r.error for i, r in self.interfaces.items() if r.error is not None}

    @property
    def op_count(self) -> int:
        return sum(len(r.tc_ops) for r in self.interfaces.values())

    @property
    def restored(self) -> dict[str, tuple[str, ...]]:
        return {i: r.restored for i, r in self.interfaces.items() if r.restored}


@dataclass(frozen=True)
class ClassCounters:
    """One class's counters, as ``tc -s class show`` prints them (``Sent B bytes P pkt
    (dropped D, overlimits O ...)``, ``backlog``)."""

    classid: int
    bytes: int
    packets: int
    drops: int
    overlimits: int
    backlog_bytes: int

    @property
    def name(self) -> str:
        return format_handle(self.classid)


@dataclass(frozen=True)
class AdoptedState:
    """What ``adopt`` found on one interface.

    ``ours``: our HTB root was there (left as it is); ``original``: the root qdisc that
    was there before gpud's (None when ours was found: it was replaced earlier, and only
    the daemon's record, ``gpud.net.shaped``, knows what it was); ``state``: everything
    read; ``ifindex``: the netdev's index (``ip link show``), which a netdev deleted and
    created again under the name does not keep (unless given the old index explicitly, or
    moved in from another namespace keeping it: such a netdev is taken for the old one).
    """

    iface: str
    ours: bool
    original: RootQdisc | None
    state: InterfaceState
    ifindex: int


@dataclass(frozen=True)
class Restored:
    """What ``restore`` did on one interface.

    ``ours``: gpud's HTB root was there and was deleted (False: another root was found and
    left as it is); ``replaced``: "ifindex NEW, was OLD" when the name is another netdev's
    than the one the original was recorded on, else ""; ``root``: the root qdisc left on
    the interface (None: none dumped, as on a netdev that is down; or not read again
    after the original was re-installed, or after gpud's root was deleted).
    """

    ours: bool
    replaced: str = ""
    root: RootQdisc | None = None
    renamed: str = ""
    """The netdev's name now, when it was renamed away from ``iface`` since this adapter
    last looked it up (same ifindex, so still the netdev gpud shaped): "" when not."""


# --- encoding ---------------------------------------------------------------------------


def _nla(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return _NLA.pack(length, kind) + payload + b"\0" * (-length % 4)


def _kind(name: str) -> bytes:
    return _nla(TCA_KIND, name.encode() + b"\0")


class _Psched:
    """The kernel's tick arithmetic (``/proc/net/psched``), as tc uses it for ``buffer``."""

    def __init__(self, proc_root: str = "/proc") -> None:
        try:
            with open(os.path.join(proc_root, "net/psched")) as f:
                t2us, us2t, clock_res, _ = (int(x, 16) for x in f.read().split())
            self.tick_in_usec = t2us / us2t * (clock_res / 1_000_000)
        except (OSError, ValueError):
            self.tick_in_usec = 15.625  # t2us=1000, us2t=64: every kernel since 2.6.x

    def xmittime(self, rate_bytes: int, size: int) -> int:
        ticks = int(1_000_000 * size / rate_bytes * self.tick_in_usec)
        return min(ticks, 0xFFFFFFFF)

    def xmitsize(self, rate_bytes: int, ticks: int) -> int:
        return round(rate_bytes * ticks / self.tick_in_usec / 1_000_000)


def _ratespec(rate_bytes: int) -> tuple[int, ...]:
    # cell_log, linklayer, overhead, cell_align, mpu, rate; linklayer "ethernet" tells the
    # kernel not to expect a rate table.
    return (0, TC_LINKLAYER_ETHERNET, 0, -1, 0, min(rate_bytes, 0xFFFFFFFF))


class _Encoder:
    def __init__(self, psched: _Psched) -> None:
        self._ps = psched

    def root(self, ifindex: int, op: TcOp) -> tuple[int, int, bytes]:
        if op.kind is OpKind.DELETE_ROOT:
            # the handle (gpud's, or 0: any root) makes the kernel refuse another's root
            return RTM_DELQDISC, 0, _TCMSG.pack(0, ifindex, op.root, TC_H_ROOT, 0)
        glob = _HTB_GLOB.pack(HTB_VERSION, HTB_R2Q, op.default_classid & 0xFFFF, 0, 0)
        body = _TCMSG.pack(0, ifindex, op.root, TC_H_ROOT, 0)
        body += _kind("htb") + _nla(TCA_OPTIONS, _nla(TCA_HTB_INIT, glob))
        return RTM_NEWQDISC, NLM_F_CREATE | NLM_F_REPLACE, body

    def cls(self, ifindex: int, op: TcOp) -> tuple[int, int, bytes]:
        c = op.cls
        assert c is not None
        if op.kind is OpKind.DELETE_CLASS:
            return RTM_DELTCLASS, 0, _TCMSG.pack(0, ifindex, c.classid, c.parent, 0)
        rate, ceil = c.rate_bps // 8, c.ceil_bps // 8
        parms = _HTB_OPT.pack(
            *_ratespec(rate),
            *_ratespec(ceil),
            self._ps.xmittime(rate, c.burst),
            self._ps.xmittime(ceil, c.cburst),
            c.quantum,
            0,
            c.prio,
        )
        opts = _nla(TCA_HTB_PARMS, parms)
        if rate > 0xFFFFFFFF:
            opts += _nla(TCA_HTB_RATE64, struct.pack("=Q", rate))
        if ceil > 0xFFFFFFFF:
            opts += _nla(TCA_HTB_CEIL64, struct.pack("=Q", ceil))
        body = _TCMSG.pack(0, ifindex, c.classid, c.parent, 0)
        body += _kind("htb") + _nla(TCA_OPTIONS, opts)
        flags = NLM_F_CREATE | NLM_F_EXCL if op.kind is OpKind.ADD_CLASS else 0
        return RTM_NEWTCLASS, flags, body

    def flt(self, ifindex: int, op: TcOp) -> tuple[int, int, bytes]:
        if op.kind is OpKind.DELETE_FILTER:
            info = (op.filter_prio << 16) | socket.htons(op.filter_protocol)
            body = _TCMSG.pack(0, ifindex, op.filter_handle, op.root, info)
            if op.filter_handle:  # one u32 filter; handle 0: the whole prio, any classifier
                body += _kind("u32")
            return RTM_DELTFILTER, 0, body
        f = op.flt
        assert f is not None
        value, mask = f.key
        sel = _U32_SEL.pack(TC_U32_TERMINAL, 0, 1, 0, 0, 0, 0, 0) + _U32_KEY.pack(mask, value, 0, 0)
        opts = _nla(TCA_U32_CLASSID, struct.pack("=I", f.flowid)) + _nla(TCA_U32_SEL, sel)
        info = (FILTER_PRIO << 16) | socket.htons(ETH_P_ALL)
        # add: node only (the kernel puts it in the prio's root hash table); change: as read
        body = _TCMSG.pack(0, ifindex, op.filter_handle or f.node, op.root, info)
        body += _kind("u32") + _nla(TCA_OPTIONS, opts)
        flags = NLM_F_CREATE | NLM_F_EXCL if op.kind is OpKind.ADD_FILTER else 0
        return RTM_NEWTFILTER, flags, body

    def encode(self, ifindex: int, op: TcOp) -> tuple[int, int, bytes]:
        if op.kind in (OpKind.REPLACE_ROOT, OpKind.DELETE_ROOT):
            return self.root(ifindex, op)
        if op.qdisc is not None:
            q = op.qdisc
            return RTM_DELQDISC, 0, _TCMSG.pack(0, ifindex, q.handle, q.parent, 0)
        if op.kind in (OpKind.ADD_CLASS, OpKind.CHANGE_CLASS, OpKind.DELETE_CLASS):
            return self.cls(ifindex, op)
        return self.flt(ifindex, op)


# --- decoding ---------------------------------------------------------------------------


def _attrs(data: bytes | memoryview, start: int, end: int) -> dict[int, memoryview]:
    out: dict[int, memoryview] = {}
    view = memoryview(data)
    pos = start
    while pos + 4 <= end:
        length, kind = _NLA.unpack_from(view, pos)
        if length < 4:
            break
        out[kind & NLA_F_MASK] = view[pos + 4 : pos + length]
        pos += (length + 3) & ~3
    return out


def _cstr(v: memoryview) -> str:
    return bytes(v).split(b"\0", 1)[0].decode()


@dataclass
class _TcMsg:
    ifindex: int
    handle: int
    parent: int
    info: int
    kind: str
    attrs: dict[int, memoryview]

    def options(self) -> dict[int, memoryview]:
        opt = self.attrs.get(TCA_OPTIONS)
        return _attrs(opt, 0, len(opt)) if opt is not None else {}

    def stats(self) -> tuple[int, int, int, int, int]:
        """(bytes, packets, drops, overlimits, backlog bytes)."""
        s2 = self.attrs.get(TCA_STATS2)
        if s2 is None:
            return 0, 0, 0, 0, 0
        st = _attrs(s2, 0, len(s2))
        nbytes = packets = drops = overlimits = backlog = 0
        if (basic := st.get(TCA_STATS_BASIC)) is not None:
            nbytes, packets = struct.unpack_from("=QI", basic)
        if (pkt64 := st.get(TCA_STATS_PKT64)) is not None:
            (packets,) = struct.unpack_from("=Q", pkt64)
        if (queue := st.get(TCA_STATS_QUEUE)) is not None:
            _qlen, backlog, drops, _requeues, overlimits = struct.unpack_from("=IIIII", queue)
        return nbytes, packets, drops, overlimits, backlog


def _decode_tcmsg(body: memoryview) -> _TcMsg:
    _family, ifindex, h, parent, info = _TCMSG.unpack_from(body, 0)
    attrs = _attrs(body, _TCMSG.size, len(body))
    kind = _cstr(attrs[TCA_KIND]) if TCA_KIND in attrs else ""
    return _TcMsg(ifindex, h, parent, info, kind, attrs)


@dataclass(frozen=True)
class Ack:
    """The kernel's answer to one request: ``errno`` 0 for success, else the positive
    error number; ``detail`` the extended-ack message (``Error: ...`` in tc's output)."""

    seq: int
    errno: int
    detail: str | None


class NetlinkTransport(Protocol):
    """What :class:`TcNetlink` needs from an rtnetlink socket (a test double implements it)."""

    def request(self, msgs: Sequence[tuple[int, int, bytes]]) -> list[Ack]:
        """Send (type, flags, body) messages; one Ack per message, in order (errno 0: done)."""
        ...

    def dump(self, mtype: int, body: bytes) -> tuple[list[memoryview], Ack | None]:
        """A dump: the reply bodies, and the error Ack if the kernel refused."""
        ...

    def get(self, mtype: int, body: bytes) -> tuple[list[memoryview], Ack | None]:
        """One object (``RTM_GETLINK`` by name): its reply body, or the error Ack."""
        ...

    def close(self) -> None: ...


def netns_socket(netns: str, family: int, kind: int, proto: int = 0) -> socket.socket:
    """A socket made in the network namespace ``/run/netns/NETNS`` (one fork): what the
    kernel answers on it (an ioctl, a netlink dump) is about that namespace's netdevs. A
    NETNS that cannot be entered is an OSError naming it (a FileNotFoundError where it
    does not exist, a PermissionError where ``open(2)`` or ``setns(2)`` is refused); it is
    never created (pyroute2's ``create_socket`` makes one by default: its ``flags`` are
    ``open(2)``'s, O_CREAT)."""
    try:
        sock: socket.socket = create_socket(netns, family, kind, proto, flags=0)
    except OSError as e:
        # pyroute2's forked child gives only errno and strerror ("failed to open netns"
        # for a file setns(2) refuses): which namespace is the caller's to say. A bare name
        # is a file under /run/netns, said once beside it; a path is the name itself
        path = "" if "/" in netns else f"/run/netns/{netns}; "
        if isinstance(e, FileNotFoundError):
            why = (
                f"does not exist (no {path or 'such file; '}`ip netns list` names those"
                " that do): nothing was created"
            )
        else:
            why = f"cannot be entered ({path}{e.strerror or e})"
        named = f"network namespace {netns!r}"
        # OSError(errno, ...) is the errno's own subclass (FileNotFoundError, ...); no
        # filename, which str() would show after the message a second time
        raise OSError(e.errno, f"{named} {why}") from e
    return sock


class _Netlink:
    """One rtnetlink socket: batched requests with per-message acks, and dumps."""

    def __init__(self, netns: str | None) -> None:
        if netns is None:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        else:
            sock = netns_socket(netns, socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        try:
            sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
            sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
            sock.bind((0, 0))
            sock.settimeout(_TIMEOUT_S)  # a lost answer fails the pass, never hangs the daemon
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._seq = 1

    def close(self) -> None:
        self._sock.close()

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0x7FFFFFFF or 1
        return self._seq

    def request(self, msgs: Sequence[tuple[int, int, bytes]]) -> list[Ack]:
        """Send every message (type, flags, body); one Ack per message, in order.

        The kernel handles the messages of one ``sendmsg`` in order, before it returns, and
        answers a message without NLM_F_ACK only when it fails. So only the last message of
        each chunk asks for an ack: once that ack is read, every error of the chunk has
        been read too, and one ``recv`` serves a chunk instead of one per message.
        """
        seqs = [self._next_seq() for _ in msgs]
        mine = frozenset(seqs)
        errors: dict[int, Ack] = {}
        chunk = bytearray()
        for i, ((mtype, flags, body), seq) in enumerate(zip(msgs, seqs, strict=True)):
            last = i == len(msgs) - 1
            if not last:
                nxt = msgs[i + 1][2]
                last = len(chunk) + 32 + len(body) + len(nxt) > _SEND_CHUNK
            nl_flags = flags | NLM_F_REQUEST | (NLM_F_ACK if last else 0)
            chunk += _NLMSGHDR.pack(16 + len(body), mtype, nl_flags, seq, 0) + body
            if last:
                self._send_and_collect(bytes(chunk), mine, seq, errors)
                chunk.clear()
        return [errors.get(s) or Ack(s, 0, None) for s in seqs]

    def _send_and_collect(
        self, data: bytes, mine: frozenset[int], last: int, errors: dict[int, Ack]
    ) -> None:
        self._sock.send(data)
        while True:
            for mtype, flags, seq, payload in _messages(self._sock.recv(1 << 20)):
                if mtype != NLMSG_ERROR or seq not in mine:
                    continue  # a late answer to an earlier request
                ack = _ack(seq, flags, payload)
                if ack.errno:
                    errors[seq] = ack
                if seq == last:
                    return

    def dump(self, mtype: int, body: bytes) -> tuple[list[memoryview], Ack | None]:
        """A dump request; returns (message bodies, error ack or None)."""
        return self._query(mtype, body, NLM_F_DUMP)

    def get(self, mtype: int, body: bytes) -> tuple[list[memoryview], Ack | None]:
        """A get request, acked: its answer ends with the ack (or the error)."""
        return self._query(mtype, body, NLM_F_ACK)

    def _query(self, mtype: int, body: bytes, kind: int) -> tuple[list[memoryview], Ack | None]:
        seq = self._next_seq()
        hdr = _NLMSGHDR.pack(16 + len(body), mtype, NLM_F_REQUEST | kind, seq, 0)
        self._sock.send(hdr + body)
        return _answer(lambda: self._sock.recv(1 << 20), seq)


def _answer(recv: Callable[[], bytes], seq: int) -> tuple[list[memoryview], Ack | None]:
    """The reply bodies to request ``seq``, read with ``recv`` up to its end, and the error
    Ack, if any. A dump the kernel flags ``NLM_F_DUMP_INTR`` (the objects changed while it
    was dumped: some may be missing or seen twice) is an error, EINTR, as for iproute2: a
    partial read is not taken for the kernel's state."""
    out: list[memoryview] = []
    intr = False
    while True:
        for rtype, flags, rseq, payload in _messages(recv()):
            if rseq != seq:
                continue  # a late answer to an earlier request
            intr = intr or bool(flags & NLM_F_DUMP_INTR)
            if rtype in (NLMSG_DONE, NLMSG_ERROR):
                ack = _ack(rseq, flags, payload) if len(payload) >= 4 else None
                if ack is not None and ack.errno:
                    return out, ack
                if intr:
                    return out, Ack(seq, errno_mod.EINTR, "dump interrupted by a change")
                return out, None
            out.append(payload)


def _ack(seq: int, flags: int, payload: memoryview) -> Ack:
    """An NLMSG_ERROR (or NLMSG_DONE) payload: the error, and the extended-ack message."""
    (err,) = struct.unpack_from("=i", payload, 0)
    detail = None
    if flags & NLM_F_ACK_TLVS:
        # NETLINK_CAP_ACK: the echoed request is only its 16-byte header.
        tlvs = _attrs(payload, 4 + 16, len(payload))
        if NLMSGERR_ATTR_MSG in tlvs:
            detail = _cstr(tlvs[NLMSGERR_ATTR_MSG])
    return Ack(seq, -err, detail)


def _messages(buf: bytes) -> Iterator[tuple[int, int, int, memoryview]]:
    view = memoryview(buf)
    pos = 0
    while pos + 16 <= len(buf):
        length, mtype, flags, seq, _pid = _NLMSGHDR.unpack_from(view, pos)
        if length < 16:
            return
        yield mtype, flags, seq, view[pos + 16 : pos + length]
        pos += (length + 3) & ~3


def _errname(err: int) -> str:
    return errno_mod.errorcode.get(err, str(err))


def _describe(op: TcOp) -> str:
    """A line for the event log: what a drift repair put back."""
    if op.cls is not None:
        what = f"class {op.cls.name}"
        if op.cls.job is not None:
            what += f" (job {op.cls.job}, level {op.cls.level})"
        elif op.cls.level is not None:
            what += f" (level {op.cls.level})"
        verb = {
            OpKind.ADD_CLASS: "re-added",
            OpKind.CHANGE_CLASS: "reset",
            OpKind.DELETE_CLASS: "removed",
        }[op.kind]
        return f"{verb} {what}"
    if op.flt is not None:
        f = op.flt
        return f"re-added {f.family.value} filter DSCP {f.dscp} -> {format_handle(f.flowid)}"
    if op.kind is OpKind.DELETE_FILTER and op.filter_handle:
        return f"removed u32 filter {format_u32_handle(op.filter_handle)} (pref {op.filter_prio})"
    if op.kind is OpKind.DELETE_FILTER:  # a prio of someone else's: all of it goes
        proto = protocol_name(op.filter_protocol)
        return f"removed every filter of pref {op.filter_prio} (protocol {proto})"
    if op.qdisc is not None:
        q = op.qdisc
        return (
            f"removed {q.kind} qdisc {format_qdisc_handle(q.handle)} under class"
            f" {format_handle(q.parent)} (back to HTB's default queue)"
        )
    if op.kind is OpKind.DELETE_ROOT:
        return f"removed a root qdisc that held gpud's handle {format_qdisc_handle(op.root)}"
    if op.kind is OpKind.REPLACE_ROOT:
        return f"re-installed HTB root {format_qdisc_handle(op.root)}"
    return " ".join(op.tc_args())


class TcNetlink:
    """Applies ``TcPlan``\\s over one rtnetlink socket; see the module docstring."""

    def __init__(
        self,
        netns: str | None = None,
        *,
        proc_root: str = "/proc",
        transport: NetlinkTransport | None = None,
    ) -> None:
        """Open the socket (in ``/run/netns/<netns>`` when given; that forks once). A
        namespace that does not exist is a FileNotFoundError naming it, and is not made.

        ``transport`` replaces the socket (tests); ``proc_root`` is where
        ``net/psched`` is read.
        """
        self._nl: NetlinkTransport = transport if transport is not None else _Netlink(netns)
        self._ps = _Psched(proc_root)
        self._enc = _Encoder(self._ps)
        self._ifindex: dict[str, int] = {}
        self._cache: dict[str, InterfaceState] = {}
        self._cache_index: dict[str, int] = {}  # the index each cached state was read on
        # names found on another netdev than the last pass's, until a pass reports it
        self._replaced: dict[str, str] = {}
        self._loopbacks: set[str] = set()  # names whose last look-up was ARPHRD_LOOPBACK
        # (index, fingerprint) of each name's last look-up: tells a netdev deleted and
        # another made with its index from the one gpud shaped
        self._prints: dict[str, tuple[int, _Fingerprint]] = {}
        # the names of the last plan a pass was given, or of an adopt before it: those in
        # traffic.interfaces, which a netdev renamed onto is shaped and restored as
        self._shaping: frozenset[str] = frozenset()
        # when each name was last looked up (a count of look-ups): of two names whose
        # last look-ups found one index, the later one's netdev it is
        self._looked: dict[str, int] = {}
        # whether gpud's tree was on an index when last read: a failed read keeps it
        self._tree_seen: dict[int, bool] = {}

    def close(self) -> None:
        self._nl.close()

    def __enter__(self) -> TcNetlink:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- reading ------------------------------------------------------------------------

    def _lookup(self, iface: str) -> int:
        """The index the kernel gives ``iface`` now (``RTM_GETLINK`` by name)."""
        body = _IFINFOMSG.pack(0, 0, 0, 0, 0) + _nla(IFLA_IFNAME, iface.encode() + b"\0")
        try:
            msgs, err = self._nl.get(RTM_GETLINK, body)
        except OSError as oserr:
            raise TcError(
                iface, f"cannot look the interface up: {oserr}", errno=oserr.errno
            ) from oserr
        if err is not None and err.errno in (errno_mod.ENODEV, errno_mod.ENOENT):
            raise TcError(
                iface, "no such network interface", errno=errno_mod.ENODEV, tree_left=False
            )
        if err is not None or not msgs:
            errnum = err.errno if err is not None else errno_mod.EIO
            raise TcError(iface, f"cannot look the interface up: {_errname(errnum)}", errno=errnum)
        _fam, kind, index, _flags, _change = _IFINFOMSG.unpack_from(msgs[0], 0)
        if kind == ARPHRD_LOOPBACK:
            self._loopbacks.add(iface)
        else:
            self._loopbacks.discard(iface)
        self._prints[iface] = (int(index), _fingerprint(msgs[0]))
        return int(index)

    def ifindex(self, iface: str) -> int:
        """The interface's index in this adapter's namespace; TcError if there is none."""
        idx = self._ifindex.get(iface)
        if idx is None:
            idx = self._ifindex[iface] = self._lookup(iface)
        return idx

    def _link_at(self, iface: str, index: int, err: TcError) -> tuple[str, _Fingerprint] | None:
        """The name and fingerprint the kernel gives index ``index`` now (``ip link show``,
        ``RTM_GETLINK`` by index); None when there is no such index (the kernel's
        ``ENODEV``). Unread (``ENOBUFS``, ``EINTR``, any other error or an answer without
        a name), the netdev ``iface`` was may be there under another name with gpud's
        tree: a TcError (``ENODEV``, caused by ``err``, the look-up by name that failed)
        whose ``tree_left`` is None raised."""
        try:
            msgs, ack = self._nl.get(RTM_GETLINK, _IFINFOMSG.pack(0, 0, index, 0, 0))
        except OSError as oserr:
            if oserr.errno == errno_mod.ENODEV:
                return None
            failed = _errname(oserr.errno) if oserr.errno else str(oserr)
        else:
            if ack is not None and ack.errno == errno_mod.ENODEV:
                return None
            name = None
            if ack is None and msgs:
                name = _attrs(msgs[0], _IFINFOMSG.size, len(msgs[0])).get(IFLA_IFNAME)
            if name is not None:
                text = bytes(name).split(b"\0", 1)[0].decode(errors="backslashreplace")
                return text, _fingerprint(msgs[0])
            failed = _errname(ack.errno) if ack is not None else "no name in the answer"
        out = TcError(
            iface,
            f"no such network interface; the netdev on ifindex {index} unread: {failed}",
            errno=errno_mod.ENODEV,
            tree_left=None,
        )
        out.__cause__ = err
        raise out

    def _renamed(self, iface: str, err: TcError) -> tuple[int, str, bool]:
        """The index and name now of the netdev ``iface`` was when this adapter last looked
        it up, where the look-up by name failed (``err``) because it was renamed away;
        ``err`` raised otherwise. Only this adapter's own look-up: an index recorded by an
        earlier run may be another netdev's since a reboot.

        Not that netdev, so a TcError (``ENODEV``) naming what is there raised: one of
        another link type or MAC than the look-up saw (``IFLA_PERM_ADDRESS``, else
        ``IFLA_ADDRESS``: deleted, and another made with its index) without gpud's HTB
        root ``6764:`` on it (a MAC changed on the netdev gpud shaped keeps its tree: a
        bond's, a cloned or a set one; the check is any HTB root with that major handle, so
        one made by hand, or by a second gpud in the same namespace, passes too), or one
        another name found on that index by a later look-up (that name's to restore). The
        error's ``tree_left`` is None where that netdev or its tc state could not be read,
        False otherwise. The third item is True where the name now is one in the last plan a pass
        was given, or one adopted (``traffic.interfaces``; ``ip link del b0; ip link set a0
        name b0``): the netdev is b0's to shape and restore, which :meth:`_resolve` says
        and :meth:`restore` refuses to do as ``iface``."""
        seen = self._cache_index.get(iface)
        if err.errno != errno_mod.ENODEV or seen is None:
            raise err
        link = self._link_at(iface, seen, err)
        if link is None or link[0] == iface:
            raise err
        renamed, print_now = link
        was = self._prints.get(iface)
        same = was == (seen, print_now)
        if renamed in self._shaping:
            if same:
                return seen, renamed, True
            # another netdev given the index, under a name gpud shapes: that name's
            why = _print_change(was, seen, print_now)
            raise self._not_taken(iface, seen, renamed, why, err, left=False)
        mine = self._looked.get(iface, 0)
        later = max(
            (n for n, i in self._cache_index.items() if n != iface and i == seen),
            key=lambda n: self._looked.get(n, 0),
            default=None,
        )
        if later is not None and self._looked.get(later, 0) > mine:
            why = f"{later}'s at gpud's last look-up, restored as {later}"
            raise self._not_taken(iface, seen, renamed, why, err, left=False)
        # a MAC changes on a netdev kept (a bond's slave, a cloned or set address): gpud's
        # tree on the index tells it is the netdev gpud shaped, as a new one never has it
        ours, failed = (None, "") if same else self._ours_on(seen)
        if same or ours:
            return seen, renamed, False
        unknown = f", gpud's tree on it unknown (cannot read tc state: {failed})" if failed else ""
        why = _print_change(was, seen, print_now) + unknown
        # unread, the tree may be there; read, it is not (a new netdev never has it)
        raise self._not_taken(iface, seen, renamed, why, err, left=None if failed else False)

    @staticmethod
    def _not_taken(
        iface: str, index: int, name: str, why: str, err: TcError, *, left: bool | None
    ) -> TcError:
        """The error of a netdev on ``iface``'s last looked-up index not taken for it;
        ``left`` is its ``tree_left``."""
        out = TcError(
            iface,
            f"no such network interface (ifindex {index} is now {name}, {why}: not taken for"
            f" {iface})",
            errno=errno_mod.ENODEV,
            tree_left=left,
        )
        out.__cause__ = err
        return out

    def _ours_on(self, index: int) -> tuple[bool | None, str]:
        """Whether the netdev of ``index`` has gpud's HTB root (``tc qdisc show``), and why
        that is not known (None, the kernel's answer). A dump that fails for a while
        (``ENOBUFS``, ``EINTR`` of a dump the kernel marked interrupted) keeps what the
        last one saw; ``ENODEV`` is the netdev gone since its look-up, so no tree."""
        try:
            msgs, err = self._nl.dump(RTM_GETQDISC, _TCMSG.pack(0, index, 0, 0, 0))
        except OSError as oserr:
            code, failed = oserr.errno, _errname(oserr.errno) if oserr.errno else str(oserr)
        else:
            code, failed = (err.errno, _errname(err.errno)) if err is not None else (0, "")
        if code == errno_mod.ENODEV:
            self._tree_seen.pop(index, None)
            return False, ""
        if failed:
            seen = self._tree_seen.get(index)
            if seen is None or code not in (errno_mod.ENOBUFS, errno_mod.EINTR):
                return None, failed
            return seen, ""
        ours = any(
            _is_ours(RootQdisc(q.kind, q.handle))
            for q in map(_decode_tcmsg, msgs)
            if q.ifindex == index and q.parent == TC_H_ROOT
        )
        self._tree_seen[index] = ours
        # only an index some name was last looked up on is asked about again: one per
        # name kept, however many netdevs were renamed away and made again while gpud ran
        named = set(self._cache_index.values())
        for gone in [i for i in self._tree_seen if i not in named]:
            del self._tree_seen[gone]
        return ours, ""

    def _tree_at(self, index: int) -> tuple[str, bool | None]:
        """Whether the netdev of ``index`` has gpud's HTB root, as the running error says
        it, and as its ``tree_left`` (:meth:`_ours_on`)."""
        ours, failed = self._ours_on(index)
        if ours is None:
            return f", gpud's tree on it unknown (cannot read tc state: {failed})", None
        return (", gpud's tree still on it" if ours else ""), ours

    def _resolve(self, iface: str, *, shaping: bool = True) -> int:
        """Look ``iface`` up afresh: an interface renamed away, or deleted and created
        again, is another index (what was seen of the old one is forgotten). One renamed
        away is named in the error: gpud's tree went with it, to a name gpud never shapes.
        With ``shaping``, the loopback is refused under any name: the kernel's
        ``ARPHRD_LOOPBACK`` (``/sys/class/net/IF/type`` 772), as gpud's namespace sees it."""
        self._ifindex.pop(iface, None)
        try:
            idx = self.ifindex(iface)
        except TcError as err:
            seen, renamed, shaped = self._renamed(iface, err)
            if shaped:
                # its tree is the one gpud keeps under that name: nothing of it to say here
                raise TcError(
                    iface,
                    f"no such network interface (renamed to {renamed}, ifindex {seen}: now"
                    f" {renamed}, shaped as {renamed})",
                    errno=errno_mod.ENODEV,
                    tree_left=False,
                ) from err
            tree, left = self._tree_at(seen)
            raise TcError(
                iface,
                f"no such network interface (renamed to {renamed}, ifindex {seen}{tree}:"
                f" gpud leaves {renamed} alone)",
                errno=errno_mod.ENODEV,
                tree_left=left,
            ) from err
        if shaping and iface in self._loopbacks:
            raise TcError(
                iface,
                f"the loopback (ARPHRD_LOOPBACK, type 772), named {iface}: shaping it slows"
                " this node's local gRPC and etcd traffic, never GPU traffic between nodes;"
                " not shaped (list the NICs that carry GPU traffic in traffic.interfaces)",
                errno=errno_mod.EINVAL,
            )
        was = self._cache_index.get(iface)
        if was is not None and was != idx:
            self._cache.pop(iface, None)
            self._replaced[iface] = f"ifindex {idx}, was {was}"
        self._cache_index[iface] = idx
        self._looked[iface] = max(self._looked.values(), default=0) + 1
        return idx

    def _dump_tc(self, iface: str, mtype: int, parent: int = 0) -> list[_TcMsg]:
        idx = self.ifindex(iface)
        try:
            msgs, err = self._nl.dump(mtype, _TCMSG.pack(0, idx, 0, parent, 0))
        except OSError as oserr:
            raise TcError(iface, f"cannot read tc state: {oserr}", errno=oserr.errno) from oserr
        if err is not None:
            gone = err.errno == errno_mod.ENODEV
            if gone:
                self._ifindex.pop(iface, None)
            raise TcError(
                iface,
                f"cannot read tc state: {_errname(err.errno)}",
                errno=err.errno,
                detail=err.detail,
                # the netdev deleted since its look-up: its tree went with it
                tree_left=False if gone else None,
            )
        return [m for m in map(_decode_tcmsg, msgs) if m.ifindex == idx]

    def read(self, iface: str) -> InterfaceState:
        """What the kernel holds on ``iface`` now (``tc qdisc/class/filter show``)."""
        root: RootQdisc | None = None
        qdiscs = self._dump_tc(iface, RTM_GETQDISC)
        for q in qdiscs:
            if q.parent == TC_H_ROOT:
                default = None
                if q.kind == "htb" and (init := q.options().get(TCA_HTB_INIT)) is not None:
                    _v, _r2q, defcls, _d, _p = _HTB_GLOB.unpack_from(init, 0)
                    default = (q.handle & 0xFFFF0000) | defcls
                root = RootQdisc(q.kind, q.handle, default)
        if root is None or root.kind != "htb":
            return InterfaceState(iface, root)
        # HTB's default queue under a class is not dumped; what is listed under our classes
        # was attached by someone else
        children = tuple(
            ChildQdisc(q.parent, q.handle, q.kind)
            for q in qdiscs
            if q.parent != TC_H_ROOT and q.parent >> 16 == root.handle >> 16 and q.handle
        )
        classes: list[HtbClass] = []
        for c in self._dump_tc(iface, RTM_GETTCLASS):
            if c.kind != "htb" or c.handle >> 16 != root.handle >> 16:
                continue
            cls = self._htb_class(c)
            if cls.parent == TC_H_ROOT:  # the top class: tc shows "root"
                cls = replace(cls, parent=root.handle)
            classes.append(cls)
        filters: list[tuple[int, DscpFilter]] = []
        foreign: list[tuple[int, int, int]] = []
        for f in self._dump_tc(iface, RTM_GETTFILTER, parent=root.handle):
            prio, proto = f.info >> 16, socket.ntohs(f.info & 0xFFFF)
            if f.handle == 0 or (f.kind == "u32" and f.handle & 0xFFF == 0):
                continue  # the chain/prio head or a u32 hash table, not a filter
            known = self._our_filter(f) if (prio, proto) == (FILTER_PRIO, ETH_P_ALL) else None
            if known is None:
                foreign.append((prio, proto, f.handle))
            else:
                filters.append((f.handle, known))
        return InterfaceState(iface, root, tuple(classes), tuple(filters), tuple(foreign), children)

    def _htb_class(self, c: _TcMsg) -> HtbClass:
        opts = c.options()
        parms = opts.get(TCA_HTB_PARMS)
        if parms is None:
            return HtbClass(c.handle, c.parent, -1, 0, 0, 0, 0, 0)
        v = _HTB_OPT.unpack_from(parms, 0)
        rate, ceil = v[5], v[11]
        buffer, cbuffer, quantum, _level, prio = v[12:17]
        if (r64 := opts.get(TCA_HTB_RATE64)) is not None:
            (rate,) = struct.unpack_from("=Q", r64)
        if (c64 := opts.get(TCA_HTB_CEIL64)) is not None:
            (ceil,) = struct.unpack_from("=Q", c64)
        return HtbClass(
            classid=c.handle,
            parent=c.parent,
            prio=prio,
            rate_bps=rate * 8,
            ceil_bps=ceil * 8,
            burst=self._ps.xmitsize(rate, buffer),
            cburst=self._ps.xmitsize(ceil, cbuffer),
            quantum=quantum,
        )

    @staticmethod
    def _our_filter(f: _TcMsg) -> DscpFilter | None:
        if f.kind != "u32":
            return None
        opts = f.options()
        sel, classid = opts.get(TCA_U32_SEL), opts.get(TCA_U32_CLASSID)
        if sel is None or classid is None:
            return None
        _flags, _offshift, nkeys, *_ = _U32_SEL.unpack_from(sel, 0)
        if nkeys != 1 or (f.handle >> 12) & 0xFF:
            return None
        mask, value, off, _offmask = _U32_KEY.unpack_from(sel, _U32_SEL.size)
        if off != 0:
            return None
        (flowid,) = struct.unpack_from("=I", classid, 0)
        return filter_from_key(f.handle & 0xFFF, value, mask, flowid)

    def counters(self, iface: str) -> dict[int, ClassCounters]:
        """Per-class counters on ``iface`` (``tc -s class show dev IFACE``), by classid.

        Raises TcError when the interface cannot be read.
        """
        out: dict[int, ClassCounters] = {}
        for c in self._dump_tc(iface, RTM_GETTCLASS):
            nbytes, packets, drops, overlimits, backlog = c.stats()
            out[c.handle] = ClassCounters(c.handle, nbytes, packets, drops, overlimits, backlog)
        return out

    # -- adopting, syncing, repairing ---------------------------------------------------

    def adopt(self, ifaces: Iterable[str]) -> dict[str, AdoptedState | TcError]:
        """Read each interface at start; keep an HTB root of ours as it is.

        Nothing is changed. An interface that cannot be read maps to its TcError. The names
        are ones gpud shapes (``traffic.interfaces``), as a pass's plan's are: a netdev
        renamed onto one is that name's to restore, before the first pass too.
        """
        names = list(ifaces)
        # a late adopt reads a few of them: the names known to be shaped are kept
        self._shaping |= frozenset(names)
        found: dict[str, AdoptedState | TcError] = {}
        for iface in names:
            try:
                idx = self._resolve(iface)
                state = self.read(iface)
            except TcError as err:
                found[iface] = err
                continue
            ours = _is_ours(state.root)
            self._cache[iface] = state
            found[iface] = AdoptedState(iface, ours, None if ours else state.root, state, idx)
        return found

    def sync(self, plan: TcPlan) -> SyncResult:
        """Apply only what differs between the plan and the kernel, in one batch.

        Where the plan changed, the difference is taken from what this adapter last saw
        (no read: a re-prioritization costs one batch); an interface whose operations fail
        (someone changed it since) is read again and repaired at once. Where the plan did
        not change, the interface is read and checked, as ``drift`` does. Either repair
        lists what was put back in the interface's ``restored``.
        """
        self._shaping = frozenset(p.iface for p in plan.interfaces)
        first = self._apply(plan, reread=False)
        stale = [
            p
            for p in plan.interfaces
            if (err := first.interfaces[p.iface].error) is not None and err.op is not None
        ]
        if not stale:
            return first
        retry = self._apply(TcPlan(tuple(stale)), reread=True)
        # the first try took the replacement it found: the retry's result must still say it
        retried = {
            iface: replace(res, replaced=res.replaced or first.interfaces[iface].replaced)
            for iface, res in retry.interfaces.items()
        }
        return SyncResult({**first.interfaces, **retried})

    def drift(self, plan: TcPlan) -> SyncResult:
        """Re-read every interface, restore whatever differs from the plan.

        Each interface's ``restored`` lists what was put back, for the event log.
        """
        self._shaping = frozenset(p.iface for p in plan.interfaces)
        return self._apply(plan, reread=True)

    def _apply(self, plan: TcPlan, *, reread: bool) -> SyncResult:
        results: dict[str, InterfaceResult] = {}
        batch: list[tuple[str, TcOp, tuple[int, int, bytes]]] = []
        planned: dict[str, tuple[InterfacePlan, InterfaceState, tuple[TcOp, ...], bool]] = {}
        for want in plan.interfaces:
            iface = want.iface
            try:
                idx = self._resolve(iface)
                state = self._cache.get(iface) if not reread else None
                checked = state is None
                if state is None:
                    state = self.read(iface)
                ops = diff(state, want)
                if not ops and not checked:
                    # Nothing new for this interface: check what the kernel really holds.
                    state, checked = self.read(iface), True
                    ops = diff(state, want)
            except TcError as err:
                self._cache.pop(iface, None)
                results[iface] = InterfaceResult(iface, error=err)
                continue
            planned[iface] = (want, state, ops, reread or (checked and bool(ops)))
            batch.extend((iface, op, self._enc.encode(idx, op)) for op in ops)
        failed: dict[str, TcError] = {}
        try:
            acks = self._nl.request([m for _, _, m in batch]) if batch else []
        except OSError as err:  # the socket itself failed (timeout, ENOBUFS): all unknown
            acks = []
            for iface, _op, _msg in batch:
                failed.setdefault(iface, TcError(iface, f"netlink request failed: {err}"))
        for (iface, op, _), ack in zip(batch, acks, strict=True):
            if ack.errno and iface not in failed:
                failed[iface] = self._op_error(iface, op, ack)
        for iface, (want, state, ops, repair) in planned.items():
            failure = failed.get(iface)
            htid = u32_htid(state, ops)
            if failure is None and (htid is not None or not want.filters):
                self._cache[iface] = state_after(want, htid or 0x800)
            elif failure is None:
                self._cache.pop(iface, None)  # filter handles unknown: read them next time
            else:
                self._cache.pop(iface, None)
                if failure.errno == errno_mod.ENODEV:
                    self._ifindex.pop(iface, None)
            results[iface] = InterfaceResult(
                iface, ops, drift=repair, error=failure, replaced=self._replaced.pop(iface, "")
            )
        return SyncResult(results)

    @staticmethod
    def _op_error(iface: str, op: TcOp, ack: Ack) -> TcError:
        args = " ".join(op.tc_args())
        if op.kind is OpKind.REPLACE_ROOT and ack.errno == errno_mod.ENOENT:
            message = "the kernel has no HTB qdisc (sch_htb)"
        elif op.kind is OpKind.ADD_FILTER and ack.errno == errno_mod.ENOENT:
            message = "the kernel has no u32 classifier (cls_u32)"
        elif ack.errno == errno_mod.ENODEV:
            message = "the interface disappeared"
        else:
            message = f"netlink error {_errname(ack.errno)} ({os.strerror(ack.errno)})"
        return TcError(iface, message, op=args, errno=ack.errno, detail=ack.detail)

    def restore(
        self, iface: str, original: RootQdisc | None = None, *, ifindex: int | None = None
    ) -> Restored:
        """Put back the interface's root qdisc from before gpud (shutdown mode "restore").

        Deletes our HTB root, so the kernel installs its default root (``mq``,
        ``net.core.default_qdisc``, or ``noqueue`` on virtual devices); when ``original``
        names another kind than that, the original kind is installed with its default
        parameters (``tc qdisc replace dev IF root KIND``). A root that is not gpud's HTB
        is left as it is, and nothing is installed: gpud's tree is not there to give back
        (removed by hand, or gone with a netdev deleted and created again). Raises TcError
        on failure, whose ``tree_left`` is False where nothing of gpud's is left (no netdev
        by that name, the kernel's ``ENODEV``; or its netdev another name's to restore; or
        gpud's root deleted and only the original's re-install refused, ``tree_removed``).

        ``ifindex``: the index of the netdev ``original`` was recorded on (None: not
        known). When the name is another netdev's than that one, or than the one this
        adapter last looked up (deleted and created again), ``original`` was the old
        netdev's: only our HTB root is deleted, the new netdev keeps the root the kernel
        gave it, and ``replaced`` says "ifindex NEW, was OLD". The netdev is told by its
        ifindex: one given the old ifindex explicitly, or moved in from another namespace
        keeping it, is taken for the old one. The original re-installed, a failed read of
        it gives ``root`` None (the kernel acked the replace). A failed read after the
        kernel acked the delete of gpud's root does not fail the restore: the original is
        re-installed as where another kind was read, and ``root`` is None where it is not;
        where that re-install fails too, its error names the read's failure as well.

        A netdev renamed away from ``iface`` (``ip link set dev IF name NEW``) keeps its
        ifindex and gpud's tree: it is restored by the ifindex this adapter last looked up
        under ``iface``, whatever its name now, which ``renamed`` says.
        """
        try:
            idx = self._resolve(iface, shaping=False)
        except TcError as err:
            idx, renamed, shaped = self._renamed(iface, err)
            if shaped:  # restored as that name, by its own restore
                raise
            # the reads and requests below go to that netdev by its index, under the old
            # name in their messages; forgotten after, so no pass shapes it as iface
            self._ifindex[iface] = idx
            try:
                done = self._restore_at(iface, idx, original, "")
            finally:
                self._ifindex.pop(iface, None)
            return replace(done, renamed=renamed)
        replaced = self._replaced.pop(iface, "")
        if not replaced and ifindex is not None and ifindex != idx:
            replaced = f"ifindex {idx}, was {ifindex}"
        return self._restore_at(iface, idx, original, replaced)

    def _restore_at(
        self, iface: str, idx: int, original: RootQdisc | None, replaced: str
    ) -> Restored:
        self._cache.pop(iface, None)
        state = self.read(iface)
        if not _is_ours(state.root):
            return Restored(False, replaced, state.root)
        # gpud's handle in the request: the kernel refuses (EINVAL, "Invalid handle") a
        # root that stopped being gpud's since the read, rather than deleting another's
        delete = self._enc.root(idx, TcOp(OpKind.DELETE_ROOT, iface, root=ROOT_HANDLE))
        try:
            self._request_one(
                iface, delete, f"qdisc del dev {iface} root handle 6764:", "delete the HTB root"
            )
        except TcError as err:
            if err.errno not in (errno_mod.EINVAL, errno_mod.ENOENT):
                raise
            raise _reworded(
                err,
                f"cannot delete the HTB root: the root qdisc is no longer gpud's HTB 6764:"
                f" (replaced or removed since it was read; the kernel answered"
                f" {_errname(err.errno)}): left as it is",
            ) from err
        left: RootQdisc | None = None
        now: str | None = None
        unread: TcError | None = None
        try:
            left = self.read(iface).root
        except TcError as err:
            # the delete was acked: gpud's tree is gone whatever the read says, and the
            # root the kernel put in its place is not known, so the original goes back
            unread = err
        else:
            now = left.kind if left is not None else "noqueue"
        if replaced or original is None or original.kind in (now, "noqueue"):
            return Restored(True, replaced, left)
        body = _TCMSG.pack(0, idx, original.handle, TC_H_ROOT, 0) + _kind(original.kind)
        try:
            self._request_one(
                iface,
                (RTM_NEWQDISC, NLM_F_CREATE | NLM_F_REPLACE, body),
                f"qdisc replace dev {iface} root {original.kind}",
                f"re-install the original {original.kind} root",
            )
        except TcError as err:
            # the delete was acked: gpud's tree is gone, only the original is not back
            err.tree_left, err.tree_removed = False, True
            if unread is None:
                raise
            # both failures say what the netdev holds now: neither the original nor a
            # root anyone read
            raise _reworded(
                err,
                f"cannot re-install the original {original.kind} root: {_short(err, iface)};"
                " gpud's tree is deleted, but the read of the root after the delete failed:"
                f" {_short(unread, iface)}",
            ) from err
        try:
            root = self.read(iface).root
        except TcError:
            # the original is back (the kernel acked it): only the look at it failed
            root = None
        return Restored(True, "", root)

    def _request_one(self, iface: str, msg: tuple[int, int, bytes], op: str, what: str) -> None:
        try:
            (ack,) = self._nl.request([msg])
        except OSError as err:
            raise TcError(iface, f"cannot {what}: {err}", op=op, errno=err.errno) from err
        if ack.errno:
            raise TcError(
                iface,
                f"cannot {what}: {_errname(ack.errno)}",
                op=op,
                errno=ack.errno,
                detail=ack.detail,
            )


ROOT_HANDLE = ROOT_MAJOR << 16  # gpud's root qdisc, 6764:

_Fingerprint = tuple[int, bytes]
"""A netdev's ``ifi_type`` and MAC (the permanent one where the NIC has one, the one in
use on virtual netdevs): the same ifindex with another is another netdev."""


def _fingerprint(msg: memoryview | bytes) -> _Fingerprint:
    """The fingerprint of one ``RTM_NEWLINK`` answer."""
    _fam, kind, _index, _flags, _change = _IFINFOMSG.unpack_from(msg, 0)
    attrs = _attrs(msg, _IFINFOMSG.size, len(msg))
    perm = bytes(attrs.get(IFLA_PERM_ADDRESS, b""))
    mac = perm if perm.strip(b"\0") else bytes(attrs.get(IFLA_ADDRESS, b""))
    return int(kind), mac


def _mac(mac: bytes) -> str:
    return ":".join(f"{b:02x}" for b in mac) or "none"


def _print_change(was: tuple[int, _Fingerprint] | None, index: int, now: _Fingerprint) -> str:
    """How the netdev on an index differs from the one a name's look-up saw there."""
    if was is None or was[0] != index:
        return "not the netdev gpud looked up"
    (kind, mac), (kind_now, mac_now) = was[1], now
    if kind != kind_now:
        return f"link type {kind_now}, was {kind}"
    return f"MAC {_mac(mac_now)}, was {_mac(mac)}"


def _short(err: TcError, iface: str) -> str:
    """What the kernel answered, by its short name (``EPERM``), else what ``err`` says."""
    if err.errno:
        return _errname(err.errno)
    return str(err.__cause__ or err).removeprefix(f"{iface}: ")


def _reworded(err: TcError, message: str) -> TcError:
    """``err`` (its interface, tc command, errno, extended ack and what it says of gpud's
    tree) said as ``message``."""
    out = TcError(err.iface, message, op=err.op, errno=err.errno, detail=err.detail)
    out.tree_left, out.tree_removed = err.tree_left, err.tree_removed
    return out


def _is_ours(root: RootQdisc | None) -> bool:
    """An HTB root with gpud's major handle (``6764:``)."""
    return root is not None and root.kind == "htb" and root.handle >> 16 == ROOT_MAJOR
