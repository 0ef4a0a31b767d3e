"""colocate: shapes, prices, predictor, guard and planner, without I/O."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from colocate import (
    GpuView,
    GuardAction,
    GuardParams,
    InterferencePredictor,
    JobFeatures,
    JobKind,
    JobView,
    MigMemory,
    MigOption,
    Option,
    Planner,
    PlannerParams,
    ServiceGuard,
    ShadowPrices,
    Shape,
)
from colocate.planner import Plan
from colocate.shapes import PRIOR_SERVICE_TIME_S, Curve, prior_service_rate

GIB = 1 << 30


def training(
    job_id: str,
    *,
    sm: float = 0.3,
    bw: float = 0.2,
    mem_gib: float = 10,
    gpu: int | None = None,
    order: float = 0,
    used_gib: float = 0,
) -> JobView:
    shape = Shape.prior(
        job_id, JobKind.TRAINING, memory_bytes=int(mem_gib * GIB), knee=sm, bw_intensity=bw
    )
    return JobView(
        job_id=job_id,
        shape=shape,
        features=JobFeatures(sm=sm, mem_bw=bw),
        gpu=gpu,
        order=order,
        memory_used=int(used_gib * GIB),
    )


def inference(job_id: str, *, slo_s: float, peak: float, gpu: int | None = None) -> JobView:
    shape = Shape.prior(
        job_id,
        JobKind.INFERENCE,
        memory_bytes=20 * GIB,
        peak=400.0,
        knee=0.6,
        bw_intensity=0.4,
        slo_s=slo_s,
    )
    return JobView(
        job_id=job_id,
        shape=shape,
        features=JobFeatures(sm=0.6, mem_bw=0.4),
        gpu=gpu,
        load=peak / 2,
        peak_load=peak,
        sm_share=1.0,
    )


def gpus(n: int, mem_gib: int = 80) -> list[GpuView]:
    return [GpuView(index=i, memory_total=mem_gib * GIB) for i in range(n)]


# -- shapes ---------------------------------------------------------------------------------
def test_curve_saturates_at_knee() -> None:
    c = Curve(peak=10.0, knee=0.5)
    assert c.perf(0.5) == 10.0 == c.perf(1.0)
    assert 0 < c.perf(0.25) < 10.0
    assert c.perf(0.0) == 0.0


def test_prior_is_conservative_and_refinement_finds_the_knee() -> None:
    s = Shape.prior("j", JobKind.TRAINING, memory_bytes=GIB)
    assert s.curve.knee == 1.0  # unknown: needs the whole GPU
    truth = Curve(peak=5.0, knee=0.4)
    for _ in range(10):
        for share in (0.25, 0.5, 0.75, 1.0):
            s.observe(share, truth.perf(share))
    assert abs(s.curve.knee - 0.4) < 0.051
    assert abs(s.curve.peak - 5.0) < 0.5


def test_inference_perf_is_load_within_slo() -> None:
    s = Shape.prior("i", JobKind.INFERENCE, memory_bytes=GIB, peak=100.0, knee=1.0, slo_s=0.1)
    # mu = 100/s, p99 = ln(100)/(mu - lambda) <= 0.1 s  ->  lambda <= 100 - 46.05
    assert math.isclose(s.perf(1.0), 100.0 - math.log(100) / 0.1)
    assert s.share_for_load(10.0) < 1.0


def test_memory_reservation_tracks_observed_peak() -> None:
    s = Shape.prior("j", JobKind.TRAINING, memory_bytes=10 * GIB)
    assert s.reserve_bytes() == int(10 * GIB * 1.15)
    s.observe_memory(20 * GIB)
    assert s.reserve_bytes() == int(20 * GIB * 1.15)


def test_configs_include_mig_profiles_that_hold_the_job() -> None:
    s = Shape.prior("i", JobKind.INFERENCE, memory_bytes=8 * GIB, peak=100.0, slo_s=0.5)
    migs = (MigOption("1g.10gb", 1 / 7, 10 * GIB), MigOption("1g.5gb", 1 / 7, 5 * GIB))
    cs = s.configs(mig=migs)
    assert [c.mig_profile for c in cs if c.mig_profile] == ["1g.10gb"]


# -- interference ---------------------------------------------------------------------------
def test_predictor_orders_pairs_and_learns() -> None:
    p = InterferencePredictor()
    light = JobFeatures(sm=0.2, mem_bw=0.1)
    heavy = JobFeatures(sm=0.9, mem_bw=0.8)
    assert p.speed(light, []) == 1.0
    assert p.speed(light, [light]) > p.speed(heavy, [heavy])
    # The truth is harsher than the prior for heavy pairs: the error falls as it learns.
    truth = 0.35
    first = abs(p.speed(heavy, [heavy]) - truth)
    for _ in range(200):
        p.observe(heavy, [heavy], truth)
        p.observe(light, [light], 0.95)
    assert abs(p.speed(heavy, [heavy]) - truth) < first / 3
    assert p.stats().samples == 400
    assert p.stats().mean_abs_error < first


def test_pair_corrections_learn_what_the_features_miss() -> None:
    # Two neighbours with the same footprint, one of which thrashes the job's cache: only
    # the job classes tell them apart.
    p = InterferencePredictor()
    me = JobFeatures(sm=0.3, mem_bw=0.3, key="a")
    kind = JobFeatures(sm=0.3, mem_bw=0.3, key="b")
    harsh = JobFeatures(sm=0.3, mem_bw=0.3, key="c")
    for _ in range(300):
        p.observe(me, [kind], 0.85)
        p.observe(me, [harsh], 0.55)
    assert abs(p.speed(me, [kind]) - 0.85) < 0.05
    assert abs(p.speed(me, [harsh]) - 0.55) < 0.05
    # Without classes nothing is learned per pair: one average for both.
    anon = JobFeatures(sm=0.3, mem_bw=0.3)
    assert p.speed(anon, [anon]) == p.speed(anon, [JobFeatures(sm=0.3, mem_bw=0.3)])


def test_margin_is_larger_for_pairs_never_seen() -> None:
    p = InterferencePredictor()
    # Every new pair of classes is off by a hidden amount the first time it is seen; a pair
    # seen often is predicted well.
    for i in range(200):
        a, b = (
            JobFeatures(sm=0.3, mem_bw=0.2, key=f"x{i}"),
            JobFeatures(sm=0.3, mem_bw=0.2, key=f"y{i}"),
        )
        p.observe(a, [b], 0.9 if i % 2 else 0.5)
    known_a = JobFeatures(sm=0.3, mem_bw=0.2, key="k1")
    known_b = JobFeatures(sm=0.3, mem_bw=0.2, key="k2")
    for _ in range(400):
        p.observe(known_a, [known_b], 0.7)
    fresh = JobFeatures(sm=0.3, mem_bw=0.2, key="new")
    unseen = p.margin(fresh, [known_b], 0.9)
    seen = p.margin(known_a, [known_b], 0.9)
    assert seen < 0.05 < unseen
    assert p.speed_bound(known_a, [known_b]) <= p.speed(known_a, [known_b])
    assert p.speed_bound(fresh, [known_b]) < p.speed_bound(known_a, [known_b])


def test_a_margin_on_scant_evidence_is_forgotten_so_new_pairs_are_tried_again() -> None:
    """One bad first pair must not keep every new pair off for good: its error alone makes
    the never-seen margin, and a margin that keeps new pairs off brings no errors to narrow
    it."""
    p = InterferencePredictor(scant_memory_s=1800.0)
    a3c = JobFeatures(sm=0.3, mem_bw=0.2, key="a3c")
    p.observe(a3c, [a3c], 0.44)  # half a log unit under the prior's prediction
    newcomer, other = JobFeatures(sm=0.3, mem_bw=0.2, key="new"), JobFeatures(0.3, 0.2, key="x")
    assert p.margin(newcomer, [other], 0.9) > 0.3
    assert p.margin_errors() == {"0": 1}  # what `gpuctl colo show` says it stands on
    p.advance(1500)
    assert p.margin(newcomer, [other], 0.9) > 0.3
    p.advance(301)
    assert p.margin(newcomer, [other], 0.9) == 0.0
    assert p.margin_errors() == {}
    # What the pair taught the model stays: only the margin's evidence went.
    assert p.speed(a3c, [a3c]) < InterferencePredictor().speed(a3c, [a3c])
    assert p.to_dict()["clock_s"] == 1801.0


def test_a_margin_on_enough_errors_does_not_age() -> None:
    p = InterferencePredictor(scant_memory_s=60.0)
    for i in range(40):
        a, b = JobFeatures(0.3, 0.2, key=f"x{i}"), JobFeatures(0.3, 0.2, key=f"y{i}")
        p.observe(a, [b], 0.5)
    newcomer = JobFeatures(0.3, 0.2, key="new")
    before = p.margin(newcomer, [newcomer], 0.9)
    p.advance(3600)
    assert p.margin(newcomer, [newcomer], 0.9) == before > 0.0


def test_a_scant_memory_of_zero_keeps_every_error() -> None:
    p = InterferencePredictor(scant_memory_s=0.0)
    a3c = JobFeatures(sm=0.3, mem_bw=0.2, key="a3c")
    p.observe(a3c, [a3c], 0.44)
    before = p.margin(JobFeatures(0.3, 0.2, key="new"), [a3c], 0.9)
    for bad in (-5.0, math.nan, math.inf, 1e9):
        p.advance(bad)
    assert p.margin(JobFeatures(0.3, 0.2, key="new"), [a3c], 0.9) == before > 0.3


@settings(max_examples=60, deadline=None)
@given(
    errors=st.lists(st.floats(-0.3, 0.3), min_size=40, max_size=200),
    quantile=st.floats(0.5, 0.95),
)
def test_margin_is_a_quantile_of_recent_errors(errors: list[float], quantile: float) -> None:
    p = InterferencePredictor()
    me, other = JobFeatures(sm=0.2, mem_bw=0.1), JobFeatures(sm=0.2, mem_bw=0.1)
    # Learning moves the prediction, so record the error of each prediction as made.
    seen = []
    for e in errors:
        predicted = p.log_slowdown(me, [other])
        observed = max(0.0, predicted + e)
        seen.append(observed - predicted)
        p.observe(me, [other], math.exp(-observed))
    m = p.margin(me, [other], quantile)
    ranked = sorted(seen[-400:])
    assert m >= 0.0
    assert m <= max(0.0, ranked[-1]) + 1e-9
    below = sum(x <= m + 1e-9 for x in ranked) / len(ranked)
    assert below >= min(quantile, 1.0) - 0.05 or m == 0.0


# -- prices ---------------------------------------------------------------------------------
def _market() -> tuple[dict[str, list[Option]], dict[tuple[int, str], float]]:
    options = {
        f"j{k}": [
            Option(gpu=g, utility=1.0 - 0.1 * g + 0.01 * k, demand={"sm": 0.5, "mem": 0.3})
            for g in range(2)
        ]
        for k in range(6)
    }
    capacity = {(g, r): 1.0 for g in range(2) for r in ("sm", "mem", "bw")}
    return options, capacity


def test_prices_rise_on_overuse_and_settle_on_stationary_input() -> None:
    options, capacity = _market()
    sp = ShadowPrices(max_iterations=200)
    first = sp.solve(options, capacity)
    assert first.prices[(0, "sm")] > 0.0
    again = sp.solve(options, capacity)
    for key, value in again.prices.items():
        assert abs(value - first.prices[key]) < 0.05
    assert again.iterations <= first.iterations


@settings(max_examples=40, deadline=None)
@given(
    utilities=st.lists(st.floats(0.1, 2.0), min_size=1, max_size=10),
    demand=st.floats(0.1, 0.9),
)
def test_prices_settle_property(utilities: list[float], demand: float) -> None:
    options = {
        f"j{i}": [Option(gpu=0, utility=u, demand={"sm": demand})] for i, u in enumerate(utilities)
    }
    capacity = {(0, "sm"): 1.0}
    sp = ShadowPrices(max_iterations=60)
    history = [sp.solve(options, capacity).prices[(0, "sm")] for _ in range(30)]
    tail = history[-5:]
    assert max(tail) - min(tail) < 0.1 * max(1.0, *tail)
    assert all(p >= 0.0 for p in history)


@settings(max_examples=60, deadline=None)
@given(
    jobs=st.lists(
        st.lists(
            st.tuples(st.integers(0, 3), st.floats(0.05, 1.5), st.floats(0.05, 0.9)),
            min_size=1,
            max_size=6,
        ),
        min_size=1,
        max_size=16,
    ),
    caps=st.lists(st.floats(0.0, 1.3), min_size=4, max_size=4),
)
# A price that fell back to 0 kept the long step that brought it down and swung for ever.
@example(jobs=[[(0, 1.0, 0.05)], [(0, 1.0, 0.0546875), (2, 1.5, 0.5)]], caps=[0, 0, 0.03125, 0])
# Two prices' steps halved and regrew in turn around the clearing point, for ever.
@example(jobs=[[(0, 1.0, 0.625)], [(0, 1.0, 0.5), (1, 1.0, 0.625)]], caps=[0.625, 0.5, 0, 0])
@example(
    jobs=[
        [(0, 1.0, 0.578125)],
        [(0, 1.0, 0.5), (2, 1.0, 0.5)],
        [(0, 1.0, 0.5), (0, 1.0, 0.5), (1, 1.0, 0.5546875)],
    ],
    caps=[0.5625, 0.5, 1.0, 0],
)
def test_prices_converge_on_stationary_markets(
    jobs: list[list[tuple[int, float, float]]], caps: list[float]
) -> None:
    options = {
        f"j{i}": [Option(gpu=g, utility=u, demand={"sm": d, "mem": d / 2}) for g, u, d in opts]
        for i, opts in enumerate(jobs)
    }
    capacity = {(g, r): caps[g] for g in range(4) for r in ("sm", "mem")}
    sp = ShadowPrices(max_iterations=400)
    first = sp.solve(options, capacity)
    assert first.converged and first.residual <= sp.tolerance
    assert all(p >= 0.0 for p in first.prices.values())
    # Warm: the same market is settled at once, and its prices stay where they are.
    again = sp.solve(options, capacity)
    assert again.converged and again.iterations == 1
    assert again.prices == first.prices


# -- guard ----------------------------------------------------------------------------------
def test_guard_reacts_within_one_tick_and_recovers_additively() -> None:
    g = ServiceGuard("svc", slo_s=0.1)
    d = g.tick(0.09)  # within 20% of the SLO
    assert d.action is GuardAction.THROTTLE and d.duty == 0.5
    assert g.tick(0.09).duty == 0.25
    r = g.tick(0.01)
    assert r.action is GuardAction.RECOVER and math.isclose(r.duty, 0.35)
    assert g.tick(0.07).action is GuardAction.HOLD


def test_guard_evicts_when_the_slo_cannot_be_held() -> None:
    g = ServiceGuard("svc", slo_s=0.1, params=GuardParams(min_duty=0.1, evict_after=2))
    actions = [g.tick(0.5).action for _ in range(6)]
    assert GuardAction.EVICT in actions
    evict = next(d for d in [g.last] if d is not None)
    assert evict is not None


@settings(max_examples=60, deadline=None)
@given(
    history=st.lists(st.floats(0.0, 0.3), max_size=20),
    breach=st.floats(0.0801, 1.0),
)
def test_guard_reacts_within_one_tick_property(history: list[float], breach: float) -> None:
    g = ServiceGuard("svc", slo_s=0.1)
    for p99 in history:
        g.tick(p99)
    before = g.duty
    d = g.tick(breach)
    assert d.action in (GuardAction.THROTTLE, GuardAction.EVICT)
    assert d.duty < before or d.action is GuardAction.EVICT or before <= g.params.min_duty


# -- planner --------------------------------------------------------------------------------
def test_free_gpu_is_taken_exclusively() -> None:
    planner = Planner(InterferencePredictor())
    jobs = [training("a", gpu=0), training("b", order=1)]
    plan = planner.plan(gpus(2), jobs)
    (p,) = plan.placements
    assert p.gpu == 1 and p.sm_share == 1.0 and "free" in p.reason


def test_light_jobs_share_and_heavy_ones_wait() -> None:
    planner = Planner(InterferencePredictor())
    light = planner.plan(gpus(1), [training("a", gpu=0), training("b", order=1)])
    assert [p.job_id for p in light.placements] == ["b"]
    assert "shares GPU 0" in light.placements[0].reason
    heavy = planner.plan(
        gpus(1),
        [training("a", sm=0.95, bw=0.9, gpu=0), training("b", sm=0.95, bw=0.9, order=1)],
    )
    assert not heavy.placements and "b" in heavy.waiting


@pytest.mark.parametrize(("weight", "placed"), [(0.0, True), (0.75, True), (1.0, False)])
def test_the_gain_weighs_training_speed_by_the_sms_it_keeps_busy(
    weight: float, placed: bool
) -> None:
    # A job that hardly touches the SMs runs almost at full speed beside a busy one: much
    # progress, little GPU work. Counted by SM work alone, sharing is not worth it.
    planner = Planner(InterferencePredictor(), PlannerParams(activity_weight=weight))
    plan = planner.plan(
        gpus(1), [training("busy", sm=0.6, gpu=0), training("idle", sm=0.1, bw=0.02, order=1)]
    )
    assert [p.job_id for p in plan.placements] == (["idle"] if placed else [])
    if not placed:
        assert "gain" in plan.waiting["idle"]


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_activity_weight_is_a_fraction(bad: float) -> None:
    with pytest.raises(ValueError, match="activity_weight"):
        PlannerParams(activity_weight=bad)


def test_a_gpu_is_held_for_a_job_that_waited_long_with_no_option() -> None:
    """A job that needs a GPU alone waits while later jobs keep every GPU partly taken;
    once it has waited ``head_hold_s``, the GPU with the fewest jobs takes no one else, so
    it drains and the job gets it."""
    planner = Planner(InterferencePredictor(), PlannerParams(head_hold_s=600.0))
    residents = [training("a", gpu=0), training("b", gpu=0), training("c", gpu=1)]
    big = training("big", mem_gib=70, order=0)
    small = training("small", order=1)
    fresh = planner.plan(gpus(2), [*residents, big, small])
    assert [(p.job_id, p.gpu) for p in fresh.placements] == [("small", 1)]
    assert "held" not in fresh.waiting["big"]
    big.waited_s = 600.0
    held = planner.plan(gpus(2), [*residents, big, small])
    assert [(p.job_id, p.gpu) for p in held.placements] == [("small", 0)]
    assert held.waiting["big"].startswith("GPU 1 held for it (waited 600 s): ")
    drained = planner.plan(gpus(2), [*residents[:2], big, small])
    assert [(p.job_id, p.gpu) for p in drained.placements] == [("big", 1), ("small", 0)]
    never = Planner(InterferencePredictor())  # by default, only for jobs evicted
    assert never.plan(gpus(2), [*residents, big, small]).placements[0].gpu == 1
    big.evicted = True
    evicted = never.plan(gpus(2), [*residents, big, small])
    assert [(p.job_id, p.gpu) for p in evicted.placements] == [("small", 0)]
    assert evicted.waiting["big"].startswith("GPU 1 held for it (evicted): ")


def test_a_gpu_in_mig_mode_gives_no_whole_gpu_share_and_is_never_held() -> None:
    """A GPU in MIG mode offers its instances alone: training never goes there, even when
    it is empty, and a GPU held for the queue's head is one it could have whole."""
    planner = Planner(InterferencePredictor())
    mig_mode = replace(gpus(1)[0], index=1, whole=False)
    plan = planner.plan([gpus(1)[0], mig_mode], [training("a", gpu=0), training("b", order=1)])
    assert [(p.job_id, p.gpu) for p in plan.placements] == [("b", 0)]
    busy = planner.plan([gpus(1)[0], mig_mode], [training("a", mem_gib=70, gpu=0), training("b")])
    assert not busy.placements
    assert busy.waiting["b"].endswith("; GPU 1: in MIG mode: every instance is taken")
    # Every GPU in MIG mode: waiting would not help (gpuctl run leaves it to the jobs service).
    alone = planner.plan([mig_mode], [training("b")])
    assert alone.waiting["b"].startswith(
        "never fits on this node: every healthy GPU is in MIG mode"
    )
    big = training("big", mem_gib=70, order=0)
    big.evicted = True
    residents = [training("a", gpu=0), training("b", gpu=0)]
    held = planner.plan([gpus(1)[0], mig_mode], [*residents, big, training("small", order=1)])
    assert held.waiting["big"].startswith("GPU 0 held for it (evicted): ")


