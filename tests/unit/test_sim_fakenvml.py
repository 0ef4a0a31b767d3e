"""The simulated driver behaves like pynvml: errors, MIG rules, persisted state, faults."""

from __future__ import annotations

import ctypes
import re
import threading
import time
from pathlib import Path

import pytest

from gpud.backend.sim import SimNode, SimulatedCrash
from gpud.errors import (
    AlreadyExists,
    ConfigError,
    DeviceNotFound,
    InUse,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from tests.unit.sim_support import NO_HOST


def _mig_node(tmp_path: Path | None = None, spec: str = "H100-SXM5-80GB") -> SimNode:
    node = SimNode([(spec, 1)], state_file=tmp_path / "dev.json" if tmp_path else None)
    nv = node.nvml
    nv.nvmlInit()
    nv.nvmlDeviceSetMigMode(nv.nvmlDeviceGetHandleByIndex(0), nv.NVML_DEVICE_MIG_ENABLE)
    node.reboot()
    return node


def _place(nv: object, start: int, size: int) -> object:
    return ctypes.byref(nv.c_nvmlGpuInstancePlacement_t(start, size))  # type: ignore[attr-defined]


def test_error_classes_like_pynvml() -> None:
    nv = SimNode([("A100-SXM4-40GB", 1)]).nvml
    assert type(nv.NVMLError(15)) is nv.NVMLError_GpuIsLost
    assert nv.NVMLError_InsufficientResources().value == 23
    assert nv.NVMLError_InUse().value == 19
    assert isinstance(nv.NVMLError_Timeout(), nv.NVMLError)
    with pytest.raises(nv.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()


def test_an_idle_board_reports_the_memory_its_driver_keeps_as_used() -> None:
    """As an H200 with driver 580.159.04 does: 615 MiB used with no process running, which
    nvmlDeviceGetMemoryInfo_v2 also names ``reserved``; a process's memory adds to it."""
    node = SimNode([("H200-SXM-141GB", 1)])
    nv = node.nvml
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    mib = 1 << 20
    v1 = nv.nvmlDeviceGetMemoryInfo(h)
    assert (v1.total, v1.used, v1.free) == (143771 * mib, 615 * mib, (143771 - 615) * mib)
    v2 = nv.nvmlDeviceGetMemoryInfo_v2(h, version=2)
    assert v2.reserved == 615 * mib and v2.used == 615 * mib
    nv.sim_start_process(0, 4242, 1000 * mib, 0.5)
    assert nv.nvmlDeviceGetMemoryInfo(h).used == 1615 * mib


def test_a_process_gets_no_more_memory_than_its_device_has_free() -> None:
    """As cudaMalloc fails: a second 70 GiB process finds 80 GB short, and the device is
    as it was (a process list whose sum exceeds the board's memory no NVML shows)."""
    node = SimNode([("H100-SXM5-80GB", 1)])
    nv = node.nvml
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    gib = 1 << 30
    nv.sim_start_process(0, 10, 70 * gib, 0.5)
    before = nv.nvmlDeviceGetMemoryInfo(h).used
    with pytest.raises(
        ResourceExhausted, match=r"out of memory on GPU 0: 71680 MiB asked, 9530 MiB free"
    ):
        nv.sim_start_process(0, 11, 70 * gib, 0.5)
    assert nv.nvmlDeviceGetMemoryInfo(h).used == before
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(h)] == [10]
    nv.sim_start_process(0, 11, 5 * gib, 0.5)  # what is free still is


def test_one_pid_started_twice_at_once_runs_once() -> None:
    """The duplicate check and the insert are one critical section: a start that waited
    for the driver's lock while another start of the same PID held it finds that process
    (AlreadyExists) instead of adding a second one (two rows in nvidia-smi for one PID)."""
    node = SimNode([("H100-SXM5-80GB", 1)])
    nv = node.nvml
    nv.nvmlInit()
    errors: list[Exception] = []

    def start() -> None:
        try:
            nv.sim_start_process(0, 4242, 1 << 30, 0.5)
        except Exception as err:
            errors.append(err)

    with nv._lock:  # another call holds the driver
        other = threading.Thread(target=start)
        other.start()
        other.join(0.3)  # waiting for the lock
        nv.sim_start_process(0, 4242, 1 << 30, 0.5)  # the start that holds it
    other.join(5)
    assert [type(e) for e in errors] == [AlreadyExists]
    assert [p.pid for p in nv.sim_processes()] == [4242]


def test_an_unknown_mig_device_is_not_found() -> None:
    nv = _mig_node().nvml
    with pytest.raises(NotFound, match="GPU 0 has no MIG device 9 \\(0 exist\\)"):
        nv.sim_start_process(0, 4242, 1 << 30, 0.5, 9)
    with pytest.raises(NotFound, match="GPU 0 has no MIG device MIG-nope"):
        nv.sim_start_process(0, 4242, 1 << 30, 0.5, "MIG-nope")


def test_mig_mode_pending_until_reboot() -> None:
    node = SimNode([("A100-SXM4-40GB", 1)])  # A100: a MIG mode change waits for a reset
    nv = node.nvml
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceSetMigMode(h, 1) == nv.NVML_ERROR_RESET_REQUIRED
    assert nv.nvmlDeviceGetMigMode(h) == [0, 1]
    with pytest.raises(nv.NVMLError_NotSupported):  # instances need MIG mode current
        nv.nvmlDeviceCreateGpuInstance(h, 19)
    # the profile table answers all the same (580-series driver)
    assert nv.nvmlDeviceGetGpuInstanceProfileInfo(h, nv.NVML_GPU_INSTANCE_PROFILE_1_SLICE).id == 19
    node.reboot()
    assert nv.nvmlDeviceGetMigMode(h) == [1, 1]
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetUtilizationRates(h)


@pytest.mark.parametrize("product", ["H100-SXM5-80GB", "H200-SXM-141GB"])
def test_hopper_switches_mig_mode_at_once_unless_a_process_holds_the_gpu(product: str) -> None:
    node = SimNode([(product, 1)])
    nv = node.nvml
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceSetMigMode(h, 1) == nv.NVML_SUCCESS
    assert nv.nvmlDeviceGetMigMode(h) == [1, 1]
    nv.nvmlDeviceGetGpuInstanceProfileInfo(h, nv.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    assert nv.nvmlDeviceSetMigMode(h, 0) == nv.NVML_SUCCESS
    assert nv.nvmlDeviceGetMigMode(h) == [0, 0]
    # a process on the GPU: the change waits for a reset, as on A100
    node.workloads.start(0, 4000, 1 << 30, 0.5)
    assert nv.nvmlDeviceSetMigMode(h, 1) == nv.NVML_ERROR_RESET_REQUIRED
    assert nv.nvmlDeviceGetMigMode(h) == [0, 1]
    node.workloads.stop(4000)
    node.reset(0)
    assert nv.nvmlDeviceGetMigMode(h) == [1, 1]


def test_overlap_and_capacity() -> None:
    nv = _mig_node().nvml
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 9) == 2
    nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, _place(nv, 0, 4))  # 3g at 0..3
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 3  # 1g at 4, 5, 6
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 5) == 0
    with pytest.raises(nv.NVMLError_InsufficientResources):
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, _place(nv, 2, 1))
    with pytest.raises(nv.NVMLError_InvalidArgument):  # not a placement of 2g
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 14, _place(nv, 5, 2))
    with pytest.raises(nv.NVMLError_InvalidArgument):  # no such profile id on H100
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 77, _place(nv, 4, 1))
    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, _place(nv, 4, 4))
    assert nv.nvmlGpuInstanceGetInfo(gi).id == 2  # the driver numbers halves 1 and 2


