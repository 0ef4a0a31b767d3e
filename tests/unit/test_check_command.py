"""What ``tools/check`` type-checks: every Python package of the repository but the tests
(which it reaches through the tools that import them), under mypy's strict mode."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_strict_type_check_covers_every_package_and_the_tools() -> None:
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} - {"tests"}
    assert "tools" in packages
    assert mypy["strict"] is True
    assert sorted(packages - set(mypy["packages"])) == []


def test_the_check_command_runs_mypy_on_what_pyproject_names() -> None:
    # mypy with no targets checks [tool.mypy] packages; a target on the line would narrow it
    check = (ROOT / "tools" / "check").read_text()
    assert re.search(r"-m mypy\s*$", check, re.MULTILINE), check
