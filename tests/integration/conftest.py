"""Fixtures for tests that run real programs: a gpud daemon on a simulated node."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

import pytest

from tools.simdaemon import kill_mps_daemons

# gpud and gpuctl: beside the test interpreter (its virtual environment), or in GPUD_TEST_BIN
# (tests/gpu/run.sh --python makes them there for an interpreter without them).
BIN = Path(os.environ.get("GPUD_TEST_BIN") or Path(sys.executable).parent)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# RunningDaemon's field named socket hides the module inside its class body
Socket: TypeAlias = socket.socket


@dataclass
class RunningDaemon:
    proc: subprocess.Popen[bytes]
    root: Path
    socket: Path
    metrics_port: int
    notify: Socket | None = None
    log: Path = field(default_factory=Path)
    run: Path = field(default_factory=Path)

    def gpuctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(BIN / "gpuctl"), "--socket", str(self.socket), *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"gpuctl {' '.join(args)} exited {result.returncode}: {result.stderr}"
            )
        return result

    def metrics(self) -> str:
        import urllib.request

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return str(resp.read().decode())

    def notifications(self, timeout: float = 0.0) -> list[str]:
        assert self.notify is not None
        out: list[str] = []
        self.notify.settimeout(timeout or 0.01)
        while True:
            try:
                out.append(self.notify.recv(4096).decode())
            except (TimeoutError, BlockingIOError):
                return out
            self.notify.settimeout(0.01)


def start_daemon(
    root: Path,
    *extra: str,
    config_text: str = "",
    env: dict[str, str] | None = None,
    run_dir: Path | None = None,
    prefix: tuple[str, ...] = (),
    metrics_port: int | None = None,
) -> RunningDaemon:
    """``run_dir`` defaults to ``root/run``; pass a short one where unix socket paths under
    it must fit in 107 bytes (MPS pipe directories). ``prefix`` runs gpud under another
    program (``nsenter --net=/run/netns/NAME``). ``metrics_port`` defaults to a free one;
    pass the port of a gpud before it to restart it on the same scrape target."""
    root.mkdir(parents=True, exist_ok=True)
    config = root / "gpud.toml"
    config.write_text(config_text)
    run = run_dir or root / "run"
    sock = run / "gpud.sock"
    port = metrics_port or free_port()
    notify_path = root / "notify.sock"
    notify_path.unlink(missing_ok=True)  # left by an earlier daemon in the same root
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    log = root / "gpud.log"
    command = [
        *prefix,
        str(BIN / "gpud"),
        "--config",
        str(config),
        "--run-dir",
        str(run),
        "--state-dir",
        str(root / "state"),
        "--socket",
        str(sock),
        "--metrics-address",
        f"127.0.0.1:{port}",
        *extra,
    ]
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "NOTIFY_SOCKET": str(notify_path),
                "WATCHDOG_USEC": "2000000",  # as WatchdogSec=2s would set it
                **(env or {}),
            },
        )
    daemon = RunningDaemon(proc, root, sock, port, notify, log, run)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"gpud exited {proc.returncode}:\n{log.read_text()}")
        if daemon.gpuctl("status", check=False).returncode == 0:
            return daemon
        time.sleep(0.2)
    stop_daemon(daemon)
    raise AssertionError(f"gpud did not start:\n{log.read_text()}")


def terminate(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM ``proc`` and wait for it; SIGKILL it if it has not stopped in ``timeout``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_daemon(daemon: RunningDaemon, *, leave_mps: bool = False) -> int:
    """SIGTERM gpud and wait for it; then stop (``quit``) the MPS control daemons it leaves
    running at its stop (for its next start to adopt), unless ``leave_mps``."""
    terminate(daemon.proc)
    if daemon.notify is not None:
        daemon.notify.close()
    if not leave_mps:
        kill_mps_daemons(daemon.run, quit_first=True)
    return daemon.proc.returncode


@pytest.fixture
def gpud_sim(tmp_path: Path) -> Iterator[RunningDaemon]:
    """A gpud on the default simulated node (8 x H100-SXM5-80GB), stopped at the end."""
    daemon = start_daemon(tmp_path / "gpud", "--simulate")
    try:
        yield daemon
    finally:
        stop_daemon(daemon)
