"""The interfaces gpud has put its HTB root on, persisted in ``state.db`` (table
``net_shaped``), so that a start with an interface taken out of ``traffic.interfaces``
removes the tree an earlier run left there (``kill -9``, or ``traffic.shutdown =
"fail-static"``) instead of leaving stale priorities that nothing keeps any more."""

from __future__ import annotations

import threading

from gpud.store import StateStore

SCHEMA = ("CREATE TABLE IF NOT EXISTS net_shaped (iface TEXT PRIMARY KEY)",)


class ShapedInterfaces:
    """Thread-safe; a name is written once, when it is first enforced."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        store.ensure_schema(SCHEMA)
        with store.transaction() as conn:
            rows = conn.execute("SELECT iface FROM net_shaped").fetchall()
        self._known = {str(r["iface"]) for r in rows}

    def all(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._known)

    def add(self, iface: str) -> None:
        with self._lock:
            if iface in self._known:
                return
            with self._store.transaction() as conn:
                conn.execute("INSERT OR IGNORE INTO net_shaped (iface) VALUES (?)", (iface,))
            self._known.add(iface)

    def discard(self, iface: str) -> None:
        with self._lock:
            if iface not in self._known:
                return
            with self._store.transaction() as conn:
                conn.execute("DELETE FROM net_shaped WHERE iface = ?", (iface,))
            self._known.discard(iface)
