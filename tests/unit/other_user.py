"""Acting as a user other than root, as operators and jobs do: a forked child that drops to
``nobody`` (in a group of the test's choice), for tests that run as root.

The paths such a child reaches must lie under a directory other users may pass:
the fixture ``open_dir`` (conftest) makes one under /tmp (pytest's own ``tmp_path`` is under a
0700 one).
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable

import pytest

GROUP = 1234  # a group no account is in; the child is made a member
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


def as_nobody(act: Callable[[], int], *, groups: tuple[int, ...] = ()) -> int:
    """Run ``act`` in a child as user ``nobody`` (with ``groups``, the first its primary
    group; else nobody's own group) and return the child's exit code: ``act``'s value, 13
    when it raised PermissionError, 1 when it raised anything else."""
    nobody = pwd.getpwnam("nobody")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups(list(groups))
            os.setgid(groups[0] if groups else nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            code = act()
        except PermissionError:
            code = 13
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
