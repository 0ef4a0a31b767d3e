"""Admission policy: Erlang C, packing, feasibility and remedies, estimates, quotes."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpud.admission.classes import class_views
from gpud.admission.estimate import Record, estimate, littles_residual
from gpud.admission.feasibility import classify, resolve_configs
from gpud.admission.model import Demand, Device, Request, Unfeasible, Vec
from gpud.admission.node import synthetic
from gpud.admission.packing import pack
from gpud.admission.placement_fit import PlacementFit
from gpud.admission.quote import (
    CONFIDENCE_Z,
    ClassQuote,
    erlang_c,
    job_quote,
    mgk_wait,
    upper_wait,
    variability_factor,
)
from gpud.backend.port import GpuIdentity
from gpud.mig.layout import DeviceLayout, load_config

GIB = 1 << 30
MIB = 1 << 20
DATA = Path(__file__).parent.parent / "data" / "mig-parted"


def test_erlang_c_of_a_small_load_on_millions_of_servers_stops_early() -> None:
    """A 1MiB request on a node of big GPUs packs millions of copies (k): a few Erlangs
    there wait with a negligible probability, found in a few hundred steps, not k."""
    import time

    start = time.process_time()
    assert erlang_c(50_000_000, 5.0) == 0.0
    assert time.process_time() - start < 1.0  # the full recursion takes about 10 s
    # where it stops early the answer is the full recursion's, to 1e-15
    for k, a in ((200, 5.0), (300, 150.0), (64, 63.5), (5000, 4000.0)):
        b = 1.0
        for i in range(1, k + 1):
            b = a * b / (i + a * b)
        assert erlang_c(k, a) == pytest.approx(k * b / (k - a * (1.0 - b)), abs=1e-15)


def test_erlang_c_matches_known_values() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(4, 0.0) == 0.0
    assert erlang_c(3, 3.0) == 1.0
    # M/M/1 wait: rho / (1 - rho) * S
    assert mgk_wait(1, 0.8, 10.0, 1.0) == pytest.approx(40.0)
    # One server: Pollaczek-Khinchine, (1 + cs2) / 2 times M/M/1, whatever the load
    assert mgk_wait(1, 0.8, 10.0, 4.0) == pytest.approx(100.0)
    assert mgk_wait(1, 0.8, 10.0, 0.25) == pytest.approx(25.0)
    assert mgk_wait(1, 0.2, 10.0, 0.0) == pytest.approx(0.5 * 2.5)
    assert math.isinf(mgk_wait(2, 2.0, 1.0, 1.0))


def test_variability_factor_meets_its_light_and_heavy_traffic_limits() -> None:
    # Deterministic service: the first of k busy servers frees after S / (k + 1), not S / k.
    assert variability_factor(2, 0.0, 0.0) == pytest.approx(2 / 3)
    assert variability_factor(7, 0.0, 0.0) == pytest.approx(7 / 8)
    assert variability_factor(2, 1.0, 0.0) == pytest.approx(0.5)
    assert variability_factor(3, 0.5, 1.0) == pytest.approx(1.0)  # exponential: M/M/k
    assert variability_factor(3, 0.5, 4.0) == pytest.approx(2.5)  # Allen-Cunneen above 1
    # Less variable service, or more load, never waits longer than M/M/k.
    for k in (1, 2, 5):
        for rho in (0.1, 0.5, 0.9):
            f = [variability_factor(k, rho, scv) for scv in (0.0, 0.25, 0.5, 1.0)]
            assert f == sorted(f) and f[-1] == pytest.approx(1.0)
            assert variability_factor(k, rho, 0.25) >= variability_factor(k, 0.95, 0.25)


def test_upper_wait_is_the_delta_method_bound() -> None:
    assert upper_wait(2, 0.9, 100.0, 1.0, 0.0) == pytest.approx(mgk_wait(2, 1.8, 100.0, 1.0))
    # M/M/1: W = rho / (1 - rho) S, so d ln W / d ln rho = 1 / (1 - rho) = 5 at 0.8.
    bound = upper_wait(1, 0.8, 10.0, 1.0, 0.01)
    assert bound == pytest.approx(40.0 * (1 + CONFIDENCE_Z * 5 * 0.01), rel=1e-6)
    # The bound tightens as the history grows.
    assert upper_wait(2, 0.9, 100.0, 0.25, 0.01) < upper_wait(2, 0.9, 100.0, 0.25, 0.05)
    assert math.isinf(upper_wait(2, 1.0, 100.0, 1.0, 0.01))


def test_packing_names_the_binding_dimension() -> None:
    devices = synthetic("H100-SXM5-80GB", 2, {1: DeviceLayout.of(True, {"1g.10gb": 7})})
    fit = PlacementFit(devices)
    by = {d.uuid: d for d in devices}
    share = fit.demand(Request(gpu_count=1, memory_bytes=10 * GIB, threads_percent=25))
    assert isinstance(share, Demand)
    p = pack(share, by)
    assert p.k_eff == 4 and p.binding == "threads" and p.vector == {"memory": 7, "threads": 4}
    whole = fit.demand(Request(gpu_count=1, memory_bytes=70 * GIB))
    assert isinstance(whole, Demand)
    assert pack(whole, by).k_eff == 1
    assert pack(whole, by).binding == "memory"
    mig = fit.demand(Request(mig_profile="1g.10gb", memory_bytes=9 * GIB))
    assert isinstance(mig, Demand)
    assert pack(mig, by).vector == {"memory": 7, "mig_slices": 7}
    free = fit.demand(Request(gpu_count=1))
    assert isinstance(free, Demand)
    assert pack(free, by).k_eff is None  # no limits: shares, never waits


H100_ID = 0x233010DE


def identity(i: int) -> GpuIdentity:
    return GpuIdentity(
        i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", "H100-SXM5-80GB", "", H100_ID, 80 * GIB, True
    )


def test_unfeasible_request_gets_a_mig_config_remedy() -> None:
    devices = synthetic("H100-SXM5-80GB", 2)
    fit = PlacementFit(devices)
    configs = resolve_configs(load_config(DATA / "config.yaml"), [identity(0), identity(1)])
    request = Request(mig_profile="3g.40gb")
    verdict = classify(
        request,
        fit,
        configs=configs,
        products={0: "H100-SXM5-80GB", 1: "H100-SXM5-80GB"},
        fit_for=PlacementFit,
        config_file="/etc/gpud/mig.yaml",
    )
    assert isinstance(verdict, Unfeasible)
    assert "no MIG device of profile 3g.40gb" in verdict.reason
    assert "'all-3g.40gb'" in verdict.remedy and "'all-balanced'" in verdict.remedy
    assert "gpuctl mig apply -f /etc/gpud/mig.yaml -c" in verdict.remedy


def test_unfeasible_reasons_name_the_numbers() -> None:
    fit = PlacementFit(synthetic("H100-SXM5-80GB", 2))
    too_big = fit.demand(Request(gpu_count=1, memory_bytes=100 * GIB))
    assert isinstance(too_big, Unfeasible) and "largest" in too_big.reason
    too_many = fit.demand(Request(gpu_count=3))
    assert isinstance(too_many, Unfeasible) and "3 whole GPUs" in too_many.reason
    missing = fit.demand(Request(devices=("GPU-9",)))
    assert isinstance(missing, Unfeasible) and "GPU-9" in missing.reason


def test_estimates_and_littles_law() -> None:
    records = [
        Record("a", "c", 0.0, 0.0, 10.0),
        Record("b", "c", 5.0, 10.0, 30.0),
        Record("d", "c", 20.0, 30.0, None),
    ]
    stats = estimate(records, now=40.0)["c"]
    # the first arrival opens the history: two arrivals over the 40 s after it
    assert stats.arrivals == 3 and stats.arrival_rate == pytest.approx(2 / 40)
    assert stats.mean_service_s == pytest.approx(15.0)
    assert stats.mean_wait_s == pytest.approx(5.0)
    # Queue length: 1 over [5, 10] and [20, 30]: area 15 = sum of waits.
    assert littles_residual(records, 15.0, start=0.0, end=40.0) == pytest.approx(0.0)
    assert littles_residual(records, 30.0, start=0.0, end=40.0) == pytest.approx(0.5)


def test_class_views_and_job_quotes() -> None:
    devices = [Device("GPU-0", 0, None, "H100", Vec(80 * GIB, 100))]
    fit = PlacementFit(devices)
    whole = Request(gpu_count=1, memory_bytes=80 * GIB)
    records = [Record(f"j{i}", "whole", i * 100.0, i * 100.0, i * 100.0 + 50.0) for i in range(10)]
    views = class_views(fit, {"whole": whole}, records, now=1000.0)
    q = views["whole"].quote
    assert q is not None and q.servers == 1
    assert q.rho == pytest.approx(0.45)  # nine arrivals after the first in 1000 s, 50 s each
    # Ten ended runs of fixed length: the wait's upper confidence bound, spread sqrt(1 / 10).
    assert q.wait_s == pytest.approx(upper_wait(1, 0.45, 50.0, 0.0, math.sqrt(1 / 10)))
    assert q.wait_s > mgk_wait(1, 0.45, 50.0, 0.0)
    assert job_quote(q, ahead=3, waited_s=0.0) == pytest.approx(max(q.wait_s, 200.0))
    assert job_quote(ClassQuote("x", math.inf, 1.0, 1, 1.0, 1.0), ahead=0, waited_s=0.0) == math.inf


def test_classes_sharing_devices_are_quoted_no_less_than_each_other() -> None:
    from gpud.admission.quote import ClassModel, class_quotes

    pool = frozenset({"GPU-0", "GPU-1"})
    small = ClassModel("small", 0.001, 100.0, 1.0, 4, pool)
    large = ClassModel("large", 0.0005, 1000.0, 1.0, 1, pool)
    alone = ClassModel("alone", 0.001, 100.0, 1.0, 4, frozenset({"MIG-0"}))
    quotes = class_quotes([small, large, alone])
    assert quotes["small"].wait_s == quotes["large"].wait_s > 0
    assert quotes["alone"].wait_s < quotes["small"].wait_s
    assert quotes["small"].servers == 4 and quotes["large"].servers == 1


class CountedPool(frozenset[str]):
    """A pool that counts the intersections taken with it."""

    taken = 0

    def __and__(self, other: object) -> frozenset[str]:
        CountedPool.taken += 1
        return frozenset(self).__and__(other)  # type: ignore[operator]


def test_many_classes_on_one_pool_are_quoted_at_a_cost_of_classes_not_their_square() -> None:
    """A sweep's runs each ask another memory size, each a class of its own, all on the
    same GPUs: the quotes take each class's share of the pool once per pool, not once per
    pair of classes, and are what each pair gave: the same wait for all."""
    from gpud.admission.quote import ClassModel, class_quotes

    pool = CountedPool({"GPU-0", "GPU-1"})
    classes = [ClassModel(f"c{i}", 0.0001, 100.0 + i, 1.0, 2, pool) for i in range(300)]
    CountedPool.taken = 0
    quotes = class_quotes(classes)
    assert CountedPool.taken <= 4 * len(classes)
    assert len({q.wait_s for q in quotes.values()}) == 1 and quotes["c0"].wait_s > 0


def test_many_classes_on_one_pool_get_its_packing_efficiency_at_a_cost_of_classes() -> None:
    """The same sweep's classes each get their pool's packing efficiency from one sweep of
    the pool, not one intersection per pair of classes, and all the same efficiency."""
    from gpud.admission.classes import ClassViews
    from gpud.admission.quote import ClassModel

    pool = CountedPool({"GPU-0", "GPU-1"})
    models = [ClassModel(f"c{i}", 0.0001, 100.0 + i, 1.0, 2, pool) for i in range(300)]
    records = [Record(f"j{i}", f"c{i}", float(i), i + 1.0, i + 50.0) for i in range(300)]
    views = ClassViews(records, now=400.0)
    CountedPool.taken = 0
    out = views._with_efficiency(models, now=400.0)
    assert CountedPool.taken <= 4 * len(models)
    assert len({m.efficiency for m in out}) == 1


def test_a_class_with_no_history_is_quoted_from_the_classes_loading_its_pool() -> None:
    """A class none of whose runs is in the history waits for the servers of its pool
    that the classes with history load: it gets their wait on its own servers (its own
    rate taken as none), no less than theirs, and changes none of theirs; on a pool no
    class with history loads, it gets no quote."""
    from gpud.admission.quote import ClassModel, class_quotes

    pool = frozenset({"GPU-0", "GPU-1"})
    known = ClassModel("known", 0.001, 100.0, 1.0, 2, pool, runs=20)
    new = ClassModel("new", 0.0, 0.0, 1.0, 1, pool)  # takes both GPUs: 1 server
    elsewhere = ClassModel("elsewhere", 0.0, 0.0, 1.0, 1, frozenset({"MIG-0"}))
    before = class_quotes([known])
    quotes = class_quotes([known], unseen=[new, elsewhere])
    assert quotes["known"] == before["known"]
    assert "elsewhere" not in quotes
    q = quotes["new"]
    assert q.servers == 1 and q.mean_service_s == 100.0 and q.rho == pytest.approx(0.05)
    assert q.wait_s > before["known"].wait_s > 0  # one server waits longer than two
    assert q.wait_s == pytest.approx(upper_wait(1, 0.05, 100.0, 1.0, math.sqrt(2 / 20)))


def test_a_wait_longer_than_the_history_is_an_overload_not_a_quote() -> None:
    """A saturated pool, its load within rounding of 1, is quoted no finite wait: Erlang C
    alone would say 10^13 s and more, flipping with the last bit of the load."""
    from gpud.admission.quote import ClassModel, class_quotes

    pool = frozenset({"GPU-0"})
    saturated = ClassModel("s", (1 - 1e-13) / 100.0, 100.0, 1.0, 1, pool, runs=50)
    assert 1e12 < class_quotes([saturated])["s"].wait_s < math.inf
    assert class_quotes([saturated], horizon_s=7 * 86400.0)["s"].wait_s == math.inf
    calm = ClassModel("c", 0.5 / 100.0, 100.0, 1.0, 1, pool, runs=50)
    assert class_quotes([calm], horizon_s=7 * 86400.0)["c"].wait_s < 1000.0


def test_one_running_run_does_not_make_its_devices_look_overloaded() -> None:
    """A first run that started at once and still runs: its class's load is not its one
    arrival over its own run time so far (exactly 1), and a job queued behind it is quoted
    at least what that run has run, not "no bound on the wait"."""
    devices = [Device("GPU-0", 0, None, "H100", Vec(80 * GIB, 100))]
    whole = Request(gpu_count=1, memory_bytes=60 * GIB)
    records = [Record("a", "whole", 100.0, 100.0, None)]
    views = class_views(PlacementFit(devices), {"whole": whole}, records, now=100.4)
    q = views["whole"].quote
    assert q is not None and q.rho == 0.0
    assert job_quote(q, ahead=0, waited_s=0.0) == pytest.approx(0.4)
    # the first arrival opens the span; only the class it is of counts one less
    two = [Record("a", "whole", 100.0, 100.0, 101.0), Record("b", "half", 110.0, 110.0, None)]
    stats = estimate(two, now=120.0)
    assert stats["whole"].arrival_rate == 0.0
    assert stats["half"].arrival_rate == pytest.approx(1 / 20)


def test_a_class_with_no_ended_run_counts_its_running_time() -> None:
    stats = estimate([Record("a", "big", 0.0, 0.0, None)], now=300.0)["big"]
    assert stats.completions == 0 and stats.mean_service_s == pytest.approx(300.0)


def test_packing_efficiency_is_the_busy_share_while_jobs_wait() -> None:
    from gpud.admission.quote import packing_efficiency

    # Two GPUs; a one-GPU job runs [0, 10); a two-GPU job waits over [0, 10) with one GPU
    # idle (share 1/2 busy), then runs [10, 20).
    jobs = [(0.0, 0.0, 10.0, 0.5), (0.0, 10.0, 20.0, 1.0)]
    assert packing_efficiency(jobs, now=20.0) == pytest.approx(0.5)
    assert packing_efficiency([(0.0, 0.0, 5.0, 1.0)], now=5.0) == 1.0  # nobody waited


def test_one_server_is_exact_and_many_servers_are_erlang_c_for_exponential_service() -> None:
    # M/M/1 and M/G/1 (Pollaczek-Khinchine: W = rho S (1 + cs2) / (2 (1 - rho))) at any load.
    for rho in (0.1, 0.5, 0.9, 0.95, 0.99):
        for scv in (0.0, 0.25, 1.0, 2.25, 4.0):
            exact = rho * 100.0 * (1 + scv) / (2 * (1 - rho))
            assert mgk_wait(1, rho, 100.0, scv) == pytest.approx(exact)
    # M/M/k: C(k, a) S / (k - a), with Erlang C from its closed form for two servers.
    a = 1.8
    c2 = (a**2 / 2 * 2 / (2 - a)) / (1 + a + a**2 / 2 * 2 / (2 - a))
    assert erlang_c(2, a) == pytest.approx(c2)
    assert mgk_wait(2, a, 100.0, 1.0) == pytest.approx(c2 * 100.0 / (2 - a))


@given(
    k=st.integers(1, 16),
    rho=st.floats(0.01, 0.98),
    step=st.floats(0.001, 0.5),
    scv=st.floats(0.0, 6.0),
    more=st.floats(0.001, 2.0),
)
def test_quoted_wait_grows_with_load_and_with_service_variability(
    k: int, rho: float, step: float, scv: float, more: float
) -> None:
    higher = min(rho + step * (1 - rho), 0.99)
    assert mgk_wait(k, k * higher, 100.0, scv) >= mgk_wait(k, k * rho, 100.0, scv)
    assert mgk_wait(k, k * rho, 100.0, scv + more) >= mgk_wait(k, k * rho, 100.0, scv)
    # The confidence bound is never below the estimate, and widens with the load's spread.
    assert upper_wait(k, rho, 100.0, scv, 0.01) >= mgk_wait(k, k * rho, 100.0, scv)
    assert upper_wait(k, rho, 100.0, scv, 0.02) >= upper_wait(k, rho, 100.0, scv, 0.01)


def test_packing_counts_a_device_without_mps_default_as_holding_any_number() -> None:
    """A request without a memory limit asks a device's MPS default memory limit where it
    has one and nothing where it has none: it never waits while enough devices ask nothing
    of it, and the others alone bound it otherwise (never a count so large that Erlang C's
    recursion over the servers runs for hours)."""
    devices = synthetic("A100-SXM4-40GB", 2, {0: DeviceLayout.of(True, {"3g.20gb": 2})})
    mig = [d for d in devices if d.is_mig]
    pinned = {mig[0].uuid: replace(mig[0], default_memory=12 * GIB)}
    by = {d.uuid: pinned.get(d.uuid, d) for d in devices}
    fit = PlacementFit(list(by.values()))
    one = fit.demand(Request(mig_profile="3g.20gb"))
    assert isinstance(one, Demand) and len(one.pool) == 2
    assert pack(one, by).k_eff is None  # MIG 0:1 takes any number of them
    gpus = [d for d in devices if not d.is_mig]
    by = {d.uuid: d for d in devices}
    asks = ((mig[0].uuid, Vec(12 * GIB, 0)), (mig[1].uuid, Vec(6 * GIB, 0)))
    both = Demand((mig[0].uuid, mig[1].uuid, gpus[0].uuid), Vec(0, 0), 2, asks)
    p = pack(both, by)
    # each job needs one of the MIG devices beside the GPU: 1 + 3 of them at once
    assert p.k_eff == 4 and p.vector == {"memory": 4}


def test_a_run_past_its_estimate_is_said_not_hidden_under_a_short_quote() -> None:
    """A run holding the devices has run 5 s of a class whose runs took 2 s: the model's
    2 s rests on run times it already disproves, so the job is told the run is overdue;
    one still within its estimate raises the quote to what it is expected to run still."""
    from gpud.admission.quote import Running, overdue

    q = ClassQuote("x", 0.5, 0.2, 1, 2.0, 0.0)
    late = Running("a", ran_s=5.0, estimate_s=2.0)
    assert overdue([late]) == (late,)
    assert overdue([late, Running("b", 1.0, 2.0)]) == ()  # b frees within its estimate
    assert overdue([late, Running("c", 9.0, None)]) == ()  # c has no estimate
    assert overdue([]) == ()
    assert job_quote(q, ahead=0, waited_s=0.0) == pytest.approx(2.0)
    # a long run of another class, 10 s into its 100 s: not the pool's 2 s
    long = Running("l", ran_s=10.0, estimate_s=100.0)
    assert job_quote(q, ahead=0, waited_s=0.0, running=[long]) == pytest.approx(90.0)
    # two releases needed: the second to end of the two
    short = Running("s", ran_s=1.0, estimate_s=2.0)
    assert job_quote(q, ahead=1, waited_s=0.0, running=[short, long]) == pytest.approx(90.0)
    assert job_quote(q, ahead=0, waited_s=0.0, running=[short, long]) == pytest.approx(2.0)
    # an end no estimate bounds: the pool's figure
    unknown = Running("", 0.0, None)
    assert job_quote(q, ahead=0, waited_s=0.0, running=[long, unknown]) == pytest.approx(2.0)
