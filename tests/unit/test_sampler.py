"""Sampler behaviour against a small in-test GpuBackend: readings, faults, events, the loop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence
from pathlib import Path

import pytest

from gpud.backend.port import (
    READINGS,
    Clocks,
    EccCounts,
    EventKind,
    GpuEvent,
    GpuIdentity,
    GpuReadings,
    MemoryInfo,
    MigDeviceIdentity,
    MigMode,
    MigReading,
    MigReadings,
    PcieThroughput,
    ProcessInfo,
    Utilization,
)
from gpud.errors import BackendError, GpuLost, NotSupported, Unavailable
from gpud.events import Event, EventLog
from gpud.store import StateStore
from gpud.telemetry.dispatch import Dispatcher, Target
from gpud.telemetry.sampler import (
    XID_STATE_VERSION,
    Sampler,
    XidWatcher,
    parse_xid_state,
    xid_state_document,
)
from gpud.telemetry.seen import Seen, SeenGpus, describe, parse
from gpud.telemetry.snapshot import ClearedXids, CriticalXid, GpuSample, SeenIdentity, Snapshot
from gpud.telemetry.worker import Worker

GIB = 1 << 30


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeBackend:
    """Just the reading half of GpuBackend, with per-GPU faults and call counts."""

    def __init__(self, gpus: int = 4, mig_gpus: dict[int, int] | None = None) -> None:
        self.count = gpus
        self.mig = dict(mig_gpus or {})  # gpu -> number of MIG devices
        self.calls: Counter[tuple[int, str]] = Counter()
        self.lost: set[int] = set()
        self.unsupported: set[tuple[int, str]] = set()
        self.failing: set[tuple[int, str]] = set()
        self.hang: dict[int, threading.Event] = {}
        self.events: list[GpuEvent] = []
        self._lock = threading.Lock()

    def _call(self, gpu: int, name: str) -> None:
        with self._lock:
            self.calls[(gpu, name)] += 1
        gate = self.hang.get(gpu)
        if gate is not None:
            # Each test sets its gate; the bound only ends a thread a failed test left. A
            # hang that ended by itself in a loaded machine's stall would be a GPU that
            # answered again, which is not what the test meant: so it is long.
            gate.wait(120)
        if gpu in self.lost:
            raise GpuLost("GPU has fallen off the bus", gpu=gpu, call=name)
        if (gpu, name) in self.unsupported:
            raise NotSupported(f"{name} not supported", gpu=gpu, call=name)
        if (gpu, name) in self.failing:
            raise BackendError(f"{name}: unknown error", gpu=gpu, call=name)

    def driver_version(self) -> str:
        return "550.54.15"

    def gpu_count(self) -> int:
        return self.count

    def identity(self, gpu: int) -> GpuIdentity:
        self._call(gpu, "identity")
        return GpuIdentity(
            index=gpu,
            uuid=f"GPU-{gpu:08x}",
            name="NVIDIA H100 80GB HBM3",
            product="H100-SXM5-80GB",
            pci_bus_id=f"00000000:{gpu + 0x18:02X}:00.0",
            pci_device_id=0x233010DE,
            memory_total_bytes=80 * GIB,
            mig_capable=True,
        )

    def memory(self, gpu: int, mig: int | None = None) -> MemoryInfo:
        self._call(gpu, "memory" if mig is None else "mig_memory")
        total = 80 * GIB if mig is None else 10 * GIB
        return MemoryInfo(total, GIB, total - GIB)

    def processes(self, gpu: int, mig: int | None = None) -> list[ProcessInfo]:
        self._call(gpu, "processes" if mig is None else "mig_processes")
        return [ProcessInfo(pid=100 + gpu, used_memory_bytes=GIB)]

    def gpu_readings(self, gpu: int, skip: Collection[str] = frozenset()) -> GpuReadings:
        # One call per reading, each failing on its own, as the port describes.
        calls: dict[str, Callable[[int], object]] = {
            "memory": self.memory,
            "utilization": self.utilization,
            "power_watts": self.power_watts,
            "temperature_celsius": self.temperature_celsius,
            "clocks": self.clocks,
            "ecc": self.ecc_errors,
            "pcie": self.pcie_throughput,
            "nvlink_bytes": self.nvlink_throughput_bytes,
            "processes": lambda gpu: tuple(self.processes(gpu)),
            "mig_mode": self.mig_mode,
        }
        values: dict[str, object] = {}
        errors: list[tuple[str, BackendError]] = []
        for name in READINGS:
            if name in skip:
                continue
            try:
                values[name] = calls[name](gpu)
            except BackendError as err:
                errors.append((name, err))
                if isinstance(err, GpuLost):
                    return GpuReadings(errors=tuple(errors))
        return GpuReadings(**values, errors=tuple(errors))  # type: ignore[arg-type]

    def mig_readings(self, gpu: int, devices: Sequence[MigDeviceIdentity]) -> MigReadings:
        out: list[MigReading] = []
        errors: list[tuple[int, BackendError]] = []
        for dev in devices:
            try:
                memory = self.memory(gpu, dev.mig)
                processes = tuple(self.processes(gpu, dev.mig))
            except GpuLost:
                raise
            except BackendError as err:
                out.append(MigReading(dev, None, (), False))
                errors.append((dev.mig, err))
                continue
            out.append(MigReading(dev, memory, processes, True))
        return MigReadings(tuple(out), tuple(errors))

    def utilization(self, gpu: int) -> Utilization:
        self._call(gpu, "utilization")
        if self.mig.get(gpu):
            raise NotSupported("utilization in MIG mode", gpu=gpu)
        return Utilization(0.5, 0.25)

    def power_watts(self, gpu: int) -> float:
        self._call(gpu, "power_watts")
        return 300.0

    def temperature_celsius(self, gpu: int) -> float:
        self._call(gpu, "temperature_celsius")
        return 40.0 + gpu

    def clocks(self, gpu: int) -> Clocks:
        self._call(gpu, "clocks")
        return Clocks(1980, 2619)

    def ecc_errors(self, gpu: int) -> EccCounts:
        self._call(gpu, "ecc_errors")
        return EccCounts(1, 0)

    def pcie_throughput(self, gpu: int) -> PcieThroughput:
        self._call(gpu, "pcie_throughput")
        return PcieThroughput(1e6, 2e6)

    def nvlink_throughput_bytes(self, gpu: int) -> tuple[int, int]:
        self._call(gpu, "nvlink_throughput_bytes")
        return (10, 20)

    def mig_mode(self, gpu: int) -> MigMode:
        self._call(gpu, "mig_mode")
        on = bool(self.mig.get(gpu))
        return MigMode(on, on)

    def mig_devices(self, gpu: int) -> list[MigDeviceIdentity]:
        self._call(gpu, "mig_devices")
        return [
            MigDeviceIdentity(
                gpu=gpu,
                mig=i,
                uuid=f"MIG-{gpu:04x}{i:04x}",
                gpu_instance_id=7 + i,
                compute_instance_id=0,
                gpu_instance_profile_id=19,
                profile_name="1g.10gb",
                memory_total_bytes=10 * GIB,
                multiprocessor_count=16,
            )
            for i in range(self.mig.get(gpu, 0))
        ]

    def wait_events(self, timeout_s: float) -> list[GpuEvent]:
        with self._lock:
            events, self.events = self.events, []
        if not events:
            time.sleep(min(timeout_s, 0.02))
        return events

    def xid_watched(self, gpu: int) -> bool:
        return True

    def close(self) -> None:
        pass


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def events() -> EventLog:
    return EventLog(None)


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(gpus=4, mig_gpus={1: 7})


def _sampler(
    backend: FakeBackend, clock: FakeClock, events: EventLog, event_wait_s: float = 0.05
) -> Sampler:
    return Sampler(
        backend,  # type: ignore[arg-type]  # only the reading half is implemented
        history=3,
        call_timeout_s=0.3,
        clock=clock,
        wall_clock=lambda: 1.7e9,
        events=events,
        event_wait_s=event_wait_s,
    )


@pytest.fixture
def sampler(backend: FakeBackend, clock: FakeClock, events: EventLog) -> Iterator[Sampler]:
    s = _sampler(backend, clock, events)
    yield s
    for gate in backend.hang.values():
        gate.set()
    s.close()


def test_tick_reads_every_gpu_and_mig_device(sampler: Sampler) -> None:
    snap = sampler.tick()
    assert [g.identity.index for g in snap.gpus] == [0, 1, 2, 3]
    assert snap.wall_time == 1.7e9
    assert snap.driver_version == "550.54.15"
    g0 = snap.gpus[0]
    assert g0.healthy and g0.reason == ""
    assert g0.memory == MemoryInfo(80 * GIB, GIB, 79 * GIB)
    assert g0.utilization == Utilization(0.5, 0.25)
    assert g0.clocks == Clocks(1980, 2619)
    assert g0.nvlink_bytes == (10, 20)
    assert g0.processes == (ProcessInfo(100, GIB),)
    assert g0.mig_mode == MigMode(False, False)
    assert g0.mig_devices == ()
    g1 = snap.gpus[1]
    assert g1.healthy
    assert g1.utilization is None  # NotSupported in MIG mode: just absent
    assert len(g1.mig_devices) == 7
    assert g1.mig_devices[3].identity.uuid == "MIG-00010003"
    assert g1.mig_devices[3].memory == MemoryInfo(10 * GIB, GIB, 9 * GIB)
    assert snap.by_uuid("MIG-00010003") is g1.mig_devices[3]
    with pytest.raises(AttributeError):  # immutable
        snap.gpus[0].healthy = False  # type: ignore[misc]
    with pytest.raises(AttributeError):
        g1.mig_devices[3].memory = None  # type: ignore[misc]


def test_history_is_bounded_and_latest_is_last(sampler: Sampler, clock: FakeClock) -> None:
    assert sampler.latest() is None
    for _ in range(5):
        clock.now += 1
        sampler.tick()
    hist = sampler.history()
    assert len(hist) == 3
    assert [s.monotonic for s in hist] == [1003.0, 1004.0, 1005.0]
    assert sampler.latest() is hist[-1]


def test_identity_is_read_once_and_mig_list_refreshed_on_request(
    sampler: Sampler, backend: FakeBackend
) -> None:
    for _ in range(3):
        sampler.tick()
    assert backend.calls[(0, "identity")] == 1
    assert backend.calls[(1, "mig_devices")] == 1
    backend.mig[1] = 3
    sampler.refresh_identity(1)
    snap = sampler.tick()
    assert backend.calls[(1, "identity")] == 2
    assert backend.calls[(0, "identity")] == 1
    assert len(snap.gpus[1].mig_devices) == 3


def test_a_gpu_lost_when_its_identity_is_read_again_keeps_what_was_read(
    sampler: Sampler, backend: FakeBackend
) -> None:
    """A GPU read once and lost keeps its static facts, also when gpud asked to read them
    again (after a MIG change) just as it fell off the bus: not a placeholder of zeros."""
    read = sampler.tick().gpus[1].identity
    backend.lost.add(1)
    sampler.refresh_identity(1)
    for _ in range(2):
        g1 = sampler.tick().gpus[1]
        assert not g1.healthy and "GPU lost (identity)" in g1.reason and g1.lost
        assert g1.identity == read and g1.identity.read
    backend.lost.clear()
    assert sampler.tick().gpus[1].healthy
    assert backend.calls[(1, "identity")] == 4  # asked again until it answered


def test_mig_list_refreshed_when_mig_mode_changes(sampler: Sampler, backend: FakeBackend) -> None:
    sampler.tick()
    backend.mig[2] = 2
    snap = sampler.tick()
    assert len(snap.gpus[2].mig_devices) == 2
    assert snap.gpus[2].utilization is None
    backend.mig[2] = 0
    snap = sampler.tick()
    assert snap.gpus[2].mig_devices == ()
    assert snap.gpus[2].utilization == Utilization(0.5, 0.25)  # asked again after leaving MIG


def test_not_supported_field_is_none_and_retried_only_occasionally(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock
) -> None:
    backend.unsupported.add((0, "power_watts"))
    for _ in range(10):
        clock.now += 1
        snap = sampler.tick()
    g0 = snap.gpus[0]
    assert g0.healthy  # unsupported is not a fault
    assert g0.power_watts is None
    assert g0.temperature_celsius == 40.0
    assert backend.calls[(0, "power_watts")] == 1
    assert backend.calls[(1, "utilization")] == 1  # MIG GPU: asked once
    clock.now += 301
    sampler.tick()
    assert backend.calls[(0, "power_watts")] == 2


def test_lost_gpu_is_unhealthy_others_keep_reporting(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock, events: EventLog
) -> None:
    first = sampler.tick()
    clock.now += 1
    backend.lost.add(2)
    snap = sampler.tick()
    g2 = snap.gpus[2]
    assert not g2.healthy and g2.lost  # what admission's advice is chosen by
    assert "GPU lost" in g2.reason
    assert g2.identity.uuid == "GPU-00000002"  # stays visible
    assert g2.memory is None
    assert g2.sampled_at == first.gpus[2].sampled_at  # age keeps growing
    assert all(g.healthy and g.sampled_at == clock.now for g in snap.gpus if g.identity.index != 2)
    assert [e.kind for e in events.recent()] == ["gpu.unhealthy"]
    assert events.recent()[0].fields["gpu"] == 2
    clock.now += 1
    sampler.tick()
    assert events.counts() == {"gpu.unhealthy": 1}  # transitions only
    backend.lost.clear()
    snap = sampler.tick()
    assert snap.gpus[2].healthy
    assert events.counts() == {"gpu.unhealthy": 1, "gpu.recovered": 1}


def test_lost_at_start_shows_placeholder_identity(clock: FakeClock) -> None:
    backend = FakeBackend(gpus=2)
    backend.lost.add(0)
    s = Sampler(backend, clock=clock, call_timeout_s=1)  # type: ignore[arg-type]
    try:
        snap = s.tick()
        assert not snap.gpus[0].healthy and snap.gpus[0].lost
        assert not snap.gpus[1].lost
        assert snap.gpus[0].identity.index == 0 and snap.gpus[0].identity.uuid == ""
        assert not snap.gpus[0].identity.read  # its zeros are no facts
        assert snap.gpus[1].identity.read
        assert snap.gpus[1].healthy
        backend.lost.clear()
        assert s.tick().gpus[0].identity.uuid == "GPU-00000000"
    finally:
        s.close()


def test_a_gpu_lost_at_start_is_named_as_last_seen(clock: FakeClock, tmp_path: Path) -> None:
    """Its identity cannot be read, but an earlier run's is kept in the state database."""
    store = StateStore(tmp_path)
    try:
        backend = FakeBackend(gpus=2)
        first = Sampler(backend, clock=clock, call_timeout_s=1)  # type: ignore[arg-type]
        try:
            seen = SeenGpus(store)
            changes = seen.changes(g.identity for g in first.tick().gpus)
            assert set(changes) == {0, 1}
            seen.remember(changes, now=1.0)
            assert seen.changes(g.identity for g in first.tick().gpus) == {}  # nothing new
        finally:
            first.close()
        backend.lost.add(0)
        known = SeenGpus(store).known  # as a restarted gpud reads it
        events = EventLog(None)
        again = Sampler(backend, clock=clock, call_timeout_s=1, last_seen=known, events=events)  # type: ignore[arg-type]
        try:
            gpu0, gpu1 = again.tick().gpus
            assert not gpu0.healthy and gpu0.identity.uuid == ""
            assert gpu0.reason.endswith(
                "; last seen as NVIDIA H100 80GB HBM3 GPU-00000000 at 00000000:18:00.0"
            )
            assert "last seen" not in gpu1.reason
            # metrics, the API and gpuctl name it so, not by its index alone
            seen0 = SeenIdentity(
                "GPU-00000000", "NVIDIA H100 80GB HBM3", "00000000:18:00.0", "H100-SXM5-80GB"
            )
            assert gpu0.last_seen == seen0 and gpu0.known() == seen0
            assert gpu1.last_seen is None and gpu1.known().uuid == "GPU-00000001"
            (lost,) = [e for e in events.recent() if e.kind == "gpu.unhealthy"]
            assert lost.fields["uuid"] == "GPU-00000000"
        finally:
            again.close()
    finally:
        store.close()


