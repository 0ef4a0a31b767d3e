"""Who leads, and in which epoch.

* :class:`SingleElection` (``cluster.election = "single"``, the default): the node leads
  itself in epoch 1; nothing to configure.
* :class:`EtcdElection`: campaign by creating ``<prefix>/leader`` attached to a lease of
  ``lease_ttl_s`` (``etcdctl lease timetolive``), if absent; the key's create revision is the
  epoch (etcd revisions only grow, so a new leader's epoch is higher, except on an etcd
  restored from a snapshot or a fresh one: revisions start lower, and a new key may get
  the create revision of the one before, never its lease). The leader
  renews the lease every ``ttl/4`` and counts its leadership as valid only until
  ``last renewal sent + TTL - margin``: a leader cut off from etcd stops leading before
  etcd can expire its lease and let another node in, so two leaders never overlap.
  The deadline is kept on :data:`gpud.clock.elapsed`, which counts the time the host was
  suspended as etcd does: a leader resumed past it stops leading at once, before its next
  renewal (which fails, or renews a lease that etcd still keeps).
  Between steps (every ``ttl/4``) both watch the key (``etcdctl watch``): a follower
  campaigns as soon as it is gone, a leader notices at once that it lost it.
  A node campaigns only while its certificate is one the other nodes accept
  (:mod:`gpud.cluster.trust`), checked before each campaign and every
  :data:`~gpud.cluster.trust.CHECK_S` while it leads: a leader whose certificate expires or
  that the others turn out to refuse steps down and revokes its lease.

``state()`` is cheap and thread-safe; the etcd work runs on the election's own thread
(:meth:`EtcdElection.start`) or, in tests, one :meth:`EtcdElection.step` at a time.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gpud.clock import WAKE_S, elapsed
from gpud.cluster.etcd import EtcdClient, KeyValue
from gpud.cluster.model import node_name
from gpud.cluster.trust import CHECK_S, Candidacy
from gpud.errors import GpudError, StoreFull, StoreRefused

log = logging.getLogger(__name__)


# How the last etcd call went (LeaderInfo.store_state; "" with no etcd)
STORE_OK = "ok"
STORE_UNREACHABLE = "unreachable"  # no endpoint answered
STORE_REFUSED = "refused"  # etcd answered and refused: the login, the user's keys
STORE_FULL = "full"  # etcd refuses writes: out of space (alarm NOSPACE)


def store_state(err: GpudError) -> str:
    """The ``store_state`` an etcd call that raised ``err`` leaves."""
    if isinstance(err, StoreFull):
        return STORE_FULL
    if isinstance(err, StoreRefused):
        return STORE_REFUSED
    return STORE_UNREACHABLE


@dataclass(frozen=True, slots=True)
class LeaderInfo:
    """``leader`` / ``address``: the leader's node name and peer address ("" if none known);
    ``leading``: whether this node leads now; ``store_ok``: the last etcd call succeeded,
    ``store_state`` how it went (:data:`STORE_OK`... ; "" with no etcd); ``lease``: the ID of
    the etcd lease the leader key is attached to (``etcdctl get -w json <prefix>/leader``),
    the one this node holds while it leads, as last read on another node; 0 when no leader
    key is known, or with election "single"; ``stepped_down``: why this node last stopped
    leading (the ``cluster.step_down`` event's words), while it knows of no leader since
    ("" otherwise): etcd unreachable overwrites ``detail`` with its own failure."""

    leader: str
    address: str
    epoch: int
    leading: bool
    store_ok: bool = True
    detail: str = ""
    store_state: str = STORE_OK
    lease: int = 0
    stepped_down: str = ""


class Election(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...

    def state(self) -> LeaderInfo: ...


class SingleElection:
    """A lone node leads itself."""

    def __init__(self, node: str, address: str = "") -> None:
        self._info = LeaderInfo(node, address, epoch=1, leading=True, store_state="")

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def state(self) -> LeaderInfo:
        return self._info


Notify = Callable[[str, str, dict[str, object]], None]
"""(event kind, message, fields): elections report ``cluster.elected`` / ``cluster.step_down``."""


def _watched_from(kv: KeyValue, compacted: int) -> int:
    """The revision a watch of the leader key starts after: the one etcd read it at. Its
    own mod revision, never written again while one leader holds it, falls behind every
    compaction (``etcdctl compact``, etcd's auto-compaction): a watch from there is
    cancelled at once, and the step it ends would read and watch it again, without
    pause, until the leader changes. Where the read's answer carried no revision (a
    proxy that strips etcd's header), the watch starts no earlier than the revision
    etcd was last seen ``compacted`` to, which etcd still serves. A read that carried
    one is never passed by ``compacted``: an etcd wiped or restored from an older
    snapshot starts its revisions again at 1, below a compaction seen before, and a
    watch from past its own revision would wait for revisions it has not reached."""
    if kv.read_revision:
        return max(kv.mod_revision, kv.read_revision)
    return max(kv.mod_revision, compacted - 1)


class EtcdElection:
    """See the module docstring."""

    def __init__(
        self,
        client: EtcdClient,
        *,
        node: str,
        address: str,
        prefix: str,
        ttl_s: int,
        notify: Notify | None = None,
        clock: Callable[[], float] = elapsed,
        candidacy: Candidacy | None = None,
        stopped: threading.Event | None = None,
    ) -> None:
        """``stopped``: the event :meth:`stop` sets, waited on between steps (a new one by
        default)."""
        self._client = client
        self.node = node
        self.address = address
        self.key = prefix.rstrip("/") + "/leader"
        self.ttl_s = ttl_s
        self._notify = notify or (lambda kind, message, fields: None)
        self._clock = clock
        self._candidacy = candidacy
        self._refused = ""  # why this node may not lead, as last logged ("" it may)
        self._checked_at = 0.0  # (clock) a leader's last candidacy check
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._granted_ttl = float(ttl_s)
        self._valid_until = 0.0
        self._epoch = 0
        self._leader = ""
        self._leader_address = ""
        self._leader_lease = 0  # of the leader key as last read (a follower's)
        self._store_state = STORE_UNREACHABLE  # how the last etcd call went
        self._detail = "not started"
        self._stepped_down = ""  # why this node last stopped leading, until a leader is known
        self._failing = False  # an etcd outage was logged and has not ended
        self._abandoned: int | None = None  # a lease we stepped down from, to revoke
        # the revision the leader key was last read at (0: none seen): watched from there
        self._watch_revision = 0
        self._stop = stopped if stopped is not None else threading.Event()
        self._thread: threading.Thread | None = None
        # called on the election's thread when the leader or the epoch changes
        self.on_change: Callable[[], None] = lambda: None

    @property
    def interval_s(self) -> float:
        return max(0.05, self.ttl_s / 4)

    @property
    def margin_s(self) -> float:
        """How long before the lease could expire the leader stops leading."""
        return max(0.2, self._granted_ttl / 4)

    # -- state ---------------------------------------------------------------------------

    def _leading_now(self) -> bool:
        return self._lease is not None and self._clock() < self._valid_until - self.margin_s

    def state(self) -> LeaderInfo:
        with self._lock:
            held = self._lease if self._leading_now() else None
            state = self._store_state
            store_ok = state == STORE_OK
            if held is not None:
                return LeaderInfo(
                    self.node,
                    self.address,
                    self._epoch,
                    leading=True,
                    store_ok=store_ok,
                    detail=self._detail,  # why renewals fail while the lease holds
                    store_state=state,
                    lease=held,
                )
            if self._lease is not None:
                # past the deadline but the thread has not noticed yet: not leading
                overdue = STORE_UNREACHABLE if state == STORE_OK else state
                why = "lease renewal overdue" + (f": {self._detail}" if self._detail else "")
                return LeaderInfo("", "", self._epoch, False, False, why, overdue)
            return LeaderInfo(
                self._leader,
                self._leader_address,
                self._epoch,
                False,
                store_ok,
                self._detail,
                state,
                self._leader_lease if self._leader else 0,
                "" if self._leader else self._stepped_down,
            )

    # -- life ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cluster-election", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop campaigning; a leader revokes its lease so that another takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self._client_timeout() + 2)
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            try:
                self._client.revoke(lease)
                self._notify("cluster.step_down", "stopped: lease revoked", {"epoch": self._epoch})
            except GpudError as err:
                log.warning("cannot revoke the leader lease: %s", err)

    def _client_timeout(self) -> float:
        return self._client.timeout_s

    def _run(self) -> None:
        while not self._stop.is_set():
            started = self._clock()
            try:
                self.step()
            except Exception:  # the thread must survive anything; the next step retries
                log.exception("election step failed")
            self._wait(max(0.0, self.interval_s - (self._clock() - started)))

    def _wait(self, timeout_s: float) -> None:
        """Until the next step: a watch on the leader key, so that a follower campaigns as
        soon as the key is gone and a leader notices at once that it lost it; a plain
        sleep when etcd cannot be watched. Both in slices of :data:`~gpud.clock.WAKE_S`
        at most, the time read anew after each on the election's clock: stop() never waits
        long, and a step due during a suspend runs at the resume (the kernel's timeouts
        stop while the host is suspended; etcd's lease ran on).

        A watch that ends without a change well before its slice (the stream closed with
        no event: a proxy, a gateway's in-stream error) counts as failed: the rest of the
        pause is a plain sleep, not one watch after another."""
        deadline = self._clock() + timeout_s
        watch = True  # until the watch fails: then no call of etcd until the next step
        while not self._stop.is_set():
            started = self._clock()
            left = deadline - started
            revision = self._watch_revision
            if left <= 0:
                return
            slice_s = min(left, WAKE_S)
            if not (watch and revision):
                self._stop.wait(slice_s)
                continue
            try:
                if self._client.wait_for_change(self.key, revision, slice_s):
                    return
            except GpudError:
                watch = False
                continue
            if self._clock() - started < slice_s / 2:
                watch = False

    def step(self) -> None:
        """One pass: renew (leader) or watch and campaign (follower)."""
        if self._lease is not None:
            self._renew()
        else:
            self._follow()

    def _renew(self) -> None:
        lease = self._lease
        assert lease is not None
        sent = self._clock()
        try:
            ttl = self._client.keepalive(lease)
            kv = self._client.get(self.key) if ttl > 0 else None
        except GpudError as err:
            with self._lock:
                self._store_state = store_state(err)
                self._detail = str(err)
                overdue = self._clock() >= self._valid_until - self.margin_s
            if overdue:
                self._step_down(f"cannot reach etcd before the lease could expire: {err}")
            return
        if ttl <= 0:
            self._step_down("lease expired")
            return
        if kv is None or kv.lease != lease:
            self._step_down("leader key is gone")
            return
        self._watch_revision = _watched_from(kv, self._client.compacted_revision)
        with self._lock:
            self._granted_ttl = float(ttl)
            self._valid_until = sent + ttl
            self._store_state = STORE_OK
            self._detail = ""
        if self._candidacy is not None and self._clock() - self._checked_at >= CHECK_S:
            self._checked_at = self._clock()
            try:
                why = self._candidacy.refusal()
            except GpudError as err:  # the next renewal finds an outage; lead on meanwhile
                log.debug("cluster: cannot check this node's candidacy: %s", err)
                return
            if why:
                self._refused = why  # said once, by the step-down's log line and event
                self._resign(why)

    def _resign(self, why: str) -> None:
        """Step down and revoke the lease now, so that another node is elected at once
        rather than when the lease expires."""
        self._step_down(why)
        lease = self._abandoned
        if lease is None:
            return
        try:
            self._client.revoke(lease)
            self._abandoned = None
        except GpudError as err:  # revoked by the next follower step
            log.debug("cluster: cannot revoke the lease stepped down from: %s", err)

    def _note_refusal(self, why: str) -> None:
        """Log and report a change of why this node may not lead, once."""
        if why == self._refused:
            return
        self._refused = why
        if why:
            log.error("cluster: %s", why)
            self._notify("cluster.not_candidate", why, {})
        else:
            log.info("cluster: this node's certificate is accepted again: it may lead")

    def _step_down(self, why: str) -> None:
        with self._lock:
            lease, self._lease = self._lease, None
            self._abandoned = lease
            self._leader = self._leader_address = ""
            self._leader_lease = 0
            self._detail = self._stepped_down = why
        log.warning("stepping down as cluster leader (epoch %d): %s", self._epoch, why)
        self._notify("cluster.step_down", f"stepped down: {why}", {"epoch": self._epoch})
        self.on_change()

    def _follow(self) -> None:
        try:
            if self._abandoned is not None:
                # our old lease may outlive etcd's restart (leases are renewed on recovery):
                # drop it so that the cluster need not wait for its TTL
                self._client.revoke(self._abandoned)
                self._abandoned = None
            if self._candidacy is not None:
                self._candidacy.record()
            kv = self._client.get(self.key)
            if kv is None:
                self._watch_revision = 0
                why = self._candidacy.refusal() if self._candidacy is not None else ""
                self._note_refusal(why)
                if why:
                    with self._lock:
                        self._store_state = STORE_OK
                        self._detail = why
                    self._forget_leader()
                    return
                self._forget_leader()
                self._campaign()
                return
            self._watch_revision = _watched_from(kv, self._client.compacted_revision)
        except GpudError as err:
            with self._lock:
                was_ok = self._store_state == STORE_OK
                self._store_state = store_state(err)
                self._detail = str(err)
            if was_ok or not self._failing:  # once per outage, not every step
                log.warning("cluster: %s; the last order stays in force", err)
            self._failing = True
            return
        if self._failing:
            log.info("cluster: etcd reachable again")
            self._failing = False
        try:
            holder = json.loads(kv.value)
            # an older gpud writes its name as configured: compared in lower case here
            leader, address = node_name(str(holder["node"])), str(holder["address"])
        except (ValueError, KeyError, TypeError):
            leader, address = "", ""
        with self._lock:
            # another lease on the epoch in force: a fresh etcd gave a new key its revision
            changed = (self._epoch, self._leader, self._leader_lease) != (
                kv.create_revision,
                leader,
                kv.lease,
            )
            self._leader, self._leader_address = leader, address
            self._leader_lease = kv.lease
            self._stepped_down = ""  # a leader is known again: that is what status says
            self._epoch = kv.create_revision
            self._store_state = STORE_OK
            self._detail = "" if leader else f"unreadable leader key {self.key}"
        if changed:
            self.on_change()
            log.info(
                "cluster leader is %s (epoch %d, lease %x)",
                leader or "?",
                kv.create_revision,
                kv.lease,
            )

    def _forget_leader(self) -> None:
        """The leader key is gone: its leader no longer leads, whether or not a campaign
        follows and succeeds (etcd out of space or refusing writes lets none in)."""
        with self._lock:
            changed = bool(self._leader)
            self._leader = self._leader_address = ""
            self._leader_lease = 0
        if changed:
            self.on_change()

    def _campaign(self) -> None:
        sent = self._clock()
        lease, granted = self._client.grant(self.ttl_s)
        value = json.dumps({"node": self.node, "address": self.address})
        try:
            epoch = self._client.create(self.key, value, lease)
        except GpudError:
            self._client.revoke(lease)
            raise
        if epoch is None:  # someone else was faster
            self._client.revoke(lease)
            return
        self._watch_revision = epoch
        with self._lock:
            self._lease = lease
            self._granted_ttl = float(granted)
            self._valid_until = sent + granted
            self._epoch = epoch
            self._leader, self._leader_address = self.node, self.address
            self._stepped_down = ""
            self._store_state = STORE_OK
            self._detail = ""
        log.info("elected cluster leader (epoch %d, lease TTL %d s)", epoch, granted)
        self.on_change()
        self._notify("cluster.elected", f"elected leader in epoch {epoch}", {"epoch": epoch})
