"""Workload models behind the jobs' processes on a simulated node (``gpud --simulate``).

On a real node the driver lists a process under ``nvidia-smi``'s "Processes" once it opens
a CUDA context, and the SMs it keeps busy show in the device's utilization. A simulated node
has no CUDA, so :class:`JobWorkloads` stands in for the driver: every daemon tick it finds
the host processes gpud launched for jobs (``GPUD_JOB`` in ``/proc/<pid>/environ``, as
``gpuctl run`` and ``gpuctl env`` set it; the top process of each job's tree) and runs a
simulated compute process for each one on every device the job holds (a job spanning
GPUs has a context on each, and the same PID in each one's process list), through
:class:`~gpud.backend.sim.workloads.Workloads`:

- memory: what the job declared per device (its MPS pinned-memory limit), else a per-kind
  default, never more than the device holds;
- SM activity: :func:`sm_activity` of the job's kind, MPS thread share and the duty cycle
  the co-location loop currently tells it (a throttled training job keeps the SMs busy
  only for its duty); an inference service's follows its utilization, the load the daemon
  measures over its service rate at its share (a service at half load keeps the SMs busy
  half as long as at full load); the memory controller's activity follows the SMs';
- PCIe and NVLink traffic: :func:`link_traffic` — training streams its input batches from
  host memory and, when it spans several GPUs, all-reduces its gradients over NVLink, both
  in step with its SM activity; inference moves each request's inputs in and its outputs
  out, at the request rate it reports;
- it appears in ``nvmlDeviceGetComputeRunningProcesses`` with the host PID, so attribution,
  ``gpuctl jobs`` and the co-location loop see it as on a real node, and it is gone at the
  next tick after the host process exits or the job's reservation is released.

A process the operator declared with ``gpuctl sim workload start`` is theirs: the models
leave it alone while it is declared.

Everything stays behind the NVML port: a lost GPU answers nothing (its processes included),
a reset is refused while processes run, and nothing is started on a GPU that is lost,
requires a reset or hangs (what ran there before the fault stays, as the device's state).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gpud.backend.sim.fakenvml import LinkTraffic
from gpud.backend.sim.workloads import Workloads
from gpud.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from gpud.mps import procs

log = logging.getLogger(__name__)

GIB: Final = 1 << 30
JOB_VAR: Final = b"GPUD_JOB="

# SM activity of a job alone on a whole GPU at full duty, or full load: a training step
# keeps the SMs nearly saturated; an inference service busy all the time runs smaller
# batches, with gaps for tokenizing and scheduling between them (what nvidia-smi shows for
# each in practice). A service at a lower load shows this times its utilization.
ALONE_SM: Final = {"training": 0.9, "inference": 0.7}
# Device memory a job uses when it declares none: weights, optimizer state and activations
# of a mid-size training job; weights and KV cache of a mid-size served model.
DEFAULT_MEMORY: Final = {"training": 16 * GIB, "inference": 8 * GIB}
DEVICE_MEMORY_CAP: Final = 0.9  # of the device: the CUDA context and allocator keep the rest
# Link traffic, bytes/s (NVML's PCIe RX is into the GPU, TX out of it). Training alone at
# full duty: decoded input batches from host memory (a ResNet-50 step of 256 images of
# 224x224x3 in fp16 is 77 MB, at about 25 steps/s), a little back (losses, metrics,
# checkpoint shards); a job on several GPUs all-reduces its gradients over NVLink, each way
# (a 1.3B-parameter fp16 model, 2(n-1)/n of its 2.6 GB per step at several steps/s).
TRAINING_PCIE_RX: Final = 2.0e9
TRAINING_PCIE_TX: Final = 0.1e9
TRAINING_NVLINK: Final = 40e9
# Inference: per request, its inputs in (an image, a prompt's tensors) and its outputs out.
REQUEST_BYTES: Final = 512 * 1024
RESPONSE_BYTES: Final = 64 * 1024


def utilization(load: float, service_rate: float | None) -> float:
    """An inference service's utilization: its load over its service rate (requests/s),
    at most 1; 1 (busy all the time) when its rate is not known yet, 0 without load."""
    if not load > 0.0:  # NaN included
        return 0.0
    if service_rate is None or not service_rate > 0.0:
        return 1.0
    return min(1.0, load / service_rate)


def sm_activity(
    kind: str, duty: float = 1.0, threads_percent: int | None = None, busy: float = 1.0
) -> float:
    """The fraction of a device's SMs a job keeps busy: its kind's activity alone, capped by
    its MPS active-thread share, times the duty cycle it runs at (training: the guard
    throttles training) or the fraction of time it is busy (inference: its
    :func:`utilization`, as it serves what it is sent)."""
    base = ALONE_SM.get(kind, ALONE_SM["training"])
    if threads_percent is not None:
        base = min(base, max(0, threads_percent) / 100.0)
    if kind == "training":
        base *= min(1.0, max(0.0, duty))
    else:
        base *= min(1.0, max(0.0, busy))
    return round(base, 4)


def link_traffic(
    kind: str,
    *,
    duty: float = 1.0,
    threads_percent: int | None = None,
    load: float = 0.0,
    gpus: int = 1,
) -> LinkTraffic:
    """What a job moves over PCIe and NVLink (see the constants): training in step with
    its SM activity (a share cap or a duty cycle slows its steps, and its data loading and
    all-reduce with them), NVLink only when it spans ``gpus`` > 1; inference ``load``
    requests/s of :data:`REQUEST_BYTES` in and :data:`RESPONSE_BYTES` out."""
    if kind == "inference":
        rate = max(0.0, load)
        return LinkTraffic(pcie_tx=rate * RESPONSE_BYTES, pcie_rx=rate * REQUEST_BYTES)
    pace = sm_activity("training", duty, threads_percent) / ALONE_SM["training"]
    nvlink = TRAINING_NVLINK * pace if gpus > 1 else 0.0
    return LinkTraffic(TRAINING_PCIE_TX * pace, TRAINING_PCIE_RX * pace, nvlink, nvlink)


@dataclass(frozen=True, slots=True)
class JobDevice:
    """A job's place on one device, as the daemon knows it from the reservation."""

    job: str
    kind: str  # "training" | "inference"
    gpu: int
    mig: str | None = None  # MIG device UUID, or None for the whole GPU
    memory_bytes: int | None = None  # declared; None: the kind's default
    memory_total: int = 0  # the device's memory (GPU or MIG instance); 0: unknown
    threads_percent: int | None = None
    duty: float = 1.0
    load: float = 0.0  # an inference service's request rate (its latency reports per second)
    # an inference service's rate (requests/s) at its share, as the daemon knows it; None:
    # not known yet (the model takes it as busy all the time)
    service_rate: float | None = None


