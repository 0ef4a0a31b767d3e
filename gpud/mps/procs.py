"""Small process checks over an injectable ``/proc`` (psutil's ``PROCFS_PATH`` habit)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def alive(pid: int, proc_root: Path = Path("/proc")) -> bool:
    """``pid`` runs and is not a zombie.

    Control daemons are orphans (they daemonize); where nothing reaps orphans, a dead one stays
    a zombie that still answers ``kill(pid, 0)``, so the state in ``/proc/<pid>/stat`` decides.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = (proc_root / str(pid) / "stat").read_text()
    except OSError:
        return True  # no procfs entry readable: trust kill(0)
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X")


def start_time(pid: int, proc_root: Path = Path("/proc")) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks since boot): with the PID, it names one
    process even after the PID is reused."""
    try:
        stat = (proc_root / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    with contextlib.suppress(IndexError, ValueError):
        return int(fields[19])
    return None
