"""The scrape-time collector on hand-built snapshots, read back with get_sample_value."""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from wsgiref.util import setup_testing_defaults

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

import gpud.build
from gpud import metrics_http
from gpud.backend.port import (
    Clocks,
    EccCounts,
    EventKind,
    GpuEvent,
    GpuIdentity,
    MemoryInfo,
    MigDeviceIdentity,
    MigMode,
    PcieThroughput,
    ProcessInfo,
    Utilization,
)
from gpud.events import EventLog
from gpud.loopstats import LoopMetrics, LoopStats
from gpud.metrics import Collector, build_registry
from gpud.metrics_http import metrics_app, start_metrics_server, stop_metrics_server
from gpud.telemetry.reader import placeholder_identity
from gpud.telemetry.sampler import Sampler
from gpud.telemetry.snapshot import CriticalXid, GpuSample, MigSample, SeenIdentity, Snapshot
from tests.unit.test_sampler import FakeBackend

GIB = 1 << 30
NAME = "NVIDIA H100 80GB HBM3"


def ident(i: int) -> GpuIdentity:
    return GpuIdentity(
        index=i,
        uuid=f"GPU-{i}",
        name=NAME,
        product="H100-SXM5-80GB",
        pci_bus_id=f"00000000:{i + 0x18:02X}:00.0",
        pci_device_id=0x233010DE,
        memory_total_bytes=80 * GIB,
        mig_capable=True,
    )


def mig(gpu: int, i: int) -> MigSample:
    return MigSample(
        identity=MigDeviceIdentity(
            gpu=gpu,
            mig=i,
            uuid=f"MIG-{gpu}-{i}",
            gpu_instance_id=7 + i,
            compute_instance_id=0,
            gpu_instance_profile_id=19,
            profile_name="1g.10gb",
            memory_total_bytes=10 * GIB,
            multiprocessor_count=16,
        ),
        memory=MemoryInfo(10 * GIB, 2 * GIB, 8 * GIB),
        processes=(ProcessInfo(42, 2 * GIB, 7 + i, 0),),
        processes_read=True,
    )


def snapshot() -> Snapshot:
    full = GpuSample(
        identity=ident(0),
        healthy=True,
        reason="",
        sampled_at=99.5,
        memory=MemoryInfo(80 * GIB, 4 * GIB, 76 * GIB),
        utilization=Utilization(0.75, 0.5),
        power_watts=350.5,
        temperature_celsius=41.0,
        clocks=Clocks(1980, 2619),
        ecc=EccCounts(3, 1),
        pcie=PcieThroughput(1.5e9, 2.5e9),
        processes=(ProcessInfo(1, GIB), ProcessInfo(2, GIB)),
        mig_mode=MigMode(False, False),
        xid_events_total=2,
        last_xid=79,
        nvlink_bytes=(100, 200),
    )
    mig_gpu = GpuSample(
        identity=ident(1),
        healthy=True,
        reason="",
        sampled_at=99.5,
        memory=MemoryInfo(80 * GIB, 4 * GIB, 76 * GIB),
        power_watts=None,  # NotSupported
        mig_mode=MigMode(True, True),
        mig_devices=(mig(1, 0), mig(1, 1)),
    )
    lost = GpuSample(
        identity=ident(2), healthy=False, reason="GPU lost (memory): fell off", sampled_at=90.0
    )
    return Snapshot(
        wall_time=1.7e9,
        monotonic=99.0,
        gpus=(full, mig_gpu, lost),
        tick_seconds=0.004,
        driver_version="550.54.15",
    )


@pytest.fixture
def registry() -> CollectorRegistry:
    events = EventLog(None)
    events.emit("gpu.unhealthy", "GPU 2 unhealthy")
    events.emit("gpu.xid", "x")
    events.emit("gpu.xid", "x")
    return build_registry(
        Collector(snapshot, events=events, clock=lambda: 100.0, build="3f2a9c1d04ab")
    )


def test_event_log_lines_the_file_lacks_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    events = EventLog(path)
    path.mkdir()  # a full or read-only state directory: every write fails
    events.emit("job.add", "only in the ring and the journal")
    registry = build_registry(Collector(snapshot, events=events))
    assert registry.get_sample_value("gpud_event_log_write_errors_total") == 1


