"""What a node says about etcd and its certificates: etcd's alarms (NOSPACE), when the
certificates it uses expire, and withdrawing its problem at a clean stop."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gpud.cluster.agent import ALARM_CHECK_S
from gpud.cluster.certexpiry import CertWatch, not_after
from gpud.cluster.election import LeaderInfo
from gpud.cluster.etcd import EtcdClient
from gpud.cluster.fencing import Mode
from gpud.cluster.metrics import ClusterMetrics
from gpud.cluster.model import Order
from gpud.cluster.ports import MemoryTagStore, StaticAlarms
from gpud.cluster.problems import EtcdProblemBoard
from gpud.errors import StoreFull
from gpud.events import EventLog
from gpud.net.port import FakeTraffic
from tests.unit.cluster_support import Clock, LoopbackPeers, agent, job
from tests.unit.test_cluster_agent import Board
from tests.unit.test_cluster_candidacy import MemoryEtcd
from tools.certs import make_ca, make_node

DAY = 86400.0


def _expiry(path: Path) -> float:
    return x509.load_pem_x509_certificate(path.read_bytes()).not_valid_after_utc.timestamp()


# -- certificates ---------------------------------------------------------------------------


def test_not_after_reads_the_earliest_expiry_of_a_pem_file(tmp_path: Path) -> None:
    ca, _ = make_ca(tmp_path)
    soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3)
    cert, _ = make_node(tmp_path, "n1", tmp_path, not_after=soon.replace(microsecond=0))
    assert not_after(cert.read_bytes()) == _expiry(cert) == int(soon.timestamp())
    assert not_after(ca.read_bytes()) == _expiry(ca)
    bundle = ca.read_bytes() + b"\n" + cert.read_bytes()
    assert not_after(bundle) == _expiry(cert)  # a bundle counts by its earliest
    # GeneralizedTime (a year past 2049) as well as UTCTime
    late = datetime.datetime(2051, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    far, _ = make_node(tmp_path, "n2", tmp_path, not_after=late)
    assert not_after(far.read_bytes()) == late.timestamp()
    for bad in (b"", b"not pem", b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----"):
        with pytest.raises(ValueError):
            not_after(bad)


def test_a_certificate_expiring_within_two_weeks_is_warned_about_once_then_when_expired(
    tmp_path: Path,
) -> None:
    make_ca(tmp_path)
    cert, _ = make_node(tmp_path, "client", tmp_path)
    end = _expiry(cert)
    watch = CertWatch({"cluster.etcd_cert_file": (cert, None)}, recheck_s=3600)
    assert watch.check(end - 20 * DAY) == []
    (expiry,) = watch.expiries(end - 20 * DAY)
    assert expiry.key == "cluster.etcd_cert_file" and expiry.expires_in_s == 20 * DAY
    (warning,) = watch.check(end - 13 * DAY)
    assert "cluster.etcd_cert_file" in warning and "in 13.0 days" in warning
    assert "etcd then refuses" in warning
    assert watch.check(end - 12 * DAY) == []  # once
    (expired,) = watch.check(end + 1)
    assert "expired at" in expired
    assert watch.expiries(end + 1)[0].expires_in_s == -1


def test_etcd_files_are_read_again_but_the_peer_files_only_as_loaded(tmp_path: Path) -> None:
    make_ca(tmp_path)
    old, _ = make_node(tmp_path, "client", tmp_path)
    held = old.read_bytes()
    end = _expiry(old)
    reads: list[Path] = []

    def read(path: Path) -> bytes:
        reads.append(path)
        return path.read_bytes()

    watch = CertWatch(
        {"cluster.cert_file": (old, held), "cluster.etcd_cert_file": (old, None)},
        recheck_s=3600,
        read=read,
    )
    watch.check(end - 20 * DAY)
    assert reads == [old]  # the peer certificate is the one in memory
    later = datetime.datetime.fromtimestamp(end, datetime.UTC) + datetime.timedelta(days=30)
    make_node(tmp_path, "client", tmp_path, not_after=later)  # renewed on disk
    watch.check(end - 20 * DAY + 10)  # not due: nothing read
    assert len(reads) == 1
    watch.check(end - 20 * DAY + 3600)
    by_key = {e.key: e.not_after for e in watch.expiries(end)}
    assert by_key == {"cluster.cert_file": end, "cluster.etcd_cert_file": later.timestamp()}
    old.unlink()
    watch.check(end - 20 * DAY + 7200)
    gone = next(e for e in watch.expiries(end) if e.key == "cluster.etcd_cert_file")
    assert gone.not_after is None and gone.expires_in_s is None and "cannot read" in gone.error


# -- etcd out of space ----------------------------------------------------------------------


def _events(log: EventLog, kind: str) -> list[tuple[str, dict[str, object]]]:
    return [(e.message, dict(e.fields)) for e in log.recent(kind_prefix=kind)]


async def test_etcd_out_of_space_is_said_once_and_cleared_when_disarmed(tmp_path: Path) -> None:
    clock, peers, alarms = Clock(), LoopbackPeers(), StaticAlarms()
    events = EventLog(tmp_path / "events.jsonl")
    info = LeaderInfo("n0", "a0", epoch=3, leading=False)
    node = agent(
        "n1", info, FakeTraffic((job("a", 0.5),)), peers, clock, alarms=alarms, events=events
    )
    peers.forced = Order(epoch=3, seq=1, leader="n0", levels={"a": 1}, tags={"a": 12})
    await node.tick()
    assert node.status().etcd_alarms == () and node.mode is Mode.FOLLOWER
    alarms.raised = ("NOSPACE",)
    clock.now += 5
    await node.tick()  # read every ALARM_CHECK_S only while none is raised
    assert node.status().etcd_alarms == ()
    clock.now += 5
    await node.tick()
    assert node.status().etcd_alarms == ("NOSPACE",)
    ((message, fields),) = _events(events, "cluster.etcd_alarm")
    assert "out of space" in message and "etcdctl alarm disarm" in message
    assert fields == {"alarms": "NOSPACE"}
    await node.tick()
    assert len(_events(events, "cluster.etcd_alarm")) == 1  # once, not every round
    assert node.levels() == {"a": 1}  # the last order stays in force
    alarms.down = True  # etcd unreachable meanwhile: what was read stays
    await node.tick()
    assert node.status().etcd_alarms == ("NOSPACE",)
    alarms.down, alarms.raised = False, ()
    clock.now += 0.5
    await node.tick()  # read every round while raised: the disarm is seen at once
    assert node.status().etcd_alarms == ()
    assert _events(events, "cluster.etcd_alarm")[-1][1] == {"alarms": ""}


class FullStore(MemoryTagStore):
    def save(self, allocated: object, released: object) -> None:
        raise StoreFull("etcd refused /kv/txn: etcd is out of space (alarm NOSPACE) ...")


async def test_a_leader_whose_tags_etcd_refuses_for_space_reads_the_alarm_at_once() -> None:
    clock, peers, alarms = Clock(), LoopbackPeers(), StaticAlarms()
    info = LeaderInfo("n0", "a0", epoch=3, leading=True)
    traffic = FakeTraffic(())
    leader = agent("n0", info, traffic, peers, clock, store=FullStore(), alarms=alarms)
    await leader.tick()  # no job: nothing to save
    alarms.raised = ("NOSPACE",)
    traffic.jobs = (job("a", 0.5),)  # a new job needs a tag
    clock.now += 1
    await leader.tick()
    assert leader.status().etcd_alarms == ("NOSPACE",)
    assert "out of space" in leader.last_error and leader.mode is Mode.LEADER
    assert leader.last_error_kind == "store_full"


def test_alarm_and_certificate_metrics(tmp_path: Path) -> None:
    make_ca(tmp_path)
    cert, _ = make_node(tmp_path, "client", tmp_path)
    end = _expiry(cert)
    clock = Clock()
    info = LeaderInfo("n0", "a0", epoch=3, leading=False)
    certs = CertWatch({"cluster.etcd_cert_file": (cert, None)})
    certs.check(end - DAY)
    node = agent(
        "n1", info, FakeTraffic(()), LoopbackPeers(), clock, wall=lambda: end - DAY, certs=certs
    )
    node.etcd_alarms, node.etcd_alarms_read = ("NOSPACE",), True
    source = ClusterMetrics(node)

    class Source(Collector):
        def collect(self) -> Iterator[Metric]:
            return source()

    registry = CollectorRegistry()
    registry.register(Source())
    value = registry.get_sample_value
    assert value("gpud_cluster_etcd_alarm", {"alarm": "NOSPACE"}) == 1
    assert value("gpud_cluster_etcd_alarm", {"alarm": "CORRUPT"}) == 0
    key = {"key": "cluster.etcd_cert_file"}
    assert value("gpud_cluster_certificate_expiry_seconds", key) == DAY


def _alarm_samples(source: ClusterMetrics) -> dict[str, float]:
    """``gpud_cluster_etcd_alarm`` as exported: {alarm: value}, {} while absent."""
    return {
        s.labels["alarm"]: s.value
        for m in source()
        if m.name == "gpud_cluster_etcd_alarm"
        for s in m.samples
    }


async def test_a_started_gpud_says_nothing_of_etcd_alarms_it_has_not_read() -> None:
    """Until this run of gpud has read etcd's alarms, ``gpud_cluster_etcd_alarm`` is absent,
    not 0: a gpud that restarted while NOSPACE is raised would otherwise say "not raised"
    until its first read, and the cluster's alert resolve and page again."""
    clock, peers, alarms = Clock(), LoopbackPeers(), StaticAlarms(raised=("NOSPACE",))
    info = LeaderInfo("n0", "a0", epoch=3, leading=False)
    node = agent("n1", info, FakeTraffic(()), peers, clock, alarms=alarms)
    source = ClusterMetrics(node)

    assert _alarm_samples(source) == {}
    alarms.down = True  # etcd unreachable: still not known
    await node.tick()
    assert _alarm_samples(source) == {}
    alarms.down = False
    clock.now += ALARM_CHECK_S
    await node.tick()
    assert _alarm_samples(source) == {"NOSPACE": 1.0, "CORRUPT": 0.0}


