"""Signals the test run hands down to the gpuctl and gpud it starts.

A run started as a shell script's background job, or under ``nohup``, inherits SIGINT and
SIGQUIT (or SIGHUP) ignored, and ignored signals stay ignored across ``exec``; ``gpuctl run``
keeps a signal ignored at its start ignored for itself and its command (as ``nohup gpuctl
run ... &`` asks). The tests that send Ctrl-C, Ctrl-\\ or a hang-up to a gpuctl model one
started from an interactive shell, so the run takes these signals over here: a handler of
this process's own is reset to the default in every child at its ``exec``.
"""

from __future__ import annotations

import signal


def _hand_down_default(signum: signal.Signals, handler: signal.Handlers | object) -> None:
    if signal.getsignal(signum) is signal.SIG_IGN:
        signal.signal(signum, handler)  # type: ignore[arg-type]


_hand_down_default(signal.SIGINT, signal.default_int_handler)
# SIGQUIT and SIGHUP stay without effect on the test run itself, as they were
_hand_down_default(signal.SIGQUIT, lambda signum, frame: None)
_hand_down_default(signal.SIGHUP, lambda signum, frame: None)
