"""One co-location planning pass for 8 GPUs and 32 jobs, against the 50 ms budget.

``python -m tools.bench_colocate [--repeat N]`` prints the median CPU time of one pass (the
thread's own, which other load on a shared machine does not inflate) against the budget,
and the median and worst wall time, for a cold planner (fresh prices) and a warm one (prices
kept from the previous pass). Half the jobs run (2 per GPU, two of them inference services),
half wait; features are drawn from a fixed seed. A SIGTERM or SIGINT stops it: the figures
of the passes done so far, "cut short by SIGNAL after N of M passes", dying by it (128 + its number).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from colocate import (
    GpuView,
    InterferencePredictor,
    JobFeatures,
    JobKind,
    JobView,
    Plan,
    Planner,
    Shape,
)
from tools.simdaemon import cut_short, exit_as, held, restores_signals, stopped_by_signal

BUDGET_S = 0.050
GIB = 1 << 30


def workload(seed: int = 7) -> tuple[list[GpuView], list[JobView]]:
    rng = random.Random(seed)
    gpus = [GpuView(index=i, memory_total=80 * GIB) for i in range(8)]
    jobs: list[JobView] = []
    for k in range(32):
        sm, bw = rng.uniform(0.1, 0.9), rng.uniform(0.05, 0.8)
        if k < 2:
            shape = Shape.prior(
                f"svc{k}",
                JobKind.INFERENCE,
                memory_bytes=20 * GIB,
                peak=400.0,
                knee=0.6,
                bw_intensity=0.4,
                slo_s=0.1,
            )
            job = JobView(
                f"svc{k}",
                shape,
                JobFeatures(sm=0.6, mem_bw=0.4),
                gpu=k,
                sm_share=0.5,
                load=100.0,
                peak_load=150.0,
                order=k,
            )
        else:
            shape = Shape.prior(
                f"t{k}",
                JobKind.TRAINING,
                memory_bytes=int(rng.uniform(4, 30) * GIB),
                knee=sm,
                bw_intensity=bw,
            )
            running = k < 16
            job = JobView(
                f"t{k}",
                shape,
                JobFeatures(sm=sm, mem_bw=bw, host_cpu=0.05),
                gpu=(k % 8) if running else None,
                order=k,
            )
        jobs.append(job)
    return gpus, jobs


@restores_signals
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args(argv)
    gpus, jobs = workload()
    passes: dict[str, Passes] = {}
    with stopped_by_signal() as stopped:
        print(f"measuring: 2 planners x {args.repeat} passes", file=sys.stderr, flush=True)
        for label, warm in (("cold", False), ("warm", True)):
            done = passes[label] = Passes()
            planner = Planner(InterferencePredictor())
            for _ in range(args.repeat):
                if not warm:
                    planner = Planner(InterferencePredictor())
                t0, c0 = time.perf_counter(), time.thread_time()
                plan = planner.plan(gpus, jobs)
                done.add(time.thread_time() - c0, time.perf_counter() - t0, plan)
            print(done.line(label), flush=True)
    if stopped.by:
        for label, done in passes.items():
            if done.plan is not None and len(done.cpu) < args.repeat:
                print(done.line(label) + f" ({len(done.cpu)} passes)")
        timed = sum(len(done.cpu) for done in passes.values())
        return cut_short(stopped.by, f"{timed} of {2 * args.repeat} passes", cleaned="")
    return 0


@dataclass
class Passes:
    """One planner's passes, each recorded as it ends (what a run cut short has)."""

    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    plan: Plan | None = None

    def add(self, cpu: float, wall: float, plan: Plan) -> None:
        """The pass recorded whole: a signal meanwhile waits (held), lest its lists differ."""
        with held():
            self.cpu.append(cpu)
            self.wall.append(wall)
            self.plan = plan

    def line(self, label: str) -> str:
        assert self.plan is not None
        med_cpu, plan = statistics.median(self.cpu), self.plan
        return (
            f"{label}: median CPU {med_cpu * 1e3:.1f} ms ({med_cpu / BUDGET_S:.2f} x budget), "
            f"wall median {statistics.median(self.wall) * 1e3:.1f} ms, worst "
            f"{max(self.wall) * 1e3:.1f} ms; placed {len(plan.placements)}, waiting "
            f"{len(plan.waiting)}, price iterations {plan.convergence.iterations}, residual "
            f"{plan.convergence.residual:.3f}"
        )


if __name__ == "__main__":
    exit_as(main())
