"""Leader election on a real etcd (Debian's etcd-server) on loopback, stepped by hand."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpud.cluster.agent import ClusterAgent
from gpud.cluster.election import EtcdElection, LeaderInfo
from gpud.cluster.etcd import EtcdClient, EtcdSettings
from gpud.cluster.problems import EtcdProblemBoard
from gpud.cluster.tagstore import EtcdTagStore
from gpud.net.port import FakeTraffic, JobTraffic
from tools.etcd_local import LocalEtcd, etcd_binary

if TYPE_CHECKING:
    from tests.unit.cluster_support import FixedElection

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed"),
]


@pytest.fixture
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elections(etcd: LocalEtcd, clock: Clock, n: int = 3, ttl: int = 5) -> list[EtcdElection]:
    """Elections stepped by hand on a fake clock (the lease itself runs on etcd's clock:
    a TTL of 5 s outlasts a slow step on a loaded machine)."""
    prefix = f"/gpud-test-{time.monotonic_ns()}"
    events: list[tuple[str, str]] = []
    return [
        EtcdElection(
            EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,), timeout_s=0.5)),
            node=f"n{i}",
            address=f"127.0.0.1:{9000 + i}",
            prefix=prefix,
            ttl_s=ttl,
            notify=lambda kind, msg, fields, i=i: events.append((f"n{i}", kind)),
            clock=clock,
        )
        for i in range(n)
    ]


def test_three_nodes_elect_one_leader_and_agree_on_it(etcd: LocalEtcd) -> None:
    clock = Clock()
    nodes = elections(etcd, clock)
    for e in nodes:
        e.step()
    for e in nodes:
        e.step()
    states = [e.state() for e in nodes]
    assert [s.leading for s in states] == [True, False, False]
    assert {(s.leader, s.address, s.epoch) for s in states} == {
        ("n0", "127.0.0.1:9000", states[0].epoch)
    }
    assert states[0].epoch > 0


def test_followers_read_the_leaders_name_in_lower_case(etcd: LocalEtcd) -> None:
    """A leader key written with the name as configured (an older gpud) names the node
    every other node knows in lower case: not a node of its own, nor another one."""
    clock = Clock()
    nodes = elections(etcd, clock)
    nodes[0].node = "N0.Example"
    for e in nodes:
        e.step()
    assert [e.state().leader for e in nodes[1:]] == ["n0.example", "n0.example"]


def test_a_dead_leaders_lease_expires_and_a_successor_gets_a_higher_epoch(etcd: LocalEtcd) -> None:
    clock = Clock()
    nodes = elections(etcd, clock, ttl=2)
    for e in nodes:
        e.step()
    first = nodes[0].state().epoch
    # n0 dies: nobody renews its lease; etcd expires it after the TTL (real time). Whichever
    # of n1 and n2 steps first after the expiry wins.
    survivors = nodes[1:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(e.state().leading for e in survivors):
        for e in survivors:
            e.step()
        time.sleep(0.2)
    (successor,) = [e for e in survivors if e.state().leading]
    (other,) = [e for e in survivors if e is not successor]
    assert successor.state().epoch > first
    other.step()
    assert other.state().leader == successor.state().leader != "n0"
    assert not other.state().leading


def test_a_leader_cut_off_from_etcd_steps_down_before_its_lease_expires(
    etcd: LocalEtcd,
) -> None:
    clock = Clock()
    nodes = elections(etcd, clock, n=1)
    leader = nodes[0]
    leader.step()
    assert leader.state().leading
    etcd.stop()
    # the clock moves; renewals fail; leadership ends TTL/4 before the lease could expire
    deadline = leader.ttl_s - leader.margin_s
    clock.now += deadline - 0.5
    leader.step()
    assert leader.state().leading  # still inside the lease
    clock.now += 0.6  # past TTL - margin since the last renewal was sent
    assert not leader.state().leading  # already, before the thread notices
    leader.step()
    info = leader.state()
    assert not info.leading and not info.store_ok
    leader.step()  # as a follower: etcd still stopped, said in the detail
    info = leader.state()
    assert info.detail.startswith("etcd unreachable at") and info.store_state == "unreachable"
    assert info.stepped_down.startswith("cannot reach etcd before the lease could expire")


def test_an_operator_deleting_the_leader_key_has_it_elected_again_on_a_new_lease(
    etcd: LocalEtcd,
) -> None:
    """``etcdctl del <prefix>/leader`` while a node leads: it steps down at its next step
    (the watch ends at the delete), frees its old lease, and the next campaign elects a
    leader on a new lease in a higher epoch."""
    clock = Clock()
    leader, follower = elections(etcd, clock, n=2)
    leader.step()
    follower.step()
    before = leader.state()
    client = EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,), timeout_s=2.0))
    kv = client.get(leader.key)
    assert kv is not None
    client.delete(leader.key)
    assert client.wait_for_change(leader.key, kv.read_revision, 5.0)
    leader.step()
    assert not leader.state().leading
    assert leader.state().stepped_down == "leader key is gone"
    follower.step()
    leader.step()
    after = follower.state()
    assert after.leading and after.epoch > before.epoch and after.lease != before.lease
    assert client.time_to_live(before.lease)[0] == -1  # the old lease was revoked
    assert leader.state().leader == follower.node and leader.state().stepped_down == ""
    follower.stop()


def test_etcd_restart_is_ridden_out(etcd: LocalEtcd) -> None:
    clock = Clock()
    (leader,) = elections(etcd, clock, n=1)
    leader.step()
    epoch = leader.state().epoch
    etcd.stop()
    etcd.start()
    leader.step()
    assert leader.state().leading and leader.state().epoch == epoch


def test_a_follower_logs_an_etcd_outage_once_naming_the_endpoint_and_its_end(
    etcd: LocalEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    leader, follower = elections(etcd, clock, n=2)
    leader.step()
    follower.step()
    etcd.stop()
    with caplog.at_level(logging.INFO, logger="gpud.cluster.election"):
        for _ in range(3):
            follower.step()
        etcd.start()
        follower.step()
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        f"cluster: etcd unreachable at {etcd.endpoint} (Connection refused); "
        "the last order stays in force",
        "cluster: etcd reachable again",
    ]


def test_a_stepped_down_leader_frees_its_old_lease_when_etcd_is_back(etcd: LocalEtcd) -> None:
    clock = Clock()
    a, b = elections(etcd, clock, n=2)
    a.step()
    etcd.pause()
    clock.now += 10
    a.step()  # cannot renew, past the deadline: steps down
    assert not a.state().leading
    etcd.resume()
    a.step()  # revokes its abandoned lease; the key goes with it
    b.step()
    assert b.state().leading or a.state().leading


def test_a_stopping_leader_hands_over_through_the_watch(etcd: LocalEtcd) -> None:
    clock = time.monotonic
    prefix = f"/gpud-test-{time.monotonic_ns()}"
    a, b = (
        EtcdElection(
            EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,), timeout_s=0.5)),
            node=name,
            address=name,
            prefix=prefix,
            ttl_s=30,  # a lease that would take long to expire: only the watch is quick
            clock=clock,
        )
        for name in ("a", "b")
    )
    a.start()
    deadline = time.monotonic() + 10
    while not a.state().leading and time.monotonic() < deadline:
        time.sleep(0.05)
    b.start()
    try:
        while b.state().leader != "a" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.state().leader == "a"
        a.stop()  # revokes its lease: the key goes, b's watch fires
        deadline = time.monotonic() + 10
        while not b.state().leading and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.state().leading and b.state().epoch > 0
    finally:
        a.stop()
        b.stop()


def test_nodes_problems_are_published_read_and_cleared_in_etcd(etcd: LocalEtcd) -> None:
    from gpud.cluster.problems import EtcdProblemBoard, Problem

    client = EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,), timeout_s=2.0))
    prefix = f"/gpud-test-{time.monotonic_ns()}"
    board = EtcdProblemBoard(client, prefix=prefix, ttl_s=5)
    board.publish("n2", "leader n0 at a0: UNAVAILABLE", 1.7e9, "leader_unreachable")
    board.publish("n1", "refused", 1.6e9, "tls_handshake")
    client.put(f"{prefix}/problems/n9", "not json")  # an unreadable entry is skipped
    # an older gpud's entry: no kind, no for_s
    client.put(f"{prefix}/problems/n3", json.dumps({"message": "old", "since": 1.5e9}))
    assert board.read() == [
        Problem("n1", "refused", pytest.approx(1.6e9, abs=2), "tls_handshake"),
        Problem(
            "n2", "leader n0 at a0: UNAVAILABLE", pytest.approx(1.7e9, abs=2), "leader_unreachable"
        ),
        Problem("n3", "old", 1.5e9, None),
    ]
    kv = client.get(f"{prefix}/problems/n2")
    assert kv is not None and kv.lease != 0  # it goes with its lease when n2 stops
    board.clear("n2")
    board.clear("n2")  # twice is fine
    assert [p.node for p in board.read()] == ["n1", "n3"]


def test_a_problems_start_is_read_in_the_readers_clock_whatever_the_publishers(
    etcd: LocalEtcd,
) -> None:
    """A node whose clock is an hour ahead or behind publishes when its problem began by
    that clock; every other node must still see how long ago that was, not an hour more
    or a problem that seems to begin in the future."""
    from gpud.cluster.problems import EtcdProblemBoard

    client = EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,), timeout_s=2.0))
    prefix = f"/gpud-test-{time.monotonic_ns()}"
    for node, skew_s, lasted_s in (("ahead", 3600.0, 20.0), ("behind", -3600.0, 5.0)):

        def skewed(skew_s: float = skew_s) -> float:
            return time.time() + skew_s

        board = EtcdProblemBoard(client, prefix=prefix, ttl_s=30, wall=skewed)
        board.publish(
            node, "leader n0 at a0: UNAVAILABLE", skewed() - lasted_s, "leader_unreachable"
        )
    time.sleep(1.2)  # read a while after the writes, as gpuctl would
    ages = {p.node: time.time() - p.since for p in EtcdProblemBoard(client, prefix=prefix).read()}
    assert ages == {
        "ahead": pytest.approx(21.2, abs=1.1),
        "behind": pytest.approx(6.2, abs=1.1),
    }


def test_a_clean_stop_drops_the_nodes_problem_at_once_on_its_one_lease(etcd: LocalEtcd) -> None:
    from gpud.cluster.problems import EtcdProblemBoard

    client = EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,), timeout_s=2.0))
    prefix = f"/gpud-test-{time.monotonic_ns()}"
    board = EtcdProblemBoard(client, prefix=prefix, ttl_s=30)
    board.publish("n4", "leader n0 at a0: UNAVAILABLE", 1.7e9, "leader_unreachable")
    first = client.get(f"{prefix}/problems/n4")
    board.publish(
        "n4", "leader n0 at a0: UNAVAILABLE", 1.7e9, "leader_unreachable"
    )  # again: its lease renewed
    again = client.get(f"{prefix}/problems/n4")
    assert first is not None and again is not None and again.lease == first.lease
    leases = client._post("/lease/leases", {}).get("leases") or []
    assert [int(lease["ID"]) for lease in leases] == [first.lease]
    board.close()  # a clean stop: gone now, not in 30 s
    assert client.get(f"{prefix}/problems/n4") is None
    assert not client._post("/lease/leases", {}).get("leases")
    board.publish("n4", "again", 1.7e9, "leader_unreachable")
    board.clear("n4")  # a problem gone: the entry and its lease with it
    assert client.get(f"{prefix}/problems/n4") is None
    assert not client._post("/lease/leases", {}).get("leases")


def test_a_guarded_update_holds_only_for_the_leader_keys_epoch_and_lease(etcd: LocalEtcd) -> None:
    """etcd itself judges the txn's compares: the key's create revision alone (all a deposed
    leader on a fresh etcd may share with the new one) does not let a write through."""
    client = EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,)))
    prefix = f"/gpud-test-{time.monotonic_ns()}"
    ours, _ = client.grant(10)
    another, _ = client.grant(10)
    try:
        epoch = client.create(f"{prefix}/leader", "{}", ours)
        assert epoch is not None
        tag = {f"{prefix}/tags/a": "10"}
        assert not client.guarded_update(f"{prefix}/leader", epoch, another, tag, [])
        assert not client.guarded_update(f"{prefix}/leader", epoch + 1, ours, tag, [])
        assert client.get_prefix(f"{prefix}/tags/") == {}
        assert client.guarded_update(f"{prefix}/leader", epoch, ours, tag, [])
        assert client.get_prefix(f"{prefix}/tags/") == {f"{prefix}/tags/a": b"10"}
    finally:
        client.revoke(ours)
        client.revoke(another)


def _fill(client: EtcdClient) -> None:
    from gpud.errors import StoreFull

    for i in range(1000):
        try:
            client.put(f"/filler/{i}", "x" * 100_000)
        except StoreFull:
            return
    raise AssertionError("etcd never ran out of space")


def _free(etcd: LocalEtcd, client: EtcdClient) -> None:
    """What the operator does: delete, compact, defragment, disarm."""
    client._post("/kv/deleterange", {"key": "L2ZpbGxlci8=", "range_end": "L2ZpbGxlcjA="})
    revision = int(client._post("/kv/range", {"key": "AA=="})["header"]["revision"])
    for args in (("compact", str(revision)), ("defrag",), ("alarm", "disarm")):
        subprocess.run(
            ["etcdctl", f"--endpoints={etcd.endpoint}", *args], check=True, capture_output=True
        )


@pytest.mark.skipif(shutil.which("etcdctl") is None, reason="etcdctl is not installed")
def test_out_of_space_keeps_the_leader_says_so_and_recovers_after_the_disarm() -> None:
    from gpud.errors import StoreFull

    with LocalEtcd(("--quota-backend-bytes=1048576",)) as etcd:
        clock = Clock()
        a, b = elections(etcd, clock, n=2)
        client = EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,), timeout_s=2.0))
        a.step()
        assert a.state().leading
        b.step()
        assert b.state().leader == a.node
        _fill(client)
        assert client.alarms() == ("NOSPACE",)
        with pytest.raises(StoreFull, match=r"out of space .*etcdctl alarm disarm"):
            client.put("/x", "y")
        clock.now += 1
        a.step()  # renewals and reads still work: the leader keeps leading
        assert a.state().leading and a.state().store_ok
        a.stop()  # revoking works too: the key goes
        for _ in range(3):
            b.step()  # campaigns, refused for space each time, without raising
        state = b.state()
        assert not state.leading and not state.store_ok and state.store_state == "full"
        # the key is gone with a's lease: a is no longer named, though none can succeed it
        assert (state.leader, state.address) == ("", "")
        assert "out of space" in state.detail
        _free(etcd, client)
        assert client.alarms() == ()
        b.step()
        assert b.state().leading
        b.stop()


@pytest.mark.skipif(shutil.which("etcdctl") is None, reason="etcdctl is not installed")
def test_certificates_of_a_tls_etcd_are_watched_as_the_client_uses_them(tmp_path: Path) -> None:
    import datetime
    import ssl

    from gpud.cluster.certexpiry import CertWatch
    from gpud.cluster.runtime import cert_files
    from gpud.cluster.tls import PeerTls
    from gpud.config import ClusterConfig
    from tools.certs import make_ca, make_node

    pki = tmp_path / "etcd-pki"
    make_ca(pki, "etcd CA")
    server, server_key = make_node(pki, "etcd", pki)
    soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=10)
    client_cert, client_key = make_node(pki, "gpud", pki, not_after=soon)
    peers = tmp_path / "peer-pki"
    make_ca(peers)
    make_node(peers, "n1", peers)
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    context.load_cert_chain(client_cert, client_key)
    flags = (
        f"--cert-file={server}",
        f"--key-file={server_key}",
        f"--trusted-ca-file={pki / 'ca.pem'}",
        "--client-cert-auth",
    )
    with LocalEtcd(flags, client_tls=context) as etcd:
        config = ClusterConfig(
            election="etcd",
            node="n1",
            ca_file=peers / "ca.pem",
            cert_file=peers / "n1.pem",
            key_file=peers / "n1-key.pem",
            etcd_endpoints=etcd.endpoint,
            etcd_ca_file=pki / "ca.pem",
            etcd_cert_file=client_cert,
            etcd_key_file=client_key,
        )
        from gpud.cluster.runtime import etcd_settings

        client = EtcdClient(etcd_settings(config))
        client.put("/tls", "ok")  # the client speaks TLS with its certificate
        tls = PeerTls.load(config.ca_file, config.cert_file, config.key_file, node="n1")
        watch = CertWatch(cert_files(config, tls))
        (warning,) = watch.check(time.time())
        assert warning.startswith(f"cluster.etcd_cert_file {client_cert} expires at")
        left = {e.key: e.expires_in_s for e in watch.expiries(time.time())}
        assert set(left) == {
            "cluster.ca_file",
            "cluster.cert_file",
            "cluster.etcd_ca_file",
            "cluster.etcd_cert_file",
        }
        assert min(left.values(), key=lambda v: v or 0) == left["cluster.etcd_cert_file"]
        assert 9 * 86400 < (left["cluster.etcd_cert_file"] or 0) <= 10 * 86400


@pytest.mark.skipif(shutil.which("etcdctl") is None, reason="etcdctl is not installed")
def test_an_etcd_login_refused_names_the_settings_to_fix(etcd: LocalEtcd, tmp_path: Path) -> None:
    from gpud.cluster.runtime import etcd_settings
    from gpud.config import ClusterConfig
    from gpud.errors import StoreRefused

    def etcdctl(*args: str) -> None:
        subprocess.run(
            ["etcdctl", f"--endpoints={etcd.endpoint}", *args], check=True, capture_output=True
        )

    etcdctl("user", "add", "root:rootpw")
    etcdctl("user", "grant-role", "root", "root")
    etcdctl("user", "add", "gpud:goodpw")
    etcdctl("auth", "enable")
    password = tmp_path / "password"
    password.write_text("wrongpw\n")
    wrong = ClusterConfig(
        etcd_endpoints=etcd.endpoint, etcd_username="gpud", etcd_password_file=password
    )
    with pytest.raises(StoreRefused) as refused:
        EtcdClient(etcd_settings(wrong)).get("/x")
    assert "etcd refused the login of user 'gpud'" in str(refused.value)
    assert f"cluster.etcd_password_file ({password})" in str(refused.value)
    with pytest.raises(StoreRefused) as nobody:
        EtcdClient(etcd_settings(ClusterConfig(etcd_endpoints=etcd.endpoint))).get("/x")
    assert "etcd refused a call without a user: it has authentication on" in str(nobody.value)
    assert "set cluster.etcd_username and cluster.etcd_password_file" in str(nobody.value)
    password.write_text("goodpw\n")  # no role: refused the keys, not the login
    with pytest.raises(StoreRefused, match=r"refused user gpud the keys under cluster.etcd_prefix"):
        EtcdClient(etcd_settings(wrong)).get("/x")
    # the election says so in its state: etcd answers, and refuses
    election = EtcdElection(
        EtcdClient(etcd_settings(wrong)), node="n1", address="a1", prefix="/gpud", ttl_s=4
    )
    election.step()
    info = election.state()
    assert (info.store_ok, info.store_state) == (False, "refused")
    assert "refused user gpud the keys" in info.detail


def test_credentials_serve_while_etcds_authentication_is_turned_on_and_off(
    etcd: LocalEtcd, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As etcdctl does, gpud calls on without a token while etcd has authentication off
    (saying so once), and logs in once it is turned on, within the call that meets it: the
    users can be set up first. After `etcdctl auth disable` it calls without the token
    again, which etcd would refuse (``invalid auth token``)."""
    from gpud.cluster.runtime import etcd_settings
    from gpud.config import ClusterConfig

    def etcdctl(*args: str) -> None:
        subprocess.run(
            ["etcdctl", f"--endpoints={etcd.endpoint}", *args], check=True, capture_output=True
        )

    password = tmp_path / "password"
    password.write_text("goodpw\n")
    client = EtcdClient(
        etcd_settings(
            ClusterConfig(
                etcd_endpoints=etcd.endpoint, etcd_username="gpud", etcd_password_file=password
            )
        )
    )
    with caplog.at_level(logging.WARNING, logger="gpud.cluster.etcd"):
        client.put("/gpud/x", "1")
        assert client.get("/gpud/x") is not None
    assert [r.getMessage() for r in caplog.records] == [
        f"cluster: etcd at {etcd.endpoint} has authentication off: calls go without the "
        "login of cluster.etcd_username 'gpud' until it is on (etcdctl auth enable)"
    ]
    etcdctl("user", "add", "root:rootpw")
    etcdctl("user", "grant-role", "root", "root")
    etcdctl("user", "add", "gpud:goodpw")
    etcdctl("role", "add", "gpud")
    etcdctl("role", "grant-permission", "--prefix=true", "gpud", "readwrite", "/gpud/")
    etcdctl("user", "grant-role", "gpud", "gpud")
    etcdctl("auth", "enable")
    assert client.get("/gpud/x") is not None
    assert client.get("/gpud/x") is not None
    etcdctl("--user", "root:rootpw", "auth", "disable")
    for _ in range(3):
        assert client.get("/gpud/x") is not None
    client.put("/gpud/x", "2")


