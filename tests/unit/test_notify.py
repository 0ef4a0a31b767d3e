import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.notify import Notifier, while_starting


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    yield sock, path
    sock.close()


def test_sends_ready_watchdog_stopping(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    n = Notifier.from_environ({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"})
    assert n.enabled
    assert n.watchdog_interval_s == 2.0
    assert n.ready("serving 8 GPUs")
    assert sock.recv(256) == b"READY=1\nSTATUS=serving 8 GPUs"
    n.watchdog()
    assert sock.recv(256) == b"WATCHDOG=1"
    n.stopping()
    assert sock.recv(256) == b"STOPPING=1"


def test_no_watchdog_unless_systemd_asks(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    n = Notifier.from_environ({"NOTIFY_SOCKET": path})
    assert not n.watchdog()
    assert n.ready()
    assert sock.recv(256) == b"READY=1"


def test_a_receiver_that_does_not_read_never_blocks(listener: tuple[socket.socket, str]) -> None:
    _, path = listener
    n = Notifier.from_environ({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"})
    results = [n.watchdog() for _ in range(5000)]  # far more than the socket queue holds
    assert results[0]
    assert not results[-1]  # dropped, not blocked


def test_without_systemd_is_a_no_op() -> None:
    n = Notifier.from_environ({})
    assert not n.enabled
    assert n.watchdog_interval_s is None
    assert not n.ready()


def test_garbage_watchdog_settings_are_ignored() -> None:
    assert Notifier.from_environ({"WATCHDOG_USEC": "soon"}).watchdog_interval_s is None
    assert (
        Notifier.from_environ({"WATCHDOG_USEC": "1", "WATCHDOG_PID": "x"}).watchdog_interval_s
        is None
    )


def test_the_units_watchdog_sec_is_read_from_watchdog_usec() -> None:
    """``WatchdogSec=30s`` reaches gpud as ``WATCHDOG_USEC=30000000``; none, or another
    process's, is no watchdog."""
    assert Notifier.from_environ({"WATCHDOG_USEC": "30000000"}).watchdog_s == 30.0
    assert Notifier.from_environ({}).watchdog_s is None
    assert (
        Notifier.from_environ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}).watchdog_s is None
    )


def test_watchdog_for_another_pid_is_ignored() -> None:
    n = Notifier.from_environ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert n.watchdog_interval_s is None


def test_start_up_work_that_moves_asks_systemd_for_more_time(
    listener: tuple[socket.socket, str],
) -> None:
    """An interrupted MIG apply resumed at start can outlast TimeoutStartSec: while its steps
    go on, systemd is given more time (EXTEND_TIMEOUT_USEC); once they stop moving, none."""
    sock, path = listener
    n = Notifier.from_environ({"NOTIFY_SOCKET": path})
    steps = [0]

    async def resume() -> str:
        for _ in range(4):  # a step per check, then a long wait in one step
            await asyncio.sleep(0.1)
            steps[0] += 1
        await asyncio.sleep(0.35)
        return "converged"

    result = asyncio.run(
        while_starting(
            resume(),
            n,
            progress=lambda: steps[0],
            status=lambda k: f"{k} changes made",
            every_s=0.1,
            extend_s=90,
        )
    )
    assert result == "converged"
    sock.settimeout(0.05)
    got = []
    with contextlib.suppress(TimeoutError):
        while True:
            got.append(sock.recv(256).decode())
    assert got and len(got) <= 4  # none for the checks while the last step took its time
    assert all(m.startswith("EXTEND_TIMEOUT_USEC=90000000\nSTATUS=") for m in got)
    assert got[-1].endswith("4 changes made")


def test_start_up_work_that_raises_raises_and_asks_for_nothing(
    listener: tuple[socket.socket, str],
) -> None:
    sock, path = listener
    n = Notifier.from_environ({"NOTIFY_SOCKET": path})

    async def fails() -> None:
        await asyncio.sleep(0.15)
        raise RuntimeError("driver said no")

    with pytest.raises(RuntimeError, match="driver said no"):
        asyncio.run(while_starting(fails(), n, progress=lambda: 0, status=str, every_s=0.05))
    sock.settimeout(0.05)
    with pytest.raises(TimeoutError):
        sock.recv(256)


def test_failed_sends_are_logged_once_until_one_works_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "notify.sock")  # systemd's socket is gone: every send fails
    n = Notifier.from_environ({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"})
    caplog.set_level(logging.INFO, logger="gpud.notify")
    assert not any(n.watchdog() for _ in range(50))
    assert [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records] == [
        (logging.WARNING, f"sd_notify to {path} failed")
    ]
    caplog.clear()
    with contextlib.closing(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)) as sock:
        sock.bind(path)
        assert n.watchdog() and n.watchdog()
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, f"sd_notify to {path} works again, after 50 failed sends over 0 s")
    ]
    caplog.clear()
    assert not n.watchdog()  # gone again: said once more
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_a_failed_ready_or_stopping_is_warned_whatever_failed_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Watchdog pings failing are said once; READY=1 and STOPPING=1 failing then are said
    each time (systemd, never told, kills gpud at its start or stop timeout), and the send
    that works again says how many failed over how long."""
    path = str(tmp_path / "notify.sock")
    now = [0.0]
    n = Notifier(path, 1_000_000, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="gpud.notify")
    assert not any(n.watchdog() for _ in range(3))
    now[0] = 30.0
    assert not n.ready("serving")
    assert not n.stopping()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        f"sd_notify to {path} failed",
        f"sd_notify READY=1 to {path} failed",
        f"sd_notify STOPPING=1 to {path} failed",
    ]
    caplog.clear()
    with contextlib.closing(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)) as sock:
        sock.bind(path)
        now[0] = 42.0
        assert n.watchdog()
    assert [r.getMessage() for r in caplog.records] == [
        f"sd_notify to {path} works again, after 5 failed sends over 42 s"
    ]


def test_routine_failures_are_warned_once_after_a_failed_ready(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """READY=1 failing first is warned; the watchdog pings failing after it are warned too
    (once, until a send works), not left silent; a failed EXTEND_TIMEOUT_USEC= (systemd
    then kills a start that goes on) is warned each time."""
    path = str(tmp_path / "notify.sock")
    n = Notifier(path, 1_000_000, clock=lambda: 0.0)
    caplog.set_level(logging.INFO, logger="gpud.notify")
    assert not n.ready()
    assert not any(n.watchdog() for _ in range(3))
    assert not n.extend_start(90, "applying MIG")
    assert not n.extend_start(90, "applying MIG")
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        f"sd_notify READY=1 to {path} failed",
        f"sd_notify to {path} failed",
        f"sd_notify EXTEND_TIMEOUT_USEC=90000000 to {path} failed",
        f"sd_notify EXTEND_TIMEOUT_USEC=90000000 to {path} failed",
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
