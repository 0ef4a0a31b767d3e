"""tools/soak's arithmetic and clean-up, and a soak stopped part way (``timeout``'s SIGTERM,
Ctrl-C): its gpud, commands and directories gone, what it measured printed, a failure."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.unit.tool_support import running_tool, stopped_by
from tools.simdaemon import Terminated, stop_on_signals
from tools.soak import Sample, clean_up, slope, stray_mps_daemons, summary


def _sample(minute: float, rss: float) -> Sample:
    return Sample(minute, rss, rss - 26, rss - 26, 20, 15, 400, int(minute * 60))


def test_slope_is_the_least_squares_fit() -> None:
    assert slope([(0, 1), (1, 3), (2, 5)]) == 2.0
    assert slope([(0, 1)]) == 0.0
    assert slope([(1, 1), (1, 5)]) == 0.0


def test_summary_tells_a_plateau_from_growth() -> None:
    rising_then_flat = [_sample(m, 60 + min(m, 10)) for m in range(0, 21)]
    lines = summary(rising_then_flat).splitlines()
    first, second = lines[1].split(), lines[2].split()
    assert first[:2] == ["first", "half"] and float(first[2]) == 1.0
    assert second[:2] == ["second", "half"] and float(second[2]) == 0.0
    assert summary(rising_then_flat[:3]) == "too few samples for slopes"


def test_stray_mps_daemons_are_those_under_the_run_dir(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    run = tmp_path / "run"
    for pid, env in {
        "10": f"PATH=/bin\0CUDA_MPS_PIPE_DIRECTORY={run}/mps/GPU-1\0",
        "11": "CUDA_MPS_PIPE_DIRECTORY=/run/gpud/mps/GPU-1\0",
        "12": "HOME=/root\0",
    }.items():
        (proc / pid).mkdir(parents=True)
        (proc / pid / "environ").write_text(env)
    (proc / "13").mkdir()  # gone before its environ was read
    (proc / "self").mkdir()
    assert stray_mps_daemons(run, proc) == [10]


def test_a_signal_during_the_clean_up_and_a_daemon_gone_meanwhile_leave_it_whole(
    tmp_path: Path,
) -> None:
    proc, run, work = tmp_path / "proc", tmp_path / "run", tmp_path / "work"
    (proc / "10").mkdir(parents=True)
    (proc / "10" / "environ").write_text(f"CUDA_MPS_PIPE_DIRECTORY={run}/mps/GPU-1\0")
    work.mkdir()
    killed: list[int] = []

    def kill(pid: int, signum: int) -> None:
        # timeout's SIGTERM lands, and the daemon found has exited by now
        os.kill(os.getpid(), signal.SIGTERM)
        killed.append(pid)
        raise ProcessLookupError(pid)

    with pytest.raises(Terminated), stop_on_signals():
        clean_up(work, run, proc_root=proc, kill=kill)
    assert killed == [10]
    assert not work.exists()


def test_a_sigterm_mid_soak_cleans_up_prints_what_it_measured_and_fails() -> None:
    argv = ["-m", "tools.soak", "--minutes", "30", "--rate", "5", "--spec", "H100-SXM5-80GB:4"]
    # its table's first row: its first command started
    with running_tool(argv, began=r" *\d+\.\d +\d") as tool:
        # held where they are: a command ending on its own as gpud stops would hide a soak
        # that left its commands running
        commands = tool.freeze("gpuctl")
        assert commands
        rest = stopped_by(tool, signal.SIGTERM)
        assert set(commands) < tool.pids, tool.pids  # and gpud, its MPS control daemon
        assert tool.proc.returncode == -signal.SIGTERM, rest
        assert "too few samples for slopes" in rest and "commands: " in rest, rest
        assert "cut short by SIGTERM after " in rest and " of 30 minutes" in rest, rest
        assert list(tool.tmp.iterdir()) == []
        assert tool.left() == []
