"""[cluster] config checks, report bounds, the node view, certificates and mutual TLS."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from gpud import config
from gpud.api.validate import request_bounds
from gpud.cluster.agent import ClusterAgent
from gpud.cluster.api import PeerClient, PeerServer
from gpud.cluster.convert import (
    MAX_GPUS,
    MAX_JOBS,
    MAX_NAME,
    MAX_XIDS,
    order_from_pb,
    order_to_pb,
    report_from_pb,
    report_to_pb,
)
from gpud.cluster.election import LeaderInfo
from gpud.cluster.fencing import Mode
from gpud.cluster.leader import Aggregator
from gpud.cluster.model import (
    MAX_JOB_FAULTS,
    MAX_ORDER_FAULTS,
    JobReport,
    LeftOutJob,
    NodeReport,
)
from gpud.cluster.nodeview import DaemonNodeView
from gpud.cluster.ports import MemoryTagStore
from gpud.cluster.tls import PeerTls
from gpud.errors import (
    ConfigError,
    DuplicateNode,
    HandshakeFailed,
    InvalidArgument,
    LeaderNotReady,
    NotLeader,
    PermissionDenied,
    Unavailable,
)
from gpud.jobs.registry import MAX_NAME as JOB_NAME_MAX
from gpud.shared import CLUSTER_MAX_JOBS, CLUSTER_MAX_REPORT_GPUS, CLUSTER_MAX_REPORT_XIDS
from gpud.telemetry.reader import placeholder_identity
from gpud.telemetry.snapshot import CriticalXid, GpuSample, SeenIdentity, Snapshot
from gpud.v1 import cluster_pb2 as pb
from netshaper.leveller import Leveller, LevellerConfig
from tests.unit.api_support import identity, mig
from tests.unit.cluster_support import FixedElection
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
        # what the other nodes dial: no wildcard host, no port 0
        ('advertise = "0.0.0.0:7443"', "cluster.advertise"),
        ('advertise = "[::]:7443"', "cluster.advertise"),
        ('advertise = ":7443"', "cluster.advertise"),
        ('advertise = "10.0.0.7:0"', "cluster.advertise"),
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
        (
            JobReport("a", 0.5, 2.0, 12, ("G1",), ("G1",), (79,), False, 10, 2, 3, 1, ("G1:79",)),
            JobReport("b", 0.1, unranked=True),
        ),
        applied_epoch=4,
        instance="5f3a9c0e1b2d4a68",
        build="3f2a9c1d04ab",
    )
    assert report_from_pb(report_to_pb(report)) == report
    # a gpud older than the build field sends none: kept as ""
    assert report_from_pb(pb.ReportRequest(node="n1")).build == ""
    with pytest.raises(InvalidArgument, match="build"):
        report_from_pb(pb.ReportRequest(node="n1", build="x" * 1000))
    many = pb.JobReport(job="a", critical_xids=["G1:79"] * (MAX_XIDS + 1))
    with pytest.raises(InvalidArgument, match=r"jobs\[0\]\.critical_xids"):
        report_from_pb(pb.ReportRequest(node="n", jobs=[many]))
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
    with pytest.raises(InvalidArgument, match=r"jobs\[0\]\.applied_level"):
        report_from_pb(pb.ReportRequest(node="n", jobs=[pb.JobReport(job="a", applied_level=8)]))


@pytest.mark.parametrize(
    ("job", "why"),
    [
        ("a\nb", r"letters, digits"),  # a forged line in every log that names it
        ("a\x1b[31m", r"letters, digits"),  # an escape sequence for gpuctl's terminal
        ("a b", r"letters, digits"),
        ("x" * 64, r"up to 63"),
        ("", r"letters, digits"),
    ],
)
def test_a_reported_job_name_the_registry_would_refuse_is_refused_naming_the_field(
    job: str, why: str
) -> None:
    """A peer's job names reach every node's order and `gpuctl cluster status`: they are
    held to the rule every node's registry holds its own to, as GetOrder's are."""
    fine = pb.JobReport(job="a")
    msg = pb.ReportRequest(node="n1", jobs=[fine, pb.JobReport(job=job)])
    with pytest.raises(InvalidArgument, match=why) as err:
        report_from_pb(msg)
    assert err.value.field == "jobs[1].job"


def test_a_job_name_the_leader_refuses_is_left_out_and_the_rest_of_the_report_read() -> None:
    """A gpud before 2026-12-06 took a job name ending in a line break: its node's report
    reaches an upgraded leader, which reads its other jobs and says which it left out."""
    msg = pb.ReportRequest(
        node="n1",
        jobs=[pb.JobReport(job="a"), pb.JobReport(job="old\n"), pb.JobReport(job="b")],
    )
    left_out: list[LeftOutJob] = []
    report = report_from_pb(msg, left_out=left_out)
    assert [j.job for j in report.jobs] == ["a", "b"]
    ((job, reason),) = left_out
    assert job == "old\n" and reason.startswith("jobs[1].job: 'old\\n': letters, digits")


def test_a_job_reported_twice_in_one_report_is_refused_naming_both_places() -> None:
    """Taken, the job's node would be listed twice in its attributes and its counters
    summed twice, in the order every node of the job gets."""
    twice = pb.ReportRequest(
        node="n1",
        jobs=[
            pb.JobReport(job="a", tx_bytes=10),
            pb.JobReport(job="b"),
            pb.JobReport(job="a", tx_bytes=10),
        ],
    )
    with pytest.raises(InvalidArgument, match=r"'a' is reported twice, at jobs\[0\]") as err:
        report_from_pb(twice)
    assert err.value.field == "jobs[2].job"


def test_a_pinned_level_out_of_range_is_refused_as_an_applied_one_is() -> None:
    """Taken, it would count as a pin: a job its node marks unranked would be ranked."""
    pinned = pb.JobReport(job="a", unranked=True, pinned_level=4_000_000_000)
    with pytest.raises(InvalidArgument, match=r"level must be in \[0, 8\), got 4000000000") as err:
        report_from_pb(pb.ReportRequest(node="n1", jobs=[pinned]))
    assert err.value.field == "jobs[0].pinned_level"
    kept = pb.JobReport(job="a", pinned_level=7)
    assert report_from_pb(pb.ReportRequest(node="n1", jobs=[kept])).jobs[0].pinned_level == 7


@pytest.mark.parametrize(
    ("job", "fields", "field"),
    [
        (pb.JobReport(job="a", gpus=["G1", "G2\nforged"]), {}, "jobs[0].gpus[1]"),
        (pb.JobReport(job="a", unhealthy_gpus=["G 1"]), {}, "jobs[0].unhealthy_gpus[0]"),
        (pb.JobReport(job="a", critical_xids=["G1:79\x1b[2J"]), {}, "jobs[0].critical_xids[0]"),
        (pb.JobReport(job="a"), {"build": "\x1b[2J3f2a"}, "build"),
        (pb.JobReport(job="a"), {"instance": "5f3a\n"}, "instance"),
        (pb.JobReport(job="a"), {"build": "caf\u00e9"}, "build"),
    ],
)
def test_a_reported_uuid_xid_build_or_instance_must_be_printable_ascii(
    job: pb.JobReport, fields: dict[str, str], field: str
) -> None:
    """They are handed on to every node of the job and shown by `gpuctl cluster status`."""
    with pytest.raises(InvalidArgument, match="printable ASCII without spaces") as err:
        report_from_pb(pb.ReportRequest(node="n1", jobs=[job], **fields))
    assert err.value.field == field


def test_a_jobs_counters_summed_past_uint64_reach_its_nodes_saturated() -> None:
    """A job's counters are summed over its nodes: one peer's 2**64 - 1 and another's 5
    made an order no message could hold, and every node of the job got INTERNAL (and the
    leader logged a traceback) for each report, until the peer stopped sending it."""
    leader = Aggregator(
        leader="leader",
        leveller=Leveller(LevellerConfig(levels=4)),
        tags=MemoryTagStore(),
        node_timeout_s=5,
    )
    top = 2**64 - 1
    leader.receive(NodeReport("n1", (JobReport("a", tx_bytes=top, drops=top),)), 0.0)
    leader.receive(NodeReport("n2", (JobReport("a", 0.5, tx_bytes=5, drops=1),)), 0.0)
    leader.compute(1, 0.0)
    answer = leader.answer("n2")
    assert answer is not None
    sent = order_from_pb(pb.Order.FromString(order_to_pb(answer).SerializeToString()))
    assert (sent.attributes["a"].tx_bytes, sent.attributes["a"].drops) == (top, top)
    assert sent.levels == {"a": 0}


def test_a_report_within_the_clusters_bounds_passes_the_apis_generic_ones() -> None:
    """The error interceptor checks every request against the API's generic bounds (256
    entries a repeated field) before the peer servicer runs: a node with more jobs, or a
    job with more critical XIDs, must reach report_from_pb, which holds them to its own."""
    jobs = [
        pb.JobReport(job=f"j{i}", critical_xids=["G1:79"] * (MAX_XIDS if i == 0 else 0))
        for i in range(MAX_JOBS)
    ]
    full = pb.ReportRequest(node="n1", jobs=jobs)
    request_bounds(full)
    assert len(report_from_pb(full).jobs) == MAX_JOBS
    request_bounds(pb.GetOrderRequest(node="n1", jobs=[f"j{i}" for i in range(MAX_JOBS)]))
    jobs.append(pb.JobReport(job="one-more"))
    with pytest.raises(InvalidArgument, match=f"more than {MAX_JOBS}") as err:
        request_bounds(pb.ReportRequest(node="n1", jobs=jobs))
    assert err.value.field == "jobs"
    xids = pb.JobReport(job="a", critical_xids=["G1:79"] * (MAX_XIDS + 1))
    with pytest.raises(InvalidArgument) as err:
        request_bounds(pb.ReportRequest(node="n1", jobs=[xids]))
    assert err.value.field == "jobs[0].critical_xids"


def _fullest_report(node: str, jobs: list[str]) -> pb.ReportRequest:
    """The largest report of ``node`` the request bounds let through, its entries as long
    as report_from_pb takes them, spread over ``jobs`` (each job within its own bounds)."""
    left = dict.fromkeys(("gpus", "unhealthy_gpus", "xids"), CLUSTER_MAX_REPORT_GPUS)
    left["critical_xids"] = CLUSTER_MAX_REPORT_XIDS
    device, pair = "G" * MAX_NAME, "G" * (MAX_NAME - 3) + ":79"
    msg = pb.ReportRequest(node=node)
    for job in jobs:
        j = msg.jobs.add(job=job)
        for name, value, most in (
            ("gpus", device, MAX_GPUS),
            ("unhealthy_gpus", device, MAX_GPUS),
            ("xids", 79, MAX_GPUS),
            ("critical_xids", pair, MAX_XIDS),
        ):
            n = min(most, left[name])
            left[name] -= n
            getattr(j, name).extend([value] * n)
    return msg


@pytest.mark.parametrize("field", ["critical_xids", "gpus", "unhealthy_gpus", "xids"])
def test_a_report_past_its_entries_in_all_is_refused_before_its_conversion(field: str) -> None:
    """Every job within its own bound, 4096 of them made one report of 4 million XIDs
    (16 MiB): seconds of the leader's event loop and hundreds of MiB to convert and fold.
    The request bounds, which run before the peer servicer, refuse it at the job that
    takes its field past the report's bound, naming that field and the bound."""
    jobs = [f"j{i}" for i in range(CLUSTER_MAX_JOBS)]
    full = _fullest_report("n1", jobs)
    request_bounds(full)
    most = CLUSTER_MAX_REPORT_XIDS if field == "critical_xids" else CLUSTER_MAX_REPORT_GPUS
    assert sum(len(getattr(j, field)) for j in full.jobs) == most
    spare = next(i for i, j in enumerate(full.jobs) if not getattr(j, field))
    getattr(full.jobs[spare], field).append(79 if field == "xids" else "G1:79")
    with pytest.raises(InvalidArgument, match=f"{most + 1} entries, more than {most} in all") as e:
        request_bounds(full)
    assert e.value.field == f"jobs[{spare}].{field}"


