"""Leveller: a first re-rank is the plain greedy order, whatever the rates and pins."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from netshaper import Leveller, LevellerConfig, rank_levels

_rates = st.dictionaries(
    st.text("abcdef", min_size=1, max_size=3),
    st.none()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0.0, -0.0, 1.0, 0.5])
    | st.integers(-2, 2),
    max_size=30,
)


def _clamped(r: float | None, unknown: float) -> float:
    return min(1.0, max(0.0, unknown if r is None else r))


@settings(max_examples=300, deadline=None)
@given(
    _rates,
    st.integers(2, 8),
    st.sampled_from([0.0, 0.5, 1.0]),
    st.dictionaries(st.text("abcdef", min_size=1, max_size=3), st.integers(0, 7), max_size=4),
    st.sets(st.text("abcdef", min_size=1, max_size=3), max_size=3),
)
def test_a_first_rerank_is_the_greedy_order_by_clamped_rate_then_id(
    rates: dict[str, float | None],
    k: int,
    unknown: float,
    pins: dict[str, int],
    excluded: set[str],
) -> None:
    lv = Leveller(LevellerConfig(levels=k, unknown_rate=unknown))
    for job, level in pins.items():
        lv.pin(job, level % k)
    for job in excluded:
        lv.exclude(job)
    a = lv.update(0.0, rates)
    eff = {j: _clamped(r, unknown) for j, r in rates.items() if j not in excluded}
    assert a.rates == eff
    assert list(a.rates) == sorted(eff)
    pinned = {j: lv % k for j, lv in pins.items() if j in eff}
    free = sorted((r, j) for j, r in eff.items() if j not in pinned)
    expected = rank_levels([j for _, j in free], k) | pinned
    assert list(a.levels.items()) == sorted(expected.items())
    assert a.excluded == frozenset(excluded & set(rates))
