"""One MPS control daemon process: started, queried, stopped.

What runs, for the GPU or MIG device ``<uuid>``::

    CUDA_VISIBLE_DEVICES=<uuid> \\
    CUDA_MPS_PIPE_DIRECTORY=<run_dir>/mps/<uuid>/pipe \\
    CUDA_MPS_LOG_DIRECTORY=<run_dir>/mps/<uuid>/log \\
        nvidia-cuda-mps-control -d

and every query is ``echo <command> | nvidia-cuda-mps-control`` with the same environment.
The daemon writes its PID to ``<pipe>/nvidia-cuda-mps-control.pid``; that file, and the
process behind it, are how a restarted gpud finds (and adopts) a daemon it started earlier.

Calls block (they run the client program): call them off the event loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from gpud.errors import BackendError, ConfigError, DriverTimeout
from gpud.mps import procs, protocol
from gpud.mps.procs import started_at

# sun_path holds 108 bytes on Linux, the terminating NUL included.
_MAX_UNIX_PATH = 107
# How much later than its PID file a process may have started and still be the daemon that
# wrote it (the wall clock may be stepped between the two readings).
_PID_REUSE_SLACK_S = 60.0

log = logging.getLogger(__name__)

DEFAULT_BASE_ENV: Mapping[str, str] = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"}


# execve's ENOENT for a file that is there: ``ls`` would seem to deny it
_NO_INTERPRETER = "exists but cannot be run (its interpreter or loader missing?)"


def exec_failure(program: str, search: str, err: OSError | None = None) -> str:
    """Why execve refused the control binary ``program`` (``err``: what it raised), or would
    refuse it (None: judged from the file, with this process's real uid as ``access(2)``
    checks), in words; "" when it would run it. A name without a ``/`` is looked up in
    ``search``, the PATH the daemons are started with. ENOENT also comes for a file that is
    there when its ``#!`` interpreter or its ELF loader is not."""
    if "/" not in program:
        found = shutil.which(program, path=search) or shutil.which(
            program, mode=os.F_OK, path=search
        )
        if found is None and (err is None or isinstance(err, FileNotFoundError)):
            return f"no such file in PATH ({search})"
        program = found or program
    if err is None:
        if not os.path.exists(program):
            return "no such file"
        if os.path.isdir(program) or not os.access(program, os.X_OK):
            return "not an executable file"
        return _NO_INTERPRETER if _interpreter_missing(program) else ""
    if isinstance(err, FileNotFoundError):
        return _NO_INTERPRETER if os.path.exists(program) else "no such file"
    return err.strerror or str(err)


def _interpreter_missing(program: str) -> bool:
    """Whether ``program`` is a script whose ``#!`` interpreter is not there, as the kernel
    reads the line (the first word after ``#!``, up to the first 255 bytes)."""
    try:
        with open(program, "rb") as script:
            head = script.read(256)
    except OSError:
        return False  # execve says what it finds at the start
    if not head.startswith(b"#!"):
        return False
    words = head[2:].split(b"\n", 1)[0].split()
    return bool(words) and not os.path.exists(words[0])


# How a daemon went: ``quit`` (it obeyed ``echo quit | nvidia-cuda-mps-control``),
# ``sigterm`` or ``sigkill`` (it ignored ``quit``, or did not answer, and that signal ended
# it), ``exited`` (it went unasked: no ``quit`` could reach it, or none ran).
How = Literal["quit", "sigterm", "sigkill", "exited"]
# How the control program is run: :func:`subprocess.run`'s arguments, its text result.
Run = Callable[..., "subprocess.CompletedProcess[str]"]
# The control program's runner unless a caller gives another (a test's hang made at will).
RUN_CONTROL: Run = subprocess.run


# Below this much free space a daemon's failure to start is put down to a full file system.
_LOW_SPACE_BYTES = 1 << 20
# how long :meth:`ControlDaemon.stop` waits for the daemon to exit after its ``quit``, after
# SIGTERM, and after SIGKILL (:meth:`ControlDaemon.kill` only the last)
_QUIT_EXIT_S = 5.0
_TERM_EXIT_S = 2.0
_KILL_EXIT_S = 2.0


