"""The fake nvidia-cuda-mps-control is a real program: a daemon with ``-d``, a client on stdin."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.mps.procs import alive
from gpud.sim_tools import FAKE_MPS_CONTROL, FAKE_MPS_CONTROL_BIN
from tests.unit.mps_support import kill_daemons, short_dir
from tests.unit.other_user import as_nobody, needs_root


@pytest.fixture
def env() -> Iterator[dict[str, str]]:
    with short_dir() as root:
        yield {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(root / "log"),
            "CUDA_VISIBLE_DEVICES": "GPU-0",
        }


def control(env: dict[str, str], *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(FAKE_MPS_CONTROL), *args],
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )


def state(env: dict[str, str]) -> dict[str, object]:
    data: dict[str, object] = json.loads(
        (Path(env["CUDA_MPS_PIPE_DIRECTORY"]) / "fake-mps-state.json").read_text()
    )
    return data


def test_client_without_a_daemon_says_so_and_fails(env: dict[str, str]) -> None:
    result = control(env, stdin="get_server_list\n")
    assert result.returncode == 1
    assert "Cannot find MPS control daemon process" in result.stderr


def test_daemon_keeps_limits_and_servers_and_quits(env: dict[str, str]) -> None:
    assert control(env, "-d").returncode == 0
    pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
    pid = int((pipe / "nvidia-cuda-mps-control.pid").read_text())
    assert alive(pid)
    assert (pipe / "control").exists()
    assert control(env, "-d").returncode == 1  # one daemon per pipe directory

    script = (
        "set_default_active_thread_percentage 40\n"
        "set_default_device_pinned_mem_limit 0 1044M\n"
        "get_default_active_thread_percentage\n"
        "get_default_device_pinned_mem_limit 0\n"
        "start_server -uid 0\n"
    )
    result = control(env, stdin=script)
    assert result.returncode == 0, result.stderr
    # the echo of the default percentage (580-series daemon), then the read-backs: the
    # driver's whole-GiB display
    assert result.stdout.split() == ["40.0", "40.0", "1G"]

    servers = control(env, stdin="get_server_list\n").stdout.split()
    assert len(servers) == 1
    server = servers[0]
    assert (
        control(env, stdin=f"set_active_thread_percentage {server} 20\n").stdout.strip() == "20.0"
    )
    # refused: the daemon prints the percentage it still holds
    assert (
        control(env, stdin=f"set_active_thread_percentage {server} 150\n").stdout.strip() == "20.0"
    )
    assert control(env, stdin=f"get_active_thread_percentage {server}\n").stdout.strip() == "20.0"
    assert "not found" in control(env, stdin="set_active_thread_percentage 1 20\n").stdout
    assert control(env, stdin="bogus\n").stdout.strip() == 'Unknown command "bogus"'
    assert (
        "Invalid memory"
        in control(env, stdin="set_default_device_pinned_mem_limit 0 1.5G\n").stdout
    )
    # a device it does not see: taken without a word, as the 580-series daemon does
    assert control(env, stdin="set_default_device_pinned_mem_limit 1 1G\n").stdout == ""
    assert control(env, stdin="get_default_device_pinned_mem_limit 1\n").stdout.strip() == "1G"
    assert "Invalid device" in control(env, stdin="get_default_device_pinned_mem_limit x\n").stdout
    control(env, stdin="set_default_device_pinned_mem_limit 1 0\n")

    held = state(env)
    assert held["visible_devices"] == ["GPU-0"]
    assert held["default_active_thread_percentage"] == 40.0
    assert held["default_device_pinned_mem_limit"] == {"0": 1044 * 2**20}
    assert held["servers"] == {
        server: {
            "uid": 0,
            "active_thread_percentage": 20.0,
            "device_pinned_mem_limit": {"0": 1044 * 2**20},
        }
    }
    cleared = control(
        env,
        stdin="set_default_device_pinned_mem_limit 0 0\nget_default_device_pinned_mem_limit 0\n",
    )
    assert cleared.stdout.strip() == ""  # no limit reads as nothing

    assert control(env, stdin="quit\n").returncode == 0
    for _ in range(100):
        if not alive(pid) and not alive(int(server)):
            break
        subprocess.run(["sleep", "0.05"], check=True)
    assert not alive(pid)
    assert not alive(int(server))
    assert not (pipe / "control").exists()
    assert (
        "Cmd:set_default_active_thread_percentage 40"
        in (Path(env["CUDA_MPS_LOG_DIRECTORY"]) / "control.log").read_text()
    )


def test_the_executable_under_the_real_name_works(env: dict[str, str]) -> None:
    assert os.access(FAKE_MPS_CONTROL_BIN, os.X_OK)
    run = [str(FAKE_MPS_CONTROL_BIN)]
    # The shebang finds python3 on PATH; make it this interpreter's.
    env = {**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}
    assert subprocess.run([*run, "-d"], env=env, timeout=20, check=False).returncode == 0
    out = subprocess.run(
        run, input="get_default_active_thread_percentage\nquit\n", env=env,
        capture_output=True, text=True, timeout=20, check=False,
    )  # fmt: skip
    assert out.stdout.strip() == "100.0"


@needs_root
def test_clients_of_every_user_reach_the_daemon_under_gpuds_umask(open_dir: Path) -> None:
    """Started by gpud under the unit's UMask=0027, the control socket still lets every user
    connect, as the real daemon's does (tests/gpu checks that one): a job's CUDA client, or
    the client of a user outside root's group (nobody here)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CUDA_MPS_PIPE_DIRECTORY": str(open_dir / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(open_dir / "log"),
        "CUDA_VISIBLE_DEVICES": "GPU-0",
    }
    (open_dir / "pipe").mkdir(mode=0o755)
    try:
        started = subprocess.run(
            [sys.executable, str(FAKE_MPS_CONTROL), "-d"], env=env, umask=0o027, check=False
        )
        assert started.returncode == 0
        path = open_dir / "pipe" / "control"
        assert path.stat().st_mode & 0o006 == 0o006, oct(path.stat().st_mode)

        def connect() -> int:
            with socket.socket(socket.AF_UNIX) as client:
                client.connect(str(path))
            return 0

        assert as_nobody(connect) == 0
    finally:
        kill_daemons(open_dir)
