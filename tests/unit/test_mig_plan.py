"""Validation against the products' MIG tables and the pure planner (no device needed)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gpud.backend.port import ComputeInstanceInfo, GpuInstanceInfo, MigMode, Placement
from gpud.errors import ConfigError, InvalidArgument
from gpud.mig.layout import DeviceLayout, load_config, resolve
from gpud.mig.plan import (
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    GpuActual,
    SetMigMode,
    Step,
    actual_layout,
    describe_difference,
    plan_all,
    plan_gpu,
    step_from_dict,
    step_to_dict,
    steps_before_reset,
)
from gpud.mig.validate import ProfileTable, validate_layout
from tests.unit.mig_tables import table_for

DATA = Path(__file__).parent.parent / "data" / "mig-parted"
H100 = "H100-SXM5-80GB"
PRODUCTS = ("A100-SXM4-40GB", "A100-SXM4-80GB", H100, "H200-SXM-141GB")
ON = MigMode(True, True)


def run(actual: GpuActual, steps: tuple[Step, ...], table: ProfileTable) -> GpuActual:
    """A model driver: applies steps with the driver's rules (no overlap, CIs first...)."""
    gis = {gi.id: gi for gi in actual.instances}
    mode = actual.mode
    next_id = max(gis, default=0) + 1
    for step in steps:
        if isinstance(step, DestroyComputeInstance):
            gi = gis[step.gpu_instance_id]
            left = tuple(c for c in gi.compute_instances if c.id != step.compute_instance_id)
            assert len(left) == len(gi.compute_instances) - 1
            gis[gi.id] = replace(gi, compute_instances=left)
        elif isinstance(step, DestroyGpuInstance):
            assert not gis[step.gpu_instance_id].compute_instances, "destroy CIs first"
            del gis[step.gpu_instance_id]
        elif isinstance(step, SetMigMode):
            assert not gis, "MIG mode changes with instances present"
            mode = MigMode(step.enabled, step.enabled)
        elif isinstance(step, CreateGpuInstance):
            assert mode.current
            assert step.placement in table.placements[step.profile_id]
            for gi in gis.values():
                a, b = gi.placement, step.placement
                assert a.start + a.size <= b.start or b.start + b.size <= a.start, "overlap"
            gis[next_id] = GpuInstanceInfo(next_id, step.profile_id, step.placement)
            next_id += 1
        elif isinstance(step, CreateComputeInstance):
            (gi,) = [
                g
                for g in gis.values()
                if g.placement == step.gpu_instance_placement
                and g.profile_id == step.gpu_instance_profile_id
            ]
            ci = ComputeInstanceInfo(len(gi.compute_instances), step.profile_id, Placement(0, 1))
            gis[gi.id] = replace(gi, compute_instances=(*gi.compute_instances, ci))
    return GpuActual(actual.gpu, mode, tuple(gis.values()))


def layout(**counts: int) -> DeviceLayout:
    return DeviceLayout.of(
        True, {k.replace("_", ".").replace("p", "+"): v for k, v in counts.items()}
    )


def apply_from(actual: GpuActual, desired: DeviceLayout, table: ProfileTable) -> GpuActual:
    plan = plan_gpu(actual, desired, table)
    return run(actual, plan.steps, table)


EMPTY = GpuActual(0, ON, ())


