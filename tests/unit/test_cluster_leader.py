"""Leader aggregation, cluster-wide tags and fencing (pure, no I/O)."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable
from types import TracebackType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpud.cluster.convert import order_from_pb, order_to_pb
from gpud.cluster.fencing import FailStatic, Fence, Mode
from gpud.cluster.leader import Aggregator, seed_levels
from gpud.cluster.model import LEFT_OUT_KEPT, JobReport, NodeReport, Order
from gpud.cluster.ports import MemoryTagStore
from gpud.errors import FailedPrecondition
from gpud.v1 import cluster_pb2 as pb
from netshaper.leveller import Leveller, LevellerConfig


def make(store: MemoryTagStore | None = None, timeout: float = 5.0) -> Aggregator:
    return Aggregator(
        leader="n0",
        leveller=Leveller(LevellerConfig(levels=4)),
        tags=store if store is not None else MemoryTagStore(),
        node_timeout_s=timeout,
    )


def test_a_jobs_progress_is_its_slowest_node() -> None:
    agg = make()
    agg.receive(NodeReport("n1", (JobReport("a", progress_rate=0.9), JobReport("b", 0.5))), 0)
    agg.receive(NodeReport("n2", (JobReport("a", progress_rate=0.3),)), 0)
    order = agg.compute(epoch=7, now=1.0)
    a = order.attributes["a"]
    assert a.progress_rate == 0.3
    assert a.slowest_node == "n2"
    assert a.nodes == ("n1", "n2")
    assert a.epoch == 7
    # a (0.3) is slower than b (0.5): it gets the higher priority
    assert order.levels["a"] < order.levels["b"]


def test_faults_of_any_node_reach_the_jobs_attributes() -> None:
    agg = make()
    agg.receive(NodeReport("n1", (JobReport("a", gpus=("G1",)),)), 0)
    agg.receive(
        NodeReport(
            "n2",
            (JobReport("a", unhealthy_gpus=("G2",), xids=(79,), link_up=False, drops=5),),
        ),
        0,
    )
    agg.receive(
        NodeReport("n3", (JobReport("a", xids=(79, 48), critical_xids=("G3:79", "G3:48")),)), 0
    )
    a = agg.compute(1, 0.5).attributes["a"]
    assert a.unhealthy_gpus == ("n2/G2",)
    # n2 an older gpud (codes only), n3 naming the device of each uncleared critical XID
    assert a.xids == ("n2:79", "n3:79", "n3:48")
    assert a.critical_xids == ("n3/G3:79", "n3/G3:48")
    assert a.links_down == ("n2",)
    assert a.drops == 5


def test_two_gpuds_under_one_node_name_are_told_apart_from_a_restart() -> None:
    agg = make()
    first = NodeReport("n1", (JobReport("a"), JobReport("b")), instance="first")
    second = NodeReport("n1", (JobReport("c"),), instance="second")
    agg.receive(first, 0, peer="ipv4:10.0.0.1:4000")
    agg.receive(second, 1, peer="ipv4:10.0.0.9:4000")  # a restart, as far as anyone knows
    # the replaced one reports again: two gpuds share the name; the newest keeps it
    with pytest.raises(FailedPrecondition, match=r"'n1' .* the one at ipv4:10\.0\.0\.9:4000"):
        agg.receive(first, 2, peer="ipv4:10.0.0.1:4000")
    agg.receive(second, 2)
    assert set(agg.compute(1, 2).levels) == {"c"}  # no flapping between the two job sets
    # the second one gone for the node timeout: the first may have the name back
    agg.receive(first, 8)
    assert set(agg.compute(1, 8).levels) == {"a", "b"}
    # a plain restart of it is taken at once
    agg.receive(NodeReport("n1", (JobReport("a"),), instance="third"), 9)
    assert set(agg.compute(1, 9).levels) == {"a"}


def test_answers_carry_only_the_nodes_jobs() -> None:
    agg = make()
    agg.receive(NodeReport("n1", (JobReport("a"),)), 0)
    agg.receive(NodeReport("n2", (JobReport("b"),)), 0)
    agg.compute(3, 0)
    answer = agg.answer("n1")
    assert answer is not None
    assert set(answer.levels) == {"a"} and set(answer.tags) == {"a"}
    assert answer.epoch == 3


def test_tags_are_unique_persisted_and_kept_by_a_new_leader() -> None:
    store = MemoryTagStore()
    agg = make(store)
    jobs = tuple(JobReport(f"j{i}") for i in range(40))
    agg.receive(NodeReport("n1", jobs), 0)
    first = agg.compute(1, 0).tags
    assert len(set(first.values())) == 40
    assert store.tags == first
    successor = make(store)
    successor.receive(NodeReport("n1", jobs), 10)
    assert successor.compute(2, 10).tags == first


def test_stale_nodes_drop_out_and_idle_tags_are_released() -> None:
    store = MemoryTagStore()
    agg = make(store, timeout=5)
    agg.receive(NodeReport("n1", (JobReport("a"),)), 0)
    agg.receive(NodeReport("n2", (JobReport("b"),)), 0)
    agg.compute(1, 0)
    agg.receive(NodeReport("n1", (JobReport("a"),)), 10)
    order = agg.compute(1, 10)
    assert set(order.levels) == {"a"}
    assert [n.node for n in agg.nodes(10)] == ["n1"]
    assert "b" in store.tags  # not yet: released after 3 x node timeout
    agg.receive(NodeReport("n1", (JobReport("a"),)), 16)
    agg.compute(1, 16)
    assert set(store.tags) == {"a"}


def test_a_new_leader_releases_the_stored_tags_of_jobs_no_node_reports() -> None:
    """Jobs that ended while no leader ran (or before the old one released them): the
    successor loads their tags from etcd and gives them back after release_after_s, so
    ``<prefix>/tags/`` and the DSCP pool do not fill up across failovers."""
    store = MemoryTagStore(tags={"gone-1": 10, "gone-2": 11})
    agg = make(store, timeout=5)
    agg.receive(NodeReport("n1", (JobReport("a"),)), 100)
    agg.compute(2, 100)
    assert set(store.tags) == {"gone-1", "gone-2", "a"}  # not yet: a node may report them
    agg.receive(NodeReport("n1", (JobReport("a"),)), 116)
    agg.compute(2, 116)
    assert set(store.tags) == {"a"}


def test_a_tag_stays_held_while_a_node_runs_its_job_under_a_name_the_leader_refuses() -> None:
    """An older leader tagged "old\n", which this one refuses and leaves out of n1's
    report: while n1 reports it so (it marks the job's packets with DSCP 10), the tag is
    neither released nor given to another node's job; once n1 no longer runs it, it goes
    after release_after_s like any other."""
    store = MemoryTagStore(tags={"old\n": 10})
    agg = make(store, timeout=5)
    for now in (100, 116, 132):
        agg.receive(NodeReport("n1", (JobReport("a"),)), now, left_out=["old\n"])
        # n2 marks a job of its own with 10 (its node-local tag)
        agg.receive(NodeReport("n2", (JobReport("x", dscp=10),)), now)
        order = agg.compute(2, now)
        assert store.tags["old\n"] == 10
        assert order.tags["x"] != 10
    for now in (140, 156, 172):
        agg.receive(NodeReport("n1", (JobReport("a"),)), now)
        agg.compute(2, now)
    assert "old\n" not in store.tags


def test_a_tag_a_silent_node_ran_a_refused_job_with_is_released_as_its_report_goes() -> None:
    """The left-out names go with the node's report: a node that stops reporting holds
    no tag for them."""
    store = MemoryTagStore(tags={"old\n": 10})
    agg = make(store, timeout=5)
    agg.receive(NodeReport("n1", (JobReport("a"),)), 100, left_out=["old\n"])
    agg.compute(2, 100)
    for now in (110, 120):  # n1 silent
        agg.receive(NodeReport("n2", (JobReport("b"),)), now)
        agg.compute(2, now)
    assert "old\n" not in store.tags


def test_a_new_leaders_first_round_keeps_the_tag_of_a_refused_job_past_the_first_64() -> None:
    """A leader that takes over hears n1 leave out 100 names, the 81st tagged 10 by an
    older leader, before its first round has read the tags: it remembered only the first
    64, so that round did not count the job running and gave DSCP 10 to n2's job."""
    many = [f"j{i:03d}\n" for i in range(100)]
    store = MemoryTagStore(tags={many[80]: 10})
    agg = make(store, timeout=5)
    agg.receive(NodeReport("n1", (JobReport("a"),)), 100, left_out=many)
    agg.receive(NodeReport("n2", (JobReport("x", dscp=10),)), 100)
    order = agg.compute(2, 100)
    assert store.tags[many[80]] == 10
    assert order.tags["x"] != 10


class _ReceivedDuringPop(dict[str, object]):
    """A leader's reports, into which ``arrive`` delivers a node's next report while a
    round drops the node's last one (the gRPC thread's receive in the middle of a round)."""

    def __init__(self, reports: dict[str, object], arrive: Callable[[], None]) -> None:
        super().__init__(reports)
        self.arrive: Callable[[], None] | None = arrive

    def pop(self, key: str, *default: object) -> object:
        gone = super().pop(key, *default)
        arrive, self.arrive = self.arrive, None
        if arrive is not None:
            arrive()
        return gone


def _silent_n1_and_its_next_report(store: MemoryTagStore) -> tuple[Aggregator, Callable[[], None]]:
    """A leader whose n1 reported at 100, leaving out the job tagged 10 in ``store``, and
    n1's next report of 110 (the same), to deliver: n1 is past the timeout at 110."""
    agg = make(store, timeout=5)
    agg.receive(NodeReport("n1", (JobReport("a"),)), 100, left_out=["old\n"])
    agg.compute(2, 100)

    def arrive() -> None:
        agg.receive(NodeReport("n1", (JobReport("a"),)), 110, left_out=["old\n"])

    return agg, arrive


def _n1s_tag_is_held(agg: Aggregator, store: MemoryTagStore) -> None:
    """n2 marks its job with DSCP 10: the next round leaves it to n1's left-out job."""
    agg.receive(NodeReport("n2", (JobReport("x", dscp=10),)), 111)
    order = agg.compute(2, 111)
    assert store.tags["old\n"] == 10
    assert order.tags["x"] != 10


def test_a_report_arriving_while_a_round_drops_the_nodes_last_keeps_its_left_out_names() -> None:
    """n1 falls silent past the node timeout and reports again, leaving out the job
    tagged 10, while a round drops its last report: the round then dropped the left-out
    names of the new report, kept apart from it, and the next round gave DSCP 10 to
    n2's job though n1 still marks its job with it."""
    store = MemoryTagStore(tags={"old\n": 10})
    agg, arrive = _silent_n1_and_its_next_report(store)
    agg._reports = _ReceivedDuringPop(agg._reports, arrive)  # type: ignore[assignment]
    # the report arrives on the round's own thread here, inside the round's hold of the lock
    agg._lock = contextlib.nullcontext()  # type: ignore[assignment]
    agg.compute(2, 110)  # n1's report of 100 is past the timeout
    _n1s_tag_is_held(agg, store)


class _SaysWhenWaitedOn:
    """A lock that sets ``waiting`` when a thread finds it held and waits for it."""

    def __init__(self, waiting: threading.Event) -> None:
        self._lock = threading.Lock()
        self._waiting = waiting

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._waiting.set()
            self._lock.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._lock.release()


class _ReceivedDuringCheck(dict[str, object]):
    """A leader's reports, into which another thread (the gRPC one) delivers a node's next
    report right after a round has looked up the node's last one to drop it: the round
    goes on once that report is in, or once its thread waits for the leader's lock."""

    def __init__(self, reports: dict[str, object], arrive: Callable[[], None]) -> None:
        super().__init__(reports)
        self.arrive: Callable[[], None] | None = arrive
        self.progress = threading.Event()
        self.thread: threading.Thread | None = None

    def get(self, key: str, default: object = None) -> object:
        found = super().get(key, default)
        arrive, self.arrive = self.arrive, None
        if arrive is not None:

            def deliver() -> None:
                arrive()
                self.progress.set()

            self.thread = threading.Thread(target=deliver)
            self.thread.start()
            self.progress.wait(timeout=60)  # not a bound on the round: only against a hang
        return found


def test_a_report_arriving_between_a_rounds_check_and_its_drop_of_the_nodes_last_is_kept() -> None:
    """n1 falls silent past the node timeout and reports again, leaving out the job
    tagged 10, after a round checked that its last report was the silent one and before
    the round removed it: the round removed the new report with its left-out names, n1
    was gone, and the next round gave DSCP 10 to n2's job though n1 marks its job with it."""
    store = MemoryTagStore(tags={"old\n": 10})
    agg, arrive = _silent_n1_and_its_next_report(store)
    reports = _ReceivedDuringCheck(agg._reports, arrive)
    agg._reports = reports  # type: ignore[assignment]
    agg._lock = _SaysWhenWaitedOn(reports.progress)  # type: ignore[assignment]
    agg.compute(2, 110)  # n1's report of 100 is past the timeout
    assert reports.thread is not None
    reports.thread.join()
    assert [n.node for n in agg.nodes(110)] == ["n1"]
    _n1s_tag_is_held(agg, store)


def test_a_nodes_refused_job_is_new_once_until_the_node_falls_silent() -> None:
    """What to log: a name the node's last report left out already is not new, whatever
    else comes and goes; a node dropped for silence is new again; of thousands of names,
    only the first LEFT_OUT_KEPT are remembered (the others come back each report)."""
    agg = make(timeout=5)
    n1 = NodeReport("n1")
    assert agg.receive(n1, 0, left_out=["old\n"]) == ["old\n"]
    assert agg.receive(n1, 1, left_out=["x\n", "old\n"]) == ["x\n"]
    assert agg.receive(n1, 2, left_out=["old\n"]) == []
    agg.compute(1, 10)  # n1 silent past the node timeout: dropped
    assert agg.receive(n1, 11, left_out=["old\n"]) == ["old\n"]
    many = [f"j{i}\n" for i in range(4096)]
    assert len(agg.receive(n1, 12, left_out=many)) == 4096
    assert agg.receive(n1, 13, left_out=many) == many[LEFT_OUT_KEPT:]


def test_a_failing_tag_store_publishes_nothing_new() -> None:
    class Broken(MemoryTagStore):
        def save(self, allocated: object, released: object) -> None:
            raise OSError("etcd down")

    agg = make(Broken())
    agg.receive(NodeReport("n1", (JobReport("a"),)), 0)
    with pytest.raises(OSError):
        agg.compute(1, 0)
    assert agg.order is None


def test_seq_restarts_with_each_epoch() -> None:
    agg = make()
    agg.receive(NodeReport("n1", (JobReport("a"),)), 0)
    assert (agg.compute(5, 0).seq, agg.compute(5, 1).seq) == (1, 2)
    assert agg.compute(9, 2).seq == 1


def order(epoch: int, seq: int) -> Order:
    return Order(epoch=epoch, seq=seq, leader="x", levels={}, tags={})


def test_fence_rejects_stale_epochs_and_old_answers() -> None:
    fence = Fence()
    assert fence.admit(order(5, 1))
    assert fence.admit(order(5, 2))
    assert not fence.admit(order(4, 9))  # a deposed leader
    assert not fence.admit(order(5, 1))  # an older answer of the same leader
    assert fence.admit(order(6, 1))
    assert fence.rejected == 2
    assert (fence.epoch, fence.seq) == (6, 1)


def test_fence_admits_the_named_leader_of_the_same_epoch_on_a_new_lease() -> None:
    # a fresh etcd gave the new leader key the create revision of the one before
    def signed(seq: int, lease: int) -> Order:
        return Order(epoch=5, seq=seq, leader="x", levels={}, tags={}, lease=lease)

    fence = Fence()
    assert fence.admit(signed(7, 100), elected=5)
    assert not fence.admit(signed(1, 200))  # not the leader etcd names
    assert fence.admit(signed(1, 200), elected=5)  # its seq starts over
    assert not fence.admit(signed(8, 100))  # the deposed leadership, not named
    assert not fence.admit(signed(9, 100), elected=4)
    assert fence.admit(signed(2, 200), elected=5)
    assert not fence.admit(signed(1, 200), elected=5)  # an older answer of the same one
    assert not fence.admit(signed(1, 0), elected=5)  # no lease (an older gpud): by seq
    assert fence.rejected == 5
    assert (fence.epoch, fence.seq, fence.lease) == (5, 2, 200)


def test_the_leaders_orders_carry_its_leader_key_lease_to_the_nodes() -> None:
    agg = Aggregator(
        leader="n0",
        leveller=Leveller(LevellerConfig(levels=4)),
        tags=MemoryTagStore(),
        node_timeout_s=5.0,
        lease=0x7F3A,
    )
    agg.receive(NodeReport("n1", (JobReport("a", progress_rate=0.5),)), 0)
    sent = agg.compute(epoch=5, now=1.0).for_jobs(["a"])
    assert order_from_pb(pb.Order.FromString(order_to_pb(sent).SerializeToString())) == sent
    assert sent.lease == 0x7F3A
    # an older leader sends none: read as 0, and the fence judges it by seq
    older = pb.Order(epoch=5, seq=1, leader="n0")
    assert order_from_pb(pb.Order.FromString(older.SerializeToString())).lease == 0


def test_fail_static_holds_the_last_order_for_the_grace_period() -> None:
    fs = FailStatic(grace_s=30, fresh_s=3)
    assert fs.mode(0, leading=False) is Mode.LOCAL
    fs.contact(10)
    assert fs.mode(11, leading=False) is Mode.FOLLOWER
    assert fs.mode(20, leading=False) is Mode.HOLDING
    assert fs.mode(40, leading=False) is Mode.HOLDING
    assert fs.mode(40.5, leading=False) is Mode.LOCAL
    assert fs.mode(40.5, leading=True) is Mode.LEADER


def test_a_tag_nodes_already_use_is_kept_when_free() -> None:
    agg = make()
    agg.receive(NodeReport("n1", (JobReport("a", dscp=21), JobReport("b", dscp=21))), 0)
    tags = agg.compute(1, 0).tags
    assert tags["a"] == 21 and tags["b"] != 21


def test_tags_a_node_handed_over_from_idle_jobs_are_not_ordered_back() -> None:
    """A node with its DSCP pool used up hands the tag of a job idle there to a job about
    to run, and tags the idle job anew once it runs again. The leader, which still holds
    the old tags for ``release_after_s``, follows: ordering them back would move the DSCP
    of jobs that run."""
    store = MemoryTagStore()
    agg = make(store)
    agg.receive(NodeReport("n1", (JobReport("a", 0.5, dscp=10), JobReport("b", 0.5, dscp=11))), 0)
    assert agg.compute(1, 0).tags == {"a": 10, "b": 11}
    # a went idle: its tag 10 went to c; then a ran again and took b's tag 11 (b idle too)
    agg.receive(NodeReport("n1", (JobReport("a", 0.5, dscp=11), JobReport("c", 0.5, dscp=10))), 2)
    order = agg.compute(1, 2)
    assert order.tags == {"a": 11, "c": 10}
    assert store.tags == {"a": 11, "c": 10}
    # b runs again with a tag of its own: the leader's round keeps it
    agg.receive(
        NodeReport(
            "n1",
            (
                JobReport("a", 0.5, dscp=11),
                JobReport("b", 0.5, dscp=12),
                JobReport("c", 0.5, dscp=10),
            ),
        ),
        4,
    )
    assert agg.compute(1, 4).tags == {"a": 11, "b": 12, "c": 10}


def test_a_tag_two_nodes_give_two_jobs_stays_with_the_leaders_holder() -> None:
    agg = make()
    agg.receive(NodeReport("n1", (JobReport("a", 0.5, dscp=10),)), 0)
    agg.compute(1, 0)
    agg.receive(NodeReport("n2", (JobReport("b", 0.5, dscp=10),)), 1)
    tags = agg.compute(1, 1).tags
    assert tags["a"] == 10 and tags["b"] != 10


def test_more_jobs_than_codepoints_still_get_levels() -> None:
    agg = make()
    agg.receive(NodeReport("n1", tuple(JobReport(f"j{i:03}", 0.5) for i in range(100))), 0)
    order = agg.compute(1, 0)
    assert len(order.levels) == 100
    assert len(order.tags) == len(set(order.tags.values())) == 100 - len(agg.untagged)
    assert agg.untagged and all(order.attributes[j].dscp is None for j in agg.untagged)


def test_a_pin_on_any_node_holds_everywhere() -> None:
    agg = make()
    agg.receive(NodeReport("n1", (JobReport("a", 0.1), JobReport("b", 0.9, pinned_level=0))), 0)
    agg.receive(NodeReport("n2", (JobReport("b", 0.9),)), 0)
    assert agg.compute(1, 0).levels["b"] == 0
    agg.receive(NodeReport("n1", (JobReport("a", 0.1), JobReport("b", 0.9))), 1)
    levels = agg.compute(1, 1).levels  # unpinned: b (0.9) below a (0.1) again
    assert levels["b"] > levels["a"]


def test_a_job_no_node_ranks_holds_no_level_and_pushes_no_live_job_down() -> None:
    agg = make()
    # "done" ended on n1: its last rate, decayed to its gap limit, reads the slowest
    done = JobReport("done", 0.05, unranked=True)
    agg.receive(NodeReport("n1", (done, JobReport("a", 0.5), JobReport("b", 0.9))), 0)
    order = agg.compute(1, 0)
    assert "done" not in order.levels
    assert order.attributes["done"].level is None
    assert order.levels["a"] == 0 and order.levels["b"] == 1
    # ranked where any node ranks it (still running there), or where a node pins it
    agg.receive(NodeReport("n2", (JobReport("done", 0.05),)), 0)
    assert agg.compute(1, 0).levels["done"] == 0
    agg.receive(NodeReport("n2", (JobReport("done", 0.05, unranked=True, pinned_level=3),)), 0)
    assert agg.compute(1, 0).levels["done"] == 3


def test_a_new_leaders_first_order_keeps_the_levels_in_force() -> None:
    agg = make()
    # equal rates (a fresh ranking: by job id); c was pinned on the old leader's node only
    agg.receive(
        NodeReport(
            "n1",
            (
                JobReport("a", 0.5, applied_level=2),
                JobReport("b", 0.5, applied_level=0),
                JobReport("c", 0.5, applied_level=3),
            ),
            applied_epoch=5,
        ),
        0,
    )
    agg.receive(
        NodeReport(
            "n2",
            (
                JobReport("b", 0.5, applied_level=1),  # an older order: n1's level counts
                JobReport("d", 0.5, applied_level=0, pinned_level=3),  # the pin counts
                JobReport("e", 0.5),  # new: no level in force
            ),
            applied_epoch=4,
        ),
        0,
    )
    levels = agg.compute(9, 1.0).levels
    assert levels == {"a": 2, "b": 0, "c": 3, "d": 3, "e": 1}
    # the seed is the first round's only: a later round ranks from the levels it gave
    agg.receive(NodeReport("n1", (JobReport("a", 0.5, applied_level=0),), applied_epoch=9), 2)
    assert agg.compute(9, 2.0).levels["a"] == 2


def test_seed_levels_take_the_newest_epoch_and_leave_out_levels_out_of_range() -> None:
    reports = [
        NodeReport("n1", (JobReport("a", applied_level=1), JobReport("b", applied_level=5))),
        NodeReport("n2", (JobReport("a", applied_level=3), JobReport("c")), applied_epoch=7),
        NodeReport(
            "n3",
            (JobReport("a", applied_level=2), JobReport("d", applied_level=1)),
            applied_epoch=7,
        ),
    ]
    # two nodes of epoch 7 differ by a round: the higher priority
    assert seed_levels(reports, 4) == {"a": 2, "d": 1}
    assert seed_levels(reports[:1], 8) == {"a": 1, "b": 5}


_job_reports = st.builds(
    JobReport,
    job=st.sampled_from(["a", "b", "c", "d"]),
    progress_rate=st.none() | st.floats(0, 1),
    iterations_per_s=st.none() | st.floats(0, 10),
    dscp=st.none() | st.integers(1, 40),
    unhealthy_gpus=st.lists(st.sampled_from(["G1", "G2"]), max_size=2).map(tuple),
    xids=st.lists(st.integers(1, 99), max_size=2).map(tuple),
    critical_xids=st.lists(st.sampled_from(["G1:79", "G2:48"]), max_size=2).map(tuple),
    link_up=st.none() | st.booleans(),
    tx_bytes=st.integers(0, 1 << 20),
    drops=st.integers(0, 9),
    pinned_level=st.none() | st.integers(-1, 4),
    unranked=st.booleans(),
    faults_left_out=st.integers(0, 9),
)


def _round_robin(seen: list[tuple[str, JobReport]], field: str, sep: str) -> tuple[str, ...]:
    """A fault list as the fold lists it: each node's first entry, by node name, then
    each one's second, ..."""
    lists = [[f"{n}{sep}{x}" for x in getattr(jr, field)] for n, jr in sorted(seen)]
    return tuple(x for turn in itertools.zip_longest(*lists) for x in turn if x is not None)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(_job_reports, max_size=4, unique_by=lambda r: r.job), min_size=1, max_size=4)
)
def test_the_fold_is_the_plain_fold_over_the_nodes_in_order(
    per_node: list[list[JobReport]],
) -> None:
    agg = make()
    reports = [NodeReport(f"n{i}", tuple(jobs)) for i, jobs in enumerate(per_node)]
    for r in reports:
        agg.receive(r, 0)
    order = agg.compute(epoch=1, now=0.0)
    jobs = {jr.job for r in reports for jr in r.jobs}
    assert set(order.attributes) == jobs
    for job in jobs:
        seen = [(r.node, jr) for r in reports for jr in r.jobs if jr.job == job]
        rated = [(jr.progress_rate, n) for n, jr in seen if jr.progress_rate is not None]
        slowest = min(rated, key=lambda p: p[0]) if rated else (None, "")
        ips = [jr.iterations_per_s for _, jr in seen if jr.iterations_per_s is not None]
        pins = [jr.pinned_level for _, jr in seen if jr.pinned_level is not None]
        a = order.attributes[job]
        assert (a.progress_rate, a.slowest_node) == slowest
        assert a.iterations_per_s == (min(ips) if ips else None)
        assert a.nodes == tuple(n for n, _ in seen)
        assert a.unhealthy_gpus == _round_robin(seen, "unhealthy_gpus", "/")
        assert a.xids == _round_robin(seen, "xids", ":")
        assert a.critical_xids == _round_robin(seen, "critical_xids", "/")
        assert a.links_down == tuple(n for n, jr in seen if jr.link_up is False)
        # the lists are within MAX_JOB_FAULTS: the leader cuts none of its own
        assert a.faults_left_out == sum(jr.faults_left_out for _, jr in seen)
        assert a.drops == sum(jr.drops for _, jr in seen)
        assert a.tx_bytes == sum(jr.tx_bytes for _, jr in seen)
        # ranked where some node ranks it or pins it
        assert (job in order.levels) == (any(not jr.unranked for _, jr in seen) or bool(pins))
        # the last pin reported wins, where it names a level
        if pins and 0 <= pins[-1] < 4:
            assert order.levels[job] == pins[-1]
