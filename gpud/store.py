"""The daemon's persistent desired state: one SQLite database in the state directory.

``/var/lib/gpud/state.db`` by default, in WAL mode with ``synchronous=FULL``, so a committed
transaction survives a crash of the daemon or the host. Each feature owns its tables and
declares them with :meth:`StateStore.ensure_schema`; it reads and writes them through
:meth:`StateStore.transaction`.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

DB_NAME = "state.db"


class StateStore:
    """A thread-safe handle on ``<state_dir>/state.db``.

    One connection, serialised by a lock: the daemon's writes are small and rare, and one
    connection keeps every feature's view consistent.
    """

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / DB_NAME
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=30.0
        )
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")

    def ensure_schema(self, statements: Sequence[str]) -> None:
        """Run ``CREATE ... IF NOT EXISTS`` statements in one transaction."""
        with self.transaction() as conn:
            for statement in statements:
                conn.execute(statement)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT`` (or ``ROLLBACK`` on error); re-entrant per thread."""
        with self._lock:
            if self._conn.in_transaction:
                yield self._conn
                return
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._conn.close()
