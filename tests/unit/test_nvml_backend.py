"""NvmlBackend runs against the simulated pynvml module: the code path a real driver sees."""

from __future__ import annotations

import ctypes
import dataclasses
import inspect
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_type_hints

import pytest

from gpud.backend import port
from gpud.backend.nvml import (
    REREGISTER_S,
    NvmlBackend,
    _same_handle,
    open_real_backend,
    product_key,
)
from gpud.backend.sim import FakeNvml, SimNode, SimulatedCrash, fakenvml, products
from gpud.errors import (
    BackendError,
    DeviceNotFound,
    DriverNotLoaded,
    DriverTimeout,
    GpuFault,
    GpuLost,
    InsufficientResources,
    InUse,
    NoPermission,
    NotSupported,
    classify,
)
from tests.unit.nvml_doubles import HeldSleep, NoNvml, Refusing, Sleeps

GiB = 2**30


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _backend(
    spec: list[tuple[str, int]], tmp_path: Path | None = None
) -> tuple[SimNode, NvmlBackend]:
    node = SimNode(spec, state_file=tmp_path / "dev.json" if tmp_path else None, clock=FakeClock())
    return node, NvmlBackend(node.nvml)


def _mig_backend(
    product: str = "H100-SXM5-80GB", tmp_path: Path | None = None
) -> tuple[SimNode, NvmlBackend]:
    """One GPU of ``product`` in MIG mode: at once on Hopper, after a reboot on an A100."""
    node, be = _backend([(product, 1)], tmp_path)
    if products.PRODUCTS[product].mig_mode_needs_reset:
        assert be.set_mig_mode(0, True) == port.MigMode(current=False, pending=True)
        node.reboot()
    else:
        assert be.set_mig_mode(0, True) == port.MigMode(current=True, pending=True)
    assert be.mig_mode(0) == port.MigMode(current=True, pending=True)
    return node, be


@pytest.mark.parametrize("key", list(products.PRODUCTS))
def test_identity_and_readings(key: str) -> None:
    _, be = _backend([(key, 2)])
    spec = products.PRODUCTS[key]
    ident = be.identity(1)
    assert ident.product == key
    assert ident.name == spec.nvml_name
    assert ident.pci_device_id == spec.pci_device_id
    assert ident.uuid.startswith("GPU-") and ident.uuid != be.identity(0).uuid
    assert ident.pci_bus_id.startswith("00000000:")
    assert ident.memory_total_bytes == spec.memory_mib * 2**20
    assert ident.mig_capable
    assert be.memory(1).total_bytes == ident.memory_total_bytes
    assert be.utilization(1) == port.Utilization(0.0, 0.0)
    assert spec.power_idle_w - 2 < be.power_watts(1) < spec.power_idle_w + 2
    assert be.clocks(1) == port.Clocks(spec.sm_clock_idle_mhz, spec.mem_clock_mhz)
    assert be.ecc_errors(1) == port.EccCounts(0, 0)
    assert be.processes(1) == []
    assert be.driver_version() and be.gpu_count() == 2


def test_product_key_of_unknown_gpu() -> None:
    assert product_key("NVIDIA L40S", 46068 * 2**20) == "L40S-45GB"
    assert product_key("NVIDIA H100 80GB HBM3", 81559 * 2**20) == "H100-SXM5-80GB"


def test_workloads_move_readings() -> None:
    node, be = _backend([("H100-SXM5-80GB", 2)])
    clock = node.nvml._clock  # the FakeClock
    idle_power, idle_temp = be.power_watts(0), be.temperature_celsius(0)
    tx0, _ = be.nvlink_throughput_bytes(0)
    node.workloads.start(0, 4000, 20 * GiB, 0.9)
    assert isinstance(clock, FakeClock)
    clock.now += 10
    assert be.memory(0).used_bytes >= 20 * GiB
    assert be.utilization(0).gpu_ratio > 0.8
    assert be.power_watts(0) > idle_power + 300
    assert be.temperature_celsius(0) > idle_temp + 20
    assert be.pcie_throughput(0).tx_bytes_per_second > 1e9
    assert be.nvlink_throughput_bytes(0)[0] > tx0
    assert be.processes(0) == [port.ProcessInfo(4000, 20 * GiB, None, None)]
    assert be.utilization(1).gpu_ratio == 0.0  # the other GPU stays idle
    node.workloads.stop(4000)
    assert be.processes(0) == [] and be.memory(0).used_bytes < GiB


@pytest.mark.parametrize(("key", "links"), [("A100-SXM4-40GB", 12), ("H100-SXM5-80GB", 18)])
def test_nvlink_throughput_sums_every_link(key: str, links: int) -> None:
    node, be = _backend([(key, 1)])
    clock = node.nvml._clock
    assert isinstance(clock, FakeClock)
    be.nvlink_throughput_bytes(0)
    node.workloads.start(0, 4000, GiB, 1.0)
    clock.now += 10
    tx, rx = be.nvlink_throughput_bytes(0)
    # What the driver has, link by link (scopeId = link index), read straight from it.
    nv = node.nvml
    h = nv.nvmlDeviceGetHandleByIndex(0)
    (count,) = nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_NVLINK_LINK_COUNT])
    assert count.value.uiVal == links
    fid_tx, fid_rx = (
        nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
        nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
    )
    per_link = nv.nvmlDeviceGetFieldValues(
        h, [(f, link) for link in range(links) for f in (fid_tx, fid_rx)]
    )
    assert all(v.scopeId == i // 2 for i, v in enumerate(per_link))
    assert tx == sum(v.value.ullVal for v in per_link[0::2]) * 1024
    assert rx == sum(v.value.ullVal for v in per_link[1::2]) * 1024
    assert tx > per_link[0].value.ullVal * 1024 * (links - 1), "more than link 0"
    readings = be.gpu_readings(0)
    assert readings.nvlink_bytes is not None and readings.nvlink_bytes[0] == tx


def test_a_gpu_without_nvlink_has_nvlink_not_supported_not_failing() -> None:
    """A board without NVLink (an H100 PCIe card without bridges, say) counts no links: its
    NVLink counters are NotSupported, a reading the sampler skips, not an error that marks
    the GPU unhealthy on every tick."""
    spec = dataclasses.replace(products.PRODUCTS["H100-SXM5-80GB"], nvlink_links=0)
    nv = FakeNvml([spec], clock=FakeClock())
    be = NvmlBackend(nv)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    (count,) = nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_NVLINK_LINK_COUNT])
    assert (count.nvmlReturn, count.value.uiVal) == (nv.NVML_SUCCESS, 0)
    readings = be.gpu_readings(0)
    assert readings.nvlink_bytes is None
    assert [(name, type(err)) for name, err in readings.errors] == [("nvlink_bytes", NotSupported)]
    with pytest.raises(NotSupported):
        be.nvlink_throughput_bytes(0)


