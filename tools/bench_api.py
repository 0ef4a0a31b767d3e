"""The gRPC API's latency with one client and under 16 at once, beside a bare gRPC server.

Against a running ``gpud --simulate`` (8 x H100, MPS off, the daemon ticking as configured),
client processes call ``Node.GetStatus``, ``Node.ListGpus`` and ``Jobs.ListJobs`` in turn
over its unix socket for ``--seconds`` each, first one client alone, then ``--clients`` at
once. The same is done, in the same run, against the floor: a bare ``grpc.aio`` server in
its own process, on its own unix socket, that answers every call with the response gpud
gave (the same bytes on the wire, nothing computed). So ``gpud / floor`` is what gpud's own
work and its tick cost a caller beyond gRPC itself, under the same load on the same CPUs.

Figures per method: median and 99th percentile of the calls' latency, alone and under
load, and the calls per second served under load. Each of the four phases (gpud alone,
loaded, the floor alone, loaded) is printed as it ends. A SIGTERM or SIGINT stops it: its
clients, the floor and gpud stopped, its directories removed, "cut short by SIGNAL after
N of 4 phases", dying by it (128 + its number); with ``--json``, the phases done as its one JSON
object, with ``cut_short``.

    .venv/bin/python -m tools.bench_api [--clients 16] [--seconds 5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from gpud.v1 import jobs_pb2, jobs_pb2_grpc, node_pb2, node_pb2_grpc
from tools.simdaemon import (
    cut_short,
    exit_as,
    restores_signals,
    simulated_gpud,
    start_child,
    stop_children,
    stopped_by_signal,
)

METHODS = ("GetStatus", "ListGpus", "ListJobs")


def _calls(channel: grpc.Channel) -> dict[str, Any]:
    node = node_pb2_grpc.NodeStub(channel)
    jobs = jobs_pb2_grpc.JobsStub(channel)
    return {
        "GetStatus": lambda: node.GetStatus(node_pb2.GetStatusRequest(), timeout=30),
        "ListGpus": lambda: node.ListGpus(node_pb2.ListGpusRequest(), timeout=30),
        "ListJobs": lambda: jobs.ListJobs(jobs_pb2.ListJobsRequest(), timeout=30),
    }


def client(socket: str, seconds: float, start_at: float, out: str) -> None:
    """One client process: waits until ``start_at`` (wall clock, so that all start
    together), then calls the methods in turn for ``seconds``; latencies (s) to ``out``."""
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        calls = _calls(channel)
        for call in calls.values():
            call()  # connected and warm
        time.sleep(max(0.0, start_at - time.time()))
        seen: dict[str, list[float]] = {m: [] for m in METHODS}
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for method in METHODS:
                t0 = time.perf_counter()
                calls[method]()
                seen[method].append(time.perf_counter() - t0)
    Path(out).write_text(json.dumps(seen))


def floor_server(socket: str, responses: str) -> None:
    """A bare grpc.aio server answering every call with gpud's recorded response."""
    data = json.loads(Path(responses).read_text())
    status = node_pb2.GetStatusResponse.FromString(bytes.fromhex(data["GetStatus"]))
    gpus = node_pb2.ListGpusResponse.FromString(bytes.fromhex(data["ListGpus"]))
    listed = jobs_pb2.ListJobsResponse.FromString(bytes.fromhex(data["ListJobs"]))

    # The methods the clients do not call keep the generated servicer's (UNIMPLEMENTED),
    # named here because the generated stubs declare every method abstract.
    class Node(node_pb2_grpc.NodeServicer):
        async def GetStatus(  # noqa: N802
            self, request: node_pb2.GetStatusRequest, context: Any
        ) -> node_pb2.GetStatusResponse:
            return status

        async def ListGpus(  # noqa: N802
            self, request: node_pb2.ListGpusRequest, context: Any
        ) -> node_pb2.ListGpusResponse:
            return gpus

        ListEvents = node_pb2_grpc.NodeServicer.ListEvents
        WatchEvents = node_pb2_grpc.NodeServicer.WatchEvents
        InjectFault = node_pb2_grpc.NodeServicer.InjectFault
        RebootSim = node_pb2_grpc.NodeServicer.RebootSim
        SimWorkload = node_pb2_grpc.NodeServicer.SimWorkload
        ClearXid = node_pb2_grpc.NodeServicer.ClearXid

    class Jobs(jobs_pb2_grpc.JobsServicer):
        async def ListJobs(  # noqa: N802
            self, request: jobs_pb2.ListJobsRequest, context: Any
        ) -> jobs_pb2.ListJobsResponse:
            return listed

        AddJob = jobs_pb2_grpc.JobsServicer.AddJob
        RemoveJob = jobs_pb2_grpc.JobsServicer.RemoveJob
        Reserve = jobs_pb2_grpc.JobsServicer.Reserve
        Release = jobs_pb2_grpc.JobsServicer.Release
        GetJobEnv = jobs_pb2_grpc.JobsServicer.GetJobEnv

    async def serve() -> None:
        server = grpc.aio.server()
        node_pb2_grpc.add_NodeServicer_to_server(Node(), server)
        jobs_pb2_grpc.add_JobsServicer_to_server(Jobs(), server)
        server.add_insecure_port(f"unix:{socket}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def _record(socket: Path, out: Path) -> None:
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        calls = _calls(channel)
        out.write_text(json.dumps({m: calls[m]().SerializeToString().hex() for m in METHODS}))


def _run_clients(socket: Path, n: int, seconds: float, work: Path) -> dict[str, list[float]]:
    start_at = time.time() + 1.0 + 0.1 * n  # every client connected and warm by then
    outs = [work / f"client-{n}-{i}.json" for i in range(n)]
    argv = [sys.executable, "-m", "tools.bench_api", "--client", str(socket), str(seconds)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for out in outs:
            start_child(procs, [*argv, str(start_at), str(out)], stderr=None)
        for p in procs:
            if p.wait(seconds + 120) != 0:
                raise RuntimeError(f"a client exited with {p.returncode}")
    finally:
        # cut short: SIGTERM, quiet (a SIGINT has each print its traceback)
        stop_children(procs, signal.SIGTERM)
    merged: dict[str, list[float]] = {m: [] for m in METHODS}
    for out in outs:
        for method, values in json.loads(out.read_text()).items():
            merged[method].extend(values)
        out.unlink()
    return merged


def _summary(latencies: dict[str, list[float]], seconds: float) -> dict[str, dict[str, float]]:
    out = {}
    for method, values in latencies.items():
        cut = statistics.quantiles(values, n=100, method="inclusive")
        out[method] = {
            "calls": len(values),
            "p50_ms": statistics.median(values) * 1e3,
            "p99_ms": cut[98] * 1e3,
            "per_s": len(values) / seconds,
        }
    return out


PHASES = 4  # gpud alone, loaded; the floor alone, loaded


def measure(
    clients: int,
    seconds: float,
    result: dict[str, Any] | None = None,
    said: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The figures, filled into ``result`` phase by phase (what a run cut short has
    measured), each phase's told to ``said`` as it ends."""
    result = {} if result is None else result
    result.update(clients=clients, seconds=seconds, cpus=os.cpu_count(), phases=0)
    with (
        simulated_gpud("H100-SXM5-80GB:8") as daemon,
        tempfile.TemporaryDirectory(prefix="gpud-bench-api-") as tmp,
    ):
        work = Path(tmp)
        responses = work / "responses.json"
        _record(daemon.socket, responses)
        floor_socket = work / "floor.sock"
        started: list[subprocess.Popen[bytes]] = []
        argv = [sys.executable, "-m", "tools.bench_api", "--floor"]
        try:
            floor = start_child(started, [*argv, str(floor_socket), str(responses)], stderr=None)
            deadline = time.monotonic() + 30
            while not floor_socket.exists():
                if floor.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the floor server did not start")
                time.sleep(0.05)
            said(f"measuring: {PHASES} phases of {seconds:g} s")
            # side by side: alone and loaded, gpud then the floor
            for target, socket in (("gpud", daemon.socket), ("floor", floor_socket)):
                for load, n in (("alone", 1), ("loaded", clients)):
                    summary = _summary(_run_clients(socket, n, seconds, work), seconds)
                    result.setdefault(target, {})[load] = summary
                    result["phases"] += 1
                    said(_phase(target, load, n, summary))
        finally:
            stop_children(started, signal.SIGTERM)
    return result


def _phase(target: str, load: str, n: int, summary: dict[str, dict[str, float]]) -> str:
    return f"{target} {load} ({n} client{'s' if n > 1 else ''}): " + ", ".join(
        f"{method} p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms, {s['per_s']:.0f}/s"
        for method, s in summary.items()
    )


def _table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['clients']} clients, {result['seconds']:g} s per phase, {result['cpus']} CPUs",
        f"{'method':<10} {'':>6} {'p50 alone':>10} {'p99 alone':>10} {'p50 loaded':>11} "
        f"{'p99 loaded':>11} {'calls/s':>8}",
    ]
    for method in METHODS:
        for target in ("gpud", "floor"):
            a = result[target]["alone"][method]
            b = result[target]["loaded"][method]
            lines.append(
                f"{method:<10} {target:>6} {a['p50_ms']:>8.2f}ms {a['p99_ms']:>8.2f}ms "
                f"{b['p50_ms']:>9.2f}ms {b['p99_ms']:>9.2f}ms {b['per_s']:>8.0f}"
            )
        g, f = result["gpud"], result["floor"]
        lines.append(
            f"{'':<10} {'ratio':>6} {g['alone'][method]['p50_ms'] / f['alone'][method]['p50_ms']:>9.2f}x"
            f" {g['alone'][method]['p99_ms'] / f['alone'][method]['p99_ms']:>9.2f}x"
            f" {g['loaded'][method]['p50_ms'] / f['loaded'][method]['p50_ms']:>10.2f}x"
            f" {g['loaded'][method]['p99_ms'] / f['loaded'][method]['p99_ms']:>10.2f}x"
            f" {g['loaded'][method]['per_s'] / f['loaded'][method]['per_s']:>7.2f}x"
        )
    return "\n".join(lines)


@restores_signals
def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--client"]:
        client(args[1], float(args[2]), float(args[3]), args[4])
        return 0
    if args[:1] == ["--floor"]:
        floor_server(args[1], args[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(args)
    result: dict[str, Any] = {}

    def said(line: str) -> None:
        print(line, file=sys.stderr if ns.json else sys.stdout, flush=True)

    with stopped_by_signal() as stopped:
        measure(ns.clients, ns.seconds, result, said)
    if stopped.by:
        done = f"{result.get('phases', 0)} of {PHASES} phases"
        return cut_short(stopped.by, done, figures=result if ns.json else None)
    print(json.dumps(result, indent=2) if ns.json else _table(result))
    return 0


if __name__ == "__main__":
    exit_as(main())
