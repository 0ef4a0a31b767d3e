"""The structured event log: decisions the daemon took, for people and for scripts.

Each event is one JSON line in ``<state_dir>/events.jsonl`` (rotated at ``max_bytes``) and is
kept in a short in-memory ring that ``gpuctl`` and the metrics read. Events also go to the
``gpud.events`` logger, so journald has them too.

Each event said gets the next sequence number (``seq``), kept in its line, so that numbers
go on across restarts: a watcher (:meth:`EventLog.watch`, ``gpuctl events --follow``) resumes
after the last one it saw (by its time instead, where the numbers were given again). A watcher has a bounded buffer of its own: one that reads too
slowly misses events (counted), and never slows the thread that emits.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpud.files import STATE_FILE_MODE
from gpud.shared import is_about

log = logging.getLogger("gpud.events")
_watch_log = logging.getLogger("gpud.events.watch")  # about watchers, not an event


@dataclass(frozen=True, slots=True)
class Event:
    """One decision: ``kind`` is a dotted name (``mig.apply``, ``gpu.unhealthy``, ...)."""

    time: float
    kind: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)
    seq: int = 0  # its number in the log, from 1; 0: not said yet, or a line without one

    def to_json(self) -> str:
        head: dict[str, Any] = {"seq": self.seq} if self.seq else {}
        return json.dumps(
            {**head, "time": self.time, "kind": self.kind, "message": self.message, **self.fields},
            sort_keys=True,
            default=str,
        )


DEFAULT_WATCH_BUFFER = 1000  # events a watcher may be behind before it misses some
# seq is a uint64 in the API; a line's larger number (a hand-edited file) is taken as none
_MAX_SEQ = 2**63


def _matches(event: Event, kind_prefix: str, gpu: str, job: str) -> bool:
    """Whether ``event`` passes the filters of ``gpuctl events`` (and of a watcher)."""
    return event.kind.startswith(kind_prefix) and is_about(event.fields, gpu=gpu, job=job)


class Watcher:
    """One reader of new events (:meth:`EventLog.watch`): those matching its filters wait in
    a buffer of at most ``buffer`` events; past that they are counted as missed, never
    kept. ``wake`` is called (from the emitting thread) when its buffer, empty, is given an
    event, and when the log closes its watchers."""

    def __init__(
        self, kind_prefix: str, gpu: str, job: str, wake: Callable[[], None], buffer: int
    ) -> None:
        self._filters = (kind_prefix, gpu, job)
        self._wake = wake
        self._buffer: deque[Event] = deque()
        self._size = max(1, buffer)
        self._missed = 0
        self._closed = False

    def _matches(self, event: Event) -> bool:
        return _matches(event, *self._filters)

    def _offer(self, event: Event) -> bool:
        """Under the log's lock: keep ``event`` if it matches and there is room. True when
        the watcher is to be woken: its buffer was empty (a wake is pending otherwise)."""
        if not self._matches(event):
            return False
        if len(self._buffer) < self._size:
            self._buffer.append(event)
            return len(self._buffer) == 1
        self._missed += 1
        return False


class EventLog:
    """Append-only event log with an in-memory ring of the latest ``keep`` events."""

    def __init__(
        self,
        path: Path | None,
        *,
        keep: int = 1000,
        max_bytes: int = 16 * 1024 * 1024,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: the events' times; ``monotonic``: when the write under way began
        (:meth:`pending`)."""
        self._path = path
        self._max_bytes = max_bytes
        self._clock = clock
        self._ring: deque[Event] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._write_errors = 0  # events whose line the file did not get, since start
        # one emitter at a time writes the file (under _lock: whether one does), outside
        # _lock, so that a hung disk holds back neither a reader (a /metrics scrape, gpuctl
        # events) nor another emitter (the event loop): theirs are queued for it to write
        self._writing = False
        self._written = threading.Condition(self._lock)  # notified when _writing ends
        self._lines: deque[str] = deque()  # said, in order, not written yet (under _lock)
        self._monotonic = monotonic
        self._write_began: float | None = None  # the write under way (by the writer)
        # why the outage going on began (the first line not written) and how many lines the
        # file did not get in it: one tuple, set whole by the writer, so that a reader
        # without the lock never gets a count without its reason
        self._outage: tuple[str, int] = ("", 0)
        self._held = threading.local()  # this thread's events held by until_committed
        self._watchers: list[Watcher] = []
        self._watching_ended = False  # close_watchers was called: the daemon stops
        self._seq = 0  # the last number given
        # a line torn by a crash would swallow the first line appended after it
        self._torn = False
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._ring.extend(_read_tail(path, keep))
            self._torn = _ends_torn(path)
            # just rotated: the numbers go on from the rotated file's last line
            tail = self._ring or _read_tail(path.with_suffix(".jsonl.1"), 1)
            self._seq = max((e.seq for e in tail), default=0)

    @property
    def path(self) -> Path | None:
        """The file the events are appended to; None: the ring and the journal only."""
        return self._path

    def emit(self, kind: str, message: str, **fields: Any) -> Event:
        """Say an event (held inside :meth:`until_committed`); the event said, with its
        ``seq``, or the one held (``seq`` 0)."""
        event = Event(self._clock(), kind, message, fields)
        held: list[Event] | None = getattr(self._held, "events", None)
        if held is not None:
            held.append(event)  # said once its transaction commits (until_committed)
            return event
        return self._say(event)

    @contextmanager
    def until_committed(self) -> Iterator[None]:
        """Hold back what this thread emits inside, to say it once the block ends without
        an error, and drop it if the block raises. Around a store transaction
        (``with events.until_committed(), store.transaction():``), events of the changes it
        makes (a removal hook's ``admission.leave``) are said only once they are committed:
        a failed commit (disk full) leaves no event of what did not happen. Nested, the
        outermost block says them all."""
        outer: list[Event] | None = getattr(self._held, "events", None)
        mine: list[Event] = []
        self._held.events = mine
        try:
            yield
        finally:
            self._held.events = outer
        if outer is not None:
            outer.extend(mine)
            return
        for event in mine:
            self._say(event)

    def _say(self, event: Event) -> Event:
        kind, message = event.kind, event.message
        with self._lock:
            self._seq += 1
            event = Event(event.time, kind, message, event.fields, self._seq)
            line = event.to_json()
            self._ring.append(event)
            self._counts[kind] = self._counts.get(kind, 0) + 1
            writes = False
            if self._path is not None:
                self._lines.append(line)
                writes, self._writing = not self._writing, True
            woken = [w for w in self._watchers if w._offer(event)]
        _wake_all(woken)
        # the journal first: it has the event even while the file's disk hangs
        log.info("%s: %s", kind, message, extra={"event": line})
        if writes:
            self._write_lines()
        return event

    def watch(
        self,
        wake: Callable[[], None],
        *,
        limit: int = 100,
        kind_prefix: str = "",
        gpu: str = "",
        job: str = "",
        after_seq: int = 0,
        after_time: float = 0.0,
        buffer: int = DEFAULT_WATCH_BUFFER,
    ) -> tuple[Watcher, list[Event], int]:
        """A new :class:`Watcher` with these filters, the events it starts from, and how
        many events (of every kind) before them it cannot have: the newest ``limit`` as
        :meth:`recent` gives them; with ``after_seq`` (the last event a watcher before it
        saw, from this log or one before a restart), every kept event after it instead,
        and the count of those after it the ring no longer keeps.

        ``after_time`` (that event's time) checks the number: where it was given again
        since (writes to the file failed, so the next gpud did not read them back; the file
        was removed), a kept event numbered up to ``after_seq`` is later than it, or the
        log's last number is below it. Then every kept event later than ``after_time`` is
        given instead (none counted as lost). Without ``after_time``, an ``after_seq``
        past the last number given is taken as none. Nothing is said between the start
        events and the watcher's first. :meth:`unwatch` it when done."""
        watcher = Watcher(kind_prefix, gpu, job, wake, buffer)
        with self._lock:
            if self._watching_ended:  # a watch that came as gpud stops: it ends at once too
                watcher._closed = True
            else:
                self._watchers.append(watcher)
            ring = list(self._ring)
            seq = self._seq
        if after_seq > 0:
            reused = after_seq > seq or any(
                e.seq <= after_seq and e.time > after_time for e in ring if after_time > 0
            )
            if not reused:
                kept = [e for e in ring if e.seq > after_seq]
                first = kept[0].seq if kept else seq + 1
                gap = max(0, first - after_seq - 1)
                return watcher, [e for e in kept if watcher._matches(e)], gap
            if after_time > 0:
                return watcher, [e for e in ring if e.time > after_time and watcher._matches(e)], 0
        return watcher, [e for e in ring if watcher._matches(e)][-limit:], 0

    def take(self, watcher: Watcher) -> tuple[list[Event], int, bool]:
        """What ``watcher`` was given since the last take: the events, then how many it
        missed after them, and whether the log closed its watchers (then it is done)."""
        with self._lock:
            events = list(watcher._buffer)
            watcher._buffer.clear()
            missed, watcher._missed = watcher._missed, 0
            return events, missed, watcher._closed

    def unwatch(self, watcher: Watcher) -> None:
        with self._lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def close_watchers(self) -> None:
        """End every watcher (the daemon stops): each is woken, and its next :meth:`take`
        says it is done once its buffer is empty. A watcher made later is done from the start
        (after its start events), not left open until the API's grace cuts its stream."""
        with self._lock:
            self._watching_ended = True
            watchers, self._watchers = self._watchers, []
            for watcher in watchers:
                watcher._closed = True
        _wake_all(watchers)

    def recent(
        self, limit: int = 100, kind_prefix: str = "", *, gpu: str = "", job: str = ""
    ) -> list[Event]:
        """The newest ``limit`` events of kinds starting with ``kind_prefix``; with ``gpu``
        or ``job``, only those about it (:func:`is_about`), counted after the filter."""
        with self._lock:
            events = [e for e in self._ring if _matches(e, kind_prefix, gpu, job)]
        return events[-limit:]

    def counts(self) -> dict[str, int]:
        """Events emitted since start, by kind."""
        return self.tallies()[0]

    def tallies(self) -> tuple[dict[str, int], int]:
        """Events emitted since start, by kind (for ``gpud_events_total``), and those whose
        line could not be written to the file (``gpud_event_log_write_errors_total``: the
        ring and the journal still have them), read at once. It never waits for the file's
        disk."""
        with self._lock:
            return dict(self._counts), self._write_errors

    def write_problem(self) -> tuple[Path, str, int] | None:
        """While the file's writes fail (full disk, read-only file system, a directory in
        its place): the file, why its first failed write failed (the kernel's ``strerror``:
        ``No space left on device``), and how many lines it lacks since (the journal and
        the ring have them); None while they succeed. Read without waiting for the file's
        disk."""
        why, missed = self._outage
        if self._path is None or not missed:
            return None
        return self._path, why, missed

    def pending(self) -> tuple[int, float | None]:
        """Lines said and not yet in the file (the one being written, and those queued
        behind it), and when the write under way began (``monotonic``; None while none
        runs): a hung disk fails no write, it only lets these grow. Read without the lock
        nor the file, so a status read never waits for the writer."""
        began = self._write_began
        return len(self._lines) + (began is not None), began

    def flush(self, wait_s: float) -> bool:
        """Wait, at most ``wait_s``, until every line said is written to the file (or its
        write failed); whether it was. The daemon's stop calls it after its last event; one
        still queued then (the file's disk hangs) is said in a warning: the journal has it.
        Lines a writer that raised (not an ``OSError``) left for the next emitter, which at
        the stop does not come, are written by a thread of its own, still within
        ``wait_s``."""
        deadline = time.monotonic() + max(0.0, wait_s)
        with self._written:
            while self._writing or self._lines:
                if not self._writing:
                    self._writing = True
                    threading.Thread(
                        target=self._write_left, name="event-log-flush", daemon=True
                    ).start()
                left_s = deadline - time.monotonic()
                if left_s <= 0 or not self._written.wait(left_s):
                    break
            else:
                return True
            left = len(self._lines) + self._writing  # and the one being written
        log.warning(
            "the event log %s: %d lines not written at the stop (its disk hangs?); the "
            "journal has them",
            self._path,
            left,
        )
        return False

    def _write_left(self) -> None:
        """By :meth:`flush`: write the lines a writer that raised left behind, as the next
        emitter would; one that raises again loses its line (counted), the rest are taken
        up by the flush once more."""
        try:
            self._write_lines()
        except Exception:
            log.exception("cannot write the event log %s", self._path)

    def _write_lines(self) -> None:
        """By the emitter that set ``_writing``: write the lines said and not yet written,
        in their order, outside ``_lock``, those said meanwhile too, until none is left."""
        while True:
            with self._lock:
                if not self._lines:
                    self._writing = False
                    self._written.notify_all()
                    return
                line = self._lines.popleft()
            self._write_began = self._monotonic()
            try:
                written = self._write(line)
            except BaseException:
                self._write_began = None  # not an OSError: the next emitter writes what is left
                with self._lock:
                    self._write_errors += 1
                    self._writing = False
                    self._written.notify_all()
                raise
            self._write_began = None
            if not written:
                with self._lock:
                    self._write_errors += 1

    def _write(self, line: str) -> bool:
        """Append ``line`` to the file (by the one writer); whether it was. A failed
        write (disk full, read-only) keeps the event in the ring and the journal; it warns
        once per outage, not once per event, and says at its end how many lines the file
        lacks."""
        assert self._path is not None
        data = (("\n" if self._torn else "") + line + "\n").encode()
        try:
            self._rotate_if_needed()
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
            fd, size = _append(str(self._path), flags)
            try:
                _append_whole(fd, data, size)
            finally:
                os.close(fd)
            self._torn = False
        except OSError as err:
            # as the file ends now: as before when the part written was cut off again
            self._torn = _ends_torn(self._path)
            why, missed = self._outage
            if not missed:
                log.warning("cannot write the event log %s: %s", self._path, err)
                why = err.strerror or str(err)
            self._outage = (why, missed + 1)
            return False
        if missed := self._outage[1]:
            log.warning(
                "the event log %s is written again; it lacks the %d events said while it "
                "could not be (the journal has them)",
                self._path,
                missed,
            )
        self._outage = ("", 0)
        return True

    def _rotate_if_needed(self) -> None:
        assert self._path is not None
        try:
            if self._path.stat().st_size < self._max_bytes:
                return
        except FileNotFoundError:
            return
        self._path.replace(self._path.with_suffix(".jsonl.1"))