def test_on_a_gpu_in_mig_mode_a_training_job_takes_an_instance_that_keeps_its_pace() -> None:
    """The smallest free instance where its shape predicts its best speed, never one that
    cuts it below 1 / max_slowdown of its speed on a whole GPU; a free whole GPU first."""
    planner = Planner(InterferencePredictor())
    free = (
        MigOption("1g.10gb", 1 / 7, 10 * GIB),
        MigOption("3g.40gb", 3 / 7, 40 * GIB),
        MigOption("7g.80gb", 1.0, 80 * GIB),
    )
    mig_mode = GpuView(index=1, memory_total=80 * GIB, mig_options=free, whole=False)
    whole = gpus(1)[0]
    full = training("x", mem_gib=70, gpu=0)

    def where(*jobs: JobView, views: tuple[GpuView, ...] = (whole, mig_mode)) -> list[object]:
        plan = planner.plan(list(views), list(jobs))
        return [(p.job_id, p.gpu, p.mig_profile) for p in plan.placements]

    assert where(training("a", sm=1.0)) == [("a", 0, None)]
    assert where(full, training("a", sm=1.0)) == [("a", 1, "7g.80gb")]
    assert where(full, training("a", sm=0.1, mem_gib=8)) == [("a", 1, "1g.10gb")]
    assert where(full, training("a", sm=0.1, mem_gib=20)) == [("a", 1, "3g.40gb")]
    small = replace(mig_mode, mig_options=free[:2])
    (p,) = planner.plan([whole, small], [full, training("a", sm=0.5)]).placements
    assert p.mig_profile == "3g.40gb" and p.reason == (
        "GPU 1 is in MIG mode: MIG instance 3g.40gb, predicted speed 0.88 of its speed on a "
        "whole GPU"
    )
    # 3/7 of the SMs give a job that needs them all 0.49 of its speed: under the cap of 2.
    plan = planner.plan([whole, small], [full, training("a", sm=1.0)])
    assert not plan.placements
    assert plan.waiting["a"].endswith(
        "GPU 1: in MIG mode: no free instance (1g.10gb, 3g.40gb) holds its 11776 MiB and gives "
        "it 1/2 of its speed on a whole GPU"
    )
    lenient = Planner(InterferencePredictor(), PlannerParams(max_slowdown=2.5))
    (p,) = lenient.plan([whole, small], [full, training("a", sm=1.0)]).placements
    assert p.mig_profile == "3g.40gb"


