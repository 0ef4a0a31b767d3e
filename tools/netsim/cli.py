"""``python -m tools.netsim``: run scenarios, the built-in suite, plots and the benchmark.

::

    python -m tools.netsim run SCENARIO.json|BUILTIN [--policies fair,sincronia,crux,leveller] [--json]
    python -m tools.netsim suite [--json] [--only NAME,...]
    python -m tools.netsim plot SCENARIO --out docs/img/netsim-NAME.png
    python -m tools.netsim bench [SCENARIO]
    python -m tools.netsim testbed [--results TESTBED.json] [--json]
    python -m tools.netsim list
    python -m tools.netsim export DIR

Exit codes: 0 ok, 2 bad arguments or scenario, 3 a needed optional package is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from tools.netsim.compare import best_reading, columns, summary, value, winners
from tools.netsim.metrics import ScenarioReport, run_scenario, run_scenarios
from tools.netsim.policies import BASELINES, POLICY_NAMES, READING_NAMES
from tools.netsim.scenario import Scenario, ScenarioError, load
from tools.netsim.suite import BUILTIN, all_builtin, builtin

EXIT_USAGE = 2
EXIT_MISSING = 3


def resolve(name_or_path: str) -> Scenario:
    """A scenario file, or the name of a built-in one."""
    if name_or_path in BUILTIN:
        return builtin(name_or_path)
    if name_or_path.startswith("testbed-"):
        from tools.netsim.testbed import scenarios

        for sc in scenarios():
            if sc.name == name_or_path:
                return sc
    path = Path(name_or_path)
    if not path.exists():
        raise ScenarioError(
            f"no such file or built-in scenario (built-ins: {', '.join(BUILTIN)})",
            where=name_or_path,
        )
    return load(path)


KNOWN_POLICIES = ("fair", "leveller", *BASELINES, *READING_NAMES)
# One reading per baseline: what one policy costs to simulate.
BENCH_POLICIES = ("fair", "sincronia-even", "crux-even", "cassini", "leveller")


def _policies(arg: str | None) -> list[str]:
    if not arg:
        return list(POLICY_NAMES)
    names = [p.strip() for p in arg.split(",") if p.strip()]
    for n in names:
        if n not in KNOWN_POLICIES:
            raise ScenarioError(
                f"unknown policy {n!r}; choose from {', '.join(KNOWN_POLICIES)}",
                where="--policies",
            )
    return names


def _workers(arg: int | None) -> int:
    if arg is not None:
        if arg < 1:
            raise ScenarioError("must be >= 1", where="--workers")
        return arg
    return max(1, min(2, os.cpu_count() or 1))


def panels(report: ScenarioReport) -> list[str]:
    """The runs worth showing: fair, each baseline's best reading, leveller."""
    out: list[str] = []
    for col in columns([report]):
        if col in BASELINES:
            found = best_reading(report, col, "min_progress")
            if found:
                out.append(found[0])
        elif col != "best":
            out.append(col)
    return out


def print_report(report: ScenarioReport, out: TextIO) -> None:
    out.write(f"scenario {report.scenario}\n")
    out.write(f"{'policy':<22}{'min':>8}{'mean':>8}{'jain':>8}{'effic':>8}{'changes':>9}\n")
    for name, m in report.policies.items():
        out.write(
            f"{name:<22}{m.min_progress:>8.3f}{m.mean_progress:>8.3f}{m.jain:>8.3f}"
            f"{m.efficiency:>8.2f}{m.level_changes:>9d}\n"
        )
    out.write(f"{'bound':<22}{report.bound.min_progress:>8.3f}\n")
    jobs = sorted(report.bound.jobs)
    shown = panels(report)
    out.write("\nper-job progress rate (each baseline's best reading)\n")
    out.write(f"{'job':<16}" + "".join(f"{n:>22}" for n in shown) + f"{'bound':>9}\n")
    for j in jobs:
        row = "".join(f"{report.policies[n].jobs.get(j, float('nan')):>22.3f}" for n in shown)
        out.write(f"{j:<16}{row}{report.bound.jobs[j]:>9.3f}\n")


