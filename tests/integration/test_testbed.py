"""The testbed end to end on the real kernel, short: it runs, reports, and leaves nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpud.net.cgroups import find_cgroup2

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, tc, nft)"),
    pytest.mark.skipif(
        not all(shutil.which(p) for p in ("nft", "tc", "nsenter")), reason="needs nft, tc, nsenter"
    ),
]

REPO = Path(__file__).resolve().parents[2]


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.startswith("tb")}


def _testbed_cgroups() -> set[str]:
    mount = find_cgroup2()
    return set() if mount is None else {p.name for p in mount.glob("gpud-testbed-*")}


def test_testbed_runs_a_mix_and_cleans_up() -> None:
    before = _namespaces()
    cgroups_before = _testbed_cgroups()
    r = subprocess.run(
        [sys.executable, "-m", "tools.testbed", "run", "--json",
         "--jobs", "one:1:2:30,many:8:2:30", "--seconds", "8", "--warmup", "2"],
        capture_output=True, text=True, timeout=600, cwd=REPO, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    mix = report["mixes"]["custom"]
    assert 0 < mix["ceiling"] <= 1
    for side in ("baseline", "gpud"):
        assert set(mix[side]) >= {"min_progress", "jain", "efficiency"}
        assert mix[side]["min_progress"] > 0
    run = report["runs"][0]
    assert run["mixes"]["custom"]["gpud"]["progress"].keys() == {"one", "many"}
    assert _namespaces() == before
    assert _testbed_cgroups() <= cgroups_before
