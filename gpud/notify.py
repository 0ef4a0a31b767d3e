"""systemd readiness and watchdog notifications (``sd_notify(3)``) without libsystemd.

``Type=notify`` units get ``NOTIFY_SOCKET`` in their environment; the daemon sends
``READY=1`` once it serves, ``WATCHDOG=1`` after each healthy loop pass (at least twice per
``WatchdogSec``) and between the steps of a long one, ``RELOADING=1``/``READY=1`` around a config reload and ``STOPPING=1`` on
shutdown. ``systemctl status gpud`` shows the ``STATUS=`` line. Start-up work that is still
moving when ``TimeoutStartSec=`` nears (an interrupted MIG apply, resumed before gpud serves)
asks for more time with ``EXTEND_TIMEOUT_USEC``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# While start-up work moves, every START_CHECK_S it is given START_EXTEND_S more (the
# shipped unit's TimeoutStartSec): one slow driver step (a GPU reset) fits in it.
START_CHECK_S = 10.0
START_EXTEND_S = 90.0


# what systemd waits for: a start or stop it is never told of (nor given more time for)
# ends in a kill
_VITAL = frozenset({"READY=1", "STOPPING=1"})
_VITAL_PREFIXES = ("EXTEND_TIMEOUT_USEC=",)


class Notifier:
    """Sends datagrams to ``$NOTIFY_SOCKET``; a no-op when the daemon is not run by systemd."""

    def __init__(
        self,
        socket_path: str | None,
        watchdog_usec: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._address: str | None = None
        self._clock = clock
        if socket_path:
            # A leading "@" names an abstract socket: the kernel wants a NUL byte there.
            self._address = "\0" + socket_path[1:] if socket_path.startswith("@") else socket_path
        # A receiver that stays away (a full queue, a vanished socket) fails every status
        # line and watchdog ping: warned once, until a send works again (then said, with
        # how many failed over how long). A failed READY=1, STOPPING=1 or
        # EXTEND_TIMEOUT_USEC= is warned always: systemd, never told, kills gpud at
        # TimeoutStartSec= / TimeoutStopSec=; it does not count as the routine warning.
        self._failures = 0
        self._routine_warned = False
        self._failing_since = 0.0
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
    def watchdog_s(self) -> float | None:
        """The unit's ``WatchdogSec=`` in seconds (``WATCHDOG_USEC``); None when systemd does
        not watch this process."""
        half = self.watchdog_interval_s
        return 2 * half if half else None

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, *assignments: str) -> bool:
        if self._address is None:
            return False
        payload = "\n".join(assignments).encode()
        vital = next((a for a in assignments if a in _VITAL or a.startswith(_VITAL_PREFIXES)), None)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                # Never block the daemon's loop: a receiver that does not read (a full queue)
                # costs a lost notification, not a hung daemon.
                sock.sendto(payload, socket.MSG_DONTWAIT, self._address)
        except OSError as err:
            if not self._failures:
                self._failing_since = self._clock()
            self._failures += 1
            if vital is not None:
                log.warning("sd_notify %s to %s failed: %s", vital, self._address, err)
            elif not self._routine_warned:
                self._routine_warned = True
                log.warning(
                    "sd_notify to %s failed: %s (not repeated until a send works)",
                    self._address,
                    err,
                )
            return False
        if self._failures:
            log.info(
                "sd_notify to %s works again, after %d failed sends over %.0f s",
                self._address,
                self._failures,
                self._clock() - self._failing_since,
            )
            self._failures, self._routine_warned = 0, False
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

    def extend_start(self, seconds: float, status: str) -> bool:
        """``EXTEND_TIMEOUT_USEC``: ``seconds`` more to start from now, past the unit's
        ``TimeoutStartSec=`` (``systemctl status gpud`` shows ``status``)."""
        return self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}", f"STATUS={status}")


async def while_starting(
    work: Awaitable[T],
    notifier: Notifier,
    *,
    progress: Callable[[], int],
    status: Callable[[int], str],
    every_s: float = START_CHECK_S,
    extend_s: float = START_EXTEND_S,
) -> T:
    """``work``'s result; while it runs, every ``every_s`` in which ``progress()`` moved,
    systemd is given ``extend_s`` more to start (``EXTEND_TIMEOUT_USEC``) and the
    ``status(progress())`` line. Start-up work that goes on (an interrupted MIG apply resumed
    step by step) is not killed by ``TimeoutStartSec=``; work that stops moving (a driver
    call that never returns) gets no more than the last extension."""
    task = asyncio.ensure_future(work)
    seen = progress()
    while True:
        done, _ = await asyncio.wait({task}, timeout=every_s)
        if done:
            return task.result()
        now = progress()
        if now != seen:
            seen = now
            notifier.extend_start(extend_s, status(now))