def gpu_labels(i: int, **extra: str) -> dict[str, str]:
    return {"gpu": str(i), "uuid": f"GPU-{i}", "model": NAME, **extra}


def test_gpu_readings(registry: CollectorRegistry) -> None:
    v = registry.get_sample_value
    g0 = gpu_labels(0)
    assert v("gpud_gpu_memory_used_bytes", g0) == 4 * GIB
    assert v("gpud_gpu_memory_total_bytes", g0) == 80 * GIB
    assert v("gpud_gpu_utilization_ratio", g0) == 0.75
    assert v("gpud_gpu_memory_utilization_ratio", g0) == 0.5
    assert v("gpud_gpu_power_watts", g0) == 350.5
    assert v("gpud_gpu_temperature_celsius", g0) == 41.0
    assert v("gpud_gpu_sm_clock_hertz", g0) == 1.98e9
    assert v("gpud_gpu_memory_clock_hertz", g0) == 2.619e9
    assert v("gpud_gpu_ecc_errors_total", gpu_labels(0, type="uncorrected")) == 1
    assert v("gpud_gpu_ecc_errors_total", gpu_labels(0, type="corrected")) == 3
    assert v("gpud_gpu_pcie_throughput_bytes_per_second", gpu_labels(0, direction="rx")) == 2.5e9
    assert v("gpud_gpu_nvlink_bytes_total", gpu_labels(0, direction="tx")) == 100
    assert v("gpud_gpu_processes", g0) == 2
    assert v("gpud_gpu_xid_errors_total", g0) == 2
    assert v("gpud_gpu_last_xid", g0) == 79
    assert v("gpud_gpu_mig_mode_enabled", g0) == 0
    assert v("gpud_gpu_healthy", g0) == 1
    assert v("gpud_gpu_sample_age_seconds", g0) == 0.5
    info = gpu_labels(0, product="H100-SXM5-80GB", pci_bus_id="00000000:18:00.0")
    assert v("gpud_gpu_info", info) == 1


def test_missing_values_are_not_exported(registry: CollectorRegistry) -> None:
    v = registry.get_sample_value
    assert v("gpud_gpu_power_watts", gpu_labels(1)) is None
    assert v("gpud_gpu_utilization_ratio", gpu_labels(1)) is None
    assert v("gpud_gpu_last_xid", gpu_labels(1)) is None
    assert v("gpud_gpu_mig_mode_enabled", gpu_labels(1)) == 1
    assert v("gpud_gpu_mig_mode_pending", gpu_labels(1)) == 0


def test_unhealthy_gpu_shows_reason_and_no_readings(registry: CollectorRegistry) -> None:
    v = registry.get_sample_value
    g2 = gpu_labels(2)
    assert v("gpud_gpu_healthy", g2) == 0
    assert v("gpud_gpu_unhealthy_info", gpu_labels(2, reason="GPU lost (memory): fell off")) == 1
    assert v("gpud_gpu_unhealthy_info", gpu_labels(0, reason="")) is None
    assert v("gpud_gpu_memory_used_bytes", g2) is None
    assert v("gpud_gpu_memory_free_bytes", g2) is None
    # its size is a static fact, read with its identity in this run: kept, as the API keeps it
    assert v("gpud_gpu_memory_total_bytes", g2) == 80 * GIB
    assert v("gpud_gpu_processes", g2) is None
    assert v("gpud_gpu_sample_age_seconds", g2) == 10.0
    assert v("gpud_gpu_xid_errors_total", g2) == 0


def test_process_count_is_exported_when_the_driver_listed_them() -> None:
    """0 processes only where the driver listed none: also on a GPU unhealthy for an XID
    whose reads succeed; absent where the list was not read (NotSupported, failed, hung)."""
    xid_only = GpuSample(
        identity=ident(0),
        healthy=False,
        reason="critical Xid 48: reset the GPU or clear it with `gpuctl xid clear`",
        sampled_at=99.5,
        memory=MemoryInfo(80 * GIB, 0, 80 * GIB),
        processes_read=True,
    )
    not_listed = GpuSample(
        identity=ident(1), healthy=True, reason="", sampled_at=99.5, processes_read=False
    )
    snap = Snapshot(wall_time=1.7e9, monotonic=99.0, gpus=(xid_only, not_listed), tick_seconds=0)
    registry = build_registry(Collector(lambda: snap, clock=lambda: 100.0), process=False)
    assert registry.get_sample_value("gpud_gpu_processes", gpu_labels(0)) == 0
    assert registry.get_sample_value("gpud_gpu_processes", gpu_labels(1)) is None


