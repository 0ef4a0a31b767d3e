"""What jobs import to talk to their node's gpud (stdlib + grpc only)."""

from gpud.client.colo import Latency, throttle_point

__all__ = [
    "Latency",
    "throttle_point",
]
