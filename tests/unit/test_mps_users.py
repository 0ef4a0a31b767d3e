"""Placement under MPS keeps users apart: a control daemon serves one user at a time."""

from __future__ import annotations

import os
import sqlite3
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpud.admission.model import Request, Vec
from gpud.admission.node import synthetic
from gpud.admission.placement_fit import PlacementFit
from gpud.admission.service import QUEUED, STARTED, AdmissionService
from gpud.config import AdmissionConfig
from gpud.errors import ResourceExhausted
from gpud.events import EventLog
from gpud.jobs.api import reservation_message
from gpud.jobs.placement import DeviceLoad, Reservations, choose_devices, user_name
from gpud.jobs.registry import JobSpec
from gpud.jobs.service import JobService, RunRequest
from gpud.mps.manager import MpsManager, targets_from_snapshot
from gpud.mps.procs import real_uid
from gpud.shared import GIB
from gpud.store import StateStore
from tests.unit.mps_support import (
    FAKE_CONTROL,
    fake_proc,
    gpu_sample,
    gpu_uuid,
    mig_uuid,
    snapshot,
)

NODE = snapshot(
    gpu_sample(0, migs=(("3g.40gb", 40), ("3g.40gb", 40))),
    gpu_sample(1, memory_gib=80),
    gpu_sample(2, memory_gib=80),
)
DEVICES = targets_from_snapshot(NODE)
NAMES = {1000: "alice", 1001: "bob"}.get


def name_of(uid: int) -> str:
    return NAMES(uid) or str(uid)


def place(spec: JobSpec, loads: dict[str, DeviceLoad], uid: int | None) -> list[str]:
    chosen = choose_devices(spec, DEVICES, loads, memory_bytes=None, uid=uid, name_of=name_of)
    return [d.uuid for d in chosen]


def shared_text(job: str, uid: int, device: str, whose: str, ends: str) -> str:
    return (
        f"job {job!r} (uid {uid}) asks {device}: it is shared under MPS by jobs of user"
        f" {whose}, and an MPS control daemon serves one user at a time: {job}'s CUDA"
        f" processes would wait there until {ends} end"
    )


def test_a_job_goes_to_a_device_no_other_user_holds_even_with_more_jobs() -> None:
    loads = {
        gpu_uuid(1): DeviceLoad(0, ("a",), users=((1000, "a"),)),
        gpu_uuid(2): DeviceLoad(0, ("b1", "b2"), users=((1001, "b1"), (1001, "b2"))),
    }
    assert place(JobSpec("b"), loads, 1001) == [gpu_uuid(2)]
    assert place(JobSpec("a2"), loads, 1000) == [gpu_uuid(1)]
    # unknown user: constrained by nothing, the fewest jobs win as before
    assert place(JobSpec("x"), loads, None) == [gpu_uuid(1)]


def test_a_job_joins_a_device_serving_its_user_before_an_idle_one() -> None:
    # the idle GPU stays free for another user's run (a control daemon serves one user)
    loads = {gpu_uuid(2): DeviceLoad(0, ("a",), users=((1000, "a"),))}
    assert place(JobSpec("a2"), loads, 1000) == [gpu_uuid(2)]
    assert place(JobSpec("b"), loads, 1001) == [gpu_uuid(1)]
    # unknown user: constrained by nothing, the fewest jobs win
    assert place(JobSpec("x"), loads, None) == [gpu_uuid(1)]


def test_one_users_runs_spread_over_all_but_the_last_idle_gpu(
    tmp_path: Path, store: StateStore, proc: Path
) -> None:
    """One user's runs that set no limits take GPUs 0, 1 and 2 in turn; the fourth joins a
    GPU serving that user (the fewest jobs, then the first) and GPU 3 stays idle for
    another user's run, which then goes there."""
    jobs, _ = node(tmp_path, store, proc, mps=True, gpus=4)

    def run(job: str, holder: int) -> list[int]:
        reservation = jobs.reserve(RunRequest(job, holder_pid=holder)).reservation
        return jobs.gpu_indexes(reservation.devices)

    assert [run(f"a{i}", 4242) for i in range(4)] == [[0], [1], [2], [0]]
    assert run("b", 4343) == [3]


def test_a_preview_from_a_pid_namespace_gpud_cannot_see_is_for_no_known_user(
    tmp_path: Path, store: StateStore, proc: Path
) -> None:
    """``gpuctl env`` run where gpud sees no such process (another container's PID
    namespace) previews the job as for no known user, rather than being refused: a preview
    reserves nothing."""
    jobs, _ = node(tmp_path, store, proc, mps=True, gpus=2)
    jobs.reserve(RunRequest("a", holder_pid=4242))
    jobs.registry.add(JobSpec("b"))
    env = jobs.env("b", holder_pid=999_999, holder_pid_namespace=4_026_531_999)
    assert env["CUDA_VISIBLE_DEVICES"] == gpu_uuid(1)


