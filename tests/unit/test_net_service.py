"""The traffic service over fake tc, nftables and cgroups: reports, tags, levels, drift."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gpud.cluster.agent import ClusterAgent
from gpud.cluster.election import LeaderInfo
from gpud.config import TrafficConfig
from gpud.errors import (
    DscpPoolExhausted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from gpud.events import EventLog
from gpud.metrics import Collector
from gpud.net.api import job_message, show_message
from gpud.net.cgroups import JobCgroups, find_cgroup2
from gpud.net.enforce import (
    FakeAdopted,
    FakeCounters,
    FakeMarker,
    FakeRestored,
    FakeResult,
    FakeSync,
    FakeTc,
    RdmaPort,
)
from gpud.net.latest import LatestWorker
from gpud.net.metrics import TrafficMetrics
from gpud.net.port import JobTraffic, LinkEnforcement, TrafficSummary
from gpud.net.service import (
    MAX_JOB_SESSIONS,
    RDMA_RECHECK_S,
    RDMA_RETRY_S,
    Report,
    TrafficService,
    ethtool_speed,
    job_pool,
)
from gpud.net.shaped import ShapedInterfaces
from gpud.net.tagstore import TagStore, parse_pool
from gpud.store import StateStore
from tests.unit.cluster_support import Clock as AgentClock
from tests.unit.cluster_support import LoopbackPeers, agent
from tests.unit.store_support import CountingStore

if TYPE_CHECKING:
    from gpud.jobs.service import JobService, Launch
from netshaper import tcplan
from netshaper.dcb import MapResult
from netshaper.nftables import CgroupMark, MarkSync
from netshaper.tc_netlink import TcError


class Clock:
    """The wall clock (``t``, moved by tests) and a monotonic one that follows it, but for
    the wall clock's steps (:meth:`step`)."""

    def __init__(self) -> None:
        self.t = 1_000_000.0
        self.stepped = 0.0

    def __call__(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t - self.stepped

    def step(self, seconds: float) -> None:
        """The wall clock jumps (NTP, ``date -s``); the monotonic clock does not."""
        self.t += seconds
        self.stepped += seconds


def ether(netdev: str) -> int:
    """Every netdev an Ethernet port (ARPHRD_ETHER): no read of the host's netdevs."""
    return 1


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    for name, speed in (("eth0", "1000"), ("veth0", "-1")):
        d = tmp_path / "sys" / "class" / "net" / name
        d.mkdir(parents=True)
        (d / "speed").write_text(speed + "\n")
    return tmp_path / "sys"


def speeds(sysfs: Path) -> Callable[[str], tuple[int | None, str]]:
    """Link speeds as the fixture's ``class/net/IF/speed`` files give them, read by
    ``ethtool_speed``: an interface without a directory is not there (NotFound), one whose
    ``carrier`` file says 0 has its link down."""

    def speed(iface: str) -> int | None:
        try:
            return int((sysfs / "class" / "net" / iface / "speed").read_text())
        except (OSError, ValueError):
            return None

    def running(iface: str) -> bool | None:
        link = sysfs / "class" / "net" / iface
        if not link.is_dir():
            return None
        carrier = link / "carrier"
        return not carrier.exists() or carrier.read_text().strip() != "0"

    return lambda iface: ethtool_speed(iface, speed=speed, running=running)


def indexes(sysfs: Path) -> Callable[[str], int | None]:
    """Each netdev's ifindex as the fixture's ``class/net/IF/ifindex`` file gives it (None:
    no file, as for a netdev that is not there)."""

    def index(iface: str) -> int | None:
        try:
            return int((sysfs / "class" / "net" / iface / "ifindex").read_text())
        except (OSError, ValueError):
            return None

    return index


class Rig:
    def __init__(self, tmp_path: Path, sysfs: Path, **config: object) -> None:
        self.tmp = tmp_path
        self.sysfs = sysfs
        self.store = StateStore(tmp_path / "state")
        self.events = EventLog(None)
        self.jobs = ["a", "b", "c"]
        self.active: set[str] = set()
        self.clock = Clock()
        self.tc = FakeTc()
        self.marker = FakeMarker()
        self.cg_root = tmp_path / "cg"
        self.cgroups = JobCgroups(self.cg_root / "unified", nft_root=self.cg_root)
        self.config = TrafficConfig(**{"enabled": True, "interfaces": ("eth0",), **config})  # type: ignore[arg-type]
        self.service = self.make()

    def make(
        self,
        rdma: RdmaPort | None = None,
        jobs: Callable[[], list[str]] | None = None,
        tags: TagStore | None = None,
        active: Callable[[], set[str]] | None = None,
        link_index: Callable[[str], int | None] | None = None,
    ) -> TrafficService:
        """``jobs``: the registry's names (default: ``self.jobs``); ``active``: the jobs
        holding a reservation (default: ``self.active``); ``link_index``: each netdev's
        ifindex (default: the fixture's ``ifindex`` files)."""
        return TrafficService(
            self.config,
            tags=tags or TagStore(self.store, pool=job_pool(self.config)),
            events=self.events,
            jobs=jobs or (lambda: list(self.jobs)),
            active=active or (lambda: set(self.active)),
            tc=self.tc,
            marker=self.marker,
            cgroups=self.cgroups,
            rdma=rdma,
            shaped=ShapedInterfaces(self.store),
            link_speed=speeds(self.sysfs),
            link_index=link_index or indexes(self.sysfs),
            proc_root=self.tmp / "proc",
            clock=self.clock,
            monotonic=self.clock.monotonic,
        )

    def with_nic(self, rdma: RdmaPort) -> TrafficService:
        """A service writing the NIC map through ``rdma``, jobs a and b in use."""
        self.jobs = ["a", "b"]
        self.active = {"a", "b"}
        return self.make(rdma)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events.recent(1000)]


@pytest.fixture
def rig(tmp_path: Path, sysfs: Path) -> Rig:
    return Rig(tmp_path, sysfs)


def feed(rig: Rig, job: str, period: float, n: int, ideal: float | None = None) -> None:
    """``n`` iterations of ``period`` seconds ending now."""
    start = rig.clock.t - n * period
    for i in range(1, n + 1):
        rig.service.report(Report(job, i, start + i * period, ideal, session="s"))


def test_default_pool_avoids_reserved_and_cnp() -> None:
    pool = job_pool(TrafficConfig())
    assert not pool & {0, 8, 16, 24, 32, 40, 46, 48, 56}
    assert len(pool) == 64 - 9
    assert parse_pool("10-12,20", {11}) == {10, 12, 20}
    with pytest.raises(ValueError, match="no DSCP"):
        parse_pool("48", {48})


def test_reports_are_checked_and_bad_ones_change_nothing(rig: Rig) -> None:
    s = rig.service
    with pytest.raises(NotFound, match="no job 'zz'"):
        s.report(Report("zz", 1, rig.clock.t))
    with pytest.raises(InvalidArgument, match=r"timestamp_unix_seconds: .*in the future"):
        s.report(Report("a", 1, rig.clock.t + 60))
    s.report(Report("a", 10, rig.clock.t - 1, session="x"))
    with pytest.raises(InvalidArgument, match=r"iterations: .*5 iterations after 10"):
        s.report(Report("a", 5, rig.clock.t, session="x"))
    with pytest.raises(InvalidArgument, match="contention_free_iteration_s"):
        s.report(Report("a", 11, rig.clock.t, ideal_s=-1.0, session="x"))
    # a microscopic contention-free time would make the job the slowest for good
    with pytest.raises(InvalidArgument, match=r"contention_free_iteration_s: must be 1e-06\.\."):
        s.report(Report("a", 11, rig.clock.t, ideal_s=1e-300, session="x"))
    with pytest.raises(InvalidArgument, match=r"1e\+300 s in the future"):
        s.report(Report("a", 11, 1e300, session="x"))
    assert s.local_report().jobs == ()  # no tags yet: the tick hands them out
    s.tick()
    (a,) = [j for j in s.local_report().jobs if j.job == "a"]
    assert a.iterations == 10
    # a new session (a restarted job) may count again from the start
    s.report(Report("a", 1, rig.clock.t, session="y"))
    accepted, rejected = s.report_batch(
        [Report("a", 2, rig.clock.t, session="y"), Report("nope", 1, rig.clock.t)]
    )
    assert accepted == 1 and [r.index for r in rejected] == [1]
    assert s.rejected_reports == 7 and s.accepted_reports == 3


def test_tags_persist_and_are_released(rig: Rig) -> None:
    rig.service.tick()
    tags = rig.service.tags.allocations()
    assert set(tags) == {"a", "b", "c"}
    again = rig.make()  # a restart reads them back
    assert again.tags.allocations() == tags
    rig.jobs.remove("b")
    rig.service.tick()
    assert "b" not in rig.service.tags.allocations()
    assert "net.release" in rig.kinds()
    assert "b" not in rig.make().tags.allocations()


def test_slowest_job_gets_the_highest_level_on_the_wire(rig: Rig) -> None:
    feed(rig, "a", 1.0, 10, ideal=0.5)  # rate 0.5: slowest
    feed(rig, "b", 0.6, 10, ideal=0.5)
    feed(rig, "c", 0.5, 10, ideal=0.5)
    rig.service.tick()
    levels = {j.job: j.level for j in rig.service.local_report().jobs}
    assert levels == {"a": 0, "b": 1, "c": 2}
    state = rig.tc.states["eth0"]
    assert state.root is not None and state.root.handle >> 16 == tcplan.ROOT_MAJOR
    leaves = {tcplan.parse_leaf(c.classid) for c in state.classes} - {None}
    tags = rig.service.tags.allocations()
    assert leaves == {(0, tags["a"]), (1, tags["b"]), (2, tags["c"])}
    view = rig.service.view()
    assert view.interfaces[0].enforced and view.interfaces[0].rate_bps == 1_000_000_000


def test_top_share_and_long_weight_reach_the_wire_and_the_ranking(
    tmp_path: Path, sysfs: Path
) -> None:
    def run(**config: object) -> Rig:
        # a fell behind early and runs faster than b now (window rates 0.625 and 0.5,
        # long-run 0.44 and 0.5): by the plain geometric mean a is the faster (0.52), by
        # its deficit alone the slower
        rig = Rig(tmp_path / str(len(config)), sysfs, **config)
        start = rig.clock.t - 40.0
        reports = [Report("b", i, start + 1.0 * i, 0.5, session="s") for i in range(1, 41)]
        reports += [Report("a", i, start + 2.0 * i, 0.5, session="s") for i in range(1, 11)]
        reports += [
            Report("a", 10 + i, start + 20.0 + 0.8 * i, 0.5, session="s") for i in range(1, 26)
        ]
        for r in sorted(reports, key=lambda r: r.timestamp):
            rig.service.report(r)
        rig.service.tick()
        return rig

    plain = {j.job: j.level for j in run().service.local_report().jobs}
    assert plain["b"] < plain["a"]
    rig = run(top_share=0.5, progress_long_weight=1.0)
    levels = {j.job: j.level for j in rig.service.local_report().jobs}
    assert levels["a"] < levels["b"] and levels["a"] == 0
    rate = {tcplan.parse_leaf(c.classid): c.rate_bps for c in rig.tc.states["eth0"].classes}
    tags = rig.service.tags.allocations()
    assert rate[(0, tags["a"])] == 500_000_000  # half of eth0's 1 Gbit/s
    assert rate[(levels["b"], tags["b"])] < 10_000_000


def test_changed_level_only_moves_the_mapping_and_is_counted(rig: Rig) -> None:
    for j in "abc":
        feed(rig, j, 1.0, 5, ideal=0.5)
    rig.service.tick()
    tags = dict(rig.service.tags.allocations())
    before = {j.job: j.level for j in rig.service.local_report().jobs}
    rig.service.pin("c", 3)
    rig.service.tick()
    after = {j.job: j.level for j in rig.service.local_report().jobs}
    assert after["c"] == 3 and before["c"] != 3
    assert rig.service.tags.allocations() == tags  # the tag never changes
    assert rig.service.view().level_changes_total >= 1
    assert "net.levels" in rig.kinds()


def test_drift_is_repaired_within_one_tick_and_logged(rig: Rig) -> None:
    rig.active = {"a", "b"}
    rig.service.tick()
    rig.service.tick()
    assert rig.service.view().interfaces[0].repairs == 0
    del rig.tc.states["eth0"]  # someone ran `tc qdisc del dev eth0 root`
    rig.service.tick()
    assert rig.tc.states["eth0"].root is not None
    assert rig.service.view().interfaces[0].repairs == 1
    assert "net.drift" in rig.kinds()


def test_another_tool_changing_the_root_every_pass_is_repaired_each_pass_said_twice(
    rig: Rig,
) -> None:
    """Another tool runs ``tc qdisc replace dev eth0 root fq_codel`` before every pass:
    gpud puts its tree back each pass, and says the first repair and, once, that the
    change comes back every pass; not an event per pass. One pass that finds its tree in
    place ends the fight: the next change is said again."""
    rig.active = {"a", "b"}
    rig.service.tick()
    rig.service.tick()

    def fq_codel() -> None:
        rig.tc.states["eth0"] = tcplan.InterfaceState("eth0", tcplan.RootQdisc("fq_codel", 0))

    for _ in range(10):
        fq_codel()
        rig.service.tick()
        root = rig.tc.states["eth0"].root
        assert root is not None and root.kind == "htb"
    drifts = [e.message for e in rig.events.recent(100) if e.kind == "net.drift"]
    assert len(drifts) == 2, drifts
    assert drifts[0].startswith("eth0: restored ")
    assert drifts[1].startswith(
        "eth0: changed outside gpud again on 2 passes running: another tool keeps changing"
        " it; gpud restores it on every pass, said again once a pass finds it as gpud left"
        " it: restored "
    )
    assert rig.service.view().interfaces[0].repairs == 10
    rig.service.tick()  # gpud's tree held for a pass
    fq_codel()
    rig.service.tick()
    drifts = [e.message for e in rig.events.recent(100) if e.kind == "net.drift"]
    assert len(drifts) == 3 and drifts[2].startswith("eth0: restored ")


def test_changes_outside_gpud_with_plan_changes_between_are_each_said_plainly(
    rig: Rig,
) -> None:
    """Three unrelated ``tc qdisc replace dev eth0 root fq_codel``, each a pass apart
    from the next by a pass that moved the plan (a job started or stopped): no pass
    repaired eth0 twice running, so each is said as a change of its own."""
    rig.active = {"a"}
    rig.service.tick()
    rig.service.tick()
    for then_active in ({"a", "b"}, {"a"}, None):
        rig.tc.states["eth0"] = tcplan.InterfaceState("eth0", tcplan.RootQdisc("fq_codel", 0))
        rig.service.tick()
        if then_active is not None:
            rig.active = then_active
            rig.service.tick()
    drifts = [e.message for e in rig.events.recent(100) if e.kind == "net.drift"]
    assert len(drifts) == 3, drifts
    assert all(d.startswith("eth0: restored ") for d in drifts), drifts
    assert rig.service.view().interfaces[0].repairs == 3


def test_a_netdev_made_again_on_passes_running_is_named_each_time(rig: Rig) -> None:
    """eth0 deleted and created again before each of three passes (a driver resetting
    it): each new netdev is said with its ifindex and the one before, never as another
    tool's change."""
    rig.active = {"a"}
    rig.service.tick()
    rig.service.tick()
    for n in range(3):
        del rig.tc.states["eth0"]
        rig.tc.replaced["eth0"] = f"ifindex {9 + n}, was {8 + n}"
        rig.service.tick()
    drifts = [e.message for e in rig.events.recent(100) if e.kind == "net.drift"]
    assert len(drifts) == 3, drifts
    for n, d in enumerate(drifts):
        assert d.startswith(f"eth0: another netdev by that name (ifindex {9 + n}, was {8 + n}):")


@pytest.mark.parametrize(
    "then_active",
    [{"a"}, {"a", "b"}],  # the plan unchanged; a job started in that same tick
    ids=["plan_unchanged", "plan_moved"],
)
def test_a_netdev_made_again_between_two_ticks_is_named_so_not_as_a_change(
    rig: Rig, then_active: set[str]
) -> None:
    rig.active = {"a"}
    rig.service.tick()
    rig.service.tick()
    del rig.tc.states["eth0"]  # eth0 deleted and created again: a bare netdev, no tree
    rig.tc.replaced["eth0"] = "ifindex 9, was 4"
    rig.active = then_active
    rig.service.tick()
    (drift,) = [e for e in rig.events.recent(100) if e.kind == "net.drift"]
    assert drift.message.startswith(
        "eth0: another netdev by that name (ifindex 9, was 4): gpud's tree built on it again,"
    )
    assert "changed outside gpud" not in drift.message
    assert "net.interface" not in rig.kinds()
    assert rig.service.view().interfaces[0].repairs == 1
    assert rig.service.view().interfaces[0].enforced


def test_a_pass_whose_interface_failed_between_two_repairs_ends_the_tools_run(
    rig: Rig,
) -> None:
    """A repair, then a pass that cannot shape eth0 (its link says a speed out of
    range for a moment), then a repair: the second is said as one of its own, not as a
    tool that keeps changing the tree (the failed pass counts as a pass)."""
    rig.active = {"a", "b"}
    rig.service.tick()
    rig.service.tick()
    speed = rig.sysfs / "class" / "net" / "eth0" / "speed"
    del rig.tc.states["eth0"]
    rig.service.tick()  # pass N: repaired
    speed.write_text("4000000000\n")
    rig.service.tick()  # pass N+1: no rate to shape eth0 to, an interface error
    assert "set traffic.link_rates" in rig.service.view().interfaces[0].error
    speed.write_text("1000\n")
    del rig.tc.states["eth0"]
    rig.service.tick()  # pass N+2: repaired again
    assert rig.tc.states["eth0"].root is not None
    drifts = [e.message for e in rig.events.recent(100) if e.kind == "net.drift"]
    assert len(drifts) == 2, drifts
    assert all(d.startswith("eth0: restored ") for d in drifts), drifts


def test_a_netdev_seen_missing_then_made_again_is_enforced_again_not_drift(rig: Rig) -> None:
    rig.active = {"a"}
    rig.service.tick()
    rig.tc.missing.add("eth0")
    rig.service.tick()
    rig.tc.missing.discard("eth0")
    del rig.tc.states["eth0"]
    rig.tc.replaced["eth0"] = "ifindex 9, was 4"
    rig.active = {"a", "b"}
    rig.service.tick()
    assert "net.drift" not in rig.kinds()
    (back,) = [e for e in rig.events.recent(100) if e.kind == "net.interface"]
    assert back.message.startswith("eth0: enforced again")
    assert rig.service.view().interfaces[0].repairs == 0


def test_a_bad_interface_is_its_own_error(tmp_path: Path, sysfs: Path) -> None:
    rig = Rig(tmp_path, sysfs, link_rates=("veth0=400mbit",))
    rig.config = dataclasses.replace(rig.config, interfaces=("eth0", "veth0", "nope0"))
    rig.tc.missing.add("nope0")
    rig.service = rig.make()
    rig.service.tick()
    by_name = {i.name: i for i in rig.service.view().interfaces}
    assert by_name["eth0"].enforced and by_name["veth0"].enforced
    assert by_name["veth0"].rate_bps == 400_000_000
    assert not by_name["nope0"].enforced
    assert by_name["nope0"].error == "nope0: no such network interface"


def test_the_summary_for_gpuctl_status_waits_for_no_pass(tmp_path: Path, sysfs: Path) -> None:
    rig = Rig(tmp_path, sysfs)
    rig.config = dataclasses.replace(rig.config, interfaces=("eth0", "nope0"))
    rig.tc.missing.add("nope0")
    rig.service = s = rig.make()
    assert s.summary() == TrafficSummary(
        True, (LinkEnforcement("eth0", False), LinkEnforcement("nope0", False))
    )
    s.tick()
    summary: list[TrafficSummary] = []
    with s._lock:  # as a pass holds it while tc runs
        asked = threading.Thread(target=lambda: summary.append(s.summary()))
        asked.start()
        asked.join(timeout=5)
    assert summary == [
        TrafficSummary(
            True,
            (
                LinkEnforcement("eth0", True),
                LinkEnforcement("nope0", False, "nope0: no such network interface"),
            ),
        )
    ]


def test_a_link_that_loses_its_speed_keeps_its_last_rate(rig: Rig) -> None:
    """A NIC whose link goes down has no speed until it is up again: its tree stays at the
    rate it had, still checked for drift, and nothing is said of a rate."""
    rig.service.tick()
    (eth0,) = rig.service.view().interfaces
    assert eth0.enforced and eth0.rate_bps == 1_000_000_000
    (rig.sysfs / "class" / "net" / "eth0" / "speed").write_text("-1\n")  # link down
    del rig.tc.states["eth0"]  # and its root deleted meanwhile
    rig.service.tick()
    (eth0,) = rig.service.view().interfaces
    assert eth0.enforced and not eth0.error and eth0.rate_bps == 1_000_000_000
    assert eth0.repairs == 1 and "net.interface_error" not in rig.kinds()
    (rig.sysfs / "class" / "net" / "eth0" / "speed").write_text("100\n")  # up, slower
    rig.service.tick()
    (eth0,) = rig.service.view().interfaces
    assert eth0.enforced and eth0.rate_bps == 100_000_000
    top = next(
        c
        for c in rig.tc.states["eth0"].classes
        if c.classid == tcplan.handle(tcplan.ROOT_MAJOR, tcplan.TOP_MINOR)
    )
    assert top.rate_bps == 100_000_000


def test_a_netdev_made_again_under_the_name_is_not_shaped_at_the_old_ones_rate(
    rig: Rig,
) -> None:
    """The rate a link held while its speed is unknown is the same netdev's: a veth deleted
    and made again as eth0 (another ifindex) without a speed is not shaped at the rate the
    old eth0 had, and is said to have none; the one made again after it, with its speed,
    is shaped at that speed."""
    eth0 = rig.sysfs / "class" / "net" / "eth0"
    (eth0 / "ifindex").write_text("4\n")
    rig.service.tick()
    (status,) = rig.service.view().interfaces
    assert status.enforced and status.rate_bps == 1_000_000_000
    (eth0 / "ifindex").write_text("9\n")  # made again: up, but no speed
    (eth0 / "speed").write_text("-1\n")
    rig.service.tick()
    (status,) = rig.service.view().interfaces
    assert not status.enforced
    assert status.error == "eth0: link rate unknown (ethtool gives none): set traffic.link_rates"
    (eth0 / "speed").unlink()  # its link down too: still not the old netdev's rate
    (eth0 / "carrier").write_text("0\n")
    rig.service.tick()
    (status,) = rig.service.view().interfaces
    assert not status.enforced and "link down" in status.error
    (eth0 / "ifindex").write_text("12\n")  # and again, with a speed of its own
    (eth0 / "carrier").write_text("1\n")
    (eth0 / "speed").write_text("100\n")
    rig.service.tick()
    (status,) = rig.service.view().interfaces
    assert status.enforced and status.rate_bps == 100_000_000


def test_a_netdev_made_again_while_its_speed_is_read_gets_no_rate_held_for_the_old_one(
    rig: Rig,
) -> None:
    """eth0 deleted and made again (another ifindex, no speed) between gpud's read of its
    ifindex and of its speed: the new netdev is not shaped at the old one's rate; nor is a
    rate kept while the ifindex was not known held for the netdev found later."""
    answers: list[int | None] = []
    rig.service = rig.make(link_index=lambda iface: answers.pop(0))
    eth0 = rig.sysfs / "class" / "net" / "eth0"
    answers[:] = [4, 4]
    rig.service.tick()
    (status,) = rig.service.view().interfaces
    assert status.enforced and status.rate_bps == 1_000_000_000
    (eth0 / "speed").write_text("-1\n")  # the new netdev: up, no speed
    answers[:] = [4, 9, 9]  # the old one's index read before its speed, the new one's after
    rig.service.tick()
    (status,) = rig.service.view().interfaces
    assert not status.enforced
    assert status.error == "eth0: link rate unknown (ethtool gives none): set traffic.link_rates"
    # a speed kept while no ifindex was known, then a netdev on ifindex 12 without one
    (eth0 / "speed").write_text("100\n")
    answers[:] = [None, None, None]
    rig.service.tick()
    (status,) = rig.service.view().interfaces
    assert status.enforced and status.rate_bps == 100_000_000
    (eth0 / "speed").write_text("-1\n")
    answers[:] = [12, 12, 12]
    rig.service.tick()
    (status,) = rig.service.view().interfaces
    assert not status.enforced and "link rate unknown" in status.error


def test_a_link_down_at_start_is_named_down_and_enforced_once_it_is_up(rig: Rig) -> None:
    """A NIC without carrier when gpud starts (cable or switch port down) has no speed:
    that is said, rather than asking for traffic.link_rates, and the link's own speed is
    taken once it is up."""
    eth0 = rig.sysfs / "class" / "net" / "eth0"
    (eth0 / "speed").unlink()
    (eth0 / "carrier").write_text("0\n")
    rig.service.tick()
    (status,) = rig.service.view().interfaces
    assert not status.enforced
    assert status.error == (
        "eth0: link down (no carrier, or set down), so no speed to shape to: enforced once it is up"
        " (or set traffic.link_rates)"
    )
    (broke,) = [e for e in rig.events.recent(100) if e.kind == "net.interface_error"]
    assert broke.fields["interface"] == "eth0"
    (eth0 / "carrier").write_text("1\n")
    (eth0 / "speed").write_text("25000\n")
    rig.service.tick()
    (status,) = rig.service.view().interfaces
    assert status.enforced and status.rate_bps == 25_000_000_000
    assert "net.interface" in rig.kinds()
    (eth0 / "speed").unlink()  # down again: the rate it had holds
    (eth0 / "carrier").write_text("0\n")
    rig.service.tick()
    (status,) = rig.service.view().interfaces
    assert status.enforced and not status.error and status.rate_bps == 25_000_000_000


def test_sysfs_without_a_speed_asks_for_link_rates(tmp_path: Path, sysfs: Path) -> None:
    rig = Rig(tmp_path, sysfs)
    rig.config = dataclasses.replace(rig.config, interfaces=("veth0",))
    rig.service = rig.make()
    rig.service.tick()
    (iface,) = rig.service.view().interfaces
    assert "set traffic.link_rates" in iface.error


def test_an_absurd_speed_in_sysfs_is_that_interfaces_error(tmp_path: Path, sysfs: Path) -> None:
    (sysfs / "class" / "net" / "veth0" / "speed").write_text("4000000000\n")
    rig = Rig(tmp_path, sysfs)
    rig.config = dataclasses.replace(rig.config, interfaces=("eth0", "veth0"))
    rig.service = rig.make()
    rig.service.tick()
    eth0, veth0 = rig.service.view().interfaces
    assert eth0.enforced and not eth0.error
    assert not veth0.enforced
    assert "outside 8 kbit/s to 10 Tbit/s" in veth0.error and "4000000000 Mb/s" in veth0.error


def test_restart_adopts_the_kernels_levels(rig: Rig) -> None:
    feed(rig, "a", 1.0, 10, ideal=0.5)
    feed(rig, "b", 0.5, 10, ideal=0.5)
    rig.service.tick()
    before = {j.job: j.level for j in rig.service.local_report().jobs}
    rig.service = rig.make()  # kill -9 and start again: no progress known yet
    rig.active = {"a", "b"}
    rig.service.start()
    rig.service.tick()
    after = {j.job: j.level for j in rig.service.local_report().jobs}
    assert after["a"] == before["a"] and after["b"] == before["b"]
    assert "net.adopt" in rig.kinds()


