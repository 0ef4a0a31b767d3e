"""MIG metrics, a metric source for :class:`gpud.metrics.Collector`::

    gpud_mig_instance_info{gpu,gpu_uuid,mig_uuid,profile,gpu_instance_id,
                           compute_instance_id,placement,job}   1 per compute instance
    gpud_mig_instance_memory_limit_bytes{gpu,mig_uuid,profile}   the instance's memory
    gpud_mig_instance_memory_used_bytes{gpu,mig_uuid,profile}
    gpud_mig_instance_processes{gpu,mig_uuid,profile}
    gpud_mig_reset_pending{gpu,gpu_uuid}                      1 while a MIG mode change waits
    gpud_mig_layout_matches{gpu,gpu_uuid}                     managed GPUs: 1 when the last
                                                              reconcile found it as desired
    gpud_mig_apply_unfinished                                 1 while an apply a stop, crash
                                                              or failure left unfinished is
                                                              not resumed (on_start "report")
    gpud_mig_apply_total{result}                              success, noop, reset_pending,
                                                              partial, invalid, busy, failed,
                                                              not_started, resumed
    gpud_mig_apply_duration_seconds                           histogram

A faulty GPU (lost, not answering: ``gpud_gpu_healthy`` 0 says why) has no
``gpud_mig_reset_pending`` and no ``gpud_mig_layout_matches``: its MIG state cannot be read,
so it is unknown, not 0, and not the last value read either (a reset or a reboot may have
changed it meanwhile). Its health alert pages, not ``MigLayoutDiffers`` as well.

A desired record whose GPU is not present (outcome ``missing``: another UUID is known at its
index, read by the manager or by telemetry, or no GPU is there and none was ever known there)
has ``gpud_mig_layout_matches`` 0 under its own UUID and the index it was recorded at. With
no UUID known at that index (the GPU there lost since before gpud started, or gone from the
bus where one was known) its records are left alone as faulty: no series.

Instance data comes from the view the manager refreshes on reconcile after a change and at
least every ``MigManager.VIEW_REFRESH_S`` (the driver is not called at scrape time once the
daemon ticks). Between, a GPU turning faulty drops its series at the next reconcile with no
driver call, and one answering again is read again on its own, at most every
``MigManager.VIEW_REREAD_S``. Live per-device memory is also in the telemetry's
``gpud_mig_device_*``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)

from gpud.metrics import histogram_family
from gpud.mig.manager import MigManager
from gpud.mig.results import RESULTS

_INSTANCE = ("gpu", "mig_uuid", "profile")


class MigMetrics:
    """``collector.add_source(MigMetrics(manager))``."""

    def __init__(self, manager: MigManager) -> None:
        self._manager = manager

    def __call__(self) -> Iterator[Metric]:
        m = self._manager
        info = GaugeMetricFamily(
            "gpud_mig_instance_info",
            "A MIG compute instance, its profile, placement and the jobs on it.",
            labels=(
                "gpu",
                "gpu_uuid",
                "mig_uuid",
                "profile",
                "gpu_instance_id",
                "compute_instance_id",
                "placement",
                "job",
            ),
        )
        limit = GaugeMetricFamily(
            "gpud_mig_instance_memory_limit_bytes", "Memory of the MIG instance.", labels=_INSTANCE
        )
        used = GaugeMetricFamily(
            "gpud_mig_instance_memory_used_bytes",
            "Memory used on the MIG instance.",
            labels=_INSTANCE,
        )
        procs = GaugeMetricFamily(
            "gpud_mig_instance_processes",
            "Compute processes on the MIG instance.",
            labels=_INSTANCE,
        )
        pending = GaugeMetricFamily(
            "gpud_mig_reset_pending",
            "1 while a MIG mode change waits for a GPU reset.",
            labels=("gpu", "gpu_uuid"),
        )
        matches = GaugeMetricFamily(
            "gpud_mig_layout_matches",
            "Managed GPUs: 1 when the last reconcile found the desired layout.",
            labels=("gpu", "gpu_uuid"),
        )
        for gpu in m.latest_view():
            g = str(gpu.identity.index)
            if gpu.mode is not None:
                pending.add_metric((g, gpu.identity.uuid), float(gpu.mode.reset_pending))
            for inst in gpu.instances:
                if inst.uuid is None:
                    continue
                jobs = sorted({p.job for p in inst.processes if p.job})
                info.add_metric(
                    (
                        g,
                        gpu.identity.uuid,
                        inst.uuid,
                        inst.compute_profile or inst.profile,
                        str(inst.gpu_instance_id),
                        str(inst.compute_instance_id),
                        f"{inst.placement_start}:{inst.placement_size}",
                        ",".join(jobs),
                    ),
                    1.0,
                )
                key = (g, inst.uuid, inst.compute_profile or inst.profile)
                if inst.memory_total_bytes is not None:
                    limit.add_metric(key, float(inst.memory_total_bytes))
                if inst.memory_used_bytes is not None:
                    used.add_metric(key, float(inst.memory_used_bytes))
                if not inst.processes_error:  # absent, not 0, when they could not be listed
                    procs.add_metric(key, float(len(inst.processes)))
        for o in m.last_outcomes():
            if o.status != "faulty":  # not read: unknown, absent (see the module docstring)
                matches.add_metric((str(o.gpu), o.uuid), float(o.status in ("ok", "changed")))
        yield from (info, limit, used, procs, pending, matches)
        unfinished = GaugeMetricFamily(
            "gpud_mig_apply_unfinished",
            '1 while an apply is left unfinished, not resumed (mig.on_start = "report").',
        )
        unfinished.add_metric((), float(m.unfinished() is not None))
        yield unfinished

        totals, durations = m.stats.snapshot()
        applies = CounterMetricFamily(
            "gpud_mig_apply", "MIG layout applies, by result.", labels=("result",)
        )
        for result in RESULTS:
            applies.add_metric((result,), float(totals.get(result, 0)))
        yield applies
        yield histogram_family(
            "gpud_mig_apply_duration_seconds",
            "Time a MIG layout apply took, checks included.",
            durations,
            lambda bound: repr(float(bound)),
        )
