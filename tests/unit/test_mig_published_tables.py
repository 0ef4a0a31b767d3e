"""Every modelled product's MIG profiles against NVIDIA's published values, written out here
independently of gpud/backend/products.py.

Sources: the NVIDIA Multi-Instance GPU User Guide, "Supported MIG Profiles" (per product:
fraction of memory, fraction of SMs, number of instances available) and its placement
figure, which ``nvidia-smi mig -lgipp`` prints as ``{0,2,4,6}:2`` (start slices : size);
profile ids and SM counts as ``nvidia-smi mig -lgip`` prints them on each product.
"""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

import pytest

from gpud.backend.products import PRODUCTS
from tests.unit.mig_tables import table_for

GB = 10**9


class Row(NamedTuple):
    name: str
    profile_id: int  # -lgip ID
    memory: Fraction  # fraction of the GPU's memory (of 8 memory slices)
    sms: Fraction  # fraction of SMs (of 7 compute slices)
    instances: int  # number of instances available on an empty GPU
    starts: tuple[int, ...]  # -lgipp placement starts
    size: int  # -lgipp placement size, in memory slices


def _rows(names: tuple[str, ...]) -> tuple[Row, ...]:
    """The seven-slice family shared by A100, H100 and H200: only the names (their
    memory) differ. The 1g profile with two memory slices sits at {0,2,4,6}:2."""
    one, one_me, one_double, two, three, four, seven = names
    f = Fraction
    return (
        Row(one, 19, f(1, 8), f(1, 7), 7, (0, 1, 2, 3, 4, 5, 6), 1),
        Row(one_me, 20, f(1, 8), f(1, 7), 1, (0, 1, 2, 3, 4, 5, 6), 1),
        Row(one_double, 15, f(2, 8), f(1, 7), 4, (0, 2, 4, 6), 2),
        Row(two, 14, f(2, 8), f(2, 7), 3, (0, 2, 4), 2),
        Row(three, 9, f(4, 8), f(3, 7), 2, (0, 4), 4),
        Row(four, 5, f(4, 8), f(4, 7), 1, (0,), 4),
        Row(seven, 0, f(8, 8), f(7, 7), 1, (0,), 8),
    )


# product -> (nominal memory in GB, published rows, SMs per profile as -lgip prints them)
PUBLISHED: dict[str, tuple[int, tuple[Row, ...], tuple[int, ...]]] = {
    "A100-SXM4-40GB": (
        40,
        _rows(("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb")),
        (14, 14, 14, 28, 42, 56, 98),
    ),
    "A100-SXM4-80GB": (
        80,
        _rows(("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")),
        (14, 14, 14, 28, 42, 56, 98),
    ),
    "H100-SXM5-80GB": (
        80,
        _rows(("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")),
        (16, 16, 26, 32, 60, 64, 132),
    ),
    "H200-SXM-141GB": (
        141,
        _rows(("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb")),
        (16, 16, 26, 32, 60, 64, 132),
    ),
}


def test_every_modelled_mig_product_is_checked() -> None:
    mig_products = {key for key, spec in PRODUCTS.items() if spec.mig_capable}
    assert mig_products == set(PUBLISHED)


@pytest.mark.parametrize("product", sorted(PUBLISHED))
def test_profiles_ids_and_counts_are_nvidias(product: str) -> None:
    _, rows, sms = PUBLISHED[product]
    table = table_for(product)
    assert sorted(p.name for p in table.gi_profiles) == sorted(r.name for r in rows)
    for row, sm_count in zip(rows, sms, strict=True):
        p = table.gi_profile_named(row.name)
        assert p is not None, row.name
        assert p.id == row.profile_id, row.name
        assert Fraction(p.slice_count, 7) == row.sms, row.name
        assert Fraction(p.memory_slices, 8) == row.memory, row.name
        assert p.instance_count == row.instances, row.name
        assert p.multiprocessor_count == sm_count, row.name


