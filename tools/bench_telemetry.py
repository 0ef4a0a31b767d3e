"""Telemetry cost on a simulated 8 x H100-SXM5-80GB node, every GPU in MIG 1g.10gb x 7.

Measures, side by side in one run:

- ``tick``: CPU time (every thread, user + system) of one ``Sampler.tick()`` over 8 GPUs
  and 56 MIG devices;
- ``adapter``: the sampler's backend calls (``NvmlBackend.gpu_readings`` and
  ``mig_readings`` per GPU) in a plain loop, to show which share of the tick is the adapter
  and which the sampler;
- ``bare``: the very same NVML calls, made in a bare loop directly on the simulated
  ``pynvml`` module with no gpud code around them. The call list is recorded from a
  steady-state tick (function, arguments), so both sides make identical driver calls;
- ``scrape``: one ``/metrics`` scrape, ``collect`` + ``generate_latest`` on the daemon's
  registry (gpud collector, process and Python collectors), CPU and wall time;
- ``rss``: the resident set of a running ``gpud --simulate`` daemon (started as a
  subprocess with temporary directories), or of this process when the daemon cannot start.

Each of ``--reps`` repetitions measures bare, adapter and tick back to back (in alternating
order), so that the ratios are taken between measurements made under the same conditions;
the reported ratios are the medians of the per-repetition ratios, which a noisy, shared
machine moves much less than either side's own figures (medians and minimums shown too).
Scrapes are measured afterwards, ``--reps`` times, in a loop of their own.

CPU time is summed from each thread's own clock: ``time.process_time()`` would miss the time
that a thread still running on another CPU has used since that CPU's last scheduler tick
(Linux does not bring other running threads up to date for a process-wide clock), so it
would miss a varying part of the sampler's worker thread and bill it to the next measurement.

The sampler reads the GPUs on a worker thread (hang isolation), which the scheduler wakes on
an idle CPU when there is one: the bare loop runs on the busy, warm CPU of the measuring
thread, the tick's reads on a CPU woken for them, where on a small VM the very same code can
take up to twice as long. So by default everything runs on one CPU (``--cpu N`` picks it),
which compares the two sides' CPU cost under the same cache conditions; ``--cpu all`` shows
the unpinned figures too (the output says which way they were taken).

Targets: tick <= 1.5 x bare, scrape <= 20 ms, RSS <= 80 MB. A SIGTERM or SIGINT stops it
(its gpud stopped, its directory removed): each side's CPU time over the repetitions done so
far is printed, "cut short by SIGNAL", dying by it (128 + its number); with ``--json``, as its one
JSON object, with ``"cut_short": {"by": SIGNAL, "after": "N of M repetitions"}``. A second
signal meanwhile is ignored.

    .venv/bin/python -m tools.bench_telemetry [--json] [--reps N] [--no-daemon] [--cpu N|all]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import psutil
from prometheus_client import generate_latest

from gpud.backend.nvml import NvmlBackend
from gpud.backend.port import READINGS
from gpud.backend.sim import SimNode, parse_simulate_spec
from gpud.metrics import Collector, build_registry
from gpud.telemetry.sampler import Sampler
from gpud.telemetry.snapshot import Snapshot
from tools.simdaemon import cut_short, exit_as, restores_signals, simulated_gpud, stopped_by_signal

SPEC = "H100-SXM5-80GB:8"
PROFILE = "1g.10gb"
TICK_RATIO_TARGET = 1.5
SCRAPE_TARGET_S = 0.020
RSS_TARGET_BYTES = 80 * 1000 * 1000

Call = tuple[Callable[..., Any], tuple[Any, ...]]


class RecordingNvml:
    """Passes every attribute of a pynvml-shaped module through; records ``nvml*`` calls."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.calls: list[Call] | None = None

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._module, name)
        if not name.startswith("nvml") or not callable(attr) or isinstance(attr, type):
            return attr

        def call(*args: Any) -> Any:
            if self.calls is not None:
                self.calls.append((attr, args))
            return attr(*args)

        return call


def build_node(backend: NvmlBackend, node: SimNode, *, workloads: bool = True) -> None:
    """``nvidia-smi -mig 1``, reset, then ``nvidia-smi mig -cgi 1g.10gb x7 -C`` on every GPU."""
    count = backend.gpu_count()
    for gpu in range(count):
        backend.set_mig_mode(gpu, True)
    node.reboot()  # the pending MIG mode applies at the reset (A100; Hopper needs none)
    for gpu in range(count):
        profile = next(p for p in backend.gpu_instance_profiles(gpu) if p.name == PROFILE)
        for placement in backend.gpu_instance_placements(gpu, profile.id):
            gi = backend.create_gpu_instance(gpu, profile.id, placement)
            # CI profiles are read from an existing GI (nvidia-smi mig -lcip -gi N).
            ci_profile = next(
                c
                for c in backend.compute_instance_profiles(gpu, profile.id)
                if c.slice_count == profile.slice_count
            )
            backend.create_compute_instance(gpu, gi.id, ci_profile.id)
    if not workloads:
        return
    # A process on every other MIG device, so process lists are not all empty.
    pid = 10_000
    for gpu in range(count):
        for mig in range(0, 7, 2):
            node.workloads.start(gpu, pid, 2 << 30, 0.5, mig=mig)
            pid += 1


