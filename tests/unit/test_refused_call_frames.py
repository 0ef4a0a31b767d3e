"""A refused call lets go of what its handler and servicer held (its request) without the
cyclic GC, yet the error it logs keeps where it came from, even when other calls share it."""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import pytest

from gpud.api.gate import CallGate
from gpud.api.interceptors import _wrap_stream_response, _wrap_unary_response
from gpud.errors import InvalidArgument

Handler = Callable[[Any, Any], Any]


class Request:
    """Stands for a decoded request: weakly referenced to see when it is freed."""

    def ListFields(self) -> list[Any]:  # protobuf's, which the bounds check calls
        return []


class Item:
    """Stands for a streamed response."""


class Context:
    """gRPC's servicer context, as far as the interceptor uses it."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code: grpc.StatusCode, details: str, metadata: Any) -> None:
        raise grpc.aio.AbortError(details)


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def _refuse(request: Request, context: Context) -> None:
    raise InvalidArgument("refused", field="jobs")


async def _refuse_in_a_group(request: Request, context: Context) -> None:
    async with asyncio.TaskGroup() as group:
        group.create_task(_refuse(request, context))


async def _yield_then_refuse(request: Request, context: Context) -> AsyncIterator[Item]:
    yield Item()
    raise InvalidArgument("refused", field="jobs")


# each drive takes the request from ``requests`` and weakly references what is streamed in
# ``held``: its own frame, in the AbortError's traceback as gRPC's are, holds neither


async def _unary(handler: Handler, requests: list[Request], held: list[weakref.ref[Any]]) -> None:
    await handler(requests.pop(), Context())


async def _streamed(
    handler: Handler, requests: list[Request], held: list[weakref.ref[Any]]
) -> None:
    async for item in handler(requests.pop(), Context()):
        held.append(weakref.ref(item))
        del item


CALLS = {
    "a unary call": ("/gpud.v1.ClusterPeer/Report", _wrap_unary_response, _refuse, _unary),
    # AddJob changes the node: gated, its work run to its end (_to_its_end) in a task
    "a gated changing call": ("/gpud.v1.Jobs/AddJob", _wrap_unary_response, _refuse, _unary),
    "a call whose error groups the refusal": (
        "/gpud.v1.ClusterPeer/Report",
        _wrap_unary_response,
        _refuse_in_a_group,
        _unary,
    ),
    "a server-streaming call": (
        "/gpud.v1.Events/Watch",
        _wrap_stream_response,
        _yield_then_refuse,
        _streamed,
    ),
}


@pytest.mark.parametrize("call", CALLS, ids=list(CALLS))
async def test_a_refused_call_frees_its_request_and_what_it_streamed_without_the_cyclic_gc(
    call: str, no_cyclic_gc: None
) -> None:
    # the AbortError that ends a refused call and gRPC's per-call state refer to each other,
    # freed by a full collection only: the refusal (its __context__) must not hold the
    # request through its traceback's frames, nor a streamed item through the handler's
    method, wrap, behavior, drive = CALLS[call]
    handler = wrap(behavior, method, None, None, CallGate())
    requests = [Request()]
    held: list[weakref.ref[Any]] = [weakref.ref(requests[0])]
    with pytest.raises(grpc.aio.AbortError) as aborted:
        await drive(handler, requests, held)
    abort_error = aborted.value  # as gRPC's per-call state holds it
    assert isinstance(abort_error.__context__, InvalidArgument | BaseExceptionGroup)
    assert len(held) == (2 if drive is _streamed else 1)
    assert [ref() for ref in held] == [None] * len(held)


async def test_calls_sharing_one_failed_read_each_log_where_it_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # GetEntry's waiters share one read, so one exception: the first refused must not take
    # from the others the traceback of what it chains
    def read() -> None:
        try:
            int("not a number")
        except ValueError as err:
            raise RuntimeError("the queue could not be read") from err

    shared = asyncio.ensure_future(asyncio.to_thread(read))

    async def get_entry(request: Request, context: Context) -> None:
        await asyncio.shield(shared)

    handler = _wrap_unary_response(get_entry, "/gpud.v1.Queue/GetEntry", None, None)
    caplog.set_level(logging.ERROR, logger="gpud.api.interceptors")

    async def waiter() -> None:
        with pytest.raises(grpc.aio.AbortError):
            await handler(Request(), Context())

    await asyncio.gather(waiter(), waiter())
    logged = [logging.Formatter().formatException(r.exc_info) for r in caplog.records if r.exc_info]
    assert len(logged) == 2
    for text in logged:
        assert 'int("not a number")' in text
        assert 'raise RuntimeError("the queue could not be read") from err' in text


async def test_a_loop_that_hands_its_error_to_waiters_outlives_a_call_refused_with_it() -> None:
    # a loop task that catches an error, gives it to each waiter and goes on is suspended
    # in that error's traceback: a refused call must not close it (frame.clear would)
    waiters: list[asyncio.Future[None]] = []
    wake = asyncio.Event()
    rounds: list[int] = []

    async def broadcast() -> None:
        while True:
            await wake.wait()
            wake.clear()
            try:
                raise RuntimeError("the queue could not be read")
            except RuntimeError as err:
                for waiter in waiters:
                    waiter.set_exception(err)
                waiters.clear()
                rounds.append(len(rounds))
                await asyncio.sleep(0)  # suspended here while the waiter's call is refused

    async def get_entry(request: Request, context: Context) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        wake.set()
        await waiter

    loop_task = asyncio.ensure_future(broadcast())
    handler = _wrap_unary_response(get_entry, "/gpud.v1.Queue/GetEntry", None, None)
    try:
        with pytest.raises(grpc.aio.AbortError):
            await handler(Request(), Context())
        # the next round: a loop gone would leave this waiter waiting for ever
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        wake.set()
        await asyncio.wait({waiter, loop_task}, return_when=asyncio.FIRST_COMPLETED)
        assert not loop_task.done()
        assert isinstance(waiter.exception(), RuntimeError)
        assert rounds == [0, 1]
    finally:
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)
