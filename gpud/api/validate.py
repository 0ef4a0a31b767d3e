"""Request validation shared by the servicers: each check raises ``InvalidArgument`` naming
the field, which the error interceptor turns into ``INVALID_ARGUMENT``.

Protobuf cannot say "non-negative", "finite" or "one of these" for every field, and proto3
keeps unknown enum numbers as plain ints, so every servicer validates what it reads.

Sizes are bounded before any servicer sees a request: gRPC refuses a message over
:data:`MAX_REQUEST_BYTES` (``RESOURCE_EXHAUSTED``) without decoding it, and
:func:`request_bounds`, run by the error interceptor on every decoded request of every
service, refuses a string longer than :data:`MAX_STRING_CHARS` or a repeated field with more
than :data:`MAX_REPEATED` entries, unless :data:`FIELD_LIMITS` names a wider bound for that
field. A new field is bounded without anyone having to remember it. :data:`TOTAL_LIMITS`
bounds a field summed over one request (the critical XIDs of all the jobs of a node's
report), so that each entry within its own bound does not add up to millions.
"""

from __future__ import annotations

import math
from typing import Any

from gpud.errors import InvalidArgument, NotFound
from gpud.jobs.registry import check_name
from gpud.mps.procs import PID_MAX
from gpud.shared import (
    CLUSTER_MAX_JOBS,
    CLUSTER_MAX_REPORT_GPUS,
    CLUSTER_MAX_REPORT_XIDS,
    CLUSTER_MAX_XIDS,
    MAX_LAYOUT_BYTES,
    MAX_XID,
)

# The largest request gRPC accepts: a mig-parted config file for a whole cluster is some KiB.
MAX_REQUEST_BYTES = 256 * 1024
# Names, UUIDs, profiles, paths: every string field of every request, unless listed below.
MAX_STRING_CHARS = 4096
# Devices of a job, ...: every repeated (and map) field of every request.
MAX_REPEATED = 256
# Other bounds by full field name: characters for a string field, entries for a repeated or
# map one (whose entries keep the default bounds).
FIELD_LIMITS: dict[str, int] = {
    "gpud.v1.MigConfigSource.text": MAX_LAYOUT_BYTES,  # the file's content
    # a second's latencies of a busy service: gpud.client.Latency sends up to 4096 at once
    "gpud.v1.ReportLatencyRequest.seconds": 4096,
    # a node's report to the cluster leader, checked to these by gpud.cluster.convert
    "gpud.v1.ReportRequest.jobs": CLUSTER_MAX_JOBS,
    "gpud.v1.GetOrderRequest.jobs": CLUSTER_MAX_JOBS,
    "gpud.v1.JobReport.critical_xids": CLUSTER_MAX_XIDS,
}
# Entries a repeated field may have summed over one request (a field of a repeated message),
# counted as the walk reaches them, so that a request past the sum is refused having walked
# no more than it: a node's report to the cluster leader, whose jobs each stay within their
# own bound, may not reach them all at once (gpud.shared.CLUSTER_MAX_REPORT_XIDS says why).
TOTAL_LIMITS: dict[str, int] = {
    "gpud.v1.JobReport.critical_xids": CLUSTER_MAX_REPORT_XIDS,
    "gpud.v1.JobReport.gpus": CLUSTER_MAX_REPORT_GPUS,
    "gpud.v1.JobReport.unhealthy_gpus": CLUSTER_MAX_REPORT_GPUS,
    "gpud.v1.JobReport.xids": CLUSTER_MAX_REPORT_GPUS,
}

# Job names, by full field name, and the field their servicer's refusal names: one over the
# bound is refused as any other name that breaks the name rule, saying the rule, not the
# bound (fields named "job" or "jobs" are job names too, named by their path)
JOB_NAME_FIELDS: dict[str, str] = {
    "gpud.v1.Job.name": "name",
    "gpud.v1.RemoveJobRequest.name": "name",
    "gpud.v1.ListJobsRequest.name": "name",
}

_TYPE_STRING = 9  # FieldDescriptor.TYPE_STRING
_TYPE_BYTES = 12  # FieldDescriptor.TYPE_BYTES
_TYPE_MESSAGE = 11  # FieldDescriptor.TYPE_MESSAGE


def request_bounds(message: Any, prefix: str = "") -> None:
    """Every string and bytes field of ``message`` (at any depth) within its length bound,
    every repeated and map field within its count bound, and the fields of
    :data:`TOTAL_LIMITS` within theirs summed over the request; ``InvalidArgument`` names
    the field's path (``job.devices[3]``) otherwise."""
    _walk(message, prefix, {})


