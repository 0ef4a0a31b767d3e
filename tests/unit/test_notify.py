import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.notify import Notifier


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


def test_watchdog_for_another_pid_is_ignored() -> None:
    n = Notifier.from_environ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert n.watchdog_interval_s is None
