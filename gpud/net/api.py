"""``gpud.v1.Net``: progress reports, ``gpuctl net show``, level pins, cgroup placement.

Register on the daemon's ``ApiServer``::

    ApiServer(path, servicers=[NetServicer(traffic, tokens=tokens).register])

Reports are checked field by field (the call's report token must be a run's of the job,
:mod:`gpud.api.access`; the job must be registered, the timestamp not in the future,
iterations not going backwards within a session, at most ``MAX_JOB_SESSIONS`` sessions of a
job live at once); a rejected report changes nothing. Calls run in a worker thread: the service's lock may be held by the tick.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gpud.api.access import ReportTokens
from gpud.api.validate import optional
from gpud.errors import GpudError, classify
from gpud.jobs.registry import MAX_NAME, check_name
from gpud.net.port import JobTraffic, TrafficCounters
from gpud.net.service import NetView, Report, TrafficService
from gpud.v1 import net_pb2 as pb
from gpud.v1 import net_pb2_grpc as pb_grpc


def counters_message(c: TrafficCounters) -> pb.NetCounters:
    return pb.NetCounters(bytes=c.bytes, packets=c.packets, drops=c.drops)


def job_message(j: JobTraffic, now: float) -> pb.NetJob:
    msg = pb.NetJob(job=j.job, dscp=j.dscp, cgroup=j.cgroup, counters=counters_message(j.counters))
    if j.level is not None:
        msg.level = j.level
    if j.rate is not None:
        msg.progress_rate = j.rate
    if j.iterations is not None:
        msg.iterations = j.iterations
    if j.iteration_s is not None:
        msg.iteration_s = j.iteration_s
    if j.contention_free_iteration_s is not None:
        msg.contention_free_iteration_s = j.contention_free_iteration_s
    if j.last_report_unix_s is not None:
        msg.last_report_age_seconds = max(0.0, now - j.last_report_unix_s)
    if j.pinned_level is not None:
        msg.pinned_level = j.pinned_level
    if j.pin_clamped_from is not None:
        msg.pinned_level_clamped_from = j.pin_clamped_from
    if j.stopped_s is not None:
        msg.stopped_seconds = j.stopped_s
    msg.stopped_unranked = j.unranked
    if j.ended_s is not None:
        msg.ended_seconds = j.ended_s
    return msg


def untagged_message(j: JobTraffic, why: str, now: float) -> pb.NetJob:
    """The row of a job in use without a tag: its progress, ``error`` why it has no tag;
    no DSCP (0), no level and no counters: its traffic is in the default class."""
    msg = job_message(j, now)
    msg.ClearField("counters")
    msg.error = why
    return msg


def show_message(view: NetView, now: float) -> pb.ShowNetResponse:
    by_level: dict[int, list[str]] = {}
    for j in view.jobs:
        if j.level is not None:
            by_level.setdefault(j.level, []).append(j.job)
    return pb.ShowNetResponse(
        enabled=view.enabled,
        jobs=[
            *(job_message(j, now) for j in view.jobs),
            *(untagged_message(j, view.untagged.get(j.job, ""), now) for j in view.untagged_jobs),
        ],
        levels=[
            pb.NetLevel(
                level=lv,
                min_share=share,
                jobs=by_level.get(lv, []),
                counters=counters_message(view.level_counters.get(lv, TrafficCounters())),
            )
            for lv, share in enumerate(view.shares)
        ],
        interfaces=[
            pb.NetInterface(
                name=i.name,
                rate_bits_per_second=float(i.rate_bps),
                enforced=i.enforced,
                error=i.error,
                repairs=i.repairs,
            )
            for i in view.interfaces
        ],
        level_changes_total=view.level_changes_total,
        order_source=view.order_source,
        epoch=view.epoch,
        marking_error=view.marking_error,
        rdma_backend=view.rdma_backend,
        rdma_error=view.rdma_error,
        idle_untagged_jobs=view.idle_untagged,
        marking_off=not view.marking,
        stop_after_spacings=view.gap_spacings,
        rdma_repairs=view.rdma_repairs,
        marking_restores=view.marking_restores,
    )


def report_from_pb(r: pb.ReportProgressRequest) -> Report:
    return Report(
        job=check_name(r.job, field="job"),
        iterations=r.iterations,
        timestamp=r.timestamp_unix_seconds,
        ideal_s=optional(r, "contention_free_iteration_s"),
        session=r.session,
    )


class NetServicer(pb_grpc.NetServicer):
    def __init__(self, service: TrafficService, *, tokens: ReportTokens | None = None) -> None:
        """``tokens``: whose reports a call may carry (default: no token is any run's)."""
        self._service = service
        self._tokens = tokens or ReportTokens()

    def register(self, server: Any) -> None:
        """Add this service to a ``grpc.aio.Server`` (an ``ApiServer`` registrar)."""
        pb_grpc.add_NetServicer_to_server(self, server)

    async def ReportProgress(  # noqa: N802
        self, request: pb.ReportProgressRequest, context: Any
    ) -> pb.ReportProgressResponse:
        def report() -> pb.ReportProgressResponse:
            reporter = self._tokens.reporter(context)
            r = report_from_pb(request)
            reporter.check(r.job)
            self._service.report(r)
            return pb.ReportProgressResponse()

        return await asyncio.to_thread(report)

    async def ReportProgressBatch(  # noqa: N802
        self, request: pb.ReportProgressBatchRequest, context: Any
    ) -> pb.ReportProgressBatchResponse:
        # at most MAX_REPEATED reports a call: the API's validation refuses more (the
        # client's Progress sends batches of that size)
        def batch() -> pb.ReportProgressBatchResponse:
            reporter = self._tokens.reporter(context)
            reports: list[Report] = []
            bad: list[pb.RejectedReport] = []
            index: list[int] = []
            for i, r in enumerate(request.reports):
                try:
                    report = report_from_pb(r)
                    reporter.check(report.job)
                    reports.append(report)
                    index.append(i)
                except GpudError as err:
                    bad.append(_rejected(i, r.job, err))
            accepted, rejected = self._service.report_batch(reports)
            bad += [_rejected(index[x.index], x.job, x.error) for x in rejected]
            bad.sort(key=lambda b: b.index)
            return pb.ReportProgressBatchResponse(accepted=accepted, rejected=bad)

        return await asyncio.to_thread(batch)

    async def ShowNet(self, request: pb.ShowNetRequest, context: Any) -> pb.ShowNetResponse:  # noqa: N802
        def show() -> pb.ShowNetResponse:
            return show_message(self._service.view(), self._service.now())

        return await asyncio.to_thread(show)

    async def PinLevel(self, request: pb.PinLevelRequest, context: Any) -> pb.PinLevelResponse:  # noqa: N802
        def pin() -> pb.PinLevelResponse:
            job = check_name(request.job, field="job")
            view = self._service.pin(job, optional(request, "level"))
            return pb.PinLevelResponse(job=job_message(view, self._service.now()))

        return await asyncio.to_thread(pin)

    async def PlaceProcess(  # noqa: N802
        self, request: pb.PlaceProcessRequest, context: Any
    ) -> pb.PlaceProcessResponse:
        def place() -> pb.PlaceProcessResponse:
            job = check_name(request.job, field="job")
            cgroup = self._service.place(job, request.pid, optional(request, "pid_namespace"))
            return pb.PlaceProcessResponse(cgroup=cgroup)

        return await asyncio.to_thread(place)


def _rejected(index: int, job: str, err: GpudError) -> pb.RejectedReport:
    code, _ = classify(err)
    # a refused name is echoed back no longer than a job name may be
    return pb.RejectedReport(index=index, job=job[:MAX_NAME], code=code, message=str(err))
