"""The shipped alerting rules, checked and unit-tested by ``promtool`` (Prometheus's own
rule engine): each alert fires on the series it is meant for, after its ``for``, and not on
the others."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "monitoring" / "gpud-alerts.yml"
CASES = Path(__file__).with_name("gpud-alerts.test.yml")


def _promtool() -> str:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (Debian package prometheus)"
    return promtool


def test_rules_pass_promtool_check() -> None:
    done = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 19 rules found" in done.stdout


def test_alerts_fire_as_the_cases_say(tmp_path: Path) -> None:
    # promtool reads rule_files relative to the test file: both go into one directory
    shutil.copy(RULES, tmp_path / RULES.name)
    cases = tmp_path / CASES.name
    cases.write_text(f"rule_files: [{RULES.name}]\n" + CASES.read_text())
    done = subprocess.run(
        [_promtool(), "test", "rules", str(cases)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
