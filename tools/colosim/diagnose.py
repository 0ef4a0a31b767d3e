"""What limits packing: one scenario, one seed, the colocate policy watched from outside.

``python -m tools.colosim diagnose SCENARIO [--seed 0] [--json]`` reports, over the arrival
window: how many training jobs share each GPU (GPUs that hold a service apart from the
others), the mean SM activity alone and the speed of the training that runs there, the
options the planner refused by the check that refused them and by how many jobs the GPU
already held, the predictor's margins for each standing of a pair, and whether the shadow
prices settled. The policy is the same as in ``run``; the watching changes nothing.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any, TextIO

from colocate import GpuView, JobView, Plan
from tools.colosim.engine import Actions, Observation, simulate
from tools.colosim.policies import Colocate
from tools.colosim.report import summarize
from tools.colosim.scenario import Scenario
from tools.colosim.workloads import TRAIN_TYPES


class _Watched(Colocate):
    """The colocate policy, counting what it sees and what its planner refuses."""

    window_s: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.occupancy: Counter[tuple[str, int]] = Counter()
        self.sm: dict[str, list[float]] = {"service GPUs": [], "training GPUs": []}
        self.speed: dict[str, list[float]] = {"service GPUs": [], "training GPUs": []}
        self.refused: Counter[tuple[int, str]] = Counter()
        self.residuals: list[float] = []
        self.unsettled = 0
        self._now = 0.0
        assert self.planner is not None
        plan = self.planner.plan

        def watched(
            gpus: Sequence[GpuView],
            jobs: Sequence[JobView],
            guard_duty: Any = None,
            guard_evict: Any = None,
        ) -> Plan:
            out = plan(gpus, jobs, guard_duty, guard_evict)
            if self._now < self.window_s:
                self.refused.update(out.refused)
                self.residuals.append(out.convergence.residual)
                self.unsettled += not out.convergence.converged
            return out

        self.planner.plan = watched  # type: ignore[method-assign]

    def tick(self, obs: Observation) -> Actions:
        self._now = obs.now
        if obs.now < self.window_s:
            services = {r.gpu for r in obs.running if r.kind == "inference"}
            per_gpu = Counter(r.gpu for r in obs.running if r.kind == "training")
            for g in range(obs.gpu_count):
                kind = "service GPUs" if g in services else "training GPUs"
                self.occupancy[(kind, per_gpu.get(g, 0))] += 1
            for r in obs.running:
                if r.kind == "training" and r.rate > 0 and r.gpu is not None:
                    kind = "service GPUs" if r.gpu in services else "training GPUs"
                    t = TRAIN_TYPES[r.type]
                    self.sm[kind].append(t.sm)
                    self.speed[kind].append(r.sm_util / t.sm)
        return super().tick(obs)


def diagnose(scenario: Scenario, seed: int = 0) -> dict[str, Any]:
    """The report ``diagnose --json`` prints."""
    pol = _Watched()
    pol.window_s = scenario.duration_s
    result = summarize(simulate(scenario, scenario.trace(seed), pol))
    occupancy: dict[str, dict[str, float]] = {}
    for kind in ("training GPUs", "service GPUs"):
        total = sum(v for (k, _), v in pol.occupancy.items() if k == kind)
        if total:
            occupancy[kind] = {
                str(n): round(v / total, 3)
                for (k, n), v in sorted(pol.occupancy.items())
                if k == kind
            }
    running = {
        kind: {
            "mean_sm_alone": round(statistics.fmean(pol.sm[kind]), 3),
            "mean_speed": round(statistics.fmean(pol.speed[kind]), 3),
        }
        for kind in pol.sm
        if pol.sm[kind]
    }
    refused: dict[str, dict[str, int]] = {}
    for (n, check), v in sorted(pol.refused.items()):
        refused.setdefault(str(n), {})[check] = v
    res = sorted(pol.residuals)
    return {
        "scenario": scenario.name,
        "seed": seed,
        "colocate": result,
        "training_jobs_per_gpu": occupancy,
        "running_training": running,
        "refused_by_jobs_already_there": refused,
        "predictor_margins_p90": {
            k: round(v, 3) for k, v in pol.predictor.margins(pol.params.error_quantile).items()
        },
        "prices": {
            "passes": len(res),
            "unsettled": pol.unsettled,
            "residual_p50": round(res[len(res) // 2], 4) if res else 0.0,
            "residual_max": round(res[-1], 4) if res else 0.0,
        },
    }


def print_diagnosis(d: dict[str, Any], out: TextIO) -> None:
    c = d["colocate"]
    out.write(
        f"scenario {d['scenario']} seed {d['seed']}: colocate util {c['gpu_util']:.3f}, "
        f"throughput {c['train_throughput']:.2f}, avg JCT {c['avg_jct_s']:.0f} s, "
        f"worst SLO {c['worst_service_slo']:.4f}, OOM {c['oom_events']}\n"
    )
    for kind, dist in d["training_jobs_per_gpu"].items():
        shares = ", ".join(f"{n}: {v:.0%}" for n, v in dist.items())
        run = d["running_training"].get(kind)
        extra = (
            f"; running training: SM alone {run['mean_sm_alone']:.3f}, speed {run['mean_speed']:.3f}"
            if run
            else ""
        )
        out.write(f"{kind}: training jobs per GPU (share of time) {shares}{extra}\n")
    out.write("options refused, by jobs already on the GPU:\n")
    for n, checks in d["refused_by_jobs_already_there"].items():
        out.write(
            f"  {n}: "
            + ", ".join(f"{k} {v}" for k, v in sorted(checks.items(), key=lambda x: -x[1]))
        )
        out.write("\n")
    m = d["predictor_margins_p90"]
    out.write(
        "predictor margin (log-speed, p90) by the fewest observations of a pair: "
        + ", ".join(f"{k}: {v:.3f}" for k, v in m.items())
        + "\n"
    )
    p = d["prices"]
    out.write(
        f"prices: {p['passes']} passes, {p['unsettled']} unsettled, residual median "
        f"{p['residual_p50']:.4f}, max {p['residual_max']:.4f}\n"
    )
