"""MIG apply, safety, crash safety and reconcile on the simulated node through the real
NVML adapter."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gpud.backend import products
from gpud.backend.nvml import NvmlBackend
from gpud.backend.port import GpuIdentity
from gpud.backend.sim import SimNode, SimulatedCrash, fakenvml
from gpud.cli.output import message_to_dict
from gpud.errors import (
    BackendError,
    Busy,
    FailedPrecondition,
    GpuLost,
    InUse,
    InvalidArgument,
    NotFound,
    StateInUse,
)
from gpud.events import EventLog
from gpud.mig.api import apply_message, gpu_message
from gpud.mig.layout import DeviceLayout, MigConfigFile, load_config, parse_config
from gpud.mig.manager import INCOMPLETE_TABLE_S, NOT_ANSWERING, MigManager, Release
from gpud.mig.metrics import MigMetrics
from gpud.mig.results import ApplyResult
from gpud.mig.store import ApplyOptions, MigStore
from gpud.store import StateStore
from gpud.telemetry.snapshot import SeenIdentity
from tests.unit.nvml_doubles import Refusing, Sleeps
from tests.unit.store_support import held_write_lock

DATA = Path(__file__).parent.parent / "data" / "mig-parted"
H100 = "H100-SXM5-80GB"
A100 = "A100-SXM4-40GB"
GIB = 1 << 30


class ReadClock:
    """A manager's clock, which only the manager moves (its sleep, its bounded reads' wait:
    :data:`~gpud.mig.manager.ReadAwait`), and the driver calls that hang on it. A call that
    hangs (:meth:`hang`; the simulated node's slow calls, :meth:`driver_sleep`) holds its
    GPU's read till the clock reaches its end, or till :meth:`let_go`. A read's wait moves
    the clock on only once every GPU it waits for hangs, to the end of its wait or of the
    first hung call, whichever comes first; until then it waits for an answer or a hang: a
    read is given up on, or answered late, as on a real node, at no real time."""

    # only so that a test whose read neither answers nor hangs fails, instead of hanging
    GUARD_S = 30.0

    def __init__(self) -> None:
        self.now = 0.0
        self._cond = threading.Condition()
        self._hung: dict[threading.Thread, tuple[int, float]] = {}  # -> its GPU, its end
        self._waiting: threading.Condition | None = None  # the read's, while it waits
        self._let_go = False  # every call answers at once
        self.entered = 0  # calls that hung
        self.returned = 0  # of them, those that returned

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._cond:
            self.now += seconds
            self._cond.notify_all()

    def read_wait(self, done: threading.Condition, timeout_s: float, gpus: frozenset[int]) -> None:
        with self._cond:
            ends = {g: end for g, end in self._hung.values() if end > self.now}
            if gpus <= ends.keys():
                self.now = min([self.now + timeout_s, *(ends[g] for g in gpus)])
                self._cond.notify_all()
                return
            self._waiting = done
        answered = done.wait(self.GUARD_S)
        with self._cond:
            self._waiting = None
        # returning would have the read wait again on a clock nothing moves: for ever
        assert answered, (
            f"the read of GPUs {sorted(gpus)} neither answered nor hung in {self.GUARD_S} s"
        )

    def hang(self, gpu: int, seconds: float = float("inf")) -> None:
        """A driver call on ``gpu`` that answers ``seconds`` on (on this clock), or once let
        go of."""
        me = threading.current_thread()
        with self._cond:
            if self._let_go:
                return
            end = self.now + seconds
            self._hung[me] = (gpu, end)
            self.entered += 1
            waiting = self._waiting
        if waiting is not None:  # the read waits for an answer: it is told of the hang
            with waiting:
                waiting.notify_all()
        with self._cond:
            self._cond.wait_for(lambda: me not in self._hung or self.now >= end, self.GUARD_S)
            self._hung.pop(me, None)
            self.returned += 1

    def driver_sleep(self, seconds: float) -> None:
        """The simulated node's slow call: on a bounded read's thread (named for its GPU),
        it hangs; elsewhere it takes its time on the clock."""
        name = threading.current_thread().name
        if name.startswith("gpud-mig-"):
            self.hang(int(name.rsplit("-", 1)[1]), seconds)
        else:
            self.advance(seconds)

    def let_go(self) -> None:
        """Every hung call returns, and any later one answers at once: the reads left behind
        on them end."""
        with self._cond:
            self._let_go = True
            threads = list(self._hung)
            self._hung.clear()
            self._cond.notify_all()
        for thread in threads:
            thread.join(self.GUARD_S)
            assert not thread.is_alive()


@dataclass
class Daemon:
    """One daemon life: a node view on the shared device state file, and a manager."""

    node: SimNode
    backend: NvmlBackend
    store: StateStore
    events: EventLog
    mig: MigManager
    sleeps: list[float]
    sleep: Callable[[float], None]  # the manager's: advances its monotonic clock
    clock: ReadClock


class Host:
    """The machine: device state and gpud's state directory outlive each daemon."""

    def __init__(self, tmp: Path, spec: list[tuple[str, int]]) -> None:
        self.tmp = tmp
        self.spec = spec
        # the processes the nodes see: none, so that a declared PID runs until stopped
        # whatever runs on the machine, and a daemon started again still has it
        self.proc = tmp / "proc"
        self.jobs: dict[int, str] = {}
        self.reserved: dict[str, list[str]] = {}  # device UUID -> jobs with a reservation
        self.faults: dict[int, str] = {}  # what telemetry found unhealthy
        self.read_timeout_s = 5.0  # how long an apply waits for a GPU's reads
        self.daemons: list[Daemon] = []
        self.release: Release | None = None  # the MPS daemons' stop before a destroy
        self.release_active: Callable[[], bool] | None = None  # MPS on
        self.wrap: Callable[[NvmlBackend], Any] = lambda b: b  # the manager's backend
        self.open_store: Callable[[Path], StateStore] = StateStore  # on gpud's state dir
        self.on_change: Callable[[int], None] | None = None  # a GPU's devices changed
        self.placement = Placement(self.reserved)  # where runs reserve devices
        self.after_change: Callable[[], None] | None = None  # the GPUs read again
        # how a slow driver call hangs (None: on the daemon life's clock)
        self.driver_sleep: Callable[[float], None] | None = None
        self.clock = ReadClock()  # the latest daemon life's
        # how an earlier daemon life last saw each GPU never read in this one
        self.last_seen: dict[int, SeenIdentity] = {}
        # each GPU's identity as telemetry last read it in the latest daemon life
        self.read_identities: dict[int, GpuIdentity] = {}

    def start(self, *, resets: bool = False) -> Daemon:
        """A daemon life; with ``resets`` its backend can reset GPUs (nvidia-smi)."""
        clock = self.clock = ReadClock()
        node = SimNode(
            self.spec,
            state_file=self.tmp / "driver.json",
            proc_root=self.proc,
            sleep=self.driver_sleep or clock.driver_sleep,
        )
        backend = NvmlBackend(node.nvml, reset=node.reset if resets else None)
        store = self.open_store(self.tmp / "state")
        events = EventLog(None)
        sleeps: list[float] = []

        def sleep(s: float) -> None:
            sleeps.append(s)
            clock.advance(s)

        mig = MigManager(
            self.wrap(backend),
            store,
            events,
            job_resolver=self.jobs.get,
            monotonic=clock.monotonic,
            sleep=sleep,
            read_wait=clock.read_wait,
            faults=lambda: self.faults,
            read_timeout_s=self.read_timeout_s,
            release=self.release,
            release_active=self.release_active,
            on_change=self.on_change,
            reserved=lambda: {u: list(jobs) for u, jobs in self.reserved.items()},
            hold_placement=self.placement.hold,
            after_change=self.after_change,
            last_seen=lambda: self.last_seen,
            read_identities=lambda: self.read_identities,
        )
        d = Daemon(node, backend, store, events, mig, sleeps, sleep, clock)
        self.daemons.append(d)
        return d

    def close(self) -> None:
        for d in self.daemons:
            d.clock.let_go()
            d.store.close()


class Placement:
    """Where runs reserve devices, as the jobs service does: under its lock, and on no GPU
    an apply holds off (index -> why)."""

    def __init__(self, reserved: dict[str, list[str]]) -> None:
        self.reserved = reserved
        self.lock = threading.Lock()
        self.off: dict[int, str] = {}

    @contextlib.contextmanager
    def hold(self, gpus: Mapping[int, str]) -> Iterator[None]:
        with self.lock:
            self.off.update(gpus)
        try:
            yield
        finally:
            for i in gpus:
                self.off.pop(i, None)

    def reserve(self, job: str, gpu: int, uuid: str) -> str | None:
        """None once ``job`` holds ``uuid``; else why it was refused."""
        with self.lock:
            if gpu in self.off:
                return self.off[gpu]
            self.reserved.setdefault(uuid, []).append(job)
            return None


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    h = Host(tmp_path, [(H100, 2)])
    yield h
    h.close()


@pytest.fixture
def a100(tmp_path: Path) -> Iterator[Host]:
    h = Host(tmp_path, [(A100, 2)])
    yield h
    h.close()


@pytest.fixture
def config() -> MigConfigFile:
    return load_config(DATA / "config.yaml")


def instances(d: Daemon) -> list[list[tuple[int, int, int, int]]]:
    """Per GPU: (GI profile id, placement start, CI count, CI profile id) sorted."""
    out = []
    for gpu in range(d.backend.gpu_count()):
        if not d.backend.mig_mode(gpu).current:
            out.append([])
            continue
        out.append(
            sorted(
                (
                    gi.profile_id,
                    gi.placement.start,
                    len(gi.compute_instances),
                    *(c.profile_id for c in gi.compute_instances[:1]),
                )
                for gi in d.backend.gpu_instances(gpu)
            )
        )
    return out


def enable(host: Host, config: MigConfigFile, name: str) -> Daemon:
    """Apply ``name`` from MIG off. Hopper switches MIG mode at once and the instances are
    created in the apply; on an A100 the change is pending until the reboot, and reconcile
    creates the instances after it."""
    d = host.start()
    result = d.mig.apply(config, name)
    needs_reset = any(products.PRODUCTS[p].mig_mode_needs_reset for p, _ in host.spec)
    assert result.result == ("reset_pending" if needs_reset else "success"), result
    if needs_reset:
        d.node.reboot()
        outcomes = d.mig.reconcile()
        assert {o.status for o in outcomes} <= {"changed", "ok"}
    assert d.mig.assert_config(config, name) == []
    return d


def test_a_read_that_neither_answers_nor_hangs_fails_the_test_rather_than_waiting_for_ever() -> (
    None
):
    """The test clock moves only for hung calls: a read whose wait nothing ends (no answer,
    no hang) raises, where returning would have the read wait again on an unmoved clock."""
    clock = ReadClock()
    clock.GUARD_S = 0.01
    done = threading.Condition()
    with done, pytest.raises(AssertionError, match=r"GPUs \[0\] neither answered nor hung"):
        clock.read_wait(done, 5.0, frozenset({0}))
    assert clock.now == 0.0


def test_mode_change_is_reported_pending_then_reconciled_after_reboot(
    a100: Host, config: MigConfigFile
) -> None:
    d = a100.start()
    result = d.mig.apply(config, "all-balanced")
    assert result.result == "reset_pending"
    assert all(o.reset_pending and o.status == "reset_pending" for o in result.gpus)
    assert "pending a GPU reset" in result.gpus[0].detail
    assert d.backend.mig_mode(0).pending and not d.backend.mig_mode(0).current
    diff = d.mig.assert_config(config, "all-balanced")
    assert len(diff) == 2 and "MIG mode enabled pending a GPU reset" in diff[0]
    # reconciling while the reset is pending changes nothing and says so
    assert {o.status for o in d.mig.reconcile()} == {"reset_pending"}
    d.node.reboot()
    assert {o.status for o in d.mig.reconcile()} == {"changed"}
    assert d.mig.assert_config(config, "all-balanced") == []
    assert d.mig.apply(config, "all-balanced").result == "noop", "applying twice is a no-op"
    assert any(e.kind == "mig.apply" for e in d.events.recent())


def test_published_configs_apply_assert_and_export_round_trip(
    tmp_path: Path, config: MigConfigFile
) -> None:
    host = Host(tmp_path, [(H100, 1), (A100, 1)])
    try:
        d = enable(host, config, "all-enabled")
        for name in ("all-1g.10gb", "all-balanced", "all-disabled"):
            if name == "all-disabled":
                result = d.mig.apply(config, name)
                assert result.result == "reset_pending"
                d.node.reboot()
            else:
                result = d.mig.apply(config, name)
                assert result.result == "success", (name, result)
            assert d.mig.assert_config(config, name) == []
            exported = parse_config(d.mig.export("now")[0])
            assert d.mig.assert_config(exported, "now") == []
            assert d.mig.apply(exported, "now").result == "noop"
        balanced_a100 = [
            e for e in config.config("all-balanced") if e.device_filter == (0x20B010DE,)
        ]
        assert balanced_a100
    finally:
        host.close()


def test_mixed_config_with_compute_instance_profiles(tmp_path: Path) -> None:
    host = Host(tmp_path, [(H100, 2), (A100, 1)])
    try:
        mixed = load_config(DATA / "mixed.yaml")
        d = host.start()
        d.mig.apply(mixed, "mixed-train-infer")
        d.node.reboot()
        d.mig.reconcile()
        assert d.mig.assert_config(mixed, "mixed-train-infer") == []
        layouts, _ = d.mig.layouts()
        assert layouts[0].describe() == "1x 4g.40gb, 1x 3g.40gb"
        assert layouts[1].describe() == "1x 3g.40gb, 4x 1g.10gb"
        assert layouts[2].describe() == "1x 3g.20gb, 1x 2g.10gb, 2x 1g.5gb"
        # only the H100s match this one; the A100 is left alone
        result = d.mig.apply(mixed, "h100-shared-3g")
        assert [o.gpu for o in result.gpus] == [0, 1]
        assert d.mig.layouts()[0][0].describe() == "1x 1c.3g.40gb, 2x 2g.20gb"
        assert d.mig.layouts()[0][2].describe() == "1x 3g.20gb, 1x 2g.10gb, 2x 1g.5gb"
        exported = parse_config(d.mig.export("now")[0])
        assert d.mig.assert_config(exported, "now") == []
    finally:
        host.close()


@pytest.mark.parametrize(
    "name", ["too-many-slices", "too-many-instances", "placements-collide", "unknown-profile"]
)
def test_impossible_layouts_change_nothing(host: Host, config: MigConfigFile, name: str) -> None:
    d = enable(host, config, "all-1g.10gb")
    before = instances(d)
    d.node.faults.crash_after_mutations(1)  # any driver mutation would crash the test
    impossible = load_config(DATA / "impossible.yaml")
    with pytest.raises(InvalidArgument) as err:
        d.mig.apply(impossible, name)
    assert "GPU 0 (H100-SXM5-80GB)" in str(err.value)
    # a file holds many configs: the message says which one, and which file
    assert str(err.value).startswith(f"mig-configs.{name} in {DATA / 'impossible.yaml'}: ")
    with pytest.raises(InvalidArgument) as err:
        d.mig.assert_config(impossible, name)
    assert str(err.value).startswith(f"mig-configs.{name} in {DATA / 'impossible.yaml'}: ")
    d.node.faults.clear()
    assert instances(d) == before
    assert d.mig.stats.snapshot()[0]["invalid"] == 1


def test_a_gpu_in_two_entries_with_different_layouts_names_the_config(host: Host) -> None:
    text = """\
version: v1
mig-configs:
  twice:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
    - devices: all
      mig-enabled: false
"""
    d = host.start()
    with pytest.raises(InvalidArgument) as err:
        d.mig.apply(parse_config(text, path="/etc/layouts.yaml"), "twice")
    assert str(err.value) == (
        "devices: GPU 0 (H100-SXM5-80GB) matches 2 entries of mig-configs.twice in"
        " /etc/layouts.yaml with different layouts"
    )


def test_unknown_config_name(host: Host, config: MigConfigFile) -> None:
    d = host.start()
    with pytest.raises(InvalidArgument, match="no config named"):
        d.mig.apply(config, "all-9g")


def test_unknown_gpu_index_is_an_invalid_request(host: Host, config: MigConfigFile) -> None:
    """A config naming GPU 4 on a two-GPU node: NotFound naming the index and the file,
    nothing changed, counted as ``invalid`` (a typo must not raise a failed-apply alert)."""
    d = host.start()
    d.node.faults.crash_after_mutations(1)  # any driver mutation would crash the test
    with pytest.raises(NotFound) as err:
        d.mig.apply(config, "custom-config")
    assert "no GPU with indexes 2, 3, 4, 5, 6, 7 on this node (2 GPUs, indexes 0, 1)" in str(
        err.value
    )
    assert f"mig-configs.custom-config in {DATA / 'config.yaml'}" in str(err.value)
    with pytest.raises(NotFound, match="no GPU with indexes 2, 3"):
        d.mig.assert_config(config, "custom-config")
    d.node.faults.clear()
    totals = d.mig.stats.snapshot()[0]
    assert totals["invalid"] == 1 and totals["failed"] == 0
    assert [e.fields["result"] for e in d.events.recent() if e.kind == "mig.apply"] == ["invalid"]


def _slice0(d: Daemon) -> Any:
    """GPU 0's MIG device at slice 0: it goes in the move to all-3g.40gb."""
    devices = d.backend.mig_devices(0)
    return next(m for m in devices if m.gpu_instance_id == min(x.gpu_instance_id for x in devices))


def _busy_setup(host: Host, config: MigConfigFile) -> tuple[Daemon, int]:
    d = enable(host, config, "all-1g.10gb")
    victim = _slice0(d)
    d.node.workloads.start(0, 4242, 2 * GIB, 0.5, mig=victim.mig)
    host.jobs[4242] = "train-a"
    return d, 4242


def test_busy_instances_are_not_destroyed(host: Host, config: MigConfigFile) -> None:
    d, pid = _busy_setup(host, config)
    before = instances(d)
    with pytest.raises(Busy) as err:
        d.mig.apply(config, "all-3g.40gb")
    assert err.value.pids == (pid,) and err.value.jobs == ("train-a",)
    assert "pid 4242 (job train-a)" in str(err.value) and "GPU 0 (H100-SXM5-80GB)" in str(err.value)
    assert instances(d) == before
    assert d.mig.stats.snapshot()[0]["busy"] == 1
    # show names the process and its job on the instance
    view = d.mig.show()[0]
    busy = [i for i in view.instances if i.processes]
    assert [(p.pid, p.job) for p in busy[0].processes] == [(pid, "train-a")]
    assert busy[0].uuid is not None and busy[0].uuid.startswith("MIG-")


def test_drain_waits_for_processes_to_leave(host: Host, config: MigConfigFile) -> None:
    d, pid = _busy_setup(host, config)
    original = d.mig._sleep

    def leave_after_two(s: float) -> None:
        original(s)
        if len(d.sleeps) == 2:
            d.node.workloads.stop(pid)

    d.mig._sleep = leave_after_two
    result = d.mig.apply(config, "all-3g.40gb", options=ApplyOptions(drain=True, timeout_s=30))
    assert result.result == "success"
    assert len(d.sleeps) == 2
    assert d.mig.assert_config(config, "all-3g.40gb") == []


def test_a_drain_cut_off_is_logged_as_stopped_while_draining(
    host: Host, config: MigConfigFile
) -> None:
    """gpuctl interrupted (or gpud stopping) while the apply waits for processes to leave:
    nothing is changed, and the event says so, not that it never got as far as draining."""
    d, _pid = _busy_setup(host, config)
    before = instances(d)
    result = d.mig.apply(
        config,
        "all-3g.40gb",
        options=ApplyOptions(drain=True, timeout_s=30),
        still_wanted=lambda: len(d.sleeps) < 2,
    )
    assert result.result == "not_started" and len(d.sleeps) == 2
    assert instances(d) == before
    event = d.events.recent(kind_prefix="mig.apply")[-1]
    assert event.fields["result"] == "not_started" and event.fields["client_gone"] is True
    assert event.message == (
        "apply all-3g.40gb: not_started: stopped while draining, after 2s waiting for "
        "processes to leave, before any change (the client had gone)"
    )


def test_a_drain_ends_as_not_started_when_gpud_stops(host: Host, config: MigConfigFile) -> None:
    """gpud stopping while an apply waits for processes to leave: the apply ends at once,
    changing nothing, and its caller (still there) is answered ``not_started``."""
    d, _pid = _busy_setup(host, config)
    before = instances(d)
    result = d.mig.apply(
        config,
        "all-3g.40gb",
        options=ApplyOptions(drain=True, timeout_s=30),
        stopping=lambda: len(d.sleeps) >= 1,
    )
    assert result.result == "not_started" and len(d.sleeps) == 1
    assert instances(d) == before
    event = d.events.recent(kind_prefix="mig.apply")[-1]
    assert event.fields["client_gone"] is False
    assert event.message.endswith("before any change (gpud was stopping)")


def test_drain_times_out(host: Host, config: MigConfigFile) -> None:
    d, _pid = _busy_setup(host, config)
    before = instances(d)
    with pytest.raises(Busy, match="after draining for 5s") as busy:
        d.mig.apply(config, "all-3g.40gb", options=ApplyOptions(drain=True, timeout_s=5))
    # drained already: the way on is a longer drain or force, not "use drain"
    assert str(busy.value).endswith("(stop them, drain longer (--drain-timeout) or force)")
    assert sum(d.sleeps) == pytest.approx(5)
    assert instances(d) == before


def test_an_instance_a_job_reserved_is_not_destroyed_before_its_process_opens_it(
    host: Host, config: MigConfigFile
) -> None:
    """A run reserved a MIG device and has not opened it yet (its process loads data): the
    driver lists no process there, but destroying it would leave the run a device that is
    gone. The apply is refused naming the job, a drain waits for the reservation to go."""
    d = enable(host, config, "all-1g.10gb")
    victim = _slice0(d)
    host.reserved[victim.uuid] = ["train-b"]
    before = instances(d)
    with pytest.raises(Busy) as err:
        d.mig.apply(config, "all-3g.40gb")
    assert err.value.jobs == ("train-b",) and err.value.pids == ()
    assert f"GPU 0 (H100-SXM5-80GB) 1g.10gb GPU instance {victim.gpu_instance_id}" in str(err.value)
    assert f"({victim.uuid}): reserved by job train-b" in str(err.value)
    assert "jobs' reservations" in str(err.value)
    assert instances(d) == before
    dry = d.mig.apply(config, "all-3g.40gb", dry_run=True)
    assert dry.result == "busy" and "reserved by job train-b" in dry.gpus[0].detail
    drain = ApplyOptions(drain=True, timeout_s=30)
    dry = d.mig.apply(config, "all-3g.40gb", options=drain, dry_run=True)
    assert dry.gpus[0].detail.startswith(
        "would first wait up to 30 s for reservations to be released: GPU 0 (H100-SXM5-80GB)"
    )
    original = d.mig._sleep

    def released_after_one(s: float) -> None:
        original(s)
        host.reserved.clear()

    d.mig._sleep = released_after_one
    result = d.mig.apply(config, "all-3g.40gb", options=ApplyOptions(drain=True, timeout_s=30))
    assert result.result == "success" and len(d.sleeps) == 1
    assert d.mig.assert_config(config, "all-3g.40gb") == []


class _ReservesBeforeTheFirstDestroy:
    """A backend where, as the apply's first destroy step reaches the driver, a queued job
    is started on every MIG device of the GPU (an admission pass between the apply's busy
    check and its steps)."""

    def __init__(self, backend: NvmlBackend, placement: Placement) -> None:
        self._backend = backend
        self._placement = placement
        self.refused: list[str] = []
        self._done = False

    def _start_queued(self, gpu: int) -> None:
        if self._done:
            return
        self._done = True
        for m in self._backend.mig_devices(gpu):
            why = self._placement.reserve("train-c", gpu, m.uuid)
            if why is not None:
                self.refused.append(why)

    def destroy_compute_instance(self, gpu: int, gi: int, ci: int) -> Any:
        self._start_queued(gpu)
        return self._backend.destroy_compute_instance(gpu, gi, ci)

    def destroy_gpu_instance(self, gpu: int, gi: int) -> Any:
        self._start_queued(gpu)
        return self._backend.destroy_gpu_instance(gpu, gi)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def _reserving_before_the_first_destroy(host: Host) -> list[_ReservesBeforeTheFirstDestroy]:
    """The backends of the daemons ``host`` starts from now on, each starting a queued job
    as the first destroy step reaches the driver."""
    wrapped: list[_ReservesBeforeTheFirstDestroy] = []

    def wrap(backend: NvmlBackend) -> _ReservesBeforeTheFirstDestroy:
        wrapped.append(_ReservesBeforeTheFirstDestroy(backend, host.placement))
        return wrapped[-1]

    host.wrap = wrap
    return wrapped


def test_a_run_placed_while_an_apply_changes_the_gpu_is_not_given_an_instance_it_destroys(
    host: Host, config: MigConfigFile
) -> None:
    """A queued job is started while an apply of GPU 0 runs, after its busy check found
    nothing there: placement holds the GPU off until the apply ends, so the job is not
    given an instance the next step destroys; once the apply ends GPU 0 is placed on."""
    enable(host, config, "all-1g.10gb")
    wrapped = _reserving_before_the_first_destroy(host)
    d = host.start()
    result = d.mig.apply(config, "all-3g.40gb")
    assert result.result == "success"
    assert wrapped[0].refused == ["a MIG apply of all-3g.40gb is changing its instances"] * 7
    assert host.reserved == {} and host.placement.off == {}
    new = d.backend.mig_devices(0)[0]
    assert host.placement.reserve("train-c", 0, new.uuid) is None


def test_a_run_placed_while_reconcile_resumes_an_apply_is_not_given_an_instance_it_destroys(
    host: Host, config: MigConfigFile
) -> None:
    """A forced apply left GPU 0 unchanged (a process held it) and gpud restarted: the
    reconcile that resumes the apply holds GPU 0 off placement as the apply did, so a queued
    job started between its busy check and its steps is not given an instance the next step
    destroys; once the GPU converged it is placed on again."""
    d, pid = _busy_setup(host, config)
    assert d.mig.apply(config, "all-3g.40gb", options=ApplyOptions(force=True)).result == "failed"
    d.node.workloads.stop(pid)
    wrapped = _reserving_before_the_first_destroy(host)
    again = host.start()
    assert "changed" in {o.status for o in again.mig.reconcile()}
    assert len(wrapped[0].refused) == 7 and host.reserved == {}, (wrapped, host.reserved)
    assert all("changing its instances" in why for why in wrapped[0].refused)
    assert host.placement.off == {}
    new = again.backend.mig_devices(0)[0]
    assert host.placement.reserve("train-c", 0, new.uuid) is None


def test_a_gpu_reconcile_changed_is_read_again_before_placement_reopens_on_it(
    host: Host, config: MigConfigFile
) -> None:
    """The reconcile that resumes an apply changes GPU 0: the GPUs are read again while it
    is still held off placement, so a queued job is never placed on an instance the steps
    destroyed that the sampler has not yet seen gone."""
    d, pid = _busy_setup(host, config)
    assert d.mig.apply(config, "all-3g.40gb", options=ApplyOptions(force=True)).result == "failed"
    d.node.workloads.stop(pid)
    held_when_read: list[dict[int, str]] = []
    host.after_change = lambda: held_when_read.append(dict(host.placement.off))
    again = host.start()
    assert "changed" in {o.status for o in again.mig.reconcile()}
    assert held_when_read == [{0: "a MIG reconcile to all-3g.40gb is changing its instances"}]
    assert host.placement.off == {}


def test_each_gpu_an_apply_changed_is_read_again_before_placement_reopens_on_it(
    host: Host, config: MigConfigFile
) -> None:
    """An apply changes GPU 0, then GPU 1: after each GPU's steps the GPUs are read again
    while that GPU is still held off placement."""
    enable(host, config, "all-1g.10gb")
    held_when_read: list[set[int]] = []
    host.after_change = lambda: held_when_read.append(set(host.placement.off))
    d = host.start()
    assert d.mig.apply(config, "all-3g.40gb").result == "success"
    assert held_when_read == [{0, 1}, {1}]
    assert host.placement.off == {}


class _SeesPlacementAtGpu1:
    """A backend noting which GPUs placement holds off as the apply's first destroy step on
    GPU 1 reaches the driver (GPU 0 converged by then)."""

    def __init__(self, backend: NvmlBackend, placement: Placement) -> None:
        self._backend = backend
        self._placement = placement
        self.off: dict[int, str] | None = None

    def destroy_compute_instance(self, gpu: int, gi: int, ci: int) -> Any:
        if gpu == 1 and self.off is None:
            self.off = dict(self._placement.off)
        return self._backend.destroy_compute_instance(gpu, gi, ci)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def test_a_gpu_an_apply_converged_takes_jobs_while_it_changes_the_next(
    host: Host, config: MigConfigFile
) -> None:
    """An apply changes GPU 0, then GPU 1: once GPU 0 has its new instances it is placed on
    again, while GPU 1 is still held off (a slow or hung GPU keeps no other from jobs)."""
    enable(host, config, "all-1g.10gb")
    seen: list[_SeesPlacementAtGpu1] = []

    def wrap(backend: NvmlBackend) -> _SeesPlacementAtGpu1:
        seen.append(_SeesPlacementAtGpu1(backend, host.placement))
        return seen[-1]

    host.wrap = wrap
    d = host.start()
    assert d.mig.apply(config, "all-3g.40gb").result == "success"
    assert seen[0].off == {1: "a MIG apply of all-3g.40gb is changing its instances"}
    assert host.placement.off == {}


class _AppliesDuringTheFirstDestroy:
    """A backend where, as an apply's first destroy step reaches the driver, ``during()``
    runs (another ``gpuctl mig apply`` arriving meanwhile)."""

    def __init__(self, backend: NvmlBackend, during: Callable[[], None]) -> None:
        self._backend = backend
        self._during: Callable[[], None] | None = during

    def destroy_compute_instance(self, gpu: int, gi: int, ci: int) -> Any:
        during, self._during = self._during, None
        if during is not None:
            during()
        return self._backend.destroy_compute_instance(gpu, gi, ci)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def test_an_apply_made_while_another_runs_is_refused_naming_it(
    host: Host, config: MigConfigFile
) -> None:
    """An operator applies all-balanced while the apply of all-3g.40gb runs: it is refused
    at once, naming the apply in flight, rather than waiting for it unseen and then undoing
    it; a dry run is refused so too. The first apply ends as asked, and the refused one is
    logged as not started."""
    enable(host, config, "all-1g.10gb")
    daemons: list[Daemon] = []
    refused: list[Exception] = []

    def second() -> None:
        for dry_run in (False, True):
            try:
                daemons[0].mig.apply(config, "all-balanced", dry_run=dry_run)
            except FailedPrecondition as err:
                refused.append(err)

    host.wrap = lambda backend: _AppliesDuringTheFirstDestroy(backend, second)
    daemons.append(host.start())
    d = daemons[0]
    assert d.mig.apply(config, "all-3g.40gb").result == "success"
    assert [str(e) for e in refused] == [
        "an apply of all-3g.40gb is in flight (started 0 s ago): wait for it to end"
        " (gpuctl mig show) and apply again"
    ] * 2
    assert not any(isinstance(e, Busy) for e in refused)
    assert d.mig.assert_config(config, "all-3g.40gb") == []
    first, last = d.events.recent(kind_prefix="mig.apply")
    assert (first.fields["config"], first.fields["result"]) == ("all-balanced", "not_started")
    assert "an apply of all-3g.40gb is in flight" in first.message
    assert (last.fields["config"], last.fields["result"]) == ("all-3g.40gb", "success")
    assert d.mig.apply(config, "all-balanced").result == "success"


def test_a_whole_gpu_a_job_reserved_keeps_mig_off_until_the_reservation_goes(
    host: Host, config: MigConfigFile
) -> None:
    """train-w reserved GPU 0 whole (MIG off) and its process has not opened it yet: an
    apply turning MIG on there would take the GPU from under it. It is refused naming the
    job and the whole GPU; GPU 1, which no job holds, is not what it names."""
    d = host.start()
    gpu0 = d.backend.identity(0).uuid
    host.reserved[gpu0] = ["train-w"]
    with pytest.raises(Busy) as err:
        d.mig.apply(config, "all-1g.10gb")
    assert err.value.jobs == ("train-w",) and err.value.pids == ()
    assert (
        "GPU 0 (H100-SXM5-80GB) the whole GPU: reserved by job train-w (no process of it there yet)"
    ) in str(err.value)
    assert "GPU 1" not in str(err.value)
    assert not d.backend.mig_mode(0).current
    host.reserved.clear()
    assert d.mig.apply(config, "all-1g.10gb").result == "success"


def test_a_forced_apply_names_the_reservations_whose_devices_it_destroyed(
    host: Host, config: MigConfigFile
) -> None:
    """train-b reserved a MIG device its process has not opened yet; the operator forces
    an apply that destroys it. The reservation stays (its run releases it), and GPU 0's
    outcome and the mig.apply event say that its run finds no such device."""
    d = enable(host, config, "all-1g.10gb")
    victim = _slice0(d)
    host.reserved[victim.uuid] = ["train-b"]
    result = d.mig.apply(config, "all-3g.40gb", options=ApplyOptions(force=True))
    assert result.result == "success"
    gpu0, gpu1 = result.gpus
    note = (
        f"GPU 0 (H100-SXM5-80GB) 1g.10gb GPU instance {victim.gpu_instance_id}"
        f" ({victim.uuid}): reserved by job train-b (no process of it there yet): destroyed"
        " by the forced apply; its run finds no such device (release the reservation and"
        " run again)"
    )
    assert gpu0.detail == note and "train-b" not in gpu1.detail
    assert victim.uuid not in {m.uuid for m in d.backend.mig_devices(0)}
    assert host.reserved == {victim.uuid: ["train-b"]}
    (event,) = d.events.recent(1, kind_prefix="mig.apply")
    assert note in event.message


def test_a_reservation_on_a_faulty_gpu_holds_no_other_gpu_back(
    host: Host, config: MigConfigFile
) -> None:
    """train-f reserved a MIG device of GPU 1, which is then lost: an apply leaves GPU 1
    alone (its fault stays with it) and changes GPU 0, which no job holds."""
    d = enable(host, config, "all-1g.10gb")
    host.reserved[d.backend.mig_devices(1)[0].uuid] = ["train-f"]
    host.faults[1] = "GPU lost"
    result = d.mig.apply(config, "all-3g.40gb")
    assert result.result == "partial"
    assert [o.status for o in result.gpus] == ["changed", "faulty"]
    assert "train-f" not in result.gpus[0].detail


def test_a_job_whose_process_runs_on_the_instance_is_named_once(
    host: Host, config: MigConfigFile
) -> None:
    """train-a's process shows on one of the devices it reserved: the refusal names the
    process and its job, not the job's reservations again."""
    d, pid = _busy_setup(host, config)
    for m in d.backend.mig_devices(0):
        host.reserved[m.uuid] = ["train-a"]
    with pytest.raises(Busy) as err:
        d.mig.apply(config, "all-3g.40gb")
    assert err.value.jobs == ("train-a",) and err.value.pids == (pid,)
    assert "reserved by" not in str(err.value)


def test_force_skips_the_check_but_the_driver_still_refuses(
    host: Host, config: MigConfigFile
) -> None:
    d, pid = _busy_setup(host, config)
    result = d.mig.apply(config, "all-3g.40gb", options=ApplyOptions(force=True))
    # nvidia-smi mig -dci answers "In use by another client" while a CUDA context lives
    assert result.result == "failed" and "GPU 0" in result.gpus[0].detail
    assert d.mig.desired()  # the layout is kept; reconcile finishes once the process ends
    assert {o.status for o in d.mig.reconcile()} >= {"failed"}
    # retried, not taken for an apply a crash interrupted
    kinds = [e.kind for e in d.events.recent()]
    assert "mig.retry" in kinds and "mig.resume" not in kinds
    d.node.workloads.stop(pid)
    d.mig.reconcile()
    assert d.mig.assert_config(config, "all-3g.40gb") == []


def test_a_dry_run_makes_the_busy_checks_and_answers_as_the_apply_would(
    host: Host, config: MigConfigFile
) -> None:
    """The apply would be refused: so is the dry run's result, with the steps it planned;
    with force or drain it would go ahead. Nothing is changed, no apply is counted."""
    d, _pid = _busy_setup(host, config)
    before = instances(d)
    dry = d.mig.apply(config, "all-3g.40gb", dry_run=True)
    assert dry.result == "busy" and dry.dry_run, dry
    assert [o.status for o in dry.gpus] == ["busy", "differs"]
    assert "refusing to destroy" in dry.gpus[0].detail
    assert "pid 4242 (job train-a)" in dry.gpus[0].detail
    assert any("destroy GPU instance" in s for s in dry.gpus[0].steps)
    with pytest.raises(Busy) as refused:
        d.mig.apply(config, "all-3g.40gb")
    assert dry.gpus[0].detail == str(refused.value)  # one GPU busy: the same words
    forced = d.mig.apply(config, "all-3g.40gb", options=ApplyOptions(force=True), dry_run=True)
    assert forced.result == "success" and [o.status for o in forced.gpus] == ["differs"] * 2
    drained = d.mig.apply(
        config, "all-3g.40gb", options=ApplyOptions(drain=True, timeout_s=30), dry_run=True
    )
    assert drained.result == "success" and d.sleeps == []  # a dry run does not wait
    assert [o.status for o in drained.gpus] == ["differs"] * 2
    assert drained.gpus[0].detail.startswith("would first wait up to 30 s for processes")
    assert "pid 4242 (job train-a)" in drained.gpus[0].detail
    assert instances(d) == before
    assert d.mig.stats.snapshot()[0]["busy"] == 1  # the real refusal only


def test_restart_adopts_what_exists(host: Host, config: MigConfigFile) -> None:
    first = enable(host, config, "all-balanced")
    before = instances(first)
    second = host.start()
    second.node.faults.crash_after_mutations(1)  # adopting must not touch the driver
    outcomes = second.mig.reconcile()
    second.node.faults.clear()
    assert {o.status for o in outcomes} == {"ok"}
    assert instances(second) == before


def test_reboot_recreates_the_desired_layout(host: Host, config: MigConfigFile) -> None:
    first = enable(host, config, "all-balanced")
    before = instances(first)
    first.node.reboot()
    second = host.start()
    assert instances(second) == [[], []] or all(not x for x in instances(second))
    report = second.mig.reconcile("report")
    assert {o.status for o in report} == {"differs"}
    assert any(e.kind == "mig.drift" for e in second.events.recent())
    assert {o.status for o in second.mig.reconcile()} == {"changed"}
    assert instances(second) == before


def test_unhealthy_gpus_are_skipped_until_they_answer(host: Host, config: MigConfigFile) -> None:
    first = enable(host, config, "all-balanced")
    before = instances(first)
    first.node.reboot()
    second = host.start()
    second.node.faults.slow(1, 30.0)  # any driver call on GPU 1 would hang
    host.faults[1] = "not answering: a driver call is outstanding"
    outcomes = {o.gpu: o for o in second.mig.reconcile()}
    assert outcomes[0].status == "changed"
    assert outcomes[1].status == "faulty" and "not answering" in outcomes[1].detail
    assert outcomes[1].steps == ()
    second.node.faults.clear(1)
    host.faults.clear()
    assert {o.status for o in second.mig.reconcile()} == {"ok", "changed"}
    assert instances(second) == before


def test_a_faulty_gpu_has_no_mig_layout_or_reset_series(host: Host, config: MigConfigFile) -> None:
    """A GPU reconcile leaves alone as faulty has neither gpud_mig_layout_matches nor
    gpud_mig_reset_pending (its state is unknown: its health metric says why); once it
    answers again both come back."""
    d = enable(host, config, "all-balanced")
    d.node.faults.slow(1, 30.0)
    host.faults[1] = "not answering: a driver call is outstanding"
    d.mig.refresh_view()
    assert [o.status for o in d.mig.reconcile()] == ["ok", "faulty"]

    def series() -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for family in MigMetrics(d.mig)():
            if family.name in ("gpud_mig_layout_matches", "gpud_mig_reset_pending"):
                out[family.name] = {s.labels["gpu"]: s.value for s in family.samples}
        return out

    assert series() == {
        "gpud_mig_layout_matches": {"0": 1.0},
        "gpud_mig_reset_pending": {"0": 0.0},
    }
    d.node.faults.clear(1)
    host.faults.clear()
    d.mig.refresh_view()
    d.mig.reconcile()
    assert series() == {
        "gpud_mig_layout_matches": {"0": 1.0, "1": 1.0},
        "gpud_mig_reset_pending": {"0": 0.0, "1": 0.0},
    }


def test_a_gpu_found_faulty_drops_its_mig_series_at_the_next_reconcile(
    host: Host, config: MigConfigFile
) -> None:
    """The MIG view is read again at once when a GPU turns faulty or answers again, not
    only every VIEW_REFRESH_S: a lost or hung GPU's instances and reset state, read before,
    are not exported as its state now."""
    d = enable(host, config, "all-balanced")
    d.mig.reconcile()

    def gpus_of(name: str) -> set[str]:
        return {
            s.labels["gpu"]
            for family in MigMetrics(d.mig)()
            if family.name == name
            for s in family.samples
        }

    assert gpus_of("gpud_mig_instance_info") == {"0", "1"}
    d.node.faults.lose(1)
    host.faults[1] = "GPU lost (memory): GPU is lost"
    d.mig.reconcile()
    for name in (
        "gpud_mig_instance_info",
        "gpud_mig_instance_memory_used_bytes",
        "gpud_mig_instance_processes",
        "gpud_mig_reset_pending",
    ):
        assert gpus_of(name) == {"0"}, name
    d.node.faults.clear(1)
    host.faults.clear()
    d.mig.reconcile()
    assert gpus_of("gpud_mig_instance_info") == gpus_of("gpud_mig_reset_pending") == {"0", "1"}


W = TypeVar("W")


def _wrapping(host: Host, make: Callable[[NvmlBackend], W]) -> list[W]:
    """The backends of the daemons ``host`` starts from now on, each ``make`` of its own."""
    made: list[W] = []

    def wrap(backend: NvmlBackend) -> W:
        made.append(make(backend))
        return made[-1]

    host.wrap = wrap
    return made


class _CountsViewReads:
    """A backend that counts, per GPU, the MIG devices' process lists read (``mig show``'s
    reads: a reconcile's plans read none)."""

    def __init__(self, backend: NvmlBackend) -> None:
        self._backend = backend
        self.reads: dict[int, int] = {}

    def processes(self, gpu: int, mig: int | None = None) -> Any:
        self.reads[gpu] = self.reads.get(gpu, 0) + 1
        return self._backend.processes(gpu, mig)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def test_a_gpu_whose_health_flaps_has_only_itself_read_again_and_not_at_every_reconcile(
    host: Host, config: MigConfigFile
) -> None:
    """A GPU turning faulty takes its fault in the MIG view with no driver call; one
    answering again is read alone, and at most every VIEW_REREAD_S: a flapping GPU does not
    have every GPU read at every reconcile."""
    counting = _wrapping(host, _CountsViewReads)
    d = enable(host, config, "all-balanced")
    reads = counting[0].reads
    d.mig.reconcile()
    reads.clear()
    d.mig.show()
    one_gpu = reads[1]
    assert one_gpu > 0 and reads[0] == one_gpu
    reads.clear()
    for flap in range(10):
        if flap % 2 == 0:
            host.faults[1] = "power_watts failed: Unknown Error"
        else:
            host.faults.clear()
        d.mig.reconcile()
    assert reads.get(0, 0) == 0
    assert reads.get(1, 0) == one_gpu  # read once, when it first answered again
    # answering since, not read again yet: its fault stays shown, not instances read before
    assert [v.fault for v in d.mig.latest_view()] == ["", "power_watts failed: Unknown Error"]
    d.sleep(MigManager.VIEW_REREAD_S)
    d.mig.reconcile()
    assert reads.get(0, 0) == 0
    assert reads[1] == 2 * one_gpu
    assert [v.fault for v in d.mig.latest_view()] == ["", ""]
    assert len(d.mig.latest_view()[1].instances) > 0


class _FailsACount:
    """A backend whose GPU count fails at the ``fail_at``-th call from now (a driver that
    errors for a moment), and answers before and after."""

    def __init__(self, backend: NvmlBackend) -> None:
        self._backend = backend
        self.fail_at = 0

    def gpu_count(self) -> int:
        self.fail_at -= 1
        if self.fail_at == 0:
            raise BackendError("nvmlDeviceGetCount failed: Unknown Error")
        return self._backend.gpu_count()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def test_a_gpu_answering_again_when_a_view_refresh_fails_is_read_again_alone(
    host: Host, config: MigConfigFile
) -> None:
    """GPU 1 was found faulty and answers again as the view's full read fails: its fault
    stays shown only until it is read again on its own (VIEW_REREAD_S), not until the
    next full read."""
    failing = _wrapping(host, _FailsACount)
    d = enable(host, config, "all-balanced")
    d.mig.reconcile()
    host.faults[1] = "power_watts failed: Unknown Error"
    d.mig.reconcile()
    host.faults.clear()
    d.sleep(MigManager.VIEW_REFRESH_S)
    failing[0].fail_at = 2  # the reconcile's count answers, its view's full read's fails
    d.mig.reconcile()
    assert [v.fault for v in d.mig.latest_view()] == ["", "power_watts failed: Unknown Error"]
    d.sleep(MigManager.VIEW_REREAD_S)
    d.mig.reconcile()
    assert [v.fault for v in d.mig.latest_view()] == ["", ""]


def _mutations(
    host_dir: Path, spec: list[tuple[str, int]], config: MigConfigFile, start: str | None
) -> int:
    """How many driver mutations the apply to all-balanced makes (a dry full run)."""
    host = Host(host_dir, spec)
    try:
        d = enable(host, config, start) if start else enable(host, config, "all-enabled")
        result = d.mig.apply(config, "all-balanced")
        return sum(len(o.steps) for o in result.gpus)
    finally:
        host.close()


@pytest.mark.parametrize("start", ["all-1g.10gb", "all-enabled"])
def test_crash_at_every_step_converges(tmp_path: Path, config: MigConfigFile, start: str) -> None:
    spec = [(H100, 2)]
    total = _mutations(tmp_path / "count", spec, config, start)
    assert total > 10
    expected: list[list[tuple[int, ...]]] | None = None
    for n in range(1, total + 1):
        host = Host(tmp_path / f"crash{n}", spec)
        try:
            d = enable(host, config, start)
            d.node.faults.crash_after_mutations(n)
            with pytest.raises(SimulatedCrash):
                d.mig.apply(config, "all-balanced")
            # the daemon died; the driver kept what was done. Next start:
            again = host.start()
            interrupted = again.mig._store.inflight()
            assert interrupted is not None and interrupted.steps_done == n - 1, f"after {n}"
            again.mig.reconcile()
            resumed = again.events.recent(kind_prefix="mig.resume")[-1].message
            assert f"({n - 1}/{total} steps were done)" in resumed
            assert again.mig.assert_config(config, "all-balanced") == [], f"crash after {n}"
            got = instances(again)
            for gpu in got:
                assert all(ci_count == 1 for _, _, ci_count, *_ in gpu), f"orphan after {n}"
                assert len(gpu) == 4, f"duplicates after {n}"
            expected = expected or got
            assert got == expected
            assert again.mig._store.inflight() is None
            assert any(e.kind == "mig.resume" for e in again.events.recent())
            # gpud_mig_apply_total counts the finished apply once, as resumed
            totals = again.mig.stats.snapshot()[0]
            assert totals["resumed"] == 1 and sum(totals.values()) == 1
            again.mig.reconcile()  # nothing in flight now: no second count
            assert again.mig.stats.snapshot()[0]["resumed"] == 1
        finally:
            host.close()


def test_report_mode_leaves_an_interrupted_apply_unfinished_and_says_so(
    tmp_path: Path, config: MigConfigFile
) -> None:
    """With mig.on_start = "report" gpud changes no MIG layout at start, an interrupted apply
    included: it is reported (a ``mig.unfinished`` event once, :meth:`unfinished`, the
    ``gpud_mig_apply_unfinished`` metric) with the command that finishes it, until an apply
    or a start in "reconcile" mode finishes it."""
    host = Host(tmp_path, [(H100, 2)])
    try:
        d = host.start()
        d.node.faults.crash_after_mutations(3)
        with pytest.raises(SimulatedCrash):
            d.mig.apply(config, "all-balanced", options=ApplyOptions(force=True))
        again = host.start()
        before = instances(again)

        def unfinished_metric() -> float:
            families = [f for f in MigMetrics(again.mig)() if f.name == "gpud_mig_apply_unfinished"]
            return families[0].samples[0].value

        for _ in range(2):  # at start, then on a tick
            assert {o.status for o in again.mig.reconcile("report")} <= {"ok", "differs"}
        assert instances(again) == before, "report mode changes nothing"
        assert again.mig._store.inflight() is not None
        (event,) = again.events.recent(kind_prefix="mig.unfinished")
        assert "apply of all-balanced was interrupted after 2 of 18 steps" in event.message
        assert "`gpuctl mig apply -f FILE -c all-balanced --force`" in event.message
        assert 'mig.on_start = "reconcile"' in event.message
        assert again.mig.unfinished() == event.message and unfinished_metric() == 1.0
        assert not again.events.recent(kind_prefix="mig.resume")
        # a start in reconcile mode finishes it, and the report goes
        assert {o.status for o in again.mig.reconcile()} <= {"ok", "changed"}
        assert again.mig.unfinished() is None and unfinished_metric() == 0.0
        assert again.mig.assert_config(config, "all-balanced") == []
        # so does the apply that the report names
        d = host.start()
        d.node.faults.crash_after_mutations(1)
        with pytest.raises(SimulatedCrash):
            d.mig.apply(config, "all-1g.10gb")
        again = host.start()
        again.mig.reconcile("report")
        assert again.mig.unfinished() is not None
        assert again.mig.apply(config, "all-1g.10gb").result == "success"
        assert again.mig.unfinished() is None
        again.mig.reconcile("report")
        assert again.mig.unfinished() is None
    finally:
        host.close()


def test_an_apply_that_replaces_an_unfinished_one_says_which(
    host: Host, config: MigConfigFile
) -> None:
    """gpud was killed during an apply of all-balanced and started in "report" mode; the
    operator applies another layout. The new one wins, and its ``mig.apply`` event says
    that the interrupted one is dropped, not finished."""
    d = host.start()
    d.node.faults.crash_after_mutations(3)
    with pytest.raises(SimulatedCrash):
        d.mig.apply(config, "all-balanced", options=ApplyOptions(force=True))
    again = host.start()
    again.mig.reconcile("report")
    assert again.mig.unfinished() is not None
    assert again.mig.apply(config, "all-1g.10gb").result == "success"
    (event,) = again.events.recent(kind_prefix="mig.apply")
    assert event.fields["replaced"] == "all-balanced"
    assert event.message.startswith(
        "apply all-1g.10gb: success: replaces the unfinished apply of all-balanced (2 of 18"
        " steps done)"
    )
    assert again.mig.assert_config(config, "all-1g.10gb") == []
    assert again.mig.apply(config, "all-1g.10gb").result == "noop"
    assert "replaced" not in again.events.recent(kind_prefix="mig.apply")[-1].fields


def test_crash_during_mode_change_then_reboot(tmp_path: Path, config: MigConfigFile) -> None:
    host = Host(tmp_path, [(A100, 2)])  # the mode change waits for a reset
    try:
        d = host.start()
        d.node.faults.crash_after_mutations(1)
        with pytest.raises(SimulatedCrash):
            d.mig.apply(config, "all-balanced")
        again = host.start()
        outcomes = again.mig.reconcile()
        # GPU 0's mode change took effect before the crash; GPU 1's is made now
        assert {o.status for o in outcomes} == {"reset_pending"}
        again.node.reboot()
        third = host.start()
        third.mig.reconcile()
        assert third.mig.assert_config(config, "all-balanced") == []
    finally:
        host.close()


# --- a pending MIG mode change finished by a GPU reset ---------------------------------

# Not among the published configs the other tests use: a balanced A100-40GB layout.
HELD_OUT = parse_config(
    """
version: v1
mig-configs:
  custom-balanced:
    - devices: all
      mig-enabled: true
      mig-devices:
        "3g.20gb": 1
        "2g.10gb": 1
        "1g.5gb": 2
"""
)


def test_apply_resets_the_gpu_and_creates_the_instances_in_the_same_apply(a100: Host) -> None:
    d = a100.start(resets=True)
    result = d.mig.apply(HELD_OUT, "custom-balanced")
    assert result.result == "success", result
    for o in result.gpus:
        assert o.status == "changed" and not o.reset_pending
        assert f"GPU {o.gpu}: reset the GPU (nvidia-smi --gpu-reset -i {o.gpu})" in o.steps
        # the reset comes after the mode change and before the first instance
        steps = [s.split(": ", 1)[1] for s in o.steps]
        assert steps.index(f"reset the GPU (nvidia-smi --gpu-reset -i {o.gpu})") == 1
    assert d.mig.assert_config(HELD_OUT, "custom-balanced") == []
    assert d.mig.layouts()[0][0].describe() == "1x 3g.20gb, 1x 2g.10gb, 2x 1g.5gb"
    assert [e.fields["gpu"] for e in d.events.recent(kind_prefix="mig.reset")] == [0, 1]
    # and back: MIG off takes a reset too, done the same way
    assert d.mig.apply(HELD_OUT, "custom-balanced").result == "noop"
    off = parse_config(
        "version: v1\nmig-configs:\n  mig-off:\n    - devices: all\n      mig-enabled: false\n"
    )
    assert d.mig.apply(off, "mig-off").result == "success"
    assert not any(d.backend.mig_mode(g).current or d.backend.mig_mode(g).pending for g in (0, 1))


def test_hopper_switches_mig_mode_without_a_reset(tmp_path: Path, config: MigConfigFile) -> None:
    """H100/H200 take a MIG mode change at once when no process holds the GPU: the apply
    creates the instances with no reset (though it may reset), and back off the same way;
    the A100 beside them is still reset."""
    host = Host(tmp_path, [(H100, 1), ("H200-SXM-141GB", 1), (A100, 1)])
    try:
        d = host.start(resets=True)
        result = d.mig.apply(config, "all-balanced")
        assert result.result == "success", result
        assert all(o.status == "changed" and not o.reset_pending for o in result.gpus)
        for o in result.gpus[:2]:
            assert not any("reset" in s for s in o.steps), o.steps
            assert o.steps[0] == f"GPU {o.gpu}: set MIG mode enabled", o.steps
        assert any("nvidia-smi --gpu-reset -i 2" in s for s in result.gpus[2].steps)
        assert [e.fields["gpu"] for e in d.events.recent(kind_prefix="mig.reset")] == [2]
        assert d.mig.assert_config(config, "all-balanced") == []
        assert d.mig.layouts()[0][0].describe() == "1x 3g.40gb, 1x 2g.20gb, 2x 1g.10gb"
        assert d.mig.layouts()[0][1].describe() == "1x 3g.71gb, 1x 2g.35gb, 2x 1g.18gb"
        off = d.mig.apply(config, "all-disabled")
        assert off.result == "success" and len(d.events.recent(kind_prefix="mig.reset")) == 2
        assert all(d.backend.mig_mode(g) == (False, False) for g in range(3))
        # without a reset at hand, only the A100 is left pending
        plain = host.start()
        partly = plain.mig.apply(config, "all-balanced")
        assert [o.status for o in partly.gpus] == ["changed", "changed", "reset_pending"]
    finally:
        host.close()


class _ProgressRefused(StateStore):
    """Another process's lock taken at each record of an apply's progress, only then."""

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Any]:
        with super().transaction() as conn:
            yield _RefusesProgress(conn, self.path)


