"""Cluster benchmarks: the leader's global order, one report round over mTLS, failover.

::

    python -m tools.bench_cluster                  # all three, a table
    python -m tools.bench_cluster --json           # the same figures as JSON
    python -m tools.bench_cluster --skip-failover  # no etcd / gpud processes
    python -m tools.bench_cluster --failover-only  # only the SIGKILLs of the leader
    python -m tools.bench_cluster --order-only     # the global order alone

1. **Global order**: :meth:`Aggregator.compute` over ``--jobs`` (10,000) jobs reported by
   ``--nodes`` (1,000) nodes, each job on ``--span`` (8) nodes, steady state (every node
   re-reported since the last round), LEVELLER re-ranking every round (the worst case).
   Beside it, in the same run, LEVELLER alone over the same rates (the policy's own cost,
   the floor for any global order) and a round with LEVELLER's default laziness (stable
   rates: no re-rank). Target <= 100 ms.
2. **One round on loopback**: a leader agent behind the real peer server (gRPC, mutual
   TLS) and ``--round-nodes`` (100) simulated nodes, each with its own TLS channel and
   about ``--jobs-per-node`` (80) jobs, each job on 8 nodes: the leader's round, then
   every node's report and answer, concurrently (the nodes run in the benchmark's process,
   sharing its CPU with the leader). Beside it: one node's report alone. Target <= 1 s.
3. **Failover**: three gpud processes (simulated nodes) on one etcd (lease TTL
   ``--ttl``); ``--kills`` (10) times SIGKILL the leader, then measure from the kill to the
   new leader's ``cluster.elected`` event and to the last survivor's ``cluster.epoch``
   event (the new order applied everywhere), from the daemons' own event logs.

Each part's figures are printed as it ends (with ``--json``, all in one JSON object at the
end). A SIGTERM or SIGINT stops it: its etcd and gpud processes stopped (those it started),
the parts done so far reported, "cut short by SIGNAL after N of M parts", dying by the signal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpud.cluster.agent import ClusterAgent
from gpud.cluster.api import PeerClient, PeerServer
from gpud.cluster.election import LeaderInfo
from gpud.cluster.leader import Aggregator
from gpud.cluster.model import JobReport, NodeReport
from gpud.cluster.ports import MemoryTagStore, StaticNodeView
from gpud.cluster.tls import PeerTls
from gpud.net.port import FakeTraffic
from netshaper.leveller import Leveller, LevellerConfig
from tools.simdaemon import cut_short, exit_as, restores_signals, stopped_by_signal


def _reports(jobs: int, nodes: int, span: int, seed: int = 1) -> list[NodeReport]:
    rng = random.Random(seed)
    per_node: list[list[JobReport]] = [[] for _ in range(nodes)]
    for j in range(jobs):
        first = rng.randrange(nodes)
        for k in range(span):
            per_node[(first + k) % nodes].append(
                JobReport(
                    f"job-{j:05}",
                    progress_rate=rng.uniform(0.1, 1.0),
                    iterations_per_s=rng.uniform(0.5, 5),
                    gpus=(f"GPU-{j}-{k}",),
                    tx_bytes=rng.randrange(1 << 30),
                )
            )
    return [NodeReport(f"node-{i:04}", tuple(js)) for i, js in enumerate(per_node)]


def bench_order(jobs: int, nodes: int, span: int, reps: int) -> dict[str, Any]:
    reports = _reports(jobs, nodes, span)
    config = LevellerConfig(levels=8, max_age_s=1e-9)  # re-rank every round: the worst case
    agg = Aggregator(
        leader="bench", leveller=Leveller(config), tags=MemoryTagStore(), node_timeout_s=1e9
    )
    for r in reports:
        agg.receive(r, 0.0)
    agg.compute(1, 0.0)  # first round: tag allocation
    rates: dict[str, float | None] = {}
    for r in reports:
        for jr in r.jobs:
            rate = jr.progress_rate
            old = rates.get(jr.job)
            rates[jr.job] = rate if old is None or (rate is not None and rate < old) else old
    leveller = Leveller(config)
    lazy = Aggregator(  # LEVELLER's default laziness: rates as stable as here, no re-rank
        leader="bench",
        leveller=Leveller(LevellerConfig(levels=8)),
        tags=MemoryTagStore(),
        node_timeout_s=1e9,
    )
    for r in reports:
        lazy.receive(r, 0.0)
    lazy.compute(1, 0.0)
    compute, compute_cpu, receive, policy, lazy_cpu = [], [], [], [], []
    for i in range(1, reps + 1):
        for r in reports:
            lazy.receive(r, float(i))
        c0 = time.thread_time()
        lazy.compute(1, float(i))
        lazy_cpu.append(time.thread_time() - c0)
        t0 = time.perf_counter()
        for r in reports:
            agg.receive(r, float(i))
        t1 = time.perf_counter()
        c0 = time.thread_time()
        agg.compute(1, float(i))
        c1 = time.thread_time()
        t2 = time.perf_counter()
        leveller.update(float(i), rates)
        t3 = time.perf_counter()
        receive.append(t1 - t0)
        compute.append(t2 - t1)
        compute_cpu.append(c1 - c0)
        policy.append(t3 - t2)
    c, p = statistics.median(compute), statistics.median(policy)
    return {
        "jobs": jobs,
        "nodes": nodes,
        "span": span,
        "compute_ms": c * 1e3,
        "compute_max_ms": max(compute) * 1e3,
        "compute_cpu_ms": statistics.median(compute_cpu) * 1e3,
        "compute_no_rerank_cpu_ms": statistics.median(lazy_cpu) * 1e3,
        "load_average": os.getloadavg()[0],
        "receive_all_ms": statistics.median(receive) * 1e3,
        "leveller_alone_ms": p * 1e3,
        "ratio_to_leveller": c / p,
        "target_ms": 100.0,
    }


class _Leading:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def state(self) -> LeaderInfo:
        return LeaderInfo("leader", "", epoch=1, leading=True)


async def _round(nodes: int, jobs_per_node: int, reps: int) -> dict[str, Any]:
    from tools.certs import make_ca, make_node

    with tempfile.TemporaryDirectory(prefix="gpud-bench-") as tmp:
        pki = Path(tmp)
        make_ca(pki)
        make_node(pki, "leader", pki)
        server_tls = PeerTls.load(pki / "ca.pem", pki / "leader.pem", pki / "leader-key.pem")
        agent = ClusterAgent(
            node="leader",
            election_kind="etcd",
            election=_Leading(),
            traffic=FakeTraffic(),
            view=StaticNodeView(),
            tag_store=lambda epoch, lease: MemoryTagStore(),
            leveller=LevellerConfig(levels=8),
            reserved_tags=(0, 46, 48, 56),
            peers=None,
            grace_s=30,
            fresh_s=3,
            node_timeout_s=1e9,
        )
        server = PeerServer("127.0.0.1:0", server_tls, agent)
        await server.start()
        address = f"127.0.0.1:{server.port}"
        reports = _reports(nodes * jobs_per_node // 8, nodes, 8, seed=2)
        clients = []
        for r in reports:  # each node its own certificate: a node reports only as itself
            cert, key = make_node(pki, r.node, pki)
            clients.append(PeerClient(PeerTls.load(pki / "ca.pem", cert, key), timeout_s=10))
        try:
            await agent.tick()
            await asyncio.gather(
                *(c.report(address, "leader", r) for c, r in zip(clients, reports, strict=True))
            )
            rounds, singles = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                await agent.tick()
                answers = await asyncio.gather(
                    *(c.report(address, "leader", r) for c, r in zip(clients, reports, strict=True))
                )
                t1 = time.perf_counter()
                assert all(a is not None for a in answers)
                await clients[0].report(address, "leader", reports[0])
                t2 = time.perf_counter()
                rounds.append(t1 - t0)
                singles.append(t2 - t1)
        finally:
            for c in clients:
                await c.close()
            await server.stop(None)
    round_s, single_s = statistics.median(rounds), statistics.median(singles)
    return {
        "nodes": nodes,
        "jobs": len({j.job for rep in reports for j in rep.jobs}),
        "round_ms": round_s * 1e3,
        "round_max_ms": max(rounds) * 1e3,
        "one_report_ms": single_s * 1e3,
        "ratio_to_one_report": round_s / single_s,
        "target_ms": 1000.0,
    }


def bench_failover(kills: int) -> dict[str, Any]:
    from tests.integration.cluster_support import TTL_S, Node, start_cluster
    from tests.integration.conftest import start_daemon, stop_daemon
    from tools.etcd_local import LocalEtcd

    elected, applied = [], []
    with tempfile.TemporaryDirectory(prefix="gpud-bench-") as tmp, LocalEtcd() as etcd:
        cluster = start_cluster(Path(tmp), etcd)
        try:
            cluster.wait(cluster.settled, what="settled")
            for _ in range(kills):
                ((leader, status),) = cluster.leaders()
                old = status["epoch"]
                killed_at = time.time()
                os.kill(leader.daemon.proc.pid, signal.SIGKILL)
                leader.daemon.proc.wait()
                survivors = cluster.live()

                def done(old: int = old, survivors: list[Node] = survivors) -> bool:
                    return all(
                        any(e["fields"]["epoch"] > old for e in n.events("cluster.epoch"))
                        for n in survivors
                    )

                cluster.wait(done, what="the new order everywhere")
                new_leader = next(n for n in survivors if n.status().get("leading"))
                t_elected = min(
                    e["time_unix_seconds"]
                    for e in new_leader.events("cluster.elected")
                    if e["fields"]["epoch"] > old
                )
                t_applied = max(
                    min(
                        e["time_unix_seconds"]
                        for e in n.events("cluster.epoch")
                        if e["fields"]["epoch"] > old
                    )
                    for n in survivors
                )
                elected.append(t_elected - killed_at)
                applied.append(t_applied - killed_at)
                # bring the node back as a follower
                stop_daemon(leader.daemon)
                config = (leader.daemon.root / "gpud.toml").read_text()
                leader.daemon = start_daemon(leader.daemon.root, "--simulate", config_text=config)
                cluster.wait(cluster.settled, what="settled again")
        finally:
            cluster.close()
    return {
        "kills": kills,
        "lease_ttl_s": TTL_S,
        "elected_median_s": statistics.median(elected),
        "elected_max_s": max(elected),
        "applied_median_s": statistics.median(applied),
        "applied_max_s": max(applied),
        "bound_s": 2 * TTL_S,
    }


@restores_signals
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_cluster")
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=1_000)
    parser.add_argument("--span", type=int, default=8)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--round-nodes", type=int, default=100)
    parser.add_argument("--jobs-per-node", type=int, default=80)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--skip-failover", action="store_true")
    parser.add_argument("--order-only", action="store_true", help="only the global order")
    parser.add_argument("--failover-only", action="store_true", help="only the failover")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.order_only and args.failover_only:
        parser.error("--order-only and --failover-only exclude each other")
    parts: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    if not args.failover_only:
        parts.append(("order", lambda: bench_order(args.jobs, args.nodes, args.span, args.reps)))
    if not args.order_only and not args.failover_only:
        parts.append(
            ("round", lambda: asyncio.run(_round(args.round_nodes, args.jobs_per_node, args.reps)))
        )
    if not args.skip_failover and not args.order_only:
        parts.append(("failover", lambda: bench_failover(args.kills)))
    result: dict[str, Any] = {}
    with stopped_by_signal() as stopped:
        print(f"measuring: {len(parts)} parts", file=sys.stderr, flush=True)
        for name, part in parts:
            result[name] = part()
            if not args.json:
                print(SHOWN[name].format(**result[name]), flush=True)
    if stopped.by:
        done, shown = f"{len(result)} of {len(parts)} parts", None if args.json else _nothing
        cleaned = cleaned_after([name for name, _ in parts])
        return cut_short(stopped.by, done, figures=result, show=shown, cleaned=cleaned)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


def cleaned_after(planned: list[str]) -> str:
    """What a run of the parts ``planned`` that was cut short cleaned up: the failover's etcd
    and gpud processes and the directories of it and the round, only those it would make."""
    if "failover" in planned:
        return "its etcd and gpud processes stopped, its directories removed"
    return "its directories removed" if "round" in planned else ""


def _nothing(figures: dict[str, Any]) -> None:
    """Each part's figures were printed as it ended."""


