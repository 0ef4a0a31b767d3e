"""gpud killed between any two of an operation's writes to the state database: after a
restart on the same state directory the operation took effect whole or not at all.

The crash is a store whose Nth transaction (outermost, counted from when it is armed)
raises before it begins: what the ones before it committed is kept, nothing after it is
written, as when the process is killed there. Each operation is crashed at every point it
has, and a fresh service is built over the same state directory each time."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from sqlite3 import Connection

import pytest

from gpud.admission.service import LEFT, QUEUED, AdmissionService
from gpud.colo.service import ColoService, RunningJob
from gpud.config import AdmissionConfig, ColocateConfig, TrafficConfig
from gpud.errors import GpudError, NotFound, StateUnwritable
from gpud.events import EventLog
from gpud.jobs.registry import JobSpec
from gpud.jobs.service import JobService, RunRequest
from gpud.mps.manager import MpsManager
from gpud.net.service import TrafficService, job_pool
from gpud.net.tagstore import TagStore
from gpud.store import StateStore
from tests.unit.mps_support import FAKE_CONTROL, gpu_sample, gpu_uuid, snapshot

GIB = 1 << 30
MOST_POINTS = 40  # more transactions than any operation here has


class Crash(BaseException):
    """gpud killed: no handler of the daemon's catches it."""


class CrashingStore(StateStore):
    """Crashes before its ``crash_at``-th outermost transaction once armed (None: never);
    with ``commit_fails``, each outermost transaction that wrote fails at its commit, as on
    a full disk: nothing of it is kept."""

    crash_at: int | None = None
    commit_fails = False

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        outermost = not self._conn.in_transaction
        if self.crash_at is not None and outermost:
            self.crash_at -= 1
            if self.crash_at == 0:
                raise Crash
        with super().transaction() as conn:
            changes = conn.total_changes
            yield conn
            if outermost and self.commit_fails and conn.total_changes != changes:
                raise StateUnwritable(f"state database {self.path} cannot be written")


@dataclass
class Node:
    store: CrashingStore
    jobs: JobService
    admission: AdmissionService
    events: EventLog
    traffic: TrafficService | None = None


def make_node(root: Path, *, traffic: bool = False) -> Node:
    """A node over ``root``'s state directory; with ``traffic``, jobs get DSCP tags (no
    interface is shaped)."""
    store = CrashingStore(root / "state")
    events = EventLog(None)
    mps = MpsManager(store, events, root / "run", FAKE_CONTROL, enabled=False)
    mps.reconcile(snapshot(gpu_sample(0), gpu_sample(1)))
    jobs = JobService(store, events, mps, socket_path=root / "gpud.sock", clock=lambda: 1000.0)
    admission = AdmissionService(store, jobs, mps, events, AdmissionConfig(), clock=lambda: 1000.0)
    node = Node(store, jobs, admission, events)
    if traffic:
        config = TrafficConfig(enabled=True, interfaces=())
        node.traffic = TrafficService(
            config,
            tags=TagStore(store, pool=job_pool(config)),
            events=events,
            jobs=jobs.registry.names,
            active=lambda: {r.job for r in jobs.reservations.held()},
            clock=lambda: 1000.0,
            monotonic=lambda: 1000.0,
        )
        jobs.set_tagger(node.traffic.tag, node.traffic.tags.get, node.traffic.starting)
    return node


