"""Output piped into a reader that stops early (``... | head -3``)."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TextIO, cast

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what `yes | head` reports for `yes`
EXIT_HUNG_UP = 129  # 128 + SIGHUP: what a shell reports for a command its closed terminal ended
EXIT_OTHER_PIPE = 1  # a pipe or socket other than gpuctl's own output broke
# a parser default: the command runs, its errors said included, within
# stderr_that_never_fails (as every command's usage errors are)
STDERR_MAY_GO = "stderr_may_go"


def quiet_on_broken_pipe(run: Callable[[], int]) -> int:
    """``run()``'s exit code; when its reader has gone (stdout's or stderr's), exit 141
    quietly, as a process killed by SIGPIPE would, instead of a ``BrokenPipeError``
    traceback; when its terminal has hung up instead (closed, its writes failing with EIO,
    SIGHUP not received: ``trap '' HUP``, a job after ``disown``, ``setsid`` with output
    left on the terminal), exit 129 quietly, as the terminal's SIGHUP would have. A
    broken pipe of anything else (a pipe to a child, a socket) is an error of its own: said
    on stderr, exit 1."""
    try:
        code = run()
        if sys.stdout is not None:  # None: started with stdout closed
            sys.stdout.flush()  # inside the try: a pipe closed early shows here for buffered output
    except OSError as err:
        if not isinstance(err, BrokenPipeError) and err.errno != errno.EIO:
            raise
        gone = output_gone()
        if gone is None:
            if not isinstance(err, BrokenPipeError):
                raise  # an EIO of a file or device other than gpuctl's output
            print(f"gpuctl: {err.strerror or 'broken pipe'} (not gpuctl's output)", file=sys.stderr)
            return EXIT_OTHER_PIPE
        discard_stdout()
        return gone
    return code


def output_gone() -> int | None:
    """The exit code for stdout's or stderr's end gone, stdout's first: 141 for a pipe (or
    socket) whose reader went, 129 for a terminal that hung up; None while both are there."""
    for stream in (sys.stdout, sys.stderr):
        if reader_gone(stream):
            return EXIT_BROKEN_PIPE if _is_pipe(stream) else EXIT_HUNG_UP
    return None


def _is_pipe(stream: TextIO) -> bool:
    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (AttributeError, OSError, ValueError):
        return True
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def discard_stdout() -> None:
    """Point stdout at /dev/null once it has failed: Python flushes it again at exit, and
    that flush then has nowhere to fail and prints no "Exception ignored" traceback."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # no stdout (started closed) or no real file behind it: nothing to flush
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def reader_gone(stream: TextIO | None) -> bool:
    """Whether ``stream``'s reader has gone: its file is a pipe or socket whose other end
    closed, or a terminal that hung up (``poll`` says POLLERR or POLLHUP at once). False
    without a real file behind it."""
    try:
        if stream is None:
            return False
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR, POLLHUP and POLLNVAL are reported regardless
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))


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


# the errors after which nothing more can be written to a stream
_LOST = frozenset({errno.EPIPE, errno.EIO, errno.ENOSPC, errno.EBADF})


class _Lossy:
    """A stream that passes writes on until one fails for good (a terminal hung up: EIO;
    its reader gone: EPIPE; a full disk; closed), then drops them: nothing more reaches it,
    and the writer goes on. A write that fails otherwise (a non-blocking stream full for
    now: EAGAIN) loses that one alone. Whatever else it is asked goes to the stream."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.lost = False

    def write(self, text: str) -> int:
        self._try(lambda: self._stream.write(text))
        return len(text)

    def flush(self) -> None:
        self._try(self._stream.flush)

    def _try(self, act: Callable[[], object]) -> None:
        if not self.lost:
            try:
                act()
            except OSError as err:
                self.lost = err.errno in _LOST
            except ValueError:  # closed
                self.lost = True

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


@contextlib.contextmanager
def stderr_that_never_fails() -> Iterator[None]:
    """Within it, a message on stderr that cannot be written (``gpuctl run`` whose terminal
    went away, ``2>&1 | head -1``) is dropped rather than raised: what gpuctl does after it
    (leaving the queue, stopping what the command left, releasing the reservation with the
    command's exit status) must still be done."""
    stream = sys.stderr
    if stream is None:  # started with stderr closed: print() then writes nothing anyway
        yield
        return
    sys.stderr = cast("TextIO", _Lossy(stream))
    try:
        yield
    finally:
        sys.stderr = stream
