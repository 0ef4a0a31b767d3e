"""A host suspended and resumed: the leader's lease, the nodes' reports and the orders age
by a clock that counts the suspend, as etcd's and the other nodes' do."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable

import pytest

from gpud import clock
from gpud.cluster.agent import ClusterAgent
from gpud.cluster.election import EtcdElection
from gpud.cluster.etcd import EtcdClient, EtcdSettings, KeyValue
from gpud.cluster.fencing import Mode
from gpud.cluster.model import JobReport, NodeReport, Order
from gpud.cluster.ports import MemoryTagStore, StaticNodeView
from gpud.errors import NotLeader
from gpud.net.port import FakeTraffic
from netshaper.leveller import LevellerConfig
from tests.unit.cluster_support import Clock, LoopbackPeers, job

TTL = 8  # the leader leads until its last renewal was sent + 6 s (TTL less a quarter)


class ExpiringEtcd:
    """The calls the election makes, on a dict; a lease expires ``TTL`` s after its last
    grant or keepalive by ``now`` (etcd's clock, which a suspended node's does not stop)."""

    timeout_s = 0.1
    compacted_revision = 0  # no watch was cancelled for a compaction

    def __init__(self, now: Clock) -> None:
        self.now = now
        self.kv: dict[str, KeyValue] = {}
        self.expires: dict[int, float] = {}
        self.revision = 10

    def _expire(self) -> None:
        gone = {lease for lease, at in self.expires.items() if at <= self.now()}
        self.expires = {lease: at for lease, at in self.expires.items() if lease not in gone}
        self.kv = {k: v for k, v in self.kv.items() if v.lease not in gone}

    def grant(self, ttl_s: int) -> tuple[int, int]:
        lease = 100 + len(self.expires) + self.revision
        self.expires[lease] = self.now() + ttl_s
        return lease, ttl_s

    def keepalive(self, lease: int) -> int:
        self._expire()
        if lease not in self.expires:
            return 0
        self.expires[lease] = self.now() + TTL
        return TTL

    def revoke(self, lease: int) -> None:
        self.expires[lease] = self.now()
        self._expire()

    def get(self, key: str) -> KeyValue | None:
        self._expire()
        return self.kv.get(key)

    def create(self, key: str, value: str, lease: int) -> int | None:
        self._expire()
        if key in self.kv:
            return None
        self.revision += 1
        self.kv[key] = KeyValue(value.encode(), self.revision, self.revision, lease)
        return self.revision

    def wait_for_change(self, key: str, after_revision: int, timeout_s: float) -> bool:
        return False


def _node(
    name: str, etcd: ExpiringEtcd, now: Clock, settle_s: float = 0.0
) -> tuple[EtcdElection, ClusterAgent]:
    client: EtcdClient = etcd  # type: ignore[assignment]  # the calls used, in memory
    election = EtcdElection(
        client, node=name, address=f"{name}:1", prefix="/c", ttl_s=TTL, clock=now
    )
    tags = MemoryTagStore()
    agent = ClusterAgent(
        node=name,
        election_kind="etcd",
        election=election,
        traffic=FakeTraffic((job("a", 0.5),)),
        view=StaticNodeView(),
        tag_store=lambda epoch, lease: tags,
        leveller=LevellerConfig(levels=4),
        reserved_tags=(0,),
        peers=LoopbackPeers(),
        grace_s=30,
        fresh_s=3,
        node_timeout_s=5,
        settle_s=settle_s,
        clock=now,
    )
    return election, agent


async def _leading(now: Clock) -> tuple[ExpiringEtcd, EtcdElection, ClusterAgent]:
    """n0 elected and answering n1's reports with orders."""
    etcd = ExpiringEtcd(now)
    election, leader = _node("n0", etcd, now)
    election.step()
    await leader.tick()
    report = NodeReport("n1")
    leader.receive(report)
    await leader.tick()
    assert isinstance(leader.receive(report), Order)
    return etcd, election, leader


