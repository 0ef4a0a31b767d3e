"""``python -m tools.netsim``: run scenarios, the built-in suite, plots and the benchmark.

::

    python -m tools.netsim run SCENARIO.json|BUILTIN [--policies fair,sincronia,crux,leveller] [--json]
    python -m tools.netsim suite [--json] [--only NAME,...]
    python -m tools.netsim plot SCENARIO --out docs/img/netsim-NAME.png
    python -m tools.netsim bench [SCENARIO]
    python -m tools.netsim list
    python -m tools.netsim export DIR

Exit codes: 0 ok, 2 bad arguments or scenario, 3 a needed optional package is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from tools.netsim.metrics import ScenarioReport, geomean, run_scenario
from tools.netsim.policies import EXTRA_POLICY_NAMES, POLICY_NAMES
from tools.netsim.scenario import Scenario, ScenarioError, load
from tools.netsim.suite import BUILTIN, all_builtin, builtin

EXIT_USAGE = 2
EXIT_MISSING = 3

# The targets, checked in the suite's summary: (label, leveller metric, against,
# factor). "baseline" is the better of crux and sincronia on that metric.
TARGETS: tuple[tuple[str, str, str, float], ...] = (
    ("min_progress >= 1.57 x best baseline", "min_progress", "baseline", 1.57),
    ("jain >= 1.17 x best baseline", "jain", "baseline", 1.17),
    ("efficiency >= 0.95 x fair", "efficiency", "fair", 0.95),
    ("min_progress >= 0.85 x bound", "min_progress", "bound", 0.85),
)


def resolve(name_or_path: str) -> Scenario:
    """A scenario file, or the name of a built-in one."""
    if name_or_path in BUILTIN:
        return builtin(name_or_path)
    path = Path(name_or_path)
    if not path.exists():
        raise ScenarioError(
            f"no such file or built-in scenario (built-ins: {', '.join(BUILTIN)})",
            where=name_or_path,
        )
    return load(path)


def _policies(arg: str | None) -> list[str]:
    if not arg:
        return list(POLICY_NAMES)
    names = [p.strip() for p in arg.split(",") if p.strip()]
    for n in names:
        if n not in POLICY_NAMES + EXTRA_POLICY_NAMES:
            raise ScenarioError(f"unknown policy {n!r}", where="--policies")
    return names


def print_report(report: ScenarioReport, out: TextIO) -> None:
    out.write(f"scenario {report.scenario}\n")
    out.write(f"{'policy':<18}{'min':>8}{'mean':>8}{'jain':>8}{'effic':>8}{'changes':>9}\n")
    for name, m in report.policies.items():
        out.write(
            f"{name:<18}{m.min_progress:>8.3f}{m.mean_progress:>8.3f}{m.jain:>8.3f}"
            f"{m.efficiency:>8.2f}{m.level_changes:>9d}\n"
        )
    out.write(f"{'bound':<18}{report.bound.min_progress:>8.3f}\n")
    jobs = sorted(report.bound.jobs)
    out.write("\nper-job progress rate\n")
    out.write(
        f"{'job':<16}" + "".join(f"{n[:10]:>11}" for n in report.policies) + f"{'bound':>11}\n"
    )
    for j in jobs:
        row = "".join(
            f"{report.policies[n].jobs.get(j, float('nan')):>11.3f}" for n in report.policies
        )
        out.write(f"{j:<16}{row}{report.bound.jobs[j]:>11.3f}\n")


def _best_baseline(report: ScenarioReport, metric: str) -> float | None:
    vals = [
        getattr(report.policies[p], metric) for p in ("crux", "sincronia") if p in report.policies
    ]
    return max(vals) if vals else None


def summary(reports: Sequence[ScenarioReport]) -> dict[str, Any]:
    """Geometric means per policy and the targets' ratios (leveller vs the reference)."""
    policies = list(reports[0].policies) if reports else []
    means: dict[str, dict[str, float]] = {}
    for p in policies:
        means[p] = {
            metric: geomean(getattr(r.policies[p], metric) for r in reports)
            for metric in ("min_progress", "jain", "efficiency")
        }
    means["bound"] = {"min_progress": geomean(r.bound.min_progress for r in reports)}
    targets: list[dict[str, Any]] = []
    if "leveller" in policies:
        for label, metric, against, factor in TARGETS:
            refs: list[float] = []
            for r in reports:
                if against == "baseline":
                    ref = _best_baseline(r, metric)
                elif against == "bound":
                    ref = r.bound.min_progress
                else:
                    ref = getattr(r.policies[against], metric) if against in r.policies else None
                if ref is None:
                    break
                refs.append(ref)
            else:
                ours = geomean(getattr(r.policies["leveller"], metric) for r in reports)
                ratio = ours / geomean(refs)
                targets.append(
                    {"target": label, "ratio": ratio, "factor": factor, "met": ratio >= factor}
                )
        if "fair" in policies:
            worse = [
                r.scenario
                for r in reports
                if r.policies["leveller"].min_progress < r.policies["fair"].min_progress
            ]
            targets.append(
                {
                    "target": "min_progress >= fair on every scenario",
                    "scenarios_below": worse,
                    "met": not worse,
                }
            )
    return {"geomean": means, "targets": targets}


