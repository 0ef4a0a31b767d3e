"""MpsManager over the fake control daemon: the real process management runs."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shlex
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from gpud.backend.nvml import NvmlBackend
from gpud.backend.port import MigMode, Placement, unknown_identity
from gpud.backend.sim import SimNode, fakenvml, parse_simulate_spec
from gpud.cli.mps import device_row, unhealthy_notes
from gpud.cli.output import message_to_dict
from gpud.config import Config
from gpud.errors import (
    BackendError,
    DriverTimeout,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StateUnwritable,
)
from gpud.events import EventLog
from gpud.main import mps_cgroups
from gpud.mps.api import device_message
from gpud.mps.daemon import ControlDaemon
from gpud.mps.manager import (
    CGROUP_PREFIX,
    RESTORE_RETRY_S,
    MpsDeviceStatus,
    MpsLimits,
    MpsManager,
    MpsTarget,
    Reserved,
    targets_from_snapshot,
)
from gpud.mps.metrics import MpsMetrics
from gpud.mps.procs import alive
from gpud.mps.protocol import PID_FILE
from gpud.net.cgroups import JobCgroups
from gpud.shared import GIB, MIB
from gpud.store import StateStore
from gpud.telemetry.sampler import Sampler
from gpud.telemetry.snapshot import GpuSample, SeenIdentity, Snapshot
from gpud.v1 import mps_pb2
from tests.unit.mps_support import (
    FAKE_CONTROL,
    gpu_sample,
    gpu_uuid,
    make_manager,
    mig_uuid,
    short_dir,
    snapshot,
)
from tests.unit.nvml_doubles import Refusing
from tests.unit.process_support import until
from tests.unit.store_support import CountingStore

NODE = snapshot(gpu_sample(0, memory_gib=80), gpu_sample(1, memory_gib=40))
MIG_NODE = snapshot(
    gpu_sample(0, migs=(("3g.40gb", 40), ("2g.20gb", 20), ("1g.10gb", 10))), gpu_sample(1)
)


@pytest.fixture
def root() -> Iterator[Path]:
    with short_dir() as path:
        yield path


@pytest.fixture
def manager(root: Path) -> Iterator[MpsManager]:
    mgr, store, _ = make_manager(root)
    try:
        yield mgr
    finally:
        mgr.stop()
        store.close()


def held(mgr: MpsManager, uuid: str) -> dict[str, object]:
    """What the control daemon holds (the fake writes it after every command)."""
    status = {s.target.uuid: s for s in mgr.status()}[uuid]
    data: dict[str, object] = json.loads((status.pipe_dir / "fake-mps-state.json").read_text())
    return data


class Stepped:
    """A manager's clock: ``time.monotonic`` moved ``ahead`` seconds on. A check sets its
    device's next one from it as it begins (``health_interval_s`` 0: to its reading), so a
    check that began after ``ahead`` was raised is told from earlier ones."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead


def held_elsewhere(mgr: MpsManager, uuid: str) -> bool:
    """Whether another thread holds ``uuid``'s device lock (a pass working on it)."""
    io = mgr._devices[uuid].io
    if io.acquire(blocking=False):
        io.release()
        return False
    return True


def checked_since(mgr: MpsManager, uuid: str, since: float) -> bool:
    """Whether a check of ``uuid`` that began at ``since`` or later (the manager's
    :class:`Stepped` clock) has ended: a device a pass has not reached yet is free too."""
    return mgr._devices[uuid].next_check_at >= since and not held_elsewhere(mgr, uuid)


def control_wrapper(root: Path, line: str) -> Path:
    """``root/control.sh``: the fake control daemon's command, run after the shell ``line``
    (which may wait, or exit in its stead)."""
    wrapper = root / "control.sh"
    fake = " ".join(shlex.quote(part) for part in FAKE_CONTROL)
    wrapper.write_text(f'#!/bin/sh\n{line}\nexec {fake} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def wait_dead(pid: int) -> None:
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid)


def test_targets_are_gpus_or_their_mig_devices() -> None:
    targets = targets_from_snapshot(MIG_NODE)
    assert [(t.uuid, t.gpu, t.mig, t.profile, t.memory_total_bytes) for t in targets] == [
        (mig_uuid(0, 0), 0, 0, "3g.40gb", 40 * GIB),
        (mig_uuid(0, 1), 0, 1, "2g.20gb", 20 * GIB),
        (mig_uuid(0, 2), 0, 2, "1g.10gb", 10 * GIB),
        (gpu_uuid(1), 1, None, "H100-SXM5-80GB", 80 * GIB),
    ]


def test_a_gpu_that_needs_a_reset_keeps_its_mig_devices_it_says_its_mig_mode_beside() -> None:
    """A GPU that needs a reset still says its MIG mode, but its MIG devices are not read:
    they stay the devices known, not all taken for gone (which would stop their daemons)."""
    before = targets_from_snapshot(MIG_NODE)
    unread = MIG_NODE.gpus[0]._replace(
        healthy=False, reason="reset required", mig_devices=(), mig_devices_read=False
    )
    targets = targets_from_snapshot(snapshot(unread, MIG_NODE.gpus[1]), before)
    assert [(t.uuid, t.gpu_unhealthy) for t in targets] == [
        (mig_uuid(0, 0), "reset required"),
        (mig_uuid(0, 1), "reset required"),
        (mig_uuid(0, 2), "reset required"),
        (gpu_uuid(1), ""),
    ]


def test_mig_devices_destroyed_on_a_gpu_unhealthy_for_another_reading_are_no_targets() -> None:
    """A GPU whose ECC reading fails had its MIG devices read all the same: an empty list is
    the layout (all destroyed), so their targets go and their daemons are stopped."""
    before = targets_from_snapshot(MIG_NODE)
    emptied = MIG_NODE.gpus[0]._replace(healthy=False, reason="ecc: Unknown Error", mig_devices=())
    targets = targets_from_snapshot(snapshot(emptied, MIG_NODE.gpus[1]), before)
    assert [t.uuid for t in targets] == [gpu_uuid(1)]


def lost(gpu: GpuSample) -> GpuSample:
    """``gpu`` fallen off the bus: NVML answers none of its readings, its MIG mode neither."""
    return gpu._replace(
        healthy=False, reason="GPU lost", mig_mode=None, mig_devices=(), mig_devices_read=False
    )


def test_a_gpu_in_mig_mode_lost_before_it_had_mig_devices_is_no_whole_gpu(
    manager: MpsManager,
) -> None:
    """GPU 1's MIG mode was just turned on, its MIG devices not created yet, and it falls
    off the bus: it answers no MIG mode, yet it is no whole GPU, tick after tick, until it
    is read again; then its MIG mode is what was read."""
    split = gpu_sample(1, migs=(("3g.40gb", 40),))
    empty = split._replace(mig_devices=())
    manager.observe_snapshot(snapshot(MIG_NODE.gpus[0], empty))
    for _ in range(2):
        manager.observe_snapshot(snapshot(MIG_NODE.gpus[0], lost(empty)))
        assert {t.gpu for t in manager.targets()} == {0}
    with pytest.raises(FailedPrecondition, match=r"GPU 1 \(GPU-\S+\) is in MIG mode"):
        manager.resolve("1")
    manager.observe_snapshot(snapshot(MIG_NODE.gpus[0], split))
    assert [(t.gpu, t.mig) for t in manager.targets() if t.gpu == 1] == [(1, 0)]
    # read again with its MIG mode off, then lost: a whole GPU, as it was last read
    whole = gpu_sample(1)
    manager.observe_snapshot(snapshot(MIG_NODE.gpus[0], whole))
    manager.observe_snapshot(snapshot(MIG_NODE.gpus[0], lost(whole)))
    assert [(t.uuid, t.mig, t.gpu_unhealthy) for t in manager.targets() if t.gpu == 1] == [
        (gpu_uuid(1), None, "GPU lost")
    ]


def test_targets_of_a_lost_gpu_follow_the_mig_mode_it_was_last_read_in() -> None:
    """The same GPU lost, with no targets before: none where it was last read in MIG mode,
    a whole one where it was not (or was another GPU at that index)."""
    gone = snapshot(MIG_NODE.gpus[0], lost(gpu_sample(1)))
    assert [t.gpu for t in targets_from_snapshot(gone, (), {1: gpu_uuid(1)})] == [0, 0, 0]
    assert [t.gpu for t in targets_from_snapshot(gone, (), {})] == [0, 0, 0, 1]
    assert [t.gpu for t in targets_from_snapshot(gone, (), {1: gpu_uuid(7)})] == [0, 0, 0, 1]


def test_a_device_on_an_unhealthy_gpu_says_so(manager: MpsManager) -> None:
    """``gpuctl mps show``: a daemon can answer while the GPU under it has an XID."""
    sick = MIG_NODE.gpus[0]._replace(healthy=False, reason="XID 79")
    targets = targets_from_snapshot(snapshot(sick, MIG_NODE.gpus[1]))
    assert [t.gpu_unhealthy for t in targets] == ["XID 79", "XID 79", "XID 79", ""]
    manager.reconcile(snapshot(MIG_NODE.gpus[0], NODE.gpus[1]))  # GPU 1's daemon runs
    manager.reconcile(snapshot(MIG_NODE.gpus[0], NODE.gpus[1]._replace(healthy=False, reason="")))
    shown = {s.target.gpu: device_message(s, None) for s in manager.status()}
    assert shown[1].gpu_unhealthy == "unhealthy" and shown[0].gpu_unhealthy == ""
    assert device_row(shown[1])[3].endswith("(GPU 1 unhealthy)")
    # why, once per GPU, under the table: too long for its cell
    sick_migs = [device_message(s, None) for s in manager.status()]
    for m in sick_migs:
        m.gpu_unhealthy = f"critical Xid 79 on {m.gpu}" if m.gpu == 0 else ""
    assert unhealthy_notes(sick_migs) == ["GPU 0 unhealthy: critical Xid 79 on 0"]
    assert "unhealthy" not in device_row(shown[0])[3]
    assert device_row(shown[1])[6] == "none of 40GiB"
    # a GPU never read (lost before gpud started) has no known memory, not 0 bytes
    unread = device_message(manager.status()[0], None)
    unread.ClearField("memory_total_bytes")
    assert device_row(unread)[6] == "none of ?"


def test_a_gpu_with_an_uncleared_critical_xid_gets_no_daemon_until_it_is_cleared(
    root: Path,
) -> None:
    """The simulated node's GPU 1 raises a critical XID before any daemon runs: it gets none
    (the jobs service places no job there either), the status says why in gpud's words, and
    the skip is said once, not on every pass; GPU 0 beside it starts as before. Once the XID
    is cleared the next pass starts it; one running when its GPU turns unhealthy again is
    left running."""
    sim = SimNode(parse_simulate_spec("H100-SXM5-80GB:2"), seed=1)
    backend = NvmlBackend(sim.nvml, uid=1000)
    sampler = Sampler(backend, call_timeout_s=1.0, events=EventLog(None), event_wait_s=0.05)
    mgr, store, events = make_manager(root)

    def xid_48() -> Snapshot:
        sim.faults.xid(1, 48)  # double-bit ECC: critical
        until(lambda: not sampler.tick().gpus[1].healthy, "XID 48 not seen")
        snap = sampler.latest()
        assert snap is not None
        return snap

    try:
        sampler.tick()
        assert backend.wait_events(0.0) == []  # registers every GPU: the XID cannot come first
        sampler.start()
        sick = xid_48()
        reason = sick.gpus[1].reason
        assert reason.startswith("critical Xid 48:")
        mgr.reconcile(sick)
        mgr.reconcile(sampler.tick())  # a later pass: nothing new to say
        status = {s.target.gpu: s for s in mgr.status()}
        assert status[0].up and status[0].pid is not None
        assert not status[1].up and status[1].pid is None
        assert status[1].last_error == "not started while GPU 1 is unhealthy"
        assert status[1].target.gpu_unhealthy == reason
        shown = device_message(status[1], None)
        assert device_row(shown)[3] == "DOWN: not started while GPU 1 is unhealthy"
        assert unhealthy_notes([shown]) == [f"GPU 1 unhealthy: {reason}"]
        (skipped,) = events.recent(kind_prefix="mps.start_skipped")
        assert (skipped.fields["gpu"], skipped.fields["uuid"]) == (1, status[1].target.uuid)
        assert skipped.fields["reason"] == reason
        assert "is not started while GPU 1 is unhealthy" in skipped.message
        assert [
            e.fields["gpu"] for e in events.recent(kind_prefix="mps.start") if e.kind == "mps.start"
        ] == [0]

        assert sampler.clear_xid(1).cleared
        mgr.reconcile(sampler.tick())
        status = {s.target.gpu: s for s in mgr.status()}
        assert status[1].up and status[1].pid is not None and status[1].last_error == ""
        started = status[1].pid
        assert [
            e.fields["gpu"] for e in events.recent(kind_prefix="mps.start") if e.kind == "mps.start"
        ] == [0, 1]

        # turning unhealthy with its daemon running: left as it is, its clients may drain
        mgr.reconcile(xid_48())
        status = {s.target.gpu: s for s in mgr.status()}
        assert status[1].up and status[1].pid == started and status[1].last_error == ""
        assert not events.recent(kind_prefix="mps.stop")
        assert len(events.recent(kind_prefix="mps.start_skipped")) == 1
    finally:
        mgr.stop()
        store.close()
        sampler.close()
        backend.close()


def test_a_daemon_that_exits_while_its_gpu_is_unhealthy_is_not_restarted(
    manager: MpsManager,
) -> None:
    """A restart is a new daemon: none on an unhealthy GPU, nor on its MIG devices; it is
    restarted once the GPU is healthy again."""
    manager.reconcile(MIG_NODE)
    pid = {s.target.uuid: s.pid for s in manager.status()}[gpu_uuid(1)]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    sick = snapshot(
        MIG_NODE.gpus[0]._replace(healthy=False, reason="XID 79"),
        MIG_NODE.gpus[1]._replace(healthy=False, reason="not answering"),
    )
    manager.reconcile(sick)
    status = {s.target.uuid: s for s in manager.status()}
    assert status[gpu_uuid(1)].pid is None and not status[gpu_uuid(1)].up
    assert status[gpu_uuid(1)].last_error == "not started while GPU 1 is unhealthy"
    assert all(status[mig_uuid(0, i)].up for i in range(3))  # running: left as they are
    said = manager._events.recent(kind_prefix="mps.start_skipped")
    assert [(e.fields["gpu"], e.fields["reason"]) for e in said] == [(1, "not answering")]
    assert "exited and is not restarted" in said[0].message
    manager.reconcile(MIG_NODE)
    status = {s.target.uuid: s for s in manager.status()}
    assert status[gpu_uuid(1)].up and status[gpu_uuid(1)].pid not in (None, pid)
    assert status[gpu_uuid(1)].restarts == 1


def test_mig_devices_of_an_unhealthy_gpu_get_no_daemon(manager: MpsManager) -> None:
    sick = MIG_NODE.gpus[0]._replace(healthy=False, reason="XID 79")
    manager.reconcile(snapshot(sick, MIG_NODE.gpus[1]))
    status = {s.target.uuid: s for s in manager.status()}
    assert all(status[mig_uuid(0, i)].pid is None for i in range(3))
    assert status[mig_uuid(0, 1)].last_error == "not started while GPU 0 is unhealthy"
    assert status[gpu_uuid(1)].up
    said = manager._events.recent(kind_prefix="mps.start_skipped")
    by_mig = {e.fields["mig"]: e.message for e in said}  # the devices are checked in any order
    assert sorted(by_mig) == [0, 1, 2]
    assert "MIG device 0:1 on GPU 0" in by_mig[1]


SICK_1 = snapshot(NODE.gpus[0], NODE.gpus[1]._replace(healthy=False, reason="XID 79"))


def test_a_wait_for_an_unhealthy_gpu_ends_once_the_daemon_is_off_or_the_gpu_is_healthy(
    manager: MpsManager,
) -> None:
    """A device passed over for its GPU's health, then disabled: its row is off on the
    unhealthy GPU (not a daemon waiting to start), nothing waits once the GPU is healthy,
    and the next skip, with the device enabled on a sick GPU again, is said anew."""

    def gpu_1() -> MpsDeviceStatus:
        return {s.target.gpu: s for s in manager.status()}[1]

    manager.reconcile(SICK_1)
    assert gpu_1().last_error == "not started while GPU 1 is unhealthy"
    manager.set_limits("1", enabled=False)
    manager.reconcile(SICK_1)
    assert gpu_1().last_error == ""
    assert device_row(device_message(gpu_1(), None))[3] == "off (GPU 1 unhealthy)"
    manager.reconcile(NODE)
    assert gpu_1().last_error == "" and gpu_1().pid is None
    manager.reconcile(SICK_1)  # a new fault, and the device enabled while it lasts
    manager.set_limits("1", enabled=True)
    manager.reconcile(SICK_1)
    said = manager._events.recent(kind_prefix="mps.start_skipped")
    assert [e.fields["gpu"] for e in said] == [1, 1]
    manager.reconcile(NODE)
    assert gpu_1().up and gpu_1().last_error == ""


HEALTHY_0 = snapshot(gpu_sample(0))
SICK_0 = snapshot(gpu_sample(0)._replace(healthy=False, reason="XID 79"))


def _cannot_start(root: Path, now: list[float]) -> tuple[MpsManager, StateStore, EventLog]:
    """A manager of GPU 0 on clock ``now[0]`` whose control binary does not exist: each
    start fails, backing off from 1 s to 60 s."""
    mgr, store, events = make_manager(
        root, clock=lambda: now[0], sleep=lambda s: None, backoff_max_s=60.0
    )
    mgr._command = ["/nonexistent/nvidia-cuda-mps-control"]
    return mgr, store, events


def test_a_start_that_failed_before_a_long_outage_of_its_gpu_fails_anew_after(
    root: Path,
) -> None:
    """A skip that outlasted ``backoff_max_s`` starts afresh: the first start after the GPU
    is healthy again that fails is said (``mps.start_failed``), retried in 1 s, not left to
    an event from before the outage."""
    now = [100.0]
    mgr, store, events = _cannot_start(root, now)
    try:
        mgr.reconcile(HEALTHY_0)
        mgr.reconcile(SICK_0)
        now[0] += 60.0
        mgr.reconcile(SICK_0)
        mgr.reconcile(HEALTHY_0)
        failed = events.recent(kind_prefix="mps.start_failed")
        assert [e.fields["retry_in_s"] for e in failed] == [1.0, 1.0]
    finally:
        mgr.stop()
        store.close()


def test_a_start_error_is_said_again_after_a_short_skip_while_its_starts_back_off(
    root: Path,
) -> None:
    """A control binary that does not run, then its GPU unhealthy for one pass: the skip's
    wait stands in for the start's error while it lasts; healthy again before the back-off
    ends, the row says why the daemon is down (the failed start), not a bare ``DOWN``."""
    now = [100.0]
    mgr, store, _ = _cannot_start(root, now)

    def row() -> tuple[str, ...]:
        (status,) = mgr.status()
        return device_row(device_message(status, None))

    try:
        mgr.reconcile(HEALTHY_0)  # fails: retried in 1 s
        (status,) = mgr.status()
        failed = status.last_error
        assert "/nonexistent/nvidia-cuda-mps-control" in failed, failed
        now[0] += 0.25
        mgr.reconcile(SICK_0)
        assert row()[3] == "DOWN: not started while GPU 0 is unhealthy"
        now[0] += 0.25
        mgr.reconcile(HEALTHY_0)  # before the retry: no start tried
        assert mgr.status()[0].last_error == failed
        assert row()[3] == f"DOWN: {failed}"
    finally:
        mgr.stop()
        store.close()


def test_a_gpu_flapping_under_a_daemon_that_cannot_start_backs_its_starts_off(
    root: Path,
) -> None:
    """A GPU unhealthy every other pass, under a control binary that does not start: the
    failure is said once (``mps.start_failed``), and the starts keep backing off (1 s,
    2 s, 4 s, ...), as without the flapping, rather than one start and one alert per
    flap; the skip is said once too (``mps.start_skipped``): one outage."""
    tries = root / "tries"
    wrapper = control_wrapper(root, f'[ "$1" = -d ] && echo >> {shlex.quote(str(tries))} && exit 1')
    now = [0.0]
    mgr, store, events = make_manager(
        root, [str(wrapper)], clock=lambda: now[0], sleep=lambda s: None, backoff_max_s=60.0
    )
    healthy = snapshot(gpu_sample(0))
    sick = snapshot(gpu_sample(0)._replace(healthy=False, reason="XID 79"))
    tried_at: list[float] = []

    def tried() -> int:
        return len(tries.read_text().splitlines()) if tries.exists() else 0

    try:
        for step in range(30):
            now[0] = float(step)
            before = tried()
            mgr.reconcile(sick if step % 2 else healthy)
            if tried() > before:
                tried_at.append(now[0])
        assert tried_at == [0.0, 2.0, 4.0, 8.0, 16.0]
        (failed,) = events.recent(kind_prefix="mps.start_failed")
        assert failed.fields["retry_in_s"] == 1.0
        assert len(events.recent(kind_prefix="mps.start_skipped")) == 1
    finally:
        mgr.stop()
        store.close()


def test_mig_devices_of_a_flapping_gpu_say_their_skip_once_each(root: Path) -> None:
    """Seven MIG devices on a GPU unhealthy every other pass, none of which can start:
    each says its skip once, not once per flap."""
    now = [0.0]
    mgr, store, events = _cannot_start(root, now)
    migs = tuple(("1g.10gb", 10) for _ in range(7))
    healthy = snapshot(gpu_sample(0, migs=migs))
    sick = snapshot(gpu_sample(0, migs=migs)._replace(healthy=False, reason="XID 79"))
    try:
        for step in range(30):
            now[0] = float(step)
            mgr.reconcile(sick if step % 2 else healthy)
        said = events.recent(kind_prefix="mps.start_skipped")
        assert sorted(e.fields["mig"] for e in said) == list(range(7))
    finally:
        mgr.stop()
        store.close()


def test_a_skip_is_said_again_once_its_gpu_was_healthy_longer_than_the_longest_back_off(
    root: Path,
) -> None:
    """A skip that begins within ``backoff_max_s`` (60 s) of the last one's end is the same
    outage, not said again; one after a longer healthy stretch is a new one, said."""
    now = [100.0]
    mgr, store, events = _cannot_start(root, now)
    try:
        mgr.reconcile(HEALTHY_0)
        mgr.reconcile(SICK_0)  # said
        now[0] += 1.0
        mgr.reconcile(HEALTHY_0)
        now[0] += 59.0
        mgr.reconcile(SICK_0)  # 59 s after: the same outage
        now[0] += 1.0
        mgr.reconcile(HEALTHY_0)
        now[0] += 60.0
        mgr.reconcile(SICK_0)  # 60 s after: a new one
        said = events.recent(kind_prefix="mps.start_skipped")
        assert [e.fields["gpu"] for e in said] == [0, 0]
        assert mgr.status()[0].last_error == "not started while GPU 0 is unhealthy"
    finally:
        mgr.stop()
        store.close()


