"""The node agent with fakes: leader rounds, following, fencing, fail-static, attributes."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from gpud.cluster.agent import ClusterAgent, LeaderHint
from gpud.cluster.api import status_to_pb
from gpud.cluster.election import LeaderInfo, SingleElection
from gpud.cluster.fencing import Mode
from gpud.cluster.model import NodeReport, Order
from gpud.cluster.ports import MemoryTagStore, StaticNodeView
from gpud.cluster.problems import NODE, REPUBLISH_S, Problem, Writer
from gpud.errors import DuplicateNode, FailedPrecondition, LeaderNotReady, Unavailable
from gpud.events import EventLog
from gpud.net.port import FakeTraffic, JobTraffic, LocalReport, OrderResult
from tests.unit.cluster_support import (
    Clock,
    FixedElection,
    LoopbackPeers,
    RoutedPeers,
    agent,
    job,
)


async def test_one_order_everywhere_with_a_jobs_slowest_node() -> None:
    clock, peers = Clock(), LoopbackPeers()
    lead_info = LeaderInfo("n0", "a0", epoch=7, leading=True)
    follow_info = LeaderInfo("n0", "a0", epoch=7, leading=False)
    t0 = FakeTraffic((job("a", 0.9), job("b", 0.5)))
    t1 = FakeTraffic((job("a", 0.2),))
    view1 = StaticNodeView(
        gpus={"a": ("G1", "G2")}, unhealthy={"G2": "GPU lost"}, critical={"G2": (79, 48)}
    )
    leader = agent("n0", lead_info, t0, peers, clock)
    follower = agent("n1", follow_info, t1, peers, clock, view=view1)
    peers.leader = leader
    await leader.tick()
    await follower.tick()  # first report: the leader has not folded it in yet
    assert follower.order is None and follower.mode is Mode.LOCAL
    await leader.tick()
    await follower.tick()
    assert follower.mode is Mode.FOLLOWER and leader.mode is Mode.LEADER
    assert t1.epoch == 7 and t0.epoch == 7
    assert t0.order is not None and t1.order == {"a": t0.order["a"]}
    assert t0.tags["a"] == t1.tags["a"]
    epoch, _, attrs = follower.attributes()
    assert epoch == 7
    (a,) = attrs
    assert a.progress_rate == 0.2 and a.slowest_node == "n1"
    assert a.unhealthy_gpus == ("n1/G2",) and a.xids == ("n1:79", "n1:48")
    assert a.critical_xids == ("n1/G2:79", "n1/G2:48")  # every uncleared code, by device
    # a (0.2 on n1) is the slowest job: the highest priority on every node
    assert t0.order is not None and t0.order["a"] < t0.order["b"]
    status = leader.status()
    assert [n.node for n in status.nodes] == ["n0", "n1"]
    assert [n.node for n in (await follower.status_with_nodes()).nodes] == ["n0", "n1"]
    assert {j.job for j in status.jobs} == {"a", "b"}


async def test_a_follower_refuses_reports() -> None:
    clock, peers = Clock(), LoopbackPeers()
    f = agent("n1", LeaderInfo("n0", "a0", 3, False), FakeTraffic(), peers, clock)
    with pytest.raises(FailedPrecondition, match="the leader is n0"):
        f.receive(NodeReport("n2"))


async def test_a_second_gpud_under_a_nodes_name_is_refused_and_told_why() -> None:
    clock, peers = Clock(), LoopbackPeers()
    info = LeaderInfo("n0", "a0", 7, False)
    leader = agent("n0", LeaderInfo("n0", "a0", 7, True), FakeTraffic(), peers, clock)
    peers.leader = leader
    n1 = agent("n1", info, FakeTraffic((job("a", 0.5),)), peers, clock)
    twin = agent("n1", info, FakeTraffic((job("z", 0.5),)), peers, clock)
    impostor = agent("n0", info, FakeTraffic((job("y", 0.5),)), peers, clock)
    for _ in range(3):
        for a in (leader, n1, twin, impostor):
            await a.tick()
    assert "'n1' is reported by two gpuds" in n1.last_error
    assert n1.status().last_error_kind == "duplicate_node"
    assert "the leader key names n0 at a0, but this gpud does not" in impostor.last_error
    assert impostor.status().last_error_kind == "leader_key_held"
    # one that reports under the leader's name all the same is refused
    with pytest.raises(DuplicateNode, match="'n0' is reported by two gpuds, this one and"):
        leader.receive(impostor.local_report())
    assert twin.last_error == twin.last_error_kind == "" and twin.mode is Mode.FOLLOWER
    assert leader.order is not None and set(leader.order.levels) == set()
    assert {j.job for j in leader.status().jobs} == {"z"}


async def test_node_names_that_differ_only_in_case_are_one_node() -> None:
    """Host names compare without case (DNS): a gpud configured as ``Node-B`` beside one
    configured as ``node-b`` is a second gpud under one node name, refused as such, and
    every name the cluster shows is the lower-case one."""
    clock, peers = Clock(), LoopbackPeers()
    info = LeaderInfo("n0", "a0", 7, False)
    leader = agent("N0", LeaderInfo("n0", "a0", 7, True), FakeTraffic(), peers, clock)
    peers.leader = leader
    first = agent("node-b", info, FakeTraffic((job("a", 0.5),)), peers, clock)
    second = agent("Node-B", info, FakeTraffic((job("z", 0.5),)), peers, clock)
    assert (leader.node, second.node) == ("n0", "node-b")
    for _ in range(3):
        for a in (leader, first, second):
            await a.tick()
    assert "'node-b' is reported by two gpuds" in first.last_error
    assert "names compare without case" in first.last_error
    assert [n.node for n in leader.status().nodes] == ["n0", "node-b"]
    assert {j.job for j in leader.status().jobs} == {"z"}
    (attributes,) = leader.status().jobs
    assert attributes.nodes == ("node-b",)
    # a report spelled otherwise (an older gpud sends its name as configured) is the node
    report = dataclasses.replace(second.local_report(), node="NODE-B")
    assert leader.receive(report) is not None
    assert [n.node for n in leader.status().nodes] == ["n0", "node-b"]
    # nor can a peer report as the leader under another spelling of its name
    with pytest.raises(FailedPrecondition, match="'n0' is reported by two gpuds"):
        leader.receive(NodeReport("N0", instance="other"))


async def test_a_follower_cut_off_from_etcd_follows_the_leader_its_old_leader_names() -> None:
    """Its election still names n0 (epoch 7), which stepped down and answers that n2
    leads: the follower reports to n2 (whose certificate names it, and which answers only
    while it leads) and follows it instead of holding and then going local."""
    clock, peers = Clock(), RoutedPeers()
    old = agent("n0", LeaderInfo("n2", "a2", 9, False), FakeTraffic(), peers, clock)
    new = agent("n2", LeaderInfo("n2", "a2", 9, True), FakeTraffic(), peers, clock)
    election = FixedElection(LeaderInfo("n0", "a0", 7, False, False, "cannot reach etcd"))
    follower = agent("n1", election.info, FakeTraffic((job("a", 0.5),)), peers, clock)
    follower.election = election
    peers.at = {"a0": old, "a2": new}
    await new.tick()
    await follower.tick()  # n0 names n2; n2 has not folded the report in yet
    assert peers.asked == ["n0", "n2"] and follower.last_error == ""
    await new.tick()
    await follower.tick()
    assert peers.asked[2:] == ["n2"]  # the hint holds: n0 is not asked again
    assert follower.order is not None and follower.order.leader == "n2"
    assert follower.order.epoch == 9 and follower.mode is Mode.FOLLOWER
    # once the election names a leader again, it is followed, and the hint is gone
    election.info = LeaderInfo("n2", "a2", 9, False)
    await follower.tick()
    assert peers.asked[3:] == ["n2"] and follower._hint is None


async def test_status_names_the_leader_a_follower_reports_to_on_a_hint() -> None:
    """While the follower reports to the leader its old leader named, its status names
    that one (marked as a hint, with since when) beside the one etcd last named, and the
    node list is asked of it: the old leader has none to give."""
    clock, peers = Clock(), RoutedPeers()
    old = agent("n0", LeaderInfo("n2", "a2", 9, False), FakeTraffic(), peers, clock)
    new = agent("n2", LeaderInfo("n2", "a2", 9, True), FakeTraffic(), peers, clock)
    election = FixedElection(LeaderInfo("n0", "a0", 7, False, False, "cannot reach etcd"))
    wall = [1.7e9]
    follower = agent(
        "n1", election.info, FakeTraffic((job("a", 0.5),)), peers, clock, wall=lambda: wall[0]
    )
    follower.election = election
    peers.at = {"a0": old, "a2": new}
    assert follower.status().hint is None
    await new.tick()
    await follower.tick()
    wall[0] += 30
    await new.tick()
    await follower.tick()
    status = await follower.status_with_nodes()
    assert status.hint == LeaderHint("n2", "a2", since=1.7e9)  # not reset by a later round
    assert (status.info.leader, status.info.epoch) == ("n0", 7)  # what etcd last named
    assert peers.asked_nodes == ["n2"]
    assert [n.node for n in status.nodes] == ["n1", "n2"]
    msg = status_to_pb(status)
    assert (msg.leader, msg.leader_address, msg.leader_source) == ("n2", "a2", "hint")
    assert (msg.elected_leader, msg.elected_leader_address, msg.epoch) == ("n0", "a0", 7)
    assert msg.leader_since_unix_seconds == 1.7e9 and msg.mode == "follower"
    # the election names a leader again: that one, from the election, with no "since"
    election.info = LeaderInfo("n2", "a2", 9, False)
    assert follower.status().hint is None
    msg = status_to_pb(await follower.status_with_nodes())
    assert (msg.leader, msg.leader_source, msg.elected_leader) == ("n2", "election", "n2")
    assert not msg.HasField("leader_since_unix_seconds")
    assert peers.asked_nodes == ["n2", "n2"]


async def test_the_status_says_how_etcd_answers_and_what_the_error_is_in_fields() -> None:
    clock, peers = Clock(), LoopbackPeers()
    info = LeaderInfo("n0", "a0", 7, False, False, "etcd refused ...", store_state="refused")
    follower = agent("n1", info, FakeTraffic((job("a", 0.5),)), peers, clock)
    await follower.tick()  # the leader unreachable
    msg = status_to_pb(follower.status())
    assert (msg.store_state, msg.last_error_kind) == ("refused", "leader_unreachable")
    peers.leader = agent("n0", LeaderInfo("n0", "a0", 7, True), FakeTraffic(), peers, clock)
    await peers.leader.tick()
    await follower.tick()
    msg = status_to_pb(follower.status())
    assert msg.HasField("last_error_kind") and msg.last_error_kind == ""
    leading = status_to_pb(peers.leader.status())
    assert leading.HasField("store_state") and leading.store_state == "ok"
    lone = SingleElection("n0").state()
    assert lone.store_ok and lone.store_state == ""  # no etcd to reach


async def test_a_named_leader_is_only_a_hint() -> None:
    """What the old leader names is checked: a node that does not answer, or does not
    lead either (it names yet another: not followed on), or whose order is older than the
    one in force, is not followed; the election's leader is asked again next round."""
    clock, peers = Clock(), RoutedPeers()
    election = FixedElection(LeaderInfo("n0", "a0", 7, False, False, "cannot reach etcd"))
    follower = agent("n1", election.info, FakeTraffic((job("a", 0.5),)), peers, clock)
    follower.election = election
    old = agent("n0", LeaderInfo("n3", "a3", 9, False), FakeTraffic(), peers, clock)
    peers.at = {"a0": old}
    await follower.tick()  # n3 does not answer
    assert peers.asked == ["n0", "n3"] and "n3 at a3" in follower.last_error
    assert follower._hint is None
    # n3 answers but does not lead: it names n4, which is not asked
    peers.at["a3"] = agent("n3", LeaderInfo("n4", "a4", 11, False), FakeTraffic(), peers, clock)
    await follower.tick()
    assert peers.asked[2:] == ["n0", "n3"] and "n3 does not lead" in follower.last_error
    # n3 leads, but in an epoch older than the order in force: refused by the fence
    stale = agent("n3", LeaderInfo("n3", "a3", 5, True), FakeTraffic(), peers, clock)
    peers.at["a3"] = stale
    await stale.tick()
    follower.fence.admit(Order(epoch=8, seq=1, leader="n9", levels={}, tags={}))
    await follower.tick()
    await stale.tick()
    await follower.tick()
    assert follower.order is None and follower.fence.rejected == 1
    assert follower._hint is None