@dataclass
class _RefusesProgress:
    conn: Any
    path: Path

    def execute(self, sql: str, *args: Any) -> Any:
        if "steps_done = steps_done + 1" in sql:
            raise StateInUse(f"state database {self.path} is in use by another process")
        return self.conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


def test_a_step_whose_progress_record_is_refused_is_not_called_failed(
    host: Host, config: MigConfigFile, caplog: pytest.LogCaptureFixture
) -> None:
    """The driver took each step: the apply succeeds, MPS and co-location hear of each GPU
    changed, and the log says only that the progress count was not recorded."""
    changed: list[int] = []
    host.open_store = _ProgressRefused
    host.on_change = changed.append
    d = host.start()
    with caplog.at_level(logging.WARNING, logger="gpud.mig.manager"):
        result = d.mig.apply(config, "all-balanced")
    assert result.result == "success", result
    assert all(o.status == "changed" for o in result.gpus)
    assert sorted(set(changed)) == [0, 1]
    assert d.mig.assert_config(config, "all-balanced") == []
    said = [r.getMessage() for r in caplog.records]
    assert not any("MIG step failed" in m for m in said)
    assert any(
        m.startswith("MIG step on GPU 0 took effect; its progress not recorded") for m in said
    )


def test_the_desired_layouts_are_read_while_another_process_writes_the_database(
    tmp_path: Path,
) -> None:
    """A sqlite3 shell's write under way: reading the desired layouts and the apply in
    flight waits for nothing, says no change was refused, and ``gpuctl status`` shows no
    write problem."""
    store = StateStore(tmp_path, write_wait_s=0.05)
    mig = MigStore(store)
    store.start_done()
    with held_write_lock(tmp_path / "state.db"):
        assert mig.desired() == {}
        assert mig.inflight() is None
    assert store.write_problem() is None
    store.close()