async def test_a_leader_resumed_from_a_suspend_gives_no_order_until_a_renewal_succeeds() -> None:
    now = Clock()
    _, election, leader = await _leading(now)
    report = NodeReport("n1")
    now.now += TTL - 1  # suspended 7 s: past its deadline, within etcd's lease
    assert not election.state().leading
    with pytest.raises(NotLeader):
        leader.receive(report)
    applied = leader.order
    await leader.tick()  # no round of its own either
    assert leader.order is applied and leader.mode is not Mode.LEADER
    election.step()  # the renewal: etcd still held the lease
    assert election.state().leading
    await leader.tick()
    assert leader.receive(report) is None  # a fresh aggregator: folded in next round
    await leader.tick()
    assert leader.mode is Mode.LEADER and isinstance(leader.receive(report), Order)


async def test_a_leader_resumed_within_its_lease_waits_for_the_reports_again() -> None:
    """Suspended past the node timeout but not its lease deadline: it still leads, and
    every other node's report is too old to count. It settles again rather than order
    its own jobs alone: the others keep the last order until they have reported."""
    now = Clock()
    etcd = ExpiringEtcd(now)
    election, leader = _node("n0", etcd, now, settle_s=2.0)
    report = NodeReport("n1", jobs=(JobReport("b", progress_rate=0.2),))
    election.step()
    await leader.tick()  # a new leadership settles
    leader.receive(report)
    now.now += 2.0
    election.step()  # renewed: leads until 108
    await leader.tick()
    first = leader.receive(report)
    assert isinstance(first, Order) and set(first.levels) == {"b"}  # its share
    now.now += 5.5  # suspended: past node_timeout_s (5), within the deadline (6)
    assert election.state().leading
    asked: list[float] = []
    leader.request_round = asked.append
    await leader.tick()
    assert asked == [2.0]  # its next round once settled, not a tick later
    assert leader.receive(report) == first  # n1's jobs stay ordered as they were
    now.now += 2.0
    election.step()
    await leader.tick()  # settled, n1 reported again: both nodes' jobs
    after = leader.receive(report)
    assert isinstance(after, Order) and after.seq > first.seq
    assert set(after.levels) == {"b"}


async def test_a_late_round_while_the_others_kept_reporting_orders_at_once() -> None:
    """A round late by more than the node timeout (a slow daemon pass) while the other
    nodes kept reporting: their reports are fresh, so it does not settle again."""
    now = Clock()
    etcd = ExpiringEtcd(now)
    election, leader = _node("n0", etcd, now, settle_s=2.0)
    report = NodeReport("n1", jobs=(JobReport("b", progress_rate=0.2),))
    election.step()
    await leader.tick()
    leader.receive(report)
    now.now += 2.0
    election.step()
    await leader.tick()
    first = leader.receive(report)
    assert isinstance(first, Order)
    for _ in range(5):  # n1 reports every second; the leader's next round is 5.5 s later
        now.now += 1.0
        election.step()
        leader.receive(report)
    now.now += 0.5
    asked: list[float] = []
    leader.request_round = asked.append
    await leader.tick()
    assert asked == []  # no wait for reports that are 0.5 s old
    after = leader.receive(report)
    assert isinstance(after, Order) and after.seq > first.seq


async def test_a_leader_resumed_after_its_lease_expired_never_leads_beside_its_successor() -> None:
    now = Clock()
    etcd, election, leader = await _leading(now)
    epoch = election.state().epoch
    now.now += 60  # suspended a minute: etcd expired the lease, n2 was elected
    successor, _ = _node("n2", etcd, now)
    successor.step()
    assert successor.state().leading and successor.state().epoch > epoch
    assert not election.state().leading
    with pytest.raises(NotLeader):
        leader.receive(NodeReport("n1"))
    election.step()  # the renewal finds the lease gone: it steps down
    election.step()
    state = election.state()
    assert not state.leading and state.leader == "n2" and state.epoch > epoch