def test_a_call_the_driver_lacks_is_not_supported() -> None:
    """A call the installed driver has no entry point for (FunctionNotFound) is NotSupported
    (the reading is skipped), not a driver error that marks the GPU unhealthy on every tick."""
    nv = FakeNvml([products.PRODUCTS["A100-SXM4-80GB"]], clock=FakeClock())
    be = NvmlBackend(nv)

    def lacking(*_: object) -> None:
        raise nv.NVMLError(nv.NVML_ERROR_FUNCTION_NOT_FOUND)

    be._fast.temperature = lacking
    readings = be.gpu_readings(0)
    assert readings.memory is not None and readings.temperature_celsius is None
    assert [(name, type(err)) for name, err in readings.errors] == [
        ("temperature_celsius", NotSupported)
    ]


def test_processes_are_listed_on_a_driver_before_r510() -> None:
    """pynvml lists processes with ``nvmlDeviceGetComputeRunningProcesses_v3``, which drivers
    before R510 lack (FunctionNotFound): gpud lists them with ``_v2`` then, so jobs' processes
    are still seen, and the GPU stays healthy."""
    nv = FakeNvml(
        [products.PRODUCTS["A100-SXM4-80GB"]], clock=FakeClock(), driver_version="470.256.02"
    )
    nv.sim_start_process(0, 4242, 1 << 30, 0.5)
    be = NvmlBackend(nv)
    with pytest.raises(nv.NVMLError_FunctionNotFound):  # what pynvml itself does there
        nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByIndex(0))
    assert [p.pid for p in be.processes(0)] == [4242]
    readings = be.gpu_readings(0)
    assert [p.pid for p in readings.processes] == [4242] and readings.errors == ()


def test_nvlink_counters_never_go_back_when_a_link_misses_a_read() -> None:
    """A link that answers an error for one read counts with its last value: the sum is a
    counter (gpud_gpu_nvlink_bytes_total), so it must not drop and jump back."""
    node, _ = _backend([("H100-SXM5-80GB", 1)])
    clock = node.nvml._clock
    assert isinstance(clock, FakeClock)
    nv = node.nvml
    read = nv.nvmlDeviceGetFieldValues
    failing: set[int] = set()

    def field_values(handle: object, ids: Any) -> list[Any]:
        out = read(handle, ids)
        for v in out:
            if v.scopeId in failing and v.fieldId != nv.NVML_FI_DEV_NVLINK_LINK_COUNT:
                v.nvmlReturn = nv.NVML_ERROR_UNKNOWN
        return out

    nv.nvmlDeviceGetFieldValues = field_values  # type: ignore[method-assign]
    be = NvmlBackend(nv)
    be.gpu_readings(0)
    node.workloads.start(0, 4000, GiB, 1.0)
    clock.now += 10
    seen = [be.gpu_readings(0).nvlink_bytes]
    node.workloads.stop(4000)  # little traffic from here: a link left out would show
    failing.add(3)
    for _ in range(2):
        clock.now += 1
        seen.append(be.gpu_readings(0).nvlink_bytes)
        seen.append(be.nvlink_throughput_bytes(0))
    failing.clear()
    clock.now += 1
    seen.append(be.gpu_readings(0).nvlink_bytes)
    assert all(s is not None for s in seen)
    for direction in (0, 1):
        values = [s[direction] for s in seen if s is not None]
        assert values == sorted(values), values
        assert values[-1] >= values[0] > 0


def test_mig_tables_h100() -> None:
    _, be = _mig_backend()
    profiles = {p.name: p for p in be.gpu_instance_profiles(0)}
    assert profiles["1g.10gb"].id == 19 and profiles["1g.10gb"].instance_count == 7
    assert profiles["1g.20gb"].id == 15 and profiles["1g.20gb"].memory_slices == 2
    assert (
        profiles["7g.80gb"].memory_slices == 8 and profiles["7g.80gb"].multiprocessor_count == 132
    )
    assert profiles["3g.40gb"].memory_bytes == 40448 * 2**20
    assert [p.start for p in be.gpu_instance_placements(0, 15)] == [0, 2, 4, 6]
    assert be.gpu_instance_placements(0, 9) == [port.Placement(0, 4), port.Placement(4, 4)]
    assert be.gpu_instance_placements(0, 5) == [port.Placement(0, 4)]
    with pytest.raises(NotSupported):
        be.gpu_instance_placements(0, 77)


