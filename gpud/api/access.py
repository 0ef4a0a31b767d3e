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
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Final, Literal

from gpud.config import parse_address
from gpud.errors import PermissionDenied

TcpAccess = Literal["read", "full"]

_READS: Final = {
    "grpc.health.v1.Health": ("Check", "Watch"),
    "gpud.v1.Node": ("GetStatus", "ListGpus", "ListEvents"),
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


def guard(access: TcpAccess, socket_hint: str) -> Guard:
    """A check for each call, given its method (``/gpud.v1.Mig/ApplyMig``) and
    ``context.peer()``: it raises :class:`PermissionDenied` for a method that changes state,
    called over TCP under ``"read"``. ``socket_hint``: where such calls are served (the
    socket's path), for the message."""

    def check(method: str, peer: str) -> None:
        if access == "full" or peer.startswith("unix:") or method in TCP_READ_METHODS:
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
