"""The admission queue's hand-over and withdrawals, on a running ``gpud --simulate``.

::

    .venv/bin/python -m tools.bench_queue [--runs 10] [--leavers 80]
    .venv/bin/python -m tools.bench_queue --waiters 200 [--idle-s 30] [--timeout S]
        [--history N]
    .venv/bin/python -m tools.bench_queue --enqueues 10,100,300,1000

- hand-over: ``--runs`` queued ``gpuctl run --gpus 1 --memory 60GiB`` of 0.3 s each on one
  H100; the time from one command's end to the next one's start (what the devices sit idle
  between two queued runs), mean, min and max;
- withdrawals: ``--leavers`` runs queued behind one holding the GPU get SIGINT at once (a
  Ctrl-C each, one ``Leave`` each); how long each ``gpuctl run`` takes to exit after it,
  median and max, and how many said gpud did not answer the withdrawal within its 2 s.

With ``--waiters N``, instead: N runs queued behind one holding the GPU, and

- idle: the CPU gpud spends while nothing changes (``utime + stime`` of
  ``/proc/PID/stat`` over ``--idle-s``), as a share of one CPU;
- lists: how long ``ListQueue`` (``gpuctl queue``) and a scrape of ``/metrics`` take with
  the N entries queued, median and max of ten each;
- hand-over: the holder ends, then ten queued 0.3 s runs start one after the other with
  N, N - 1, ... still waiting behind; the time from one command's end to the next one's
  start, median and max (the rest are then stopped with SIGINT).

With ``--enqueues SIZES``, instead: behind one run holding the GPU, ``Enqueue`` calls
(what each ``gpuctl run`` that queues asks; held by this process, no ``gpuctl`` each) fill
the queue, and the times of the last five enqueues up to each size (those that make the
queue 4 short of it to those that make it that long) are printed, median and max, the
sizes side by side. Sizes are 1 to the simulated gpud's ``admission.max_queue`` (1000);
``--enqueues`` is run alone, with neither ``--waiters`` nor ``--runs`` or ``--leavers``.

``--history N``: the job history holds N runs before the waiters queue
(:func:`fill_history`: four request classes over the last 6.3 days), what
every quote (each waiting run's poll, each listing, each scrape) is made from.

``--timeout``: the waiting runs' ``gpuctl --timeout`` (default gpuctl's): a gpud that
takes long to answer them while they queue fails the benchmark, with what the run said.

Each phase's figures are printed as it ends. A SIGTERM or SIGINT stops it: gpud stopped,
its directory removed, the phases done so far reported, "cut short by SIGNAL", dying by it (128 +
its number).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpud.admission.service import request_of, run_request_to_json
from gpud.config import AdmissionConfig
from gpud.jobs.ends import EndCause
from gpud.jobs.service import RunRequest
from tools.simdaemon import (
    SimDaemon,
    cut_short,
    exit_as,
    restores_signals,
    simulated_gpud,
    start_child,
    stop_children,
    stopped_by_signal,
)

GPUCTL = "import sys; from gpud.cli.main import main; sys.exit(main())"  # the console script
NO_ANSWER = "did not answer the withdrawal"
DROP = subprocess.DEVNULL
GIB = 1 << 30
WINDOW_S = 7 * 86400.0  # admission.history_window_s' default
CLASSES = (
    (RunRequest(job="", gpu_count=1, memory_bytes=60 * GIB), 1.0),
    (RunRequest(job="", gpu_count=1, memory_bytes=20 * GIB, threads_percent=50), 0.5),
    (RunRequest(job="", gpu_count=1, memory_bytes=10 * GIB, threads_percent=25), 0.25),
    (RunRequest(job="", gpu_count=1, memory_bytes=30 * GIB), 0.5),
)


def fill_history(conn: sqlite3.Connection, n: int, now: float, *, seed: int = 1) -> None:
    """``n`` runs queued evenly over the last 0.9 of the default window (none leaves it
    while the benchmark runs), the classes in turn, exponential waits and run times (a load
    of about 0.6 on one GPU); the last three still run."""
    rng = random.Random(seed)
    span = 0.9 * WINDOW_S
    mean_s = 0.6 * span / max(n, 1)
    rows = []
    for i in range(n):
        request, size = CLASSES[i % len(CLASSES)]
        queued = now - span + span * i / max(n, 1)
        started = queued + rng.expovariate(1.0 / (mean_s * 0.3))
        ended = None if i >= n - 3 else min(now, started + rng.expovariate(1.0 / (mean_s * size)))
        placed = RunRequest(
            job=f"h{i}",
            gpu_count=request.gpu_count,
            memory_bytes=request.memory_bytes,
            threads_percent=request.threads_percent,
            holder_pid=1000 + i,
        )
        rows.append(
            (
                placed.job,
                f"hist{i:08d}",
                request_of(placed).describe(),
                run_request_to_json(placed),
                queued,
                min(started, now),
                ended,
                None,
                None if ended is None else 0,
                None if ended is None else EndCause.EXITED.value,
            )
        )
    conn.executemany(
        "INSERT INTO job_history (job, reservation, request_class, request, queued_at,"
        " started_at, ended_at, quote_s, exit_code, end_cause)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        rows,
    )


RUN = ("run", "--gpus", "1", "--memory", "60GiB", "--job")  # the job's name follows


def gpuctl(daemon: SimDaemon, *argv: str, timeout_s: float | None = None) -> list[str]:
    timeout = ["--timeout", f"{timeout_s:g}"] if timeout_s is not None else []
    return [sys.executable, "-c", GPUCTL, "--socket", str(daemon.socket), *timeout, *argv]


def wait_queued(
    daemon: SimDaemon,
    count: int,
    timeout_s: float = 120.0,
    *,
    procs: list[subprocess.Popen[bytes]] | None = None,
    work: Path | None = None,
) -> None:
    """Until ``count`` runs are queued; with ``procs`` (whose stderr is ``work/w{i}.err``),
    raises at the first of them that exits meanwhile, with what it said."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for i, p in enumerate(procs or []):
            if p.poll() is not None and work is not None:
                said = (work / f"w{i}.err").read_text().strip().splitlines()
                raise RuntimeError(f"queued run w{i} exited {p.returncode}: {said[-1:]}")
        out = subprocess.run(
            gpuctl(daemon, "queue"), check=False, capture_output=True, text=True
        ).stdout
        if sum(1 for line in out.splitlines()[1:] if line.strip()) >= count:
            return
        time.sleep(0.5)
    raise RuntimeError(f"fewer than {count} runs queued after {timeout_s:.0f} s")