def print_suite(reports: Sequence[ScenarioReport], out: TextIO) -> None:
    policies = list(reports[0].policies) if reports else []
    out.write("min_progress (jain) per scenario; efficiency = sum of progress rates\n")
    head = f"{'scenario':<18}" + "".join(f"{p[:16]:>17}" for p in policies) + f"{'bound':>8}\n"
    out.write(head)
    for r in reports:
        cells = "".join(
            f"{r.policies[p].min_progress:>9.3f} ({r.policies[p].jain:.2f})" for p in policies
        )
        out.write(f"{r.scenario:<18}{cells}{r.bound.min_progress:>8.3f}\n")
    s = summary(reports)
    out.write("\ngeometric means\n")
    out.write(f"{'policy':<18}{'min':>8}{'jain':>8}{'effic':>8}\n")
    for p, m in s["geomean"].items():
        out.write(
            f"{p:<18}{m['min_progress']:>8.3f}"
            + (f"{m['jain']:>8.3f}{m['efficiency']:>8.2f}" if "jain" in m else "")
            + "\n"
        )
    if s["targets"]:
        out.write("\ntargets (leveller)\n")
        for t in s["targets"]:
            mark = "met " if t["met"] else "MISS"
            if "ratio" in t:
                out.write(f"  [{mark}] {t['target']}: {t['ratio']:.2f}x\n")
            else:
                below = ", ".join(t["scenarios_below"]) or "none below"
                out.write(f"  [{mark}] {t['target']}: {below}\n")


def _cmd_run(args: argparse.Namespace) -> int:
    report = run_scenario(resolve(args.scenario), _policies(args.policies))
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print_report(report, sys.stdout)
    return 0


def _cmd_suite(args: argparse.Namespace) -> int:
    only = [n.strip() for n in args.only.split(",")] if args.only else None
    scenarios = [builtin(n) for n in only] if only else all_builtin()
    policies = _policies(args.policies)
    reports = []
    for sc in scenarios:
        reports.append(run_scenario(sc, policies))
        if not args.json:
            sys.stderr.write(f"  {sc.name} done\n")
    if args.json:
        doc = {"scenarios": {r.scenario: r.to_dict() for r in reports}, "summary": summary(reports)}
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print_suite(reports, sys.stdout)
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from tools.netsim.plot import MissingMatplotlib, plot_progress

    scenario = resolve(args.scenario)
    report = run_scenario(scenario, _policies(args.policies))
    try:
        plot_progress(scenario, report, Path(args.out), window_s=args.window)
    except MissingMatplotlib as err:
        sys.stderr.write(f"netsim: {err}\n")
        return EXIT_MISSING
    sys.stdout.write(f"wrote {args.out}\n")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from tools.netsim.engine import Simulation
    from tools.netsim.policies import make_policy

    scenario = resolve(args.scenario)
    total = 0.0
    for name in _policies(args.policies):
        t0 = time.perf_counter()
        result = Simulation(scenario, make_policy(name)).run()
        dt = time.perf_counter() - t0
        total += dt
        sys.stdout.write(f"{name:<18}{dt:>7.2f} s  {result.events:>8d} events\n")
    sys.stdout.write(
        f"{'all':<18}{total:>7.2f} s  ({len(scenario.jobs)} jobs, {scenario.duration_s:g} s simulated)\n"
    )
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    for name, make in BUILTIN.items():
        sc = make()
        sys.stdout.write(
            f"{name:<18}{len(sc.jobs):>3} jobs {len(sc.links)} links  {sc.description}\n"
        )
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    for sc in all_builtin():
        (out / f"{sc.name}.json").write_text(json.dumps(sc.to_dict(), indent=1) + "\n")
    sys.stdout.write(f"wrote {len(BUILTIN)} scenarios to {out}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.netsim", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    policies_help = f"comma-separated, from {', '.join(POLICY_NAMES + EXTRA_POLICY_NAMES)}"

    p = sub.add_parser("run", help="simulate one scenario under each policy")
    p.add_argument("scenario", help="scenario JSON file or built-in name")
    p.add_argument("--policies", help=policies_help)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("suite", help="run the built-in scenarios")
    p.add_argument("--json", action="store_true")
    p.add_argument("--only", help="comma-separated built-in names")
    p.add_argument("--policies", help=policies_help)
    p.set_defaults(func=_cmd_suite)

    p = sub.add_parser("plot", help="PNG of progress rates over time (needs matplotlib)")
    p.add_argument("scenario")
    p.add_argument("--out", required=True)
    p.add_argument("--policies", help=policies_help)
    p.add_argument("--window", type=float, default=20.0, help="trailing window in seconds")
    p.set_defaults(func=_cmd_plot)

    p = sub.add_parser("bench", help="time the simulator itself")
    p.add_argument("scenario", nargs="?", default="cluster-32")
    p.add_argument("--policies", help=policies_help)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("list", help="list the built-in scenarios")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("export", help="write the built-in scenarios as JSON files")
    p.add_argument("dir")
    p.set_defaults(func=_cmd_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc: int = args.func(args)
    except (ScenarioError, KeyError) as err:
        sys.stderr.write(f"netsim: {err}\n")
        return EXIT_USAGE
    return rc
