"""Following the event log: sequence numbers, watchers and their bounded buffers, the
WatchEvents stream, and ``gpuctl events --follow`` across a restart and into ``| head``."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO, Any

import grpc
import pytest

from gpud.api import ApiServer
from gpud.events import EventLog
from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc
from tests.unit.api_support import ServerThread, make_servicer, short_dir


def _log(path: Path | None = None) -> EventLog:
    log = EventLog(path)
    log.emit("gpu.unhealthy", "GPU 2 lost", gpu=2)
    log.emit("mig.apply", "applied on GPU 1", gpu=1)
    log.emit("gpu.healthy", "GPU 2 back", gpu=2)
    return log


def test_events_are_numbered_on_across_a_restart_and_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    first = _log(path)
    assert [e.seq for e in first.recent()] == [1, 2, 3]
    assert json.loads(path.read_text().splitlines()[-1])["seq"] == 3
    again = EventLog(path)
    assert [e.seq for e in again.recent()] == [1, 2, 3]
    assert again.emit("job.add", "a", job="a").seq == 4
    path.replace(path.with_suffix(".jsonl.1"))  # rotated, then gpud restarts
    assert EventLog(path).emit("job.add", "b", job="b").seq == 5
    # a line of a gpud before the field: no number; those after it are numbered from 1
    older = tmp_path / "older.jsonl"
    older.write_text('{"time": 1.0, "kind": "job.add", "message": "old", "job": "c"}\n')
    log = EventLog(older)
    assert [e.seq for e in log.recent()] == [0]
    assert log.recent()[0].fields == {"job": "c"}
    assert log.emit("job.add", "new").seq == 1


def test_a_watcher_starts_where_asked_and_counts_what_it_could_not_hold() -> None:
    log, woken = _log(), []
    watcher, start, gap = log.watch(lambda: woken.append(1), kind_prefix="gpu.", limit=1)
    assert [e.message for e in start] == ["GPU 2 back"] and gap == 0
    for i in range(5):
        log.emit("gpu.unhealthy", f"lost {i}", gpu=i)
    log.emit("mig.apply", "not a gpu. event")
    assert len(woken) == 5
    assert log.take(watcher) == (log.recent(5, "gpu.unhealthy")[:], 0, False)
    small, _, _ = log.watch(lambda: None, buffer=2)
    for i in range(5):
        log.emit("job.add", f"job {i}", job=str(i))
    events, missed, closed = log.take(small)
    assert [e.message for e in events] == ["job 0", "job 1"] and missed == 3 and not closed
    log.unwatch(watcher)
    log.emit("gpu.healthy", "unwatched", gpu=0)
    assert len(woken) == 5
    log.close_watchers()  # what it holds is still given, and then it is done
    assert [e.message for e in log.take(small)[0]] == ["unwatched"]
    assert log.take(small) == ([], 0, True)


def test_a_watcher_resumes_after_a_number_and_says_what_the_ring_lost() -> None:
    log = EventLog(None, keep=3)
    for i in range(6):
        log.emit("job.add", f"job {i}", job=str(i))  # seq 1..6; the ring keeps 4..6
    _, start, gap = log.watch(lambda: None, after_seq=4)
    assert [e.seq for e in start] == [5, 6] and gap == 0
    _, start, gap = log.watch(lambda: None, after_seq=1)
    assert [e.seq for e in start] == [4, 5, 6] and gap == 2
    _, start, gap = log.watch(lambda: None, after_seq=6)
    assert start == [] and gap == 0
    # a number this log never gave (its file was removed): the newest `limit`, as without one
    _, start, gap = log.watch(lambda: None, after_seq=99, limit=2)
    assert [e.seq for e in start] == [5, 6] and gap == 0


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with short_dir() as d:
        yield d


async def _serve(path: Path, log: EventLog, **options: Any) -> ApiServer:
    server = ApiServer(path, servicers=[make_servicer(events=log, **options).register])
    await server.start()
    return server


@pytest.fixture
async def served(sock_dir: Path) -> AsyncIterator[tuple[EventLog, pb_grpc.NodeStub]]:
    log = _log()
    server = await _serve(sock_dir / "gpud.sock", log, watch_buffer=3, max_event_watchers=2)
    async with grpc.aio.insecure_channel(f"unix:{sock_dir / 'gpud.sock'}") as ch:
        yield log, pb_grpc.NodeStub(ch)
    await server.stop(0)


def _said(item: pb.WatchEventsResponse) -> str:
    return item.event.message if item.WhichOneof("item") == "event" else f"missed {item.missed}"


async def test_watch_sends_the_newest_then_each_new_one_with_the_filters(
    served: tuple[EventLog, pb_grpc.NodeStub],
) -> None:
    log, stub = served
    stream = stub.WatchEvents(pb.WatchEventsRequest(kind_prefix="gpu.", gpu="2", limit=1))
    first = await stream.read()
    assert first.event.message == "GPU 2 back" and first.event.seq == 3
    log.emit("gpu.unhealthy", "GPU 1 lost", gpu=1)
    log.emit("mig.apply", "about GPU 2, not gpu.", gpu=2)
    log.emit("gpu.unhealthy", "GPU 2 lost again", gpu=2)
    item = await stream.read()
    assert (item.event.message, item.event.seq) == ("GPU 2 lost again", 6)
    stream.cancel()


async def test_a_slow_watcher_is_told_how_many_it_missed_and_goes_on(
    served: tuple[EventLog, pb_grpc.NodeStub],
) -> None:
    log, stub = served
    stream = stub.WatchEvents(pb.WatchEventsRequest(kind_prefix="job."))
    await stream.initial_metadata()
    for i in range(10):  # all at once: the stream cannot take one before the buffer is full
        log.emit("job.add", f"job {i}", job=str(i))
    said = [_said(await stream.read()) for _ in range(4)]
    assert said == ["job 0", "job 1", "job 2", "missed 7"]
    log.emit("job.add", "after", job="x")
    assert _said(await stream.read()) == "after"
    stream.cancel()


async def test_watchers_past_the_cap_are_refused_naming_it(
    served: tuple[EventLog, pb_grpc.NodeStub],
) -> None:
    _, stub = served
    held = [stub.WatchEvents(pb.WatchEventsRequest()) for _ in range(2)]
    for stream in held:
        await stream.initial_metadata()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.WatchEvents(pb.WatchEventsRequest()).read()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the most gpud serves at once (2)" in (err.value.details() or "")
    held[0].cancel()
    for _ in range(100):  # the server sees the cancel shortly
        again = stub.WatchEvents(pb.WatchEventsRequest(limit=1))
        try:
            assert (await again.read()).event.message == "GPU 2 back"
            break
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.02)
    else:
        pytest.fail("a watcher ended still counts")
    again.cancel()
    held[1].cancel()


async def test_the_stream_ends_when_gpud_stops(
    served: tuple[EventLog, pb_grpc.NodeStub],
) -> None:
    log, stub = served
    stream = stub.WatchEvents(pb.WatchEventsRequest(kind_prefix="job."))
    await stream.initial_metadata()
    log.emit("job.add", "last", job="a")
    log.close_watchers()  # what the daemon does first when it stops
    assert _said(await stream.read()) == "last"
    assert await stream.read() == grpc.aio.EOF
    assert await stream.code() == grpc.StatusCode.OK


def _gpuctl(sock: Path, *argv: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gpud.cli.main", "--socket", str(sock), "events", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _end(child: subprocess.Popen[str]) -> None:
    child.kill()
    child.wait(10)
    for pipe in (child.stdout, child.stderr):
        if pipe is not None:
            pipe.close()


def _line(stream: IO[str] | None) -> str:
    assert stream is not None
    return stream.readline().rstrip("\n")


def _served(sock: Path, log: EventLog) -> ServerThread:
    return ServerThread(ApiServer(sock, servicers=[make_servicer(events=log).register]))


def test_follow_goes_on_across_a_restart_of_gpud(sock_dir: Path) -> None:
    sock, state = sock_dir / "gpud.sock", sock_dir / "events.jsonl"
    log = _log(state)
    child = _gpuctl(sock, "--follow", "--json", "--kind", "gpu.")
    try:
        with _served(sock, log):
            seen = [json.loads(_line(child.stdout)) for _ in range(2)]
            assert [(e["seq"], e["message"]) for e in seen] == [
                (1, "GPU 2 lost"),
                (3, "GPU 2 back"),
            ]
        assert _line(child.stderr) == (
            "gpuctl: gpud stopped: reconnecting until it is back (Ctrl-C ends)"
        )
        # emitted after gpuctl's last event: the next gpud keeps it (its file), not missed
        log.emit("gpu.unhealthy", "while away", gpu=0)
        time.sleep(0.5)  # gpud is down a while: gpuctl tries again meanwhile
        log = EventLog(state)
        with _served(sock, log):
            assert _line(child.stderr) == "gpuctl: gpud is back: following again"
            assert json.loads(_line(child.stdout))["message"] == "while away"
            log.emit("gpu.healthy", "after", gpu=0)  # from another thread than the server's
            after = json.loads(_line(child.stdout))
            assert (after["seq"], after["message"]) == (5, "after")
            child.send_signal(signal.SIGINT)
            _, err = child.communicate(timeout=10)
    finally:
        _end(child)
    assert child.returncode == 130 and err == ""  # Ctrl-C: quiet


def test_follow_into_head_ends_once_head_has_gone(sock_dir: Path) -> None:
    """``gpuctl events --follow | head -2``: head exits while gpuctl waits for events."""
    sock = sock_dir / "gpud.sock"
    with _served(sock, _log()):
        child = _gpuctl(sock, "--follow", "--limit", "2")
        try:
            assert "GPU 2 lost" not in _line(child.stdout)  # the newest 2 only
            assert "GPU 2 back" in _line(child.stdout)
            assert child.stdout is not None
            child.stdout.close()  # what head does after its lines
            assert child.wait(timeout=10) == 141
            assert child.stderr is not None and child.stderr.read() == ""
        finally:
            _end(child)