@dataclass
class Phases:
    """The phases a run measures: each one's figures printed as it ends, so that a run cut
    short still shows those it finished."""

    planned: int
    done: int = 0

    def said(self, figures: str) -> None:
        print(figures, flush=True)
        self.done += 1


def hand_over(daemon: SimDaemon, runs: int, work: Path) -> list[float]:
    starts, ends = work / "starts", work / "ends"
    script = f"date +%s.%N >> {starts}; sleep 0.3; date +%s.%N >> {ends}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(runs):
            argv = gpuctl(daemon, *RUN, f"h{i}", "--", "sh", "-c", script)
            start_child(procs, argv, stderr=DROP)
        failed = sum(1 for p in procs if p.wait() != 0)
    finally:
        stop_children(procs)  # cut short: those still queued or running would outlive the tool
    if failed:
        raise RuntimeError(f"{failed} of {runs} runs failed")
    began = sorted(float(x) for x in starts.read_text().split())
    ended = sorted(float(x) for x in ends.read_text().split())
    return [began[i + 1] - ended[i] for i in range(len(began) - 1)]


def withdrawals(daemon: SimDaemon, leavers: int) -> tuple[list[float], int]:
    holding: list[subprocess.Popen[bytes]] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        start_child(holding, gpuctl(daemon, *RUN, "holder", "--", "sleep", "600"), stderr=DROP)
        time.sleep(2)
        for i in range(leavers):
            start_child(procs, gpuctl(daemon, *RUN, f"q{i}", "--", "true"), stderr=subprocess.PIPE)
            time.sleep(0.1)  # two CPUs: starting them all at once is a benchmark of Python
        wait_queued(daemon, leavers)
        signalled = time.monotonic()
        for p in procs:
            os.kill(p.pid, signal.SIGINT)
        exited: dict[int, float] = {}
        while len(exited) < len(procs):
            for i, p in enumerate(procs):
                if i not in exited and p.poll() is not None:
                    exited[i] = time.monotonic() - signalled
            time.sleep(0.01)
        unanswered = sum(NO_ANSWER in p.communicate()[1].decode() for p in procs)
        return list(exited.values()), unanswered
    finally:
        stop_children([*holding, *procs])


