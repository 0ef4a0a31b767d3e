"""``gpuctl xid``: critical XIDs.

::

    gpuctl xid clear GPU     forget GPU's critical XID: it is healthy again unless its
                             readings say otherwise (a GPU reset clears it too); also
                             `--gpu GPU`, as `gpuctl sim fault` and `mps set` take it

A critical XID (any but ``telemetry.ignored_xids``) marks a GPU unhealthy with the XID in
the reason (``gpuctl gpus``, ``gpud_gpu_unhealthy_info``) until the GPU is reset or this.
"""

from __future__ import annotations

import argparse

from gpud.cli.context import EXIT_USAGE, INT32, CliError, Context, Subparsers
from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc


def register(subparsers: Subparsers) -> None:
    xid = subparsers.add_parser("xid", help="critical XIDs: clear one after dealing with it")
    actions = xid.add_subparsers(dest="xid_command", metavar="COMMAND", required=True)
    clear = actions.add_parser("clear", help="forget a GPU's critical XID")
    clear.add_argument("gpu", type=INT32, nargs="?", metavar="GPU", help="GPU index")
    clear.add_argument("--gpu", type=INT32, dest="gpu_option", metavar="INDEX", help="the same")
    clear.set_defaults(run=run_clear)


def run_clear(ctx: Context, args: argparse.Namespace) -> int:
    given = [g for g in (args.gpu, args.gpu_option) if g is not None]
    if len(given) != 1:
        raise CliError("xid clear: name one GPU, e.g. gpuctl xid clear 1", EXIT_USAGE)
    (gpu,) = given
    resp: pb.ClearXidResponse = ctx.call(
        ctx.stub(pb_grpc.NodeStub).ClearXid, pb.ClearXidRequest(gpu=gpu)
    )
    if ctx.out.json:
        ctx.out.print_json(resp)
    elif resp.HasField("cleared_xid"):
        ctx.out.print(f"GPU {gpu}: critical Xid {resp.cleared_xid} cleared")
    else:
        ctx.out.print(f"GPU {gpu}: no critical Xid to clear")
    return 0
