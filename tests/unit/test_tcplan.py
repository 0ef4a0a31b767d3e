"""The pure tc planner: tree shape, validation, and the diff against a model of the kernel."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netshaper import tcplan as tp

GBIT = 10**9
SHARES = [0.02] * 8


def one(p: tp.TcPlan) -> tp.InterfacePlan:
    assert len(p.interfaces) == 1
    return p.interfaces[0]


def test_tree_shape_ids_and_explicit_parameters() -> None:
    p = tp.plan({"eth0": 10 * GBIT}, {"a": 26, "b": 34}, {"a": 0, "b": 3}, SHARES)
    ip = one(p)
    assert ip.root == 0x67640000 and ip.default_classid == 0x67640002
    by_name = {c.name: c for c in ip.classes}
    assert set(by_name) == {
        "6764:1",
        "6764:2",
        *(f"6764:1{i}" for i in range(8)),
        "6764:101a",
        "6764:1322",
    }
    top, default = by_name["6764:1"], by_name["6764:2"]
    assert top.rate_bps == top.ceil_bps == 10 * GBIT and top.parent == ip.root
    assert default.prio == 7 and default.rate_bps == 200_000_000
    lvl3 = by_name["6764:13"]
    assert (lvl3.prio, lvl3.rate_bps, lvl3.ceil_bps, lvl3.parent) == (
        3,
        200_000_000,
        10 * GBIT,
        top.classid,
    )
    leaf = by_name["6764:1322"]
    assert (leaf.parent, leaf.prio, leaf.job, leaf.level) == (lvl3.classid, 3, "b", 3)
    assert leaf.rate_bps == 10_000_000  # leaf_share 0.001: independent of the level's job count
    for c in ip.classes:  # explicit: 1 ms of rate at least 128 KiB; quantum for every class
        assert c.burst == max(128 * 1024, c.rate_bps // 8 // 1000)
        assert c.cburst == max(128 * 1024, c.ceil_bps // 8 // 1000)
        assert c.quantum == 60_000
    # parents come before their children
    seen = {ip.root}
    for c in ip.classes:
        assert c.parent in seen
        seen.add(c.classid)
    assert {c.job: c.classid for c in ip.classes if c.job} == {"a": 0x6764101A, "b": 0x67641322}


def test_filters_match_dscp_for_ipv4_and_ipv6() -> None:
    ip = one(tp.plan({"eth0": GBIT}, {"a": 26}, {"a": 0}, SHARES))
    v4, v6 = ip.filters
    assert (v4.family, v4.key, v4.node, v4.flowid) == (
        tp.Family.IPV4,
        (0x40680000, 0xF0FC0000),
        53,
        0x6764101A,
    )
    assert (v6.family, v6.key, v6.node) == (tp.Family.IPV6, (0x66800000, 0xFFC00000), 54)
    # A TOS byte of 0x68 (DSCP 26, any ECN) in an IPv4 header matches; the same byte as an
    # IPv6 traffic class matches the IPv6 key.
    ipv4_word = 0x45680054
    ipv6_word = 0x6 << 28 | 0x6B << 20 | 0x12345
    assert ipv4_word & v4.key[1] == v4.key[0]
    assert ipv6_word & v6.key[1] == v6.key[0]
    assert ipv6_word & v4.key[1] != v4.key[0]
    assert tp.filter_from_key(53, *v4.key, v4.flowid) == replace(v4, job=None)
    assert tp.filter_from_key(54, *v4.key, v4.flowid) is None  # node does not fit the key


def test_tc_args_read_as_tc_commands() -> None:
    ip = one(tp.plan({"eth0": GBIT}, {"a": 26}, {"a": 1}, SHARES))
    ops = tp.diff(tp.InterfaceState("eth0", None), ip)
    text = [" ".join(op.tc_args()) for op in ops]
    assert text[0] == "qdisc replace dev eth0 root handle 6764: htb default 2"
    assert (
        "class add dev eth0 parent 6764:11 classid 6764:111a htb rate 1000000bit ceil "
        "1000000000bit burst 131072b cburst 131072b quantum 60000 prio 1"
    ) in text
    assert text[-2] == (
        "filter add dev eth0 parent 6764: protocol all prio 1 handle ::35 u32 match u32 "
        "0x40680000 0xf0fc0000 at 0 flowid 6764:111a"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"levels": {"x": 0}}, "x: has level 0 but no DSCP tag"),
        ({"levels": {"a": 8}}, r"a: level 8 is outside \[0, 7\]"),
        ({"tags": {"a": 26, "b": 26}}, "b: DSCP 26 is already the tag of a"),
        ({"tags": {"a": 0}}, r"a: DSCP tag must be in \[1, 63\]"),
        ({"links": {"eth0/x": GBIT}}, "interface name 'eth0/x' is not valid"),
        ({"links": {"eth0:1": GBIT}}, "'eth0:1' is not valid: the kernel refuses ':'"),
        ({"links": {"eth0": 10}}, r"eth0: link rate 10 bit/s is outside 8 kbit/s to 10 Tbit/s"),
        ({"shares": [0.2] * 5}, "exceed 1"),
        ({"shares": []}, "need 1 to 8 levels"),
    ],
)
def test_bad_input_names_what_is_wrong(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "links": {"eth0": GBIT},
        "tags": {"a": 26},
        "levels": {"a": 0},
        "shares": SHARES,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        tp.plan(**args)  # type: ignore[arg-type]


def test_options_are_range_checked() -> None:
    with pytest.raises(ValueError, match="quantum_bytes"):
        tp.TcOptions(quantum_bytes=100)
    with pytest.raises(ValueError, match="default_share"):
        tp.TcOptions(default_share=0)


def test_jobs_without_level_fall_to_default_class() -> None:
    ip = one(tp.plan({"eth0": GBIT}, {"a": 26, "b": 27}, {"a": 0}, SHARES))
    assert [c.job for c in ip.classes if c.job] == ["a"]
    assert {f.dscp for f in ip.filters} == {26}


# --- diff ------------------------------------------------------------------------------


def test_no_ops_when_the_kernel_matches() -> None:
    ip = one(tp.plan({"eth0": GBIT}, {"a": 26}, {"a": 0}, SHARES))
    assert tp.diff(tp.state_after(ip), ip) == ()


def test_a_move_is_four_ops_in_a_safe_order() -> None:
    tags = {"a": 26, "b": 34}
    before = one(tp.plan({"eth0": GBIT}, tags, {"a": 0, "b": 3}, SHARES))
    after = one(tp.plan({"eth0": GBIT}, tags, {"a": 2, "b": 3}, SHARES))
    ops = tp.diff(tp.state_after(before), after)
    assert [(o.kind, o.cls.name if o.cls else o.flt.dscp if o.flt else None) for o in ops] == [
        (tp.OpKind.ADD_CLASS, "6764:121a"),
        (tp.OpKind.CHANGE_FILTER, 26),
        (tp.OpKind.CHANGE_FILTER, 26),
        (tp.OpKind.DELETE_CLASS, "6764:101a"),
    ]


def test_jobs_come_and_go() -> None:
    before = one(tp.plan({"eth0": GBIT}, {"a": 26, "b": 34}, {"a": 0, "b": 1}, SHARES))
    after = one(tp.plan({"eth0": GBIT}, {"b": 34, "c": 9}, {"b": 1, "c": 5}, SHARES))
    kinds = [o.kind for o in tp.diff(tp.state_after(before), after)]
    assert kinds == [
        tp.OpKind.ADD_CLASS,
        tp.OpKind.ADD_FILTER,
        tp.OpKind.ADD_FILTER,
        tp.OpKind.DELETE_FILTER,
        tp.OpKind.DELETE_FILTER,
        tp.OpKind.DELETE_CLASS,
    ]


def test_foreign_or_missing_root_rebuilds_everything() -> None:
    ip = one(tp.plan({"eth0": GBIT}, {"a": 26}, {"a": 0}, SHARES))
    for root in (None, tp.RootQdisc("fq_codel", 0), tp.RootQdisc("htb", 0x10000, 0x10010)):
        ops = tp.diff(tp.InterfaceState("eth0", root), ip)
        assert ops[0].kind is tp.OpKind.REPLACE_ROOT
        assert len(ops) == 1 + len(ip.classes) + len(ip.filters)


def test_drift_is_repaired_with_targeted_ops() -> None:
    ip = one(tp.plan({"eth0": GBIT}, {"a": 26}, {"a": 0}, SHARES))
    good = tp.state_after(ip)
    tampered_cls = replace(good.classes[3], rate_bps=5_000_000)
    state = replace(
        good,
        classes=(*good.classes[:3], tampered_cls, *good.classes[4:]),
        filters=good.filters[:1],
        foreign_filters=((5, 0x0800, 0x80100801),),
    )
    ops = tp.diff(state, ip)
    assert [o.kind for o in ops] == [
        tp.OpKind.DELETE_FILTER,
        tp.OpKind.CHANGE_CLASS,
        tp.OpKind.ADD_FILTER,
    ]
    assert ops[0].tc_args()[-3:] == ["ip", "prio", "5"]  # the whole foreign prio


def test_burst_read_back_rounding_is_not_drift() -> None:
    ip = one(tp.plan({"eth0": GBIT}, {}, {}, SHARES))
    good = tp.state_after(ip)
    rounded = tuple(replace(c, burst=c.burst - 72, cburst=c.cburst + 40) for c in good.classes)
    assert tp.diff(replace(good, classes=rounded), ip) == ()


def _as_the_kernel_keeps_it(c: tp.HtbClass) -> tp.HtbClass:
    """``c`` read back: HTB keeps burst and cburst as their time at rate and ceil, in 32-bit
    ticks of 64 ns (15.625 a microsecond), cut at 2**32 - 1."""

    def kept(size: int, bps: int) -> int:
        ticks = min(int(1_000_000 * size / (bps // 8) * 15.625), 0xFFFFFFFF)
        return round(bps // 8 * ticks / 15.625 / 1_000_000)

    return replace(c, burst=kept(c.burst, c.rate_bps), cburst=kept(c.cburst, c.ceil_bps))


@pytest.mark.parametrize(("link", "shares"), [(100 * 10**6, [0.0] * 4), (8000, [0.001] * 8)])
def test_a_class_too_slow_for_its_burst_is_not_drift_every_tick(
    link: int, shares: list[float]
) -> None:
    """With no minimum share (or a very slow link) a class's rate is a few bytes a second:
    128 KiB of burst would last longer than the kernel can hold, and read back cut short,
    drift to repair on every tick. The plan asks for what the kernel keeps."""
    ip = one(
        tp.plan({"eth0": link}, {"a": 26}, {"a": 0}, shares, tp.TcOptions(default_share=0.001))
    )
    read_back = tuple(_as_the_kernel_keeps_it(c) for c in tp.state_after(ip).classes)
    assert tp.diff(replace(tp.state_after(ip), classes=read_back), ip) == ()


# --- a model of the kernel: every diff applies cleanly and reaches the plan ----------------


@dataclass
class KernelModel:
    """What HTB and u32 accept: parents exist, no class deleted while in use."""

    root: int | None = None
    classes: dict[int, tp.HtbClass] = field(default_factory=dict)
    filters: dict[tuple[tp.Family, int], int] = field(default_factory=dict)  # -> flowid

    def apply(self, op: tp.TcOp) -> None:
        k = op.kind
        if k is tp.OpKind.REPLACE_ROOT:
            self.root, self.classes, self.filters = op.root, {}, {}
        elif k is tp.OpKind.ADD_CLASS:
            assert op.cls is not None
            assert op.cls.classid not in self.classes, "EEXIST"
            assert op.cls.parent == self.root or op.cls.parent in self.classes, "no parent"
            self.classes[op.cls.classid] = op.cls
        elif k is tp.OpKind.CHANGE_CLASS:
            assert op.cls is not None and op.cls.classid in self.classes
            self.classes[op.cls.classid] = op.cls
        elif k is tp.OpKind.DELETE_CLASS:
            assert op.cls is not None
            cid = op.cls.classid
            assert not any(c.parent == cid for c in self.classes.values()), "has children"
            assert cid not in self.filters.values(), "HTB class in use"
            del self.classes[cid]
        elif k in (tp.OpKind.ADD_FILTER, tp.OpKind.CHANGE_FILTER):
            assert op.flt is not None
            key = (op.flt.family, op.flt.dscp)
            assert (key in self.filters) == (k is tp.OpKind.CHANGE_FILTER)
            assert op.flt.flowid in self.classes, "filter to a missing class"
            self.filters[key] = op.flt.flowid
        elif k is tp.OpKind.DELETE_FILTER:
            node = op.filter_handle & 0xFFF
            key = next(kk for kk in self.filters if tp.filter_node(kk[1], kk[0]) == node)
            del self.filters[key]

    def state(self, iface: str) -> tp.InterfaceState:
        assert self.root is not None
        return tp.InterfaceState(
            iface,
            tp.RootQdisc("htb", self.root, self.root | tp.DEFAULT_MINOR),
            tuple(self.classes.values()),
            tuple(
                (0x80000000 | tp.filter_node(d, fam), tp.DscpFilter(fam, d, flow))
                for (fam, d), flow in self.filters.items()
            ),
        )


assignments = st.dictionaries(
    st.sampled_from([f"job{i}" for i in range(12)]), st.integers(0, 7), max_size=12
)


@settings(max_examples=150, deadline=None)
@given(first=assignments, second=assignments)
def test_every_diff_applies_cleanly_and_moves_few(
    first: dict[str, int], second: dict[str, int]
) -> None:
    tags = {f"job{i}": 10 + i for i in range(12)}
    a = one(tp.plan({"eth0": GBIT}, tags, first, SHARES))
    b = one(tp.plan({"eth0": GBIT}, tags, second, SHARES))
    kernel = KernelModel()
    for op in tp.diff(tp.InterfaceState("eth0", None), a):
        kernel.apply(op)
    ops = tp.diff(kernel.state("eth0"), b)
    for op in ops:
        kernel.apply(op)
        # every placed job keeps a class for its traffic through the whole change
        for flow in kernel.filters.values():
            assert flow in kernel.classes
    assert tp.diff(kernel.state("eth0"), b) == ()
    moved = sum(1 for j in set(first) & set(second) if first[j] != second[j])
    added = len(set(second) - set(first))
    removed = len(set(first) - set(second))
    assert len(ops) == 4 * moved + 3 * added + 3 * removed


def test_foreign_filters_go_by_handle_in_our_prio_and_by_prio_elsewhere() -> None:
    ip = one(tp.plan({"eth0": GBIT}, {"a": 26}, {"a": 0}, SHARES))
    state = replace(
        tp.state_after(ip),
        foreign_filters=((5, 0x0800, 0x80100801), (5, 0x0800, 0x80100802), (1, 0x0003, 0x80000FFF)),
    )
    ops = tp.diff(state, ip)
    assert [op.tc_args()[-6:] for op in ops] == [
        ["all", "prio", "1", "handle", "800::fff", "u32"],
        ["parent", "6764:", "protocol", "ip", "prio", "5"],
    ]


def test_weights_scale_leaf_quanta_and_a_new_weight_is_one_change_in_place() -> None:
    tags, levels = {"a": 26, "b": 34}, {"a": 1, "b": 1}
    even = one(tp.plan({"eth0": GBIT}, tags, levels, SHARES))
    weighted = one(tp.plan({"eth0": GBIT}, tags, levels, SHARES, weights={"b": 0.25}))
    quantum = {c.job: c.quantum for c in weighted.classes if c.job}
    assert quantum == {"a": 60_000, "b": 15_000}
    tiny = one(tp.plan({"eth0": GBIT}, tags, levels, SHARES, weights={"b": 1e-6}))
    assert min(c.quantum for c in tiny.classes) == tp.MIN_QUANTUM
    ops = tp.diff(tp.state_after(even), weighted)
    assert [(o.kind, o.cls.name if o.cls else None) for o in ops] == [
        (tp.OpKind.CHANGE_CLASS, "6764:1122")
    ]
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="b: weight"):
            tp.plan({"eth0": GBIT}, tags, levels, SHARES, weights={"b": bad})


def test_a_move_at_home_is_one_change_in_place() -> None:
    tags, homes = {"a": 26, "b": 34}, {"a": 0, "b": 3}
    before = one(tp.plan({"eth0": GBIT}, tags, {"a": 0, "b": 3}, SHARES, homes=homes))
    after = one(tp.plan({"eth0": GBIT}, tags, {"a": 2, "b": 3}, SHARES, homes=homes))
    ops = tp.diff(tp.state_after(before), after)
    assert [(o.kind, o.cls.name if o.cls else None) for o in ops] == [
        (tp.OpKind.CHANGE_CLASS, "6764:101a")
    ]
    (leaf,) = [c for c in after.classes if c.job == "a"]
    assert (leaf.parent, leaf.prio) == (tp.level_classid(0), 2)
    with pytest.raises(ValueError, match="a: home level 9"):
        tp.plan({"eth0": GBIT}, tags, {"a": 0}, SHARES, homes={"a": 9})


def test_a_leaf_stays_under_the_home_it_has_on_each_interface() -> None:
    """A job whose leaves sit under different level classes on two interfaces (a sync cut
    short) keeps each where it is: no op on either, its filters pointing at that leaf."""
    tags, levels = {"a": 26, "b": 34}, {"a": 2, "b": 3}
    links = {"eth0": GBIT, "eth1": GBIT}
    homes = {"eth0": {"a": 0}, "eth1": {"a": 2}}
    planned = tp.plan(links, tags, levels, SHARES, homes={"a": 0}, interface_homes=homes)
    for iface, home in (("eth0", 0), ("eth1", 2)):
        want = planned.interface(iface)
        (leaf,) = [c for c in want.classes if c.job == "a"]
        assert (leaf.classid, leaf.parent, leaf.prio) == (
            tp.leaf_classid(home, 26),
            tp.level_classid(home),
            2,
        )
        assert {f.flowid for f in want.filters if f.job == "a"} == {leaf.classid}
        alone = one(tp.plan({iface: GBIT}, tags, levels, SHARES, homes={"a": home}))
        assert not tp.diff(tp.state_after(alone), want)
    with pytest.raises(ValueError, match="eth1: a: home level 9"):
        tp.plan(links, tags, levels, SHARES, interface_homes={"eth1": {"a": 9}})


def test_a_plan_names_a_jobs_leaf_only_in_each_interfaces_classes() -> None:
    """A job's leaf may sit under a different level class on each interface: the plan
    holds no one job -> leaf map for all of them, which would name a class some interface
    does not have."""
    tags, levels = {"a": 26}, {"a": 2}
    links = {"eth0": GBIT, "eth1": GBIT}
    homes = {"eth0": {"a": 0}, "eth1": {"a": 2}}
    planned = tp.plan(links, tags, levels, SHARES, interface_homes=homes)
    assert [f.name for f in fields(planned)] == ["interfaces"]
    assert {p.iface: [c.classid for c in p.classes if c.job] for p in planned.interfaces} == {
        "eth0": [tp.leaf_classid(0, 26)],
        "eth1": [tp.leaf_classid(2, 26)],
    }


def test_top_share_is_the_rate_of_level_0_leaves_and_moves_with_the_level() -> None:
    tags, homes = {"a": 26, "b": 34}, {"a": 0, "b": 3}
    opts = tp.TcOptions(top_share=0.8)
    shares = [0.02] * 4

    def leaves(levels: dict[str, int]) -> tuple[tp.InterfacePlan, dict[str, tp.HtbClass]]:
        ip = one(tp.plan({"eth0": GBIT}, tags, levels, shares, opts, homes=homes))
        return ip, {c.job: c for c in ip.classes if c.job}

    before, got = leaves({"a": 0, "b": 3})
    assert got["a"].rate_bps == round(0.8 * GBIT)  # level 0: the top share
    assert got["b"].rate_bps == round(tp.TcOptions().leaf_share * GBIT)
    # b to the top, a down: each one class change in place, prio and rate together
    after, got = leaves({"a": 2, "b": 0})
    assert (got["a"].prio, got["a"].rate_bps) == (2, round(tp.TcOptions().leaf_share * GBIT))
    assert (got["b"].prio, got["b"].rate_bps) == (0, round(0.8 * GBIT))
    ops = tp.diff(tp.state_after(before), after)
    assert sorted((o.kind, o.cls.name if o.cls else None) for o in ops) == [
        (tp.OpKind.CHANGE_CLASS, "6764:101a"),
        (tp.OpKind.CHANGE_CLASS, "6764:1322"),
    ]
    # the levels' and the default class's guarantees keep their room
    with pytest.raises(ValueError, match="top_share"):
        tp.plan({"eth0": GBIT}, tags, {"a": 0}, shares, tp.TcOptions(top_share=0.95))
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="top_share"):
            tp.TcOptions(top_share=bad)


def test_handles_read_as_tc_prints_them() -> None:
    assert tp.format_qdisc_handle(0x67640000) == "6764:"
    assert tp.format_u32_handle(0x80000800) == "800::800"
    assert tp.format_u32_handle(0x80000000) == "800:"
    assert tp.format_u32_handle(0x80012035) == "800:12:35"
    assert tp.protocol_name(0x0800) == "ip" and tp.protocol_name(0x88CC) == "0x88cc"


def test_a_qdisc_attached_to_a_class_that_stays_is_deleted_once() -> None:
    ip = one(tp.plan({"eth0": GBIT}, {"a": 26, "b": 34}, {"a": 1, "b": 0}, SHARES))
    leaf = tp.leaf_classid(1, 26)
    state = replace(
        tp.state_after(ip),
        child_qdiscs=(
            tp.ChildQdisc(leaf, 0x200000, "bfifo"),
            tp.ChildQdisc(0x6764FFFF, 0x300000, "pfifo"),  # under a class that goes anyway
        ),
    )
    ops = tp.diff(state, ip)
    assert [op.kind for op in ops] == [tp.OpKind.DELETE_QDISC]
    assert " ".join(ops[0].tc_args()) == "qdisc del dev eth0 parent 6764:111a handle 20:"
    assert tp.diff(tp.state_after(ip), ip) == ()  # HTB's default queue is no drift


def test_a_root_holding_our_handle_is_deleted_before_the_rebuild() -> None:
    ip = one(tp.plan({"eth0": GBIT}, {"a": 26}, {"a": 1}, SHARES))
    # `tc qdisc del dev eth0 root; tc qdisc add dev eth0 root handle 6764: htb default 5`:
    # the kernel refuses to replace a root by one of the same handle
    state = tp.InterfaceState("eth0", tp.RootQdisc("htb", ip.root, tp.handle(0x6764, 5)))
    ops = tp.diff(state, ip)
    assert [op.kind for op in ops[:2]] == [tp.OpKind.DELETE_ROOT, tp.OpKind.REPLACE_ROOT]
    foreign = tp.InterfaceState("eth0", tp.RootQdisc("pfifo", 0x10000))
    assert tp.diff(foreign, ip)[0].kind is tp.OpKind.REPLACE_ROOT


def test_a_root_delete_is_shown_with_the_handle_it_sends() -> None:
    """The kernel deletes only a root of the handle the request carries: ``tc`` says it."""
    ip = one(tp.plan({"eth0": GBIT}, {"a": 26}, {"a": 1}, SHARES))
    state = tp.InterfaceState("eth0", tp.RootQdisc("htb", ip.root, tp.handle(0x6764, 5)))
    assert " ".join(tp.diff(state, ip)[0].tc_args()) == "qdisc del dev eth0 root handle 6764:"
    assert tp.TcOp(tp.OpKind.DELETE_ROOT, "eth0").tc_args() == [
        "qdisc",
        "del",
        "dev",
        "eth0",
        "root",
    ]
