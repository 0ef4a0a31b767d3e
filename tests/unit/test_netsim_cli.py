"""The netsim command line: run, suite, list, export, plot errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.netsim.cli import main

SMALL = {
    "name": "small",
    "duration_s": 40,
    "warmup_s": 5,
    "links": {"l": {"gbps": 100}},
    "jobs": [
        {"id": "a", "compute_s": 0.2, "flows": [{"bytes": 2e9, "path": ["l"]}]},
        {"id": "b", "compute_s": 0.5, "flows": [{"bytes": 1e9, "path": ["l"], "count": 4}]},
    ],
}


def test_run_json_has_the_documented_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps(SMALL))
    assert main(["run", str(path), "--json", "--policies", "fair,leveller"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["scenario"] == "small"
    assert set(doc["policies"]) == {"fair", "leveller"}
    for m in doc["policies"].values():
        assert set(m) == {
            "min_progress",
            "mean_progress",
            "jain",
            "efficiency",
            "level_changes",
            "jobs",
        }
        assert set(m["jobs"]) == {"a", "b"}
    assert set(doc["bound"]) == {"min_progress", "upper", "jobs"}


def test_run_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps(SMALL))
    assert main(["run", str(path)]) == 0
    out = capsys.readouterr().out
    assert "leveller" in out and "bound" in out


def test_suite_json_with_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["suite", "--json", "--only", "pair-one-link"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc["scenarios"]) == ["pair-one-link"]
    assert {t["target"] for t in doc["summary"]["targets"]} >= {"min_progress >= 0.85 x bound"}


def test_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tmp_path / "missing.json")]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["run", str(bad)]) == 2
    assert main(["run", "pair-one-link", "--policies", "nope"]) == 2
    assert "netsim:" in capsys.readouterr().err


def test_list_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    assert "cluster-32" in capsys.readouterr().out
    assert main(["export", str(tmp_path)]) == 0
    assert (tmp_path / "cluster-32.json").exists()


def test_suite_table_quotes_best_readings_per_group(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["suite", "--only", "phase-pair", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "best reading per scenario" in out and "[n<=K]" in out
    assert "bound over best reading" in out
    assert main(["suite", "--only", "phase-pair", "--workers", "0"]) == 2


def test_family_names_expand_to_their_readings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "phase-pair", "--json", "--policies", "sincronia,cassini"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["policies"]) == {
        "sincronia-even",
        "sincronia-even-strict",
        "sincronia-top",
        "sincronia-top-strict",
        "cassini",
        "cassini-loose",
    }
