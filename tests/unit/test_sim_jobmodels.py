"""Workload models behind the jobs' host processes on the simulated node."""

from __future__ import annotations

import ctypes
import sys
import threading
from pathlib import Path

import pytest

from gpud.backend import products
from gpud.backend.sim import JobDevice, JobWorkloads, SimNode
from gpud.backend.sim.fakenvml import FakeNvml
from gpud.backend.sim.faults import FaultInjector
from gpud.backend.sim.jobmodels import ALONE_SM, DEFAULT_MEMORY, sm_activity, utilization
from gpud.backend.sim.workloads import Workloads, host_start
from gpud.errors import FailedPrecondition
from gpud.mps import procs as procfs

GIB = 1 << 30


class Procs:
    """A fake ``/proc``: stat (parent, start time) and environ per PID."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def add(
        self,
        pid: int,
        ppid: int,
        env: dict[str, str],
        *,
        comm: str = "python",
        state: str = "S",
    ) -> None:
        d = self.root / str(pid)
        d.mkdir(exist_ok=True)
        rest = [state, str(ppid)] + ["0"] * 17 + [str(1000 + pid)] + ["0"] * 10
        (d / "stat").write_text(f"{pid} ({comm}) {' '.join(rest)}\n")
        (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))

    def remove(self, pid: int) -> None:
        d = self.root / str(pid)
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


@pytest.fixture
def sim(tmp_path: Path) -> tuple[SimNode, Procs]:
    proc = tmp_path / "proc"
    proc.mkdir()
    node = SimNode([("H100-SXM5-80GB", 2)], proc_root=proc)
    node.nvml.nvmlInit()
    procs = Procs(proc)
    procs.add(1, 0, {"PATH": "/bin"}, comm="init")
    return node, procs


def listed(node: SimNode, gpu: int) -> dict[int, int]:
    nv = node.nvml
    handle = nv.nvmlDeviceGetHandleByIndex(gpu)
    return {p.pid: p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(handle)}


def util(node: SimNode, gpu: int) -> int:
    nv = node.nvml
    return int(nv.nvmlDeviceGetUtilizationRates(nv.nvmlDeviceGetHandleByIndex(gpu)).gpu)


def test_sm_activity_follows_kind_share_and_duty() -> None:
    assert sm_activity("training") == ALONE_SM["training"]
    assert sm_activity("training", 0.5) == pytest.approx(ALONE_SM["training"] / 2)
    assert sm_activity("training", 1.0, threads_percent=30) == pytest.approx(0.3)
    assert sm_activity("inference", 0.1) == ALONE_SM["inference"]  # the guard throttles training


def test_a_services_activity_follows_its_utilization() -> None:
    full = sm_activity("inference")
    assert utilization(50.0, 100.0) == 0.5
    assert sm_activity("inference", busy=utilization(50.0, 100.0)) == pytest.approx(full / 2)
    assert sm_activity("inference", busy=utilization(500.0, 100.0)) == full  # at most busy
    assert sm_activity("inference", 1.0, 20, utilization(50.0, 100.0)) == pytest.approx(0.1)
    assert utilization(0.0, 100.0) == 0.0 and utilization(float("nan"), 100.0) == 0.0
    assert utilization(50.0, None) == 1.0 and utilization(50.0, 0.0) == 1.0  # rate not known
    assert sm_activity("training", busy=0.1) == ALONE_SM["training"]  # training: its duty


def test_a_service_alone_at_half_load_shows_half_its_full_load_activity(
    sim: tuple[SimNode, Procs],
) -> None:
    node, procs = sim
    procs.add(200, 1, {"GPUD_JOB": "chat"})
    (m,) = node.jobs.sync([JobDevice("chat", "inference", 0, load=200.0, service_rate=400.0)])
    half = util(node, 0)
    assert m.sm_ratio == pytest.approx(ALONE_SM["inference"] / 2)
    assert abs(half - 100 * ALONE_SM["inference"] / 2) <= 5  # the reading wobbles by 4 points
    node.jobs.sync([JobDevice("chat", "inference", 0, load=400.0, service_rate=400.0)])
    assert abs(util(node, 0) - 100 * ALONE_SM["inference"]) <= 5
    memory = node.nvml.nvmlDeviceGetUtilizationRates(node.nvml.nvmlDeviceGetHandleByIndex(0))
    assert memory.memory > 0  # the memory controller follows the SMs
    node.jobs.sync([JobDevice("chat", "inference", 0, load=0.0, service_rate=400.0)])
    assert util(node, 0) == 0  # no requests: idle SMs


def test_job_processes_run_their_models_and_go_when_they_exit(
    sim: tuple[SimNode, Procs],
) -> None:
    node, procs = sim
    jobs: JobWorkloads = node.jobs
    procs.add(100, 1, {"HOME": "/root"}, comm="gpuctl")  # gpuctl run itself: no GPUD_JOB
    procs.add(101, 100, {"GPUD_JOB": "train", "CUDA_VISIBLE_DEVICES": "GPU-x"})
    procs.add(102, 101, {"GPUD_JOB": "train"})  # a data loader worker: the same tree
    procs.add(200, 1, {"GPUD_JOB": "chat"}, comm="serve (v2) x")
    procs.add(300, 1, {"GPUD_JOB": "unreserved"})
    devices = [
        JobDevice("train", "training", 0, memory_bytes=20 * GIB),
        JobDevice("chat", "inference", 0, load=100.0, service_rate=100.0),
    ]
    running = jobs.sync(devices)
    assert [(m.pid, m.job) for m in running] == [(101, "train"), (200, "chat")]
    assert listed(node, 0) == {101: 20 * GIB, 200: DEFAULT_MEMORY["inference"]}
    assert listed(node, 1) == {}
    busy = ALONE_SM["training"] + ALONE_SM["inference"]
    assert (
        abs(util(node, 0) - 100 * min(1.0, busy)) <= 5
    )  # the simulated reading wobbles by up to 4 points

    # The guard throttles the training: the same process keeps fewer SMs busy.
    devices[0] = JobDevice("train", "training", 0, memory_bytes=20 * GIB, duty=0.25)
    jobs.sync(devices)
    assert listed(node, 0)[101] == 20 * GIB
    expected = 100 * (ALONE_SM["training"] * 0.25 + ALONE_SM["inference"])
    assert abs(util(node, 0) - expected) <= 5  # the simulated reading wobbles by up to 4 points

    procs.remove(102)
    procs.remove(101)  # the training exits
    jobs.sync(devices)
    assert listed(node, 0) == {200: DEFAULT_MEMORY["inference"]}
    jobs.sync([])  # no reservation left
    assert listed(node, 0) == {} and util(node, 0) == 0


def test_a_reused_pid_is_looked_at_afresh(sim: tuple[SimNode, Procs]) -> None:
    node, procs = sim
    procs.add(50, 1, {"GPUD_JOB": "a"})
    node.jobs.sync([JobDevice("a", "training", 1)])
    assert 50 in listed(node, 1)
    procs.remove(50)
    procs.add(50, 1, {"OTHER": "1"})  # the PID again, another program (its own start time)
    (procs.root / "50" / "stat").write_text(
        (procs.root / "50" / "stat").read_text().replace("1050", "9999")
    )
    node.jobs.sync([JobDevice("a", "training", 1)])
    assert listed(node, 1) == {}


def test_a_process_seen_between_fork_and_exec_is_looked_at_again_after_exec(
    sim: tuple[SimNode, Procs],
) -> None:
    """``gpuctl run`` forks, then execs the job's command with ``GPUD_JOB`` set: a tick in
    between reads gpuctl's own environment under the child's PID and start time. The exec
    changes the name in ``/proc/<pid>/stat``, and the process is read again."""
    node, procs = sim
    procs.add(100, 1, {"HOME": "/root"}, comm="gpuctl")
    procs.add(101, 100, {"HOME": "/root"}, comm="gpuctl")  # forked, not yet exec'd
    devices = [JobDevice("a", "training", 0)]
    node.jobs.sync(devices)
    assert listed(node, 0) == {}
    procs.remove(101)
    procs.add(101, 100, {"GPUD_JOB": "a"}, comm="sleep")  # the same start time
    node.jobs.sync(devices)
    assert listed(node, 0) == {101: DEFAULT_MEMORY["training"]}


def test_memory_is_capped_by_the_device_and_mig_instances_are_used(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    node = SimNode([("H100-SXM5-80GB", 1)], proc_root=proc)
    nv = node.nvml
    nv.nvmlInit()
    gpu = nv.nvmlDeviceGetHandleByIndex(0)
    nv.nvmlDeviceSetMigMode(gpu, nv.NVML_DEVICE_MIG_ENABLE)
    node.reboot()
    info = nv.nvmlDeviceGetGpuInstanceProfileInfo(gpu, nv.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    placement = ctypes.byref(nv.c_nvmlGpuInstancePlacement_t(0, 1))
    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, info.id, placement)
    ci_info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, nv.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    )
    nv.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    uuid = nv.nvmlDeviceGetUUID(mig)
    total = nv.nvmlDeviceGetMemoryInfo(mig).total
    Procs(proc).add(7, 1, {"GPUD_JOB": "chat"})
    node.jobs.sync(
        [JobDevice("chat", "inference", 0, mig=uuid, memory_bytes=40 * GIB, memory_total=total)]
    )
    (p,) = nv.nvmlDeviceGetComputeRunningProcesses(mig)
    assert p.pid == 7 and p.usedGpuMemory == int(total * 0.9)


def test_a_job_of_a_whole_gpu_now_in_mig_mode_gets_no_process(tmp_path: Path) -> None:
    """A job placed on a whole GPU that has gone into MIG mode since: its process cannot
    run there (it needs a MIG device) and the models leave it out, as for a device that
    changed under the job, rather than failing the sync."""
    proc = tmp_path / "proc"
    proc.mkdir()
    node = SimNode([("H100-SXM5-80GB", 1)], proc_root=proc)
    nv = node.nvml
    nv.nvmlInit()
    nv.nvmlDeviceSetMigMode(nv.nvmlDeviceGetHandleByIndex(0), nv.NVML_DEVICE_MIG_ENABLE)
    node.reboot()
    Procs(proc).add(7, 1, {"GPUD_JOB": "a"})
    node.jobs.sync([JobDevice("a", "training", 0)])
    assert node.workloads.list() == []


def test_a_lost_gpu_shows_nothing_and_gets_no_new_process(sim: tuple[SimNode, Procs]) -> None:
    node, procs = sim
    procs.add(10, 1, {"GPUD_JOB": "a"})
    procs.add(20, 1, {"GPUD_JOB": "b"})
    node.jobs.sync([JobDevice("a", "training", 0)])
    node.faults.lose(0)
    node.jobs.sync([JobDevice("a", "training", 0), JobDevice("b", "training", 0)])
    nv = node.nvml
    with pytest.raises(nv.NVMLError_GpuIsLost):
        listed(node, 0)
    assert [m.pid for m in node.jobs.running()] == [10]  # b could not start on it
    node.faults.clear(0)
    node.jobs.sync([JobDevice("a", "training", 0), JobDevice("b", "training", 0)])
    assert set(listed(node, 0)) == {10, 20}


def test_a_reboot_clears_processes_and_the_next_sync_restarts_them(
    sim: tuple[SimNode, Procs],
) -> None:
    node, procs = sim
    procs.add(10, 1, {"GPUD_JOB": "a"})
    node.jobs.sync([JobDevice("a", "training", 1)])
    node.reboot()
    assert listed(node, 1) == {}
    node.jobs.sync([JobDevice("a", "training", 1)])
    assert set(listed(node, 1)) == {10}


def test_what_the_operator_declares_wins_over_the_model(sim: tuple[SimNode, Procs]) -> None:
    node, procs = sim
    procs.add(10, 1, {"GPUD_JOB": "a"})
    devices = [JobDevice("a", "training", 0)]
    node.jobs.sync(devices)
    assert listed(node, 0) == {10: DEFAULT_MEMORY["training"]}
    node.workloads.start(0, 10, 12 * GIB, 0.5)  # gpuctl sim workload start --pid 10 ...
    assert listed(node, 0) == {10: 12 * GIB}
    node.jobs.sync([JobDevice("a", "training", 0, duty=0.5)])
    assert listed(node, 0) == {10: 12 * GIB} and node.jobs.running() == []
    node.workloads.stop(10)  # the operator lets go: the model runs it again
    node.jobs.sync(devices)
    assert listed(node, 0) == {10: DEFAULT_MEMORY["training"]}


def test_a_job_on_two_gpus_runs_its_model_on_each(sim: tuple[SimNode, Procs]) -> None:
    """A training job holding GPUs 0 and 1, a service next to it on GPU 0: the training's
    process is listed on both GPUs, busy on both, all-reducing over NVLink on both; the
    guard's duty reaches both; it goes from both when it exits."""
    node, procs = sim
    procs.add(10, 1, {"GPUD_JOB": "train"})
    procs.add(20, 1, {"GPUD_JOB": "chat"})

    def devices(duty: float) -> list[JobDevice]:
        return [
            JobDevice("train", "training", 0, memory_bytes=20 * GIB, duty=duty),
            JobDevice("train", "training", 1, memory_bytes=20 * GIB, duty=duty),
            JobDevice("chat", "inference", 0, load=100.0, service_rate=100.0),
        ]

    running = node.jobs.sync(devices(1.0))
    assert [(m.pid, m.gpu) for m in running] == [(10, 0), (10, 1), (20, 0)]
    assert listed(node, 0) == {10: 20 * GIB, 20: DEFAULT_MEMORY["inference"]}
    assert listed(node, 1) == {10: 20 * GIB}
    train = 100 * ALONE_SM["training"]
    assert abs(util(node, 0) - 100 * min(1.0, ALONE_SM["training"] + ALONE_SM["inference"])) <= 5
    assert abs(util(node, 1) - train) <= 5  # the simulated reading wobbles by up to 4 points
    assert all(m.traffic.nvlink_tx > 0 for m in running if m.job == "train")

    node.jobs.sync(devices(0.5))  # the guard on GPU 0 halves the training's duty
    assert abs(util(node, 1) - train / 2) <= 5
    assert {(m.gpu, m.sm_ratio) for m in node.jobs.running() if m.job == "train"} == {
        (0, ALONE_SM["training"] / 2),
        (1, ALONE_SM["training"] / 2),
    }

    procs.remove(10)
    node.jobs.sync(devices(0.5))
    assert listed(node, 0) == {20: DEFAULT_MEMORY["inference"]}
    assert listed(node, 1) == {}