def test_mig_tables_a100_40gb() -> None:
    _, be = _mig_backend("A100-SXM4-40GB")
    profiles = {p.name: p for p in be.gpu_instance_profiles(0)}
    assert {n: p.id for n, p in profiles.items()} == {
        "1g.5gb": 19,
        "1g.5gb+me": 20,
        "1g.10gb": 15,
        "2g.10gb": 14,
        "3g.20gb": 9,
        "4g.20gb": 5,
        "7g.40gb": 0,
    }
    assert profiles["1g.5gb+me"].profile == 7  # NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1
    assert [p.start for p in be.gpu_instance_placements(0, 19)] == list(range(7))
    assert [p.start for p in be.gpu_instance_placements(0, 14)] == [0, 2, 4]


def test_profiles_answer_with_mig_mode_off_but_instances_need_it() -> None:
    """As the 580-series driver does on an H200: ``-lgip``/``-lgipp`` answer with MIG mode
    off; creating an instance does not."""
    _, be = _backend([("H100-SXM5-80GB", 1), ("A100-SXM4-40GB", 1)])
    assert not be.mig_mode(0).current
    profiles = {p.name: p for p in be.gpu_instance_profiles(0)}
    assert profiles["3g.40gb"].memory_bytes == 40448 * 2**20
    assert be.gpu_instance_placements(0, profiles["3g.40gb"].id) == [
        port.Placement(0, 4),
        port.Placement(4, 4),
    ]
    with pytest.raises(NotSupported):
        be.create_gpu_instance(0, profiles["3g.40gb"].id, port.Placement(0, 4))
    assert be.mig_devices(0) == []


def test_create_destroy_instances() -> None:
    node, be = _mig_backend()
    gi = be.create_gpu_instance(0, 9, port.Placement(4, 4))
    assert (gi.id, gi.profile_id, gi.placement, gi.compute_instances) == (
        2,
        9,
        port.Placement(4, 4),
        (),
    )
    cips = {c.name: c for c in be.compute_instance_profiles(0, 9)}
    assert set(cips) == {"1c.3g.40gb", "2c.3g.40gb", "3g.40gb"}
    ci = be.create_compute_instance(0, gi.id, cips["1c.3g.40gb"].id)
    ci2 = be.create_compute_instance(0, gi.id, cips["2c.3g.40gb"].id)
    assert (ci.id, ci2.id) == (0, 1)
    with pytest.raises(InsufficientResources):
        be.create_compute_instance(0, gi.id, cips["2c.3g.40gb"].id)
    with pytest.raises(InsufficientResources):  # overlaps the 3g at 4..7
        be.create_gpu_instance(0, 19, port.Placement(5, 1))
    (listed,) = be.gpu_instances(0)
    assert [c.id for c in listed.compute_instances] == [0, 1]
    migs = be.mig_devices(0)
    assert [(m.mig, m.gpu_instance_id, m.compute_instance_id, m.profile_name) for m in migs] == [
        (0, 2, 0, "1c.3g.40gb"),
        (1, 2, 1, "2c.3g.40gb"),
    ]
    assert migs[0].memory_total_bytes == 40448 * 2**20 and migs[1].multiprocessor_count == 32
    assert be.memory(0, 1).total_bytes == 40448 * 2**20

    node.workloads.start(0, 77, GiB, 0.5, mig=1)
    assert be.processes(0, 1) == [port.ProcessInfo(77, GiB, 2, 1)]
    assert be.processes(0, 0) == []
    with pytest.raises(InUse):
        be.destroy_compute_instance(0, gi.id, 1)
    with pytest.raises(InUse):  # compute instances first
        be.destroy_gpu_instance(0, gi.id)
    with pytest.raises(NotSupported):
        be.utilization(0)
    node.workloads.stop(77)
    be.destroy_compute_instance(0, gi.id, 1)
    be.destroy_compute_instance(0, gi.id, 0)
    be.destroy_gpu_instance(0, gi.id)
    assert be.gpu_instances(0) == [] and be.mig_devices(0) == []
    with pytest.raises(DeviceNotFound):
        be.destroy_gpu_instance(0, gi.id)
    with pytest.raises(DeviceNotFound):
        be.memory(0, 0)


def test_persisted_instances_adopted_and_reboot_clears(tmp_path: Path) -> None:
    _node, be = _mig_backend(tmp_path=tmp_path)
    for start in (0, 2, 4):
        gi = be.create_gpu_instance(0, 14, port.Placement(start, 2))
        be.create_compute_instance(0, gi.id, 1)
    uuids = [m.uuid for m in be.mig_devices(0)]
    be.close()

    restarted = NvmlBackend(SimNode([("H100-SXM5-80GB", 1)], state_file=tmp_path / "dev.json").nvml)
    assert [g.id for g in restarted.gpu_instances(0)] == [3, 4, 5]
    assert [m.uuid for m in restarted.mig_devices(0)] == uuids
    with pytest.raises(InUse):  # instances first, then MIG mode off
        restarted.set_mig_mode(0, False)
    node2 = SimNode([("H100-SXM5-80GB", 1)], state_file=tmp_path / "dev.json")
    node2.reboot()
    fresh = NvmlBackend(node2.nvml)
    assert fresh.gpu_instances(0) == []


def test_pending_disable_applied_by_reboot(tmp_path: Path) -> None:
    node, be = _mig_backend("A100-SXM4-40GB", tmp_path=tmp_path)
    assert be.set_mig_mode(0, False) == port.MigMode(current=True, pending=False)
    node.reboot()
    assert be.mig_mode(0) == port.MigMode(current=False, pending=False)
    # Hopper takes it at once
    _, hopper = _mig_backend()
    assert hopper.set_mig_mode(0, False) == port.MigMode(current=False, pending=False)