@pytest.mark.parametrize("product", PRODUCTS)
def test_published_configs_validate_and_apply(product: str) -> None:
    cfg = load_config(DATA / "config.yaml")
    table = table_for(product)
    names = {p.name for p in table.gi_profiles}
    applied = 0
    for name in cfg.configs:
        if name == "custom-config":
            continue  # an eight-GPU node
        layouts = resolve(cfg.config(name), [table.identity])
        if 0 not in layouts:
            continue
        wanted = layouts[0]
        if any(p.gi_name not in names for p, _ in wanted.devices):
            continue  # another product's profile names
        validate_layout(table, wanted)
        after = apply_from(EMPTY, wanted, table)
        assert actual_layout(after, table) == wanted, name
        assert plan_gpu(after, wanted, table).empty, f"{name}: applying twice is a no-op"
        applied += 1
    assert applied >= 4


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("too-many-slices", "too many slices: 8 compute slices requested, the GPU has 7"),
        ("too-many-instances", "too many 1g.10gb instances: 8 requested, at most 7 fit"),
        (
            "placements-collide",
            "no placement fits 1g.20gb after placing 4g.40gb at 0-3, 1g.20gb at 4-5, 1g.20gb at 6-7",
        ),
        ("unknown-profile", "unknown MIG profile '1g.5gb' for this product"),
    ],
)
def test_impossible_layouts_are_refused_with_the_reason(config: str, message: str) -> None:
    cfg = load_config(DATA / "impossible.yaml")
    table = table_for(H100, index=3)
    wanted = resolve(cfg.config(config), [table.identity])[3]
    with pytest.raises(InvalidArgument) as err:
        validate_layout(table, wanted)
    text = str(err.value)
    assert text.startswith("mig-devices: GPU 3 (H100-SXM5-80GB): ")
    assert message in text


def test_collision_names_the_slices() -> None:
    table = table_for(H100)
    with pytest.raises(InvalidArgument) as err:
        validate_layout(table, layout(**{"4g_40gb": 1, "1g_20gb": 3}))
    assert "slices 0-1 collide with 4g.40gb at 0-3" in str(err.value)
    assert "slices 6-7 collide with 1g.20gb at 6-7" in str(err.value)


def test_larger_profiles_get_their_specific_starts() -> None:
    table = table_for(H100)
    placed = validate_layout(table, layout(**{"3g_40gb": 1, "2g_20gb": 1, "1g_10gb": 2}))
    by_name = sorted((a.wanted.gi.name, a.placement.start) for a in placed)
    # 3g.40gb must take 4-7 so that 2g.20gb (0, 2 or 4) and the two 1g fit below it
    assert by_name == [("1g.10gb", 2), ("1g.10gb", 3), ("2g.20gb", 0), ("3g.40gb", 4)]


def test_ci_profiles_smaller_than_their_gpu_instance() -> None:
    table = table_for(H100)
    wanted = DeviceLayout.of(True, {"1c.3g.40gb": 2, "1g.10gb": 0})
    after = apply_from(EMPTY, wanted, table)
    assert actual_layout(after, table) == wanted
    assert [c.profile_id for gi in after.instances for c in gi.compute_instances] == [0, 0]
    with pytest.raises(InvalidArgument, match=r"no 5-slice compute instance profile in 7g\.80gb"):
        validate_layout(table, DeviceLayout.of(True, {"5c.7g.80gb": 1}))


def test_mig_mode_steps_and_pending_reset() -> None:
    table = table_for(H100)
    off = GpuActual(0, MigMode(False, False), ())
    plan = plan_gpu(off, layout(**{"7g_80gb": 1}), table)
    assert isinstance(plan.steps[0], SetMigMode) and plan.steps[0].enabled
    assert plan.reset_pending
    # already pending: no second mode change, still pending
    pending = GpuActual(0, MigMode(False, True), ())
    plan = plan_gpu(pending, layout(**{"7g_80gb": 1}), table)
    assert not any(isinstance(s, SetMigMode) for s in plan.steps) and plan.reset_pending
    # disabling: destroy everything, then the mode
    full = apply_from(EMPTY, layout(**{"1g_10gb": 7}), table)
    plan = plan_gpu(full, DeviceLayout(False), table)
    kinds = [type(s).__name__ for s in plan.steps]
    assert kinds == ["DestroyComputeInstance"] * 7 + ["DestroyGpuInstance"] * 7 + ["SetMigMode"]
    assert plan.reset_pending
    assert plan_gpu(GpuActual(0, MigMode(False, False), ()), DeviceLayout(False), None).empty