def test_a_job_is_refused_where_every_fitting_device_has_another_user() -> None:
    loads = {
        gpu_uuid(1): DeviceLoad(0, ("a",), users=((1000, "a"),)),
        gpu_uuid(2): DeviceLoad(0, ("a2", "c"), users=((1000, "a2"), (1002, "c"))),
    }
    with pytest.raises(ResourceExhausted) as refused:
        place(JobSpec("b"), loads, 1001)
    assert str(refused.value) == shared_text("b", 1001, gpu_uuid(1), "alice (a)", "a's")
    with pytest.raises(ResourceExhausted) as two:
        place(JobSpec("b", devices=(gpu_uuid(2),)), loads, 1001)
    assert str(two.value) == (
        f"job 'b' (uid 1001) asks {gpu_uuid(2)}: it is shared under MPS by jobs of users"
        " alice (a2), 1002 (c), and an MPS control daemon serves one user at a time: b's"
        " CUDA processes would wait there until a2's and c's end"
    )
    # two GPUs asked, one free of other users: refused, naming the other
    free = {gpu_uuid(1): loads[gpu_uuid(1)]}
    with pytest.raises(ResourceExhausted, match="until a's end"):
        place(JobSpec("b", gpu_count=2), free, 1001)


def test_a_pinned_device_of_another_user_is_refused_and_its_own_users_is_not() -> None:
    loads = {gpu_uuid(1): DeviceLoad(0, ("a", "x"), users=((1000, "a"),))}
    with pytest.raises(ResourceExhausted) as refused:
        place(JobSpec("b", devices=(gpu_uuid(1),)), loads, 1001)
    assert str(refused.value) == shared_text("b", 1001, gpu_uuid(1), "alice (a)", "a's")
    assert place(JobSpec("a2", devices=(gpu_uuid(1),)), loads, 1000) == [gpu_uuid(1)]
    assert place(JobSpec("b", devices=(gpu_uuid(1),)), loads, None) == [gpu_uuid(1)]


def test_mig_devices_are_kept_apart_each_with_its_own_daemon() -> None:
    loads = {mig_uuid(0, 0): DeviceLoad(0, ("a",), users=((1000, "a"),))}
    assert place(JobSpec("b", mig_profile="3g.40gb"), loads, 1001) == [mig_uuid(0, 1)]
    loads[mig_uuid(0, 1)] = DeviceLoad(0, ("a2",), users=((1000, "a2"),))
    with pytest.raises(ResourceExhausted, match=f"asks {mig_uuid(0, 0)}: .* alice \\(a\\)"):
        place(JobSpec("b", mig_profile="3g.40gb"), loads, 1001)
    # a whole GPU in MIG mode is not the MIG devices' daemon: GPU 0 is not in the pool
    assert place(JobSpec("b"), loads, 1001) == [gpu_uuid(1)]


def test_memory_refusals_come_before_users() -> None:
    loads = {
        gpu_uuid(1): DeviceLoad(70 * GIB, ("a",), users=((1000, "a"),)),
        gpu_uuid(2): DeviceLoad(70 * GIB, ("c",)),
    }
    spec = JobSpec("b")
    with pytest.raises(ResourceExhausted, match=r"asks 20GiB on .*, 10GiB free"):
        choose_devices(spec, DEVICES, loads, memory_bytes=20 * GIB, uid=1001, name_of=name_of)


# -- the jobs service: the holder's UID from /proc --------------------------------------


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    fake_proc(root, 4242, 1000)
    fake_proc(root, 4343, 1001)
    fake_proc(root, 4444, 1000)
    return root


def node(
    root: Path, store: StateStore, proc: Path, *, mps: bool, gpus: int = 1
) -> tuple[JobService, MpsManager]:
    manager = MpsManager(store, EventLog(None), root / "run", FAKE_CONTROL, enabled=mps)
    manager.observe(targets_from_snapshot(snapshot(*(gpu_sample(i) for i in range(gpus)))))
    jobs = JobService(store, EventLog(None), manager, socket_path=root / "s", proc_root=proc)
    return jobs, manager


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    s = StateStore(tmp_path / "state")
    yield s
    s.close()


def test_the_holders_uid_is_read_from_proc_and_kept(
    tmp_path: Path, store: StateStore, proc: Path
) -> None:
    assert real_uid(4343, proc) == 1001 and real_uid(1, proc) is None
    service, _ = node(tmp_path, store, proc, mps=True)
    a = service.reserve(RunRequest("a", holder_pid=4242)).reservation
    assert a.uid == 1000
    assert service.reservations.get(a.id).uid == 1000
    msg = reservation_message(service.reservations.get(a.id))
    assert msg.holder_uid == 1000 and msg.holder_user
    # no holder: no known user
    api = service.reserve(RunRequest("api")).reservation
    assert api.uid is None and not reservation_message(api).HasField("holder_uid")
    with pytest.raises(ResourceExhausted) as refused:
        service.reserve(RunRequest("b", holder_pid=4343))
    assert "(uid 1001) asks GPU-" in str(refused.value)
    assert "would wait there until a's end" in str(refused.value)
    assert service.reserve(RunRequest("a2", holder_pid=4444)).reservation.uid == 1000