async def test_stale_epoch_is_rejected_and_the_last_order_stays() -> None:
    clock, peers = Clock(), LoopbackPeers()
    traffic = FakeTraffic((job("a", 0.5),))
    f = agent("n1", LeaderInfo("n0", "a0", 9, False), traffic, peers, clock)
    peers.forced = Order(epoch=9, seq=1, leader="n0", levels={"a": 1}, tags={"a": 12})
    await f.tick()
    peers.forced = Order(epoch=8, seq=5, leader="old", levels={"a": 3}, tags={"a": 12})
    await f.tick()
    assert traffic.order == {"a": 1} and f.fence.rejected == 1
    assert f.status().applied_epoch == 9


class RefusingTraffic(FakeTraffic):
    """A traffic service with fewer levels than the leader's orders use."""

    def apply_order(
        self,
        epoch: int,
        levels: Mapping[str, int],
        tags: Mapping[str, int] | None = None,
        *,
        restart: bool = False,
    ) -> OrderResult:
        for name, level in levels.items():
            if level >= self.levels:
                return OrderResult(False, self.epoch, f"job {name!r}: level {level} not in [0, 2)")
        return super().apply_order(epoch, levels, tags, restart=restart)


async def test_an_order_the_traffic_service_refuses_is_not_followed() -> None:
    clock, peers = Clock(), LoopbackPeers()
    traffic = RefusingTraffic((job("a", 0.5),), levels=2)
    f = agent("n1", LeaderInfo("n0", "a0", 9, False), traffic, peers, clock)
    peers.forced = Order(epoch=9, seq=1, leader="n0", levels={"a": 1}, tags={"a": 12})
    await f.tick()
    assert f.mode is Mode.FOLLOWER and f.status().last_error == ""
    peers.forced = Order(epoch=9, seq=2, leader="n0", levels={"a": 3}, tags={"a": 12})
    clock.now += 10
    await f.tick()
    # the last order it could apply stays in force, and status says why no newer one is
    assert traffic.order == {"a": 1} and f.levels() == {"a": 1}
    assert f.mode is Mode.HOLDING
    assert f.status().last_error == (
        "traffic service refused the order of epoch 9 from n0: job 'a': level 3 not in [0, 2)"
    )
    assert f.status().last_error_kind == "order_refused"
    clock.now += 25
    await f.tick()
    assert f.mode is Mode.LOCAL and traffic.order is None


