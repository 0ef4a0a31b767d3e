"""gpuctl run's gate: the command waits until gpud has placed it, then runs as the same PID."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpud.cli.context import CliError
from gpud.cli.run import NotStarted, Stop, _launch, _signals_stop, still_the_gate
from tests.unit.process_support import proc_state, until


def test_the_command_runs_only_after_it_was_placed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    seen: list[tuple[int, bytes]] = []

    def place(pid: int) -> None:
        # still the gate, and already showing its environment (what gpud checks)
        seen.append((pid, Path(f"/proc/{pid}/cmdline").read_bytes()))
        assert b"GPUD_TEST_JOB=x" in Path(f"/proc/{pid}/environ").read_bytes()
        assert not out.exists()

    env = {**os.environ, "GPUD_TEST_JOB": "x"}
    code = _launch(["sh", "-c", f"echo $$ > {out}"], env, place)
    assert code == 0
    ((pid, cmdline),) = seen
    assert b"-c" in cmdline and b"execvp" in cmdline
    assert int(out.read_text()) == pid  # exec keeps the PID that was placed


def test_a_failed_placement_warns_and_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def place(pid: int) -> None:
        raise CliError("cannot mark job traffic by cgroup: nft not found", 6)

    assert _launch(["sh", "-c", "exit 3"], dict(os.environ), place) == 3
    assert "not marked by cgroup: cannot mark" in capsys.readouterr().err


def test_a_gate_whose_process_ends_before_it_opens_says_the_command_never_started(
    tmp_path: Path,
) -> None:
    """`gpuctl jobs rm --force` SIGTERMs the process held at the gate (its environment names
    the run): NotStarted with that process's end, not a BrokenPipeError from the gate."""
    out = tmp_path / "out"

    def place(pid: int) -> None:
        os.kill(pid, signal.SIGTERM)
        until(lambda: proc_state(pid) == "Z", "the held process ended")

    with pytest.raises(NotStarted) as never:
        _launch(["touch", str(out)], dict(os.environ), place)
    assert never.value.returncode == -signal.SIGTERM and not never.value.removed
    assert not out.exists()


def test_a_gate_kept_shut_runs_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"

    def place(pid: int) -> None:
        raise NotStarted(removed=True)

    with pytest.raises(NotStarted) as never:
        _launch(["touch", str(out)], dict(os.environ), place)
    assert never.value.returncode == 125 and never.value.removed
    assert not out.exists()


def test_a_missing_command_behind_the_gate() -> None:
    assert _launch(["/nonexistent/cmd"], dict(os.environ), lambda pid: None) == 127


@pytest.mark.parametrize("place", [None, lambda pid: None], ids=["plain", "gated"])
def test_a_command_found_but_not_executable_exits_126_as_in_a_shell(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], place: Callable[[int], None] | None
) -> None:
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    assert _launch([str(script)], dict(os.environ), place) == 126
    assert _launch([str(tmp_path)], dict(os.environ), place) == 126  # a directory
    assert _launch([str(tmp_path / "missing")], dict(os.environ), place) == 127
    assert f"cannot run {script}: Permission denied" in capfd.readouterr().err


@pytest.mark.parametrize("place", [None, lambda pid: None], ids=["plain", "gated"])
def test_a_command_name_that_cannot_run_is_said_on_one_short_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], place: Callable[[int], None] | None
) -> None:
    """A 10 000-character name was echoed whole (its reason buried at the end), and a
    newline or an escape sequence in it split the line or reached the terminal raw."""
    long = str(tmp_path / ("x" * 10_000))
    assert _launch([long], dict(os.environ), place) == 126  # ENAMETOOLONG
    said = capfd.readouterr().err
    assert said == (
        f"gpuctl: cannot run {long[:200]}... ({len(long)} characters): File name too long\n"
    )
    odd = str(tmp_path / "bad\nname\x1b[31m")
    assert _launch([odd], dict(os.environ), place) == 127
    said = capfd.readouterr().err
    assert said == f"gpuctl: cannot run {tmp_path}/bad\\nname\\x1b[31m: No such file or directory\n"


