"""The pure MIG planner: what a GPU has, what it should have -> ordered driver steps.

Steps, in the order the driver needs them:

1. destroy compute instances   (``nvidia-smi mig -dci -gi G -ci C``)
2. destroy GPU instances       (``nvidia-smi mig -dgi -gi G``)
3. set MIG mode                (``nvidia-smi -i N -mig 0|1``; may need a GPU reset)
4. create GPU instances        (``nvidia-smi mig -cgi P`` at an explicit placement, largest first)
5. create compute instances    (``nvidia-smi mig -cci P -gi G``)

GPU instances that already hold exactly what is wanted are kept, so planning a GPU that
matches gives no steps (applying twice is a no-op). A compute instance is created in a GPU
instance named by its placement, because the new GPU instance's id is only known once the
driver has made it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gpud.backend.port import GpuInstanceInfo, MigMode, Placement
from gpud.mig.layout import DeviceLayout, MigProfile
from gpud.mig.validate import ProfileTable, resolve_profiles, solve


@dataclass(frozen=True, slots=True)
class DestroyComputeInstance:
    gpu: int
    gpu_instance_id: int
    compute_instance_id: int
    profile: str

    def describe(self) -> str:
        return (
            f"GPU {self.gpu}: destroy compute instance {self.compute_instance_id} "
            f"({self.profile}) in GPU instance {self.gpu_instance_id}"
        )


@dataclass(frozen=True, slots=True)
class DestroyGpuInstance:
    gpu: int
    gpu_instance_id: int
    profile: str
    placement: Placement

    def describe(self) -> str:
        return (
            f"GPU {self.gpu}: destroy GPU instance {self.gpu_instance_id} ({self.profile} "
            f"at {self.placement.start}:{self.placement.size})"
        )


@dataclass(frozen=True, slots=True)
class SetMigMode:
    gpu: int
    enabled: bool

    def describe(self) -> str:
        return f"GPU {self.gpu}: set MIG mode {'enabled' if self.enabled else 'disabled'}"


@dataclass(frozen=True, slots=True)
class CreateGpuInstance:
    gpu: int
    profile_id: int
    profile: str
    placement: Placement

    def describe(self) -> str:
        return (
            f"GPU {self.gpu}: create GPU instance {self.profile} "
            f"at {self.placement.start}:{self.placement.size}"
        )


@dataclass(frozen=True, slots=True)
class CreateComputeInstance:
    gpu: int
    gpu_instance_profile_id: int
    gpu_instance_placement: Placement
    profile_id: int
    profile: str

    def describe(self) -> str:
        p = self.gpu_instance_placement
        return f"GPU {self.gpu}: create compute instance {self.profile} in the GPU instance at {p.start}:{p.size}"


Step = (
    DestroyComputeInstance
    | DestroyGpuInstance
    | SetMigMode
    | CreateGpuInstance
    | CreateComputeInstance
)

_STEP_TYPES: dict[str, type[Step]] = {
    t.__name__: t
    for t in (
        DestroyComputeInstance,
        DestroyGpuInstance,
        SetMigMode,
        CreateGpuInstance,
        CreateComputeInstance,
    )
}


def step_to_dict(step: Step) -> dict[str, Any]:
    return {"op": type(step).__name__, **asdict(step)}


def step_from_dict(raw: dict[str, Any]) -> Step:
    fields = dict(raw)
    cls = _STEP_TYPES[fields.pop("op")]
    for key in ("placement", "gpu_instance_placement"):
        if key in fields:
            fields[key] = Placement(**fields[key])
    return cls(**fields)


@dataclass(frozen=True, slots=True)
class GpuActual:
    """What the driver has for one GPU: ``nvidia-smi -q`` MIG mode, ``mig -lgi`` and ``-lci``."""

    gpu: int
    mode: MigMode
    instances: tuple[GpuInstanceInfo, ...]


@dataclass(frozen=True, slots=True)
class GpuPlan:
    gpu: int
    steps: tuple[Step, ...]
    reset_pending: bool  # MIG mode is or will be pending until a GPU reset

    @property
    def empty(self) -> bool:
        return not self.steps and not self.reset_pending

    def destroyed_gpu_instances(self) -> set[int]:
        return {s.gpu_instance_id for s in self.steps if isinstance(s, DestroyGpuInstance)}

    def destroyed_compute_instances(self) -> set[tuple[int, int]]:
        return {
            (s.gpu_instance_id, s.compute_instance_id)
            for s in self.steps
            if isinstance(s, DestroyComputeInstance)
        }

    def changes_mode(self) -> bool:
        return any(isinstance(s, SetMigMode) for s in self.steps)


def plan_gpu(actual: GpuActual, desired: DeviceLayout, table: ProfileTable | None) -> GpuPlan:
    """Ordered steps taking ``actual`` to ``desired``. ``table`` may be None only when
    ``desired`` has MIG disabled. Raises :class:`~gpud.errors.InvalidArgument` when the
    layout does not fit (see :func:`gpud.mig.validate.solve`)."""
    gpu = actual.gpu
    mode = actual.mode
    destroy_ci: list[Step] = []
    destroy_gi: list[Step] = []
    create_gi: list[Step] = []
    create_ci: list[Step] = []

    def drop_cis(gi: GpuInstanceInfo, profile: str) -> None:
        for ci in gi.compute_instances:
            destroy_ci.append(
                DestroyComputeInstance(
                    gpu, gi.id, ci.id, _ci_name(table, gi, ci.profile_id, profile)
                )
            )

    def drop_gi(gi: GpuInstanceInfo) -> None:
        name = _gi_name(table, gi.profile_id)
        drop_cis(gi, name)
        destroy_gi.append(DestroyGpuInstance(gpu, gi.id, name, gi.placement))

    if not desired.mig_enabled:
        for gi in sorted(actual.instances, key=lambda g: g.id):
            drop_gi(gi)
        mode_steps: list[Step] = [SetMigMode(gpu, False)] if mode.pending else []
        steps = (*destroy_ci, *destroy_gi, *mode_steps)
        return GpuPlan(gpu, steps, reset_pending=mode.current)

    if table is None:
        raise ValueError("a MIG-enabled layout needs the GPU's profile table")
    wanted = resolve_profiles(table, desired)
    # A GPU with MIG mode off has no instances to keep.
    existing = actual.instances if mode.current else ()
    assignments = solve(table, wanted, existing) if wanted else []
    kept = {a.keep.id for a in assignments if a.keep is not None}
    for gi in sorted(actual.instances, key=lambda g: g.id):
        if gi.id not in kept:
            drop_gi(gi)
    for a in assignments:
        w = a.wanted
        if a.keep is not None:
            cis = a.keep.compute_instances
            if len(cis) == 1 and cis[0].profile_id == w.ci.id:
                continue
            drop_cis(a.keep, w.gi.name)
        else:
            create_gi.append(CreateGpuInstance(gpu, w.gi.id, w.gi.name, a.placement))
        create_ci.append(CreateComputeInstance(gpu, w.gi.id, a.placement, w.ci.id, w.ci.name))
    mode_steps = [SetMigMode(gpu, True)] if not mode.pending else []
    steps = (*destroy_ci, *destroy_gi, *mode_steps, *create_gi, *create_ci)
    return GpuPlan(gpu, steps, reset_pending=not mode.current)


def steps_before_reset(
    actual: GpuActual, plan: GpuPlan, *, mode_needs_reset: bool
) -> tuple[Step, ...] | None:
    """The steps an apply that does not reset the GPU (``skip_reset``) runs before a MIG
    mode change pending a GPU reset stops it, or None when the plan does not stop there.

    It stops there when the GPU's MIG mode is already pending (``nvidia-smi -q``: "Pending"
    differs from "Current"), or when the plan changes the mode on a product that makes the
    change at the next reset (``mode_needs_reset``: ``nvidia-smi -mig 1`` answers "pending"
    on A100; Hopper switches at once). The instances to create wait for the new mode: the
    steps before the first creation run, the rest after the reset.
    """
    if not plan.reset_pending:
        return None
    if not (actual.mode.reset_pending or (mode_needs_reset and plan.changes_mode())):
        return None
    creating = (CreateGpuInstance, CreateComputeInstance)
    return tuple(itertools.takewhile(lambda s: not isinstance(s, creating), plan.steps))


def reset_step(gpu: int) -> str:
    """How an apply names the GPU reset that makes a pending MIG mode current."""
    return f"GPU {gpu}: reset the GPU (nvidia-smi --gpu-reset -i {gpu})"


def _gi_name(table: ProfileTable | None, profile_id: int) -> str:
    if table is not None:
        try:
            return table.gi_profile(profile_id).name
        except KeyError:
            pass
    return f"profile {profile_id}"


def _ci_name(
    table: ProfileTable | None, gi: GpuInstanceInfo, ci_profile_id: int, gi_name: str
) -> str:
    if table is not None:
        try:
            return table.ci_profile(gi.profile_id, ci_profile_id).name
        except KeyError:
            pass
    return f"profile {ci_profile_id} in {gi_name}"


def actual_layout(actual: GpuActual, table: ProfileTable | None) -> DeviceLayout:
    """The current layout in mig-parted's terms, for ``export`` and for showing differences.

    Each compute instance counts as one MIG device. A GPU instance without a compute
    instance has no MIG device and is not part of it (so such a GPU never matches a layout:
    the plan for it is not empty); :func:`describe_actual` names it beside the layout.
    """
    if not actual.mode.current or table is None:
        return DeviceLayout(actual.mode.current)
    counts: dict[MigProfile, int] = {}
    for gi in actual.instances:
        gi_profile = table.gi_profile(gi.profile_id)
        label = MigProfile.parse(gi_profile.name)
        for ci in gi.compute_instances:
            ci_profile = table.ci_profile(gi.profile_id, ci.profile_id)
            ci_slices = (
                None if ci_profile.slice_count == gi_profile.slice_count else ci_profile.slice_count
            )
            p = MigProfile(label.gi_slices, label.memory_gb, label.attrs, ci_slices)
            counts[p] = counts.get(p, 0) + 1
    return DeviceLayout.of(True, counts)


def describe_difference(
    actual: GpuActual, desired: DeviceLayout, table: ProfileTable | None, plan: GpuPlan
) -> str:
    """One line for ``gpuctl mig assert``: what the GPU has and what it should have."""
    mode = actual.mode
    pending = ""
    if mode.reset_pending:
        pending = f" (MIG mode {'enabled' if mode.pending else 'disabled'} pending a GPU reset)"
    empty_gis = [gi.id for gi in actual.instances if not gi.compute_instances]
    have_txt = describe_actual(actual_layout(actual, table), empty_gis, note=pending)
    return f"GPU {actual.gpu}: has {have_txt}; wants {desired.describe()} ({len(plan.steps)} steps)"


def describe_actual(
    layout: DeviceLayout, empty_gpu_instances: Sequence[int], *, note: str = ""
) -> str:
    """What a GPU holds, for ``gpuctl mig show`` and ``assert``: ``layout`` (see
    :func:`actual_layout`), then ``note``, then the GPU instances the driver has without a
    compute instance (``nvidia-smi mig -lgi`` lists them, ``-lci`` does not): they hold no
    MIG device, so ``layout`` leaves them out, but they are not nothing."""
    text = layout.describe()
    if empty_gpu_instances and not layout.devices:
        text = "MIG enabled, no MIG devices"
    text += note
    if empty_gpu_instances:
        ids = ", ".join(map(str, empty_gpu_instances))
        text += f"; GPU instances without compute instances: {ids}"
    return text


def plan_all(
    actuals: Sequence[GpuActual],
    desired: dict[int, DeviceLayout],
    tables: dict[int, ProfileTable | None],
) -> list[GpuPlan]:
    """Plans for every GPU in ``desired``; GPUs without a desired layout are left alone."""
    return [plan_gpu(a, desired[a.gpu], tables.get(a.gpu)) for a in actuals if a.gpu in desired]
