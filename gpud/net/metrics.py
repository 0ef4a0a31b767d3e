"""Traffic metrics, a metric source for :class:`gpud.metrics.Collector`::

    gpud_net_job_dscp{job}                          the job's tag
    gpud_net_job_level{job}                         its level (0 highest); absent: default class
    gpud_net_job_progress_rate_ratio{job}           contention-free / observed iteration time
                                                    (jobs in use without a tag too: the one
                                                    label is the job's name)
    gpud_net_job_sent_bytes_total{job}              through gpud's classes on every interface
                                                    since gpud started, while the job held
                                                    them (not what a class carried before)
    gpud_net_job_sent_packets_total{job}
    gpud_net_job_dropped_packets_total{job}
    gpud_net_level_jobs{level}                      jobs at the level
    gpud_net_level_min_share_ratio{level}           guaranteed fraction of every link
    gpud_net_level_sent_bytes_total{level}          (and _sent_packets_total, _dropped_packets_total)
                                                    since gpud started, each read counted at
                                                    the level its job had while sending: a
                                                    job moving off the level or going takes
                                                    nothing away (never the sum of the jobs
                                                    at the level now)
    gpud_net_level_changes_total                    jobs moved between levels since start
    gpud_net_interface_enforced{interface}          1 when the plan is in the kernel
    gpud_net_interface_rate_bits_per_second{interface}
    gpud_net_interface_repairs_total{interface}     drift restored
    gpud_net_rdma_map_repairs_total                 NIC map drift written back
    gpud_net_untagged_jobs                          jobs in use left without a tag: the DSCP
                                                    pool is in use (alert TrafficJobsUntagged)
    gpud_net_idle_untagged_jobs                     idle jobs holding no tag (they take one
                                                    when they run; no fault)
    gpud_net_marking_ok                             gpud's nftables table is in force
                                                    (absent: traffic.marking = false)
    gpud_net_marking_restores_total                 gpud's table written again after it
                                                    was removed outside gpud
    gpud_net_rdma_map_ok                            the NIC DSCP -> priority map is written on
                                                    every netdev (absent: rdma_backend none)
    gpud_net_cluster_epoch                          epoch of the cluster order (0: local policy)
    gpud_net_progress_reports_total{result}         accepted / rejected

Counters are read from HTB's class statistics on the daemon's tick, not at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpud.net.port import TrafficCounters
from gpud.net.service import TrafficService


class TrafficMetrics:
    """``collector.add_source(TrafficMetrics(service))``."""

    def __init__(self, service: TrafficService) -> None:
        self._service = service

    def __call__(self) -> Iterator[Metric]:
        view = self._service.view()
        if not view.enabled:
            return
        dscp = GaugeMetricFamily("gpud_net_job_dscp", "The job's DSCP tag.", labels=("job",))
        level = GaugeMetricFamily(
            "gpud_net_job_level", "The job's network priority level (0 highest).", labels=("job",)
        )
        rate = GaugeMetricFamily(
            "gpud_net_job_progress_rate_ratio",
            "Contention-free over observed iteration time.",
            labels=("job",),
        )
        job_c = _counter_families("gpud_net_job", "job")
        for j in view.jobs:
            dscp.add_metric([j.job], float(j.dscp))
            if j.level is not None:
                level.add_metric([j.job], float(j.level))
            if j.rate is not None:
                rate.add_metric([j.job], j.rate)
            _add(job_c, j.job, j.counters)
        for j in view.untagged_jobs:  # no tag, level or counters of their own
            if j.rate is not None:
                rate.add_metric([j.job], j.rate)
        jobs_at = GaugeMetricFamily("gpud_net_level_jobs", "Jobs at the level.", labels=("level",))
        share = GaugeMetricFamily(
            "gpud_net_level_min_share_ratio",
            "Guaranteed fraction of every link for the level.",
            labels=("level",),
        )
        level_c = _counter_families("gpud_net_level", "level")
        for lv, s in enumerate(view.shares):
            name = str(lv)
            jobs_at.add_metric([name], float(sum(1 for j in view.jobs if j.level == lv)))
            share.add_metric([name], s)
            _add(level_c, name, view.level_counters.get(lv, TrafficCounters()))
        changes = CounterMetricFamily(
            "gpud_net_level_changes", "Jobs moved between levels since start."
        )
        changes.add_metric([], float(view.level_changes_total))
        enforced = GaugeMetricFamily(
            "gpud_net_interface_enforced",
            "1 when gpud's plan is in the interface's qdisc.",
            labels=("interface",),
        )
        link = GaugeMetricFamily(
            "gpud_net_interface_rate_bits_per_second",
            "Link rate gpud shapes the interface to.",
            labels=("interface",),
        )
        repairs = CounterMetricFamily(
            "gpud_net_interface_repairs",
            "Times gpud restored tc state changed outside it.",
            labels=("interface",),
        )
        for i in view.interfaces:
            enforced.add_metric([i.name], 1.0 if i.enforced else 0.0)
            link.add_metric([i.name], float(i.rate_bps))
            repairs.add_metric([i.name], float(i.repairs))
        untagged = GaugeMetricFamily(
            "gpud_net_untagged_jobs",
            "Registered jobs with no DSCP tag: traffic.dscp_pool is held by jobs in use.",
        )
        untagged.add_metric([], float(len(view.untagged)))
        # a gauge of its own, not a label on the one above: gpud_net_untagged_jobs > 0 (and
        # any rule built on it) keeps meaning jobs in use without a tag, a pool too small,
        # while idle jobs without one are normal on a node that has seen many jobs
        idle_untagged = GaugeMetricFamily(
            "gpud_net_idle_untagged_jobs",
            "Registered jobs not in use that hold no DSCP tag (each takes one when it runs).",
        )
        idle_untagged.add_metric([], float(view.idle_untagged))
        marking = GaugeMetricFamily(
            "gpud_net_marking_ok", "1 when gpud's nftables marking table is in force."
        )
        # marking turned off is a setting, not a fault: no sample, so no alert fires on it
        # a firewall flushing the ruleset on every tick is said once a minute (net.marking),
        # every restore counted here
        restores = CounterMetricFamily(
            "gpud_net_marking_restores",
            "Times gpud's nftables table was found removed outside gpud (nft flush ruleset)"
            " and written again.",
        )
        if self._service.config.marking:
            marking.add_metric([], 0.0 if view.marking_error else 1.0)
            restores.add_metric([], float(view.marking_restores))
        # a dcb that fails for one NIC leaves that NIC's RDMA traffic at its old priorities
        # while tc holds on every interface: only this gauge and `gpuctl net show` say so
        rdma = GaugeMetricFamily(
            "gpud_net_rdma_map_ok",
            "1 when the NIC DSCP -> priority map (traffic.rdma_backend) is written on every"
            " netdev; 0 while one is not (gpuctl net show names it).",
        )
        # an agent rewriting the map before every write is said twice (net.rdma_drift),
        # then only counted here
        rdma_repairs = CounterMetricFamily(
            "gpud_net_rdma_map_repairs",
            "Writes of the NIC DSCP -> priority map that found an entry changed outside gpud"
            " and wrote it back.",
        )
        if view.rdma_backend != "none":
            rdma.add_metric([], 0.0 if view.rdma_error else 1.0)
            rdma_repairs.add_metric([], float(view.rdma_repairs))
        epoch = GaugeMetricFamily(
            "gpud_net_cluster_epoch", "Epoch of the cluster order in force (0: local policy)."
        )
        epoch.add_metric([], float(view.epoch))
        reports = CounterMetricFamily(
            "gpud_net_progress_reports", "Progress reports received.", labels=("result",)
        )
        reports.add_metric(["accepted"], float(self._service.accepted_reports))
        reports.add_metric(["rejected"], float(self._service.rejected_reports))
        yield from (dscp, level, rate, *job_c, jobs_at, share, *level_c, changes)
        yield from (enforced, link, repairs, untagged, idle_untagged, marking, restores)
        yield from (rdma, rdma_repairs)
        yield epoch
        yield reports


def _counter_families(prefix: str, label: str) -> tuple[CounterMetricFamily, ...]:
    return (
        CounterMetricFamily(
            f"{prefix}_sent_bytes", "Bytes sent through gpud's classes.", labels=(label,)
        ),
        CounterMetricFamily(
            f"{prefix}_sent_packets", "Packets sent through gpud's classes.", labels=(label,)
        ),
        CounterMetricFamily(f"{prefix}_dropped_packets", "Packets HTB dropped.", labels=(label,)),
    )


def _add(families: tuple[CounterMetricFamily, ...], key: str, c: TrafficCounters) -> None:
    for family, value in zip(families, (c.bytes, c.packets, c.drops), strict=True):
        family.add_metric([key], float(value))
