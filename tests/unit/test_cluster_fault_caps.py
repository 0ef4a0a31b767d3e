"""Which faults the cluster's bounds keep: a node's own report, the leader's fold of a job
over its nodes, and the order each node gets (each a fair share, and a count of what was
cut)."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from gpud.api.validate import request_bounds
from gpud.cluster.agent import ClusterAgent
from gpud.cluster.convert import (
    attributes_from_pb,
    attributes_to_pb,
    order_from_pb,
    order_to_pb,
    report_from_pb,
    report_to_pb,
)
from gpud.cluster.election import LeaderInfo
from gpud.cluster.leader import Aggregator
from gpud.cluster.model import (
    MAX_FAULTS_LEFT_OUT,
    MAX_JOB_FAULTS,
    MAX_ORDER_FAULTS,
    JobReport,
    NodeReport,
    by_turns,
    fair_shares,
)
from gpud.cluster.ports import MemoryTagStore, StaticNodeView
from gpud.net.port import FakeTraffic
from gpud.shared import CLUSTER_MAX_REPORT_XIDS, CLUSTER_MAX_XIDS
from netshaper.leveller import Leveller, LevellerConfig
from tests.unit.cluster_support import Clock, LoopbackPeers, agent, job


def _aggregator() -> Aggregator:
    return Aggregator(
        leader="leader",
        leveller=Leveller(LevellerConfig(levels=4)),
        tags=MemoryTagStore(),
        node_timeout_s=5,
    )


def _faulted(node: str, jobs: list[str], gpus: int, critical: int) -> NodeReport:
    """``node`` running every one of ``jobs`` on each of its ``gpus``, the first
    ``critical`` of them lost with an uncleared XID 79."""
    held = tuple(f"GPU-{node}-{g}" for g in range(gpus))
    lost = held[:critical]
    return NodeReport(
        node,
        tuple(
            JobReport(
                j,
                0.5,
                gpus=held,
                unhealthy_gpus=lost,
                xids=(79,) * len(lost),
                critical_xids=tuple(f"{u}:79" for u in lost),
            )
            for j in jobs
        ),
    )


def test_shares_are_even_and_what_one_needs_less_of_goes_to_the_others() -> None:
    assert fair_shares([10, 1, 5], 9) == [4, 1, 4]
    assert fair_shares([3, 3, 3], 7) == [3, 2, 2]  # the first ones get the one left over
    assert fair_shares([0, 100, 100], 11) == [0, 6, 5]
    assert fair_shares([5, 5], 20) == [5, 5]


def test_a_fleet_wide_fault_leaves_every_job_of_a_node_its_share_of_faults() -> None:
    """128 nodes of 8 GPUs, 8 jobs on all of them, half the nodes' GPUs lost with XID 79:
    each job has 512 entries in each list. The order of a node cut at 8192 entries in job
    name order, so jobs g and h got none (attributes said healthy) while a..e kept their
    xids, the summary, and f lost its critical_xids to them."""
    leader = _aggregator()
    jobs = list("abcdefgh")
    for n in range(128):
        leader.receive(_faulted(f"n{n:03d}", jobs, 8, 8 if n % 2 else 0), 0.0)
    leader.compute(1, 0.0)
    answer = leader.answer("n000")
    assert answer is not None
    kept = [answer.attributes[j] for j in jobs]
    assert sum(len(a.unhealthy_gpus) + len(a.xids) + len(a.critical_xids) for a in kept) == (
        MAX_ORDER_FAULTS
    )
    assert [a.job for a in kept if not (a.unhealthy_gpus and a.critical_xids)] == []
    for a in kept:  # 1024 each: the lost GPUs and their XIDs kept, the codes alone cut
        assert (len(a.unhealthy_gpus), len(a.critical_xids), len(a.xids)) == (512, 512, 0)
        assert a.faults_left_out == 512
        assert attributes_from_pb(attributes_to_pb(a)).faults_left_out == 512


def _noisy_and_quiet() -> list[NodeReport]:
    noisy = NodeReport(
        "n0",
        (JobReport("a", critical_xids=tuple(f"GPU-{i}:79" for i in range(MAX_JOB_FAULTS))),),
    )
    return [noisy, NodeReport("n1", (JobReport("a", critical_xids=("GPU-Q:48",)),))]


def test_a_noisy_node_hides_no_other_nodes_critical_xid() -> None:
    """A peer reporting 1024 critical XIDs for a job first took the job's whole bound:
    the XID another node really had on it was dropped, and nothing said so."""
    leader = _aggregator()
    for report in _noisy_and_quiet():
        leader.receive(report, 0.0)
    leader.compute(1, 0.0)
    assert leader.order is not None
    a = leader.order.attributes["a"]
    assert "n1/GPU-Q:48" in a.critical_xids
    assert len(a.critical_xids) == MAX_JOB_FAULTS and a.faults_left_out == 1


def test_the_fold_keeps_the_same_faults_whatever_order_the_reports_arrived_in() -> None:
    """A new leader hears the nodes in another order than the one before: the faults it
    keeps of a job past its bound were those of whichever nodes reported first."""
    folded = []
    for reports in (_noisy_and_quiet(), _noisy_and_quiet()[::-1]):
        leader = _aggregator()
        for report in reports:
            leader.receive(report, 0.0)
        leader.compute(1, 0.0)
        assert leader.order is not None
        folded.append(leader.order.attributes["a"].critical_xids)
    assert folded[0] == folded[1]


def _crowded_node() -> ClusterAgent:
    """A node of 64 devices with 13 uncleared codes each, held by 20 jobs: 16640 critical
    XIDs over the report, past the 16384 the leader takes."""
    devices = tuple(f"GPU-{d}" for d in range(64))
    jobs = [f"j{i:02d}" for i in range(20)]
    view = StaticNodeView(
        gpus=dict.fromkeys(jobs, devices), critical=dict.fromkeys(devices, tuple(range(13)))
    )
    info = LeaderInfo("leader", "10.0.0.9:7443", 3, False)
    traffic = FakeTraffic(tuple(job(name, 0.5) for name in jobs))
    return agent("n1", info, traffic, LoopbackPeers(), Clock(), view=view)


def test_a_node_past_the_reports_totals_trims_its_own_and_is_accepted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """64 devices with 13 uncleared codes each, held by 20 jobs: 16640 critical XIDs over
    the report, past the 16384 the leader takes. The node sent them all and was refused
    whole every tick, cut off the cluster. It now cuts each job to an even share, says so
    once, and the leader's bounds pass its report."""
    node = _crowded_node()
    with caplog.at_level(logging.WARNING, logger="gpud.cluster"):
        report = node.local_report()
        again = node.local_report()
    request_bounds(report_to_pb(report))
    assert report == again
    kept = [len(j.critical_xids) for j in report.jobs]
    assert sum(kept) == CLUSTER_MAX_REPORT_XIDS and min(kept) >= CLUSTER_MAX_REPORT_XIDS // 20
    said = [r.getMessage() for r in caplog.records if "cut to the cluster's bounds" in r.message]
    assert said == [
        "cluster: this node's report cut to the cluster's bounds, each job an even share: "
        "256 of critical_xids"
    ]


