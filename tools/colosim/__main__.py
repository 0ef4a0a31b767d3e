"""Entry point: ``python -m tools.colosim``."""

import sys

from tools.colosim.cli import main

sys.exit(main())
