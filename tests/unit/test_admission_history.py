"""The quotes' view of the job history, kept up to date as runs start, end, leave the window
and are pruned, against the same views made afresh from the whole history."""

from __future__ import annotations

import itertools
import math
import tempfile
import tracemalloc
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpud.admission.classes import ClassViews, class_views
from gpud.admission.estimate import Record
from gpud.admission.metrics import AdmissionMetrics
from gpud.admission.node import synthetic
from gpud.admission.placement_fit import PlacementFit
from gpud.admission.quote import PackingEfficiency, packing_efficiency
from gpud.admission.service import request_of, run_request_to_json
from gpud.jobs.ends import EndCause, RunEnd
from gpud.jobs.service import RunRequest
from tests.unit.test_admission_service import GIB, Clock, Node, make_node

REQUESTS = (
    RunRequest(job="w", gpu_count=1, memory_bytes=60 * GIB),
    RunRequest(job="w", gpu_count=2, memory_bytes=60 * GIB),
    RunRequest(job="w", gpu_count=1, memory_bytes=20 * GIB, threads_percent=50),
    RunRequest(job="w", gpu_count=1, memory_bytes=10 * GIB, threads_percent=25),
)

times = st.floats(min_value=0.0, max_value=4000.0, allow_nan=False)
steps = st.one_of(
    st.tuples(
        st.just("add"),
        st.integers(0, len(REQUESTS) - 1),
        times,  # waited
        times,  # ran until now (or, past now: a run from before the clock stepped back)
        st.one_of(st.none(), times),  # ended: how long ago (None: still runs)
        st.one_of(st.none(), times),  # quoted
    ),
    st.tuples(st.just("end"), st.integers(0, 50), times, st.booleans()),
    st.tuples(st.just("prune"), st.integers(1, 5)),
    st.tuples(st.just("bound"), st.integers(0, 6)),  # admission.history_keep's prune
    st.tuples(st.just("clock"), st.floats(-3000.0, 6000.0, allow_nan=False)),
    st.tuples(st.just("window"), st.sampled_from([600.0, 3600.0, 86400.0])),
    st.tuples(st.just("ask"), st.integers(0, len(REQUESTS) - 1)),
)


def apply(node: Node, step: tuple[object, ...], serial: list[int]) -> None:
    now = node.clock.now
    match step:
        case ("add", int(kind), float(waited), float(ran), ended, quoted):
            request = REQUESTS[kind]
            serial[0] += 1
            started = now - ran
            end = None if ended is None else max(started, now - float(ended))  # type: ignore[arg-type]
            with node.store.transaction() as conn:
                conn.execute(
                    "INSERT INTO job_history (job, reservation, request_class, request,"
                    " queued_at, started_at, ended_at, quote_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        f"j{serial[0]}",
                        f"r{serial[0]}",
                        request_of(request).describe(),
                        run_request_to_json(replace(request, job=f"j{serial[0]}")),
                        started - waited,
                        started,
                        end,
                        quoted,
                    ),
                )
        case ("end", int(which), float(ago), bool(removed)):
            # a run ends; a run removed while it ran ends again when its gpuctl reports
            with node.store.transaction() as conn:
                rows = conn.execute(
                    "SELECT id FROM job_history WHERE ended_at IS NULL OR"
                    " (end_cause = ? AND reported_at IS NULL) ORDER BY id",
                    (EndCause.REMOVED.value,),
                ).fetchall()
                if rows:
                    row_id = rows[which % len(rows)][0]
                    conn.execute(
                        "UPDATE job_history SET ended_at = MAX(started_at, ?),"
                        " end_cause = ?, reported_at = CASE WHEN end_cause = ? THEN ?"
                        " ELSE NULL END WHERE id = ?",
                        (
                            now - ago,
                            EndCause.REMOVED.value if removed else "exited",
                            EndCause.REMOVED.value,
                            now,
                            row_id,
                        ),
                    )
        case ("prune", int(count)):
            with node.store.transaction() as conn:
                conn.execute(
                    "DELETE FROM job_history WHERE id IN"
                    " (SELECT id FROM job_history ORDER BY id LIMIT ?)",
                    (count,),
                )
        case ("bound", int(keep)):
            node.admission.config = replace(node.admission.config, history_keep=keep)
            node.admission._prune(now)
        case ("clock", float(delta)):
            node.clock.now += delta
        case ("window", float(window_s)):
            node.admission.config = replace(node.admission.config, history_window_s=window_s)
        case ("ask", int(kind)):
            pass


