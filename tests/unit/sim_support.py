"""What the tests of the simulated node share."""

from __future__ import annotations

from typing import Final

from gpud.mps.procs import PID_MAX

# A PID no host process has (Linux hands out PIDs below PID_MAX): a process declared with it
# runs until stopped, whatever runs on the machine, and a SimNode built again keeps it.
NO_HOST: Final = PID_MAX
