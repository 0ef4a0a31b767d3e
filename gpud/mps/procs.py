"""Small process checks over an injectable ``/proc`` (psutil's ``PROCFS_PATH`` habit)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from gpud.pidns import status_line

# The largest PID Linux hands out (PID_MAX_LIMIT on 64-bit; /proc/sys/kernel/pid_max may not
# exceed it). A larger number names no process, and os.kill refuses one past 2**31 with
# OverflowError instead of an OSError.
PID_MAX = 4 * 1024 * 1024


def stat(pid: int, proc_root: Path = Path("/proc")) -> tuple[str, list[str]] | None:
    """``/proc/<pid>/stat`` read once: the name (``comm``) and the fields after it (``[0]``
    is the state, field 3 of proc(5)); None when the process is gone. ``comm`` may hold
    spaces and parentheses, so it ends at the last ``)``; the kernel copies it as the
    process set it (``prctl(PR_SET_NAME)``), any bytes, so bytes that are not UTF-8 come
    back as surrogate escapes rather than failing the read."""
    try:
        # a str path, not Path's /: an admission pass reads one per queued holder, and
        # pathlib's joins cost more than the read
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    close = raw.rfind(b")")
    name = raw[raw.find(b"(") + 1 : close].decode(errors="surrogateescape")
    # after the name the kernel writes only ASCII: numbers and the state letter
    return name, raw[close + 2 :].decode("ascii", errors="replace").split()


def stat_fields(pid: int, proc_root: Path = Path("/proc")) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after ``(comm)`` (:func:`stat`); None when the
    process is gone."""
    read = stat(pid, proc_root)
    return None if read is None else read[1]


def exited(fields: list[str]) -> bool:
    """The state in ``fields`` (:func:`stat_fields`) says the process has exited: a zombie
    its parent has not reaped yet (``Z``), or dead (``X``)."""
    return bool(fields) and fields[0] in ("Z", "X")


def start_ticks(fields: list[str]) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` from its ``fields`` (:func:`stat_fields`): when the
    process started, in clock ticks since boot; None when procfs does not say."""
    with contextlib.suppress(IndexError, ValueError):
        return int(fields[19])
    return None


def alive(pid: int, proc_root: Path = Path("/proc")) -> bool:
    """``pid`` runs and is not a zombie.

    Control daemons are orphans (they daemonize); where nothing reaps orphans, a dead one stays
    a zombie that still answers ``kill(pid, 0)``, so the state in ``/proc/<pid>/stat`` decides.
    """
    return runs(pid, None, proc_root)


def runs(
    pid: int,
    started: int | None,
    proc_root: Path = Path("/proc"),
    *,
    fields_of: Callable[[int], list[str] | None] | None = None,
) -> bool:
    """``pid`` is :func:`alive` and is the process that started at ``started`` (field 22 of
    ``/proc/<pid>/stat``, clock ticks since boot; None: whichever process has the PID): a
    PID the kernel reused for another process is not it. ``/proc/<pid>/stat`` is read once
    (``fields_of``: how, :func:`stat_fields` under ``proc_root`` by default; where given,
    it replaces ``proc_root``, which is then not read), and not at all where
    ``kill(pid, 0)`` already says no such process runs."""
    if not 0 < pid <= PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = stat_fields(pid, proc_root) if fields_of is None else fields_of(pid)
    if not fields:
        # no procfs entry readable: kill(0) is trusted, but no start time can match
        return started is None
    return not exited(fields) and (started is None or start_ticks(fields) == started)


def start_time(pid: int, proc_root: Path = Path("/proc")) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks since boot): with the PID, it names one
    process even after the PID is reused."""
    fields = stat_fields(pid, proc_root)
    return None if fields is None else start_ticks(fields)


def started_at(pid: int, proc_root: Path = Path("/proc")) -> float | None:
    """When ``pid`` started, in wall-clock seconds (boot time from ``/proc/stat`` plus field
    22 of ``/proc/<pid>/stat``); None when procfs does not say."""
    ticks = start_time(pid, proc_root)
    if ticks is None:
        return None
    try:
        stat = (proc_root / "stat").read_text()
    except OSError:
        return None
    for line in stat.splitlines():
        name, _, value = line.partition(" ")
        if name == "btime" and value.strip().isdigit():
            return int(value) + ticks / os.sysconf("SC_CLK_TCK")
    return None


def real_uid(pid: int, proc_root: Path = Path("/proc")) -> int | None:
    """The real UID of ``pid`` (the first field of the ``Uid:`` line of
    ``/proc/<pid>/status``); None when the process is gone or procfs does not say."""
    fields = status_line(pid, "Uid", proc_root)
    return int(fields[0]) if fields and fields[0].isdigit() else None
