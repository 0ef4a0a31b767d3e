"""Job registry, placement, environment and attribution (no daemon processes)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpud.backend.port import ProcessInfo, unknown_identity
from gpud.cli.jobs import unhealthy_lines
from gpud.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StateInUse,
)
from gpud.events import EventLog
from gpud.jobs import leftovers
from gpud.jobs.api import JobsServicer
from gpud.jobs.attribution import Attributor, memory_by_job
from gpud.jobs.env import build_env
from gpud.jobs.placement import DeviceLoad, Reservation, Reservations, choose_devices
from gpud.jobs.registry import JobKind, JobRegistry, JobSpec, validate_spec
from gpud.jobs.service import STOP_GRACE_S, JobService, RunRequest
from gpud.jobs.stops import RunStop, RunStops, StopReason
from gpud.mps.manager import MpsManager, MpsTarget, targets_from_snapshot
from gpud.shared import GIB, is_about, shell_exports
from gpud.store import DB_NAME, StateStore
from gpud.telemetry.snapshot import GpuSample, SeenIdentity
from gpud.v1 import jobs_pb2
from tests.unit.mps_support import FAKE_CONTROL, gpu_sample, gpu_uuid, mig_uuid, snapshot
from tests.unit.store_support import held_write_lock

NODE = snapshot(
    gpu_sample(0, migs=(("3g.40gb", 40), ("3g.40gb", 40))),
    gpu_sample(1, memory_gib=80),
    gpu_sample(2, memory_gib=40),
)
DEVICES = targets_from_snapshot(NODE)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    s = StateStore(tmp_path / "state")
    yield s
    s.close()


def test_registry_persists_jobs(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    reg = JobRegistry(store, clock=lambda: 42.0)
    reg.add(JobSpec("infer-a", JobKind.INFERENCE, owner="ana", mig_profile="3g.40gb",
                    threads_percent=40, memory_bytes=20 * GIB, slo_p99_ms=25.0))  # fmt: skip
    reg.add(JobSpec("train-b", devices=(gpu_uuid(1),)))
    with pytest.raises(AlreadyExists):
        reg.add(JobSpec("train-b"))
    store.close()

    store = StateStore(tmp_path)
    reg = JobRegistry(store)
    assert [j.name for j in reg.all()] == ["infer-a", "train-b"]
    assert reg.names() == ["infer-a", "train-b"]
    assert reg.registrations() == {"infer-a": 42.0, "train-b": 42.0}
    infer = reg.get("infer-a")
    assert (infer.kind, infer.owner, infer.mig_profile, infer.slo_p99_ms) == (
        JobKind.INFERENCE, "ana", "3g.40gb", 25.0,
    )  # fmt: skip
    assert infer.created_at == 42.0
    assert infer.effective_priority == 0
    assert reg.get("train-b").devices == (gpu_uuid(1),)
    assert reg.get("train-b").effective_priority == 1
    reg.remove("train-b")
    with pytest.raises(NotFound):
        reg.get("train-b")
    store.close()


def test_a_stored_slo_outside_the_range_is_brought_into_it_on_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An earlier gpud took any p99 SLO above zero; the registry that loads such a row sets
    it to the floor (what `gpuctl colo advise` and `gpuctl run` then take) in the row, and
    warns once, naming the job; an SLO in range is left as it was."""
    from gpud.shared import MIN_SLO_MS, check_slo_ms

    store = StateStore(tmp_path)
    reg = JobRegistry(store)
    for name in ("tight", "ok"):
        reg.add(JobSpec(name, JobKind.INFERENCE, slo_p99_ms=25.0))
    with store.transaction() as conn:  # as the earlier gpud stored it
        conn.execute("UPDATE jobs SET slo_p99_ms = 0.005 WHERE name = 'tight'")
    with caplog.at_level("WARNING", logger="gpud.jobs.registry"):
        reg = JobRegistry(store)
    tight = reg.get("tight").slo_p99_ms
    assert tight == MIN_SLO_MS and check_slo_ms(tight) == tight
    assert reg.get("ok").slo_p99_ms == 25.0
    (warning,) = caplog.messages
    assert "job tight" in warning and "0.005 ms" in warning and "0.01 ms now" in warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpud.jobs.registry"):
        JobRegistry(store)  # the row was rewritten: no second warning
    assert not caplog.messages
    store.close()


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (JobSpec("bad name"), "name"),
        (JobSpec("evil\n"), "name"),  # a cgroup, an env line, a log line of its own
        (JobSpec("x", owner="alice\x1b]0;owned\x07"), "owner"),  # a terminal's title
        (JobSpec("x", owner="alice\nFAKE  training"), "owner"),  # a row of `gpuctl jobs ls`
        (JobSpec("x", owner="a" * 129), "owner"),
        (JobSpec("x", devices=("GPU-a\x1b[31m\nFAKE ROW",)), "devices"),
        (JobSpec("x", devices=("",)), "devices"),
        (JobSpec("x", mig_profile="huge"), "mig"),
        (JobSpec("x", mig_profile="1g.10gb\n"), "mig"),
        (JobSpec("x", gpu_count=0), "gpus"),
        (JobSpec("x", gpu_count=2, mig_profile="1g.10gb"), "gpus"),
        (JobSpec("x", threads_percent=0), "threads"),
        (JobSpec("x", memory_bytes=5), "memory"),
        (JobSpec("x", slo_p99_ms=10.0), "slo_p99_ms"),
        (JobSpec("x", JobKind.INFERENCE, slo_p99_ms=-1.0), "slo_p99_ms"),
        (JobSpec("x", JobKind.INFERENCE, slo_p99_ms=float("nan")), "slo_p99_ms"),
        (JobSpec("x", JobKind.INFERENCE, slo_p99_ms=float("inf")), "slo_p99_ms"),
        (JobSpec("x", JobKind.INFERENCE, slo_p99_ms=1e308), "slo_p99_ms"),
        (JobSpec("x", JobKind.INFERENCE, slo_p99_ms=0.0), "slo_p99_ms"),
        (JobSpec("x", JobKind.INFERENCE, slo_p99_ms=1e-3), "slo_p99_ms"),  # a microsecond
        (JobSpec("x", client_priority=3), "priority"),
    ],
)
def test_invalid_jobs_name_the_field(store: StateStore, spec: JobSpec, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        JobRegistry(store).add(spec)
    assert info.value.field == field


def test_placement_picks_the_least_loaded_fitting_devices() -> None:
    loads = {
        mig_uuid(0, 0): DeviceLoad(30 * GIB, ("a",)),
        gpu_uuid(1): DeviceLoad(10 * GIB, ("b",)),
    }
    mig = choose_devices(JobSpec("j", mig_profile="3g.40gb"), DEVICES, loads, memory_bytes=5 * GIB)
    assert [d.uuid for d in mig] == [mig_uuid(0, 1)]
    one = choose_devices(JobSpec("j"), DEVICES, loads, memory_bytes=None)
    assert [d.uuid for d in one] == [gpu_uuid(2)]
    two = choose_devices(JobSpec("j", gpu_count=2), DEVICES, loads, memory_bytes=35 * GIB)
    assert [d.uuid for d in two] == [gpu_uuid(2), gpu_uuid(1)]
    pinned = choose_devices(
        JobSpec("j", devices=(mig_uuid(0, 0),)), DEVICES, loads, memory_bytes=None
    )
    assert [d.uuid for d in pinned] == [mig_uuid(0, 0)]


def test_placement_refusals_carry_the_numbers() -> None:
    loads = {
        mig_uuid(0, 0): DeviceLoad(30 * GIB, ("a",)),
        mig_uuid(0, 1): DeviceLoad(35 * GIB, ("b", "c")),
    }
    with pytest.raises(ResourceExhausted) as info:
        choose_devices(JobSpec("j", mig_profile="3g.40gb"), DEVICES, loads, memory_bytes=20 * GIB)
    assert str(info.value) == (
        f"job 'j' asks 20GiB on {mig_uuid(0, 0)} (3g.40gb): 30GiB reserved by a of 40GiB, 10GiB free"
    )
    with pytest.raises(ResourceExhausted, match="asks 3 whole GPUs; this node has 2"):
        choose_devices(JobSpec("j", gpu_count=3), DEVICES, {}, memory_bytes=None)
    with pytest.raises(NotFound, match=r"no MIG device of profile 1g\.10gb .*here: 3g\.40gb"):
        choose_devices(JobSpec("j", mig_profile="1g.10gb"), DEVICES, {}, memory_bytes=None)
    with pytest.raises(NotFound, match="GPU-nope"):
        choose_devices(JobSpec("j", devices=("GPU-nope",)), DEVICES, {}, memory_bytes=None)


def test_a_refusal_names_a_gpu_the_request_would_fit_were_less_held_there() -> None:
    """60 GiB on a node of a 40 GiB GPU (all free) and an 80 GiB GPU with 50 GiB held: the
    80 GiB GPU is what stands in the way, not the one that could never hold it."""
    small = MpsTarget("GPU-small", 0, None, "NVIDIA A100-PCIE-40GB", 40 * GIB)
    big = MpsTarget("GPU-big", 1, None, "NVIDIA H100 80GB HBM3", 80 * GIB)
    loads = {"GPU-big": DeviceLoad(50 * GIB, ("a",))}
    with pytest.raises(ResourceExhausted, match=r"on GPU-big .*30GiB free"):
        choose_devices(JobSpec("j"), [small, big], loads, memory_bytes=60 * GIB)
    with pytest.raises(ResourceExhausted, match=r"asks 90GiB on GPU-big .*30GiB free"):
        choose_devices(JobSpec("j"), [small, big], loads, memory_bytes=90 * GIB)


def test_environment_of_a_reservation() -> None:
    r = Reservation("r1", "infer-a", (mig_uuid(0, 1),), 40, 20 * GIB, 0, None, 0.0)
    pipe = Path("/run/gpud/mps") / mig_uuid(0, 1) / "pipe"
    env = build_env(r, socket_path=Path("/run/gpud/gpud.sock"), pipe_dirs={mig_uuid(0, 1): pipe})
    assert env == {
        "CUDA_VISIBLE_DEVICES": mig_uuid(0, 1),
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20G",
        "CUDA_MPS_CLIENT_PRIORITY": "0",
        "GPUD_JOB": "infer-a",
        "GPUD_SOCKET": "/run/gpud/gpud.sock",
        "GPUD_RESERVATION": "r1",
    }
    wide = Reservation("r2", "train", (gpu_uuid(1), gpu_uuid(2)), None, None, 1, None, 0.0)
    env = build_env(wide, socket_path=Path("/s"), pipe_dirs={gpu_uuid(1): Path("/p")})
    assert env["CUDA_VISIBLE_DEVICES"] == f"{gpu_uuid(1)},{gpu_uuid(2)}"
    assert not [k for k in env if k.startswith("CUDA_MPS")]
    # no --memory: the MPS default it reserved under pins every client it starts, even one
    # started after the default was raised; one an earlier version made recorded none
    pipes = {gpu_uuid(1): Path("/p")}
    defaulted = Reservation(
        "r3", "t", (gpu_uuid(1),), None, None, 0, None, 0.0, ((gpu_uuid(1), 30 * GIB),)
    )
    env = build_env(defaulted, socket_path=Path("/s"), pipe_dirs=pipes)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=30G"
    for defaults in ((), None):
        r = replace(defaulted, defaults=defaults)
        env = build_env(r, socket_path=Path("/s"), pipe_dirs=pipes)
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env
    assert shell_exports({"B": "it's", "A": "1"}) == "export A='1'\nexport B='it'\\''s'\n"


def fake_proc(
    root: Path, pid: int, *, environ: dict[str, str] | None, cgroup: str = "0::/"
) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "stat").write_text(
        f"{pid} (python3) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {1000 + pid} 0 0\n"
    )
    if environ is not None:
        (d / "environ").write_bytes(
            b"\0".join(f"{k}={v}".encode() for k, v in environ.items()) + b"\0"
        )
    (d / "cgroup").write_text(cgroup + "\n")