def test_an_order_cut_past_its_bound_keeps_the_quiet_nodes_fault_of_a_job() -> None:
    """n0 reports jobs a..i with 1024 critical XIDs each and n1 job a with one; z9 runs
    a..i. z9's order keeps an even share of each job's list, its front: the fold listed
    n0's entries before n1's, so job a's share in z9's order lacked n1's XID."""
    leader = _aggregator()
    jobs = list("abcdefghi")
    noisy = tuple(f"GPU-{i}:79" for i in range(MAX_JOB_FAULTS))
    leader.receive(NodeReport("n0", tuple(JobReport(j, critical_xids=noisy) for j in jobs)), 0.0)
    leader.receive(NodeReport("n1", (JobReport("a", critical_xids=("GPU-Q:48",)),)), 0.0)
    leader.receive(NodeReport("z9", tuple(JobReport(j) for j in jobs)), 0.0)
    leader.compute(1, 0.0)
    answer = leader.answer("z9")
    assert answer is not None
    a = answer.attributes["a"]
    assert len(a.critical_xids) < MAX_JOB_FAULTS  # the order cut it
    assert "n1/GPU-Q:48" in a.critical_xids
    assert a.critical_xids[:3] == ("n0/GPU-0:79", "n1/GPU-Q:48", "n0/GPU-1:79")


