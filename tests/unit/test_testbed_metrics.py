"""The testbed's figures from completion times (pure)."""

from __future__ import annotations

import pytest

from tools.testbed.metrics import JobSpec, ceiling, jain, parse_jobs, progress, series, summarize


def test_parse_jobs() -> None:
    jobs = parse_jobs("a:1:4:40, b:16:0.5:0")
    assert jobs == [JobSpec("a", 1, 4_000_000, 0.04), JobSpec("b", 16, 500_000, 0.0)]
    for bad in ("a:1:4", "a:x:4:40", "a:0:4:40", "a:1:4:40,a:2:4:40", ""):
        with pytest.raises(ValueError):
            parse_jobs(bad)


def test_progress_ceiling_and_jain() -> None:
    # 10 iterations in 10 s, 0.5 s each alone: progress 0.5
    assert progress([float(t) for t in range(1, 11)], 0.5, 0.0, 10.0) == pytest.approx(0.5)
    jobs = [JobSpec("a", 1, 1_000_000, 0.0), JobSpec("b", 8, 1_000_000, 0.0)]
    ideal = {"a": 0.1, "b": 0.1}  # each wants 80 Mbit/s alone
    assert ceiling(jobs, ideal, 80e6) == pytest.approx(0.5)
    assert ceiling(jobs, ideal, 1e9) == 1.0
    assert jain([1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0]) == pytest.approx(0.5)


def test_summarize_and_series() -> None:
    jobs = [JobSpec("a", 1, 1_000_000, 0.0), JobSpec("b", 8, 1_000_000, 0.0)]
    times = {"a": [0.5 * i for i in range(1, 21)], "b": [0.25 * i for i in range(1, 41)]}
    out = summarize(jobs, times, {"a": 0.25, "b": 0.25}, 80e6, t0=0.0, t1=10.0)
    assert out["progress"] == {"a": 0.5, "b": 1.0}
    assert out["min_progress"] == 0.5
    assert out["efficiency"] == pytest.approx((20 + 40) * 8e6 / (80e6 * 10))
    points = series(times["a"], 0.25, 0.0, 3.0)
    assert [p[0] for p in points] == [1.0, 2.0, 3.0]
    assert all(p[1] == pytest.approx(0.5) for p in points)


def test_iterations_straddling_the_window_count_by_fraction() -> None:
    from tools.testbed.metrics import completed

    times = [1.0, 2.0, 3.0, 4.0]
    assert completed(times, 2.5) == 2.5 and completed(times, 0.5) == 0.0
    assert completed(times, 9.0) == 4.0
    assert progress(times, 1.0, 1.5, 3.5) == pytest.approx(1.0)
