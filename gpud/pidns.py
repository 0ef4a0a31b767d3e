"""A client's PID in gpud's own view of processes, over an injectable ``/proc``.

``gpuctl run`` inside a container (gpud's socket bind-mounted, ``unshare --pid``, docker,
podman) knows its own PID only as that container's PID namespace numbers it: PID 1, 7, ...
gpud, in the host's namespace, would take that number for another process (host PID 1
never exits: the reservation is held for ever) or for none (released at once). So the
client sends, beside the PID, the identity of its PID namespace: the inode number of its
``/proc/self/ns/pid`` (``readlink /proc/self/ns/pid`` -> ``pid:[4026532712]``). When that
is not gpud's own namespace, gpud looks for the process whose ``ns/pid`` link names that
namespace and whose ``/proc/<pid>/status`` ``NSpid:`` line (its PID in each namespace, from
the one of gpud's /proc outward view down to the innermost) ends with the client's PID::

    $ grep NSpid /proc/48213/status
    NSpid:  48213   7

The scan runs only when the namespaces differ. A namespace gpud cannot see (gpud itself in
a container that does not hold the client's) has no such process: refused, nothing held.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gpud.errors import FailedPrecondition

_LINK = re.compile(r"pid:\[(\d+)\]")


def namespace_of(pid: int | str, proc_root: Path = Path("/proc")) -> int | None:
    """The inode number of the PID namespace of process ``pid`` (``"self"``: the caller's)
    as ``<proc_root>/<pid>/ns/pid`` names it; None when unreadable (gone, another user's
    process for an unprivileged reader)."""
    try:
        link = os.readlink(proc_root / str(pid) / "ns" / "pid")
    except OSError:
        return None
    match = _LINK.fullmatch(link)
    return int(match.group(1)) if match else None


def own_namespace() -> int | None:
    """The inode number of the calling process's PID namespace (what ``gpuctl`` sends);
    None where ``/proc`` is not mounted."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def status_line(pid: int | str, name: str, proc_root: Path = Path("/proc")) -> list[str] | None:
    """The fields of line ``name:`` of ``/proc/<pid>/status``; None when the process is
    gone or the line is missing. ``Name:`` holds the process's ``comm`` as it set it, any
    bytes: those that are not UTF-8 come back as surrogate escapes, not a failed read."""
    try:
        status = (proc_root / str(pid) / "status").read_text(errors="surrogateescape")
    except OSError:
        return None
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.split()
    return None


def ns_pids(pid: int | str, proc_root: Path = Path("/proc")) -> list[int] | None:
    """The ``NSpid:`` line of ``<proc_root>/<pid>/status``: the process's PID in each PID
    namespace it is in, outermost (the one of that /proc) first; None when unreadable."""
    fields = status_line(pid, "NSpid", proc_root)
    try:
        return None if fields is None else [int(v) for v in fields]
    except ValueError:
        return None


def find(pid: int, namespace: int, proc_root: Path = Path("/proc")) -> int | None:
    """The PID, as ``proc_root`` numbers it, of the process that PID namespace
    ``namespace`` calls ``pid``; None when ``proc_root`` shows none."""
    try:
        entries = [e.name for e in os.scandir(proc_root) if e.name.isdigit()]
    except OSError:
        return None
    for name in entries:
        if namespace_of(name, proc_root) != namespace:
            continue
        pids = ns_pids(name, proc_root)
        if pids and pids[-1] == pid:
            return int(name)
    return None


def local_pid(
    pid: int, namespace: int | None, proc_root: Path = Path("/proc"), *, field: str = "pid"
) -> int:
    """``pid`` of PID namespace ``namespace`` as gpud numbers it. ``namespace`` None (a
    client that does not say, as an older gpuctl) or gpud's own: ``pid`` as it is.
    FailedPrecondition, naming the field, the PID and the namespace, when gpud sees no
    such process."""
    if namespace is None or namespace == namespace_of("self", proc_root):
        return pid
    found = find(pid, namespace, proc_root)
    if found is None:
        raise FailedPrecondition(
            f"{field}: no process {pid} of PID namespace pid:[{namespace}] is visible to gpud"
            " (gone, or in a container that gpud's own PID namespace does not hold)"
        )
    return found