def test_the_fullest_reports_make_an_order_far_within_the_message_limit() -> None:
    """Two peers send the largest reports that pass, their faults on the jobs of a third
    node: the order that node gets keeps MAX_JOB_FAULTS a job and list, MAX_ORDER_FAULTS
    in all (some 4 MiB of them), and stays within half the peer port's 16 MiB (past it the
    node would get no order at all) with 4096 jobs, each naming its three nodes, whose
    names are as long as report_from_pb takes them."""
    leader = Aggregator(
        leader="leader",
        leveller=Leveller(LevellerConfig(levels=4)),
        tags=MemoryTagStore(),
        node_timeout_s=5,
    )
    jobs = [f"{i:0{JOB_NAME_MAX}d}" for i in range(CLUSTER_MAX_JOBS)]
    for peer in ("a" * (MAX_NAME - 1) + "1", "a" * (MAX_NAME - 1) + "2"):
        sent = _fullest_report(peer, jobs)
        request_bounds(sent)
        leader.receive(report_from_pb(sent), 0.0)
    leader.receive(NodeReport("n3", tuple(JobReport(j, 0.5) for j in jobs)), 0.0)
    leader.compute(1, 0.0)
    assert leader.order is not None
    folded = leader.order.attributes.values()
    assert max(len(a.critical_xids) for a in folded) == MAX_JOB_FAULTS
    answer = leader.answer("n3")
    assert answer is not None and len(answer.attributes) == CLUSTER_MAX_JOBS
    faults = sum(
        len(a.unhealthy_gpus) + len(a.xids) + len(a.critical_xids)
        for a in answer.attributes.values()
    )
    assert faults == MAX_ORDER_FAULTS
    size = order_to_pb(answer).ByteSize()
    assert size < 16 * 1024 * 1024 // 2, size


