"""Sampler + metrics on the real adapter over the simulated node, with injected faults."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpud.api import convert
from gpud.backend.nvml import NvmlBackend
from gpud.backend.sim import FakeNvml, SimNode, fakenvml, parse_simulate_spec
from gpud.events import EventLog
from gpud.metrics import Collector, build_registry
from gpud.telemetry.sampler import Sampler
from gpud.telemetry.snapshot import GpuSample, MigSample
from tests.unit.nvml_doubles import Refusing

GIB = 1 << 30


class Node:
    def __init__(
        self,
        nvml: Callable[[FakeNvml], Any] = lambda nv: nv,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``nvml`` wraps the simulated module in a double (one that refuses some calls);
        ``clock`` stamps the samples and measures their age at a scrape."""
        self.sim = SimNode(parse_simulate_spec("H100-SXM5-80GB:4"), seed=1)
        self.backend = NvmlBackend(nvml(self.sim.nvml), uid=1000)
        self.events = EventLog(None)
        self.sampler = Sampler(
            self.backend, call_timeout_s=0.25, events=self.events, event_wait_s=0.05, clock=clock
        )
        self.registry: CollectorRegistry = build_registry(
            Collector(self.sampler.latest, events=self.events, clock=clock), process=False
        )

    def value(self, name: str, gpu: int, **labels: str) -> float | None:
        snap = self.sampler.latest()
        assert snap is not None
        ident = snap.gpus[gpu].identity
        base = {"gpu": str(gpu), "uuid": ident.uuid, "model": ident.name}
        return self.registry.get_sample_value(name, {**base, **labels})


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node()
    yield n
    n.sim.faults.clear()
    n.sampler.close()
    n.backend.close()


def enable_mig(node: Node, gpu: int, count: int) -> None:
    backend = node.backend
    backend.set_mig_mode(gpu, True)
    node.sim.reboot()
    profile = next(p for p in backend.gpu_instance_profiles(gpu) if p.name == "1g.10gb")
    for placement in backend.gpu_instance_placements(gpu, profile.id)[:count]:
        gi = backend.create_gpu_instance(gpu, profile.id, placement)
        ci = next(
            c
            for c in backend.compute_instance_profiles(gpu, profile.id)
            if c.slice_count == profile.slice_count
        )
        backend.create_compute_instance(gpu, gi.id, ci.id)


def test_reads_gpus_processes_and_mig_devices(node: Node) -> None:
    enable_mig(node, 1, 3)
    node.sampler.refresh_identity()
    node.sim.workloads.start(0, 4242, 8 * GIB, 0.9)
    node.sim.workloads.start(1, 4343, 2 * GIB, 0.5, mig=0)
    snap = node.sampler.tick()
    assert all(g.healthy for g in snap.gpus)
    g0 = snap.gpus[0]
    assert g0.identity.product == "H100-SXM5-80GB"
    assert [p.pid for p in g0.processes] == [4242]
    assert g0.memory is not None and g0.memory.used_bytes >= 8 * GIB
    assert g0.utilization is not None
    g1 = snap.gpus[1]
    assert g1.mig_mode is not None and g1.mig_mode.current
    assert [m.identity.profile_name for m in g1.mig_devices] == ["1g.10gb"] * 3
    assert [p.pid for p in g1.mig_devices[0].processes] == [4343]
    mig = g1.mig_devices[0].identity
    used = node.registry.get_sample_value(
        "gpud_mig_device_memory_used_bytes",
        {
            "gpu": "1",
            "gpu_uuid": g1.identity.uuid,
            "mig_uuid": mig.uuid,
            "profile": "1g.10gb",
            "gpu_instance_id": str(mig.gpu_instance_id),
            "compute_instance_id": str(mig.compute_instance_id),
        },
    )
    assert used is not None and used >= 2 * GIB
    assert node.value("gpud_gpu_processes", 0) == 1
    assert node.value("gpud_gpu_mig_mode_enabled", 1) == 1


