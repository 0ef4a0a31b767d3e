"""``gpud.v1.Mig``: show, apply, assert and export MIG layouts over gRPC.

Manager calls block on the driver (and an apply with ``drain`` waits for processes), so they
run in a worker thread, off the server's event loop. Errors propagate as gpud errors; the
server's interceptor maps them to gRPC codes and gpuctl exit codes.

A driver call that hangs never holds an answer past the request's deadline: ``ShowMig``
reads each GPU on its own thread and shows one that does not answer in time as faulty; an
apply whose client has gone (cancelled, or past its deadline) is not started if it had not
started, and otherwise finishes and is logged as finished after its client had gone.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from gpud.errors import InvalidArgument
from gpud.mig import MAX_DRAIN_SECONDS
from gpud.mig.layout import MigConfigFile, parse_config
from gpud.mig.manager import MigManager
from gpud.mig.results import ApplyResult, GpuOutcome
from gpud.mig.store import ApplyOptions
from gpud.mig.view import GpuView
from gpud.shared import MAX_LAYOUT_BYTES, check_config_name
from gpud.telemetry.snapshot import LastSeenSource, SeenIdentity
from gpud.threads import on_daemon_thread
from gpud.v1 import mig_pb2 as pb
from gpud.v1 import mig_pb2_grpc as pb_grpc

# What a read leaves of the request's deadline for the answer to travel back.
_ANSWER_MARGIN_S = 0.5
_DEFAULT_READ_S = 10.0  # a request without a deadline

T = TypeVar("T")


def _read_budget(context: grpc.aio.ServicerContext, cap: float = _DEFAULT_READ_S) -> float:
    remaining: float | None = context.time_remaining()
    if remaining is None:
        return cap
    return max(0.1, min(cap, remaining - _ANSWER_MARGIN_S))


def _config(source: pb.MigConfigSource) -> tuple[MigConfigFile, str]:
    if not source.name:
        raise InvalidArgument("a config name is required", field="config.name")
    check_config_name(source.name, field="config.name")
    if len(source.text.encode()) > MAX_LAYOUT_BYTES:
        raise InvalidArgument(f"larger than {MAX_LAYOUT_BYTES} bytes", field="config.text")
    return parse_config(source.text, path=source.path or None), source.name


def gpu_message(view: GpuView, seen: SeenIdentity | None = None) -> pb.MigGpu:
    """``seen``: how an earlier run last saw a GPU never read in this one (its UUID and
    product then; ``mig_capable`` stays unset, as for any GPU not read)."""
    ident = view.identity
    msg = pb.MigGpu(
        index=ident.index, layout="" if view.fault else view.describe(), fault=view.fault
    )
    # else not read (faulty, or not MIG capable): unknown, unset rather than False
    if view.mode is not None:
        msg.mig_current = view.mode.current
        msg.mig_pending = view.mode.pending
    # else never read (lost or hung since gpud started): unknown, unset rather than "" or False
    if ident.read:
        msg.uuid = ident.uuid
        msg.product = ident.product
        msg.mig_capable = ident.mig_capable
    elif seen is not None:
        if seen.uuid:
            msg.uuid = seen.uuid
        if seen.product:
            msg.product = seen.product
    if view.desired is not None:
        msg.desired_config = view.desired.config_name
        msg.desired_layout = view.desired.layout.describe()
    for inst in view.instances:
        m = msg.instances.add(
            gpu_instance_id=inst.gpu_instance_id,
            profile=inst.profile,
            placement_start=inst.placement_start,
            placement_size=inst.placement_size,
            compute_profile=inst.compute_profile or "",
            uuid=inst.uuid or "",
        )
        if inst.compute_instance_id is not None:
            m.compute_instance_id = inst.compute_instance_id
        if inst.mig is not None:
            m.mig = inst.mig
        if inst.memory_total_bytes is not None:
            m.memory_total_bytes = inst.memory_total_bytes
        if inst.memory_used_bytes is not None:
            m.memory_used_bytes = inst.memory_used_bytes
        m.processes_unknown = inst.processes_error
        m.memory_unknown = inst.memory_error
        for p in inst.processes:
            proc = m.processes.add(pid=p.pid, job=p.job or "")
            if p.used_memory_bytes is not None:
                proc.used_memory_bytes = p.used_memory_bytes
    for name, free, placements in view.profiles:
        msg.profiles.add(
            name=name,
            free=free,
            placement_starts=[s for s, _ in placements],
            placement_size=placements[0][1] if placements else 0,
        )
    return msg


def apply_message(result: ApplyResult) -> pb.ApplyMigResponse:
    return pb.ApplyMigResponse(
        config_name=result.config_name,
        result=result.result,
        duration_seconds=result.duration_s,
        dry_run=result.dry_run,
        gpus=[_outcome(o) for o in result.gpus],
    )


def _outcome(o: GpuOutcome) -> pb.MigGpuOutcome:
    msg = pb.MigGpuOutcome(
        gpu=o.gpu,
        steps=list(o.steps),
        reset_pending=o.reset_pending,
        status=o.status,
        detail=o.detail,
    )
    if o.uuid:  # else a GPU never read, left alone: its UUID is unknown
        msg.uuid = o.uuid
    return msg


class MigServicer(pb_grpc.MigServicer):
    """Serves ``gpud.v1.Mig``: ``ApiServer(path, servicers=[MigServicer(manager).register])``."""

    def __init__(
        self,
        manager: MigManager,
        *,
        default_drain_timeout_s: float = 300.0,
        read_timeout_s: float = _DEFAULT_READ_S,
        last_seen: LastSeenSource = dict,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        """``read_timeout_s``: how long ``ShowMig`` and ``AssertMig`` wait for a GPU's reads
        before they report the GPU as not answering (the daemon passes
        ``telemetry.call_timeout_s``: a GPU that takes longer is hung by telemetry's own
        measure, which marks it a moment later).
        ``last_seen()``: how an earlier run last saw each GPU never read in this one.
        ``stopping()``: whether gpud is stopping (an apply still draining or not begun ends
        as not started, and is answered so)."""
        self._manager = manager
        self._stopping = stopping
        self._last_seen = last_seen
        self._default_drain_s = default_drain_timeout_s  # for a drain without a timeout
        self._read_s = read_timeout_s

    def register(self, server: Any) -> None:
        pb_grpc.add_MigServicer_to_server(self, server)

    async def ShowMig(  # noqa: N802 (gRPC method names come from the proto)
        self, request: pb.ShowMigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ShowMigResponse:
        views = await asyncio.to_thread(
            self._manager.show, timeout_s=_read_budget(context, self._read_s)
        )
        seen = self._last_seen()
        return pb.ShowMigResponse(
            gpus=[gpu_message(v, seen.get(v.identity.index)) for v in views],
            unfinished_apply=self._manager.unfinished(),  # None: absent, null in JSON
        )

    async def ApplyMig(  # noqa: N802
        self, request: pb.ApplyMigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ApplyMigResponse:
        config, name = _config(request.config)
        if request.drain and request.force:
            raise InvalidArgument("drain and force exclude each other", field="force")
        timeout = request.timeout_seconds
        if request.drain and timeout == 0:
            timeout = self._default_drain_s
        if not 0 <= timeout <= MAX_DRAIN_SECONDS:
            raise InvalidArgument(
                f"must be within 0..{MAX_DRAIN_SECONDS:g}", field="timeout_seconds"
            )
        options = ApplyOptions(
            drain=request.drain,
            force=request.force,
            timeout_s=timeout,
            skip_reset=request.skip_reset,
        )
        gone = threading.Event()
        remaining: float | None = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining

        def still_wanted() -> bool:
            return not gone.is_set() and (deadline is None or time.monotonic() < deadline)

        result = await _run_while_wanted(
            gone,
            lambda: self._manager.apply(
                config,
                name,
                options=options,
                dry_run=request.dry_run,
                still_wanted=still_wanted,
                stopping=self._stopping,
            ),
        )
        return apply_message(result)

    async def AssertMig(  # noqa: N802
        self, request: pb.AssertMigRequest, context: grpc.aio.ServicerContext
    ) -> pb.AssertMigResponse:
        config, name = _config(request.config)
        budget = _read_budget(context, self._read_s)
        diff, faulty = await on_daemon_thread(
            lambda: self._manager.check(config, name, timeout_s=budget)
        )
        return pb.AssertMigResponse(
            matches=not diff,
            differences=diff,
            faulty=[f"GPU {gpu}: {reason}" for gpu, reason in faulty.items()],
        )

    async def ExportMig(  # noqa: N802
        self, request: pb.ExportMigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExportMigResponse:
        name = check_config_name(request.name or "current", field="name")
        text, faults = await on_daemon_thread(lambda: self._manager.export(name))
        return pb.ExportMigResponse(
            yaml=text, left_out=[f"GPU {i}: {why}" for i, why in sorted(faults.items())]
        )

    async def ForgetMig(  # noqa: N802
        self, request: pb.ForgetMigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ForgetMigResponse:
        uuid = request.gpu_uuid.strip()
        if not uuid:
            raise InvalidArgument("a GPU UUID is required (GPU-...)", field="gpu_uuid")
        record = await on_daemon_thread(lambda: self._manager.forget(uuid, gone=request.gone))
        return pb.ForgetMigResponse(
            gpu_uuid=record.gpu_uuid, gpu=record.gpu_index, config_name=record.config_name
        )


async def _run_while_wanted(gone: threading.Event, call: Callable[[], T]) -> T:
    """``call()`` on a daemon thread; ``gone`` is set when the RPC is cancelled (the client
    went away or its deadline passed) before the call returned. The thread is not stopped:
    the call decides what a gone client means; and a call stuck in the driver does not hold
    up gpud's exit (the plan is kept: the next start resumes it)."""
    try:
        return await on_daemon_thread(call)
    except asyncio.CancelledError:
        gone.set()
        raise
