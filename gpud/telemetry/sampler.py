"""The telemetry sampler: every GPU and MIG device, once per interval, into a :class:`Snapshot`.

GPU reads run off the calling thread (:mod:`gpud.telemetry.dispatch`): one worker reads the
GPUs in turn, and a GPU whose call runs past half the interval (or ``call_timeout_s``, if
shorter) is left behind while the rest are read on threads of their own. So:

- a GPU whose calls raise (lost, driver error) is ``healthy=False`` with the reason, and every
  other GPU is read as usual (:mod:`gpud.telemetry.reader` has the per-call policy);
- a GPU whose call hangs is ``healthy=False`` with one reason (:data:`NOT_ANSWERING`) from
  the first tick that finds it hung until the call returns; it gets no new call until then,
  while the others keep samples no older than twice the interval. A call past its deadline
  with other GPUs' calls late too (a host that starves gpud of CPU) is late, not hung: the
  GPU shows its last answer (older each tick, ``gpud_gpu_sample_age_seconds``) until
  another GPU answers in time a read of a later tick while it is still outstanding, or it
  has been outstanding ``call_timeout_s`` (:mod:`gpud.telemetry.dispatch`
  has the rule); a GPU found hung stays so until the call returns;
- a GPU reset or MIG-changed through gpud twice during one read (a MIG apply renews it after
  every step) keeps the health and reason last reported for that tick, its MIG devices not
  read (no call is outstanding, no transition), and is read again the next;
- health transitions, and changes of the reason a GPU is unhealthy, are logged and go to
  the event log as ``gpu.unhealthy`` / ``gpu.recovered``.

XID and ECC events arrive on a separate thread blocked in ``nvmlEventSetWait``
(:class:`XidWatcher`); counts show in each :class:`GpuSample` and an XID goes to the
event log as ``gpu.xid``, a code raised again on the same device at most once per
:data:`REMIND_S` with the raises counted meanwhile (and an ECC error type likewise as
``gpu.ecc``); a storm that stops is said with its last count once its window is over, or at
a clean stop (not cut short by a second SIGTERM). A
critical XID (any but ``ignored_xids``, the application-caused ones: 13, 31, 43, 45, 68, 109
by default, as the Kubernetes device plugin has it) marks the GPU unhealthy with the XID in
the reason until the GPU is reset (:meth:`Sampler.gpu_reset`) or the fault is cleared by hand
(:meth:`Sampler.clear_xid`). Each code is kept on its own with how often and when it was
raised (:class:`CriticalXid`, ``GpuSample.critical_xids``): a
second critical XID on a GPU is a second fault, shown beside the first, and clearing one code
leaves the others. With ``xid_state`` (a file under the run directory, which a reboot
empties) they outlive a daemon restart.

Use from asyncio (the daemon)::

    sampler = Sampler(backend, interval_s=1.0, events=event_log)
    await sampler.run(stop_event)      # starts the XID watcher; closes everything on return

or synchronously (tests, benchmarks): ``sampler.start()`` (optional, for XIDs), ``tick()``,
``latest()``, ``close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpud.backend.port import EventKind, GpuBackend, GpuEvent
from gpud.errors import BackendError, NotSupported, Unavailable
from gpud.events import EventLog
from gpud.files import keep_aside, write_atomically
from gpud.telemetry.dispatch import Dispatcher, Result, Superseded, Target
from gpud.telemetry.reader import GpuReader, placeholder_identity
from gpud.telemetry.seen import Seen
from gpud.telemetry.seen import identity as seen_identity
from gpud.telemetry.snapshot import ClearedXids, CriticalXid, GpuSample, Snapshot
from gpud.threads import on_daemon_thread, wait_first

log = logging.getLogger(__name__)


def _times(n: int) -> str:
    return f"{n} more time" if n == 1 else f"{n} more times"


Listener = Callable[[Snapshot], None]

NOT_ANSWERING = "not answering: a driver call is outstanding"
"""The reason of a GPU whose call has not returned yet, for as long as it has not. The same
words all along (not how long it has been): it is a metric label, the reason of events and
of what co-location and admission show, and a label that changed while the GPU stayed hung
would resolve an alert and fire it again. How long is ``gpud_gpu_sample_age_seconds``."""

DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
"""XIDs an application causes (illegal address, page fault, ...): they leave the GPU healthy."""


XID_STATE_VERSION = 2
"""Version of the ``xid_state`` file: ``{"version": 2, "gpus": {"1": [{"xid": 79, ...}]}}``.
Version 1 (no ``version`` key) kept one code per GPU, ``{"1": 79}``; it is still read."""

REMIND_S = 600.0
"""An XID code (or an ECC error type) raised again on the same GPU or MIG device within this
many seconds of the ``gpu.xid`` (``gpu.ecc``) that last said it is counted, not said: a storm
of one fault is one line and one event, then one every 10 minutes carrying how many went
unsaid (``repeats``); once a window ends with raises unsaid, the next tick says them, and
a clean stop (:meth:`Sampler.close`, not cut short by a second SIGTERM) says those of every
window still open. The
driver's counters go on regardless: ``gpud_gpu_xid_errors_total`` counts every XID the event
thread takes in once the GPUs are counted, and ``gpud_gpu_ecc_errors_total`` is NVML's
volatile ECC counters."""

XID_SAVE_S = 1.0
"""A new critical XID is saved to ``xid_state`` at once; later raises of it (its count and
last_seen) at most once per this many seconds, on a tick or a raise, and at close: a storm is
not one fsync'd write per raise on the event thread."""

