"""The cluster, built from ``[cluster]`` and started with the daemon.

``single`` (the default): the node leads itself; no peer API, no etcd, tags in memory
(the traffic service persists its own). ``etcd``: the peer API on ``cluster.listen`` with
mutual TLS, an :class:`~gpud.cluster.election.EtcdElection` whose leader key carries the
advertised peer address, and tags in etcd.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable
from pathlib import Path

from gpud.clock import call_after, elapsed
from gpud.cluster.agent import ClusterAgent
from gpud.cluster.api import ClusterServicer, PeerClient, PeerServer
from gpud.cluster.certexpiry import CertWatch
from gpud.cluster.election import Election, EtcdElection, SingleElection
from gpud.cluster.etcd import EtcdClient, EtcdSettings
from gpud.cluster.model import node_name
from gpud.cluster.ports import MemoryTagStore, NodeView, TagStore
from gpud.cluster.problems import EtcdProblemBoard
from gpud.cluster.tagstore import EtcdTagStore
from gpud.cluster.tls import PeerTls, read_cluster_file
from gpud.cluster.trust import EtcdCandidacy
from gpud.config import ClusterConfig, parse_address
from gpud.events import EventLog
from gpud.net.port import TrafficPort
from netshaper.leveller import LevellerConfig

log = logging.getLogger(__name__)

# seconds a stop waits at most for a cluster round under way (a report in flight: it ends by
# its deadline, report_timeout_s), meanwhile the daemon answers its calls; before the
# shutdown hooks, so that the cluster's (giving up the leadership, withdrawing this node's
# problem) has its share whole
ROUND_STOP_WAIT_S = 3.0


def etcd_settings(c: ClusterConfig) -> EtcdSettings:
    password = ""
    if c.etcd_password_file is not None:
        raw = read_cluster_file(c.etcd_password_file, "cluster.etcd_password_file")
        password = raw.decode("utf-8", errors="replace").strip()
    return EtcdSettings(
        endpoints=tuple(e.strip().rstrip("/") for e in c.etcd_endpoints.split(",") if e.strip()),
        ca_file=str(c.etcd_ca_file or ""),
        cert_file=str(c.etcd_cert_file or ""),
        key_file=str(c.etcd_key_file or ""),
        username=c.etcd_username,
        password=password,
        password_file=str(c.etcd_password_file or ""),
        timeout_s=c.etcd_timeout_s,
    )


def cert_files(
    c: ClusterConfig, tls: PeerTls | None = None
) -> dict[str, tuple[Path, bytes | None]]:
    """The certificates to watch: the peer API's as loaded (``tls``: gRPC holds those
    bytes; None: from disk, as ``gpud --check-config`` reads them), etcd's from disk (its
    HTTP client reads the files again for every new connection)."""
    files: dict[str, tuple[Path, bytes | None]] = {}
    if c.ca_file is not None:
        files["cluster.ca_file"] = (c.ca_file, tls.ca if tls is not None else None)
    if c.cert_file is not None:
        files["cluster.cert_file"] = (c.cert_file, tls.cert if tls is not None else None)
    if c.etcd_ca_file is not None:
        files["cluster.etcd_ca_file"] = (c.etcd_ca_file, None)
    if c.etcd_cert_file is not None:
        files["cluster.etcd_cert_file"] = (c.etcd_cert_file, None)
    return files


class ClusterRuntime:
    def __init__(
        self,
        config: ClusterConfig,
        *,
        traffic: TrafficPort,
        view: NodeView,
        leveller: LevellerConfig,
        reserved_tags: Iterable[int],
        tick_s: float,
        events: EventLog,
        build: str = "",
    ) -> None:
        """``build``: the identity of the code this gpud runs (:mod:`gpud.build`), sent to
        the leader in every report."""
        self.config = config
        # lower case: how every node names it (reports, the leader key, gpuctl cluster)
        self.node = node_name(config.node or socket.gethostname())
        self._events = events
        self._peer_server: PeerServer | None = None
        self._kicker: asyncio.Task[None] | None = None
        self._peer_client: PeerClient | None = None
        self._etcd: EtcdClient | None = None
        election: Election
        certs: CertWatch | None = None
        if config.election == "etcd":
            tls = PeerTls.load(config.ca_file, config.cert_file, config.key_file, node=self.node)
            certs = CertWatch(cert_files(config, tls))
            self._etcd = EtcdClient(etcd_settings(config))
            self._peer_client = PeerClient(tls, timeout_s=config.report_timeout_s)
            self._election: EtcdElection | None = EtcdElection(
                self._etcd,
                node=self.node,
                address="",  # set once the peer API is bound
                prefix=config.etcd_prefix,
                ttl_s=config.lease_ttl_s,
                notify=self._emit,
                candidacy=EtcdCandidacy(
                    self._etcd,
                    prefix=config.etcd_prefix,
                    node=self.node,
                    ca=tls.ca,
                    ca_file=str(config.ca_file),
                    cert_file=tls.cert_file,
                    expiry=tls.expiry_problem,
                ),
            )
            election = self._election
            self._tls: PeerTls | None = tls
        else:
            self._election = None
            self._tls = None
            election = SingleElection(self.node)
        memory = MemoryTagStore()

        def tag_store(epoch: int, lease: int) -> TagStore:
            if self._etcd is None:
                return memory
            return EtcdTagStore(self._etcd, prefix=config.etcd_prefix, epoch=epoch, lease=lease)

        self.agent = ClusterAgent(
            node=self.node,
            election_kind=config.election,
            election=election,
            traffic=traffic,
            view=view,
            tag_store=tag_store,
            leveller=leveller,
            reserved_tags=reserved_tags,
            peers=self._peer_client,
            grace_s=config.grace_s,
            node_timeout_s=config.node_timeout_s,
            fresh_s=_fresh_s(config, tick_s),
            settle_s=_settle_s(config, tick_s),
            events=events,
            build=build,
            credential_problem=self._tls.expiry_problem if self._tls is not None else None,
            problems=(
                EtcdProblemBoard(self._etcd, prefix=config.etcd_prefix)
                if self._etcd is not None
                else None
            ),
            alarms=self._etcd,
            certs=certs,
        )
        self.servicer = ClusterServicer(self.agent)

    def set_tick(self, tick_s: float) -> None:
        """The daemon's tick changed (a reload of ``daemon.tick_s``): so do the times the
        agent derives from it."""
        self.agent.retime(
            fresh_s=_fresh_s(self.config, tick_s), settle_s=_settle_s(self.config, tick_s)
        )

    def _emit(self, kind: str, message: str, fields: dict[str, object]) -> None:
        self._events.emit(kind, message, **fields)

    @property
    def peer_port(self) -> int | None:
        return self._peer_server.port if self._peer_server is not None else None

    async def start(self) -> None:
        """Bind the peer API, then campaign with its address."""
        if self._election is None or self._tls is None:
            return
        self._peer_server = PeerServer(self.config.listen, self._tls, self.agent)
        await self._peer_server.start()
        if self.config.advertise:
            address = self.config.advertise
        else:
            host, _ = parse_address(self.config.listen, path="config", key="cluster.listen")
            if host in ("0.0.0.0", "::"):
                host = socket.getfqdn()
            address = f"[{host}]:{self.peer_port}" if ":" in host else f"{host}:{self.peer_port}"
        self._election.address = address
        loop = asyncio.get_running_loop()
        self._kick = asyncio.Event()
        kick = self._kick

        def on_change() -> None:
            # at once, not at the round it kicks: a round reads only the election's latest
            # view, and another node's leadership between two of this node's is to be seen
            self.agent.seen_leader()
            loop.call_soon_threadsafe(kick.set)

        def request_round(delay: float) -> None:  # on the loop (servicer, tick)
            # by the agent's clock: a leadership that settles across a suspend orders at
            # the resume, not once the loop's timer has run its full delay after it
            call_after(loop, delay, kick.set, elapsed)

        self._election.on_change = on_change
        self.agent.request_round = request_round
        self._kicker = asyncio.create_task(self._tick_on_change(), name="cluster-kick")
        self._election.start()
        log.info("cluster: node %s campaigning on etcd, peer address %s", self.node, address)

    async def _tick_on_change(self) -> None:
        """A new leader or epoch, or a node new to this leader: a round now rather than at
        the next tick, so a failover reaches every node within a fraction of a tick."""
        while True:
            await self._kick.wait()
            self._kick.clear()
            try:
                await self.agent.tick()
            except Exception:
                log.exception("cluster round after a leader change failed")

    def round_stop_wait_s(self) -> float:
        """Seconds a stop waits for the round under way (Daemon.run): its report's
        deadline, ROUND_STOP_WAIT_S at most."""
        return min(self.config.report_timeout_s + 0.5, ROUND_STOP_WAIT_S)

    def cut(self) -> None:
        """No round from now, a leader's included, and none at a leader change: at a second
        SIGTERM/SIGINT, which skips :meth:`stop`, so that no round runs while the store and
        the driver close. No I/O: the leadership and this node's problem are left to their
        lease."""
        self.agent.end_rounds()
        if self._kicker is not None:
            self._kicker.cancel()

    async def stop(self) -> None:
        """The daemon's shutdown hook: the round under way was waited for before (by then
        ended, or left running), so at once no round (:meth:`cut`), then give up the
        leadership (a successor is elected now, not at the lease's end) and withdraw this
        node's problem."""
        self.cut()
        if self._election is not None:
            await asyncio.to_thread(self._election.stop)
        await self.agent.close()
        if self._peer_server is not None:
            await self._peer_server.stop()
        if self._peer_client is not None:
            await self._peer_client.close()

    async def tick(self) -> None:
        await self.agent.tick()


def _fresh_s(config: ClusterConfig, tick_s: float) -> float:
    """An order younger than three of the daemon's ticks and a report's time is fresh."""
    return 3 * tick_s + config.report_timeout_s


def _settle_s(config: ClusterConfig, tick_s: float) -> float:
    """A new leader waits for every node's report before its first order (one tick, and the
    report's own time); alone (single), there is nobody to wait for."""
    return tick_s + config.report_timeout_s if config.election == "etcd" else 0.0
