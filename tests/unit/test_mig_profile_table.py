"""Reading one GPU's MIG tables (``load_table``): what the driver lists, and what stands in
for the compute instance profiles it lists only from an existing GPU instance."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from gpud.backend.port import ComputeInstanceProfile, GpuIdentity, GpuInstanceProfile, Placement
from gpud.errors import DeviceNotFound, NotFound
from gpud.mig.validate import load_table, reference_table
from tests.unit.mig_tables import identity_for, table_for

H100 = "H100-SXM5-80GB"


@dataclass
class FakeDriver:
    """The four MIG table queries of the backend port, for one GPU."""

    ident: GpuIdentity
    profiles: tuple[GpuInstanceProfile, ...]
    cis: dict[int, tuple[ComputeInstanceProfile, ...]] = field(default_factory=dict)
    missing: type[Exception] = NotFound  # what the driver raises without a GPU instance
    asked: set[object] = field(default_factory=set)  # the GPUs the calls named

    def identity(self, gpu: int) -> GpuIdentity:
        self.asked.add(gpu)
        return self.ident

    def gpu_instance_profiles(self, gpu: int) -> list[GpuInstanceProfile]:
        self.asked.add(gpu)
        return list(self.profiles)

    def gpu_instance_placements(self, gpu: int, profile_id: int) -> list[Placement]:
        self.asked.add(gpu)
        return [Placement(profile_id % 7, 1)]

    def compute_instance_profiles(self, gpu: int, profile_id: int) -> list[ComputeInstanceProfile]:
        self.asked.add(gpu)
        if profile_id not in self.cis:
            raise self.missing("no GPU instance of that profile")
        return list(self.cis[profile_id])


def _gi(pid: int, name: str, slices: int, sms: int) -> GpuInstanceProfile:
    return GpuInstanceProfile(pid, pid, name, slices, 10 << 30, slices, 1, sms, 1, 0, 0, 0, 0)


def test_what_the_driver_lists_is_used_and_marks_the_table_complete() -> None:
    ref = table_for(H100)
    three = ref.gi_profile_named("3g.40gb")
    assert three is not None
    own = (ComputeInstanceProfile(2, 2, "3g.40gb", 3, 1, 60),)
    driver = FakeDriver(identity_for(H100), (three,), {three.id: own})
    table = load_table(driver, 5)  # type: ignore[arg-type]
    assert driver.asked == {5}
    assert table.from_device is True
    assert table.gi_profiles == (three,)
    assert table.placements == {three.id: (Placement(three.id % 7, 1),)}
    assert table.ci_profiles == {three.id: own}
    assert table.identity == identity_for(H100)


def test_the_published_table_stands_in_for_unlisted_compute_profiles() -> None:
    ref = table_for(H100)
    gis = ref.gi_profiles
    for missing in (NotFound, DeviceNotFound):
        driver = FakeDriver(identity_for(H100), gis, missing=missing)
        table = load_table(driver, 0)  # type: ignore[arg-type]
        assert table.from_device is False
        assert table.ci_profiles == {g.id: ref.ci_profiles[g.id] for g in gis}


def test_an_unknown_product_gets_nvmls_fixed_compute_profiles() -> None:
    ident = replace(identity_for(H100), product="Z100-42GB", name="NVIDIA Z100")
    assert reference_table(ident) is None
    gis = (_gi(19, "1g.6gb", 1, 16), _gi(9, "3g.21gb", 3, 60), _gi(0, "7g.42gb", 7, 132))
    table = load_table(FakeDriver(ident, gis), 0)  # type: ignore[arg-type]
    rows = {
        gi: [(c.id, c.profile, c.name, c.slice_count, c.instance_count, c.multiprocessor_count)
             for c in cis]
        for gi, cis in table.ci_profiles.items()
    }  # fmt: skip
    assert rows[19] == [(0, 0, "1g.6gb", 1, 1, 16)]
    assert rows[9] == [
        (0, 0, "1c.3g.21gb", 1, 3, 0),
        (1, 1, "2c.3g.21gb", 2, 1, 0),
        (2, 2, "3g.21gb", 3, 1, 60),
    ]
    assert rows[0] == [
        (0, 0, "1c.7g.42gb", 1, 7, 0),
        (1, 1, "2c.7g.42gb", 2, 3, 0),
        (2, 2, "3c.7g.42gb", 3, 2, 0),
        (3, 3, "4c.7g.42gb", 4, 1, 0),
        (4, 4, "7g.42gb", 7, 1, 132),
    ]
    assert table.from_device is False


def test_a_known_product_with_a_profile_the_table_lacks_falls_back_to_constants() -> None:
    odd = _gi(99, "2g.odd", 2, 32)
    table = load_table(FakeDriver(identity_for(H100), (odd,)), 0)  # type: ignore[arg-type]
    assert [(c.id, c.name, c.instance_count) for c in table.ci_profiles[99]] == [
        (0, "1c.2g.odd", 2),
        (1, "2g.odd", 1),
    ]


def test_unknown_profile_ids_raise_key_errors_naming_them() -> None:
    table = table_for(H100)
    with pytest.raises(KeyError) as err:
        table.gi_profile(77)
    assert err.value.args == (77,)
    with pytest.raises(KeyError) as err:
        table.ci_profile(77, 3)  # no such GPU instance profile
    assert err.value.args == (3,)
    assert table.ci_profile(9, 2).name == "3g.40gb"
