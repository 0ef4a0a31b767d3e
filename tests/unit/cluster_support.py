"""The cluster agent for tests: a fixed election, a clock, peers that deliver reports
in-process, and an agent over a fake traffic service."""

from __future__ import annotations

from collections.abc import Callable

from gpud.cluster.agent import ClusterAgent
from gpud.cluster.certexpiry import CertWatch
from gpud.cluster.election import LeaderInfo
from gpud.cluster.leader import NodeSeen
from gpud.cluster.model import NodeReport, Order
from gpud.cluster.ports import MemoryTagStore, StaticNodeView, StoreAlarms, TagStore
from gpud.cluster.problems import ProblemBoard
from gpud.errors import Unavailable
from gpud.events import EventLog
from gpud.net.port import JobTraffic, TrafficPort
from netshaper.leveller import LevellerConfig


class FixedElection:
    def __init__(self, info: LeaderInfo) -> None:
        self.info = info

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def state(self) -> LeaderInfo:
        return self.info


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class LoopbackPeers:
    """Delivers reports straight to the leader agent, or fails like an unreachable one."""

    def __init__(self) -> None:
        self.leader: ClusterAgent | None = None
        self.forced: Order | None = None

    async def report(self, address: str, leader: str, report: NodeReport) -> Order | None:
        if self.forced is not None:
            return self.forced
        if self.leader is None:
            raise Unavailable(f"leader {leader} at {address}: UNAVAILABLE")
        return self.leader.receive(report)

    async def nodes(self, address: str, leader: str) -> list[NodeSeen]:
        if self.leader is None:
            raise Unavailable(f"leader {leader} at {address}: UNAVAILABLE")
        return self.leader.seen_nodes()


class RoutedPeers:
    """Delivers each report to the agent at its address, as mTLS would only to the node
    its certificate names; an address nobody listens on is unreachable."""

    def __init__(self) -> None:
        self.at: dict[str, ClusterAgent] = {}
        self.asked: list[str] = []
        self.asked_nodes: list[str] = []

    async def report(self, address: str, leader: str, report: NodeReport) -> Order | None:
        self.asked.append(leader)
        target = self.at.get(address)
        if target is None or target.node != leader:
            raise Unavailable(f"leader {leader} at {address}: UNAVAILABLE")
        return target.receive(report)

    async def nodes(self, address: str, leader: str) -> list[NodeSeen]:
        self.asked_nodes.append(leader)
        target = self.at.get(address)
        if target is None or target.node != leader:
            raise Unavailable(f"leader {leader} at {address}: UNAVAILABLE")
        return target.seen_nodes()


def job(name: str, rate: float | None) -> JobTraffic:
    return JobTraffic(
        job=name,
        dscp=10,
        level=None,
        rate=rate,
        iterations=None,
        iteration_s=0.5,
        contention_free_iteration_s=None,
        last_report_unix_s=None,
    )


def agent(
    name: str,
    info: LeaderInfo,
    traffic: TrafficPort,
    peers: LoopbackPeers | RoutedPeers,
    clock: Clock,
    *,
    view: StaticNodeView | None = None,
    store: TagStore | None = None,
    tag_store: Callable[[int, int], TagStore] | None = None,
    credential_problem: Callable[[float], str] | None = None,
    settle_s: float = 0.0,
    problems: ProblemBoard | None = None,
    wall: Callable[[], float] = lambda: 1.7e9,
    alarms: StoreAlarms | None = None,
    events: EventLog | None = None,
    certs: CertWatch | None = None,
) -> ClusterAgent:
    tags: TagStore = store or MemoryTagStore()
    return ClusterAgent(
        node=name,
        election_kind="etcd",
        election=FixedElection(info),
        traffic=traffic,
        view=view or StaticNodeView(),
        tag_store=tag_store or (lambda epoch, lease: tags),
        leveller=LevellerConfig(levels=4),
        reserved_tags=(0, 46, 48, 56),
        peers=peers,
        grace_s=30,
        fresh_s=3,
        node_timeout_s=5,
        settle_s=settle_s,
        clock=clock,
        wall=wall,
        credential_problem=credential_problem,
        problems=problems,
        alarms=alarms,
        events=events,
        certs=certs,
    )