# gpu, the XID's code or the ECC error's type, gpu and compute instance
_SaidKey = tuple[int, int | str | None, int | None, int | None]


class _Said:
    """When a code on a device was last said, the raises counted since, and the raise that
    was said (its message and what names its device), which the end of the window says again
    with the count."""

    __slots__ = ("at", "critical", "event", "message", "mig_uuid", "unsaid", "uuid")

    def __init__(
        self, event: GpuEvent, message: str, uuid: str, mig_uuid: str, critical: bool
    ) -> None:
        self.at = 0.0  # set when said
        self.event = event
        self.message = message
        self.uuid = uuid
        self.mig_uuid = mig_uuid
        self.critical = critical
        self.unsaid = 0


def _event_fields(event: GpuEvent, uuid: str, mig_uuid: str) -> dict[str, object]:
    """The fields naming the device of a ``gpu.xid`` or ``gpu.ecc``: on a MIG device, as the
    MIG metrics label it (``uuid`` stays the GPU's)."""
    fields: dict[str, object] = {"gpu": event.gpu, "uuid": uuid}
    if event.gpu_instance_id is not None:
        fields["gpu_instance_id"] = event.gpu_instance_id
    if event.compute_instance_id is not None:
        fields["compute_instance_id"] = event.compute_instance_id
    if event.gpu_instance_id is not None:
        fields["gpu_uuid"] = uuid
        if mig_uuid:
            fields["mig_uuid"] = mig_uuid
    return fields


def critical_xid_reason(xids: Sequence[int]) -> str:
    """The unhealthy reason for uncleared critical XIDs ``xids`` (never empty). Alert rules
    match its start, ``critical Xid 79:`` or ``critical Xids 79, 48:``."""
    if len(xids) == 1:
        return f"critical Xid {xids[0]}: reset the GPU or clear it with `gpuctl xid clear`"
    codes = ", ".join(str(x) for x in xids)
    return f"critical Xids {codes}: reset the GPU or clear them with `gpuctl xid clear`"


class _Slot:
    """One GPU: its reader, its dispatch target and the health last reported."""

    __slots__ = (
        "critical",
        "healthy",
        "reader",
        "reason",
        "target",
        "xid_last",
        "xid_total",
    )

    def __init__(self, reader: GpuReader) -> None:
        self.reader = reader
        self.target = Target(reader.index, reader.read)
        self.healthy = True
        self.reason = ""
        self.critical: dict[int, CriticalXid] = {}  # by code, until a reset or a clear
        self.xid_total = 0
        self.xid_last: int | None = None


def tick_bound_s(interval_s: float, call_timeout_s: float) -> float:
    """Seconds one tick waits for the driver at most, however many GPUs hang: the wait for
    the GPU that stopped answering, ``min(call_timeout_s, interval_s / 2)``, then one more
    for the GPUs not read yet (``telemetry.interval_s``, ``telemetry.call_timeout_s``)."""
    return 2 * min(call_timeout_s, interval_s / 2)