async def test_without_a_leader_the_last_order_holds_until_the_grace_period_ends() -> None:
    clock, peers = Clock(), LoopbackPeers()
    traffic = FakeTraffic((job("a", 0.5),))
    f = agent("n1", LeaderInfo("n0", "a0", 9, False), traffic, peers, clock)
    peers.forced = Order(epoch=9, seq=1, leader="n0", levels={"a": 1}, tags={"a": 12})
    await f.tick()
    peers.forced = None  # the leader dies
    clock.now += 10
    await f.tick()
    assert f.mode is Mode.HOLDING and traffic.order == {"a": 1}
    assert "UNAVAILABLE" in f.last_error
    clock.now += 25
    await f.tick()
    assert f.mode is Mode.LOCAL and traffic.order is None  # clear_order: local policy


async def test_a_leader_that_steps_down_holds_rather_than_follows_nobody(tmp_path: Path) -> None:
    """A leader cut off from etcd steps down with no leader known: it keeps its last order,
    which is holding, not following (fresh as that order is), and says so at once."""
    clock, peers, events = Clock(), LoopbackPeers(), EventLog(tmp_path / "events.jsonl")
    traffic = FakeTraffic((job("a", 0.5),))
    election = FixedElection(LeaderInfo("n0", "a0", 9, True))
    leader = agent("n0", election.info, traffic, peers, clock, events=events)
    leader.election = election
    await leader.tick()
    assert leader.mode is Mode.LEADER and traffic.order is not None
    election.info = LeaderInfo("", "", 9, False, False, "cannot reach etcd")
    clock.now += 0.5  # well within the time an order counts as fresh
    await leader.tick()
    assert leader.mode is Mode.HOLDING and traffic.order is not None
    modes = [e.fields["mode"] for e in events.recent(kind_prefix="cluster.mode")]
    assert "follower" not in modes, modes
    # a gpud whose name the leader key holds, but not on its lease: nobody it follows
    election.info = LeaderInfo("n0", "a9", 11, False)
    await leader.tick()
    assert leader.mode is Mode.HOLDING


async def test_tags_survive_a_change_of_leader() -> None:
    clock, peers, store = Clock(), LoopbackPeers(), MemoryTagStore()
    traffic = FakeTraffic(tuple(job(f"j{i}", 0.5) for i in range(20)))
    first = agent("n0", LeaderInfo("n0", "a", 5, True), traffic, peers, clock, store=store)
    await first.tick()
    tags = dict(traffic.tags)
    second = agent(
        "n1", LeaderInfo("n1", "b", 11, True), FakeTraffic(traffic.jobs), peers, clock, store=store
    )
    await second.tick()
    assert second.order is not None and dict(second.order.tags) == tags


async def test_watch_yields_again_only_when_attributes_change() -> None:
    clock, peers = Clock(), LoopbackPeers()
    view = StaticNodeView(gpus={"a": ("G1",)})
    leader = agent("n0", LeaderInfo("n0", "a0", 2, True), FakeTraffic(), peers, clock, view=view)
    await leader.tick()
    stream = leader.watch(["a"])
    epoch, _, (a,) = await anext(stream)
    assert epoch == 2 and a.unhealthy_gpus == ()
    nxt = asyncio.ensure_future(anext(stream))
    await leader.tick()  # same attributes: nothing sent
    await asyncio.sleep(0)
    assert not nxt.done()
    view.unhealthy["G1"] = "GPU lost"
    await leader.tick()
    epoch, _, (a,) = await asyncio.wait_for(nxt, 5)
    assert a.unhealthy_gpus == ("n0/G1",)


async def test_a_certificate_expired_since_start_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, peers = Clock(), LoopbackPeers()
    problem = "this node's certificate cluster.cert_file /pki/n1.pem expired at ..."
    expired = {"now": False}

    def check(now: float) -> str:
        return problem if expired["now"] else ""

    f = agent(
        "n1",
        LeaderInfo("n0", "a0", 9, False),
        FakeTraffic(),
        peers,
        clock,
        credential_problem=check,
    )
    lead = agent(
        "n0",
        LeaderInfo("n0", "a0", 9, True),
        FakeTraffic((job("a", 0.5),)),
        peers,
        clock,
        credential_problem=check,
    )
    await f.tick()
    await lead.tick()
    assert f.last_error.startswith("leader n0 at a0: UNAVAILABLE") and problem not in f.last_error
    expired["now"] = True
    with caplog.at_level("WARNING", logger="gpud.cluster.agent"):
        for _ in range(3):
            await f.tick()
            await lead.tick()
    # a follower's failed report says what peers refuse; the leader's status says it too
    assert f.last_error.endswith(f"; {problem}") and lead.last_error == problem
    assert lead.mode is Mode.LEADER
    # once per gpud, not every round: the problem itself, and the follower's failed report
    assert [r.levelname for r in caplog.records if problem in r.getMessage()] == [
        "ERROR",
        "WARNING",
        "ERROR",
    ]


async def test_a_new_leader_changes_no_level_before_the_nodes_have_reported() -> None:
    clock, peers = Clock(), LoopbackPeers()
    # epoch 5 (leader n0, now gone): b (0.1 on n2) is the slowest job, a is on level 1
    t1, t2 = FakeTraffic((job("a", 0.5),)), FakeTraffic((job("b", 0.1),))
    old = Order(epoch=5, seq=3, leader="n0", levels={"a": 1, "b": 0}, tags={"a": 12, "b": 14})
    info = LeaderInfo("n1", "a1", 9, False)
    n1 = agent("n1", LeaderInfo("n1", "a1", 9, True), t1, peers, clock, settle_s=1.5)
    n2 = agent("n2", info, t2, peers, clock)
    rounds: list[float] = []
    n1.request_round = rounds.append
    peers.leader = n1
    assert n1._apply(old.for_jobs(["a"]), info) and n2._apply(old.for_jobs(["b"]), info)
    await n1.tick()  # elected: its own report only; no order yet
    assert rounds == [1.5]
    assert t1.order == {"a": 1} and t1.epoch == 5 and n1.mode is Mode.LEADER
    await n2.tick()
    assert t2.order == {"b": 0} and t2.epoch == 5  # answered "no order yet": it keeps its own
    clock.now += 1.0
    await n1.tick()
    assert t1.order == {"a": 1} and t1.epoch == 5
    clock.now += 0.5  # settled: the first order folds in every node that reported
    await n1.tick()
    await n2.tick()
    assert t1.epoch == 9 and t1.order == {"a": 1}
    assert t2.epoch == 9 and t2.order == {"b": 0}


async def test_a_new_leader_orders_even_when_a_node_never_reports() -> None:
    clock, peers = Clock(), LoopbackPeers()
    traffic = FakeTraffic((job("a", 0.5),))
    n1 = agent("n1", LeaderInfo("n1", "a1", 9, True), traffic, peers, clock, settle_s=1.5)
    await n1.tick()
    assert traffic.order is None
    clock.now += 1.5
    await n1.tick()
    assert traffic.epoch == 9 and traffic.order == {"a": 0} and n1.status().last_error == ""


