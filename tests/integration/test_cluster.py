"""Three gpud processes on loopback, one real etcd: election, failover, fencing,
fail-static, mutual TLS and runtime attributes, end to end."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

import gpud.client
from gpud.cluster.etcd import EtcdClient, EtcdSettings
from gpud.v1 import cluster_pb2 as pb
from gpud.v1 import cluster_pb2_grpc as pb_grpc
from tests.integration.cluster_support import (
    TTL_S,
    Cluster,
    Node,
    Proxy,
    config_text,
    start_cluster,
)
from tests.integration.conftest import start_daemon, stop_daemon
from tools.certs import make_ca, make_node
from tools.etcd_local import LocalEtcd, etcd_binary

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed"),
]

JOB = "train-a"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with LocalEtcd() as etcd:
        c = start_cluster(tmp_path, etcd)
        try:
            for node in c.nodes:  # one job spanning the three nodes
                c.run_job(node, JOB)
            c.wait(c.settled, what="one leader, its order applied everywhere")
            c.wait(
                lambda: all([j["job"] for j in n.status()["jobs"]] == [JOB] for n in c.nodes),
                what="the job in every node's order",
            )
            yield c
        finally:
            c.close()


def levels(status: dict[str, Any]) -> dict[str, Any]:
    return {j["job"]: (j.get("level"), j.get("dscp")) for j in status["jobs"]}


def test_one_leader_then_failover_keeps_the_last_order_during_the_gap(cluster: Cluster) -> None:
    ((leader, before),) = cluster.leaders()
    kept = {n.name: levels(n.status()) for n in cluster.nodes}
    assert len({str(v) for v in kept.values()}) == 1  # the same order on every node
    assert all(n.status()["leader"] == leader.name for n in cluster.nodes)
    # every node shows every node's last report, asked of the leader
    assert all(
        sorted(m["node"] for m in n.status()["nodes"]) == ["n0", "n1", "n2"] for n in cluster.nodes
    )

    os.kill(leader.daemon.proc.pid, signal.SIGKILL)
    leader.daemon.proc.wait()
    killed = time.monotonic()
    survivors = cluster.live()
    new_leader: Node | None = None
    while new_leader is None:
        assert time.monotonic() - killed < 30, "no new leader"
        for n in survivors:
            s = n.status()
            if s.get("leading") and s["epoch"] > before["epoch"]:
                new_leader = n
                break
            # the gap: the last order stays in force, from the old epoch
            assert s["applied_epoch"] in (before["epoch"], s["epoch"])
            if s["applied_epoch"] == before["epoch"]:
                assert levels(s) == kept[n.name], f"{n.name} changed its order during the gap"
                assert s["mode"] in ("follower", "holding")
    failover = time.monotonic() - killed
    assert failover <= 2 * TTL_S, f"failover took {failover:.2f} s"
    epoch = new_leader.status()["epoch"]
    cluster.wait(
        lambda: all(n.status()["applied_epoch"] == epoch for n in survivors),
        what="the new leader's order applied everywhere",
    )
    assert {str(levels(n.status())) for n in survivors} == {str(kept[survivors[0].name])}
    # the tag lives in etcd, where the new leader found it
    etcd = EtcdClient(EtcdSettings(endpoints=(cluster.etcd.endpoint,)))
    stored = etcd.get_prefix(f"{cluster.prefix}/tags/")
    assert {k.rsplit("/", 1)[1]: int(v) for k, v in stored.items()} == {
        JOB: kept[survivors[0].name][JOB][1]
    }


def test_a_leader_cut_off_from_etcd_steps_down_before_a_successor_is_elected(
    cluster: Cluster,
) -> None:
    ((leader, before),) = cluster.leaders()
    leader.proxy.cut()
    cluster.wait(
        lambda: any(
            s.get("leading") and s["epoch"] > before["epoch"]
            for n in cluster.nodes
            if n is not leader
            for s in [n.status()]
        ),
        what="a new leader",
    )
    successor = next(n for n in cluster.nodes if n is not leader and n.status().get("leading"))
    (stepped,) = [e for e in leader.events("cluster.step_down")][-1:]
    (elected,) = [e for e in successor.events("cluster.elected")][-1:]
    assert stepped["time_unix_seconds"] < elected["time_unix_seconds"]
    status = leader.status()
    assert not status["leading"] and not status["store_ok"]
    # the old leader keeps the order of its own last epoch, or follows the new one
    assert status["applied_epoch"] >= before["epoch"]
    leader.proxy.heal()
    epoch = successor.status()["epoch"]
    cluster.wait(
        lambda: all(n.status()["applied_epoch"] == epoch for n in cluster.nodes),
        what="the deposed leader follows the new epoch",
    )
    assert all(n.status()["rejected_orders"] == 0 for n in cluster.nodes)


def test_a_follower_cut_off_from_etcd_shows_the_leader_its_old_leader_named(
    cluster: Cluster,
) -> None:
    """The follower cannot read etcd when the leader steps down; the old leader names its
    successor, and the follower reports there: its status names the successor (a hint,
    not etcd's word, and since when) and lists the nodes the successor heard from."""
    ((leader, before),) = cluster.leaders()
    follower, other = [n for n in cluster.nodes if n is not leader]
    follower.proxy.cut()
    leader.proxy.cut()
    cluster.wait(lambda: bool(other.status().get("leading")), what=f"{other.name} leads")
    leader.proxy.heal()
    epoch = other.status()["epoch"]
    cluster.wait(
        lambda: follower.status().get("applied_epoch") == epoch,
        what=f"{follower.name} follows {other.name} on {leader.name}'s word",
    )
    status = follower.status()
    assert status["mode"] == "follower" and not status["store_ok"]
    assert (status["leader"], status["leader_source"]) == (other.name, "hint")
    assert (status["elected_leader"], status["epoch"]) == (leader.name, before["epoch"])
    assert 0 <= time.time() - status["leader_since_unix_seconds"] < 30
    assert sorted(n["node"] for n in status["nodes"]) == ["n0", "n1", "n2"]
    text = follower.status_text()
    assert f"leader:      {other.name} at " in text
    assert f"not from etcd: named by {leader.name}" in text
    follower.proxy.heal()
    cluster.wait(
        lambda: (
            follower.status().get("leader_source") == "election"
            and follower.status().get("elected_leader") == other.name
        ),
        what="etcd names the leader again",
    )


def test_etcd_restart_is_ridden_out_fail_static(cluster: Cluster) -> None:
    ((_, before),) = cluster.leaders()
    kept = {n.name: levels(n.status()) for n in cluster.nodes}
    cluster.etcd.stop()
    time.sleep(TTL_S * 2)  # the leader steps down; nobody can be elected
    for n in cluster.nodes:
        s = n.status()
        assert s["applied_epoch"] == before["epoch"]
        assert levels(s) == kept[n.name]
        assert s["mode"] in ("holding", "follower", "leader")
    cluster.etcd.start()
    cluster.wait(cluster.settled, what="a leader again after etcd came back")
    assert all(n.alive() for n in cluster.nodes)
    assert {str(levels(n.status())) for n in cluster.nodes} == {str(kept["n0"])}


def _peer_address(cluster: Cluster) -> tuple[str, str]:
    ((leader, status),) = cluster.leaders()
    return str(status["leader_address"]), leader.name


def _report(
    target: str, name: str, creds: grpc.ChannelCredentials, node: str = "intruder"
) -> pb.ReportResponse:
    with grpc.secure_channel(
        target, creds, options=[("grpc.ssl_target_name_override", name)]
    ) as channel:
        response: pb.ReportResponse = pb_grpc.ClusterPeerStub(channel).Report(
            pb.ReportRequest(node=node, jobs=[pb.JobReport(job="x")]), timeout=5
        )
        return response


def test_peers_without_a_certificate_of_the_cluster_ca_are_refused(
    cluster: Cluster, tmp_path: Path
) -> None:
    target, name = _peer_address(cluster)
    pki = cluster.root / "pki"
    ca = (pki / "ca.pem").read_bytes()
    other = tmp_path / "other"
    make_ca(other)
    make_node(other, "intruder", other)
    refused = [
        grpc.ssl_channel_credentials(root_certificates=ca),  # no client certificate
        grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=(other / "intruder-key.pem").read_bytes(),
            certificate_chain=(other / "intruder.pem").read_bytes(),
        ),
    ]
    for creds in refused:
        with pytest.raises(grpc.RpcError) as err:
            _report(target, name, creds)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with (
            pytest.raises(grpc.RpcError),
            grpc.secure_channel(
                target, creds, options=[("grpc.ssl_target_name_override", name)]
            ) as channel,
        ):
            pb_grpc.ClusterPeerStub(channel).GetOrder(pb.GetOrderRequest(node="x"), timeout=5)
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError):
        pb_grpc.ClusterPeerStub(channel).GetOrder(pb.GetOrderRequest(node="x"), timeout=5)
    # refused at the handshake, each connection without a line of its own in the leader's
    # log (the journal): anyone who reaches the port could fill it
    leader = next(n for n in cluster.nodes if n.name == name)
    assert "Handshake failed" not in leader.daemon.log.read_text(errors="replace")
    # a certificate of the cluster CA gets in
    make_node(pki, "n9", tmp_path)
    ok = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=(tmp_path / "n9-key.pem").read_bytes(),
        certificate_chain=(tmp_path / "n9.pem").read_bytes(),
    )
    _report(target, name, ok, node="n9")
    # ... and reports only as the node its certificate names
    with pytest.raises(grpc.RpcError) as err:
        _report(target, name, ok, node="n1")
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_node_whose_certificate_the_leader_refuses_says_so_on_every_node(
    cluster: Cluster, tmp_path: Path
) -> None:
    """n4 came with a PKI of its own (a CA rotated on some nodes only): the leader's TLS
    stack sees only a failed handshake; n4 knows its reports fail, and publishes that in
    etcd, where ``gpuctl cluster status`` on any node reads it."""
    pki = tmp_path / "n4-pki"
    make_ca(pki)
    make_node(pki, "n4", pki)
    proxy = Proxy(("127.0.0.1", cluster.etcd.client_port))
    daemon = start_daemon(
        tmp_path / "n4",
        "--simulate",
        config_text=config_text(tmp_path, "n4", proxy.port, cluster.prefix, pki),
    )
    cluster.nodes.append(Node("n4", daemon, proxy))  # closed with the cluster

    def problems(node: Node) -> dict[str, str]:
        return {p["node"]: p["message"] for p in node.status().get("problems", [])}

    for node in cluster.nodes[:3]:
        cluster.wait(lambda node=node: "n4" in problems(node), what=f"n4's problem on {node.name}")
    assert set(problems(cluster.nodes[0])) == {"n4"}  # the others report fine
    text = cluster.nodes[0].status_text()
    assert "PROBLEM" in text and "n4" in text