def test_the_steps_an_apply_runs_before_a_pending_reset_stops_it() -> None:
    table = table_for(H100)
    want = layout(**{"7g_80gb": 1})
    off = GpuActual(0, MigMode(False, False), ())
    plan = plan_gpu(off, want, table)
    # a product that switches at once does not stop; one that waits for a reset stops
    # after the mode change, before any instance is created
    assert steps_before_reset(off, plan, mode_needs_reset=False) is None
    assert steps_before_reset(off, plan, mode_needs_reset=True) == (SetMigMode(0, True),)
    # already pending: it stops before the first step, whatever the product
    pending = GpuActual(0, MigMode(False, True), ())
    assert steps_before_reset(pending, plan_gpu(pending, want, table), mode_needs_reset=False) == ()
    # disabling: every destroy and the mode change run, then it stops
    full = apply_from(EMPTY, layout(**{"1g_10gb": 7}), table)
    plan = plan_gpu(full, DeviceLayout(False), table)
    assert steps_before_reset(full, plan, mode_needs_reset=True) == plan.steps
    # no mode change: nothing waits for a reset
    plan = plan_gpu(full, layout(**{"7g_80gb": 1}), table)
    assert steps_before_reset(full, plan, mode_needs_reset=True) is None


def test_matching_instances_are_kept() -> None:
    table = table_for(H100)
    all_1g = apply_from(EMPTY, layout(**{"1g_10gb": 7}), table)
    plan = plan_gpu(all_1g, layout(**{"1g_10gb": 2, "2g_20gb": 1, "3g_40gb": 1}), table)
    destroyed = [s for s in plan.steps if isinstance(s, DestroyGpuInstance)]
    assert len(destroyed) == 5, "two 1g.10gb stay"
    # a GPU instance that lost its compute instance is kept and refilled
    gi = all_1g.instances[0]
    half = replace(all_1g, instances=(replace(gi, compute_instances=()), *all_1g.instances[1:]))
    plan = plan_gpu(half, layout(**{"1g_10gb": 7}), table)
    assert [type(s).__name__ for s in plan.steps] == ["CreateComputeInstance"]


def test_steps_round_trip_through_json() -> None:
    table = table_for(H100)
    all_1g = apply_from(EMPTY, layout(**{"1g_10gb": 7}), table)
    plan = plan_gpu(all_1g, layout(**{"3g_40gb": 2}), table)
    assert tuple(step_from_dict(step_to_dict(s)) for s in plan.steps) == plan.steps
    assert all(s.describe().startswith("GPU 0: ") for s in plan.steps)


def _valid_layouts(product: str) -> st.SearchStrategy[DeviceLayout]:
    table = table_for(product)
    names = [p.name for p in table.gi_profiles]
    ci_names = [
        f"{c.slice_count}c.{p.name}"
        for p in table.gi_profiles
        for c in table.ci_profiles[p.id]
        if c.slice_count < p.slice_count
    ]
    return st.lists(st.sampled_from(names + ci_names), max_size=8).map(
        lambda picks: DeviceLayout.of(
            True, {k: len(list(g)) for k, g in itertools.groupby(sorted(picks))}
        )
    )


def _fits(table: ProfileTable, desired: DeviceLayout) -> bool:
    try:
        validate_layout(table, desired)
    except InvalidArgument:
        return False
    return True


def _shape(gi: GpuInstanceInfo) -> tuple[object, ...]:
    """What makes two GPU instances interchangeable: profile, placement, compute instances."""
    cis = sorted((ci.profile_id, ci.placement) for ci in gi.compute_instances)
    return (gi.profile_id, gi.placement, tuple(cis))


def matching_destroyed(start: GpuActual, steps: tuple[Step, ...], after: GpuActual) -> list[str]:
    """Intact instances of ``start`` that the end has too (same profile, placement and compute
    instances) but that ``steps`` destroyed or replaced (the end holds another id there)."""
    destroyed = {s.gpu_instance_id for s in steps if isinstance(s, DestroyGpuInstance)}
    after_ids = {gi.id for gi in after.instances}
    wanted = {_shape(gi) for gi in after.instances}
    return [
        f"GPU instance {gi.id} ({gi.placement}) matched the target and was recreated"
        for gi in start.instances
        if gi.compute_instances
        and _shape(gi) in wanted
        and (gi.id in destroyed or gi.id not in after_ids)
    ]


