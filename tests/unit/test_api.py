"""The gRPC API in-process: a real grpc.aio server on a temporary unix socket, real clients."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import grp
import importlib
import logging
import math
import os
import random
import socket
import stat
import subprocess
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpud.api import ApiServer, FaultPort, NodeServicer
from gpud.api import server as api_server
from gpud.api.access import TCP_READ_METHODS, TcpAccess
from gpud.errors import (
    ERROR_KEY,
    EXIT_CODE_KEY,
    ConfigError,
    FailedPrecondition,
    GpudError,
    GpuLost,
)
from gpud.events import EventLog
from gpud.telemetry.snapshot import ClearedXids
from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc
from tests.unit.api_support import (
    FakeFaults,
    identity,
    make_events,
    make_servicer,
    node_info,
    short_dir,
)


@pytest.fixture
def sock_dir() -> Any:
    with short_dir() as d:
        yield d


async def _serve(path: Path, servicer: NodeServicer, **kw: Any) -> ApiServer:
    server = ApiServer(path, servicers=[servicer.register], **kw)
    await server.start()
    return server


@pytest.fixture
async def channel(sock_dir: Path) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to a simulated node's API (fake fault port)."""
    faults = FakeFaults()
    server = await _serve(sock_dir / "gpud.sock", make_servicer(faults=faults))
    async with grpc.aio.insecure_channel(f"unix:{sock_dir / 'gpud.sock'}") as ch:
        ch.faults = faults  # type: ignore[attr-defined]
        yield ch
    await server.stop(0)


def _md(err: grpc.aio.AioRpcError) -> dict[str, str]:
    return dict(err.trailing_metadata() or ())


# --- the socket and the server's life ---


async def test_socket_mode_group_and_removal(sock_dir: Path) -> None:
    path = sock_dir / "run" / "gpud.sock"  # the parent is created
    group = grp.getgrgid(os.getgid()).gr_name
    server = await _serve(path, make_servicer(), socket_group=group)
    st = path.stat()
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == os.getgid()
    await server.stop(0)
    assert not path.exists()
    await server.stop(0)  # twice is fine


async def test_missing_group_is_a_clear_error_and_binds_nothing(sock_dir: Path) -> None:
    path = sock_dir / "gpud.sock"
    server = ApiServer(
        path, socket_group="no-such-group-gpud", servicers=[make_servicer().register]
    )
    with pytest.raises(ConfigError, match=r"no-such-group-gpud.*does not exist"):
        await server.start()
    assert not path.exists()


async def test_stale_socket_is_replaced(sock_dir: Path) -> None:
    path = sock_dir / "gpud.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))
    dead.close()  # the file stays, nobody listens: a daemon that died
    server = await _serve(path, make_servicer())
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        resp = await pb_grpc.NodeStub(ch).GetStatus(pb.GetStatusRequest())
    assert resp.hostname == "node-a"
    await server.stop(0)


async def test_refuses_to_steal_a_live_socket(sock_dir: Path) -> None:
    path = sock_dir / "gpud.sock"
    first = await _serve(path, make_servicer())
    second = ApiServer(path, servicers=[make_servicer().register])
    with pytest.raises(FailedPrecondition, match="already running"):
        await second.start()
    assert path.exists()  # the first one's socket is untouched
    await first.stop(0)


async def test_refuses_to_replace_a_regular_file(sock_dir: Path) -> None:
    path = sock_dir / "gpud.sock"
    path.write_text("not a socket")
    with pytest.raises(FailedPrecondition, match="not a socket"):
        await ApiServer(path).start()
    assert path.read_text() == "not a socket"


async def test_a_removed_socket_is_bound_again(sock_dir: Path) -> None:
    """``rm`` of the socket (or of its directory) while gpud runs: the next keep_socket
    binds it again, 0660, so that a new gpuctl reaches gpud; a connection made before keeps
    its server until the stop, which removes the new socket."""
    path = sock_dir / "run" / "gpud.sock"
    server = await _serve(path, make_servicer())
    assert not await server.keep_socket()  # in place: nothing to do
    async with grpc.aio.insecure_channel(f"unix:{path}") as before:
        await pb_grpc.NodeStub(before).GetStatus(pb.GetStatusRequest())
        path.unlink()
        path.parent.rmdir()
        assert await server.keep_socket()
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        async with grpc.aio.insecure_channel(f"unix:{path}") as after:
            resp = await pb_grpc.NodeStub(after).GetStatus(pb.GetStatusRequest())
        assert resp.hostname == "node-a"
        resp = await pb_grpc.NodeStub(before).GetStatus(pb.GetStatusRequest())
        assert resp.hostname == "node-a"
    await server.stop(0)
    assert not path.exists()


def _listeners(directory: Path) -> int:
    """Unix sockets of this process listening on a name in ``directory`` (its file removed
    or not)."""
    ours = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                ours.add(target[len("socket:[") : -1])
    count = 0
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            fields = line.split()
            # Num RefCount Protocol Flags Type St Inode Path; Flags 00010000: listening
            if len(fields) == 8 and fields[3] == "00010000" and fields[6] in ours:
                count += fields[7].startswith(f"{directory}/")
    return count


async def test_a_socket_removed_again_and_again_keeps_one_retired_server(
    sock_dir: Path,
) -> None:
    """A cleaner that removes the socket over and over: each removal binds it again, and
    the server retired the time before stops, so listeners do not pile up until gpud stops."""
    path = sock_dir / "gpud.sock"
    server = await _serve(path, make_servicer())
    for _ in range(5):
        path.unlink()
        assert await server.keep_socket()
    for _ in range(100):  # the older ones stop in the background
        if _listeners(sock_dir) <= 2:
            break
        await asyncio.sleep(0.02)
    # the one on the file and the one retired last
    assert _listeners(sock_dir) == 2
    assert sorted(p.name for p in sock_dir.iterdir()) == ["gpud.sock"]
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        resp = await pb_grpc.NodeStub(ch).GetStatus(pb.GetStatusRequest())
    assert resp.hostname == "node-a"
    await server.stop(0)
    assert _listeners(sock_dir) == 0 and not path.exists()


