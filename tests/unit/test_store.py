"""The state database: a damaged or unreadable file stops the daemon with its name."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud.cli.main import DEFAULT_TIMEOUT
from gpud.daemon import STATE_TABLES as GPUD
from gpud.errors import StateDamaged, StateError, StateInUse, StateUnwritable, classify
from gpud.jobs.registry import SCHEMA as JOBS_SCHEMA
from gpud.main import EXIT_STATE_DAMAGED, main
from gpud.mps.manager import SCHEMA as MPS_SCHEMA
from gpud.store import APPLICATION_ID, DB_NAME, StateStore
from gpud.telemetry.seen import SCHEMA as SEEN_SCHEMA
from tests.unit.api_support import short_dir
from tests.unit.store_support import LetGoWhenSaid, held_write_lock, lock_waits
from tests.unit.tool_support import running_tool


def fill(state: Path) -> int:
    store = StateStore(state)
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT)"])
    with store.transaction() as conn:
        conn.executemany("INSERT INTO t (v) VALUES (?)", [("x" * 200,) for _ in range(500)])
    store.close()
    (state / f"{DB_NAME}-wal").unlink(missing_ok=True)
    return (state / DB_NAME).stat().st_size


def test_a_full_disk_keeps_nothing_of_the_change_and_says_so(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT)"])
    with store.transaction() as conn:
        conn.execute("INSERT INTO t (v) VALUES ('kept')")
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")  # no room for one more page
    with pytest.raises(StateUnwritable) as caught, store.transaction() as conn:
        conn.execute("INSERT INTO t (v) VALUES ('one')")
        conn.executemany("INSERT INTO t (v) VALUES (?)", [("x" * 4000,) for _ in range(20)])
    assert str(caught.value).startswith(
        f"state database {tmp_path / DB_NAME} cannot be written (database or disk is full)"
    )
    assert classify(caught.value) == ("UNAVAILABLE", 3)
    with store.transaction() as conn:  # a transaction of its own, not nested in the failed one
        conn.execute("PRAGMA max_page_count = 1000000")
        conn.execute("INSERT INTO t (v) VALUES ('after')")
    store.close()
    with StateStore(tmp_path).transaction() as conn:
        assert [r[0] for r in conn.execute("SELECT v FROM t ORDER BY k")] == ["kept", "after"]


def test_a_refused_change_is_kept_as_the_store_s_write_problem_until_one_is_written(
    tmp_path: Path,
) -> None:
    """What ``gpuctl status`` says of the database: SQLite's reason and when, from the
    refused change on, not only in the log line of the call that failed."""
    now = [100.0]
    store = StateStore(tmp_path, clock=lambda: now[0])
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT)"])
    assert store.write_problem() is None
    with store.transaction() as conn:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full
    with pytest.raises(StateUnwritable), store.transaction() as conn:
        conn.executemany("INSERT INTO t (v) VALUES (?)", [("x" * 4000,) for _ in range(20)])
    assert store.write_problem() == ("database or disk is full", 100.0)
    now[0] = 200.0
    with store.transaction() as conn:  # a read, or a transaction that changes nothing
        conn.execute("SELECT count(*) FROM t").fetchone()
    assert store.write_problem() == ("database or disk is full", 100.0)
    with store.transaction() as conn:  # space freed: a change is written again
        conn.execute("PRAGMA max_page_count = 1000000")
        conn.execute("INSERT INTO t (v) VALUES ('after')")
    assert store.write_problem() is None
    store.close()


def test_a_database_removed_under_the_store_is_its_write_problem_since_it_was_found(
    tmp_path: Path,
) -> None:
    """``gpuctl status`` names the file before the reason: the reason does not name it
    again, and its time is when the loop found it gone, not that of a later refused change
    (changes are refused from then on, whether one was asked or not)."""
    now = [7.0]
    store = StateStore(tmp_path, clock=lambda: now[0])
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT)"])
    (tmp_path / DB_NAME).unlink()
    assert store.check_files() is not None
    now[0] = 20.0
    with pytest.raises(StateUnwritable), store.transaction() as conn:
        conn.execute("INSERT INTO t (v) VALUES ('refused')")
    assert store.write_problem() == (
        "removed or replaced while gpud ran; restart gpud (on the database restored from a "
        "backup, or on none to start afresh)",
        7.0,
    )
    store.close()


def test_a_removed_write_ahead_log_is_named_in_the_write_problem_by_its_file_name(
    tmp_path: Path,
) -> None:
    store = _wal_removed(tmp_path / "state")
    assert store.check_files() is not None
    problem = store.write_problem()
    assert problem is not None
    assert problem[0].startswith(
        f"its write-ahead log {DB_NAME}-wal was removed or replaced while gpud ran; "
    )
    assert str(tmp_path) not in problem[0]
    store.close()


def test_a_write_under_way_says_when_it_began_without_a_lock(tmp_path: Path) -> None:
    """``gpuctl status`` tells a write held up (a commit's fsync on a hung disk, another
    process's lock) from none, read from another thread while the writer's lock is held."""
    now = [7.0]
    store = StateStore(tmp_path, clock=lambda: now[0])
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT)"])
    assert store.write_began() is None
    with store.transaction() as conn:
        conn.execute("INSERT INTO t (v) VALUES ('x')")
        now[0] = 9.0
        seen: list[float | None] = []
        reader = threading.Thread(target=lambda: seen.append(store.write_began()))
        reader.start()
        reader.join()
        assert seen == [7.0]
    assert store.write_began() is None
    with pytest.raises(RuntimeError), store.transaction():
        raise RuntimeError("a caller's error")
    assert store.write_began() is None
    store.close()


def _started(state: Path, **options: Any) -> StateStore:
    """A store with a table ``t``, its daemon's start done: writes wait ``write_wait_s``."""
    store = StateStore(state, **options)
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT)"])
    store.start_done()
    return store


def test_a_write_refused_by_another_process_s_lock_names_the_file_and_the_likely_holder(
    tmp_path: Path,
) -> None:
    """UNAVAILABLE (gpuctl exits 3, retry later), not an INTERNAL error with SQLite's words
    alone; ``gpuctl status`` says it until a transaction takes the lock again."""
    now = [7.0]
    store = _started(tmp_path, clock=lambda: now[0], write_wait_s=0.05)
    with (
        held_write_lock(tmp_path / DB_NAME),
        pytest.raises(StateInUse) as caught,
        store.transaction() as conn,
    ):
        conn.execute("INSERT INTO t (v) VALUES ('refused')")
    why = "in use by another process (database is locked; a sqlite3 shell, a backup tool?)"
    assert str(caught.value) == (
        f"state database {tmp_path / DB_NAME} is {why}: gpud waited 0.05 s for its lock; "
        "nothing of this change was kept: stop that process, then retry"
    )
    assert classify(caught.value) == ("UNAVAILABLE", 3)
    assert store.write_problem() == (why, 7.0)
    with store.transaction() as conn:  # the lock let go: taken by one that changes nothing
        conn.execute("SELECT count(*) FROM t").fetchone()
    assert store.write_problem() is None
    with store.reading(), store.transaction() as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 0
    store.close()


