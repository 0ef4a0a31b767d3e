"""Each node's cluster problem, where every node can read it.

A node that cannot reach the leader, or whose report or certificate the leader refuses,
is the one that knows why (the leader's TLS stack sees only a failed handshake). So each
node publishes its own ``last_error`` in etcd, ``<prefix>/problems/<node>`` = ``{"message":
..., "since": <Unix time>}`` (``etcdctl get --prefix <prefix>/problems/``), on a lease of
``ttl_s`` renewed by publishing again, and deletes it once the problem is gone: a node that
stops (or loses etcd too) drops out when its lease expires. ``gpuctl cluster status`` on
any node lists them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Protocol

from gpud.cluster.etcd import EtcdClient

log = logging.getLogger(__name__)

TTL_S = 30
REPUBLISH_S = 10.0  # well inside the lease: one missed round does not drop a problem


@dataclass(frozen=True, slots=True)
class Problem:
    node: str
    message: str
    since: float  # Unix time it began


class ProblemBoard(Protocol):
    def publish(self, node: str, message: str, since: float) -> None: ...

    def clear(self, node: str) -> None: ...

    def read(self) -> list[Problem]: ...


class EtcdProblemBoard:
    def __init__(self, client: EtcdClient, *, prefix: str, ttl_s: int = TTL_S) -> None:
        self._client = client
        self._prefix = prefix.rstrip("/") + "/problems/"
        self._ttl_s = ttl_s

    def publish(self, node: str, message: str, since: float) -> None:
        lease, _ = self._client.grant(self._ttl_s)
        value = json.dumps({"message": message, "since": since})
        self._client.put(self._prefix + node, value, lease=lease)

    def clear(self, node: str) -> None:
        self._client.delete(self._prefix + node)

    def read(self) -> list[Problem]:
        out = []
        for key, raw in sorted(self._client.get_prefix(self._prefix).items()):
            try:
                data = json.loads(raw)
                out.append(
                    Problem(
                        key.removeprefix(self._prefix), str(data["message"]), float(data["since"])
                    )
                )
            except (ValueError, KeyError, TypeError):
                log.debug("cluster: unreadable problem entry %s", key)
        return out
