"""Host-side features of jobs: CPU use and resident memory of each job's process tree.

Data loaders, tokenizers and pre-processing contend for the host's CPUs and memory as GPU
kernels contend for SMs, so the interference predictor sees them too. The numbers are what
``psutil`` reads (``Process.cpu_times()``, ``memory_info().rss``, ``children(recursive)``),
read here straight from an injectable ``/proc``: ``/proc/<pid>/stat`` fields 4 (parent),
14-15 (user and system clock ticks), 22 (start time) and 24 (resident pages), and
``/proc/meminfo``'s ``MemTotal``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gpud.mps.procs import stat_fields


@dataclass(frozen=True, slots=True)
class HostUse:
    cpu: float  # CPU time per second over the host's cores, 0..1
    rss: float  # resident memory over the host's memory, 0..1


@dataclass(frozen=True, slots=True)
class _Stat:
    ppid: int
    ticks: int  # user + system
    start: int
    rss_pages: int


class HostUsage:
    """``sample({job: [root PIDs]})`` -> ``{job: HostUse}`` for each job's process trees.

    CPU use is measured between two samples (the first sample of a process gives none)."""

    def __init__(
        self,
        *,
        proc_root: Path = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
        cpus: int | None = None,
        clock_ticks: int | None = None,
        page_size: int | None = None,
    ) -> None:
        self._proc = proc_root
        self._clock = clock
        self._cpus = cpus or os.cpu_count() or 1
        self._hz = clock_ticks or os.sysconf("SC_CLK_TCK")
        self._page = page_size or os.sysconf("SC_PAGE_SIZE")
        self._last: dict[tuple[int, int], int] = {}  # (pid, start) -> CPU ticks
        self._last_at: float | None = None

    def sample(self, roots: Mapping[str, Iterable[int]]) -> dict[str, HostUse]:
        now = self._clock()
        stats = self._stats()
        children: dict[int, list[int]] = {}
        for pid, st in stats.items():
            children.setdefault(st.ppid, []).append(pid)
        mem_total = self._mem_total()
        elapsed = now - self._last_at if self._last_at is not None else 0.0
        seen: dict[tuple[int, int], int] = {}
        out: dict[str, HostUse] = {}
        for job, pids in roots.items():
            tree = _tree([p for p in pids if p in stats], children)
            ticks = rss = 0
            for pid in tree:
                st = stats[pid]
                key = (pid, st.start)
                seen[key] = st.ticks
                if key in self._last:
                    ticks += max(0, st.ticks - self._last[key])
                rss += st.rss_pages * self._page
            cpu = ticks / self._hz / elapsed / self._cpus if elapsed > 0 else 0.0
            out[job] = HostUse(
                cpu=min(1.0, cpu), rss=min(1.0, rss / mem_total) if mem_total else 0.0
            )
        self._last, self._last_at = seen, now
        return out

    def _stats(self) -> dict[int, _Stat]:
        out: dict[int, _Stat] = {}
        try:
            names = os.listdir(self._proc)
        except OSError:
            return out
        for name in names:
            if not name.isdigit():
                continue
            f = stat_fields(int(name), self._proc)
            if f is None:
                continue  # gone meanwhile
            try:
                out[int(name)] = _Stat(int(f[1]), int(f[11]) + int(f[12]), int(f[19]), int(f[21]))
            except (IndexError, ValueError):
                continue
        return out

    def _mem_total(self) -> int:
        try:
            for line in (self._proc / "meminfo").read_text().splitlines():
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return 0


def _tree(roots: Iterable[int], children: Mapping[int, list[int]]) -> set[int]:
    tree: set[int] = set()
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if pid not in tree:
            tree.add(pid)
            stack.extend(children.get(pid, ()))
    return tree
