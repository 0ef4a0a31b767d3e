"""What every gpuctl command gets: the connection to the daemon, output, and error mapping.

A command calls the daemon with :meth:`Context.call`; failures become :class:`CliError` with
a message for people and an exit code that means something:

==== =====================================================================
 3   the daemon is not running / not reachable (``systemctl start gpud``)
 77  permission denied on the socket (join its group: gpud's ``api.socket_group``)
 2   invalid argument (argparse, or the daemon's INVALID_ARGUMENT)
 N   any other daemon error: the exit code of ``gpud.errors.ERROR_TABLE``
==== =====================================================================
"""

from __future__ import annotations

import argparse
import errno
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

from gpud.cli.output import Output
from gpud.errors import (
    ERROR_KEY,
    ERROR_TABLE,
    EXIT_CODE_KEY,
    InvalidArgument,
    Partial,
    Unavailable,
)
from gpud.shared import (
    MAX_THREADS_PERCENT,
    MAX_XID,
    MIN_THREADS_PERCENT,
    check_slo_ms,
    parse_size,
)

T = TypeVar("T")

# what a command group's register() receives (argparse's type for add_subparsers())
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

DEFAULT_SOCKET = Path("/run/gpud/gpud.sock")
EXIT_NOT_RUNNING = ERROR_TABLE[Unavailable][1]  # 3
# a degraded answer: done for the GPUs that answer (mig), the nodes' problems unknown or
# not recordable (cluster status); what is missing is said with its reason
EXIT_PARTIAL = ERROR_TABLE[Partial][1]  # 11
EXIT_PERMISSION = 77
EXIT_USAGE = 2

# gRPC status code name -> exit code: the first (least specific) class of ERROR_TABLE wins,
# e.g. UNAVAILABLE -> 3 (Unavailable), not 10 (GpuLost). The daemon sends the exact code in
# trailing metadata; this table serves errors without it.
_EXIT_BY_STATUS: dict[str, int] = {}
for _code_name, _exit in ERROR_TABLE.values():
    _EXIT_BY_STATUS.setdefault(_code_name, _exit)


N = TypeVar("N", int, float)


def _bound(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)  # 1e+07, not 10000000.0


def _ranged(
    cast: Callable[[str], N], noun: str, low: N, high: N, *, above: bool = False
) -> Callable[[str], N]:
    span = (
        f"over {_bound(low)} and at most {_bound(high)}"
        if above
        else f"in {_bound(low)}..{_bound(high)}"
    )

    def parse(text: str) -> N:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun} {span}") from None
        # NaN is in no range
        if not low <= value <= high or (above and value == low):
            raise argparse.ArgumentTypeError(f"{value} is not {span}")
        return value

    return parse


