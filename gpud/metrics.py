"""Prometheus exposition: one scrape-time collector over the latest telemetry snapshot.

Nothing is kept in prometheus_client's own metric objects: at each scrape :class:`Collector`
turns the sampler's latest :class:`Snapshot`, the event log's counts and any extra
*metric sources* into metric families. So a scrape always shows one consistent tick, and a
reading that is ``None`` (not supported, or the GPU is unhealthy) is simply absent.

What Prometheus sees (``curl -s localhost:9400/metrics | grep ^gpud_``):

- per GPU, labels ``gpu`` (NVML index), ``uuid``, ``model`` (NVML's name; of a GPU not
  read since gpud started, lost or hung, as an earlier run last read them, so its series
  go on across the restart; empty when no run ever read it):
  ``gpud_gpu_info`` (+ ``product``, ``pci_bus_id``: of a GPU not read since gpud started, as
  an earlier run last read them; empty where not known, ``product`` also where that run did
  not keep it),
  ``gpud_gpu_healthy``,
  ``gpud_gpu_unhealthy_info`` (+ ``reason``; only while unhealthy),
  ``gpud_gpu_sample_age_seconds``, ``gpud_gpu_memory_{total,used,free}_bytes`` (``total``
  also of a GPU lost or hung since it was read in this run: the size read with its identity;
  ``used`` and ``free`` only from the latest tick's reading),
  ``gpud_gpu_utilization_ratio``, ``gpud_gpu_memory_utilization_ratio``,
  ``gpud_gpu_power_watts``, ``gpud_gpu_temperature_celsius``,
  ``gpud_gpu_{sm,memory}_clock_hertz``, ``gpud_gpu_ecc_errors_total{type}``,
  ``gpud_gpu_pcie_throughput_bytes_per_second{direction}``,
  ``gpud_gpu_nvlink_bytes_total{direction}`` (the sum over every NVLink link of the GPU:
  NVML keeps one counter per link, ``scopeId`` = link index), ``gpud_gpu_processes`` (absent
  when the driver does not list them),
  ``gpud_gpu_mig_mode_enabled``, ``gpud_gpu_mig_mode_pending``,
  ``gpud_gpu_xid_errors_total`` (absent where the driver gives no XID events for the
  GPU), ``gpud_gpu_last_xid`` (the latest XID of any kind: history,
  not state), ``gpud_gpu_critical_xid_uncleared{xid}`` (one series per critical XID code the
  GPU raised and nobody cleared or reset since, the value how often; gone once cleared: what
  the critical-XID alert reads; ``uuid`` is the GPU's when the XID was raised if it cannot be
  read now);
- per MIG device, labels ``gpu``, ``gpu_uuid``, ``mig_uuid``, ``profile``,
  ``gpu_instance_id``, ``compute_instance_id`` (as in ``nvidia-smi mig -lgi`` / ``-lci``):
  ``gpud_mig_device_memory_{total,used,free}_bytes``, ``gpud_mig_device_processes``;
- the node: ``gpud_sample_age_seconds``, ``gpud_sample_duration_seconds``, ``gpud_gpus``,
  ``gpud_driver_info{version}``, ``gpud_events_total{kind}``,
  ``gpud_event_log_write_errors_total``, ``gpud_build_info{version, build}``,
  ``gpud_metric_source_errors_total{source}``, and from :mod:`gpud.loopstats`
  ``gpud_loop_duration_seconds`` (a histogram of the daemon loop's passes) and
  ``gpud_loop_overruns_total`` (passes longer than the tick);
- the daemon's own process: ``process_*`` and ``python_*`` (prometheus_client's collectors).

Typical wiring (the daemon's composition root)::

    registry = build_registry(Collector(sampler.latest, events=event_log))
    server, thread = gpud.metrics_http.start_metrics_server(registry, "0.0.0.0", 9400)
    ...
    gpud.metrics_http.stop_metrics_server(server, thread)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector as _CollectorBase

import gpud
import gpud.build
from gpud.events import EventLog
from gpud.histogram import HistogramCounts
from gpud.telemetry.snapshot import Snapshot

log = logging.getLogger(__name__)

MetricSource = Callable[[], Iterable[Metric]]
"""A feature's own metrics (MIG layouts, MPS, jobs, network), called at every scrape."""


