"""Jobs' DSCP tags and level pins, persisted with the jobs in ``state.db`` (table ``net_tags``).

A registered job gets its tag the first time anyone asks (``gpuctl run``, the admission
queue, ``gpuctl net pin``, or the daemon's traffic step; never ``gpuctl env``, which only
shows the one held) and keeps it until the job is removed from the registry; a
restart of gpud hands out the same tags (:class:`netshaper.tags.TagAllocator` is seeded
with the stored ones). A tag set by the cluster leader replaces the local one.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping

from gpud.errors import DscpPoolExhausted, FailedPrecondition, InvalidArgument
from gpud.shared import shown
from gpud.store import StateStore
from netshaper.tags import DSCP_MAX, TagAllocator, TagsExhausted

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS net_tags (
        job TEXT PRIMARY KEY,
        dscp INTEGER NOT NULL UNIQUE,
        pinned_level INTEGER
    )""",
)


def parse_pool(spec: str, reserved: Iterable[int]) -> frozenset[int]:
    """The codepoints ``spec`` names ("10-30,34"; "" = all 64), less ``reserved``."""
    chosen = _named(spec) if spec.strip() else set(range(DSCP_MAX + 1))
    pool = frozenset(chosen - set(reserved))
    if not pool:
        raise ValueError(f"{shown_pool(spec)} leaves no DSCP tag to hand out")
    return pool


def reserved_in_pool(spec: str, reserved: Iterable[int]) -> list[int]:
    """The codepoints ``spec`` names outright that ``reserved`` takes out of the pool, low
    to high ("" names none: it means every DSCP but the reserved ones)."""
    return sorted(_named(spec) & set(reserved))


def has_empty_item(spec: str) -> bool:
    """Whether ``spec`` names a pool with an empty item ("10-30,", "10,,34"): skipped, as
    gpud always has, but a DSCP left out most likely, worth a warning."""
    return bool(spec.strip()) and any(not part.strip() for part in spec.split(","))


SHOWN_POOL_CHARS = 80  # of a spec repeated in a message: a huge one would bury the reason


def shown_pool(spec: str) -> str:
    """``spec`` quoted as a message repeats it, cut past :data:`SHOWN_POOL_CHARS`."""
    return shown(spec, SHOWN_POOL_CHARS)


# one item of a pool: a DSCP or a range of them, in ASCII digits; spaces around an item or
# its "-" are harmless ("10, 12 - 14"), but not what int() would also take ("1_0", "+10");
# up to 4 digits, so that a huge number is "not a DSCP" rather than past int()'s digit limit
_ITEM = re.compile(r"\s*([0-9]{1,4})\s*(?:-\s*([0-9]{1,4})\s*)?")


def _named(spec: str) -> set[int]:
    chosen: set[int] = set()
    for part in spec.split(","):
        if not part.strip():  # "10,,34" or "10-30,": skipped (has_empty_item warns of it)
            continue
        match = _ITEM.fullmatch(part)
        if match is None:
            raise ValueError(f"{shown_pool(part.strip())} is not a DSCP or a range like 10-30")
        first = int(match[1])
        last = int(match[2]) if match[2] is not None else first
        if not 0 <= first <= last <= DSCP_MAX:
            raise ValueError(
                f"{shown_pool(part.strip())}: DSCP values are 0..{DSCP_MAX}, low to high"
            )
        chosen.update(range(first, last + 1))
    return chosen


def _spent(job: str, pool_size: int) -> DscpPoolExhausted:
    return DscpPoolExhausted(f"all {pool_size} DSCP tags of traffic.dscp_pool are in use", job=job)


