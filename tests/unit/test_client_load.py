"""A client made in a training program or a service, where gRPC cannot be loaded or its
channel made, never raises into the program: it reports nothing and says why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# the program, in a fresh interpreter: %(before)s breaks gRPC's load, then a client is made
# and used as a training loop or a service would, its steps and exit never waiting on gpud
_PROGRAM = """
import sys, threading
%(before)s
import gpud.client
%(make)s
for _ in range(3):
    %(use)s
client.close()
assert threading.active_count() == 1, threading.enumerate()  # no sender thread
print(client.last_error)
"""

_CLIENTS = {
    "Progress": ('client = gpud.client.Progress("train-a")', "client.step()"),
    "Latency": ('client = gpud.client.Latency("chat", flush_every_s=0)', "client.observe(0.01)"),
}


def _run(client: str, before: str, socket: bytes | None = None) -> subprocess.CompletedProcess[str]:
    make, use = _CLIENTS[client]
    env = dict(os.environb)
    env.pop(b"GPUD_SOCKET", None)
    if socket is not None:
        env[b"GPUD_SOCKET"] = socket
    return subprocess.run(
        [sys.executable, "-c", _PROGRAM % {"before": before, "make": make, "use": use}],
        check=False,
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        errors="backslashreplace",
        timeout=60,  # a guard against a hang, not a measurement
    )


@pytest.mark.parametrize("client", sorted(_CLIENTS))
def test_a_client_without_grpc_reports_nothing_and_says_so(client: str) -> None:
    run = _run(client, "sys.modules['grpc'] = None  # a broken or absent grpc")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("gRPC not loaded (ModuleNotFoundError("), run.stdout
    assert run.stdout.rstrip().endswith("nothing is reported")
    assert "is not reported: gRPC not loaded" in run.stderr  # the warning, once


@pytest.mark.parametrize("client", sorted(_CLIENTS))
def test_a_socket_path_grpc_cannot_take_is_named_not_raised(client: str) -> None:
    run = _run(client, "", socket=b"/tmp/gpud-\xff.sock")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(
        "no gRPC channel to gpud at '/tmp/gpud-\\udcff.sock' ($GPUD_SOCKET, socket= or target=):"
    ), run.stdout
