"""Water-filling with priorities and minimum shares; the fluid bound's progressive filling."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tools.netsim.bound import progressive_fill
from tools.netsim.fluid import allocate, waterfill


def test_single_link_is_shared_per_flow() -> None:
    assert waterfill([[0], [0]], [1, 3], [100.0]) == [25.0, 25.0]


def test_classic_max_min_example() -> None:
    # Flow 0 crosses both links; flows 1 and 2 use one each; link 1 is small.
    rates = waterfill([[0, 1], [0], [1]], [1, 1, 1], [10.0, 4.0])
    assert rates == pytest.approx([2.0, 8.0, 2.0])


def test_strict_priority_without_shares() -> None:
    rates = allocate([[0], [0]], [1, 1], [1, 0], [100.0])
    assert rates == pytest.approx([0.0, 100.0])


def test_minimum_shares_are_honoured() -> None:
    rates = allocate([[0], [0]], [1, 1], [1, 0], [100.0], shares=(0.1, 0.2))
    assert rates == pytest.approx([20.0, 80.0])


def test_unused_guarantee_goes_to_others() -> None:
    # Level 0's flow is capped by link 1, so its share of link 0 is lent out.
    rates = allocate([[0, 1], [0]], [1, 1], [0, 1], [100.0, 5.0], shares=(0.5, 0.1))
    assert rates == pytest.approx([5.0, 95.0])


def test_single_level_is_plain_max_min() -> None:
    paths = [[0, 1], [0], [1]]
    assert allocate(paths, [1, 1, 1], [3, 3, 3], [10.0, 4.0], shares=(0.5,) * 4) == pytest.approx(
        waterfill(paths, [1, 1, 1], [10.0, 4.0])
    )


@settings(max_examples=60, deadline=None)
@given(
    flows=st.lists(
        st.tuples(
            st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True),
            st.integers(1, 4),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=10,
    ),
    caps=st.lists(st.floats(1.0, 100.0), min_size=4, max_size=4),
    share=st.sampled_from([0.0, 0.05, 0.2]),
)
def test_allocation_is_feasible_and_work_conserving(
    flows: list[tuple[list[int], int, int]], caps: list[float], share: float
) -> None:
    paths = [f[0] for f in flows]
    weights = [float(f[1]) for f in flows]
    levels = [f[2] for f in flows]
    rates = allocate(paths, weights, levels, caps, shares=(share,) * 4)
    load = [0.0] * 4
    for p, w, r in zip(paths, weights, rates, strict=True):
        assert r >= 0
        for link in p:
            load[link] += w * r
    for link in range(4):
        assert load[link] <= caps[link] * (1 + 1e-9)
    # Work conservation: every flow crosses at least one full link.
    for p in paths:
        assert any(load[link] >= caps[link] * (1 - 1e-6) for link in p)


def test_progressive_fill_caps_at_one_and_splits_links() -> None:
    rates = progressive_fill({"a": {"l": 5.0}, "b": {"l": 10.0}}, {"l": 10.0})
    assert rates == pytest.approx({"a": 10 / 15, "b": 10 / 15})
    assert progressive_fill({"a": {"l": 1.0}}, {"l": 10.0}) == {"a": 1.0}


def test_progressive_fill_gives_leftovers_to_unconstrained_jobs() -> None:
    rates = progressive_fill(
        {"a": {"x": 10.0, "y": 10.0}, "b": {"x": 10.0}, "c": {"y": 2.0}}, {"x": 10.0, "y": 100.0}
    )
    assert rates == pytest.approx({"a": 0.5, "b": 0.5, "c": 1.0})