def test_a_process_in_a_cgroup_named_with_bytes_not_utf8_is_attributed_to_no_job(
    tmp_path: Path,
) -> None:
    """A cgroup's directory is named with whatever bytes its creator chose, and
    ``/proc/<pid>/cgroup`` shows them as they are: reading them as UTF-8 failed the whole
    attribution of the snapshot. Such a process is no job's; the others keep theirs."""
    fake_proc(tmp_path, 102, environ=None, cgroup="0::/system.slice/gpud-job-train-b.scope")
    fake_proc(tmp_path, 105, environ=None)
    (tmp_path / "105" / "cgroup").write_bytes(b"0::/user.slice/\xff\xfe.scope\n")
    snap = snapshot(gpu_sample(1, processes=(ProcessInfo(102, GIB), ProcessInfo(105, GIB))))
    uses = Attributor(proc_root=tmp_path).attribute(snap)
    assert [(u.pid, u.job, u.source) for u in uses] == [(102, "train-b", "cgroup"), (105, None, "")]


def test_processes_are_attributed_by_environ_then_cgroup(tmp_path: Path) -> None:
    fake_proc(tmp_path, 101, environ={"PATH": "/bin", "GPUD_JOB": "infer-a"})
    fake_proc(tmp_path, 102, environ=None, cgroup="0::/system.slice/gpud-job-train-b.scope")
    fake_proc(tmp_path, 103, environ={"PATH": "/bin"}, cgroup="0::/user.slice")
    snap = snapshot(
        gpu_sample(0, migs=(("3g.40gb", 40),),
                   processes=(ProcessInfo(101, 5 * GIB, 1, 0),),
                   mig_processes={0: (ProcessInfo(101, 5 * GIB, 1, 0),)}),
        gpu_sample(1, processes=(ProcessInfo(102, 7 * GIB), ProcessInfo(103, GIB), ProcessInfo(104, None))),
    )  # fmt: skip
    uses = Attributor(proc_root=tmp_path).attribute(snap)
    assert [(u.pid, u.device, u.job, u.source) for u in uses] == [
        (101, mig_uuid(0, 0), "infer-a", "environ"),
        (102, gpu_uuid(1), "train-b", "cgroup"),
        (103, gpu_uuid(1), None, ""),
        (104, gpu_uuid(1), None, ""),
    ]
    assert memory_by_job(uses) == {
        ("infer-a", mig_uuid(0, 0)): 5 * GIB,
        ("train-b", gpu_uuid(1)): 7 * GIB,
    }


def test_reservations_of_dead_holders_are_reaped(tmp_path: Path, store: StateStore) -> None:
    proc = tmp_path / "proc"
    fake_proc(proc, 4242, environ={})
    res = Reservations(store, proc_root=proc)
    kept = res.add(
        "a",
        [gpu_uuid(1)],
        threads_percent=None,
        memory_bytes=None,
        client_priority=1,
        holder_pid=4242,
    )
    res.add(
        "b",
        [gpu_uuid(1)],
        threads_percent=None,
        memory_bytes=GIB,
        client_priority=1,
        holder_pid=999_999_999,
    )
    pinned = res.add(
        "c",
        [gpu_uuid(2)],
        threads_percent=None,
        memory_bytes=None,
        client_priority=1,
        holder_pid=None,
    )
    # 4242 may not run on this machine; what is checked is the dead PID being released.
    gone = {r.job for r in res.reap()}
    assert "b" in gone and "c" not in gone
    assert pinned in res.held()
    assert kept.holder_pid == 4242


def test_what_a_run_whose_gpuctl_is_gone_left_running_is_killed_with_its_release(
    tmp_path: Path, store: StateStore
) -> None:
    """gpuctl killed with SIGKILL: the kernel kills its command (PR_SET_PDEATHSIG), not what
    the command started. gpud releases the reservation and kills those too (``GPUD_RUN``)."""
    events = EventLog(None)
    mps = MpsManager(store, events, tmp_path / "run", FAKE_CONTROL, enabled=False)
    mps.observe(DEVICES)
    service = JobService(store, events, mps, socket_path=Path("/s"))
    holder = subprocess.Popen(["sleep", "300"])
    held = service.reservations.add(
        "a", [gpu_uuid(1)], threads_percent=None, memory_bytes=None, client_priority=1,
        holder_pid=holder.pid,
    )  # fmt: skip
    env = {**os.environ, "GPUD_RUN": held.id}
    left = subprocess.Popen(["sleep", "300"], env=env)
    other = subprocess.Popen(["sleep", "300"], env={**os.environ, "GPUD_RUN": "another"})
    try:
        service.tick(None)
        assert left.poll() is None  # its gpuctl still runs
        holder.kill()
        holder.wait()
        service.tick(None)
        assert left.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None
        assert service.reservations.held() == []
        (event,) = [e for e in events.recent() if e.kind == "job.kill"]
        assert event.fields["pids"] == [left.pid], event
    finally:
        for p in (holder, left, other):
            p.kill()
            p.wait()