def test_gpu_lost_mid_run(node: Node) -> None:
    node.sampler.tick()
    node.sim.faults.lose(2)
    snap = node.sampler.tick()
    assert not snap.gpus[2].healthy
    assert "GPU lost" in snap.gpus[2].reason
    assert all(snap.gpus[i].healthy for i in (0, 1, 3))
    assert node.value("gpud_gpu_healthy", 2) == 0
    assert node.value("gpud_gpu_healthy", 0) == 1
    assert node.value("gpud_gpu_memory_used_bytes", 2) is None
    assert node.value("gpud_gpu_memory_used_bytes", 3) is not None
    assert node.registry.get_sample_value("gpud_events_total", {"kind": "gpu.unhealthy"}) == 1
    node.sim.faults.clear(2)
    assert node.sampler.tick().gpus[2].healthy
    assert node.registry.get_sample_value("gpud_events_total", {"kind": "gpu.recovered"}) == 1


def test_not_supported_field(node: Node) -> None:
    node.sim.faults.not_supported(1, "power")
    snap = node.sampler.tick()
    assert snap.gpus[1].healthy
    assert snap.gpus[1].power_watts is None
    assert snap.gpus[0].power_watts is not None
    assert node.value("gpud_gpu_power_watts", 1) is None
    assert node.value("gpud_gpu_power_watts", 0) is not None
    assert node.value("gpud_gpu_healthy", 1) == 1


def test_a_reading_only_root_may_take_is_skipped_and_said_once_the_gpu_stays_healthy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = Node(
        lambda nv: Refusing(nv, fakenvml.NVML_ERROR_NO_PERMISSION, ["nvmlDeviceGetClockInfo"])
    )
    try:
        with caplog.at_level(logging.WARNING, logger="gpud.telemetry.reader"):
            node.sampler.tick()
            snap = node.sampler.tick()
        assert all(g.healthy for g in snap.gpus)
        assert snap.gpus[0].clocks is None and snap.gpus[0].memory is not None
        assert node.value("gpud_gpu_healthy", 0) == 1
        said = [r.getMessage() for r in caplog.records if "clocks not read" in r.getMessage()]
        assert len(said) == 4  # once per GPU, not once per tick
        assert "GPU 0: clocks not read: nvmlDeviceGetClockInfo failed on GPU 0" in said[0]
        assert "root" in said[0]
    finally:
        node.sampler.close()
        node.backend.close()


def test_a_gpu_that_requires_a_reset_is_unhealthy_saying_so_the_others_keep_working() -> None:
    refusing: list[Refusing] = []

    def wrap(nv: FakeNvml) -> Refusing:
        # every reading of GPU 2, as a driver that wants the GPU reset answers them
        calls = [n for n in dir(nv) if n.startswith("nvmlDeviceGet") and n != "nvmlDeviceGetCount"]
        refusing.append(Refusing(nv, 0, calls, [2]))
        return refusing[0]

    node = Node(wrap)
    try:
        assert all(g.healthy for g in node.sampler.tick().gpus)
        refusing[0].code = fakenvml.NVML_ERROR_RESET_REQUIRED
        snap = node.sampler.tick()
        assert all(snap.gpus[i].healthy for i in (0, 1, 3))
        reason = snap.gpus[2].reason
        assert reason.startswith(
            "reset required (memory): nvmlDeviceGetMemoryInfo failed on GPU 2:"
        )
        assert "nvidia-smi --gpu-reset -i 2" in reason
        assert node.value("gpud_gpu_healthy", 2) == 0
        assert node.value("gpud_gpu_unhealthy_info", 2, reason=reason) == 1
        assert node.value("gpud_gpu_memory_used_bytes", 3) is not None
    finally:
        node.sampler.close()
        node.backend.close()


def test_a_gpu_that_requires_a_reset_when_first_read_names_the_read_that_failed(
    node: Node,
) -> None:
    # its handle, UUID, name and PCI info answer; the memory size, read with them, does not
    node.sim.faults.reset_required(1)
    reason = node.sampler.tick().gpus[1].reason
    assert reason.startswith("reset required (memory): nvmlDeviceGetMemoryInfo failed on GPU 1:")
    assert "(identity)" not in reason