def test_a_gpu_kept_by_an_older_gpud_is_named_without_its_product(
    clock: FakeClock, tmp_path: Path
) -> None:
    """A state database whose gpu_seen has no product column (as an older gpud kept it)
    loads: the GPU is named by what was kept, and the product is kept once it answers."""
    description = "NVIDIA H100 80GB HBM3 GPU-00000000 at 00000000:18:00.0"
    store = StateStore(tmp_path)
    try:
        store.ensure_schema(
            (
                """CREATE TABLE gpu_seen (
                    gpu_index INTEGER PRIMARY KEY,
                    description TEXT NOT NULL,
                    seen_at REAL NOT NULL
                )""",
            )
        )
        with store.transaction() as conn:
            conn.execute("INSERT INTO gpu_seen VALUES (0, ?, 1.0)", (description,))
    finally:
        store.close()
    store = StateStore(tmp_path)
    try:
        seen = SeenGpus(store)
        assert seen.known == {0: Seen(description, "")}
        backend = FakeBackend(gpus=1)
        backend.lost.add(0)
        s = Sampler(backend, clock=clock, call_timeout_s=1, last_seen=seen.known)  # type: ignore[arg-type]
        try:
            (gpu0,) = s.tick().gpus
            assert gpu0.reason.endswith(f"; last seen as {description}")
            assert gpu0.known() == SeenIdentity(
                "GPU-00000000", "NVIDIA H100 80GB HBM3", "00000000:18:00.0", ""
            )
            backend.lost.clear()
            changes = seen.changes(g.identity for g in s.tick().gpus)
        finally:
            s.close()
        assert changes == {0: Seen(description, "H100-SXM5-80GB")}  # the same GPU, and more
        seen.remember(changes, now=2.0)
        assert SeenGpus(store).known == {0: Seen(description, "H100-SXM5-80GB")}
    finally:
        store.close()


def test_a_gpu_never_seen_is_known_by_nothing(clock: FakeClock) -> None:
    backend = FakeBackend(gpus=1)
    backend.lost.add(0)
    s = Sampler(backend, clock=clock, call_timeout_s=1)  # type: ignore[arg-type]
    try:
        (gpu0,) = s.tick().gpus
        assert gpu0.last_seen is None and gpu0.known() == SeenIdentity("", "", "")
    finally:
        s.close()


@pytest.mark.parametrize(
    "name", ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "Graphics at Work"]
)
def test_a_description_reads_back_as_the_identity_it_describes(name: str) -> None:
    ident = dataclasses.replace(FakeBackend(gpus=1).identity(0), name=name)
    assert parse(describe(ident)) == SeenIdentity(ident.uuid, name, ident.pci_bus_id)


@pytest.mark.parametrize("text", ["", "edited by hand", "NVIDIA H100 at 00000000:18:00.0"])
def test_a_description_not_of_gpuds_making_names_nothing(text: str) -> None:
    assert parse(text) is None


def test_failing_field_marks_gpu_unhealthy_but_keeps_other_fields(
    sampler: Sampler, backend: FakeBackend
) -> None:
    backend.failing.add((3, "clocks"))
    g3 = sampler.tick().gpus[3]
    assert not g3.healthy
    assert g3.reason.startswith("clocks failed")
    assert g3.clocks is None
    assert g3.power_watts == 300.0