async def _round(*agents: ClusterAgent) -> None:
    for a in agents:
        await a.tick()


class Twins:
    """Two gpuds configured with one cluster.node, n1, each with its problem board on the
    real etcd, and the leader n0: ``refused`` reports first, so the leader takes ``taken``
    (the newer) and refuses ``refused``. ``peers`` / ``twins_peers``: their ways to the
    leader."""

    def __init__(self, etcd: LocalEtcd) -> None:
        from tests.unit.cluster_support import Clock as AgentClock
        from tests.unit.cluster_support import LoopbackPeers, agent, job

        self._endpoint, self._prefix = etcd.endpoint, f"/gpud-test-{time.monotonic_ns()}"
        clock, self.peers, self.twins_peers = AgentClock(), LoopbackPeers(), LoopbackPeers()
        info = LeaderInfo("n0", "a0", 7, False)
        lead = LeaderInfo("n0", "a0", 7, True)
        self.leader = agent("n0", lead, FakeTraffic(), self.peers, clock)
        self.peers.leader = self.twins_peers.leader = self.leader
        self.refused = agent(
            "n1", info, FakeTraffic((job("a", 0.5),)), self.peers, clock, problems=self.board()
        )
        self.taken = agent(
            "n1",
            info,
            FakeTraffic((job("z", 0.5),)),
            self.twins_peers,
            clock,
            problems=self.board(),
        )
        self.reader = self.board()

    def board(self) -> EtcdProblemBoard:
        client = EtcdClient(EtcdSettings(endpoints=(self._endpoint,), timeout_s=2.0))
        return EtcdProblemBoard(client, prefix=self._prefix, ttl_s=30)