class Sampler:
    """Samples a :class:`GpuBackend` into immutable snapshots; keeps the last ``history``."""

    def __init__(
        self,
        backend: GpuBackend,
        *,
        interval_s: float = 1.0,
        history: int = 60,
        call_timeout_s: float = 3.0,
        unsupported_retry_s: float = 300.0,
        identity_refresh_s: float = 30.0,
        event_wait_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        events: EventLog | None = None,
        ignored_xids: Collection[int] = DEFAULT_IGNORED_XIDS,
        xid_state: Path | None = None,
        last_seen: Mapping[int, Seen] | None = None,
    ) -> None:
        """``last_seen``: how each GPU index was last seen (:mod:`gpud.telemetry.seen`), named
        in the reason of a GPU whose identity cannot be read now."""
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        if call_timeout_s <= 0:
            raise ValueError("call_timeout_s must be > 0")
        self._interval_s = interval_s
        # set when interval_s changes while run() waits: the wait is measured again
        self._rescheduled: asyncio.Event | None = None
        self.call_timeout_s = call_timeout_s
        self._last_seen = dict(last_seen or {})
        self._backend = backend
        self._unsupported_retry_s = unsupported_retry_s
        self._identity_refresh_s = identity_refresh_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._events = events
        self._history: deque[Snapshot] = deque(maxlen=max(1, history))
        self._latest: Snapshot | None = None
        # guards _history, _slots' xid counts and critical XIDs, _unslotted_xids, _listeners
        self._lock = threading.Lock()
        self._tick_lock = threading.Lock()  # one tick at a time
        self._slots: list[_Slot] | None = None
        self._count_failures = 0  # ticks in a row that could not count the GPUs
        self._driver_version: str | None = None
        self._listeners: list[Listener] = []
        # a tick waits at most twice (see tick_bound_s): each wait is half its bound
        self._dispatcher = Dispatcher(self.tick_bound_s() / 2, clock=clock)
        self._xid = XidWatcher(backend, self._on_gpu_event, wait_s=event_wait_s)
        self._events_handled = 0  # GPU events taken in, of any kind
        self._handled = threading.Condition()
        self._closed = False
        self.ignored_xids = frozenset(ignored_xids)
        self._xid_state = xid_state
        self._xid_save_lock = threading.Lock()  # one write at a time, of the newest state
        self._xids_unsaved = False  # under _lock: a count or last_seen not written yet
        self._xids_saved_at = float("-inf")  # under _lock: when state was last taken to save
        # critical XIDs of GPU indexes without a slot: read from xid_state before the GPUs
        # are counted, raised before that, or of an index the driver no longer counts
        self._unslotted_xids: dict[int, dict[int, CriticalXid]] = self._load_xids()
        self._said: dict[_SaidKey, _Said] = {}  # under _lock

    @property
    def interval_s(self) -> float:
        return self._interval_s

    @interval_s.setter
    def interval_s(self, value: float) -> None:
        """A new period (a reload), from the event loop's thread: the wait for the next tick
        is measured again with it, so a reload from an hour to a second samples within a
        second, not after the hour."""
        if value <= 0:
            raise ValueError("interval_s must be > 0")
        changed = value != self._interval_s
        self._interval_s = value
        if changed and self._rescheduled is not None:
            self._rescheduled.set()

    def tick_bound_s(self) -> float:
        """Seconds one :meth:`tick` waits for the driver at most, however many GPUs hang:
        the wait for the GPU that stopped answering, then one more for the GPUs not read yet,
        each on a thread of its own (:mod:`gpud.telemetry.dispatch`)."""
        return tick_bound_s(self.interval_s, self.call_timeout_s)

    # -- reading ------------------------------------------------------------------------

    def latest(self) -> Snapshot | None:
        """The last snapshot, or None before the first tick. Safe from any thread."""
        return self._latest

    def history(self) -> list[Snapshot]:
        """The kept snapshots, oldest first."""
        with self._lock:
            return list(self._history)

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(snapshot)`` after every tick, on the sampling thread; keep it short."""
        with self._lock:
            self._listeners.append(listener)

    def refresh_identity(self, gpu: int | None = None) -> None:
        """Re-read identity and MIG devices of ``gpu`` (all when None) on the next tick.

        Call after changing the MIG layout, so that new MIG devices show at once. A MIG
        device created now may take a destroyed one's GPU and compute instance ids: what was
        said of the ids on ``gpu`` is forgot, so its first XID or ECC error is said at once.
        """
        with self._lock:
            over = self._forget_said(
                lambda key: (gpu is None or key[0] == gpu) and key[2] is not None
            )
        self._say_the_rest(over, "since it was last said, before the MIG layout changed")
        for slot in self._slots or ():
            if gpu is None or slot.reader.index == gpu:
                slot.reader.refresh_identity()
                slot.target.renew()  # after: a read renewed reads the identity anew

    # -- sampling -----------------------------------------------------------------------

    def tick(self) -> Snapshot:
        """Read every GPU once (at most ``call_timeout_s``); store and return the snapshot.
        Raises :class:`Unavailable` once closed (a tick that waited behind another while
        the sampler closed included)."""
        with self._tick_lock:
            if self._closed:
                raise Unavailable("the GPU sampler is closed: gpud is stopping")
            start = self._clock()
            wall = self._wall_clock()
            slots = self._slots if self._slots is not None else self._discover()
            self._dispatcher.wait_s = self.tick_bound_s() / 2  # the interval may have changed
            targets = [slot.target for slot in slots]
            results = self._dispatcher.read(targets)
            samples = tuple(
                self._collect(slot, self._result(slot, results, targets)) for slot in slots
            )
            snapshot = Snapshot(
                wall_time=wall,
                monotonic=start,
                gpus=samples,
                tick_seconds=self._clock() - start,
                driver_version=self._driver_version,
            )
            with self._lock:
                self._history.append(snapshot)
                self._latest = snapshot
                listeners = tuple(self._listeners)
                over = self._forget_said(lambda key: start - self._said[key].at >= REMIND_S)
            self._say_the_rest(over, f"in the {REMIND_S / 60:g} minutes after it was last said")
            self._save_xids(only_unsaved=True, only_if_due=True)
            for listener in listeners:
                try:
                    listener(snapshot)
                except Exception:
                    log.exception("snapshot listener %r failed", listener)
            return snapshot

    def _discover(self) -> list[_Slot]:
        """Count GPUs once (a GPU that comes or goes needs a driver reload and a restart)."""
        try:
            count = self._backend.gpu_count()
        except BackendError as err:
            # said once, not every tick, as a failing loop step is; and once when it works
            if not self._count_failures:
                log.warning("cannot count GPUs, retrying every tick: %s", err)
            self._count_failures += 1
            return []
        if self._count_failures:
            log.info(
                "counting GPUs works again after %d failed ticks: %d GPUs",
                self._count_failures,
                count,
            )
            self._count_failures = 0
        try:
            self._driver_version = self._backend.driver_version()
        except BackendError as err:
            log.warning("cannot read the driver version: %s", err)
        slots = [
            _Slot(
                GpuReader(
                    self._backend,
                    index,
                    clock=self._clock,
                    unsupported_retry_s=self._unsupported_retry_s,
                    identity_refresh_s=self._identity_refresh_s,
                )
            )
            for index in range(count)
        ]
        with self._lock:
            for slot in slots:
                slot.critical = self._unslotted_xids.pop(slot.reader.index, {})
            self._slots = slots
        return slots

    def _result(
        self, slot: _Slot, results: Mapping[int, Result], targets: Sequence[Target]
    ) -> Result | None:
        """``slot``'s result of the tick; where its read gave none, its last answer while the
        read is late and not judged hung (None: not answering)."""
        result = results.get(slot.reader.index)
        if result is not None:
            return result
        return self._dispatcher.late_answer(slot.target, targets, self.call_timeout_s)

    def _collect(self, slot: _Slot, result: GpuSample | BaseException | None) -> GpuSample:
        reader = slot.reader
        if isinstance(result, GpuSample):
            sample = result
        else:
            if isinstance(result, Superseded):
                reason = slot.reason
            elif result is not None:
                # Not a driver error (the reader handles those): a bug. Report it and go on.
                # The reason names the exception's type alone: it is a metric label and each
                # change of it an event, and a message may change at every tick (numbers,
                # addresses).
                log.error("reading GPU %d failed", reader.index, exc_info=result)
                reason = f"internal error: {type(result).__name__} (gpud's log has the details)"
            else:  # hung: judged so by the dispatcher (late alone, or shown stuck)
                reason = NOT_ANSWERING
            sample = GpuSample(
                identity=reader.identity or placeholder_identity(reader.index),
                healthy=False,
                reason=reason,
                sampled_at=reader.last_good_at,
                mig_devices_read=False,
            )
        seen = self._last_seen.get(reader.index)
        if seen and seen.description and not sample.identity.uuid:  # never read in this run
            sample = sample._replace(
                reason=f"{sample.reason}; last seen as {seen.description}",
                last_seen=seen_identity(seen),
            )
        if not self._backend.xid_watched(reader.index):
            sample = sample._replace(xids_watched=False)
        if slot.xid_total or slot.critical:
            with self._lock:
                critical = tuple(slot.critical.values())
                sample = sample._replace(
                    xid_events_total=slot.xid_total, last_xid=slot.xid_last, critical_xids=critical
                )
            if critical:
                why = critical_xid_reason([c.xid for c in critical])
                sample = sample._replace(
                    healthy=False, reason=f"{sample.reason}; {why}" if sample.reason else why
                )
        if isinstance(result, Superseded):
            # A MIG apply renews the GPU after every step: a read it outran says nothing of
            # the GPU's health, which stays as last reported (no event, not faulty for MPS).
            return sample._replace(healthy=slot.healthy, reason=slot.reason)
        if sample.healthy != slot.healthy or sample.reason != slot.reason:
            self._transition(slot, sample)
        return sample

    def _transition(self, slot: _Slot, sample: GpuSample) -> None:
        slot.healthy = sample.healthy
        slot.reason = sample.reason
        gpu = sample.identity.index
        uuid = sample.known().uuid  # as last seen, of a GPU not read since gpud started
        if sample.healthy:
            log.info("GPU %d recovered", gpu)
            self._emit("gpu.recovered", f"GPU {gpu} recovered", gpu=gpu, uuid=uuid)
        else:
            # Also on a change of reason, e.g. a timed-out GPU that then reports "lost".
            log.warning("GPU %d unhealthy: %s", gpu, sample.reason)
            self._emit(
                "gpu.unhealthy",
                f"GPU {gpu} unhealthy: {sample.reason}",
                gpu=gpu,
                uuid=uuid,
                reason=sample.reason,
            )

    # -- events -------------------------------------------------------------------------

    def events_handled(self) -> int:
        """GPU events (XIDs, ECC errors) taken in since the start."""
        with self._handled:
            return self._events_handled

    def wait_events_handled(self, count: int, timeout_s: float) -> bool:
        """Wait until ``count`` GPU events were taken in (at most ``timeout_s``): an event the
        driver posted reaches the samples only once the event thread has taken it."""
        with self._handled:
            return self._handled.wait_for(lambda: self._events_handled >= count, timeout_s)

    def _on_gpu_event(self, event: GpuEvent) -> None:
        try:
            self._take_event(event)
        finally:
            with self._handled:
                self._events_handled += 1
                self._handled.notify_all()

    def _take_event(self, event: GpuEvent) -> None:
        slots = self._slots or []
        slot = next((s for s in slots if s.reader.index == event.gpu), None)
        read = slot.reader.identity if slot else None
        uuid, model = (read.uuid, read.name) if read else ("", "")
        gi, ci = event.gpu_instance_id, event.compute_instance_id
        mig_uuid = self._mig_uuid(event.gpu, gi, ci) if gi is not None else ""
        if event.kind is EventKind.XID:
            critical = event.xid is not None and event.xid not in self.ignored_xids
            now = self._wall_clock()
            key = (event.gpu, event.xid, gi, ci)
            message = f"GPU {event.gpu} reported {'critical ' if critical else ''}Xid {event.xid}"
            with self._lock:
                # again under the lock: the GPUs may have been counted since, taking over
                # what was raised before (_discover), and this XID must reach the same place
                slot = next((s for s in self._slots or () if s.reader.index == event.gpu), None)
                if slot is not None:
                    slot.xid_total += 1
                    slot.xid_last = event.xid
                if critical and event.xid is not None:
                    # before the GPUs are counted too: the slot takes it over when made
                    table = (
                        slot.critical
                        if slot is not None
                        else self._unslotted_xids.setdefault(event.gpu, {})
                    )
                    known = table.get(event.xid)
                    self._xids_unsaved = True
                    if known is None:  # new since a reset or a clear, which forgot it was said
                        table[event.xid] = CriticalXid(event.xid, 1, now, now, uuid, model)
                    else:
                        # the board it was first raised on, once known: UUID and model together
                        named = (known.uuid, known.model) if known.uuid else (uuid, model)
                        table[event.xid] = dataclasses.replace(
                            known,
                            count=known.count + 1,
                            last_seen=now,
                            uuid=named[0],
                            model=named[1],
                        )
                repeats = self._repeats(key, _Said(event, message, uuid, mig_uuid, critical))
            if critical:
                # a new fault at once; a storm's counting at most once per XID_SAVE_S
                later = known is not None
                self._save_xids(only_unsaved=later, only_if_due=later)
            if repeats is None:
                return
            if repeats:
                message += f" (and {_times(repeats)} since it was last said)"
            log.warning("%s", message)
            self._emit(
                "gpu.xid",
                message,
                xid=event.xid,
                critical=critical,
                repeats=repeats,
                **_event_fields(event, uuid, mig_uuid),
            )
        elif event.kind in (EventKind.ECC_DOUBLE_BIT, EventKind.ECC_SINGLE_BIT):
            key = (event.gpu, event.kind.value, gi, ci)
            message = f"GPU {event.gpu}: {event.kind.value} ECC error"
            with self._lock:
                repeats = self._repeats(key, _Said(event, message, uuid, mig_uuid, False))
            if repeats is None:
                return
            if repeats:
                message += f" (and {repeats} more since it was last said)"
            self._emit("gpu.ecc", message, repeats=repeats, **_event_fields(event, uuid, mig_uuid))

    def _repeats(self, key: _SaidKey, raised: _Said) -> int | None:
        """Under ``_lock``: None when this XID or ECC error of ``key`` is only counted (said
        less than REMIND_S ago), else how many were left unsaid since it was last said (and
        ``raised`` is kept as the one said)."""
        now = self._clock()
        said = self._said.get(key)
        if said is not None and now - said.at < REMIND_S:
            said.unsaid += 1
            return None
        raised.at = now
        self._said[key] = raised
        return said.unsaid if said is not None else 0

    def _forget_said(self, forget: Callable[[_SaidKey], bool]) -> list[_Said]:
        """Under ``_lock``: drop what was said of the keys ``forget`` picks, so the next raise
        of each is said at once; what they left unsaid."""
        keys = [key for key in self._said if forget(key)]
        return [said for said in (self._said.pop(key) for key in keys) if said.unsaid]

    def _say_the_rest(self, over: Sequence[_Said], when: str) -> None:
        """Say the raises each window in ``over`` counted but never said (``when``: over
        which time): a storm that stopped is not left at the count of its first event."""
        for said in over:
            message = f"{said.message}: {_times(said.unsaid)} {when}"
            event = said.event
            if event.kind is not EventKind.XID:
                self._emit(
                    "gpu.ecc",
                    message,
                    repeats=said.unsaid,
                    **_event_fields(event, said.uuid, said.mig_uuid),
                )
                continue
            log.warning("%s", message)
            self._emit(
                "gpu.xid",
                message,
                xid=event.xid,
                critical=said.critical,
                repeats=said.unsaid,
                **_event_fields(event, said.uuid, said.mig_uuid),
            )

    def _mig_uuid(self, gpu: int, gi: int, ci: int | None) -> str:
        """The UUID of GPU ``gpu``'s MIG device on GPU instance ``gi`` (and compute
        instance ``ci`` when known) in the latest snapshot; "" where it holds none."""
        snap = self._latest
        sample = snap.gpu(gpu) if snap is not None else None
        for m in sample.mig_devices if sample is not None else ():
            ident = m.identity
            if ident.gpu_instance_id == gi and ci in (None, ident.compute_instance_id):
                return ident.uuid
        return ""

    def clear_xid(self, gpu: int, xid: int | None = None) -> ClearedXids:
        """Forget ``gpu``'s critical XID ``xid`` (every one when None): the operator dealt
        with it. The next tick reports the GPU by its readings and the codes left alone."""
        slot = self._slot(gpu)
        with self._lock:
            codes = list(slot.critical) if xid is None else [xid] if xid in slot.critical else []
            cleared = [slot.critical.pop(code) for code in codes]
            remaining = tuple(slot.critical)
            # raised anew on any of its MIG devices, a cleared code is said at once
            over = self._forget_said(lambda key: key[0] == gpu and key[1] in codes)
        self._say_the_rest(over, "since it was last said, before it was cleared")
        if cleared:
            self._save_xids()
        uuid = slot.reader.identity.uuid if slot.reader.identity else ""
        for c in cleared:
            self._emit(
                "gpu.xid_cleared",
                f"GPU {gpu}: critical Xid {c.xid} cleared",
                gpu=gpu,
                uuid=uuid or c.uuid,
                xid=c.xid,
                count=c.count,
            )
        return ClearedXids(tuple(c.xid for c in cleared), remaining)

    def gpu_reset(self, gpu: int | None = None) -> None:
        """``gpu`` (every GPU when None: a reboot) was reset: its critical XIDs are gone and
        its identity and MIG devices are read again."""
        for slot in self._slots or ():
            if gpu is None or slot.reader.index == gpu:
                with self._lock:
                    slot.critical = {}
                slot.reader.refresh_identity()
                slot.target.renew()  # a read begun before the reset is not its answer
        with self._lock:
            if gpu is None:
                self._unslotted_xids = {}
            else:
                self._unslotted_xids.pop(gpu, None)
            # an XID or ECC error right after a reset (the reset did not help) is said at once
            over = self._forget_said(lambda key: gpu is None or key[0] == gpu)
        self._say_the_rest(over, "since it was last said, before the reset")
        self._save_xids()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No tick runs inside (a GPU reset needs the driver to itself); waits for the tick
        in progress, which takes at most two waits for a GPU that does not answer."""
        with self._tick_lock:
            yield

    def _slot(self, gpu: int) -> _Slot:
        for slot in self._slots or ():
            if slot.reader.index == gpu:
                return slot
        raise IndexError(f"no GPU {gpu}")

    def _load_xids(self) -> dict[int, dict[int, CriticalXid]]:
        path = self._xid_state
        if path is None:
            return {}
        try:
            return parse_xid_state(json.loads(path.read_text()))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, AttributeError, KeyError) as err:
            # Which GPUs had an uncleared critical XID is unknown now: they look healthy. The
            # file is kept aside (a later save would overwrite it) and the loss is an event,
            # not only a log line, so that an operator can look before trusting those GPUs.
            aside = keep_aside(path)
            kept = f"kept as {aside}" if aside else "left in place"
            message = (
                f"critical-XID state {path} unreadable ({err}), {kept}: GPUs with an "
                "uncleared critical XID before the restart now look healthy"
            )
            log.error("%s", message)
            self._emit("gpu.xid_state_unreadable", message, path=str(path), kept=str(aside or ""))
            return {}

    def _save_xids(self, *, only_unsaved: bool = False, only_if_due: bool = False) -> None:
        """Write the critical XIDs to ``xid_state``: with ``only_unsaved``, only when a raise
        changed them since the last write; with ``only_if_due``, not within XID_SAVE_S of it."""
        path = self._xid_state
        if path is None:
            return
        # The state is read under the save lock, so of two racing saves the later write
        # carries the newer state.
        with self._xid_save_lock:
            with self._lock:
                now = self._clock()
                if only_unsaved and not self._xids_unsaved:
                    return
                if only_if_due and now - self._xids_saved_at < XID_SAVE_S:
                    return
                self._xids_unsaved = False
                self._xids_saved_at = now
                state = {g: list(t.values()) for g, t in self._unslotted_xids.items() if t}
                for s in self._slots or ():
                    if s.critical:
                        state[s.reader.index] = list(s.critical.values())
            try:
                write_atomically(path, json.dumps(xid_state_document(state)))
            except OSError as err:
                log.warning("cannot save critical-XID state to %s: %s", path, err)

    def _emit(self, kind: str, message: str, **fields: object) -> None:
        if self._events is not None:
            self._events.emit(kind, message, **fields)

    # -- life ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start watching XID/ECC events (``tick`` works without it)."""
        self._xid.start()

    def close(self) -> None:
        """Stop the event watcher and the GPU workers. A worker stuck in the driver is left
        behind (it is a daemon thread); nothing else waits on it. The raises counted but not
        said yet (within :data:`REMIND_S` of the ``gpu.xid``/``gpu.ecc`` that said their
        code) are said now, one event per code with its ``repeats``, as the end of their
        window would: no tick comes after the close to say them. They are said before the
        event watcher is joined, which waits up to ``event_wait_s`` + 1 s on the driver's
        event wait, and the critical XIDs' last counts saved: a second SIGTERM leaves this
        close behind on its daemon thread, and gpud may be gone before the join ends. What the watcher takes in meanwhile is said
        after the join, only on a clean stop (not cut short by a second SIGTERM)."""
        if self._closed:
            return
        self._closed = True
        self._say_every_rest()
        # the storm's last count (raised within a second of the last write), saved before
        # the join too: a second SIGTERM may end gpud before the join does
        self._save_xids(only_unsaved=True)
        self._xid.stop()
        self._say_every_rest()  # the raises the watcher took in during the join
        self._save_xids(only_unsaved=True)  # the storm's last count, raised within a second
        self._dispatcher.close()

    def _say_every_rest(self) -> None:
        """Say what every window still open counted but never said, and forget them all."""
        with self._lock:
            over = self._forget_said(lambda key: True)
        self._say_the_rest(over, "since it was last said, before gpud stopped")

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every ``interval_s`` until ``stop`` is set, off the event loop; then close,
        off it too (the event watcher's thread is joined for up to ``event_wait_s`` + 1 s,
        longer while the driver's event wait hangs: the loop, and a second SIGTERM, never
        wait on it).

        Ticks are scheduled at a fixed rate on the loop's clock; a tick that overruns skips
        the missed slots rather than bursting to catch up.
        """
        loop = asyncio.get_running_loop()
        self._rescheduled = asyncio.Event()
        self.start()
        try:
            slot = loop.time()
            while not stop.is_set():
                try:
                    await asyncio.to_thread(self.tick)
                except Exception:
                    log.exception("sampler tick failed")
                slot = await self._wait_next(slot, stop)
        finally:
            await on_daemon_thread(self.close)

    async def _wait_next(self, slot: float, stop: asyncio.Event) -> float:
        """Wait until ``interval_s`` after ``slot`` (no later than now) or ``stop``; a new
        ``interval_s`` meanwhile measures the wait afresh from ``slot``. The slot waited
        for."""
        loop = asyncio.get_running_loop()
        again = self._rescheduled
        assert again is not None  # set by run()
        while True:
            again.clear()
            now = loop.time()
            next_at = max(slot + self.interval_s, now)
            await wait_first(stop, again, timeout=next_at - now)
            if stop.is_set() or not again.is_set():
                return next_at


def xid_state_document(state: Mapping[int, Sequence[CriticalXid]]) -> dict[str, Any]:
    """The ``xid_state`` file's JSON document (version :data:`XID_STATE_VERSION`)."""
    return {
        "version": XID_STATE_VERSION,
        "gpus": {
            str(gpu): [dataclasses.asdict(c) for c in xids] for gpu, xids in sorted(state.items())
        },
    }


