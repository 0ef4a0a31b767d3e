"""``gpuctl sim``: rehearse failures on a simulated node (``gpud --simulate``).

::

    gpuctl sim fault --gpu 0 lost               # the GPU falls off the bus
    gpuctl sim fault --gpu 1 reset-required     # the GPU needs a reset (NVML_ERROR_RESET_REQUIRED)
    gpuctl sim fault --gpu 1 not-supported power
    gpuctl sim fault --gpu 1 error mig_memory   # its MIG devices' memory reads fail
    gpuctl sim fault --gpu 2 slow 5             # every driver call takes 5 s longer
    gpuctl sim fault --gpu 2 slow-mig 0.5       # each MIG change takes 0.5 s longer; reads do not
    gpuctl sim fault --gpu 3 xid 79
    gpuctl sim fault --gpu 0 clear
    gpuctl sim reboot                           # as a reboot: MIG instances, MPS daemons go
    gpuctl sim workload start --gpu 0 --mig 1 --pid 4194304 --memory 8GiB --sm 0.6
    gpuctl sim workload stop --pid 4194304      # (a PID no host process has: see --pid)

A daemon on real GPUs refuses with FAILED_PRECONDITION (exit 6).
"""

from __future__ import annotations

import argparse

from gpud.cli.context import (
    XID_CODE,
    CliError,
    Context,
    Subparsers,
    given,
    gpu_index,
    integer,
    number,
    size,
)
from gpud.cli.output import NA, gib, percent
from gpud.shared import MAX_XID
from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc

FIELD = given("a reading")  # an unset variable names none
PID = integer(1, 2**32 - 1)  # the uint32 field; 0 names no process


def register(subparsers: Subparsers) -> None:
    sim = subparsers.add_parser("sim", help="simulated node: faults, reboot, workloads")
    actions = sim.add_subparsers(dest="sim_command", metavar="COMMAND", required=True)
    fault = actions.add_parser("fault", help="inject a fault into one simulated GPU")
    fault.add_argument(
        "--gpu",
        type=gpu_index,
        required=True,
        metavar="INDEX",
        help="the GPU's index (gpuctl gpus)",
    )
    kinds = fault.add_subparsers(dest="fault_kind", metavar="KIND", required=True)
    kinds.add_parser("lost", help="the GPU falls off the bus").set_defaults(kind="FAULT_KIND_LOST")
    kinds.add_parser(
        "reset-required",
        help="the GPU requires a reset: its queries answer NVML_ERROR_RESET_REQUIRED until it is"
        " reset (its UUID, name and PCI info still answer)",
    ).set_defaults(kind="FAULT_KIND_RESET_REQUIRED")
    kinds.add_parser("clear", help="remove every fault on the GPU").set_defaults(
        kind="FAULT_KIND_CLEAR"
    )
    xid = kinds.add_parser("xid", help="raise an XID event")
    xid.add_argument(
        "code", type=XID_CODE, help=f"XID code 1..{MAX_XID}, e.g. 79 (fallen off the bus)"
    )
    xid.set_defaults(kind="FAULT_KIND_XID")
    slow = kinds.add_parser("slow", help="make every driver call on the GPU slower")
    # a day at most: a slower driver call is no fault to simulate, and NaN would hang it
    slow.add_argument("seconds", type=number(0, 86400), help="added to each call, 0..86400")
    slow.set_defaults(kind="FAULT_KIND_SLOW")
    slow_mig = kinds.add_parser(
        "slow-mig",
        help="make each MIG change on the GPU slower (create/destroy instances, set MIG mode); "
        "reads stay fast",
    )
    slow_mig.add_argument("seconds", type=number(0, 86400), help="added to each change, 0..86400")
    slow_mig.set_defaults(kind="FAULT_KIND_SLOW_MIG")
    ns = kinds.add_parser("not-supported", help="make reads of FIELD raise NotSupported")
    ns.add_argument(
        "field", type=FIELD, help='a reading, e.g. "power", "temperature", "ecc", "process_memory"'
    )
    ns.set_defaults(kind="FAULT_KIND_NOT_SUPPORTED")
    err = kinds.add_parser("error", help="make reads of FIELD fail with a driver error")
    err.add_argument("field", type=FIELD, help='a reading: "mig_memory" (the MIG devices\' memory)')
    err.set_defaults(kind="FAULT_KIND_ERROR")
    fault.set_defaults(run=run_fault)
    reboot = actions.add_parser(
        "reboot",
        help="reboot the simulated node: MIG instances and MPS control daemons go, pending MIG"
        " modes apply",
    )
    reboot.set_defaults(run=run_reboot)
    workload = actions.add_parser(
        "workload", help="start or stop a simulated compute process on a GPU or MIG device"
    )
    wl = workload.add_subparsers(dest="workload_command", metavar="ACTION", required=True)
    start = wl.add_parser("start", help="a process that uses memory and SMs")
    start.add_argument(
        "--gpu",
        type=gpu_index,
        required=True,
        metavar="INDEX",
        help="the GPU's index (gpuctl gpus)",
    )
    start.add_argument(
        "--mig",
        default=None,
        # an unset variable: not "the whole GPU"
        type=given("a MIG device index or MIG UUID"),
        help="a MIG device index or MIG UUID on that GPU",
    )
    start.add_argument(
        "--pid",
        type=PID,
        required=True,
        help="its PID: when a host process with it runs now (in gpud's /proc, not a zombie), it is"
        " attributed to that process's job and ends when that process exits (sim.workload"
        " event); otherwise (say 4194304: Linux hands out PIDs below it) it runs until stopped",
    )
    start.add_argument(
        "--memory", type=size, default="1GiB", help="device memory it uses (default 1GiB)"
    )
    start.add_argument(
        "--sm", type=number(0, 1), default=0.5, help="share of SMs it keeps busy, 0..1"
    )
    start.set_defaults(run=run_workload, stop=False)
    stop = wl.add_parser("stop", help="the process ends")
    stop.add_argument("--pid", type=PID, required=True)
    stop.set_defaults(run=run_workload, stop=True)


