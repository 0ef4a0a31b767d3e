"""``python -m tools.testbed run``: the same jobs under the kernel's default qdisc and under
gpud, on a real kernel (network namespaces, a veth bottleneck shaped by HTB), side by side.

::

    sudo .venv/bin/python -m tools.testbed run --json [--jobs SPEC] [--plot FILE.png]
        [--rate 400mbit] [--seconds 20] [--warmup 5] [--cc default,cubic] [--repeat 2]

``--jobs NAME:CONNS:MB:COMPUTE_MS,...`` runs one mix ("custom"); without it the built-in
mixes run. For each congestion control and repetition, the testbed measures the link's
goodput G (one bulk transfer), each job's contention-free iteration time T* (the job
alone), then every mix twice: under the baseline, and under gpud (jobs launched with
``gpuctl run``, marked by cgroup, reporting progress through ``gpud.client``). It prints::

    {"mixes": {NAME: {"ceiling": x, "baseline": {"min_progress", "jain", "efficiency"},
                      "gpud": {...}}}, "runs": [...], "setup": {...}}

where ``mixes`` holds the mean over every run and ``runs`` each run's own figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from gpud.config import parse_rate
from tools.testbed.bed import RCV_IP, Bed, kernel_default_cc
from tools.testbed.metrics import JobSpec, ceiling, parse_jobs, series, summarize

# Per-flow sharing treats these unfairly: one connection against 8 and 16.
MIXES: dict[str, str] = {
    "unfair": "solo:1:6:60,wide:16:6:60,mid:8:6:60",
    "equal": "e1:4:6:60,e2:4:6:60,e3:4:6:60",
    "mixed": "heavy:8:10:40,light:2:3:120,solo:1:6:60",
}

# gpud's knobs for a testbed whose phases last tens of seconds: a re-rank every tick (no
# threshold, no hysteresis), jobs ranked by the deficit they gathered (their long-run rate
# alone: ranked by a short window's rate, jobs of equal demand trade the top level every
# few iterations and drift apart by what no window remembers), and level 0's leaves
# guaranteed most of the link (a rate HTB takes up once the leaf's tokens allow, where a
# changed prio waits for the leaf's queue to drain).
GPUD_TRAFFIC = {
    "levels": 4,
    "progress_window_s": 2.0,
    "progress_long_weight": 1.0,
    "top_share": 0.9,
    "max_age_s": 0.2,
    "threshold": 0.0,
    "hysteresis": 0.0,
    "group_tolerance": 0.0,
}
# gpud's loop period in the testbed: a level change lands within an iteration of these jobs
# (their compute phases are 40-120 ms), not a second later.
GPUD_TICK_S = 0.2


class Interrupted(BaseException):
    """SIGTERM: a BaseException, as KeyboardInterrupt is, so that no ``except Exception``
    on the way swallows it and the run goes on after it was asked to stop."""


def _on_term(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(f"signal {signum}")


def _sender_argv(
    job: JobSpec, port: int, seconds: float, log: Path, *, cc: str, ideal: float | None
) -> list[str]:
    argv = [
        sys.executable, "-m", "tools.testbed.job", "send", "--host", RCV_IP, "--port", str(port),
        "--conns", str(job.conns), "--bytes", str(job.nbytes),
        "--compute-ms", str(job.compute_s * 1000), "--seconds", str(seconds), "--log", str(log),
    ]  # fmt: skip
    if cc:
        argv += ["--cc", cc]
    if ideal is not None:
        argv += ["--report", "--ideal", f"{ideal:.6f}"]
    return argv


def _receiver_argv(job: JobSpec, port: int) -> list[str]:
    return [
        sys.executable, "-m", "tools.testbed.job", "recv", "--port", str(port),
        "--conns", str(job.conns), "--bytes", str(job.nbytes),
    ]  # fmt: skip


def run_jobs(
    bed: Bed,
    jobs: Sequence[JobSpec],
    seconds: float,
    cc: str,
    tag: str,
    *,
    gpud_ideal: dict[str, float] | None = None,
) -> tuple[dict[str, list[float]], float]:
    """Run ``jobs`` together for ``seconds``; returns each job's completion times and the
    time they all started. With ``gpud_ideal`` they run under ``gpuctl run`` and report."""
    logs = {j.name: bed.tmp / f"{tag}-{j.name}.log" for j in jobs}
    for path in logs.values():
        path.unlink(missing_ok=True)
    receivers = []
    for i, job in enumerate(jobs):
        receivers.append(bed.spawn([*bed.in_rcv, *_receiver_argv(job, 7100 + i)]))
    time.sleep(0.5)
    start = time.time()
    senders = []
    for i, job in enumerate(jobs):
        ideal = gpud_ideal[job.name] if gpud_ideal is not None else None
        argv = _sender_argv(job, 7100 + i, seconds, logs[job.name], cc=cc, ideal=ideal)
        if gpud_ideal is not None:
            argv = [
                *bed.in_snd, str(Path(sys.executable).parent / "gpuctl"), "--socket",
                str(bed.socket), "run", "--job", job.name, "--gpus", "1", "--", *argv,
            ]  # fmt: skip
        else:
            argv = [*bed.in_snd, *argv]
        senders.append(bed.spawn(argv, log=bed.tmp / f"{tag}-{job.name}.out"))
    for proc in senders:
        try:
            proc.wait(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            break
    for proc, job in zip(senders, jobs, strict=True):
        out = (bed.tmp / f"{tag}-{job.name}.out").read_text()
        if proc.returncode not in (0, None):
            raise RuntimeError(f"job {job.name} ({tag}) exited {proc.returncode}:\n{out[-1500:]}")
        if "not marked by cgroup" in out:  # its figures would measure the default class
            raise RuntimeError(f"job {job.name} ({tag}) ran unmarked:\n{out[-1500:]}")
    bed.stop_all()
    del receivers
    times = {
        name: [float(x) for x in path.read_text().split()] if path.exists() else []
        for name, path in logs.items()
    }
    return times, start


def measure_goodput(bed: Bed, cc: str, seconds: float = 4.0) -> float:
    """Bits/s one bulk job (8 connections, no compute) gets through the bottleneck."""
    bed.baseline_shaping()
    job = JobSpec("bulk", 8, 8_000_000, 0.0)
    times, _ = run_jobs(bed, [job], seconds, cc, "goodput")
    t = times["bulk"]
    if len(t) < 3:
        raise RuntimeError("the bottleneck carried almost nothing: is the machine overloaded?")
    return (len(t) - 1) * job.nbytes * 8 / (t[-1] - t[0])


def contention_free(bed: Bed, job: JobSpec, cc: str, seconds: float = 4.0) -> float:
    """The job's median iteration time alone on the bottleneck."""
    bed.baseline_shaping()
    times, _ = run_jobs(bed, [job], seconds, cc, f"alone-{job.name}")
    t = times[job.name]
    gaps = [b - a for a, b in itertools.pairwise(t[1:])]  # skip the slow-start iteration
    if len(gaps) < 3:
        raise RuntimeError(f"job {job.name}: too few iterations alone to time it")
    return statistics.median(gaps)