def test_hung_call_times_out_others_stay_fresh(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock, events: EventLog
) -> None:
    sampler.tick()
    gate = threading.Event()
    backend.hang[0] = gate
    clock.now += 1
    snap = sampler.tick()
    assert _read_outstanding(sampler, 0)  # the tick did not wait for the hung call
    g0 = snap.gpus[0]
    assert not g0.healthy
    assert g0.reason == "not answering: a driver call is outstanding"
    assert all(g.healthy and g.sampled_at == clock.now for g in snap.gpus[1:])
    calls_while_hung = backend.calls[(0, "memory")]
    for _ in range(2):
        clock.now += 1
        snap = sampler.tick()
        assert not snap.gpus[0].healthy
        assert all(g.healthy and g.sampled_at == clock.now for g in snap.gpus[1:])
    assert backend.calls[(0, "memory")] == calls_while_hung  # no new call while hung
    assert events.counts() == {"gpu.unhealthy": 1}
    del backend.hang[0]
    gate.set()
    _wait_for(lambda: not _read_outstanding(sampler, 0))
    clock.now += 1
    snap = sampler.tick()
    assert snap.gpus[0].healthy
    assert snap.gpus[0].sampled_at == clock.now
    assert events.counts()["gpu.recovered"] == 1


def test_xid_events_are_counted_and_logged(
    sampler: Sampler, backend: FakeBackend, events: EventLog
) -> None:
    sampler.tick()
    sampler.start()
    backend.events += [
        GpuEvent(gpu=1, kind=EventKind.XID, xid=31, gpu_instance_id=7),
        GpuEvent(gpu=1, kind=EventKind.XID, xid=43),
        GpuEvent(gpu=3, kind=EventKind.ECC_DOUBLE_BIT),
    ]
    deadline = time.monotonic() + 5
    while events.counts().get("gpu.ecc") != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    snap = sampler.tick()
    assert snap.gpus[1].xid_events_total == 2
    assert snap.gpus[1].last_xid == 43
    assert snap.gpus[0].xid_events_total == 0
    xids = events.recent(kind_prefix="gpu.xid")
    assert [e.fields["xid"] for e in xids] == [31, 43]
    assert xids[0].fields["uuid"] == "GPU-00000001"
    assert xids[0].fields["gpu_instance_id"] == 7
    # on a MIG device: it and its GPU as the MIG metrics name them
    assert xids[0].fields["gpu_uuid"] == "GPU-00000001"
    assert xids[0].fields["mig_uuid"] == "MIG-00010000"  # GPU instance 7's, in the snapshot
    assert "gpu_uuid" not in xids[1].fields  # on the whole GPU


class _EventsDownThenBack(FakeBackend):
    """A driver whose event wait fails ``failures`` times, then answers."""

    def __init__(self, failures: int) -> None:
        super().__init__(gpus=1)
        self.failures = failures
        self.answered = threading.Event()

    def wait_events(self, timeout_s: float) -> list[GpuEvent]:
        if self.failures > 0:
            self.failures -= 1
            raise BackendError("NVML_ERROR_UNKNOWN")
        self.answered.set()
        return super().wait_events(timeout_s)


def test_waiting_for_gpu_events_says_once_that_it_failed_and_once_that_it_works_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = _EventsDownThenBack(failures=3)
    caplog.set_level("INFO", logger="gpud.telemetry.sampler")
    watcher = XidWatcher(backend, lambda event: None, wait_s=0.01, retry_s=0.0)
    watcher.start()
    try:
        assert backend.answered.wait(5)
        time.sleep(0.05)  # a few more answered waits: nothing more to say
    finally:
        watcher.stop()
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "waiting for GPU events failed, retrying: NVML_ERROR_UNKNOWN"),
        ("INFO", "waiting for GPU events works again"),
    ]


def test_listener_errors_do_not_break_the_tick(sampler: Sampler) -> None:
    seen: list[float] = []

    def bad(_snap: object) -> None:
        raise RuntimeError("boom")

    sampler.subscribe(bad)
    sampler.subscribe(lambda snap: seen.append(snap.monotonic))
    sampler.tick()
    assert seen == [1000.0]


async def test_run_ticks_without_blocking_the_event_loop(backend: FakeBackend) -> None:
    gate = threading.Event()
    backend.hang[3] = gate  # a hung GPU from the start
    s = Sampler(backend, interval_s=0.05, call_timeout_s=0.2)  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(s.run(stop))
    beats = 0
    try:
        # The loop keeps turning while ticks wait on the hung GPU.
        for _ in range(40):
            await asyncio.sleep(0.01)
            beats += 1
        snap = s.latest()
        assert snap is not None
        assert [g.healthy for g in snap.gpus] == [True, True, True, False]
    finally:
        gate.set()
        stop.set()
        await asyncio.wait_for(task, 5)
    assert beats == 40
    assert len(s.history()) >= 2


class _EventWaitHangs(FakeBackend):
    """A driver whose event wait (``nvmlEventSetWait``) hangs, past its timeout, until
    ``answer`` is set."""

    def __init__(self) -> None:
        super().__init__(gpus=1)
        self.waiting = threading.Event()
        self.answer = threading.Event()

    def wait_events(self, timeout_s: float) -> list[GpuEvent]:
        self.waiting.set()
        self.answer.wait(10)
        return []


async def test_the_close_at_the_end_of_run_does_not_hold_the_event_loop() -> None:
    """The event watcher's thread is joined off the loop: while the driver's event wait
    hangs, the loop (a second SIGTERM's handler, the daemon's stop) goes on turning."""
    backend = _EventWaitHangs()
    s = Sampler(backend, interval_s=3600.0, event_wait_s=0.05)  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(s.run(stop))
    try:
        assert await asyncio.to_thread(backend.waiting.wait, 5)
        stop.set()
        loop = asyncio.get_running_loop()
        longest, last = 0.0, loop.time()
        for _ in range(30):
            await asyncio.sleep(0.01)
            longest, last = max(longest, loop.time() - last), loop.time()
        assert longest < 0.5, longest  # the join takes event_wait_s + 1 s
    finally:
        backend.answer.set()
        await asyncio.wait_for(task, 5)
    with pytest.raises(Unavailable):  # closed all the same
        s.tick()


@contextlib.asynccontextmanager
async def running(backend: FakeBackend, interval_s: float) -> AsyncIterator[Sampler]:
    """A sampler's run, from its first tick (at once) to its stop."""
    s = Sampler(backend, interval_s=interval_s)  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(s.run(stop))
    try:
        while s.latest() is None:
            await asyncio.sleep(0.01)
        yield s
    finally:
        stop.set()
        await asyncio.wait_for(task, 2)  # at once, even in the middle of a long wait


async def test_a_shorter_interval_set_while_run_waits_takes_effect_at_once(
    backend: FakeBackend,
) -> None:
    """A reload from an hour to 10 ms: the next tick comes within the new period, not after
    the hour the run was waiting out."""
    async with running(backend, 3600.0) as s:
        first = len(s.history())
        s.interval_s = 0.01
        for _ in range(200):
            if len(s.history()) > first + 2:
                break
            await asyncio.sleep(0.01)
        assert len(s.history()) > first + 2


async def test_a_longer_interval_set_while_run_waits_adds_no_tick(
    backend: FakeBackend,
) -> None:
    """A reload from 0.2 s to an hour: the wait is measured again, from the last tick, with
    the hour; the change itself is no tick."""
    async with running(backend, 0.2) as s:
        ticks = len(s.history())
        s.interval_s = 3600.0
        await asyncio.sleep(0.6)  # three of the old periods
        assert len(s.history()) == ticks


async def test_a_stop_during_a_wait_measured_again_ends_the_run_at_once(
    backend: FakeBackend,
) -> None:
    async with running(backend, 3600.0) as s:
        s.interval_s = 1800.0  # the wait is measured again: still half an hour
        await asyncio.sleep(0.05)
        ticks = len(s.history())
    assert len(s.history()) == ticks  # stopped within 2 s, with no tick on the way out


def test_rejects_bad_settings(backend: FakeBackend) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        Sampler(backend, interval_s=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="call_timeout_s"):
        Sampler(backend, call_timeout_s=0)  # type: ignore[arg-type]


def test_several_hung_gpus_cost_two_timeouts_not_one_each_and_are_found_at_the_next_tick(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock
) -> None:
    sampler.tick()
    gate = threading.Event()
    for gpu in (0, 1, 2):
        backend.hang[gpu] = gate
    clock.now += 1
    snap = sampler.tick()
    # GPU 0 stalls the pass; 1 and 2 are then read on threads of their own, in parallel
    # (each is called once, while 0 still hangs), and 3 keeps a fresh sample.
    assert [backend.calls[(g, "memory")] for g in (0, 1, 2)] == [2, 2, 2]
    assert snap.gpus[3].sampled_at == clock.now
    # late together, and GPU 3's answer of the same tick proves nothing (an unevenly starved
    # host answers some reads of a burst in time and not others)
    assert [g.healthy for g in snap.gpus] == [True] * 4
    clock.now += 1
    snap = sampler.tick()  # all three still stuck: not called again
    assert [backend.calls[(g, "memory")] for g in (0, 1, 2)] == [2, 2, 2]
    # GPU 3 answers in time a read of a later tick while the three are outstanding: hung
    assert [g.healthy for g in snap.gpus] == [False, False, False, True]
    backend.hang.clear()
    gate.set()
    _wait_for(lambda: not any(_read_outstanding(sampler, gpu) for gpu in (0, 1, 2)))
    assert all(g.healthy for g in sampler.tick().gpus)


