"""``gpuctl run`` and ``gpuctl env``: launch a job with the environment gpud gives it.

::

    gpuctl run --job infer-a --kind inference --mig 3g.40gb --threads 40 --memory 20GiB -- python serve.py
    gpuctl env --job infer-a            # export lines, for a Slurm prolog or a container hook
    gpuctl env --job infer-a --json

``run`` asks the co-location loop where a job that names no place should go (a GPU, its
MPS thread share), registers the job if it is new, reserves its place (the reservation names this
gpuctl process, so gpud releases it even if gpuctl is killed), starts the command with
``CUDA_VISIBLE_DEVICES``, the MPS variables, ``GPUD_JOB`` and ``GPUD_SOCKET`` added to the
current environment, forwards SIGINT/SIGTERM/SIGHUP to it, releases the reservation when it
ends and exits with its exit status (128 + N when killed by signal N; 127 when the command
cannot be started).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from types import FrameType

from gpud.cli.context import EXIT_USAGE, CliError, Context, Subparsers
from gpud.cli.jobs import KINDS, add_placement_options, fill_placement
from gpud.jobs.env import shell_exports
from gpud.v1 import colo_pb2, colo_pb2_grpc
from gpud.v1 import jobs_pb2 as pb
from gpud.v1 import jobs_pb2_grpc as pb_grpc

EXIT_CANNOT_EXEC = 127
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def register(subparsers: Subparsers) -> None:
    run = subparsers.add_parser(
        "run", help="run a command as a job, with its GPUs and MPS limits reserved"
    )
    run.add_argument("--job", required=True, metavar="NAME")
    add_placement_options(run)
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS...")
    run.set_defaults(run=run_run)
    env = subparsers.add_parser("env", help="print the environment of a job (export lines)")
    env.add_argument("--job", required=True, metavar="NAME")
    env.set_defaults(run=run_env)


def run_env(ctx: Context, args: argparse.Namespace) -> int:
    resp: pb.GetJobEnvResponse = ctx.call(
        ctx.stub(pb_grpc.JobsStub).GetJobEnv, pb.GetJobEnvRequest(job=args.job)
    )
    if ctx.out.json:
        ctx.out.print_json(dict(resp.env))
    else:
        ctx.out.stream.write(shell_exports(dict(resp.env)))
    return 0


def reserve_request(args: argparse.Namespace) -> pb.ReserveRequest:
    request = pb.ReserveRequest(
        job=args.job,
        kind=KINDS.get(args.kind or "", pb.JOB_KIND_UNSPECIFIED),
        owner=args.owner,
        holder_pid=os.getpid(),
    )
    fill_placement(request, args)
    return request


def advise(ctx: Context, args: argparse.Namespace, request: pb.ReserveRequest) -> None:
    """Where the co-location loop would put a job that names no place: its GPU and MPS
    thread share go into the request. Without advice (loop off, no room now), the jobs
    service places the job as it always does."""
    if args.mig or args.gpus is not None or args.devices:
        return
    ask = colo_pb2.AdviseRequest(job=args.job, kind=args.kind or "training")
    if request.HasField("memory_limit_bytes"):
        ask.memory_bytes = request.memory_limit_bytes
    try:
        resp: colo_pb2.AdviseResponse = ctx.call(ctx.stub(colo_pb2_grpc.ColocationStub).Advise, ask)
    except CliError as err:
        print(f"gpuctl: no co-location advice ({err}); default placement", file=sys.stderr)
        return
    if resp.gpu < 0 or not resp.device:
        print(f"gpuctl: co-location says wait ({resp.reason}); default placement", file=sys.stderr)
        return
    request.devices.append(resp.device)
    if not request.HasField("threads_percent") and resp.threads_percent < 100:
        request.threads_percent = resp.threads_percent
    print(f"gpuctl: {args.job} on GPU {resp.gpu}: {resp.reason}", file=sys.stderr)


def run_run(ctx: Context, args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise CliError(
            "run: give the command after --, e.g. gpuctl run --job a -- ./train", EXIT_USAGE
        )
    stub = ctx.stub(pb_grpc.JobsStub)
    request = reserve_request(args)
    advise(ctx, args, request)
    resp: pb.ReserveResponse = ctx.call(stub.Reserve, request)
    reservation = resp.reservation.id
    env = {**os.environ, **resp.env}
    try:
        return _launch(command, env)
    finally:
        try:
            ctx.call(stub.Release, pb.ReleaseRequest(reservation_id=reservation))
        except CliError as err:
            # gpud releases it by itself once this process is gone.
            print(f"gpuctl: could not release reservation {reservation}: {err}", file=sys.stderr)


def _launch(command: list[str], env: dict[str, str]) -> int:
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as err:
        print(f"gpuctl: cannot run {command[0]}: {err.strerror}", file=sys.stderr)
        return EXIT_CANNOT_EXEC

    def forward(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    # Signal handlers can only be set from the main thread (gpuctl's own); elsewhere
    # (embedded use) the child shares the terminal's process group anyway.
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED} if main else {}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code