def test_writes_that_wait_alike_set_the_busy_timeout_once_not_each(tmp_path: Path) -> None:
    """Every transaction asks for its wait for another process's lock: one that asks the
    same wait as the one before runs no ``PRAGMA busy_timeout`` (a statement on each
    write of every pass); one that asks another sets it."""
    now = [7.0]
    store = _started(tmp_path, clock=lambda: now[0], write_wait_s=0.6, in_use_wait_s=0.05)
    with store.transaction() as conn:
        conn.execute("INSERT INTO t (v) VALUES ('first')")
    said: list[str] = []
    store._conn.set_trace_callback(said.append)
    for _ in range(3):
        with store.transaction() as conn:
            conn.execute("INSERT INTO t (v) VALUES ('again')")
    assert [s for s in said if s.startswith("PRAGMA busy_timeout")] == []
    assert said.count("BEGIN IMMEDIATE") == 3
    with (
        held_write_lock(tmp_path / DB_NAME),
        pytest.raises(StateInUse),
        store.transaction() as conn,
    ):
        conn.execute("INSERT INTO t (v) VALUES ('refused')")
    with store.transaction() as conn:  # the lock known held: looked at, not waited for
        conn.execute("INSERT INTO t (v) VALUES ('let go')")
    assert [s for s in said if s.startswith("PRAGMA busy_timeout")] == ["PRAGMA busy_timeout = 50"]
    store.close()


def test_writes_after_one_refused_by_another_process_s_lock_only_look_whether_it_was_let_go(
    tmp_path: Path,
) -> None:
    """A backup tool holds the lock: the loop's writing steps do not each wait
    ``write_wait_s`` for it in turn (a pass past the systemd watchdog), only the first; the
    others are refused as quickly, still naming the file, until the lock is let go and a
    write commits; the one after waits in full again."""
    store = _started(tmp_path, write_wait_s=0.6, in_use_wait_s=0.05)
    waits = lock_waits(store)
    with held_write_lock(tmp_path / DB_NAME):
        for _ in range(6):  # a pass's writing steps
            with pytest.raises(StateInUse) as caught, store.transaction() as conn:
                conn.execute("INSERT INTO t (v) VALUES ('refused')")
            assert str(caught.value).startswith(f"state database {tmp_path / DB_NAME} is in use")
            assert classify(caught.value) == ("UNAVAILABLE", 3)
    assert waits == [600] + [50] * 5
    assert ": gpud waited 0.05 s for its lock; " in str(caught.value)
    with store.transaction() as conn:  # let go: the next one looks, takes it, commits
        conn.execute("INSERT INTO t (v) VALUES ('written')")
    with store.transaction() as conn:
        conn.execute("INSERT INTO t (v) VALUES ('again')")
    assert waits[6:] == [50, 600]
    assert store.write_problem() is None
    store.close()


def test_a_write_queued_behind_another_waits_for_a_lock_only_what_is_left_of_its_own_wait(
    tmp_path: Path,
) -> None:
    """Two API calls' writes held up by another process's lock: the second, which waited
    2 s for the first (on the store's clock), waits 3 s more for the lock, not 5: each
    call says why within gpuctl's timeout, not one after the other."""
    times = [0.0]
    store = StateStore(tmp_path, clock=lambda: times.pop(0) if len(times) > 1 else times[0])
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT)"])
    times[:] = [100.0, 102.0]  # asked, then the writer's lock taken
    with store.transaction() as conn:
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 3000
    store.close()


def test_a_write_queued_past_its_own_wait_still_waits_a_little_for_the_lock_and_commits(
    tmp_path: Path,
) -> None:
    """A write that queued its whole 5 s behind gpud's own writers is not refused at once
    by a lock another process takes for a moment: it waits half a second for it, and with
    no such lock it commits."""
    times = [0.0]
    store = _started(tmp_path, clock=lambda: times.pop(0) if len(times) > 1 else times[0])
    times[:] = [100.0, 106.0]  # asked, then the writer's lock taken: 6 s queued
    with store.transaction() as conn:
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 500
        conn.execute("INSERT INTO t (v) VALUES ('queued')")
    with store.reading(), store.transaction() as conn:
        assert conn.execute("SELECT v FROM t").fetchall()[0][0] == "queued"
    assert store.write_problem() is None
    store.close()


def test_a_write_refused_after_queueing_says_how_long_it_queued_and_waited_for_the_lock(
    tmp_path: Path,
) -> None:
    """The refusal says both waits, not that gpud waited all of write_wait_s for the lock;
    no write is said under way after it."""
    times = [0.0]
    store = _started(
        tmp_path, clock=lambda: times.pop(0) if len(times) > 1 else times[0], write_wait_s=0.3
    )
    times[:] = [100.0, 100.2]  # asked, then the writer's lock taken
    with (
        held_write_lock(tmp_path / DB_NAME),
        pytest.raises(StateInUse) as caught,
        store.transaction() as conn,
    ):
        conn.execute("INSERT INTO t (v) VALUES ('refused')")
    assert ": gpud waited 0.2 s queued behind its own writes, then 0.3 s for its lock; " in str(
        caught.value
    )
    assert store.write_began() is None
    store.close()


def test_a_lasting_refusal_keeps_the_time_of_the_first(tmp_path: Path) -> None:
    """``gpuctl status`` says since when changes are refused: a disk full for an hour with a
    change refused each minute reads an hour, not the latest minute; another reason
    refusing next starts its own time."""
    now = [7.0]
    store = _started(tmp_path, clock=lambda: now[0], write_wait_s=0.05)
    with store.transaction() as conn:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full
    for at in (7.0, 3607.0):
        now[0] = at
        with pytest.raises(StateUnwritable), store.transaction() as conn:
            conn.executemany("INSERT INTO t (v) VALUES (?)", [("x" * 4000,) for _ in range(20)])
    assert store.write_problem() == ("database or disk is full", 7.0)
    now[0] = 4000.0
    with (
        held_write_lock(tmp_path / DB_NAME),
        pytest.raises(StateInUse),
        store.transaction() as conn,
    ):
        conn.execute("INSERT INTO t (v) VALUES ('refused')")
    problem = store.write_problem()
    assert problem is not None and problem[1] == 4000.0
    store.close()


def test_a_read_waits_for_no_other_process_s_write_and_is_never_a_refused_change(
    tmp_path: Path,
) -> None:
    """Another process's write holds the lock: a read still answers at once from what is
    committed, and ``gpuctl status`` says no change refused; within a transaction of its
    thread, a read sees that transaction's own change."""
    store = _started(tmp_path, write_wait_s=0.05)
    with store.transaction() as conn:
        conn.execute("INSERT INTO t (v) VALUES ('committed')")
    with held_write_lock(tmp_path / DB_NAME) as holder:
        holder.execute("INSERT INTO t (v) VALUES ('not yet')")
        with store.read() as conn:
            assert [r[0] for r in conn.execute("SELECT v FROM t")] == ["committed"]
    assert store.write_problem() is None
    with store.transaction() as conn:
        conn.execute("INSERT INTO t (v) VALUES ('mine')")
        with store.read() as seen:
            assert seen.execute("SELECT count(*) FROM t").fetchone()[0] == 2
    store.close()


def test_a_table_locked_within_gpud_s_own_connection_is_raised_as_the_bug_it_is(
    tmp_path: Path,
) -> None:
    """SQLITE_LOCKED in a transaction (a table dropped while a statement of the same
    connection still reads it) is no other process's doing: not StateInUse, and not kept
    as the write problem."""
    store = _started(tmp_path)
    with store.transaction() as conn:
        conn.executemany("INSERT INTO t (v) VALUES (?)", [("a",), ("b",)])
    with pytest.raises(sqlite3.OperationalError) as caught, store.transaction() as conn:
        reading = conn.execute("SELECT v FROM t")
        reading.fetchone()
        conn.execute("DROP TABLE t")
    assert not isinstance(caught.value, StateError)
    assert caught.value.sqlite_errorcode & 0xFF == 6
    assert store.write_problem() is None
    store.close()


