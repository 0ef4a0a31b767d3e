"""tools/fuzz_api stopped part way (``timeout``'s SIGTERM, Ctrl-C): it stops its gpud and the
MPS control daemons, removes its directory and prints what it measured so far; any other tool
on tools.simdaemon (the benchmarks) stops its gpud and removes its directory too."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
import psutil
import pytest

from gpud.mps.procs import alive
from gpud.v1 import node_pb2
from tests.unit.api_support import short_dir
from tests.unit.tool_support import running_tool, stopped_by
from tools import simdaemon
from tools.fuzz_api import MB, Run, first_of, first_of_stream, methods, report, send_fuzzed
from tools.simdaemon import Terminated, stop_on_signals


def test_a_sigterm_mid_run_stops_its_gpud_removes_its_directory_and_reports_so_far() -> None:
    argv = ["-m", "tools.fuzz_api", "--requests", "10000000", "--big", "0"]
    with running_tool(argv, began="fuzzing: ") as tool:
        rest = stopped_by(tool, signal.SIGTERM)
        assert len(tool.pids) > 1, tool.pids  # gpud and its MPS control daemon at least
        assert tool.proc.returncode == -signal.SIGTERM, rest
        assert "cut short by SIGTERM after " in rest, rest
        assert rest.splitlines()[0].endswith(" seed 1") and "outcomes: " in rest, rest
        assert "RSS: " in rest and " after the warm-up" in rest, rest
        assert list(tool.tmp.iterdir()) == []
        assert tool.left() == []


def test_the_fuzzed_gpud_runs_with_the_environment_the_shipped_unit_gives_it() -> None:
    argv = ["-m", "tools.fuzz_api", "--requests", "10000000", "--big", "0"]
    with running_tool(argv, began="fuzzing: ") as tool:
        first = tool.began[0]
        pid = int(first.split()[2].rstrip(","))
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        stopped_by(tool, signal.SIGTERM)
    # its RSS is then the installed daemon's: glibc maps and unmaps blocks of 128 KiB and
    # more rather than keeping them in its arenas
    assert b"GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072" in environ, first
    assert first.rstrip().endswith(", env GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072")


def test_a_daemon_as_installed_gets_the_units_variables_unless_the_caller_sets_them(
    tmp_path: Path,
) -> None:
    unit = tmp_path / "gpud.service"
    unit.write_text(
        "[Service]\n"
        "Environment=GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072\n"
        'Environment="GREETING=two words" EMPTY=\n'
        "ExecStart=/usr/local/bin/gpud\n"
    )
    assert simdaemon.unit_environment(unit) == {
        "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072",
        "GREETING": "two words",
        "EMPTY": "",
    }
    env = simdaemon.as_installed({"PATH": "/bin", "GLIBC_TUNABLES": ""}, unit)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "", "GREETING": "two words", "EMPTY": ""}


def test_a_run_cut_short_counts_the_big_strings_it_sent_not_those_it_planned(
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = Run(requests=3000, big=300, seed=1, methods=40, sent=120, big_sent=11)
    run.cut_by = "SIGINT"
    assert report(run, max_growth_mb=20) == 128 + signal.SIGINT
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("120 of 3000 fuzzed requests (11 of 300 with a 1 MB string) "), first


def test_a_big_request_a_signal_cuts_short_is_counted_neither_sent_nor_big() -> None:
    answered: list[bool] = []  # whether each request answered carried 1 MB

    def call(request: Any, timeout: float) -> None:
        size = len(request) if isinstance(request, bytes) else request.ByteSize()
        if size >= MB and answered.count(True) == 2:
            raise Terminated()  # SIGTERM arriving while the third big one is on its way
        answered.append(size >= MB)

    rpcs = methods()
    run = Run(requests=40, big=10, seed=1, methods=len(rpcs))
    calls = {path: call for path, _, _, _ in rpcs}
    with pytest.raises(Terminated):
        send_fuzzed(calls, rpcs, random.Random(1), run, big_at={3, 9, 11, 30}, queued="q")
    assert (run.sent, run.big_sent) == (len(answered), answered.count(True)) == (11, 2)


@pytest.mark.parametrize("refused", [False, True])
def test_a_watch_that_matches_nothing_yet_answers_once_set_up_and_a_refused_one_its_error(
    refused: bool,
) -> None:
    # a WatchEvents whose filters match no event sends nothing for hours: the fuzzer's call
    # ends once gpud has set it up (its initial metadata), not at its deadline
    ended = threading.Event()

    def watch(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        if refused:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "gpu: expected a GPU index")
        # before the metadata: the caller may cancel as soon as it has it, and a callback
        # added to an ended call is never run
        context.add_callback(ended.set)
        context.send_initial_metadata((("gpud-watching", "1"),))
        ended.wait()  # no event ever matches
        yield b""

    path = "/gpud.v1.Node/WatchEvents"
    handler = grpc.method_handlers_generic_handler(
        "gpud.v1.Node", {"WatchEvents": grpc.unary_stream_rpc_method_handler(watch)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    with short_dir() as d:
        server.add_insecure_port(f"unix:{d / 'gpud.sock'}")
        server.start()
        try:
            with grpc.insecure_channel(f"unix:{d / 'gpud.sock'}") as channel:
                first = first_of_stream(
                    channel, path, node_pb2.WatchEventsResponse, lambda m: m.SerializeToString()
                )
                if refused:
                    with pytest.raises(grpc.RpcError) as err:
                        first(node_pb2.WatchEventsRequest(gpu="x"), timeout=60)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                else:
                    assert first(node_pb2.WatchEventsRequest(job="none"), timeout=60) is None
                    ended.wait(60)  # cancelled, not left open
                    assert ended.is_set()
        finally:
            server.stop(None)


class _RefusedTooLarge(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self) -> str:
        return "SERVER: Received message larger than max (1000004 vs. 262144)"


class _RefusedStream:
    """A WatchEvents gRPC refused for its size: empty initial metadata, the status not yet
    in (done() False) as the fuzzer asks, the refusal as it reads on."""

    def initial_metadata(self) -> tuple[()]:
        return ()

    def done(self) -> bool:
        return False

    def __iter__(self) -> _RefusedStream:
        return self

    def __next__(self) -> Any:
        raise _RefusedTooLarge()

    def cancel(self) -> bool:
        return True


def test_a_watch_refused_for_its_size_before_its_status_came_is_counted_refused_not_set_up() -> (
    None
):
    with pytest.raises(grpc.RpcError) as err:
        first_of(_RefusedStream(), "/gpud.v1.Node/WatchEvents")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_summary_names_each_big_request_not_refused_for_its_size_by_method_and_field(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def call(request: Any, timeout: float) -> None:
        if not isinstance(request, bytes) and request.DESCRIPTOR.name == "WatchEventsRequest":
            return  # as a stream set up with the 1 MB in it would be
        raise _RefusedTooLarge()

    rpcs = [
        r for r in methods() if r[0] in ("/gpud.v1.Node/WatchEvents", "/gpud.v1.Node/GetStatus")
    ]
    run = Run(requests=40, big=40, seed=1, methods=len(rpcs))
    calls = {path: call for path, _, _, _ in rpcs}
    send_fuzzed(calls, rpcs, random.Random(1), run, big_at=set(range(40)), queued="q")
    run.alive, run.rss_warm, run.rss_end = True, 70.0, 71.0
    assert report(run, max_growth_mb=20) == 1
    out = capsys.readouterr().out
    watches = run.big_outcomes["OK"]
    assert 0 < watches < 40, out
    assert f"of them with 1 MB: RESOURCE_EXHAUSTED {40 - watches}, OK {watches}" in out, out
    # GetStatus has no string field: its 1 MB are raw bytes, refused whole
    assert re.search(
        r"  \d+ x /gpud.v1.Node/WatchEvents (kind_prefix|gpu|job): OK: $", out, re.M
    ), out


class _Invalid(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self) -> str:
        return "jobs[0].job: longer than 256 characters"


def test_the_peer_mode_sends_the_peer_methods_as_the_peer_and_wants_big_ones_refused_by_gpud(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """ClusterPeer only, with the peer's own node name in half the requests that name one
    (so they pass the identity check), and a 1 MB request refused by gpud (INVALID_ARGUMENT)
    rather than by gRPC for its size: the peer port takes up to 16 MiB."""
    rpcs = methods(peer=True)
    paths = {r[0] for r in rpcs}
    assert paths == {f"/gpud.v1.ClusterPeer/{m}" for m in ("Report", "GetOrder", "GetNodes")}
    assert not paths & {r[0] for r in methods()}
    named: list[str] = []

    def call(request: Any, timeout: float) -> None:
        if not isinstance(request, bytes) and "node" in request.DESCRIPTOR.fields_by_name:
            named.append(request.node)
        raise _Invalid()

    run = Run(requests=60, big=20, seed=1, methods=len(rpcs))
    calls = {path: call for path in paths}
    send_fuzzed(
        calls, rpcs, random.Random(1), run, big_at=set(range(20)), queued="", node="fuzz-peer"
    )
    assert 0 < named.count("fuzz-peer") < len(named)
    run.alive, run.rss_warm, run.rss_end = True, 70.0, 71.0
    assert report(run, max_growth_mb=20) == 0, capsys.readouterr().out


# a benchmark's shape: a simulated gpud, then work it prints nothing about until its end
BENCHMARK = """
import time
from tools.simdaemon import simulated_gpud
with simulated_gpud("H100-SXM5-80GB:1", config_text="[mps]\\nenabled = true\\n") as daemon:
    print("measuring", flush=True)
    while True:
        time.sleep(1)