def test_skip_reset_leaves_the_mode_change_pending(a100: Host) -> None:
    d = a100.start(resets=True)
    result = d.mig.apply(HELD_OUT, "custom-balanced", options=ApplyOptions(skip_reset=True))
    assert result.result == "reset_pending"
    assert d.backend.mig_mode(0) == (False, True)
    assert not d.events.recent(kind_prefix="mig.reset")
    # reconcile (no apply asked for a reset) leaves it pending too
    assert {o.status for o in d.mig.reconcile()} == {"reset_pending"}


def test_a_dry_run_with_skip_reset_foresees_the_pending_mode_change(
    tmp_path: Path, config: MigConfigFile
) -> None:
    """With skip_reset an A100 stops at a MIG mode change pending a reset: the dry run says
    so in the apply's words (each GPU and the result ``reset_pending``, the steps the apply
    runs before it stops), also once the change is already pending. An H100 beside it
    switches at once: it differs, then matches, never pending."""
    host = Host(tmp_path, [(A100, 1), (H100, 1)])
    try:
        d = host.start(resets=True)
        skip = ApplyOptions(skip_reset=True)
        for h100_status in ("differs", "ok"):  # from MIG off, then with the change pending
            dry = d.mig.apply(config, "all-balanced", options=skip, dry_run=True)
            assert dry.dry_run and dry.result == "reset_pending", dry
            a100_dry, h100_dry = dry.gpus
            assert (a100_dry.status, a100_dry.reset_pending) == ("reset_pending", True)
            assert (h100_dry.status, h100_dry.reset_pending) == (h100_status, False)
            assert not any("create" in s for s in a100_dry.steps)
            applied = d.mig.apply(config, "all-balanced", options=skip)
            assert applied.result == "reset_pending", applied
            a100_did = applied.gpus[0]
            assert a100_did.status == "reset_pending"
            assert (a100_dry.steps, a100_dry.detail) == (a100_did.steps, a100_did.detail)
            assert d.backend.mig_mode(0) == (False, True)
        assert a100_dry.steps == () and "pending a GPU reset" in a100_dry.detail
        # without skip_reset the apply resets the GPU: the dry run differs, nothing pending
        dry = d.mig.apply(config, "all-balanced", dry_run=True)
        assert dry.result == "success" and dry.gpus[0].status == "differs"
        assert not any(o.reset_pending for o in dry.gpus)
    finally:
        host.close()


