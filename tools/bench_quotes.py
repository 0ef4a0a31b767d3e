"""What one admission quote costs over a long job history, in process.

::

    .venv/bin/python -m tools.bench_quotes [--history 0,10000,100000]

For each history size N: a state database whose ``job_history`` holds N runs
(:func:`tools.bench_queue.fill_history`: four request classes over the last 6.3 days, a few still running),
and the class models the quotes come from, made

- afresh, as each quote made them before they were kept (``full_views``): the SQL read,
  each row's request decoded from JSON, the records built, then the class statistics, the
  packing efficiency and the quotes (``class_views``), each timed;
- kept (:class:`~gpud.admission.history.HistoryMirror` and
  :class:`~gpud.admission.classes.ClassViews`): the first (every row read and decoded once),
  a later second with nothing changed (what a waiting ``gpuctl run`` costs each second), one
  after a run was added (the window's statistics made again from memory);
- after a run started and after it ended, side by side on the same history: the views made
  again from every run in the window (as gpud did) and changed in place
  (:meth:`~gpud.admission.classes.ClassViews.change`, as gpud does), checked equal;
- at steady state, a step where a run starts, one ends and the oldest leaves the window
  (runs leave it about as fast as they come), made again and changed in place, side by
  side, checked equal.

Each time is the median of ``--repeat``; the ratio is afresh over kept, later second.
A SIGTERM or SIGINT stops it: the table of the history sizes measured so far, "cut short
by SIGNAL after N of M history sizes", its databases removed, dying by it (128 + its number).
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from gpud.admission.classes import ClassViews, class_views
from gpud.admission.history import HistoryMirror
from gpud.admission.model import Request
from gpud.admission.node import synthetic
from gpud.admission.placement_fit import PlacementFit
from gpud.admission.service import (
    ADDED,
    SCHEMA,
    _history,
    request_of,
    run_request_from_json,
    run_request_to_json,
)
from gpud.jobs.ends import EndCause
from gpud.store import StateStore
from tools.bench_queue import CLASSES, fill_history
from tools.simdaemon import cut_short, exit_as, restores_signals, stopped_by_signal

WINDOW_S = 7 * 86400.0


def median_s(call: Callable[[], object], repeat: int) -> float:
    took = []
    for _ in range(repeat):
        began = time.perf_counter()
        call()
        took.append(time.perf_counter() - began)
    return statistics.median(took)


def measure(n: int, repeat: int) -> dict[str, float]:
    fit = PlacementFit(synthetic("H100-SXM5-80GB", 1))
    now = time.time()
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = StateStore(Path(tmp))
        store.ensure_schema(SCHEMA, added=ADDED)
        with store.transaction() as conn:
            fill_history(conn, n, now)
        since = now - WINDOW_S

        def read() -> list[sqlite3.Row]:
            with store.transaction() as conn:
                query = "SELECT * FROM job_history WHERE queued_at >= ? ORDER BY id DESC"
                return conn.execute(query, (since,)).fetchall()

        rows = read()
        texts = [r["request"] for r in rows]
        history = [_history(r) for r in reversed(rows)]
        records = [h.record() for h in history]
        requests = {h.request_class: request_of(h.request) for h in history}
        out["afresh: SQL read"] = median_s(read, repeat)
        out["afresh: JSON decode"] = median_s(
            lambda: [run_request_from_json(t) for t in texts], repeat
        )
        out["afresh: records built"] = (
            median_s(lambda: [h.record() for h in [_history(r) for r in rows]], repeat)
            - out["afresh: JSON decode"]
        )
        out["afresh: class_views"] = median_s(
            lambda: class_views(fit, requests, records, now=now, window_s=WINDOW_S), repeat
        )
        out["afresh: total"] = sum(v for k, v in out.items() if k.startswith("afresh"))

        mirror = HistoryMirror(
            lambda text: request_of(run_request_from_json(text)), removed=EndCause.REMOVED.value
        )
        kept: list[ClassViews] = []

        def first() -> None:
            with store.transaction() as conn:
                mirror.refresh(conn)
            kept.append(ClassViews([r for r, _ in mirror.since(since)], now=now, window_s=WINDOW_S))
            kept[-1].at(fit, requests, now=now)

        began = time.perf_counter()
        first()
        out["kept: first"] = time.perf_counter() - began
        later = [now]

        def second() -> None:
            later[0] += 1.0
            with store.transaction() as conn:
                mirror.refresh(conn)
            mirror.members(later[0] - WINDOW_S, later[0])
            kept[-1].at(fit, requests, now=later[0])

        out["kept: a later second"] = median_s(second, repeat)

        def rebuilt() -> None:
            kept.append(ClassViews([r for r, _ in mirror.since(since)], now=now, window_s=WINDOW_S))
            kept[-1].at(fit, requests, now=now)

        out["kept: a run added"] = median_s(rebuilt, repeat)
        out.update(start_and_end(store, mirror, fit, requests, now=now, repeat=repeat))
        out.update(steady_state(store, mirror, fit, requests, n=n, now=now, repeat=repeat))
        store.close()
    return out


def start_and_end(
    store: StateStore,
    mirror: HistoryMirror,
    fit: PlacementFit,
    requests: dict[str, Request],
    *,
    now: float,
    repeat: int,
) -> dict[str, float]:
    """A run starts, then ends, ``repeat`` times: what bringing the window's views up to date
    costs each time, made again from the window and changed in place (the mirror's own
    refresh, the same for both, left out)."""
    since = now - WINDOW_S
    views = ClassViews([r for r, _ in mirror.since(since)], now=now, window_s=WINDOW_S)
    views.at(fit, requests, now=now)
    took: dict[str, list[float]] = {}
    placed = replace(CLASSES[0][0], job="b")
    request_class, request = request_of(placed).describe(), run_request_to_json(placed)
    for i in range(repeat):
        at = now + 10.0 * (i + 1)
        for what in ("started", "ended"):
            version = mirror.version
            with store.transaction() as conn:
                if what == "started":
                    conn.execute(
                        "INSERT INTO job_history (job, reservation, request_class, request,"
                        " queued_at, started_at) VALUES (?, ?, ?, ?, ?, ?)",
                        (f"b{i}", f"bench{i}", request_class, request, at - 3.0, at),
                    )
                else:
                    conn.execute(
                        "UPDATE job_history SET ended_at = ?, end_cause = ?, exit_code = 0"
                        " WHERE reservation = ?",
                        (at + 5.0, EndCause.EXITED.value, f"bench{i}"),
                    )
                mirror.refresh(conn)
            at += 5.0
            changes = mirror.changes_since(version)
            assert changes is not None
            began = time.perf_counter()
            rebuilt = ClassViews([r for r, _ in mirror.since(since)], now=at, window_s=WINDOW_S)
            afresh = rebuilt.at(fit, requests, now=at)
            took.setdefault(f"a run {what}: made again", []).append(time.perf_counter() - began)
            began = time.perf_counter()
            assert views.change([(old, new) for old, new, _ in changes], now=at)
            changed = views.at(fit, requests, now=at)
            took.setdefault(f"a run {what}: changed", []).append(time.perf_counter() - began)
            assert changed == afresh
    return {name: statistics.median(values) for name, values in took.items()}


def steady_state(
    store: StateStore,
    mirror: HistoryMirror,
    fit: PlacementFit,
    requests: dict[str, Request],
    *,
    n: int,
    now: float,
    repeat: int,
) -> dict[str, float]:
    """A busy node at steady state, ``repeat`` steps: in each a run starts, the one started
    the step before ends, and the time has moved on past the oldest run's queued time (it
    leaves the window): what bringing the window's views up to date costs each step, made
    again from the window and changed in place (made again where that cannot be, as gpud
    does), checked equal. Run after :func:`start_and_end`, whose runs are in the window."""
    span = 0.9 * WINDOW_S
    placed = replace(CLASSES[1][0], job="s")
    request_class, request = request_of(placed).describe(), run_request_to_json(placed)

    def step(i: int) -> float:
        """Step ``i``: its time (run ``i`` of :func:`fill_history` has just left)."""
        at = now - span + span * (i + 0.5) / max(n, 1) + WINDOW_S
        with store.transaction() as conn:
            conn.execute(
                "INSERT INTO job_history (job, reservation, request_class, request,"
                " queued_at, started_at) VALUES (?, ?, ?, ?, ?, ?)",
                (f"s{i}", f"steady{i}", request_class, request, at - 3.0, at),
            )
            conn.execute(
                "UPDATE job_history SET ended_at = ?, end_cause = ?, exit_code = 0"
                " WHERE reservation = ?",
                (at - 1.0, EndCause.EXITED.value, f"steady{i - 1}"),
            )
            mirror.refresh(conn)
        return at

    at = step(-1)
    views = ClassViews([r for r, _ in mirror.since(at - WINDOW_S)], now=at, window_s=WINDOW_S)
    views.at(fit, requests, now=at)
    held = len(views)
    took: dict[str, list[float]] = {}
    for i in range(repeat):
        version = mirror.version
        at = step(i)
        since = at - WINDOW_S
        changes = mirror.changes_since(version)
        assert changes is not None
        began = time.perf_counter()
        rebuilt = ClassViews([r for r, _ in mirror.since(since)], now=at, window_s=WINDOW_S)
        afresh = rebuilt.at(fit, requests, now=at)
        took.setdefault("steady state: made again", []).append(time.perf_counter() - began)
        began = time.perf_counter()
        if not views.change([(old, new) for old, new, _ in changes], now=at):
            views = ClassViews([r for r, _ in mirror.since(since)], now=at, window_s=WINDOW_S)
        changed = views.at(fit, requests, now=at)
        took.setdefault("steady state: changed", []).append(time.perf_counter() - began)
        assert changed == afresh
        if n:  # one run came, the oldest left
            assert len(views) == len(rebuilt) == held
    return {name: statistics.median(values) for name, values in took.items()}


@restores_signals
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", default="0,10000,100000")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.history.split(",")]
    results: dict[int, dict[str, float]] = {}
    with stopped_by_signal() as stopped:
        for n in sizes:
            print(f"measuring: N={n}", file=sys.stderr, flush=True)
            results[n] = measure(n, args.repeat)
    if results:
        table(results)
    if stopped.by:
        done = f"{len(results)} of {len(sizes)} history sizes"
        return cut_short(stopped.by, done, cleaned="its databases removed")
    return 0


def table(results: dict[int, dict[str, float]]) -> None:
    """Milliseconds, a column for each history size measured."""
    sizes = list(results)
    print(f"{'ms':<28}" + "".join(f"{f'N={n}':>12}" for n in sizes))
    for name in results[sizes[0]]:
        print(f"{name:<28}" + "".join(f"{results[n][name] * 1e3:>12.1f}" for n in sizes))
    print(
        f"{'afresh / later second':<28}"
        + "".join(
            f"{results[n]['afresh: total'] / results[n]['kept: a later second']:>11.0f}x"
            for n in sizes
        )
    )


if __name__ == "__main__":
    exit_as(main())
