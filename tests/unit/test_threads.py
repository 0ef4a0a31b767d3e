"""The event loop's waits (the first of several events, or a timeout) and its worker pool."""

from __future__ import annotations

import asyncio
import gc
import weakref

from gpud.main import serve_until_stopped
from gpud.threads import WORK_START, WorkStart, wait_first


def test_gpuds_loop_says_when_an_api_calls_work_began_on_a_worker() -> None:
    # what lets a changing call whose caller gave up be dropped while still queued
    start = WorkStart()

    async def call() -> int:
        WORK_START.set(start)
        await asyncio.to_thread(lambda: None)
        return 0

    assert serve_until_stopped(call()) == 0
    assert start.begun
    assert not start.drop()  # begun: it runs to its end


async def test_a_loop_callback_is_not_the_call_once_the_calls_task_is_gone() -> None:
    # both the collected owner and current_task() in a callback read as None, and None is
    # None: the callback was taken for the call's own task
    start = WorkStart()

    async def call() -> None:
        start.own()

    gone = weakref.ref(asyncio.ensure_future(call()))
    await asyncio.sleep(0)  # it runs, and nothing keeps it
    gc.collect()
    assert gone() is None
    seen: list[bool] = []
    asyncio.get_running_loop().call_soon(lambda: seen.append(start.owned_here()))
    await asyncio.sleep(0)
    assert seen == [False]


async def test_wait_first_ends_at_the_first_event_set_and_leaves_no_wait_behind() -> None:
    stop, reload = asyncio.Event(), asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, reload.set)
    before = len(asyncio.all_tasks())
    await asyncio.wait_for(wait_first(stop, reload, timeout=30), 5)
    assert reload.is_set() and not stop.is_set()
    await asyncio.sleep(0)  # the cancelled waits end
    assert len(asyncio.all_tasks()) == before


async def test_wait_first_ends_at_the_timeout_with_none_set() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await wait_first(stop, timeout=0.05)
    assert not stop.is_set() and loop.time() - started >= 0.04
