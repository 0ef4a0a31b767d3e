"""What ``gpuctl mig apply`` says when a layout cannot be: the exact messages and fields."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpud.errors import InvalidArgument
from gpud.mig.layout import DeviceLayout
from gpud.mig.validate import validate_layout
from tests.unit.mig_tables import table_for
from tests.unit.test_mig_plan import layout

H100 = "GPU 0 (H100-SXM5-80GB)"


def _refusal(layout_: DeviceLayout, **identity: object) -> tuple[str, str | None]:
    table = table_for("H100-SXM5-80GB")
    if identity:
        table = replace(table, identity=replace(table.identity, **identity))
    with pytest.raises(InvalidArgument) as err:
        validate_layout(table, layout_)
    return str(err.value), err.value.field


def test_a_gpu_without_mig() -> None:
    assert _refusal(layout(**{"3g_40gb": 1}), mig_capable=False) == (
        f"mig-enabled: {H100}: does not support MIG",
        "mig-enabled",
    )


def test_unknown_profiles_list_the_known_ones() -> None:
    assert _refusal(layout(**{"9g_90gb": 1})) == (
        f"mig-devices: {H100}: unknown MIG profile '9g.90gb' for this product (known: "
        "1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb)",
        "mig-devices",
    )
    assert _refusal(DeviceLayout.of(True, {"5c.7g.80gb": 1})) == (
        f"mig-devices: {H100}: no 5-slice compute instance profile in 7g.80gb (known: "
        "1c.7g.80gb, 2c.7g.80gb, 3c.7g.80gb, 4c.7g.80gb, 7g.80gb)",
        "mig-devices",
    )


def test_counts_slices_and_memory() -> None:
    assert _refusal(layout(**{"1g_10gb": 8})) == (
        f"mig-devices: {H100}: too many 1g.10gb instances: 8 requested, at most 7 fit",
        "mig-devices",
    )
    assert _refusal(layout(**{"4g_40gb": 1, "3g_40gb": 1, "1g_10gb": 1})) == (
        f"mig-devices: {H100}: too many slices: 8 compute slices requested, the GPU has 7",
        "mig-devices",
    )
    assert _refusal(layout(**{"3g_40gb": 1}), memory_total_bytes=30 << 30) == (
        f"mig-devices: {H100}: too much memory: 39.5 GiB requested, the GPU has 30.0 GiB",
        "mig-devices",
    )
    # exactly the profile's memory is enough
    table = table_for("H100-SXM5-80GB")
    three = table.gi_profile_named("3g.40gb")
    assert three is not None
    exact = replace(table, identity=replace(table.identity, memory_total_bytes=three.memory_bytes))
    assert len(validate_layout(exact, layout(**{"3g_40gb": 1}))) == 1


def test_placements_that_collide_are_named() -> None:
    placed = "3g.40gb at 0-3, 3g.40gb at 4-7"
    assert _refusal(layout(**{"3g_40gb": 2, "1g_10gb": 1})) == (
        f"mig-devices: {H100}: no placement fits 1g.10gb after placing {placed} "
        "(memory slices 8): "
        + "; ".join(
            f"slice {i} collides with 3g.40gb at {'0-3' if i < 4 else '4-7'}" for i in range(7)
        ),
        "mig-devices",
    )
    assert _refusal(layout(**{"3g_40gb": 2, "1g_20gb": 1})) == (
        f"mig-devices: {H100}: no placement fits 1g.20gb after placing {placed} "
        "(memory slices 8): slices 0-1 collide with 3g.40gb at 0-3; slices 2-3 collide with "
        "3g.40gb at 0-3; slices 4-5 collide with 3g.40gb at 4-7; slices 6-7 collide with "
        "3g.40gb at 4-7",
        "mig-devices",
    )


def test_larger_profiles_are_placed_first() -> None:
    table = table_for("H100-SXM5-80GB")
    placed = validate_layout(table, layout(**{"1g_10gb": 2, "2g_20gb": 1, "1g_20gb": 1}))
    order = [a.wanted.gi.name for a in placed]
    # two memory slices before one; among them more compute slices first
    assert order == ["2g.20gb", "1g.20gb", "1g.10gb", "1g.10gb"]