# each part's line, from its figures
SHOWN = {
    "order": "global order: {jobs} jobs over {nodes} nodes (x{span}): {compute_ms:.1f} ms"
    " median, {compute_max_ms:.1f} ms max, {compute_cpu_ms:.1f} ms CPU (target <= 100 ms;"
    " load average {load_average:.1f}); LEVELLER alone {leveller_alone_ms:.1f} ms (ratio"
    " {ratio_to_leveller:.2f}); a round without re-rank {compute_no_rerank_cpu_ms:.1f} ms CPU;"
    " receiving all reports {receive_all_ms:.1f} ms",
    "round": "one round, {nodes} nodes over mTLS on loopback, {jobs} jobs: {round_ms:.1f} ms"
    " median, {round_max_ms:.1f} ms max (target <= 1000 ms); one report alone"
    " {one_report_ms:.2f} ms (ratio {ratio_to_one_report:.1f})",
    "failover": "failover over {kills} SIGKILLs (lease TTL {lease_ttl_s} s, bound {bound_s} s):"
    " new leader {elected_median_s:.2f} s median, {elected_max_s:.2f} s max; new order applied"
    " everywhere {applied_median_s:.2f} s median, {applied_max_s:.2f} s max",
}


if __name__ == "__main__":
    exit_as(main())
