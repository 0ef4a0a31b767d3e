"""``python -m tools.admission bench [--json] [--detail] [--jobs N] [--seed S]
[--replications R] [--utilizations U,U...] [--workers W] [--fifo-replications F] [--mix pools|shared]``;
``python -m tools.admission reference [--json] [--jobs N] [--seed S] [--replications R]
[--utilizations U,U...] [--warmup F]``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from gpud.cli.pipes import quiet_on_broken_pipe
from tools.admission import bench, reference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.admission")
    commands = parser.add_subparsers(dest="command", required=True)
    b = commands.add_parser("bench", help="validate the admission queue by simulation")
    b.add_argument("--json", action="store_true", help="print JSON (the default is a table)")
    b.add_argument("--detail", action="store_true", help="add per-class quotes and waits")
    b.add_argument("--jobs", type=int, default=30000, help="jobs per utilisation")
    b.add_argument("--seed", type=int, default=1, help="seed of the first replication")
    b.add_argument(
        "--replications",
        type=_positive,
        default=10,
        help="independent arrival sequences per utilisation (the confidence interval's samples)",
    )
    b.add_argument(
        "--workers",
        type=_positive,
        default=os.cpu_count() or 1,
        help="processes running replications (default: one per CPU)",
    )
    b.add_argument(
        "--fifo-replications",
        type=int,
        default=3,
        help="replications also run in strict FIFO for backfill/fifo (default 3)",
    )
    b.add_argument(
        "--utilizations",
        type=_utilizations,
        default=bench.UTILIZATIONS,
        help="comma-separated utilisations, each in (0, 1) (default 0.5,0.7,0.8,0.9,0.95)",
    )
    b.add_argument(
        "--mix",
        choices=("pools", "shared"),
        default="pools",
        help="request sizes in separate pools (default) or sharing whole GPUs",
    )
    r = commands.add_parser(
        "reference", help="the quote's M/G/k formula against long simulations of each pool alone"
    )
    r.add_argument("--json", action="store_true", help="print JSON (the default is a table)")
    r.add_argument("--jobs", type=_positive, default=300_000, help="jobs per sequence")
    r.add_argument("--seed", type=int, default=1, help="seed of the first sequence")
    r.add_argument("--replications", type=_positive, default=10, help="sequences per load")
    r.add_argument(
        "--warmup",
        type=_fraction,
        default=reference.WARMUP_FRACTION,
        help="fraction of each sequence's jobs not observed (default 0.2)",
    )
    r.add_argument(
        "--utilizations",
        type=_utilizations,
        default=bench.UTILIZATIONS,
        help="comma-separated utilisations, each in (0, 1) (default 0.5,0.7,0.8,0.9,0.95)",
    )
    args = parser.parse_args(argv)
    if args.command == "reference":
        return _reference(args)
    result = bench.run(
        jobs=args.jobs,
        seed=args.seed,
        detail=args.detail,
        mix=args.mix,
        replications=args.replications,
        workers=args.workers,
        fifo_replications=max(1, min(args.fifo_replications, args.replications)),
        utilizations=args.utilizations,
    )
    if args.json:
        json.dump(_finite(result), sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
        return 0
    print(f"{'rho':>5} {'littles_residual':>17} {'quote/observed':>15} {'backfill/fifo':>14}")
    for rho, row in result["utilizations"].items():
        print(
            f"{rho:>5} {row['littles_residual']:>17.2e} {row['quote_over_observed']:>15.2f}"
            f" {row['backfill_over_fifo_wait']:>14.3f}"
        )
        for key, c in row.get("classes", {}).items():
            lo, hi = c["observed_ci95_s"]
            print(
                f"      {key:>10} quote {c['quote_s']:>9.0f} s  observed {c['observed_s']:>8.0f} s"
                f" (95 % CI {lo:.0f}-{hi:.0f}, +-{c['half_width_ratio']:.1%})"
                f"  quote/observed {c['quote_over_observed']:.2f}"
                f"  quote/upper {c['quote_over_observed_upper']:.2f}"
            )
    print(f"wait slope vs 1/(1-rho): {result['wait_slope']:.2f}; pass: {result['pass_ms']:.2f} ms")
    return 0


def _reference(args: argparse.Namespace) -> int:
    result = reference.run(
        args.jobs,
        seed=args.seed,
        replications=args.replications,
        utilizations=args.utilizations,
        warmup=args.warmup,
    )
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for key, c in result["classes"].items():
        print(f"{key} (k_eff {c['k_eff']}, service cs2 {c['scv']:g})")
        for rho, row in c["utilizations"].items():
            lo, hi = row["reference_ci95_s"]
            print(
                f"  {rho:>5} exact {row['reference_s']:>8.1f} s (95 % CI {lo:.1f}-{hi:.1f})"
                f"  formula {row['formula_s']:>8.1f} s  formula/exact"
                f" {row['formula_over_reference']:.3f}"
            )
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _utilizations(text: str) -> tuple[float, ...]:
    values = tuple(float(v) for v in text.split(","))
    if len(values) < 2 or not all(0.0 < v < 1.0 for v in values):
        raise argparse.ArgumentTypeError(
            f"needs two or more utilisations in (0, 1) (the wait slope's fit), got {text!r}"
        )
    return values


def _finite(value: Any) -> Any:
    """JSON has no infinity: an unbounded quote (and its ratio) prints as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    sys.exit(quiet_on_broken_pipe(main))
