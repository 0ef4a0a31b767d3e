"""tools/bench_api runs end to end (briefly): both servers answer every method."""

from __future__ import annotations

from tools.bench_api import METHODS, _table, measure


def test_the_api_benchmark_measures_gpud_and_the_floor() -> None:
    result = measure(clients=2, seconds=0.3)
    for target in ("gpud", "floor"):
        for phase in ("alone", "loaded"):
            for method in METHODS:
                figures = result[target][phase][method]
                assert figures["calls"] > 0 and 0 < figures["p50_ms"] <= figures["p99_ms"]
    assert "ratio" in _table(result)