def test_a_dry_run_lists_the_gpu_reset_the_apply_makes(a100: Host) -> None:
    """An A100 apply finishes a MIG mode change by resetting the GPU: the dry run lists that
    reset among the steps, where the apply makes it (from MIG off, and with the change
    already pending), and changes nothing."""
    d = a100.start(resets=True)
    reset0 = "GPU 0: reset the GPU (nvidia-smi --gpu-reset -i 0)"
    dry = d.mig.apply(HELD_OUT, "custom-balanced", dry_run=True)
    assert dry.result == "success" and not any(o.reset_pending for o in dry.gpus), dry
    assert dry.gpus[0].steps[:2] == ("GPU 0: set MIG mode enabled", reset0), dry.gpus[0].steps
    assert d.backend.mig_mode(0) == (False, False) and d.mig.desired() == {}, "nothing touched"
    # the change left pending: the dry run now starts with the reset
    pending = d.mig.apply(HELD_OUT, "custom-balanced", options=ApplyOptions(skip_reset=True))
    assert pending.result == "reset_pending", pending
    dry = d.mig.apply(HELD_OUT, "custom-balanced", dry_run=True)
    assert dry.gpus[0].steps[0] == reset0, dry.gpus[0].steps
    applied = d.mig.apply(HELD_OUT, "custom-balanced")
    assert applied.result == "success", applied
    assert [o.steps for o in dry.gpus] == [o.steps for o in applied.gpus]
    # and back off: destroy, set the mode, reset
    off = parse_config(
        "version: v1\nmig-configs:\n  mig-off:\n    - devices: all\n      mig-enabled: false\n"
    )
    dry = d.mig.apply(off, "mig-off", dry_run=True)
    assert dry.gpus[0].steps[-2:] == ("GPU 0: set MIG mode disabled", reset0), dry.gpus[0].steps
    assert [o.steps for o in dry.gpus] == [o.steps for o in d.mig.apply(off, "mig-off").gpus]


def test_a_forced_dry_run_foresees_a_mode_change_held_pending_by_processes(
    tmp_path: Path, config: MigConfigFile
) -> None:
    """A process on a Hopper GPU keeps a forced MIG mode change pending: with skip_reset the
    dry run answers ``reset_pending`` as the apply does; without, the driver would refuse
    the reset the apply then makes, and the dry run answers ``failed`` as the apply does,
    naming the process."""
    host = Host(tmp_path, [(H100, 1)])
    try:
        d = host.start(resets=True)
        d.node.workloads.start(0, 4242, GIB, 0.5)
        host.jobs[4242] = "train-7"
        force = ApplyOptions(force=True)
        dry = d.mig.apply(config, "all-balanced", options=force, dry_run=True)
        assert (dry.result, dry.gpus[0].status) == ("failed", "failed"), dry
        assert "reset would be refused" in dry.gpus[0].detail
        assert "pid 4242 (job train-7)" in dry.gpus[0].detail
        assert dry.gpus[0].steps == ("GPU 0: set MIG mode enabled",)
        assert d.backend.mig_mode(0) == (False, False), "nothing touched"
        skip = ApplyOptions(force=True, skip_reset=True)
        dry = d.mig.apply(config, "all-balanced", options=skip, dry_run=True)
        assert dry.result == "reset_pending" and dry.gpus[0].reset_pending, dry
        assert "pid 4242" in dry.gpus[0].detail
        applied = d.mig.apply(config, "all-balanced", options=skip)
        assert applied.result == "reset_pending", applied
        assert dry.gpus[0].steps == applied.gpus[0].steps
        applied = d.mig.apply(config, "all-balanced", options=force)
        assert applied.result == "failed" and "in use" in applied.gpus[0].detail, applied
        dry = d.mig.apply(config, "all-balanced", options=force, dry_run=True)
        assert dry.result == "failed" and dry.gpus[0].steps == (), dry
        # once it has gone, the reset goes through
        d.node.workloads.stop(4242)
        dry = d.mig.apply(config, "all-balanced", options=force, dry_run=True)
        applied = d.mig.apply(config, "all-balanced", options=force)
        assert dry.result == applied.result == "success", (dry, applied)
        assert [o.steps for o in dry.gpus] == [o.steps for o in applied.gpus]
    finally:
        host.close()


def test_a_mode_change_left_pending_is_not_held_back_by_processes(a100: Host) -> None:
    """With skip_reset an A100's MIG mode change only waits for the next GPU reset: the
    processes running on the GPU are not disturbed by it, so the apply (and its dry run)
    neither refuses nor waits for them; the apply that then makes the reset does."""
    d = a100.start(resets=True)
    d.node.workloads.start(1, 4242, GIB, 0.5)  # a process on the whole GPU 1
    a100.jobs[4242] = "train-7"
    skip = ApplyOptions(skip_reset=True)
    dry = d.mig.apply(HELD_OUT, "custom-balanced", options=skip, dry_run=True)
    assert dry.result == "reset_pending", dry
    assert [o.status for o in dry.gpus] == ["reset_pending", "reset_pending"], dry
    result = d.mig.apply(HELD_OUT, "custom-balanced", options=skip)
    assert result.result == "reset_pending", result
    assert d.backend.mig_mode(1) == (False, True)
    assert 4242 in {p.pid for p in d.backend.processes(1)}, "still running"
    with pytest.raises(Busy, match=r"GPU 1 .*the whole GPU: pid 4242 \(job train-7\)"):
        d.mig.apply(HELD_OUT, "custom-balanced")


def test_a_backend_that_cannot_reset_reports_reset_pending(a100: Host) -> None:
    d = a100.start(resets=False)
    assert d.mig.apply(HELD_OUT, "custom-balanced").result == "reset_pending"


def test_reset_follows_the_busy_rules(a100: Host) -> None:
    d = a100.start(resets=True)
    d.node.workloads.start(1, 4242, GIB, 0.5)  # a process on the whole GPU 1
    a100.jobs[4242] = "train-7"
    with pytest.raises(Busy, match=r"GPU 1 .*the whole GPU: pid 4242 \(job train-7\)"):
        d.mig.apply(HELD_OUT, "custom-balanced")
    assert d.backend.mig_mode(0) == (False, False), "nothing touched"
    # force skips gpud's check; the driver still refuses to reset a GPU in use
    result = d.mig.apply(HELD_OUT, "custom-balanced", options=ApplyOptions(force=True))
    assert result.result == "failed"
    by_gpu = {o.gpu: o for o in result.gpus}
    assert by_gpu[0].status == "changed"
    assert by_gpu[1].status == "failed" and "in use" in by_gpu[1].detail
    d.node.workloads.stop(4242)
    # the interrupted apply (force, resets allowed) is finished by the next reconcile
    assert {o.status for o in d.mig.reconcile()} == {"ok", "changed"}
    assert d.mig.assert_config(HELD_OUT, "custom-balanced") == []


def test_drain_waits_for_the_process_then_resets(a100: Host) -> None:
    d = a100.start(resets=True)
    d.node.workloads.start(0, 4242, GIB, 0.5)
    stopped = []

    def sleep(s: float) -> None:  # the process leaves while gpud drains
        stopped.append(d.node.workloads.stop(4242))

    d.mig._sleep = sleep
    opts = ApplyOptions(drain=True, timeout_s=30)
    assert d.mig.apply(HELD_OUT, "custom-balanced", options=opts).result == "success"
    assert stopped == [True]
    assert d.mig.assert_config(HELD_OUT, "custom-balanced") == []


# --- faults stay with the GPU that has them ----------------------------------------------


def test_a_gpu_lost_before_start_leaves_the_others_managed(a100: Host) -> None:
    first = a100.start(resets=True)
    assert first.mig.apply(HELD_OUT, "custom-balanced").result == "success"
    first.node.faults.lose(1)  # device state: still lost when the next daemon starts
    d = a100.start(resets=True)
    with pytest.raises(GpuLost):
        d.backend.identity(1)  # nvmlDeviceGetUUID: GPU is lost
    outcomes = {o.gpu: o for o in d.mig.reconcile()}
    assert outcomes[0].status == "ok"
    assert outcomes[1].status == "faulty" and "GPU lost" in outcomes[1].detail
    (drift,) = [e.message for e in d.events.recent() if e.kind == "mig.drift"]
    assert drift.startswith("GPU 1 is faulty: identity: GPU lost"), drift
    views = d.mig.show()
    assert views[0].fault == "" and len(views[0].instances) == 4
    assert views[1].fault.startswith("identity: GPU lost") and views[1].instances == ()
    # never read: whether it can do MIG is unknown (null in --json), not "not MIG capable"
    shown = [gpu_message(v) for v in views]
    assert shown[0].HasField("mig_capable") and shown[0].mig_capable
    assert not shown[1].HasField("mig_capable")
    # and so are its UUID and product: null, not "" (a UUID a script would look up)
    assert shown[0].uuid.startswith("GPU-") and shown[0].product == "A100-SXM4-40GB"
    assert not shown[1].HasField("uuid") and not shown[1].HasField("product")
    unknown = message_to_dict(shown[1])
    assert (unknown["uuid"], unknown["product"]) == (None, None)
    diff, faulty = d.mig.check(HELD_OUT, "custom-balanced")
    assert diff == [] and list(faulty) == [1]
    result = d.mig.apply(HELD_OUT, "custom-balanced")
    assert result.result == "partial"
    assert [o.status for o in result.gpus] == ["ok", "faulty"]
    assert "GPU 1 is faulty, left alone" in result.gpus[1].detail
    answer = apply_message(result)
    assert answer.gpus[0].uuid.startswith("GPU-") and not answer.gpus[1].HasField("uuid")
    text, left_out = d.mig.export("now")  # the GPUs that answer
    assert list(left_out) == [1] and text.startswith("# GPU 1 left out: identity: GPU lost")
    assert parse_config(text).configs["now"][0].devices == (0,)


def test_telemetry_faults_are_not_called(a100: Host) -> None:
    d = a100.start(resets=True)
    uuid = d.mig.show()[1].identity.uuid
    d.node.faults.slow(1, 30.0)  # a call on GPU 1 would hang for 30 s
    a100.faults[1] = "not answering: a driver call is outstanding"
    result = d.mig.apply(HELD_OUT, "custom-balanced")
    assert result.result == "partial"
    assert [o.status for o in result.gpus] == ["changed", "faulty"]
    views = d.mig.show()
    assert views[1].fault == "not answering: a driver call is outstanding"
    assert views[1].identity.uuid == uuid  # known from before
    d.node.faults.clear(1)


def test_a_gpu_faulty_during_an_apply_takes_that_layout_once_it_answers_again(
    host: Host, config: MigConfigFile
) -> None:
    """The apply leaves a faulty GPU alone but makes the config it names that GPU's desired
    layout: once it answers, the reconcile step brings it there, not back to the layout
    an earlier apply gave it."""
    d = enable(host, config, "all-balanced")
    host.faults[1] = "not answering: a driver call is outstanding"
    result = d.mig.apply(config, "all-3g.40gb")
    assert [o.status for o in result.gpus] == ["changed", "faulty"]
    assert d.mig.desired()[d.mig.show()[1].identity.uuid].config_name == "all-3g.40gb"
    host.faults.clear()
    assert [o.status for o in d.mig.reconcile()] == ["ok", "changed"]
    assert d.mig.assert_config(config, "all-3g.40gb") == []


def test_a_gpu_lost_before_start_takes_the_layout_an_apply_gave_it_once_it_answers(
    host: Host, config: MigConfigFile
) -> None:
    """A GPU lost since before gpud started has no UUID to record a layout under: where
    an earlier run saw its product (so the layout is checked against it), the apply gives
    its new layout to the record its index had (the GPU it most likely is)."""
    first = enable(host, config, "all-balanced")
    host.last_seen = {1: seen(first, 1)}
    first.node.faults.lose(1)  # device state: still lost when the next daemon starts
    d = host.start()
    result = d.mig.apply(config, "all-3g.40gb")
    assert [o.status for o in result.gpus] == ["changed", "faulty"]
    assert {r.gpu_index: r.config_name for r in d.mig.desired().values()} == {
        0: "all-3g.40gb",
        1: "all-3g.40gb",
    }
    d.node.faults.clear(1)
    assert [o.status for o in d.mig.reconcile()] == ["ok", "changed"]
    assert d.mig.assert_config(config, "all-3g.40gb") == []