@pytest.mark.parametrize(
    ("call", "label"),
    [
        ("nvmlDeviceGetMigMode", "mig_mode"),
        # who the GPU is: not "pcie", the later readings' PCIe throughput
        ("nvmlDeviceGetMaxPcieLinkGeneration", "identity"),
        ("nvmlDeviceGetMaxPcieLinkWidth", "identity"),
    ],
)
def test_a_gpu_refused_at_its_first_read_is_labelled_by_what_the_call_reads(
    call: str, label: str
) -> None:
    node = Node(lambda nv: Refusing(nv, fakenvml.NVML_ERROR_RESET_REQUIRED, [call], [1]))
    try:
        reason = node.sampler.tick().gpus[1].reason
        assert reason.startswith(f"reset required ({label}): {call} failed on GPU 1:")
    finally:
        node.sampler.close()
        node.backend.close()


class SteppedClock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


_GPU_READINGS = (
    "gpud_gpu_memory_used_bytes",
    "gpud_gpu_memory_free_bytes",
    "gpud_gpu_utilization_ratio",
    "gpud_gpu_power_watts",
    "gpud_gpu_temperature_celsius",
    "gpud_gpu_sm_clock_hertz",
)


def test_a_gpu_that_requires_a_reset_ages_from_its_last_good_reading() -> None:
    clock = SteppedClock()
    node = Node(clock=clock)
    try:
        node.sampler.tick()
        good_at = clock.now
        node.sim.faults.reset_required(1)
        for _ in range(3):
            clock.now += 40.0
            snap = node.sampler.tick()
        assert not snap.gpus[1].healthy
        assert snap.gpus[1].reason.startswith("reset required (")
        assert snap.gpus[1].sampled_at == good_at
        assert node.value("gpud_gpu_sample_age_seconds", 1) == 120.0
        assert node.value("gpud_gpu_sample_age_seconds", 0) == 0.0
        # the board's size is a fact of its identity, not a reading: kept
        total = snap.gpus[1].identity.memory_total_bytes
        assert node.value("gpud_gpu_memory_total_bytes", 1) == total
        assert [n for n in _GPU_READINGS if node.value(n, 1) is not None] == []
        # the simulated driver refuses every query but identity's
        assert node.value("gpud_gpu_processes", 1) is None
        assert node.value("gpud_gpu_mig_mode_enabled", 1) is None
        node.sim.faults.clear(1)
        clock.now += 1.0
        assert node.sampler.tick().gpus[1].healthy
        assert node.value("gpud_gpu_sample_age_seconds", 1) == 0.0
    finally:
        node.sampler.close()
        node.backend.close()


def test_what_a_gpu_answers_beside_reset_required_is_not_exported_as_fresh() -> None:
    """A driver that wants the GPU reset may still answer some queries, with what it last
    had: none of them is a reading of the GPU now."""
    clock = SteppedClock()
    refusing: list[Refusing] = []

    def wrap(nv: FakeNvml) -> Refusing:
        refusing.append(Refusing(nv, 0, ["nvmlDeviceGetPowerUsage"], [2]))
        return refusing[0]

    node = Node(wrap, clock=clock)
    try:
        node.sampler.tick()
        good_at = clock.now
        assert node.value("gpud_gpu_memory_used_bytes", 2) is not None
        refusing[0].code = fakenvml.NVML_ERROR_RESET_REQUIRED
        clock.now += 45.0
        snap = node.sampler.tick()
        g2 = snap.gpus[2]
        assert g2.reason.startswith("reset required (power_watts): ")
        assert (g2.memory, g2.temperature_celsius, g2.clocks, g2.sampled_at) == (
            None,
            None,
            None,
            good_at,
        )
        assert node.value("gpud_gpu_sample_age_seconds", 2) == 45.0
        assert [n for n in _GPU_READINGS if node.value(n, 2) is not None] == []
        assert all(snap.gpus[i].healthy for i in (0, 1, 3))
    finally:
        node.sampler.close()
        node.backend.close()


