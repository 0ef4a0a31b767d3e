"""Entry point: ``python -m tools.netsim``."""

import sys

from gpud.cli.pipes import quiet_on_broken_pipe
from tools.netsim.cli import main

sys.exit(quiet_on_broken_pipe(main))