def test_a_restart_keeps_the_levels_of_jobs_whose_rates_tie_once_they_report_again(
    rig: Rig,
) -> None:
    """b ran alone, then a came with b's rate: the hysteresis kept b on level 0. Started
    again, both report again at the same rate: a fresh ranking would break the tie by job
    id and swap them, a tc change on each; the local policy starts from the kernel's."""
    rig.jobs = ["a", "b"]
    rig.active = {"b"}
    done = {"a": 0, "b": 0}

    def run(*jobs: str) -> None:
        """Ten iterations of 0.5 s of each of ``jobs``, the last one now."""
        for _ in range(10):
            rig.clock.t += 0.5
            for job in jobs:
                done[job] += 1
                rig.service.report(Report(job, done[job], rig.clock.t, 0.4, "s"))

    run("b")
    rig.service.tick()
    run("a", "b")
    rig.active = {"a", "b"}
    rig.service.tick()
    assert {j.job: j.level for j in rig.service.local_report().jobs} == {"a": 1, "b": 0}
    tree = rig.tc.states["eth0"]
    rig.service = rig.make()
    rig.service.start()
    for _ in range(3):
        run("a", "b")
        rig.service.tick()
        assert rig.tc.states["eth0"] == tree
    assert {j.job: j.level for j in rig.service.local_report().jobs} == {"a": 1, "b": 0}
    assert rig.service.view().level_changes_total == 0


def test_the_first_tick_after_a_restart_says_what_it_kept_and_removed(rig: Rig) -> None:
    """A job gone while gpud was down: the first tick removes its tc leaf, filter and
    nftables rule, left by the previous run, and says so in one ``net.takeover`` event per
    interface and one for the nftables table, with counts."""
    rig.jobs = ["a", "b", "c"]
    rig.active = {"a", "b", "c"}
    for job in rig.jobs:
        (rig.cgroups.dir(job)).mkdir(parents=True)
    rig.service.tick()
    assert len(rig.marker.marks) == 3
    found = rig.tc.states["eth0"]
    objects = len(found.classes) + len(found.filters) + 1  # and the root
    rig.jobs = ["a", "b"]  # c's job ended while gpud was down
    rig.service = rig.make()
    rig.service.start()
    before = len(rig.events.recent(1000))
    rig.service.tick()
    said = [e for e in rig.events.recent(1000)[before:] if e.kind == "net.takeover"]
    tc, nft = sorted(said, key=lambda e: not e.fields["interface"])
    assert tc.fields["interface"] == "eth0"
    assert tc.fields["removed"] >= 2  # c's leaf and filter at least
    assert tc.fields["kept"] + tc.fields["removed"] == objects
    assert f"removed {tc.fields['removed']}" in tc.message
    # rules: one per job and family (ip, ip6)
    assert nft.fields == {"interface": "", "kept": 4, "removed": 2, "changed": 0, "added": 0}
    assert "nftables" in nft.message and "job=c" in nft.message  # the stale ones listed
    rig.service.tick()  # said once: the ticks after are drift's
    assert [e.kind for e in rig.events.recent(1000)].count("net.takeover") == len(said)


def _tc_takeover(
    rig: Rig, left: Callable[[tcplan.InterfaceState], tcplan.InterfaceState]
) -> dict[str, object]:
    """Jobs a, b and c shaped, gpud stopped, the kernel's tree changed by ``left``, job c
    gone meanwhile; the fields of the first tick's net.takeover for eth0, and its message."""
    rig.jobs = ["a", "b", "c"]
    rig.active = {"a", "b", "c"}
    for job in rig.jobs:
        rig.cgroups.dir(job).mkdir(parents=True, exist_ok=True)
    rig.service.tick()
    rig.tc.states["eth0"] = left(rig.tc.states["eth0"])
    rig.jobs = ["a", "b"]
    rig.service = rig.make()
    rig.service.start()
    rig.service.tick()
    (tc,) = [
        e for e in rig.events.recent(1000) if e.kind == "net.takeover" and e.fields["interface"]
    ]
    return {**tc.fields, "message": tc.message}


def test_a_takeover_counts_what_goes_with_a_class_or_with_one_filter_deletion(
    rig: Rig, sysfs: Path
) -> None:
    """Qdiscs someone attached under gpud's classes (removed with a gone job's class, or
    alone) and foreign filters (one deletion removes all of a priority): all counted as
    removed, none as kept."""
    plain = _tc_takeover(Rig(rig.tmp / "plain", sysfs), lambda state: state)

    added: list[int] = []

    def extras(state: tcplan.InterfaceState) -> tcplan.InterfaceState:
        added.append(len(state.classes) + 2)
        return dataclasses.replace(
            state,
            child_qdiscs=tuple(
                tcplan.ChildQdisc(c.classid, (0x20 + i) << 16, "fq_codel")
                for i, c in enumerate(state.classes)
            ),
            foreign_filters=((2, 0x0800, 0x800800), (2, 0x0800, 0x800801)),
        )

    more = _tc_takeover(rig, extras)
    assert more["kept"] == plain["kept"]
    assert more["removed"] == plain["removed"] + added[0]  # type: ignore[operator]


def test_a_takeover_that_rebuilds_the_tree_kept_nothing(rig: Rig) -> None:
    """gpud's root found with another default class: the tree is deleted and built again,
    so nothing of it was kept (not "kept all but the root")."""

    def other_default(state: tcplan.InterfaceState) -> tcplan.InterfaceState:
        assert state.root is not None
        root = dataclasses.replace(state.root, default_classid=(state.root.handle | 0xFFF))
        return dataclasses.replace(state, root=root)

    said = _tc_takeover(rig, other_default)
    found = said["kept"] + said["removed"]  # type: ignore[operator]
    assert said["kept"] == 0 and said["removed"] == found and found > 2
    assert f"kept 0 of {found} object(s), removed {found} (the tree rebuilt)" in str(
        said["message"]
    )


def test_the_nftables_takeover_counts_rules_of_kept_gone_and_new_jobs(rig: Rig) -> None:
    """Two jobs kept, one gone and two new since the run before: counted in rules, one per
    job and family, never jobs against rules (which read "kept -1")."""
    rig.jobs = ["a", "b", "c"]
    rig.active = {"a", "b", "c"}
    for job in rig.jobs:
        rig.cgroups.dir(job).mkdir(parents=True)
    rig.service.tick()
    rig.jobs = ["a", "b", "d", "e"]
    rig.active = {"a", "b", "d", "e"}
    rig.service = rig.make()
    rig.service.start()
    for job in ("d", "e"):  # their runs tag them and make their cgroups
        rig.service.tags.tag(job)
        rig.cgroups.dir(job).mkdir(parents=True)
    rig.service.tick()
    (nft,) = [
        e for e in rig.events.recent(1000) if e.kind == "net.takeover" and not e.fields["interface"]
    ]
    assert nft.fields == {"interface": "", "kept": 4, "removed": 2, "changed": 0, "added": 4}
    assert "kept 4 rule(s), removed 2 stale (gpud job=c " in nft.message
    assert nft.message.endswith(", added 4")


def test_a_first_start_adopts_nothing_and_says_nothing(rig: Rig) -> None:
    rig.active = {"a"}
    rig.service.start()
    rig.service.tick()
    assert "net.takeover" not in rig.kinds()


def test_counters_survive_a_leaf_moving(rig: Rig) -> None:
    rig.active = {"a"}
    rig.service.tick()
    tags = rig.service.tags.allocations()
    leaf = next(
        c.classid
        for c in rig.tc.states["eth0"].classes
        if (p := tcplan.parse_leaf(c.classid)) and p[1] == tags["a"]
    )
    rig.tc.sent[("eth0", leaf)] = FakeCounters(1000, 10, 1)
    rig.service.tick()
    rig.service.pin("a", 2)  # the leaf is recreated under level 2: its counters restart
    rig.service.tick()
    moved = next(
        c.classid
        for c in rig.tc.states["eth0"].classes
        if (p := tcplan.parse_leaf(c.classid)) and p[1] == tags["a"]
    )
    rig.tc.sent[("eth0", moved)] = FakeCounters(500, 5, 0)
    rig.service.tick()
    (a,) = [j for j in rig.service.local_report().jobs if j.job == "a"]
    assert (a.counters.bytes, a.counters.packets, a.counters.drops) == (1500, 15, 1)
    view = rig.service.view()
    assert view.level_counters[2].bytes == 500  # the 1000 before were sent at its old level


def _level_bytes(rig: Rig) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(Collector(lambda: None, sources=[TrafficMetrics(rig.service)], build="x"))
    return {
        s.labels["level"]: s.value
        for m in registry.collect()
        if m.name == "gpud_net_level_sent_bytes"
        for s in m.samples
    }


def test_a_level_keeps_the_bytes_sent_at_it_when_its_jobs_move_off_or_go(rig: Rig) -> None:
    rig.active = {"a", "b"}
    rig.service.pin("a", 1)
    rig.service.pin("b", 1)
    rig.service.tick()
    rig.tc.sent[("eth0", _leaf(rig, "a").classid)] = FakeCounters(1000, 10, 0)
    rig.tc.sent[("eth0", _leaf(rig, "b").classid)] = FakeCounters(2000, 20, 0)
    rig.service.tick()
    assert _level_bytes(rig)["1"] == 3000
    rig.service.pin("a", 2)  # a moves to level 2: what it sent at level 1 stays counted there
    rig.service.tick()
    rig.tc.sent[("eth0", _leaf(rig, "a").classid)] = FakeCounters(1500, 15, 0)
    rig.service.tick()
    after_move = _level_bytes(rig)
    assert (after_move["1"], after_move["2"]) == (3000, 500)
    rig.jobs.remove("b")  # b goes, and its tag with it: level 1 keeps its bytes
    rig.active = {"a"}
    rig.service.tick()
    assert "b" not in [j.job for j in rig.service.view().jobs]
    assert _level_bytes(rig) == {"0": 0, "1": 3000, "2": 500, "3": 0}


def _sent(rig: Rig, job: str) -> tuple[int, int, int]:
    (row,) = [j for j in rig.service.view().jobs if j.job == job]
    return (row.counters.bytes, row.counters.packets, row.counters.drops)


@pytest.mark.parametrize("b_goes", ["idle", "removed"])
def test_a_class_handed_to_another_job_adds_nothing_it_sent_before(
    tmp_path: Path, sysfs: Path, b_goes: str
) -> None:
    """A job's leaf is named by its home level and tag: a tag handed to another job at the
    same home level keeps the class, and the kernel's counters carry on. The job taking it
    starts from the class's reading then: neither its level nor its own counters count
    again what the job before sent."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-11")
    s = rig.service
    rig.active = {"a", "b", "c"}
    s.tick()
    assert set(s.view().untagged) == {"c"}
    leaf = _leaf(rig, "b").classid
    rig.tc.sent[("eth0", leaf)] = FakeCounters(1000, 10, 0)
    s.tick()
    before = _level_bytes(rig)
    assert sum(before.values()) == 1000
    if b_goes == "idle":
        rig.active = {"a", "c"}
        rig.clock.t += rig.config.idle_after_s + 1
    else:
        rig.jobs.remove("b")  # its tag freed and handed on in the same pass
    s.tick()
    assert _leaf(rig, "c").classid == leaf  # the kernel's class, and its counters, stay
    assert _level_bytes(rig) == before
    assert _sent(rig, "c") == (0, 0, 0)
    rig.tc.sent[("eth0", leaf)] = FakeCounters(1300, 13, 0)
    s.tick()
    assert _sent(rig, "c") == (300, 3, 0)
    assert sum(_level_bytes(rig).values()) == 1300


def _a_sent_at_level_1(rig: Rig, drops: int) -> int:
    """Job a pinned to level 1, its leaf's 1000 bytes (10 packets) counted there: the
    leaf's classid."""
    rig.active = {"a"}
    rig.service.pin("a", 1)
    rig.service.tick()
    leaf = _leaf(rig, "a").classid
    rig.tc.sent[("eth0", leaf)] = FakeCounters(1000, 10, drops)
    rig.service.tick()
    assert _level_bytes(rig)["1"] == 1000
    return leaf


def test_a_restart_counts_from_the_kernels_reading_at_its_first_pass(rig: Rig) -> None:
    """The leaves a run before left are adopted with the counts they carry: the level and
    job counters say what was sent since gpud started, so what the run before counted is
    not counted again."""
    leaf = _a_sent_at_level_1(rig, drops=1)
    rig.service = rig.make()  # gpud restarts: the tree stays
    rig.service.start()
    rig.service.tick()
    assert _leaf(rig, "a").classid == leaf
    assert sum(_level_bytes(rig).values()) == 0
    assert _sent(rig, "a") == (0, 0, 0)
    rig.tc.sent[("eth0", leaf)] = FakeCounters(1200, 12, 1)
    rig.service.tick()
    assert _level_bytes(rig)["1"] == 200
    assert _sent(rig, "a") == (200, 2, 0)


def _leaf_moved(
    state: tcplan.InterfaceState, dscp: int, home: int, *, keep: bool = False
) -> tcplan.InterfaceState:
    """``state`` with the leaf of tag ``dscp`` under level class ``home`` and its filters
    pointing there, as a sync moving it leaves it; ``keep``: the old leaf still there too
    (the sync cut short before its delete)."""
    leaf = tcplan.leaf_classid(home, dscp)
    classes = [*state.classes]
    for c in state.classes:
        if (p := tcplan.parse_leaf(c.classid)) and p[1] == dscp:
            if not keep:
                classes.remove(c)
            classes.append(dataclasses.replace(c, classid=leaf, parent=tcplan.level_classid(home)))
    filters = tuple(
        (h, dataclasses.replace(f, flowid=leaf) if f.dscp == dscp else f) for h, f in state.filters
    )
    return dataclasses.replace(
        state, classes=tuple(sorted(classes, key=lambda c: c.classid)), filters=filters
    )


def _a_under_two_homes(tmp_path: Path, sysfs: Path) -> tuple[Rig, int]:
    """Job a pinned at level 1 on eth0 and eth1, its leaf on eth1 then moved under level
    class 3 (on eth0 still under 1): the rig, and a's tag."""
    rig = Rig(tmp_path, sysfs, link_rates=("eth1=1gbit",), interfaces=("eth0", "eth1"))
    rig.active = {"a"}
    rig.service.pin("a", 1)
    rig.service.tick()
    dscp = rig.service.tags.allocations()["a"]
    rig.tc.states["eth1"] = _leaf_moved(rig.tc.states["eth1"], dscp, 3)
    return rig, dscp


def test_a_job_left_under_two_homes_by_a_sync_cut_short_keeps_each_leaf_and_its_counts(
    tmp_path: Path, sysfs: Path
) -> None:
    """gpud killed -9 in a sync that moved job a's leaf: on eth1 it sits under level
    class 3, on eth0 still under 1. The start reads each interface's home, so the first
    pass moves neither leaf (no packet of a's queue dropped) and counts each from it."""
    rig, dscp = _a_under_two_homes(tmp_path, sysfs)
    kernel = dict(rig.tc.states)
    at_home = {"eth0": tcplan.leaf_classid(1, dscp), "eth1": tcplan.leaf_classid(3, dscp)}
    for iface, leaf in at_home.items():
        rig.tc.sent[(iface, leaf)] = FakeCounters(1000, 10, 0)
    rig.service = rig.make()  # gpud restarts: the tree stays
    rig.service.start()
    rig.service.tick()
    assert rig.tc.states == kernel
    assert _sent(rig, "a") == (0, 0, 0)
    for iface, leaf in at_home.items():
        rig.tc.sent[(iface, leaf)] = FakeCounters(1300, 13, 0)
    rig.service.tick()
    assert _sent(rig, "a") == (600, 6, 0)
    assert _level_bytes(rig)["1"] == 600


def test_an_interface_read_after_the_start_keeps_the_level_class_its_leaf_has_there(
    tmp_path: Path, sysfs: Path
) -> None:
    """eth1 cannot be read at the start (its adopt fails), its leaf of job a under level
    class 3 while eth0's is under 1: read before its first pass, it keeps its own."""
    rig, _ = _a_under_two_homes(tmp_path, sysfs)
    kernel = dict(rig.tc.states)
    rig.service = rig.make()
    rig.tc.missing.add("eth1")
    rig.service.start()
    rig.service.tick()
    rig.tc.missing.clear()
    rig.service.tick()
    assert rig.tc.states == kernel


def _a_left_twice_restarted(rig: Rig, *, ipv6_at_old: bool = False) -> int:
    """Job a pinned at level 1 on eth0, its leaf then moved from level class 3 to 1 by a
    sync cut short before the old leaf was deleted (``ipv6_at_old``: cut between the two
    filter changes, the IPv6 filter still at the old leaf); gpud restarted and one pass
    run. a's tag."""
    rig.active = {"a"}
    rig.service.pin("a", 1)
    rig.service.tick()
    dscp = rig.service.tags.allocations()["a"]
    state = _leaf_moved(_leaf_moved(rig.tc.states["eth0"], dscp, 3), dscp, 1, keep=True)
    if ipv6_at_old:
        old = tcplan.leaf_classid(3, dscp)
        state = dataclasses.replace(
            state,
            filters=tuple(
                (h, dataclasses.replace(f, flowid=old) if f.family is tcplan.Family.IPV6 else f)
                for h, f in state.filters
            ),
        )
    rig.tc.states["eth0"] = state
    rig.service = rig.make()
    rig.service.start()
    rig.service.tick()
    return dscp


def _only_leaf_and_aim(rig: Rig) -> tuple[list[int], set[int]]:
    """eth0's job leaves, and the leaves its filters point to."""
    state = rig.tc.states["eth0"]
    return [c.classid for c in state.classes if c.job], {f.flowid for _, f in state.filters}


def test_a_leaf_left_twice_on_an_interface_keeps_the_one_its_filters_point_to(
    rig: Rig,
) -> None:
    """A sync moving job a's leaf from level class 3 to 1 cut short after its filters were
    pointed at the new leaf, before the old one was deleted: the start takes the one the
    packets go to, and the first pass deletes the other, moving no packet back."""
    dscp = _a_left_twice_restarted(rig)
    new = tcplan.leaf_classid(1, dscp)
    assert _only_leaf_and_aim(rig) == ([new], {new})


def test_a_leaf_left_twice_with_its_filters_split_keeps_the_one_its_ipv4_filter_points_to(
    rig: Rig,
) -> None:
    """The sync cut short between its two filter changes: the IPv4 filter at the new leaf
    (under level class 1), the IPv6 one still at the old (under 3, the higher classid).
    The planner re-points IPv4 first, so the IPv4 filter's leaf is the one the sync was
    moving to: the first pass keeps it, points IPv6 there too and deletes the old one."""
    dscp = _a_left_twice_restarted(rig, ipv6_at_old=True)
    new = tcplan.leaf_classid(1, dscp)
    assert _only_leaf_and_aim(rig) == ([new], {new})


@dataclasses.dataclass
class UnreadTc(FakeTc):
    """The next ``unread`` counter reads fail; the next one leaves out the ``cut`` classes
    (a dump cut short)."""

    unread: int = 0
    cut: set[int] = dataclasses.field(default_factory=set)

    def counters(self, iface: str) -> Mapping[int, FakeCounters]:
        if self.unread:
            self.unread -= 1
            raise OSError(105, f"{iface}: cannot read tc state: ENOBUFS")
        read = super().counters(iface)
        cut, self.cut = self.cut, set()
        return {cid: c for cid, c in read.items() if cid not in cut}


def test_a_class_a_read_left_out_counts_from_its_reading_before(rig: Rig) -> None:
    rig.tc = UnreadTc()
    rig.service = rig.make()
    leaf = _a_sent_at_level_1(rig, drops=0)
    rig.tc.cut = {leaf}
    rig.service.tick()
    rig.tc.sent[("eth0", leaf)] = FakeCounters(1100, 11, 0)
    rig.service.tick()
    assert _sent(rig, "a") == (1100, 11, 0)
    assert _level_bytes(rig)["1"] == 1100


def test_a_tree_built_on_a_netdev_made_again_counts_its_classes_from_0(rig: Rig) -> None:
    leaf = _a_sent_at_level_1(rig, drops=0)
    _made_again(rig)
    rig.tc.sent[("eth0", leaf)] = FakeCounters(5000, 50, 0)  # the new class's, since made
    rig.service.tick()
    assert _leaf(rig, "a").classid == leaf
    assert _sent(rig, "a") == (6000, 60, 0)  # not less the old class's 1000


def test_a_tree_adopted_then_built_again_counts_its_first_read_whole(rig: Rig) -> None:
    leaf = _a_sent_at_level_1(rig, drops=0)
    rig.tc = UnreadTc(states=dict(rig.tc.states), sent=dict(rig.tc.sent))
    rig.service = rig.make()  # kill -9 and start again: gpud's tree adopted
    rig.service.start()
    _made_again(rig)  # before the first pass, which builds the tree again
    rig.tc.unread = 1  # and cannot read it
    rig.service.tick()
    rig.tc.sent[("eth0", leaf)] = FakeCounters(5000, 50, 0)
    rig.service.tick()
    assert _sent(rig, "a") == (5000, 50, 0)  # not taken as the baseline of the old tree's


def test_what_is_sent_while_an_interface_fails_counts_at_the_level_the_kernel_had(
    rig: Rig,
) -> None:
    """A pass that cannot enforce an interface leaves the kernel at the levels last
    enforced there: what the leaves send meanwhile is counted at those, not at the levels
    of the plan that was not put in place."""
    leaf = _a_sent_at_level_1(rig, drops=0)
    rig.tc.missing.add("eth0")  # the level change below is not put in place
    rig.service.pin("a", 2)
    rig.service.tick()
    assert rig.service.view().interfaces[0].error
    rig.tc.sent[("eth0", leaf)] = FakeCounters(1500, 15, 0)  # sent at level 1 meanwhile
    rig.tc.missing.discard("eth0")
    rig.service.tick()  # enforces level 2 (in place), then reads
    assert _leaf(rig, "a").classid == leaf
    assert (_level_bytes(rig)["1"], _level_bytes(rig)["2"]) == (1500, 0)
    rig.tc.sent[("eth0", leaf)] = FakeCounters(1800, 18, 0)
    rig.service.tick()
    assert (_level_bytes(rig)["1"], _level_bytes(rig)["2"]) == (1500, 300)


def test_a_node_with_traffic_off_takes_no_tags_from_the_cluster(
    tmp_path: Path, sysfs: Path
) -> None:
    """The leader tags every job that holds GPUs, on any node; where traffic is off
    nothing here marks or shapes by tag, so the order's tags are not kept and no
    ``net.retag`` says a job was tagged (one each run, on a node the operator turned off)."""
    rig = Rig(tmp_path, sysfs, enabled=False)
    result = rig.service.apply_order(3, {"a": 1}, tags={"a": 10, "b": 11})
    assert result.applied and result.retagged == ()
    assert rig.service.tags.allocations() == {}
    assert [e for e in rig.events.recent(100) if e.kind == "net.retag"] == []
    assert rig.service.local_report().epoch == 3


def test_cluster_order_is_fenced_by_epoch(rig: Rig) -> None:
    rig.active = {"a", "b"}
    rig.service.tick()
    assert rig.service.apply_order(5, {"a": 3, "b": 0}).applied
    rig.service.tick()
    assert {j.job: j.level for j in rig.service.local_report().jobs if j.level is not None} == {
        "a": 3,
        "b": 0,
    }
    assert rig.service.local_report().epoch == 5
    stale = rig.service.apply_order(4, {"a": 0})
    assert not stale.applied and "stale epoch" in stale.reason
    assert not rig.service.apply_order(6, {"a": 99}).applied
    tags = rig.service.tags.allocations()
    free = next(d for d in rig.service.tags.pool if d not in tags.values())
    result = rig.service.apply_order(6, {"a": 1}, tags={"a": free})
    assert result.applied and result.retagged == ("a",)
    # b, idle here, is not in the order: the DSCP it holds goes to a, and b is tagged anew
    b_had = rig.service.tags.allocations()["b"]
    result = rig.service.apply_order(7, {"a": 1}, tags={"a": b_had})
    assert result.applied and result.retagged == ("a", "b"), result.reason
    now = rig.service.tags.allocations()
    assert now["a"] == b_had and "b" not in now
    # each retag event carries the DSCP the job has now, as net.tag does (none: gave it up)
    retags = [e for e in rig.events.recent(100) if e.kind == "net.retag"][-2:]
    assert [(e.fields["job"], e.fields["dscp"]) for e in retags] == [("a", b_had), ("b", None)]
    rig.service.tick()
    again = rig.service.tags.allocations()
    assert again["a"] == b_had and again["b"] not in (b_had, None)
    assert not rig.service.apply_order(8, {"a": 1, "b": 0}, tags={"a": free, "b": free}).applied
    rig.service.clear_order()
    rig.service.tick()
    assert rig.service.local_report().epoch == 0
    # the epochs started again lower (etcd went back): the cluster says so, and it holds
    assert rig.service.apply_order(2, {"a": 2}, restart=True).applied
    assert rig.service.local_report().epoch == 2
    assert not rig.service.apply_order(1, {"a": 0}).applied


