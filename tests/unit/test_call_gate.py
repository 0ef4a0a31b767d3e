"""The gate a stop closes on the API's calls that change the node (gpud.api.gate)."""

from __future__ import annotations

import ast
import asyncio
import gc
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from gpud.api import ApiServer
from gpud.api.gate import CallGate, call_kind
from gpud.api.interceptors import _named, _to_its_end
from gpud.errors import Unavailable
from gpud.threads import WORK_START, StartTellingExecutor, WorkStart, on_daemon_thread
from gpud.v1 import jobs_pb2, mig_pb2, node_pb2
from tests.unit.api_support import ServerThread, short_dir

APPLY = "/gpud.v1.Mig/ApplyMig"
RESERVE = "/gpud.v1.Jobs/Reserve"
RELEASE = "/gpud.v1.Jobs/Release"
LEAVE = "/gpud.v1.Queue/Leave"
SHOW = "/gpud.v1.Mig/ShowMig"
ADVISE = "/gpud.v1.Colocation/Advise"


async def _hold(gate: CallGate, method: str, release: asyncio.Event) -> None:
    with gate.call(method):
        await release.wait()


def test_what_the_gate_counts_and_refuses() -> None:
    assert call_kind(APPLY, mig_pb2.ApplyMigRequest()) == "starts"
    assert call_kind(APPLY, mig_pb2.ApplyMigRequest(dry_run=True)) is None
    assert call_kind(RESERVE, None) == "starts"
    assert call_kind("/gpud.v1.Mps/SetMpsLimits", None) == "starts"
    assert call_kind("/gpud.v1.Mig/ForgetMig", mig_pb2.ForgetMigRequest()) == "starts"
    assert call_kind(RELEASE, None) == "ends"
    assert call_kind(LEAVE, None) == "ends"
    assert call_kind(SHOW, None) is None
    assert call_kind(ADVISE, None) is None
    assert call_kind("/gpud.v1.Net/ReportProgress", None) is None


async def test_a_release_during_the_drain_is_taken_and_waited_for() -> None:
    """Node shutdown stops gpud and `gpuctl run` together: the run's Release, sent while gpud
    drains its running calls, is served (its exit status is kept), and waited for; a new
    Reserve is refused."""
    gate = CallGate()
    gate.close()
    refused = pytest.raises(Unavailable, match="gpud is stopping: Reserve was not started")
    with refused, gate.call(RESERVE):
        pass
    release = asyncio.Event()
    task = asyncio.create_task(_hold(gate, RELEASE, release))
    await asyncio.sleep(0)
    assert gate.running == 1
    assert not await gate.drained(0.05)
    with gate.call(LEAVE):
        assert gate.running == 2
    release.set()
    await task
    assert await gate.drained(1.0)


async def test_reads_advise_and_dry_runs_are_served_while_closed_and_not_counted() -> None:
    gate = CallGate()
    gate.close()
    for method, request in [
        (SHOW, None),
        (ADVISE, None),
        (APPLY, mig_pb2.ApplyMigRequest(dry_run=True)),
    ]:
        with gate.call(method, request):
            assert gate.running == 0
    assert await gate.drained(0.0)


async def test_a_call_cancelled_midway_is_no_longer_counted() -> None:
    """A client that goes away mid-call: its handler is cancelled, the count drops."""
    gate = CallGate()
    task = asyncio.create_task(_hold(gate, RESERVE, asyncio.Event()))
    await asyncio.sleep(0)
    assert gate.running == 1
    gate.close()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.running == 0
    assert await gate.drained(1.0)


async def test_drained_times_out_while_a_call_runs_and_a_cut_ends_it_at_once() -> None:
    gate = CallGate()
    release = asyncio.Event()
    task = asyncio.create_task(_hold(gate, APPLY, release))
    await asyncio.sleep(0)
    gate.close()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert not await gate.drained(0.1)
    assert 0.09 <= loop.time() - t0 < 1.0
    assert gate.running == 1
    # a second SIGTERM: the wait ends at once, however long it was to be
    loop.call_later(0.05, gate.cut)
    t0 = loop.time()
    assert not await gate.drained(30.0)
    assert loop.time() - t0 < 1.0
    release.set()
    await task
    assert gate.running == 0


async def _cancelling() -> bool:
    return any(task.cancelling() for task in asyncio.all_tasks())