async def test_a_failover_keeps_the_levels_a_fresh_ranking_would_swap() -> None:
    clock, peers = Clock(), LoopbackPeers()
    # equal rates: a fresh ranking breaks the tie by job id, a-job above train-a
    t0 = FakeTraffic((job("train-a", 0.5),))
    t1, t2 = FakeTraffic((job("a-job", 0.5),)), FakeTraffic((job("train-a", 0.5),))
    n0 = agent("n0", LeaderInfo("n0", "a0", 5, True), t0, peers, clock)
    n1 = agent("n1", LeaderInfo("n0", "a0", 5, False), t1, peers, clock, settle_s=1.5)
    n2 = agent("n2", LeaderInfo("n0", "a0", 5, False), t2, peers, clock)
    peers.leader = n0
    await n0.tick()  # train-a alone: level 0
    for _ in range(2):
        await n1.tick()
        await n2.tick()
        await n0.tick()
    await n1.tick()
    await n2.tick()
    # a-job came later: the hysteresis kept train-a on level 0
    assert t1.epoch == 5 and t1.order == {"a-job": 1}
    assert t2.epoch == 5 and t2.order == {"train-a": 0}
    assert n1.local_report().jobs[0].applied_level == 1
    # n0 is killed; n1 leads epoch 9
    n1.election = FixedElection(LeaderInfo("n1", "a1", 9, True))
    n2.election = FixedElection(LeaderInfo("n1", "a1", 9, False))
    peers.leader = n1
    await n1.tick()
    await n2.tick()
    clock.now += 1.5
    await n1.tick()
    await n2.tick()
    assert t1.epoch == 9 and t1.order == {"a-job": 1}
    assert t2.epoch == 9 and t2.order == {"train-a": 0}


async def test_a_node_reports_the_levels_of_the_order_in_force_only() -> None:
    clock, peers = Clock(), LoopbackPeers()
    traffic = FakeTraffic((job("a", 0.5), job("b", 0.5)))
    f = agent("n1", LeaderInfo("n0", "a0", 9, False), traffic, peers, clock)
    assert [j.applied_level for j in f.local_report().jobs] == [None, None]
    peers.forced = Order(epoch=9, seq=1, leader="n0", levels={"a": 2}, tags={"a": 12})
    await f.tick()
    report = f.local_report()
    assert report.applied_epoch == 9 and [j.applied_level for j in report.jobs] == [2, None]
    peers.forced = None  # the leader dies; past the grace period the local policy decides
    clock.now += 31
    await f.tick()
    assert f.mode is Mode.LOCAL
    report = f.local_report()
    assert report.applied_epoch == 9 and [j.applied_level for j in report.jobs] == [None, None]


async def test_a_node_started_again_reports_the_kernels_levels_until_its_first_order() -> None:
    """gpud started again: no order yet, the levels its traffic service found in the
    kernel (the run before's order) go to the new leader as of epoch 0, which keeps them
    where the rates allow -- here two unknown rates, which a fresh ranking would order by
    job id."""
    clock, peers = Clock(), LoopbackPeers()
    found = {"a-train": 1, "runner": 0}
    traffic = FakeTraffic(
        tuple(dataclasses.replace(job(j, None), level=lv) for j, lv in found.items())
    )
    traffic.adopted = dict(found)
    n1 = agent("n1", LeaderInfo("n1", "a1", 2, True), traffic, peers, clock, settle_s=1.0)
    peers.leader = n1
    report = n1.local_report()
    assert report.applied_epoch == 0
    assert {j.job: j.applied_level for j in report.jobs} == {"a-train": 1, "runner": 0}
    await n1.tick()
    clock.now += 1.0
    await n1.tick()
    assert traffic.epoch == 2 and traffic.order == {"a-train": 1, "runner": 0}
    traffic.adopted = {"a-train": 0}  # not said once an order is in force: the order's are
    assert {j.job: j.applied_level for j in n1.local_report().jobs} == {"a-train": 1, "runner": 0}


async def test_a_node_started_into_a_partition_reports_the_kernels_levels_meanwhile() -> None:
    """gpud started again with its leader out of reach: the local policy runs, and the
    levels its tc tree held (for the jobs that policy left there) go to whichever leader
    it reaches next, as of epoch 0."""
    clock, peers = Clock(), LoopbackPeers()
    traffic = FakeTraffic((dataclasses.replace(job("a-train", None), level=1),))
    traffic.adopted = {"a-train": 1}
    n1 = agent("n1", LeaderInfo("n0", "a0", 2, False), traffic, peers, clock)
    for _ in range(4):
        await n1.tick()
        clock.now += 15.0
    assert n1.mode is Mode.LOCAL and traffic.order is None
    report = n1.local_report()
    assert report.applied_epoch == 0
    assert {j.job: j.applied_level for j in report.jobs} == {"a-train": 1}


async def test_a_node_reports_ended_and_silent_jobs_unranked_unless_pinned() -> None:
    clock, peers = Clock(), LoopbackPeers()
    ended = dataclasses.replace(job("ended", 0.05), ended_s=3.0)
    silent = dataclasses.replace(job("silent", 0.05), stopped_s=60.0, unranked=True)
    pinned = dataclasses.replace(job("pinned", 0.05), ended_s=3.0, pinned_level=1)
    traffic = FakeTraffic((ended, silent, pinned, job("live", 0.5)))
    f = agent("n1", LeaderInfo("n0", "a0", 9, False), traffic, peers, clock)
    report = {j.job: j.unranked for j in f.local_report().jobs}
    assert report == {"ended": True, "live": False, "pinned": False, "silent": True}


class Board:
    """A problem board in memory, recording its writes."""

    def __init__(self) -> None:
        self.entries: dict[str, Problem] = {}
        self.writes: list[tuple[str, str]] = []
        self.down = False

    def publish(self, node: str, message: str, since: float, kind: str, by: Writer = NODE) -> None:
        if self.down:
            raise Unavailable("etcd: connection refused")
        key = f"{node}/{by.instance}" if by.instance else node
        self.writes.append(("publish", key))
        self.entries[key] = Problem(
            node, message, since, kind, by.instance, by.gpud, by.mode or None
        )

    def clear(self, node: str, *, instance: str = "") -> None:
        if self.down:
            raise Unavailable("etcd: connection refused")
        key = f"{node}/{instance}" if instance else node
        self.writes.append(("clear", key))
        self.entries.pop(key, None)

    def read(self) -> list[Problem]:
        if self.down:
            raise Unavailable("etcd: connection refused")
        return [self.entries[n] for n in sorted(self.entries)]

    def close(self) -> None:
        if self.down:
            raise Unavailable("etcd: connection refused")
        for node in self.entries:
            self.writes.append(("close", node))
        self.entries.clear()


async def test_a_gpud_restarted_within_its_own_leader_lease_publishes_under_its_node() -> None:
    """A lone gpud killed while it led and started again finds the leader key naming its
    node, held by its previous run until that lease expires (leader_key_held): gpud cannot
    tell that run from another gpud under its name, so it publishes as the node, under
    ``<node>``, not as a second gpud under ``<node>/<instance>``."""
    clock, peers, board = Clock(), LoopbackPeers(), Board()
    held = LeaderInfo("n1", "a1", epoch=4, leading=False)
    restarted = agent("n1", held, FakeTraffic((job("a", 0.5),)), peers, clock, problems=board)
    await restarted.tick()
    assert restarted.last_error_kind == "leader_key_held"
    assert board.writes == [("publish", "n1")]
    assert board.entries["n1"].instance == ""