def parse_xid_state(raw: Any) -> dict[int, dict[int, CriticalXid]]:
    """Read an ``xid_state`` document, of this version or version 1 (one code per GPU, when
    and how often unknown). Raises ValueError, TypeError, AttributeError or KeyError on one
    that does not validate."""
    if "version" not in raw:
        return {int(gpu): {int(x): CriticalXid(int(x), 1, 0.0, 0.0)} for gpu, x in raw.items()}
    if raw["version"] != XID_STATE_VERSION:
        raise ValueError(f"version {raw['version']!r}, not {XID_STATE_VERSION}")
    state: dict[int, dict[int, CriticalXid]] = {}
    for gpu, xids in raw["gpus"].items():
        table = state[int(gpu)] = {}
        for x in xids:
            c = CriticalXid(
                int(x["xid"]),
                int(x["count"]),
                float(x["first_seen"]),
                float(x["last_seen"]),
                str(x.get("uuid", "")),
                str(x.get("model", "")),  # absent from a file an older gpud wrote
            )
            table[c.xid] = c
    return state


class XidWatcher:
    """A thread blocked in ``backend.wait_events`` that hands each event to ``on_event``.

    Stops for good when the driver does not support events; retries after ``retry_s`` on
    other driver errors (logged once per outage, and its end once).
    """

    def __init__(
        self,
        backend: GpuBackend,
        on_event: Callable[[GpuEvent], None],
        *,
        wait_s: float = 1.0,
        retry_s: float = 5.0,
    ) -> None:
        self._backend = backend
        self._on_event = on_event
        self._wait_s = wait_s
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpud-xid", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._wait_s + 1.0)

    def _run(self) -> None:
        warned = False
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                events = self._backend.wait_events(self._wait_s)
            except NotSupported as err:
                log.info("GPU events not supported, XIDs will not be counted: %s", err)
                return
            except Exception as err:
                if not warned:  # once per outage, not once per retry
                    log.warning("waiting for GPU events failed, retrying: %s", err)
                    warned = True
                self._stop.wait(self._retry_s)
                continue
            if warned:  # and its end, once
                log.info("waiting for GPU events works again")
            warned = False
            for event in events:
                try:
                    self._on_event(event)
                except Exception:
                    log.exception("handling GPU event %r failed", event)
            if not events and time.monotonic() - started < self._wait_s / 10:
                # A backend that returns at once instead of blocking must not spin a core.
                self._stop.wait(self._wait_s)