def test_a_node_cutting_its_report_keeps_every_devices_codes_and_says_how_many_it_cut() -> None:
    """The crowded node cut each job to its share, the front of its list, which listed
    device by device: the job's last devices lost all or most of their codes, and the
    leader's faults_left_out did not count them."""
    report = _crowded_node().local_report()
    for j in report.jobs:
        per_device = Counter(pair.rsplit(":", 1)[0] for pair in j.critical_xids)
        assert len(per_device) == 64 and min(per_device.values()) >= 12, j.job
        assert j.faults_left_out == 64 * 13 - len(j.critical_xids)
    assert sum(j.faults_left_out for j in report.jobs) == 256
    assert report_from_pb(report_to_pb(report)) == report
    leader = _aggregator()
    leader.receive(report, 0.0)
    leader.receive(NodeReport("n2", (JobReport("j00", faults_left_out=3),)), 0.0)
    leader.compute(1, 0.0)
    assert leader.order is not None
    assert leader.order.attributes["j00"].faults_left_out == report.jobs[0].faults_left_out + 3


def test_a_job_past_its_xid_bound_keeps_every_devices_codes_and_counts_the_cut() -> None:
    """One job on 64 devices with 17 uncleared codes each: 1088 pairs, past the 1024 a
    job may send. The node kept the first 1024, device by device: the last three devices
    reported none, and nothing counted the 64 cut."""
    devices = tuple(f"GPU-{d}" for d in range(64))
    view = StaticNodeView(gpus={"a": devices}, critical=dict.fromkeys(devices, tuple(range(17))))
    info = LeaderInfo("leader", "10.0.0.9:7443", 3, False)
    node = agent("n1", info, FakeTraffic((job("a", 0.5),)), LoopbackPeers(), Clock(), view=view)
    (a,) = node.local_report().jobs
    per_device = Counter(pair.rsplit(":", 1)[0] for pair in a.critical_xids)
    assert len(a.critical_xids) == CLUSTER_MAX_XIDS and a.faults_left_out == 64
    assert set(per_device.values()) == {16}


def test_a_jobs_left_out_count_past_its_wire_type_saturates_and_the_order_is_sent() -> None:
    """Two nodes each said they cut 2**32 - 1 entries of job a: the leader's sum passed
    faults_left_out's uint32 and building the order raised ValueError, so every node of
    the job got INTERNAL for its reports instead of its order."""
    leader = _aggregator()
    most = 2**32 - 1
    for node in ("n1", "n2"):
        leader.receive(NodeReport(node, (JobReport("a", faults_left_out=most),)), 0.0)
    leader.compute(1, 0.0)
    answer = leader.answer("n1")
    assert answer is not None
    assert answer.attributes["a"].faults_left_out == MAX_FAULTS_LEFT_OUT == most
    assert order_from_pb(order_to_pb(answer)).attributes["a"].faults_left_out == most
    past = answer.attributes["a"]._replace(faults_left_out=2 * most)
    assert attributes_to_pb(past).faults_left_out == most


def test_an_orders_own_cut_keeps_a_saturated_left_out_count_within_its_wire_type() -> None:
    """A job whose nodes' count is already at the bound, cut again by its order."""
    leader = _aggregator()
    noisy = tuple(f"GPU-{i}:79" for i in range(MAX_JOB_FAULTS))
    jobs = list("abcdefghi")
    most = 2**32 - 1
    leader.receive(
        NodeReport(
            "n0", tuple(JobReport(j, critical_xids=noisy, faults_left_out=most) for j in jobs)
        ),
        0.0,
    )
    leader.compute(1, 0.0)
    answer = leader.answer("n0")
    assert answer is not None
    assert len(answer.attributes["a"].critical_xids) < MAX_JOB_FAULTS  # the order cut it
    assert answer.attributes["a"].faults_left_out == most
    assert attributes_to_pb(answer.attributes["a"]).faults_left_out == most


def test_round_robin_keeps_entries_that_are_none() -> None:
    assert by_turns([[None, 1], [2], [None, None, 3]]) == [None, 2, None, 1, None, 3]
