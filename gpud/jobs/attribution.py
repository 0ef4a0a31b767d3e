"""Which job a GPU process belongs to.

NVML lists a device's compute processes by host PID (``nvidia-smi --query-compute-apps``);
gpud finds the job of each:

1. ``GPUD_JOB=<name>`` in ``/proc/<pid>/environ``: set by ``gpuctl run`` / ``gpuctl env``
   and inherited by every child. Reading another user's environ needs root (gpud runs as
   root); where it is refused, the cgroup decides.
2. The cgroup (``/proc/<pid>/cgroup``), matched by ``cgroup_pattern``: its first group is the
   job name. The default matches ``gpud-job-<name>`` anywhere in the path (e.g. a systemd
   scope ``gpud-job-train-a.scope``).

Results are cached per (PID, start time), so a reused PID is looked at afresh.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpud.jobs.env import JOB_VAR
from gpud.mps.procs import start_time
from gpud.telemetry.snapshot import Snapshot

DEFAULT_CGROUP_PATTERN = r"gpud-job-([A-Za-z0-9][A-Za-z0-9_.-]*?)(?:\.scope|\.service|/|$)"


@dataclass(frozen=True, slots=True)
class ProcessUse:
    """One GPU process and its job: ``device`` is the GPU or MIG UUID it runs on."""

    pid: int
    gpu: int
    device: str
    job: str | None
    source: str  # "environ", "cgroup" or "" (unknown)
    used_memory_bytes: int | None


class Attributor:
    def __init__(
        self,
        *,
        proc_root: Path = Path("/proc"),
        cgroup_pattern: str = DEFAULT_CGROUP_PATTERN,
    ) -> None:
        self._proc_root = proc_root
        self._cgroup = re.compile(cgroup_pattern)
        self._cache: dict[tuple[int, int | None], tuple[str | None, str]] = {}
        # job_of runs on API threads (``gpuctl mig show``) while the tick prunes the cache.
        self._cache_lock = threading.Lock()

    def job_of(self, pid: int) -> tuple[str | None, str]:
        """``(job, source)`` for ``pid``; ``(None, "")`` when it is no job of gpud's."""
        key = (pid, start_time(pid, self._proc_root))
        with self._cache_lock:
            found = self._cache.get(key)
        if found is None:
            found = self._lookup(pid)
            with self._cache_lock:
                self._cache[key] = found
        return found

    def _lookup(self, pid: int) -> tuple[str | None, str]:
        base = self._proc_root / str(pid)
        try:
            environ = (base / "environ").read_bytes()
        except OSError:
            environ = b""
        prefix = JOB_VAR.encode() + b"="
        for entry in environ.split(b"\0"):
            if entry.startswith(prefix):
                return entry[len(prefix) :].decode(errors="replace"), "environ"
        try:
            # a cgroup's directory name is any bytes its creator chose
            cgroup = (base / "cgroup").read_text(errors="surrogateescape")
        except OSError:
            return None, ""
        for line in cgroup.splitlines():
            path = line.split(":", 2)[-1]
            match = self._cgroup.search(path)
            if match:
                return match.group(1), "cgroup"
        return None, ""

    def attribute(self, snapshot: Snapshot) -> list[ProcessUse]:
        """Every process NVML saw in ``snapshot``, on GPUs and MIG devices, with its job."""
        uses: list[ProcessUse] = []
        seen: set[tuple[int, int | None]] = set()
        for gpu in snapshot.gpus:
            for mig in gpu.mig_devices:
                for p in mig.processes:
                    uses.append(
                        self._use(p.pid, gpu.identity.index, mig.identity.uuid, p.used_memory_bytes)
                    )
            for p in gpu.processes:
                # On a MIG GPU, NVML lists the MIG devices' processes on the GPU too.
                if any(u.pid == p.pid and u.gpu == gpu.identity.index for u in uses):
                    continue
                uses.append(
                    self._use(p.pid, gpu.identity.index, gpu.identity.uuid, p.used_memory_bytes)
                )
        for u in uses:
            seen.add((u.pid, start_time(u.pid, self._proc_root)))
        with self._cache_lock:
            self._cache = {k: v for k, v in self._cache.items() if k in seen}
        return uses

    def _use(self, pid: int, gpu: int, device: str, used: int | None) -> ProcessUse:
        job, source = self.job_of(pid)
        return ProcessUse(pid, gpu, device, job, source, used)


def memory_by_job(uses: Iterable[ProcessUse]) -> dict[tuple[str, str], int]:
    """GPU memory used per (job, device UUID), over the processes whose use NVML reports."""
    totals: dict[tuple[str, str], int] = {}
    for u in uses:
        if u.job is not None and u.used_memory_bytes is not None:
            key = (u.job, u.device)
            totals[key] = totals.get(key, 0) + u.used_memory_bytes
    return totals
