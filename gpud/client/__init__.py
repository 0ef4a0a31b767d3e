"""gpud's client library for jobs: standard library and grpc only, imported inside jobs.

Everything a job uses is re-exported here::

    import gpud.client
    progress = gpud.client.Progress()
"""

from gpud.client.attributes import Attributes, GrpcUnavailable, attributes, watch_attributes
from gpud.client.colo import Latency, directive, throttle_point
from gpud.client.progress import Progress
from gpud.client.tos import job_dscp, set_socket_tos

__all__ = [
    "Attributes",
    "GrpcUnavailable",
    "Latency",
    "Progress",
    "attributes",
    "directive",
    "job_dscp",
    "set_socket_tos",
    "throttle_point",
    "watch_attributes",
]