def test_with_mps_off_users_share_devices_as_before(
    tmp_path: Path, store: StateStore, proc: Path
) -> None:
    service, _ = node(tmp_path, store, proc, mps=False)
    service.reserve(RunRequest("a", holder_pid=4242))
    b = service.reserve(RunRequest("b", holder_pid=4343)).reservation
    assert b.uid == 1001  # still known, for `gpuctl jobs ls`


def test_the_admission_gate_sends_a_job_past_another_users_device(
    tmp_path: Path, store: StateStore, proc: Path
) -> None:
    """GPU 0 holds one job of alice, GPU 1 two of bob: bob's next goes to GPU 1, not to the
    device with the fewest jobs; with GPU 1 full it is refused naming alice's job."""
    jobs, manager = node(tmp_path, store, proc, mps=True, gpus=2)
    AdmissionService(store, jobs, manager, EventLog(None), AdmissionConfig())
    first, second = (t.uuid for t in jobs.targets())
    jobs.reserve(RunRequest("a", devices=(first,), holder_pid=4242))
    for job in ("b1", "b2"):
        jobs.reserve(RunRequest(job, devices=(second,), holder_pid=4343))
    b3 = jobs.reserve(RunRequest("b3", holder_pid=4343)).reservation
    assert b3.devices == (second,)
    jobs.reserve(RunRequest("b4", devices=(second,), memory_bytes=70 * GIB, holder_pid=4343))
    with pytest.raises(ResourceExhausted) as refused:
        jobs.reserve(RunRequest("b5", memory_bytes=20 * GIB, holder_pid=4343))
    assert f"(uid 1001) asks {first}: it is shared under MPS" in str(refused.value)


def alice_and_bob(
    root: Path, store: StateStore, proc: Path, alice: int
) -> tuple[JobService, AdmissionService, str, str]:
    """Two GPUs under MPS: the first holds a run of alice (UID 1000, ``alice`` its holder)
    with room left, the second one of bob (UID 1001, this process) with 10 GiB left."""
    fake_proc(proc, alice, 1000)
    fake_proc(proc, os.getpid(), 1001)
    jobs, manager = node(root, store, proc, mps=True, gpus=2)
    admission = AdmissionService(
        store, jobs, manager, EventLog(None), AdmissionConfig(), proc_root=proc
    )
    first, second = (t.uuid for t in jobs.targets())
    jobs.reserve(RunRequest("a", devices=(first,), memory_bytes=10 * GIB, holder_pid=alice))
    jobs.reserve(RunRequest("b1", devices=(second,), memory_bytes=70 * GIB, holder_pid=os.getpid()))
    return jobs, admission, first, second


def test_a_queued_job_starts_beside_its_own_user_when_room_frees_there(
    tmp_path: Path, store: StateStore
) -> None:
    """Bob's queued job waits while only alice's GPU has room, saying why, and starts on
    bob's GPU once it frees, never on alice's."""
    alice = subprocess.Popen(["sleep", "60"])
    try:
        proc = tmp_path / "proc"
        jobs, admission, first, second = alice_and_bob(tmp_path, store, proc, alice.pid)
        (b1,) = (r for r in jobs.reservations.held() if r.job == "b1")
        queued = admission.enqueue(RunRequest("b2", memory_bytes=20 * GIB, holder_pid=os.getpid()))
        assert queued.entry.state == QUEUED
        assert queued.waiting_on == (  # not "could not start: …": it is not tried there
            f"job 'b2' (uid 1001) asks {first}: it is shared under MPS by jobs of user"
            f" {user_name(1000)} (a), and an MPS control daemon serves one user at a time: b2's CUDA processes"
            " would wait there until a's end;"
            f" GPU 0 held by a ({user_name(1000)}), GPU 1 held by b1 ({user_name(1001)})"
        )
        jobs.release(b1.id)
        admission.tick()
        started = admission.view(queued.entry.id)
        assert started.entry.state == STARTED
        assert started.reservation is not None and started.reservation.devices == (second,)
    finally:
        alice.kill()
        alice.wait()


