"""A tool of tools/ run as an operator runs it, for the tests that stop it part way: its
temporary directories in one of the test's own (TMPDIR), and every process it started noted
as the test stops it, so that the test can tell whether it left any behind."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from gpud.mps.procs import alive

ROOT = Path(__file__).resolve().parents[2]
NETNS = Path("/run/netns")


@dataclass
class RunningTool:
    proc: subprocess.Popen[str]
    tmp: Path  # its TMPDIR: empty again once it cleaned up
    began: list[str]  # its lines up to the one saying it began
    pids: set[int] = field(default_factory=set)  # what it started, as it was stopped

    def left(self) -> list[int]:
        return [pid for pid in self.pids if alive(pid)]

    def note_started(self) -> None:
        """Note the tool's descendants and every MPS control daemon with a PID file under
        its TMPDIR (they leave the daemon's process tree). Only while the tool is not reaped:
        until then its PID, and so its children's parent, is its own."""
        with contextlib.suppress(psutil.NoSuchProcess):
            self.pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        self.note_mps_daemons()

    def freeze(self, named: str) -> list[int]:
        """SIGSTOP the tool's children whose command line names ``named``, so that none ends on
        its own before the tool ends it; their PIDs. The tool is stopped meanwhile, so that
        it reaps none of them (a reaped child's PID could be another process's)."""
        frozen = []
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            for child in psutil.Process(self.proc.pid).children():
                with contextlib.suppress(psutil.NoSuchProcess):  # a zombie has no command line
                    if child.status() != psutil.STATUS_ZOMBIE and any(
                        named in arg for arg in child.cmdline()
                    ):
                        child.suspend()
                        frozen.append(child.pid)
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)
        return frozen

    def note_mps_daemons(self) -> None:
        for pid_file in self.tmp.rglob("nvidia-cuda-mps-control.pid"):
            with contextlib.suppress(OSError, ValueError):
                self.pids.add(int(pid_file.read_text()))


def _kill_noted(tool: RunningTool) -> None:
    for pid in tool.pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _kill_unreaped(tool: RunningTool) -> None:
    """SIGKILL the tool, not yet reaped, and all it started; stopped first, so that the
    children it has not reaped keep their PIDs until they are killed."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(tool.proc.pid, signal.SIGSTOP)
    tool.note_started()
    _kill_noted(tool)
    tool.proc.kill()


@contextmanager
def running_tool(
    argv: list[str], began: str, *, begin_guard_s: float = 90.0
) -> Iterator[RunningTool]:
    """``python ARGV`` once it printed a line that the regular expression ``began`` matches
    (at its start). Whatever is left of it and what it started at the end is killed or
    removed. A guard, not a measure: a tool that has not said it began ``begin_guard_s``
    after its start is killed, with all it started, ending the wait for its line."""
    # short: gpud's unix socket lies under it, and a socket's path has at most 107 bytes
    tmp = Path(tempfile.mkdtemp(prefix="gpud-tool-"))
    try:
        proc = subprocess.Popen(
            [sys.executable, *argv],
            cwd=ROOT,
            env={**os.environ, "TMPDIR": str(tmp)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        tool = RunningTool(proc, tmp, [])
        guard = threading.Timer(begin_guard_s, _kill_unreaped, (tool,))
        guard.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                tool.began.append(line)
                if re.match(began, line):
                    break
            guard.cancel()
            assert tool.began and re.match(began, tool.began[-1]), "".join(tool.began)
            yield tool
        finally:
            guard.cancel()
            guard.join()
            # poll() would reap it: what it started is looked up before
            if proc.returncode is None:
                _kill_unreaped(tool)
                proc.wait()
            tool.note_mps_daemons()
            _kill_noted(tool)
            if proc.stdout is not None:
                proc.stdout.close()
            _delete_its_namespace(proc.pid)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _delete_its_namespace(pid: int) -> None:
    """bench_reprio's network namespace, named for its PID: a tool killed outright (SIGKILL,
    by the guard or a failing test) cannot delete it itself."""
    if (NETNS / f"gpud-bench-{pid}").exists():
        argv = ["ip", "netns", "del", f"gpud-bench-{pid}"]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(argv, check=False, capture_output=True)


def stopped_by(tool: RunningTool, signum: signal.Signals) -> str:
    """Send ``signum`` to the tool alone, noting first what it started; the rest of its
    output once it exited."""
    tool.note_started()
    tool.proc.send_signal(signum)
    rest, _ = tool.proc.communicate(timeout=120)
    return rest