def integer(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[low, high]``, the range of the request field it
    goes to, so that an absurd value is a usage error naming the flag (exit 2)."""
    return _ranged(int, "an integer", low, high)


def number(low: float, high: float, *, above: bool = False) -> Callable[[str], float]:
    """:func:`integer` for a real number; ``above``: ``low`` itself is refused too, as the
    field's own check refuses it. NaN and the infinities are in no such range."""
    return _ranged(float, "a number", low, high, above=above)


def seconds(high: float) -> Callable[[str], float]:
    """An argparse ``type``: a duration in seconds, over 0 and at most ``high`` (a timeout,
    a drain): ``'abc' is not a number of seconds (0 < s <= 86400)``, the text as given."""
    return described(number(0, high, above=True), f"a number of seconds (0 < s <= {high:g})")


def given(what: str) -> Callable[[str], str]:
    """An argparse ``type`` that refuses an empty (or blank) value, an unset variable most
    likely, as a usage error naming the flag (exit 2), rather than send it to gpud or take
    it for the option left out: ``give WHAT, got ''``."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"give {what}, got {text!r}")
        return text

    return parse


JOB_NAME = given("a job name")


def size(text: str) -> int:
    """An argparse ``type``: a size as gpud takes it (:func:`gpud.shared.parse_size`), in
    bytes, so that an empty or malformed one is a usage error naming the flag (exit 2)."""
    try:
        return parse_size(text, field="")
    except InvalidArgument as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def described(parse: Callable[[str], T], what: str) -> Callable[[str], T]:
    """``parse`` (an argparse ``type``) whose refusal says what the flag takes instead of
    its bare range: ``'x' is not WHAT``."""

    def parse_described(text: str) -> T:
        try:
            return parse(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None

    return parse_described


def slo_ms(text: str) -> float:
    """An argparse ``type``: a p99 latency SLO in milliseconds, held to the range the
    daemon takes (:func:`gpud.shared.check_slo_ms`), so that an absurd one is a usage error
    naming the flag (exit 2)."""
    try:
        return check_slo_ms(float(text), field="")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds") from None
    except InvalidArgument as err:
        raise argparse.ArgumentTypeError(str(err)) from None


INT32 = integer(-(2**31), 2**31 - 1)
UINT32 = integer(0, 2**32 - 1)
UINT64 = integer(0, 2**64 - 1)
# an MPS active thread percentage (``--threads``), as gpud takes it: refused before any
# question to gpud
THREADS_PERCENT = integer(MIN_THREADS_PERCENT, MAX_THREADS_PERCENT)
THREADS_RANGE = f"{MIN_THREADS_PERCENT}..{MAX_THREADS_PERCENT}"
# an XID code as gpud takes it (telemetry.ignored_xids, a clear, an injection)
XID_CODE = integer(1, MAX_XID)
_INDEX = integer(0, 2**31 - 1)  # the int32 field a GPU index goes in; no GPU is numbered below 0


def gpu_index(text: str) -> int:
    """An argparse ``type``: a GPU index as gpud numbers the node's GPUs (``gpuctl
    gpus``), for every option that takes one; a UUID or a negative number is refused
    saying what is expected (gpud says which indexes the node has)."""
    try:
        return _INDEX(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"GPU index: expected a number 0..N-1 for a node of N GPUs (gpuctl gpus lists"
            f" them), got {text!r}"
        ) from None


# exit code -> gRPC status code name, for a failure of gpuctl's own (no daemon answer):
# the first class of ERROR_TABLE with that exit code, e.g. 3 -> UNAVAILABLE, 77 ->
# PERMISSION_DENIED; an exit code no class has (1 of a command's own) is INTERNAL's.
_STATUS_BY_EXIT: dict[int, str] = {}
for _code_name, _exit in ERROR_TABLE.values():
    _STATUS_BY_EXIT.setdefault(_exit, _code_name)


# gRPC's words for a connection the socket accepted but no HTTP/2 settings came back on
CONNECT_TIMED_OUT = "connection attempt timed out"
# gRPC's last errors for a socket nothing listens on: gpud stopped between gpuctl's probe
# and gRPC's own connect.
_NOTHING_LISTENS = ("Connection refused", "No such file or directory", "Not a directory")
# gRPC's last errors for a connection the kernel did not complete because gpud's queue of
# connections not yet accepted was full: gpud runs, busy under a burst of gpuctl. Not gRPC's
# "Delayed close" wrapper: it wraps a dropped connection's reason as well.
_QUEUE_FULL = (
    "Transport endpoint is not connected",
    "Resource temporarily unavailable",
)
# gRPC's last errors for a connection gpud's socket had queued and then dropped unanswered:
# gpud ended (killed, or stopped to restart) with it still in the queue, or during gRPC's
# handshake write. Looked for before a full queue's words, which gRPC may put beside these.
_DROPPED = ("Connection reset by peer", "Socket closed", "Broken pipe")


class CliError(Exception):
    """A failure to report in one line and exit with ``exit_code``; ``error`` names the
    daemon's error class (``gpud.errors``) when the daemon raised it; ``status``, the gRPC
    status code name of the failed call (``NOT_FOUND``), or of the class of failure that
    ``exit_code`` means when gpuctl found it itself; ``deadline_s``, the seconds gpud did
    not answer within, when that was the failure; ``unanswered``, whether the call may have
    reached a gpud that sent no answer (past its deadline, gone during the call, or closing
    gpuctl's connection as it stopped): what it asked for may have been done. A refusal
    gpud sent, or a socket nothing listened on, is not unanswered."""

    def __init__(
        self,
        message: str,
        exit_code: int,
        *,
        error: str = "",
        status: str = "",
        deadline_s: float | None = None,
        unanswered: bool = False,
    ) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.error = error
        self.status = status or _STATUS_BY_EXIT.get(exit_code, _STATUS_BY_EXIT[1])
        self.deadline_s = deadline_s
        self.unanswered = unanswered

    def to_json(self, message: str | None = None) -> dict[str, object]:
        """What ``--json`` prints on stderr for it: ``{"error": {...}}``, the message as
        said without ``--json`` (``message`` where given), the exit code, the status code name, and the daemon's
        error class (``null`` when the daemon raised none)."""
        return {
            "error": {
                "message": str(self) if message is None else message,
                "code": self.status,
                "exit_code": self.exit_code,
                "class": self.error or None,
            }
        }


def _group_name(path: Path) -> str | None:
    """The socket's group, or None where it cannot be read."""
    import grp

    try:
        return grp.getgrgid(path.stat().st_gid).gr_name
    except (OSError, KeyError):
        return None


# The most of a path, or of an argument, a message shows: a unix socket's path is at most
# 107 bytes anyway, and no name or number an option takes is longer.
SHOWN_PATH_CHARS = 200


def clip_arguments(message: str, words: Sequence[str]) -> str:
    """``message`` with each of gpuctl's arguments (``words``) longer than
    :data:`SHOWN_PATH_CHARS` that it repeats cut, its length said: a 100 kB argument echoed
    back (``'xxx...' is not a size``) would bury the reason that follows it."""
    for word in sorted({w for w in words if len(w) > SHOWN_PATH_CHARS}, key=len, reverse=True):
        for form in dict.fromkeys((repr(word)[1:-1], word)):  # as repr writes it, or as it is
            if form in message:
                clipped = f"{form[:SHOWN_PATH_CHARS]}... ({len(word)} characters)"
                message = message.replace(form, clipped)
    return message


def shown_word(word: str) -> str:
    """``word`` (a path, a command's name) as a one-line message shows it: a control
    character (a newline would split the line, an escape sequence reach the terminal) or a
    byte that is not UTF-8 escaped as Python writes it (``\\n``, ``\\udcff``), and a word
    past :data:`SHOWN_PATH_CHARS` cut, its length said."""
    text = word if word.isprintable() else repr(word)[1:-1]
    if len(text) > SHOWN_PATH_CHARS:
        text = f"{text[:SHOWN_PATH_CHARS]}... ({len(word)} characters)"
    return text


def shown_path(path: Path) -> str:
    """``path`` as a one-line message shows it (:func:`shown_word`)."""
    return shown_word(str(path))


def _not_running(path: Path, why: str) -> CliError:
    return CliError(
        f"gpud is not running: {why} {shown_path(path)}. Start it with `systemctl start gpud` "
        "(or point --socket / GPUD_SOCKET at its socket).",
        EXIT_NOT_RUNNING,
    )


def _denied(path: Path) -> CliError:
    from gpud.reach import closed_to_caller

    closed = closed_to_caller(path)
    if closed is not None:
        # the socket's group is no help behind a directory that keeps this user out
        return CliError(
            f"permission denied on {path}: {closed}. That is for an administrator (as root);"
            " the socket's group (api.socket_group) does not help before it.",
            EXIT_PERMISSION,
        )
    group = _group_name(path)
    if group is None or group == "root":
        # joining root's group is no fix to suggest: the socket needs a group of its own
        how = (
            'an administrator sets `socket_group = "gpud"` in the [api] section of '
            "/etc/gpud/gpud.toml (`groupadd --system gpud` first), restarts gpud, and adds you "
            "(`usermod -aG gpud $USER`, then log in again)"
        )
    else:
        how = (
            f"join group {group!r} (`usermod -aG {group} $USER`, then log in again); the "
            "group is gpud's `api.socket_group` setting"
        )
    return CliError(f"permission denied on {path}: run as root, or {how}.", EXIT_PERMISSION)


def _not_a_socket(path: Path) -> str | None:
    """What ``path`` is, when it is something other than a socket; None for a socket (or
    when it cannot be read)."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else "a file"


def probe_socket(path: Path, timeout: float) -> None:
    """Connect once with a plain socket, so that "not running" and "permission denied" get
    their own messages and exit codes (gRPC reports both as an opaque UNAVAILABLE).

    The socket blocks, with ``timeout`` as its send timeout (SO_SNDTIMEO): when the
    kernel's queue of connections gpud has not accepted yet is full, connect() then waits
    for room, up to ``timeout``, as for a gpud busy for a moment under a burst of gpuctl;
    a socket with a Python timeout is non-blocking, and the kernel would say EAGAIN at
    once."""
    import socket  # not at the top: `gpuctl --help` needs no socket
    import struct

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # a struct timeval of at least 1 µs: 0 would wait for ever
    micros = max(1, round(timeout * 1_000_000))
    sock.setsockopt(
        socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", *divmod(micros, 1_000_000))
    )
    try:
        sock.connect(os.fsencode(path))
    except PermissionError:
        raise _denied(path) from None
    except (FileNotFoundError, NotADirectoryError):
        raise _not_running(path, "no socket at") from None
    except ConnectionRefusedError:
        # connect() refuses a path that is no socket just as it refuses a stale socket
        kind = _not_a_socket(path)
        if kind is not None:
            raise _not_running(path, f"there is {kind}, not a socket, at") from None
        raise _not_running(path, "nothing listens on") from None
    except OSError as err:
        if err.errno == errno.EACCES:
            raise _denied(path) from None
        if err.errno == errno.EAGAIN:
            # the kernel's queue of connections gpud has not accepted stayed full for the
            # whole timeout: it runs, and takes none
            raise CliError(
                f"gpud on {shown_path(path)} takes no more connections: the queue of those it"
                f" has not accepted stayed full for {timeout:g} s (it accepts none: stopped,"
                " or its event loop stuck); check `systemctl status gpud`",
                EXIT_NOT_RUNNING,
            ) from None
        # e.g. "AF_UNIX path too long" carries no errno
        raise _not_running(path, f"cannot connect ({err.strerror or err}) to") from None
    finally:
        sock.close()


class Context:
    """One gpuctl invocation: socket, timeout, output; the channel is opened on first use."""

    def __init__(self, *, socket_path: Path, timeout: float, output: Output) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.out = output
        self._channel: Any = None

    def channel(self) -> Any:
        """The ``grpc.Channel`` to the daemon (probes the socket first)."""
        if self._channel is None:
            import grpc  # here, not at the top: `gpuctl --help` must not pay for it

            probe_socket(self.socket_path, self.timeout)
            # A gpud that accepts the connection but never speaks (stopped, its loop stuck)
            # is waited for up to gRPC's connect timeout, 20 s by default, even by a stream
            # with no deadline (events --follow): --timeout bounds it too.
            self._channel = grpc.insecure_channel(
                f"unix:{self.socket_path.absolute()}",
                options=[("grpc.min_reconnect_backoff_ms", max(1, round(self.timeout * 1000)))],
            )
        return self._channel

    def stub(self, stub_class: Callable[[Any], T]) -> T:
        """A generated stub on the channel, e.g. ``ctx.stub(node_pb2_grpc.NodeStub)``."""
        return stub_class(self.channel())

    def call(self, method: Callable[..., T], request: object, *, timeout: float | None = None) -> T:
        """Call a unary method with the timeout (``timeout`` when shorter: a call made on
        the way out); gRPC errors become :class:`CliError`."""
        import grpc

        bound = min(self.timeout, timeout or self.timeout)
        try:
            return method(request, timeout=bound)
        except grpc.RpcError as err:
            raise self.translate(err, bound) from None

    def translate(self, err: Any, timeout: float | None = None) -> CliError:
        """A gRPC error as a message and exit code; ``timeout``: the call's deadline, when
        shorter than ``--timeout`` (a call's own bound, which raising --timeout would not
        lengthen)."""
        import grpc

        code = err.code()
        details = err.details() or code.name
        metadata = dict(err.trailing_metadata() or ())
        exit_text = metadata.get(EXIT_CODE_KEY)
        if exit_text is not None and str(exit_text).isdigit():
            return CliError(
                details,
                int(exit_text),
                error=str(metadata.get(ERROR_KEY, "")),
                status=code.name,
            )
        # no gpud metadata: the error came from gRPC itself, not from the daemon's code
        if code == grpc.StatusCode.UNAVAILABLE and CONNECT_TIMED_OUT in details:
            # the socket took the connection (the probe did) but gpud sent nothing back: it
            # runs, and does not answer, as a call past its deadline
            code, timeout = grpc.StatusCode.DEADLINE_EXCEEDED, None
        if code == grpc.StatusCode.UNAVAILABLE:
            if details.startswith("failed to connect"):
                return self._failed_to_connect(details)
            # the call had reached gpud ("Socket closed", "Connection reset by peer"): it
            # died or restarted while handling it, so a change asked for may be half known
            return CliError(
                f"gpud on {self.socket_path} went away during the call ({details}): it"
                " stopped or restarted, so whether what this command asks for was done is"
                " unknown; see `systemctl status gpud`, then check before repeating it",
                EXIT_NOT_RUNNING,
                unanswered=True,
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            bound = self.timeout if timeout is None else timeout
            hint = "raise --timeout, or " if bound >= self.timeout else ""
            return CliError(
                f"gpud did not answer within {bound:g} s on {self.socket_path} "
                f"({hint}check `systemctl status gpud`)",
                EXIT_NOT_RUNNING,
                status=code.name,
                deadline_s=bound,
                unanswered=True,
            )
        if code == grpc.StatusCode.UNIMPLEMENTED:  # another gRPC server, or an older gpud
            details += (
                f": the server on {self.socket_path} does not serve this call: it is not gpud,"
                " or a gpud older than this gpuctl"
            )
        return CliError(
            f"{code.name}: {details}", _EXIT_BY_STATUS.get(code.name, 1), status=code.name
        )

    def _failed_to_connect(self, details: str) -> CliError:
        """gRPC's own connect failing after the probe connected, by gRPC's last error:
        closed before answering where gpud dropped the queued connection as it ended
        ("Connection reset by peer", "Broken pipe"), even inside gRPC's "Delayed close"
        wrapper; busy only where the kernel said gpud's queue of connections not yet
        accepted was full ("Transport endpoint is not connected"); permission denied
        where the socket's mode changed since the probe; else not running, as where
        nothing listens on the socket any more. Only the kernel's words count: the
        socket's path, which gRPC's text names, is left out before they are looked for."""
        last_error = details.partition("last error")[2].replace(
            f"unix:{self.socket_path.absolute()}", "unix:"
        )
        if any(w in last_error for w in _NOTHING_LISTENS):
            last_error = ""  # gpud stopped since the probe
        if "Permission denied" in last_error:
            return _denied(self.socket_path)
        if any(w in last_error for w in _DROPPED):
            return CliError(
                f"gpud on {shown_path(self.socket_path)} closed gpuctl's connection before"
                f" answering ({details}): it stopped or restarted just now; nothing was sent;"
                " see `systemctl status gpud`",
                EXIT_NOT_RUNNING,
                unanswered=True,
            )
        if any(w in last_error for w in _QUEUE_FULL):
            return CliError(
                f"gpud on {shown_path(self.socket_path)} runs but did not take gpuctl's"
                f" connection ({details}): it is busy (a burst of connections can fill the"
                " queue of those it has not accepted); retry, or check `systemctl status gpud`",
                EXIT_NOT_RUNNING,
            )
        return _not_running(self.socket_path, f"cannot reach it ({details}) on")

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