def test_a_mig_instance_refusal_names_the_job_held_at_its_runs_peak() -> None:
    """A job that took 30 GiB in its run and uses 5 GiB now is planned at its peak: no
    free instance of 10 or 20 GiB holds it, and the refusal says that peak is why, where
    ``nvidia-smi`` shows 5 GiB used."""
    planner = Planner(InterferencePredictor())
    free = (MigOption("1g.10gb", 1 / 7, 10 * GIB), MigOption("2g.20gb", 2 / 7, 20 * GIB))
    mig_mode = GpuView(index=1, memory_total=80 * GIB, mig_options=free, whole=False)
    job = training("a", sm=0.1, mem_gib=4, used_gib=5)
    job.shape.observe_memory(30 * GIB)
    one_gpu = planner.plan([mig_mode], [job])
    assert one_gpu.waiting["a"].endswith(
        "holds its 35328 MiB and gives it 1/2 of its speed on a whole GPU;"
        " a holds its run's peak 30 GiB (now 5 GiB)"
    ), one_gpu.waiting["a"]
    busy = replace(gpus(1)[0], index=0)
    two = planner.plan([busy, mig_mode], [training("x", mem_gib=70, gpu=0), job])
    assert two.waiting["a"].endswith(
        "GPU 1: in MIG mode: no free instance (1g.10gb, 2g.20gb) holds its 35328 MiB and"
        " gives it 1/2 of its speed on a whole GPU; a holds its run's peak 30 GiB (now 5 GiB)"
    ), two.waiting["a"]


@pytest.mark.parametrize(
    ("declared_gib", "used_gib", "peak_gib"),
    [(4, 30, 30.02), (30, 5, 30), (30, 5, 30.02)],
    ids=["peak-as-now", "peak-as-declared", "peak-a-hair-over-declared"],
)
def test_a_refusal_names_no_peak_that_shows_no_more_than_declared_or_used_now(
    declared_gib: float, used_gib: float, peak_gib: float
) -> None:
    """A run's peak is named as what holds a job only where it shows above both what the
    job declared and what it uses now: "a holds its run's peak 30 GiB (now 30 GiB)", or a
    peak no more than the declared memory it is held at anyway, explains nothing."""
    planner = Planner(InterferencePredictor())
    free = (MigOption("1g.10gb", 1 / 7, 10 * GIB), MigOption("2g.20gb", 2 / 7, 20 * GIB))
    mig_mode = GpuView(index=1, memory_total=80 * GIB, mig_options=free, whole=False)
    job = training("a", sm=0.1, mem_gib=declared_gib, used_gib=used_gib)
    job.shape.observe_memory(int(peak_gib * GIB))
    said = planner.plan([mig_mode], [job]).waiting["a"]
    assert said.endswith("gives it 1/2 of its speed on a whole GPU"), said


def test_a_refusal_on_two_mig_gpus_names_the_job_held_at_its_runs_peak_once() -> None:
    planner = Planner(InterferencePredictor())
    free = (MigOption("1g.10gb", 1 / 7, 10 * GIB), MigOption("2g.20gb", 2 / 7, 20 * GIB))
    mig_mode = [
        GpuView(index=i, memory_total=80 * GIB, mig_options=free, whole=False) for i in (0, 1)
    ]
    job = training("a", sm=0.1, mem_gib=4, used_gib=5)
    job.shape.observe_memory(30 * GIB)
    busy = replace(gpus(1)[0], index=2)
    why = planner.plan([*mig_mode, busy], [training("x", mem_gib=70, gpu=2), job]).waiting["a"]
    assert why.count("holds its run's peak") == 1, why
    assert why.endswith("; a holds its run's peak 30 GiB (now 5 GiB)"), why
    assert why.count("GPU 1: in MIG mode: no free instance (1g.10gb, 2g.20gb) holds its") == 1


def test_a_mig_instance_holds_its_own_memory_and_goes_to_one_job() -> None:
    """Jobs that fill their instances crowd no one: none is evicted for the GPU's memory,
    and a free instance is still given; one free instance goes to the first job only."""
    planner = Planner(InterferencePredictor())
    residents = []
    for name, profile in (("a", "4g.40gb"), ("b", "3g.40gb")):
        j = training(name, sm=1.0, mem_gib=34, gpu=1, used_gib=39)
        j.mig_profile = profile
        residents.append(j)
    free = (MigOption("1g.10gb", 16 / 132, 10 * GIB),)
    full = GpuView(
        index=1, memory_total=80 * GIB, memory_used=78 * GIB, mig_options=free, whole=False
    )
    plan = planner.plan([full], [*residents, training("c", sm=0.1, mem_gib=8)])
    assert not [d for d in plan.directives if d.evict]
    assert [(p.job_id, p.mig_profile) for p in plan.placements] == [("c", "1g.10gb")]
    two = planner.plan(
        [full], [training("c", sm=0.1, mem_gib=8), training("d", sm=0.1, mem_gib=8, order=1)]
    )
    assert [p.job_id for p in two.placements] == ["c"]
    assert two.waiting["d"] == "its options went to jobs ahead of it: c"


def test_a_job_whose_instance_went_to_a_job_ahead_takes_another_free_one_that_fits() -> None:
    """Two training jobs that each fit the smallest free instance, on a GPU in MIG mode
    with a 1g.10gb and a 3g.40gb free: the first takes the 1g.10gb, the second the
    3g.40gb (the smallest still free that fits it), not told to wait for the 1g.10gb."""
    free = (MigOption("1g.10gb", 1 / 7, 10 * GIB), MigOption("3g.40gb", 3 / 7, 40 * GIB))
    view = GpuView(index=0, memory_total=80 * GIB, mig_options=free, whole=False)
    first, second = training("c", sm=0.1, mem_gib=8), training("d", sm=0.1, mem_gib=8, order=1)
    plan = Planner(InterferencePredictor()).plan([view], [first, second])
    assert [(p.job_id, p.mig_profile) for p in plan.placements] == [
        ("c", "1g.10gb"),
        ("d", "3g.40gb"),
    ]
    assert not plan.waiting


