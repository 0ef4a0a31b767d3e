"""One co-location planning pass for 8 GPUs and 32 jobs, against the 50 ms budget.

``python -m tools.bench_colocate [--repeat N]`` prints the median and worst pass time of a
cold planner (fresh prices) and a warm one (prices kept from the previous pass), and each
as a fraction of the budget. Half the jobs run (2 per GPU, two of them inference services),
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
        times = []
        for _ in range(args.repeat):
            if not warm:
                planner = Planner(InterferencePredictor())
            t0 = time.perf_counter()
            plan = planner.plan(gpus, jobs)
            times.append(time.perf_counter() - t0)
        results[label] = (statistics.median(times), max(times), plan)
    for label, (med, worst, plan) in results.items():
        print(
            f"{label}: median {med * 1e3:.1f} ms ({med / BUDGET_S:.2f} x budget), worst "
            f"{worst * 1e3:.1f} ms ({worst / BUDGET_S:.2f} x budget); placed "
            f"{len(plan.placements)}, waiting {len(plan.waiting)}, price iterations "
            f"{plan.convergence.iterations}, residual {plan.convergence.residual:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
