"""A tool of tools/ run as an operator runs it, for the tests that stop it part way: its
temporary directories in one of the test's own (TMPDIR), and every process it started noted
once it says it began, so that the test can tell whether it left any behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from gpud.mps.procs import alive

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RunningTool:
    proc: subprocess.Popen[str]
    tmp: Path  # its TMPDIR: empty again once it cleaned up
    pids: set[int]  # what it started (gpud, MPS control daemons), as it began
    began: list[str]  # its lines up to the one saying it began

    def left(self) -> list[int]:
        return [pid for pid in self.pids if alive(pid)]


def _started_by(tool: int, tmp: Path) -> set[int]:
    """The tool's descendants, and every MPS control daemon with a PID file under ``tmp``
    (they leave the daemon's process tree)."""
    pids: set[int] = set()
    with contextlib.suppress(psutil.NoSuchProcess):
        pids |= {p.pid for p in psutil.Process(tool).children(recursive=True)}
    for pid_file in tmp.rglob("nvidia-cuda-mps-control.pid"):
        with contextlib.suppress(OSError, ValueError):
            pids.add(int(pid_file.read_text()))
    return pids


@contextmanager
def running_tool(argv: list[str], began: str) -> Iterator[RunningTool]:
    """``python ARGV`` once it printed a line starting with ``began``. Whatever is left of it
    and what it started at the end is killed or removed."""
    # short: gpud's unix socket lies under it, and a socket's path has at most 107 bytes
    tmp = Path(tempfile.mkdtemp(prefix="gpud-tool-"))
    proc = subprocess.Popen(
        [sys.executable, *argv],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    # a guard, not a measure: a tool that never says it began ends the wait for its line
    guard = threading.Timer(300, proc.kill)
    guard.start()
    tool = RunningTool(proc, tmp, set(), [])
    try:
        for line in proc.stdout:
            tool.began.append(line)
            if line.startswith(began):
                break
        assert tool.began and tool.began[-1].startswith(began), "".join(tool.began)
        tool.pids = _started_by(proc.pid, tmp)
        yield tool
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in tool.pids | _started_by(proc.pid, tmp):
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def stopped_by(tool: RunningTool, signum: signal.Signals) -> str:
    """Send ``signum`` to the tool alone; the rest of its output once it exited."""
    tool.proc.send_signal(signum)
    rest, _ = tool.proc.communicate(timeout=120)
    return rest