def test_lost_gpu_and_not_supported_field() -> None:
    node, be = _backend([("A100-SXM4-80GB", 2)])
    be.identity(1)
    node.faults.lose(1)
    with pytest.raises(GpuLost) as info:
        be.memory(1)
    assert info.value.gpu == 1 and info.value.uuid == be.identity(1).uuid
    assert info.value.call == "nvmlDeviceGetMemoryInfo" and info.value.code == 15
    assert be.memory(0).total_bytes > 0
    node.faults.not_supported(0, "ecc")
    with pytest.raises(NotSupported):
        be.ecc_errors(0)
    assert be.power_watts(0) > 0
    node.faults.clear(0)
    assert be.ecc_errors(0) == port.EccCounts(0, 0)


def test_slow_gpu_blocks_its_calls() -> None:
    sleeps = Sleeps()
    node = SimNode([("H100-SXM5-80GB", 2)], clock=FakeClock(), sleep=sleeps)
    be = NvmlBackend(node.nvml)
    node.faults.slow(0, 0.05)
    be.power_watts(0)
    hung = list(sleeps.calls)
    assert hung and set(hung) == {0.05}  # the calls on GPU 0 hung for their time
    be.power_watts(1)
    assert sleeps.calls == hung  # GPU 1's did not


def test_xid_events() -> None:
    node, be = _backend([("H100-SXM5-80GB", 2)])
    assert be.wait_events(0.01) == []
    node.faults.xid(1, 63)
    node.faults.ecc_double_bit(0)
    events = be.wait_events(0.5)
    assert [(e.gpu, e.kind, e.xid) for e in events] == [
        (1, port.EventKind.XID, 63),
        (0, port.EventKind.ECC_DOUBLE_BIT, None),
    ]
    assert be.ecc_errors(0).uncorrected == 1
    node.faults.lose(0)
    (lost,) = be.wait_events(0.5)
    assert (lost.gpu, lost.xid) == (0, 79)
    be.close()


def test_a_lost_gpu_holds_up_no_other_gpus_events() -> None:
    """NVML's event set answers GPU_IS_LOST at every wait while a GPU on it is lost, naming
    none: the lost GPU leaves the set, the others' XIDs go on arriving, and it joins again
    once it answers."""
    clock = FakeClock()
    node = SimNode([("H100-SXM5-80GB", 3)], clock=FakeClock())
    be = NvmlBackend(node.nvml, clock=clock)
    assert be.wait_events(0.0) == []
    node.faults.lose(1)
    assert [(e.gpu, e.xid) for e in be.wait_events(0.2)] == [(1, 79)]
    for _ in range(3):
        assert be.wait_events(0.01) == []  # no GpuLost: the set has no lost GPU now
    node.faults.xid(0, 48)
    node.faults.xid(2, 63)
    assert [(e.gpu, e.xid) for e in be.wait_events(0.5)] == [(0, 48), (2, 63)]
    assert not be.xid_watched(1)
    assert be.xid_watched(0) and be.xid_watched(2)
    clock.now += REREGISTER_S  # still lost: it stays out
    assert be.wait_events(0.01) == []
    assert not be.xid_watched(1)
    node.faults.clear(1)
    clock.now += REREGISTER_S
    assert be.wait_events(0.01) == []
    assert be.xid_watched(1)
    node.faults.xid(1, 43)
    node.faults.xid(0, 31)
    assert [(e.gpu, e.xid) for e in be.wait_events(0.5)] == [(1, 43), (0, 31)]
    be.close()


def test_a_gpu_that_does_not_answer_holds_up_no_other_gpus_events() -> None:
    held = HeldSleep()
    node = SimNode([("A100-SXM4-40GB", 3)], clock=FakeClock(), sleep=held)
    be = NvmlBackend(node.nvml, reset=node.reset)
    node.faults.slow(1, 0.4)  # each call on GPU 1 hangs until released
    assert be.wait_events(0.0) == []
    returned = held.returned  # as the wait came back
    assert held.first.wait(HeldSleep.HANG_GUARD_S)
    assert returned == 0  # GPU 1's registration was still in the driver: not waited for
    node.faults.xid(0, 48)
    assert [(e.gpu, e.xid) for e in be.wait_events(0.5)] == [(0, 48)]
    # A reset of another GPU makes a new event set; GPU 1, still registering on the old
    # one, moves to the new one when it answers.
    be.reset_gpu(2)
    assert be.wait_events(0.0) == []
    assert (held.entered, held.returned) == (1, 0)  # not waited for, nor registered anew
    node.faults.xid(2, 31)
    assert [(e.gpu, e.xid) for e in be.wait_events(0.5)] == [(2, 31)]
    node.faults.clear(1)
    held.release()  # the registration's call in progress ends, the rest are quick
    for t in threading.enumerate():
        if t.name == "gpud-events-1":
            t.join(HeldSleep.HANG_GUARD_S)  # a hang guard: it ends once the call returns
            assert not t.is_alive()
    node.faults.xid(1, 43)
    assert [(e.gpu, e.xid) for e in be.wait_events(0.5)] == [(1, 43)]
    be.close()


def test_crash_after_mutations_reaches_the_caller(tmp_path: Path) -> None:
    node, be = _mig_backend(tmp_path=tmp_path)
    node.faults.crash_after_mutations(1)
    with pytest.raises(SimulatedCrash):
        be.create_gpu_instance(0, 19, port.Placement(0, 1))
    again = NvmlBackend(SimNode([("H100-SXM5-80GB", 1)], state_file=tmp_path / "dev.json").nvml)
    assert [g.id for g in again.gpu_instances(0)] == [7]