def _wait_for(path: Path) -> None:
    """Until ``path`` exists (a test's process says it is ready), at most 10 s."""
    deadline = time.monotonic() + 10
    while not path.exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_force_removed_jobs_runs_are_told_to_stop_then_killed(
    tmp_path: Path, store: StateStore
) -> None:
    """``gpuctl jobs rm --force`` releases a running job's reservations: its run's processes
    get SIGTERM at once, and those still there STOP_GRACE_S later SIGKILL (the tick)."""
    now = [1000.0]
    events = EventLog(None)
    mps = MpsManager(store, events, tmp_path / "run", FAKE_CONTROL, enabled=False)
    mps.observe(DEVICES)
    service = JobService(store, events, mps, socket_path=Path("/s"), clock=lambda: now[0])
    holder = subprocess.Popen(["sleep", "300"])  # its gpuctl run
    service.add(JobSpec("a"))
    held = service.reservations.add(
        "a", [gpu_uuid(1)], threads_percent=None, memory_bytes=None, client_priority=1,
        holder_pid=holder.pid,
    )  # fmt: skip
    env = {**os.environ, "GPUD_RUN": held.id}
    ready = tmp_path / "ready"
    polite = subprocess.Popen(["sleep", "300"], env=env)
    stubborn = subprocess.Popen(
        ["sh", "-c", f"trap '' TERM; touch {ready}; while :; do sleep 0.1; done"], env=env
    )
    try:
        _wait_for(ready)
        with pytest.raises(FailedPrecondition, match="--force"):
            service.remove("a")
        service.remove("a", force=True)
        assert polite.wait(timeout=10) == -signal.SIGTERM
        (event,) = [e for e in events.recent() if e.kind == "job.stop"]
        # and the stubborn shell's own sleep, a process of the run too
        assert {polite.pid, stubborn.pid} <= set(event.fields["pids"])
        # gpud restarts within the grace: the SIGKILL it promised is kept in the store
        service = JobService(store, events, mps, socket_path=Path("/s"), clock=lambda: now[0])
        service.tick(None)
        time.sleep(0.3)
        assert stubborn.poll() is None  # within its grace
        now[0] += STOP_GRACE_S
        service.tick(None)
        assert stubborn.wait(timeout=10) == -signal.SIGKILL
        assert holder.poll() is None  # gpuctl itself ends when its command has
        (killed,) = [e for e in events.recent() if e.kind == "job.kill"]
        assert "after SIGTERM" in killed.message and stubborn.pid in killed.fields["pids"]
    finally:
        for p in (holder, polite, stubborn):
            p.kill()
            p.wait()


def test_a_force_removed_run_an_older_gpuctl_run_started_is_stopped_too(
    tmp_path: Path, store: StateStore
) -> None:
    """A ``gpuctl run`` of a version older than ``GPUD_RUN``, still running through an
    upgrade of gpud, gave its command ``GPUD_RESERVATION`` alone: ``gpuctl jobs rm --force``
    stops that command too (it descends from the run's holder), SIGKILL after the grace, and
    leaves a shell that took the job's environment from ``gpuctl env`` alone."""
    mono = [50.0]
    events = EventLog(None)
    mps = MpsManager(store, events, tmp_path / "run", FAKE_CONTROL, enabled=False)
    mps.observe(DEVICES)
    service = JobService(store, events, mps, socket_path=Path("/s"), monotonic=lambda: mono[0])
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUD_")}
    ready = tmp_path / "ready"
    command = tmp_path / "command.sh"
    command.write_text(f"trap '' TERM; touch {ready}; while :; do sleep 0.1; done\n")
    # the older gpuctl run: its command gets the reservation id, then it waits for it
    holder = subprocess.Popen(
        ["sh", "-c", f"read id; GPUD_RESERVATION=$id sh {command} & wait"],
        stdin=subprocess.PIPE,
        env=base,
        text=True,
    )
    service.add(JobSpec("a"))
    held = service.reservations.add(
        "a", [gpu_uuid(1)], threads_percent=None, memory_bytes=None, client_priority=1,
        holder_pid=holder.pid,
    )  # fmt: skip
    assert holder.stdin is not None
    holder.stdin.write(f"{held.id}\n")
    holder.stdin.close()
    shell = subprocess.Popen(["sleep", "300"], env={**base, "GPUD_RESERVATION": held.id})
    try:
        _wait_for(ready)
        service.remove("a", force=True)
        (event,) = [e for e in events.recent() if e.kind == "job.stop"]
        assert event.fields["pids"] and shell.pid not in event.fields["pids"]
        mono[0] += STOP_GRACE_S
        service.tick(None)
        assert holder.wait(timeout=10) == 0  # its command was killed: its wait returned
        (killed,) = [e for e in events.recent() if e.kind == "job.kill"]
        assert "after SIGTERM" in killed.message
        assert shell.poll() is None
    finally:
        for p in (holder, shell):
            p.kill()
            p.wait()


def test_a_wall_clock_step_forward_does_not_cut_a_force_removed_runs_grace(
    tmp_path: Path, store: StateStore
) -> None:
    """The grace after SIGTERM is measured by the monotonic clock within one gpud: the
    wall clock stepping an hour ahead right after the removal does not make SIGKILL early."""
    now, mono = [1000.0], [50.0]
    events = EventLog(None)
    mps = MpsManager(store, events, tmp_path / "run", FAKE_CONTROL, enabled=False)
    mps.observe(DEVICES)
    service = JobService(
        store, events, mps, socket_path=Path("/s"), clock=lambda: now[0], monotonic=lambda: mono[0]
    )
    holder = subprocess.Popen(["sleep", "300"])
    service.add(JobSpec("a"))
    held = service.reservations.add(
        "a", [gpu_uuid(1)], threads_percent=None, memory_bytes=None, client_priority=1,
        holder_pid=holder.pid,
    )  # fmt: skip
    ready = tmp_path / "ready"
    stubborn = subprocess.Popen(
        ["sh", "-c", f"trap '' TERM; touch {ready}; while :; do sleep 0.1; done"],
        env={**os.environ, "GPUD_RUN": held.id},
    )
    try:
        _wait_for(ready)
        service.remove("a", force=True)
        now[0] += 3600  # NTP step, a resumed VM
        service.tick(None)
        mono[0] += STOP_GRACE_S - 0.5
        service.tick(None)
        time.sleep(0.3)
        assert stubborn.poll() is None
        assert not [e for e in events.recent() if e.kind == "job.kill"]
        mono[0] += 0.5
        service.tick(None)
        assert stubborn.wait(timeout=10) == -signal.SIGKILL
    finally:
        for p in (holder, stubborn):
            p.kill()
            p.wait()


def test_a_kill_due_before_a_restart_or_scheduled_before_the_clock_went_back_is_done(
    tmp_path: Path, store: StateStore
) -> None:
    """A released run's pending SIGKILL lives in the store: a gpud that died between the
    release and the kill does it at its first tick, and one whose time lies further ahead
    than any grace (the wall clock went back) is not put off."""
    events = EventLog(None)
    mps = MpsManager(store, events, tmp_path / "run", FAKE_CONTROL, enabled=False)
    mps.observe(DEVICES)
    RunStops(store, longest_wait_s=STOP_GRACE_S).schedule(
        RunStop("run-a", "a", StopReason.HOLDER_GONE, 1000.0)
    )
    RunStops(store, longest_wait_s=STOP_GRACE_S).schedule(
        RunStop("run-b", "b", StopReason.REMOVED, 1000.0 + 3600)
    )
    procs = [
        subprocess.Popen(["sleep", "300"], env={**os.environ, "GPUD_RUN": run})
        for run in ("run-a", "run-b", "run-c")
    ]
    try:
        service = JobService(store, events, mps, socket_path=Path("/s"), clock=lambda: 1000.0)
        service.tick(None)
        assert [p.wait(timeout=10) for p in procs[:2]] == [-signal.SIGKILL] * 2
        assert procs[2].poll() is None
        assert RunStops(store, longest_wait_s=STOP_GRACE_S).due(10**12) == []
        assert len([e for e in events.recent() if e.kind == "job.kill"]) == 2
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.fixture
def service(tmp_path: Path, store: StateStore) -> Iterator[JobService]:
    mps = MpsManager(store, EventLog(None), tmp_path / "run", FAKE_CONTROL, enabled=False)
    mps.observe(DEVICES)
    yield JobService(store, EventLog(None), mps, socket_path=Path("/run/gpud/gpud.sock"))


def test_a_lookup_of_a_name_no_job_may_have_says_the_name_rule_at_any_length(
    service: JobService,
) -> None:
    """``gpuctl jobs ls 'a b'``: refused by the rule, as one over the request bound is
    (:data:`gpud.api.validate.JOB_NAME_FIELDS`), not "no job" for a short one alone."""
    servicer = JobsServicer(service)
    for name in ("a b", "x" * 64):
        with pytest.raises(InvalidArgument, match=r"^name: .*letters, digits"):
            asyncio.run(servicer.ListJobs(jobs_pb2.ListJobsRequest(name=name), None))
    with pytest.raises(NotFound, match=r"^no job 'absent'$"):
        asyncio.run(servicer.ListJobs(jobs_pb2.ListJobsRequest(name="absent"), None))


def test_a_removal_within_an_open_transaction_is_refused(
    service: JobService, store: StateStore
) -> None:
    """A removal's hooks let go of what they keep in memory once its transaction
    committed: nested in another (re-entrant) transaction it would commit only later, or
    be rolled back with it, so it is refused, and nothing is removed or let go of."""
    service.registry.add(JobSpec("train-b"))
    let_go: list[str] = []
    service.add_removal_hook(lambda name, force: lambda: let_go.append(name))
    with pytest.raises(RuntimeError, match="open store transaction"), store.transaction():
        service.remove("train-b")
    with pytest.raises(RuntimeError, match="open store transaction"), store.reading():
        service.remove("train-b")
    assert service.registry.names() == ["train-b"] and let_go == []
    assert not store.in_transaction()
    service.remove("train-b")  # outside one: removed, its hooks' callables called
    assert service.registry.names() == [] and let_go == ["train-b"]


