"""MIG profile tables of the modelled products as the backend port returns them, for the
pure planner and validation tests (no simulated node needed)."""

from __future__ import annotations

from gpud.backend.port import GpuIdentity
from gpud.backend.products import PRODUCTS
from gpud.mig.validate import ProfileTable, reference_table

MIB = 1 << 20


def identity_for(product: str, index: int = 0) -> GpuIdentity:
    spec = PRODUCTS[product]
    return GpuIdentity(
        index=index,
        uuid=f"GPU-{index:08x}-test",
        name=spec.nvml_name,
        product=spec.key,
        pci_bus_id=f"00000000:{index + 0x18:02x}:00.0",
        pci_device_id=spec.pci_device_id,
        memory_total_bytes=spec.memory_mib * MIB,
        mig_capable=spec.mig_capable,
    )


def table_for(product: str, index: int = 0) -> ProfileTable:
    table = reference_table(identity_for(product, index))
    assert table is not None
    return table
