"""The testbed's mixes as fluid scenarios, and the side-by-side table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tools.netsim.cli import main
from tools.netsim.scenario import ScenarioError, from_dict
from tools.netsim.testbed import compare, scenario, scenarios

JOBS = [
    {"name": "solo", "conns": 1, "nbytes": 6_000_000, "compute_s": 0.06},
    {"name": "wide", "conns": 16, "nbytes": 6_000_000, "compute_s": 0.06},
]
TRAFFIC = {"levels": 4, "progress_window_s": 2.0, "max_age_s": 1.0, "threshold": 0.05}


def result_file(tmp_path: Path) -> Path:
    doc: dict[str, Any] = {
        "setup": {
            "rate_bps": 400e6,
            "seconds": 20.0,
            "warmup": 5.0,
            "mixes": {"pair": JOBS},
            "gpud_traffic": TRAFFIC,
        },
        "mixes": {
            "pair": {
                "ceiling": 0.49,
                "baseline": {"min_progress": 0.2, "jain": 0.8, "efficiency": 0.9},
                "gpud": {"min_progress": 0.45, "jain": 0.99, "efficiency": 0.93},
            }
        },
    }
    mix = doc["mixes"]["pair"]
    doc["runs"] = [{"cc": cc, "mixes": {"pair": mix}} for cc in ("default (bbr)", "cubic")]
    path = tmp_path / "tb.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_mix_becomes_one_link_with_the_testbed_knobs() -> None:
    sc = scenario("pair", JOBS, TRAFFIC)
    assert sc.links == {"bottleneck": 0.4} and sc.levels == 4
    assert sc.leveller == {"progress_window_s": 2.0, "max_age_s": 1.0, "threshold": 0.05}
    wide = sc.jobs[1]
    assert wide.flows[0].count == 16 and wide.flows[0].bytes * 16 == 6_000_000
    assert from_dict(sc.to_dict()) == sc


def test_gpud_ticks_as_often_as_in_the_testbed(tmp_path: Path) -> None:
    from tools.testbed.run import GPUD_TICK_S

    assert scenario("pair", JOBS, TRAFFIC).update_interval_s == GPUD_TICK_S == 0.2
    doc = json.loads(result_file(tmp_path).read_text())
    assert [sc.update_interval_s for sc in scenarios(doc)] == [0.2]  # files from before it
    doc["setup"]["gpud_tick_s"] = 0.5
    assert [sc.update_interval_s for sc in scenarios(doc)] == [0.5]


def test_default_mixes_come_from_the_testbed() -> None:
    from tools.testbed.run import MIXES

    assert [sc.name for sc in scenarios()] == [f"testbed-{m}" for m in MIXES]


def test_fluid_figures_sit_beside_the_kernel_ones(tmp_path: Path) -> None:
    rows = compare(json.loads(result_file(tmp_path).read_text()))
    row = rows["pair"]
    assert row["kernel"]["gpud"]["min_progress"] == 0.45
    assert set(row["kernel_by_cc"]) == {"default (bbr)", "cubic"}
    assert row["kernel_by_cc"]["cubic"]["runs"] == 1
    fluid = row["fluid"]
    # Per-flow sharing gives the one-connection job 1/17 of the link while both send.
    assert fluid["baseline"]["min_progress"] < 0.8 * fluid["gpud"]["min_progress"]
    assert fluid["gpud"]["min_progress"] <= fluid["ceiling"] + 0.02
    assert 0.5 < fluid["gpud"]["efficiency"] <= 1.05


def test_testbed_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["testbed", "--results", str(result_file(tmp_path)), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "kernel (2)" in out and "cubic (1)" in out and "fluid" in out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["testbed", "--results", str(bad)]) == 2


def test_unknown_leveller_knob_is_refused() -> None:
    raw = {
        "name": "t",
        "links": {"l": {"gbps": 1}},
        "jobs": [{"id": "a", "compute_s": 1}],
        "leveller": {"speed": 2},
    }
    with pytest.raises(ScenarioError) as info:
        from_dict(raw)
    assert info.value.where == "leveller"


def test_testbed_mixes_run_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    assert "testbed-unfair" in capsys.readouterr().out
    assert main(["run", "testbed-equal", "--policies", "fair,leveller", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["scenario"] == "testbed-equal"