def test_a_gpud_refused_under_a_nodes_name_publishes_its_problem_apart_from_the_nodes(
    etcd: LocalEtcd,
) -> None:
    """Two gpuds configured with one cluster.node: the one the leader refuses publishes
    why under its own instance, named with its host and pid and saying that it holds; the
    one the leader takes keeps the node's own entry, and its problems, published and
    cleared, neither overwrite nor remove the refused one's."""
    twins = Twins(etcd)
    leader, refused, taken, reader = twins.leader, twins.refused, twins.taken, twins.reader
    twins_peers = twins.twins_peers

    async def scenario() -> None:
        for _ in range(3):
            await _round(leader, refused, taken)
        assert refused.last_error_kind == "duplicate_node" and taken.last_error == ""
        (problem,) = reader.read()
        assert (problem.node, problem.instance, problem.kind) == (
            "n1",
            refused.instance,
            "duplicate_node",
        )
        assert problem.gpud == refused.gpud and problem.gpud.endswith(f"pid {os.getpid()}")
        assert problem.mode == refused.mode.value and problem.mode in ("holding", "local")
        # the gpud the leader takes cannot reach it a while: its own entry, beside the other
        twins_peers.leader = None
        await _round(leader, refused, taken)
        by_instance = {p.instance: p for p in reader.read()}
        assert set(by_instance) == {"", refused.instance}
        assert by_instance[""].kind == "leader_unreachable"
        assert by_instance[refused.instance].kind == "duplicate_node"
        # it reaches the leader again: its entry goes, the refused one's stays
        twins_peers.leader = leader
        await _round(leader, refused, taken)
        assert [(p.node, p.instance) for p in reader.read()] == [("n1", refused.instance)]
        await refused.close()  # a clean stop withdraws it
        assert reader.read() == []

    asyncio.run(scenario())


