"""MPS: one ``nvidia-cuda-mps-control`` daemon per GPU, or per MIG device when MIG is on.

- :mod:`gpud.mps.protocol`: the control daemon's stdin commands and the grammar of its replies.
- :mod:`gpud.mps.daemon`: one control daemon process (start with ``-d``, query, ``quit``).
- :mod:`gpud.mps.manager`: desired limits (persisted), health checks, restarts, reservations'
  memory accounting.
- :mod:`gpud.mps.metrics`: the Prometheus collector.
"""
