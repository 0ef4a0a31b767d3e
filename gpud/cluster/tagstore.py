"""Cluster-wide DSCP tags in etcd: ``<prefix>/tags/<job>`` = the DSCP, as a decimal string.

Only the leader writes, in one transaction per round that also checks that the leader
key is still the one of its epoch, held by its lease (a fresh etcd numbers its revisions
from 1 again, so an epoch alone may match a newer leader's key): a deposed leader's
writes fail and change nothing
(``etcdctl get --prefix <prefix>/tags/`` lists the allocations).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from gpud.cluster.etcd import EtcdClient
from gpud.errors import FailedPrecondition

log = logging.getLogger(__name__)

TXN_OPS = 128


class EtcdTagStore:
    def __init__(self, client: EtcdClient, *, prefix: str, epoch: int, lease: int) -> None:
        """``epoch``: the leader key's create revision; ``lease``: the ID of the lease the
        leader created it on (``etcdctl lease list``)."""
        self._client = client
        self._tags = prefix.rstrip("/") + "/tags/"
        self._leader_key = prefix.rstrip("/") + "/leader"
        self._epoch = epoch
        self._lease = lease

    def load(self) -> dict[str, int]:
        tags: dict[str, int] = {}
        for key, value in self._client.get_prefix(self._tags).items():
            try:
                tags[key.removeprefix(self._tags)] = int(value)
            except ValueError:
                log.warning("ignoring %s: %r is not a DSCP", key, value)
        return tags

    def save(self, allocated: Mapping[str, int], released: list[str]) -> None:
        puts = [(self._tags + job, str(dscp)) for job, dscp in allocated.items()]
        deletes = [self._tags + job for job in released]
        # etcd refuses transactions of more than 128 operations (--max-txn-ops)
        for start in range(0, max(len(puts), len(deletes)), TXN_OPS // 2):
            chunk = slice(start, start + TXN_OPS // 2)
            ok = self._client.guarded_update(
                self._leader_key, self._epoch, self._lease, dict(puts[chunk]), deletes[chunk]
            )
            if not ok:
                raise FailedPrecondition(
                    f"tags not saved: {self._leader_key} is no longer the one of epoch "
                    f"{self._epoch} on lease {self._lease:x}"
                )
