"""A stop while the leader's round waits on etcd: the round ends at its next etcd call,
with the in-memory etcd and the tags in it as the leader keeps them."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gpud.cluster.agent import ALARM_CHECK_S, ClusterAgent
from gpud.cluster.election import LeaderInfo
from gpud.cluster.etcd import EtcdClient
from gpud.cluster.leader import Aggregator
from gpud.cluster.model import JobReport, NodeReport
from gpud.cluster.tagstore import EtcdTagStore
from gpud.net.port import FakeTraffic
from netshaper.leveller import Leveller, LevellerConfig
from tests.unit.cluster_support import Clock, FixedElection, LoopbackPeers, agent, job
from tests.unit.test_cluster_candidacy import MemoryEtcd


class SlowEtcd(MemoryEtcd):
    """``during``: called in each tag read or transaction, as etcd would be slow to answer
    it (the stop arrives meanwhile); ``calls`` the tag reads and transactions made."""

    def __init__(self) -> None:
        super().__init__()
        self.during: Callable[[str], None] = lambda call: None
        self.calls: list[str] = []
        self.deleted = 0  # the deletes asked for, of keys there or not

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        self.calls.append("read")
        self.during("read")
        return super().get_prefix(prefix)

    def alarms(self) -> tuple[str, ...]:
        self.calls.append("alarms")
        self.during("alarms")
        return ()

    def guarded_update(
        self,
        guard_key: str,
        guard_create_revision: int,
        guard_lease: int,
        puts: Mapping[str, str],
        deletes: list[str],
    ) -> bool:
        self.calls.append("txn")
        self.deleted += len(deletes)
        self.during("txn")
        held = self.kv.get(guard_key)
        if held is None or (held.create_revision, held.lease) != (
            guard_create_revision,
            guard_lease,
        ):
            return False
        for key, value in puts.items():
            self.put(key, value)
        for key in deletes:
            self.kv.pop(key, None)
        return True


def _leader(
    etcd: SlowEtcd, traffic: FakeTraffic, *, clock: Clock | None = None, alarms: bool = False
) -> ClusterAgent:
    lease, _ = etcd.grant(10)
    epoch = etcd.create("/c/leader", '{"node": "n0", "address": "n0:1"}', lease)
    assert epoch is not None
    client: EtcdClient = etcd  # type: ignore[assignment]  # the calls used, in memory
    info = LeaderInfo("n0", "n0:1", epoch, True, lease=lease)
    store = EtcdTagStore(client, prefix="/c", epoch=epoch, lease=lease)
    return agent(
        "n0",
        info,
        traffic,
        LoopbackPeers(),
        clock or Clock(),
        store=store,
        alarms=etcd if alarms else None,
    )


def _tags(etcd: SlowEtcd) -> dict[str, bytes]:
    return MemoryEtcd.get_prefix(etcd, "/c/tags/")


async def test_a_stop_while_the_leader_reads_its_tags_saves_and_orders_nothing() -> None:
    etcd, traffic = SlowEtcd(), FakeTraffic((job("a", 0.5), job("b", 0.2)))
    leader = _leader(etcd, traffic)
    etcd.during = lambda call: leader.end_rounds()
    await leader.tick()
    assert etcd.calls == ["read"]  # no transaction after the stop
    etcd.during = lambda call: None
    assert _tags(etcd) == {}
    assert leader.order is None and traffic.order is None


async def test_a_stop_during_the_leaders_save_lets_it_end_whole_and_applies_no_order() -> None:
    etcd, traffic = SlowEtcd(), FakeTraffic(tuple(job(f"j{i}", 0.1 * i) for i in range(8)))
    leader = _leader(etcd, traffic)

    def stop_at_save(call: str) -> None:
        if call == "txn":
            leader.end_rounds()

    etcd.during = stop_at_save
    await leader.tick()
    assert etcd.calls == ["read", "txn"]
    etcd.during = lambda call: None
    # every tag of the round is in etcd: a successor starts from all of them
    assert sorted(_tags(etcd)) == [f"/c/tags/j{i}" for i in range(8)]
    assert len(set(_tags(etcd).values())) == 8
    assert leader.order is None and traffic.order is None


async def test_a_round_cut_by_a_stop_reads_no_alarms_after_it() -> None:
    """The cut round's tick ends there: etcd's alarms, the last etcd call of a tick, are
    not read once the cluster stops."""
    etcd, traffic, now = SlowEtcd(), FakeTraffic((job("a", 0.5),)), Clock()
    leader = _leader(etcd, traffic, clock=now, alarms=True)
    await leader.tick()
    assert etcd.calls == ["read", "txn", "alarms"]  # a round as it runs without a stop
    applied = traffic.order
    etcd.calls.clear()
    now.now += ALARM_CHECK_S  # the alarms are due again, and a new job needs a tag
    traffic.jobs = (job("a", 0.5), job("b", 0.2))

    def stop_at_save(call: str) -> None:
        if call == "txn":
            leader.end_rounds()

    etcd.during = stop_at_save
    await leader.tick()
    assert etcd.calls == ["txn"]
    assert traffic.order == applied  # the cut round applied nothing


def test_jobs_the_pool_had_no_tag_for_age_out_without_a_delete_and_a_save_is_one_txn() -> None:
    """More jobs than DSCP codepoints, then none reported past release_after_s: only the
    tagged jobs' keys are deleted, in one transaction, so a stop's cut right after it
    leaves etcd with all of the round's tags or none of them."""
    etcd = SlowEtcd()
    lease, _ = etcd.grant(10)
    epoch = etcd.create("/c/leader", '{"node": "n0", "address": "n0:1"}', lease)
    assert epoch is not None
    client: EtcdClient = etcd  # type: ignore[assignment]  # the calls used, in memory
    agg = Aggregator(
        leader="n0",
        leveller=Leveller(LevellerConfig(levels=4)),
        tags=EtcdTagStore(client, prefix="/c", epoch=epoch, lease=lease),
        node_timeout_s=5,
    )
    agg.receive(NodeReport("n1", tuple(JobReport(f"j{i:03}", 0.5) for i in range(200))), 0)
    tags = agg.compute(epoch, 0).tags
    assert 0 < len(tags) < 200 and len(agg.untagged) == 200 - len(tags)
    assert etcd.calls == ["read", "txn"]
    etcd.calls.clear()
    agg.compute(epoch, agg.release_after_s + 1)
    assert etcd.calls == ["txn"] and etcd.deleted == len(tags)
    assert _tags(etcd) == {}
    agg.compute(epoch, 2 * agg.release_after_s + 2)  # the untagged ones are forgotten too
    assert etcd.calls == ["txn"]


