#!/usr/bin/env python3
"""A fake ``nvidia-cuda-mps-control`` for machines without a GPU: a real program that speaks
the control daemon's command protocol and keeps its state, so gpud's real process management
runs against it.

It behaves as the real one is reached:

- ``fake_mps_control.py -d`` daemonizes (double fork, ``setsid``), writes
  ``$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid``, listens on the unix socket
  ``$CUDA_MPS_PIPE_DIRECTORY/control`` (every user may connect, whatever the umask) and logs each command to
  ``$CUDA_MPS_LOG_DIRECTORY/control.log``. ``-f`` runs the same daemon in the foreground.
  ``-d`` returns once the daemon accepts commands.
- Without ``-d``/``-f`` it is the client: each line read from stdin is sent to the daemon of
  ``$CUDA_MPS_PIPE_DIRECTORY`` and the reply printed; with no daemon it prints
  ``Cannot find MPS control daemon process`` on stderr and exits 1.

Commands: ``get_server_list``, ``start_server -uid UID``, ``get_server_status PID``,
``get_client_list PID``, ``get_device_client_list [PID]``,
``set_default_active_thread_percentage P``, ``get_default_active_thread_percentage``,
``set_active_thread_percentage PID P``, ``get_active_thread_percentage PID``,
``set_default_device_pinned_mem_limit DEV VALUE``, ``get_default_device_pinned_mem_limit DEV``,
``set_device_pinned_mem_limit PID DEV VALUE``, ``get_device_pinned_mem_limit PID DEV``,
``quit``. Replies follow the 580-series daemon: ``set_*active_thread_percentage`` print the
percentage held afterwards (the new one, or the old one when the value is refused), the
memory ``set_*`` print nothing, percentages read ``25.0``, memory limits read as whole GiB
from 1 GiB up (``1044M`` reads ``1G``), a memory limit never set (or set to ``0``) reads as
nothing, a memory limit for a device index the daemon does not see (past
``CUDA_VISIBLE_DEVICES``) is taken without a word and read back as set, and unknown
commands get ``Unknown command "NAME"``.

Servers started with ``start_server`` are real child processes (they exit when the control
daemon goes away), so their PIDs are real. Like the real daemon, the limits live in the
process and are lost when it quits or dies. For tests to check what the daemon holds, the
state is also written after every command to ``$CUDA_MPS_PIPE_DIRECTORY/fake-mps-state.json``.

While ``$CUDA_MPS_PIPE_DIRECTORY/fake-mps-stuck`` exists the daemon ignores ``quit`` and
SIGTERM, as one stuck in the driver does (SIGKILL still ends this one: tests that need it to
look alive after that inject the liveness check, ``alive(pid, proc_root)``).

Standard library only: it runs under any ``python3``, without gpud installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

PID_FILE = "nvidia-cuda-mps-control.pid"
STUCK_FILE = "fake-mps-stuck"
CONTROL_SOCKET = "control"
STATE_FILE = "fake-mps-state.json"
NOT_RUNNING = "Cannot find MPS control daemon process"
GIB = 1 << 30
MIB = 1 << 20
_MEMORY = re.compile(r"^(\d+)([GM])$")


def pipe_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))


def log_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))


def _alive(pid: int) -> bool:
    """Running, and not a zombie (an orphan nobody reaped yet still answers ``kill 0``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust kill(0)
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X")


def _running_pid(directory: Path) -> int | None:
    try:
        pid = int((directory / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def _displayed(num_bytes: int) -> str:
    return f"{num_bytes // GIB}G" if num_bytes >= GIB else f"{num_bytes // MIB}M"


def _memory(value: str) -> int | None:
    match = _MEMORY.match(value)
    if match is None:
        return None
    return int(match.group(1)) * (GIB if match.group(2) == "G" else MIB)


def _percent(value: str) -> float | None:
    try:
        number = float(value)
    except ValueError:
        return None
    return number if 0 < number <= 100 else None


class Daemon:
    """The control daemon's state and command handling."""

    def __init__(self, directory: Path, logs: Path) -> None:
        self.directory = directory
        self.logs = logs
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.devices = [d for d in visible.split(",") if d] or ["0"]
        self.default_threads = 100.0
        self.default_memory: dict[int, int] = {}
        self.servers: dict[int, dict[str, Any]] = {}
        self.commands = 0
        self.quitting = False

    # -- state --------------------------------------------------------------------------
    def save(self) -> None:
        state = {
            "pid": os.getpid(),
            "running": not self.quitting,
            "visible_devices": self.devices,
            "default_active_thread_percentage": self.default_threads,
            "default_device_pinned_mem_limit": {str(k): v for k, v in self.default_memory.items()},
            "servers": {
                str(pid): {
                    "uid": s["uid"],
                    "active_thread_percentage": s["threads"],
                    "device_pinned_mem_limit": {str(k): v for k, v in s["memory"].items()},
                }
                for pid, s in self.servers.items()
            },
            "commands": self.commands,
        }
        tmp = self.directory / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
        tmp.replace(self.directory / STATE_FILE)

    def log(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with (self.logs / "control.log").open("a") as fh:
            fh.write(f"[{stamp} Control {os.getpid()}] {message}\n")

    def reap(self) -> None:
        """Forget servers that exited (killed, or gone with their clients)."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            self.servers.pop(pid, None)
        for pid in [p for p in self.servers if not _alive(p)]:
            del self.servers[pid]

    # -- commands -----------------------------------------------------------------------
    def handle(self, line: str) -> str:
        self.reap()
        self.commands += 1
        self.log(f"Cmd:{line}")
        words = line.split()
        if not words:
            return ""
        name, args = words[0], words[1:]
        handler = getattr(self, "cmd_" + name, None)
        if handler is None:
            return f'Unknown command "{name}"'
        try:
            reply: str = handler(*args)
        except TypeError:
            return f"Invalid arguments for {name}"
        return reply

    def _server(self, pid: str) -> dict[str, Any] | None:
        return self.servers.get(int(pid)) if pid.isdigit() else None

    def _device(self, dev: str) -> int | None:
        # The 580-series daemon takes any device index, also one past the devices it sees.
        return int(dev) if dev.isdigit() else None

    def cmd_get_server_list(self) -> str:
        return "\n".join(str(pid) for pid in sorted(self.servers))

    def cmd_start_server(self, flag: str, uid: str, *rest: str) -> str:
        if flag != "-uid" or not uid.isdigit():
            return "Invalid arguments for start_server"
        for server in self.servers.values():
            if server["uid"] == int(uid):
                return ""  # one server per user, as the real daemon keeps
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the "server": lives until the control daemon goes away
            # Drop the listener and the client's connection, or the client waits for EOF.
            os.closerange(3, 65536)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while os.getppid() == parent:
                time.sleep(0.2)
            os._exit(0)
        self.servers[pid] = {
            "uid": int(uid),
            "threads": self.default_threads,
            "memory": dict(self.default_memory),
        }
        self.log(f"Starting new server {pid} for user {uid}")
        return ""

    def cmd_get_server_status(self, pid: str) -> str:
        return "ACTIVE" if self._server(pid) is not None else f"Server {pid} not found"

    def cmd_get_client_list(self, pid: str) -> str:
        return "" if self._server(pid) is not None else f"Server {pid} not found"

    def cmd_get_device_client_list(self, *pid: str) -> str:
        return ""

    def cmd_set_default_active_thread_percentage(self, value: str) -> str:
        # The 580-series daemon prints the percentage it holds afterwards: the new one, or
        # the old one when it refused (out of (0, 100]; the reason goes to its log only).
        percent = _percent(value)
        if percent is None:
            self.log("Invalid percentage, expected between (0.0, 100.0]")
        else:
            self.default_threads = percent
        return f"{self.default_threads:.1f}"

    def cmd_get_default_active_thread_percentage(self) -> str:
        return f"{self.default_threads:.1f}"

    def cmd_set_active_thread_percentage(self, pid: str, value: str) -> str:
        server, percent = self._server(pid), _percent(value)
        if server is None:
            return f"Server {pid} not found"
        if percent is None:
            self.log("Invalid percentage, expected between (0.0, 100.0]")
        else:
            server["threads"] = percent
        return f"{server['threads']:.1f}"

    def cmd_get_active_thread_percentage(self, pid: str) -> str:
        server = self._server(pid)
        return f"Server {pid} not found" if server is None else f"{server['threads']:.1f}"

    def cmd_set_default_device_pinned_mem_limit(self, dev: str, value: str) -> str:
        device, limit = self._device(dev), _memory(value)
        if device is None:
            return f"Invalid device: {dev}"
        if value == "0":  # clears the limit
            self.default_memory.pop(device, None)
            return ""
        if limit is None:
            return f"Invalid memory limit: {value}"
        self.default_memory[device] = limit
        return ""

    def cmd_get_default_device_pinned_mem_limit(self, dev: str) -> str:
        device = self._device(dev)
        if device is None:
            return f"Invalid device: {dev}"
        limit = self.default_memory.get(device)
        return "" if not limit else _displayed(limit)  # nothing when no limit is set

    def cmd_set_device_pinned_mem_limit(self, pid: str, dev: str, value: str) -> str:
        server, device, limit = self._server(pid), self._device(dev), _memory(value)
        if server is None:
            return f"Server {pid} not found"
        if device is None:
            return f"Invalid device: {dev}"
        if value == "0":
            server["memory"].pop(device, None)
            return ""
        if limit is None:
            return f"Invalid memory limit: {value}"
        server["memory"][device] = limit
        return ""

    def cmd_get_device_pinned_mem_limit(self, pid: str, dev: str) -> str:
        server, device = self._server(pid), self._device(dev)
        if server is None:
            return f"Server {pid} not found"
        if device is None:
            return f"Invalid device: {dev}"
        limit = server["memory"].get(device)
        return "" if not limit else _displayed(limit)

    def cmd_quit(self) -> str:
        self.quitting = not self.stuck()
        return ""

    def stuck(self) -> bool:
        return (self.directory / STUCK_FILE).exists()

    # -- lifecycle ----------------------------------------------------------------------
    def shutdown(self) -> None:
        for pid in list(self.servers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for pid in list(self.servers):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.servers.clear()
        self.quitting = True
        self.save()
        for name in (CONTROL_SOCKET, PID_FILE):
            with contextlib.suppress(FileNotFoundError):
                (self.directory / name).unlink()
        self.log("Exit")

    def serve(self, ready_fd: int | None) -> int:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        path = self.directory / CONTROL_SOCKET
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        # as the real daemon's: clients of every user connect, whatever the umask it was
        # started with (gpud's unit sets 0027, which leaves a socket 0750)
        os.chmod(path, 0o777)
        listener.listen(16)
        listener.settimeout(0.5)
        (self.directory / PID_FILE).write_text(f"{os.getpid()}\n")
        self.save()
        self.log(f"Starting control daemon, devices {','.join(self.devices)}")

        def on_term(signum: int, frame: object) -> None:
            self.quitting = not self.stuck()

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        if ready_fd is not None:
            os.write(ready_fd, b"ok")
            os.close(ready_fd)
        try:
            while not self.quitting:
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    self.reap()
                    continue
                except InterruptedError:
                    continue
                with conn:
                    conn.settimeout(5.0)
                    line = _read_line(conn)
                    reply = self.handle(line)
                    self.save()
                    with contextlib.suppress(OSError):
                        conn.sendall(reply.encode())
        finally:
            listener.close()
            self.shutdown()
        return 0


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def run_daemon(background: bool) -> int:
    directory, logs = pipe_dir(), log_dir()
    running = _running_pid(directory)
    if running is not None:
        print(f"An instance of this daemon is already running (pid {running})", file=sys.stderr)
        return 1
    if not background:
        return Daemon(directory, logs).serve(None)
    read_fd, write_fd = os.pipe()
    if os.fork() > 0:  # the caller: wait until the daemon accepts commands
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as ready:
            ok = ready.read() == b"ok"
        if not ok:
            print("Failed to start the MPS control daemon", file=sys.stderr)
        return 0 if ok else 1
    os.close(read_fd)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    os.chdir("/")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    try:
        code = Daemon(directory, logs).serve(write_fd)
    except BaseException:
        os._exit(1)
    os._exit(code)


def run_client() -> int:
    path = pipe_dir() / CONTROL_SOCKET
    for raw in sys.stdin:
        line = raw.strip()
        if not line:
            continue
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(30.0)
                conn.connect(str(path))
                conn.sendall(line.encode() + b"\n")
                chunks = []
                while chunk := conn.recv(65536):
                    chunks.append(chunk)
        except (FileNotFoundError, ConnectionRefusedError):
            print(NOT_RUNNING, file=sys.stderr)
            return 1
        reply = b"".join(chunks).decode(errors="replace")
        if reply:
            print(reply, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-d", "-f"):
        return run_daemon(background=args[0] == "-d")
    if args and args[0] == "-v":
        print("fake nvidia-cuda-mps-control (gpud)")
        return 0
    if args:
        print(
            f"usage: nvidia-cuda-mps-control [-d | -f]; unknown option {args[0]}", file=sys.stderr
        )
        return 2
    return run_client()


if __name__ == "__main__":
    sys.exit(main())