def test_a_gpu_that_needs_a_reset_keeps_what_holds_it_and_the_mig_mode_the_reset_switches() -> None:
    """The processes (``nvidia-smi --gpu-reset`` refuses while they hold the GPU) and the
    MIG mode, pending one included, are facts the driver still answers, not aging numbers:
    kept for the operator, while the numbers are dropped and the sample ages."""
    clock = SteppedClock()
    refusing: list[Refusing] = []

    def wrap(nv: FakeNvml) -> Refusing:
        refusing.append(Refusing(nv, 0, ["nvmlDeviceGetPowerUsage"], [1]))
        return refusing[0]

    node = Node(wrap, clock=clock)
    try:
        node.sim.workloads.start(1, 4242, 2 * GIB, 0.5)
        # a process holds the GPU: Hopper keeps the change pending until the reset
        node.backend.set_mig_mode(1, True)
        node.sampler.tick()
        good_at = clock.now
        refusing[0].code = fakenvml.NVML_ERROR_RESET_REQUIRED
        clock.now += 30.0
        snap = node.sampler.tick()
        g1 = snap.gpus[1]
        assert not g1.healthy and g1.reason.startswith("reset required (power_watts): ")
        assert (g1.memory, g1.power_watts, g1.sampled_at) == (None, None, good_at)
        assert [p.pid for p in g1.processes] == [4242] and g1.processes_read
        assert g1.mig_mode is not None
        assert (g1.mig_mode.current, g1.mig_mode.pending) == (False, True)
        assert node.value("gpud_gpu_sample_age_seconds", 1) == 30.0
        assert [n for n in _GPU_READINGS if node.value(n, 1) is not None] == []
        assert node.value("gpud_gpu_processes", 1) == 1
        assert node.value("gpud_gpu_mig_mode_enabled", 1) == 0
        msg = convert.gpu(g1, now_monotonic=clock.now)
        assert (msg.mig_mode.current, msg.mig_mode.pending) == (False, True)
        assert [p.pid for p in msg.processes] == [4242]
    finally:
        node.sampler.close()
        node.backend.close()


def test_a_reading_that_answers_the_driver_timeout_leaves_the_gpu_read() -> None:
    """NVML_ERROR_TIMEOUT belongs to calls given a timeout: on one reading it is that
    reading's error, the GPU's other readings are fresh, not the sample of a faulty GPU."""
    clock = SteppedClock()
    refusing: list[Refusing] = []

    def wrap(nv: FakeNvml) -> Refusing:
        refusing.append(Refusing(nv, fakenvml.NVML_ERROR_TIMEOUT, ["nvmlDeviceGetPowerUsage"], [1]))
        return refusing[0]

    node = Node(wrap, clock=clock)
    try:
        node.sampler.tick()
        clock.now += 5.0
        g1 = node.sampler.tick().gpus[1]
        assert not g1.healthy and g1.reason.startswith("power_watts failed: ")
        assert g1.memory is not None and g1.power_watts is None
        assert g1.sampled_at == clock.now
    finally:
        node.sampler.close()
        node.backend.close()


def test_a_process_list_the_driver_does_not_report_is_absent_not_zero(node: Node) -> None:
    node.sim.workloads.start(1, 4242, 2 * GIB, 0.5)
    node.sim.faults.not_supported(1, "processes")
    snap = node.sampler.tick()
    assert snap.gpus[1].healthy
    assert node.value("gpud_gpu_processes", 1) is None
    assert node.value("gpud_gpu_processes", 0) == 0
    # skipped on the next ticks (asked again later): still absent, not 0
    assert not node.sampler.tick().gpus[1].processes_read
    assert node.value("gpud_gpu_processes", 1) is None
    node.sim.faults.clear(1)
    node.sampler.refresh_identity()  # a fresh view of what the GPU supports
    node.sampler.tick()
    assert node.value("gpud_gpu_processes", 1) == 1


def _mig_labels(gpu: GpuSample, dev: MigSample) -> dict[str, str]:
    """The labels of a 1g.10gb MIG device's series."""
    return {
        "gpu": str(gpu.identity.index),
        "gpu_uuid": gpu.identity.uuid,
        "mig_uuid": dev.identity.uuid,
        "profile": "1g.10gb",
        "gpu_instance_id": str(dev.identity.gpu_instance_id),
        "compute_instance_id": str(dev.identity.compute_instance_id),
    }


