"""A stop while the leader's round waits on etcd: the round ends at its next etcd call,
with the in-memory etcd and the tags in it as the leader keeps them."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gpud.cluster.agent import ClusterAgent
from gpud.cluster.election import LeaderInfo
from gpud.cluster.etcd import EtcdClient
from gpud.cluster.tagstore import EtcdTagStore
from gpud.net.port import FakeTraffic
from tests.unit.test_cluster_agent import Clock, LoopbackPeers, agent, job
from tests.unit.test_cluster_candidacy import MemoryEtcd


class SlowEtcd(MemoryEtcd):
    """``during``: called in each tag read or transaction, as etcd would be slow to answer
    it (the stop arrives meanwhile); ``calls`` the tag reads and transactions made."""

    def __init__(self) -> None:
        super().__init__()
        self.during: Callable[[str], None] = lambda call: None
        self.calls: list[str] = []

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        self.calls.append("read")
        self.during("read")
        return super().get_prefix(prefix)

    def guarded_update(
        self,
        guard_key: str,
        guard_create_revision: int,
        puts: Mapping[str, str],
        deletes: list[str],
    ) -> bool:
        self.calls.append("txn")
        self.during("txn")
        held = self.kv.get(guard_key)
        if held is None or held.create_revision != guard_create_revision:
            return False
        for key, value in puts.items():
            self.put(key, value)
        for key in deletes:
            self.kv.pop(key, None)
        return True


def _leader(etcd: SlowEtcd, traffic: FakeTraffic) -> ClusterAgent:
    etcd.put("/c/leader", '{"node": "n0", "address": "n0:1"}')
    epoch = etcd.kv["/c/leader"].create_revision
    client: EtcdClient = etcd  # type: ignore[assignment]  # the calls used, in memory
    info = LeaderInfo("n0", "n0:1", epoch, True)
    store = EtcdTagStore(client, prefix="/c", epoch=epoch)
    return agent("n0", info, traffic, LoopbackPeers(), Clock(), store=store)


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
