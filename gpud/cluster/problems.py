"""Each node's cluster problem, where every node can read it.

A node that cannot reach the leader, or whose report or certificate the leader refuses,
is the one that knows why (the leader's TLS stack sees only a failed handshake). So each
node publishes its own ``last_error`` in etcd, ``<prefix>/problems/<node>`` = ``{"message":
..., "kind": ..., "since": <Unix time>, "for_s": <seconds it has lasted>, "mode": ...,
"gpud": "<host> pid <pid>"}`` (``etcdctl get --prefix <prefix>/problems/``), on a lease of
``ttl_s`` renewed by publishing again, and revokes that lease once the problem is gone: the
entry goes with it, unless another gpud under the node's name wrote the key since, on its
own lease. The entry keeps one lease for as long as it lasts (``etcdctl lease list``: one
per node with a problem); a clean stop revokes it, so the entry goes at once, and a node
killed (or cut off from etcd) drops out when the lease expires.
``gpuctl cluster status`` on any node lists them. ``kind`` is the node's
``last_error_kind`` (``leader_unreachable``, ``tls_handshake``...), for scripts to branch
on rather than on the message's words; an entry of an older gpud has none (read as None).
``mode`` is the node's (``holding``, ``local``...), ``gpud`` the host and process that wrote it.

A gpud refused because another reports under its node name (two gpuds configured with one
``cluster.node``) publishes under ``<prefix>/problems/<node>/<instance>`` instead, its
instance being the random one its reports carry: the gpud the leader takes keeps
``<node>`` for its own problems, and neither overwrites nor clears the other's.

Nodes' clocks may disagree by hours, so a reader does not take ``since`` as it stands: it
takes ``for_s`` at the write, plus how long ago the write was (the lease renewed with it
has run that long: its TTL granted less its TTL left), back from its own clock. An entry
of an older gpud, without ``for_s``, is read by its ``since``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gpud.cluster.etcd import EtcdClient, KeyValue

log = logging.getLogger(__name__)

TTL_S = 30
REPUBLISH_S = 10.0  # well inside the lease: one missed round does not drop a problem


@dataclass(frozen=True, slots=True)
class Problem:
    node: str
    message: str
    since: float  # Unix time it began, by the reader's clock
    kind: str | None = None  # its last_error_kind (None: published by an older gpud)
    # the publishing gpud's instance when the entry is keyed by it (a gpud refused under
    # another's node name); "" for a node's own entry
    instance: str = ""
    gpud: str = ""  # "<host> pid <pid>" of the gpud that wrote it ("" from an older gpud)
    mode: str | None = None  # the node's mode as it wrote it (None: an older gpud)


@dataclass(frozen=True, slots=True)
class Writer:
    """The gpud that publishes an entry, and what its node does meanwhile."""

    # keys the entry, under the node's name: a gpud refused as a second one under it; ""
    # for the node's own entry
    instance: str = ""
    mode: str = ""  # holding, local...
    gpud: str = ""  # "<host> pid <pid>"


NODE = Writer()  # the node's own entry, with no more said


class ProblemBoard(Protocol):
    def publish(self, node: str, message: str, since: float, kind: str, by: Writer = NODE) -> None:
        """``node``'s entry, or with ``by.instance`` the entry of that gpud under
        ``node``'s name."""
        ...

    def clear(self, node: str, *, instance: str = "") -> None:
        """Withdraw what this process published as ``node``'s entry (or its instance's):
        an entry another gpud wrote under the key since stays."""
        ...

    def read(self) -> list[Problem]: ...

    def close(self) -> None:
        """A clean stop: drop what this node published, now rather than at its lease's end."""
        ...


class EtcdProblemBoard:
    """Called from the agent's round, and from its stop: one at a time (a lock), and
    nothing published once closed (a round left running at the stop would otherwise grant
    a new lease and put the entry back for a lease's time)."""

    def __init__(
        self,
        client: EtcdClient,
        *,
        prefix: str,
        ttl_s: int = TTL_S,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._prefix = prefix.rstrip("/") + "/problems/"
        self._ttl_s = ttl_s
        self._wall = wall
        self._leases: dict[str, int] = {}  # the entry's key (less the prefix) -> its lease
        self._lock = threading.Lock()
        self._closed = False

    def publish(self, node: str, message: str, since: float, kind: str, by: Writer = NODE) -> None:
        with self._lock:
            if not self._closed:
                # for_s by this node's clock alone, so that a reader need not share it
                lasted = max(0.0, self._wall() - since)
                entry = {"message": message, "kind": kind, "since": since, "for_s": lasted}
                self._publish(_key(node, by.instance), {**entry, "mode": by.mode, "gpud": by.gpud})

    def _publish(self, key: str, entry: dict[str, object]) -> None:
        # Renew the entry's lease rather than grant one per publish: every grant would
        # leave the previous lease alive, keyless, for the rest of its TTL.
        lease = self._leases.get(key, 0)
        if lease and self._client.keepalive(lease) <= 0:
            lease = 0  # expired meanwhile (etcd was unreachable for a TTL)
        if not lease:
            lease, _ = self._client.grant(self._ttl_s)
            self._leases[key] = lease
        self._client.put(self._prefix + key, json.dumps(entry), lease=lease)

    def clear(self, node: str, *, instance: str = "") -> None:
        key = _key(node, instance)
        with self._lock:
            # Revoking this process's lease takes the entry only while that lease still
            # holds it: another gpud under the node's name (two configured with one
            # cluster.node) may have written the key since on its own lease, and its entry
            # stays. A key this process never wrote is not its to take.
            self._revoke(key)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for key in list(self._leases):
                self._revoke(key)

    def _revoke(self, key: str) -> None:
        lease = self._leases.get(key)
        if lease:
            self._client.revoke(lease)  # the entry goes with it
            del self._leases[key]

    def read(self) -> list[Problem]:
        out = []
        for key, kv in sorted(self._client.get_prefix_kvs(self._prefix).items()):
            try:
                data = json.loads(kv.value)
                message, since = str(data["message"]), float(data["since"])
                lasted = data.get("for_s")
                kind, mode, gpud = data.get("kind"), data.get("mode"), data.get("gpud")
            except (ValueError, KeyError, TypeError, AttributeError):
                log.debug("cluster: unreadable problem entry %s", key)
                continue
            if isinstance(lasted, int | float) and not isinstance(lasted, bool):
                since = self._wall() - float(lasted) - self._written_ago(kv)
            kind = kind if isinstance(kind, str) else None  # an older gpud writes none
            node, _, instance = key.removeprefix(self._prefix).partition("/")
            out.append(
                Problem(
                    node,
                    message,
                    since,
                    kind,
                    instance=instance,
                    gpud=gpud if isinstance(gpud, str) else "",
                    mode=mode if isinstance(mode, str) and mode else None,
                )
            )
        return out

    def _written_ago(self, kv: KeyValue) -> float:
        """Seconds since ``kv`` was written, by its lease (renewed at each write); etcd
        says whole seconds left, rounded down, hence the second taken back."""
        if not kv.lease:
            return 0.0
        left, granted = self._client.time_to_live(kv.lease)
        return max(0.0, float(granted - left - 1)) if left > 0 else 0.0


def _key(node: str, instance: str) -> str:
    """An entry's key under the prefix: node names are DNS names, never with a slash."""
    return f"{node}/{instance}" if instance else node