def test_node_view_gives_each_device_its_gpus_uncleared_critical_xids() -> None:
    """Every uncleared code, as ``gpuctl xid`` lists them, not the latest XID of any kind
    (an application's 13 is no fault of the GPU); a MIG device has its GPU's; a GPU lost
    before gpud started is named as last seen, the UUID its jobs hold."""
    seen = SeenIdentity("GPU-lost", "NVIDIA H100 80GB HBM3", "00000000:1A:00.0")
    snap = Snapshot(
        wall_time=0.0,
        monotonic=0.0,
        tick_seconds=0.0,
        gpus=(
            GpuSample(identity(0), True, "", 0.0, xid_events_total=1, last_xid=13),
            GpuSample(
                identity(1),
                False,
                "critical Xids 79, 48: ...",
                0.0,
                last_xid=13,
                mig_devices=(mig(1, 0),),
                critical_xids=(CriticalXid(79, 1, 1.0, 1.0), CriticalXid(48, 3, 2.0, 9.0)),
            ),
            GpuSample(
                placeholder_identity(2),
                False,
                "GPU lost",
                0.0,
                last_seen=seen,
                critical_xids=(CriticalXid(79, 1, 1.0, 1.0),),
            ),
        ),
    )
    view = DaemonNodeView(list, lambda: snap)
    gpu1, mig10 = identity(1).uuid, mig(1, 0).identity.uuid
    assert view.critical_xids() == {gpu1: (79, 48), mig10: (79, 48), "GPU-lost": (79,)}
    assert view.unhealthy_gpus() == {
        gpu1: "critical Xids 79, 48: ...",
        mig10: "critical Xids 79, 48: ...",
        "GPU-lost": "GPU lost",
    }


def test_node_view_reads_the_state_of_each_enforced_link() -> None:
    state = {"eth0": True, "eth1": False}  # up (or no state reported); down
    view = DaemonNodeView(list, lambda: None, interfaces=("eth0",), link_running=state.get)
    assert view.links_up() is True
    view = DaemonNodeView(list, lambda: None, interfaces=("eth0", "eth1"), link_running=state.get)
    assert view.links_up() is False
    assert DaemonNodeView(list, lambda: None).links_up() is None
    view = DaemonNodeView(list, lambda: None, interfaces=("gone0",), link_running=state.get)
    assert view.links_up() is False


def test_missing_certificate_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("")
    with pytest.raises(ConfigError, match=r"cluster\.cert_file"):
        PeerTls.load(tmp_path / "ca.pem", None, None)
    with pytest.raises(ConfigError, match=r"cluster\.ca_file"):
        PeerTls.load(tmp_path / "missing.pem", tmp_path / "x", tmp_path / "y")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pki = tmp_path_factory.mktemp("pki")
    make_ca(pki)
    for name in ("n1", "n2", "n3"):
        make_node(pki, name, pki)
    now = datetime.datetime.now(datetime.UTC)
    day = datetime.timedelta(days=1)
    make_node(pki, "old", pki, not_before=now - 3 * day, not_after=now - day)
    make_node(pki, "early", pki, not_before=now + day)
    make_node(pki, "soon", pki, not_after=now + 2 * day)
    other = pki / "other"
    make_ca(other, name="another CA")
    make_node(other, "n1", other)
    make_ca(pki / "twin")  # same name as the cluster CA, another key
    make_node(pki / "twin", "n1", pki / "twin")
    (pki / "garbage.pem").write_text("not a certificate\n")
    (pki / "binary.pem").write_bytes(bytes(range(256)))
    return pki