def test_leadership_and_reports_age_by_the_clock_that_counts_a_suspend() -> None:
    for built in (EtcdElection, ClusterAgent):
        default = inspect.signature(built.__init__).parameters["clock"].default
        assert default is clock.elapsed, built
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is None:
        assert clock.elapsed is time.monotonic
        return
    before = time.clock_gettime(boottime)
    read = clock.elapsed()
    assert before <= read <= time.clock_gettime(boottime)
    assert read >= time.monotonic() - 1  # never behind the clock that stops


class SuspendingStop(threading.Event):
    """The election's stop event; its first wait is lengthened by a suspend of
    ``suspend_s``: the clock runs on by that and then by the wait's whole timeout
    (CLOCK_MONOTONIC, which the kernel's timeouts run on, stopped meanwhile)."""

    def __init__(self, now: Clock, suspend_s: float) -> None:
        super().__init__()
        self.now = now
        self.suspend_s = suspend_s
        self.resumed_at: float | None = None

    def wait(self, timeout: float | None = None) -> bool:
        self.now.now += self.suspend_s
        if self.suspend_s:
            self.resumed_at, self.suspend_s = self.now.now, 0.0
        self.now.now += timeout or 0.0
        return self.is_set()


def test_an_elections_pause_that_a_suspend_outlasts_ends_at_the_resume() -> None:
    """A lease of 300 s: a step every 75 s. Suspended 100 s into a pause without a watch
    (it lost a campaign: no leader key seen yet), the node's next step, a campaign should
    the leader have gone meanwhile, comes at the resume rather than 75 s later."""
    now = Clock()
    stop = SuspendingStop(now, suspend_s=100.0)
    client: EtcdClient = ExpiringEtcd(now)  # type: ignore[assignment]  # in memory
    election = EtcdElection(
        client, node="n1", address="n1:1", prefix="/c", ttl_s=300, clock=now, stopped=stop
    )
    election._wait(election.interval_s)
    assert stop.resumed_at is not None
    assert now.now - stop.resumed_at <= clock.WAKE_S


class Timers:
    """The event loop's timers, run by hand on ``now``; ``suspend_s`` lengthens the first
    as :class:`SuspendingStop` does."""

    def __init__(self, now: Clock, suspend_s: float) -> None:
        self.now = now
        self.suspend_s = suspend_s
        self.resumed_at: float | None = None
        self.pending: list[tuple[float, Callable[[], object]]] = []

    def call_later(self, delay: float, callback: Callable[[], object], /) -> object:
        self.pending.append((delay, callback))
        return None

    def run_next(self) -> None:
        delay, callback = self.pending.pop(0)
        self.now.now += self.suspend_s
        if self.suspend_s:
            self.resumed_at, self.suspend_s = self.now.now, 0.0
        self.now.now += delay
        callback()


def test_a_settle_round_due_during_a_suspend_runs_at_the_resume() -> None:
    now = Clock()
    timers = Timers(now, suspend_s=100.0)
    ran: list[float] = []
    clock.call_after(timers, 30.0, lambda: ran.append(now.now), now)
    while not ran:
        timers.run_next()
    assert timers.resumed_at is not None
    assert ran[0] - timers.resumed_at <= clock.WAKE_S
    assert not timers.pending


def test_a_round_requested_without_a_suspend_runs_when_due_and_once() -> None:
    now = Clock()
    timers = Timers(now, suspend_s=0.0)
    ran: list[float] = []
    start = now.now
    clock.call_after(timers, 2.5, lambda: ran.append(now.now), now)
    while not ran:
        timers.run_next()
    assert ran == [start + 2.5] and not timers.pending
    clock.call_after(timers, 0.0, lambda: ran.append(now.now), now)
    assert ran == [start + 2.5, start + 2.5]  # at once, no timer


