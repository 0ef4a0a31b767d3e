"""Admission: a queue for jobs that cannot be placed now, with wait-time quotes.

Pure policy (no I/O, no clock of its own; every time is a parameter):

- :mod:`gpud.admission.model`: requests, what they hold, their per-device demand vectors,
  and :class:`~gpud.admission.model.FitCheck`, the one question asked of placement ("where
  would this go now, given these loads?"). :mod:`gpud.admission.placement_fit` answers it
  with :func:`gpud.jobs.placement.choose_devices`; a co-location planner can answer it later.
- :mod:`gpud.admission.feasibility`: quotable vs unfeasible, and which MIG layout would
  make an unfeasible request feasible.
- :mod:`gpud.admission.packing`: the vector-packing reduction to an effective server count
  ``k_eff`` per request class, and the binding resource dimension.
- :mod:`gpud.admission.estimate`: arrival rate and service-time moments from job history.
- :mod:`gpud.admission.quote`: Erlang-C / Allen-Cunneen waits per class (M/G/k).
- :mod:`gpud.admission.queue`: FIFO with backfill that cannot delay the head.

The daemon side (SQLite tables, the gRPC service, metrics) is :mod:`gpud.admission.service`,
:mod:`gpud.admission.api` and :mod:`gpud.admission.metrics`.
"""
