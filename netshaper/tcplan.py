"""Pure planner for TCP enforcement: (links, tags, levels, shares) -> :class:`TcPlan`.

No I/O and no project imports: :func:`plan` turns the policy's decision into the HTB tree
and u32 filters each configured interface should hold, and :func:`diff` turns (what the
kernel holds, what the plan wants) into the fewest tc operations. The kernel adapter
(``netshaper.tc_netlink``) only reads state and sends the operations.

The tree on one interface (handles in tc's hex notation, major ``6764`` = "gd")::

    qdisc htb 6764: root default 2                 (untagged traffic -> 6764:2)
    └── class 6764:1     rate = ceil = link                    (lets levels borrow)
        ├── class 6764:2   prio 7, rate = default_share x link  (untagged, default class)
        ├── class 6764:10  prio 0, rate = share[0] x link, ceil = link   (level 0)
        │   ├── class 6764:101a  prio 0, the job with DSCP 26 (0x1a)
        │   └── class 6764:1022  prio 0, the job with DSCP 34 (0x22)
        ├── class 6764:11  prio 1, rate = share[1] x link, ceil = link   (level 1)
        │   └── class 6764:1128  prio 1, the job with DSCP 40 ...
        └── class 6764:17  (level 7)

    filter parent 6764: protocol all pref 1 u32: two per job
        IPv4: match 0x40000000|DSCP<<18 / 0xf0fc0000 at 0  (version 4, TOS DSCP bits)
        IPv6: match 0x60000000|DSCP<<22 / 0xffc00000 at 0  (version 6, traffic class DSCP)
        -> flowid 6764:LLTT (the job's leaf: level class LL, tag TT)

Why this shape: each level's ``rate`` is its guaranteed minimum share (no starvation);
bandwidth above the guarantees is lent by ``6764:1`` in strict ``prio`` order. HTB serves
borrowing by the *leaf's* prio, so a job leaf carries its level as prio too -- and that is
all a level change needs to touch: with ``homes`` (what the daemon passes) a job's leaf
stays under the level class it was first placed at and only its ``prio`` changes, one
class *change* in place. Moving the leaf instead (a new class under the new level, the
filters re-pointed, the old class deleted) drops the packets queued in the old class and
lets the job's new packets overtake its old ones: on a real kernel that cost every move a
burst of TCP retransmissions and timeouts. HTB takes up a leaf's new prio when the leaf's
queue next empties (its next activation): a training job's queue empties every iteration,
between its communication phases; a flow that never lets its queue drain keeps its old
priority until it does. Leaves get a
small fixed rate (``leaf_share``), never one that depends on how many jobs share a level,
so a job arriving, leaving or moving touches no other job's class; with ``top_share`` the
leaves at level 0 get that larger one, a rate HTB takes up as soon as the leaf's tokens
allow (the same class change as the prio's), so a job moved to the top is served first
without waiting for its queue to drain.

A leaf's id is its level class's minor followed by the tag byte (``6764:101a`` = level 0,
DSCP 26), and filter handles are derived from the tag alone (node ``2*DSCP + 1`` for IPv4,
``2*DSCP + 2`` for IPv6). Re-prioritizing a job at home is one class change; without
``homes`` it is four operations and never leaves its traffic unclassified: add the leaf
under the new level, re-point its two filters (a u32 *change* of the same handle), delete
the old leaf. (HTB refuses to delete a class that a
filter still points to, and a class cannot change parent, so this is the minimum.) Our
filters are deleted only by exact handle -- never by parent alone, which deletes every
filter on the qdisc; filters someone else put under our root in another prio go as that
whole prio. A job's leaf counters restart when it moves; the daemon accumulates.

Rates are bit/s in the plan; the adapter converts to the kernel's bytes/s. ``burst`` and
``cburst`` are explicit (``burst_s`` of the rate, at least ``min_burst_bytes``, at most
``MAX_BURST_S`` of it, the longest the kernel holds) so fast links are shaped correctly, and every class has an explicit ``quantum`` so all jobs in a
level share its excess equally -- or, with ``weights``, in proportion to them (a job's
leaf quantum scaled by its weight: the daemon weighs jobs by their demand, so the jobs of
one level progress alike). A changed weight is a class *change* in place: no packet moves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum

ROOT_MAJOR = 0x6764
LEVEL_MINOR_BASE = 0x10
TOP_MINOR = 0x1
DEFAULT_MINOR = 0x2
FILTER_PRIO = 1
ETH_P_ALL = 0x0003  # our filters' protocol: "all"
MAX_LEVELS = 8  # HTB has 8 priorities (TC_HTB_NUMPRIO)
# link rates gpud shapes, in bit/s: 1 kB/s (a rate HTB still meters) to 10 Tbit/s
LINK_BPS_MIN = 8_000
LINK_BPS_MAX = 10**13
DEFAULT_PRIO = MAX_LEVELS - 1
DSCP_MAX = 63
U32_NODE_MAX = 0xFFF
MIN_QUANTUM = 1514  # one full Ethernet frame: DRR below that needs rounds to send one


def handle(major: int, minor: int) -> int:
    """The 32-bit tc handle ``major:minor``."""
    return (major << 16) | minor


def format_handle(h: int) -> str:
    """``0x6764011a`` -> ``"6764:11a"``, as ``tc`` prints it."""
    return f"{h >> 16:x}:{h & 0xFFFF:x}"


def format_qdisc_handle(h: int) -> str:
    """A qdisc's handle as ``tc qdisc show`` prints it: ``0x67640000`` -> ``"6764:"``."""
    return f"{h >> 16:x}:" if h & 0xFFFF == 0 else format_handle(h)


