"""The Net API end to end over a unix socket: gpud.client.Progress, gpuctl net, metrics."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpud.api import ApiServer
from gpud.cli.main import main
from gpud.client import Progress, job_dscp, set_socket_tos
from gpud.client import progress as progress_module
from gpud.config import TrafficConfig
from gpud.events import EventLog
from gpud.metrics import Collector
from gpud.net.api import NetServicer
from gpud.net.enforce import FakeMarker, FakeTc
from gpud.net.metrics import TrafficMetrics
from gpud.net.service import Report, TrafficService, job_pool
from gpud.net.tagstore import TagStore
from gpud.store import StateStore
from gpud.v1 import net_pb2, net_pb2_grpc
from tests.unit.api_support import ServerThread, fork_mid_grpc_import, short_dir
from tests.unit.other_user import as_nobody, needs_root


class Node:
    def __init__(
        self,
        state: Path,
        dscp_pool: str = "",
        interfaces: tuple[str, ...] = ("eth0",),
        *,
        enabled: bool = True,
        levels: int = 4,
        marking: bool = True,
        monotonic: Callable[[], float] = time.monotonic,
        clock: Callable[[], float] = time.time,
        active: Callable[[], set[str]] = set,
    ) -> None:
        self.jobs = ["train-a", "train-b"]
        self.config = TrafficConfig(
            enabled=enabled,
            interfaces=interfaces,
            link_rates=tuple(f"{i}=10gbit" for i in interfaces),
            levels=levels,
            dscp_pool=dscp_pool,
            marking=marking,
        )
        self.tc = FakeTc()
        self.service = TrafficService(
            self.config,
            tags=TagStore(StateStore(state), pool=job_pool(self.config)),
            events=EventLog(None),
            jobs=lambda: list(self.jobs),
            tc=self.tc,
            marker=FakeMarker(),
            clock=clock,
            monotonic=monotonic,
            active=active,
        )


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path / "state")


@pytest.fixture
def sock(node: Node) -> Iterator[Path]:
    with short_dir() as d:
        path = d / "gpud.sock"
        with ServerThread(ApiServer(path, servicers=[NetServicer(node.service).register])):
            yield path


def gpuctl(capsys: pytest.CaptureFixture[str], sock: Path, *argv: str) -> tuple[int, str, str]:
    code = main(["--socket", str(sock), *argv], env={})
    out, err = capsys.readouterr()
    return code, out, err


def test_progress_batches_reports_to_the_daemon(node: Node, sock: Path) -> None:
    p = Progress("train-a", socket=sock, flush_interval_s=0.05, contention_free_iteration_s=0.1)
    try:
        for _ in range(50):
            p.step()
        assert p.flush(timeout=10)
    finally:
        p.close()
    assert p.sent == 50 and p.dropped == 0 and p.rejected == 0
    assert node.service.accepted_reports == 50
    node.service.tick()
    (a,) = [j for j in node.service.local_report().jobs if j.job == "train-a"]
    assert a.iterations == 50 and a.contention_free_iteration_s == 0.1


def test_a_step_after_close_is_dropped_and_a_flush_after_close_returns_true_at_once(
    node: Node, sock: Path
) -> None:
    """close() sends what is held and stops the sender: a step after it counts on, its
    report counted as dropped (no sender is left to send it), and flush() after it returns
    True at once, everything accounted for. It returned False, the step neither sent nor
    counted as dropped."""
    p = Progress("train-a", socket=sock, flush_interval_s=60)
    p.step()
    p.close()
    assert (p.sent, p.dropped) == (1, 0)
    p.step(2)
    assert p.flush(timeout=0) is True
    assert p.flush() is True  # no timeout: returns all the same, never waits
    assert (p.iterations, p.sent, p.dropped, p.rejected) == (3, 1, 1, 0)
    assert node.service.accepted_reports == 1


def test_a_send_the_close_could_not_wait_for_never_lowers_dropped(node: Node, sock: Path) -> None:
    """A sender still in its try when close() gives up on it (held here in its wait, as one
    importing gRPC would be) may send that try yet: dropped counts as the sender does until
    it ends (the report it has not drained is not counted at the close), never falling, and
    the channel the late try makes is closed when it ends."""
    entered, release = threading.Event(), threading.Event()
    tries = 0

    def wait(wake: threading.Event, timeout: float) -> bool:
        nonlocal tries
        tries += 1
        if tries == 2:  # the wait after the try the first flush woke
            entered.set()
            release.wait()
            return True
        return wake.wait(timeout)

    p = Progress("train-a", socket=sock, flush_interval_s=60, wait=wait)
    assert p.flush(timeout=5)
    assert entered.wait(5)
    p.step()  # drained only once the sender is let go, after the close gave up on it
    p.close(timeout=0.1)
    said_at_close = p.dropped
    assert said_at_close == 0
    release.set()
    assert p.flush(timeout=5) is True  # waits for the late sender to end
    assert (p.sent, p.dropped) == (1, 0)
    assert said_at_close <= p.dropped
    assert node.service.accepted_reports == 1
    assert p._channel is None  # the channel the late try made is closed with it


def test_what_a_close_could_not_send_is_counted_as_dropped() -> None:
    """gpud away at the close: the reports it held are never sent, counted in dropped, and
    flush() after the close says everything is accounted for."""
    with short_dir() as d:
        p = Progress("train-a", socket=d / "gpud.sock", flush_interval_s=60, call_timeout_s=0.2)
        for _ in range(3):
            p.step()
        p.close(timeout=0.1)
    assert (p.sent, p.dropped) == (0, 3)
    assert p.flush(timeout=0) is True


def test_progress_sends_a_full_buffer_in_batches_the_api_accepts(node: Node, sock: Path) -> None:
    # a second of a fast loop, or what waited through a gpud restart: more reports than the
    # API takes in one call (its bound on a repeated field)
    p = Progress("train-a", socket=sock, flush_interval_s=60)
    try:
        for _ in range(1000):
            p.step()
        assert p.flush(timeout=10)
    finally:
        p.close()
    assert p.sent == 1000 and p.dropped == 0 and p.rejected == 0, p.last_error
    assert node.service.accepted_reports == 1000


def test_a_batch_refused_whole_is_counted_and_does_not_block_the_reports_after_it(
    node: Node, sock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a client whose batches exceed what the API takes (an older client, a lower bound in
    # a newer gpud): the call is refused whole, and sending it again could never succeed
    monkeypatch.setattr(progress_module, "MAX_BATCH", 1000)
    p = Progress("train-a", socket=sock, flush_interval_s=60)
    try:
        for _ in range(300):
            p.step()
        assert p.flush(timeout=10)
        assert p.rejected == 300 and p.sent == 0
        assert "more than 256" in (p.last_error or "")
        for _ in range(10):
            p.step()
        assert p.flush(timeout=10)
    finally:
        p.close()
    assert p.sent == 10 and node.service.accepted_reports == 10


def _forked_exit(p: Progress) -> int | None:
    """The exit code of a forked child that steps, closes and exits; None when it hangs
    (killed after 30 s, a hang guard). Its close and flush would wait without end for
    reports only the parent's thread sends: a child that waits on the parent hangs."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        p.step()  # a worker's copy takes steps and never blocks
        p.close(timeout=3600.0)  # what exiting runs, but waiting without end if it waits
        p.flush()  # no timeout: says False (the step is not sent) instead of waiting
        os._exit(0)
    started = time.monotonic()
    while time.monotonic() - started < 30:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_a_forked_child_exits_without_waiting_for_the_parent_and_sends_nothing(
    node: Node, sock: Path
) -> None:
    # DataLoader workers fork the training process: its Progress copy has no sender thread
    # and the parent's buffer, perhaps its lock held by the parent's sender when it forked.
    p = Progress("train-a", socket=sock, flush_interval_s=60)
    try:
        p.step()
        assert p.flush(timeout=10)  # the parent's channel is open
        for _ in range(5):
            p.step()  # buffered, not sent yet
        assert _forked_exit(p) == 0
        locked, release = threading.Event(), threading.Event()

        def hold() -> None:
            with p._flushed:
                locked.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        locked.wait(10)
        try:
            assert _forked_exit(p) == 0
        finally:
            release.set()
            holder.join()
        assert p.flush(timeout=10)
    finally:
        p.close()
    assert p.sent == 6 and node.service.accepted_reports == 6  # the children sent none