class _OneNodeCluster:
    """gpud's loop on one node leading its own cluster: the traffic pass, then the cluster
    agent's tick, every half second, job ``a-train`` reporting progress while ``reporting``
    (``runner`` never does: a reservation with no known rate)."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.clock = AgentClock()
        self.peers = LoopbackPeers()
        self.iterations = 0
        self.reporting = True
        self.trees: list[tcplan.InterfaceState] = []  # eth0's tree after each pass
        self.node = self.lead(1)

    def lead(self, epoch: int) -> ClusterAgent:
        leader = LeaderInfo("n1", "127.0.0.1:7070", epoch, True)
        node = agent("n1", leader, self.rig.service, self.peers, self.clock, settle_s=1.0)
        self.peers.leader = node
        return node

    async def passes(self, n: int) -> None:
        for _ in range(n):
            self.rig.clock.t += 0.5
            self.clock.now += 0.5
            if self.reporting:
                self.iterations += 1
                report = Report("a-train", self.iterations, self.rig.clock.t, 0.4, session="s")
                self.rig.service.report(report)
            self.rig.service.tick()
            self.trees.append(self.rig.tc.states["eth0"])
            await self.node.tick()

    def restart(self, epoch: int) -> None:
        """kill -9 and start again: the tree adopted, no progress known, a new leadership."""
        self.rig.service = self.rig.make()
        self.rig.service.start()
        self.node = self.lead(epoch)


async def test_a_restart_under_the_cluster_moves_no_level_of_a_job_whose_rate_is_unknown(
    rig: Rig,
) -> None:
    """Before the restart runner (no rate: the top) is on level 0 and a-train on level 1.
    Started again, a-train's reports come back a few passes late: the new leadership's
    first order, ranked afresh, would tie the two unknown rates by job id (a-train 0,
    runner 1), then swap them back once a-train's rate is known -- two tc changes on each
    live job. The levels found in the kernel are what the new leader starts from."""
    rig.jobs = ["a-train", "runner"]
    rig.active = {"a-train", "runner"}
    cluster = _OneNodeCluster(rig)
    await cluster.passes(30)
    assert {j.job: j.level for j in rig.service.local_report().jobs} == {
        "a-train": 1,
        "runner": 0,
    }
    tree = rig.tc.states["eth0"]
    said = len(rig.events.recent(1000))
    cluster.trees = []
    cluster.restart(2)
    cluster.reporting = False
    await cluster.passes(4)  # past the new leader's settle time: its first order is in force
    assert rig.service.local_report().epoch == 2
    cluster.reporting = True
    await cluster.passes(10)
    assert rig.service.view().level_changes_total == 0
    assert [e for e in rig.events.recent(1000)[said:] if e.kind == "net.levels"] == []
    assert all(t == tree for t in cluster.trees)  # no class of the tree moved, ever
    assert {j.job: j.level for j in rig.service.local_report().jobs} == {
        "a-train": 1,
        "runner": 0,
    }


def test_the_levels_found_in_the_kernel_are_reported_until_the_first_order(rig: Rig) -> None:
    rig.active = {"a", "b"}
    rig.service.tick()
    assert rig.service.apply_order(1, {"a": 1, "b": 0}).applied
    rig.service.tick()
    assert rig.service.local_report().adopted == {}  # an order in force: it says the levels
    rig.service = rig.make()
    rig.service.start()
    assert rig.service.local_report().adopted == {"a": 1, "b": 0}
    rig.service.tick()
    assert rig.service.local_report().adopted == {"a": 1, "b": 0}
    assert rig.service.apply_order(2, {"a": 0, "b": 1}).applied
    rig.service.tick()
    assert rig.service.local_report().adopted == {}
    rig.service.clear_order()  # the local policy decides: not the run before's order
    assert rig.service.local_report().adopted == {}


def test_a_job_whose_interfaces_disagree_at_start_keeps_its_highest_priority_level(
    tmp_path: Path, sysfs: Path
) -> None:
    """kill -9 between two interfaces' syncs of a new order: eth0 holds the new levels,
    eth1 the old ones. The start keeps each job's highest priority (lowest level) of the
    two, whichever interface is read last, and says which jobs disagreed."""
    (sysfs / "class" / "net" / "eth1").mkdir()
    (sysfs / "class" / "net" / "eth1" / "speed").write_text("1000\n")
    rig = Rig(tmp_path, sysfs, interfaces=("eth0", "eth1"))
    rig.jobs = ["a", "b"]
    rig.active = {"a", "b"}
    assert rig.service.apply_order(1, {"a": 1, "b": 0}).applied
    rig.service.tick()
    old = rig.tc.states["eth1"]
    assert rig.service.apply_order(2, {"a": 0, "b": 1}).applied
    rig.service.tick()
    rig.tc.states["eth1"] = old  # eth0 synced to the new order, eth1 not yet
    rig.service = rig.make()
    rig.service.start()
    assert rig.service.local_report().adopted == {"a": 0, "b": 0}
    assert {j.job: j.level for j in rig.service.local_report().jobs} == {"a": 0, "b": 0}
    said = [e.message for e in rig.events.recent(1000) if e.kind == "net.adopt"]
    assert said == [
        "adopted the levels of 2 job(s) from the kernel; a's interfaces held different"
        " levels: 0 kept; b's interfaces held different levels: 0 kept"
    ]


def test_marks_follow_job_cgroups(rig: Rig) -> None:
    (rig.tmp / "proc" / "4242").mkdir(parents=True)
    (rig.tmp / "proc" / "4242" / "environ").write_bytes(b"A=1\0GPUD_JOB=a\0")
    (rig.tmp / "proc" / "4343").mkdir(parents=True)
    (rig.tmp / "proc" / "4343" / "environ").write_bytes(b"GPUD_JOB=b\0")
    # a fake cgroup tree: writing cgroup.procs is a plain file write here
    path = rig.service.place("a", 4242)
    assert path.endswith("unified/gpud/gpud-job-a")
    with pytest.raises(PermissionDenied, match="not started for job 'a'"):
        rig.service.place("a", 4343)
    (mark,) = rig.marker.marks
    assert mark.job == "a" and mark.path == "unified/gpud/gpud-job-a" and mark.level == 2
    assert mark.dscp == rig.service.tags.allocations()["a"]
    # nft failing: the process is placed all the same, and the caller told it is unmarked
    rig.marker.fail = "nft: simulated failure"
    with pytest.raises(FailedPrecondition, match="nft: simulated failure") as info:
        rig.service.place("a", 4242)
    assert "the process is in " in str(info.value) and "gpud-job-a" in str(info.value)
    assert (rig.cgroups.dir("a") / "cgroup.procs").read_text() == "4242\n"
    rig.marker.fail = ""
    rig.service.tick()
    (mark,) = rig.marker.marks
    rig.jobs.remove("a")
    (rig.cgroups.dir("a") / "cgroup.procs").unlink()  # an empty cgroup can be removed
    rig.service.tick()
    assert not rig.marker.marks and not rig.cgroups.dir("a").exists()


def test_a_process_numbered_by_a_containers_pid_namespace_is_placed_as_gpud_sees_it(
    rig: Rig,
) -> None:
    """``gpuctl run`` in a container asks for its command, PID 2 there, host PID 4343:
    that one goes into the job's cgroup, not host PID 2; one gpud cannot see is refused."""
    from tests.unit.test_pidns import BOX, HOST, fake_process

    proc = rig.tmp / "proc"
    fake_process(proc, "self", HOST)
    fake_process(proc, 2, HOST)  # a host process of no job
    fake_process(proc, 4343, BOX, 2)
    (proc / "4343" / "environ").write_bytes(b"GPUD_JOB=a\0")
    path = rig.service.place("a", 2, BOX)
    assert path == str(rig.cgroups.dir("a"))
    assert (rig.cgroups.dir("a") / "cgroup.procs").read_text() == "4343\n"
    with pytest.raises(FailedPrecondition, match=r"pid: no process 3 of PID namespace pid:\["):
        rig.service.place("a", 3, BOX)


def test_marking_failure_is_reported_not_fatal(rig: Rig) -> None:
    rig.marker.fail = "nft not found (install the nftables package)"
    rig.cgroups.ensure("a")
    rig.service.tick()
    view = rig.service.view()
    assert "nft not found" in view.marking_error
    assert view.interfaces[0].enforced
    rig.service.tick()  # still failing, the same error: one event
    rig.marker.fail = ""
    rig.service.tick()
    rig.service.tick()
    assert rig.service.view().marking_error == ""
    marking = [e for e in rig.events.recent(100) if e.kind.startswith("net.marking")]
    assert [(e.kind, e.message) for e in marking] == [
        ("net.marking_error", "nftables: nft not found (install the nftables package)"),
        (
            "net.marking",
            "nftables marking in force again (was: nftables: nft not found (install the"
            " nftables package))",
        ),
    ]


def test_a_ruleset_flushed_while_jobs_are_marked_is_written_again_and_said_so(rig: Rig) -> None:
    """A firewall reload runs ``nft flush ruleset`` while jobs a and b are marked: the next
    pass writes gpud's table again and says it was removed outside gpud, in one event."""
    rig.active = {"a", "b"}
    for job in ("a", "b"):
        rig.cgroups.ensure(job)
    rig.service.tick()
    rig.service.tick()
    assert len(rig.marker.marks) == 2
    rig.marker.table, rig.marker.marks = False, set()  # nft flush ruleset
    rig.service.tick()
    assert len(rig.marker.marks) == 2
    marking = [e.message for e in rig.events.recent(100, "net.marking")]
    assert marking[-1] == (
        "nftables: table inet gpud removed outside gpud (nft flush ruleset, a firewall"
        " reload?): written again, 4 rule(s): the jobs' packets went unmarked until this"
        " pass"
    )
    rig.service.tick()
    assert len(rig.events.recent(100, "net.marking")) == len(marking)


def test_net_show_counts_the_marking_tables_written_again(rig: Rig) -> None:
    """``gpuctl net show --json`` carries each restore of gpud's table (what
    ``gpud_net_marking_restores_total`` counts), so the operator sees a ruleset flushed
    while the marking reads ok again."""
    rig.active = {"a"}
    rig.cgroups.ensure("a")
    rig.service.tick()
    assert show_message(rig.service.view(), rig.clock.t).marking_restores == 0
    for _ in range(3):
        rig.marker.table, rig.marker.marks = False, set()  # nft flush ruleset
        rig.service.tick()
    shown = show_message(rig.service.view(), rig.clock.t)
    assert (shown.marking_restores, shown.marking_error) == (3, "")


