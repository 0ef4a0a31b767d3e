"""A link's speed (``SIOCETHTOOL``), whether it is up (``SIOCGIFFLAGS``), its link type
(``SIOCGIFHWADDR``) and its ifindex (``SIOCGIFINDEX``), as the calling process's network
namespace sees them (the link type and ifindex also as another one sees them, on a socket
made there).

``/sys/class/net/IF/speed`` and ``operstate`` describe the interfaces of the namespace that
mounted /sys, not of the caller's: a daemon started with ``nsenter --net=`` still sees the
host's /sys, where ``eth0`` is the host's eth0 (or none). The ioctls ask the kernel on a
socket of the caller's own namespace, so they name the interface the daemon shapes.
"""

from __future__ import annotations

import ctypes
import fcntl
import socket
import struct
from collections.abc import Callable

SocketOpener = Callable[[], socket.socket]
"""Makes the datagram socket an ioctl is asked on: its network namespace is the one the
answer is about."""

SIOCETHTOOL = 0x8946
SIOCGIFFLAGS = 0x8913
SIOCGIFHWADDR = 0x8927
SIOCGIFINDEX = 0x8933
ARPHRD_LOOPBACK = 772  # ifi_type (and /sys/class/net/IF/type) of the loopback
# ip link's LOWER_UP-and-UP: the kernel sets it when operstate is "up" or "unknown"
IFF_RUNNING = 0x40
ETHTOOL_GSET = 0x00000001
# struct ethtool_cmd: 44 bytes; speed (low 16 bits) at 12, speed_hi at 28
_CMD_SIZE = 44
_SPEED, _SPEED_HI = 12, 28
_SPEED_UNKNOWN = 0xFFFFFFFF
# struct ifreq: the name (16 bytes), then a union of 24 whose first member is the pointer
_IFREQ = "16sP16x"
_IFNAMSIZ = 16
# struct ifreq with ifr_flags: the name, then a short (padded to the union's 24 bytes)
_IFREQ_FLAGS = "16sh22x"
# struct ifreq with ifr_hwaddr: the name, then a sockaddr whose sa_family is the link type
_IFREQ_HWADDR = "16sH22x"
# struct ifreq with ifr_ifindex: the name, then an int
_IFREQ_INDEX = "16si20x"


def link_speed_mbps(iface: str) -> int | None:
    """Mb/s of ``iface`` in this process's network namespace; None when the kernel has no
    speed for it (link down, a device without one) or no such interface."""
    name = iface.encode()
    if not name or len(name) >= _IFNAMSIZ:
        return None
    cmd = ctypes.create_string_buffer(struct.pack("=I", ETHTOOL_GSET), _CMD_SIZE)
    ifreq = struct.pack(_IFREQ, name, ctypes.addressof(cmd))
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            fcntl.ioctl(sock.fileno(), SIOCETHTOOL, ifreq)
    except OSError:
        return None
    (low,) = struct.unpack_from("=H", cmd, _SPEED)
    (high,) = struct.unpack_from("=H", cmd, _SPEED_HI)
    speed = low | high << 16
    return None if speed in (0, _SPEED_UNKNOWN) else speed


def _own_socket() -> socket.socket:
    return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


def _ifreq_member(
    iface: str, request: int, layout: str, member: str, open_socket: SocketOpener = _own_socket
) -> int | None:
    """The number right after the name in the ``struct ifreq`` the kernel answers to
    ``request`` on ``iface`` (``layout``, with ``member`` its format); None when there is
    no such interface in the namespace of ``open_socket``'s socket (this process's unless
    given), or that socket cannot be made."""
    name = iface.encode()
    if not name or len(name) >= _IFNAMSIZ:
        return None
    try:
        with open_socket() as sock:
            answer = fcntl.ioctl(sock.fileno(), request, struct.pack(layout, name, 0))
    except OSError:
        return None
    (value,) = struct.unpack_from(member, answer, _IFNAMSIZ)
    return int(value)


def link_running(iface: str) -> bool | None:
    """Whether ``iface`` in this process's network namespace is up with its carrier
    (``ip link``'s ``state UP``, or ``UNKNOWN`` for a driver that reports no state); None
    when there is no such interface."""
    flags = _ifreq_member(iface, SIOCGIFFLAGS, _IFREQ_FLAGS, "=h")
    return None if flags is None else bool(flags & IFF_RUNNING)


def link_type(iface: str, open_socket: SocketOpener = _own_socket) -> int | None:
    """The link type of ``iface`` in this process's network namespace (or in the one
    ``open_socket`` makes its socket in): the kernel's ``ARPHRD_*`` (``dev->type``, what
    ``ip link`` prints as ``link/ether``, ``link/loopback``), whatever the netdev is
    named; None when there is no such interface, or the socket cannot be made."""
    return _ifreq_member(iface, SIOCGIFHWADDR, _IFREQ_HWADDR, "=H", open_socket)


def ifindex(iface: str, open_socket: SocketOpener = _own_socket) -> int | None:
    """The ifindex of ``iface`` in this process's network namespace (or in the one
    ``open_socket`` makes its socket in): the kernel gives a netdev a new one each time it
    is made (a driver reset, a VF re-created), under the same name; None when there is no
    such interface, or the socket cannot be made."""
    return _ifreq_member(iface, SIOCGIFINDEX, _IFREQ_INDEX, "=i", open_socket)
