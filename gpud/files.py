"""Writing a state file so that a crash leaves the old or the new contents, never half.

Pure standard library (and :mod:`gpud.errors`): the backends, the telemetry sampler and the
daemon's loops all keep small state files this way; gpud's own directories are made, and
checked, here (:func:`make_dir`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpud.errors import ConfigError

# Modes gpud gives what it creates, whatever the umask it was started with (systemd's unit
# has UMask=0027; a root shell 0022, or 0077):
STATE_DIR_MODE = 0o750  # <state_dir>: gpud's own, its group may read (backups, monitoring)
RUN_DIR_MODE = 0o711  # <run_dir>: the socket's group and jobs' users pass through, not list
DB_MODE = 0o600  # state.db (SQLite gives its -wal and -shm its mode): reservations' tokens
DB_MOST = 0o640  # ... an existing one may keep its group's read, no more
STATE_FILE_MODE = 0o640  # events.jsonl, colo.json: what the API shows anyway
RUN_FILE_MODE = 0o644  # the run directory's state (XID faults, the simulated node's devices)
ABOVE_MODE = 0o755  # directories gpud creates on the way to one of its own


def make_dirs(path: Path, mode: int) -> list[Path]:
    """``mkdir -p path`` with explicit modes: ``path`` gets ``mode`` and each directory above
    it that is missing 0755, whatever the umask (under ``umask 077`` a created run directory
    would be 0700, closed to the socket's group and the jobs' MPS clients). An existing
    directory keeps its mode. Returns the directories created, from the top down. Raises
    OSError as ``mkdir`` does; a file in the way of ``path`` itself is left for the caller to
    find."""
    created: list[Path] = []
    for directory in reversed((path, *path.parents)):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            continue
        os.chmod(directory, mode if directory == path else ABOVE_MODE)
        created.append(directory)
    return created


def make_dir(path: Path, key: str, mode: int) -> str:
    """``mkdir -p path``, a directory it creates with ``mode`` (those above 0755) whatever
    the umask (:func:`make_dirs`); a ConfigError naming ``key`` and the path when
    it cannot be, or when a user other than gpud's own could plant files there
    (:func:`check_private`). Returns one line for the log naming what it created with its
    mode and owner, as ``ls -ld`` showed them when checked (:func:`made_said`); "" when it
    created nothing."""
    try:
        created = make_dirs(path, mode)
        st = path.stat()
    except OSError as err:
        raise ConfigError(f"cannot create {path}: {err.strerror or err}", key=key) from None
    check_dir(path, st, key)
    return made_said(key, created, st)


def check_dir(path: Path, st: os.stat_result, key: str) -> None:
    """What :func:`make_dir` asks of a directory of gpud's that is there (``st``: its
    ``stat``, through a symbolic link as ``mkdir -p`` goes): that it is one, and one no user
    but gpud's own may plant files in (:func:`check_private`); a ConfigError naming ``key``
    when not. ``gpud --check-config`` asks the same of one that exists, without making."""
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"cannot create {path}: it exists and is not a directory", key=key)
    check_private(path, st, key, euid=os.geteuid())


def made_said(key: str, created: list[Path], st: os.stat_result) -> str:
    """One line for the log naming what :func:`make_dir` created for ``key`` (the last of
    ``created`` is the directory asked for, ``st`` its stat); "" when it created nothing."""
    if not created:
        return ""
    said = f"created {created[-1]} for {key} (mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid})"
    if len(created) > 1:
        above = ", ".join(str(p) for p in created[:-1])
        said += f", and above it {above} (mode {ABOVE_MODE:04o})"
    return said


def check_private(path: Path, st: os.stat_result, key: str, *, euid: int) -> None:
    """gpud (root) creates, truncates, chmods and chowns files in its directories: one other
    users may write to (``/tmp``; a group's) or another user owns would let them plant a
    symbolic link there (``gpud.lock -> /etc/passwd``, or the socket swapped for a link to
    ``/etc/shadow`` before gpud sets its mode and group) and have gpud write through it. A
    ConfigError naming ``key`` then; a directory of root's or gpud's own user that only its
    owner may write to is taken."""
    if st.st_mode & (stat.S_IWOTH | stat.S_IWGRP):
        who = "every user" if st.st_mode & stat.S_IWOTH else f"group {st.st_gid}"
        raise ConfigError(
            f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}): gpud keeps"
            " its lock, socket and state files in a directory of its own",
            key=key,
        )
    if st.st_uid not in (0, euid):
        raise ConfigError(
            f"{path} belongs to uid {st.st_uid}, not to gpud's user (uid {euid}) or root:"
            " gpud keeps its lock, socket and state files in a directory of its own",
            key=key,
        )


def tighten(path: Path, most: int) -> int | None:
    """Take from ``path``'s permission bits those beyond ``most`` (``chmod``, never through a
    symbolic link); its mode before when that changed it, None when it had none of them or
    does not exist."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    before = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode) or not before & ~most & 0o777:
        return None
    os.chmod(path, before & (most | 0o7000))
    return before


def tighten_all(paths: list[tuple[Path, int]]) -> list[str]:
    """:func:`tighten` each path to its mode; ``"PATH (was 0644)"`` for each it changed, and
    ``"PATH (not closed: ...)"`` for each it could not (another owner's, a read-only
    mount): said, not fatal, as the state store says itself what it cannot open."""
    said = []
    for path, most in paths:
        try:
            before = tighten(path, most)
        except OSError as err:
            said.append(f"{path} (not closed: {err.strerror or err})")
            continue
        if before is not None:
            said.append(f"{path} (was {before:04o})")
    return said


def write_atomically(path: Path, text: str, *, mode: int = RUN_FILE_MODE) -> None:
    """``path`` holds ``text`` or what it held before, whatever stops the writer (a kill, a
    power cut): a temporary file beside it, flushed to disk, renamed over it, the rename
    flushed. The temporary file is removed when the write fails. The file gets ``mode``,
    whatever the umask."""
    tmp = path.with_name(f".{path.name}.tmp")  # one writer per file
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(fd, mode)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


UNREADABLE_SUFFIX = ".unreadable"


def keep_aside(path: Path) -> Path | None:
    """Rename a state file gpud cannot read to ``<name>.unreadable`` beside it, so that the
    next write (which starts afresh) does not destroy what an operator could still recover
    by hand; an earlier one is replaced. ``None`` when it cannot be renamed (a read-only
    directory): the file then stays where it is."""
    aside = path.with_name(path.name + UNREADABLE_SUFFIX)
    try:
        os.replace(path, aside)
    except OSError:
        return None
    return aside
