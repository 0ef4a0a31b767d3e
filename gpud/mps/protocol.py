"""The ``nvidia-cuda-mps-control`` command protocol: commands written to its stdin, one per
line, and the grammar of the replies it prints.

This is what an operator types::

    $ echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=/run/gpud/mps/GPU-1/pipe nvidia-cuda-mps-control
    4242
    $ echo "set_default_device_pinned_mem_limit 0 20G" | nvidia-cuda-mps-control
    $ echo "get_default_device_pinned_mem_limit 0" | nvidia-cuda-mps-control
    20G

Facts the grammar follows (NVIDIA's MPS documentation, "Tools and Interface Reference"):

- ``set_*`` commands print nothing on success, except the thread percentage ones: the
  580-series daemon prints the percentage it holds afterwards, as a read-back prints it
  (``100.0``): the new one, or the old one when it refuses the value (out of (0, 100]; the
  reason goes to its log only). So an echo of the value set is success, any other text a
  refusal. A memory limit never set (or set to ``0``) reads back as nothing.
- Memory values are an integer followed by ``G`` or ``M`` (GiB or MiB). The driver displays a
  limit of at least 1 GiB as whole GiB, rounded down (``1044M`` reads back as ``1G``), so a
  read-back is compared with :func:`displayed_memory`, not with the value written.
- Thread percentages read back as a decimal (``25.0``).
- ``set_default_*`` reaches only servers started afterwards; a running server keeps its own
  values, changed with ``set_active_thread_percentage <PID> <pct>`` and
  ``set_device_pinned_mem_limit <PID> <dev> <value>`` (new clients only).
- ``<dev>`` is the device ordinal as the daemon sees it: gpud starts each daemon with
  ``CUDA_VISIBLE_DEVICES=<uuid>``, so it is always 0.

Everything here is pure: strings in, values out. :class:`MpsReplyError` carries the command
and the reply that did not parse.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from gpud.errors import BackendError, InvalidArgument
from gpud.shared import GIB, MAX_THREADS_PERCENT, MIB, MIN_THREADS_PERCENT

PID_FILE = "nvidia-cuda-mps-control.pid"  # written by the control daemon in its pipe dir
CONTROL_SOCKET = "control"  # the unix socket clients reach in the pipe dir
NOT_RUNNING = "Cannot find MPS control daemon process"

_MEMORY = re.compile(r"^(\d+)([GM])$")
_PERCENT = re.compile(r"^(\d+(?:\.\d+)?)$")


class MpsReplyError(BackendError):
    """The control daemon refused a command, or its reply did not parse.

    ``command`` is the line sent, ``reply`` what came back (trimmed).
    """

    def __init__(self, message: str, *, command: str, reply: str, uuid: str | None = None):
        shown = reply if len(reply) <= 200 else reply[:200] + "..."
        super().__init__(
            f"{message} (command {command!r}, reply {shown!r})", uuid=uuid, call=command
        )
        self.command = command
        self.reply = reply


# ---- commands -------------------------------------------------------------------------------


def get_server_list() -> str:
    return "get_server_list"


def start_server(uid: int) -> str:
    return f"start_server -uid {uid}"


def get_default_active_thread_percentage() -> str:
    return "get_default_active_thread_percentage"


def set_default_active_thread_percentage(percent: int) -> str:
    return f"set_default_active_thread_percentage {check_percent(percent)}"


def get_active_thread_percentage(server_pid: int) -> str:
    return f"get_active_thread_percentage {server_pid}"


def set_active_thread_percentage(server_pid: int, percent: int) -> str:
    return f"set_active_thread_percentage {server_pid} {check_percent(percent)}"


def get_default_device_pinned_mem_limit(device: int = 0) -> str:
    return f"get_default_device_pinned_mem_limit {device}"


def set_default_device_pinned_mem_limit(device: int, num_bytes: int) -> str:
    return f"set_default_device_pinned_mem_limit {device} {format_memory(num_bytes)}"


def set_device_pinned_mem_limit(server_pid: int, device: int, num_bytes: int) -> str:
    return f"set_device_pinned_mem_limit {server_pid} {device} {format_memory(num_bytes)}"


def quit_() -> str:
    return "quit"


# ---- values ---------------------------------------------------------------------------------


def check_percent(percent: int, *, field: str = "threads") -> int:
    if not MIN_THREADS_PERCENT <= percent <= MAX_THREADS_PERCENT:
        raise InvalidArgument(
            f"{percent} is not a percentage in {MIN_THREADS_PERCENT}..{MAX_THREADS_PERCENT}",
            field=field,
        )
    return percent


def format_memory(num_bytes: int, *, field: str = "memory") -> str:
    """MPS's memory value: ``20G`` for whole GiB, else whole MiB (``1536M``), rounded down."""
    if num_bytes < MIB:
        raise InvalidArgument(f"{num_bytes} bytes is below MPS's 1M minimum", field=field)
    if num_bytes >= 2**63:  # as gpuctl refuses it: the state database keeps 64-bit integers
        raise InvalidArgument(f"{num_bytes} bytes is more than any device holds", field=field)
    if num_bytes % GIB == 0:
        return f"{num_bytes // GIB}G"
    return f"{num_bytes // MIB}M"


