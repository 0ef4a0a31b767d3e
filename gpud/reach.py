"""Who can reach gpud's socket and the MPS control daemons' pipes, through the directories
on the way to them.

A unix socket is reached through every directory above it: a user other than the owner
passes one only with its execute bit, for others (``o+x``) or for its group (``g+x``, when
the user is in the directory's group). gpud's socket (mode 0660, ``api.socket_group``) is
of no use to the group's members behind a run directory of mode 0750 and group root, as
systemd creates ``RuntimeDirectory=`` with ``RuntimeDirectoryMode=0750``; nor are the MPS
control daemons' pipe directories (``<run_dir>/mps/<uuid>/pipe``, where jobs' CUDA clients
connect) to the users jobs run as. Nothing fails at gpud's start: ``gpuctl`` of a non-root
user says ``Permission denied`` and MPS clients never reach their daemon. These checks say
so at the start instead, and ``gpuctl`` names the directory that keeps its user out.
Standard library only: ``gpuctl`` imports it.
"""

from __future__ import annotations

import grp
import os
import stat
from collections.abc import Callable
from pathlib import Path


def closed_dir(
    path: Path, gid: int | None, *, stat_of: Callable[[Path], os.stat_result] = Path.stat
) -> tuple[Path, os.stat_result] | None:
    """The first directory on the way to ``path`` (its parents, from ``/`` down) that a
    non-root user who does not own it cannot pass: a member of group ``gid`` (None: any
    user) passes one with ``o+x``, or with ``g+x`` when it is the directory's group. None
    when every one lets them through (or one cannot be read: that is said elsewhere)."""
    for directory in reversed(path.absolute().parents):
        try:
            st = stat_of(directory)
        except OSError:
            return None
        if st.st_mode & stat.S_IXOTH:
            continue
        if gid is not None and st.st_gid == gid and st.st_mode & stat.S_IXGRP:
            continue
        return directory, st
    return None


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _why(directory: Path, st: os.stat_result) -> str:
    group = f" and group {_group_name(st.st_gid)}" if st.st_mode & stat.S_IXGRP else ""
    return (
        f"{directory} (mode {stat.S_IMODE(st.st_mode):04o}) lets only its owner{group} through"
        f": give it o+x (chmod o+x {directory}; the shipped unit's"
        " RuntimeDirectoryMode=0711 does)"
    )


def closed_to_caller(
    path: Path,
    *,
    access: Callable[[Path, int], bool] = os.access,
    stat_of: Callable[[Path], os.stat_result] = Path.stat,
) -> str | None:
    """Why this process cannot pass a directory on the way to ``path`` (the first one,
    from ``/`` down, that ``access`` says it may not search), or None when it passes them
    all: the kernel's answer for the caller, where :func:`closed_dir` reasons for a group.
    Read by ``gpuctl`` when the socket refuses it, so that a member of the socket's group
    is not told to join it."""
    for directory in reversed(path.absolute().parents):
        if access(directory, os.X_OK):
            continue
        try:
            return _why(directory, stat_of(directory))
        except OSError:
            return f"{directory} does not let this user through"
    return None


def reach_warnings(
    socket: Path,
    run_dir: Path,
    *,
    group: str | None,
    gid: int | None,
    mps: bool,
    stat_of: Callable[[Path], os.stat_result] = Path.stat,
) -> list[str]:
    """What to warn of at start: the socket out of reach of ``api.socket_group`` (``group``,
    id ``gid``; no check without one: only root may use the socket then), and, with MPS on,
    the MPS pipe directories out of reach of the users jobs run as (the group's members when
    there is one, else any user)."""
    out = []
    if group is not None and gid is not None:
        closed = closed_dir(socket, gid, stat_of=stat_of)
        if closed is not None:
            out.append(
                f"members of api.socket_group {group!r} cannot reach the socket {socket}:"
                f" {_why(*closed)}"
            )
    if mps:  # gpud makes <run_dir>/mps and what it holds 0755 itself
        closed = closed_dir(run_dir / "mps", gid, stat_of=stat_of)
        if closed is not None:
            who = f"members of api.socket_group {group!r}" if group else "users other than root"
            out.append(
                f"jobs run by {who} cannot reach the MPS control daemons under"
                f" {run_dir / 'mps'} (their CUDA processes cannot connect to MPS):"
                f" {_why(*closed)}"
            )
    return out