def test_a_ruleset_flushed_on_every_tick_is_restored_each_time_and_said_once_a_minute(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """A firewall that flushes the whole ruleset before every pass: each pass writes
    gpud's table again, and each restore is counted (``gpud_net_marking_restores_total``),
    but the event log says the first at once, then how many followed at most once a
    minute, and nothing once the flushing has stopped and been said."""
    rig.active = {"a", "b"}
    for job in ("a", "b"):
        rig.cgroups.ensure(job)
    rig.service.tick()
    rig.service.tick()
    restored = 0

    def flushed_pass() -> None:
        nonlocal restored
        rig.marker.table, rig.marker.marks = False, set()  # nft flush ruleset
        rig.clock.t += 1.0
        rig.service.tick()
        assert len(rig.marker.marks) == 2  # written again on this very pass
        restored += 1

    def said() -> list[tuple[str, object]]:
        return [
            (e.message, e.fields.get("restores"))
            for e in rig.events.recent(1000, "net.marking")
            if "removed outside gpud" in e.message
        ]

    with caplog.at_level("WARNING"):
        for _ in range(60):
            flushed_pass()
    assert said() == [
        (
            "nftables: table inet gpud removed outside gpud (nft flush ruleset, a firewall"
            " reload?): written again, 4 rule(s): the jobs' packets went unmarked until this"
            " pass",
            1,
        )
    ]
    assert len([r for r in caplog.records if "removed outside gpud" in r.getMessage()]) == 1
    flushed_pass()  # a minute after the first was said: the 60 since, in one event
    assert said()[1:] == [
        (
            "nftables: table inet gpud removed outside gpud again, 60 time(s) in the last 60 s"
            " (a firewall flushing the ruleset on a timer?): written again on each pass that"
            " found it gone, the last with 4 rule(s): the jobs' packets went unmarked until"
            " each; said at most once every 60 s while it goes on"
            " (gpud_net_marking_restores_total counts each)",
            60,
        )
    ]
    for _ in range(10):
        flushed_pass()
    assert rig.service.view().marking_restores == restored == 71
    assert _samples(rig.service).get_sample_value("gpud_net_marking_restores_total") == 71
    for _ in range(120):  # the firewall stopped: the last 10 said a minute after the event
        rig.clock.t += 1.0
        rig.service.tick()
    assert [n for _, n in said()] == [1, 60, 10]
    flushed_pass()  # a flush over a minute after that: said at once, as a first
    assert [n for _, n in said()] == [1, 60, 10, 1]


def _flush_and_tick(rig: Rig, times: int) -> None:
    """``nft flush ruleset`` before each of ``times`` passes, a second apart."""
    for _ in range(times):
        rig.marker.table, rig.marker.marks = False, set()
        rig.clock.t += 1.0
        rig.service.tick()


def _marking_said(rig: Rig) -> list[tuple[str, object]]:
    return [
        (e.kind, e.fields.get("restores"))
        for e in rig.events.recent(1000, "net.marking")
        if e.kind == "net.marking_error" or "removed outside gpud" in e.message
    ]


def test_restores_held_within_the_minute_are_said_before_nft_fails(rig: Rig) -> None:
    """A firewall flushing the ruleset, then ``nft`` failing: the restores held within the
    minute are said as soon as it fails, before its ``net.marking_error``, not after the
    error and its "in force again" (reading as a flush after it), nor never while nft
    stays broken."""
    rig.active = {"a"}
    rig.cgroups.ensure("a")
    rig.service.tick()
    rig.service.tick()
    _flush_and_tick(rig, 5)  # the first said, 4 held
    rig.marker.fail = "nft: simulated failure"
    rig.clock.t += 1.0
    rig.service.tick()
    assert _marking_said(rig) == [
        ("net.marking", 1),
        ("net.marking", 4),
        ("net.marking_error", None),
    ]
    for _ in range(120):  # broken for minutes: nothing more to say
        rig.clock.t += 1.0
        rig.service.tick()
    rig.marker.fail = ""
    rig.clock.t += 1.0
    rig.service.tick()
    assert len(_marking_said(rig)) == 3
    assert rig.service.view().marking_restores == 5


def test_restores_held_within_the_minute_are_said_at_the_stop(rig: Rig) -> None:
    """Restores of gpud's table made within the minute after the last said one are said
    at gpud's stop, with their count, not lost with it."""
    rig.active = {"a"}
    rig.cgroups.ensure("a")
    rig.service.tick()
    rig.service.tick()
    _flush_and_tick(rig, 3)
    rig.service.shutdown()
    assert _marking_said(rig) == [("net.marking", 1), ("net.marking", 2)]
    rig.service.shutdown()  # nothing held any more: nothing said twice
    assert len(_marking_said(rig)) == 2


def test_a_ruleset_flushed_while_no_job_is_marked_is_said_without_unmarked_packets(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """``nft flush ruleset`` while no job is marked: the table is written again and said,
    but no packet went unmarked, so neither the message nor a warning says so."""
    rig.service.tick()
    rig.service.tick()
    assert not rig.marker.marks
    rig.marker.table = False  # nft flush ruleset
    with caplog.at_level("WARNING"):
        rig.service.tick()
    marking = [e.message for e in rig.events.recent(100, "net.marking")]
    assert marking[-1] == (
        "nftables: table inet gpud removed outside gpud (nft flush ruleset, a firewall"
        " reload?): written again, 0 rule(s)"
    )
    assert not [r for r in caplog.records if "removed outside gpud" in r.getMessage()]


def test_shutdown_modes(rig: Rig, tmp_path: Path) -> None:
    rig.service.tick()
    rig.service.shutdown()  # fail-static: nothing is touched
    assert "eth0" in rig.tc.states
    rig.config = dataclasses.replace(rig.config, shutdown="restore")
    rig.service = rig.make()
    rig.service.start()
    rig.service.shutdown()
    assert rig.tc.restored_ifaces == ["eth0"]
    assert ShapedInterfaces(rig.store).all() == set()  # nothing left to remove at start


def test_an_interface_taken_out_of_the_config_loses_gpuds_tree_at_start(
    tmp_path: Path, sysfs: Path
) -> None:
    rig = Rig(tmp_path, sysfs, link_rates=("eth1=1gbit",))
    rig.config = dataclasses.replace(rig.config, interfaces=("eth0", "eth1"))
    rig.service = rig.make()
    rig.service.start()
    rig.service.tick()
    assert set(rig.tc.states) == {"eth0", "eth1"}
    # kill -9 (or a fail-static stop), and a start with eth1 no longer in the list
    rig.config = dataclasses.replace(rig.config, interfaces=("eth0",), link_rates=())
    rig.service = rig.make()
    rig.service.start()
    assert rig.tc.restored_ifaces == ["eth1"] and "eth1" not in rig.tc.states
    events = [e for e in rig.events.recent(100) if e.kind == "net.unshaped"]
    assert len(events) == 1 and "eth1" in events[0].message
    rig.service.tick()
    assert set(rig.tc.states) == {"eth0"}
    # it is forgotten: the next start has nothing more to remove
    rig.service = rig.make()
    rig.service.start()
    assert rig.tc.restored_ifaces == ["eth1"]
    # an interface that is gone by then has nothing to remove either
    rig.tc.missing.add("eth0")
    rig.config = dataclasses.replace(rig.config, interfaces=("eth1",), link_rates=("eth1=1gbit",))
    rig.service = rig.make()
    rig.service.start()
    assert rig.tc.restored_ifaces == ["eth1"]
    assert "eth0" not in ShapedInterfaces(rig.store).all()


def test_a_pin_beyond_fewer_levels_moves_to_the_lowest_level(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.service.pin("b", 3)
    rig.service.tick()
    rig.config = dataclasses.replace(rig.config, levels=2)
    with caplog.at_level("WARNING", logger="gpud.net.service"):
        rig.service = rig.make()  # a restart with traffic.levels lowered from 4 to 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert line == (
        "traffic: job b was pinned to level 3, beyond traffic.levels = 2: pinned to level 1"
    )
    (moved,) = rig.events.recent(100, kind_prefix="net.pin")[-1:]
    assert moved.fields == {"job": "b", "level": 1, "pinned": 3}
    assert rig.service.view().jobs[1].pin_clamped_from == 3
    rig.service.start()
    rig.service.tick()
    assert rig.service.tags.pins() == {"b": 3}  # the operator's level is kept
    assert {j.job: (j.level, j.pinned_level) for j in rig.service.local_report().jobs}["b"] == (
        1,
        1,
    )
    assert all(i.enforced for i in rig.service.view().interfaces)
    (event,) = rig.events.recent(100, kind_prefix="net.pin")[-1:]
    assert "level 3" in event.message and "traffic.levels = 2" in event.message
    assert len(rig.events.recent(100, kind_prefix="net.pin")) == 2  # the pin, one move
    restarted = rig.make()  # still with traffic.levels = 2: still clamped, and says so
    assert restarted.tags.pins() == {"b": 3}
    assert restarted.view().jobs[1].pin_clamped_from == 3
    rig.service.pin("b", 0)
    assert rig.service.view().jobs[1].pin_clamped_from is None
    assert rig.make().tags.pins() == {"b": 0}  # a new pin replaces the kept one


def test_a_clamped_pin_comes_back_when_the_levels_are_raised_again(rig: Rig) -> None:
    rig.service.pin("b", 3)
    rig.config = dataclasses.replace(rig.config, levels=2)
    rig.service = rig.make()  # a restart with traffic.levels lowered from 4 to 2
    rig.service.start()
    rig.service.tick()
    assert {j.job: j.level for j in rig.service.local_report().jobs}["b"] == 1
    rig.config = dataclasses.replace(rig.config, levels=4)
    rig.service = rig.make()  # and raised back to 4
    rig.service.start()
    rig.service.tick()
    (job,) = [j for j in rig.service.view().jobs if j.job == "b"]
    assert (job.level, job.pinned_level, job.pin_clamped_from) == (3, 3, None)
    assert len(rig.events.recent(100, kind_prefix="net.pin")) == 2  # the pin, one clamp


def test_pins_and_reports_are_refused_while_traffic_is_off(tmp_path: Path, sysfs: Path) -> None:
    rig = Rig(tmp_path, sysfs, enabled=False)
    for call in (
        lambda: rig.service.pin("a", 1),
        lambda: rig.service.pin("a", None),
        lambda: rig.service.report(Report("a", 1, rig.clock.t, session="s")),
    ):
        with pytest.raises(FailedPrecondition, match=r"traffic\.enabled = false"):
            call()
    accepted, rejected = rig.service.report_batch([Report("a", 1, rig.clock.t)])
    assert accepted == 0 and isinstance(rejected[0].error, FailedPrecondition)
    assert rig.service.tags.allocations() == {} and rig.service.tags.pins() == {}
    assert rig.kinds() == []


def test_find_cgroup2(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "25 18 0:22 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
        "34 25 0:30 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw\n"
    )
    assert find_cgroup2(info) == Path("/sys/fs/cgroup/unified")
    info.write_text("25 18 0:22 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n")
    assert find_cgroup2(info) is None


def test_rdma_map_follows_levels(tmp_path: Path, sysfs: Path) -> None:
    from netshaper.dcb import DryRunBackend, NicMap

    lines: list[str] = []
    # two newcomers tie at rate 0: without grouping each gets its own level
    rig = Rig(tmp_path, sysfs, group_tolerance=0.0)
    service = rig.with_nic(NicMap(DryRunBackend(lines.append), ["eth2", "eth3"], link_type=ether))
    service.tick()
    assert service.settle(5)
    tags = service.tags.allocations()
    levels = {j.job: j.level for j in service.local_report().jobs}
    assert levels == {"a": 0, "b": 1}
    assert lines == [
        f"dcb app replace dev {dev} dscp-prio "
        + " ".join(f"{d}:{p}" for d, p in sorted({tags["a"]: 7, tags["b"]: 6}.items()))
        for dev in ("eth2", "eth3")
    ]
    lines.clear()
    service.tick()
    assert service.settle(5)
    assert lines == []  # nothing changed, nothing written
    service.pin("b", 0)
    service.pin("a", 3)
    service.tick()
    assert service.settle(5)
    assert lines == [
        f"dcb app replace dev {dev} dscp-prio "
        + " ".join(f"{d}:{p}" for d, p in sorted({tags["a"]: 4, tags["b"]: 7}.items()))
        for dev in ("eth2", "eth3")
    ]
    assert "net.rdma" in rig.kinds()


def test_open_rdma_discovers_roce_netdevs() -> None:
    from gpud.config import Config
    from gpud.net.wiring import open_rdma

    root = Path(__file__).resolve().parents[1] / "data" / "sysfs-rdma"
    port, why = open_rdma(
        Config(traffic=TrafficConfig(rdma_backend="dry-run")), sysfs_root=str(root)
    )
    assert port is not None and why == ""
    assert port.netdevs  # type: ignore[attr-defined]
    none, why = open_rdma(
        Config(traffic=TrafficConfig(rdma_backend="dcb")), sysfs_root=str(root / "nothing")
    )
    assert none is None and "traffic.rdma_interfaces" in why
    assert open_rdma(Config()) == (None, "")


def test_a_loopback_renamed_into_rdma_interfaces_is_refused_by_its_link_type(
    tmp_path: Path,
) -> None:
    """``ip link set lo name lb0``, lb0 in traffic.rdma_interfaces: the config's check by
    name passes it, the map is not written on it (the kernel's ARPHRD_LOOPBACK), and eth2
    still gets its map."""
    from gpud.config import Config
    from gpud.net.wiring import open_rdma
    from netshaper.dcb import DcbError

    t = TrafficConfig(rdma_backend="dry-run", rdma_interfaces=("lb0", "eth2"))
    kinds = {"lb0": 772, "eth2": 1}
    port, why = open_rdma(Config(traffic=t), sysfs_root=str(tmp_path), link_type=kinds.get)
    assert port is not None and why == ""
    with pytest.raises(DcbError) as refused:
        port.apply({26: 5})
    said = str(refused.value)
    assert said.startswith("lb0: 1 of 2 netdev(s) not written"), said
    assert "lb0: the loopback (ARPHRD_LOOPBACK, type 772), named lb0" in said


def wiring_parts(tmp_path: Path) -> tuple[StateStore, EventLog, JobService]:
    """What the daemon hands open_traffic: its store, event log and jobs service."""
    from gpud.jobs.service import JobService
    from gpud.mps.manager import MpsManager

    store = StateStore(tmp_path / "state")
    events = EventLog(None)
    mps = MpsManager(store, events, tmp_path / "run", control_command=["true"], enabled=False)
    return store, events, JobService(store, events, mps, socket_path=tmp_path / "gpud.sock")


class Wired(Protocol):
    def __call__(self, gpus: int, dscp_pool: str = ...) -> tuple[JobService, TrafficService]: ...


@pytest.fixture
def wired_traffic(tmp_path: Path) -> Iterator[Wired]:
    """Wires, given ``gpus`` (and ``traffic.dscp_pool``), the jobs service on that many GPUs of 80 GiB and the traffic
    service open_traffic wires to it (traffic on, no marking). The service is shut down
    when the test ends, pass or fail: its netlink socket left open would fail a later
    test (an unclosed socket's warning is an error)."""
    from gpud.config import Config
    from gpud.jobs.service import JobService
    from gpud.mps.manager import MpsManager, targets_from_snapshot
    from gpud.net.wiring import open_traffic
    from tests.unit.mps_support import gpu_sample, snapshot

    opened: list[TrafficService] = []

    def wire(
        gpus: int, dscp_pool: str = TrafficConfig().dscp_pool
    ) -> tuple[JobService, TrafficService]:
        store, events, _ = wiring_parts(tmp_path)
        mps = MpsManager(store, events, tmp_path / "run", control_command=["true"], enabled=False)
        mps.observe(
            targets_from_snapshot(snapshot(*(gpu_sample(i, memory_gib=80) for i in range(gpus))))
        )
        jobs = JobService(store, events, mps, socket_path=tmp_path / "gpud.sock")
        traffic = TrafficConfig(enabled=True, marking=False, dscp_pool=dscp_pool)
        opened.append(open_traffic(Config(traffic=traffic), store, events, jobs))
        return jobs, opened[-1]

    yield wire
    for service in opened:
        service.shutdown()


def test_wiring_says_why_marking_is_off(tmp_path: Path) -> None:
    from gpud.config import Config
    from gpud.net.wiring import open_traffic

    store, events, jobs = wiring_parts(tmp_path)
    config = Config(traffic=TrafficConfig(enabled=True, interfaces=("lo",)))
    no_cgroup2 = tmp_path / "mountinfo"
    no_cgroup2.write_text("25 18 0:22 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n")
    service = open_traffic(config, store, events, jobs, mountinfo=no_cgroup2)
    assert "cgroup v2 is not mounted" in service.view().marking_error
    service.shutdown()
    with_cgroup2 = tmp_path / "mountinfo2"
    with_cgroup2.write_text("34 25 0:30 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    service = open_traffic(
        config, store, events, jobs, mountinfo=with_cgroup2, which=lambda _: None
    )
    assert "nft not found (install the nftables package)" in service.view().marking_error
    service.shutdown()
    # turned off: `gpuctl net show` says so, `gpuctl status` counts no fault for it
    unmarked = Config(traffic=TrafficConfig(enabled=True, interfaces=("lo",), marking=False))
    service = open_traffic(unmarked, store, events, jobs, mountinfo=with_cgroup2)
    assert service.view().marking_error == "off (traffic.marking = false)"
    assert service.summary().marking_error == ""
    service.shutdown()
    off = open_traffic(Config(), store, events, jobs)
    assert not off.view().enabled


def test_wiring_tells_the_service_when_a_run_ends(wired_traffic: Wired) -> None:
    """A run's release (gpuctl run's, at its command's exit) reaches the traffic service:
    its job reads as ended, until it holds a reservation again (at once)."""
    from gpud.jobs.ends import EndCause, RunEnd
    from gpud.jobs.service import RunRequest

    jobs, service = wired_traffic(1)
    launch = jobs.reserve(RunRequest("train-a"))
    service.tick()
    service.report(Report("train-a", 1, time.time() - 1, session="s"))

    def row() -> JobTraffic:
        (found,) = service.view().jobs
        return found

    assert row().ended_s is None
    jobs.release(launch.reservation.id, RunEnd(EndCause.EXITED, exit_code=0))
    service.tick()  # views judge by the tick's reservations: they read no store
    ended = row().ended_s
    assert ended is not None and 0 <= ended < 5
    again = jobs.reserve(RunRequest("train-a"))
    assert row().ended_s is None
    jobs.release(again.reservation.id)


def test_a_run_that_ends_is_counted_ended_at_once_without_its_level(wired_traffic: Wired) -> None:
    """Between a run's end and the next traffic tick, ``gpuctl net show`` and /metrics do
    not count the job as running at its level: it reads ended, with no level, in no
    level's count. A job one of whose two runs ended still runs, at its level."""
    from gpud.jobs.service import RunRequest

    jobs, service = wired_traffic(2)
    first = jobs.reserve(RunRequest("train-a"))
    second = jobs.reserve(RunRequest("train-a"))
    service.tick()
    service.report(Report("train-a", 1, time.time() - 1, session="s"))
    service.tick()

    def row() -> JobTraffic:
        (found,) = service.view().jobs
        return found

    def at_levels() -> float:
        registry = _samples(service)
        return sum(
            registry.get_sample_value("gpud_net_level_jobs", {"level": str(lv)}) or 0.0
            for lv in range(service.config.levels)
        )

    assert row().level is not None and at_levels() == 1
    jobs.release(first.reservation.id)
    assert row().ended_s is None and row().level is not None and at_levels() == 1
    jobs.release(second.reservation.id)  # no tick since
    ended = row()
    assert ended.ended_s is not None and ended.level is None
    assert at_levels() == 0
    assert _samples(service).get_sample_value("gpud_net_job_level", {"job": "train-a"}) is None
    service.tick()
    assert row().ended_s is not None and row().level is None


def test_a_run_reserved_since_the_tick_runs_on_when_another_run_of_its_job_ends(
    wired_traffic: Wired,
) -> None:
    """A job's run that reserved after the last tick keeps it running, at its level, when
    another run of the job that also started since then ends."""
    from gpud.jobs.service import RunRequest

    jobs, service = wired_traffic(3)
    first = _ranked_run(jobs, service)
    jobs.release(first.reservation.id)
    second = jobs.reserve(RunRequest("train-a"))
    jobs.reserve(RunRequest("train-a"))
    jobs.release(second.reservation.id)  # the third holds, no tick since
    (row,) = service.view().jobs
    assert row.ended_s is None and row.level is not None


def _ranked_run(jobs: JobService, service: TrafficService) -> Launch:
    """A run of job "train-a" reserved, reporting, and ranked by a tick."""
    from gpud.jobs.service import RunRequest

    launch = jobs.reserve(RunRequest("train-a"))
    service.tick()
    service.report(Report("train-a", 1, time.time() - 1, session="s"))
    service.tick()
    return launch


def test_a_reservation_rolled_back_after_a_release_leaves_the_job_ended(
    wired_traffic: Wired,
) -> None:
    """A run that reserves right after its job's last run was released, in a transaction
    that is rolled back (the disk full), holds nothing: the job reads ended at the ticks
    after, without its level, though it reported within traffic.idle_after_s."""
    from gpud.jobs.service import RunRequest

    jobs, service = wired_traffic(1)
    launch = _ranked_run(jobs, service)
    jobs.release(launch.reservation.id)
    with pytest.raises(OSError), jobs.store.transaction():
        jobs.reserve(RunRequest("train-a"))
        raise OSError(28, "No space left on device")
    assert not jobs.reservations.held()
    for _ in range(2):
        service.tick()
        (row,) = service.view().jobs
        assert row.ended_s is not None and row.level is None


def test_a_run_tagged_as_its_jobs_last_run_ends_launches_with_its_dscp(
    wired_traffic: Wired,
) -> None:
    """A job's second run tags it while its first still holds (gpuctl run tags before its
    transaction), then the first ends: another job's run is refused the pool's one tag,
    and the second run's environment carries the job's DSCP."""
    from gpud.jobs.service import RunRequest

    jobs, service = wired_traffic(2, dscp_pool="10")
    jobs.set_tagger(service.tag, service.tags.get, service.starting)  # as gpud does
    first = jobs.reserve(RunRequest("train-a"))
    assert service.tag("train-a") == 10  # the second run, before its transaction
    jobs.release(first.reservation.id)
    with pytest.raises(DscpPoolExhausted):
        jobs.reserve(RunRequest("train-d"))
    second = jobs.reserve(RunRequest("train-a"))
    assert second.env["GPUD_DSCP"] == "10"
    assert jobs.env_for(second.reservation)["GPUD_DSCP"] == "10"


def test_the_reservations_are_read_in_turn_with_their_writes(wired_traffic: Wired) -> None:
    """The tick reads the reservations through the store's writer, in turn with its writes
    (a release is said to the service before it commits), never a reading snapshot of what
    was committed: a tick after the release reads the job ended, without its level. A
    guard, not a fix's test: the wiring's read goes through the writer, and this fails
    only where it is switched to the store's ``reading()`` snapshot."""

    jobs, service = wired_traffic(1)
    launch = _ranked_run(jobs, service)
    with jobs.store.transaction():
        jobs.release(launch.reservation.id)  # told to the service, not committed yet
        service.tick()
    (row,) = service.view().jobs
    assert row.ended_s is not None and row.level is None


def test_reserved_dscps_named_in_the_pool_are_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from gpud.config import Config
    from gpud.net.wiring import open_traffic

    store, events, jobs = wiring_parts(tmp_path)
    traffic = TrafficConfig(enabled=True, interfaces=("lo",), marking=False)
    for pool, said in (
        ("10-12,46", "46 (in traffic.reserved_dscp)"),
        ("46-48", "46 (in traffic.reserved_dscp), 48 (in traffic.reserved_dscp)"),
        ("10-12", None),
        ("", None),  # every DSCP but the reserved ones: nothing named is left out
    ):
        caplog.clear()
        config = Config(traffic=dataclasses.replace(traffic, dscp_pool=pool))
        with caplog.at_level("WARNING", logger="gpud.net.wiring"):
            service = open_traffic(config, store, events, jobs)
        service.shutdown()
        warnings = [r.getMessage() for r in caplog.records if r.name == "gpud.net.wiring"]
        if said is None:
            assert warnings == [], pool
            continue
        assert warnings == [
            f"traffic.dscp_pool: {pool!r} names reserved DSCPs, left out of the pool and never"
            f" a job's tag: {said}"
        ]
        assert 46 not in service.tags.pool
    cnp = dataclasses.replace(traffic, dscp_pool="10,26", cnp_dscp=26)
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpud.net.wiring"):
        open_traffic(Config(traffic=cnp), store, events, jobs).shutdown()
    assert "26 (traffic.cnp_dscp)" in caplog.text
    # named as a config error names it: the file and the key
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpud.net.wiring"):
        open_traffic(
            Config(traffic=cnp), store, events, jobs, config_path="/etc/gpud/gpud.toml"
        ).shutdown()
    assert "/etc/gpud/gpud.toml:traffic.dscp_pool: '10,26' names reserved DSCPs" in caplog.text


def test_a_pool_with_an_empty_item_starts_gpud_with_a_warning_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ "10-12," (loaded by every gpud before) starts gpud, the empty item skipped and said
    at start, naming the config file and key."""
    from gpud.config import Config
    from gpud.net.wiring import open_traffic

    store, events, jobs = wiring_parts(tmp_path)
    traffic = TrafficConfig(enabled=True, interfaces=("lo",), marking=False, dscp_pool="10-12,")
    with caplog.at_level("WARNING", logger="gpud.net.wiring"):
        service = open_traffic(
            Config(traffic=traffic), store, events, jobs, config_path="/etc/gpud/gpud.toml"
        )
    service.shutdown()
    assert service.tags.pool == (10, 11, 12)
    warnings = [r.getMessage() for r in caplog.records if r.name == "gpud.net.wiring"]
    assert warnings == [
        "/etc/gpud/gpud.toml:traffic.dscp_pool: '10-12,' has an empty item (nothing between"
        " two commas, or before or after them), skipped: a DSCP left out?"
    ]


def test_level_priorities_that_defeat_the_levels_are_taken_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`traffic.level_priorities` that put levels on one NIC priority, or a level above the
    one before it, start gpud with one warning naming the key (it may be meant); the default
    and a decreasing list start without one."""
    from gpud.config import Config
    from gpud.net.wiring import open_traffic

    store, events, jobs = wiring_parts(tmp_path)
    traffic = TrafficConfig(enabled=True, interfaces=("lo",), marking=False)
    for prios, said in (
        (
            (7, 7, 7, 7),
            "traffic.level_priorities = [7, 7, 7, 7] maps every level to NIC priority 7:"
            " levels would not be distinguished on RDMA",
        ),
        (
            (7, 5, 5, 6),
            "traffic.level_priorities = [7, 5, 5, 6]: levels 1 and 2 share NIC priority 5;"
            " level 3 gets NIC priority 6, above level 2's 5 (level 0 holds the slowest jobs:"
            " each level should get a lower NIC priority than the one before it, as the"
            " default 7 - level does, or RDMA traffic does not follow the levels)",
        ),
        ((0, 1, 2, 3), "level 1 gets NIC priority 1, above level 0's 0"),
        ((6, 4, 3, 0), None),
        ((), None),  # the default: 7 - level
    ):
        caplog.clear()
        config = Config(traffic=dataclasses.replace(traffic, level_priorities=prios))
        with caplog.at_level("WARNING", logger="gpud.net.wiring"):
            open_traffic(config, store, events, jobs).shutdown()
        warnings = [r.getMessage() for r in caplog.records if r.name == "gpud.net.wiring"]
        if said is None:
            assert warnings == [], prios
        else:
            (warning,) = warnings
            assert said in warning


def test_drift_is_counted_while_another_interface_fails(tmp_path: Path, sysfs: Path) -> None:
    rig = Rig(tmp_path, sysfs, link_rates=("nope0=1gbit",))
    rig.config = dataclasses.replace(rig.config, interfaces=("eth0", "nope0"))
    rig.tc.missing.add("nope0")
    rig.service = rig.make()
    rig.active = {"a"}
    rig.service.tick()
    rig.service.tick()
    del rig.tc.states["eth0"]
    rig.service.tick()
    eth0, nope0 = rig.service.view().interfaces
    assert eth0.repairs == 1 and eth0.enforced and not nope0.enforced


def _leaf(rig: Rig, job: str) -> tcplan.HtbClass:
    tag = rig.service.tags.allocations()[job]
    return next(
        c
        for c in rig.tc.states["eth0"].classes
        if (p := tcplan.parse_leaf(c.classid)) and p[1] == tag
    )


def test_jobs_weigh_by_their_demand_inside_a_level(rig: Rig) -> None:
    # two jobs progressing alike (one group, one level), one moving 4x the bytes per iteration
    rig.config = dataclasses.replace(rig.config, group_tolerance=0.1)
    rig.service = rig.make()
    rig.active = {"a", "b"}
    feed(rig, "a", 0.5, 4, ideal=0.25)
    feed(rig, "b", 0.5, 4, ideal=0.25)
    rig.service.tick()  # leaves exist; demand is counted from here
    assert _leaf(rig, "a").level == _leaf(rig, "b").level
    for n in range(5, 10):
        rig.clock.t += 0.5
        for job, per_iter in (("a", 4_000_000), ("b", 1_000_000)):
            rig.tc.sent[("eth0", _leaf(rig, job).classid)] = FakeCounters(per_iter * (n - 4), n, 0)
            rig.service.report(Report(job, n, rig.clock.t, 0.25, session="s"))
        rig.service.tick()
    base = tcplan.TcOptions().quantum_bytes
    assert _leaf(rig, "a").quantum == base
    assert _leaf(rig, "b").quantum == base * 8 // 32  # a quarter of a's demand
    # off: equal quanta
    rig.config = dataclasses.replace(rig.config, weigh_by_demand=False)
    rig.service = rig.make()
    rig.service.tick()
    assert _leaf(rig, "a").quantum == _leaf(rig, "b").quantum == base


def test_a_full_tag_pool_goes_to_jobs_in_use_and_the_rest_stays_enforced(
    tmp_path: Path, sysfs: Path
) -> None:
    rig = Rig(tmp_path, sysfs, dscp_pool="10-11")  # two tags, three jobs
    s = rig.service
    rig.active = {"a", "b", "c"}
    s.tick()
    s.tick()  # the job left without a tag is told once, and the tick goes on
    assert set(s.tags.allocations()) == {"a", "b"}
    view = s.view()
    assert view.interfaces[0].enforced
    assert "all 2 DSCP tags of traffic.dscp_pool are in use" in view.untagged["c"]
    assert "widen traffic.dscp_pool" in view.untagged["c"]
    assert rig.kinds().count("net.untagged") == 1
    assert "c" not in {j.job for j in view.jobs}
    # b stops: it holds no reservation, and reports nothing for idle_after_s
    rig.active = {"a", "c"}
    rig.clock.t += rig.config.idle_after_s + 1
    s.tick()
    assert s.tags.allocations()["c"] in (10, 11) and "b" not in s.tags.allocations()
    assert s.view().untagged == {} and "net.reclaim" in rig.kinds()
    # an idle job needs no tag: it does not take one back from a job in use
    s.tick()
    assert set(s.tags.allocations()) == {"a", "c"} and s.view().untagged == {}
    # ... until it reports progress again, and a tag is idle
    rig.active = {"c"}
    feed(rig, "b", 0.5, 4)
    s.tick()
    assert set(s.tags.allocations()) == {"b", "c"}


def test_many_jobs_left_without_a_tag_at_once_are_one_event_past_the_first_few(
    tmp_path: Path, sysfs: Path
) -> None:
    """A start with a spent pool counts every registered job as in use: hundreds of jobs
    go untagged in one pass, told in a few events, not one each."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-11")  # two tags
    rig.jobs = [f"j{i:03d}" for i in range(200)]
    s = rig.service
    s.tick()
    s.tick()
    said = [e for e in rig.events.recent(1000) if e.kind == "net.untagged"]
    assert len(said) == 9, [e.message for e in said]
    assert [e.fields["job"] for e in said[:8]] == [f"j{i:03d}" for i in range(2, 10)]
    rest = said[8]
    assert rest.fields == {"jobs": 190, "names": [f"j{i:03d}" for i in range(10, 200)]}
    assert rest.message.startswith("190 more job(s) have no DSCP tag (j010, j011, ")
    assert ", ...): all 2 DSCP tags of traffic.dscp_pool are in use" in rest.message
    assert "j199" not in rest.message and "job 'j010'" not in rest.message
    assert len(s.view().untagged) == 198  # each still listed by gpuctl net show
    # gpuctl events --job finds each job's event, the grouped one by its names
    for job in ("j005", "j150", "j199"):
        (about,) = rig.events.recent(1000, "net.untagged", job=job)
        assert about is (said[3] if job == "j005" else rest)


class _CountedTags(TagStore):
    """A TagStore that counts the calls of :meth:`tag`."""

    calls = 0

    def tag(self, job: str) -> int:
        self.calls += 1
        return super().tag(job)


def test_a_spent_pool_costs_one_try_a_tick_however_many_jobs_wait(
    tmp_path: Path, sysfs: Path
) -> None:
    """Once one job in use found no tag (and none idle to hand over), the rest of the pass
    goes without one for the same reason, untried: no tag frees while the pass holds the
    lock, and each try is a store transaction and a look at every held job."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-11")  # two tags
    rig.jobs = [f"j{i:03d}" for i in range(200)]
    tags = _CountedTags(rig.store, pool=job_pool(rig.config))
    s = rig.service = rig.make(tags=tags)
    s.tick()
    assert tags.calls == 3  # j000 and j001 tagged, j002 refused
    s.tick()
    assert tags.calls == 4
    untagged = s.view().untagged
    assert sorted(untagged) == [f"j{i:03d}" for i in range(2, 200)]
    assert untagged["j150"].startswith(
        "no DSCP tag: job 'j150': all 2 DSCP tags of traffic.dscp_pool are in use; gpud started"
    )


def test_a_spent_pool_refuses_a_tag_without_a_transaction(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "state")
    tags = TagStore(store, pool=frozenset({10}))
    assert tags.tag("a") == 10
    before = store.transactions
    with pytest.raises(DscpPoolExhausted, match="all 1 DSCP tags") as err:
        tags.tag("b")
    assert store.transactions == before
    assert (err.value.job, err.value.reason) == (
        "b",
        "all 1 DSCP tags of traffic.dscp_pool are in use",
    )
    assert str(err.value) == "job 'b': all 1 DSCP tags of traffic.dscp_pool are in use"


def test_chains_added_to_gpuds_table_are_named_when_removed(rig: Rig) -> None:
    """A chain someone added to gpud's table (one hooked after gpud's may set every DSCP
    back to 0) goes with the table written again: one warning and net.marking event name
    it, while gpud runs and on the first pass after a start."""
    rig.active = {"a", "b", "c"}
    for job in rig.jobs:
        rig.cgroups.dir(job).mkdir(parents=True)
    rig.service.tick()
    said = (
        "nftables: removed chain(s) zap not gpud's from table inet gpud (they could undo the marks)"
    )
    rig.marker.foreign = ("zap",)
    rig.service.tick()
    marking = [e.message for e in rig.events.recent(1000, "net.marking")]
    assert marking == [said]  # not also "table updated"
    rig.service.tick()
    assert len(rig.events.recent(1000, "net.marking")) == 1
    # the same after a restart: the first pass also says what it took over
    rig.marker.foreign = ("zap", "idle")
    rig.service = rig.make()
    rig.service.start()
    rig.service.tick()
    assert rig.events.recent(1000, "net.marking")[-1].message == said.replace("zap", "zap, idle")
    (nft,) = [
        e for e in rig.events.recent(1000) if e.kind == "net.takeover" and not e.fields["interface"]
    ]
    assert nft.fields == {"interface": "", "kept": 0, "removed": 6, "changed": 0, "added": 6}
    assert nft.message.endswith("kept 0 rule(s), removed 6 (the table rebuilt), added 6")


def test_a_job_removed_without_a_tag_leaves_no_progress_behind(tmp_path: Path, sysfs: Path) -> None:
    rig = Rig(tmp_path, sysfs, dscp_pool="10-11")  # two tags, three jobs
    s = rig.service
    rig.active = {"a", "b", "c"}
    s.tick()
    assert "c" in s.view().untagged
    feed(rig, "c", 0.5, 100)  # it runs untagged, and reports progress
    rig.active, rig.jobs = {"a", "b"}, ["a", "b"]  # gpuctl jobs rm c
    s.tick()
    rig.jobs.append("c")  # gpuctl jobs add c: a new job under the name, from its start
    s.tick()
    # its first report counts: the old job's 100 iterations went with it
    s.report(Report("c", 1, rig.clock.t, session="s"))


def _samples(service: TrafficService) -> CollectorRegistry:
    collector = Collector(lambda: None, events=EventLog(None), clock=lambda: 0.0)
    collector.add_source(TrafficMetrics(service))
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def test_a_job_in_use_without_a_tag_shows_its_progress_and_takes_no_level(
    tmp_path: Path, sysfs: Path
) -> None:
    """A job the full pool left untagged still reports: its row in ``gpuctl net show`` and
    ``gpud_net_job_progress_rate_ratio`` carry its progress. It has no class of its own, so
    the leveller ranks the tagged jobs only: the slowest of them holds level 0."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-11")  # two tags, three jobs
    s = rig.service
    rig.active = {"a", "b", "c"}
    s.tick()
    assert set(s.view().untagged) == {"c"}
    feed(rig, "a", 0.5, 10, ideal=0.25)  # rate 0.5
    feed(rig, "b", 0.5, 10, ideal=0.4)  # rate 0.8
    feed(rig, "c", 1.0, 10, ideal=0.25)  # rate 0.25: the slowest, untagged
    s.tick()
    view = s.view()
    (row,) = view.untagged_jobs
    assert (row.job, row.dscp, row.level, row.iterations) == ("c", 0, None, 10)
    assert row.rate == pytest.approx(0.25) and row.iteration_s == pytest.approx(1.0)
    assert row.contention_free_iteration_s == 0.25 and row.last_report_unix_s == rig.clock.t
    assert {j.job: j.level for j in view.jobs} == {"a": 0, "b": 1}
    registry = _samples(s)
    rate = "gpud_net_job_progress_rate_ratio"
    assert registry.get_sample_value(rate, {"job": "c"}) == pytest.approx(0.25)
    assert registry.get_sample_value(rate, {"job": "a"}) == pytest.approx(0.5)
    for name in ("gpud_net_job_dscp", "gpud_net_job_level", "gpud_net_job_sent_bytes_total"):
        assert registry.get_sample_value(name, {"job": "c"}) is None  # no tag, no class
    assert registry.get_sample_value("gpud_net_level_jobs", {"level": "0"}) == 1
    assert "net.levels" not in rig.kinds()  # nothing moved c, nor a or b around it


def test_a_job_whose_idle_tag_went_to_another_keeps_its_progress(
    tmp_path: Path, sysfs: Path
) -> None:
    """An idle job's tag handed over takes its level and counters along, not its
    progress: run again while the pool is full, its untagged row goes on from where it
    was (a report going backwards in its session is refused, as before the hand-over)."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-11")  # two tags, three jobs
    s = rig.service
    rig.active = {"a", "b"}
    feed(rig, "b", 0.5, 4, ideal=0.25)
    s.tick()
    assert set(s.tags.allocations()) == {"a", "b"}
    rig.active = {"a", "c"}  # b stops; c starts once b is idle
    rig.clock.t += rig.config.idle_after_s + 1
    s.tag("c")
    assert set(s.tags.allocations()) == {"a", "c"} and "net.reclaim" in rig.kinds()
    s.report(Report("b", 5, rig.clock.t, session="s"))  # b runs again: no tag is idle
    s.tick()
    (row,) = s.view().untagged_jobs
    assert (row.job, row.iterations, row.contention_free_iteration_s) == ("b", 5, 0.25)
    assert row.iteration_s is not None
    with pytest.raises(InvalidArgument, match="going backwards"):
        s.report(Report("b", 1, rig.clock.t, session="s"))
    rig.jobs.remove("b")  # gpuctl jobs rm b: its progress goes with it
    s.tick()
    assert s.view().untagged_jobs == ()
    rig.jobs.append("b")  # gpuctl jobs add b: a new job under the name counts from its start
    s.report(Report("b", 1, rig.clock.t, session="s"))


def test_idle_jobs_without_a_tag_are_a_gauge_of_their_own(tmp_path: Path, sysfs: Path) -> None:
    """``gpud_net_untagged_jobs`` counts jobs in use without a tag (alert
    TrafficJobsUntagged); idle ones, a normal state, are ``gpud_net_idle_untagged_jobs``."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-11")
    s = rig.service
    rig.jobs = ["a", "b", "c", "d", "e"]
    rig.active = {"a", "b", "c"}
    rig.clock.t += rig.config.idle_after_s + 1  # past the start: d and e are idle
    s.tick()
    registry = _samples(s)
    assert registry.get_sample_value("gpud_net_untagged_jobs") == 1
    assert registry.get_sample_value("gpud_net_idle_untagged_jobs") == 2


def test_a_tag_is_not_taken_from_a_job_in_use(tmp_path: Path, sysfs: Path) -> None:
    rig = Rig(tmp_path, sysfs, dscp_pool="10-11")
    s = rig.service
    rig.jobs = ["a", "b"]
    s.tick()
    rig.clock.t += rig.config.idle_after_s + 1
    rig.jobs.append("new")
    (rig.cgroups.ensure("a") / "cgroup.procs").write_text("4242\n")  # a's process runs
    s.pin("b", 1)
    with pytest.raises(
        ResourceExhausted,
        match="each by a job that runs, is pinned, or was given its tag, ended a run or reported",
    ):
        s.tag("new")
    (rig.cgroups.dir("a") / "cgroup.procs").write_text("")
    assert s.tag("new") == 10 + 11 - s.tags.allocations()["b"]
    assert "a" not in s.tags.allocations()
    # "new" is about to run (its reservation comes next): a runs again, and waits for a tag
    with pytest.raises(ResourceExhausted):
        s.tag("a")


def test_a_refused_tag_request_holds_no_tag_back_from_jobs_that_run(
    tmp_path: Path, sysfs: Path
) -> None:
    rig = Rig(tmp_path, sysfs, dscp_pool="10-13")  # four tags, twelve jobs
    s = rig.service
    rig.jobs = [f"j{i:02d}" for i in range(12)]
    wait = rig.config.idle_after_s
    rig.clock.t += wait + 1
    s.tick()  # idle jobs take the free tags (j00..j03)
    # j04..j07 start (their tags are handed over), and run on past idle_after_s
    for job in rig.jobs[4:8]:
        s.tag(job)
    rig.active = set(rig.jobs[4:8])
    rig.clock.t += wait + 10
    s.tick()
    # a bulk of runs that find every tag in use: refused, nothing of them starts
    for job in rig.jobs[8:]:
        with pytest.raises(DscpPoolExhausted):
            s.tag(job)
    s.tick()
    # j04 and j05 end; then j00 and j01 start: the tags of the jobs that ended go to them
    rig.clock.t += 5
    rig.active = {"j06", "j07"}
    s.tick()
    for job in ("j00", "j01"):
        s.tag(job)  # gpuctl run: the tag first, then the reservation
        rig.active.add(job)
    for _ in range(3):
        rig.clock.t += 1
        s.tick()
    held = s.tags.allocations()
    assert set(held) == rig.active
    assert not set(held) & set(rig.jobs[8:])  # refused, never started: no tag


class _HungMarker(FakeMarker):
    """``nft`` that hangs until released."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def sync(self, marks: Iterable[CgroupMark]) -> MarkSync:
        self.entered.set()
        self.release.wait(timeout=30)
        return super().sync(marks)


def test_a_hung_nft_holds_back_no_report_view_or_tag(rig: Rig) -> None:
    rig.marker = hung = _HungMarker()
    rig.service = s = rig.make()
    tick = threading.Thread(target=s.tick)
    tick.start()
    try:
        assert hung.entered.wait(timeout=10)
        done = threading.Event()

        def api_calls() -> None:
            s.report(Report("a", 1, rig.clock.t, session="s"))
            s.view()
            s.tag("a")
            done.set()

        threading.Thread(target=api_calls, daemon=True).start()
        assert done.wait(timeout=5), "the API waited for nft"
        assert s.view().interfaces[0].enforced  # tc went first, under the state lock
    finally:
        hung.release.set()
        tick.join(timeout=30)


