"""Logging set-up for the gpud and gpuctl applications (libraries only log)."""

from __future__ import annotations

import logging
import sys


def configure(level: str, *, journald: bool) -> None:
    """Plain lines on stderr. Under systemd (``journald``) the journal adds time and PID, so
    lines carry a ``<N>`` syslog priority prefix instead, which journald turns into the
    entry's priority (``SyslogLevelPrefix=yes`` is the default)."""
    handler = logging.StreamHandler(sys.stderr)
    if journald:
        handler.setFormatter(_JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class _JournalFormatter(logging.Formatter):
    _PRIORITY = {
        logging.DEBUG: 7,
        logging.INFO: 6,
        logging.WARNING: 4,
        logging.ERROR: 3,
        logging.CRITICAL: 2,
    }

    def format(self, record: logging.LogRecord) -> str:
        return f"<{self._PRIORITY.get(record.levelno, 6)}>{super().format(record)}"
