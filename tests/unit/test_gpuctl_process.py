"""gpuctl as a process: what it imports, a closed output pipe, permission-denied advice."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import socket
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpud.api import ApiServer
from gpud.cli import EXIT_INTERRUPTED, context, entry, pipes
from tests.unit.api_support import ServerThread, make_servicer, short_dir
from tests.unit.other_user import GROUP, as_nobody, needs_root

# What gpuctl may import of the project: its own modules, generated code, the error table and
# the modules it shares with the daemon (gpud.reach: who passes the socket's directories, when
# it refuses a user; gpud.pidns: the PID namespace gpuctl sends with its PIDs). Daemon
# packages (gpud.api, gpud.mig, gpud.mps, gpud.jobs, gpud.telemetry, gpud.backend,
# gpud.config, ...) are off limits.
ALLOWED = (
    "gpud.cli",
    "gpud.v1",
    "gpud.errors",
    "gpud.shared",
    "gpud.build",
    "gpud.reach",
    "gpud.pidns",
    "gpud.pdeathsig",
)

PROBE = """
import json, sys
from gpud.cli.main import build_parser, main
build_parser()
help_modules = sorted(sys.modules)
code = main(sys.argv[1:], env={})
print(json.dumps({"help": help_modules, "after": sorted(sys.modules), "code": code}))
"""


@pytest.fixture
def socket_path() -> Iterator[Path]:
    with short_dir() as d:
        path = d / "gpud.sock"
        with ServerThread(ApiServer(path, servicers=[make_servicer().register])):
            yield path


def _probe(*argv: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, check=True
    ).stdout
    result: dict[str, object] = json.loads(out.splitlines()[-1])
    return result


def _project(modules: object) -> set[str]:
    assert isinstance(modules, list)
    return {m for m in modules if m == "gpud" or m.startswith("gpud.")}


def test_gpuctl_imports_no_daemon_package(socket_path: Path) -> None:
    for argv in (["--socket", str(socket_path), "status"], ["--socket", str(socket_path), "gpus"]):
        seen = _probe(*argv)
        assert seen["code"] == 0
        outside = {m for m in _project(seen["after"]) if m != "gpud" and not m.startswith(ALLOWED)}
        assert outside == set(), f"gpuctl {argv[-1]} imported daemon modules: {outside}"


def test_help_loads_neither_grpc_nor_protobuf() -> None:
    seen = _probe("--version")
    heavy = [
        m
        for m in seen["help"]  # type: ignore[attr-defined]
        if m.split(".")[0] == "grpc" or m.startswith("google.protobuf")
    ]
    assert heavy == []


def _with_closed_stdout(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run gpuctl with stdout a pipe whose reader is gone (`gpuctl ... | head` after head
    has exited)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "gpud.cli.main", *argv],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    finally:
        os.close(write)


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["status"],
        ["--json", "gpus"],
        ["events"],
        ["events", "--follow"],
        ["sim", "fault", "--help"],
    ],
    ids=["help", "status", "gpus-json", "events", "events-follow", "sub-help"],
)
def test_a_closed_pipe_ends_quietly(socket_path: Path, argv: list[str]) -> None:
    done = _with_closed_stdout("--socket", str(socket_path), *argv)
    assert done.stderr == ""  # no traceback, no "Exception ignored"
    # 141 as for a process killed by SIGPIPE; argparse's help printer ignores write errors
    assert done.returncode == (0 if "--help" in argv else 141)


def test_permission_advice_never_suggests_group_root(tmp_path: Path) -> None:
    path = tmp_path / "gpud.sock"
    path.touch()
    os.chown(path, -1, 0)
    message = str(context._denied(path))
    assert "socket_group" in message and "[api]" in message
    assert "-aG root" not in message and "group 'root'" not in message


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another group needs root")
def test_permission_advice_names_the_sockets_own_group(tmp_path: Path) -> None:
    import grp

    group = grp.getgrall()[-1]
    if group.gr_gid == 0:
        pytest.skip("no group other than root")
    path = tmp_path / "gpud.sock"
    path.touch()
    os.chown(path, -1, group.gr_gid)
    message = str(context._denied(path))
    assert f"usermod -aG {group.gr_name} $USER" in message and "api.socket_group" in message


def test_output_that_waits_long_between_writes_learns_its_reader_went() -> None:
    """``cluster attributes --watch | head -1``: attributes may not change for hours, so
    the watch must not wait for its next write to find ``head`` gone."""
    code = (
        "import sys\n"
        "from gpud.cli.pipes import when_reader_goes\n"
        "gone = when_reader_goes(lambda: None, every_s=0.05)\n"
        "print('first', flush=True)\n"
        "sys.exit(0 if gone.wait(10) else 1)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout is not None
    assert child.stdout.readline() == b"first\n"
    child.stdout.close()  # what head does after its first line
    assert child.wait(timeout=20) == 0


def test_ctrl_c_while_gpuctl_loads_ends_quietly_with_130() -> None:
    """The console script (``gpuctl = "gpud.cli:entry"``) loads the command modules inside
    the handler: a Ctrl-C in the middle of an import is exit 130, not a traceback."""

    def interrupted_load() -> Callable[[], int]:
        raise KeyboardInterrupt

    assert entry(interrupted_load) == EXIT_INTERRUPTED == 130
    assert entry(lambda: lambda: 7) == 7
    with open(Path(__file__).parents[2] / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["gpuctl"] == "gpud.cli:entry"


def test_a_broken_pipe_other_than_its_output_is_an_error() -> None:
    """A pipe to a child (or a socket) that breaks while gpuctl's own output is fine was
    taken for `gpuctl ... | head`: exit 141, nothing said."""
    code = (
        "import os\n"
        "from gpud.cli.pipes import quiet_on_broken_pipe\n"
        "def run():\n"
        "    read, write = os.pipe()\n"
        "    os.close(read)\n"
        "    os.write(write, b'x')\n"
        "    return 0\n"
        "raise SystemExit(quiet_on_broken_pipe(run))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode not in (0, 141)
    assert "gpuctl: Broken pipe" in done.stderr and "Traceback" not in done.stderr


def test_the_gpus_left_alone_reach_stderr_when_stdouts_reader_went() -> None:
    """``gpuctl mig export | head`` with a GPU left out: the answer cannot be flushed, but
    the line naming the GPU and why still goes to stderr; the exit is 141, as for any
    output into a closed pipe."""
    code = (
        "from pathlib import Path\n"
        "from gpud.cli.context import Context\n"
        "from gpud.cli.mig import _left_alone\n"
        "from gpud.cli.output import Output\n"
        "from gpud.cli.pipes import quiet_on_broken_pipe\n"
        "def run():\n"
        "    out = Output(json_output=False)\n"
        "    ctx = Context(socket_path=Path('gpud.sock'), timeout=1.0, output=out)\n"
        "    out.print('version: v1')  # the answer, still in stdout's buffer\n"
        "    return _left_alone(ctx, 'not exported', ['GPU 1: identity: GPU lost'])\n"
        "raise SystemExit(quiet_on_broken_pipe(run))\n"
    )
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
            timeout=60,
            # stdout block-buffered, as gpuctl's is into a pipe: the answer waits for a flush
            env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
        )
    finally:
        os.close(write)
    assert done.stderr == "gpuctl: not exported: GPU 1: identity: GPU lost\n"
    assert done.returncode == 141


@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_a_json_error_into_a_closed_pipe(tmp_path: Path, closed: str) -> None:
    """``gpuctl --json ... | head``: an error still goes to stderr as JSON with its exit code
    when stdout's reader has gone; when stderr's has, gpuctl ends quietly with 141."""
    read, write = os.pipe()
    os.close(read)  # the reader went before gpuctl wrote a word
    other = subprocess.PIPE
    argv = [sys.executable, "-m", "gpud.cli.main", "--socket", str(tmp_path / "no.sock")]
    try:
        done = subprocess.run(
            [*argv, "--json", "status"],
            stdout=write if closed == "stdout" else other,
            stderr=write if closed == "stderr" else other,
            check=False,
            timeout=60,
        )
    finally:
        os.close(write)
    if closed == "stdout":
        assert done.returncode == 3
        assert json.loads(done.stderr)["error"]["exit_code"] == 3
    else:
        assert done.returncode == 141 and done.stdout == b""


@needs_root
@pytest.mark.parametrize("mode", [0o750, 0o711])
def test_permission_advice_for_a_member_kept_out_by_a_directory(open_dir: Path, mode: int) -> None:
    """A member of the socket's group behind a run directory of mode 0750, group root: told
    of the directory, not to join the group they are in (nor to have the group set up)."""
    run = open_dir / "run"
    run.mkdir(mode=mode)
    run.chmod(mode)
    path = run / "gpud.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    os.chmod(path, 0o660)
    os.chown(path, -1, GROUP)
    read, write = os.pipe()

    def connect() -> int:
        try:
            context.probe_socket(path, 1.0)
        except context.CliError as err:
            os.write(write, str(err).encode())
            return err.exit_code
        return 0

    try:
        code = as_nobody(connect, groups=(GROUP,))
    finally:
        server.close()
        os.close(write)
    with os.fdopen(read) as said:
        message = said.read()
    if mode == 0o711:
        assert (code, message) == (0, "")
        return
    assert code == context.EXIT_PERMISSION
    assert message == (
        f"permission denied on {path}: {run} (mode 0750) lets only its owner and group root"
        f" through: give it o+x (chmod o+x {run}; the shipped unit's RuntimeDirectoryMode=0711"
        " does). That is for an administrator (as root); the socket's group (api.socket_group)"
        " does not help before it."
    )


@pytest.mark.parametrize("how", ["pipe", "pty"])
@pytest.mark.parametrize(
    ("words", "code"),
    [
        (["--job", "j", "--", "true"], 3),  # no gpud there
        (["--job", "j"], 2),  # no command: the run's parser says so
        (["--job", "j", "--bogus", "--", "true"], 2),  # gpuctl's parser, once the run's is done
        (["--json", "--job", "j", "--bogus", "--", "true"], 2),
    ],
    ids=["no-gpud", "no-command", "unknown-option", "unknown-option-json"],
)
def test_an_error_of_gpuctl_run_keeps_its_exit_status_with_stderr_gone(
    tmp_path: Path, how: str, words: list[str], code: int
) -> None:
    """``gpuctl run`` whose own error (no gpud there: 3; a usage error: 2) cannot be said,
    its stderr gone (a pipe whose reader went: EPIPE; a terminal that hung up: EIO): the
    line is lost, the exit status is not, as within the run. It was 141, or 1 with a
    traceback."""
    done = _with_stderr_gone(tmp_path, ["run", *words], how)
    assert done.returncode == code and done.stdout == b""


def _with_stderr_gone(
    tmp_path: Path, words: list[str], how: str = "pipe"
) -> subprocess.CompletedProcess[bytes]:
    """gpuctl with ``words``, its stderr gone: a pipe whose reader went (``how``
    "pipe"), or a terminal that hung up ("pty")."""
    if how == "pipe":
        read, write = os.pipe()
    else:
        read, write = os.openpty()
    os.close(read)
    argv = [sys.executable, "-m", "gpud.cli.main", "--socket", str(tmp_path / "no.sock")]
    try:
        done = subprocess.run(
            [*argv, *words],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=write,
            check=False,
            timeout=60,
        )
    finally:
        os.close(write)
    return done


@pytest.mark.parametrize(
    "words",
    [
        ["--timeout", "abc", "run", "--job", "j", "--", "true"],
        ["--bogus", "status"],
        ["status", "--bogus"],
        ["--json", "--timeout", "abc", "status"],
        [],
        ["--json"],
    ],
    ids=["before-run", "before-status", "after-status", "json", "no-command", "no-command-json"],
)
def test_a_usage_error_exits_2_with_stderr_gone(tmp_path: Path, words: list[str]) -> None:
    """A usage error, in any command and wherever its word is (before the command's name
    too), exits 2 with its stderr a pipe whose reader went: the line is lost, the status
    is not. A usage error before ``run`` exited 141."""
    done = _with_stderr_gone(tmp_path, words)
    assert done.returncode == 2 and done.stdout == b""


class _Flaky(io.StringIO):
    """A stream whose writes fail with ``errors`` in turn, then pass."""

    def __init__(self, *errors: OSError) -> None:
        super().__init__()
        self.failures = list(errors)

    def write(self, text: str) -> int:
        if self.failures:
            raise self.failures.pop(0)
        return super().write(text)


def test_a_stderr_full_for_now_loses_a_line_not_all_that_follow() -> None:
    """A non-blocking stderr full for a moment (EAGAIN) drops the line written then; one
    that failed for good (its reader gone) drops everything after. EAGAIN dropped every
    later line as well."""
    busy = _Flaky(BlockingIOError(errno.EAGAIN, "busy"))
    with contextlib.redirect_stderr(busy), pipes.stderr_that_never_fails():
        sys.stderr.write("lost\n")
        sys.stderr.write("said\n")
    assert busy.getvalue() == "said\n"
    gone = _Flaky(BrokenPipeError(errno.EPIPE, "gone"))
    with contextlib.redirect_stderr(gone), pipes.stderr_that_never_fails():
        sys.stderr.write("lost\n")
        sys.stderr.write("lost too\n")
    assert gone.getvalue() == ""


def _hung_up_terminal() -> int:
    """A terminal that hung up (closed, as a terminal window is): its pty's master closed,
    the slave returned; writes to it fail with EIO."""
    master, slave = os.openpty()
    os.close(master)
    return slave


@pytest.mark.parametrize("json_output", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("hung_up", ["stdout", "stderr"])
def test_a_terminal_that_hung_up_ends_a_command_quietly_with_129(
    socket_path: Path, tmp_path: Path, hung_up: str, json_output: bool
) -> None:
    """``gpuctl status`` whose terminal was closed (SIGHUP ignored, or none sent): exit 129,
    as the terminal's SIGHUP would have, nothing said elsewhere. It was a traceback, exit 1;
    with stderr fine, ``cannot write the output: Input/output error``."""
    terminal = _hung_up_terminal()
    # the answer to stdout; with stderr the terminal, an error (no gpud there) to say on it
    sock = socket_path if hung_up == "stdout" else tmp_path / "no.sock"
    argv = [sys.executable, "-m", "gpud.cli.main", "--socket", str(sock)]
    try:
        done = subprocess.run(
            [*argv, *(["--json"] if json_output else []), "status"],
            stdin=subprocess.DEVNULL,
            stdout=terminal if hung_up == "stdout" else subprocess.PIPE,
            stderr=terminal if hung_up == "stderr" else subprocess.PIPE,
            check=False,
            timeout=60,
        )
    finally:
        os.close(terminal)
    assert done.returncode == pipes.EXIT_HUNG_UP == 129
    assert (done.stderr if hung_up == "stdout" else done.stdout) == b""


def test_output_that_fails_is_its_error_though_the_terminal_of_stderr_hung_up(
    socket_path: Path,
) -> None:
    """``gpuctl version > /dev/full`` (a full or failing disk under the output file) whose
    stderr is a terminal that hung up: exit 1, the output's error, which cannot be said;
    not 129, as if the output's own terminal had gone."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    terminal = _hung_up_terminal()
    argv = [sys.executable, "-m", "gpud.cli.main", "--socket", str(socket_path), "version"]
    try:
        with open("/dev/full", "w") as full:
            done = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=full,
                stderr=terminal,
                timeout=60,
                check=False,
            )
    finally:
        os.close(terminal)
    assert done.returncode == 1


def test_a_follower_whose_terminal_closed_ends_at_once_with_129(socket_path: Path) -> None:
    """SIGHUP ignored (``trap '' HUP``): ``gpuctl events --follow`` on a terminal that is then
    closed ends within a second, quietly, 129, though no event comes to be written."""
    master, slave = os.openpty()
    gpuctl = [sys.executable, "-m", "gpud.cli.main", "--socket", str(socket_path), "events", "-f"]
    child = subprocess.Popen(
        ["sh", "-c", 'trap "" HUP; exec "$@"', "sh", *gpuctl],  # output left on the terminal
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=subprocess.PIPE,
    )
    os.close(slave)
    with child:
        try:
            assert os.read(master, 4096)  # the history: it follows now
        finally:
            os.close(master)  # the terminal closes
        try:
            code = child.wait(timeout=20)
        finally:
            child.kill()
        assert child.stderr is not None
        assert (code, child.stderr.read()) == (pipes.EXIT_HUNG_UP, b"")
