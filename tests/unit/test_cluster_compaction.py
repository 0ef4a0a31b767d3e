"""An etcd compacted past the leader key's own revision (``etcdctl compact REV``, the
advice for an etcd out of space, or etcd's auto-compaction): the election's watch between
steps still waits for a change."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from gpud.cluster.election import EtcdElection
from gpud.cluster.etcd import EtcdClient, KeyValue
from tests.unit.cluster_support import Clock
from tests.unit.test_cluster_suspend import SuspendingWatch

KEY = "/c/leader"


class CompactedEtcd(SuspendingWatch):
    """Reads answer with the store's revision, as etcd's header does (none where
    ``headerless``: a proxy that strips it); a watch from a revision below the compaction
    is cancelled at once (etcd's ``compact_revision`` answer, which ``wait_for_change``
    counts as a change and records), any other lasts its timeout."""

    def __init__(self, now: Clock, stop: threading.Event, *, headerless: bool = False) -> None:
        super().__init__(now, stop)
        self.headerless = headerless
        self.compacted = 0
        self.cancelled = 0
        self.watched_after: list[int] = []  # each watch's after_revision

    def write_elsewhere_and_compact(self, writes: int) -> None:
        self.revision += writes
        self.compacted = self.revision

    def get(self, key: str) -> KeyValue | None:
        kv = super().get(key)
        if kv is None or self.headerless:
            return kv
        return dataclasses.replace(kv, read_revision=self.revision)

    def wait_for_change(self, key: str, after_revision: int, timeout_s: float) -> bool:
        self.watched_after.append(after_revision)
        if after_revision + 1 < self.compacted:  # etcd keeps the revision compacted to
            self.cancelled += 1
            self.compacted_revision = self.compacted
            return True
        return super().wait_for_change(key, after_revision, timeout_s)


def _compacted_under(
    node: str, *, headerless: bool = False
) -> tuple[Clock, CompactedEtcd, EtcdElection]:
    """n0 elected; 40 writes to other keys, then a compaction to the last of them."""
    now = Clock()
    stop = threading.Event()
    etcd = CompactedEtcd(now, stop, headerless=headerless)
    client: EtcdClient = etcd  # type: ignore[assignment]  # the calls used, in memory
    leader = EtcdElection(client, node="n0", address="n0:1", prefix="/c", ttl_s=300, clock=now)
    leader.step()
    assert leader.state().leading
    etcd.write_elsewhere_and_compact(40)
    if node == "n0":
        return now, etcd, leader
    follower = EtcdElection(
        client, node=node, address=f"{node}:1", prefix="/c", ttl_s=300, clock=now
    )
    return now, etcd, follower


def test_a_follower_waits_out_its_pause_after_etcd_is_compacted_past_the_leader_key() -> None:
    now, etcd, follower = _compacted_under("n1")
    follower.step()
    assert follower.state().leader == "n0"
    start = now.now
    follower._wait(follower.interval_s)
    assert etcd.cancelled == 0
    assert now.now >= start + follower.interval_s  # watched, not stepped again at once


def test_a_leader_waits_out_its_pause_after_etcd_is_compacted_past_its_key() -> None:
    now, etcd, leader = _compacted_under("n0")
    leader.step()  # the renewal reads the key again
    assert leader.state().leading
    start = now.now
    leader._wait(leader.interval_s)
    assert etcd.cancelled == 0
    assert now.now >= start + leader.interval_s


@pytest.mark.parametrize("node", ["n0", "n1"], ids=["leader", "follower"])
def test_a_read_without_a_revision_is_watched_from_the_compaction_a_watch_was_cancelled_for(
    node: str,
) -> None:
    """A proxy that strips etcd's header from a read's answer: the leader key is watched
    from its own revision, behind the compaction, once; etcd's cancel names the revision
    it was compacted to, and every watch after it starts there and waits out its pause."""
    now, etcd, election = _compacted_under(node, headerless=True)
    election.step()
    assert election.state().leader == "n0"
    election._wait(election.interval_s)
    assert etcd.cancelled == 1  # watched from the key's own revision
    start = now.now
    election.step()
    assert election.state().leader == "n0"
    election._wait(election.interval_s)
    assert etcd.cancelled == 1
    assert now.now >= start + election.interval_s


def test_a_follower_of_an_etcd_wiped_since_a_compaction_watches_from_the_store_it_reads() -> None:
    """etcd compacted to 1000, then its data wiped (or restored from an older snapshot):
    revisions start again at 1, and the leader key read at 11 is watched from there, not
    from past the old compaction, where no change would be seen until the store passed
    it."""
    now = Clock()
    stop = threading.Event()
    etcd = CompactedEtcd(now, stop)
    client: EtcdClient = etcd  # type: ignore[assignment]  # the calls used, in memory
    leader = EtcdElection(client, node="n0", address="n0:1", prefix="/c", ttl_s=300, clock=now)
    leader.step()
    etcd.revision = 11
    etcd.compacted_revision = 1000  # seen before the wipe
    follower = EtcdElection(client, node="n1", address="n1:1", prefix="/c", ttl_s=300, clock=now)
    follower.step()
    assert follower.state().leader == "n0"
    follower._wait(follower.interval_s)
    assert etcd.watched_after and max(etcd.watched_after) <= 11, etcd.watched_after