def _mig_series(node: Node, gpu: int) -> dict[str, float]:
    """gpud_mig_device_memory_used_bytes of ``gpu``'s MIG devices, by GPU instance ID."""
    return {
        s.labels["gpu_instance_id"]: s.value
        for family in node.registry.collect()
        if family.name == "gpud_mig_device_memory_used_bytes"
        for s in family.samples
        if s.labels["gpu"] == str(gpu)
    }


def test_mig_devices_that_come_and_go_are_shown_as_they_are_at_the_tick(node: Node) -> None:
    """The driver numbers MIG devices among those that exist: a device destroyed or created
    moves others onto new indexes, and neither a removed device nor another's readings under
    a device's labels may show, not even for one tick."""
    enable_mig(node, 1, 3)
    node.sampler.refresh_identity()
    node.sampler.tick()
    first, middle, last = node.sampler.latest().gpus[1].mig_devices  # type: ignore[union-attr]
    node.sim.workloads.start(1, 4242, 3 * GIB, 0.5, mig=2)
    node.sampler.tick()
    ids = [str(d.identity.gpu_instance_id) for d in (first, middle, last)]
    assert _mig_series(node, 1)[ids[2]] >= 3 * GIB

    node.backend.destroy_compute_instance(1, middle.identity.gpu_instance_id, 0)
    node.backend.destroy_gpu_instance(1, middle.identity.gpu_instance_id)
    node.sampler.tick()
    series = _mig_series(node, 1)
    assert sorted(series) == sorted([ids[0], ids[2]])
    assert series[ids[2]] >= 3 * GIB  # its own reading, not the first device's

    # created again where it was: the last device moves back to the index it had, and no
    # driver call fails on the way
    profile = next(p for p in node.backend.gpu_instance_profiles(1) if p.name == "1g.10gb")
    placement = node.backend.gpu_instance_placements(1, profile.id)[1]
    gi = node.backend.create_gpu_instance(1, profile.id, placement)
    node.backend.create_compute_instance(1, gi.id, 0)
    node.sampler.tick()
    series = _mig_series(node, 1)
    assert len(series) == 3 and series[ids[2]] >= 3 * GIB
    node.sim.workloads.stop(4242)


def test_mig_devices_whose_memory_cannot_be_read_keep_their_processes(node: Node) -> None:
    """Only the MIG devices' memory is missing: it is absent with the reason, the processes
    are listed as usual, and the GPU is as healthy as its other reads."""
    enable_mig(node, 1, 2)
    node.sampler.refresh_identity()
    node.sim.workloads.start(1, 4343, 2 * GIB, 0.5, mig=0)
    node.sim.faults.error(1, "mig_memory")
    snap = node.sampler.tick()
    g1 = snap.gpus[1]
    assert g1.healthy and g1.reason == "" and g1.memory is not None
    first, second = g1.mig_devices
    for m in g1.mig_devices:
        assert m.memory is None and "Unknown Error" in m.memory_error
        assert m.processes_read and m.processes_error == ""
    assert [p.pid for p in first.processes] == [4343] and second.processes == ()
    labels = _mig_labels(g1, first)
    v = node.registry.get_sample_value
    assert v("gpud_mig_device_memory_used_bytes", labels) is None  # absent, not 0
    assert v("gpud_mig_device_processes", labels) == 1
    (dev,) = [d for d in convert.gpu(g1, now_monotonic=g1.sampled_at).mig_devices if d.mig == 0]
    assert not dev.HasField("memory") and "Unknown Error" in dev.memory_unknown
    assert dev.processes_unknown == "" and [p.pid for p in dev.processes] == [4343]
    node.sim.faults.clear(1)
    first = node.sampler.tick().gpus[1].mig_devices[0]
    assert first.memory is not None and first.memory_error == ""
    assert v("gpud_mig_device_memory_used_bytes", labels) == first.memory.used_bytes