def test_gi_ids_follow_placement() -> None:
    nv = _mig_node().nvml
    h = nv.nvmlDeviceGetHandleByIndex(0)
    ids = [nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceCreateGpuInstance(h, 19)).id for _ in range(7)]
    assert sorted(ids) == list(range(7, 14))
    with pytest.raises(nv.NVMLError_InsufficientResources):
        nv.nvmlDeviceCreateGpuInstance(h, 19)


def _one_mig_device(tmp_path: Path) -> tuple[SimNode, str]:
    """A GPU in MIG mode with one 2-slice instance at placement 2 (GI 4, CI 0); its UUID."""
    node = _mig_node(tmp_path)
    nv = node.nvml
    h = nv.nvmlDeviceGetHandleByIndex(0)
    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 14, _place(nv, 2, 2))
    nv.nvmlGpuInstanceCreateComputeInstance(gi, nv.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE)
    return node, nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0))


def test_state_survives_restart_and_reboot_clears(tmp_path: Path) -> None:
    _, uuid = _one_mig_device(tmp_path)

    again = SimNode([("H100-SXM5-80GB", 1)], state_file=tmp_path / "dev.json")
    nv2 = again.nvml
    nv2.nvmlInit()
    h2 = nv2.nvmlDeviceGetHandleByIndex(0)
    assert nv2.nvmlDeviceGetMigMode(h2) == [1, 1]
    mig = nv2.nvmlDeviceGetMigDeviceHandleByIndex(h2, 0)
    assert nv2.nvmlDeviceGetUUID(mig) == uuid  # same instance, same MIG UUID
    assert (nv2.nvmlDeviceGetGpuInstanceId(mig), nv2.nvmlDeviceGetComputeInstanceId(mig)) == (4, 0)

    again.reboot()
    with pytest.raises(nv2.NVMLError_NotFound):
        nv2.nvmlDeviceGetMigDeviceHandleByIndex(h2, 0)
    third = SimNode([("H100-SXM5-80GB", 1)], state_file=tmp_path / "dev.json")
    third.nvml.nvmlInit()
    with pytest.raises(third.nvml.NVMLError_NotFound):
        third.nvml.nvmlDeviceGetMigDeviceHandleByIndex(third.nvml.nvmlDeviceGetHandleByIndex(0), 0)