def test_a_job_whose_instance_went_ahead_takes_its_next_choice_before_a_smaller_one() -> None:
    """GPU 0 has a 3g.40gb and a 1g.10gb free, GPU 1 a 3g.40gb: two training jobs that each
    keep their pace only in a 3g.40gb take one on each GPU; the second is not squeezed into
    GPU 0's 1g.10gb while GPU 1's 3g.40gb stays free."""
    three, one = MigOption("3g.40gb", 3 / 7, 40 * GIB), MigOption("1g.10gb", 1 / 7, 10 * GIB)
    views = [
        GpuView(index=0, memory_total=80 * GIB, mig_options=(three, one), whole=False),
        GpuView(index=1, memory_total=80 * GIB, mig_options=(three,), whole=False),
    ]
    jobs = [training("c", sm=0.3, mem_gib=8), training("d", sm=0.3, mem_gib=8, order=1)]
    plan = Planner(InterferencePredictor()).plan(views, jobs)
    assert [(p.job_id, p.gpu, p.mig_profile) for p in plan.placements] == [
        ("c", 0, "3g.40gb"),
        ("d", 1, "3g.40gb"),
    ]
    assert [p.predicted_speed for p in plan.placements] == [1.0, 1.0]


def test_a_job_whose_instance_went_ahead_leaves_the_larger_one_to_a_job_that_needs_it() -> None:
    """GPU 0 has a 1g.10gb and a 3g.40gb free, GPU 1 a 1g.10gb: two small training jobs
    take the two 1g.10gb and a third that only a 3g.40gb holds takes GPU 0's, rather than
    the second small job taking it and the third waiting."""
    one, three = MigOption("1g.10gb", 1 / 7, 10 * GIB), MigOption("3g.40gb", 3 / 7, 40 * GIB)
    views = [
        GpuView(index=0, memory_total=80 * GIB, mig_options=(one, three), whole=False),
        GpuView(index=1, memory_total=80 * GIB, mig_options=(one,), whole=False),
    ]
    jobs = [
        training("c", sm=0.1, mem_gib=8),
        training("d", sm=0.1, mem_gib=8, order=1),
        training("e", sm=0.4, mem_gib=30, order=2),
    ]
    plan = Planner(InterferencePredictor()).plan(views, jobs)
    assert [(p.job_id, p.gpu, p.mig_profile) for p in plan.placements] == [
        ("c", 0, "1g.10gb"),
        ("d", 1, "1g.10gb"),
        ("e", 0, "3g.40gb"),
    ]
    assert not plan.waiting


@pytest.mark.parametrize("beside", ["job", "processes of no job"])
def test_a_job_whose_instance_went_ahead_takes_a_free_one_rather_than_share_a_busy_gpu(
    beside: str,
) -> None:
    """GPU 0 in MIG mode has a 3g.40gb and a 2g.20gb free; GPU 1 is whole, with training
    (or processes gpud does not know) on it. Two small training jobs both rank GPU 0's
    2g.20gb first: the first takes it, the second GPU 0's 3g.40gb rather than an MPS share
    beside GPU 1's work that slows it, the 3g.40gb left empty."""
    three, two = MigOption("3g.40gb", 60 / 132, 40 * GIB), MigOption("2g.20gb", 32 / 132, 20 * GIB)
    views = [
        GpuView(index=0, memory_total=80 * GIB, mig_options=(three, two), whole=False),
        GpuView(index=1, memory_total=80 * GIB),
    ]
    jobs = [
        training("a", sm=0.15, bw=0.1, mem_gib=8, order=1),
        training("b", sm=0.15, bw=0.1, mem_gib=8, order=2),
    ]
    if beside == "job":
        jobs.append(training("r", gpu=1))
    else:
        views[1] = replace(views[1], foreign=JobFeatures(sm=0.3, mem_bw=0.2))
    plan = Planner(InterferencePredictor()).plan(views, jobs)
    assert [(p.job_id, p.gpu, p.mig_profile) for p in plan.placements] == [
        ("a", 0, "2g.20gb"),
        ("b", 0, "3g.40gb"),
    ]
    assert set(plan.predicted_speed.values()) == {1.0}


def test_a_job_whose_instance_went_ahead_takes_a_free_gpu_before_a_smaller_instance() -> None:
    """A re-pick comes after the ranked options that slow no one: with GPU 0's 3g.40gb gone
    to the job ahead and its 1g.10gb left, the second job takes the free whole GPU 1."""
    three, one = MigOption("3g.40gb", 3 / 7, 40 * GIB), MigOption("1g.10gb", 1 / 7, 10 * GIB)
    views = [
        GpuView(index=0, memory_total=80 * GIB, mig_options=(three, one), whole=False),
        GpuView(index=1, memory_total=80 * GIB),
    ]
    jobs = [training("c", sm=0.3, mem_gib=8), training("d", sm=0.3, mem_gib=8, order=1)]
    plan = Planner(InterferencePredictor()).plan(views, jobs)
    assert [(p.job_id, p.gpu, p.mig_profile) for p in plan.placements] == [
        ("c", 0, "3g.40gb"),
        ("d", 1, None),
    ]


@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_head_hold_is_a_duration(bad: float) -> None:
    with pytest.raises(ValueError, match="head_hold_s"):
        PlannerParams(head_hold_s=bad)


def test_a_job_larger_than_every_gpu_is_told_it_never_fits() -> None:
    plan = Planner(InterferencePredictor()).plan(gpus(2), [training("big", mem_gib=100)])
    why = plan.waiting["big"]
    assert why.startswith("never fits on this node")
    assert f"{100 * 1024} MiB" in why and f"{int(80 * 0.95 * 1024)} MiB" in why
    busy = Planner(InterferencePredictor()).plan(
        gpus(1), [training("a", sm=0.95, bw=0.9, gpu=0), training("b", sm=0.95, bw=0.9, order=1)]
    )
    assert "never fits" not in busy.waiting["b"]
    nowhere = Planner(InterferencePredictor()).plan([], [training("b")])
    assert nowhere.waiting["b"] == "no GPU to place it on (none is healthy)"


def test_a_job_alone_may_fill_its_gpu() -> None:
    """The growth margin keeps a job's growth from its neighbours: alone, a job needs only
    its memory, and using all of it gets it no eviction."""
    planner = Planner(InterferencePredictor())
    plan = planner.plan(
        gpus(2), [training("a", gpu=0, mem_gib=70, used_gib=78), training("b", mem_gib=70)]
    )
    assert not any(d.evict for d in plan.directives)
    (p,) = plan.placements
    assert p.gpu == 1 and p.memory_limit_bytes == int(80 * GIB * 0.95)
    crowded = planner.plan(gpus(1), [training("a", gpu=0, mem_gib=10), training("b", mem_gib=70)])
    assert not crowded.placements and "memory" in crowded.waiting["b"]


def test_memory_of_processes_no_job_owns_is_held() -> None:
    """NVML's use beyond the jobs' own (another user's process, an MPS server) is taken."""
    planner = Planner(InterferencePredictor())
    view = [GpuView(index=0, memory_total=80 * GIB, memory_used=70 * GIB)]
    plan = planner.plan(view, [training("b", mem_gib=10)])
    assert not plan.placements and "memory" in plan.waiting["b"]
    # a's 50 GiB (over its 10 GiB declared: counted with its margin) is not held again as
    # someone else's
    jobs = [training("a", gpu=0, used_gib=50), training("b", mem_gib=10, order=1)]
    shared = planner.plan([GpuView(index=0, memory_total=80 * GIB, memory_used=50 * GIB)], jobs)
    assert [p.job_id for p in shared.placements] == ["b"]


def test_a_job_whose_memory_nvml_does_not_report_counts_its_reservation_once() -> None:
    """A driver that reports no per-process memory: the GPU's use is the job's, within its
    reservation, and not held a second time as someone else's."""
    planner = Planner(InterferencePredictor())
    a = replace(training("a", gpu=0, mem_gib=30), memory_used=None)
    view = [GpuView(index=0, memory_total=80 * GIB, memory_used=30 * GIB)]
    plan = planner.plan(view, [a, training("b", mem_gib=30, order=1)])
    assert [p.job_id for p in plan.placements] == ["b"]
    assert plan.memory_reserved[0] == 2 * training("b", mem_gib=30).shape.reserve_bytes()
    # Beyond its reservation, the rest is held as anyone else's would be.
    over = [GpuView(index=0, memory_total=80 * GIB, memory_used=60 * GIB)]
    crowded = planner.plan(over, [a, training("b", mem_gib=30, order=1)])
    assert not crowded.placements and "memory" in crowded.waiting["b"]
    # Over the limit beside another job, the newest training job still goes.
    full = [GpuView(index=0, memory_total=80 * GIB, memory_used=79 * GIB)]
    old = replace(training("old", gpu=0, mem_gib=30), memory_used=None)
    new = replace(training("new", gpu=0, mem_gib=30, order=5), memory_used=None)
    (ev,) = [d for d in planner.plan(full, [old, new]).directives if d.evict]
    assert ev.job_id == "new"


def test_a_gpu_with_processes_of_no_job_is_not_free() -> None:
    planner = Planner(InterferencePredictor())
    heavy = JobFeatures(sm=0.8, mem_bw=0.6)
    view = [GpuView(index=0, memory_total=80 * GIB, foreign=heavy)]
    (p,) = planner.plan(view, [training("b")]).placements
    assert "processes gpud does not know" in p.reason and p.predicted_speed < 1.0
    (free,) = planner.plan(gpus(1), [training("b")]).placements
    assert "free" in free.reason and free.predicted_speed == pytest.approx(1.0)
    two = [GpuView(index=0, memory_total=80 * GIB, foreign=heavy), *gpus(2)[1:]]
    (p,) = planner.plan(two, [training("b")]).placements
    assert p.gpu == 1  # the free GPU first


