"""Refusals the peer API logs once each: what is remembered stays bounded."""

from __future__ import annotations

import logging

import pytest

from gpud.api.interceptors import ONCE_KEEP, ONCE_SUMMARY_S, _Once


def test_a_method_that_keeps_failing_with_new_messages_remembers_a_bounded_number() -> None:
    once = _Once()
    said = [
        once.first("/gpud.v1.Peer/Report", f"job 'j{i}' is not on GPU-{i}")
        for i in range(10 * ONCE_KEEP)
    ]  # each refusal names another job
    assert len(once) == ONCE_KEEP
    # each said until one was forgotten (the one that forgot it too), then held back
    assert said == [True] * (ONCE_KEEP + 1) + [False] * (9 * ONCE_KEEP - 1)


def test_a_refusal_repeated_among_new_ones_is_still_logged_once() -> None:
    once = _Once(keep=4)
    assert once.first("/m", "steady")
    for i in range(20):
        assert once.first("/m", f"varying {i}") == (i < 4)  # held back once one is forgotten
        assert not once.first("/m", "steady")  # retried every tick: said once
    assert len(once) == 4
    once.succeeded("/m")
    assert once.first("/m", "varying 0")  # a success: said again


def test_a_success_forgets_its_methods_refusals_only() -> None:
    once = _Once()
    once.first("/a", "x")
    once.first("/b", "y")
    once.succeeded("/a")
    assert once.first("/a", "x")
    assert not once.first("/b", "y")


def test_callers_cycling_through_more_refusals_than_are_remembered_get_one_line_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [1000.0]
    once = _Once(keep=4, clock=lambda: now[0])
    messages = [f"job 'j{i}' is not on GPU-{i}" for i in range(5)]
    assert all(once.first("/m", m) for m in messages)  # each said once
    with caplog.at_level(logging.INFO, logger="gpud.api.interceptors"):
        # each comes back just after it was forgotten: none is said again
        assert not any(once.first("/m", m) for m in messages)
        assert caplog.messages == []
        now[0] += ONCE_SUMMARY_S
        assert not once.first("/m", messages[0])
        assert not any(once.first("/m", m) for m in messages[1:])
    assert caplog.messages == [
        "6 more refusals of /m not logged since its refusals outgrew the 4 remembered, 60 s ago"
    ]


def test_a_success_says_the_refusals_held_back_and_logs_each_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [1000.0]
    once = _Once(keep=2, clock=lambda: now[0])
    for m in ("a", "b", "c", "d"):
        once.first("/m", m)  # c forgets a: d is held back
    now[0] += 5
    with caplog.at_level(logging.INFO, logger="gpud.api.interceptors"):
        once.succeeded("/m")
    assert caplog.messages == [
        "1 more refusals of /m not logged since its refusals outgrew the 2 remembered, 5 s ago"
    ]
    assert once.first("/m", "a")  # afresh: each said once again
    assert len(once) == 1


def test_another_methods_success_leaves_the_remembered_refusals_alone() -> None:
    once = _Once(keep=4)
    once.first("/a", "x")
    once.succeeded("/b")
    assert not once.first("/a", "x")
