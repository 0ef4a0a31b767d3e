"""What gpuctl and the daemon agree on, in one small module both import.

gpuctl imports no daemon package (start-up time, and a CLI that does not depend on the
daemon's internals), so the few things both sides must read the same way live here:

- memory sizes as people write them (``20GiB``, ``512M``) and as MPS writes them (``20G``);
- the p99 latency SLOs an inference job may declare (``jobs add --slo-p99-ms``, ``colo
  advise --slo-ms``, and the API fields behind them), and the peak load one may declare;
- the longest drain a MIG apply may ask for, and the largest mig-parted file it may send,
  read so that whatever file an operator names fails at once;
- the longest contention-free iteration time a progress report may declare;
- a job's environment rendered as shell ``export`` lines;
- what a ``gpuctl run`` that waits outside the admission queue waits on, and why
  ``gpuctl queue --leave`` of an entry no longer queued takes nothing out;
- why an MPS device's daemon is not started (its GPU unhealthy), as its status says it;
- free text a request may carry (a progress report's session): one short line;
- files read whole at start and on reload (the config, the cluster's certificates), read so
  that a named pipe, a device or a file far too big fails at once rather than hangs;
- which events are about a GPU or a job (``gpuctl events --gpu/--job``, ListEvents), and
  which texts can name a GPU there;
- the initial metadata that says a WatchEvents stream is live (``events --follow``);
- the XID codes gpud takes (``telemetry.ignored_xids``, ``xid clear --xid``, an injected one);
- a number a range check refuses, written with every digit it has;
- the first few of a long list of names, as a message shows them, and a long text cut.

Pure and cheap to import: the standard library and :mod:`gpud.errors` only.
"""

from __future__ import annotations

import errno
import math
import os
import pwd
import re
import stat
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from gpud.errors import InvalidArgument

# The largest XID code gpud takes, in the config, a clear or an injection (the driver's are
# in the hundreds at most): one a config could not name would be one it could not ignore.
MAX_XID = 999

# What one node's report to the cluster leader (gpud.v1.ClusterPeer) may carry: jobs a report
# (or GetOrder names), critical XIDs a job (a few codes on each of its devices). Here, not in
# gpud.cluster.convert, as the API's generic bounds (gpud.api.validate.FIELD_LIMITS) widen
# those fields to them: under the generic 256, a node with more jobs had every report refused.
CLUSTER_MAX_JOBS = 4096
CLUSTER_MAX_XIDS = 1024
# ... and across all the jobs of one report, so that one certified peer cannot make the
# leader convert and fold millions of entries (4096 jobs x 1024 XIDs: seconds of its event
# loop and hundreds of MiB). A node holds a few GPUs x 7 MIG devices (64 at most), each with
# a few uncleared codes, shared by its jobs: hundreds of jobs with every device faulted stay
# within some thousand entries, a sixteenth of these; a node past them cuts its own report
# (gpud.cluster.agent.trim_report) rather than have it refused whole.
CLUSTER_MAX_REPORT_XIDS = 16384  # critical_xids, summed over the report's jobs
CLUSTER_MAX_REPORT_GPUS = 16384  # gpus, unhealthy_gpus and xids, each summed over its jobs

# The most events one ListEvents or WatchEvents may ask for (`gpuctl events --limit`): gpud
# refuses a larger limit, and gpuctl does before asking, in the same range.
MAX_EVENT_LIMIT = 10_000

# QueueEntry.waiting_on of a `gpuctl run` waiting for co-location (outside the queue), as
# `gpuctl queue --leave` answers it and `gpuctl queue` lists it
WAITING_ON_COLOCATION = "co-location"


def started_not_left(job: str, entry_id: str, reservation: str, devices: Iterable[str]) -> str:
    """Why an operator's leave of queue entry ``entry_id`` took nothing out: it had started,
    as reservation ``reservation`` on ``devices`` ("": its run has ended since); the job runs
    on unless its run is stopped."""
    said = f"job {job} ({entry_id}) did not leave the queue: it had started"
    if not reservation:
        return f"{said}, and its run has ended (gpuctl jobs history)"
    return (
        f"{said} (reservation {reservation} on {', '.join(devices)}): stop its gpuctl run, or"
        f" gpuctl jobs rm --force {job}"
    )


def mps_unhealthy_wait(gpu: int) -> str:
    """An MPS device's ``last_error`` while gpud starts no control daemon on it because
    GPU ``gpu`` is unhealthy: `gpuctl mps show` tells that wait from other reasons a daemon
    is down by it, the GPU's own reason being said under the table."""
    return f"not started while GPU {gpu} is unhealthy"