def test_a_gpu_lost_before_start_shows_the_layout_it_is_to_take(
    host: Host, config: MigConfigFile
) -> None:
    """A GPU lost since before gpud started carries the desired layout of the record its
    index had (what reconcile brings it to once it answers), as a GPU lost after it was
    read does: not shown as unmanaged."""
    first = enable(host, config, "all-balanced")
    first.node.faults.lose(1)
    d = host.start()
    lost = d.mig.show()[1]
    assert lost.fault and not lost.identity.read
    assert lost.desired is not None and lost.desired.config_name == "all-balanced"
    assert lost.desired.gpu_uuid == seen(first, 1).uuid
    assert d.mig.show()[0].desired is not None  # a GPU that answers: its own, as before


def seen(d: Daemon, gpu: int) -> SeenIdentity:
    """GPU ``gpu`` as daemon life ``d`` read it: how a later life last saw it."""
    g = d.mig.show()[gpu].identity
    return SeenIdentity(g.uuid, g.name, g.pci_bus_id, g.product)


def test_a_layout_a_faulty_gpu_cannot_take_is_refused_as_for_a_healthy_one(
    tmp_path: Path, config: MigConfigFile
) -> None:
    """A GPU left alone as faulty gets the config's layout as its desired one: a profile
    its product lacks is refused as it is while the GPU answers, naming the GPU and the
    profile, not saved for every reconcile after the fault clears to fail on."""
    host = Host(tmp_path, [(H100, 1), (A100, 1)])
    try:
        d = host.start()
        with pytest.raises(InvalidArgument) as healthy:
            d.mig.apply(config, "all-3g.40gb")
        assert "GPU 1" in str(healthy.value) and "'3g.40gb'" in str(healthy.value)
        host.faults[1] = "not answering: a driver call is outstanding"
        with pytest.raises(InvalidArgument) as faulty:
            d.mig.apply(config, "all-3g.40gb")
        assert str(faulty.value) == str(healthy.value)
        with pytest.raises(InvalidArgument):
            d.mig.apply(config, "all-3g.40gb", dry_run=True)
        assert d.mig.desired() == {}
        # lost since before a later start: the product an earlier run saw is checked
        host.last_seen = {1: seen(d, 1)}
        d.node.faults.lose(1)
        later = host.start()
        with pytest.raises(InvalidArgument, match=r"GPU 1 .*'3g\.40gb'"):
            later.mig.apply(config, "all-3g.40gb")
        assert later.mig.desired() == {}
    finally:
        host.close()


@pytest.mark.parametrize(
    ("product_seen", "said", "kept"),
    [
        # no run kept its product: the layout cannot be checked, the earlier one is kept
        (
            False,
            "; its product unknown: the config's layout for it cannot be checked;"
            " its desired layout is unchanged",
            {0: "all-3g.40gb", 1: "all-balanced"},
        ),
        # its product seen, but no earlier apply recorded it: no UUID to record it under
        (
            True,
            "; its UUID never read and no earlier apply recorded it: unmanaged",
            {0: "all-3g.40gb"},
        ),
    ],
    ids=["no-product-seen", "product-seen-unrecorded"],
)
def test_a_gpu_lost_before_start_that_cannot_take_a_layout_says_why_on_its_line(
    host: Host, config: MigConfigFile, product_seen: bool, said: str, kept: dict[int, str]
) -> None:
    """A GPU never read since gpud started: where no run kept its product, its record keeps
    the earlier apply's layout; where one did but no earlier apply recorded the GPU (the
    layout checked against that product), it stays unmanaged. The apply says which."""
    first = host.start() if product_seen else enable(host, config, "all-balanced")
    if product_seen:
        host.last_seen = {1: seen(first, 1)}
    first.node.faults.lose(1)
    d = host.start()
    result = d.mig.apply(config, "all-3g.40gb")
    assert [o.status for o in result.gpus] == ["changed", "faulty"]
    assert result.gpus[1].detail.endswith(said), result.gpus[1].detail
    assert {r.gpu_index: r.config_name for r in d.mig.desired().values()} == kept


def test_a_gpu_lost_before_start_takes_the_layout_into_its_newest_record(
    host: Host, config: MigConfigFile
) -> None:
    """Two records kept for one GPU index, neither of a GPU read now (a GPU replaced while
    gpud was down): an apply's layout goes to the newer one, whatever order the store
    lists them in."""
    first = enable(host, config, "all-balanced")
    host.last_seen = {1: seen(first, 1)}
    newest = first.mig.show()[1].identity.uuid
    older = first.mig.desired()[newest].updated_at - 60
    layout = first.mig.desired()[newest].layout
    MigStore(first.store).begin_apply(
        "all-balanced", {"GPU-replaced": (1, layout)}, (), ApplyOptions(), older, inflight=False
    )
    first.node.faults.lose(1)
    d = host.start()
    d.mig.apply(config, "all-3g.40gb")
    assert {u: r.config_name for u, r in d.mig.desired().items() if r.gpu_index == 1} == {
        newest: "all-3g.40gb",
        "GPU-replaced": "all-balanced",
    }


def replaced_at_1(host: Host, config: MigConfigFile) -> tuple[Daemon, str]:
    """A node whose GPU 1 an earlier run read as a new board (last seen there) and lost,
    with an older record left at index 1 by the board it replaced (``GPU-replaced``): a
    daemon started since, and the new board's UUID."""
    first = host.start()
    MigStore(first.store).begin_apply(
        "all-balanced",
        {"GPU-replaced": (1, config.layouts("all-balanced", [first.mig.show()[1].identity])[1])},
        (),
        ApplyOptions(),
        0.0,
        inflight=False,
    )
    host.last_seen = {1: seen(first, 1)}
    first.node.faults.lose(1)
    return host.start(), host.last_seen[1].uuid


def test_a_board_replaced_at_an_index_lost_before_start_shows_no_layout_of_the_old_one(
    host: Host, config: MigConfigFile
) -> None:
    """A GPU lost since before gpud started, whose UUID an earlier run read at its index,
    is that board: the record an older board at the same index left is not its desired
    layout (it has none: unmanaged)."""
    d, _ = replaced_at_1(host, config)
    lost = d.mig.show()[1]
    assert lost.fault and not lost.identity.read
    assert lost.desired is None


def test_an_apply_gives_a_board_replaced_at_an_index_not_the_old_ones_record(
    host: Host, config: MigConfigFile
) -> None:
    """An apply that leaves a GPU lost since before start alone does not write its layout
    into the record of the board an earlier run found replaced at that index: the new
    board has no record, so it stays unmanaged, and the apply says so."""
    d, _ = replaced_at_1(host, config)
    result = d.mig.apply(config, "all-3g.40gb")
    assert [o.status for o in result.gpus] == ["changed", "faulty"]
    assert result.gpus[1].detail.endswith("no earlier apply recorded it: unmanaged")
    assert d.mig.desired()["GPU-replaced"].config_name == "all-balanced"


XID_79 = "critical Xid 79 (GPU has fallen off the bus): uncleared"


def record_replaced(d: Daemon, updated_at: float) -> None:
    """A layout (all-disabled) recorded at ``updated_at`` for GPU-replaced at GPU 1: a GPU
    there before the one there now."""
    MigStore(d.store).begin_apply(
        "all-disabled",
        {"GPU-replaced": (1, DeviceLayout(False, ()))},
        (),
        ApplyOptions(),
        updated_at,
        inflight=False,
    )


@pytest.mark.parametrize("read_by_telemetry", [False, True], ids=["never-read", "read-faulty"])
def test_an_older_record_of_a_gpu_index_is_missing_only_once_another_uuid_is_read_there(
    host: Host, config: MigConfigFile, read_by_telemetry: bool
) -> None:
    """Two records kept for one GPU index (a GPU replaced while gpud was down), the older
    one listed last and of another layout, and the GPU there faulty since before start.
    With no UUID read at that index, nothing says the older one's GPU is gone: both are
    left alone as faulty, neither with a gpud_mig_layout_matches series. Once telemetry
    reads the newest record's UUID there (the GPU back, its XID 79 uncleared), the older
    one is of a GPU not present: ``missing``, its layout_matches 0."""
    first = enable(host, config, "all-balanced")
    newest = first.mig.show()[1].identity
    record_replaced(first, first.mig.desired()[newest.uuid].updated_at - 60)
    first.node.faults.lose(1)
    if read_by_telemetry:
        host.faults[1] = XID_79
        host.read_identities = {1: newest}
    d = host.start()
    outcomes = {o.uuid: o for o in d.mig.reconcile() if o.gpu == 1}
    assert outcomes[newest.uuid].status == "faulty"
    replaced = outcomes["GPU-replaced"]
    assert replaced.status == ("missing" if read_by_telemetry else "faulty"), replaced
    if not read_by_telemetry:
        assert f"most likely {newest.uuid} (recorded there last)" in replaced.detail
    matches = {
        s.labels["gpu_uuid"]: s.value
        for family in MigMetrics(d.mig)()
        if family.name == "gpud_mig_layout_matches"
        for s in family.samples
        if s.labels["gpu"] == "1"
    }
    assert matches == ({"GPU-replaced": 0.0} if read_by_telemetry else {})


def test_a_faulty_gpu_never_read_by_the_manager_is_named_as_telemetry_read_it(
    host: Host, config: MigConfigFile
) -> None:
    """GPU 1 is lost before gpud starts, then answers again with its XID 79 uncleared: the
    manager never reads it (it calls no faulty GPU), but telemetry did. An apply names it
    by its product and records the layout under its UUID; reconcile leaves it alone until
    the fault clears, then brings it to that layout."""
    first = enable(host, config, "all-balanced")
    gpu0, gpu1 = (g.identity for g in first.mig.show())
    first.node.faults.lose(1)
    d = host.start()
    d.node.faults.clear(1)
    host.faults[1] = XID_79
    host.read_identities = {1: gpu1}
    result = d.mig.apply(config, "all-3g.40gb")
    assert [o.status for o in result.gpus] == ["changed", "faulty"]
    assert result.gpus[1].detail.startswith(f"GPU 1 ({H100})"), result.gpus[1].detail
    assert result.gpus[1].uuid == gpu1.uuid
    assert d.mig.desired()[gpu1.uuid].config_name == "all-3g.40gb"
    assert [(o.uuid, o.status) for o in d.mig.reconcile()] == [
        (gpu0.uuid, "ok"),
        (gpu1.uuid, "faulty"),
    ]
    host.faults.clear()
    assert [o.status for o in d.mig.reconcile()] == ["ok", "changed"]
    assert d.mig.assert_config(config, "all-3g.40gb") == []


def test_show_never_waits_on_a_hung_gpu_past_its_deadline(a100: Host) -> None:
    d = a100.start()
    d.mig.show()  # identities and tables known
    d.node.faults.slow(1, 3.0)  # telemetry has not noticed yet
    views = d.mig.show(timeout_s=0.3)
    assert views[0].fault == "" and views[0].mode is not None
    assert views[1].fault.startswith("not answering")
    # until the stuck read returns, GPU 1 gets no new call and is shown faulty at once
    again = d.mig.show(timeout_s=30.0)
    assert again[1].fault == "not answering: an earlier driver call on it is still outstanding"
    d.node.faults.clear(1)


def test_reconcile_never_waits_on_a_hung_gpu_past_its_deadline(
    host: Host, config: MigConfigFile
) -> None:
    """A GPU that hangs between two telemetry ticks: the daemon's MIG step must not wait on
    it (the other steps and the watchdog wait behind that step)."""
    d = enable(host, config, "all-balanced")
    d.mig.reconcile()  # tables and the view read while every GPU answers
    d.mig.VIEW_TIMEOUT_S = 0.3
    d.node.faults.slow(1, 3.0)  # telemetry has not noticed yet
    outcomes = {o.gpu: o for o in d.mig.reconcile()}
    assert d.mig._stuck == {1}  # its read is left in the driver, not waited for
    assert outcomes[0].status == "ok"
    assert outcomes[1].status == "faulty" and "not answering" in outcomes[1].detail
    # until the stuck read returns, GPU 1 gets no new call
    again = {o.gpu: o for o in d.mig.reconcile()}
    assert again[1].status == "faulty" and "still outstanding" in again[1].detail
    d.node.faults.clear(1)


def test_an_apply_whose_client_has_gone_is_not_started(a100: Host) -> None:
    d = a100.start(resets=True)
    result = d.mig.apply(HELD_OUT, "custom-balanced", still_wanted=lambda: False)
    assert result.result == "not_started"
    assert d.backend.mig_mode(0) == (False, False)
    assert d.mig.desired() == {}
    event = d.events.recent(kind_prefix="mig.apply")[-1]
    assert event.fields["result"] == "not_started" and event.fields["client_gone"] is True


def test_every_apply_timed_is_counted_by_its_result(a100: Host) -> None:
    """gpud_mig_apply_total has a series for every result an apply can end with: the
    results sum to the duration histogram's count (an apply not started included)."""
    d = a100.start(resets=True)
    d.mig.apply(HELD_OUT, "custom-balanced", still_wanted=lambda: False)
    samples = {
        (s.name, s.labels.get("result")): s.value
        for family in MigMetrics(d.mig)()
        for s in family.samples
    }
    assert samples[("gpud_mig_apply_total", "not_started")] == 1
    applies = sum(v for (name, _), v in samples.items() if name == "gpud_mig_apply_total")
    assert applies == samples[("gpud_mig_apply_duration_seconds_count", None)] == 1


def test_an_apply_whose_client_goes_while_it_runs_is_finished_and_logged(a100: Host) -> None:
    d = a100.start(resets=True)
    calls = []

    def wanted() -> bool:  # the client goes once the apply has started
        calls.append(1)
        return len(calls) == 1

    result = d.mig.apply(HELD_OUT, "custom-balanced", still_wanted=wanted)
    assert result.result == "success"
    assert d.mig.assert_config(HELD_OUT, "custom-balanced") == []
    event = d.events.recent(kind_prefix="mig.apply")[-1]
    assert event.fields["client_gone"] is True
    assert "finished after the client had gone" in event.message


class _LosesAnotherGpu:
    """The backend, except that GPU ``lost`` falls off the bus right after the first GPU
    instance is created on GPU ``on``: a GPU lost in the middle of an apply."""

    def __init__(self, backend: NvmlBackend, node: SimNode, *, on: int, lost: int) -> None:
        self._backend, self._node, self._on, self._lost = backend, node, on, lost

    def __getattr__(self, name: str) -> object:
        return getattr(self._backend, name)

    def create_gpu_instance(self, gpu: int, profile_id: int, placement: object) -> object:
        out = self._backend.create_gpu_instance(gpu, profile_id, placement)  # type: ignore[arg-type]
        if gpu == self._on and not self._node.faults.active().get(self._lost):
            self._node.faults.lose(self._lost)
        return out


def test_a_gpu_lost_during_an_apply_leaves_the_others_applied(
    host: Host, config: MigConfigFile
) -> None:
    d = host.start()
    lossy = MigManager(
        _LosesAnotherGpu(d.backend, d.node, on=0, lost=1),  # type: ignore[arg-type]
        d.store,
        d.events,
        job_resolver=host.jobs.get,
        monotonic=d.clock.monotonic,
        sleep=d.clock.advance,
        read_wait=d.clock.read_wait,
    )
    result = lossy.apply(config, "all-balanced")
    assert result.result == "partial", result
    outcomes = {o.gpu: o for o in result.gpus}
    assert outcomes[0].status == "changed"
    assert outcomes[1].status == "faulty" and "GPU lost" in outcomes[1].detail
    assert "GPU 1" in outcomes[1].detail
    # GPU 0 holds its layout; GPU 1's part waits for the GPU, as the next start resumes it
    d.node.faults.clear(1)
    again = host.start()
    assert again.mig.apply(config, "all-balanced").result in ("success", "noop")
    assert again.mig.assert_config(config, "all-balanced") == []


def test_a_gpu_lost_while_draining_leaves_the_others_applied(
    host: Host, config: MigConfigFile
) -> None:
    d, _pid = _busy_setup(host, config)  # GPU 0 runs a process on an instance that goes
    d.mig._sleep = lambda s: d.node.faults.lose(0)  # it falls off the bus while gpud waits
    result = d.mig.apply(config, "all-3g.40gb", options=ApplyOptions(drain=True, timeout_s=30))
    assert result.result == "partial", result
    outcomes = {o.gpu: o for o in result.gpus}
    assert outcomes[0].status == "faulty" and "GPU 0" in outcomes[0].detail
    assert "GPU lost" in outcomes[0].detail
    assert outcomes[1].status == "changed"
    d.node.faults.clear(0)
    diff = d.mig.assert_config(config, "all-3g.40gb")
    assert diff and all(line.startswith("GPU 0") for line in diff), diff


def test_a_gpu_whose_processes_cannot_be_listed_is_left_alone(
    host: Host, config: MigConfigFile
) -> None:
    """gpud cannot tell that its instances are idle, so it does not destroy them; the other
    GPUs are applied and the result names the GPU and why."""
    d = enable(host, config, "all-1g.10gb")
    before = instances(d)
    d.node.faults.not_supported(1, "processes")
    result = d.mig.apply(config, "all-3g.40gb")
    assert result.result == "partial", result
    outcomes = {o.gpu: o for o in result.gpus}
    assert outcomes[0].status == "changed"
    assert outcomes[1].status == "faulty" and outcomes[1].detail.startswith("GPU 1 ")
    assert "cannot list its processes" in outcomes[1].detail
    assert "Not Supported" in outcomes[1].detail and "--force" in outcomes[1].detail
    assert instances(d)[1] == before[1]
    # the same while draining: GPU 1 is left alone at once, not waited on
    d.mig.apply(config, "all-1g.10gb")
    drained = d.mig.apply(config, "all-3g.40gb", options=ApplyOptions(drain=True, timeout_s=30))
    assert drained.result == "partial" and d.sleeps == []
    assert [o.status for o in drained.gpus] == ["changed", "faulty"]
    # reading it needs no process list; changing it anyway is for force
    diff, faulty = d.mig.check(config, "all-3g.40gb")
    assert faulty == {} and [line[:5] for line in diff] == ["GPU 1"]
    forced = d.mig.apply(config, "all-3g.40gb", options=ApplyOptions(force=True))
    assert forced.result == "success", forced
    assert d.mig.assert_config(config, "all-3g.40gb") == []


