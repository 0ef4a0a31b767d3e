"""NvmlBackend over the real driver returns the port's types (read-only queries)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from gpud.backend import port, products
from gpud.backend.nvml import NvmlBackend
from gpud.backend.sim import SimNode
from gpud.colo.links import pcie_capacity
from gpud.errors import DeviceNotFound, NotSupported

pytestmark = pytest.mark.gpu


@pytest.fixture
def backend(real_nvml: Any) -> Iterator[NvmlBackend]:
    be = NvmlBackend(real_nvml)
    yield be
    be.close()


def test_identity(backend: NvmlBackend) -> None:
    assert backend.gpu_count() >= 1
    assert backend.driver_version()
    for gpu in range(backend.gpu_count()):
        ident = backend.identity(gpu)
        assert isinstance(ident, port.GpuIdentity)
        assert ident.uuid.startswith("GPU-")
        assert ident.memory_total_bytes > 0
        assert ident.pci_device_id & 0xFFFF == 0x10DE  # NVIDIA's vendor id
        assert ident.product
        # the host link, where the driver says (a vGPU may not): a PCIe generation and width
        if ident.pcie_link_gen is not None and ident.pcie_link_width is not None:
            assert products.pcie_bytes_per_second(ident.pcie_link_gen, ident.pcie_link_width)
        assert pcie_capacity(ident) > 0


def test_readings(backend: NvmlBackend) -> None:
    mem = backend.memory(0)
    assert isinstance(mem, port.MemoryInfo) and mem.total_bytes >= mem.used_bytes
    # v1: used is everything not free, the driver's reserved memory included
    assert mem.used_bytes + mem.free_bytes == mem.total_bytes, mem
    for p in backend.processes(0):
        assert isinstance(p, port.ProcessInfo) and p.pid > 0
    for read in (backend.power_watts, backend.temperature_celsius):
        with contextlib.suppress(NotSupported):
            assert read(0) >= 0
    try:
        assert isinstance(backend.clocks(0), port.Clocks)
        assert isinstance(backend.ecc_errors(0), port.EccCounts)
        assert isinstance(backend.pcie_throughput(0), port.PcieThroughput)
    except NotSupported:
        pass
    try:
        tx, rx = backend.nvlink_throughput_bytes(0)
        assert tx >= 0 and rx >= 0
    except NotSupported:
        pass


def test_gpu_readings_in_one_call(backend: NvmlBackend) -> None:
    r = backend.gpu_readings(0)
    assert isinstance(r, port.GpuReadings)
    assert all(isinstance(err, NotSupported) for _, err in r.errors), r.errors
    assert isinstance(r.memory, port.MemoryInfo)
    assert r.memory.total_bytes == backend.memory(0).total_bytes
    assert all(type(v) is int for v in r.memory)  # stored as pynvml returns them
    for p in r.processes:
        assert type(p.pid) is int and (p.used_memory_bytes is None or p.used_memory_bytes >= 0)
    for value in (r.clocks, r.ecc, r.nvlink_bytes):
        assert value is None or all(type(v) is int for v in value)
    assert r.power_watts is None or r.power_watts >= 0
    skipped = backend.gpu_readings(0, skip=port.READINGS)
    assert skipped == port.GpuReadings()


def test_events_register_and_a_wait_times_out(backend: NvmlBackend, real_nvml: Any) -> None:
    """XID and ECC events: every GPU registers on one event set (what its driver supports of
    them), and a wait with nothing to deliver ends in NVML_ERROR_TIMEOUT, which is no error
    here. A datacenter GPU supports XID events, MIG mode on or off."""
    events = backend.wait_events(0.2)
    assert all(isinstance(e, port.GpuEvent) for e in events), events
    for gpu in range(backend.gpu_count()):
        supported = real_nvml.nvmlDeviceGetSupportedEventTypes(
            real_nvml.nvmlDeviceGetHandleByIndex(gpu)
        )
        assert backend.xid_watched(gpu), f"GPU {gpu}: supported event types {supported:#x}"
    assert isinstance(backend.wait_events(0.0), list)


def test_mig_read_only(backend: NvmlBackend) -> None:
    ident = backend.identity(0)
    if not ident.mig_capable:
        pytest.skip(f"{ident.name} is not MIG-capable")
    mode = backend.mig_mode(0)
    assert isinstance(mode, port.MigMode)
    if not mode.current:
        assert backend.mig_devices(0) == []
        pytest.skip("MIG mode is off (and these tests never turn it on)")
    profiles = backend.gpu_instance_profiles(0)
    assert profiles and all(isinstance(p, port.GpuInstanceProfile) for p in profiles)
    for p in profiles:
        placements = backend.gpu_instance_placements(0, p.id)
        assert all(pl.start + pl.size <= 8 for pl in placements)
    for gi in backend.gpu_instances(0):
        assert isinstance(gi, port.GpuInstanceInfo)
        try:
            cis = backend.compute_instance_profiles(0, gi.profile_id)
            assert all(isinstance(c, port.ComputeInstanceProfile) for c in cis)
        except DeviceNotFound:
            pass
    devices = backend.mig_devices(0)
    for m in devices:
        assert m.uuid.startswith("MIG-") and m.memory_total_bytes > 0
        assert isinstance(backend.memory(0, m.mig), port.MemoryInfo)
    readings = backend.mig_readings(0, devices)
    assert readings.errors == ()
    for m, reading in zip(devices, readings.devices, strict=True):
        assert reading.identity is m and isinstance(reading.memory, port.MemoryInfo)
        assert reading.memory.total_bytes == backend.memory(0, m.mig).total_bytes


def test_the_simulated_board_answers_as_this_one(backend: NvmlBackend) -> None:
    """For a board gpud simulates, the simulated board's NVML answers are this one's: name,
    PCI id, memory, and the MIG profile table with its placements (``nvidia-smi mig -lgip``,
    ``-lgipp``), which the driver answers with MIG mode off too (580 series)."""
    real = backend.identity(0)
    if real.product not in products.PRODUCTS:
        pytest.skip(f"{real.name} is not a board gpud simulates")
    twin = NvmlBackend(SimNode([(real.product, 1)]).nvml)
    try:
        sim = twin.identity(0)
        assert (sim.name, sim.pci_device_id, sim.memory_total_bytes) == (
            real.name,
            real.pci_device_id,
            real.memory_total_bytes,
        )
        if not real.mig_capable:
            return
        try:
            profiles = backend.gpu_instance_profiles(0)
        except NotSupported:
            pytest.skip("this driver lists MIG profiles only while MIG mode is on")
        assert twin.gpu_instance_profiles(0) == profiles
        for p in profiles:
            assert twin.gpu_instance_placements(0, p.id) == backend.gpu_instance_placements(
                0, p.id
            ), p.name
    finally:
        twin.close()
