"""The runner of the admission passes that freed devices and leaves ask for."""

from __future__ import annotations

import threading

import pytest

from gpud.admission.passes import PassRunner


def test_a_failing_pass_is_logged_and_the_next_ask_runs_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs: list[int] = []

    def fails_once() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("boom")

    passes = PassRunner(fails_once)
    passes.ask()
    assert passes.drain(10)
    assert "admission pass failed" in caplog.text
    passes.ask()
    assert passes.drain(10)
    assert len(runs) == 2
    passes.close(10)


def test_no_thread_is_left_once_idle_or_closed() -> None:
    running, go = threading.Event(), threading.Event()
    runs: list[int] = []

    def held() -> None:
        runs.append(1)
        running.set()
        go.wait(10)

    passes = PassRunner(held, name="gpud-admission-test")
    passes.ask()
    assert running.wait(10)
    passes.ask()  # would run once more, but the stop comes first
    passes.close(0)  # the stop, not waiting
    go.set()
    passes.close(10)
    passes.ask()  # closed: ignored
    assert passes.drain(1)
    assert len(runs) == 1
    assert not [t for t in threading.enumerate() if t.name == "gpud-admission-test"]