def test_a_refused_gpud_that_loses_the_leader_and_finds_it_again_leaves_its_twins_entry(
    etcd: LocalEtcd,
) -> None:
    """While the leader is unreachable both gpuds under n1 publish under the node's own
    key, the later write standing; when the refused one reaches the leader again it moves
    back under its instance and takes away only what its own lease still holds: the entry
    the other gpud wrote since (it still cannot reach the leader) stays, one per gpud."""
    twins = Twins(etcd)
    leader, refused, taken, reader = twins.leader, twins.refused, twins.taken, twins.reader
    peers, twins_peers = twins.peers, twins.twins_peers
    refused.gpud, taken.gpud = "host-r pid 10", "host-t pid 20"

    def entries() -> list[tuple[str, str, str | None, str]]:
        return sorted((p.node, p.instance, p.kind, p.gpud) for p in reader.read())

    async def scenario() -> None:
        for _ in range(3):
            await _round(leader, refused, taken)
        assert entries() == [("n1", refused.instance, "duplicate_node", "host-r pid 10")]
        # the leader fails: both publish under n1, the one that wrote last standing
        peers.leader = twins_peers.leader = None
        await _round(leader, refused, taken)
        assert entries() == [("n1", "", "leader_unreachable", "host-t pid 20")]
        # it returns for the refused gpud first: refused again, back under its instance
        peers.leader = leader
        await _round(leader, refused, taken)
        assert refused.last_error_kind == "duplicate_node"
        assert entries() == [
            ("n1", "", "leader_unreachable", "host-t pid 20"),
            ("n1", refused.instance, "duplicate_node", "host-r pid 10"),
        ]
        # and for the other: its entry goes, the refused one's stays
        twins_peers.leader = leader
        await _round(leader, refused, taken)
        assert entries() == [("n1", refused.instance, "duplicate_node", "host-r pid 10")]
        await refused.close()
        await taken.close()
        assert entries() == []

    asyncio.run(scenario())


