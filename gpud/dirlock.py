"""``gpud.lock``: held in the state and run directories (``flock``, released when the process
ends, ``kill -9`` included) so that a second gpud on the same directories stops before it
touches the GPUs, the state or the sockets.

::

    locks = DirLocks.take({state_dir: ("daemon.state_dir", 0o755), run_dir: (...)})
    ...
    locks.keep()    # each loop pass: a lock file removed (``rm -rf /run/gpud``) made again
    locks.close()

A lock on a file that was removed protects nothing: a second gpud would create a new
``gpud.lock`` there and take it. :meth:`DirLocks.keep` makes the directory and the file
again and takes the new one, so that the second gpud is refused as before.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from gpud import files
from gpud.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_NAME = "gpud.lock"


def lock_dir(path: Path, key: str) -> int:
    """Take ``path/gpud.lock`` (created, and this process's pid written in it); its
    descriptor. A ConfigError naming ``key`` and the holder's pid when another process
    holds it, or naming the file when it cannot be opened or written."""
    lock = path / LOCK_NAME
    try:
        # never through a link: the file is truncated below
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise ConfigError(f"cannot open {lock}: {err.strerror or err}", key=key) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(
            f"another gpud (pid {holder}) holds {lock}: is gpud already running?", key=key
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as err:  # a full disk
        os.close(fd)
        raise ConfigError(f"cannot write {lock}: {err.strerror or err}", key=key) from None
    return fd


class DirLocks:
    """The ``gpud.lock`` of each directory, held; see the module docstring. ``dirs``: each
    directory's config key and the mode it is made again with."""

    def __init__(self, dirs: dict[Path, tuple[str, int]], held: dict[Path, int]) -> None:
        self._dirs = dirs
        self._held = held
        self._said: dict[Path, str] = {}  # the error said last for a directory, said once

    @classmethod
    def take(cls, dirs: dict[Path, tuple[str, int]]) -> DirLocks:
        """Lock every directory (which must exist), or none: the ConfigError of the first
        that cannot be."""
        held: dict[Path, int] = {}
        try:
            for path, (key, _) in dirs.items():
                held[path] = lock_dir(path, key)
        except ConfigError:
            for fd in held.values():
                os.close(fd)
            raise
        return cls(dirs, held)

    def close(self) -> None:
        for fd in self._held.values():
            os.close(fd)
        self._held = {}

    def keep(self) -> list[Path]:
        """Make each lock file that is no longer the one held (removed with its directory,
        or alone) again, and take it; the directories whose lock was taken again. One that
        cannot be (another gpud took the new file first, a read-only file system) is said
        in the log, once until it changes, and tried again at the next call."""
        again: list[Path] = []
        for path, fd in list(self._held.items()):
            key, mode = self._dirs[path]
            try:
                try:
                    st = (path / LOCK_NAME).lstat()
                    held = os.fstat(fd)
                    if (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
                        continue
                except FileNotFoundError:
                    pass
                # made again as at the start: refused where another user could plant links
                files.make_dir(path, key, mode)
                new = lock_dir(path, key)
            except (OSError, ConfigError) as err:  # EIO, EACCES, ENOTDIR: said, tried again
                message = f"{key}: {err}" if isinstance(err, OSError) else str(err)
                if self._said.get(path) != message:
                    self._said[path] = message
                    log.error(
                        "%s was removed while gpud ran and cannot be locked again: %s",
                        path / LOCK_NAME,
                        message,
                    )
                continue
            os.close(fd)
            self._held[path] = new
            self._said.pop(path, None)
            again.append(path)
            log.warning(
                "%s was removed while gpud ran: made and locked again, so that a second"
                " gpud on %s is refused",
                path / LOCK_NAME,
                path,
            )
        return again
