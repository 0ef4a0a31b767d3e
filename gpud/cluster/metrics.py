"""Cluster metrics, a metric source for :class:`gpud.metrics.Collector`::

gpud_cluster_leader                     1 while this node leads
gpud_cluster_epoch                      the election's current epoch
gpud_cluster_applied_epoch              epoch of the newest order applied here
gpud_cluster_mode{mode}                 1 for the node's mode: leader, follower,
                                        holding (no leader: last order kept), local
gpud_cluster_last_order_age_seconds     since the last order was applied (absent: never)
gpud_cluster_grace_seconds              how long "holding" lasts before "local"
gpud_cluster_rejected_orders_total      orders refused for a stale epoch
gpud_cluster_store_up                   1 if the last etcd call succeeded
gpud_cluster_nodes                      nodes heard from (on the leader)
gpud_cluster_etcd_alarm{alarm}          1 while etcd has raised the alarm (NOSPACE: out of
                                        space, writes refused; CORRUPT); etcd election only,
                                        while the last read of them succeeded
gpud_cluster_certificate_expiry_seconds{key}
                                        seconds until the earliest certificate in the file
                                        named by config key ``key`` expires (negative once
                                        expired); absent while the file cannot be read
gpud_cluster_job_level{job}             the job's global level (this node's jobs)
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpud.cluster.agent import ClusterAgent
from gpud.cluster.etcd import NOSPACE
from gpud.cluster.fencing import Mode

# always exported under etcd once read (0 when not raised), so an alert needs no absent()
# clause; not before: a restarted gpud would say "not raised" of an alarm it has not read
_ALARMS = (NOSPACE, "CORRUPT")


class ClusterMetrics:
    def __init__(self, agent: ClusterAgent) -> None:
        self._agent = agent

    def __call__(self) -> Iterator[Metric]:
        s = self._agent.status()
        yield GaugeMetricFamily(
            "gpud_cluster_leader",
            "1 while this node leads the cluster.",
            value=float(s.info.leading),
        )
        yield GaugeMetricFamily(
            "gpud_cluster_epoch", "The cluster election's current epoch.", value=float(s.info.epoch)
        )
        yield GaugeMetricFamily(
            "gpud_cluster_applied_epoch",
            "Epoch of the newest cluster order applied on this node.",
            value=float(s.applied_epoch),
        )
        mode = GaugeMetricFamily(
            "gpud_cluster_mode", "1 for this node's cluster mode.", labels=("mode",)
        )
        for m in Mode:
            mode.add_metric([m.value], float(m is s.mode))
        yield mode
        if s.last_order_age_s is not None:
            yield GaugeMetricFamily(
                "gpud_cluster_last_order_age_seconds",
                "Seconds since the last cluster order was applied here.",
                value=s.last_order_age_s,
            )
        yield GaugeMetricFamily(
            "gpud_cluster_grace_seconds",
            "Without a leader, seconds the last order holds before the local policy.",
            value=s.grace_s,
        )
        yield CounterMetricFamily(
            "gpud_cluster_rejected_orders",
            "Cluster orders refused for a stale epoch.",
            value=float(s.rejected_orders),
        )
        yield GaugeMetricFamily(
            "gpud_cluster_store_up",
            "1 if the last call to the election store (etcd) succeeded.",
            value=float(s.info.store_ok),
        )
        yield GaugeMetricFamily(
            "gpud_cluster_nodes", "Nodes heard from (on the leader).", value=float(len(s.nodes))
        )
        if s.election == "etcd" and s.etcd_alarms_read:
            alarm = GaugeMetricFamily(
                "gpud_cluster_etcd_alarm",
                "1 while etcd has raised the alarm (NOSPACE: out of space, writes refused).",
                labels=("alarm",),
            )
            for name in sorted({*_ALARMS, *s.etcd_alarms}):
                alarm.add_metric([name], float(name in s.etcd_alarms))
            yield alarm
        expiry = GaugeMetricFamily(
            "gpud_cluster_certificate_expiry_seconds",
            "Seconds until the earliest certificate in the file expires (negative: expired).",
            labels=("key",),
        )
        for c in s.certificates:
            if c.expires_in_s is not None:
                expiry.add_metric([c.key], c.expires_in_s)
        yield expiry
        level = GaugeMetricFamily(
            "gpud_cluster_job_level", "The job's global network level.", labels=("job",)
        )
        for a in s.jobs:
            if a.level is not None:
                level.add_metric([a.job], float(a.level))
        yield level