def test_a_reservation_is_told_to_its_reserved_hooks_only_once_committed(
    service: JobService, store: StateStore
) -> None:
    """The co-location loop hears of a reservation only once the store has committed it,
    outside the write transaction (its lock is never taken while SQLite's write lock is
    held); one rolled back was never made, and no hook hears of it."""
    told: list[tuple[str, bool]] = []
    service.add_reserved_hook(lambda r: told.append((r.job, store.in_transaction())))

    def refuse(what: str, reservation: Reservation, spec: JobSpec, end: object) -> None:
        if reservation.job == "rolled-back":
            raise RuntimeError("rolled back")

    service.add_observer(refuse)
    with pytest.raises(RuntimeError, match="rolled back"):
        service.reserve(RunRequest("rolled-back", JobKind.TRAINING))
    assert told == [] and service.reservations.held() == []
    service.reserve(RunRequest("kept", JobKind.TRAINING))
    assert told == [("kept", False)]


def test_run_registers_reserves_and_refuses_oversubscription(service: JobService) -> None:
    launch = service.reserve(
        RunRequest("infer-a", JobKind.INFERENCE, mig_profile="3g.40gb", memory_bytes=30 * GIB)
    )
    assert launch.created_job and launch.job.kind is JobKind.INFERENCE
    assert launch.env["CUDA_VISIBLE_DEVICES"] == mig_uuid(0, 0)
    assert launch.env["GPUD_JOB"] == "infer-a"
    second = service.reserve(RunRequest("infer-a"))  # reused, same limits: the other 3g.40gb
    assert not second.created_job
    assert second.env["CUDA_VISIBLE_DEVICES"] == mig_uuid(0, 1)
    with pytest.raises(ResourceExhausted, match="asks 30GiB"):
        service.reserve(RunRequest("infer-a"))
    with pytest.raises(InvalidArgument, match="registered as inference"):
        service.reserve(RunRequest("infer-a", JobKind.TRAINING))
    with pytest.raises(FailedPrecondition, match="holds 2 reservation"):
        service.remove("infer-a")
    service.release(second.reservation.id)
    assert service.loads()[mig_uuid(0, 0)] == DeviceLoad(30 * GIB, ("infer-a",))
    assert service.env("infer-a")["GPUD_RESERVATION"] == launch.reservation.id
    service.remove("infer-a", force=True)
    assert service.reservations.held() == []


def test_held_reservations_are_read_as_the_writer_sees_them_not_as_last_committed(
    service: JobService, store: StateStore
) -> None:
    """A release made in an open transaction, not committed yet, is gone from what
    ``held()`` reads (the traffic tick counts run ends on it), while a read of what was
    committed still has it."""
    launch = service.reserve(RunRequest("train-a"))
    with store.transaction():
        service.reservations.release(launch.reservation.id)
        assert service.reservations.held() == []
        committed: list[str] = []

        def read_committed() -> None:
            with store.read() as conn:
                committed.extend(r[0] for r in conn.execute("SELECT job FROM job_reservations"))

        reader = threading.Thread(target=read_committed)
        reader.start()
        reader.join()
        assert committed == ["train-a"]


def test_a_runs_reserve_and_release_events_are_found_by_gpu_index(service: JobService) -> None:
    """``gpuctl events --gpu 1`` finds a run's job.reserve and job.release, which name
    their devices by UUID: they carry the indexes of the devices' GPUs too."""
    whole = service.reserve(RunRequest("on-1", devices=(gpu_uuid(1),)))
    mig = service.reserve(RunRequest("on-mig", mig_profile="3g.40gb"))
    service.release(whole.reservation.id)
    service.release(mig.reservation.id)
    events = service._events.recent(kind_prefix="job.re")
    assert [(e.kind, e.fields["job"], e.fields["gpus"]) for e in events] == [
        ("job.reserve", "on-1", [1]),
        ("job.reserve", "on-mig", [0]),
        ("job.release", "on-1", [1]),
        ("job.release", "on-mig", [0]),
    ]
    about = [e for e in events if is_about(e.fields, gpu="1")]
    assert [(e.kind, e.fields["job"]) for e in about] == [
        ("job.reserve", "on-1"),
        ("job.release", "on-1"),
    ]


def test_a_job_that_can_get_no_dscp_tag_is_refused_before_it_holds_anything(
    service: JobService,
) -> None:
    tags = {"train-a": 10}

    def tag_of(job: str) -> int:
        if job not in tags:
            raise ResourceExhausted(f"job {job!r}: all 1 DSCP tags of traffic.dscp_pool are in use")
        return tags[job]

    service.set_tagger(tag_of, tags.get)
    launch = service.reserve(RunRequest("train-a"))
    assert launch.env["GPUD_DSCP"] == "10" and launch.env["NCCL_IB_TC"] == "40"
    with pytest.raises(ResourceExhausted, match=r"DSCP tags of traffic\.dscp_pool"):
        service.reserve(RunRequest("train-b"))
    assert [r.job for r in service.reservations.held()] == ["train-a"]
    assert [j.name for j in service.registry.all()] == ["train-a"]


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (RunRequest("big", gpu_count=1, memory_bytes=90 * GIB), ResourceExhausted),
        (RunRequest("many", gpu_count=99), ResourceExhausted),
        (RunRequest("nowhere", devices=("GPU-nope",)), NotFound),
        (RunRequest("mig", mig_profile="7g.80gb"), NotFound),
    ],
)
def test_a_refused_run_of_a_new_job_leaves_it_unregistered(
    service: JobService, request_: RunRequest, error: type[Exception]
) -> None:
    with pytest.raises(error):
        service.reserve(request_)
    assert service.registry.all() == [] and service.reservations.held() == []
    assert service.reserve(RunRequest(request_.job)).created_job  # new again, placed anew


def test_env_without_a_reservation_previews_the_placement(service: JobService) -> None:
    service.add(JobSpec("train-b", gpu_count=2))
    env = service.env("train-b")
    assert env["CUDA_VISIBLE_DEVICES"] == f"{gpu_uuid(1)},{gpu_uuid(2)}"
    assert "GPUD_RESERVATION" not in env  # nothing reserved yet
    assert service.reservations.held() == []


def test_a_preview_takes_no_dscp_tag_and_shows_the_one_held(service: JobService) -> None:
    # traffic.dscp_pool = "10-11": both tags held, train-b registered without one
    tags = {"train-a": 10, "infer-c": 11}
    taken: list[str] = []

    def tag_of(job: str) -> int:
        taken.append(job)  # a hand-over, or a job marked as about to run
        if job not in tags:
            raise ResourceExhausted(f"job {job!r}: all 2 DSCP tags of traffic.dscp_pool are in use")
        return tags[job]

    service.set_tagger(tag_of, tags.get)
    service.add(JobSpec("train-b", gpu_count=1))
    service.add(JobSpec("infer-c", gpu_count=1))
    preview = service.env("train-b")  # no tag to take: the preview answers all the same
    assert "GPUD_DSCP" not in preview and "GPUD_RESERVATION" not in preview
    assert service.env("infer-c")["GPUD_DSCP"] == "11"  # the one it holds
    assert taken == [] and service.reservations.held() == []


def test_a_mig_device_read_neither_for_processes_nor_memory_is_not_taken_for_free(
    tmp_path: Path, store: StateStore
) -> None:
    """NVML read neither the processes nor the memory of a MIG device: all of its memory is
    held beyond the reservations there, not none of it."""
    mps = MpsManager(store, EventLog(None), tmp_path / "run", FAKE_CONTROL, enabled=False)
    mps.observe(DEVICES)
    service = JobService(
        store, EventLog(None), mps, socket_path=Path("/s"), proc_root=tmp_path / "proc"
    )
    g = gpu_sample(1, migs=(("3g.40gb", 40),))
    (m,) = g.mig_devices
    unread = g._replace(mig_devices=(m._replace(memory=None, processes_read=False),))
    service.tick(snapshot(gpu_sample(0, used_gib=30), unread))
    assert service.unreserved_memory() == {m.identity.uuid: 40 * GIB}


def test_a_device_whose_processes_are_not_listed_is_not_taken_for_idle(
    tmp_path: Path, store: StateStore
) -> None:
    """NVML uses 30 GiB of GPU 1 but cannot list its processes: what is used beyond the
    10 GiB reserved there is held, as if another user's process used it."""
    mps = MpsManager(store, EventLog(None), tmp_path / "run", FAKE_CONTROL, enabled=False)
    mps.observe(DEVICES)
    service = JobService(
        store, EventLog(None), mps, socket_path=Path("/s"), proc_root=tmp_path / "proc"
    )
    gpu1 = gpu_uuid(1)
    service.reserve(RunRequest("small", devices=(gpu1,), memory_bytes=10 * GIB))
    unlisted = gpu_sample(1, used_gib=30, processes_read=False)
    service.tick(snapshot(gpu_sample(0, used_gib=30), unlisted))
    assert service.unreserved_memory() == {gpu1: 20 * GIB}
    service.tick(snapshot(gpu_sample(0, used_gib=30), unlisted._replace(processes_read=True)))
    assert service.unreserved_memory() == {}