def test_mig_devices_whose_processes_cannot_be_listed_keep_their_memory(node: Node) -> None:
    """Only the process list is missing: each MIG device's memory is read as usual, the
    process counts are absent (not 0), and the GPU is as healthy as its other reads."""
    enable_mig(node, 1, 2)
    node.sampler.refresh_identity()
    node.sim.workloads.start(1, 4343, 2 * GIB, 0.5, mig=0)
    node.sim.faults.not_supported(1, "processes")
    snap = node.sampler.tick()
    g1 = snap.gpus[1]
    assert g1.healthy and g1.reason == ""
    assert not g1.processes_read and "Not Supported" in g1.processes_error
    first, second = g1.mig_devices
    assert first.memory is not None and first.memory.used_bytes >= 2 * GIB
    assert second.memory is not None
    for m in g1.mig_devices:
        assert not m.processes_read and "Not Supported" in m.processes_error
    labels = _mig_labels(g1, first)
    v = node.registry.get_sample_value
    assert v("gpud_mig_device_memory_used_bytes", labels) == first.memory.used_bytes
    assert v("gpud_mig_device_processes", labels) is None
    assert node.value("gpud_gpu_processes", 1) is None
    # the device list is not read again for it: the devices themselves answered
    assert node.sampler.tick().gpus[1].mig_devices[0].identity == first.identity
    node.sim.faults.clear(1)
    node.sampler.refresh_identity()
    g1 = node.sampler.tick().gpus[1]
    assert g1.mig_devices[0].processes_read and g1.mig_devices[0].processes_error == ""
    assert [p.pid for p in g1.mig_devices[0].processes] == [4343]
    assert v("gpud_mig_device_processes", labels) == 1


def test_hung_call_others_stay_fresh(node: Node) -> None:
    node.sampler.tick()
    node.sim.faults.slow(3, 1.0)
    snap = node.sampler.tick()
    g3 = snap.gpus[3]
    assert not g3.healthy
    # did not wait for the hung GPU: a tick that had would hold the sample its call returned
    assert g3.reason == "not answering: a driver call is outstanding"
    assert all(g.healthy and g.sampled_at >= snap.monotonic for g in snap.gpus[:3])
    snap = node.sampler.tick()  # still stuck: not called again, others fresh
    assert not snap.gpus[3].healthy
    assert all(g.healthy and g.sampled_at >= snap.monotonic for g in snap.gpus[:3])
    age = node.value("gpud_gpu_sample_age_seconds", 3)
    assert age is not None and age > 0.2
    assert node.value("gpud_gpu_healthy", 3) == 0
    reason = {"reason": "not answering: a driver call is outstanding"}
    assert node.value("gpud_gpu_unhealthy_info", 3, **reason) == 1
    node.sim.faults.clear(3)
    deadline = time.monotonic() + 5
    while not node.sampler.tick().gpus[3].healthy:
        assert time.monotonic() < deadline, "GPU 3 did not recover"
        time.sleep(0.1)


def test_xid_events(node: Node) -> None:
    node.sampler.tick()
    # The driver tells only of events after a GPU is registered: register before the
    # watcher starts, so the XIDs below cannot come first.
    assert node.backend.wait_events(0.0) == []
    node.sampler.start()
    node.sim.faults.xid(0, 31)
    node.sim.faults.xid(0, 43)
    deadline = time.monotonic() + 5
    while node.events.counts().get("gpu.xid", 0) < 2:
        assert time.monotonic() < deadline, "XIDs not seen"
        time.sleep(0.02)
    snap = node.sampler.tick()
    assert snap.gpus[0].xid_events_total == 2
    assert snap.gpus[0].last_xid == 43
    assert node.value("gpud_gpu_xid_errors_total", 0) == 2
    assert node.value("gpud_gpu_last_xid", 0) == 43
    assert node.value("gpud_gpu_xid_errors_total", 1) == 0


def test_a_lost_gpus_fault_keeps_no_other_gpus_xids_away(node: Node) -> None:
    """The driver's event set answers GPU_IS_LOST while GPU 1 is lost: GPU 0's XIDs still
    arrive, and GPU 1 is reported lost."""
    node.sampler.tick()
    assert node.backend.wait_events(0.0) == []
    node.sampler.start()
    node.sim.faults.lose(1)
    deadline = time.monotonic() + 5
    while node.events.counts().get("gpu.xid", 0) < 1:  # XID 79, GPU 1 fell off the bus
        assert time.monotonic() < deadline, "XID 79 not seen"
        time.sleep(0.02)
    time.sleep(0.2)  # the watcher waits on the set again
    node.sim.faults.xid(0, 48)
    while node.events.counts().get("gpu.xid", 0) < 2:
        assert time.monotonic() < deadline, "GPU 0's XID not seen"
        time.sleep(0.02)
    snap = node.sampler.tick()
    assert snap.gpus[0].last_xid == 48
    assert not snap.gpus[1].healthy and "lost" in snap.gpus[1].reason
    assert not snap.gpus[1].xids_watched


