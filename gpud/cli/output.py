"""gpuctl's output: aligned tables for people, JSON for scripts.

Display strings ("-" for a reading the device does not report, "?" for what gpud never read
of a GPU that has not answered since it started, "12.3 GiB") exist only here.
``--json`` prints protobuf messages as plain JSON values with the proto field names: numbers
stay numbers (also 64-bit ones, which protobuf's own JSON mapping turns into strings) and an
absent optional reading is ``null``; so is a list the driver did not give, or a value gpud
cannot know, one whose ``<name>_unknown`` beside it says why (``processes`` beside
``processes_unknown``, ``up`` beside ``up_unknown``). A number that is none (NaN, an
infinity), which JSON cannot carry, is ``null`` too.
"""

from __future__ import annotations

import errno
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from gpud.cli.pipes import reader_gone

if TYPE_CHECKING:
    from google.protobuf.message import Message

NA = "-"  # a reading that is not supported or not read
# a static fact (model, UUID, size) of a GPU that never answered: gpud does not know it
UNKNOWN = "?"
GIB = 1024**3
# Double fields that only ever carry a whole number (a count of bits, as gpud sets it):
# shown as one, 100000000 rather than 100000000.0. (Byte fields are integers on the wire;
# a measured rate, tx_bytes_per_second, is a real number.)
_WHOLE_DOUBLES = {"gpud.v1.NetInterface.rate_bits_per_second"}
_STRUCT_TYPES = {"google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue"}
_WELL_KNOWN_JSON = {
    "google.protobuf.Timestamp",
    "google.protobuf.Duration",
}
_UNKNOWN = "_unknown"  # "processes_unknown": why the list "processes" was not read


def _whole_numbers(value: Any) -> Any:
    """Struct numbers are doubles on the wire: show 2.0 as 2 (JSON numbers have no type)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _whole_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    return value


def _finite(value: Any) -> Any:
    """``value`` with each NaN and infinity made ``null``: JSON has no such number, and
    ``json.dumps`` would write ``NaN``/``Infinity``, which jq and strict parsers refuse."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def json_text(value: Any, **options: Any) -> str:
    """Plain ``value`` as JSON text that every parser takes (no NaN, no Infinity);
    ``options``: those of ``json.dumps``."""
    return json.dumps(_finite(value), allow_nan=False, **options)


def _struct(msg: Any) -> Any:
    """A ``google.protobuf`` Struct, Value or ListValue as plain values (json_format refuses
    a NaN or infinite number in one: it is ``None`` here)."""
    name = msg.DESCRIPTOR.full_name
    if name == "google.protobuf.Struct":
        return {k: _struct(v) for k, v in msg.fields.items()}
    if name == "google.protobuf.ListValue":
        return [_struct(v) for v in msg.values]
    kind = msg.WhichOneof("kind")
    if kind is None or kind == "null_value":
        return None
    value = getattr(msg, kind)
    return _struct(value) if kind in {"struct_value", "list_value"} else _finite(value)


def _scalar(fd: Any, value: Any) -> Any:
    # protobuf is imported where it is used: `gpuctl --help` needs none of it
    from google.protobuf.descriptor import FieldDescriptor  # C twin has no stub: fields are Any

    if fd.type == FieldDescriptor.TYPE_ENUM and fd.enum_type is not None:
        known = fd.enum_type.values_by_number.get(value)
        return known.name if known is not None else value
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return value.hex()
    if fd.full_name in _WHOLE_DOUBLES:
        return _whole_numbers(value)
    return value


def _value(fd: Any, value: Any) -> Any:
    if fd.message_type is not None:
        return message_to_dict(value)
    return _scalar(fd, value)


