"""Demand weights: relative to the largest demand, rounded, never zero (unit + property)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from netshaper.weights import demand_weights


def test_weights_follow_demand() -> None:
    w = demand_weights({"heavy": 40e6, "solo": 32e6, "light": 16e6, "new": 0.0})
    assert w == {"heavy": 1.0, "solo": 26 / 32, "light": 13 / 32}
    assert demand_weights({}) == {} and demand_weights({"a": math.nan}) == {}
    with pytest.raises(ValueError):
        demand_weights({"a": 1.0}, steps=0)


@given(st.dictionaries(st.text("abc", min_size=1, max_size=2), st.floats(1e-3, 1e12), min_size=1))
def test_weights_are_in_range_and_monotone(demand: dict[str, float]) -> None:
    w = demand_weights(demand)
    assert set(w) == set(demand) and max(w.values()) == 1.0
    assert all(1 / 32 <= x <= 1 for x in w.values())
    for a, da in demand.items():
        for b, db in demand.items():
            if da <= db:
                assert w[a] <= w[b]