class SuspendingWatch(ExpiringEtcd):
    """A watch of the leader key that sees no change: its first call lasts a suspend of
    ``suspend_s`` and each one its whole timeout, on ``now``; ``stop`` is set past
    ``max_calls`` calls so that a loop that never sleeps still ends."""

    def __init__(self, now: Clock, stop: threading.Event, suspend_s: float = 0.0) -> None:
        super().__init__(now)
        self.stop = stop
        self.suspend_s = suspend_s
        self.resumed_at: float | None = None
        self.calls = 0
        self.max_calls = 1000
        self.lasts = True  # False: the stream ends at once, no event, no time passed

    def wait_for_change(self, key: str, after_revision: int, timeout_s: float) -> bool:
        self.calls += 1
        if self.calls > self.max_calls:
            self.stop.set()
        if self.suspend_s:
            self.now.now += self.suspend_s
            self.resumed_at, self.suspend_s = self.now.now, 0.0
        if self.lasts:
            self.now.now += timeout_s
        return False


def _watching(etcd: SuspendingWatch, stop: threading.Event, now: Clock) -> EtcdElection:
    """n1 following n0, whose leader key it watches between its steps."""
    lease, _ = etcd.grant(300)
    etcd.create("/c/leader", '{"node": "n0", "address": "n0:1"}', lease)
    client: EtcdClient = etcd  # type: ignore[assignment]  # in memory
    election = EtcdElection(
        client, node="n1", address="n1:1", prefix="/c", ttl_s=300, clock=now, stopped=stop
    )
    election.step()
    assert election.state().leader == "n0"
    return election


def test_a_watch_that_ends_at_once_without_a_change_is_not_called_again_until_the_step() -> None:
    """A proxy that closes the watch stream at once: the rest of the pause sleeps rather
    than call etcd again and again."""
    now = Clock()
    stop = SuspendingStop(now, suspend_s=0.0)
    etcd = SuspendingWatch(now, stop)
    etcd.lasts = False
    election = _watching(etcd, stop, now)
    start = now.now
    election._wait(election.interval_s)
    assert not stop.is_set() and etcd.calls == 1
    assert now.now >= start + election.interval_s  # the pause was slept out


def test_an_elections_watch_that_a_suspend_outlasts_ends_at_the_resume() -> None:
    """A follower watching the leader key (its revision known), suspended 100 s into a
    pause of 75 s: its next step comes within a watch slice of the resume."""
    now = Clock()
    stop = threading.Event()
    etcd = SuspendingWatch(now, stop, suspend_s=100.0)
    election = _watching(etcd, stop, now)
    election._wait(election.interval_s)
    assert not stop.is_set() and etcd.resumed_at is not None
    assert now.now - etcd.resumed_at <= clock.WAKE_S


def test_a_watch_connects_within_its_slice_where_etcds_timeout_is_longer() -> None:
    """The watch's TCP connect is bounded by its slice, not the client's timeout (5 s):
    an etcd unreachable after a resume delays the step by a slice at most."""
    asked: list[object] = []

    class Stream:
        status_code = 200

        def __enter__(self) -> Stream:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def iter_lines(self) -> list[bytes]:
            return []

        def json(self) -> dict[str, str]:  # the version, which picks the API's path
            return {"etcdserver": "3.5.0"}

    class Session:
        def get(self, url: str, **kwargs: object) -> Stream:
            return Stream()

        def post(self, url: str, **kwargs: object) -> Stream:
            asked.append(kwargs["timeout"])
            return Stream()

    client = EtcdClient(EtcdSettings(endpoints=("http://127.0.0.1:2379",), timeout_s=5.0))
    client._clients[0].session = Session()
    assert client.wait_for_change("/c/leader", 10, clock.WAKE_S) is False
    assert asked == [(clock.WAKE_S, clock.WAKE_S)]