async def test_keep_socket_leaves_another_file_in_its_place(sock_dir: Path) -> None:
    path = sock_dir / "gpud.sock"
    server = await _serve(path, make_servicer())
    path.unlink()
    path.write_text("an operator's")
    assert not await server.keep_socket()
    await server.stop(0)
    assert path.read_text() == "an operator's"


async def _said_once(server: ApiServer, caplog: pytest.LogCaptureFixture) -> str:
    """What two passes that find the socket's path taken say in the log: one line."""
    with caplog.at_level(logging.WARNING, logger="gpud.api.server"):
        assert not await server.keep_socket()
        assert not await server.keep_socket()
    (said,) = caplog.records
    return said.getMessage()


async def test_a_directory_made_in_the_sockets_place_is_said_once_in_the_log(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The socket removed and a directory made at its path while gpud runs: left alone,
    but said once, for ``gpuctl`` then says gpud is not running; once it is gone the
    socket is bound again."""
    path = sock_dir / "gpud.sock"
    server = await _serve(path, make_servicer())
    try:
        path.unlink()
        path.mkdir()
        assert await _said_once(server, caplog) == (
            f"the socket {path} was replaced by a directory while gpud ran: gpuctl cannot "
            "reach gpud (it says gpud is not running) until that is removed; gpud then "
            "listens there again"
        )
        path.rmdir()
        assert await server.keep_socket()
    finally:
        await server.stop(0)


def _on_inode(st: os.stat_result, kind: int) -> os.stat_result:
    """``st`` as ``lstat`` gives it once ext4 handed its inode to a file of another ``kind``
    (``stat.S_IFDIR``, ``stat.S_IFREG``): no test filesystem can be made to reuse one."""
    fields = list(st[:10])
    fields[0] = kind | 0o644
    return os.stat_result(fields)


async def test_what_takes_the_sockets_place_on_one_inode_is_said_for_each_kind(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory made at the socket's path, removed, and a file made there on the same
    inode before a pass saw the path empty: each is said."""
    path = sock_dir / "gpud.sock"
    server = await _serve(path, make_servicer())
    try:
        path.unlink()
        path.mkdir()
        with caplog.at_level(logging.WARNING, logger="gpud.api.server"):
            assert not await server.keep_socket()
            server._say_taken(path, _on_inode(path.lstat(), stat.S_IFREG))
        said = [r.getMessage() for r in caplog.records]
        assert [m.split(" while ")[0] for m in said] == [
            f"the socket {path} was replaced by a directory",
            f"the socket {path} was replaced by a regular file",
        ]
        path.rmdir()
    finally:
        await server.stop(0)


async def test_gpuds_socket_put_back_lets_what_takes_its_place_later_be_said(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """gpud's socket moved away, a directory made at its path, removed, the socket moved
    back; later a directory on that same inode takes the path again: said again."""
    path, away = sock_dir / "gpud.sock", sock_dir / "moved.sock"
    server = await _serve(path, make_servicer())
    try:
        path.rename(away)
        path.mkdir()
        with caplog.at_level(logging.WARNING, logger="gpud.api.server"):
            assert not await server.keep_socket()
            directory = path.lstat()
            path.rmdir()
            away.rename(path)
            assert not await server.keep_socket()  # gpud's own, left as it is
            server._say_taken(path, directory)  # the next directory, on the same inode
        assert len(caplog.records) == 2
        assert caplog.records[1].getMessage() == caplog.records[0].getMessage()
    finally:
        await server.stop(0)


async def test_a_socket_of_another_process_in_the_sockets_place_is_said_as_such(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process's socket bound at the path: gpuctl reaches that process, which
    the warning says (not that gpud seems to be down)."""
    path = sock_dir / "gpud.sock"
    server = await _serve(path, make_servicer())
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        path.unlink()
        other.bind(os.fsencode(path))
        other.listen()
        assert await _said_once(server, caplog) == (
            f"the socket {path} was replaced by a socket gpud did not bind while gpud ran: "
            "gpuctl reaches whatever listens on that one, not this gpud (with nothing "
            "listening, it says gpud is not running), until that is removed; gpud then "
            "listens there again"
        )
    finally:
        other.close()
        await server.stop(0)
    assert path.exists()  # gpud's stop leaves the other process's socket alone
    path.unlink()


async def test_health_serving_and_not_serving(sock_dir: Path) -> None:
    path = sock_dir / "gpud.sock"
    server = await _serve(path, make_servicer())
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        check = health_pb2_grpc.HealthStub(ch).Check
        resp = await check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        await server.set_serving(False)
        resp = await check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
    await server.stop(0)


async def test_tcp_listener(sock_dir: Path) -> None:
    server = await _serve(sock_dir / "gpud.sock", make_servicer(), tcp_address="127.0.0.1:0")
    assert server.tcp_port
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.tcp_port}") as ch:
        resp = await pb_grpc.NodeStub(ch).GetStatus(pb.GetStatusRequest())
    assert resp.gpu_count == 3
    await server.stop(0)


def _closed_within(port: int, sent: bytes, seconds: float) -> bool:
    """Whether gpud closes a TCP connection that sent ``sent`` and then nothing."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(sent)
        conn.settimeout(seconds)
        try:
            while conn.recv(4096):  # its SETTINGS, then GOAWAY
                pass
        except TimeoutError:
            return False
        return True


async def test_connections_left_doing_nothing_are_closed(sock_dir: Path) -> None:
    # A descriptor each: thousands held open on api.tcp_address left gpud none to accept
    # gpuctl on its socket with.
    server = await _serve(
        sock_dir / "gpud.sock",
        make_servicer(),
        tcp_address="127.0.0.1:0",
        handshake_timeout_s=0.5,
        idle_timeout_s=1.0,
    )
    assert server.tcp_port
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    settings = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # empty SETTINGS: handshake done
    for sent in (b"", preface[:10], preface + settings):
        assert await asyncio.to_thread(_closed_within, server.tcp_port, sent, 5.0), sent
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.tcp_port}") as ch:
        await pb_grpc.NodeStub(ch).GetStatus(pb.GetStatusRequest())
        await asyncio.sleep(1.5)  # closed as idle: the next call reconnects by itself
        resp = await pb_grpc.NodeStub(ch).GetStatus(pb.GetStatusRequest())
    assert resp.gpu_count == 3
    await server.stop(0)


async def test_calls_held_open_over_tcp_are_bounded_and_never_take_the_sockets(
    sock_dir: Path,
) -> None:
    path = sock_dir / "gpud.sock"
    server = await _serve(path, make_servicer(), tcp_address="127.0.0.1:0", tcp_max_calls=2)
    request = health_pb2.HealthCheckRequest(service="")
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{server.tcp_port}") as tcp,
        grpc.aio.insecure_channel(f"unix:{path}") as unix,
    ):
        held = [health_pb2_grpc.HealthStub(tcp).Watch(request) for _ in range(2)]
        for stream in held:
            await stream.read()  # open on the server
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.NodeStub(tcp).GetStatus(pb.GetStatusRequest())
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        on_socket = [health_pb2_grpc.HealthStub(unix).Watch(request) for _ in range(3)]
        for stream in on_socket:
            await stream.read()
        resp = await pb_grpc.NodeStub(unix).GetStatus(pb.GetStatusRequest())
        assert resp.gpu_count == 3
        for stream in [*held, *on_socket]:
            stream.cancel()
    await server.stop(0)


@pytest.mark.parametrize("access", ["read", "full"])
async def test_tcp_serves_calls_that_change_the_node_only_when_told(
    sock_dir: Path, access: TcpAccess
) -> None:
    """The unix socket's mode and group decide who may change the node; TCP has no such
    check, so by default it answers reads and jobs' own reports only."""
    faults = FakeFaults()
    path = sock_dir / "gpud.sock"
    server = await _serve(
        path, make_servicer(faults=faults), tcp_address="127.0.0.1:0", tcp_access=access
    )
    fault = pb.InjectFaultRequest(gpu=0, kind=pb.FAULT_KIND_LOST)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.tcp_port}") as ch:
        node = pb_grpc.NodeStub(ch)
        assert (await node.ListGpus(pb.ListGpusRequest())).gpus  # a read
        if access == "read":
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await node.InjectFault(fault)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert refused.value.details() == (
                f"InjectFault changes the node's state and is served on gpud's unix socket"
                f" ({path}) only: over TCP (api.tcp_address) gpud answers reads and jobs'"
                ' own reports (api.tcp_access = "read"; "full" serves every call there)'
            )
            assert faults.calls == []
        else:
            await node.InjectFault(fault)
            assert len(faults.calls) == 1
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        await pb_grpc.NodeStub(ch).InjectFault(fault)  # the socket serves every call
    assert len(faults.calls) == (1 if access == "read" else 2)
    await server.stop(0)