def _wake_all(watchers: list[Watcher]) -> None:
    """Wake each of ``watchers``: one whose wake fails (its stream's loop closed) neither
    stops the others nor the thread that emitted."""
    for watcher in watchers:
        try:
            watcher._wake()
        except Exception:
            _watch_log.exception("cannot wake an event watcher")


def _append(path: str, flags: int) -> tuple[int, int]:
    """Open the log to append, a new (empty) one with :data:`STATE_FILE_MODE` whatever the
    umask; one that has lines keeps its mode. The descriptor, and the file's size as opened
    (what :func:`_append_whole` cuts a part-written line back to)."""
    fd = os.open(path, flags | os.O_NOFOLLOW, STATE_FILE_MODE)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            os.fchmod(fd, STATE_FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd, size


def _append_whole(fd: int, data: bytes, size: int) -> None:
    """Append ``data`` to ``fd`` (opened O_APPEND, by the log's one writer), or none of it.
    A disk that fills (ENOSPC, EFBIG, EDQUOT) writes what fits before it refuses the rest,
    and that part of a line would stay in the file as a line no reader parses (``jq``, a
    log shipper): the file is truncated to ``size``, its size before the write (the log's one
    writer appends nothing between the open and the write), which frees what the part took,
    and the error raised."""
    done = 0
    try:
        while done < len(data):
            done += os.write(fd, data[done:])
    except OSError:
        if done:
            with suppress(OSError):  # the next line begins on a line of its own
                os.ftruncate(fd, size)
        raise


def _ends_torn(path: Path) -> bool:
    """Whether ``path`` ends in a line without its newline (a write cut by a crash, or
    one a full disk cut that could not be cut off again)."""
    try:
        with path.open("rb") as fh:
            if fh.seek(0, 2) == 0:
                return False
            fh.seek(-1, 2)
            return fh.read(1) != b"\n"
    except OSError:
        return False


def _read_tail(path: Path, keep: int) -> list[Event]:
    """The last ``keep`` events of an earlier run, so ``gpuctl events`` spans restarts.
    Lines that do not parse (a torn last write, bytes that are not UTF-8, a time that is no
    finite number: gpuctl prints it as a date) are skipped; a ``seq`` that is no number
    from 0 to 2**63 - 1 is taken as none."""
    try:
        with path.open(encoding="utf-8", errors="replace") as fh:
            lines = deque(fh, maxlen=keep)
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            data = json.loads(line)
            when, kind, message = data.pop("time"), data.pop("kind"), data.pop("message")
            seq = data.pop("seq", 0)  # absent from a line of a gpud before the field
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < _MAX_SEQ:
            seq = 0
        if (
            isinstance(when, int | float)
            and not isinstance(when, bool)
            and math.isfinite(when)
            and isinstance(kind, str)
            and isinstance(message, str)
        ):
            events.append(Event(float(when), kind, message, data, seq))
    return events
