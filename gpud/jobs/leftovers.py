"""The processes of one ``gpuctl run``, found again after its command has ended.

``gpuctl run`` starts the command with ``GPUD_RUN=<reservation id>`` in its environment,
and every process the command forks or execs inherits it, also one that outlives its parent
(``sh -c 'a & b'``, a launcher's workers) and is re-parented to init. When the run ends its
reservation goes, so none of them may keep running on the devices it held:

- ``gpuctl run``, once its command has exited, sends SIGTERM to what is left of the run and
  SIGKILL to what is still there ``--kill-after`` seconds later (:func:`stop`);
- gpud, when it releases the reservation of a ``gpuctl run`` that is gone (killed with
  SIGKILL, or its host session lost), sends SIGKILL to what is left, as the kernel did to
  the command itself when gpuctl died (:func:`kill`);
- gpud, when ``gpuctl jobs rm --force`` releases a running job's reservations, sends
  SIGTERM to each run's processes, and SIGKILL to those left a grace period later.

gpud's pending SIGKILLs are kept in its state store (``gpud.jobs.stops``), so a gpud that
restarts between a release and the kill still sends it.

What a process's environment says is ``/proc/<pid>/environ`` as it was at its ``exec``:
a process that clears its environment and execs again is not found. The variable is set by
``gpuctl run`` alone (``gpuctl env`` does not print it), so a shell that took a job's
environment from ``gpuctl env`` is never one of a run's processes.

A ``gpuctl run`` of a version older than ``GPUD_RUN``, still running through an upgrade of
gpud, gave its command ``GPUD_RESERVATION=<run>`` alone, as ``gpuctl env`` prints it. Given
the run's holder (the PID of its ``gpuctl run``), a process that carries that, no
``GPUD_RUN``, and descends from the holder is one of the run's too; a shell that took the
environment from ``gpuctl env`` does not descend from it. What such a run left re-parented
to init is not found.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from gpud.mps.procs import stat_fields

RUN_VAR: Final = "GPUD_RUN"
RESERVATION_VAR: Final = "GPUD_RESERVATION"  # gpud.jobs.env
POLL_S: Final = 0.1


def processes(
    run: str, proc_root: Path = Path("/proc"), *, skip: int | None = None, holder: int | None = None
) -> list[int]:
    """PIDs whose environment carries ``GPUD_RUN=<run>``: of another user's processes only
    those whose ``environ`` this process may read (all of them as root). Zombies have an
    empty ``environ`` and are not listed. ``holder``: the PID of the run's ``gpuctl run``,
    to find the processes of a run an older ``gpuctl run`` started (see above)."""
    needle = f"{RUN_VAR}={run}".encode()
    older = f"{RESERVATION_VAR}={run}".encode()
    unmarked = f"{RUN_VAR}=".encode()
    found, descendants = [], []
    try:
        names = os.listdir(proc_root)
    except OSError:
        return []
    for name in names:
        if not name.isdigit() or int(name) == skip:
            continue
        try:
            environ = (proc_root / name / "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours to read
        variables = environ.split(b"\0")
        if needle in variables:
            found.append(int(name))
        elif holder and older in variables and not any(v.startswith(unmarked) for v in variables):
            descendants.append(int(name))
    found += [pid for pid in descendants if _descends(pid, holder or 0, proc_root)]
    return sorted(found)


def _descends(pid: int, ancestor: int, proc_root: Path) -> bool:
    """``ancestor`` is the parent of ``pid``, or of its parent, and so on."""
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        fields = stat_fields(pid, proc_root)
        try:
            pid = int(fields[1]) if fields else 0  # field 4 of proc(5): the parent's PID
        except (IndexError, ValueError):
            return False
        if pid == ancestor:
            return True
    return False


def kill(
    run: str,
    sig: int = signal.SIGKILL,
    proc_root: Path = Path("/proc"),
    *,
    send: Callable[[int, int], None] = os.kill,
    holder: int | None = None,
) -> list[int]:
    """Send ``sig`` to every process of ``run`` (``holder``: see :func:`processes`), as
    listed right then: a PID listed earlier may have been reused since by a process of no
    run; the PIDs it was sent to."""
    sent = []
    for pid in processes(run, proc_root, skip=os.getpid(), holder=holder):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            send(pid, sig)
            sent.append(pid)
    return sent


def stop(
    run: str,
    grace_s: float,
    proc_root: Path = Path("/proc"),
    *,
    send: Callable[[int, int], None] = os.kill,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
    reap: Callable[[], None] | None = None,
    hurry: Callable[[], bool] = lambda: False,
) -> tuple[list[int], list[int]]:
    """SIGTERM to every process of ``run``, then SIGKILL to those still there after ``grace_s`` seconds, or as soon as
    ``hurry()`` says so: ``(terminated, killed)``. ``reap`` collects exited children of the
    caller (a process that is gone but not waited for still reads as there)."""
    terminated = kill(run, signal.SIGTERM, proc_root, send=send)
    if not terminated:
        return [], []
    deadline = clock() + grace_s
    while clock() < deadline and not hurry():
        if reap is not None:
            reap()
        if not processes(run, proc_root, skip=os.getpid()):
            return terminated, []
        sleep(POLL_S)
    killed = kill(run, signal.SIGKILL, proc_root, send=send)
    if reap is not None:
        reap()
    return terminated, killed