def test_a_command_name_that_cannot_be_started_is_said_clipped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def no_fork(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    long = "y" * 300
    assert _launch([long], dict(os.environ), None, popen=no_fork) == 127
    said = capsys.readouterr().err
    assert (
        said
        == f"gpuctl: cannot run {'y' * 200}... (300 characters): Resource temporarily unavailable\n"
    )


def test_a_command_that_cannot_run_is_said_as_json_when_asked(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / 'no "such"')
    assert _launch([missing], dict(os.environ), lambda pid: None, json_errors=True) == 127
    assert json.loads(capfd.readouterr().err) == {
        "error": {
            "message": f"cannot run {missing}: No such file or directory",
            "code": "NOT_FOUND",
            "exit_code": 127,
            "class": None,
        }
    }
    assert _launch([str(tmp_path)], dict(os.environ), None, json_errors=True) == 126
    assert json.loads(capfd.readouterr().err)["error"]["code"] == "FAILED_PRECONDITION"


_COUNTER = """
import signal, sys, time
got = []
signal.signal(int(sys.argv[2]), lambda s, f: got.append(time.monotonic()))
open(sys.argv[1], "w").close()
while not got:
    time.sleep(0.01)
time.sleep(1.0)  # a second one, forwarded, would come within this
sys.exit(len(got))
"""

_GPUCTL = """
import fcntl, os, sys, termios
fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # the pty is this session's terminal, its group foreground
from gpud.cli.run import NotStarted, _launch, still_the_gate
print("exit", _launch([sys.executable, "-c", *sys.argv[1:]], dict(os.environ)))
"""


@pytest.mark.parametrize(
    ("signum", "key"), [(signal.SIGINT, b"\x03"), (signal.SIGQUIT, b"\x1c")], ids=["C-c", "C-\\"]
)
def test_ctrl_c_on_the_terminal_reaches_the_command_once(
    tmp_path: Path, signum: signal.Signals, key: bytes
) -> None:
    # The terminal sends SIGINT (Ctrl-C) or SIGQUIT (Ctrl-\) to its foreground process
    # group, gpuctl and the command alike: forwarded as well, the command would count two (a
    # forced stop for many). SIGQUIT, not taken over, killed gpuctl, its command with it.
    ready = tmp_path / "ready"
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _GPUCTL, _COUNTER, str(ready), str(int(signum))],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
        os.close(slave)
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.write(master, key)
        assert proc.wait(20) == 0
        out = b""
        with contextlib.suppress(OSError):
            while chunk := os.read(master, 4096):
                out += chunk
    finally:
        os.close(master)
    assert b"exit 1" in out, out  # the count of signals it got


def test_the_gate_is_known_by_its_name_until_the_exec(tmp_path: Path) -> None:
    """`ps` shows the process held at the gate as gpuctl/gate; exec gives it the command's
    name. Without /proc to read, a process is taken for the command (as before)."""
    names: list[bool] = []

    def place(pid: int) -> None:
        names.append(still_the_gate(pid))

    assert _launch(["sh", "-c", "exit 0"], dict(os.environ), place) == 0
    assert names == [True]
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "comm").write_text("gpuctl/gate\n")
    assert still_the_gate(7, tmp_path) and not still_the_gate(8, tmp_path)
    (tmp_path / "7" / "comm").write_text("train\n")
    assert not still_the_gate(7, tmp_path)


# gpuctl alone (no gRPC threads): a signal to the process interrupts its wait for the command
_ENDED_UNSEEN = """
import os, sys
from gpud.cli.run import _launch
command = ["sh", "-c", f"echo $$ > {sys.argv[1]}; exec sleep 300"]
print("exit", _launch(command, dict(os.environ), lambda pid: None), flush=True)
"""