def test_every_uncleared_critical_xid_is_a_series_of_its_own() -> None:
    """One series per GPU and code, so two faults on a GPU are two alerts; a cleared code is
    gone while the latest XID, any kind, stays history; a GPU not read since gpud started
    is named by the UUID it had when it raised the XID."""
    two_faults = GpuSample(
        identity=ident(0),
        healthy=False,
        reason="critical Xids 79, 48: reset the GPU or clear them with `gpuctl xid clear`",
        sampled_at=99.5,
        xid_events_total=4,
        last_xid=31,  # an application's, after them
        critical_xids=(CriticalXid(79, 1, 1.0, 1.0, "GPU-0"), CriticalXid(48, 3, 2.0, 9.0)),
    )
    cleared = GpuSample(
        identity=ident(1), healthy=True, reason="", sampled_at=99.5, xid_events_total=1, last_xid=48
    )
    unread = GpuSample(
        identity=placeholder_identity(2),
        healthy=False,
        reason="GPU lost (identity): ...; critical Xid 79: ...",
        sampled_at=0.0,
        critical_xids=(CriticalXid(79, 1, 1.0, 1.0, "GPU-2"),),
    )
    snap = Snapshot(
        wall_time=1.7e9, monotonic=99.0, gpus=(two_faults, cleared, unread), tick_seconds=0.0
    )
    registry = build_registry(Collector(lambda: snap, clock=lambda: 100.0), process=False)
    v = registry.get_sample_value
    assert v("gpud_gpu_critical_xid_uncleared", gpu_labels(0, xid="79")) == 1
    assert v("gpud_gpu_critical_xid_uncleared", gpu_labels(0, xid="48")) == 3
    assert v("gpud_gpu_last_xid", gpu_labels(0)) == 31
    assert v("gpud_gpu_last_xid", gpu_labels(1)) == 48
    assert v("gpud_gpu_critical_xid_uncleared", gpu_labels(1, xid="48")) is None
    unread_labels = {"gpu": "2", "uuid": "GPU-2", "model": "", "xid": "79"}
    assert v("gpud_gpu_critical_xid_uncleared", unread_labels) == 1
    (family,) = [m for m in registry.collect() if m.name == "gpud_gpu_critical_xid_uncleared"]
    assert len(family.samples) == 3


def test_a_critical_xid_of_a_gpu_lost_before_start_keeps_the_model_it_was_raised_with(
    tmp_path: Path,
) -> None:
    """A GPU that raised a critical XID, then was lost before gpud restarted with a state
    database that never saw it: the XID's series is the one it had before the restart, the
    UUID and model of the board that raised it, not that UUID beside an empty model."""
    backend = FakeBackend(gpus=2)
    state = tmp_path / "xid-faults.json"

    def sampler() -> Sampler:
        return Sampler(backend, event_wait_s=0.05, xid_state=state)  # type: ignore[arg-type]

    first = sampler()
    try:
        first.tick()
        first.start()
        backend.events.append(GpuEvent(gpu=1, kind=EventKind.XID, xid=79))
        assert first.wait_events_handled(1, timeout_s=30)
        read = first.tick()
    finally:
        first.close()
    before = build_registry(Collector(lambda: read, clock=time.monotonic), process=False)
    raised = {"gpu": "1", "uuid": "GPU-00000001", "model": NAME, "xid": "79"}
    assert before.get_sample_value("gpud_gpu_critical_xid_uncleared", raised) == 1
    backend.lost.add(1)
    restarted = sampler()  # no last_seen: a fresh state directory
    try:
        lost = restarted.tick()
    finally:
        restarted.close()
    assert not lost.gpus[1].identity.uuid
    after = build_registry(Collector(lambda: lost, clock=time.monotonic), process=False)
    assert after.get_sample_value("gpud_gpu_critical_xid_uncleared", raised) == 1
    (family,) = [m for m in after.collect() if m.name == "gpud_gpu_critical_xid_uncleared"]
    assert len(family.samples) == 1


