"""tools/fuzz_api stopped part way (``timeout``'s SIGTERM, Ctrl-C): it stops its gpud and the
MPS control daemons, removes its directory and prints what it measured so far."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from gpud.mps.procs import alive

ROOT = Path(__file__).resolve().parents[2]


def _pids_under(run_dir: Path, gpud: int) -> set[int]:
    """gpud, what it started, and every MPS control daemon with a PID file in its run dir."""
    pids = {gpud}
    with contextlib.suppress(psutil.NoSuchProcess):
        pids |= {p.pid for p in psutil.Process(gpud).children(recursive=True)}
    for pid_file in run_dir.rglob("nvidia-cuda-mps-control.pid"):
        with contextlib.suppress(OSError, ValueError):
            pids.add(int(pid_file.read_text()))
    return pids


def test_a_sigterm_mid_run_stops_its_gpud_removes_its_directory_and_reports_so_far() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.fuzz_api", "--requests", "10000000", "--big", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    # a guard, not a measure: a tool that never says it began ends the wait for its line
    guard = threading.Timer(300, proc.kill)
    guard.start()
    pids: set[int] = set()
    work: Path | None = None
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("gpud pid "):
                words = line.split()  # gpud pid PID, run dir DIR
                gpud, run_dir = int(words[2].rstrip(",")), Path(words[5])
                work = run_dir.parent
            if line.startswith("fuzzing: "):
                break
        assert work is not None, "".join(seen)
        pids = _pids_under(run_dir, gpud)
        assert len(pids) > 1, pids  # its MPS control daemon at least
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGTERM, rest
        assert "cut short by SIGTERM after " in rest, rest
        assert rest.splitlines()[0].endswith(" seed 1") and "outcomes: " in rest, rest
        assert "RSS: " in rest and " after the warm-up" in rest, rest
        assert not work.exists()
        assert [pid for pid in pids if alive(pid)] == []
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