def test_a_change_whose_caller_went_away_midway_runs_to_its_end_and_is_counted_till_then() -> None:
    # gRPC cancels a handler at its next await once its caller is gone: the change its worker
    # thread made stood, but what the handler did after it (the event saying so) never ran,
    # and a stop's drain no longer waited for it.
    started, go_on, finished = (threading.Event() for _ in range(3))

    def change() -> None:
        started.set()
        go_on.wait(30)

    async def inject(request: node_pb2.InjectFaultRequest, context: Any) -> Any:
        await asyncio.to_thread(change)  # the change, on a worker thread
        finished.set()  # what follows it on the loop: its event
        return node_pb2.InjectFaultResponse()

    handler = grpc.method_handlers_generic_handler(
        "gpud.v1.Node",
        {
            "InjectFault": grpc.unary_unary_rpc_method_handler(
                inject,
                request_deserializer=node_pb2.InjectFaultRequest.FromString,
                response_serializer=node_pb2.InjectFaultResponse.SerializeToString,
            )
        },
    )
    gate = CallGate()
    with short_dir() as d:
        path = d / "gpud.sock"
        registrar = lambda server: server.add_generic_rpc_handlers((handler,))  # noqa: E731
        with (
            ServerThread(ApiServer(path, servicers=[registrar], gate=gate)) as served,
            grpc.insecure_channel(f"unix:{path}") as channel,
        ):
            call = channel.unary_unary(
                "/gpud.v1.Node/InjectFault",
                request_serializer=node_pb2.InjectFaultRequest.SerializeToString,
                response_deserializer=node_pb2.InjectFaultResponse.FromString,
            ).future(node_pb2.InjectFaultRequest(), timeout=60)
            assert started.wait(30)
            call.cancel()
            for _ in range(3000):  # until gRPC has cancelled the handler's task
                if served.run(_cancelling()):
                    break
                time.sleep(0.01)
            assert gate.running == 1  # a stop still waits for it
            go_on.set()
            assert finished.wait(30)
            assert served.run(gate.drained(30))


INJECT = "/gpud.v1.Node/InjectFault"


def _inject_handler(inject: Any) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "gpud.v1.Node",
        {
            "InjectFault": grpc.unary_unary_rpc_method_handler(
                inject,
                request_deserializer=node_pb2.InjectFaultRequest.FromString,
                response_serializer=node_pb2.InjectFaultResponse.SerializeToString,
            )
        },
    )


def _injecting(channel: grpc.Channel) -> Any:
    return channel.unary_unary(
        INJECT,
        request_serializer=node_pb2.InjectFaultRequest.SerializeToString,
        response_deserializer=node_pb2.InjectFaultResponse.FromString,
    )


def _until_cancelled(served: ServerThread, gate: CallGate, left: int = 1) -> None:
    for _ in range(3000):  # until gRPC has cancelled the handler's task (or it ended)
        if served.run(_cancelling()) or gate.running < left + 1:
            return
        time.sleep(0.01)
    raise AssertionError("gRPC never cancelled the handler")


async def _use_pool(pool: StartTellingExecutor) -> None:
    asyncio.get_running_loop().set_default_executor(pool)


def test_a_change_queued_behind_busy_workers_is_never_made_once_its_caller_gave_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # One worker, busy with call A's change; call B's change waits for it. B's caller gives
    # up (its deadline, gpuctl cut off) and is told the call failed: B's change must not be
    # made later, once A's frees the worker (a reservation said failed yet holding GPUs).
    caplog.set_level(logging.INFO, logger="gpud.api.interceptors")
    a_started, go_on = threading.Event(), threading.Event()
    b_queued = threading.Event()
    made: list[int] = []

    def change(gpu: int) -> None:
        if gpu == 0:
            a_started.set()
            go_on.wait(30)
        made.append(gpu)

    async def inject(request: node_pb2.InjectFaultRequest, context: Any) -> Any:
        if request.gpu == 1:
            b_queued.set()  # its to_thread is submitted right after, on this loop turn
        await asyncio.to_thread(change, request.gpu)
        return node_pb2.InjectFaultResponse()

    gate = CallGate()
    pool = StartTellingExecutor(max_workers=1)
    with short_dir() as d:
        path = d / "gpud.sock"
        registrar = lambda server: server.add_generic_rpc_handlers(  # noqa: E731
            (_inject_handler(inject),)
        )
        try:
            with (
                ServerThread(ApiServer(path, servicers=[registrar], gate=gate)) as served,
                grpc.insecure_channel(f"unix:{path}") as channel,
            ):
                served.run(_use_pool(pool))
                a = _injecting(channel).future(node_pb2.InjectFaultRequest(gpu=0), timeout=60)
                assert a_started.wait(30)
                b = _injecting(channel).future(node_pb2.InjectFaultRequest(gpu=1), timeout=60)
                assert b_queued.wait(30)
                b.cancel()
                _until_cancelled(served, gate)
                go_on.set()
                a.result(30)
                assert served.run(gate.drained(30))
                pool.submit(lambda: None).result(30)  # one worker: B's would have run first
                assert made == [0]
                dropped = "InjectFault (its caller gone): dropped while queued for a worker"
                assert f"{dropped}: not made (gpu=1)" in caplog.text
        finally:
            go_on.set()
            pool.shutdown(wait=True)


