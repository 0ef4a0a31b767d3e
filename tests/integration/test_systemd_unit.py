"""The shipped unit file passes ``systemd-analyze verify``."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is required (Debian package systemd)"
    gpud = Path(sys.executable).with_name("gpud")
    assert gpud.exists(), f"{gpud} missing: install the project (tools/setup.sh)"
    # verify also checks that ExecStart exists: point it at this checkout's gpud.
    text = (ROOT / "systemd" / "gpud.service").read_text()
    assert "ExecStart=/usr/local/bin/gpud " in text
    unit = tmp_path / "gpud.service"
    unit.write_text(text.replace("/usr/local/bin/gpud", str(gpud)))
    result = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "gpud.service" not in result.stderr, result.stderr


def test_unit_has_what_operators_rely_on() -> None:
    text = (ROOT / "systemd" / "gpud.service").read_text()
    for line in (
        "Type=notify",
        "WatchdogSec=",
        "Restart=on-failure",
        # a config error, a damaged state database, no driver or library, no permission:
        # restarting cannot mend them
        "RestartPreventExitStatus=2 65 69 77",
        "StateDirectory=gpud",
        "RuntimeDirectory=gpud",
        "ExecReload=/bin/kill -HUP $MAINPID",
        # traffic marking creates the jobs' cgroups and moves their commands in
        "ProtectControlGroups=no",
        # glibc maps and unmaps large blocks (a decoded peer report) rather than keep them
        "Environment=GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072",
    ):
        assert line in text
    (bounding,) = [ln for ln in text.splitlines() if ln.startswith("CapabilityBoundingSet=")]
    # NET_ADMIN: tc and nftables; SYS_PTRACE: other users' /proc/PID/environ (the job of a
    # GPU process, a run's leftovers); KILL: stopping those leftovers
    assert {"CAP_NET_ADMIN", "CAP_SYS_PTRACE", "CAP_KILL"} <= set(bounding.split("=")[1].split())