def test_the_tcp_read_methods_are_methods_of_the_api() -> None:
    """Each method TCP serves under "read" exists (a renamed one would be refused there),
    and none of them changes state by its name."""
    names = ("cluster", "colo", "jobs", "mig", "mps", "net", "node", "queue")
    methods = {
        f"/{service.full_name}/{method.name}"
        for module in (importlib.import_module(f"gpud.v1.{name}_pb2") for name in names)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    ours = {m for m in TCP_READ_METHODS if m.startswith("/gpud.")}
    assert ours <= methods, ours - methods
    changing = ("Add", "Remove", "Reserve", "Release", "Apply", "Set", "Pin", "Place", "Inject")
    assert not [m for m in ours if m.rsplit("/", 1)[1].startswith(changing)]


# --- Node service ---


async def test_status(channel: grpc.aio.Channel) -> None:
    resp = await pb_grpc.NodeStub(channel).GetStatus(pb.GetStatusRequest())
    assert resp.version
    assert (resp.hostname, resp.backend, resp.driver_version) == ("node-a", "sim", "550.54.15")
    assert resp.simulated
    assert resp.uptime_seconds == 3725.0
    assert (resp.gpu_count, resp.healthy_gpu_count) == (3, 2)
    assert resp.last_sample_age_seconds == 0.5
    assert resp.last_tick_seconds == pytest.approx(0.012)


async def test_status_before_first_sample(sock_dir: Path) -> None:
    path = sock_dir / "gpud.sock"
    server = await _serve(path, make_servicer(snapshot=lambda: None))
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        stub = pb_grpc.NodeStub(ch)
        resp = await stub.GetStatus(pb.GetStatusRequest())
        assert not resp.HasField("last_sample_age_seconds")
        assert resp.healthy_gpu_count == 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListGpus(pb.ListGpusRequest())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no telemetry sample yet" in (err.value.details() or "")
    assert _md(err.value)[EXIT_CODE_KEY] == "3"
    await server.stop(0)


async def test_list_gpus(channel: grpc.aio.Channel) -> None:
    resp = await pb_grpc.NodeStub(channel).ListGpus(pb.ListGpusRequest())
    assert [g.index for g in resp.gpus] == [0, 1, 2]
    assert resp.sample_age_seconds == 0.5
    full, with_mig, lost = resp.gpus
    assert full.uuid.startswith("GPU-00000000")
    assert full.memory.used_bytes == 20 * 1024**3
    assert full.utilization.gpu_ratio == 0.5
    assert full.power_watts == 312.5
    assert (full.clocks.sm_mhz, full.ecc.corrected, full.pcie.rx_bytes_per_second) == (1980, 1, 2e9)
    assert full.last_xid == 79
    assert full.sample_age_seconds == 0.25
    assert not full.processes[0].HasField("used_memory_bytes")  # the driver did not say
    # not supported is absent, not 0
    assert not with_mig.HasField("power_watts")
    assert not with_mig.HasField("utilization")
    assert with_mig.HasField("temperature_celsius")
    assert with_mig.mig_mode.current and with_mig.mig_mode.pending
    assert [(d.gpu, d.mig, d.profile_name) for d in with_mig.mig_devices] == [
        (1, 0, "1g.10gb"),
        (1, 1, "1g.10gb"),
    ]
    assert with_mig.mig_devices[0].memory.used_bytes == 2 * 1024**3
    assert not with_mig.mig_devices[1].HasField("memory")
    assert with_mig.mig_devices[0].processes[0].gpu_instance_id == 7
    assert not lost.healthy and lost.reason == "GPU lost"
    assert not lost.HasField("memory") and not lost.HasField("last_xid")
    assert lost.sample_age_seconds == 30.0
    # processes not listed are unknown, with why, not "none run"
    assert full.processes_unknown == ""
    assert "Not Supported" in with_mig.processes_unknown and not with_mig.processes
    assert with_mig.mig_devices[0].processes_unknown == ""
    assert lost.processes_unknown == "GPU lost"


async def test_list_one_gpu_and_bad_indexes(channel: grpc.aio.Channel) -> None:
    stub = pb_grpc.NodeStub(channel)
    resp = await stub.ListGpus(pb.ListGpusRequest(gpu=1))
    assert [g.index for g in resp.gpus] == [1]
    cases = (
        (-1, ">= 0", "INVALID_ARGUMENT", "InvalidArgument", "2"),
        (3, "no GPU 3", "NOT_FOUND", "NotFound", "4"),
        (2**31 - 1, "no GPU", "NOT_FOUND", "NotFound", "4"),
    )
    for bad, words, code, error, exit_code in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListGpus(pb.ListGpusRequest(gpu=bad))
        assert err.value.code() == grpc.StatusCode[code]
        details = err.value.details() or ""
        assert details.startswith("gpu: ") and words in details
        assert _md(err.value) == {ERROR_KEY: error, EXIT_CODE_KEY: exit_code}


async def test_list_events(channel: grpc.aio.Channel) -> None:
    stub = pb_grpc.NodeStub(channel)
    resp = await stub.ListEvents(pb.ListEventsRequest())
    assert [e.kind for e in resp.events] == ["gpu.unhealthy", "mig.apply", "gpu.healthy"]
    first = resp.events[0]
    assert first.time_unix_seconds == 1_700_000_000
    assert first.fields["gpu"] == 2 and first.fields["path"] == "/x"  # non-JSON -> str
    resp = await stub.ListEvents(pb.ListEventsRequest(kind_prefix="gpu.", limit=1))
    assert [e.message for e in resp.events] == ["GPU 2 back"]
    for bad in (-1, 10_001):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListEvents(pb.ListEventsRequest(limit=bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith("limit: ")


async def test_list_events_about_a_gpu_or_a_job(sock_dir: Path) -> None:
    """``gpu`` and ``job`` keep the events about them, of every kind, before ``limit``
    counts; events written before a field was added match by the fields they carry."""
    log = EventLog(None)
    log.emit("gpu.unhealthy", "GPU 1 lost", gpu=1, uuid="GPU-1")
    log.emit("job.gpu_unhealthy", "older: no uuid", job="a", gpu=1, reservation="r1")
    log.emit("job.reserve", "a", job="a", reservation="r1", devices=["MIG-1a", "GPU-2"])
    log.emit("mps.start", "MIG", gpu=1, uuid="MIG-1a", mig=0, gpu_uuid="GPU-1", mig_uuid="MIG-1a")
    log.emit("mig.apply", "apply", config="c", result="success", gpus={1: "applied"})
    log.emit("gpu.recovered", "GPU 0 back", gpu=0, uuid="GPU-0")
    log.emit("job.add", "b", job="b")
    log.emit("job.release", "a gone", job="a", reservation="r1", gpus=[1, 2])
    path = sock_dir / "gpud.sock"
    server = await _serve(path, make_servicer(events=log))
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        stub = pb_grpc.NodeStub(ch)

        async def messages(**request: object) -> list[str]:
            resp = await stub.ListEvents(pb.ListEventsRequest(**request))  # type: ignore[arg-type]
            return [e.message for e in resp.events]

        assert await messages(gpu="1") == [
            "GPU 1 lost",
            "older: no uuid",
            "MIG",
            "apply",
            "a gone",
        ]
        assert await messages(gpu="2") == ["a gone"]  # the older job.reserve: by UUID alone
        assert await messages(gpu="GPU-1") == ["GPU 1 lost", "MIG"]
        assert await messages(gpu="MIG-1a") == ["a", "MIG"]
        assert await messages(gpu="1", limit=1) == ["a gone"]
        assert await messages(job="a") == ["older: no uuid", "a", "a gone"]
        assert await messages(job="a", gpu="1", kind_prefix="job.") == [
            "older: no uuid",
            "a gone",
        ]
        assert await messages(gpu="7") == []
    await server.stop(0)


async def test_inject_fault_refused_when_not_simulated(sock_dir: Path) -> None:
    path = sock_dir / "gpud.sock"
    server = await _serve(path, make_servicer(faults=None))
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.NodeStub(ch).InjectFault(
                pb.InjectFaultRequest(gpu=0, kind=pb.FAULT_KIND_LOST)
            )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "node is not simulated" in (err.value.details() or "")
    await server.stop(0)


async def test_inject_faults(sock_dir: Path) -> None:
    path = sock_dir / "gpud.sock"
    faults, events = FakeFaults(), EventLog(None)
    server = await _serve(path, make_servicer(faults=faults, events=events))
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        inject = pb_grpc.NodeStub(ch).InjectFault
        await inject(pb.InjectFaultRequest(gpu=0, kind=pb.FAULT_KIND_LOST))
        await inject(pb.InjectFaultRequest(gpu=2, kind=pb.FAULT_KIND_RESET_REQUIRED))
        await inject(pb.InjectFaultRequest(gpu=1, kind=pb.FAULT_KIND_NOT_SUPPORTED, field="power"))
        await inject(pb.InjectFaultRequest(gpu=1, kind=pb.FAULT_KIND_SLOW, seconds=2.5))
        await inject(pb.InjectFaultRequest(gpu=0, kind=pb.FAULT_KIND_SLOW_MIG, seconds=0.2))
        await inject(pb.InjectFaultRequest(gpu=2, kind=pb.FAULT_KIND_XID, xid=79))
        await inject(pb.InjectFaultRequest(gpu=2, kind=pb.FAULT_KIND_ERROR, field="mig_memory"))
        resp = await inject(pb.InjectFaultRequest(gpu=0, kind=pb.FAULT_KIND_CLEAR))
    assert faults.calls == [
        ("lose", 0),
        ("reset_required", 2),
        ("not_supported", 1, "power"),
        ("slow", 1, 2.5),
        ("slow_mig", 0, 0.2),
        ("xid", 2, 79),
        ("error", 2, "mig_memory"),
        ("clear", 0),
    ]
    assert list(resp.active_faults) == [
        "lose on GPU 0",
        "reset_required on GPU 2",
        "not_supported on GPU 1",
        "slow on GPU 1",
        "slow_mig on GPU 0",
        "xid on GPU 2",
        "error on GPU 2",
    ]
    kinds = [e.kind for e in events.recent()]
    assert kinds == [
        "sim.fault.lost",
        "sim.fault.reset_required",
        "sim.fault.not_supported",
        "sim.fault.slow",
        "sim.fault.slow_mig",
        "sim.fault.xid",
        "sim.fault.error",
        "sim.fault.clear",
    ]
    # the GPU by index and UUID, as every event about a GPU names it
    assert events.recent()[4].fields == {"gpu": 0, "uuid": identity(0).uuid, "seconds": 0.2}
    assert events.recent()[5].fields == {"gpu": 2, "uuid": identity(2).uuid, "xid": 79}
    await server.stop(0)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.InjectFaultRequest(gpu=-1, kind=pb.FAULT_KIND_LOST), "gpu"),
        (pb.InjectFaultRequest(gpu=0), "kind"),
        (pb.InjectFaultRequest(gpu=0, kind=42), "kind"),  # type: ignore[arg-type]
        (pb.InjectFaultRequest(gpu=0, kind=pb.FAULT_KIND_XID), "xid"),
        (pb.InjectFaultRequest(gpu=0, kind=pb.FAULT_KIND_SLOW, seconds=-1), "seconds"),
        (pb.InjectFaultRequest(gpu=0, kind=pb.FAULT_KIND_SLOW, seconds=math.nan), "seconds"),
        (pb.InjectFaultRequest(gpu=0, kind=pb.FAULT_KIND_SLOW, seconds=math.inf), "seconds"),
        (pb.InjectFaultRequest(gpu=0, kind=pb.FAULT_KIND_NOT_SUPPORTED), "field"),
        (pb.InjectFaultRequest(gpu=0, kind=pb.FAULT_KIND_NOT_SUPPORTED, field="x" * 300), "field"),
        (pb.InjectFaultRequest(gpu=0, kind=pb.FAULT_KIND_ERROR), "field"),
    ],
)
async def test_inject_fault_invalid_arguments_name_the_field(
    channel: grpc.aio.Channel, request_: pb.InjectFaultRequest, field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pb_grpc.NodeStub(channel).InjectFault(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(f"{field}: ")
    assert channel.faults.calls == []  # type: ignore[attr-defined]


async def test_inject_fault_unknown_gpu_is_not_found(channel: grpc.aio.Channel) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pb_grpc.NodeStub(channel).InjectFault(
            pb.InjectFaultRequest(gpu=7, kind=pb.FAULT_KIND_LOST)
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert (err.value.details() or "").startswith("gpu: no GPU 7")
    assert channel.faults.calls == []  # type: ignore[attr-defined]


# --- nothing a client sends can crash the daemon ---


async def test_driver_error_from_fault_port_maps_to_its_status(sock_dir: Path) -> None:
    path = sock_dir / "gpud.sock"
    faults = FakeFaults(fail=GpuLost("GPU 0 fell off the bus", gpu=0))
    server = await _serve(path, make_servicer(faults=faults))
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.NodeStub(ch).InjectFault(pb.InjectFaultRequest(gpu=0, kind=1))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _md(err.value) == {ERROR_KEY: "GpuLost", EXIT_CODE_KEY: "10"}
    await server.stop(0)


async def test_unexpected_errors_are_internal_and_the_server_keeps_serving(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = sock_dir / "gpud.sock"
    calls = 0

    def flaky() -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("sampler exploded")
        return None

    server = await _serve(path, make_servicer(snapshot=flaky))
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        stub = pb_grpc.NodeStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetStatus(pb.GetStatusRequest())
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "RuntimeError: sampler exploded" in (err.value.details() or "")
        assert EXIT_CODE_KEY not in _md(err.value)
        assert (await stub.GetStatus(pb.GetStatusRequest())).gpu_count == 3
    assert "unexpected error" in caplog.text
    await server.stop(0)


async def test_garbage_bytes_never_crash_the_server(channel: grpc.aio.Channel) -> None:
    rng = random.Random(20240601)
    methods = ["GetStatus", "ListGpus", "ListEvents", "InjectFault", "NoSuchMethod"]
    codes: set[grpc.StatusCode] = set()
    for name in methods:
        raw = channel.unary_unary(f"/gpud.v1.Node/{name}")  # bytes in, bytes out
        for _ in range(60):
            payload = rng.randbytes(rng.randrange(0, 64))
            try:
                await raw(payload, timeout=5)
                codes.add(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as err:
                codes.add(err.code())
    # every answer is a status, never a hang or a dead server; undecodable bytes are the
    # client's fault (INVALID_ARGUMENT), not the daemon's (INTERNAL)
    assert codes <= {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAVAILABLE,
    }
    assert grpc.StatusCode.INVALID_ARGUMENT in codes
    resp = await pb_grpc.NodeStub(channel).GetStatus(pb.GetStatusRequest())
    assert resp.gpu_count == 3


async def test_undecodable_request_names_the_request(channel: grpc.aio.Channel) -> None:
    raw = channel.unary_unary("/gpud.v1.Node/ListGpus")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw(b"\xff\xff\xff")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("request: cannot decode")


async def test_extreme_values_are_refused_not_crashed(channel: grpc.aio.Channel) -> None:
    stub = pb_grpc.NodeStub(channel)
    for request in (
        pb.InjectFaultRequest(gpu=-(2**31), kind=pb.FAULT_KIND_LOST),
        pb.InjectFaultRequest(gpu=0, kind=pb.FAULT_KIND_SLOW, seconds=-math.inf),
        pb.InjectFaultRequest(gpu=0, kind=-5),  # type: ignore[arg-type]
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.InjectFault(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ListEvents(pb.ListEventsRequest(kind_prefix="k" * 100_000))
    assert (err.value.details() or "").startswith("kind_prefix: ")


@pytest.mark.parametrize("prefix", ["\x00\uffff" * 100, "a\nb", "gpu.\x1b[2J"])
async def test_a_kind_prefix_no_event_kind_can_start_with_is_refused_not_listed_empty(
    channel: grpc.aio.Channel, prefix: str
) -> None:
    # kinds are printable: a listing filtered by a control character would be empty without
    # saying why, and a watch would wait for ever
    stub = pb_grpc.NodeStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as listed:
        await stub.ListEvents(pb.ListEventsRequest(kind_prefix=prefix))
    with pytest.raises(grpc.aio.AioRpcError) as watched:
        # a deadline: a watch gpud took would wait for an event for ever
        watch = stub.WatchEvents(pb.WatchEventsRequest(kind_prefix=prefix), timeout=20)
        async for _ in watch:
            pass
    for err in (listed, watched):
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details() or ""
        assert details.startswith("kind_prefix: ") and "only printable characters" in details


async def test_servicer_without_event_log(sock_dir: Path) -> None:
    path = sock_dir / "gpud.sock"
    servicer = NodeServicer(
        snapshots=lambda: None,
        node_info=node_info,
    )
    server = await _serve(path, servicer)
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        resp = await pb_grpc.NodeStub(ch).ListEvents(pb.ListEventsRequest())
    assert list(resp.events) == []
    await server.stop(0)


async def test_clearing_an_xid_writes_its_state_off_the_event_loop(sock_dir: Path) -> None:
    """Clearing saves the XID state file, flushed to disk: a slow disk must not stall every
    other call meanwhile."""
    loop_thread = threading.get_ident()
    cleared_on: list[int] = []

    def clear_xid(gpu: int, xid: int | None) -> ClearedXids:
        cleared_on.append(threading.get_ident())
        return ClearedXids((79,), ())

    servicer = NodeServicer(snapshots=lambda: None, node_info=node_info, clear_xid=clear_xid)
    path = sock_dir / "gpud.sock"
    server = await _serve(path, servicer)
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        resp = await pb_grpc.NodeStub(ch).ClearXid(pb.ClearXidRequest(gpu=0))
    await server.stop(0)
    assert resp.cleared_xid == 79 and cleared_on and cleared_on[0] != loop_thread


async def test_clearing_one_xid_code_says_which_are_left(sock_dir: Path) -> None:
    asked: list[tuple[int, int | None]] = []

    def clear_xid(gpu: int, xid: int | None) -> ClearedXids:
        asked.append((gpu, xid))
        return ClearedXids((xid,), (48,)) if xid == 79 else ClearedXids((), (79, 48))

    servicer = NodeServicer(snapshots=lambda: None, node_info=node_info, clear_xid=clear_xid)
    path = sock_dir / "gpud.sock"
    server = await _serve(path, servicer)
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        stub = pb_grpc.NodeStub(ch)
        one = await stub.ClearXid(pb.ClearXidRequest(gpu=1, xid=79))
        other = await stub.ClearXid(pb.ClearXidRequest(gpu=1, xid=13))
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.ClearXid(pb.ClearXidRequest(gpu=1, xid=0))
    await server.stop(0)
    assert asked == [(1, 79), (1, 13)]
    assert (list(one.cleared_xids), list(one.remaining_xids), one.cleared_xid) == ([79], [48], 79)
    assert list(other.cleared_xids) == [] and not other.HasField("cleared_xid")
    assert list(other.remaining_xids) == [79, 48]
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_make_events_fixture_is_ordered() -> None:
    assert [e.time for e in make_events().recent()] == sorted(
        e.time for e in make_events().recent()
    )


# --- with the simulated node's own fault injector ---


async def test_faults_reach_the_simulated_node(sock_dir: Path) -> None:
    sim = pytest.importorskip("gpud.backend.sim")
    node = sim.SimNode([("H100-SXM5-80GB", 3)])
    port: FaultPort = node.faults  # the sim's injector is a FaultPort
    servicer = NodeServicer(
        snapshots=lambda: None,
        node_info=lambda: node_info(simulated=True),
        faults=port,
    )
    path = sock_dir / "gpud.sock"
    server = await _serve(path, servicer)
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        inject = pb_grpc.NodeStub(ch).InjectFault
        await inject(pb.InjectFaultRequest(gpu=1, kind=pb.FAULT_KIND_LOST))
        resp = await inject(
            pb.InjectFaultRequest(gpu=2, kind=pb.FAULT_KIND_NOT_SUPPORTED, field="power")
        )
        assert list(resp.active_faults) == [
            "GPU 1: lost=True",
            "GPU 2: not_supported=['power']",
        ]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await inject(
                pb.InjectFaultRequest(gpu=0, kind=pb.FAULT_KIND_NOT_SUPPORTED, field="colour")
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith("field: unknown field 'colour'")
        resp = await inject(pb.InjectFaultRequest(gpu=1, kind=pb.FAULT_KIND_CLEAR))
        assert list(resp.active_faults) == ["GPU 2: not_supported=['power']"]
    await server.stop(0)


async def test_a_fault_injected_before_the_first_sample_is_answered_and_logged(
    sock_dir: Path,
) -> None:
    """The fault is in before the event names its GPU's UUID: with no sample yet there is
    none to name, and the call still says it was done (a retry would inject it twice)."""
    path = sock_dir / "gpud.sock"
    faults, events = FakeFaults(), EventLog(None)
    server = await _serve(path, make_servicer(snapshot=lambda: None, faults=faults, events=events))
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        inject = pb_grpc.NodeStub(ch).InjectFault
        resp = await inject(pb.InjectFaultRequest(gpu=2, kind=pb.FAULT_KIND_XID, xid=79))
    await server.stop(0)
    assert faults.calls == [("xid", 2, 79)] and list(resp.active_faults) == ["xid on GPU 2"]
    (event,) = [e for e in events.recent() if e.kind == "sim.fault.xid"]
    assert event.fields["gpu"] == 2 and event.fields["uuid"] == ""


async def _stop_beside(old: ApiServer, new: ApiServer, path: Path) -> None:
    """Stop ``old``: ``new`` still serves on ``path``."""
    await old.stop(0)
    assert stat.S_ISSOCK(path.stat().st_mode)
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        resp = await pb_grpc.NodeStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)
    assert resp.hostname == "node-a"
    await new.stop(0)


async def test_a_stop_leaves_a_newer_gpuds_socket_alone(sock_dir: Path) -> None:
    """The run directory removed and made again while gpud runs, and a second gpud bound in
    it (a restart that overlaps the old one's stop): the old one's stop leaves the new
    socket in place, reachable; it removes only the file it bound itself."""
    path = sock_dir / "run" / "gpud.sock"
    old = await _serve(path, make_servicer())
    path.unlink()
    path.parent.rmdir()
    new = await _serve(path, make_servicer())
    await _stop_beside(old, new, path)
    assert not path.exists()  # its own, the new one removes


async def test_a_stop_after_a_rebind_leaves_a_newer_gpuds_socket_alone(sock_dir: Path) -> None:
    """The same after the socket was bound again once (keep_socket): neither the first
    server nor the one bound again removes another gpud's socket as they stop."""
    path = sock_dir / "gpud.sock"
    old = await _serve(path, make_servicer())
    path.unlink()
    assert await old.keep_socket()
    path.unlink()
    new = await _serve(path, make_servicer())
    await _stop_beside(old, new, path)


class _UnbindableServer(ApiServer):
    """An ApiServer whose unix binds fail as grpcio says it: a RuntimeError from
    add_insecure_port (no reason given), not a port 0; from the start, or once ``fail``."""

    fail = True

    def _new_server(self, max_calls: int | None, options: Any = ()) -> Any:
        server = super()._new_server(max_calls, options)
        tcp_bind = server.add_insecure_port

        def add_insecure_port(address: str) -> int:
            if address.startswith("unix:") and self.fail:
                raise RuntimeError(f"Failed to bind to address {address}")
            return int(tcp_bind(address))

        server.add_insecure_port = add_insecure_port
        return server


async def test_a_socket_that_cannot_be_bound_is_a_gpud_error_naming_it(sock_dir: Path) -> None:
    """``gpud: gRPC server cannot listen on PATH: ...`` (exit 1), never a traceback about
    a temporary file; the TCP server made beside it is stopped, nothing is left."""
    path = sock_dir / "gpud.sock"
    server = _UnbindableServer(
        path, servicers=[make_servicer().register], tcp_address="127.0.0.1:0"
    )
    with pytest.raises(GpudError, match=f"gRPC server cannot listen on {path}: cannot bind"):
        await server.start()
    assert not server.running and list(sock_dir.iterdir()) == []


async def test_a_socket_that_cannot_be_bound_again_is_a_gpud_error(sock_dir: Path) -> None:
    path = sock_dir / "gpud.sock"
    server = _UnbindableServer(path, servicers=[make_servicer().register])
    server.fail = False
    await server.start()
    try:
        path.unlink()
        server.fail = True
        with pytest.raises(GpudError, match=f"cannot listen on {path}: cannot bind"):
            await server.keep_socket()
        assert list(sock_dir.iterdir()) == []
    finally:
        await server.stop(0)


async def test_a_directory_in_the_temporary_names_place_fails_the_bind(sock_dir: Path) -> None:
    """What grpcio reports for a bind the kernel refuses (the name taken): the same error,
    the directory left alone."""
    path = sock_dir / "gpud.sock"
    n = next(copy.copy(api_server._BINDS))  # the number of the next bind
    (sock_dir / f".gpud.sock.{os.getpid()}.{n}~").mkdir()
    server = ApiServer(path, servicers=[make_servicer().register])
    with pytest.raises(GpudError, match=f"gRPC server cannot listen on {path}: cannot bind"):
        await server.start()
    assert not path.exists()


def _listening(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen()
    return sock


async def test_the_temporary_names_of_other_processes_are_theirs(sock_dir: Path) -> None:
    """Two gpuds whose ``api.socket`` is the same file: the temporary name one binds is its
    own (its pid in it), so the other never removes it, nor links it as its own socket.
    Those of processes that are gone (killed between their bind and link) are removed."""
    path = sock_dir / "gpud.sock"
    dead = _dead_pid()
    others = [
        _listening(sock_dir / ".gpud.sock.1~"),  # a name another process bound
        _listening(sock_dir / f".gpud.sock.{os.getppid()}.1~"),  # one of a live process
    ]
    _listening(sock_dir / f".gpud.sock.{dead}.1~").close()  # one of a process gone
    try:
        server = await _serve(path, make_servicer())
        await server.stop(0)
        assert {p.name for p in sock_dir.iterdir()} == {
            ".gpud.sock.1~",
            f".gpud.sock.{os.getppid()}.1~",
        }
    finally:
        for sock in others:
            sock.close()


async def test_old_temporary_names_nothing_listens_on_are_removed(sock_dir: Path) -> None:
    """``.gpud.sock.N~`` (older gpuds' temporary names, without a pid) left by a crash are
    removed when they are sockets of gpud's user that nothing listens on; one still bound,
    a file of another kind, and another user's are left alone."""
    path = sock_dir / "gpud.sock"
    _listening(sock_dir / ".gpud.sock.3~").close()  # bound by a gpud that died
    _listening(sock_dir / ".gpud.sock.4~").close()
    served = _listening(sock_dir / ".gpud.sock.5~")
    (sock_dir / ".gpud.sock.6~").write_text("")  # not a socket
    (sock_dir / ".gpud.sock.x~").mkdir()  # not a name of gpud's
    try:
        # a uid other than the files': another user's sockets stay
        api_server._clear_stale_temps(path, euid=os.geteuid() + 1)
        assert {p.name for p in sock_dir.iterdir()} == {
            ".gpud.sock.3~",
            ".gpud.sock.4~",
            ".gpud.sock.5~",
            ".gpud.sock.6~",
            ".gpud.sock.x~",
        }
        server = await _serve(path, make_servicer())
        await server.stop(0)
        assert {p.name for p in sock_dir.iterdir()} == {
            ".gpud.sock.5~",
            ".gpud.sock.6~",
            ".gpud.sock.x~",
        }
    finally:
        served.close()


def _dead_pid() -> int:
    """The pid of a process that ended."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


async def test_a_socket_directory_every_user_may_write_to_is_refused_at_start(
    sock_dir: Path,
) -> None:
    """As when the socket is bound again (:meth:`ApiServer.keep_socket`): one could plant a
    link where gpud chmods. A ConfigError naming the key; nothing bound there."""
    run = sock_dir / "run"
    run.mkdir()
    run.chmod(0o777)
    server = ApiServer(run / "gpud.sock", servicers=[make_servicer().register])
    with pytest.raises(ConfigError, match="writable by every user") as caught:
        await server.start()
    assert caught.value.key == "api.socket"
    assert list(run.iterdir()) == []


async def test_a_socket_directory_another_user_made_again_is_not_bound_in(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The socket's directory removed, and made again by someone who lets every user
    write there: refused as at the start (one could plant a link where gpud chmods), said
    once; bound again once the directory is gpud's own."""
    run = sock_dir / "run"
    path = run / "gpud.sock"
    server = await _serve(path, make_servicer())
    try:
        path.unlink()
        run.rmdir()
        run.mkdir()
        run.chmod(0o777)
        with caplog.at_level(logging.ERROR, logger="gpud.api.server"):
            assert not await server.keep_socket()
            assert not await server.keep_socket()
        (said,) = caplog.records
        assert "writable by every user" in said.getMessage()
        assert list(run.iterdir()) == []
        run.chmod(0o711)
        assert await server.keep_socket()
    finally:
        await server.stop(0)


async def test_the_mode_is_never_set_through_a_link_in_the_sockets_place(
    sock_dir: Path,
) -> None:
    path = sock_dir / "gpud.sock"
    server = await _serve(path, make_servicer())
    target = sock_dir / "passwd"
    target.write_text("")
    target.chmod(0o600)
    try:
        path.unlink()
        path.symlink_to(target)
        with pytest.raises(OSError, match="no longer the socket gpud bound"):
            server._own_socket(None)
        assert stat.S_IMODE(target.stat().st_mode) == 0o600
    finally:
        await server.stop(0)