def test_state_file_for_other_products_is_refused(tmp_path: Path) -> None:
    _mig_node(tmp_path)
    with pytest.raises(ConfigError) as info:
        SimNode([("A100-SXM4-40GB", 1)], state_file=tmp_path / "dev.json")
    assert "dev.json" in str(info.value)


def test_crash_after_mutations_is_persisted_first(tmp_path: Path) -> None:
    node = _mig_node(tmp_path)
    nv = node.nvml
    h = nv.nvmlDeviceGetHandleByIndex(0)
    node.faults.crash_after_mutations(2)
    nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, _place(nv, 0, 1))
    with pytest.raises(SimulatedCrash):
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, _place(nv, 1, 1))
    assert not isinstance(SimulatedCrash(), Exception)
    restarted = SimNode([("H100-SXM5-80GB", 1)], state_file=tmp_path / "dev.json").nvml
    restarted.nvmlInit()
    c = ctypes.c_uint()
    arr = (restarted.c_nvmlGpuInstance_t * 7)()
    restarted.nvmlDeviceGetGpuInstances(
        restarted.nvmlDeviceGetHandleByIndex(0), 19, arr, ctypes.byref(c)
    )
    assert c.value == 2
    # the trigger fires once
    nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, _place(nv, 2, 1))


def test_faults_are_per_gpu_and_thread_safe() -> None:
    node = SimNode([("A100-SXM4-80GB", 2)])
    nv = node.nvml
    nv.nvmlInit()
    h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    node.faults.not_supported(0, "power")
    node.faults.lose(1)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetPowerUsage(h0)
    assert nv.nvmlDeviceGetTemperature(h0, nv.NVML_TEMPERATURE_GPU) > 0
    with pytest.raises(nv.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetTemperature(h1, nv.NVML_TEMPERATURE_GPU)
    assert node.faults.active() == {0: {"not_supported": ["power"]}, 1: {"lost": True}}
    errors: list[BaseException] = []

    def hammer() -> None:
        try:
            for _ in range(200):
                nv.nvmlDeviceGetMemoryInfo(h0)
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for pid in range(100, 150):
        node.workloads.start(0, pid, 2**20, 0.01)
    for t in threads:
        t.join()
    assert not errors
    node.faults.clear()
    assert node.faults.active() == {}
    with pytest.raises(ValueError, match="unknown field"):
        node.faults.not_supported(0, "fan")
    with pytest.raises(ValueError, match="unknown reading"):
        node.faults.error(0, "memory")  # only the MIG devices' memory fails on its own


def test_processes_block_destroy() -> None:
    node = _mig_node()
    nv = node.nvml
    h = nv.nvmlDeviceGetHandleByIndex(0)
    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, _place(nv, 0, 1))
    ci = nv.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    mig_uuid = nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0))
    assert mig_uuid.startswith("MIG-")
    node.workloads.start(0, 4242, 3 * 2**30, 0.8, mig=mig_uuid)
    with pytest.raises(nv.NVMLError_InUse):
        nv.nvmlComputeInstanceDestroy(ci)
    with pytest.raises(nv.NVMLError_InUse):
        nv.nvmlGpuInstanceDestroy(gi)
    needs_mig = r"^mig: GPU 0 is in MIG mode: .* name one: a MIG device index, 0, or its MIG UUID$"
    with pytest.raises(InvalidArgument, match=needs_mig):
        node.workloads.start(0, 4243, 1, 0.1)  # a MIG-enabled GPU needs a MIG device
    node.workloads.stop(4242)
    nv.nvmlComputeInstanceDestroy(ci)
    nv.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlGpuInstanceGetInfo(gi)


def test_gpu_reset_makes_the_pending_mode_current_and_needs_an_idle_gpu() -> None:
    node = SimNode([("A100-SXM4-40GB", 2)])
    nv = node.nvml
    nv.nvmlInit()
    h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    for h in (h0, h1):
        assert nv.nvmlDeviceSetMigMode(h, 1) == nv.NVML_ERROR_RESET_REQUIRED
    node.workloads.start(1, 4242, 1 << 30, 0.5)
    with pytest.raises(InUse, match="in use"):
        node.reset(1)  # nvidia-smi: "In use by another client"
    assert nv.nvmlDeviceGetMigMode(h1) == [0, 1]
    node.reset(0)
    assert nv.nvmlDeviceGetMigMode(h0) == [1, 1]
    assert nv.nvmlDeviceGetMigMode(h1) == [0, 1], "only the GPU reset"
    # instances are gone after a reset; so is a lost GPU's fault
    prof = nv.nvmlDeviceGetGpuInstanceProfileInfo(h0, nv.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    nv.nvmlDeviceCreateGpuInstanceWithPlacement(h0, prof.id, _place(nv, 0, 1))
    node.faults.lose(0)
    node.reset(0)
    assert nv.nvmlDeviceGetGpuInstances(h0, prof.id, None, ctypes.byref(ctypes.c_uint())) == 0
    assert node.faults.active() == {}
    with pytest.raises(DeviceNotFound):
        node.reset(2)


def test_faults_are_device_state_that_outlives_the_daemon(tmp_path: Path) -> None:
    state = tmp_path / "dev.json"
    node = SimNode([("A100-SXM4-40GB", 3)], state_file=state)
    node.nvml.nvmlInit()
    node.faults.lose(1)
    node.faults.not_supported(2, "power")
    node.faults.slow(0, 0.01)
    node.faults.error(2, "mig_memory")
    # gpud restarts: a new process reads the same device state
    again = SimNode([("A100-SXM4-40GB", 3)], state_file=state)
    nv = again.nvml
    nv.nvmlInit()
    assert again.faults.active() == {
        0: {"slow_seconds": 0.01},
        1: {"lost": True},
        2: {"not_supported": ["power"], "errors": ["mig_memory"]},
    }
    with pytest.raises(nv.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(1))  # lost before gpud started
    again.faults.clear(0)
    assert set(SimNode([("A100-SXM4-40GB", 3)], state_file=state).faults.active()) == {1, 2}
    again.reset(1)
    assert set(SimNode([("A100-SXM4-40GB", 3)], state_file=state).faults.active()) == {2}
    again.reboot()
    assert SimNode([("A100-SXM4-40GB", 3)], state_file=state).faults.active() == {}


def test_a_slow_fault_hangs_calls_at_most_a_day() -> None:
    node = SimNode([("H100-SXM5-80GB", 1)])
    node.faults.slow(0, 86400.0)
    for bad in (-1.0, 86400.5, 1e308, float("inf"), float("nan")):
        with pytest.raises(
            ValueError, match=rf"^must be in 0\.\.86400 s, got {re.escape(f'{bad:g}')}$"
        ):
            node.faults.slow(0, bad)
    assert node.faults.active() == {0: {"slow_seconds": 86400.0}}


def test_slow_mig_slows_only_the_calls_that_change_mig(tmp_path: Path) -> None:
    node = _mig_node(tmp_path)
    nv = node.nvml
    h = nv.nvmlDeviceGetHandleByIndex(0)
    node.faults.slow_mig(0, 0.3)
    assert node.faults.active() == {0: {"slow_mig_seconds": 0.3}}

    def took(call: object, *args: object) -> tuple[object, float]:
        assert callable(call)
        start = time.monotonic()
        out = call(*args)
        return out, time.monotonic() - start

    gi, created = took(nv.nvmlDeviceCreateGpuInstanceWithPlacement, h, 19, _place(nv, 0, 1))
    ci, ci_created = took(nv.nvmlGpuInstanceCreateComputeInstance, gi, 0)
    reads = [
        took(nv.nvmlDeviceGetMigMode, h)[1],
        took(nv.nvmlDeviceGetUUID, h)[1],
        took(nv.nvmlDeviceGetMemoryInfo, h)[1],
        took(nv.nvmlGpuInstanceGetInfo, gi)[1],
        took(nv.nvmlDeviceGetMigDeviceHandleByIndex, h, 0)[1],
    ]
    _, ci_destroyed = took(nv.nvmlComputeInstanceDestroy, ci)
    _, destroyed = took(nv.nvmlGpuInstanceDestroy, gi)
    _, mode_set = took(nv.nvmlDeviceSetMigMode, h, nv.NVML_DEVICE_MIG_DISABLE)
    assert min(created, ci_created, ci_destroyed, destroyed, mode_set) >= 0.3
    assert sum(reads) < 0.3
    # device state: a restarted daemon finds it, and a clear ends it
    again = SimNode([("H100-SXM5-80GB", 1)], state_file=tmp_path / "dev.json")
    assert again.faults.active() == {0: {"slow_mig_seconds": 0.3}}
    again.faults.clear(0)
    assert SimNode([("H100-SXM5-80GB", 1)], state_file=tmp_path / "dev.json").faults.active() == {}
    with pytest.raises(ValueError, match=r"^must be in 0\.\.86400 s, got -1$"):
        node.faults.slow_mig(0, -1.0)


def test_declared_processes_outlive_gpud_and_modelled_ones_do_not(tmp_path: Path) -> None:
    """A process `gpuctl sim workload start` declared is a CUDA process of the node: a gpud
    killed and started again still lists it (before, it was gone: `gpuctl sim workload stop
    --pid 4194304` said "no simulated process 4194304"), on its MIG device too. (Its PID is
    one no host process has: one that a host process has runs only as long as it.) A workload
    model's is not kept (the models start it again from the job's host process), nor one
    stopped; a reboot ends them all."""
    node, mig = _one_mig_device(tmp_path)
    node.workloads.start(0, NO_HOST, 3 << 30, 0.6, mig=0)
    assert node.workloads.start_modelled(0, 4300, 1 << 30, 0.5, mig=mig)
    node.workloads.start(0, NO_HOST + 1, 1 << 30, 0.2, mig=0)
    node.workloads.stop(NO_HOST + 1)

    def listed(n: SimNode) -> list[tuple[int, int, int | None, int | None, int, float]]:
        return sorted(
            (p.pid, p.gpu, p.gi, p.ci, p.used_bytes, p.sm_ratio) for p in n.nvml.sim_processes()
        )

    declared = (NO_HOST, 0, 4, 0, 3 << 30, 0.6)
    assert listed(node) == [(4300, 0, 4, 0, 1 << 30, 0.5), declared]
    again = SimNode([("H100-SXM5-80GB", 1)], state_file=tmp_path / "dev.json")
    assert listed(again) == [declared]
    assert again.workloads.stop(NO_HOST)
    assert listed(SimNode([("H100-SXM5-80GB", 1)], state_file=tmp_path / "dev.json")) == []
    again.workloads.start(0, NO_HOST, 3 << 30, 0.6, mig=0)
    again.reboot()
    assert listed(SimNode([("H100-SXM5-80GB", 1)], state_file=tmp_path / "dev.json")) == []


def test_a_gpu_that_requires_a_reset_is_named_but_not_read_until_it_is_reset(
    tmp_path: Path,
) -> None:
    state = tmp_path / "dev.json"
    node = SimNode([("A100-SXM4-40GB", 2)], state_file=state)
    node.faults.reset_required(1)
    again = SimNode([("A100-SXM4-40GB", 2)], state_file=state)  # device state, as the others
    assert again.faults.active() == {1: {"reset_required": True}}
    nv = again.nvml
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetUUID(h) and nv.nvmlDeviceGetName(h) and nv.nvmlDeviceGetPciInfo(h)
    for call in (nv.nvmlDeviceGetMemoryInfo, nv.nvmlDeviceGetMigMode, nv.nvmlDeviceGetPowerUsage):
        with pytest.raises(nv.NVMLError) as err:
            call(h)
        assert err.value.value == nv.NVML_ERROR_RESET_REQUIRED
    assert nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(0)).total > 0
    again.reset(1)
    assert nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(1)).total > 0
    assert again.faults.active() == {}
