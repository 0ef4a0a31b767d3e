"""The admission queue in the daemon: persisted, ordered, gated, over the real job service."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpud.admission.api import class_message, entry_message, history_message, run_request
from gpud.admission.passes import Inline, Passes, PassRunner
from gpud.admission.service import (
    DEMANDS_KEEP,
    LEFT,
    QUEUED,
    SCHEMA,
    STARTED,
    AdmissionService,
    Entry,
    HistoryRow,
    mig_file_layouts,
    run_request_from_json,
    run_request_to_json,
)
from gpud.cli.jobs import queued_line
from gpud.cli.queue import quote_text
from gpud.config import AdmissionConfig, from_dict
from gpud.errors import ConfigError, FailedPrecondition, InvalidArgument, ResourceExhausted
from gpud.events import EventLog
from gpud.jobs.api import run_end
from gpud.jobs.ends import EndCause, RunEnd
from gpud.jobs.placement import DeviceLoad, user_name
from gpud.jobs.registry import JobKind, JobSpec
from gpud.jobs.service import JobService, NotPlacedOn, RunRequest
from gpud.mps.api import MpsServicer
from gpud.mps.manager import MpsManager, targets_from_snapshot
from gpud.mps.procs import runs, stat_fields
from gpud.shared import is_about
from gpud.store import StateStore
from gpud.telemetry.reader import placeholder_identity
from gpud.telemetry.sampler import NOT_ANSWERING, critical_xid_reason
from gpud.telemetry.snapshot import CriticalXid, GpuSample, SeenIdentity
from gpud.v1 import jobs_pb2, mps_pb2
from gpud.v1 import queue_pb2 as pb_queue
from gpud.v1.queue_pb2 import ListQueueRequest
from tests.unit.mps_support import FAKE_CONTROL, fake_proc, gpu_sample, gpu_uuid, snapshot
from tests.unit.store_support import CountingStore

GIB = 1 << 30


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Node:
    root: Path
    store: StateStore
    mps: MpsManager
    jobs: JobService
    admission: AdmissionService
    clock: Clock
    events: EventLog

    def restart(self) -> Node:
        """A new daemon on the same state directory."""
        self.store.close()
        return make_node(self.root, self.clock)


def make_node(
    root: Path,
    clock: Clock,
    passes: Callable[[Callable[[], None]], Passes] = Inline,
    *,
    store_type: type[StateStore] = StateStore,
    jobs_type: type[JobService] = JobService,
    config: AdmissionConfig | None = None,
    proc_root: Path = Path("/proc"),
    admission_type: type[AdmissionService] = AdmissionService,
    gpus: int = 2,
    mps: bool = False,
    read_stat: Callable[[int, Path], list[str] | None] = stat_fields,
) -> Node:
    store = store_type(root / "state")
    events = EventLog(None)
    manager = MpsManager(store, events, root / "run", FAKE_CONTROL, enabled=mps)
    seen = snapshot(*(gpu_sample(i) for i in range(gpus)))
    if mps:
        # its devices only: placement reads no control daemon, and none is left running
        manager.observe(targets_from_snapshot(seen))
    else:
        manager.reconcile(seen)
    jobs = jobs_type(
        store, events, manager, socket_path=root / "gpud.sock", clock=clock, proc_root=proc_root
    )
    admission = admission_type(
        store,
        jobs,
        manager,
        events,
        config or AdmissionConfig(),
        clock=clock,
        passes=passes,
        proc_root=proc_root,
        read_stat=read_stat,
    )
    return Node(root, store, manager, jobs, admission, clock, events)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = make_node(tmp_path, Clock())
    yield n
    n.store.close()


def whole(job: str, gpus: int = 1, *, holder: int | None = None) -> RunRequest:
    return RunRequest(job=job, gpu_count=gpus, memory_bytes=60 * GIB, holder_pid=holder)


def test_queued_job_survives_a_restart_and_starts_once(node: Node) -> None:
    a = node.jobs.reserve(whole("a", 2)).reservation
    entry = node.admission.enqueue(whole("b"))
    assert entry.position == 1 and entry.entry.state == QUEUED
    node = node.restart()
    (again,) = node.admission.entries()
    assert again.id == entry.entry.id
    node.clock.now += 30.0
    node.jobs.release(a.id)
    node.admission.tick()
    node.admission.tick()
    started = node.admission.view(again.id)
    assert started.entry.state == STARTED and started.reservation is not None
    assert started.env["GPUD_JOB"] == "b"
    assert [r.job for r in node.jobs.reservations.held()] == ["b"]
    history = {h.job: h for h in node.admission.history()}
    assert history["a"].ended_at == 1030.0
    assert history["b"].started_at - history["b"].queued_at == 30.0
    assert history["b"].request_class == "1 GPU 60GiB"


def test_a_queued_jobs_start_names_the_gpus_it_got(node: Node) -> None:
    """``gpuctl events --gpu N`` finds admission.start, which names devices by UUID."""
    a = node.jobs.reserve(whole("a", 2)).reservation
    node.admission.enqueue(whole("b"))
    node.jobs.release(a.id)
    node.admission.tick()
    (event,) = node.events.recent(kind_prefix="admission.start")
    (held,) = node.jobs.reservations.held()
    assert event.fields["devices"] == list(held.devices)
    assert event.fields["gpus"] == node.jobs.gpu_indexes(held.devices) != []
    assert is_about(event.fields, gpu=str(event.fields["gpus"][0]))


def test_runs_that_set_no_limits_spread_over_the_gpus_rather_than_pile_on_the_first(
    node: Node,
) -> None:
    held = [node.jobs.reserve(RunRequest(job=f"j{i}", gpu_count=1)).reservation for i in range(4)]
    gpus = [node.jobs.gpu_indexes(r.devices) for r in held]
    assert sorted(gpus) == [[0], [0], [1], [1]]


def test_a_job_holding_a_gpu_twice_counts_once_there_in_the_preview_and_the_run(
    node: Node,
) -> None:
    # the gate and the reservation's own placement count the jobs on a device, not its
    # reservations: a preview of a run with no known holder names the GPU such a run then
    # gets (with MPS on and a holder, gpuctl env's own PID places its preview for that user:
    # test_gpuctl_env_previews_the_gpu_its_users_run_then_gets_under_mps)
    def reserve(job: str, *, preview: bool = False) -> list[int]:
        launch = node.jobs.reserve(RunRequest(job=job, gpu_count=1), preview=preview)
        return node.jobs.gpu_indexes(launch.reservation.devices)

    assert [reserve("t"), reserve("a"), reserve("t")] == [[0], [1], [0]]
    assert reserve("b", preview=True) == reserve("b")


def test_a_job_that_fits_does_not_jump_the_queue(node: Node) -> None:
    node.jobs.reserve(whole("a"))
    node.admission.enqueue(whole("pair", 2))  # the head: needs both GPUs
    with pytest.raises(ResourceExhausted, match="1 queued job") as refused:
        node.jobs.reserve(whole("c"))  # would fit on GPU 1, which the head waits for
    # gpuctl run prints it after its own "cannot start now: "
    assert (
        str(refused.value)
        == "job 'c' (1 GPU 60GiB) waits behind 1 queued job(s) that need its devices"
    )
    # A request that sets no limits shares and never waits.
    assert node.jobs.reserve(RunRequest(job="d", gpu_count=1)).reservation.devices


def test_thread_shares_are_admitted_up_to_100_percent(node: Node) -> None:
    share = RunRequest(
        job="s", devices=("GPU-00000000-1111-2222-3333-444455556666",), threads_percent=60
    )
    node.jobs.reserve(share)
    with pytest.raises(ResourceExhausted, match="threads"):
        node.jobs.reserve(RunRequest(job="t", devices=share.devices, threads_percent=50))


def test_thread_shares_are_admitted_up_to_100_percent_with_the_queue_off(tmp_path: Path) -> None:
    """``admission.enabled = false`` turns the queue off, not the thread-share check."""
    n = make_node(tmp_path, Clock())
    n.admission.config = AdmissionConfig(enabled=False)
    try:
        share = RunRequest(
            job="s", devices=("GPU-00000000-1111-2222-3333-444455556666",), threads_percent=60
        )
        n.jobs.reserve(share)
        with pytest.raises(
            ResourceExhausted, match="thread shares there would add up to over 100%"
        ):
            n.jobs.reserve(RunRequest(job="t", devices=share.devices, threads_percent=50))
        assert [r.job for r in n.jobs.reservations.held()] == ["s"]
        # elsewhere it starts, and what sets no limits shares as before
        assert n.jobs.reserve(RunRequest(job="t", gpu_count=1, threads_percent=50))
        assert n.jobs.reserve(RunRequest(job="u", devices=share.devices))
    finally:
        n.store.close()


def test_a_refusal_for_want_of_threads_names_the_share_holders_of_each_gpu_once(
    node: Node,
) -> None:
    """GPU 0 holds s's 60 % share, GPU 1 s2's 70 % and z, which sets no share: a run asking
    50 % fits on neither. The refusal names each GPU with the jobs whose shares fill it (not
    z, which takes none of its SMs), and the gate adds no second list of the same holders."""
    node.jobs.reserve(RunRequest("s", devices=(gpu_uuid(0),), threads_percent=60))
    node.jobs.reserve(RunRequest("s2", devices=(gpu_uuid(1),), threads_percent=70))
    node.jobs.reserve(RunRequest("z", devices=(gpu_uuid(1),)))
    with pytest.raises(ResourceExhausted) as refused:
        node.jobs.reserve(RunRequest("t", gpu_count=1, threads_percent=50))
    assert str(refused.value) == (
        f"job 't' asks 50% of the threads of {gpu_uuid(0)} (60% held by s), {gpu_uuid(1)}"
        " (70% held by s2): the MPS thread shares there would add up to over 100%"
    )


def test_a_refusal_for_memory_names_the_gpus_left_out_for_want_of_threads_too(
    node: Node,
) -> None:
    """One GPU wanted: GPU 0 has no room for the run's thread share, GPU 1 no room for its
    memory. The refusal gives GPU 1's memory and GPU 0's thread shares, the run waiting for
    either, and names each holder once."""
    node.jobs.reserve(RunRequest("s", devices=(gpu_uuid(0),), threads_percent=60))
    node.jobs.reserve(RunRequest("m", devices=(gpu_uuid(1),), memory_bytes=60 * GIB))
    with pytest.raises(ResourceExhausted) as refused:
        node.jobs.reserve(RunRequest("t", gpu_count=1, threads_percent=50, memory_bytes=40 * GIB))
    assert str(refused.value) == (
        f"job 't' asks 40GiB on {gpu_uuid(1)} (H100-SXM5-80GB): 60GiB reserved by m of 80GiB,"
        f" 20GiB free; and 50% of the threads of {gpu_uuid(0)} (60% held by s): the MPS"
        " thread shares there would add up to over 100%"
    )


class CountsNoThreads(JobService):
    """A jobs service whose loads leave the thread shares out, so that its placement and
    the admission gate (which counts them from the reservations) disagree."""

    def loads(self) -> dict[str, DeviceLoad]:
        return {
            uuid: replace(load, threads_percent=0, shares=())
            for uuid, load in super().loads().items()
        }


def test_where_the_gate_refuses_a_run_placement_would_place_it_is_logged_as_a_mismatch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """GPU 0 holds a 60 % thread share; a run pinned there asks 50 %. The gate finds no room,
    while a placement that counts no thread shares would put it there: the run is refused
    saying that the two disagree (not guessing at threads), and gpud logs the mismatch."""
    node = make_node(tmp_path, Clock(), jobs_type=CountsNoThreads)
    try:
        node.jobs.reserve(RunRequest("s", devices=(gpu_uuid(0),), threads_percent=60))
        with caplog.at_level(logging.WARNING), pytest.raises(ResourceExhausted) as refused:
            node.jobs.reserve(RunRequest("t", devices=(gpu_uuid(0),), threads_percent=50))
        assert f"placement finds room on {gpu_uuid(0)}" in str(refused.value)
        assert "admission gate and placement disagree" in caplog.text
        assert [r.job for r in node.jobs.reservations.held()] == ["s"]
    finally:
        node.store.close()


def test_gpuctl_env_names_the_gpu_a_run_gets_where_a_run_of_no_known_user_takes_every_thread(
    tmp_path: Path,
) -> None:
    """MPS on, three GPUs: GPU 0 serves alice's run, every thread of GPU 1 is held by a run
    whose user gpud does not know (no holder it can read), GPU 2 is idle. Alice's next run,
    asking a thread share, has no room on GPU 1, so GPU 2 is the last idle GPU it could
    take: it joins GPU 0, and her ``gpuctl env`` preview names GPU 0 too."""
    proc = tmp_path / "proc"
    alice = os.getpid()
    fake_proc(proc, alice, 1000)
    node = make_node(tmp_path, Clock(), proc_root=proc, gpus=3, mps=True)
    try:
        first = RunRequest("a", devices=(gpu_uuid(0),), threads_percent=10, holder_pid=alice)
        node.jobs.reserve(first)
        node.jobs.reserve(RunRequest("u", devices=(gpu_uuid(1),), threads_percent=100))
        node.jobs.add(JobSpec("b", threads_percent=10))
        previewed = node.jobs.env("b", holder_pid=alice)
        run = node.jobs.reserve(RunRequest("b", holder_pid=alice)).reservation
        assert previewed["CUDA_VISIBLE_DEVICES"] == ",".join(run.devices) == gpu_uuid(0)
    finally:
        node.store.close()


# a reservation held: its user (None: unknown), thread share and memory limit
held_runs = st.tuples(
    st.sampled_from((None, 1000, 1001)),
    st.sampled_from((None, 10, 50, 100)),
    st.sampled_from((None, 20 * GIB, 60 * GIB)),
)


@settings(max_examples=60, deadline=None)
@given(
    held=st.lists(st.lists(held_runs, max_size=2), min_size=3, max_size=3),
    user=st.sampled_from((None, 1000, 1001)),
    threads=st.sampled_from((None, 10, 50)),
    memory=st.sampled_from((None, 20 * GIB, 60 * GIB)),
    gpus=st.integers(1, 2),
)
def test_gpuctl_env_previews_the_devices_the_run_then_gets(
    held: list[list[tuple[int | None, int | None, int | None]]],
    user: int | None,
    threads: int | None,
    memory: int | None,
    gpus: int,
) -> None:
    """Whatever three GPUs hold (runs of known and unknown users, with and without thread
    shares and memory limits), ``gpuctl env`` for a user names the devices that user's run
    then gets through the admission gate, or both refuse it for now."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        holders = {1000: os.getpid(), 1001: os.getppid()}
        for uid, pid in holders.items():
            fake_proc(root / "proc", pid, uid)
        node = make_node(root, Clock(), proc_root=root / "proc", gpus=3, mps=True)
        try:
            for gpu, runs in enumerate(held):
                for i, (uid, share, limit) in enumerate(runs):
                    node.jobs.reservations.add(
                        f"h{gpu}{i}",
                        (gpu_uuid(gpu),),
                        threads_percent=share,
                        memory_bytes=limit,
                        client_priority=0,
                        holder_pid=None,
                        holder_uid=uid,
                    )
            spec = JobSpec("b", gpu_count=gpus, threads_percent=threads, memory_bytes=memory)
            node.jobs.add(spec)
            holder = None if user is None else holders[user]
            try:
                previewed: str | None = node.jobs.env("b", holder_pid=holder)[
                    "CUDA_VISIBLE_DEVICES"
                ]
            except ResourceExhausted:
                previewed = None
            try:
                run = node.jobs.reserve(RunRequest("b", holder_pid=holder)).reservation
                placed: str | None = ",".join(run.devices)
            except ResourceExhausted:
                placed = None
            assert previewed == placed
        finally:
            node.store.close()


def test_entries_queued_before_the_queue_was_turned_off_leave_it_and_never_start(
    tmp_path: Path,
) -> None:
    """gpud restarted with ``admission.enabled = false`` on a state directory with queued
    entries: they leave the queue at start, with an event, and their waiting `gpuctl run`
    is told why; none starts when its devices free, and the listing says the queue is off.
    A reload that turns it off does the same at the next pass."""
    from gpud.admission.api import QueueServicer

    n = make_node(tmp_path, Clock())
    a = n.jobs.reserve(whole("a", 2)).reservation
    b = n.admission.enqueue(whole("b")).entry
    n.store.close()
    n = make_node(tmp_path, n.clock, config=AdmissionConfig(enabled=False))
    off, jobs = n.admission, n.jobs
    try:
        assert off.entries() == []
        left = off.view(b.id)
        assert left.entry.state == LEFT
        msg = entry_message(left)
        assert msg.waiting_on == "the admission queue is off (admission.enabled = false)"
        said = [e.message for e in n.events.recent() if e.kind == "admission.leave"]
        assert said == [
            "job b left the queue: the admission queue is off (admission.enabled = false);"
            " nothing was started"
        ]
        jobs.release(a.id)
        off.tick()
        assert [r.job for r in jobs.reservations.held()] == []
        assert off.view(b.id).entry.state == LEFT
        listing = asyncio.run(QueueServicer(off).ListQueue(ListQueueRequest(), None))
        assert listing.off == "the admission queue is off (admission.enabled = false)"
        # on again, then off by a reload: the next pass takes the new entries out
        off.config = AdmissionConfig()
        jobs.reserve(whole("a", 2))
        c = off.enqueue(whole("c")).entry
        assert asyncio.run(QueueServicer(off).ListQueue(ListQueueRequest(), None)).off == ""
        off.config = AdmissionConfig(enabled=False)
        off.tick()
        assert off.view(c.id).entry.state == LEFT and off.entries() == []
    finally:
        n.store.close()


def test_a_full_queue_names_the_job_and_its_limit(tmp_path: Path) -> None:
    n = make_node(tmp_path, Clock(), config=AdmissionConfig(max_queue=1))
    try:
        n.jobs.reserve(whole("a", 2))
        n.admission.enqueue(whole("b"))
        with pytest.raises(ResourceExhausted) as full:
            n.admission.enqueue(whole("c"))
        assert str(full.value) == (
            "job 'c' cannot be queued: the admission queue is full (1 jobs waiting,"
            " admission.max_queue = 1)"
        )
        assert [e.job for e in n.admission.entries()] == ["b"]
    finally:
        n.store.close()


