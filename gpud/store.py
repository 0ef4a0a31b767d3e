"""The daemon's persistent desired state: one SQLite database in the state directory.

``/var/lib/gpud/state.db`` by default, in WAL mode with ``synchronous=FULL``, so a committed
transaction survives a crash of the daemon or the host. Each feature owns its tables and
declares them with :meth:`StateStore.ensure_schema`; it reads and writes them through
:meth:`StateStore.transaction`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from gpud.errors import StateDamaged, StateError, StateInUse, StateUnwritable
from gpud.files import DB_MODE

DB_NAME = "state.db"
# PRAGMA application_id of every state database gpud writes ("GPUD" in ASCII), set in a new
# one's first transaction, before any table (in an earlier gpud's, once its tables passed
# the schema checks): it tells gpud's file from another program's however few of gpud's
# tables a first start that was cut short committed
APPLICATION_ID = 0x47505544
# the size of a write-ahead log's header: a -wal no larger holds no frames (a read of the
# database leaves an empty one)
_WAL_HEADER = 32

log = logging.getLogger(__name__)

# SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN (primary result codes): the
# file or the disk under it, not the SQL, is what failed.
_UNWRITABLE = frozenset({8, 10, 13, 14})
# SQLITE_PERM, SQLITE_READONLY, SQLITE_CANTOPEN: at open, the file's or the directory's
# owner or mode, not the content
_CANNOT_OPEN = frozenset({3, 8, 14})
# SQLITE_IOERR, SQLITE_FULL: at open, the disk under the file (full: no room for the WAL
# index, or failing), not its content
_DISK = frozenset({10, 13})
# SQLITE_BUSY, SQLITE_LOCKED: at open, another process holds the file's lock (a sqlite3
# shell in exclusive locking mode, a backup tool), past the busy timeout
_IN_USE = frozenset({5, 6})
# SQLITE_CORRUPT, SQLITE_NOTADB: at open, the file's content, which no restart mends
_DAMAGED = frozenset({11, 26})
# SQLITE_BUSY alone in a transaction: SQLITE_LOCKED there is a conflict within gpud's own
# connection (a table dropped while a statement reads it), a bug no other process causes
_BUSY = 5
_HOLDER = "a sqlite3 shell, a backup tool?"
# the least a transaction waits for another process's lock, however long it queued behind
# gpud's own writers: a lock taken for a moment does not refuse it at once
_LOCK_WAIT_FLOOR_S = 0.5
# how long a transaction waits for another process's lock before it is refused (below
# gpuctl's default --timeout, so that the API answers why)
WRITE_WAIT_S = 5.0


def worst_refusals_s(
    writes: int, write_wait_s: float = WRITE_WAIT_S, in_use_wait_s: float = _LOCK_WAIT_FLOOR_S
) -> float:
    """Seconds ``writes`` writes in a row wait for another process's lock on the file when
    each is refused (SQLITE_BUSY): the first ``write_wait_s``, each later one
    ``in_use_wait_s`` (see :meth:`StateStore.worst_refusals_s`)."""
    if writes <= 0:
        return 0.0
    return write_wait_s + (writes - 1) * min(in_use_wait_s, write_wait_s)


def _unreadable(path: Path, why: str) -> str:
    return (
        f"state database {path} is unreadable ({why}): restore it from a backup, or move it "
        "aside to start afresh (the job registry, reservations, admission queue and desired "
        "MIG layouts and MPS limits in it are then forgotten; what runs on the GPUs stays)"
    )


def _in_use_at_start(path: Path, err: sqlite3.Error) -> str:
    return (
        f"state database {path} is in use by another process ({err}; {_HOLDER}): stop it, "
        "then start gpud again; nothing was changed"
    )


def _open_error(path: Path, err: sqlite3.Error) -> StateError:
    """What an open of the database (the writer's or the reader's) that failed with ``err``
    tells the operator: the choices that fit the cause, so that a database gpud merely cannot
    open now is not moved aside with what it holds."""
    code = getattr(err, "sqlite_errorcode", 0) & 0xFF
    if code in _IN_USE:
        return StateError(_in_use_at_start(path, err))
    if code in _DISK:
        return StateError(
            f"cannot open the state database {path} ({err}): the disk under it is full or "
            f"failing: free space in {path.parent} (or check the device), then start gpud "
            "again; nothing in the database was changed"
        )
    if code in _CANNOT_OPEN:
        return StateError(
            f"cannot open the state database {path} ({err}): gpud's user must be able to "
            f"read and write it and to create files in {path.parent} (owner, mode, a "
            "read-only mount?)"
        )
    if code in _DAMAGED:
        return StateDamaged(_unreadable(path, str(err)))
    return StateError(_unreadable(path, str(err)))


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _declared(statements: Sequence[str]) -> dict[str, dict[str, sqlite3.Row]]:
    """Table -> column -> its ``PRAGMA table_info`` row, as ``statements`` create them (on
    an empty database in memory)."""
    declared = sqlite3.connect(":memory:")
    declared.row_factory = sqlite3.Row
    try:
        for statement in statements:
            declared.execute(statement)
        return {
            str(name): {str(r["name"]): r for r in declared.execute(f'PRAGMA table_info("{name}")')}
            for (name,) in declared.execute("SELECT name FROM sqlite_master WHERE type='table'")
        }
    finally:
        declared.close()


def declared_tables(*schemas: Sequence[str]) -> frozenset[str]:
    """The names of the tables ``schemas``' statements create (as :meth:`StateStore.ensure_schema`
    runs them)."""
    return frozenset(
        name
        for statements in schemas
        for name in _declared(statements)
        if not name.startswith("sqlite_")  # SQLite's own (AUTOINCREMENT's sqlite_sequence)
    )


def _addable(tables: Mapping[str, Mapping[str, sqlite3.Row]], table: str, column: str) -> str:
    """The ``ADD COLUMN`` definition of ``table.column``: the declared name and type. Only a
    nullable column can be added to rows that exist (they get NULL)."""
    row = tables.get(table, {}).get(column)
    if row is None or row["notnull"] or row["pk"]:
        raise ValueError(f"{table}.{column}: only a nullable declared column can be added")
    return f'"{column}" {row["type"]}'.rstrip()


def _create(path: Path) -> bool:
    """Create the database file, when missing, with :data:`DB_MODE` whatever the umask: it
    holds reservations' report tokens, and SQLite gives its ``-wal`` and ``-shm`` files the
    database's mode. One that exists, or cannot be created, is left to SQLite's open (which
    says why it cannot). Whether this call created it (empty, so gpud's)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, DB_MODE)
    except OSError:
        return False
    try:
        os.fchmod(fd, DB_MODE)
    finally:
        os.close(fd)
    return True


def _wal_beside(path: Path) -> Path | None:
    """``path``'s ``-wal`` when it holds frames: SQLite's open reads it into the database,
    whichever database wrote it."""
    wal = path.with_name(path.name + "-wal")
    try:
        return wal if wal.stat().st_size else None
    except OSError:
        return None


def _wal_size(wal: Path) -> int:
    """``wal``'s size in bytes; 0 when there is none."""
    try:
        return wal.stat().st_size
    except OSError:
        return 0


def _refuse_found(path: Path, why: str) -> NoReturn:
    """Refuse the database for ``why`` (what the read-only probe found), saying to move a
    non-empty ``-wal`` aside too: it may be what made it so (another database's log, or
    one that rewrote its pages), and it is read into any database put in its place."""
    wal = _wal_beside(path)
    if wal is None:
        raise StateDamaged(_unreadable(path, why))
    raise StateDamaged(
        f"state database {path} is unreadable ({why}) as read through {wal}, a write-ahead "
        f"log next to it (another database's?): move {wal} aside (the database's contents "
        f"are unchanged), then start gpud again; if it is still refused, restore {path} "
        "from a backup or move it aside too"
    )


def _tables(
    conn: sqlite3.Connection, step: Callable[[sqlite3.Connection, str], list[sqlite3.Row]]
) -> list[str]:
    """The names of ``conn``'s tables (SQLite's own left out), sorted."""
    query = "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'"
    return sorted(str(row[0]) for row in step(conn, query))


def _check_ours(
    path: Path,
    known: Collection[str],
    step: Callable[[sqlite3.Connection, str], list[sqlite3.Row]],
) -> bool:
    """Refuse a database that is not gpud's or is damaged (see :class:`StateStore`) before
    the writer's connection opens it: read through a read-only connection, which reads a
    ``-wal`` as the writer would but, at its close, never copies it into the database (a
    read-write connection's last close does, and deletes it), so that the database's
    contents stay as they were found (SQLite may leave an empty ``-wal`` and a ``-shm``
    next to it). gpud's: its ``PRAGMA application_id`` is :data:`APPLICATION_ID`; or, not
    set (a file of an earlier gpud, or no table yet), it holds no tables or one of
    ``known``. ``step`` runs each statement within the open's deadline: another process's
    lock on the file (SQLITE_BUSY) is waited for, said once, and past the deadline refuses
    the start, so that a file never goes unchecked to the writer (which would stamp
    another program's database gpud's once the lock is let go). True when the file was
    read and found sound; False when it is missing or this read cannot open it (left to
    the writer's open, which says why)."""
    try:
        probe = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=0)
    except sqlite3.Error:
        return False
    try:
        (application_id,) = (int(row[0]) for row in step(probe, "PRAGMA application_id"))
        found = _tables(probe, step)
        damage = [" ".join(str(row[0]).split()) for row in step(probe, "PRAGMA quick_check(5)")]
    except sqlite3.Error as err:
        code = getattr(err, "sqlite_errorcode", 0) & 0xFF
        if code in _IN_USE:
            raise _open_error(path, err) from None
        if code not in _DAMAGED:
            return False
        _refuse_found(path, str(err))
    finally:
        probe.close()
    if damage != ["ok"]:
        _refuse_found(path, "; ".join(damage))
    _refuse_not_ours(path, application_id, found, known)
    return True