def run_mix(
    bed: Bed,
    jobs: Sequence[JobSpec],
    ideal: dict[str, float],
    goodput: float,
    *,
    cc: str,
    seconds: float,
    warmup: float,
    tag: str,
) -> dict[str, Any]:
    result: dict[str, Any] = {"ceiling": round(ceiling(jobs, ideal, goodput), 4)}
    traces: dict[str, Any] = {}
    qdisc = bed.baseline_shaping()
    times, start = run_jobs(bed, jobs, seconds, cc, f"{tag}-baseline")
    result["baseline"] = summarize(
        jobs, times, ideal, goodput, t0=start + warmup, t1=start + seconds
    )
    result["baseline"]["qdisc"] = qdisc
    traces["baseline"] = {
        j.name: series(times[j.name], ideal[j.name], start, start + seconds) for j in jobs
    }
    bed.start_gpud(GPUD_TRAFFIC, tick_s=GPUD_TICK_S)
    try:
        for job in jobs:
            bed.gpuctl("jobs", "add", job.name)
        times, start = run_jobs(bed, jobs, seconds, cc, f"{tag}-gpud", gpud_ideal=ideal)
        shown = json.loads(bed.gpuctl("net", "show", "--json").stdout)
        for job in jobs:  # releases their tags; the next mix starts from a clean registry
            bed.gpuctl("jobs", "rm", job.name, "--force")
    finally:
        bed.stop_gpud()
    result["gpud"] = summarize(jobs, times, ideal, goodput, t0=start + warmup, t1=start + seconds)
    result["gpud"]["level_changes"] = int(shown.get("level_changes_total", 0))
    traces["gpud"] = {
        j.name: series(times[j.name], ideal[j.name], start, start + seconds) for j in jobs
    }
    result["_traces"] = traces
    return result


