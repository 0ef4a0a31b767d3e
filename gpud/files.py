"""Writing a state file so that a crash leaves the old or the new contents, never half.

Pure standard library: the backends, the telemetry sampler and the daemon's loops all keep
small state files this way.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, whatever stops the writer (a kill, a
    power cut): a temporary file beside it, flushed to disk, renamed over it, the rename
    flushed. The temporary file is removed when the write fails."""
    tmp = path.with_name(f".{path.name}.tmp")  # one writer per file
    try:
        with tmp.open("w") as f:
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
