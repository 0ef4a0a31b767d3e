"""Leader election on a real etcd (Debian's etcd-server) on loopback, stepped by hand."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from gpud.cluster.election import EtcdElection
from gpud.cluster.etcd import EtcdClient, EtcdSettings
from tools.etcd_local import LocalEtcd, etcd_binary

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
        f"cluster: etcd unreachable at {etcd.endpoint}: ConnectionFailedError; "
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
    board.publish("n2", "leader n0 at a0: UNAVAILABLE", 1.7e9)
    board.publish("n1", "refused", 1.6e9)
    client.put(f"{prefix}/problems/n9", "not json")  # an unreadable entry is skipped
    assert board.read() == [
        Problem("n1", "refused", 1.6e9),
        Problem("n2", "leader n0 at a0: UNAVAILABLE", 1.7e9),
    ]
    kv = client.get(f"{prefix}/problems/n2")
    assert kv is not None and kv.lease != 0  # it goes with its lease when n2 stops
    board.clear("n2")
    board.clear("n2")  # twice is fine
    assert [p.node for p in board.read()] == ["n1"]