def _refuse_not_ours(
    path: Path, application_id: int, found: Collection[str], known: Collection[str]
) -> None:
    """Refuse the database when it is not gpud's: its ``PRAGMA application_id`` is another
    program's, or, not set, it holds tables (``found``), none of ``known``."""
    if application_id not in (0, APPLICATION_ID):
        _refuse_found(
            path,
            f"application_id {application_id:#x}, not gpud's {APPLICATION_ID:#x}: another "
            "program's database?",
        )
    if application_id == 0 and found and not set(found) & set(known):
        _refuse_found(
            path, f"tables {', '.join(found)}, none of gpud's: another program's database?"
        )


class StateStore:
    """A thread-safe handle on ``<state_dir>/state.db``.

    One connection, serialised by a lock: the daemon's writes are small and rare, and one
    connection keeps every feature's view consistent.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        busy_timeout_s: float = 30.0,
        warn_after_s: float = 3.0,
        write_wait_s: float = WRITE_WAIT_S,
        in_use_wait_s: float = _LOCK_WAIT_FLOOR_S,
        clock: Callable[[], float] = time.monotonic,
        known_tables: Collection[str] | None = None,
    ) -> None:
        """Raises :class:`StateError`, naming the file, when it cannot be opened or
        ``PRAGMA quick_check`` finds it damaged: nothing in it is thrown away unasked; a
        :class:`StateDamaged` when its content, not the disk or a lock, is the cause.
        ``known_tables``: the tables the daemon makes; given, the file is read first
        through a read-only connection (its ``-wal`` too, copied into nothing) and refused,
        before a connection that writes opens it (one it cannot read, such as a file whose
        ``-journal`` is hot, by the writer's first read, before WAL mode), when
        ``PRAGMA quick_check`` finds it damaged, or it is not gpud's: its ``PRAGMA application_id`` (set to
        :data:`APPLICATION_ID` in the store's first transaction) is another program's, or,
        not set (a file of an earlier gpud), it holds tables, none of these. So another
        program's database, or one into which SQLite's open replayed another program's WAL
        (``state.db-wal``, a backup restored next to the crashed daemon's log), is never
        opened for writing (which would make gpud's tables again, empty, and at its close
        checkpoint the foreign pages into the file for good). A 0-byte file whose ``-wal``
        holds no frames (none, or the empty one a read leaves) is a first start cut short
        before its first commit (power lost): a new database; one whose ``-wal`` holds
        frames was truncated, refused. The file is stamped gpud's (``application_id``) at
        the open only when it holds no tables yet; one of an earlier gpud, by
        :meth:`mark_ours` once the daemon's tables were all found as declared.
        ``busy_timeout_s``: how long the open waits for another process's lock on the file
        before it fails; ``warn_after_s``: when an open that waits for one says so, naming
        the file. ``write_wait_s``: how long a transaction then waits for such a lock
        (SQLite's ``busy_timeout``) before it raises :class:`StateInUse`: less than gpuctl's
        default ``--timeout``, so that the API answers why. ``in_use_wait_s``: once one was
        refused so, how long each later one waits for that lock (its busy timeout), until
        one commits: the daemon's loop writes in several steps a pass, which would each wait
        ``write_wait_s`` in turn, past the systemd watchdog. ``clock``: the open's deadline,
        and when a change was last refused (:meth:`write_problem`)."""
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StateError(f"state directory {state_dir}: {err.strerror or err}") from None
        self.path = state_dir / DB_NAME
        self._lock = threading.RLock()
        self._reader_lock = threading.Lock()
        self._reading = threading.local()
        self._writer: int | None = None  # the thread whose transaction is open (under _lock)
        self._write_begun: float | None = None  # when it began (clock; set under _lock)
        self._clock = clock
        self._write_wait_s = write_wait_s
        self._in_use_wait_s = in_use_wait_s
        # why the latest change was not written, and when (clock): gpuctl status says it;
        # and whether another process's lock refused it (then any lock taken ends it). One
        # tuple, set whole: write_problem reads it without the lock
        self._refused: tuple[str, float, bool] | None = None
        # the writer's busy timeout (ms) as last set, None when not known: a transaction
        # sets it only when its wait differs, not with a statement on every write
        self._busy_ms: int | None = None
        # the database or its WAL found removed or replaced: why, and since when (clock);
        # for good, until the restart
        self._gone: tuple[str, float] | None = None
        with contextlib.suppress(OSError):
            # SQLite takes an empty file for a new database. gpud's first start makes the
            # file, then commits (fsync) its first transaction: a power loss between the two
            # leaves it empty, with no -wal, or the empty one a read of it left (a WAL's
            # header is 32 bytes, frames follow); one gpud wrote is never empty, so an empty
            # one next to a -wal that holds frames was truncated
            found = self.path.stat()
            wal = self.path.with_name(self.path.name + "-wal")
            framed = _wal_size(wal) > _WAL_HEADER
            if found.st_size == 0 and stat.S_ISREG(found.st_mode) and framed:
                raise StateDamaged(_unreadable(self.path, "empty: 0 bytes, truncated?"))
            if not stat.S_ISREG(found.st_mode):
                # SQLite says only "unable to open database file", as for a mode or owner
                kind = "a directory" if stat.S_ISDIR(found.st_mode) else "not a regular file"
                raise StateDamaged(
                    f"state database {self.path} is {kind}, not the database file: move it "
                    "aside (a backup restored into it: put its state.db in its place), then "
                    "start gpud again"
                )
        # one deadline for the whole open, both connections: each statement waits for
        # another process's lock only for what is left of it, said once at warn_after_s
        started = clock()
        deadline, warn_at = started + busy_timeout_s, started + min(busy_timeout_s, warn_after_s)
        self._warned = False
        # until the daemon's start is done (start_done): its first transactions (each
        # feature's ensure_schema) wait, as the open did, to the open's deadline; the
        # open's steps pass at once in WAL mode while another process's write holds the lock
        self._starting: tuple[float, float] | None = (deadline, warn_at)
        # whether the read-only probe found the file sound: the writer's quick_check,
        # which reads every page again, is then skipped
        checked = known_tables is not None and _check_ours(
            self.path,
            known_tables,
            lambda conn, statement: self._open_step(conn, statement, deadline, warn_at),
        )
        try:
            created = _create(self.path)
            self._conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=write_wait_s
            )
        except sqlite3.Error as err:
            raise _open_error(self.path, err) from None
        # a file the probe could not read (a hot journal: SQLITE_READONLY_ROLLBACK) is
        # checked by the writer, so that none goes unchecked to mark_ours; whose the file
        # is was then checked (by the probe, the writer, or it is new): only then may
        # mark_ours stamp it gpud's
        unchecked = known_tables if not checked and not created else None
        self._owner_checked = known_tables is not None
        try:
            self._conn.row_factory = sqlite3.Row
            damage = self._first_steps(deadline, warn_at, checked=checked, unchecked=unchecked)
            self._set_busy_timeout(round(write_wait_s * 1000))
        except sqlite3.Error as err:
            self._conn.close()
            raise _open_error(self.path, err) from None
        except StateDamaged:
            self._conn.close()
            raise
        if damage != ["ok"]:
            self._conn.close()
            raise StateDamaged(_unreadable(self.path, "; ".join(damage)))
        self._file = _file_id(self.path)
        # the write-ahead log: the open (its quick_check) made it, and SQLite keeps it while a
        # connection is open; committed changes live in it until a checkpoint
        self._wal_path = self.path.with_name(self.path.name + "-wal")
        self._wal = _file_id(self._wal_path)
        # once the files were found not kept: the file gone, and what became of the WAL's
        # content (_save_replaced); and whether check_files() said it
        self._saved: tuple[str, str] | None = None
        self._said = False
        try:
            # opened now, and a first read done, so that it holds this WAL too: one opened
            # after the WAL was removed would make a new, empty one, read nothing from it,
            # and (the last connection to close) checkpoint that into state.db at the stop
            self._reader = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=write_wait_s
            )
        except sqlite3.Error as err:
            self._conn.close()
            raise _open_error(self.path, err) from None
        try:
            self._reader.row_factory = sqlite3.Row
            self._reader.execute("PRAGMA query_only=ON")
            self._open_step(self._reader, "SELECT count(*) FROM sqlite_master", deadline, warn_at)
            self._reader.execute(f"PRAGMA busy_timeout = {round(write_wait_s * 1000)}")
        except sqlite3.Error as err:
            self._reader.close()
            self._conn.close()
            raise _open_error(self.path, err) from None

    def start_done(self) -> None:
        """The daemon's start is done: from now on a transaction waits for another process's
        lock on the file (SQLite's busy timeout) ``write_wait_s`` at most, and is refused
        as a change, not as a start. Before, it waits what is left of the open's
        ``busy_timeout_s``, said once at ``warn_after_s``, and a refusal says to stop that
        process and start gpud again."""
        self._starting = None

    def worst_refusals_s(self, writes: int) -> float:
        """Seconds ``writes`` writes in a row wait for another process's lock on the file,
        once the start is done, when each is refused (SQLITE_BUSY): the first
        ``write_wait_s``, each later one ``in_use_wait_s`` (see :meth:`transaction`; the
        wait behind this process's own writers is not counted: a commit hung in a disk's
        fsync holds them without bound)."""
        return worst_refusals_s(writes, self._write_wait_s, self._in_use_wait_s)

    def _first_steps(
        self,
        deadline: float,
        warn_at: float,
        *,
        checked: bool,
        unchecked: Collection[str] | None,
    ) -> list[str]:
        """WAL, ``synchronous=FULL``, foreign keys, then ``PRAGMA quick_check``'s findings
        (``["ok"]`` unread when the probe ``checked`` the file). ``unchecked``: gpud's
        tables, given when the file was there but the read-only probe could not read it (a
        hot ``-journal``, which only a connection that writes may roll back): it is refused
        as the probe would, unless its ``application_id`` is gpud's or it holds no tables
        or one of these, read by the writer's first statement (SQLite rolls the journal
        back then, as any program's open would) and before WAL mode rewrites its header;
        :meth:`mark_ours` stamps nothing when the file was checked by neither. A sound
        file that holds no tables and whose ``application_id`` is not set (a new database)
        is stamped gpud's (:data:`APPLICATION_ID`), in a transaction of its own before any
        feature's table.
        One with tables is stamped by :meth:`mark_ours`: stamped before the schema checks,
        another program's file with a table of one of gpud's names would be taken as gpud's
        for good, however its columns then refused it."""

        def step(statement: str) -> list[sqlite3.Row]:
            return self._open_step(self._conn, statement, deadline, warn_at)

        if unchecked is not None:
            (application_id,) = (int(row[0]) for row in step("PRAGMA application_id"))
            found = _tables(self._conn, lambda _, query: step(query))
            _refuse_not_ours(self.path, application_id, found, unchecked)
        for statement in ("journal_mode=WAL", "synchronous=FULL", "foreign_keys=ON"):
            step(f"PRAGMA {statement}")
        damage = ["ok"]
        if not checked:
            damage = [" ".join(str(row[0]).split()) for row in step("PRAGMA quick_check(5)")]
        if damage == ["ok"]:
            (stamp,) = step("PRAGMA application_id")
            if not stamp[0] and not _tables(self._conn, lambda _, query: step(query)):
                step(f"PRAGMA application_id = {APPLICATION_ID}")
        return damage

    def mark_ours(self) -> None:
        """Stamp the file gpud's (``PRAGMA application_id`` = :data:`APPLICATION_ID`) when
        it is not yet: the daemon calls it once every feature's :meth:`ensure_schema`
        passed, so that a database of an earlier gpud (tables, no stamp) is known as gpud's
        from then on, and another program's, refused by a schema check, never is. A store
        opened without ``known_tables`` (whose file's owner no check read) stamps nothing.
        The stamp is read first, so a stamped file takes no write lock. A disk that refuses
        the stamp (full, failing) fails nothing: it is said in a warning naming the file,
        and a later start stamps it (unstamped, gpud's tables still pass the check).
        Another process's lock past the wait raises :class:`StateInUse` (stop it, start
        again)."""
        if not self._owner_checked:
            return
        try:
            with self.read() as conn:
                if conn.execute("PRAGMA application_id").fetchone()[0]:
                    return
            with self.transaction() as conn:
                if not conn.execute("PRAGMA application_id").fetchone()[0]:
                    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        except StateInUse:
            raise
        except StateUnwritable as err:
            log.warning(
                "state database %s not stamped gpud's (%s): stamped at a later start",
                self.path,
                err,
            )

    def _open_step(
        self, conn: sqlite3.Connection, statement: str, deadline: float, warn_at: float
    ) -> list[sqlite3.Row]:
        """``statement``'s rows, run within the open's deadline (on the store's clock).
        Another process's lock on the file (a sqlite3 shell in exclusive mode) is said once,
        at ``warn_at``, naming the file, while the open waits on until ``deadline``: a lock
        let go meanwhile, or a slow disk, fails nothing."""
        self._wait_until(conn, deadline if self._warned else min(warn_at, deadline))
        try:
            return conn.execute(statement).fetchall()
        except sqlite3.OperationalError as err:
            left = deadline - self._clock()
            if err.sqlite_errorcode & 0xFF not in _IN_USE or left <= 0 or self._warned:
                raise
            self._warned = True
            log.warning(
                "state database %s is in use by another process (%s; %s): gpud waits %s s "
                "more for it, then stops",
                self.path,
                err,
                _HOLDER,
                f"{left:.1f}",
            )
            self._wait_until(conn, deadline)
            return conn.execute(statement).fetchall()

    def _wait_until(self, conn: sqlite3.Connection, until: float) -> None:
        """Let ``conn``'s next statements wait for another process's lock until ``until``
        (the store's clock) at most: SQLite's busy timeout, which counts per statement."""
        left_ms = max(0, round((until - self._clock()) * 1000))
        conn.execute(f"PRAGMA busy_timeout = {left_ms}")
        # the read-only check's connection runs before the writer's is opened
        if conn is getattr(self, "_conn", None):
            self._busy_ms = left_ms

    def _set_busy_timeout(self, ms: int) -> None:
        """The writer's connection's busy timeout (SQLite's wait for another process's lock
        on the file), set only when it changes: each transaction asks for one."""
        if ms != self._busy_ms:
            self._conn.execute(f"PRAGMA busy_timeout = {ms}")
            self._busy_ms = ms

    def ensure_schema(
        self, statements: Sequence[str], *, added: Mapping[str, Sequence[str]] | None = None
    ) -> None:
        """Run ``CREATE ... IF NOT EXISTS`` statements in one transaction.

        ``IF NOT EXISTS`` keeps a table of another layout (a database of an other gpud
        version, or edited by hand), whose reads and writes would then fail one by one at
        run time: a table that lacks a declared column raises :class:`StateError` instead.
        ``added``: table -> columns a later version declared (nullable): a table of an
        earlier version gets them (``ALTER TABLE ... ADD COLUMN``, NULL in its rows), so its
        rows are kept; a column a table has beyond the declared ones is left alone."""
        tables = _declared(statements)
        adding = {(t, c): _addable(tables, t, c) for t, cs in (added or {}).items() for c in cs}
        with self.transaction() as conn:
            for statement in statements:
                conn.execute(statement)
            for name, columns in sorted(tables.items()):
                have = {str(row[1]) for row in conn.execute(f'PRAGMA table_info("{name}")')}
                missing = sorted(columns.keys() - have)
                for column in [c for c in missing if (name, c) in adding]:
                    conn.execute(f'ALTER TABLE "{name}" ADD COLUMN {adding[(name, column)]}')
                if missing := [c for c in missing if (name, c) not in adding]:
                    raise StateDamaged(
                        _unreadable(
                            self.path,
                            f"table {name} has no column {', '.join(missing)}: "
                            "written by another gpud version?",
                        )
                    )

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Within, this thread's transactions are one read-only snapshot on a connection of
        their own (WAL: a reader never waits for the writer, nor the writer for it), so a
        read on the event loop never waits on another thread's commit. Serialised among
        readers; a write attempted within fails (``PRAGMA query_only``).

        The reader holds the files the store opened (the database and its WAL, from the
        start), so after either was removed or replaced it still reads what was committed,
        whole: reads go on until the restart, while changes are refused. A read never checks
        the files nor saves what a removed WAL holds (that takes the writer's lock and an
        fsync): the daemon's loop does, with :meth:`check_files`."""
        if getattr(self._reading, "conn", None) is not None:
            yield  # already reading on this thread: the same snapshot
            return
        with self._reader_lock:
            self._reading.conn = self._reader
            self._reader.execute("BEGIN")  # deferred: the snapshot is taken at the first read
            try:
                yield
            finally:
                self._reading.conn = None
                self._reader.execute("COMMIT")

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """A read of what is committed that takes no write lock: within this thread's
        transaction (:meth:`transaction` or :meth:`reading`), that transaction's connection,
        so it sees the thread's own changes; else a snapshot of its own (:meth:`reading`).
        So it never waits for another process's write lock (WAL), is never refused as a
        change, and sets no :meth:`write_problem`; one the disk fails (an I/O error)
        raises :class:`StateUnwritable` naming the file, as a read."""
        if self.in_transaction():
            with self.transaction() as conn:
                yield conn
            return
        try:
            with self.reading(), self.transaction() as conn:
                yield conn
        except sqlite3.OperationalError as err:
            if err.sqlite_errorcode & 0xFF not in _UNWRITABLE | {_BUSY}:
                raise
            raise StateUnwritable(
                f"state database {self.path} cannot be read ({err}); nothing was changed"
            ) from err

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT`` (or ``ROLLBACK`` on error); re-entrant per thread.

        A database that cannot be written (disk full, an I/O error, a read-only file) raises
        :class:`StateUnwritable` naming the file: nothing of the transaction is kept. One
        whose lock another process holds (SQLITE_BUSY) past ``write_wait_s`` raises
        :class:`StateInUse`, naming the file and the likely holder (that wait counts from
        the call, the wait behind this process's other transactions included, but for at
        least half a second for the lock itself; once one was so refused, each later one
        waits ``in_use_wait_s`` for it, until one commits); until :meth:`start_done`, past what is
        left of the open's ``busy_timeout_s``, saying to start gpud again. SQLITE_LOCKED, a
        conflict within this connection, raises as it is."""
        reader = getattr(self._reading, "conn", None)
        if reader is not None:
            yield reader
            return
        asked = self._clock()
        with self._lock:
            if self._conn.in_transaction:
                yield self._conn
                return
            self._write_begun = began = self._clock()
            # the wait for another process's lock counts the wait behind this process's
            # writers (one of them may have waited for it already): a call queued behind
            # another still answers within write_wait_s of its own, or soon after, as
            # each waits a little for the lock however long it queued
            lock_wait_s = max(
                asked + self._write_wait_s - began, min(_LOCK_WAIT_FLOOR_S, self._write_wait_s)
            )
            starting = self._starting
            kept = self._refused
            if kept is not None and kept[2] and starting is None:
                # the lock is known held: the first refusal waited for it in full; the
                # rest only look whether it was let go, until one commits
                lock_wait_s = min(lock_wait_s, self._in_use_wait_s)
            try:
                if starting is not None and starting[0] - began > lock_wait_s:
                    self._open_step(self._conn, "BEGIN IMMEDIATE", *starting)
                else:
                    self._set_busy_timeout(round(lock_wait_s * 1000))
                    self._conn.execute("BEGIN IMMEDIATE")
                self._writer = threading.get_ident()
                try:
                    changes = self._conn.total_changes
                    yield self._conn
                    changed = self._conn.total_changes != changes
                    if changed and not self._files_kept():
                        self._conn.execute("ROLLBACK")
                        self._refuse_replaced()
                    self._conn.execute("COMMIT")
                    # only a change written shows the disk takes writes again; any lock
                    # taken, that another process's lock was let go
                    kept = self._refused
                    if changed or (kept is not None and kept[2]):
                        self._refused = None
                except BaseException:
                    # SQLite may already have rolled back (a failed COMMIT on a full disk):
                    # never leave a transaction open for the next caller to nest in.
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")
                    raise
                finally:
                    self._writer = None
            except sqlite3.OperationalError as err:
                refused = self._refusal(err, queued_s=began - asked, lock_wait_s=lock_wait_s)
                if refused is None:
                    raise
                raise refused from err
            finally:
                self._write_begun = None

    def _refusal(
        self, err: sqlite3.OperationalError, *, queued_s: float, lock_wait_s: float
    ) -> StateUnwritable | None:
        """Under the writer's lock: the error a transaction that failed with ``err`` raises,
        kept as the write problem, when the file or another process's lock, not the SQL, is
        the cause; None otherwise. ``queued_s``: how long it waited behind gpud's own
        writers; ``lock_wait_s``: then for another process's lock."""
        code = err.sqlite_errorcode & 0xFF
        if code == _BUSY:
            why = f"in use by another process ({err}; {_HOLDER})"
            self._refuse(why, in_use=True)
            if self._starting is not None:
                return StateInUse(_in_use_at_start(self.path, err))
            waited = f"{round(lock_wait_s, 2):g} s for its lock"
            if round(queued_s, 1) > 0:  # a queue of note, not the microseconds of any call
                waited = f"{queued_s:.1f} s queued behind its own writes, then {waited}"
            return StateInUse(
                f"state database {self.path} is {why}: gpud waited {waited}; nothing of this "
                "change was kept: stop that process, then retry"
            )
        if code not in _UNWRITABLE:
            return None
        self._refuse(str(err), in_use=False)
        return StateUnwritable(
            f"state database {self.path} cannot be written ({err}): nothing of this change "
            "was kept; free space or fix the file, then retry"
        )

    def _refuse(self, why: str, *, in_use: bool) -> None:
        """Keep ``why`` as the write problem, since the first refusal for it: a problem that
        lasts (a disk full for hours) keeps the time it began, whatever refused since."""
        kept = self._refused
        since = kept[1] if kept is not None and kept[0] == why else self._clock()
        self._refused = (why, since, in_use)

    def write_began(self) -> float | None:
        """When the transaction under way began (the store's clock; its wait for another
        process's lock included), None while none runs: one stuck in its commit's fsync on
        a hung disk fails nothing, it only runs on. Read without a lock (``gpuctl status``
        never waits for a writer)."""
        return self._write_begun

    def in_transaction(self) -> bool:
        """Whether this thread has a transaction open (:meth:`transaction` or
        :meth:`reading`): one it begins now is part of it, committed only when it ends."""
        return (
            getattr(self._reading, "conn", None) is not None
            or self._writer == threading.get_ident()
        )

    def _files_kept(self) -> bool:
        """Whether the database and its WAL are still the files the connection has open.
        SQLite goes on writing to a file removed under it, so a change would be lost at the
        next start (one in a removed WAL, and all that WAL holds, at a crash)."""
        return _file_id(self.path) == self._file and _file_id(self._wal_path) == self._wal

    def check_files(self) -> str | None:
        """Whether the database and its WAL are still the files the store has open (two
        ``stat`` calls: the daemon's loop calls it each pass). Once either is found removed
        or replaced, what the WAL holds is checkpointed into the database file (under the
        writer's lock and the reader's), so that a crash before the restart keeps it; a
        checkpoint that could not copy it all (another process reading an older snapshot)
        is tried again at each call until it does. The first call that finds the files gone
        returns what the operator is to know: which file, what was done, "restart gpud".
        None otherwise, and after."""
        if self._said and self._saved is not None:
            return None
        if self._files_kept():
            return None
        what, kept = self._save_once()
        with self._lock:
            if self._said:
                return None
            self._said = True
        return f"{what} while gpud ran: gpud refuses every change from now on; {kept}"

    def refuses_until_restart(self) -> bool:
        """Whether the database file or its WAL was found removed or replaced while gpud
        ran (SQLite still writes to the unlinked inode): every change is refused from then
        on, and none is written again before gpud restarts."""
        return self._gone is not None

    def write_problem(self) -> tuple[str, float] | None:
        """Why changes to the database are not written, and since when (on the store's
        clock): what SQLite said of the latest refused one (``database or disk is full``,
        ``attempt to write a readonly database``, ``disk I/O error``), another process's
        lock on it, or, from when it was found, the file or its WAL removed or replaced
        while gpud ran (then every change is refused until the restart; the file itself is
        not named again). None when the latest change was written, or none was refused
        since start. A refusal holds until a change is written again (a full disk says
        nothing when it is freed: the next change tells; another process's lock, until a
        transaction takes the lock). Read without a lock (``gpuctl status`` never waits
        for a writer): each is one attribute, set whole."""
        refused = self._refused
        return self._gone or (refused[:2] if refused is not None else None)

    def _save_once(self) -> tuple[str, str]:
        """:meth:`_save_replaced` for files found not kept, until it is done for good (the
        database gone, or all the WAL held copied into it); what it said then, after."""
        with self._lock:
            if self._saved is not None:
                return self._saved
            what, kept, done = self._save_replaced()
            # the first finding's time: changes are refused from then on, asked or not
            since = self._clock() if self._gone is None else self._gone[1]
            # what gpuctl status says after the file's path: not the path again
            short = (
                "removed or replaced"
                if what.startswith("state database ")
                else f"its write-ahead log {self._wal_path.name} was removed or replaced"
            )
            self._gone = (f"{short} while gpud ran; {kept}", since)
            if done:
                self._saved = (what, kept)
                if self._said:  # it went out saying "may be lost": this one it did not say
                    log.warning("state database %s: %s", self.path, kept)
            return what, kept

    def _refuse_replaced(self) -> NoReturn:
        """Raise :class:`StateUnwritable` for a database or WAL not :meth:`_files_kept`
        (outside a transaction: what the WAL holds is checkpointed first). Reads still hold."""
        what, kept = self._save_once()
        raise StateUnwritable(f"{what} while gpud ran: nothing of this change was kept; {kept}")

    def _save_replaced(self) -> tuple[str, str, bool]:
        """Under the writer's lock, for files not :meth:`_files_kept`: the checkpoint of what
        the removed WAL holds, and what to say: the file gone, then what became of what was
        committed and what to do; and whether that is final (the database gone, or the
        checkpoint complete)."""
        if _file_id(self.path) != self._file:
            return (
                f"state database {self.path} was removed or replaced",
                "restart gpud (on the database restored from a backup, or on none to start afresh)",
                True,
            )
        # what was committed lives on in the removed WAL, which SQLite still has open: a
        # checkpoint copies it into the database file, so a crash before the restart keeps
        # it. A read in progress first: a snapshot open there, older than the last commit,
        # makes SQLite copy only the frames it can see, leaving a database file that is not
        # whole without the WAL. Not held for the checkpoint (its write and fsync): under the
        # writer's lock no commit lands, so a read begun now sees the last commit and does
        # not limit the copy, and reads never wait behind it. A thread that reads now cannot
        # wait for its own read: tried again later.
        kept = False
        if getattr(self._reading, "conn", None) is None:
            with self._reader_lock:
                pass
            try:
                _, logged, copied = self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                kept = logged == copied
            except sqlite3.Error:
                kept = False
        return (
            f"write-ahead log {self._wal_path} of the state database was removed or replaced",
            (
                "what was committed before is kept in the database file"
                if kept
                else "what was committed before may be lost unless gpud stops cleanly"
            )
            + "; restart gpud",
            kept,
        )

    def close(self, wait_s: float | None = None) -> None:
        """Close the connections, once no transaction runs; with ``wait_s``, not waiting
        longer than that in all for one running on another thread (a daemon stop that gave up
        a loop pass, a read still under way): its connection is left open then, saying so
        once, and the transaction goes whole or not at all. Nothing committed is lost either
        way (``synchronous=FULL``: it is in the WAL, which the next open reads); a close left
        undone skips only SQLite's checkpoint."""
        deadline = None if wait_s is None else time.monotonic() + max(0.0, wait_s)

        def left() -> float:
            return -1.0 if deadline is None else max(0.0, deadline - time.monotonic())

        if not self._lock.acquire(timeout=left()):
            log.warning(
                "state database %s: a transaction still ran at the stop; left to the exit",
                self.path,
            )
            return
        try:
            self._conn.close()
        finally:
            self._lock.release()
        if not self._reader_lock.acquire(timeout=left()):
            log.warning(
                "state database %s: a read still ran at the stop; its connection is left to"
                " the exit",
                self.path,
            )
            return
        try:
            self._reader.close()
        finally:
            self._reader_lock.release()