def device_dir(run_dir: Path, uuid: str) -> Path:
    """``<run_dir>/mps/<uuid>``: the pipe and log directories of one device's daemon."""
    return run_dir / "mps" / uuid


class ControlDaemon:
    """The control daemon of one GPU or MIG device.

    ``control_command`` is the program (and any leading arguments), e.g.
    ``["nvidia-cuda-mps-control"]`` or ``[sys.executable, FAKE_MPS_CONTROL]``.
    """

    def __init__(
        self,
        uuid: str,
        run_dir: Path,
        control_command: Sequence[str],
        *,
        base_env: Mapping[str, str] = DEFAULT_BASE_ENV,
        timeout_s: float = 10.0,
        proc_root: Path = Path("/proc"),
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        statvfs: Callable[[Path], os.statvfs_result] = os.statvfs,
        place: Callable[[int], None] = lambda pid: None,
        alive: Callable[[int, Path], bool] = procs.alive,
        run: Run = RUN_CONTROL,
    ) -> None:
        """``place(pid)``: called with the PID of a daemon :meth:`start` started, as soon as
        its PID file names it (before it answers, before any client): moves it into a cgroup
        of its own (see :class:`gpud.mps.manager.MpsManager`). It raises nothing.
        ``alive(pid, proc_root)``: whether a process runs (tests: one that outlives
        SIGKILL, as a daemon stuck in the driver does).
        ``run``: how the control program is run (:func:`subprocess.run`, given the command,
        ``input``, ``timeout`` and the rest); tests: one raising
        :class:`subprocess.TimeoutExpired` as a hung daemon's client does."""
        self._alive = alive
        self._run_program = run
        self.uuid = uuid
        self._place = place
        self._statvfs = statvfs
        self.directory = device_dir(run_dir, uuid)
        self.pipe_dir = self.directory / "pipe"
        self.log_dir = self.directory / "log"
        self._command = list(control_command)
        self._base_env = dict(base_env)
        self._timeout_s = timeout_s
        self._proc_root = proc_root
        self._sleep = sleep
        self._clock = clock
        # The daemon last found by its PID file, and when it started: still known to be ours
        # if that file goes (its pipe directory deleted under it).
        self._last: tuple[int, float | None] | None = None

    @property
    def env(self) -> dict[str, str]:
        """The environment the daemon and its client run with."""
        return {
            **self._base_env,
            "CUDA_VISIBLE_DEVICES": self.uuid,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }

    # -- process ---------------------------------------------------------------------------
    def pid(self) -> int | None:
        """The running daemon's PID (from its PID file), or None when none runs."""
        pid_file = self.pipe_dir / protocol.PID_FILE
        try:
            pid = int(pid_file.read_text().strip())
            written = pid_file.stat().st_mtime
        except (OSError, ValueError):
            return None
        if not self._alive(pid, self._proc_root):
            return None
        # A daemon that died left its PID file; a process started well after the file was
        # written only reuses the PID, and must be neither adopted nor signalled.
        started = started_at(pid, self._proc_root)
        if started is not None and started > written + _PID_REUSE_SLACK_S:
            return None
        self._last = (pid, started)
        return pid

    def orphan(self) -> int | None:
        """When :meth:`pid` finds none: the daemon it last found, if that very process still
        runs (its pipe directory was deleted: no client reaches it, no PID file names it)."""
        if self._last is None:
            return None
        pid, started = self._last
        if not self._alive(pid, self._proc_root) or started_at(pid, self._proc_root) != started:
            self._last = None
            return None
        return pid

    @property
    def start_s(self) -> float:
        """How long :meth:`start` may take at most: ``nvidia-cuda-mps-control -d`` is waited
        on ``timeout_s``, the daemon's first answer ``timeout_s``, and the query asked just
        before that wait ends ``timeout_s`` again."""
        return 3 * self._timeout_s

    def stop_s(self, *, quit_s: float | None = None, timeout_s: float = _QUIT_EXIT_S) -> float:
        """How long :meth:`stop` given the same ``quit_s`` and ``timeout_s`` may take at most:
        its ``quit`` waited on ``quit_s`` (None: the daemon's ``timeout_s``), the daemon's exit
        after it on ``timeout_s``, after SIGTERM and after SIGKILL each on its own time (a
        process stuck in the driver outlives all three)."""
        quit_wait = self._timeout_s if quit_s is None else quit_s
        return quit_wait + timeout_s + _TERM_EXIT_S + self.kill_s

    @property
    def kill_s(self) -> float:
        """How long :meth:`kill` may take at most: the daemon's exit after SIGKILL."""
        return _KILL_EXIT_S

    def lost(self, pid: int) -> None:
        """``pid`` is this device's daemon, found running with its pipe directory gone (an
        earlier gpud started it): :meth:`orphan` names it from now on, while it runs."""
        self._last = (pid, started_at(pid, self._proc_root))

    def running(self) -> bool:
        return self.pid() is not None

    def start(self) -> int:
        """Start the daemon (``-d``) and wait until it answers; return its PID.

        A PID file left by a dead daemon, and its control socket, are removed first: the
        daemon refuses to start over them. While the daemon that lost its pipe directory
        still runs (:meth:`orphan`), none is started: :class:`BackendError`.
        """
        existing = self.pid()
        if existing is not None:
            return existing
        orphan = self.orphan()
        if orphan is not None:
            # the caller kills it first (:meth:`kill` with its PID): one that outlives SIGKILL
            # still holds the device
            raise BackendError(
                f"the MPS control daemon (pid {orphan}) that lost its pipe directory still"
                " runs: none is started beside it",
                uuid=self.uuid,
                call="nvidia-cuda-mps-control -d",
            )
        control = self.pipe_dir / protocol.CONTROL_SOCKET
        if len(os.fsencode(control)) > _MAX_UNIX_PATH:
            raise ConfigError(
                f"the MPS control socket {control} is {len(os.fsencode(control))} bytes long, "
                f"over the {_MAX_UNIX_PATH} a unix socket path may have: use a shorter "
                "daemon.run_dir",
                key="daemon.run_dir",
            )
        try:
            self.pipe_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            # Clients of other users connect through the pipe dir: it must be traversable
            # (the process umask, 0027 under the unit, would leave <run_dir>/mps 0750).
            self.directory.parent.chmod(0o755)
            self.directory.chmod(0o755)
            self.pipe_dir.chmod(0o755)
            for stale in (protocol.PID_FILE, protocol.CONTROL_SOCKET):
                with contextlib.suppress(FileNotFoundError):
                    (self.pipe_dir / stale).unlink()
        except OSError as err:
            raise BackendError(
                f"cannot prepare {err.filename or self.directory}: {err.strerror}",
                uuid=self.uuid,
                call="nvidia-cuda-mps-control -d",
            ) from err
        result = self._run(["-d"], None)
        if result.returncode != 0:
            raise BackendError(
                f"{' '.join(self._command)} -d exited {result.returncode}: "
                f"{(result.stderr or result.stdout).strip()}{self._space_note()}",
                uuid=self.uuid,
                call="nvidia-cuda-mps-control -d",
                code=result.returncode,
            )
        deadline = self._clock() + self._timeout_s
        placed = None
        while True:
            pid = self.pid()
            if pid is not None and pid != placed:
                self._place(pid)
                placed = pid
            if pid is not None:
                try:
                    self.query(protocol.get_server_list())
                    return pid
                except BackendError:
                    pass
            if self._clock() >= deadline:
                raise DriverTimeout(
                    f"MPS control daemon did not come up within {self._timeout_s:g}s"
                    f"{self._space_note()}",
                    uuid=self.uuid,
                    call="nvidia-cuda-mps-control -d",
                )
            self._sleep(0.05)

    def _space_note(self) -> str:
        """Why a daemon may have failed to start, when its file system is full: the daemon
        writes its PID file, control socket and log there and says only that it failed."""
        path = self.directory.parent
        try:
            st = self._statvfs(path)
        except OSError:
            return ""
        free = st.f_bavail * st.f_frsize
        if free == 0:
            what = "no space left"
        elif free < _LOW_SPACE_BYTES:
            what = f"only {free // 1024} KiB free"
        elif st.f_files and st.f_favail == 0:
            what = "no inodes left"
        else:
            return ""
        return f" ({what} on the file system of {path})"

    def stop(
        self,
        timeout_s: float = _QUIT_EXIT_S,
        *,
        pid: int | None = None,
        quit_s: float | None = None,
    ) -> How | None:
        """``echo quit | nvidia-cuda-mps-control``; SIGTERM, then SIGKILL, if it lingers.
        How it went once no daemon runs (:data:`How`); None when the process outlived SIGKILL
        (stuck in the driver, ``State: D`` in ``/proc/<pid>/status``): it still runs, and
        still holds its device.

        ``pid``: that process (the caller made sure it is this device's daemon), also when
        no PID file names it any more; ``quit`` goes through the pipe only where one does.
        ``quit_s``: how long the ``quit`` command is waited for (default: the daemon's
        ``timeout_s``); ``timeout_s``: how long the daemon's exit is waited for after it,
        before SIGTERM. :meth:`stop_s` with the same two is the most this takes."""
        found = self.pid()
        pid = found if pid is None else pid
        if pid is None:
            return "exited"
        asked = found == pid
        if asked:
            with contextlib.suppress(BackendError):
                self.query(protocol.quit_(), timeout_s=quit_s)
        if self._wait_exit(pid, timeout_s):
            return "quit" if asked else "exited"
        log.warning("MPS control daemon %s (pid %d) ignored quit; terminating", self.uuid, pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if self._wait_exit(pid, _TERM_EXIT_S):
            return "sigterm"
        return self._kill(pid)

    def remove_directory(self) -> bool:
        """Remove the device's pipe and log directories once its device is gone (a MIG
        device's UUID is never used again, so nothing else would ever remove them). False,
        leaving them, while a daemon still runs from them or they cannot be removed."""
        if self.pid() is not None or self.orphan() is not None:
            return False
        try:
            shutil.rmtree(self.directory)
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning("cannot remove %s: %s", err.filename or self.directory, err.strerror)
            return False
        return True

    def kill(self, pid: int | None = None) -> How | None:
        """SIGKILL a daemon that stopped answering (it is restarted afterwards): ``sigkill``
        once it is gone (``exited`` where none ran), None when it outlived SIGKILL, as
        :meth:`stop` says. ``pid``: that process, as for :meth:`stop`."""
        pid = self.pid() if pid is None else pid
        return "exited" if pid is None else self._kill(pid)

    def _kill(self, pid: int) -> How | None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if self._wait_exit(pid, _KILL_EXIT_S):
            return "sigkill"
        log.warning("MPS control daemon %s (pid %d) outlived SIGKILL", self.uuid, pid)
        return None

    def _wait_exit(self, pid: int, timeout_s: float) -> bool:
        deadline = self._clock() + timeout_s
        while self._alive(pid, self._proc_root):
            if self._clock() >= deadline:
                return False
            self._sleep(0.05)
        return True

    # -- commands --------------------------------------------------------------------------
    def query(self, command: str, timeout_s: float | None = None) -> str:
        """Send one command on the client's stdin; return what it printed.

        Raises :class:`BackendError` when the client cannot reach the daemon,
        :class:`DriverTimeout` when it does not answer within ``timeout_s`` (default: the
        daemon's ``timeout_s``).
        """
        result = self._run([], command + "\n", timeout_s)
        if result.returncode != 0:
            raise BackendError(
                f"MPS control client exited {result.returncode}: "
                f"{(result.stderr or result.stdout).strip()}",
                uuid=self.uuid,
                call=command,
                code=result.returncode,
            )
        return result.stdout

    def _run(
        self, args: list[str], stdin: str | None, timeout_s: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        timeout = self._timeout_s if timeout_s is None else timeout_s
        try:
            return self._run_program(
                [*self._command, *args],
                input=stdin,
                stdin=None if stdin is not None else subprocess.DEVNULL,
                capture_output=True,
                text=True,
                env=self.env,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as err:
            raise DriverTimeout(
                f"MPS control did not answer within {timeout:g}s",
                uuid=self.uuid,
                call=" ".join(args) or (stdin or "").strip(),
            ) from err
        except OSError as err:
            # the program mps.control_binary names: the key is what the operator mends
            program = self._command[0]
            why = exec_failure(program, self.env.get("PATH", ""), err)
            raise BackendError(
                f"cannot run mps.control_binary: {program}: {why}",
                uuid=self.uuid,
                call="exec",
            ) from err
