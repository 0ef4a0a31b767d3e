"""Who may lead: the election with an in-memory etcd and fake clocks, and the trust records
that say whether the other nodes accept this node's certificate."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from gpud.cluster.election import (
    STORE_FULL,
    STORE_OK,
    STORE_REFUSED,
    STORE_UNREACHABLE,
    EtcdElection,
)
from gpud.cluster.etcd import EtcdClient, KeyValue
from gpud.cluster.tls import PeerTls
from gpud.cluster.trust import CHECK_S, STALE_S, EtcdCandidacy, ca_fingerprints
from gpud.errors import GpudError, StoreFull, StoreRefused, Unavailable
from tools.certs import make_ca


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class MemoryEtcd:
    """The calls the election and the trust records make, on a dict; leases never expire
    by themselves."""

    timeout_s = 0.1
    compacted_revision = 0  # no watch was cancelled for a compaction

    def __init__(self) -> None:
        self.kv: dict[str, KeyValue] = {}
        self.leases: set[int] = set()
        self.revision = 10

    def grant(self, ttl_s: int) -> tuple[int, int]:
        lease = len(self.leases) + 100
        self.leases.add(lease)
        return lease, ttl_s

    def keepalive(self, lease: int) -> int:
        return 8 if lease in self.leases else 0

    def revoke(self, lease: int) -> None:
        self.leases.discard(lease)
        self.kv = {k: v for k, v in self.kv.items() if v.lease != lease}

    def get(self, key: str) -> KeyValue | None:
        return self.kv.get(key)

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return {k: v.value for k, v in self.kv.items() if k.startswith(prefix)}

    def put(self, key: str, value: str, lease: int = 0) -> None:
        self.revision += 1
        old = self.kv.get(key)
        created = old.create_revision if old else self.revision
        self.kv[key] = KeyValue(value.encode(), created, self.revision, lease)

    def create(self, key: str, value: str, lease: int) -> int | None:
        if key in self.kv:
            return None
        self.put(key, value, lease)
        return self.revision

    def wait_for_change(self, key: str, after_revision: int, timeout_s: float) -> bool:
        return False


def _candidacy(
    etcd: MemoryEtcd,
    wall: Clock,
    ca: bytes,
    node: str = "n0",
    expiry: Callable[[float], str] = lambda now: "",
) -> EtcdCandidacy:
    client: EtcdClient = etcd  # type: ignore[assignment]  # the calls used, in memory
    return EtcdCandidacy(
        client,
        prefix="/c",
        node=node,
        ca=ca,
        ca_file="/pki/ca.pem",
        cert_file=f"/pki/{node}.pem",
        expiry=expiry,
        wall=wall,
    )


def _election(
    etcd: MemoryEtcd,
    clock: Clock,
    wall: Clock,
    expiry: Callable[[float], str],
    ca: bytes,
    *,
    node: str = "n0",
) -> tuple[EtcdElection, list[tuple[str, str]]]:
    events: list[tuple[str, str]] = []
    client: EtcdClient = etcd  # type: ignore[assignment]  # the calls used, in memory
    candidacy = _candidacy(etcd, wall, ca, node, expiry)
    election = EtcdElection(
        client,
        node=node,
        address=f"{node}:1",
        prefix="/c",
        ttl_s=8,
        notify=lambda kind, message, fields: events.append((kind, message)),
        clock=clock,
        candidacy=candidacy,
    )
    return election, events


def test_a_leader_whose_certificate_expires_steps_down_and_does_not_campaign_again(
    tmp_path: Path,
) -> None:
    ca, _ = make_ca(tmp_path)
    tls = PeerTls(b"", b"", b"", cert_file="/pki/n0.pem", not_after=5000.0)
    etcd, clock, wall = MemoryEtcd(), Clock(0.0), Clock(4000.0)
    election, events = _election(etcd, clock, wall, tls.expiry_problem, ca.read_bytes())
    election.step()
    assert election.state().leading
    # the lease its writes are guarded by is the one the leader key is on
    assert election.state().lease == etcd.kv["/c/leader"].lease != 0
    wall.now = 5000.0  # expired; the next check is due
    clock.now = CHECK_S
    election.step()
    state = election.state()
    assert not state.leading and state.lease == 0
    assert "/c/leader" not in etcd.kv  # resigned: the lease is revoked, not left to expire
    assert [k for k, _ in events] == ["cluster.elected", "cluster.step_down"]
    assert "expired at" in events[-1][1] and "/pki/n0.pem" in events[-1][1]
    clock.now += 1
    election.step()
    election.step()
    assert not election.state().leading and "/c/leader" not in etcd.kv
    assert "expired at" in election.state().detail
    assert len(events) == 2  # said once


def test_a_node_whose_ca_the_recorded_nodes_do_not_trust_does_not_campaign(
    tmp_path: Path,
) -> None:
    ca, _ = make_ca(tmp_path / "mine")
    other, _ = make_ca(tmp_path / "cluster")
    theirs = list(ca_fingerprints(other.read_bytes()))
    etcd, clock, wall = MemoryEtcd(), Clock(0.0), Clock(10**6)
    for node in ("n1", "n2"):
        etcd.put(f"/c/trust/{node}", json.dumps({"ca_sha256": theirs, "at": wall.now - 60}))
    election, events = _election(etcd, clock, wall, lambda now: "", ca.read_bytes())
    election.step()
    assert not election.state().leading and "/c/leader" not in etcd.kv
    assert "n1, n2 trust none of the CAs" in election.state().detail
    assert [k for k, _ in events] == ["cluster.not_candidate"]
    mine = json.loads(etcd.kv["/c/trust/n0"].value)["ca_sha256"]
    assert mine == list(ca_fingerprints(ca.read_bytes()))
    # records of nodes gone for good no longer count: n0 leads
    wall.now += STALE_S
    election.step()
    assert election.state().leading


def test_a_node_trusted_by_as_many_as_refuse_it_may_lead(tmp_path: Path) -> None:
    ca, _ = make_ca(tmp_path / "mine")
    other, _ = make_ca(tmp_path / "other")
    etcd, clock, wall = MemoryEtcd(), Clock(0.0), Clock(10**6)
    for node, pem in (("n1", ca), ("n2", other)):
        value = {"ca_sha256": list(ca_fingerprints(pem.read_bytes())), "at": wall.now}
        etcd.put(f"/c/trust/{node}", json.dumps(value))
    election, events = _election(etcd, clock, wall, lambda now: "", ca.read_bytes())
    election.step()
    assert election.state().leading
    assert [k for k, _ in events] == ["cluster.elected"]


def test_trust_records_lost_from_etcd_are_written_again_by_the_running_nodes(
    tmp_path: Path,
) -> None:
    """A new etcd (its data directory lost) or one restored from a snapshot: the leader and
    its followers write their records again within a check, not an hour later."""
    ca, _ = make_ca(tmp_path / "cluster")
    etcd, clock, wall = MemoryEtcd(), Clock(0.0), Clock(10**6)
    leader, _ = _election(etcd, clock, wall, lambda now: "", ca.read_bytes(), node="n0")
    follower, _ = _election(etcd, clock, wall, lambda now: "", ca.read_bytes(), node="n1")
    leader.step()
    follower.step()
    assert leader.state().leading and not follower.state().leading
    mine = list(ca_fingerprints(ca.read_bytes()))
    etcd.kv = {k: v for k, v in etcd.kv.items() if not k.startswith("/c/trust/")}
    clock.now = wall.now = wall.now + CHECK_S
    leader.step()
    follower.step()
    for node in ("n0", "n1"):
        assert json.loads(etcd.kv[f"/c/trust/{node}"].value)["ca_sha256"] == mine
    assert leader.state().leading
    # records in place are read, not written again: an idle cluster makes no revisions
    written = etcd.revision
    clock.now = wall.now = wall.now + CHECK_S
    leader.step()
    follower.step()
    assert etcd.revision == written


def test_two_gpuds_under_one_node_name_with_other_cas_warn_once_each_until_it_holds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A re-imaged host beside the old one, each with its own CA: each finds the record
    naming other CAs at every check and writes its own back, warning the first time only,
    and again once a check has found it intact in between."""
    ours, _ = make_ca(tmp_path / "ours")
    theirs, _ = make_ca(tmp_path / "theirs")
    etcd, wall = MemoryEtcd(), Clock(10**6)
    old, new = (
        _candidacy(etcd, wall, ours.read_bytes()),
        _candidacy(etcd, wall, theirs.read_bytes()),
    )
    caplog.set_level(logging.DEBUG, logger="gpud.cluster.trust")
    old.record()
    new.record()

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    for _ in range(5):
        wall.now += CHECK_S
        old.record()
        new.record()
    said = warnings()
    assert len(said) == 2, said
    assert all("/c/trust/n0 names other CAs" in m for m in said)
    # the twin goes: the record written back holds at the next check, and a later loss
    # is said again
    for _ in range(2):
        wall.now += CHECK_S
        old.record()
    assert len(warnings()) == 2
    etcd.kv.clear()
    wall.now += CHECK_S
    old.record()
    assert len(warnings()) == 3 and "/c/trust/n0 is gone from etcd" in warnings()[-1]


