"""gpud: a host-level GPU sharing and traffic daemon."""

__version__ = "0.1.0"


def daemon_entry() -> int:
    """The ``gpud`` console script. Until the daemon's loop takes SIGINT as a stop (as it
    does SIGTERM), a Ctrl-C while gpud loads its modules and opens the GPUs and its state
    ends it at once, as SIGTERM does then, instead of a KeyboardInterrupt traceback from the
    middle of an import. Nothing is half-written by it: the state database commits whole,
    the state files are renamed into place, and the kernel drops the locks."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from gpud.main import main

    return main()
