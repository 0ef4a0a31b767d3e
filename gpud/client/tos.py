"""Mark a socket's packets with the job's DSCP tag (IPv4 TOS, IPv6 traffic class).

::

    import socket
    from gpud.client import set_socket_tos

    s = socket.create_connection((peer, port))
    set_socket_tos(s)            # DSCP from $GPUD_DSCP (set by gpuctl run / gpuctl env)

``ss -tin`` shows the socket's ``tos``; on the wire the DSCP is the six high bits of that
byte, which gpud's tc filters match. Jobs launched with ``gpuctl run`` need not do this:
gpud marks their packets by cgroup. Only the standard library is used.
"""

from __future__ import annotations

import contextlib
import os
import socket

DSCP_VAR = "GPUD_DSCP"


def job_dscp() -> int | None:
    """The job's DSCP tag from ``$GPUD_DSCP``, or None when it is not set."""
    raw = os.environ.get(DSCP_VAR, "")
    if not raw:
        return None
    value = int(raw)
    if not 0 <= value <= 63:
        raise ValueError(f"${DSCP_VAR}={raw!r}: must be a DSCP in [0, 63]")
    return value


def set_socket_tos(sock: socket.socket, dscp: int | None = None) -> int:
    """Set ``sock``'s TOS / traffic class to ``dscp * 4`` (ECN bits left to the kernel) and
    return the byte; ``dscp`` defaults to the job's tag. Raises ``ValueError`` without one."""
    if dscp is None:
        dscp = job_dscp()
        if dscp is None:
            raise ValueError(f"no DSCP given and ${DSCP_VAR} is not set")
    if not 0 <= dscp <= 63:
        raise ValueError(f"DSCP must be in [0, 63], got {dscp}")
    tos = dscp << 2
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, tos)
        # v4-mapped peers on a dual-stack socket use the IPv4 option
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
    else:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
    return tos