def test_an_endpoint_that_is_not_etcds_client_port_is_said_as_such_and_passed_over(
    etcd: LocalEtcd,
) -> None:
    """etcd's peer port (2380 by default), or another HTTP service, answers every call with
    a 404 of its own: that is no refusal of etcd's (whose action would be its user and
    role) but a wrong cluster.etcd_endpoints, and the next endpoint is tried."""
    import http.server
    import threading

    from gpud.errors import Unavailable

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        peer = f"http://127.0.0.1:{etcd.peer_port}"
        service = f"http://127.0.0.1:{other.server_address[1]}"
        for endpoint in (peer, service):
            with pytest.raises(Unavailable) as wrong:
                EtcdClient(EtcdSettings(endpoints=(endpoint,), timeout_s=2.0)).get("/x")
            assert str(wrong.value).startswith(f"etcd unreachable: {endpoint} answered ")
            assert "not as etcd's client API" in str(wrong.value)
            assert "check cluster.etcd_endpoints" in str(wrong.value)
        election = EtcdElection(
            EtcdClient(EtcdSettings(endpoints=(peer,), timeout_s=2.0)),
            node="n1",
            address="a1",
            prefix="/gpud",
            ttl_s=4,
        )
        election.step()
        info = election.state()
        assert (info.store_ok, info.store_state) == (False, "unreachable")
        assert "2380 is the peer port" in info.detail
        both = EtcdClient(EtcdSettings(endpoints=(peer, etcd.endpoint), timeout_s=2.0))
        both.put("/x", "1")
        kv = both.get("/x")
        assert kv is not None and kv.value == b"1"
    finally:
        other.shutdown()
        other.server_close()