@dataclass
class _Departed:
    """A changing call whose caller went away while its worker thread runs its change."""

    served: ServerThread
    gate: CallGate
    go_on: threading.Event  # its thread ends
    thread_done: threading.Event
    finished: threading.Event  # what follows the thread on the loop ran


@contextmanager
def _departed_call() -> Iterator[_Departed]:
    started, go_on, thread_done, finished = (threading.Event() for _ in range(4))
    gate = CallGate()

    def change() -> None:
        started.set()
        go_on.wait(30)
        thread_done.set()

    async def inject(request: node_pb2.InjectFaultRequest, context: Any) -> Any:
        await asyncio.to_thread(change)
        finished.set()  # what follows it on the loop: its event, the store
        return node_pb2.InjectFaultResponse()

    with short_dir() as d:
        path = d / "gpud.sock"
        registrar = lambda server: server.add_generic_rpc_handlers(  # noqa: E731
            (_inject_handler(inject),)
        )
        with (
            ServerThread(ApiServer(path, servicers=[registrar], gate=gate)) as served,
            grpc.insecure_channel(f"unix:{path}") as channel,
        ):
            departed = _Departed(served, gate, go_on, thread_done, finished)
            try:
                call = _injecting(channel).future(node_pb2.InjectFaultRequest(), timeout=60)
                assert started.wait(30)
                call.cancel()
                _until_cancelled(served, gate, left=0)
                yield departed
            finally:
                departed.go_on.set()


def _the_rest_never_ran(departed: _Departed) -> None:
    departed.go_on.set()
    assert departed.thread_done.wait(30)
    departed.served.run(asyncio.sleep(0.01))  # the loop turns its worker's result gets
    assert not departed.finished.is_set()


def test_the_rest_of_a_call_whose_caller_went_away_is_cut_when_the_stop_gives_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The stop's drain gave up on it: what follows its worker thread (its event, the store)
    # must not run once the event log, the store and the driver close.
    with _departed_call() as departed:
        gate, served = departed.gate, departed.served
        assert gate.running == 1
        assert served.run(gate.cut_held(30)) == 1
        assert served.run(gate.drained(30))
        _the_rest_never_ran(departed)
    assert "InjectFault (its caller gone): cut at the stop (gpu=0)" in caplog.text


async def _until_idle(gate: CallGate) -> bool:
    for _ in range(500):  # until its handler has taken the cancel
        if gate.running == 0:
            return True
        await asyncio.sleep(0.01)
    return False


async def _cancel_again() -> None:
    for task in asyncio.all_tasks():
        if task.cancelling():
            task.cancel()


def test_a_call_whose_caller_went_away_is_not_waited_for_once_cancelled_again() -> None:
    """gRPC cancels its handler again when the server's grace ends."""
    with _departed_call() as departed:
        departed.served.run(_cancel_again())
        assert departed.served.run(_until_idle(departed.gate))
        _the_rest_never_ran(departed)


class _Pool(StartTellingExecutor):
    """The loop's pool, one worker, saying when work was handed to it."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.submitted = threading.Event()

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        future = super().submit(fn, *args, **kwargs)
        self.submitted.set()
        return future


@contextmanager
def _one_busy_worker() -> Iterator[tuple[_Pool, threading.Event]]:
    """The loop's pool, its one worker busy until the event is set."""
    pool = _Pool()
    free = threading.Event()
    asyncio.get_running_loop().set_default_executor(pool)
    pool.submit(free.wait, 30)
    pool.submitted.clear()
    try:
        yield pool, free
    finally:
        free.set()
        pool.shutdown(wait=True)


async def _until(pool: _Pool) -> None:
    for _ in range(3000):  # until the call handed its step to the pool
        if pool.submitted.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the call never reached the pool")


