"""The ports the traffic service enforces through, and their public fakes.

``TcPort`` is the kernel's traffic control on one interface (the real one is
``netshaper.tc_netlink``, over netlink); ``MarkPort`` is gpud's nftables table
(``netshaper.nftables.NftablesMarker``); ``RdmaPort`` writes the NIC's DSCP -> priority map.
The service computes what each should hold and asks only for the difference.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from netshaper import tcplan
from netshaper.dcb import MapResult
from netshaper.nftables import CgroupMark, MarkSync
from netshaper.tc_netlink import TcError


class CountersLike(Protocol):
    """One class's counters (``tc -s class show``): sent bytes and packets, drops."""

    @property
    def bytes(self) -> int: ...
    @property
    def packets(self) -> int: ...
    @property
    def drops(self) -> int: ...


class InterfaceResultLike(Protocol):
    """What one pass did on one interface: ``tc_ops`` sent (``ops``: the same as tc
    arguments), what drift ``restored``, the interface's ``error`` (None when enforced),
    and ``replaced`` ("ifindex NEW, was OLD": the name is another netdev's since the last
    pass; "" when not)."""

    @property
    def tc_ops(self) -> tuple[tcplan.TcOp, ...]: ...
    @property
    def ops(self) -> tuple[str, ...]: ...
    @property
    def restored(self) -> tuple[str, ...]: ...
    @property
    def error(self) -> Exception | None: ...

    @property
    def replaced(self) -> str: ...


class SyncResultLike(Protocol):
    @property
    def interfaces(self) -> Mapping[str, InterfaceResultLike]: ...


class AdoptedLike(Protocol):
    """What the kernel held at start: the tree (``state``), the root qdisc that was
    there before gpud's (``original``; None when gpud's own root was found) and the
    netdev's ``ifindex``."""

    @property
    def state(self) -> tcplan.InterfaceState: ...
    @property
    def original(self) -> tcplan.RootQdisc | None: ...
    @property
    def ifindex(self) -> int: ...


class RestoredLike(Protocol):
    """What a restore did: ``ours`` (gpud's HTB root was there and is deleted; False: the
    root found is left as it is), ``replaced`` ("ifindex NEW, was OLD": the name is another
    netdev's than the original's; "" when not), the ``root`` left on the interface and the
    name it was ``renamed`` to since gpud last looked it up ("" when not)."""

    @property
    def ours(self) -> bool: ...
    @property
    def replaced(self) -> str: ...
    @property
    def root(self) -> tcplan.RootQdisc | None: ...
    @property
    def renamed(self) -> str: ...


class TcPort(Protocol):
    """Traffic control on the configured interfaces (``netshaper.tc_netlink.TcNetlink``)."""

    def adopt(self, ifaces: Iterable[str]) -> Mapping[str, AdoptedLike | Exception]:
        """Read each interface at start, change nothing."""
        ...

    def sync(self, plan: tcplan.TcPlan) -> SyncResultLike:
        """Send only what differs from the last state seen, in one batch."""
        ...

    def drift(self, plan: tcplan.TcPlan) -> SyncResultLike:
        """Re-read the kernel and restore whatever differs from ``plan``."""
        ...

    def counters(self, iface: str) -> Mapping[int, CountersLike]:
        """classid -> counters of every class on ``iface``."""
        ...

    def restore(
        self, iface: str, original: tcplan.RootQdisc | None = None, *, ifindex: int | None = None
    ) -> RestoredLike:
        """Give ``iface`` back its original root qdisc (delete gpud's HTB root; a root that
        is not gpud's is left as it is). ``ifindex``: the netdev ``original`` was recorded
        on; when the name is another netdev's (than that one, or since the last pass),
        ``original`` was the old one's and is not put on it. An error whose ``tree_left``
        is False left nothing of gpud's (no netdev by that name, or the netdev is another
        name's to restore, or ``tree_removed``: gpud's tree deleted and only the original
        root not put back); any other may have left gpud's tree on a netdev."""
        ...

    def close(self) -> None:
        """Close the netlink socket (what the kernel holds stays)."""
        ...


class MarkPort(Protocol):
    def sync(self, marks: Iterable[CgroupMark]) -> MarkSync: ...

    def delete(self) -> bool: ...


class RdmaPort(Protocol):
    def apply(self, dscp_priorities: Mapping[int, int]) -> Sequence[MapResult]:
        """Make the NIC map each DSCP to its priority; returns the entries each netdev's
        APP table did not hold and that were written (``dcb app replace``)."""
        ...


@dataclass(frozen=True)
class FakeCounters:
    bytes: int = 0
    packets: int = 0
    drops: int = 0


@dataclass(frozen=True)
class FakeResult:
    iface: str
    tc_ops: tuple[tcplan.TcOp, ...] = ()
    drift: bool = False
    error: Exception | None = None
    replaced: str = ""

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(" ".join(op.tc_args()) for op in self.tc_ops)

    @property
    def restored(self) -> tuple[str, ...]:
        return self.ops if self.drift else ()


@dataclass(frozen=True)
class FakeSync:
    interfaces: Mapping[str, FakeResult]


@dataclass(frozen=True)
class FakeAdopted:
    state: tcplan.InterfaceState
    original: tcplan.RootQdisc | None
    ifindex: int = 4