def _first_seen_with_fault(node: Node, victim: str, seen: dict[str, tuple[int, int]]) -> None:
    """Watch ``node``'s attributes until the job shows a lost GPU on ``victim``."""
    with grpc.insecure_channel(f"unix:{node.daemon.socket}") as channel:
        stream = pb_grpc.ClusterStub(channel).WatchAttributes(
            pb.GetAttributesRequest(jobs=[JOB]), timeout=60
        )
        for resp in stream:
            if any(u.startswith(f"{victim}/") for a in resp.attributes for u in a.unhealthy_gpus):
                seen[node.name] = (resp.epoch, resp.seq)
                stream.cancel()
                return


def test_a_lost_gpu_shows_in_the_jobs_attributes_on_every_node(cluster: Cluster) -> None:
    victim = cluster.nodes[1]
    before = gpud.client.attributes(JOB, socket=victim.daemon.socket)
    assert before is not None and before.unhealthy_gpus == ()
    seen: dict[str, tuple[int, int]] = {}
    watchers = [
        threading.Thread(target=_first_seen_with_fault, args=(n, victim.name, seen))
        for n in cluster.nodes
    ]
    for w in watchers:
        w.start()
    time.sleep(1)  # the watches are open
    victim.daemon.gpuctl("sim", "fault", "--gpu", "0", "lost")
    for w in watchers:
        w.join(timeout=60)
    assert set(seen) == {n.name for n in cluster.nodes}, seen
    # every node applies the leader's first order that carries the fault, or the one after
    # it: one round (each node's next report) after the leader folded in the victim's
    (epoch,) = {epoch for epoch, _ in seen.values()}
    first = min(seq for _, seq in seen.values())
    assert all(seq - first <= 1 for _, seq in seen.values()), seen
    for n in cluster.nodes:
        after = gpud.client.attributes(JOB, socket=n.daemon.socket)
        assert after is not None and after.epoch == epoch
        assert any(u.startswith(f"{victim.name}/") for u in after.unhealthy_gpus)
        assert sorted(after.nodes) == ["n0", "n1", "n2"]


