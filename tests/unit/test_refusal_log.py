"""Refusals the peer API logs once each: what is remembered stays bounded."""

from __future__ import annotations

from gpud.api.interceptors import ONCE_KEEP, _Once


def test_a_method_that_keeps_failing_with_new_messages_remembers_a_bounded_number() -> None:
    once = _Once()
    for i in range(10 * ONCE_KEEP):  # each refusal names another job
        assert once.first("/gpud.v1.Peer/Report", f"job 'j{i}' is not on GPU-{i}")
    assert len(once) == ONCE_KEEP


def test_a_refusal_repeated_among_new_ones_is_still_logged_once() -> None:
    once = _Once(keep=4)
    assert once.first("/m", "steady")
    for i in range(20):
        assert once.first("/m", f"varying {i}")
        assert not once.first("/m", "steady")  # retried every tick: said once
    assert len(once) == 4
    assert once.first("/m", "varying 0")  # forgotten long ago: said again


def test_a_success_forgets_its_methods_refusals_only() -> None:
    once = _Once()
    once.first("/a", "x")
    once.first("/b", "y")
    once.succeeded("/a")
    assert once.first("/a", "x")
    assert not once.first("/b", "y")
