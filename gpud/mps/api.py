"""``gpud.v1.Mps``: ``gpuctl mps show`` / ``gpuctl mps set``.

Register on the daemon's ``ApiServer``::

    ApiServer(path, servicers=[MpsServicer(mps, loads=jobs.loads, placement=jobs.locked).register])

Manager calls run the control client program (and may wait for a daemon to start): they run
in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any, Protocol

from gpud.api.validate import optional
from gpud.errors import InvalidArgument
from gpud.mps.manager import MpsDeviceStatus, MpsManager, Placement, Reserved
from gpud.telemetry.snapshot import LastSeenSource, SeenIdentity
from gpud.v1 import mps_pb2 as pb
from gpud.v1 import mps_pb2_grpc as pb_grpc


class DeviceLoad(Protocol):
    """What job reservations hold on one device (``gpud.jobs.placement.DeviceLoad``).

    A protocol, so that ``mps`` does not import ``jobs`` (``jobs`` builds on ``mps``)."""

    @property
    def memory_bytes(self) -> int: ...

    @property
    def jobs(self) -> tuple[str, ...]: ...

    @property
    def defaulted(self) -> tuple[str, ...]: ...


LoadSource = Callable[[], Mapping[str, DeviceLoad]]


def device_message(
    s: MpsDeviceStatus, load: DeviceLoad | None, seen: SeenIdentity | None = None
) -> pb.MpsDevice:
    """``seen``: how an earlier run last saw the GPU, when it was never read in this one."""
    msg = pb.MpsDevice(
        gpu=s.target.gpu,
        enabled=s.running,
        up=s.up,
        server_pids=list(s.servers),
        restarts=s.restarts,
        failed_starts=s.failed_starts,
        last_error=s.last_error,
        reserved_memory_bytes=load.memory_bytes if load else 0,
        jobs=list(load.jobs) if load else [],
        gpu_unhealthy=s.target.gpu_unhealthy,
    )
    # else a GPU never read: its size is unknown (unset, not 0), and no daemon that gpud
    # started in this run runs for it, so it has no pipe directory (a client would find none
    # there; one an earlier run started may still run, untouched: up_unknown); its UUID and
    # product are unknown too, unless an earlier run saw them
    if s.target.uuid:
        msg.uuid = s.target.uuid
        msg.memory_total_bytes = s.target.memory_total_bytes
        msg.pipe_directory = str(s.pipe_dir)
    else:
        # whether a daemon runs for it is unknown: one an earlier gpud started for its UUID
        # is left running, untouched, and gpud cannot tell which it is
        msg.up_unknown = f"GPU {s.target.gpu} not read since gpud started"
    if not s.target.uuid and seen is not None and s.target.mig is None:
        # as `gpuctl gpus` names it; memory_total_bytes and pipe_directory stay unset
        if seen.uuid:
            msg.uuid = seen.uuid
        if seen.product:
            msg.profile = seen.product
    if s.target.profile:
        msg.profile = s.target.profile
    if s.target.mig is not None:
        msg.mig = s.target.mig
    if s.pid is not None:
        msg.pid = s.pid
    if s.desired.threads_percent is not None:
        msg.threads_percent = s.desired.threads_percent
    if s.desired.memory_bytes is not None:
        msg.memory_limit_bytes = s.desired.memory_bytes
    if s.observed_threads_percent is not None:
        msg.observed_threads_percent = s.observed_threads_percent
    if s.observed_memory_bytes is not None:
        msg.observed_memory_limit_bytes = s.observed_memory_bytes
    return msg


class MpsServicer(pb_grpc.MpsServicer):
    def __init__(
        self,
        manager: MpsManager,
        *,
        loads: LoadSource = dict,
        placement: Placement = nullcontext,
        last_seen: LastSeenSource = dict,
    ) -> None:
        """``last_seen()``: how an earlier run last saw each GPU never read in this one.
        ``placement()``: holds reservations still (the jobs service's lock), from the read of
        ``loads()`` that a new default is checked against to its save."""
        self._manager = manager
        self._loads = loads
        self._placement = placement
        self._last_seen = last_seen

    def _reserved(self, uuid: str) -> Reserved:
        load = self._loads().get(uuid)
        return Reserved(load.memory_bytes, load.defaulted) if load else Reserved()

    def register(self, server: Any) -> None:
        """Add this service to a ``grpc.aio.Server`` (an ``ApiServer`` registrar)."""
        pb_grpc.add_MpsServicer_to_server(self, server)

    async def ShowMps(self, request: pb.ShowMpsRequest, context: Any) -> pb.ShowMpsResponse:  # noqa: N802
        return await asyncio.to_thread(self._show, request)

    def _show(self, request: pb.ShowMpsRequest) -> pb.ShowMpsResponse:
        statuses = self._manager.status()
        if request.HasField("device"):
            target = self._manager.resolve(request.device)
            statuses = [
                s
                for s in statuses
                if (s.target.uuid, s.target.gpu, s.target.mig)
                == (target.uuid, target.gpu, target.mig)
            ]
        loads, seen = self._loads(), self._last_seen()
        return pb.ShowMpsResponse(
            mps_enabled=self._manager.enabled,
            devices=[
                device_message(s, loads.get(s.target.uuid), seen.get(s.target.gpu))
                for s in statuses
            ],
        )

    async def SetMpsLimits(  # noqa: N802
        self, request: pb.SetMpsLimitsRequest, context: Any
    ) -> pb.SetMpsLimitsResponse:
        return await asyncio.to_thread(self._set, request)

    def _set(self, request: pb.SetMpsLimitsRequest) -> pb.SetMpsLimitsResponse:
        if not request.device:
            raise InvalidArgument("name a GPU or MIG device (UUID, index or GPU:MIG)", field="gpu")
        if request.clear_threads and request.HasField("threads_percent"):
            raise InvalidArgument("set or clear, not both", field="threads")
        if request.clear_memory and request.HasField("memory_limit_bytes"):
            raise InvalidArgument("set or clear, not both", field="memory")
        target = self._manager.resolve(request.device)
        status = self._manager.set_limits(
            request.device,
            threads_percent=optional(request, "threads_percent"),
            memory_bytes=optional(request, "memory_limit_bytes"),
            clear_threads=request.clear_threads,
            clear_memory=request.clear_memory,
            enabled=optional(request, "enabled"),
            placement=self._placement,
            reserved=self._reserved,
        )
        seen = self._last_seen().get(status.target.gpu)
        # what runs an earlier version made without a memory limit hold follows the default
        load = self._loads().get(target.uuid)
        return pb.SetMpsLimitsResponse(
            device=device_message(status, load, seen), limits_changed=status.limits_changed
        )