def fresh(node: Node) -> list[object]:
    """The class views made from the whole history in the window, read afresh."""
    fit = node.admission.fit()
    assert fit is not None
    now, window_s = node.clock.now, node.admission.config.history_window_s
    history = node.admission.history(since=now - window_s)
    requests = {h.request_class: request_of(h.request) for h in history}
    records = [h.record() for h in history]
    return list(class_views(fit, requests, records, now=now, window_s=window_s).values())


def fresh_error(node: Node) -> tuple[float, int]:
    """gpud_admission_quote_error_seconds and _runs from the history read afresh."""
    since = node.clock.now - node.admission.config.history_window_s
    history = node.admission.history(since=since)
    errors = [h.started_at - h.queued_at - h.quote_s for h in history if h.quote_s is not None]
    return (sum(errors) / len(errors) if errors else 0.0, len(errors))


@settings(max_examples=60, deadline=None)
@given(st.lists(steps, min_size=1, max_size=40))
# runs that left the window come back into it when the clock steps back past their queueing
@example(
    [
        ("window", 600.0),
        ("add", 0, 0.0, 599.0, None, None),
        ("add", 0, 0.0, 600.0, None, None),
        ("clock", -602.0),
    ]
)
def test_kept_views_equal_views_made_afresh(plan: list[tuple[object, ...]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        node = make_node(Path(tmp), Clock())
        try:
            serial = [0]
            asked = None
            for step in plan:
                apply(node, step, serial)
                if int(node.clock.now) == asked:  # within one second the views are kept
                    node.clock.now += 1.0
                asked = int(node.clock.now)
                assert node.admission.explain() == fresh(node)
                assert node.admission.quote_error() == fresh_error(node)
                mirror = node.admission._mirror
                assert mirror._queued == sorted(r.queued_at for r, _ in mirror.since(-math.inf))
        finally:
            node.store.close()


def test_a_second_quote_reads_only_the_rows_that_changed(tmp_path: Path) -> None:
    """Asking again reads the rows added or still running since, not the whole history."""
    node = make_node(tmp_path, Clock())
    serial = [0]
    for i in range(200):
        apply(
            node, ("add", i % len(REQUESTS), 30.0, 600.0, 100.0 if i % 50 else None, 20.0), serial
        )
    node.admission.explain()
    mirror = node.admission._mirror
    first = mirror.reads
    assert first == 200
    for _ in range(5):
        node.clock.now += 1.0
        assert node.admission.explain() == fresh(node)
    assert mirror.reads == first + 5 * 4  # the four runs still running, each time
    apply(node, ("add", 0, 10.0, 20.0, None, None), serial)
    apply(node, ("prune", 3), serial)
    node.clock.now += 1.0
    assert node.admission.explain() == fresh(node)
    # the row added, and the three runs still running that were not pruned
    assert mirror.reads == first + 5 * 4 + 1 + 3 and len(mirror) == 198
    node.store.close()


def test_ended_rows_pruned_behind_a_running_run_leave_the_kept_history_in_place(
    tmp_path: Path,
) -> None:
    """The history bound prunes the ended rows past it and keeps the runs still running,
    however old: the rows pruned behind such a run leave the kept history by themselves,
    neither kept on (as the oldest row is still there) nor read again with all the rest."""
    node = make_node(tmp_path, Clock())
    serial = [0]
    apply(node, ("add", 0, 30.0, 900.0, None, None), serial)  # runs on, the oldest
    for i in range(200):
        apply(node, ("add", i % len(REQUESTS), 30.0, 600.0, 100.0, None), serial)
    node.admission.explain()
    mirror = node.admission._mirror
    first = mirror.reads
    apply(node, ("add", 0, 10.0, 20.0, 5.0, None), serial)
    apply(node, ("bound", 150), serial)
    node.clock.now += 1.0
    assert node.admission.explain() == fresh(node)
    assert len(mirror) == 151 and mirror.reads == first + 1 + 1  # the row added, the run
    assert [h.job for h in node.admission.history()][:2] == ["j1", "j53"]
    node.store.close()


def test_a_run_past_the_bound_that_ended_and_was_pruned_leaves_without_a_full_read(
    tmp_path: Path,
) -> None:
    """Two runs older than the history bound still run; the younger ends and the bound
    prunes its row: the kept history drops it by itself and reads again only the run still
    running, not the whole table."""
    node = make_node(tmp_path, Clock())
    serial = [0]
    apply(node, ("add", 0, 30.0, 900.0, None, None), serial)  # runs on, the oldest
    apply(node, ("add", 1, 30.0, 800.0, None, None), serial)  # ends, then is pruned
    for i in range(200):
        apply(node, ("add", i % len(REQUESTS), 30.0, 600.0, 100.0, None), serial)
    node.admission.explain()
    mirror = node.admission._mirror
    first = mirror.reads
    apply(node, ("end", 1, 5.0, False), serial)
    apply(node, ("bound", 150), serial)
    node.clock.now += 1.0
    assert node.admission.explain() == fresh(node)
    assert len(mirror) == 151 and mirror.reads == first + 1  # the run still running
    assert [h.job for h in node.admission.history()][:2] == ["j1", "j53"]
    node.store.close()


def test_a_run_removed_while_its_command_runs_keeps_its_row_past_the_bound_for_its_end(
    tmp_path: Path,
) -> None:
    """A run `gpuctl jobs rm --force` removed while its command ran is ended at the removal
    until its `gpuctl run` reports the command's exit: the history bound keeps its row
    however old until then, so that the late end is kept there."""
    node = make_node(tmp_path, Clock())
    serial = [0]
    apply(node, ("add", 0, 30.0, 900.0, None, None), serial)  # removed, its command runs on
    for i in range(200):
        apply(node, ("add", i % len(REQUESTS), 30.0, 600.0, 100.0, None), serial)
    apply(node, ("end", 0, 5.0, True), serial)
    apply(node, ("bound", 150), serial)
    node.clock.now += 1.0
    assert node.admission.explain() == fresh(node)
    assert [h.job for h in node.admission.history()][:2] == ["j1", "j52"]
    assert node.admission._removed_run_ended("r1", RunEnd(EndCause.EXITED, exit_code=3))
    (ended,) = [h for h in node.admission.history() if h.job == "j1"]
    assert (ended.exit_code, ended.end_cause, ended.ended_at) == (3, "removed", node.clock.now)
    apply(node, ("bound", 150), serial)  # reported: an ended row like any other
    assert [h.job for h in node.admission.history()][:1] == ["j52"]
    node.store.close()


def test_the_window_s_members_are_kept_sorted_as_runs_come_end_and_are_pruned(
    tmp_path: Path,
) -> None:
    """Which runs the window holds is counted on the queued times kept sorted: a run added,
    one that ended and rows pruned change them in place, not sorted again from every run."""
    node = make_node(tmp_path, Clock())
    serial = [0]
    for i in range(50):
        apply(node, ("add", i % len(REQUESTS), 10.0 * (i % 7), 600.0, None, None), serial)
    node.admission.explain()
    mirror = node.admission._mirror
    kept = mirror._queued
    assert kept is not None
    for step in [
        ("add", 0, 5000.0, 10.0, None, None),  # queued before most
        ("end", 3, 1.0, False),
        ("prune", 4),
        ("add", 1, 0.0, 0.0, None, None),
    ]:
        node.clock.now += 1.0
        apply(node, step, serial)
        assert node.admission.explain() == fresh(node)
        assert mirror._queued is kept
        assert kept == sorted(r.queued_at for r, _ in mirror.since(-math.inf))
    node.store.close()


jobs = st.lists(
    st.tuples(times, times, st.one_of(st.none(), times), st.sampled_from([0.25, 0.5, 1.0])).map(
        lambda j: (j[0], j[0] + j[1], None if j[2] is None else j[0] + j[1] + j[2], j[3])
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(jobs, st.lists(st.floats(0.0, 12000.0, allow_nan=False), min_size=1, max_size=12))
def test_packing_efficiency_asked_again_equals_it_made_afresh(
    ran: list[tuple[float, float, float | None, float]], asked: list[float]
) -> None:
    """Asked at times that move on, stand still or step back (a clock stepped back)."""
    kept = PackingEfficiency(ran)
    for now in asked:
        assert kept.at(now) == packing_efficiency(ran, now=now)


def test_a_scrape_decodes_no_run_it_read_before(tmp_path: Path) -> None:
    """gpud_admission_quote_error_* come from the history kept for the quotes: a scrape
    over a long history decodes no run it has read before (rows that would no longer decode
    change nothing), and says what the history read afresh says."""
    node = make_node(tmp_path, Clock())
    serial = [0]
    for i in range(300):
        apply(node, ("add", i % len(REQUESTS), 30.0 + i, 600.0, 100.0, 20.0), serial)
    scrape = AdmissionMetrics(node.admission)

    def figures() -> dict[str, float]:
        return {
            m.name: m.samples[0].value for m in scrape() if m.name.startswith("gpud_admission_q")
        }

    mean, runs = fresh_error(node)
    assert figures() == {
        "gpud_admission_quote_error_seconds": mean,
        "gpud_admission_quote_error_runs": runs,
        "gpud_admission_queue_length": 0.0,
    }
    assert runs == 300
    with node.store.transaction() as conn:
        conn.execute("UPDATE job_history SET request = 'no longer decodes'")
    node.clock.now += 1.0
    assert figures()["gpud_admission_quote_error_seconds"] == mean
    node.store.close()


@settings(max_examples=200, deadline=None)
@given(
    jobs,
    st.lists(
        st.tuples(
            st.sampled_from(["add", "end", "ask"]),
            times,
            times,
            st.sampled_from([0.25, 0.5, 1.0]),
        ),
        max_size=30,
    ),
    st.integers(1, 8),
)
def test_packing_efficiency_with_jobs_added_and_ended_equals_it_made_afresh(
    ran: list[tuple[float, float, float | None, float]],
    steps: list[tuple[str, float, float, float]],
    mark_every: int,
) -> None:
    """Jobs added after the others and runs that end, each taken in where it stands, against
    the sweep made afresh (asked in between, so that the kept sweep has gone past them and
    goes back to a mark before them)."""
    jobs_now = list(ran)
    kept = PackingEfficiency(jobs_now, mark_every=mark_every)
    now = 0.0
    for what, a, b, share in steps:
        running = [i for i, j in enumerate(jobs_now) if j[2] is None]
        if what == "add":
            job = (a, a + b, None if share == 1.0 else a + b + 1.0, share)
            kept.add(job, (len(jobs_now),))
            jobs_now.append(job)
        elif what == "end" and running:
            i = running[int(a) % len(running)]
            queued, started, _, s = jobs_now[i]
            kept.remove(jobs_now[i], (i,))
            jobs_now[i] = (queued, started, started + b, s)
            kept.add(jobs_now[i], (i,))
        else:
            now = a * 3
        assert kept.at(now) == packing_efficiency(jobs_now, now=now)


def test_runs_started_ended_leaving_and_pruned_change_the_views_in_place(tmp_path: Path) -> None:
    """A run added, ended, leaving the window or pruned is taken into the views kept for
    the window (not made afresh from every run in it), until as many runs have left as
    remain: then they are made afresh. Either way they are the views made afresh."""
    node = make_node(tmp_path, Clock())
    serial = [0]
    for i in range(40):  # queued a minute apart, from 1010 on
        node.clock.now += 60.0
        apply(node, ("add", i % len(REQUESTS), 30.0, 20.0, 10.0 if i % 4 else None, 5.0), serial)
    node.admission.config = replace(node.admission.config, history_window_s=3600.0)

    def views() -> tuple[object, int]:
        assert node.admission.explain() == fresh(node)
        window = node.admission._window
        assert window is not None
        (_, below, upto), _ = window[0]
        return window[2], upto - below

    kept, held = views()
    for step, leave in [
        (("add", 1, 10.0, 5.0, None, 3.0), -1),
        (("end", 0, 2.0, False), 0),
        (("add", 2, 0.0, 0.0, 1.0, None), -1),
        (("prune", 3), 3),
        (("clock", 1500.0), 2),  # the runs queued before 1310 leave the window
        (("prune", 2), 0),  # rows from before the window
    ]:
        node.clock.now += 1.0
        apply(node, step, serial)
        views_now, held_now = views()
        assert views_now is kept
        assert held - held_now == leave
        held = held_now
    node.clock.now += 1300.0  # more runs leave than remain
    assert views()[0] is not kept


window_steps = st.one_of(
    # a run starts: waited, of this class
    st.tuples(st.just("start"), st.integers(0, len(REQUESTS) - 1), times),
    # a run that ended is added (a run removed while it ran, reported): waited, ran
    st.tuples(st.just("ran"), st.integers(0, len(REQUESTS) - 1), times, times),
    st.tuples(st.just("end"), st.integers(0, 50)),  # a run that runs ends now
    st.tuples(st.just("prune"), st.integers(1, 5)),  # the oldest rows
    st.tuples(st.just("clock"), st.floats(0.0, 2000.0, allow_nan=False)),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, len(REQUESTS) - 1), times, times), max_size=30),
    st.lists(window_steps, min_size=1, max_size=40),
    st.sampled_from([600.0, 3600.0]),
)
def test_views_of_a_window_runs_leave_equal_views_made_afresh(
    first: list[tuple[int, float, float]],
    plan: list[tuple[object, ...]],
    window_s: float,
) -> None:
    """Runs that start, end, are pruned and leave the window as the time moves on are taken
    into the views in place (not made afresh: only once as many runs have left as remain),
    with the same figures, floats and all, as the views made afresh from the runs left."""
    fit = PlacementFit(synthetic("H100-SXM5-80GB", 2))
    requests = {request_of(r).describe(): request_of(r) for r in REQUESTS}
    keys = list(requests)
    now = 5000.0
    rows = [  # the history, in row order
        Record(f"j{i}", keys[kind], now - waited - ran, now - ran, now - ran / 2)
        for i, (kind, waited, ran) in enumerate(first)
    ]

    def window() -> set[str]:
        return {r.job for r in rows if now - window_s <= r.queued_at <= now}

    views = ClassViews(rows, now=now, window_s=window_s)
    assert views.at(fit, requests, now=now) == class_views(
        fit, requests, rows, now=now, window_s=window_s
    )
    held, left = window(), 0
    serial = itertools.count(len(rows))
    for step in plan:
        changes: list[tuple[Record | None, Record | None]] = []
        match step:
            case ("start", int(kind), float(waited)):
                rows.append(Record(f"j{next(serial)}", keys[kind], now - waited, now, None))
                changes.append((None, rows[-1]))
            case ("ran", int(kind), float(waited), float(ran)):
                rows.append(
                    Record(f"j{next(serial)}", keys[kind], now - waited - ran, now - ran, now)
                )
                changes.append((None, rows[-1]))
            case ("end", int(which)):
                running = [i for i, r in enumerate(rows) if r.ended_at is None]
                if running:
                    i = running[which % len(running)]
                    changes.append((rows[i], replace(rows[i], ended_at=now)))
                    rows[i] = changes[-1][1]  # type: ignore[assignment]
            case ("prune", int(count)):
                changes.extend((r, None) for r in rows[:count])
                del rows[:count]
            case ("clock", float(delta)):
                now += delta
        kept = views.change(changes, now=now)
        left += len(held - window())
        held = window()
        assert kept or left > len(held)  # in place until as many have left as remain
        if not kept:
            views, left = ClassViews(rows, now=now, window_s=window_s), 0
        assert len(views) == len(held)
        fresh_views = class_views(fit, requests, rows, now=now, window_s=window_s)
        assert views.at(fit, requests, now=now) == fresh_views


def test_requests_of_pruned_runs_are_not_kept_past_the_history_bound(tmp_path: Path) -> None:
    """A sweep whose every run asks another memory size: once the bound prunes their rows,
    the kept history holds no more distinct requests and class keys than the rows it keeps
    (twice over at most), however many runs came before."""
    node = make_node(tmp_path, Clock())
    mirror = node.admission._mirror
    for i in range(1, 1001):
        request = RunRequest(job=f"j{i}", gpu_count=1, memory_bytes=GIB + i * 2**20)
        with node.store.transaction() as conn:
            conn.execute(
                "INSERT INTO job_history (job, reservation, request_class, request,"
                " queued_at, started_at, ended_at, quote_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    f"j{i}",
                    f"r{i}",
                    request_of(request).describe(),
                    run_request_to_json(request),
                    node.clock.now - 30.0,
                    node.clock.now - 20.0,
                    node.clock.now - 10.0,
                    None,
                ),
            )
        if i % 100 == 0:
            apply(node, ("bound", 50), [0])
            node.clock.now += 1.0
            assert node.admission.explain() == fresh(node)
    assert len(mirror) == 50
    assert len(mirror._interned) <= 2 * 50 + 64 and len(mirror._classes) <= 2 * 50 + 64
    node.store.close()


