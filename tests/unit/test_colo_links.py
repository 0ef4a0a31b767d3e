"""PCIe and NVLink throughput as fractions of the links, and their way into the predictor's
features: unit figures, then end to end on the simulated node's workload models."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gpud.backend import products
from gpud.backend.nvml import NvmlBackend
from gpud.backend.port import MemoryInfo, PcieThroughput, Utilization
from gpud.backend.sim import JobDevice, SimNode
from gpud.backend.sim.fakenvml import LinkTraffic
from gpud.backend.sim.jobmodels import (
    REQUEST_BYTES,
    TRAINING_NVLINK,
    TRAINING_PCIE_RX,
    link_traffic,
)
from gpud.colo.links import NvlinkRates, nvlink_capacity, pcie_capacity, pcie_ratio
from gpud.colo.service import ColoService, Directive, RunningJob
from gpud.config import ColocateConfig
from gpud.errors import GpuLost
from gpud.events import EventLog
from gpud.telemetry.reader import GpuReader
from gpud.telemetry.snapshot import GpuSample, Snapshot
from tests.unit.api_support import GIB, identity
from tests.unit.test_sim_jobmodels import Procs

GEN5_X16 = 32e9 * 128 / 130 / 8 * 16  # 63.0 GB/s each way
GEN4_X16 = GEN5_X16 / 2


def test_pcie_capacity_per_generation_and_width() -> None:
    assert products.pcie_bytes_per_second(5, 16) == pytest.approx(GEN5_X16)
    assert products.pcie_bytes_per_second(4, 8) == pytest.approx(GEN4_X16 / 2)
    assert products.pcie_bytes_per_second(3, 16) == pytest.approx(15.75e9, rel=1e-3)
    assert products.pcie_bytes_per_second(1, 1) == pytest.approx(250e6)
    assert products.pcie_bytes_per_second(0, 16) is None
    assert products.pcie_bytes_per_second(4, 3) is None


def test_link_capacity_from_nvml_then_the_product_then_a_default() -> None:
    h100 = dataclasses.replace(identity(0), product="H100-SXM5-80GB")
    # what NVML says wins: an H100 in a Gen4 slot has a Gen4 link
    assert pcie_capacity(
        dataclasses.replace(h100, pcie_link_gen=4, pcie_link_width=16)
    ) == pytest.approx(GEN4_X16)
    assert pcie_capacity(h100) == pytest.approx(GEN5_X16)  # NVML silent: the product's
    bogus = dataclasses.replace(h100, pcie_link_gen=9, pcie_link_width=16)
    assert pcie_capacity(bogus) == pytest.approx(GEN5_X16)
    unknown = dataclasses.replace(identity(0), product="L40S-45GB")
    assert pcie_capacity(unknown) == pytest.approx(GEN4_X16)  # the documented default
    assert nvlink_capacity(h100) == 450e9
    assert nvlink_capacity(unknown) is None


def test_pcie_ratio_is_the_busier_direction_within_0_and_1() -> None:
    assert pcie_ratio(PcieThroughput(1e9, 3e9), 10e9) == pytest.approx(0.3)
    assert pcie_ratio(PcieThroughput(30e9, 0.0), 10e9) == 1.0
    assert pcie_ratio(None, 10e9) == 0.0
    assert pcie_ratio(PcieThroughput(1e9, 1e9), 0.0) == 0.0


def sample(index: int, at: float, nvlink: tuple[int, int] | None, product: str) -> GpuSample:
    ident = dataclasses.replace(identity(index), product=product)
    return GpuSample(ident, True, "", at, nvlink_bytes=nvlink)


def test_nvlink_rate_is_counter_growth_over_the_interval_and_capacity() -> None:
    rates = NvlinkRates()
    h100 = "H100-SXM5-80GB"
    assert rates.ratio(sample(0, 10.0, (0, 0), h100)) is None  # one reading: no rate yet
    # 90 GB sent and 45 GB received in 2 s: 45 GB/s of 450 the busier way
    assert rates.ratio(sample(0, 12.0, (90 * 10**9, 45 * 10**9), h100)) == pytest.approx(0.1)
    assert rates.ratio(sample(0, 12.0, (90 * 10**9, 45 * 10**9), h100)) == pytest.approx(0.1)
    # counters restarted (driver reload): no rate until they grew again
    assert rates.ratio(sample(0, 14.0, (10, 10), h100)) is None
    assert rates.ratio(sample(0, 15.0, (10 + 450 * 10**9, 10), h100)) == pytest.approx(1.0)
    # unsupported, or a product without a known NVLink: 0, never an error
    assert rates.ratio(sample(1, 10.0, None, h100)) == 0.0
    assert rates.ratio(sample(2, 10.0, (5, 5), "L40S-45GB")) == 0.0


def h100_busy(
    at: float, nvlink: tuple[int, int] | None, pcie: PcieThroughput | None = None
) -> Snapshot:
    """An H100 whose SMs are 45 % busy, sampled at ``at`` with these link readings."""
    ident = dataclasses.replace(identity(0), product="H100-SXM5-80GB")
    gpu = GpuSample(
        ident,
        True,
        "",
        at,
        memory=MemoryInfo(80 * GIB, 20 * GIB, 60 * GIB),
        utilization=Utilization(0.45, 0.2),
        pcie=pcie,
        nvlink_bytes=nvlink,
    )
    return Snapshot(wall_time=0.0, monotonic=at, tick_seconds=0.01, gpus=(gpu,))


def test_a_job_alone_learns_its_link_features_divided_by_its_duty(tmp_path: Path) -> None:
    t = [100.0]
    jobs = [RunningJob("train", "training", 0, memory_bytes=10 * GIB, memory_used=10 * GIB)]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=lambda: t[0]
    )

    def snap(at: float, nvlink: tuple[int, int]) -> Snapshot:
        return h100_busy(at, nvlink, PcieThroughput(0.1e9, 3.15e9))

    def held() -> None:  # as a guard next to it would hold it (the plan alone does not)
        svc._directives["train"] = Directive(0.5, False, "held for a service")

    svc.tick(snap(0.0, (0, 0)))  # a new company (none): measuring starts
    held()
    svc.tick(snap(5.0, (9 * 10**10, 9 * 10**10)))  # 18 GB/s: 0.04 of 450, at duty 0.5
    f = svc._features(jobs[0])
    assert f.pcie == pytest.approx(0.1, rel=1e-3)  # 3.15 GB/s of 63 at duty 0.5
    assert f.nvlink == pytest.approx(0.08) and f.sm == pytest.approx(0.9)
    held()
    svc.tick(snap(10.0, (9 * 10**10, 9 * 10**10)))  # no traffic this interval
    f = svc._features(jobs[0])
    # the mean of the two readings: the last one does not stand for the job alone
    assert f.nvlink == pytest.approx(0.04) and f.sm == pytest.approx(0.9)


def test_link_traffic_of_the_models() -> None:
    alone = link_traffic("training")
    assert alone.pcie_rx == TRAINING_PCIE_RX and alone.nvlink_tx == 0.0  # one GPU: no peers
    half = link_traffic("training", duty=0.5, gpus=2)
    assert half.pcie_rx == pytest.approx(TRAINING_PCIE_RX / 2)
    assert half.nvlink_tx == half.nvlink_rx == pytest.approx(TRAINING_NVLINK / 2)
    served = link_traffic("inference", load=100.0, gpus=2)
    assert served.pcie_rx == pytest.approx(100 * REQUEST_BYTES) and served.nvlink_tx == 0.0
    assert link_traffic("inference").pcie_rx == 0.0


def test_the_simulated_node_feeds_link_features_end_to_end(tmp_path: Path) -> None:
    """Workload models -> fake NVML -> the real adapter and GPU reader -> the loop's
    features: a training job on two GPUs reads its batches over PCIe and all-reduces over
    NVLink; an inference service moves its requests over PCIe."""
    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    proc = tmp_path / "proc"
    proc.mkdir()
    node = SimNode([("H100-SXM5-80GB", 3)], proc_root=proc, clock=clock)
    procs = Procs(proc)
    procs.add(1, 0, {"PATH": "/bin"}, comm="init")
    procs.add(500, 1, {"GPUD_JOB": "train"})
    procs.add(600, 1, {"GPUD_JOB": "chat"})
    backend = NvmlBackend(node.nvml)
    readers = [
        GpuReader(backend, i, clock=clock, unsupported_retry_s=60, identity_refresh_s=60)
        for i in range(3)
    ]
    running = [
        RunningJob("train", "training", 0, memory_bytes=10 * GIB, pids=(500,)),
        RunningJob("chat", "inference", 2, slo_p99_ms=500.0, memory_bytes=8 * GIB, pids=(600,)),
    ]
    # the training job holds GPUs 0 and 1; its process (the model's) runs on the first
    devices = [*running, dataclasses.replace(running[0], gpu=1)]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: running, clock=clock
    )
    try:
        for _ in range(4):
            svc.report_latency("chat", [0.01] * 200)
            node.jobs.sync(
                [
                    JobDevice(
                        r.name,
                        r.kind,
                        r.gpu,
                        memory_bytes=r.memory_bytes,
                        load=svc.load(r.name) if r.kind == "inference" else 0.0,
                    )
                    for r in devices
                ]
            )
            svc.tick(Snapshot(0.0, now[0], tuple(r.read() for r in readers), 0.01))
            now[0] += 5.0
        ident = readers[0].read().identity
        assert (ident.pcie_link_gen, ident.pcie_link_width) == (5, 16)
        train = svc._features(running[0])
        assert train.pcie == pytest.approx(TRAINING_PCIE_RX / GEN5_X16, rel=0.05)
        assert train.nvlink == pytest.approx(TRAINING_NVLINK / 450e9, rel=0.01)
        chat = svc._features(running[1])
        assert 0.0 < chat.pcie < 0.01 and chat.nvlink == 0.0
    finally:
        node.jobs.stop_all()
        backend.close()


def test_a_lost_gpu_raises_for_the_link_calls_and_unsupported_reads_none() -> None:
    node = SimNode([("A100-SXM4-80GB", 2)])
    nv = node.nvml
    backend = NvmlBackend(nv)
    try:
        assert (backend.identity(0).pcie_link_gen, backend.identity(0).pcie_link_width) == (4, 16)
        node.faults.lose(1)
        h1 = nv.nvmlDeviceGetHandleByIndex(1)
        for call in (
            nv.nvmlDeviceGetMaxPcieLinkGeneration,
            nv.nvmlDeviceGetMaxPcieLinkWidth,
            lambda h: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES),
        ):
            with pytest.raises(nv.NVMLError_GpuIsLost):
                call(h1)
        with pytest.raises(GpuLost):
            backend.identity(1)
        node.faults.clear(1)
        node.faults.not_supported(1, "pcie")
        ident = backend.identity(1)  # NVML silent on the link: the product's is used
        assert ident.pcie_link_gen is None and ident.pcie_link_width is None
        assert pcie_capacity(ident) == pytest.approx(GEN4_X16)
    finally:
        node.faults.clear()
        backend.close()


def test_nvlink_counters_that_stop_being_supported_read_0(tmp_path: Path) -> None:
    """A GPU whose NVLink counters read and then answer NotSupported (the reader's sample
    stays healthy): its NVLink reads 0 from then on, and a job alone there learns that,
    not the traffic it showed before, kept for ever."""
    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    node = SimNode([("H100-SXM5-80GB", 1)], clock=clock)
    backend = NvmlBackend(node.nvml)
    reader = GpuReader(backend, 0, clock=clock, unsupported_retry_s=60, identity_refresh_s=60)
    jobs = [RunningJob("train", "training", 0, memory_bytes=10 * GIB, memory_used=10 * GIB)]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=clock
    )
    rates = NvlinkRates()
    # 45 GB/s each way: 0.1 of the H100's 450
    node.nvml.sim_start_process(0, 500, GIB, 0.45, traffic=LinkTraffic(nvlink_tx=45e9))
    try:
        seen = []
        for step in range(6):
            if step == 3:
                node.faults.not_supported(0, "nvlink")
            s = reader.read()
            assert s.healthy
            seen.append(rates.ratio(s))
            svc.tick(Snapshot(0.0, now[0], (s,), 0.01))
            now[0] += 5.0
        assert seen[0] is None and seen[1:3] == [pytest.approx(0.1, rel=0.01)] * 2
        assert seen[3:] == [0.0, 0.0, 0.0]
        whole = svc._jobs["train"].devices["GPU 0"].whole
        assert whole is not None and whole.nvlink < 0.1
    finally:
        node.faults.clear()
        backend.close()
