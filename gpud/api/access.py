"""Who may call what: every method on the unix socket, a subset over TCP.

The unix socket (``api.socket``, mode 0660, group ``api.socket_group``) is the operator's
door: the kernel checks who connects. ``api.tcp_address`` has no such check, so by default
(``api.tcp_access = "read"``) it serves only what reads the node and what jobs report about
themselves (progress, latency); a call that changes the node's state (a MIG layout, MPS
limits, jobs, reservations, the queue, pins, simulated faults) is refused there with
``PERMISSION_DENIED`` naming the socket. ``"full"`` serves every method over TCP too, for a
listener the operator guards otherwise (a firewall, a loopback address on a single-user
host).

What gRPC says of the caller is ``context.peer()``: ``unix:...`` on the socket,
``ipv4:HOST:PORT`` or ``ipv6:[HOST]:PORT`` over TCP.

A job's own reports (``ReportProgress``, ``ReportProgressBatch``, ``ReportLatency``,
``ThrottlePoint``) name the job they speak for. Each reservation has a random report token,
kept with it in the state store and given to its run as ``GPUD_REPORT_TOKEN``;
``gpud.client`` sends it as the call's metadata ``gpud-report-token``
(:class:`ReportTokens`):

- a call carrying a token may report for the job of the reservation that has it, and for no
  other (``PERMISSION_DENIED`` naming the job; a released run's token is no one's);
- a call without one is taken on the socket (its users are the operators: ``gpuctl net
  report`` from a shell) and refused over TCP, where anyone could name any job.

The token is shown only to callers who may reserve (the socket; TCP under ``"full"``):
``GetJobEnv``, ``GetEntry`` and ``ListQueue``, reads over TCP, leave it out.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

from gpud.config import parse_address
from gpud.errors import PermissionDenied, ResourceExhausted

TcpAccess = Literal["read", "full"]

_READS: Final = {
    "grpc.health.v1.Health": ("Check", "Watch"),
    "gpud.v1.Node": ("GetStatus", "ListGpus", "ListEvents", "WatchEvents"),
    "gpud.v1.Jobs": ("ListJobs", "GetJobEnv"),
    "gpud.v1.Mig": ("ShowMig", "AssertMig", "ExportMig"),
    "gpud.v1.Mps": ("ShowMps",),
    # a job's own reports: what gpud.client sends from inside a job
    "gpud.v1.Net": ("ShowNet", "ReportProgress", "ReportProgressBatch"),
    "gpud.v1.Colocation": ("ShowColo", "ReportLatency", "ThrottlePoint"),
    "gpud.v1.Queue": ("GetEntry", "ListQueue", "History"),
    "gpud.v1.Cluster": ("GetClusterStatus", "GetAttributes", "WatchAttributes"),
}
TCP_READ_METHODS: Final = frozenset(
    f"/{service}/{method}" for service, methods in _READS.items() for method in methods
)

Guard = Callable[[str, str], None]

TOKEN_KEY: Final = "gpud-report-token"  # gRPC metadata: the run's GPUD_REPORT_TOKEN
TCP_NEEDS_TOKEN: Final = "reports over TCP carry the run's GPUD_REPORT_TOKEN"


def on_socket(peer: str) -> bool:
    """Whether ``context.peer()`` is a caller on the unix socket."""
    return peer.startswith("unix:")


class OpenStreams:
    """The streams of one method open at once, on the unix socket and over TCP counted
    apart (TCP callers never take the socket's places): at most ``most`` on each, one more
    refused with :class:`ResourceExhausted` saying how many ``what`` are open there, the
    bound, and which to end (``hint``)."""

    def __init__(self, most: int, what: str, hint: str) -> None:
        self.most = most
        self._what = what
        self._hint = hint
        self._open = {True: 0, False: 0}  # by on_socket

    @contextlib.contextmanager
    def held(self, peer: str) -> Iterator[None]:
        """A place for the stream of ``context.peer()`` ``peer`` while it is open."""
        local = on_socket(peer)
        if self._open[local] >= self.most:
            where = "on gpud's unix socket" if local else "over TCP (api.tcp_address)"
            raise ResourceExhausted(
                f"{self._open[local]} {self._what} {where} already, the most gpud serves"
                f" there at once ({self.most}): end one ({self._hint}) and retry"
            )
        self._open[local] += 1
        try:
            yield
        finally:
            self._open[local] -= 1


def guard(access: TcpAccess, socket_hint: str) -> Guard:
    """A check for each call, given its method (``/gpud.v1.Mig/ApplyMig``) and
    ``context.peer()``: it raises :class:`PermissionDenied` for a method that changes state,
    called over TCP under ``"read"``. ``socket_hint``: where such calls are served (the
    socket's path), for the message."""

    def check(method: str, peer: str) -> None:
        if access == "full" or on_socket(peer) or method in TCP_READ_METHODS:
            return
        name = method.rsplit("/", 1)[-1]
        raise PermissionDenied(
            f"{name} changes the node's state and is served on gpud's unix socket"
            f" ({socket_hint}) only: over TCP (api.tcp_address) gpud answers reads and jobs'"
            ' own reports (api.tcp_access = "read"; "full" serves every call there)'
        )

    return check


def tcp_warning(address: str, access: TcpAccess) -> str | None:
    """What an operator should hear of ``api.tcp_address`` with ``api.tcp_access = "full"``
    on an address other hosts can reach: anyone who reaches the port may change the node
    (no TLS, no check of who connects). Said at start and by ``gpud --check-config``."""
    if not address or access != "full":
        return None
    host = parse_address(address, path="", key="api.tcp_address")[0]
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (
        f'api.tcp_access = "full" serves every call, changes included, to whoever reaches'
        f" api.tcp_address {address!r} (no TLS, no check of who connects): guard that port,"
        ' or use "read"'
    )


@dataclass(frozen=True, slots=True)
class Reporter:
    """Who sent a call of reports: the job whose run's token it carried (``job``, None for
    a token that is no live run's), or an operator on the socket (``operator``: no token)."""

    job: str | None
    operator: bool = False

    def check(self, job: str) -> None:
        """Raise :class:`PermissionDenied` unless the call may report for ``job``."""
        if self.operator or self.job == job:
            return
        raise PermissionDenied(
            f"this call's report token (GPUD_REPORT_TOKEN) is not that of a run of job {job!r}:"
            " a run reports for its own job only, with the token gpud gave it"
        )


class ReportTokens:
    """Checks a call's report token and says who may see tokens.

    ``job_of``: the job of the live reservation holding a token (None: none holds it;
    :meth:`gpud.jobs.placement.Reservations.job_of_token`, a read of the state store: call
    :meth:`reporter` off the event loop). ``access``: ``api.tcp_access``."""

    def __init__(
        self, job_of: Callable[[str], str | None] = lambda _: None, access: TcpAccess = "read"
    ) -> None:
        self._job_of = job_of
        self._access = access

    def reporter(self, context: Any) -> Reporter:
        """Who sent the call of ``context``; raises :class:`PermissionDenied` for a call
        over TCP without a token."""
        token = next((str(v) for k, v in context.invocation_metadata() or () if k == TOKEN_KEY), "")
        if not token:
            if on_socket(context.peer()):
                return Reporter(None, operator=True)
            raise PermissionDenied(TCP_NEEDS_TOKEN)
        return Reporter(self._job_of(token))

    def reveals(self, context: Any) -> bool:
        """Whether the caller may see report tokens: those who may reserve (the socket,
        TCP under ``"full"``)."""
        return self._access == "full" or on_socket(context.peer())
