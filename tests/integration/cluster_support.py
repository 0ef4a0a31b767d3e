"""Several gpud processes on loopback forming one cluster over a real etcd."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.integration.conftest import BIN, RunningDaemon, start_daemon, stop_daemon
from tools.certs import make_ca, make_node
from tools.etcd_local import LocalEtcd

TTL_S = 2
TICK_S = 0.5


class Proxy:
    """A TCP relay from a loopback port to ``target``; :meth:`cut` partitions it
    (connections dropped, new ones closed at once), :meth:`heal` restores it."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._cut = False
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._cut:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self._cut = True
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def heal(self) -> None:
        self._cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()


# gpuctl cluster status: 0, or 11 while the nodes' problems are unknown or cannot be
# recorded (etcd unreachable from the node, or out of space)
STATUS_EXITS = (0, 11)


@dataclass
class Node:
    name: str
    daemon: RunningDaemon
    proxy: Proxy
    holders: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def status(self) -> dict[str, Any]:
        result = self.daemon.gpuctl("cluster", "status", "--json", check=False)
        if result.returncode not in STATUS_EXITS:
            return {}
        data: dict[str, Any] = json.loads(result.stdout)
        return data

    def status_text(self) -> str:
        """``gpuctl cluster status`` as an operator reads it."""
        result = self.daemon.gpuctl("cluster", "status", check=False)
        assert result.returncode in STATUS_EXITS, result.stderr
        return result.stdout

    def attributes(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(
            self.daemon.gpuctl("cluster", "attributes", "--json").stdout
        )
        return data

    def events(self, kind: str) -> list[dict[str, Any]]:
        out = self.daemon.gpuctl("events", "--kind", kind, "--json").stdout
        events: list[dict[str, Any]] = json.loads(out)["events"]
        return events

    def alive(self) -> bool:
        return self.daemon.proc.poll() is None


@dataclass
class Cluster:
    etcd: LocalEtcd
    nodes: list[Node]
    root: Path
    prefix: str

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.alive()]

    def leaders(self) -> list[tuple[Node, dict[str, Any]]]:
        return [(n, s) for n in self.live() if (s := n.status()).get("leading")]

    def wait(self, predicate: Callable[[], bool], timeout: float = 40.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        logs = "\n".join(f"--- {n.name}\n{n.daemon.log.read_text()[-3000:]}" for n in self.nodes)
        raise AssertionError(f"not reached in {timeout} s: {what}\n{logs}")

    def settled(self) -> bool:
        """One leader, and every live node applied an order of its epoch."""
        statuses = [n.status() for n in self.live()]
        leaders = [s for s in statuses if s.get("leading")]
        if len(leaders) != 1:
            return False
        epoch = leaders[0]["epoch"]
        return all(
            s.get("applied_epoch") == epoch and s.get("mode") in ("leader", "follower")
            for s in statuses
        )

    def run_job(self, node: Node, job: str) -> None:
        """A training job holding one GPU on ``node`` (a sleeping process under gpuctl run)."""
        proc = subprocess.Popen(
            [
                str(BIN / "gpuctl"),
                "--socket",
                str(node.daemon.socket),
                "run",
                "--job",
                job,
                "--gpus",
                "1",
                "--",
                "sleep",
                "600",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        node.holders.append(proc)

    def close(self) -> None:
        for n in self.nodes:
            for p in n.holders:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            stop_daemon(n.daemon)
            n.proxy.close()


def config_text(root: Path, name: str, etcd_port: int, prefix: str, pki: Path) -> str:
    return f"""
[daemon]
tick_s = {TICK_S}

[telemetry]
interval_s = {TICK_S}

[cluster]
election = "etcd"
node = "{name}"
listen = "127.0.0.1:0"
ca_file = "{pki / "ca.pem"}"
cert_file = "{pki / f"{name}.pem"}"
key_file = "{pki / f"{name}-key.pem"}"
etcd_endpoints = "http://127.0.0.1:{etcd_port}"
etcd_prefix = "{prefix}"
etcd_timeout_s = 0.5
lease_ttl_s = {TTL_S}
grace_s = 15.0
node_timeout_s = 3.0
report_timeout_s = 0.5
"""


def start_cluster(root: Path, etcd: LocalEtcd, n: int = 3) -> Cluster:
    pki = root / "pki"
    make_ca(pki)
    prefix = f"/gpud-test-{os.getpid()}-{time.monotonic_ns()}"
    cluster = Cluster(etcd, [], root, prefix)
    try:
        for i in range(n):
            name = f"n{i}"
            make_node(pki, name, pki)
            proxy = Proxy(("127.0.0.1", etcd.client_port))
            daemon = start_daemon(
                root / name,
                "--simulate",
                config_text=config_text(root, name, proxy.port, prefix, pki),
            )
            cluster.nodes.append(Node(name, daemon, proxy))
    except BaseException:
        cluster.close()
        raise
    return cluster