def bare_loop(calls: list[Call]) -> None:
    for fn, args in calls:
        try:  # noqa: SIM105  (contextlib.suppress would add its own cost to the baseline)
            fn(*args)
        except Exception:  # NotSupported answers are part of the cost too
            pass


def adapter_loop(backend: NvmlBackend, snap: Snapshot) -> Callable[[], None]:
    """The sampler's backend calls in a plain loop: the adapter's share of the tick.

    What the sampler does not ask (readings it found unsupported, ``None`` in a healthy
    sample) is not asked here either.
    """
    plan: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
    for g in snap.gpus:
        i = g.identity.index
        skip = frozenset(name for name in READINGS if getattr(g, name) is None)
        plan.append((backend.gpu_readings, (i, skip)))
        if g.mig_devices:
            plan.append((backend.mig_readings, (i, tuple(m.identity for m in g.mig_devices))))

    def loop() -> None:
        for fn, args in plan:
            fn(*args)

    return loop


class CpuClock:
    """CPU seconds of this process's threads, summed from per-thread clocks (see the module
    docstring for why not ``time.process_time``). ``refresh`` picks up the current threads."""

    def __init__(self) -> None:
        self._clocks: list[int] = []
        self.refresh()

    def refresh(self) -> None:
        getcpuclockid = getattr(time, "pthread_getcpuclockid", None)
        if getcpuclockid is None:  # not on this platform: the process clock will do
            self._clocks = []
            return
        self._clocks = [getcpuclockid(t.ident) for t in threading.enumerate() if t.ident]

    def __call__(self) -> float:
        if not self._clocks:
            return time.process_time()
        return sum(map(time.clock_gettime, self._clocks))


def cpu_seconds(fn: Callable[[], object], clock: Callable[[], float] = time.process_time) -> float:
    start = clock()
    fn()
    return clock() - start


def _prepare_node(run_dir: Path) -> None:
    """The benchmark's MIG layout, written into the simulated driver's state file, which the
    daemon's simulated node reads at start (as a real node keeps its MIG instances across a
    daemon restart)."""
    state = SimNode(parse_simulate_spec(SPEC), state_file=run_dir / "sim" / "node.json")
    backend = NvmlBackend(state.nvml)
    try:
        build_node(backend, state, workloads=False)
    finally:
        backend.close()


def measure_rss_daemon() -> tuple[int | None, str, int]:
    """RSS of ``gpud --simulate`` on the benchmark's MIG layout, after a few ticks/scrapes.

    Returns (RSS or None, what was measured or why not, MIG devices the daemon's /metrics
    shows).
    """
    try:
        with simulated_gpud(SPEC, prepare=_prepare_node) as daemon:
            mig_devices = 0
            for _ in range(5):  # a few sampling ticks and scrapes' worth of allocations
                time.sleep(1)
                with urllib.request.urlopen(daemon.metrics_url, timeout=10) as resp:
                    body = resp.read().decode()
                mig_devices = sum(
                    1
                    for line in body.splitlines()
                    if line.startswith("gpud_mig_device_memory_total")
                )
            rss = psutil.Process(daemon.pid).memory_info().rss
            return rss, "gpud --simulate subprocess", mig_devices
    except (OSError, RuntimeError) as err:
        return None, f"cannot run gpud: {err}", 0


def record_tick_calls(node: SimNode) -> list[Call]:
    """The NVML calls of one steady-state tick, recorded through a second backend."""
    recorder = RecordingNvml(node.nvml)
    backend = NvmlBackend(recorder)
    sampler = Sampler(backend, call_timeout_s=10.0)
    try:
        for _ in range(5):  # warm: identities, MIG lists, NotSupported answers cached
            sampler.tick()
        recorder.calls = []
        sampler.tick()
        calls = recorder.calls
        recorder.calls = None
        return calls
    finally:
        sampler.close()
        backend.close()