def test_a_skip_after_a_daemon_started_is_said_however_soon(root: Path) -> None:
    """A daemon that started between two skips ends the outage: the next skip, however soon,
    is said, as its daemon then exited."""
    now = [100.0]
    mgr, store, events = make_manager(root, clock=lambda: now[0], backoff_max_s=60.0)
    try:
        mgr.reconcile(SICK_0)  # said: not started
        mgr.reconcile(HEALTHY_0)  # started
        pid = mgr.status()[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_dead(pid)
        mgr.reconcile(SICK_0)  # said: exited
        said = events.recent(kind_prefix="mps.start_skipped")
        assert ["exited and is not restarted" in e.message for e in said] == [False, True]
    finally:
        mgr.stop()
        store.close()


def test_a_skipped_start_names_the_jobs_that_lose_their_daemon(root: Path) -> None:
    """A `gpuctl run` reserving the device is not told otherwise that its daemon is gone:
    ``mps.start_skipped`` names the jobs, as ``gpuctl mps show`` lists them."""
    mgr, store, events = make_manager(root, holding=lambda: {gpu_uuid(1): ["a", "b"]})
    try:
        mgr.reconcile(SICK_1)
        (said,) = events.recent(kind_prefix="mps.start_skipped")
        assert said.fields["jobs"] == ["a", "b"]
        assert said.message.endswith("; jobs a, b lose MPS until then")
    finally:
        mgr.stop()
        store.close()


def test_a_skipped_start_names_the_one_job_that_loses_its_daemon(root: Path) -> None:
    mgr, store, events = make_manager(root, holding=lambda: {gpu_uuid(1): ["a"]})
    try:
        mgr.reconcile(SICK_1)
        (said,) = events.recent(kind_prefix="mps.start_skipped")
        assert said.fields["jobs"] == ["a"]
        assert said.message.endswith("; job a loses MPS until then")
    finally:
        mgr.stop()
        store.close()


def test_a_skip_is_said_though_the_jobs_reserving_the_device_cannot_be_read(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A state database that does not read (corrupt) while the skip begins: the skip is
    said all the same, once, its ``jobs`` null (not the none of a device no job holds),
    and the log says what was not read."""

    def corrupt() -> dict[str, list[str]]:
        raise sqlite3.DatabaseError("database disk image is malformed")

    mgr, store, events = make_manager(root, holding=corrupt)
    try:
        with caplog.at_level(logging.WARNING, logger="gpud.mps.manager"):
            mgr.reconcile(SICK_1)
            mgr.reconcile(SICK_1)
        (said,) = events.recent(kind_prefix="mps.start_skipped")
        assert said.fields["gpu"] == 1 and said.fields["jobs"] is None
        assert said.message.endswith("; the jobs holding it were not read")
        assert any(
            gpu_uuid(1) in r.getMessage() and "database disk image is malformed" in r.getMessage()
            for r in caplog.records
        )
        status = {s.target.gpu: s for s in mgr.status()}
        assert status[1].last_error == "not started while GPU 1 is unhealthy"
    finally:
        mgr.stop()
        store.close()


def test_a_device_down_for_another_reason_on_an_unhealthy_gpu_is_marked_so() -> None:
    """Only the wait for the GPU's health goes unmarked (it says so itself): a daemon down
    for another reason on an unhealthy GPU (its limits waiting to be moved, an earlier
    daemon that would not stop) gets the marker, though none runs there either."""
    waiting = mps_pb2.MpsDevice(
        gpu=1,
        enabled=True,
        up=False,
        last_error="its MPS limits wait to be moved (state database not writable)",
        gpu_unhealthy="XID 79",
    )
    assert device_row(waiting)[3] == (
        "DOWN: its MPS limits wait to be moved (state database not writable) (GPU 1 unhealthy)"
    )
    passed_over = mps_pb2.MpsDevice(
        gpu=1,
        enabled=True,
        last_error="not started while GPU 1 is unhealthy",
        gpu_unhealthy="XID 79",
    )
    assert device_row(passed_over)[3] == "DOWN: not started while GPU 1 is unhealthy"


def test_a_skipped_start_with_no_job_holding_the_device_names_none(
    manager: MpsManager,
) -> None:
    manager.reconcile(SICK_1)
    (said,) = manager._events.recent(kind_prefix="mps.start_skipped")
    assert said.fields["jobs"] == []
    assert said.message.endswith("it starts once the GPU is healthy again")


def test_a_non_critical_xid_does_not_hold_a_daemons_start(root: Path) -> None:
    """XID 13 (an application's illegal address, in ``ignored_xids``) leaves the GPU healthy:
    its daemon starts, and no skip is said."""
    sim = SimNode(parse_simulate_spec("H100-SXM5-80GB:2"), seed=1)
    backend = NvmlBackend(sim.nvml, uid=1000)
    sampler = Sampler(backend, call_timeout_s=1.0, events=EventLog(None), event_wait_s=0.05)
    mgr, store, events = make_manager(root)
    try:
        sampler.tick()
        assert backend.wait_events(0.0) == []  # registers every GPU: the XID cannot come first
        sampler.start()
        sim.faults.xid(1, 13)
        until(lambda: sampler.tick().gpus[1].last_xid == 13, "XID 13 not seen")
        seen = sampler.latest()
        assert seen is not None and seen.gpus[1].healthy
        mgr.reconcile(seen)
        status = {s.target.gpu: s for s in mgr.status()}
        assert status[1].up and status[1].pid is not None and status[1].last_error == ""
        assert not events.recent(kind_prefix="mps.start_skipped")
    finally:
        mgr.stop()
        store.close()
        sampler.close()
        backend.close()


def test_a_gpu_that_cannot_be_read_keeps_its_daemons(manager: MpsManager) -> None:
    """A lost or hung GPU's sample has no MIG mode and no MIG devices: that is not a GPU
    that left MIG mode, so its MIG devices' daemons stay and no whole-GPU one starts."""
    manager.reconcile(MIG_NODE)
    before = {s.target.uuid: s.pid for s in manager.status()}
    lost = MIG_NODE.gpus[0]._replace(
        healthy=False, reason="GPU lost (memory): GPU is lost", mig_mode=None, mig_devices=()
    )
    manager.reconcile(snapshot(lost, MIG_NODE.gpus[1]))
    after = {s.target.uuid: s for s in manager.status()}
    assert {uuid: s.pid for uuid, s in after.items()} == before
    assert all(after[mig_uuid(0, i)].up for i in range(3))
    assert after[mig_uuid(0, 0)].target.gpu_unhealthy == "GPU lost (memory): GPU is lost"
    manager.reconcile(MIG_NODE)  # it answers again, with the same devices
    assert {s.target.uuid: s.pid for s in manager.status()} == before


def test_mig_devices_answering_reset_required_keep_their_daemons(root: Path) -> None:
    """A GPU whose MIG devices answer "reset required" (or hang) is read as not read, not
    as a GPU in MIG mode without MIG devices: their targets stay and no daemon is stopped
    (jobs may still run on them)."""
    sim = SimNode(parse_simulate_spec("H100-SXM5-80GB:1"), seed=1)
    # MIG device handles carry no GPU index: gpus={None} refuses only their reads
    refusing = Refusing(sim.nvml, 0, ["nvmlDeviceGetMemoryInfo"], [None])  # type: ignore[list-item]
    backend = NvmlBackend(refusing, uid=1000)
    backend.set_mig_mode(0, True)
    sim.reboot()
    profile = next(p for p in backend.gpu_instance_profiles(0) if p.name == "3g.40gb")
    gi = backend.create_gpu_instance(
        0, profile.id, backend.gpu_instance_placements(0, profile.id)[0]
    )
    ci = next(
        c
        for c in backend.compute_instance_profiles(0, profile.id)
        if c.slice_count == profile.slice_count
    )
    backend.create_compute_instance(0, gi.id, ci.id)
    sampler = Sampler(backend, call_timeout_s=1.0, events=EventLog(None), event_wait_s=0.05)
    mgr, store, events = make_manager(root)
    try:
        sampler.refresh_identity()
        mgr.reconcile(sampler.tick())
        before = {s.target.uuid: s.pid for s in mgr.status()}
        assert [u[:4] for u in before] == ["MIG-"] and None not in before.values()
        refusing.code = fakenvml.NVML_ERROR_RESET_REQUIRED
        snap = sampler.tick()
        assert snap.gpus[0].reason.startswith("reset required (mig_devices): ")
        mgr.reconcile(snap)
        after = {s.target.uuid: s for s in mgr.status()}
        assert {uuid: s.pid for uuid, s in after.items()} == before
        assert all(s.up and s.target.gpu_unhealthy for s in after.values())
        assert not events.recent(kind_prefix="mps.stop")
    finally:
        mgr.stop()
        store.close()
        sampler.close()
        backend.close()


def test_limits_for_a_gpu_lost_before_gpud_started_are_refused_without_denying_its_last_uuid(
    manager: MpsManager,
) -> None:
    seen = "NVIDIA H100 80GB HBM3 GPU-ef6bd996 at 00000000:1A:00.0"
    reason = f"GPU lost (identity): GPU is lost; last seen as {seen}"
    unread = GpuSample(identity=unknown_identity(0), healthy=False, reason=reason, sampled_at=0.0)
    manager.reconcile(snapshot(unread, NODE.gpus[1]))
    with pytest.raises(FailedPrecondition) as err:
        manager.set_limits("0", threads_percent=50)
    assert str(err.value) == (
        f"GPU 0 has not been read since gpud started ({reason}): it takes no MPS limits until"
        " it answers with its UUID"
    )


def test_a_gpu_lost_before_gpud_started_named_by_its_last_uuid_or_a_mig_device_says_it_is_lost(
    manager: MpsManager,
) -> None:
    """GPU 0 fell off the bus before gpud started: named by the UUID an earlier run read, it
    is GPU 0 (refused its limits as by its index, a job told it is unhealthy), not an
    unknown device; a MIG device of it says the GPU is lost, how it was seen, not that no
    such device is known."""
    last = "GPU-ef6bd996-508f-4667-91a1-078f3e502e4b"
    reason = f"GPU lost (identity): GPU is lost; last seen as NVIDIA H100 80GB HBM3 {last}"
    seen = SeenIdentity(last, "NVIDIA H100 80GB HBM3", "00000000:1A:00.0", "H100-SXM5-80GB")
    unread = GpuSample(
        identity=unknown_identity(0),
        healthy=False,
        reason=reason,
        sampled_at=0.0,
        last_seen=seen,
    )
    manager.reconcile(snapshot(unread, NODE.gpus[1]))
    target = manager.resolve(last)
    assert (target.gpu, target.uuid, target.gpu_unhealthy) == (0, "", reason)
    with pytest.raises(FailedPrecondition) as err:
        manager.set_limits(last, threads_percent=50)
    assert str(err.value).startswith(
        f"{last} was last seen on GPU 0, which has not been read since gpud started ({reason})"
    )
    with pytest.raises(FailedPrecondition) as err:
        manager.resolve("0:1")
    assert str(err.value) == (
        f"device 0:1 is on GPU 0, which is unhealthy: {reason} (not read since gpud started:"
        " its MIG devices are not known until it answers)"
    )


def _unread_last_seen_as(index: int, uuid: str) -> GpuSample:
    """GPU ``index``, not read since gpud started, that an earlier run last read as ``uuid``."""
    return GpuSample(
        identity=unknown_identity(index),
        healthy=False,
        reason=f"GPU lost (identity): GPU is lost; last seen as NVIDIA H100 80GB HBM3 {uuid}",
        sampled_at=0.0,
        last_seen=SeenIdentity(uuid, "NVIDIA H100 80GB HBM3", "00000000:19:00.0"),
    )


def test_a_last_seen_uuid_now_read_on_a_gpu_in_mig_mode_names_that_gpu_not_the_unread_one(
    manager: MpsManager,
) -> None:
    """The boards were swapped: the UUID GPU 1 was last seen with answers now at GPU 0, in
    MIG mode. Named by it, it is GPU 0 (name one of its MIG devices; create some where it
    has none), never GPU 1, which may be another board."""
    split = gpu_sample(0, migs=(("3g.40gb", 40),))
    manager.observe_snapshot(snapshot(split, _unread_last_seen_as(1, gpu_uuid(0))))
    with pytest.raises(InvalidArgument) as err:
        manager.resolve(gpu_uuid(0))
    assert str(err.value) == (
        f"gpu: GPU 0 ({gpu_uuid(0)}) is in MIG mode; name one of its MIG devices: 0:0"
    )
    empty = split._replace(mig_devices=())
    manager.observe_snapshot(
        dataclasses.replace(snapshot(empty, _unread_last_seen_as(1, gpu_uuid(0))), monotonic=1.0)
    )
    with pytest.raises(FailedPrecondition, match=r"GPU 0 \(GPU-\S+\) is in MIG mode and has no"):
        manager.resolve(gpu_uuid(0))


def test_a_last_seen_uuid_of_no_gpu_read_now_names_the_unread_gpu(manager: MpsManager) -> None:
    """No GPU read in this run answers with the UUID GPU 1 was last seen with: it names GPU
    1, as its index does."""
    manager.observe_snapshot(snapshot(gpu_sample(0), _unread_last_seen_as(1, gpu_uuid(7))))
    target = manager.resolve(gpu_uuid(7))
    assert (target.gpu, target.uuid, target.last_seen_uuid) == (1, "", gpu_uuid(7))
    assert manager.resolve(gpu_uuid(0)).gpu == 0


def test_no_daemon_for_a_gpu_never_read(manager: MpsManager) -> None:
    """Lost before gpud started: no UUID, so nothing to start a daemon for; it stays listed,
    so that a job naming it hears that it is unhealthy."""
    unread = GpuSample(
        identity=unknown_identity(0), healthy=False, reason="GPU lost (identity)", sampled_at=0.0
    )
    manager.reconcile(snapshot(unread, NODE.gpus[1]))
    status = {s.target.gpu: s for s in manager.status()}
    assert status[0].pid is None and not status[0].up
    assert status[0].target.gpu_unhealthy == "GPU lost (identity)"
    assert status[1].up and status[1].pid is not None
    # its size, product and UUID are unknown: absent (null in --json) and "?", not 0 or ""
    shown = device_message(status[0], None)
    assert not shown.HasField("memory_total_bytes")
    assert device_message(status[1], None).memory_total_bytes == 40 * GIB
    row = device_row(shown)
    assert (row[1], row[2], row[6]) == ("?", "?", "none of ?")
    # nor is there a pipe directory: no daemon runs for it (not <run-dir>/mps/pipe)
    unknown = message_to_dict(shown)
    assert {k: unknown[k] for k in ("uuid", "profile", "pipe_directory")} == dict.fromkeys(
        ("uuid", "profile", "pipe_directory")
    )
    read = device_message(status[1], None)
    assert read.uuid == gpu_uuid(1) and read.profile and read.pipe_directory.endswith("/pipe")
    # whether its daemon runs is unknown (one an earlier gpud started runs on, untouched):
    # not "DOWN", nor up: false in --json
    assert row[3] == "unknown (GPU 0 not read since gpud started) (GPU 0 unhealthy)"
    assert row[4] == "-"
    assert unknown["up"] is None
    assert unknown["up_unknown"] == "GPU 0 not read since gpud started"
    assert device_row(read)[3] == "up" and message_to_dict(read)["up"] is True
    assert read.up_unknown == ""
    # no MPS series for it: not under uuid="" (beside the last-seen UUID that its GPU series
    # carry), nor a daemon "enabled" and down that is no daemon at all
    registry = _metrics_registry(manager)
    series = [s for m in registry.collect() for s in m.samples if s.name.startswith("gpud_mps_")]
    assert {s.labels["gpu"] for s in series} == {"1"}
    assert all(s.labels["uuid"] == gpu_uuid(1) for s in series)


def test_every_gpu_never_read_is_listed(manager: MpsManager) -> None:
    """Two GPUs lost before gpud started have no UUID: both stay listed, each under its own
    index, and neither takes limits (they would be kept for no device, or for any)."""
    unread = [
        GpuSample(identity=unknown_identity(i), healthy=False, reason=f"lost {i}", sampled_at=0.0)
        for i in (1, 2)
    ]
    manager.reconcile(snapshot(NODE.gpus[0], *unread))
    status = {s.target.gpu: s.target.gpu_unhealthy for s in manager.status()}
    assert status == {0: "", 1: "lost 1", 2: "lost 2"}
    assert manager.resolve("2").gpu == 2
    with pytest.raises(FailedPrecondition, match=r"GPU 2 .*lost 2"):
        manager.set_limits("2", threads_percent=40)
    assert manager.all_limits() == {}


def test_one_daemon_per_gpu_with_unequal_limits(manager: MpsManager, root: Path) -> None:
    manager.reconcile(NODE)
    manager.set_limits("0", threads_percent=40, memory_bytes=20 * GIB)
    manager.set_limits(gpu_uuid(1), threads_percent=70, memory_bytes=1536 * MIB)

    first, second = held(manager, gpu_uuid(0)), held(manager, gpu_uuid(1))
    assert first["visible_devices"] == [gpu_uuid(0)]
    assert first["default_active_thread_percentage"] == 40.0
    assert first["default_device_pinned_mem_limit"] == {"0": 20 * GIB}
    assert second["visible_devices"] == [gpu_uuid(1)]
    assert second["default_active_thread_percentage"] == 70.0
    assert second["default_device_pinned_mem_limit"] == {"0": 1536 * MIB}
    assert first["pid"] != second["pid"]

    status = {s.target.uuid: s for s in manager.status()}
    assert status[gpu_uuid(0)].pipe_dir == root / "run" / "mps" / gpu_uuid(0) / "pipe"
    assert status[gpu_uuid(0)].up and status[gpu_uuid(1)].up
    assert status[gpu_uuid(0)].observed_threads_percent == 40.0
    assert status[gpu_uuid(1)].observed_memory_bytes == 1 * GIB  # shown in whole GiB
    assert (root / "run" / "mps" / gpu_uuid(0) / "log" / "control.log").exists()


def test_memory_over_the_device_is_refused_with_the_numbers(manager: MpsManager) -> None:
    manager.reconcile(NODE)
    manager.set_limits("1", memory_bytes=10 * GIB)
    with pytest.raises(ResourceExhausted, match=r"50GiB exceeds the device's 40GiB"):
        manager.set_limits("1", memory_bytes=50 * GIB)
    with pytest.raises(ResourceExhausted, match=r"30GiB \+ reserved by jobs 20GiB = 50GiB"):
        manager.set_limits("1", memory_bytes=30 * GIB, reserved=lambda _: Reserved(20 * GIB))
    assert manager.limits(gpu_uuid(1)).memory_bytes == 10 * GIB
    assert held(manager, gpu_uuid(1))["default_device_pinned_mem_limit"] == {"0": 10 * GIB}


def test_devices_are_named_by_uuid_index_or_gpu_colon_mig(manager: MpsManager) -> None:
    manager.observe(targets_from_snapshot(MIG_NODE))
    assert manager.resolve("1").uuid == gpu_uuid(1)
    assert manager.resolve("0:2").uuid == mig_uuid(0, 2)
    assert manager.resolve(mig_uuid(0, 1)).profile == "2g.20gb"
    with pytest.raises(InvalidArgument, match=r"MIG mode; name one of its MIG devices: 0:\d"):
        manager.resolve("0")
    with pytest.raises(NotFound, match=r"no GPU or MIG device '7' \(known: 0:") as err:
        manager.resolve("7")
    assert str(err.value).endswith("(known: 0:0..2, 1; or a GPU-/MIG- UUID)")
    with pytest.raises(NotFound):
        manager.resolve("GPU-nope")


def test_a_gpu_in_mig_mode_without_mig_devices_is_named_as_such(manager: MpsManager) -> None:
    empty_mig = gpu_sample(1)._replace(mig_mode=MigMode(True, True))
    manager.observe_snapshot(snapshot(gpu_sample(0), empty_mig))
    for name in ("1", "1:0", gpu_uuid(1)):
        with pytest.raises(FailedPrecondition) as err:
            manager.resolve(name)
        assert str(err.value) == (
            f"GPU 1 ({gpu_uuid(1)}) is in MIG mode and has no MIG devices: create some"
            " (gpuctl mig apply) or turn its MIG mode off"
        )
    with pytest.raises(NotFound, match=r"no GPU or MIG device '2' \(known: 0;"):
        manager.resolve("2")
    # a GPU in MIG mode that has MIG devices: a MIG index it lacks is not found
    manager.observe_snapshot(MIG_NODE)
    with pytest.raises(NotFound, match=r"no GPU or MIG device '0:9' \(known: 0:0..2, 1;"):
        manager.resolve("0:9")


def test_mps_on_mig_devices_one_daemon_each(manager: MpsManager) -> None:
    manager.reconcile(MIG_NODE)
    manager.set_limits("0:0", threads_percent=50, memory_bytes=30 * GIB)
    manager.set_limits("0:2", threads_percent=100, memory_bytes=5 * GIB)
    assert held(manager, mig_uuid(0, 0))["visible_devices"] == [mig_uuid(0, 0)]
    assert held(manager, mig_uuid(0, 0))["default_device_pinned_mem_limit"] == {"0": 30 * GIB}
    assert held(manager, mig_uuid(0, 2))["default_device_pinned_mem_limit"] == {"0": 5 * GIB}
    with pytest.raises(ResourceExhausted, match="10GiB"):
        manager.set_limits("0:2", memory_bytes=11 * GIB)
    assert len({s.pid for s in manager.status()}) == 4


def test_a_killed_daemon_is_restarted_with_the_same_limits(root: Path) -> None:
    mgr, store, events = make_manager(root)
    try:
        mgr.reconcile(NODE)
        mgr.set_limits("0", threads_percent=30, memory_bytes=12 * GIB)
        old_pid = mgr.status()[0].pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        wait_dead(old_pid)

        mgr.reconcile(NODE)
        status = mgr.status()[0]
        assert status.pid is not None and status.pid != old_pid
        assert status.up and status.restarts == 1
        daemon = held(mgr, gpu_uuid(0))
        assert daemon["pid"] == status.pid
        assert daemon["default_active_thread_percentage"] == 30.0
        assert daemon["default_device_pinned_mem_limit"] == {"0": 12 * GIB}
        assert [e.kind for e in events.recent(kind_prefix="mps.restart")] == ["mps.restart"]
    finally:
        mgr.stop()
        store.close()


def kill_daemons(mgr: MpsManager) -> None:
    """SIGKILL every control daemon, behind the manager's back."""
    for status in mgr.status():
        assert status.pid is not None
        os.kill(status.pid, signal.SIGKILL)
        wait_dead(status.pid)


def test_a_daemon_killed_behind_gpuds_back_is_restarted_naming_the_jobs_it_served(
    root: Path,
) -> None:
    """A control daemon killed with its MPS server (and its clients) under a job: the
    restart names the jobs holding the device and the server pid its clients lost, as a
    skipped start names the jobs; one on a device no job holds, with no server, names none."""
    mgr, store, events = make_manager(root, holding=lambda: {gpu_uuid(0): ["train-7"]})
    try:
        mgr.reconcile(snapshot(gpu_sample(0), gpu_sample(1)))
        (server,) = mgr.start_server("0", os.getuid())
        kill_daemons(mgr)
        mgr.reconcile(snapshot(gpu_sample(0), gpu_sample(1)))
        said = {e.fields["gpu"]: e for e in events.recent(kind_prefix="mps.restart")}
        assert said[0].fields["jobs"] == ["train-7"]
        assert said[0].fields["servers"] == [server]
        assert said[0].message.endswith(
            f"; job train-7 held the device: its MPS clients lost their server (pid {server})"
            " with the daemon before"
        )
        assert said[1].fields["jobs"] == [] and said[1].fields["servers"] == []
        assert said[1].message.endswith("memory unlimited")
    finally:
        mgr.stop()
        store.close()


def test_a_restart_under_a_job_that_ran_no_mps_server_says_no_client_lost_one(
    root: Path,
) -> None:
    """A job holds the device but none of its processes connected (so no MPS server ran):
    the daemon's restart says so, and not that its clients lost their server."""
    mgr, store, events = make_manager(root, holding=lambda: {gpu_uuid(0): ["train-7", "eval"]})
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        kill_daemons(mgr)
        mgr.reconcile(snapshot(gpu_sample(0)))
        (said,) = events.recent(kind_prefix="mps.restart")
        assert said.fields["jobs"] == ["train-7", "eval"] and said.fields["servers"] == []
        assert said.message.endswith(
            "memory unlimited; jobs train-7, eval held the device with no MPS server running"
        )
    finally:
        mgr.stop()
        store.close()


def test_a_restart_is_said_though_the_jobs_holding_the_device_cannot_be_read(
    root: Path,
) -> None:
    """A state database that does not read as a daemon with a server is restarted: the
    restart still names the server its clients lost, its ``jobs`` null (not the none of
    an unheld device), and says the jobs were not read."""

    def corrupt() -> dict[str, list[str]]:
        raise sqlite3.DatabaseError("database disk image is malformed")

    mgr, store, events = make_manager(root, holding=corrupt)
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        (server,) = mgr.start_server("0", os.getuid())
        kill_daemons(mgr)
        mgr.reconcile(snapshot(gpu_sample(0)))
        (said,) = events.recent(kind_prefix="mps.restart")
        assert said.fields["jobs"] is None and said.fields["servers"] == [server]
        assert said.message.endswith(
            f"; the MPS clients lost their server (pid {server}) with the daemon before;"
            " the jobs holding the device were not read"
        )
    finally:
        mgr.stop()
        store.close()


def test_a_daemon_being_restarted_is_not_shown_up_before_its_limits_are_back(
    root: Path,
) -> None:
    """While a killed daemon is started again, its new PID exists before its limits are
    applied: `gpuctl mps show` must not show it up (with the old limits and restart count)
    in between."""
    slow = root / "slow"
    # the client commands (limits) wait while ``slow`` exists; the daemon (-d) starts at once
    wrapper = control_wrapper(
        root, f'[ "$1" = -d ] || while [ -e {shlex.quote(str(slow))} ]; do sleep 0.01; done'
    )
    mgr, store, _ = make_manager(root, [str(wrapper)])
    try:
        mgr.reconcile(NODE)
        mgr.set_limits("0", threads_percent=30)
        old_pid = mgr.status()[0].pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        wait_dead(old_pid)
        slow.touch()
        restarting = threading.Thread(target=mgr.reconcile, args=(NODE,))
        restarting.start()
        shown = mgr.status()[0]
        while shown.pid in (None, old_pid):  # until the new daemon's PID shows
            shown = mgr.status()[0]
        assert not shown.up  # its limits are not applied yet
        slow.unlink()
        restarting.join()
        status = mgr.status()[0]
        assert status.up and status.pid == shown.pid and status.restarts == 1
        assert status.observed_threads_percent == 30.0
    finally:
        slow.unlink(missing_ok=True)
        mgr.stop()
        store.close()


def test_a_hung_daemon_is_killed_and_restarted(root: Path) -> None:
    hang = Hang()
    mgr, store, events = make_manager(root, max_failures=2, run_control=hang)
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        mgr.set_limits("0", threads_percent=60)
        pid = mgr.status()[0].pid
        assert pid is not None
        hang.hung = True
        mgr.reconcile()  # first failed check
        assert not mgr.status()[0].up
        assert "did not answer" in mgr.status()[0].last_error
        mgr.reconcile()  # second: killed
        wait_dead(pid)
        hang.hung = False  # the next daemon answers
        mgr.reconcile()  # restarted
        status = mgr.status()[0]
        assert status.up and status.pid != pid and status.restarts == 1
        assert held(mgr, gpu_uuid(0))["default_active_thread_percentage"] == 60.0
        assert events.recent(kind_prefix="mps.unresponsive")
    finally:
        mgr.stop()
        store.close()


def test_a_daemon_killed_for_not_answering_on_an_unhealthy_gpu_is_said_killed_not_exited(
    root: Path,
) -> None:
    """A daemon that stops answering while its GPU is unhealthy is killed; its restart
    waits for the GPU, and both events say so: killed for not answering (it did not exit),
    restarted once the GPU is healthy."""
    hang = Hang()
    mgr, store, events = make_manager(root, max_failures=2, run_control=hang)
    try:
        mgr.reconcile(HEALTHY_0)
        pid = mgr.status()[0].pid
        assert pid is not None
        hang.hung = True
        mgr.reconcile(SICK_0)  # first failed check
        mgr.reconcile(SICK_0)  # second: killed
        wait_dead(pid)
        hang.hung = False  # the next daemon answers
        (killed,) = events.recent(kind_prefix="mps.unresponsive")
        assert "failed 2 health checks, the last: " in killed.message, killed.message
        assert killed.message.endswith("; killing it; it is restarted once GPU 0 is healthy"), (
            killed.message
        )
        mgr.reconcile(SICK_0)  # gone: its restart passed over
        (skipped,) = events.recent(kind_prefix="mps.start_skipped")
        assert (
            "was killed for not answering and is not restarted while GPU 0 is unhealthy: XID 79"
            in skipped.message
        ), skipped.message
        assert mgr.status()[0].pid is None
        mgr.reconcile(HEALTHY_0)
        status = mgr.status()[0]
        assert status.up and status.pid not in (None, pid) and status.restarts == 1
    finally:
        mgr.stop()
        store.close()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_limits_persist_and_a_running_daemon_is_adopted(root: Path, how: str) -> None:
    """gpud killed, or stopped (a restart: its stop leaves the daemons running for the jobs
    that use them, and says so once)."""
    first, store, events = make_manager(root)
    first.reconcile(NODE)
    first.set_limits("1", threads_percent=25, memory_bytes=4 * GIB)
    pids = {s.target.uuid: s.pid for s in first.status()}
    if how == "stopped":
        first.leave()
        (left,) = [e for e in events.recent() if e.kind == "mps.leave"]
        assert left.message == (
            "leaving 2 MPS control daemons running for the jobs that use them: the next"
            " start adopts them"
        )
        assert left.fields["daemons"] == 2
        assert not [e for e in events.recent() if e.kind == "mps.stop"]
    store.close()
    assert all(pid is not None and alive(pid) for pid in pids.values())

    second, store, events = make_manager(root)
    try:
        assert second.limits(gpu_uuid(1)) == MpsLimits(25, 4 * GIB, True)
        assert second.limits(gpu_uuid(0)) == MpsLimits()
        second.reconcile(NODE)
        assert {s.target.uuid: s.pid for s in second.status()} == pids
        assert {e.kind for e in events.recent()} == {"mps.adopt"}
        assert held(second, gpu_uuid(1))["default_active_thread_percentage"] == 25.0
    finally:
        second.stop()
        store.close()
    for pid in pids.values():
        assert pid is not None
        wait_dead(pid)


def test_changes_reach_running_servers(manager: MpsManager) -> None:
    manager.reconcile(snapshot(gpu_sample(0)))
    (server,) = manager.start_server("0", os.getuid())
    manager.set_limits("0", threads_percent=35, memory_bytes=8 * GIB)
    servers = held(manager, gpu_uuid(0))["servers"]
    assert servers == {
        str(server): {
            "uid": os.getuid(),
            "active_thread_percentage": 35.0,
            "device_pinned_mem_limit": {"0": 8 * GIB},
        }
    }


def test_clearing_the_memory_limit_restarts_an_idle_daemon(manager: MpsManager) -> None:
    manager.reconcile(snapshot(gpu_sample(0)))
    manager.set_limits("0", memory_bytes=8 * GIB)
    manager.start_server("0", os.getuid())
    with pytest.raises(FailedPrecondition, match="still serve clients"):
        manager.set_limits("0", clear_memory=True)
    assert manager.limits(gpu_uuid(0)).memory_bytes == 8 * GIB  # nothing changed
    daemon = held(manager, gpu_uuid(0))
    for server in daemon["servers"]:  # type: ignore[attr-defined]
        os.kill(int(server), signal.SIGKILL)
        wait_dead(int(server))
    manager.set_limits("0", clear_memory=True)
    assert held(manager, gpu_uuid(0))["default_device_pinned_mem_limit"] == {}
    status = manager.status()[0]
    assert status.observed_memory_bytes is None and status.up and status.restarts == 0


class Hang:
    """How the manager runs the control program (``run``): as :func:`subprocess.run`, but
    while ``hung`` every command sent to a daemon (``-d`` aside) times out at once, as the
    client of a daemon that answers nothing does after its timeout."""

    def __init__(self) -> None:
        self.hung = False

    def __call__(
        self,
        command: list[str],
        *,
        input: str | None = None,
        check: bool = False,
        **kwargs: Any,
    ) -> subprocess.CompletedProcess[str]:
        if self.hung and input is not None:
            raise subprocess.TimeoutExpired(command, kwargs.get("timeout") or 0.0)
        result: subprocess.CompletedProcess[str] = subprocess.run(
            command, input=input, check=check, **kwargs
        )
        return result


def test_a_daemon_answering_again_while_its_memory_limit_waits_is_recovered(
    root: Path,
) -> None:
    """A daemon whose memory limit waits to be removed (its servers still run) that did
    not answer once and answers again: said recovered, its failed check no longer counted,
    so two later hangs in a row (under max_failures 3) kill no daemon serving jobs."""
    hang = Hang()
    mgr, store, events = make_manager(root, max_failures=3, run_control=hang)
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        mgr.set_limits("0", memory_bytes=GIB)
        mgr.start_server("0", os.getuid())
        pid = mgr.status()[0].pid
        assert pid is not None
        hang.hung = True
        mgr.reconcile()
        assert [e.kind for e in events.recent(kind_prefix="mps.hung")] == ["mps.hung"]
        hang.hung = False
        with store.transaction() as conn:  # cleared while the server runs
            conn.execute("UPDATE mps_limits SET pinned_mem_limit_bytes = NULL")
        mgr.reconcile()
        status = mgr.status()[0]
        assert status.up and status.last_error.startswith("memory limit removal waits")
        assert events.recent(kind_prefix="mps.recovered")
        for _ in range(2):
            hang.hung = True
            mgr.reconcile()
            hang.hung = False
            mgr.reconcile()
        assert not events.recent(kind_prefix="mps.unresponsive")
        assert alive(pid) and mgr.status()[0].pid == pid
        assert len(events.recent(kind_prefix="mps.hung")) == 3
    finally:
        mgr.stop()
        store.close()


def test_disabled_devices_and_vanished_mig_devices_lose_their_daemon(manager: MpsManager) -> None:
    manager.reconcile(MIG_NODE)
    pids = {s.target.uuid: s.pid for s in manager.status()}
    manager.set_limits("1", enabled=False)
    gone = pids[gpu_uuid(1)]
    assert gone is not None
    wait_dead(gone)
    assert not manager.status()[-1].running
    # MIG device 0:2 destroyed: its daemon quits.
    smaller = snapshot(gpu_sample(0, migs=(("3g.40gb", 40), ("2g.20gb", 20))), gpu_sample(1))
    manager.reconcile(smaller)
    removed = pids[mig_uuid(0, 2)]
    assert removed is not None
    wait_dead(removed)
    assert {s.target.uuid for s in manager.status()} == {
        mig_uuid(0, 0),
        mig_uuid(0, 1),
        gpu_uuid(1),
    }


def test_mps_off_runs_nothing_but_keeps_limits(root: Path) -> None:
    mgr, store, _ = make_manager(root, enabled=False)
    try:
        mgr.reconcile(NODE)
        mgr.set_limits("0", threads_percent=10)
        assert all(s.pid is None and not s.running for s in mgr.status())
        assert mgr.pipe_dir(gpu_uuid(0)) is None
        assert mgr.limits(gpu_uuid(0)).threads_percent == 10
    finally:
        mgr.stop()
        store.close()


_PID_OPENS: list[list[str]] = []  # the counts being made: each PID file opened, by any thread


def _count_pid_opens(event: str, args: tuple[object, ...]) -> None:
    if event == "open" and _PID_OPENS and str(args[0]).endswith(PID_FILE):
        for opens in _PID_OPENS:
            opens.append(str(args[0]))


_HOOKED: list[bool] = []  # an audit hook cannot be removed: added once, by the first count


@contextlib.contextmanager
def counting_passes() -> Iterator[tuple[list[str], list[str]]]:
    """(threads started named gpud-mps-*, PID files opened) while inside."""
    threads: list[str] = []
    opens: list[str] = []

    def first_call(frame: object, event: str, arg: object) -> None:
        sys.setprofile(None)  # the thread's first call is all it takes
        name = threading.current_thread().name
        if name.startswith("gpud-mps-"):
            threads.append(name)

    if not _HOOKED:
        sys.addaudithook(_count_pid_opens)
        _HOOKED.append(True)
    _PID_OPENS.append(opens)
    threading.setprofile(first_call)
    try:
        yield threads, opens
    finally:
        threading.setprofile(None)
        _PID_OPENS.remove(opens)


def test_mps_off_a_pass_leaves_devices_without_a_daemon_alone(root: Path) -> None:
    """With MPS off, a device found without a control daemon costs a pass nothing: no thread,
    no PID file read (a node of 8 GPUs with 7 MIG devices each would start 56 threads and
    read 112 PID files a second). A daemon an earlier run with MPS on left behind is stopped
    once, and a device new to the node is checked once."""
    earlier, store, _ = make_manager(root)
    earlier.reconcile(snapshot(gpu_sample(0)))
    (left,) = [s.pid for s in earlier.status()]
    assert left is not None
    store.close()  # gpud restarted with MPS off, the daemon left running

    node = [gpu_sample(0), gpu_sample(1, migs=(("1g.10gb", 10),) * 3)]
    mgr, store, events = make_manager(root, enabled=False)
    try:
        passes = []
        for gpus in (node, node, node, node, [node[0], gpu_sample(1, migs=(("1g.10gb", 10),) * 4)]):
            with counting_passes() as (threads, opens):
                mgr.reconcile(snapshot(*gpus))
            passes.append((len(threads), len(opens)))
        # 4 devices: the one with the daemon is stopped, then found stopped at the next pass;
        # then nothing, until a fourth MIG device shows up on GPU 1
        assert [t for t, _ in passes] == [4, 1, 0, 0, 1]
        assert passes[2] == passes[3] == (0, 0)
        wait_dead(left)
        assert [
            (e.fields["uuid"], e.fields["pid"]) for e in events.recent(kind_prefix="mps.stop")
        ] == [(gpu_uuid(0), left)]
        assert all(s.pid is None and not s.running for s in mgr.status())
        with counting_passes() as (threads, opens):
            mgr.reconcile(snapshot(node[0], gpu_sample(1, migs=(("1g.10gb", 10),) * 4)))
        assert (threads, opens) == ([], [])
    finally:
        mgr.stop()
        store.close()


def test_mps_off_a_pass_reads_the_limits_once_not_once_per_device(root: Path) -> None:
    """With MPS off a pass needs no device's limits, and its status reads them all at once:
    one read of the state database whatever the number of devices (a MIG node of 8 GPUs has
    64, reconciled every tick), not two per device."""
    store = CountingStore(root / "state")
    mgr = MpsManager(store, EventLog(None), root / "run", FAKE_CONTROL, timeout_s=5.0,
                     health_interval_s=60.0, enabled=False)  # fmt: skip
    small = snapshot(gpu_sample(0))
    big = snapshot(*(gpu_sample(i, migs=(("1g.10gb", 10),) * 7) for i in range(4)))
    try:
        counts = []
        for node in (small, big):
            mgr.reconcile(node)  # new devices: their daemons start, MIG limits restored
            store.transactions = 0
            mgr.reconcile(node)
            counts.append(store.transactions)
        assert counts == [1, 1]
        assert all(s.pid is None and not s.running for s in mgr.status())
    finally:
        mgr.stop()
        store.close()


def test_a_daemon_that_cannot_start_backs_off(root: Path) -> None:
    now = [100.0]
    mgr, store, events = make_manager(root, clock=lambda: now[0], sleep=lambda s: None)
    mgr._command = ["/nonexistent/nvidia-cuda-mps-control"]
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        mgr.reconcile()
        status = mgr.status()[0]
        assert not status.up and "cannot run" in status.last_error
        assert len(events.recent(kind_prefix="mps.start_failed")) == 1
    finally:
        store.close()


@pytest.mark.parametrize(
    ("binary", "said"),
    [
        ("/nonexistent/x", "/nonexistent/x: no such file"),
        ("no-such-mps-control", "no-such-mps-control: no such file in PATH (/usr/local/sbin:"),
    ],
)
def test_a_control_binary_that_does_not_exist_is_named_by_its_key_when_a_start_fails(
    root: Path, binary: str, said: str
) -> None:
    mgr, store, events = make_manager(root, [binary], sleep=lambda s: None)
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        (failed,) = events.recent(kind_prefix="mps.start_failed")
        assert f"did not start: cannot run mps.control_binary: {said}" in failed.message
    finally:
        store.close()


def test_a_control_binary_that_is_there_but_cannot_be_run_is_named_by_its_key_and_why(
    root: Path, tmp_path: Path
) -> None:
    """Not "no such file" for a file ``ls`` shows: execve's ENOENT for a script whose
    interpreter is missing is said as that, and a file without an execute bit as
    execve's EACCES, both naming the key."""
    orphan = tmp_path / "orphan-mps-control"
    orphan.write_text("#!/nonexistent/interpreter\n")
    orphan.chmod(0o755)
    plain = tmp_path / "plain-mps-control"
    plain.write_text("#!/bin/sh\n")
    plain.chmod(0o644)
    for binary, why in (
        (orphan, "exists but cannot be run (its interpreter or loader missing?)"),
        (plain, "Permission denied"),
    ):
        mgr, store, events = make_manager(root, [str(binary)], sleep=lambda s: None)
        try:
            mgr.reconcile(snapshot(gpu_sample(0)))
            (failed,) = events.recent(kind_prefix="mps.start_failed")
            assert f"did not start: cannot run mps.control_binary: {binary}: {why}" in (
                failed.message
            )
        finally:
            mgr.stop()
            store.close()


def test_events_of_a_daemon_name_its_gpu_as_the_health_checks_do(root: Path) -> None:
    """``gpuctl events --kind mps. --json`` filtered on a GPU finds every event of its
    daemon: a start, a failed start, as a failed health check does."""
    mgr, store, events = make_manager(root, sleep=lambda s: None)
    try:
        mgr.reconcile(snapshot(gpu_sample(0), gpu_sample(1)))
        started = events.recent(kind_prefix="mps.start")
        assert sorted(e.fields["gpu"] for e in started) == [0, 1]
        assert all(f"GPU {e.fields['gpu']} (" in e.message for e in started)
    finally:
        mgr.stop()
        store.close()
    mgr, store, events = make_manager(root / "again", sleep=lambda s: None)
    mgr._command = ["/nonexistent/nvidia-cuda-mps-control"]
    try:
        mgr.reconcile(snapshot(gpu_sample(0), gpu_sample(1)))
        failed = events.recent(kind_prefix="mps.start_failed")
        assert sorted((e.fields["gpu"], e.fields["uuid"]) for e in failed) == [
            (0, gpu_uuid(0)),
            (1, gpu_uuid(1)),
        ]
        assert all(f"GPU {e.fields['gpu']} (" in e.message for e in failed)
    finally:
        store.close()


def test_events_of_a_mig_device_name_it_and_its_gpu_as_the_mig_metrics_do(root: Path) -> None:
    """A MIG device's events carry ``gpu_uuid`` and ``mig_uuid`` (the labels of the MIG
    metrics) beside ``gpu`` and ``uuid``; a whole GPU's carry ``gpu`` and ``uuid`` alone."""
    mgr, store, events = make_manager(root, sleep=lambda s: None)
    try:
        mgr.reconcile(snapshot(gpu_sample(0), gpu_sample(1, migs=(("3g.40gb", 40),))))
        mgr.set_limits("1:0", threads_percent=50)
        mgr.set_limits("0", threads_percent=40)
        where = {"gpu", "uuid", "mig", "gpu_uuid", "mig_uuid"}
        said = [
            (e.kind, {k: v for k, v in e.fields.items() if k in where})
            for e in events.recent(kind_prefix="mps.")
        ]
        mig = {
            "gpu": 1,
            "uuid": mig_uuid(1, 0),
            "mig": 0,
            "gpu_uuid": gpu_uuid(1),
            "mig_uuid": mig_uuid(1, 0),
        }
        whole = {"gpu": 0, "uuid": gpu_uuid(0)}
        assert sorted(said, key=lambda s: (s[0], s[1]["gpu"])) == [
            ("mps.limits", whole),
            ("mps.limits", mig),
            ("mps.start", whole),
            ("mps.start", mig),
        ]
    finally:
        mgr.stop()
        store.close()


def _metrics_registry(manager: MpsManager) -> CollectorRegistry:
    registry = CollectorRegistry()
    source = MpsMetrics(manager)

    class _Source(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            return source()

    registry.register(_Source())
    return registry


def test_metrics(manager: MpsManager) -> None:
    manager.reconcile(NODE)
    manager.set_limits("0", threads_percent=40, memory_bytes=20 * GIB)
    registry = _metrics_registry(manager)
    labels = {"gpu": "0", "uuid": gpu_uuid(0), "profile": "H100-SXM5-80GB"}
    assert registry.get_sample_value("gpud_mps_daemon_up", labels) == 1.0
    assert registry.get_sample_value("gpud_mps_default_active_thread_ratio", labels) == 0.4
    assert (
        registry.get_sample_value("gpud_mps_default_pinned_memory_limit_bytes", labels) == 20 * GIB
    )
    assert registry.get_sample_value("gpud_mps_daemon_restarts_total", labels) == 0.0
    assert registry.get_sample_value("gpud_mps_daemon_start_failures_total", labels) == 0.0
    other = {"gpu": "1", "uuid": gpu_uuid(1), "profile": "TEST-40GB"}
    assert registry.get_sample_value("gpud_mps_default_active_thread_ratio", other) == 1.0
    assert registry.get_sample_value("gpud_mps_default_pinned_memory_limit_bytes", other) is None


def test_an_unwritable_run_dir_is_a_device_error_not_a_crash(root: Path) -> None:
    (root / "run").mkdir(parents=True)
    (root / "run" / "mps").write_text("not a directory")
    mgr, store, _ = make_manager(root, sleep=lambda s: None)
    try:
        mgr.reconcile(snapshot(gpu_sample(0), gpu_sample(1)))  # must not raise
        statuses = mgr.status()
        assert [s.up for s in statuses] == [False, False]
        assert all("mps" in s.last_error for s in statuses)
    finally:
        store.close()


def test_a_reused_pid_in_a_stale_pid_file_is_never_signalled(root: Path) -> None:
    from gpud.mps.daemon import ControlDaemon

    daemon = ControlDaemon(gpu_uuid(0), root / "run", ["/bin/false"], sleep=lambda s: None)
    daemon.pipe_dir.mkdir(parents=True)
    other = subprocess.Popen(["sleep", "30"])  # an unrelated process that got the PID
    try:
        pid_file = daemon.pipe_dir / "nvidia-cuda-mps-control.pid"
        pid_file.write_text(f"{other.pid}\n")
        an_hour_ago = time.time() - 3600
        os.utime(pid_file, (an_hour_ago, an_hour_ago))  # left by a daemon that died
        assert daemon.pid() is None
        daemon.kill()
        daemon.stop(timeout_s=0.1)
        assert other.poll() is None
        os.utime(pid_file)  # written now: the process may be the daemon
        assert daemon.pid() == other.pid
    finally:
        other.kill()
        other.wait()


class _UnwritableStore(StateStore):
    """A state database whose transactions fail, as on a full disk, while ``unwritable``;
    ``tries``: those that failed."""

    unwritable = False
    tries = 0

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        if self.unwritable:
            self.tries += 1
            raise StateUnwritable(f"state database {self.path} cannot be written")
        with super().transaction() as conn:
            yield conn


def test_limits_not_moved_to_a_re_created_mig_device_are_moved_at_a_later_try(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A state database that cannot be written when MIG devices are re-created (a full
    disk): the observe (the sampler's listener, every tick) goes on, logs it once, and the
    limits are moved at a try RESTORE_RETRY_S later, not at every observe in between."""
    now = [0.0]
    store = _UnwritableStore(root / "state")
    mgr, _, _ = make_manager(root, enabled=False, clock=lambda: now[0], store=store)
    try:

        def mig(uuid: str) -> MpsTarget:
            return MpsTarget(uuid, 0, 0, "3g.40gb", 40 * GIB, gpu_uuid(0), (0, 4))

        mgr.observe([mig("MIG-a")])
        mgr.set_limits("MIG-a", threads_percent=40)
        store.unwritable = True
        for _ in range(3):
            mgr.observe([mig("MIG-c")])
        assert store.tries == 1
        assert [t.uuid for t in mgr.targets()] == ["MIG-c"]
        now[0] += RESTORE_RETRY_S
        mgr.observe([mig("MIG-c")])
        assert store.tries == 2
        warned = [r for r in caplog.records if "were not moved" in r.getMessage()]
        assert len(warned) == 1 and not warned[0].exc_info
        store.unwritable = False
        mgr.observe([mig("MIG-c")])
        assert mgr.limits("MIG-c") == MpsLimits()  # not before its try
        now[0] += RESTORE_RETRY_S
        caplog.set_level(logging.INFO)
        mgr.observe([mig("MIG-c")])
        assert mgr.limits("MIG-c").threads_percent == 40
        assert any("were moved to them" in r.getMessage() for r in caplog.records)
    finally:
        mgr.stop()
        store.close()


def test_device_lists_name_index_forms_not_uuids() -> None:
    from gpud.mps.manager import MpsTarget, device_names

    def t(gpu: int, mig: int | None) -> MpsTarget:
        return MpsTarget(f"X-{gpu}-{mig}", gpu, mig, "p", 1)

    targets = [t(1, None), t(0, None), *(t(2, m) for m in range(7)), t(3, 0), t(3, 2), t(4, 1)]
    assert device_names(targets) == "0, 1, 2:0..6, 3:0,2, 4:1"
    assert device_names([t(5, 0), t(5, 1)]) == "5:0,1"
    assert device_names([]) == ""


def test_limits_follow_a_mig_device_to_its_new_uuid_by_place_and_profile(root: Path) -> None:
    mgr, store, events = make_manager(root, enabled=False)
    try:

        def mig(uuid: str, start: int, profile: str = "3g.40gb") -> MpsTarget:
            return MpsTarget(uuid, 0, start // 4, profile, 40 * GIB, gpu_uuid(0), (start, 4))

        mgr.observe([mig("MIG-a", 0), mig("MIG-b", 4)])
        mgr.set_limits("MIG-a", threads_percent=40, memory_bytes=2 * GIB)
        mgr.set_limits("MIG-b", threads_percent=70)
        # A reset re-created them: new UUIDs; the second place now holds another profile.
        mgr.observe([mig("MIG-c", 0), mig("MIG-d", 4, "4g.40gb")])
        assert mgr.limits("MIG-c") == MpsLimits(40, 2 * GIB)
        assert mgr.limits("MIG-d") == MpsLimits()
        assert mgr.limits("MIG-a") == MpsLimits()  # the old UUID's row moved, not copied
        restored = events.recent(kind_prefix="mps.limits_restored")
        assert [(e.fields["previous_uuid"], e.fields["uuid"]) for e in restored] == [
            ("MIG-a", "MIG-c")
        ]
        assert restored[0].fields["placement"] == "0:4"
        # Seen before: observing again changes nothing; limits set on the new UUID stay.
        mgr.set_limits("MIG-c", threads_percent=55)
        mgr.observe([mig("MIG-c", 0), mig("MIG-d", 4, "4g.40gb")])
        assert mgr.limits("MIG-c").threads_percent == 55
        assert len(events.recent(kind_prefix="mps.limits_restored")) == 1
    finally:
        mgr.stop()
        store.close()


def test_a_hung_daemon_blocks_neither_status_nor_other_devices(root: Path) -> None:
    # the hung query waits a minute: status and GPU 1's limits are done while it is pending
    clock = Stepped()
    mgr, store, _ = make_manager(root, timeout_s=60.0, request_timeout_s=10.0, clock=clock)
    pid = None
    passing: threading.Thread | None = None
    try:
        mgr.reconcile(NODE)
        pid = mgr.status()[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        clock.ahead = since = 1e6
        passing = threading.Thread(target=mgr.reconcile)
        passing.start()
        # the pass is in its query to GPU 0, and its check of GPU 1 is over (GPU 1's limits,
        # set while that check runs, would wait for it)
        until(
            lambda: held_elsewhere(mgr, gpu_uuid(0)) and checked_since(mgr, gpu_uuid(1), since),
            "the pass held on GPU 0 alone",
        )
        assert len(mgr.status()) == 2
        mgr.set_limits("1", threads_percent=40)
        assert held(mgr, gpu_uuid(1))["default_active_thread_percentage"] == 40.0
        assert held_elsewhere(mgr, gpu_uuid(0))  # neither waited for GPU 0's query
        os.kill(pid, signal.SIGKILL)  # the query to it fails: the pass ends
        passing.join()
        assert not mgr.status()[0].up and mgr.status()[1].up
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if passing is not None:
            passing.join()
        mgr.stop()
        store.close()


def test_a_daemon_whose_pipe_dir_was_deleted_is_replaced_not_left_running(root: Path) -> None:
    mgr, store, events = make_manager(root)
    try:
        mgr.reconcile(NODE)
        old = mgr.status()[0]
        assert old.pid is not None
        shutil.rmtree(old.pipe_dir)  # its PID file and control socket go with it

        mgr.reconcile(NODE)
        new = mgr.status()[0]
        assert new.up and new.pid is not None and new.pid != old.pid
        wait_dead(old.pid)
        (stop,) = [e for e in events.recent(kind_prefix="mps.stop") if e.kind == "mps.stop"]
        assert stop.fields["pid"] == old.pid and stop.fields["how"] == "sigkill"
        assert stop.message.endswith("(it lost its pipe directory): SIGKILL ended it")
    finally:
        mgr.stop()
        store.close()


def test_limits_set_on_a_device_whose_daemon_hangs_are_kept_and_applied_later(
    root: Path,
) -> None:
    clients = root / "clients"  # the pipe directory of each control client run, a line each
    wrapper = control_wrapper(
        root, f'echo "$CUDA_MPS_PIPE_DIRECTORY" >> {shlex.quote(str(clients))}'
    )
    mgr, store, events = make_manager(root, [str(wrapper)], timeout_s=2.0)
    try:
        mgr.reconcile(NODE)
        pid = mgr.status()[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        mgr.reconcile()  # its health check fails: down
        asked = clients.read_text().splitlines()
        status = mgr.set_limits("0", threads_percent=40)
        assert clients.read_text().splitlines() == asked  # no daemon was asked again
        assert status.desired.threads_percent == 40 and not status.up
        os.kill(pid, signal.SIGCONT)
        mgr.reconcile()
        assert mgr.status()[0].up
        assert held(mgr, gpu_uuid(0))["default_active_thread_percentage"] == 40.0
        assert not events.recent(kind_prefix="mps.drift")  # the change itself, not drift
    finally:
        os.kill(pid, signal.SIGCONT)
        mgr.stop()
        store.close()


def test_hung_daemons_cost_one_pass_one_timeout_and_others_are_checked_on_time(
    root: Path,
) -> None:
    """Three of four daemons hang: the pass waits one query timeout, not three (their
    queries and the fourth's check are all under way at once), each hung daemon is reported
    with its GPU, and the fourth's drift is repaired."""
    # Once armed, each control client first waits until one has started for every device:
    # one whose wait ends that way is noted in ``met``; checked one after another, a hung
    # device's client would be killed at its timeout still waiting.
    armed, started, met = root / "armed", root / "started", root / "met"
    dirs = f"$(sort -u {shlex.quote(str(started))} | wc -l)"
    wrapper = control_wrapper(
        root,
        f"""if [ -e {shlex.quote(str(armed))} ]; then
  echo "$CUDA_MPS_PIPE_DIRECTORY" >> {shlex.quote(str(started))}
  n=0
  while [ "{dirs}" -lt 4 ] && [ $n -lt 3000 ]; do n=$((n+1)); sleep 0.01; done
  if [ "{dirs}" -ge 4 ]; then echo "$CUDA_MPS_PIPE_DIRECTORY" >> {shlex.quote(str(met))}; fi
fi""",
    )
    node = snapshot(*(gpu_sample(i) for i in range(4)))
    # long beside four clients' start, that the wait before the hung ones' is not cut short
    mgr, store, events = make_manager(root, [str(wrapper)], timeout_s=3.0)
    pids: list[int] = []
    try:
        mgr.reconcile(node)
        assert all(s.up for s in mgr.status())
        pids = [p for s in mgr.status()[:3] if (p := s.pid) is not None]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        # GPU 3's daemon is changed behind gpud's back: its next check re-applies the limits
        ControlDaemon(gpu_uuid(3), root / "run", FAKE_CONTROL).query(
            "set_default_active_thread_percentage 30"
        )
        armed.touch()
        mgr.reconcile()
        armed.unlink()
        pipes = {str(s.pipe_dir) for s in mgr.status()}
        assert set(met.read_text().splitlines()) == pipes  # all four under way at once
        assert events.recent(kind_prefix="mps.drift")
        status = mgr.status()
        assert [s.up for s in status] == [False, False, False, True]
        assert held(mgr, gpu_uuid(3))["default_active_thread_percentage"] == 100.0
        hung = events.recent(kind_prefix="mps.hung")
        assert sorted(e.fields["gpu"] for e in hung) == [0, 1, 2]
        assert all(f"GPU {e.fields['gpu']}" in e.message for e in hung)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        mgr.reconcile()
        assert all(s.up for s in mgr.status())
        recovered = events.recent(kind_prefix="mps.recovered")
        assert sorted(e.fields["gpu"] for e in recovered) == [0, 1, 2]
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        mgr.stop()
        store.close()


def test_limits_set_on_a_daemon_that_has_just_hung_return_at_once_naming_it(root: Path) -> None:
    """The daemon hangs after its last good check: ``gpuctl mps set`` waits on it
    ``request_timeout_s``, not its query timeout (past gpuctl's own 10 s deadline), whether a
    health check of it is under way or not, and the answer says it does not answer."""
    clock = Stepped()
    # a request's wait is short beside the query timeout, yet long enough that a daemon that
    # answers answers within it on a loaded machine (each command is a python client)
    mgr, store, events = make_manager(root, timeout_s=30.0, request_timeout_s=3.0, clock=clock)
    pid = None
    try:
        mgr.reconcile(NODE)
        pid = mgr.status()[0].pid
        assert pid is not None and mgr.status()[0].up
        os.kill(pid, signal.SIGSTOP)
        clock.ahead = since = 1e6
        passing = threading.Thread(target=mgr.reconcile)  # its check waits on GPU 0 (30 s)
        passing.start()
        try:
            # the pass is in its query to GPU 0, and its check of GPU 1 is over (GPU 1's limits,
            # set while that check runs, would wait for it)
            until(
                lambda: held_elsewhere(mgr, gpu_uuid(0)) and checked_since(mgr, gpu_uuid(1), since),
                "the pass held on GPU 0 alone",
            )
            status = mgr.set_limits("0", threads_percent=45)
            assert not status.up
            assert "GPU 0 is still busy with a command after 3 s" in status.last_error
            assert held_elsewhere(mgr, gpu_uuid(0))  # the check's query has not returned
            mgr.set_limits("1", threads_percent=50)  # GPU 1 answers: applied at once
            assert held(mgr, gpu_uuid(1))["default_active_thread_percentage"] == 50.0
        finally:
            os.kill(pid, signal.SIGCONT)
            passing.join()
        mgr.reconcile()  # the check under way had read the old limits: this one applies them
        assert mgr.status()[0].up
        assert held(mgr, gpu_uuid(0))["default_active_thread_percentage"] == 45.0
        assert not events.recent(kind_prefix="mps.drift")  # the change itself, not drift

        os.kill(pid, signal.SIGSTOP)  # no check under way: the change's own check times out
        status = mgr.set_limits("0", threads_percent=40)
        assert status.desired.threads_percent == 40 and not status.up
        assert "did not answer within 3s" in status.last_error  # not the daemon's 30 s
        hung = events.recent(kind_prefix="mps.hung")
        assert [e.fields["gpu"] for e in hung] == [0] and "GPU 0" in hung[0].message
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        mgr.stop()
        store.close()


def test_clearing_the_memory_limit_of_a_daemon_that_has_just_hung_fails_at_once(
    root: Path,
) -> None:
    """Whether MPS servers still serve clients cannot be asked: refused within
    ``request_timeout_s``, naming the GPU, the limit kept."""
    mgr, store, _ = make_manager(root, timeout_s=30.0, request_timeout_s=0.5)
    pid = None
    try:
        mgr.reconcile(NODE)
        mgr.set_limits("0", memory_bytes=8 * GIB)
        pid = mgr.status()[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(DriverTimeout, match=r"GPU 0 .*did not answer within 0\.5 s") as err:
            mgr.set_limits("0", clear_memory=True)
        # the control client itself was given 0.5 s, not the daemon's 30
        assert "did not answer within 0.5s" in str(err.value.__cause__)
        assert mgr.limits(gpu_uuid(0)).memory_bytes == 8 * GIB
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        mgr.stop()
        store.close()


def test_a_gone_device_leaves_no_directory_behind(manager: MpsManager, root: Path) -> None:
    # MIG devices get new UUIDs each time they are created: the directory of one destroyed
    # would never be used again, and /run would fill with them over reconfigurations
    manager.reconcile(MIG_NODE)
    gone = {s.target.uuid: s for s in manager.status()}[mig_uuid(0, 2)]
    assert gone.pid is not None and gone.pipe_dir.is_dir()
    kept = {s.target.uuid: s for s in manager.status()}[mig_uuid(0, 0)]
    manager.reconcile(
        snapshot(gpu_sample(0, migs=(("3g.40gb", 40), ("2g.20gb", 20))), gpu_sample(1))
    )
    wait_dead(gone.pid)
    assert not (root / "run" / "mps" / mig_uuid(0, 2)).exists()
    assert kept.pipe_dir.is_dir()  # the others keep theirs
    assert sorted(p.name for p in (root / "run" / "mps").iterdir()) == sorted(
        [mig_uuid(0, 0), mig_uuid(0, 1), gpu_uuid(1)]
    )


def test_directories_of_devices_gone_while_gpud_was_down_are_removed(root: Path) -> None:
    first, store, _ = make_manager(root)
    try:
        first.reconcile(MIG_NODE)
        orphan = {s.target.uuid: s.pid for s in first.status()}[mig_uuid(0, 2)]
        assert orphan is not None
    finally:
        store.close()  # gpud killed: the daemons run on
    stale = root / "run" / "mps" / "MIG-00000000-0000-0000-0000-00000000dead"
    (stale / "log").mkdir(parents=True)
    (stale / "log" / "control.log").write_text("a daemon of long ago\n")
    hung_start = snapshot(
        gpu_sample(0, migs=(("3g.40gb", 40), ("2g.20gb", 20))),
        gpu_sample(1)._replace(
            healthy=False, reason="not answering: a driver call is outstanding", mig_mode=None
        ),
    )
    second, store, events = make_manager(root)
    try:
        # while a GPU does not answer, a directory may be its device's: nothing is removed
        second.reconcile(hung_start)
        assert stale.is_dir() and alive(orphan)
        # 0:2 was destroyed while gpud was down: its daemon is stopped, its directory goes
        second.reconcile(
            snapshot(gpu_sample(0, migs=(("3g.40gb", 40), ("2g.20gb", 20))), gpu_sample(1))
        )
        wait_dead(orphan)
        assert not stale.exists()
        assert not (root / "run" / "mps" / mig_uuid(0, 2)).exists()
        assert sorted(p.name for p in (root / "run" / "mps").iterdir()) == sorted(
            [mig_uuid(0, 0), mig_uuid(0, 1), gpu_uuid(1)]
        )
        assert any(
            e.kind == "mps.stop" and e.fields.get("uuid") == mig_uuid(0, 2) for e in events.recent()
        )
    finally:
        second.stop()
        store.close()


def test_mps_off_stops_the_daemons_of_devices_gone_while_gpud_was_down(root: Path) -> None:
    """A run with MPS on left daemons; the next runs with MPS off, after a MIG device went
    meanwhile: that device's daemon is stopped too, not only those of devices still there."""
    first, store, _ = make_manager(root)
    try:
        first.reconcile(MIG_NODE)
        pids = {s.target.uuid: s.pid for s in first.status()}
        orphan = pids[mig_uuid(0, 2)]
        assert orphan is not None
    finally:
        store.close()  # gpud killed: the daemons run on
    second, store, events = make_manager(root, enabled=False)
    try:
        second.reconcile(
            snapshot(gpu_sample(0, migs=(("3g.40gb", 40), ("2g.20gb", 20))), gpu_sample(1))
        )
        wait_dead(orphan)
        for uuid in (mig_uuid(0, 0), mig_uuid(0, 1), gpu_uuid(1)):
            pid = pids[uuid]
            assert pid is not None
            wait_dead(pid)
        assert not (root / "run" / "mps" / mig_uuid(0, 2)).exists()
        (stop,) = [
            e
            for e in events.recent()
            if e.kind == "mps.stop" and e.fields["uuid"] == mig_uuid(0, 2)
        ]
        assert "gone while gpud was not running" in stop.message
    finally:
        second.stop()
        store.close()


def _statvfs(free_bytes: int, free_files: int = 1000) -> os.statvfs_result:
    # f_bsize, f_frsize, f_blocks, f_bfree, f_bavail, f_files, f_ffree, f_favail, f_flag,
    # f_namemax
    blocks = free_bytes // 4096
    return os.statvfs_result((4096, 4096, 16, blocks, blocks, 2000, free_files, free_files, 0, 255))


@pytest.mark.parametrize(
    ("space", "said"),
    [
        (_statvfs(0), "no space left"),
        (_statvfs(8192), "8 KiB free"),
        (_statvfs(1 << 30, free_files=0), "no inodes left"),
        (_statvfs(1 << 30), None),
    ],
)
def test_a_daemon_that_fails_to_start_on_a_full_run_dir_says_so(
    root: Path, space: os.statvfs_result, said: str | None
) -> None:
    # the control daemon writes its PID file, socket and log there, and says no more than
    # that it failed: the operator is told the file system is full, and which
    daemon = ControlDaemon(
        gpu_uuid(0), root / "run", ["/bin/false"], sleep=lambda s: None, statvfs=lambda p: space
    )
    with pytest.raises(BackendError) as err:
        daemon.start()
    if said is None:
        assert "free" not in str(err.value) and "left" not in str(err.value)
    else:
        assert said in str(err.value)
        assert f"on the file system of {root / 'run' / 'mps'}" in str(err.value)


def test_every_directory_to_the_pipes_lets_other_users_through(root: Path) -> None:
    """Jobs' CUDA clients of any user connect through ``<run_dir>/mps/<uuid>/pipe``: under the
    unit's umask 0027 gpud's mkdir would leave ``<run_dir>/mps`` 0750, closed to them."""
    old = os.umask(0o027)
    try:
        mgr, store, _ = make_manager(root)
        try:
            mgr.reconcile(NODE)
        finally:
            mgr.stop()
            store.close()
    finally:
        os.umask(old)
    pipe = root / "run" / "mps" / gpu_uuid(0) / "pipe"
    for directory in (pipe.parent.parent, pipe.parent, pipe):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o755, directory


def test_a_stop_given_a_longer_exit_wait_stays_within_the_bound_it_is_said_in_flight_for(
    root: Path,
) -> None:
    """A daemon stuck in the driver outlives quit, SIGTERM and SIGKILL: :meth:`stop` with
    an exit wait of its own takes all of it, and :meth:`stop_s` given the same counts it."""
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    stuck = subprocess.Popen(["sleep", "600"])
    try:
        daemon = ControlDaemon(
            gpu_uuid(0),
            root / "run",
            FAKE_CONTROL,
            sleep=sleep,
            clock=lambda: now[0],
            alive=lambda pid, proc_root: True,
        )
        assert daemon.stop(timeout_s=30.0, pid=stuck.pid, quit_s=1.0) is None
        assert 30.0 < now[0] <= daemon.stop_s(quit_s=1.0, timeout_s=30.0)
        # both waits named, as stop takes them: neither read as the other by position
        with pytest.raises(TypeError):
            daemon.stop_s(1.0, timeout_s=30.0)  # type: ignore[call-arg]
    finally:
        stuck.kill()
        stuck.wait()


def test_with_no_daemon_running_a_stop_says_nothing(root: Path) -> None:
    mgr, store, events = make_manager(root, enabled=False)
    try:
        mgr.reconcile(NODE)
        mgr.leave()
        assert not events.recent()
    finally:
        store.close()


class PlainCgroupTree(JobCgroups):
    """Cgroup directories in a plain directory tree: ``cgroup.procs`` is a file, and a
    directory goes (as the kernel removes a cgroup) once no process it lists runs, and a
    process moved into one leaves the one it was in (a process is in one cgroup)."""

    def place(self, job: str, pid: int) -> Path:
        for procs in self.mount.rglob("cgroup.procs"):
            pids = procs.read_text().split()
            if str(pid) in pids:
                procs.write_text("".join(f"{p}\n" for p in pids if p != str(pid)))
        return super().place(job, pid)

    def remove(self, job: str) -> bool:
        if any(alive(pid) for pid in self.pids(job)):
            return False
        (self.dir(job) / "cgroup.procs").unlink(missing_ok=True)
        return super().remove(job)


def test_each_daemon_is_moved_into_a_cgroup_of_its_own(root: Path) -> None:
    """Out of gpud's own cgroup, whose processes systemd kills at gpud's stop (KillMode=mixed):
    ``<mount>/<traffic.cgroup_parent>/gpud-mps-<uuid>``, removed once the daemon is stopped
    for good, kept when gpud's stop leaves it running."""
    cgroups = PlainCgroupTree(root / "cg", parent="gpud", prefix=CGROUP_PREFIX)
    (root / "cg").mkdir()
    mgr, store, _ = make_manager(root, cgroups=cgroups)
    try:
        mgr.reconcile(NODE)
        pids = {s.target.uuid: s.pid for s in mgr.status()}
        for uuid, pid in pids.items():
            directory = root / "cg" / "gpud" / f"gpud-mps-{uuid}"
            assert (directory / "cgroup.procs").read_text() == f"{pid}\n"
            assert stat.S_IMODE(directory.stat().st_mode) == 0o755
        assert stat.S_IMODE((root / "cg" / "gpud").stat().st_mode) == 0o755
        assert cgroups.jobs() == sorted(pids)
        mgr.set_limits("1", enabled=False)  # stopped for good: its cgroup goes
        assert cgroups.jobs() == [gpu_uuid(0)]
        mgr.leave()  # gpud stops: the running daemon keeps its cgroup
        assert cgroups.jobs() == [gpu_uuid(0)]
    finally:
        store.close()
    # Adopted by the next start, a daemon that is not in its cgroup (started by an earlier
    # version, or by a gpud killed before it moved it) is moved there.
    (root / "cg" / "gpud" / f"gpud-mps-{gpu_uuid(0)}" / "cgroup.procs").write_text("")
    mgr, store, _ = make_manager(root, cgroups=cgroups)
    try:
        mgr.reconcile(NODE)
        procs = root / "cg" / "gpud" / f"gpud-mps-{gpu_uuid(0)}" / "cgroup.procs"
        assert procs.read_text() == f"{pids[gpu_uuid(0)]}\n"
        mgr.leave()
    finally:
        store.close()
    # The next start, with MPS off, stops it and removes its cgroup, and that of a device
    # gone meanwhile.
    (root / "cg" / "gpud" / f"gpud-mps-{mig_uuid(5, 0)}").mkdir()
    mgr, store, _ = make_manager(root, cgroups=cgroups, enabled=False)
    try:
        mgr.reconcile(NODE)
        pid = pids[gpu_uuid(0)]
        assert pid is not None
        wait_dead(pid)
        assert cgroups.jobs() == []
    finally:
        mgr.stop()
        store.close()


def test_without_a_usable_cgroup_daemons_run_in_gpuds_and_it_is_said_once(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (root / "cg").mkdir()
    (root / "cg" / "gpud").write_text("")  # no directory can be made there
    cgroups = PlainCgroupTree(root / "cg", parent="gpud", prefix=CGROUP_PREFIX)
    for options in (
        {"cgroups": cgroups},
        {"cgroups": None, "no_cgroups": "cgroup v2 is not mounted"},
    ):
        caplog.clear()
        mgr, store, _ = make_manager(root, **options)
        try:
            mgr.reconcile(NODE)
            assert all(s.up for s in mgr.status())
            said = [r.getMessage() for r in caplog.records if "own cgroup" in r.getMessage()]
            assert len(said) == 1, said
            assert "under systemd they, and the MPS jobs they serve, end when gpud" in said[0]
        finally:
            mgr.stop()
            store.close()
    assert "cgroup v2 is not mounted" in said[0]


def test_daemons_get_cgroups_under_the_traffic_cgroup_parent(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("30 24 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n")
    config = Config().with_overrides({"traffic.cgroup_parent": "infra/gpud"}, source="test")
    cgroups, why = mps_cgroups(config, mountinfo)
    assert cgroups is not None and why == ""
    assert cgroups.dir(gpu_uuid(0)) == Path(f"/sys/fs/cgroup/infra/gpud/gpud-mps-{gpu_uuid(0)}")
    mountinfo.write_text("30 24 0:26 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n")
    assert mps_cgroups(config, mountinfo) == (None, "cgroup v2 is not mounted")
    # a simulated node's fake daemons stay in gpud's cgroup, and say nothing of it
    sim = config.with_overrides({"backend.kind": "sim"}, source="test")
    assert mps_cgroups(sim, tmp_path / "none") == (None, "")


def test_daemons_left_under_another_run_dir_are_stopped_not_doubled(root: Path) -> None:
    """gpud stopped (its daemons left running), then started with another daemon.run_dir:
    the daemons of the old one are stopped before the new ones start, one per GPU, and
    their directories go."""
    first, store, _ = make_manager(root, run="run")
    first.reconcile(NODE)
    old = {s.target.uuid: s.pid for s in first.status()}
    first.leave()
    store.close()
    second, store, events = make_manager(root, run="run2")
    try:
        second.reconcile(NODE)
        for pid in old.values():
            assert pid is not None
            wait_dead(pid)
        new = {s.target.uuid: s.pid for s in second.status()}
        assert all(s.up and root / "run2" in s.pipe_dir.parents for s in second.status())
        assert not set(new.values()) & set(old.values())
        stopped = [e for e in events.recent() if e.kind == "mps.stop_moved"]
        assert sorted((e.fields["uuid"], e.fields["pid"]) for e in stopped) == sorted(old.items())
        assert stopped[0].fields["pipe_dir"] == str(
            root / "run" / "mps" / str(stopped[0].fields["uuid"]) / "pipe"
        )
        assert "outside daemon.run_dir" in stopped[0].message
        assert not (root / "run" / "mps").exists()
        assert not [e for e in events.recent() if e.kind == "mps.other_daemon"]
        second.leave()
    finally:
        store.close()
    # the next start with the same run dir adopts them, as ever
    third, store, events = make_manager(root, run="run2")
    try:
        third.reconcile(NODE)
        assert {s.target.uuid: s.pid for s in third.status()} == new
        assert {e.kind for e in events.recent()} == {"mps.adopt"}
    finally:
        third.stop()
        store.close()


def test_an_adopted_daemon_follows_a_changed_cgroup_parent(root: Path) -> None:
    (root / "cg").mkdir()
    before = PlainCgroupTree(root / "cg", parent="gpud", prefix=CGROUP_PREFIX)
    first, store, _ = make_manager(root, cgroups=before)
    first.reconcile(NODE)
    pids = {s.target.uuid: s.pid for s in first.status()}
    first.leave()
    store.close()
    after = PlainCgroupTree(root / "cg", parent="infra/gpud", prefix=CGROUP_PREFIX)
    second, store, events = make_manager(root, cgroups=after)
    try:
        second.reconcile(NODE)
        assert {s.target.uuid: s.pid for s in second.status()} == pids
        assert before.jobs() == []
        for uuid, pid in pids.items():
            assert (after.dir(uuid) / "cgroup.procs").read_text() == f"{pid}\n"
        moved = [e for e in events.recent() if e.kind == "mps.cgroup_moved"]
        assert sorted(str(e.fields["previous_cgroup"]) for e in moved) == sorted(
            str(before.dir(u)) for u in pids
        )
    finally:
        second.stop()
        store.close()


@pytest.mark.parametrize("deleted", ["pipe directory", "PID file"])
def test_a_daemon_that_lost_its_pipe_dir_under_an_earlier_gpud_is_stopped_at_start(
    root: Path, deleted: str
) -> None:
    """gpud killed -9, the pipe directory of one of its daemons deleted (or only the PID
    file in it), gpud started again: that daemon (no PID file names it, this run never knew
    its PID) is found by its environment and stopped before the device's new one starts,
    not left holding the GPU beside it. One whose pipe directory is not under gpud's run
    directory is left alone."""
    first, store, _ = make_manager(root)
    other = ControlDaemon(gpu_uuid(1), root / "elsewhere", FAKE_CONTROL, timeout_s=5.0)
    try:
        first.reconcile(NODE)
        old = {s.target.uuid: s for s in first.status()}
        other_pid = other.start()
    finally:
        store.close()  # killed -9: nothing stopped, its records kept
    lost = old[gpu_uuid(0)]
    assert lost.pid is not None
    if deleted == "PID file":
        (lost.pipe_dir / PID_FILE).unlink()
    else:
        shutil.rmtree(lost.pipe_dir)  # its PID file and control socket go with it
    shutil.rmtree(other.pipe_dir)  # not gpud's
    mgr, store, events = make_manager(root)
    try:
        mgr.reconcile(NODE)
        wait_dead(lost.pid)
        (stop,) = [e for e in events.recent(kind_prefix="mps.stop") if e.kind == "mps.stop"]
        assert stop.fields["pid"] == lost.pid and stop.fields["how"] == "sigkill"
        assert stop.fields["uuid"] == gpu_uuid(0)
        assert stop.message.endswith("(it lost its pipe directory): SIGKILL ended it")
        now = {s.target.uuid: s for s in mgr.status()}
        assert now[gpu_uuid(0)].up and now[gpu_uuid(0)].pid not in (None, lost.pid)
        assert now[gpu_uuid(1)].pid == old[gpu_uuid(1)].pid  # adopted, as ever
        assert daemons_under(root / "run") == {str(s.pipe_dir): s.pid for s in now.values()}
        assert alive(other_pid)
    finally:
        mgr.stop()
        store.close()
        for pid in (other_pid, lost.pid):  # none is left behind, whatever failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_simulated_reboot_ends_the_daemons_and_each_device_starts_anew(root: Path) -> None:
    """``gpuctl sim reboot``: as a real reboot, it ends every control daemon (one that lost
    its pipe directory too), and the next pass starts each device's anew, as gpud's start
    after a reboot would: one ``mps.start`` each, neither a restart nor a failed stop. A
    daemon under another directory is not this node's gpud's: it runs on."""
    other = ControlDaemon(gpu_uuid(0), root / "elsewhere", FAKE_CONTROL, timeout_s=5.0)
    mgr, store, events = make_manager(root)
    try:
        other_pid = other.start()
        mgr.reconcile(NODE)
        before = {s.target.uuid: s.pid for s in mgr.status()}
        shutil.rmtree(mgr.status()[1].pipe_dir)  # lost: no PID file names it
        with mgr.rebooting() as ended:
            assert ended == 2
        for pid in before.values():
            assert pid is not None
            wait_dead(pid)
        assert alive(other_pid)
        mgr.reconcile(NODE)
        after = mgr.status()
        assert all(s.up and s.restarts == 0 and s.pid not in before.values() for s in after)
        started = [
            e.fields["uuid"] for e in events.recent(kind_prefix="mps.") if e.kind == "mps.start"
        ]
        assert sorted(started) == sorted([*before, *before])
        kinds = {e.kind for e in events.recent(kind_prefix="mps.")}
        assert not kinds & {"mps.restart", "mps.stop", "mps.stop_failed", "mps.adopt"}, kinds
    finally:
        mgr.stop()
        store.close()
        other.stop()


def test_a_daemon_gpud_did_not_start_is_reported_not_stopped(root: Path) -> None:
    other = ControlDaemon(gpu_uuid(0), root / "elsewhere", FAKE_CONTROL, timeout_s=5.0)
    pid = other.start()
    mgr, store, events = make_manager(root)
    try:
        mgr.reconcile(NODE)
        (said,) = [
            e for e in events.recent() if e.kind == "mps.other_daemon" and e.fields["pid"] == pid
        ]
        assert said.fields["pipe_dir"] == str(other.pipe_dir)
        assert said.fields["devices"] == gpu_uuid(0)
        assert "did not start" in said.message and "left running" in said.message
        mgr.reconcile(NODE)  # said once, at the first pass
        said_again = [
            e for e in events.recent() if e.kind == "mps.other_daemon" and e.fields["pid"] == pid
        ]
        assert len(said_again) == 1
        assert alive(pid)
    finally:
        mgr.stop()
        store.close()
        other.stop()


class Killed(Exception):
    """gpud killed -9: raised by every transaction from then on, nothing more is written."""


class DyingStore(StateStore):
    """Killed at its ``die_at``-th outermost transaction (None: never) and at every one
    after: what the ones before committed is kept, as when gpud is killed there."""

    die_at: int | None = None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        if self.die_at is not None and not self._conn.in_transaction:
            self.die_at -= 1
            if self.die_at <= 0:
                raise Killed
        with super().transaction() as conn:
            yield conn


def daemons_under(root: Path) -> dict[str, int]:
    """The fake control daemons running with a pipe directory under ``root``, by it."""
    found = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"-d" not in argv or not any(b"fake_mps_control" in a for a in argv):
                continue
            env = dict(
                v.decode().partition("=")[::2]
                for v in (entry / "environ").read_bytes().split(b"\0")
                if v
            )
            pipe = env.get("CUDA_MPS_PIPE_DIRECTORY", "")
            if Path(pipe).is_relative_to(root) and alive(int(entry.name)):
                found[pipe] = int(entry.name)
    return found


@pytest.mark.parametrize("run", ["run", "run2"])
def test_a_gpud_killed_at_any_point_of_a_start_leaves_no_second_daemon(run: str) -> None:
    """gpud killed -9 anywhere in its first pass (a daemon started, its PID not yet
    recorded, say), then started again on the same state, with the same run_dir or
    another: one daemon, this run's, and none left of the killed one."""
    node = snapshot(gpu_sample(0))
    uuid = gpu_uuid(0)
    for point in range(1, 30):
        with short_dir() as root:
            store = DyingStore(root / "state")
            first = MpsManager(
                store, EventLog(None), root / "run", FAKE_CONTROL, timeout_s=5.0, others_root=root
            )
            store.die_at = point
            try:
                first.reconcile(node)
            except Killed:
                pass
            else:
                assert point > 2  # it was killed somewhere, at least once
                store.close()
                return
            store.close()
            second, store, _ = make_manager(root, run=run)
            try:
                second.reconcile(node)
                assert daemons_under(root) == {
                    str(root / run / "mps" / uuid / "pipe"): second.status()[0].pid
                }, f"killed at transaction {point}"
            finally:
                second.stop()
                store.close()
    raise AssertionError("never got through a pass")


@pytest.mark.parametrize("ticks", [None, 1])
def test_a_recorded_pid_now_another_process_is_never_signalled(
    root: Path, ticks: int | None
) -> None:
    """A daemon recorded under another run_dir died, and its PID went to another process:
    that process is left alone (recorded with another start time, or with none)."""
    uuid = gpu_uuid(0)
    other = subprocess.Popen(["sleep", "60"])
    try:
        pipe = root / "old" / "mps" / uuid / "pipe"
        pipe.mkdir(parents=True)
        (pipe / PID_FILE).write_text(f"{other.pid}\n")
        an_hour_ago = time.time() - 3600  # the dead daemon wrote it
        os.utime(pipe / PID_FILE, (an_hour_ago, an_hour_ago))
        mgr, store, events = make_manager(root)
        with store.transaction() as conn:
            conn.execute(
                "INSERT INTO mps_daemons VALUES (?, ?, ?, ?, ?)",
                (uuid, other.pid, ticks, str(pipe), ""),
            )
        try:
            mgr.reconcile(snapshot(gpu_sample(0)))
            assert other.poll() is None
            assert not [e for e in events.recent() if e.kind == "mps.stop_moved"]
            assert not (root / "old" / "mps").exists()
            assert mgr.status()[0].up
        finally:
            mgr.stop()
            store.close()
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("recorded", ["/", "", "pipe", "/pipe", "/mps/{uuid}/pipe", "keep/x/pipe"])
def test_a_record_naming_no_directory_gpud_makes_is_dropped_touching_nothing(
    root: Path, recorded: str
) -> None:
    """A pipe directory in the record that is not <run_dir>/mps/<uuid>/pipe (relative, the
    root, too short to hold a run_dir) stops and removes nothing; the pass goes on."""
    uuid = gpu_uuid(0)
    (root / "mps" / uuid).mkdir(parents=True)
    (root / "mps" / uuid / "data").write_text("not gpud's")
    pipe_dir = str(root / recorded) if recorded.startswith("keep") else recorded
    mgr, store, _ = make_manager(root)
    with store.transaction() as conn:
        conn.execute(
            "INSERT INTO mps_daemons VALUES (?, ?, ?, ?, ?)",
            (uuid, 0, None, pipe_dir.format(uuid=uuid), ""),
        )
    try:
        mgr.reconcile(NODE)
        assert all(s.up for s in mgr.status())
        assert (root / "mps" / uuid / "data").read_text() == "not gpud's"
        with store.transaction() as conn:
            (row,) = conn.execute(
                "SELECT pipe_dir FROM mps_daemons WHERE uuid = ?", (uuid,)
            ).fetchall()
        assert row[0] == str(root / "run" / "mps" / uuid / "pipe")
    finally:
        mgr.stop()
        store.close()


class StuckDaemons:
    """The manager's liveness check: the PIDs in ``pids`` run on after SIGKILL, as a daemon
    stuck in the driver does; and its clock, which a test moves on (waits move it too)."""

    def __init__(self) -> None:
        self.pids: set[int] = set()
        self.now = 0.0
        # the stuck daemons go at the next wait (a retried SIGKILL takes effect)
        self.free_on_wait = False

    def alive(self, pid: int, proc_root: Path) -> bool:
        return pid in self.pids or alive(pid, proc_root)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.free_on_wait:
            self.pids.clear()
        time.sleep(min(seconds, 0.01))

    def stick(self, pipe_dir: Path, pid: int) -> None:
        """The daemon ignores quit and SIGTERM, and looks alive after SIGKILL."""
        (pipe_dir / "fake-mps-stuck").touch()
        self.pids.add(pid)

    def options(self) -> dict[str, object]:
        return {"alive": self.alive, "clock": self.clock, "sleep": self.sleep}


def _record(store: StateStore, uuid: str) -> tuple[object, ...] | None:
    with store.transaction() as conn:
        row = conn.execute("SELECT pid, pipe_dir FROM mps_daemons WHERE uuid = ?", (uuid,))
        found = row.fetchone()
    return tuple(found) if found is not None else None


def test_a_daemon_that_outlives_sigkill_is_kept_and_retried(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A gone device's daemon that will not stop (stuck in the driver) is not reported
    stopped: its record and directory stay, one mps.stop_failed names it, and later passes
    try again, no sooner than a backoff, until it is gone."""
    stuck = StuckDaemons()
    mgr, store, events = make_manager(root, **stuck.options())
    try:
        mgr.reconcile(MIG_NODE)
        gone = mig_uuid(0, 2)
        (status,) = [s for s in mgr.status() if s.target.uuid == gone]
        assert status.pid is not None
        stuck.stick(status.pipe_dir, status.pid)
        fewer = snapshot(gpu_sample(0, migs=(("3g.40gb", 40), ("2g.20gb", 20))), gpu_sample(1))
        mgr.reconcile(fewer)
        (failed,) = events.recent(kind_prefix="mps.stop_failed")
        assert failed.fields["uuid"] == gone and failed.fields["pid"] == status.pid
        assert f"pid {status.pid}" in failed.message and "SIGKILL" in failed.message
        assert "GPU reset" in failed.message
        assert not [e for e in events.recent() if e.kind == "mps.stop"]
        assert _record(store, gone) == (status.pid, str(status.pipe_dir))
        assert status.pipe_dir.is_dir()

        # the next passes, within the backoff: not signalled again, not said again
        def tries() -> int:
            return sum("outlived SIGKILL" in r.getMessage() for r in caplog.records)

        assert tries() == 1
        mgr.reconcile(fewer)
        assert tries() == 1
        assert len(events.recent(kind_prefix="mps.stop_failed")) == 1
        # past the backoff it is tried again: still there, said no more
        stuck.now += 60
        mgr.reconcile(fewer)
        assert tries() == 2
        assert len(events.recent(kind_prefix="mps.stop_failed")) == 1
        assert _record(store, gone) is not None
        # once it has gone (the GPU reset), the next try forgets it and removes its directory
        stuck.pids.clear()
        stuck.now += 120
        mgr.reconcile(fewer)
        assert _record(store, gone) is None
        assert not status.pipe_dir.parent.exists()
    finally:
        stuck.pids.clear()
        mgr.stop()
        store.close()


def test_a_daemon_under_an_old_run_dir_that_will_not_stop_is_not_doubled(root: Path) -> None:
    """daemon.run_dir changed while a daemon left under the old one is stuck: no
    mps.stop_moved for it, its record stays, no second daemon starts for its GPU, and once
    it has gone the next pass takes over and starts the device's own."""
    first, store, _ = make_manager(root, run="run")
    first.reconcile(NODE)
    old = {s.target.uuid: s for s in first.status()}
    first.leave()
    store.close()
    stuck = StuckDaemons()
    held = old[gpu_uuid(0)]
    assert held.pid is not None
    stuck.stick(held.pipe_dir, held.pid)
    second, store, events = make_manager(root, run="run2", **stuck.options())
    try:
        second.reconcile(NODE)
        moved = events.recent(kind_prefix="mps.stop_moved")
        assert [e.fields["uuid"] for e in moved] == [gpu_uuid(1)]
        (failed,) = events.recent(kind_prefix="mps.stop_failed")
        assert failed.fields["uuid"] == gpu_uuid(0) and failed.fields["pid"] == held.pid
        assert "outside daemon.run_dir" in failed.message
        now = {s.target.uuid: s for s in second.status()}
        assert now[gpu_uuid(0)].pid is None and not now[gpu_uuid(0)].up
        assert "would not stop" in now[gpu_uuid(0)].last_error
        assert now[gpu_uuid(1)].up
        assert _record(store, gpu_uuid(0)) == (held.pid, str(held.pipe_dir))
        assert held.pipe_dir.is_dir()
        second.reconcile(NODE)  # within the backoff: still none beside it
        assert {s.target.uuid: s.pid for s in second.status()}[gpu_uuid(0)] is None
        stuck.pids.clear()
        stuck.now += 60
        second.reconcile(NODE)
        now = {s.target.uuid: s for s in second.status()}
        assert now[gpu_uuid(0)].up and root / "run2" in now[gpu_uuid(0)].pipe_dir.parents
        assert not (root / "run" / "mps").exists()
        assert _record(store, gpu_uuid(0)) == (now[gpu_uuid(0)].pid, str(now[gpu_uuid(0)].pipe_dir))
    finally:
        stuck.pids.clear()
        second.stop()
        store.close()


def test_a_reboot_ends_the_daemons_left_under_an_old_run_dir(root: Path) -> None:
    """daemon.run_dir changed, and the simulated node reboots before the first pass took
    over: as on a real node, the daemons left under the old run dir end with the others
    (counted), and the first pass then has none of them to stop, only their directories
    to remove, before each device's own starts under the new run dir."""
    first, store, _ = make_manager(root, run="run")
    first.reconcile(NODE)
    old = [s.pid for s in first.status()]
    first.leave()
    store.close()
    second, store, events = make_manager(root, run="run2")
    try:
        with second.rebooting() as ended:
            assert ended == 2
        assert None not in old and not [pid for pid in old if pid and alive(pid)]
        second.reconcile(NODE)
        assert not events.recent(kind_prefix="mps.stop_moved")
        now = second.status()
        assert all(s.up and root / "run2" in s.pipe_dir.parents for s in now)
        assert not {s.pid for s in now} & set(old)
        assert not (root / "run" / "mps").exists()
    finally:
        second.stop()
        store.close()


def test_a_reboot_ends_only_the_recorded_daemons_under_an_old_run_dir(root: Path) -> None:
    """daemon.run_dir changed, and another gpud (a simulated node of its own) now runs a
    daemon under the old one: the reboot ends the daemon this gpud's record names there,
    never the other gpud's, of a GPU no record names."""
    first, store, _ = make_manager(root, run="run")
    first.reconcile(snapshot(gpu_sample(0)))
    (recorded,) = [s.pid for s in first.status()]
    first.leave()
    store.close()
    other = ControlDaemon(gpu_uuid(1), root / "run", FAKE_CONTROL, timeout_s=5.0)
    theirs = other.start()
    second, store, _ = make_manager(root, run="run2")
    try:
        assert recorded is not None
        with second.rebooting() as ended:
            assert ended == 1
        assert not alive(recorded)
        assert alive(theirs) and other.pid() == theirs
    finally:
        second.stop()
        store.close()
        other.stop()


def test_after_a_reboot_a_device_whose_old_run_dir_daemon_would_not_stop_starts_its_own(
    root: Path,
) -> None:
    """A daemon left under the old daemon.run_dir that would not stop keeps its device's
    own from starting, with a backoff between tries; a reboot ends every process, so the
    pass after it takes over at once instead of after the backoff."""
    first, store, _ = make_manager(root, run="run")
    first.reconcile(NODE)
    held = {s.target.uuid: s for s in first.status()}[gpu_uuid(0)]
    first.leave()
    store.close()
    stuck = StuckDaemons()
    assert held.pid is not None
    stuck.stick(held.pipe_dir, held.pid)
    second, store, _ = make_manager(root, run="run2", **stuck.options())
    try:
        second.reconcile(NODE)
        assert {s.target.uuid: s.pid for s in second.status()}[gpu_uuid(0)] is None
        stuck.pids.clear()  # the reboot ends it
        with second.rebooting():
            pass
        second.reconcile(NODE)
        now = {s.target.uuid: s for s in second.status()}
        assert now[gpu_uuid(0)].up and root / "run2" in now[gpu_uuid(0)].pipe_dir.parents
        assert not (root / "run" / "mps").exists()
    finally:
        stuck.pids.clear()
        second.stop()
        store.close()


def test_mig_devices_about_to_be_destroyed_lose_their_daemons_first(root: Path) -> None:
    """What a MIG apply holds while it destroys instances: their daemons stopped, none
    started meanwhile; one that would not stop is named, with its pid."""
    stuck = StuckDaemons()
    mgr, store, events = make_manager(root, **stuck.options())
    try:
        mgr.reconcile(MIG_NODE)
        pids = {s.target.uuid: s for s in mgr.status()}
        held = pids[mig_uuid(0, 1)]
        assert held.pid is not None
        stuck.stick(held.pipe_dir, held.pid)
        with mgr.released([mig_uuid(0, 0), mig_uuid(0, 1)]) as left:
            assert list(left) == [mig_uuid(0, 1)]
            assert (
                f"MIG device 0:1 on GPU 0 ({mig_uuid(0, 1)}, pid {held.pid})"
                in left[mig_uuid(0, 1)]
            )
            mgr.reconcile(MIG_NODE)  # a pass meanwhile starts none for them
            assert {s.target.uuid: s.pid for s in mgr.status()}[mig_uuid(0, 0)] is None
        said = [(e.kind, e.fields["uuid"]) for e in events.recent(kind_prefix="mps.stop")]
        assert sorted(said) == [("mps.stop", mig_uuid(0, 0)), ("mps.stop_failed", mig_uuid(0, 1))]
        mgr.reconcile(MIG_NODE)  # after it, the device still there gets one again
        assert {s.target.uuid: s.up for s in mgr.status()}[mig_uuid(0, 0)]
    finally:
        stuck.pids.clear()
        mgr.stop()
        store.close()


def test_a_start_failing_after_a_mig_apply_stopped_a_daemon_that_had_failed_a_check_is_said(
    root: Path,
) -> None:
    """A daemon that failed a health check, answered nothing since, and was then stopped
    as planned (a MIG apply released its GPU) leaves no failed checks behind: its device's
    next start that fails is said (mps.start_failed) and backed off from 1 s, as a first."""
    failing = root / "failing"
    # the daemon (-d) does not start while ``failing`` exists; client commands still run
    wrapper = control_wrapper(
        root, f'[ "$1" = -d ] && [ -e {shlex.quote(str(failing))} ] && exit 1'
    )
    mgr, store, events = make_manager(root, [str(wrapper)], timeout_s=0.5, max_failures=3)
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        pid = mgr.status()[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        mgr.reconcile()  # one failed check, under max_failures: it is kept
        assert events.recent(kind_prefix="mps.hung")
        os.kill(pid, signal.SIGCONT)
        with mgr.released([gpu_uuid(0)]) as left:
            assert left == {}
        failing.touch()
        mgr.reconcile(snapshot(gpu_sample(0)))
        assert mgr.status()[0].pid is None
        (failed,) = events.recent(kind_prefix="mps.start_failed")
        assert failed.fields["uuid"] == gpu_uuid(0) and failed.fields["retry_in_s"] == 1.0
    finally:
        mgr.stop()
        store.close()


def test_a_daemon_that_would_not_stop_leaves_the_rest_of_its_gpu_alone(root: Path) -> None:
    """A MIG apply retried while one of the GPU's daemons is stuck: the stuck one is tried
    first, and while it runs the GPU's other daemons are not stopped again (they would be
    stopped and restarted on every retry otherwise)."""
    stuck = StuckDaemons()
    mgr, store, events = make_manager(root, **stuck.options())
    doomed = [mig_uuid(0, 0), mig_uuid(0, 1), mig_uuid(0, 2)]
    try:
        mgr.reconcile(MIG_NODE)
        held = {s.target.uuid: s for s in mgr.status()}[mig_uuid(0, 1)]
        assert held.pid is not None
        stuck.stick(held.pipe_dir, held.pid)
        with mgr.released(doomed) as left:  # found stuck now: the others were stopped
            assert list(left) == [mig_uuid(0, 1)]
        mgr.reconcile(MIG_NODE)  # and get theirs again
        serving = {s.target.uuid: s.pid for s in mgr.status()}
        stops = len(events.recent(kind_prefix="mps.stop"))
        for later in (0, 60):  # within its backoff, and past it (tried again, still there)
            stuck.now += later
            with mgr.released(doomed) as left:
                assert list(left) == [mig_uuid(0, 1)]
                assert {s.target.uuid: s.pid for s in mgr.status()} == serving
            mgr.reconcile(MIG_NODE)
        assert len(events.recent(kind_prefix="mps.stop")) == stops
        assert not events.recent(kind_prefix="mps.restart")
        assert {s.target.uuid: s.pid for s in mgr.status()} == serving
    finally:
        stuck.pids.clear()
        mgr.stop()
        store.close()


def test_a_daemon_stuck_again_after_it_went_is_said_again(root: Path) -> None:
    """A daemon that would not stop goes by itself (a GPU reset); its device's next daemon
    that would not stop gets its own mps.stop_failed, not a log line and an old backoff."""
    stuck = StuckDaemons()
    mgr, store, events = make_manager(root, **stuck.options())
    try:
        mgr.reconcile(MIG_NODE)
        for _ in range(2):
            held = {s.target.uuid: s for s in mgr.status()}[mig_uuid(0, 1)]
            assert held.pid is not None
            stuck.stick(held.pipe_dir, held.pid)
            with mgr.released([mig_uuid(0, 1)]) as left:
                assert list(left) == [mig_uuid(0, 1)]
            stuck.pids.clear()  # it goes (SIGKILL took it once it came out of the driver)
            stuck.now += 60
            mgr.reconcile(MIG_NODE)  # and the device gets a new one
        failed = events.recent(kind_prefix="mps.stop_failed")
        assert [e.fields["uuid"] for e in failed] == [mig_uuid(0, 1)] * 2
    finally:
        stuck.pids.clear()
        mgr.stop()
        store.close()


def test_destroying_mig_devices_waits_on_a_busy_daemon_seconds_at_most(root: Path) -> None:
    """A daemon a pass is still talking to past its query's timeout (its client stuck in the
    driver) holds a MIG apply's stops no longer than ``request_timeout_s``: it is named busy,
    and the others are stopped meanwhile, not after it."""
    # the hung query waits a minute, far past the release's 0.3 s, and the manager's clock is
    # moved past that minute: to the manager the query is past its timeout and has not
    # returned. The release is over while the pass still holds 0:0, and SIGCONT ends that
    # query once it is
    clock = Stepped()
    mgr, store, events = make_manager(root, timeout_s=60.0, request_timeout_s=0.3, clock=clock)
    pid = None
    passing: threading.Thread | None = None
    try:
        mgr.reconcile(MIG_NODE)
        pids = {s.target.uuid: s.pid for s in mgr.status()}
        pid = pids[mig_uuid(0, 0)]
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        clock.ahead = since = 1e6
        passing = threading.Thread(target=mgr.reconcile)
        passing.start()
        # the pass holds 0:0 in its query, and has checked 0:2 and let it go: 0:2 is free
        # before the pass reaches it too, and then the pass takes it while the release waits
        # its query said in flight before the clock moves: sent after, it is not past its
        # timeout, and the stop waits the whole minute for it
        until(
            lambda: (
                held_elsewhere(mgr, mig_uuid(0, 0))
                and mgr._devices[mig_uuid(0, 0)].in_flight is not None
                and checked_since(mgr, mig_uuid(0, 2), since)
            ),
            "the pass held on 0:0 alone",
        )
        clock.ahead = since + 61.0
        with mgr.released([mig_uuid(0, 0), mig_uuid(0, 2)]) as left:
            assert list(left) == [mig_uuid(0, 0)]
            assert (
                "was not stopped: busy: its command 'get_default_active_thread_percentage' has"
                " not returned" in left[mig_uuid(0, 0)]
            )
            assert "past its own timeout" in left[mig_uuid(0, 0)]
            # the release did not wait for the pass's query to 0:0: it has not returned
            assert held_elsewhere(mgr, mig_uuid(0, 0))
        stopped = [e.fields["uuid"] for e in events.recent(kind_prefix="mps.stop")]
        assert stopped == [mig_uuid(0, 2)]
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        if passing is not None:
            passing.join()
        mgr.stop()
        store.close()


class HeldOnAScript:
    """A device's lock that another operation on its daemon holds on a script, on a clock
    (``now[0]``, the manager's) that only waiting for the lock moves. ``steps``, one after
    another from ``start``: (seconds, the command in flight, None between two), each
    command said in flight as the manager says its own (``_Device.in_flight``, sent with
    ``timeout_s``, and ``command``); the lock is free after the last step."""

    def __init__(
        self,
        dev: Any,
        now: list[float],
        steps: list[tuple[float, str | None]],
        *,
        timeout_s: float,
        start: float = 0.0,
    ) -> None:
        self._dev, self._now, self._timeout_s = dev, now, timeout_s
        self._spans: list[tuple[float, float, str | None]] = []
        for seconds, command in steps:
            self._spans.append((start, start + seconds, command))
            start += seconds
        self.free_at = start
        self._show()

    def _show(self) -> None:
        now = self._now[0]
        span = next(((b, c) for b, e, c in self._spans if b <= now < e), (None, None))
        begun, command = span
        self._dev.in_flight = (
            None if begun is None or command is None else (begun + self._timeout_s, command)
        )

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        now = self._now[0]
        held = timeout < 0 or self.free_at <= now + timeout
        self._now[0] = max(now, self.free_at) if held else now + timeout
        self._show()
        return held

    def release(self) -> None:
        pass

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *_: object) -> None:
        self.release()


def _stop_held_on(
    root: Path, steps: list[tuple[float, str | None]], *, start: float = 0.0
) -> tuple[dict[str, str], float]:
    """A MIG apply's stop of 0:0 asked at 0 while another operation holds its daemon on
    ``steps`` (:class:`HeldOnAScript`; ``timeout_s`` 10, ``request_timeout_s`` 2): why 0:0
    still has a daemon (nothing: it got the lock), and when the stop ended its wait."""
    now = [0.0]
    mgr, store, _ = make_manager(root, timeout_s=10.0, request_timeout_s=2.0, clock=lambda: now[0])
    try:
        dev = mgr._device(mig_uuid(0, 0))
        dev.io = HeldOnAScript(dev, now, steps, timeout_s=10.0, start=start)  # type: ignore[assignment]
        with mgr.released([mig_uuid(0, 0)]) as left:
            return dict(left), now[0]
    finally:
        mgr.stop()
        store.close()


def test_a_stop_waits_one_command_and_request_timeout_s_however_many_commands_follow(
    root: Path,
) -> None:
    """A health check of a daemon slow to answer sends six commands, each answered within
    its 10 s timeout: a MIG apply's stop waits 12 s for the daemon (the longest one command
    may take, and ``request_timeout_s``), not for the six, and names the command it left
    in flight."""
    left, ended = _stop_held_on(root, [(9.0, "get_server_list")] * 6)
    assert ended == 12.0
    assert left[mig_uuid(0, 0)] == (
        f"the MPS control daemon of MIG device ({mig_uuid(0, 0)}) was not stopped: busy: its"
        " command 'get_server_list' was still in flight after the stop waited 12 s, the"
        " longest wait a stop gives one command to it"
    )


def test_a_stop_that_asked_while_a_check_is_between_commands_gets_the_daemon(
    root: Path,
) -> None:
    """The stop's wait for a command's timeout ends while the check is between two commands
    (writing to its database), every command answered within its timeout: the stop goes on
    waiting, gets the daemon once the check is over, and stops it."""
    steps: list[tuple[float, str | None]] = [
        (9.0, "get_default_active_thread_percentage"),
        (4.0, None),
        (3.0, "get_server_list"),
    ]
    left, ended = _stop_held_on(root, steps, start=-8.0)
    assert (left, ended) == ({}, 8.0)


def test_a_stop_fails_a_command_hung_past_its_timeout_request_timeout_s_after_it_asked(
    root: Path,
) -> None:
    """A command past its own timeout whose control client has not returned (stuck in the
    driver): the stop gives up ``request_timeout_s`` after it asked, naming the command."""
    left, ended = _stop_held_on(root, [(1e9, "get_server_list")], start=-20.0)
    assert ended == 2.0
    assert left[mig_uuid(0, 0)].endswith(
        "busy: its command 'get_server_list' has not returned 12 s past its own timeout (its"
        " control client stuck in the driver); the stop waited 2 s"
    )


def test_a_stop_held_off_by_an_operation_with_no_command_in_flight_says_so(root: Path) -> None:
    """The daemon held with no command in flight (a pass between two commands, a reboot of
    the simulated node) is not taken for hung: the stop waits its whole 12 s, and says that
    another operation held the daemon, naming no command."""
    left, ended = _stop_held_on(root, [(1e9, None)])
    assert ended == 12.0
    assert left[mig_uuid(0, 0)].endswith("busy: another operation on its daemon held it for 12 s")


def test_a_daemon_being_started_is_said_in_flight_as_long_as_its_start_may_take(
    root: Path,
) -> None:
    """A start (``-d``, then its first answer) may take three of the daemon's timeouts: it
    is said in flight that long, so a stop meanwhile does not take it for hung."""
    now = [100.0]
    mgr, store, _ = make_manager(root, timeout_s=10.0, clock=lambda: now[0])
    seen: list[tuple[float, str] | None] = []
    try:
        dev = mgr._device(mig_uuid(0, 0))
        start = dev.daemon.start

        def starting() -> int:
            seen.append(dev.in_flight)
            return start()

        dev.daemon.start = starting  # type: ignore[method-assign]
        mgr.reconcile(MIG_NODE)
        assert seen == [(130.0, "nvidia-cuda-mps-control -d")]
        assert dev.in_flight is None
    finally:
        mgr.stop()
        store.close()


def test_a_quit_that_clears_a_memory_limit_is_said_in_flight_as_long_as_the_stop_may_take(
    root: Path,
) -> None:
    """The ``quit`` of an idle daemon restarted to remove its memory limit, then SIGTERM and
    SIGKILL if it lingers, may take its timeout and 9 s: it is said in flight that long, so
    a MIG apply's stop waiting meanwhile names the ``quit`` that holds the daemon, not an
    unnamed operation."""
    now = [100.0]
    mgr, store, _ = make_manager(root, timeout_s=10.0, request_timeout_s=2.0, clock=lambda: now[0])
    seen: list[tuple[tuple[float, str] | None, str]] = []
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        mgr.set_limits("0", memory_bytes=8 * GIB)
        dev = mgr._device(gpu_uuid(0))
        stop = dev.daemon.stop

        def stopping(**kwargs: Any) -> Any:
            seen.append((dev.in_flight, mgr._busy(dev, 12.0)))
            return stop(**kwargs)

        dev.daemon.stop = stopping  # type: ignore[method-assign]
        mgr.set_limits("0", clear_memory=True)
        assert seen == [
            (
                (119.0, "quit"),
                "busy: its command 'quit' was still in flight after the stop waited 12 s, the"
                " longest wait a stop gives one command to it",
            )
        ]
        assert dev.in_flight is None
        assert held(mgr, gpu_uuid(0))["default_device_pinned_mem_limit"] == {}
    finally:
        mgr.stop()
        store.close()


class WatchedLock:
    """A device's lock that keeps how long each timed wait for it was to last."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.waits: list[float] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if timeout >= 0:
            self.waits.append(timeout)
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *_: object) -> None:
        self.release()


def test_destroying_a_mig_device_waits_for_a_slow_health_check_within_its_timeout(
    root: Path,
) -> None:
    """A health check of a daemon slow to answer (a loaded node), its query still within its
    own timeout when a MIG apply stops the daemon, holds the stop until it answers, not
    ``request_timeout_s`` from when the stop asked: the daemon is stopped, the GPU not
    failed as busy."""
    mgr, store, events = make_manager(root, timeout_s=60.0, request_timeout_s=0.3)
    pid = None
    passing: threading.Thread | None = None
    stopping: threading.Thread | None = None
    left: dict[str, str] = {}
    try:
        mgr.reconcile(MIG_NODE)
        pid = {s.target.uuid: s.pid for s in mgr.status()}[mig_uuid(0, 0)]
        assert pid is not None
        watched = WatchedLock()
        mgr._devices[mig_uuid(0, 0)].io = watched  # type: ignore[assignment]
        os.kill(pid, signal.SIGSTOP)  # its health check's query waits till SIGCONT
        passing = threading.Thread(target=mgr.reconcile)
        passing.start()
        until(lambda: held_elsewhere(mgr, mig_uuid(0, 0)), "the pass in its check of 0:0")

        def release() -> None:
            with mgr.released([mig_uuid(0, 0)]) as stuck:
                left.update(stuck)

        stopping = threading.Thread(target=release)
        stopping.start()
        # the stop waits past its own 0.3 s (for the check's query, 60 s), or has given up
        until(
            lambda: not stopping.is_alive() or any(w > 1.0 for w in watched.waits),
            "the stop waiting on 0:0",
        )
        os.kill(pid, signal.SIGCONT)  # the check's query is answered
        pid = None
        stopping.join()
        assert left == {}
        stopped = [e.fields["uuid"] for e in events.recent(kind_prefix="mps.stop")]
        assert stopped == [mig_uuid(0, 0)]
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        for thread in (stopping, passing):
            if thread is not None:
                thread.join()
        mgr.stop()
        store.close()


def test_destroying_mig_devices_with_mps_off_touches_nothing(root: Path) -> None:
    """``mps.enabled = false``: a MIG apply's release stops nothing and writes nothing."""
    store = CountingStore(root / "state")
    events = EventLog(None)
    mgr = MpsManager(store, events, root / "run", FAKE_CONTROL, enabled=False, others_root=root)
    try:
        mgr.reconcile(MIG_NODE)
        before = store.transactions
        with mgr.released([mig_uuid(0, 0), mig_uuid(0, 1)]) as left:
            assert left == {}
        assert store.transactions == before
        assert not events.recent()
    finally:
        mgr.stop()
        store.close()


@pytest.mark.parametrize("goes", ["between passes", "at a retried SIGKILL"])
def test_a_hung_daemon_that_outlives_sigkill_is_kept_not_checked_adopted_or_doubled(
    root: Path, goes: str
) -> None:
    """A daemon killed for not answering that outlives SIGKILL (stuck in the driver) is not
    taken for killed: one mps.stop_failed names it, its status says so, later passes try
    the kill again (with backoff) instead of checking it or starting a second daemon beside
    it, and once it has gone the device gets a new one. One that dies at a retried SIGKILL
    is not checked or adopted in that pass (no mps.check_failed, no second
    mps.unresponsive): the next pass starts its successor."""
    stuck = StuckDaemons()
    mgr, store, events = make_manager(root, timeout_s=0.5, max_failures=1, **stuck.options())
    pid = None
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        pid = mgr.status()[0].pid
        assert pid is not None
        stuck.stick(mgr.status()[0].pipe_dir, pid)
        os.kill(pid, signal.SIGSTOP)  # it answers nothing
        mgr.reconcile()  # one failed check: killed, and it "runs" on
        (failed,) = events.recent(kind_prefix="mps.stop_failed")
        assert failed.fields["pid"] == pid and "after SIGKILL:" in failed.message
        assert "restarted once it has gone" in failed.message
        status = mgr.status()[0]
        assert not status.up and "outlived SIGKILL" in status.last_error
        for later in (0, 60):  # within the backoff, and past it: tried again, still there
            stuck.now += later
            mgr.reconcile()
            assert mgr.status()[0].pid == pid and not mgr.status()[0].up
        said = [e.kind for e in events.recent()]
        assert said == ["mps.start", "mps.hung", "mps.unresponsive", "mps.stop_failed"]
        stuck.now += 120
        if goes == "between passes":
            stuck.pids.clear()
        else:
            stuck.free_on_wait = True  # the retried SIGKILL takes effect
            mgr.reconcile()
            assert [e.kind for e in events.recent()] == said
            assert mgr.status()[0].pid is None and not mgr.status()[0].up
        mgr.reconcile()
        status = mgr.status()[0]
        assert status.up and status.pid not in (None, pid) and status.restarts == 1
        assert [e.kind for e in events.recent()] == [*said, "mps.restart"]
    finally:
        stuck.pids.clear()
        mgr.stop()
        store.close()


def test_a_stop_event_says_how_the_daemon_went(root: Path) -> None:
    """mps.stop says whether the daemon quit when asked or needed a signal (field ``how``)."""
    stuck = StuckDaemons()
    mgr, store, events = make_manager(root, **stuck.options())
    try:
        mgr.reconcile(NODE)
        by_uuid = {s.target.uuid: s for s in mgr.status()}
        stubborn = by_uuid[gpu_uuid(1)]
        assert stubborn.pid is not None
        (stubborn.pipe_dir / "fake-mps-stuck").touch()  # ignores quit and SIGTERM
        mgr.set_limits("0", enabled=False)
        mgr.set_limits("1", enabled=False)
        mgr.reconcile(NODE)
        said = {e.fields["uuid"]: e for e in events.recent(kind_prefix="mps.stop")}
        assert said[gpu_uuid(0)].fields["how"] == "quit"
        assert said[gpu_uuid(0)].message.endswith("(disabled): it quit when asked")
        assert said[gpu_uuid(1)].fields["how"] == "sigkill"
        assert said[gpu_uuid(1)].message.endswith(
            "(disabled): it ignored quit and SIGTERM; SIGKILL ended it"
        )
        wait_dead(stubborn.pid)
    finally:
        mgr.stop()
        store.close()


@pytest.mark.parametrize("sampled", [True, False])
def test_a_gpu_about_to_enable_mig_loses_its_daemon_first(root: Path, sampled: bool) -> None:
    """What a MIG apply holds while it enables MIG mode on a GPU: the GPU's own daemon
    stopped (it would hold the GPU), none started meanwhile; one that would not stop is
    named as the GPU's, with its pid. So too before gpud has read any GPU (``sampled``
    false: the daemons were left by the run before): a GPU's daemon, not a MIG device's."""
    if not sampled:
        first, store, _ = make_manager(root)
        first.reconcile(NODE)
        first.leave()
        store.close()
    stuck = StuckDaemons()
    mgr, store, events = make_manager(root, **stuck.options())
    try:
        if sampled:
            mgr.reconcile(NODE)
        daemon = ControlDaemon(gpu_uuid(1), root / "run", FAKE_CONTROL)
        pid = daemon.pid()
        assert pid is not None
        with mgr.released([gpu_uuid(0)]) as left:
            assert left == {}
            if sampled:
                mgr.reconcile(NODE)
                assert {s.target.uuid: s.pid for s in mgr.status()}[gpu_uuid(0)] is None
        (stop,) = events.recent(kind_prefix="mps.stop")
        assert stop.fields["uuid"] == gpu_uuid(0)
        assert stop.message.startswith(
            f"stopped the MPS control daemon of {gpu_uuid(0)} (MIG mode is being enabled on"
            " its GPU)"
        )
        stuck.stick(daemon.pipe_dir, pid)
        with mgr.released([gpu_uuid(1)]) as left:
            assert left == {
                gpu_uuid(1): f"the MPS control daemon of {'GPU 1' if sampled else 'GPU'}"
                f" ({gpu_uuid(1)}, pid {pid}) would not stop (see the mps.stop_failed event)"
            }
    finally:
        stuck.pids.clear()
        mgr.stop()
        store.close()


def test_a_daemon_that_lost_its_pipe_dir_and_outlives_sigkill_gets_none_beside_it(
    root: Path,
) -> None:
    """A daemon whose pipe directory was deleted is killed before the device's next one
    starts; one that outlives SIGKILL (stuck in the driver) still holds the GPU: no second
    daemon starts beside it, it is said once as any daemon that outlives SIGKILL is
    (mps.stop_failed, not a failed start), later passes try again with the same backoff,
    and once it has gone one starts."""
    stuck = StuckDaemons()
    mgr, store, events = make_manager(root, **stuck.options())
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        old = mgr.status()[0]
        assert old.pid is not None
        stuck.pids.add(old.pid)
        shutil.rmtree(old.pipe_dir)
        mgr.reconcile()
        status = mgr.status()[0]
        assert status.pid is None and not status.up
        assert f"(pid {old.pid}) lost its pipe directory and outlived SIGKILL" in status.last_error
        (failed,) = events.recent(kind_prefix="mps.stop_failed")
        assert f"pid {old.pid}" in failed.message and failed.fields["pid"] == old.pid
        assert "lost its pipe directory" in failed.message
        stuck.now += 1  # within the backoff: not signalled again, said once
        mgr.reconcile()
        assert len(events.recent(kind_prefix="mps.stop_failed")) == 1
        assert [e.kind for e in events.recent(kind_prefix="mps.start")] == ["mps.start"]
        assert not events.recent(kind_prefix="mps.restart")
        stuck.pids.clear()
        stuck.now += 60
        mgr.reconcile()
        status = mgr.status()[0]
        assert status.up and status.pid not in (None, old.pid)
        (started,) = events.recent(kind_prefix="mps.restart")
        assert started.fields["pid"] == status.pid
    finally:
        stuck.pids.clear()
        mgr.stop()
        store.close()


@contextlib.contextmanager
def gpu0_released(root: Path, sampled: list[float]) -> Iterator[tuple[MpsManager, EventLog]]:
    """A manager with a daemon per whole GPU whose GPU 0 a MIG apply released, the apply
    ending at ``sampled[0]`` on the snapshot clock."""
    mgr, store, events = make_manager(root, snapshot_clock=lambda: sampled[0])
    try:
        mgr.reconcile(NODE)
        with mgr.released([gpu_uuid(0)]) as left:
            assert left == {}
        yield mgr, events
    finally:
        mgr.stop()
        store.close()


def test_a_snapshot_older_than_a_mig_apply_starts_no_daemon_it_released(root: Path) -> None:
    """After a MIG apply that enabled MIG mode on a GPU, a pass working from a snapshot
    sampled before the apply ended (the GPU still whole in it) starts no whole-GPU daemon
    there (it would hold the GPU in MIG mode, and be stopped as gone a pass later): the
    devices the apply released get a daemon again only from a snapshot sampled after it,
    their own where the GPU is still whole (the apply failed), its MIG devices' otherwise."""
    sampled = [100.0]
    with gpu0_released(root, sampled) as (mgr, events):
        stale = dataclasses.replace(NODE, monotonic=99.0)  # its tick began before the end
        mgr.reconcile(stale)
        assert {s.target.uuid: s.pid for s in mgr.status()}[gpu_uuid(0)] is None
        assert [e.kind for e in events.recent(kind_prefix="mps.st")] == [
            "mps.start",
            "mps.start",
            "mps.stop",
        ]
        mig = snapshot(gpu_sample(0, migs=(("3g.40gb", 40),)), gpu_sample(1, memory_gib=40))
        mgr.reconcile(dataclasses.replace(mig, monotonic=100.0))
        now = {s.target.uuid: s for s in mgr.status()}
        assert now[mig_uuid(0, 0)].up and gpu_uuid(0) not in now
        started = [e.fields["uuid"] for e in events.recent(kind_prefix="mps.start")]
        assert started == [gpu_uuid(0), gpu_uuid(1), mig_uuid(0, 0)] or started == [
            gpu_uuid(1),
            gpu_uuid(0),
            mig_uuid(0, 0),
        ]
        assert len(events.recent(kind_prefix="mps.stop")) == 1

        # an apply that released the GPU and failed: its daemon comes back, once
        sampled[0] = 200.0
        mgr.reconcile(dataclasses.replace(NODE, monotonic=150.0))
        with mgr.released([mig_uuid(0, 0)]):
            pass
        mgr.reconcile(dataclasses.replace(mig, monotonic=199.0))
        assert {s.target.uuid: s.pid for s in mgr.status()}[mig_uuid(0, 0)] is None
        mgr.reconcile(dataclasses.replace(mig, monotonic=201.0))
        assert {s.target.uuid: s.up for s in mgr.status()}[mig_uuid(0, 0)]


def test_a_pass_behind_a_newer_snapshot_starts_no_daemon_the_apply_released(root: Path) -> None:
    """The loop's pass took its snapshot before a MIG apply ended (the GPU still whole in
    it) and waited behind the pass the apply made with a new sample: that pass let go of
    what the apply released, and the older one then started a whole-GPU daemon on a GPU in
    MIG mode (and stopped its MIG device's as gone). A snapshot older than one observed
    is passed over: the devices stay those of the newer."""
    sampled = [100.0]
    with gpu0_released(root, sampled) as (mgr, events):
        mig = snapshot(gpu_sample(0, migs=(("3g.40gb", 40),)), gpu_sample(1, memory_gib=40))
        mgr.reconcile(dataclasses.replace(mig, monotonic=101.0))  # the apply's own sample
        mgr.reconcile(dataclasses.replace(NODE, monotonic=99.0))  # the loop's, from before
        now = {s.target.uuid: s for s in mgr.status()}
        assert gpu_uuid(0) not in now and now[mig_uuid(0, 0)].up
        started = sorted(e.fields["uuid"] for e in events.recent(kind_prefix="mps.start"))
        assert started == sorted([gpu_uuid(0), gpu_uuid(1), mig_uuid(0, 0)])
        assert len(events.recent(kind_prefix="mps.stop")) == 1  # the whole GPU's, released


class _GpusHeldBack(tuple[GpuSample, ...]):
    """A snapshot's GPUs whose first read waits for ``go`` (5 s at most), having set
    ``reading``: where an observe of the snapshot stands still after its older-snapshot
    check."""

    reading = threading.Event()
    go = threading.Event()
    first = True

    def __iter__(self) -> Iterator[GpuSample]:
        if _GpusHeldBack.first:
            _GpusHeldBack.first = False
            _GpusHeldBack.reading.set()
            _GpusHeldBack.go.wait(5.0)
        return super().__iter__()


def test_an_older_snapshot_observed_alongside_a_newer_one_leaves_the_newer_devices(
    manager: MpsManager,
) -> None:
    """The sampler's listener and the loop's pass observe snapshots on two threads. One
    observing an older snapshot, which passed its check before the newer was observed,
    does not replace the newer one's devices once it gets to them (a GPU put into MIG
    mode whole again, MIG devices destroyed since back for a pass)."""
    older = dataclasses.replace(
        NODE, monotonic=1.0, gpus=_GpusHeldBack((gpu_sample(0), gpu_sample(1, memory_gib=40)))
    )
    mig = snapshot(gpu_sample(0, migs=(("3g.40gb", 40),)), gpu_sample(1, memory_gib=40))
    newer = dataclasses.replace(mig, monotonic=2.0)
    first = threading.Thread(target=manager.observe_snapshot, args=(older,))
    first.start()
    assert _GpusHeldBack.reading.wait(5.0)
    second = threading.Thread(target=manager.observe_snapshot, args=(newer,))
    second.start()
    second.join(0.5)  # done by now unless it waits for the first
    _GpusHeldBack.go.set()
    first.join(5.0)
    second.join(5.0)
    assert {t.uuid for t in manager.targets()} == {mig_uuid(0, 0), gpu_uuid(1)}


def test_the_snapshot_observed_last_is_not_observed_again(manager: MpsManager) -> None:
    """The loop's pass after the listener's observe of the same snapshot leaves the devices
    as they are: their targets are not built again."""
    manager.observe_snapshot(MIG_NODE)
    before = manager.targets()
    manager.observe_snapshot(MIG_NODE)
    assert all(a is b for a, b in zip(manager.targets(), before, strict=True))


def test_a_daemon_that_lost_its_pipe_dir_is_killed_when_its_device_is_disabled(
    root: Path,
) -> None:
    """``gpuctl mps set GPU --disable`` for a device whose control daemon lost its pipe
    directory (no PID file names it): the daemon is killed, not left running with its
    record dropped."""
    mgr, store, events = make_manager(root)
    try:
        mgr.reconcile(NODE)
        old = mgr.status()[1]
        assert old.pid is not None
        shutil.rmtree(old.pipe_dir)  # its PID file and control socket go with it
        mgr.set_limits("1", enabled=False)
        wait_dead(old.pid)
        (stop,) = [e for e in events.recent(kind_prefix="mps.stop") if e.kind == "mps.stop"]
        assert stop.fields["pid"] == old.pid and stop.fields["how"] == "sigkill"
        assert "it lost its pipe directory" in stop.message
        assert "ignored quit" not in stop.message  # no quit nor SIGTERM was sent
        assert not mgr.status()[1].running
    finally:
        mgr.stop()
        store.close()


def test_a_daemon_that_outlives_the_reboots_sigkill_is_kept_not_adopted_or_doubled(
    root: Path,
) -> None:
    """``gpuctl sim reboot`` while a daemon is stuck in the driver, one with its PID file
    and one that lost its pipe directory: neither counts as ended, neither is adopted, no
    second daemon starts beside either; the next pass tries again and names each in an
    mps.stop_failed, and once they have gone each device's next daemon is an mps.start."""
    stuck = StuckDaemons()
    mgr, store, events = make_manager(root, **stuck.options())
    try:
        mgr.reconcile(NODE)
        by_uuid = {s.target.uuid: s for s in mgr.status()}
        kept, lost = by_uuid[gpu_uuid(0)], by_uuid[gpu_uuid(1)]
        assert kept.pid is not None and lost.pid is not None
        shutil.rmtree(lost.pipe_dir)  # no PID file names it
        stuck.pids.update({kept.pid, lost.pid})  # alive after SIGKILL
        with mgr.rebooting() as ended:
            assert ended == 0
        mgr.reconcile(NODE)
        failed = {e.fields["uuid"]: e for e in events.recent(kind_prefix="mps.stop_failed")}
        assert {u: e.fields["pid"] for u, e in failed.items()} == {
            gpu_uuid(0): kept.pid,
            gpu_uuid(1): lost.pid,
        }
        assert [e.kind for e in events.recent()].count("mps.stop_failed") == 2
        now = {s.target.uuid: s for s in mgr.status()}
        assert not now[gpu_uuid(0)].up and not now[gpu_uuid(1)].up
        assert now[gpu_uuid(1)].pid is None
        kinds = [e.kind for e in events.recent(kind_prefix="mps.")]
        assert kinds == ["mps.start", "mps.start", "mps.stop_failed", "mps.stop_failed"]
        # gone (a GPU reset): each device starts anew
        stuck.pids.clear()
        stuck.now += 120
        mgr.reconcile(NODE)
        after = mgr.status()
        assert all(s.up and s.restarts == 0 for s in after)
        kinds = [e.kind for e in events.recent(kind_prefix="mps.")]
        assert kinds.count("mps.start") == 4 and not {"mps.adopt", "mps.restart"} & set(kinds)
    finally:
        stuck.pids.clear()
        mgr.stop()
        store.close()


class Gate:
    """The manager's liveness check, held at ``pid`` in the thread named ``name`` until
    ``go`` is set: that thread stays inside the device's lock meanwhile."""

    def __init__(self, pid: int, name: str) -> None:
        self.pid, self.name = pid, name
        self.entered, self.go = threading.Event(), threading.Event()

    def alive(self, pid: int, proc_root: Path) -> bool:
        if pid == self.pid and threading.current_thread().name == self.name:
            self.entered.set()
            self.go.wait(10)
        return alive(pid, proc_root)


def test_a_reboot_waits_for_a_change_talking_to_a_daemon(root: Path) -> None:
    """``gpuctl mps set`` restarting a device's dead daemon as the node reboots: the reboot
    ends the daemon it started too, and the device starts anew after it (an mps.start), not
    by adopting a daemon that outlived the reboot."""
    gates: list[Gate] = []

    def check(pid: int, proc_root: Path) -> bool:
        return gates[0].alive(pid, proc_root) if gates else alive(pid, proc_root)

    mgr, store, events = make_manager(root, alive=check)
    try:
        mgr.reconcile(NODE)
        dead = mgr.status()[0].pid
        assert dead is not None
        os.kill(dead, signal.SIGKILL)
        wait_dead(dead)
        gates.append(Gate(dead, "limits"))
        change = threading.Thread(
            target=lambda: mgr.set_limits("0", threads_percent=50), name="limits"
        )
        change.start()
        assert gates[0].entered.wait(10)
        ended: list[int] = []

        def reboot_node() -> None:
            with mgr.rebooting() as n:
                ended.append(n)

        reboot = threading.Thread(target=reboot_node)
        reboot.start()
        reboot.join(1.0)
        gates[0].go.set()
        change.join(10)
        reboot.join(10)
        restarted = [e.fields["pid"] for e in events.recent() if e.kind == "mps.restart"]
        assert len(restarted) == 1 and ended == [2]
        wait_dead(int(str(restarted[0])))
        mgr.reconcile(NODE)
        kinds = [e.kind for e in events.recent(kind_prefix="mps.")]
        assert "mps.adopt" not in kinds and kinds.count("mps.start") == 4, kinds
        assert all(s.up and s.restarts == 0 for s in mgr.status())
    finally:
        if gates:
            gates[0].go.set()
        mgr.stop()
        store.close()


def test_a_pass_waiting_through_a_reboot_starts_no_daemon_on_a_destroyed_mig_device(
    root: Path,
) -> None:
    """A pass that sampled the node before a reboot and waited for it: the MIG devices in
    its snapshot are gone (the reboot destroyed their instances), and it starts no daemon
    for them; the reboot's own sample is what the pass works from."""
    mgr, store, events = make_manager(root)
    try:
        mgr.reconcile(MIG_NODE)
        rebooted = snapshot(gpu_sample(0)._replace(mig_mode=MigMode(True, True)), gpu_sample(1))
        rebooted = dataclasses.replace(rebooted, monotonic=1.0)
        with mgr.rebooting() as ended:
            assert ended == 4
            waiting = threading.Thread(target=mgr.reconcile, args=(MIG_NODE,))
            waiting.start()
            waiting.join(0.3)
            assert waiting.is_alive()  # it waits for the reboot
            mgr.observe_snapshot(rebooted)
        waiting.join(30)
        started = [e.fields["uuid"] for e in events.recent() if e.kind == "mps.start"]
        assert started[4:] == [gpu_uuid(1)]
        assert [s.target.uuid for s in mgr.status()] == [gpu_uuid(1)]
        assert set(daemons_under(root / "run").values()) == {mgr.status()[0].pid}
    finally:
        mgr.stop()
        store.close()


def test_no_change_starts_a_daemon_while_the_node_reboots(root: Path) -> None:
    """``gpuctl mps set`` while the simulated node reboots (its daemons already ended): it
    waits for the device, answers that the daemon is busy, and starts none that would
    outlive the reboot; the status and /metrics show none running from the kills on, and
    the next pass starts each device's anew with the new limits."""
    mgr, store, events = make_manager(root, request_timeout_s=0.2)
    try:
        mgr.reconcile(NODE)
        answers = []
        with mgr.rebooting() as ended:
            assert ended == 2
            assert [(s.pid, s.up) for s in mgr.last_status()] == [(None, False)] * 2
            change = threading.Thread(
                target=lambda: answers.append(mgr.set_limits("0", threads_percent=50))
            )
            change.start()
            change.join(20)
            assert not daemons_under(root / "run")  # none until the node has rebooted
        (answer,) = answers
        assert not answer.up and "still busy" in answer.last_error
        mgr.reconcile(NODE)
        after = {s.target.uuid: s for s in mgr.status()}
        assert all(s.up and s.restarts == 0 for s in after.values())
        assert after[gpu_uuid(0)].observed_threads_percent == 50
        starts = [e.kind for e in events.recent(kind_prefix="mps.")].count("mps.start")
        assert starts == 4
    finally:
        mgr.stop()
        store.close()


def test_a_lost_daemon_beside_the_one_its_pid_file_names_is_stopped_at_start(
    root: Path,
) -> None:
    """An earlier gpud, killed since, left two daemons for a device: one whose PID file was
    deleted, and one started after it that its new PID file names. The next start adopts
    the named one and SIGKILLs the lost one (an mps.stop), rather than leaving it to hold
    the GPU."""
    first, store, _ = make_manager(root)
    first.reconcile(NODE)
    old = first.status()[0]
    store.close()  # killed -9
    assert old.pid is not None
    (old.pipe_dir / PID_FILE).unlink()
    second = ControlDaemon(gpu_uuid(0), root / "run", FAKE_CONTROL, timeout_s=5.0)
    named = second.start()
    mgr, store, events = make_manager(root)
    try:
        mgr.reconcile(NODE)
        wait_dead(old.pid)
        assert not alive(old.pid)
        assert mgr.status()[0].pid == named and alive(named)
        (stop,) = [e for e in events.recent() if e.kind == "mps.stop"]
        assert stop.fields["pid"] == old.pid and stop.fields["how"] == "sigkill"
        assert "it lost its pipe directory" in stop.message
        assert not [e for e in events.recent() if e.kind == "mps.other_daemon"]
    finally:
        mgr.stop()
        store.close()
        for pid in (old.pid, named):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("known", [3, 1])
def test_a_pass_waiting_through_a_reboot_whose_sample_failed_starts_no_mig_daemon(
    root: Path, known: int
) -> None:
    """A reboot whose own sample failed (nothing observed): the pass that waited for it
    works from its snapshot sampled before, yet starts no daemon on the MIG devices the
    reboot destroyed, those it did not know of (``known``: 1 of 3, the others created by a
    MIG apply meanwhile) too; a snapshot sampled after the reboot shows what there is."""
    clock = [1.0]
    mgr, store, events = make_manager(root, snapshot_clock=lambda: clock[0])
    try:
        migs = (("3g.40gb", 40), ("2g.20gb", 20), ("1g.10gb", 10))[:known]
        mgr.reconcile(snapshot(gpu_sample(0, migs=migs), gpu_sample(1)))
        with mgr.rebooting() as ended:
            assert ended == known + 1
            waiting = threading.Thread(target=mgr.reconcile, args=(MIG_NODE,))
            waiting.start()
            waiting.join(0.3)
        waiting.join(30)
        started = [e.fields["uuid"] for e in events.recent() if e.kind == "mps.start"]
        assert started[known + 1 :] == [gpu_uuid(1)]
        assert set(daemons_under(root / "run").values()) == {
            s.pid for s in mgr.status() if s.target.uuid == gpu_uuid(1)
        }
        clock[0] = 2.0
        mgr.reconcile(dataclasses.replace(MIG_NODE, monotonic=2.0))  # re-created since
        assert all(s.up for s in mgr.status())
    finally:
        mgr.stop()
        store.close()


def test_a_lost_daemon_of_a_device_gone_at_start_leaves_no_record(root: Path) -> None:
    """A daemon an earlier gpud left with its pipe directory deleted, for a MIG device
    destroyed since: stopped at start with its record and directories, even while another
    GPU does not answer (no sweep runs then)."""
    first, store, _ = make_manager(root)
    try:
        first.reconcile(MIG_NODE)
        gone = {s.target.uuid: s for s in first.status()}[mig_uuid(0, 2)]
    finally:
        store.close()  # killed -9
    assert gone.pid is not None
    shutil.rmtree(gone.pipe_dir)
    hung = gpu_sample(1)._replace(healthy=False, reason="not answering", mig_mode=None)
    mgr, store, events = make_manager(root)
    try:
        mgr.reconcile(snapshot(gpu_sample(0, migs=(("3g.40gb", 40), ("2g.20gb", 20))), hung))
        wait_dead(gone.pid)
        assert _record(store, mig_uuid(0, 2)) is None
        assert not gone.pipe_dir.parent.exists()
        (stop,) = [e for e in events.recent(kind_prefix="mps.stop") if e.kind == "mps.stop"]
        assert stop.fields["uuid"] == mig_uuid(0, 2) and stop.fields["how"] == "sigkill"
    finally:
        mgr.stop()
        store.close()


def test_a_lost_daemon_under_an_old_run_dir_is_sigkilled_at_once(root: Path) -> None:
    """daemon.run_dir changed, and a daemon left under the old one lost its pipe directory:
    no quit can reach it, so none is waited for; SIGKILL ends it, and mps.stop_moved says
    so."""
    first, store, _ = make_manager(root, run="run")
    try:
        first.reconcile(snapshot(gpu_sample(0)))
        old = first.status()[0]
    finally:
        store.close()
    assert old.pid is not None
    shutil.rmtree(old.pipe_dir)
    clock = StuckDaemons()
    second, store, events = make_manager(root, run="run2", **clock.options())
    try:
        second.reconcile(snapshot(gpu_sample(0)))
        wait_dead(old.pid)
        (moved,) = events.recent(kind_prefix="mps.stop_moved")
        assert moved.fields["pid"] == old.pid and moved.fields["how"] == "sigkill"
        assert moved.message.endswith("it lost its pipe directory: SIGKILL ended it")
        assert clock.now < 5.0  # no quit waited for
        assert second.status()[0].up
    finally:
        second.stop()
        store.close()


def _lose_another(root: Path, first: int) -> int:
    """GPU 0's daemon ``first`` loses its PID file, and an earlier gpud (killed since) left
    a second one there, whose PID file is deleted too: its PID."""
    pid_file = root / "run" / "mps" / gpu_uuid(0) / "pipe" / PID_FILE
    pid_file.unlink()
    second = ControlDaemon(gpu_uuid(0), root / "run", FAKE_CONTROL, timeout_s=5.0).start()
    pid_file.unlink()
    return second


def _gone(stuck: StuckDaemons, pid: int) -> None:
    """The stuck daemon ``pid`` goes at last (a GPU reset frees it)."""
    stuck.pids.discard(pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    stuck.now += 120  # past the backoff of the failed stops


@pytest.mark.parametrize("how", ["start", "reboot"])
def test_no_daemon_starts_beside_any_of_two_lost_daemons_that_outlive_sigkill(
    root: Path, how: str
) -> None:
    """Two daemons that lost their pipe directory, both stuck in the driver (found at
    gpud's start, or left by a simulated reboot): once one of them has gone, the device
    still gets no daemon beside the other; it gets one once that one has gone too."""
    stuck = StuckDaemons()
    first = second = 0
    if how == "start":
        earlier, store = make_manager(root)[:2]
        earlier.reconcile(NODE)
        first = earlier.status()[0].pid or 0
        store.close()  # killed -9
    mgr, store, events = make_manager(root, **stuck.options())
    try:
        if how == "reboot":
            mgr.reconcile(NODE)
            first = mgr.status()[0].pid or 0
        assert first
        second = _lose_another(root, first)
        stuck.pids.update({first, second})
        if how == "reboot":
            with mgr.rebooting() as ended:
                assert ended == 1  # GPU 1's
        mgr.reconcile(NODE)
        assert mgr.status()[0].pid is None
        # the one each kept before goes first: the first lost at a start, the last at a reboot
        going, staying = (first, second) if how == "start" else (second, first)
        _gone(stuck, going)
        mgr.reconcile(NODE)
        status = mgr.status()[0]
        assert status.pid is None, f"a daemon started beside the stuck pid {staying}"
        assert f"pid {staying}" in status.last_error
        assert daemons_under(root / "run" / "mps" / gpu_uuid(0)) == {}  # none started there
        _gone(stuck, staying)
        mgr.reconcile(NODE)
        status = mgr.status()[0]
        assert status.up and status.pid not in (None, first, second)
        assert "mps.stop_failed" in [e.kind for e in events.recent()]
    finally:
        stuck.pids.clear()
        mgr.stop()
        store.close()
        for pid in (first, second):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


class _FullDisk(StateStore):
    """A state database whose writes fail, as on a full disk, while ``full``; reads work."""

    full = False

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with super().transaction() as conn:
            before = conn.total_changes
            yield conn
            if self.full and conn.total_changes != before:
                raise StateUnwritable(f"state database {self.path} cannot be written")


def _mig(uuid: str, start: int = 0) -> MpsTarget:
    return MpsTarget(uuid, 0, 0, "3g.40gb", 40 * GIB, gpu_uuid(0), (start, 4))


@pytest.mark.parametrize("enabled", [False, True])
def test_a_re_created_mig_device_gets_no_daemon_while_its_limits_wait_to_be_moved(
    root: Path, enabled: bool
) -> None:
    """A MIG device re-created while the state database cannot be written: its limits
    (MPS disabled there, or 40 % threads) are not its own yet, so no daemon starts with the
    defaults meanwhile; once they are moved it gets the right one (or none), no drift."""
    now = [0.0]
    store = _FullDisk(root / "state")
    mgr, _, events = make_manager(root, store=store, clock=lambda: now[0])
    try:
        mgr.observe([_mig("MIG-a")])
        mgr.set_limits("MIG-a", threads_percent=40, enabled=enabled)
        mgr.reconcile()
        mgr.stop()  # MIG-a destroyed, its daemon with it
        store.full = True
        mgr.observe([_mig("MIG-c")])
        mgr.reconcile()
        (status,) = mgr.status()
        assert status.pid is None
        assert status.last_error == (
            "its MPS limits wait to be moved (state database not writable)"
        )
        store.full = False
        now[0] += RESTORE_RETRY_S
        mgr.observe([_mig("MIG-c")])
        mgr.reconcile()
        (status,) = mgr.status()
        assert status.desired == MpsLimits(40, None, enabled)
        assert (status.pid is not None) == enabled
        if enabled:
            assert status.up and status.observed_threads_percent == 40
        kinds = [e.kind for e in events.recent(kind_prefix="mps.")]
        assert "mps.limits_restored" in kinds and "mps.drift" not in kinds
    finally:
        store.full = False
        mgr.stop()
        store.close()


@contextlib.contextmanager
def _adopted_while_limits_wait(
    root: Path, store: _FullDisk, **kwargs: object
) -> Iterator[tuple[MpsManager, EventLog, int]]:
    """gpud restarted on a full disk: MIG-b's running daemon (its PID) adopted while its
    limits wait to be moved, MIG-a having been re-created as MIG-c. After: the disk freed,
    the manager stopped (its daemons with it) and ``store`` closed."""
    first, _, _ = make_manager(root, store=store)
    first.observe([_mig("MIG-a"), _mig("MIG-b", start=4)])
    first.set_limits("MIG-a", threads_percent=40)
    first.set_limits("MIG-b", threads_percent=60)
    first.reconcile()
    first.observe([_mig("MIG-b", start=4)])
    first.reconcile()  # MIG-a destroyed: its daemon with it
    pid = {s.target.uuid: s.pid for s in first.status()}["MIG-b"]
    assert pid is not None
    store.full = True
    mgr, _, events = make_manager(root, store=store, **kwargs)
    try:
        mgr.observe([_mig("MIG-c"), _mig("MIG-b", start=4)])
        mgr.reconcile()
        yield mgr, events, pid
    finally:
        store.full = False
        mgr.stop()
        store.close()


def test_a_daemon_whose_limits_wait_to_be_moved_is_still_adopted_and_checked(
    root: Path,
) -> None:
    """gpud restarted with the state database unwritable after one MIG device was re-created
    (MIG-a -> MIG-c at its place): every MIG device is new to it, so every one waits for
    the move, the running daemon of MIG-b too. Only the limits wait: MIG-b's daemon is
    adopted and checked as ever, and once it dies it is said down, not up; a new one starts
    with its limits after the move, and MIG-c gets MIG-a's."""
    now = [0.0]
    store = _FullDisk(root / "state")
    with _adopted_while_limits_wait(root, store, clock=lambda: now[0]) as (mgr, events, pid):
        status = {s.target.uuid: s for s in mgr.status()}
        assert status["MIG-c"].pid is None
        assert status["MIG-b"].pid == pid and status["MIG-b"].up
        assert status["MIG-b"].observed_threads_percent == 60
        assert "mps.adopt" in [e.kind for e in events.recent()]
        os.kill(pid, signal.SIGKILL)
        wait_dead(pid)
        mgr.reconcile()
        status = {s.target.uuid: s for s in mgr.status()}
        assert not status["MIG-b"].up and status["MIG-b"].pid is None
        assert status["MIG-b"].last_error.startswith("its MPS limits wait to be moved")
        store.full = False
        now[0] += RESTORE_RETRY_S
        mgr.observe([_mig("MIG-c"), _mig("MIG-b", start=4)])
        mgr.reconcile()
        status = {s.target.uuid: s for s in mgr.status()}
        assert status["MIG-b"].up and status["MIG-b"].observed_threads_percent == 60
        assert status["MIG-c"].up and status["MIG-c"].observed_threads_percent == 40


def test_limits_set_while_they_wait_to_be_moved_are_refused_naming_the_wait(
    root: Path,
) -> None:
    """gpud restarted on a full disk: MIG-b's running daemon is adopted while its limits
    wait to be moved. The disk is freed, and before the move is tried again an operator
    sets MIG-b's threads: refused, naming the wait, nothing stored and no answer saying
    new limits are in place. After the move the same change is applied as the operator's,
    never as drift."""
    now = [0.0]
    store = _FullDisk(root / "state")
    with _adopted_while_limits_wait(root, store, clock=lambda: now[0]) as (mgr, events, _):
        store.full = False
        with pytest.raises(FailedPrecondition, match=r"MIG-b.*wait to be moved.* 30 s"):
            mgr.set_limits("MIG-b", threads_percent=30)
        assert mgr.limits("MIG-b").threads_percent == 60
        now[0] += RESTORE_RETRY_S
        mgr.observe([_mig("MIG-c"), _mig("MIG-b", start=4)])
        mgr.reconcile()
        status = mgr.set_limits("MIG-b", threads_percent=30)
        assert status.up and status.observed_threads_percent == 30
        mgr.reconcile()
        assert not events.recent(kind_prefix="mps.drift")


def test_an_up_daemon_whose_limits_wait_is_shown_waiting_and_its_exit_is_said(
    root: Path,
) -> None:
    """An adopted daemon whose limits wait to be moved is shown up and waiting; once it
    dies (nothing restarts it meanwhile) an ``mps.exited`` names it, once."""
    store = _FullDisk(root / "state")
    with _adopted_while_limits_wait(root, store) as (mgr, events, pid):
        status = {s.target.uuid: s for s in mgr.status()}["MIG-b"]
        assert device_row(device_message(status, None))[3] == (
            "up: its MPS limits wait to be moved (state database not writable)"
        )
        os.kill(pid, signal.SIGKILL)
        wait_dead(pid)
        mgr.reconcile()
        mgr.reconcile()
        (said,) = events.recent(kind_prefix="mps.exited")
        assert said.fields["uuid"] == "MIG-b" and "wait to be moved" in said.message


def test_a_hung_daemon_whose_limits_wait_is_killed_not_said_restarted(root: Path) -> None:
    """Killed for not answering while its limits wait to be moved: the event says that a
    new one waits for them, not that it is restarted."""
    store = _FullDisk(root / "state")
    hang = Hang()
    with _adopted_while_limits_wait(root, store, max_failures=1, run_control=hang) as (
        mgr,
        events,
        pid,
    ):
        hang.hung = True
        mgr.reconcile()
        wait_dead(pid)
        (said,) = events.recent(kind_prefix="mps.unresponsive")
        assert "restart" not in said.message and "wait to be moved" in said.message


def test_a_failed_move_whose_devices_are_gone_hides_no_later_failure(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Re-created MIG devices destroyed again before their limits' move was tried again:
    nothing waits any more, so a later failure (another device, an hour later) is logged
    anew, and its success is not said to have moved the ones gone."""
    now = [0.0]
    store = _UnwritableStore(root / "state")
    mgr, _, _ = make_manager(root, enabled=False, clock=lambda: now[0], store=store)
    try:
        mgr.observe([_mig("MIG-a")])
        mgr.set_limits("MIG-a", threads_percent=40)
        store.unwritable = True
        mgr.observe([_mig("MIG-c")])  # not moved: said
        mgr.observe([])  # MIG-c destroyed before its next try
        store.unwritable = False
        caplog.set_level(logging.INFO)
        mgr.observe([_mig("MIG-d", start=4)])  # nothing to move there
        assert not [r for r in caplog.records if "were moved to them" in r.getMessage()]
        now[0] += 3600
        store.unwritable = True
        mgr.observe([_mig("MIG-e")])  # a new failure, an hour later: said too
        warned = [r for r in caplog.records if "were not moved" in r.getMessage()]
        assert len(warned) == 2
    finally:
        store.unwritable = False
        mgr.stop()
        store.close()


class _BrokenOnce(StateStore):
    """A state database whose next transaction fails with an error not a StateError (a
    bug, say) while ``broken``."""

    broken = False

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        if self.broken:
            self.broken = False
            raise RuntimeError("broken")
        with super().transaction() as conn:
            yield conn


def test_a_snapshot_whose_observe_failed_is_observed_again(root: Path) -> None:
    """An observe that fails (not on the state database: a bug) leaves the snapshot to be
    observed again by the next pass with it, which notes its GPUs in MIG mode."""
    store = _BrokenOnce(root / "state")
    mgr, _, _ = make_manager(root, store=store)
    try:
        empty_mig = gpu_sample(1)._replace(mig_mode=MigMode(True, True))
        gpu = gpu_sample(0, migs=(("3g.40gb", 40),))
        (mig,) = gpu.mig_devices
        placed = dataclasses.replace(mig.identity, gpu_instance_placement=Placement(0, 4))
        gpu = gpu._replace(mig_devices=(mig._replace(identity=placed),))
        snap = snapshot(gpu, empty_mig)
        store.broken = True  # the move of its limits, by place, reads it
        with pytest.raises(RuntimeError):
            mgr.observe_snapshot(snap)
        mgr.observe_snapshot(snap)
        with pytest.raises(FailedPrecondition, match="is in MIG mode and has no MIG devices"):
            mgr.resolve("1")
    finally:
        mgr.stop()
        store.close()


def test_a_daemon_stopped_for_a_mig_apply_while_its_limits_wait_is_not_said_exited(
    root: Path,
) -> None:
    """A daemon whose limits wait to be moved, that once missed a health check, is stopped
    by gpud for a MIG apply: its stop is said, and no ``mps.exited`` (an alert) follows."""
    store = _FullDisk(root / "state")
    hang = Hang()
    with _adopted_while_limits_wait(root, store, max_failures=3, run_control=hang) as (
        mgr,
        events,
        _pid,
    ):
        hang.hung = True
        mgr.reconcile()
        hang.hung = False
        assert events.recent(kind_prefix="mps.hung")
        with mgr.released(["MIG-b"]) as kept:
            assert not kept
            mgr.reconcile()
        mgr.reconcile()
        assert events.recent(kind_prefix="mps.stop")
        assert not events.recent(kind_prefix="mps.exited")


def test_a_daemon_whose_limits_wait_ended_for_losing_its_pipe_dir_is_not_said_exited(
    root: Path,
) -> None:
    """gpud SIGKILLs an adopted daemon whose limits wait to be moved once it lost its pipe
    directory: said once, as ``mps.stop``; no ``mps.exited`` says it went unasked."""
    store = _FullDisk(root / "state")
    with _adopted_while_limits_wait(root, store) as (mgr, events, pid):
        status = {s.target.uuid: s for s in mgr.status()}["MIG-b"]
        shutil.rmtree(status.pipe_dir)  # its PID file and control socket go with it
        mgr.reconcile()
        wait_dead(pid)
        mgr.reconcile()
        (stop,) = [e for e in events.recent(kind_prefix="mps.stop") if e.kind == "mps.stop"]
        assert stop.fields["pid"] == pid and "it lost its pipe directory" in stop.message
        assert not events.recent(kind_prefix="mps.exited")


def test_a_reboot_ends_the_daemon_started_under_an_old_run_dir_while_its_record_was_not_kept(
    root: Path,
) -> None:
    """A daemon restarted while the state database could not be written keeps its
    predecessor's record (PID, start time). daemon.run_dir changed since, and the simulated
    node reboots: the recorded daemon has gone, so the one the PID file of that device's
    pipe directory names there is ended, not left holding the GPU beside the next one."""
    store = _FullDisk(root / "state")
    first, _, _ = make_manager(root, run="run", store=store)
    first.reconcile(snapshot(gpu_sample(0)))
    (recorded,) = [s.pid for s in first.status()]
    assert recorded is not None
    store.full = True
    os.kill(recorded, signal.SIGKILL)
    wait_dead(recorded)
    first.reconcile(snapshot(gpu_sample(0)))
    (unrecorded,) = [s.pid for s in first.status()]
    assert unrecorded is not None and unrecorded != recorded
    first.leave()
    store.full = False
    assert _record(store, gpu_uuid(0)) == (recorded, str(root / "run/mps" / gpu_uuid(0) / "pipe"))
    second, _, _ = make_manager(root, run="run2", store=store)
    try:
        with second.rebooting() as ended:
            assert ended == 1
        wait_dead(unrecorded)
    finally:
        if alive(unrecorded):
            os.kill(unrecorded, signal.SIGKILL)
        second.stop()
        store.close()


def test_a_change_refused_while_limits_wait_names_the_state_database_and_its_error(
    root: Path,
) -> None:
    """The refusal of a change to a device whose limits wait to be moved names the state
    database and what refused the move's write, and when it is tried again."""
    store = _FullDisk(root / "state")
    with _adopted_while_limits_wait(root, store, clock=lambda: 0.0) as (mgr, _, _):
        with pytest.raises(FailedPrecondition) as refused:
            mgr.set_limits("MIG-b", threads_percent=30)
        said = str(refused.value)
        assert f"(state database {store.path} cannot be written)" in said
        assert "MIG-b" in said and "the move is tried again in 30 s" in said


def test_a_change_refused_while_limits_wait_on_a_removed_state_database_says_to_restart(
    root: Path,
) -> None:
    """The state database was removed while gpud ran, before a re-created MIG device's
    limits were moved: no later try can move them, so the refusal of a change names the
    database, says it was removed, and that only a restart makes the move, not a wait."""
    store = StateStore(root / "state")
    mgr, _, _ = make_manager(root, store=store)
    try:
        mgr.observe([_mig("MIG-a")])
        mgr.set_limits("MIG-a", threads_percent=40)
        mgr.reconcile()
        mgr.stop()  # MIG-a destroyed, its daemon with it
        store.path.unlink()
        mgr.observe([_mig("MIG-c")])
        with pytest.raises(FailedPrecondition) as refused:
            mgr.set_limits("MIG-c", threads_percent=30)
        said = str(refused.value)
        assert f"state database {store.path} was removed or replaced while gpud ran" in said
        assert "restart" in said and "tried again" not in said
    finally:
        mgr.stop()
        store.close()


def test_a_device_many_jobs_share_names_the_first_few_and_counts_the_rest() -> None:
    shared = mps_pb2.MpsDevice(gpu=0, jobs=[f"infer-{i:02}" for i in range(30)])
    cell = device_row(shared)[8]
    assert cell == ",".join(f"infer-{i:02}" for i in range(8)) + ",... (+22 more)"
    assert device_row(mps_pb2.MpsDevice(gpu=0, jobs=["a", "b"]))[8] == "a,b"
    assert device_row(mps_pb2.MpsDevice(gpu=0))[8] == "-"


class Hand:
    """A manager's clock moved by the test alone."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def kill_and_wait_restart(mgr: MpsManager, clock: Hand, *, up_s: float) -> float:
    """Let the daemon of the node's one device run ``up_s`` (the clock), SIGKILL it, and
    pass each second (the clock) until a new daemon runs: the seconds it waited."""
    clock.now += up_s
    mgr.reconcile()  # a pass sees it up
    old = mgr.status()[0].pid
    assert old is not None
    os.kill(old, signal.SIGKILL)
    wait_dead(old)
    mgr.reconcile()
    waited = 0.0
    while mgr.status()[0].pid in (None, old):
        assert waited < 120, "not restarted"
        clock.now += 1
        waited += 1
        mgr.reconcile()
    return waited


def test_a_daemon_that_dies_a_second_after_each_start_is_restarted_ever_later(
    root: Path,
) -> None:
    """A daemon that can start but not stay up: after the first, each restart waits longer
    (1 s, 2 s, 4 s, ...) instead of restarting it on every pass; each restart still counts."""
    clock = Hand()
    mgr, store, _ = make_manager(root, clock=clock)
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        waits = [kill_and_wait_restart(mgr, clock, up_s=1) for _ in range(4)]
        assert waits == sorted(waits) and waits[-1] > waits[0], waits
        assert waits == [0, 1, 2, 4]
        assert mgr.status()[0].restarts == 4
    finally:
        mgr.stop()
        store.close()


def test_a_daemon_that_stayed_up_two_minutes_is_restarted_at_once_after_a_crash_loop(
    root: Path,
) -> None:
    clock = Hand()
    mgr, store, _ = make_manager(root, clock=clock)
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        for _ in range(3):
            kill_and_wait_restart(mgr, clock, up_s=1)
        assert kill_and_wait_restart(mgr, clock, up_s=120) == 0
        assert kill_and_wait_restart(mgr, clock, up_s=1) <= 1
    finally:
        mgr.stop()
        store.close()


def test_a_crash_loop_is_said_as_it_begins_and_as_its_count_doubles_not_per_death(
    root: Path,
) -> None:
    clock = Hand()
    mgr, store, events = make_manager(root, clock=clock)
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        for _ in range(5):
            kill_and_wait_restart(mgr, clock, up_s=1)
        said = events.recent(kind_prefix="mps.crash_loop")
        assert [e.fields["crashes"] for e in said] == [2, 4]
        assert said[1].fields["retry_in_s"] == 4
        assert "4 in a row within 60 s" in said[1].message
        # the first death after a stable run is a plain restart; the loop's are counted
        assert len(events.recent(kind_prefix="mps.restart")) == 1
        assert mgr.status()[0].restarts == 5
    finally:
        mgr.stop()
        store.close()


def test_a_crash_loop_that_ends_is_said_over_with_the_restarts_it_took(root: Path) -> None:
    """A daemon dying a second after each start, then one that stays up 60 s: the loop's
    end is said once (``mps.crash_loop_ended``), with the deaths and restarts it took."""
    clock = Hand()
    mgr, store, events = make_manager(root, clock=clock)
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        for _ in range(4):
            kill_and_wait_restart(mgr, clock, up_s=1)
        assert not events.recent(kind_prefix="mps.crash_loop_ended")
        clock.now += 60
        mgr.reconcile()
        mgr.reconcile()
        (ended,) = events.recent(kind_prefix="mps.crash_loop_ended")
        assert ended.fields["crashes"] == 4 and "loop_restarts" not in ended.fields
        assert ended.fields["restarts"] == 4 and ended.fields["gpu"] == 0
        assert "crash loop is over after 4 in a row" in ended.message, ended.message
        # one death after a stable run is no loop: its end is not said
        kill_and_wait_restart(mgr, clock, up_s=1)
        clock.now += 60
        mgr.reconcile()
        assert len(events.recent(kind_prefix="mps.crash_loop_ended")) == 1
    finally:
        mgr.stop()
        store.close()


def test_a_daemon_that_starts_now_and_then_and_dies_young_says_its_failed_starts_once(
    root: Path,
) -> None:
    """Starts that fail, with a daemon that starts between them and dies a second later:
    one trouble, said once (``mps.start_failed``); once a daemon ran 60 s, the next start
    that fails is said anew, with the device's failed starts counted."""
    failing, tries = root / "failing", root / "tries"
    wrapper = control_wrapper(
        root,
        f'[ "$1" = -d ] && [ -e {shlex.quote(str(failing))} ]'
        f" && echo >> {shlex.quote(str(tries))} && exit 1",
    )
    clock = Hand()
    mgr, store, events = make_manager(
        root, [str(wrapper)], clock=clock, sleep=lambda s: None, backoff_max_s=60.0
    )

    def failed() -> int:
        return len(tries.read_text().splitlines()) if tries.exists() else 0

    def fail_then_start() -> None:
        """Kill the daemon, fail its restart once, then let the next start hold."""
        failing.touch()
        before, old = failed(), mgr.status()[0].pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        wait_dead(old)
        mgr.reconcile()
        for _ in range(120):
            if failed() > before:
                break
            clock.now += 1
            mgr.reconcile()
        assert failed() > before, "no start tried"
        failing.unlink()
        for _ in range(120):
            clock.now += 1
            mgr.reconcile()
            if mgr.status()[0].pid not in (None, old):
                return
        raise AssertionError("not started")

    try:
        failing.touch()
        mgr.reconcile(snapshot(gpu_sample(0)))
        failing.unlink()
        clock.now += 1
        mgr.reconcile()
        assert mgr.status()[0].up
        for _ in range(3):
            clock.now += 1
            fail_then_start()
        (said,) = events.recent(kind_prefix="mps.start_failed")
        assert said.fields["failed_starts"] == 1
        clock.now += 60
        mgr.reconcile()  # it ran well: the trouble is over
        fail_then_start()
        said_again = events.recent(kind_prefix="mps.start_failed")
        assert [e.fields["failed_starts"] for e in said_again] == [1, 5]
        assert "(5 failed starts of the device since gpud started)" in said_again[1].message
    finally:
        mgr.stop()
        store.close()


def test_a_device_that_cannot_start_turned_off_and_on_again_starts_at_once_and_says_it(
    root: Path,
) -> None:
    """The operator disabling a device whose starts keep failing ends that trouble: turned
    on again, its start is tried at once and a failure is said anew."""
    now = [100.0]
    mgr, store, events = _cannot_start(root, now)
    try:
        mgr.reconcile(HEALTHY_0)
        for _ in range(3):
            now[0] += 10.0
            mgr.reconcile(HEALTHY_0)
        mgr.set_limits("0", enabled=False)
        mgr.reconcile(HEALTHY_0)
        mgr.set_limits("0", enabled=True)
        mgr.reconcile(HEALTHY_0)
        failed = events.recent(kind_prefix="mps.start_failed")
        assert [e.fields["retry_in_s"] for e in failed] == [1.0, 1.0]
    finally:
        mgr.stop()
        store.close()


def test_a_first_failed_health_check_is_said_once_and_later_ones_are_logged(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first failed check is its event alone (``mps.hung``, logged as every event is),
    not also a warning; the second, which no event says, is a warning naming the GPU; the
    last (``mps.unresponsive``) says its error in the event."""
    hang = Hang()
    mgr, store, events = make_manager(root, max_failures=3, run_control=hang)
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        pid = mgr.status()[0].pid
        assert pid is not None
        hang.hung = True

        def warned() -> list[str]:
            return [
                r.getMessage()
                for r in caplog.records
                if r.name == "gpud.mps.manager" and r.levelno >= logging.WARNING
            ]

        with caplog.at_level(logging.WARNING, logger="gpud.mps.manager"):
            mgr.reconcile()
            assert [e.kind for e in events.recent(kind_prefix="mps.hung")] == ["mps.hung"]
            assert warned() == []
            mgr.reconcile()
            (second,) = warned()
            assert "GPU 0" in second and "failed health check 2" in second, second
            mgr.reconcile()
            assert len(warned()) == 1
        (killed,) = events.recent(kind_prefix="mps.unresponsive")
        assert killed.fields["error"] and "the last: " in killed.message
        wait_dead(pid)
    finally:
        mgr.stop()
        store.close()


def _crash_loop(mgr: MpsManager, clock: Hand, deaths: int) -> MpsManager:
    """Start the daemon of GPU 0, then let ``deaths`` daemons die a second after each start."""
    mgr.reconcile(snapshot(gpu_sample(0)))
    for _ in range(deaths):
        kill_and_wait_restart(mgr, clock, up_s=1)
    return mgr


def kill_unseen(mgr: MpsManager, clock: Hand, *, up_s: float) -> None:
    """Let the daemon of the node's one device run ``up_s`` (the clock) unseen by any pass,
    SIGKILL it, and pass once."""
    clock.now += up_s
    pid = mgr.status()[0].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    mgr.reconcile()


def test_a_crash_loop_a_disable_ended_while_its_daemon_was_dead_is_not_said_over_later(
    root: Path,
) -> None:
    """A device in a crash loop, disabled while its last daemon lies dead in back-off, then
    turned on again: its daemon starts at once as a first start (``mps.start``), and no
    ``mps.crash_loop_ended`` follows for the loop the disable already ended."""
    clock = Hand()
    mgr, store, events = make_manager(root, clock=clock)
    try:
        kill_unseen(_crash_loop(mgr, clock, 4), clock, up_s=1)  # its restart backed off
        assert mgr.status()[0].pid is None
        mgr.set_limits("0", enabled=False)
        mgr.reconcile()
        mgr.set_limits("0", enabled=True)
        mgr.reconcile()
        assert mgr.status()[0].pid is not None
        starts = [e.kind for e in events.recent(kind_prefix="mps.") if e.kind in _STARTS]
        assert starts == ["mps.start", "mps.restart", "mps.start"], starts
        clock.now += 61
        mgr.reconcile()
        mgr.reconcile()
        assert not events.recent(kind_prefix="mps.crash_loop_ended")
    finally:
        mgr.stop()
        store.close()


_STARTS = ("mps.start", "mps.restart")


def test_a_start_failing_with_another_error_is_said_again_and_every_failure_is_counted(
    root: Path,
) -> None:
    """Starts that keep failing with one error are said once (``mps.start_failed``); one
    failing with another error is said too, though no daemon ran well between. The status
    and ``gpud_mps_daemon_start_failures_total`` count every failed start, said or not."""
    why = root / "why"
    why.write_text("no GPU answers")
    wrapper = control_wrapper(root, f'[ "$1" = -d ] && cat {shlex.quote(str(why))} >&2 && exit 1')
    clock = Hand()
    mgr, store, events = make_manager(
        root, [str(wrapper)], clock=clock, sleep=lambda s: None, backoff_max_s=60.0
    )
    try:
        mgr.reconcile(snapshot(gpu_sample(0)))
        for _ in range(3):
            clock.now += 60
            mgr.reconcile()
        (said,) = events.recent(kind_prefix="mps.start_failed")
        assert "no GPU answers" in said.message, said.message
        why.write_text("the MPS pipe directory is full")
        clock.now += 60
        mgr.reconcile()
        failed = events.recent(kind_prefix="mps.start_failed")
        assert [e.fields["failed_starts"] for e in failed] == [1, 5]
        assert "the MPS pipe directory is full" in failed[1].message, failed[1].message
        clock.now += 60
        mgr.reconcile()
        assert len(events.recent(kind_prefix="mps.start_failed")) == 2
        assert mgr.status()[0].failed_starts == 6
        # gpuctl mps show --json
        assert message_to_dict(device_message(mgr.status()[0], None))["failed_starts"] == 6
        labels = {"gpu": "0", "uuid": gpu_uuid(0), "profile": "H100-SXM5-80GB"}
        registry = _metrics_registry(mgr)
        assert registry.get_sample_value("gpud_mps_daemon_start_failures_total", labels) == 6.0
    finally:
        mgr.stop()
        store.close()


def test_a_crash_loop_whose_end_is_seen_only_after_its_daemon_exited_says_it_ran_not_runs(
    root: Path,
) -> None:
    """A crash loop whose last daemon ran 60 s, then exited before a pass saw it up: the
    loop's end (``mps.crash_loop_ended``) says the daemon ran, and exited, not that it runs."""
    clock = Hand()
    mgr, store, events = make_manager(root, clock=clock)
    try:
        # the first pass since it came up: it ran 61 s, and is gone
        kill_unseen(_crash_loop(mgr, clock, 3), clock, up_s=61)
        (ended,) = events.recent(kind_prefix="mps.crash_loop_ended")
        assert "ran 61 s before it exited" in ended.message, ended.message
        assert "has run" not in ended.message and ended.fields["up_s"] == 61
    finally:
        mgr.stop()
        store.close()