def test_a_gpu_lost_before_start_is_labelled_as_last_seen() -> None:
    """Its series keep the UUID and model of the run that last read it (the same series as
    before the restart, and GpuLost names the board); one never read by any run has empty
    ones, the only way Prometheus has to say "unknown"."""
    seen = SeenIdentity("GPU-2", NAME, "00000000:1A:00.0")
    lost = GpuSample(
        identity=placeholder_identity(2),
        healthy=False,
        reason="GPU lost (identity): GPU is lost; last seen as ...",
        sampled_at=0.0,
        last_seen=seen,
        critical_xids=(CriticalXid(79, 1, 1.0, 1.0),),  # raised before the UUID was read
    )
    never = GpuSample(
        identity=placeholder_identity(3), healthy=False, reason="GPU lost", sampled_at=0.0
    )
    snap = Snapshot(wall_time=1.7e9, monotonic=99.0, gpus=(lost, never), tick_seconds=0.0)
    registry = build_registry(Collector(lambda: snap, clock=lambda: 100.0), process=False)
    v = registry.get_sample_value
    assert v("gpud_gpu_healthy", gpu_labels(2)) == 0
    assert v("gpud_gpu_unhealthy_info", gpu_labels(2, reason=lost.reason)) == 1
    assert v("gpud_gpu_critical_xid_uncleared", gpu_labels(2, xid="79")) == 1
    info = gpu_labels(2, product="", pci_bus_id="00000000:1A:00.0")
    assert v("gpud_gpu_info", info) == 1
    unknown = {"gpu": "3", "uuid": "", "model": ""}
    assert v("gpud_gpu_healthy", unknown) == 0
    assert v("gpud_gpu_info", {**unknown, "product": "", "pci_bus_id": ""}) == 1
    # what was never read has no series: no size, clocks or MIG mode of 0 beside the
    # real ones of the GPUs read (a sum or a min over the node would count them)
    for gpu in ("2", "3"):
        series = {
            s.name for m in registry.collect() for s in m.samples if s.labels.get("gpu") == gpu
        }
        assert series == {
            "gpud_gpu_info",
            "gpud_gpu_healthy",
            "gpud_gpu_unhealthy_info",
            "gpud_gpu_sample_age_seconds",
            *(("gpud_gpu_critical_xid_uncleared",) if gpu == "2" else ()),
            "gpud_gpu_xid_errors_total",
        }


def test_a_gpu_lost_before_start_keeps_the_product_it_was_last_seen_as() -> None:
    """gpud_gpu_info of a GPU lost while gpud was down: the product label it had before the
    restart (the same series), where the earlier run kept it."""
    seen = SeenIdentity("GPU-2", NAME, "00000000:1A:00.0", "H100-SXM5-80GB")
    lost = GpuSample(placeholder_identity(2), False, "GPU lost", 0.0, last_seen=seen)
    snap = Snapshot(wall_time=1.7e9, monotonic=99.0, gpus=(lost,), tick_seconds=0.0)
    registry = build_registry(Collector(lambda: snap, clock=lambda: 100.0), process=False)
    info = gpu_labels(2, product="H100-SXM5-80GB", pci_bus_id="00000000:1A:00.0")
    assert registry.get_sample_value("gpud_gpu_info", info) == 1


def test_mig_devices(registry: CollectorRegistry) -> None:
    labels = {
        "gpu": "1",
        "gpu_uuid": "GPU-1",
        "mig_uuid": "MIG-1-1",
        "profile": "1g.10gb",
        "gpu_instance_id": "8",
        "compute_instance_id": "0",
    }
    v = registry.get_sample_value
    assert v("gpud_mig_device_memory_used_bytes", labels) == 2 * GIB
    assert v("gpud_mig_device_memory_total_bytes", labels) == 10 * GIB
    assert v("gpud_mig_device_memory_free_bytes", labels) == 8 * GIB
    assert v("gpud_mig_device_processes", labels) == 1