def test_a_worker_forked_while_the_parent_first_sends_reports_with_its_own_progress(
    node: Node, sock: Path
) -> None:
    # A DataLoader worker forked as the parent's sender made its first call: had the sender
    # been importing gRPC then, the child would hold grpc half-imported for good and its own
    # Progress's sender would die on it, reporting nothing.
    run = fork_mid_grpc_import(
        sock,
        make='p = gpud.client.Progress("train-a", socket=sock, flush_interval_s=0.01); p.step()',
        sent="p.flush(0.05)",
        child='q = gpud.client.Progress("train-a", socket=sock, flush_interval_s=0.01); q.step();'
        " os._exit(0 if q.flush(5) and q.sent == 1 else 1)",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert node.service.accepted_reports == 2  # the parent's step and the worker's


def test_a_worker_forked_while_another_thread_imports_grpc_gets_an_inert_progress(
    sock: Path,
) -> None:
    # A DataLoader worker forked while a thread of the program (not the Progress's) was
    # inside grpc's import: the worker's import of grpc would wait for good on that module's
    # lock, which no thread of the worker holds; its Progress is inert and says why instead.
    run = fork_mid_grpc_import(
        sock,
        make='threading.Thread(target=lambda: __import__("grpc"), daemon=True).start()',
        sent="False",
        child='q = gpud.client.Progress("train-a", socket=sock); q.step(); q.close();'
        ' os._exit(0 if q.last_error.startswith("gRPC was half-imported at a fork (grpc,")'
        " and q.dropped == 1 and threading.active_count() == 1 else 1)",
    )
    assert run.returncode == 0, run.stderr[-3000:]


def test_steps_from_several_threads_never_report_going_backwards(node: Node, sock: Path) -> None:
    # step() from two threads: one reads the count, the other steps and appends before the
    # first appends its (lower) count; gpud refuses a count lower than the session's last
    interleave: list[Progress] = []

    def clock() -> float:
        if interleave:
            interleave.pop().step()  # the other thread, between the read and the append
        return time.time()

    p = Progress("train-a", socket=sock, flush_interval_s=60, clock=clock)
    try:
        interleave.append(p)
        p.step()
        assert [c for c, _ in p._queue] == [2, 1]  # appended out of order
        assert p.flush(timeout=10)
    finally:
        p.close()
    assert p.rejected == 0 and p.sent == 2, p.last_error


def test_progress_keeps_the_newest_reports_while_the_daemon_is_down(node: Node) -> None:
    with short_dir() as d:
        path = d / "gpud.sock"
        p = Progress("train-a", socket=path, flush_interval_s=0.02, max_buffer=10)
        try:
            for _ in range(25):
                p.step()  # nobody listens: never blocks, never raises
            time.sleep(0.1)
            with ServerThread(ApiServer(path, servicers=[NetServicer(node.service).register])):
                assert p.flush(timeout=15)
        finally:
            p.close()
    assert p.sent == 10 and p.dropped == 15
    node.service.tick()
    (a,) = [j for j in node.service.local_report().jobs if j.job == "train-a"]
    assert a.iterations == 25  # the newest survived


def test_reports_buffered_while_gpud_was_down_count_when_stamped_not_when_sent(
    node: Node,
) -> None:
    """A job ran 40 iterations of 1 s while gpud was down; they arrive in one burst: the
    job ran at 1 s an iteration, not 40 in an instant."""
    start = time.time() - 40  # read once: the stamps are exactly 1 s apart
    stamps = iter([start + i for i in range(41)])
    with short_dir() as d:
        path = d / "gpud.sock"
        p = Progress(
            "train-a",
            socket=path,
            flush_interval_s=0.02,
            contention_free_iteration_s=0.5,
            clock=lambda: next(stamps, time.time()),
        )
        try:
            for _ in range(40):
                p.step()
            with _serve(node, path):
                assert p.flush(timeout=15)
        finally:
            p.close()
    node.service.tick()
    (a,) = [j for j in node.service.local_report().jobs if j.job == "train-a"]
    assert a.iterations == 40
    assert a.iteration_s == pytest.approx(1.0)
    assert a.rate is not None and a.rate <= 0.5 + 1e-9


def test_last_error_says_gpud_is_unreachable_since_when_and_what_is_buffered(
    node: Node,
) -> None:
    """While gpud is away ``last_error`` names its socket, since when, and how many reports
    wait and were dropped (not gRPC's bare DEADLINE_EXCEEDED); once it is back, for how long
    it was away and what that dropped."""
    with short_dir() as d:
        path = d / "gpud.sock"
        before = time.time()
        tries = Tries()
        p = Progress(
            "train-a",
            socket=path,
            flush_interval_s=0.02,
            max_buffer=10,
            call_timeout_s=0.3,
            wait=tries.wait,
        )
        try:
            for _ in range(25):
                p.step()
            # the sender pauses after each try, its last_error said: one try at least, two
            # where the first began before the last step
            tries.until_said(lambda: "10 reports buffered" in p.last_error)
            away = p.last_error
            with _serve(node, path):
                assert p.flush(timeout=15)
        finally:
            p.close()
    assert away.startswith(f"gpud unreachable at {path} since ")
    since = time.mktime(time.strptime(away.split(" since ")[1][:19], "%Y-%m-%d %H:%M:%S"))
    assert before - 1 <= since <= time.time()
    assert "DEADLINE_EXCEEDED" not in away
    assert ": 10 reports buffered, 15 dropped (the buffer keeps the newest 10)" in away
    assert p.last_error.startswith(f"gpud was unreachable at {path} from ")
    assert p.last_error.endswith(": 15 reports dropped meanwhile")
    assert p.sent == 10 and p.dropped == 15


def _said_while_unreachable(path: Path | str, *, target: str | None = None) -> str:
    """Progress's last_error once a try to reach gpud at ``path`` (or ``target``) failed."""
    tries = Tries()
    p = Progress("train-a", socket=path, target=target, call_timeout_s=0.3, wait=tries.wait)
    try:
        p.step()
        tries.until_said(lambda: "reports buffered" in p.last_error)
        return p.last_error
    finally:
        p.close()


def test_last_error_says_the_socket_path_names_a_file_that_is_no_socket(tmp_path: Path) -> None:
    """$GPUD_SOCKET set to a regular file or a directory by mistake: connect() is refused
    as if gpud were down, and last_error says what the path holds instead."""
    for path, kind in ((tmp_path / "gpud.sock", "a regular file"), (tmp_path, "a directory")):
        path.touch()
        said = _said_while_unreachable(path)
        assert said.startswith(
            f"gpud unreachable at {path} ({kind}, not a socket: $GPUD_SOCKET or socket= names"
            " gpud's socket, api.socket in its configuration) since "
        ), said


def test_last_error_names_target_and_a_path_through_a_regular_file(tmp_path: Path) -> None:
    """A target= that names a regular file is said with target=, not $GPUD_SOCKET; a path
    through a regular file (connect(): ENOTDIR) is said as such."""
    afile = tmp_path / "gpud.sock"
    afile.touch()
    said = _said_while_unreachable("unused", target=f"unix:{afile}")
    assert said.startswith(
        f"gpud unreachable at {afile} (a regular file, not a socket: target= names gpud's"
        " socket, api.socket in its configuration) since "
    ), said
    said = _said_while_unreachable(afile / "gpud.sock")
    assert said.startswith(
        f"gpud unreachable at {afile}/gpud.sock (a component of the path is a regular file:"
        " $GPUD_SOCKET or socket= names gpud's socket, api.socket in its configuration) since "
    ), said


def test_a_nul_in_the_socket_path_leaves_the_sender_trying(tmp_path: Path) -> None:
    """A NUL in socket= (which no syscall takes) is a gpud unreachable there, not the end
    of the sender thread."""
    said = _said_while_unreachable(f"{tmp_path}/gpud\0.sock")
    assert said.startswith(f"gpud unreachable at {tmp_path}/gpud\0.sock since "), said


def test_a_flush_returns_only_once_the_try_that_sent_the_reports_has_counted_them(
    node: Node,
) -> None:
    """The sender empties its pending reports before it says what became of them (gpud back
    after an outage: the clock it reads for how long). A flush while it is there has not
    returned yet; once it returns, sent and last_error say what that try did."""
    away, back = threading.Event(), threading.Event()
    reading, release = threading.Event(), threading.Event()
    held: list[Progress] = []

    def wait(wake: threading.Event, timeout: float) -> bool:
        # gpud starts while the sender pauses after a try that found it away: the next try
        # meets it listening, not its deadline running out as it appears
        if held and "gpud unreachable" in held[0].last_error:
            away.set()
            assert back.wait(60), "never let go"
        return wake.wait(timeout)

    def clock() -> float:
        # the sender's read once gpud accepted the reports: the try is between emptying its
        # pending reports and saying gpud is back
        if threading.current_thread().name.startswith("gpud-progress-") and held[0].sent:
            reading.set()
            assert release.wait(60), "never released"
        return time.time()

    with short_dir() as d:
        path = d / "gpud.sock"
        p = Progress(
            "train-a",
            socket=path,
            flush_interval_s=0.02,
            call_timeout_s=1.0,
            clock=clock,
            wait=wait,
        )
        held.append(p)
        try:
            for _ in range(5):
                p.step()
            assert away.wait(60), p.last_error
            with _serve(node, path):
                back.set()
                assert reading.wait(60), p.last_error
                assert not p.flush(timeout=0.05)  # the try has not counted them yet
                release.set()
                assert p.flush(timeout=15)
                sent, said = p.sent, p.last_error
        finally:
            back.set()
            release.set()
            p.close()
    assert sent == 5
    assert said.startswith(f"gpud was unreachable at {path} from "), said
    assert said.endswith(": 0 reports dropped meanwhile"), said


def test_last_error_counts_no_negative_outage_after_the_wall_clock_steps_back() -> None:
    """An NTP step back while gpud is away: the outage reads 0 s, not minus an hour."""
    wall = [time.time()]
    with short_dir() as d:
        p = Progress(
            "train-a",
            socket=d / "gpud.sock",
            flush_interval_s=0.02,
            call_timeout_s=0.2,
            clock=lambda: wall[0],
        )
        try:
            p.step()
            for _ in range(200):
                if "unreachable" in p.last_error:
                    break
                time.sleep(0.02)
            wall[0] += 10.0
            for _ in range(300):
                if "(10 s)" in p.last_error:
                    break
                time.sleep(0.02)
            first = p.last_error
            wall[0] -= 3600.0
            for _ in range(300):
                if p.last_error != first:
                    break
                time.sleep(0.02)
            stepped = p.last_error
        finally:
            p.close()
    assert "(10 s)" in first and "unreachable" in stepped
    assert " (0 s)" in stepped and "(-" not in stepped


class SlowNet(NetServicer):
    """gpud's Net API, answering each progress batch ``delay_s`` late (an overloaded gpud)."""

    def __init__(self, service: TrafficService, delay_s: float) -> None:
        super().__init__(service)
        self.delay_s = delay_s

    async def ReportProgressBatch(self, request: Any, context: Any) -> Any:
        await asyncio.sleep(self.delay_s)
        return await super().ReportProgressBatch(request, context)


def test_last_error_tells_a_slow_gpud_from_an_unreachable_one(node: Node) -> None:
    """A gpud that is connected but answers no call within ``call_timeout_s``: ``last_error``
    says it did not answer within that deadline, not that it is unreachable; once it answers
    again, for how long it did not."""
    with short_dir() as d:
        path = d / "gpud.sock"
        slow = SlowNet(node.service, delay_s=1.0)
        with ServerThread(ApiServer(path, servicers=[slow.register])):
            p = Progress("train-a", socket=path, flush_interval_s=0.02, call_timeout_s=0.3)
            try:
                p.step()
                for _ in range(200):
                    if p.last_error:
                        break
                    time.sleep(0.05)
                late = p.last_error
                slow.delay_s = 0.0
                assert p.flush(timeout=15)
            finally:
                p.close()
    assert late.startswith(f"gpud at {path} did not answer within 0.3 s (call_timeout_s) since ")
    assert "unreachable" not in late and ": 1 reports buffered, 0 dropped" in late
    assert p.last_error.startswith(
        f"gpud at {path} did not answer within 0.3 s (call_timeout_s) from "
    )
    assert p.last_error.endswith(": 0 reports dropped meanwhile")


def _serve(node: Node, path: Path) -> ServerThread:
    return ServerThread(ApiServer(path, servicers=[NetServicer(node.service).register]))


class Tries:
    """Progress's ``wait``: the sender thread's pauses, one after each try while gpud is away
    (a report pending), with their time limits."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._said = threading.Condition()

    def wait(self, wake: threading.Event, timeout: float) -> bool:
        with self._said:
            self.pauses.append(timeout)
            self._said.notify_all()
        return wake.wait(timeout)

    def until_said(self, said: Callable[[], bool]) -> None:
        """Until ``said`` holds at a pause (a hang guard of 60 s): what a try set is read
        once it has ended."""
        with self._said:
            assert self._said.wait_for(said, 60), self.pauses

    def until(self, n: int) -> int:
        """Until ``n`` pauses have begun (a hang guard of 60 s); how many have."""
        with self._said:
            assert self._said.wait_for(lambda: len(self.pauses) >= n, 60), self.pauses
            return len(self.pauses)


def _first_report_after(node: Node, before: int) -> None:
    """Until gpud has accepted more than ``before`` reports (no flush: the sender thread's
    own pace; a hang guard of 30 s)."""
    guard = time.monotonic() + 30
    while node.service.accepted_reports <= before:
        assert time.monotonic() < guard, "no report arrived"
        time.sleep(0.005)


# the tries while gpud is away: enough for gRPC's reconnect back-off, left to itself, to grow
# to seconds, several times CALL_S
AWAY_TRIES = 12
CALL_S = 0.25


def test_a_report_arrives_promptly_once_gpud_starts_after_the_job(node: Node) -> None:
    """While gpud is away each try waits inside gRPC for the channel, to its deadline: the
    thread wakes once a call_timeout_s, no busy retries; once gpud listens the report goes
    out on the try then waiting, or the one after it (gRPC finds the socket a few times a
    second, not at a back-off grown to seconds)."""
    tries = Tries()
    with short_dir() as d:
        path = d / "gpud.sock"
        p = Progress(
            "train-a", socket=path, flush_interval_s=0.05, call_timeout_s=CALL_S, wait=tries.wait
        )
        try:
            began = time.monotonic()
            p.step()
            tries.until(AWAY_TRIES)
            away_s = time.monotonic() - began
            # each try ran to its deadline, so the next one followed it at once
            assert set(tries.pauses[1:]) == {0.05}
            assert len(tries.pauses) <= 2 + away_s / CALL_S
            with _serve(node, path):
                listening = len(tries.pauses)
                _first_report_after(node, 0)
                assert len(tries.pauses) - listening <= 2, tries.pauses
        finally:
            p.close()


def test_a_report_arrives_promptly_once_gpud_restarts(node: Node) -> None:
    """As when gpud starts after the job: the report made while gpud restarted goes out on
    the try waiting when it listens again, or the one after it."""
    tries = Tries()
    with short_dir() as d:
        path = d / "gpud.sock"
        p = Progress(
            "train-a", socket=path, flush_interval_s=0.05, call_timeout_s=CALL_S, wait=tries.wait
        )
        try:
            with _serve(node, path):
                p.step()
                _first_report_after(node, 0)
            p.step()
            away = len(tries.pauses)
            tries.until(away + AWAY_TRIES)
            assert set(tries.pauses[away:]) == {0.05}  # each try waited to its deadline
            with _serve(node, path):
                listening = len(tries.pauses)
                _first_report_after(node, 1)
                assert len(tries.pauses) - listening <= 2, tries.pauses
        finally:
            p.close()


def test_progress_counts_rejected_reports(sock: Path) -> None:
    p = Progress("nobody", socket=sock, flush_interval_s=0.02)
    try:
        p.step()
        assert p.flush(timeout=10)
    finally:
        p.close()
    assert p.rejected == 1 and "no job 'nobody'" in p.last_error


def test_only_local_rank_0_reports_unless_asked(
    node: Node, sock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four ranks of one job on a node, each with its own Progress (the README's loop under
    torchrun): local rank 0's reports are the job's; the others send nothing, hold no
    thread, and a flush of theirs has nothing to wait for."""
    ranks = []
    for rank in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        ranks.append(Progress("train-a", socket=sock, flush_interval_s=0.05))
    monkeypatch.setenv("LOCAL_RANK", "2")
    asked = Progress("train-b", socket=sock, flush_interval_s=0.05, active=True)
    try:
        assert [p.active for p in ranks] == [True, False, False, False]
        assert [p._thread.is_alive() for p in ranks] == [True, False, False, False]
        for _ in range(20):
            for p in (*ranks, asked):
                p.step()
        assert all(p.flush(timeout=10) for p in (*ranks, asked))
    finally:
        for p in (*ranks, asked):
            p.close()
    assert [p.sent for p in ranks] == [20, 0, 0, 0] and asked.sent == 20
    assert [p.iterations for p in ranks] == [20] * 4  # counted on every rank all the same
    assert node.service.accepted_reports == 40


def test_progress_needs_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUD_JOB", raising=False)
    with pytest.raises(ValueError, match="no job name"):
        Progress()


def test_socket_tos_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUD_DSCP", "26")
    assert job_dscp() == 26
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        assert set_socket_tos(s) == 104
        assert s.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == 104
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
        set_socket_tos(s, 10)
        assert s.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS) == 40
    monkeypatch.setenv("GPUD_DSCP", "99")
    with pytest.raises(ValueError, match="GPUD_DSCP"):
        job_dscp()


