"""``gpuctl events``: the daemon's recent decisions from its structured event log."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from gpud.cli.context import INT32, Context, Subparsers
from gpud.cli.output import message_to_dict
from gpud.shared import is_about
from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("events", help="recent structured events, oldest first")
    parser.add_argument(
        "--kind", default="", metavar="PREFIX", help='only kinds starting with PREFIX (e.g. "gpu.")'
    )
    parser.add_argument(
        "--gpu",
        default="",
        metavar="GPU",
        help="only events about this GPU: its index (also its MIG devices'), or a GPU or MIG"
        " device UUID",
    )
    parser.add_argument("--job", default="", metavar="NAME", help="only events about job NAME")
    parser.add_argument(
        "--limit", type=INT32, default=0, metavar="N", help="the newest N (default 100)"
    )
    parser.set_defaults(run=run)


# Messages are padded to this many characters at most, so that the FIELDS of most events line
# up without every line taking the width of the longest message in the listing.
MESSAGE_PAD = 72


def _fields(event: pb.Event) -> dict[str, Any]:
    return message_to_dict(event.fields) if event.HasField("fields") else {}


def _when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def run(ctx: Context, args: argparse.Namespace) -> int:
    request = pb.ListEventsRequest(
        kind_prefix=args.kind, limit=args.limit, gpu=args.gpu, job=args.job
    )
    resp: pb.ListEventsResponse = ctx.call(ctx.stub(pb_grpc.NodeStub).ListEvents, request)
    if args.gpu or args.job:
        # a gpud older than these filters ignores them: filter here too
        kept = [e for e in resp.events if is_about(_fields(e), gpu=args.gpu.strip(), job=args.job)]
        if len(kept) != len(resp.events):
            resp = pb.ListEventsResponse(events=kept)
    if ctx.out.json:
        ctx.out.print_json(resp)
        return 0
    rows = []
    for event in resp.events:
        fields = _fields(event)
        detail = " ".join(f"{k}={json.dumps(v)}" for k, v in sorted(fields.items()))
        rows.append((_when(event.time_unix_seconds), event.kind, event.message, detail))
    ctx.out.print_table(("TIME", "KIND", "MESSAGE", "FIELDS"), rows, pad_at_most={2: MESSAGE_PAD})
    return 0