def test_node_metrics_events_and_process(registry: CollectorRegistry) -> None:
    v = registry.get_sample_value
    assert v("gpud_sample_age_seconds") == 1.0
    assert v("gpud_sample_duration_seconds") == 0.004
    assert v("gpud_gpus") == 3
    assert v("gpud_driver_info", {"version": "550.54.15"}) == 1
    assert v("gpud_events_total", {"kind": "gpu.xid"}) == 2
    assert v("gpud_events_total", {"kind": "gpu.unhealthy"}) == 1
    assert v("gpud_event_log_write_errors_total") == 0  # no file: nothing failed
    import gpud

    assert v("gpud_build_info", {"version": gpud.__version__, "build": "3f2a9c1d04ab"}) == 1
    resident = v("process_resident_memory_bytes")
    assert resident is not None and resident > 0
    assert v("python_info", {**_python_info_labels()}) == 1


def _python_info_labels() -> dict[str, str]:
    import platform

    major, minor, patch = platform.python_version_tuple()
    return {
        "implementation": platform.python_implementation(),
        "major": major,
        "minor": minor,
        "patchlevel": patch,
        "version": platform.python_version(),
    }


def test_before_first_tick_only_node_metrics() -> None:
    registry = build_registry(Collector(lambda: None), process=False)
    text = generate_latest(registry).decode()
    assert "gpud_build_info" in text
    # by default, the build of the code running
    assert f'build="{gpud.build.current()}"' in text
    assert "gpud_gpu_" not in text
    assert registry.get_sample_value("gpud_sample_age_seconds") is None


def test_extra_sources_and_a_failing_one() -> None:
    def mps() -> Iterable[Metric]:
        fam = GaugeMetricFamily("gpud_mps_clients", "MPS clients.", labels=("gpu",))
        fam.add_metric(("0",), 3)
        return [fam]

    def broken() -> Iterable[Metric]:
        raise RuntimeError("boom")

    collector = Collector(lambda: None, sources=[broken])
    collector.add_source(mps)
    registry = build_registry(collector, process=False)
    assert registry.get_sample_value("gpud_mps_clients", {"gpu": "0"}) == 3  # scrape 1
    errors = registry.get_sample_value(  # scrape 2 counts its own failure too
        "gpud_metric_source_errors_total",
        {"source": "test_extra_sources_and_a_failing_one.<locals>.broken"},
    )
    assert errors == 2


def test_each_registry_is_separate() -> None:
    a = build_registry(Collector(snapshot, clock=lambda: 100.0), process=False)
    b = build_registry(Collector(lambda: None), process=False)
    assert a.get_sample_value("gpud_gpus") == 3
    assert b.get_sample_value("gpud_gpus") is None


def test_http_server_serves_and_stops() -> None:
    registry = build_registry(Collector(snapshot, clock=lambda: 100.0), process=False)
    server, thread = start_metrics_server(registry, "127.0.0.1", 0)
    port = server.server_port
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            body = resp.read().decode()
        assert 'gpud_gpu_healthy{gpu="2",model="NVIDIA H100 80GB HBM3",uuid="GPU-2"} 0.0' in body
    finally:
        stop_metrics_server(server, thread)
    assert not thread.is_alive()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1)


def test_a_connection_that_sends_nothing_is_closed_after_the_timeout() -> None:
    registry = build_registry(Collector(snapshot, clock=lambda: 100.0), process=False)
    server, thread = start_metrics_server(registry, "127.0.0.1", 0, connection_timeout_s=0.2)
    try:
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=5) as idle:
            idle.sendall(b"GET /metrics HTTP/1.1\\r\\n")  # and never the rest
            assert idle.recv(1) == b""  # closed by the server, not timed out here
    finally:
        stop_metrics_server(server, thread)


def test_a_connection_that_trickles_its_request_is_closed_once_its_time_is_spent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="gpud.metrics_http")
    now = [0.0]
    reads = threading.Semaphore(0)

    def clock() -> float:
        value = now[0]  # read before the test may move it on
        reads.release()  # the server looked at the time: connection start, or a read
        return value

    registry = build_registry(Collector(snapshot, clock=lambda: 100.0), process=False)
    server, thread = start_metrics_server(
        registry, "127.0.0.1", 0, connection_timeout_s=30.0, clock=clock
    )
    try:
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=5) as slow:
            slow.sendall(b"GET /metrics HTTP/1.1\r\n")
            # its start, the read of the request line, the read waiting for the headers
            for _ in range(3):
                assert reads.acquire(timeout=5)
            now[0] = 31.0  # each byte came within the socket timeout; the whole did not
            try:
                slow.sendall(b"X-Slow: 1\r\n")
                assert slow.recv(4096) == b""  # closed by the server, not timed out here
            except ConnectionResetError:
                pass
        # logged before the server closed the connection
        (ended,) = [r for r in caplog.records if r.exc_info]
        assert ended.exc_info is not None
        assert str(ended.exc_info[1]) == "/metrics: request not received within 30 s"
    finally:
        stop_metrics_server(server, thread)


