"""The cluster's gRPC services and the peer transport.

* :class:`ClusterPeerServicer` (``gpud.v1.ClusterPeer``) on :class:`PeerServer`: TCP on
  ``cluster.listen`` with mutual TLS (``ss -tlnp | grep gpud`` shows it); a client without
  a certificate from the cluster CA fails the handshake and never reaches a method.
* :class:`ClusterServicer` (``gpud.v1.Cluster``) on the local unix socket, in the daemon's
  ``servicers=[...]``: status, attributes and their watch stream.
* :class:`PeerClient`: how a node reaches the leader (one channel per leader address,
  the leader's node name checked against its certificate).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import socket
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc

from gpud.api.access import OpenStreams
from gpud.api.interceptors import ErrorMappingInterceptor
from gpud.api.server import connection_options
from gpud.cluster.agent import ClusterAgent, ClusterStatus
from gpud.cluster.convert import (
    MAX_JOBS,
    MAX_NAME,
    attributes_to_pb,
    order_from_pb,
    order_to_pb,
    report_from_pb,
    report_to_pb,
)
from gpud.cluster.leader import NodeSeen
from gpud.cluster.model import (
    LEFT_OUT_KEPT,
    LeftOutJob,
    NodeReport,
    Order,
    left_out_said,
    node_name,
)
from gpud.cluster.tls import PeerTls
from gpud.config import parse_address
from gpud.errors import (
    ERROR_KEY,
    LEADER_ADDRESS_KEY,
    LEADER_KEY,
    ConfigError,
    DuplicateNode,
    GpudError,
    HandshakeFailed,
    InvalidArgument,
    LeaderNotReady,
    NotLeader,
    PermissionDenied,
    Unavailable,
)
from gpud.jobs.registry import check_name
from gpud.shared import shown
from gpud.v1 import cluster_pb2 as pb
from gpud.v1 import cluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def _jobs(values: Any, *, field: str = "jobs") -> list[str]:
    """Job names as the registry takes them: an empty or malformed name is refused
    (``INVALID_ARGUMENT``), where a well-formed one no order names yet lists nothing."""
    if len(values) > MAX_JOBS:
        raise InvalidArgument(f"at most {MAX_JOBS} entries, got {len(values)}", field=field)
    return [check_name(str(v), field=f"{field}[{i}]") for i, v in enumerate(values)]


def peer_names(context: Any) -> set[str]:
    """The names in the client certificate (subjectAltName DNS entries, else its CN)."""
    auth = context.auth_context() or {}
    names = {
        bytes(v).decode(errors="replace") for v in auth.get("x509_subject_alternative_name", [])
    }
    if not names:
        names = {bytes(v).decode(errors="replace") for v in auth.get("x509_common_name", [])}
    return names


def _check_identity(context: Any, node: str) -> None:
    """A node reports only as itself: the name in its report must be in its certificate.
    Checked on the report's name as it came, before the report is read: a peer reporting
    as another node costs no more than this comparison."""
    names = peer_names(context)
    # DNS names compare without case (RFC 4343), as TLS and the start's check of
    # cluster.node against this node's own certificate do
    if node.lower() not in {name.lower() for name in names}:
        raise PermissionDenied(
            f"a peer whose certificate names {', '.join(sorted(names)) or 'nothing'} "
            f"cannot report as {shown(node, MAX_NAME)}"
        )


class ClusterPeerServicer(pb_grpc.ClusterPeerServicer):
    def __init__(self, agent: ClusterAgent) -> None:
        self._agent = agent

    def register(self, server: Any) -> None:
        pb_grpc.add_ClusterPeerServicer_to_server(self, server)

    async def Report(  # noqa: N802 (gRPC method names come from the proto)
        self, request: pb.ReportRequest, context: Any
    ) -> pb.ReportResponse:
        _check_identity(context, request.node)
        # a job whose name this gpud refuses (an older node's) is left out, not the report:
        # refused whole, the node would get no order for any of its jobs
        left_out: list[LeftOutJob] = []
        report = report_from_pb(request, left_out=left_out)
        order = self._agent.receive(report, peer=context.peer(), left_out=left_out)
        response = pb.ReportResponse(
            left_out=[pb.LeftOutJob(job=j.job, reason=j.reason) for j in left_out]
        )
        if order is not None:
            response.order.CopyFrom(order_to_pb(order))
        return response

    async def GetNodes(  # noqa: N802 (gRPC method names come from the proto)
        self, request: pb.GetNodesRequest, context: Any
    ) -> pb.GetNodesResponse:
        return pb.GetNodesResponse(nodes=[_node_to_pb(n) for n in self._agent.seen_nodes()])

    async def GetOrder(  # noqa: N802 (gRPC method names come from the proto)
        self, request: pb.GetOrderRequest, context: Any
    ) -> pb.GetOrderResponse:
        order = self._agent.read_order(request.node, _jobs(request.jobs))
        if order is None:
            return pb.GetOrderResponse()
        return pb.GetOrderResponse(order=order_to_pb(order))


def _node_to_pb(n: NodeSeen) -> pb.ClusterNode:
    return pb.ClusterNode(
        node=n.node,
        report_age_seconds=n.age_s,
        jobs=n.jobs,
        applied_epoch=n.applied_epoch,
        build=n.build or None,  # absent: an older gpud, which sent none
    )


def _node_from_pb(m: pb.ClusterNode) -> NodeSeen:
    return NodeSeen(m.node, m.report_age_seconds, m.jobs, m.applied_epoch, m.build)


def status_to_pb(s: ClusterStatus) -> pb.GetClusterStatusResponse:
    hint = s.hint
    msg = pb.GetClusterStatusResponse(
        election=s.election,
        node=s.node,
        leader=hint.leader if hint else s.info.leader,
        leader_address=hint.address if hint else s.info.address,
        leader_source="hint" if hint else "election",
        elected_leader=s.info.leader,
        elected_leader_address=s.info.address,
        epoch=s.info.epoch,
        leading=s.info.leading,
        mode=s.mode.value,
        store_ok=s.info.store_ok,
        detail=s.info.detail,
        applied_epoch=s.applied_epoch,
        applied_seq=s.applied_seq,
        grace_seconds=s.grace_s,
        rejected_orders=s.rejected_orders,
        nodes=[_node_to_pb(n) for n in s.nodes],
        last_error=s.last_error,
        problems=[
            pb.ClusterProblem(
                node=p.node,
                message=p.message,
                since_unix_seconds=p.since,
                kind=p.kind,
                instance=p.instance,
                gpud=p.gpud,
                mode=p.mode,
            )
            for p in s.problems
        ],
        etcd_alarms=s.etcd_alarms,
        store_state=s.info.store_state,
        last_error_kind=s.last_error_kind,
        problems_state=s.problems_state or None,  # absent with no etcd, as from an older gpud
        leader_lease=f"{s.info.lease:016x}" if s.info.lease else None,  # as etcdctl prints it
        stepped_down=s.info.stepped_down or None,
    )
    for c in s.certificates:
        cert = msg.certificates.add(key=c.key, path=c.path, error=c.error)
        if c.not_after is not None:
            cert.not_after_unix_seconds = c.not_after
        if c.expires_in_s is not None:
            cert.expires_in_seconds = c.expires_in_s
    if s.last_order_age_s is not None:
        msg.last_order_age_seconds = s.last_order_age_s
    if hint is not None:
        msg.leader_since_unix_seconds = hint.since
    for a in s.jobs:
        job = msg.jobs.add(job=a.job, slowest_node=a.slowest_node, nodes=a.nodes)
        if a.level is not None:
            job.level = a.level
        if a.dscp is not None:
            job.dscp = a.dscp
        if a.progress_rate is not None:
            job.progress_rate = a.progress_rate
    return msg


# WatchAttributes streams open at once on the unix socket, and as many over TCP
# (api.tcp_address), counted apart: each job process that watches its attributes holds one
# (gpud.client.watch_attributes), with its request (up to MAX_REQUEST_BYTES) and its
# coroutine, so that a client that opens them in a loop and never closes one bounds gpud's
# memory rather than growing it until the kernel's OOM killer stops gpud.
MAX_ATTRIBUTE_WATCHERS = 1024


class ClusterServicer(pb_grpc.ClusterServicer):
    """``gpud.v1.Cluster`` on the local socket (and api.tcp_address): at most
    ``max_watchers`` WatchAttributes streams open at once on each, one more refused with
    RESOURCE_EXHAUSTED."""

    def __init__(self, agent: ClusterAgent, *, max_watchers: int = MAX_ATTRIBUTE_WATCHERS) -> None:
        self._agent = agent
        self._watchers = OpenStreams(
            max_watchers, "WatchAttributes streams", "a job's gpud.client.watch_attributes"
        )

    def register(self, server: Any) -> None:
        pb_grpc.add_ClusterServicer_to_server(self, server)

    async def GetClusterStatus(  # noqa: N802 (gRPC method names come from the proto)
        self, request: pb.GetClusterStatusRequest, context: Any
    ) -> pb.GetClusterStatusResponse:
        return status_to_pb(await self._agent.status_with_nodes())

    async def GetAttributes(  # noqa: N802 (gRPC method names come from the proto)
        self, request: pb.GetAttributesRequest, context: Any
    ) -> pb.GetAttributesResponse:
        epoch, seq, attributes = self._agent.attributes(_jobs(request.jobs))
        return pb.GetAttributesResponse(
            epoch=epoch, seq=seq, attributes=[attributes_to_pb(a) for a in attributes]
        )

    async def WatchAttributes(  # noqa: N802 (gRPC method names come from the proto)
        self, request: pb.GetAttributesRequest, context: Any
    ) -> AsyncIterator[pb.GetAttributesResponse]:
        jobs = _jobs(request.jobs)
        with self._watchers.held(context.peer()):
            async for epoch, seq, attributes in self._agent.watch(jobs):
                yield pb.GetAttributesResponse(
                    epoch=epoch, seq=seq, attributes=[attributes_to_pb(a) for a in attributes]
                )


def _listen_error(address: str) -> GpudError:
    """Why gRPC could not bind ``address`` (it logs the reason but raises nothing that
    says it): a plain bind finds it out. A port another process holds may be free at the
    next try (exit 1, systemd restarts gpud); any other reason is the config's (exit 2)."""
    what = f"cannot serve the cluster peer API on {address}"
    host, port = parse_address(address, path="config", key="cluster.listen")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(addr)
    except OSError as err:
        why = err.strerror or str(err)
        if err.errno == errno.EADDRINUSE:
            return Unavailable(f"{what}: {why} (cluster.listen; what holds it: ss -ltnp)")
        return ConfigError(f"{what}: {why}", key="cluster.listen")
    return GpudError(f"{what} (cluster.listen); gRPC's log line above says why")