def test_gpuctl_net_report_and_show(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # the clocks stand still: the long-run rate also counts the time since the last report,
    # which a slow run would otherwise read lower
    now = time.time()
    node = Node(tmp_path / "state", clock=lambda: now, monotonic=lambda: 1000.0)
    with short_dir() as d:
        sock = d / "gpud.sock"
        with ServerThread(ApiServer(sock, servicers=[NetServicer(node.service).register])):
            _report_and_show(capsys, node, sock, now)


def _report_and_show(
    capsys: pytest.CaptureFixture[str], node: Node, sock: Path, now: float
) -> None:
    for i in (1, 2, 3):
        code, _, err = gpuctl(
            capsys, sock, "net", "report", "--job", "train-a", "--iterations", str(i),
            "--timestamp", str(now - 3 + i), "--ideal", "0.5",
        )  # fmt: skip
        assert code == 0, err
    code, _, err = gpuctl(capsys, sock, "net", "report", "--job", "train-a", "--iterations", "1")
    assert code == 2 and "going backwards" in err
    code, _, err = gpuctl(capsys, sock, "net", "report", "--job", "zz", "--iterations", "1")
    assert code == 4 and "no job 'zz'" in err
    code, _, err = gpuctl(
        capsys, sock, "net", "report", "--job", "train-a", "--iterations", "9",
        "--timestamp", str(now + 3600),
    )  # fmt: skip
    assert code == 2 and "in the future" in err
    node.service.tick()
    code, out, _ = gpuctl(capsys, sock, "net", "show")
    assert code == 0
    # 1 s per iteration, 0.5 s alone
    (row,) = [line for line in out.splitlines() if line.startswith("train-a")]
    assert row.split()[3] == "running"
    assert float(row.split()[4]) == pytest.approx(0.5, abs=0.05)
    assert "eth0" in out and "10 Gbit/s" in out
    code, out, _ = gpuctl(capsys, sock, "net", "show", "--json")
    doc = json.loads(out)
    (a,) = [j for j in doc["jobs"] if j["job"] == "train-a"]
    assert a["iterations"] == 3 and a["progress_rate"] == pytest.approx(0.5, abs=0.05)
    assert a["level"] == 0 and doc["interfaces"][0]["enforced"] is True
    assert [lv["level"] for lv in doc["levels"]] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "session", ["a\nforged line", "x\x1b[2J", "nul\x00", "\u202eevil", "s" * 65]
)
def test_a_report_session_that_is_not_one_short_line_is_refused(
    capsys: pytest.CaptureFixture[str], node: Node, sock: Path, session: str
) -> None:
    """A progress report's session with a control character (newline, escape sequence,
    NUL), another unprintable one, or over 64 characters: INVALID_ARGUMENT naming the
    field from the API, in a batch a rejected report; `gpuctl net report --session` refuses
    it before sending (exit 2)."""
    import grpc

    from gpud.v1 import net_pb2, net_pb2_grpc

    report = net_pb2.ReportProgressRequest(
        job="train-a", iterations=1, timestamp_unix_seconds=time.time(), session=session
    )
    with grpc.insecure_channel(f"unix:{sock}") as channel:
        stub = net_pb2_grpc.NetStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportProgress(report)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith("session: ")
        resp = stub.ReportProgressBatch(net_pb2.ReportProgressBatchRequest(reports=[report]))
        (rejected,) = resp.rejected
        assert rejected.code == "INVALID_ARGUMENT" and rejected.message.startswith("session: ")
    code, _, said = gpuctl(
        capsys, sock, "net", "report", "--job", "train-a", "--iterations", "1",
        "--session", session,
    )  # fmt: skip
    assert code == 2 and "argument --session: " in said
    assert node.service.accepted_reports == 0
    assert gpuctl(capsys, sock, "net", "report", "--job", "train-a", "--iterations", "1",
                  "--session", "restart 2 (é)")[0] == 0  # fmt: skip


