"""A child process that does not outlive the process that started it, whatever kills that one.

A parent that dies by SIGKILL (``kill -9``, a CI job cancelled, ``timeout -k``) runs no
cleanup: its children are left running, reparented to init (or the nearest subreaper). The
kernel can send such a child a signal of its choosing instead, when its parent thread exits:
``prctl(PR_SET_PDEATHSIG, sig)``, kept across exec. It is set from the child itself, so it
is written here as the first lines of a ``python -c`` program; ``preexec_fn`` is not
used, as it is unsafe in a parent with threads running (gRPC's).

The parent may have died already, before the child asked: then the child's parent PID is no
longer the one it was started by (``getppid()``), and it exits at once.
"""

from __future__ import annotations

import signal

PR_SET_PDEATHSIG = 1


def dies_with_parent(sig: signal.Signals, parent: str, exit_code: int) -> str:
    """Python source, one statement a line, that the kernel sends this process ``sig`` when
    its parent exits (PR_SET_PDEATHSIG), and that exits with ``exit_code`` if the parent
    already has: ``parent`` is a Python expression for the parent's PID, which the starting
    process knows and writes in (``int(sys.argv[1])``, or a number). The program imports
    ``os``, ``sys`` and ``ctypes`` before these lines."""
    return (
        f"ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG},{int(sig)})\n"
        f"os.getppid()=={parent} or sys.exit({exit_code})\n"
    )