class _SlowNic:
    """A NIC map whose ``dcb`` hangs until released, then fails or writes."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.fail = True
        self.writes: list[dict[int, int]] = []

    def apply(self, dscp_priorities: Mapping[int, int]) -> list[MapResult]:
        self.release.wait(timeout=30)
        if self.fail:
            raise RuntimeError("eth2: cannot run dcb: timed out after 10 seconds")
        self.writes.append(dict(dscp_priorities))
        return [MapResult("eth2", dict(dscp_priorities))]


def _failed_nic_map(rig: Rig) -> tuple[_SlowNic, TrafficService]:
    """A service whose first NIC map write failed (its worker is shut down on failure)."""
    nic = _SlowNic()
    nic.release.set()
    s = rig.with_nic(nic)
    try:
        s.tick()
        assert s.settle(10) and "cannot run dcb" in s.view().rdma_error
    except BaseException:
        s.shutdown()
        raise
    return nic, s


def _rdma_map_ok(service: TrafficService) -> float | None:
    collector = Collector(lambda: None, events=EventLog(None), clock=lambda: 0.0)
    collector.add_source(TrafficMetrics(service))
    registry = CollectorRegistry()
    registry.register(collector)
    return registry.get_sample_value("gpud_net_rdma_map_ok")


def test_a_nic_map_that_fails_is_a_metric_as_well(tmp_path: Path, sysfs: Path) -> None:
    """One NIC whose dcb fails: tc stays enforced, and the gauge says the map is not."""
    assert _rdma_map_ok(Rig(tmp_path / "none", sysfs).service) is None  # rdma_backend none
    rig = Rig(tmp_path, sysfs, rdma_backend="dcb")
    nic, s = _failed_nic_map(rig)
    try:
        assert s.view().interfaces[0].enforced
        assert _rdma_map_ok(s) == 0
        # gpuctl status says it too
        assert s.summary().rdma_backend == "dcb"
        assert s.summary().rdma_error == s.view().rdma_error
        nic.fail = False
        rig.clock.t += RDMA_RETRY_S
        s.tick()
        assert s.settle(10) and s.view().rdma_error == ""
        assert _rdma_map_ok(s) == 1
        rdma = [(e.kind, e.message) for e in rig.events.recent(100) if "rdma" in e.kind]
        broke = "rdma: eth2: cannot run dcb: timed out after 10 seconds"
        assert rdma == [
            ("net.rdma_error", broke),
            (
                "net.rdma",
                f"NIC DSCP -> priority map written on every netdev again (was: {broke})"
                "; 2 change(s)",
            ),
        ]
    finally:
        s.shutdown()


def test_a_hung_nic_map_holds_back_no_tick(tmp_path: Path, sysfs: Path) -> None:
    rig = Rig(tmp_path, sysfs)
    nic = _SlowNic()
    s = rig.with_nic(nic)
    try:
        for _ in range(3):  # each returns at once: tc is enforced, dcb hangs on its own
            s.tick()
        assert s.view().interfaces[0].enforced and not s.settle(0.1)
        nic.release.set()
        assert s.settle(10)
        assert "cannot run dcb" in s.view().rdma_error
        s.tick()  # failed, and the map is the same: not before RDMA_RETRY_S
        assert s.settle(10) and nic.writes == []
        nic.fail = False
        rig.clock.t += RDMA_RETRY_S
        s.tick()
        assert s.settle(10) and s.view().rdma_error == ""
        (written,) = nic.writes
        assert sorted(written.values()) == [6, 7]
    finally:
        nic.release.set()
        s.shutdown()


def test_the_latest_value_runs_next_and_a_failure_stops_nothing() -> None:
    seen: list[int] = []
    gate, started = threading.Event(), threading.Event()

    def run(value: int) -> None:
        started.set()
        gate.wait(timeout=30)
        seen.append(value)
        if value == 2:
            raise RuntimeError("boom")

    worker = LatestWorker(run, name="test-latest")
    worker.submit(1)
    assert started.wait(10)  # 1 is running
    for value in (2, 3, 4):  # 2 and 3 are replaced before they run
        worker.submit(value)
    gate.set()
    assert worker.wait_idle(10) and seen == [1, 4]
    worker.submit(2)  # it raises: logged, and the worker goes on
    worker.submit(5)
    assert worker.wait_idle(10)
    worker.submit(6)
    assert worker.wait_idle(10) and seen[-1] == 6
    worker.close()
    worker.submit(7)
    assert worker.wait_idle(1) and seen[-1] == 6


def test_a_nic_map_changed_outside_gpud_is_written_back(tmp_path: Path, sysfs: Path) -> None:
    from netshaper.dcb import DryRunBackend, NicMap

    lines: list[str] = []
    backend = DryRunBackend(lines.append)
    rig = Rig(tmp_path, sysfs)
    s = rig.with_nic(NicMap(backend, ["eth2"], link_type=ether))
    s.tick()
    assert s.settle(5) and len(lines) == 1
    tag = s.tags.allocations()["a"]
    backend._shown["eth2"][tag] = (3,)  # someone ran `dcb app replace ... dscp-prio TAG:3`
    rig.clock.t += RDMA_RECHECK_S - 1
    s.tick()
    assert s.settle(5) and len(lines) == 1  # not read back yet
    rig.clock.t += 1
    s.tick()
    assert s.settle(5) and lines[-1].endswith(f"dscp-prio {tag}:7")
    assert "net.rdma_drift" in rig.kinds()
    rig.clock.t += RDMA_RECHECK_S
    s.tick()
    assert s.settle(5) and len(lines) == 2  # read back, nothing to write


def test_a_nic_map_another_agent_changes_before_every_check_is_said_twice(
    tmp_path: Path, sysfs: Path
) -> None:
    """A DCBX agent puts its own priority back on gpud's DSCP before every check: each
    check writes gpud's back; the first is said, then once that it keeps coming back,
    not once a check. A check that finds the map as gpud wrote it ends the run."""
    from netshaper.dcb import DryRunBackend, NicMap

    lines: list[str] = []
    backend = DryRunBackend(lines.append)
    rig = Rig(tmp_path, sysfs)
    s = rig.with_nic(NicMap(backend, ["eth2"], link_type=ether))
    s.tick()
    assert s.settle(5)
    tag = s.tags.allocations()["a"]

    def check(agent: bool) -> None:
        if agent:
            backend._shown["eth2"][tag] = (3,)
        rig.clock.t += RDMA_RECHECK_S
        s.tick()
        assert s.settle(5)

    for _ in range(6):
        check(agent=True)
    assert len(lines) == 7 and lines[-1].endswith(f"dscp-prio {tag}:7")
    drifts = [e.message for e in rig.events.recent(100, "net.rdma_drift")]
    assert len(drifts) == 2, drifts
    assert drifts[1] == (
        "NIC DSCP -> priority map changed outside gpud again on 2 writes running: another"
        " agent (a DCBX one, lldpad) keeps changing it; gpud writes it back each time,"
        " said again once a write finds it as gpud wrote it: 1 entry written back"
    )
    check(agent=False)
    check(agent=True)
    assert len(rig.events.recent(100, "net.rdma_drift")) == 3


class _BreakableNic:
    """A NIC map that writes through ``nic`` until ``fail`` is set (``dcb`` timing out)."""

    def __init__(self, nic: RdmaPort) -> None:
        self.nic = nic
        self.fail = False

    def apply(self, dscp_priorities: Mapping[int, int]) -> Sequence[MapResult]:
        if self.fail:
            raise RuntimeError("eth2: cannot run dcb: timed out after 10 seconds")
        return self.nic.apply(dscp_priorities)


def test_a_nic_map_check_that_failed_ends_the_agents_run_and_every_write_back_is_counted(
    tmp_path: Path, sysfs: Path
) -> None:
    """An agent rewrites the map on two checks running (said twice), a check fails, the
    next writes it again: one later change by an agent is said, not taken as the same
    fight; every write-back is counted in ``gpuctl net show`` and the metric, said or
    not."""
    from netshaper.dcb import DryRunBackend, NicMap

    backend = DryRunBackend(lambda line: None)
    nic = _BreakableNic(NicMap(backend, ["eth2"], link_type=lambda netdev: 1))
    rig = Rig(tmp_path, sysfs, rdma_backend="dcb")
    s = rig.with_nic(nic)
    try:
        s.tick()
        assert s.settle(5)
        tag = s.tags.allocations()["a"]

        def check(*, agent: bool = False, fail: bool = False) -> None:
            if agent:
                backend._shown["eth2"][tag] = (3,)
            nic.fail = fail
            rig.clock.t += RDMA_RECHECK_S
            s.tick()
            assert s.settle(5)

        for _ in range(3):
            check(agent=True)
        check(agent=True, fail=True)
        check()  # writes the agent's change back, as the pair of net.rdma_error
        assert s.view().rdma_error == ""
        check(agent=True)
        drifts = [e.message for e in rig.events.recent(100, "net.rdma_drift")]
        assert len(drifts) == 3, drifts
        assert "keeps changing" not in drifts[2]
        (back,) = [e.message for e in rig.events.recent(100, "net.rdma") if "(was: " in e.message]
        assert back.endswith("; 1 change(s), 1 of them changed outside gpud and written back")
        assert s.view().rdma_repairs == 5
        assert show_message(s.view(), rig.clock.t).rdma_repairs == 5
        collector = Collector(lambda: None, events=EventLog(None), clock=lambda: 0.0)
        collector.add_source(TrafficMetrics(s))
        registry = CollectorRegistry()
        registry.register(collector)
        assert registry.get_sample_value("gpud_net_rdma_map_repairs_total") == 5
    finally:
        s.shutdown()


def test_a_nic_map_write_that_only_moved_the_plan_ends_the_agents_run(
    tmp_path: Path, sysfs: Path
) -> None:
    """An agent rewrites the map on two checks running (said twice); then a job's level
    moves and the write finds nothing of the agent's; a later change by an agent is its
    own, said plainly."""
    from netshaper.dcb import DryRunBackend, NicMap

    backend = DryRunBackend(lambda line: None)
    rig = Rig(tmp_path, sysfs)
    s = rig.with_nic(NicMap(backend, ["eth2"], link_type=ether))
    try:
        s.tick()
        assert s.settle(5)
        tag = s.tags.allocations()["a"]
        for _ in range(2):
            backend._shown["eth2"][tag] = (3,)
            rig.clock.t += RDMA_RECHECK_S
            s.tick()
            assert s.settle(5)
        s.pin("a", 3)  # gpud's own entry moves: no agent in this write
        rig.clock.t += 1
        s.tick()
        assert s.settle(5) and backend._shown["eth2"][tag] == (4,)
        backend._shown["eth2"][tag] = (3,)
        rig.clock.t += RDMA_RECHECK_S
        s.tick()
        assert s.settle(5) and backend._shown["eth2"][tag] == (4,)
        drifts = [e.message for e in rig.events.recent(100, "net.rdma_drift")]
        assert len(drifts) == 3, drifts
        assert "keeps changing" not in drifts[2]
        assert s.view().rdma_repairs == 3
    finally:
        s.shutdown()


def test_an_agents_entry_written_back_with_a_moved_plan_is_said_and_counted(
    tmp_path: Path, sysfs: Path
) -> None:
    """An agent changes job a's entry, and job b's level moves before the next check:
    the one write puts both right; a's is a write-back (said, counted), b's a change."""
    from netshaper.dcb import DryRunBackend, NicMap

    backend = DryRunBackend(lambda line: None)
    rig = Rig(tmp_path, sysfs, group_tolerance=0.0)
    s = rig.with_nic(NicMap(backend, ["eth2"], link_type=ether))
    try:
        s.tick()
        assert s.settle(5)
        tags = s.tags.allocations()
        backend._shown["eth2"][tags["a"]] = (3,)
        s.pin("b", 3)
        rig.clock.t += 1
        s.tick()
        assert s.settle(5)
        assert backend._shown["eth2"][tags["a"]] == (7,)
        assert backend._shown["eth2"][tags["b"]] == (4,)
        (drift,) = [e.message for e in rig.events.recent(100, "net.rdma_drift")]
        assert drift == "NIC DSCP -> priority map changed outside gpud: 1 entry written back"
        said = [e.message for e in rig.events.recent(100, "net.rdma") if e.kind == "net.rdma"]
        assert said[-1] == "NIC DSCP -> priority map: 1 change(s)"
        assert s.view().rdma_repairs == 1
    finally:
        s.shutdown()


class _Eth3Fails:
    """``dcb`` as the dry run prints it, whose writes on eth3 fail while ``fail`` is set
    (after the kernel took them, with ``took_it``: ``dcb`` timed out past its write)."""

    def __init__(self) -> None:
        from netshaper.dcb import DryRunBackend

        self.dry = DryRunBackend(lambda line: None)
        self.fail = False
        self.took_it = False

    @property
    def netns(self) -> str | None:
        return None

    def current(self, netdev: str) -> dict[int, tuple[int, ...]]:
        return self.dry.current(netdev)

    def apply(self, netdev: str, want: Mapping[int, int]) -> MapResult:
        from netshaper.dcb import DcbError

        if netdev == "eth3" and self.fail:
            if self.took_it:
                self.dry.apply(netdev, want)
            raise DcbError(netdev, "app replace failed (exit 1)", detail="No such device")
        return self.dry.apply(netdev, want)

    def table(self, netdev: str) -> dict[int, tuple[int, ...]]:
        return self.dry._shown.setdefault(netdev, {})


@contextlib.contextmanager
def _written_on_eth2_and_eth3(
    rig: Rig, jobs: Sequence[str] = ("a", "b")
) -> Iterator[tuple[_Eth3Fails, TrafficService]]:
    """A service that wrote the map of ``jobs`` (all in use) on eth2 and eth3."""
    from netshaper.dcb import NicMap

    backend = _Eth3Fails()
    s = rig.with_nic(NicMap(backend, ["eth2", "eth3"], link_type=ether))
    rig.jobs, rig.active = list(jobs), set(jobs)
    try:
        s.tick()
        assert s.settle(5)
        yield backend, s
    finally:
        s.shutdown()


def _write(rig: Rig, s: TrafficService, after: float = RDMA_RECHECK_S) -> None:
    rig.clock.t += after
    s.tick()
    assert s.settle(5)


def _written_with_no_write_back(rig: Rig, s: TrafficService) -> None:
    """The last write held everywhere, and no write counted or said a change outside gpud."""
    assert s.view().rdma_error == ""
    assert s.view().rdma_repairs == 0
    assert [e.message for e in rig.events.recent(100) if "outside gpud" in e.message] == []


@pytest.mark.parametrize("took_it", [False, True])
def test_a_level_back_after_a_move_that_failed_on_one_netdev_is_no_write_back(
    tmp_path: Path, sysfs: Path, took_it: bool
) -> None:
    """a at 7 on eth2 and eth3; a move to 5 is written on eth2 and fails on eth3 (before
    or after its kernel took it); a back at 7: gpud's own moves, no tool's change."""
    rig = Rig(tmp_path, sysfs)
    with _written_on_eth2_and_eth3(rig) as (backend, s):
        tag = s.tags.allocations()["a"]
        backend.fail, backend.took_it = True, took_it
        s.pin("a", 2)
        _write(rig, s, 1)
        assert "eth3" in s.view().rdma_error
        assert backend.table("eth2")[tag] == (5,)
        backend.fail = False
        s.pin("a", 0)
        _write(rig, s, 1)
        assert backend.table("eth2")[tag] == backend.table("eth3")[tag] == (7,)
        _written_with_no_write_back(rig, s)


def test_a_tag_let_go_while_one_netdev_failed_and_reused_is_no_write_back(
    tmp_path: Path, sysfs: Path
) -> None:
    """a's DSCP at 7; a goes and the write of the map without it fails on eth3; an agent
    puts its own priority on that DSCP; c gets the DSCP at 7: gpud let go of the entry,
    what the agent put there is not a change to gpud's."""
    rig = Rig(tmp_path, sysfs, dscp_pool="26")  # one DSCP: c gets the one a had
    with _written_on_eth2_and_eth3(rig, ["a"]) as (backend, s):
        tag = s.tags.allocations()["a"]
        backend.fail = True
        rig.jobs, rig.active = [], set()
        _write(rig, s, 1)
        assert "eth3" in s.view().rdma_error
        backend.table("eth2")[tag] = backend.table("eth3")[tag] = (3,)
        backend.fail = False
        rig.jobs, rig.active = ["c"], {"c"}
        _write(rig, s, RDMA_RETRY_S)
        assert s.tags.allocations()["c"] == tag
        assert backend.table("eth2")[tag] == backend.table("eth3")[tag] == (7,)
        _written_with_no_write_back(rig, s)


def test_a_netdev_back_with_an_empty_table_is_written_not_counted_as_a_write_back(
    tmp_path: Path, sysfs: Path
) -> None:
    """eth3 goes (its write fails) and comes back with an empty APP table (a driver reset,
    its VF re-created): its entries are written again as changes, no tool's."""
    rig = Rig(tmp_path, sysfs)
    with _written_on_eth2_and_eth3(rig) as (backend, s):
        tags = s.tags.allocations()
        backend.fail = True  # eth3 gone, with its table
        backend.table("eth3").clear()
        _write(rig, s)
        assert "eth3" in s.view().rdma_error
        backend.fail = False
        _write(rig, s, RDMA_RETRY_S)
        _written_with_no_write_back(rig, s)
        assert backend.table("eth3") == {tags["a"]: (7,), tags["b"]: (6,)}
        (back,) = [e.message for e in rig.events.recent(100, "net.rdma") if "(was: " in e.message]
        assert back.endswith("; 2 change(s)")
        backend.table("eth3").clear()  # gone from a netdev with no failure since: a tool's
        _write(rig, s)
        assert s.view().rdma_repairs == 1


def test_a_netdev_made_again_between_two_checks_is_written_not_counted_as_a_write_back(
    tmp_path: Path, sysfs: Path
) -> None:
    """eth3 is made again (a driver reset, its VF re-created: another ifindex) between two
    checks, with no write failing in between, and comes back with an empty APP table: its
    entries are written again and said, no tool's change."""
    from netshaper.dcb import NicMap

    rig = Rig(tmp_path, sysfs)
    backend = _Eth3Fails()
    indexes = {"eth2": 4, "eth3": 5}
    s = rig.with_nic(NicMap(backend, ["eth2", "eth3"], link_type=ether, ifindex=indexes.get))
    rig.jobs, rig.active = ["a", "b"], {"a", "b"}
    try:
        s.tick()
        assert s.settle(5)
        tags = s.tags.allocations()
        indexes["eth3"] = 9
        backend.table("eth3").clear()
        _write(rig, s)
        _written_with_no_write_back(rig, s)
        assert backend.table("eth3") == {tags["a"]: (7,), tags["b"]: (6,)}
        said = rig.events.recent(100, "net.rdma")[-1].message
        assert said == (
            "NIC DSCP -> priority map: 2 change(s); eth3 was made again (ifindex 9, was 5):"
            " its map written"
        )
        backend.table("eth3").clear()  # gone from the same netdev since: a tool's
        _write(rig, s)
        assert s.view().rdma_repairs == 1
    finally:
        s.shutdown()


def test_a_table_lost_after_a_write_that_failed_on_no_named_netdev_is_no_write_back(
    tmp_path: Path, sysfs: Path
) -> None:
    """A write fails without naming its netdevs, and eth3 comes back with an empty table:
    any netdev may have lost its table with that failure, so the next write that holds
    writes eth3's entries again without counting them as another tool's."""
    from netshaper.dcb import NicMap

    rig = Rig(tmp_path, sysfs)
    backend = _Eth3Fails()
    nic = _BreakableNic(NicMap(backend, ["eth2", "eth3"], link_type=ether))
    s = rig.with_nic(nic)
    try:
        s.tick()
        assert s.settle(5)
        tags = s.tags.allocations()
        nic.fail = True
        _write(rig, s)
        assert "timed out" in s.view().rdma_error
        backend.table("eth3").clear()
        nic.fail = False
        _write(rig, s, RDMA_RETRY_S)
        _written_with_no_write_back(rig, s)
        assert backend.table("eth3") == {tags["a"]: (7,), tags["b"]: (6,)}
    finally:
        s.shutdown()


def test_an_agents_change_is_written_back_on_the_netdevs_written_while_one_fails(
    tmp_path: Path, sysfs: Path
) -> None:
    """eth3 goes with its table; an agent changes eth2 before the write that fails on
    eth3, and again before the one that writes eth3 back: both are write-backs, eth3's
    lost entries are not."""
    rig = Rig(tmp_path, sysfs)
    with _written_on_eth2_and_eth3(rig) as (backend, s):
        tags = s.tags.allocations()
        backend.fail = True  # eth3 gone, with its table
        backend.table("eth3").clear()
        backend.table("eth2")[tags["a"]] = (3,)
        _write(rig, s)
        assert "eth3" in s.view().rdma_error
        assert backend.table("eth2")[tags["a"]] == (7,)
        assert s.view().rdma_repairs == 1
        backend.fail = False
        backend.table("eth2")[tags["b"]] = (3,)
        _write(rig, s, RDMA_RETRY_S)
        assert s.view().rdma_error == ""
        (back,) = [e.message for e in rig.events.recent(100, "net.rdma") if "(was: " in e.message]
        assert back.endswith("; 3 change(s), 1 of them changed outside gpud and written back")
        assert s.view().rdma_repairs == 2


def test_an_agents_entry_gpud_moves_in_the_same_write_is_a_write_back(
    tmp_path: Path, sysfs: Path
) -> None:
    """a at 7; an agent sets a's DSCP on eth2 to 3; a's level moves (5) before the next
    check: the write puts gpud's 5 over the agent's 3, still a change outside gpud."""
    rig = Rig(tmp_path, sysfs)
    with _written_on_eth2_and_eth3(rig) as (backend, s):
        tag = s.tags.allocations()["a"]
        backend.table("eth2")[tag] = (3,)
        s.pin("a", 2)
        _write(rig, s, 1)
        assert backend.table("eth2")[tag] == backend.table("eth3")[tag] == (5,)
        (drift,) = [e.message for e in rig.events.recent(100, "net.rdma_drift")]
        assert drift == "NIC DSCP -> priority map changed outside gpud: 1 entry written back"
        assert s.view().rdma_repairs == 1


@pytest.mark.parametrize(
    ("stall_iterations", "low", "high"),
    [(0, 0.35, 0.45), (8, 0.8, 0.9)],
)
def test_the_progress_estimate_takes_its_knobs_from_the_config(
    tmp_path: Path, sysfs: Path, stall_iterations: int, low: float, high: float
) -> None:
    """Ten 1 s iterations, then 2.5 s without one: the open iteration alone (0) says 0.4;
    averaged with the last 8 it says 9 / 10.5 = 0.86 (traffic.progress_stall_iterations)."""
    rig = Rig(
        tmp_path,
        sysfs,
        progress_stall_iterations=stall_iterations,
        progress_long_window_s=0.0,  # the window's rate alone
    )
    feed(rig, "a", 1.0, 10, ideal=1.0)
    rig.clock.t += 2.5
    rig.service.tick()
    (a,) = [j for j in rig.service.local_report().jobs if j.job == "a"]
    assert a.rate is not None and low < a.rate < high, a.rate


@dataclasses.dataclass
class BreakingTc(FakeTc):
    """Fails with each of ``failures`` in turn (one per pass), then works again."""

    failures: list[Exception] = dataclasses.field(default_factory=list)

    def _apply(self, plan: tcplan.TcPlan, *, drift: bool) -> FakeSync:
        if self.failures:
            err = self.failures.pop(0)
            return FakeSync({p.iface: FakeResult(p.iface, error=err) for p in plan.interfaces})
        return super()._apply(plan, drift=drift)


def test_a_broken_interface_is_one_event_when_it_breaks_and_one_when_it_recovers(
    rig: Rig,
) -> None:
    rig.tc = BreakingTc()
    rig.service = rig.make()
    rig.active = {"a"}
    rig.service.tick()
    rig.tc.failures = [
        RuntimeError("eth0: the interface disappeared (tc class change dev eth0 ...)"),
        RuntimeError("eth0: no such network interface"),
        RuntimeError("eth0: no such network interface"),
    ]
    for _ in range(3):
        rig.service.tick()
    (iface,) = rig.service.view().interfaces
    assert iface.error == "eth0: no such network interface"  # the reason as it is now
    rig.service.tick()
    errors = rig.events.recent(100, kind_prefix="net.interface_error")
    assert [(e.message, e.fields["interface"]) for e in errors] == [
        ("eth0: the interface disappeared (tc class change dev eth0 ...)", "eth0")
    ]
    (back,) = [e for e in rig.events.recent(100) if e.kind == "net.interface"]
    assert back.message == "eth0: enforced again (was: no such network interface)"
    assert rig.service.view().interfaces[0].enforced


def test_before_its_first_tick_a_restarted_gpud_shows_the_levels_in_force(rig: Rig) -> None:
    rig.active = {"a"}
    rig.service.pin("a", 2)
    rig.service.tick()
    rig.service = rig.make()  # kill -9 and start again
    rig.service.start()
    (a,) = [j for j in rig.service.view().jobs if j.job == "a"]
    assert a.dscp and a.level == 2  # its leaf's level in the kernel, not the default class
    rig.service.tick()
    assert [j.level for j in rig.service.view().jobs if j.job == "a"] == [2]
    assert "net.levels" not in rig.kinds()


PFIFO_FAST = tcplan.RootQdisc("pfifo_fast", 0)


@dataclasses.dataclass
class RefusingTc(FakeTc):
    """Refuses to remove gpud's tree (EPERM, as netlink says it)."""

    def restore(
        self, iface: str, original: tcplan.RootQdisc | None = None, *, ifindex: int | None = None
    ) -> FakeRestored:
        raise RuntimeError(f"{iface}: Operation not permitted")


def test_a_tree_that_stays_on_an_interface_taken_out_gives_its_reason(
    tmp_path: Path, sysfs: Path
) -> None:
    """Every net.interface_error carries ``reason``, also this one: a script reading the
    field of the kind finds it."""
    rig = Rig(tmp_path, sysfs, link_rates=("eth1=1gbit",))
    rig.config = dataclasses.replace(rig.config, interfaces=("eth0", "eth1"))
    rig.service = rig.make()
    rig.service.start()
    rig.service.tick()
    rig.tc = RefusingTc(states=dict(rig.tc.states))
    rig.config = dataclasses.replace(rig.config, interfaces=("eth0",), link_rates=())
    rig.service = rig.make()
    rig.service.start()
    (event,) = rig.events.recent(100, kind_prefix="net.interface_error")
    assert event.fields == {"interface": "eth1", "reason": "eth1: Operation not permitted"}
    assert "gpud's tree stays: eth1: Operation not permitted" in event.message


@dataclasses.dataclass
class UnreadRenamedTc(FakeTc):
    """A restore refused: another MAC on the netdev's ifindex, whose tc state cannot be
    read, so gpud's tree may be on it (``tree_left`` None)."""

    def restore(
        self, iface: str, original: tcplan.RootQdisc | None = None, *, ifindex: int | None = None
    ) -> FakeRestored:
        raise TcError(
            iface,
            "no such network interface (ifindex 5 is now x1, MAC 02:11:22:33:44:55, was"
            " 02:00:00:00:00:bb, gpud's tree on it unknown (cannot read tc state: EPERM):"
            " not taken for eth1)",
            errno=errno.ENODEV,
            tree_left=None,
        )


def test_an_interface_taken_out_whose_tree_may_stay_is_said_and_kept_for_the_next_start(
    tmp_path: Path, sysfs: Path
) -> None:
    """A refusal says ENODEV, but gpud's tree may be on the netdev it left alone: the
    operator is told, and the record stays, so a later start tries again."""
    rig = Rig(tmp_path, sysfs, link_rates=("eth1=1gbit",))
    rig.config = dataclasses.replace(rig.config, interfaces=("eth0", "eth1"))
    rig.service = rig.make()
    rig.service.start()
    rig.service.tick()
    rig.tc = UnreadRenamedTc(states=dict(rig.tc.states))
    rig.config = dataclasses.replace(rig.config, interfaces=("eth0",), link_rates=())
    rig.service = rig.make()
    rig.service.start()
    (event,) = rig.events.recent(100, kind_prefix="net.interface_error")
    assert event.fields["interface"] == "eth1"
    assert "gpud's tree on it unknown" in event.message
    assert "eth1" in ShapedInterfaces(rig.store).all()


@dataclasses.dataclass
class NotPutBackTc(FakeTc):
    """Deletes gpud's tree, and the re-install of the original root is refused (EPERM)."""

    def restore(
        self, iface: str, original: tcplan.RootQdisc | None = None, *, ifindex: int | None = None
    ) -> FakeRestored:
        self.states.pop(iface, None)
        raise TcError(
            iface,
            "cannot re-install the original pfifo_fast root: EPERM",
            op=f"qdisc replace dev {iface} root pfifo_fast",
            errno=errno.EPERM,
            tree_left=False,
            tree_removed=True,
        )


