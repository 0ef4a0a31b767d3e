"""gpuctl cluster and gpud.client.attributes against an in-process Cluster service."""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import gpud.client
from gpud.api import ApiServer
from gpud.cli.cluster import builds_line
from gpud.cli.main import main
from gpud.cluster.agent import ClusterAgent
from gpud.cluster.api import ClusterServicer, status_to_pb
from gpud.cluster.certexpiry import CertWatch
from gpud.cluster.election import LeaderInfo
from gpud.cluster.model import MAX_JOB_FAULTS, JobReport, NodeReport
from gpud.cluster.ports import MemoryTagStore, StaticNodeView
from gpud.net.port import FakeTraffic
from netshaper.leveller import LevellerConfig
from tests.unit.api_support import ServerThread, short_dir
from tools.certs import make_ca, make_node


class Leading:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def state(self) -> LeaderInfo:
        return LeaderInfo("gpu-01", "10.0.0.1:7443", 12, True, lease=0x694D7A2B1C3E4F10)


def leading_agent(view: StaticNodeView) -> ClusterAgent:
    """The agent of node gpu-01, which leads the cluster, seeing the node as ``view``."""
    return ClusterAgent(
        node="gpu-01",
        election_kind="etcd",
        election=Leading(),
        traffic=FakeTraffic(),
        view=view,
        tag_store=lambda epoch, lease: MemoryTagStore(),
        leveller=LevellerConfig(levels=4),
        reserved_tags=(0, 46, 48, 56),
        peers=None,
        grace_s=30,
        fresh_s=3,
        node_timeout_s=5,
        build="3f2a9c1d04ab",
    )


@pytest.fixture
def served() -> Iterator[tuple[str, ClusterAgent, ServerThread]]:
    view = StaticNodeView(
        gpus={"train-a": ("GPU-1", "GPU-2")},
        unhealthy={"GPU-2": "GPU lost"},
        critical={"GPU-2": (79, 48)},
    )
    agent = leading_agent(view)
    with short_dir() as d:
        path = d / "gpud.sock"
        with ServerThread(ApiServer(path, servicers=[ClusterServicer(agent).register])) as server:
            server.run(agent.tick())
            yield str(path), agent, server


def test_status_table_and_json(
    capsys: pytest.CaptureFixture[str], served: tuple[str, ClusterAgent, ServerThread]
) -> None:
    sock, _, _ = served
    assert main(["cluster", "status", "--socket", sock], env={}) == 0
    out = capsys.readouterr().out
    assert "gpu-01 at 10.0.0.1:7443, epoch 12, lease 694d7a2b1c3e4f10\n" in out
    assert "leader (this node leads: it ranks every node's jobs" in out
    assert "train-a" in out and "LAST REPORT" in out
    assert main(["cluster", "status", "--socket", sock, "--json"], env={}) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["epoch"] == 12 and data["mode"] == "leader"
    assert data["leader_lease"] == "694d7a2b1c3e4f10"  # as etcdctl lease timetolive takes it
    assert [n["node"] for n in data["nodes"]] == ["gpu-01"]
    assert data["jobs"][0]["job"] == "train-a" and data["jobs"][0]["level"] == 0


def test_status_shows_each_node_s_build_and_a_rolling_upgrade_s_progress(
    capsys: pytest.CaptureFixture[str], served: tuple[str, ClusterAgent, ServerThread]
) -> None:
    sock, agent, _ = served
    assert main(["cluster", "status", "--socket", sock], env={}) == 0
    out = capsys.readouterr().out
    assert "BUILD" in out and "3f2a9c1d04ab" in out
    assert "builds:" not in out  # one node, one build
    agent.receive(NodeReport("gpu-02", build="3f2a9c1d04ab"))
    agent.receive(NodeReport("gpu-03", build="9e8d7c6b5a43"))  # upgraded already
    agent.receive(NodeReport("gpu-04"))  # a gpud older than builds
    assert main(["cluster", "status", "--socket", sock], env={}) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[-2:] for line in lines if line.startswith("gpu-0")}
    assert rows["gpu-03"][-1] == "9e8d7c6b5a43"
    assert rows["gpu-04"] == ["older", "gpud"]
    assert (
        "builds: 2 nodes on 3f2a9c1d04ab, 1 on 9e8d7c6b5a43 (gpu-03), 1 on older gpud (gpu-04)"
        in lines
    )
    assert main(["cluster", "status", "--socket", sock, "--json"], env={}) == 0
    nodes = json.loads(capsys.readouterr().out)["nodes"]
    assert {n["node"]: n["build"] for n in nodes} == {
        "gpu-01": "3f2a9c1d04ab",
        "gpu-02": "3f2a9c1d04ab",
        "gpu-03": "9e8d7c6b5a43",
        "gpu-04": None,
    }