@pytest.fixture
def holder() -> Iterator[int]:
    """A live `gpuctl run` holding what it asked for."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc.pid
    proc.kill()
    proc.wait()


@dataclass(frozen=True)
class Seen:
    jobs: tuple[str, ...]
    held: tuple[str, ...]  # the jobs of the reservations
    queue: tuple[tuple[str, str], ...]  # (job, state) of every entry
    open_runs: tuple[str, ...]  # the jobs of history rows without an end
    tagged: tuple[str, ...] = ()  # the jobs holding a DSCP tag after the first traffic tick


def seen(root: Path, *, traffic: bool = False) -> Seen:
    node = make_node(root, traffic=traffic)
    try:
        if node.traffic is not None:
            node.traffic.tick()
        return Seen(
            tuple(j.name for j in node.jobs.registry.all()),
            tuple(r.job for r in node.jobs.reservations.held()),
            tuple((e.job, e.state) for e in node.admission.entries(None)),
            tuple(h.job for h in node.admission.history() if h.ended_at is None),
            tuple(sorted(node.traffic.tags.allocations())) if node.traffic is not None else (),
        )
    finally:
        node.store.close()


def crash_points(
    root: Path,
    setup: Callable[[Node], object],
    operation: Callable[[Node], object],
    *,
    traffic: bool = False,
) -> Iterator[tuple[int, Seen]]:
    """The state after ``operation`` crashed at each of its points, then after it ran
    whole (the last)."""
    for n in range(1, MOST_POINTS):
        where = root / str(n)
        node = make_node(where, traffic=traffic)
        setup(node)
        node.store.crash_at = n
        try:
            operation(node)
        except Crash:
            node.store.close()
            yield n, seen(where, traffic=traffic)
            continue
        node.store.close()
        yield n, seen(where, traffic=traffic)
        return
    raise AssertionError(f"no run of the operation got through {MOST_POINTS} transactions")


def whole_or_none(points: list[tuple[int, Seen]], before: Seen, after: Seen) -> None:
    assert len(points) > 2
    for n, state in points[:-1]:
        assert state in (before, after), f"crash at transaction {n}: {state}"
    assert points[-1][1] == after


def fill_and_queue(node: Node, holder: int) -> None:
    """Job a runs on both GPUs and waits in the queue for more."""
    whole = RunRequest(job="a", gpu_count=2, memory_bytes=60 * GIB, holder_pid=holder)
    node.jobs.reserve(whole)
    node.admission.enqueue(whole)


def test_jobs_rm_force_is_whole_or_not_at_all(tmp_path: Path, holder: int) -> None:
    """`gpuctl jobs rm --force a` killed between its writes left job a unregistered while
    its running run still held its reservation and its history row stayed open: `gpuctl
    jobs rm --force a` then said `no job 'a'`, and the devices stayed reserved as long as
    the run ran."""
    before = Seen(("a",), ("a",), (("a", QUEUED),), ("a",))
    after = Seen((), (), (("a", LEFT),), ())
    points = list(
        crash_points(
            tmp_path, lambda n: fill_and_queue(n, holder), lambda n: n.jobs.remove("a", force=True)
        )
    )
    whole_or_none(points, before, after)


def test_a_removal_whose_commit_fails_says_nothing_of_it(tmp_path: Path, holder: int) -> None:
    """`gpuctl jobs rm --force a` whose commit failed (disk full) wrote `admission.leave` to
    events.jsonl, though job a and its queue entry stayed."""
    node = make_node(tmp_path)
    fill_and_queue(node, holder)
    node.store.commit_fails = True
    with pytest.raises(StateUnwritable):
        node.jobs.remove("a", force=True)
    assert [e.kind for e in node.events.recent(kind_prefix="admission.leave")] == []
    assert [e.kind for e in node.events.recent(kind_prefix="job.remove")] == []
    assert [(e.job, e.state) for e in node.admission.entries(None)] == [("a", QUEUED)]
    node.store.commit_fails = False
    node.jobs.remove("a", force=True)
    assert [e.fields["job"] for e in node.events.recent(kind_prefix="admission.leave")] == ["a"]
    node.store.close()


def test_a_removal_whose_commit_fails_leaves_a_run_waiting_for_co_location(
    tmp_path: Path,
) -> None:
    """`gpuctl jobs rm --force w` whose commit failed (disk full) kept job w registered,
    yet its `gpuctl run` waiting for co-location was taken out of the wait at once: its
    next question was answered "job w was removed" (it exited 4) and `colo.leave` was
    said. The run now waits on until a removal commits."""
    node = make_node(tmp_path)
    full = snapshot(gpu_sample(0), gpu_sample(1))
    held = [
        RunningJob(j, "training", i, memory_bytes=75 * GIB, device=gpu_uuid(i))
        for i, j in enumerate("ab")
    ]
    now = [1000.0]
    loop = ColoService(ColocateConfig(), node.events, running=lambda: held, clock=lambda: now[0])
    loop.tick(full)
    node.jobs.add_removal_hook(loop.job_removed)
    node.jobs.set_waiting(loop.waiting_kind)
    node.jobs.add(JobSpec("w"))  # `gpuctl jobs add w`, then its `gpuctl run` waits

    def ask() -> str:
        now[0] += 1.0  # gpuctl run asks again, saying how long it has waited
        advice = loop.advise(
            "w", snapshot=full, waiting=True, waited_s=now[0] - 1001.0, waiter_id=waiter
        )
        assert advice.gpu == -1, advice  # every GPU's memory is held
        return advice.waiter_id

    waiter = ""
    waiter = ask()
    node.store.commit_fails = True
    with pytest.raises(StateUnwritable):
        node.jobs.remove("w", force=True)
    assert node.jobs.registry.find("w") is not None
    assert [w.id for w in loop.waiting()] == [waiter]
    assert ask() == waiter  # not "job w was removed"
    assert [e.kind for e in node.events.recent(kind_prefix="colo.leave")] == []
    node.store.commit_fails = False
    node.jobs.remove("w", force=True)
    assert node.jobs.registry.find("w") is None and loop.waiting() == []
    with pytest.raises(NotFound, match="job w was removed"):
        ask()
    assert [e.fields["job"] for e in node.events.recent(kind_prefix="colo.leave")] == ["w"]
    node.store.close()


def test_a_run_of_a_new_job_registers_it_with_its_reservation(tmp_path: Path, holder: int) -> None:
    """`gpuctl run --job new` killed between the job's registration and its reservation
    left job new registered with nothing run: its placement and limits then held for
    every later run of that name, which a refused run never leaves."""
    held = RunRequest(job="b", gpu_count=1, memory_bytes=60 * GIB, holder_pid=holder)
    before = Seen(("b",), ("b",), (), ("b",))
    after = Seen(("b", "new"), ("b", "new"), (), ("b", "new"))
    points = list(
        crash_points(
            tmp_path,
            lambda n: n.jobs.reserve(held),
            lambda n: n.jobs.reserve(RunRequest(job="new", holder_pid=holder)),
        )
    )
    whole_or_none(points, before, after)


def test_a_queued_run_of_a_new_job_registers_it_with_its_entry(tmp_path: Path, holder: int) -> None:
    """The same for a run that has to wait: the job and its queue entry are kept or lost
    together."""
    held = RunRequest(job="b", gpu_count=2, memory_bytes=60 * GIB, holder_pid=holder)
    waits = RunRequest(job="new", gpu_count=2, memory_bytes=60 * GIB, holder_pid=holder)
    before = Seen(("b",), ("b",), (), ("b",))
    after = Seen(("b", "new"), ("b",), (("new", QUEUED),), ("b",))
    points = list(
        crash_points(
            tmp_path,
            lambda n: n.jobs.reserve(held),
            lambda n: n.admission.enqueue(waits),
        )
    )
    whole_or_none(points, before, after)


def test_a_run_of_a_new_job_with_traffic_on_registers_it_with_its_reservation(
    tmp_path: Path, holder: int
) -> None:
    """With traffic on, `gpuctl run --job new` registered job new, then tagged it, then
    reserved for it, each in a transaction of its own: killed between them, it left job new
    registered with nothing run (and a DSCP tag), whose placement and limits every later
    run of that name inherited. A tag left by a run cut short goes at the first tick."""
    held = RunRequest(job="b", gpu_count=1, memory_bytes=60 * GIB, holder_pid=holder)
    before = Seen(("b",), ("b",), (), ("b",), ("b",))
    after = Seen(("b", "new"), ("b", "new"), (), ("b", "new"), ("b", "new"))
    points = list(
        crash_points(
            tmp_path,
            lambda n: n.jobs.reserve(held),
            lambda n: n.jobs.reserve(RunRequest(job="new", gpu_count=1, holder_pid=holder)),
            traffic=True,
        )
    )
    whole_or_none(points, before, after)


def test_a_traffic_tick_as_a_new_job_starts_keeps_its_tag(tmp_path: Path, holder: int) -> None:
    """A new job is tagged before the transaction that registers it: a traffic tick between
    the two keeps its tag (the run's environment carries the tag the job holds). A run
    refused leaves neither the job nor, after the next tick, its tag."""
    node = make_node(tmp_path, traffic=True)
    assert node.traffic is not None
    traffic = node.traffic

    def tick_meanwhile(spec: object, uid: object) -> None:
        traffic.tick()  # the job is tagged, not registered yet

    node.jobs.gate = tick_meanwhile
    launch = node.jobs.reserve(RunRequest(job="new", gpu_count=1, holder_pid=holder))
    traffic.tick()
    assert launch.env["GPUD_DSCP"] == str(traffic.tags.get("new"))
    assert node.jobs.registry.names() == ["new"]
    with pytest.raises(GpudError):
        node.jobs.reserve(RunRequest(job="refused", gpu_count=9, holder_pid=holder))
    traffic.tick()
    assert node.jobs.registry.names() == ["new"] and sorted(traffic.tags.allocations()) == ["new"]
