"""Runs every GPU's reads off the calling thread, so that one hung GPU starves no other.

The common case costs two thread hand-offs per tick: one worker thread reads the GPUs one
after the other (a *pass*) while the caller waits. Handing each GPU to its own thread every
tick would cost two hand-offs per GPU and make the readers contend for the GIL, which with
cheap driver calls costs more CPU than the calls themselves.

When a GPU's read runs past ``wait_s`` (the sampler makes it at most half its interval) the
pass is abandoned on that GPU (a call inside the driver cannot be cancelled; its daemon
thread returns when the driver does), the GPU is reported as not answering, and the GPUs
not read yet are each read on a fresh thread of their own within one more ``wait_s``, so
even a driver-wide hang costs a tick two waits, not one per GPU, and the GPUs that answer
keep samples no older than the interval allows. A hung GPU gets no new call until its
stuck one has returned.

Timeouts use the real monotonic clock: they bound real waits, not simulated time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from gpud.telemetry.snapshot import GpuSample
from gpud.telemetry.worker import Worker

Read = Callable[[], GpuSample]
Result = GpuSample | BaseException  # what a read returned or raised


class Target:
    """One GPU to read: its read function and whether a call on it is still stuck."""

    __slots__ = ("busy", "index", "read")

    def __init__(self, index: int, read: Read) -> None:
        self.index = index
        self.read = read
        self.busy = False  # True while a read runs; stays True while it is stuck


class _Pass:
    """Reads several targets one after the other on one thread.

    ``finished`` is held from creation until the pass ends, so the caller waits for it with
    one ``acquire(timeout=...)``: the cheapest wait there is (a tick waits for one pass).
    """

    __slots__ = (
        "abandoned",
        "complete",
        "current",
        "finished",
        "lock",
        "results",
        "started",
        "targets",
    )

    def __init__(self, targets: Sequence[Target]) -> None:
        self.targets = targets
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
                    target.busy = True
                try:
                    result: Result = target.read()
                except BaseException as err:  # reported as that GPU's result
                    result = err
                with lock:
                    target.busy = False
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

    def __init__(self, wait_s: float, name: str = "gpud-sampler") -> None:
        self.wait_s = wait_s
        self._name = name
        self._worker = Worker(name)
        self._spare = 0

    def read(self, targets: Sequence[Target]) -> dict[int, Result]:
        """Results by GPU index; a GPU missing from the result is hung (stuck or timed out)."""
        todo = [t for t in targets if not t.busy]
        if not todo:
            return {}
        p = _Pass(todo)
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
            p = _Pass((target,))
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

    def close(self) -> None:
        self._worker.close()
