"""``gpud.v1.Node``: node status, GPUs with their latest sample, events, fault injection.

Reads only what it is given (see :mod:`gpud.api.ports`): the latest snapshot, static node
info, the event log and, on a simulated node, its fault injector.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc

from gpud.api import convert, validate
from gpud.api.access import OpenStreams
from gpud.api.ports import (
    EventSource,
    FaultPort,
    NodeInfoSource,
    ReloadState,
    SimProcessView,
    SnapshotSource,
    StateFiles,
    TrafficSource,
    WorkloadPort,
)
from gpud.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from gpud.events import DEFAULT_WATCH_BUFFER
from gpud.jobs.registry import MAX_NAME, check_name
from gpud.mps.procs import PID_MAX
from gpud.shared import (
    MAX_EVENT_LIMIT,
    WATCHING_KEY,
    check_kind_prefix,
    format_number,
    names_an_event_gpu,
    shown,
)
from gpud.telemetry.snapshot import ClearedXids, Snapshot
from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc

DEFAULT_EVENT_LIMIT = 100
# WatchEvents streams open at once (`gpuctl events --follow`) on the unix socket, and as many
# over TCP (api.tcp_address), counted apart: TCP callers never take the socket's. Each holds a
# buffer of at most DEFAULT_WATCH_BUFFER events, so that watchers bound gpud's memory.
MAX_EVENT_WATCHERS = 32

_FAULT_NAMES = {
    pb.FAULT_KIND_LOST: "lost",
    pb.FAULT_KIND_NOT_SUPPORTED: "not_supported",
    pb.FAULT_KIND_SLOW: "slow",
    pb.FAULT_KIND_XID: "xid",
    pb.FAULT_KIND_CLEAR: "clear",
    pb.FAULT_KIND_ERROR: "error",
    pb.FAULT_KIND_SLOW_MIG: "slow_mig",
    pb.FAULT_KIND_RESET_REQUIRED: "reset_required",
}


def _event_limit(request: pb.ListEventsRequest | pb.WatchEventsRequest) -> int:
    """The request's limit (its default for 0), its kind prefix and its filters checked: a
    ``gpu`` that is neither an index nor a GPU/MIG UUID, or a ``job`` no job could be
    named, or a kind prefix with an unprintable character, matches no event, and a listing (or a watch that would wait forever) would say
    nothing about why, as gpuctl refuses them (exit 2)."""
    limit = validate.int_range(request.limit, 0, MAX_EVENT_LIMIT, field="limit")
    check_kind_prefix(request.kind_prefix)
    gpu = request.gpu.strip()
    if gpu and not names_an_event_gpu(gpu):
        raise InvalidArgument(
            f"expected a GPU index or a GPU-/MIG- UUID, got {shown(request.gpu, MAX_NAME)}",
            field="gpu",
        )
    if request.job:
        check_name(request.job, field="job")
    return limit or DEFAULT_EVENT_LIMIT


def _workload_line(w: SimProcessView) -> str:
    """One simulated process as a line, for a gpuctl that reads only ``workloads``."""
    where = f"GPU {w.gpu}"
    if w.gpu_instance_id is not None:
        where += f" GI {w.gpu_instance_id} CI {w.compute_instance_id}"
    return f"pid {w.pid} on {where}: {w.used_memory_bytes / 2**30:.1f} GiB, {w.sm_ratio:.0%} SM"


def describe_faults(active: object) -> list[str]:
    """The fault injector's ``active()`` as lines: a mapping or a collection of faults."""
    if active is None:
        return []
    if isinstance(active, Mapping):
        lines = []
        for key, value in active.items():
            where = f"GPU {key}" if isinstance(key, int) else str(key)
            what = (
                ", ".join(f"{k}={v}" for k, v in value.items())
                if isinstance(value, Mapping)
                else str(value)
            )
            lines.append(f"{where}: {what}")
        return lines
    if isinstance(active, str | bytes):
        return [str(active)]
    try:
        return [str(f) for f in active]  # type: ignore[attr-defined]
    except TypeError:
        return [str(active)]


