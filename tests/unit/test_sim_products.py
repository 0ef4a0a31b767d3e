"""The simulated products carry NVIDIA's MIG tables (MIG user guide, nvidia-smi mig -lgip/-lgipp)."""

from __future__ import annotations

import pytest

from gpud.backend.sim import parse_simulate_spec, products
from gpud.errors import ConfigError


def _profiles(key: str) -> dict[str, products.GiProfileSpec]:
    return {p.name: p for p in products.PRODUCTS[key].mig_profiles}


def test_a100_40gb_matches_lgip() -> None:
    p = _profiles("A100-SXM4-40GB")
    assert {n: v.id for n, v in p.items()} == {
        "1g.5gb": 19,
        "1g.5gb+me": 20,
        "1g.10gb": 15,
        "2g.10gb": 14,
        "3g.20gb": 9,
        "4g.20gb": 5,
        "7g.40gb": 0,
    }
    assert p["1g.5gb"].instance_count == 7 and p["1g.5gb"].memory_mib == 4864
    assert p["1g.10gb"].placements == ((0, 2), (2, 2), (4, 2), (6, 2))
    assert p["2g.10gb"].placements == ((0, 2), (2, 2), (4, 2))
    assert p["3g.20gb"].placements == ((0, 4), (4, 4))
    assert p["4g.20gb"].placements == ((0, 4),)
    assert p["7g.40gb"].placements == ((0, 8),) and p["7g.40gb"].sm == 98


def test_h100_matches_lgip() -> None:
    p = _profiles("H100-SXM5-80GB")
    assert [(v.name, v.id, v.instance_count, v.sm) for v in p.values()] == [
        ("1g.10gb", 19, 7, 16),
        ("1g.10gb+me", 20, 1, 16),
        ("1g.20gb", 15, 4, 26),
        ("2g.20gb", 14, 3, 32),
        ("3g.40gb", 9, 2, 60),
        ("4g.40gb", 5, 1, 64),
        ("7g.80gb", 0, 1, 132),
    ]
    assert p["1g.10gb"].starts == (0, 1, 2, 3, 4, 5, 6)
    assert products.PRODUCTS["H100-SXM5-80GB"].pci_device_id == 0x233010DE


def test_h200_and_a100_80gb_names() -> None:
    assert list(_profiles("H200-SXM-141GB")) == [
        "1g.18gb",
        "1g.18gb+me",
        "1g.35gb",
        "2g.35gb",
        "3g.71gb",
        "4g.71gb",
        "7g.141gb",
    ]
    assert "7g.80gb" in _profiles("A100-SXM4-80GB")


def test_compute_instance_profiles_of_a_3g() -> None:
    spec = products.PRODUCTS["H100-SXM5-80GB"]
    cis = spec.ci_profiles(_profiles("H100-SXM5-80GB")["3g.40gb"])
    assert [(c.name, c.constant, c.instance_count, c.sm) for c in cis] == [
        ("1c.3g.40gb", 0, 3, 16),
        ("2c.3g.40gb", 1, 1, 32),
        ("3g.40gb", 2, 1, 60),
    ]
    seven = spec.ci_profiles(_profiles("H100-SXM5-80GB")["7g.80gb"])
    assert [c.name for c in seven] == [
        "1c.7g.80gb",
        "2c.7g.80gb",
        "3c.7g.80gb",
        "4c.7g.80gb",
        "7g.80gb",
    ]


def test_product_key_from_nvml_name() -> None:
    assert products.product_key_for("NVIDIA H100 80GB HBM3", 81559 * 2**20) == "H100-SXM5-80GB"
    assert products.product_key_for("NVIDIA H200", 143771 * 2**20) == "H200-SXM-141GB"
    assert products.product_key_for("Tesla T4", 15360 * 2**20) is None


def test_parse_simulate_spec() -> None:
    assert parse_simulate_spec(None) == [("H100-SXM5-80GB", 8)]
    assert parse_simulate_spec("H100-SXM5-80GB:8,A100-SXM4-40GB:2") == [
        ("H100-SXM5-80GB", 8),
        ("A100-SXM4-40GB", 2),
    ]
    assert parse_simulate_spec("nvidia h100 80gb hbm3:2, h200") == [
        ("H100-SXM5-80GB", 2),
        ("H200-SXM-141GB", 1),
    ]


@pytest.mark.parametrize(
    "bad", ["Z80:1", "H100-SXM5-80GB:x", "H100-SXM5-80GB:0", "H100-SXM5-80GB:500"]
)
def test_parse_simulate_spec_rejects(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_simulate_spec(bad)
    if bad.startswith("Z80"):
        assert "Z80" in str(info.value) and "A100-SXM4-40GB" in str(info.value)
