"""Cost of ``gpud.client.Progress.step()`` inside a training loop.

Measures, side by side in one run, the wall time per call of:

- ``step (daemon up)``: ``p.step()`` while a Net API server (the daemon's servicer over a
  fake node, on a unix socket in this process) receives the batches;
- ``step (daemon down)``: the same with nobody listening on the socket (the sender thread
  retries with back-off; the buffer drops the oldest reports);
- ``time.time()``: one clock read, the floor of any timestamped report;
- ``deque.append``: an append of a tuple to a bounded deque, the other half of the floor.

Each of ``--reps`` repetitions times ``--calls`` calls of each, in alternating order; the
figures are medians over the repetitions, and ``step / (clock + append)`` is the median of
the per-repetition ratios. The sender thread competes for the GIL with the loop, so the
daemon-up figure includes what batching costs the training thread.

Target: step <= 2 us. A SIGTERM or SIGINT stops it: the figures of the repetitions done so
far (with ``--json``, as its one JSON object, with ``cut_short``), "cut short by SIGNAL
after N of M repetitions", dying by it (128 + its number).

    .venv/bin/python -m tools.bench_progress [--json] [--reps N] [--calls N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpud.api import ApiServer
from gpud.client import Progress
from gpud.config import TrafficConfig
from gpud.events import EventLog
from gpud.net.api import NetServicer
from gpud.net.service import TrafficService, job_pool
from gpud.net.tagstore import TagStore
from gpud.store import StateStore
from tools.simdaemon import cut_short, exit_as, held, restores_signals, stopped_by_signal

TARGET_US = 2.0


def _per_call_us(fn: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _server(path: Path, state: Path) -> tuple[ApiServer, TrafficService]:
    config = TrafficConfig(enabled=True)
    service = TrafficService(
        config,
        tags=TagStore(StateStore(state), pool=job_pool(config)),
        events=EventLog(None),
        jobs=lambda: ["bench"],
    )
    return ApiServer(path, servicers=[NetServicer(service).register]), service


@contextlib.contextmanager
def _serving(server: ApiServer) -> Iterator[None]:
    """``server`` on an event loop in a background thread (the daemon's side)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    try:
        yield
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@restores_signals
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args(argv)

    results: dict[str, list[float]] = {name: [] for name in NAMES}
    ratios: list[float] = []
    delivery = {"sent": 0, "dropped": 0, "accepted": 0}
    with stopped_by_signal() as stopped:
        measure(args.reps, args.calls, results, ratios, delivery)
    report = report_of(results, ratios, args.calls, delivery)
    if stopped.by:
        done, shown = f"{report['reps']} of {args.reps} repetitions", None if args.json else show
        return cut_short(
            stopped.by, done, figures=report, show=shown, cleaned="its sockets removed"
        )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        show(report)
    return 0


NAMES = ("step_up", "step_down", "clock", "append")


def record(got: dict[str, float], results: dict[str, list[float]], ratios: list[float]) -> None:
    """One repetition's figures ``got`` appended to ``results`` and ``ratios``, all or none: a
    signal meanwhile waits (held), lest the lists differ in length."""
    with held():
        for name, us in got.items():
            results[name].append(us)
        ratios.append(got["step_up"] / (got["clock"] + got["append"]))


def measure(
    reps: int,
    calls: int,
    results: dict[str, list[float]],
    ratios: list[float],
    delivery: dict[str, int],
) -> None:
    """Each repetition's figures appended to ``results`` and ``ratios`` as it ends (what a
    run cut short has measured); what the reports' sender delivered into ``delivery``."""
    with tempfile.TemporaryDirectory(prefix="gpud-bp-") as d:
        up_sock, down_sock = Path(d) / "up.sock", Path(d) / "down.sock"
        server, service = _server(up_sock, Path(d) / "state")
        with _serving(server):
            up = Progress("bench", socket=up_sock, flush_interval_s=0.05, max_buffer=100_000)
            down = Progress("bench", socket=down_sock, flush_interval_s=0.05, max_buffer=10_000)
            q: deque[tuple[int, float]] = deque(maxlen=10_000)
            clock = time.time

            def append() -> None:
                q.append((1, 0.5))

            def read_clock() -> None:
                clock()

            try:
                print(f"measuring: {reps} repetitions", file=sys.stderr, flush=True)
                for rep in range(reps):
                    order = [
                        ("step_up", up.step),
                        ("step_down", down.step),
                        ("clock", read_clock),
                        ("append", append),
                    ]
                    if rep % 2:
                        order.reverse()
                    got = {name: _per_call_us(fn, calls) for name, fn in order}
                    record(got, results, ratios)
                up.flush(timeout=30)
            finally:
                delivery.update(sent=up.sent, dropped=up.dropped)
                up.close()
                down.close(timeout=0.1)
                delivery["accepted"] = service.accepted_reports


def report_of(
    results: dict[str, list[float]], ratios: list[float], calls: int, delivery: dict[str, int]
) -> dict[str, Any]:
    """The figures of the repetitions done (``reps``); no medians if none was."""
    report: dict[str, Any] = {"calls_per_rep": calls, "reps": len(ratios)}
    if ratios:
        med = {k: statistics.median(v) for k, v in results.items()}
        report.update(
            step_daemon_up_us=round(med["step_up"], 3),
            step_daemon_down_us=round(med["step_down"], 3),
            time_time_us=round(med["clock"], 3),
            deque_append_us=round(med["append"], 3),
            step_over_clock_plus_append=round(statistics.median(ratios), 2),
        )
    report.update(
        reports_delivered=delivery["sent"],
        reports_dropped=delivery["dropped"],
        accepted_by_daemon=delivery["accepted"],
        target_us=TARGET_US,
    )
    if ratios:
        report["meets_target"] = max(med["step_up"], med["step_down"]) <= TARGET_US
    return report


def show(report: dict[str, Any]) -> None:
    for key, value in report.items():
        print(f"{key:32} {value}")


if __name__ == "__main__":
    exit_as(main())
