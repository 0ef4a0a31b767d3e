"""The admission benchmark and its simulator, on a small run."""

from __future__ import annotations

import json

import pytest

from gpud.admission.model import Request
from gpud.admission.node import synthetic
from gpud.admission.placement_fit import PlacementFit
from tools.admission.__main__ import main
from tools.admission.bench import _half_width
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