class NodeServicer(pb_grpc.NodeServicer):
    """Serves ``gpud.v1.Node``. Register it with :meth:`register` on an ``ApiServer``::

    ApiServer(path, servicers=[NodeServicer(snapshots=..., node_info=...).register])
    """

    def __init__(
        self,
        *,
        snapshots: SnapshotSource,
        node_info: NodeInfoSource,
        events: EventSource | None = None,
        faults: FaultPort | None = None,
        reboot: Callable[[], None] | None = None,
        workloads: WorkloadPort | None = None,
        clear_xid: Callable[[int, int | None], ClearedXids] | None = None,
        sample_again: Callable[[], object] | None = None,
        traffic: TrafficSource | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_event_watchers: int = MAX_EVENT_WATCHERS,
        watch_buffer: int = DEFAULT_WATCH_BUFFER,
    ) -> None:
        self._snapshots = snapshots
        self._node_info = node_info
        self._events = events
        self._faults = faults
        self._reboot = reboot
        self._workloads = workloads
        self._clear_xid = clear_xid
        self._sample_again = sample_again
        self._traffic = traffic
        self._clock = clock
        self._watch_buffer = watch_buffer
        self._watchers = OpenStreams(max_event_watchers, "event watchers", "gpuctl events --follow")

    def register(self, server: Any) -> None:
        """Add this service to a ``grpc.aio.Server`` (an ``ApiServer`` registrar)."""
        pb_grpc.add_NodeServicer_to_server(self, server)

    async def _show_change(self) -> None:
        """Sample again after changing the simulated node, so that the next read
        (`gpuctl xid`, `gpuctl gpus`, `gpuctl jobs`) shows the change, not the last tick."""
        if self._sample_again is not None:
            await asyncio.to_thread(self._sample_again)

    def _latest(self) -> Snapshot:
        snap = self._snapshots()
        if snap is None:
            raise Unavailable("no telemetry sample yet: the daemon is starting, retry shortly")
        return snap

    async def GetStatus(  # noqa: N802 (gRPC method names come from the proto)
        self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatusResponse:
        info = self._node_info()
        now = self._clock()
        snap = self._snapshots()
        resp = pb.GetStatusResponse(
            version=info.version,
            build=info.build,
            hostname=info.hostname,
            backend=info.backend,
            driver_version=info.driver_version,
            uptime_seconds=max(0.0, now - info.started_monotonic),
            gpu_count=info.gpu_count,
            simulated=info.simulated,
            watchdog_warning=info.watchdog_warning,
        )
        if info.reload is not None:
            resp.config.CopyFrom(_config_status(info.reload, now))
        if info.state_files is not None:
            resp.state_files.CopyFrom(_state_files_status(info.state_files, now))
        if snap is not None:
            resp.healthy_gpu_count = sum(1 for g in snap.gpus if g.healthy)
            resp.unhealthy_gpus.extend(
                f"GPU {g.identity.index}: {g.reason or 'unhealthy'}"
                for g in snap.gpus
                if not g.healthy
            )
            resp.last_sample_age_seconds = max(0.0, now - snap.monotonic)
            resp.last_tick_seconds = snap.tick_seconds
        if self._traffic is not None:
            traffic = self._traffic()
            resp.traffic.CopyFrom(
                pb.TrafficStatus(
                    enabled=traffic.enabled,
                    interfaces=[
                        pb.TrafficInterfaceStatus(name=i.name, enforced=i.enforced, error=i.error)
                        for i in traffic.interfaces
                    ],
                    marking_error=traffic.marking_error,
                    marking_off=not traffic.marking,
                    rdma_backend=traffic.rdma_backend,
                    rdma_error=traffic.rdma_error,
                )
            )
        return resp

    async def ListGpus(  # noqa: N802 (gRPC method names come from the proto)
        self, request: pb.ListGpusRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListGpusResponse:
        only: int | None = None
        if request.HasField("gpu"):
            only = validate.gpu_index(request.gpu, self._node_info().gpu_count)
        snap = self._latest()
        now = self._clock()
        samples = [g for g in snap.gpus if only is None or g.identity.index == only]
        return pb.ListGpusResponse(
            gpus=[convert.gpu(g, now_monotonic=now) for g in samples],
            sampled_at_unix_seconds=snap.wall_time,
            sample_age_seconds=max(0.0, now - snap.monotonic),
        )

    async def ListEvents(  # noqa: N802 (gRPC method names come from the proto)
        self, request: pb.ListEventsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListEventsResponse:
        limit = _event_limit(request)
        if self._events is None:
            return pb.ListEventsResponse()
        events = self._events.recent(
            limit, request.kind_prefix, gpu=request.gpu.strip(), job=request.job
        )
        return pb.ListEventsResponse(events=[convert.event(e) for e in events])

    async def WatchEvents(  # noqa: N802 (gRPC method names come from the proto)
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        limit = _event_limit(request)
        after_time = validate.non_negative_seconds(
            request.after_time_unix_seconds, field="after_time_unix_seconds"
        )
        log = self._events
        if log is None:
            return
        with self._watchers.held(context.peer()):
            loop = asyncio.get_running_loop()
            ready = asyncio.Event()

            def wake() -> None:  # from whichever thread emitted
                with contextlib.suppress(RuntimeError):  # the loop closed: nothing waits
                    loop.call_soon_threadsafe(ready.set)

            watcher, start, gap = log.watch(
                wake,
                limit=limit,
                kind_prefix=request.kind_prefix,
                gpu=request.gpu.strip(),
                job=request.job,
                after_seq=request.after_seq,
                after_time=after_time,
                buffer=self._watch_buffer,
            )
            try:
                # the watcher knows it is set up (and following again, after a restart)
                await context.send_initial_metadata(((WATCHING_KEY, "1"),))
                if gap:
                    yield pb.WatchEventsResponse(expired=gap)
                for event in start:
                    yield pb.WatchEventsResponse(event=convert.event(event))
                while True:
                    ready.clear()  # before the take: a wake after it is not lost
                    events, missed, closed = log.take(watcher)
                    for event in events:
                        yield pb.WatchEventsResponse(event=convert.event(event))
                    if missed:
                        yield pb.WatchEventsResponse(missed=missed)
                    if closed:
                        return  # gpud stops: the stream ends, OK
                    if not events and not missed:
                        await ready.wait()
            finally:
                log.unwatch(watcher)

    async def InjectFault(  # noqa: N802 (gRPC method names come from the proto)
        self, request: pb.InjectFaultRequest, context: grpc.aio.ServicerContext
    ) -> pb.InjectFaultResponse:
        faults = self._faults
        if faults is None:
            raise FailedPrecondition(
                "node is not simulated: faults can only be injected into gpud --simulate"
            )
        gpu = validate.gpu_index(request.gpu, self._node_info().gpu_count)
        kind = _FAULT_NAMES.get(request.kind)
        if kind is None:
            known = ", ".join(pb.FaultKind.Name(k) for k in _FAULT_NAMES)
            raise InvalidArgument(
                f"unknown fault kind {request.kind} (one of {known})", field="kind"
            )

        apply: Callable[[], object]
        detail: dict[str, Any] = {}
        blame = "gpu"  # the request field a ValueError from the injector is about
        if kind == "lost":
            apply = lambda: faults.lose(gpu)  # noqa: E731
        elif kind == "reset_required":
            apply = lambda: faults.reset_required(gpu)  # noqa: E731
        elif kind == "clear":
            apply = lambda: faults.clear(gpu)  # noqa: E731
        elif kind == "not_supported":
            field = validate.non_empty(request.field, field="field")
            detail["field"], blame = field, "field"
            apply = lambda: faults.not_supported(gpu, field)  # noqa: E731
        elif kind == "error":
            field = validate.non_empty(request.field, field="field")
            detail["field"], blame = field, "field"
            apply = lambda: faults.error(gpu, field)  # noqa: E731
        elif kind in ("slow", "slow_mig"):
            seconds = validate.non_negative_seconds(request.seconds, field="seconds")
            detail["seconds"], blame = seconds, "seconds"
            slow = faults.slow if kind == "slow" else faults.slow_mig
            apply = lambda: slow(gpu, seconds)  # noqa: E731
        else:
            code = validate.xid_code(request.xid)
            detail["xid"], blame = code, "xid"
            apply = lambda: faults.xid(gpu, code)  # noqa: E731

        try:
            # The simulated driver may hold its lock through a slow call: stay off the loop.
            await asyncio.to_thread(apply)
        except ValueError as err:
            # the injector refuses what it cannot simulate, e.g. an unknown field name
            raise InvalidArgument(str(err), field=blame) from err
        if self._events is not None:
            self._events.emit(
                f"sim.fault.{kind}",
                f"injected fault {kind} on GPU {gpu}",
                gpu=gpu,
                uuid=self._gpu_uuid(gpu),
                **detail,
            )
        if kind != "slow":
            # not for a slow GPU: its sample would take the whole call timeout, and telemetry
            # calls it hung only once a read outlasts that anyway
            await self._show_change()
        active = await asyncio.to_thread(faults.active)
        return pb.InjectFaultResponse(active_faults=describe_faults(active))

    def _gpu_uuid(self, gpu: int) -> str:
        """GPU ``gpu``'s UUID for an event, from the latest snapshot ("" before its first)."""
        snap = self._snapshots()  # not _latest(): the fault is in already, the event must be
        sample = snap.gpu(gpu) if snap is not None else None
        return sample.known().uuid if sample is not None else ""

    async def RebootSim(  # noqa: N802 (gRPC method names come from the proto)
        self, request: pb.RebootSimRequest, context: grpc.aio.ServicerContext
    ) -> pb.RebootSimResponse:
        if self._reboot is None:
            raise FailedPrecondition("node is not simulated: only gpud --simulate can reboot")
        # no _show_change(): the reboot samples the node again itself, before any pass runs
        await asyncio.to_thread(self._reboot)
        return pb.RebootSimResponse()

    async def SimWorkload(  # noqa: N802 (gRPC method names come from the proto)
        self, request: pb.SimWorkloadRequest, context: grpc.aio.ServicerContext
    ) -> pb.SimWorkloadResponse:
        workloads = self._workloads
        if workloads is None:
            raise FailedPrecondition(
                "node is not simulated: workloads can only be started on gpud --simulate"
            )
        pid = validate.int_range(request.pid, 1, PID_MAX, field="pid")
        if request.stop:
            if not await asyncio.to_thread(workloads.stop, pid):
                raise NotFound(f"no simulated process {pid}")
        else:
            gpu = validate.gpu_index(request.gpu, self._node_info().gpu_count)
            if not 0.0 <= request.sm_ratio <= 1.0:
                raise InvalidArgument(
                    f"must be within 0..1, got {format_number(request.sm_ratio)}", field="sm_ratio"
                )
            mig: int | str | None = None
            if request.mig:
                digits = request.mig.isascii() and request.mig.isdigit()
                mig = int(request.mig) if digits else request.mig
            try:
                follows = await asyncio.to_thread(
                    workloads.start, gpu, pid, request.memory_bytes, request.sm_ratio, mig
                )
            except ValueError as err:
                # the workloads' own checks of the GPU index, memory and SM share (made
                # above already). The simulated driver's refusals pass as they are: a GPU
                # in MIG mode with no MIG device named is InvalidArgument of mig listing
                # its MIG devices (gpuctl adds its option, --mig), a PID already on the GPU
                # AlreadyExists, an unknown MIG device NotFound, a faulty GPU
                # FailedPrecondition
                raise InvalidArgument(str(err), field="mig" if request.mig else "pid") from err
            if self._events is not None:
                self._events.emit(
                    "sim.workload",
                    f"simulated process {pid} started on GPU {gpu}"
                    + (f" MIG {request.mig}" if request.mig else "")
                    + (
                        f": it ends when host process {pid} exits"
                        if follows
                        else f": no host process {pid} runs, so it runs until stopped"
                    ),
                    pid=pid,
                    gpu=gpu,
                    uuid=self._gpu_uuid(gpu),
                )
        await self._show_change()
        running = await asyncio.to_thread(workloads.list)
        return pb.SimWorkloadResponse(
            workloads=[_workload_line(w) for w in running],
            processes=[
                pb.SimProcess(
                    pid=w.pid,
                    gpu=w.gpu,
                    gpu_instance_id=w.gpu_instance_id,
                    compute_instance_id=w.compute_instance_id,
                    used_memory_bytes=w.used_memory_bytes,
                    sm_ratio=w.sm_ratio,
                )
                for w in running
            ],
        )

    async def ClearXid(  # noqa: N802 (gRPC method names come from the proto)
        self, request: pb.ClearXidRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClearXidResponse:
        if self._clear_xid is None:
            raise FailedPrecondition("this daemon does not track critical XIDs")
        gpu = validate.gpu_index(request.gpu, self._node_info().gpu_count)
        code: int | None = validate.optional(request, "xid")
        if code is not None:
            validate.xid_code(code)
        try:
            # it writes the XID state file (flushed to disk): off the event loop
            done = await asyncio.to_thread(self._clear_xid, gpu, code)
        except IndexError as err:  # not sampled yet
            raise Unavailable(f"GPU {gpu} has not been sampled yet: retry shortly") from err
        resp = pb.ClearXidResponse(cleared_xids=done.cleared, remaining_xids=done.remaining)
        if done.cleared:
            resp.cleared_xid = done.cleared[0]
        return resp


def _config_status(state: ReloadState, now: float) -> pb.ConfigStatus:
    status = pb.ConfigStatus(
        reloads=state.reloads,
        reload_error=state.error,
        restart_needed=state.restart_needed,
        file_changed=state.file_changed,
        overridden=state.overridden,
    )
    if state.last_monotonic is not None:
        status.last_reload_age_seconds = max(0.0, now - state.last_monotonic)
    return status


def _state_files_status(files: StateFiles, now: float) -> pb.StateFilesStatus:
    status = pb.StateFilesStatus(
        state_db_path=files.state_db,
        state_db_error=files.state_db_error,
        event_log_path=files.event_log,
        event_log_error=files.event_log_error,
        event_log_lines_missing=files.event_log_lines_missing,
        event_log_lines_queued=files.event_log_lines_queued,
    )
    if files.state_db_error_monotonic is not None:
        status.state_db_error_age_seconds = max(0.0, now - files.state_db_error_monotonic)
    if files.event_log_write_monotonic is not None:
        status.event_log_write_seconds = max(0.0, now - files.event_log_write_monotonic)
    if files.state_db_write_monotonic is not None:
        status.state_db_write_seconds = max(0.0, now - files.state_db_write_monotonic)
    return status