async def test_a_node_cut_off_from_etcd_exports_no_alarm_reading_it_cannot_renew() -> None:
    """A failed read of etcd's alarms leaves ``gpud_cluster_etcd_alarm`` absent, not at the
    last value read: a node cut off from etcd would otherwise hold the cluster's alarm
    alert firing after etcd disarmed it, and hide its own ClusterStoreDown. Its status
    keeps what it last read (``gpuctl cluster status`` names it)."""
    clock, peers, alarms = Clock(), LoopbackPeers(), StaticAlarms(raised=("NOSPACE",))
    info = LeaderInfo("n0", "a0", epoch=3, leading=False)
    node = agent("n1", info, FakeTraffic(()), peers, clock, alarms=alarms)
    source = ClusterMetrics(node)

    await node.tick()
    assert _alarm_samples(source) == {"NOSPACE": 1.0, "CORRUPT": 0.0}
    alarms.down = True
    clock.now += 1
    await node.tick()
    assert _alarm_samples(source) == {}
    assert node.status().etcd_alarms == ("NOSPACE",)
    alarms.down, alarms.raised = False, ()
    clock.now += 1
    await node.tick()
    assert _alarm_samples(source) == {"NOSPACE": 0.0, "CORRUPT": 0.0}


async def test_a_clean_stop_withdraws_the_nodes_problem() -> None:
    clock, peers, board = Clock(), LoopbackPeers(), Board()
    info = LeaderInfo("n0", "a0", epoch=3, leading=False)
    node = agent("n1", info, FakeTraffic((job("a", 0.5),)), peers, clock, problems=board)
    await node.tick()  # the leader is unreachable: published
    assert set(board.entries) == {"n1"}
    await node.close()
    assert board.entries == {} and board.writes[-1] == ("close", "n1")
    board.down = True
    await node.close()  # etcd gone: logged, the stop goes on


def test_a_publish_after_the_boards_close_puts_nothing_back() -> None:
    # a round left running at the stop publishes after the close withdrew the problem: no
    # new lease, no entry listed for a lease's time after a clean stop
    etcd = MemoryEtcd()
    client: EtcdClient = etcd  # type: ignore[assignment]  # the calls used, in memory
    board = EtcdProblemBoard(client, prefix="/c", wall=lambda: 1.7e9)
    board.publish("n1", "leader n0 unreachable", 1.7e9, "leader_unreachable")
    assert list(etcd.kv) == ["/c/problems/n1"] and len(etcd.leases) == 1
    board.close()
    assert etcd.kv == {} and etcd.leases == set()
    board.publish("n1", "leader n0 unreachable", 1.7e9, "leader_unreachable")
    assert etcd.kv == {} and etcd.leases == set()