@pytest.mark.parametrize("product", sorted(PUBLISHED))
def test_placements_are_nvidias(product: str) -> None:
    _, rows, _ = PUBLISHED[product]
    table = table_for(product)
    for row in rows:
        p = table.gi_profile_named(row.name)
        assert p is not None
        placements = table.placements[p.id]
        assert tuple(pl.start for pl in placements) == row.starts, row.name
        assert {pl.size for pl in placements} == {row.size}, row.name
        # as many fit side by side on an empty GPU as the table says (media extensions: one)
        disjoint = len({pl.start // row.size for pl in placements})
        assert disjoint >= row.instances, row.name


@pytest.mark.parametrize("product", sorted(PUBLISHED))
def test_memory_sizes_follow_the_published_fractions(product: str) -> None:
    nominal_gb, rows, _ = PUBLISHED[product]
    table = table_for(product)
    total = table.identity.memory_total_bytes
    for row in rows:
        p = table.gi_profile_named(row.name)
        assert p is not None
        # the driver keeps a little of each slice: a profile has at most its fraction of the
        # GPU's memory and at least 90 % of it
        share = Fraction(p.memory_bytes, total)
        assert row.memory * Fraction(9, 10) <= share <= row.memory, (row.name, float(share))
        # the name's size is the fraction of the nominal memory, rounded half up ("3g.71gb")
        named_gb = int(row.name.split(".")[1].split("gb")[0])
        assert named_gb == int(row.memory * nominal_gb + Fraction(1, 2)), row.name


# Hardware units per profile, in -lgip order (CE, NVDEC, JPEG, OFA; no profile has an
# NVENC): the "Hardware Units" and "Copy Engines" columns of the A100 table, and -lgip on
# H100 and H200 (same GH100 die).
_A100_UNITS = ((1, 0, 0, 0), (1, 1, 1, 1), (1, 1, 0, 0), (2, 1, 0, 0), (3, 2, 0, 0),
               (4, 2, 0, 0), (7, 5, 1, 1))  # fmt: skip
_HOPPER_UNITS = ((1, 1, 1, 0), (1, 1, 1, 1), (1, 1, 1, 0), (2, 2, 2, 0), (3, 3, 3, 0),
                 (4, 4, 4, 0), (8, 7, 7, 1))  # fmt: skip
UNITS = {
    "A100-SXM4-40GB": _A100_UNITS,
    "A100-SXM4-80GB": _A100_UNITS,
    "H100-SXM5-80GB": _HOPPER_UNITS,
    "H200-SXM-141GB": _HOPPER_UNITS,
}
# NVML_GPU_INSTANCE_PROFILE_* constant of each row: 1_SLICE, 1_SLICE_REV1 (+me),
# 1_SLICE_REV2 (two memory slices), 2_SLICE, 3_SLICE, 4_SLICE, 7_SLICE (nvml.h)
CONSTANTS = (0x0, 0x7, 0x9, 0x1, 0x2, 0x3, 0x4)


@pytest.mark.parametrize("product", sorted(PUBLISHED))
def test_hardware_units_and_constants_are_nvidias(product: str) -> None:
    _, rows, _ = PUBLISHED[product]
    table = table_for(product)
    for row, units, constant in zip(rows, UNITS[product], CONSTANTS, strict=True):
        p = table.gi_profile_named(row.name)
        assert p is not None
        got = (p.copy_engine_count, p.decoder_count, p.jpeg_count, p.ofa_count)
        assert got == units, row.name
        assert p.encoder_count == 0 and p.profile == constant, row.name


@pytest.mark.parametrize("product", sorted(PUBLISHED))
def test_compute_instance_profiles_are_nvidias(product: str) -> None:
    """``nvidia-smi mig -lcip``: a GPU instance of s compute slices offers c-slice compute
    instances (``1c.3g.40gb``) for c = 1, 2, 3, 4 below s, s // c of them, and one full-size
    one named as the GPU instance; a c-slice one has the SMs of the c-slice GPU instance."""
    _, rows, sms = PUBLISHED[product]
    table = table_for(product)
    # SMs of the plain c-slice GPU instance: 1g (first row), 2g, 3g, 4g, 7g
    sm_of_slices = {1: sms[0], 2: sms[3], 3: sms[4], 4: sms[5], 7: sms[6]}
    for row in rows:
        p = table.gi_profile_named(row.name)
        assert p is not None
        s = p.slice_count
        want = [(f"{c}c.{row.name}", c, s // c, sm_of_slices[c]) for c in (1, 2, 3, 4) if c < s]
        want.append((row.name, s, 1, p.multiprocessor_count))
        got = [
            (c.name, c.slice_count, c.instance_count, c.multiprocessor_count)
            for c in table.ci_profiles[p.id]
        ]
        assert got == want, row.name
        # NVML_COMPUTE_INSTANCE_PROFILE_<c>_SLICE: 1 -> 0, 2 -> 1, 3 -> 2, 4 -> 3, 7 -> 4
        ids = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}
        assert [c.profile for c in table.ci_profiles[p.id]] == [ids[c[1]] for c in want]
