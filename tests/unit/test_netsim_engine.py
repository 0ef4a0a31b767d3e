"""The flow-level simulator: scenarios, job iterations, policies, metrics, the bound."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tools.netsim.bound import fluid_bound
from tools.netsim.engine import Simulation, job_infos
from tools.netsim.metrics import jain, run_scenario
from tools.netsim.policies import bssi_order, make_policy
from tools.netsim.scenario import ScenarioError, from_dict, load
from tools.netsim.suite import BUILTIN, all_builtin

GB = 1e9


def scenario(jobs: list[dict[str, Any]], **kw: Any) -> Any:
    raw = {
        "name": "t",
        "duration_s": kw.pop("duration_s", 60.0),
        "warmup_s": kw.pop("warmup_s", 0.0),
        "links": kw.pop("links", {"l": {"gbps": 80}}),  # 10 GB/s
        "jobs": jobs,
        **kw,
    }
    return from_dict(raw)


def test_ideal_time_with_overlap_and_shared_own_links() -> None:
    sc = scenario(
        [
            {"id": "a", "compute_s": 1.0, "flows": [{"bytes": 10 * GB, "path": ["l"]}]},
            {
                "id": "b",
                "compute_s": 1.0,
                "overlap": 0.5,
                "flows": [{"bytes": 10 * GB, "path": ["l"]}],
            },
            {"id": "c", "compute_s": 0.0, "flows": [{"bytes": 5 * GB, "path": ["l"], "count": 2}]},
        ]
    )
    infos = job_infos(sc)
    assert infos["a"].ideal_s == pytest.approx(2.0)
    assert infos["b"].ideal_s == pytest.approx(1.5)  # half of 1 s hidden under compute
    assert infos["c"].ideal_s == pytest.approx(1.0)
    assert infos["c"].link_bytes == {"l": 10 * GB}


def test_a_job_alone_runs_at_full_rate_under_every_policy() -> None:
    sc = scenario([{"id": "a", "compute_s": 0.5, "flows": [{"bytes": 5 * GB, "path": ["l"]}]}])
    report = run_scenario(sc)
    for m in report.policies.values():
        assert m.min_progress == pytest.approx(1.0, abs=0.02)
    assert report.bound.min_progress == 1.0


def test_two_identical_jobs_share_fairly() -> None:
    job = {"compute_s": 0.0, "flows": [{"bytes": 10 * GB, "path": ["l"]}]}
    sc = scenario([{"id": "a", **job}, {"id": "b", **job}])
    fair = run_scenario(sc, ["fair"]).policies["fair"]
    assert fair.jobs["a"] == pytest.approx(0.5, abs=0.02)
    assert fair.jain == pytest.approx(1.0)


def test_iterations_and_stop_end_jobs() -> None:
    sc = scenario(
        [
            {"id": "n", "compute_s": 1.0, "iterations": 5},
            {"id": "s", "compute_s": 1.0, "start_s": 10.0, "stop_s": 20.5},
        ]
    )
    run = Simulation(sc, make_policy("fair")).run()
    assert run.jobs["n"].completions == (1.0, 2.0, 3.0, 4.0, 5.0)
    assert run.jobs["n"].end_s == 5.0
    assert len(run.jobs["s"].completions) == 10 and run.jobs["s"].end_s == 20.5


def test_runs_are_deterministic() -> None:
    sc = BUILTIN["two-tors"]()
    short = from_dict({**sc.to_dict(), "duration_s": 80.0, "warmup_s": 10.0})
    a = run_scenario(short).to_dict()
    b = run_scenario(short).to_dict()
    assert a == b


def test_leveller_lifts_the_job_that_fair_sharing_starves() -> None:
    # One flow against eight: per-flow fairness leaves the single-flow job far behind.
    sc = scenario(
        [
            {"id": "one", "compute_s": 0.2, "flows": [{"bytes": 4 * GB, "path": ["l"]}]},
            {
                "id": "eight",
                "compute_s": 0.2,
                "flows": [{"bytes": 0.5 * GB, "path": ["l"], "count": 8}],
            },
        ],
        duration_s=120.0,
        warmup_s=20.0,
    )
    report = run_scenario(sc, ["fair", "leveller"])
    assert report.policies["leveller"].min_progress > 1.2 * report.policies["fair"].min_progress
    assert report.policies["leveller"].jain > report.policies["fair"].jain


def test_bound_handles_arrivals_and_limits() -> None:
    sc = scenario(
        [
            {"id": "a", "compute_s": 0.0, "flows": [{"bytes": 10 * GB, "path": ["l"]}]},
            {
                "id": "b",
                "compute_s": 0.0,
                "start_s": 30.0,
                "flows": [{"bytes": 10 * GB, "path": ["l"]}],
            },
        ]
    )
    bound = fluid_bound(sc)
    assert bound.jobs["a"] == pytest.approx(0.75)  # 1 alone, then 0.5
    assert bound.jobs["b"] == pytest.approx(0.5)
    limited = scenario(
        [
            {
                "id": "a",
                "compute_s": 0.0,
                "iterations": 10,
                "flows": [{"bytes": 10 * GB, "path": ["l"]}],
            },
            {"id": "b", "compute_s": 0.0, "flows": [{"bytes": 10 * GB, "path": ["l"]}]},
        ]
    )
    # a finishes its 10 iterations at 20 s at rate 0.5; b then runs alone.
    assert fluid_bound(limited).jobs["b"] == pytest.approx((0.5 * 20 + 40) / 60)


def test_bssi_puts_the_biggest_job_on_the_bottleneck_last() -> None:
    order = bssi_order({"big": {"x": 5.0}, "small": {"x": 1.0}, "other": {"y": 2.0}})
    assert order.index("small") < order.index("big")
    assert sorted(order) == ["big", "other", "small"]


def test_jain_index() -> None:
    assert jain([1.0, 1.0]) == 1.0
    assert jain([1.0, 0.0]) == 0.5
    assert jain([]) == 0.0


@pytest.mark.parametrize(
    ("patch", "where"),
    [
        ({"links": {}}, "links"),
        (
            {"jobs": [{"id": "a", "compute_s": 1, "flows": [{"bytes": 1, "path": ["nope"]}]}]},
            "jobs[0].flows[0].path",
        ),
        ({"jobs": [{"id": "a", "compute_s": 1, "overlap": 2}]}, "jobs[0].overlap"),
        ({"jobs": [{"id": "a", "compute_s": 1}, {"id": "a", "compute_s": 1}]}, "jobs[1].id"),
        ({"jobs": [{"id": "a", "compute_s": 1, "start_s": 5, "stop_s": 5}]}, "jobs[0].stop_s"),
        ({"levels": 9}, "levels"),
        ({"warmup_s": 100}, "warmup_s"),
    ],
)
def test_scenario_errors_name_the_field(patch: dict[str, Any], where: str) -> None:
    raw = {
        "name": "t",
        "duration_s": 60,
        "links": {"l": {"gbps": 1}},
        "jobs": [{"id": "a", "compute_s": 1}],
    }
    raw.update(patch)
    with pytest.raises(ScenarioError) as info:
        from_dict(raw)
    assert info.value.where == where


def test_builtin_suite_round_trips_and_covers_the_brief(tmp_path: Path) -> None:
    scenarios = all_builtin()
    assert len(scenarios) >= 12
    sizes = [len(s.jobs) for s in scenarios]
    assert min(sizes) == 2 and max(sizes) == 32
    assert {len(s.links) for s in scenarios} >= {1, 2, 3, 4}
    for sc in scenarios:
        path = tmp_path / f"{sc.name}.json"
        path.write_text(json.dumps(sc.to_dict()))
        assert load(path) == sc


@pytest.mark.parametrize("per_job", [False, True])
def test_a_level_is_shared_per_flow_or_per_job(per_job: bool) -> None:
    from tools.netsim.engine import Decision, View

    class OneLevel:
        name = "one-level"
        reorder_on_coflows = False

        def decide(self, now: float, view: View) -> Decision:
            return Decision(levels=dict.fromkeys(view.active_jobs(), 0), per_job=per_job)

    # no compute: both jobs always send; one flow against eight on one link
    sc = scenario(
        [
            {"id": "one", "compute_s": 0.0, "flows": [{"bytes": GB, "path": ["l"]}]},
            {
                "id": "wide",
                "compute_s": 0.0,
                "flows": [{"bytes": GB / 8, "path": ["l"], "count": 8}],
            },
        ],
        duration_s=20.0,
    )
    run = Simulation(sc, OneLevel()).run()
    one, wide = (len(run.jobs[j].completions) for j in ("one", "wide"))
    if per_job:  # gpud's tree: a leaf per job, equal quanta
        assert one == pytest.approx(wide, abs=1)
    else:  # the kernel's default qdisc: per flow
        assert wide == pytest.approx(8 * one, rel=0.15)


def test_the_upper_bound_holds_with_churn_where_the_piecewise_one_does_not() -> None:
    # a is alone for half the window, then b joins: the piecewise max-min gives b 0.5, but a
    # schedule giving b 2/3 while they compete leaves a at (1 + 1/3) / 2 = 2/3 as well
    sc = scenario(
        [
            {"id": "a", "compute_s": 0.0, "flows": [{"bytes": 10 * GB, "path": ["l"]}]},
            {
                "id": "b",
                "compute_s": 0.0,
                "start_s": 50.0,
                "flows": [{"bytes": 10 * GB, "path": ["l"]}],
            },
        ],
        duration_s=100.0,
    )
    b = fluid_bound(sc)
    assert b.min_progress == pytest.approx(0.5)
    assert b.upper == pytest.approx(2 / 3)
    # constant membership: the two agree
    steady = scenario(
        [
            {"id": "a", "compute_s": 0.0, "flows": [{"bytes": 10 * GB, "path": ["l"]}]},
            {"id": "b", "compute_s": 1.0, "flows": [{"bytes": 10 * GB, "path": ["l"]}]},
        ]
    )
    s = fluid_bound(steady)
    assert s.upper == pytest.approx(s.min_progress)
    for sc in all_builtin():
        bound = fluid_bound(sc)
        assert bound.upper <= 1.0
