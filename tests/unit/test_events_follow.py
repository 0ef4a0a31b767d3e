"""Following the event log: sequence numbers, watchers and their bounded buffers, the
WatchEvents stream, and ``gpuctl events --follow`` across a restart and into ``| head``."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO, Any

import grpc
import pytest

from gpud.api import ApiServer, convert
from gpud.cli.context import Context
from gpud.cli.events import _follow_line
from gpud.cli.output import Output
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
    assert len(woken) == 1  # once its buffer is given an event: the rest wait with it
    assert log.take(watcher) == (log.recent(5, "gpu.unhealthy")[:], 0, False)
    log.emit("gpu.healthy", "taken, then one more", gpu=0)
    assert len(woken) == 2 and len(log.take(watcher)[0]) == 1
    small, _, _ = log.watch(lambda: None, buffer=2)
    for i in range(5):
        log.emit("job.add", f"job {i}", job=str(i))
    events, missed, closed = log.take(small)
    assert [e.message for e in events] == ["job 0", "job 1"] and missed == 3 and not closed
    log.unwatch(watcher)
    log.emit("gpu.healthy", "unwatched", gpu=0)
    assert len(woken) == 2
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


@pytest.mark.parametrize(
    ("asked", "field", "words"),
    [
        ({"gpu": "{8..;$/5"}, "gpu", "expected a GPU index or a GPU-/MIG- UUID, got '{8..;$/5'"),
        ({"gpu": "-1"}, "gpu", "got '-1'"),
        ({"job": "a\nb"}, "job", "'a\\nb': letters, digits"),
        ({"job": "x" * 300}, "job", "(300 characters)"),
    ],
)
async def test_an_event_filter_that_can_match_nothing_is_refused_naming_it(
    served: tuple[EventLog, pb_grpc.NodeStub], asked: dict[str, str], field: str, words: str
) -> None:
    # a watch of it would wait forever, a listing say nothing, as if it had no history
    _, stub = served
    for call in (
        lambda: stub.ListEvents(pb.ListEventsRequest(**asked)),
        lambda: stub.WatchEvents(pb.WatchEventsRequest(**asked)).read(),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call(), 10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details() or ""
        assert details.startswith(f"{field}: ") and words in details, details


@pytest.mark.parametrize("after_time", [math.nan, math.inf, -1.0])
async def test_a_watch_resuming_after_no_time_there_is_refused_naming_it(
    served: tuple[EventLog, pb_grpc.NodeStub], after_time: float
) -> None:
    _, stub = served
    stream = stub.WatchEvents(
        pb.WatchEventsRequest(after_seq=2, after_time_unix_seconds=after_time)
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(stream.read(), 10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("after_time_unix_seconds: ")


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
    assert (
        "2 event watchers on gpud's unix socket already, the most gpud serves there at once (2)"
        in (err.value.details() or "")
    )
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


async def test_watchers_over_tcp_never_take_the_sockets_places(sock_dir: Path) -> None:
    log = _log()
    server = ApiServer(
        sock_dir / "gpud.sock",
        tcp_address="127.0.0.1:0",
        servicers=[make_servicer(events=log, max_event_watchers=2).register],
    )
    await server.start()
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{server.tcp_port}") as tcp,
            grpc.aio.insecure_channel(f"unix:{sock_dir / 'gpud.sock'}") as local,
        ):
            remote = pb_grpc.NodeStub(tcp)
            held = [remote.WatchEvents(pb.WatchEventsRequest()) for _ in range(2)]
            for stream in held:
                await stream.initial_metadata()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await remote.WatchEvents(pb.WatchEventsRequest()).read()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 event watchers over TCP (api.tcp_address) already" in (
                err.value.details() or ""
            )
            # the operator on the socket still follows
            stream = pb_grpc.NodeStub(local).WatchEvents(pb.WatchEventsRequest(limit=1))
            assert (await stream.read()).event.message == "GPU 2 back"
            for each in (stream, *held):
                each.cancel()
    finally:
        await server.stop(0)


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


async def test_a_watch_that_comes_as_gpud_stops_ends_at_once(
    served: tuple[EventLog, pb_grpc.NodeStub],
) -> None:
    """``gpuctl events --follow`` whose call reaches gpud just after its stop ended the
    watchers: it gets what the log holds and its stream ends (OK) at once, instead of
    waiting for the API's grace to cut it (CANCELLED)."""
    log, stub = served
    log.emit("job.add", "last", job="a")
    log.close_watchers()  # what the daemon does first when it stops
    stream = stub.WatchEvents(pb.WatchEventsRequest(kind_prefix="job.", limit=1))
    assert _said(await asyncio.wait_for(stream.read(), 5)) == "last"
    assert await asyncio.wait_for(stream.read(), 5) == grpc.aio.EOF
    assert await stream.code() == grpc.StatusCode.OK


