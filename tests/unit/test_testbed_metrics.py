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


def _phase(progress: dict[str, float]) -> dict[str, object]:
    return {
        "min_progress": min(progress.values()),
        "jain": 1.0,
        "efficiency": 1.0,
        "progress": progress,
    }


def test_a_phase_with_a_stalled_job_is_flagged() -> None:
    from tools.testbed.run import aggregate, stalled

    good = {
        "ceiling": 0.48,
        "baseline": _phase({"a": 0.48, "b": 0.49}),
        "gpud": _phase({"a": 0.48, "b": 0.48}),
    }
    bad = {
        "ceiling": 0.48,
        "baseline": _phase({"a": 0.05, "b": 0.70}),
        "gpud": _phase({"a": 0.48, "b": 0.48}),
    }
    assert stalled(bad["baseline"], 0.48) == ["a"] and stalled(good["baseline"], 0.48) == []
    out = aggregate([{"mixes": {"m": good}}, {"mixes": {"m": bad}}])["m"]
    assert out["baseline"]["stalled_runs"] == [1] and out["gpud"]["stalled_runs"] == []


def test_set_names_the_bad_knob(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.testbed.run import main

    for bad, said in (
        ("nope=1", "KEY one of"),
        ("hysteresis=x", "not a number"),
        ("levels=3", "KEY one of"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["run", "--set", bad])
        assert exit_.value.code == 2 and said in capsys.readouterr().err