def test_a_start_waits_for_another_process_s_write_to_the_open_s_deadline(
    tmp_path: Path,
) -> None:
    """In WAL mode the open's steps pass while another process's write holds the lock; the
    first feature's tables then wait for it as the open would (said once, naming the file),
    not only write_wait_s, and the start goes on once it lets go."""
    StateStore(tmp_path).close()
    store = StateStore(tmp_path, warn_after_s=0.0, write_wait_s=0.05)
    with held_write_lock(tmp_path / DB_NAME) as holder, LetGoWhenSaid(holder).listening() as said:
        store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT)"])
    assert len(said.said) == 1
    assert said.said[0].startswith(f"state database {tmp_path / DB_NAME} is in use by another")
    store.close()


def test_a_start_held_up_past_the_open_s_deadline_says_to_start_gpud_again(
    tmp_path: Path,
) -> None:
    """A start whose first tables another process's write holds up past the open's busy
    timeout stops as the open would: stop that process, then start gpud again."""
    StateStore(tmp_path).close()
    store = StateStore(tmp_path, busy_timeout_s=0.2, warn_after_s=0.0, write_wait_s=0.05)
    with held_write_lock(tmp_path / DB_NAME), pytest.raises(StateInUse) as caught:
        store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY)"])
    text = str(caught.value)
    assert text.startswith(f"state database {tmp_path / DB_NAME} is in use by another process")
    assert text.endswith("stop it, then start gpud again; nothing was changed")
    store.close()


def test_a_write_waits_for_another_process_s_lock_less_than_gpuctl_waits_for_an_answer(
    tmp_path: Path,
) -> None:
    """A write held up by a lock fails with its reason before gpuctl's default timeout
    ends the call, saying only that gpud did not answer; the open keeps its longer wait."""
    store = StateStore(tmp_path)
    for conn in (store._conn, store._reader):
        waits_ms = conn.execute("PRAGMA busy_timeout").fetchone()[0]
        assert 0 < waits_ms < DEFAULT_TIMEOUT * 1000
    store.close()


def test_a_healthy_database_opens_again(tmp_path: Path) -> None:
    fill(tmp_path)
    with StateStore(tmp_path).transaction() as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 500


def test_a_damaged_header_names_the_file(tmp_path: Path) -> None:
    fill(tmp_path)
    with (tmp_path / DB_NAME).open("r+b") as f:
        f.write(b"not a database at all" * 10)
    with pytest.raises(StateDamaged, match=rf"{tmp_path / DB_NAME} is unreadable .*move it aside"):
        StateStore(tmp_path)


