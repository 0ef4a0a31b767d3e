import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpud.events import EventLog


def test_events_are_logged_and_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, clock=lambda: 100.0)
    log.emit("mig.apply", "applied all-1g.10gb", gpu=0)
    log.emit("gpu.unhealthy", "GPU 1 unhealthy: GPU lost", gpu=1)
    line = json.loads(path.read_text().splitlines()[0])
    assert line == {
        "seq": 1,
        "time": 100.0,
        "kind": "mig.apply",
        "message": "applied all-1g.10gb",
        "gpu": 0,
    }
    assert [e.kind for e in log.recent(kind_prefix="gpu.")] == ["gpu.unhealthy"]
    assert log.counts() == {"mig.apply": 1, "gpu.unhealthy": 1}
    with path.open("a") as fh:
        fh.write('{"torn": ')  # a crash mid-write
    again = EventLog(path)
    assert [e.message for e in again.recent()] == [
        "applied all-1g.10gb",
        "GPU 1 unhealthy: GPU lost",
    ]
    assert again.recent()[0].fields == {"gpu": 0}


def test_log_rotates(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, max_bytes=200)
    for i in range(20):
        log.emit("x", f"event {i}")
    assert path.with_suffix(".jsonl.1").exists()
    assert path.stat().st_size < 400