def test_a_trust_record_restored_with_an_old_time_is_written_again(tmp_path: Path) -> None:
    """A snapshot taken days ago brings back this node's record with its CAs but its old
    ``at``: the leader would drop it as stale before the hourly rewrite."""
    ca, _ = make_ca(tmp_path / "cluster")
    etcd, wall = MemoryEtcd(), Clock(10**6 + 0.123456789)
    candidacy = _candidacy(etcd, wall, ca.read_bytes())
    wall.now -= STALE_S - CHECK_S
    candidacy.record()
    snapshot = dict(etcd.kv)
    wall.now += STALE_S - CHECK_S
    candidacy.record()  # due: an old record is rewritten hourly anyway
    written = etcd.revision
    wall.now += CHECK_S
    candidacy.record()
    assert etcd.revision == written  # its own time reads back equal: nothing to write
    etcd.kv = snapshot
    wall.now += CHECK_S
    candidacy.record()
    assert json.loads(etcd.kv["/c/trust/n0"].value)["at"] == wall.now


class FailingEtcd(MemoryEtcd):
    """Each call raises ``error`` while it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.error: GpudError | None = None

    def get(self, key: str) -> KeyValue | None:
        if self.error is not None and not isinstance(self.error, StoreFull):
            raise self.error
        return super().get(key)

    def create(self, key: str, value: str, lease: int) -> int | None:
        if isinstance(self.error, StoreFull):  # reads go on, writes are refused
            raise self.error
        return super().create(key, value, lease)


def test_the_election_says_whether_etcd_is_unreachable_refuses_or_is_full() -> None:
    etcd = FailingEtcd()
    client: EtcdClient = etcd  # type: ignore[assignment]  # the calls used, in memory
    clock = Clock(0.0)
    election = EtcdElection(client, node="n1", address="a1", prefix="/c", ttl_s=8, clock=clock)
    assert election.state().store_state == STORE_UNREACHABLE  # not started
    etcd.put("/c/leader", json.dumps({"node": "n0", "address": "a0"}))
    election.step()
    assert election.state().store_state == STORE_OK
    # the words are etcd's and gpud's, reworded at will: the state is the error's class
    for error, state in (
        (Unavailable("no answer"), STORE_UNREACHABLE),
        (StoreRefused("no login"), STORE_REFUSED),
    ):
        etcd.error = error
        election.step()
        info = election.state()
        assert (info.store_ok, info.store_state, info.detail) == (False, state, str(error))
    etcd.kv.clear()
    etcd.error = StoreFull("no room")  # reads work: it campaigns, and the write is refused
    election.step()
    info = election.state()
    assert (info.store_ok, info.store_state, info.leading) == (False, STORE_FULL, False)
    assert info.detail == "no room"
    etcd.error = None
    election.step()
    info = election.state()
    assert info.leading and info.store_ok and info.store_state == STORE_OK


def test_a_new_lease_on_the_same_epoch_is_a_leadership_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a fresh etcd numbers revisions from 1 again: the leader key another node puts there
    # may have the create revision of the one before, under the same leader name; only its
    # lease tells the leaderships apart, and a follower says the change once
    etcd = MemoryEtcd()
    client: EtcdClient = etcd  # type: ignore[assignment]  # the calls used, in memory
    election = EtcdElection(client, node="n0", address="n0:1", prefix="/c", ttl_s=8)
    changes: list[int] = []
    election.on_change = lambda: changes.append(election.state().lease)
    holder = json.dumps({"node": "n1", "address": "n1:1"}).encode()
    etcd.kv[election.key] = KeyValue(holder, 5, 5, 0x12C)
    with caplog.at_level(logging.INFO, logger="gpud.cluster.election"):
        election.step()
        etcd.kv[election.key] = KeyValue(holder, 5, 5, 0x190)
        election.step()
        election.step()  # nothing changed since
    assert changes == [0x12C, 0x190]
    state = election.state()
    assert (state.leader, state.epoch, state.lease, state.leading) == ("n1", 5, 0x190, False)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cluster leader")]
    assert said == [
        "cluster leader is n1 (epoch 5, lease 12c)",
        "cluster leader is n1 (epoch 5, lease 190)",
    ]


def test_a_leader_whose_renewals_fail_says_why_while_its_lease_holds() -> None:
    """A leader that cannot reach etcd leads on until its lease could expire; meanwhile
    its state says etcd is unreachable and why (gpuctl cluster status's detail), and the
    error stays named once the renewal is overdue."""
    etcd = FailingEtcd()
    client: EtcdClient = etcd  # type: ignore[assignment]  # the calls used, in memory
    clock = Clock(0.0)
    election = EtcdElection(client, node="n1", address="a1", prefix="/c", ttl_s=8, clock=clock)
    election.step()
    assert election.state().leading
    etcd.error = Unavailable("etcd unreachable at http://e1:2379: ReadTimeout")
    clock.now = 3.0
    election.step()
    info = election.state()
    assert (info.leading, info.store_ok, info.store_state) == (True, False, STORE_UNREACHABLE)
    assert info.detail == "etcd unreachable at http://e1:2379: ReadTimeout"
    clock.now = 7.0  # past the margin before the lease could expire, not yet stepped
    info = election.state()
    assert not info.leading
    assert info.detail == "lease renewal overdue: etcd unreachable at http://e1:2379: ReadTimeout"
    etcd.error = None  # renewed before the thread stepped down: the lease held in etcd
    election.step()
    info = election.state()
    assert (info.leading, info.store_ok, info.detail) == (True, True, "")