"""


def test_a_sigterm_to_any_tool_on_a_simulated_gpud_stops_it_and_removes_its_directory() -> None:
    with running_tool(["-c", BENCHMARK], began="measuring") as tool:
        rest = stopped_by(tool, signal.SIGTERM)
        assert tool.proc.returncode != 0 and "Terminated" in rest, rest
        assert list(tool.tmp.iterdir()) == []
        assert tool.left() == []


def test_a_tool_killed_outright_takes_its_simulated_gpud_with_it() -> None:
    # SIGKILL (`timeout -k`, a cancelled CI job): the tool runs no cleanup, and gpud, in a
    # process group of its own, is not reached by one sent to the tool's
    script = BENCHMARK.replace("[mps]\\nenabled = true\\n", "")  # gpud alone, no MPS
    assert script != BENCHMARK
    with running_tool(["-c", script], began="measuring") as tool:
        stopped_by(tool, signal.SIGKILL)
        for pid in tool.pids:  # a guard, not a measure: gpud stops in order on its SIGTERM
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).wait(timeout=120)
        assert tool.pids and tool.left() == []
        assert list(tool.tmp.iterdir()) != []  # the tool could not remove it: running_tool does


# starts a command of its own, then never says it began
SILENT = """
import subprocess, time
child = subprocess.Popen(["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(f"started {child.pid}", flush=True)
time.sleep(600)
"""


def test_a_tool_that_never_says_it_began_is_killed_with_what_it_started() -> None:
    tool = running_tool(["-c", SILENT], began="measuring", begin_guard_s=1)
    with pytest.raises(AssertionError) as failed, tool:
        pass
    found = re.search(r"started (\d+)", str(failed.value))
    assert found, failed.value
    pid = int(found[1])
    try:
        assert not alive(pid)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


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


def test_a_benchmark_in_rounds_stopped_says_how_many_it_did_and_fails() -> None:
    argv = ["-m", "tools.bench_gpuctl", "--reps", "100000", "--simulate", "H100-SXM5-80GB:1"]
    with running_tool(argv, began="measuring: ") as tool:
        rest = stopped_by(tool, signal.SIGINT)
        assert tool.proc.returncode == -signal.SIGINT, rest
        assert re.search(r"cut short by SIGINT after \d+ of 100000 repetitions", rest), rest
        assert list(tool.tmp.iterdir()) == []
        assert tool.left() == []


def test_a_signal_just_as_the_simulated_gpud_directory_is_made_still_has_it_removed(
    tmp_path: Path,
) -> None:
    def as_mkdtemp_returns(frame: FrameType, event: str, arg: object) -> None:
        # SIGTERM the moment the directory exists: its handler runs back in simulated_gpud,
        # before anything after the mkdtemp call
        if event == "return" and frame.f_code.co_name == "mkdtemp":
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        with pytest.raises(Terminated):
            sys.setprofile(as_mkdtemp_returns)
            with simdaemon.simulated_gpud("H100-SXM5-80GB:1", root=tmp_path):
                pytest.fail("gpud started despite the SIGTERM")
    finally:
        sys.setprofile(None)
    assert list(tmp_path.iterdir()) == []
