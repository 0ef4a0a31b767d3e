"""The baselines' readings, Sincronia's ties and re-ordering, Crux's priority and
compression, CASSINI's time shifts, and the suite's best-reading comparison."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest

from tools.netsim.cassini import plan_shifts, unified_circle
from tools.netsim.compare import best_reading, summary
from tools.netsim.engine import Decision, Simulation, View, job_infos
from tools.netsim.metrics import geomean, peak_jobs, positive_geomean, run_scenario
from tools.netsim.policies import (
    BASELINES,
    SincroniaPolicy,
    bssi_order,
    contention_aware_levels,
    crux_priority,
    expand,
    make_policy,
    top_levels,
)
from tools.netsim.scenario import from_dict

GB = 1e9


def scenario(jobs: list[dict[str, Any]], **kw: Any) -> Any:
    raw = {
        "name": kw.pop("name", "t"),
        "duration_s": kw.pop("duration_s", 60.0),
        "warmup_s": kw.pop("warmup_s", 10.0),
        "links": kw.pop("links", {"l": {"gbps": 100}}),
        "jobs": jobs,
        **kw,
    }
    return from_dict(raw)


def twins(**kw: Any) -> Any:
    job = {"compute_s": 0.5, "flows": [{"bytes": 6.25 * GB, "path": ["l"]}]}
    return scenario([{"id": "a", **job}, {"id": "b", **job}], **kw)


def test_every_reading_exists_and_families_expand() -> None:
    assert BASELINES["sincronia"] == (
        "sincronia-even",
        "sincronia-even-strict",
        "sincronia-top",
        "sincronia-top-strict",
    )
    assert "crux-aware-strict" in BASELINES["crux"]
    assert expand(["fair", "crux", "crux-top"]) == ["fair", *BASELINES["crux"]]
    for name in expand(["fair", "sincronia", "crux", "cassini", "leveller"]):
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("crux-sideways")


def test_top_reading_gives_the_first_k_minus_1_their_own_levels() -> None:
    order = [f"j{i}" for i in range(6)]
    assert list(top_levels(order, 4).values()) == [0, 1, 2, 3, 3, 3]


def test_contention_aware_compression_shares_levels_only_between_strangers() -> None:
    links = {"a": frozenset({"x"}), "b": frozenset({"x"}), "c": frozenset({"y"})}
    prio = {"a": 3.0, "b": 2.0, "c": 1.0}
    # c meets nobody: it shares the top level instead of taking a third one.
    assert contention_aware_levels(["a", "b", "c"], links, prio, 2) == {"a": 0, "b": 1, "c": 0}


def test_contention_aware_compression_merges_the_closest_priorities() -> None:
    links = dict.fromkeys("abcd", frozenset({"x"}))
    prio = {"a": 100.0, "b": 10.0, "c": 9.0, "d": 1.0}
    levels = contention_aware_levels(["a", "b", "c", "d"], links, prio, 3)
    assert levels == {"a": 0, "b": 1, "c": 1, "d": 2}
    # Never an inversion between contending jobs.
    order = "abcd"
    assert all(levels[x] <= levels[y] for x, y in pairwise(order))


def test_bssi_breaks_ties_by_arrival_oldest_first() -> None:
    demand = {"new": {"x": 1.0}, "old": {"x": 1.0}}
    assert bssi_order(demand, {"new": (5.0,), "old": (2.0,)}) == ["old", "new"]
    assert bssi_order(demand, {"new": (1.0,), "old": (2.0,)}) == ["new", "old"]


def test_sincronia_reorders_on_coflow_arrivals_and_completions() -> None:
    calls: list[float] = []

    class Recording(SincroniaPolicy):
        def decide(self, now: float, view: View) -> Decision:
            calls.append(now)
            return super().decide(now, view)

    sc = scenario(
        [{"id": "a", "compute_s": 0.25, "flows": [{"bytes": 1 * GB, "path": ["l"]}]}],
        duration_s=3.0,
        warmup_s=0.0,
    )
    Simulation(sc, Recording()).run()
    off_tick = [t for t in calls if abs(t - round(t)) > 1e-9]
    # Comm starts at 0.25 and ends at 0.33 in the first iteration: both are decision points.
    assert pytest.approx(0.25) in off_tick and pytest.approx(0.25 + 0.08) in off_tick


def test_sincronia_levels_only_coflows_in_flight() -> None:
    sc = twins(duration_s=2.0, warmup_s=0.0)
    sim = Simulation(sc, make_policy("sincronia-even"))
    # Before any job communicates, nobody holds a high level.
    assert SincroniaPolicy().decide(0.0, sim).levels == {}


def test_crux_priority_uses_gpus_and_the_exposed_share_of_communication() -> None:
    sc = scenario(
        [
            {"id": "big", "compute_s": 1.0, "gpus": 64, "flows": [{"bytes": GB, "path": ["l"]}]},
            {"id": "small", "compute_s": 1.0, "gpus": 8, "flows": [{"bytes": GB, "path": ["l"]}]},
            {
                "id": "hidden",
                "compute_s": 1.0,
                "gpus": 64,
                "overlap": 1.0,
                "flows": [{"bytes": GB, "path": ["l"]}],
            },
        ]
    )
    sim = Simulation(sc, make_policy("crux-even"))
    big, small, hidden = (crux_priority(sim, j) for j in ("big", "small", "hidden"))
    assert big == pytest.approx(8 * small)
    assert hidden == pytest.approx(0.05 * big)  # fully overlapped: correction floor


def test_pacing_starts_iterations_on_the_grid() -> None:
    class Paced:
        name = "paced"
        reorder_on_coflows = False

        def decide(self, now: float, view: View) -> Decision:
            return Decision(levels={"a": 0}, pace={"a": (0.3, 2.0)})

    sc = scenario([{"id": "a", "compute_s": 1.0}], duration_s=8.5, warmup_s=0.0)
    run = Simulation(sc, Paced()).run()
    # First iteration unpaced (0 -> 1); then slots 2.3, 4.3, 6.3.
    assert run.jobs["a"].completions == pytest.approx((1.0, 3.3, 5.3, 7.3))


def test_cassini_interleaves_twins_that_fair_sharing_keeps_in_step() -> None:
    sc = twins(duration_s=60.0, warmup_s=10.0)
    infos = job_infos(sc)
    pace = plan_shifts(0.0, infos, {"l": sc.link_bytes_per_s("l")})
    assert sorted(pace) == ["a", "b"]
    assert abs(pace["a"][0] - pace["b"][0]) == pytest.approx(0.5, abs=0.01)
    report = run_scenario(sc, ["fair", "cassini"])
    assert report.policies["fair"].min_progress == pytest.approx(2 / 3, abs=0.02)
    assert report.policies["cassini"].min_progress == pytest.approx(1.0, abs=0.02)


def test_unified_circle_prefers_the_least_stretch() -> None:
    perimeter, reps = unified_circle({"a": 1.0, "b": 2.0})
    assert perimeter == 2.0 and reps == {"a": 2, "b": 1}


def test_geomean_does_not_floor_zeros() -> None:
    assert geomean([0.5, 0.0]) == 0.0
    assert positive_geomean([0.25, 1.0, 0.0]) == (pytest.approx(0.5), 1)


def test_peak_jobs_counts_jobs_present_at_once() -> None:
    sc = scenario(
        [
            {"id": "a", "compute_s": 1.0, "stop_s": 10.0},
            {"id": "b", "compute_s": 1.0, "start_s": 10.0},
            {"id": "c", "compute_s": 1.0, "start_s": 5.0},
        ]
    )
    assert peak_jobs(sc) == 2


def test_summary_compares_with_the_best_reading_per_group() -> None:
    reports = [run_scenario(twins(name="twins", duration_s=30.0, warmup_s=5.0))]
    found = best_reading(reports[0], "best", "min_progress")
    assert found is not None and found[1] >= reports[0].policies["fair"].min_progress
    s = summary(reports)
    assert set(s["groups"]) == {"all", "n<=K"}
    over = s["groups"]["all"]["leveller_min_progress_over"]
    assert {"fair", "sincronia", "crux", "cassini", "best", "best-prio", "bound"} <= set(over)
    assert {t["target"] for t in s["targets"]} >= {"min_progress >= 1.57 x best baseline reading"}