def _fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_suite(reports: Sequence[ScenarioReport], out: TextIO) -> None:
    cols = columns(reports)
    out.write(
        "min_progress per scenario; a baseline's column is its best reading there "
        "(which one: below)\n"
    )
    head = f"{'scenario':<20}{'n/K':>6}" + "".join(f"{c:>11}" for c in cols)
    out.write(head + f"{'bound':>9}{'upper':>9}\n")
    for r in reports:
        cells = "".join(f"{_fmt(value(r, c, 'min_progress')):>11}" for c in cols)
        out.write(
            f"{r.scenario:<20}{r.jobs:>3}/{r.levels:<2}{cells}"
            f"{r.bound.min_progress:>9.3f}{r.bound.upper:>9.3f}\n"
        )
    fams = [c for c in cols if c in BASELINES]
    if fams:
        out.write("\nbest reading per scenario (min_progress)\n")
        for r in reports:
            picks = []
            for f in fams:
                found = best_reading(r, f, "min_progress")
                if found:
                    picks.append(found[0])
            out.write(f"  {r.scenario:<20}{'  '.join(picks)}\n")
        out.write(
            "  best overall: " + ", ".join(f"{k} {v}" for k, v in winners(reports).items()) + "\n"
        )
        zeros = {
            name: sum(1 for r in reports if r.policies[name].min_progress <= 0)
            for name in reports[0].policies
        }
        starved = ", ".join(f"{k} {v}" for k, v in zeros.items() if v) or "none"
        out.write(f"  scenarios where a reading leaves a job at 0 progress: {starved}\n")
    s = summary(reports)
    for gname, g in s["groups"].items():
        out.write(f"\n[{gname}] {len(g['scenarios'])} scenarios: geometric means")
        out.write(" (zeros: scenarios at 0, excluded from 'pos')\n")
        out.write(f"{'':<11}" + "".join(f"{c:>11}" for c in [*cols, "bound"]) + "\n")
        for metric in ("min_progress", "jain", "efficiency"):
            row = ""
            for c in [*cols, "bound"]:
                m = g["geomean"].get(c, {}).get(metric)
                row += f"{_fmt(m['geomean'] if m else None):>11}"
            out.write(f"{metric[:10]:<11}{row}\n")
            zero_notes = [
                f"{c} {g['geomean'][c][metric]['zeros']} (pos {g['geomean'][c][metric]['positive']:.3f})"
                for c in cols
                if metric in g["geomean"].get(c, {}) and g["geomean"][c][metric]["zeros"]
            ]
            if zero_notes:
                out.write(f"{'':<11}zeros: {', '.join(zero_notes)}\n")
        ratios = g["leveller_min_progress_over"]
        if ratios:
            parts = []
            for c, res in ratios.items():
                text = f"{c} {_fmt(res['ratio'], 2)}x"
                if res["reference_zero"]:
                    text += f" (+{len(res['reference_zero'])} where {c} is 0)"
                if res["leveller_zero"]:
                    text += f" ({len(res['leveller_zero'])} where leveller is 0)"
                parts.append(text)
            out.write(f"leveller min_progress over: {', '.join(parts)}\n")
        if g["bound_over_best"]:
            out.write(
                f"bound over best reading: {g['bound_over_best']:.2f}x (piecewise with churn:"
                f" not a bound there); upper bound {g['upper_geomean']:.3f}, over best"
                f" reading {g['upper_over_best']:.2f}x (no policy's ratio can exceed it)\n"
            )
    if s["targets"]:
        out.write("\ntargets (leveller, all scenarios)\n")
        for t in s["targets"]:
            mark = "met " if t["met"] else "MISS"
            if "ratio" in t:
                out.write(
                    f"  [{mark}] {t['target']}: {_fmt(t['ratio'], 2)}x"
                    f" (worst scenario {_fmt(t['worst'], 2)}x)\n"
                )
            else:
                below = ", ".join(t["scenarios_below"]) or "none below"
                out.write(f"  [{mark}] {t['target']}: {below}\n")


def _cmd_run(args: argparse.Namespace) -> int:
    report = run_scenario(
        resolve(args.scenario), _policies(args.policies), workers=_workers(args.workers)
    )
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print_report(report, sys.stdout)
    return 0


def _cmd_suite(args: argparse.Namespace) -> int:
    only = [n.strip() for n in args.only.split(",")] if args.only else None
    scenarios = [builtin(n) for n in only] if only else all_builtin()
    t0 = time.perf_counter()
    reports = run_scenarios(scenarios, _policies(args.policies), workers=_workers(args.workers))
    if not args.json:
        sys.stderr.write(f"  {len(reports)} scenarios in {time.perf_counter() - t0:.1f} s\n")
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
    report = run_scenario(scenario, _policies(args.policies), workers=_workers(args.workers))
    try:
        plot_progress(scenario, report, Path(args.out), window_s=args.window, panels=panels(report))
    except MissingMatplotlib as err:
        sys.stderr.write(f"netsim: {err}\n")
        return EXIT_MISSING
    sys.stdout.write(f"wrote {args.out}\n")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from tools.netsim.engine import Simulation
    from tools.netsim.policies import expand, make_policy

    scenario = resolve(args.scenario)
    total = 0.0
    names = expand(_policies(args.policies)) if args.policies else list(BENCH_POLICIES)
    for name in names:
        t0 = time.perf_counter()
        result = Simulation(scenario, make_policy(name)).run()
        dt = time.perf_counter() - t0
        total += dt
        sys.stdout.write(f"{name:<18}{dt:>7.2f} s  {result.events:>8d} events\n")
    sys.stdout.write(
        f"{'all':<18}{total:>7.2f} s  ({len(scenario.jobs)} jobs, {scenario.duration_s:g} s simulated)\n"
    )
    return 0