@pytest.mark.parametrize(
    ("ca", "cert", "key", "wrong", "why"),
    [
        ("ca.pem", "garbage.pem", "n1-key.pem", "cert_file", "garbage.pem: no PEM certificate"),
        ("ca.pem", "binary.pem", "n1-key.pem", "cert_file", "binary.pem: no PEM certificate"),
        ("garbage.pem", "n1.pem", "n1-key.pem", "ca_file", "garbage.pem: no PEM certificate"),
        ("n1.pem", "n1.pem", "n1-key.pem", "ca_file", "n1.pem: no CA certificate"),
        ("ca.pem", "n1.pem", "garbage.pem", "key_file", "garbage.pem: no PEM private key"),
        ("ca.pem", "n3.pem", "n2-key.pem", "key_file", "n2-key.pem is not the key of .*n3.pem"),
        ("ca.pem", "old.pem", "old-key.pem", "cert_file", "old.pem: the certificate has expired"),
        ("ca.pem", "early.pem", "early-key.pem", "cert_file", "early.pem: .* is not valid yet"),
        ("ca.pem", "other/n1.pem", "other/n1-key.pem", "cert_file", "not signed by the CA in"),
        ("ca.pem", "twin/n1.pem", "twin/n1-key.pem", "cert_file", "not signed by the CA in"),
    ],
)
def test_bad_certificate_files_are_named_at_load(  # noqa: PLR0917 (parametrized)
    pki: Path, ca: str, cert: str, key: str, wrong: str, why: str
) -> None:
    with pytest.raises(ConfigError, match=why) as err:
        PeerTls.load(pki / ca, pki / cert, pki / key, node=Path(cert).stem)
    assert err.value.key == f"cluster.{wrong}"
    named = {"ca_file": ca, "cert_file": cert, "key_file": key}[wrong]
    assert str(pki / named) in str(err.value)