async def test_a_node_that_cannot_report_publishes_why_for_every_node_to_see() -> None:
    clock, wall, peers, board = Clock(), Clock(), LoopbackPeers(), Board()
    wall.now = 1.7e9
    lead_info = LeaderInfo("n0", "a0", epoch=3, leading=True)
    follow_info = LeaderInfo("n0", "a0", epoch=3, leading=False)
    leader = agent("n0", lead_info, FakeTraffic(()), peers, clock, problems=board, wall=wall)
    follower = agent(
        "n1", follow_info, FakeTraffic((job("a", 0.5),)), peers, clock, problems=board, wall=wall
    )
    await leader.tick()
    await follower.tick()  # peers.leader is None: the leader is unreachable
    assert board.writes == [("publish", "n1")]
    (problem,) = (await leader.status_with_nodes()).problems
    # with its kind, for scripts to branch on rather than on the message's words
    assert problem == Problem(
        "n1",
        "leader n0 at a0: UNAVAILABLE",
        1.7e9,
        "leader_unreachable",
        "",
        follower.gpud,
        "local",
    )
    assert follower.last_error_kind == "leader_unreachable"
    # the same problem is published again only as its lease asks, keeping when it began
    for passed in (5, 6):
        wall.now += passed
        clock.now += passed
        await follower.tick()
        assert board.writes == [("publish", "n1")] * (1 if passed == 5 else 2)
    assert board.entries["n1"].since == 1.7e9
    # etcd down: nothing published, nothing lost; the status lists no problems then
    board.down = True
    wall.now += 11
    clock.now += 11
    await follower.tick()
    assert (await leader.status_with_nodes()).problems == ()
    board.down = False
    # the leader answers again: the problem goes
    peers.leader = leader
    await follower.tick()
    await follower.tick()
    assert follower.last_error == follower.last_error_kind == ""
    assert board.writes[-1] == ("clear", "n1") and board.entries == {}
    await follower.tick()
    assert board.writes.count(("clear", "n1")) == 1


async def test_a_problem_is_republished_within_its_lease_after_the_wall_clock_steps_back() -> None:
    """The entry's lease (30 s) runs on etcd's clock: a wall clock stepped back an hour (NTP,
    date -s) holds back no republish, or the problem would vanish while it lasts."""
    clock, wall, peers, board = Clock(), Clock(), LoopbackPeers(), Board()
    wall.now = 1.7e9
    follow_info = LeaderInfo("n0", "a0", epoch=3, leading=False)
    follower = agent(
        "n1", follow_info, FakeTraffic((job("a", 0.5),)), peers, clock, problems=board, wall=wall
    )
    await follower.tick()  # the leader is unreachable: published
    assert board.writes == [("publish", "n1")]
    wall.now -= 3600
    for _ in range(2):
        clock.now += REPUBLISH_S
        wall.now += REPUBLISH_S
        await follower.tick()
    assert board.writes == [("publish", "n1")] * 3
    assert board.entries["n1"].since == 1.7e9  # when it began, as said at the time


async def test_the_status_says_whether_the_nodes_problems_could_be_read_and_recorded() -> None:
    clock, peers, board = Clock(), LoopbackPeers(), Board()
    election = LeaderInfo("n0", "a0", epoch=3, leading=True)
    leader = agent("n0", election, FakeTraffic(()), peers, clock, problems=board)
    assert (await leader.status_with_nodes()).problems_state == "ok"
    board.down = True  # etcd unreachable: the problems are unknown, not none
    status = await leader.status_with_nodes()
    assert status.problems == () and status.problems_state == "unreachable"
    assert status_to_pb(status).problems_state == "unreachable"
    board.down = False
    # etcd out of space: readable, but no node can record a problem
    leader.etcd_alarms = ("NOSPACE",)
    assert (await leader.status_with_nodes()).problems_state == "full"
    leader.etcd_alarms = ()
    assert isinstance(leader.election, FixedElection)
    leader.election.info = dataclasses.replace(election, store_state="full")
    assert (await leader.status_with_nodes()).problems_state == "full"
    # no etcd: no field
    single = agent("n0", election, FakeTraffic(()), peers, clock)
    status = await single.status_with_nodes()
    assert status.problems_state == "" and not status_to_pb(status).HasField("problems_state")


class TurningElection(FixedElection):
    """Says ``first`` at its first reading, then ``info`` (etcd's state changed between)."""

    def __init__(self, first: LeaderInfo, info: LeaderInfo) -> None:
        super().__init__(info)
        self.first: LeaderInfo | None = first

    def state(self) -> LeaderInfo:
        first, self.first = self.first, None
        return first or self.info


async def test_the_problems_state_agrees_with_the_store_state_of_the_same_status() -> None:
    ok = LeaderInfo("n0", "a0", epoch=3, leading=True, store_state="ok")
    full = dataclasses.replace(ok, store_state="full")
    for first, then, expected in ((full, ok, "full"), (ok, full, "ok")):
        node = agent("n0", ok, FakeTraffic(()), LoopbackPeers(), Clock(), problems=Board())
        node.election = TurningElection(first, then)
        status = await node.status_with_nodes()
        assert (status.info.store_state, status.problems_state) == (expected, expected)


async def cut_off_from_n0(*, settle_s: float = 0.0) -> tuple[ClusterAgent, Board]:
    """Node n1 after a round in which its leader, n0, was dead: its problem published."""
    wall, board = Clock(), Board()
    wall.now = 1.7e9
    node = agent(
        "n1",
        LeaderInfo("n0", "a0", epoch=3, leading=False),
        FakeTraffic((job("a", 0.5),)),
        LoopbackPeers(),
        Clock(),
        problems=board,
        wall=wall,
        settle_s=settle_s,
    )
    await node.tick()  # n0 is dead: unreachable
    assert node.last_error_kind == "leader_unreachable" and "n1" in board.entries
    assert isinstance(node.election, FixedElection)
    return node, board


async def test_a_leader_gone_from_etcd_leaves_no_error_about_reporting_to_it() -> None:
    # The dead leader's key is gone and none can be elected (etcd out of space): the node
    # names no leader, so an error about reporting to the dead one would send the operator
    # after a node that is not meant to lead any more, and keep it listed as a problem.
    follower, board = await cut_off_from_n0()
    assert isinstance(follower.election, FixedElection)
    follower.election.info = LeaderInfo("", "", epoch=3, leading=False, store_state="full")
    await follower.tick()
    assert (follower.last_error, follower.last_error_kind) == ("", "")
    assert board.entries == {}


async def test_a_leader_that_resumes_its_epoch_after_a_late_renewal_is_still_followed() -> None:
    # A renewal that comes late (a loaded host) makes the leader count itself not leading
    # for a moment; once etcd renews the same lease it leads the same epoch again. Its new
    # round must continue the epoch's sequence: orders numbered from 1 again would be
    # refused as stale by every node (itself included) until they caught up.
    clock, peers = Clock(), LoopbackPeers()
    election = FixedElection(LeaderInfo("n0", "a0", epoch=7, leading=True))
    t0, t1 = FakeTraffic((job("a", 0.9),)), FakeTraffic((job("b", 0.5),))
    leader = agent("n0", election.info, t0, peers, clock)
    leader.election = election
    follower = agent("n1", LeaderInfo("n0", "a0", epoch=7, leading=False), t1, peers, clock)
    peers.leader = leader
    for _ in range(5):
        clock.now += 0.5
        await leader.tick()
        await follower.tick()
    assert follower.fence.seq >= 4
    election.info = LeaderInfo("", "", epoch=7, leading=False, store_ok=False)
    await leader.tick()
    election.info = LeaderInfo("n0", "a0", epoch=7, leading=True)
    for _ in range(2):
        clock.now += 0.5
        await leader.tick()
        await follower.tick()
    assert leader.fence.rejected == 0 and follower.fence.rejected == 0
    assert leader.order is not None and follower.order is not None
    assert follower.order.seq == leader.order.seq > 5
    assert leader.mode is Mode.LEADER and follower.mode is Mode.FOLLOWER


