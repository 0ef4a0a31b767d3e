"""``gpuctl colo show`` / ``gpuctl colo advise``: the co-location loop, explained.

::

    gpuctl colo show [--json]
    gpuctl colo advise JOB [--kind inference --slo-ms 50 --memory 20GiB --sm 0.4] [--json]
"""

from __future__ import annotations

import argparse
import os

from gpud.cli.context import (
    JOB_NAME,
    Context,
    Subparsers,
    number,
    size,
    slo_ms,
)
from gpud.cli.output import NA, seconds
from gpud.pidns import own_namespace
from gpud.shared import MAX_PEAK_LOAD, MIN_SLO_MS, format_size
from gpud.v1 import colo_pb2 as pb
from gpud.v1 import colo_pb2_grpc as pb_grpc

PLACEMENT_HEADERS = ("JOB", "KIND", "GPU", "SM SHARE", "DUTY", "PREDICTED", "OBSERVED", "WHY")
GUARD_HEADERS = (
    "SERVICE",
    "GPU",
    "SLO",
    # what the guard judges (since its duty last reached the training, the loop was
    # switched on or its GPUs answered again), then the whole window's, which ATTAINED counts
    "P99 JUDGED",
    "P99 WINDOW",
    "TRAINING DUTY",
    "ACTION",
    "ATTAINED",
    "WHY",
)


def register(subparsers: Subparsers) -> None:
    colo = subparsers.add_parser(
        "colo", help="co-location: placements, prices, SLO guards (default: show)"
    )
    colo.set_defaults(run=run_show)
    commands = colo.add_subparsers(dest="colo_command", metavar="COMMAND")
    show = commands.add_parser("show", help="placements, prices, slowdowns and guard states")
    show.set_defaults(run=run_show)
    advise = commands.add_parser("advise", help="where a new job would go now, and its limits")
    advise.add_argument("job", type=JOB_NAME)
    advise.add_argument("--kind", choices=("training", "inference"), default="training")
    advise.add_argument(
        "--memory", type=size, metavar="SIZE", help="device memory it needs, e.g. 20GiB"
    )
    advise.add_argument(
        "--slo-ms",
        "--slo-p99-ms",  # as `gpuctl jobs add` names it
        dest="slo_ms",
        type=slo_ms,
        metavar="MS",
        help=f"inference p99 SLO in milliseconds, {MIN_SLO_MS:g} up to an hour",
    )
    # the ranges Advise takes: refused here, naming the flag, before any question to gpud
    advise.add_argument(
        "--sm",
        type=number(0, 1, above=True),
        metavar="0..1",
        help="its SM activity alone, over 0 and at most 1",
    )
    advise.add_argument(
        "--peak-load",
        type=number(0, MAX_PEAK_LOAD),
        metavar="REQ/S",
        help=f"inference peak load, 0 up to {MAX_PEAK_LOAD:g} requests/s",
    )
    advise.set_defaults(run=run_advise)


def _pct(x: float) -> str:
    return f"{x:.0%}"