def run(
    reps: int,
    with_daemon: bool,
    cpu: dict[str, list[float]] | None = None,
    progress: TextIO = sys.stdout,
) -> dict[str, Any]:
    """The figures, from ``reps`` repetitions; ``cpu``, each side's CPU seconds, one per
    repetition done, filled as they are (what a run cut short has measured)."""
    cpu = {} if cpu is None else cpu
    node = SimNode(parse_simulate_spec(SPEC), seed=0)
    backend = NvmlBackend(node.nvml)
    build_node(backend, node)
    calls = record_tick_calls(node)
    # The measured sampler talks to the simulated module directly, as the daemon does.
    sampler = Sampler(backend, call_timeout_s=10.0)
    registry = build_registry(Collector(sampler.latest))
    try:
        for _ in range(5):
            sampler.tick()
        snap = sampler.latest()
        assert snap is not None
        mig_devices = sum(len(g.mig_devices) for g in snap.gpus)
        assert all(g.healthy for g in snap.gpus), [g.reason for g in snap.gpus]

        adapter = adapter_loop(backend, snap)
        clock = CpuClock()
        sides: list[tuple[str, Callable[[], object]]] = [
            ("bare", lambda: bare_loop(calls)),
            ("adapter", adapter),
            ("tick", sampler.tick),
        ]
        cpu.update({name: [] for name, _ in sides})
        scrapes: list[float] = []
        scrape_walls: list[float] = []
        print(f"measuring: {reps} repetitions", file=progress, flush=True)
        rep = 0
        while rep < reps:
            clock.refresh()  # the sampler's threads, should one have been replaced
            try:
                figures = [
                    (name, cpu_seconds(fn, clock))
                    for name, fn in (sides if rep % 2 == 0 else sides[::-1])
                ]
            except OSError:  # a thread ended while measured: measure this repetition again
                continue
            for name, seconds in figures:
                cpu[name].append(seconds)
            rep += 1
        # Scrapes in a loop of their own: 4 ms of other work inside each repetition would
        # weigh on whichever side follows it, and scrapes are rarer than ticks in a daemon.
        for _ in range(reps):
            wall = time.perf_counter()
            scrapes.append(cpu_seconds(lambda: generate_latest(registry), clock))
            scrape_walls.append(time.perf_counter() - wall)
        body = generate_latest(registry)
    finally:
        sampler.close()
        backend.close()

    rss: int | None = None
    rss_source = "not measured"
    daemon_mig_devices = 0
    if with_daemon:
        rss, rss_source, daemon_mig_devices = measure_rss_daemon()
    if rss is None:
        why = rss_source
        rss = psutil.Process(os.getpid()).memory_info().rss
        rss_source = f"this process, in-process sampler + collector ({why})"

    bares = cpu["bare"]

    def over_bare(side: str) -> float:
        return statistics.median(t / b for t, b in zip(cpu[side], bares, strict=True))

    tick_over_bare = over_bare("tick")
    scrape = statistics.median(scrapes)
    return {
        "node": f"{SPEC}, MIG {PROFILE} x 7 per GPU",
        "gpus": len(snap.gpus),
        "mig_devices": mig_devices,
        "nvml_calls_per_tick": len(calls),
        "reps": reps,
        "tick_cpu_s": statistics.median(cpu["tick"]),
        "tick_cpu_min_s": min(cpu["tick"]),
        "bare_cpu_s": statistics.median(bares),
        "bare_cpu_min_s": min(bares),
        "adapter_cpu_s": statistics.median(cpu["adapter"]),
        "adapter_cpu_min_s": min(cpu["adapter"]),
        "adapter_over_bare": over_bare("adapter"),
        "tick_over_bare": tick_over_bare,
        "tick_over_bare_target": TICK_RATIO_TARGET,
        "scrape_cpu_s": scrape,
        "scrape_wall_s": statistics.median(scrape_walls),
        "scrape_target_s": SCRAPE_TARGET_S,
        "scrape_bytes": len(body),
        "scrape_samples": sum(
            1 for line in body.decode().splitlines() if line and not line.startswith("#")
        ),
        "rss_bytes": rss,
        "rss_source": rss_source,
        "rss_daemon_mig_devices": daemon_mig_devices,
        "rss_target_bytes": RSS_TARGET_BYTES,
        "ok": tick_over_bare <= TICK_RATIO_TARGET
        and scrape <= SCRAPE_TARGET_S
        and rss <= RSS_TARGET_BYTES,
    }


def _ok(good: bool) -> str:
    return "ok" if good else "OVER TARGET"


LABELS = {"bare": "bare NVML loop", "adapter": "backend calls only", "tick": "sampler tick"}


