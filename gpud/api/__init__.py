"""gpud's gRPC API: the server, its services and what they need from the daemon.

The composition root builds the servicers from small ports (:mod:`gpud.api.ports`) and hands
their ``register`` methods to :class:`ApiServer`. A new service is a ``gpud.v1`` proto, a
servicer class that raises :mod:`gpud.errors` exceptions (the interceptor turns them into
statuses) and one more registrar in the list.
"""

from gpud.api.node import NodeServicer
from gpud.api.ports import EventSource, FaultPort, NodeInfo, NodeInfoSource, SnapshotSource
from gpud.api.server import ApiServer, Registrar

__all__ = [
    "ApiServer",
    "EventSource",
    "FaultPort",
    "NodeInfo",
    "NodeInfoSource",
    "NodeServicer",
    "Registrar",
    "SnapshotSource",
]