async def test_a_leader_elected_before_its_first_round_answers_no_order_yet() -> None:
    # Elected a moment ago, its first round not begun: a node's report gets "no order
    # yet" (it retries shortly), not "n0 does not lead; the leader is n0".
    clock, peers = Clock(), LoopbackPeers()
    leader = agent("n0", LeaderInfo("n0", "a0", 7, True), FakeTraffic(), peers, clock)
    rounds: list[float] = []
    leader.request_round = rounds.append
    assert leader.receive(NodeReport("n1")) is None
    assert rounds == [0.0]
    follower = agent("n1", LeaderInfo("n0", "a0", 7, False), FakeTraffic(), peers, clock)
    with pytest.raises(FailedPrecondition, match="n1 does not lead; the leader is n0"):
        follower.receive(NodeReport("n2"))


async def test_a_restarted_leader_that_etcd_still_names_says_so_when_it_refuses() -> None:
    # kill -9 and a start at once (an upgrade): the leader key is still the previous run's.
    # The nodes' reports were refused with "n0 does not lead; the leader is n0 at a0",
    # which every node published as its problem, with the action to make n0 reachable.
    clock, peers = Clock(), LoopbackPeers()
    restarted = agent("n0", LeaderInfo("n0", "a0", 7, False), FakeTraffic(), peers, clock)
    with pytest.raises(LeaderNotReady) as refused:
        restarted.receive(NodeReport("n1"))
    message = str(refused.value)
    assert "the leader is n0" not in message
    assert "n0 does not lead yet: the leader key still names it" in message
    assert "until that lease expires" in message
    assert (refused.value.leader, refused.value.address) == ("", "")  # no hint to follow
    peers.leader = restarted
    follower = agent("n1", LeaderInfo("n0", "a0", 7, False), FakeTraffic(), peers, clock)
    await follower.tick()
    assert follower.last_error == message and follower.last_error_kind == "leader_not_ready"


async def test_orders_of_the_leader_etcd_names_now_are_followed_after_etcd_went_back() -> None:
    # etcd restored from a snapshot, or replaced by a new one: revisions, and so epochs,
    # start lower than the ones the nodes applied. The leader etcd names now, in the epoch
    # it names, is followed (by itself too); another's lower epoch is still refused.
    clock, peers = Clock(), LoopbackPeers()
    election = FixedElection(LeaderInfo("n0", "a0", 38, False))
    traffic = FakeTraffic((job("a", 0.5),))
    f = agent("n1", election.info, traffic, peers, clock)
    f.election = election
    peers.forced = Order(epoch=38, seq=4, leader="n0", levels={"a": 1}, tags={"a": 12})
    await f.tick()
    assert f.fence.epoch == 38
    election.info = LeaderInfo("n2", "a2", 2, False)
    peers.forced = Order(epoch=2, seq=1, leader="n0", levels={"a": 3}, tags={"a": 12})
    await f.tick()  # not the leader etcd names
    assert f.fence.rejected == 1 and traffic.order == {"a": 1}
    peers.forced = Order(epoch=2, seq=1, leader="n2", levels={"a": 2}, tags={"a": 12})
    await f.tick()
    assert f.fence.rejected == 1 and traffic.order == {"a": 2}
    assert (f.fence.epoch, f.fence.seq) == (2, 1) and f.mode is Mode.FOLLOWER
    # and a leader that had followed epoch 38 applies its own orders of epoch 2
    election = FixedElection(LeaderInfo("n0", "a0", 38, False))
    t3 = FakeTraffic((job("b", 0.5),))
    leader = agent("n3", election.info, t3, peers, clock)
    leader.election = election
    peers.forced = Order(epoch=38, seq=9, leader="n0", levels={"b": 1}, tags={"b": 14})
    await leader.tick()
    assert leader.fence.epoch == 38
    election.info = LeaderInfo("n3", "a3", 2, True)
    await leader.tick()
    assert leader.fence.rejected == 0 and leader.fence.epoch == 2 and t3.epoch == 2


async def test_a_new_leader_on_a_fresh_etcd_is_followed_from_its_first_order() -> None:
    # etcd wiped: the new leader key lands on the create revision of the one before (5),
    # on a new lease. The new leader, with no orders issued, starts its seq at 1; the
    # nodes follow it at once, while the deposed leader's orders and an older answer of
    # the new leadership are still refused.
    clock, peers = Clock(), LoopbackPeers()
    old = agent("n0", LeaderInfo("n0", "a0", 5, True, lease=100), FakeTraffic(), peers, clock)
    peers.leader = old
    traffic = FakeTraffic((job("a", 0.5),))
    election = FixedElection(LeaderInfo("n0", "a0", 5, False))
    events = EventLog(None)
    f = agent("n1", election.info, traffic, peers, clock, events=events)
    f.election = election
    for _ in range(5):
        await f.tick()
        await old.tick()
    await f.tick()
    assert (f.fence.epoch, f.fence.seq, f.fence.lease) == (5, 5, 100)
    new = agent("n2", LeaderInfo("n2", "a2", 5, True, lease=200), FakeTraffic(), peers, clock)
    peers.leader = new
    election.info = LeaderInfo("n2", "a2", 5, False)
    await new.tick()
    await f.tick()  # its report reaches the new leader
    await new.tick()
    await f.tick()  # the new leader's first order that includes it
    assert f.fence.rejected == 0 and f.mode is Mode.FOLLOWER
    assert (f.fence.epoch, f.fence.seq, f.fence.lease) == (5, 2, 200)
    assert f.order is not None and f.order.leader == "n2"
    # the new leadership is said as a new leader's orders, though the epoch is the same
    said = [e.message for e in events.recent() if e.kind == "cluster.epoch"]
    assert said == ["applying the orders of n0, epoch 5", "applying the orders of n2, epoch 5"]
    # the deposed leader, still talking, is not the one etcd names: said so, not "newer"
    peers.forced = Order(epoch=5, seq=9, leader="n0", levels={"a": 3}, tags={}, lease=100)
    await f.tick()
    assert f.fence.rejected == 1 and f.fence.lease == 200
    assert f.last_error == (
        "rejected the order 5.9 (epoch.seq) from n0: epoch 5 on lease 64 is not the"
        " leadership etcd names (lease c8 is in force)"
    )
    # within the new leadership a lower seq is stale, as before
    await new.tick()
    peers.forced = None
    await f.tick()
    assert f.fence.seq == 3
    peers.forced = Order(epoch=5, seq=2, leader="n2", levels={"a": 3}, tags={}, lease=200)
    await f.tick()
    assert f.fence.rejected == 2 and f.last_error_kind == "stale_order"


