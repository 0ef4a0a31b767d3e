"""A ``gpud --simulate`` daemon in temporary directories, for the benchmarks and the fuzzer.

::

    with simulated_gpud("A100-SXM4-40GB:2") as daemon:
        daemon.socket        # its gRPC unix socket
        daemon.pid           # for its RSS
        daemon.metrics_url   # http://127.0.0.1:PORT/metrics

Runs ``python -m gpud.main`` with this interpreter, a config file of its own, and its own state
and run directories under a fresh temporary directory (removed afterwards, with the daemon
stopped by SIGTERM, or killed if it does not stop, and the MPS control daemons it left
running killed: :func:`kill_mps_daemons`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gpud.mps.procs import alive


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def simulated_gpud(
    spec: str,
    *,
    config_text: str = "",
    prepare: Callable[[Path], None] | None = None,
    start_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> Iterator[SimDaemon]:
    """A running ``gpud --simulate SPEC`` with ``config_text`` as its gpud.toml; raises
    RuntimeError (with its log) if it does not start.

    ``prepare(run_dir)`` runs before the daemon starts, e.g. to write the simulated
    driver's state (``<run_dir>/sim/node.json``) as a node that already has MIG instances.
    ``env``: the daemon's environment (default: this process's).
    """
    with tempfile.TemporaryDirectory(prefix="gpud-sim-") as tmp:
        work = Path(tmp)
        if prepare is not None:
            prepare(work / "run")
        sock = work / "run" / "gpud.sock"
        port = free_port()
        (work / "gpud.toml").write_text(config_text)
        cmd = [
            sys.executable, "-m", "gpud.main",
            "--simulate", spec,
            "--config", str(work / "gpud.toml"),
            "--state-dir", str(work / "state"),
            "--run-dir", str(work / "run"),
            "--socket", str(sock),
            "--metrics-address", f"127.0.0.1:{port}",
            "--log-level", "warning",
        ]  # fmt: skip
        log_path = work / "gpud.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + start_timeout_s
            while not sock.exists():
                if proc.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"gpud exited with {proc.returncode}:\n{tail}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gpud did not open {sock} within {start_timeout_s:g} s")
                time.sleep(0.1)
            yield SimDaemon(proc.pid, sock, f"http://127.0.0.1:{port}/metrics", log_path)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            kill_mps_daemons(work / "run")
