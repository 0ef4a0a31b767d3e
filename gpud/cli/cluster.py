"""``gpuctl cluster``: the leader, the epoch, this node's mode, nodes and jobs' global levels.

::

    gpuctl cluster status [--json]           the leader this node reports to (and whether
                                             etcd or the old leader named it), epoch, mode,
                                             what to do; etcd's alarms; nodes (asked of that
                                             leader) with the build each runs, and a line
                                             when they differ; every node's problem (as it
                                             published it); when the certificates expire;
                                             jobs
    gpuctl cluster attributes [--job J ...]  runtime attributes of this node's jobs
                              [--watch]      ... and again whenever they change (--json:
                                             one object a line, JSON Lines)
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Sequence

from gpud.cli.context import EXIT_PARTIAL, JOB_NAME, Context, Subparsers
from gpud.cli.output import seconds
from gpud.cli.pipes import when_reader_goes
from gpud.shared import first_few
from gpud.v1 import cluster_pb2 as pb
from gpud.v1 import cluster_pb2_grpc as pb_grpc

_RENEW_SOON_S = 14 * 86400  # as the daemon's warning (gpud.cluster.certexpiry.WARN_S)

_MODES = {
    "leader": "leader (this node leads: it ranks every node's jobs and hands out the order)",
    "follower": "follower (applying the leader's orders)",
    "holding": "holding (no leader reachable: the last order stays in force)",
    "local": "local (no leader order within the grace period: this node's own policy decides;"
    " it follows again at the next leader order)",
}


_OLDER = "older gpud"  # a node (or leader) whose gpud sends no build
_NAMED = 5  # nodes named per build in the builds line


def builds_line(nodes: Sequence[tuple[str, str]]) -> str | None:
    """``builds: 2 nodes on 3f2a9c1d04ab, 1 on 9e8d7c6b5a43 (n3)`` when the ``(node,
    build)`` pairs hold more than one build (a rolling upgrade under way, or a node whose
    gpud was not restarted after one); None when they agree. The most common build comes
    first, unnamed; the nodes of each other build are named."""
    by_build: dict[str, list[str]] = {}
    for node, build in nodes:
        by_build.setdefault(build or _OLDER, []).append(node)
    if len(by_build) < 2:
        return None
    groups = sorted(by_build.items(), key=lambda g: (-len(g[1]), g[0]))
    parts = []
    for i, (build, names) in enumerate(groups):
        count = f"{len(names)} node{'s' if len(names) > 1 else ''}" if i == 0 else str(len(names))
        part = f"{count} on {build}"
        if i > 0:
            part += f" ({first_few(names, _NAMED)})"
        parts.append(part)
    return "builds: " + ", ".join(parts)


def register(subparsers: Subparsers) -> None:
    group = subparsers.add_parser(
        "cluster", help="the cluster leader and the global order (default: status)"
    )
    group.set_defaults(run=run_status)
    sub = group.add_subparsers(dest="cluster_command", metavar="COMMAND")
    status = sub.add_parser("status", help="leader, epoch, mode, nodes and jobs")
    status.set_defaults(run=run_status)
    attrs = sub.add_parser("attributes", help="runtime attributes of this node's jobs")
    attrs.add_argument(
        "--job", action="append", type=JOB_NAME, default=[], help="only this job (repeatable)"
    )
    attrs.add_argument(
        "--watch",
        action="store_true",
        help="print again on every change (--json: one object a line)",
    )
    attrs.set_defaults(run=run_attributes)


def _opt(msg: object, field: str, fmt: str = "{}") -> str:
    return fmt.format(getattr(msg, field)) if msg.HasField(field) else "-"  # type: ignore[attr-defined]


def run_status(ctx: Context, args: argparse.Namespace) -> int:
    resp: pb.GetClusterStatusResponse = ctx.call(
        ctx.stub(pb_grpc.ClusterStub).GetClusterStatus, pb.GetClusterStatusRequest()
    )
    degraded = EXIT_PARTIAL if problems_state(resp) not in ("", "ok") or refused(resp) else 0
    if ctx.out.json:
        ctx.out.print_json(resp)
        return degraded
    lines = [f"node:        {resp.node} (election: {resp.election})", *_leader_lines(resp)]
    lines.append(f"mode:        {_mode(resp)}")
    if not resp.HasField("last_order_age_seconds"):
        lines.append("last order:  none yet (this node's own policy decides until one comes)")
    elif resp.leading:
        lines.append(
            f"last order:  epoch {resp.applied_epoch}.{resp.applied_seq}, applied"
            f" {seconds(resp.last_order_age_seconds)} ago"
        )
    else:
        lines.append(
            f"last order:  epoch {resp.applied_epoch}.{resp.applied_seq},"
            f" {seconds(resp.last_order_age_seconds)} ago"
            f" (local policy after {seconds(resp.grace_seconds)} without one)"
        )
    if resp.election == "etcd":
        lines.append(f"etcd:        {_etcd_state(resp)}")
        if _nospace_shown(resp):
            lines += [
                f"etcd alarm:  NOSPACE: {_NOSPACE}",
                f"action:      {_FREE_SPACE}",
            ]
        others = [a for a in resp.etcd_alarms if a != "NOSPACE"]
        if others:
            lines.append(f"etcd alarm:  {', '.join(others)} (etcdctl alarm list)")
    if resp.detail:
        detail = resp.detail
        if _nospace_shown(resp) and store_state(resp) == "full":
            detail = _FULL  # what the alarm's lines say already, at length
        lines.append(f"detail:      {detail}")
    if resp.last_error:
        error = _summary(resp.last_error)
        if _nospace_shown(resp) and error_kind(resp) == "store_full":
            error = f"leader round failed: {_FULL}"
        lines.append(f"error:       {error}")
    lines += [f"action:      {a}" for a in _actions(resp)]
    if resp.rejected_orders:
        lines.append(f"rejected:    {resp.rejected_orders} stale orders")
    ctx.out.print("\n".join(lines))
    if resp.nodes:
        ctx.out.print()
        ctx.out.print_table(
            ("NODE", "LAST REPORT", "JOBS", "APPLIED EPOCH", "BUILD"),
            [
                (
                    n.node,
                    f"{seconds(n.report_age_seconds)} ago",
                    str(n.jobs),
                    str(n.applied_epoch),
                    n.build or _OLDER,
                )
                for n in resp.nodes
            ],
        )
        builds = builds_line([(n.node, n.build) for n in resp.nodes])
        if builds is not None:
            ctx.out.print(builds)
    note = _problems_note(resp)
    if note or resp.problems:
        ctx.out.print()
    if note:
        ctx.out.print(f"problems:    {note}")
    if resp.problems:
        now = time.time()
        ctx.out.print_table(
            ("NODE", "PROBLEM SINCE", "PROBLEM"),
            [
                (
                    f"{p.node} ({p.gpud or p.instance})" if p.instance else p.node,
                    f"{seconds(max(0.0, now - p.since_unix_seconds))} ago",
                    _problem_text(p),
                )
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
        if resp.mode == "local":
            ctx.out.print("the last order's levels, not in force (the local policy decides):")
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
    return degraded


def refused(resp: pb.GetClusterStatusResponse) -> bool:
    """This gpud holds (or runs its local policy) because the leader refuses it: another
    gpud reports under its node name, and the leader takes that one only."""
    return not resp.leading and error_kind(resp) == "duplicate_node"


def _mode(resp: pb.GetClusterStatusResponse) -> str:
    """The mode line: what the node does, and why it does not follow."""
    left = ""
    if resp.HasField("last_order_age_seconds"):
        left_s = max(0.0, resp.grace_seconds - resp.last_order_age_seconds)
        left = f"; local policy in {seconds(left_s)} unless an order comes"
    why = ""
    if refused(resp):
        why = f"the leader refuses this gpud: another gpud reports as {resp.node}"
    elif not resp.leading and error_kind(resp) == "report_refused":
        # the leader answered: "no leader reachable" would send the operator to the network
        why = "the leader answers and refuses this node's report, as the error says"
    if why and resp.mode in ("holding", "local"):
        if resp.mode == "local":
            return f"local ({why}; this node's own policy decides)"
        return f"holding ({why}; the last order stays in force{left})"
    if resp.mode == "holding" and left:
        return f"holding (no leader reachable: the last order stays in force{left})"
    return _MODES.get(resp.mode, resp.mode)


def _problem_text(p: pb.ClusterProblem) -> str:
    """A problem as its node published it, after what the node does meanwhile (holding,
    local) where it said so."""
    text = _summary(p.message)
    if p.HasField("mode") and p.mode in ("holding", "local"):
        return f"{p.mode}: {text}"
    return text


# what an etcd out of space (the NOSPACE alarm) means, and what to do about it
_NOSPACE = (
    "etcd is out of space and refuses writes (no new leader, no new tag); the last order"
    " stays in force"
)
_FREE_SPACE = "free space (etcdctl compact REV; etcdctl defrag), then etcdctl alarm disarm"
# a write etcd refused while out of space, shortly, under the NOSPACE alarm's own lines
_FULL = "etcd refused a write: out of space (see the alarm above; full text: --json)"

_TLS_FAILED = re.compile(r"(?i)\b(?:tls|ssl) handshake failed")
# OpenSSL's last words in gRPC's text: "...:OPENSSL_internal:BAD_SIGNATURE: certificate
# signature failure"
_OPENSSL_REASON = re.compile(r"OPENSSL_internal:[A-Z0-9_]+: ([^:;]+)")
_OWN_CERTIFICATE = "; this node's certificate"


def _summary(message: str) -> str:
    """A failed TLS handshake in one line: gRPC's text carries the connection attempt and
    OpenSSL's error stack (hundreds of characters); ``--json`` and gpud's log keep it all."""
    text, own, rest = message.partition(_OWN_CERTIFICATE)
    tls = _TLS_FAILED.search(text)
    if tls is None:
        return message
    head = text[: tls.start()].split(" failed to connect", 1)[0].rstrip(" :;")
    reason = _OPENSSL_REASON.search(text)
    why = reason.group(1).strip() if reason else "see --json"
    return f"{head}: TLS handshake failed ({why}; full text: --json){own}{rest}"


def _leader_lines(resp: pb.GetClusterStatusResponse) -> list[str]:
    """Who this node reports to, and where it learnt that."""
    if not resp.leader:
        none = [f"leader:      none known, epoch {resp.epoch}"]
        if resp.stepped_down:  # the detail says etcd's failure since, not this
            # past tense, and no wider than the other labels ("stepped down:" is 13)
            none.append(f"stood down:  this node led epoch {resp.epoch}: {resp.stepped_down}")
        return none
    leader = f"{resp.leader} at {resp.leader_address}" if resp.leader_address else resp.leader
    # the leader key's lease, hex as etcdctl prints it (etcdctl lease timetolive ID): the
    # elected leader's, absent from an older gpud
    lease = f", lease {resp.leader_lease}" if resp.leader_lease else ""
    if resp.leader_source != "hint":
        stale = (
            " (as this node last read etcd)"
            if resp.election == "etcd" and not resp.store_ok
            else ""
        )
        return [f"leader:      {leader}, epoch {resp.epoch}{lease}{stale}"]
    since = ""
    if resp.HasField("leader_since_unix_seconds"):
        since = f" for {seconds(max(0.0, time.time() - resp.leader_since_unix_seconds))}"
    elected = resp.elected_leader
    if resp.elected_leader_address:
        elected += f" at {resp.elected_leader_address}"
    return [
        f"leader:      {leader}, not from etcd: named by {resp.elected_leader} when it refused"
        f" this node's report; reporting there{since}",
        f"etcd leader: {elected}, epoch {resp.epoch}{lease}, as this node last read etcd;"
        f" {resp.elected_leader} does not lead now",
    ]


def store_state(resp: pb.GetClusterStatusResponse) -> str:
    """How this node's last etcd call went: "ok", "unreachable", "refused" (its login, its
    keys) or "full" (a write while etcd is out of space). An older gpud sends no
    ``store_state``: its detail then begins "etcd refused" when etcd answered and refused,
    naming the alarm NOSPACE when out of space, and anything else is an etcd it cannot
    reach."""
    if resp.HasField("store_state"):
        return resp.store_state
    if resp.store_ok:
        return "ok"
    if not resp.detail.startswith("etcd refused"):
        return "unreachable"
    return "full" if "NOSPACE" in resp.detail else "refused"


def problems_state(resp: pb.GetClusterStatusResponse) -> str:
    """Whether the nodes' problems as listed can be trusted, in :func:`store_state`'s
    words: "ok"; "unreachable" or "refused" (this node could not read them: unknown);
    "full" (etcd refuses writes: no node can record a new one); "" with no etcd. An older
    gpud sends no ``problems_state``: its alarms and ``store_state`` stand for it, and the
    problems it lists were read whatever its last etcd call met."""
    if resp.HasField("problems_state"):
        return resp.problems_state
    if resp.election != "etcd":
        return ""
    if "NOSPACE" in resp.etcd_alarms:
        return "full"
    state = store_state(resp)
    if state in ("unreachable", "refused") and resp.problems:
        return "ok"
    return state


def _problems_note(resp: pb.GetClusterStatusResponse) -> str:
    """Why the problems table is empty or incomplete ("" when it can be trusted): an empty
    one must not read as "no node has a problem"."""
    state = problems_state(resp)
    if state == "full":
        before = " (those listed were recorded before)" if resp.problems else ""
        return f"etcd REFUSES writes (NOSPACE): problems cannot be recorded{before}"
    if state == "unreachable":
        return "etcd unreachable from this node: problems unknown"
    if state == "refused":
        return "etcd REFUSES this node's calls (see detail): problems unknown"
    return ""


# the gRPC code of a leader's refusal in a report's error ("leader N at ADDRESS: CODE
# words"; the words may be empty)
_LEADER_REFUSED = re.compile(r": (?:INVALID_ARGUMENT|PERMISSION_DENIED)(?: |$)")


def error_kind(resp: pb.GetClusterStatusResponse) -> str:
    """What ``last_error`` is (``last_error_kind``: "duplicate_node", "leader_not_ready",
    "tls_handshake"...; "" with none). An older gpud sends no ``last_error_kind``: the
    words of its error tell the kinds this gpuctl acts on."""
    error = resp.last_error
    if resp.HasField("last_error_kind"):
        kind = resp.last_error_kind
        if kind == "leader_unreachable" and _LEADER_REFUSED.search(error):
            # a gpud from 2026-12-06 typed the leader's answered refusal so
            return "report_refused"
        return kind
    if not error:
        return ""
    if "handshake" in error.lower():
        return "tls_handshake"
    if "is reported by two gpuds" in error:
        return "duplicate_node"
    if "does not lead yet" in error:
        return "leader_not_ready"
    if _LEADER_REFUSED.search(error):
        return "report_refused"  # an older gpud typed the leader's refusal so
    return "leader_unreachable"


def _etcd_refuses(resp: pb.GetClusterStatusResponse) -> bool:
    """etcd answers but refuses this node's calls (its login, its keys, a write while out
    of space); otherwise, when not ok, it cannot reach etcd."""
    return store_state(resp) in ("refused", "full")


def _etcd_state(resp: pb.GetClusterStatusResponse) -> str:
    if resp.store_ok:
        return "reachable"
    if store_state(resp) == "full":
        # NOSPACE refuses writes only: this node still reads the leader key and alarms
        return "reachable, REFUSES writes: out of space (reads work)"
    if _etcd_refuses(resp):
        return "reachable, REFUSES this node's calls (see detail)"
    return "UNREACHABLE"


def _nospace_shown(resp: pb.GetClusterStatusResponse) -> bool:
    """The NOSPACE alarm's lines (what it means, what to do) are in the status."""
    return resp.election == "etcd" and "NOSPACE" in resp.etcd_alarms