def test_hung_gpu_is_not_answering_at_once_and_unhealthy_at_the_timeout(
    backend: FakeBackend, clock: FakeClock, events: EventLog
) -> None:
    # A call timeout far longer than the interval: the tick must not wait for it. (Each
    # tick waits half the interval for the others' reads: 1 s, so that a loaded machine
    # still reads them in time.)
    s = Sampler(
        backend,  # type: ignore[arg-type]
        interval_s=2.0,
        call_timeout_s=60.0,
        clock=clock,
        events=events,
    )
    gate = threading.Event()
    try:
        s.tick()
        backend.hang[2] = gate
        clock.now += 0.2
        snap = s.tick()
        assert snap.gpus[2].healthy is False
        assert snap.gpus[2].reason == "not answering: a driver call is outstanding"
        # The others are read in the same tick: their samples are as fresh as the tick.
        assert all(
            g.healthy and g.sampled_at == clock.now for g in snap.gpus if g is not snap.gpus[2]
        )
        clock.now += 30
        snap = s.tick()
        assert snap.gpus[2].reason == "not answering: a driver call is outstanding"
        assert all(g.sampled_at == clock.now for g in snap.gpus if g is not snap.gpus[2])
        clock.now += 30  # 60 s outstanding: the call timeout
        snap = s.tick()
        assert snap.gpus[2].healthy is False
        # one hung state, one reason: past the call timeout as before it (a metric label and
        # an event reason that changed would page again for the same fault)
        assert snap.gpus[2].reason == "not answering: a driver call is outstanding"
        reasons = [
            e.fields["reason"]
            for e in events.recent(kind_prefix="gpu.unhealthy")
            if e.fields["gpu"] == 2
        ]
        assert reasons == ["not answering: a driver call is outstanding"]
        del backend.hang[2]
        gate.set()
        deadline = time.monotonic() + 5
        while not s.tick().gpus[2].healthy:
            assert time.monotonic() < deadline, "GPU 2 did not recover"
            time.sleep(0.01)
    finally:
        gate.set()
        s.close()


NOT_ANSWERING = "not answering: a driver call is outstanding"


def _starve(backend: FakeBackend, gpus: Sequence[int]) -> dict[int, threading.Event]:
    """Hold every call of ``gpus`` past the tick's deadlines: what a host that gives gpud no
    CPU does to reads a simulated driver makes in Python (or a hang, until released)."""
    gates = {gpu: threading.Event() for gpu in gpus}
    backend.hang.update(gates)
    return gates


def _answer(backend: FakeBackend, sampler: Sampler, gates: dict[int, threading.Event]) -> None:
    """Let the held reads of ``gates``' GPUs return, and wait until they have."""
    for gpu, gate in gates.items():
        del backend.hang[gpu]
        gate.set()
    _wait_for(lambda: not any(_read_outstanding(sampler, gpu) for gpu in gates))


def test_gpus_late_together_on_a_starved_host_keep_their_health(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock, events: EventLog
) -> None:
    first = sampler.tick()
    gates = _starve(backend, range(4))
    clock.now += 1
    snap = sampler.tick()
    # every read late together: each GPU shows its last answer, as old as it is
    assert [g.healthy for g in snap.gpus] == [True] * 4
    assert [g.sampled_at for g in snap.gpus] == [g.sampled_at for g in first.gpus]
    _answer(backend, sampler, gates)
    clock.now += 1
    snap = sampler.tick()
    assert all(g.healthy and g.sampled_at == clock.now for g in snap.gpus)
    assert "gpu.unhealthy" not in events.counts()


def test_a_read_late_through_ticks_of_starvation_keeps_its_gpus_health(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock
) -> None:
    """The reads late with it may be of a later tick: the host still starves gpud."""
    sampler.tick()
    first = _starve(backend, range(4))
    clock.now += 0.1
    assert all(g.healthy for g in sampler.tick().gpus)
    _answer(backend, sampler, {g: first[g] for g in (1, 2, 3)})  # late answers: no proof
    _starve(backend, [1, 2, 3])
    clock.now += 0.1
    snap = sampler.tick()  # GPU 0 still outstanding, the others late in this tick
    assert [g.healthy for g in snap.gpus] == [True] * 4


def test_a_gpu_hung_among_starved_ones_is_not_answering_once_the_next_tick_reads_another(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock
) -> None:
    sampler.tick()
    gates = _starve(backend, range(4))
    clock.now += 1
    assert all(g.healthy for g in sampler.tick().gpus)  # late together: not judged yet
    _answer(backend, sampler, {g: gates[g] for g in (0, 1, 3)})  # GPU 2 never returns
    clock.now += 0.1  # well within call_timeout_s
    snap = sampler.tick()
    assert [g.healthy for g in snap.gpus] == [True, True, False, True]
    assert snap.gpus[2].reason == NOT_ANSWERING


def test_gpus_late_together_are_not_answering_once_outstanding_the_call_timeout(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock
) -> None:
    """Every GPU hung at once (the driver's own hang) shows no read answering: the call
    timeout bounds how long reads late together keep their GPUs' health."""
    sampler.tick()
    _starve(backend, range(4))
    clock.now += 1
    assert all(g.healthy for g in sampler.tick().gpus)
    clock.now += 1  # past call_timeout_s (0.3 s)
    snap = sampler.tick()
    assert [g.reason for g in snap.gpus] == [NOT_ANSWERING] * 4


@pytest.mark.parametrize("gpus", [1, 4])
def test_the_last_gpu_read_hung_alone_is_not_answering_in_the_tick_it_hangs(
    gpus: int, clock: FakeClock, events: EventLog
) -> None:
    """No read after it in the tick to compare with (on a node of one GPU, none at all): a
    read late alone is hung at its deadline, as fast as ever."""
    backend = FakeBackend(gpus=gpus)
    s = Sampler(backend, call_timeout_s=0.3, clock=clock, events=events)  # type: ignore[arg-type]
    try:
        s.tick()
        gates = _starve(backend, [gpus - 1])
        clock.now += 1
        snap = s.tick()
        assert [g.healthy for g in snap.gpus] == [True] * (gpus - 1) + [False]
        assert snap.gpus[-1].reason == NOT_ANSWERING
    finally:
        for gate in gates.values():
            gate.set()
        s.close()


def test_a_lost_gpus_fast_failures_do_not_make_gpus_late_together_not_answering(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock
) -> None:
    """A failed read is no answer: a GPU that fails at once (lost) neither shows that the
    driver answers while the others' reads are late, nor keeps a sample from before."""
    sampler.tick()
    backend.lost.add(3)
    gates = _starve(backend, range(3))
    for _ in range(2):
        clock.now += 0.1
        snap = sampler.tick()
        assert [g.healthy for g in snap.gpus] == [True, True, True, False]
        assert snap.gpus[3].reason.startswith("GPU lost")
    _starve(backend, [3])  # lost, then late: it has no answer since its failure to show
    _answer(backend, sampler, gates)
    clock.now += 0.1
    snap = sampler.tick()  # 0 to 2 read again in a later tick, 3 late alone
    assert [g.healthy for g in snap.gpus] == [True, True, True, False]
    assert snap.gpus[3].reason == NOT_ANSWERING
    backend.hang[3].set()


def test_a_read_begun_before_a_reset_is_not_the_gpus_answer(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock
) -> None:
    sampler.tick()
    gates = _starve(backend, range(4))
    clock.now += 1
    assert all(g.healthy for g in sampler.tick().gpus)
    sampler.gpu_reset(1)  # while every read is late
    clock.now += 0.1
    snap = sampler.tick()
    # its last answer is of the GPU before the reset: not shown as the GPU now
    assert [g.healthy for g in snap.gpus] == [True, False, True, True]
    assert snap.gpus[1].reason == NOT_ANSWERING
    _answer(backend, sampler, gates)
    # the read held across the reset was made again, reading the GPU's identity anew
    assert backend.calls[(1, "identity")] == 2
    assert backend.calls[(0, "identity")] == 1
    clock.now += 0.1
    assert all(g.healthy for g in sampler.tick().gpus)
    assert backend.calls[(1, "identity")] == 2


class _Replaced(FakeBackend):
    """A backend whose GPU 1 is another board after ``replace()`` (a reset that swapped it,
    as far as a read can tell: another UUID)."""

    def __init__(self) -> None:
        super().__init__()
        self.board = 0

    def identity(self, gpu: int) -> GpuIdentity:
        ident = super().identity(gpu)
        return dataclasses.replace(ident, uuid=f"{ident.uuid}-{self.board}") if gpu == 1 else ident


def test_a_read_in_progress_when_its_gpu_is_reset_is_made_again(
    clock: FakeClock, events: EventLog
) -> None:
    backend = _Replaced()
    # deadlines of a minute: the held read is within its deadline however slow the host
    s = Sampler(backend, interval_s=120.0, call_timeout_s=60.0, clock=clock, events=events)  # type: ignore[arg-type]
    gate = threading.Event()
    try:
        s.tick()
        backend.hang[1] = gate
        got: list[Snapshot] = []
        ticking = threading.Thread(target=lambda: got.append(s.tick()), daemon=True)
        ticking.start()
        _wait_for(lambda: backend.calls[(1, "memory")] == 2)  # held inside its read
        backend.board = 1
        s.gpu_reset(1)
        del backend.hang[1]
        gate.set()
        ticking.join(30)
        assert got[0].gpus[1].healthy
        assert got[0].gpus[1].identity.uuid == "GPU-00000001-1"
    finally:
        gate.set()
        s.close()


def test_a_gpu_found_hung_stays_not_answering_when_other_gpus_reads_turn_late(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock, events: EventLog
) -> None:
    """Reads of other GPUs late since (a host starved from then on) do not show that a call
    already found stuck is not: the GPU stays not answering until its call returns."""
    sampler.tick()
    hung = _starve(backend, [2])
    clock.now += 0.1
    assert [g.healthy for g in sampler.tick().gpus] == [True, True, False, True]
    starved = _starve(backend, [0, 1, 3])
    clock.now += 0.1
    snap = sampler.tick()
    assert [(g.healthy, g.reason) for g in snap.gpus] == [
        (True, ""),
        (True, ""),
        (False, NOT_ANSWERING),
        (True, ""),
    ]
    assert events.counts() == {"gpu.unhealthy": 1}
    _answer(backend, sampler, {**starved, **hung})
    clock.now += 0.1
    assert all(g.healthy for g in sampler.tick().gpus)
    assert events.counts() == {"gpu.unhealthy": 1, "gpu.recovered": 1}