# The MPS active thread percentages gpud takes (a job's, a device's default): what
# nvidia-cuda-mps-control takes, (0, 100] in whole percent (gpud.mps.protocol.check_percent).
# The most is every SM of the device: all the shares of the MPS clients on one device add
# up to at most that too (placement and admission keep that sum).
MIN_THREADS_PERCENT = 1
MAX_THREADS_PERCENT = 100

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
TIB = 1024 * GIB

# The longest drain a request may ask for: one day. The daemon refuses more; gpuctl says so
# before asking, and ``mig.drain_timeout_s`` may not exceed it.
MAX_DRAIN_SECONDS = 24 * 3600.0

# The largest mig-parted file gpuctl sends, the API takes or gpud reads (real ones are a few
# KiB): it fits in one API request with room to spare.
MAX_LAYOUT_BYTES = 128 * 1024
# The longest name of a config in one (``mig apply/assert/export -c``)
MAX_CONFIG_NAME = 256
# The longest start of an event kind a listing or a watch is filtered by
MAX_KIND_PREFIX = 256

# The p99 latency SLOs a service may declare. Under 10 µs none can be met: a GPU request
# as its client times it (a kernel launch, its completion seen by the host) takes some
# microseconds alone, and the co-location loop reads a median under a microsecond as a timer
# that read nothing (gpud.colo.service.MIN_MEDIAN_LATENCY_S), while an M/M/1 p99 is
# ln 100 / ln 2 = 6.6 medians: a shorter SLO is one whose service it could never measure.
# Over an hour is no online service's SLO: a unit mistake.
MIN_SLO_MS = 0.01
MAX_SLO_MS = 3_600_000.0
# The peak load, in requests/s, an inference service may declare (``colo advise
# --peak-load`` and the API field behind it): more is a mistake, or a unit.
MAX_PEAK_LOAD = 1e7
# The contention-free iteration times a progress report may declare (``net report --ideal``
# and the API field behind it): from netshaper.progress.MIN_ITERATION_S (no iteration is
# shorter; equal by a unit test, as gpuctl imports no netshaper) to a day (more is a unit
# mistake).
MIN_IDEAL_S = 1e-6
MAX_IDEAL_S = 86400.0
# The longest session a progress report may name (``net report --session``; gpud.client
# sends 16 hex digits).
MAX_SESSION_CHARS = 64
# Who a job is for, free text shown by `gpuctl jobs ls` and the queue's listings
# (gpud.shared.check_owner; gpuctl's --owner checks it before asking gpud anything).
MAX_OWNER = 128

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_FACTORS = {"": 1, "k": KIB, "m": MIB, "g": GIB, "t": TIB}


def parse_size(text: str, *, field: str = "memory") -> int:
    """Bytes from ``20GiB``, ``20G``, ``20gb``, ``512MiB``, ``1.5G`` or a plain byte count.

    Binary units throughout: MPS's own ``G`` means GiB, and so does gpud's.
    """
    match = _SIZE.match(text)
    if match is None:
        match = _SIZE.match(text.strip().removeprefix("-"))
        if match is None:
            raise InvalidArgument(f"{text!r} is not a size like 20GiB or 512MiB", field=field)
        if float(match.group(1)) > 0:
            raise InvalidArgument(f"{text!r}: a size cannot be negative", field=field)
        # -0 is 0, refused as 0 is below
    number, unit, _ = match.groups()
    value = float(number) * _FACTORS[unit.lower()]
    if value <= 0:
        raise InvalidArgument(f"{text!r} must be more than zero", field=field)
    if value >= 2**63:
        raise InvalidArgument(f"{text!r} is more than any device holds", field=field)
    return int(value)


def format_number(value: float) -> str:
    """``value`` as short as ``:g`` writes it when that is exact (``0.01``, ``1e+07``),
    else with every digit it has (``3600001``, ``1.0000001``): a range check that refuses
    3600001 ms must not say "3.6e+06 ms", which reads as inside the range it names."""
    if isinstance(value, int):
        return str(value)
    short = f"{value:g}"
    if math.isnan(value) or float(short) == value:
        return short
    return repr(float(value)).removesuffix(".0")


def check_slo_ms(value: float, *, field: str = "slo_p99_ms") -> float:
    """``value``, a p99 latency SLO in milliseconds, when it is one a service can be held
    to (:data:`MIN_SLO_MS` up to :data:`MAX_SLO_MS`); else :class:`InvalidArgument`
    naming ``field`` and the range. NaN, infinities, zero and negatives are refused."""
    if not MIN_SLO_MS <= value <= MAX_SLO_MS:  # NaN is in no range
        raise InvalidArgument(
            f"{format_number(value)} ms is outside {MIN_SLO_MS:g}..{MAX_SLO_MS:.0f} ms"
            " (a p99 latency SLO: 10 microseconds up to an hour)",
            field=field,
        )
    return value