def _eth1_taken_out(tmp_path: Path, sysfs: Path, tc: Callable[[FakeTc], FakeTc]) -> Rig:
    """eth0 and eth1 shaped, then gpud started again with eth1 out of the config."""
    rig = Rig(tmp_path, sysfs, link_rates=("eth1=1gbit",))
    rig.config = dataclasses.replace(rig.config, interfaces=("eth0", "eth1"))
    rig.service = rig.make()
    rig.service.start()
    rig.service.tick()
    rig.tc = tc(rig.tc)
    rig.config = dataclasses.replace(rig.config, interfaces=("eth0",), link_rates=())
    rig.service = rig.make()
    rig.service.start()
    return rig


def test_an_interface_taken_out_whose_original_root_is_not_put_back_says_the_tree_is_gone(
    tmp_path: Path, sysfs: Path
) -> None:
    rig = _eth1_taken_out(tmp_path, sysfs, lambda tc: NotPutBackTc(states=dict(tc.states)))
    (event,) = rig.events.recent(100, kind_prefix="net.interface_error")
    assert event.message == (
        "not in traffic.interfaces any more: gpud's tree removed, the original root not put"
        " back: eth1: cannot re-install the original pfifo_fast root: EPERM"
        " (tc qdisc replace dev eth1 root pfifo_fast)"
    )
    assert "eth1" not in ShapedInterfaces(rig.store).all()  # nothing of gpud's to retry


def test_an_interface_taken_out_that_is_gone_is_a_log_line(
    tmp_path: Path, sysfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="gpud.net.service"):
        rig = _eth1_taken_out(
            tmp_path, sysfs, lambda tc: FakeTc(states=dict(tc.states), missing={"eth1"})
        )
    assert rig.events.recent(100, kind_prefix="net.interface_error") == []
    assert "eth1" not in ShapedInterfaces(rig.store).all()
    (line,) = [r.getMessage() for r in caplog.records if "nothing to remove" in r.getMessage()]
    assert line == (
        "traffic: nothing to remove from eth1, not in traffic.interfaces any more: eth1: no"
        " such network interface"
    )


def test_a_stop_whose_original_root_is_not_put_back_says_gpuds_tree_is_removed(
    rig: Rig,
) -> None:
    _shaped_over(rig, PFIFO_FAST)
    rig.tc = NotPutBackTc(states=dict(rig.tc.states))
    _restart(rig).shutdown()
    (event,) = rig.events.recent(100, kind_prefix="net.interface_error")
    assert event.message == (
        "traffic.shutdown = restore: gpud's tree removed, the original root not put back:"
        " eth0: cannot re-install the original pfifo_fast root: EPERM"
        " (tc qdisc replace dev eth0 root pfifo_fast)"
    )
    assert "eth0" not in ShapedInterfaces(rig.store).all()  # nothing of gpud's is left


def _restart(rig: Rig) -> TrafficService:
    """A new service (gpud started again) that has adopted the kernel and ticked once."""
    rig.service = rig.make()
    rig.service.start()
    rig.service.tick()
    return rig.service


def _shaped_over(rig: Rig, root: tcplan.RootQdisc) -> None:
    """eth0 holds ``root`` when gpud starts (``traffic.shutdown = "restore"``)."""
    rig.config = dataclasses.replace(rig.config, shutdown="restore")
    rig.tc.states["eth0"] = tcplan.InterfaceState("eth0", root)
    _restart(rig)


def test_restore_gives_back_the_root_from_before_gpud_first_took_the_interface(
    rig: Rig,
) -> None:
    _shaped_over(rig, PFIFO_FAST)
    # kill -9: the next start finds gpud's own tree, which hides what was there before
    _restart(rig).shutdown()
    assert rig.tc.restored_to == {"eth0": PFIFO_FAST}
    (done,) = [e for e in rig.events.recent(100) if e.kind == "net.unshaped"]
    assert "its root qdisc from before gpud is back: pfifo_fast (default options)" in done.message
    # restored: forgotten, so a later start records whatever is there then
    assert ShapedInterfaces(rig.store).original("eth0") is None


def test_a_restore_on_a_netdev_down_without_gpuds_tree_does_not_call_its_root_noqueue(
    rig: Rig,
) -> None:
    _shaped_over(rig, PFIFO_FAST)
    # gpud's tree removed by hand, and the netdev set down: the kernel dumps no root
    rig.tc.states["eth0"] = tcplan.InterfaceState("eth0", None)
    rig.service.shutdown()
    (done,) = [e for e in rig.events.recent(100) if e.kind == "net.unshaped"]
    assert done.message == (
        "eth0: traffic.shutdown = restore: gpud's HTB root was not there: the root qdisc"
        " found (none (a netdev not up since it was made, or its root deleted while down))"
        " is left as it is"
    )


def test_a_root_changed_while_gpud_was_stopped_is_the_new_original(rig: Rig) -> None:
    _shaped_over(rig, PFIFO_FAST)
    # gpud stopped fail-static; the operator replaced gpud's tree by another root
    bfifo = tcplan.RootQdisc("bfifo", 0x10000)
    _shaped_over(rig, bfifo)
    _restart(rig).shutdown()
    assert rig.tc.restored_to == {"eth0": bfifo}


def _made_again(rig: Rig) -> None:
    """eth0 deleted and created again: a bare netdev under the name, another ifindex."""
    rig.tc.states.pop("eth0", None)
    rig.tc.replaced["eth0"] = "ifindex 9, was 4"
    rig.tc.ifindexes["eth0"] = 9


def test_a_netdev_made_again_before_the_first_tick_is_named_so_not_taken_over(
    rig: Rig,
) -> None:
    rig.active = {"a"}
    rig.service.tick()  # gpud's tree on eth0; then kill -9
    rig.service = rig.make()
    rig.service.start()  # adopts gpud's tree on the old netdev
    _made_again(rig)
    rig.service.tick()
    takeovers = [e for e in rig.events.recent(100) if e.kind == "net.takeover"]
    assert [e.fields["interface"] for e in takeovers] == [""]  # the nftables table's alone
    (drift,) = [e for e in rig.events.recent(100) if e.kind == "net.drift"]
    assert drift.message.startswith(
        "eth0: another netdev by that name (ifindex 9, was 4): gpud's tree built on it again,"
    )
    assert rig.service.view().interfaces[0].enforced


@dataclasses.dataclass
class RenamedTc(FakeTc):
    """eth0 renamed x0 since the last pass: the restore finds x0 by its ifindex, with
    gpud's tree on it (``ours``) or not."""

    ours: bool = True

    def restore(
        self, iface: str, original: tcplan.RootQdisc | None = None, *, ifindex: int | None = None
    ) -> FakeRestored:
        return FakeRestored(self.ours, root=PFIFO_FAST if self.ours else BFIFO, renamed="x0")


BFIFO = tcplan.RootQdisc("bfifo", 0x50000)


@pytest.mark.parametrize(
    ("ours", "what"),
    [
        (
            True,
            "restored there: gpud's HTB root removed, its root qdisc from before gpud is back:"
            " pfifo_fast (default options)",
        ),
        # the tree removed by hand from x0 before the stop: nothing was restored there
        (
            False,
            "found there: gpud's HTB root was not there: the root qdisc found (bfifo 5:) is"
            " left as it is",
        ),
    ],
)
def test_a_restore_on_a_renamed_netdev_says_what_it_found_there(
    rig: Rig, ours: bool, what: str
) -> None:
    _shaped_over(rig, PFIFO_FAST)
    rig.tc = RenamedTc(states=dict(rig.tc.states), ours=ours)
    _restart(rig).shutdown()
    (done,) = [e for e in rig.events.recent(100) if e.kind == "net.unshaped"]
    assert done.message == (
        f"eth0: traffic.shutdown = restore: renamed to x0 since gpud shaped it, {what}"
    )


@dataclasses.dataclass
class NotTakenTc(FakeTc):
    """eth0's restore refused: another netdev (``x0``) on its ifindex, and ``left`` what
    the adapter says of gpud's tree there (``tree_left``)."""

    left: bool | None = None
    why: str = "gpud's tree on it unknown (cannot read tc state: EPERM)"

    def restore(
        self, iface: str, original: tcplan.RootQdisc | None = None, *, ifindex: int | None = None
    ) -> FakeRestored:
        raise TcError(
            iface,
            f"no such network interface (ifindex 4 is now x0, {self.why}: not taken for eth0)",
            errno=errno.ENODEV,
            tree_left=self.left,
        )


@pytest.mark.parametrize("left", [True, None])
def test_a_restore_refused_where_gpuds_tree_may_stay_is_an_event_naming_the_netdev(
    rig: Rig, left: bool | None
) -> None:
    _shaped_over(rig, PFIFO_FAST)
    rig.tc = NotTakenTc(states=dict(rig.tc.states), left=left)
    _restart(rig).shutdown()
    (refused,) = [e for e in rig.events.recent(100) if e.kind == "net.interface_error"]
    assert refused.message == (
        "traffic.shutdown = restore, not done: eth0: no such network interface (ifindex 4 is"
        " now x0, gpud's tree on it unknown (cannot read tc state: EPERM): not taken for eth0)"
    )
    assert refused.fields["interface"] == "eth0"


@pytest.mark.parametrize(
    "why",
    [
        # deleted, and another netdev (another MAC, nothing of gpud's) made with its index
        "MAC 02:11:22:33:44:55, was 02:00:00:00:00:aa",
        # ip link del eth1; ip link set eth0 name eth1: eth1's, restored by its own restore
        "eth1's at gpud's last look-up, restored as eth1",
    ],
)
def test_a_restore_refused_where_nothing_of_gpuds_is_left_raises_no_alert(
    rig: Rig, why: str
) -> None:
    _shaped_over(rig, PFIFO_FAST)
    rig.tc = NotTakenTc(states=dict(rig.tc.states), left=False, why=why)
    _restart(rig).shutdown()
    assert [e for e in rig.events.recent(100) if e.kind == "net.interface_error"] == []


def test_a_configured_nic_that_does_not_exist_raises_no_alert_at_the_stop(rig: Rig) -> None:
    """traffic.interfaces names a NIC this node lacks: its error was said at the start;
    the stop has nothing of gpud's to give back there, so it stays quiet."""
    rig.config = dataclasses.replace(rig.config, shutdown="restore")
    rig.tc.missing.add("eth0")
    service = _restart(rig)
    before = len(rig.events.recent(100, kind_prefix="net.interface_error"))
    service.shutdown()
    assert len(rig.events.recent(100, kind_prefix="net.interface_error")) == before


def test_restore_leaves_a_netdev_made_again_before_the_first_tick_its_own_root(
    rig: Rig,
) -> None:
    rig.config = dataclasses.replace(rig.config, shutdown="restore")
    rig.tc.states["eth0"] = tcplan.InterfaceState("eth0", PFIFO_FAST)
    rig.service = rig.make()
    rig.service.start()  # records the old netdev's pfifo_fast
    _made_again(rig)
    rig.service.tick()
    # the record was the old netdev's: a restart (kill -9 here) does not take it back up
    assert ShapedInterfaces(rig.store).original("eth0") is None
    rig.service.shutdown()
    assert rig.tc.restored_to == {"eth0": None}
    (done,) = [e for e in rig.events.recent(100) if e.kind == "net.unshaped"]
    assert done.message == (
        "eth0: traffic.shutdown = restore: another netdev by that name since gpud took it"
        " (ifindex 9, was 4): gpud's HTB root removed from it, the root qdisc the kernel"
        " gave it is left; the old netdev's pfifo_fast is not put on it"
    )


def test_restore_on_a_netdev_made_again_after_the_last_tick_leaves_its_root(rig: Rig) -> None:
    _shaped_over(rig, PFIFO_FAST)
    _made_again(rig)  # after the last pass, before the stop: the restore finds it
    rig.service.shutdown()
    assert rig.tc.restored_to == {}  # gpud's tree went with the old netdev: nothing to do
    (done,) = [e for e in rig.events.recent(100) if e.kind == "net.unshaped"]
    assert done.message == (
        "eth0: traffic.shutdown = restore: another netdev by that name since gpud took it"
        " (ifindex 9, was 4): gpud's tree went with the old one, the root qdisc the kernel"
        " gave it is left; the old netdev's pfifo_fast is not put on it"
    )


def test_a_job_tagged_outside_the_tick_is_no_longer_listed_as_untagged(
    tmp_path: Path, sysfs: Path
) -> None:
    """A job left without a tag by the tick that gets one from ``gpuctl run`` (or the
    admission queue) once another job goes idle is tagged: neither ``gpuctl net show`` nor
    ``gpud_net_untagged_jobs`` keeps calling it untagged."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-11")
    s = rig.service
    rig.active = {"a", "b", "c"}
    s.tick()
    assert set(s.view().untagged) == {"c"}
    rig.active = {"a", "c"}  # b stops, and stays idle for idle_after_s
    rig.clock.t += rig.config.idle_after_s + 1
    dscp = s.tag("c")  # gpuctl run: b's tag goes to c at once
    assert s.view().untagged == {}
    s.tick()
    assert s.view().untagged == {} and s.tags.allocations()["c"] == dscp


def test_a_removed_jobs_cgroup_that_still_holds_processes_is_said_once(rig: Rig) -> None:
    """A job removed while processes remain in its cgroup (they left gpuctl run's process
    group and environment): their packets are no longer marked, and the cgroup stays until
    they exit. One event names them, not one per tick."""
    (rig.tmp / "proc" / "4242").mkdir(parents=True)
    (rig.tmp / "proc" / "4242" / "environ").write_bytes(b"GPUD_JOB=a\0")
    rig.service.place("a", 4242)
    rig.jobs.remove("a")
    rig.service.tick()
    rig.service.tick()
    (event,) = [e for e in rig.events.recent(100) if e.kind == "net.cgroup_busy"]
    assert "job a is removed" in event.message and "4242" in event.message
    assert str(rig.cgroups.dir("a")) in event.message
    (rig.cgroups.dir("a") / "cgroup.procs").unlink()  # they exited
    rig.service.tick()
    assert not rig.cgroups.dir("a").exists()


def test_a_jobs_cgroup_removed_outside_gpud_is_said_once(rig: Rig) -> None:
    """An operator moves a running job's processes out of its cgroup and removes it: its
    rule goes (nothing is left to mark), and one event names the job, not one per tick."""
    (rig.tmp / "proc" / "4242").mkdir(parents=True)
    (rig.tmp / "proc" / "4242" / "environ").write_bytes(b"GPUD_JOB=a\0")
    rig.service.place("a", 4242)
    rig.service.tick()
    assert [m.job for m in rig.marker.marks] == ["a"]
    (rig.cgroups.dir("a") / "cgroup.procs").unlink()
    rig.cgroups.dir("a").rmdir()
    rig.service.tick()
    rig.service.tick()
    assert rig.marker.marks == set()
    (gone,) = [e for e in rig.events.recent(100) if e.kind == "net.cgroup_gone"]
    assert gone.fields == {"job": "a"}
    assert f"job a: its cgroup {rig.cgroups.dir('a')} was removed outside gpud" in gone.message
    rig.service.place("a", 4242)  # its next run: marked again, nothing more said
    rig.service.tick()
    assert [m.job for m in rig.marker.marks] == ["a"]
    assert rig.kinds().count("net.cgroup_gone") == 1


class _RacingCgroups(JobCgroups):
    """Cgroups where, as the marks are read, a tick releases ``job``'s tag and removes its
    cgroup (the job was removed): what a tick may do while place() syncs the marks."""

    def __init__(self, mount: Path, *, nft_root: Path) -> None:
        super().__init__(mount, nft_root=nft_root)
        self.race: Callable[[str], None] = lambda job: None

    def mark(self, job: str, dscp: int) -> CgroupMark | None:
        self.race(job)
        return super().mark(job, dscp)


def test_a_cgroup_gpud_removes_while_a_process_is_placed_is_not_said_gone(
    tmp_path: Path, sysfs: Path
) -> None:
    rig = Rig(tmp_path, sysfs)
    rig.cgroups = _RacingCgroups(rig.cg_root / "unified", nft_root=rig.cg_root)
    rig.service = rig.make()
    for pid, job in ((4242, "a"), (4343, "b")):
        (rig.tmp / "proc" / str(pid)).mkdir(parents=True)
        (rig.tmp / "proc" / str(pid) / "environ").write_bytes(f"GPUD_JOB={job}\0".encode())
        rig.service.place(job, pid)
    assert [m.job for m in sorted(rig.marker.marks)] == ["a", "b"]

    def removed(job: str) -> None:
        if job == "b":  # b was removed: the tick's pass releases its tag, then its cgroup
            rig.jobs.remove("b")
            rig.service.tags.release("b")
            (rig.cgroups.dir("b") / "cgroup.procs").unlink()
            assert rig.cgroups.remove("b")

    rig.cgroups.race = removed
    rig.service.place("a", 4242)
    rig.cgroups.race = lambda job: None
    rig.service.tick()
    assert [m.job for m in rig.marker.marks] == ["a"]
    assert "net.cgroup_gone" not in rig.kinds()


@pytest.mark.parametrize("tick_between", [False, True], ids=["removed", "removed-and-ticked"])
def test_a_job_removed_as_its_process_is_placed_leaves_nothing_past_the_next_tick(
    rig: Rig, tick_between: bool
) -> None:
    """`gpuctl jobs rm --force a` lands between PlaceProcess's job check and its cgroup
    write (and a traffic tick too, which releases a's tag: placing tags a again). The
    process still lands in a's cgroup and gets a mark; the removal SIGTERMs it (its
    environment names the run). The next tick once it has exited leaves no cgroup, no nft
    rule and no tag of a."""
    (rig.tmp / "proc" / "4242").mkdir(parents=True)
    (rig.tmp / "proc" / "4242" / "environ").write_bytes(b"GPUD_JOB=a\0")
    checked = []

    def registry() -> list[str]:
        names = list(rig.jobs)
        if not checked and service is not None:  # PlaceProcess's check: a goes right after
            checked.append(names)
            rig.jobs.remove("a")
            if tick_between:
                service.tick()
        return names

    service: TrafficService | None = None
    service = rig.make(jobs=registry)
    service.tag("a")  # tagged as its run started
    path = service.place("a", 4242)
    assert checked and path.endswith("gpud-job-a") and "a" in service.tags.allocations()
    assert [m.job for m in rig.marker.marks] == ["a"]
    (rig.cgroups.dir("a") / "cgroup.procs").unlink()  # SIGTERMed, it exited: the cgroup empty
    service.tick()
    assert not rig.cgroups.dir("a").exists() and rig.marker.marks == set()
    assert "a" not in service.tags.allocations() and "a" not in service.view().untagged
    assert "a" not in TagStore(rig.store, pool=job_pool(rig.config)).allocations()  # stored


def test_the_shortest_declared_iteration_is_the_trackers_shortest_iteration() -> None:
    # gpuctl checks `net report --ideal` against gpud.shared's bound (it imports no
    # netshaper); gpud and its tracker hold reports to netshaper's
    from gpud.shared import MIN_IDEAL_S
    from netshaper.progress import MIN_ITERATION_S

    assert MIN_IDEAL_S == MIN_ITERATION_S


def test_a_wall_clock_stepped_back_holds_back_no_idle_tag_nor_nic_retry(
    tmp_path: Path, sysfs: Path
) -> None:
    """The wall clock steps back an hour (NTP, ``date -s``): an idle job's tag still goes to
    a job that needs one after ``traffic.idle_after_s``, and a NIC map write that failed is
    tried again after ``RDMA_RETRY_S``, not an hour later."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-11")  # two tags, three jobs
    s = rig.service
    rig.active = {"a", "b", "c"}
    feed(rig, "b", 0.5, 4)
    s.tick()
    assert set(s.tags.allocations()) == {"a", "b"}
    rig.active = {"a", "c"}  # b stops
    rig.clock.step(-3600)
    rig.clock.t += rig.config.idle_after_s + 1
    s.tick()
    assert s.tags.allocations()["c"] in (10, 11) and "b" not in s.tags.allocations()
    nic, s = _failed_nic_map(rig)
    try:
        nic.fail = False
        rig.clock.step(-3600)
        rig.clock.t += RDMA_RETRY_S
        s.tick()
        assert s.settle(10) and s.view().rdma_error == ""
    finally:
        s.shutdown()


def test_progress_reports_after_a_wall_clock_step_back_are_taken(
    tmp_path: Path, sysfs: Path
) -> None:
    """Reports stamped after the node's clock stepped back an hour are accepted and ranked
    at once (the window starts again from them, at their own pace), not refused, nor
    told to the progress tracker at the last stamp before the step, until the clock
    catches up."""
    rig = Rig(tmp_path, sysfs)
    s = rig.service
    rig.active = {"a"}
    feed(rig, "a", 0.5, 40, ideal=0.5)
    rig.clock.step(-3600)
    for n in range(41, 81):
        rig.clock.t += 1.0
        s.report(Report("a", n, rig.clock.t, 0.5, session="s"))
    s.tick()
    (a,) = [j for j in s.view().jobs if j.job == "a"]
    assert s.rejected_reports == 0 and a.iterations == 80
    assert a.iteration_s == pytest.approx(1.0) and a.rate == pytest.approx(0.5)


def test_a_full_pool_right_after_start_says_when_idle_tags_are_handed_over(
    tmp_path: Path, sysfs: Path
) -> None:
    """For traffic.idle_after_s after gpud starts no job counts as idle: the refusal says
    so, and when that ends, rather than call every holder a job in use."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-11")
    s = rig.service
    s.tick()  # a and b hold the two tags; neither runs
    rig.clock.t += 20
    with pytest.raises(ResourceExhausted) as refused:
        s.tag("c")
    message = str(refused.value)
    assert "each by a job that runs" not in message
    assert "gpud started 20 s ago" in message
    assert "handed over in 40 s" in message
    rig.clock.t += 41
    assert s.tag("c") in (10, 11)


def test_a_last_report_stays_in_the_past_when_the_wall_clock_steps_back(rig: Rig) -> None:
    """``gpuctl net show`` gives a job's last report as its age: after the wall clock steps
    back (NTP, ``date -s``) a report stamped before the step is as old as it is, not in the
    future (an age of 0, a job that stopped reporting looking fresh for as long as the
    step); a report stamped after the step is the newest."""
    s = rig.service
    rig.active = {"a"}
    s.tick()
    s.report(Report("a", 1, rig.clock.t - 2.0, session="s"))  # stamped 2 s before it came
    rig.clock.t += 10
    rig.clock.step(-3600)

    def row() -> JobTraffic:
        (found,) = [j for j in s.view().jobs if j.job == "a"]
        return found

    assert row().last_report_unix_s == pytest.approx(rig.clock.t - 12)
    assert job_message(row(), s.now()).last_report_age_seconds == pytest.approx(12)
    rig.clock.t += 5
    s.report(Report("a", 2, rig.clock.t - 1.0, session="s"))
    assert row().last_report_unix_s == pytest.approx(rig.clock.t - 1)
    # a late report, stamped before the newest, does not make the last report older
    s.report(Report("a", 2, rig.clock.t - 4.0, session="s"))
    assert job_message(row(), s.now()).last_report_age_seconds == pytest.approx(1)


class Training:
    """Jobs reporting each iteration as it completes, at their paces (s per iteration), with
    the service ticking each second."""

    def __init__(self, rig: Rig, paces: Mapping[str, float], ideal: Mapping[str, float]) -> None:
        self.rig, self.paces, self.ideal = rig, dict(paces), ideal
        self.done = dict.fromkeys(paces, 0)
        self.since = dict.fromkeys(paces, rig.clock.t)  # when each job's open one began

    def run(self, seconds: int, *, stopped: Iterable[str] = ()) -> dict[str, int | None]:
        rig = self.rig
        for _ in range(seconds):
            rig.clock.t += 1.0
            for job, pace in self.paces.items():
                if job in stopped:
                    continue
                while self.since[job] + pace <= rig.clock.t:
                    self.since[job] += pace
                    self.done[job] += 1
                    rig.service.report(
                        Report(job, self.done[job], self.since[job], self.ideal[job], "s")
                    )
            rig.service.tick()
        return self.levels()

    def suspend(self, seconds: float) -> None:
        """The node sleeps: the wall clock runs on, the monotonic clock does not."""
        self.rig.clock.step(seconds)
        for job in self.since:
            self.since[job] += seconds

    def levels(self) -> dict[str, int | None]:
        return {j.job: j.level for j in self.rig.service.local_report().jobs}


def test_a_suspended_node_resumes_with_the_levels_it_had(rig: Rig) -> None:
    """A VM suspended for an hour: reports and gpud's wall clock run on through it, the
    monotonic clock does not. No job ran in that hour, so no level moves: counted as a stall
    of every job, it ranked the job of the shortest iterations the slowest."""
    rig.active = {"a", "b", "c"}
    train = Training(rig, {"a": 0.1, "b": 1.0, "c": 8.0}, {"a": 0.1, "b": 0.5, "c": 2.0})
    before = train.run(120)
    assert before == {"a": 2, "b": 1, "c": 0}
    train.suspend(3600.0)
    assert train.run(1) == before  # the first tick after the resume
    assert train.run(60) == before
    assert rig.service.local_report().jobs[0].rate == pytest.approx(1.0, rel=0.05)


def test_a_stopped_job_holds_no_level_reservation_or_not(rig: Rig) -> None:
    """A job stopped (SIGSTOP, a debugger) past its gap limit and traffic.idle_after_s is
    not ranked, though its run holds a reservation: it held level 0 for as long as it was
    stopped. Once it runs again it is ranked at once."""
    rig.active = {"a", "b"}
    train = Training(rig, {"a": 1.0, "b": 1.0}, {"a": 0.5, "b": 0.25})
    assert train.run(60) == {"a": 1, "b": 0, "c": None}
    assert train.run(30, stopped="a")["a"] == 0  # a stall, for all gpud knows
    levels = train.run(60, stopped="a")
    assert levels["a"] is None
    assert levels["b"] is not None
    train.since["a"] = rig.clock.t
    assert train.run(2)["a"] is not None


def test_net_show_says_a_job_is_stopped_and_whether_it_holds_a_level(rig: Rig) -> None:
    """``gpuctl net show`` says why a stopped job's rate froze, and its level went: past
    its gap limit it is stopped (how long since its last progress), and silent for
    traffic.idle_after_s it is not ranked. Running again, it reads running."""
    rig.active = {"a", "b"}
    train = Training(rig, {"a": 1.0, "b": 1.0}, {"a": 0.5, "b": 0.25})
    train.run(60)

    def row() -> JobTraffic:
        (found,) = [j for j in rig.service.view().jobs if j.job == "a"]
        return found

    assert row().stopped_s is None and not row().unranked
    train.run(30, stopped="a")  # 20 iterations of 1 s each: stopped, but heard lately
    assert row().stopped_s == pytest.approx(30, abs=1) and not row().unranked
    assert job_message(row(), rig.service.now()).stopped_seconds == pytest.approx(30, abs=1)
    train.run(60, stopped="a")
    assert row().level is None and row().unranked
    msg = job_message(row(), rig.service.now())
    assert msg.stopped_unranked and msg.stopped_seconds == pytest.approx(90, abs=1)
    assert rig.service.view().gap_spacings == 20
    train.since["a"] = rig.clock.t
    train.run(2)
    assert row().stopped_s is None and not row().unranked
    assert not job_message(row(), rig.service.now()).HasField("stopped_seconds")


def test_a_job_whose_run_ended_reads_ended_not_stopped_and_holds_no_level(rig: Rig) -> None:
    """A job whose run ended (its reservation released) is done, not stopped: ``gpuctl net
    show`` says how long ago it ended, with no stop (no SIGSTOP hint), and it is not ranked
    from the end on, however lately it reported. Running again (a reservation, or progress
    after the end), it reads as any job."""
    rig.active = {"a", "b"}
    train = Training(rig, {"a": 1.0, "b": 1.0}, {"a": 0.5, "b": 0.25})
    assert train.run(60)["a"] == 1

    def row() -> JobTraffic:
        (found,) = [j for j in rig.service.view().jobs if j.job == "a"]
        return found

    rig.active = {"b"}
    rig.clock.t += 0.5  # its last iteration was reported as it ended
    rig.service.run_ended("a", since_end_s=0.5)  # what the jobs service says on release
    levels = train.run(30, stopped="a")  # past its gap limit, heard within idle_after_s
    assert levels["a"] is None and levels["b"] is not None
    assert row().ended_s == pytest.approx(30.5) and row().stopped_s is None
    msg = job_message(row(), rig.service.now())
    assert msg.ended_seconds == pytest.approx(30.5) and not msg.HasField("stopped_seconds")
    assert not msg.stopped_unranked
    # a new run of it: stopped again, for all gpud knows, until it reports
    rig.active = {"a", "b"}
    rig.service.run_started("a")  # what the jobs service says on reserve
    assert row().ended_s is None and row().stopped_s is not None
    # progress after the end: not ended, whatever holds its reservation
    rig.active = {"b"}
    rig.service.run_ended("a")
    assert row().ended_s is not None
    train.since["a"] = rig.clock.t
    assert train.run(2)["a"] is not None
    assert row().ended_s is None and row().stopped_s is None


def test_a_job_seen_only_through_its_reports_ends_with_them(rig: Rig) -> None:
    """A job that only reports (``gpuctl net report``; no run of it holds a reservation)
    has nothing gpud sees run: silent past its gap limit it reads stopped while heard
    within traffic.idle_after_s, then ended (when its last report came), not stopped for
    ever with a SIGSTOP hint. A report that makes progress brings it back."""
    rig.active = {"b"}
    train = Training(rig, {"a": 1.0, "b": 1.0}, {"a": 0.5, "b": 0.25})
    train.run(60)
    idle = rig.service.config.idle_after_s

    def row() -> JobTraffic:
        (found,) = [j for j in rig.service.view().jobs if j.job == "a"]
        return found

    last = train.since["a"]
    train.run(30, stopped="a")  # past its gap limit, heard within idle_after_s
    assert row().stopped_s is not None and row().ended_s is None
    train.run(int(idle), stopped="a")
    assert row().stopped_s is None and not row().unranked
    assert row().ended_s == pytest.approx(rig.clock.t - last, abs=1)
    msg = job_message(row(), rig.service.now())
    assert msg.HasField("ended_seconds") and not msg.HasField("stopped_seconds")
    assert row().level is None
    train.since["a"] = rig.clock.t
    assert train.run(2)["a"] is not None
    assert row().ended_s is None and row().stopped_s is None


def _silent_past_idle(rig: Rig) -> tuple[Training, Callable[[], JobTraffic]]:
    """Jobs "a" and "b" trained for a minute, "b" holding a reservation and "a" known only
    through its reports, then "a" silent past traffic.idle_after_s (ended); and a read of
    "a"'s row."""
    rig.active = {"b"}
    train = Training(rig, {"a": 1.0, "b": 1.0}, {"a": 0.5, "b": 0.25})
    train.run(60)
    train.run(int(rig.service.config.idle_after_s) + 30, stopped="a")

    def row() -> JobTraffic:
        (found,) = [j for j in rig.service.view().jobs if j.job == "a"]
        return found

    assert row().ended_s is not None
    return train, row