async def test_a_leader_elected_again_at_its_epoch_on_a_fresh_etcd_saves_under_its_new_lease() -> (
    None
):
    """etcd wiped and its revisions counting from 1 again: the node is elected once more
    and its new leader key happens to carry the old create revision. Its writes are
    guarded by the new lease, not refused for the old one."""
    etcd, traffic = SlowEtcd(), FakeTraffic((job("a", 0.5),))
    client: EtcdClient = etcd  # type: ignore[assignment]  # the calls used, in memory
    first = _elect(etcd, revision=10)
    leader = agent(
        "n0",
        first,
        traffic,
        LoopbackPeers(),
        Clock(),
        tag_store=lambda epoch, lease: EtcdTagStore(client, prefix="/c", epoch=epoch, lease=lease),
    )
    await leader.tick()
    assert sorted(_tags(etcd)) == ["/c/tags/a"]
    etcd.kv.clear()  # a fresh etcd: no keys, and a lease granted there gets another ID
    again = _elect(etcd, revision=10)
    assert (again.epoch, again.lease) == (first.epoch, first.lease + 1)
    leader.election = FixedElection(again)
    traffic.jobs = (job("a", 0.5), job("b", 0.2))
    await leader.tick()
    assert "/c/tags/b" in _tags(etcd)  # the new job's tag, written on the new lease
    assert leader.last_error == ""


def _elect(etcd: SlowEtcd, *, revision: int) -> LeaderInfo:
    """n0 creates the leader key at ``revision`` + 1, on a lease of its own."""
    etcd.revision = revision
    lease, _ = etcd.grant(10)
    epoch = etcd.create("/c/leader", '{"node": "n0", "address": "n0:1"}', lease)
    assert epoch is not None
    return LeaderInfo("n0", "n0:1", epoch, True, lease=lease)