def message_to_dict(msg: Message) -> Any:
    """``msg`` as JSON values; unset sub-messages and optional scalars are ``None``, as is a
    list with a reason beside it why it was not read."""
    if msg.DESCRIPTOR.full_name in _STRUCT_TYPES:
        return _whole_numbers(_struct(msg))
    if msg.DESCRIPTOR.full_name in _WELL_KNOWN_JSON:
        from google.protobuf import json_format

        return json_format.MessageToDict(msg)
    out: dict[str, Any] = {}
    for fd in msg.DESCRIPTOR.fields:
        value = getattr(msg, fd.name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            out[fd.name] = {str(k): _value(value_fd, v) for k, v in value.items()}
        elif fd.is_repeated:
            out[fd.name] = [_value(fd, v) for v in value]
        elif fd.has_presence and not msg.HasField(fd.name):
            out[fd.name] = None
        else:
            out[fd.name] = _value(fd, value)
    # On the wire an unread list is empty, as is a list of none: the reason beside it tells
    # them apart. A script reading only the list must not take "not listed" for "none run".
    for fd in msg.DESCRIPTOR.fields:
        if fd.name.endswith(_UNKNOWN) and fd.type == fd.TYPE_STRING and getattr(msg, fd.name):
            listed = msg.DESCRIPTOR.fields_by_name.get(fd.name.removesuffix(_UNKNOWN))
            if listed is not None:  # a list, or a flag ("up" beside "up_unknown")
                out[listed.name] = None
    return out


def _plain(value: Any) -> Any:
    if hasattr(value, "DESCRIPTOR"):  # a protobuf message
        return message_to_dict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def format_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    pad_at_most: Mapping[int, int] | None = None,
) -> str:
    """Left-aligned columns two spaces apart; the last column is not padded. Column ``i`` is
    padded to at most ``pad_at_most[i]`` characters where it names ``i``: a longer cell is shown
    whole and pushes the rest of its own row right, instead of every row being padded to
    the longest one (an event's message of 300 characters)."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    for i, most in (pad_at_most or {}).items():
        widths[i] = min(widths[i], max(most, len(headers[i])))
    lines = []
    for row in (headers, *rows):
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def cell_first_few(items: Sequence[str], shown: int, sep: str = ",") -> str:
    """``items`` joined, the first ``shown`` of them and how many more: a table cell stays
    readable however many jobs or processes share one device (``--json`` lists them all).
    Not :func:`gpud.shared.first_few`, which daemon messages use (``a, b, ...``, no count)."""
    more = len(items) - shown
    named = sep.join(items[:shown]) or NA
    return f"{named}{sep}... (+{more} more)" if more > 0 else named


def last_seen(shown: str, read: bool) -> str:
    """A GPU's model or product as shown: marked ``(last seen)`` where the GPU was not
    ``read`` since gpud started, so that it is what an earlier run of gpud last read there
    (``gpuctl gpus``, ``mig show``, ``mps show`` alike)."""
    return shown if read or not shown else f"{shown} (last seen)"


def gib(value_bytes: int) -> str:
    return f"{value_bytes / GIB:.1f}"


def percent(ratio: float) -> str:
    return f"{ratio * 100:.0f}%"


def seconds(value: float) -> str:
    """A duration for people: "850 ms", "4.2 s", "3h 05m"."""
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 60:
        return f"{value:.1f} s"
    minutes, sec = divmod(int(value), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours}h {minutes:02d}m"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {sec:02d}s"


class OutputError(Exception):
    """stdout cannot take the output: a full disk (``gpuctl ... > /dev/full``), a file past
    its size limit, or no stdout at all (``gpuctl ... >&-``). gpuctl says so in one line and
    exits 1; a reader that went away (``| head -1``) is ``BrokenPipeError`` instead, and a
    terminal that hung up an EIO ``OSError``: both quiet (:func:`gpud.cli.pipes.output_gone`)."""


def _written(stream: TextIO, act: Callable[[], object]) -> None:
    """``act()`` (a write or flush of ``stream``), its failure an ``OutputError``; but a
    reader gone (``| head -1``: ``BrokenPipeError``) or a terminal hung up (EIO) is raised
    as it is, for :func:`gpud.cli.pipes.quiet_on_broken_pipe` to end gpuctl quietly."""
    try:
        act()
    except BrokenPipeError:
        raise
    except OSError as err:
        if err.errno == errno.EIO and reader_gone(stream):
            raise
        raise OutputError(f"cannot write the output: {err.strerror or err}") from err


class Output:
    """Where a command prints: one table or text for people, or one JSON document."""

    def __init__(self, *, json_output: bool, stream: TextIO | None = None) -> None:
        self.json = json_output
        self._stream = stream
        self.notes: list[str] = []  # under --json: said in the document (``notes``)

    @property
    def stream(self) -> TextIO:
        # resolved at print time, so a redirected sys.stdout (tests, pagers) is honoured
        return self._stream if self._stream is not None else sys.stdout

    def print(self, text: str = "") -> None:
        self.write(text + "\n")

    def write(self, text: str) -> None:
        """``text`` on stdout as it is; ``OutputError`` when stdout cannot take it."""
        stream = self.stream
        if stream is None:  # started with stdout closed: Python has no sys.stdout
            raise OutputError("cannot write the output: stdout is closed")
        _written(stream, lambda: stream.write(text))

    def flush(self) -> None:
        """What is still buffered, written; ``OutputError`` as for :meth:`write`. A small
        answer to a full file fails only here, when gpuctl's buffer is flushed."""
        stream = self.stream
        if stream is None:
            return
        _written(stream, stream.flush)

    def note(self, text: str) -> None:
        """A note beside an answer that exits 0 (a warning, what the answer is): a ``gpuctl:
        TEXT`` line on stderr, or under ``--json`` the document's ``notes`` list, stderr left
        empty."""
        if self.json:
            self.notes.append(text)
        else:
            print(f"gpuctl: {text}", file=sys.stderr)

    def print_json(self, value: Any) -> None:
        """``value`` (a protobuf message, or plain values holding messages) as one document,
        with ``notes`` added to an object where any were said."""
        value = _plain(value)
        if self.notes and isinstance(value, dict):
            value = {**value, "notes": list(self.notes)}
        self.write(json_text(value, indent=2) + "\n")

    def print_json_line(self, value: Any) -> None:
        """``value`` as one line of a stream of documents (JSON Lines: ``--watch``,
        ``--follow``), each read as it comes."""
        self.write(json_text(_plain(value)) + "\n")

    def print_table(
        self,
        headers: Sequence[str],
        rows: Sequence[Sequence[str]],
        *,
        pad_at_most: Mapping[int, int] | None = None,
    ) -> None:
        self.print(format_table(headers, rows, pad_at_most=pad_at_most))
