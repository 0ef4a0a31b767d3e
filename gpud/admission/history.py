"""The job history as the quotes read it: each row decoded once, kept in memory, and brought
up to date from the database by what changed since (rows added, runs that ended, rows
pruned), not read again whole each time a quote is asked."""

from __future__ import annotations

import bisect
import sqlite3
from collections.abc import Callable, Iterator
from itertools import islice

from gpud.admission.estimate import Record
from gpud.admission.model import Request

COLUMNS = (
    "id, job, request_class, request, queued_at, started_at, ended_at, quote_s,"
    " exit_code, exit_signal, end_cause, reported_at, reservation"
)
CHUNK = 500  # row ids asked at once (SQLite's bound parameters)
LOG_KEEP = 10_000  # changes kept for changes_since: past them, the rows are read again
PRUNE_PROBE = 64  # ended rows looked up at once for whether the bound pruned them


class HistoryMirror:
    """``job_history``'s rows as :class:`Record` and request, oldest first. Rows change
    after they are added only while they may still end (or, for a run removed while it
    ran, end again when its ``gpuctl run`` reports): those are read again at each
    :meth:`refresh`, with the rows added since; rows pruned leave (the ended ones past the
    bound, oldest first, from among those that may still change, which stay). Where any of that
    changed, a count that then disagrees with the table's reads it all again."""

    def __init__(self, decode: Callable[[str], Request], *, removed: str) -> None:
        self._decode = decode
        self._removed = removed  # the end cause of a run removed while it ran
        self._rows: dict[int, tuple[Record, Request]] = {}  # by row id, ascending
        self._open: set[int] = set()  # rows that may still change
        self._last_id = 0
        # each request and class key kept once; what no kept row holds any more is dropped
        # (_trim_interned), so that a node's distinct requests over months (a sweep over
        # --memory sizes) stay as many as the rows admission.history_keep keeps
        self._interned: dict[Request, Request] = {}
        self._classes: dict[str, str] = {}
        # queued_at of every row, sorted: made at the first :meth:`members` after the table
        # was read whole, then kept as rows are added, changed and pruned
        self._queued: list[float] | None = None
        self._running: dict[int, tuple[str, str]] = {}  # (reservation, class) of open rows
        self.version = 0  # moves on whenever a row is added, changed or removed
        self.reads = 0  # rows read from the database so far
        # the rows added, changed and pruned since version ``_log_base``: (the version that
        # holds it, the record it replaced or None, the record or None (pruned), request)
        # (the first read, and a read of the whole table again, are not logged: nobody asks
        # for the changes from before them)
        self._log: list[tuple[int, Record | None, Record | None, Request]] = []
        self._log_base = 1

    def refresh(self, conn: sqlite3.Connection) -> None:
        # MIN(id) costs a lookup, COUNT(*) a scan of the table: counted only once
        # something changed (rows leave the table only when pruned: the ended ones, oldest
        # first, and the rows before the first left)
        (low,) = conn.execute("SELECT MIN(id) FROM job_history").fetchone()
        changed = self.version == 0
        if len(self._log) > LOG_KEEP:
            self._forget(self.version)  # who asks from before this version reads all again
        while self._rows:
            first = next(iter(self._rows))
            if low is not None and first >= low:
                break
            self._pruned(first)
            changed = True
        # runs still running are kept past the bound (they have yet to end there): the
        # ended rows before them are pruned, oldest first, and leave from among them
        changed = self._pop_ended_pruned(conn) or changed
        still = sorted(self._open)  # before the rows added since, read whole below
        read = self.reads
        for row in conn.execute(  # row by row: the first holds every run
            f"SELECT {COLUMNS} FROM job_history WHERE id > ? ORDER BY id", (self._last_id,)
        ):
            self._keep(row, log=self.version > 0)
        changed = changed or self.reads > read
        for i in range(0, len(still), CHUNK):
            ids = still[i : i + CHUNK]
            rows = conn.execute(
                f"SELECT {COLUMNS} FROM job_history WHERE id IN ({', '.join('?' * len(ids))})",
                ids,
            ).fetchall()
            # an open row gone ended and was pruned since (the bound prunes a run past it
            # once it ended): it leaves as any pruned row, not with the whole table read
            # again; rows deleted otherwise than gpud deletes them still show in the count
            gone = set(ids).difference(row[0] for row in rows)
            for row_id in sorted(gone):
                self._pruned(row_id)
                changed = True
            for row in rows:
                record, _ = self._rows[row[0]]
                if row[6] != record.ended_at:
                    changed = True
                self._keep(row)
        if not changed:
            return
        self._trim_interned()
        (count,) = conn.execute("SELECT COUNT(*) FROM job_history").fetchone()
        if len(self._rows) != count:  # changed otherwise than gpud changes it
            self._forget(self.version + 1)
            self._rows.clear()
            self._open.clear()
            self._running.clear()
            self._queued = None
            self._last_id = 0
            for row in conn.execute(f"SELECT {COLUMNS} FROM job_history ORDER BY id"):
                self._keep(row, log=False)
        self.version += 1

    def _pruned(self, row_id: int) -> None:
        """Row ``row_id`` left the table: it leaves the kept rows, and the log says so."""
        record, request = self._rows.pop(row_id)
        self._unqueue(record.queued_at)
        self._open.discard(row_id)
        self._running.pop(row_id, None)
        self._log.append((self.version + 1, record, None, request))

    def _pop_ended_pruned(self, conn: sqlite3.Connection) -> bool:
        """Take out the ended rows pruned from among the rows still running: the ended rows
        kept here, oldest first, up to the first the table still has (the pruned ones come
        first: the bound prunes ended rows in row order). Whether any left."""
        popped = False
        while True:
            ids = list(islice((i for i in self._rows if i not in self._open), PRUNE_PROBE))
            if not ids:
                return popped
            marks = ", ".join("?" * len(ids))
            there = {
                row[0]
                for row in conn.execute(f"SELECT id FROM job_history WHERE id IN ({marks})", ids)
            }
            for row_id in ids:
                if row_id in there:
                    return popped
                self._pruned(row_id)
                popped = True

    def _forget(self, base: int) -> None:
        """The table changed otherwise than gpud changes it (or the log grew long): who asks
        for the changes since a version before ``base`` reads the rows again
        (:meth:`changes_since`)."""
        self._log.clear()
        self._log_base = base

    def changes_since(
        self, version: int
    ) -> list[tuple[Record | None, Record | None, Request]] | None:
        """The rows added (``(None, record, request)``, in row order), changed in place
        (``(old, new, request)``: a run ended) and pruned (``(record, None, request)``, the
        oldest first) since ``version``, in the order they came; None where the table
        changed otherwise than gpud changes it (read whole again), or too long ago to say."""
        if version < self._log_base:
            return None
        return [(old, new, q) for v, old, new, q in self._log if v > version]

    def _keep(self, row: sqlite3.Row, *, log: bool = True) -> None:
        self.reads += 1
        (
            row_id,
            job,
            request_class,
            request,
            queued_at,
            started_at,
            ended_at,
            quote_s,
            exit_code,
            exit_signal,
            end_cause,
            reported_at,
            reservation,
        ) = tuple(row)
        kept = self._rows.get(row_id)
        if kept is not None:
            placement = kept[1]
        else:
            decoded = self._decode(request)
            placement = self._interned.setdefault(decoded, decoded)
        request_class = self._classes.setdefault(request_class, request_class)
        record = Record(job, request_class, queued_at, started_at, ended_at, quote_s)
        if kept is None or kept[0] != record:  # unchanged: the same record (the log says so)
            self._rows[row_id] = (record, placement)
            if kept is None or kept[0].queued_at != queued_at:  # a run that ended keeps it
                if kept is not None:
                    self._unqueue(kept[0].queued_at)
                if self._queued is not None:
                    bisect.insort(self._queued, queued_at)
            if log:
                self._log.append(
                    (self.version + 1, None if kept is None else kept[0], record, placement)
                )
        self._last_id = max(self._last_id, row_id)
        late_end = (
            end_cause == self._removed
            and reported_at is None
            and exit_code is None
            and exit_signal is None
        )
        if ended_at is None or late_end:
            self._open.add(row_id)
        else:
            self._open.discard(row_id)
        if ended_at is None:
            self._running[row_id] = (reservation, request_class)
        else:
            self._running.pop(row_id, None)

    def _trim_interned(self) -> None:
        """Drop the requests and class keys no kept row holds, once they outnumber the rows
        twice over (at most one pass over the rows per as many new keys as rows)."""
        most = 2 * len(self._rows) + PRUNE_PROBE
        if len(self._interned) > most or len(self._classes) > most:
            self._interned = {q: q for _, q in self._rows.values()}
            self._classes = {r.request_class: r.request_class for r, _ in self._rows.values()}

    def _unqueue(self, queued_at: float) -> None:
        """A row queued at ``queued_at`` leaves :meth:`members`' sorted times."""
        if self._queued is not None:
            del self._queued[bisect.bisect_left(self._queued, queued_at)]

    def running(self) -> dict[str, str]:
        """The request class of each run that has not ended, by its reservation."""
        return dict(self._running.values())

    def members(self, since: float, now: float) -> tuple[int, int, int]:
        """Which rows a window ``[since, now]`` holds, as a key: the same key, the same rows
        (those queued before ``since`` and those after ``now``, counted)."""
        if self._queued is None:
            self._queued = sorted(record.queued_at for record, _ in self._rows.values())
        return (
            self.version,
            bisect.bisect_left(self._queued, since),
            bisect.bisect_right(self._queued, now),
        )

    def since(self, since: float) -> Iterator[tuple[Record, Request]]:
        """The rows queued at ``since`` or later, oldest first."""
        return ((r, q) for r, q in self._rows.values() if r.queued_at >= since)

    def __len__(self) -> int:
        return len(self._rows)
