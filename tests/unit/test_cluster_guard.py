"""The leader's guarded writes against an etcd gateway on loopback that holds one leader
key and judges each txn by the compares it is sent, as etcd does: a key created at the
same revision on another lease (a fresh etcd numbers revisions from 1 again) is not the
writer's."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from gpud.cluster.etcd import EtcdClient, EtcdSettings
from gpud.cluster.tagstore import EtcdTagStore
from gpud.errors import FailedPrecondition
from tests.unit.test_cluster_etcd_endpoints import ETCD, _serve

LEADER = "/c/leader"


@dataclass
class Gateway:
    """One key, ``LEADER``, created at ``create_revision`` on ``lease``; ``written``: the
    keys the txns that succeeded put."""

    create_revision: int
    lease: int
    written: list[str] = field(default_factory=list)

    def __call__(self, path: str, request: bytes, token: str) -> tuple[int, str]:
        if path == "/v3/kv/txn":
            return 200, json.dumps(self.txn(json.loads(request)))
        return ETCD.get(path, (404, "404 page not found\n"))

    def txn(self, body: dict[str, Any]) -> dict[str, Any]:
        held = {"CREATE": self.create_revision, "LEASE": self.lease}
        names = {"CREATE": "create_revision", "LEASE": "lease"}
        ok = True
        for compare in body.get("compare", []):
            assert base64.b64decode(compare["key"]).decode() == LEADER
            assert compare["result"] == "EQUAL"
            target = compare["target"]
            ok &= int(compare[names[target]]) == held[target]
        if ok:
            for op in body.get("success", []):
                if "request_put" in op:
                    self.written.append(base64.b64decode(op["request_put"]["key"]).decode())
        return {"header": {"revision": "9"}, "succeeded": ok}


@pytest.fixture
def fresh_etcd() -> Iterator[tuple[Gateway, EtcdClient]]:
    """A new leader's key on a fresh etcd: created at revision 5, on lease 0x7e1."""
    gateway = Gateway(create_revision=5, lease=0x7E1)
    server = _serve(gateway)
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        yield gateway, EtcdClient(EtcdSettings(endpoints=(endpoint,)))
    finally:
        server.shutdown()
        server.server_close()


def test_a_deposed_leaders_tags_are_refused_by_a_new_leader_key_of_its_epoch(
    fresh_etcd: tuple[Gateway, EtcdClient],
) -> None:
    """The old leader's epoch is the new key's create revision; its lease is not the key's."""
    gateway, client = fresh_etcd
    deposed = EtcdTagStore(client, prefix="/c", epoch=5, lease=0x3A9)
    with pytest.raises(FailedPrecondition) as refused:
        deposed.save({"job-a": 10}, [])
    assert str(refused.value) == (
        "tags not saved: /c/leader is no longer the one of epoch 5 on lease 3a9"
    )
    assert gateway.written == []


def test_the_leader_holding_the_key_on_its_lease_saves_its_tags(
    fresh_etcd: tuple[Gateway, EtcdClient],
) -> None:
    gateway, client = fresh_etcd
    EtcdTagStore(client, prefix="/c", epoch=5, lease=0x7E1).save({"job-a": 10}, [])
    assert gateway.written == ["/c/tags/job-a"]
