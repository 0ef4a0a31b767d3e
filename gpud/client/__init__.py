"""What jobs import to talk to their node's gpud (stdlib + grpc only)."""

from gpud.client.colo import Latency, directive, throttle_point

__all__ = [
    "Latency",
    "directive",
    "throttle_point",
]
