"""The node's job bookkeeping explored as sequences: jobs registered and removed, runs
reserved and released, queued, left, their holders dying, GPUs lost and back, MPS default
memory limits set and cleared, gpud restarted on the same state directory, and after every
step the promises it keeps.

The services are the daemon's own, wired as it wires them, over hand-built samples of a
three-GPU node (one in MIG mode) and a fake clock; a holder is this test's own process, seen through a
``/proc`` tree of its own whose start time a step changes (the PID taken by another
process: every holder is gone).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from gpud.admission.service import LEFT, OFF, QUEUED, STARTED, AdmissionService
from gpud.config import AdmissionConfig
from gpud.errors import FailedPrecondition, GpudError, NotFound
from gpud.events import EventLog
from gpud.jobs.ends import EndCause, RunEnd
from gpud.jobs.registry import JobSpec
from gpud.jobs.service import JobService, RunRequest
from gpud.mps.api import MpsServicer
from gpud.mps.manager import MpsManager
from gpud.store import StateStore
from gpud.telemetry.reader import placeholder_identity
from gpud.telemetry.snapshot import GpuSample, Snapshot
from gpud.v1 import mps_pb2
from tests.unit.mps_support import FAKE_CONTROL, gpu_sample, gpu_uuid, mig_uuid, snapshot
from tests.unit.test_admission_service import Clock

GIB = 1 << 30
GPUS = 3
MIG_GPU = 2  # in MIG mode: two 3g.40gb devices
MIGS = (("3g.40gb", 40), ("3g.40gb", 40))
NAMES = ("a", "b", "c", "d")
MEMORY_GIB = 80
CAPACITY = {
    gpu_uuid(0): MEMORY_GIB * GIB,
    gpu_uuid(1): MEMORY_GIB * GIB,
    mig_uuid(MIG_GPU, 0): 40 * GIB,
    mig_uuid(MIG_GPU, 1): 40 * GIB,
}
# where a run goes: (whole GPUs, pinned devices, MIG profile)
Where = tuple[int | None, tuple[str, ...], str | None]

names = st.sampled_from(NAMES)
memory = st.sampled_from([None, 10 * GIB, 40 * GIB, 60 * GIB, 80 * GIB, 100 * GIB])
threads = st.sampled_from([None, 30, 60, 100])
placement: st.SearchStrategy[Where] = st.one_of(
    st.tuples(st.sampled_from([None, 1, 2, 3]), st.just(()), st.none()),
    st.tuples(st.none(), st.sampled_from([(u,) for u in CAPACITY]), st.none()),
    st.tuples(st.none(), st.just(()), st.sampled_from(["3g.40gb", "1g.10gb"])),
)


def run_request(
    name: str,
    where: Where | None,
    memory_bytes: int | None,
    threads_percent: int | None,
    held: bool,
) -> RunRequest:
    """``held``: this process holds it (else it is held until released)."""
    return RunRequest(
        job=name,
        gpu_count=where[0] if where else None,
        devices=where[1] if where else (),
        mig_profile=where[2] if where else None,
        memory_bytes=memory_bytes,
        threads_percent=threads_percent,
        holder_pid=os.getpid() if held else None,
    )


requests = st.builds(
    run_request,
    name=names,
    where=st.none() | placement,
    memory_bytes=memory,
    threads_percent=threads,
    held=st.booleans(),
)


@dataclass
class Services:
    store: StateStore
    mps: MpsManager
    jobs: JobService
    admission: AdmissionService


class Bookkeeping(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="gbk"))
        self.proc = self.root / "proc"
        self.holder_start = 1
        self._write_holder()
        self.clock = Clock()
        self.sick: dict[int, str] = {}  # GPU index -> why it is unhealthy
        self.unread: set[int] = set()  # sick since gpud started: identity never read
        self.queue_on = True
        self.seen: list[str] = []  # every reservation id made, in order
        self.s = self._build()
        self._serve()

    def teardown(self) -> None:
        if hasattr(self, "s"):
            self.s.store.close()
        if hasattr(self, "root"):
            shutil.rmtree(self.root, ignore_errors=True)

    # -- the node ----------------------------------------------------------------------------
    def _write_holder(self) -> None:
        pid = os.getpid()
        (self.proc / str(pid)).mkdir(parents=True, exist_ok=True)
        fields = ["S", *["0"] * 18, str(self.holder_start)]
        (self.proc / str(pid) / "stat").write_text(f"{pid} (python) {' '.join(fields)}\n")

    def _snapshot(self) -> Snapshot:
        gpus = []
        for i in range(GPUS):
            g = gpu_sample(i, memory_gib=MEMORY_GIB, migs=MIGS if i == MIG_GPU else ())
            if i in self.unread:
                g = GpuSample(placeholder_identity(i), False, self.sick[i], None)
            elif i in self.sick:
                g = g._replace(healthy=False, reason=self.sick[i])
            gpus.append(g)
        return snapshot(*gpus)

    def _build(self) -> Services:
        """The services as gpud builds them at start, and its first MPS pass."""
        store = StateStore(self.root / "state")
        events = EventLog(None)
        mps = MpsManager(store, events, self.root / "run", FAKE_CONTROL, enabled=False)
        mps.reconcile(self._snapshot())
        jobs = JobService(
            store,
            events,
            mps,
            socket_path=self.root / "gpud.sock",
            proc_root=self.proc,
            clock=self.clock,
        )
        admission = AdmissionService(
            store,
            jobs,
            mps,
            events,
            AdmissionConfig(enabled=self.queue_on),
            proc_root=self.proc,
            clock=self.clock,
        )
        return Services(store, mps, jobs, admission)

    def _serve(self) -> None:
        """What gpud does before its API serves: a sample, and the jobs tick on it (the
        unhealthy GPUs known before the first request)."""
        self.s.jobs.tick(self._snapshot())

    def _state(self) -> tuple[object, ...]:
        s = self.s
        return (
            s.jobs.registry.all(),
            sorted(s.jobs.reservations.held(), key=lambda r: r.id),
            s.admission.entries(state=None),
            len(s.admission.history()),
        )

    # -- rules -------------------------------------------------------------------------------
    @rule(name=names, where=placement, memory_bytes=memory, threads_percent=threads)
    def add_job(
        self,
        name: str,
        where: Where,
        memory_bytes: int | None,
        threads_percent: int | None,
    ) -> None:
        spec = JobSpec(
            name,
            gpu_count=where[0],
            devices=where[1],
            mig_profile=where[2],
            memory_bytes=memory_bytes,
            threads_percent=threads_percent,
        )
        with contextlib.suppress(GpudError):
            self.s.jobs.add(spec)

    @rule(name=names, force=st.booleans())
    def remove_job(self, name: str, force: bool) -> None:
        try:
            self.s.jobs.remove(name, force=force)
        except GpudError:
            return
        assert self.s.jobs.registry.find(name) is None
        assert self.s.jobs.reservations.held(name) == []
        assert [e for e in self.s.admission.entries() if e.job == name] == []

    @rule(request=requests)
    def reserve(self, request: RunRequest) -> None:
        try:
            launch = self.s.jobs.reserve(request)
        except GpudError:
            return
        assert launch.reservation in self.s.jobs.reservations.held(request.job)
        self.seen.append(launch.reservation.id)

    @rule(
        pick=st.integers(0, 7),
        code=st.none() | st.integers(0, 2),
        since=st.sampled_from([0.0, 5.0, 1e6]),
    )
    def release(self, pick: int, code: int | None, since: float) -> None:
        held = self.s.jobs.reservations.held()
        if not held:
            return
        r = held[pick % len(held)]
        end = RunEnd(EndCause.EXITED, exit_code=code, since_end_s=since)
        self.s.jobs.release(r.id, end)
        assert r not in self.s.jobs.reservations.held()

    @rule(request=requests, keep=st.booleans())
    def enqueue(self, request: RunRequest, keep: bool) -> None:
        try:
            view = self.s.admission.enqueue(request, keep_unfeasible=keep)
        except GpudError:
            return
        assert view.entry.state in (QUEUED, STARTED, LEFT)

    @precondition(lambda self: bool(self.seen))
    @rule(
        pick=st.integers(0, 7),
        code=st.none() | st.integers(0, 2),
        since=st.sampled_from([0.0, 5.0, 1e6]),
    )
    def release_again(self, pick: int, code: int | None, since: float) -> None:
        """A run's end reported for a reservation that may be gone (released already, or by
        ``gpuctl jobs rm --force`` while its run ran)."""
        rid = self.seen[pick % len(self.seen)]
        with contextlib.suppress(NotFound):
            self.s.jobs.release(rid, RunEnd(EndCause.EXITED, exit_code=code, since_end_s=since))
        assert rid not in {r.id for r in self.s.jobs.reservations.held()}

    @rule(pick=st.integers(0, 7))
    def leave(self, pick: int) -> None:
        entries = self.s.admission.entries(state=None)
        if not entries:
            return
        e = entries[pick % len(entries)]
        before = e.state
        if before != QUEUED:  # an operator's leave of an entry no longer queued is refused
            with pytest.raises(FailedPrecondition, match="did not leave the queue"):
                self.s.admission.leave(e.id)
            assert self.s.admission.entry(e.id).state == before
            return
        assert self.s.admission.leave(e.id).entry.state == LEFT

    @rule(
        device=st.sampled_from(sorted(CAPACITY)),
        limit=st.sampled_from([None, 30 * GIB, 60 * GIB]),
    )
    def set_default_memory(self, device: str, limit: int | None) -> None:
        """``gpuctl mps set --gpu DEVICE --memory LIMIT`` (None: ``--clear-memory``): the
        MPS default pinned memory limit a run that sets none gets on that device."""
        api = MpsServicer(self.s.mps, loads=self.s.jobs.loads)
        request = mps_pb2.SetMpsLimitsRequest(device=device)
        if limit is None:
            request.clear_memory = True
        else:
            request.memory_limit_bytes = limit
        with contextlib.suppress(GpudError):
            api._set(request)

    @rule(seconds=st.sampled_from([0.0, 1.0, 30.0, 4000.0]))
    def tick(self, seconds: float) -> None:
        """One pass of gpud's loop over the node as it is now."""
        self.clock.now += seconds
        snap = self._snapshot()
        self.s.mps.reconcile(snap)
        self.s.jobs.tick(snap)
        self.s.admission.tick()
        self.seen += [e.reservation for e in self.s.admission.entries(STARTED) if e.reservation]
        registered = {j.name for j in self.s.jobs.registry.all()}
        for r in self.s.jobs.reservations.held():
            assert r.job in registered, f"reservation {r} of a removed job"

    @rule()
    def drain(self) -> None:
        """Every run ends and every GPU answers: the first queued job that fits the empty
        node starts at the next tick (none is stuck)."""
        for r in self.s.jobs.reservations.held():
            self.s.jobs.release(r.id)
        self.sick.clear()
        self.unread.clear()
        self.tick(1.0)
        waiting = [v for v in self.s.admission.queue_views() if v.unfeasible is None]
        assert not waiting or self.s.jobs.reservations.held(), waiting[0]

    @rule()
    def holders_die(self) -> None:
        """Every holder's PID is now another process's (its start time changed)."""
        self.holder_start += 1
        self._write_holder()

    @rule(gpu=st.integers(0, GPUS - 1), why=st.sampled_from(["GPU is lost", "not answering"]))
    def fault(self, gpu: int, why: str) -> None:
        self.sick[gpu] = why

    @precondition(lambda self: bool(self.sick))
    @rule(gpu=st.integers(0, GPUS - 1))
    def recover(self, gpu: int) -> None:
        self.sick.pop(gpu, None)
        self.unread.discard(gpu)

    @rule(forget=st.booleans(), queue_on=st.booleans())
    def restart(self, forget: bool, queue_on: bool) -> None:
        """gpud starts again on the same state directory; ``forget``: the sick GPUs'
        identities are not read at this start (lost before it, nothing seen of them);
        ``queue_on``: ``admission.enabled`` in its config."""
        before = self._state()
        self.s.store.close()
        if forget:
            self.unread |= self.sick.keys()
        self.queue_on = queue_on
        self.s = self._build()
        if not queue_on:  # the queue off: what was queued has left it, nothing started
            jobs, held, entries, history = before
            entries = [
                e
                if e.state != QUEUED
                else replace(e, state=LEFT, changed_at=self.clock(), left_why=OFF)
                for e in entries  # type: ignore[attr-defined]
            ]
            before = (jobs, held, entries, history)
        assert self._state() == before
        self._serve()

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def never_over_committed(self) -> None:
        """A run without a memory limit counts the MPS default limit in force on its device
        when it started, as its client gets it there (a default set later reaches only the
        servers started after it: ``Reservation.defaults``)."""
        held = self.s.jobs.reservations.held()
        memory_by: dict[str, int] = {}
        threads_by: dict[str, int] = {}
        for r in held:
            for uuid in r.devices:
                pinned = r.memory_on(uuid, lambda u: self.s.mps.limits(u).memory_bytes)
                memory_by[uuid] = memory_by.get(uuid, 0) + (pinned or 0)
                threads_by[uuid] = threads_by.get(uuid, 0) + (r.threads_percent or 0)
        for uuid, n in memory_by.items():
            assert n <= CAPACITY[uuid], f"{uuid}: {n / GIB:g} GiB reserved"
        for uuid, n in threads_by.items():
            assert n <= 100, f"{uuid}: {n}% of its threads reserved"

    @invariant()
    def reservations_and_entries_agree(self) -> None:
        held = {r.id: r for r in self.s.jobs.reservations.held()}
        registered = {j.name for j in self.s.jobs.registry.all()}
        for r in held.values():
            assert r.job in registered, f"reservation {r.id} of unregistered job {r.job}"
        rows = {h.reservation for h in self.s.admission.history()}
        entries = self.s.admission.entries(state=None)
        assert len({e.id for e in entries}) == len(entries)
        claimed: dict[str, str] = {}
        for e in entries:
            assert e.state in (QUEUED, STARTED, LEFT), e
            if e.state == QUEUED:
                assert e.reservation is None, e
                assert e.job in registered, f"queued entry {e.id} of unregistered job {e.job}"
            if e.state == STARTED:
                assert e.reservation is not None, e
                assert e.reservation not in claimed, (e, claimed)
                claimed[e.reservation] = e.id
                assert e.reservation in rows, f"started entry {e.id} has no history row"
                if e.reservation in held:
                    assert held[e.reservation].job == e.job

    @invariant()
    def history_follows_reservations(self) -> None:
        held = {r.id for r in self.s.jobs.reservations.held()}
        rows = {h.reservation: h for h in self.s.admission.history()}
        for rid in held:
            assert rid in rows, f"reservation {rid} has no history row"
            assert rows[rid].ended_at is None, rows[rid]
        for h in rows.values():
            assert h.started_at >= h.queued_at, h
            if h.reservation not in held:
                assert h.ended_at is not None, f"released run {h} never ended"
            if h.ended_at is not None:
                assert h.ended_at >= h.started_at, h


Bookkeeping.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBookkeeping = Bookkeeping.TestCase
