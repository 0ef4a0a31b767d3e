"""The admission benchmark and its simulator, on a small run."""

from __future__ import annotations

import json
import random

import pytest

from gpud.admission.estimate import Record, estimate
from gpud.admission.model import Request
from gpud.admission.node import synthetic
from gpud.admission.placement_fit import PlacementFit
from tools.admission.__main__ import main
from tools.admission.bench import _controlled_mean, _half_width, _history, _Replication
from tools.admission.reference import mgk_fifo_mean_wait
from tools.admission.sim import SimJob, simulate

GIB = 1 << 30


def test_two_jobs_for_one_gpu_run_one_after_the_other() -> None:
    fit = PlacementFit(synthetic("H100-SXM5-80GB", 1))
    whole = Request(gpu_count=1, memory_bytes=60 * GIB)
    out = simulate([SimJob("a", "w", whole, 0.0, 10.0), SimJob("b", "w", whole, 1.0, 5.0)], fit)
    by = {r.job: r for r in out.records}
    assert (by["a"].started_at, by["a"].ended_at) == (0.0, 10.0)
    assert (by["b"].started_at, by["b"].ended_at) == (10.0, 15.0)
    assert out.queue_area == pytest.approx(9.0)


def test_bench_prints_the_documented_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--json", "--jobs", "400", "--replications", "3", "--workers", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"utilizations", "wait_slope", "pass_ms"}
    assert set(result["utilizations"]) == {"0.5", "0.7", "0.8", "0.9", "0.95"}
    for row in result["utilizations"].values():
        assert set(row) == {"littles_residual", "quote_over_observed", "backfill_over_fifo_wait"}
        assert row["littles_residual"] < 0.01


def test_detail_reports_each_class_mean_wait_with_its_interval(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "--json", "--detail", "--jobs", "300", "--replications", "2"]
    assert main([*argv, "--workers", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    for row in result["utilizations"].values():
        assert row["max_half_width_ratio"] >= 0.0
        for c in row["classes"].values():
            lo, hi = c["observed_ci95_s"]
            assert lo <= c["observed_s"] <= hi
            if c["quote_s"] is not None and c["observed_s"] > 0:
                assert c["quote_above_interval"] == (c["quote_s"] >= hi)
                assert c["quote_over_observed_upper"] <= c["quote_over_observed"]


def test_half_width_is_the_student_t_interval_over_replication_means() -> None:
    assert _half_width([1.0]) == float("inf")
    # Two means 2 apart: sd = sqrt(2), t(1) = 12.706.
    assert _half_width([1.0, 3.0]) == pytest.approx(12.706 * 2**0.5 / 2**0.5)
    assert _half_width([5.0] * 40) == 0.0


def test_utilizations_are_chosen_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--json", "--jobs", "200", "--replications", "2", "--workers", "1"]
    assert main([*argv, "--utilizations", "0.6,0.85"]) == 0
    assert set(json.loads(capsys.readouterr().out)["utilizations"]) == {"0.6", "0.85"}
    with pytest.raises(SystemExit):
        main([*argv, "--utilizations", "0.5,1.2"])
    assert "--utilizations" in capsys.readouterr().err


def test_control_variate_reads_the_regression_at_the_target_load() -> None:
    # Waits exactly linear in the drawn load: the intercept, with no residual.
    xs = [-0.02, 0.01, 0.03, -0.01, 0.02]
    ys = [100.0 + 5000.0 * x for x in xs]
    mean, half = _controlled_mean(ys, xs)
    assert mean == pytest.approx(100.0)
    assert half == pytest.approx(0.0, abs=1e-9)
    # Their plain mean is pulled up by the sequences that drew more than the target's load.
    assert sum(ys) / len(ys) == pytest.approx(130.0)
    # Too few points for the slope to pay for itself, or a control that never moved: the
    # plain mean and its interval.
    assert _controlled_mean(ys[:4], xs[:4]) == (112.5, _half_width(ys[:4]))
    assert _controlled_mean([1.0, 2.0, 3.0] * 2, [0.0] * 6) == (
        2.0,
        _half_width([1.0, 2.0, 3.0] * 2),
    )
    # Noise around the line: the interval is the intercept's (n - 2 degrees of freedom).
    xs = [-1.0, 0.0, 0.5, 1.0, 0.0]
    ys = [1.0, 2.5, 2.9, 4.2, 2.4]
    mean, half = _controlled_mean(ys, xs)
    mx, my = 0.1, 2.6
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    assert mean == pytest.approx(my - slope * mx)
    sse = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
    assert half == pytest.approx(3.182 * (sse / 3 * (1 / 5 + mx**2 / sxx)) ** 0.5)


def _rep(arrivals: list[float], service: float) -> _Replication:
    records = [Record(f"j{i}", "w", t, t, t + service) for i, t in enumerate(arrivals)]
    end = arrivals[-1] + 10 * service  # a long drain after the last arrival
    return _Replication({}, {}, 0.0, records, arrivals[0], end, 0.0, [], [])


def test_histories_are_laid_end_to_end_on_the_arrival_clock() -> None:
    reps = [_rep([0.0, 1.0, 2.0, 3.0, 4.0], 50.0), _rep([100.0, 102.0, 104.0], 50.0)]
    history, now = _history(reps)
    # Each sequence starts one mean inter-arrival time after the last arrival of the one
    # before; its drain overlaps what follows instead of adding time with no arrivals.
    assert [r.queued_at for r in history] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 9.0]
    assert now == pytest.approx(11.0)
    # the first arrival opens the history: seven arrivals over the 11 s after it
    assert estimate(history, now=now)["w"].arrival_rate == pytest.approx(7 / 11)


def test_reference_simulation_meets_the_exact_single_server_waits() -> None:
    # M/M/1 at 0.5: W = rho / (1 - rho) S = S; M/G/1 with cs2 4 (Pollaczek-Khinchine): 2.5 S.
    mm1 = mgk_fifo_mean_wait(1, 0.5, 1.0, 1.0, jobs=200_000, rng=random.Random(3))
    assert mm1 == pytest.approx(1.0, rel=0.1)
    mg1 = mgk_fifo_mean_wait(1, 0.5, 1.0, 2.0, jobs=200_000, rng=random.Random(4))
    assert mg1 == pytest.approx(2.5, rel=0.15)


def test_reference_prints_formula_over_exact_per_class(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["reference", "--json", "--jobs", "500", "--replications", "2"]
    assert main([*argv, "--utilizations", "0.5,0.7"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["classes"]) == {"1gpu", "3g.40gb", "1g.10gb", "2g.20gb/2"}
    assert result["classes"]["1gpu"]["k_eff"] == 5
    for c in result["classes"].values():
        row = c["utilizations"]["0.7"]
        assert row["formula_over_reference"] == pytest.approx(row["formula_s"] / row["reference_s"])
    assert set(result["utilizations"]) == {"0.5", "0.7"}
    with pytest.raises(SystemExit):
        main([*argv, "--warmup", "1.0"])
    assert "--warmup" in capsys.readouterr().err