def test_a_gpu_found_hung_stays_so_when_the_other_gpu_hangs_a_tick_later(
    clock: FakeClock, events: EventLog
) -> None:
    backend = FakeBackend(gpus=2)
    s = Sampler(backend, call_timeout_s=0.3, clock=clock, events=events)  # type: ignore[arg-type]
    try:
        s.tick()
        _starve(backend, [0])
        clock.now += 0.1
        assert [g.healthy for g in s.tick().gpus] == [False, True]
        _starve(backend, [1])
        clock.now += 0.1
        snap = s.tick()
        assert [g.reason for g in snap.gpus] == [NOT_ANSWERING, NOT_ANSWERING]
        assert events.counts() == {"gpu.unhealthy": 2}
    finally:
        for gate in backend.hang.values():
            gate.set()
        s.close()


def test_gpus_hung_at_once_while_others_answer_in_time_are_not_answering_at_the_next_tick(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock
) -> None:
    """GPUs 2 and 3 answer in time in the tick 0 and 1 hang: no proof (a host starved
    unevenly does that too); their reads of the next tick, in time while 0's and 1's are
    outstanding, show that the host runs gpud, so 0 and 1 are hung, not starved."""
    sampler.tick()
    _starve(backend, [0, 1])
    clock.now += 0.1
    assert [g.healthy for g in sampler.tick().gpus] == [True] * 4
    clock.now += 0.1
    snap = sampler.tick()
    assert [g.healthy for g in snap.gpus] == [False, False, True, True]
    assert [g.reason for g in snap.gpus[:2]] == [NOT_ANSWERING] * 2


class _Cpu:
    """The host's one CPU, given out in slices in the order they were asked for."""

    def __init__(self) -> None:
        self._turns = threading.Condition()
        self._queue: deque[object] = deque()

    @contextlib.contextmanager
    def slice(self) -> Iterator[None]:
        me = object()
        with self._turns:
            self._queue.append(me)
            self._turns.wait_for(lambda: self._queue[0] is me)
        try:
            yield
        finally:
            with self._turns:
                self._queue.popleft()
                self._turns.notify_all()


class _SharedCpu(FakeBackend):
    """A backend whose reads each need ``cpu`` for ``cost_s`` once set, GPU 0's four times
    (a costlier read, as of a GPU with MIG devices) in four slices, asked for one by one."""

    def __init__(self, gpus: int) -> None:
        super().__init__(gpus=gpus)
        self.cpu = _Cpu()
        self.cost_s = 0.0

    def gpu_readings(self, gpu: int, skip: Collection[str] = frozenset()) -> GpuReadings:
        for _ in range(4 if gpu == 0 else 1):
            with self.cpu.slice():
                time.sleep(self.cost_s)
        return super().gpu_readings(gpu, skip)


def test_a_host_starved_unevenly_within_a_tick_keeps_every_gpus_health(
    clock: FakeClock, events: EventLog
) -> None:
    """The CPU is taken from gpud at the start of a tick and given back mid-way: some reads
    of the fan-out answer in time, others do not; none of the GPUs is hung."""
    backend = _SharedCpu(gpus=8)
    # waits of 0.2 s: min(call_timeout_s, interval_s / 2)
    s = Sampler(backend, interval_s=0.4, call_timeout_s=60.0, clock=clock, events=events)  # type: ignore[arg-type]
    hogging = threading.Event()
    release = threading.Event()

    def hog() -> None:
        with backend.cpu.slice():
            hogging.set()
            release.wait(0.25)  # a throttle window that ends after the first read's deadline

    try:
        s.tick()
        backend.cost_s = 0.04
        hogger = threading.Thread(target=hog, daemon=True)
        hogger.start()
        hogging.wait(5)
        clock.now += 0.4
        s.tick()
        hogger.join(5)
        _wait_for(lambda: not any(_read_outstanding(s, gpu) for gpu in range(8)))
        backend.cost_s = 0.0  # the host runs gpud again: no read waits for the CPU
        clock.now += 0.4
        assert all(g.healthy for g in s.tick().gpus)
        assert "gpu.unhealthy" not in events.counts()
    finally:
        release.set()
        s.close()


def test_answers_after_their_deadline_prove_nothing_in_later_ticks(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock, events: EventLog
) -> None:
    """GPU 0's read is outstanding from one tick on; the others' reads of the next tick
    answer only after their deadline (still starved): no proof that 0 hangs."""
    sampler.tick()
    first = _starve(backend, range(4))
    clock.now += 0.1
    assert all(g.healthy for g in sampler.tick().gpus)
    _answer(backend, sampler, {g: first[g] for g in (1, 2, 3)})
    second = _starve(backend, [1, 2, 3])
    clock.now += 0.1
    assert all(g.healthy for g in sampler.tick().gpus)
    _answer(backend, sampler, second)  # answers of a later tick than 0's, each late
    _starve(backend, [1, 2, 3])
    clock.now += 0.1
    snap = sampler.tick()  # GPU 0 still outstanding, the others late again
    assert [g.healthy for g in snap.gpus] == [True] * 4
    assert "gpu.unhealthy" not in events.counts()


class _ResetWhileRead(FakeBackend):
    """A backend whose GPU 1 is reset through ``sampler`` during each of its next ``resets``
    memory reads."""

    def __init__(self) -> None:
        super().__init__()
        self.sampler: Sampler | None = None
        self.resets = 0

    def memory(self, gpu: int, mig: int | None = None) -> MemoryInfo:
        if gpu == 1 and mig is None and self.resets and self.sampler is not None:
            self.resets -= 1
            self.sampler.gpu_reset(1)
        return super().memory(gpu, mig)


def test_a_gpu_reset_twice_during_one_read_keeps_its_health_for_that_tick(
    clock: FakeClock, events: EventLog
) -> None:
    """As a MIG apply of several steps does: no gpu.unhealthy and gpu.recovered pair, and
    nothing to make the GPU faulty meanwhile."""
    backend = _ResetWhileRead()
    s = Sampler(backend, call_timeout_s=60.0, clock=clock, events=events)  # type: ignore[arg-type]
    backend.sampler = s
    try:
        s.tick()
        backend.resets = 2  # during the read, and again during the read made anew
        clock.now += 1
        snap = s.tick()
        assert [(g.healthy, g.reason) for g in snap.gpus] == [(True, "")] * 4
        assert not snap.gpus[1].mig_devices_read
        assert not _read_outstanding(s, 1)
        clock.now += 1
        snap = s.tick()
        assert snap.gpus[1].healthy and snap.gpus[1].sampled_at == clock.now
        assert "gpu.unhealthy" not in events.counts()
    finally:
        s.close()