def test_memory_over_limit_evicts_newest_training() -> None:
    planner = Planner(InterferencePredictor())
    jobs = [
        training("old", gpu=0, order=0, used_gib=40),
        training("new", gpu=0, order=5, used_gib=40),
    ]
    plan = planner.plan(gpus(1), jobs)
    (ev,) = [d for d in plan.directives if d.evict]
    assert ev.job_id == "new" and "memory" in ev.reason


def test_tight_slo_inference_gets_a_mig_instance() -> None:
    planner = Planner(InterferencePredictor())
    migs = (MigOption("3g.40gb", 3 / 7, 40 * GIB), MigOption("7g.80gb", 1.0, 80 * GIB))
    view = [GpuView(index=0, memory_total=80 * GIB, mig_options=migs)]
    tight = planner.plan(view, [inference("svc", slo_s=0.019, peak=40.0)])
    (p,) = tight.placements
    assert p.mig_profile == "3g.40gb" and "MIG" in p.reason
    loose = planner.plan(view, [inference("svc2", slo_s=0.5, peak=50.0)])
    assert loose.placements[0].mig_profile is None


def test_a_free_mig_instance_is_offered_next_to_a_service_on_another() -> None:
    planner = Planner(InterferencePredictor())
    free = (MigOption("3g.40gb", 3 / 7, 40 * GIB), MigOption("3g.40gb", 3 / 7, 40 * GIB))
    view = [GpuView(index=0, memory_total=80 * GIB, mig_options=free)]
    first = inference("first", slo_s=0.019, peak=40.0, gpu=0)
    first.mig_profile, first.sm_share = "3g.40gb", 3 / 7
    plan = planner.plan(view, [first, inference("second", slo_s=0.019, peak=40.0)])
    (p,) = plan.placements
    assert p.gpu == 0 and p.mig_profile == "3g.40gb" and "MIG" in p.reason
    # Two in one pass take the two free instances; a third has none left to take.
    many = [inference(n, slo_s=0.019, peak=40.0) for n in ("a", "b", "c")]
    for i, j in enumerate(many):
        j.order = i
    plan = planner.plan(view, [first, *many])
    assert [p.mig_profile for p in plan.placements][:2] == ["3g.40gb", "3g.40gb"]
    assert all(p.mig_profile is None for p in plan.placements[2:])


def _undeclared(slo_s: float, *, gpu: int | None = None, load: float = 0.0) -> JobView:
    shape = Shape.prior("svc", JobKind.INFERENCE, memory_bytes=10 * GIB, slo_s=slo_s)
    return JobView(
        "svc", shape, JobFeatures(sm=0.8, mem_bw=0.6), gpu=gpu, load=load, peak_load=load
    )


def test_a_service_peak_must_hold_with_the_training_throttled_to_peak_duty() -> None:
    """The guard throttles training at a burst: beside a service whose peak only holds
    with the training slowed, the training is placed at peak_duty 0.25 and refused at 1."""

    def plan(peak_duty: float) -> Plan:
        svc = inference("svc", slo_s=0.5, peak=370.0, gpu=0)
        svc.load = 50.0
        planner = Planner(InterferencePredictor(), PlannerParams(peak_duty=peak_duty))
        return planner.plan(gpus(1), [svc, training("t", sm=0.5, bw=0.4)])

    full = plan(1.0)
    assert not full.placements and "t" in full.waiting
    assert full.refused[(1, "service SLO")] >= 1
    throttled = plan(0.25)
    assert [p.job_id for p in throttled.placements] == ["t"]
    assert throttled.placements[0].sm_share < 1.0  # the service's peak share stays its own


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_peak_duty_is_a_duty(bad: float) -> None:
    with pytest.raises(ValueError, match="peak_duty"):
        PlannerParams(peak_duty=bad)


def test_an_undeclared_service_is_placeable_and_its_tightness_follows_its_slo() -> None:
    planner = Planner(InterferencePredictor())
    alone = planner.plan(gpus(1), [_undeclared(0.05)])
    assert alone.placements[0].gpu == 0 and "free" in alone.placements[0].reason
    # It holds its SLO alone with some load to spare, whatever the SLO.
    for slo in (0.01, 0.05, 0.2, 2.0):
        assert Shape.prior("s", JobKind.INFERENCE, memory_bytes=GIB, slo_s=slo).perf(1.0) > 0
    migs = (MigOption("3g.40gb", 3 / 7, 40 * GIB),)
    view = [GpuView(index=0, memory_total=80 * GIB, mig_options=migs)]
    assert planner.plan(view, [_undeclared(0.05)]).placements[0].mig_profile == "3g.40gb"
    assert planner.plan(view, [_undeclared(2.0)]).placements[0].mig_profile is None
    # Next to a light training job, either way round, rather than refused.
    plan = planner.plan(gpus(1), [training("t", gpu=0), _undeclared(0.1, load=5.0)])
    assert [p.job_id for p in plan.placements] == ["svc"]
    plan = planner.plan(gpus(1), [_undeclared(0.1, gpu=0, load=5.0), training("t", order=1)])
    assert [p.job_id for p in plan.placements] == ["t"]


def test_a_declared_peak_makes_the_prior_serve_it() -> None:
    s = Shape.prior("s", JobKind.INFERENCE, memory_bytes=GIB, slo_s=0.1, peak_load=200.0)
    assert s.perf(1.0) >= 200.0 * 1.5  # the peak with the prior's headroom
    assert prior_service_rate(None) == 1.0 / PRIOR_SERVICE_TIME_S
    t = Shape.prior("t", JobKind.TRAINING, memory_bytes=GIB)
    assert t.curve.peak == 1.0  # training stays relative


def test_training_next_to_inference_keeps_the_slo_capacity() -> None:
    planner = Planner(InterferencePredictor())
    svc = inference("svc", slo_s=0.1, peak=300.0, gpu=0)
    svc.sm_share = svc.shape.share_for_load(300.0 * 1.2)
    plan = planner.plan(gpus(1), [svc, training("t", sm=0.9, bw=0.8, order=1)])
    assert not plan.placements  # would break the service's peak


def test_training_shares_a_service_gpu_within_the_services_peak() -> None:
    planner = Planner(InterferencePredictor())
    svc = inference("svc", slo_s=0.5, peak=100.0, gpu=0)
    plan = planner.plan(gpus(1), [svc, training("t", sm=0.2, bw=0.1, order=1)])
    (p,) = plan.placements
    # The service keeps the SMs its declared peak needs; training gets what is left.
    assert p.sm_share <= 1.0 - svc.shape.share_for_load(100.0) + 1e-9
    busy = inference("busy", slo_s=0.5, peak=380.0, gpu=0)
    plan = planner.plan(gpus(1), [busy, training("t", sm=0.2, bw=0.1, order=1)])
    assert not plan.placements and "t" in plan.waiting


def test_guard_duty_becomes_directives_and_eviction() -> None:
    planner = Planner(InterferencePredictor())
    jobs = [inference("svc", slo_s=0.2, peak=50.0, gpu=0), training("t", gpu=0)]
    plan = planner.plan(gpus(1), jobs, guard_duty={0: 0.25})
    (d,) = plan.directives
    assert d.duty == 0.25 and not d.evict
    plan = planner.plan(gpus(1), jobs, guard_evict={0: "SLO cannot be held"})
    (d,) = plan.directives
    assert d.evict and d.reason == "SLO cannot be held"


job_strategy = st.tuples(
    st.floats(0.05, 1.0),  # sm
    st.floats(0.0, 1.0),  # bw
    st.floats(1.0, 70.0),  # memory GiB
    st.one_of(st.none(), st.integers(0, 3)),  # gpu
)


@settings(max_examples=80, deadline=None)
@given(
    specs=st.lists(job_strategy, min_size=1, max_size=16),
    headroom=st.floats(0.0, 0.2),
    service_peak=st.one_of(st.none(), st.floats(10.0, 300.0)),
)
def test_plan_never_overcommits_memory(
    specs: list[tuple[float, float, float, int | None]],
    headroom: float,
    service_peak: float | None,
) -> None:
    views = gpus(4)
    jobs: list[JobView] = []
    reserved = dict.fromkeys(range(4), 0)
    if service_peak is not None:
        # A service on GPU 0: training may now share its GPU, within the same memory.
        svc = inference("svc", slo_s=0.5, peak=service_peak, gpu=0)
        jobs.append(svc)
        reserved[0] += svc.shape.reserve_bytes()
    for i, (sm, bw, mem, gpu) in enumerate(specs):
        j = training(f"j{i}", sm=sm, bw=bw, mem_gib=mem, order=i)
        limit = int(80 * GIB * (1 - headroom))
        if gpu is not None and reserved[gpu] + j.shape.reserve_bytes() <= limit:
            j.gpu = gpu
            reserved[gpu] += j.shape.reserve_bytes()
        jobs.append(j)
    planner = Planner(InterferencePredictor(), PlannerParams(memory_headroom=headroom))
    plan = planner.plan(views, jobs)
    by_id = {j.job_id: j for j in jobs}
    total = dict(reserved)
    members = {g: [j for j in jobs if j.gpu == g] for g in range(4)}
    for p in plan.placements:
        total[p.gpu] += by_id[p.job_id].shape.reserve_bytes()
        members[p.gpu].append(by_id[p.job_id])
    for g in range(4):
        limit = int(80 * GIB * (1 - headroom))
        if len(members[g]) == 1:  # alone, a job needs no room for its growth
            assert members[g][0].shape.needed_bytes() <= limit
        else:
            assert total[g] <= limit
        assert plan.memory_reserved[g] == total[g]
    assert {p.job_id for p in plan.placements}.isdisjoint(plan.waiting)