def format_u32_handle(h: int) -> str:
    """A u32 filter handle as ``tc filter show`` prints it (its ``fh``): ``0x80000800`` ->
    ``"800::800"`` (hash table 800, bucket 0, node 800), ``0x80000000`` -> ``"800:"``."""
    htid, bucket, node = h >> 20, (h >> 12) & 0xFF, h & 0xFFF
    out = f"{htid:x}:" if htid else ""
    if bucket:
        out += f"{bucket:x}"
    if node:
        out += f":{node:x}"
    return out or "0"


def protocol_name(proto: int) -> str:
    """A filter's protocol as ``tc filter show`` names the common ones."""
    return {ETH_P_ALL: "all", 0x0800: "ip", 0x86DD: "ipv6", 0x0806: "arp"}.get(
        proto, f"{proto:#06x}"
    )


def level_classid(level: int, major: int = ROOT_MAJOR) -> int:
    """The class of priority level ``level`` (0 = highest)."""
    return handle(major, LEVEL_MINOR_BASE + level)


def leaf_classid(level: int, dscp: int, major: int = ROOT_MAJOR) -> int:
    """The leaf class of the job whose packets carry ``dscp``, at ``level``."""
    return handle(major, ((LEVEL_MINOR_BASE + level) << 8) | dscp)


def parse_leaf(classid: int) -> tuple[int, int] | None:
    """(level, DSCP) of a job leaf ``classid``, or None for another class."""
    minor = classid & 0xFFFF
    level, dscp = (minor >> 8) - LEVEL_MINOR_BASE, minor & 0xFF
    if 0 <= level < MAX_LEVELS and dscp <= DSCP_MAX:
        return level, dscp
    return None


class Family(Enum):
    """Which IP header a DSCP filter matches."""

    IPV4 = "ipv4"
    IPV6 = "ipv6"