class PeerServer:
    """gRPC on TCP with mutual TLS, for :class:`ClusterPeerServicer` only."""

    def __init__(self, address: str, tls: PeerTls, agent: ClusterAgent) -> None:
        self.address = address
        self._tls = tls
        self._agent = agent
        self._server: Any = None
        self.port: int | None = None

    async def start(self) -> None:
        server = grpc.aio.server(
            # peers retry every tick: a refusal ("does not lead") is logged once per cause
            interceptors=[ErrorMappingInterceptor(log_repeats=False)],
            options=[
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                *connection_options(),
            ],
        )
        ClusterPeerServicer(self._agent).register(server)
        try:
            port = server.add_secure_port(self.address, self._tls.server_credentials())
        except RuntimeError as err:
            port = 0
            log.debug("bind failed: %s", err)
        if port == 0:
            await server.stop(None)
            raise _listen_error(self.address)
        await server.start()
        self._server, self.port = server, port
        log.info("cluster peer API (mutual TLS) on %s", self.address.rsplit(":", 1)[0] + f":{port}")

    async def stop(self, grace: float | None = 1.0) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)


# the words an older leader's refusals carry, its metadata naming only FailedPrecondition
# or NotLeader
_OLDER_DUPLICATE = "is reported by two gpuds"
_OLDER_NOT_READY = "does not lead yet"


