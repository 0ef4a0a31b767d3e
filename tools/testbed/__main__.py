"""Entry point: ``python -m tools.testbed run ...``."""

import sys

from gpud.cli.pipes import quiet_on_broken_pipe
from tools.testbed.run import main

sys.exit(quiet_on_broken_pipe(main))
