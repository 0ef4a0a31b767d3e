"""Entry point: ``python -m tools.colosim``."""

import sys

from gpud.cli.pipes import quiet_on_broken_pipe
from tools.colosim.cli import main

sys.exit(quiet_on_broken_pipe(main))