# a gpuctl still running this long is killed: a line it never prints fails its test (an
# empty line) rather than hanging it
GPUCTL_LIMIT_S = 30.0


def _gpuctl(sock: Path, *argv: str, **kw: Any) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-m", "gpud.cli.main", "--socket", str(sock), "events", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )
    watchdog = threading.Timer(GPUCTL_LIMIT_S, child.kill)
    watchdog.daemon = True
    watchdog.start()
    return child


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
        # --json: said in the stream too, where its consumer reads
        assert json.loads(_line(child.stdout)) == {"gpud": "stopped"}
        # emitted after gpuctl's last event: the next gpud keeps it (its file), not missed
        log.emit("gpu.unhealthy", "while away", gpu=0)
        time.sleep(0.5)  # gpud is down a while: gpuctl tries again meanwhile
        log = EventLog(state)
        with _served(sock, log):
            assert _line(child.stderr) == "gpuctl: gpud is back: following again"
            assert json.loads(_line(child.stdout)) == {"gpud": "back"}
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


def _watching(log: EventLog, count: int = 1) -> None:
    """Wait until ``log`` has ``count`` watchers (gpuctl's stream is set up)."""
    for _ in range(500):
        if len(log._watchers) == count:
            return
        time.sleep(0.01)
    pytest.fail(f"no {count} watchers")


def test_follow_of_what_matched_nothing_yet_reconnects_after_gpud_is_killed(
    sock_dir: Path,
) -> None:
    """``gpuctl events -f --kind gpu.`` on a healthy node: gpud killed (its calls cut, no
    end of stream) before any event was shown, and back."""
    sock = sock_dir / "gpud.sock"
    log = EventLog(None)
    child = _gpuctl(sock, "--follow", "--kind", "gpu.")
    try:
        with _served(sock, log):
            _watching(log)
        assert _line(child.stderr) == (
            "gpuctl: gpud stopped: reconnecting until it is back (Ctrl-C ends)"
        )
        log = EventLog(None)
        with _served(sock, log):
            # said once the watch is set up, not at the next event
            assert _line(child.stderr) == "gpuctl: gpud is back: following again"
            log.emit("gpu.unhealthy", "GPU 0 lost", gpu=0)
            assert "GPU 0 lost" in _line(child.stdout)
            child.send_signal(signal.SIGINT)
            child.communicate(timeout=10)
    finally:
        _end(child)
    assert child.returncode == 130


