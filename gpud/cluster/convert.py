"""Cluster values <-> ``gpud.v1.cluster`` messages, with the bounds every request is held to."""

from __future__ import annotations

import math

from gpud.api.validate import non_empty, optional
from gpud.cluster.model import (
    MAX_FAULTS_LEFT_OUT,
    JobAttributes,
    JobReport,
    LeftOutJob,
    NodeReport,
    Order,
)
from gpud.errors import InvalidArgument
from gpud.jobs.registry import check_name
from gpud.shared import CLUSTER_MAX_JOBS, CLUSTER_MAX_XIDS, shown
from gpud.v1 import cluster_pb2 as pb
from netshaper.leveller import MAX_LEVELS

MAX_JOBS = CLUSTER_MAX_JOBS  # per node report or request
MAX_GPUS = 64  # per job and node
MAX_XIDS = CLUSTER_MAX_XIDS  # critical XIDs per job and node: a few codes on each of its devices
MAX_NAME = 256
# uint64, the counters' wire type: a job's counters are the sum over its nodes, which a
# node's counter near it (a peer that sends 2**64 - 1) carries past it
_MAX_COUNTER = 2**64 - 1


def _bounded(values: object, limit: int, *, field: str) -> None:
    if len(values) > limit:  # type: ignore[arg-type]
        raise InvalidArgument(f"at most {limit} entries, got {len(values)}", field=field)  # type: ignore[arg-type]


def _token(value: str, *, field: str) -> str:
    """A GPU UUID, a ``uuid:code`` pair, an instance or a build as gpud writes them: printable
    ASCII without spaces. The leader hands them on to every node (in ``node/uuid`` form) and
    to ``gpuctl cluster status``: a line break or an escape sequence there would forge a line
    of their output or reach an operator's terminal."""
    if len(value) > MAX_NAME:
        raise InvalidArgument(f"longer than {MAX_NAME} characters", field=field)
    if not (value.isascii() and value.isprintable()) or " " in value:
        raise InvalidArgument(
            f"{shown(value, MAX_NAME)}: printable ASCII without spaces only", field=field
        )
    return value


def _level(value: int | None, *, field: str) -> int | None:
    if value is not None and value >= MAX_LEVELS:
        raise InvalidArgument(f"level must be in [0, {MAX_LEVELS}), got {value}", field=field)
    return value


def _rate(value: float | None, *, field: str) -> float | None:
    if value is not None and (not math.isfinite(value) or value < 0):
        raise InvalidArgument(f"must be a finite number >= 0, got {value}", field=field)
    return value


def job_report_to_pb(r: JobReport) -> pb.JobReport:
    msg = pb.JobReport(
        job=r.job,
        gpus=r.gpus,
        unhealthy_gpus=r.unhealthy_gpus,
        xids=r.xids,
        tx_bytes=r.tx_bytes,
        drops=r.drops,
        critical_xids=r.critical_xids,
        unranked=r.unranked,
        faults_left_out=r.faults_left_out,
    )
    if r.progress_rate is not None:
        msg.progress_rate = r.progress_rate
    if r.iterations_per_s is not None:
        msg.iterations_per_s = r.iterations_per_s
    if r.dscp is not None:
        msg.dscp = r.dscp
    if r.link_up is not None:
        msg.link_up = r.link_up
    if r.pinned_level is not None:
        msg.pinned_level = r.pinned_level
    if r.applied_level is not None:
        msg.applied_level = r.applied_level
    return msg


def report_to_pb(report: NodeReport) -> pb.ReportRequest:
    return pb.ReportRequest(
        node=report.node,
        jobs=[job_report_to_pb(j) for j in report.jobs],
        applied_epoch=report.applied_epoch,
        instance=report.instance,
        build=report.build,
    )