def test_errors_translate_by_value() -> None:
    node, be = _backend([("H100-SXM5-80GB", 1)])
    nv = node.nvml
    assert isinstance(be._translate(nv.NVMLError(10), 0, "x"), DriverTimeout)
    assert type(be._translate(nv.NVMLError(999), 0, "x")) is BackendError
    assert type(be._translate(nv.NVMLError(4), 0, "x")) is NoPermission
    assert type(be._translate(nv.NVMLError(16), 0, "x")) is GpuFault
    # a call the driver does not have, or no longer serves: as for a reading it lacks
    for code in (nv.NVML_ERROR_FUNCTION_NOT_FOUND, nv.NVML_ERROR_DEPRECATED):
        assert type(be._translate(nv.NVMLError(code), 0, "x")) is NotSupported
    with pytest.raises(DeviceNotFound):
        be.memory(5)


def test_gpu_readings_are_the_single_readings_in_one_call() -> None:
    node, be = _backend([("H100-SXM5-80GB", 2)])  # a FakeClock: readings hold still
    node.workloads.start(0, 4000, 20 * GiB, 0.9)
    r = be.gpu_readings(0)
    assert r == port.GpuReadings(
        memory=be.memory(0),
        utilization=be.utilization(0),
        power_watts=be.power_watts(0),
        temperature_celsius=be.temperature_celsius(0),
        clocks=be.clocks(0),
        ecc=be.ecc_errors(0),
        pcie=be.pcie_throughput(0),
        nvlink_bytes=be.nvlink_throughput_bytes(0),
        processes=tuple(be.processes(0)),
        mig_mode=be.mig_mode(0),
    )
    assert r.processes == (port.ProcessInfo(4000, 20 * GiB, None, None),)
    assert tuple(f for f in r._fields if f != "errors") == port.READINGS


def test_gpu_readings_skip_unsupported_and_lost() -> None:
    node, be = _backend([("A100-SXM4-80GB", 2)])
    node.faults.not_supported(0, "ecc")
    r = be.gpu_readings(0, skip={"power_watts", "mig_mode"})
    assert r.power_watts is None and r.mig_mode is None  # not asked
    assert r.ecc is None and r.temperature_celsius is not None and r.clocks is not None
    assert [(name, type(err)) for name, err in r.errors] == [("ecc", NotSupported)]
    assert r.errors[0][1].call == "nvmlDeviceGetTotalEccErrors" and r.errors[0][1].gpu == 0
    node.faults.lose(0)
    r = be.gpu_readings(0)
    ((name, err),) = r.errors  # the first call finds the GPU lost: no more calls
    assert name == "memory" and isinstance(err, GpuLost) and err.code == 15
    assert r == port.GpuReadings(errors=r.errors)
    assert be.gpu_readings(1).errors == ()
    with pytest.raises(DeviceNotFound):
        be.gpu_readings(5)


def test_mig_readings_leave_a_destroyed_device_empty() -> None:
    node, be = _mig_backend()
    for start in (0, 1):
        gi = be.create_gpu_instance(0, 19, port.Placement(start, 1))
        be.create_compute_instance(0, gi.id, 0)
    node.workloads.start(0, 77, GiB, 0.5, mig=1)
    devices = be.mig_devices(0)
    readings = be.mig_readings(0, devices)
    assert readings.errors == ()
    first, second = readings.devices
    assert first.identity == devices[0] and first.processes == ()
    assert second.memory == be.memory(0, 1)
    assert second.processes == tuple(be.processes(0, 1)) != ()
    node.workloads.stop(77)
    be.destroy_compute_instance(0, devices[1].gpu_instance_id, devices[1].compute_instance_id)
    readings = be.mig_readings(0, devices)
    assert readings.devices[0].memory is not None
    assert readings.devices[1] == port.MigReading(devices[1], None, (), False)
    ((mig, err),) = readings.errors
    assert mig == 1 and isinstance(err, BackendError) and err.gpu == 0
    node.faults.lose(0)
    with pytest.raises(GpuLost):
        be.mig_readings(0, devices)


def test_mig_readings_never_give_a_device_the_readings_of_one_moved_onto_its_index() -> None:
    node, be = _mig_backend()
    for start in (0, 1):
        gi = be.create_gpu_instance(0, 19, port.Placement(start, 1))
        be.create_compute_instance(0, gi.id, 0)
    devices = be.mig_devices(0)
    node.workloads.start(0, 77, GiB, 0.5, mig=1)
    # the first device destroyed: the driver numbers the second one 0 now
    be.destroy_compute_instance(0, devices[0].gpu_instance_id, devices[0].compute_instance_id)
    readings = be.mig_readings(0, devices)
    assert readings.devices[0] == port.MigReading(devices[0], None, (), False)
    assert readings.devices[1] == port.MigReading(devices[1], None, (), False)
    (moved, err), (gone, _) = readings.errors
    assert (moved, gone) == (0, 1) and isinstance(err, DeviceNotFound)
    assert err.gpu == 0 and err.uuid == devices[0].uuid
    assert f"is {devices[1].uuid} now, not {devices[0].uuid}" in str(err)
    node.workloads.stop(77)


def test_mig_readings_keep_processes_when_the_memory_query_fails() -> None:
    node, be = _mig_backend()
    gi = be.create_gpu_instance(0, 19, port.Placement(0, 1))
    be.create_compute_instance(0, gi.id, 0)
    node.workloads.start(0, 77, GiB, 0.5, mig=0)
    devices = be.mig_devices(0)
    node.faults.error(0, "mig_memory")
    readings = be.mig_readings(0, devices)
    assert readings.errors == ()  # the device was read: nothing to list again
    (reading,) = readings.devices
    assert reading.memory is None and "Unknown Error" in reading.memory_error
    assert reading.processes_read and [p.pid for p in reading.processes] == [77]
    assert be.memory(0).used_bytes >= GiB  # the whole GPU's memory still answers
    node.faults.clear(0)
    (reading,) = be.mig_readings(0, devices).devices
    assert reading.memory == be.memory(0, 0) and reading.memory_error == ""