@dataclass(frozen=True)
class FakeRestored:
    ours: bool
    replaced: str = ""
    root: tcplan.RootQdisc | None = None
    renamed: str = ""


@dataclass
class FakeTc:
    """An in-memory :class:`TcPort` over :func:`netshaper.tcplan.diff`: ``states`` is what
    the "kernel" holds per interface (tests edit it to simulate drift); ``missing``
    interfaces fail like a missing netdev; ``sent`` sets a class's counters; ``replaced``
    names an interface deleted and created again since the last pass (its ifindexes),
    said by the next pass or restore; ``ifindexes`` are the netdevs' indexes (4 when not
    set)."""

    states: dict[str, tcplan.InterfaceState] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)
    sent: dict[tuple[str, int], FakeCounters] = field(default_factory=dict)
    restored_ifaces: list[str] = field(default_factory=list)
    restored_to: dict[str, tcplan.RootQdisc | None] = field(default_factory=dict)
    replaced: dict[str, str] = field(default_factory=dict)
    ifindexes: dict[str, int] = field(default_factory=dict)

    def _state(self, iface: str) -> tcplan.InterfaceState:
        if iface in self.missing:
            raise OSError(19, f"{iface}: no such interface")
        return self.states.get(iface, tcplan.InterfaceState(iface, None))

    def adopt(self, ifaces: Iterable[str]) -> Mapping[str, FakeAdopted | Exception]:
        found: dict[str, FakeAdopted | Exception] = {}
        for iface in ifaces:
            try:
                state = self._state(iface)
            except OSError as err:
                found[iface] = err
                continue
            ours = state.root is not None and state.root.handle >> 16 == tcplan.ROOT_MAJOR
            found[iface] = FakeAdopted(
                state, None if ours else state.root, self.ifindexes.get(iface, 4)
            )
        return found

    def _apply(self, plan: tcplan.TcPlan, *, drift: bool) -> FakeSync:
        out: dict[str, FakeResult] = {}
        for want in plan.interfaces:
            try:
                state = self._state(want.iface)
            except OSError as err:
                out[want.iface] = FakeResult(want.iface, error=err)
                continue
            ops = tcplan.diff(state, want)
            self.states[want.iface] = tcplan.state_after(want)
            out[want.iface] = FakeResult(
                want.iface, ops, drift, replaced=self.replaced.pop(want.iface, "")
            )
        return FakeSync(out)

    def sync(self, plan: tcplan.TcPlan) -> FakeSync:
        return self._apply(plan, drift=False)

    def drift(self, plan: tcplan.TcPlan) -> FakeSync:
        return self._apply(plan, drift=True)

    def counters(self, iface: str) -> Mapping[int, FakeCounters]:
        state = self._state(iface)
        return {c.classid: self.sent.get((iface, c.classid), FakeCounters()) for c in state.classes}

    def restore(
        self, iface: str, original: tcplan.RootQdisc | None = None, *, ifindex: int | None = None
    ) -> FakeRestored:
        if iface in self.missing:
            # as the kernel's look-up by name fails: nothing of gpud's is there
            raise TcError(iface, "no such network interface", errno=19, tree_left=False)
        root = self._state(iface).root
        replaced = self.replaced.pop(iface, "")
        now = self.ifindexes.get(iface, 4)
        if not replaced and ifindex is not None and ifindex != now:
            replaced = f"ifindex {now}, was {ifindex}"
        if root is None or root.kind != "htb" or root.handle >> 16 != tcplan.ROOT_MAJOR:
            return FakeRestored(False, replaced, root)  # not gpud's: left as it is
        if replaced:
            original = None
        self.restored_ifaces.append(iface)
        self.restored_to[iface] = original
        if original is None:
            self.states.pop(iface, None)
        else:
            self.states[iface] = tcplan.InterfaceState(iface, original)
        return FakeRestored(True, replaced, original)

    def close(self) -> None:
        pass


@dataclass
class FakeMarker:
    """An in-memory :class:`MarkPort`."""

    marks: set[CgroupMark] = field(default_factory=set)
    fail: str = ""
    table: bool = False  # gpud's table is there (a sync creates it)
    # chains added to gpud's table by hand: the next sync writes the table again without
    # them, as the real marker does
    foreign: tuple[str, ...] = ()

    def sync(self, marks: Iterable[CgroupMark]) -> MarkSync:
        if self.fail:
            raise RuntimeError(self.fail)
        want = set(marks)
        foreign, self.foreign = (self.foreign, ()) if self.table else ((), ())
        # rebuilt: every rule of the table goes, every one wanted is added
        had = set() if foreign else self.marks
        added, removed, kept = (
            _comments(want - had),
            _comments(self.marks if foreign else self.marks - want),
            _comments(want & had),
        )
        self.marks = want
        created, self.table = not self.table or bool(foreign), True
        return MarkSync(created, added, removed, kept, rebuilt=bool(foreign), foreign=foreign)

    def delete(self) -> bool:
        had = self.table
        self.marks, self.table = set(), False
        return had


def _comments(marks: Iterable[CgroupMark]) -> tuple[str, ...]:
    """The comments of ``marks``' rules, one per family, as the real marker reports them."""
    return tuple(sorted(c for m in marks for c in m.comments().values()))