def test_the_operator_takes_a_multi_gpu_jobs_pid_over_on_every_gpu(
    sim: tuple[SimNode, Procs],
) -> None:
    node, procs = sim
    procs.add(10, 1, {"GPUD_JOB": "a"})
    devices = [JobDevice("a", "training", 0), JobDevice("a", "training", 1)]
    node.jobs.sync(devices)
    assert set(listed(node, 0)) == set(listed(node, 1)) == {10}
    node.workloads.start(0, 10, 12 * GIB, 0.5)  # gpuctl sim workload start --pid 10 ...
    node.jobs.sync(devices)
    assert listed(node, 0) == {10: 12 * GIB} and listed(node, 1) == {}
    assert node.jobs.running() == []
    node.workloads.stop(10)
    node.jobs.sync(devices)
    assert set(listed(node, 0)) == set(listed(node, 1)) == {10}


FAULTS = {
    "lost": ("has fallen off the bus (sim fault lost)", lambda n, g: n.faults.lose(g)),
    "reset_required": (
        "requires a reset (sim fault reset-required)",
        lambda n, g: n.faults.reset_required(g),
    ),
    "slow": (
        "hangs in every driver call (sim fault slow 0.001 s)",
        lambda n, g: n.faults.slow(g, 0.001),
    ),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_no_process_starts_on_a_gpu_that_is_lost_hung_or_requires_a_reset(
    sim: tuple[SimNode, Procs], fault: str
) -> None:
    node, procs = sim
    why, inject = FAULTS[fault]
    inject(node, 1)
    with pytest.raises(FailedPrecondition) as err:
        node.workloads.start(1, 4242, 8 * GIB, 0.5)  # gpuctl sim workload start --gpu 1 ...
    assert str(err.value) == f"GPU 1 {why}: no process starts on it"
    node.workloads.start(0, 4243, 8 * GIB, 0.5)  # GPU 0 has no fault
    # a job's model does not start there either, and its step does not fail
    procs.add(10, 1, {"GPUD_JOB": "a"})
    node.jobs.sync([JobDevice("a", "training", 1)])
    assert node.jobs.running() == []
    node.faults.clear(1)
    assert listed(node, 1) == {}  # nothing was started behind the fault
    assert listed(node, 0) == {4243: 8 * GIB}
    node.jobs.sync([JobDevice("a", "training", 1)])
    assert set(listed(node, 1)) == {10}


def test_a_refused_declaration_leaves_the_models_process_of_the_pid(
    sim: tuple[SimNode, Procs],
) -> None:
    node, procs = sim
    procs.add(10, 1, {"GPUD_JOB": "a"})
    node.jobs.sync([JobDevice("a", "training", 0)])
    node.faults.lose(1)
    with pytest.raises(FailedPrecondition):
        node.workloads.start(1, 10, 8 * GIB, 0.5)
    assert listed(node, 0) == {10: DEFAULT_MEMORY["training"]}
    assert [m.pid for m in node.jobs.running()] == [10]


class FaultInTheGap(FakeNvml):
    """A node where GPU 0 falls off the bus (from another thread, as ``gpuctl sim fault``
    does) as soon as a process is stopped: the injection waits for the node's lock, a
    little."""

    fault: threading.Thread

    def sim_stop_process(self, pid: int, gpu: int | None = None) -> bool:
        stopped = super().sim_stop_process(pid, gpu)
        fault = threading.Thread(target=FaultInjector(self).lose, args=(0,))
        fault.start()
        fault.join(0.3)
        self.fault = fault
        return stopped


def test_a_fault_during_a_declared_start_cannot_fall_between_its_check_and_the_start(
    tmp_path: Path,
) -> None:
    """The check of a GPU's faults, the takeover of the models' process of the PID and the
    declared start are one: a fault that comes on meanwhile waits, the declared process
    runs (and stays, as what ran before the fault does); never the models' process stopped
    and the start refused."""
    product = products.lookup("H100-SXM5-80GB")
    assert product is not None
    nvml = FaultInTheGap([product])
    nvml.nvmlInit()
    workloads = Workloads(nvml, proc_root=tmp_path)
    assert workloads.start_modelled(0, 10, 4 * GIB, 0.5, None)
    workloads.start(0, 10, 8 * GIB, 0.5)
    nvml.fault.join()
    assert nvml.sim_start_refusal(0) is not None  # the fault came on: after the start
    assert [(p.pid, p.used_bytes, p.declared) for p in nvml.sim_processes()] == [
        (10, 8 * GIB, True)
    ]


def test_a_declared_process_ends_when_its_host_process_exits(
    sim: tuple[SimNode, Procs],
) -> None:
    node, procs = sim
    procs.add(10, 1, {"PATH": "/bin"})
    procs.add(11, 1, {"PATH": "/bin"})
    assert node.workloads.start(0, 10, 16 * GIB, 0.5)  # a live host process: ends with it
    assert node.workloads.start(0, 11, 16 * GIB, 0.5)
    assert not node.workloads.start(0, 4242, 8 * GIB, 0.5)  # no host process: a made-up PID
    assert node.workloads.end_exited() == []
    procs.remove(10)
    procs.remove(11)
    procs.add(11, 1, {"PATH": "/bin"}, comm="other")  # the PID taken by another process...
    (procs.root / "11" / "stat").write_text(
        (procs.root / "11" / "stat").read_text().replace(" 1011 ", " 5011 ")  # ...later
    )
    assert [(w.pid, w.gpu) for w in node.workloads.end_exited()] == [(10, 0), (11, 0)]
    assert listed(node, 0) == {4242: 8 * GIB}


def test_a_declared_process_ends_when_its_host_process_is_a_zombie(
    sim: tuple[SimNode, Procs],
) -> None:
    """A host process that has exited but is not reaped yet (state Z) holds no GPU memory:
    its declared process ends; the host's start time is kept as the number procfs gives."""
    node, procs = sim
    procs.add(10, 1, {"PATH": "/bin"})
    node.workloads.start(0, 10, 16 * GIB, 0.5)
    assert [p.host for p in node.nvml.sim_processes()] == [1010]
    procs.add(10, 1, {"PATH": "/bin"}, state="Z")  # exited, its parent not told yet
    assert [w.pid for w in node.workloads.end_exited()] == [10]
    assert listed(node, 0) == {}


def test_a_declared_process_whose_host_process_exited_while_gpud_was_down_is_gone(
    tmp_path: Path,
) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    procs = Procs(proc)
    procs.add(10, 1, {"PATH": "/bin"})
    state = tmp_path / "node.json"
    node = SimNode([("H100-SXM5-80GB", 1)], proc_root=proc, state_file=state)
    node.workloads.start(0, 10, 16 * GIB, 0.5)
    node.workloads.start(0, 4242, 8 * GIB, 0.5)
    again = SimNode([("H100-SXM5-80GB", 1)], proc_root=proc, state_file=state)
    again.nvml.nvmlInit()
    assert listed(again, 0) == {10: 16 * GIB, 4242: 8 * GIB}  # 10 still runs
    procs.remove(10)
    third = SimNode([("H100-SXM5-80GB", 1)], proc_root=proc, state_file=state)
    third.nvml.nvmlInit()
    assert listed(third, 0) == {4242: 8 * GIB}


def test_a_host_process_that_exits_ends_only_its_own_declared_processes(
    sim: tuple[SimNode, Procs],
) -> None:
    """A PID declared on GPU 0 when no host process had it (it runs until stopped) and on
    GPU 1 once one does: the host process's exit ends the one on GPU 1 only (before, both
    went)."""
    node, procs = sim
    assert not node.workloads.start(0, 10, 8 * GIB, 0.5)
    procs.add(10, 1, {"PATH": "/bin"})
    assert node.workloads.start(1, 10, 16 * GIB, 0.5)
    procs.remove(10)
    assert [(w.pid, w.gpu) for w in node.workloads.end_exited()] == [(10, 1)]
    assert listed(node, 0) == {10: 8 * GIB}
    assert listed(node, 1) == {}


_COUNTING: list[list[str]] = []  # while a test counts: the stat files opened since


def _count_stat_opens(event: str, args: tuple[object, ...]) -> None:
    if event == "open" and _COUNTING and str(args[0]).endswith("/stat"):
        _COUNTING[-1].append(str(args[0]))


sys.addaudithook(_count_stat_opens)  # inert unless a test counts (hooks cannot be removed)


def test_a_declared_process_reads_its_host_process_stat_once(tmp_path: Path) -> None:
    """Whether a declared PID is a live host process and when it started come from one read
    of ``/proc/<pid>/stat`` (it was read twice, per declared process and tick)."""
    Procs(tmp_path).add(10, 1, {"PATH": "/bin"})
    _COUNTING.append([])
    try:
        assert host_start(tmp_path, 10) == 1010
        assert _COUNTING[-1] == [f"{tmp_path}/10/stat"]
    finally:
        _COUNTING.clear()
    Procs(tmp_path).add(10, 1, {"PATH": "/bin"}, state="Z")
    assert host_start(tmp_path, 10) is None


def test_stat_gives_the_name_whatever_it_holds_and_the_fields_after_it(tmp_path: Path) -> None:
    """``comm`` may hold spaces and parentheses: the fields start after its last ``)``."""
    Procs(tmp_path).add(10, 1, {"PATH": "/bin"}, comm="a) (b c")
    read = procfs.stat(10, tmp_path)
    assert read is not None
    comm, fields = read
    assert comm == "a) (b c" and fields[:2] == ["S", "1"]
    assert procfs.stat_fields(10, tmp_path) == fields
    assert procfs.start_time(10, tmp_path) == 1010
    assert procfs.stat(11, tmp_path) is None
    assert procfs.exited(["Z"]) and procfs.exited(["X"]) and not procfs.exited(["S"])
    assert not procfs.exited([])