@dataclass(frozen=True)
class TcOptions:
    """Knobs of the tree that are not policy decisions.

    ``default_share``: guaranteed fraction of the link for untagged traffic (the default
    class, lowest priority). ``leaf_share``: fixed guaranteed fraction per job leaf (keep it
    small: traffic under a leaf's own rate is served before any priority). ``burst_s``:
    burst and cburst as seconds of rate and ceil, at least ``min_burst_bytes`` (one GSO
    super-packet plus headroom) where the rate allows it (``MAX_BURST_S``). ``quantum_bytes``: DRR quantum of every class, at least
    one MTU; equal quanta give equal sharing between classes of one priority.
    ``top_share``: guaranteed fraction of the link for each leaf at level 0 (0: ``leaf_share``
    like every leaf). HTB serves traffic under a leaf's own rate before any that borrows, and
    takes a changed rate up as soon as the leaf's tokens allow, where a changed prio waits
    until the leaf's queue next empties (which a flow that never pauses never lets happen):
    with it, a job moved to level 0 is served first once its leaf has paid the time of the
    last packet it sent at ``leaf_share`` (a 64 KiB packet at 0.001 of 400 Mbit/s: 1.3 s;
    most of it gone already when the job had been borrowing), and one moved down loses that
    at once. It must leave the levels' and the default class's
    guarantees room (``top_share + sum(shares) + default_share <= 1``).
    """

    default_share: float = 0.02
    leaf_share: float = 0.001
    top_share: float = 0.0
    burst_s: float = 0.001
    min_burst_bytes: int = 128 * 1024
    quantum_bytes: int = 60_000
    major: int = ROOT_MAJOR

    def __post_init__(self) -> None:
        if not 0 < self.default_share < 1:
            raise ValueError(f"default_share must be in (0, 1), got {self.default_share}")
        if not 0 < self.leaf_share < 1:
            raise ValueError(f"leaf_share must be in (0, 1), got {self.leaf_share}")
        if not 0 <= self.top_share < 1:
            raise ValueError(f"top_share must be in [0, 1), got {self.top_share}")
        if not 0 < self.burst_s <= 1:
            raise ValueError(f"burst_s must be in (0, 1], got {self.burst_s}")
        if not 1500 <= self.min_burst_bytes <= 64 * 1024 * 1024:
            raise ValueError(
                f"min_burst_bytes must be in [1500, 67108864], got {self.min_burst_bytes}"
            )
        if not 1500 <= self.quantum_bytes <= 200_000:
            raise ValueError(f"quantum_bytes must be in [1500, 200000], got {self.quantum_bytes}")
        if not 1 <= self.major <= 0x7FFF:
            raise ValueError(f"major must be in [1, 0x7fff], got {self.major:#x}")


@dataclass(frozen=True)
class HtbClass:
    """One HTB class, as ``tc class add dev IF parent PARENT classid CLASSID htb ...``.

    Rates are bit/s; burst, cburst and quantum are bytes. ``job`` and ``level`` say what
    the class is for (None for the top and default classes; ``job`` None on level classes).
    """

    classid: int
    parent: int
    prio: int
    rate_bps: int
    ceil_bps: int
    burst: int
    cburst: int
    quantum: int
    level: int | None = None
    job: str | None = None

    @property
    def name(self) -> str:
        return format_handle(self.classid)


@dataclass(frozen=True)
class DscpFilter:
    """One u32 filter: packets of one family carrying ``dscp`` go to ``flowid``.

    ``node`` is the u32 node id (the ``N`` of handle ``800::N``), derived from the DSCP
    and family, so the filter can be deleted by its exact handle.
    """

    family: Family
    dscp: int
    flowid: int
    job: str | None = None

    @property
    def node(self) -> int:
        return filter_node(self.dscp, self.family)

    @property
    def key(self) -> tuple[int, int]:
        """(value, mask) of the one u32 key, at offset 0 of the network header."""
        return u32_key(self.dscp, self.family)


def filter_node(dscp: int, family: Family) -> int:
    return 2 * dscp + (1 if family is Family.IPV4 else 2)


def u32_key(dscp: int, family: Family) -> tuple[int, int]:
    """The u32 (value, mask) at offset 0 matching IP version and DSCP."""
    if family is Family.IPV4:
        return 0x40000000 | (dscp << 18), 0xF0FC0000
    return 0x60000000 | (dscp << 22), 0xFFC00000


def filter_from_key(node: int, value: int, mask: int, flowid: int) -> DscpFilter | None:
    """Read a kernel u32 filter back as a :class:`DscpFilter` (None if not one of ours)."""
    for family in Family:
        dscp_bits = (value >> 18) & 0x3F if family is Family.IPV4 else (value >> 22) & 0x3F
        if (value, mask) == u32_key(dscp_bits, family) and node == filter_node(dscp_bits, family):
            return DscpFilter(family, dscp_bits, flowid)
    return None


