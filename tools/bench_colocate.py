"""One co-location planning pass for 8 GPUs and 32 jobs, against the 50 ms budget.

``python -m tools.bench_colocate [--repeat N]`` prints the median CPU time of one pass (the
thread's own, which other load on a shared machine does not inflate) against the budget,
and the median and worst wall time, for a cold planner (fresh prices) and a warm one (prices
kept from the previous pass). Half the jobs run (2 per GPU, two of them inference services),
half wait; features are drawn from a fixed seed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from colocate import (
    GpuView,
    InterferencePredictor,
    JobFeatures,
    JobKind,
    JobView,
    Planner,
    Shape,
)

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    gpus, jobs = workload()
    results = {}
    for label, warm in (("cold", False), ("warm", True)):
        planner = Planner(InterferencePredictor())
        times, cpu = [], []
        for _ in range(args.repeat):
            if not warm:
                planner = Planner(InterferencePredictor())
            t0, c0 = time.perf_counter(), time.thread_time()
            plan = planner.plan(gpus, jobs)
            cpu.append(time.thread_time() - c0)
            times.append(time.perf_counter() - t0)
        results[label] = (statistics.median(cpu), statistics.median(times), max(times), plan)
    for label, (med_cpu, med, worst, plan) in results.items():
        print(
            f"{label}: median CPU {med_cpu * 1e3:.1f} ms ({med_cpu / BUDGET_S:.2f} x budget), "
            f"wall median {med * 1e3:.1f} ms, worst {worst * 1e3:.1f} ms; placed "
            f"{len(plan.placements)}, waiting {len(plan.waiting)}, price iterations "
            f"{plan.convergence.iterations}, residual {plan.convergence.residual:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