def test_mig_readings_keep_memory_when_the_process_list_fails() -> None:
    node, be = _mig_backend()
    gi = be.create_gpu_instance(0, 19, port.Placement(0, 1))
    be.create_compute_instance(0, gi.id, 0)
    node.workloads.start(0, 77, GiB, 0.5, mig=0)
    devices = be.mig_devices(0)
    node.faults.not_supported(0, "processes")
    readings = be.mig_readings(0, devices)
    assert readings.errors == ()  # the device was read: nothing to list again
    (reading,) = readings.devices
    assert reading.memory == be.memory(0, 0) and reading.memory.used_bytes >= GiB
    assert reading.processes == () and not reading.processes_read
    assert "Not Supported" in reading.processes_error
    node.faults.clear(0)
    (reading,) = be.mig_readings(0, devices).devices
    assert reading.processes_read and reading.processes_error == ""
    assert [p.pid for p in reading.processes] == [77]


# -- contract: every GpuBackend method returns the port's types -------------------------------


def _check_type(value: Any, hint: Any) -> None:
    origin = getattr(hint, "__origin__", None)
    if origin is list:
        assert isinstance(value, list)
        for item in value:
            _check_type(item, hint.__args__[0])
    elif origin is tuple and hint.__args__[-1] is Ellipsis:
        assert isinstance(value, tuple)
        for item in value:
            _check_type(item, hint.__args__[0])
    elif origin is tuple:
        assert isinstance(value, tuple) and len(value) == len(hint.__args__)
        for item, h in zip(value, hint.__args__, strict=True):
            _check_type(item, h)
    elif origin is dict:
        assert isinstance(value, dict)
    elif hint is float:
        assert isinstance(value, (int, float))
    elif hint is type(None):
        assert value is None
    else:
        assert isinstance(value, hint), (value, hint)
    names: tuple[str, ...] = ()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = tuple(f.name for f in dataclasses.fields(value))
    elif isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        names = value._fields
    if names:
        hints = get_type_hints(type(value), vars(port))
        for name in names:
            v = getattr(value, name)
            h = hints[name]
            args = getattr(h, "__args__", ())
            if type(None) in args and v is None:
                continue
            if args and type(None) in args:
                h = next(a for a in args if a is not type(None))
            _check_type(v, h)


def contract_calls(be: Any, idle: Callable[[], object]) -> dict[str, Any]:
    """Every GpuBackend method, called on GPU 0 of a MIG-enabled node with one instance;
    ``idle()`` stops the processes on GPU 1 before it is reset."""
    gi = be.gpu_instances(0)[0]
    return {
        "driver_version": be.driver_version(),
        "gpu_count": be.gpu_count(),
        "identity": be.identity(0),
        "memory": be.memory(0),
        "processes": be.processes(0),
        "gpu_readings": be.gpu_readings(1),
        "mig_readings": be.mig_readings(0, be.mig_devices(0)),
        "mig_mode": be.mig_mode(0),
        "set_mig_mode": be.set_mig_mode(1, False),
        "mig_devices": be.mig_devices(0),
        "gpu_instance_profiles": be.gpu_instance_profiles(0),
        "compute_instance_profiles": be.compute_instance_profiles(0, gi.profile_id),
        "gpu_instance_placements": be.gpu_instance_placements(0, gi.profile_id),
        "gpu_instances": be.gpu_instances(0),
        "create_gpu_instance": be.create_gpu_instance(0, 19, port.Placement(0, 1)),
        "create_compute_instance": be.create_compute_instance(0, 7, 0),
        "destroy_compute_instance": be.destroy_compute_instance(0, 7, 0),
        "destroy_gpu_instance": be.destroy_gpu_instance(0, 7),
        "wait_events": be.wait_events(0.0),
        "xid_watched": be.xid_watched(0),
        "idle": idle(),
        "reset_gpu": be.reset_gpu(1),
        "close": be.close(),
    }


def test_contract_every_method_returns_port_types() -> None:
    node = SimNode([("H100-SXM5-80GB", 2)])
    be = NvmlBackend(node.nvml, reset=node.reset)
    be.set_mig_mode(0, True)
    node.reboot()
    gi = be.create_gpu_instance(0, 9, port.Placement(4, 4))
    be.create_compute_instance(0, gi.id, 2)
    node.workloads.start(0, 4000, GiB, 0.5, mig=0)
    node.workloads.start(1, 4001, GiB, 0.5)
    results = contract_calls(be, lambda: node.workloads.stop(4001))
    del results["idle"]
    assert results["gpu_readings"].errors == ()
    assert results["gpu_readings"].processes
    assert results["mig_readings"].errors == ()
    assert results["mig_readings"].devices[0].processes
    protocol_methods = {
        name
        for name, _ in inspect.getmembers(port.GpuBackend, inspect.isfunction)
        if not name.startswith("_")
    }
    assert protocol_methods == set(results)
    hints_ns = {**vars(port)}
    for name, value in results.items():
        hint = get_type_hints(getattr(port.GpuBackend, name), hints_ns)["return"]
        _check_type(value, hint)
    backend: port.GpuBackend = be  # structural check for mypy readers
    assert backend is be


