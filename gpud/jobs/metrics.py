"""Job metrics, a metric source for :class:`gpud.metrics.Collector`::

    gpud_job_info{job,kind,owner}                     1 per registered job
    gpud_job_slo_p99_latency_seconds{job}             inference SLO, when set
    gpud_job_reservations{job}                        reservations the job holds
    gpud_job_gpu_memory_used_bytes{job,uuid}          GPU memory of the job's processes, per
                                                      GPU / MIG device (from NVML + attribution)
    gpud_job_gpu_processes{job,uuid}                  the job's processes per device
    gpud_device_reserved_memory_bytes{uuid}           MPS memory limits reserved on a device
                                                      (0 on each device with none)
    gpud_device_unattributed_processes{uuid}          processes of no job per device (another
                                                      user's; MPS servers aside): co-location
                                                      plans around them
    gpud_device_unattributed_memory_bytes{uuid}       their GPU memory, where NVML reports it

Attribution is computed on the daemon's tick (:meth:`JobService.tick`), not at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric

from gpud.jobs.service import JobService


class JobMetrics:
    """``collector.add_source(JobMetrics(service))``."""

    def __init__(self, service: JobService) -> None:
        self._service = service

    def __call__(self) -> Iterator[Metric]:
        info = InfoMetricFamily("gpud_job", "A registered job.", labels=("job",))
        slo = GaugeMetricFamily(
            "gpud_job_slo_p99_latency_seconds", "Inference job's p99 latency SLO.", labels=("job",)
        )
        held = GaugeMetricFamily(
            "gpud_job_reservations", "Reservations the job holds.", labels=("job",)
        )
        counts: dict[str, int] = {}
        for r in self._service.reservations.held():
            counts[r.job] = counts.get(r.job, 0) + 1
        for job in self._service.registry.all():
            info.add_metric([job.name], {"kind": job.kind.value, "owner": job.owner})
            if job.slo_p99_ms is not None:
                slo.add_metric([job.name], job.slo_p99_ms / 1000.0)
            held.add_metric([job.name], float(counts.get(job.name, 0)))
        used = GaugeMetricFamily(
            "gpud_job_gpu_memory_used_bytes",
            "GPU memory used by the job's processes on a GPU or MIG device.",
            labels=("job", "uuid"),
        )
        procs = GaugeMetricFamily(
            "gpud_job_gpu_processes",
            "The job's processes on a GPU or MIG device.",
            labels=("job", "uuid"),
        )
        per_device: dict[tuple[str, str], int] = {}
        for u in self._service.process_uses():
            if u.job is not None:
                per_device[(u.job, u.device)] = per_device.get((u.job, u.device), 0) + 1
        strangers: dict[str, int] = {}
        stranger_bytes: dict[str, int] = {}
        for u in self._service.unattributed_uses():
            strangers[u.device] = strangers.get(u.device, 0) + 1
            stranger_bytes[u.device] = stranger_bytes.get(u.device, 0) + (u.used_memory_bytes or 0)
        for (job_name, uuid), count in sorted(per_device.items()):
            procs.add_metric([job_name, uuid], float(count))
        for (job_name, uuid), num_bytes in sorted(self._service.memory_by_job().items()):
            used.add_metric([job_name, uuid], float(num_bytes))
        reserved = GaugeMetricFamily(
            "gpud_device_reserved_memory_bytes",
            "MPS pinned memory limits reserved by jobs on a GPU or MIG device.",
            labels=("uuid",),
        )
        # every device jobs may be placed on, 0 where nothing is reserved: an absent series
        # would read as a device gpud does not know
        loads = self._service.loads()
        known = {t.uuid for t in self._service.targets() if t.uuid}
        for uuid in sorted(known | loads.keys()):
            load = loads.get(uuid)
            reserved.add_metric([uuid], float(load.memory_bytes if load is not None else 0))
        foreign = GaugeMetricFamily(
            "gpud_device_unattributed_processes",
            "Processes NVML lists on a GPU or MIG device that belong to no job (MPS servers aside).",
            labels=("uuid",),
        )
        foreign_bytes = GaugeMetricFamily(
            "gpud_device_unattributed_memory_bytes",
            "GPU memory of the processes on a device that belong to no job.",
            labels=("uuid",),
        )
        for uuid, count in sorted(strangers.items()):
            foreign.add_metric([uuid], float(count))
            foreign_bytes.add_metric([uuid], float(stranger_bytes[uuid]))
        yield from (info, slo, held, used, procs, reserved, foreign, foreign_bytes)
