"""``gpuctl xid``: critical XIDs.

::

    gpuctl xid clear GPU     forget GPU's critical XID: it is healthy again unless its
                             readings say otherwise (a GPU reset clears it too)

A critical XID (any but ``telemetry.ignored_xids``) marks a GPU unhealthy with the XID in
the reason (``gpuctl gpus``, ``gpud_gpu_unhealthy_info``) until the GPU is reset or this.
"""

from __future__ import annotations

import argparse

from gpud.cli.context import Context, Subparsers
from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc


def register(subparsers: Subparsers) -> None:
    xid = subparsers.add_parser("xid", help="critical XIDs: clear one after dealing with it")
    actions = xid.add_subparsers(dest="xid_command", metavar="COMMAND", required=True)
    clear = actions.add_parser("clear", help="forget a GPU's critical XID")
    clear.add_argument("gpu", type=int, metavar="GPU", help="GPU index")
    clear.set_defaults(run=run_clear)


def run_clear(ctx: Context, args: argparse.Namespace) -> int:
    resp: pb.ClearXidResponse = ctx.call(
        ctx.stub(pb_grpc.NodeStub).ClearXid, pb.ClearXidRequest(gpu=args.gpu)
    )
    if ctx.out.json:
        ctx.out.print_json(resp)
    elif resp.HasField("cleared_xid"):
        ctx.out.print(f"GPU {args.gpu}: critical Xid {resp.cleared_xid} cleared")
    else:
        ctx.out.print(f"GPU {args.gpu}: no critical Xid to clear")
    return 0
