"""Memory sizes as people write them (``20GiB``, ``512M``) and as MPS writes them (``20G``)."""

from __future__ import annotations

import re

from gpud.errors import InvalidArgument

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
TIB = 1024 * GIB

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_FACTORS = {"": 1, "k": KIB, "m": MIB, "g": GIB, "t": TIB}


def parse_size(text: str, *, field: str = "memory") -> int:
    """Bytes from ``20GiB``, ``20G``, ``20gb``, ``512MiB``, ``1.5G`` or a plain byte count.

    Binary units throughout: MPS's own ``G`` means GiB, and so does gpud's.
    """
    match = _SIZE.match(text)
    if match is None:
        raise InvalidArgument(f"{text!r} is not a size like 20GiB or 512MiB", field=field)
    number, unit, _ = match.groups()
    value = float(number) * _FACTORS[unit.lower()]
    if value <= 0:
        raise InvalidArgument(f"{text!r} must be more than zero", field=field)
    return int(value)


def format_size(num_bytes: int) -> str:
    """``20GiB``, ``1536MiB`` or ``100B``: the largest binary unit that divides exactly."""
    for unit, factor in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if num_bytes >= factor and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    if num_bytes >= GIB:
        return f"{num_bytes / GIB:.1f}GiB"
    if num_bytes >= MIB:
        return f"{num_bytes / MIB:.1f}MiB"
    return f"{num_bytes}B"