async def test_a_new_leader_drops_its_error_about_the_previous_leader_at_once() -> None:
    # n1 could not reach n0, then etcd elects n1: it cannot be unreachable from itself, so
    # the problem goes in the round it begins leading, not once its leadership has settled
    node, board = await cut_off_from_n0(settle_s=5.0)
    assert isinstance(node.election, FixedElection)
    node.election.info = LeaderInfo("n1", "a1", epoch=4, leading=True)
    await node.tick()  # its first round as leader: settling, no order yet
    assert node.order is None
    assert (node.last_error, node.last_error_kind) == ("", "")
    assert board.entries == {}
    assert (await node.status_with_nodes()).problems == ()


async def test_a_node_that_reaches_the_leader_drops_its_unreachable_error() -> None:
    # the leader answers with an order the fence refuses (an older epoch than applied):
    # reached all the same, so "unreachable" is no longer this node's problem
    clock, peers, board = Clock(), LoopbackPeers(), Board()
    follower = agent(
        "n1",
        LeaderInfo("n0", "a0", epoch=9, leading=False),
        FakeTraffic((job("a", 0.5),)),
        peers,
        clock,
        problems=board,
    )
    follower.fence.admit(Order(epoch=9, seq=4, leader="n0", levels={}, tags={}))
    await follower.tick()
    assert follower.last_error_kind == "leader_unreachable" and "n1" in board.entries
    peers.forced = Order(epoch=9, seq=2, leader="n0", levels={"a": 1}, tags={"a": 12})
    await follower.tick()
    assert follower.fence.rejected == 1  # stale: not applied
    # reached, so no longer unreachable; but it follows no order, and says why
    assert follower.last_error_kind == "stale_order"
    assert follower.last_error == (
        "rejected the order 9.2 (epoch.seq) from n0: 9.4, newer, is in force"
    )
    assert board.entries["n1"].kind == "stale_order"
    # the leader's next order passes the fence: the problem goes
    peers.forced = Order(epoch=9, seq=5, leader="n0", levels={"a": 1}, tags={"a": 12})
    await follower.tick()
    assert (follower.last_error, follower.last_error_kind) == ("", "")
    assert board.entries == {}