def run_show(ctx: Context, args: argparse.Namespace) -> int:
    resp: pb.ShowColoResponse = ctx.call(
        ctx.stub(pb_grpc.ColocationStub).ShowColo, pb.ShowColoRequest()
    )
    if ctx.out.json:
        ctx.out.print_json(resp)
        return 0
    if not resp.enabled:
        ctx.out.print("co-location is off ([colocate] enabled = false)")
    ctx.out.print_table(
        PLACEMENT_HEADERS,
        [
            (
                p.job,
                p.kind,
                str(p.gpu) if p.gpu >= 0 else "waiting",
                p.mig_profile if p.HasField("mig_profile") else _pct(p.sm_share),
                _pct(p.duty),
                f"{p.predicted_speed:.2f}" if p.HasField("predicted_speed") else NA,
                f"{p.observed_speed:.2f}" if p.HasField("observed_speed") else NA,
                p.reason,
            )
            for p in resp.placements
        ],
    )
    ctx.out.print()
    ctx.out.print_table(
        GUARD_HEADERS,
        [
            (
                g.job,
                str(g.gpu) if g.gpu >= 0 else "-",
                f"{g.slo_ms:g} ms",
                f"{g.p99_at_duty_ms:.1f} ms" if g.HasField("p99_at_duty_ms") else NA,
                f"{g.p99_ms:.1f} ms" if g.HasField("p99_ms") else NA,
                _pct(g.duty),
                g.action,
                f"{g.attainment:.3f}",
                g.reason,
            )
            for g in resp.guards
        ],
    )
    ctx.out.print()
    busy = [p for p in resp.prices if p.price > 1e-6]
    prices = ", ".join(f"GPU {p.gpu} {p.resource} {p.price:.2f}" for p in busy) or "all zero"
    ctx.out.print(
        f"prices: {prices} ({resp.price_iterations} iterations, residual "
        f"{resp.price_residual:.3f}{', converged' if resp.prices_converged else ''})"
    )
    ctx.out.print(
        f"interference predictor: {resp.predictor_samples} samples, mean abs error "
        f"{resp.predictor_mean_abs_error:.3f}; plan {resp.plan_age_seconds:.1f} s old"
    )
    if resp.predictor_margins:
        standings = sorted(resp.predictor_margins.items(), key=lambda kv: _standing(kv[0]))
        errors = resp.predictor_margin_errors
        margins = ", ".join(
            f"pairs seen {k} times {v:.3f}"
            + (f" (on {errors[k]} error{'' if errors[k] == 1 else 's'})" if k in errors else "")
            for k, v in standings
        )
        ctx.out.print(f"predictor p90 margins (log-speed): {margins}")
    if resp.refused:
        refused = ", ".join(
            f"{r.count} by {r.check} on GPUs with {r.residents} job{'' if r.residents == 1 else 's'}"
            for r in resp.refused
        )
        ctx.out.print(f"options refused when advising {resp.refused_job}: {refused}")
    if resp.unattributed_processes:
        strangers = ", ".join(
            f"GPU {gpu}: {n}" for gpu, n in sorted(resp.unattributed_processes.items())
        )
        ctx.out.print(f"processes of no job (their memory held, their GPU never free): {strangers}")
    for w in resp.waiting:
        user = f" (user {w.holder_user})" if w.HasField("holder_uid") else ""
        ctx.out.print(
            f"waiting for a GPU (gpuctl run): {w.job} for {seconds(w.waited_seconds)}{user}:"
            f" {w.reason}"
        )
    ctx.out.print(
        "speed: throughput shared over alone (1.00: no slowdown), observed for jobs that "
        "ran alone first: training per second of running time (duty taken out), inference "
        "as the M/M/1 service rate from its median latency and load"
    )
    return 0


def _standing(key: str) -> int:
    """ "0", "1+", "30+" -> 0, 1, 30: the fewest observations of a prediction's pairs."""
    head = key.rstrip("+")
    return int(head) if head.isdigit() else 0


def run_advise(ctx: Context, args: argparse.Namespace) -> int:
    # asked as a gpuctl run from here would ask: for this user (GPUs whose MPS server
    # serves another user are not advised)
    request = pb.AdviseRequest(
        job=args.job,
        kind=args.kind,
        holder_pid=os.getpid(),
        holder_pid_namespace=own_namespace(),
    )
    if args.memory is not None:
        request.memory_bytes = args.memory
    if args.slo_ms is not None:
        request.slo_p99_ms = args.slo_ms
    if args.sm is not None:
        request.sm_activity = args.sm
    if args.peak_load is not None:
        request.peak_load = args.peak_load
    resp: pb.AdviseResponse = ctx.call(ctx.stub(pb_grpc.ColocationStub).Advise, request)
    if ctx.out.json:
        ctx.out.print_json(resp)
        return 0
    if resp.gpu < 0:
        ctx.out.print(f"{args.job}: not placed now: {resp.reason}")
        return 0
    where = f"GPU {resp.gpu}" + (f" MIG {resp.mig_profile}" if resp.HasField("mig_profile") else "")
    limit = format_size(resp.memory_limit_bytes) if resp.memory_limit_bytes else "none"
    ctx.out.print(
        f"{args.job}: {where}, {resp.threads_percent}% threads, memory limit {limit}, "
        f"predicted speed {resp.predicted_speed:.2f} ({resp.reason})"
    )
    return 0
