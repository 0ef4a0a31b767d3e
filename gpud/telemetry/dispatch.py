"""Runs every GPU's reads off the calling thread, so that one hung GPU starves no other.

The common case costs two thread hand-offs per tick: one worker thread reads the GPUs one
after the other (a *pass*) while the caller waits. Handing each GPU to its own thread every
tick would cost two hand-offs per GPU and make the readers contend for the GIL, which with
cheap driver calls costs more CPU than the calls themselves.

When a GPU's read runs past ``wait_s`` (the sampler makes it at most half its interval) the
pass is abandoned on that GPU (a call inside the driver cannot be cancelled; its daemon
thread returns when the driver does), and the GPUs not read yet are each read on a fresh
thread of their own within one more ``wait_s``, so even a driver-wide hang costs a tick two
waits, not one per GPU, and the GPUs that answer keep samples no older than the interval
allows. A GPU whose call is still outstanding gets no new call until it has returned.

A call outstanding past ``wait_s`` is late, not yet hung: on a host whose cores are all
busy (data loaders), gpud's threads wait for a CPU and every GPU's calls take longer
together. :meth:`Dispatcher.not_answering` judges it hung only once another GPU answered a
call begun after it (the process runs and the driver answers, but not for this GPU), or
once it has been outstanding ``hung_after_s`` (every GPU hung at once, or a node with one).

Timeouts use the real monotonic clock: they bound real waits, not simulated time. How long a
call has been outstanding is measured on the injected ``clock`` (the sampler's).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Collection, Sequence

from gpud.telemetry.snapshot import GpuSample
from gpud.telemetry.worker import Worker

Read = Callable[[], GpuSample]
Result = GpuSample | BaseException  # what a read returned or raised


class Target:
    """One GPU to read: its read function and whether a call on it is still stuck."""

    __slots__ = ("answered", "busy", "index", "read", "since", "started")

    def __init__(self, index: int, read: Read) -> None:
        self.index = index
        self.read = read
        self.busy = False  # True while a read runs; stays True while it is stuck
        # the order its latest read began in, among every GPU's reads, and when (the
        # dispatcher's clock); ``answered``: ``started`` of its latest read that returned
        self.started = 0
        self.since = 0.0
        self.answered = 0

    def outstanding(self) -> bool:
        """Whether its latest read began and has not returned (stuck or slow)."""
        return self.answered < self.started


class _Pass:
    """Reads several targets one after the other on one thread.

    ``finished`` is held from creation until the pass ends, so the caller waits for it with
    one ``acquire(timeout=...)``: the cheapest wait there is (a tick waits for one pass).
    """

    __slots__ = (
        "abandoned",
        "begin",
        "complete",
        "current",
        "finished",
        "lock",
        "results",
        "started",
        "targets",
    )

    def __init__(self, targets: Sequence[Target], begin: Callable[[Target], None]) -> None:
        self.targets = targets
        self.begin = begin  # stamps a read as it begins (called under ``lock``)
        self.results: dict[int, Result] = {}
        self.lock = threading.Lock()  # guards the fields below and the targets' ``busy``
        self.current: Target | None = None
        self.started = 0.0
        self.abandoned = False
        self.complete = False
        self.finished = threading.Lock()
        self.finished.acquire()

    def run(self) -> None:
        lock = self.lock
        results = self.results
        try:
            for target in self.targets:
                with lock:
                    if self.abandoned:
                        return
                    self.current = target
                    self.started = time.monotonic()
                    self.begin(target)
                    target.busy = True
                try:
                    result: Result = target.read()
                except BaseException as err:  # reported as that GPU's result
                    result = err
                with lock:
                    target.busy = False
                    # also when given up on: a late answer still shows the GPU answers
                    target.answered = target.started
                    if self.abandoned:
                        return  # the caller gave up on this read: its values are stale
                    results[target.index] = result
                    self.current = None
            with lock:
                self.complete = True
        finally:
            self.finished.release()  # last: the waiting caller finds this thread idle

    def wait(self, timeout_s: float) -> bool:
        """Whether the pass ended within ``timeout_s``."""
        return self.finished.acquire(timeout=max(0.0, timeout_s))

    def abandon_if_overdue(self, timeout_s: float) -> Target | None:
        """Give up on the target being read if it started ``timeout_s`` ago; return it."""
        with self.lock:
            if self.complete or self.current is None:
                return None
            if time.monotonic() - self.started < timeout_s:
                return None
            self.abandoned = True
            return self.current

    def next_deadline(self, timeout_s: float) -> float:
        with self.lock:
            if self.current is None:  # between two targets
                return time.monotonic() + 0.001
            return self.started + timeout_s


class Dispatcher:
    """Reads targets, waiting at most ``wait_s`` for a GPU that does not answer (see the
    module doc). ``wait_s`` may be changed between reads."""

    def __init__(
        self,
        wait_s: float,
        name: str = "gpud-sampler",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.wait_s = wait_s
        self._name = name
        self._clock = clock
        self._order = itertools.count(1)
        self._worker = Worker(name)
        self._spare = 0

    def read(self, targets: Sequence[Target]) -> dict[int, Result]:
        """Results by GPU index; a GPU missing from the result is hung (stuck or timed out)."""
        todo = [t for t in targets if not t.busy]
        if not todo:
            return {}
        p = _Pass(todo, self._begin)
        if not self._worker.submit(p.run):
            return {}  # closed (gpud is stopping): no GPU is read, each reported hung
        timeout = self.wait_s
        wait_s = timeout
        while not p.wait(wait_s):
            hung = p.abandon_if_overdue(timeout)
            if hung is None:
                wait_s = p.next_deadline(timeout) - time.monotonic()
                continue
            # The worker is stuck in the driver: it exits when the call returns.
            self._worker.close()
            self._worker = Worker(self._name)
            results = dict(p.results)
            rest = todo[todo.index(hung) + 1 :]
            results.update(self._fan_out(rest, timeout))
            return results
        return p.results

    def _fan_out(self, targets: Sequence[Target], timeout: float) -> dict[int, Result]:
        passes: list[_Pass] = []
        for target in targets:
            # stamped here, in the order of the GPUs: a GPU after a hung one that answers
            # shows it hung, whichever thread the OS happens to run first
            self._begin(target)
            p = _Pass((target,), _stamped)
            self._spare += 1
            worker = Worker(f"{self._name}-{self._spare}")
            worker.submit(p.run)
            worker.close()  # the thread ends after this one read
            passes.append(p)
        deadline = time.monotonic() + timeout
        results: dict[int, Result] = {}
        for p in passes:
            if not p.wait(deadline - time.monotonic()):
                # Only abandon a read that is still running; one that finished meanwhile counts.
                with p.lock:
                    if not p.results:
                        p.abandoned = True
                        continue
            results.update(p.results)
        return results

    def not_answering(self, targets: Collection[Target], hung_after_s: float) -> set[int]:
        """The indexes of the targets whose call is outstanding and judged hung: another
        target answered a call begun after it, or it has been outstanding ``hung_after_s``
        on the dispatcher's clock. A call outstanding while no other GPU answered is late,
        not hung: the threads waiting in the driver (or for a CPU) are all slow together."""
        now = self._clock()
        hung: set[int] = set()
        for target in targets:
            if not target.outstanding():
                continue
            latest = max((t.answered for t in targets if t is not target), default=0)
            if latest > target.started or now - target.since >= hung_after_s:
                hung.add(target.index)
        return hung

    def _begin(self, target: Target) -> None:
        target.started = next(self._order)
        target.since = self._clock()

    def close(self) -> None:
        self._worker.close()


def _stamped(target: Target) -> None:
    """A fan-out read, stamped by the dispatcher when it handed the read to its thread."""