def test_followers_read_the_leader_keys_lease_as_the_leader_holds_it(etcd: LocalEtcd) -> None:
    """Every node's LeaderInfo names the lease the leader key is on (the one the leader's
    orders are signed with), a follower's as it read the key; none once the key is gone."""
    clock = Clock()
    nodes = elections(etcd, clock)
    for e in nodes:
        e.step()
    held = nodes[0].state()
    assert held.leading and held.lease != 0
    assert [e.state().lease for e in nodes[1:]] == [held.lease, held.lease]
    nodes[0].stop()  # revokes the lease: the key goes with it
    nodes[1].step()
    assert nodes[1].state().leading and nodes[1].state().lease not in (0, held.lease)
    nodes[2].step()
    assert nodes[2].state().lease == nodes[1].state().lease


@dataclasses.dataclass
class LedTags:
    """n0 leads on a real etcd with job a running on n1 and job b, idle there now, whose
    tag it holds still (``lead``)."""

    etcd: LocalEtcd
    client: EtcdClient
    election: EtcdElection
    leader: ClusterAgent
    follower: ClusterAgent
    follows: FixedElection
    traffic: FakeTraffic
    running: JobTraffic
    tags: str

    @classmethod
    def start(cls, etcd: LocalEtcd) -> LedTags:
        from tests.unit.cluster_support import Clock as AgentClock
        from tests.unit.cluster_support import FixedElection, LoopbackPeers, agent, job

        prefix = f"/gpud-test-{time.monotonic_ns()}"
        client = EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,), timeout_s=2.0))
        election = EtcdElection(
            client, node="n0", address="a0", prefix=prefix, ttl_s=5, clock=Clock()
        )
        election.step()
        first = election.state()
        assert first.leading
        clock, peers = AgentClock(), LoopbackPeers()
        leader = agent(
            "n0",
            first,
            FakeTraffic(),
            peers,
            clock,
            tag_store=lambda epoch, lease: EtcdTagStore(
                client, prefix=prefix, epoch=epoch, lease=lease
            ),
        )
        leader.election = election
        peers.leader = leader
        running = dataclasses.replace(job("a", 0.5), dscp=12)
        idle = dataclasses.replace(job("b", 0.5), dscp=14)
        traffic = FakeTraffic((running, idle))
        follows = FixedElection(LeaderInfo("n0", "a0", first.epoch, False, lease=first.lease))
        follower = agent("n1", follows.info, traffic, peers, clock)
        follower.election = follows
        tags = f"{prefix}/tags/"
        return cls(etcd, client, election, leader, follower, follows, traffic, running, tags)

    def stored(self) -> dict[str, bytes]:
        return self.client.get_prefix(self.tags)

    async def lead(self) -> None:
        for _ in range(3):
            await _round(self.follower, self.leader)
        assert self.stored() == {f"{self.tags}a": b"12", f"{self.tags}b": b"14"}
        self.traffic.jobs = (self.running,)  # b idles on n1: its tag held meanwhile
        await _round(self.follower, self.leader)

    async def elected_again(self) -> LeaderInfo:
        """n0 steps down (its lease is gone) and is elected again; three rounds."""
        self.election.step()
        assert not self.election.state().leading
        self.election.step()
        again = self.election.state()
        assert again.leading
        self.follows.info = LeaderInfo("n0", "a0", again.epoch, False, lease=again.lease)
        for _ in range(3):
            await _round(self.leader, self.follower)
        return again