def test_memory_processes_use_beyond_reservations_is_not_placed_again(
    tmp_path: Path, store: StateStore
) -> None:
    """Another user's process (202, no job) holds 30 GiB of GPU 1, and job small's process
    uses 30 GiB where it reserved 10: of the 80 GiB, 10 are reserved and 50 used beyond,
    so 20 are left to place, as ``nvidia-smi`` would show."""
    proc = tmp_path / "proc"
    fake_proc(proc, 101, environ={"GPUD_JOB": "small"})
    fake_proc(proc, 202, environ={})  # no job
    mps = MpsManager(store, EventLog(None), tmp_path / "run", FAKE_CONTROL, enabled=False)
    mps.observe(DEVICES)
    service = JobService(store, EventLog(None), mps, socket_path=Path("/s"), proc_root=proc)
    gpu1 = gpu_uuid(1)
    service.reserve(RunRequest("small", devices=(gpu1,), memory_bytes=10 * GIB))
    # 303 has exited since the snapshot (no /proc/303): its memory is free already
    running = (ProcessInfo(101, 30 * GIB), ProcessInfo(202, 30 * GIB), ProcessInfo(303, 9 * GIB))
    service.tick(snapshot(gpu_sample(1, memory_gib=80, processes=running)))
    assert service.unreserved_memory() == {gpu1: 50 * GIB}
    assert service.loads()[gpu1].unreserved_bytes == 50 * GIB
    with pytest.raises(ResourceExhausted, match="10GiB reserved by small, 50GiB used beyond"):
        service.reserve(RunRequest("big", devices=(gpu1,), memory_bytes=30 * GIB))
    service.reserve(RunRequest("fits", devices=(gpu1,), memory_bytes=20 * GIB))
    with pytest.raises(ResourceExhausted, match="0B free"):
        service.reserve(RunRequest("more", devices=(gpu1,), memory_bytes=GIB))


def test_tick_attributes_and_metrics_show_memory_per_job(tmp_path: Path, store: StateStore) -> None:
    from prometheus_client import CollectorRegistry
    from prometheus_client.registry import Collector

    from gpud.jobs.metrics import JobMetrics

    proc = tmp_path / "proc"
    fake_proc(proc, 101, environ={"GPUD_JOB": "infer-a"})
    mps = MpsManager(store, EventLog(None), tmp_path / "run", FAKE_CONTROL, enabled=False)
    mps.observe(DEVICES)
    service = JobService(store, EventLog(None), mps, socket_path=Path("/s"), proc_root=proc)
    service.add(JobSpec("infer-a", JobKind.INFERENCE, owner="ana", slo_p99_ms=20.0))
    service.reserve(RunRequest("infer-a", memory_bytes=10 * GIB))
    # 202: a process of no job (no environ, no cgroup under the fake /proc)
    running = (ProcessInfo(101, 3 * GIB), ProcessInfo(202, 1 * GIB))
    service.tick(snapshot(gpu_sample(1, processes=running)))
    source = JobMetrics(service)

    class _Source(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            return source()

    registry = CollectorRegistry()
    registry.register(_Source())
    job = {"job": "infer-a"}
    assert (
        registry.get_sample_value("gpud_job_info", {**job, "kind": "inference", "owner": "ana"})
        == 1.0
    )
    assert registry.get_sample_value("gpud_job_slo_p99_latency_seconds", job) == 0.02
    assert registry.get_sample_value("gpud_job_reservations", job) == 1.0
    used = {"job": "infer-a", "uuid": gpu_uuid(1)}
    assert registry.get_sample_value("gpud_job_gpu_memory_used_bytes", used) == 3 * GIB
    assert registry.get_sample_value("gpud_job_gpu_processes", used) == 1.0
    device = {"uuid": gpu_uuid(1)}
    assert registry.get_sample_value("gpud_device_unattributed_processes", device) == 1.0
    assert registry.get_sample_value("gpud_device_unattributed_memory_bytes", device) == GIB
    reserved = service.reservations.held()[0].devices[0]
    assert (
        registry.get_sample_value("gpud_device_reserved_memory_bytes", {"uuid": reserved})
        == 10 * GIB
    )
    # the other devices read 0, not absent; and so does this one once released
    others = [t.uuid for t in mps.targets() if t.uuid and t.uuid != reserved]
    assert others
    for uuid in others:
        assert registry.get_sample_value("gpud_device_reserved_memory_bytes", {"uuid": uuid}) == 0
    service.release(service.reservations.held()[0].id)
    assert registry.get_sample_value("gpud_device_reserved_memory_bytes", {"uuid": reserved}) == 0


def test_a_run_asking_zero_gpus_is_refused_for_a_registered_job(service: JobService) -> None:
    service.add(JobSpec("train-z", gpu_count=1))
    with pytest.raises(InvalidArgument) as err:
        service.reserve(RunRequest(job="train-z", gpu_count=0))
    assert err.value.field == "gpus"
    assert service.reservations.held("train-z") == []


def test_attribution_from_api_threads_does_not_break_the_tick(tmp_path: Path) -> None:
    """gpuctl mig show asks job_of on an API thread while the tick prunes the cache (which
    raised "dictionary changed size during iteration" before the lock): both sides keep
    answering, and answering right."""
    fake_proc(tmp_path, 101, environ={"GPUD_JOB": "infer-a"})
    fake_proc(tmp_path, 102, environ={"PATH": "/bin"}, cgroup="0::/gpud-job-train-b.scope")
    attributor = Attributor(proc_root=tmp_path)
    node = snapshot(gpu_sample(0, processes=(ProcessInfo(101, GIB), ProcessInfo(102, GIB))))
    expected = [(101, "infer-a", "environ"), (102, "train-b", "cgroup")]
    stop = threading.Event()
    api_answers: list[tuple[int, tuple[str | None, str]]] = []
    api_errors: list[BaseException] = []

    def ask() -> None:
        # many PIDs the tick does not know (cached, then pruned) and one it does
        pid = 100_000
        try:
            while not stop.is_set():
                api_answers.append((pid, attributor.job_of(pid)))
                api_answers.append((101, attributor.job_of(101)))
                pid += 1
        except BaseException as err:
            api_errors.append(err)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=ask)
    thread.start()
    ticks = []
    try:
        while len(ticks) < 20 and thread.is_alive():
            # let the API thread fill the cache, then prune it while it goes on adding
            target = len(api_answers) + 200
            while len(api_answers) < target and thread.is_alive():
                time.sleep(0)
            ticks.append([(u.pid, u.job, u.source) for u in attributor.attribute(node)])
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert api_errors == []
    assert len(ticks) == 20 and len(api_answers) >= 20 * 200  # both sides ran, interleaved
    assert all(tick == expected for tick in ticks)
    assert all(
        answer == (("infer-a", "environ") if pid == 101 else (None, ""))
        for pid, answer in api_answers
    )
    # what the API thread cached is pruned by the next tick: only the node's processes stay
    attributor.attribute(node)
    assert len(attributor._cache) == 2


@pytest.mark.parametrize(
    "profile", ["1g.10gb", "1g.10gb+me", "1g.18gb+me.all", "1g.10gb-me", "1c.3g.40gb"]
)
def test_every_mig_profile_name_nvidia_uses_is_accepted(profile: str) -> None:
    assert validate_spec(JobSpec("x", mig_profile=profile)).mig_profile == profile


def test_devices_are_named_by_index_as_gpuctl_mps_takes_them(service: JobService) -> None:
    launch = service.reserve(RunRequest("by-index", devices=("1",)))
    assert launch.env["CUDA_VISIBLE_DEVICES"] == gpu_uuid(1)
    mig = service.reserve(RunRequest("by-mig", devices=("0:1",)))
    assert mig.env["CUDA_VISIBLE_DEVICES"] == mig_uuid(0, 1)
    assert service.add(JobSpec("pinned", devices=("2",))).devices == (gpu_uuid(2),)
    with pytest.raises(NotFound, match=r"no GPU or MIG device '9' \(known: 0:0"):
        service.reserve(RunRequest("nowhere", devices=("9",)))


@pytest.mark.parametrize("index", ["9", "0:7"])
def test_an_index_the_node_lacks_is_refused_saying_why_a_uuid_is_not(
    service: JobService, index: str
) -> None:
    """Registration keeps the UUID an index names now: an index that names none (a GPU the
    node lacks, a MIG device a layout may make later) cannot be kept, and the refusal says
    so and what registers the job ahead of a layout instead; a UUID the node lacks is kept."""
    why = (
        ": an index names a device of this node as it is now (a job keeps the UUID it"
        " names); give a UUID, or a MIG profile (--mig), to register a job ahead of a layout"
    )
    with pytest.raises(NotFound) as err:
        service.add(JobSpec("ahead", devices=(index,)))
    assert str(err.value).startswith(f"no GPU or MIG device '{index}' (known: 0:0")
    assert str(err.value).endswith(why)
    assert service.add(JobSpec("ahead", devices=("MIG-later",))).devices == ("MIG-later",)


