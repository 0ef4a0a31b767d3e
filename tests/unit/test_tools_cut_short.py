"""The benchmarks of tools/ stopped part way (``timeout``'s SIGTERM, Ctrl-C): each prints
what it measured so far, says it was cut short and how far it got, exits 128 + the signal's
number, and leaves neither its gpud nor its directory behind."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import CodeType, FrameType
from typing import cast

import pytest

from colocate import Plan
from tests.unit.tool_support import NETNS, ROOT, running_tool, stopped_by
from tools import bench_telemetry
from tools.bench_cluster import cleaned_after
from tools.bench_colocate import Passes
from tools.bench_progress import NAMES, record
from tools.simdaemon import (
    Terminated,
    restores_signals,
    start_child,
    stop_children,
    stop_on_signals,
    stopped_by_signal,
)

NEEDS_NETNS = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("tc") and shutil.which("ip")),
    reason="needs root, tc and ip to make a network namespace",
)


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
    """``python ARGV`` sent ``signum`` once it printed a line matching ``began``: it dies by
    the signal once it printed what it measured, ending ``cut short by SIGNAL after AFTER`` (a regular expression; or,
    ``--json``, with one JSON document saying so), its directories removed, its network
    namespace (bench_reprio's) deleted and nothing it started left; what it printed after
    ``began``."""
    with running_tool(argv, began=began) as tool:
        rest = stopped_by(tool, signum)
        assert tool.proc.returncode == -signum, rest
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
def sigterm_at(seen: Callable[[FrameType, str, object], bool]) -> Iterator[None]:
    """SIGTERM to this process at the first profiling event in the body that ``seen`` picks."""

    def at_event(frame: FrameType, event: str, arg: object) -> None:
        if seen(frame, event, arg):
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGTERM)

    sys.setprofile(at_event)
    try:
        yield
    finally:
        sys.setprofile(None)


def sigterm_as_it_returns(code: CodeType) -> contextlib.AbstractContextManager[None]:
    """SIGTERM to this process as a call of ``code`` in the body first returns."""
    return sigterm_at(lambda frame, event, arg: event == "return" and frame.f_code is code)


def _a_list_grew(frame: FrameType, event: str, arg: object) -> bool:
    grown = getattr(arg, "__self__", None)
    return event == "c_return" and getattr(arg, "__name__", "") == "append" and type(grown) is list


def sigterm_as_a_list_grows() -> contextlib.AbstractContextManager[None]:
    """SIGTERM to this process as the first ``list.append`` in the body returns."""
    return sigterm_at(_a_list_grew)


def kill_left(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


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
        kill_left(procs)


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
        pytest.param(
            ["tools.bench_reprio", "--jobs", "8"],
            signal.SIGTERM,
            "its network namespace deleted",
            marks=NEEDS_NETNS,
        ),
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
    else:  # --skip-failover: it started no etcd nor gpud
        assert re.search(r"^cut short .*; its directories removed; FAILED$", rest, re.M), rest


def test_a_cluster_benchmark_cut_short_says_it_stopped_only_what_it_planned_to_start() -> None:
    assert cleaned_after(["order"]) == ""
    assert cleaned_after(["order", "round"]) == "its directories removed"
    assert cleaned_after(["failover"]).startswith("its etcd and gpud processes stopped")


def test_the_colocation_benchmark_stopped_prints_the_passes_it_timed() -> None:
    argv = ["-m", "tools.bench_colocate", "--repeat", "100000"]
    rest = cut_short_at(argv, r"measuring: 2 planners", signal.SIGINT, r"\d+ of 200000 passes")
    timed = re.search(r"after (\d+) of", rest)
    assert timed is not None
    if int(timed[1]):  # the cold planner's, so far
        assert re.search(rf"^cold: median CPU .* \({timed[1]} passes\)$", rest, re.M), rest


# A tool cut short whose report blocks: stdout is a pipe the test never reads.
STUCK_REPORT = """
import signal, sys
from tools.simdaemon import cut_short, stopped_by_signal

with stopped_by_signal() as stopped:
    print("began", file=sys.stderr, flush=True)
    signal.pause()
print("reporting", file=sys.stderr, flush=True)
sys.exit(cut_short(stopped.by, "0 of 1 rounds", figures={}, show=lambda f: print("x" * 10**7)))
"""


def took_them_stuck_writing(proc: subprocess.Popen[str]) -> None:
    """Until ``proc`` has no signal pending and sleeps on a pipe (or is gone): it took the
    signals sent so far and went back to its report (a write) or its cleanup (a read). Sent
    sooner, a signal still pending would merge with the one before it."""
    status, wchan = Path(f"/proc/{proc.pid}/status"), Path(f"/proc/{proc.pid}/wchan")
    while proc.poll() is None:
        pending = re.findall(r"^(?:SigPnd|ShdPnd):\s+(\w+)$", status.read_text(), re.M)
        if not any(int(mask, 16) for mask in pending) and "pipe" in wchan.read_text():
            return
        time.sleep(0.01)


def test_a_report_stuck_on_a_full_pipe_is_ended_by_a_third_signal() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK_REPORT],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline() == "began\n"
        proc.send_signal(signal.SIGTERM)  # cuts it short
        assert proc.stderr.readline() == "reporting\n"
        took_them_stuck_writing(proc)
        proc.send_signal(signal.SIGTERM)  # only noted
        took_them_stuck_writing(proc)
        proc.send_signal(signal.SIGTERM)  # ends it
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


# A cleanup (held) that removes its marker once the test writes a line: the signals come first.
HELD_CLEANUP = """
import sys
from pathlib import Path
from tools.simdaemon import held, stop_on_signals

marker = Path(sys.argv[1])
with stop_on_signals():
    with held():
        print("holding", file=sys.stderr, flush=True)
        sys.stdin.readline()
        marker.unlink()
    print("not reached", file=sys.stderr, flush=True)
"""


def test_a_cleanup_under_three_signals_finishes_before_the_tool_dies_by_the_signal(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "netns"
    marker.touch()
    proc = subprocess.Popen(
        [sys.executable, "-c", HELD_CLEANUP, str(marker)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdin is not None and proc.stderr is not None
        assert proc.stderr.readline() == "holding\n"
        for _ in range(3):
            took_them_stuck_writing(proc)
            proc.send_signal(signal.SIGTERM)
        took_them_stuck_writing(proc)
        assert proc.poll() is None, "a third signal cut the cleanup short"
        proc.stdin.write("cleaned\n")
        proc.stdin.close()
        assert proc.wait(timeout=60) == -signal.SIGTERM
        assert not marker.exists()
        assert "not reached" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


# Cut short, with its reader gone (``bench ... | head``) and a report still buffered.
EXIT_AS_ON_A_CLOSED_PIPE = """
import signal, sys
from tools.simdaemon import exit_as

sys.stdout.write("a report the reader never takes")
exit_as(128 + signal.SIGINT)
"""


def test_a_tool_cut_short_whose_reader_went_away_still_dies_by_the_signal() -> None:
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-c", EXIT_AS_ON_A_CLOSED_PIPE],
            cwd=ROOT,
            # buffered, as a tool's stdout to a pipe is: the report fails in exit_as's flush
            env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write)
    assert done.returncode == -signal.SIGINT, done.stderr
    assert "Traceback" not in done.stderr


# die_by called off the main thread, where Python's signal.signal refuses.
DIE_OFF_THE_MAIN_THREAD = """
import signal, sys, threading
from tools.simdaemon import die_by

if sys.argv[1] == "handled":
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
dying = threading.Thread(target=die_by, args=(signal.SIGTERM,))
dying.start()
dying.join()
"""


@pytest.mark.parametrize(
    ("handler", "ended"),
    [("default", -signal.SIGTERM), ("handled", 128 + signal.SIGTERM)],
)
def test_die_by_off_the_main_thread_still_ends_the_tool(handler: str, ended: int) -> None:
    done = subprocess.run(
        [sys.executable, "-c", DIE_OFF_THE_MAIN_THREAD, handler],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == ended, done.stderr


def test_a_benchmark_cut_short_by_ctrl_c_stops_the_shell_loop_that_ran_it() -> None:
    bench = f"{sys.executable} -m tools.bench_colocate --repeat 100000"
    shell = subprocess.Popen(
        ["bash", "-c", f"{bench}; echo CONTINUED"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        process_group=0,
    )
    try:
        assert shell.stdout is not None
        began = shell.stdout.readline()
        assert began.startswith("measuring: 2 planners"), began
        os.killpg(shell.pid, signal.SIGINT)  # a Ctrl-C at the terminal
        rest, _ = shell.communicate(timeout=120)
        assert re.search(r"^cut short by SIGINT after \d+ of 200000 passes;", rest, re.M), rest
        assert "CONTINUED" not in rest, rest
        assert shell.returncode == -signal.SIGINT
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()


def cut_short_by_sigterm() -> None:
    """What a tool measures, cut short by a SIGTERM: the tool reports next."""
    with stopped_by_signal() as stopped:
        os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.by == "SIGTERM"


@pytest.mark.usefixtures("sigterm_raises")
def test_a_tool_failing_after_a_signal_cut_it_short_has_its_handlers_back() -> None:
    @restores_signals
    def tool() -> int:
        cut_short_by_sigterm()
        raise ValueError("its report failed")

    with pytest.raises(ValueError, match="its report failed"):
        tool()
    with pytest.raises(TermReached):
        os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.usefixtures("sigterm_raises")
def test_a_command_started_while_a_tool_reports_can_be_stopped_by_sigterm() -> None:
    @restores_signals
    def tool() -> int:
        cut_short_by_sigterm()
        child = subprocess.Popen(["sleep", "600"])
        try:
            child.terminate()
            return child.wait(timeout=60)
        finally:
            kill_left([child])

    assert tool() == -signal.SIGTERM


def test_children_still_there_at_the_deadline_are_killed_without_a_wait_each() -> None:
    # SIGCONT: they go on running; the clock says the deadline passed after the first look
    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(3)]
    times = iter([0.0])
    try:
        stop_children(procs, signal.SIGCONT, wait_s=30, clock=lambda: next(times, 31.0))
        assert [p.returncode for p in procs] == [-signal.SIGKILL] * 3
    finally:
        kill_left(procs)


def test_a_colocation_pass_cut_short_as_it_is_recorded_is_recorded_whole() -> None:
    done = Passes()
    with pytest.raises(Terminated), stop_on_signals(), sigterm_as_a_list_grows():
        done.add(0.01, 0.02, cast(Plan, object()))
    assert (done.cpu, done.wall) == ([0.01], [0.02])


def test_a_progress_repetition_cut_short_as_it_is_recorded_is_recorded_whole() -> None:
    results: dict[str, list[float]] = {name: [] for name in NAMES}
    ratios: list[float] = []
    with pytest.raises(Terminated), stop_on_signals(), sigterm_as_a_list_grows():
        record(dict.fromkeys(NAMES, 1.0), results, ratios)
    assert [len(results[name]) for name in NAMES] == [1] * len(NAMES)
    assert ratios == [0.5]


@NEEDS_NETNS
def test_a_reprio_run_killed_by_a_failing_test_leaves_no_network_namespace() -> None:
    # as bench_reprio names its namespace; the test fails before the tool deletes it
    script = (
        "import os, subprocess, time\n"
        "subprocess.run(['ip', 'netns', 'add', f'gpud-bench-{os.getpid()}'], check=True)\n"
        "print('made', flush=True)\n"
        "time.sleep(600)\n"
    )
    pid = 0
    try:
        with pytest.raises(AssertionError), running_tool(["-c", script], began="made") as tool:
            pid = tool.proc.pid
            assert (NETNS / f"gpud-bench-{pid}").exists()
            raise AssertionError("the test failed with the tool running")
        assert not (NETNS / f"gpud-bench-{pid}").exists()
    finally:
        if pid and (NETNS / f"gpud-bench-{pid}").exists():
            subprocess.run(["ip", "netns", "del", f"gpud-bench-{pid}"], check=False)
