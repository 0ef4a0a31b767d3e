"""systemd readiness and watchdog notifications (``sd_notify(3)``) without libsystemd.

``Type=notify`` units get ``NOTIFY_SOCKET`` in their environment; the daemon sends
``READY=1`` once it serves, ``WATCHDOG=1`` after each healthy loop pass (at least twice per
``WatchdogSec``), ``RELOADING=1``/``READY=1`` around a config reload and ``STOPPING=1`` on
shutdown. ``systemctl status gpud`` shows the ``STATUS=`` line.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


class Notifier:
    """Sends datagrams to ``$NOTIFY_SOCKET``; a no-op when the daemon is not run by systemd."""

    def __init__(self, socket_path: str | None, watchdog_usec: int | None = None) -> None:
        self._address: str | None = None
        if socket_path:
            # A leading "@" names an abstract socket: the kernel wants a NUL byte there.
            self._address = "\0" + socket_path[1:] if socket_path.startswith("@") else socket_path
        self.watchdog_interval_s: float | None = (
            watchdog_usec / 1_000_000 / 2 if watchdog_usec else None
        )

    @classmethod
    def from_environ(cls, environ: dict[str, str] | os._Environ[str]) -> Notifier:
        usec = environ.get("WATCHDOG_USEC", "")
        pid = environ.get("WATCHDOG_PID", "")
        watchdog: int | None = None
        if usec:
            if not usec.isdigit() or (pid and not pid.isdigit()):
                log.warning("ignoring WATCHDOG_USEC=%r WATCHDOG_PID=%r: not numbers", usec, pid)
            elif not pid or int(pid) == os.getpid():
                watchdog = int(usec)
        return cls(environ.get("NOTIFY_SOCKET"), watchdog)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, *assignments: str) -> bool:
        if self._address is None:
            return False
        payload = "\n".join(assignments).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                # Never block the daemon's loop: a receiver that does not read (a full queue)
                # costs a lost notification, not a hung daemon.
                sock.sendto(payload, socket.MSG_DONTWAIT, self._address)
        except OSError as err:
            log.warning("sd_notify to %s failed: %s", self._address, err)
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def reloading(self) -> bool:
        return self.send("RELOADING=1")

    def watchdog(self) -> bool:
        """``WATCHDOG=1``, only when systemd asked for it (``WatchdogSec=``)."""
        if self.watchdog_interval_s is None:
            return False
        return self.send("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")