def _mean(values: list[float]) -> float:
    return round(statistics.fmean(values), 4)


# A job under this fraction of the ceiling for a whole phase all but stopped (a sender that
# could not start or connect, a machine too loaded to run it): the phase measures that, not
# the scheduler, and is flagged.
STALL_FRACTION = 0.2


def stalled(phase: dict[str, Any], ceiling: float) -> list[str]:
    """The jobs of one phase that made under STALL_FRACTION of the ceiling."""
    return sorted(j for j, v in phase["progress"].items() if v < STALL_FRACTION * ceiling)


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over runs per mix and side; ``stalled_runs`` lists the runs (by index) in which
    a job all but stopped, which the means still include."""
    out: dict[str, Any] = {}
    names = list(runs[0]["mixes"])
    for name in names:
        per = [r["mixes"][name] for r in runs]
        entry: dict[str, Any] = {"ceiling": _mean([p["ceiling"] for p in per])}
        for side in ("baseline", "gpud"):
            entry[side] = {
                k: _mean([p[side][k] for p in per]) for k in ("min_progress", "jain", "efficiency")
            }
            entry[side]["min_progress_runs"] = [p[side]["min_progress"] for p in per]
            entry[side]["stalled_runs"] = [
                i for i, p in enumerate(per) if stalled(p[side], p["ceiling"])
            ]
        b, g = entry["baseline"], entry["gpud"]
        entry["gpud_over_baseline"] = round(g["min_progress"] / max(b["min_progress"], 1e-9), 3)
        entry["gpud_over_ceiling"] = round(g["min_progress"] / entry["ceiling"], 3)
        entry["efficiency_ratio"] = round(g["efficiency"] / max(b["efficiency"], 1e-9), 3)
        out[name] = entry
    return out


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = runs[0]
    names = list(run["mixes"])
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.2 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        traces = run["mixes"][name]["_traces"]
        for col, side in enumerate(("baseline", "gpud")):
            ax = axes[row][col]
            for job, points in traces[side].items():
                ax.plot([p[0] for p in points], [p[1] for p in points], label=job)
            ceil = run["mixes"][name]["ceiling"]
            ax.axhline(ceil, color="grey", linestyle="--", linewidth=0.8, label="ceiling")
            ax.set_ylim(0, 1.1)
            ax.set_title(f"{name}: {side} (cc {run['cc']})")
            ax.set_xlabel("s")
            ax.set_ylabel("progress rate")
            ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.testbed")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="baseline vs gpud on a real-kernel bottleneck")
    p.add_argument("--jobs", help="NAME:CONNS:MB:COMPUTE_MS,... (one custom mix)")
    p.add_argument("--mixes", default=",".join(MIXES), help="built-in mixes to run")
    p.add_argument("--rate", default="400mbit", help="bottleneck rate (tc notation)")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    p.add_argument("--warmup", type=float, default=5.0, help="left out of the figures")
    p.add_argument("--cc", default="default", help="congestion controls: default,cubic,...")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--levels", type=int, default=GPUD_TRAFFIC["levels"], help="gpud's levels")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another of gpud's [traffic] knobs for the run (threshold, hysteresis, "
        "progress_window_s, progress_long_weight, top_share, max_age_s, group_tolerance)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", type=Path, metavar="FILE.png")
    args = parser.parse_args(argv)
    if args.jobs:
        mixes = {"custom": parse_jobs(args.jobs)}
    else:
        unknown = [m for m in args.mixes.split(",") if m not in MIXES]
        if unknown:
            parser.error(f"unknown mix {unknown[0]!r} (have {', '.join(MIXES)})")
        mixes = {m: parse_jobs(MIXES[m]) for m in args.mixes.split(",")}
    specs: dict[str, JobSpec] = {}
    for jobs in mixes.values():
        for job in jobs:
            if specs.setdefault(job.name, job) != job:
                parser.error(f"job {job.name!r} is defined twice, differently")
    if args.warmup >= args.seconds:
        parser.error("--warmup must be shorter than --seconds")
    rate = parse_rate(args.rate)
    GPUD_TRAFFIC["levels"] = args.levels
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or key not in GPUD_TRAFFIC or key == "levels":
            knobs = ", ".join(k for k in GPUD_TRAFFIC if k != "levels")
            parser.error(f"--set {item!r}: expected KEY=VALUE with KEY one of {knobs}")
        try:
            GPUD_TRAFFIC[key] = float(value)
        except ValueError:
            parser.error(f"--set {item!r}: {value!r} is not a number")
    ccs = [c.strip() for c in args.cc.split(",") if c.strip()]
    signal.signal(signal.SIGTERM, _on_term)
    runs: list[dict[str, Any]] = []
    default_cc = kernel_default_cc()
    try:
        with Bed(rate) as bed:
            for cc_name in ccs:
                cc = "" if cc_name == "default" else cc_name
                for rep in range(args.repeat):
                    goodput = measure_goodput(bed, cc)
                    ideal: dict[str, float] = {}
                    for jobs in mixes.values():
                        for job in jobs:
                            if job.name not in ideal:
                                ideal[job.name] = contention_free(bed, job, cc)
                    run: dict[str, Any] = {
                        "cc": cc or f"default ({default_cc})",
                        "repeat": rep,
                        "goodput_bps": round(goodput),
                        "contention_free_s": {k: round(v, 4) for k, v in ideal.items()},
                        "mixes": {},
                    }
                    for name, jobs in mixes.items():
                        run["mixes"][name] = run_mix(
                            bed, jobs, ideal, goodput, cc=cc, seconds=args.seconds,
                            warmup=args.warmup, tag=f"{cc_name}-{rep}-{name}",
                        )  # fmt: skip
                        m = run["mixes"][name]
                        for side in ("baseline", "gpud"):
                            if slow := stalled(m[side], m["ceiling"]):
                                print(
                                    f"testbed: {run['cc']} #{rep} {name} {side}: "
                                    f"{', '.join(slow)} made under {STALL_FRACTION:g} of the "
                                    "ceiling; this phase measures a stalled job",
                                    file=sys.stderr,
                                )
                        if not args.json:
                            print(
                                f"{run['cc']} #{rep} {name}: ceiling {m['ceiling']}"
                                f" baseline {m['baseline']['min_progress']}"
                                f" gpud {m['gpud']['min_progress']}",
                                file=sys.stderr,
                            )
                    runs.append(run)
    except (KeyboardInterrupt, Interrupted):
        print("testbed: interrupted; everything it created is removed", file=sys.stderr)
        return 130
    if args.plot:
        plot(runs, args.plot)
    for run in runs:
        for m in run["mixes"].values():
            m.pop("_traces", None)
    aggregated = aggregate(runs)
    report = {
        "setup": {
            "rate_bps": rate,
            "seconds": args.seconds,
            "warmup": args.warmup,
            "baseline_qdisc": runs[0]["mixes"][next(iter(mixes))]["baseline"]["qdisc"],
            "mixes": {k: [vars(j) for j in v] for k, v in mixes.items()},
            "gpud_traffic": GPUD_TRAFFIC,
            "gpud_tick_s": GPUD_TICK_S,
        },
        "mixes": aggregated,
        "runs": runs,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name, m in aggregated.items():
            print(
                f"{name:8} ceiling {m['ceiling']:.3f}  baseline {m['baseline']['min_progress']:.3f}"
                f"  gpud {m['gpud']['min_progress']:.3f}  (x{m['gpud_over_baseline']} baseline,"
                f" {m['gpud_over_ceiling']} of ceiling, efficiency x{m['efficiency_ratio']})"
            )
    return 0
