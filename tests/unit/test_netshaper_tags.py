"""Stable DSCP tags per job."""

from __future__ import annotations

import pytest

from netshaper import TagAllocator, TagsExhausted, nccl_ib_tc, tos
from netshaper.tags import DEFAULT_RESERVED


def test_tags_are_stable_and_avoid_reserved_codepoints() -> None:
    a = TagAllocator()
    b = TagAllocator()
    ids = [f"job-{i}" for i in range(40)]
    tags = [a.tag(j) for j in ids]
    assert tags == [b.tag(j) for j in ids]
    assert len(set(tags)) == len(tags)
    assert not set(tags) & DEFAULT_RESERVED
    assert a.tag("job-3") == tags[3]


def test_release_frees_the_tag_and_restore_keeps_it() -> None:
    a = TagAllocator()
    t = a.tag("x")
    assert a.owner(t) == "x"
    a.release("x")
    a.release("x")
    assert a.owner(t) is None
    restored = TagAllocator(existing={"y": 10})
    assert restored.tag("y") == 10
    assert restored.allocations() == {"y": 10}


def test_restore_rejects_reserved_or_duplicate_tags() -> None:
    with pytest.raises(ValueError):
        TagAllocator(existing={"y": 46})
    with pytest.raises(ValueError):
        TagAllocator(existing={"y": 10, "z": 10})


def test_exhaustion_raises_with_the_job() -> None:
    a = TagAllocator(reserved=[d for d in range(64) if d not in (10, 12)])
    a.tag("p")
    a.tag("q")
    with pytest.raises(TagsExhausted) as info:
        a.tag("r")
    assert info.value.job_id == "r"


def test_nccl_traffic_class_is_dscp_times_four() -> None:
    assert nccl_ib_tc(26) == 104
    assert tos(46) == 184
    with pytest.raises(ValueError):
        nccl_ib_tc(64)
