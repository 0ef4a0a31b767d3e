"""MIG partitions: declarative layouts in mig-parted's format, validated, planned and applied.

- :mod:`gpud.mig.layout`: read and write ``nvidia-mig-parted`` config files.
- :mod:`gpud.mig.validate`: check a layout against the device's own profile and placement
  table (``nvidia-smi mig -lgip`` / ``-lgipp``) and find placements for it.
- :mod:`gpud.mig.plan`: pure planner, actual instances -> desired -> ordered driver steps.
- :mod:`gpud.mig.manager`: :class:`~gpud.mig.manager.MigManager`, the one object the daemon
  holds: apply with busy checks (drain / force), reconcile at start and on each tick, show,
  export.
- :mod:`gpud.mig.view`: what ``gpuctl mig show`` prints, read from the driver.
- :mod:`gpud.mig.results`: per-GPU outcomes, apply results and their counters.
- :mod:`gpud.mig.api`: the ``gpud.v1.Mig`` gRPC servicer.
- :mod:`gpud.mig.store`: desired layouts and the in-flight plan in the state database.
- :mod:`gpud.mig.metrics`: the scrape-time metric source.
"""

# The longest drain a request may ask for: one day. The daemon refuses more; gpuctl says so
# before asking.
MAX_DRAIN_SECONDS = 24 * 3600.0