def test_a_damaged_page_is_found_at_start(tmp_path: Path) -> None:
    size = fill(tmp_path)
    with (tmp_path / DB_NAME).open("r+b") as f:
        f.seek(size // 2)
        f.write(os.urandom(4096))
    with pytest.raises(StateDamaged, match="is unreadable"):
        StateStore(tmp_path)


def restart_prevented() -> list[str]:
    """The exit statuses after which the shipped unit does not start gpud again."""
    unit = (Path(__file__).parents[2] / "systemd" / "gpud.service").read_text()
    (prevent,) = [ln for ln in unit.splitlines() if ln.startswith("RestartPreventExitStatus=")]
    return prevent.partition("=")[2].split()


def test_a_damaged_database_stops_the_daemon_with_the_reason_and_is_not_restarted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 1 was restarted every few seconds for good, repeating the error: no start reads
    the file better than the last one did."""
    state = tmp_path / "state"
    state.mkdir()
    (state / DB_NAME).write_bytes(b"garbage" * 1000)
    with short_dir() as run:
        args = ["--simulate", "--state-dir", str(state), "--run-dir", str(run)]
        args += ["--socket", str(run / "gpud.sock"), "--metrics-address", "127.0.0.1:0"]
        assert main(args) == EXIT_STATE_DAMAGED == 65  # sysexits.h EX_DATAERR
    err = capsys.readouterr().err
    assert f"gpud: state database {state / DB_NAME} is unreadable" in err
    assert err.rstrip().endswith("(gpud is not restarted for this: start it again once mended)")
    assert "65" in restart_prevented()


def test_an_empty_database_file_next_to_a_wal_is_refused_not_taken_for_a_new_one(
    tmp_path: Path,
) -> None:
    fill(tmp_path)
    _another_databases_wal(tmp_path)  # frames, as gpud's -wal holds after its first commit
    (tmp_path / DB_NAME).write_bytes(b"")  # truncated
    with pytest.raises(StateDamaged, match=r"is unreadable \(empty: 0 bytes, truncated\?\)"):
        StateStore(tmp_path, known_tables=GPUD)


def test_an_empty_database_file_next_to_the_empty_wal_a_read_left_is_taken_as_new(
    tmp_path: Path,
) -> None:
    """A read of the new, empty file (the start's read-only check) leaves an empty -wal
    next to it: a first start cut short before its first commit then left both, and was
    refused as truncated at every later start."""
    (tmp_path / DB_NAME).write_bytes(b"")
    (tmp_path / f"{DB_NAME}-wal").write_bytes(b"")
    StateStore(tmp_path, known_tables=GPUD).close()
    assert _application_id(tmp_path) == APPLICATION_ID


def test_an_empty_database_file_alone_is_a_first_start_cut_short_and_taken_as_new(
    tmp_path: Path,
) -> None:
    """gpud's first start makes the file, then commits its first transaction: a power loss
    between the two left it empty, with no -wal, and every later start was refused (exit
    65, not restarted)."""
    (tmp_path / DB_NAME).write_bytes(b"")
    store = StateStore(tmp_path, known_tables=GPUD)
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS jobs (name TEXT PRIMARY KEY)"])
    store.close()
    assert _application_id(tmp_path) == APPLICATION_ID


def test_a_database_that_cannot_be_opened_says_so_not_that_it_is_damaged(
    tmp_path: Path,
) -> None:
    # as unopenable as one of another owner, without root: a link into a missing directory
    (tmp_path / DB_NAME).symlink_to(tmp_path / "gone" / DB_NAME)
    with pytest.raises(StateError) as caught:
        StateStore(tmp_path)
    assert str(caught.value).startswith(f"cannot open the state database {tmp_path / DB_NAME}")
    assert f"create files in {tmp_path}" in str(caught.value)
    assert "restore" not in str(caught.value)


def test_a_directory_in_the_database_s_place_is_named_as_one(tmp_path: Path) -> None:
    """Not "gpud's user must be able to read and write it" (owner, mode): nothing of the
    sort would let SQLite open a directory."""
    (tmp_path / DB_NAME).mkdir()  # a backup restored into a directory of that name
    with pytest.raises(StateDamaged) as caught:
        StateStore(tmp_path)
    assert str(caught.value) == (
        f"state database {tmp_path / DB_NAME} is a directory, not the database file: move it"
        " aside (a backup restored into it: put its state.db in its place), then start gpud"
        " again"
    )
    assert (tmp_path / DB_NAME).is_dir()  # left as it was


@pytest.mark.parametrize(
    ("code", "why"), [(4874, "disk I/O error"), (13, "database or disk is full")]
)
def test_a_full_or_failing_disk_at_open_is_not_called_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, why: str
) -> None:
    """SQLite needs room for its WAL index to open a database: on a full disk it answers
    an I/O error, which says nothing of the file, so the advice is to free space, not to
    move the database aside (and forget what is in it)."""
    fill(tmp_path)
    connect = sqlite3.connect

    class Disk:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self._conn = conn
            self.row_factory = None

        def execute(self, sql: str) -> sqlite3.Cursor:
            if "quick_check" in sql:
                err = sqlite3.OperationalError(why)
                err.sqlite_errorcode = code
                raise err
            return self._conn.execute(sql)

        def close(self) -> None:
            self._conn.close()

    monkeypatch.setattr(sqlite3, "connect", lambda *a, **k: Disk(connect(*a, **k)))
    with pytest.raises(StateError) as caught:
        StateStore(tmp_path)
    text = str(caught.value)
    assert not isinstance(caught.value, StateDamaged)  # exit 1: restarted, space can be freed
    assert text.startswith(f"cannot open the state database {tmp_path / DB_NAME} ({why})")
    assert f"free space in {tmp_path}" in text
    assert "move it aside" not in text and "unreadable" not in text


def test_a_table_of_another_layout_is_refused_at_start(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY)"])
    store.close()
    store = StateStore(tmp_path)
    with pytest.raises(StateDamaged, match=r"table t has no column v, w: written by another gpud"):
        store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT, w)"])
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY)"])
    store.close()


def test_a_column_a_later_version_added_is_added_to_an_older_table_in_place(
    tmp_path: Path,
) -> None:
    old = ["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT NOT NULL)"]
    new = ["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT NOT NULL, w INTEGER)"]
    store = StateStore(tmp_path)
    store.ensure_schema(old)
    with store.transaction() as conn:
        conn.execute("INSERT INTO t (v) VALUES ('kept')")
    store.close()
    store = StateStore(tmp_path)
    store.ensure_schema(new, added={"t": ("w",)})
    with store.transaction() as conn:
        conn.execute("INSERT INTO t (v, w) VALUES ('new', 7)")
        rows = [tuple(r) for r in conn.execute("SELECT k, v, w FROM t ORDER BY k")]
    assert rows == [(1, "kept", None), (2, "new", 7)]
    store.ensure_schema(new, added={"t": ("w",)})  # again: nothing left to add
    store.ensure_schema(old)  # the previous version's check takes the extra column
    store.close()


def test_only_a_nullable_declared_column_can_be_added(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY)"])
    with pytest.raises(ValueError, match=r"t\.w: only a nullable declared column"):
        store.ensure_schema(
            ["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, w INTEGER NOT NULL)"],
            added={"t": ("w",)},
        )
    with pytest.raises(ValueError, match=r"t\.x: only a nullable declared column"):
        store.ensure_schema(
            ["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY)"], added={"t": ("x",)}
        )
    with store.transaction() as conn:  # nothing of either was kept
        assert [r[1] for r in conn.execute("PRAGMA table_info(t)")] == ["k"]
    store.close()


def test_the_daemon_stops_on_a_database_of_an_older_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    store = StateStore(state)
    with store.transaction() as conn:
        conn.execute("CREATE TABLE jobs (name TEXT PRIMARY KEY, kind TEXT NOT NULL)")
    store.close()
    with short_dir() as run:
        args = ["--simulate", "H100-SXM5-80GB:1", "--state-dir", str(state), "--run-dir", str(run)]
        args += ["--socket", str(run / "gpud.sock"), "--metrics-address", "127.0.0.1:0"]
        assert main(args) == EXIT_STATE_DAMAGED  # no restart installs the other version
    err = capsys.readouterr().err
    assert f"gpud: state database {state / DB_NAME} is unreadable (table jobs has no column" in err
    assert "Traceback" not in err


def _another_databases_wal(state: Path) -> bytes:
    """Put next to ``state``'s database the write-ahead log another database left (its
    process killed before a checkpoint, as a backup restored next to a crashed gpud's
    log finds it); its bytes."""
    other = sqlite3.connect(state / "other.db", isolation_level=None)
    other.execute("PRAGMA journal_mode=WAL")
    other.execute("PRAGMA wal_autocheckpoint=0")
    other.execute("CREATE TABLE x (a)")
    other.execute("INSERT INTO x VALUES (1)")
    log = (state / "other.db-wal").read_bytes()
    other.close()
    (state / f"{DB_NAME}-wal").write_bytes(log)
    return log


def _jobs_database(state: Path) -> bytes:
    """A state database holding gpud's jobs table with one row; its bytes."""
    store = StateStore(state, known_tables=GPUD)
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS jobs (name TEXT PRIMARY KEY)"])
    with store.transaction() as conn:
        conn.execute("INSERT INTO jobs VALUES ('train')")
    store.close()
    return (state / DB_NAME).read_bytes()


def _kept_and_whole_once_moved_aside(state: Path, db: bytes, log: bytes) -> None:
    """The refused database and its -wal are as they were; with the -wal moved aside, the
    database opens holding its job."""
    wal = state / f"{DB_NAME}-wal"
    assert (state / DB_NAME).read_bytes() == db
    assert wal.read_bytes() == log
    wal.rename(state.parent / f"{state.name}-aside.wal")
    store = StateStore(state, known_tables=GPUD)
    with store.reading(), store.transaction() as conn:
        assert [r[0] for r in conn.execute("SELECT name FROM jobs")] == ["train"]
    store.close()


def test_another_database_s_wal_next_to_the_state_is_refused_and_both_files_kept(
    tmp_path: Path,
) -> None:
    """SQLite's open reads any ``-wal`` next to the file into it: one of another database
    made gpud's tables vanish, and the start made them again, empty (every job forgotten),
    and the close copied it into ``state.db`` for good. Now the start stops naming the log
    to move aside, and the database's contents are unchanged: moved aside, the jobs are all
    there."""
    db = _jobs_database(tmp_path)
    log = _another_databases_wal(tmp_path)
    wal = tmp_path / f"{DB_NAME}-wal"
    with pytest.raises(StateDamaged) as caught:
        StateStore(tmp_path, known_tables=GPUD)
    assert str(caught.value) == (
        f"state database {tmp_path / DB_NAME} is unreadable (tables x, none of gpud's: another"
        f" program's database?) as read through {wal}, a write-ahead log next to it (another"
        f" database's?): move {wal} aside (the database's contents are unchanged), then start"
        f" gpud again; if it is still refused, restore {tmp_path / DB_NAME} from a backup or"
        " move it aside too"
    )
    _kept_and_whole_once_moved_aside(tmp_path, db, log)


def test_another_program_s_database_is_refused_and_a_new_one_taken(tmp_path: Path) -> None:
    other = sqlite3.connect(tmp_path / DB_NAME)
    other.execute("CREATE TABLE x (a)")
    other.commit()
    other.close()
    with pytest.raises(
        StateDamaged,
        match=r"is unreadable \(tables x, none of gpud's: another program's database\?\)",
    ):
        StateStore(tmp_path, known_tables=GPUD)
    StateStore(tmp_path / "new", known_tables=GPUD).close()  # no tables yet: a first start


def _application_id(state: Path) -> int:
    with contextlib.closing(sqlite3.connect(state / DB_NAME)) as conn:
        return int(conn.execute("PRAGMA application_id").fetchone()[0])


@pytest.mark.parametrize(
    "committed", [["gpu_seen"], ["gpu_seen", "mps_limits", "mps_mig_limits", "mps_daemons"]]
)
def test_an_earlier_gpud_s_first_start_cut_short_before_the_jobs_table_is_taken_as_gpuds(
    tmp_path: Path, committed: list[str]
) -> None:
    """The first start commits its tables one feature at a time (gpu_seen, the mps_*
    tables, job_run_stops, then jobs): killed between two, a database without jobs was
    refused at every later start as another program's (exit 65, not restarted)."""
    with contextlib.closing(sqlite3.connect(tmp_path / DB_NAME)) as conn:  # no application_id
        for table in committed:
            conn.execute(f"CREATE TABLE {table} (k)")
        conn.commit()
    store = StateStore(tmp_path, known_tables=GPUD)
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS jobs (name TEXT PRIMARY KEY)"])
    assert _application_id(tmp_path) == 0  # not before its tables were all checked
    store.mark_ours()
    store.close()
    assert _application_id(tmp_path) == APPLICATION_ID  # and stamped gpud's from now on


def test_another_program_s_table_of_a_name_gpud_uses_is_refused_and_never_stamped(
    tmp_path: Path,
) -> None:
    """Another program's database with a jobs table of its own columns passed the check
    of table names and was stamped gpud's before the schema check refused it: from the
    next start on it was taken as gpud's."""
    with contextlib.closing(sqlite3.connect(tmp_path / DB_NAME)) as conn:  # no application_id
        conn.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, cmd TEXT)")
        conn.commit()
    store = StateStore(tmp_path, known_tables=GPUD)
    try:
        with pytest.raises(StateDamaged, match="table jobs has no column client_priority"):
            store.ensure_schema(JOBS_SCHEMA)
    finally:
        store.close()
    assert _application_id(tmp_path) == 0


