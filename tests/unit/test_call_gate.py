"""The gate a stop closes on the API's calls that change the node (gpud.api.gate)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import grpc
import pytest

from gpud.api import ApiServer
from gpud.api.gate import CallGate, call_kind
from gpud.errors import Unavailable
from gpud.v1 import mig_pb2, node_pb2
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