def test_a_change_of_unhealthy_reason_is_logged(
    sampler: Sampler,
    backend: FakeBackend,
    clock: FakeClock,
    events: EventLog,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("WARNING", logger="gpud.telemetry.sampler")
    backend.failing.add((1, "clocks"))
    sampler.tick()
    clock.now += 1
    sampler.tick()  # same reason: not logged again
    backend.lost.add(1)
    clock.now += 1
    sampler.tick()
    logged = [r.getMessage() for r in caplog.records if r.name == "gpud.telemetry.sampler"]
    assert len(logged) == 2, logged
    assert logged[0].startswith("GPU 1 unhealthy: clocks failed")
    assert logged[1].startswith("GPU 1 unhealthy: GPU lost")
    reasons = [e.fields["reason"] for e in events.recent(kind_prefix="gpu.unhealthy")]
    assert [r.split(":")[0] for r in reasons] == ["clocks failed", "GPU lost (memory)"]


def _read_outstanding(sampler: Sampler, gpu: int) -> bool:
    """Whether a read of ``gpu`` is still inside the driver: such a GPU gets no new call, so
    the next tick reports it not answering whatever the driver now says."""
    slots = sampler._slots or []
    return any(slot.target.busy for slot in slots if slot.reader.index == gpu)


def _wait_for(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_critical_xid_marks_the_gpu_unhealthy_until_cleared_or_reset(
    backend: FakeBackend, clock: FakeClock, events: EventLog, tmp_path: Path
) -> None:
    state = tmp_path / "xid-faults.json"

    def new_sampler() -> Sampler:
        return Sampler(
            backend,  # type: ignore[arg-type]
            call_timeout_s=0.3,
            clock=clock,
            events=events,
            event_wait_s=0.05,
            xid_state=state,
        )

    s = new_sampler()
    try:
        s.tick()
        s.start()
        backend.events += [
            GpuEvent(gpu=1, kind=EventKind.XID, xid=43),  # application-caused: ignored
            GpuEvent(gpu=2, kind=EventKind.XID, xid=79),  # fallen off the bus
            GpuEvent(gpu=3, kind=EventKind.XID, xid=48),  # double-bit ECC
        ]
        _wait_for(lambda: len(events.recent(kind_prefix="gpu.xid")) == 3)
        snap = s.tick()
        assert snap.gpus[1].healthy and snap.gpus[1].last_xid == 43
        assert not snap.gpus[2].healthy and "critical Xid 79" in snap.gpus[2].reason
        assert not snap.gpus[3].healthy and "critical Xid 48" in snap.gpus[3].reason
        assert [e.fields["critical"] for e in events.recent(kind_prefix="gpu.xid")] == [
            False,
            True,
            True,
        ]
        clock.now += 1
        assert not s.tick().gpus[2].healthy, "stays until a reset or a clear"
    finally:
        s.close()
    # a daemon restart keeps them (the state file lives in the run directory)
    s = new_sampler()
    try:
        snap = s.tick()
        assert [g.healthy for g in snap.gpus] == [True, True, False, False]
        assert s.clear_xid(2) == ClearedXids((79,), ())
        assert s.clear_xid(2) == ClearedXids((), ())
        s.gpu_reset(3)
        assert all(g.healthy for g in s.tick().gpus)
        assert [e.fields["xid"] for e in events.recent(kind_prefix="gpu.xid_cleared")] == [79]
    finally:
        s.close()
    assert all(g.healthy for g in new_sampler().tick().gpus)


def test_an_xid_storm_is_said_once_then_every_ten_minutes_with_its_count(
    sampler: Sampler,
    backend: FakeBackend,
    clock: FakeClock,
    events: EventLog,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A GPU raising one code over and over is one line and one gpu.xid, then one every ten
    minutes carrying the raises left unsaid; each raise is still counted. Another code,
    another GPU, or the code raised anew after a clear is said at once."""
    caplog.set_level("INFO", logger="gpud.telemetry.sampler")
    sampler.tick()
    sampler.start()
    handled = 0

    def raise_xids(*xids: tuple[int, int]) -> None:
        nonlocal handled
        backend.events += [GpuEvent(gpu=gpu, kind=EventKind.XID, xid=xid) for gpu, xid in xids]
        handled += len(xids)
        assert sampler.wait_events_handled(handled, 5)

    def said() -> list[tuple[object, ...]]:
        return [
            (e.fields["gpu"], e.fields["xid"], e.fields.get("repeats"))
            for e in events.recent(kind_prefix="gpu.xid")
            if e.kind == "gpu.xid"
        ]

    raise_xids(*[(1, 48)] * 100)
    assert said() == [(1, 48, 0)]
    clock.now += 599
    raise_xids((1, 48))
    assert said() == [(1, 48, 0)]
    assert sampler.tick().gpus[1].xid_events_total == 101  # gpud_gpu_xid_errors_total
    clock.now += 1
    raise_xids((1, 48), (1, 48))
    assert said() == [(1, 48, 0), (1, 48, 100)]
    raise_xids((1, 79), (2, 48))
    assert said() == [(1, 48, 0), (1, 48, 100), (1, 79, 0), (2, 48, 0)]
    sampler.clear_xid(1, 48)
    raise_xids((1, 48))
    assert said()[-1] == (1, 48, 0)
    logged = [r.getMessage() for r in caplog.records if "reported" in r.getMessage()]
    assert logged == [
        "GPU 1 reported critical Xid 48",
        "GPU 1 reported critical Xid 48 (and 100 more times since it was last said)",
        "GPU 1 reported critical Xid 79",
        "GPU 2 reported critical Xid 48",
        # the clear says the raise it cut short
        "GPU 1 reported critical Xid 48: 1 more time since it was last said, before it was cleared",
        "GPU 1 reported critical Xid 48",
    ]


def test_an_ecc_error_storm_is_said_once_then_every_ten_minutes_with_its_count(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock, events: EventLog
) -> None:
    """Single-bit ECC errors pouring from one GPU are one gpu.ecc, then one every ten minutes
    with the count; a double-bit error, or another GPU's, is said at once."""
    sampler.tick()
    sampler.start()
    single = [GpuEvent(gpu=1, kind=EventKind.ECC_SINGLE_BIT)] * 50
    backend.events += single
    assert sampler.wait_events_handled(50, 5)
    clock.now += 600
    backend.events += [
        GpuEvent(gpu=1, kind=EventKind.ECC_SINGLE_BIT),
        GpuEvent(gpu=1, kind=EventKind.ECC_DOUBLE_BIT),
        GpuEvent(gpu=2, kind=EventKind.ECC_SINGLE_BIT),
    ]
    assert sampler.wait_events_handled(53, 5)
    said = [(e.fields["gpu"], e.message) for e in events.recent(kind_prefix="gpu.ecc")]
    assert said == [
        (1, "GPU 1: ecc_single_bit ECC error"),
        (1, "GPU 1: ecc_single_bit ECC error (and 49 more since it was last said)"),
        (1, "GPU 1: ecc_double_bit ECC error"),
        (2, "GPU 2: ecc_single_bit ECC error"),
    ]


def _raise(sampler: Sampler, backend: FakeBackend, *raised: GpuEvent) -> None:
    """Post ``raised`` and wait until the event thread took them all in."""
    before = sampler.events_handled()
    backend.events += raised
    assert sampler.wait_events_handled(before + len(raised), 5)


def _xid(gpu: int, code: int, gi: int | None = None) -> GpuEvent:
    return GpuEvent(gpu=gpu, kind=EventKind.XID, xid=code, gpu_instance_id=gi)


def _said(events: EventLog) -> list[tuple[object, ...]]:
    """(kind, gpu, xid or None, GPU instance or None, repeats) of each gpu.xid and gpu.ecc."""
    return [
        (
            e.kind,
            e.fields["gpu"],
            e.fields.get("xid"),
            e.fields.get("gpu_instance_id"),
            e.fields["repeats"],
        )
        for e in events.recent(kind_prefix="gpu.")
        if e.kind in ("gpu.xid", "gpu.ecc")
    ]


def test_an_xid_or_ecc_error_right_after_a_reset_is_said_at_once(
    sampler: Sampler, backend: FakeBackend, events: EventLog
) -> None:
    """A reset that did not help shows at once: the application XID or the double-bit error
    raised again right after it is said, with the raises the reset cut short said first;
    another GPU's storm stays counted."""
    sampler.tick()
    sampler.start()
    double = GpuEvent(gpu=1, kind=EventKind.ECC_DOUBLE_BIT)
    _raise(sampler, backend, _xid(1, 13), _xid(1, 13), double, _xid(2, 43))
    sampler.gpu_reset(1)
    _raise(sampler, backend, _xid(1, 13), double, _xid(2, 43))
    assert _said(events) == [
        ("gpu.xid", 1, 13, None, 0),
        ("gpu.ecc", 1, None, None, 0),
        ("gpu.xid", 2, 43, None, 0),
        ("gpu.xid", 1, 13, None, 1),  # the one the reset cut short
        ("gpu.xid", 1, 13, None, 0),
        ("gpu.ecc", 1, None, None, 0),
    ]
    (cut_short,) = [e for e in events.recent(kind_prefix="gpu.xid") if e.fields["repeats"]]
    assert cut_short.message == (
        "GPU 1 reported Xid 13: 1 more time since it was last said, before the reset"
    )
    sampler.gpu_reset()  # every GPU
    _raise(sampler, backend, _xid(2, 43))
    assert _said(events)[-2:] == [("gpu.xid", 2, 43, None, 1), ("gpu.xid", 2, 43, None, 0)]


def test_a_cleared_code_raised_anew_on_any_mig_device_is_said_at_once(
    sampler: Sampler, backend: FakeBackend, events: EventLog
) -> None:
    """A critical code cleared by hand is new again on every MIG device of the GPU, not only
    on the one that raises it first after the clear."""
    sampler.tick()
    sampler.start()
    _raise(sampler, backend, _xid(1, 48, gi=1), _xid(1, 48, gi=2))
    sampler.clear_xid(1, 48)
    _raise(sampler, backend, _xid(1, 48, gi=1), _xid(1, 48, gi=2))
    assert _said(events) == [("gpu.xid", 1, 48, gi, 0) for gi in (1, 2, 1, 2)]


def test_a_mig_device_made_on_the_ids_of_a_destroyed_one_says_its_first_xid(
    sampler: Sampler, backend: FakeBackend, events: EventLog
) -> None:
    """GPU and compute instance ids are reused: after the MIG layout of a GPU changes, an
    XID on its MIG devices is said at once, while the whole GPU's and other GPUs' storms
    stay counted."""
    sampler.tick()
    sampler.start()
    storm = (_xid(1, 43, gi=7), _xid(1, 43), _xid(2, 43, gi=7))
    _raise(sampler, backend, *storm)
    sampler.refresh_identity(1)
    _raise(sampler, backend, *storm)
    assert _said(events) == [
        ("gpu.xid", 1, 43, 7, 0),
        ("gpu.xid", 1, 43, None, 0),
        ("gpu.xid", 2, 43, 7, 0),
        ("gpu.xid", 1, 43, 7, 0),
    ]


def _storm_said_once(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock, events: EventLog, later_s: float
) -> None:
    """Raise 500 of XID 43 on GPU 1, two single-bit ECC errors on GPU 2's GPU instance 7 and
    one XID 79 on GPU 3; tick ``later_s`` after, still within their window: each said once."""
    sampler.tick()
    sampler.start()
    single = GpuEvent(gpu=2, kind=EventKind.ECC_SINGLE_BIT, gpu_instance_id=7)
    _raise(sampler, backend, *[_xid(1, 43)] * 500, single, single, _xid(3, 79))
    clock.now += later_s
    sampler.tick()
    assert len(_said(events)) == 3


def _said_the_rest_of_the_storm(events: EventLog, when: str) -> None:
    """What :func:`_storm_said_once` left unsaid is said, with the fields of the raise said
    and ``when`` in the message; XID 79, said alone, leaves nothing to say."""
    assert _said(events)[3:] == [("gpu.xid", 1, 43, None, 499), ("gpu.ecc", 2, None, 7, 1)]
    last = events.recent(kind_prefix="gpu.xid")[-1]
    assert last.message == f"GPU 1 reported Xid 43: 499 more times {when}"
    assert (last.fields["critical"], last.fields["uuid"]) == (False, "GPU-00000001")


def test_a_storm_that_stops_says_its_last_count_when_its_window_ends(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock, events: EventLog
) -> None:
    """Raises left unsaid are said by the first tick after the ten minutes that followed the
    last gpu.xid (gpu.ecc) of the code, with the same fields; then the code is forgot, so a
    raise after that is said as new, and one said alone leaves nothing to say."""
    _storm_said_once(sampler, backend, clock, events, 599)
    clock.now += 1
    sampler.tick()
    sampler.tick()
    _said_the_rest_of_the_storm(events, "in the 10 minutes after it was last said")
    _raise(sampler, backend, _xid(1, 43), _xid(3, 79))
    assert _said(events)[5:] == [("gpu.xid", 1, 43, None, 0), ("gpu.xid", 3, 79, None, 0)]


def test_a_storm_still_counting_when_gpud_stops_is_said_at_the_close(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock, events: EventLog
) -> None:
    """Raises counted within a window still open when the sampler closes (a clean stop)
    are said then, one gpu.xid (gpu.ecc) per code with its count and the same fields, as
    the window's end would; a code said alone leaves nothing to say. They were never said:
    no tick comes after the close."""
    _storm_said_once(sampler, backend, clock, events, 10)
    sampler.close()
    _said_the_rest_of_the_storm(events, "since it was last said, before gpud stopped")
    sampler.close()  # a second close says nothing again
    assert len(_said(events)) == 5


class _HeldAtTheClose(FakeBackend):
    """Once ``held`` is set, the event wait blocks until ``release`` (as the driver's
    ``nvmlEventSetWait`` does for its timeout), then delivers two more raises of XID 43."""

    def __init__(self) -> None:
        super().__init__(gpus=4, mig_gpus={1: 7})
        self.held = threading.Event()
        self.waiting = threading.Event()  # the watcher is in the held wait
        self.release = threading.Event()

    def wait_events(self, timeout_s: float) -> list[GpuEvent]:
        if not self.held.is_set():
            return super().wait_events(timeout_s)
        self.waiting.set()
        self.release.wait()
        self.held.clear()
        return [_xid(1, 43)] * 2


class _ReleasingAtTheRest(EventLog):
    """Releases the held event wait once the close said the rest of the storm."""

    def __init__(self, backend: _HeldAtTheClose) -> None:
        super().__init__(None)
        self._backend = backend

    def emit(self, kind: str, message: str, **fields: object) -> Event:
        event = super().emit(kind, message, **fields)
        if message.endswith("before gpud stopped"):
            self._backend.release.set()
        return event


def test_a_storm_still_counting_is_said_before_the_close_waits_for_the_event_watcher(
    clock: FakeClock,
) -> None:
    """The close says what every open window left unsaid before it joins the event watcher
    (up to event_wait_s + 1 s in the driver's wait, where a second SIGTERM leaves it behind),
    then what the watcher took in during the join. The rest was said only after the join:
    the event wait here ends only once it is said, so the raises it delivered came after
    the close, the second of them counted and never said."""
    backend = _HeldAtTheClose()
    events = _ReleasingAtTheRest(backend)
    sampler = _sampler(backend, clock, events, event_wait_s=1)  # the join waits up to 2 s
    _storm_said_once(sampler, backend, clock, events, 10)
    backend.held.set()
    assert backend.waiting.wait(5)
    sampler.close()
    assert _said(events)[3:] == [
        ("gpu.xid", 1, 43, None, 499),
        ("gpu.ecc", 2, None, 7, 1),
        ("gpu.xid", 1, 43, None, 0),  # said at once: the code was forgot before the join
        ("gpu.xid", 1, 43, None, 1),
    ]
    assert events.recent(kind_prefix="gpu.xid")[-1].message == (
        "GPU 1 reported Xid 43: 1 more time since it was last said, before gpud stopped"
    )


def test_a_critical_xids_last_seen_never_comes_before_its_first_seen(
    backend: FakeBackend, clock: FakeClock, events: EventLog, tmp_path: Path
) -> None:
    """The wall clock stepped back between two raises of one code: its last_seen stays at
    its first_seen, in the snapshot (what `gpuctl xid` shows) and in a state file read back."""
    wall = FakeClock(1_700_000_000.0)
    s = Sampler(
        backend,  # type: ignore[arg-type]
        clock=clock,
        wall_clock=wall,
        events=events,
        event_wait_s=0.05,
        xid_state=tmp_path / "xid-faults.json",
    )
    try:
        s.tick()
        s.start()
        backend.events.append(GpuEvent(gpu=1, kind=EventKind.XID, xid=79))
        _wait_for(lambda: len(events.recent(kind_prefix="gpu.xid")) == 1)
        wall.now -= 3600  # the wall clock steps back
        backend.events.append(GpuEvent(gpu=1, kind=EventKind.XID, xid=79))
        assert s.wait_events_handled(2, 5)  # counted, not said again so soon
        (xid,) = s.tick().gpus[1].critical_xids
        assert (xid.count, xid.first_seen, xid.last_seen) == (2, 1_700_000_000.0, 1_700_000_000.0)
    finally:
        s.close()
    raw = {"version": XID_STATE_VERSION, "gpus": {"1": [
        {"xid": 79, "count": 2, "first_seen": 1_700_000_000.0, "last_seen": 1_699_990_000.0}
    ]}}  # fmt: skip
    assert parse_xid_state(raw)[1][79].last_seen == 1_700_000_000.0


def test_a_critical_xid_storm_is_saved_at_once_then_at_most_once_a_second_and_at_close(
    backend: FakeBackend, clock: FakeClock, tmp_path: Path
) -> None:
    """The first raise of a critical code is written at once (a crash right after keeps the
    fault); its later raises, a count and a last_seen, wait up to a second for a tick or a
    raise to write them, and close writes what is left: the count read back is every raise."""
    path = tmp_path / "xid-faults.json"

    def saved() -> int:
        return parse_xid_state(json.loads(path.read_text()))[1][79].count

    s = Sampler(backend, clock=clock, event_wait_s=0.05, xid_state=path)  # type: ignore[arg-type]
    try:
        s.tick()
        s.start()
        _raise(s, backend, *[_xid(1, 79)] * 100)
        assert saved() == 1
        s.tick()
        assert saved() == 1  # within the second
        clock.now += 1
        s.tick()
        assert saved() == 100
        clock.now += 1
        _raise(s, backend, *[_xid(1, 79)] * 10)
        assert saved() == 101  # the first of them, a second after the last write
    finally:
        s.close()
    assert saved() == 110
    again = Sampler(backend, clock=clock, xid_state=path)  # type: ignore[arg-type]
    try:
        assert again.tick().gpus[1].critical_xids[0].count == 110
    finally:
        again.close()


def test_a_critical_xid_storm_s_last_count_is_saved_before_the_close_waits_for_the_watcher(
    clock: FakeClock, tmp_path: Path
) -> None:
    """The close writes the count raised within a second of the last write before it joins
    the event watcher (up to event_wait_s + 1 s in the driver's wait), which a second
    SIGTERM may not let end. It was written only after the join."""
    path = tmp_path / "xid-faults.json"
    backend = _HeldAtTheClose()
    s = Sampler(backend, clock=clock, event_wait_s=1, xid_state=path)  # type: ignore[arg-type]
    at_the_join: list[int] = []

    def read_at_the_join() -> None:
        s._xid._stop.wait()  # set as the join begins
        at_the_join.append(parse_xid_state(json.loads(path.read_text()))[1][79].count)
        backend.release.set()

    reader = threading.Thread(target=read_at_the_join)
    try:
        s.tick()
        s.start()
        _raise(s, backend, *[_xid(1, 79)] * 5)
        backend.held.set()
        assert backend.waiting.wait(5)
        reader.start()
    finally:
        s.close()
        backend.release.set()
    reader.join(5)
    assert at_the_join == [5]


def test_each_critical_xid_code_is_kept_and_cleared_on_its_own(
    backend: FakeBackend, clock: FakeClock, events: EventLog, tmp_path: Path
) -> None:
    """Two faults on one GPU are two: the second is neither dropped (79 then 48) nor hidden
    by an application's XID after it (48 then 31); clearing one code leaves the other."""
    state = tmp_path / "xid-faults.json"
    wall = FakeClock(1_700_000_000.0)

    def new_sampler() -> Sampler:
        return Sampler(
            backend,  # type: ignore[arg-type]
            clock=clock,
            wall_clock=wall,
            events=events,
            event_wait_s=0.05,
            xid_state=state,
        )

    def raise_xids(*xids: tuple[int, int]) -> None:
        before = s.events_handled()  # a code raised again so soon is counted, not said
        for gpu, code in xids:
            backend.events.append(GpuEvent(gpu=gpu, kind=EventKind.XID, xid=code))
        assert s.wait_events_handled(before + len(xids), 5)

    s = new_sampler()
    try:
        s.tick()
        s.start()
        raise_xids((1, 79), (2, 48))
        wall.now += 60
        raise_xids((1, 48), (2, 31), (1, 79))
        snap = s.tick()
        one, two = snap.gpus[1], snap.gpus[2]
        uuid1, model = one.identity.uuid, one.identity.name
        assert one.critical_xids == (
            CriticalXid(79, 2, 1_700_000_000.0, 1_700_000_060.0, uuid1, model),
            CriticalXid(48, 1, 1_700_000_060.0, 1_700_000_060.0, uuid1, model),
        )
        assert one.reason.startswith("critical Xids 79, 48: ") and not one.healthy
        assert one.last_xid == 79
        assert [c.xid for c in two.critical_xids] == [48]  # 31 is the application's
        assert two.last_xid == 31 and two.reason.startswith("critical Xid 48: ")
        assert s.clear_xid(1, 79) == ClearedXids((79,), (48,))
        assert s.clear_xid(1, 13) == ClearedXids((), (48,))
        snap = s.tick()
        assert not snap.gpus[1].healthy and snap.gpus[1].reason.startswith("critical Xid 48:")
        cleared = events.recent(kind_prefix="gpu.xid_cleared")
        assert [(e.fields["xid"], e.fields["count"], e.fields["uuid"]) for e in cleared] == [
            (79, 2, uuid1)
        ]
    finally:
        s.close()
    # a daemon restart keeps every code with its count and times
    s = new_sampler()
    try:
        snap = s.tick()
        assert [c.xid for c in snap.gpus[1].critical_xids] == [48]
        two = snap.gpus[2].identity
        assert snap.gpus[2].critical_xids == (
            CriticalXid(48, 1, 1_700_000_000.0, 1_700_000_000.0, two.uuid, two.name),
        )
        assert s.clear_xid(2) == ClearedXids((48,), ())
        s.gpu_reset(1)
        snap = s.tick()
        assert all(g.healthy and not g.critical_xids for g in snap.gpus)
    finally:
        s.close()


def test_xid_state_of_an_older_gpud_is_read_and_written_anew(
    backend: FakeBackend, tmp_path: Path
) -> None:
    state = tmp_path / "xid-faults.json"
    state.write_text('{"3": 79}')  # one code per GPU, when and how often unknown
    s = Sampler(backend, xid_state=state)  # type: ignore[arg-type]
    try:
        snap = s.tick()
        assert snap.gpus[3].critical_xids == (CriticalXid(79, 1, 0.0, 0.0),)
        assert "critical Xid 79" in snap.gpus[3].reason
        assert s.clear_xid(3, 79) == ClearedXids((79,), ())
        assert state.read_text() == '{"version": 2, "gpus": {}}'
    finally:
        s.close()
    document = xid_state_document({0: [CriticalXid(48, 2, 1.0, 2.0, "GPU-x")]})
    assert parse_xid_state(document) == {0: {48: CriticalXid(48, 2, 1.0, 2.0, "GPU-x")}}
    with pytest.raises(ValueError):
        parse_xid_state({"version": 3, "gpus": {}})


def test_an_unreadable_xid_state_is_kept_aside_and_said_in_an_event(
    backend: FakeBackend, events: EventLog, tmp_path: Path
) -> None:
    """Which GPUs had a critical XID is lost with the file: a later save must not destroy it
    too, and the loss is an event an operator sees (``gpuctl events``), not only a log line."""
    state = tmp_path / "xid-faults.json"
    document = json.dumps(xid_state_document({3: [CriticalXid(48, 1, 1.0, 1.0, "GPU-x")]}))
    state.write_text(document[: len(document) // 2])  # a disk that lost the rest
    s = Sampler(backend, events=events, xid_state=state)  # type: ignore[arg-type]
    try:
        assert s.tick().gpus[3].healthy
        aside = tmp_path / "xid-faults.json.unreadable"
        assert aside.read_text() == document[: len(document) // 2]
        (event,) = events.recent(kind_prefix="gpu.xid_state_unreadable")
        assert event.fields["kept"] == str(aside) and str(state) in event.message
        s.gpu_reset(3)  # a save: the kept file stays as it was
        assert aside.read_text() == document[: len(document) // 2]
    finally:
        s.close()


def test_a_critical_xid_raised_before_the_gpus_are_counted_is_kept(
    backend: FakeBackend, events: EventLog
) -> None:
    s = Sampler(backend, events=events, event_wait_s=0.05)  # type: ignore[arg-type]
    try:
        s.start()
        backend.events.append(GpuEvent(gpu=2, kind=EventKind.XID, xid=79))
        _wait_for(lambda: len(events.recent(kind_prefix="gpu.xid")) == 1)
        snap = s.tick()
        assert [c.xid for c in snap.gpus[2].critical_xids] == [79]
        assert not snap.gpus[2].healthy
    finally:
        s.close()


def test_the_ignored_xids_are_configurable(backend: FakeBackend, events: EventLog) -> None:
    s = Sampler(
        backend,  # type: ignore[arg-type]
        events=events,
        event_wait_s=0.05,
        ignored_xids={79},
    )
    try:
        s.tick()
        s.start()
        backend.events += [
            GpuEvent(gpu=0, kind=EventKind.XID, xid=79),
            GpuEvent(gpu=1, kind=EventKind.XID, xid=13),
        ]
        _wait_for(lambda: len(events.recent(kind_prefix="gpu.xid")) == 2)
        snap = s.tick()
        assert snap.gpus[0].healthy
        assert not snap.gpus[1].healthy and "critical Xid 13" in snap.gpus[1].reason
    finally:
        s.close()


def test_an_internal_error_keeps_one_reason_whatever_its_message(
    sampler: Sampler, backend: FakeBackend, clock: FakeClock, events: EventLog
) -> None:
    """A bug in reading a GPU (not a driver error) whose message changes at every tick (a
    number, an address) is one reason: the reason is gpud_gpu_unhealthy_info's label and
    each change an event; the message is in the log."""
    ticks = iter(range(1000))

    def broken(gpu: int, skip: Collection[str] = frozenset()) -> GpuReadings:
        raise ValueError(f"bad value {next(ticks)} at 0x7f{next(ticks):08x}")

    backend.gpu_readings = broken  # type: ignore[method-assign]
    reasons = set()
    for _ in range(3):
        snap = sampler.tick()
        clock.now += 1
        reasons |= {g.reason for g in snap.gpus}
    assert reasons == {"internal error: ValueError (gpud's log has the details)"}
    assert events.counts().get("gpu.unhealthy") == 4  # once per GPU, not once per tick


def test_gpus_that_cannot_be_counted_are_said_once_and_once_again_when_they_can(
    sampler: Sampler, backend: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """A driver that cannot count its GPUs at start (being loaded) is said once, not at
    every tick, and once more when the GPUs are counted."""
    caplog.set_level("INFO", logger="gpud.telemetry.sampler")
    count = backend.gpu_count

    def refusing() -> int:
        raise BackendError("nvmlDeviceGetCount failed: driver not loaded")

    backend.gpu_count = refusing  # type: ignore[method-assign]
    for _ in range(3):
        assert sampler.tick().gpus == ()
    backend.gpu_count = count  # type: ignore[method-assign]
    assert len(sampler.tick().gpus) == 4
    said = [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.name == "gpud.telemetry.sampler" and "count" in r.getMessage()
    ]
    assert said == [
        (
            "WARNING",
            "cannot count GPUs, retrying every tick: nvmlDeviceGetCount failed: driver not loaded",
        ),
        ("INFO", "counting GPUs works again after 3 failed ticks: 4 GPUs"),
    ]


def test_a_tick_once_closed_is_refused_at_once(sampler: Sampler) -> None:
    """A sample asked for while gpud stops (after a MIG apply, behind a tick stuck on a hung
    GPU) once the sampler closed: refused with Unavailable, not left spinning forever on a
    read queued to the closed worker."""
    sampler.tick()
    sampler.close()
    got: list[object] = []

    def tick() -> None:
        try:
            got.append(sampler.tick())
        except Unavailable as err:
            got.append(err)

    t = threading.Thread(target=tick, daemon=True)
    t.start()
    t.join(2.0)
    assert len(got) == 1 and isinstance(got[0], Unavailable), got


def test_a_closed_worker_refuses_jobs_and_a_read_through_it_finds_every_gpu_hung() -> None:
    worker = Worker("test-worker")
    ran = threading.Event()
    assert worker.submit(ran.set)
    worker.close(1.0)
    assert ran.is_set()
    assert not worker.submit(lambda: None)
    # a wait of an hour: a read that waited for the closed worker would not end in the test
    dispatcher = Dispatcher(3600.0, name="test-dispatcher")
    dispatcher.close()
    called: list[int] = []

    def read() -> GpuSample:
        called.append(0)
        raise AssertionError("a GPU read through a closed worker")

    target = Target(0, read)
    got: list[dict[int, object]] = []
    reader = threading.Thread(target=lambda: got.append(dispatcher.read([target])), daemon=True)
    reader.start()
    reader.join(30)
    assert got == [{}] and called == [] and not target.busy


class _StampedSlowly(Target):
    """A target whose stamping of a read is held (its pass thread descheduled) until the
    read was marked late, or ``hold_s`` passed where marking it must wait for the stamp."""

    def __init__(self, index: int, read: Callable[[], GpuSample], hold_s: float) -> None:
        super().__init__(index, read)
        self.hold = False
        self.hold_s = hold_s
        self.marked = threading.Event()
        self.stamped = threading.Event()

    def _begin(self, tick: int, now: float, began: float, wait_s: float, entered: bool) -> None:
        if self.hold:
            self.marked.wait(self.hold_s)
        super()._begin(tick, now, began, wait_s, entered)
        self.stamped.set()

    def _mark_late(self) -> None:
        super()._mark_late()
        self.marked.set()


def test_a_pass_thread_descheduled_before_stamping_its_read_keeps_the_gpus_health(
    sampler: Sampler,
) -> None:
    """The deadline passes between the pass handing the GPU its read and stamping it: the
    read is late before its driver call, not the GPU's previous read judged anew."""
    answer = sampler.tick().gpus[0]
    dispatcher = Dispatcher(0.05, name="test-dispatcher")

    def read() -> GpuSample:
        if target.hold:  # a driver call past the deadline, however the stamp went
            target.marked.wait(5)
        return answer

    target = _StampedSlowly(0, read, hold_s=0.5)
    try:
        assert dispatcher.read([target]) == {0: answer}
        target.hold = True
        target.stamped.clear()
        assert dispatcher.read([target]) == {}
        target.stamped.wait(5)
        assert dispatcher.late_answer(target, [target], 60.0) == answer
    finally:
        dispatcher.close()


class _ResetLate(_ResetWhileRead):
    """GPU 1's reset comes ``after_s`` into its read, on the sampler's clock."""

    def __init__(self, clock: FakeClock, after_s: float) -> None:
        super().__init__()
        self.clock = clock
        self.after_s = after_s

    def memory(self, gpu: int, mig: int | None = None) -> MemoryInfo:
        if gpu == 1 and mig is None and self.resets:
            self.clock.now += self.after_s
        return super().memory(gpu, mig)


def test_a_read_made_anew_after_a_reset_is_outstanding_from_when_it_was_made_again(
    clock: FakeClock, events: EventLog
) -> None:
    """Time spent on the read a reset made void is not the new read's: the call timeout
    counts from when it was made again."""
    backend = _ResetLate(clock, after_s=50.0)  # 50 s of a 60 s call timeout
    s = Sampler(backend, interval_s=120.0, call_timeout_s=60.0, clock=clock, events=events)  # type: ignore[arg-type]
    backend.sampler = s
    try:
        s.tick()
        backend.resets = 1
        s.tick()
        target = next(slot.target for slot in s._slots or () if slot.reader.index == 1)
        assert target.since == clock.now
    finally:
        s.close()
