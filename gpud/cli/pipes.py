"""Output piped into a reader that stops early (``... | head -3``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what `yes | head` reports for `yes`


def quiet_on_broken_pipe(run: Callable[[], int]) -> int:
    """``run()``'s exit code; when its reader has gone, exit 141 quietly, as a process
    killed by SIGPIPE would, instead of a ``BrokenPipeError`` traceback."""
    try:
        code = run()
        sys.stdout.flush()  # inside the try: a pipe closed early shows here for buffered output
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush has
        # nowhere to fail and prints no "Exception ignored" traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    return code