async def test_a_call_whose_first_step_ran_elsewhere_is_run_whole_once_its_caller_went_away() -> (
    None
):
    # its first step on a pool of its own, its second queued behind the loop's busy worker:
    # dropped there, the first step's change stood without the rest (half-made)
    made: list[str] = []
    loop = asyncio.get_running_loop()
    with _one_busy_worker() as (pool, free), ThreadPoolExecutor(1) as own:

        async def call() -> None:
            await loop.run_in_executor(own, made.append, "first")
            await asyncio.to_thread(made.append, "second")

        held = asyncio.create_task(_to_its_end(call(), INJECT, None))
        await _until(pool)
        held.cancel()
        await asyncio.sleep(0)
        free.set()
        with pytest.raises(asyncio.CancelledError):
            await held
    assert made == ["first", "second"]


async def test_a_task_a_dropped_call_started_still_gets_its_worker_steps_run() -> None:
    # the task carries the call's context: its steps were skipped, each one CancelledError
    made: list[str] = []
    later = asyncio.Event()
    background: list[asyncio.Task[None]] = []

    async def in_background() -> None:
        await later.wait()
        await asyncio.to_thread(made.append, "background")

    with _one_busy_worker() as (pool, free):

        async def call() -> None:
            background.append(asyncio.create_task(in_background()))
            await asyncio.to_thread(made.append, "call")

        held = asyncio.create_task(_to_its_end(call(), INJECT, None))
        await _until(pool)
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held
        free.set()
        later.set()
        await background[0]
        pool.submit(lambda: None).result(30)  # one worker: the call's would have run first
    assert made == ["background"]


async def test_a_stop_that_cuts_a_call_waits_for_its_worker_thread_before_the_store_closes() -> (
    None
):
    # the cancel ends the call's task at once; its worker thread, in service.release() or
    # the driver, goes on, and the store closed under it
    gate = CallGate()
    started, go_on, ended = (threading.Event() for _ in range(3))

    def step() -> None:
        started.set()
        go_on.wait(30)
        ended.set()

    async def call() -> None:
        await asyncio.to_thread(step)

    pool = StartTellingExecutor(max_workers=1)
    asyncio.get_running_loop().set_default_executor(pool)
    try:
        held = asyncio.create_task(_to_its_end(call(), INJECT, gate))
        while not started.is_set():
            await asyncio.sleep(0.01)
        held.cancel()  # its caller went away: held on
        await asyncio.sleep(0)
        cut = asyncio.create_task(gate.cut_held(30))
        with pytest.raises(asyncio.CancelledError):
            await held
        for _ in range(20):
            await asyncio.sleep(0)
        assert not cut.done()  # the thread still runs
        go_on.set()
        assert await cut == 1
        assert ended.is_set()
    finally:
        go_on.set()
        pool.shutdown(wait=True)