@settings(max_examples=120, deadline=None)
@given(
    residents=st.lists(
        st.tuples(st.floats(1.0, 40.0), st.floats(0.0, 2.0), st.integers(0, 1)), max_size=4
    ),
    pending=st.lists(st.floats(1.0, 60.0), min_size=1, max_size=6),
    foreign_gib=st.tuples(st.floats(0.0, 20.0), st.floats(0.0, 20.0)),
)
@example(residents=[(40.0, 1.5, 0)], pending=[20.0, 20.0], foreign_gib=(0.0, 80.0))
def test_work_placed_beside_running_jobs_fits_what_nvml_shows_they_hold(
    residents: list[tuple[float, float, int]],
    pending: list[float],
    foreign_gib: tuple[float, float],
) -> None:
    """Running jobs as NVML reads them, some holding more than they declared (no MPS limit
    holds a job whose memory grew), beside memory of no job: on every GPU where the plan
    places work beside a job, what NVML shows in use plus the newcomers' reservations stays
    under the limit (with no other job there, their memory alone), whether or not the
    caller fed the readings to ``Shape.observe_memory``."""
    limit = int(80 * GIB * 0.95)
    used = [int(f * GIB) for f in foreign_gib]
    jobs: list[JobView] = []
    for i, (declared, grown, gpu) in enumerate(residents):
        j = training(f"r{i}", mem_gib=declared, gpu=gpu, order=i, used_gib=declared * grown)
        assert j.memory_used is not None
        if used[gpu] + j.memory_used > 80 * GIB:
            continue
        used[gpu] += j.memory_used
        jobs.append(j)
    for i, mem in enumerate(pending):
        jobs.append(training(f"p{i}", mem_gib=mem, order=10 + i))
    views = [GpuView(index=g, memory_total=80 * GIB, memory_used=used[g]) for g in range(2)]
    plan = Planner(InterferencePredictor()).plan(views, jobs)
    by_id = {j.job_id: j for j in jobs}
    evicted = {d.job_id for d in plan.directives if d.evict}
    for g in range(2):
        placed = [by_id[p.job_id] for p in plan.placements if p.gpu == g]
        stay = [j for j in jobs if j.gpu == g and j.job_id not in evicted]
        if not placed:
            continue
        if len(placed) + len(stay) == 1:  # no other job: its growth reaches no job
            assert used[g] + placed[0].shape.needed_bytes() <= limit, (g, used)
        else:
            assert used[g] + sum(j.shape.reserve_bytes() for j in placed) <= limit, (g, used)


H100_INSTANCES = (
    MigOption("1g.10gb", 16 / 132, 10 * GIB),
    MigOption("2g.20gb", 32 / 132, 20 * GIB),
    MigOption("3g.40gb", 60 / 132, 40 * GIB),
    MigOption("4g.40gb", 64 / 132, 40 * GIB),
    MigOption("7g.80gb", 1.0, 80 * GIB),
)


@settings(max_examples=80, deadline=None)
@given(
    free=st.lists(st.sampled_from(H100_INSTANCES), max_size=7),
    specs=st.lists(job_strategy, min_size=1, max_size=10),
    services=st.lists(st.floats(0.005, 0.5), max_size=3),
)
def test_a_free_mig_instance_goes_to_one_job_that_fits_it(
    free: list[MigOption],
    specs: list[tuple[float, float, float, int | None]],
    services: list[float],
) -> None:
    """On a GPU in MIG mode: each free instance to one job at most, whose memory it holds,
    and a training job only where it keeps 1 / max_slowdown of its speed on a whole GPU."""
    view = GpuView(index=0, memory_total=80 * GIB, mig_options=tuple(free), whole=False)
    jobs = [
        training(f"t{i}", sm=sm, bw=bw, mem_gib=mem, order=i)
        for i, (sm, bw, mem, _) in enumerate(specs)
    ]
    jobs += [inference(f"s{i}", slo_s=slo, peak=20.0) for i, slo in enumerate(services)]
    for i, j in enumerate(jobs):
        j.order = i
    planner = Planner(InterferencePredictor())
    plan = planner.plan([view], jobs)
    by_id = {j.job_id: j for j in jobs}
    instances = {m.profile: m for m in free}
    for profile in instances:
        given_out = sum(1 for p in plan.placements if p.mig_profile == profile)
        assert given_out <= sum(1 for m in free if m.profile == profile)
    for p in plan.placements:
        assert p.mig_profile is not None  # no share of a GPU in MIG mode
        j, m = by_id[p.job_id], instances[p.mig_profile]
        assert j.shape.reserve_bytes() <= m.memory_bytes
        if j.kind is JobKind.TRAINING:
            assert j.shape.curve.relative(m.sm_fraction) >= 1 / planner.params.max_slowdown
    assert {p.job_id for p in plan.placements}.isdisjoint(plan.waiting)
    assert set(plan.waiting) | {p.job_id for p in plan.placements} == set(by_id)


@settings(max_examples=80, deadline=None)
@given(
    layouts=st.lists(st.lists(st.sampled_from(H100_INSTANCES), max_size=4), min_size=2, max_size=3),
    specs=st.lists(job_strategy, min_size=1, max_size=8),
)
def test_on_several_mig_gpus_a_job_takes_a_second_choice_only_when_its_first_are_gone(
    layouts: list[list[MigOption]], specs: list[tuple[float, float, float, int | None]]
) -> None:
    """Training jobs over GPUs in MIG mode: a job placed in an instance other than the one
    it takes on that GPU alone found none of its first choices (the instance it takes on
    each GPU alone) free when it was placed, in arrival order, and no job waits while an
    instance that holds it alone stays free, on any GPU."""
    views = [
        GpuView(index=i, memory_total=80 * GIB, mig_options=tuple(free), whole=False)
        for i, free in enumerate(layouts)
    ]
    jobs = [
        training(f"t{i}", sm=sm, bw=bw, mem_gib=mem, order=i)
        for i, (sm, bw, mem, _) in enumerate(specs)
    ]

    def alone(view: GpuView, job: JobView) -> str | None:
        plan = Planner(InterferencePredictor()).plan([view], [job])
        return plan.placements[0].mig_profile if plan.placements else None

    plan = Planner(InterferencePredictor()).plan(views, jobs)
    by_id = {j.job_id: j for j in jobs}
    # The instances still free as each job was placed, in the order the jobs were committed:
    # a job's first choice that a job behind it took was free when it chose.
    left = {v.index: [m.profile for m in v.mig_options] for v in views}
    for p in plan.placements:
        assert p.mig_profile is not None
        if p.mig_profile != alone(views[p.gpu], by_id[p.job_id]):
            for v in views:
                first = alone(v, by_id[p.job_id])
                assert first is None or first not in left[v.index], (p, v.index, first)
        left[p.gpu].remove(p.mig_profile)  # each instance to one job at most
    for job_id in plan.waiting:
        for v in views:
            for profile in left[v.index]:
                one = replace(
                    v, mig_options=(next(m for m in v.mig_options if m.profile == profile),)
                )
                assert alone(one, by_id[job_id]) is None, (job_id, v.index, profile)


def test_a_guard_acts_only_on_training_in_its_services_mig_instance() -> None:
    """A service and a training job share MIG instance A; another training job runs in
    instance B of the same GPU, which the service cannot feel: the guard's duty and its
    eviction reach the first only."""
    planner = Planner(InterferencePredictor())
    svc = inference("svc", slo_s=0.2, peak=50.0, gpu=0)
    svc.mig_profile, svc.device = "3g.40gb", "MIG-a"
    near = training("near", gpu=0)
    near.mig_profile, near.device = "3g.40gb", "MIG-a"
    far = training("far", gpu=0)
    far.mig_profile, far.device = "3g.40gb", "MIG-b"
    jobs = [svc, near, far]
    plan = planner.plan(gpus(1), jobs, guard_duty={0: 0.25})
    duties = {d.job_id: d.duty for d in plan.directives}
    assert duties == {"near": 0.25, "far": 1.0}
    plan = planner.plan(gpus(1), jobs, guard_evict={0: "SLO cannot be held"})
    assert {d.job_id for d in plan.directives if d.evict} == {"near"}


def _in_instance(view: JobView, device: str, profile: str = "3g.40gb") -> JobView:
    view.mig_profile, view.device = profile, device
    return view


def _mig_gpu(*instances: MigMemory) -> GpuView:
    """GPU 0 in MIG mode with these GPU instances (3g.40gb each)."""
    return GpuView(
        index=0,
        memory_total=80 * GIB,
        whole=False,
        mig_layout=(H100_INSTANCES[2],),
        mig_memory=instances,
    )


def _evicted(gpu: GpuView, jobs: list[JobView]) -> list[str]:
    plan = Planner(InterferencePredictor()).plan([gpu], jobs)
    return [d.job_id for d in plan.directives if d.evict]


def test_memory_over_a_shared_mig_instance_evicts_its_newest_training() -> None:
    """A service and a training job share MIG instance A (40 GiB): the training grows to
    32 GiB beside the service's 8, over the instance's limit, and is evicted, the reason
    naming the instance; a training job alone in instance B that fills it is left alone."""
    view = _mig_gpu(MigMemory(("MIG-a",), 40 * GIB), MigMemory(("MIG-b",), 40 * GIB))
    svc = _in_instance(inference("svc", slo_s=0.2, peak=50.0, gpu=0), "MIG-a")
    svc.memory_used, svc.order = 8 * GIB, 0
    grown = _in_instance(training("grown", gpu=0, order=1, used_gib=32), "MIG-a")
    full = _in_instance(training("full", gpu=0, order=2, used_gib=39), "MIG-b")
    plan = Planner(InterferencePredictor()).plan([view], [svc, grown, full])
    (ev,) = [d for d in plan.directives if d.evict]
    assert ev.job_id == "grown"
    assert ev.reason == (
        "GPU 0 MIG instance 3g.40gb (MIG-a) memory 40960 MiB over its limit 38912 MiB: "
        "evict the newest training job there"
    )
    # within the instance's limit, nothing goes; nor where the driver does not say
    for unknown in (20 * GIB, None):
        grown.memory_used = unknown
        assert _evicted(view, [svc, grown, full]) == []


