"""``python -m tools.colosim``: co-location simulator.

::

    python -m tools.colosim run SCENARIO.json|BUILTIN [--seeds 3] [--policies A,B] [--json]
    python -m tools.colosim suite [--json] [--seeds 3] [--only NAME,...] [--jobs N]
    python -m tools.colosim plot SCENARIO.json|BUILTIN --out FILE.png [--seed 0]
    python -m tools.colosim diagnose SCENARIO.json|BUILTIN [--seed 0] [--json]
    python -m tools.colosim ceiling [--mix production] [--max-jobs 4] [--floor 0.5] [--json]
    python -m tools.colosim list
    python -m tools.colosim calibrate

Exit codes: 0 ok, 1 a target missed (suite), 2 bad arguments or scenario, 3 matplotlib
missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TextIO

from tools.colosim.policies import POLICY_NAMES
from tools.colosim.report import run_scenario
from tools.colosim.scenario import Scenario, ScenarioError, load
from tools.colosim.suite import BUILTIN, check_targets
from tools.colosim.truth import GAVEL_V100_BELOW_ONE, GAVEL_V100_MEDIAN, calibration

EXIT_MISSED = 1
EXIT_USAGE = 2
EXIT_MISSING = 3


def resolve(name_or_path: str) -> Scenario:
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    path = Path(name_or_path)
    if not path.exists():
        raise ScenarioError(
            f"no such file or built-in scenario (built-ins: {', '.join(BUILTIN)})",
            where=name_or_path,
        )
    return load(path)


def _emit(report: Any, as_json: bool, printer: Callable[[Any, TextIO], None]) -> None:
    if as_json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        printer(report, sys.stdout)


def print_ceiling(c: dict[str, Any], out: TextIO) -> None:
    print(f"mix {c['mix']}: one job alone, utilization {c['alone_util']:.3f}", file=out)
    for k, r in c["random"].items():
        print(
            f"{k} random jobs per GPU: utilization {r['util']:.3f} "
            f"({r['util_x_alone']:.2f} x alone), throughput {r['throughput']:.2f}",
            file=out,
        )
    o = c["oracle"]
    print(
        f"oracle, up to {o['max_jobs']} jobs, none under {o['floor']:g} of its speed, "
        f"classes consumed as they arrive: utilization {o['util']:.3f} "
        f"({o['util_x_alone']:.2f} x alone), throughput {o['throughput']:.2f} "
        f"(least-served class at {o['worst_class_vs_mix']:.2f} of its share)",
        file=out,
    )


def print_run(run: dict[str, Any], out: TextIO) -> None:
    out.write(f"scenario {run['scenario']} ({run['regime']}, load {run['load']})\n")
    out.write(
        f"{'policy':<14}{'util':>7}{'thrpt':>7}{'avgJCT':>9}{'p95JCT':>9}{'maxSD':>7}"
        f"{'SLO':>8}{'worst':>8}{'OOM':>5}\n"
    )
    for name, m in run["policies"].items():
        out.write(
            f"{name:<14}{m['gpu_util']:>7.3f}{m['train_throughput']:>7.2f}"
            f"{m['avg_jct_s']:>9.0f}{m['p95_jct_s']:>9.0f}{m['max_slowdown']:>7.2f}"
            f"{m['slo_attainment']:>8.4f}{m['worst_service_slo']:>8.4f}{m['oom_events']:>5d}\n"
        )
    for name, r in run.get("vs_exclusive", {}).items():
        out.write(
            f"{name} against exclusive, trace by trace (median): util {r['gpu_util']:.2f} x, "
            f"throughput {r['train_throughput']:.2f} x, avg JCT {r['avg_jct_s']:.2f} x better\n"
        )


def _run_one(args: tuple[str, int]) -> dict[str, Any]:
    name, seeds = args
    return run_scenario(BUILTIN[name], seeds)


def cmd_suite(names: Sequence[str], seeds: int, jobs: int, as_json: bool, out: TextIO) -> int:
    work = [(n, seeds) for n in names]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as ex:
            runs = list(ex.map(_run_one, work))
    else:
        runs = [_run_one(w) for w in work]
    missed = 0
    checks = {r["scenario"]: check_targets(r) for r in runs}
    missed = sum(not ok for c in checks.values() for _, ok, _ in c)
    if as_json:
        json.dump({"scenarios": {r["scenario"]: r for r in runs}}, out, indent=2)
        out.write("\n")
        return 0
    for r in runs:
        print_run(r, out)
        for label, ok, detail in checks[r["scenario"]]:
            out.write(f"  [{'ok' if ok else 'MISSED'}] {label}: {detail}\n")
        out.write("\n")
    out.write(f"{missed} target(s) missed\n")
    return EXIT_MISSED if missed else 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.colosim", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="run one scenario under every policy")
    p_run.add_argument("scenario")
    p_run.add_argument("--seeds", type=int, default=3)
    p_run.add_argument("--json", action="store_true")
    p_run.add_argument(
        "--policies",
        default=",".join(POLICY_NAMES),
        help="comma-separated, from " + ", ".join(POLICY_NAMES),
    )
    p_suite = sub.add_parser("suite", help="run the built-in scenarios and check the targets")
    p_suite.add_argument("--seeds", type=int, default=3)
    p_suite.add_argument("--json", action="store_true")
    p_suite.add_argument("--only", default="")
    p_suite.add_argument("--jobs", type=int, default=1, help="scenarios in parallel processes")
    p_plot = sub.add_parser("plot", help="utilization, JCT and p99 vs SLO over time")
    p_plot.add_argument("scenario")
    p_plot.add_argument("--out", required=True)
    p_plot.add_argument("--seed", type=int, default=0)
    p_diag = sub.add_parser("diagnose", help="what limits colocate's packing, one seed")
    p_diag.add_argument("scenario")
    p_diag.add_argument("--seed", type=int, default=0)
    p_diag.add_argument("--json", action="store_true")
    p_ceil = sub.add_parser("ceiling", help="an oracle's packing under the hidden model")
    p_ceil.add_argument("--mix", default="production")
    p_ceil.add_argument("--max-jobs", type=int, default=4)
    p_ceil.add_argument("--floor", type=float, default=0.5)
    p_ceil.add_argument("--json", action="store_true")
    sub.add_parser("list", help="the built-in scenarios")
    sub.add_parser("calibrate", help="the interference model against Gavel's measurements")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "run":
            if args.seeds < 1:
                raise ScenarioError("must be at least 1", where="--seeds")
            policies = [p.strip() for p in args.policies.split(",") if p.strip()]
            for p in policies:
                if p not in POLICY_NAMES:
                    raise ScenarioError(
                        f"unknown policy {p!r} (known: {', '.join(POLICY_NAMES)})",
                        where="--policies",
                    )
            if not policies:
                raise ScenarioError("names no policy", where="--policies")
            _emit(run_scenario(resolve(args.scenario), args.seeds, policies), args.json, print_run)
            return 0
        if args.cmd == "suite":
            names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BUILTIN)
            for n in names:
                if n not in BUILTIN:
                    raise ScenarioError(f"unknown built-in scenario {n!r}", where="--only")
            if args.seeds < 1:
                raise ScenarioError("must be at least 1", where="--seeds")
            return cmd_suite(names, args.seeds, max(1, args.jobs), args.json, sys.stdout)
        if args.cmd == "plot":
            from tools.colosim.plot import MissingMatplotlib, plot_scenario

            try:
                plot_scenario(resolve(args.scenario), Path(args.out), args.seed)
            except MissingMatplotlib as err:
                print(f"colosim: {err}", file=sys.stderr)
                return EXIT_MISSING
            print(args.out)
            return 0
        if args.cmd == "diagnose":
            from tools.colosim.diagnose import diagnose, print_diagnosis

            _emit(diagnose(resolve(args.scenario), args.seed), args.json, print_diagnosis)
            return 0
        if args.cmd == "ceiling":
            from tools.colosim.ceiling import ceiling
            from tools.colosim.workloads import MIXES

            if args.mix not in MIXES:
                raise ScenarioError(f"unknown mix (known: {', '.join(MIXES)})", where="--mix")
            if not 1 <= args.max_jobs <= 5:
                raise ScenarioError("must be in [1, 5]", where="--max-jobs")
            if not 0.0 <= args.floor < 1.0:
                raise ScenarioError("must be in [0, 1)", where="--floor")
            _emit(ceiling(args.mix, args.max_jobs, args.floor), args.json, print_ceiling)
            return 0
        if args.cmd == "list":
            for name, s in BUILTIN.items():
                print(f"{name:<22}{s.regime:<9}load {s.load:<5} {s.description}")
            return 0
        med, below = calibration()
        print(
            f"model:  median combined normalized throughput {med:.3f}, {below:.1%} of pairs below 1.0\n"
            f"Gavel V100 (MPS, pairs): median {GAVEL_V100_MEDIAN:.3f}, {GAVEL_V100_BELOW_ONE:.1%} below 1.0"
        )
        return 0
    except ScenarioError as err:
        print(f"colosim: {err}", file=sys.stderr)
        return EXIT_USAGE