def _race(start: WorkStart) -> dict[str, bool]:
    """A worker's begin and the loop's drop, let go at once on two threads."""
    results: dict[str, bool] = {}
    go = threading.Barrier(2)

    def side(name: str, act: Any) -> None:
        go.wait(5)
        results[name] = act()

    threads = [
        threading.Thread(target=side, args=("begin", start.begin)),
        threading.Thread(target=side, args=("drop", start.drop)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return results


def test_a_worker_taking_the_work_and_the_loop_dropping_it_never_both_win() -> None:
    for _ in range(500):
        start = WorkStart()
        start.queued()  # behind busy workers
        results = _race(start)
        assert results["begin"] != results["drop"]
        assert start.begun == results["begin"]


class _Stuck:
    """A held call's threads, one stuck in the driver: counts how often a stop looks."""

    def __init__(self) -> None:
        self.looks = 0
        self.thread: Future[None] = Future()

    def __call__(self) -> list[Future[Any]]:
        self.looks += 1
        return [] if self.thread.done() else [self.thread]


async def test_the_stops_two_cuts_wait_for_a_hung_worker_thread_once() -> None:
    # the second cut (after the API stopped) polled the same stuck thread to its own
    # deadline again: a hung driver call held the stop up twice CUT_CALLS_WAIT_S
    gate = CallGate()
    stuck = _Stuck()
    work = asyncio.ensure_future(asyncio.Event().wait())
    gate.hold(work, stuck)
    assert await gate.cut_held(0.05) == 1
    looked = stuck.looks
    assert await gate.cut_held(0.2) == 0
    assert stuck.looks <= looked + 1  # looked at, not polled to its deadline again


async def test_a_second_cut_still_waits_for_the_threads_of_a_call_it_cut_itself() -> None:
    gate = CallGate()
    first, second = _Stuck(), _Stuck()
    gate.hold(asyncio.ensure_future(asyncio.Event().wait()), first)
    await gate.cut_held(0.02)
    gate.hold(asyncio.ensure_future(asyncio.Event().wait()), second)
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, second.thread.set_result, None)
    assert await gate.cut_held(30) == 1
    assert second.thread.done()


async def test_a_thread_a_cut_call_starts_after_the_first_cut_is_waited_for_by_the_second() -> None:
    # the second cut skipped every thread of a call the first one had waited for, the one
    # its cleanup handed work to afterwards included
    gate = CallGate()
    hung: Future[None] = Future()
    later: Future[None] = Future()
    threads = [hung]
    gate.hold(asyncio.ensure_future(asyncio.Event().wait()), lambda: list(threads))
    assert await gate.cut_held(0.05) == 1
    threads.append(later)
    asyncio.get_running_loop().call_later(0.1, later.set_result, None)
    await gate.cut_held(1.0)
    assert later.done()
    assert not hung.done()


async def test_threads_of_calls_long_ended_are_not_kept_for_the_stop() -> None:
    gate = CallGate()
    for _ in range(3):
        left = _Stuck()
        work = asyncio.ensure_future(asyncio.sleep(0))
        gate.hold(work, left)
        await work
        await asyncio.sleep(0)  # its done callback
        left.thread.set_result(None)  # its worker thread ended since
    gate.hold(asyncio.ensure_future(asyncio.sleep(0)), list)
    assert gate._left == []


async def test_a_daemon_thread_that_never_started_is_not_waited_for_at_the_stop() -> None:
    def no_thread(**_: Any) -> threading.Thread:
        raise RuntimeError("can't start new thread")

    start = WorkStart()
    WORK_START.set(start)
    with pytest.raises(RuntimeError):
        await on_daemon_thread(lambda: None, spawn=no_thread)
    assert start.threads() == []


async def test_a_finished_calls_work_start_is_freed_without_the_cycle_collector() -> None:
    # its task's context held it, and it held the task: each changing call's task, request
    # and frames stayed until the cyclic collector ran
    seen: list[weakref.ref[WorkStart]] = []

    async def call() -> None:
        start = WORK_START.get()
        assert start is not None
        seen.append(weakref.ref(start))
        await asyncio.to_thread(lambda: None)

    gc.collect()
    gc.disable()
    try:
        await _to_its_end(call(), INJECT, None)
        for _ in range(3):
            await asyncio.sleep(0)
        assert seen[0]() is None
    finally:
        gc.enable()


def test_a_callers_string_in_a_cut_line_is_escaped_and_clipped() -> None:
    forged = "a\n2026-12-07 16:00:00 gpud: fake " + "x" * 4000
    named = _named(jobs_pb2.ReserveRequest(job=forged))
    assert "\n" not in named
    assert named.startswith("job='a\\n2026")
    assert len(named) <= len("job=") + 64 and named.endswith("...")
    assert named.isascii()
    assert _named(jobs_pb2.ReserveRequest(job="train")) == "job=train"


def test_a_clipped_string_ends_on_a_whole_escape_and_reads_back_as_its_start() -> None:
    # the escaped form was cut at 63 characters, an "\\xe9" in two, and marked with a
    # character that is not ASCII on a line kept ASCII
    value = "\xe9" * 100
    named = _named(jobs_pb2.ReserveRequest(job=value))
    assert named.isascii() and named.endswith("...")
    assert len(named) <= len("job=") + 64
    shown = named.removeprefix("job=").removesuffix("...")
    kept = ast.literal_eval(shown)
    assert kept and value.startswith(kept)


async def test_a_dropped_calls_own_cleanup_still_runs() -> None:
    # its change was dropped while queued; its finally's undo, handed on after, was skipped
    made: list[str] = []
    with _one_busy_worker() as (pool, free):

        async def call() -> None:
            try:
                await asyncio.to_thread(made.append, "change")
            finally:
                await asyncio.to_thread(made.append, "undo")

        held = asyncio.create_task(_to_its_end(call(), INJECT, None))
        await _until(pool)
        held.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        free.set()
        with pytest.raises(asyncio.CancelledError):
            await held
    assert made == ["undo"]