def report_from_pb(
    msg: pb.ReportRequest, *, left_out: list[LeftOutJob] | None = None
) -> NodeReport:
    """A checked report: job names as the registry takes them, each once; GPU UUIDs and
    XID pairs printable; levels within ``MAX_LEVELS``; rates finite; at most ``MAX_JOBS``
    jobs. With ``left_out``, a job whose name the registry refuses is left out of the
    report and added there (the leader takes the rest: a gpud before 2026-12-06 took a
    name ending in a line break, and an upgraded leader meets it from an older node);
    without, it refuses the whole report."""
    node = non_empty(msg.node, field="node", max_len=MAX_NAME)
    _bounded(msg.jobs, MAX_JOBS, field="jobs")
    jobs = []
    first: dict[str, int] = {}  # job -> the index it was first reported at
    for i, j in enumerate(msg.jobs):
        where = f"jobs[{i}]"
        try:
            check_name(j.job, field=f"{where}.job")
        except InvalidArgument as err:
            if left_out is None:
                raise
            left_out.append(LeftOutJob(j.job[:MAX_NAME], str(err)))  # the reason says its length
            continue
        # twice in one report, a job's node would count twice in its attributes and its
        # traffic counters be summed twice (a node's own report lists each job once)
        if (before := first.setdefault(j.job, i)) != i:
            raise InvalidArgument(
                f"job {j.job!r} is reported twice, at jobs[{before}] too", field=f"{where}.job"
            )
        for name in ("gpus", "unhealthy_gpus", "xids"):
            _bounded(getattr(j, name), MAX_GPUS, field=f"{where}.{name}")
        _bounded(j.critical_xids, MAX_XIDS, field=f"{where}.critical_xids")
        for name in ("gpus", "unhealthy_gpus", "critical_xids"):
            for k, value in enumerate(getattr(j, name)):
                non_empty(value, field=f"{where}.{name}[{k}]", max_len=MAX_NAME)
                _token(value, field=f"{where}.{name}[{k}]")
        dscp = optional(j, "dscp")
        if dscp is not None and dscp > 63:
            raise InvalidArgument(f"DSCP must be in [0, 63], got {dscp}", field=f"{where}.dscp")
        applied = _level(optional(j, "applied_level"), field=f"{where}.applied_level")
        pinned = _level(optional(j, "pinned_level"), field=f"{where}.pinned_level")
        jobs.append(
            JobReport(
                job=j.job,
                progress_rate=_rate(optional(j, "progress_rate"), field=f"{where}.progress_rate"),
                iterations_per_s=_rate(
                    optional(j, "iterations_per_s"), field=f"{where}.iterations_per_s"
                ),
                dscp=dscp,
                gpus=tuple(j.gpus),
                unhealthy_gpus=tuple(j.unhealthy_gpus),
                xids=tuple(j.xids),
                link_up=optional(j, "link_up"),
                tx_bytes=j.tx_bytes,
                drops=j.drops,
                pinned_level=pinned,
                applied_level=applied,
                critical_xids=tuple(j.critical_xids),
                unranked=j.unranked,
                faults_left_out=j.faults_left_out,
            )
        )
    for name in ("instance", "build"):
        _token(getattr(msg, name), field=name)
    return NodeReport(
        node=node,
        jobs=tuple(jobs),
        applied_epoch=msg.applied_epoch,
        instance=msg.instance,
        build=msg.build,
    )


def attributes_to_pb(a: JobAttributes) -> pb.JobAttributes:
    msg = pb.JobAttributes(
        job=a.job,
        epoch=a.epoch,
        slowest_node=a.slowest_node,
        nodes=a.nodes,
        unhealthy_gpus=a.unhealthy_gpus,
        xids=a.xids,
        links_down=a.links_down,
        # saturated: past the wire type, the message could not be built and every node of
        # the job would get INTERNAL for its reports instead of its order
        drops=min(a.drops, _MAX_COUNTER),
        tx_bytes=min(a.tx_bytes, _MAX_COUNTER),
        computed_unix_seconds=a.computed_at,
        critical_xids=a.critical_xids,
        faults_left_out=min(a.faults_left_out, MAX_FAULTS_LEFT_OUT),  # uint32, as the counters
    )
    if a.level is not None:
        msg.level = a.level
    if a.dscp is not None:
        msg.dscp = a.dscp
    if a.progress_rate is not None:
        msg.progress_rate = a.progress_rate
    if a.iterations_per_s is not None:
        msg.iterations_per_s = a.iterations_per_s
    return msg


def attributes_from_pb(m: pb.JobAttributes) -> JobAttributes:
    return JobAttributes(
        job=m.job,
        epoch=m.epoch,
        level=optional(m, "level"),
        dscp=optional(m, "dscp"),
        progress_rate=optional(m, "progress_rate"),
        iterations_per_s=optional(m, "iterations_per_s"),
        slowest_node=m.slowest_node,
        nodes=tuple(m.nodes),
        unhealthy_gpus=tuple(m.unhealthy_gpus),
        xids=tuple(m.xids),
        links_down=tuple(m.links_down),
        drops=m.drops,
        tx_bytes=m.tx_bytes,
        computed_at=m.computed_unix_seconds,
        critical_xids=tuple(m.critical_xids),
        faults_left_out=m.faults_left_out,
    )


def order_to_pb(order: Order) -> pb.Order:
    return pb.Order(
        epoch=order.epoch,
        seq=order.seq,
        leader=order.leader,
        levels=dict(order.levels),
        tags=dict(order.tags),
        shares=order.shares,
        attributes=[attributes_to_pb(a) for a in order.attributes.values()],
        computed_unix_seconds=order.computed_at,
        lease=order.lease,
    )


def order_from_pb(m: pb.Order) -> Order:
    """An order as a leader sent it; levels and tags are checked where they are applied."""
    return Order(
        epoch=m.epoch,
        seq=m.seq,
        leader=m.leader,
        levels=dict(m.levels),
        tags=dict(m.tags),
        shares=tuple(m.shares),
        attributes={a.job: attributes_from_pb(a) for a in m.attributes},
        computed_at=m.computed_unix_seconds,
        lease=m.lease,
    )
