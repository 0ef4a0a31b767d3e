"""Output piped into a reader that stops early (``... | head -3``)."""

from __future__ import annotations

import os
import select
import sys
import threading
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


def when_reader_goes(act: Callable[[], object], *, every_s: float = 0.5) -> threading.Event:
    """Call ``act`` once stdout's reader has gone (a pipe's read end closed: ``poll`` says
    POLLERR; a terminal hung up: POLLHUP), for output that waits long between writes
    (``--watch``), which would learn it only at its next write. Returns the event set then.
    A regular file never reports either."""
    gone = threading.Event()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return gone  # no real file behind stdout (a test's capture): nothing to watch

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, 0)  # POLLERR, POLLHUP and POLLNVAL are reported regardless
        while not poller.poll(every_s * 1000):
            pass
        gone.set()
        act()

    threading.Thread(target=watch, name="gpuctl-reader", daemon=True).start()
    return gone
