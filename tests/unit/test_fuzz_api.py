"""tools/fuzz_api stopped part way (``timeout``'s SIGTERM, Ctrl-C): it stops its gpud and the
MPS control daemons, removes its directory and prints what it measured so far; any other tool
on tools.simdaemon (the benchmarks) stops its gpud and removes its directory too."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import psutil
import pytest

from gpud.mps.procs import alive
from tools import simdaemon
from tools.simdaemon import stop_on_signals

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


def _began(stdout: IO[str]) -> tuple[int, Path]:
    """gpud's PID and run dir, read from the tool's lines up to the one saying it began."""
    gpud, run_dir, seen = 0, None, []
    for line in stdout:
        seen.append(line)
        if line.startswith("gpud pid "):
            words = line.split()  # gpud pid PID, run dir DIR
            gpud, run_dir = int(words[2].rstrip(",")), Path(words[5])
        if line.startswith("fuzzing: "):
            break
    assert run_dir is not None and line.startswith("fuzzing: "), "".join(seen)
    return gpud, run_dir


@contextmanager
def _running(argv: list[str]) -> Iterator[tuple[subprocess.Popen[str], Path, set[int]]]:
    """The tool ``argv`` once it said it began: it, its temporary directory, and gpud with
    the processes it started. Whatever is left of them at the end is killed or removed."""
    proc = subprocess.Popen(
        [sys.executable, *argv],
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
        gpud, run_dir = _began(proc.stdout)
        work = run_dir.parent
        pids = _pids_under(run_dir, gpud)
        yield proc, work, pids
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


def test_a_sigterm_mid_run_stops_its_gpud_removes_its_directory_and_reports_so_far() -> None:
    argv = ["-m", "tools.fuzz_api", "--requests", "10000000", "--big", "0"]
    with _running(argv) as (proc, work, pids):
        assert len(pids) > 1, pids  # its MPS control daemon at least
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGTERM, rest
        assert "cut short by SIGTERM after " in rest, rest
        assert rest.splitlines()[0].endswith(" seed 1") and "outcomes: " in rest, rest
        assert "RSS: " in rest and " after the warm-up" in rest, rest
        assert not work.exists()
        assert [pid for pid in pids if alive(pid)] == []


# a benchmark's shape: a simulated gpud, then work it prints nothing about until its end
BENCHMARK = """
import time
from tools.simdaemon import simulated_gpud
with simulated_gpud("H100-SXM5-80GB:1", config_text="[mps]\\nenabled = true\\n") as daemon:
    print(f"gpud pid {daemon.pid}, run dir {daemon.socket.parent}", flush=True)
    print("fuzzing: (measuring)", flush=True)
    while True:
        time.sleep(1)
"""


def test_a_sigterm_to_any_tool_on_a_simulated_gpud_stops_it_and_removes_its_directory() -> None:
    with _running(["-c", BENCHMARK]) as (proc, work, pids):
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode != 0 and "Terminated" in rest, rest
        assert not work.exists()
        assert [pid for pid in pids if alive(pid)] == []


def test_a_tool_killed_outright_takes_its_simulated_gpud_with_it() -> None:
    # SIGKILL (`timeout -k`, a cancelled CI job): the tool runs no cleanup, and gpud, in a
    # process group of its own, is not reached by one sent to the tool's
    script = BENCHMARK.replace("[mps]\\nenabled = true\\n", "")  # gpud alone, no MPS
    assert script != BENCHMARK
    with _running(["-c", script]) as (proc, work, pids):
        proc.kill()
        proc.communicate()
        for pid in pids:  # a guard, not a measure: gpud stops in order on its SIGTERM
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).wait(timeout=120)
        assert [pid for pid in pids if alive(pid)] == []
        assert work.exists()  # the tool could not remove it: _running does


def test_a_signal_while_the_tool_puts_its_handlers_back_is_noted_and_all_are_put_back() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    restored: list[object] = []

    def between_the_restores(frame: object, event: str, arg: object) -> None:
        # SIGINT as the first handler is back and the second is not yet: its handler runs
        # as this returns, before the next restore
        # (signal.signal is Python, around the C one)
        c_signal = (getattr(arg, "__module__", None), getattr(arg, "__name__", None)) == (
            "_signal",
            "signal",
        )
        if event == "c_return" and c_signal:
            restored.append(arg)
            if len(restored) == 1:
                sys.setprofile(None)
                os.kill(os.getpid(), signal.SIGINT)

    try:
        try:
            with stop_on_signals() as received:
                sys.setprofile(between_the_restores)
        except KeyboardInterrupt:
            pytest.fail("raised as the handlers were put back")
        assert received == [signal.SIGINT]
        assert {s: signal.getsignal(s) for s in before} == before
        assert simdaemon._signals is None
    finally:
        sys.setprofile(None)
        for signum, handler in before.items():
            signal.signal(signum, handler)
