"""gpud: a host-level GPU sharing and traffic daemon."""

__version__ = "0.1.0"
