"""[cluster] config checks, report bounds, the node view, certificates and mutual TLS."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from gpud import config
from gpud.cluster.api import PeerClient, PeerServer
from gpud.cluster.convert import MAX_JOBS, report_from_pb, report_to_pb
from gpud.cluster.election import LeaderInfo
from gpud.cluster.model import JobReport, NodeReport
from gpud.cluster.nodeview import DaemonNodeView
from gpud.cluster.tls import PeerTls
from gpud.errors import ConfigError, InvalidArgument, Unavailable
from gpud.v1 import cluster_pb2 as pb
from tools.certs import make_ca, make_node


def load(text: str) -> config.Config:
    import tomllib

    return config.from_dict(tomllib.loads(text), path="gpud.toml")


def test_single_needs_nothing() -> None:
    assert load("[cluster]\n").cluster.election == "single"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('election = "etcd"', "cluster.listen"),
        ('election = "etcd"\nlisten = "127.0.0.1:7443"', "cluster.ca_file"),
        ("lease_ttl_s = 1", "cluster.lease_ttl_s"),
        ("grace_s = -1.0", "cluster.grace_s"),
        ('etcd_prefix = "gpud"', "cluster.etcd_prefix"),
        ('listen = "nowhere"', "cluster.listen"),
        (
            'election = "etcd"\nlisten = "127.0.0.1:0"\nca_file = "a"\ncert_file = "b"\n'
            'key_file = "c"\netcd_endpoints = "ftp://x:1"',
            "cluster.etcd_endpoints",
        ),
    ],
)
def test_bad_cluster_config_names_the_key(text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load(f"[cluster]\n{text}\n")


def test_reports_are_checked_and_round_trip() -> None:
    report = NodeReport(
        "n1",
        (JobReport("a", 0.5, 2.0, 12, ("G1",), ("G1",), (79,), False, 10, 2),),
        applied_epoch=4,
        instance="5f3a9c0e1b2d4a68",
    )
    assert report_from_pb(report_to_pb(report)) == report
    too_many = pb.ReportRequest(
        node="n1", jobs=[pb.JobReport(job=f"j{i}") for i in range(MAX_JOBS + 1)]
    )
    with pytest.raises(InvalidArgument, match="jobs"):
        report_from_pb(too_many)
    with pytest.raises(InvalidArgument, match="node"):
        report_from_pb(pb.ReportRequest(node=""))
    with pytest.raises(InvalidArgument, match=r"jobs\[0\]\.progress_rate"):
        report_from_pb(
            pb.ReportRequest(node="n", jobs=[pb.JobReport(job="a", progress_rate=float("nan"))])
        )
    with pytest.raises(InvalidArgument, match=r"jobs\[0\]\.dscp"):
        report_from_pb(pb.ReportRequest(node="n", jobs=[pb.JobReport(job="a", dscp=64)]))


def test_node_view_reads_link_state_from_sysfs(tmp_path: Path) -> None:
    for name, state in (("eth0", "up"), ("eth1", "down")):
        d = tmp_path / "class" / "net" / name
        d.mkdir(parents=True)
        (d / "operstate").write_text(state + "\n")
    view = DaemonNodeView(list, lambda: None, interfaces=("eth0",), sysfs_root=tmp_path)
    assert view.links_up() is True
    view = DaemonNodeView(list, lambda: None, interfaces=("eth0", "eth1"), sysfs_root=tmp_path)
    assert view.links_up() is False
    assert DaemonNodeView(list, lambda: None).links_up() is None
    view = DaemonNodeView(list, lambda: None, interfaces=("gone0",), sysfs_root=tmp_path)
    assert view.links_up() is False


def test_missing_certificate_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("")
    with pytest.raises(ConfigError, match=r"cluster\.cert_file"):
        PeerTls.load(tmp_path / "ca.pem", None, None)
    with pytest.raises(ConfigError, match=r"cluster\.ca_file"):
        PeerTls.load(tmp_path / "missing.pem", tmp_path / "x", tmp_path / "y")


class Leading:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def state(self) -> LeaderInfo:
        return LeaderInfo("leader", "", 3, True)


async def test_mutual_tls_lets_cluster_members_in_and_nobody_else(tmp_path: Path) -> None:
    from gpud.cluster.agent import ClusterAgent
    from gpud.cluster.ports import MemoryTagStore, StaticNodeView
    from gpud.net.port import FakeTraffic
    from netshaper.leveller import LevellerConfig

    pki, other = tmp_path / "pki", tmp_path / "other"
    make_ca(pki)
    make_ca(other)
    for name in ("leader", "n1"):
        make_node(pki, name, pki)
    make_node(other, "n1", other)
    agent = ClusterAgent(
        node="leader",
        election_kind="etcd",
        election=Leading(),
        traffic=FakeTraffic(),
        view=StaticNodeView(gpus={"a": ("G",)}),
        tag_store=lambda epoch: MemoryTagStore(),
        leveller=LevellerConfig(levels=4),
        reserved_tags=(0,),
        peers=None,
        grace_s=30,
        fresh_s=3,
        node_timeout_s=5,
    )
    server = PeerServer(
        "127.0.0.1:0",
        PeerTls.load(pki / "ca.pem", pki / "leader.pem", pki / "leader-key.pem"),
        agent,
    )
    await server.start()
    address = f"127.0.0.1:{server.port}"
    member = PeerClient(
        PeerTls.load(pki / "ca.pem", pki / "n1.pem", pki / "n1-key.pem"), timeout_s=5
    )
    stranger = PeerClient(
        PeerTls.load(pki / "ca.pem", other / "n1.pem", other / "n1-key.pem"), timeout_s=5
    )
    try:
        await agent.tick()
        report = NodeReport("n1", (JobReport("a", 0.5),))
        assert await member.report(address, "leader", report) is None  # not folded in yet
        await agent.tick()
        order = await member.report(address, "leader", report)
        assert order is not None and order.epoch == 3 and set(order.levels) == {"a"}
        with pytest.raises(Unavailable):
            await stranger.report(address, "leader", report)
        with pytest.raises(Unavailable, match=r"PERMISSION_DENIED.*cannot report as 'n2'"):
            await member.report(address, "leader", NodeReport("n2", (JobReport("a", 0.5),)))
        with pytest.raises(Unavailable):  # the leader's certificate does not name "n9"
            await member.report(address, "n9", report)
        async with grpc.aio.insecure_channel(address) as channel:
            from gpud.v1 import cluster_pb2_grpc

            with pytest.raises(grpc.aio.AioRpcError):
                await cluster_pb2_grpc.ClusterPeerStub(channel).GetOrder(
                    pb.GetOrderRequest(node="x"), timeout=5
                )
    finally:
        await member.close()
        await stranger.close()
        await server.stop(None)
        await asyncio.sleep(0)
