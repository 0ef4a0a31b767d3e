"""Fencing and fail-static: which orders a node applies, and what it does without a leader.

* Epochs come from the election (an etcd revision: a new leader's is higher, except on an
  etcd restored from a snapshot or a fresh one, whose revisions start lower again). A node
  applies an order only if its epoch is >= the newest it has applied, and within one
  leadership only a newer ``seq``; an order from a deposed leader that is still talking is
  rejected. The exceptions are both the leader etcd names now, in the epoch it names: when
  etcd's revisions went back, and when a fresh etcd gave its key the very revision of the
  leadership in force (told apart by the leader key's lease, which the order carries).
* With no leader reachable a node keeps enforcing its last order (``holding``) and goes
  back to its local leveller only after ``grace_s`` without contact (``local``), so a
  leader failover or an etcd restart changes nothing on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gpud.cluster.model import Order


class Mode(StrEnum):
    LEADER = "leader"  # this node leads and applies its own orders
    FOLLOWER = "follower"  # applying a leader's orders
    HOLDING = "holding"  # no leader reachable: the last order stays in force
    LOCAL = "local"  # no leader for longer than the grace period: local policy


@dataclass
class Fence:
    """The newest (epoch, lease, seq) applied; see the module docstring. ``lease``: the
    leader key's etcd lease ID the order in force was signed with (0: an older leader's
    order, which carries none)."""

    epoch: int = 0
    seq: int = 0
    rejected: int = 0
    lease: int = 0

    def admit(self, order: Order, *, elected: int = 0) -> bool:
        """True (and remembered) if ``order`` may be applied; False counts a rejection.

        ``elected``: the epoch etcd names now for the order's leader, as this node read it
        (0: not that leader). An order of exactly that epoch is admitted even when lower
        than the newest applied: etcd's revisions went back (restored from a snapshot, or
        a new etcd), and no higher epoch can come; a deposed leader's is not the one
        etcd names. An order of the epoch in force on another lease of the leader key is
        another leadership (a fresh etcd gave its key the same create revision): admitted,
        whatever its seq (it numbers its orders from 1), only if it is the one etcd names,
        so a deposed leader's is refused whatever its seq. Without a lease on either order
        (an older leader) the seq is judged as within one leadership.
        """
        went_back = order.epoch < self.epoch and order.epoch == elected
        if self.other_leadership(order):
            stale = order.epoch != elected
        else:
            stale = not went_back and (
                order.epoch < self.epoch or (order.epoch == self.epoch and order.seq < self.seq)
            )
        if stale:
            self.rejected += 1
            return False
        self.epoch, self.seq, self.lease = order.epoch, order.seq, order.lease
        return True

    def other_leadership(self, order: Order) -> bool:
        """Whether ``order`` is of the epoch in force on another lease of the leader key
        (both known): another leadership, whose seq says nothing of the one in force."""
        return (
            order.epoch == self.epoch
            and order.lease != self.lease
            and 0 not in (order.lease, self.lease)
        )


class FailStatic:
    """Tracks the last order received (or computed, when leading) and says which
    :class:`Mode` the node is in.

    ``fresh_s``: an order younger than this means the node is following a live leader.
    """

    def __init__(self, grace_s: float, *, fresh_s: float) -> None:
        self.grace_s = grace_s
        self.fresh_s = fresh_s
        self.last_contact: float | None = None

    def contact(self, now: float) -> None:
        self.last_contact = now

    def mode(self, now: float, *, leading: bool, leader_known: bool = True) -> Mode:
        """``leader_known``: another node holds the leader key now; without one, a fresh
        order is still only kept (a leader that just stepped down has nobody to follow)."""
        if leading:
            return Mode.LEADER
        if self.last_contact is None:
            return Mode.LOCAL  # never had an order: the node's own policy
        age = now - self.last_contact
        if age <= self.fresh_s and leader_known:
            return Mode.FOLLOWER
        if age <= self.grace_s:
            return Mode.HOLDING
        return Mode.LOCAL
