"""A real-kernel testbed for gpud's traffic enforcement: see :mod:`tools.testbed.run`."""