def test_no_job_is_placed_on_an_unhealthy_gpu(service: JobService) -> None:
    """GPU 1 is lost: a job that names no device goes elsewhere; one pinned there is refused
    at once, naming the GPU and why; with no healthy GPU left, a job waits."""
    lost = gpu_sample(1, memory_gib=80)._replace(healthy=False, reason="GPU lost (memory)")
    service.tick(snapshot(NODE.gpus[0], lost, NODE.gpus[2]))
    assert service.unhealthy() == {1: "GPU lost (memory)"}
    launch = service.reserve(RunRequest("a"))
    assert launch.env["CUDA_VISIBLE_DEVICES"] == gpu_uuid(2)
    with pytest.raises(FailedPrecondition, match=r"on GPU 1, which is unhealthy: GPU lost"):
        service.reserve(RunRequest("b", devices=(gpu_uuid(1),)))
    # Too few GPUs without the lost one: the refusal says it is left out, and why.
    with pytest.raises(
        ResourceExhausted,
        match=r"this node has 2 GPUs not in MIG mode, 1 of them taking jobs now \(GPU 1 unhealthy: GPU lost",
    ):
        service.reserve(RunRequest("b2", gpu_count=3))
    sick = [g._replace(healthy=False, reason="driver call timed out") for g in NODE.gpus]
    service.tick(snapshot(*sick))
    with pytest.raises(ResourceExhausted, match="no healthy GPU on this node now"):
        service.reserve(RunRequest("c"))
    service.tick(NODE)  # they answer again
    assert service.reserve(RunRequest("c")).env["CUDA_VISIBLE_DEVICES"]


def test_a_gpu_that_fails_while_another_process_holds_the_state_lock_takes_no_job(
    tmp_path: Path,
) -> None:
    """A backup tool holds the state database's lock: the tick's write is refused
    (StateInUse, naming the file), yet the GPU lost in its snapshot is known unhealthy at
    once, and a job pinned there is refused for it, not placed on a lost GPU until the
    lock is let go."""
    state = tmp_path / "state"
    store = StateStore(state, write_wait_s=0.05)
    mps = MpsManager(store, EventLog(None), tmp_path / "run", FAKE_CONTROL, enabled=False)
    mps.observe(DEVICES)
    service = JobService(store, EventLog(None), mps, socket_path=Path("/run/gpud/gpud.sock"))
    store.start_done()
    lost = gpu_sample(1, memory_gib=80)._replace(healthy=False, reason="GPU lost (memory)")
    try:
        with held_write_lock(state / DB_NAME):
            with pytest.raises(StateInUse, match=str(state / DB_NAME)):
                service.tick(snapshot(NODE.gpus[0], lost, NODE.gpus[2]))
            assert service.unhealthy() == {1: "GPU lost (memory)"}
        with pytest.raises(FailedPrecondition, match=r"on GPU 1, which is unhealthy: GPU lost"):
            service.reserve(RunRequest("b", devices=(gpu_uuid(1),)))
    finally:
        store.close()


def test_no_job_is_placed_on_a_gpu_whose_mig_instances_an_apply_is_changing(
    service: JobService,
) -> None:
    """A MIG apply destroys and creates GPU 0's instances: a run pinned to one of them is
    refused naming the apply, one that names no device goes elsewhere; once the apply ends
    GPU 0 is placed on again."""
    mig = [t.uuid for t in DEVICES if t.gpu == 0 and t.mig is not None]
    why = "a MIG apply of all-1g.10gb is changing its instances"
    with service.placing_none_on({0: why}):
        assert service.unhealthy() == {0: why}
        with pytest.raises(
            FailedPrecondition, match=rf"{mig[0]} is on GPU 0, where no job is placed now: {why}"
        ):
            service.reserve(RunRequest("pinned", devices=(mig[0],)))
        launch = service.reserve(RunRequest("any"))
        assert launch.reservation.devices in ((gpu_uuid(1),), (gpu_uuid(2),))
    assert service.unhealthy() == {}
    assert service.reserve(RunRequest("pinned", devices=(mig[0],))).reservation.devices == (mig[0],)


def test_a_gpu_held_twice_is_placed_on_again_only_once_both_holds_end(
    service: JobService,
) -> None:
    """An apply holds GPU 0 and a step inside it holds it again: when the inner hold ends
    GPU 0 is still held, naming the apply, and is placed on once the apply's hold ends."""
    mig = [t.uuid for t in DEVICES if t.gpu == 0 and t.mig is not None]
    outer = "a MIG apply of all-1g.10gb is changing its instances"
    inner = "a MIG reconcile to all-1g.10gb is changing its instances"
    with service.placing_none_on({0: outer}):
        with service.placing_none_on({0: inner}):
            assert service.unhealthy() == {0: inner}
        assert service.unhealthy() == {0: outer}
        with pytest.raises(
            FailedPrecondition, match=rf"GPU 0, where no job is placed now: {outer}"
        ):
            service.reserve(RunRequest("pinned", devices=(mig[0],)))
    assert service.unhealthy() == {}
    assert service.reserve(RunRequest("pinned", devices=(mig[0],))).reservation.devices == (mig[0],)


def test_a_mig_profile_only_on_a_gpu_left_out_is_refused_naming_that_gpu_and_why(
    service: JobService,
) -> None:
    """Every 3g.40gb device is on GPU 0: while a MIG apply changes its instances, or while
    it is unhealthy, a run asking that profile waits (ResourceExhausted) told where they are
    and why none is placed there, not that the node has no such profile; a profile the
    node lacks is still not found."""
    why = "a MIG apply of all-1g.10gb is changing its instances"
    with service.placing_none_on({0: why}):
        with pytest.raises(ResourceExhausted) as held:
            service.reserve(RunRequest("held", mig_profile="3g.40gb"))
        assert str(held.value) == (
            "job 'held': the MIG devices of profile 3g.40gb are on GPU 0, where no job is"
            f" placed now: {why}"
        )
        with pytest.raises(NotFound, match=r"no MIG device of profile 1g.10gb on this node"):
            service.reserve(RunRequest("other", mig_profile="1g.10gb"))
    lost = NODE.gpus[0]._replace(healthy=False, reason="GPU lost (memory)")
    service.tick(snapshot(lost, NODE.gpus[1], NODE.gpus[2]))
    with pytest.raises(ResourceExhausted) as sick:
        service.reserve(RunRequest("sick", mig_profile="3g.40gb"))
    assert str(sick.value) == (
        "job 'sick': the MIG devices of profile 3g.40gb are on GPU 0, which is unhealthy:"
        " GPU lost (memory)"
    )
    service.tick(NODE)
    assert service.reserve(RunRequest("sick", mig_profile="3g.40gb")).reservation.devices


def test_a_run_refused_while_an_apply_holds_every_gpu_calls_them_held_not_unhealthy(
    service: JobService,
) -> None:
    """A MIG apply changes every GPU's instances: a run that names no device is refused
    naming each GPU as held by the apply, not as unhealthy (each answers, and takes jobs
    again once the apply ends)."""
    why = "a MIG apply of all-1g.10gb is changing its instances"
    gpus = {t.gpu for t in DEVICES}
    with (
        service.placing_none_on(dict.fromkeys(gpus, why)),
        pytest.raises(ResourceExhausted) as refused,
    ):
        service.reserve(RunRequest("any"))
    said = str(refused.value)
    assert all(f"GPU {i} held: {why}" in said for i in gpus), said
    assert "unhealthy" not in said, said


def test_a_gpu_never_read_that_answers_is_placed_on_only_with_its_uuid(
    tmp_path: Path, store: StateStore
) -> None:
    """GPU 1 was lost before gpud started (its MPS target has the UUID ""): once a
    snapshot has it healthy, a job that names no device is not placed on "" (an empty
    ``CUDA_VISIBLE_DEVICES``) while the MPS manager still lists it so, but once the MPS
    manager observes that snapshot, on the UUID it has now."""
    mps = MpsManager(store, EventLog(None), tmp_path / "run", FAKE_CONTROL, enabled=False)
    service = JobService(store, EventLog(None), mps, socket_path=Path("/s"))
    unread = GpuSample(identity=unknown_identity(1), healthy=False, reason="GPU lost", sampled_at=0)
    down = replace(snapshot(unread), monotonic=1.0)
    mps.observe_snapshot(down)
    service.tick(down)
    up = replace(snapshot(NODE.gpus[1]), monotonic=2.0)
    service.tick(up)  # the MPS manager has not observed it yet
    assert service.unhealthy() == {}
    assert service.healthy_targets() == []
    with pytest.raises(ResourceExhausted):
        service.reserve(RunRequest("x"))
    assert service.reservations.held() == []
    mps.observe_snapshot(up)
    launch = service.reserve(RunRequest("x"))
    assert launch.reservation.devices == (gpu_uuid(1),)
    assert launch.env["CUDA_VISIBLE_DEVICES"] == gpu_uuid(1)
    service.release(launch.reservation.id)


