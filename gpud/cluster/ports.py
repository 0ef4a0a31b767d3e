"""What the cluster agent needs from the rest of the node, as small Protocols with fakes.

* The node's traffic service is :class:`gpud.net.port.TrafficPort` (``local_report``,
  ``apply_order(epoch, levels, tags)``, ``clear_order``), with its fake
  :class:`gpud.net.port.FakeTraffic`.
* :class:`NodeView`: which GPUs each job holds here and which GPUs are unhealthy.
* :class:`TagStore`: where the leader keeps cluster-wide DSCP tags (etcd, or memory for
  a single node) so that a new leader hands out the same tags.
* :class:`StoreAlarms`: the alarms etcd has raised (``NOSPACE``: it refuses writes).

:class:`StaticNodeView`, :class:`MemoryTagStore` and :class:`StaticAlarms` are the public
fakes; a lone node keeps its tags in a :class:`MemoryTagStore`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from gpud.errors import Unavailable


class NodeView(Protocol):
    def job_gpus(self) -> Mapping[str, tuple[str, ...]]:
        """job -> GPU / MIG UUIDs it holds on this node."""
        ...

    def unhealthy_gpus(self) -> Mapping[str, str]:
        """UUID -> reason, for every GPU the last telemetry tick found lost or hung."""
        ...

    def critical_xids(self) -> Mapping[str, tuple[int, ...]]:
        """UUID -> the uncleared critical XID codes of the GPU under it, first raised first
        (``gpuctl xid``); devices without any are absent."""
        ...

    def links_up(self) -> bool | None:
        """Whether the node's enforced interfaces are up (None: none, or not known)."""
        ...


class TagStore(Protocol):
    def load(self) -> dict[str, int]:
        """job -> DSCP, as persisted."""
        ...

    def save(self, allocated: Mapping[str, int], released: list[str]) -> None:
        """Persist new allocations and releases (atomically where the store can)."""
        ...


class StoreAlarms(Protocol):
    def alarms(self) -> tuple[str, ...]:
        """The alarms raised, e.g. ``("NOSPACE",)`` (``etcdctl alarm list``); raises
        :class:`~gpud.errors.Unavailable` when the store cannot be read."""
        ...


@dataclass
class StaticNodeView:
    """A fixed view: ``gpus`` job -> UUIDs, ``unhealthy`` UUID -> reason, ``critical``
    UUID -> uncleared critical XID codes."""

    gpus: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unhealthy: dict[str, str] = field(default_factory=dict)
    critical: dict[str, tuple[int, ...]] = field(default_factory=dict)
    links: bool | None = None

    def job_gpus(self) -> Mapping[str, tuple[str, ...]]:
        return self.gpus

    def unhealthy_gpus(self) -> Mapping[str, str]:
        return self.unhealthy

    def critical_xids(self) -> Mapping[str, tuple[int, ...]]:
        return self.critical

    def links_up(self) -> bool | None:
        return self.links


@dataclass
class MemoryTagStore:
    """Tags kept in memory: enough when one node leads itself."""

    tags: dict[str, int] = field(default_factory=dict)

    def load(self) -> dict[str, int]:
        return dict(self.tags)

    def save(self, allocated: Mapping[str, int], released: list[str]) -> None:
        self.tags.update(allocated)
        for job in released:
            self.tags.pop(job, None)


@dataclass
class StaticAlarms:
    """Alarms set by hand; ``down``: the store cannot be read."""

    raised: tuple[str, ...] = ()
    down: bool = False

    def alarms(self) -> tuple[str, ...]:
        if self.down:
            raise Unavailable("etcd: connection refused")
        return self.raised
