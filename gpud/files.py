"""Writing a state file so that a crash leaves the old or the new contents, never half;
reading a small text file an operator names, whatever it turns out to be.

Pure standard library: the backends, the telemetry sampler and the daemon's loops all keep
small state files this way.
"""

from __future__ import annotations

import os
import sys
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


def read_small_text(path: Path, limit: int) -> str:
    """The UTF-8 text of ``path`` (``-``: standard input), read no further than ``limit``
    bytes, so that ``/dev/zero`` or a disk image named by mistake fails at once. Raises
    ``OSError`` when it cannot be read, ``ValueError`` (with the reason) when it is larger
    than ``limit`` or not UTF-8 text."""
    if str(path) == "-":
        raw = sys.stdin.buffer.read(limit + 1)
    else:
        with path.open("rb") as f:
            raw = f.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"larger than {limit // 1024} KiB: not a file of this kind")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"not UTF-8 text (byte {err.start})") from None