_LAST_UUID = "GPU-ef6bd996-508f-4667-91a1-078f3e502e4b"
_LAST_SEEN = f"NVIDIA H100 80GB HBM3 {_LAST_UUID} at 00000000:1A:00.0"


def _lost_before_start(tmp_path: Path, store: StateStore) -> JobService:
    """GPU 1 lost since before gpud started; an earlier run last read it as _LAST_UUID."""
    mps = MpsManager(store, EventLog(None), tmp_path / "run", FAKE_CONTROL, enabled=False)
    service = JobService(store, EventLog(None), mps, socket_path=Path("/s"))
    lost = GpuSample(
        identity=unknown_identity(1),
        healthy=False,
        reason=f"GPU lost (identity): GPU is lost; last seen as {_LAST_SEEN}",
        sampled_at=0,
        last_seen=SeenIdentity(_LAST_UUID, "NVIDIA H100 80GB HBM3", "00000000:1A:00.0"),
    )
    down = replace(snapshot(NODE.gpus[0], lost), monotonic=1.0)
    mps.observe_snapshot(down)
    service.tick(down)
    return service


@pytest.mark.parametrize("name", ["1", "1:0"])
def test_a_gpu_lost_before_gpud_started_named_by_index_says_it_was_last_seen(
    tmp_path: Path, store: StateStore, name: str
) -> None:
    """Its index (or a MIG device of it) names whatever GPU is there now, which has no UUID
    yet: the job is refused naming the GPU, why it is unhealthy and how it was last seen."""
    service = _lost_before_start(tmp_path, store)
    with pytest.raises(FailedPrecondition) as err:
        service.add(JobSpec("pinned", devices=(name,)))
    why = (
        "its MIG devices are not known until it answers"
        if ":" in name
        else "GPU 1 names no UUID until it answers"
    )
    assert str(err.value) == (
        f"device {name} is on GPU 1, which is unhealthy: GPU lost (identity): GPU is lost;"
        f" last seen as {_LAST_SEEN} (not read since gpud started: {why})"
    )


def test_a_job_named_by_the_last_uuid_of_a_gpu_lost_before_gpud_started_is_kept_as_given(
    tmp_path: Path, store: StateStore
) -> None:
    """A GPU hung before gpud started answers with the same UUID once it comes back: a job
    registered ahead on that UUID keeps it, as on any UUID the node lacks."""
    service = _lost_before_start(tmp_path, store)
    assert service.add(JobSpec("pinned", devices=(_LAST_UUID,))).devices == (_LAST_UUID,)


def test_a_run_pinned_to_the_last_uuid_of_a_gpu_lost_before_gpud_started_is_refused_as_on_it(
    tmp_path: Path, store: StateStore
) -> None:
    """The job keeps the UUID as given, but while the GPU last seen with it has not answered
    its run is refused as one pinned to an unhealthy GPU (exit 6), naming the GPU and why,
    not as on a device the node lacks (exit 4); nothing is reserved."""
    service = _lost_before_start(tmp_path, store)
    with pytest.raises(FailedPrecondition) as err:
        service.reserve(RunRequest(job="p", devices=(_LAST_UUID,)))
    assert str(err.value) == (
        f"job 'p': {_LAST_UUID} was last seen on GPU 1, which is unhealthy: GPU lost"
        f" (identity): GPU is lost; last seen as {_LAST_SEEN} (not read since gpud started:"
        " GPU 1 names no UUID until it answers)"
    )
    assert service.reservations.held() == []


def test_an_older_snapshot_does_not_undo_the_health_of_a_newer_one(
    service: JobService,
) -> None:
    """A loop pass that read a snapshot before the sampler's next tick observed a newer
    one takes no health from it: GPU 1, lost since, stays unhealthy."""
    lost = gpu_sample(1, memory_gib=80)._replace(healthy=False, reason="GPU lost (memory)")
    service.tick(replace(snapshot(NODE.gpus[0], lost, NODE.gpus[2]), monotonic=11.0))
    service.tick(replace(NODE, monotonic=10.0))
    assert service.unhealthy() == {1: "GPU lost (memory)"}


def test_a_job_holding_a_device_of_a_gpu_that_failed_says_so(service: JobService) -> None:
    """``gpuctl jobs``: a job already running on a GPU that is lost since shows the GPU and
    why, beside the job; the others show nothing."""
    held = service.reserve(RunRequest("on-1", devices=(gpu_uuid(1),)))
    other = service.reserve(RunRequest("on-mig", mig_profile="3g.40gb"))
    lost = gpu_sample(1, memory_gib=80)._replace(healthy=False, reason="GPU lost (memory)")
    service.tick(snapshot(NODE.gpus[0], lost, NODE.gpus[2]))
    service._mps.reconcile()  # the MPS pass of the same tick
    shown = {
        j.name: list(j.unhealthy_gpus)
        for j in JobsServicer(service)._messages(service.registry.all())
    }
    assert shown == {"on-1": ["GPU 1: GPU lost (memory)"], "on-mig": []}
    assert "GPU 1 unhealthy: GPU lost (memory)" in "\n".join(
        unhealthy_lines(JobsServicer(service)._messages(service.registry.all()))
    )
    for launch in (held, other):
        service.release(launch.reservation.id)


def test_a_job_on_a_gpu_that_fails_or_answers_again_gets_an_event(service: JobService) -> None:
    """`gpuctl events --kind job.`: the job holding a device of the GPU that was lost is
    told once (not again as the reason changes), and when it answers again; the job on
    another GPU is told nothing; both keep their reservations."""
    held = service.reserve(RunRequest("on-1", devices=(gpu_uuid(1),)))
    other = service.reserve(RunRequest("on-mig", mig_profile="3g.40gb"))
    service.tick(NODE)
    lost = gpu_sample(1, memory_gib=80)._replace(healthy=False, reason="GPU lost (memory)")
    service.tick(snapshot(NODE.gpus[0], lost, NODE.gpus[2]))
    hung = lost._replace(reason="not answering: a driver call is outstanding")
    service.tick(snapshot(NODE.gpus[0], hung, NODE.gpus[2]))
    service.tick(NODE)
    events = service._events.recent(kind_prefix="job.gpu")
    assert [(e.kind, e.fields["job"], e.fields["gpu"], e.fields["uuid"]) for e in events] == [
        ("job.gpu_unhealthy", "on-1", 1, gpu_uuid(1)),
        ("job.gpu_recovered", "on-1", 1, gpu_uuid(1)),
    ]
    assert events[0].message == (
        "job on-1: GPU 1 under it is unhealthy: GPU lost (memory); its reservation stays "
        "until its run ends"
    )
    assert {r.job for r in service.reservations.held()} == {"on-1", "on-mig"}
    for launch in (held, other):
        service.release(launch.reservation.id)


def test_jobs_on_a_gpu_that_fails_are_told_without_waiting_for_a_write(
    service: JobService,
) -> None:
    """The sampler's listener tells the jobs on a GPU that failed while another thread
    writes the state database (a long transaction): it reads their reservations without
    waiting for that write to end, and the sampler's tick goes on."""
    held = service.reserve(RunRequest("on-1", devices=(gpu_uuid(1),)))
    service.observe_health(NODE)
    writing, done = threading.Event(), threading.Event()

    def write() -> None:
        with service.store.transaction():
            writing.set()
            done.wait(10.0)

    lost = gpu_sample(1, memory_gib=80)._replace(healthy=False, reason="GPU lost (memory)")
    observer = threading.Thread(
        target=service.observe_health, args=(snapshot(NODE.gpus[0], lost, NODE.gpus[2]),)
    )
    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert writing.wait(5.0)
        observer.start()
        observer.join(3.0)
        assert not observer.is_alive()
    finally:
        done.set()
        writer.join()
        if observer.ident is not None:
            observer.join()
    events = service._events.recent(kind_prefix="job.gpu")
    assert [(e.kind, e.fields["job"]) for e in events] == [("job.gpu_unhealthy", "on-1")]
    service.release(held.reservation.id)


def test_a_gpu_never_read_named_by_index_is_refused_and_nothing_is_kept(
    service: JobService, tmp_path: Path
) -> None:
    """GPUs 1 and 2 were lost before gpud started: no UUID, so a job naming one by index is
    refused with the GPU and why, and no job is registered with an empty device."""
    unread = [
        GpuSample(identity=unknown_identity(i), healthy=False, reason="GPU lost", sampled_at=0)
        for i in (1, 2)
    ]
    service._mps.observe(targets_from_snapshot(snapshot(NODE.gpus[0], *unread)))
    for index in ("1", "2"):
        with pytest.raises(FailedPrecondition, match=rf"on GPU {index}, which is unhealthy"):
            service.reserve(RunRequest("pinned", devices=(index,)))
    assert service.registry.all() == []