def check_owner(owner: str, *, field: str = "owner") -> str:
    """A job's owner: one line of printable text (:func:`check_text`, :data:`MAX_OWNER`):
    an escape sequence or a newline in an owner would rewrite the terminal or the table of
    whoever lists the jobs."""
    return check_text(owner, field=field, max_len=MAX_OWNER)


def check_text(value: str, *, field: str, max_len: int) -> str:
    """``value``, free text a request carries, when it is one line of at most ``max_len``
    printable characters; else :class:`InvalidArgument` naming ``field``. A control
    character (a newline, an escape sequence, NUL) or another unprintable one (a
    right-to-left override) would rewrite what a log line or a terminal shows."""
    if len(value) > max_len:
        raise InvalidArgument(f"longer than {max_len} characters", field=field)
    for i, char in enumerate(value):
        if not char.isprintable():
            raise InvalidArgument(
                f"{char!r} at character {i + 1}: only printable characters are taken",
                field=field,
            )
    return value


def check_kind_prefix(prefix: str, *, field: str = "kind_prefix") -> str:
    """``prefix``, the start of the event kinds a listing or a watch keeps, when some kind
    could start with it: at most :data:`MAX_KIND_PREFIX` printable characters
    (:func:`check_text`). Kinds are printable (``gpu.lost``): an unprintable character in
    the prefix matches no event, and the listing would be empty without saying why (a watch
    would wait for ever)."""
    return check_text(prefix, field=field, max_len=MAX_KIND_PREFIX)


def check_config_name(name: str, *, field: str) -> str:
    """``name``, of a config in a mig-parted file, when ``mig apply``, ``mig assert`` and
    ``mig export`` can take it: one line of at most :data:`MAX_CONFIG_NAME` printable
    characters (:func:`check_text`). It is a key of the YAML export writes, and goes into
    gpud's state database, its events and log, and the ``gpuctl mig apply -c NAME`` line
    that says how to finish an interrupted apply: a newline there would split the line."""
    return check_text(name, field=field, max_len=MAX_CONFIG_NAME)


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


def shell_exports(env: Mapping[str, str]) -> str:
    """``export NAME='value'`` lines, quoted for POSIX shells, sorted by name."""
    lines = []
    for name in sorted(env):
        value = env[name].replace("'", "'\\''")
        lines.append(f"export {name}='{value}'")
    return "\n".join(lines) + "\n"


def read_small_text(path: Path, limit: int) -> str:
    """The UTF-8 text of ``path`` (``-``: standard input), read no further than ``limit``
    bytes, so that ``/dev/zero`` or a disk image named by mistake fails at once. Raises
    ``OSError`` when it cannot be read, ``ValueError`` (with the reason) when it is larger
    than ``limit`` or not UTF-8 text. A named pipe is taken (``<(...)``): see
    :func:`read_regular` for files that must be regular."""
    try:
        if str(path) == "-":
            if sys.stdin is None:  # started with standard input closed (`<&-`)
                raise OSError(errno.EBADF, "standard input is closed")
            raw = _capped(sys.stdin.buffer.read(limit + 1), limit, limit + 1)
        else:
            raw = _read_limited(path, limit, regular=False)
    except OSError as err:
        if err.errno != errno.EFBIG:
            raise
        raise ValueError(f"larger than {limit // 1024} KiB: not a file of this kind") from None
    return utf8_text(raw)