def test_a_job_named_in_a_net_request_is_checked_as_every_job_name(
    capsys: pytest.CaptureFixture[str], sock: Path
) -> None:
    """A name no job can have (a control character in it) is a bad argument (exit 2), as
    in the jobs and co-location APIs, not an unknown job."""
    for argv in (("report", "--iterations", "1"), ("pin", "--level", "1"), ("unpin",)):
        code, _, err = gpuctl(capsys, sock, "net", argv[0], "--job", "a\nb", *argv[1:])
        assert code == 2 and "job: 'a\\nb': letters, digits" in err, err


def test_gpuctl_net_pin(capsys: pytest.CaptureFixture[str], node: Node, sock: Path) -> None:
    node.service.tick()
    code, out, _ = gpuctl(capsys, sock, "net", "pin", "--job", "train-b", "--level", "3")
    assert code == 0 and "pinned to level 3" in out
    code, _, err = gpuctl(capsys, sock, "net", "pin", "--job", "train-b", "--level", "9")
    assert code == 2 and "level" in err
    node.service.tick()
    assert {j.job: j.level for j in node.service.local_report().jobs}["train-b"] == 3
    code, out, _ = gpuctl(capsys, sock, "net", "unpin", "--job", "train-b")
    assert code == 0 and "unpinned" in out