def test_reset_lets_go_of_nvml_for_the_runner_and_comes_back() -> None:
    node = SimNode([("A100-SXM4-40GB", 2)])
    seen: list[int] = []

    def runner(gpu: int) -> None:
        # nvidia-smi refuses while another client holds the GPU open: gpud must not.
        seen.append(node.nvml._initialized)
        node.reset(gpu)

    be = NvmlBackend(node.nvml, reset=runner)
    be.wait_events(0.0)  # an event set exists, and is freed for the reset
    be.set_mig_mode(0, True)
    assert be.mig_mode(0) == port.MigMode(False, True)
    be.reset_gpu(0)
    assert seen == [0]
    assert be.mig_mode(0) == port.MigMode(True, True)
    assert be.identity(0).uuid == be.identity(0).uuid and be.gpu_readings(1).errors == ()
    assert be.wait_events(0.0) == []  # the watcher's next wait registers the GPUs again
    node.faults.xid(1, 48)
    assert [e.xid for e in be.wait_events(0.5)] == [48]
    with pytest.raises(DeviceNotFound):
        be.reset_gpu(5)
    with pytest.raises(NotSupported, match="reset is not available"):
        NvmlBackend(node.nvml).reset_gpu(0)
    be.close()


def test_a_device_handle_read_back_from_an_event_is_the_cached_one() -> None:
    """pynvml's handles are ctypes pointers: the ``device`` field of an event is a new pointer
    object at each read, and ``==`` between ctypes pointers is identity."""

    class Device(ctypes.Structure):
        _fields_ = [("opaque", ctypes.c_int)]

    handle_t = ctypes.POINTER(Device)

    class EventData(ctypes.Structure):
        _fields_ = [("device", handle_t)]

    gpu0, gpu1 = Device(), Device()
    cached = ctypes.pointer(gpu0)
    event = EventData(cached)
    assert event.device != cached  # what a plain comparison sees
    assert _same_handle(cached, event.device)
    assert not _same_handle(ctypes.pointer(gpu1), event.device)
    assert not _same_handle(handle_t(), handle_t())  # two NULL handles name no device
    sim_handle = object()  # the simulated driver's handles are plain objects
    assert _same_handle(sim_handle, sim_handle) and not _same_handle(sim_handle, object())


# -- NVML refusing: permissions, a driver or library missing, GPUs needing an operator --------


def _refusing(code: int, calls: list[str], gpus: list[int] | None = None) -> NvmlBackend:
    node = SimNode([("H100-SXM5-80GB", 2)], clock=FakeClock())
    return NvmlBackend(Refusing(node.nvml, code, calls, gpus), uid=1000)


_NUMERIC_CALLS = [
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetPcieThroughput",
    "nvmlDeviceGetFieldValues",
]


def test_a_gpu_that_needs_a_reset_is_asked_no_more_numbers_but_its_processes_and_mig_mode() -> None:
    """RESET_REQUIRED on the first reading ends the numeric ones (each would answer the
    same, and be dropped); the processes that keep ``nvidia-smi --gpu-reset`` from running
    and the MIG mode the reset switches are still asked."""
    node = SimNode([("H100-SXM5-80GB", 2)], clock=FakeClock())
    refusing = Refusing(node.nvml, fakenvml.NVML_ERROR_RESET_REQUIRED, _NUMERIC_CALLS, [1])
    be = NvmlBackend(refusing, uid=1000)
    node.workloads.start(1, 4242, 2 * GiB, 0.5)
    # a process holds the GPU: Hopper keeps the change pending until the reset
    assert be.set_mig_mode(1, True) == port.MigMode(current=False, pending=True)
    r = be.gpu_readings(1)
    assert [(name, type(err)) for name, err in r.errors] == [("memory", GpuFault)]
    assert r.processes == (port.ProcessInfo(4242, 2 * GiB, None, None),)
    assert r.mig_mode == port.MigMode(current=False, pending=True)
    assert r._replace(processes=(), mig_mode=None) == port.GpuReadings(errors=r.errors)
    assert be.gpu_readings(0).errors == ()


def test_a_reading_that_answers_the_driver_timeout_is_that_readings_error_alone() -> None:
    """NVML_ERROR_TIMEOUT belongs to calls given a timeout: on a reading, the GPU is not
    taken for faulty, and the other readings are read."""
    be = _refusing(fakenvml.NVML_ERROR_TIMEOUT, ["nvmlDeviceGetPowerUsage"], [1])
    r = be.gpu_readings(1)
    assert [(name, type(err)) for name, err in r.errors] == [("power_watts", DriverTimeout)]
    assert r.memory is not None and r.temperature_celsius is not None
    assert r.mig_mode is not None


def test_no_permission_at_init_names_the_control_node_gpuds_uid_and_the_remedy() -> None:
    with pytest.raises(NoPermission) as err:
        _refusing(fakenvml.NVML_ERROR_NO_PERMISSION, ["nvmlInit"])
    text = str(err.value)
    assert text.startswith("nvmlInit failed: Insufficient Permissions: no permission to use")
    assert "/dev/nvidiactl (gpud runs as uid 1000): run gpud as root" in text
    assert "NVIDIA container runtime" in text
    assert classify(err.value) == ("PERMISSION_DENIED", 77)


def test_a_gpu_whose_device_node_gpud_may_not_open_is_named_the_others_answer() -> None:
    be = _refusing(fakenvml.NVML_ERROR_NO_PERMISSION, ["nvmlDeviceGetHandleByIndex"], [1])
    assert be.identity(0).uuid
    with pytest.raises(NoPermission) as err:
        be.identity(1)
    assert err.value.gpu == 1
    assert "no permission to use GPU 1's device node (/dev/nvidia*) (gpud runs as uid 1000)" in (
        str(err.value)
    )


def test_a_reading_only_root_may_take_is_a_permission_error_of_that_reading() -> None:
    be = _refusing(fakenvml.NVML_ERROR_NO_PERMISSION, ["nvmlDeviceGetClockInfo"])
    r = be.gpu_readings(0)
    assert r.clocks is None and r.memory is not None and r.power_watts is not None
    [(name, error)] = r.errors
    assert name == "clocks" and isinstance(error, NoPermission)
    assert "not permitted (gpud runs as uid 1000): the driver allows this call to root" in str(
        error
    )