def utf8_text(raw: bytes) -> str:
    """``raw`` decoded as UTF-8; ValueError ``not UTF-8 text (byte N)``, naming the first
    byte that is not, when it is not."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"not UTF-8 text (byte {err.start})") from None


# /dev/null's device numbers: the Linux memory devices' major 1, minor 3 ("null" in
# Documentation/admin-guide/devices.txt), whatever name or link reaches it
DEV_NULL = (1, 3)


def read_regular(path: Path, limit: int, *, kind: str = "a file of this kind") -> bytes:
    """The bytes of ``path``, refusing what is not a regular file: a named pipe nobody
    writes to would block start-up, or a reload, for ever; a device such as /dev/zero never
    ends. /dev/null is the exception: it reads empty (``gpud --config /dev/null``: no
    settings). A file over ``limit`` bytes is refused unread (``OSError`` EFBIG, whose
    ``strerror`` gives the size, the limit and ``kind``, what may hold that much)."""
    return _read_limited(path, limit, regular=True, kind=kind)


def _read_limited(
    path: Path, limit: int, *, regular: bool, kind: str = "a file of this kind"
) -> bytes:
    # O_NONBLOCK: opening a named pipe nobody writes to would wait forever
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if regular:
            if stat.S_ISDIR(st.st_mode):
                raise OSError(errno.EISDIR, os.strerror(errno.EISDIR))
            if (
                stat.S_ISCHR(st.st_mode)
                and (os.major(st.st_rdev), os.minor(st.st_rdev)) == DEV_NULL
            ):
                return b""
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
        else:
            # once open, reads block again, so a pipe with a writer (`<(...)`) is read whole
            # and one without reads as empty
            os.set_blocking(fd, True)
        if stat.S_ISREG(st.st_mode) and st.st_size > limit:
            raise _too_big(st.st_size, limit, kind)  # refused unread
        # not more than the limit, should it grow meanwhile (or a /proc file, of size 0)
        return _capped(fh.read(limit + 1), limit, st.st_size, kind)


def _capped(raw: bytes, limit: int, size: int, kind: str = "a file of this kind") -> bytes:
    if len(raw) > limit:
        raise _too_big(max(size, len(raw)), limit, kind)
    return raw


def _too_big(size: int, limit: int, kind: str) -> OSError:
    return OSError(
        errno.EFBIG,
        f"{size} bytes, more than {kind} may hold ({limit >> 10} KiB): is it the right file?",
    )


# WatchEvents sends (WATCHING_KEY, "1") as its initial metadata once the watch is set up
WATCHING_KEY = "gpud-watching"

# The fields that name a device by UUID: a GPU's or MIG device's (``uuid``), a MIG device's
# GPU and the MIG device itself (``gpu_uuid``, ``mig_uuid``: as the metrics label them), a
# MIG device's UUID before it was re-created (``previous_uuid``).
UUID_FIELDS = ("uuid", "gpu_uuid", "mig_uuid", "previous_uuid")


def names_an_event_gpu(gpu: str) -> bool:
    """Whether ``gpu`` (stripped) can name a GPU in the event log: an index or a GPU or MIG
    device UUID. Anything else matches no event, and a filter of it would list nothing, as
    if the GPU had no history."""
    return (gpu.isascii() and gpu.isdigit()) or gpu.startswith(("GPU-", "MIG-"))


def is_about(fields: dict[str, Any], *, gpu: str = "", job: str = "") -> bool:
    """Whether an event with ``fields`` is about GPU ``gpu`` (its NVML index, or a GPU or
    MIG device UUID; "": any) and job ``job`` ("": any). A job matches ``job``, or one of
    the ``names`` an event about many jobs lists (``net.untagged``), or of the ``jobs`` an
    event about a device lists (those holding it: ``mps.restart``, ``mps.start_skipped``). An index matches ``gpu``
    (a MIG device's event carries its GPU's index), the GPUs of ``mig.apply``'s ``gpus``
    and those a run's ``gpus`` lists (``job.reserve``, ``job.release``,
    ``admission.start``); a UUID matches any UUID field and the ``devices`` a run reserved.
    Events written before a field was added (an older events.jsonl) match by the fields
    they have."""
    if job and fields.get("job") != job:
        # net.untagged's `jobs` is a count, not names: only a list of them names a job
        named = (fields.get("names"), fields.get("jobs"))
        if not any(isinstance(n, list | tuple) and job in n for n in named):
            return False
    if not gpu:
        return True
    if gpu.isascii() and gpu.isdigit():  # "²".isdigit() too, which int() refuses
        index = int(gpu)
        if fields.get("gpu") == index and not isinstance(fields.get("gpu"), bool):
            return True
        per_gpu = fields.get("gpus")
        if isinstance(per_gpu, list):  # a run's GPUs: indexes
            return index in per_gpu
        # mig.apply: {index: outcome}, its keys strings once read back from the file
        return isinstance(per_gpu, dict) and (index in per_gpu or str(index) in per_gpu)
    if any(fields.get(name) == gpu for name in UUID_FIELDS):
        return True
    devices = fields.get("devices")
    return isinstance(devices, list) and gpu in devices


def first_few(items: Iterable[object], shown: int) -> str:
    """The first ``shown`` of ``items``, comma-separated, and ", ..." after them when
    there are more: a message naming hundreds of jobs or PIDs would bury what it says."""
    listed = list(items)
    return ", ".join(map(str, listed[:shown])) + (", ..." if len(listed) > shown else "")


def shown(text: str, most: int) -> str:
    """``text`` quoted as a message repeats it: its first ``most`` characters and its
    length when it is longer (a value of 100000 characters would bury the reason)."""
    if len(text) <= most:
        return repr(text)
    return f"{text[:most]!r}... ({len(text)} characters)"


def user_name(uid: int) -> str:
    """The name ``pwd`` gives ``uid``, else the number."""
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


def user_names() -> Callable[[int], str]:
    """:func:`user_name`, each UID asked once: a listing names the user of every entry,
    mostly the same few (an unknown UID costs a scan of the user database each time)."""
    names: dict[int, str] = {}

    def name_of(uid: int) -> str:
        name = names.get(uid)
        if name is None:
            name = names[uid] = user_name(uid)
        return name

    return name_of
