"""gpuctl run's gate: the command waits until gpud has placed it, then runs as the same PID."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpud.cli.context import CliError
from gpud.cli.run import NotStarted, _launch, still_the_gate


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
        while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)

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
signal.signal(signal.SIGINT, lambda s, f: got.append(time.monotonic()))
open(sys.argv[1], "w").close()
while not got:
    time.sleep(0.01)
time.sleep(1.0)  # a second SIGINT, forwarded, would come within this
sys.exit(len(got))
"""

_GPUCTL = """
import fcntl, os, sys, termios
fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # the pty is this session's terminal, its group foreground
from gpud.cli.run import NotStarted, _launch, still_the_gate
print("exit", _launch([sys.executable, "-c", sys.argv[1], sys.argv[2]], dict(os.environ)))
"""


def test_ctrl_c_on_the_terminal_reaches_the_command_once(tmp_path: Path) -> None:
    # The terminal sends SIGINT to its foreground process group, gpuctl and the command
    # alike: forwarded as well, the command would count two Ctrl-C (a forced stop for many).
    ready = tmp_path / "ready"
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _GPUCTL, _COUNTER, str(ready)],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
        os.close(slave)
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.write(master, b"\x03")
        assert proc.wait(20) == 0
        out = b""
        with contextlib.suppress(OSError):
            while chunk := os.read(master, 4096):
                out += chunk
    finally:
        os.close(master)
    assert b"exit 1" in out, out  # the count of SIGINTs it got


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


def _state(pid: int) -> str:
    """``/proc/PID/stat``'s state letter: ``T`` stopped, ``Z`` ended, not yet waited for."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


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
        _until(lambda: pid_file.exists() and pid_file.read_text().endswith("\n"), "started")
        command = int(pid_file.read_text())
        time.sleep(0.2)  # gpuctl waits for it by now
        os.kill(proc.pid, signal.SIGSTOP)
        _until(lambda: _state(proc.pid) == "T", "gpuctl stopped")
        os.kill(command, signal.SIGTERM)
        _until(lambda: _state(command) == "Z", "the command ended")
        os.kill(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and out == f"exit {-signal.SIGTERM}\n", err
