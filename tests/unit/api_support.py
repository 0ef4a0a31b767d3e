"""Shared pieces for the API and gpuctl tests: a hand-built snapshot, fakes for the API's
ports, and an ApiServer running on its own event loop in a thread (so that synchronous
clients such as gpuctl can call it from the test's thread)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpud.api import ApiServer, NodeInfo, NodeServicer
from gpud.api.ports import ReloadState, StateFiles
from gpud.backend.port import (
    Clocks,
    EccCounts,
    GpuIdentity,
    MemoryInfo,
    MigDeviceIdentity,
    MigMode,
    PcieThroughput,
    ProcessInfo,
    Utilization,
)
from gpud.events import EventLog
from gpud.net.port import TrafficSummary
from gpud.telemetry.snapshot import CriticalXid, GpuSample, MigSample, Snapshot
from tools.simdaemon import kill_mps_daemons

GIB = 1024**3
NOW = 1000.0  # the fake monotonic clock


def identity(index: int, *, mig_capable: bool = True) -> GpuIdentity:
    return GpuIdentity(
        index=index,
        uuid=f"GPU-{index:08x}-1111-2222-3333-444455556666",
        name="NVIDIA H100 80GB HBM3",
        product="H100-SXM5-80GB",
        pci_bus_id=f"00000000:{0x18 + index:02X}:00.0",
        pci_device_id=0x233010DE,
        memory_total_bytes=80 * GIB,
        mig_capable=mig_capable,
    )


def mig(gpu: int, index: int) -> MigSample:
    return MigSample(
        identity=MigDeviceIdentity(
            gpu=gpu,
            mig=index,
            uuid=f"MIG-{gpu}{index}aaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
            gpu_instance_id=7 + index,
            compute_instance_id=0,
            gpu_instance_profile_id=19,
            profile_name="1g.10gb",
            memory_total_bytes=10 * GIB,
            multiprocessor_count=16,
        ),
        memory=MemoryInfo(10 * GIB, 2 * GIB, 8 * GIB) if index == 0 else None,
        processes=(ProcessInfo(pid=4242, used_memory_bytes=GIB, gpu_instance_id=7),),
        processes_read=True,
    )


def make_snapshot() -> Snapshot:
    """GPU 0: every reading. GPU 1: MIG on with two devices, power and its process list not
    supported. GPU 2: lost, identity only."""
    full = GpuSample(
        identity=identity(0),
        healthy=True,
        reason="",
        sampled_at=NOW - 0.25,
        memory=MemoryInfo(80 * GIB, 20 * GIB, 60 * GIB),
        utilization=Utilization(0.5, 0.25),
        power_watts=312.5,
        temperature_celsius=54.0,
        clocks=Clocks(1980, 2619),
        ecc=EccCounts(1, 0),
        pcie=PcieThroughput(1e9, 2e9),
        processes=(ProcessInfo(pid=100, used_memory_bytes=None),),
        processes_read=True,
        mig_mode=MigMode(current=False, pending=False),
        xid_events_total=2,
        last_xid=79,
    )
    with_mig = GpuSample(
        identity=identity(1),
        healthy=True,
        reason="",
        sampled_at=NOW - 0.25,
        memory=MemoryInfo(80 * GIB, 4 * GIB, 76 * GIB),
        temperature_celsius=40.0,
        processes_error="nvmlDeviceGetComputeRunningProcesses failed on GPU 1: Not Supported",
        mig_mode=MigMode(current=True, pending=True),
        mig_devices=(mig(1, 0), mig(1, 1)),
    )
    lost = GpuSample(
        identity=identity(2),
        healthy=False,
        reason="GPU lost",
        sampled_at=NOW - 30.0,
        # two faults: each code is its own (the second one raised 3 times, its time unknown)
        critical_xids=(
            CriticalXid(79, 1, 1_699_999_000.0, 1_699_999_000.0),
            CriticalXid(48, 3, 0.0, 0.0),
        ),
    )
    return Snapshot(
        wall_time=1_700_000_000.0,
        monotonic=NOW - 0.5,
        gpus=(full, with_mig, lost),
        tick_seconds=0.012,
    )


def node_info(
    *,
    simulated: bool = True,
    build: str = "",
    reload: ReloadState | None = None,
    state_files: StateFiles | None = None,
    watchdog_warning: str = "",
) -> NodeInfo:
    """``build`` "": a gpud older than the field, which sends none; so is ``state_files``
    None, and ``watchdog_warning`` "" (or a config whose gap fits)."""
    return NodeInfo(
        backend="sim" if simulated else "nvml",
        driver_version="550.54.15",
        gpu_count=3,
        simulated=simulated,
        started_monotonic=NOW - 3725.0,
        hostname="node-a",
        build=build,
        reload=reload,
        state_files=state_files,
        watchdog_warning=watchdog_warning,
    )


@dataclass
class FakeFaults:
    """Records injections; ``fail`` makes the next call raise it."""

    calls: list[tuple[Any, ...]] = field(default_factory=list)
    fail: BaseException | None = None

    def _record(self, *call: Any) -> None:
        if self.fail is not None:
            raise self.fail
        self.calls.append(call)

    def lose(self, gpu: int) -> None:
        self._record("lose", gpu)

    def reset_required(self, gpu: int) -> None:
        self._record("reset_required", gpu)

    def not_supported(self, gpu: int, field: str) -> None:
        self._record("not_supported", gpu, field)

    def error(self, gpu: int, reading: str) -> None:
        self._record("error", gpu, reading)

    def slow(self, gpu: int, seconds: float) -> None:
        self._record("slow", gpu, seconds)

    def slow_mig(self, gpu: int, seconds: float) -> None:
        self._record("slow_mig", gpu, seconds)

    def xid(self, gpu: int, code: int) -> None:
        self._record("xid", gpu, code)

    def clear(self, gpu: int) -> None:
        self._record("clear", gpu)

    def active(self) -> list[str]:
        return [f"{c[0]} on GPU {c[1]}" for c in self.calls if c[0] != "clear"]


def make_events() -> EventLog:
    clock = iter(range(1_700_000_000, 1_800_000_000)).__next__
    log = EventLog(None, clock=lambda: float(clock()))
    log.emit("gpu.unhealthy", "GPU 2 lost", gpu=2, uuid="GPU-2", path=Path("/x"))
    log.emit("mig.apply", "applied all-1g.10gb on GPU 1", gpu=1, devices=7)
    log.emit("gpu.healthy", "GPU 2 back", gpu=2)
    return log


@contextmanager
def short_dir() -> Iterator[Path]:
    """A short directory: unix socket paths must fit in 107 bytes. The MPS control daemons
    a gpud run there left running at its stop are killed at the end."""
    with tempfile.TemporaryDirectory(prefix="gpud-api-") as d:
        try:
            yield Path(d)
        finally:
            kill_mps_daemons(Path(d))


def make_servicer(
    *,
    snapshot: Callable[[], Snapshot | None] | None = None,
    faults: FakeFaults | None = None,
    events: EventLog | None = None,
    build: str = "",
    traffic: TrafficSummary | None = None,
    reload: ReloadState | None = None,
    state_files: StateFiles | None = None,
    watchdog_warning: str = "",
    **options: Any,
) -> NodeServicer:
    snap = make_snapshot()
    return NodeServicer(
        snapshots=snapshot or (lambda: snap),
        node_info=lambda: node_info(
            simulated=faults is not None,
            build=build,
            reload=reload,
            state_files=state_files,
            watchdog_warning=watchdog_warning,
        ),
        events=events if events is not None else make_events(),
        faults=faults,
        traffic=(lambda: traffic) if traffic is not None else None,
        clock=lambda: NOW,
        **options,
    )


class ServerThread:
    """Runs ``server`` on an event loop in a background thread."""

    def __init__(self, server: ApiServer) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def run(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self.run(self.server.start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self.server.stop(0))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


# A client's program in a fresh interpreter (gRPC not imported yet): a thread other than the
# main one (the client's sender, or the program's own importer) is held inside grpc's import,
# its module's code not run yet (its module lock held, as in a real import; the global import
# lock, which os.fork() takes, is not), while the program forks a worker, whose exit code
# says whether it did what it should (an exit of 3: it hung, its stacks dumped by the guard).
_FORK_MID_GRPC_IMPORT = """
import faulthandler, os, resource, signal, sys, threading, time

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the guard's SIGABRT leaves no core file
faulthandler.enable()  # a hung worker's stacks, on the guard's SIGABRT
sock, parent = sys.argv[1], os.getpid()
inside, gate = threading.Event(), threading.Event()