def test_a_mig_change_refused_for_permission_names_the_gpu_and_says_root() -> None:
    node = SimNode([("H100-SXM5-80GB", 2)], clock=FakeClock())
    refusing = Refusing(node.nvml, 0, ["nvmlDeviceCreateGpuInstanceWithPlacement"])
    be = NvmlBackend(refusing, uid=1000)
    be.set_mig_mode(1, True)
    profile = be.gpu_instance_profiles(1)[0]
    placement = be.gpu_instance_placements(1, profile.id)[0]
    refusing.code = fakenvml.NVML_ERROR_NO_PERMISSION
    with pytest.raises(NoPermission) as err:
        be.create_gpu_instance(1, profile.id, placement)
    assert err.value.gpu == 1
    assert str(err.value) == (
        "nvmlDeviceCreateGpuInstanceWithPlacement failed on GPU 1: Insufficient Permissions:"
        " not permitted (gpud runs as uid 1000): the driver allows MIG changes to root only;"
        " run gpud as root"
    )


@pytest.mark.parametrize(
    ("code", "problem", "advice"),
    [
        (fakenvml.NVML_ERROR_RESET_REQUIRED, "reset required", "nvidia-smi --gpu-reset -i 1"),
        (fakenvml.NVML_ERROR_IRQ_ISSUE, "interrupt issue", "dmesg"),
        (fakenvml.NVML_ERROR_INSUFFICIENT_POWER, "insufficient power", "power cables"),
        (fakenvml.NVML_ERROR_CORRUPTED_INFOROM, "corrupted infoROM", "infoROM is corrupted"),
    ],
)
def test_a_gpu_that_needs_an_operator_is_a_gpu_fault_saying_what_it_needs(
    code: int, problem: str, advice: str
) -> None:
    be = _refusing(code, ["nvmlDeviceGetMemoryInfo"], [1])
    assert be.memory(0).total_bytes
    with pytest.raises(GpuFault) as err:
        be.memory(1)
    assert err.value.problem == problem and err.value.gpu == 1 and err.value.code == code
    assert advice in str(err.value)
    # the alert rules take any reason with "lost" in it for a lost GPU
    assert "lost" not in str(err.value).lower()
    assert classify(err.value) == ("UNAVAILABLE", 10)


@pytest.mark.parametrize(
    ("code", "cls", "check"),
    [
        (fakenvml.NVML_ERROR_DRIVER_NOT_LOADED, DriverNotLoaded, "lsmod | grep nvidia"),
        (fakenvml.NVML_ERROR_LIBRARY_NOT_FOUND, DriverNotLoaded, "NVIDIA container runtime"),
        (fakenvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, DriverNotLoaded, "reboot"),
        (fakenvml.NVML_ERROR_NO_PERMISSION, NoPermission, "run gpud as root"),
    ],
)
def test_a_node_where_nvml_cannot_start_says_what_to_check(
    code: int, cls: type[BackendError], check: str
) -> None:
    with pytest.raises(cls) as err:
        open_real_backend(uid=1000, nvml=NoNvml(code))
    assert check in str(err.value)


def test_a_gpu_that_needs_an_operator_has_no_identity_without_its_pcie_link() -> None:
    """A GPU whose link query answers RESET_REQUIRED is faulty: its identity is not
    remembered with the link missing, and is read whole once the GPU answers."""
    node = SimNode([("H100-SXM5-80GB", 2)], clock=FakeClock())
    refusing = Refusing(
        node.nvml, fakenvml.NVML_ERROR_RESET_REQUIRED, ["nvmlDeviceGetMaxPcieLinkGeneration"], [0]
    )
    be = NvmlBackend(refusing)
    with pytest.raises(GpuFault) as err:
        be.identity(0)
    assert err.value.problem == "reset required" and err.value.gpu == 0
    assert be.identity(1).pcie_link_gen == products.PRODUCTS["H100-SXM5-80GB"].pcie_gen
    refusing.code = 0
    assert be.identity(0).pcie_link_gen == products.PRODUCTS["H100-SXM5-80GB"].pcie_gen


def test_mig_readings_raise_a_fault_of_the_gpu_not_one_devices_missing_reading() -> None:
    node, _ = _mig_backend()
    refusing = Refusing(node.nvml, 0, ["nvmlDeviceGetMemoryInfo"])
    be = NvmlBackend(refusing)
    gi = be.create_gpu_instance(0, 19, port.Placement(0, 1))
    be.create_compute_instance(0, gi.id, 0)
    devices = be.mig_devices(0)
    assert be.mig_readings(0, devices).devices[0].memory is not None
    refusing.code = fakenvml.NVML_ERROR_RESET_REQUIRED
    with pytest.raises(GpuFault) as err:
        be.mig_readings(0, devices)
    assert err.value.problem == "reset required"
    refusing.code = fakenvml.NVML_ERROR_UNKNOWN  # one reading's error stays that device's
    (reading,) = be.mig_readings(0, devices).devices
    assert reading.memory is None and "Unknown Error" in reading.memory_error


def test_a_gpu_that_needs_a_reset_at_registration_joins_the_events_once_it_answers() -> None:
    clock = FakeClock()
    node = SimNode([("H100-SXM5-80GB", 2)], clock=FakeClock())
    be = NvmlBackend(node.nvml, clock=clock)
    node.faults.reset_required(1)
    assert be.wait_events(0.0) == []
    assert be.xid_watched(0) and not be.xid_watched(1)
    node.faults.clear(1)
    clock.now += REREGISTER_S
    assert be.wait_events(0.01) == []
    assert be.xid_watched(1)
    node.faults.xid(1, 43)
    assert [(e.gpu, e.xid) for e in be.wait_events(0.5)] == [(1, 43)]
    be.close()
