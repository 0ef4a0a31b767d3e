"""Runs every GPU's reads off the calling thread, so that one hung GPU starves no other.

The common case costs two thread hand-offs per tick: one worker thread reads the GPUs one
after the other (a *pass*) while the caller waits. Handing each GPU to its own thread every
tick would cost two hand-offs per GPU and make the readers contend for the GIL, which with
cheap driver calls costs more CPU than the calls themselves.

When a GPU's read runs past ``wait_s`` (the sampler makes it at most half its interval) the
pass is abandoned on that GPU (a call inside the driver cannot be cancelled; its daemon
thread returns when the driver does), the GPU's read is *late*, and the GPUs not read yet
are each read on a fresh thread of their own within one more ``wait_s``, so even a
driver-wide hang costs a tick two waits, not one per GPU, and the GPUs that answer keep
samples no older than the interval allows. A GPU whose call is outstanding gets no
new call until it has returned.

Whether a late read is hung is judged by :meth:`Dispatcher.late_answer`, by this rule:

    A GPU whose read passed its deadline is not answering at once when no other GPU's read
    begun in that tick or since is late too (a GPU hung alone, or on a node of one GPU, is
    found in the tick it hangs, as before), and otherwise (reads late together, as when the
    host starves gpud of CPU) as soon as another GPU answers within its deadline a read
    handed out in a later tick than this one, or once it has been outstanding
    ``call_timeout_s``; once found hung it stays so until its call returns. Only a read that
    returned a sample without a driver error, begun since the GPU's last reset or MIG change
    made through gpud (:meth:`Target.renew`), is an answer, to show or to prove another GPU
    hung: a late GPU shows its last answer, and one with none since its last failure, reset
    or MIG change is not answering at the deadline.

Starvation slows the threads of the process, so a read late with others is slow, not stuck;
a hung call never returns, which a read of another GPU in a later tick, answered in time,
shows while it is still outstanding. An answer in time within the same tick proves nothing:
a host starved unevenly (a CPU quota's throttle window ending mid-tick, the GIL handed to
some threads before others, a costlier read) lets some reads of one burst finish in time
and not others, so several GPUs hung at once are found one interval later, by the next
tick's reads. A read whose GPU was reset or changed through gpud while it ran is read again
once (its reader reads the GPU's identity anew), and that one's sample taken; one changed
again during that read is :class:`Superseded`.

Waits use the real monotonic clock: they bound real waits. How long a read has been
outstanding (against ``call_timeout_s``) is measured on the injected ``clock``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal

from gpud.telemetry.snapshot import GpuSample
from gpud.telemetry.worker import Worker

Read = Callable[[], GpuSample]
Result = GpuSample | BaseException  # what a read returned or raised
Outcome = Literal["", "answer", "failed", "dropped"]


class Superseded(Exception):
    """A read whose GPU was reset or MIG-changed through gpud during it and again during the
    read made anew: it returned, but no sample of the GPU as it is now; read next tick."""


def is_answer(result: Result) -> bool:
    """Whether ``result`` answers for its GPU: a sample read without a driver error (the
    reader makes a sample unhealthy for each error the driver returned)."""
    return isinstance(result, GpuSample) and result.healthy


class Target:
    """One GPU to read: its read function, whether a call on it is still stuck, and how its
    latest read went (guarded by ``lock``), which :meth:`Dispatcher.late_answer` judges."""

    __slots__ = (
        "began",
        "busy",
        "deadline",
        "entered",
        "generation",
        "hung",
        "in_time_tick",
        "index",
        "last",
        "late",
        "lock",
        "outcome",
        "read",
        "since",
        "tick",
    )

    def __init__(self, index: int, read: Read) -> None:
        self.index = index
        self.read = read
        self.busy = False  # True while a read runs; stays True while it is stuck
        self.lock = threading.Lock()
        self.generation = 0  # one more at each reset or MIG change of the GPU (renew)
        # its latest read: the tick it was handed out in and when (the dispatcher's clock),
        # whether it called the driver (a starved thread may not have begun by the deadline),
        # whether it passed its deadline, and how it returned ("" while it has not)
        self.tick = -1
        self.since = 0.0
        self.entered = False
        self.late = False
        self.outcome: Outcome = ""
        # when its latest read was handed out and its deadline, on the real monotonic clock:
        # the order of reads and deadlines is what tells a starved host from a hung GPU
        self.began = 0.0
        self.deadline = 0.0
        self.hung = False  # its outstanding read was judged hung: until it returns
        self.last: GpuSample | None = None  # its latest answer; None after a failure or renew
        # the tick of its latest read that answered within its deadline; -1: never
        self.in_time_tick = -1

    def renew(self) -> None:
        """The GPU was reset or its MIG layout changed through gpud: no read begun before is
        its answer (a read running now is read again once it returns)."""
        with self.lock:
            self.generation += 1
            self.last = None

    def _begin(self, tick: int, now: float, began: float, wait_s: float, entered: bool) -> None:
        with self.lock:
            self.tick, self.since, self.entered = tick, now, entered
            self.began, self.deadline = began, began + wait_s
            self.late = self.hung = False
            self.outcome = ""

    def _mark_late(self) -> None:
        with self.lock:
            self.late = True


def _read(target: Target, clock: Callable[[], float]) -> tuple[Result, bool]:
    """Read ``target`` (again once if it was renewed meanwhile); its result and whether that
    is of a read begun since the last renew (else it is dropped)."""
    with target.lock:
        target.entered = True
        generation = target.generation
    result: Result = RuntimeError("not read")
    for attempt in range(2):
        if attempt:
            # a read made anew is judged as begun now: its own deadline and time outstanding
            now, began = clock(), time.monotonic()
            with target.lock:
                wait_s = target.deadline - target.began
                target.since, target.began, target.deadline = now, began, began + wait_s
        try:
            result = target.read()
        except BaseException as err:  # reported as that GPU's result
            result = err
        returned = time.monotonic()
        with target.lock:
            target.hung = False  # the call returned: it was not stuck
            if target.generation == generation:
                if is_answer(result):
                    assert isinstance(result, GpuSample)
                    target.outcome, target.last = "answer", result
                    if returned <= target.deadline:
                        target.in_time_tick = target.tick
                else:
                    target.outcome, target.last = "failed", None
                return result, True
            generation = target.generation
    with target.lock:
        target.outcome = "dropped"
    return result, False


class _Pass:
    """Reads several targets one after the other on one thread.

    ``finished`` is held from creation until the pass ends, so the caller waits for it with
    one ``acquire(timeout=...)``: the cheapest wait there is (a tick waits for one pass).
    """

    __slots__ = (
        "abandoned",
        "clock",
        "complete",
        "current",
        "finished",
        "lock",
        "results",
        "stamped",
        "started",
        "targets",
        "tick",
        "wait_s",
    )

    def __init__(
        self,
        targets: Sequence[Target],
        tick: int,
        clock: Callable[[], float],
        wait_s: float,
        stamped: bool = False,
    ) -> None:
        self.targets = targets
        self.tick = tick
        self.clock = clock
        self.wait_s = wait_s
        self.stamped = stamped  # the targets' reads were stamped as handed out
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
                    if not self.stamped:
                        # under the pass lock: a deadline passing before the read is stamped
                        # marks this read late, not the GPU's previous one (which the stamp
                        # would then make not late, judged by its stale outcome)
                        target._begin(
                            self.tick, self.clock(), self.started, self.wait_s, entered=False
                        )
                result, fresh = _read(target, self.clock)
                with lock:
                    target.busy = False
                    if self.abandoned:
                        return  # the caller gave up on this read: the tick has ended
                    if fresh:
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
            self.current._mark_late()
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
        self._tick = 0
        self._worker = Worker(name)
        self._spare = 0

    def read(self, targets: Sequence[Target]) -> dict[int, Result]:
        """Results by GPU index; a GPU missing from the result is late or hung (stuck or
        timed out): :meth:`late_answer` tells which."""
        self._tick += 1
        todo = [t for t in targets if not t.busy]
        if not todo:
            return {}
        p = _Pass(todo, self._tick, self._clock, self.wait_s)
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
        # one stamp for them all: they are begun together, none before another
        now, began = self._clock(), time.monotonic()
        for target in targets:
            # stamped as handed out: a thread the OS has not run by the deadline is late
            # without having called the driver
            target._begin(self._tick, now, began, timeout, entered=False)
            p = _Pass((target,), self._tick, self._clock, timeout, stamped=True)
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
                        p.targets[0]._mark_late()
                        continue
            results.update(p.results)
        return results

    def late_answer(
        self, target: Target, targets: Sequence[Target], hung_after_s: float
    ) -> GpuSample | Superseded | None:
        """What ``target``, which has no result from the last :meth:`read`, shows: its last
        answer while its read is late and not judged hung (the module doc has the rule);
        :class:`Superseded` where its read returned none of the GPU as it is now; else None:
        it is not answering. ``targets``: every GPU's, ``hung_after_s``: the longest a read
        may be outstanding (``telemetry.call_timeout_s``) on the dispatcher's clock."""
        with target.lock:
            late, outcome, entered, hung = target.late, target.outcome, target.entered, target.hung
            last, tick, since = target.last, target.tick, target.since
        if outcome == "dropped":
            return Superseded(f"GPU {target.index}: reset or MIG-changed twice during one read")
        if not late or last is None or outcome == "failed":
            return None
        if outcome == "answer" or not entered:
            # it answered after its deadline (its latest sample), or its thread had not begun
            # by then: the GPU was not called, and is read again next tick
            return last
        if hung or self._clock() - since >= hung_after_s:
            return self._judged_hung(target, tick)
        # Only an answer within its deadline to a read of a later tick shows that the host
        # runs gpud: the reads of one burst are starved unevenly, some in time, some not.
        together = proven = False
        for other in targets:
            if other is target:
                continue
            with other.lock:
                if other.tick >= tick and other.late and other.outcome in ("", "answer"):
                    together = True
                proven = proven or other.in_time_tick > tick
        if not together or proven:
            return self._judged_hung(target, tick)
        return last

    @staticmethod
    def _judged_hung(target: Target, tick: int) -> None:
        """Keep ``target``'s read of ``tick`` hung until it returns: reads of other GPUs
        late later (a host starved since) do not show that a stuck call is not stuck."""
        with target.lock:
            if target.tick == tick and target.outcome == "":
                target.hung = True

    def close(self) -> None:
        self._worker.close()