def test_builds_line_names_the_nodes_off_the_common_build() -> None:
    assert builds_line([]) is None
    assert builds_line([("a", "x"), ("b", "x")]) is None
    assert builds_line([("a", ""), ("b", "")]) is None  # an older leader: no builds to compare
    many = [(f"n{i}", "new") for i in range(7)] + [(f"o{i}", "old") for i in range(9)]
    assert builds_line(many) == "builds: 9 nodes on old, 7 on new (n0, n1, n2, n3, n4, ...)"


def test_status_says_why_no_order_is_in_force(
    capsys: pytest.CaptureFixture[str], served: tuple[str, ClusterAgent, ServerThread]
) -> None:
    sock, agent, _ = served
    agent.last_error = "leader gpu-02 at 10.0.0.2:7443: PERMISSION_DENIED a peer whose ..."
    assert main(["cluster", "status", "--socket", sock], env={}) == 0
    assert (
        "error:       leader gpu-02 at 10.0.0.2:7443: PERMISSION_DENIED" in capsys.readouterr().out
    )
    assert main(["cluster", "status", "--socket", sock, "--json"], env={}) == 0
    assert json.loads(capsys.readouterr().out)["last_error"].startswith("leader gpu-02")


def test_status_says_etcd_is_out_of_space_and_when_certificates_expire(
    capsys: pytest.CaptureFixture[str],
    served: tuple[str, ClusterAgent, ServerThread],
    tmp_path: Path,
) -> None:
    sock, agent, _ = served
    agent.etcd_alarms = ("NOSPACE",)
    make_ca(tmp_path)
    soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3, hours=1)
    cert, _ = make_node(tmp_path, "client", tmp_path, not_after=soon)
    agent._certs = CertWatch({"cluster.etcd_cert_file": (cert, None)})
    agent._certs.check(time.time())
    # no problem board here (no problems_state, as from an older gpud): under NOSPACE no
    # node can record a problem, exit 11
    assert main(["cluster", "status", "--socket", sock], env={}) == 11
    out = capsys.readouterr().out
    assert "etcd alarm:  NOSPACE: etcd is out of space" in out
    assert "problems:    etcd REFUSES writes (NOSPACE): problems cannot be recorded" in out
    assert "etcdctl alarm disarm" in out
    assert f"in 3 d RENEW SOON  {cert}" in out
    assert main(["cluster", "status", "--socket", sock, "--json"], env={}) == 11
    data = json.loads(capsys.readouterr().out)
    assert data["etcd_alarms"] == ["NOSPACE"]
    (c,) = data["certificates"]
    assert c["key"] == "cluster.etcd_cert_file" and c["path"] == str(cert)
    assert 3 * 86400 < c["expires_in_seconds"] < 3 * 86400 + 3600
    assert c["not_after_unix_seconds"] == int(soon.timestamp())


def test_attributes_from_gpuctl_and_the_client(
    capsys: pytest.CaptureFixture[str], served: tuple[str, ClusterAgent, ServerThread]
) -> None:
    sock, _, _ = served
    assert main(["cluster", "attributes", "--socket", sock, "--job", "train-a"], env={}) == 0
    out = capsys.readouterr().out
    assert "epoch 12" in out and "gpu-01/GPU-2" in out
    assert "CRITICAL XIDS" in out and "gpu-01/GPU-2:79,gpu-01/GPU-2:48" in out
    assert main(["--json", "cluster", "attributes", "--socket", sock], env={}) == 0
    (data,) = json.loads(capsys.readouterr().out)["attributes"]
    assert data["critical_xids"] == ["gpu-01/GPU-2:79", "gpu-01/GPU-2:48"]
    assert data["xids"] == ["gpu-01:79", "gpu-01:48"]  # the codes alone, as older gpuds read
    a = gpud.client.attributes("train-a", socket=sock)
    assert a is not None
    assert a.epoch == 12 and a.unhealthy_gpus == ("gpu-01/GPU-2",) and a.level == 0
    assert a.critical_xids == ("gpu-01/GPU-2:79", "gpu-01/GPU-2:48")
    assert a.nodes == ("gpu-01",)
    assert gpud.client.attributes("unknown", socket=sock) is None
    watch = gpud.client.watch_attributes("train-a", socket=sock)
    first = next(watch)
    assert first == a
    watch.close()