def test_nvml_reading_of_a_mig_instance_counts_where_it_says_more() -> None:
    """NVML reads 39 GiB used in the instance where its jobs' processes report 28: the
    instance is over its limit all the same, and the newest training job there goes."""
    svc = _in_instance(inference("svc", slo_s=0.2, peak=50.0, gpu=0), "MIG-a")
    svc.memory_used = 8 * GIB
    train = _in_instance(training("train", gpu=0, order=1, used_gib=20), "MIG-a")
    assert _evicted(_mig_gpu(MigMemory(("MIG-a",), 40 * GIB, 39 * GIB)), [svc, train]) == ["train"]
    assert _evicted(_mig_gpu(MigMemory(("MIG-a",), 40 * GIB, 30 * GIB)), [svc, train]) == []


def test_a_job_of_unknown_memory_in_a_mig_instance_is_never_evicted_for_it() -> None:
    """A service and t1 use 20 GiB each of a 40 GiB instance, t2 (the newest) reports none:
    t1, whose memory crowds the service, goes; t2 is no reason and no victim."""
    svc = _in_instance(inference("svc", slo_s=0.2, peak=50.0, gpu=0), "MIG-a")
    svc.memory_used = 20 * GIB
    t1 = _in_instance(training("t1", gpu=0, order=1, used_gib=20), "MIG-a")
    t2 = _in_instance(training("t2", gpu=0, order=2), "MIG-a")
    t2.memory_used = None
    assert _evicted(_mig_gpu(MigMemory(("MIG-a",), 40 * GIB)), [svc, t1, t2]) == ["t1"]


def test_a_job_in_two_mig_instances_is_evicted_once() -> None:
    """A training job runs in instances A and B of GPU 0, beside a service in each, and
    crowds both: it is evicted once, and that frees both."""
    a = _in_instance(inference("a", slo_s=0.2, peak=50.0, gpu=0), "MIG-a")
    b = _in_instance(inference("b", slo_s=0.2, peak=50.0, gpu=0), "MIG-b")
    a.memory_used = b.memory_used = 8 * GIB
    big = [
        _in_instance(training("big", gpu=0, order=1, used_gib=32), d) for d in ("MIG-a", "MIG-b")
    ]
    gpu = _mig_gpu(MigMemory(("MIG-a",), 40 * GIB), MigMemory(("MIG-b",), 40 * GIB))
    assert _evicted(gpu, [a, b, *big]) == ["big"]


def test_compute_instances_of_one_gpu_instance_share_its_memory() -> None:
    """A 3g.40gb GPU instance split into a 1c.3g.40gb and a 2c.3g.40gb compute instance (two
    MIG devices, each reading the instance's 40 GiB as its total): a service in one and a
    training job in the other share those 40 GiB, and the training's 32 GiB crowd it."""
    svc = _in_instance(inference("svc", slo_s=0.2, peak=50.0, gpu=0), "MIG-c1", "1c.3g.40gb")
    svc.memory_used = 8 * GIB
    train = _in_instance(training("train", gpu=0, order=1, used_gib=32), "MIG-c2", "2c.3g.40gb")
    gpu = _mig_gpu(MigMemory(("MIG-c1", "MIG-c2"), 40 * GIB))
    assert _evicted(gpu, [svc, train]) == ["train"]


def test_a_job_of_unknown_memory_never_costs_an_older_one_its_place() -> None:
    """A service (4 GiB) and t1 (2 GiB) share a 40 GiB instance with t2, the newest, whose
    memory the driver does not report: NVML reads 39 GiB used there, t2's growth most of
    it. t2 is no reason to evict and no victim, so t1 stays too."""
    svc = _in_instance(inference("svc", slo_s=0.2, peak=50.0, gpu=0), "MIG-a")
    svc.memory_used = 4 * GIB
    t1 = _in_instance(training("t1", gpu=0, order=1, used_gib=2), "MIG-a")
    t2 = _in_instance(training("t2", gpu=0, order=2), "MIG-a")
    t2.memory_used = None
    assert _evicted(_mig_gpu(MigMemory(("MIG-a",), 40 * GIB, 39 * GIB)), [svc, t1, t2]) == []
    # what the jobs are known to use still counts
    t1.memory_used = 36 * GIB
    assert _evicted(_mig_gpu(MigMemory(("MIG-a",), 40 * GIB, 39 * GIB)), [svc, t1, t2]) == ["t1"]


def test_a_job_evicted_elsewhere_of_unknown_memory_in_an_instance_costs_no_one_there() -> None:
    """``x`` uses 30 GiB in instance A beside a service and goes for it; in B, where the
    driver does not say what it uses, NVML reads 39 GiB used until it has left: ``x`` is no
    reason to evict ``older`` (2 GiB) beside B's service (4) either."""
    a = _in_instance(inference("a", slo_s=0.2, peak=50.0, gpu=0), "MIG-a")
    b = _in_instance(inference("b", slo_s=0.2, peak=50.0, gpu=0), "MIG-b")
    a.memory_used = b.memory_used = 4 * GIB
    older = _in_instance(training("older", gpu=0, order=1, used_gib=2), "MIG-b")
    x = [_in_instance(training("x", gpu=0, order=2, used_gib=30), d) for d in ("MIG-a", "MIG-b")]
    x[1].memory_used = None
    gpu = _mig_gpu(
        MigMemory(("MIG-a",), 40 * GIB, 39 * GIB), MigMemory(("MIG-b",), 40 * GIB, 39 * GIB)
    )
    assert _evicted(gpu, [a, b, older, *x]) == ["x"]


def test_memory_a_job_evicted_for_one_instance_frees_in_another_counts_there() -> None:
    """``shared`` runs in instances A and B, each beside a service, and B holds ``older``
    too; NVML reads 39 GiB used in each. ``shared``, the newest in A, goes for A, and with
    it the 20 GiB it held in B: B is within its limit then, and ``older`` stays."""
    a = _in_instance(inference("a", slo_s=0.2, peak=50.0, gpu=0), "MIG-a")
    b = _in_instance(inference("b", slo_s=0.2, peak=50.0, gpu=0), "MIG-b")
    a.memory_used = b.memory_used = 4 * GIB
    older = _in_instance(training("older", gpu=0, order=1, used_gib=10), "MIG-b")
    shared = [
        _in_instance(training("shared", gpu=0, order=2, used_gib=20), d) for d in ("MIG-a", "MIG-b")
    ]
    gpu = _mig_gpu(
        MigMemory(("MIG-a",), 40 * GIB, 39 * GIB), MigMemory(("MIG-b",), 40 * GIB, 39 * GIB)
    )
    assert _evicted(gpu, [a, b, older, *shared]) == ["shared"]


def test_a_mig_device_no_listed_instance_holds_is_an_instance_of_its_profile() -> None:
    """``big`` grows to 38 GiB beside a service's 8 in MIG device MIG-x, made since the GPU's
    instances were listed (or on a view that lists none): MIG-x holds what its profile's
    40 GiB do, and ``big`` goes. Of a profile the GPU's layout does not have, nothing is
    known of what the device holds, and nothing goes."""
    big = _in_instance(training("big", gpu=0, order=1, used_gib=38), "MIG-x")
    svc = _in_instance(inference("svc", slo_s=0.2, peak=50.0, gpu=0), "MIG-x")
    svc.memory_used = 8 * GIB
    assert _evicted(_mig_gpu(MigMemory(("MIG-a",), 40 * GIB)), [svc, big]) == ["big"]
    assert _evicted(_mig_gpu(), [svc, big]) == ["big"]
    big.mig_profile = svc.mig_profile = "9g.99gb"
    assert _evicted(_mig_gpu(), [svc, big]) == []


def test_an_evicted_job_takes_off_an_instance_only_the_memory_counted_there() -> None:
    """A 40 GiB GPU instance split into compute instances c1 and c2: ``x``, the newest, uses
    5 GiB in c1 and an unreported amount in c2 (a 30 GiB reservation), beside a service
    (4 GiB), t1 (18) and t2 (17). Their known 44 GiB are over the 38 GiB limit: ``x`` goes,
    which takes 5 GiB off, not its reservation, and 39 GiB are still over: t2 goes too."""
    svc = _in_instance(inference("svc", slo_s=0.2, peak=50.0, gpu=0), "MIG-c1", "1c.3g.40gb")
    svc.memory_used = 4 * GIB
    t1 = _in_instance(training("t1", gpu=0, order=1, used_gib=18), "MIG-c1", "1c.3g.40gb")
    t2 = _in_instance(training("t2", gpu=0, order=2, used_gib=17), "MIG-c1", "1c.3g.40gb")
    x = [
        _in_instance(training("x", gpu=0, order=3, used_gib=5, mem_gib=26), d, f"{c}c.3g.40gb")
        for c, d in ((1, "MIG-c1"), (2, "MIG-c2"))
    ]
    x[1].memory_used = None
    gpu = _mig_gpu(MigMemory(("MIG-c1", "MIG-c2"), 40 * GIB))
    assert _evicted(gpu, [svc, t1, t2, *x]) == ["x", "t2"]


