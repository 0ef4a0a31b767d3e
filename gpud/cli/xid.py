"""``gpuctl xid``: critical XIDs.

::

    gpuctl xid [list] [--gpu GPU]   every uncleared critical XID, one row per GPU and code:
                                    how often and when it was raised (--json: the same)
    gpuctl xid clear GPU [--xid C]  forget GPU's critical XIDs, or only code C: it is healthy
                                    again unless its readings or the codes left say otherwise
                                    (a GPU reset clears them all); also `--gpu GPU`, as
                                    `gpuctl sim fault` and `mps set` take it

A critical XID (any but ``telemetry.ignored_xids``) marks a GPU unhealthy with the XID in
the reason (``gpuctl gpus``, ``gpud_gpu_unhealthy_info``) until the GPU is reset or it is
cleared. Each code is kept on its own (``gpud_gpu_critical_xid_uncleared{xid}``), so a second
fault on a GPU is listed beside the first, not hidden behind it.
"""

from __future__ import annotations

import argparse
import time

from gpud.cli.context import EXIT_USAGE, XID_CODE, CliError, Context, Subparsers, gpu_index
from gpud.cli.output import NA
from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc

HEADERS = ("GPU", "UUID", "XID", "COUNT", "FIRST SEEN", "LAST SEEN")


def register(subparsers: Subparsers) -> None:
    xid = subparsers.add_parser(
        "xid", help="critical XIDs: list the uncleared ones, clear one after dealing with it"
    )
    xid.set_defaults(run=run_list, gpu=None)
    actions = xid.add_subparsers(dest="xid_command", metavar="COMMAND")
    list_ = actions.add_parser("list", help="every uncleared critical XID (the default)")
    list_.add_argument("--gpu", type=gpu_index, metavar="INDEX", help="only this GPU")
    list_.set_defaults(run=run_list)
    clear = actions.add_parser("clear", help="forget a GPU's critical XIDs, or one of them")
    clear.add_argument("gpu", type=gpu_index, nargs="?", metavar="GPU", help="GPU index")
    clear.add_argument("--gpu", type=gpu_index, dest="gpu_option", metavar="INDEX", help="the same")
    clear.add_argument(
        "--xid", type=XID_CODE, metavar="CODE", help="only this code (default: every one)"
    )
    clear.set_defaults(run=run_clear)


def _when(unix: float) -> str:
    # 0: kept by a gpud that did not record when
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix)) if unix else NA


def run_list(ctx: Context, args: argparse.Namespace) -> int:
    request = pb.ListGpusRequest()
    if args.gpu is not None:
        request.gpu = args.gpu
    resp: pb.ListGpusResponse = ctx.call(ctx.stub(pb_grpc.NodeStub).ListGpus, request)
    rows = [(gpu, x) for gpu in resp.gpus for x in gpu.critical_xids]
    if ctx.out.json:
        ctx.out.print_json(
            {
                "critical_xids": [
                    {
                        "gpu": gpu.index,
                        "uuid": x.uuid,
                        "xid": x.xid,
                        "count": x.count,
                        "first_seen_unix_seconds": x.first_seen_unix_seconds,
                        "last_seen_unix_seconds": x.last_seen_unix_seconds,
                    }
                    for gpu, x in rows
                ]
            }
        )
        return 0
    if not rows:
        ctx.out.print("no uncleared critical Xid")
        return 0
    ctx.out.print_table(
        HEADERS,
        [
            (
                str(gpu.index),
                x.uuid or NA,
                str(x.xid),
                str(x.count),
                _when(x.first_seen_unix_seconds),
                _when(x.last_seen_unix_seconds),
            )
            for gpu, x in rows
        ],
    )
    return 0


def _codes(xids: list[int]) -> str:
    return ("Xid " if len(xids) == 1 else "Xids ") + ", ".join(str(x) for x in xids)


def run_clear(ctx: Context, args: argparse.Namespace) -> int:
    given = [g for g in (args.gpu, args.gpu_option) if g is not None]
    if len(given) != 1:
        raise CliError("xid clear: name one GPU, e.g. gpuctl xid clear 1", EXIT_USAGE)
    (gpu,) = given
    request = pb.ClearXidRequest(gpu=gpu)
    if args.xid is not None:
        request.xid = args.xid
    resp: pb.ClearXidResponse = ctx.call(ctx.stub(pb_grpc.NodeStub).ClearXid, request)
    if ctx.out.json:
        ctx.out.print_json(resp)
        return 0
    cleared, remaining = list(resp.cleared_xids), list(resp.remaining_xids)
    if cleared:
        ctx.out.print(f"GPU {gpu}: critical {_codes(cleared)} cleared")
    elif args.xid is not None:
        ctx.out.print(f"GPU {gpu}: no critical Xid {args.xid} to clear")
    else:
        ctx.out.print(f"GPU {gpu}: no critical Xid to clear")
    if remaining:
        # the GPU stays unhealthy for them: say so, or the operator expects it back
        ctx.out.print(f"GPU {gpu}: critical {_codes(remaining)} not cleared")
    return 0