def test_a_signal_that_reaches_gpuctl_as_its_command_ends_by_it_is_the_commands_end(
    tmp_path: Path,
) -> None:
    """A signal to the process group (``timeout``'s SIGTERM, a hung-up terminal's SIGHUP)
    ends the command and reaches gpuctl before gpuctl has seen the command end (here:
    gpuctl stopped while the command ends and the signal comes): passed on to a command
    that is gone, the command's end is still gpuctl's to wait for. Passing it on reaped
    the command, and gpuctl failed with ``ChildProcessError`` (exit 1), telling gpud no
    status."""
    pid_file = tmp_path / "pid"
    proc = subprocess.Popen(
        [sys.executable, "-c", _ENDED_UNSEEN, str(pid_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        until(lambda: pid_file.exists() and pid_file.read_text().endswith("\n"), "started")
        command = int(pid_file.read_text())
        time.sleep(0.2)  # gpuctl waits for it by now
        os.kill(proc.pid, signal.SIGSTOP)
        until(lambda: proc_state(proc.pid) == "T", "gpuctl stopped")
        os.kill(command, signal.SIGTERM)
        until(lambda: proc_state(command) == "Z", "the command ended")
        os.kill(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and out == f"exit {-signal.SIGTERM}\n", err


# a command that cannot be run, gpuctl's stderr gone: the exit status `_launch` gets
_CANNOT_RUN = """
import os, sys
from gpud.cli.run import _launch
print("exit", _launch([sys.argv[1]], dict(os.environ), lambda pid: None), flush=True)
"""


@contextlib.contextmanager
def _stderr_gone(how: str) -> Iterator[int]:
    """An fd for a process's stderr that can no longer be written: a pipe whose reader has
    gone (EPIPE, and SIGPIPE), or a terminal that hung up (EIO)."""
    if how == "pipe":
        read, write = os.pipe()
        os.close(read)
    else:
        read, write = os.openpty()
        os.close(read)  # the terminal's master closed: writes to the slave fail with EIO
    try:
        yield write
    finally:
        os.close(write)


@pytest.mark.parametrize("how", ["pipe", "pty"])
@pytest.mark.parametrize(("what", "code"), [("missing", 127), ("directory", 126)])
def test_a_command_that_cannot_run_exits_127_or_126_with_stderr_gone(
    tmp_path: Path, how: str, what: str, code: int
) -> None:
    """The gate's ``gpuctl: cannot run ...`` line that cannot be written is lost, never the
    exit status of a command not found (127) or not runnable (126). The write killed the
    gate with SIGPIPE (141), or failed again as Python flushed stderr at exit (120)."""
    command = str(tmp_path / "nonexistent") if what == "missing" else str(tmp_path)
    with _stderr_gone(how) as stderr:
        done = subprocess.run(
            [sys.executable, "-c", _CANNOT_RUN, command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            check=False,
            timeout=60,
        )
    assert done.stdout == f"exit {code}\n"


def test_a_signal_while_the_command_is_held_keeps_the_gate_shut(tmp_path: Path) -> None:
    """A signal that lands while the command is held at the gate (gpuctl asking gpud to
    place it) stops the run before anything started: the gate stays shut and the command
    never runs. The gate opened all the same, the command ran, and was then sent the
    signal (exit 143, its side effects done)."""
    out = tmp_path / "out"

    def place(pid: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # gpuctl's handler: the stop names it

    with _signals_stop() as stop, pytest.raises(NotStarted) as never:
        _launch(["touch", str(out)], dict(os.environ), place, stop=stop)
    assert never.value.returncode == 125 and not never.value.removed
    assert stop.signum == signal.SIGTERM
    assert not out.exists()


# a signal just after gpuctl looked whether one came while the command was held (before it
# takes the signals over), the command ending before gpuctl passes the signal on to it
_SIGNAL_AS_THE_GATE_OPENS = """
import os, signal, sys, time
from pathlib import Path
from gpud.cli.run import Stop, _launch, _setting
class LandsOnceLooked(Stop):
    def is_set(self):
        was = super().is_set()
        os.kill(os.getpid(), signal.SIGTERM)  # gpuctl's handler: the stop names it
        return was
pids = []
def told(signum):  # before gpuctl passes it on: wait until the command has ended
    while Path(f"/proc/{pids[0]}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
stop = LandsOnceLooked()
stop.previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _setting(stop))}
print("exit", _launch(["true"], dict(os.environ), pids.append, told, stop), flush=True)
"""


def test_a_signal_as_the_gate_opens_for_a_command_that_ended_since_is_its_end() -> None:
    """A signal that lands after gpuctl last looked for one, as it opens the gate, is
    passed on once the command runs; the command ended meanwhile, its end is still
    gpuctl's to wait for. Passing it on reaped the command, and gpuctl failed with
    ``ChildProcessError`` (exit 1), telling gpud no status."""
    done = subprocess.run(
        [sys.executable, "-c", _SIGNAL_AS_THE_GATE_OPENS],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout == "exit 0\n", done.stderr


def test_a_command_that_cannot_be_started_leaves_the_signals_to_end_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No process to run the command in (fork fails: EAGAIN, ENOMEM): exit 127, and from
    then on a signal sets ``after``, as once a command has ended, so that Ctrl-C cuts the
    wait to tell an absent gpud how the run ended. It set the stop no one waited on any
    more: Ctrl-C did nothing for up to a minute."""

    def no_fork(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    after = Stop()
    try:
        with _signals_stop() as stop:
            code = _launch(
                ["true"], dict(os.environ), lambda pid: None, stop=stop, after=after, popen=no_fork
            )
            os.kill(os.getpid(), signal.SIGINT)
            assert after.wait(5) and after.signum == signal.SIGINT
        assert code == 127
        assert (
            "gpuctl: cannot run true: Resource temporarily unavailable" in capsys.readouterr().err
        )
    finally:
        after.close()


def test_a_signal_taken_before_the_fork_failed_stops_the_run_not_exit_127(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGTERM that lands while gpuctl forks the command's process, the fork then failing
    (EAGAIN): the signal came first, so the run ends as one stopped before its command
    started (NotStarted: exit 130, the reservation given back), as a signal while the
    command is held does. It exited 127, a command not found, telling gpud that exit
    status as the command's."""

    def signalled_then_no_fork(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        os.kill(os.getpid(), signal.SIGTERM)  # gpuctl's handler: the stop names it
        raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    after = Stop()
    try:
        with _signals_stop() as stop, pytest.raises(NotStarted) as never:
            _launch(
                ["true"],
                dict(os.environ),
                lambda pid: None,
                stop=stop,
                after=after,
                popen=signalled_then_no_fork,
            )
        assert never.value.returncode is None and not never.value.removed
        assert stop.signum == signal.SIGTERM and after.signum == signal.SIGTERM
        assert "cannot run" not in capsys.readouterr().err
    finally:
        after.close()
