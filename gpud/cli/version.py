"""``gpuctl version``: this client's version and, when reachable, the daemon's."""

from __future__ import annotations

import argparse

from gpud import __version__
from gpud.cli.context import CliError, Context, Subparsers
from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("version", help="client and daemon versions")
    parser.set_defaults(run=run)


def run(ctx: Context, args: argparse.Namespace) -> int:
    daemon: str | None = None
    error: str | None = None
    try:
        resp: pb.GetStatusResponse = ctx.call(
            ctx.stub(pb_grpc.NodeStub).GetStatus, pb.GetStatusRequest()
        )
        daemon = resp.version
    except CliError as err:
        error = str(err)  # the client's version is still worth printing
    if ctx.out.json:
        ctx.out.print_json({"client": __version__, "daemon": daemon, "daemon_error": error})
    else:
        ctx.out.print(f"gpuctl {__version__}")
        ctx.out.print(f"gpud   {daemon}" if daemon is not None else f"gpud   unknown: {error}")
    return 0