def test_every_device_of_a_gpu_never_read_is_listed_unhealthy(service: JobService) -> None:
    """GPUs 0 and 2 were lost before gpud started: both devices have the UUID "", and each
    is kept, by index; ``gpuctl jobs`` still names the GPU under a job that holds one."""
    held = service.reserve(RunRequest("on-1", devices=(gpu_uuid(1),)))
    unread = [
        GpuSample(identity=unknown_identity(i), healthy=False, reason="GPU lost", sampled_at=0)
        for i in (0, 2)
    ]
    lost = gpu_sample(1, memory_gib=80)._replace(healthy=False, reason="GPU lost (memory)")
    node = snapshot(unread[0], lost, unread[1])
    service._mps.observe(targets_from_snapshot(node))
    service.tick(node)
    service._mps.status()  # the MPS pass of the same tick
    assert service.unhealthy_devices() == {
        (0, None): ("", "GPU 0: GPU lost"),
        (1, None): (gpu_uuid(1), "GPU 1: GPU lost (memory)"),
        (2, None): ("", "GPU 2: GPU lost"),
    }
    shown = {
        j.name: list(j.unhealthy_gpus)
        for j in JobsServicer(service)._messages(service.registry.all())
    }
    assert shown == {"on-1": ["GPU 1: GPU lost (memory)"]}
    service.release(held.reservation.id)


@pytest.mark.parametrize("memory", [2**63, 2**64 - 1])
def test_memory_past_64_bits_is_refused_before_anything_is_kept(
    service: JobService, memory: int
) -> None:
    for call in (
        lambda: service.add(JobSpec("big", memory_bytes=memory)),
        lambda: service.reserve(RunRequest("big", gpu_count=1, memory_bytes=memory)),
    ):
        with pytest.raises(InvalidArgument, match=r"^memory: .* is more than any device holds$"):
            call()
    assert service.registry.all() == [] and service.reservations.held() == []
    service.add(JobSpec("small", gpu_count=1))
    with pytest.raises(InvalidArgument, match=r"^memory: "):  # a run's own limit too
        service.reserve(RunRequest("small", memory_bytes=memory))
    assert service.reservations.held() == []


def test_with_mps_off_a_runs_user_is_not_looked_for(tmp_path: Path, store: StateStore) -> None:
    """Users are kept apart only where MPS serves the devices: with MPS off co-location's
    advice asks no user, so a holder gpud cannot find (another PID namespace, gone) refuses
    nothing (``gpuctl colo advise`` from a container)."""
    mps = MpsManager(store, EventLog(None), tmp_path / "run", FAKE_CONTROL, enabled=False)
    service = JobService(store, EventLog(None), mps, socket_path=Path("/s"))
    assert service.run_uid(4_000_000, 4026531836) is None  # no such PID, nor namespace


def test_stopping_what_a_run_left_sends_sigkill_at_once_when_hurried(tmp_path: Path) -> None:
    """``leftovers.stop`` waits up to its grace for what the run left to end after SIGTERM,
    unless ``hurry()`` says not to wait more (a signal since the command ended): SIGKILL
    then, at the next poll."""
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "environ").write_bytes(b"HOME=/\0GPUD_RUN=r1\0")
    sent: list[tuple[int, int]] = []
    now = [0.0]
    hurried: list[bool] = []

    def sleep(seconds: float) -> None:
        now[0] += seconds
        hurried.append(True)  # a signal while it waited

    terminated, killed = leftovers.stop(
        "r1",
        60.0,
        tmp_path,
        send=lambda pid, sig: sent.append((pid, sig)),
        clock=lambda: now[0],
        sleep=sleep,
        hurry=lambda: bool(hurried),
    )
    assert terminated == killed == [41]
    assert sent == [(41, signal.SIGTERM), (41, signal.SIGKILL)]
    assert now[0] < 1.0


def _started(store: StateStore, run_dir: Path, events: EventLog | None = None) -> JobService:
    mps = MpsManager(store, EventLog(None), run_dir, FAKE_CONTROL, enabled=False)
    mps.observe(DEVICES)
    return JobService(store, events or EventLog(None), mps, socket_path=Path("/run/gpud/gpud.sock"))


def test_a_reserve_asked_again_with_its_request_id_is_answered_as_first_not_made_twice(
    tmp_path: Path, store: StateStore
) -> None:
    """A caller whose answer was lost asks again with the same request id and fields: it
    gets the reservation, environment and new-job flag of the first answer, and nothing
    more is reserved, registered or said."""
    events = EventLog(None)
    service = _started(store, tmp_path / "run", events)
    ask = RunRequest("train-a", gpu_count=1, memory_bytes=10 * GIB, request_id="r-1")
    first = service.reserve(ask)
    again = service.reserve(ask)
    assert again.reservation == first.reservation and again.env == first.env
    assert again.created_job and first.created_job
    assert [r.id for r in service.reservations.held()] == [first.reservation.id]
    assert [e.kind for e in events.recent()].count("job.reserve") == 1
    # another id is another reservation, as is a call with none
    other = service.reserve(replace(ask, request_id="r-2"))
    plain = service.reserve(replace(ask, request_id=""))
    assert len({first.reservation.id, other.reservation.id, plain.reservation.id}) == 3
    assert not other.created_job


def test_a_request_id_given_again_with_other_fields_is_refused_naming_it(
    service: JobService,
) -> None:
    first = service.reserve(RunRequest("train-a", memory_bytes=10 * GIB, request_id="r-1"))
    with pytest.raises(FailedPrecondition, match=r"request id 'r-1' was given to reservation"):
        service.reserve(RunRequest("train-a", memory_bytes=20 * GIB, request_id="r-1"))
    assert [r.id for r in service.reservations.held()] == [first.reservation.id]


def test_a_request_id_is_kept_through_a_restart_and_forgotten_once_released(
    tmp_path: Path,
) -> None:
    ask = RunRequest("train-a", gpu_count=1, request_id="r-1")
    store = StateStore(tmp_path / "state")
    first = _started(store, tmp_path / "run").reserve(ask)
    store.close()
    store = StateStore(tmp_path / "state")
    try:
        service = _started(store, tmp_path / "run")
        again = service.reserve(ask)
        assert again.reservation == first.reservation and again.created_job
        assert len(service.reservations.held()) == 1
        service.release(first.reservation.id)
        later = service.reserve(ask)  # the id went with its reservation
        assert later.reservation.id != first.reservation.id and not later.created_job
    finally:
        store.close()


def test_reservations_of_an_earlier_version_are_kept_and_take_request_ids(
    tmp_path: Path,
) -> None:
    """A state database whose job_reservations has no request columns gets them, its rows
    kept (with no request id)."""
    store = StateStore(tmp_path / "state")
    with store.transaction() as conn:
        conn.execute(
            """CREATE TABLE job_reservations (id TEXT PRIMARY KEY, job TEXT NOT NULL,
            devices TEXT NOT NULL, threads_percent INTEGER, memory_bytes INTEGER,
            client_priority INTEGER NOT NULL, holder_pid INTEGER, holder_start INTEGER,
            created_at REAL NOT NULL, default_memory TEXT, report_token TEXT,
            holder_uid INTEGER)"""
        )
        conn.execute(
            "INSERT INTO job_reservations (id, job, devices, client_priority, created_at)"
            " VALUES ('old', 'train-a', ?, 1, 1.0)",
            (f'["{gpu_uuid(1)}"]',),
        )
    store.close()
    store = StateStore(tmp_path / "state")
    try:
        reservations = Reservations(store)
        assert [r.id for r in reservations.held()] == ["old"]
        assert reservations.asked("r-1") is None
        with store.read() as conn:
            row = conn.execute("SELECT request_id, request FROM job_reservations").fetchone()
        assert tuple(row) == (None, None)
    finally:
        store.close()


@pytest.mark.parametrize("bad", ["x" * 129, "has space", "tab\there", "é"])
def test_a_request_id_that_could_not_be_kept_is_refused_naming_the_field(
    service: JobService, bad: str
) -> None:
    servicer = JobsServicer(service)
    request = jobs_pb2.ReserveRequest(job="train-a", request_id=bad)
    with pytest.raises(InvalidArgument, match=r"^request_id: "):
        asyncio.run(servicer.Reserve(request, None))
    assert service.reservations.held() == []


def test_a_reserved_hook_that_raises_fails_no_committed_reservation(
    service: JobService, caplog: pytest.LogCaptureFixture
) -> None:
    """The reservation is committed before its hooks hear of it: one hook that raises is
    logged, the hooks after it still hear, and the run is answered the reservation it holds."""
    told: list[str] = []

    def broken(reservation: Reservation) -> None:
        raise RuntimeError("hook broke")

    service.add_reserved_hook(broken)
    service.add_reserved_hook(lambda r: told.append(r.job))
    launch = service.reserve(RunRequest("kept", JobKind.TRAINING))
    assert [r.id for r in service.reservations.held()] == [launch.reservation.id]
    assert told == ["kept"]
    assert "job kept: after reservation" in caplog.text and "hook broke" in caplog.text
