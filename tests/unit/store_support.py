"""The state database for tests: one that counts what a step costs in it, and another
process holding its lock."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from gpud.store import StateStore


class CountingStore(StateStore):
    """The state database, counting the transactions opened (``transactions``)."""

    transactions = 0

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        self.transactions += 1
        with super().transaction() as conn:
            yield conn


def lock_waits(store: StateStore) -> list[int]:
    """The busy timeouts (ms) the store's writer begins its transactions with from now on,
    one for each: its wait for another process's lock (counted, not timed). The writer sets
    the timeout only when it changes: the one in effect at each ``BEGIN`` is taken."""
    waits: list[int] = []
    (now,) = store._conn.execute("PRAGMA busy_timeout").fetchone()
    current = [int(now)]

    def heard(statement: str) -> None:
        if statement.startswith("PRAGMA busy_timeout = "):
            current[0] = int(statement.rsplit(" ", 1)[1])
        elif statement == "BEGIN IMMEDIATE":
            waits.append(current[0])

    store._conn.set_trace_callback(heard)
    return waits


@contextlib.contextmanager
def held_write_lock(path: Path) -> Iterator[sqlite3.Connection]:
    """Another process's write in progress on the database ``path`` (a sqlite3 shell's
    ``BEGIN IMMEDIATE``): gpud's writes wait for it, its reads do not (WAL). Let go at the
    end, or earlier by closing the connection (from any thread: gpud's writes wait on
    worker threads)."""
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    try:
        yield holder
    finally:
        holder.close()  # a transaction still open is rolled back


class LetGoWhenSaid(logging.Handler):
    """Ends the lock's holder when the store says it waits for it: the shell closed."""

    def __init__(self, holder: sqlite3.Connection) -> None:
        super().__init__(logging.WARNING)
        self.holder = holder
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())
        self.holder.close()  # in exclusive locking mode, only a close lets go

    @contextlib.contextmanager
    def listening(self) -> Iterator[LetGoWhenSaid]:
        """Within, it hears what ``gpud.store`` warns."""
        logging.getLogger("gpud.store").addHandler(self)
        try:
            yield self
        finally:
            logging.getLogger("gpud.store").removeHandler(self)