def _actions(resp: pb.GetClusterStatusResponse) -> list[str]:
    """What an operator can do about the state the status shows (none when all is well)."""
    actions: list[str] = []
    if resp.election == "etcd" and _etcd_refuses(resp):
        if store_state(resp) == "full":
            # out of space: no login or role to check; the alarm's lines, where shown (the
            # alarms are read every 10 s, and the read may fail), say it above
            if not _nospace_shown(resp):
                actions.append(f"{_FREE_SPACE}: {_NOSPACE}")
        else:
            actions.append(
                "do what the detail says (etcd's user and password: cluster.etcd_username,"
                " cluster.etcd_password_file; the user's role): it learns of a new leader"
                " only from etcd"
            )
    elif resp.election == "etcd" and not resp.store_ok and not resp.leading:
        actions.append(
            "make etcd reachable from this node (cluster.etcd_endpoints, etcd's TLS and auth"
            " files; the detail says why it fails): it learns of a new leader only from etcd"
        )
    kind = error_kind(resp)
    if kind == "tls_handshake":
        actions.append(
            "the TLS handshake with the leader failed: both certificates must be signed by"
            " the same cluster CA (cluster.ca_file on each node), name their node and be"
            " valid now (openssl verify -CAfile CA CERT on this node's cluster.cert_file and"
            " the leader's)"
        )
    elif kind == "duplicate_node":
        actions.append(
            "give each gpud its own cluster.node: another gpud reports under this node's name"
            " (the error names its address), and the leader takes the newest one only;"
            " rename one (a restart) or stop it; the node follows again by itself"
        )
    elif resp.mode in ("holding", "local") and not resp.leading and kind == "report_refused":
        actions.append(
            "the leader is reachable and refuses this node's report: the error names the"
            " field it refuses (gpuds of two versions: upgrade the older, BUILD in gpuctl"
            " cluster status on the leader) or says this node's certificate does not name"
            " cluster.node; the node follows again by itself once a report is taken"
        )
    elif resp.mode in ("holding", "local") and kind == "leader_not_ready":
        actions.append(
            "wait: the leader restarted within its previous run's lease, and leads again"
            " once that lease expires (cluster.lease_ttl_s); the node follows by itself"
        )
    elif resp.mode in ("holding", "local") and kind == "leader_key_held":
        actions.append(
            "wait, or rename: etcd names this node the leader while another gpud holds the"
            " key: this gpud's previous run until its lease expires (cluster.lease_ttl_s),"
            " or another gpud under the same cluster.node (give each its own)"
        )
    elif resp.mode in ("holding", "local") and kind == "not_leader":
        # the leader answered: it stepped down; reaching it mends nothing
        if resp.store_ok:
            actions.append(
                "wait: the leader etcd named answered that it no longer leads (it stepped"
                " down), and etcd names its successor within cluster.lease_ttl_s; the node"
                " follows by itself"
            )
    elif resp.mode in ("holding", "local") and resp.last_error:
        actions.append(
            "make the leader reachable from this node (see error: its cluster.advertise"
            " address, the network between them); the node follows again by itself"
        )
    return actions