@dataclass(frozen=True, slots=True)
class Modelled:
    """One simulated process: the host PID, where it runs, what it uses."""

    pid: int
    job: str
    gpu: int
    mig: str | None
    used_memory_bytes: int
    sm_ratio: float
    traffic: LinkTraffic


class JobWorkloads:
    """Keeps the simulated node's processes in step with the jobs' host processes."""

    def __init__(self, workloads: Workloads, *, proc_root: Path = Path("/proc")) -> None:
        self._workloads = workloads
        self._proc = proc_root
        self._lock = threading.Lock()
        self._running: dict[tuple[int, int], Modelled] = {}  # (pid, GPU)
        # (pid, identity) -> job name or None: environ is read once per program
        self._jobs_of: dict[tuple[int, str], str | None] = {}

    def running(self) -> list[Modelled]:
        with self._lock:
            return [self._running[k] for k in sorted(self._running)]

    def sync(self, devices: Sequence[JobDevice]) -> list[Modelled]:
        """Start, update or stop simulated processes so that each live job process runs the
        model of its job on every device in ``devices`` the job holds (one per GPU: of two
        MIG instances of one GPU, the first); returns what runs now."""
        by_job: dict[str, dict[int, JobDevice]] = {}
        for d in devices:
            by_job.setdefault(d.job, {}).setdefault(d.gpu, d)
        procs = self._job_processes(set(by_job)) if by_job else {}
        faulty = self._workloads.faulty_gpus()
        want: dict[tuple[int, int], Modelled] = {}
        for pid, job in procs.items():
            for d in by_job[job].values():
                key = (pid, d.gpu)
                if d.gpu in faulty:
                    # what ran there stays as it was (the device's state); nothing new
                    # starts: no CUDA context can be created on a GPU that fell off the
                    # bus, requires a reset or hangs
                    if (old := self._running.get(key)) is not None:
                        want[key] = old
                    continue
                memory = d.memory_bytes if d.memory_bytes is not None else DEFAULT_MEMORY[d.kind]
                if d.memory_total:
                    memory = min(memory, int(d.memory_total * DEVICE_MEMORY_CAP))
                want[key] = Modelled(
                    pid,
                    job,
                    d.gpu,
                    d.mig,
                    memory,
                    sm_activity(
                        d.kind, d.duty, d.threads_percent, utilization(d.load, d.service_rate)
                    ),
                    link_traffic(
                        d.kind,
                        duty=d.duty,
                        threads_percent=d.threads_percent,
                        load=d.load,
                        gpus=len(by_job[job]),
                    ),
                )
        with self._lock:
            ours = self._workloads.modelled()
            for key in set(self._running) - ours:
                # gone with a reboot (started again below), or the operator declared it
                del self._running[key]
            for key, m in list(self._running.items()):
                new = want.get(key)
                if new is None or new.mig != m.mig:
                    self._stop(m)
                elif new != m:
                    # a new duty cycle or limit: the same process, using more or less
                    self._workloads.update(
                        m.pid, m.gpu, new.used_memory_bytes, new.sm_ratio, new.traffic
                    )
                    self._running[key] = new
            for key, m in want.items():
                if key not in self._running:
                    self._start(m)
            return [self._running[k] for k in sorted(self._running)]

    def stop_all(self) -> None:
        with self._lock:
            for m in list(self._running.values()):
                self._stop(m)

    def _start(self, m: Modelled) -> None:
        try:
            started = self._workloads.start_modelled(
                m.gpu, m.pid, m.used_memory_bytes, m.sm_ratio, m.mig, traffic=m.traffic
            )
        except (ValueError, InvalidArgument, ResourceExhausted, FailedPrecondition) as err:
            # The device changed under the job (a MIG instance went, MIG mode changed), its
            # memory is taken, or a fault came on it: as on a real node, the process cannot
            # run there; try again next tick.
            log.debug("simulated process %d of job %s not started: %s", m.pid, m.job, err)
            return
        if started:  # else the operator runs it (gpuctl sim workload start): theirs
            self._running[(m.pid, m.gpu)] = m

    def _stop(self, m: Modelled) -> None:
        self._workloads.stop_modelled(m.pid, m.gpu)
        del self._running[(m.pid, m.gpu)]

    # -- the host side ---------------------------------------------------------------------
    def _job_processes(self, jobs: set[str]) -> dict[int, str]:
        """PID -> job for the top process of each job tree (parent not in the same job)."""
        stats: dict[int, tuple[int, str]] = {}  # pid -> (ppid, identity)
        try:
            names = os.listdir(self._proc)
        except OSError:
            return {}
        for name in names:
            if name.isdigit() and (st := _stat(int(name), self._proc)) is not None:
                stats[int(name)] = st
        job_of: dict[int, str | None] = {}
        cache: dict[tuple[int, str], str | None] = {}
        for pid, (_, start) in stats.items():
            key = (pid, start)
            job = self._jobs_of[key] if key in self._jobs_of else self._read_job(pid)
            cache[key] = job
            job_of[pid] = job
        self._jobs_of = cache  # forget the processes that are gone
        return {
            pid: job
            for pid, job in job_of.items()
            if job in jobs and job_of.get(stats[pid][0]) != job
        }

    def _read_job(self, pid: int) -> str | None:
        try:
            environ = (self._proc / str(pid) / "environ").read_bytes()
        except OSError:
            return None  # gone, or a kernel thread
        for entry in environ.split(b"\0"):
            if entry.startswith(JOB_VAR):
                return entry[len(JOB_VAR) :].decode(errors="replace")
        return None


def _stat(pid: int, proc_root: Path) -> tuple[int, str] | None:
    """(parent PID, identity) from ``/proc/<pid>/stat``, or None if it is gone.

    The identity is the start time and the name (``comm``): a PID reused later has another
    start time, and a child that execs after the fork (as ``gpuctl run``'s does) keeps its
    start time but takes the new program's name. Before that exec its environ is still its
    parent's, so what was read then must not stand for the program it becomes."""
    read = procs.stat(pid, proc_root)
    if read is None or len(read[1]) < 20:
        return None
    comm, fields = read
    return int(fields[1]), f"{fields[19]} {comm}"
