"""Utilization, JCT and each service's p99 against its SLO over time, for every policy."""

from __future__ import annotations

import math
from pathlib import Path

from tools.colosim.engine import simulate
from tools.colosim.policies import POLICY_NAMES, make
from tools.colosim.scenario import Scenario
from tools.colosim.workloads import SERVICE_TYPES
from tools.netsim.plot import MissingMatplotlib, _pyplot

__all__ = ["MissingMatplotlib", "plot_scenario"]


def _smooth(values: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= n:
            acc -= values[i - n]
        out.append(acc / min(i + 1, n))
    return out


def plot_scenario(scenario: Scenario, out: Path, seed: int = 0) -> None:
    """One row per policy: utilization (5-minute mean), JCT of each job at its completion,
    and each service's p99 (1-minute max) against its SLO (dashed)."""
    plt = _pyplot()
    trace = scenario.trace(seed)
    runs = {p: simulate(scenario, trace, make(p), series=True) for p in POLICY_NAMES}
    services = [s.name for s in scenario.services]
    cols = 2 + len(services)
    fig, axes = plt.subplots(
        len(runs), cols, figsize=(3.6 * cols, 2.2 * len(runs)), sharex="col", squeeze=False
    )
    win = max(1, int(300 / scenario.tick_s))
    pwin = max(1, int(60 / scenario.tick_s))
    for row, (name, r) in enumerate(runs.items()):
        t_h = [t / 3600 for t, _, _ in r.series]
        ax = axes[row][0]
        ax.plot(t_h, _smooth([u for _, u, _ in r.series], win), lw=1.0)
        ax.set_ylim(0, 1)
        ax.set_ylabel(f"{name}\nGPU util", fontsize=8)
        ax = axes[row][1]
        ax.scatter([f / 3600 for f, _ in r.finishes], [j / 60 for _, j in r.finishes], s=3)
        ax.set_ylabel("JCT (min)", fontsize=8)
        for k, svc in enumerate(services):
            ax = axes[row][2 + k]
            raw = [p.get(svc) for _, _, p in r.series]
            vals = [min(5.0, v) if v is not None and math.isfinite(v) else 5.0 for v in raw]
            peak = [max(vals[max(0, i - pwin + 1) : i + 1]) for i in range(len(vals))]
            slo = SERVICE_TYPES[next(s.type for s in scenario.services if s.name == svc)].slo_s
            ax.plot(t_h, [v * 1e3 for v in peak], lw=0.7)
            ax.axhline(slo * 1e3, color="black", ls="--", lw=0.8)
            ax.set_ylim(0, slo * 2e3)
            ax.set_ylabel(f"{svc} p99 (ms)", fontsize=8)
        for ax in axes[row]:
            ax.tick_params(labelsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("hours", fontsize=8)
    fig.suptitle(f"{scenario.name} (load {scenario.load}, seed {seed})", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