def _every(rig: Rig, seconds: int, each: float, job: str = "a") -> list[JobTraffic]:
    """``job`` reports one iteration every ``each`` seconds (``gpuctl net report`` from a
    script; no run of it holds a reservation) for ``seconds``, the service ticking each
    second: its row at each tick."""
    rows = []
    done = max((j.iterations or 0 for j in rig.service.view().jobs if j.job == job), default=0)
    start = rig.clock.t
    due = start + each
    for n in range(1, seconds + 1):
        while due <= start + n + 1e-6:
            rig.clock.t = due  # each report arrives when it is sent
            done += 1
            rig.service.report(Report(job, done, rig.clock.t, session="s"))
            due += each
        rig.clock.t = start + n
        rig.service.tick()
        (row,) = [j for j in rig.service.view().jobs if j.job == job]
        rows.append(row)
    return rows


def _ended(rows: list[JobTraffic]) -> list[bool]:
    return [row.ended_s is not None for row in rows]


def _ends(rows: list[JobTraffic]) -> int:
    """How many times the job read ended after running."""
    flags = [False, *_ended(rows)]
    return sum(not was and now for was, now in itertools.pairwise(flags))


def test_a_slow_reporting_job_removed_and_added_again_is_told_of_again(
    tmp_path: Path, sysfs: Path
) -> None:
    """``net.slow_reports`` is said once while gpud knows the job: after ``gpuctl jobs rm``
    (forgotten at the next tick) and the job added again under its name, its first two
    long intervals say it again."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-12")
    rig.active = {"b", "c"}
    _every(rig, 450, 90)
    assert rig.kinds().count("net.slow_reports") == 1
    rig.jobs.remove("a")
    rig.clock.t += 1
    rig.service.tick()
    rig.jobs.append("a")
    _every(rig, 450, 90)
    assert rig.kinds().count("net.slow_reports") == 2


def test_a_job_reporting_less_often_than_idle_after_s_stays_running(
    tmp_path: Path, sysfs: Path
) -> None:
    """A job known only through its reports, one every 90 s under traffic.idle_after_s =
    60: it ends at most once, while its interval is not known yet (two intervals make it),
    then runs without ending between its reports: its level stays, no level churns, and
    its tag is not handed over between reports. ``net.slow_reports`` says it, once."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-12")  # three tags, three jobs
    rig.active = {"b", "c"}
    assert _ends(_every(rig, 270, 90)) <= 1  # three reports: two intervals
    steady = _every(rig, 900, 90)
    assert not any(_ended(steady))
    assert all(row.level is not None for row in steady)
    kinds = rig.kinds()
    assert kinds.count("net.slow_reports") == 1 and "net.levels" not in kinds
    (said,) = [e for e in rig.events.recent(1000) if e.kind == "net.slow_reports"]
    assert said.fields["job"] == "a" and said.fields["interval_s"] == 90
    assert said.fields["quiet_s"] == 180
    assert "traffic.idle_after_s (60 s)" in said.message
    assert "runs again at each report" not in said.message
    (a,) = [j for j in rig.service.view().jobs if j.job == "a"]
    assert a.level is not None
    rig.jobs.append("d")
    rig.clock.t += 150  # after its last report: past idle_after_s, within its quiet time
    with pytest.raises(DscpPoolExhausted):
        rig.service.tag("d")
    # silent for twice its interval: ended, its tag free to go
    rig.clock.t += 31
    rig.service.tick()
    (a,) = [j for j in rig.service.view().jobs if j.job == "a"]
    assert a.ended_s is not None and a.level is None
    dscp = rig.service.tags.get("a")
    assert rig.service.tag("d") == dscp and "net.reclaim" in rig.kinds()


def test_a_job_that_once_reports_late_ends_once_and_keeps_its_tag(rig: Rig) -> None:
    """One late report (90 s, under traffic.idle_after_s = 60) in a job's steady 10 s
    reports is no cadence: it ends once and comes back with the same tag, and goes on at
    its usual pace without ending again."""
    rig.active = {"b"}
    _every(rig, 60, 10)
    dscp = rig.service.tags.get("a")
    assert _ends(_every(rig, 90, 90)) == 1
    assert rig.service.tags.get("a") == dscp
    assert not any(_ended(_every(rig, 100, 10)))
    assert "net.slow_reports" not in rig.kinds()


def test_a_job_that_reports_faster_is_idle_after_idle_after_s_of_silence(rig: Rig) -> None:
    """A job that reported every 100 s, then several times a second without a pause, has
    a short usual interval: silent for traffic.idle_after_s, it reads ended, not only
    after twice its old interval."""
    rig.active = {"b"}
    _every(rig, 300, 100)
    _every(rig, 30, 0.4)
    silent = _every(rig, 65, 10**6)
    assert _ended(silent)[-1]


def test_a_job_reporting_very_seldom_is_idle_after_ten_times_idle_after_s(rig: Rig) -> None:
    """A job's quiet time is at most 10 times traffic.idle_after_s, however seldom it reports:
    one that reported every 1000 s (idle_after_s 60) reads ended 600 s after its last
    report, and ``net.slow_reports`` says so."""
    rig.active = {"b"}
    _every(rig, 3000, 1000)
    silent = _every(rig, 700, 10**6)
    assert _ended(silent).index(True) == 600  # 601 s after its report
    (said,) = [e for e in rig.events.recent(1000) if e.kind == "net.slow_reports"]
    assert said.fields["interval_s"] == 1000 and said.fields["quiet_s"] == 600
    assert "after 600 s without a report" in said.message
    assert "it ends and runs again at each report" in said.message


def test_a_run_that_ends_while_a_tick_reads_the_reservations_stays_ended(rig: Rig) -> None:
    """A run released after the tick read the reservations (that read still holds it) but
    before the tick keeps what it read: the job reads ended, without its level, after that
    tick, and is not ranked by it."""
    ending: list[str] = []

    def active() -> set[str]:
        held = set(rig.active)
        for job in ending:  # the release commits while the tick goes on
            rig.active.discard(job)
            service.run_ended(job)
        ending.clear()
        return held

    rig.active = {"a", "b"}
    service = rig.make(active=active)
    service.run_started("a")
    service.report(Report("a", 1, rig.clock.t, session="s"))
    service.tick()
    rig.clock.t += 1
    service.report(Report("a", 2, rig.clock.t, session="s"))
    service.tick()
    (row,) = [j for j in service.view().jobs if j.job == "a"]
    assert row.level is not None and row.ended_s is None
    ending.append("a")
    service.tick()
    (row,) = [j for j in service.view().jobs if j.job == "a"]
    assert row.ended_s is not None and row.level is None
    at_levels = _samples(service).get_sample_value("gpud_net_level_jobs", {"level": "0"})
    service.tick()
    assert _samples(service).get_sample_value("gpud_net_level_jobs", {"level": "0"}) == at_levels
    (row,) = [j for j in service.view().jobs if j.job == "a"]
    assert row.ended_s is not None and row.level is None


def test_a_job_ended_with_its_reports_runs_again_only_with_progress(rig: Rig) -> None:
    """A job known only through its reports, ended by its silence, stays ended for a report
    that repeats its count (a last flush): not stopped with a SIGSTOP hint. A report with
    more iterations, or from a new session, runs it again."""
    train, row = _silent_past_idle(rig)
    done = train.done["a"]
    rig.service.report(Report("a", done, rig.clock.t, session="s"))
    rig.service.tick()
    assert row().ended_s is not None and row().stopped_s is None
    assert not job_message(row(), rig.service.now()).HasField("stopped_seconds")
    rig.clock.t += 1
    rig.service.report(Report("a", done + 1, rig.clock.t, session="s"))
    assert row().ended_s is None
    train.run(int(rig.service.config.idle_after_s) + 30, stopped="a")
    assert row().ended_s is not None
    rig.service.report(Report("a", 1, rig.clock.t, session="t"))  # a new run of it
    assert row().ended_s is None


def test_a_job_silent_again_after_progress_stays_ended_on_a_repeat_flush(rig: Rig) -> None:
    """A job known only through its reports that ended by its silence, ran again and fell
    silent again ended the second time: a last flush that repeats its count then is no
    progress (not stopped with a SIGSTOP hint), as after the first silence."""
    train, row = _silent_past_idle(rig)
    rig.clock.t += 1
    train.done["a"] += 1
    rig.service.report(Report("a", train.done["a"], rig.clock.t, session="s"))  # progress
    assert row().ended_s is None
    train.run(20)
    train.run(int(rig.service.config.idle_after_s) + 30, stopped="a")
    assert row().ended_s is not None
    rig.service.report(Report("a", train.done["a"], rig.clock.t, session="s"))  # last flush
    rig.service.tick()
    assert row().ended_s is not None and row().stopped_s is None
    assert not job_message(row(), rig.service.now()).HasField("stopped_seconds")
    rig.clock.t += 1
    rig.service.report(Report("a", train.done["a"] + 1, rig.clock.t, session="s"))
    assert row().ended_s is None


def test_a_silent_job_that_reserves_counts_as_running_before_the_next_tick(rig: Rig) -> None:
    """A job silent past traffic.idle_after_s (it reads ended) that reserves its devices
    since the last tick holds a reservation at once: ``gpuctl net show`` and the cluster's
    report do not call it ended, nor unranked, until that tick."""
    _, row = _silent_past_idle(rig)
    rig.active = {"a", "b"}
    rig.service.run_started("a")  # what the jobs service says on reserve
    assert row().ended_s is None
    (reported,) = [j for j in rig.service.local_report().jobs if j.job == "a"]
    assert reported.ended_s is None
    rig.service.tick()
    assert row().ended_s is None
    rig.active = {"b"}
    rig.service.run_ended("a")
    rig.service.tick()
    assert row().ended_s is not None


def test_a_report_after_the_end_that_repeats_the_count_is_no_progress(rig: Rig) -> None:
    """A last flush after the end (the same iteration count, stamped later) leaves the job
    ended, not stopped; more iterations, or a new session, are progress."""

    def ended() -> bool:
        (found,) = [j for j in rig.service.view().jobs if j.job == "a"]
        return found.ended_s is not None

    rig.service.report(Report("a", 10, rig.clock.t, 0.5, session="s"))
    rig.service.tick()
    rig.service.run_ended("a")
    rig.clock.t += 1
    rig.service.report(Report("a", 10, rig.clock.t, session="s"))
    assert ended()
    rig.service.report(Report("a", 11, rig.clock.t, session="s"))
    assert not ended()
    rig.service.run_ended("a")
    rig.clock.t += 1
    rig.service.report(Report("a", 3, rig.clock.t, session="t"))  # a new run of it
    assert not ended()


def test_a_job_removed_after_its_run_ended_is_forgotten(rig: Rig) -> None:
    rig.service.tick()
    rig.service.run_ended("a")
    rig.jobs.remove("a")
    rig.service.tick()
    rig.jobs.append("a")
    rig.service.tick()
    (a,) = [j for j in rig.service.view().jobs if j.job == "a"]
    assert a.ended_s is None


def test_the_gap_limit_is_traffic_progress_gap_spacings(tmp_path: Path, sysfs: Path) -> None:
    """A job with 1 s iterations silent for 30 s is stopped at the default 20 spacings, and
    not at ``traffic.progress_gap_spacings = 60``, which ``gpuctl net show`` says."""
    for spacings, stopped in ((20.0, True), (60.0, False)):
        rig = Rig(tmp_path / str(spacings), sysfs, progress_gap_spacings=spacings)
        rig.active = {"a"}
        train = Training(rig, {"a": 1.0}, {"a": 0.5})
        train.run(30)
        train.run(30, stopped="a")
        (a,) = [j for j in rig.service.view().jobs if j.job == "a"]
        assert (a.stopped_s is not None) is stopped, spacings
        assert rig.service.view().gap_spacings == spacings


def _rounds(rig: Rig, rounds: int, each: float, spread: Iterable[float]) -> list[JobTraffic]:
    """Job "a" reports from several processes ``spread`` seconds after each round's start
    (one iteration each), a round every ``each`` seconds, the service ticking each second:
    its row at each tick."""
    rows = []
    offsets = sorted(spread)
    done = 0
    start = rig.clock.t
    for r in range(rounds):
        base = start + r * each
        for offset in offsets:
            rig.clock.t = base + offset
            done += 1
            rig.service.report(Report("a", done, rig.clock.t, session="s"))
        for second in range(1, int(each) + 1):
            rig.clock.t = base + second
            rig.service.tick()
            (row,) = [j for j in rig.service.view().jobs if j.job == "a"]
            rows.append(row)
    return rows


def test_a_job_reporting_from_processes_a_moment_apart_keeps_the_rounds_cadence(
    rig: Rig,
) -> None:
    """Four processes of a job report 0.2 s apart, a round every 90 s (traffic.idle_after_s
    60): each round is one arrival, the job's usual interval is 90 s, and it ends at most
    once, while that interval is learnt, not between every round."""
    rig.active = {"b"}
    rows = _rounds(rig, 8, 90, (0.0, 0.2, 0.4, 0.6))
    assert _ends(rows) == 1
    (said,) = [e for e in rig.events.recent(1000) if e.kind == "net.slow_reports"]
    assert said.fields["interval_s"] == 90


def _spent(rig: Rig) -> int:
    """Jobs a, b and c run and hold the pool's three tags, gpud up past
    traffic.idle_after_s, job a reporting: a's tag."""
    rig.active = {"a", "b", "c"}
    rig.service.tick()
    rig.clock.t += 70
    rig.service.report(Report("a", 1, rig.clock.t, session="s"))
    dscp = rig.service.tags.get("a")
    assert dscp is not None
    return dscp


def test_a_run_given_its_tag_before_its_jobs_last_run_ended_starts_with_it(
    tmp_path: Path, sysfs: Path
) -> None:
    """A run of a job that took its tag while another run of the job still held (gpuctl run
    tags before it reserves) keeps it through that run's end: a job that starts meanwhile
    is refused, and the run reserves with its tag."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-12")
    dscp = _spent(rig)
    rig.clock.t += 1
    assert rig.service.tag("a") == dscp  # the second run, before its transaction
    rig.clock.t += 1
    rig.active = {"b", "c"}
    rig.service.run_ended("a")  # the first run ends
    rig.jobs.append("d")
    with pytest.raises(DscpPoolExhausted):
        rig.service.tag("d")
    assert rig.service.tags.get("a") == dscp
    assert "net.reclaim" not in rig.kinds()


def test_a_job_run_again_seconds_after_its_run_ended_finds_its_tag(
    tmp_path: Path, sysfs: Path
) -> None:
    """The tick does not hand a job's tag to an untagged job in use when the job's run
    ends: run again 4 s later (a restart wrapper), it is not refused."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-12")
    dscp = _spent(rig)
    rig.jobs.append("d")
    rig.active = {"b", "c", "d"}  # d runs untagged: the pool is spent
    rig.service.run_ended("a")
    rig.clock.t += 1
    rig.service.tick()
    assert rig.service.tags.get("d") is None
    rig.clock.t += 3
    assert rig.service.tag("a") == dscp


def test_a_spent_pool_names_the_jobs_whose_quiet_time_keeps_their_tags(
    tmp_path: Path, sysfs: Path
) -> None:
    """The refusal of a tag says a job reporting less often than traffic.idle_after_s keeps
    its tag for its quiet time, and names the job that does so now."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-12")
    rig.active = {"b", "c"}
    _every(rig, 270, 90)
    rig.jobs.append("d")
    rig.clock.t += 70  # past idle_after_s since a's last report, within its quiet time
    with pytest.raises(DscpPoolExhausted) as refused:
        rig.service.tag("d")
    message = str(refused.value)
    assert "reported in the last 60 s (traffic.idle_after_s)" in message
    assert "at most 10 times traffic.idle_after_s" in message
    assert "job a (a report every 90 s: idle in 110 s)" in message


def test_a_spent_pools_refusal_reads_the_reservations_once(tmp_path: Path, sysfs: Path) -> None:
    """A tag refused for a spent pool reads the jobs holding a reservation (a store read
    under the writer's lock) once, for both the handover it finds none for and the jobs
    it names."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-12")
    reads: list[set[str]] = []

    def active() -> set[str]:
        reads.append(set(rig.active))
        return set(rig.active)

    rig.service = rig.make(active=active)
    rig.active = {"b", "c"}
    _every(rig, 270, 90)
    rig.jobs.append("d")
    rig.clock.t += 70
    reads.clear()
    with pytest.raises(DscpPoolExhausted) as refused:
        rig.service.tag("d")
    assert "job a (a report every 90 s: idle in 110 s)" in str(refused.value)
    assert len(reads) == 1


@pytest.mark.parametrize("in_use", ["reserved", "pinned", "process in its cgroup"])
def test_a_spent_pools_refusal_does_not_name_a_job_in_use_as_idle_soon(
    tmp_path: Path, sysfs: Path, in_use: str
) -> None:
    """A job reporting less often than traffic.idle_after_s that runs (a reservation), is
    pinned or has a process in its cgroup is not idle in any time: the refusal of a tag
    does not name it."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-12")
    rig.active = {"b", "c"}
    if in_use == "reserved":
        rig.active.add("a")
    elif in_use == "pinned":
        rig.service.pin("a", 1)
    else:
        (rig.cgroups.ensure("a") / "cgroup.procs").write_text("4242\n")
    _every(rig, 270, 90)
    rig.jobs.append("d")
    rig.clock.t += 70
    with pytest.raises(DscpPoolExhausted) as refused:
        rig.service.tag("d")
    assert "job a (" not in str(refused.value)


def test_a_spent_pools_refusal_counts_a_jobs_idle_time_from_its_tag_where_later(
    tmp_path: Path, sysfs: Path
) -> None:
    """A job reporting less often, given its tag again near the end of its quiet time, is
    idle traffic.idle_after_s after its tag: the refusal says so, not its quiet time's end."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-12")
    rig.active = {"b", "c"}
    _every(rig, 270, 90)
    rig.jobs.append("d")
    rig.clock.t += 170  # 10 s of a's quiet time (180 s) left
    rig.service.tag("a")  # about to run
    with pytest.raises(DscpPoolExhausted) as refused:
        rig.service.tag("d")
    assert "job a (a report every 90 s: idle in 60 s)" in str(refused.value)


def _made_again_in_a_run_started_without_it(rig: Rig, iface: str = "eth0") -> None:
    """``iface`` (ifindex 4, gpud's tree on it) is deleted while gpud is stopped: the next
    run starts without it, it is made again (ifindex 9, a bare netdev) and that run's pass
    builds gpud's tree on it."""
    rig.tc.states.pop(iface)
    rig.tc.missing.add(iface)
    rig.service = rig.make()
    rig.service.start()  # no such netdev to adopt
    rig.tc.missing.discard(iface)
    rig.tc.ifindexes[iface] = 9
    rig.service.tick()


def _stopped_with_pfifo_fast_recorded(rig: Rig) -> None:
    """Run 1 took eth0 (ifindex 4) over pfifo_fast and stopped fail-static; then eth0 is
    made again while run 2 runs (kill -9, or a crash, after its pass)."""
    _shaped_over(rig, PFIFO_FAST)
    assert ShapedInterfaces(rig.store).original_ifindex("eth0") == 4
    _made_again_in_a_run_started_without_it(rig)


def test_a_netdev_missing_at_start_and_made_again_does_not_get_the_old_root_back(
    rig: Rig,
) -> None:
    _stopped_with_pfifo_fast_recorded(rig)
    # run 3: gpud's tree sits on ifindex 9, the record is ifindex 4's
    _restart(rig).shutdown()
    assert rig.tc.restored_to == {"eth0": None}
    assert ShapedInterfaces(rig.store).original("eth0") is None
    (done,) = [e for e in rig.events.recent(100) if e.kind == "net.unshaped"]
    assert "the kernel's default root qdisc is back" in done.message


def test_a_restore_in_the_run_that_found_the_netdev_made_again_keeps_the_old_root_off(
    rig: Rig,
) -> None:
    _stopped_with_pfifo_fast_recorded(rig)
    rig.service.shutdown()
    assert rig.tc.restored_to == {"eth0": None}


@dataclasses.dataclass
class BusyTc(FakeTc):
    """The first ``busy`` reads of eth0 before a pass fail (EBUSY, as netlink says it);
    later ones, and the passes, work."""

    busy: int = 1

    def adopt(self, ifaces: Iterable[str]) -> Mapping[str, FakeAdopted | Exception]:
        found = dict(super().adopt(ifaces))
        if self.busy and "eth0" in found:
            self.busy -= 1
            found["eth0"] = OSError(16, "eth0: Device or resource busy")
        return found


def test_a_restore_gives_back_the_recorded_root_where_the_start_could_not_read_it(
    rig: Rig,
) -> None:
    _shaped_over(rig, PFIFO_FAST)  # run 1 records pfifo_fast; kill -9
    rig.tc = BusyTc(states=dict(rig.tc.states))
    rig.service = rig.make()
    rig.service.start()
    rig.service.tick()
    rig.service.shutdown()
    assert rig.tc.restored_to == {"eth0": PFIFO_FAST}


def _busy_at_start(rig: Rig, busy: int = 1) -> None:
    """gpud starts again (the kernel as the run before left it) and cannot read eth0 in
    its first ``busy`` tries; then it ticks once."""
    rig.tc = BusyTc(states=dict(rig.tc.states), sent=dict(rig.tc.sent), busy=busy)
    rig.service = rig.make()
    rig.service.start()
    assert rig.service.view().interfaces[0].error
    rig.service.tick()


def test_a_tree_the_start_could_not_read_is_counted_from_its_first_pass(rig: Rig) -> None:
    leaf = _a_sent_at_level_1(rig, drops=0)  # then kill -9: the tree and its counts stay
    _busy_at_start(rig)
    assert rig.service.view().interfaces[0].enforced
    assert _leaf(rig, "a").classid == leaf
    assert _sent(rig, "a") == (0, 0, 0)  # the run before's 1000 bytes are not counted again
    assert sum(_level_bytes(rig).values()) == 0
    assert "eth0" in [e.fields["interface"] for e in rig.events.recent(100, "net.takeover")]
    rig.tc.sent[("eth0", leaf)] = FakeCounters(1200, 12, 0)
    rig.service.tick()
    assert _sent(rig, "a") == (200, 2, 0)


def _cake_put_on_after_a_fail_static_stop(rig: Rig) -> tcplan.RootQdisc:
    """Run 1 took eth0 over pfifo_fast (recorded) and stopped fail-static; the operator
    then replaced gpud's tree by cake, the root returned."""
    _shaped_over(rig, PFIFO_FAST)
    cake = tcplan.RootQdisc("cake", 0x80010000)
    rig.tc.states["eth0"] = tcplan.InterfaceState("eth0", cake)
    return cake


def test_a_root_put_on_while_gpud_was_stopped_is_given_back_where_the_start_could_not_read_it(
    rig: Rig,
) -> None:
    cake = _cake_put_on_after_a_fail_static_stop(rig)
    _busy_at_start(rig)  # the pass reads eth0 before it replaces cake by gpud's tree
    assert ShapedInterfaces(rig.store).original("eth0") == cake
    rig.service.shutdown()
    assert rig.tc.restored_to == {"eth0": cake}
    (done,) = [e for e in rig.events.recent(100) if e.kind == "net.unshaped"]
    assert "its root qdisc from before gpud is back: cake 8001:" in done.message


def test_an_interface_gpud_cannot_read_is_not_shaped_and_its_root_is_left_as_it_is(
    rig: Rig,
) -> None:
    cake = _cake_put_on_after_a_fail_static_stop(rig)
    _busy_at_start(rig, busy=2)  # the read before the pass fails as well
    (eth0,) = rig.service.view().interfaces
    assert not eth0.enforced and "Device or resource busy" in eth0.error
    assert rig.tc.states["eth0"].root == cake
    rig.service.shutdown()
    assert rig.tc.restored_to == {}  # pfifo_fast, recorded by run 1, is not put on
    (done,) = [e for e in rig.events.recent(100) if e.kind == "net.unshaped"]
    assert "the root qdisc found (cake 8001:) is left as it is" in done.message