def test_another_program_s_database_locked_during_the_check_is_checked_once_let_go(
    tmp_path: Path,
) -> None:
    """Another program's database whose lock was held as the start read it (a sqlite3
    shell's exclusive transaction) went unchecked to the writer, which waited for the
    lock, then stamped it gpud's: refused never again."""
    with contextlib.closing(sqlite3.connect(tmp_path / DB_NAME)) as conn:
        conn.execute("CREATE TABLE x (a)")
        conn.commit()
    holder = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    with (
        LetGoWhenSaid(holder).listening() as said,
        pytest.raises(StateDamaged, match=r"tables x, none of gpud's"),
    ):
        StateStore(tmp_path, known_tables=GPUD, warn_after_s=0)
    assert said.said and "is in use by another process" in said.said[0]
    assert _application_id(tmp_path) == 0


def test_a_database_locked_past_the_open_s_wait_is_refused_as_in_use_unchecked_unstamped(
    tmp_path: Path,
) -> None:
    with contextlib.closing(sqlite3.connect(tmp_path / DB_NAME)) as conn:
        conn.execute("CREATE TABLE x (a)")
        conn.commit()
    with contextlib.closing(sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)) as holder:
        holder.execute("BEGIN EXCLUSIVE")
        with pytest.raises(StateError, match="is in use by another process"):
            StateStore(tmp_path, known_tables=GPUD, busy_timeout_s=0)
    assert _application_id(tmp_path) == 0


class _Statements(StateStore):
    """The state database, keeping each statement of its open and whether the writer's
    connection ran it."""

    def __init__(self, state: Path, **kwargs: Any) -> None:
        self.ran: list[tuple[bool, str]] = []
        super().__init__(state, **kwargs)

    def _open_step(
        self, conn: sqlite3.Connection, statement: str, deadline: float, warn_at: float
    ) -> list[sqlite3.Row]:
        self.ran.append((conn is getattr(self, "_conn", None), statement))
        return super()._open_step(conn, statement, deadline, warn_at)


def test_a_start_reads_the_database_through_for_damage_once(tmp_path: Path) -> None:
    _jobs_database(tmp_path)
    store = _Statements(tmp_path, known_tables=GPUD)
    store.close()
    checks = [(writer, s) for writer, s in store.ran if s.startswith("PRAGMA quick_check")]
    assert checks == [(False, "PRAGMA quick_check(5)")]  # the read-only check's, not the writer's


def test_gpud_killed_mid_run_after_a_first_start_cut_short_serves_at_each_restart(
    tmp_path: Path,
) -> None:
    """A real ``gpud --simulate`` on the database a first start killed after gpu_seen and
    the mps_* tables left (refused before, exit 65, for good), killed again (SIGKILL) while
    its -wal holds what it committed, then started again: it serves each time."""
    state = tmp_path / "state"
    state.mkdir()
    with contextlib.closing(sqlite3.connect(state / DB_NAME)) as conn:  # no application_id
        for statement in (*SEEN_SCHEMA, *MPS_SCHEMA):
            conn.execute(statement)
        conn.commit()
    with short_dir() as run:
        argv = ["-m", "gpud.main", "--simulate", "H100-SXM5-80GB:1", "--state-dir", str(state)]
        argv += ["--run-dir", str(run), "--socket", str(run / "gpud.sock")]
        argv += ["--metrics-address", "127.0.0.1:0"]
        for _ in range(2):  # each ends in SIGKILL, at the end of running_tool
            with running_tool(argv, began=".*serving gRPC on"):
                assert (state / f"{DB_NAME}-wal").stat().st_size > 0
    assert _application_id(state) == APPLICATION_ID
    with contextlib.closing(sqlite3.connect(state / DB_NAME)) as conn:
        made = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert made - {"sqlite_sequence"} <= GPUD  # each table a start makes is known as gpud's


def test_a_new_database_is_stamped_gpud_s_before_any_table_is_made(tmp_path: Path) -> None:
    StateStore(tmp_path, known_tables=GPUD).close()  # killed before the first table
    assert _application_id(tmp_path) == APPLICATION_ID
    with contextlib.closing(sqlite3.connect(tmp_path / DB_NAME)) as conn:
        conn.execute("CREATE TABLE x (a)")  # not one of gpud's: a stamped file is gpud's
        conn.commit()
    StateStore(tmp_path, known_tables=GPUD).close()


def test_a_database_stamped_by_another_program_is_refused_whatever_its_tables(
    tmp_path: Path,
) -> None:
    with contextlib.closing(sqlite3.connect(tmp_path / DB_NAME)) as conn:
        conn.execute("PRAGMA application_id = 1234")
        conn.execute("CREATE TABLE jobs (name TEXT PRIMARY KEY)")
        conn.commit()
    with pytest.raises(StateDamaged) as caught:
        StateStore(tmp_path, known_tables=GPUD)
    assert str(caught.value).startswith(
        f"state database {tmp_path / DB_NAME} is unreadable (application_id 0x4d2, not"
        f" gpud's {APPLICATION_ID:#x}: another program's database?)"
    )


def test_a_wal_that_damages_the_database_is_refused_before_it_is_copied_into_it(
    tmp_path: Path,
) -> None:
    """A foreign -wal that leaves page 1 (the schema) alone: jobs is still seen, the
    writer's quick_check found the damage, and its close copied the foreign pages into
    state.db for good and deleted the -wal. Now the read-only probe's quick_check refuses
    it first: moved aside, the jobs are all there."""
    db = _jobs_database(tmp_path / "state")
    other = sqlite3.connect(tmp_path / "other.db", isolation_level=None)
    other.execute("PRAGMA journal_mode=WAL")
    # as many pages as state.db, page 2 an index where state.db has the jobs table
    other.execute("CREATE TABLE y (a PRIMARY KEY, b) WITHOUT ROWID")
    other.execute("CREATE TABLE z (a)")
    other.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    other.execute("PRAGMA wal_autocheckpoint=0")
    other.execute("INSERT INTO y VALUES (1, 2)")  # one frame: page 2
    log = (tmp_path / "other.db-wal").read_bytes()
    other.close()
    state = tmp_path / "state"
    wal = state / f"{DB_NAME}-wal"
    wal.write_bytes(log)
    with pytest.raises(StateDamaged) as caught:
        StateStore(state, known_tables=GPUD)
    assert f"as read through {wal}" in str(caught.value)
    assert f"move {wal} aside (the database's contents are unchanged)" in str(caught.value)
    _kept_and_whole_once_moved_aside(state, db, log)


