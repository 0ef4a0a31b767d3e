"""Shared pieces for the MPS and jobs tests: hand-built snapshots (unequal GPUs, MIG), a
manager running the fake control daemon, and clean-up of every daemon a test started."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gpud.backend.port import GpuIdentity, MemoryInfo, MigDeviceIdentity, MigMode, ProcessInfo
from gpud.events import EventLog
from gpud.mps.manager import MpsManager
from gpud.sim_tools import FAKE_MPS_CONTROL
from gpud.store import StateStore
from gpud.telemetry.snapshot import GpuSample, MigSample, Snapshot
from tools.simdaemon import kill_mps_daemons

GIB = 1024**3
FAKE_CONTROL = (sys.executable, str(FAKE_MPS_CONTROL))


def fake_proc(root: Path, pid: int, uid: int) -> None:
    """``root/<pid>``: a process of real UID ``uid`` (``status``) that started at tick 77
    (``stat``), as gpud reads them."""
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "status").write_text(
        f"Name:\tgpuctl\nState:\tS (sleeping)\nUid:\t{uid}\t0\t{uid}\t{uid}\nGid:\t0\t0\t0\t0\n"
    )
    (root / str(pid) / "stat").write_text(f"{pid} (gpuctl) S " + " ".join(["1"] * 18) + " 77 0\n")


def gpu_uuid(index: int) -> str:
    return f"GPU-{index:08x}-1111-2222-3333-444455556666"


def mig_uuid(gpu: int, index: int) -> str:
    return f"MIG-{gpu:04x}{index:04x}-aaaa-bbbb-cccc-ddddeeeeffff"


def gpu_sample(
    index: int,
    *,
    memory_gib: int = 80,
    migs: tuple[tuple[str, int], ...] = (),
    processes: tuple[ProcessInfo, ...] = (),
    mig_processes: dict[int, tuple[ProcessInfo, ...]] | None = None,
    used_gib: int | None = None,
    processes_read: bool = True,
) -> GpuSample:
    """A GPU; with ``migs`` ((profile, memory GiB), ...) it is in MIG mode with those devices.
    ``used_gib``: its memory reading (none without); ``processes_read``: whether NVML listed
    its processes (its MIG devices' are listed)."""
    ident = GpuIdentity(
        index=index,
        uuid=gpu_uuid(index),
        name="NVIDIA H100 80GB HBM3",
        product="H100-SXM5-80GB" if memory_gib == 80 else f"TEST-{memory_gib}GB",
        pci_bus_id=f"00000000:{0x18 + index:02X}:00.0",
        pci_device_id=0x233010DE,
        memory_total_bytes=memory_gib * GIB,
        mig_capable=True,
    )
    samples = tuple(
        MigSample(
            identity=MigDeviceIdentity(
                gpu=index,
                mig=i,
                uuid=mig_uuid(index, i),
                gpu_instance_id=1 + i,
                compute_instance_id=0,
                gpu_instance_profile_id=9,
                profile_name=profile,
                memory_total_bytes=mem * GIB,
                multiprocessor_count=60,
            ),
            memory=None,
            processes=(mig_processes or {}).get(i, ()),
            processes_read=True,
        )
        for i, (profile, mem) in enumerate(migs)
    )
    return GpuSample(
        identity=ident,
        healthy=True,
        reason="",
        sampled_at=0.0,
        memory=(
            None
            if used_gib is None
            else MemoryInfo(memory_gib * GIB, used_gib * GIB, (memory_gib - used_gib) * GIB)
        ),
        processes=processes,
        processes_read=processes_read,
        mig_mode=MigMode(bool(migs), bool(migs)),
        mig_devices=samples,
    )


def snapshot(*gpus: GpuSample) -> Snapshot:
    return Snapshot(wall_time=0.0, monotonic=0.0, gpus=tuple(gpus), tick_seconds=0.0)


@contextlib.contextmanager
def short_dir() -> Iterator[Path]:
    """A directory with a short path: a unix socket path is at most 107 bytes, and the
    control socket lives at ``<dir>/run/mps/<40-char uuid>/pipe/control``."""
    path = Path(tempfile.mkdtemp(prefix="gm", dir="/tmp"))
    try:
        yield path
    finally:
        kill_daemons(path)
        shutil.rmtree(path, ignore_errors=True)


def kill_daemons(root: Path) -> None:
    """SIGKILL every control daemon under ``root`` (its servers exit with it)."""
    kill_mps_daemons(root)


def make_manager(
    root: Path,
    control: list[str] | None = None,
    *,
    run: str = "run",
    store: StateStore | None = None,
    **kwargs: object,
) -> tuple[MpsManager, StateStore, EventLog]:
    """``control``: the control daemon's command (default: the fake); ``run``: the run
    directory under ``root``; ``store``: the state database (default: one under ``root``)."""
    store = store or StateStore(root / "state")
    events = EventLog(None)
    options: dict[str, object] = {
        "timeout_s": 5.0,
        "health_interval_s": 0.0,
        "others_root": root,
        # the clock of the hand-built snapshots, whose ``monotonic`` is 0
        "snapshot_clock": lambda: 0.0,
    }
    options.update(kwargs)
    manager = MpsManager(store, events, root / run, control or FAKE_CONTROL, **options)  # type: ignore[arg-type]
    return manager, store, events