def so_far(cpu: dict[str, list[float]], planned: int) -> dict[str, Any]:
    """The figures of the repetitions done (``reps`` of them, of ``planned``), keyed as
    :func:`run`'s; none but the counts if none was."""
    done = min((len(figures) for figures in cpu.values()), default=0)
    figures: dict[str, Any] = {"reps": done, "reps_planned": planned}
    if not done:
        return figures
    for side in LABELS:
        figures[f"{side}_cpu_s"] = statistics.median(cpu[side])
        figures[f"{side}_cpu_min_s"] = min(cpu[side])
        if side != "bare":
            figures[f"{side}_over_bare"] = statistics.median(
                t / b for t, b in zip(cpu[side], cpu["bare"], strict=True)
            )
    return figures


def print_so_far(figures: dict[str, Any]) -> None:
    """Each side's CPU time over the repetitions done, as the text output does."""
    if not figures["reps"]:
        return
    for side, label in LABELS.items():
        ratio = figures.get(f"{side}_over_bare", 1.0)
        print(
            f"{label:<20}{figures[f'{side}_cpu_s'] * 1000:8.3f} ms CPU   {ratio:.2f} x bare"
            f" (median of {figures['reps']}; min {figures[f'{side}_cpu_min_s'] * 1000:.3f} ms)"
        )


@restores_signals
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_telemetry", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--reps", type=int, default=200, help="repetitions (medians are reported)")
    p.add_argument(
        "--no-daemon", action="store_true", help="measure in-process RSS, do not start gpud"
    )
    p.add_argument(
        "--cpu",
        default=str(min(os.sched_getaffinity(0))),
        help="run on this CPU only (default: the first this process may use), or 'all' "
        "to let the scheduler place the threads (see the module docstring)",
    )
    args = p.parse_args(argv)
    if args.cpu == "all":
        args.cpu = None
    else:
        try:
            args.cpu = int(args.cpu)
        except ValueError:
            p.error(f"--cpu: a CPU number or 'all', not {args.cpu!r}")
        os.sched_setaffinity(0, {args.cpu})  # before any thread starts: they inherit it
    reps = max(1, args.reps)
    cpu: dict[str, list[float]] = {}
    with stopped_by_signal() as stopped:
        r = run(
            reps,
            with_daemon=not args.no_daemon,
            cpu=cpu,
            progress=sys.stderr if args.json else sys.stdout,
        )
    if stopped.by:
        figures = {**so_far(cpu, reps), "cpu": args.cpu}
        done = f"{figures['reps']} of {reps} repetitions"
        return cut_short(
            stopped.by, done, figures=figures, show=None if args.json else print_so_far
        )
    r["cpu"] = args.cpu
    if args.json:
        print(json.dumps(r, indent=2, sort_keys=True))
        return 0 if r["ok"] else 1
    ms = 1000.0
    print(f"node: {r['node']}: {r['gpus']} GPUs, {r['mig_devices']} MIG devices")
    where = "all CPUs" if r["cpu"] is None else f"CPU {r['cpu']} only"
    print(
        f"NVML calls per tick: {r['nvml_calls_per_tick']}; {r['reps']} repetitions on {where}, "
        "ratios are medians of per-repetition ratios"
    )
    print(
        f"bare NVML loop      {r['bare_cpu_s'] * ms:8.3f} ms CPU   "
        f"(median; min {r['bare_cpu_min_s'] * ms:.3f} ms)"
    )
    print(
        f"backend calls only  {r['adapter_cpu_s'] * ms:8.3f} ms CPU   "
        f"{r['adapter_over_bare']:.2f} x bare (NvmlBackend, no sampler; "
        f"min {r['adapter_cpu_min_s'] * ms:.3f} ms)"
    )
    print(
        f"sampler tick        {r['tick_cpu_s'] * ms:8.3f} ms CPU   "
        f"{r['tick_over_bare']:.2f} x bare (target <= {TICK_RATIO_TARGET} x; "
        f"min {r['tick_cpu_min_s'] * ms:.3f} ms)  {_ok(r['tick_over_bare'] <= TICK_RATIO_TARGET)}"
    )
    print(
        f"/metrics scrape     {r['scrape_cpu_s'] * ms:8.3f} ms CPU, "
        f"{r['scrape_wall_s'] * ms:.3f} ms wall, {r['scrape_samples']} samples, "
        f"{r['scrape_bytes']} bytes (target <= {SCRAPE_TARGET_S * ms:.0f} ms)  "
        f"{_ok(r['scrape_cpu_s'] <= SCRAPE_TARGET_S)}"
    )
    print(
        f"RSS                 {r['rss_bytes'] / 1e6:8.1f} MB      ({r['rss_source']}, "
        f"{r['rss_daemon_mig_devices']} MIG devices; "
        f"target <= {RSS_TARGET_BYTES / 1e6:.0f} MB)  {_ok(r['rss_bytes'] <= RSS_TARGET_BYTES)}"
    )
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    exit_as(main())