def histogram_family(
    name: str, doc: str, counts: HistogramCounts, bound_text: Callable[[float], str]
) -> HistogramMetricFamily:
    """``name`` as a Prometheus histogram of ``counts`` (``le`` written by ``bound_text``)."""
    buckets = [
        (bound_text(b), float(c)) for b, c in zip(counts.bounds, counts.buckets, strict=True)
    ]
    buckets.append(("+Inf", float(counts.count)))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=counts.sum)


_GPU_LABELS = ("gpu", "uuid", "model")
_MIG_LABELS = (
    "gpu",
    "gpu_uuid",
    "mig_uuid",
    "profile",
    "gpu_instance_id",
    "compute_instance_id",
)
_MHZ = 1_000_000.0


class Collector(_CollectorBase):
    """Scrape-time collector over ``snapshot()`` (e.g. ``Sampler.latest``).

    ``clock`` is the monotonic clock the snapshots were stamped with (for the age metrics).
    A metric source that raises is logged and counted in
    ``gpud_metric_source_errors_total{source}``; the rest of the scrape still succeeds.
    """

    def __init__(
        self,
        snapshot: Callable[[], Snapshot | None],
        *,
        events: EventLog | None = None,
        sources: Sequence[MetricSource] = (),
        clock: Callable[[], float] = time.monotonic,
        version: str = gpud.__version__,
        build: str | None = None,
    ) -> None:
        """``version`` and ``build`` (default :func:`gpud.build.current`, computed now)
        label ``gpud_build_info``."""
        self._snapshot = snapshot
        self._events = events
        self._sources: list[MetricSource] = list(sources)
        self._clock = clock
        self._version = version
        self._build = gpud.build.current() if build is None else build
        self._source_errors: dict[str, int] = {}
        self._lock = threading.Lock()

    def add_source(self, source: MetricSource) -> None:
        """Add a feature's metric source; it is called at every scrape from then on."""
        with self._lock:
            self._sources.append(source)

    def describe(self) -> Iterable[Metric]:
        # Nothing to check at registration: names are fixed here and in the sources.
        return ()

    def collect(self) -> Iterator[Metric]:
        build = InfoMetricFamily(
            "gpud_build", "gpud's version and build (a digest of the code it runs)."
        )
        build.add_metric([], {"version": self._version, "build": self._build})
        yield build
        snap = self._snapshot()
        if snap is not None:
            yield from self._snapshot_metrics(snap)
        if self._events is not None:
            events = CounterMetricFamily(
                "gpud_events", "Events written to the event log, by kind.", labels=("kind",)
            )
            counts, write_errors = self._events.tallies()
            for kind, count in sorted(counts.items()):
                events.add_metric((kind,), count)
            yield events
            yield CounterMetricFamily(
                "gpud_event_log_write_errors",
                "Events whose line could not be written to the event log file (disk full, "
                "read-only): the journal still has them, and gpuctl events until gpud "
                "restarts.",
                value=write_errors,
            )
        with self._lock:
            sources = tuple(self._sources)
        for source in sources:
            try:
                yield from list(source())
            except Exception:
                name = getattr(source, "__qualname__", None) or type(source).__name__
                log.exception("metric source %s failed", name)
                with self._lock:
                    self._source_errors[name] = self._source_errors.get(name, 0) + 1
        errors = CounterMetricFamily(
            "gpud_metric_source_errors",
            "Scrapes in which a metric source raised, by source.",
            labels=("source",),
        )
        with self._lock:
            for name, count in sorted(self._source_errors.items()):
                errors.add_metric((name,), count)
        yield errors

    def _snapshot_metrics(self, snap: Snapshot) -> Iterator[Metric]:
        now = self._clock()
        g = GaugeMetricFamily
        info = InfoMetricFamily("gpud_gpu", "GPU identity as NVML reports it.", labels=_GPU_LABELS)
        healthy = g(
            "gpud_gpu_healthy",
            "1 if the last sample of the GPU succeeded, 0 if a driver call failed or hung.",
            labels=_GPU_LABELS,
        )
        unhealthy = InfoMetricFamily(
            "gpud_gpu_unhealthy",
            "Why a GPU is unhealthy; present only while it is.",
            labels=_GPU_LABELS,
        )
        age = g(
            "gpud_gpu_sample_age_seconds",
            "Seconds since the GPU's last successful sample.",
            labels=_GPU_LABELS,
        )
        mem_total = g(
            "gpud_gpu_memory_total_bytes", "Total framebuffer memory.", labels=_GPU_LABELS
        )
        mem_used = g(
            "gpud_gpu_memory_used_bytes",
            "Used framebuffer memory, the driver's reserved memory included (total - free).",
            labels=_GPU_LABELS,
        )
        mem_free = g("gpud_gpu_memory_free_bytes", "Free framebuffer memory.", labels=_GPU_LABELS)
        util = g(
            "gpud_gpu_utilization_ratio",
            "Fraction of the last sample period a kernel was running (not on MIG GPUs).",
            labels=_GPU_LABELS,
        )
        mem_util = g(
            "gpud_gpu_memory_utilization_ratio",
            "Fraction of the last sample period device memory was read or written.",
            labels=_GPU_LABELS,
        )
        power = g("gpud_gpu_power_watts", "Power draw.", labels=_GPU_LABELS)
        temp = g("gpud_gpu_temperature_celsius", "GPU core temperature.", labels=_GPU_LABELS)
        sm_clock = g("gpud_gpu_sm_clock_hertz", "Current SM clock.", labels=_GPU_LABELS)
        mem_clock = g("gpud_gpu_memory_clock_hertz", "Current memory clock.", labels=_GPU_LABELS)
        ecc = CounterMetricFamily(
            "gpud_gpu_ecc_errors",
            "Volatile ECC errors since the driver loaded, by type.",
            labels=(*_GPU_LABELS, "type"),
        )
        pcie = g(
            "gpud_gpu_pcie_throughput_bytes_per_second",
            "PCIe throughput over the driver's last 20 ms window, by direction.",
            labels=(*_GPU_LABELS, "direction"),
        )
        nvlink = CounterMetricFamily(
            "gpud_gpu_nvlink_bytes",
            "Bytes sent and received over NVLink, summed over every link of the GPU, by direction.",
            labels=(*_GPU_LABELS, "direction"),
        )
        procs = g("gpud_gpu_processes", "Compute processes on the GPU.", labels=_GPU_LABELS)
        mig_enabled = g(
            "gpud_gpu_mig_mode_enabled", "1 if MIG mode is currently on.", labels=_GPU_LABELS
        )
        mig_pending = g(
            "gpud_gpu_mig_mode_pending",
            "1 if a MIG mode change waits for a GPU reset.",
            labels=_GPU_LABELS,
        )
        xid = CounterMetricFamily(
            "gpud_gpu_xid_errors", "XID errors seen since gpud started.", labels=_GPU_LABELS
        )
        last_xid = g(
            "gpud_gpu_last_xid",
            "Code of the last XID error seen, of any kind, cleared or not.",
            labels=_GPU_LABELS,
        )
        critical_xid = g(
            "gpud_gpu_critical_xid_uncleared",
            "Times the GPU raised this critical XID since its last reset or the XID's clear"
            " (gpuctl xid clear); present only while uncleared.",
            labels=(*_GPU_LABELS, "xid"),
        )
        mig_total = g(
            "gpud_mig_device_memory_total_bytes", "MIG device memory.", labels=_MIG_LABELS
        )
        mig_used = g(
            "gpud_mig_device_memory_used_bytes", "Used MIG device memory.", labels=_MIG_LABELS
        )
        mig_free = g(
            "gpud_mig_device_memory_free_bytes", "Free MIG device memory.", labels=_MIG_LABELS
        )
        mig_procs = g(
            "gpud_mig_device_processes", "Compute processes on the MIG device.", labels=_MIG_LABELS
        )

        for s in snap.gpus:
            ident = s.identity
            index = str(ident.index)
            # a GPU not read since gpud started keeps the labels it last had: same series
            known = s.known()
            labels = (index, known.uuid, known.name)
            info.add_metric(labels, {"product": known.product, "pci_bus_id": known.pci_bus_id})
            healthy.add_metric(labels, 1.0 if s.healthy else 0.0)
            if not s.healthy:
                unhealthy.add_metric(labels, {"reason": s.reason})
            age.add_metric(labels, max(0.0, now - s.sampled_at))
            if s.xids_watched or s.xid_events_total:
                xid.add_metric(labels, s.xid_events_total)
            if s.last_xid is not None:
                last_xid.add_metric(labels, s.last_xid)
            for c in s.critical_xids:
                # a GPU not read since gpud started: the UUID and model it had when it raised
                # the XID, the series it had then, even with a state database that never saw
                # it (an xid_state an older gpud wrote has no model: the last seen one's, if
                # that is the same board)
                model = c.model or (known.name if known.uuid == c.uuid else "")
                where = labels if ident.uuid or not c.uuid else (index, c.uuid, model)
                critical_xid.add_metric((*where, str(c.xid)), c.count)
            if s.memory is not None:
                mem_total.add_metric(labels, s.memory.total_bytes)
                mem_used.add_metric(labels, s.memory.used_bytes)
                mem_free.add_metric(labels, s.memory.free_bytes)
            elif ident.read:
                # the board's size is a static fact (nvidia-smi -q "FB Memory Usage: Total"),
                # known from its identity read: kept while the tick's reading is missing (lost,
                # hung, the query failed), as gpuctl gpus keeps it; absent only when never read
                mem_total.add_metric(labels, ident.memory_total_bytes)
            if s.utilization is not None:
                util.add_metric(labels, s.utilization.gpu_ratio)
                mem_util.add_metric(labels, s.utilization.memory_ratio)
            if s.power_watts is not None:
                power.add_metric(labels, s.power_watts)
            if s.temperature_celsius is not None:
                temp.add_metric(labels, s.temperature_celsius)
            if s.clocks is not None:
                sm_clock.add_metric(labels, s.clocks.sm_mhz * _MHZ)
                mem_clock.add_metric(labels, s.clocks.memory_mhz * _MHZ)
            if s.ecc is not None:
                ecc.add_metric((*labels, "corrected"), s.ecc.corrected)
                ecc.add_metric((*labels, "uncorrected"), s.ecc.uncorrected)
            if s.pcie is not None:
                pcie.add_metric((*labels, "tx"), s.pcie.tx_bytes_per_second)
                pcie.add_metric((*labels, "rx"), s.pcie.rx_bytes_per_second)
            if s.nvlink_bytes is not None:
                nvlink.add_metric((*labels, "tx"), s.nvlink_bytes[0])
                nvlink.add_metric((*labels, "rx"), s.nvlink_bytes[1])
            # none listed is 0 only when the driver listed them (not NotSupported or failed)
            if s.processes or s.processes_read:
                procs.add_metric(labels, len(s.processes))
            if s.mig_mode is not None:
                mig_enabled.add_metric(labels, 1.0 if s.mig_mode.current else 0.0)
                mig_pending.add_metric(labels, 1.0 if s.mig_mode.reset_pending else 0.0)
            for m in s.mig_devices:
                mi = m.identity
                mlabels = (
                    index,
                    ident.uuid,
                    mi.uuid,
                    mi.profile_name,
                    str(mi.gpu_instance_id),
                    str(mi.compute_instance_id),
                )
                mig_total.add_metric(mlabels, mi.memory_total_bytes)
                if m.memory is not None:
                    mig_used.add_metric(mlabels, m.memory.used_bytes)
                    mig_free.add_metric(mlabels, m.memory.free_bytes)
                if m.processes_read:  # as for the GPU: absent, not 0, when not listed
                    mig_procs.add_metric(mlabels, len(m.processes))

        node_age = g(
            "gpud_sample_age_seconds", "Seconds since the start of the latest sampling tick."
        )
        node_age.add_metric([], max(0.0, now - snap.monotonic))
        duration = g("gpud_sample_duration_seconds", "Wall time the latest sampling tick took.")
        duration.add_metric([], snap.tick_seconds)
        gpus = g("gpud_gpus", "GPUs on the node, healthy or not.")
        gpus.add_metric([], len(snap.gpus))
        yield from (node_age, duration, gpus)
        if snap.driver_version is not None:
            driver = InfoMetricFamily("gpud_driver", "NVIDIA driver version.")
            driver.add_metric([], {"version": snap.driver_version})
            yield driver
        yield from (
            info,
            healthy,
            unhealthy,
            age,
            mem_total,
            mem_used,
            mem_free,
            util,
            mem_util,
            power,
            temp,
            sm_clock,
            mem_clock,
            ecc,
            pcie,
            nvlink,
            procs,
            mig_enabled,
            mig_pending,
            xid,
            last_xid,
            critical_xid,
            mig_total,
            mig_used,
            mig_free,
            mig_procs,
        )


def build_registry(
    collector: Collector,
    *,
    process: bool = True,
    proc_root: str = "/proc",
) -> CollectorRegistry:
    """A fresh registry with ``collector`` and the daemon's own process and Python metrics.

    ``proc_root`` is where ``ProcessCollector`` reads ``/proc/self`` (tests may pass a tree).
    """
    # the collector's families vary with the node, so it names none at registration:
    # prometheus_client then leaves it out of a ``?name[]=`` scrape unless told to keep it
    registry = CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
    registry.register(collector)
    if process:
        ProcessCollector(registry=registry, proc=proc_root)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    return registry