def report_error(err: grpc.aio.AioRpcError, leader: str, address: str) -> GpudError:
    """Why the leader at ``address`` did not answer a report, as the error tree has it:
    :class:`DuplicateNode`, :class:`LeaderNotReady`, :class:`NotLeader` (with the leader
    it names), :class:`InvalidArgument` or :class:`PermissionDenied` (it refused the
    report, in its words), :class:`HandshakeFailed` (gRPC says only so in its text),
    otherwise :class:`Unavailable`. The leader names its error's class in trailing metadata
    (``ERROR_KEY``); an older leader's class is the base, and its words tell."""
    code, details = err.code(), err.details() or ""
    message = f"leader {leader} at {address}: {code.name} {details}".rstrip()
    meta = dict(err.trailing_metadata() or ())
    error = str(meta.get(ERROR_KEY, ""))
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        if error == DuplicateNode.__name__ or _OLDER_DUPLICATE in details:
            return DuplicateNode(message)
        if error == LeaderNotReady.__name__ or _OLDER_NOT_READY in details:
            return LeaderNotReady(message)
        if meta.get(LEADER_KEY):
            # it does not lead, and names the leader it knows of (a hint: see
            # ClusterAgent._follow)
            return NotLeader(
                message,
                leader=node_name(str(meta[LEADER_KEY])),
                address=str(meta.get(LEADER_ADDRESS_KEY, "")),
            )
    elif code == grpc.StatusCode.INVALID_ARGUMENT:
        # it answered and refused the report (a field it does not take): reaching it
        # again mends nothing, so this is no unreachable leader
        return InvalidArgument(message)
    elif code == grpc.StatusCode.PERMISSION_DENIED:  # the report's node is not the certificate's
        return PermissionDenied(message)
    elif not error and "handshake" in details.lower():
        return HandshakeFailed(message)
    return Unavailable(message)