def _walk(message: Any, prefix: str, totals: dict[str, int]) -> None:
    for fd, value in message.ListFields():
        path = f"{prefix}{fd.name}"
        limit = FIELD_LIMITS.get(fd.full_name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            _count(len(value), limit, path)
            value_fd = fd.message_type.fields_by_name["value"]
            for key, item in value.items():
                _scalar(fd.message_type.fields_by_name["key"], key, None, f"{path}[{key!r}]")
                _item(value_fd, item, None, f"{path}[{key!r}]", totals)
        elif fd.is_repeated:
            _count(len(value), limit, path)
            if (most := TOTAL_LIMITS.get(fd.full_name)) is not None:
                _total(fd, len(value), most, path, totals)
            for i, item in enumerate(value):  # the entries get the default bounds
                _item(fd, item, None, f"{path}[{i}]", totals)
        else:
            _item(fd, value, limit, path, totals)


def _total(fd: Any, n: int, most: int, path: str, totals: dict[str, int]) -> None:
    total = totals[fd.full_name] = totals.get(fd.full_name, 0) + n
    if total > most:
        raise InvalidArgument(
            f"brings the request's {fd.name} to {total} entries, more than {most} in all",
            field=path,
        )


def _count(n: int, limit: int | None, path: str) -> None:
    most = MAX_REPEATED if limit is None else limit
    if n > most:
        raise InvalidArgument(f"has {n} entries, more than {most}", field=path)


def _item(fd: Any, value: Any, limit: int | None, path: str, totals: dict[str, int]) -> None:
    if fd.type == _TYPE_MESSAGE:
        _walk(value, f"{path}.", totals)
    else:
        _scalar(fd, value, limit, path)


def _scalar(fd: Any, value: Any, limit: int | None, path: str) -> None:
    if fd.type in (_TYPE_STRING, _TYPE_BYTES):
        most = MAX_STRING_CHARS if limit is None else limit
        if len(value) > most:
            if fd.full_name in JOB_NAME_FIELDS or fd.name in ("job", "jobs"):
                check_name(value, field=JOB_NAME_FIELDS.get(fd.full_name, path))
            unit = "characters" if fd.type == _TYPE_STRING else "bytes"
            raise InvalidArgument(f"is {len(value)} {unit} long, more than {most}", field=path)


def gpu_index(value: int, gpu_count: int, *, field: str = "gpu") -> int:
    """``value`` is an existing GPU index on a node with ``gpu_count`` GPUs.

    A negative index is malformed (``InvalidArgument``); one the node does not have is an
    unknown GPU, ``NotFound`` (exit 4) as in every command that names a GPU.
    """
    if value < 0:
        raise InvalidArgument(f"must be a GPU index >= 0, got {value}", field=field)
    if value >= gpu_count:
        have = f"0..{gpu_count - 1}" if gpu_count else "none"
        raise NotFound(f"{field}: no GPU {value} on this node (it has {gpu_count}: {have})")
    return value


def non_negative_seconds(value: float, *, field: str = "seconds") -> float:
    """A finite duration >= 0 (NaN and infinity are refused: they would hang a timer)."""
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"must be a finite number of seconds >= 0, got {value}", field=field)
    return value


def xid_code(value: int, *, field: str = "xid") -> int:
    """An XID code gpud takes: ``1..MAX_XID``, as ``telemetry.ignored_xids`` does."""
    if not 0 < value <= MAX_XID:
        raise InvalidArgument(f"must be an XID code in 1..{MAX_XID}, got {value}", field=field)
    return value


def int_range(value: int, low: int, high: int, *, field: str) -> int:
    """``low <= value <= high``."""
    if not low <= value <= high:
        raise InvalidArgument(f"must be in [{low}, {high}], got {value}", field=field)
    return value


def optional_pid(message: Any, field: str) -> int | None:
    """A proto3 ``optional`` PID field: None when unset, else a number Linux could give a
    process. A holder PID is persisted and checked every tick, so one out of range is refused
    here rather than failing each tick after it."""
    value = optional(message, field)
    if value is not None and not 0 < value <= PID_MAX:
        raise InvalidArgument(f"must be a PID in 1..{PID_MAX}, got {value}", field=field)
    return value  # type: ignore[no-any-return]


def non_empty(value: str, *, field: str, max_len: int = 256) -> str:
    """A non-empty, reasonably short string."""
    if not value:
        raise InvalidArgument("must not be empty", field=field)
    if len(value) > max_len:
        raise InvalidArgument(f"longer than {max_len} characters", field=field)
    return value


# A caller's request id (ReserveRequest.request_id): a uuid4 is 36 characters.
MAX_REQUEST_ID = 128


def request_id(value: str, *, field: str = "request_id") -> str:
    """A caller's request id: empty (none), or up to :data:`MAX_REQUEST_ID` printable ASCII
    characters; it is kept in the state database and said in refusals and logs."""
    if len(value) > MAX_REQUEST_ID:
        raise InvalidArgument(f"longer than {MAX_REQUEST_ID} characters", field=field)
    if not all(" " < c <= "~" for c in value):
        raise InvalidArgument("printable ASCII without spaces only (a uuid4, for one)", field=field)
    return value


def optional(message: Any, field: str) -> Any:
    """A proto3 ``optional`` field's value, or None when the request does not set it."""
    return getattr(message, field) if message.HasField(field) else None
