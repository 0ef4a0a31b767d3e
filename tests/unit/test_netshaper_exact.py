"""Exact values and edges of the netshaper policies: the messages of refused settings, the
hysteresis band at its very edges, the sliding window's trimming, what re-ranks and what not.

The property tests (test_netshaper_leveller.py, test_netshaper_progress.py) guard the
guarantees; these pin the arithmetic the guarantees leave free, so that a changed operator
or constant shows (tools/mutation.py).
"""

from __future__ import annotations

import pytest

from netshaper import LevellerConfig, ProgressConfig, ProgressTracker
from netshaper.leveller import Leveller
from netshaper.tags import DSCP_MAX, TagAllocator, TagsExhausted, nccl_ib_tc

# -- leveller: settings ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"levels": 1}, r"^levels must be in \[2, 8\], got 1$"),
        ({"levels": 9}, r"^levels must be in \[2, 8\], got 9$"),
        ({"threshold": -0.5}, r"^threshold must be >= 0, got -0.5$"),
        ({"max_age_s": 0.0}, r"^max_age_s must be > 0, got 0.0$"),
        ({"hysteresis": 1.0}, r"^hysteresis must be in \[0, 1\), got 1.0$"),
        ({"hysteresis": -0.1}, r"^hysteresis must be in \[0, 1\), got -0.1$"),
        ({"unknown_rate": 1.5}, r"^unknown_rate must be in \[0, 1\], got 1.5$"),
        ({"levels": 2, "min_share": (0.6, 0.5)}, r"^min_share must be >= 0 and sum to <= 1, "),
        ({"levels": 2, "min_share": (0.5, -0.1)}, r"^min_share must be >= 0 and sum to <= 1, "),
        ({"levels": 2, "min_share": (0.5,)}, r"^min_share has 1 entries for 2 levels$"),
    ],
)
def test_refused_settings_say_why(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LevellerConfig(**kwargs)  # type: ignore[arg-type]


def test_settings_at_their_edges_are_accepted() -> None:
    assert LevellerConfig(levels=2).levels == 2
    assert LevellerConfig(levels=8, min_share=0.125).shares() == (0.125,) * 8  # sums to 1
    assert LevellerConfig(levels=4, min_share=(0.25, 0.25, 0.25, 0.25)).shares()[3] == 0.25
    assert LevellerConfig(threshold=0.0, hysteresis=0.0, unknown_rate=1.0).unknown_rate == 1.0


# -- leveller: what an update reports --------------------------------------------------------


def test_an_assignment_carries_its_time_rates_and_changes() -> None:
    lv = Leveller(LevellerConfig(levels=2, threshold=0.0, hysteresis=0.0, min_share=0.0))
    assert lv.last is None and lv.total_changes == 0
    out = lv.update(3.0, {"a": 0.2, "b": 1.5, "c": None})
    assert out.at == 3.0
    assert out.rates == {"a": 0.2, "b": 1.0, "c": 0.0}  # clamped into [0, 1]; unknown: 0
    assert out.reranked is True and out.changes == 0
    assert lv.last == out
    again = lv.update(4.0, {"a": 0.2, "b": 1.5, "c": None})
    assert again.reranked is False and again.changes == 0
    swapped = lv.update(5.0, {"a": 0.9, "b": 0.1, "c": None})
    swapped_again = lv.update(6.0, {"a": 0.1, "b": 0.9, "c": None})
    assert swapped.changes == 2 and swapped_again.changes == 2
    assert lv.total_changes == 4  # summed over the updates


def test_max_age_rerank_counts_from_the_last_rerank() -> None:
    lv = Leveller(LevellerConfig(levels=2, threshold=1.0, max_age_s=5.0, hysteresis=0.0))
    rates = {"a": 0.5, "b": 0.6}
    assert lv.update(10.0, rates).reranked
    assert not lv.update(12.0, rates).reranked  # 2 s after the rerank at 10 s
    assert not lv.update(14.9, rates).reranked
    assert lv.update(15.0, rates).reranked  # exactly max_age_s


def test_the_threshold_is_exclusive() -> None:
    lv = Leveller(LevellerConfig(levels=2, threshold=0.5, max_age_s=100.0, hysteresis=0.0))
    lv.update(0.0, {"a": 0.5, "b": 0.25})
    assert not lv.update(1.0, {"a": 0.75, "b": 0.25}).reranked  # moved exactly 50 %
    assert lv.update(2.0, {"a": 0.76, "b": 0.25}).reranked


def test_pins_and_exclusions_force_a_rerank_only_when_they_change_something() -> None:
    lv = Leveller(LevellerConfig(levels=2, threshold=1.0, max_age_s=100.0, hysteresis=0.0))
    rates = {"a": 0.2, "b": 0.8}
    lv.update(0.0, rates)
    lv.pin("a", 1)
    assert lv.update(1.0, rates).reranked and lv.last is not None
    assert lv.last.levels["a"] == 1
    lv.pin("a", 1)  # the same pin again: nothing to redo
    assert not lv.update(2.0, rates).reranked
    lv.unpin("b")  # was not pinned
    assert not lv.update(3.0, rates).reranked
    lv.unpin("a")
    assert lv.update(4.0, rates).reranked
    lv.exclude("b")
    assert lv.update(5.0, rates).reranked
    lv.exclude("b")
    assert not lv.update(6.0, rates).reranked
    lv.include("b")
    assert lv.update(7.0, rates).reranked
    lv.include("b")
    assert not lv.update(8.0, rates).reranked
    with pytest.raises(ValueError, match=r"^a: level must be in \[0, 2\), got 2$"):
        lv.pin("a", 2)


# -- leveller: the hysteresis band at its edges (h = 0.5, values exact in binary) ------------


def _two_updates(first: dict[str, float], second: dict[str, float]) -> dict[str, int]:
    lv = Leveller(LevellerConfig(levels=2, threshold=0.0, hysteresis=0.5, min_share=0.0))
    lv.update(0.0, first)
    return dict(lv.update(1.0, second).levels)


def test_a_job_at_the_lower_edge_of_its_band_keeps_its_level() -> None:
    first = {"a": 0.25, "b": 0.5, "c": 0.75, "d": 1.0}  # {a, b} at level 0, {c, d} at 1
    # c drops to 0.25: a fresh ranking puts {c, a} at 0 and {b, d} at 1, whose lowest rate
    # is 0.5; c, at exactly 0.5 * (1 - 0.5), is inside the band of its old level 1 and
    # keeps it by swapping with b, which fits level 0's band (0.5 <= 0.375 * 1.5)
    assert _two_updates(first, {"a": 0.375, "b": 0.5, "c": 0.25, "d": 1.0}) == {
        "a": 0, "b": 0, "c": 1, "d": 1,
    }  # fmt: skip
    # just below the band, it moves
    assert _two_updates(first, {"a": 0.375, "b": 0.5, "c": 0.2421875, "d": 1.0}) == {
        "a": 0, "b": 1, "c": 0, "d": 1,
    }  # fmt: skip


def test_a_job_at_the_upper_edge_of_its_band_keeps_its_level() -> None:
    first = {"a": 0.125, "b": 0.25, "c": 0.5, "d": 0.75}
    # fresh: {a, c} at 0 with top 0.25, {b, d} at 1; b at exactly 0.25 * 1.5 stays at 0
    assert _two_updates(first, {"a": 0.125, "b": 0.375, "c": 0.25, "d": 0.75}) == {
        "a": 0, "b": 0, "c": 1, "d": 1,
    }  # fmt: skip
    assert _two_updates(first, {"a": 0.125, "b": 0.38, "c": 0.25, "d": 0.75})["b"] == 1


# -- progress ---------------------------------------------------------------------------------


def test_progress_settings_and_reports_are_checked() -> None:
    assert ProgressConfig(window_s=0.5).window_s == 0.5
    with pytest.raises(ValueError, match=r"^window_s must be > 0, got 0$"):
        ProgressConfig(window_s=0)
    tr = ProgressTracker()
    with pytest.raises(ValueError, match=r"^a: ideal_s must be > 0, got 0.0$"):
        tr.register("a", now=0.0, ideal_s=0.0)
    with pytest.raises(ValueError, match=r"^a: iteration must be >= 0, got -1$"):
        tr.report("a", -1, 0.0)


def test_registering_again_keeps_what_was_learned() -> None:
    tr = ProgressTracker()
    tr.register("a", now=0.0, ideal_s=2.0)
    assert tr.progress("a", 5.0).rate == pytest.approx(0.4)  # stalled since registration
    tr.report("a", 0, 10.0)
    tr.report("a", 4, 18.0)
    tr.register("a", now=20.0)  # no ideal: the declared one stays
    p = tr.progress("a", 18.0)
    assert (p.ideal_s, p.iterations, p.period_s) == (2.0, 4, 2.0)
    tr.register("a", now=21.0, ideal_s=1.0)
    assert tr.progress("a", 18.0).ideal_s == 1.0


def test_the_learned_ideal_is_the_time_per_iteration_between_reports() -> None:
    tr = ProgressTracker()
    tr.report("a", 0, 10.0)
    tr.report("a", 2, 14.0)
    assert tr.progress("a", 14.0).ideal_s == 2.0


def test_repeats_and_same_instant_reports() -> None:
    tr = ProgressTracker()
    tr.report("a", 0, 0.0)
    tr.report("a", 1, 1.0)
    tr.report("a", 1, 5.0)  # the same count again later: no progress, ignored
    assert tr.progress("a", 5.0).period_s == 1.0 and tr.progress("a", 5.0).restarts == 0
    tr.report("a", 2, 1.0)  # a batch stamped with the same instant still counts
    assert tr.progress("a", 1.0).iterations == 2


def test_restarts_are_counted() -> None:
    tr = ProgressTracker()
    for restart in range(2):
        tr.report("a", 5, 10.0 * restart + 1)
        tr.report("a", 0, 10.0 * restart + 2)
    assert tr.progress("a", 30.0).restarts == 2


@pytest.mark.parametrize(
    ("window", "least", "reports", "period"),
    [
        (1.0, 1, [(0, 0.0), (1, 1.0), (2, 2.0), (3, 10.0)], 8.0),  # trimmed to the last two
        (1.0, 1, [(0, 0.0), (1, 3.0), (2, 4.0)], 1.0),  # exactly one window back: trimmed
        (10.0, 1, [(0, 0.0), (1, 5.0), (2, 6.0)], 3.0),  # within the window: all kept
        (1.0, 2, [(0, 0.0), (1, 1.0), (2, 2.0), (3, 10.0)], 4.5),  # two iterations kept
        (1.0, 2, [(0, 0.0), (1, 1.0), (3, 3.0)], 1.0),  # one report covers two: trimmed
    ],
)
def test_the_window_trims_points_a_whole_window_old(
    window: float, least: int, reports: list[tuple[int, float]], period: float
) -> None:
    tr = ProgressTracker(ProgressConfig(window_s=window, min_iterations=least))
    for n, t in reports:
        tr.report("a", n, t)
    assert tr.progress("a", reports[-1][1]).period_s == pytest.approx(period)


# -- tags -------------------------------------------------------------------------------------


def test_tag_errors_say_why() -> None:
    err = TagsExhausted("j", 3)
    assert str(err) == "j: all 3 DSCP tags are in use" and err.pool_size == 3
    assert err.job_id == "j"
    with pytest.raises(ValueError, match=r"^DSCP must be in \[0, 63\], got 64$"):
        nccl_ib_tc(64)
    with pytest.raises(ValueError, match=r"^every DSCP codepoint is reserved$"):
        TagAllocator(reserved=range(DSCP_MAX + 1))


def test_the_whole_dscp_range_is_in_the_pool() -> None:
    pool = TagAllocator(reserved=()).pool
    assert pool[0] == 0 and pool[-1] == DSCP_MAX and len(pool) == 64


def test_progress_at_the_edges_of_a_stall() -> None:
    tr = ProgressTracker()
    tr.register("a", now=0.0, ideal_s=0.25)
    assert tr.progress("a", 0.25).rate is None  # exactly one ideal iteration: not slow yet
    assert tr.progress("a", 0.5).rate == 0.5  # stalled twice the ideal, no period yet
    tr.report("a", 0, 1.0)
    tr.report("a", 2, 2.0)  # 0.5 s per iteration
    p = tr.progress("a", 2.0)
    assert (p.job_id, p.rate, p.period_s) == ("a", 0.5, 0.5)


def test_rates_of_some_jobs() -> None:
    tr = ProgressTracker()
    tr.register("a", now=0.0, ideal_s=1.0)
    tr.register("b", now=0.0, ideal_s=1.0)
    assert tr.rates(4.0, ["b"]) == {"b": 0.25}
    assert tr.rates(4.0) == {"a": 0.25, "b": 0.25}


def test_restored_tags_are_checked_and_probing_goes_forward() -> None:
    with pytest.raises(ValueError, match=r"^a: DSCP 8 is reserved or out of range$"):
        TagAllocator(existing={"a": 8})
    with pytest.raises(ValueError, match=r"^b: DSCP 10 is already held by a$"):
        TagAllocator(existing={"a": 10, "b": 10})
    alloc = TagAllocator()
    pool = alloc.pool
    # two jobs whose hashes pick the same slot: the second takes the next one up
    import zlib

    by_slot: dict[int, str] = {}
    for i in range(10_000):
        job = f"job-{i}"
        slot = zlib.crc32(job.encode()) % len(pool)
        if slot in by_slot and slot + 1 < len(pool):
            first, second = by_slot[slot], job
            break
        by_slot.setdefault(slot, job)
    assert alloc.tag(first) == pool[slot]
    assert alloc.tag(second) == pool[slot + 1]
    one_left = TagAllocator(reserved=[d for d in range(DSCP_MAX + 1) if d != 5])
    assert one_left.tag("x") == 5
    with pytest.raises(TagsExhausted) as err:
        one_left.tag("y")
    assert err.value.pool_size == 1
