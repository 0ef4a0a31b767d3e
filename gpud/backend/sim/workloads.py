"""Simulated compute processes: what ``nvidia-smi`` lists under "Processes".

A started process holds device memory and drives the SMs of its GPU or MIG device: it
appears in ``nvmlDeviceGetComputeRunningProcesses`` and moves memory used, utilization,
power, temperature, clocks and PCIe/NVLink throughput until it is stopped.

No process starts on a GPU that is lost, requires a reset or hangs (``gpuctl sim fault``):
the simulated driver refuses it (:class:`gpud.errors.FailedPrecondition`), the operator's
and the workload models' alike. A process declared with the PID of a live host process
ends when that process does (:meth:`Workloads.end_exited`), as the driver frees an exiting
process's memory; one declared with a PID no host process had then (a made-up PID) runs
until it is stopped or the node reboots.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from gpud.backend.sim.fakenvml import FakeNvml, LinkTraffic, _Proc
from gpud.mps import procs


@dataclass(frozen=True, slots=True)
class Workload:
    pid: int
    gpu: int
    gpu_instance_id: int | None
    compute_instance_id: int | None
    used_memory_bytes: int
    sm_ratio: float


class Workloads:
    """Start and stop simulated processes. Thread-safe.

    Two kinds of callers: the operator (``gpuctl sim workload``: :meth:`start`, :meth:`stop`)
    and the workload models behind the jobs' processes (:meth:`start_modelled`,
    :meth:`update`, :meth:`stop_modelled`), which run a process on each GPU its job holds.
    What the operator declares wins: starting a PID the models run replaces their process
    (on every GPU), and the models leave it alone from then on (until the operator stops
    it)."""

    def __init__(self, nvml: FakeNvml, *, proc_root: Path = Path("/proc")) -> None:
        self._nvml = nvml
        self._proc = proc_root
        self._lock = threading.Lock()
        self._modelled: set[tuple[int, int]] = set()  # (pid, GPU)

    def start(
        self,
        gpu: int,
        pid: int,
        used_memory_bytes: int,
        sm_ratio: float,
        mig: int | str | None = None,
    ) -> bool:
        """Run ``pid`` on ``gpu`` (or its MIG device: index or ``MIG-`` UUID): whether it
        ends with its host process.

        ``sm_ratio`` is the share of the device's SMs it keeps busy (0..1). When a host
        process ``pid`` runs now (in ``proc_root``, not a zombie) it ends with it
        (:meth:`end_exited`); else it runs until stopped. FailedPrecondition on a GPU whose
        faults keep processes off it (the models' process of ``pid`` stays).
        """
        _check(self._nvml, gpu, used_memory_bytes, sm_ratio)
        host = host_start(self._proc, pid)
        # one critical section from the check to the start: a fault that came on between
        # them would leave the models' process stopped and the start refused
        with self._lock, self._nvml.sim_locked():
            if (refusal := self._nvml.sim_start_refusal(gpu)) is not None:
                raise refusal  # before the models' process is taken over
            for key in [k for k in self._modelled if k[0] == pid]:
                self._modelled.discard(key)
                self._nvml.sim_stop_process(pid, key[1])
            self._nvml.sim_start_process(
                gpu, pid, used_memory_bytes, sm_ratio, mig, declared=True, host=host
            )
        return host is not None

    def end_exited(self) -> list[Workload]:
        """End the declared processes whose host process has exited (or whose PID another
        process has taken since), as the driver frees an exiting process's memory; returns
        them (one per GPU), by PID. Each ends on its own GPU only: the same PID declared on
        another GPU when no host process had it (or another one did) is left there, as are
        all those declared with a PID no host process had."""
        with self._lock:
            gone = [
                _workload(p)
                for p in sorted(self._nvml.sim_processes(), key=lambda p: (p.pid, p.gpu))
                if p.declared and p.host is not None and host_start(self._proc, p.pid) != p.host
            ]
            for w in gone:
                self._nvml.sim_stop_process(w.pid, w.gpu)
            return gone

    def stop(self, pid: int) -> bool:
        """Stop ``pid`` (on every GPU); False if it was not running."""
        with self._lock:
            self._modelled = {k for k in self._modelled if k[0] != pid}
            return self._nvml.sim_stop_process(pid)

    def start_modelled(
        self,
        gpu: int,
        pid: int,
        used_memory_bytes: int,
        sm_ratio: float,
        mig: str | None,
        *,
        traffic: LinkTraffic | None = None,
    ) -> bool:
        """:meth:`start` for the workload models, with what the process moves over PCIe and
        NVLink; False (nothing done) when ``pid`` already runs on ``gpu``, or anywhere as
        the operator declared it."""
        _check(self._nvml, gpu, used_memory_bytes, sm_ratio)
        with self._lock:
            for p in self._nvml.sim_processes():
                if p.pid == pid and (p.gpu == gpu or (pid, p.gpu) not in self._modelled):
                    return False
            self._nvml.sim_start_process(
                gpu, pid, used_memory_bytes, sm_ratio, mig, traffic=traffic
            )
            self._modelled.add((pid, gpu))
            return True

    def stop_modelled(self, pid: int, gpu: int) -> None:
        """Stop a process the models started on ``gpu`` (not one the operator took over)."""
        with self._lock:
            if (pid, gpu) in self._modelled:
                self._modelled.discard((pid, gpu))
                self._nvml.sim_stop_process(pid, gpu)

    def modelled(self) -> set[tuple[int, int]]:
        """The (PID, GPU) the models run now (a reboot ends them all)."""
        with self._lock:
            running = {(p.pid, p.gpu) for p in self._nvml.sim_processes()}
            self._modelled &= running
            return set(self._modelled)

    def update(
        self,
        pid: int,
        gpu: int,
        used_memory_bytes: int,
        sm_ratio: float,
        traffic: LinkTraffic | None = None,
    ) -> bool:
        """Change the memory, SM activity and link traffic of a modelled ``pid`` on ``gpu``;
        False if the models do not run it there."""
        if used_memory_bytes < 0 or not 0.0 <= sm_ratio <= 1.0:
            raise ValueError("used_memory_bytes must be >= 0 and sm_ratio within 0..1")
        with self._lock:
            if (pid, gpu) not in self._modelled:
                return False
            return self._nvml.sim_update_process(pid, used_memory_bytes, sm_ratio, traffic, gpu=gpu)

    def faulty_gpus(self) -> set[int]:
        """The GPUs whose injected faults keep new processes off them (lost, requiring a
        reset, hanging)."""
        return {
            gpu
            for gpu in self._nvml.sim_fault_table()
            if self._nvml.sim_start_refusal(gpu) is not None
        }

    def list(self) -> list[Workload]:
        return [_workload(p) for p in sorted(self._nvml.sim_processes(), key=lambda p: p.pid)]


def host_start(proc_root: Path, pid: int) -> int | None:
    """When host process ``pid`` started (:func:`gpud.mps.procs.start_time`), or None: no
    such process, or one that has exited (a zombie not yet reaped). A PID reused later has
    another start time."""
    fields = procs.stat_fields(pid, proc_root)
    if fields is None or procs.exited(fields):
        return None
    return procs.start_ticks(fields)


def _workload(p: _Proc) -> Workload:
    return Workload(p.pid, p.gpu, p.gi, p.ci, p.used_bytes, p.sm_ratio)


def _check(nvml: FakeNvml, gpu: int, used_memory_bytes: int, sm_ratio: float) -> None:
    if not 0 <= gpu < nvml.sim_gpu_count:
        raise ValueError(f"no GPU {gpu} (the node has {nvml.sim_gpu_count})")
    if used_memory_bytes < 0 or not 0.0 <= sm_ratio <= 1.0:
        raise ValueError("used_memory_bytes must be >= 0 and sm_ratio within 0..1")