def test_a_dry_run_leaves_a_gpu_whose_processes_cannot_be_listed_as_the_apply_would(
    host: Host, config: MigConfigFile
) -> None:
    d = enable(host, config, "all-1g.10gb")
    before = instances(d)
    d.node.faults.not_supported(1, "processes")
    dry = d.mig.apply(config, "all-3g.40gb", dry_run=True)
    assert dry.result == "partial", dry
    assert [o.status for o in dry.gpus] == ["differs", "faulty"]
    assert dry.gpus[0].steps and dry.gpus[1].steps == ()
    assert "cannot list its processes" in dry.gpus[1].detail
    assert instances(d) == before
    result = d.mig.apply(config, "all-3g.40gb")
    assert result.result == dry.result and result.gpus[1] == dry.gpus[1]
    assert [o.status for o in result.gpus] == ["changed", "faulty"]
    assert list(result.gpus[0].steps) == list(dry.gpus[0].steps)


def test_a_dry_run_leaves_lost_and_hung_gpus_as_the_apply_would(
    host: Host, config: MigConfigFile
) -> None:
    host.read_timeout_s = 0.2
    d = enable(host, config, "all-1g.10gb")
    before = instances(d)
    d.node.faults.lose(1)
    dry = d.mig.apply(config, "all-3g.40gb", dry_run=True)
    assert dry.result == "partial" and [o.status for o in dry.gpus] == ["differs", "faulty"]
    assert "GPU lost" in dry.gpus[1].detail
    d.node.faults.clear(1)
    d.node.faults.slow(1, 1.0)  # telemetry has not noticed yet
    dry = d.mig.apply(config, "all-3g.40gb", dry_run=True)
    assert dry.result == "partial" and [o.status for o in dry.gpus] == ["differs", "faulty"]
    assert "not answering" in dry.gpus[1].detail
    assert d.mig._stuck == {1}  # its read is left in the driver, not waited for
    d.clock.let_go()  # the stuck read returns
    assert not d.mig._stuck
    d.node.faults.clear(1)
    assert instances(d) == before


def test_an_apply_never_waits_on_a_hung_gpu_past_its_read_deadline(
    host: Host, config: MigConfigFile
) -> None:
    """A GPU that hangs before telemetry notices: the apply reads it no longer than its
    read deadline, leaves it alone as not answering and applies the others."""
    host.read_timeout_s = 0.2
    d = enable(host, config, "all-1g.10gb")
    before = instances(d)
    d.node.faults.slow(1, 1.0)  # every call on GPU 1 takes 1 s; telemetry has not noticed
    result = d.mig.apply(config, "all-3g.40gb")
    assert d.mig._stuck == {1}  # its read is left in the driver, not waited for
    assert result.result == "partial", result
    outcomes = {o.gpu: o for o in result.gpus}
    assert outcomes[0].status == "changed"
    assert outcomes[1].status == "faulty" and "not answering" in outcomes[1].detail
    d.node.faults.clear(1)
    assert instances(d)[1] == before[1]


def test_a_gpu_slow_to_answer_on_a_loaded_host_is_changed_not_given_up_on_half_made(
    host: Host, config: MigConfigFile
) -> None:
    """gpud starved of CPU: once the apply has changed GPU 0, the driver answers each of its
    calls, slowly, and the re-read after its steps takes longer in all than the read
    deadline. No call goes unanswered for that long: the GPU is changed, not called faulty
    with its layout half made."""
    host.read_timeout_s = 0.5
    reads = _SlowReads(host, 0, 0.1)
    host.wrap = reads.wrap
    d = enable(host, config, "all-1g.10gb")

    def changed(gpu: int) -> None:
        reads.slow = reads.slow or gpu == 0

    d.mig._on_change = changed
    result = d.mig.apply(config, "all-3g.40gb")
    assert max(reads.calls.values()) * 0.1 > host.read_timeout_s  # one read, slower in all
    assert result.result == "success", result
    assert [(o.gpu, o.status) for o in result.gpus] == [(0, "changed"), (1, "changed")]
    assert d.mig.assert_config(config, "all-3g.40gb") == []


class _SlowReads:
    """The backend, where once ``slow`` each call on GPU ``gpu`` from a bounded read (a
    thread of the manager's own) takes ``seconds`` more on the host's clock (the daemon
    life's), counted by read."""

    def __init__(self, host: Host, gpu: int, seconds: float) -> None:
        self.host, self.gpu, self.seconds = host, gpu, seconds
        self.slow = False
        self.calls: dict[threading.Thread, int] = {}

    def wrap(self, backend: NvmlBackend) -> object:
        reads = self

        class Slow:
            def __getattr__(self, name: str) -> object:
                real = getattr(backend, name)

                def call(*args: object, **kwargs: object) -> object:
                    reader = threading.current_thread()
                    bounded = reader.name.startswith("gpud-mig-")
                    if reads.slow and bounded and args and args[0] == reads.gpu:
                        reads.calls[reader] = reads.calls.get(reader, 0) + 1
                        # answered, late: no CPU for gpud
                        reads.host.clock.hang(reads.gpu, reads.seconds)
                    return real(*args, **kwargs)

                return call if callable(real) else real

        return Slow()


def test_an_apply_stops_waiting_on_a_gpu_once_telemetry_finds_it_hung(
    host: Host, config: MigConfigFile
) -> None:
    """Telemetry finds a GPU hung while an apply's read of it is in the driver: that read
    is given up on then, not at the read deadline nor when the call returns, and the others
    go on."""
    telemetry_tick = threading.Event()

    def hangs(seconds: float) -> None:
        # the sampler's tick comes while the apply's read of GPU 1 is outstanding
        host.faults[1] = "not answering: ..."
        telemetry_tick.set()
        host.clock.hang(1)  # in the driver until let go of

    host.driver_sleep = hangs
    host.read_timeout_s = 5.0  # telemetry.call_timeout_s
    d = enable(host, config, "all-1g.10gb")
    before = instances(d)
    reading = {t for t in threading.enumerate() if t.name.startswith("gpud-mig-")}
    d.node.faults.slow(1, 5.0)  # each call on GPU 1 now hangs; telemetry has not noticed
    try:
        result = d.mig.apply(config, "all-3g.40gb")
        assert telemetry_tick.is_set()
        # the read is still in the driver: the apply did not wait for it to return, and the
        # reason given is telemetry's, not the read deadline's
        assert d.clock.entered == 1 and d.clock.returned == 0
        assert d.mig._stuck == {1}
        assert result.result == "partial", result
        outcomes = {o.gpu: o for o in result.gpus}
        assert outcomes[0].status == "changed"
        assert outcomes[1].status == "faulty" and outcomes[1].detail.endswith("not answering: ...")
        left = [t for t in threading.enumerate() if t.name.startswith("gpud-mig-")]
        (behind,) = [t for t in left if t not in reading and t.name.endswith("-1")]
    finally:
        d.node.faults.clear(1)
        d.clock.let_go()  # the read left behind returns
    assert not behind.is_alive() and d.clock.returned == 1
    assert not d.mig._stuck
    assert instances(d)[1] == before[1]


def test_a_gpu_found_hung_while_an_apply_waits_is_left_alone(
    host: Host, config: MigConfigFile
) -> None:
    """Telemetry finds a GPU hung while an apply drains another: it gets no further call."""
    driver = Sleeps()  # a call on GPU 1 once it hangs: recorded, not waited out
    host.driver_sleep = driver
    d, pid = _busy_setup(host, config)  # GPU 0 runs a process on an instance that goes

    def found_hung(s: float) -> None:
        host.faults[1] = "driver call timed out after 5 s"
        d.node.faults.slow(1, 1.0)  # each call on GPU 1 now hangs
        d.node.workloads.stop(pid)

    d.mig._sleep = found_hung
    result = d.mig.apply(config, "all-3g.40gb", options=ApplyOptions(drain=True, timeout_s=30))
    assert driver.calls == []  # no call reached GPU 1 once it was found hung
    assert result.result == "partial", result
    outcomes = {o.gpu: o for o in result.gpus}
    assert outcomes[0].status == "changed"
    assert outcomes[1].status == "faulty" and "timed out after 5 s" in outcomes[1].detail
    d.node.faults.clear(1)


def test_reconcile_leaves_a_gpu_whose_processes_cannot_be_listed(
    host: Host, config: MigConfigFile, tmp_path: Path
) -> None:
    d = enable(host, config, "all-3g.40gb")
    # another manager changes the driver behind this one's back: both GPUs drift
    other = MigManager(d.backend, StateStore(tmp_path / "other"), EventLog(None))
    assert other.apply(config, "all-1g.10gb").result == "success"
    d.node.faults.not_supported(1, "processes")
    outcomes = {o.gpu: o for o in d.mig.reconcile()}
    assert outcomes[0].status == "changed"
    assert outcomes[1].status == "faulty" and "cannot list its processes" in outcomes[1].detail
    d.node.faults.clear(1)
    assert {o.status for o in d.mig.reconcile()} == {"ok", "changed"}
    assert d.mig.assert_config(config, "all-3g.40gb") == []


def test_a_gpu_never_read_is_faulty_in_an_apply_that_filters_devices(
    host: Host, config: MigConfigFile
) -> None:
    """A GPU lost before gpud ever read it has no PCI device id, so no ``device-filter``
    can tell whether it is one the config names: it is reported faulty with its reason
    (partial), as it is where an entry names every device, never silently left out."""
    first = enable(host, config, "all-3g.40gb")
    first.node.faults.lose(1)  # device state: still lost when the next daemon starts
    d = host.start()
    dry = d.mig.apply(config, "all-1g.10gb", dry_run=True)  # H100 and H200 by device-filter
    assert dry.result == "partial", dry
    assert [(o.gpu, o.status) for o in dry.gpus] == [(0, "differs"), (1, "faulty")]
    assert dry.gpus[1].detail.startswith("GPU 1 is faulty, left alone: identity: GPU lost")
    assert dry.gpus[1].detail.endswith(
        "; its product unknown: the config's device-filter cannot be judged;"
        " its desired layout is unchanged"
    )
    result = d.mig.apply(config, "all-1g.10gb")
    assert result.result == "partial", result
    assert [(o.gpu, o.status) for o in result.gpus] == [(0, "changed"), (1, "faulty")]
    assert result.gpus[1] == dry.gpus[1]
    diff, faulty = d.mig.check(config, "all-1g.10gb")
    assert diff == [] and list(faulty) == [1]
    # with no GPU read, the config is not refused as naming other products: both are faulty
    d.node.faults.lose(0)
    blind = host.start()
    result = blind.mig.apply(config, "all-1g.10gb")
    assert result.result == "partial", result
    assert [(o.gpu, o.status) for o in result.gpus] == [(0, "faulty"), (1, "faulty")]


class _Hangs:
    """The daemon life's backend, except that ``method`` on GPU ``gpu`` hangs in the driver
    once armed (at once, or by the first call of ``arm_on`` on that GPU), on the life's
    clock (:meth:`ReadClock.hang`) till let go of, and calls ``on_hang`` as it starts to hang
    (telemetry's tick finding the GPU hung)."""

    def __init__(
        self,
        d: Daemon,
        gpu: int,
        method: str,
        *,
        arm_on: str | None = None,
        on_hang: Callable[[], None] = lambda: None,
    ) -> None:
        self._backend, self.clock, self._gpu, self._method = d.backend, d.clock, gpu, method
        self._arm_on, self._on_hang = arm_on, on_hang
        self.armed = arm_on is None
        self.hanging = threading.Event()
        self.returned = threading.Event()

    def __getattr__(self, name: str) -> object:
        real = getattr(self._backend, name)
        if name not in (self._method, self._arm_on):
            return real

        def call(gpu: int, *args: object) -> object:
            if gpu == self._gpu and name == self._arm_on:
                self.armed = True
            elif gpu == self._gpu and self.armed:
                self.hanging.set()
                self._on_hang()
                self.clock.hang(gpu)
                self.returned.set()
            return real(gpu, *args)

        return call


def _hanging(host: Host, d: Daemon, hang: _Hangs) -> MigManager:
    return MigManager(
        hang,  # type: ignore[arg-type]
        d.store,
        d.events,
        job_resolver=host.jobs.get,
        monotonic=d.clock.monotonic,
        sleep=d.clock.advance,
        read_wait=d.clock.read_wait,
        faults=lambda: host.faults,
        read_timeout_s=host.read_timeout_s,
    )


def _let_go(mig: MigManager, hang: _Hangs) -> None:
    """The hung call returns; the read left behind on its thread ends."""
    hang.clock.let_go()
    assert hang.returned.is_set()
    assert not mig._stuck


def test_a_gpu_found_not_answering_while_its_own_change_runs_is_changed_not_half_made(
    host: Host, config: MigConfigFile
) -> None:
    """Telemetry's sample of GPU 0 waits behind the apply's own driver changes and finds it
    "not answering"; the driver answers the apply's reads of it all the same: the apply
    finishes its layout rather than calling it faulty half made."""
    d = enable(host, config, "all-1g.10gb")
    d.mig._on_change = lambda gpu: host.faults.update({gpu: "not answering: ..."})
    result = d.mig.apply(config, "all-3g.40gb")
    assert result.result == "success", result
    assert [(o.gpu, o.status) for o in result.gpus] == [(0, "changed"), (1, "changed")]
    host.faults.clear()
    assert d.mig.assert_config(config, "all-3g.40gb") == []


def test_a_gpu_that_hangs_once_its_change_has_begun_is_given_up_on_at_the_read_deadline(
    host: Host, config: MigConfigFile
) -> None:
    """GPU 1 hangs after its first step and telemetry finds it so: the re-read after its
    steps is given up on at ``read_timeout_s`` (not at telemetry's verdict, which its own
    change may have caused), and it is faulty with the steps it took."""
    host.read_timeout_s = 0.3
    d = enable(host, config, "all-1g.10gb")
    hang = _Hangs(
        d,
        1,
        "mig_mode",
        arm_on="destroy_compute_instance",
        on_hang=lambda: host.faults.update({1: "not answering: ..."}),
    )
    mig = _hanging(host, d, hang)
    result = mig.apply(config, "all-3g.40gb")
    assert hang.hanging.is_set() and not hang.returned.is_set()  # still in the driver
    assert result.result == "partial", result
    outcomes = {o.gpu: o for o in result.gpus}
    assert outcomes[0].status == "changed"
    assert outcomes[1].status == "faulty" and outcomes[1].steps
    assert "not answering: no answer from the driver within 0.3 s" in outcomes[1].detail
    host.faults.clear()
    _let_go(mig, hang)


def test_an_apply_stops_waiting_on_a_process_list_once_telemetry_finds_the_gpu_hung(
    host: Host, config: MigConfigFile
) -> None:
    """A GPU that hangs after its plan was read, in the busy check's process listing: it is
    faulty with telemetry's reason and the other GPU is applied, without waiting for the
    listing (nor for ``read_timeout_s``)."""
    d = enable(host, config, "all-1g.10gb")
    before = instances(d)
    hang = _Hangs(d, 1, "processes", on_hang=lambda: host.faults.update({1: "not answering: ..."}))
    mig = _hanging(host, d, hang)
    result = mig.apply(config, "all-3g.40gb", options=ApplyOptions(drain=True, timeout_s=30))
    assert hang.hanging.is_set() and not hang.returned.is_set()  # still in the driver
    assert result.result == "partial", result
    outcomes = {o.gpu: o for o in result.gpus}
    assert outcomes[0].status == "changed"
    assert outcomes[1].status == "faulty" and outcomes[1].detail.endswith("not answering: ...")
    host.faults.clear()
    _let_go(mig, hang)
    assert instances(d)[1] == before[1]


def test_an_apply_never_waits_on_the_read_before_a_gpus_steps_past_its_deadline(
    host: Host, config: MigConfigFile
) -> None:
    """A GPU that hangs between its busy check and its steps: the read of its state before
    the steps is waited for no longer than ``read_timeout_s``, and no step is run on it."""
    host.read_timeout_s = 0.3
    d = enable(host, config, "all-1g.10gb")
    before = instances(d)
    hang = _Hangs(d, 1, "mig_mode", arm_on="processes")  # hangs after the busy check
    mig = _hanging(host, d, hang)
    result = mig.apply(config, "all-3g.40gb")
    assert hang.hanging.is_set() and not hang.returned.is_set()
    assert result.result == "partial", result
    outcomes = {o.gpu: o for o in result.gpus}
    assert outcomes[0].status == "changed"
    assert outcomes[1].status == "faulty"
    assert "not answering: no answer from the driver within 0.3 s" in outcomes[1].detail
    assert outcomes[1].steps == ()
    _let_go(mig, hang)
    assert instances(d)[1] == before[1]


def test_show_stops_waiting_on_a_gpu_once_telemetry_finds_it_hung(
    host: Host, config: MigConfigFile
) -> None:
    """``mig show`` waits for a hung GPU no longer than telemetry takes to find it hung,
    however long its own deadline is."""
    d = enable(host, config, "all-1g.10gb")
    hang = _Hangs(d, 1, "gpu_instances", on_hang=lambda: host.faults.update({1: "hung: ..."}))
    mig = _hanging(host, d, hang)
    views = mig.show(timeout_s=30.0)
    assert hang.hanging.is_set() and not hang.returned.is_set()
    assert views[0].fault == "" and views[1].fault == "hung: ..."
    host.faults.clear()
    _let_go(mig, hang)


def test_reconcile_stops_waiting_on_a_gpu_once_telemetry_finds_it_hung(
    host: Host, config: MigConfigFile
) -> None:
    """The daemon's reconcile step (and the watchdog behind it) waits for a hung GPU no
    longer than telemetry takes to find it hung, however long its own deadline is."""
    d = enable(host, config, "all-1g.10gb")
    hang = _Hangs(d, 1, "gpu_instances", on_hang=lambda: host.faults.update({1: "hung: ..."}))
    mig = _hanging(host, d, hang)
    mig.VIEW_TIMEOUT_S = 30.0
    outcomes = {o.gpu: o for o in mig.reconcile()}
    assert hang.hanging.is_set() and not hang.returned.is_set()
    assert outcomes[0].status == "ok"
    assert outcomes[1].status == "faulty" and "hung: ..." in outcomes[1].detail
    host.faults.clear()
    _let_go(mig, hang)


