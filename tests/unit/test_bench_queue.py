"""tools/bench_queue's arguments: a mistaken one is refused before any gpud starts, naming
what was wrong."""

from __future__ import annotations

import pytest

from tools.bench_queue import main


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as stopped:
        main(list(argv))
    assert stopped.value.code == 2
    return capsys.readouterr().err


def test_an_enqueue_size_that_is_no_number_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "--enqueues", "10,x")
    assert "--enqueues: 'x' is not a queue size" in err, err
    assert "Traceback" not in err


def test_an_enqueue_size_over_the_queue_limit_names_the_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = refused(capsys, "--enqueues", "10,1001")
    assert "1001" in err and "admission.max_queue = 1000" in err, err


@pytest.mark.parametrize("other", [["--waiters", "200"], ["--runs", "5"], ["--leavers", "3"]])
def test_enqueues_mixed_with_another_benchmark_are_refused(
    capsys: pytest.CaptureFixture[str], other: list[str]
) -> None:
    err = refused(capsys, "--enqueues", "10", *other)
    assert f"--enqueues and {other[0]}" in err, err
