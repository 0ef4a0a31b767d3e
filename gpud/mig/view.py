"""What ``gpuctl mig show`` prints, read from the driver: a GPU's MIG mode, its instances
with their MIG UUIDs, memory and processes (``nvidia-smi -L``, ``nvidia-smi mig -lgi`` /
``-lci``, the "Processes" table), and its profiles with free counts and placements
(``nvidia-smi mig -lgip`` / ``-lgipp``).

Plain functions over a :class:`~gpud.backend.port.GpuBackend`; :class:`gpud.mig.manager.MigManager`
calls them under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from gpud.backend.port import GpuBackend, GpuIdentity, MigMode
from gpud.errors import GPU_FAULTS, BackendError
from gpud.mig.layout import DeviceLayout
from gpud.mig.plan import GpuActual, actual_layout, describe_actual
from gpud.mig.store import DesiredRecord
from gpud.mig.validate import ProfileTable

JobResolver = Callable[[int], str | None]
"""pid -> job name, when a job registry knows the process."""


@dataclass(frozen=True, slots=True)
class ProcessView:
    pid: int
    used_memory_bytes: int | None
    job: str | None


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One GPU instance and (when it has one) its compute instance, as ``gpuctl mig show``
    prints it. ``mig`` and ``uuid`` are those of the MIG device (``nvidia-smi -L``)."""

    gpu: int
    gpu_instance_id: int
    profile: str  # GPU instance profile, "3g.40gb"
    placement_start: int
    placement_size: int
    compute_instance_id: int | None
    compute_profile: str | None
    mig: int | None
    uuid: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    processes: tuple[ProcessView, ...] = ()
    # why the MIG device's processes could not be listed (NotSupported, a driver error):
    # ``processes`` is then empty without meaning that none run; "" when they were
    processes_error: str = ""
    # why its memory could not be read (NotSupported, a driver error): ``memory_used_bytes``
    # is then None; "" when it was
    memory_error: str = ""


@dataclass(frozen=True, slots=True)
class GpuView:
    """One GPU as ``gpuctl mig show`` prints it. ``fault`` is why it could not be read (lost,
    not answering, a driver error); the other fields are then what is known without the
    driver (identity, desired layout) and empty otherwise."""

    identity: GpuIdentity
    mode: MigMode | None  # None: not MIG capable, or not read
    instances: tuple[InstanceView, ...]
    layout: DeviceLayout
    desired: DesiredRecord | None
    profiles: tuple[tuple[str, int, tuple[tuple[int, int], ...]], ...]  # (name, free, placements)
    fault: str = ""

    def describe(self) -> str:
        """The layout the GPU holds, and the GPU instances it has without a compute instance
        (each shown as an instance without a MIG device, UUID or MPS daemon)."""
        empty = [i.gpu_instance_id for i in self.instances if i.compute_instance_id is None]
        return describe_actual(self.layout, empty)


def read_actual(backend: GpuBackend, gpu: GpuIdentity) -> GpuActual:
    """``nvidia-smi -q`` MIG mode plus ``nvidia-smi mig -lgi`` / ``-lci``."""
    if not gpu.mig_capable:
        return GpuActual(gpu.index, MigMode(False, False), ())
    mode = backend.mig_mode(gpu.index)
    instances = tuple(backend.gpu_instances(gpu.index)) if mode.current else ()
    return GpuActual(gpu.index, mode, instances)


def gpu_view(
    backend: GpuBackend,
    gpu: GpuIdentity,
    table: ProfileTable | None,
    desired: DesiredRecord | None,
    jobs: JobResolver | None,
) -> GpuView:
    """Read one GPU's view from the driver."""
    actual = read_actual(backend, gpu)
    instances = (
        tuple(_instance_views(backend, gpu, actual, table, jobs)) if actual.mode.current else ()
    )
    profiles: tuple[tuple[str, int, tuple[tuple[int, int], ...]], ...] = ()
    if table is not None:
        profiles = tuple(
            (
                p.name,
                _free_count(backend, gpu, p.id, actual),
                tuple((pl.start, pl.size) for pl in table.placements.get(p.id, ())),
            )
            for p in table.gi_profiles
        )
    return GpuView(
        gpu,
        actual.mode if gpu.mig_capable else None,
        instances,
        actual_layout(actual, table),
        desired,
        profiles,
    )