def test_assert_stops_waiting_on_a_gpu_once_telemetry_finds_it_hung(
    host: Host, config: MigConfigFile
) -> None:
    """``mig assert`` waits for a GPU that hangs before telemetry notices no longer than
    telemetry takes to find it hung: that GPU is not checked (faulty, with telemetry's
    reason) and the other is."""
    host.read_timeout_s = 30.0
    d = enable(host, config, "all-1g.10gb")
    hang = _Hangs(d, 1, "gpu_instances", on_hang=lambda: host.faults.update({1: "hung: ..."}))
    mig = _hanging(host, d, hang)
    diff, faulty = mig.check(config, "all-3g.40gb")
    assert hang.hanging.is_set() and not hang.returned.is_set()  # still in the driver
    assert [line.startswith("GPU 0") for line in diff] == [True], diff
    assert faulty == {1: "hung: ..."}
    host.faults.clear()
    # the read left behind keeps the GPU from further calls until it returns
    assert mig.check(config, "all-3g.40gb")[1] == {1: NOT_ANSWERING}
    _let_go(mig, hang)
    diff, faulty = mig.check(config, "all-3g.40gb")
    assert len(diff) == 2 and faulty == {}


@pytest.mark.parametrize(
    ("timeout_s", "said"),
    [(0.01, "0.01 s"), (0.04, "0.04 s"), (0.3, "0.3 s"), (3600.0, "3600 s")],
)
def test_assert_never_waits_on_a_gpu_past_its_read_deadline(
    host: Host, config: MigConfigFile, timeout_s: float, said: str
) -> None:
    """Telemetry has not noticed the hang: the GPU is not checked once ``read_timeout_s``
    (telemetry.call_timeout_s) has passed on the clock the manager was given (an hour of it
    at no real time), and the deadline is said as a person reads it (a whole one whole)."""
    host.read_timeout_s = timeout_s
    d = enable(host, config, "all-1g.10gb")
    hang = _Hangs(d, 1, "gpu_instances")
    mig = _hanging(host, d, hang)
    diff, faulty = mig.check(config, "all-1g.10gb")
    assert hang.hanging.is_set() and not hang.returned.is_set()
    assert diff == [] and d.clock.now == pytest.approx(timeout_s)
    assert faulty == {1: f"not answering: no answer from the driver within {said}"}
    assert mig.check(config, "all-1g.10gb")[1] == {1: NOT_ANSWERING}
    _let_go(mig, hang)


def test_metrics_before_the_first_reconcile_never_wait_on_a_hung_gpu(
    host: Host, config: MigConfigFile
) -> None:
    """A scrape before the first reconcile reads the GPUs itself (``latest_view``): a GPU
    that hangs is waited for no longer than ``read_timeout_s``, and the others are shown."""
    host.read_timeout_s = 0.3
    d = enable(host, config, "all-1g.10gb")
    hang = _Hangs(d, 1, "gpu_instances")
    mig = _hanging(host, d, hang)
    views = mig.latest_view()
    assert hang.hanging.is_set() and not hang.returned.is_set()
    assert views[0].fault == "" and len(views[0].instances) == 7
    assert views[1].fault == "not answering: no answer from the driver within 0.3 s"
    families = {f.name: f for f in MigMetrics(mig)()}
    gpus = {s.labels["gpu"] for s in families["gpud_mig_instance_info"].samples}
    assert gpus == {"0"}
    _let_go(mig, hang)


def test_a_config_matching_no_gpu_names_a_gpu_never_read_as_unknown(
    host: Host, config: MigConfigFile
) -> None:
    """A config none of whose entries matches refuses naming the node's GPUs: a GPU never
    read has no product or PCI device id to name, so it is named unknown with why."""
    first = enable(host, config, "all-3g.40gb")
    first.node.faults.lose(1)  # device state: still lost when the next daemon starts
    d = host.start()
    a100_on_0 = parse_config(
        'version: v1\nmig-configs:\n  x:\n    - device-filter: "0x20B010DE"\n'
        "      devices: [0]\n      mig-enabled: true\n      mig-devices: {1g.5gb: 7}\n",
        path="m.yaml",
    )
    refusals = []
    for attempt in (
        lambda: d.mig.apply(a100_on_0, "x"),
        lambda: d.mig.apply(a100_on_0, "x", dry_run=True),
        lambda: d.mig.check(a100_on_0, "x"),
    ):
        with pytest.raises(InvalidArgument) as err:
            attempt()
        refusals.append(str(err.value))
    message = refusals[0]
    assert "GPU 0 (H100-SXM5-80GB, 0x233010DE)" in message, message
    assert "GPU 1 (unknown, never read: identity: GPU lost" in message, message
    assert "0x0000" not in message and "(," not in message
    assert refusals == [message] * 3


def _refusing_manager(host: Host, code: int, call: str, gpu: int) -> MigManager:
    node = SimNode(host.spec, state_file=host.tmp / "driver.json", proc_root=host.proc)
    d = host.start()
    return MigManager(
        NvmlBackend(Refusing(node.nvml, code, [call], [gpu]), uid=1000),
        d.store,
        d.events,
        job_resolver=host.jobs.get,
        monotonic=d.clock.monotonic,
        sleep=d.clock.advance,
        read_wait=d.clock.read_wait,
    )


def test_a_gpu_that_requires_a_reset_is_faulty_and_left_alone_the_others_applied(
    host: Host, config: MigConfigFile
) -> None:
    mig = _refusing_manager(
        host,
        fakenvml.NVML_ERROR_RESET_REQUIRED,
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        1,
    )
    result = mig.apply(config, "all-balanced")
    assert result.result == "partial", result
    outcomes = {o.gpu: o for o in result.gpus}
    assert outcomes[0].status == "changed"
    assert outcomes[1].status == "faulty", outcomes[1]
    assert outcomes[1].detail.startswith("GPU 1")
    assert "is faulty: reset required: " in outcomes[1].detail
    assert "nvidia-smi --gpu-reset -i 1" in outcomes[1].detail


def test_a_mig_change_refused_for_permission_fails_naming_the_gpu(
    host: Host, config: MigConfigFile
) -> None:
    mig = _refusing_manager(
        host,
        fakenvml.NVML_ERROR_NO_PERMISSION,
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        1,
    )
    result = mig.apply(config, "all-balanced")
    outcomes = {o.gpu: o for o in result.gpus}
    assert outcomes[0].status == "changed"
    assert outcomes[1].status == "failed", outcomes[1]
    assert outcomes[1].detail.startswith("GPU 1")
    assert "Insufficient Permissions: not permitted (gpud runs as uid 1000)" in outcomes[1].detail
    assert "MIG changes to root only; run gpud as root" in outcomes[1].detail


def test_mig_show_shows_a_gpu_whose_mig_devices_need_a_reset_as_faulty(
    host: Host, config: MigConfigFile
) -> None:
    """A GPU whose MIG devices answer RESET_REQUIRED before telemetry says so is shown as
    faulty, with why, not as instances whose memory is merely unknown."""
    enable(host, config, "all-1g.10gb")
    node = SimNode(host.spec, state_file=host.tmp / "driver.json", proc_root=host.proc)
    refusing = Refusing(node.nvml, 0, ["nvmlDeviceGetMemoryInfo"])
    d = host.start()
    mig = MigManager(NvmlBackend(refusing), d.store, d.events, sleep=lambda s: None)
    assert [v.fault for v in mig.show()] == ["", ""]  # identities and tables known
    refusing.code = fakenvml.NVML_ERROR_RESET_REQUIRED
    views = mig.show()
    assert [v.instances for v in views] == [(), ()]
    assert all(v.fault.startswith("reset required: ") for v in views), views
    assert "nvidia-smi --gpu-reset -i 0" in views[0].fault


def test_an_instance_whose_mps_daemon_would_not_stop_is_not_destroyed(
    host: Host, config: MigConfigFile
) -> None:
    """The MPS control daemons of the MIG devices a relayout destroys are stopped first; one
    that would not stop (stuck in the driver) keeps its GPU as it is: the apply fails,
    naming the device, and no step is taken there."""
    before = instances(enable(host, config, "all-1g.10gb"))
    asked: list[list[str]] = []
    stuck_uuid = ""

    @contextlib.contextmanager
    def release(uuids: list[str]) -> Iterator[dict[str, str]]:
        asked.append(uuids)
        yield {u: f"the MPS control daemon of {u} (pid 4242) would not stop" for u in uuids[:1]}

    host.release = release
    d = host.start()
    result = d.mig.apply(config, "all-3g.40gb")
    assert result.result == "failed"
    assert [len(a) for a in asked] == [7, 7]  # every MIG device of each GPU, before any step
    for o, uuids in zip(result.gpus, asked, strict=True):
        stuck_uuid = uuids[0]
        assert o.status == "failed" and not o.steps
        assert f"{stuck_uuid} (pid 4242) would not stop" in o.detail
        assert "not destroyed" in o.detail
    assert instances(d) == before
    (event,) = d.events.recent(kind_prefix="mig.apply")
    assert stuck_uuid in event.message

    @contextlib.contextmanager
    def stopped(uuids: list[str]) -> Iterator[dict[str, str]]:
        yield {}

    host.release = stopped
    assert host.start().mig.apply(config, "all-3g.40gb").result == "success"


def test_enabling_mig_stops_the_whole_gpu_mps_daemon_first(
    host: Host, config: MigConfigFile
) -> None:
    """A GPU's MPS control daemon holds it, and the driver enables MIG mode only on a GPU no
    process holds: an apply that enables MIG stops the GPU's daemon before any step; one
    that would not stop leaves the GPU as it is (failed, naming the daemon, no step), and
    MIG is enabled once it has gone. Disabling MIG stops every MIG device's daemon."""
    asked: list[list[str]] = []

    @contextlib.contextmanager
    def release(uuids: list[str]) -> Iterator[dict[str, str]]:
        asked.append(uuids)
        yield {u: f"the MPS control daemon of GPU ({u}, pid 4242) would not stop" for u in uuids}

    host.release = release
    d = host.start()
    gpus = [d.backend.identity(i).uuid for i in range(2)]
    result = d.mig.apply(config, "all-3g.40gb")
    assert result.result == "failed"
    assert asked == [[gpus[0]], [gpus[1]]]
    for o, uuid in zip(result.gpus, gpus, strict=True):
        assert o.status == "failed" and not o.steps, o
        assert f"({uuid}, pid 4242) would not stop" in o.detail
        assert "MIG mode is not enabled under it" in o.detail
    assert not any(d.backend.mig_mode(i).current for i in range(2))

    asked.clear()
    host.release = _recording(asked)
    d = host.start()
    assert d.mig.apply(config, "all-3g.40gb").result == "success"
    assert [a for a in asked if a] == [[gpus[0]], [gpus[1]]]  # then each GPU's instances
    asked.clear()
    migs = [[md.uuid for md in d.backend.mig_devices(i)] for i in range(2)]
    assert d.mig.apply(config, "all-disabled").result == "success"
    assert [sorted(a) for a in asked if a] == [sorted(m) for m in migs]


def test_a_pending_mig_enable_leaves_the_whole_gpu_mps_daemon_running(
    a100: Host, config: MigConfigFile
) -> None:
    """On an A100 ``-mig 1`` only makes the change pending (the driver takes it whatever holds
    the GPU): an apply that leaves it for the next reset (``skip_reset``) keeps the GPU's MPS
    daemon; one that resets the GPU stops it first (the reset makes MIG mode current)."""
    asked: list[list[str]] = []
    a100.release = _recording(asked)
    d = a100.start(resets=True)
    gpus = [d.backend.identity(i).uuid for i in range(2)]
    pending = d.mig.apply(config, "all-balanced", options=ApplyOptions(skip_reset=True))
    assert pending.result == "reset_pending"
    assert not [a for a in asked if a]
    assert d.mig.apply(config, "all-balanced").result == "success"
    assert [a for a in asked if a][:2] == [[gpus[0]], [gpus[1]]]


def test_a_failed_apply_finished_by_its_retries_is_not_said_finished_after_a_restart(
    host: Host, config: MigConfigFile
) -> None:
    """An apply that failed, finished by the reconcile step's retries in the same gpud run:
    its mig.apply event says so (no restart happened), and gpud_mig_apply_total, which
    counted it failed, does not count it again as resumed."""
    d, pid = _busy_setup(host, config)
    assert d.mig.apply(config, "all-3g.40gb", options=ApplyOptions(force=True)).result == "failed"
    d.node.workloads.stop(pid)
    assert "changed" in {o.status for o in d.mig.reconcile()}
    last = d.events.recent(kind_prefix="mig.apply")[-1]
    assert last.fields["result"] == "retried"
    assert (
        last.message
        == "apply all-3g.40gb: finished by the reconcile step's retries after it failed"
    )
    totals = d.mig.stats.snapshot()[0]
    assert totals["failed"] == 1 and totals["resumed"] == 0
    assert sum(totals.values()) == 2  # and the setup's apply


def _recording(asked: list[list[str]]) -> Release:
    """An MPS release that stops every daemon it is asked to, noting the UUIDs asked."""

    @contextlib.contextmanager
    def release(uuids: list[str]) -> Iterator[dict[str, str]]:
        asked.append(uuids)
        yield {}

    return release


def test_a_forced_retry_leaves_the_mps_daemons_of_busy_instances_alone(
    host: Host, config: MigConfigFile
) -> None:
    """A forced apply the driver refused (a job's process on an instance it destroys) is
    retried on every tick; the retries stop no MPS daemon of that GPU while the process
    runs (the driver would refuse again, and the job's daemon would be stopped and started
    again on every tick): the GPU is reported busy, naming the process, and the retry that
    finds it gone stops the daemons and finishes the layout."""
    d, pid = _busy_setup(host, config)
    asked: list[list[str]] = []
    host.release = _recording(asked)
    d = host.start()
    result = d.mig.apply(config, "all-3g.40gb", options=ApplyOptions(force=True))
    assert [o.status for o in result.gpus] == ["failed", "changed"]
    assert [len(a) for a in asked] == [7, 7]  # the forced apply itself: as asked
    for _ in range(3):
        (gpu0, _gpu1) = d.mig.reconcile()
        assert gpu0.status == "busy" and not gpu0.steps
        # each process named as a refusal names it
        assert re.fullmatch(
            r"GPU 0 \(H100-SXM5-80GB\) 1g\.10gb GPU instance \d+ \(MIG-[^)]+\): "
            rf"pid {pid} \(job train-a\): the forced apply waits for it to leave what it"
            " destroys; the MPS control daemons there are left running until then"
            r" \(reconcile tries again\)",
            gpu0.detail,
        ), gpu0.detail
    assert len(asked) == 2  # no daemon stopped by the retries
    drift = [e.message for e in d.events.recent(kind_prefix="mig.drift")]
    assert drift == [gpu0.detail]
    d.node.workloads.stop(pid)
    assert [o.status for o in d.mig.reconcile()] == ["changed", "ok"]
    assert [len(a) for a in asked] == [7, 7, 7]
    assert d.mig.assert_config(config, "all-3g.40gb") == []


def test_a_forced_retry_with_mps_off_goes_ahead_as_forced(
    host: Host, config: MigConfigFile
) -> None:
    """With MPS off there is no control daemon to keep: a forced apply the driver refused
    is retried as forced (no process listed, nothing read for MPS), failing while the
    driver refuses, and never says MPS daemons are left running."""
    d, pid = _busy_setup(host, config)
    asked: list[list[str]] = []
    host.release = _recording(asked)
    host.release_active = lambda: False
    d = host.start()
    result = d.mig.apply(config, "all-3g.40gb", options=ApplyOptions(force=True))
    assert [o.status for o in result.gpus] == ["failed", "changed"]
    for _ in range(2):
        (gpu0, _gpu1) = d.mig.reconcile()
        assert gpu0.status == "failed" and "in use" in gpu0.detail.lower(), gpu0
        assert "MPS" not in gpu0.detail
    assert all(a == [] for a in asked)  # no MIG device read for a daemon to stop
    assert not any("MPS" in e.message for e in d.events.recent(kind_prefix="mig."))
    d.node.workloads.stop(pid)
    assert [o.status for o in d.mig.reconcile()] == ["changed", "ok"]
    assert d.mig.assert_config(config, "all-3g.40gb") == []


