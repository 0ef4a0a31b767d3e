"""Whether this node may lead: only with a certificate the other nodes accept.

The other nodes report to the leader over mutual TLS and verify its certificate against
*their* ``cluster.ca_file``. At start gpud checks this node's certificate against its own
CA file (:meth:`~gpud.cluster.tls.PeerTls.load`): signed by it, naming the node, valid
now. That cannot catch a node brought up with a PKI of its own (its ``ca_file`` is the other
CA): it passes its own check, every other node refuses it, and once it is elected no node
can report to anyone, so every node falls back to its local policy until it goes.

So each node records in etcd which CAs it verifies peers with, without a lease, so that the
record outlives the node (a node down now still refuses that certificate when it comes
back)::

    <prefix>/trust/<node> = {"ca_sha256": [...], "at": <Unix time written>}

``ca_sha256``: the SHA-256 of each CA certificate in its ``cluster.ca_file`` (DER, as
``openssl x509 -noout -fingerprint -sha256 -in ca.pem`` shows it); ``etcdctl get --prefix
<prefix>/trust/`` lists them. Before it campaigns, and every :data:`CHECK_S` while it
leads, a node asks :meth:`Candidacy.refusal`: its certificate has expired, or more of the
other recorded nodes trust none of its CAs than trust one of them. Then it does not
campaign, or steps down. A record not rewritten for :data:`STALE_S` (a node removed for
good) no longer counts; ``etcdctl del <prefix>/trust/NODE`` drops it at once. A running
node reads its own record every :data:`CHECK_S` and writes it again when it is gone, names
other CAs or is older than the one it wrote: a new etcd (its data directory lost) or one
restored from a snapshot (whose ``at`` may be near :data:`STALE_S`) would otherwise lack it
for up to :data:`REFRESH_S`, and a node of another PKI could lead. With a CA bundle (a
rotation), a node counts as trusted by a peer that trusts any CA of its bundle.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from typing import Protocol

from gpud.cluster.certexpiry import certificates_der
from gpud.cluster.etcd import EtcdClient

log = logging.getLogger(__name__)

CHECK_S = 10.0  # a leader reads the records, and every node its own, this often
REFRESH_S = 3600.0  # a node rewrites its record this often
STALE_S = 7 * 86400.0  # a record older than this is a node removed for good


class Candidacy(Protocol):
    def record(self) -> None:
        """Write this node's record when due; raises GpudError when etcd fails."""
        ...

    def refusal(self) -> str:
        """'' or why the other nodes would refuse this node as leader, with what to do;
        raises GpudError when etcd fails."""
        ...


def ca_fingerprints(pem: bytes) -> tuple[str, ...]:
    """SHA-256 (hex, lower case) of each certificate in ``pem``."""
    try:
        return tuple(sorted(hashlib.sha256(der).hexdigest() for der in certificates_der(pem)))
    except ValueError:  # parsed at start (PeerTls.load): not reached
        return ()


class EtcdCandidacy:
    """See the module docstring. Called from the election's thread only."""

    def __init__(
        self,
        client: EtcdClient,
        *,
        prefix: str,
        node: str,
        ca: bytes,
        ca_file: str,
        cert_file: str,
        expiry: Callable[[float], str],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._prefix = prefix.rstrip("/") + "/trust/"
        self.node = node
        self._trusted = ca_fingerprints(ca)
        self._ca_file = ca_file
        self._cert_file = cert_file
        self._expiry = expiry
        self._wall = wall
        self._written_at: float | None = None
        self._checked_at = 0.0  # (wall) when etcd was last read for this node's record
        self._lost_said = False  # a warning said the record was lost, none found it since

    def record(self) -> None:
        now = self._wall()
        if self._written_at is not None and now - self._written_at < REFRESH_S:
            if 0 <= now - self._checked_at < CHECK_S:
                return
            lost = self._record_lost(self._written_at)
            if not lost:
                self._lost_said = False
                return
            # a new etcd, one restored from a snapshot, or an etcdctl del: without the
            # record this node's CAs would not count for an hour, and a node of another
            # PKI could lead meanwhile. A second gpud under this node's name with other
            # CAs rewrites it back every check: said once, until a check finds it intact.
            say = log.debug if self._lost_said else log.warning
            say(
                "cluster: this node's trust record %s%s %s (a new etcd, one restored from a "
                "snapshot, or a second gpud under this node name?): written again",
                self._prefix,
                self.node,
                lost,
            )
            self._lost_said = True
        value = json.dumps({"ca_sha256": list(self._trusted), "at": now})
        self._client.put(self._prefix + self.node, value)
        self._written_at = self._checked_at = now

    def _record_lost(self, written_at: float) -> str:
        """ "" while etcd still holds this node's record as written at ``written_at``
        (read every :data:`CHECK_S`: one read, no revision), else how it is not."""
        self._checked_at = self._wall()
        kv = self._client.get(self._prefix + self.node)
        if kv is None:
            return "is gone from etcd"
        try:
            data = json.loads(kv.value)
            theirs = tuple(sorted(str(f) for f in data["ca_sha256"]))
            at = float(data["at"])
        except (ValueError, KeyError, TypeError):
            return "is unreadable in etcd"
        if theirs != self._trusted:
            return "names other CAs in etcd"
        # written with repr(float): it reads back equal. Only an older one is rewritten:
        # a second gpud under this name with the same CAs writes a newer one, and both
        # rewriting any other would make a revision every check
        if at < written_at:
            return f"is older in etcd than written (at {at:.0f}, written at {written_at:.0f})"
        return ""

    def refusal(self) -> str:
        expired = self._expiry(self._wall())
        if expired:
            return f"{expired}; it does not lead meanwhile"
        self.record()
        now = self._wall()
        mine = set(self._trusted)
        accept: list[str] = []
        refuse: list[str] = []
        for key, value in sorted(self._client.get_prefix(self._prefix).items()):
            node = key.removeprefix(self._prefix)
            if node == self.node:
                continue
            try:
                data = json.loads(value)
                theirs = {str(f) for f in data["ca_sha256"]}
                at = float(data["at"])
            except (ValueError, KeyError, TypeError):
                log.debug("cluster: unreadable trust record %s", key)
                continue
            if now - at > STALE_S:
                continue
            (accept if mine & theirs else refuse).append(node)
        if len(refuse) <= len(accept):
            return ""
        return (
            f"the other nodes would refuse this node's certificate: {', '.join(refuse)} "
            f"trust none of the CAs in its cluster.ca_file {self._ca_file} (etcdctl get "
            f"--prefix {self._prefix}), so it does not lead; replace cluster.cert_file "
            f"{self._cert_file} and cluster.ca_file with the cluster CA's and restart gpud "
            f"(openssl verify -CAfile CLUSTER-CA {self._cert_file} must say OK)"
        )
