"""A leader cut off from etcd steps down; while etcd stays out of reach its status says
why it stopped leading beside etcd's own failure."""

from __future__ import annotations

import pytest

from gpud.cli.main import main
from gpud.cluster.agent import ClusterAgent
from gpud.cluster.election import EtcdElection, LeaderInfo
from gpud.cluster.etcd import EtcdClient, KeyValue
from gpud.errors import Unavailable
from tests.unit.api_support import ServerThread
from tests.unit.cluster_support import Clock
from tests.unit.test_cluster_gpuctl import served  # noqa: F401  # the fixture
from tests.unit.test_cluster_suspend import TTL, ExpiringEtcd

DOWN = "etcd unreachable at http://10.0.0.9:2379 (Connection refused)"


class OutageEtcd(ExpiringEtcd):
    """Every call fails as an etcd out of reach while ``down``."""

    down = False

    def _reach(self) -> None:
        if self.down:
            raise Unavailable(DOWN)

    def keepalive(self, lease: int) -> int:
        self._reach()
        return super().keepalive(lease)

    def get(self, key: str) -> KeyValue | None:
        self._reach()
        return super().get(key)

    def revoke(self, lease: int) -> None:
        self._reach()
        super().revoke(lease)


def test_a_leader_cut_off_from_etcd_says_why_it_stepped_down_until_a_leader_is_known() -> None:
    now = Clock()
    etcd = OutageEtcd(now)
    client: EtcdClient = etcd  # type: ignore[assignment]  # the calls used, in memory
    election = EtcdElection(client, node="n0", address="n0:1", prefix="/c", ttl_s=TTL, clock=now)
    election.step()
    epoch = election.state().epoch
    etcd.down = True
    now.now += TTL  # past its deadline: the renewal fails, and it steps down
    election.step()
    election.step()  # as a follower: etcd still out of reach
    state = election.state()
    assert (state.leading, state.leader, state.epoch) == (False, "", epoch)
    assert state.detail == DOWN and state.store_state == "unreachable"
    assert state.stepped_down.startswith("cannot reach etcd before the lease could expire")
    etcd.down = False
    now.now += TTL  # etcd expired the lease meanwhile: the node is elected again
    election.step()
    assert election.state().leading and election.state().stepped_down == ""


class SteppedDown:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def state(self) -> LeaderInfo:
        why = f"cannot reach etcd before the lease could expire: {DOWN}"
        return LeaderInfo("", "", 12, False, False, DOWN, "unreachable", stepped_down=why)


def test_status_of_a_former_leader_cut_off_from_etcd_says_why_it_stepped_down(
    capsys: pytest.CaptureFixture[str],
    served: tuple[str, ClusterAgent, ServerThread],  # noqa: F811
) -> None:
    sock, agent, _ = served
    agent.election = SteppedDown()
    main(["cluster", "status", "--socket", sock], env={})
    out = capsys.readouterr().out
    assert "leader:      none known, epoch 12\n" in out
    assert (
        "stood down:  this node led epoch 12: cannot reach etcd before the lease could expire:"
        f" {DOWN}\n" in out
    )
    assert f"detail:      {DOWN}\n" in out
