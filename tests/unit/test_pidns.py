"""A client's PID in another PID namespace (``gpuctl run`` in a container), found in gpud's
view of processes on a fake ``/proc`` tree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpud.admission.service import AdmissionService
from gpud.config import AdmissionConfig
from gpud.errors import FailedPrecondition
from gpud.events import EventLog
from gpud.jobs.service import JobService, RunRequest
from gpud.mps.manager import MpsManager
from gpud.pidns import find, local_pid, namespace_of, ns_pids, own_namespace
from gpud.store import StateStore
from gpud.v1 import jobs_pb2
from tests.unit.mps_support import FAKE_CONTROL, gpu_sample, snapshot

HOST = 4026531836  # the host's PID namespace (gpud's)
BOX = 4026532712  # a container's
OTHER = 4026532999  # another container's


def fake_process(proc: Path, pid: int | str, namespace: int, *nspid: int) -> None:
    """``<proc>/<pid>`` with its ``ns/pid`` link naming ``namespace`` and, unless
    ``pid`` is "self", a status whose NSpid line is ``pid`` then ``nspid``."""
    d = proc / str(pid)
    (d / "ns").mkdir(parents=True)
    (d / "ns" / "pid").symlink_to(f"pid:[{namespace}]")
    if pid != "self":
        ids = "\t".join(str(p) for p in (pid, *nspid))
        (d / "status").write_text(f"Name:\tgpuctl\nPid:\t{pid}\nNSpid:\t{ids}\nNSpgid:\t{ids}\n")
        (d / "stat").write_text(f"{pid} (gpuctl) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 77 0 0\n")


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    """gpud in the host's namespace; host PID 1 (init) and 7 (some daemon); a container
    whose PID 1 is host 4242 and whose PID 7 is host 4250; another container whose PID 7
    is host 5007."""
    root = tmp_path / "proc"
    fake_process(root, "self", HOST)
    fake_process(root, 1, HOST)
    fake_process(root, 7, HOST)
    fake_process(root, 4242, BOX, 1)
    fake_process(root, 4250, BOX, 7)
    fake_process(root, 5007, OTHER, 7)
    (root / "stat").write_text("btime 1700000000\n")
    return root


def test_links_and_nspid_are_read() -> None:
    assert namespace_of("self") == own_namespace() == os.stat("/proc/self/ns/pid").st_ino
    assert ns_pids(os.getpid())[-1] == os.getpid()  # type: ignore[index]


def test_a_pid_of_another_namespace_is_found_in_gpuds(proc: Path) -> None:
    assert namespace_of(4242, proc) == BOX
    assert local_pid(1, BOX, proc) == 4242
    assert local_pid(7, BOX, proc) == 4250


def test_the_same_pid_in_another_namespace_is_not_taken(proc: Path) -> None:
    # PID 7 names three processes: the host's, the container's and the other container's
    assert find(7, OTHER, proc) == 5007
    assert local_pid(7, OTHER, proc) == 5007
    (proc / "5007" / "status").unlink()  # gone as it is read
    with pytest.raises(FailedPrecondition):
        local_pid(7, OTHER, proc)


def test_a_pid_gpud_cannot_see_is_refused_naming_it(proc: Path) -> None:
    with pytest.raises(FailedPrecondition) as info:
        local_pid(3, BOX, proc, field="holder_pid")
    assert str(info.value) == (
        "holder_pid: no process 3 of PID namespace pid:[4026532712] is visible to gpud"
        " (gone, or in a container that gpud's own PID namespace does not hold)"
    )
    with pytest.raises(FailedPrecondition, match=r"pid:\[12345\]"):
        local_pid(1, 12345, proc)  # a namespace of no process gpud sees


def test_no_namespace_or_gpuds_own_takes_the_pid_as_it_is(tmp_path: Path, proc: Path) -> None:
    assert local_pid(1, None, proc) == 1
    assert local_pid(7, HOST, proc) == 7
    assert local_pid(99, None, tmp_path / "nothing") == 99  # nothing read at all


def _jobs(root: Path, proc: Path) -> tuple[JobService, MpsManager]:
    store = StateStore(root / "state")
    mps = MpsManager(store, EventLog(None), root / "run", FAKE_CONTROL, enabled=False)
    mps.reconcile(snapshot(gpu_sample(0), gpu_sample(1)))
    return JobService(store, EventLog(None), mps, socket_path=root / "s", proc_root=proc), mps


def test_a_reservation_is_held_by_gpuds_pid_of_a_containers_holder(
    tmp_path: Path, proc: Path
) -> None:
    """``gpuctl run`` as PID 1 of a container holds its reservation as host PID 4242, not
    as the host's init (which never exits: the reservation would be held for ever)."""
    jobs, _ = _jobs(tmp_path, proc)
    held = jobs.reserve(RunRequest("pa", gpu_count=1, holder_pid=1, holder_pid_namespace=BOX))
    assert held.reservation.holder_pid == 4242
    # an older gpuctl, or one in gpud's own namespace: the PID as it is
    same = jobs.reserve(RunRequest("pb", gpu_count=1, holder_pid=7, holder_pid_namespace=HOST))
    assert same.reservation.holder_pid == 7
    old = jobs.reserve(RunRequest("pc", gpu_count=1, holder_pid=7))
    assert old.reservation.holder_pid == 7
    with pytest.raises(FailedPrecondition, match="no process 3 of PID namespace"):
        jobs.reserve(RunRequest("pd", gpu_count=1, holder_pid=3, holder_pid_namespace=BOX))
    assert {r.job for r in jobs.reservations.held()} == {"pa", "pb", "pc"}
    assert [j.name for j in jobs.registry.all()] == ["pa", "pb", "pc"]  # pd not registered


def test_a_queued_run_waits_as_gpuds_pid_of_its_holder(tmp_path: Path, proc: Path) -> None:
    """(The fake holder 5007 runs nowhere: the tick after the enqueue drops the entry.)"""
    jobs, mps = _jobs(tmp_path, proc)
    admission = AdmissionService(
        jobs.store, jobs, mps, EventLog(None), AdmissionConfig(), proc_root=proc
    )
    jobs.reserve(RunRequest("a", gpu_count=2))
    queued = admission.enqueue(
        RunRequest("b", gpu_count=1, holder_pid=7, holder_pid_namespace=OTHER)
    )
    assert queued.entry.request.holder_pid == 5007
    with pytest.raises(FailedPrecondition, match="no process 9 of PID namespace"):
        admission.enqueue(RunRequest("c", gpu_count=1, holder_pid=9, holder_pid_namespace=BOX))
    assert "c" not in {j.name for j in jobs.registry.all()}  # nothing kept of it


def test_the_api_passes_the_namespace_on() -> None:
    from gpud.admission.api import run_request

    ask = jobs_pb2.ReserveRequest(job="a", holder_pid=1, holder_pid_namespace=BOX)
    assert run_request(ask).holder_pid_namespace == BOX
    assert run_request(jobs_pb2.ReserveRequest(job="a", holder_pid=1)).holder_pid_namespace is None