@dataclass(frozen=True)
class InterfacePlan:
    """Everything one interface should hold.

    ``root``: the HTB qdisc's handle (``6764:``); ``default_classid``: where untagged
    traffic goes (HTB ``default``); ``classes`` ordered parents first; ``filters`` sorted.
    """

    iface: str
    link_bps: int
    root: int
    default_classid: int
    classes: tuple[HtbClass, ...]
    filters: tuple[DscpFilter, ...]

    def class_of(self, classid: int) -> HtbClass | None:
        for c in self.classes:
            if c.classid == classid:
                return c
        return None


@dataclass(frozen=True)
class TcPlan:
    """The plan for every configured interface. A job's leaf (the class its counters are
    read from) is in each interface's ``classes``: the level class it sits under may
    differ from one interface to another (``plan``'s ``interface_homes``)."""

    interfaces: tuple[InterfacePlan, ...]

    def interface(self, iface: str) -> InterfacePlan:
        for p in self.interfaces:
            if p.iface == iface:
                return p
        raise KeyError(iface)

    @property
    def ifaces(self) -> tuple[str, ...]:
        return tuple(p.iface for p in self.interfaces)


# HTB keeps a class's burst as its time at the class's rate, in 32-bit psched ticks of
# 64 ns: at most 2**32 x 64 ns = 274.9 s. A class with no minimum share (a rate of a byte a
# second) gets the burst that lasts this long, not min_burst_bytes.
MAX_BURST_S = 274.0


# what the kernel takes as a netdev name (dev_valid_name, net/core/dev.c): fewer than
# IFNAMSIZ (16) bytes with the NUL, never "." or "..", no "/", ":" or a byte its isspace()
# holds -- which, in the kernel's Latin-1 ctype, is also 0xa0: UTF-8's "à" (c3 a0) fails
_IFNAMSIZ = 16
_IFNAME_BAD_BYTES = frozenset(b"/:\0\t\n\v\f\r \xa0")


def interface_name_error(name: str) -> str:
    """Why the kernel would never name a netdev ``name`` (``ip link set X name NAME``
    fails: "not a valid ifname"); "" when it could."""
    if not name:
        return "empty"
    size = len(name.encode())
    if size >= _IFNAMSIZ:
        return f"{size} bytes, the kernel takes at most {_IFNAMSIZ - 1}"
    if name in (".", ".."):
        return "reserved by the kernel"
    bad = [c for c in name if _IFNAME_BAD_BYTES.intersection(c.encode())]
    if bad:
        return f"the kernel refuses {', '.join(dict.fromkeys(map(repr, bad)))} in a name"
    return ""


def link_rate_range(bps: int) -> str:
    """Why ``bps`` is no link rate gpud shapes (for errors naming where it came from)."""
    return f"link rate {bps} bit/s is outside 8 kbit/s to 10 Tbit/s"


