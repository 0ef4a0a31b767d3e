"""A ``gpud --simulate`` daemon in temporary directories, for the benchmarks and the fuzzer.

::

    with simulated_gpud("A100-SXM4-40GB:2") as daemon:
        daemon.socket        # its gRPC unix socket
        daemon.pid           # for its RSS
        daemon.metrics_url   # http://127.0.0.1:PORT/metrics

Runs ``python -m gpud.main`` with this interpreter, a config file of its own, and its own state
and run directories under a fresh temporary directory (removed afterwards, with the daemon
stopped by SIGTERM, or killed if it does not stop, and the MPS control daemons it left
running killed: :func:`kill_mps_daemons`). The daemon runs in a process group of its own, so
that a Ctrl-C at the terminal, or ``timeout``'s SIGTERM to its group, reaches the tool alone,
which then stops it. A tool killed outright (SIGKILL: ``timeout -k``, a cancelled CI job)
cannot: the kernel sends the daemon SIGTERM as the tool's thread that started it exits
(PR_SET_PDEATHSIG, :mod:`gpud.pdeathsig`), so start it from a thread that outlives it. Its
temporary directory is left then.

While it runs (from the main thread), SIGTERM and SIGINT raise KeyboardInterrupt (SIGTERM as
:class:`Terminated`): the daemon is stopped and the directories removed as the ``with``
unwinds. A tool that prints what it has so far takes them itself, :func:`stopped_by_signal`,
and says it was cut short with :func:`cut_short`::

    with stopped_by_signal() as stopped:
        with simulated_gpud(spec) as daemon:
            ...  # measures, recording as it goes
    ...  # prints what it measured so far
    if stopped.by:  # e.g. "SIGTERM"
        return cut_short(stopped.by, f"{done} of {planned} rounds")  # 128 + its number

in a ``main`` under :func:`restores_signals`, run as ``exit_as(main())``: a tool cut short
dies by the signal once it has printed its report, as a shell loop expects. Meanwhile a second
signal is only noted; a third ends the tool at once (a report stuck on a full pipe), except in
the middle of a cleanup (:func:`held`: a daemon being stopped, a network namespace deleted),
which finishes first.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any, NoReturn, ParamSpec

from gpud.mps.procs import alive
from gpud.pdeathsig import dies_with_parent


@dataclass(frozen=True)
class SimDaemon:
    pid: int
    socket: Path
    metrics_url: str
    log: Path


def kill_mps_daemons(root: Path, *, quit_first: bool = False) -> list[int]:
    """Stop every MPS control daemon whose PID file lies under ``root``: gpud leaves them
    running at its stop, for the next start to adopt. SIGKILL (the fake one's servers exit
    with it); ``quit_first``: ``echo quit`` to it first, through its own program and pipe
    directory, as a real daemon's servers want (killed only if still there 10 s later).
    Returns the PIDs of those that were running."""
    stopped = []
    for pid_file in root.rglob("nvidia-cuda-mps-control.pid"):
        with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
            pid = int(pid_file.read_text())
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
            # a control daemon still: the PID of one that died may have been reused
            if not alive(pid) or not any(b"mps" in arg for arg in argv):
                continue
            stopped.append(pid)
            if quit_first:
                env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pid_file.parent)}
                command = [os.fsdecode(a) for a in argv if a != b"-d"]
                subprocess.run(command, input=b"quit\n", env=env, timeout=10, check=False)
                deadline = time.monotonic() + 10
                while alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    return stopped


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl-C's KeyboardInterrupt is, so that the same cleanup runs."""


