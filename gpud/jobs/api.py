"""``gpud.v1.Jobs``: the registry and reservations over the API.

Register on the daemon's ``ApiServer``::

    ApiServer(path, servicers=[JobsServicer(job_service).register])

Calls touch SQLite and /proc: they run in a worker thread, off the event loop; ``ListJobs``,
a short read, runs on the loop on the store's reading connection
(:meth:`gpud.store.StateStore.reading`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from gpud.api.access import ReportTokens
from gpud.api.validate import (
    int_range,
    non_negative_seconds,
    optional,
    optional_pid,
    request_id,
)
from gpud.errors import InvalidArgument
from gpud.jobs.attribution import ProcessUse
from gpud.jobs.ends import NO_STATUS, EndCause, RunEnd
from gpud.jobs.env import without_token
from gpud.jobs.placement import Reservation
from gpud.jobs.registry import JobKind, JobSpec, check_devices, check_name
from gpud.jobs.service import JobService, RunRequest
from gpud.shared import user_name
from gpud.v1 import jobs_pb2 as pb
from gpud.v1 import jobs_pb2_grpc as pb_grpc

_KIND_TO_PB = {JobKind.TRAINING: pb.JOB_KIND_TRAINING, JobKind.INFERENCE: pb.JOB_KIND_INFERENCE}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}


def kind_from_pb(value: int) -> JobKind | None:
    if value == pb.JOB_KIND_UNSPECIFIED:
        return None
    if value not in _KIND_FROM_PB:
        raise InvalidArgument(f"unknown job kind {value}", field="kind")
    return _KIND_FROM_PB[value]  # type: ignore[index]


def reservation_message(r: Reservation) -> pb.JobReservation:
    msg = pb.JobReservation(
        id=r.id,
        job=r.job,
        devices=list(r.devices),
        client_priority=r.client_priority,
        created_unix_seconds=r.created_at,
    )
    if r.threads_percent is not None:
        msg.threads_percent = r.threads_percent
    if r.memory_bytes is not None:
        msg.memory_limit_bytes = r.memory_bytes
    if r.holder_pid is not None:
        msg.holder_pid = r.holder_pid
    if r.uid is not None:
        msg.holder_uid = r.uid
        msg.holder_user = user_name(r.uid)
    return msg


def job_message(
    job: JobSpec,
    reservations: Sequence[Reservation] = (),
    uses: Sequence[ProcessUse] = (),
) -> pb.Job:
    msg = pb.Job(
        name=job.name,
        kind=_KIND_TO_PB[job.kind],
        owner=job.owner,
        devices=list(job.devices),
        created_unix_seconds=job.created_at,
        reservations=[reservation_message(r) for r in reservations],
    )
    for u in uses:
        p = msg.processes.add(pid=u.pid, gpu=u.gpu, device=u.device, source=u.source)
        if u.used_memory_bytes is not None:
            p.used_memory_bytes = u.used_memory_bytes
    if job.mig_profile is not None:
        msg.mig_profile = job.mig_profile
    if job.gpu_count is not None:
        msg.gpu_count = job.gpu_count
    if job.threads_percent is not None:
        msg.threads_percent = job.threads_percent
    if job.memory_bytes is not None:
        msg.memory_limit_bytes = job.memory_bytes
    if job.client_priority is not None:
        msg.client_priority = job.client_priority
    if job.slo_p99_ms is not None:
        msg.slo_p99_ms = job.slo_p99_ms
    return msg


def run_end(request: pb.ReleaseRequest) -> RunEnd:
    """How the run ended, from a release: its command's exit status or the signal that
    killed it, as its gpuctl run reports it; neither (an older gpuctl): released. A release
    tried again through a gpud restart says how long ago it was first tried."""
    code, sig = optional(request, "exit_code"), optional(request, "exit_signal")
    if code is not None and sig is not None:
        raise InvalidArgument("give exit_code or exit_signal, not both", field="exit_signal")
    if code is not None:
        end = RunEnd(EndCause.EXITED, exit_code=int_range(code, 0, 255, field="exit_code"))
    elif sig is not None:
        end = RunEnd(EndCause.EXITED, exit_signal=int_range(sig, 1, 64, field="exit_signal"))
    else:
        end = NO_STATUS
    since = optional(request, "since_end_s")
    if since is None:
        return end
    return replace(end, since_end_s=non_negative_seconds(since, field="since_end_s"))


def spec_from_pb(job: pb.Job) -> JobSpec:
    return JobSpec(
        name=job.name,
        kind=kind_from_pb(job.kind) or JobKind.TRAINING,
        owner=job.owner,
        devices=tuple(job.devices),
        mig_profile=optional(job, "mig_profile"),
        gpu_count=optional(job, "gpu_count"),
        threads_percent=optional(job, "threads_percent"),
        memory_bytes=optional(job, "memory_limit_bytes"),
        client_priority=optional(job, "client_priority"),
        slo_p99_ms=optional(job, "slo_p99_ms"),
    )


class JobsServicer(pb_grpc.JobsServicer):
    def __init__(self, service: JobService, *, tokens: ReportTokens | None = None) -> None:
        """``tokens``: who may see a run's report token (:mod:`gpud.api.access`): a
        ``GetJobEnv`` over TCP leaves it out."""
        self._service = service
        self._tokens = tokens or ReportTokens()

    def register(self, server: Any) -> None:
        """Add this service to a ``grpc.aio.Server`` (an ``ApiServer`` registrar)."""
        pb_grpc.add_JobsServicer_to_server(self, server)

    def _message(self, job: JobSpec) -> pb.Job:
        uses = [u for u in self._service.process_uses() if u.job == job.name]
        return job_message(job, self._service.reservations.held(job.name), uses)

    def _messages(self, jobs: Sequence[JobSpec]) -> list[pb.Job]:
        """:meth:`_message` of each, with two reads in all rather than two per job."""
        held: dict[str, list[Reservation]] = {}
        for r in self._service.reservations.held():
            held.setdefault(r.job, []).append(r)
        uses: dict[str | None, list[ProcessUse]] = {}
        for u in self._service.process_uses():
            uses.setdefault(u.job, []).append(u)
        # a reservation holds UUIDs: a device never read (UUID "") is held by none
        sick = {u: why for u, why in self._service.unhealthy_devices().values() if u}
        messages = []
        for j in jobs:
            msg = job_message(j, held.get(j.name, []), uses.get(j.name, []))
            devices = {d for r in held.get(j.name, []) for d in r.devices}
            msg.unhealthy_gpus.extend(sorted({sick[d] for d in devices if d in sick}))
            messages.append(msg)
        return messages

    async def AddJob(self, request: pb.AddJobRequest, context: Any) -> pb.AddJobResponse:  # noqa: N802
        def add() -> pb.AddJobResponse:
            job = self._service.add(spec_from_pb(request.job))
            never = self._service.cannot_start(job)
            return pb.AddJobResponse(job=self._message(job), warnings=[never] if never else [])

        return await asyncio.to_thread(add)

    async def RemoveJob(self, request: pb.RemoveJobRequest, context: Any) -> pb.RemoveJobResponse:  # noqa: N802
        def remove() -> pb.RemoveJobResponse:
            return pb.RemoveJobResponse(
                job=job_message(self._service.remove(check_name(request.name), force=request.force))
            )

        return await asyncio.to_thread(remove)

    async def ListJobs(self, request: pb.ListJobsRequest, context: Any) -> pb.ListJobsResponse:  # noqa: N802
        def list_jobs() -> pb.ListJobsResponse:
            if request.HasField("name"):
                # a name the registry could not hold is refused by its rule, at any length,
                # as RemoveJob refuses it: not "no job" for a short one alone
                jobs = [self._service.registry.get(check_name(request.name))]
            else:
                jobs = self._service.registry.all()
            return pb.ListJobsResponse(jobs=self._messages(jobs))

        # On the loop, from the store's read-only snapshot connection: a read of a few rows,
        # where a hop to a worker thread queued for the GIL under a dozen clients
        # (tools/bench_api: p99 3.3 x a bare gRPC server's through a thread)
        with self._service.store.reading():
            return list_jobs()

    async def Reserve(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveResponse:  # noqa: N802
        def reserve() -> pb.ReserveResponse:
            launch = self._service.reserve(
                RunRequest(
                    job=check_name(request.job),
                    kind=kind_from_pb(request.kind),
                    owner=request.owner,
                    mig_profile=optional(request, "mig_profile"),
                    gpu_count=optional(request, "gpu_count"),
                    devices=check_devices(request.devices),
                    threads_percent=optional(request, "threads_percent"),
                    memory_bytes=optional(request, "memory_limit_bytes"),
                    client_priority=optional(request, "client_priority"),
                    holder_pid=optional_pid(request, "holder_pid"),
                    holder_pid_namespace=optional(request, "holder_pid_namespace"),
                    advised_devices=tuple(request.advised_devices),
                    advised_threads_percent=optional(request, "advised_threads_percent"),
                    request_id=request_id(request.request_id),
                )
            )
            return pb.ReserveResponse(
                job=job_message(launch.job),
                reservation=reservation_message(launch.reservation),
                env=launch.env,
                created_job=launch.created_job,
            )

        return await asyncio.to_thread(reserve)

    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:  # noqa: N802
        def release() -> pb.ReleaseResponse:
            if not request.reservation_id:
                raise InvalidArgument("missing", field="reservation_id")
            released = self._service.release(request.reservation_id, run_end(request))
            if released is None:  # removed while its run ran: its exit status is kept
                return pb.ReleaseResponse(removed=True)
            return pb.ReleaseResponse(reservation=reservation_message(released))

        return await asyncio.to_thread(release)

    async def GetJobEnv(self, request: pb.GetJobEnvRequest, context: Any) -> pb.GetJobEnvResponse:  # noqa: N802
        def env() -> pb.GetJobEnvResponse:
            env = self._service.env(
                check_name(request.job),
                holder_pid=optional_pid(request, "holder_pid"),
                holder_pid_namespace=optional(request, "holder_pid_namespace"),
            )
            return pb.GetJobEnvResponse(
                env=env if self._tokens.reveals(context) else without_token(env)
            )

        return await asyncio.to_thread(env)