def displayed_memory(num_bytes: int) -> str:
    """What ``get_*_device_pinned_mem_limit`` prints after ``num_bytes`` was set: whole GiB
    (rounded down) from 1 GiB up, whole MiB below."""
    if num_bytes >= GIB:
        return f"{num_bytes // GIB}G"
    return f"{num_bytes // MIB}M"


def client_memory_limit_env(limits: Mapping[int, int]) -> str:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``: ``0=20G,1=512M`` (device ordinal -> limit)."""
    return ",".join(f"{dev}={format_memory(limits[dev])}" for dev in sorted(limits))


# ---- replies --------------------------------------------------------------------------------


def _lines(reply: str) -> list[str]:
    return [line.strip() for line in reply.strip().splitlines() if line.strip()]


def parse_empty(command: str, reply: str) -> None:
    """A ``set_*``/``start_server``/``quit`` reply: nothing, or the daemon's refusal."""
    if reply.strip():
        raise MpsReplyError("the control daemon refused", command=command, reply=reply.strip())


def parse_set(
    command: str, reply: str, *, percent: int | None = None, num_bytes: int | None = None
) -> None:
    """A ``set_*`` reply: nothing, or the value just set (``percent`` or ``num_bytes``) echoed
    as a read-back prints it; anything else is the daemon's refusal."""
    lines = _lines(reply)
    if not lines:
        return
    if len(lines) == 1:
        echoed = lines[0]
        m = _PERCENT.match(echoed)
        if percent is not None and m is not None and abs(float(m.group(1)) - percent) <= 0.05:
            return
        if num_bytes is not None and echoed in (
            displayed_memory(num_bytes),
            format_memory(num_bytes),
        ):
            return
    raise MpsReplyError("the control daemon refused", command=command, reply=reply.strip())


def parse_server_list(command: str, reply: str) -> list[int]:
    """``get_server_list``: one server PID per line; nothing when no server runs."""
    pids: list[int] = []
    for line in _lines(reply):
        if not line.isdigit():
            raise MpsReplyError("not a server PID list", command=command, reply=reply.strip())
        pids.append(int(line))
    return pids


def parse_percent(command: str, reply: str) -> float:
    """``get_*active_thread_percentage``: ``25.0``."""
    lines = _lines(reply)
    match = _PERCENT.match(lines[0]) if len(lines) == 1 else None
    if match is None:
        raise MpsReplyError("not a percentage", command=command, reply=reply.strip())
    return float(match.group(1))


def parse_memory(command: str, reply: str) -> int | None:
    """``get_*device_pinned_mem_limit``: ``20G`` or ``512M`` in bytes; ``0``, ``0M``, ``0G``
    or nothing mean no limit (``None``)."""
    lines = _lines(reply)
    if not lines or lines == ["0"]:
        return None
    match = _MEMORY.match(lines[0]) if len(lines) == 1 else None
    if match is None:
        raise MpsReplyError("not a memory limit", command=command, reply=reply.strip())
    value = int(match.group(1)) * (GIB if match.group(2) == "G" else MIB)
    return value or None