def test_a_waiter_that_dies_leaves_the_queue(node: Node) -> None:
    node.jobs.reserve(whole("a", 2))
    gone = subprocess.Popen(["true"])
    gone.wait()
    entry = node.admission.enqueue(whole("b", holder=gone.pid))
    node.admission.tick()
    assert node.admission.view(entry.entry.id).entry.state == LEFT
    assert node.admission.entries() == []


def test_a_second_leave_of_an_entry_whose_gpuctl_run_died_says_its_holder_is_gone(
    node: Node,
) -> None:
    """A `gpuctl run` killed with SIGKILL leaves its entry to gpud's next pass, which took it
    out saying nothing of why: `gpuctl queue --leave ID` then said a bare "it left it
    already, 4 s ago". It names the holder gone, as the event does; so for an entry that
    `gpuctl jobs rm --force` took out."""
    node.jobs.reserve(whole("a", 2))
    gone = subprocess.Popen(["true"])
    gone.wait()
    entry = node.admission.enqueue(whole("b", holder=gone.pid)).entry.id
    removed = node.admission.enqueue(whole("c")).entry.id
    node.admission.tick()
    node.jobs.remove("c", force=True)
    node.clock.now += 4.0
    with pytest.raises(FailedPrecondition) as again:
        node.admission.leave(entry)
    assert str(again.value) == (
        f"job b ({entry}) did not leave the queue: it left it already, 4 s ago: holder pid"
        f" {gone.pid} is gone"
    )
    with pytest.raises(FailedPrecondition, match=r"4 s ago: the job was removed \(gpuctl jobs"):
        node.admission.leave(removed)


def test_a_holder_pid_no_process_can_have_leaves_the_queue_and_ticks_go_on(node: Node) -> None:
    # Kept from before the API bounded holder PIDs: os.kill(2**32 - 1, 0) raises
    # OverflowError, which used to fail every admission and jobs tick.
    node.jobs.reserve(whole("a", 2, holder=2**32 - 1))
    entry = node.admission.enqueue(whole("b", holder=2**31))
    node.jobs.tick(None)
    node.admission.tick()
    assert node.jobs.reservations.held() == []
    assert node.admission.view(entry.entry.id).entry.state == LEFT


def test_the_api_refuses_a_holder_pid_out_of_range() -> None:
    for pid in (0, 2**22 + 1, 2**31, 2**32 - 1):
        with pytest.raises(
            InvalidArgument, match=rf"^holder_pid: must be a PID in 1\.\.4194304, got {pid}$"
        ):
            run_request(jobs_pb2.ReserveRequest(job="a", gpu_count=1, holder_pid=pid))
    assert run_request(jobs_pb2.ReserveRequest(job="a", holder_pid=2**22)).holder_pid == 2**22


def test_unfeasible_requests_say_why(node: Node) -> None:
    with pytest.raises(FailedPrecondition, match="3 whole GPUs"):
        node.admission.enqueue(whole("big", 3))
    kept = node.admission.enqueue(whole("big", 3), keep_unfeasible=True)
    assert kept.unfeasible is not None and "3 whole GPUs" in kept.unfeasible.reason
    assert node.admission.queue_views()[-1].unfeasible is not None
    assert node.jobs.reserve(whole("ok")).reservation.devices  # it blocks nothing


def test_a_refused_request_leaves_no_job_registered(node: Node) -> None:
    """Whatever refused it (the node, the queue, a taken GPU), a new job is not kept with
    the placement every later run of it would inherit."""
    node.jobs.reserve(whole("a", 2))
    with pytest.raises(FailedPrecondition, match="3 whole GPUs"):
        node.admission.enqueue(whole("big", 3))
    with pytest.raises(ResourceExhausted, match="asks 60GiB"):
        node.jobs.reserve(whole("late"))
    assert [j.name for j in node.jobs.registry.all()] == ["a"]
    # queued: registered with the entry, as before
    assert node.admission.enqueue(whole("late")).entry.state == QUEUED
    assert [j.name for j in node.jobs.registry.all()] == ["a", "late"]
    # a job registered before stays registered when a run of it is refused
    with pytest.raises(ResourceExhausted):
        node.jobs.reserve(whole("late"))
    assert [j.name for j in node.jobs.registry.all()] == ["a", "late"]


def test_leave_takes_an_entry_out(node: Node) -> None:
    node.jobs.reserve(whole("a", 2))
    entry = node.admission.enqueue(whole("b"))
    assert node.admission.leave(entry.entry.id).entry.state == LEFT
    assert node.admission.queue_views() == []


def test_a_run_that_leaves_as_it_stops_is_said_in_the_event(node: Node) -> None:
    """The queue's own `gpuctl run`, stopped, leaves saying by what signal."""
    node.jobs.reserve(whole("a", 2))
    entry = node.admission.enqueue(whole("b"))
    assert node.admission.leave(entry.entry.id, stopped_by="SIGHUP").entry.state == LEFT
    (event,) = node.admission._events.recent(kind_prefix="admission.leave")
    assert event.message == "job b left the queue: its gpuctl run was stopped (SIGHUP)"


def test_a_leave_of_an_entry_that_left_says_who_took_it_out(tmp_path: Path) -> None:
    """An entry kept no word of who took it out: a second leave said it left already, not
    whether an operator or its stopped run took it out. It says which, after a restart too."""
    node = make_node(tmp_path, Clock())
    node.jobs.reserve(whole("a", 2))
    stopped = node.admission.enqueue(whole("b")).entry
    node.admission.leave(stopped.id, stopped_by="SIGTERM")
    node = node.restart()
    try:
        node.clock.now += 3.0
        with pytest.raises(FailedPrecondition) as err:
            node.admission.leave(stopped.id)
        assert str(err.value) == (
            f"job b ({stopped.id}) did not leave the queue: it left it already, 3 s ago: its"
            " gpuctl run was stopped (SIGTERM)"
        )
        assert node.admission.entry(stopped.id).left_by == "its gpuctl run was stopped (SIGTERM)"
    finally:
        node.store.close()


def test_an_operators_leave_of_an_entry_no_longer_queued_is_refused_saying_what_it_is(
    node: Node,
) -> None:
    """Any client's leave (not only a recent gpuctl's) of an entry that started, whose run
    ended, or that left already takes nothing out: refused, naming what the entry is now,
    with no event and no state changed."""
    a = node.jobs.reserve(whole("a", 2)).reservation
    b = node.admission.enqueue(whole("b")).entry
    c = node.admission.enqueue(whole("c")).entry
    node.admission.leave(c.id)
    node.jobs.release(a.id)
    node.admission.tick()
    (started,) = node.jobs.reservations.held()
    node.clock.now += 42.0
    said = node.admission._events.recent(kind_prefix="admission")
    with pytest.raises(FailedPrecondition) as err:
        node.admission.leave(b.id)
    assert str(err.value) == (
        f"job b ({b.id}) did not leave the queue: it had started (reservation {started.id} on"
        f" {started.devices[0]}): stop its gpuctl run, or gpuctl jobs rm --force b"
    )
    assert [r.id for r in node.jobs.reservations.held()] == [started.id]
    with pytest.raises(FailedPrecondition, match=f"job c \\({c.id}\\) did not leave the queue: "):
        node.admission.leave(c.id)
    with pytest.raises(FailedPrecondition) as err:
        node.admission.leave(c.id)
    assert str(err.value).endswith(
        ": it left it already, 42 s ago: gpuctl queue --leave took it out"
    )
    node.jobs.release(started.id)
    with pytest.raises(FailedPrecondition) as err:
        node.admission.leave(b.id)
    assert str(err.value) == (
        f"job b ({b.id}) did not leave the queue: it had started, and its run has ended"
        " (gpuctl jobs history)"
    )
    assert node.admission._events.recent(kind_prefix="admission") == said
    assert node.admission.entry(c.id).state == LEFT


def test_a_stopped_run_leaving_as_its_entry_started_is_answered_its_reservation(
    node: Node,
) -> None:
    """Its gpuctl run releases the reservation it is answered: not refused."""
    a = node.jobs.reserve(whole("a", 2)).reservation
    b = node.admission.enqueue(whole("b")).entry
    node.jobs.release(a.id)
    node.admission.tick()
    (started,) = node.jobs.reservations.held()
    view = node.admission.leave(b.id, stopped_by="SIGINT")
    assert view.entry.state == STARTED
    assert view.reservation is not None and view.reservation.id == started.id


def test_admission_config_is_range_checked() -> None:
    with pytest.raises(ConfigError, match=r"admission.history_window_s: 1.0 is out of range"):
        from_dict({"admission": {"history_window_s": 1}})
    with pytest.raises(ConfigError, match=r"admission\.max_queue"):
        from_dict({"admission": {"max_queue": 0}})
    assert from_dict({"admission": {"backfill": False}}).admission.backfill is False


def test_with_admission_off_reservations_work_as_before(node: Node) -> None:
    node.admission.config = AdmissionConfig(enabled=False)
    node.jobs.reserve(whole("a", 2))
    with pytest.raises(FailedPrecondition, match="admission queue is off"):
        node.admission.enqueue(whole("b"))
    with pytest.raises(ResourceExhausted, match="reserved by a"):
        node.jobs.reserve(whole("c"))  # the reservation's own refusal, with the numbers


class _HoldEndsAfterARead(JobService):
    """A jobs service where a MIG apply's hold of the GPUs ends just after ``after_read``
    is set and the GPUs left out are next read (the apply's last step ending meanwhile)."""

    after_read: Callable[[], None] | None = None

    def unhealthy(self) -> NotPlacedOn:
        sick = super().unhealthy()
        end, self.after_read = self.after_read, None
        if end is not None:
            end()
        return sick


def test_a_queued_job_waiting_on_gpus_an_apply_holds_calls_them_held_as_read(
    tmp_path: Path,
) -> None:
    """A MIG apply holds both GPUs and its hold ends while the queue is listed: the
    queued job's WHY NOT calls them held, as they were when read, never unhealthy."""
    node = make_node(tmp_path, Clock(), jobs_type=_HoldEndsAfterARead)
    jobs = node.jobs
    assert isinstance(jobs, _HoldEndsAfterARead)
    why = "a MIG apply of all-1g.10gb is changing its instances"
    try:
        with contextlib.ExitStack() as hold:
            hold.enter_context(jobs.placing_none_on({0: why, 1: why}))
            entry = node.admission.enqueue(whole("b"))
            jobs.after_read = hold.close
            (view,) = node.admission.queue_views()
        assert view.entry.id == entry.entry.id
        assert view.waiting_on == f"GPU 0 held: {why}; GPU 1 held: {why}"
    finally:
        node.store.close()


def test_a_job_that_waits_for_a_lost_gpu_is_quoted_no_wait(node: Node) -> None:
    """Two GPUs, one lost: a job asking both can start only once it answers again, which
    no run time in the history says anything of. It was quoted a finite wait all the same
    (`gpuctl run` said `expected wait 1m 31s`, and the history kept it as its quote); it
    gets none, and says which GPUs it waits for (``unhealthy``)."""
    for _ in range(3):  # a history of the class, so that a quote could be made
        run = node.jobs.reserve(whole("pair", 2)).reservation
        node.clock.now += 30.0
        node.jobs.release(run.id)
        node.clock.now += 30.0
    lost = gpu_sample(1)._replace(healthy=False, reason="GPU lost (memory)")
    node.jobs.tick(snapshot(gpu_sample(0), lost))
    entry = node.admission.enqueue(whole("pair", 2))
    view = node.admission.view(entry.entry.id)
    assert view.entry.state == QUEUED
    assert view.quote_s is None and view.overdue == ()
    assert view.unhealthy == "GPU 1 unhealthy: GPU lost (memory)"
    assert view.waiting_on == view.unhealthy
    (listed,) = node.admission.queue_views()
    assert listed.quote_s is None and listed.unhealthy == view.unhealthy
    said = entry_message(view)
    assert said.unhealthy == view.unhealthy and not said.HasField("quote_seconds")
    assert queued_line(said).endswith(
        "position 1, no wait can be quoted: it waits for its GPUs to answer again"
        " (GPU 1 unhealthy: GPU lost (memory))"
    )
    assert quote_text(said) == "no quote"
    assert view.entry.quote_s is None  # what its history row would keep as quoted
    node.admission.leave(entry.entry.id)
    # once it answers again, a wait is quoted
    node.jobs.tick(snapshot(gpu_sample(0), gpu_sample(1)))
    a = node.jobs.reserve(whole("a")).reservation
    again = node.admission.enqueue(whole("pair", 2))
    assert again.unhealthy == "" and again.quote_s is not None
    node.jobs.release(a.id)