def test_the_kept_sweep_holds_a_few_hundred_bytes_per_run() -> None:
    """The sweep of the packing efficiency is kept for every pool while gpud runs, over
    every run in the window (admission.history_keep of them): its events share their run's
    rank and the classes' negated shares, rather than a tuple and a float each."""
    runs = 20_000
    shares = (1.0, 0.5, 0.25)
    ran = [(i * 10.0, i * 10.0 + 3.0, i * 10.0 + 8.0, shares[i % 3]) for i in range(runs)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        # the ranks made here, held by the sweep alone (as the class views make them): counted
        kept = PackingEfficiency(ran, [(i % 3, i) for i in range(runs)])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept.at(runs * 10.0) == packing_efficiency(ran, now=runs * 10.0)
    # four events of a run: 80 bytes each and their list's slots, and its rank, a pair and
    # an int (443 measured; before the events shared them, a tuple of its own for each
    # event's place and a float for each end, about 600 without the rank). The times are
    # the history rows' own floats, kept by them: not counted
    assert held < 500 * runs, f"{held / runs:.0f} bytes per run"


def test_a_rank_of_another_length_is_refused_naming_both_lengths() -> None:
    """A longer rank sorts after a shorter one it begins with: mixed, the ties of one time
    would be swept in another order than a sweep made afresh takes them."""
    kept = PackingEfficiency([(0.0, 1.0, 2.0, 0.5)], [(0, 0)])
    with pytest.raises(ValueError, match=r"rank \(0, 1, 0\) has 3 parts, the sweep's ranks 2"):
        kept.add((0.0, 1.0, None, 0.5), (0, 1, 0))
    kept.add((0.0, 1.0, None, 0.5), (0, 1))
    assert kept.at(3.0) == packing_efficiency(
        [(0.0, 1.0, 2.0, 0.5), (0.0, 1.0, None, 0.5)], now=3.0
    )