def faulty_view(gpu: GpuIdentity, desired: DesiredRecord | None, fault: str) -> GpuView:
    """A GPU that could not be read: what is known without the driver, and why."""
    return GpuView(gpu, None, (), DeviceLayout(False, ()), desired, (), fault=fault)


def _free_count(backend: GpuBackend, gpu: GpuIdentity, profile_id: int, actual: GpuActual) -> int:
    """How many more of this profile fit (``nvidia-smi mig -lgip`` "Free" column)."""
    if not actual.mode.current:
        return 0
    taken = [gi.placement for gi in actual.instances]
    free = 0
    chosen: list[tuple[int, int]] = []
    for pl in backend.gpu_instance_placements(gpu.index, profile_id):
        spans = [(t.start, t.size) for t in taken] + chosen
        if all(pl.start + pl.size <= s or s + n <= pl.start for s, n in spans):
            free += 1
            chosen.append((pl.start, pl.size))
    return free


def _instance_views(
    backend: GpuBackend,
    gpu: GpuIdentity,
    actual: GpuActual,
    table: ProfileTable | None,
    jobs: JobResolver | None,
) -> Iterable[InstanceView]:
    devices = {
        (m.gpu_instance_id, m.compute_instance_id): m for m in backend.mig_devices(gpu.index)
    }
    for gi in sorted(actual.instances, key=lambda g: g.placement.start):
        gi_name = profile_name(table, gi.profile_id, None)
        cis: Sequence[tuple[int | None, int | None]] = [
            (ci.id, ci.profile_id) for ci in gi.compute_instances
        ] or [(None, None)]
        for ci_id, ci_profile in cis:
            md = devices.get((gi.id, ci_id)) if ci_id is not None else None
            used = None
            procs: tuple[ProcessView, ...] = ()
            procs_error = ""
            memory_error = ""
            if md is not None:
                try:
                    used = backend.memory(gpu.index, md.mig).used_bytes
                except GPU_FAULTS:
                    raise  # the whole GPU is faulty
                except BackendError as err:
                    # Only this reading is missing, as for the processes below.
                    memory_error = str(err)
                try:
                    listed = backend.processes(gpu.index, md.mig)
                except GPU_FAULTS:
                    raise  # the whole GPU is faulty
                except BackendError as err:
                    # Only this reading is missing: the instance is shown as the MIG reads
                    # found it, its processes as unknown.
                    procs_error = str(err)
                else:
                    procs = tuple(
                        ProcessView(p.pid, p.used_memory_bytes, jobs(p.pid) if jobs else None)
                        for p in listed
                    )
            yield InstanceView(
                gpu.index,
                gi.id,
                gi_name,
                gi.placement.start,
                gi.placement.size,
                ci_id,
                profile_name(table, gi.profile_id, ci_profile) if ci_profile is not None else None,
                md.mig if md else None,
                md.uuid if md else None,
                md.memory_total_bytes if md else None,
                used,
                procs,
                procs_error,
                memory_error,
            )


def profile_name(table: ProfileTable | None, gi_profile_id: int, ci_profile_id: int | None) -> str:
    """The profile's name (``3g.40gb``, ``1c.3g.40gb``), or ``profile N`` when unknown."""
    if table is None:
        return f"profile {gi_profile_id}"
    try:
        if ci_profile_id is None:
            return table.gi_profile(gi_profile_id).name
        return table.ci_profile(gi_profile_id, ci_profile_id).name
    except KeyError:
        return f"profile {ci_profile_id if ci_profile_id is not None else gi_profile_id}"
