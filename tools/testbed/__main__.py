"""Entry point: ``python -m tools.testbed run ...``."""

import sys

from tools.testbed.run import main

sys.exit(main())
