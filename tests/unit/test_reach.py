"""Who can reach the socket and the MPS pipes: the rule against made-up modes, then against
the kernel itself (a process of another user connecting), and the shipped unit."""

from __future__ import annotations

import configparser
import os
import pwd
import socket
import stat
from pathlib import Path

import pytest

from gpud.reach import closed_dir, reach_warnings

UNIT = Path(__file__).parents[2] / "systemd" / "gpud.service"
GROUP = 1234
SOCK = Path("/run/gpud/gpud.sock")
RUN = Path("/run/gpud")


def modes(run_gpud: tuple[int, int]) -> dict[Path, os.stat_result]:
    """``/run/gpud`` of (mode, gid); ``/`` and ``/run`` 0755 root."""

    def st(mode: int, gid: int) -> os.stat_result:
        return os.stat_result((stat.S_IFDIR | mode, 0, 0, 2, 0, gid, 0, 0, 0, 0))

    return {Path("/"): st(0o755, 0), Path("/run"): st(0o755, 0), RUN: st(*run_gpud)}


def stat_of(table: dict[Path, os.stat_result]):  # type: ignore[no-untyped-def]
    return lambda p: table[p]


def test_a_run_dir_of_mode_0750_group_root_keeps_the_group_from_the_socket() -> None:
    table = modes((0o750, 0))
    closed = closed_dir(SOCK, GROUP, stat_of=stat_of(table))
    assert closed is not None and closed[0] == RUN
    (warning,) = reach_warnings(
        SOCK, RUN, group="gpud", gid=GROUP, mps=False, stat_of=stat_of(table)
    )
    assert warning == (
        "members of api.socket_group 'gpud' cannot reach the socket /run/gpud/gpud.sock:"
        " /run/gpud (mode 0750) lets only its owner and group root through: give it o+x"
        " (chmod o+x /run/gpud; the shipped unit's RuntimeDirectoryMode=0711 does)"
    )
    (mps,) = reach_warnings(SOCK, RUN, group=None, gid=None, mps=True, stat_of=stat_of(table))
    assert mps.startswith(
        "jobs run by users other than root cannot reach the MPS control daemons under"
        " /run/gpud/mps (their CUDA processes cannot connect to MPS): /run/gpud (mode 0750)"
    )


@pytest.mark.parametrize(
    "mode,gid,closed",
    [
        (0o711, 0, False),  # the shipped unit's
        (0o755, 0, False),  # gpud's own mkdir under umask 0022
        (0o750, GROUP, False),  # the socket's group owns it
        (0o710, GROUP, False),
        (0o750, 0, True),  # systemd's RuntimeDirectory with mode 0750
        (0o700, GROUP, True),
    ],
)
def test_who_passes_a_directory(mode: int, gid: int, closed: bool) -> None:
    table = modes((mode, gid))
    assert (closed_dir(SOCK, GROUP, stat_of=stat_of(table)) is not None) is closed
    warnings = reach_warnings(SOCK, RUN, group="gpud", gid=GROUP, mps=True, stat_of=stat_of(table))
    assert len(warnings) == (2 if closed else 0)


def test_no_group_no_socket_check() -> None:
    """Without api.socket_group only root may use the socket: nothing to say of it."""
    table = modes((0o700, 0))
    assert reach_warnings(SOCK, RUN, group=None, gid=None, mps=False, stat_of=stat_of(table)) == []


def test_the_shipped_unit_lets_the_group_reach_the_socket() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string(UNIT.read_text())
    mode = int(unit["Service"]["RuntimeDirectoryMode"], 8)
    assert mode & stat.S_IXOTH and not mode & (stat.S_IWGRP | stat.S_IWOTH | stat.S_IROTH)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
@pytest.mark.parametrize("mode", [0o750, 0o711])
def test_the_rule_is_the_kernels(open_dir: Path, mode: int) -> None:
    """A process of user nobody in group GROUP connects to a socket of mode 0660, group
    GROUP, in a directory of ``mode`` owned by root: it gets through exactly when
    :func:`closed_dir` says the way is open."""
    run = open_dir / "run"
    run.mkdir(mode=mode)
    run.chmod(mode)
    path = run / "gpud.sock"
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(path))
        server.listen()
        os.chmod(path, 0o660)
        os.chown(path, -1, GROUP)
        nobody = pwd.getpwnam("nobody").pw_uid
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                os.setgroups([GROUP])
                os.setgid(GROUP)
                os.setuid(nobody)
                client = socket.socket(socket.AF_UNIX)
                client.connect(str(path))
                code = 0
            except PermissionError:
                code = 13
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        server.close()
    reached = os.waitstatus_to_exitcode(status) == 0
    assert os.waitstatus_to_exitcode(status) in (0, 13)
    assert reached is (closed_dir(path, GROUP) is None)
    assert reached is (mode == 0o711)