def test_a_node_whose_certificate_the_others_refuse_never_leads(tmp_path: Path) -> None:
    """n2 came with a PKI of its own: it passes its own start check (its cluster.ca_file is
    that other CA), but n0 and n1 refuse it. Once they are gone it must not be elected, or
    no node could report to anyone when they come back."""
    with LocalEtcd() as etcd:
        c = start_cluster(tmp_path, etcd, n=2)
        try:
            c.wait(c.settled, what="one leader of n0, n1")
            pki = tmp_path / "n2-pki"
            make_ca(pki)
            make_node(pki, "n2", pki)
            proxy = Proxy(("127.0.0.1", etcd.client_port))
            daemon = start_daemon(
                tmp_path / "n2",
                "--simulate",
                config_text=config_text(tmp_path, "n2", proxy.port, c.prefix, pki),
            )
            foreign = Node("n2", daemon, proxy)
            c.nodes.append(foreign)  # closed with the cluster
            c.wait(lambda: foreign.status().get("leader") in ("n0", "n1"), what="n2 follows")
            for node in c.nodes[:2]:
                stop_daemon(node.daemon)
            deadline = time.monotonic() + 4 * TTL_S + 2
            while time.monotonic() < deadline:
                assert not foreign.status().get("leading"), "n2 was elected"
                time.sleep(0.1)
            status = foreign.status()
            assert "would refuse this node's certificate" in status["detail"]
            assert "n0, n1" in status["detail"]
            (event,) = foreign.events("cluster.not_candidate")
            assert "openssl verify -CAfile" in event["message"]
            text = foreign.status_text()
            assert "would refuse this node's certificate" in text
        finally:
            c.close()
