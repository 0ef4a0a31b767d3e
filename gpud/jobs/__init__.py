"""Jobs: the registry (persisted), reservations of GPUs / MIG devices, the environment a
job is launched with, and attribution of GPU processes to jobs.

- :mod:`gpud.jobs.registry`: :class:`JobSpec` and the ``jobs`` table.
- :mod:`gpud.jobs.placement`: reservations and where they go (``job_reservations``).
- :mod:`gpud.jobs.env`: ``CUDA_VISIBLE_DEVICES``, the MPS variables, ``GPUD_JOB``, ...
- :mod:`gpud.jobs.attribution`: NVML's processes -> jobs, via ``/proc/<pid>/environ`` or the
  cgroup.
- :mod:`gpud.jobs.ends`: how a run ended (exit status, or what released it), for the history.
- :mod:`gpud.jobs.service`: the above together, as the API and the daemon's tick use them.
"""
