"""The benchmarks of tools/ stopped part way (``timeout``'s SIGTERM, Ctrl-C): each prints
what it measured so far, says it was cut short and how far it got, exits 128 + the signal's
number, and leaves neither its gpud nor its directory behind."""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Iterator
from types import FrameType

import pytest

from tests.unit.tool_support import running_tool, stopped_by
from tools import bench_telemetry


class TermReached(Exception):
    """The SIGTERM came through to the test: the tool under test did not take it."""


@pytest.fixture
def sigterm_raises() -> Iterator[None]:
    def raise_it(signum: int, frame: object) -> None:
        raise TermReached()

    before = signal.signal(signal.SIGTERM, raise_it)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.usefixtures("sigterm_raises")
def test_the_telemetry_benchmark_stopped_prints_the_repetitions_it_measured(
    capsys: pytest.CaptureFixture[str],
) -> None:
    measured = 0

    def after_two_repetitions(frame: FrameType, event: str, arg: object) -> None:
        # each repetition measures three sides: SIGTERM as the seventh measure ends
        nonlocal measured
        if event == "return" and frame.f_code is bench_telemetry.cpu_seconds.__code__:
            measured += 1
            if measured == 7:
                sys.setprofile(None)
                os.kill(os.getpid(), signal.SIGTERM)

    sys.setprofile(after_two_repetitions)
    try:
        code = bench_telemetry.main(["--reps", "1000", "--no-daemon", "--cpu", "all"])
    finally:
        sys.setprofile(None)
    out = capsys.readouterr().out
    assert code == 128 + signal.SIGTERM, out
    for label in ("bare NVML loop", "backend calls only", "sampler tick"):
        assert re.search(rf"^{label} +\d+\.\d+ ms CPU .*median of 2;", out, re.M), out
    assert "cut short by SIGTERM after 2 of 1000 repetitions" in out, out


def test_the_queue_benchmark_stopped_prints_the_phases_it_finished() -> None:
    argv = ["-m", "tools.bench_queue", "--waiters", "1", "--idle-s", "600"]
    with running_tool(argv, began=r"1 queued, 0 runs in the history: ListQueue") as tool:
        rest = stopped_by(tool, signal.SIGTERM)  # while it watches gpud idle
        assert tool.proc.returncode == 128 + signal.SIGTERM, rest
        assert "cut short by SIGTERM after 1 of 3 phases" in rest, rest
        assert list(tool.tmp.iterdir()) == []
        assert tool.left() == []


def test_the_faults_benchmark_stopped_says_how_many_scenarios_it_finished() -> None:
    argv = ["-m", "tools.bench_faults", "--hang", "600"]
    with running_tool(argv, began=r"interval 1 s, call timeout 5.7 s, hang 600 s") as tool:
        rest = stopped_by(tool, signal.SIGTERM)  # in its first scenario
        assert tool.proc.returncode == 128 + signal.SIGTERM, rest
        assert "cut short by SIGTERM after 0 of 2 scenarios" in rest, rest
        assert list(tool.tmp.iterdir()) == []
        assert tool.left() == []