def test_a_state_dir_without_the_uid_column_loads(tmp_path: Path) -> None:
    path = tmp_path / "state"
    path.mkdir()
    StateStore(path).close()  # the database file as gpud lays it out
    (db,) = [p for p in path.iterdir() if p.suffix == ".db"]
    with sqlite3.connect(db) as conn:  # job_reservations as the previous version made it
        conn.execute(
            """CREATE TABLE job_reservations (id TEXT PRIMARY KEY, job TEXT NOT NULL,
            devices TEXT NOT NULL, threads_percent INTEGER, memory_bytes INTEGER,
            client_priority INTEGER NOT NULL, holder_pid INTEGER, holder_start INTEGER,
            created_at REAL NOT NULL, default_memory TEXT, report_token TEXT)"""
        )
        conn.execute(
            "INSERT INTO job_reservations VALUES ('r1', 'old', ?, NULL, NULL, 0, 4242, 77, 1.0,"
            " '{}', 't')",
            (f'["{gpu_uuid(1)}"]',),
        )
    store = StateStore(path)
    try:
        res = Reservations(store)
        (old,) = res.held()
        assert old.job == "old" and old.uid is None
        assert not reservation_message(old).HasField("holder_uid")
    finally:
        store.close()


# -- devices whose MPS defaults would narrow what the job asks --------------------------


def test_a_device_whose_mps_defaults_are_below_the_jobs_own_limits_comes_last() -> None:
    """An MPS client only narrows its server's limits: on GPU 1 (defaults 40 %, 20 GiB) a job
    asking 60 % and 30 GiB would get 40 % and 20 GiB, so GPU 2 takes it though it has a job
    already; where every device would narrow it, the usual order decides (gpuctl warns)."""
    gpu1, gpu2 = gpu_uuid(1), gpu_uuid(2)
    threads = {gpu1: 40}.get
    memory = {gpu1: 20 * GIB}.get
    loads = {gpu2: DeviceLoad(10 * GIB, ("other",))}
    spec = JobSpec("j", threads_percent=60)

    def chosen(spec: JobSpec, memory_bytes: int | None, **kw: object) -> str:
        (d,) = choose_devices(
            spec, DEVICES, loads, memory_bytes=memory_bytes, default_memory=memory,
            default_threads=threads, **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        return d.uuid

    assert chosen(spec, None) == gpu2  # threads alone
    assert chosen(JobSpec("j"), 30 * GIB) == gpu2  # memory alone
    assert chosen(JobSpec("j", threads_percent=40), 20 * GIB) == gpu1  # within the defaults
    assert chosen(JobSpec("j"), None) == gpu1  # asks nothing of its own
    every = {gpu1: 40, gpu2: 40}.get
    (d,) = choose_devices(
        spec, DEVICES, loads, memory_bytes=None, default_memory=memory, default_threads=every
    )
    assert d.uuid == gpu1  # the fewest jobs, as before


def test_the_queue_places_as_the_jobs_service_does_past_lower_mps_defaults() -> None:
    """The admission queue chooses a queued run's devices itself: a device whose MPS default
    thread share or memory limit is below the run's own comes last there too."""
    first, second = synthetic("H100-SXM5-80GB", 2)
    first = replace(first, default_threads=40, default_memory=20 * GIB)
    fit = PlacementFit([first, second])
    busy = {second.uuid: Vec(10 * GIB, 10)}  # the less loaded is the first
    assert fit.place(Request(gpu_count=1, threads_percent=60), busy, allowed=None) == (second.uuid,)
    assert fit.place(Request(gpu_count=1, memory_bytes=30 * GIB), busy, allowed=None) == (
        second.uuid,
    )
    within = Request(gpu_count=1, threads_percent=40, memory_bytes=20 * GIB)
    assert fit.place(within, busy, allowed=None) == (first.uuid,)


def test_a_pass_places_a_queued_job_by_the_user_read_when_it_queued(
    tmp_path: Path, store: StateStore
) -> None:
    """An admission pass takes each queued entry's user as read when it queued: it reads no
    ``/proc`` for it (here ``/proc`` no longer says: read again, the job would have no user
    and go to alice's GPU, which has room); an entry of no known user is read as before."""
    alice = subprocess.Popen(["sleep", "60"])
    try:
        proc = tmp_path / "proc"
        jobs, admission, first, _ = alice_and_bob(tmp_path, store, proc, alice.pid)
        queued = admission.enqueue(RunRequest("b2", memory_bytes=20 * GIB, holder_pid=os.getpid()))
        assert queued.entry.state == QUEUED and queued.entry.holder_uid == 1001
        (proc / str(os.getpid()) / "status").write_text("Name:\tgpuctl\n")  # no Uid line now
        admission.tick()
        again = admission.view(queued.entry.id)
        assert again.entry.state == QUEUED
        assert f"(uid 1001) asks {first}" in again.waiting_on
        # an entry queued when /proc did not say: read at each pass, as before
        assert jobs.placement_uid(os.getpid(), None) is None
        assert jobs.placement_uid(os.getpid(), 1001) == 1001
    finally:
        alice.kill()
        alice.wait()
