"""What the cluster agent needs from the rest of the node, as small Protocols with fakes.

* :class:`TrafficPort`: the node's traffic service. ``local_report()`` gives this node's
  jobs with their progress, tags and counters; ``apply_order()`` enforces a global order
  (levels and tags) with its epoch; ``use_local_policy()`` hands enforcement back to the
  node's own leveller (after the fail-static grace period, or when clustering is off).
* :class:`NodeView`: which GPUs each job holds here and which GPUs are unhealthy.
* :class:`TagStore`: where the leader keeps cluster-wide DSCP tags (etcd, or memory for
  a single node) so that a new leader hands out the same tags.

:class:`FakeTraffic`, :class:`StaticNodeView` and :class:`MemoryTagStore` are the public
fakes: the unit tests and the benchmarks use them, and a daemon without a traffic service
runs on :class:`FakeTraffic` (it reports its jobs with unknown progress and records the
orders it is given, which ``gpuctl cluster status`` shows).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from gpud.cluster.model import JobReport


@dataclass(frozen=True, slots=True)
class AppliedOrder:
    """What a traffic service was last told to enforce."""

    epoch: int
    levels: Mapping[str, int]
    tags: Mapping[str, int]


class TrafficPort(Protocol):
    def local_report(self) -> list[JobReport]:
        """This node's jobs: progress, tag in use, link state and counters."""
        ...

    def apply_order(self, epoch: int, levels: Mapping[str, int], tags: Mapping[str, int]) -> None:
        """Enforce a global order (job -> level, job -> DSCP) computed in ``epoch``."""
        ...

    def use_local_policy(self) -> None:
        """Go back to this node's own leveller."""
        ...


class NodeView(Protocol):
    def job_gpus(self) -> Mapping[str, tuple[str, ...]]:
        """job -> GPU / MIG UUIDs it holds on this node."""
        ...

    def unhealthy_gpus(self) -> Mapping[str, str]:
        """UUID -> reason, for every GPU the last telemetry tick found lost or hung."""
        ...

    def last_xids(self) -> Mapping[str, int]:
        """UUID -> the last XID code seen on it (GPUs without XIDs are absent)."""
        ...


class TagStore(Protocol):
    def load(self) -> dict[str, int]:
        """job -> DSCP, as persisted."""
        ...

    def save(self, allocated: Mapping[str, int], released: list[str]) -> None:
        """Persist new allocations and releases (atomically where the store can)."""
        ...


@dataclass
class FakeTraffic:
    """A traffic service that enforces nothing: reports ``jobs`` and records orders."""

    jobs: list[JobReport] = field(default_factory=list)
    applied: AppliedOrder | None = None
    local_policy: bool = True
    history: list[AppliedOrder] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def local_report(self) -> list[JobReport]:
        with self._lock:
            return list(self.jobs)

    def apply_order(self, epoch: int, levels: Mapping[str, int], tags: Mapping[str, int]) -> None:
        order = AppliedOrder(epoch, dict(levels), dict(tags))
        with self._lock:
            self.applied = order
            self.local_policy = False
            self.history.append(order)

    def use_local_policy(self) -> None:
        with self._lock:
            self.local_policy = True


@dataclass
class StaticNodeView:
    """A fixed view: ``gpus`` job -> UUIDs, ``unhealthy`` UUID -> reason, ``xids``."""

    gpus: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unhealthy: dict[str, str] = field(default_factory=dict)
    xids: dict[str, int] = field(default_factory=dict)

    def job_gpus(self) -> Mapping[str, tuple[str, ...]]:
        return self.gpus

    def unhealthy_gpus(self) -> Mapping[str, str]:
        return self.unhealthy

    def last_xids(self) -> Mapping[str, int]:
        return self.xids


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