def test_a_queued_job_waits_for_an_unhealthy_gpu_to_answer(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """GPU 0 holds a job; GPU 1 is lost: the queued job does not start on it, nor does a
    new one, and it starts once the GPU answers again."""
    a = node.jobs.reserve(whole("a")).reservation
    lost = gpu_sample(1)._replace(healthy=False, reason="GPU lost (memory)")
    node.jobs.tick(snapshot(gpu_sample(0), lost))
    with pytest.raises(ResourceExhausted):
        node.jobs.reserve(whole("b"))
    entry = node.admission.enqueue(whole("b"))
    node.admission.tick()
    waiting = node.admission.view(entry.entry.id)
    # GPU 0 may free up: what holds it, and the GPU left out
    assert waiting.entry.state == QUEUED and "60GiB reserved by a" in waiting.waiting_on
    assert waiting.waiting_on.endswith("(GPU 1 unhealthy: GPU lost (memory))")
    hung = gpu_sample(0)._replace(healthy=False, reason="driver call timed out")
    node.jobs.tick(snapshot(hung, lost))
    both = node.admission.view(entry.entry.id).waiting_on
    assert both == "GPU 0 unhealthy: driver call timed out; GPU 1 unhealthy: GPU lost (memory)"
    # a request that sets no limits waits as well, and no start is tried on a sick GPU
    free = node.admission.enqueue(RunRequest(job="free", gpu_count=1))
    with caplog.at_level(logging.WARNING):
        node.admission.tick()
    assert node.admission.view(free.entry.id).entry.state == QUEUED
    assert "could not start" not in caplog.text
    node.admission.leave(free.entry.id)
    node.jobs.tick(snapshot(gpu_sample(0), lost))
    node.jobs.tick(snapshot(gpu_sample(0), gpu_sample(1)))
    node.admission.tick()
    started = node.admission.view(entry.entry.id)
    assert started.entry.state == STARTED and started.reservation is not None
    assert started.reservation.devices != a.devices


def test_a_queued_job_that_can_get_no_dscp_tag_says_so_and_starts_when_one_frees(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    tags: dict[str, int] = {}
    pool = [10]

    def tag_of(job: str) -> int:
        if job not in tags:
            if not pool:
                raise ResourceExhausted(
                    f"job {job!r}: all 1 DSCP tags of traffic.dscp_pool are in use"
                )
            tags[job] = pool.pop()
        return tags[job]

    caplog.set_level(logging.DEBUG, logger="gpud.admission.service")
    node.jobs.set_tagger(tag_of, tags.get)
    a = node.jobs.reserve(whole("a", 2)).reservation
    entry = node.admission.enqueue(whole("b"))
    node.jobs.release(a.id)  # a pass at once, then two ticks
    for _ in range(2):
        node.admission.tick()
    waiting = node.admission.view(entry.entry.id)
    assert waiting.entry.state == QUEUED and node.jobs.reservations.held() == []
    assert (
        waiting.waiting_on
        == "could not start: job 'b': all 1 DSCP tags of traffic.dscp_pool are in use"
    )
    said = [r.levelname for r in caplog.records if "could not start" in r.getMessage()]
    assert said == ["WARNING", "DEBUG", "DEBUG"]  # tried every pass, said once
    pool.append(tags.pop("a"))  # a's tag frees
    node.admission.tick()
    started = node.admission.view(entry.entry.id)
    assert started.entry.state == STARTED and started.env["GPUD_DSCP"] == "10"


class FailsAdmittedOnce(JobService):
    """Its next start from the queue fails, as one does when the GPU it was placed on is
    lost between the pass and the reservation."""

    failures = 0

    def reserve(self, request: RunRequest, **kwargs: Any) -> Any:
        if kwargs.get("admitted") and FailsAdmittedOnce.failures:
            FailsAdmittedOnce.failures -= 1
            raise FailedPrecondition("GPU 1 unhealthy: GPU lost (memory)")
        return super().reserve(request, **kwargs)


def fail_a_start_then_take_its_gpu(node: Node) -> tuple[str, str]:
    """Queued job c is placed on GPU 1 and its start fails (the GPU lost as it started);
    then d takes GPU 1, started as the queue starts one. c's entry id and d's reservation
    id."""
    node.jobs.reserve(whole("a"))
    b = node.jobs.reserve(whole("b")).reservation
    entry = node.admission.enqueue(whole("c")).entry
    FailsAdmittedOnce.failures = 1
    node.jobs.release(b.id)  # the pass places c on GPU 1, and its start fails
    assert node.admission.view(entry.id).waiting_on == (
        "could not start: GPU 1 unhealthy: GPU lost (memory)"
    )
    d = node.jobs.reserve(whole("d"), admitted=True).reservation
    node.admission.tick()
    return entry.id, d.id


def test_a_failed_start_is_no_longer_said_once_the_entry_waits_for_something_else(
    tmp_path: Path,
) -> None:
    """A queued job's start failed (its GPU was lost as it started); then another job took
    that GPU. `gpuctl queue` went on saying `could not start: GPU 1 unhealthy` for as long as
    it waited; it says what holds its devices now."""
    node = make_node(tmp_path, Clock(), jobs_type=FailsAdmittedOnce)
    try:
        entry, _ = fail_a_start_then_take_its_gpu(node)
        waiting = node.admission.view(entry).waiting_on
        assert "could not start" not in waiting and "reserved by" in waiting
    finally:
        FailsAdmittedOnce.failures = 0
        node.store.close()


def test_a_start_that_fails_again_for_the_same_reason_as_its_gpu_flaps_is_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A queued job's start fails, it then waits for another job on that GPU, and its start
    fails again for the same reason once that job ends: the WARNING is said once for the
    entry and reason, the later tries at DEBUG."""
    caplog.set_level(logging.DEBUG, logger="gpud.admission.service")
    node = make_node(tmp_path, Clock(), jobs_type=FailsAdmittedOnce)
    try:
        entry, d = fail_a_start_then_take_its_gpu(node)
        FailsAdmittedOnce.failures = 1
        node.jobs.release(d)  # c is placed there again, and fails the same way
        assert node.admission.view(entry).waiting_on == (
            "could not start: GPU 1 unhealthy: GPU lost (memory)"
        )
        said = [r.levelname for r in caplog.records if "could not start" in r.getMessage()]
        assert said == ["WARNING", "DEBUG"]
    finally:
        FailsAdmittedOnce.failures = 0
        node.store.close()


def store_once(node: Node) -> None:
    """What `gpuctl mps set` does next while it holds the MPS manager's lock."""
    with node.store.transaction():
        pass


def hold_up_reserve(node: Node) -> tuple[threading.Event, threading.Event]:
    """Reservations wait, once ``reserving`` is set, until ``go`` is."""
    reserving, go = threading.Event(), threading.Event()
    reserve = node.jobs.reserve

    def held_up(request: RunRequest, **kwargs: Any) -> Any:
        reserving.set()
        go.wait(10)
        return reserve(request, **kwargs)

    node.jobs.reserve = held_up  # type: ignore[method-assign]
    return reserving, go


def test_a_queued_job_starts_without_holding_the_store_while_it_reserves(node: Node) -> None:
    """The reservation asks the MPS manager, whose lock comes before the store's
    (`gpuctl mps set` takes it, then the store): a start that held the store meanwhile
    deadlocked with it, and with every API call after them. The start the release
    itself runs holds no store either: the release's transaction has ended by then."""
    a = node.jobs.reserve(whole("a", 2)).reservation
    entry = node.admission.enqueue(whole("b"))
    reserving, go = hold_up_reserve(node)
    tick = threading.Thread(target=node.jobs.release, args=(a.id,), daemon=True)
    tick.start()
    try:
        assert reserving.wait(10)
        other = threading.Thread(target=store_once, args=(node,), daemon=True)
        other.start()
        other.join(5)
        assert not other.is_alive(), "the store was held while the queued job reserved"
    finally:
        go.set()
        tick.join(10)
    started = node.admission.view(entry.entry.id)
    assert started.entry.state == STARTED and started.reservation is not None
    assert [r.job for r in node.jobs.reservations.held()] == ["b"]


@pytest.mark.parametrize("busy", [False, True])
def test_a_request_no_device_can_hold_is_refused_as_never_fitting(node: Node, busy: bool) -> None:
    # `gpuctl run --no-wait` reserves at once: a request more
    # than any GPU holds was refused as taken for now (exit 7, "try again later"), with the
    # numbers of whatever GPU happened to be busiest, where queueing it says it never fits.
    if busy:
        node.jobs.reserve(whole("a"))
    big = RunRequest(job="big", gpu_count=1, memory_bytes=2**62)
    with pytest.raises(FailedPrecondition, match="can never start on this node as it is"):
        node.jobs.reserve(big)
    node.admission.config = AdmissionConfig(enabled=False)
    with pytest.raises(FailedPrecondition, match="0 of them have that much"):
        node.jobs.reserve(big)
    assert [r.job for r in node.jobs.reservations.held()] == (["a"] if busy else [])


@pytest.mark.parametrize("busy", [False, True])
def test_the_env_of_a_job_no_device_can_hold_is_refused_as_never_fitting(
    node: Node, busy: bool
) -> None:
    # `gpuctl env --job big` (a preview: nothing reserved) answered exit 7, "try again
    # later", with the numbers of one GPU, for a job that can never start here.
    if busy:
        node.jobs.reserve(whole("a"))
    node.jobs.add(JobSpec(name="big", kind=JobKind.TRAINING, memory_bytes=2**62))
    with pytest.raises(FailedPrecondition, match="can never start on this node as it is"):
        node.jobs.env("big")
    node.admission.config = AdmissionConfig(enabled=False)
    with pytest.raises(FailedPrecondition, match="can never start on this node as it is"):
        node.jobs.env("big")
    assert [r.job for r in node.jobs.reservations.held()] == (["a"] if busy else [])


def test_a_run_without_memory_holds_each_devices_own_mps_default(node: Node) -> None:
    """A reservation that sets no memory limit gets each device's MPS default limit there
    (``set_default_device_pinned_mem_limit`` per daemon), so it holds that much on each."""
    first, second = (t.uuid for t in node.mps.targets())
    node.mps.set_limits(first, memory_bytes=70 * GIB)
    node.mps.set_limits(second, memory_bytes=10 * GIB)
    node.jobs.reserve(RunRequest(job="pair", gpu_count=2))
    held = {
        uuid: h.per_device.memory
        for h in node.admission.holdings()
        if not h.job.startswith(("unhealthy:", "unreserved:"))
        for uuid in h.devices
    }
    assert held == {first: 70 * GIB, second: 10 * GIB}
    # 60 GiB fits beside the 10 GiB default, not beside the 70 GiB one
    assert node.jobs.reserve(whole("c")).reservation.devices == (second,)


def test_runs_without_memory_ask_for_the_mps_default_and_never_over_commit(
    node: Node,
) -> None:
    """``gpuctl mps set --memory 60GiB`` on both 80 GiB GPUs: a run that sets no memory
    limit is pinned to 60 GiB there, so it asks for 60 GiB: two fit, a third waits (exit 7,
    not 6), with the numbers, and starts once one ends."""
    first, second = (t.uuid for t in node.mps.targets())
    for uuid in (first, second):
        node.mps.set_limits(uuid, memory_bytes=60 * GIB)
    a = node.jobs.reserve(RunRequest(job="a")).reservation
    b = node.jobs.reserve(RunRequest(job="b")).reservation
    assert {a.devices, b.devices} == {(first,), (second,)}
    with pytest.raises(ResourceExhausted) as refused:
        node.jobs.reserve(RunRequest(job="c"))
    assert str(refused.value) == (
        f"job 'c' asks 60GiB (its MPS default memory limit) on {first} (H100-SXM5-80GB):"
        " 60GiB reserved by a of 80GiB, 20GiB free; GPU 0 held by a, GPU 1 held by b"
    )
    loads = node.jobs.loads()
    assert {u: load.memory_bytes for u, load in loads.items()} == {
        first: 60 * GIB,
        second: 60 * GIB,
    }
    # gpuctl env for a job that holds nothing: where it would go now, refused as taken
    node.jobs.add(JobSpec(name="e", kind=JobKind.TRAINING))
    with pytest.raises(ResourceExhausted, match="asks 60GiB"):
        node.jobs.env("e")
    # queued, quotable: the class packs one a GPU, by memory
    view = node.admission.enqueue(RunRequest(job="c"))
    assert view.unfeasible is None and view.entry.state == QUEUED
    (queued,) = node.admission.queue_views()
    assert "asks 60GiB (its MPS default memory limit)" in queued.waiting_on
    (cls,) = [v for v in node.admission.explain() if v.key == "1 GPU"]
    assert cls.packing is not None and cls.packing.k_eff == 2
    node.jobs.release(a.id)
    node.admission.tick()
    assert node.admission.entry(view.entry.id).state == STARTED
    # a request with its own limit asks that, not the default
    with pytest.raises(ResourceExhausted, match="asks 30GiB on"):
        node.jobs.reserve(RunRequest(job="d", memory_bytes=30 * GIB))
    assert node.jobs.reserve(RunRequest(job="d", memory_bytes=20 * GIB)).reservation


def test_each_device_asks_its_own_default_and_no_default_never_waits(node: Node) -> None:
    first, second = (t.uuid for t in node.mps.targets())
    node.mps.set_limits(first, memory_bytes=70 * GIB)
    node.jobs.reserve(RunRequest(job="a", devices=(first,)))
    # the pair asks 70 GiB on the first GPU (20 free) and nothing on the second
    with pytest.raises(ResourceExhausted, match=f"asks 70GiB .* on {first}"):
        node.jobs.reserve(RunRequest(job="pair", gpu_count=2))
    for job in ("x", "y", "z"):  # no default there: shares, as MPS clients do
        assert node.jobs.reserve(RunRequest(job=job, devices=(second,))).reservation


def mps_api(node: Node) -> Callable[[int | None], None]:
    """``gpuctl mps set --gpu 0 --memory LIMIT`` (None: ``--clear-memory``)."""
    api = MpsServicer(node.mps, loads=node.jobs.loads, placement=node.jobs.locked)

    def set_memory(limit: int | None) -> None:
        request = mps_pb2.SetMpsLimitsRequest(device="0")
        if limit is None:
            request.clear_memory = True
        else:
            request.memory_limit_bytes = limit
        api._set(request)

    return set_memory


def test_a_run_without_a_limit_counts_the_default_it_started_with(node: Node) -> None:
    """A run that sets no memory limit is counted at the MPS default in force when it
    reserved (its MPS client keeps that limit) until it ends: ``gpuctl mps set --memory``
    raising, setting, lowering or clearing the default later changes what the next run
    asks, not what the running ones hold. A higher one must fit beside what is held."""
    first = node.mps.targets()[0].uuid
    set_memory = mps_api(node)

    def held() -> int:
        return node.jobs.loads()[first].memory_bytes

    a = node.jobs.reserve(RunRequest(job="a", devices=("0",))).reservation
    b = node.jobs.reserve(RunRequest(job="b", devices=("0",))).reservation
    assert a.defaults == () and held() == 0  # no default then: their clients have no limit
    # counted at 60 GiB each, as before, this was refused (2 x 60 on 80); they hold nothing
    set_memory(60 * GIB)
    assert held() == 0
    c = node.jobs.reserve(RunRequest(job="c", devices=("0",))).reservation
    assert c.defaults == ((first, 60 * GIB),) and held() == 60 * GIB
    set_memory(20 * GIB)  # lowered under c: c keeps (and is counted at) 60 GiB
    assert held() == 60 * GIB
    with pytest.raises(ResourceExhausted) as refused:
        set_memory(30 * GIB)  # raised: a run without a limit would not fit beside c
    assert str(refused.value) == (
        f"{first}: default limit 30GiB + reserved by jobs 60GiB = 90GiB exceeds the device's 80GiB"
    )
    d = node.jobs.reserve(RunRequest(job="d", devices=("0",))).reservation
    assert held() == 80 * GIB
    set_memory(10 * GIB)  # lower: never refused for want of room (20 GiB did not fit either)
    with pytest.raises(ResourceExhausted, match=r"asks 10GiB .* 80GiB reserved by a, b, c, d"):
        node.jobs.reserve(RunRequest(job="e", devices=("0",)))
    set_memory(None)  # cleared under c and d: they keep theirs
    assert held() == 80 * GIB
    assert {h.job: h.per_device.memory for h in node.admission.holdings()} == {
        a.id: 0,
        b.id: 0,
        c.id: 60 * GIB,
        d.id: 20 * GIB,
    }
    node.jobs.release(c.id)
    assert held() == 20 * GIB
    for r in (a, b, d):
        node.jobs.release(r.id)
    assert node.mps.limits(first).memory_bytes is None


def test_runs_an_earlier_version_reserved_without_a_limit_follow_the_default(
    node: Node,
) -> None:
    """Reservations saved without the default they started with (by an earlier version)
    load and count the device's default now in force, as they did: the new default counts
    for each of them, and it is never lowered nor cleared under them (their MPS clients
    keep the limit they started with)."""
    first = node.mps.targets()[0].uuid
    set_memory = mps_api(node)
    a = node.jobs.reserve(RunRequest(job="a", devices=("0",))).reservation
    b = node.jobs.reserve(RunRequest(job="b", devices=("0",))).reservation
    with node.store.transaction() as conn:  # as an earlier version saved them
        conn.execute("UPDATE job_reservations SET default_memory = NULL")
    node = node.restart()
    set_memory = mps_api(node)
    assert [r.defaults for r in node.jobs.reservations.held()] == [None, None]
    with pytest.raises(ResourceExhausted) as refused:
        set_memory(60 * GIB)
    assert str(refused.value) == (
        f"{first}: default limit 60GiB x 2 reservation(s) without a memory limit of their own"
        " made before gpud recorded each run's default (a, b) = 120GiB exceeds the device's"
        " 80GiB"
    )
    assert node.mps.limits(first).memory_bytes is None
    set_memory(30 * GIB)
    assert node.jobs.loads()[first].memory_bytes == 60 * GIB
    assert node.jobs.loads()[first].defaulted == ("a", "b")
    c = node.jobs.reserve(RunRequest(job="c", devices=("0",), memory_bytes=10 * GIB))
    with pytest.raises(ResourceExhausted, match=r"\(a, b\) = 80GiB \+ reserved by the others"):
        set_memory(40 * GIB)
    set_memory(35 * GIB)
    with pytest.raises(FailedPrecondition) as lowered:
        set_memory(20 * GIB)
    assert str(lowered.value) == (
        f"{first}: default limit 35GiB held by 2 reservation(s) without a memory limit of"
        " their own made before gpud recorded each run's default (a, b): their MPS clients"
        " keep it, so it can be lowered to 20GiB once they end"
    )
    with pytest.raises(FailedPrecondition, match="so it can be cleared once they end"):
        set_memory(None)
    assert node.mps.limits(first).memory_bytes == 35 * GIB
    for r in (a, b, c.reservation):
        node.jobs.release(r.id)
    set_memory(None)
    assert node.mps.limits(first).memory_bytes is None


def test_requests_show_sizes_as_people_write_them_and_keep_their_history_class(
    node: Node,
) -> None:
    huge = RunRequest(job="huge", gpu_count=1, memory_bytes=1 << 62)
    assert entry_message(node.admission.enqueue(huge, keep_unfeasible=True)).request == (
        "1 GPU 4194304TiB"
    )
    # a request whose class a state database already keeps as "1 GPU 1.5GiB": its runs stay
    # in that class (the quotes are estimated per class), shown in the same units as above
    odd = RunRequest(job="odd", gpu_count=1, memory_bytes=3 * GIB // 2)
    node.jobs.reserve(odd)
    (row,) = [h for h in node.admission.history() if h.job == "odd"]
    assert row.request_class == "1 GPU 1.5GiB"
    assert history_message(row).request == "1 GPU 1536MiB"
    shown = {class_message(v).request for v in node.admission.explain()}
    assert shown == {"1 GPU 4194304TiB", "1 GPU 1536MiB"}


def test_the_history_of_a_queued_run_names_its_job_kind(node: Node) -> None:
    a = node.jobs.reserve(whole("a", 2)).reservation
    node.jobs.add(JobSpec(name="serve", kind=JobKind.INFERENCE, gpu_count=1))
    node.admission.enqueue(RunRequest(job="serve"))  # as gpuctl run asks: no kind of its own
    node.jobs.release(a.id)
    node.admission.tick()
    history = {h.job: history_message(h) for h in node.admission.history()}
    assert history["serve"].placement.kind == jobs_pb2.JOB_KIND_INFERENCE
    assert history["a"].placement.kind == jobs_pb2.JOB_KIND_TRAINING


def test_the_history_says_how_each_run_ended(node: Node) -> None:
    def run(job: str, holder: int | None = None) -> str:
        return node.jobs.reserve(RunRequest(job=job, holder_pid=holder)).reservation.id

    node.jobs.release(run("ok"), RunEnd(EndCause.EXITED, exit_code=0))
    node.jobs.release(run("three"), RunEnd(EndCause.EXITED, exit_code=3))
    node.jobs.release(run("term"), RunEnd(EndCause.EXITED, exit_signal=15))
    node.jobs.release(run("plain"))  # an older gpuctl: no status
    run("rm")
    node.jobs.remove("rm", force=True)
    node.jobs.tick(None)  # gpud's first tick after its start
    gone = subprocess.Popen(["true"])
    gone.wait()
    run("killed", holder=gone.pid)  # its gpuctl is gone without releasing
    node.jobs.tick(None)
    holder = subprocess.Popen(["sleep", "60"])
    run("down", holder=holder.pid)
    node = node.restart()
    holder.kill()  # while gpud is down
    holder.wait()
    node.jobs.tick(None)
    ended = [(h.job, h.exit_code, h.exit_signal, h.end_cause) for h in node.admission.history()]
    assert ended == [
        ("ok", 0, None, "exited"),
        ("three", 3, None, "exited"),
        ("term", None, 15, "exited"),
        ("plain", None, None, "released"),
        ("rm", None, None, "removed"),
        ("killed", None, None, "holder-gone"),
        ("down", None, None, "holder-gone-at-start"),
    ]
    shown = [history_message(h) for h in node.admission.history()]
    assert shown[1].exit_code == 3 and not shown[1].HasField("exit_signal")
    assert shown[2].exit_signal == 15 and not shown[2].HasField("exit_code")
    assert [m.end_cause for m in shown][3:] == [
        "released", "removed", "holder-gone", "holder-gone-at-start"
    ]  # fmt: skip


def test_a_run_removed_while_it_ran_keeps_its_exit_status_beside_the_cause(
    node: Node,
) -> None:
    """`gpuctl jobs rm --force` releases a running job's reservation and the history says
    `removed`; the release its `gpuctl run` sends once the command has exited (SIGTERM)
    adds the command's exit status to that row, once, and is no NotFound. A second one, or
    one of a run that ended otherwise changes nothing."""
    from gpud.errors import NotFound

    def run(job: str) -> str:
        return node.jobs.reserve(RunRequest(job=job)).reservation.id

    def ended(job: str) -> tuple[int | None, int | None, str | None]:
        (h,) = [h for h in node.admission.history() if h.job == job]
        return h.exit_code, h.exit_signal, h.end_cause

    term, plain, done = run("term"), run("plain"), run("done")
    node.jobs.remove("term", force=True)
    node.jobs.remove("plain", force=True)
    node.jobs.release(done, RunEnd(EndCause.EXITED, exit_code=0))
    assert ended("term") == (None, None, "removed")
    assert node.jobs.release(term, RunEnd(EndCause.EXITED, exit_signal=15)) is None
    assert ended("term") == (None, 15, "removed")
    with pytest.raises(NotFound):  # once
        node.jobs.release(term, RunEnd(EndCause.EXITED, exit_code=0))
    with pytest.raises(NotFound):  # not removed: its end is kept already
        node.jobs.release(done, RunEnd(EndCause.EXITED, exit_code=1))
    with pytest.raises(NotFound):
        node.jobs.release("no-such-run", RunEnd(EndCause.EXITED, exit_code=0))
    assert ended("plain") == (None, None, "removed")
    assert ended("done") == (0, None, "exited")
    node = node.restart()  # the row waits in state.db across a restart of gpud
    assert node.jobs.release(plain, RunEnd(EndCause.EXITED, exit_code=3)) is None
    assert ended("plain") == (3, None, "removed")
    shown = {h.job: history_message(h) for h in node.admission.history()}
    assert shown["term"].exit_signal == 15 and shown["term"].end_cause == "removed"


def test_a_removed_run_ends_in_the_history_when_its_command_exits(node: Node) -> None:
    """A run `gpuctl jobs rm --force` removed ends at the removal until its `gpuctl run`
    reports the command's exit: then at that report, which the quotes take for its run
    time; a report with no exit status moves the end as well (no NotFound), once. A run
    that never reports keeps the removal's time."""
    from gpud.errors import NotFound

    def run(job: str) -> str:
        return node.jobs.reserve(RunRequest(job=job)).reservation.id

    def row(job: str) -> HistoryRow:
        (h,) = [h for h in node.admission.history() if h.job == job]
        return h

    term, quiet = run("term"), run("quiet")
    run("never")
    node.clock.now = 1010.0
    for job in ("term", "quiet", "never"):
        node.jobs.remove(job, force=True)
    assert [row(j).ended_at for j in ("term", "quiet", "never")] == [1010.0] * 3
    node.clock.now = 1013.0  # the command exited 3 s after its SIGTERM
    assert node.jobs.release(term, RunEnd(EndCause.EXITED, exit_code=0)) is None
    node.clock.now = 1014.0
    assert node.jobs.release(quiet) is None  # a gpuctl with no status to give
    node.clock.now = 1020.0
    with pytest.raises(NotFound):  # once
        node.jobs.release(quiet)
    with pytest.raises(NotFound):
        node.jobs.release(term, RunEnd(EndCause.EXITED, exit_code=1))
    got = {j: (row(j).ended_at, row(j).exit_code, row(j).end_cause) for j in ("term", "quiet")}
    assert got == {"term": (1013.0, 0, "removed"), "quiet": (1014.0, None, "removed")}
    assert (row("never").ended_at, row("never").end_cause) == (1010.0, "removed")
    assert row("term").record().service_s == 13.0


def test_the_history_export_says_when_a_removed_run_reported_its_exit(node: Node) -> None:
    """`gpuctl jobs history --json` gives ``reported_unix_seconds``: when the `gpuctl run`
    of a removed run reported its command's exit (where its end moved), null for a removed
    run that has not reported and for every other run."""
    from gpud.cli.output import message_to_dict

    term = node.jobs.reserve(RunRequest(job="term")).reservation.id
    node.jobs.reserve(RunRequest(job="never"))
    done = node.jobs.reserve(RunRequest(job="done")).reservation.id
    node.clock.now = 1010.0
    node.jobs.remove("term", force=True)
    node.jobs.remove("never", force=True)
    node.jobs.release(done, RunEnd(EndCause.EXITED, exit_code=0))
    node.clock.now = 1014.0
    node.jobs.release(term, RunEnd(EndCause.EXITED, exit_signal=15, since_end_s=1.0))
    shown = {h.job: message_to_dict(history_message(h)) for h in node.admission.history()}
    reported = {
        job: (r["ended_unix_seconds"], r["reported_unix_seconds"]) for job, r in shown.items()
    }
    assert reported == {"term": (1013.0, 1014.0), "never": (1010.0, None), "done": (1010.0, None)}


def test_a_release_tried_again_through_a_restart_ends_the_run_when_first_tried(
    node: Node,
) -> None:
    """gpud restarts as a run's command exits: its `gpuctl run`, alive and trying again,
    keeps the reservation through gpud's first tick (no holder-gone-at-start), and the
    release that gets through records the exit status and the end at its first try
    (``since_end_s`` before it arrived, never before the run started), once. A release that
    comes after gpud judged its holder gone changes nothing of the end it recorded."""
    from gpud.errors import NotFound

    def row(job: str) -> HistoryRow:
        (h,) = [h for h in node.admission.history() if h.job == job]
        return h

    gpuctl = subprocess.Popen(["sleep", "60"])
    gone = subprocess.Popen(["sleep", "60"])
    try:
        late = node.jobs.reserve(RunRequest(job="late", holder_pid=gpuctl.pid)).reservation.id
        early = node.jobs.reserve(RunRequest(job="early", holder_pid=gpuctl.pid)).reservation.id
        down = node.jobs.reserve(RunRequest(job="down", holder_pid=gone.pid)).reservation.id
        node = node.restart()
        gone.kill()  # its gpuctl gave up (or was killed) while gpud was down
        gone.wait()
        node.clock.now = 1010.0
        node.jobs.tick(None)  # gpud's first tick: the trying gpuctl is alive
        assert [r.id for r in node.jobs.reservations.held()] == [late, early]
        exited = RunEnd(EndCause.EXITED, exit_code=7, since_end_s=4.0)
        assert node.jobs.release(late, exited) is not None
        with pytest.raises(NotFound):  # once: a second try whose first answer was lost
            node.jobs.release(late, exited)
        assert (row("late").ended_at, row("late").exit_code) == (1006.0, 7)
        assert row("late").end_cause == "exited"
        node.jobs.release(early, RunEnd(EndCause.EXITED, exit_code=0, since_end_s=3600.0))
        assert row("early").ended_at == row("early").started_at == 1000.0
        with pytest.raises(NotFound):
            node.jobs.release(down, exited)
        assert (row("down").ended_at, row("down").exit_code) == (1010.0, None)
        assert row("down").end_cause == "holder-gone-at-start"
        # a removed run's end, tried again through a restart, is when it was first tried
        removed = node.jobs.reserve(RunRequest(job="removed")).reservation.id
        node.jobs.remove("removed", force=True)
        node.clock.now = 1030.0
        assert node.jobs.release(removed, replace(exited, since_end_s=5.0)) is None
        assert (row("removed").ended_at, row("removed").exit_code) == (1025.0, 7)
    finally:
        gpuctl.kill()
        gpuctl.wait()


def test_a_release_says_how_the_run_ended_or_nothing(node: Node) -> None:
    def end(**fields: Any) -> RunEnd:
        return run_end(jobs_pb2.ReleaseRequest(reservation_id="r", **fields))

    assert end() == RunEnd(EndCause.RELEASED)  # an older gpuctl
    assert end(exit_code=0) == RunEnd(EndCause.EXITED, exit_code=0)
    assert end(exit_signal=9) == RunEnd(EndCause.EXITED, exit_signal=9)
    # tried again through a gpud restart: how long ago the first try was
    assert end(exit_code=7, since_end_s=2.5) == RunEnd(
        EndCause.EXITED, exit_code=7, since_end_s=2.5
    )
    assert end(since_end_s=1.0) == RunEnd(EndCause.RELEASED, since_end_s=1.0)
    for bad in (
        {"exit_code": 256},
        {"exit_code": -1},
        {"exit_signal": 0},
        {"exit_signal": 65},
        {"since_end_s": -1.0},
        {"since_end_s": float("nan")},
        {"since_end_s": float("inf")},
    ):
        with pytest.raises(InvalidArgument, match=next(iter(bad))):
            end(**bad)
    with pytest.raises(InvalidArgument, match="not both"):
        end(exit_code=1, exit_signal=9)


# job_history as the previous gpud version created it
PREVIOUS_HISTORY = """CREATE TABLE IF NOT EXISTS job_history (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job TEXT NOT NULL,
        reservation TEXT NOT NULL UNIQUE,
        request_class TEXT NOT NULL,
        request TEXT NOT NULL,
        queued_at REAL NOT NULL,
        started_at REAL NOT NULL,
        ended_at REAL,
        quote_s REAL
    )"""


def test_a_history_the_previous_version_wrote_is_kept_and_goes_on(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    with store.transaction() as conn:
        conn.execute(PREVIOUS_HISTORY)
        conn.execute(
            "INSERT INTO job_history (job, reservation, request_class, request, queued_at,"
            " started_at, ended_at) VALUES ('old', 'r0', '1 GPU', ?, 900, 910, 950)",
            (run_request_to_json(RunRequest(job="old", gpu_count=1)),),
        )
    store.close()
    node = make_node(tmp_path, Clock())
    try:
        node.jobs.release(
            node.jobs.reserve(RunRequest(job="new")).reservation.id,
            RunEnd(EndCause.EXITED, exit_code=1),
        )
        old, new = node.admission.history()
        assert (old.job, old.ended_at, old.exit_code, old.end_cause) == ("old", 950, None, None)
        assert (new.job, new.exit_code, new.end_cause) == ("new", 1, "exited")
    finally:
        node.store.close()


def test_the_queue_and_the_history_name_the_user_of_each_run(tmp_path: Path) -> None:
    """A queued entry shows the real UID of its waiting gpuctl run as read when it queued
    (a listing reads no /proc), a run in the history its reservation's; unknown: none."""
    proc = tmp_path / "proc"
    alice, bob = os.getpid(), os.getppid()  # alive, as the queue's holders must be
    fake_proc(proc, alice, 1000)
    fake_proc(proc, bob, 1001)
    node = make_node(tmp_path, Clock(), proc_root=proc)
    try:
        held = node.jobs.reserve(whole("a", 2, holder=alice)).reservation
        node.admission.enqueue(whole("b", holder=bob))
        node.admission.enqueue(whole("c"))  # no holder: no user
        (proc / str(bob) / "status").write_text("Name:\tgpuctl\n")  # no Uid line now
        from gpud.cli.queue import entry_row

        listed = [entry_message(v) for v in node.admission.queue_views()]
        assert [(m.job, m.HasField("holder_uid")) for m in listed] == [("b", True), ("c", False)]
        assert (listed[0].holder_uid, listed[0].holder_user) == (1001, user_name(1001))
        assert [entry_row(m)[3] for m in listed] == [user_name(1001), "-"]
        fake_proc(proc / "again", bob, 1001)
        (proc / str(bob) / "status").write_text((proc / "again" / str(bob) / "status").read_text())
        node.jobs.release(held.id)
        node.admission.tick()
        history = {h.job: history_message(h) for h in node.admission.history()}
        users = {job: (m.holder_uid, m.holder_user) for job, m in history.items()}
        assert users["a"] == (1000, user_name(1000))
        assert users["b"] == (1001, user_name(1001))
        assert not history["c"].HasField("holder_uid") and history["c"].holder_user == ""
    finally:
        node.store.close()


# the queue as the version before its user column declared it
PREVIOUS_QUEUE = SCHEMA[0].replace(",\n        holder_uid INTEGER", "")
assert SCHEMA[0] != PREVIOUS_QUEUE


def test_a_queue_and_history_an_earlier_version_wrote_gain_their_users(tmp_path: Path) -> None:
    """A state.db whose queue and history rows have no user column: they are kept, with no
    user known, and new rows name theirs."""
    store = StateStore(tmp_path / "state")
    with store.transaction() as conn:
        conn.execute(PREVIOUS_HISTORY)
        conn.execute(PREVIOUS_QUEUE)
        conn.execute(
            "INSERT INTO job_history (job, reservation, request_class, request, queued_at,"
            " started_at, ended_at) VALUES ('old', 'r0', '1 GPU', ?, 900, 910, 950)",
            (run_request_to_json(RunRequest(job="old", gpu_count=1)),),
        )
        conn.execute(
            "INSERT INTO admission_queue (id, job, request, enqueued_at, state, changed_at)"
            " VALUES ('e0', 'waits', ?, 990, 'queued', 990)",
            # never fits: it stays queued
            (run_request_to_json(RunRequest(job="waits", gpu_count=1, memory_bytes=1 << 62)),),
        )
    store.close()
    proc = tmp_path / "proc"
    fake_proc(proc, os.getpid(), 1000)
    node = make_node(tmp_path, Clock(), proc_root=proc)
    try:
        new = node.admission.enqueue(whole("new", 2, holder=os.getpid()))
        (waits,) = map(entry_message, node.admission.queue_views())
        assert waits.job == "waits" and not waits.HasField("holder_uid")
        started = entry_message(node.admission.view(new.entry.id))
        assert started.state == pb_queue.ENTRY_STATE_STARTED and started.holder_uid == 1000
        history = {h.job: history_message(h) for h in node.admission.history()}
        assert not history["old"].HasField("holder_uid")
        assert history["new"].holder_uid == 1000
    finally:
        node.store.close()


def test_a_run_released_by_a_gpud_that_kept_no_history_ends_at_start(tmp_path: Path) -> None:
    """A gpud older than the job history (started on the state directory in between, after
    a downgrade) released a run this one recorded as started: the row no longer runs for
    good but ends when gpud finds it so (``unrecorded``); a run still held runs on."""
    node = make_node(tmp_path, Clock())
    held = node.jobs.reserve(whole("held")).reservation
    gone = node.jobs.reserve(whole("gone")).reservation
    clock = node.clock
    node.store.close()
    conn = sqlite3.connect(tmp_path / "state" / "state.db")  # the older gpud's release
    with conn:
        conn.execute("DELETE FROM job_reservations WHERE id = ?", (gone.id,))
    conn.close()
    clock.now += 60
    node = make_node(tmp_path, clock)
    try:
        rows = {h.job: h for h in node.admission.history()}
        assert (rows["gone"].ended_at, rows["gone"].end_cause) == (1060.0, "unrecorded")
        assert (rows["held"].ended_at, rows["held"].end_cause) == (None, None)
        assert [r.id for r in node.jobs.reservations.held()] == [held.id]
    finally:
        node.store.close()


def test_removing_a_queued_job_takes_it_out_of_the_queue(node: Node) -> None:
    """`gpuctl jobs rm` of a job that waits in the queue: without --force it is refused and
    names the entry; with it the entry leaves the queue, so the removed job never starts
    (and is not registered again) when its devices free."""
    a = node.jobs.reserve(whole("a", 2)).reservation
    entry = node.admission.enqueue(whole("b")).entry
    with pytest.raises(FailedPrecondition, match=f"queued \\({entry.id}\\).*--force"):
        node.jobs.remove("b")
    assert node.jobs.registry.find("b") is not None
    assert [e.id for e in node.admission.entries()] == [entry.id]
    node.jobs.remove("b", force=True)
    assert node.admission.entries() == []
    assert node.admission.view(entry.id).entry.state == LEFT
    node.jobs.release(a.id)
    node.admission.tick()
    assert node.jobs.registry.find("b") is None
    assert node.jobs.reservations.held() == []


def test_history_keeps_the_request_as_asked_not_the_co_location_advice(node: Node) -> None:
    """A run that names no place goes where co-location advised, for that run only: its
    history (the quotes' classes, `tools.whatif`'s replay) holds what was asked, one GPU,
    not the advised device, which no other node or replay has."""
    (gpu0, _) = (t.uuid for t in node.mps.targets())
    node.jobs.reserve(RunRequest(job="plain", memory_bytes=20 * GIB))
    advised = RunRequest(
        job="adv", memory_bytes=20 * GIB, advised_devices=(gpu0,), advised_threads_percent=50
    )
    assert node.jobs.reserve(advised).reservation.devices == (gpu0,)
    history = {h.job: h for h in node.admission.history()}
    assert history["adv"].request_class == history["plain"].request_class == "1 GPU 20GiB"
    assert history["adv"].request.devices == () and history["adv"].request.threads_percent is None


def test_a_queued_job_says_what_holds_its_devices(node: Node) -> None:
    """A queued job whose devices never free (a run that never ends, a job using more
    than it reserved) is not left with an empty WHY NOT: it says what holds them, as a
    refused `gpuctl run` does; one that would fit now says which job ahead it may not pass."""
    node.jobs.reserve(whole("a"))
    head = node.admission.enqueue(whole("pair", 2))  # needs both GPUs: a holds one
    assert "60GiB reserved by a" in head.waiting_on
    views = {v.entry.job: v for v in node.admission.queue_views()}
    assert "60GiB reserved by a" in views["pair"].waiting_on
    node.admission.enqueue(RunRequest(job="c", gpu_count=1, memory_bytes=30 * GIB))
    views = {v.entry.job: v for v in node.admission.queue_views()}
    assert views["c"].position == 2  # it fits on GPU 1, which the head waits for
    assert views["c"].waiting_on == f"behind pair ({head.entry.id})"


def runs_of_a_then_one_more(node: Node) -> None:
    """Three 2 s runs of job a on both GPUs, 6 s apart, then a fourth that holds them."""
    for _ in range(3):
        ran = node.jobs.reserve(whole("a", 2)).reservation
        node.clock.now += 2.0
        node.jobs.release(ran.id)
        node.clock.now += 6.0
    node.jobs.reserve(whole("a", 2))


def test_a_blocker_past_its_estimate_is_said_instead_of_a_short_quote(node: Node) -> None:
    """The run holding the devices has run 5 s where its job's runs took 2 s: the queued
    job is not told "expected wait 2.0 s" (the model's figure, which the run disproves) but
    that the run is past its estimate; while it is within it, the quote is at least what it
    is expected to run still."""
    runs_of_a_then_one_more(node)
    node.clock.now += 1.0
    entry = node.admission.enqueue(whole("b", 2))
    assert entry.overdue == () and entry.quote_s is not None and entry.quote_s >= 1.0
    node.clock.now += 4.0
    (view,) = node.admission.queue_views()
    assert view.quote_s is None
    assert [(r.job, r.ran_s, r.estimate_s) for r in view.overdue] == [("a", 5.0, 2.0)]
    msg = entry_message(view)
    assert not msg.HasField("quote_seconds") and not msg.unbounded
    assert [(r.job, r.ran_seconds, r.estimate_seconds) for r in msg.overdue] == [("a", 5.0, 2.0)]
    from gpud.cli.jobs import queued_line
    from gpud.cli.queue import entry_row

    assert queued_line(msg).endswith(
        "position 1, no wait can be quoted: what holds its devices has run past its"
        " estimate: a (estimated 2.0 s)"
    )
    row = entry_row(msg)
    assert row[6] == "overdue" and row[7].endswith(
        "; past the estimate: a ran 5.0 s, estimated 2.0 s"
    )


def test_a_class_with_no_runs_is_quoted_from_what_loads_its_devices(node: Node) -> None:
    """A request queued for the first time (its class has no run in the history) waits
    on devices whose runs have history: it is quoted the wait of its servers under their
    load, and no less than what holds them is expected to run still, not "no history"."""
    runs_of_a_then_one_more(node)
    node.clock.now += 0.5
    new = RunRequest(job="b", gpu_count=2, memory_bytes=50 * GIB)  # 2 GPU 50GiB: no history
    entry = node.admission.enqueue(new)
    assert entry.overdue == () and entry.quote_s is not None
    assert 1.5 <= entry.quote_s < 60.0  # a's class runs 2 s, 1.5 s of it left
    (view,) = node.admission.queue_views()
    assert view.quote_s is not None and view.quote_s >= 1.5
    explained = {v.key: v for v in node.admission.explain()}
    assert explained["2 GPU 50GiB"].quote is not None
    # the class with history is quoted as before, whatever waits beside it
    same = explained["2 GPU 60GiB"].quote
    assert same is not None and explained["2 GPU 50GiB"].quote.wait_s >= same.wait_s


def test_a_class_with_no_runs_on_devices_nothing_known_loads_has_no_quote(node: Node) -> None:
    """Where no class with history shares its devices (what holds them has no history
    either), nothing is known of when they free: no quote, rather than a wait of 0."""
    node.jobs.reserve(whole("a", 2))
    node.clock.now += 5.0
    entry = node.admission.enqueue(RunRequest(job="b", gpu_count=2, memory_bytes=50 * GIB))
    assert entry.quote_s is None and entry.overdue == ()


class CountingJobs(JobService):
    """The job service, counting the placements asked of it."""

    chosen = 0

    def choose(
        self, spec: JobSpec, now: Any = None, *, uid: int | None = None, sick: Any = None
    ) -> Any:
        self.chosen += 1
        return super().choose(spec, now, uid=uid, sick=sick)


def test_a_listing_asks_placement_once_per_request_shape(tmp_path: Path) -> None:
    """`gpuctl queue` with hundreds of runs of one shape waiting asked placement why each
    waits, once per entry; it asks once per shape, and each entry still names its own job."""
    node = make_node(tmp_path, Clock(), jobs_type=CountingJobs)
    jobs, admission = node.jobs, node.admission
    assert isinstance(jobs, CountingJobs)
    jobs.reserve(whole("a"))
    jobs.reserve(whole("b"))
    for name in ("w1", "w2", "w3"):
        admission.enqueue(whole(name))
    admission.enqueue(whole("pair", 2))
    jobs.chosen = 0
    views = admission.queue_views()
    assert jobs.chosen == 2  # 1 GPU 60GiB, 2 GPUs 60GiB
    for v in views:
        assert v.waiting_on.startswith(f"job {v.entry.job!r} asks 60GiB on "), v.waiting_on
        assert "reserved by" in v.waiting_on
    node.store.close()


class CountingQuotes(AdmissionService):
    """The admission service, counting the entries' quotes it makes."""

    quoted = 0

    def _quote(self, *args: Any, **kwargs: Any) -> Any:
        self.quoted += 1
        return super()._quote(*args, **kwargs)


def test_an_enqueue_quotes_its_own_entry_alone_however_long_the_queue(tmp_path: Path) -> None:
    """Each enqueue (and each waiting run's read of its own entry) made the view and quote
    of every queued entry to answer with one: a thousand queued took minutes. It makes its
    own, with the position and quote the listing gives it."""
    node = make_node(tmp_path, Clock(), admission_type=CountingQuotes)
    admission = node.admission
    assert isinstance(admission, CountingQuotes)
    runs_of_a_then_one_more(node)  # a history: the entries are quoted
    admission.enqueue(RunRequest(job="never", gpu_count=3), keep_unfeasible=True)
    admission.enqueue(whole("pair", 2))

    def quotes_of_an_enqueue(job: str) -> int:
        admission.quoted = 0
        admission.enqueue(whole(job))
        return admission.quoted

    first = quotes_of_an_enqueue("w0")
    for i in range(1, 30):
        admission.enqueue(whole(f"w{i}"))
    assert quotes_of_an_enqueue("w30") == first
    listed = {v.entry.id: v for v in admission.queue_views()}
    admission.quoted = 0
    for v in listed.values():
        assert admission.view(v.entry.id) == v
    assert admission.quoted == len(listed) - 1  # each its own; the unfeasible one none
    last = listed[admission.entries()[-1].id]
    assert (last.position, last.entry.job) == (32, "w30") and last.quote_s is not None
    assert len({v.quote_s for v in listed.values()}) > 2  # each quoted by its place
    node.store.close()


class EndsBeforeTheRead(AdmissionService):
    """The admission service, whose queue read first moves ``ending`` to ``to``: the pass
    thread starting it (or a Leave) between :meth:`view`'s read of the entry and its read of
    the queue."""

    ending: tuple[str, str] | None = None

    def entries(self, state: str | None = QUEUED) -> list[Entry]:
        if self.ending is not None:
            (entry_id, to), self.ending = self.ending, None
            self._set_state(entry_id, to)
        return super().entries(state)


@pytest.mark.parametrize("to", [STARTED, LEFT])
def test_an_entry_that_ends_while_its_view_is_made_is_answered_as_ended(
    tmp_path: Path, to: str
) -> None:
    """A view read the entry as queued, then the queue: an entry started or gone in between
    was in neither, and the view raised a bare StopIteration (a gRPC UNKNOWN to the
    `gpuctl run` that enqueued or waits on it). It is answered as it is now."""
    node = make_node(tmp_path, Clock(), admission_type=EndsBeforeTheRead)
    admission = node.admission
    assert isinstance(admission, EndsBeforeTheRead)
    node.jobs.reserve(whole("a", 2))
    queued = admission.enqueue(whole("b")).entry
    admission.enqueue(whole("c"))
    admission.ending = (queued.id, to)
    view = admission.view(queued.id)
    assert (view.entry.id, view.entry.state, view.position) == (queued.id, to, 0)
    node.store.close()


def test_a_pass_reads_the_store_no_more_for_more_waiting_runs(tmp_path: Path) -> None:
    """Each pass (each tick, and each release: a hand-over waits for it) read every waiting
    run's holder start time with a query of its own; it comes with the queue's rows."""
    import os

    node = make_node(tmp_path, Clock(), store_type=CountingStore)
    store, admission = node.store, node.admission
    assert isinstance(store, CountingStore)
    node.jobs.reserve(whole("a", 2))

    def pass_reads() -> int:
        store.transactions = 0
        admission.tick()
        return store.transactions

    admission.enqueue(whole("w0", holder=os.getpid()))
    one = pass_reads()
    for i in range(1, 10):
        admission.enqueue(whole(f"w{i}", holder=os.getpid()))
    assert pass_reads() == one
    assert all(e.state == QUEUED for e in admission.entries())
    store.close()


def stopped_pid() -> int:
    """The PID of a process that ran and has been reaped."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def test_a_pass_reads_each_holders_proc_stat_once_however_many_entries_it_holds(
    tmp_path: Path,
) -> None:
    """A pass read /proc/PID/stat twice for every queued entry (is it alive, did it start
    when the entry was queued), though one client (a gpuctl, a scheduler) holds many: with
    1000 queued that was most of each enqueue's time. Each holder is read once a pass."""
    proc = tmp_path / "proc"
    holders = (os.getpid(), os.getppid())
    for pid in holders:
        fake_proc(proc, pid, 1000)
    reads: list[int] = []

    def read_stat(pid: int, root: Path) -> list[str] | None:
        reads.append(pid)
        return stat_fields(pid, root)

    node = make_node(tmp_path, Clock(), proc_root=proc, read_stat=read_stat)
    try:
        node.jobs.reserve(whole("a", 2))
        for i in range(12):
            node.admission.enqueue(whole(f"w{i}", holder=holders[i % 2]))
        gone = node.admission.enqueue(whole("gone", holder=stopped_pid())).entry.id
        reads.clear()
        node.admission.tick()
        assert sorted(reads) == sorted(holders)  # none for the holder kill(0) finds gone
        assert node.admission.view(gone).entry.state == LEFT
        assert len(node.admission.entries()) == 12
    finally:
        node.store.close()


def still_holds(pid: int, started: int | None, proc: Path, live: tuple[int, ...]) -> bool:
    """What reading ``/proc/<pid>/stat`` says, worked out from its fields alone: the holder
    runs, is neither a zombie nor dead, and started when it queued (``started``: field 22,
    None when it was not read). With no fields to read, only a running process that gave
    no start time is still the holder (``live``: the PIDs that run)."""
    fields = stat_fields(pid, proc)
    if not fields:
        return started is None and pid in live
    return fields[0] not in ("Z", "X") and (
        started is None or (len(fields) > 19 and fields[19] == str(started))
    )


@pytest.mark.parametrize("change", ["same", "zombie", "dead", "reused", "unreadable", "empty"])
def test_a_pass_takes_out_the_entries_whose_holder_its_proc_stat_says_is_gone(
    tmp_path: Path, change: str
) -> None:
    """A holder that, after it queued, exited (a zombie, dead), vanished from /proc, left
    an empty stat or had its PID reused (another start time) is gone: a pass takes out
    exactly the entries whose holder's stat fields say so, and keeps those of the holder
    that still runs as it queued and those with no holder."""
    proc = tmp_path / "proc"
    changed, kept = live = (os.getpid(), os.getppid())
    for pid in live:
        fake_proc(proc, pid, 1000)
    node = make_node(tmp_path, Clock(), proc_root=proc)
    try:
        node.jobs.reserve(whole("a", 2))
        stopped = stopped_pid()  # its entry is taken out by the pass its own enqueue runs
        for i, holder in enumerate((changed, kept, stopped, None, changed, kept)):
            node.admission.enqueue(whole(f"w{i}", holder=holder))
        stat = proc / str(changed) / "stat"
        if change == "unreadable":
            stat.unlink()
        elif change != "same":
            state = {"zombie": "Z", "dead": "X"}.get(change, "S")
            ticks = 78 if change == "reused" else 77
            text = f"{changed} (gpuctl) {state} " + " ".join(["1"] * 18) + f" {ticks} 0\n"
            stat.write_text(f"{changed} (gpuctl)\n" if change == "empty" else text)
        queued = node.admission.entries()
        oracle = {
            e.id
            for e in queued
            if (pid := e.request.holder_pid) and not still_holds(pid, e.holder_start, proc, live)
        }
        node.admission.tick()
        left = {e.id for e in queued if node.admission.view(e.id).entry.state == LEFT}
        assert left == oracle
        assert len(queued) == 5
        by_holder = {e.request.holder_pid for e in queued if e.id in left}
        assert by_holder == (set() if change == "same" else {changed})
        assert all(
            runs(pid, started, proc) == still_holds(pid, started, proc, live)
            for pid in (changed, kept, stopped, 0, 2**31)
            for started in (None, 77, 78)
        )
    finally:
        node.store.close()


def test_an_entry_takes_its_holders_start_time_from_the_stat_reader_the_passes_use(
    tmp_path: Path,
) -> None:
    """The start time an entry keeps is what each pass compares with: it comes from the
    same ``read_stat`` as theirs, not from another read of ``proc_root``."""
    proc = tmp_path / "proc"
    fake_proc(proc, os.getpid(), 1000)  # its stat says tick 77; the reader says 99

    def read_stat(pid: int, root: Path) -> list[str] | None:
        return ["S", *["1"] * 18, "99", "0"]

    node = make_node(tmp_path, Clock(), proc_root=proc, read_stat=read_stat)
    try:
        node.jobs.reserve(whole("a", 2))
        entry = node.admission.enqueue(whole("w", holder=os.getpid())).entry
        node.admission.tick()
        assert entry.holder_start == 99
        assert node.admission.view(entry.id).entry.state == QUEUED
    finally:
        node.store.close()


def test_the_queue_is_read_again_after_a_pass_takes_out_a_gone_holders_entry(
    tmp_path: Path,
) -> None:
    """A pass that takes out an entry whose holder is gone must not then start it from the
    rows it read before: the next waiting entry starts, the gone one stays left."""
    proc = tmp_path / "proc"
    fake_proc(proc, os.getpid(), 1000)
    fake_proc(proc, os.getppid(), 1000)
    node = make_node(tmp_path, Clock(), proc_root=proc)
    try:
        a = node.jobs.reserve(whole("a", 2)).reservation
        gone = node.admission.enqueue(whole("g", 2, holder=os.getpid())).entry.id
        node.admission.enqueue(whole("k", 2, holder=os.getppid()))
        stat = proc / str(os.getpid()) / "stat"
        stat.write_text(stat.read_text().replace(" S ", " Z ", 1))
        node.jobs.release(a.id)
        node.admission.tick()
        assert node.admission.view(gone).entry.state == LEFT
        assert [r.job for r in node.jobs.reservations.held()] == ["k"]
    finally:
        node.store.close()


def test_a_holder_whose_name_is_not_utf8_queues_and_stops_no_pass(tmp_path: Path) -> None:
    """A process may name itself any bytes (``prctl(PR_SET_NAME, b"\\xffgpu")``) and the
    kernel writes them into ``/proc/<pid>/stat`` and ``status`` as they are: reading them
    as UTF-8 failed every pass, and every enqueue runs one, so one such holder stopped the
    queue for every user. Its start time and UID are read, and its entries wait as any."""
    proc = tmp_path / "proc"
    odd, other = os.getpid(), os.getppid()
    fake_proc(proc, other, 1000)
    (proc / str(odd)).mkdir(parents=True)
    (proc / str(odd) / "stat").write_bytes(
        f"{odd} (".encode() + b"\xff) g(pu" + b") S " + b" ".join([b"1"] * 18) + b" 77 0\n"
    )
    (proc / str(odd) / "status").write_bytes(
        b"Name:\t\xff) g(pu\nState:\tS (sleeping)\nUid:\t1000\t0\t1000\t1000\n"
    )
    node = make_node(tmp_path, Clock(), proc_root=proc)
    try:
        a = node.jobs.reserve(whole("a", 2)).reservation
        first = node.admission.enqueue(whole("odd", 2, holder=odd)).entry
        assert (first.holder_start, first.holder_uid) == (77, 1000)
        second = node.admission.enqueue(whole("other", 2, holder=other)).entry
        node.jobs.release(a.id)
        node.admission.tick()
        assert [r.job for r in node.jobs.reservations.held()] == ["odd"]
        assert node.admission.view(second.id).entry.state == QUEUED
    finally:
        node.store.close()


def test_unchanged_queue_rows_are_decoded_once(node: Node) -> None:
    """Each listing read every queued row's request again; a row read as it was keeps its
    entry, and a changed row is read afresh."""
    node.jobs.reserve(whole("a", 2))
    one = node.admission.enqueue(whole("one")).entry
    two = node.admission.enqueue(whole("two")).entry
    first = node.admission.entries()
    assert [e.id for e in first] == [one.id, two.id]
    again = node.admission.entries()
    assert all(x is y for x, y in zip(first, again, strict=True))
    node.admission.leave(one.id)
    left, still = node.admission.entries(None)
    assert left.id == one.id and left.state == LEFT and left is not first[0]
    assert still is first[1]
    assert [e.id for e in node.admission.entries()] == [two.id]


def test_the_wait_histogram_only_grows_while_gpud_runs(tmp_path: Path) -> None:
    """Prometheus reads the buckets as counters: runs leaving the history (pruned past
    admission.history_keep, or older than the history window) must not take them down."""
    from prometheus_client.core import Metric

    from gpud.admission.metrics import AdmissionMetrics

    clock = Clock()
    n = make_node(tmp_path, clock)
    n.admission.config = from_dict(
        {"admission": {"history_keep": 100, "history_window_s": 60}}
    ).admission
    metrics = AdmissionMetrics(n.admission)

    def waits() -> dict[str, float]:
        (family,) = [m for m in metrics() if m.name == "gpud_admission_wait_seconds"]
        assert isinstance(family, Metric)
        return {
            s.name.removeprefix(family.name) + s.labels.get("le", ""): s.value
            for s in family.samples
        }

    try:
        for i in range(150):
            n.jobs.release(n.jobs.reserve(RunRequest(job=f"j{i}")).reservation.id)
            clock.now += 1.0
            n.admission.tick()  # prunes the history to its last 100 runs
        assert len(n.admission.history()) < 150
        seen = waits()
        assert seen["_count"] == 150 and seen["_bucket1"] == 150 and seen["_sum"] == 0
        clock.now += 3600  # every run now older than the window
        n.admission.tick()
        assert waits() == seen
    finally:
        n.store.close()


def test_a_queued_job_names_every_gpu_unread_since_the_daemon_started(tmp_path: Path) -> None:
    """GPU 2 hung and GPU 3 was lost before gpud started: neither UUID was ever read (their
    devices share the UUID ""). A queued job names both, by index and reason, as a refused
    run does, not only the last of them."""
    store = StateStore(tmp_path / "state")
    events = EventLog(None)
    mps = MpsManager(store, events, tmp_path / "run", FAKE_CONTROL, enabled=False)
    hung, lost = (
        GpuSample(identity=placeholder_identity(i), healthy=False, reason=why, sampled_at=None)
        for i, why in ((2, "not answering: a driver call is outstanding"), (3, "GPU lost"))
    )
    mps.reconcile(snapshot(gpu_sample(0), gpu_sample(1), hung, lost))
    clock = Clock()
    jobs = JobService(store, events, mps, socket_path=tmp_path / "gpud.sock", clock=clock)
    admission = AdmissionService(store, jobs, mps, events, AdmissionConfig(), clock=clock)
    try:
        jobs.tick(snapshot(gpu_sample(0), gpu_sample(1), hung, lost))
        named = (
            "GPU 2 unhealthy: not answering: a driver call is outstanding;"
            " GPU 3 unhealthy: GPU lost"
        )
        with pytest.raises(ResourceExhausted) as refused:
            jobs.reserve(RunRequest(job="a", gpu_count=3))
        assert str(refused.value).endswith(f"({named})")
        entry = admission.enqueue(RunRequest(job="a", gpu_count=3))
        admission.tick()
        assert admission.view(entry.entry.id).waiting_on == named
    finally:
        store.close()


@pytest.mark.parametrize("last_seen", [None, "H100-SXM5-80GB"])
def test_a_request_that_needs_a_gpu_never_read_waits_for_it(
    tmp_path: Path, last_seen: str | None
) -> None:
    """GPU 3 was lost before gpud started: its size was never read (0 in its device). A run
    asking 70GiB on each of 4 GPUs may start when it answers again: it waits, and WHY NOT
    names the GPU and why, rather than being refused as one that can never start. Requests
    no answer would make room for are still refused at once: more GPUs than the node has,
    and, where an earlier run saw the GPU's product, more memory than that product has."""
    store = StateStore(tmp_path / "state")
    events = EventLog(None)
    mps = MpsManager(store, events, tmp_path / "run", FAKE_CONTROL, enabled=False)
    lost = GpuSample(
        identity=placeholder_identity(3), healthy=False, reason="GPU lost", sampled_at=None
    )
    node = snapshot(gpu_sample(0), gpu_sample(1), gpu_sample(2), lost)
    mps.reconcile(node)
    clock = Clock()
    jobs = JobService(store, events, mps, socket_path=tmp_path / "gpud.sock", clock=clock)
    products = {0: "H100-SXM5-80GB", 1: "H100-SXM5-80GB", 2: "H100-SXM5-80GB"}
    if last_seen is not None:
        products[3] = last_seen
    admission = AdmissionService(
        store, jobs, mps, events, AdmissionConfig(), products=lambda: products, clock=clock
    )
    try:
        jobs.tick(node)
        four = RunRequest(job="four", gpu_count=4, memory_bytes=70 * GIB)
        with pytest.raises(ResourceExhausted, match=r"GPU 3 unhealthy: GPU lost"):
            jobs.reserve(four)
        entry = admission.enqueue(four)
        admission.tick()
        view = admission.view(entry.entry.id)
        assert view.entry.state == QUEUED and view.unfeasible is None
        assert view.waiting_on == "GPU 3 unhealthy: GPU lost"
        with pytest.raises(FailedPrecondition, match="can never start"):
            admission.enqueue(RunRequest(job="five", gpu_count=5, memory_bytes=GIB))
        huge = RunRequest(job="huge", gpu_count=1, memory_bytes=100 * GIB)
        if last_seen is not None:
            with pytest.raises(FailedPrecondition, match=r"can never start.*largest: 80GiB"):
                admission.enqueue(huge)
        else:  # GPU 3's size is not known: it may hold 100GiB
            assert admission.enqueue(huge).entry.state == QUEUED
    finally:
        store.close()


def test_a_queued_run_pinned_to_the_last_uuid_of_a_gpu_never_read_is_refused_as_on_it(
    tmp_path: Path,
) -> None:
    """GPU 1 was lost before gpud started; an earlier run last read it as ``last``. A run
    queued pinned to that UUID is refused as the run itself is, naming GPU 1 and why it is
    unhealthy, not as one on a device the node lacks; kept as one that can never start
    (``keep_unfeasible``), it is queued: the GPU may answer with that UUID again."""
    last = "GPU-ef6bd996-508f-4667-91a1-078f3e502e4b"
    store = StateStore(tmp_path / "state")
    events = EventLog(None)
    mps = MpsManager(store, events, tmp_path / "run", FAKE_CONTROL, enabled=False)
    lost = GpuSample(
        identity=placeholder_identity(1),
        healthy=False,
        reason=f"GPU lost; last seen as {last}",
        sampled_at=None,
        last_seen=SeenIdentity(last, "NVIDIA H100 80GB HBM3", "00000000:1A:00.0"),
    )
    node = snapshot(gpu_sample(0), lost)
    mps.reconcile(node)
    jobs = JobService(store, events, mps, socket_path=tmp_path / "gpud.sock")
    products = {0: "H100-SXM5-80GB"}
    admission = AdmissionService(
        store, jobs, mps, events, AdmissionConfig(), products=lambda: products
    )
    try:
        jobs.tick(node)
        pinned = RunRequest(job="pinned", devices=(last,))
        said = (
            f"job 'pinned': {last} was last seen on GPU 1, which is unhealthy: GPU lost;"
            f" last seen as {last} (not read since gpud started: GPU 1 names no UUID until"
            " it answers)"
        )
        with pytest.raises(FailedPrecondition) as reserved:
            jobs.reserve(pinned)
        with pytest.raises(FailedPrecondition) as queued:
            admission.enqueue(pinned)
        assert str(reserved.value) == str(queued.value) == said
        assert admission.entries() == []
        kept = admission.enqueue(pinned, keep_unfeasible=True)
        assert kept.entry.state == QUEUED
    finally:
        store.close()


def test_a_run_that_outlasts_the_history_bound_keeps_its_row_and_its_end(
    tmp_path: Path,
) -> None:
    """``admission.history_keep`` at its least (100) and a service running while 101 short
    runs come and go: the service's row was pruned as it ran (``gpuctl jobs history`` lost
    it, its end was never kept, the quotes no longer counted its class on its GPU). It
    stays while it runs, the ended rows before the bound go, and its end is kept."""
    node = make_node(tmp_path, Clock(), config=AdmissionConfig(history_keep=100))
    try:
        service = node.jobs.reserve(whole("service")).reservation
        for i in range(101):
            run = node.jobs.reserve(whole(f"short{i}")).reservation
            node.clock.now += 1.0
            node.jobs.release(run.id)
            node.admission.tick()
        kept = [h.job for h in node.admission.history()]
        assert kept[0] == "service" and "short0" not in kept and len(kept) == 101
        node.admission.quote_error()  # the kept history brought up to date
        assert node.admission._mirror.running() == {service.id: "1 GPU 60GiB"}
        node.admission.config = replace(node.admission.config, history_keep=1000)
        node.clock.now += 1.0
        node.jobs.release(service.id)
        (ended,) = [h for h in node.admission.history() if h.job == "service"]
        assert ended.ended_at == node.clock.now and ended.end_cause == "released"
        node.admission.config = replace(node.admission.config, history_keep=100)
        node.admission.tick()  # ended, past the bound: pruned as the oldest
        assert node.admission.history()[0].job == "short1"
    finally:
        node.store.close()


def test_a_wall_clock_stepped_back_shows_no_negative_wait(node: Node) -> None:
    """The wall clock steps back an hour while a job is queued: the queue shows it waiting
    0 s (not -3600), and its history row starts no earlier than it was queued."""
    a = node.jobs.reserve(whole("a", 2)).reservation
    node.admission.enqueue(whole("b"))
    node.clock.now -= 3600
    (queued,) = node.admission.queue_views()
    assert queued.waited_s == 0.0
    node.jobs.release(a.id)
    node.admission.tick()
    b = {h.job: h for h in node.admission.history()}["b"]
    assert b.started_at == node.clock.now and b.queued_at == b.started_at
    assert b.record().wait_s == 0.0


@pytest.mark.parametrize("freed_by", ["release", "remove", "holder-gone", "leave"])
def test_devices_freed_start_the_next_queued_job_without_waiting_for_a_tick(
    node: Node, freed_by: str
) -> None:
    """A release, a `jobs rm --force`, a holder found gone, or the head leaving the queue
    starts what fits at once, in that call: the devices stayed idle until the next tick
    (up to a second), and the waiting gpuctl is told (the listeners) after it is kept."""
    told: list[str] = []
    node.admission.add_listener(lambda: told.append("changed"))
    holder = None
    if freed_by == "holder-gone":
        gone = subprocess.Popen(["true"])
        gone.wait()
        holder = gone.pid
    a = node.jobs.reserve(whole("a", 1 if freed_by == "leave" else 2, holder=holder))
    head = node.admission.enqueue(whole("pair", 2)) if freed_by == "leave" else None
    b = node.admission.enqueue(whole("b")).entry
    assert node.admission.view(b.id).entry.state == QUEUED and told == []
    if freed_by == "release":
        node.jobs.release(a.reservation.id)
    elif freed_by == "remove":
        node.jobs.remove("a", force=True)
    elif freed_by == "holder-gone":
        node.jobs.tick(None)
    else:
        assert head is not None
        node.admission.leave(head.entry.id)
    started = node.admission.view(b.id)  # no tick
    assert started.entry.state == STARTED and started.reservation is not None
    assert "b" in [r.job for r in node.jobs.reservations.held()]
    assert told and not node.admission._changed


@pytest.fixture
def threaded(tmp_path: Path) -> Iterator[Node]:
    """A node whose triggered passes run on the daemon's pass runner."""
    n = make_node(tmp_path, Clock(), PassRunner)
    yield n
    n.admission.passes.close(10)
    n.store.close()


def runner(node: Node) -> PassRunner:
    passes = node.admission.passes
    assert isinstance(passes, PassRunner)
    return passes


@pytest.mark.parametrize("freed_by", ["release", "remove", "leave"])
def test_a_release_or_leave_returns_while_the_pass_it_asked_for_is_held_up(
    threaded: Node, freed_by: str
) -> None:
    """The call that freed devices or left the queue returns once its own change is kept,
    not after the admission pass it asks for: a pass held up (here: the queued job's
    reservation) held every Release and Leave behind it, one pass each, so a burst of
    interrupted `gpuctl run`s waited past their 2 s for the withdrawal to be answered."""
    node = threaded
    told: list[str] = []
    node.admission.add_listener(lambda: told.append("changed"))
    a = node.jobs.reserve(whole("a", 1 if freed_by == "leave" else 2)).reservation
    head = node.admission.enqueue(whole("pair", 2)) if freed_by == "leave" else None
    b = node.admission.enqueue(whole("b")).entry
    reserving, go = hold_up_reserve(node)
    done = threading.Event()

    def change() -> None:
        if freed_by == "release":
            node.jobs.release(a.id)
        elif freed_by == "remove":
            node.jobs.remove("a", force=True)
        else:
            assert head is not None
            node.admission.leave(head.entry.id)
            assert told  # the runs behind it were told it left, before the pass
        done.set()

    caller = threading.Thread(target=change, daemon=True)
    caller.start()
    try:
        assert reserving.wait(10), "no pass started"
        assert done.wait(5), "the call waited for the pass it asked for"
    finally:
        go.set()
        caller.join(10)
    assert runner(node).drain(10)
    assert node.admission.view(b.id).entry.state == STARTED
    assert "b" in [r.job for r in node.jobs.reservations.held()]


def test_leaves_during_a_pass_lead_to_one_more_pass(threaded: Node) -> None:
    """Many leaves while a pass runs: one pass after it, not one each."""
    node = threaded
    node.jobs.reserve(whole("a", 2))
    entries = [node.admission.enqueue(whole(f"j{i}")).entry for i in range(20)]
    passes: list[float] = []
    tick = node.admission.tick
    running, go = threading.Event(), threading.Event()

    def counted() -> None:
        passes.append(node.clock())
        running.set()
        go.wait(10)
        tick()

    node.admission.passes = PassRunner(counted)
    node.admission.passes.ask()
    try:
        assert running.wait(10)
        for e in entries:
            node.admission.leave(e.id)
    finally:
        go.set()
    assert runner(node).drain(10)
    assert len(passes) == 2
    assert node.admission.entries() == []


def test_a_pass_that_fails_after_a_release_keeps_the_release(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """The release stands when the pass it runs raises (the tick tries again); logged."""
    a = node.jobs.reserve(whole("a", 2)).reservation
    entry = node.admission.enqueue(whole("b")).entry
    reserve = node.jobs.reserve
    node.jobs.reserve = lambda *args, **kwargs: 1 / 0  # type: ignore[method-assign]
    assert node.jobs.release(a.id) is not None
    assert "admission pass failed" in caplog.text
    assert node.jobs.reservations.held() == []
    node.jobs.reserve = reserve  # type: ignore[method-assign]
    node.admission.tick()
    assert node.admission.view(entry.id).entry.state == STARTED


class Deadline:
    """A servicer context with ``remaining`` seconds to its deadline (None: none), from a
    caller at ``peer`` (the socket, by default)."""

    def __init__(self, remaining: float | None = None, peer: str = "unix:/run/gpud.sock") -> None:
        self.remaining = remaining
        self._peer = peer

    def time_remaining(self) -> float | None:
        return self.remaining

    def peer(self) -> str:
        return self._peer


class ManualTime:
    """The waiting GetEntry calls' clock and wait (QueueServicer's ``clock``, ``wait``): time
    passes only by ``advance``, or, with ``lapse``, each wait's whole limit passes at once;
    a wait ends when its change event is set or its limit has passed. ``limits``: the time
    limit of each wait begun."""

    def __init__(self, *, lapse: bool = False) -> None:
        self.now = 0.0
        self.limits: list[float] = []
        self._lapse = lapse
        self._waits: list[tuple[float, asyncio.Future[None]]] = []
        self._begun = asyncio.Condition()

    def clock(self) -> float:
        return self.now

    async def wait(self, changed: asyncio.Event, timeout: float) -> None:
        self.limits.append(timeout)
        if self._lapse:
            self.now += timeout
            return
        passed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = (self.now + timeout, passed)
        self._waits.append(waiting)
        async with self._begun:
            self._begun.notify_all()
        change = asyncio.ensure_future(changed.wait())
        either: set[asyncio.Future[Any]] = {change, passed}
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            change.cancel()
            self._waits.remove(waiting)

    async def begun(self, n: int) -> None:
        """Until ``n`` waits have begun in all (a hang guard of 30 s)."""
        async with self._begun:
            await asyncio.wait_for(self._begun.wait_for(lambda: len(self.limits) >= n), 30)

    def advance(self, s: float) -> None:
        self.now += s
        for until, passed in self._waits:
            if until <= self.now and not passed.done():
                passed.set_result(None)


def test_get_entry_with_wait_answers_as_soon_as_the_entry_starts(node: Node) -> None:
    """GetEntry with wait_s holds its answer until the entry starts (here a release, in
    another thread), not for the whole wait: it answers with no time passed; without wait_s
    it answers at once."""
    import asyncio

    from gpud.admission.api import QueueServicer
    from gpud.v1 import queue_pb2

    clock = ManualTime()
    servicer = QueueServicer(node.admission, clock=clock.clock, wait=clock.wait)
    a = node.jobs.reserve(whole("a", 2)).reservation
    entry = node.admission.enqueue(whole("b")).entry

    async def scenario() -> tuple[Any, Any]:
        at_once = await servicer.GetEntry(queue_pb2.GetEntryRequest(id=entry.id), Deadline())
        assert clock.limits == []
        asked = queue_pb2.GetEntryRequest(id=entry.id, wait_s=5.0)
        waiting = asyncio.create_task(servicer.GetEntry(asked, Deadline(30.0)))
        await clock.begun(1)  # it read the entry queued: it waits
        assert not waiting.done()
        await asyncio.to_thread(node.jobs.release, a.id)
        return at_once, await asyncio.wait_for(waiting, 30)

    at_once, answer = asyncio.run(scenario())
    assert at_once.state == queue_pb2.ENTRY_STATE_QUEUED
    assert answer.state == queue_pb2.ENTRY_STATE_STARTED and answer.reservation.id
    assert clock.now == 0.0 and clock.limits == [5.0]  # woken by the start, not its limit
    # the started run's report token: on the socket, not to a read over TCP
    assert answer.env["GPUD_REPORT_TOKEN"]
    over_tcp = asyncio.run(
        servicer.GetEntry(queue_pb2.GetEntryRequest(id=entry.id), Deadline(peer="ipv4:1.2.3.4:5"))
    )
    assert dict(over_tcp.env) == {k: v for k, v in answer.env.items() if k != "GPUD_REPORT_TOKEN"}


def test_waiting_get_entries_share_one_read_of_the_queue_per_change(node: Node) -> None:
    """Every waiting GetEntry wakes on a change: they read the queue once between them, not
    once each (O(waiters) reads of O(queue) each per change made 200 waiting `gpuctl run`s
    take seconds of gpud's CPU per change); each still answers with its own entry."""
    import asyncio

    from gpud.admission.api import MOVED_ANSWER_S, QueueServicer
    from gpud.v1 import queue_pb2

    clock = ManualTime()
    servicer = QueueServicer(node.admission, clock=clock.clock, wait=clock.wait)
    node.jobs.reserve(whole("a", 2))
    ids = [node.admission.enqueue(whole(f"w{i}")).entry.id for i in range(20)]
    reads = []
    queue_views = node.admission.queue_views

    def counted() -> Any:
        reads.append(1)
        return queue_views()

    node.admission.queue_views = counted  # type: ignore[method-assign]

    async def scenario() -> list[Any]:
        asked = [
            asyncio.create_task(
                servicer.GetEntry(queue_pb2.GetEntryRequest(id=i, wait_s=5.0), Deadline(30.0))
            )
            for i in ids[1:]
        ]
        await clock.begun(len(asked))
        assert len(reads) == 1 and not any(a.done() for a in asked)
        await asyncio.to_thread(node.admission.leave, ids[0])
        # each moved up: they read the change once between them, and answer a moment later
        await clock.begun(2 * len(asked))
        assert len(reads) == 2 and not any(a.done() for a in asked)
        clock.advance(MOVED_ANSWER_S)
        return await asyncio.wait_for(asyncio.gather(*asked), 30)

    answers = asyncio.run(scenario())
    assert [(a.id, a.position) for a in answers] == [(i, n) for n, i in enumerate(ids[1:], 1)]
    assert len(reads) <= 3


def test_a_moved_entry_is_answered_once_for_the_moves_of_a_moment(node: Node) -> None:
    """A run that moved up is answered a moment after the first move, with its position
    then: every run behind a start moved, and all of them asking again at once took the
    CPUs the started run needed (a hand-over with 200 runs waiting took 0.45 s). A start is
    still answered at once."""
    import asyncio

    from gpud.admission.api import QueueServicer
    from gpud.v1 import queue_pb2

    clock = ManualTime()
    servicer = QueueServicer(node.admission, moved_answer_s=0.5, clock=clock.clock, wait=clock.wait)
    node.jobs.reserve(whole("a", 2))
    ids = [node.admission.enqueue(whole(f"w{i}")).entry.id for i in range(3)]

    async def scenario() -> Any:
        asked = queue_pb2.GetEntryRequest(id=ids[2], wait_s=5.0)
        waiting = asyncio.create_task(servicer.GetEntry(asked, Deadline(30.0)))
        await clock.begun(1)
        await asyncio.to_thread(node.admission.leave, ids[0])
        await clock.begun(2)  # moved up to 2: it waits the moment out
        clock.advance(0.25)
        await asyncio.to_thread(node.admission.leave, ids[1])
        await clock.begun(3)  # moved up to 1 within the moment: the first move's moment
        assert not waiting.done()
        clock.advance(0.25)
        return await asyncio.wait_for(waiting, 30)

    answer = asyncio.run(scenario())
    assert answer.state == queue_pb2.ENTRY_STATE_QUEUED and answer.position == 1
    assert clock.limits == [5.0, 0.5, 0.25] and clock.now == 0.5


def test_get_entry_waits_no_longer_than_asked_nor_its_deadline(node: Node) -> None:
    """An entry that stays queued is answered after wait_s, capped at 5 s and 0.5 s short
    of the call's deadline; a wait that is not a number of seconds is refused."""
    import asyncio

    from gpud.admission.api import QueueServicer
    from gpud.v1 import queue_pb2

    node.jobs.reserve(whole("a", 2))
    entry = node.admission.enqueue(whole("b")).entry

    def waited(wait_s: float, remaining: float | None) -> list[float]:
        """The time limits the call waited, each passing whole: nothing changes meanwhile."""
        clock = ManualTime(lapse=True)
        servicer = QueueServicer(node.admission, clock=clock.clock, wait=clock.wait)
        answer = asyncio.run(
            servicer.GetEntry(
                queue_pb2.GetEntryRequest(id=entry.id, wait_s=wait_s), Deadline(remaining)
            )
        )
        assert answer.state == queue_pb2.ENTRY_STATE_QUEUED
        assert clock.now == sum(clock.limits)
        return clock.limits

    assert waited(0.2, None) == [0.2]
    assert waited(60.0, None) == [5.0]
    assert waited(5.0, 0.6) == [pytest.approx(0.1)]  # 0.5 s short of the deadline
    assert waited(5.0, 0.3) == []
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument, match="wait_s"):
            waited(bad, None)


class WatchedLock:
    """A re-entrant lock that says when a thread has to wait for it."""

    def __init__(self, waits: threading.Event) -> None:
        self._lock = threading.RLock()
        self._waits = waits

    def __enter__(self) -> WatchedLock:
        if not self._lock.acquire(blocking=False):
            self._waits.set()
            self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_mps_set_memory_and_a_run_reserving_meanwhile_never_over_commit(tmp_path: Path) -> None:
    """``gpuctl mps set --memory 50GiB`` checks what runs hold on the 80 GiB GPU, then saves;
    a ``gpuctl run`` without a memory limit reserving in between (30 GiB, the default then)
    was counted at 50 GiB with the first: 100 GiB on 80. The check and the save hold
    placement still: the run is placed after the save, and asks the new default."""
    moved = threading.Event()  # the competing run reserved, or waits for placement
    store = StateStore(tmp_path / "state")
    events = EventLog(None)
    mps = MpsManager(store, events, tmp_path / "run", FAKE_CONTROL, enabled=False)
    mps.reconcile(snapshot(gpu_sample(0), gpu_sample(1)))
    jobs = JobService(
        store, events, mps, socket_path=tmp_path / "gpud.sock", lock=WatchedLock(moved)
    )
    first = mps.targets()[0].uuid
    mps.set_limits(first, memory_bytes=30 * GIB)
    jobs.reserve(RunRequest(job="a", devices=("0",)))
    outcome: list[object] = []

    def competing_run() -> None:
        try:
            outcome.append(jobs.reserve(RunRequest(job="b", devices=("0",))).reservation)
        except ResourceExhausted as err:
            outcome.append(err)
        moved.set()

    runner = threading.Thread(target=competing_run)

    def loads_then_a_run() -> dict[str, Any]:
        read = jobs.loads()  # the first read: what the new default is checked against
        if not runner.is_alive() and not outcome:
            runner.start()
            assert moved.wait(10.0)
        return dict(read)

    api = MpsServicer(mps, loads=loads_then_a_run, placement=jobs.locked)
    api._set(mps_pb2.SetMpsLimitsRequest(device="0", memory_limit_bytes=50 * GIB))
    runner.join()
    assert mps.limits(first).memory_bytes == 50 * GIB
    reserved = jobs.loads()[first].memory_bytes
    assert reserved <= 80 * GIB
    (b,) = outcome
    if isinstance(b, ResourceExhausted):  # placed after the save: it asks the new default
        assert "asks 50GiB (its MPS default memory limit)" in str(b)
    else:
        assert reserved == 80 * GIB
    store.close()


def test_the_littles_residual_of_a_long_history_decodes_no_run(node: Node) -> None:
    """``gpud_admission_littles_residual`` is computed at every scrape over the runs since
    gpud started, which may be admission.history_keep of them (100000 by default): it is
    summed in the database, not by decoding every run (3.5 s a scrape at 100000 runs), so
    rows whose request no longer decodes change nothing."""
    from gpud.admission.estimate import littles_residual
    from gpud.admission.service import run_request_to_json

    runs, start = 3000, 1000.0
    end = start + runs + 10
    request = run_request_to_json(whole("j"))
    rows = [(start + i, start + i + i % 3) for i in range(runs)]  # waits of 0, 1 and 2 s
    rows += [(start - 5, start + 2), (end - 1, end + 60)]  # cut at the start; at the end
    with node.store.transaction() as conn:
        conn.executemany(
            "INSERT INTO job_history (job, reservation, request_class, request, queued_at,"
            " started_at, ended_at) VALUES (?, ?, '1 GPU 60GiB', ?, ?, ?, ?)",
            [(f"j{i}", f"{i:012x}", request, q, s, s + 1) for i, (q, s) in enumerate(rows)],
        )
    node.admission._account(start, 1)  # one entry queued all along
    node.admission._account(end, 1)
    area = node.admission._area
    records = [h.record() for h in node.admission.history(since=start)]
    expected = littles_residual(records, area, start=start, end=end)
    with node.store.transaction() as conn:
        conn.execute("UPDATE job_history SET request = '{'")  # decoding any row now raises
    got = node.admission.littles_residual()
    assert got is not None and 0 < got == pytest.approx(expected)


def test_the_mig_config_file_is_parsed_and_said_once_for_each_version_of_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``admission.mig_config`` is asked for on each /metrics scrape and queue listing: it
    is read and parsed again, and a problem with it logged, only once it changed."""
    from gpud.mig.layout import MigConfigFile, load_config

    path = tmp_path / "mig.yaml"
    path.write_bytes(
        (Path(__file__).parent.parent / "data" / "mig-parted" / "config.yaml").read_bytes()
    )
    loads: list[Path] = []

    def counted(named: Path) -> MigConfigFile:
        loads.append(named)
        return load_config(named)

    layouts = mig_file_layouts(path, list, load=counted)
    with caplog.at_level(logging.WARNING, logger="gpud.admission.service"):
        for _ in range(5):
            layouts()
        assert loads == [path] and not caplog.records
        path.write_text("version: v1\nmig-configs: [")  # broken: said once
        for _ in range(5):
            assert layouts() == {}
        assert len(loads) == 2
        (said,) = caplog.records
        assert said.getMessage().startswith(f"admission.mig_config: {path}: ")
        path.unlink()  # gone: said once more
        for _ in range(5):
            assert layouts() == {}
        assert len(loads) == 3 and len(caplog.records) == 2


def test_a_lost_whole_gpu_counts_as_one_the_node_has_but_takes_no_job_now(
    tmp_path: Path,
) -> None:
    """GPUs 0, 2 and 3 are in MIG mode and GPU 1, the only whole one, is lost. A run asking
    for one whole GPU waits for GPU 1 (exit 7): the refusal counts it and says that none
    takes jobs now, and why. One asking for four can never start, GPU 1 answering or not
    (exit 6): the refusal says the lost GPU was counted."""
    store = StateStore(tmp_path / "state")
    events = EventLog(None)
    mps = MpsManager(store, events, tmp_path / "run", FAKE_CONTROL, enabled=False)
    split = (("3g.40gb", 40), ("3g.40gb", 40))
    lost = gpu_sample(1)._replace(healthy=False, reason="GPU lost (memory)", lost=True)
    gpus = snapshot(gpu_sample(0, migs=split), lost, *(gpu_sample(i, migs=split) for i in (2, 3)))
    mps.reconcile(gpus)
    clock = Clock()
    jobs = JobService(store, events, mps, socket_path=tmp_path / "gpud.sock", clock=clock)
    AdmissionService(store, jobs, mps, events, AdmissionConfig(), clock=clock)
    try:
        jobs.tick(gpus)
        with pytest.raises(ResourceExhausted) as waits:
            jobs.reserve(RunRequest(job="one", gpu_count=1))
        assert str(waits.value) == (
            "job 'one' asks 1 whole GPU; this node has 1 GPU not in MIG mode, 0 of them taking"
            " jobs now (GPU 1 unhealthy: GPU lost (memory))"
        )
        with pytest.raises(FailedPrecondition) as never:
            jobs.reserve(RunRequest(job="four", gpu_count=4))
        assert str(never.value) == (
            "job 'four' can never start on this node as it is: asks 4 whole GPUs; this node"
            " has 1 GPU not in MIG mode (name a MIG profile: gpuctl run --mig). GPU 1, counted"
            " all the same, is lost and takes no job now: drain the node and reset it"
            " (nvidia-smi --gpu-reset -i 1) or reboot it"
        )
    finally:
        store.close()


LOST = "GPU lost (memory): nvmlDeviceGetMemoryInfo failed on GPU 1: GPU is lost"


def xids(*codes: int) -> tuple[CriticalXid, ...]:
    return tuple(CriticalXid(x, 1, 1.0, 1.0) for x in codes)


@pytest.mark.parametrize(
    ("sample", "said"),
    [
        (
            {"reason": LOST, "lost": True},
            "is lost and takes no job now: drain the node and reset it"
            " (nvidia-smi --gpu-reset -i 1) or reboot it",
        ),
        (
            {
                "reason": f"{LOST}; {critical_xid_reason([79])}",
                "lost": True,
                "critical_xids": xids(79),
            },
            "is lost and has Xid 79 and takes no job now: drain the node and reset it"
            " (nvidia-smi --gpu-reset -i 1), then gpuctl xid clear 1, or reboot it",
        ),
        (
            {
                "reason": "reset required (memory): nvmlDeviceGetMemoryInfo failed on GPU 1:"
                " GPU requires reset: drain the node and reset the GPU (`nvidia-smi"
                f" --gpu-reset -i 1`) or reboot; {LOST}",
                "lost": True,
            },
            "is lost and takes no job now: drain the node and reset it"
            " (nvidia-smi --gpu-reset -i 1) or reboot it",
        ),
        (
            {"reason": critical_xid_reason([79, 48]), "critical_xids": xids(79, 48)},
            "has Xids 79, 48 and takes no job now: once they are dealt with, clear its Xids"
            " (gpuctl xid clear 1)",
        ),
        (
            {"reason": critical_xid_reason([48]), "critical_xids": xids(48)},
            "has Xid 48 and takes no job now: once it is dealt with, clear its Xid"
            " (gpuctl xid clear 1)",
        ),
        (
            {"reason": f"{NOT_ANSWERING}; {critical_xid_reason([79])}", "critical_xids": xids(79)},
            f"is unhealthy and takes no job now: {NOT_ANSWERING}; {critical_xid_reason([79])}",
        ),
        (
            {
                "reason": "insufficient power (power_watts): nvmlDeviceGetPowerUsage failed on"
                " GPU 1: Insufficient External Power: its external power cables are not"
                " properly attached: check them (power the node off)"
            },
            "is unhealthy and takes no job now: insufficient power (power_watts):"
            " nvmlDeviceGetPowerUsage failed on GPU 1: Insufficient External Power: its"
            " external power cables are not properly attached: check them (power the node off)",
        ),
        (
            {
                "reason": "corrupted infoROM (memory): nvmlDeviceGetMemoryInfo failed on GPU 1:"
                " Corrupted infoROM: the GPU's infoROM is corrupted: drain the node and have"
                " the board serviced"
            },
            "is unhealthy and takes no job now: corrupted infoROM (memory):"
            " nvmlDeviceGetMemoryInfo failed on GPU 1: Corrupted infoROM: the GPU's infoROM"
            " is corrupted: drain the node and have the board serviced",
        ),
        (
            {"reason": "internal error: KeyError (gpud's log has the details)"},
            "is unhealthy and takes no job now: internal error: KeyError (gpud's log has the"
            " details)",
        ),
        (
            {"reason": "memory failed: Unknown Error"},
            "is unhealthy and takes no job now: memory failed: Unknown Error",
        ),
    ],
    ids=[
        "lost",
        "lost with an Xid",
        "lost after another fault",
        "Xids alone",
        "one Xid alone",
        "not answering with an Xid",
        "insufficient power",
        "corrupted infoROM",
        "internal error",
        "a failed call",
    ],
)
def test_a_never_starting_run_says_in_one_sentence_what_a_counted_gpu_is_and_what_to_do(
    node: Node, sample: dict[str, Any], said: str
) -> None:
    """A run that can never start says of a GPU it counted that takes no job now what the
    driver answered (lost, its critical XIDs) and what brings it back; any other reason is
    quoted whole, with its own advice: the text before its first colon was kept, and each
    given "drain the node and reset it", an infoROM to service or a power cable to attach
    included."""
    gpus = snapshot(gpu_sample(0), gpu_sample(1)._replace(healthy=False, **sample))
    node.mps.reconcile(gpus)
    node.jobs.tick(gpus)
    with pytest.raises(FailedPrecondition) as never:
        node.jobs.reserve(RunRequest(job="three", gpu_count=3))
    assert str(never.value) == (
        "job 'three' can never start on this node as it is: asks 3 whole GPUs; this node has"
        f" 2 GPUs not in MIG mode (name a MIG profile: gpuctl run --mig). GPU 1, counted all"
        f" the same, {said}"
    )


def test_a_never_starting_run_says_drain_the_node_once_and_how_many_more_gpus_are_down(
    node: Node,
) -> None:
    """GPUs 1 to 5 lost: "drain the node" is said once, for GPU 1, and past the fourth
    "; 1 more", as a queued entry's WHY NOT says it."""
    lost = [gpu_sample(i)._replace(healthy=False, reason=LOST, lost=True) for i in range(1, 6)]
    gpus = snapshot(gpu_sample(0), *lost)
    node.mps.reconcile(gpus)
    node.jobs.tick(gpus)
    with pytest.raises(FailedPrecondition) as never:
        node.jobs.reserve(RunRequest(job="seven", gpu_count=7))
    said = str(never.value).partition("(name a MIG profile: gpuctl run --mig). ")[2]
    assert said == (
        "GPU 1, counted all the same, is lost and takes no job now: drain the node and reset"
        " it (nvidia-smi --gpu-reset -i 1) or reboot it; "
        + "; ".join(
            f"GPU {i}, counted all the same, is lost and takes no job now: reset it"
            f" (nvidia-smi --gpu-reset -i {i}) or reboot it"
            for i in (2, 3, 4)
        )
        + "; 1 more"
    )


def test_a_never_starting_run_says_a_gpu_a_mig_apply_holds_comes_back_alone(node: Node) -> None:
    """A GPU a MIG apply holds was said to take "no job until this ends", naming nothing."""
    why = "a MIG apply of all-1g is changing its instances"
    with node.jobs.placing_none_on({1: why}), pytest.raises(FailedPrecondition) as never:
        node.jobs.reserve(RunRequest(job="three", gpu_count=3))
    assert str(never.value).endswith(
        ". GPU 1, counted all the same, is held and takes no job for now (it comes back"
        " alone): a MIG apply of all-1g is changing its instances"
    )


def test_a_gpu_in_mig_mode_lost_before_it_had_mig_devices_is_not_counted_as_whole(
    tmp_path: Path,
) -> None:
    """GPUs 0 to 3 are in MIG mode; GPU 3's MIG devices are not created yet when it falls
    off the bus, answering no MIG mode. It was counted as a whole GPU taking no job now, so
    a run asking one waited for it (exit 7: `this node has 1 GPU not in MIG mode, 0 of them
    taking jobs now (GPU 3 unhealthy: GPU lost)`), though it comes back in MIG mode. The
    node has no whole GPU: the run can never start (exit 6), queued or not."""
    store = StateStore(tmp_path / "state")
    events = EventLog(None)
    mps = MpsManager(store, events, tmp_path / "run", FAKE_CONTROL, enabled=False)
    split = (("3g.40gb", 40), ("3g.40gb", 40))
    fresh = gpu_sample(3, migs=split)._replace(mig_devices=())
    lost = fresh._replace(healthy=False, reason="GPU lost", mig_mode=None, mig_devices_read=False)
    mps.reconcile(snapshot(*(gpu_sample(i, migs=split) for i in range(3)), fresh))
    gpus = snapshot(*(gpu_sample(i, migs=split) for i in range(3)), lost)
    mps.reconcile(gpus)
    clock = Clock()
    jobs = JobService(store, events, mps, socket_path=tmp_path / "gpud.sock", clock=clock)
    admission = AdmissionService(store, jobs, mps, events, AdmissionConfig(), clock=clock)
    never = (
        "job 'one' can never start on this node as it is: asks 1 whole GPU; this node has"
        " 0 GPUs not in MIG mode (name a MIG profile: gpuctl run --mig)"
    )
    try:
        jobs.tick(gpus)
        with pytest.raises(FailedPrecondition) as refused:
            jobs.reserve(RunRequest(job="one", gpu_count=1))
        assert str(refused.value) == never
        with pytest.raises(FailedPrecondition) as queued:
            admission.enqueue(RunRequest(job="one", gpu_count=1))
        assert str(queued.value) == never
    finally:
        store.close()


def test_a_lost_gpu_is_no_server_of_the_class_model_and_explain_says_so(node: Node) -> None:
    """Two GPUs, GPU 0 lost: one-GPU runs are served by GPU 1 alone. The class model
    counted the lost GPU as a server all the same (K_EFF 2, `memory=2 gpus=2`), so queued
    one-GPU runs were quoted as if two GPUs served them; it counts the GPUs that answer,
    and `gpuctl queue --explain` says which it left out and why."""
    from gpud.cli.queue import class_row, left_out_lines

    for _ in range(3):  # a history of the class
        run = node.jobs.reserve(whole("one")).reservation
        node.clock.now += 30.0
        node.jobs.release(run.id)
        node.clock.now += 30.0
    (before,) = node.admission.explain()
    assert before.packing is not None and before.packing.k_eff == 2 and before.left_out == ""
    lost = gpu_sample(0)._replace(healthy=False, reason="GPU lost (memory)")
    node.jobs.tick(snapshot(lost, gpu_sample(1)))
    node.jobs.reserve(whole("a"))  # on GPU 1, the one that answers
    node.admission.enqueue(whole("b"))
    (view,) = node.admission.explain()
    assert view.packing is not None and view.packing.k_eff == 1
    assert view.packing.vector == {"memory": 1, "gpus": 1} and view.packing.pool_size == 1
    assert view.left_out == "GPU 0 unhealthy: GPU lost (memory)"
    assert view.quote is not None and view.quote.servers == 1  # b's wait is one GPU's
    msg = class_message(view)
    assert msg.k_eff == 1 and msg.pool_devices == 1 and msg.left_out == view.left_out
    assert class_row(msg)[1:3] == ("1", "memory=1 gpus=1")
    assert left_out_lines([msg]) == [
        "1 GPU 60GiB: K_EFF counts the GPUs that answer, leaving out"
        " GPU 0 unhealthy: GPU lost (memory)"
    ]
    # once it answers again, it serves again
    node.jobs.tick(snapshot(gpu_sample(0), gpu_sample(1)))
    (again,) = node.admission.explain()
    assert again.packing is not None and again.packing.k_eff == 2 and again.left_out == ""
    # nor does one a MIG apply holds serve, while it holds it
    with node.jobs.placing_none_on({0: "a MIG apply is changing its instances"}):
        (held,) = node.admission.explain()
    assert held.packing is not None and held.packing.k_eff == 1
    assert held.left_out == "GPU 0 held: a MIG apply is changing its instances"


def pinned(job: str, device: str) -> RunRequest:
    return RunRequest(job=job, devices=(device,), memory_bytes=60 * GIB)


def test_a_run_refused_for_its_devices_memory_is_not_said_to_wait_behind_other_devices_jobs(
    node: Node,
) -> None:
    """GPU 0 holds a and a run pinned there waits for it; GPU 1 holds x. A one-GPU run
    could go on either, and fits on neither: it was told it waited behind the run pinned
    to GPU 0, when GPU 1's memory was why. It is told what holds its devices; where it
    fits but the queue holds it back, only the queued runs that need the devices it fits on
    are counted."""
    first, second = (t.uuid for t in node.mps.targets())
    node.jobs.reserve(pinned("a", first))
    x = node.jobs.reserve(pinned("x", second)).reservation
    waiting = node.admission.enqueue(pinned("p", first))
    with pytest.raises(ResourceExhausted) as refused:
        node.jobs.reserve(whole("b"))
    assert "queued job" not in str(refused.value)
    # as a refused run says when nothing is queued: the memory reserved on its devices
    assert "60GiB reserved by" in str(refused.value) and "20GiB free" in str(refused.value)
    # GPU 1 frees and a run that needs both GPUs queues ahead of one pinned to GPU 0: a
    # one-GPU run that fits on GPU 1 waits behind the first alone
    node.admission.leave(waiting.entry.id)
    node.jobs.release(x.id)
    node.admission.enqueue(whole("pair", 2))
    node.admission.enqueue(pinned("p2", first))
    with pytest.raises(ResourceExhausted) as behind:
        node.jobs.reserve(whole("c"))
    assert str(behind.value) == (
        "job 'c' (1 GPU 60GiB) waits behind 1 queued job(s) that need its devices"
    )


def test_a_refused_run_names_each_held_gpu_as_its_queue_entry_would(node: Node) -> None:
    """Both GPUs full: a one-GPU run refused was told one GPU's numbers, as if the other
    were free, where its queue entry's WHY NOT names each; it names each (a few, then how
    many more), after the numbers of the one placement names."""
    node.jobs.reserve(whole("a"))
    node.jobs.reserve(whole("x"))
    with pytest.raises(ResourceExhausted) as refused:
        node.jobs.reserve(whole("b"))
    assert "60GiB reserved by" in str(refused.value)
    assert str(refused.value).endswith("20GiB free; GPU 0 held by a, GPU 1 held by x")
    node.mps.reconcile(snapshot(*(gpu_sample(i) for i in range(6))))
    for i in range(2, 6):
        node.jobs.reserve(whole(f"r{i}"))
    with pytest.raises(ResourceExhausted) as six:
        node.jobs.reserve(whole("b"))
    assert str(six.value).endswith(
        "; GPU 0 held by a, GPU 1 held by x, GPU 2 held by r2, GPU 3 held by r3 and 2 more"
    )


def test_a_queued_job_names_each_held_gpu_and_its_holder(tmp_path: Path) -> None:
    """Both GPUs held, by runs of two users: the queued one-GPU job's WHY NOT named one GPU
    and its holder, as if the other were free; it names each (a few, then how many more)."""
    proc = tmp_path / "proc"
    alice, bob = os.getpid(), os.getppid()
    fake_proc(proc, alice, 1000)
    fake_proc(proc, bob, 1001)
    node = make_node(tmp_path, Clock(), proc_root=proc)
    try:
        node.jobs.reserve(whole("a", holder=alice))
        node.jobs.reserve(whole("b", holder=bob))
        c = node.admission.enqueue(whole("c"))
        (view,) = node.admission.queue_views()
        assert view.waiting_on.endswith(
            f"; GPU 0 held by a ({user_name(1000)}), GPU 1 held by b ({user_name(1001)})"
        )
        # six GPUs, each held: four are named, then how many more
        node.admission.leave(c.entry.id)
        node.mps.reconcile(snapshot(*(gpu_sample(i) for i in range(6))))
        for i in range(2, 6):
            node.jobs.reserve(whole(f"r{i}"))
        node.admission.enqueue(whole("c"))
        (view,) = node.admission.queue_views()
        assert view.waiting_on.endswith(
            f"; GPU 0 held by a ({user_name(1000)}), GPU 1 held by b ({user_name(1001)}),"
            " GPU 2 held by r2, GPU 3 held by r3 and 2 more"
        )
    finally:
        node.store.close()


def test_a_pool_left_with_fewer_answering_gpus_than_a_run_takes_serves_none_of_its_class(
    node: Node,
) -> None:
    """Two GPUs, GPU 0 lost: a run of two GPUs at 10GiB each has one GPU left to run on.
    The class model summed that GPU's eight copies as if the run's second GPU were found on
    it (K_EFF 4, a finite class quote) while the entry itself was told it waits for GPU 0;
    the class has no server while fewer GPUs than a run takes answer."""
    lost = gpu_sample(0)._replace(healthy=False, reason="GPU lost")
    node.jobs.tick(snapshot(lost, gpu_sample(1)))
    entry = node.admission.enqueue(RunRequest(job="pair", gpu_count=2, memory_bytes=10 * GIB))
    (view,) = node.admission.explain()
    assert view.packing is not None and view.packing.k_eff == 0 and view.quote is None
    assert view.packing.pool_size == 1 and view.left_out == "GPU 0 unhealthy: GPU lost"
    (listed,) = node.admission.queue_views()
    assert listed.entry.id == entry.entry.id and listed.quote_s is None
    assert listed.unhealthy == "GPU 0 unhealthy: GPU lost"


def test_a_run_kept_behind_a_head_it_need_not_share_with_says_backfill_is_off(
    tmp_path: Path,
) -> None:
    """Backfill off; the head of the queue is pinned to GPU 1 and waits for it. A one-GPU
    run that fits on GPU 0 was told it waited behind 1 queued job "that need its devices",
    though the head needs none of them: it is told that backfill is off and which head
    no run passes."""
    node = make_node(tmp_path, Clock(), config=AdmissionConfig(backfill=False))
    try:
        _, second = (t.uuid for t in node.mps.targets())
        node.jobs.reserve(pinned("x", second))
        head = node.admission.enqueue(pinned("p", second))
        with pytest.raises(ResourceExhausted) as refused:
            node.jobs.reserve(whole("c"))
        assert str(refused.value) == (
            "job 'c' (1 GPU 60GiB) waits behind 1 queued job(s): backfill is off"
            f" (admission.backfill = false), none passes the head, p ({head.entry.id})"
        )
    finally:
        node.store.close()


def test_a_run_on_a_hung_gpu_past_its_estimate_does_not_withhold_the_quote_of_the_others(
    node: Node,
) -> None:
    """GPU 0 hangs with a on it, past its estimated run time; a two-GPU run heads the queue
    and c, a one-GPU run behind it, waits for GPU 1 alone (the class model left GPU 0 out).
    c got no quote, named as waiting on a's overrun, a run on a GPU that serves no class
    now: it is quoted from GPU 1, which nothing holds."""
    for _ in range(3):  # a history of the one-GPU class: 30 s runs
        run = node.jobs.reserve(whole("one")).reservation
        node.clock.now += 30.0
        node.jobs.release(run.id)
    node.jobs.reserve(whole("a"))  # on GPU 0
    node.clock.now += 100.0  # a ran past its estimate
    hung = gpu_sample(0)._replace(healthy=False, reason="driver call timed out")
    node.jobs.tick(snapshot(hung, gpu_sample(1)))
    node.admission.enqueue(whole("pair", 2))
    c = node.admission.enqueue(whole("c"))
    views = {v.entry.id: v for v in node.admission.queue_views()}
    assert views[c.entry.id].overdue == ()
    assert views[c.entry.id].quote_s is not None


def test_a_gpu_never_read_serves_none_and_the_entry_and_the_class_model_both_say_so(
    tmp_path: Path,
) -> None:
    """GPU 2 is lost and GPU 3 was never read since gpud started, though nothing marks it
    unhealthy now. A three-GPU run has GPUs 0 and 1 to run on: the class model left GPU 3
    out unnamed, while the entry counted it as a GPU that answers and so was not said to
    wait for any. Both leave out the same GPUs and name each."""
    store = StateStore(tmp_path / "state")
    events = EventLog(None)
    mps = MpsManager(store, events, tmp_path / "run", FAKE_CONTROL, enabled=False)
    unread = GpuSample(identity=placeholder_identity(3), healthy=True, reason="", sampled_at=None)
    lost = gpu_sample(2)._replace(healthy=False, reason="GPU lost")
    node = snapshot(gpu_sample(0), gpu_sample(1), lost, unread)
    mps.reconcile(node)
    clock = Clock()
    jobs = JobService(store, events, mps, socket_path=tmp_path / "gpud.sock", clock=clock)
    admission = AdmissionService(store, jobs, mps, events, AdmissionConfig(), clock=clock)
    try:
        jobs.tick(node)
        admission.enqueue(RunRequest(job="three", gpu_count=3, memory_bytes=70 * GIB))
        left_out = "GPU 2 unhealthy: GPU lost; GPU 3 never read since gpud started"
        (view,) = admission.explain()
        assert view.left_out == left_out
        (listed,) = admission.queue_views()
        assert listed.unhealthy == left_out and listed.quote_s is None
    finally:
        store.close()


def test_a_run_held_back_is_not_said_to_need_the_devices_of_a_lost_gpu(
    tmp_path: Path,
) -> None:
    """Backfill off; GPU 0 is lost, empty, and the head of the queue is pinned to it. A
    one-GPU run that fits on GPU 1 was said to wait behind a job "that need its devices":
    the lost GPU, full as the gate sees it, is none it fits on, and it is told that backfill
    is off."""
    node = make_node(tmp_path, Clock(), config=AdmissionConfig(backfill=False))
    try:
        first, _ = (t.uuid for t in node.mps.targets())
        lost = gpu_sample(0)._replace(healthy=False, reason="GPU lost")
        node.jobs.tick(snapshot(lost, gpu_sample(1)))
        head = node.admission.enqueue(pinned("p", first))
        with pytest.raises(ResourceExhausted) as refused:
            node.jobs.reserve(whole("c"))
        assert str(refused.value).endswith(
            f"backfill is off (admission.backfill = false), none passes the head, p ({head.entry.id})"
        )
    finally:
        node.store.close()


def test_an_enqueue_asked_again_with_its_request_id_is_one_entry_through_a_restart(
    node: Node,
) -> None:
    """A caller whose answer was lost asks again with the same request id and fields: it
    gets the entry it was queued as, through a gpud restart and once that entry started,
    and nothing more is queued; another id is another entry."""
    a = node.jobs.reserve(whole("a", 2)).reservation
    ask = replace(whole("b"), request_id="q-1")
    first = node.admission.enqueue(ask).entry
    again = node.admission.enqueue(ask).entry
    assert again.id == first.id and again.state == QUEUED
    assert [e.id for e in node.admission.entries()] == [first.id]
    assert len(node.events.recent(kind_prefix="admission.queue")) == 1
    node = node.restart()
    assert node.admission.enqueue(ask).entry.id == first.id
    node.jobs.release(a.id)
    node.admission.tick()
    started = node.admission.enqueue(ask)
    assert started.entry.id == first.id and started.entry.state == STARTED
    assert [r.job for r in node.jobs.reservations.held()] == ["b"]
    assert node.admission.entries() == []
    other = node.admission.enqueue(replace(ask, request_id="q-2")).entry
    assert other.id != first.id
    node.store.close()


# the queue as the version before request ids declared it
QUEUE_BEFORE_REQUEST_IDS = SCHEMA[0].replace(",\n        request_id TEXT,\n        asked TEXT", "")
assert SCHEMA[0] != QUEUE_BEFORE_REQUEST_IDS


def test_a_queue_from_before_request_ids_keeps_its_entries_and_takes_ids(tmp_path: Path) -> None:
    """A state.db whose admission_queue has no request_id or asked column: its entries
    stay queued, and an Enqueue asked again with its request id is one entry."""
    store = StateStore(tmp_path / "state")
    with store.transaction() as conn:
        conn.execute(QUEUE_BEFORE_REQUEST_IDS)
        conn.execute(
            "INSERT INTO admission_queue (id, job, request, enqueued_at, state, changed_at)"
            " VALUES ('e0', 'waits', ?, 990, 'queued', 990)",
            # never fits: it stays queued
            (run_request_to_json(RunRequest(job="waits", gpu_count=1, memory_bytes=1 << 62)),),
        )
    store.close()
    node = make_node(tmp_path, Clock())
    try:
        node.jobs.reserve(whole("a", 2))
        ask = replace(whole("b"), request_id="q-1")
        first = node.admission.enqueue(ask).entry
        assert node.admission.enqueue(ask).entry.id == first.id
        assert [e.id for e in node.admission.entries()] == ["e0", first.id]
    finally:
        node.store.close()


def test_a_request_id_queued_again_with_other_fields_is_refused_naming_it(node: Node) -> None:
    node.jobs.reserve(whole("a", 2))
    first = node.admission.enqueue(replace(whole("b"), request_id="q-1")).entry
    with pytest.raises(FailedPrecondition, match=r"request id 'q-1' was given to queue entry"):
        node.admission.enqueue(replace(whole("b", 2), request_id="q-1"))
    with pytest.raises(FailedPrecondition, match=r"request id 'q-1'"):
        node.admission.enqueue(replace(whole("b"), request_id="q-1"), keep_unfeasible=True)
    assert [e.id for e in node.admission.entries()] == [first.id]


def test_a_stored_request_leaves_its_request_id_to_its_own_column() -> None:
    """admission_queue.request and job_history.request hold no request id: a gpud from
    before request ids, started on the same state.db, builds its RunRequest from every key
    of the stored JSON."""
    stored = json.loads(run_request_to_json(replace(whole("b"), request_id="q-1")))
    assert "request_id" not in stored
    assert run_request_from_json(json.dumps(stored)) == whole("b")


def test_a_stored_request_with_a_field_this_gpud_lacks_is_read_without_it() -> None:
    """A row a newer gpud wrote (before a downgrade) carries a key this one has no field
    for: the request is read with the rest."""
    stored = json.loads(run_request_to_json(whole("b")))
    stored["from_a_newer_gpud"] = 1
    assert run_request_from_json(json.dumps(stored)) == whole("b")


def test_an_enqueue_with_a_request_id_that_could_not_be_kept_is_refused(node: Node) -> None:
    request = jobs_pb2.ReserveRequest(job="b", gpu_count=1, request_id="no spaces")
    with pytest.raises(InvalidArgument, match=r"^request\.request_id: "):
        run_request(request)


def test_a_sweep_of_memory_sizes_leaves_no_more_classified_requests_than_the_bound(
    tmp_path: Path,
) -> None:
    """Runs of a sweep, each asking another memory size, reserved, released and their jobs
    removed: once they are gone, the classifications the admission keeps are no more than
    DEMANDS_KEEP past the queue's."""
    node = make_node(tmp_path, Clock())
    for i in range(DEMANDS_KEEP + 300):
        name = f"sweep-{i}"
        run = RunRequest(job=name, gpu_count=1, memory_bytes=GIB + i * 2**20)
        node.jobs.release(node.jobs.reserve(run).reservation.id)
        node.jobs.remove(name)
        node.admission.tick()
    assert len(node.admission._demands) <= DEMANDS_KEEP
    node.store.close()
