"""colocate.interference: the predictor's learned state as a dict, and back, exactly."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colocate import InterferencePredictor, JobFeatures
from colocate.interference import PRIOR_WEIGHTS, SCANT_MEMORY_S

unit = st.floats(0.0, 1.0)
features = st.builds(
    JobFeatures,
    sm=unit,
    mem_bw=unit,
    pcie=unit,
    nvlink=unit,
    mem_frac=unit,
    host_cpu=unit,
    rss_frac=unit,
    presence=unit,
    key=st.sampled_from(["", "resnet", "bert", "llm"]),
)
observation = st.tuples(features, st.lists(features, min_size=1, max_size=3), st.floats(0.05, 1.2))

PROBES = [
    (JobFeatures(0.5, 0.3, key="resnet"), [JobFeatures(0.4, 0.6, key="bert")]),
    (JobFeatures(0.9, 0.2, pcie=0.6, key="llm"), [JobFeatures(0.3, 0.3, pcie=0.7)]),
    (
        JobFeatures(0.2, 0.1, key="bert"),
        [JobFeatures(0.5, 0.5, key="resnet"), JobFeatures(0.6, 0.2, key="llm")],
    ),
]


def same_predictions(a: InterferencePredictor, b: InterferencePredictor) -> None:
    for me, others in PROBES:
        assert a.speed(me, others) == b.speed(me, others)
        for q in (0.5, 0.9):
            assert a.speed_bound(me, others, q) == b.speed_bound(me, others, q)
    assert a.margins(0.9) == b.margins(0.9) and a.stats() == b.stats()


@settings(max_examples=40, deadline=None)
@given(st.lists(observation, max_size=80), observation)
def test_round_trip_through_json_predicts_and_learns_the_same(
    history: list[tuple[JobFeatures, list[JobFeatures], float]],
    later: tuple[JobFeatures, list[JobFeatures], float],
) -> None:
    p = InterferencePredictor()
    for me, others, speed in history:
        p.observe(me, others, speed)
    for me, others in PROBES:
        p.margin(me, others, 0.9)  # fill the cached quantiles: they are state too
    saved = json.loads(json.dumps(p.to_dict(), allow_nan=False))
    q = InterferencePredictor.from_dict(saved)
    assert q.to_dict() == p.to_dict()
    same_predictions(p, q)
    p.observe(*later)  # and they go on learning alike
    q.observe(*later)
    same_predictions(p, q)


def learned() -> dict[str, Any]:
    p = InterferencePredictor()
    for i in range(40):
        me = JobFeatures(0.3 + i % 5 * 0.1, 0.2, key="resnet")
        p.observe(me, [JobFeatures(0.5, 0.4, key="bert")], 0.7 + i % 3 * 0.05)
        p.advance(0.25)
    return p.to_dict()


def test_errors_keep_their_times_and_an_older_state_has_every_error_fresh() -> None:
    p = InterferencePredictor(scant_memory_s=100.0)
    a, b = JobFeatures(0.3, 0.2, key="a"), JobFeatures(0.3, 0.2, key="b")
    p.observe(a, [b], 0.5)
    p.advance(60)
    kept = p.margins()
    saved = p.to_dict()
    q = InterferencePredictor.from_dict(json.loads(json.dumps(saved)))
    q.advance(41)  # 101 s after the error: forgotten, as by the one that saved it
    p.advance(41)
    assert q.to_dict() == p.to_dict() and p.margins() == {}
    # A file from before errors had times: the clock starts there, every error is fresh.
    for key in ("clock_s", "stamps"):
        del saved[key]
    del saved["params"]["scant_memory_s"]
    old = InterferencePredictor.from_dict(saved)
    assert old.margins() == kept and old.scant_memory_s == SCANT_MEMORY_S  # the default
    old.advance(SCANT_MEMORY_S - 1)
    assert old.margins() == kept
    old.scant_memory_s = 0.0  # as gpud's [colocate] scant_margin_memory_s = 0 sets it
    old.advance(10**6)
    assert old.margins() == kept
    old.scant_memory_s = 100.0
    old.advance(1)
    assert old.margins() == {}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(kind="something.Else"), "kind"),
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.update(weights=d["weights"][:-1]), "weights: 7 items, 8 expected"),
        (lambda d: d["weights"].__setitem__(0, "x"), "weights[0]"),
        (lambda d: d["p"][2].__setitem__(1, float("nan")), "p[2][1]"),
        (lambda d: d.update(samples=True), "samples"),
        (lambda d: d.update(samples=-1), "samples"),
        (lambda d: d["params"].update(forgetting=1.5), "params.forgetting"),
        (lambda d: d["pairs"].append(["", "bert", 0.1, 1]), "pairs[1]"),
        (lambda d: d["pairs"].append(list(d["pairs"][0])), "given twice"),
        (lambda d: d["residuals"].append([]), "residuals: 4 items, 3 expected"),
        (lambda d: d["residuals"][0].extend([0.0] * 401), "the window is 400"),
        (lambda d: d.pop("quantiles"), "quantiles"),
        (lambda d: d["params"].update(scant_memory_s=-1), "params.scant_memory_s"),
        (lambda d: d.update(clock_s=-1.0), "clock_s"),
        (lambda d: d["stamps"][1].pop(), "stamps[1]: 28 items, 29 expected"),
        (lambda d: d["stamps"][1].__setitem__(0, 99.0), "stamps[1][0]"),
        (lambda d: d["stamps"][1].__setitem__(0, 10.0), "stamps[1]: the times of the errors"),
    ],
)
def test_a_state_that_does_not_validate_names_the_field(change: Any, message: str) -> None:
    state = learned()
    InterferencePredictor.from_dict(state)  # the original is fine
    change(state)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        InterferencePredictor.from_dict(state)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_anything_else_is_a_value_error(value: object) -> None:
    with pytest.raises(ValueError):
        InterferencePredictor.from_dict(value)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(sorted(learned())), json_values)
def test_a_field_replaced_by_anything_is_restored_or_refused(field: str, value: object) -> None:
    state = learned()
    state[field] = value
    try:
        p = InterferencePredictor.from_dict(state)
    except ValueError:
        return
    assert len(p.weights) == len(PRIOR_WEIGHTS)