class HeldPeers(LoopbackPeers):
    """Reports that reach the leader only once ``go`` is set (a report in flight)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()
        self.sent = 0

    async def report(self, address: str, leader: str, report: NodeReport) -> Order | None:
        self.sent += 1
        await self.go.wait()
        return await super().report(address, leader, report)


async def leader_and_follower(
    peers: LoopbackPeers, clock: Clock
) -> tuple[ClusterAgent, ClusterAgent]:
    """n0 leading epoch 7 (one round done), n1 following it with job a."""
    leader = agent("n0", LeaderInfo("n0", "a0", 7, True), FakeTraffic(()), peers, clock)
    follower = agent(
        "n1", LeaderInfo("n0", "a0", 7, False), FakeTraffic((job("a", 0.5),)), peers, clock
    )
    peers.leader = leader
    await leader.tick()
    return leader, follower


async def test_a_stop_waits_for_the_report_in_flight_and_starts_no_other() -> None:
    clock, peers = Clock(), HeldPeers()
    _, follower = await leader_and_follower(peers, clock)
    in_flight = asyncio.create_task(follower.tick())
    await asyncio.sleep(0.01)
    assert peers.sent == 1
    stopping = asyncio.create_task(follower.finish_rounds(5.0))
    await asyncio.sleep(0.01)
    assert not stopping.done()  # waits for the report on its way
    await follower.tick()  # a round asked for after the stop began: none
    assert peers.sent == 1
    peers.go.set()
    assert await stopping  # the report ended, answered
    assert in_flight.done() and not in_flight.cancelled()
    assert follower.last_error == ""
    await follower.tick()
    assert peers.sent == 1


async def test_a_stop_gives_up_on_a_report_that_does_not_end_in_time() -> None:
    clock, peers = Clock(), HeldPeers()
    follower = agent(
        "n1", LeaderInfo("n0", "a0", 7, False), FakeTraffic((job("a", 0.5),)), peers, clock
    )
    in_flight = asyncio.create_task(follower.tick())
    await asyncio.sleep(0.01)
    assert not await follower.finish_rounds(0.05)
    in_flight.cancel()


async def test_a_stopping_leader_goes_on_ordering_until_the_cluster_stops() -> None:
    # gpud stops: the leader keeps handing out orders (no follower waits for a new leader
    # meanwhile) until its cluster's stop gives up the leadership; a follower stops
    # reporting at once
    clock, peers = Clock(), LoopbackPeers()
    leader, follower = await leader_and_follower(peers, clock)
    assert await leader.finish_rounds(1.0)
    await follower.tick()  # folded in: its order comes with the leader's next round
    await leader.tick()
    assert leader.read_order("n1", ["a"]) is not None
    await follower.tick()
    assert follower.order is not None and follower.order.seq == leader._issued[1]
    issued = leader._issued
    leader.end_rounds()  # the cluster's stop, before it gives up the leadership
    await leader.tick()
    assert leader._issued == issued
    follower.begin_stop()
    peers.leader = None  # unreachable: a report would fail
    await follower.tick()
    assert follower.last_error == ""


async def test_a_round_left_running_at_the_stop_neither_publishes_nor_leads() -> None:
    clock, peers, board = Clock(), HeldPeers(), Board()
    follower = agent(
        "n1",
        LeaderInfo("n0", "a0", 7, False),
        FakeTraffic((job("a", 0.5),)),
        peers,
        clock,
        problems=board,
    )
    in_flight = asyncio.create_task(follower.tick())
    await asyncio.sleep(0.01)
    assert not await follower.finish_rounds(0.05)  # left running
    await follower.close()
    peers.go.set()  # its report fails (no leader): an error, not published after the close
    await in_flight
    assert follower.last_error_kind == "leader_unreachable"
    assert board.writes == [] and board.entries == {}
    # a leader's round under way when the cluster stops computes no order (no tags written
    # after it gave up the leadership)
    traffic = HeldTraffic()
    leader = agent("n0", LeaderInfo("n0", "a0", 7, True), traffic, LoopbackPeers(), clock)
    leading = asyncio.create_task(leader.tick())
    assert await asyncio.to_thread(traffic.asked.wait, 5)
    leader.end_rounds()
    traffic.go.set()
    await leading
    assert leader._issued == (0, 0) and leader.order is None


class HeldTraffic(FakeTraffic):
    """A traffic service whose report waits for ``go`` (a round under way)."""

    def __init__(self) -> None:
        super().__init__(())
        self.asked, self.go = threading.Event(), threading.Event()

    def local_report(self) -> LocalReport:
        self.asked.set()
        self.go.wait(5)
        return super().local_report()


@dataclasses.dataclass
class SavedStore(MemoryTagStore):
    """Tags in memory; ``then`` runs once a save has committed."""

    then: Callable[[], None] = lambda: None

    def save(self, allocated: Mapping[str, int], released: list[str]) -> None:
        super().save(allocated, released)
        self.then()


class HeldTags:
    """n0 leads epoch 7 with job a running on n1 and job b, idle there now, whose tag it
    holds still; ``reelect`` makes n0 leader again in ``epoch``, on a new lease."""

    def __init__(self) -> None:
        self.clock, self.peers = Clock(), LoopbackPeers()
        self.store = SavedStore()
        self.events = EventLog(None)
        self.election = FixedElection(LeaderInfo("n0", "a0", 7, True, lease=100))
        self.leader = agent(
            "n0", self.election.info, FakeTraffic(), self.peers, self.clock,
            store=self.store, events=self.events,
        )  # fmt: skip
        self.leader.election = self.election
        self.peers.leader = self.leader
        self.running = dataclasses.replace(job("a", 0.5), dscp=12)
        self.idle = dataclasses.replace(job("b", 0.5), dscp=14)
        self.traffic = FakeTraffic((self.running, self.idle))
        self.follows = FixedElection(LeaderInfo("n0", "a0", 7, False))
        self.follower = agent(
            "n1", self.follows.info, self.traffic, self.peers, self.clock, store=self.store
        )
        self.follower.election = self.follows

    async def rounds(self, n: int) -> None:
        for _ in range(n):
            await self.follower.tick()
            await self.leader.tick()

    async def lead(self) -> None:
        await self.rounds(3)
        assert self.store.tags == {"a": 12, "b": 14}
        self.traffic.jobs = (self.running,)  # b idles on n1: not reported, its tag held
        await self.rounds(1)

    def reelect(self, epoch: int) -> None:
        self.election.info = LeaderInfo("n0", "a0", epoch, True, lease=200)
        self.follows.info = LeaderInfo("n0", "a0", epoch, False)

    async def n1_leads(self, jobs: tuple[JobTraffic, ...]) -> None:
        """n1 leads epoch 8 (etcd went on) with ``jobs`` reported on it; n0 follows it."""
        self.election.info = LeaderInfo("n1", "a1", 8, False)
        self.follows.info = LeaderInfo("n1", "a1", 8, True, lease=300)
        self.peers.leader = self.follower
        self.traffic.jobs = jobs
        for _ in range(3):
            await self.follower.tick()
            await self.leader.tick()
        self.peers.leader = self.leader

    async def n1_leads_alone(self) -> None:
        """n1 leads epoch 8 (etcd went on), n0's election says so, and n0 is cut off from
        it: n1 releases b, idle on it past the node timeout, and n0 accepts no order of n1."""
        self.election.info = LeaderInfo("n1", "a1", 8, False, lease=300)
        self.follows.info = LeaderInfo("n1", "a1", 8, True, lease=300)
        for _ in range(5):
            self.clock.now += 6
            await self.follower.tick()
        assert self.store.tags == {"a": 12}

    def republished(self) -> list[str]:
        return [e.message for e in self.events.recent() if e.kind == "cluster.tags_republished"]


async def test_a_leader_reelected_on_a_wiped_etcd_writes_back_the_tags_it_held() -> None:
    # etcd restored from an empty snapshot: the tags are gone, and the leader's key and
    # lease with them. Re-elected (the revisions went back: a lower epoch, a new lease), the
    # leader writes back every tag it held, the tag of a job idle on its node this round
    # too, so that the job keeps its DSCP and etcd lists it for the next leader.
    c = HeldTags()
    await c.lead()
    c.store.tags.clear()  # the wipe: every key gone
    c.reelect(2)
    await c.rounds(3)
    assert c.store.tags == {"a": 12, "b": 14}
    assert c.republished() == [
        "etcd had lost 2 DSCP tags this node gave out in its last leadership, no other "
        "leader seen by this node since (restored from a snapshot, or a new etcd): written "
        "back, a=12, b=14"
    ]
    said = [e for e in c.events.recent() if e.kind == "cluster.tags_republished"]
    assert said[0].fields["jobs"] == 2
    c.traffic.jobs = (c.running, c.idle)  # b runs again: the tag its nodes mark it with
    await c.rounds(2)
    await c.follower.tick()
    assert c.follower.order is not None and c.follower.order.tags == {"a": 12, "b": 14}


async def test_a_leader_reelected_in_a_higher_epoch_after_a_restore_writes_back_its_tags() -> None:
    # etcd restored from a snapshot taken after the election: the leader key is there, b's
    # tag is not. The leader steps down and is elected again on a new key (a higher epoch);
    # no other leader came between: b's tag was lost by etcd, not released, and goes back
    c = HeldTags()
    await c.lead()
    del c.store.tags["b"]
    c.reelect(9)
    await c.rounds(3)
    assert c.store.tags == {"a": 12, "b": 14}
    assert len(c.republished()) == 1 and c.republished()[0].endswith("written back, b=14")


async def test_a_leader_that_followed_another_since_takes_its_tags_from_etcd() -> None:
    # n1 led meanwhile: it released b and gave b's DSCP to c (its node handed it over), and
    # n0 applied its orders. Then etcd is wiped and n0 elected first: what n0 held before
    # n1 led is no longer the cluster's, so nothing is written back and no event says so
    c = HeldTags()
    await c.lead()
    handed = dataclasses.replace(job("c", 0.5), dscp=14)
    await c.n1_leads((c.running, handed))
    assert c.store.tags == {"a": 12, "c": 14}
    assert c.leader.order is not None and c.leader.order.leader == "n1"
    c.store.tags.clear()
    c.traffic.jobs = (c.running,)  # c idles on n1 now
    c.reelect(2)
    await c.rounds(3)
    assert c.store.tags == {"a": 12} and c.republished() == []


async def test_tags_written_back_by_a_round_cut_after_its_save_are_said() -> None:
    # the cluster stops during the first round of the new leadership, right after the
    # save that wrote the tags back: etcd has them, and the event says so all the same
    c = HeldTags()
    await c.lead()
    c.store.tags.clear()
    c.reelect(2)
    await c.follower.tick()
    c.store.then = c.leader.end_rounds
    await c.leader.tick()
    assert c.store.tags == {"a": 12, "b": 14}
    assert len(c.republished()) == 1 and c.republished()[0].endswith("a=12, b=14")


async def test_a_leader_whose_successor_it_never_reached_writes_back_no_released_tag() -> None:
    # n0, cut off from n1, never accepts an order of n1's, but its election names n1 in a
    # higher epoch (on_change, between n0's rounds): n1 may have released b, so when n0
    # leads again etcd's tags are the truth and nothing is said written back
    c = HeldTags()
    await c.lead()
    await c.n1_leads_alone()
    c.leader.seen_leader()  # the election's on_change, as the runtime wires it
    c.reelect(9)
    await c.rounds(3)
    assert c.store.tags == {"a": 12} and c.republished() == []


async def test_a_leader_cut_off_from_its_successor_in_its_rounds_writes_back_no_released_tag() -> (
    None
):
    # the same, seen by n0's own rounds while n1 leads (each report to n1 fails)
    c = HeldTags()
    await c.lead()
    c.peers.leader = None  # n1 unreachable from n0
    c.election.info = LeaderInfo("n1", "a1", 8, False, lease=300)
    await c.leader.tick()
    assert c.leader.last_error_kind == "leader_unreachable"
    c.peers.leader = c.leader
    await c.n1_leads_alone()
    c.reelect(9)
    await c.rounds(3)
    assert c.store.tags == {"a": 12} and c.republished() == []


async def test_a_leader_key_of_a_lower_epoch_from_a_snapshot_keeps_the_tags_to_write_back() -> None:
    # etcd restored from a snapshot that still names n1 leader in epoch 3 (below n0's 7):
    # no leadership after n0's, so n0, elected again, writes back what etcd lost
    c = HeldTags()
    await c.lead()
    c.store.tags.clear()
    c.election.info = LeaderInfo("n1", "a1", 3, False, lease=50)
    c.leader.seen_leader()
    c.reelect(4)
    await c.rounds(3)
    assert c.store.tags == {"a": 12, "b": 14}
    assert len(c.republished()) == 1 and c.republished()[0].endswith("a=12, b=14")