class HeldLoader:
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        if os.getpid() == parent and not inside.is_set():
            inside.set()
            gate.wait()
        self.loader.exec_module(module)


class HoldTheImport:
    def find_spec(self, name, path=None, target=None):
        if not (name == %(held)r or name.startswith(%(held)r + ".")) or os.getpid() != parent:
            return None
        if threading.current_thread() is threading.main_thread() or inside.is_set():
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = HeldLoader(spec.loader)
                return spec
        return None


sys.meta_path.insert(0, HoldTheImport())
import gpud.client

assert "grpc" not in sys.modules, "grpc imported before the client"
%(make)s
while not inside.is_set() and not (%(sent)s):  # a thread imports grpc, or the client has sent
    pass
pid = os.fork()
if pid == 0:
    %(child)s
gate.set()
for _ in range(3000):  # a hang guard: a worker stuck in an import is stopped
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        code = os.waitstatus_to_exitcode(status)
        print(f"the worker exited {code}", file=sys.stderr)
        sys.exit(code)
    time.sleep(0.01)
print("the worker hung: its stacks follow", file=sys.stderr, flush=True)
os.kill(pid, signal.SIGABRT)
os.waitpid(pid, 0)
sys.exit(3)
"""


def fork_mid_grpc_import(
    sock: Path, *, make: str, sent: str, child: str, held: str = "grpc"
) -> subprocess.CompletedProcess[str]:
    """A program that runs ``make`` (a client talking to gpud at ``sock``; it may start a
    thread that imports grpc), waits until a thread other than the main one is inside
    the import of ``held`` (grpc, or a module of it, by default) or ``sent`` holds, forks,
    and runs ``child`` (one line that exits: 0 when the worker did its part) in the worker.
    The program's exit code is the worker's (3: it hung); the program runs in its own
    session, killed whole should it hang itself."""
    script = _FORK_MID_GRPC_IMPORT % {"make": make, "sent": sent, "child": child, "held": held}
    with subprocess.Popen(
        [sys.executable, "-c", script, str(sock)],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=120)  # a guard against a hang
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"the forking program hung; its stderr:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
