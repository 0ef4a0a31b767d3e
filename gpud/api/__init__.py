"""gpud's gRPC API: the server, its services and what they need from the daemon.

The composition root builds the servicers from small ports (:mod:`gpud.api.ports`) and hands
their ``register`` methods to :class:`ApiServer`::

    node = NodeServicer(snapshots=sampler.latest, node_info=daemon.node_info,
                        events=event_log, faults=sim.faults if sim else None)
    api = ApiServer(socket_path, socket_group="gpud", tcp_address=None,
                    servicers=[node.register])
    await api.start()
    ...
    await api.stop(grace=2.0)

Adding a service (say ``gpud.v1.Mig``):

1. ``proto/gpud/v1/mig.proto`` with ``package gpud.v1;`` and ``service Mig``; run
   ``python -m tools.protogen`` (``tools/check`` runs ``--check``).
2. A servicer subclassing ``gpud.v1.mig_pb2_grpc.MigServicer`` with ``async`` methods and a
   ``register(server)`` that calls ``add_MigServicer_to_server(self, server)``. It raises
   :mod:`gpud.errors` exceptions (``InvalidArgument(..., field="gpu")``, ``NotFound``,
   ``Busy``...) and never calls ``context.abort``: the interceptor maps them, and turns
   anything unexpected into INTERNAL without taking the daemon down. Validation helpers
   are in :mod:`gpud.api.validate`. Blocking work (driver calls, SQLite) goes through
   ``asyncio.to_thread``.
3. Append its ``register`` to the ``servicers`` list at the composition root.
4. The gpuctl side: see :mod:`gpud.cli.main`.
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
