"""Progress rates over time, one panel per policy (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.netsim.metrics import ScenarioReport, windowed_rates
from tools.netsim.scenario import Scenario


class MissingMatplotlib(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise MissingMatplotlib(
            "plotting needs matplotlib: pip install 'gpud[plot]' (or .venv/bin/pip install matplotlib)"
        ) from err
    return plt


def plot_progress(
    scenario: Scenario,
    report: ScenarioReport,
    out: Path,
    window_s: float = 20.0,
    panels: Sequence[str] | None = None,
) -> None:
    """Each job's trailing-window progress rate, the minimum in bold, the bound dashed."""
    plt = _pyplot()
    policies = list(panels) if panels is not None else list(report.runs)
    step = max(scenario.update_interval_s, scenario.duration_s / 300)
    times = [step * k for k in range(1, int(scenario.duration_s / step) + 1)]
    fig, axes = plt.subplots(
        1, len(policies), figsize=(4.2 * len(policies), 3.6), sharey=True, squeeze=False
    )
    for ax, name in zip(axes[0], policies, strict=True):
        run = report.runs[name]
        series = {j: windowed_rates(r, times, window_s) for j, r in sorted(run.jobs.items())}
        for values in series.values():
            ax.plot(times, [float("nan") if v is None else v for v in values], lw=0.7, alpha=0.6)
        minimum = []
        for i in range(len(times)):
            present = [v for s in series.values() if (v := s[i]) is not None]
            minimum.append(min(present) if present else float("nan"))
        ax.plot(times, minimum, color="black", lw=2.0, label="minimum")
        ax.axhline(report.bound.min_progress, color="black", ls="--", lw=1.0, label="bound (min)")
        ax.axvline(scenario.warmup_s, color="grey", ls=":", lw=0.8)
        m = report.policies[name]
        ax.set_title(f"{name}: min {m.min_progress:.2f}, jain {m.jain:.2f}", fontsize=10)
        ax.set_xlabel("time (s)")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"progress rate ({window_s:g} s window)")
    axes[0][0].legend(loc="upper right", fontsize=8)
    fig.suptitle(f"{scenario.name}: {scenario.description}", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