def test_the_daemon_stops_on_another_database_s_wal_and_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    _jobs_database(state)
    _another_databases_wal(state)
    with short_dir() as run:
        args = ["--simulate", "H100-SXM5-80GB:1", "--state-dir", str(state), "--run-dir", str(run)]
        args += ["--socket", str(run / "gpud.sock"), "--metrics-address", "127.0.0.1:0"]
        assert main(args) == EXIT_STATE_DAMAGED
    err = capsys.readouterr().err
    assert f"move {state / DB_NAME}-wal aside (the database's contents are unchanged)" in err
    assert "not restarted for this" in err and str(EXIT_STATE_DAMAGED) in restart_prevented()
    assert "Traceback" not in err


def test_a_database_removed_while_open_takes_no_more_changes(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT)"])
    for name in os.listdir(tmp_path):  # rm -rf of the state directory
        (tmp_path / name).unlink()
    with (
        pytest.raises(StateUnwritable, match="was removed or replaced while gpud ran"),
        store.transaction() as conn,
    ):
        conn.execute("INSERT INTO t (v) VALUES ('lost at the next start')")
    with store.transaction() as conn:  # what it holds can still be read
        assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 0
    fill(tmp_path)  # another file in its place
    with pytest.raises(StateUnwritable, match="was removed or replaced"), store.transaction() as c:
        c.execute("INSERT INTO t (v) VALUES ('lost too')")
    store.close()


def test_a_wal_removed_while_open_takes_no_more_changes_and_keeps_what_it_held(
    tmp_path: Path,
) -> None:
    """``rm state.db-wal`` under a running gpud: SQLite goes on writing to the removed file,
    so a change would be lost (with all the WAL held) at a crash. It is refused instead, and
    what was committed is copied into ``state.db``, which is all a crash leaves."""
    state = tmp_path / "state"
    store = _wal_removed(state)
    with (
        pytest.raises(StateUnwritable, match=f"write-ahead log {state / DB_NAME}-wal .* removed"),
        store.transaction() as conn,
    ):
        conn.execute("INSERT INTO t (v) VALUES ('lost at a crash')")
    with store.transaction() as conn:  # reads still hold
        assert [r[0] for r in conn.execute("SELECT v FROM t")] == ["committed"]
    assert _crash_leaves(state, tmp_path / "crashed") == ["committed"]
    store.close()


def test_a_read_does_not_wait_for_a_writer_and_sees_what_was_committed(tmp_path: Path) -> None:
    """``reading()``: the event loop's reads go to a connection of their own, a snapshot of
    what is committed, while another thread holds the store in an open write."""
    import threading

    store = StateStore(tmp_path / "state")
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT)"])
    with store.transaction() as conn:
        conn.execute("INSERT INTO t (v) VALUES ('committed')")
    writing, done = threading.Event(), threading.Event()

    def writer() -> None:
        with store.transaction() as conn:
            conn.execute("INSERT INTO t (v) VALUES ('not yet')")
            writing.set()
            done.wait(10)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert writing.wait(5)
        with store.reading():
            with store.transaction() as conn:  # what the registry's reads do
                rows = [r["v"] for r in conn.execute("SELECT v FROM t")]
                with pytest.raises(sqlite3.OperationalError, match="readonly"):
                    conn.execute("INSERT INTO t (v) VALUES ('no')")
            with store.reading(), store.transaction() as again:  # nested: the same snapshot
                assert again is conn
        assert rows == ["committed"]
    finally:
        done.set()
        thread.join()
    with store.reading(), store.transaction() as conn:
        assert [r["v"] for r in conn.execute("SELECT v FROM t")] == ["committed", "not yet"]
    store.close()


