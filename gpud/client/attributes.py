"""A job's runtime attributes, as the cluster leader computed them, read from the local gpud.

::

    import gpud.client
    a = gpud.client.attributes()           # this job ($GPUD_JOB), one call; None if unknown
    if a and a.unhealthy_gpus: ...         # e.g. a collective library switching schedules
    if a and a.critical_xids: ...          # "node/uuid:79": uncleared, as `gpuctl xid` shows
    for a in gpud.client.watch_attributes():   # blocks; yields on every change
        ...

The attributes come with the epoch of the leader that computed them; a value is the same
on every node that runs the job (the leader folds all of them). Standard library and grpc
only, imported inside jobs. Where gRPC cannot be loaded in the job (missing, broken,
half-imported at the fork that made the process) or its channel made (a socket path not
valid UTF-8), both raise :class:`GrpcUnavailable`, saying why.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpud.client.progress import load_grpc

JOB_VAR = "GPUD_JOB"
SOCKET_VAR = "GPUD_SOCKET"
DEFAULT_SOCKET = Path("/run/gpud/gpud.sock")


@dataclass(frozen=True, slots=True)
class Attributes:
    """One job across the cluster.

    ``level``: its global network level (0 = highest priority; None: not ranked);
    ``progress_rate``: its slowest node's normalized progress rate (None: not known yet),
    ``slowest_node`` that node; ``unhealthy_gpus``: ``node/uuid`` of its GPUs found lost or
    hung on any node; ``critical_xids``: ``node/uuid:code``, every critical XID raised on a
    GPU (or under a MIG device) it holds and not cleared or reset since, as ``gpuctl xid``
    lists them; ``xids``: their ``node:code`` alone (from a node of an older gpud: the last
    XID of any kind); ``links_down``: nodes whose links for it are down; ``drops`` /
    ``tx_bytes``: its tag's counters summed over its nodes; ``faults_left_out``: entries
    of ``unhealthy_gpus``, ``xids`` and ``critical_xids`` the leader cut to bound its
    answer (each node and job keeps an even share; 0: none cut), so that fewer faults
    listed than there are never reads as healthy.
    """

    job: str
    epoch: int
    level: int | None
    dscp: int | None
    progress_rate: float | None
    iterations_per_s: float | None
    slowest_node: str
    nodes: tuple[str, ...]
    unhealthy_gpus: tuple[str, ...]
    xids: tuple[str, ...]
    links_down: tuple[str, ...]
    drops: int
    tx_bytes: int
    computed_unix_s: float
    critical_xids: tuple[str, ...] = ()
    faults_left_out: int = 0


class GrpcUnavailable(RuntimeError):
    """gpud was not asked: gRPC could not be loaded in this process (missing, broken,
    half-imported at the fork that made it) or its channel made (a socket path not valid
    UTF-8); the message says which, with the job."""


def _channel(target: str, job: str) -> Any:
    """A gRPC channel to gpud at ``target`` (it connects at its first call), gRPC loaded
    here in the caller's thread; :class:`GrpcUnavailable` where it cannot be."""

    def load() -> Any:
        import grpc

        return grpc.insecure_channel(target)

    generated = ("gpud.v1.cluster_pb2", "gpud.v1.cluster_pb2_grpc")
    where = target.removeprefix("unix:")
    channel, why, error = load_grpc(load, where, generated, outcome="gpud is not asked")
    if channel is None:
        raise GrpcUnavailable(f"attributes of job {job} not read: {why}") from error
    return channel


def _target(socket: Path | str | None, target: str | None) -> str:
    if target is not None:
        return target
    path = Path(socket or os.environ.get(SOCKET_VAR) or DEFAULT_SOCKET)
    return f"unix:{path.absolute()}"


def _job(job: str | None) -> str:
    name = job or os.environ.get(JOB_VAR, "")
    if not name:
        raise ValueError(f"no job name: pass job= or run under gpuctl run (${JOB_VAR})")
    return name


def _from_pb(m: Any) -> Attributes:
    def opt(field: str) -> Any:
        return getattr(m, field) if m.HasField(field) else None

    return Attributes(
        job=m.job,
        epoch=m.epoch,
        level=opt("level"),
        dscp=opt("dscp"),
        progress_rate=opt("progress_rate"),
        iterations_per_s=opt("iterations_per_s"),
        slowest_node=m.slowest_node,
        nodes=tuple(m.nodes),
        unhealthy_gpus=tuple(m.unhealthy_gpus),
        xids=tuple(m.xids),
        links_down=tuple(m.links_down),
        drops=m.drops,
        tx_bytes=m.tx_bytes,
        computed_unix_s=m.computed_unix_seconds,
        critical_xids=tuple(m.critical_xids),
        faults_left_out=m.faults_left_out,
    )


def attributes(
    job: str | None = None,
    *,
    socket: Path | str | None = None,
    target: str | None = None,
    timeout_s: float = 2.0,
) -> Attributes | None:
    """The job's attributes (``job`` defaults to ``$GPUD_JOB``); None before the first
    order that names it. Raises ``grpc.RpcError`` when gpud cannot be reached,
    :class:`GrpcUnavailable` where gRPC cannot be loaded or its channel made."""
    name = _job(job)
    with _channel(_target(socket, target), name) as channel:
        from gpud.v1 import cluster_pb2, cluster_pb2_grpc

        resp = cluster_pb2_grpc.ClusterStub(channel).GetAttributes(
            cluster_pb2.GetAttributesRequest(jobs=[name]), timeout=timeout_s
        )
    for a in resp.attributes:
        if a.job == name:
            return _from_pb(a)
    return None


def watch_attributes(
    job: str | None = None,
    *,
    socket: Path | str | None = None,
    target: str | None = None,
) -> Iterator[Attributes]:
    """The job's attributes now (once known), then again each time they change. Ends with
    ``grpc.RpcError`` if gpud goes away; close the generator to stop watching. Its first
    ``next()`` raises :class:`GrpcUnavailable` where gRPC cannot be loaded or its channel
    made."""
    name = _job(job)
    with _channel(_target(socket, target), name) as channel:
        from gpud.v1 import cluster_pb2, cluster_pb2_grpc

        stream = cluster_pb2_grpc.ClusterStub(channel).WatchAttributes(
            cluster_pb2.GetAttributesRequest(jobs=[name])
        )
        try:
            for resp in stream:
                for a in resp.attributes:
                    if a.job == name:
                        yield _from_pb(a)
        finally:
            stream.cancel()