def test_attributes_show_the_xid_an_older_gpud_reports(
    capsys: pytest.CaptureFixture[str], served: tuple[str, ClusterAgent, ServerThread]
) -> None:
    # A node still on a gpud from before critical XIDs sends only xids, its last XID of
    # any kind: the CRITICAL XIDS column said "-" for a job whose GPU there had XID 31.
    sock, agent, server = served
    older = NodeReport("gpu-02", (JobReport("train-a", gpus=("GPU-9",), xids=(31,)),))
    agent.receive(older)
    server.run(agent.tick())
    assert main(["cluster", "attributes", "--socket", sock, "--job", "train-a"], env={}) == 0
    out = capsys.readouterr().out
    assert "gpu-01/GPU-2:79,gpu-01/GPU-2:48,gpu-02:31 (code only, older gpud)" in out


def test_attributes_say_how_many_faults_the_leader_left_out(
    capsys: pytest.CaptureFixture[str], served: tuple[str, ClusterAgent, ServerThread]
) -> None:
    # A job's fault lists cut to the leader's bound read as all there was: an operator
    # could not tell 1024 listed from 1024 of thousands.
    sock, agent, server = served
    noisy = tuple(f"GPU-{i}:79" for i in range(MAX_JOB_FAULTS))
    agent.receive(NodeReport("gpu-02", (JobReport("train-a", critical_xids=noisy),)))
    server.run(agent.tick())
    assert main(["cluster", "attributes", "--socket", sock, "--job", "train-a"], env={}) == 0
    header, row = capsys.readouterr().out.splitlines()[1:3]
    assert row[header.index("FAULTS LEFT OUT") :].split()[0] == "2"
    assert main(["--json", "cluster", "attributes", "--socket", sock], env={}) == 0
    (data,) = json.loads(capsys.readouterr().out)["attributes"]
    assert data["faults_left_out"] == 2 and "gpu-01/GPU-2:79" in data["critical_xids"]
    assert gpud.client.attributes("train-a", socket=sock).faults_left_out == 2  # type: ignore[union-attr]


def test_a_leader_lease_is_said_in_sixteen_hex_digits_as_etcdctl_prints_it(
    served: tuple[str, ClusterAgent, ServerThread],
) -> None:
    """etcdctl prints a lease as ``%016x`` (``lease 000000000000002a granted``), the
    leading zeros kept, and takes it so in ``etcdctl lease timetolive``."""
    _, agent, _ = served
    status = agent.status()
    small = dataclasses.replace(status, info=dataclasses.replace(status.info, lease=0x2A))
    assert status_to_pb(small).leader_lease == "000000000000002a"


def test_attribute_watchers_past_the_bound_are_refused_naming_it_and_one_ended_frees_its_place() -> (
    None
):
    # A client that opens WatchAttributes streams in a loop and never ends one held a
    # coroutine and its request each in gpud, without bound (200 streams: +9 MiB).
    agent = leading_agent(StaticNodeView(gpus={"train-a": ("GPU-1",)}))
    with short_dir() as d:
        path = d / "gpud.sock"
        servicer = ClusterServicer(agent, max_watchers=2)
        with ServerThread(ApiServer(path, servicers=[servicer.register])) as server:
            server.run(agent.tick())
            first = gpud.client.watch_attributes("train-a", socket=path)
            second = gpud.client.watch_attributes("train-a", socket=path)
            next(first), next(second)  # both set up
            with pytest.raises(grpc.RpcError) as err:
                next(gpud.client.watch_attributes("train-a", socket=path))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.details() == (
                "2 WatchAttributes streams on gpud's unix socket already, the most gpud serves"
                " there at once (2): end one (a job's gpud.client.watch_attributes) and retry"
            )
            first.close()  # its place is freed once gpud has seen the stream end
            for _ in range(1000):
                third = gpud.client.watch_attributes("train-a", socket=path)
                try:
                    next(third)
                    break
                except grpc.RpcError as refused:
                    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            else:
                pytest.fail("the ended stream's place was never freed")
            third.close()
            second.close()
