"""``gpuctl version``: this client's version and build and, when reachable, the daemon's.

The build (:mod:`gpud.build`) is a digest of the code: gpud computes its own at start,
gpuctl its own here (and for ``--version``), from the installed files. Both come from one
package on a node, so builds that differ mean the code changed since gpud started (an
upgrade without a restart)."""

from __future__ import annotations

import argparse

from gpud import __version__
from gpud import build as build_id
from gpud.cli.context import CliError, Context, Subparsers
from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc

OLDER = "older gpud, no build"
"""The daemon's build as shown when it sends none (a gpud older than the field)."""


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("version", help="client and daemon versions and builds")
    parser.set_defaults(run=run)


def differ_line(client: str, daemon: str | None) -> str | None:
    """The line that says the daemon runs other code than the installed one, or None."""
    if daemon is None or build_id.UNKNOWN in (client, daemon) or client == daemon:
        return None
    return (
        f"builds differ: gpud runs build {daemon}, the installed code is build {client}:"
        " gpud was not restarted since the code changed (systemctl restart gpud)"
    )


def run(ctx: Context, args: argparse.Namespace) -> int:
    client_build = build_id.current()
    daemon: str | None = None
    daemon_build: str | None = None
    error: str | None = None
    try:
        resp: pb.GetStatusResponse = ctx.call(
            ctx.stub(pb_grpc.NodeStub).GetStatus, pb.GetStatusRequest()
        )
        daemon = resp.version
        daemon_build = resp.build or None  # "": a gpud older than the field
    except CliError as err:
        error = str(err)  # the client's version is still worth printing
    differ = differ_line(client_build, daemon_build)
    if ctx.out.json:
        ctx.out.print_json(
            {
                "client": __version__,
                "client_build": client_build,
                "daemon": daemon,
                "daemon_build": daemon_build,
                "builds_differ": differ is not None,
                "daemon_error": error,
            }
        )
        return 0
    ctx.out.print(f"gpuctl {build_id.describe(__version__, client_build)}")
    if daemon is None:
        ctx.out.print(f"gpud   unknown: {error}")
    else:
        ctx.out.print(
            f"gpud   {daemon} ({OLDER})"
            if daemon_build is None
            else f"gpud   {build_id.describe(daemon, daemon_build)}"
        )
    if differ is not None:
        ctx.out.print(differ)
    return 0
