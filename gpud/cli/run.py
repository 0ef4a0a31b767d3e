"""``gpuctl run`` and ``gpuctl env``: launch a job with the environment gpud gives it.

::

    gpuctl run --job infer-a --kind inference --mig 3g.40gb --threads 40 --memory 20GiB -- python serve.py
    gpuctl env --job infer-a            # export lines, for a Slurm prolog or a container hook
    gpuctl env --job infer-a --json

``run`` registers the job if it is new, reserves its place (the reservation names this
gpuctl process, so gpud releases it even if gpuctl is killed), starts the command with
``CUDA_VISIBLE_DEVICES``, the MPS variables, ``GPUD_JOB`` and ``GPUD_SOCKET`` added to the
current environment, forwards SIGINT/SIGTERM/SIGHUP to it, releases the reservation when it
ends and exits with its exit status (128 + N when killed by signal N; 127 when the command
cannot be started).

With traffic enforcement on, the environment also carries the job's ``GPUD_DSCP`` and
``NCCL_IB_TC``, and the command starts in the job's own cgroup v2 (``gpud-job-<name>``),
whose packets gpud marks with the job's DSCP: the command is held at a gate (a pipe) until
gpud has moved it into the cgroup, so not one of its sockets is opened outside. If gpud
cannot place it, gpuctl says why and runs it unmarked; if gpuctl dies first, the command
never runs (exit 125).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from types import FrameType

from gpud.cli.context import EXIT_USAGE, CliError, Context, Subparsers
from gpud.cli.jobs import KINDS, add_placement_options, fill_placement
from gpud.jobs.env import shell_exports
from gpud.v1 import jobs_pb2 as pb
from gpud.v1 import jobs_pb2_grpc as pb_grpc
from gpud.v1 import net_pb2, net_pb2_grpc

EXIT_CANNOT_EXEC = 127
EXIT_GATE_CLOSED = 125
# Says it is running (one byte on fd argv[2]: only then does /proc/PID/environ show the
# job's environment, which gpud checks), waits for one byte on fd argv[1], then becomes the
# command (the PID stays the same, so the cgroup gpud put it in is the command's).
_GATE = (
    "import os,sys\n"
    "fd,ready=int(sys.argv[1]),int(sys.argv[2])\n"
    "os.write(ready,b'r')\n"
    "os.close(ready)\n"
    "ok=os.read(fd,1)\n"
    "os.close(fd)\n"
    "ok or sys.exit(125)\n"
    "try:\n"
    " os.execvp(sys.argv[3],sys.argv[3:])\n"
    "except OSError as e:\n"
    " sys.stderr.write(f'gpuctl: cannot run {sys.argv[3]}: {e.strerror}\\n')\n"
    " sys.exit(127)\n"
)
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


def run_run(ctx: Context, args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise CliError(
            "run: give the command after --, e.g. gpuctl run --job a -- ./train", EXIT_USAGE
        )
    stub = ctx.stub(pb_grpc.JobsStub)
    resp: pb.ReserveResponse = ctx.call(stub.Reserve, reserve_request(args))
    reservation = resp.reservation.id
    env = {**os.environ, **resp.env}
    place = None
    if "GPUD_DSCP" in resp.env:
        net = ctx.stub(net_pb2_grpc.NetStub)

        def place(pid: int) -> None:
            # the response names the cgroup ("" when the daemon marks nothing by cgroup)
            ctx.call(net.PlaceProcess, net_pb2.PlaceProcessRequest(job=args.job, pid=pid))

    try:
        return _launch(command, env, place)
    finally:
        try:
            ctx.call(stub.Release, pb.ReleaseRequest(reservation_id=reservation))
        except CliError as err:
            # gpud releases it by itself once this process is gone.
            print(f"gpuctl: could not release reservation {reservation}: {err}", file=sys.stderr)


def _launch(
    command: list[str], env: dict[str, str], place: Callable[[int], None] | None = None
) -> int:
    """Run ``command``; with ``place``, start it behind a gate, call ``place(pid)``, then
    let it run (it runs even when placing fails, with a warning)."""
    gate_r = gate_w = ready_r = ready_w = -1
    argv = command
    if place is not None:
        gate_r, gate_w = os.pipe()
        ready_r, ready_w = os.pipe()
        argv = [sys.executable, "-I", "-S", "-c", _GATE, str(gate_r), str(ready_w), *command]
    try:
        child = subprocess.Popen(
            argv, env=env, pass_fds=(gate_r, ready_w) if place is not None else ()
        )
    except OSError as err:
        print(f"gpuctl: cannot run {command[0]}: {err.strerror}", file=sys.stderr)
        for fd in (gate_w, ready_r):
            if fd >= 0:
                os.close(fd)
        return EXIT_CANNOT_EXEC
    finally:
        for fd in (gate_r, ready_w):
            if fd >= 0:
                os.close(fd)
    if place is not None:
        try:
            os.read(ready_r, 1)  # empty when the gate died: placing then fails, harmlessly
            os.close(ready_r)
            place(child.pid)
        except CliError as err:
            print(f"gpuctl: the job's traffic is not marked by cgroup: {err}", file=sys.stderr)
        finally:
            os.write(gate_w, b"g")
            os.close(gate_w)

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