class _BigFamily:
    """A family whose exposition outgrows any socket buffer (16 MiB), so that sending it
    waits on its reader."""

    def collect(self) -> Iterable[Metric]:
        gauge = GaugeMetricFamily("gpud_test_big", "a big family", labels=["pad"])
        for i in range(4096):
            gauge.add_metric([f"{i:08d}" + "x" * 4088], i)
        yield gauge


def _big_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_BigFamily())
    return registry


def test_a_request_that_arrives_late_still_gets_its_whole_reply() -> None:
    calls = [0]

    def clock() -> float:
        calls[0] += 1  # the connection starts at 0; its request is all read just before 30
        return 0.0 if calls[0] == 1 else 30.0 - 1e-6

    server, thread = start_metrics_server(
        _big_registry(), "127.0.0.1", 0, connection_timeout_s=30.0, clock=clock
    )
    try:
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=30) as late:
            late.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            reply = bytearray()
            while chunk := late.recv(1 << 20):
                reply += chunk
        head, _, body = bytes(reply).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200 OK")
        assert body == generate_latest(_big_registry())
    finally:
        stop_metrics_server(server, thread)


def test_a_reader_that_stops_mid_reply_is_logged_at_debug_not_as_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cut = threading.Event()
    lines: list[str] = []

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "reply to" in record.getMessage():
                lines.append(record.getMessage())
                cut.set()

    log = logging.getLogger("gpud.metrics_http")
    seen, level = Seen(), log.level
    log.addHandler(seen)
    log.setLevel(logging.DEBUG)
    server, thread = start_metrics_server(_big_registry(), "127.0.0.1", 0, connection_timeout_s=0.2)
    try:
        with socket.socket() as stuck:
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stuck.connect(("127.0.0.1", server.server_port))
            stuck.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert stuck.recv(16) == b"HTTP/1.0 200 OK\r"  # and no more
            assert cut.wait(timeout=10)
        assert lines == ["/metrics: reply to 127.0.0.1 cut: reply not sent within 0.2 s"]
        assert "Traceback" not in capsys.readouterr().err
    finally:
        stop_metrics_server(server, thread)
        log.removeHandler(seen)
        log.setLevel(level)


def test_the_listen_queue_is_as_long_as_the_kernel_allows(tmp_path: Path) -> None:
    (tmp_path / "sys/net/core").mkdir(parents=True)
    (tmp_path / "sys/net/core/somaxconn").write_text("65535\n")
    registry = build_registry(Collector(snapshot, clock=lambda: 100.0), process=False)
    server, thread = start_metrics_server(registry, "127.0.0.1", 0, proc_root=tmp_path)
    try:
        assert server.request_queue_size == 65535
    finally:
        stop_metrics_server(server, thread)
    assert metrics_http.listen_backlog(tmp_path / "absent") == socket.SOMAXCONN


def test_a_burst_of_connections_waits_in_the_listen_queue_not_in_syn_retries() -> None:
    registry = build_registry(Collector(snapshot, clock=lambda: 100.0), process=False)
    server, thread = start_metrics_server(registry, "127.0.0.1", 0, max_connections=2)
    address = ("127.0.0.1", server.server_port)
    server.shutdown()  # nothing accepts them now: they queue, as while a burst is answered
    waiting: list[socket.socket] = []
    try:
        # prometheus_client's server left the kernel's queue at 5: the rest of a burst was
        # dropped, its clients retrying after 1 s, 3 s, 7 s..., past a scrape's timeout
        for _ in range(64):
            waiting.append(socket.create_connection(address, timeout=5))
    finally:
        for conn in waiting:
            conn.close()
        stop_metrics_server(server, thread)


