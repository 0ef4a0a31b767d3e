"""gpuctl: the command line for gpud, over its unix socket. See :mod:`gpud.cli.main`."""

from gpud.cli.lazy import GENERATED, defer

# Before any command module names them: generated gRPC code loads when a command runs.
defer(*GENERATED)
