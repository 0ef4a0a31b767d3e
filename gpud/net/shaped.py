"""The interfaces gpud has put its HTB root on, persisted in ``state.db`` (table
``net_shaped``), so that a start with an interface taken out of ``traffic.interfaces``
removes the tree an earlier run left there (``kill -9``, or ``traffic.shutdown =
"fail-static"``) instead of leaving stale priorities that nothing keeps any more.

Table ``net_original`` keeps the root qdisc each interface had before gpud first took it
(``tc qdisc show dev IF root``: kind and handle). A start that finds gpud's tree still in
place cannot see what was there before it, so it takes the recorded one; a start that finds
another root (gpud's tree was removed meanwhile, by hand or by a restore) records that
instead. ``traffic.shutdown = "restore"`` and an interface taken out of the config get the
recorded kind back (with its default parameters: its options are not kept).

The record keeps the netdev's ifindex too, and the netdev is told by its ifindex (a netdev
given the old ifindex explicitly, ``ip link add ... index N``, or moved in from another
namespace keeping it, is taken for the old one): a netdev deleted and created again under
the name (while gpud runs, or while it was stopped or could not see it) is another ifindex,
and the root recorded was the old netdev's. A start that finds gpud's tree on another
ifindex drops the record, and a restore does not put it on the new netdev, which keeps the
root the kernel gave it. A netdev renamed away and back keeps its ifindex, and its record.
A row of an older gpud has no ifindex (NULL): it is taken as it is, and given the netdev's
ifindex by the first start that finds gpud's tree there.
"""

from __future__ import annotations

import threading

from gpud.store import StateStore
from netshaper.tcplan import RootQdisc

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS net_shaped (iface TEXT PRIMARY KEY)",
    """CREATE TABLE IF NOT EXISTS net_original (
        iface TEXT PRIMARY KEY,
        kind TEXT NOT NULL,
        handle INTEGER NOT NULL,
        ifindex INTEGER
    )""",
)
ADDED = {"net_original": ("ifindex",)}  # NULL in an older gpud's rows: the netdev unknown


def ensure_schema(store: StateStore) -> None:
    """Make ``net_shaped`` and ``net_original``, or check those found as declared (an
    older gpud's ``net_original`` gets ``ifindex``): with traffic off too, so that
    :meth:`StateStore.mark_ours` stamps only a file whose tables were all checked."""
    store.ensure_schema(SCHEMA, added=ADDED)


class ShapedInterfaces:
    """Thread-safe; a name is written once, when it is first enforced."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        ensure_schema(store)
        with store.transaction() as conn:
            rows = conn.execute("SELECT iface FROM net_shaped").fetchall()
            originals = conn.execute(
                "SELECT iface, kind, handle, ifindex FROM net_original"
            ).fetchall()
        self._known = {str(r["iface"]) for r in rows}
        self._originals = {
            str(r["iface"]): (
                RootQdisc(str(r["kind"]), int(r["handle"])),
                None if r["ifindex"] is None else int(r["ifindex"]),
            )
            for r in originals
        }

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

    def original(self, iface: str) -> RootQdisc | None:
        """The root qdisc ``iface`` had before gpud took it; None when not recorded."""
        with self._lock:
            recorded = self._originals.get(iface)
        return None if recorded is None else recorded[0]

    def original_ifindex(self, iface: str) -> int | None:
        """The ifindex of the netdev whose root :meth:`original` is; None when not recorded
        (no record, or one an older gpud wrote)."""
        with self._lock:
            recorded = self._originals.get(iface)
        return None if recorded is None else recorded[1]

    def set_original(self, iface: str, root: RootQdisc, ifindex: int | None = None) -> None:
        """Record ``root`` as the one ``iface`` had before gpud, on the netdev of index
        ``ifindex`` (``ip link show``)."""
        recorded = (RootQdisc(root.kind, root.handle), ifindex)  # HTB's default: not restored
        with self._lock:
            if self._originals.get(iface) == recorded:
                return
            with self._store.transaction() as conn:
                conn.execute(
                    "INSERT OR REPLACE INTO net_original (iface, kind, handle, ifindex)"
                    " VALUES (?, ?, ?, ?)",
                    (iface, root.kind, root.handle, ifindex),
                )
            self._originals[iface] = recorded

    def forget_original(self, iface: str) -> None:
        """Forget the root ``iface`` had before gpud: the name is another netdev's now
        (deleted and created again), and the recorded root was the old netdev's."""
        with self._lock:
            if iface not in self._originals:
                return
            with self._store.transaction() as conn:
                conn.execute("DELETE FROM net_original WHERE iface = ?", (iface,))
            self._originals.pop(iface, None)

    def discard(self, iface: str) -> None:
        """Forget ``iface`` (gpud's tree is gone from it), its original root too."""
        with self._lock:
            if iface not in self._known and iface not in self._originals:
                return
            with self._store.transaction() as conn:
                conn.execute("DELETE FROM net_shaped WHERE iface = ?", (iface,))
                conn.execute("DELETE FROM net_original WHERE iface = ?", (iface,))
            self._known.discard(iface)
            self._originals.pop(iface, None)
