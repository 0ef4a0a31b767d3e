"""The state database for tests that count what a step costs in it."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator

from gpud.store import StateStore


class CountingStore(StateStore):
    """The state database, counting the transactions opened (``transactions``)."""

    transactions = 0

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        self.transactions += 1
        with super().transaction() as conn:
            yield conn
