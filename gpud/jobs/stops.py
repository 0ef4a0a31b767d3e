"""The ``job_run_stops`` table: runs whose reservation is gone while their processes may
still run, and when what is left of them gets SIGKILL (``gpud.jobs.leftovers``).

A row is written in the transaction that releases the reservation, so the kill it promises
outlives a gpud that crashes or restarts in between: a run whose ``gpuctl run`` died is due
at once, a run of a job removed with ``--force`` a grace period after its SIGTERM. The tick
kills what is due and drops the row.

The stored time is the wall clock's, which steps (NTP, a resumed VM). A stop scheduled by
this process is therefore due by the monotonic clock, its deadline kept in memory; the
stored time only serves a stop an earlier gpud scheduled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from gpud.store import StateStore

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS job_run_stops (
        run TEXT PRIMARY KEY,
        job TEXT NOT NULL,
        reason TEXT NOT NULL,
        kill_at REAL NOT NULL
    )""",
)


class StopReason(StrEnum):
    HOLDER_GONE = "holder-gone"  # its gpuctl run died without releasing
    REMOVED = "removed"  # gpuctl jobs rm --force: SIGTERM was sent, SIGKILL follows


@dataclass(frozen=True, slots=True)
class RunStop:
    run: str  # the reservation id, GPUD_RUN of its processes
    job: str
    reason: StopReason
    kill_at: float  # the clock of the service (wall time), for a gpud started after this one
    # the PID of its gpuctl run, while this gpud knows it (not stored): finds the processes
    # of a run an older gpuctl run started (gpud.jobs.leftovers)
    holder: int | None = None


class RunStops:
    """Pending SIGKILLs of released runs, kept in the state store."""

    def __init__(
        self,
        store: StateStore,
        *,
        longest_wait_s: float,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        # a kill further away than this was scheduled before the clock went back
        self._longest_wait_s = longest_wait_s
        self._monotonic = monotonic
        # run -> when its kill is due (monotonic), of the stops this process scheduled
        self._deadlines: dict[str, float] = {}
        self._holders: dict[str, int] = {}  # run -> RunStop.holder, of the stops scheduled here
        store.ensure_schema(SCHEMA)

    def schedule(self, stop: RunStop, *, wait_s: float = 0.0) -> None:
        """Record ``stop`` (in the caller's transaction, if one is open), due ``wait_s``
        from now by this process's monotonic clock and at ``stop.kill_at`` after a
        restart."""
        self._deadlines[stop.run] = self._monotonic() + wait_s
        if stop.holder:
            self._holders[stop.run] = stop.holder
        with self._store.transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO job_run_stops (run, job, reason, kill_at)"
                " VALUES (?, ?, ?, ?)",
                (stop.run, stop.job, stop.reason.value, stop.kill_at),
            )

    def due(self, now: float) -> list[RunStop]:
        """Stops whose time has come, oldest first. ``now``: the wall clock, for the stops
        an earlier gpud scheduled (one further away than the longest wait was scheduled
        before the clock went back: due at once)."""
        mono = self._monotonic()
        with self._store.transaction() as conn:
            rows = conn.execute(
                "SELECT run, job, reason, kill_at FROM job_run_stops ORDER BY kill_at"
            ).fetchall()
        stops = [
            RunStop(
                r["run"], r["job"], _reason(r["reason"]), r["kill_at"], self._holders.get(r["run"])
            )
            for r in rows
        ]
        return [s for s in stops if self._is_due(s, now, mono)]

    def _is_due(self, stop: RunStop, now: float, mono: float) -> bool:
        deadline = self._deadlines.get(stop.run)
        if deadline is not None:
            return mono >= deadline
        return stop.kill_at <= now or stop.kill_at > now + self._longest_wait_s

    def done(self, run: str) -> None:
        self._deadlines.pop(run, None)
        self._holders.pop(run, None)
        with self._store.transaction() as conn:
            conn.execute("DELETE FROM job_run_stops WHERE run = ?", (run,))


def _reason(text: str) -> StopReason:
    try:
        return StopReason(text)
    except ValueError:
        return StopReason.HOLDER_GONE  # a row of a newer gpud: kill as if its holder died