def test_xids_of_a_gpu_whose_events_cannot_be_watched_are_absent_not_zero(node: Node) -> None:
    """A GPU the driver gives no XID events for (nvmlDeviceRegisterEvents NotSupported)
    would show 0 XIDs however many it raised: its XID count is left out instead."""
    node.sim.faults.not_supported(1, "events")
    assert node.backend.wait_events(0.0) == []  # registers every GPU it can
    assert not node.backend.xid_watched(1)
    assert node.backend.xid_watched(0)
    node.sim.faults.xid(1, 48)  # never reaches gpud
    snap = node.sampler.tick()
    assert not snap.gpus[1].xids_watched and snap.gpus[0].xids_watched
    assert node.value("gpud_gpu_xid_errors_total", 1) is None
    assert node.value("gpud_gpu_xid_errors_total", 0) == 0


def test_mig_devices_that_require_a_reset_make_their_gpu_unhealthy() -> None:
    """A MIG device read answering RESET_REQUIRED is the GPU's fault, not one missing
    reading: the GPU is unhealthy saying what it needs."""
    refusing: list[Refusing] = []

    def wrap(nv: FakeNvml) -> Refusing:
        # MIG device handles carry no GPU index: gpus={None} refuses only their reads
        refusing.append(Refusing(nv, 0, ["nvmlDeviceGetMemoryInfo"], [None]))  # type: ignore[list-item]
        return refusing[0]

    node = Node(wrap)
    try:
        enable_mig(node, 1, 2)
        node.sampler.refresh_identity()
        assert node.sampler.tick().gpus[1].healthy
        refusing[0].code = fakenvml.NVML_ERROR_RESET_REQUIRED
        snap = node.sampler.tick()
        assert all(snap.gpus[i].healthy for i in (0, 2, 3))
        assert snap.gpus[1].reason.startswith("reset required (mig_devices): ")
        assert node.value("gpud_gpu_healthy", 1) == 0
    finally:
        node.sampler.close()
        node.backend.close()


def test_a_gpu_unhealthy_for_one_reading_says_its_mig_devices_were_read_a_faulty_one_not() -> None:
    """An empty MIG device list read on a GPU whose ECC reading fails is the layout (all
    destroyed); one left unread because the GPU needs a reset says so."""
    refusing: list[Refusing] = []

    def wrap(nv: FakeNvml) -> Refusing:
        refusing.append(Refusing(nv, 0, ["nvmlDeviceGetTotalEccErrors"], [1]))
        return refusing[0]

    node = Node(wrap)
    try:
        enable_mig(node, 1, 2)
        node.sampler.refresh_identity()
        assert len(node.sampler.tick().gpus[1].mig_devices) == 2
        for gi in node.backend.gpu_instances(1):
            for ci in gi.compute_instances:
                node.backend.destroy_compute_instance(1, gi.id, ci.id)
            node.backend.destroy_gpu_instance(1, gi.id)
        node.sampler.refresh_identity()
        refusing[0].code = fakenvml.NVML_ERROR_UNKNOWN
        g1 = node.sampler.tick().gpus[1]
        assert not g1.healthy and g1.reason.startswith("ecc failed: ")
        assert (g1.mig_devices, g1.mig_devices_read) == ((), True)
        refusing[0].code = fakenvml.NVML_ERROR_RESET_REQUIRED
        g1 = node.sampler.tick().gpus[1]
        assert g1.reason.startswith("reset required (ecc): ")
        assert g1.mig_mode is not None and g1.mig_mode.current
        assert (g1.mig_devices, g1.mig_devices_read) == ((), False)
    finally:
        node.sampler.close()
        node.backend.close()
