"""ProgressTracker: rates from iteration reports, stalls, restarts, learned ideals."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netshaper import ProgressConfig, ProgressTracker

# The window's estimate alone, for the tests of how the window reads a job.
WINDOW_ONLY = ProgressConfig(long_window_s=0)
# ... and a stall counted for as long as it lasts, for the tests of how a stall decays.
NO_GAP_LIMIT = ProgressConfig(long_window_s=0, gap_spacings=1e6)


def steady(
    tracker: ProgressTracker, job: str, period: float, n: int, *, t0: float = 0.0, start: int = 0
) -> float:
    for i in range(n + 1):
        tracker.report(job, start + i, t0 + i * period)
    return t0 + n * period


def test_no_estimate_until_two_progress_points() -> None:
    tr = ProgressTracker()
    tr.register("a", now=0.0, ideal_s=1.0)
    tr.report("a", 0, 0.0)
    assert tr.rates(0.5) == {"a": None}


def test_steady_rate_is_ideal_over_period() -> None:
    tr = ProgressTracker()
    tr.register("a", now=0.0, ideal_s=1.0)
    t = steady(tr, "a", 2.0, 10)
    assert tr.progress("a", t).rate == pytest.approx(0.5)
    assert tr.progress("a", t).period_s == pytest.approx(2.0)


def test_declared_ideal_above_observed_is_capped_at_one() -> None:
    tr = ProgressTracker()
    tr.register("a", now=0.0, ideal_s=3.0)
    t = steady(tr, "a", 2.0, 5)
    assert tr.progress("a", t).rate == 1.0


def test_learned_ideal_is_best_sample_and_never_above_observed() -> None:
    tr = ProgressTracker()
    times = [0.0, 1.0, 3.0, 6.0, 8.0]  # samples 1, 2, 3, 2
    for i, t in enumerate(times):
        tr.report("a", i, t)
    p = tr.progress("a", 8.0)
    assert p.ideal_s == pytest.approx(1.0)
    assert p.rate == pytest.approx(1.0 / 2.0)


def test_stall_decays_rate_without_division_by_zero() -> None:
    tr = ProgressTracker(NO_GAP_LIMIT)
    tr.register("a", now=0.0, ideal_s=1.0)
    t = steady(tr, "a", 1.0, 5)
    assert tr.progress("a", t).rate == pytest.approx(1.0)
    assert tr.progress("a", t + 10.0).rate == pytest.approx(0.1)
    assert tr.progress("a", t + 100.0).rate == pytest.approx(0.01)


def test_job_that_never_progresses_gets_a_falling_rate() -> None:
    tr = ProgressTracker()
    tr.register("a", now=0.0, ideal_s=2.0)
    tr.report("a", 0, 0.0)
    assert tr.progress("a", 1.0).rate is None  # not known to be slow yet
    assert tr.progress("a", 8.0).rate == pytest.approx(0.25)


def test_restart_resets_window_but_keeps_prior() -> None:
    tr = ProgressTracker()
    tr.register("a", now=0.0, ideal_s=1.0)
    t = steady(tr, "a", 2.0, 10)
    tr.report("a", 0, t + 1.0)  # the job restarted from scratch
    p = tr.progress("a", t + 1.5)
    assert p.restarts == 1
    assert p.rate == pytest.approx(0.5)  # prior period, not a jump
    tr.report("a", 1, t + 2.0)
    tr.report("a", 2, t + 3.0)
    assert tr.progress("a", t + 3.0).rate == pytest.approx(1.0)


def test_a_counter_that_leaps_ahead_is_a_new_start_not_a_faster_job() -> None:
    """A job that resumes from a checkpoint under its global step count (or a counter bug)
    reports 500,000 iterations one second after 10: learning T* from that step would rank
    it the slowest job for good."""
    tr = ProgressTracker()
    tr.register("a", now=0.0)  # T* learned: 2 s
    t = steady(tr, "a", 2.0, 10)
    tr.report("a", 500_000, t + 1.0)
    p = tr.progress("a", t + 1.0)
    assert p.restarts == 1
    assert p.ideal_s == pytest.approx(2.0)
    assert p.rate == pytest.approx(1.0)  # the prior period, as after a restart
    steady(tr, "a", 4.0, 5, t0=t + 1.0, start=500_000)
    assert tr.progress("a", t + 21.0).rate == pytest.approx(0.5)
    # a stretch faster than any before is learned, however much faster it is than the
    # window says the job goes now
    tr.report("a", 500_006, t + 22.0)
    assert tr.progress("a", t + 22.0).ideal_s == pytest.approx(1.0)


def test_batched_reports_give_the_same_estimate() -> None:
    every = ProgressTracker()
    batched = ProgressTracker()
    for tr in (every, batched):
        tr.register("a", now=0.0, ideal_s=0.5)
    steady(every, "a", 1.0, 12)
    for i in range(0, 13, 4):
        batched.report("a", i, float(i))
    assert every.progress("a", 12.0).rate == pytest.approx(batched.progress("a", 12.0).rate or 0)


def test_window_follows_a_slowdown() -> None:
    tr = ProgressTracker(ProgressConfig(window_s=10.0, long_window_s=0))
    tr.register("a", now=0.0, ideal_s=1.0)
    t = steady(tr, "a", 1.0, 50)
    for i in range(51, 61):
        t += 4.0
        tr.report("a", i, t)
    assert tr.progress("a", t).rate == pytest.approx(0.25)
    assert tr.progress("a", t).restarts == 0


def test_the_window_spans_two_iterations_however_long_they_take() -> None:
    # an iteration longer than the window, after a short one (as a job that went down a
    # level after a fast iteration runs): the estimate is their mean, not the last alone
    def tracker(**config: Any) -> ProgressTracker:
        tr = ProgressTracker(ProgressConfig(window_s=10.0, long_window_s=0, **config))
        tr.register("a", now=0.0, ideal_s=2.0)
        for i, at in enumerate([0.0, 12.0, 16.0, 28.0]):
            tr.report("a", i, at)
        return tr

    assert tracker().progress("a", 28.0).period_s == pytest.approx(8.0)
    assert tracker().progress("a", 28.0).rate == pytest.approx(0.25)
    assert tracker(min_iterations=1).progress("a", 28.0).period_s == pytest.approx(12.0)


def test_out_of_order_and_duplicate_reports_are_ignored() -> None:
    tr = ProgressTracker()
    tr.register("a", now=0.0, ideal_s=1.0)
    steady(tr, "a", 2.0, 4)
    tr.report("a", 9, 1.0)
    tr.report("a", 4, 8.0)
    assert tr.progress("a", 8.0).rate == pytest.approx(0.5)


def test_unknown_jobs_are_registered_and_forgotten() -> None:
    tr = ProgressTracker()
    tr.report("x", 0, 0.0)
    assert tr.jobs() == ["x"]
    tr.forget("x")
    tr.forget("x")
    assert tr.jobs() == []


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError):
        ProgressConfig(window_s=0)
    with pytest.raises(ValueError):
        ProgressConfig(min_iterations=0)
    with pytest.raises(ValueError, match="stall_iterations"):
        ProgressConfig(stall_iterations=-1)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="long_window_s"):
            ProgressConfig(long_window_s=bad)
    tr = ProgressTracker()
    with pytest.raises(ValueError):
        tr.register("a", now=0.0, ideal_s=0.0)
    with pytest.raises(ValueError):
        tr.report("a", -1, 0.0)


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.integers(-3, 5), st.floats(0.0, 5.0)),
        min_size=1,
        max_size=40,
    ),
    ideal=st.none() | st.floats(0.01, 5.0),
    probe=st.floats(0.0, 50.0),
)
def test_rate_is_none_or_in_unit_interval(
    steps: list[tuple[int, float]], ideal: float | None, probe: float
) -> None:
    tr = ProgressTracker()
    tr.register("a", now=0.0, ideal_s=ideal)
    count, t = 0, 0.0
    for dn, dt in steps:
        count = max(0, count + dn)
        t += dt
        tr.report("a", count, t)
        rate = tr.progress("a", t + probe).rate
        assert rate is None or 0.0 < rate <= 1.0


def test_an_interval_below_float_resolution_is_a_leap_not_a_zero_tstar() -> None:
    # Two iterations 5e-324 s apart: the per-iteration time underflows to 0.0.
    tr = ProgressTracker()
    tr.register("a", now=0.0)
    tr.report("a", 0, 0.0)
    tr.report("a", 2, 5e-324)
    p = tr.progress("a", 1.0)
    assert p.ideal_s is None and p.rate is None and p.restarts == 1
    tr.report("a", 3, 1.0)
    rate = tr.progress("a", 1.0).rate
    assert rate is not None and 0.0 < rate <= 1.0


def test_a_job_that_waited_one_tick_after_a_fast_stretch_is_not_taken_for_the_slowest() -> None:
    # a ran ten iterations at full speed on a high level, then waited a tick on a low one;
    # b has run steadily at half speed. Over the same stretch a made more progress.
    tr = ProgressTracker(WINDOW_ONLY)
    tr.register("a", now=0.0, ideal_s=0.2)
    tr.register("b", now=0.0, ideal_s=0.2)
    t = steady(tr, "a", 0.2, 10)
    steady(tr, "b", 0.4, 7)
    rates = tr.rates(t + 1.0)
    # the open iteration ends now at the earliest: (8 x 0.2 + 1.0) / 9 s per iteration
    assert rates["a"] == pytest.approx(0.2 / (2.6 / 9))
    assert rates["b"] == pytest.approx(0.5)
    assert rates["a"] > rates["b"]


def test_a_long_stall_still_decays_to_nothing() -> None:
    tr = ProgressTracker(NO_GAP_LIMIT)
    tr.register("a", now=0.0, ideal_s=1.0)
    t = steady(tr, "a", 1.0, 20)
    assert tr.progress("a", t + 1.0).rate == pytest.approx(1.0)  # one iteration: on time
    assert tr.progress("a", t + 10.0).rate == pytest.approx(9 / 18)
    assert tr.progress("a", t + 1000.0).rate == pytest.approx(9 / 1008)


def test_the_open_iteration_alone_counts_when_stall_iterations_is_0() -> None:
    tr = ProgressTracker(ProgressConfig(stall_iterations=0, long_window_s=0))
    tr.register("a", now=0.0, ideal_s=1.0)
    t = steady(tr, "a", 1.0, 20)
    assert tr.progress("a", t + 10.0).rate == pytest.approx(0.1)


@settings(max_examples=60, deadline=None)
@given(
    periods=st.lists(st.floats(0.01, 3.0), min_size=1, max_size=30),
    waits=st.lists(st.floats(0.0, 50.0), min_size=2, max_size=6),
    least=st.integers(0, 12),
)
def test_a_job_that_makes_no_progress_never_looks_faster(
    periods: list[float], waits: list[float], least: int
) -> None:
    tr = ProgressTracker(ProgressConfig(window_s=5.0, stall_iterations=least))
    tr.register("a", now=0.0, ideal_s=0.01)
    t = 0.0
    tr.report("a", 0, t)
    for i, p in enumerate(periods, start=1):
        t += p
        tr.report("a", i, t)
    seen = [tr.progress("a", t + w).rate or 0.0 for w in sorted(waits)]
    assert all(later <= earlier + 1e-12 for earlier, later in itertools.pairwise(seen))


def test_a_job_that_fell_behind_ranks_before_one_as_fast_now() -> None:
    # Both run at half speed now; a ran at a quarter for its first 40 s.
    tr = ProgressTracker(ProgressConfig(window_s=20.0, long_window_s=300.0))
    tr.register("a", now=0.0, ideal_s=1.0)
    tr.register("b", now=0.0, ideal_s=1.0)
    t = steady(tr, "a", 4.0, 10)
    steady(tr, "a", 2.0, 20, t0=t, start=10)
    steady(tr, "b", 2.0, 40)
    rates = tr.rates(80.0)
    assert rates["b"] == pytest.approx(0.5)
    # sqrt(window 0.5 x long run 30 iterations in 80 s)
    assert rates["a"] == pytest.approx((0.5 * 30 / 80) ** 0.5)


def test_long_weight_sets_how_much_the_deficit_ranks() -> None:
    # a at half speed now after a slow start, b at half speed throughout: the window's
    # rates tie, the long-run rates do not
    def rates(weight: float) -> dict[str, float | None]:
        tr = ProgressTracker(ProgressConfig(window_s=20.0, long_window_s=300.0, long_weight=weight))
        tr.register("a", now=0.0, ideal_s=1.0)
        tr.register("b", now=0.0, ideal_s=1.0)
        t = steady(tr, "a", 4.0, 10)
        steady(tr, "a", 2.0, 20, t0=t, start=10)
        steady(tr, "b", 2.0, 40)
        return tr.rates(80.0)

    long_a = 30 / 80
    assert rates(1.0)["a"] == pytest.approx(long_a)  # the long-run rate alone
    assert rates(0.0)["a"] == pytest.approx(0.5)  # the window's alone: a ties with b
    assert rates(0.75)["a"] == pytest.approx(0.5**0.25 * long_a**0.75)
    assert rates(0.5)["a"] == pytest.approx((0.5 * long_a) ** 0.5)
    assert all(r["b"] == pytest.approx(0.5) for r in (rates(0.0), rates(1.0)))
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="long_weight"):
            ProgressConfig(long_weight=bad)


def test_the_long_window_forgets_what_is_older() -> None:
    tr = ProgressTracker(ProgressConfig(window_s=20.0, long_window_s=100.0))
    tr.register("a", now=0.0, ideal_s=1.0)
    t = steady(tr, "a", 4.0, 10)
    t = steady(tr, "a", 2.0, 100, t0=t, start=10)
    assert tr.progress("a", t).rate == pytest.approx(0.5, rel=0.03)


def test_the_long_window_starts_again_after_a_restart() -> None:
    tr = ProgressTracker(ProgressConfig(window_s=20.0, long_window_s=300.0))
    tr.register("a", now=0.0, ideal_s=1.0)
    t = steady(tr, "a", 10.0, 5)  # slow before the restart
    steady(tr, "a", 2.0, 10, t0=t + 2.0)  # counts from 0 again, at half speed
    assert tr.progress("a", t + 22.0).rate == pytest.approx(0.5)


def test_the_long_window_is_never_shorter_than_the_window() -> None:
    tr = ProgressTracker(ProgressConfig(window_s=100.0, long_window_s=10.0))
    tr.register("a", now=0.0, ideal_s=1.0)
    t = steady(tr, "a", 4.0, 10)
    t = steady(tr, "a", 1.0, 20, t0=t, start=10)
    assert tr.progress("a", t).rate == pytest.approx(0.5)  # 30 iterations in 60 s, both ways


@pytest.mark.parametrize("first_stretch_s", [1200.0, 365 * 86400.0])
def test_a_long_first_stretch_does_not_freeze_the_estimate(first_stretch_s: float) -> None:
    """A first stretch far longer than the job's iterations (a first iteration that
    compiled for 20 minutes, a report stamped a year back) is learned as T*; the steps
    after it are then a thousand times faster. The first is taken for a counter that
    leapt, but two in a row are the job's pace: T* is learned again from them, and the
    estimate follows the job instead of holding the first stretch for good."""
    tr = ProgressTracker()
    tr.report("a", 0, 0.0)
    t = first_stretch_s
    tr.report("a", 1, t)
    steady(tr, "a", 1.0, 10, t0=t + 1.0, start=2)
    p = tr.progress("a", t + 11.0)
    assert p.ideal_s == pytest.approx(1.0)
    assert p.period_s == pytest.approx(1.0)
    # the job slows down to 4 s an iteration: it is seen as slower
    steady(tr, "a", 4.0, 10, t0=t + 11.0, start=12)
    p = tr.progress("a", t + 51.0)
    assert p.period_s == pytest.approx(4.0) and p.rate is not None and p.rate < 0.5


def test_a_counter_that_leaps_on_its_second_report_teaches_no_tstar() -> None:
    """A counter that leaps before any T* is learned (0, then 2**64 - 1 a second later)
    implies iterations far under a microsecond: learning T* from it would rank the job the
    slowest for good. It is a new start, and T* comes from the steps after it."""
    tr = ProgressTracker()
    tr.report("a", 0, 0.0)
    tr.report("a", 2**64 - 1, 1.0)
    assert tr.progress("a", 1.0).ideal_s is None
    tr.report("a", 2**64, 3.0)
    tr.report("a", 2**64 + 1, 5.0)
    p = tr.progress("a", 5.0)
    assert p.ideal_s == pytest.approx(2.0) and p.rate == pytest.approx(1.0)


def test_ranks_of_one_job_reporting_apart_are_not_restarts() -> None:
    """Every rank of a data-parallel job reports (each its own ``Progress``): a rank's
    batch arrives after another's newer one, with lower counts stamped earlier. Those are
    late reports, not the job starting over: the window and the long-run rate stay."""
    tr = ProgressTracker()
    tr.register("a", now=0.0, ideal_s=0.05)
    for k in range(1, 200):  # rank 0 sends iterations up to 2k, then rank 1 up to 2k - 1
        tr.report("a", 2 * k, 0.1 * k)
        tr.report("a", 2 * k - 1, 0.1 * k - 0.05)
    p = tr.progress("a", 19.9)
    assert p.restarts == 0
    assert p.rate == pytest.approx(1.0)
    # a restart is stamped after the newest report: the counter going back is one
    tr.report("a", 0, 20.0)
    assert tr.progress("a", 20.0).restarts == 1


def test_a_clock_stepped_back_is_a_new_time_base_not_an_hour_of_late_reports() -> None:
    """The host's clock steps back an hour (NTP, a resumed VM): the job's counter keeps
    going up, stamped before its newest report. No counter runs ahead of its own past, so
    that is the clock: the estimate goes on from the new time base, instead of dropping
    every report for an hour while the job looks stalled."""
    tr = ProgressTracker()
    tr.register("a", now=0.0, ideal_s=1.0)
    t = steady(tr, "a", 1.0, 100)
    back = t - 3600.0
    steady(tr, "a", 1.0, 20, t0=back + 1.0, start=101)
    p = tr.progress("a", back + 21.0)
    assert p.iterations == 121 and p.restarts == 1
    assert p.period_s == pytest.approx(1.0) and p.rate == pytest.approx(1.0)


def test_a_stall_counts_up_to_the_gap_limit_and_no_further() -> None:
    tr = ProgressTracker(ProgressConfig(long_window_s=0, gap_spacings=20.0))
    tr.register("a", now=0.0, ideal_s=1.0)
    t = steady(tr, "a", 1.0, 20)
    at_limit = tr.progress("a", t + 20.0)
    assert at_limit.rate == pytest.approx(9 / 28)  # (8 + 20) s over 9 iterations
    assert not at_limit.stopped
    for later in (21.0, 100.0, 86400.0):
        p = tr.progress("a", t + later)
        assert p.stopped
        assert p.rate == at_limit.rate


def resumed_rates(gap: float, *, after: float = 5.0) -> dict[str, float | None]:
    """Two jobs that run alike at 1 s per iteration; ``a`` stops for ``gap`` seconds after
    60 s (SIGSTOP, a debugger) and runs on; rates ``after`` seconds after it resumed."""
    tr = ProgressTracker()
    for job in "ab":
        tr.register(job, now=0.0, ideal_s=0.5)
    t = steady(tr, "a", 1.0, 60)
    now = t + gap + after
    steady(tr, "a", 1.0, int(after), t0=t + gap, start=61)
    steady(tr, "b", 1.0, int(now))
    return tr.rates(now)


def test_a_job_stopped_for_minutes_is_not_ranked_slowest_once_it_runs_again() -> None:
    # the stop counts as the gap limit (20 spacings: 20 s) in a's window and long-run
    # rate, not as ten minutes: a comes back ranked as after a 20 s stop, and about as b
    # (alike, never stopped) once its window has moved past it; it ranked far below b
    # for minutes
    soon, later = resumed_rates(600.0), resumed_rates(600.0, after=30.0)
    assert soon["a"] == pytest.approx(resumed_rates(20.0)["a"])
    assert soon["a"] is not None and soon["a"] > 0.4 * 0.5
    assert later["b"] == pytest.approx(0.5)
    assert later["a"] is not None and later["a"] > 0.9 * later["b"]


@settings(max_examples=40, deadline=None)
@given(gaps=st.lists(st.floats(25.0, 1e5), min_size=2, max_size=2), after=st.floats(0.0, 30.0))
def test_how_long_a_job_stopped_beyond_the_gap_limit_changes_nothing(
    gaps: list[float], after: float
) -> None:
    first, second = (resumed_rates(g, after=after)["a"] for g in gaps)
    assert first == pytest.approx(second, rel=1e-9)


def suspended_rates(
    suspend: float, *, skip: bool, paces: dict[str, float] | None = None
) -> dict[str, float | None]:
    """Jobs of different paces on one node, suspended for ``suspend`` seconds at t = 100
    (the reports carry the wall clock, which runs on through a suspend); rates 30 s after
    the resume."""
    tr = ProgressTracker()
    paces = paces or {"a": 0.1, "b": 1.0, "c": 4.0}
    for job in paces:
        tr.register(job, now=0.0, ideal_s=0.1)
    for job, pace in paces.items():
        steady(tr, job, pace, int(100 / pace))
    if skip:
        tr.skip(100.0, 100.0 + suspend)
    for job, pace in paces.items():
        n = int(100 / pace)
        steady(tr, job, pace, int(30 / pace), t0=100.0 + suspend, start=n)
    return tr.rates(130.0 + suspend)


def test_a_suspend_of_the_node_is_cut_out_of_every_job() -> None:
    unbroken = suspended_rates(0.0, skip=False)
    resumed = suspended_rates(3600.0, skip=True)
    assert resumed == pytest.approx(unbroken)


@settings(max_examples=40, deadline=None)
@given(
    paces=st.lists(st.floats(0.05, 10.0), min_size=1, max_size=4),
    suspend=st.floats(1.0, 1e6),
)
def test_how_long_the_node_slept_changes_no_rate(paces: list[float], suspend: float) -> None:
    jobs = {f"j{i}": p for i, p in enumerate(paces)}
    unbroken = suspended_rates(0.0, skip=False, paces=jobs)
    assert suspended_rates(suspend, skip=True, paces=jobs) == pytest.approx(unbroken, rel=1e-6)


def test_a_report_stamped_before_a_skip_that_arrives_after_it_is_moved_too() -> None:
    tr = ProgressTracker(WINDOW_ONLY)
    steady(tr, "a", 1.0, 10)
    # the node slept for 1000 s after iteration 11's report was stamped, and gpud saw it
    # at 1011.2: before it took that report (buffered by the job, sent after the resume)
    tr.skip(11.2, 1011.2)
    tr.report("a", 11, 11.0)
    tr.report("a", 12, 1011.5)  # 12.0 had the node not slept: 0.5 s after iteration 11
    p = tr.progress("a", 1011.5)
    assert p.iterations == 12
    assert p.ideal_s == pytest.approx(0.5)  # iteration 12 alone, not 11 and 12 in 1.5 s