def test_a_bounded_close_says_once_that_a_read_still_ran(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stop's close with a read still under way on another thread (a loop pass given up):
    it waits at most ``wait_s`` in all, then leaves that connection to the exit and says so
    in one line, instead of returning silently."""
    store = StateStore(tmp_path)
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT)"])
    reading, release = threading.Event(), threading.Event()

    def read() -> None:
        with store.reading():
            reading.set()
            release.wait(10)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert reading.wait(5)
        store.close(wait_s=0.2)
        assert reader.is_alive()  # the close did not wait for the read, which still runs
    finally:
        release.set()
        reader.join(5)
    lines = [r for r in caplog.records if "a read still ran at the stop" in r.getMessage()]
    assert [r.levelname for r in lines] == ["WARNING"]
    assert str(tmp_path / DB_NAME) in lines[0].getMessage()


def _committed(state: Path) -> StateStore:
    """A store of one committed row in ``t``, its files checked once (all there)."""
    store = StateStore(state)
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT)"])
    with store.transaction() as conn:
        conn.execute("INSERT INTO t (v) VALUES ('committed')")
    assert store.check_files() is None
    return store


def _wal_removed(state: Path, *, checked: bool = False) -> StateStore:
    """A store of one committed row in ``t``, whose WAL was then removed (``rm``); with
    ``checked``, :meth:`StateStore.check_files` found its files there before."""
    store = StateStore(state)
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT)"])
    with store.transaction() as conn:
        conn.execute("INSERT INTO t (v) VALUES ('committed')")
    if checked:
        assert store.check_files() is None
    (state / f"{DB_NAME}-wal").unlink()
    return store


def _crash_leaves(state: Path, into: Path) -> list[str]:
    """The rows of ``t`` a crash now leaves: the database file alone (the WAL removed)."""
    into.mkdir()
    (into / DB_NAME).write_bytes((state / DB_NAME).read_bytes())
    left = sqlite3.connect(into / DB_NAME)
    try:
        return [r[0] for r in left.execute("SELECT v FROM t")]
    finally:
        left.close()


def test_a_first_read_after_the_wal_was_removed_reads_and_the_stop_keeps_all(
    tmp_path: Path,
) -> None:
    """The reader connection holds the WAL from the start: one opened by a first read after
    ``rm state.db-wal`` made a new, empty one, failed (disk I/O error) and, closed last at
    the stop, left a database without its tables."""
    state = tmp_path / "state"
    store = _wal_removed(state)
    with store.reading(), store.transaction() as conn:
        assert [r[0] for r in conn.execute("SELECT v FROM t")] == ["committed"]
    assert not (state / f"{DB_NAME}-wal").exists()
    said = store.check_files()  # the loop's next check saves it
    assert said is not None and said.endswith("kept in the database file; restart gpud")
    assert _crash_leaves(state, tmp_path / "crashed") == ["committed"]
    assert store.check_files() is None
    store.close()
    assert _crash_leaves(state, tmp_path / "stopped") == ["committed"]


def test_a_removed_wal_is_checkpointed_when_first_checked_and_said_once(tmp_path: Path) -> None:
    """``rm state.db-wal`` and no change tried since: :meth:`check_files` (each loop pass)
    copies what it held into ``state.db``, so a crash keeps it, and says so once."""
    state = tmp_path / "state"
    store = _wal_removed(state, checked=True)
    said = store.check_files()
    assert said == (
        f"write-ahead log {state / DB_NAME}-wal of the state database was removed or replaced "
        "while gpud ran: gpud refuses every change from now on; what was committed before is "
        "kept in the database file; restart gpud"
    )
    assert _crash_leaves(state, tmp_path / "crashed") == ["committed"]
    assert store.check_files() is None  # said once
    with pytest.raises(StateUnwritable, match="nothing of this change"), store.transaction() as c:
        c.execute("INSERT INTO t (v) VALUES ('refused')")
    store.close()


def test_a_removed_database_is_said_once_by_check_files(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    (tmp_path / DB_NAME).unlink()
    said = store.check_files()
    assert said is not None
    assert said.startswith(f"state database {tmp_path / DB_NAME} was removed or replaced")
    assert said.endswith(
        "restart gpud (on the database restored from a backup, or on none to start afresh)"
    )
    assert store.check_files() is None
    store.close()


def _reads_at_once(store: StateStore, busy: str) -> None:
    """A read on another thread (ListJobs on the event loop) ends within 2 s, while
    ``busy`` runs, and finds the committed row."""
    rows: list[str] = []

    def read() -> None:
        with store.reading(), store.transaction() as conn:
            rows.extend(r[0] for r in conn.execute("SELECT v FROM t"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(2)
    assert not reader.is_alive(), f"the read waited for {busy}"
    assert rows == ["committed"]


def test_a_read_after_the_wal_was_removed_does_not_wait_for_a_writer(tmp_path: Path) -> None:
    """After ``rm state.db-wal`` a read (ListJobs on the event loop) still never waits on
    another thread's open transaction: saving what the WAL holds is the loop's check."""
    store = _wal_removed(tmp_path / "state")
    writing, done = threading.Event(), threading.Event()

    def writer() -> None:
        with store.transaction() as conn:
            conn.execute("SELECT 1").fetchone()
            writing.set()
            done.wait(10)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert writing.wait(5)
        _reads_at_once(store, "the writer")
    finally:
        done.set()
        thread.join()
    store.close()


def test_a_removed_wal_is_saved_whole_though_a_read_was_open_across_a_commit(
    tmp_path: Path,
) -> None:
    """A read whose snapshot is older than the last commit, open when the removal is
    checked: the checkpoint waits for it, so ``state.db`` alone holds every committed row
    (a partial one left a database a crash found malformed)."""
    state = tmp_path / "state"
    store = _committed(state)
    reading, release = threading.Event(), threading.Event()

    def read() -> None:
        with store.reading(), store.transaction() as conn:
            conn.execute("SELECT count(*) FROM t").fetchone()  # the snapshot is taken
            reading.set()
            release.wait(10)

    reader = threading.Thread(target=read)
    reader.start()
    assert reading.wait(5)
    with store.transaction() as conn:
        conn.execute("INSERT INTO t (v) VALUES ('later')")
    (state / f"{DB_NAME}-wal").unlink()
    said: list[str | None] = []
    checking = threading.Thread(target=lambda: said.append(store.check_files()), daemon=True)
    checking.start()
    checking.join(0.3)
    release.set()
    reader.join(5)
    checking.join(5)
    assert (
        said and said[0] is not None and said[0].endswith("kept in the database file; restart gpud")
    )
    assert _crash_leaves(state, tmp_path / "crashed") == ["committed", "later"]
    store.close()


def test_a_read_does_not_wait_for_the_checkpoint_of_a_removed_wal(tmp_path: Path) -> None:
    """The loop's check copying what a removed WAL holds into ``state.db`` (a write and an
    fsync, long on a slow disk): a read begun meanwhile (ListJobs on the event loop) does
    not wait for it, and the copy is still whole."""
    state = tmp_path / "state"
    store = _committed(state)
    (state / f"{DB_NAME}-wal").unlink()
    checkpointing, release = threading.Event(), threading.Event()

    def slow(statement: str) -> None:
        if "wal_checkpoint" in statement:
            checkpointing.set()
            release.wait(10)

    store._conn.set_trace_callback(slow)
    said: list[str | None] = []
    checking = threading.Thread(target=lambda: said.append(store.check_files()))
    checking.start()
    try:
        assert checkpointing.wait(5)
        _reads_at_once(store, "the checkpoint")
    finally:
        release.set()
        checking.join(5)
    store._conn.set_trace_callback(None)
    assert (
        said and said[0] is not None and said[0].endswith("kept in the database file; restart gpud")
    )
    assert _crash_leaves(state, tmp_path / "crashed") == ["committed"]
    store.close()


def _wal_removed_behind_an_older_snapshot(
    state: Path,
) -> tuple[StateStore, sqlite3.Connection]:
    """A store whose 100 last rows were committed while another process (the connection
    returned, its transaction open) read an older snapshot; its WAL then removed."""
    store = _committed(state)
    other = sqlite3.connect(state / DB_NAME, isolation_level=None)
    other.execute("BEGIN")
    other.execute("SELECT count(*) FROM t").fetchone()
    with store.transaction() as conn:
        conn.executemany("INSERT INTO t (v) VALUES (?)", [("x" * 200,) for _ in range(100)])
    (state / f"{DB_NAME}-wal").unlink()
    return store, other


def test_a_removed_wal_not_saved_whole_is_tried_again_at_the_next_check(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process reading an older snapshot (a sqlite3 shell) when the removal is
    first checked: the checkpoint copies what it can and says that it may be lost; the next
    checks try again, and the first that copies it all says so in the journal."""
    state = tmp_path / "state"
    store, other = _wal_removed_behind_an_older_snapshot(state)
    said = store.check_files()
    assert said is not None and "may be lost unless gpud stops cleanly" in said
    other.execute("COMMIT")
    other.close()
    assert store.check_files() is None  # said once; saved now
    assert len(_crash_leaves(state, tmp_path / "crashed")) == 101
    kept = [r for r in caplog.records if "kept in the database file" in r.getMessage()]
    assert [r.levelname for r in kept] == ["WARNING"]
    store.close()


