"""What one pass of the daemon's loop costs, a metric source for
:class:`gpud.metrics.Collector`::

    gpud_loop_duration_seconds     histogram of the wall time of each pass (every step:
                                   MIG, MPS, jobs, admission, co-location, cluster, traffic)
    gpud_loop_overruns_total       passes that took longer than the tick (``daemon.tick_s``,
                                   or the watchdog's interval when shorter)

``gpud_sample_duration_seconds`` is the sampler's own tick, which runs beside the loop. A
pass that overruns is also logged at debug level with each step's time, the slowest first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, Metric

from gpud.histogram import Histogram
from gpud.metrics import histogram_family

log = logging.getLogger(__name__)

# upper bounds (seconds) for passes of a 1 s tick: an idle pass takes milliseconds, one past
# the tick overruns, and the watchdog (WatchdogSec=30s) bites beyond the last
LOOP_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LoopStats:
    """Counts of the loop's passes: :meth:`record` after each one."""

    def __init__(self, bounds: Sequence[float] = LOOP_BOUNDS) -> None:
        self.durations = Histogram(bounds)
        self._lock = threading.Lock()
        self._overruns = 0

    def record(self, seconds: float, tick_s: float, steps: Sequence[tuple[str, float]]) -> bool:
        """One pass of ``seconds``, each step's ``(name, seconds)``; True when it took longer
        than ``tick_s``."""
        self.durations.observe(seconds)
        if seconds <= tick_s:
            return False
        with self._lock:
            self._overruns += 1
        if log.isEnabledFor(logging.DEBUG):
            slowest = sorted(steps, key=lambda s: s[1], reverse=True)
            log.debug(
                "loop pass took %.3f s, over the %g s tick; slowest step %s; steps: %s",
                seconds,
                tick_s,
                slowest[0][0] if slowest else "none",
                ", ".join(f"{name} {took:.3f} s" for name, took in slowest),
            )
        return True

    def overruns(self) -> int:
        with self._lock:
            return self._overruns


class LoopMetrics:
    """``collector.add_source(LoopMetrics(stats))``."""

    def __init__(self, stats: LoopStats) -> None:
        self._stats = stats

    def __call__(self) -> Iterator[Metric]:
        yield histogram_family(
            "gpud_loop_duration_seconds",
            "Wall time of each pass of gpud's loop (every step), since gpud started.",
            self._stats.durations.counts(),
            lambda bound: repr(float(bound)),
        )
        overruns = CounterMetricFamily(
            "gpud_loop_overruns",
            "Passes of gpud's loop that took longer than its tick (daemon.tick_s).",
        )
        overruns.add_metric([], float(self._stats.overruns()))
        yield overruns
