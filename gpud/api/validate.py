"""Request validation shared by the servicers: each check raises ``InvalidArgument`` naming
the field, which the error interceptor turns into ``INVALID_ARGUMENT``.

Protobuf cannot say "non-negative", "finite" or "one of these" for every field, and proto3
keeps unknown enum numbers as plain ints, so every servicer validates what it reads.
"""

from __future__ import annotations

import math
from typing import Any

from gpud.errors import InvalidArgument


def gpu_index(value: int, gpu_count: int, *, field: str = "gpu") -> int:
    """``value`` is an existing GPU index on a node with ``gpu_count`` GPUs."""
    if value < 0:
        raise InvalidArgument(f"must be a GPU index >= 0, got {value}", field=field)
    if value >= gpu_count:
        have = f"0..{gpu_count - 1}" if gpu_count else "none"
        raise InvalidArgument(
            f"no GPU {value} on this node (it has {gpu_count}: {have})", field=field
        )
    return value


def non_negative_seconds(value: float, *, field: str = "seconds") -> float:
    """A finite duration >= 0 (NaN and infinity are refused: they would hang a timer)."""
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"must be a finite number of seconds >= 0, got {value}", field=field)
    return value


def int_range(value: int, low: int, high: int, *, field: str) -> int:
    """``low <= value <= high``."""
    if not low <= value <= high:
        raise InvalidArgument(f"must be in [{low}, {high}], got {value}", field=field)
    return value


def non_empty(value: str, *, field: str, max_len: int = 256) -> str:
    """A non-empty, reasonably short string."""
    if not value:
        raise InvalidArgument("must not be empty", field=field)
    if len(value) > max_len:
        raise InvalidArgument(f"longer than {max_len} characters", field=field)
    return value


def optional(message: Any, field: str) -> Any:
    """A proto3 ``optional`` field's value, or None when the request does not set it."""
    return getattr(message, field) if message.HasField(field) else None