def test_a_removed_wal_saved_whole_at_the_first_check_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A change refused before the loop's check, its checkpoint not whole (another process
    reading an older snapshot); the check then copies it all: the check says it is kept,
    and the journal does not say it again."""
    state = tmp_path / "state"
    store, other = _wal_removed_behind_an_older_snapshot(state)
    with pytest.raises(StateUnwritable, match="may be lost"), store.transaction() as conn:
        conn.execute("INSERT INTO t (v) VALUES ('refused')")
    other.execute("COMMIT")
    other.close()
    said = store.check_files()
    assert said is not None and said.endswith("kept in the database file; restart gpud")
    assert not [r for r in caplog.records if "kept in the database file" in r.getMessage()]
    store.close()


def test_a_change_refused_after_the_check_uses_its_verdict(tmp_path: Path) -> None:
    """A change refused after the loop's check saved what the removed WAL held says what
    the check said, and checkpoints nothing again."""
    store = _wal_removed(tmp_path / "state")
    said = store.check_files()
    assert said is not None
    ran: list[str] = []
    store._conn.set_trace_callback(ran.append)
    with pytest.raises(StateUnwritable) as caught, store.transaction() as conn:
        conn.execute("INSERT INTO t (v) VALUES ('refused')")
    assert said.split("; ", 1)[1] == str(caught.value).split("; ", 1)[1]
    assert not [s for s in ran if "wal_checkpoint" in s]
    store.close()


def test_a_database_in_use_by_another_process_says_to_stop_it_not_to_move_it(
    tmp_path: Path,
) -> None:
    """A sqlite3 shell holding the database in exclusive locking mode: the open fails after
    the busy timeout saying so, without the advice that throws what it holds away."""
    state = tmp_path / "state"
    fill(state)
    holder = sqlite3.connect(state / DB_NAME, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StateError) as caught:
            StateStore(state, busy_timeout_s=0.1)
    finally:
        holder.execute("COMMIT")
        holder.close()
    text = str(caught.value)
    assert not isinstance(caught.value, StateDamaged)  # exit 1: restarted, it can let go
    assert text.startswith(f"state database {state / DB_NAME} is in use by another process")
    assert text.endswith("stop it, then start gpud again; nothing was changed")
    assert "move it aside" not in text and "unreadable" not in text
    store = StateStore(state)
    with store.reading(), store.transaction() as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 500
    store.close()


def test_a_database_in_use_by_another_process_is_said_soon_and_still_waited_for(
    tmp_path: Path,
) -> None:
    """A sqlite3 shell holding the database: the open says so, naming the file, long before
    its busy timeout, and opens once the shell lets go within it."""
    state = tmp_path / "state"
    fill(state)
    holder = sqlite3.connect(state / DB_NAME, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    said = LetGoWhenSaid(holder)
    logging.getLogger("gpud.store").addHandler(said)
    try:
        store = StateStore(state, busy_timeout_s=30.0, warn_after_s=0.05)
    finally:
        logging.getLogger("gpud.store").removeHandler(said)
        holder.close()
    assert len(said.said) == 1
    assert said.said[0].startswith(
        f"state database {state / DB_NAME} is in use by another process (database is locked;"
    )
    assert re.search(r"gpud waits 29\.\d s more for it, then stops$", said.said[0])
    with store.reading(), store.transaction() as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 500
    store.close()


def test_an_open_waits_for_a_lock_only_what_is_left_of_its_one_deadline(
    tmp_path: Path,
) -> None:
    """The open's waits for another process's lock add up to ``busy_timeout_s`` at most,
    on the store's clock: after the warning it waits what is left since the start, not a
    timeout of its own per statement. The clock reads 12 s gone once the open began."""
    state = tmp_path / "state"
    fill(state)
    holder = sqlite3.connect(state / DB_NAME, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    reads = iter([100.0])
    said = LetGoWhenSaid(holder)
    logging.getLogger("gpud.store").addHandler(said)
    try:
        store = StateStore(
            state, busy_timeout_s=30.0, warn_after_s=3.0, clock=lambda: next(reads, 112.0)
        )
    finally:
        logging.getLogger("gpud.store").removeHandler(said)
        holder.close()
    assert len(said.said) == 1
    assert said.said[0].endswith("gpud waits 18.0 s more for it, then stops")
    store.close()


def _fds_on(path: Path) -> list[str]:
    """This process's descriptors open on ``path`` (``/proc/self/fd``)."""
    fds = Path("/proc/self/fd")
    found = []
    for fd in fds.iterdir():
        try:
            if os.readlink(fd) == str(path):
                found.append(fd.name)
        except OSError:
            continue  # the directory's own descriptor, closed as it was listed
    return found


_HOLD = """
import sqlite3, sys
holder = sqlite3.connect(sys.argv[1], isolation_level=None)
holder.execute("PRAGMA locking_mode=EXCLUSIVE")
holder.execute("BEGIN EXCLUSIVE")
print("held", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("why", ["in use", "damaged"])
def test_a_failed_open_leaves_no_descriptor_on_the_database(tmp_path: Path, why: str) -> None:
    """gpud stops on it, but a caller that goes on keeps no connection to a file the
    operator is to move aside or restore. The lock's holder is another process: SQLite
    keeps a closed descriptor open while its own process holds a lock on the file."""
    state = tmp_path / "state"
    fill(state)
    holder: subprocess.Popen[str] | None = None
    if why == "in use":
        holder = subprocess.Popen(
            [sys.executable, "-c", _HOLD, str(state / DB_NAME)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    else:
        with (state / DB_NAME).open("r+b") as f:
            f.seek(4096 * 3)
            f.write(b"\xff" * 4096 * 3)  # pages of the table: quick_check finds them damaged
    try:
        with pytest.raises(StateError):
            StateStore(state, busy_timeout_s=0.05, warn_after_s=0.05)
        assert _fds_on(state / DB_NAME) == []
    finally:
        if holder is not None:
            holder.kill()
            holder.communicate()


def _another_program_s_database_killed_mid_write(state: Path, scratch: Path) -> None:
    """Another program's rollback-mode database as a kill mid-write leaves it: pages
    already written into the file, the hot ``-journal`` that restores them next to it."""
    scratch.mkdir()
    with contextlib.closing(sqlite3.connect(scratch / DB_NAME, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute("CREATE TABLE x (a)")
        conn.execute("PRAGMA cache_size=1")  # changed pages spill into the file at once
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO x VALUES (?)", [("x" * 500,) for _ in range(200)])
        # copied while the write holds its lock: the copy's journal is hot
        for name in (DB_NAME, f"{DB_NAME}-journal"):
            (state / name).write_bytes((scratch / name).read_bytes())
        conn.execute("ROLLBACK")


def test_another_program_s_database_with_a_hot_journal_is_refused_and_never_stamped(
    tmp_path: Path,
) -> None:
    """The read-only check cannot read a file whose journal is hot (it would have to roll
    it back): the file went unchecked to the writer, which rolled it back, made it WAL,
    and the daemon then stamped another program's database gpud's for good."""
    state = tmp_path / "state"
    state.mkdir()
    _another_program_s_database_killed_mid_write(state, tmp_path / "other")
    with pytest.raises(StateDamaged, match=r"tables x, none of gpud's: another program's"):
        StateStore(state, known_tables=GPUD)
    assert _application_id(state) == 0
    with contextlib.closing(sqlite3.connect(state / DB_NAME)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not made WAL


class _FullDisk(StateStore):
    """The state database on a disk that takes no write: each transaction is refused as
    the store refuses one on a full disk; reads go on."""

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        if self.in_transaction():  # a read's snapshot
            with super().transaction() as conn:
                yield conn
            return
        raise StateUnwritable(
            f"state database {self.path} cannot be written (database or disk is full): "
            "nothing of this change was kept; free space or fix the file, then retry"
        )


def _earlier_gpud_s_database(state: Path) -> None:
    with contextlib.closing(sqlite3.connect(state / DB_NAME)) as conn:  # no application_id
        for statement in SEEN_SCHEMA:
            conn.execute(statement)
        conn.commit()


def test_a_stamp_the_disk_refuses_is_said_and_the_start_goes_on_to_stamp_it_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk refused the stamp of an earlier gpud's file and with it the start
    ("nothing of this change was kept ... then retry"), though the file, unstamped, still
    passes by its tables."""
    _earlier_gpud_s_database(tmp_path)
    store = _FullDisk(tmp_path, known_tables=GPUD)
    with caplog.at_level(logging.WARNING, logger="gpud.store"):
        store.mark_ours()
    store.close()
    assert [r.getMessage() for r in caplog.records] == [
        f"state database {tmp_path / DB_NAME} not stamped gpud's (state database"
        f" {tmp_path / DB_NAME} cannot be written (database or disk is full): nothing of this"
        " change was kept; free space or fix the file, then retry): stamped at a later start"
    ]
    assert _application_id(tmp_path) == 0
    store = StateStore(tmp_path, known_tables=GPUD)
    store.mark_ours()
    store.close()
    assert _application_id(tmp_path) == APPLICATION_ID


def test_a_stamped_database_takes_no_write_lock_to_be_known_as_gpud_s(tmp_path: Path) -> None:
    StateStore(tmp_path, known_tables=GPUD).close()  # a new database: stamped
    store = StateStore(tmp_path, known_tables=GPUD)
    begun = lock_waits(store)
    store.mark_ours()
    store.close()
    assert begun == []


def test_a_store_whose_file_no_check_read_stamps_nothing(tmp_path: Path) -> None:
    with contextlib.closing(sqlite3.connect(tmp_path / DB_NAME)) as conn:
        conn.execute("CREATE TABLE x (a)")
        conn.commit()
    store = StateStore(tmp_path)  # no known_tables: whose the file is was not read
    store.mark_ours()
    store.close()
    assert _application_id(tmp_path) == 0