def test_a_log_file_that_cannot_be_written_does_not_fail_emit(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    path.mkdir()  # any write now fails, as on a full or read-only disk
    event = log.emit("gpu.unhealthy", "GPU 0 unhealthy")
    assert log.recent(1) == [event]
    assert log.counts() == {"gpu.unhealthy": 1}


def test_a_log_file_whose_writes_fail_says_why_and_how_many_lines_it_lacks(
    tmp_path: Path,
) -> None:
    """What ``gpuctl status`` says of the event log while its writes fail, beyond a
    counter and one warning at the outage's start."""
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    log.emit("daemon.start", "written")
    assert log.write_problem() is None
    path.rename(tmp_path / "aside")
    path.mkdir()  # any write now fails, as on a full or read-only disk
    log.emit("job.add", "not written")
    log.emit("job.add", "not written either")
    assert log.write_problem() == (path, "Is a directory", 2)
    path.rmdir()  # space freed
    log.emit("job.add", "written again")
    assert log.write_problem() is None


class _FailsAsRead(EventLog):
    """An event log whose file's first write fails while :meth:`EventLog.write_problem`
    reads the outage: after the first attribute of it is fetched, before the next."""

    armed = False

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        if name in ("_write_error", "_outage") and self.armed:
            self.armed = False
            self.emit("job.add", "not written")
        return value


def test_a_write_that_fails_as_the_problem_is_read_never_gives_a_count_without_its_reason(
    tmp_path: Path,
) -> None:
    """``gpuctl status`` reads the outage without the log's lock: the reason and the count
    are one, never ``("", 1)``."""
    path = tmp_path / "events.jsonl"
    log = _FailsAsRead(path)
    path.mkdir()  # any write now fails
    log.armed = True
    problem = log.write_problem()
    assert problem is None or problem[1] == "Is a directory"
    assert log.write_problem() == (path, "Is a directory", 1)


def test_writes_the_file_missed_are_counted_and_said_when_it_is_written_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full or read-only state directory: the operator sees the lines the file lacks in
    ``gpud_event_log_write_errors_total`` and, at the outage's end, in the journal."""
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    log.emit("daemon.start", "written")
    assert log.tallies()[1] == 0
    path.rename(tmp_path / "aside")
    path.mkdir()  # any write now fails, as on a full or read-only disk
    log.emit("job.add", "not written")
    log.emit("job.add", "not written either")
    assert log.tallies()[1] == 2
    path.rmdir()  # space freed
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpud.events"):
        log.emit("job.add", "written again")
    assert log.tallies()[1] == 2  # since start
    assert [r.getMessage() for r in caplog.records] == [
        f"the event log {path} is written again; it lacks the 2 events said while it could "
        "not be (the journal has them)"
    ]
    assert [e.message for e in EventLog(path).recent()] == ["written again"]


def test_a_damaged_log_is_read_past_and_appended_to_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(
        b'{"time": 1, "kind": "a.b", "message": "kept"}\n'
        b"\xff\xfe not UTF-8\n"
        b'{"time": NaN, "kind": "x", "message": "no date"}\n'
        b'{"time": 1e400, "kind": "x", "message": "no date"}\n'
        b'{"time": "2", "kind": "x", "message": "a string"}\n'
        b'{"time": 3, "kind": 4, "message": null}\n'
        b'[1, 2]\n"text"\n'
        b'{"time": 5, "kind": "c.d", "message": "torn'  # a crash mid-write
    )
    log = EventLog(path, clock=lambda: 9.0)
    assert [(e.time, e.kind, e.message) for e in log.recent()] == [(1.0, "a.b", "kept")]
    log.emit("daemon.start", "the first line after the crash")
    assert [e.message for e in EventLog(path).recent()] == [
        "kept",
        "the first line after the crash",
    ]


def test_events_held_until_committed_are_said_after_the_block_or_dropped(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    with log.until_committed():
        log.emit("a.leave", "kept")
        with log.until_committed():  # nested: said with the outermost
            log.emit("a.leave", "kept too")
        assert log.recent() == [] and not path.exists()
    try:
        with log.until_committed():
            log.emit("a.leave", "rolled back")
            raise RuntimeError("commit failed")
    except RuntimeError:
        pass
    log.emit("b", "after")
    assert [e.message for e in log.recent()] == ["kept", "kept too", "after"]
    assert len(path.read_text().splitlines()) == 3


def _within(read: Callable[[], object], seconds: float = 5.0) -> object:
    """``read()``'s value, failing the test if it takes longer than ``seconds``."""
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(read()), daemon=True)
    reader.start()
    reader.join(seconds)
    assert got, f"still waiting after {seconds} s"
    return got[0]


def test_a_hung_disk_under_the_file_stalls_no_reader_nor_emitter_and_keeps_the_lines_order(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A write to the file that hangs (a hung disk: here a FIFO no one reads yet) holds
    back only the emitter writing it: the others (the event loop) return at once, the
    journal has every event meanwhile, a scrape (``tallies``) and ``gpuctl events``
    (``recent``) answer, ``gpuctl status`` (``pending``) says the lines queued and since
    when the write runs; the lines are written in their order once it goes on, and a
    bounded flush at the stop says what it could not write."""
    caplog.set_level(logging.INFO, logger="gpud.events")
    path = tmp_path / "events.jsonl"
    log = EventLog(path, monotonic=lambda: 50.0)
    assert log.pending() == (0, None)
    os.mkfifo(path)  # opening it to write waits for a reader
    first = threading.Thread(target=log.emit, args=("job.add", "line 1"))
    disk = -1
    try:
        first.start()
        deadline = time.monotonic() + 5  # said: in the ring, the file still to write
        while not _within(log.recent) and time.monotonic() < deadline:
            time.sleep(0.01)
        then = threading.Thread(target=log.emit, args=("job.add", "line 2"), daemon=True)
        then.start()
        then.join(2)
        assert not then.is_alive(), "an emitter waited for another's hung write"
        journal = [r.getMessage() for r in caplog.records if r.name == "gpud.events"]
        assert journal == ["job.add: line 1", "job.add: line 2"]
        assert [e.message for e in _within(log.recent)] == ["line 1", "line 2"]
        assert _within(log.tallies) == ({"job.add": 2}, 0)
        assert _within(log.pending) == (2, 50.0)
        assert not log.flush(0.1)
        assert "2 lines not written at the stop" in caplog.records[-1].getMessage()
    finally:
        disk = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # the disk goes on
        if first.ident is not None:  # started
            first.join(5)
    assert log.flush(1.0)
    assert log.pending() == (0, None)
    try:
        written = b""
        while chunk := os.read(disk, 4096):
            written += chunk
    finally:
        os.close(disk)
    assert [json.loads(line)["message"] for line in written.splitlines()] == ["line 1", "line 2"]


def test_lines_left_behind_by_a_writer_that_raised_are_written_by_the_stop_s_flush(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The emitter writing the file raises (not an OSError) while others queue lines
    behind it: at the stop no emitter comes to write them, so the stop's flush writes them,
    in their order, and says they are written only once they are, warning of no hung disk;
    an emitter after it writes its own as before."""
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    write = log._write
    writing, go = threading.Event(), threading.Event()

    def raises_once(line: str) -> bool:
        if "boom" in line:
            writing.set()
            go.wait(5)
            raise MemoryError("no memory for the line")
        return write(line)

    log._write = raises_once  # type: ignore[method-assign]
    raised: list[BaseException] = []

    def first() -> None:
        try:
            log.emit("job.add", "boom")
        except MemoryError as err:
            raised.append(err)

    thread = threading.Thread(target=first)
    thread.start()
    assert writing.wait(5)
    log.emit("job.add", "queued 1")
    log.emit("job.add", "queued 2")
    go.set()
    thread.join(5)
    assert raised
    assert log.flush(5.0)
    lines = [json.loads(x)["message"] for x in path.read_text().splitlines()]
    assert lines == ["queued 1", "queued 2"]
    assert not [r for r in caplog.records if "not written at the stop" in r.getMessage()]
    log.emit("job.add", "later")
    assert log.flush(1.0)
    lines = [json.loads(x)["message"] for x in path.read_text().splitlines()]
    assert lines == ["queued 1", "queued 2", "later"]


def _emit_on_a_disk_that_fills_mid_line(path: Path, room: int) -> int:
    """Emit one event in a forked child whose files may grow by ``room`` bytes alone
    (RLIMIT_FSIZE: the kernel writes what fits and then refuses the rest, as a disk that
    fills in the middle of a line does); the child's exit code: 0 when the event was said
    and the file counted it as not written."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            import resource
            import signal

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
            log = EventLog(path)
            size = path.stat().st_size
            resource.setrlimit(resource.RLIMIT_FSIZE, (size + room, resource.RLIM_INFINITY))
            log.emit("job.add", "cut by the full disk " + "x" * 200)
            code = 0 if log.tallies()[1] == 1 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_line_a_full_disk_cut_is_not_left_in_the_file(tmp_path: Path) -> None:
    """A line whose write the disk took only part of is taken back out: every line of
    ``events.jsonl`` stays one JSON object (``jq``, a log shipper), and the next event
    follows the last whole one."""
    path = tmp_path / "events.jsonl"
    EventLog(path).emit("daemon.start", "written")
    assert _emit_on_a_disk_that_fills_mid_line(path, room=40) == 0
    EventLog(path).emit("job.add", "written once the disk has room")
    lines = path.read_text().splitlines()
    assert [json.loads(line)["message"] for line in lines] == [
        "written",
        "written once the disk has room",
    ]