class TagStore:
    """Thread-safe: the API threads (``gpuctl run``) and the tick share it."""

    def __init__(self, store: StateStore, *, pool: frozenset[int]) -> None:
        self._store = store
        self._lock = threading.Lock()
        store.ensure_schema(SCHEMA)
        with store.transaction() as conn:
            rows = conn.execute("SELECT job, dscp, pinned_level FROM net_tags").fetchall()
        existing = {r["job"]: r["dscp"] for r in rows if r["dscp"] in pool}
        # A tag outside a narrowed pool is re-issued from the new pool on next use.
        stale = [r["job"] for r in rows if r["dscp"] not in pool]
        self._pins: dict[str, int] = {
            r["job"]: r["pinned_level"] for r in rows if r["pinned_level"] is not None
        }
        reserved = [d for d in range(DSCP_MAX + 1) if d not in pool]
        self._alloc = TagAllocator(reserved=reserved, existing=existing)
        if stale:
            with store.transaction() as conn:
                conn.executemany("DELETE FROM net_tags WHERE job = ?", [(j,) for j in stale])

    @property
    def pool(self) -> tuple[int, ...]:
        return self._alloc.pool

    def tag(self, job: str) -> int:
        """The job's tag, allocated and persisted on first use."""
        known = self.get(job)
        if known is not None:
            return known
        if self.full():  # no transaction for nothing: a daemon tick asks for each job
            raise _spent(job, len(self.pool))
        # the store's lock first, as callers inside a transaction (the admission queue's
        # start) take them
        allocated = False
        try:
            with self._store.transaction() as conn, self._lock:
                known = self._alloc.allocations().get(job)
                if known is not None:
                    return known
                try:
                    dscp = self._alloc.tag(job)
                except TagsExhausted as err:  # the last went since the check above
                    raise _spent(job, err.pool_size) from err
                allocated = True
                conn.execute(
                    "INSERT OR REPLACE INTO net_tags (job, dscp, pinned_level) VALUES (?, ?, ?)",
                    (job, dscp, self._pins.get(job)),
                )
        except BaseException:
            if allocated:  # not kept (a failed write or commit): nor handed out
                with self._lock:
                    self._alloc.release(job)
            raise
        return dscp

    def get(self, job: str) -> int | None:
        with self._lock:
            return self._alloc.allocations().get(job)

    def set_tags(self, tags: Mapping[str, int]) -> list[str]:
        """Adopt tags decided elsewhere (the cluster leader); returns the jobs whose tag
        changed. The leader's tags win: a job it did not tag (one idle here, which the node
        does not report) that holds a DSCP it gives to another job gives that DSCP up, and
        is tagged again from the free ones when it needs a tag. All or nothing: a tag
        outside the pool, or one the leader gives two jobs, changes nothing."""
        with self._store.transaction() as conn, self._lock:
            current = self._alloc.allocations()
            pool = set(self._alloc.pool)
            owners: dict[int, str] = {}
            for job, dscp in tags.items():
                if dscp not in pool:
                    raise InvalidArgument(f"job {job!r}: DSCP {dscp} is not in the tag pool")
                if dscp in owners:
                    raise FailedPrecondition(
                        f"DSCP {dscp} would be held by both {owners[dscp]!r} and {job!r}"
                    )
                owners[dscp] = job
            displaced = [j for j, d in current.items() if j not in tags and d in owners]
            merged = {j: d for j, d in current.items() if j not in displaced} | dict(tags)
            changed = sorted(j for j, d in tags.items() if current.get(j) != d)
            if not changed:
                return []
            reserved = [d for d in range(DSCP_MAX + 1) if d not in pool]
            conn.executemany(
                "DELETE FROM net_tags WHERE job = ?", [(j,) for j in changed + displaced]
            )
            conn.executemany(
                "INSERT INTO net_tags (job, dscp, pinned_level) VALUES (?, ?, ?)",
                [(j, merged[j], self._pins.get(j)) for j in changed],
            )
            self._alloc = TagAllocator(reserved=reserved, existing=merged)
            return sorted(changed + displaced)

    def release(self, job: str) -> None:
        """Free the job's tag and pin (the job was removed)."""
        with self._store.transaction() as conn, self._lock:
            conn.execute("DELETE FROM net_tags WHERE job = ?", (job,))
            self._alloc.release(job)
            self._pins.pop(job, None)

    def allocations(self) -> dict[str, int]:
        with self._lock:
            return self._alloc.allocations()

    def full(self) -> bool:
        """Every tag of the pool is held (a new job gets one only by a hand-over)."""
        with self._lock:
            return len(self._alloc.allocations()) >= len(self._alloc.pool)

    def pins(self) -> dict[str, int]:
        with self._lock:
            return dict(self._pins)

    def pin(self, job: str, level: int | None) -> None:
        """Persist an operator's level pin (None: unpin). The job must hold a tag. The level
        is kept as set, even beyond a ``traffic.levels`` lowered later: the traffic service
        clamps it where it is used."""
        with self._store.transaction() as conn, self._lock:
            if job not in self._alloc.allocations():
                raise FailedPrecondition(f"job {job!r} has no tag yet")
            conn.execute("UPDATE net_tags SET pinned_level = ? WHERE job = ?", (level, job))
            if level is None:
                self._pins.pop(job, None)
            else:
                self._pins[job] = level