def _certificate_row(c: pb.ClusterCertificate) -> tuple[str, str, str]:
    if not c.HasField("expires_in_seconds"):
        return c.key, f"unreadable: {c.error}", c.path
    when = time.strftime("%Y-%m-%d", time.gmtime(c.not_after_unix_seconds))
    left = c.expires_in_seconds
    if left <= 0:
        return c.key, f"EXPIRED {when}", c.path
    soon = " RENEW SOON" if left < _RENEW_SOON_S else ""
    return c.key, f"{when}, in {left / 86400:.0f} d{soon}", c.path


def _print_attributes(ctx: Context, resp: pb.GetAttributesResponse, *, line: bool = False) -> None:
    """The attributes as a table, or under ``--json`` one document (``line``: on one line,
    as each answer of ``--watch`` is)."""
    if ctx.out.json:
        if line:
            ctx.out.print_json_line(resp)
        else:
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
            "FAULTS LEFT OUT",
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
                _xids_cell(a),
                # the leader cut these to bound its order: fewer faults listed than there are
                str(a.faults_left_out) if a.faults_left_out else "-",
                ",".join(a.links_down) or "-",
                str(a.drops),
            )
            for a in resp.attributes
        ],
    )


def _xids_cell(a: pb.JobAttributes) -> str:
    """``critical_xids``, and each ``xids`` entry (``node:code``) of a node with none of
    them: that node runs a gpud from before critical XIDs (its last XID of any kind), or
    the leader does (it drops critical_xids from reports); a node and a leader of this
    version send in ``xids`` the codes of ``critical_xids`` only."""
    reporting = {x.split("/", 1)[0] for x in a.critical_xids}
    older = [f"{x} (code only, older gpud)" for x in a.xids if x.rsplit(":", 1)[0] not in reporting]
    return ",".join([*a.critical_xids, *older]) or "-"


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
            _print_attributes(ctx, resp, line=True)
            ctx.out.flush()
    except KeyboardInterrupt:
        return 130
    except grpc.RpcError as err:
        if gone.is_set():
            # exit 141 (129: a terminal hung up), as the next write would have
            raise BrokenPipeError from None
        raise ctx.translate(err) from None
    return 0
