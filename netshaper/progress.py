"""Normalized progress rates of training jobs from their iteration reports.

A job reports ``(iteration, at)``: the number of iterations it has completed and when the
last one completed (any monotonic clock, in seconds). Reports may arrive every iteration or
only now and then; the estimate uses counts, so a missing report costs precision, not
correctness.

The progress rate is ``r = T* / T`` in (0, 1], blended with the job's long-run rate (see
the last point):

* ``T`` is the observed iteration time over a sliding window of progress points (the
  reports where the counter advanced): ``(t_last - t_first) / (n_last - n_first)``. A
  window average is robust to per-iteration jitter and to batched reports. The window
  spans at least ``min_iterations`` iterations however long they take: a job whose
  iterations outlast the window would otherwise be judged on its last iteration alone,
  which its own level just shaped (a job moved up runs one fast iteration, looks fast and
  moves down, and so on).
* ``T*`` is the contention-free iteration time. A job may declare it (profiled alone);
  otherwise it is learned as the best per-report sample seen (the fastest stretch between
  two reports), so it never exceeds what was observed.
* A job that stops reporting is slower than its last estimate says: the time since its
  last progress point lower-bounds the current iteration time. With few iterations in the
  window (long ones), that open iteration is the evidence, and ``r`` decays as
  ``T* / (now - t_last)`` once that exceeds ``T``. Once the window holds at least
  ``stall_iterations`` iterations, the open one is counted as ending now together with the
  last ``stall_iterations`` before it, ``T = (now - t_{n-k}) / (k + 1)``: a job that ran five
  iterations in one tick on a high level and then waited one tick on a low level has made
  about half its speed over both, not ``T*`` over one tick, and taking it for the slowest
  job would keep two jobs trading the top level while a third never gets it. Either way
  never a division by zero.
* A restart (the counter goes back) drops the window but keeps ``T*`` and the last ``T``
  as a prior, so the job does not jump to the front or the back on its next tick. So does
  a counter that leaps ahead (its step implies iterations more than ``_JUMP_RATIO`` times
  faster than the learned ``T*``: a job that resumed from a checkpoint under its global
  step count, a counter bug): no job runs a thousand times faster than its fastest stretch
  so far, and learning ``T*`` from the leap would rank the job the slowest for good. Nor
  does any job run an iteration in under ``MIN_ITERATION_S``: a step faster than that is a
  leap even before ``T*`` is known. Two such leaps in a row, though, are the job's pace:
  the ``T*`` learned was too slow (a first iteration that compiled for minutes, a report
  stamped long ago), so it is learned again from them, or the job's estimate would stay
  frozen at that first stretch.
* A report stamped before the newest is late (each rank of a job may report, and one
  rank's batch may arrive after another's newer one) and ignored, unless its count is
  higher and it is stamped ``_CLOCK_STEP_S`` or more before: the host's clock stepped back,
  and the window starts again from it, as after a restart.
* A gap is evidence up to a point: a job that makes no progress for more than
  ``gap_spacings`` times its usual spacing of progress points (its window's time per point:
  its iteration time, or the interval between its reports where it reports less often) is
  stopped (a debugger, SIGSTOP, a node too loaded to run it), not slowed by the network,
  whose slowdown the open iteration has long shown by then. The open iteration counts up to
  that limit and no further, so the rate stops falling there, and the report that ends the
  gap counts it as that limit (or as the iterations it covers at the window's pace, if
  more): the time beyond is cut out of the window and the long-run rate, and the job comes
  back ranked as it was when the limit was reached, not as the slowest for minutes. Time
  the whole node did not run (:meth:`ProgressTracker.skip`: a suspend, a clock stepped
  forward; the caller tells it from two clocks) is cut out of every job's reports whole,
  stamped before it or arriving after it.
* The rate reported is a weighted geometric mean of the window's ``T* / T`` and the job's
  rate over the last ``long_window_s`` (iterations since then, up to now, times ``T*``):
  ``window ** (1 - long_weight) * long ** long_weight``, so a job that fell behind ranks as
  slower than one just as fast now until it has caught up. With ``long_weight`` 1 the
  long-run rate alone ranks: the deficit a job gathered is all that counts, and jobs of
  equal demand take turns by the iterations they completed rather than drifting apart.

Nothing here does I/O or reads a clock: callers pass ``now``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# Iteration times below this are treated as this, so a burst of reports stamped with the
# same instant can never produce an infinite rate.
_MIN_PERIOD_S = 1e-9
# The blended rate stays in (0, 1] like the window's, however long a job has stalled (the
# square root of a tiny product can underflow to 0).
_MIN_RATE = 1e-12
# The long window keeps at most about this many points, however often a job reports.
_LONG_POINTS = 64
# A step this many times faster than the contention-free iteration time is a counter that
# leapt ahead, not progress.
_JUMP_RATIO = 1000.0
# A report with a higher count stamped this long before the newest is the clock stepping
# back (ranks of one job stamp theirs a few milliseconds apart).
_CLOCK_STEP_S = 1.0
# No iteration is this short: a step implying a shorter one is a counter that leapt.
MIN_ITERATION_S = 1e-6
# The node-wide gaps (ProgressTracker.skip) kept to map reports stamped before them that
# arrive late; a report older than the oldest is older than any window anyway.
_SKIPS = 16
# A gap without progress always counts for this long at least, however short a job's
# spacing (a tick's jitter is no stop).
_MIN_GAP_S = 1.0


@dataclass(frozen=True)
class ProgressConfig:
    """How progress is estimated.

    ``window_s``: span of the sliding window of progress points. ``min_iterations``: the
    fewest iterations the window spans, whatever their length (so slow jobs still have an
    estimate, and one that is not a single iteration's). ``stall_iterations``: how many
    completed iterations a job's open one is averaged with once the window holds that many
    (0: the open iteration alone, whatever the window holds). ``long_window_s``: the span of
    the long-run rate the window's rate is averaged with (geometric mean), so that a job
    that fell behind is paid back; 0 turns it off. ``long_weight``: the long-run rate's
    exponent in that mean, in [0, 1] (0.5: the plain geometric mean; 1: the long-run rate
    alone, wherever the job has one). ``gap_spacings``: how many of a job's usual spacings
    between progress points a gap without progress counts as, at most (the time beyond is
    not progress-rate evidence).
    """

    window_s: float = 20.0
    min_iterations: int = 2
    stall_iterations: int = 8
    long_window_s: float = 300.0
    long_weight: float = 0.5
    gap_spacings: float = 20.0

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if not self.min_iterations >= 1:
            raise ValueError(f"min_iterations must be >= 1, got {self.min_iterations}")
        if not self.stall_iterations >= 0:
            raise ValueError(f"stall_iterations must be >= 0, got {self.stall_iterations}")
        if not 0 <= self.long_window_s < float("inf"):
            raise ValueError(f"long_window_s must be >= 0 and finite, got {self.long_window_s}")
        if not 0 <= self.long_weight <= 1:
            raise ValueError(f"long_weight must be in [0, 1], got {self.long_weight}")
        if not 1 <= self.gap_spacings < float("inf"):
            raise ValueError(f"gap_spacings must be >= 1 and finite, got {self.gap_spacings}")


@dataclass
class _JobState:
    declared_ideal_s: float | None
    first_seen: float
    points: deque[tuple[int, float]] = field(default_factory=deque)
    # progress points of the long window, at least long_window_s / _LONG_POINTS apart
    anchors: deque[tuple[int, float]] = field(default_factory=deque)
    learned_ideal_s: float | None = None
    prior_period_s: float | None = None
    last_count: int | None = None
    last_progress_at: float | None = None
    restarts: int = 0
    # the newest point is where the counter leapt to (the window was dropped there)
    leapt: bool = False


@dataclass(frozen=True)
class JobProgress:
    """One job's estimate at a point in time (``None`` where not known yet)."""

    job_id: str
    rate: float | None
    period_s: float | None
    ideal_s: float | None
    iterations: int | None
    restarts: int
    # no progress for longer than the gap limit: the stall no longer lowers the rate
    stopped: bool = False
    # seconds since its last progress point (None before the first)
    stalled_s: float | None = None


class ProgressTracker:
    """Per-job iteration reports in, normalized progress rates out.

    The daemon calls :meth:`register` when a job appears (with the contention-free
    iteration time if the job declared one), :meth:`report` whenever a progress report
    arrives, :meth:`forget` when the job leaves, and :meth:`rates` once per tick to feed
    :class:`netshaper.leveller.Leveller`.
    """

    def __init__(self, config: ProgressConfig | None = None) -> None:
        self._config = config or ProgressConfig()
        self._jobs: dict[str, _JobState] = {}
        self._skips: deque[tuple[float, float]] = deque(maxlen=_SKIPS)

    @property
    def config(self) -> ProgressConfig:
        return self._config

    def register(self, job_id: str, *, now: float, ideal_s: float | None = None) -> None:
        """Start tracking ``job_id`` (idempotent; a new ``ideal_s`` replaces the old)."""
        if ideal_s is not None and not ideal_s > 0:
            raise ValueError(f"{job_id}: ideal_s must be > 0, got {ideal_s}")
        state = self._jobs.get(job_id)
        if state is None:
            self._jobs[job_id] = _JobState(declared_ideal_s=ideal_s, first_seen=now)
        elif ideal_s is not None:
            state.declared_ideal_s = ideal_s

    def forget(self, job_id: str) -> None:
        """Stop tracking ``job_id`` (unknown ids are ignored)."""
        self._jobs.pop(job_id, None)

    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    def skip(self, start: float, end: float) -> None:
        """The node did not run for ``end - start`` seconds (a suspend; or its clock stepped
        forward by that much), after every report stamped before ``start`` and before every
        one stamped from ``start`` on: that time is cut out of every job's reports, those in
        already (all of them from before it) and those stamped before ``start`` that arrive
        later, so that no job counts it as a stall. Later stamps and ``now`` are taken as
        they are."""
        if not end > start:
            return
        for state in self._jobs.values():
            self._move(state, lambda t: t + (end - start))
        self._skips.append((start, end))

    @staticmethod
    def _move(state: _JobState, f: Callable[[float], float]) -> None:
        """Every time ``state`` holds, mapped by ``f`` (which keeps their order)."""
        state.points = deque((n, f(t)) for n, t in state.points)
        state.anchors = deque((n, f(t)) for n, t in state.anchors)
        state.first_seen = f(state.first_seen)
        if state.last_progress_at is not None:
            state.last_progress_at = f(state.last_progress_at)

    def report(self, job_id: str, iteration: int, at: float) -> None:
        """Record that ``job_id`` had completed ``iteration`` iterations at time ``at``.

        Unknown jobs are registered on the fly (with no declared ideal). Reports older
        than the newest progress point are ignored, whatever their count (each rank of a
        job may report), unless their count is higher: then the clock stepped back. A lower
        count stamped later means a restart.
        """
        if iteration < 0:
            raise ValueError(f"{job_id}: iteration must be >= 0, got {iteration}")
        for start, end in self._skips:
            at = at + (end - start) if at < start else at
        state = self._jobs.get(job_id)
        if state is None:
            state = _JobState(declared_ideal_s=None, first_seen=at)
            self._jobs[job_id] = state
        leapt = False
        if state.points and at < state.points[-1][1]:
            stepped = state.points[-1][1] - at >= _CLOCK_STEP_S
            if state.last_count is None or iteration <= state.last_count or not stepped:
                # late, out of order: whatever its count (another rank's batch, sent after
                # a newer one), not a restart, which comes after the newest report
                return
            # ahead of the newest report's count, yet stamped well before it: no counter
            # runs ahead of its own past, the clock stepped back; the time base starts
            # again here
            self._rebase(state)
        elif state.last_count is not None and iteration < state.last_count:
            self._rebase(state)  # restart: the counter went back
        elif state.last_count is not None and iteration == state.last_count:
            return  # no progress since the last point: nothing new to learn
        elif state.points and self._impossible(state, iteration, at):
            self._rebase(state)
            leapt = True
        elif state.points and self._leaps(state, iteration, at):
            if state.leapt:  # the second in a row: T* was learned from too slow a stretch
                state.learned_ideal_s = None
            else:
                self._rebase(state)
                leapt = True
        state.leapt = leapt
        if state.points:
            self._cap_gap(state, iteration, at)
        if state.points:
            n0, t0 = state.points[-1]
            if iteration > n0 and at > t0:
                sample = max((at - t0) / (iteration - n0), _MIN_PERIOD_S)
                if state.learned_ideal_s is None or sample < state.learned_ideal_s:
                    state.learned_ideal_s = sample
        state.points.append((iteration, at))
        state.last_count = iteration
        state.last_progress_at = at
        window = self._config.window_s
        least = self._config.min_iterations
        points = state.points
        while len(points) > 2 and at - points[1][1] >= window and iteration - points[1][0] >= least:
            points.popleft()
        # never shorter than the window itself, whatever the two settings say
        span = self._config.long_window_s and max(self._config.long_window_s, window)
        anchors = state.anchors
        if span > 0:
            if not anchors or at - anchors[-1][1] >= span / _LONG_POINTS:
                anchors.append((iteration, at))
            while len(anchors) > 1 and at - anchors[1][1] >= span:
                anchors.popleft()

    def _gap_limit(self, state: _JobState) -> float | None:
        """The longest a gap without progress counts for: ``gap_spacings`` times the
        window's time per progress point (the prior's per iteration after a restart), at
        least ``_MIN_GAP_S``; ``None`` while the job has no spacing yet."""
        points = state.points
        if len(points) >= 2:
            spacing: float | None = (points[-1][1] - points[0][1]) / (len(points) - 1)
        else:
            spacing = state.prior_period_s
        if spacing is None:
            return None
        return max(self._config.gap_spacings * spacing, _MIN_GAP_S)

    def _cap_gap(self, state: _JobState, iteration: int, at: float) -> None:
        """Cut out of ``state`` the part of the gap before a report of ``iteration`` at
        ``at`` beyond the gap limit, or beyond the iterations it covers at the window's pace
        where that is longer (a report now and then is no gap)."""
        limit = self._gap_limit(state)
        n0, t0 = state.points[-1]
        if limit is None or iteration <= n0:
            return
        pace = self._window_period(state) or state.prior_period_s or 0.0
        excess = (at - t0) - max(limit, (iteration - n0) * pace)
        if excess > 0:
            self._move(state, lambda t: t + excess)

    def _rebase(self, state: _JobState) -> None:
        """Drop the window (the counter restarted or leapt); keep what was learned about
        the job's speed as a prior."""
        state.prior_period_s = self._window_period(state) or state.prior_period_s
        state.points.clear()
        state.anchors.clear()
        state.restarts += 1

    @staticmethod
    def _impossible(state: _JobState, iteration: int, at: float) -> bool:
        """Whether the step to ``iteration`` implies iterations under ``MIN_ITERATION_S``."""
        n0, t0 = state.points[-1]
        return iteration > n0 and at - t0 < MIN_ITERATION_S * (iteration - n0)

    @staticmethod
    def _leaps(state: _JobState, iteration: int, at: float) -> bool:
        """Whether the step to ``iteration`` is a thousand times faster than the fastest
        stretch learned so far. A declared ``T*`` is not held against the job: one off by
        that much would make every step a leap, and it cannot be poisoned by one."""
        ideal = state.learned_ideal_s
        n0, t0 = state.points[-1]
        if state.declared_ideal_s is not None or ideal is None or iteration <= n0:
            return False
        return (at - t0) * _JUMP_RATIO < ideal * (iteration - n0)

    def progress(self, job_id: str, now: float) -> JobProgress:
        """The estimate for one job at ``now``; raises ``KeyError`` for unknown ids."""
        state = self._jobs[job_id]
        ideal = self._ideal(state)
        period = self._window_period(state) or state.prior_period_s
        limit, last = self._gap_limit(state), state.last_progress_at
        stalled = None if last is None else max(0.0, now - last)
        stopped = limit is not None and stalled is not None and stalled > limit
        if limit is not None and last is not None and stopped:
            now = last + limit  # the stall counts up to the limit, no further
        since = state.last_progress_at if state.last_progress_at is not None else state.first_seen
        stalled_for = max(0.0, now - since)
        rate: float | None = None
        if ideal is not None:
            effective = max(period or 0.0, self._open_period(state, now) or stalled_for)
            # With no estimate yet, the job is only known to be slow once it has gone a
            # whole ideal iteration without progress.
            if period is not None or stalled_for > ideal:
                rate = min(1.0, ideal / max(effective, _MIN_PERIOD_S))
                long_rate = self._long_rate(state, ideal, now)
                if long_rate is not None:
                    w = self._config.long_weight
                    # the plain geometric mean as sqrt: the default's figures stay exact
                    mean = (
                        math.sqrt(rate * long_rate) if w == 0.5 else rate ** (1 - w) * long_rate**w
                    )
                    rate = max(mean, _MIN_RATE)
        return JobProgress(
            job_id=job_id,
            rate=rate,
            period_s=period,
            ideal_s=ideal,
            iterations=state.last_count,
            restarts=state.restarts,
            stopped=stopped,
            stalled_s=stalled,
        )

    def rates(self, now: float, jobs: Iterable[str] | None = None) -> dict[str, float | None]:
        """Progress rate of every tracked job (or of ``jobs``) at ``now``."""
        ids = sorted(self._jobs) if jobs is None else list(jobs)
        return {j: self.progress(j, now).rate for j in ids}

    @staticmethod
    def _ideal(state: _JobState) -> float | None:
        if state.declared_ideal_s is not None:
            return state.declared_ideal_s
        return state.learned_ideal_s

    @staticmethod
    def _long_rate(state: _JobState, ideal: float, now: float) -> float | None:
        """Iterations since the long window's oldest point, up to ``now``, times ``T*``;
        ``None`` until the job has progressed since that point."""
        if not state.anchors or state.last_count is None:
            return None
        n0, t0 = state.anchors[0]
        if state.last_count <= n0 or now <= t0:
            return None
        return min(1.0, ideal * (state.last_count - n0) / (now - t0))

    def _open_period(self, state: _JobState, now: float) -> float | None:
        """The iteration time with the open iteration counted as ending ``now``, over it
        and the last ``stall_iterations`` completed ones; ``None`` while the window holds
        fewer."""
        k = self._config.stall_iterations
        points = state.points
        if k == 0 or len(points) < 2 or points[-1][0] - points[0][0] < k:
            return None
        n1 = points[-1][0]
        # the newest point at least k iterations back (points may skip counts)
        i = len(points) - 2
        while points[i][0] > n1 - k:
            i -= 1
        n0, t0 = points[i]
        return max((now - t0) / (n1 - n0 + 1), _MIN_PERIOD_S)

    @staticmethod
    def _window_period(state: _JobState) -> float | None:
        if len(state.points) < 2:
            return None
        n0, t0 = state.points[0]
        n1, t1 = state.points[-1]
        if n1 <= n0:
            return None
        return max((t1 - t0) / (n1 - n0), _MIN_PERIOD_S)
