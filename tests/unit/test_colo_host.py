"""Host-side features: CPU and memory of each job's process tree, from a fake /proc."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpud.colo.host import HostUsage


def write_stat(
    proc: Path, pid: int, ppid: int, *, ticks: int, rss_pages: int, start: int = 7
) -> None:
    d = proc / str(pid)
    d.mkdir(exist_ok=True)
    f = ["S", str(ppid)] + ["0"] * 30
    f[11], f[12], f[19], f[21] = str(ticks), "0", str(start), str(rss_pages)
    (d / "stat").write_text(f"{pid} (py thon) {' '.join(f)}\n")


def test_cpu_and_rss_of_the_process_tree(tmp_path: Path) -> None:
    proc = tmp_path
    (proc / "meminfo").write_text("MemTotal:       1000000 kB\nMemFree: 1 kB\n")
    now = [0.0]
    host = HostUsage(proc_root=proc, clock=lambda: now[0], cpus=4, clock_ticks=100, page_size=1024)
    write_stat(proc, 10, 1, ticks=0, rss_pages=100_000)  # the job's GPU process
    write_stat(proc, 11, 10, ticks=0, rss_pages=50_000)  # its data loader
    write_stat(proc, 20, 1, ticks=0, rss_pages=900_000)  # somebody else's
    first = host.sample({"train": [10]})
    assert first["train"].cpu == 0.0  # nothing to measure against yet
    assert first["train"].rss == pytest.approx(150_000 * 1024 / 1_024_000_000)
    now[0] = 2.0
    write_stat(proc, 10, 1, ticks=200, rss_pages=100_000)  # 2 s of CPU in 2 s
    write_stat(proc, 11, 10, ticks=400, rss_pages=50_000)  # 4 s of CPU in 2 s
    second = host.sample({"train": [10], "gone": [99]})
    assert second["train"].cpu == pytest.approx(6.0 / 2.0 / 4)  # three of four cores
    assert second["gone"].cpu == 0.0 and second["gone"].rss == 0.0


def test_a_reused_pid_does_not_count_the_old_processs_time(tmp_path: Path) -> None:
    now = [0.0]
    host = HostUsage(proc_root=tmp_path, clock=lambda: now[0], cpus=1, clock_ticks=100)
    write_stat(tmp_path, 10, 1, ticks=5000, rss_pages=1, start=7)
    host.sample({"a": [10]})
    now[0] = 1.0
    write_stat(tmp_path, 10, 1, ticks=50, rss_pages=1, start=9)  # another process, same PID
    assert host.sample({"a": [10]})["a"].cpu == 0.0