def run_workload(ctx: Context, args: argparse.Namespace) -> int:
    request = pb.SimWorkloadRequest(pid=args.pid, stop=args.stop)
    if not args.stop:
        request.gpu = args.gpu
        request.mig = args.mig or ""
        request.memory_bytes = args.memory
        request.sm_ratio = args.sm
    try:
        resp: pb.SimWorkloadResponse = ctx.call(ctx.stub(pb_grpc.NodeStub).SimWorkload, request)
    except CliError as err:
        raise _with_option(err, args) from None
    if ctx.out.json:
        ctx.out.print_json(resp)
        return 0
    if args.stop:
        ctx.out.print(f"stopped simulated process {args.pid}")
    else:
        where = f"GPU {args.gpu}" + (f" MIG {args.mig}" if args.mig else "")
        ctx.out.print(f"started simulated process {args.pid} on {where}")
    if not resp.processes:
        # an older gpud sends only the lines
        for line in resp.workloads:
            ctx.out.print(f"  {line}")
        if not resp.workloads:
            ctx.out.print("no simulated processes running")
        return 0
    ctx.out.print_table(
        ("PID", "GPU", "GI", "CI", "MEM GiB", "SM"),
        [
            (
                str(p.pid),
                str(p.gpu),
                str(p.gpu_instance_id) if p.HasField("gpu_instance_id") else NA,
                str(p.compute_instance_id) if p.HasField("compute_instance_id") else NA,
                gib(p.used_memory_bytes),
                percent(p.sm_ratio),
            )
            for p in resp.processes
        ],
    )
    return 0


def _with_option(err: CliError, args: argparse.Namespace) -> CliError:
    """The simulated driver's refusal of a start on a GPU in MIG mode asks for a MIG
    device (``mig: ... name one: ...``): with the option that names it, when not given."""
    message = str(err)
    if err.error != "InvalidArgument" or args.stop or args.mig is not None:
        return err
    if not (message.startswith("mig: ") and " name one: " in message):
        return err
    return CliError(f"{message} (--mig)", err.exit_code, error=err.error, status=err.status)


def run_reboot(ctx: Context, args: argparse.Namespace) -> int:
    resp: pb.RebootSimResponse = ctx.call(
        ctx.stub(pb_grpc.NodeStub).RebootSim, pb.RebootSimRequest()
    )
    if ctx.out.json:
        ctx.out.print_json(resp)
    else:
        ctx.out.print("simulated node rebooted")
    return 0


def run_fault(ctx: Context, args: argparse.Namespace) -> int:
    # the kind's name, resolved here: building the parser loads no generated code
    kind = pb.FaultKind.Value(args.kind)
    request = pb.InjectFaultRequest(gpu=args.gpu, kind=kind)
    if kind == pb.FAULT_KIND_XID:
        request.xid = args.code
    elif kind in (pb.FAULT_KIND_SLOW, pb.FAULT_KIND_SLOW_MIG):
        request.seconds = args.seconds
    elif kind in (pb.FAULT_KIND_NOT_SUPPORTED, pb.FAULT_KIND_ERROR):
        request.field = args.field
    resp: pb.InjectFaultResponse = ctx.call(ctx.stub(pb_grpc.NodeStub).InjectFault, request)
    if ctx.out.json:
        ctx.out.print_json(resp)
        return 0
    if kind == pb.FAULT_KIND_XID:
        # an XID is an event, not a lasting fault: it is not among the active faults
        ctx.out.print(
            f"injected Xid {args.code} on GPU {args.gpu} (`gpuctl xid` lists the critical ones)"
        )
    else:
        ctx.out.print(f"injected {args.fault_kind} on GPU {args.gpu}")
    if resp.active_faults:
        ctx.out.print("active faults:")
        for fault in resp.active_faults:
            ctx.out.print(f"  {fault}")
    else:
        ctx.out.print("no lasting faults active")
    return 0