def test_metrics(node: Node) -> None:
    node.service.tick()
    collector = Collector(lambda: None, events=EventLog(None), clock=lambda: 0.0)
    collector.add_source(TrafficMetrics(node.service))
    registry = CollectorRegistry()
    registry.register(collector)
    tag = node.service.tags.allocations()["train-a"]
    assert registry.get_sample_value("gpud_net_job_dscp", {"job": "train-a"}) == tag
    assert registry.get_sample_value("gpud_net_interface_enforced", {"interface": "eth0"}) == 1
    assert registry.get_sample_value("gpud_net_level_changes_total") == 0
    assert registry.get_sample_value("gpud_net_job_sent_bytes_total", {"job": "train-a"}) == 0
    assert registry.get_sample_value("gpud_net_level_min_share_ratio", {"level": "0"}) == 0.02


def _show(capsys: pytest.CaptureFixture[str], node: Node) -> tuple[str, str]:
    """``gpuctl net show`` and ``gpuctl net show --json`` against ``node``'s service."""
    with short_dir() as d:
        path = d / "gpud.sock"
        with ServerThread(ApiServer(path, servicers=[NetServicer(node.service).register])):
            code, out, _ = gpuctl(capsys, path, "net", "show")
            assert code == 0
            code, json_out, _ = gpuctl(capsys, path, "net", "show", "--json")
            assert code == 0
    return out, json_out


