"""``gpuctl cluster``: the leader, the epoch, this node's mode, nodes and jobs' global levels.

::

    gpuctl cluster status [--json]           leader, epoch, mode; etcd's alarms; nodes (on the
                                             leader); every node's problem (as it published
                                             it); when the certificates expire; jobs
    gpuctl cluster attributes [--job J ...]  runtime attributes of this node's jobs
                              [--watch]      ... and again whenever they change
"""

from __future__ import annotations

import argparse
import sys
import time

from gpud.cli.context import Context, Subparsers
from gpud.cli.output import seconds
from gpud.cli.pipes import when_reader_goes
from gpud.v1 import cluster_pb2 as pb
from gpud.v1 import cluster_pb2_grpc as pb_grpc

_RENEW_SOON_S = 14 * 86400  # as the daemon's warning (gpud.cluster.certexpiry.WARN_S)

_MODES = {
    "leader": "leader (this node leads)",
    "follower": "follower (applying the leader's orders)",
    "holding": "holding (no leader reachable: the last order stays in force)",
    "local": "local (no leader order: this node's own policy)",
}


def register(subparsers: Subparsers) -> None:
    group = subparsers.add_parser(
        "cluster", help="the cluster leader and the global order (default: status)"
    )
    group.set_defaults(run=run_status)
    sub = group.add_subparsers(dest="cluster_command", metavar="COMMAND")
    status = sub.add_parser("status", help="leader, epoch, mode, nodes and jobs")
    status.set_defaults(run=run_status)
    attrs = sub.add_parser("attributes", help="runtime attributes of this node's jobs")
    attrs.add_argument("--job", action="append", default=[], help="only this job (repeatable)")
    attrs.add_argument("--watch", action="store_true", help="print again on every change")
    attrs.set_defaults(run=run_attributes)


def _opt(msg: object, field: str, fmt: str = "{}") -> str:
    return fmt.format(getattr(msg, field)) if msg.HasField(field) else "-"  # type: ignore[attr-defined]


def run_status(ctx: Context, args: argparse.Namespace) -> int:
    resp: pb.GetClusterStatusResponse = ctx.call(
        ctx.stub(pb_grpc.ClusterStub).GetClusterStatus, pb.GetClusterStatusRequest()
    )
    if ctx.out.json:
        ctx.out.print_json(resp)
        return 0
    age = (
        f"{seconds(resp.last_order_age_seconds)} ago"
        if resp.HasField("last_order_age_seconds")
        else "never"
    )
    leader = resp.leader or "none known"
    if resp.leader_address:
        leader += f" at {resp.leader_address}"
    lines = [
        f"node:        {resp.node} (election: {resp.election})",
        f"leader:      {leader}, epoch {resp.epoch}",
        f"mode:        {_MODES.get(resp.mode, resp.mode)}",
        f"last order:  epoch {resp.applied_epoch}.{resp.applied_seq}, {age}"
        f" (local policy after {seconds(resp.grace_seconds)} without one)",
    ]
    if resp.election == "etcd":
        lines.append(f"etcd:        {'reachable' if resp.store_ok else 'UNREACHABLE'}")
        if "NOSPACE" in resp.etcd_alarms:
            lines += [
                "etcd alarm:  NOSPACE: etcd is out of space and refuses writes (no new leader,"
                " no new tag); the last order stays in force",
                "action:      free space (etcdctl compact REV; etcdctl defrag), then"
                " etcdctl alarm disarm",
            ]
        others = [a for a in resp.etcd_alarms if a != "NOSPACE"]
        if others:
            lines.append(f"etcd alarm:  {', '.join(others)} (etcdctl alarm list)")
    if resp.detail:
        lines.append(f"detail:      {resp.detail}")
    if resp.last_error:
        lines.append(f"error:       {resp.last_error}")
    if resp.rejected_orders:
        lines.append(f"rejected:    {resp.rejected_orders} stale orders")
    ctx.out.print("\n".join(lines))
    if resp.nodes:
        ctx.out.print()
        ctx.out.print_table(
            ("NODE", "LAST REPORT", "JOBS", "APPLIED EPOCH"),
            [
                (n.node, f"{seconds(n.report_age_seconds)} ago", str(n.jobs), str(n.applied_epoch))
                for n in resp.nodes
            ],
        )
    if resp.problems:
        now = time.time()
        ctx.out.print()
        ctx.out.print_table(
            ("NODE", "PROBLEM SINCE", "PROBLEM"),
            [
                (p.node, f"{seconds(max(0.0, now - p.since_unix_seconds))} ago", p.message)
                for p in resp.problems
            ],
        )
    if resp.certificates:
        ctx.out.print()
        ctx.out.print_table(
            ("CERTIFICATE", "EXPIRES", "FILE"), [_certificate_row(c) for c in resp.certificates]
        )
    if resp.jobs:
        ctx.out.print()
        ctx.out.print_table(
            ("JOB", "LEVEL", "DSCP", "PROGRESS", "SLOWEST NODE", "NODES"),
            [
                (
                    j.job,
                    _opt(j, "level"),
                    _opt(j, "dscp"),
                    _opt(j, "progress_rate", "{:.3f}"),
                    j.slowest_node or "-",
                    ",".join(j.nodes),
                )
                for j in resp.jobs
            ],
        )
    return 0


def _certificate_row(c: pb.ClusterCertificate) -> tuple[str, str, str]:
    if not c.HasField("expires_in_seconds"):
        return c.key, f"unreadable: {c.error}", c.path
    when = time.strftime("%Y-%m-%d", time.gmtime(c.not_after_unix_seconds))
    left = c.expires_in_seconds
    if left <= 0:
        return c.key, f"EXPIRED {when}", c.path
    soon = " RENEW SOON" if left < _RENEW_SOON_S else ""
    return c.key, f"{when}, in {left / 86400:.0f} d{soon}", c.path


def _print_attributes(ctx: Context, resp: pb.GetAttributesResponse) -> None:
    if ctx.out.json:
        ctx.out.print_json(resp)
        return
    ctx.out.print(f"epoch {resp.epoch}")
    ctx.out.print_table(
        (
            "JOB",
            "LEVEL",
            "DSCP",
            "PROGRESS",
            "SLOWEST",
            "UNHEALTHY GPUS",
            "CRITICAL XIDS",
            "LINKS DOWN",
            "DROPS",
        ),
        [
            (
                a.job,
                _opt(a, "level"),
                _opt(a, "dscp"),
                _opt(a, "progress_rate", "{:.3f}"),
                a.slowest_node or "-",
                ",".join(a.unhealthy_gpus) or "-",
                ",".join(a.critical_xids) or "-",
                ",".join(a.links_down) or "-",
                str(a.drops),
            )
            for a in resp.attributes
        ],
    )


def run_attributes(ctx: Context, args: argparse.Namespace) -> int:
    import grpc

    request = pb.GetAttributesRequest(jobs=args.job)
    stub = ctx.stub(pb_grpc.ClusterStub)
    if not args.watch:
        _print_attributes(ctx, ctx.call(stub.GetAttributes, request))
        return 0
    stream = stub.WatchAttributes(request)
    # attributes may not change for hours: `--watch | head -1` ends once head has
    gone = when_reader_goes(stream.cancel)
    try:
        for resp in stream:
            _print_attributes(ctx, resp)
            sys.stdout.flush()
    except KeyboardInterrupt:
        return 130
    except grpc.RpcError as err:
        if gone.is_set():
            raise BrokenPipeError from None  # exit 141, as the next write would have
        raise ctx.translate(err) from None
    return 0
