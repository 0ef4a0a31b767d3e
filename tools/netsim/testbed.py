"""The real-kernel testbed's mixes in the fluid model, and the two side by side.

``tools/testbed`` runs emulated jobs -- compute (sleep), then an iteration's bytes over
``conns`` TCP connections through an HTB-shaped veth bottleneck -- under the kernel's
default qdisc and under gpud. Here the same jobs become netsim scenarios: one link at the
bottleneck's rate, each job one flow group of ``conns`` flows, the testbed's phase length
and warm-up, gpud's traffic knobs and loop period as the testbed sets them (levels,
progress window, re-rank age, threshold, hysteresis; a tick every 0.2 s). ``fair`` stands for the kernel's default qdisc
(per-flow sharing), ``leveller`` for gpud, the fluid bound for the testbed's ceiling.

The mixes come from a testbed result file's ``setup`` when one is given (so a custom
``--jobs`` mix is mirrored exactly), else from ``tools.testbed.run.MIXES``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tools.netsim.metrics import ScenarioReport, run_scenarios
from tools.netsim.scenario import Scenario, from_dict

RATE_BPS = 400e6
SECONDS = 20.0
WARMUP_S = 5.0
LINK = "bottleneck"
FIGURES = ("min_progress", "jain", "efficiency")


def mixes_from_testbed() -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """(mix -> jobs as dicts, gpud traffic knobs) from the testbed's own definitions."""
    from tools.testbed.metrics import parse_jobs
    from tools.testbed.run import GPUD_TRAFFIC, MIXES

    mixes = {name: [vars(j) for j in parse_jobs(spec)] for name, spec in MIXES.items()}
    return mixes, dict(GPUD_TRAFFIC)


def scenario(
    name: str,
    jobs: Sequence[Mapping[str, Any]],
    traffic: Mapping[str, Any],
    *,
    rate_bps: float = RATE_BPS,
    seconds: float = SECONDS,
    warmup: float = WARMUP_S,
    tick_s: float | None = None,
) -> Scenario:
    """A testbed mix as a scenario (jobs as the testbed writes them in its ``setup``), with
    gpud's loop period ``tick_s`` (default: the testbed's)."""
    if tick_s is None:
        from tools.testbed.run import GPUD_TICK_S

        tick_s = GPUD_TICK_S
    # top_share is HTB's (a rate taken up at once where a prio waits for a queue to drain):
    # the fluid model's levels take effect at once anyway
    knobs = {k: float(v) for k, v in traffic.items() if k not in ("levels", "top_share")}
    return from_dict(
        {
            "name": f"testbed-{name}",
            "description": f"the testbed's {name!r} mix at {rate_bps / 1e6:g} Mbit/s",
            "levels": int(traffic.get("levels", 8)),
            "update_interval_s": tick_s,
            "duration_s": seconds,
            "warmup_s": warmup,
            "links": {LINK: {"gbps": rate_bps / 1e9}},
            "leveller": knobs,
            "jobs": [
                {
                    "id": j["name"],
                    "compute_s": j["compute_s"],
                    "flows": [
                        {"bytes": j["nbytes"] / j["conns"], "path": [LINK], "count": j["conns"]}
                    ],
                }
                for j in jobs
            ],
        }
    )


def scenarios(results: Mapping[str, Any] | None = None) -> list[Scenario]:
    """The testbed's mixes, from a result file's ``setup`` or from the testbed's code."""
    if results is not None and "setup" in results:
        setup = results["setup"]
        return [
            scenario(
                name,
                jobs,
                setup.get("gpud_traffic", {}),
                rate_bps=float(setup.get("rate_bps", RATE_BPS)),
                seconds=float(setup.get("seconds", SECONDS)),
                warmup=float(setup.get("warmup", WARMUP_S)),
                tick_s=float(setup["gpud_tick_s"]) if "gpud_tick_s" in setup else None,
            )
            for name, jobs in setup["mixes"].items()
        ]
    mixes, traffic = mixes_from_testbed()
    return [scenario(name, jobs, traffic) for name, jobs in mixes.items()]


def link_efficiency(report: ScenarioReport, sc: Scenario, policy: str) -> float:
    """The testbed's efficiency: bytes the jobs completed in the window over what the link
    could carry in it."""
    lo, hi = sc.warmup_s, sc.duration_s
    per_iter = {j.id: sum(f.bytes * f.count for f in j.flows) for j in sc.jobs}
    carried = sum(
        per_iter[job] * sum(1 for t in run.completions if lo < t <= hi)
        for job, run in report.runs[policy].jobs.items()
    )
    return carried / (sc.link_bytes_per_s(LINK) * (hi - lo))


def compare(
    results: Mapping[str, Any] | None = None, workers: int = 1
) -> dict[str, dict[str, Any]]:
    """Per mix: the fluid figures (fair, leveller, bound) and, given results, the kernel's."""
    scs = scenarios(results)
    reports = run_scenarios(scs, ["fair", "leveller"], workers)
    out: dict[str, dict[str, Any]] = {}
    for sc, report in zip(scs, reports, strict=True):
        mix = sc.name.removeprefix("testbed-")
        fluid: dict[str, Any] = {"ceiling": report.bound.min_progress}
        for side, policy in (("baseline", "fair"), ("gpud", "leveller")):
            m = report.policies[policy]
            fluid[side] = {
                "min_progress": m.min_progress,
                "jain": m.jain,
                "efficiency": link_efficiency(report, sc, policy),
                "progress": dict(m.jobs),
            }
        row: dict[str, Any] = {"fluid": fluid}
        kernel = (results or {}).get("mixes", {}).get(mix)
        if kernel is not None:
            row["kernel"] = _figures([kernel])
            row["kernel"]["runs"] = len((results or {}).get("runs", [])) or 1
            by_cc: dict[str, list[Mapping[str, Any]]] = {}
            for run in (results or {}).get("runs", []):
                if mix in run.get("mixes", {}):
                    by_cc.setdefault(str(run.get("cc", "?")), []).append(run["mixes"][mix])
            if len(by_cc) > 1:
                row["kernel_by_cc"] = {cc: _figures(runs) for cc, runs in by_cc.items()}
        out[mix] = row
    return out


def _figures(runs: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Ceiling and both sides' figures, averaged over ``runs`` (testbed mix entries)."""

    def mean(values: list[Any]) -> float | None:
        nums = [float(v) for v in values if v is not None]
        return sum(nums) / len(nums) if nums else None

    return {
        "ceiling": mean([r.get("ceiling") for r in runs]),
        "runs": len(runs),
        **{
            side: {k: mean([r[side].get(k) for r in runs]) for k in FIGURES}
            for side in ("baseline", "gpud")
        },
    }