def cpu_seconds(pid: int) -> float:
    """``utime + stime`` of ``/proc/PID/stat``, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(call: Callable[[], object], times: int = 10) -> list[float]:
    took = []
    for _ in range(times):
        began = time.monotonic()
        call()
        took.append(time.monotonic() - began)
    return took


def at_scale(
    daemon: SimDaemon,
    waiters: int,
    idle_s: float,
    work: Path,
    timeout_s: float | None,
    *,
    history: int = 0,
    said: Callable[[str], None] = print,
) -> None:
    import grpc

    if history:
        # the daemon's state directory, beside its run directory
        db = sqlite3.connect(daemon.socket.parent.parent / "state" / "state.db", timeout=30)
        with db:
            fill_history(db, history, time.time())
        db.close()

    from gpud.v1 import queue_pb2, queue_pb2_grpc

    go, starts, ends = work / "go", work / "starts", work / "ends"
    hold = f"while [ ! -e {go} ]; do sleep 0.02; done; date +%s.%N >> {ends}"
    script = f"date +%s.%N >> {starts}; sleep 0.3; date +%s.%N >> {ends}"
    holding: list[subprocess.Popen[bytes]] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        start_child(holding, gpuctl(daemon, *RUN, "holder", "--", "sh", "-c", hold), stderr=DROP)
        time.sleep(2)
        for i in range(waiters):
            argv = gpuctl(daemon, *RUN, f"w{i}", "--", "sh", "-c", script, timeout_s=timeout_s)
            with (work / f"w{i}.err").open("wb") as err:
                start_child(procs, argv, stderr=err)
            time.sleep(0.1)
        wait_queued(daemon, waiters, timeout_s=300, procs=procs, work=work)
        time.sleep(6)  # every waiter in its long poll
        with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
            stub = queue_pb2_grpc.QueueStub(channel)
            lists = timed(lambda: stub.ListQueue(queue_pb2.ListQueueRequest(), timeout=30))
        scrapes = timed(lambda: urllib.request.urlopen(daemon.metrics_url, timeout=30).read())
        said(
            f"{waiters} queued, {history} runs in the history: ListQueue {statistics.median(lists) * 1e3:.0f} ms median"
            f" ({max(lists) * 1e3:.0f} ms max), /metrics {statistics.median(scrapes) * 1e3:.0f}"
            f" ms median ({max(scrapes) * 1e3:.0f} ms max)"
        )
        before = cpu_seconds(daemon.pid)
        time.sleep(idle_s)
        used = cpu_seconds(daemon.pid) - before
        said(
            f"{waiters} idle waiters: gpud used {used:.2f} CPU s in {idle_s:g} s"
            f" ({100 * used / idle_s:.1f} % of a CPU)"
        )
        go.touch()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (
            not ends.exists() or len(ends.read_text().split()) < 11
        ):
            time.sleep(0.05)
        began = sorted(float(x) for x in starts.read_text().split())
        ended = sorted(float(x) for x in ends.read_text().split())
        gaps = [began[i] - ended[i] for i in range(10)]
        said(
            f"hand-over with {waiters} waiting: median {statistics.median(gaps):.3f} s,"
            f" max {max(gaps):.3f} s (ten in a row)"
        )
    finally:
        stop_children([*holding, *procs])


def enqueue_times(
    daemon: SimDaemon, sizes: list[int], *, history: int = 0
) -> dict[int, list[float]]:
    """Per size of ``sizes`` (ascending), the times of the five enqueues that make the
    queue that long (the last five up to it)."""
    import grpc

    from gpud.v1 import jobs_pb2, queue_pb2, queue_pb2_grpc

    if history:
        db = sqlite3.connect(daemon.socket.parent.parent / "state" / "state.db", timeout=30)
        with db:
            fill_history(db, history, time.time())
        db.close()
    took: dict[int, list[float]] = {size: [] for size in sizes}
    holding: list[subprocess.Popen[bytes]] = []
    try:
        start_child(holding, gpuctl(daemon, *RUN, "holder", "--", "sleep", "3600"), stderr=DROP)
        time.sleep(2)
        with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
            stub = queue_pb2_grpc.QueueStub(channel)
            for n in range(1, max(sizes) + 1):
                request = jobs_pb2.ReserveRequest(
                    job=f"e{n}", gpu_count=1, memory_limit_bytes=60 * GIB, holder_pid=os.getpid()
                )
                began = time.monotonic()
                stub.Enqueue(queue_pb2.EnqueueRequest(request=request), timeout=120)
                spent = time.monotonic() - began
                for size in sizes:
                    if size - 5 < n <= size:
                        took[size].append(spent)
    finally:
        stop_children(holding)
    return took


def enqueue_figures(took: dict[int, list[float]]) -> str:
    return "enqueue with N queued, median (max) of the last five up to N: " + ", ".join(
        f"{size}: {statistics.median(t) * 1e3:.1f} ms ({max(t) * 1e3:.1f} ms)"
        for size, t in took.items()
    )


def enqueue_sizes(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """``--enqueues``' sizes, ascending; the parser's error for one that is no number, under
    1, or over the simulated gpud's ``admission.max_queue`` (its default: the enqueue that
    would make the queue longer is refused)."""
    limit = AdmissionConfig().max_queue
    sizes: set[int] = set()
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        try:
            size = int(part)
        except ValueError:
            parser.error(f"--enqueues: {part!r} is not a queue size (sizes are as 10,100,300)")
        if not 1 <= size <= limit:
            parser.error(
                f"--enqueues: queue size {size} is outside 1 to {limit}: the simulated gpud"
                f" queues admission.max_queue = {limit} jobs at most"
            )
        sizes.add(size)
    return sorted(sizes)


@restores_signals
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # None until given: --enqueues refuses them given, as it refuses --waiters
    parser.add_argument("--runs", type=int, default=None, help="default 10")
    parser.add_argument("--leavers", type=int, default=None, help="default 80")
    parser.add_argument("--waiters", type=int, default=0)
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument(
        "--enqueues", default="", help="queue sizes to time enqueues at, as 10,100,300"
    )
    parser.add_argument("--history", type=int, default=0, help="runs in the job history")
    parser.add_argument(
        "--timeout", type=float, default=None, help="the waiting runs' gpuctl --timeout"
    )
    args = parser.parse_args(argv)
    sizes = enqueue_sizes(parser, args.enqueues)
    if sizes:
        mixed = [
            name
            for name, given in (
                ("--waiters", args.waiters),
                ("--runs", args.runs is not None),
                ("--leavers", args.leavers is not None),
            )
            if given
        ]
        if mixed:
            parser.error(
                f"--enqueues and {mixed[0]} are two benchmarks: --enqueues times enqueues"
                " alone, run them one at a time"
            )
    runs = 10 if args.runs is None else args.runs
    leavers = 80 if args.leavers is None else args.leavers
    phases = Phases(1 if sizes else 3 if args.waiters else 2)
    with (
        stopped_by_signal() as stopped,
        simulated_gpud("H100-SXM5-80GB:1") as daemon,
        tempfile.TemporaryDirectory() as tmp,
    ):
        print(f"measuring: {phases.planned} phases", flush=True)
        if sizes:
            phases.said(enqueue_figures(enqueue_times(daemon, sizes, history=args.history)))
        elif args.waiters:
            at_scale(
                daemon,
                args.waiters,
                args.idle_s,
                Path(tmp),
                args.timeout,
                history=args.history,
                said=phases.said,
            )
        else:
            gaps = hand_over(daemon, runs, Path(tmp))
            phases.said(
                f"hand-over, {runs} queued 0.3 s runs: mean {statistics.mean(gaps):.3f} s,"
                f" min {min(gaps):.3f} s, max {max(gaps):.3f} s"
            )
            took, unanswered = withdrawals(daemon, leavers)
            phases.said(
                f"withdrawals, {leavers} queued runs stopped at once: exit after"
                f" {statistics.median(took):.2f} s median, {max(took):.2f} s max;"
                f" {unanswered} said gpud did not answer within 2 s"
            )
    if stopped.by:
        return cut_short(stopped.by, f"{phases.done} of {phases.planned} phases")
    return 0


if __name__ == "__main__":
    exit_as(main())