def test_a_connection_past_the_bound_is_answered_busy_and_a_scrape_follows() -> None:
    registry = build_registry(Collector(snapshot, clock=lambda: 100.0), process=False)
    server, thread = start_metrics_server(registry, "127.0.0.1", 0, max_connections=2)
    address = ("127.0.0.1", server.server_port)
    try:
        idle = [socket.create_connection(address, timeout=5) for _ in range(2)]
        for conn in idle:
            conn.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest: each holds a slot
        with socket.create_connection(address, timeout=5) as third:
            reply = b""
            while chunk := third.recv(4096):
                reply += chunk
        assert reply.startswith(b"HTTP/1.0 503 ")
        assert b"Retry-After: 1" in reply
        assert server.busy_refusals == 1  # type: ignore[attr-defined]
        for conn in idle:
            conn.close()  # their threads end and give the slots back
        deadline = time.monotonic() + 5
        while True:
            try:
                with urllib.request.urlopen(
                    f"http://{address[0]}:{address[1]}/metrics", timeout=5
                ) as resp:
                    assert b"gpud_gpus 3.0" in resp.read()
                break
            except urllib.error.HTTPError as err:  # a slot not given back yet
                assert err.code == 503 and time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        stop_metrics_server(server, thread)


def test_a_scrape_for_named_families_has_gpuds_own() -> None:
    registry = build_registry(Collector(snapshot, clock=lambda: 100.0), proc_root="/nonexistent")
    text = generate_latest(registry.restricted_registry(["gpud_gpus", "python_info"])).decode()
    assert "gpud_gpus 3.0" in text
    assert "python_info{" in text
    assert "gpud_gpu_healthy" not in text


def test_a_scrape_names_a_histogram_by_its_base_name() -> None:
    stats = LoopStats()
    stats.record(0.2, 1.0, [])
    collector = Collector(snapshot, clock=lambda: 100.0, sources=[LoopMetrics(stats)], build="x")
    app = metrics_app(build_registry(collector, process=False))
    reply: list[str] = []
    environ: dict[str, Any] = {"QUERY_STRING": "name[]=gpud_loop_duration_seconds&name[]=gpud_gpus"}
    setup_testing_defaults(environ)
    environ["PATH_INFO"] = "/metrics"
    body = b"".join(app(environ, lambda status, headers: reply.append(status))).decode()
    assert reply == ["200 OK"]
    samples = sorted(
        {line.split("{")[0].split(" ")[0] for line in body.splitlines() if line[0] != "#"}
    )
    assert samples == [
        "gpud_gpus",
        "gpud_loop_duration_seconds_bucket",
        "gpud_loop_duration_seconds_count",
        "gpud_loop_duration_seconds_sum",
    ]
    assert "gpud_loop_duration_seconds_count 1.0" in body


def _request(port: int, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_http_paths_and_methods() -> None:
    registry = build_registry(Collector(snapshot, clock=lambda: 100.0), process=False)
    server, thread = start_metrics_server(registry, "127.0.0.1", 0)
    port = server.server_port
    try:
        status, headers, body = _request(port, "GET", "/metrics?x=y")
        assert status == 200 and b"gpud_gpus 3.0" in body
        status, headers, head_body = _request(port, "HEAD", "/metrics")
        assert (status, head_body) == (200, b"")
        assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert int(headers["Content-Length"]) == len(body)
        status, _, body = _request(port, "GET", "/metrics?name[]=gpud_gpus")
        assert status == 200 and body.decode().splitlines()[-1] == "gpud_gpus 3.0"
        status, _, body = _request(port, "GET", "/")
        assert (status, body) == (200, b"gpud: metrics are at /metrics\n")
        for path in ("/nope", "/metric", "/metrics/x", "/favicon.ico"):
            status, _, body = _request(port, "GET", path)
            assert (status, body) == (404, b"404 Not Found: metrics are at /metrics\n")
        status, headers, body = _request(port, "POST", "/metrics")
        assert status == 405 and headers["Allow"] == "GET, HEAD, OPTIONS"
        status, headers, _ = _request(port, "OPTIONS", "/metrics")
        assert status == 200 and headers["Allow"] == "GET, HEAD, OPTIONS"
    finally:
        stop_metrics_server(server, thread)
