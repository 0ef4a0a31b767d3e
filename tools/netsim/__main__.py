"""Entry point: ``python -m tools.netsim``."""

import sys

from tools.netsim.cli import main

sys.exit(main())
