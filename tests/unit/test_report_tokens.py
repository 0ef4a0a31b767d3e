"""A run's report token: a job's reports over TCP carry it, and speak for that job only."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gpud.api import ApiServer
from gpud.api.access import TCP_NEEDS_TOKEN, TOKEN_KEY, ReportTokens
from gpud.client import Latency, Progress
from gpud.client import progress as client_progress
from gpud.colo.api import ColoServicer
from gpud.colo.service import ColoService, RunningJob
from gpud.config import ColocateConfig
from gpud.events import EventLog
from gpud.jobs import env as job_env
from gpud.jobs.api import JobsServicer
from gpud.jobs.placement import Reservations
from gpud.jobs.registry import JobKind
from gpud.jobs.service import JobService, RunRequest
from gpud.mps.manager import MpsManager, targets_from_snapshot
from gpud.net.api import NetServicer
from gpud.shared import GIB
from gpud.store import StateStore
from gpud.v1 import colo_pb2, colo_pb2_grpc, jobs_pb2, jobs_pb2_grpc, net_pb2, net_pb2_grpc
from tests.unit.api_support import ServerThread
from tests.unit.mps_support import FAKE_CONTROL, gpu_sample, short_dir, snapshot
from tests.unit.test_net_api import Node

DEVICES = targets_from_snapshot(snapshot(gpu_sample(0, memory_gib=80), gpu_sample(1)))


def job_service(root: Path, store: StateStore) -> JobService:
    mps = MpsManager(store, EventLog(None), root / "run", FAKE_CONTROL, enabled=False)
    mps.observe(DEVICES)
    return JobService(store, EventLog(None), mps, socket_path=root / "gpud.sock")


@dataclass
class Gpud:
    """gpud's Jobs, Net and Colocation services on a socket and on TCP, with two runs:
    train-a (training) and chat (inference), each with the token gpud gave it."""

    sock: Path
    tcp: str
    net: Node
    colo: ColoService
    jobs: JobService
    train_token: str
    chat_token: str

    def iterations_of(self, job: str) -> int | None:
        self.net.service.tick()
        return {j.job: j.iterations for j in self.net.service.view().jobs}.get(job)


@pytest.fixture
def gpud(tmp_path: Path) -> Iterator[Gpud]:
    store = StateStore(tmp_path / "state")
    jobs = job_service(tmp_path, store)
    train = jobs.reserve(RunRequest("train-a", gpu_count=1, memory_bytes=10 * GIB))
    chat = jobs.reserve(RunRequest("chat", JobKind.INFERENCE, gpu_count=1, memory_bytes=GIB))
    net = Node(tmp_path / "net")
    net.jobs = ["train-a", "train-b", "chat"]
    running = [
        RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=GIB),
        RunningJob("train-a", "training", 0, memory_bytes=10 * GIB),
    ]
    colo = ColoService(ColocateConfig(), EventLog(None), running=lambda: running)
    tokens = ReportTokens(jobs.reservations.job_of_token)
    with short_dir() as d:
        server = ApiServer(
            d / "gpud.sock",
            tcp_address="127.0.0.1:0",
            servicers=[
                NetServicer(net.service, tokens=tokens).register,
                ColoServicer(colo, snapshots=lambda: None, tokens=tokens).register,
                JobsServicer(jobs, tokens=tokens).register,
            ],
        )
        with ServerThread(server):
            yield Gpud(
                d / "gpud.sock",
                f"127.0.0.1:{server.tcp_port}",
                net,
                colo,
                jobs,
                train.env[job_env.REPORT_TOKEN_VAR],
                chat.env[job_env.REPORT_TOKEN_VAR],
            )
    store.close()


def _md(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return None if token is None else ((TOKEN_KEY, token),)


def _report(target: str, job: str, token: str | None, iterations: int = 2000) -> None:
    with grpc.insecure_channel(target) as ch:
        net_pb2_grpc.NetStub(ch).ReportProgress(
            net_pb2.ReportProgressRequest(
                job=job, iterations=iterations, timestamp_unix_seconds=time.time()
            ),
            metadata=_md(token),
            timeout=10,
        )


def _refused(call: object, *args: object) -> str:
    with pytest.raises(grpc.RpcError) as refused:
        call(*args)  # type: ignore[operator]
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    return str(refused.value.details())


def test_a_progress_report_over_tcp_speaks_only_for_the_run_whose_token_it_carries(
    gpud: Gpud,
) -> None:
    # forged: no token, and another run's token
    assert _refused(_report, gpud.tcp, "train-b", None) == TCP_NEEDS_TOKEN
    assert "of a run of job 'train-b'" in _refused(_report, gpud.tcp, "train-b", gpud.chat_token)
    assert "of a run of job 'train-a'" in _refused(_report, gpud.tcp, "train-a", "made-up")
    assert gpud.iterations_of("train-b") is None and gpud.iterations_of("train-a") is None
    _report(gpud.tcp, "train-a", gpud.train_token)  # the run's own
    assert gpud.iterations_of("train-a") == 2000
    _report(f"unix:{gpud.sock}", "train-b", None, 5)  # an operator on the socket, as today
    assert gpud.iterations_of("train-b") == 5


def test_a_batch_over_tcp_keeps_the_reports_of_the_tokens_job_only(gpud: Gpud) -> None:
    now = time.time()
    batch = net_pb2.ReportProgressBatchRequest(
        reports=[
            net_pb2.ReportProgressRequest(job=j, iterations=7, timestamp_unix_seconds=now)
            for j in ("train-b", "train-a")
        ]
    )
    with grpc.insecure_channel(gpud.tcp) as ch:
        stub = net_pb2_grpc.NetStub(ch)
        assert _refused(stub.ReportProgressBatch, batch) == TCP_NEEDS_TOKEN
        resp = stub.ReportProgressBatch(batch, metadata=_md(gpud.train_token))
    assert resp.accepted == 1
    (bad,) = resp.rejected
    assert (bad.index, bad.job, bad.code) == (0, "train-b", "PERMISSION_DENIED")
    assert gpud.iterations_of("train-b") is None and gpud.iterations_of("train-a") == 7


def test_forged_latencies_and_throttle_points_change_nothing(gpud: Gpud) -> None:
    latency = colo_pb2.ReportLatencyRequest(job="chat", seconds=[2.0] * 50)
    point = colo_pb2.ThrottlePointRequest(job="train-a", iterations=3)
    with grpc.insecure_channel(gpud.tcp) as ch:
        stub = colo_pb2_grpc.ColocationStub(ch)
        assert _refused(stub.ReportLatency, latency) == TCP_NEEDS_TOKEN
        assert "job 'chat'" in _refused(
            lambda r: stub.ReportLatency(r, metadata=_md(gpud.train_token)), latency
        )
        assert _refused(stub.ThrottlePoint, point) == TCP_NEEDS_TOKEN
        assert gpud.colo.p99("chat") is None
        stub.ReportLatency(latency, metadata=_md(gpud.chat_token))
        stub.ThrottlePoint(point, metadata=_md(gpud.train_token))
    assert gpud.colo.p99("chat") == pytest.approx(2.0)


def test_gpud_client_sends_the_runs_token_from_its_environment(
    gpud: Gpud, monkeypatch: pytest.MonkeyPatch
) -> None:
    def sent(job: str) -> Progress:
        p = Progress(job, target=gpud.tcp, flush_interval_s=0.02)
        try:
            p.step()
            assert p.flush(timeout=10)
        finally:
            p.close()
        return p

    monkeypatch.delenv(client_progress.TOKEN_VAR, raising=False)
    refused = sent("train-a")  # refused whole, dropped: not retried for ever
    assert (refused.sent, refused.rejected, refused.last_error) == (0, 1, TCP_NEEDS_TOKEN)
    monkeypatch.setenv(client_progress.TOKEN_VAR, gpud.train_token)
    assert sent("train-a").sent == 1
    # Latency (on the socket) carries it too: another job's token is refused there
    lat = Latency("chat", socket=str(gpud.sock), flush_every_s=0)
    lat.observe(0.5)  # sent by its thread: flush waits for the call
    assert lat.close(timeout=10) and lat.dropped == 1
    assert gpud.colo.p99("chat") is None
    monkeypatch.setenv(client_progress.TOKEN_VAR, gpud.chat_token)
    lat = Latency("chat", socket=str(gpud.sock), flush_every_s=0)
    lat.observe(0.5)
    assert lat.close(timeout=10) and lat.dropped == 0
    assert gpud.colo.p99("chat") == pytest.approx(0.5)


def test_get_job_env_shows_the_token_on_the_socket_only(gpud: Gpud) -> None:
    def env(target: str) -> dict[str, str]:
        with grpc.insecure_channel(target) as ch:
            req = jobs_pb2.GetJobEnvRequest(job="train-a")
            return dict(jobs_pb2_grpc.JobsStub(ch).GetJobEnv(req, timeout=10).env)

    on_socket, over_tcp = env(f"unix:{gpud.sock}"), env(gpud.tcp)
    assert on_socket[job_env.REPORT_TOKEN_VAR] == gpud.train_token
    assert job_env.REPORT_TOKEN_VAR not in over_tcp
    assert over_tcp == job_env.without_token(on_socket)


def test_a_token_outlives_a_restart_and_ends_with_its_reservation(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    jobs = job_service(tmp_path, store)
    launch = jobs.reserve(RunRequest("train-a", gpu_count=1))
    token = launch.env[job_env.REPORT_TOKEN_VAR]
    assert len(token) >= 40 and token not in repr(launch.reservation)
    store.close()
    store = StateStore(tmp_path / "state")  # gpud restarted
    reservations = Reservations(store)
    assert reservations.job_of_token(token) == "train-a"
    assert reservations.held()[0].report_token == token
    reservations.release(launch.reservation.id)
    assert reservations.job_of_token(token) is None
    store.close()


def test_the_clients_names_are_gpuds() -> None:
    assert (client_progress.TOKEN_VAR, client_progress.TOKEN_KEY) == (
        job_env.REPORT_TOKEN_VAR,
        TOKEN_KEY,
    )