def _cmd_testbed(args: argparse.Namespace) -> int:
    from tools.netsim.testbed import compare

    results = None
    if args.results:
        try:
            results = json.loads(Path(args.results).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ScenarioError(f"not a testbed result file: {err}", where=args.results) from err
        if not isinstance(results, dict) or "setup" not in results:
            raise ScenarioError("no 'setup' (write it with testbed run --json)", where=args.results)
    rows = compare(results, workers=_workers(args.workers))
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    out = sys.stdout
    out.write(
        "per mix: ceiling (kernel: G / sum of demands; fluid: the bound), then min_progress /"
        " jain / efficiency\nunder the kernel's default qdisc (fluid: per-flow fair) and"
        " under gpud (fluid: leveller)\n"
    )
    out.write(f"{'mix':<10}{'(runs)':<22}{'ceiling':>8}{'baseline':>22}{'gpud':>22}\n")
    for mix, row in rows.items():
        lines = []
        if "kernel" in row:
            lines.append((f"kernel ({row['kernel']['runs']})", row["kernel"]))
        for cc, figures in row.get("kernel_by_cc", {}).items():
            lines.append((f"  {cc} ({figures['runs']})", figures))
        lines.append(("fluid", row["fluid"]))
        for i, (label, r) in enumerate(lines):
            cells = ""
            for part in ("baseline", "gpud"):
                f = r[part]
                cells += "   " + " ".join(
                    _fmt(f.get(k)) for k in ("min_progress", "jain", "efficiency")
                )
            out.write(f"{mix if i == 0 else '':<10}{label:<22}{_fmt(r['ceiling']):>8}{cells}\n")
    if results is None:
        out.write(
            "\n(kernel figures: sudo .venv/bin/python -m tools.testbed run --json > tb.json,"
            " then --results tb.json)\n"
        )
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from tools.netsim.testbed import scenarios

    for sc in [*(make() for make in BUILTIN.values()), *scenarios()]:
        sys.stdout.write(
            f"{sc.name:<18}{len(sc.jobs):>3} jobs {len(sc.links)} links  {sc.description}\n"
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
    policies_help = (
        f"comma-separated, from {', '.join(KNOWN_POLICIES)} "
        "(a baseline's family name means all its readings)"
    )
    workers_help = "processes to run simulations in (default: 2, or 1 on one CPU)"

    p = sub.add_parser("run", help="simulate one scenario under each policy")
    p.add_argument("scenario", help="scenario JSON file or built-in name")
    p.add_argument("--policies", help=policies_help)
    p.add_argument("--json", action="store_true")
    p.add_argument("--workers", type=int, help=workers_help)
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("suite", help="run the built-in scenarios")
    p.add_argument("--json", action="store_true")
    p.add_argument("--only", help="comma-separated built-in names")
    p.add_argument("--policies", help=policies_help)
    p.add_argument("--workers", type=int, help=workers_help)
    p.set_defaults(func=_cmd_suite)

    p = sub.add_parser("plot", help="PNG of progress rates over time (needs matplotlib)")
    p.add_argument("scenario")
    p.add_argument("--out", required=True)
    p.add_argument("--policies", help=policies_help)
    p.add_argument("--window", type=float, default=20.0, help="trailing window in seconds")
    p.add_argument("--workers", type=int, help=workers_help)
    p.set_defaults(func=_cmd_plot)

    p = sub.add_parser("bench", help="time the simulator itself")
    p.add_argument("scenario", nargs="?", default="cluster-32")
    p.add_argument("--policies", help=policies_help + f"; default {','.join(BENCH_POLICIES)}")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "testbed", help="the testbed's mixes in the fluid model, beside the kernel's"
    )
    p.add_argument("--results", help="a `python -m tools.testbed run --json` result file")
    p.add_argument("--json", action="store_true")
    p.add_argument("--workers", type=int, help=workers_help)
    p.set_defaults(func=_cmd_testbed)

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
