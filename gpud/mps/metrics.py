"""MPS metrics, a metric source for :class:`gpud.metrics.Collector`.

Per control daemon, labels ``gpu`` (NVML index), ``uuid`` (GPU or MIG UUID), ``profile``::

    gpud_mps_daemon_up                           1 when it answered its last health check
    gpud_mps_daemon_enabled                      1 when gpud runs a daemon for the device
    gpud_mps_default_active_thread_ratio         desired default thread cap, 0..1
    gpud_mps_default_pinned_memory_limit_bytes   desired default; absent when unlimited
    gpud_mps_daemon_servers                      MPS servers running
    gpud_mps_daemon_restarts_total               restarts after the daemon died or hung
    gpud_mps_daemon_start_failures_total         starts of the daemon that failed

Read from :meth:`MpsManager.last_status`, so a scrape never waits for a reconcile pass.

A GPU not read since gpud started (lost or hung before it started) has no series here: gpud
runs no daemon for it and cannot tell which it will want (one for the GPU, or one per MIG
device) until the GPU answers. Its own series (``gpud_gpu_healthy`` 0, under the UUID last
seen) and alerts say that it is down.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpud.mps.manager import MpsManager

_LABELS = ("gpu", "uuid", "profile")


class MpsMetrics:
    """``collector.add_source(MpsMetrics(manager))``."""

    def __init__(self, manager: MpsManager) -> None:
        self._manager = manager

    def __call__(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "gpud_mps_daemon_up",
            "MPS control daemon answered its last health check.",
            labels=_LABELS,
        )
        enabled = GaugeMetricFamily(
            "gpud_mps_daemon_enabled",
            "gpud runs an MPS control daemon for the device.",
            labels=_LABELS,
        )
        threads = GaugeMetricFamily(
            "gpud_mps_default_active_thread_ratio",
            "Desired default active thread percentage of the device's MPS clients, as a ratio.",
            labels=_LABELS,
        )
        memory = GaugeMetricFamily(
            "gpud_mps_default_pinned_memory_limit_bytes",
            "Desired default pinned device memory limit of each MPS client.",
            labels=_LABELS,
        )
        servers = GaugeMetricFamily(
            "gpud_mps_daemon_servers", "MPS servers the control daemon runs.", labels=_LABELS
        )
        restarts = CounterMetricFamily(
            "gpud_mps_daemon_restarts",
            "Restarts of the MPS control daemon after it died or stopped answering.",
            labels=_LABELS,
        )
        start_failures = CounterMetricFamily(
            "gpud_mps_daemon_start_failures",
            "Starts of the MPS control daemon that failed (nvidia-cuda-mps-control -d), said or"
            " not as mps.start_failed.",
            labels=_LABELS,
        )
        for s in self._manager.last_status():
            if not s.target.uuid:
                continue  # a GPU never read: no daemon, and none known to be wanted yet
            labels = [str(s.target.gpu), s.target.uuid, s.target.profile]
            up.add_metric(labels, 1.0 if s.up else 0.0)
            enabled.add_metric(labels, 1.0 if s.running else 0.0)
            threads.add_metric(labels, (s.desired.threads_percent or 100) / 100.0)
            if s.desired.memory_bytes is not None:
                memory.add_metric(labels, float(s.desired.memory_bytes))
            servers.add_metric(labels, float(len(s.servers)))
            restarts.add_metric(labels, float(s.restarts))
            start_failures.add_metric(labels, float(s.failed_starts))
        yield from (up, enabled, threads, memory, servers, restarts, start_failures)
