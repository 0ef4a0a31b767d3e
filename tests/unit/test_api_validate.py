"""Every bound of gpud.api.validate at its edges: the last value in, the first value out."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from gpud.api import validate
from gpud.errors import InvalidArgument, NotFound
from gpud.v1 import jobs_pb2, mig_pb2, node_pb2


def test_gpu_index_edges() -> None:
    assert validate.gpu_index(0, 1) == 0
    assert validate.gpu_index(7, 8) == 7
    with pytest.raises(NotFound, match=r"^gpu: no GPU 8 on this node \(it has 8: 0\.\.7\)$"):
        validate.gpu_index(8, 8)
    with pytest.raises(NotFound, match=r"it has 0: none"):
        validate.gpu_index(0, 0)
    with pytest.raises(InvalidArgument, match=r"^dev: must be a GPU index >= 0, got -1$"):
        validate.gpu_index(-1, 8, field="dev")


def test_non_negative_seconds_edges() -> None:
    assert validate.non_negative_seconds(0.0) == 0.0
    assert validate.non_negative_seconds(1e9, field="t") == 1e9
    for bad in (-1e-9, -math.inf, math.inf, math.nan):
        with pytest.raises(InvalidArgument, match=r"^t: must be a finite number of seconds"):
            validate.non_negative_seconds(bad, field="t")


@pytest.mark.parametrize(("low", "high"), [(0, 0), (0, 10_000), (1, 100), (-5, 5)])
def test_int_range_edges(low: int, high: int) -> None:
    assert validate.int_range(low, low, high, field="n") == low
    assert validate.int_range(high, low, high, field="n") == high
    for bad in (low - 1, high + 1):
        with pytest.raises(InvalidArgument, match=rf"^n: must be in \[{low}, {high}\], got {bad}$"):
            validate.int_range(bad, low, high, field="n")


def test_non_empty_edges() -> None:
    assert validate.non_empty("x", field="f") == "x"
    assert validate.non_empty("x" * 256, field="f") == "x" * 256
    assert validate.non_empty("x" * 10, field="f", max_len=10) == "x" * 10
    with pytest.raises(InvalidArgument, match=r"^f: longer than 256 characters$"):
        validate.non_empty("x" * 257, field="f")
    with pytest.raises(InvalidArgument, match=r"^f: longer than 10 characters$"):
        validate.non_empty("x" * 11, field="f", max_len=10)
    with pytest.raises(InvalidArgument, match=r"^f: must not be empty$"):
        validate.non_empty("", field="f")


def test_optional_tells_unset_from_zero() -> None:
    assert validate.optional(jobs_pb2.ReserveRequest(), "gpu_count") is None
    assert validate.optional(jobs_pb2.ReserveRequest(gpu_count=0), "gpu_count") == 0


# --- request_bounds: every string and repeated field of every request ---

MAX_S = validate.MAX_STRING_CHARS
MAX_R = validate.MAX_REPEATED


def test_strings_at_the_bound_pass_and_one_more_is_refused() -> None:
    validate.request_bounds(mig_pb2.MigConfigSource(name="x" * MAX_S))
    with pytest.raises(
        InvalidArgument, match=rf"^name: is {MAX_S + 1} characters long, more than {MAX_S}$"
    ):
        validate.request_bounds(mig_pb2.MigConfigSource(name="x" * (MAX_S + 1)))


NAME_RULE = "letters, digits, '_', '.', '-' (up to 63, starting alphanumeric)"


@pytest.mark.parametrize(
    ("request_of", "field"),
    [
        (lambda name: jobs_pb2.AddJobRequest(job=jobs_pb2.Job(name=name)), "name"),
        (lambda name: jobs_pb2.RemoveJobRequest(name=name), "name"),
        (lambda name: jobs_pb2.GetJobEnvRequest(job=name), "job"),
    ],
)
def test_a_job_name_over_the_bound_is_refused_as_other_names_are_saying_the_rule(
    request_of: Callable[[str], Any], field: str
) -> None:
    """As ``gpuctl jobs add 'a b'`` is: ``name: 'a b': letters, ...``, the name cut short."""
    with pytest.raises(InvalidArgument) as err:
        validate.request_bounds(request_of("x" * 100_000))
    assert str(err.value) == f"{field}: {'x' * 63!r}... (100000 characters): {NAME_RULE}"


def test_nested_and_repeated_strings_are_named_by_path() -> None:
    job = jobs_pb2.Job(name="a", devices=["GPU-1", "x" * (MAX_S + 1)])
    with pytest.raises(InvalidArgument, match=r"^job\.devices\[1\]: is 4097 characters"):
        validate.request_bounds(jobs_pb2.AddJobRequest(job=job))
    deep = jobs_pb2.Job(name="a", reservations=[jobs_pb2.JobReservation(id="y" * (MAX_S + 1))])
    with pytest.raises(InvalidArgument, match=r"^job\.reservations\[0\]\.id: "):
        validate.request_bounds(jobs_pb2.AddJobRequest(job=deep))


def test_repeated_counts_at_the_bound_pass_and_one_more_is_refused() -> None:
    validate.request_bounds(jobs_pb2.ReserveRequest(job="a", devices=["d"] * MAX_R))
    with pytest.raises(
        InvalidArgument, match=rf"^devices: has {MAX_R + 1} entries, more than {MAX_R}$"
    ):
        validate.request_bounds(jobs_pb2.ReserveRequest(job="a", devices=["d"] * (MAX_R + 1)))
    many = [jobs_pb2.JobProcess(pid=i) for i in range(MAX_R + 1)]
    with pytest.raises(InvalidArgument, match=r"^job\.processes: has 257 entries"):
        validate.request_bounds(jobs_pb2.AddJobRequest(job=jobs_pb2.Job(name="a", processes=many)))


def test_map_fields_are_bounded_in_count_and_in_keys_and_values() -> None:
    ok = jobs_pb2.GetJobEnvResponse(env={f"K{i}": "v" for i in range(MAX_R)})
    validate.request_bounds(ok)
    with pytest.raises(InvalidArgument, match=r"^env: has 257 entries"):
        validate.request_bounds(jobs_pb2.GetJobEnvResponse(env={f"K{i}": "v" for i in range(257)}))
    with pytest.raises(InvalidArgument, match=r"^env\['K'\]: is 4097 characters"):
        validate.request_bounds(jobs_pb2.GetJobEnvResponse(env={"K": "v" * (MAX_S + 1)}))
    with pytest.raises(InvalidArgument, match=r"^env\['kkk"):
        validate.request_bounds(jobs_pb2.GetJobEnvResponse(env={"k" * (MAX_S + 1): "v"}))


def test_a_field_limit_widens_one_field_only() -> None:
    text_max = validate.FIELD_LIMITS["gpud.v1.MigConfigSource.text"]
    assert text_max > MAX_S
    source = mig_pb2.MigConfigSource(text="x" * text_max, path="p" * MAX_S)
    validate.request_bounds(mig_pb2.ApplyMigRequest(config=source))
    source.text += "x"
    with pytest.raises(InvalidArgument, match=rf"^config\.text: is {text_max + 1} characters"):
        validate.request_bounds(mig_pb2.ApplyMigRequest(config=source))
    source.text, source.path = "", "p" * (MAX_S + 1)
    with pytest.raises(InvalidArgument, match=r"^config\.path: "):
        validate.request_bounds(mig_pb2.ApplyMigRequest(config=source))


def test_unset_and_numeric_fields_pass() -> None:
    validate.request_bounds(node_pb2.GetStatusRequest())
    validate.request_bounds(node_pb2.InjectFaultRequest(gpu=2**31 - 1, seconds=1e300, xid=79))


def test_a_request_fits_the_size_bound_with_its_largest_field() -> None:
    # the largest config text, with every other field at its bound, still fits one request
    source = mig_pb2.MigConfigSource(
        text="x" * validate.FIELD_LIMITS["gpud.v1.MigConfigSource.text"],
        path="p" * MAX_S,
        name="n" * MAX_S,
    )
    size = mig_pb2.ApplyMigRequest(config=source, timeout_seconds=1.0).ByteSize()
    assert size <= validate.MAX_REQUEST_BYTES


def test_a_field_limit_on_a_repeated_or_map_field_bounds_its_entries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(validate.FIELD_LIMITS, "gpud.v1.ReserveRequest.devices", 2)
    monkeypatch.setitem(validate.FIELD_LIMITS, "gpud.v1.GetJobEnvResponse.env", 1)
    validate.request_bounds(jobs_pb2.ReserveRequest(devices=["a", "x" * MAX_S]))
    with pytest.raises(InvalidArgument, match=r"^devices: has 3 entries, more than 2$"):
        validate.request_bounds(jobs_pb2.ReserveRequest(devices=["a", "b", "c"]))
    with pytest.raises(InvalidArgument, match=r"^env: has 2 entries, more than 1$"):
        validate.request_bounds(jobs_pb2.GetJobEnvResponse(env={"A": "1", "B": "2"}))


def test_bytes_fields_are_bounded_in_bytes() -> None:
    from google.protobuf import wrappers_pb2

    validate.request_bounds(wrappers_pb2.BytesValue(value=b"x" * MAX_S))
    with pytest.raises(InvalidArgument, match=rf"^value: is {MAX_S + 1} bytes long, more than"):
        validate.request_bounds(wrappers_pb2.BytesValue(value=b"x" * (MAX_S + 1)))


def test_seconds_name_their_field_by_default() -> None:
    with pytest.raises(InvalidArgument, match=r"^seconds: "):
        validate.non_negative_seconds(-1.0)
