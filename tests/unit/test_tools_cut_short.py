"""The benchmarks of tools/ stopped part way (``timeout``'s SIGTERM, Ctrl-C): each prints
what it measured so far, says it was cut short and how far it got, exits 128 + the signal's
number, and leaves neither its gpud nor its directory behind."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import CodeType, FrameType

import pytest

from tests.unit.tool_support import running_tool, stopped_by
from tools import bench_telemetry
from tools.simdaemon import Terminated, start_child, stop_children, stop_on_signals


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


def cut_short_at(argv: list[str], began: str, signum: signal.Signals, after: str) -> str:
    """``python ARGV`` sent ``signum`` once it printed a line matching ``began``: it exits
    128 + its number, ending ``cut short by SIGNAL after AFTER`` (a regular expression; or,
    ``--json``, with one JSON document saying so), its directories removed, its network
    namespace (bench_reprio's) deleted and nothing it started left; what it printed after
    ``began``."""
    with running_tool(argv, began=began) as tool:
        rest = stopped_by(tool, signum)
        assert tool.proc.returncode == 128 + signum, rest
        if "--json" in argv:
            doc = json.loads(rest)
            assert doc["cut_short"]["by"] == signum.name, doc
            assert re.fullmatch(after, doc["cut_short"]["after"]), doc
            assert doc["ok"] is False, doc
        else:
            assert re.search(rf"^cut short by {signum.name} after {after};", rest, re.M), rest
        assert list(tool.tmp.iterdir()) == []
        assert tool.left() == []
        assert not (Path("/run/netns") / f"gpud-bench-{tool.proc.pid}").exists()
    return rest


def test_the_queue_benchmark_stopped_prints_the_phases_it_finished() -> None:
    argv = ["-m", "tools.bench_queue", "--waiters", "1", "--idle-s", "600"]
    # while it watches gpud idle
    cut_short_at(
        argv, r"1 queued, 0 runs in the history: ListQueue", signal.SIGTERM, "1 of 3 phases"
    )


def test_the_faults_benchmark_stopped_says_how_many_scenarios_it_finished() -> None:
    argv = ["-m", "tools.bench_faults", "--hang", "600"]
    began = r"interval 1 s, call timeout 5.7 s, hang 600 s"
    cut_short_at(argv, began, signal.SIGTERM, "0 of 2 scenarios")  # in its first scenario


def sigterm_after_repetitions(reps: int) -> list[int]:
    """SIGTERM to this process as the telemetry benchmark's ``reps + 1``-th repetition
    measures its first side (each measures three); the signals sent, filled as they are."""
    measured = 0
    sent: list[int] = []

    def after_them(frame: FrameType, event: str, arg: object) -> None:
        nonlocal measured
        if event == "return" and frame.f_code is bench_telemetry.cpu_seconds.__code__:
            measured += 1
            if measured == 3 * reps + 1:
                sys.setprofile(None)
                sent.append(signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)

    sys.setprofile(after_them)
    return sent


class SigtermAtReport(io.StringIO):
    """Standard output that sends this process a SIGTERM at its first write once ``sent``
    holds one: a second signal as the tool reports what it measured."""

    def __init__(self, sent: list[int]) -> None:
        super().__init__()
        self.sent = sent

    def write(self, text: str) -> int:
        if len(self.sent) == 1:
            self.sent.append(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return super().write(text)


@pytest.mark.usefixtures("sigterm_raises")
def test_the_telemetry_benchmark_stopped_with_json_prints_one_json_document(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sigterm_after_repetitions(2)
    try:
        code = bench_telemetry.main(["--json", "--reps", "1000", "--no-daemon", "--cpu", "all"])
    finally:
        sys.setprofile(None)
    out = capsys.readouterr().out
    assert code == 128 + signal.SIGTERM, out
    doc = json.loads(out)
    assert doc["cut_short"] == {"by": "SIGTERM", "after": "2 of 1000 repetitions"}, doc
    assert doc["ok"] is False
    assert (doc["reps"], doc["reps_planned"]) == (2, 1000), doc
    for side in ("bare", "adapter", "tick"):
        assert doc[f"{side}_cpu_s"] > 0, doc
    assert doc["tick_over_bare"] > 0, doc


@pytest.mark.usefixtures("sigterm_raises")
def test_a_second_signal_while_a_benchmark_reports_what_it_measured_is_ignored() -> None:
    out_to = SigtermAtReport(sigterm_after_repetitions(2))
    try:
        with contextlib.redirect_stdout(out_to):
            code = bench_telemetry.main(["--reps", "1000", "--no-daemon", "--cpu", "all"])
    finally:
        sys.setprofile(None)
    out = out_to.getvalue()
    assert out_to.sent == [signal.SIGTERM] * 2
    assert code == 128 + signal.SIGTERM, out
    assert re.search(r"^sampler tick +\d+\.\d+ ms CPU .*median of 2;", out, re.M), out
    assert "cut short by SIGTERM after 2 of 1000 repetitions" in out, out
    # the handler before is back once the report is printed
    with pytest.raises(TermReached):
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def sigterm_as_it_returns(code: CodeType) -> Iterator[None]:
    """SIGTERM to this process as a call of ``code`` in the body first returns."""

    def at_return(frame: FrameType, event: str, arg: object) -> None:
        if event == "return" and frame.f_code is code:
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGTERM)

    sys.setprofile(at_return)
    try:
        yield
    finally:
        sys.setprofile(None)


def test_a_signal_as_the_queued_runs_are_stopped_still_stops_every_one() -> None:
    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(3)]
    try:
        with (
            pytest.raises(Terminated),
            stop_on_signals(),
            sigterm_as_it_returns(subprocess.Popen.poll.__code__),
        ):
            stop_children(procs)
        assert [p.returncode for p in procs] == [-signal.SIGINT] * 3
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_run_started_as_a_signal_comes_is_noted_for_stopping() -> None:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with (
            pytest.raises(Terminated),
            stop_on_signals(),
            sigterm_as_it_returns(subprocess.Popen.__init__.__code__),
        ):
            start_child(procs, ["sleep", "600"], stderr=subprocess.DEVNULL)
        assert len(procs) == 1
    finally:
        stop_children(procs)


def test_the_api_benchmark_stopped_stops_its_clients_and_says_how_many_phases_it_did() -> None:
    argv = ["-m", "tools.bench_api", "--clients", "2", "--seconds", "600"]
    # its one client calling gpud
    cut_short_at(argv, r"measuring: 4 phases", signal.SIGTERM, "0 of 4 phases")


def test_the_api_benchmark_stopped_with_json_prints_one_json_document() -> None:
    argv = ["-m", "tools.bench_api", "--seconds", "600", "--json"]
    doc = json.loads(cut_short_at(argv, r"measuring: 4 phases", signal.SIGINT, "0 of 4 phases"))
    assert doc["phases"] == 0, doc


def test_the_quotes_benchmark_stopped_prints_the_history_sizes_it_measured() -> None:
    argv = ["-m", "tools.bench_quotes", "--history", "0,1000000", "--repeat", "1"]
    # as it fills the second history
    rest = cut_short_at(argv, r"measuring: N=1000000", signal.SIGTERM, "1 of 2 history sizes")
    assert re.search(r"^afresh: total +\d+\.\d+$", rest, re.M), rest
    assert "N=1000000" not in rest, rest


@pytest.mark.parametrize("json_out", [[], ["--json"]])
@pytest.mark.parametrize(
    ("argv", "signum", "said"),
    [
        (["tools.bench_reprio", "--jobs", "8"], signal.SIGTERM, "its network namespace deleted"),
        (["tools.bench_progress", "--calls", "20000"], signal.SIGINT, "reports_dropped "),
    ],
    ids=["reprio", "progress"],
)
def test_a_benchmark_of_repetitions_stopped_prints_the_ones_it_measured(
    argv: list[str], signum: signal.Signals, said: str, json_out: list[str]
) -> None:
    # bench_reprio while it moves the tags; its namespace is deleted
    whole = ["-m", *argv, "--reps", "1000", *json_out]
    rest = cut_short_at(whole, r"measuring: 1000", signum, r"\d+ of 1000 repetitions")
    assert json_out or said in rest, rest


@pytest.mark.parametrize("json_out", [[], ["--json"]])
def test_the_cluster_benchmark_stopped_reports_the_parts_it_finished(json_out: list[str]) -> None:
    small = ["--jobs", "16", "--nodes", "4", "--span", "2", "--round-nodes", "5"]
    argv = ["-m", "tools.bench_cluster", "--skip-failover", "--reps", "2000", *small, *json_out]
    # text: as its round part begins; --json: in its order part, or its round part
    began = r"global order: 16 jobs" if not json_out else r"measuring: 2 parts"
    rest = cut_short_at(
        argv, began, signal.SIGTERM, r"[01] of 2 parts" if json_out else "1 of 2 parts"
    )
    if json_out:
        doc = json.loads(rest)
        assert len(doc) - 2 == int(doc["cut_short"]["after"][0]), doc  # cut_short, ok


def test_the_colocation_benchmark_stopped_prints_the_passes_it_timed() -> None:
    argv = ["-m", "tools.bench_colocate", "--repeat", "100000"]
    rest = cut_short_at(argv, r"measuring: 2 planners", signal.SIGINT, r"\d+ of 200000 passes")
    timed = re.search(r"after (\d+) of", rest)
    assert timed is not None
    if int(timed[1]):  # the cold planner's, so far
        assert re.search(rf"^cold: median CPU .* \({timed[1]} passes\)$", rest, re.M), rest
