"""gpuctl: the command line for gpud, over its unix socket. See :mod:`gpud.cli.main`."""

from __future__ import annotations

from collections.abc import Callable

from gpud.cli.lazy import GENERATED, defer

# Before any command module names them: generated gRPC code loads when a command runs.
defer(*GENERATED)

EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command ended by Ctrl-C


def _load() -> Callable[[], int]:
    from gpud.cli.main import main

    return main


def entry(load: Callable[[], Callable[[], int]] = _load) -> int:
    """The ``gpuctl`` console script. Loading gpuctl takes a moment (argparse, the command
    modules; longer on a busy node), and a Ctrl-C then, or in the parsing before a command
    runs, ends it quietly with 130 as it does once a command runs, not with a traceback
    from the middle of an import."""
    try:
        return load()()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
