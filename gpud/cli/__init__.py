"""gpuctl: the command line for gpud, over its unix socket. See :mod:`gpud.cli.main`."""