def _burst(rate_bps: int, opts: TcOptions) -> int:
    want = max(opts.min_burst_bytes, math.ceil(rate_bps / 8 * opts.burst_s))
    # never more than the kernel can hold: it would read back cut short, drift every tick
    return min(want, int(rate_bps // 8 * MAX_BURST_S))


def _cls(
    classid: int,
    parent: int,
    prio: int,
    rate_bps: int,
    ceil_bps: int,
    *,
    opts: TcOptions,
    level: int | None = None,
    job: str | None = None,
) -> HtbClass:
    rate_bps = max(8, min(rate_bps, ceil_bps))
    return HtbClass(
        classid=classid,
        parent=parent,
        prio=prio,
        rate_bps=rate_bps,
        ceil_bps=ceil_bps,
        burst=_burst(rate_bps, opts=opts),
        cburst=_burst(ceil_bps, opts=opts),
        quantum=opts.quantum_bytes,
        level=level,
        job=job,
    )


def plan(
    links: Mapping[str, int],
    tags: Mapping[str, int],
    levels: Mapping[str, int],
    shares: Sequence[float],
    options: TcOptions | None = None,
    *,
    weights: Mapping[str, float] | None = None,
    homes: Mapping[str, int] | None = None,
    interface_homes: Mapping[str, Mapping[str, int]] | None = None,
) -> TcPlan:
    """The HTB tree and filters for every interface in ``links``.

    ``links``: interface -> link rate in bit/s. ``tags``: job -> DSCP. ``levels``: job ->
    level (jobs without a level -- excluded, or not ranked yet -- get no leaf: their
    traffic falls into the default class). ``shares``: level -> minimum fraction of the
    link; ``len(shares)`` is the number of levels (at most 8). ``weights``: job -> its
    share of a level's excess relative to the other jobs there, in (0, 1] (the leaf's DRR
    quantum is ``quantum_bytes`` times it, at least ``MIN_QUANTUM``); absent jobs weigh 1.
    ``homes``: job -> the level class its leaf sits under (default: its level); the leaf's
    ``prio`` is always the job's level, so a job moves between levels in place.
    ``interface_homes``: interface -> job -> the level class its leaf sits under on that
    interface, over ``homes`` (leaves a sync cut short left under different level classes
    on different interfaces stay where each is); an interface's leaves are in its plan's
    classes.

    Raises ValueError naming the job, level, interface or tag that is wrong.
    """
    opts = options or TcOptions()
    if not 1 <= len(shares) <= MAX_LEVELS:
        raise ValueError(f"shares: need 1 to {MAX_LEVELS} levels, got {len(shares)}")
    for lvl, s in enumerate(shares):
        if not 0 <= s <= 1:
            raise ValueError(f"shares[{lvl}] must be in [0, 1], got {s}")
    if sum(shares) + opts.default_share + opts.top_share > 1 + 1e-9:
        raise ValueError(
            f"level shares ({sum(shares):.3f}) plus default_share ({opts.default_share})"
            + (f" plus top_share ({opts.top_share})" if opts.top_share else "")
            + " exceed 1"
        )
    by_tag: dict[int, str] = {}
    for job, dscp in sorted(tags.items()):
        if not 1 <= dscp <= DSCP_MAX:
            raise ValueError(f"{job}: DSCP tag must be in [1, {DSCP_MAX}], got {dscp}")
        if dscp in by_tag:
            raise ValueError(f"{job}: DSCP {dscp} is already the tag of {by_tag[dscp]}")
        by_tag[dscp] = job
    placed: list[tuple[int, str, int, int]] = []  # (dscp, job, level, home)
    for job, lvl in sorted(levels.items()):
        if job not in tags:
            raise ValueError(f"{job}: has level {lvl} but no DSCP tag")
        if not 0 <= lvl < len(shares):
            raise ValueError(f"{job}: level {lvl} is outside [0, {len(shares) - 1}]")
        placed.append((tags[job], job, lvl, _home(job, (homes or {}).get(job, lvl), shares)))
    placed.sort()
    quanta: dict[str, int] = {}
    for job, w in (weights or {}).items():
        if not 0 < w <= 1:
            raise ValueError(f"{job}: weight must be in (0, 1], got {w}")
        quanta[job] = max(MIN_QUANTUM, round(opts.quantum_bytes * w))

    major = opts.major
    root = handle(major, 0)
    top = handle(major, TOP_MINOR)
    default = handle(major, DEFAULT_MINOR)
    ifaces: list[InterfacePlan] = []
    for iface, link in sorted(links.items()):
        if why := interface_name_error(iface):
            raise ValueError(f"interface name {iface!r} is not valid: {why}")
        if not LINK_BPS_MIN <= link <= LINK_BPS_MAX:
            raise ValueError(f"{iface}: {link_rate_range(link)}")
        classes = [
            _cls(top, root, 0, link, link, opts=opts),
            _cls(default, top, DEFAULT_PRIO, round(link * opts.default_share), link, opts=opts),
        ]
        for lvl, share in enumerate(shares):
            classes.append(
                _cls(
                    level_classid(lvl, major),
                    top,
                    lvl,
                    round(link * share),
                    link,
                    opts=opts,
                    level=lvl,
                )
            )
        leaf_rate = round(link * opts.leaf_share)
        top_rate = max(leaf_rate, round(link * opts.top_share))
        filters: list[DscpFilter] = []
        here = (interface_homes or {}).get(iface, {})
        for dscp, job, lvl, job_home in placed:
            home = _home(f"{iface}: {job}", here[job], shares) if job in here else job_home
            leaf = leaf_classid(home, dscp, major)
            leaf_cls = _cls(
                leaf,
                level_classid(home, major),
                lvl,
                top_rate if lvl == 0 else leaf_rate,
                link,
                opts=opts,
                level=lvl,
                job=job,
            )
            if job in quanta:
                leaf_cls = replace(leaf_cls, quantum=min(leaf_cls.quantum, quanta[job]))
            classes.append(leaf_cls)
            filters.append(DscpFilter(Family.IPV4, dscp, leaf, job))
            filters.append(DscpFilter(Family.IPV6, dscp, leaf, job))
        ifaces.append(
            InterfacePlan(
                iface=iface,
                link_bps=link,
                root=root,
                default_classid=default,
                classes=tuple(classes),
                filters=tuple(filters),
            )
        )
    return TcPlan(interfaces=tuple(ifaces))


def _home(what: str, home: int, shares: Sequence[float]) -> int:
    """``home``, a level class a leaf may sit under; ValueError naming ``what`` if not."""
    if not 0 <= home < len(shares):
        raise ValueError(f"{what}: home level {home} is outside [0, {len(shares) - 1}]")
    return home


# --- what the kernel holds, and the operations from there to the plan -------------------


@dataclass(frozen=True)
class RootQdisc:
    """The root qdisc as the kernel reports it (``tc qdisc show dev IF root``).

    ``default_classid`` is only known for HTB.
    """

    kind: str
    handle: int
    default_classid: int | None = None


@dataclass(frozen=True)
class ChildQdisc:
    """A qdisc someone attached to one of our classes (``tc qdisc replace dev IF parent
    6764:101a handle 20: ...``). The plan attaches none: HTB's built-in default queue (which
    ``tc qdisc show`` does not list) is what every class should hold."""

    parent: int
    handle: int
    kind: str


@dataclass(frozen=True)
class InterfaceState:
    """What one interface holds, read from the kernel (or remembered after a sync).

    ``classes`` and ``filters`` are the ones under our root only; filters the planner does
    not recognise are kept in ``foreign_filters`` as (prio, protocol, handle): the diff
    removes those at our own prio by exact handle, and any other prio as a whole (handle
    0), whatever classifier it is.
    """

    iface: str
    root: RootQdisc | None
    classes: tuple[HtbClass, ...] = ()
    filters: tuple[tuple[int, DscpFilter], ...] = ()  # (full u32 handle, filter)
    foreign_filters: tuple[tuple[int, int, int], ...] = ()
    child_qdiscs: tuple[ChildQdisc, ...] = ()


class OpKind(Enum):
    REPLACE_ROOT = "replace-root"  # HTB root with our handle and default class
    ADD_CLASS = "add-class"
    CHANGE_CLASS = "change-class"
    DELETE_CLASS = "delete-class"
    ADD_FILTER = "add-filter"
    CHANGE_FILTER = "change-filter"  # same handle, new flowid
    DELETE_FILTER = "delete-filter"  # by exact (prio, protocol, handle)
    DELETE_ROOT = "delete-root"  # back to the kernel's default root qdisc
    DELETE_QDISC = "delete-qdisc"  # a child qdisc under one of our classes


@dataclass(frozen=True)
class TcOp:
    """One tc operation; ``tc_args`` reads as the equivalent ``tc`` command line."""

    kind: OpKind
    iface: str
    cls: HtbClass | None = None
    flt: DscpFilter | None = None
    root: int = 0
    default_classid: int = 0
    filter_handle: int = 0  # DELETE/CHANGE_FILTER: the kernel's full handle (ADD: node only)
    filter_protocol: int = ETH_P_ALL
    filter_prio: int = FILTER_PRIO
    qdisc: ChildQdisc | None = None  # DELETE_QDISC

    def tc_args(self) -> list[str]:
        """The ``tc`` arguments doing the same (what ``tc -batch`` would read)."""
        dev = ["dev", self.iface]
        if self.kind is OpKind.REPLACE_ROOT:
            root = format_qdisc_handle(self.root)
            default = f"{self.default_classid & 0xFFFF:x}"
            return ["qdisc", "replace", *dev, "root", "handle", root, "htb", "default", default]
        if self.kind is OpKind.DELETE_ROOT:
            # the handle the request carries (gpud's): the kernel deletes no other root
            handle = ["handle", format_qdisc_handle(self.root)] if self.root else []
            return ["qdisc", "del", *dev, "root", *handle]
        if self.qdisc is not None:
            q = self.qdisc
            parent, qh = format_handle(q.parent), format_qdisc_handle(q.handle)
            return ["qdisc", "del", *dev, "parent", parent, "handle", qh]
        if self.cls is not None and self.kind is OpKind.DELETE_CLASS:
            return ["class", "del", *dev, "classid", self.cls.name]
        if self.cls is not None:
            c = self.cls
            verb = "add" if self.kind is OpKind.ADD_CLASS else "change"
            return [
                "class",
                verb,
                *dev,
                "parent",
                format_handle(c.parent),
                "classid",
                c.name,
                "htb",
                "rate",
                f"{c.rate_bps}bit",
                "ceil",
                f"{c.ceil_bps}bit",
                "burst",
                f"{c.burst}b",
                "cburst",
                f"{c.cburst}b",
                "quantum",
                str(c.quantum),
                "prio",
                str(c.prio),
            ]
        if self.kind is OpKind.DELETE_FILTER:
            return [
                "filter",
                "del",
                *dev,
                "parent",
                format_qdisc_handle(self.root),
                "protocol",
                protocol_name(self.filter_protocol),
                "prio",
                str(self.filter_prio),
                *(["handle", _u32_handle(self.filter_handle), "u32"] if self.filter_handle else []),
            ]
        assert self.flt is not None
        value, mask = self.flt.key
        return [
            "filter",
            "add" if self.kind is OpKind.ADD_FILTER else "change",
            *dev,
            "parent",
            format_qdisc_handle(self.root),
            "protocol",
            "all",
            "prio",
            str(FILTER_PRIO),
            "handle",
            _u32_handle(self.filter_handle or self.flt.node),
            "u32",
            "match",
            "u32",
            f"{value:#010x}",
            f"{mask:#010x}",
            "at",
            "0",
            "flowid",
            format_handle(self.flt.flowid),
        ]


def _u32_handle(h: int) -> str:
    """tc's ``htid:hash:node`` notation; a node alone (``::35``) lets the kernel use the
    root hash table of the filter's prio, whatever number it has (``800:``, ``801:``)."""
    return format_u32_handle(h) if h >> 20 else f"::{h & 0xFFF:x}"


def _burst_close(have: int, want: int) -> bool:
    # The kernel keeps burst as transmit time in psched ticks; reading it back rounds.
    return abs(have - want) <= max(64, want // 100)


def class_matches(have: HtbClass, want: HtbClass) -> bool:
    """Whether the kernel's class already does what the plan wants."""
    return (
        have.classid == want.classid
        and have.parent == want.parent
        and have.prio == want.prio
        and have.rate_bps // 8 == want.rate_bps // 8
        and have.ceil_bps // 8 == want.ceil_bps // 8
        and have.quantum == want.quantum
        and _burst_close(have.burst, want.burst)
        and _burst_close(have.cburst, want.cburst)
    )


def diff(state: InterfaceState, want: InterfacePlan) -> tuple[TcOp, ...]:
    """The fewest operations taking ``state`` to ``want``, in an order the kernel accepts.

    A missing or foreign root (or an HTB root with another default, or a wanted class
    under the wrong parent) means the whole tree is rebuilt: replacing the root drops
    every class and filter under it (a root holding our handle is deleted first).
    Otherwise, in this order: foreign filters under our root are deleted; qdiscs someone
    attached to classes that stay are deleted (HTB's default queue comes back); missing
    classes are added and differing ones changed, parents first; missing filters are added
    and mis-pointed ones changed in place; filters of gone jobs are deleted; classes no
    longer wanted are deleted, leaves first. So a moved job's traffic always has a class,
    and no class is deleted while a filter points to it.
    """
    iface = want.iface
    root = state.root
    have_classes = {c.classid: c for c in state.classes}
    ours = (
        root is not None
        and root.kind == "htb"
        and root.handle == want.root
        and root.default_classid == want.default_classid
        and all(
            have_classes[c.classid].parent == c.parent
            for c in want.classes
            if c.classid in have_classes
        )
    )
    if not ours:
        ops: list[TcOp] = []
        if root is not None and root.handle == want.root:
            # A root with our handle that is not our tree (another default, another kind:
            # `tc qdisc del ... root; tc qdisc add ... root handle 6764: htb default 5`)
            # cannot be replaced in place: the kernel takes a replace of the same handle as
            # a change of that qdisc, which HTB refuses ("Change operation not supported").
            ops.append(TcOp(OpKind.DELETE_ROOT, iface, root=want.root))
        ops.append(
            TcOp(OpKind.REPLACE_ROOT, iface, root=want.root, default_classid=want.default_classid)
        )
        ops += [TcOp(OpKind.ADD_CLASS, iface, cls=c) for c in want.classes]
        ops += [TcOp(OpKind.ADD_FILTER, iface, flt=f, root=want.root) for f in want.filters]
        return tuple(ops)

    foreign = sorted(
        {
            (p, proto, h if (p, proto) == (FILTER_PRIO, ETH_P_ALL) else 0)
            for p, proto, h in state.foreign_filters
        }
    )
    ops = [
        TcOp(
            OpKind.DELETE_FILTER,
            iface,
            root=want.root,
            filter_handle=h,
            filter_protocol=proto,
            filter_prio=prio,
        )
        for prio, proto, h in foreign
    ]
    want_ids = {c.classid for c in want.classes}
    # a class that goes anyway takes its qdisc with it
    ops += [
        TcOp(OpKind.DELETE_QDISC, iface, root=want.root, qdisc=q)
        for q in sorted(state.child_qdiscs, key=lambda q: (q.parent, q.handle))
        if q.parent in want_ids
    ]
    for c in want.classes:  # parents first
        have = have_classes.get(c.classid)
        if have is None:
            ops.append(TcOp(OpKind.ADD_CLASS, iface, cls=c))
        elif not class_matches(have, c):
            ops.append(TcOp(OpKind.CHANGE_CLASS, iface, cls=c))
    have_filters: dict[tuple[Family, int], tuple[int, DscpFilter]] = {}
    stray: list[int] = []
    for h, f in state.filters:
        if (f.family, f.dscp) in have_filters:
            stray.append(h)  # a duplicate someone added by hand
        else:
            have_filters[(f.family, f.dscp)] = (h, f)
    for f in want.filters:
        found = have_filters.pop((f.family, f.dscp), None)
        if found is None:
            ops.append(TcOp(OpKind.ADD_FILTER, iface, flt=f, root=want.root))
        elif found[1].flowid != f.flowid:
            ops.append(
                TcOp(OpKind.CHANGE_FILTER, iface, flt=f, root=want.root, filter_handle=found[0])
            )
    stray += [h for h, _ in have_filters.values()]
    ops += [
        TcOp(OpKind.DELETE_FILTER, iface, root=want.root, filter_handle=h) for h in sorted(stray)
    ]
    doomed = [c for c in state.classes if c.classid not in want_ids]
    depth = {c.classid: _depth(c, have_classes) for c in doomed}
    for c in sorted(doomed, key=lambda c: (-depth[c.classid], c.classid)):
        ops.append(TcOp(OpKind.DELETE_CLASS, iface, cls=c))
    return tuple(ops)


def _depth(c: HtbClass, by_id: Mapping[int, HtbClass]) -> int:
    d = 0
    seen: set[int] = set()
    while c.parent in by_id and c.parent not in seen:
        seen.add(c.parent)
        c = by_id[c.parent]
        d += 1
    return d


def u32_htid(state: InterfaceState, ops: Sequence[TcOp]) -> int | None:
    """The hash table our filters live in once ``ops`` ran on ``state`` (``0x800`` after a
    rebuild, else the one our filters already use), or None when it cannot be known
    without reading the kernel (our first filters added next to someone else's)."""
    if any(op.kind is OpKind.REPLACE_ROOT for op in ops):
        return 0x800
    if state.filters:
        return state.filters[0][0] >> 20
    return None


def state_after(want: InterfacePlan, htid: int = 0x800) -> InterfaceState:
    """What the interface holds once every op of a sync succeeded (the adapter's cache)."""
    return InterfaceState(
        iface=want.iface,
        root=RootQdisc("htb", want.root, want.default_classid),
        classes=want.classes,
        filters=tuple(((htid << 20) | f.node, f) for f in want.filters),
    )