class _Signals:
    """SIGTERM and SIGINT as received under :func:`stop_on_signals`: the first is raised in
    the main thread, unless a daemon is being stopped (:func:`held`), then once it is; any
    after it are only noted, so that the cleanup the first one began is not cut short. The
    third ends the tool (:func:`die_by`), at once or, in a held cleanup, once it is done."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.holding = 0
        self.raised = False
        self.note_after = False  # only noted, not restored, on exit: the tool reports next

    def handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        if self.holding:
            return  # acted on as the held cleanup ends: cut short, it would leave what it removes
        if len(self.received) >= STOP_AT:
            die_by(signum)
        self.raise_first()

    def raise_first(self) -> None:
        if self.received and not self.raised:
            self.raised = True
            raise Terminated() if self.received[0] == signal.SIGTERM else KeyboardInterrupt()


# The first SIGTERM or SIGINT cuts a tool short, a second is only noted (the cleanup and the
# report it began go on), a third ends the tool at once: one stuck (its report blocked on a
# full pipe, a stopped pager) still ends without a SIGKILL. In a held cleanup, the third
# ends the tool once that cleanup is done.
STOP_AT = 3


def die_by(signum: int) -> NoReturn:
    """End this process by ``signum`` itself (SIGINT, SIGTERM), its default action restored,
    so that its parent (a shell running a loop of tools) sees it killed by the signal, as it
    would a program without handlers; 128 + its number should the kernel not deliver it.
    Nothing buffered is written: the output may be the very pipe the tool is stuck on.

    Off the main thread, where Python cannot change a handler, the signal is sent to the
    process only if its action is already the default; otherwise the process exits with
    128 + its number."""
    if threading.current_thread() is not threading.main_thread():
        if signal.getsignal(signum) == signal.SIG_DFL:
            os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    signal.signal(signum, signal.SIG_DFL)
    # to the main thread, where it is not blocked: delivered as the call returns
    signal.pthread_kill(threading.main_thread().ident or 0, signum)
    os._exit(128 + signum)


_signals: _Signals | None = None
# The handlers before a tool was cut short: until :func:`cut_short` has printed (or the
# tool's main, :func:`restores_signals`, returned), SIGTERM and SIGINT are only noted here,
# the third ending the tool, then these are back.
_reporting: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
_noted: list[int] = []


def _note_while_reporting(signum: int, frame: FrameType | None) -> None:
    _noted.append(signum)
    if len(_noted) >= STOP_AT:
        die_by(signum)


def _restore_handlers() -> None:
    while _reporting:
        signum, handler = _reporting.popitem()
        signal.signal(signum, handler)
    _noted.clear()


P = ParamSpec("P")


def restores_signals(main: Callable[P, int]) -> Callable[P, int]:
    """A tool's ``main``, which prints what it measured once :func:`stopped_by_signal` saw a
    signal: the SIGTERM and SIGINT handlers before are back when it ends, whatever way it
    ends (an error before :func:`cut_short` restored them included)."""

    @functools.wraps(main)
    def run(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            return main(*args, **kwargs)
        finally:
            _restore_handlers()

    return run


def exit_as(rc: int) -> NoReturn:
    """Exit a tool run as a program with its ``main``'s status ``rc``: 128 + SIGINT's or
    SIGTERM's number (cut short, its report printed) by that signal itself, so that a shell
    loop stops as a Ctrl-C should stop it; any other as it is."""
    if rc - 128 in (signal.SIGINT, signal.SIGTERM):
        # a reader gone (``| head``) must not turn the signal's death into a traceback
        with contextlib.suppress(OSError):
            sys.stdout.flush()
        with contextlib.suppress(OSError):
            sys.stderr.flush()
        die_by(rc - 128)
    raise SystemExit(rc)


@contextmanager
def stop_on_signals() -> Iterator[list[int]]:
    """SIGTERM and SIGINT raise KeyboardInterrupt (SIGTERM: :class:`Terminated`) in the
    main thread, the first only; yields the signals received, in order. The handlers before
    are back on exit."""
    global _signals  # noqa: PLW0603 (one per process: signal handlers are)
    signals = _signals = _Signals()
    previous = {s: signal.signal(s, signals.handle) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield signals.received
    finally:
        # one arriving now is only noted: raised between the two restores, it would leave
        # the other handler ours
        signals.raised = True
        try:
            _noted[:] = signals.received
            for signum, handler in previous.items():
                if signals.note_after:
                    _reporting[signum] = handler
                    signal.signal(signum, _note_while_reporting)
                else:
                    signal.signal(signum, handler)
        finally:
            _signals = None


@dataclass
class Stopped:
    """What :func:`stopped_by_signal` saw: ``by``, the name of the signal that cut the tool
    short ("SIGTERM", "SIGINT"), or "" if none did."""

    by: str = ""


@contextmanager
def stopped_by_signal() -> Iterator[Stopped]:
    """The body runs under :func:`stop_on_signals`; the first SIGTERM or SIGINT ends it (its
    daemons stopped and directories removed as it unwinds) and is noted in the
    :class:`Stopped` yielded, not raised further, so that the tool can print what it has."""
    stopped = Stopped()
    with stop_on_signals() as received:
        try:
            yield stopped
        except KeyboardInterrupt:
            # SIGINT for one with none received: Python's own Ctrl-C handler raised it
            stopped.by = signal.Signals(received[0] if received else signal.SIGINT).name
            # a second Ctrl-C or SIGTERM must not cut short the report of what was measured
            assert _signals is not None
            _signals.note_after = True


GPUD_STOPPED = "gpud stopped, its directory removed"


def cut_short(
    by: str,
    done: str,
    *,
    figures: dict[str, Any] | None = None,
    show: Callable[[dict[str, Any]], None] | None = None,
    cleaned: str = GPUD_STOPPED,
) -> int:
    """Say that the signal ``by`` cut the tool short after ``done`` (what it got through,
    e.g. "7 of 21 rounds"), and what it cleaned up (``cleaned``, "" for none; by default its
    gpud stopped); the exit
    status, 128 + the signal's number, as a shell reports a process the signal ended.
    ``figures``: what it measured so far, printed by ``show`` first, or, with no ``show`` (a
    ``--json`` run), as its one JSON document, with ``cut_short`` ({"by", "after"}) and
    ``ok`` false. SIGTERM and SIGINT, only noted since :func:`stopped_by_signal` took the
    first (a third ends the tool), have their handlers back once it is printed."""
    try:
        if figures is None or show is not None:
            if figures is not None and show is not None:
                show(figures)
            said = [f"cut short by {by} after {done}", cleaned, "FAILED"]
            print("; ".join(part for part in said if part), flush=True)
        else:
            cut = {"by": by, "after": done}
            print(json.dumps({**figures, "cut_short": cut, "ok": False}, indent=2, sort_keys=True))
            sys.stdout.flush()
    finally:
        _restore_handlers()
    return 128 + signal.Signals[by].value


@contextmanager
def held() -> Iterator[None]:
    """A cleanup under way (a daemon being stopped, a directory removed): a SIGTERM or SIGINT
    arriving meanwhile is raised once it is done, and a third signal (:data:`STOP_AT`) ends
    the tool by it then, not part way. Nothing under no :func:`stop_on_signals`."""
    signals = _signals
    if signals is None:
        yield
        return
    signals.holding += 1
    try:
        yield
    finally:
        signals.holding -= 1
        if not signals.holding and len(signals.received) >= STOP_AT:
            die_by(signals.received[-1])
    if not signals.holding:
        signals.raise_first()


def start_child(
    procs: list[subprocess.Popen[bytes]], argv: list[str], *, stderr: int | IO[bytes] | None
) -> subprocess.Popen[bytes]:
    """``argv`` started (its output dropped, its stderr to ``stderr``) and added to
    ``procs``, for :func:`stop_children`; a SIGTERM or SIGINT meanwhile waits (held), so
    that no process is started and not noted."""
    with held():
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr)
        procs.append(proc)
    return proc


def stop_children(
    procs: list[subprocess.Popen[bytes]],
    signum: signal.Signals = signal.SIGINT,
    *,
    wait_s: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """``signum`` to every process of ``procs`` still there (SIGINT, a Ctrl-C: a ``gpuctl
    run`` leaves the queue, or stops its command), killed if it has not exited ``wait_s``
    (by ``clock``) after they were all signalled. A
    SIGTERM or SIGINT to the tool meanwhile waits (held): raised part way, it would leave
    those after it running. Only these, not yet reaped, are signalled: their PIDs are
    still theirs."""
    with held():
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
        # one deadline for them all: each its own would stop the tool 30 s a child
        deadline = clock() + wait_s
        for p in procs:
            try:
                p.wait(max(0.0, deadline - clock()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# Gone with the tool (SIGTERM: it stops in order) when the tool dies in a way that runs no
# cleanup of its own: a SIGKILL to its process group, which no longer reaches gpud in its own.
# Then `python -m gpud.main` as it is, its arguments after the launcher's.
_EXIT_PARENT_GONE = 1


def _launcher(parent: int) -> str:
    return (
        "import os,sys,ctypes,runpy\n"
        + dies_with_parent(signal.SIGTERM, str(parent), _EXIT_PARENT_GONE)
        + "runpy.run_module('gpud.main',run_name='__main__',alter_sys=True)\n"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop_and_remove(started: list[subprocess.Popen[bytes]], work: Path) -> None:
    """Stop the daemon (SIGTERM, killed if it has not stopped 20 s later), the MPS control
    daemons it left, and remove its directory; a signal meanwhile waits (held)."""
    with held():
        for proc in started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        kill_mps_daemons(work / "run")
        shutil.rmtree(work, ignore_errors=True)


UNIT = Path(__file__).resolve().parents[1] / "systemd" / "gpud.service"


def unit_environment(unit: Path = UNIT) -> dict[str, str]:
    """The variables systemd sets for gpud from ``unit``'s ``Environment=`` lines (each a
    space-separated list of ``NAME=VALUE``, quoted as a shell would): what the installed
    daemon's process finds in its environment besides systemd's own."""
    env: dict[str, str] = {}
    for line in unit.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "Environment":
            for assignment in shlex.split(value):
                name, _, val = assignment.partition("=")
                env[name] = val
    return env


def as_installed(caller: Mapping[str, str], unit: Path = UNIT) -> dict[str, str]:
    """``caller``'s environment with ``unit``'s variables added, so that a tool's daemon
    allocates as the installed one does (e.g. glibc's malloc tunables); a variable the
    caller sets itself wins, so that ``GLIBC_TUNABLES=`` runs it with glibc's defaults."""
    return {**unit_environment(unit), **caller}


@contextmanager
def simulated_gpud(
    spec: str,
    *,
    config_text: str = "",
    prepare: Callable[[Path], None] | None = None,
    start_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    root: Path | None = None,
) -> Iterator[SimDaemon]:
    """A running ``gpud --simulate SPEC`` with ``config_text`` as its gpud.toml; raises
    RuntimeError (with its log) if it does not start.

    ``prepare(run_dir)`` runs before the daemon starts, e.g. to write the simulated
    driver's state (``<run_dir>/sim/node.json``) as a node that already has MIG instances.
    ``env``: the daemon's environment (default: this process's). ``root``: where its
    ``gpud-sim-*`` directory is made (default: the system's temporary directory, TMPDIR).
    """
    with contextlib.ExitStack() as stack:
        # a tool's SIGTERM (timeout) cleans up as its Ctrl-C does, unless it chose its own
        if _signals is None and threading.current_thread() is threading.main_thread():
            stack.enter_context(stop_on_signals())
        # a signal arriving before its removal is registered would leave the directory:
        # held, it is raised once the removal is sure to run
        with held():
            work = Path(tempfile.mkdtemp(prefix="gpud-sim-", dir=root))
            started: list[subprocess.Popen[bytes]] = []
            stack.callback(_stop_and_remove, started, work)
        if prepare is not None:
            prepare(work / "run")
        sock = work / "run" / "gpud.sock"
        port = free_port()
        (work / "gpud.toml").write_text(config_text)
        cmd = [
            sys.executable, "-c", _launcher(os.getpid()),
            "--simulate", spec,
            "--config", str(work / "gpud.toml"),
            "--state-dir", str(work / "state"),
            "--run-dir", str(work / "run"),
            "--socket", str(sock),
            "--metrics-address", f"127.0.0.1:{port}",
            "--log-level", "warning",
        ]  # fmt: skip
        log_path = work / "gpud.log"
        # held: one started and not yet noted would be left running
        with log_path.open("wb") as log, held():
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, process_group=0
            )
            started.append(proc)
        deadline = time.monotonic() + start_timeout_s
        while not sock.exists():
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"gpud exited with {proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"gpud did not open {sock} within {start_timeout_s:g} s")
            time.sleep(0.1)
        yield SimDaemon(proc.pid, sock, f"http://127.0.0.1:{port}/metrics", log_path)