def test_a_destroy_and_recreate_of_a_matching_instance_is_caught() -> None:
    """The check above can fail: a plan that destroys an instance the target keeps, and
    creates the same one again, converges to the same layout under a new id."""
    table = table_for(H100)
    start = apply_from(EMPTY, layout(**{"3g_40gb": 1, "1g_10gb": 1}), table)
    gi = next(g for g in start.instances if g.placement.size == 4)
    ci = gi.compute_instances[0]
    name = table.gi_profile(gi.profile_id).name
    wasteful: tuple[Step, ...] = (
        DestroyComputeInstance(0, gi.id, ci.id, name),
        DestroyGpuInstance(0, gi.id, name, gi.placement),
        CreateGpuInstance(0, gi.profile_id, name, gi.placement),
        CreateComputeInstance(0, gi.profile_id, gi.placement, ci.profile_id, name),
    )
    after = run(start, wasteful, table)
    assert actual_layout(after, table) == actual_layout(start, table)  # looks the same
    assert matching_destroyed(start, wasteful, after) != []
    assert matching_destroyed(start, (), start) == []


@pytest.mark.parametrize("product", [H100, "A100-SXM4-40GB"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data())
def test_any_valid_layout_to_any_other(product: str, data: st.DataObject) -> None:
    table = table_for(product)
    first = data.draw(_valid_layouts(product))
    assume(_fits(table, first))
    second = data.draw(_valid_layouts(product))
    assume(_fits(table, second))
    start = apply_from(EMPTY, first, table)
    assert actual_layout(start, table) == first
    # a crash may have left some compute instances gone: the plan still converges
    ids = [gi.id for gi in start.instances]
    drop = data.draw(st.sets(st.sampled_from(ids), max_size=2)) if ids else set()
    start = replace(
        start,
        instances=tuple(
            replace(gi, compute_instances=()) if gi.id in drop else gi for gi in start.instances
        ),
    )
    plan = plan_gpu(start, second, table)
    after = run(start, plan.steps, table)
    assert actual_layout(after, table) == second
    assert all(len(gi.compute_instances) == 1 for gi in after.instances), "no orphans"
    assert plan_gpu(after, second, table).empty
    # instances that already match are never destroyed and recreated: an intact instance of
    # the start whose profile, placement and compute instances the end has too is the very
    # same instance (same id) at the end, and no step destroyed it
    assert matching_destroyed(start, plan.steps, after) == []
    if first == second and not drop:
        assert not plan.steps


def test_describe_difference_says_what_is_there_and_what_is_wanted() -> None:
    table = table_for(H100)
    wanted = layout(**{"3g_40gb": 2})
    start = apply_from(EMPTY, layout(**{"1g_10gb": 2}), table)
    plan = plan_gpu(start, wanted, table)
    assert describe_difference(start, wanted, table, plan) == (
        f"GPU 0: has 2x 1g.10gb; wants 2x 3g.40gb ({len(plan.steps)} steps)"
    )
    # a GPU instance left without its compute instance, and a mode change waiting for a reset
    bare = replace(
        start,
        mode=MigMode(True, False),
        instances=(replace(start.instances[0], compute_instances=()), start.instances[1]),
    )
    text = describe_difference(bare, wanted, table, plan_gpu(bare, wanted, table))
    assert text.startswith(
        "GPU 0: has 1x 1g.10gb (MIG mode disabled pending a GPU reset); GPU instances without "
        f"compute instances: {start.instances[0].id}; wants 2x 3g.40gb ("
    )
    off = GpuActual(3, MigMode(False, True), ())
    text = describe_difference(off, wanted, table, plan_gpu(off, wanted, table))
    assert text.startswith("GPU 3: has MIG disabled (MIG mode enabled pending a GPU reset);")


def test_mode_steps_describe_themselves_and_mark_the_plan() -> None:
    assert SetMigMode(2, True).describe() == "GPU 2: set MIG mode enabled"
    assert SetMigMode(0, False).describe() == "GPU 0: set MIG mode disabled"
    table = table_for(H100)
    off = GpuActual(0, MigMode(False, False), ())
    assert plan_gpu(off, layout(**{"7g_80gb": 1}), table).changes_mode()
    assert not plan_gpu(EMPTY, layout(**{"7g_80gb": 1}), table).changes_mode()


def test_the_steps_name_gpu_instances_and_profiles() -> None:
    table = table_for(H100)
    start = replace(apply_from(EMPTY, layout(**{"1g_10gb": 1, "1c_3g_40gb": 1}), table), gpu=3)
    one = next(gi for gi in start.instances if gi.placement.size == 1)
    three = next(gi for gi in start.instances if gi.placement.size == 4)
    plan = plan_gpu(start, layout(**{"3g_40gb": 1}), table)
    assert plan.gpu == 3 and not plan.reset_pending
    # the 1g instance goes; the 3g one keeps its GPU instance and gets a full compute instance
    assert plan.steps == (
        DestroyComputeInstance(3, one.id, one.compute_instances[0].id, "1g.10gb"),
        DestroyComputeInstance(3, three.id, three.compute_instances[0].id, "1c.3g.40gb"),
        DestroyGpuInstance(3, one.id, "1g.10gb", one.placement),
        CreateComputeInstance(3, three.profile_id, three.placement, 2, "3g.40gb"),
    )
    create = plan_gpu(replace(EMPTY, gpu=3), layout(**{"7g_80gb": 1}), table)
    assert create.steps == (
        CreateGpuInstance(3, 0, "7g.80gb", Placement(0, 8)),
        CreateComputeInstance(3, 0, Placement(0, 8), 4, "7g.80gb"),
    )


def test_turning_mig_off_needs_no_table_and_names_what_it_does_not_know() -> None:
    table = table_for(H100)
    start = replace(apply_from(EMPTY, layout(**{"7g_80gb": 1}), table), gpu=2)
    gi = start.instances[0]
    plan = plan_gpu(start, DeviceLayout(False), None)
    assert plan.gpu == 2 and plan.reset_pending
    assert plan.steps == (
        DestroyComputeInstance(2, gi.id, gi.compute_instances[0].id, "profile 4 in profile 0"),
        DestroyGpuInstance(2, gi.id, "profile 0", gi.placement),
        SetMigMode(2, False),
    )
    with_table = plan_gpu(start, DeviceLayout(False), table)
    assert [s.describe() for s in with_table.steps][1] == (
        f"GPU 2: destroy GPU instance {gi.id} (7g.80gb at 0:8)"
    )
    with pytest.raises(ValueError, match=r"^a MIG-enabled layout needs the GPU's profile table$"):
        plan_gpu(start, layout(**{"7g_80gb": 1}), None)


def test_plan_all_plans_the_gpus_with_a_desired_layout() -> None:
    table = table_for(H100)
    gpus = [replace(EMPTY, gpu=i) for i in range(3)]
    plans = plan_all(gpus, {0: layout(**{"7g_80gb": 1}), 2: DeviceLayout(False)}, {0: table})
    assert [p.gpu for p in plans] == [0, 2]
    assert [type(s).__name__ for s in plans[0].steps] == [
        "CreateGpuInstance",
        "CreateComputeInstance",
    ]
    assert plans[1].steps == (SetMigMode(2, False),) and plans[1].reset_pending


def test_a_file_that_is_no_layout_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^/dev/zero: cannot read: not a regular file$"):
        load_config(Path("/dev/zero"))
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (128 * 1024 + 1))
    with pytest.raises(ConfigError, match=r"big\.yaml: cannot read: 131073 bytes, more than a mig"):
        load_config(big)
    binary = tmp_path / "image.bin"
    binary.write_bytes(b"\xff" * 10)
    with pytest.raises(ConfigError, match=r"image\.bin: not UTF-8 text \(byte 0\)$"):
        load_config(binary)
