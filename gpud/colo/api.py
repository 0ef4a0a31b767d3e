"""``gpud.v1.Colocation``: ``gpuctl colo show``, placement advice, and job directives.

Register on the daemon's ``ApiServer``::

    ApiServer(path, servicers=[ColoServicer(colo_service, snapshots=sampler.latest).register])
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from gpud.api.access import ReportTokens
from gpud.api.validate import optional, optional_pid
from gpud.colo.service import ColoService
from gpud.errors import InvalidArgument, NotFound
from gpud.jobs.registry import check_name
from gpud.shared import user_names
from gpud.telemetry.snapshot import Snapshot
from gpud.v1 import colo_pb2 as pb
from gpud.v1 import colo_pb2_grpc as pb_grpc

MAX_WAITED_S = 366 * 86400.0


def _job(name: str) -> str:
    # Every job gpud places or hears from is a registered job: the registry's names.
    return check_name(name, field="job")


def _waited(request: pb.AdviseRequest) -> float:
    """How long the asker has waited already, in seconds (0 when it does not say)."""
    waited = optional(request, "waited_s")
    if waited is None:
        return 0.0
    if not 0.0 <= waited <= MAX_WAITED_S:  # NaN too
        raise InvalidArgument(
            f"must be a number of seconds in 0..{MAX_WAITED_S:g}, got {waited}", field="waited_s"
        )
    return float(waited)


class Registered(NamedTuple):
    """What a registered job declares that advice follows."""

    kind: str  # "training" | "inference"
    slo_p99_ms: float | None = None
    memory_bytes: int | None = None  # per device (its MPS pinned limit)


class ColoServicer(pb_grpc.ColocationServicer):
    def __init__(
        self,
        service: ColoService,
        *,
        snapshots: Callable[[], Snapshot | None],
        registered: Callable[[str], Registered | None] = lambda job: None,
        wall: Callable[[], float] = time.time,
        tokens: ReportTokens | None = None,
        run_uid: Callable[[int | None, int | None], int | None] = lambda pid, ns: None,
    ) -> None:
        """``registered``: a registered job's kind, p99 SLO and memory: advice for a job
        that is registered (``gpuctl jobs add chat --kind inference --slo-p99-ms 50
        --memory 20GiB``, then ``gpuctl run --job chat``) follows what it was registered as,
        where the request does not say. ``wall``: the clock that dates when a waiting run
        began to wait (``since_unix_seconds``). ``tokens``: whose reports a call may carry
        (:mod:`gpud.api.access`; default: no token is any run's). ``run_uid``: the user
        placement keeps a run to, from its holder PID and that PID's namespace
        (:meth:`gpud.jobs.service.JobService.run_uid`; default: none known): advice leaves
        out the GPUs that user may not share."""
        self._run_uid = run_uid
        self._service = service
        self._tokens = tokens or ReportTokens()
        self._wall = wall
        self._snapshots = snapshots
        self._registered = registered

    def register(self, server: Any) -> None:
        """Add this service to a ``grpc.aio.Server`` (an ``ApiServer`` registrar)."""
        pb_grpc.add_ColocationServicer_to_server(self, server)

    async def ShowColo(self, request: pb.ShowColoRequest, context: Any) -> pb.ShowColoResponse:  # noqa: N802
        return await asyncio.to_thread(self._show)

    def _show(self) -> pb.ShowColoResponse:
        v = self._service.show()
        out = pb.ShowColoResponse(
            enabled=v.enabled,
            plan_age_seconds=v.plan_age_s,
            predictor_samples=v.predictor_samples,
            predictor_mean_abs_error=v.predictor_mae,
        )
        plan = v.plan
        predicted = plan.predicted_speed if plan else {}
        for r in v.running:
            p = out.placements.add(
                job=r.name,
                kind=r.kind,
                gpu=r.gpu,
                sm_share=(r.threads_percent or 100) / 100.0,
                duty=v.duty.get(r.name, 1.0),
                reason="running",
            )
            if r.mig_profile is not None:
                p.mig_profile = r.mig_profile
            if r.gpu in v.faulty:
                # nothing is predicted or measured on a GPU that does not answer: a speed
                # shown would be stale (a plan or reading from before it stopped answering)
                continue
            if r.name in predicted:  # a job the plan left out has no prediction to show
                p.predicted_speed = predicted[r.name]
            if r.name in v.observed_speed:
                p.observed_speed = v.observed_speed[r.name]
        for p in out.placements:
            # what the job is told: an eviction stands until it leaves, whatever the plan
            # (its guard started afresh) would tell it now
            told = v.directives.get(p.job)
            if told is not None:
                p.reason, p.evict = told.reason, told.evict
        if plan is not None:
            for (gpu, resource), price in sorted(plan.prices.items()):
                out.prices.add(gpu=gpu, resource=resource, price=price)
            out.price_iterations = plan.convergence.iterations
            out.price_residual = plan.convergence.residual
            out.prices_converged = plan.convergence.converged
        out.predictor_margins.update(v.predictor_margins)
        out.predictor_margin_errors.update(v.predictor_margin_errors)
        out.refused_job = v.refused_job
        for (residents, check), count in sorted(v.refused.items()):
            out.refused.add(residents=residents, check=check, count=count)
        out.unattributed_processes.update(v.strangers)
        wall = self._wall()
        name_of = user_names()
        for w in v.waiting:
            waiter = out.waiting.add(
                job=w.job,
                waited_seconds=w.waited_s,
                reason=w.reason,
                id=w.id,
                since_unix_seconds=wall - w.waited_s,
            )
            if w.uid is not None:
                waiter.holder_uid = w.uid
                waiter.holder_user = name_of(w.uid)
        for p in out.placements:
            if p.gpu in v.faulty:
                p.reason = f"GPU {p.gpu} {v.faulty[p.gpu]}: left alone until it answers"
        for g in v.guards:
            m = out.guards.add(
                job=g.job,
                gpu=g.gpu,
                slo_ms=g.slo_ms,
                duty=g.duty,
                action=g.action,
                reason=g.reason,
                attainment=g.attainment,
            )
            if g.p99_ms is not None:
                m.p99_ms = g.p99_ms
            if g.p99_at_duty_ms is not None:
                m.p99_at_duty_ms = g.p99_at_duty_ms
        return out

    async def Advise(self, request: pb.AdviseRequest, context: Any) -> pb.AdviseResponse:  # noqa: N802
        job = _job(request.job)
        kind = request.kind or "training"
        slo = optional(request, "slo_p99_ms")
        memory = optional(request, "memory_bytes")
        known = await asyncio.to_thread(self._registered, job)  # reads the state store
        if known is not None:
            kind = known.kind
            slo = slo if slo is not None else known.slo_p99_ms
            memory = memory if memory is not None else known.memory_bytes
        uid = await asyncio.to_thread(  # reads /proc
            self._run_uid,
            optional_pid(request, "holder_pid"),
            optional(request, "holder_pid_namespace"),
        )
        snap = self._snapshots()
        a = await asyncio.to_thread(
            self._service.advise,
            job,
            kind=kind,
            memory_bytes=memory,
            slo_p99_ms=slo,
            sm_activity=optional(request, "sm_activity"),
            peak_load=optional(request, "peak_load") or 0.0,
            snapshot=snap,
            waiting=request.waiting,
            waited_s=_waited(request),
            waiter_id=optional(request, "waiter_id"),
            uid=uid,
            reserving=request.reserving,
        )
        out = pb.AdviseResponse(
            gpu=a.gpu,
            # a MIG instance is the job's alone: no MPS share within it
            threads_percent=(
                0
                if a.gpu < 0
                else 100
                if a.mig_profile is not None
                else max(1, min(100, round(a.sm_share * 100)))
            ),
            memory_limit_bytes=a.memory_limit_bytes,
            predicted_speed=a.predicted_speed,
            reason=a.reason,
            device=a.device,
            waiter_id=a.waiter_id,
        )
        if a.mig_profile is not None:
            out.mig_profile = a.mig_profile
        return out

    async def _holding(self, job: str, context: Any) -> str:
        """The job, if the call may report for it (its report token) and it holds a
        reservation on this node: reports from any other name would have the loop keep
        state for a job that is not there."""

        def holds() -> bool:
            self._tokens.reporter(context).check(job)
            return self._service.holds(job)

        if not await asyncio.to_thread(holds):
            raise NotFound(
                f"job {job} holds no reservation on this node (start it with gpuctl run)"
            )
        return job

    async def ReportLatency(  # noqa: N802
        self, request: pb.ReportLatencyRequest, context: Any
    ) -> pb.ReportLatencyResponse:
        job = await self._holding(_job(request.job), context)
        age = request.age_s if request.HasField("age_s") else None
        self._service.report_latency(job, list(request.seconds), age)
        return pb.ReportLatencyResponse()

    async def ThrottlePoint(  # noqa: N802
        self, request: pb.ThrottlePointRequest, context: Any
    ) -> pb.ThrottlePointResponse:
        job = await self._holding(_job(request.job), context)
        d = self._service.throttle_point(job, request.iterations, process=request.process)
        return pb.ThrottlePointResponse(duty=d.duty, evict=d.evict, reason=d.reason)