def test_a_certificate_must_name_its_node(pki: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not name node 'n2'") as err:
        PeerTls.load(pki / "ca.pem", pki / "n1.pem", pki / "n1-key.pem", node="n2")
    assert err.value.key == "cluster.cert_file"
    assert PeerTls.load(pki / "ca.pem", pki / "n1.pem", pki / "n1-key.pem", node="n1")


def test_a_wildcard_certificate_does_not_name_a_node(pki: Path) -> None:
    """TLS matches *.gpu.example to n7.gpu.example, but the leader takes a report only
    from a certificate that names the node itself (so that no node can report as
    another): a node with a wildcard certificate would have every report refused."""
    make_node(pki, "*.gpu.example", pki)
    cert, key = pki / "*.gpu.example.pem", pki / "*.gpu.example-key.pem"
    with pytest.raises(ConfigError, match=r"names '\*\.gpu\.example', not node 'n7") as err:
        PeerTls.load(pki / "ca.pem", cert, key, node="n7.gpu.example")
    assert err.value.key == "cluster.cert_file"


def test_an_encrypted_key_is_named_without_a_prompt(pki: Path, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key((pki / "n1-key.pem").read_bytes(), None)
    encrypted = tmp_path / "enc-key.pem"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(ConfigError, match=r"enc-key\.pem: the key is encrypted") as err:
        PeerTls.load(pki / "ca.pem", pki / "n1.pem", encrypted, node="n1")
    assert err.value.key == "cluster.key_file"


def test_a_certificate_about_to_expire_is_warned_about_and_its_expiry_said_later(
    pki: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="gpud.cluster.tls"):
        soon = PeerTls.load(pki / "ca.pem", pki / "soon.pem", pki / "soon-key.pem", node="soon")
        assert "cluster.cert_file" in caplog.text and "soon.pem expires at" in caplog.text
        caplog.clear()
        fine = PeerTls.load(pki / "ca.pem", pki / "n1.pem", pki / "n1-key.pem", node="n1")
        assert caplog.text == ""
    assert soon.not_after is not None and fine.not_after is not None
    assert soon.expiry_problem(soon.not_after - 1) == ""
    assert "soon.pem expired at" in soon.expiry_problem(soon.not_after + 1)


class Leading:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def state(self) -> LeaderInfo:
        return LeaderInfo("leader", "", 3, True)


class Following(Leading):
    def state(self) -> LeaderInfo:
        return LeaderInfo("N2", "10.0.0.2:7443", 4, False)  # as an older gpud writes it


class Restarted(Leading):
    """The leader key still names this node, held by its previous run."""

    def state(self) -> LeaderInfo:
        return LeaderInfo("leader", "", 3, False)


def _leader(build: str = "") -> ClusterAgent:
    """A leading agent over the peer API, node "leader", job "a" on GPU "G"."""
    from gpud.cluster.ports import MemoryTagStore, StaticNodeView
    from gpud.net.port import FakeTraffic
    from netshaper.leveller import LevellerConfig

    return ClusterAgent(
        node="leader",
        election_kind="etcd",
        election=Leading(),
        traffic=FakeTraffic(),
        view=StaticNodeView(gpus={"a": ("G",)}),
        tag_store=lambda epoch, lease: MemoryTagStore(),
        leveller=LevellerConfig(levels=4),
        reserved_tags=(0,),
        peers=None,
        grace_s=30,
        fresh_s=3,
        node_timeout_s=5,
        build=build,
    )


async def test_mutual_tls_lets_cluster_members_in_and_nobody_else(tmp_path: Path) -> None:
    pki, other = tmp_path / "pki", tmp_path / "other"
    make_ca(pki)
    make_ca(other)
    for name in ("leader", "n1"):
        make_node(pki, name, pki)
    make_node(other, "n1", other)
    agent = _leader()
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
    stranger = PeerClient(  # a node of another cluster
        PeerTls.load(other / "ca.pem", other / "n1.pem", other / "n1-key.pem"), timeout_s=5
    )
    try:
        await agent.tick()
        report = NodeReport("n1", (JobReport("a", 0.5),))
        assert await member.report(address, "leader", report) is None  # not folded in yet
        await agent.tick()
        order = await member.report(address, "leader", report)
        assert order is not None and order.epoch == 3 and set(order.levels) == {"a"}
        with pytest.raises(HandshakeFailed):  # what gpuctl's action names
            await stranger.report(address, "leader", report)
        with pytest.raises(PermissionDenied, match=r"PERMISSION_DENIED.*cannot report as 'n2'"):
            await member.report(address, "leader", NodeReport("n2", (JobReport("a", 0.5),)))
        # DNS names compare without case (RFC 4343), as the start's check of cluster.node
        # against the certificate does: node "N1" with a certificate for n1 reports, and
        # it is node n1 (already folded in: answered at once), not a node of its own
        upper = NodeReport("N1", (JobReport("a", 0.5),))
        answer = await member.report(address, "leader", upper)
        assert answer is not None and set(answer.levels) == {"a"}
        assert [n.node for n in agent.status().nodes] == ["leader", "n1"]
        with pytest.raises(Unavailable):  # the leader's certificate does not name "n9"
            await member.report(address, "n9", report)
        async with grpc.aio.insecure_channel(address) as channel:
            from gpud.v1 import cluster_pb2_grpc

            with pytest.raises(grpc.aio.AioRpcError):
                await cluster_pb2_grpc.ClusterPeerStub(channel).GetOrder(
                    pb.GetOrderRequest(node="x"), timeout=5
                )
        # another gpud under n1 (its own instance) reports, then the first again: refused
        # as a duplicate, and typed so by the class the leader names in the metadata
        await member.report(address, "leader", dataclasses.replace(report, instance="other"))
        with pytest.raises(DuplicateNode, match="'n1' is reported by two gpuds"):
            await member.report(address, "leader", report)
        # stepped down: the refusal names the leader it knows of, in the call's metadata
        agent.election = Following()
        with pytest.raises(NotLeader, match="leader does not lead; the leader is N2") as refused:
            await member.report(address, "leader", report)
        assert (refused.value.leader, refused.value.address) == ("n2", "10.0.0.2:7443")
        assert not isinstance(refused.value, LeaderNotReady)
        agent.election = Restarted()
        with pytest.raises(LeaderNotReady, match="leader does not lead yet"):
            await member.report(address, "leader", report)
    finally:
        await member.close()
        await stranger.close()
        await server.stop(None)
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def _served_leader(tmp_path: Path) -> AsyncIterator[tuple[ClusterAgent, str, PeerClient]]:
    """`_leader()` serving the peer API (one round done), its address, and a client with
    node n1's certificate."""
    make_ca(tmp_path)
    for name in ("leader", "n1"):
        make_node(tmp_path, name, tmp_path)
    leader = _leader()
    server = PeerServer(
        "127.0.0.1:0",
        PeerTls.load(tmp_path / "ca.pem", tmp_path / "leader.pem", tmp_path / "leader-key.pem"),
        leader,
    )
    await server.start()
    client = PeerClient(
        PeerTls.load(tmp_path / "ca.pem", tmp_path / "n1.pem", tmp_path / "n1-key.pem"),
        timeout_s=5,
    )
    try:
        await leader.tick()
        yield leader, f"127.0.0.1:{server.port}", client
    finally:
        await client.close()
        await server.stop(None)


def _follower(node: str, info: LeaderInfo, peers: PeerClient | None, *jobs: str) -> ClusterAgent:
    """An agent following the leader ``info`` names, running ``jobs``."""
    from gpud.cluster.ports import MemoryTagStore, StaticNodeView
    from gpud.net.port import FakeTraffic
    from tests.unit.cluster_support import job

    return ClusterAgent(
        node=node,
        election_kind="etcd",
        election=FixedElection(info),
        traffic=FakeTraffic(tuple(job(name, 0.5) for name in jobs)),
        view=StaticNodeView(),
        tag_store=lambda epoch, lease: MemoryTagStore(),
        leveller=LevellerConfig(levels=4),
        reserved_tags=(0,),
        peers=peers,
        grace_s=30,
        fresh_s=3,
        node_timeout_s=5,
    )


async def test_a_job_name_the_leader_refuses_costs_the_node_that_job_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An older node runs a job whose name the upgraded leader refuses ("old\n"): the
    leader takes the rest of its report, answers with an order for its other jobs, and
    says once which job it left out, as the node does; the node follows, with no error."""
    async with _served_leader(tmp_path) as (leader, address, client):
        follower = _follower("n1", LeaderInfo("leader", address, 3, False), client, "a", "old\n")
        with caplog.at_level(logging.WARNING, logger="gpud.cluster"):
            for _ in range(3):  # the first report is folded in at the leader's next round
                await follower.tick()
                await leader.tick()
        status = follower.status()
        assert (status.last_error, status.last_error_kind) == ("", "")
        assert follower.mode is Mode.FOLLOWER and follower.order is not None
        assert set(follower.order.levels) == {"a"}
        assert [(n.node, n.jobs) for n in leader.status().nodes] == [("leader", 1), ("n1", 1)]
        said = [r.getMessage() for r in caplog.records]
        (by_leader,) = [m for m in said if "out of the report of node n1" in m]
        assert by_leader.startswith("cluster: left 1 job(s) out of the report of node n1")
        assert by_leader.endswith(
            "new since its last report: 'old\\n' (jobs[1].job: 'old\\n': letters, digits,"
            " '_', '.', '-' (up to 63, starting alphanumeric))"
        )
        (by_node,) = [m for m in said if "out of this node's report" in m]
        assert by_node.startswith("cluster: leader leader left 1 job(s) out of this node's")
        assert "new since its last answer: 'old\\n' (jobs[1].job: " in by_node


def _said_left_out(caplog: pytest.LogCaptureFixture) -> tuple[list[str], list[str]]:
    """The lines the leader and the node logged of the jobs the leader left out."""
    said = [r.getMessage() for r in caplog.records]
    return (
        [m for m in said if "out of the report of node n1" in m],
        [m for m in said if "out of this node's report" in m],
    )


async def test_a_refused_job_is_said_once_on_each_side_as_other_jobs_come_and_go(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The reason names the refused job's place in the report (``jobs[1].job``), which
    moves as other jobs start and end: neither side says the job again for that."""
    async with _served_leader(tmp_path) as (_, address, client):
        with caplog.at_level(logging.WARNING, logger="gpud.cluster"):
            for names in (("a", "old\n"), ("a", "b", "old\n"), ("a", "old\n")):
                report = NodeReport("n1", tuple(JobReport(n) for n in names))
                await client.report(address, "leader", report)
        by_leader, by_node = _said_left_out(caplog)
        assert len(by_leader) == 1
        assert len(by_node) == 1


async def test_a_report_of_thousands_of_refused_names_costs_one_short_line_on_each_side(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node (of any version, certified) leaves out as many jobs as a report holds, one
    named with 4096 characters (the most a request's string may have): the leader takes
    the report and each side logs one line per report, naming the first few jobs
    shortened, and counting them."""
    huge = "x" * 4096
    async with _served_leader(tmp_path) as (_, address, client):
        with caplog.at_level(logging.WARNING, logger="gpud.cluster"):
            for batch in range(2):  # fresh names each time
                rest = (JobReport(f"{batch}-{i}\n") for i in range(MAX_JOBS - 1))
                jobs = (JobReport(huge), *rest)
                await client.report(address, "leader", NodeReport("n1", jobs))
        by_leader, by_node = _said_left_out(caplog)
    assert len(by_leader) == 2
    assert len(by_node) == 2
    for line in by_leader + by_node:
        assert len(line) < 1000
        assert f"left {MAX_JOBS} job(s) out of" in line
    for first in (by_leader[0], by_node[0]):  # the leader keeps 256 characters of a name
        assert f"{'x' * 40!r}... (256 characters) (jobs[0].job: {'x' * 63!r}... (4096" in first
        assert first.endswith(f" and {MAX_JOBS - 3} more")
    for second in (by_leader[1], by_node[1]):  # the long name is not new
        assert "'1-0\\n' (jobs[1].job: '1-0\\n': letters" in second
        assert second.endswith(f" and {MAX_JOBS - 1 - 3} more")


async def test_a_report_the_leader_refuses_whole_is_said_refused_not_unreachable(
    tmp_path: Path,
) -> None:
    """The leader answers, refusing the report (here: a node reporting under a name its
    certificate does not carry): the node's error is the leader's words, of its own kind,
    for gpuctl not to send the operator to the network."""
    async with _served_leader(tmp_path) as (_, address, client):
        renamed = _follower("n7", LeaderInfo("leader", address, 3, False), client, "a")
        await renamed.tick()
        status = renamed.status()
        assert status.last_error_kind == "report_refused"
        assert status.last_error.startswith(
            f"leader leader at {address}: PERMISSION_DENIED a peer whose certificate names"
        )
        assert status.last_error.endswith("cannot report as 'n7'")


async def test_a_peer_reporting_as_another_node_is_refused_before_its_report_is_read(
    tmp_path: Path,
) -> None:
    """The certificate's node is checked first: a report under another node's name is
    refused as such however malformed the rest (here a job twice), and nothing of it read."""
    twice = NodeReport("n2", (JobReport("a", 0.5), JobReport("a", 0.5)))
    async with _served_leader(tmp_path) as (_, address, client):
        with pytest.raises(PermissionDenied, match=r"cannot report as 'n2'"):
            await client.report(address, "leader", twice)


async def test_each_node_reports_its_build_and_the_leader_keeps_it(tmp_path: Path) -> None:
    """Over the peer API: the leader keeps the build of each node's latest report (its own
    too) and hands them out with the node list (what `gpuctl cluster status` shows on any
    node); a node of an older gpud, which sends none, has none."""
    make_ca(tmp_path)
    for name in ("leader", "n1", "n2"):
        make_node(tmp_path, name, tmp_path)
    agent = _leader(build="3f2a9c1d04ab")
    assert agent.local_report().build == "3f2a9c1d04ab"
    server = PeerServer(
        "127.0.0.1:0",
        PeerTls.load(tmp_path / "ca.pem", tmp_path / "leader.pem", tmp_path / "leader-key.pem"),
        agent,
    )
    await server.start()
    address = f"127.0.0.1:{server.port}"
    clients = {
        name: PeerClient(
            PeerTls.load(
                tmp_path / "ca.pem", tmp_path / f"{name}.pem", tmp_path / f"{name}-key.pem"
            ),
            timeout_s=5,
        )
        for name in ("n1", "n2")
    }
    try:
        await agent.tick()
        await clients["n1"].report(address, "leader", NodeReport("n1", build="9e8d7c6b5a43"))
        await clients["n2"].report(address, "leader", NodeReport("n2"))  # an older gpud
        seen = await clients["n1"].nodes(address, "leader")
        assert [(n.node, n.build) for n in seen] == [
            ("leader", "3f2a9c1d04ab"),
            ("n1", "9e8d7c6b5a43"),
            ("n2", ""),
        ]
        # the node upgraded and restarted: its next report carries the new build
        await clients["n2"].report(address, "leader", NodeReport("n2", build="3f2a9c1d04ab"))
        assert [n.build for n in agent.status().nodes] == [
            "3f2a9c1d04ab",
            "9e8d7c6b5a43",
            "3f2a9c1d04ab",
        ]
    finally:
        for client in clients.values():
            await client.close()
        await server.stop(None)


async def test_a_refused_peer_call_is_logged_once_and_old_channels_are_closed(
    pki: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent = _follower("n1", LeaderInfo("n2", "127.0.0.1:1", 4, False), None)
    server = PeerServer(
        "127.0.0.1:0", PeerTls.load(pki / "ca.pem", pki / "n1.pem", pki / "n1-key.pem"), agent
    )
    await server.start()
    client = PeerClient(
        PeerTls.load(pki / "ca.pem", pki / "n3.pem", pki / "n3-key.pem"), timeout_s=5
    )
    address = f"127.0.0.1:{server.port}"
    try:
        with caplog.at_level(logging.INFO, logger="gpud.api.interceptors"):
            for _ in range(5):  # a peer retries every tick
                with pytest.raises(NotLeader, match="n1 does not lead; the leader is n2"):
                    await client.report(address, "n1", NodeReport("n3"))
        assert caplog.text.count("n1 does not lead") == 1
        first = client._channels[(address, "n1")]
        with pytest.raises(Unavailable):  # a new leader: a new channel, the old one closed
            await client.report("127.0.0.1:1", "n2", NodeReport("n3"))
        assert list(client._channels) == [("127.0.0.1:1", "n2")]
        assert first.get_state() is grpc.ChannelConnectivity.SHUTDOWN
    finally:
        await client.close()
        await server.stop(None)


async def test_a_call_to_the_old_leader_in_flight_when_a_new_one_is_dialled_fails_as_a_call(
    tmp_path: Path,
) -> None:
    # The old leader hangs (SIGSTOPped: it accepts connections and never answers). A report
    # is waiting on it when `gpuctl cluster status` dials the new leader: the old channel
    # goes, and the waiting report must end as an unreachable leader (GpudError), not as an
    # asyncio cancellation that would end the daemon's loop.
    import socket

    make_ca(tmp_path)
    make_node(tmp_path, "n1", tmp_path)
    client = PeerClient(
        PeerTls.load(tmp_path / "ca.pem", tmp_path / "n1.pem", tmp_path / "n1-key.pem"),
        timeout_s=1.0,
    )
    with (
        socket.create_server(("127.0.0.1", 0)) as hung,
        socket.create_server(("127.0.0.1", 0)) as new,
    ):
        old_address = f"127.0.0.1:{hung.getsockname()[1]}"
        new_address = f"127.0.0.1:{new.getsockname()[1]}"
        try:
            waiting = asyncio.ensure_future(client.report(old_address, "n0", NodeReport("n1")))
            await asyncio.sleep(0.2)
            with pytest.raises(Unavailable):
                await client.nodes(new_address, "n2")
            with pytest.raises(Unavailable, match="leader n0"):
                await waiting
        finally:
            await client.close()


async def test_a_report_names_the_node_as_its_certificate_does_for_an_older_leader(
    tmp_path: Path,
) -> None:
    # A gpud from before node names compared without case leads: it takes a report only
    # when the report's node is one of the certificate's names as spelled there. A node
    # named GPU-C (cluster.node and certificate) reports as "gpu-c" in this version, and
    # that leader refused it ("a peer whose certificate names 127.0.0.1, GPU-C cannot
    # report as 'gpu-c'") until the whole cluster was upgraded.
    from gpud.api.interceptors import ErrorMappingInterceptor
    from gpud.cluster.api import peer_names
    from gpud.errors import PermissionDenied
    from gpud.v1 import cluster_pb2_grpc

    make_ca(tmp_path)
    for name in ("GPU-A", "GPU-C"):
        make_node(tmp_path, name, tmp_path)
    seen: list[str] = []

    class OlderLeader(cluster_pb2_grpc.ClusterPeerServicer):
        async def Report(self, request: pb.ReportRequest, context: object) -> pb.ReportResponse:
            node = request.node
            seen.append(node)
            if node not in peer_names(context):  # as an older leader compares
                raise PermissionDenied(f"cannot report as {node!r}")
            return pb.ReportResponse()

    leader_tls = PeerTls.load(
        tmp_path / "ca.pem", tmp_path / "GPU-A.pem", tmp_path / "GPU-A-key.pem", node="gpu-a"
    )
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()])
    cluster_pb2_grpc.add_ClusterPeerServicer_to_server(OlderLeader(), server)
    port = server.add_secure_port("127.0.0.1:0", leader_tls.server_credentials())
    await server.start()
    tls = PeerTls.load(
        tmp_path / "ca.pem", tmp_path / "GPU-C.pem", tmp_path / "GPU-C-key.pem", node="gpu-c"
    )
    client = PeerClient(tls, timeout_s=5)
    try:
        report = NodeReport("gpu-c", (JobReport("a", 0.5),))
        assert await client.report(f"127.0.0.1:{port}", "gpu-a", report) is None
        assert seen == ["GPU-C"]
    finally:
        await client.close()
        await server.stop(None)


def _refusal(code: grpc.StatusCode, details: str, *meta: tuple[str, str]) -> Exception:
    from gpud.cluster.api import report_error

    err = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*meta), details)
    return report_error(err, "n0", "10.0.0.1:7443")


def test_a_leaders_refusal_is_typed_by_the_class_it_names_or_an_older_leaders_words() -> None:
    precondition = grpc.StatusCode.FAILED_PRECONDITION
    # by the class in the metadata, whatever the words
    duplicate = _refusal(precondition, "two of you", ("gpud-error", "DuplicateNode"))
    assert isinstance(duplicate, DuplicateNode)
    assert str(duplicate) == "leader n0 at 10.0.0.1:7443: FAILED_PRECONDITION two of you"
    assert isinstance(
        _refusal(precondition, "not yet", ("gpud-error", "LeaderNotReady")), LeaderNotReady
    )
    # an older leader names the base class only: its words tell
    older = ("gpud-error", "FailedPrecondition")
    assert isinstance(
        _refusal(precondition, "node 'n1' is reported by two gpuds, this one and", older),
        DuplicateNode,
    )
    assert isinstance(
        _refusal(precondition, "n0 does not lead yet: the leader key", ("gpud-error", "NotLeader")),
        LeaderNotReady,
    )
    hint = _refusal(
        precondition,
        "n0 does not lead; the leader is n2",
        ("gpud-error", "NotLeader"),
        ("gpud-leader", "N2"),
        ("gpud-leader-address", "10.0.0.2:7443"),
    )
    assert isinstance(hint, NotLeader) and not isinstance(hint, LeaderNotReady)
    assert (hint.leader, hint.address) == ("n2", "10.0.0.2:7443")
    # gRPC's own failure (no gpud metadata): a failed TLS handshake, or unreachable
    handshake = _refusal(grpc.StatusCode.UNAVAILABLE, "last error: Tls handshake failed (X)")
    assert isinstance(handshake, HandshakeFailed)
    down = _refusal(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
    assert type(down) is Unavailable
    # the leader answered and refused the report: typed as such, not as unreachable
    from gpud.cluster.agent import REPORT_REFUSED, report_error_kind

    invalid = _refusal(grpc.StatusCode.INVALID_ARGUMENT, "jobs[2].job: 'a' is reported twice")
    denied = _refusal(grpc.StatusCode.PERMISSION_DENIED, "cannot report as 'n2'")
    assert isinstance(invalid, InvalidArgument) and isinstance(denied, PermissionDenied)
    assert report_error_kind(invalid) == report_error_kind(denied) == REPORT_REFUSED
    assert str(invalid) == (
        "leader n0 at 10.0.0.1:7443: INVALID_ARGUMENT jobs[2].job: 'a' is reported twice"
    )
    # a refusal without a leader to name is not one to follow
    assert type(_refusal(precondition, "n0 does not lead", ("gpud-error", "NotLeader"))) is (
        Unavailable
    )


@pytest.mark.parametrize("prefix", [" /gpud", "gpud", ""])
def test_an_etcd_prefix_that_does_not_start_with_a_slash_is_refused(prefix: str) -> None:
    """As gpud always did, naming the file and the key."""
    with pytest.raises(ConfigError) as caught:
        load(f'[cluster]\netcd_prefix = "{prefix}"\n')
    assert str(caught.value).startswith("gpud.toml:cluster.etcd_prefix: ")
    assert "must start with /" in str(caught.value)


@pytest.mark.parametrize(
    ("prefix", "said"),
    [
        ("/", "the whole of etcd's key space"),
        ("//", "the whole of etcd's key space"),
        ("/gpud//cluster", 'an empty, "." or ".." part'),
        ("/a//b/", 'an empty, "." or ".." part'),
        ("/gpud/../x", 'an empty, "." or ".." part'),
        ("/gpud/./x", 'an empty, "." or ".." part'),
        ("/gpud/ cluster", "a space or a control character"),
        ("/gpud\t", "a space or a control character"),
    ],
)
def test_an_odd_etcd_prefix_is_taken_with_a_warning_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], prefix: str, said: str
) -> None:
    """A prefix that mixes gpud's keys with other etcd users' ("/"), or that is not the
    prefix it looks like, is taken as gpud always took it (a node that ran with it must
    start again after an upgrade), but said at start and by ``gpud --check-config``."""
    from gpud.main import main
    from tests.unit.nvml_doubles import answering

    text = f"[cluster]\netcd_prefix = {prefix!r}\n".replace("'", '"')
    assert load(text).cluster.etcd_prefix == prefix
    (warning,) = config.config_warnings(load(text), path="gpud.toml")
    assert warning.startswith(f"gpud.toml:cluster.etcd_prefix: {prefix!r} ")
    assert said in warning
    path = tmp_path / "gpud.toml"
    path.write_text(text)
    assert main(["--check-config", "--config", str(path)], nvml=answering()) == 0
    out, err = capsys.readouterr()
    assert out == "config OK\n"
    assert err == f"gpud: warning: {path}:{warning.removeprefix('gpud.toml:')}\n"


@pytest.mark.parametrize(
    "prefix", ["/gpud/cluster", "/a", "/a/b", "/a/b/", "/gpud/cluster//", "/gpud-1/x.y"]
)
def test_a_path_like_etcd_prefix_is_taken_unsaid(prefix: str) -> None:
    """/a/b forms; trailing slashes name the same keys (its users strip them)."""
    assert load(f'[cluster]\netcd_prefix = "{prefix}"\n').cluster.etcd_prefix == prefix
    assert config.config_warnings(load(f'[cluster]\netcd_prefix = "{prefix}"\n')) == []


async def test_a_refused_report_frees_what_its_servicer_held_without_the_cyclic_gc() -> None:
    # gRPC's per-call state and the AbortError that ends a refused call refer to each other:
    # only the cyclic GC frees them, and a full collection may come thousands of calls
    # later. The refusal, the AbortError's __context__, held the servicer's frame through
    # its traceback, and with it the request: a leader sent 300-job reports grew by some
    # 60 MiB of protobuf arenas (C memory the GC does not count) until it ran.
    import gc
    import weakref

    from gpud.api.interceptors import ErrorMappingInterceptor
    from gpud.errors import InvalidArgument
    from gpud.v1 import cluster_pb2_grpc

    class Held:
        """Stands for what a servicer's frame holds (its request)."""

    held: list[weakref.ref[Held]] = []

    class Refusing(cluster_pb2_grpc.ClusterPeerServicer):
        async def Report(self, request: pb.ReportRequest, context: object) -> pb.ReportResponse:
            payload = Held()
            held.append(weakref.ref(payload))
            raise InvalidArgument("refused", field="jobs")

    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(log_repeats=False)])
    cluster_pb2_grpc.add_ClusterPeerServicer_to_server(Refusing(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    gc.collect()
    gc.disable()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            report = cluster_pb2_grpc.ClusterPeerStub(channel).Report
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await report(pb.ReportRequest(node="n1"))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(held) == 3
        assert [ref() for ref in held] == [None, None, None]
    finally:
        gc.enable()
        await server.stop(None)