def test_a_job_left_without_a_tag_is_shown_and_counted(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    node = Node(tmp_path / "state", dscp_pool="10")
    for job in node.jobs:  # both in use: neither tag can be handed over
        node.service.report(Report(job, 1, time.time(), session="s"))
    node.service.tick()
    out, json_out = _show(capsys, node)
    (row,) = [line for line in out.splitlines() if line.startswith("train-b ")]
    assert row.split()[1] == "-" and " default (no tag) " in row
    assert "no tag: 1 job(s) in use hold no DSCP tag" in out
    assert "the default class until a tag frees): all 1 DSCP tags of traffic.dscp_pool" in out
    jobs = {j["job"]: j for j in json.loads(json_out)["jobs"]}
    assert jobs["train-a"]["dscp"] == 10 and jobs["train-a"]["error"] == ""
    assert jobs["train-b"]["dscp"] == 0 and "widen traffic.dscp_pool" in jobs["train-b"]["error"]
    collector = Collector(lambda: None, events=EventLog(None), clock=lambda: 0.0)
    collector.add_source(TrafficMetrics(node.service))
    registry = CollectorRegistry()
    registry.register(collector)
    assert registry.get_sample_value("gpud_net_untagged_jobs") == 1


def test_a_job_left_without_a_tag_shows_its_progress_in_its_row(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    node = Node(tmp_path / "state", dscp_pool="10")
    now = time.time()
    for job in node.jobs:  # both in use: neither tag can be handed over
        for n in range(1, 5):
            node.service.report(Report(job, n, now - 10 + 2 * n, ideal_s=1.0, session="s"))
    node.service.tick()
    out, json_out = _show(capsys, node)
    (row,) = [line.split() for line in out.splitlines() if line.startswith("train-b ")]
    # JOB DSCP LEVEL(3 words) STATE PROGRESS ITER ITER-TIME(2) REPORT-AGE(2) SENT PKTS DROPS
    assert row[1:6] == ["-", "default", "(no", "tag)", "running"]
    assert row[6] != "-" and row[7] == "4" and row[8:10] == ["2.0", "s"]
    assert row[-3:] == ["-", "-", "-"]  # its traffic is in the default class: no counters
    (b,) = [j for j in json.loads(json_out)["jobs"] if j["job"] == "train-b"]
    assert b["iterations"] == 4 and b["iteration_s"] == 2.0 and 0 < b["progress_rate"] <= 0.5
    assert b["contention_free_iteration_s"] == 1.0 and b["last_report_age_seconds"] >= 0
    assert b["dscp"] == 0 and b["level"] is None and b["counters"] is None and b["error"]


def test_untagged_jobs_are_flagged_in_the_table_the_refusal_said_once_idle_ones_counted(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    clock = [0.0]
    node = Node(tmp_path / "state", dscp_pool="10-12", monotonic=lambda: clock[0])
    running = [f"run-{i}" for i in range(5)]
    node.jobs = [*running, *(f"idle-{i:02d}" for i in range(7))]
    clock[0] = node.config.idle_after_s + 1  # past the start: jobs not heard from are idle
    for job in running:
        node.service.report(Report(job, 1, time.time(), session="s"))
    node.service.tick()
    out, json_out = _show(capsys, node)
    lines = out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("run-", "idle-"))}
    assert sorted(rows) == running  # the idle ones hold no tag: not rows
    assert sorted(rows[j][1] for j in running[:3]) == ["10", "11", "12"]
    for job in ("run-3", "run-4"):
        assert rows[job][1:5] == ["-", "default", "(no", "tag)"]
    assert sum("DSCP tags of traffic.dscp_pool" in line for line in lines) == 1
    assert "run-3" not in out.replace("run-3 ", "", 1)  # named in its row only
    assert "no tag: 2 job(s) in use hold no DSCP tag" in out
    assert "all 3 DSCP tags of traffic.dscp_pool are in use, each by a job that runs" in out
    assert "7 idle job(s) hold no tag (gpuctl jobs ls lists them): not shown, each takes one" in out
    assert max(len(line) for line in lines if line.startswith("run-")) < 120
    shown = json.loads(json_out)
    assert shown["idle_untagged_jobs"] == 7
    jobs = {j["job"]: j for j in shown["jobs"]}
    assert sorted(jobs) == running
    assert jobs["run-3"]["dscp"] == 0 and "job 'run-3': all 3 DSCP tags" in jobs["run-3"]["error"]


def test_a_level_of_many_jobs_names_a_few_and_counts_the_rest(
    capsys: pytest.CaptureFixture[str], node: Node
) -> None:
    node.jobs = [f"job-{i:03d}" for i in range(40)]
    for job in node.jobs:
        node.service.pin(job, 1)
    node.service.tick()
    out, json_out = _show(capsys, node)
    (row,) = [line for line in out.splitlines() if line.startswith("1 ")]
    assert "job-000,job-001," in row and "job-008" not in row and "(+32 more)" in row
    assert max(len(line) for line in out.splitlines()) < 120  # no row widened by the list
    (level,) = [lv for lv in json.loads(json_out)["levels"] if lv["level"] == 1]
    assert level["jobs"] == node.jobs


def test_a_level_that_is_no_level_is_a_usage_error_saying_what_a_level_is(
    capsys: pytest.CaptureFixture[str], sock: Path
) -> None:
    for bad in ("-1", "high", "1.5"):
        code, _, err = gpuctl(capsys, sock, "net", "pin", "--job", "train-a", "--level", bad)
        assert code == 2
        assert f"{bad!r} is not a level: 0 (the highest priority) up to traffic.levels - 1" in err
    code_, _, err = gpuctl(capsys, sock, "net", "pin", "--job", "train-a", "--level", "9")
    assert code_ == 2 and "level: must be in [0, 3]" in err


def test_show_says_no_interface_is_shaped_when_none_is_configured(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    node = Node(tmp_path / "state", interfaces=())
    node.service.tick()
    out, json_out = _show(capsys, node)
    assert "interfaces: none (traffic.interfaces is empty): no HTB tree anywhere" in out
    assert "INTERFACE " not in out
    assert json.loads(json_out)["interfaces"] == []


def test_show_with_marking_off_does_not_say_it_marks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    node = Node(tmp_path / "state", interfaces=(), marking=False)
    node.service.tick()
    out, json_out = _show(capsys, node)
    assert "no HTB tree anywhere; tags only" in out
    assert "marking" not in out.split("no HTB tree anywhere")[1].splitlines()[0]
    assert json.loads(json_out)["marking_off"] is True


def test_show_says_which_jobs_are_stopped_and_why_one_holds_no_level(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    now = [1_000_000.0]
    node = Node(
        tmp_path / "state",
        clock=lambda: now[0],
        monotonic=lambda: now[0],
        interfaces=(),
        active=lambda: {"train-a", "train-b"},  # their runs hold reservations
    )
    for n in range(1, 31):  # both report an iteration a second
        now[0] += 1
        for job in node.jobs:
            node.service.report(Report(job, n, now[0], ideal_s=0.5, session="s"))
        node.service.tick()
    node.service.pin("train-b", 2)
    now[0] += 180  # both stopped (SIGSTOP) for 3 minutes, silent past traffic.idle_after_s
    node.service.tick()
    out, json_out = _show(capsys, node)
    rows = {ln.split()[0]: " ".join(ln.split()) for ln in out.splitlines() if ln[:6] == "train-"}
    assert " default stopped 3m 00s " in rows["train-a"]
    assert " 2 (pinned) stopped 3m 00s " in rows["train-b"]
    assert (
        "train-a: stopped 3m 00s: no progress for over 20 iterations' time (SIGSTOP, a"
        " debugger?) and no report for traffic.idle_after_s: holds no level (its traffic is in"
        " the default class) until it reports progress"
    ) in out
    assert "train-b: stopped 3m 00s: no progress for over 20 iterations' time" in out
    assert "keeps its pinned level" in out
    body = json.loads(json_out)
    jobs = {j["job"]: j for j in body["jobs"]}
    assert jobs["train-a"]["stopped_seconds"] == 180 and jobs["train-a"]["stopped_unranked"]
    assert not jobs["train-b"]["stopped_unranked"] and body["stop_after_spacings"] == 20
    now[0] += 1
    node.service.report(Report("train-a", 31, now[0], ideal_s=0.5, session="s"))
    node.service.tick()
    out, _ = _show(capsys, node)
    (row,) = [ln.split() for ln in out.splitlines() if ln.startswith("train-a")]
    assert row[3] == "running" and "train-a: stopped" not in out


def _registry(node: Node) -> CollectorRegistry:
    collector = Collector(lambda: None, events=EventLog(None), clock=lambda: 0.0)
    collector.add_source(TrafficMetrics(node.service))
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def test_net_writes_are_refused_while_traffic_is_off(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    node = Node(tmp_path / "state", enabled=False)
    with short_dir() as d:
        path = d / "gpud.sock"
        with ServerThread(ApiServer(path, servicers=[NetServicer(node.service).register])):
            for argv in (
                ("pin", "--job", "train-a", "--level", "1"),
                ("unpin", "--job", "train-a"),
                ("report", "--job", "train-a", "--iterations", "1"),
            ):
                code, out, err = gpuctl(capsys, path, "net", *argv)
                assert code == 6, (argv, out, err)  # refused in the current state
                assert "traffic enforcement is off on this node (traffic.enabled = false)" in err
                assert "pinned" not in out
            p = Progress("train-a", socket=path, flush_interval_s=0.05)
            try:
                p.step()
                assert p.flush(timeout=10)
                assert p.rejected == 1 and "traffic.enabled = false" in p.last_error
            finally:
                p.close()
            code, out, _ = gpuctl(capsys, path, "net", "show")
            assert code == 0
            assert out.strip() == (
                "traffic enforcement is off (set [traffic] enabled = true in gpud.toml)"
            )
            code, out, _ = gpuctl(capsys, path, "net", "show", "--json")
            assert code == 0 and json.loads(out)["enabled"] is False
    assert node.service.tags.allocations() == {} and node.service.tags.pins() == {}


def test_a_pin_of_an_unknown_job_is_not_found_while_traffic_is_off(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A job gpud does not know is the more basic error: NOT_FOUND (exit 4), not the
    refusal of a traffic that is off (exit 6); a known job still gets the refusal."""
    node = Node(tmp_path / "state", enabled=False)
    with short_dir() as d:
        path = d / "gpud.sock"
        with ServerThread(ApiServer(path, servicers=[NetServicer(node.service).register])):
            for argv in (("pin", "--job", "nosuch", "--level", "1"), ("unpin", "--job", "nosuch")):
                code, out, err = gpuctl(capsys, path, "net", *argv)
                assert code == 4 and out == "", (argv, err)
                assert err == "gpuctl: no job 'nosuch' on this node (gpuctl jobs ls)\n"
                code, _, err = gpuctl(capsys, path, "net", *argv, "--json")
                assert code == 4 and json.loads(err)["error"]["code"] == "NOT_FOUND"
            code, _, err = gpuctl(capsys, path, "net", "pin", "--job", "train-a", "--level", "9")
            assert code == 6 and "traffic.enabled = false" in err
    assert node.service.tags.pins() == {}


def test_a_pin_clamped_to_fewer_levels_is_shown_as_clamped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    node = Node(tmp_path / "state")
    node.service.pin("train-b", 3)
    node = Node(tmp_path / "state", levels=2)  # restarted with traffic.levels = 2
    node.service.tick()
    out, json_out = _show(capsys, node)
    (row,) = [line for line in out.splitlines() if line.startswith("train-b ")]
    assert "1 (pinned 3, clamped)" in row
    assert (
        "train-b: pinned to level 3, beyond traffic.levels = 2: held at level 1 until"
        " traffic.levels is raised again (gpuctl net pin replaces it)"
    ) in out
    jobs = {j["job"]: j for j in json.loads(json_out)["jobs"]}
    assert jobs["train-b"]["pinned_level"] == 1
    assert jobs["train-b"]["pinned_level_clamped_from"] == 3
    assert jobs["train-a"]["pinned_level_clamped_from"] is None
    node.service.pin("train-b", 0)  # pinned again: no longer a clamped pin
    out, json_out = _show(capsys, node)
    assert "clamped" not in out
    jobs = {j["job"]: j for j in json.loads(json_out)["jobs"]}
    assert jobs["train-b"]["pinned_level"] == 0
    assert jobs["train-b"]["pinned_level_clamped_from"] is None


def test_marking_turned_off_exports_no_marking_gauge(tmp_path: Path) -> None:
    on = Node(tmp_path / "on")
    on.service.tick()
    assert _registry(on).get_sample_value("gpud_net_marking_ok") == 1
    off = Node(tmp_path / "off", marking=False)
    off.service.tick()
    registry = _registry(off)
    assert registry.get_sample_value("gpud_net_marking_ok") is None  # a setting, not a fault
    assert registry.get_sample_value("gpud_net_interface_enforced", {"interface": "eth0"}) == 1


@needs_root
def test_last_error_says_the_socket_refuses_the_jobs_user(open_dir: Path) -> None:
    """A job of a user outside the socket's group: ``last_error`` says permission denied,
    with the user and what to do, not that gpud is unreachable (it is there). Asked in a
    child of user nobody, of a call that met its deadline waiting for the channel (gRPC is
    not run in the forked child)."""
    import grpc

    class Deadline(grpc.RpcError):
        """What a report call that waited for the channel to connect raises."""

        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.DEADLINE_EXCEEDED

    path = open_dir / "gpud.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    os.chmod(path, 0o660)
    read, write = os.pipe()

    def report() -> int:
        p = Progress("train-a", socket=path, active=False, call_timeout_s=0.3)
        os.write(write, p._unreachable(Deadline(), time.time(), 0).encode())
        return 0

    try:
        code = as_nobody(report)
    finally:
        server.close()
        os.close(write)
    with os.fdopen(read) as said:
        message = said.read()
    assert code == 0, message
    uid = pwd.getpwnam("nobody").pw_uid
    assert message.startswith(
        f"permission denied on gpud's socket {path} to uid {uid} (run the job as root or as a"
        " member of gpud's api.socket_group) since "
    ), message
    assert "unreachable" not in message


def test_show_says_a_job_whose_run_ended_ended_with_no_stop_hint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A job whose run ended reads `ended 3m 00s ago`, not stopped with a SIGSTOP hint, and
    holds no level; `--json` gives `ended_seconds` and no `stopped_seconds`."""
    now = [1_000_000.0]
    node = Node(
        tmp_path / "state",
        clock=lambda: now[0],
        monotonic=lambda: now[0],
        interfaces=(),
        active=lambda: {"train-b"},  # train-b's run holds its reservation
    )
    for n in range(1, 31):
        now[0] += 1
        for job in node.jobs:
            node.service.report(Report(job, n, now[0], ideal_s=0.5, session="s"))
        node.service.tick()
    node.service.run_ended("train-a")  # its run's reservation released
    now[0] += 180
    node.service.tick()
    out, json_out = _show(capsys, node)
    rows = {ln.split()[0]: " ".join(ln.split()) for ln in out.splitlines() if ln[:6] == "train-"}
    assert " default ended 3m 00s ago " in rows["train-a"]
    assert "train-a: stopped" not in out and "train-b: stopped 3m 00s" in out
    jobs = {j["job"]: j for j in json.loads(json_out)["jobs"]}
    assert jobs["train-a"]["ended_seconds"] == 180 and jobs["train-a"]["stopped_seconds"] is None
    assert jobs["train-b"]["ended_seconds"] is None


def test_a_progress_report_from_one_session_too_many_is_resource_exhausted(
    node: Node, sock: Path
) -> None:
    """A job whose live sessions are at the most gpud keeps (a client making a session per
    report): the one more is rejected RESOURCE_EXHAUSTED, naming the job, and the others
    taken."""
    import grpc

    from gpud.net.service import MAX_JOB_SESSIONS
    from gpud.v1 import net_pb2, net_pb2_grpc

    now = time.time()
    reports = [
        net_pb2.ReportProgressRequest(
            job="train-a", iterations=1, timestamp_unix_seconds=now, session=f"s{i}"
        )
        for i in range(MAX_JOB_SESSIONS + 1)
    ]
    with grpc.insecure_channel(f"unix:{sock}") as channel:
        stub = net_pb2_grpc.NetStub(channel)
        for i in range(0, MAX_JOB_SESSIONS, 256):
            batch = net_pb2.ReportProgressBatchRequest(reports=reports[i : i + 256])
            assert not stub.ReportProgressBatch(batch).rejected
        last = net_pb2.ReportProgressBatchRequest(reports=reports[MAX_JOB_SESSIONS:])
        (rejected,) = stub.ReportProgressBatch(last).rejected
    assert rejected.code == "RESOURCE_EXHAUSTED"
    assert rejected.message.startswith(f"job 'train-a': {MAX_JOB_SESSIONS} sessions")
    assert node.service.accepted_reports == MAX_JOB_SESSIONS


class _Shows(net_pb2_grpc.NetServicer):
    """A Net service whose ShowNet answers ``shown``."""

    def __init__(self, shown: net_pb2.ShowNetResponse) -> None:
        self.shown = shown

    def register(self, server: Any) -> None:
        net_pb2_grpc.add_NetServicer_to_server(self, server)

    async def ShowNet(self, request: Any, context: Any) -> net_pb2.ShowNetResponse:
        return self.shown


@pytest.mark.parametrize(
    ("shown", "line"),
    [
        (net_pb2.ShowNetResponse(enabled=True), "marking by cgroup (nftables): ok"),
        (
            net_pb2.ShowNetResponse(enabled=True, marking_restores=3),
            "marking by cgroup (nftables): ok (restores: 3)",
        ),
        (
            net_pb2.ShowNetResponse(
                enabled=True, marking_error="nft: timed out", marking_restores=1
            ),
            "marking by cgroup (nftables): nft: timed out (restores: 1)",
        ),
        (
            # as the daemon sends it: the setting is its reason (gpud.net.wiring)
            net_pb2.ShowNetResponse(
                enabled=True, marking_off=True, marking_error="off (traffic.marking = false)"
            ),
            "marking by cgroup (nftables): off (traffic.marking = false)",
        ),
    ],
    ids=["ok", "restores", "failing", "off"],
)
def test_net_show_says_the_marking_and_how_often_its_table_was_written_again(
    capsys: pytest.CaptureFixture[str], shown: net_pb2.ShowNetResponse, line: str
) -> None:
    with short_dir() as d:
        path = d / "gpud.sock"
        with ServerThread(ApiServer(path, servicers=[_Shows(shown).register])):
            code, out, _ = gpuctl(capsys, path, "net", "show")
            assert code == 0 and line in out.splitlines()
            code, out, _ = gpuctl(capsys, path, "net", "show", "--json")
    assert code == 0 and json.loads(out)["marking_restores"] == shown.marking_restores


def test_a_try_woken_by_the_close_gives_up_at_once_on_an_absent_gpud() -> None:
    """A sender in its wait when close() stops it (here held there until the stop) tries
    once more: that try no longer waits call_timeout_s for gpud to listen, so the sender
    ends with the close's join, its channel closed, the report counted dropped. It made a
    new channel and waited out the minute, the close's join and a flush after giving up."""
    holder: list[Progress] = []

    made = threading.Event()

    def wait(wake: threading.Event, timeout: float) -> bool:
        made.wait()
        holder[0]._stop.wait()
        return True

    with short_dir() as d:
        p = Progress(
            "train-a", socket=d / "gpud.sock", flush_interval_s=60, call_timeout_s=60, wait=wait
        )
        holder.append(p)
        made.set()
        p.step()
        p.close(timeout=0.1)
        assert p.flush(timeout=30) is True
        assert not p._thread.is_alive()
        assert p._channel is None
        assert (p.sent, p.dropped) == (0, 1)


def test_a_flush_with_no_timeout_after_the_close_waits_a_stuck_sender_a_call_at_most(
    node: Node, sock: Path
) -> None:
    """flush() with no timeout after a close that gave up on its sender (held here in its
    wait, as one stuck in an import would be) waits call_timeout_s and a second for it, then
    says False: not all is accounted for yet. It waited for as long as the sender was stuck."""
    entered, release = threading.Event(), threading.Event()
    tries = 0

    def wait(wake: threading.Event, timeout: float) -> bool:
        nonlocal tries
        tries += 1
        if tries == 2:
            entered.set()
            release.wait()
            return True
        return wake.wait(timeout)

    p = Progress("train-a", socket=sock, flush_interval_s=60, call_timeout_s=0.2, wait=wait)
    assert p.flush(timeout=5)
    assert entered.wait(5)
    p.step()
    p.close(timeout=0.1)
    # lets go of the sender only well after the bounded wait, should the flush not end
    letting_go = threading.Timer(30, release.set)
    letting_go.start()
    try:
        assert p.flush() is False
    finally:
        letting_go.cancel()
        release.set()
    assert p.flush(timeout=5) is True
    assert (p.sent, p.dropped) == (1, 0)