def test_a_leader_reelected_on_a_wiped_etcd_writes_its_tags_back(etcd: LocalEtcd) -> None:
    """etcd wiped (its data dir gone, as after a restore of an empty snapshot): the leader
    loses its key and lease, is elected again on revisions that start over, and writes
    back the tags it held, that of a job idle on its node this round too."""
    led = LedTags.start(etcd)

    async def scenario() -> None:
        await led.lead()
        first = led.election.state()
        etcd.stop()
        shutil.rmtree(etcd.data_dir / "data")
        etcd.start()
        again = await led.elected_again()  # on revisions that started over
        assert again.epoch <= first.epoch and again.lease != first.lease
        assert led.stored() == {f"{led.tags}a": b"12", f"{led.tags}b": b"14"}

    asyncio.run(scenario())


def test_a_leader_reelected_in_a_higher_epoch_after_a_restore_writes_its_tags_back(
    etcd: LocalEtcd,
) -> None:
    """etcd restored from a snapshot taken after the election (the leader key there, b's
    tag not), then the leader's lease lost: elected again on a new key, a higher epoch, with
    no other leader between, it writes b's tag back."""
    led = LedTags.start(etcd)

    async def scenario() -> None:
        await led.lead()
        first = led.election.state()
        led.client.delete(f"{led.tags}b")  # what the snapshot lacks
        led.client.revoke(first.lease)  # the leader key goes with its lease
        again = await led.elected_again()
        assert again.epoch > first.epoch
        assert led.stored() == {f"{led.tags}a": b"12", f"{led.tags}b": b"14"}

    asyncio.run(scenario())


def test_a_leader_key_read_after_a_compaction_is_watched_from_a_revision_etcd_keeps(
    etcd: LocalEtcd,
) -> None:
    """The leader key is written once; other writes and a compaction past it leave its own
    revision compacted: a watch from there is cancelled at once. Each read says the
    revision etcd answered at, from which a watch waits for a change."""
    clock = Clock()
    leader, follower = elections(etcd, clock, n=2)
    leader.step()
    client = EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,), timeout_s=2.0))
    for i in range(5):
        client.put(f"{leader.key}-elsewhere", str(i))
    revision = int(client._post("/kv/range", {"key": "AA=="})["header"]["revision"])
    client._post("/kv/compaction", {"revision": revision})
    kv = client.get(leader.key)
    assert kv is not None and kv.mod_revision < revision <= kv.read_revision
    assert client.wait_for_change(leader.key, kv.mod_revision, 5.0)  # cancelled: compacted
    assert not client.wait_for_change(leader.key, kv.read_revision, 0.3)
    follower.step()
    assert follower.state().leader == leader.node
    assert not client.wait_for_change(leader.key, follower._watch_revision, 0.3)
    leader.stop()