def _eth1_taken_over_pfifo_fast(tmp_path: Path, sysfs: Path) -> Rig:
    """Run 1 shapes eth0 and eth1 (ifindex 4), eth1 over pfifo_fast (recorded), then
    stops."""
    rig = Rig(tmp_path, sysfs, link_rates=("eth1=1gbit",))
    rig.config = dataclasses.replace(rig.config, interfaces=("eth0", "eth1"))
    rig.tc.states["eth1"] = tcplan.InterfaceState("eth1", PFIFO_FAST)
    _restart(rig)
    return rig


def test_an_interface_taken_out_after_being_made_again_keeps_the_root_the_kernel_gave_it(
    tmp_path: Path, sysfs: Path
) -> None:
    rig = _eth1_taken_over_pfifo_fast(tmp_path, sysfs)
    assert ShapedInterfaces(rig.store).original_ifindex("eth1") == 4
    _made_again_in_a_run_started_without_it(rig, "eth1")  # run 2; then stopped
    # run 2 read eth1 before its pass: the record was ifindex 4's, dropped
    assert ShapedInterfaces(rig.store).original("eth1") is None
    rig.config = dataclasses.replace(rig.config, interfaces=("eth0",), link_rates=())
    _restart(rig)  # run 3
    assert rig.tc.restored_to == {"eth1": None}
    (done,) = [e for e in rig.events.recent(100) if e.kind == "net.unshaped"]
    assert "the kernel's default root qdisc is back" in done.message


def test_a_netdev_missing_at_start_that_comes_back_as_itself_keeps_its_original(
    rig: Rig,
) -> None:
    """Renamed away and back (ENODEV at the adopt): the same ifindex, gpud's tree and the
    record are still its own."""
    _shaped_over(rig, PFIFO_FAST)
    tree = rig.tc.states["eth0"]
    rig.tc.missing.add("eth0")
    rig.service = rig.make()
    rig.service.start()
    rig.tc.missing.discard("eth0")
    rig.tc.states["eth0"] = tree
    rig.service.tick()
    assert ShapedInterfaces(rig.store).original("eth0") == PFIFO_FAST
    _restart(rig).shutdown()
    assert rig.tc.restored_to == {"eth0": PFIFO_FAST}


def _left_by_an_older_gpud(rig: Rig) -> None:
    """An older gpud took eth0 (ifindex 4) over pfifo_fast, recorded without an ifindex,
    and left its tree there (``traffic.shutdown = "restore"`` from now on)."""
    with rig.store.transaction() as conn:  # the table as an older gpud declared it
        conn.execute("DROP TABLE net_original")
        conn.execute(
            "CREATE TABLE net_original"
            " (iface TEXT PRIMARY KEY, kind TEXT NOT NULL, handle INTEGER NOT NULL)"
        )
        conn.execute("INSERT INTO net_original VALUES ('eth0', 'pfifo_fast', 0)")
    rig.config = dataclasses.replace(rig.config, shutdown="restore")
    shaped = ShapedInterfaces(rig.store)
    assert (shaped.original("eth0"), shaped.original_ifindex("eth0")) == (PFIFO_FAST, None)
    rig.service = rig.make()
    rig.service.tick()  # gpud's tree on eth0, as the older gpud left it


def test_a_record_of_an_older_gpud_without_ifindex_is_restored_on_the_same_netdev(
    rig: Rig,
) -> None:
    _left_by_an_older_gpud(rig)
    service = _restart(rig)
    # gpud's tree is on ifindex 4: so is the record from now on
    assert ShapedInterfaces(rig.store).original_ifindex("eth0") == 4
    service.shutdown()
    assert rig.tc.restored_to == {"eth0": PFIFO_FAST}


def test_a_record_of_an_older_gpud_is_not_given_to_a_netdev_made_again_later(
    rig: Rig,
) -> None:
    _left_by_an_older_gpud(rig)
    _restart(rig)  # finds gpud's tree on ifindex 4; then kill -9
    _made_again_in_a_run_started_without_it(rig)  # then kill -9
    _restart(rig).shutdown()
    assert rig.tc.restored_to == {"eth0": None}


def test_an_interface_taken_out_whose_root_is_not_gpuds_keeps_it(
    tmp_path: Path, sysfs: Path
) -> None:
    rig = _eth1_taken_over_pfifo_fast(tmp_path, sysfs)
    bfifo = tcplan.RootQdisc("bfifo", 0x10000)
    rig.tc.states["eth1"] = tcplan.InterfaceState("eth1", bfifo)  # gpud's tree replaced
    rig.config = dataclasses.replace(rig.config, interfaces=("eth0",), link_rates=())
    _restart(rig)
    assert rig.tc.states["eth1"].root == bfifo and rig.tc.restored_to == {}
    (done,) = [e for e in rig.events.recent(100) if e.kind == "net.unshaped"]
    assert done.message == (
        "eth1: not in traffic.interfaces any more: gpud's HTB root was not there: the root"
        " qdisc found (bfifo 1:) is left as it is"
    )
    assert "eth1" not in ShapedInterfaces(rig.store).all()


def test_a_job_that_never_reported_keeps_its_tag_for_a_while_after_its_run_ends(
    tmp_path: Path, sysfs: Path
) -> None:
    """A job that ran long without a progress report (nothing in it imports Progress) was
    in use until its release: its tag is not handed over at its end, so a run of it started
    again soon after (a restart wrapper) finds it; it goes once the job has been idle for
    traffic.idle_after_s from its end."""
    rig = Rig(tmp_path, sysfs, dscp_pool="10-12")
    rig.active = {"a", "b", "c"}
    rig.service.tick()
    dscp = rig.service.tags.get("a")
    assert dscp is not None
    rig.clock.t += 600  # an hour's training, as good as: no report, no tag handed out since
    rig.service.tick()
    rig.active = {"b", "c"}
    rig.service.run_ended("a")
    rig.jobs.append("d")
    with pytest.raises(DscpPoolExhausted):
        rig.service.tag("d")
    rig.clock.t += 4
    assert rig.service.tag("a") == dscp  # run again at once: with its tag
    assert "net.reclaim" not in rig.kinds()
    rig.active = {"b", "c"}
    rig.service.run_ended("a")
    rig.clock.t += rig.config.idle_after_s + 1
    assert rig.service.tag("d") == dscp
    assert "net.reclaim" in rig.kinds()


def test_a_batch_sent_again_after_its_deadline_is_taken_not_refused_as_going_backwards(
    rig: Rig,
) -> None:
    """A job's Progress sends its batch again when gpud answered after the call's deadline
    (a slow gpud that took it): the reports it already has, stamped before its
    newest, are late, not a count going backwards. Taken and ignored; a lower count stamped
    later in the session is still refused."""
    s = rig.service
    t = rig.clock.t
    batch = [Report("a", i, t - 10 + i, session="s") for i in range(1, 6)]
    assert s.report_batch(batch) == (5, [])
    assert s.report_batch(batch) == (5, [])  # sent again
    assert s.rejected_reports == 0
    s.tick()
    (a,) = [j for j in s.local_report().jobs if j.job == "a"]
    assert a.iterations == 5
    with pytest.raises(InvalidArgument, match=r"iterations: .*4 iterations after 5"):
        s.report(Report("a", 4, t, session="s"))


def _row(rig: Rig, job: str = "a") -> JobTraffic:
    (row,) = [j for j in rig.service.view().jobs if j.job == job]
    return row


def test_a_job_without_a_session_restarted_after_the_clock_stepped_back_is_refused(
    rig: Rig,
) -> None:
    """A job reporting without a session (``gpuctl net report`` from a script) restarts from
    a checkpoint after NTP stepped the wall clock back an hour: its lower count, stamped
    before its newest, is refused as going backwards, not taken as late and ignored while
    the job reads ended."""
    s = rig.service
    rig.active = {"a"}
    for n in range(1, 11):
        rig.clock.t += 1
        s.report(Report("a", n, rig.clock.t))
    rig.clock.step(-3600)
    rig.clock.t += 1
    with pytest.raises(InvalidArgument, match=r"iterations: .*1 iterations after 10 \(going"):
        s.report(Report("a", 1, rig.clock.t))
    s.tick()
    assert s.rejected_reports == 1 and _row(rig).iterations == 10


def test_a_lower_count_in_its_session_after_the_clock_stepped_back_is_refused_not_late(
    rig: Rig,
) -> None:
    """A batch sent again seconds after gpud took it maps on the monotonic clock to when it
    was first taken: late, and ignored. A lower count in the session after the wall clock
    stepped back is stamped before the newest too, but maps after it: refused as going
    backwards."""
    s = rig.service
    rig.active = {"a"}
    batch = []
    for n in range(1, 6):
        rig.clock.t += 1
        batch.append(Report("a", n, rig.clock.t, session="s"))
    assert s.report_batch(batch) == (5, [])
    rig.clock.t += 3
    assert s.report_batch(batch) == (5, [])  # sent again after the call's deadline
    assert s.rejected_reports == 0
    rig.clock.step(-3600)
    rig.clock.t += 1
    with pytest.raises(InvalidArgument, match=r"iterations: .*1 iterations after 5 \(going"):
        s.report(Report("a", 1, rig.clock.t, session="s"))
    s.tick()
    assert _row(rig).iterations == 5


def test_a_batch_sent_again_is_no_arrival_and_keeps_a_seldom_reporting_jobs_quiet_time(
    rig: Rig,
) -> None:
    """A job reporting every 300 s (traffic.idle_after_s = 60) has its batch, its newest
    report, sent again 2.5 s after gpud took it: the same count and stamp are no new
    arrival, so its usual interval stays 300 s and it does not read ended 60 s later."""
    rig.active = {"b"}
    _every(rig, 900, 300)
    newest = Report("a", _row(rig).iterations or 0, rig.clock.t, session="s")
    rig.clock.t += 2.5
    rig.service.report(newest)
    assert not any(_ended(_every(rig, 300, 10**6)))


def _ranks(rig: Rig, counts: Sequence[int], *, period: float, rounds: int) -> list[float | None]:
    """Ranks of one job, a ``Progress`` (a session) each, reporting every ``period``
    seconds, a moment apart, rank ``i`` from ``counts[i]`` on, one iteration more each
    round: the job's rate after each round."""
    rates: list[float | None] = []
    for n in range(rounds):
        rig.clock.t += period
        for rank, base in enumerate(counts):
            rig.service.report(
                Report("a", base + n, rig.clock.t + 0.01 * rank, 0.5, session=f"rank{rank}")
            )
        rates.append(_row(rig).rate)
    return rates


def test_ranks_reporting_together_are_one_job_at_a_steady_rate_not_restarts(rig: Rig) -> None:
    """Two ranks of a data-parallel job report at once, their counts one apart (100 and 99,
    101 and 100, ...): they are ranks of one job, not a job restarting at each report. Its
    count is the lowest rank's, and a steady pace reads as a steady rate."""
    rig.service.tick()
    rates = _ranks(rig, [100, 99], period=1.0, rounds=40)
    row = _row(rig)
    assert row.iterations == 99 + 39 and row.iteration_s == pytest.approx(1.0, rel=0.01)
    # past its first rounds, which its long-run rate remembers a while
    steady = [r for r in rates[30:] if r is not None]
    assert len(steady) == 10 and max(steady) == pytest.approx(min(steady), rel=0.01)
    assert steady[-1] == pytest.approx(0.5, rel=0.03)


def test_a_job_moves_at_its_slowest_rank_and_shows_its_count(rig: Rig) -> None:
    """Ranks that do not move together (one does two iterations a round, the other one):
    the job's rate and iteration time are its slowest rank's, and its count that rank's."""
    rig.service.tick()
    for n in range(1, 41):
        rig.clock.t += 1.0
        rig.service.report(Report("a", 2 * n, rig.clock.t, 0.5, session="fast"))
        rig.service.report(Report("a", n, rig.clock.t + 0.01, 0.5, session="slow"))
    row = _row(rig)
    assert row.iterations == 40 and row.iteration_s == pytest.approx(1.0, rel=0.01)


def test_a_rank_silent_past_the_window_drops_out_and_a_new_session_lower_then_restarts(
    rig: Rig,
) -> None:
    """A rank silent for longer than traffic.progress_window_s is no rank of the job any
    more: the job's count follows the ranks that report. A new session lower than the
    job's count while one of its ranks is live is a rank behind (the count stays); once
    every session that reached the count has gone silent past the window, it is the job
    restarted from a checkpoint, and the count goes back."""
    window = rig.config.progress_window_s
    rig.service.tick()
    _ranks(rig, [100, 100], period=1.0, rounds=5)
    assert _row(rig).iterations == 104
    for n in range(1, int(window) + 3):  # rank1 stops reporting
        rig.clock.t += 1.0
        rig.service.report(Report("a", 104 + n, rig.clock.t, session="rank0"))
    assert _row(rig).iterations == 104 + int(window) + 2
    rig.service.report(Report("a", 50, rig.clock.t + 0.01, session="late-joiner"))
    assert _row(rig).iterations == 104 + int(window) + 2  # rank0 is live
    rig.clock.t += window + 1  # every session silent past the window
    rig.service.report(Report("a", 60, rig.clock.t, session="restarted"))
    assert _row(rig).iterations == 60


def test_a_rank_going_backwards_in_its_session_is_refused_though_another_reported_since(
    rig: Rig,
) -> None:
    """Each session's count is checked against its own last, whichever rank reported in
    between: a rank going backwards is refused, not read as the job restarting."""
    s = rig.service
    s.report(Report("a", 10, rig.clock.t, session="rank0"))
    s.report(Report("a", 9, rig.clock.t, session="rank1"))
    with pytest.raises(InvalidArgument, match=r"iterations: job 'a': 5 iterations after 10"):
        s.report(Report("a", 5, rig.clock.t, session="rank0"))
    s.tick()
    assert _row(rig).iterations == 10


def test_sessions_of_one_job_are_bounded_and_one_too_many_is_refused(rig: Rig) -> None:
    """A job has at most MAX_JOB_SESSIONS sessions live at once: one more (a client making
    a session per report) is refused with RESOURCE_EXHAUSTED naming the job, and changes
    nothing; the live ones report on, and once they went silent past the window new ones
    are taken again."""
    s = rig.service
    for i in range(MAX_JOB_SESSIONS):
        s.report(Report("a", 10, rig.clock.t, session=f"s{i}"))
    with pytest.raises(ResourceExhausted, match=rf"job 'a': {MAX_JOB_SESSIONS} sessions"):
        s.report(Report("a", 11, rig.clock.t, session="one-too-many"))
    s.report(Report("a", 11, rig.clock.t, session="s0"))
    rig.clock.t += rig.config.progress_window_s + 1
    s.report(Report("a", 12, rig.clock.t, session="one-too-many"))
    s.tick()
    assert _row(rig).iterations == 12


def test_sessions_that_dropped_out_leave_room_for_new_ones(rig: Rig) -> None:
    """Sessions silent past a few of their intervals while another of the job reports
    have dropped out: within the window, they do not count towards MAX_JOB_SESSIONS, and
    a new session is taken rather than refused as one too many."""
    s = rig.service
    for i in range(MAX_JOB_SESSIONS):
        s.report(Report("a", 10, rig.clock.t, session=f"s{i}"))
    rig.clock.t += 2.0
    s.report(Report("a", 11, rig.clock.t, session="s0"))  # the others dropped out
    s.report(Report("a", 11, rig.clock.t, session="one-more"))
    s.tick()
    assert s.rejected_reports == 0 and _row(rig).iterations == 11


@contextlib.contextmanager
def _ticked_rig(**config: object) -> Iterator[Rig]:
    """A rig of its own, ticked once, for a property test (a fixture's rig would be shared
    by its examples)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sysfs = root / "sys" / "class" / "net" / "eth0"
        sysfs.mkdir(parents=True)
        (sysfs / "speed").write_text("1000\n")
        rig = Rig(root, root / "sys", **config)
        rig.service.tick()
        yield rig


@settings(max_examples=25, deadline=None)
@given(
    behind=st.lists(st.integers(0, 3), min_size=1, max_size=8),
    orders=st.lists(st.permutations(range(8)), min_size=12, max_size=12),
)
def test_ranks_reporting_in_any_order_never_take_the_count_back(
    behind: list[int], orders: list[list[int]]
) -> None:
    """Whatever order a job's ranks report in, a moment apart, and however far behind each
    other they are: the job's count never goes back, and once its first rounds are out of
    the window (the job's first count was its first rank's, which the others had not
    reached), its iteration time is theirs."""
    with _ticked_rig(progress_window_s=5.0) as rig:
        shown = 0
        for n, order in enumerate(orders):
            rig.clock.t += 1.0
            ranks = [rank for rank in order if rank < len(behind)]
            for k, rank in enumerate(ranks):
                count = 100 + n - behind[rank]
                stamp = rig.clock.t + 0.01 * k
                rig.service.report(Report("a", count, stamp, session=f"rank{rank}"))
            row = _row(rig)
            assert row.iterations is not None and row.iterations >= shown
            shown = row.iterations
        assert shown == 100 + len(orders) - 1 - max(behind)
        assert row.iteration_s == pytest.approx(1.0, rel=0.05)


def test_a_job_restarted_from_a_checkpoint_a_moment_after_it_died_counts_again_at_once(
    rig: Rig,
) -> None:
    """One Progress reports a second apart and dies; two seconds later its restart (a new
    session) reports from its checkpoint, below the count: no other session was heard
    between its first report and its next, so at that next report the job restarted from
    the first, not a window later."""
    rig.service.tick()
    for n in range(1001, 1041):
        rig.clock.t += 1.0
        rig.service.report(Report("a", n, rig.clock.t, 0.5, session="p1"))
    rig.clock.t += 2.0
    rig.service.report(Report("a", 1010, rig.clock.t, 0.5, session="p2"))
    assert _row(rig).iterations == 1040  # a rank behind, or a restart: not known yet
    rig.clock.t += 1.0
    rig.service.report(Report("a", 1011, rig.clock.t, 0.5, session="p2"))
    assert _row(rig).iterations == 1011
    for n in range(1012, 1016):
        rig.clock.t += 1.0
        rig.service.report(Report("a", n, rig.clock.t, 0.5, session="p2"))
    assert _row(rig).iterations == 1015 and _row(rig).iteration_s == pytest.approx(1.0)


def test_a_shell_driven_job_restarted_with_a_session_counts_from_it_and_reports_on_without(
    rig: Rig,
) -> None:
    """``gpuctl net report`` without a session, then ``--session S2`` with a restarted
    job's new count once the old reports stopped: the count is the new one at once, and
    reports without a session go on from it (checked against the last such report since
    the restart, not refused as going backwards)."""
    rig.service.tick()
    for n in range(1196, 1201):
        rig.clock.t += 1.0
        rig.service.report(Report("a", n, rig.clock.t))
    rig.clock.t += 5.0
    rig.service.report(Report("a", 1000, rig.clock.t, session="S2"))
    assert _row(rig).iterations == 1000
    rig.clock.t += 1.0
    rig.service.report(Report("a", 1001, rig.clock.t))
    rig.clock.t += 2.0
    rig.service.report(Report("a", 1002, rig.clock.t))
    assert _row(rig).iterations == 1002
    with pytest.raises(InvalidArgument, match=r"iterations: job 'a': 1001 iterations after 1002"):
        rig.service.report(Report("a", 1001, rig.clock.t + 1))


def _shell_job_restarted_as_s2(rig: Rig) -> None:
    """Job a reported without a session every 10 s up to 1200, then, 5 s after the last,
    with ``--session S2`` from 1000 (a restart awaiting its next report)."""
    rig.service.tick()
    for n in range(1100, 1201, 10):
        rig.clock.t += 10.0
        rig.service.report(Report("a", n, rig.clock.t))
    rig.clock.t += 5.0
    rig.service.report(Report("a", 1000, rig.clock.t, session="S2"))


def test_a_shell_driven_job_restarted_with_a_session_soon_after_reports_on_without_one(
    rig: Rig,
) -> None:
    """``gpuctl net report`` without a session every 10 s, then, 5 s after the last,
    ``--session S2`` with a restarted job's lower count: the old reporter had not dropped
    out, so S2's restart waits for its next report. A report without a session at or above
    S2's count is that next report (the shell job goes on without ``--session``): the count
    is the restarted job's from then on, not refused as going backwards for good. One below
    S2's count meanwhile is refused, saying the restart awaits its next report."""
    _shell_job_restarted_as_s2(rig)
    assert _row(rig).iterations == 1200  # a rank behind, or a restart: not known yet
    with pytest.raises(
        InvalidArgument, match=r"999 iterations after 1200 .*session S2's restart awaits its next"
    ):
        rig.service.report(Report("a", 999, rig.clock.t + 1))
    rig.clock.t += 5.0
    for n in range(1001, 1031):
        rig.service.report(Report("a", n, rig.clock.t))
        assert _row(rig).iterations == n
        rig.clock.t += 10.0
    assert rig.service.rejected_reports == 1  # the one below S2's count
    assert _row(rig).iteration_s == pytest.approx(10.0)


def test_a_pending_restart_of_a_run_that_ended_takes_no_report_of_the_next(rig: Rig) -> None:
    """``gpuctl net report`` without a session up to 1200, then ``--session S2`` with a
    lower count (its restart awaits its next report), then the run ends: S2 is a session of
    the ended run, so a report without a session below 1200 is no next report of S2's
    restart (the gap between the runs would count in the new run's pace) and the refusal
    names no session of the ended run."""
    _shell_job_restarted_as_s2(rig)
    rig.clock.t += 1.0
    rig.service.run_ended("a")
    rig.clock.t += 5.0
    for count in (1001, 5):
        with pytest.raises(InvalidArgument, match=rf"{count} iterations after 1200") as refused:
            rig.service.report(Report("a", count, rig.clock.t))
        assert "S2" not in str(refused.value)
    assert _row(rig).iterations == 1200


def test_a_report_without_a_session_below_its_last_is_refused_when_no_restart_follows(
    rig: Rig,
) -> None:
    """A reporter without a session and session R both at 1200; new session S2 reports
    1000; then R reports 1210 and the reporter without a session 1001 in the same moment:
    R heard since S2's first report makes S2 a rank behind, not a restart, so 1001 is
    refused as going backwards (naming no restart) and the shell reporter goes on from
    1200."""
    rig.service.tick()
    for n in range(1100, 1201, 10):
        rig.clock.t += 10.0
        rig.service.report(Report("a", n, rig.clock.t))
        rig.service.report(Report("a", n, rig.clock.t, session="R"))
    rig.clock.t += 5.0
    rig.service.report(Report("a", 1000, rig.clock.t, session="S2"))
    shown = _row(rig).iterations
    rig.clock.t += 5.0
    rig.service.report(Report("a", 1210, rig.clock.t, session="R"))
    with pytest.raises(InvalidArgument, match=r"1001 iterations after 1200 \(going back") as no:
        rig.service.report(Report("a", 1001, rig.clock.t))
    assert "awaits" not in str(no.value)
    assert _row(rig).iterations == shown
    with pytest.raises(InvalidArgument, match=r"1199 iterations after 1200"):
        rig.service.report(Report("a", 1199, rig.clock.t))
    rig.service.report(Report("a", 1201, rig.clock.t))


def test_sessions_of_a_run_that_ended_stay_dead_after_a_tick_sees_the_next_run(
    rig: Rig,
) -> None:
    """A run reports up to 1030 and ends; the next run starts and a tick sees it held; its
    session reports from its checkpoint seconds later: the old run's session is no rank of
    the job any more, so the count is the new run's."""
    rig.active = {"a"}
    rig.service.tick()
    for n in range(1001, 1031):
        rig.clock.t += 1.0
        rig.service.report(Report("a", n, rig.clock.t, 0.5, session="run1"))
    rig.active = set()
    rig.service.run_ended("a")
    rig.active = {"a"}
    rig.service.run_started("a")
    rig.service.tick()
    rig.clock.t += 5.0
    rig.service.report(Report("a", 900, rig.clock.t, 0.5, session="run2"))
    assert _row(rig).iterations == 900


def test_a_new_session_resuming_at_the_count_after_a_run_ended_is_running(rig: Rig) -> None:
    """A run reports 10 and ends; the next run's session reports 10 (it resumed from the
    checkpoint at that count): that is progress after the end, the job runs."""
    rig.service.tick()
    rig.service.report(Report("a", 10, rig.clock.t, session="s"))
    rig.clock.t += 1.0
    rig.service.run_ended("a")
    assert _row(rig).ended_s is not None
    rig.clock.t += 1.0
    rig.service.report(Report("a", 10, rig.clock.t, session="t"))
    assert _row(rig).ended_s is None


def test_the_count_shown_is_the_services_when_the_lowest_rank_reported_before_the_newest(
    rig: Rig,
) -> None:
    """Ranks X and Y: X 100, Y 105, X 101, X 106, each stamped after the one before. The
    job's count is Y's 105, stamped before X's newest: ``gpuctl net show`` shows 105 (the
    tracker is not left behind at 101, taking 105 for a late report)."""
    rig.service.tick()
    t = rig.clock.t
    for session, count, ago in (("X", 100, 0.6), ("Y", 105, 0.5), ("X", 101, 0.1), ("X", 106, 0)):
        rig.service.report(Report("a", count, t - ago, session=session))
    assert _row(rig).iterations == 105


@settings(max_examples=25, deadline=None)
@given(
    behind=st.lists(st.integers(0, 3), min_size=2, max_size=6),
    jitter=st.lists(st.floats(-0.3, 0.3), min_size=6, max_size=6),
    orders=st.lists(st.permutations(range(6)), min_size=10, max_size=10),
    drop_after=st.integers(2, 6),
    checkpoint=st.integers(10, 90),
)
def test_what_net_show_counts_is_the_services_count_through_jitter_a_dropout_and_a_restart(
    behind: list[int],
    jitter: list[float],
    orders: list[list[int]],
    drop_after: int,
    checkpoint: int,
) -> None:
    """Ranks report each second in any order, their stamps jittered apart; the last rank
    stops after a few rounds; then every rank dies and, two seconds later, one Progress
    restarts from a checkpoint: the count ``gpuctl net show`` shows (the progress
    tracker's) is at every round the service's own, never going back before the restart,
    and the restart's count once it reported twice."""
    with _ticked_rig(progress_window_s=5.0) as rig:
        shown = 0
        for n, order in enumerate(orders):
            rig.clock.t += 1.0
            for rank in order:
                if rank >= len(behind) or (rank == len(behind) - 1 and n > drop_after):
                    continue
                stamp = rig.clock.t + jitter[rank]
                count = 100 + n - behind[rank]
                rig.service.report(Report("a", count, stamp, session=f"rank{rank}"))
            row = _row(rig)
            assert row.iterations == rig.service._reports["a"].iterations
            assert row.iterations is not None and row.iterations >= shown
            shown = row.iterations
        rig.clock.t += 2.0
        for n in range(3):
            rig.service.report(Report("a", checkpoint + n, rig.clock.t, session="restarted"))
            rig.clock.t += 1.0
        assert _row(rig).iterations == rig.service._reports["a"].iterations == checkpoint + 2