class PeerClient:
    """Reports to the leader over mutual TLS; see the module docstring."""

    def __init__(self, tls: PeerTls, *, timeout_s: float) -> None:
        self._credentials = tls.channel_credentials()
        self._timeout_s = timeout_s
        # a gpud before node names compared without case checks the name in a report
        # against the certificate's as spelled there: reports carry that spelling (a
        # leader of this version folds it to lower case)
        self._node_as_named = tls.node_as_named
        self._channels: dict[tuple[str, str], Any] = {}
        self._closing: set[asyncio.Task[None]] = set()  # old leaders' channels
        # names of the jobs the leader left out of the last report (the reason names the
        # job's place in the report, which moves as other jobs come and go)
        self._left_out: frozenset[str] = frozenset()

    async def _stub(self, address: str, leader: str) -> Any:
        key = (address, leader)
        channel = self._channels.get(key)
        if channel is None:
            # a new leader: the old channels go (taken out at once, so a concurrent call
            # finds the new channel, not one being closed). A call still waiting on one
            # (a report to the old leader while `gpuctl cluster status` dials the new
            # one) ends by its own deadline: a channel closed under it would cancel it,
            # an asyncio cancellation of the caller's task.
            old, self._channels = list(self._channels.values()), {}
            channel = grpc.aio.secure_channel(
                address,
                self._credentials,
                options=[
                    ("grpc.ssl_target_name_override", leader),
                    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                    ("grpc.initial_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                ],
            )
            self._channels[key] = channel
            for stale in old:
                task = asyncio.create_task(stale.close(grace=self._timeout_s))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        return pb_grpc.ClusterPeerStub(channel)

    async def report(self, address: str, leader: str, report: NodeReport) -> Order | None:
        named = self._node_as_named
        if named and named != report.node and node_name(named) == report.node:
            report = dataclasses.replace(report, node=named)
        try:
            response = await (await self._stub(address, leader)).Report(
                report_to_pb(report), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as err:
            raise report_error(err, leader, address) from err
        self._say_left_out(leader, response.left_out)
        return order_from_pb(response.order) if response.HasField("order") else None

    def _say_left_out(self, leader: str, left_out: Iterable[pb.LeftOutJob]) -> None:
        """One warning when the leader leaves out a job its last answer did not (it leaves
        them out every tick): their names it refuses, so no order names them."""
        jobs = [LeftOutJob(j.job, j.reason) for j in left_out]
        said, self._left_out = self._left_out, frozenset(j.job for j in jobs[:LEFT_OUT_KEPT])
        new = [j for j in jobs if j.job not in said]
        if new:
            log.warning(
                "cluster: leader %s left %d job(s) out of this node's report, the others"
                " taken, no order naming them; new since its last answer: %s",
                leader,
                len(jobs),
                left_out_said(new),
            )

    async def nodes(self, address: str, leader: str) -> list[NodeSeen]:
        try:
            response = await (await self._stub(address, leader)).GetNodes(
                pb.GetNodesRequest(), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as err:
            raise Unavailable(
                f"leader {leader} at {address}: {err.code().name} {err.details() or ''}".rstrip()
            ) from err
        return [_node_from_pb(n) for n in response.nodes]

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