# (where, order, memory in GiB per instance it is in, None where the driver does not say)
instance_job = st.tuples(
    st.sampled_from(["a1", "a2", "b", "a1+b", "a2+b", "a1+a2"]),
    st.integers(1, 3),
    st.lists(st.one_of(st.none(), st.sampled_from([1, 4, 12, 20, 30, 39])), min_size=2, max_size=2),
)


services_in_each_at_39 = {"services": ["a1", "b"], "headroom": 0.05, "reads": [39, 39]}


@settings(max_examples=200, deadline=None)
@given(
    jobs=st.lists(instance_job, max_size=6),
    services=st.lists(st.sampled_from(["a1", "a2", "b"]), max_size=2),
    headroom=st.floats(0.0, 0.2),
    reads=st.lists(st.one_of(st.none(), st.sampled_from([10, 30, 39, 40])), min_size=2, max_size=2),
)
# ``t1`` goes for A: what it held in B goes with it, or (unknown there) never counted, and
# ``t0`` stays
@example(jobs=[("b", 1, [4, None]), ("a1+b", 2, [20, 20])], **services_in_each_at_39)
@example(jobs=[("b", 1, [2, None]), ("a1+b", 2, [30, None])], **services_in_each_at_39)
def test_a_shared_mig_instance_sheds_its_newest_training_over_its_limit(
    jobs: list[tuple[str, int, list[int | None]]],
    services: list[str],
    headroom: float,
    reads: list[int | None],
) -> None:
    """Two GPU instances of GPU 0, A split into two compute instances (jobs in either share
    its memory), jobs in one or both, orders tied: per instance, only training jobs of known
    memory there go, each newer than every such job it keeps; afterwards its use is within
    its limit, or one job is left there, or no training job of known memory; and with every
    eviction made before the last one for it (for any instance), it was still over."""
    devices = {"a1": "MIG-a1", "a2": "MIG-a2", "b": "MIG-b"}
    instances = [
        MigMemory(
            ("MIG-a1", "MIG-a2"), 40 * GIB, None if reads[0] is None else int(reads[0] * GIB)
        ),
        MigMemory(("MIG-b",), 40 * GIB, None if reads[1] is None else int(reads[1] * GIB)),
    ]
    views: list[JobView] = []
    for k, (where, order, used) in enumerate(jobs):
        for d, u in zip(where.split("+"), used, strict=False):
            j = _in_instance(training(f"t{k}", gpu=0, order=order), devices[d])
            j.memory_used = None if u is None else u * GIB
            views.append(j)
    for k, d in enumerate(services):
        svc = _in_instance(inference(f"s{k}", slo_s=0.2, peak=50.0, gpu=0), devices[d])
        svc.memory_used, svc.order = 4 * GIB, 0
        views.append(svc)
    planner = Planner(InterferencePredictor(), PlannerParams(memory_headroom=headroom))
    plan = planner.plan([_mig_gpu(*instances)], views)
    limit = int(40 * GIB * (1 - headroom))

    def known(v: JobView) -> bool:
        return v.kind is JobKind.TRAINING and v.memory_used is not None

    # each eviction, in the order made, with the instance its reason names
    made: list[tuple[str, MigMemory]] = []
    for d in plan.directives:
        if d.evict:
            device = d.reason.split("(", 1)[1].split(")", 1)[0]
            (inst,) = [i for i in instances if device in i.devices]
            (view,) = [v for v in views if v.job_id == d.job_id and v.device == device]
            assert known(view), d.reason
            made.append((d.job_id, inst))
    gone = {job for job, _ in made}
    assert len(gone) == len(made)

    def use(inst: MigMemory, out: set[str]) -> int:
        inside = [v for v in views if v.device in inst.devices]
        kept = sum(v.memory_used or 0 for v in inside if v.job_id not in out)
        if inst.used is None or any(v.memory_used is None for v in inside):
            return kept
        return max(inst.used - sum(v.memory_used or 0 for v in inside if v.job_id in out), kept)

    for inst in instances:
        inside = [v for v in views if v.device in inst.devices]
        kept = [v for v in inside if v.job_id not in gone]
        mine = [job for job, i in made if i is inst]
        for job in mine:
            assert all(
                v.order <= next(w.order for w in inside if w.job_id == job)
                for v in kept
                if known(v)
            )
        assert (
            use(inst, gone) <= limit
            or len({v.job_id for v in kept}) <= 1
            or not any(known(v) for v in kept)
        )
        if mine:  # over its limit still with every job evicted before its last
            last = max(k for k, (_, i) in enumerate(made) if i is inst)
            assert use(inst, {job for job, _ in made[:last]}) > limit


def test_a_job_on_two_gpus_is_directed_once_at_the_pace_of_its_slower_gpu() -> None:
    """A training job holding GPUs 0 and 1 is a view on each; a service shares GPU 0. It
    runs at the pace of its slower GPU, so the guard on GPU 0 sets its duty whatever GPU 1
    allows, its predicted speed is GPU 0's, and an eviction on either GPU is the job's."""
    planner = Planner(InterferencePredictor())
    svc = inference("svc", slo_s=0.2, peak=50.0, gpu=0)

    def jobs(used_gib: float = 0) -> list[JobView]:
        return [svc, training("t", gpu=0), training("t", gpu=1, used_gib=used_gib)]

    plan = planner.plan(gpus(2), jobs(), guard_duty={0: 0.25})
    (d,) = plan.directives
    assert (d.job_id, d.duty, d.evict) == ("t", 0.25, False)
    assert "GPU 0" in d.reason
    assert plan.predicted_speed["t"] < 1.0  # GPU 0's, next to the service; GPU 1's is 1.0
    older = training("u", gpu=1, order=-1, used_gib=10)
    for evicting in (
        planner.plan(gpus(2), jobs(), guard_evict={0: "SLO cannot be held"}),
        # GPU 1's memory over its limit, with an older job there to protect
        planner.plan(gpus(2), [*jobs(used_gib=70), older]),
    ):
        (d,) = [d for d in evicting.directives if d.job_id == "t"]
        assert d.evict
        assert "t" not in evicting.predicted_speed


def of(user: int, view: JobView, name: str = "") -> JobView:
    """``view`` as a job of ``user`` (named ``name``)."""
    view.user, view.user_name = user, name
    return view


def test_a_gpu_another_users_mps_server_serves_offers_no_share_but_a_free_mig_instance() -> None:
    """A job of another user on a whole GPU (its MPS server serves that user): a job gets
    no share of that GPU, goes to another, or waits with the reason; its own user's job, or
    one of no known user, still may share it; a job evicted this pass still bars it (it has
    yet to leave); a free MIG instance there (a server of its own) is still offered, and no
    GPU is held for a head that may not have it."""
    planner = Planner(InterferencePredictor())

    def theirs() -> JobView:
        return of(1000, training("theirs", gpu=0, used_gib=10), "alice")

    (p,) = planner.plan(gpus(2), [theirs(), of(1001, training("new"))]).placements
    assert p.gpu == 1
    alone = planner.plan(gpus(1), [theirs(), of(1001, training("new"))])
    assert alone.placements == ()
    assert alone.waiting["new"] == (
        "GPU 0: shared under MPS by jobs of user alice (theirs), and an MPS control daemon"
        " serves one user at a time"
    )
    assert alone.refused_for["new"] == {(1, "user"): 1}
    for sharing in (of(1000, training("mine")), training("anyone")):
        (p,) = planner.plan(gpus(1), [theirs(), sharing]).placements
        assert p.gpu == 0
    leaving = of(1000, training("theirs", gpu=0, order=1, used_gib=70))
    staying = of(1001, training("mine", gpu=0, used_gib=10))
    evicting = planner.plan(gpus(1), [leaving, staying, of(1001, training("new"))])
    assert [d.job_id for d in evicting.directives if d.evict] == ["theirs"]
    assert evicting.placements == () and "user 1000 (theirs)" in evicting.waiting["new"]
    migs = (MigOption("3g.40gb", 3 / 7, 40 * GIB),)
    svc = of(1001, inference("svc", slo_s=0.019, peak=40.0))
    (m,) = planner.plan([GpuView(0, 80 * GIB, mig_options=migs)], [theirs(), svc]).placements
    assert (m.gpu, m.mig_profile) == (0, "3g.40gb")
    head = of(1001, training("head", sm=0.9, bw=0.9, mem_gib=70))
    head.evicted = True
    there = of(1000, training("there", sm=0.9, bw=0.9, mem_gib=30, gpu=0))
    held = Planner(InterferencePredictor()).plan(gpus(1), [there, head])
    assert held.placements == () and "held for it" not in held.waiting["head"]


def test_jobs_of_two_users_placed_in_one_pass_do_not_share_a_gpus_mps_server() -> None:
    """Two pending jobs of different users and one free GPU both could share: the first
    placed takes it, and the second, planned in the same pass, sees that GPU's server
    serve the first's user now: it waits, saying so, rather than being sent there too
    (where its CUDA processes would hang until the first ended). Of one user, both go."""
    planner = Planner(InterferencePredictor())

    def light(job: str, order: float) -> JobView:
        return training(job, sm=0.1, bw=0.1, order=order)

    both = planner.plan(gpus(1), [of(1000, light("a", 0)), of(1000, light("b", 1))])
    assert sorted(p.job_id for p in both.placements) == ["a", "b"]
    plan = planner.plan(gpus(1), [of(1000, light("a", 0), "alice"), of(1001, light("b", 1))])
    assert [p.job_id for p in plan.placements] == ["a"]
    assert plan.waiting["b"] == (
        "its options went to jobs ahead of it: a; GPU 0: shared under MPS by jobs of user"
        " alice (a), and an MPS control daemon serves one user at a time"
    )