class _CountsMigLists:
    """The backend, counting its MIG device lists (``nvidia-smi -L``, one per GPU) and its
    compute instance profile reads (``-lcip``)."""

    def __init__(self, backend: NvmlBackend) -> None:
        self._backend = backend
        self.lists = 0
        self.ci_reads = 0

    def mig_devices(self, gpu: int) -> Any:
        self.lists += 1
        return self._backend.mig_devices(gpu)

    def compute_instance_profiles(self, gpu: int, profile_id: int) -> Any:
        self.ci_reads += 1
        return self._backend.compute_instance_profiles(gpu, profile_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def _drift_reconciled(host: Host, config: MigConfigFile, other_state: Path) -> int:
    """Both GPUs changed behind gpud's back, then reconciled: the MIG device lists made."""
    d = enable(host, config, "all-3g.40gb")
    other = MigManager(d.backend, StateStore(other_state), EventLog(None))
    assert other.apply(config, "all-1g.10gb").result == "success"
    again, counting = _counted_start(host)
    assert {o.status for o in again.mig.reconcile()} == {"changed"}
    assert again.mig.assert_config(config, "all-3g.40gb") == []
    return counting.lists


def _counted_start(host: Host) -> tuple[Daemon, _CountsMigLists]:
    """A daemon life whose manager's backend counts its reads."""
    counting: list[_CountsMigLists] = []

    def wrap(backend: NvmlBackend) -> _CountsMigLists:
        counting.append(_CountsMigLists(backend))
        return counting[-1]

    host.wrap = wrap
    return host.start(), counting[0]


def test_what_a_reconcile_destroys_is_listed_once_for_the_busy_check_and_mps(
    tmp_path: Path, config: MigConfigFile
) -> None:
    """The MIG devices a reconcile destroys are read from the driver once per round: the
    busy check's list is the one whose MPS daemons are stopped."""
    plain = Host(tmp_path / "plain", [(H100, 2)])
    released = Host(tmp_path / "released", [(H100, 2)])
    asked: list[list[str]] = []

    @contextlib.contextmanager
    def stop(uuids: list[str]) -> Iterator[dict[str, str]]:
        asked.append(uuids)
        yield {}

    released.release = stop
    try:
        without = _drift_reconciled(plain, config, tmp_path / "other1")
        assert _drift_reconciled(released, config, tmp_path / "other2") == without
        assert [len(a) for a in asked if a][-2:] == [7, 7]
    finally:
        plain.close()
        released.close()


MIG_OFF = parse_config(
    "version: v1\nmig-configs:\n  mig-off:\n    - devices: all\n      mig-enabled: false\n"
)


def test_an_interrupted_apply_left_with_only_the_gpu_reset_is_resumed(a100: Host) -> None:
    """An A100 whose MIG-off waits for a reset (an earlier apply with skip_reset): an apply
    with resets allowed plans no steps but the reset. gpud killed during that reset: the
    next start resumes it (the reset made, the apply counted as resumed)."""
    d = a100.start(resets=True)
    assert d.mig.apply(HELD_OUT, "custom-balanced").result == "success"
    skip = ApplyOptions(skip_reset=True)
    assert d.mig.apply(MIG_OFF, "mig-off", options=skip).result == "reset_pending"
    assert d.backend.mig_mode(0) == (True, False)
    desired = d.mig._store.desired()
    # what a kill during the reset of the apply with resets allowed leaves
    d.mig._store.begin_apply(
        "mig-off", {u: (r.gpu_index, r.layout) for u, r in desired.items()}, [], ApplyOptions(), 0.0
    )
    again = a100.start(resets=True)
    again.mig.reconcile()
    kinds = [e.kind for e in again.events.recent()]
    assert {"mig.resume", "mig.reset", "mig.apply"} <= set(kinds), kinds
    assert [e.fields["result"] for e in again.events.recent(kind_prefix="mig.apply")] == ["resumed"]
    assert all(again.backend.mig_mode(g) == (False, False) for g in (0, 1))
    assert again.mig._store.inflight() is None


def test_a_failed_apply_with_only_the_gpu_reset_is_retried(a100: Host) -> None:
    """A pending MIG-off whose reset the driver refused (a process held the GPU): the apply
    failed with no steps but the reset; later ticks retry it until the reset is made."""
    d = a100.start(resets=True)
    assert d.mig.apply(HELD_OUT, "custom-balanced").result == "success"
    skip = ApplyOptions(skip_reset=True)
    assert d.mig.apply(MIG_OFF, "mig-off", options=skip).result == "reset_pending"
    held = [0]  # a client holds GPU 0 open (nvidia-smi: "In use by another client")

    def reset(gpu: int) -> None:
        if gpu in held:
            raise InUse(f"GPU {gpu} cannot be reset: in use by another client", gpu=gpu)
        d.node.reset(gpu)

    d.backend._reset = reset
    result = d.mig.apply(MIG_OFF, "mig-off")
    assert result.result == "failed", result
    d.mig.reconcile()
    assert "mig.retry" in [e.kind for e in d.events.recent()]
    held.clear()
    d.mig.reconcile()
    assert all(d.backend.mig_mode(g) == (False, False) for g in (0, 1))
    assert d.mig._store.inflight() is None


def test_an_apply_with_nothing_to_do_records_no_plan(host: Host, config: MigConfigFile) -> None:
    """An apply of the layouts already in place records them with no plan to resume: a kill
    before it answers leaves nothing for the next start to resume or count."""
    d = host.start()
    assert d.mig.apply(config, "all-balanced").result == "success"
    seen = []

    def faults() -> dict[int, str]:  # read after the plan is recorded, for each GPU
        seen.append(d.mig._store.inflight())
        return {}

    d.mig._faults = faults
    assert d.mig.apply(config, "all-balanced").result == "noop"
    assert seen and seen == [None] * len(seen)


@pytest.mark.parametrize("options", [ApplyOptions(), ApplyOptions(skip_reset=True)])
def test_a_recorded_plan_with_no_steps_and_no_reset_pending_is_dropped_not_resumed(
    host: Host, config: MigConfigFile, options: ApplyOptions, caplog: pytest.LogCaptureFixture
) -> None:
    """The plan an earlier gpud recorded for an apply with nothing to do (no step, no GPU
    reset pending), left in flight by a kill: the next start drops it, saying so once,
    instead of resuming it as "0/0 steps" and counting a resumed apply."""
    d = host.start()
    assert d.mig.apply(config, "all-balanced").result == "success"
    desired = d.mig._store.desired()
    layouts = {u: (r.gpu_index, r.layout) for u, r in desired.items()}
    d.mig._store.begin_apply("all-balanced", layouts, [], options, 0.0)
    again = host.start()
    caplog.set_level("INFO", logger="gpud.mig.manager")
    again.mig.reconcile()
    again.mig.reconcile()
    assert again.mig._store.inflight() is None
    kinds = [e.kind for e in again.events.recent()]
    assert not {"mig.resume", "mig.apply"} & set(kinds), kinds
    assert again.mig.stats.snapshot()[0]["resumed"] == 0
    dropped = [r for r in caplog.records if "dropped the in-flight apply" in r.getMessage()]
    assert [r.levelname for r in dropped] == ["INFO"]


def test_a_recorded_plan_with_no_steps_is_kept_while_a_gpu_lost_before_start_is_unknown(
    a100: Host,
) -> None:
    """A plan with no steps whose resume would reset the GPUs (a MIG mode change pending on
    one of them) is kept while a GPU lost before this start, whose mode was never read, is
    faulty: the next start that reads it resumes the plan. With mig.on_start = "report" a
    plan with nothing to resume is reported, not dropped: report mode writes nothing."""
    first = a100.start(resets=True)
    assert first.mig.apply(HELD_OUT, "custom-balanced").result == "success"
    layouts = {u: (r.gpu_index, r.layout) for u, r in first.mig._store.desired().items()}
    first.mig._store.begin_apply("custom-balanced", layouts, [], ApplyOptions(), 0.0)
    first.node.faults.lose(1)  # device state: still lost when the next daemon starts
    lost = a100.start(resets=True)
    outcomes = {o.gpu: o.status for o in lost.mig.reconcile()}
    assert outcomes == {0: "ok", 1: "faulty"}
    assert lost.mig._store.inflight() is not None
    lost.node.faults.clear(1)
    report = a100.start(resets=True)
    report.mig.reconcile("report")
    assert report.mig._store.inflight() is not None
    back = a100.start(resets=True)
    assert {o.status for o in back.mig.reconcile()} == {"ok"}
    assert back.mig._store.inflight() is None


def test_an_incomplete_mig_table_is_not_read_again_every_pass(
    host: Host, config: MigConfigFile
) -> None:
    # 7 x 1g.10gb: the driver lists no compute instance profiles of the other GI profiles,
    # so the table is never complete
    enable(host, config, "all-1g.10gb")
    d, counting = _counted_start(host)
    assert {o.status for o in d.mig.reconcile()} == {"ok"}
    first = counting.ci_reads
    assert first > 0
    for _ in range(3):
        assert {o.status for o in d.mig.reconcile()} == {"ok"}
    assert counting.ci_reads == first
    d.sleep(INCOMPLETE_TABLE_S)  # the fake clock: then it is read again
    d.mig.reconcile()
    assert counting.ci_reads > first


def test_a_layout_is_not_forgotten_while_an_apply_runs(host: Host, config: MigConfigFile) -> None:
    """An apply in flight may record the very layout asked to be forgotten: forget is
    refused then, naming the apply, and the record stays."""
    record_replaced(enable(host, config, "all-1g.10gb"), 0.0)
    refusals: list[str] = []

    @contextlib.contextmanager
    def release(uuids: list[str]) -> Iterator[dict[str, str]]:
        with pytest.raises(FailedPrecondition) as refused:
            d.mig.forget("GPU-replaced")
        refusals.append(str(refused.value))
        yield {}

    host.release = release
    d = host.start()
    assert d.mig.apply(config, "all-3g.40gb").result == "success"
    assert refusals and all("an apply of all-3g.40gb is in flight" in r for r in refusals)
    assert d.mig.forget("GPU-replaced").config_name == "all-disabled"
    assert "GPU-replaced" not in d.mig.desired()


def layout_matches(d: Daemon, gpu: str) -> dict[str, float]:
    """GPU index ``gpu``'s gpud_mig_layout_matches series, by UUID."""
    return {
        s.labels["gpu_uuid"]: s.value
        for family in MigMetrics(d.mig)()
        if family.name == "gpud_mig_layout_matches"
        for s in family.samples
        if s.labels["gpu"] == gpu
    }


def test_the_layout_of_a_gpu_lost_since_before_start_is_kept_until_it_answers(
    host: Host, config: MigConfigFile
) -> None:
    """GPU 1 lost since before gpud started, its UUID never read: it may be the GPU any
    record of its index names, so forget refuses each, naming the GPU and why. Once it
    answers its UUID says which it is: the older record is then of a GPU not present, and
    can be forgotten; its own layout is still managed."""
    first = enable(host, config, "all-balanced")
    lost = first.mig.show()[1].identity.uuid
    record_replaced(first, first.mig.desired()[lost].updated_at - 60)
    host.last_seen = {1: seen(first, 1)}
    first.node.faults.lose(1)
    d = host.start()
    assert {o.uuid: o.status for o in d.mig.reconcile() if o.gpu == 1} == {
        lost: "faulty",
        "GPU-replaced": "faulty",
    }
    for uuid in (lost, "GPU-replaced"):
        with pytest.raises(FailedPrecondition) as refused:
            d.mig.forget(uuid)
        said = str(refused.value)
        assert said.startswith("GPU 1 is faulty (identity: GPU lost"), said
        assert said.endswith(
            f"), its UUID not read since gpud started: the layout recorded for {uuid} there is"
            " kept until it answers; forget it once another GPU answers at index 1"
        ), said
    assert set(d.mig.desired()) == {first.mig.show()[0].identity.uuid, lost, "GPU-replaced"}
    d.node.faults.clear(1)
    assert {o.uuid: o.status for o in d.mig.reconcile() if o.gpu == 1} == {
        lost: "ok",
        "GPU-replaced": "missing",
    }
    assert d.mig.forget("GPU-replaced").config_name == "all-disabled"
    assert d.mig.desired()[lost].config_name == "all-balanced"


class _Counts:
    """A backend whose driver counts ``count`` GPUs (the others gone from the bus)."""

    def __init__(self, backend: NvmlBackend, count: int) -> None:
        self._backend = backend
        self.count = count

    def gpu_count(self) -> int:
        return self.count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


@pytest.mark.parametrize("known_by", ["last-seen", "telemetry", "nothing"])
def test_a_gpu_gone_from_the_bus_where_one_was_known_keeps_its_layout(
    host: Host, config: MigConfigFile, known_by: str
) -> None:
    """After a restart the driver counts one GPU: GPU 1 fell off the bus. Where an earlier
    run or telemetry knew a GPU at index 1, it may come back: its record is left alone as
    faulty (no gpud_mig_layout_matches series) and forget refuses it. Where nothing knew
    one there, the record is of a GPU not present: missing, 0, and forgotten on request."""
    first = enable(host, config, "all-balanced")
    gone = first.mig.show()[1].identity
    if known_by == "last-seen":
        host.last_seen = {1: seen(first, 1)}
    elif known_by == "telemetry":
        host.read_identities = {1: gone}
    host.wrap = lambda b: _Counts(b, 1)
    d = host.start()
    (outcome,) = (o for o in d.mig.reconcile() if o.gpu == 1)
    if known_by == "nothing":
        assert (outcome.status, layout_matches(d, "1")) == ("missing", {gone.uuid: 0.0})
        assert d.mig.forget(gone.uuid).gpu_index == 1
        return
    assert outcome.status == "faulty", outcome
    assert "gone from the bus: the driver counts 1 GPU(s), none at index 1" in outcome.detail
    assert layout_matches(d, "1") == {}
    with pytest.raises(FailedPrecondition, match=r"^GPU 1 is faulty \(gone from the bus"):
        d.mig.forget(gone.uuid)
    assert gone.uuid in d.mig.desired()


def test_a_board_gone_from_the_bus_for_good_is_forgotten_with_gone(
    host: Host, config: MigConfigFile
) -> None:
    """GPU 1 fell off the bus and the driver now counts one GPU: a plain forget refuses its
    record, naming ``--gone``; ``gone`` drops it, says so in ``mig.forgotten``, and the
    reconcile step converges on the GPU left."""
    first = enable(host, config, "all-balanced")
    gone = first.mig.show()[1].identity
    host.last_seen = {1: seen(first, 1)}
    host.wrap = lambda b: _Counts(b, 1)
    d = host.start()
    with pytest.raises(FailedPrecondition) as refused:
        d.mig.forget(gone.uuid)
    assert str(refused.value).endswith("if the board is removed for good, forget it with --gone"), (
        refused.value
    )
    assert d.mig.forget(gone.uuid, gone=True).gpu_index == 1
    assert gone.uuid not in d.mig.desired()
    (event,) = d.events.recent(kind_prefix="mig.forgotten")
    assert (event.fields["gpu"], event.fields["gone"]) == (1, True), event
    assert [o.status for o in d.mig.reconcile()] == ["ok"]


def test_gone_is_refused_while_a_gpu_the_driver_counts_is_unread(
    host: Host, config: MigConfigFile
) -> None:
    """NVML numbers GPUs in PCI order: with the board at index 0 removed for good, the one
    recorded at index 1 is now GPU 0. Lost since before start, its UUID is unread, so
    nothing says it is not the board whose record ``gone`` would drop: refused, naming
    GPU 0, until it answers."""
    first = enable(host, config, "all-balanced")
    moved = first.mig.show()[1].identity.uuid
    host.last_seen = {1: seen(first, 1)}
    host.wrap = lambda b: _Counts(b, 1)
    first.node.faults.lose(0)
    d = host.start()
    with pytest.raises(FailedPrecondition) as refused:
        d.mig.forget(moved, gone=True)
    assert str(refused.value).startswith(
        "GPU 0 is faulty and unread: it may be this board at a new index;"
        " forget --gone once it answers"
    ), refused.value
    assert moved in d.mig.desired()
    assert d.events.recent(kind_prefix="mig.forgotten") == []


def test_gone_is_refused_for_a_gpu_lost_at_an_index_the_driver_still_counts(
    host: Host, config: MigConfigFile
) -> None:
    """A GPU lost since before start is still counted by the driver: it may answer again,
    so ``gone`` does not drop its layout."""
    first = enable(host, config, "all-balanced")
    lost = first.mig.show()[1].identity.uuid
    host.last_seen = {1: seen(first, 1)}
    first.node.faults.lose(1)
    d = host.start()
    with pytest.raises(FailedPrecondition, match=r"^--gone: the driver counts GPU 1 \(2 GPU"):
        d.mig.forget(lost, gone=True)
    assert lost in d.mig.desired()


def test_forget_waits_for_a_reconcile_step_that_holds_the_lock_for_a_moment(
    host: Host, config: MigConfigFile
) -> None:
    """A reconcile step holds the manager's lock for milliseconds each tick: a forget that
    comes meanwhile waits for it and is done, not refused as busy."""
    record_replaced(enable(host, config, "all-1g.10gb"), 0.0)
    d = host.start()
    inner = d.mig._lock
    held = threading.Event()
    asked = threading.Event()  # forget asked for the lock: the reconcile step ends

    def reconcile_step() -> None:
        with inner:
            held.set()
            asked.wait(timeout=10)

    class EndsWhenAsked:
        """The lock, let go by the step as forget asks for it: a forget that does not wait
        finds it still held."""

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            if not blocking:
                return inner.acquire(blocking=False)
            asked.set()
            return inner.acquire(timeout=timeout)

        def release(self) -> None:
            inner.release()

    step = threading.Thread(target=reconcile_step)
    step.start()
    held.wait(timeout=10)
    d.mig._lock = EndsWhenAsked()  # type: ignore[assignment]
    try:
        assert d.mig.forget("GPU-replaced").config_name == "all-disabled"
    finally:
        asked.set()
        step.join()


def test_forget_never_waits_behind_an_apply_that_began_after_its_check(
    host: Host, config: MigConfigFile
) -> None:
    """An apply that starts between forget's look for one in flight and its taking the
    manager's lock: forget is refused at once (an apply may hold the GPUs for minutes,
    past gpuctl's deadline), not run after it over what it recorded."""
    record_replaced(enable(host, config, "all-1g.10gb"), 0.0)
    inside = threading.Event()  # the apply holds the manager's lock
    answered = threading.Event()  # forget returned or raised

    @contextlib.contextmanager
    def release(uuids: list[str]) -> Iterator[dict[str, str]]:
        inside.set()
        # bounded only so that a forget waiting on the lock lets the test end (and fail)
        answered.wait(timeout=10)
        yield {}

    host.release = release
    d = host.start()
    applied: list[ApplyResult] = []
    apply = threading.Thread(target=lambda: applied.append(d.mig.apply(config, "all-3g.40gb")))
    forgetting = threading.get_ident()

    class ApplyAfterTheCheck:
        def __init__(self, lock: Any) -> None:
            self.lock = lock
            self.armed = True

        def __enter__(self) -> Any:
            return self.lock.__enter__()

        def __exit__(self, *exc: object) -> None:
            self.lock.__exit__(*exc)
            if self.armed and threading.get_ident() == forgetting:
                self.armed = False
                apply.start()
                inside.wait(timeout=10)

    d.mig._applying_lock = ApplyAfterTheCheck(d.mig._applying_lock)  # type: ignore[assignment]
    try:
        with pytest.raises(
            FailedPrecondition, match=r"^busy: an apply, a dry run or a reconcile runs"
        ):
            d.mig.forget("GPU-replaced")
    finally:
        answered.set()
        apply.join()
    assert [a.result for a in applied] == ["success"]
    assert d.mig.desired()["GPU-replaced"].config_name == "all-disabled"