def test_follow_says_what_expired_and_resumes_by_time_where_numbers_were_given_again(
    sock_dir: Path,
) -> None:
    sock, state = sock_dir / "gpud.sock", sock_dir / "events.jsonl"
    ticks = iter(range(1_000_000, 2_000_000))
    clock = lambda: float(next(ticks))  # noqa: E731
    log = EventLog(state, clock=clock)
    for i in range(3):
        log.emit("job.add", f"first {i}", job=str(i))  # seq 1..3
    child = _gpuctl(sock, "--follow", "--json")
    try:
        with _served(sock, log):
            assert [json.loads(_line(child.stdout))["seq"] for _ in range(3)] == [1, 2, 3]
        assert "gpud stopped" in _line(child.stderr)
        assert json.loads(_line(child.stdout)) == {"gpud": "stopped"}
        # the next gpud keeps 2 events: of 4..6, said while gpuctl was away, 4 is gone
        log = EventLog(state, keep=2, clock=clock)
        for i in range(3):
            log.emit("job.add", f"second {i}", job=str(i))
        with _served(sock, log):
            assert "gpud is back" in _line(child.stderr)
            said = [json.loads(_line(child.stdout)) for _ in range(4)]
            assert said[:2] == [{"gpud": "back"}, {"expired": 1}]
            assert [e["seq"] for e in said[2:]] == [5, 6]
        assert "gpud stopped" in _line(child.stderr)
        assert json.loads(_line(child.stdout)) == {"gpud": "stopped"}
        # the log removed: the next gpud numbers from 1 again, past 6 before gpuctl is back
        state.unlink()
        log = EventLog(state, clock=clock)
        for i in range(8):
            log.emit("job.add", f"third {i}", job=str(i))
        with _served(sock, log):
            assert "gpud is back" in _line(child.stderr)
            said = [json.loads(_line(child.stdout)) for _ in range(9)]
            assert said[0] == {"gpud": "back"}
            assert [e["message"] for e in said[1:]] == [f"third {i}" for i in range(8)]
            child.send_signal(signal.SIGINT)
            child.communicate(timeout=10)
    finally:
        _end(child)
    assert child.returncode == 130


def test_follow_tells_expired_events_from_missed_ones() -> None:
    ctx = Context(socket_path=Path("/nonexistent"), timeout=1.0, output=Output(json_output=False))
    assert _follow_line(ctx, pb.WatchEventsResponse(expired=340)) == (
        "gpuctl: 340 events (of any kind) said while gpuctl was away are no longer kept by gpud"
    )
    assert _follow_line(ctx, pb.WatchEventsResponse(missed=3)) == (
        "gpuctl: missed 3 events (reading too slowly)"
    )
    ctx.out = Output(json_output=True)
    assert json.loads(_follow_line(ctx, pb.WatchEventsResponse(expired=340))) == {"expired": 340}


def test_a_watcher_resumes_by_time_where_its_number_was_given_again() -> None:
    times = iter([10.0, 20.0, 30.0, 40.0])
    log = EventLog(None, clock=lambda: next(times))
    for i in range(2):
        log.emit("job.add", f"job {i}", job=str(i))  # seq 1, 2 at 10, 20
    # the watcher saw seq 2 at 15: a number given again since, to an event at 20
    _, start, gap = log.watch(lambda: None, after_seq=2, after_time=15.0)
    assert [e.seq for e in start] == [2] and gap == 0
    _, start, gap = log.watch(lambda: None, after_seq=1, after_time=10.0)  # consistent
    assert [e.seq for e in start] == [2] and gap == 0
    # a number past the last (the log removed): by time too
    _, start, gap = log.watch(lambda: None, after_seq=7, after_time=5.0)
    assert [e.seq for e in start] == [1, 2] and gap == 0


def test_a_number_too_large_for_the_api_in_the_file_is_taken_as_none(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(
        json.dumps({"seq": 2**64, "time": 1.0, "kind": "job.add", "message": "edited"}) + "\n"
    )
    log = EventLog(path)
    assert [e.seq for e in log.recent()] == [0]
    assert [convert.event(e).message for e in log.recent()] == ["edited"]  # ListEvents
    assert log.emit("job.add", "next").seq == 1


def test_a_wake_that_fails_stops_neither_the_emit_nor_other_watchers() -> None:
    log, woken = EventLog(None), []

    def closed() -> None:
        raise RuntimeError("Event loop is closed")

    log.watch(closed)
    log.watch(lambda: woken.append(1))
    assert log.emit("job.add", "a", job="a").seq == 1
    assert woken == [1]
    with log.until_committed():
        log.emit("job.add", "b", job="b")
        log.emit("job.add", "c", job="c")
    assert [e.message for e in log.recent()] == ["a", "b", "c"]
