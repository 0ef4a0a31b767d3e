"""Check a layout against the device's own MIG tables and find placements for it.

The tables are what ``nvidia-smi mig -lgip`` (GPU instance profiles), ``-lgipp`` (their
possible placements, in memory slices) and ``-lcip`` (compute instance profiles) print. A
layout is refused with :class:`~gpud.errors.InvalidArgument` naming the GPU index, the
product and the reason, before anything on the device is touched.

Placements matter: profiles may only start at specific memory slices (``3g.40gb`` at 0 or 4
on an H100), so whether a set of instances fits is a packing problem. :func:`solve` searches
for an assignment of placements, largest profiles first, optionally reusing existing GPU
instances (what the planner needs to keep instances that already match).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gpud.backend.port import (
    ComputeInstanceProfile,
    GpuBackend,
    GpuIdentity,
    GpuInstanceInfo,
    GpuInstanceProfile,
    Placement,
)
from gpud.backend.products import PRODUCTS
from gpud.errors import DeviceNotFound, InvalidArgument, NotFound
from gpud.mig.layout import DeviceLayout, MigProfile

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class ProfileTable:
    """One GPU's MIG tables, read once from the backend."""

    identity: GpuIdentity
    gi_profiles: tuple[GpuInstanceProfile, ...]
    placements: dict[int, tuple[Placement, ...]]  # GI profile id -> placements
    ci_profiles: dict[int, tuple[ComputeInstanceProfile, ...]]  # GI profile id -> CI profiles
    from_device: bool = False  # every part read from the driver (worth caching)

    @property
    def memory_slices(self) -> int:
        return max((p.start + p.size for ps in self.placements.values() for p in ps), default=0)

    @property
    def compute_slices(self) -> int:
        return max((p.slice_count for p in self.gi_profiles), default=0)

    def gi_profile(self, profile_id: int) -> GpuInstanceProfile:
        for p in self.gi_profiles:
            if p.id == profile_id:
                return p
        raise KeyError(profile_id)

    def gi_profile_named(self, name: str) -> GpuInstanceProfile | None:
        for p in self.gi_profiles:
            if p.name == name:
                return p
        return None

    def ci_profile(self, gi_profile_id: int, ci_profile_id: int) -> ComputeInstanceProfile:
        for c in self.ci_profiles.get(gi_profile_id, ()):
            if c.id == ci_profile_id:
                return c
        raise KeyError(ci_profile_id)

    def where(self) -> str:
        return f"GPU {self.identity.index} ({self.identity.product})"


def load_table(backend: GpuBackend, gpu: int) -> ProfileTable:
    """Read ``-lgip``, ``-lgipp`` and ``-lcip`` for one GPU.

    The 580-series driver answers ``-lgip``/``-lgipp`` with MIG mode off too (older ones
    raise NotSupported until it is on), and lists compute instance profiles only from an
    existing GPU instance of that profile; for the others the published table (or NVML's
    fixed profile constants) stands in.
    """
    identity = backend.identity(gpu)
    gis = tuple(backend.gpu_instance_profiles(gpu))
    placements = {p.id: tuple(backend.gpu_instance_placements(gpu, p.id)) for p in gis}
    ref = reference_table(identity)
    cis: dict[int, tuple[ComputeInstanceProfile, ...]] = {}
    complete = True
    for p in gis:
        try:
            cis[p.id] = tuple(backend.compute_instance_profiles(gpu, p.id))
        except (DeviceNotFound, NotFound):
            complete = False
            cis[p.id] = _fallback_ci_profiles(p, ref)
    return ProfileTable(identity, gis, placements, cis, complete)


# NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE constants, which NVML also returns as the ids.
_CI_CONSTANTS = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}


def _fallback_ci_profiles(
    gi: GpuInstanceProfile, ref: ProfileTable | None
) -> tuple[ComputeInstanceProfile, ...]:
    if ref is not None:
        same = ref.gi_profile_named(gi.name)
        if same is not None:
            return ref.ci_profiles.get(same.id, ())
    out = []
    for c, constant in sorted(_CI_CONSTANTS.items()):
        if c < gi.slice_count and c in (1, 2, 3, 4):
            out.append(
                ComputeInstanceProfile(
                    constant, constant, f"{c}c.{gi.name}", c, gi.slice_count // c, 0
                )
            )
    full = _CI_CONSTANTS.get(gi.slice_count)
    if full is not None:
        out.append(
            ComputeInstanceProfile(full, full, gi.name, gi.slice_count, 1, gi.multiprocessor_count)
        )
    return tuple(out)


def reference_table(identity: GpuIdentity) -> ProfileTable | None:
    """The published MIG table of ``identity``'s product, for validating a layout while the
    GPU's MIG mode is still off and the driver will not list profiles. None when unknown.

    The data is the product catalogue (NVIDIA's MIG user guide); once MIG is on, the
    driver's own table replaces it before anything is created.
    """
    spec = PRODUCTS.get(identity.product)
    if spec is None or not spec.mig_profiles:
        return None
    mib = 1 << 20
    gis = tuple(
        GpuInstanceProfile(
            id=p.id,
            profile=p.constant,
            name=p.name,
            slice_count=p.slices,
            memory_bytes=p.memory_mib * mib,
            memory_slices=p.memory_slices,
            instance_count=p.instance_count,
            multiprocessor_count=p.sm,
            copy_engine_count=p.copy_engines,
            decoder_count=p.decoders,
            encoder_count=p.encoders,
            jpeg_count=p.jpegs,
            ofa_count=p.ofas,
        )
        for p in spec.mig_profiles
    )
    placements = {p.id: tuple(Placement(s, n) for s, n in p.placements) for p in spec.mig_profiles}
    cis = {
        p.id: tuple(
            ComputeInstanceProfile(c.constant, c.constant, c.name, c.slices, c.instance_count, c.sm)
            for c in spec.ci_profiles(p)
        )
        for p in spec.mig_profiles
    }
    return ProfileTable(identity, gis, placements, cis)


@dataclass(frozen=True, slots=True)
class Wanted:
    """One MIG device the layout asks for, resolved to this product's profile ids."""

    label: MigProfile
    gi: GpuInstanceProfile
    ci: ComputeInstanceProfile

    @property
    def key(self) -> tuple[int, int]:
        return (self.gi.id, self.ci.id)


def resolve_profiles(table: ProfileTable, layout: DeviceLayout) -> list[Wanted]:
    """Map each ``mig-devices`` key to this product's profiles and check counts and sizes.

    Raises :class:`InvalidArgument` for an unknown profile, too many instances of one
    profile, or more compute slices or memory than the GPU has.
    """
    where = table.where()
    if layout.mig_enabled and not table.identity.mig_capable:
        raise InvalidArgument(f"{where}: does not support MIG", field="mig-enabled")
    wanted: list[Wanted] = []
    for label, count in layout.devices:
        gi = table.gi_profile_named(label.gi_name)
        if gi is None:
            known = ", ".join(p.name for p in table.gi_profiles)
            raise InvalidArgument(
                f"{where}: unknown MIG profile {label.gi_name!r} for this product (known: {known})",
                field="mig-devices",
            )
        ci_slices = label.ci_slices if label.ci_slices is not None else gi.slice_count
        ci = next((c for c in table.ci_profiles.get(gi.id, ()) if c.slice_count == ci_slices), None)
        if ci is None:
            known = ", ".join(c.name for c in table.ci_profiles.get(gi.id, ()))
            raise InvalidArgument(
                f"{where}: no {ci_slices}-slice compute instance profile in {gi.name} "
                f"(known: {known})",
                field="mig-devices",
            )
        if count > gi.instance_count:
            raise InvalidArgument(
                f"{where}: too many {gi.name} instances: {count} requested, "
                f"at most {gi.instance_count} fit",
                field="mig-devices",
            )
        wanted.extend(Wanted(label, gi, ci) for _ in range(count))
    compute = sum(w.gi.slice_count for w in wanted)
    if compute > table.compute_slices:
        raise InvalidArgument(
            f"{where}: too many slices: {compute} compute slices requested, "
            f"the GPU has {table.compute_slices}",
            field="mig-devices",
        )
    # Memory slices are not summed here: whether they suffice depends on where each profile
    # may start, and the placement search names the slices that collide.
    wanted.sort(key=lambda w: (-w.gi.memory_slices, -w.gi.slice_count, w.gi.id, w.ci.id))
    return wanted


@dataclass(frozen=True, slots=True)
class Assignment:
    """Where one wanted device goes: an existing GPU instance (``keep``) or a new placement."""

    wanted: Wanted
    placement: Placement
    keep: GpuInstanceInfo | None = None


@dataclass
class _Search:
    table: ProfileTable
    wanted: Sequence[Wanted]
    existing: Sequence[GpuInstanceInfo]
    best_score: int = -1
    best: list[Assignment] | None = None
    deepest: int = -1
    deepest_state: list[Assignment] = field(default_factory=list)


def _score(w: Wanted, gi: GpuInstanceInfo | None) -> int:
    """2: an existing GI with exactly the wanted compute instance; 1: the GI only; 0: new."""
    if gi is None:
        return 0
    cis = gi.compute_instances
    return 2 if len(cis) == 1 and cis[0].profile_id == w.ci.id else 1


def solve(
    table: ProfileTable,
    wanted: Sequence[Wanted],
    existing: Sequence[GpuInstanceInfo] = (),
) -> list[Assignment]:
    """Placements for ``wanted`` (sorted largest first), reusing as many ``existing`` GPU
    instances as possible; instances not reused are assumed destroyed.

    Raises :class:`InvalidArgument` naming the profile that cannot be placed and what its
    candidate placements collide with.
    """
    s = _Search(table, wanted, existing)
    _dfs(s, 0, [], 0, {}, set())
    if s.best is None:
        raise InvalidArgument(_explain(s), field="mig-devices")
    _check_memory(table, wanted)
    return s.best


def _check_memory(table: ProfileTable, wanted: Sequence[Wanted]) -> None:
    where = table.where()
    memory = sum(w.gi.memory_bytes for w in wanted)
    if memory > table.identity.memory_total_bytes:
        raise InvalidArgument(
            f"{where}: too much memory: {memory / GIB:.1f} GiB requested, "
            f"the GPU has {table.identity.memory_total_bytes / GIB:.1f} GiB",
            field="mig-devices",
        )


def _options(s: _Search, w: Wanted) -> list[tuple[Placement, GpuInstanceInfo | None]]:
    keep: list[tuple[Placement, GpuInstanceInfo | None]] = [
        (gi.placement, gi)
        for gi in sorted(s.existing, key=lambda g: (-_score(w, g), g.placement.start, g.id))
        if gi.profile_id == w.gi.id
    ]
    new: list[tuple[Placement, GpuInstanceInfo | None]] = [
        (p, None) for p in s.table.placements.get(w.gi.id, ())
    ]
    return keep + new


def _dfs(  # noqa: PLR0917 - recursion state, kept positional for speed
    s: _Search,
    i: int,
    chosen: list[Assignment],
    score: int,
    last_option: dict[tuple[int, int], int],
    used: set[int],
) -> None:
    if i > s.deepest:
        s.deepest, s.deepest_state = i, list(chosen)
    if score + 2 * (len(s.wanted) - i) <= s.best_score:
        return  # cannot beat what we have
    if i == len(s.wanted):
        s.best_score, s.best = score, list(chosen)
        return
    w = s.wanted[i]
    options = _options(s, w)
    # Identical wanted devices are interchangeable: take their options in increasing order
    # only, so the search enumerates combinations, not permutations.
    first = last_option.get(w.key, -1) + 1
    for k in range(first, len(options)):
        placement, gi = options[k]
        if gi is not None and gi.id in used:
            continue
        if any(_overlaps(placement, a.placement) for a in chosen):
            continue
        chosen.append(Assignment(w, placement, gi))
        if gi is not None:
            used.add(gi.id)
        prev = last_option.get(w.key)
        last_option[w.key] = k
        _dfs(s, i + 1, chosen, score + _score(w, gi), last_option, used)
        if prev is None:
            del last_option[w.key]
        else:
            last_option[w.key] = prev
        if gi is not None:
            used.discard(gi.id)
        chosen.pop()


def _overlaps(a: Placement, b: Placement) -> bool:
    return a.start < b.start + b.size and b.start < a.start + a.size


def _span(p: Placement) -> str:
    return f"{p.start}" if p.size == 1 else f"{p.start}-{p.start + p.size - 1}"


def _explain(s: _Search) -> str:
    where = s.table.where()
    stuck = s.wanted[s.deepest]
    placed = s.deepest_state
    parts = []
    for p in s.table.placements.get(stuck.gi.id, ()):
        hits = [a for a in placed if _overlaps(p, a.placement)]
        who = ", ".join(f"{a.wanted.gi.name} at {_span(a.placement)}" for a in hits)
        parts.append(
            f"{'slices' if p.size > 1 else 'slice'} {_span(p)} collide{'' if p.size > 1 else 's'} with {who}"
        )
    placed_txt = (
        ", ".join(f"{a.wanted.gi.name} at {_span(a.placement)}" for a in placed) or "nothing"
    )
    return (
        f"{where}: no placement fits {stuck.label} after placing {placed_txt} "
        f"(memory slices {s.table.memory_slices}): " + "; ".join(parts)
    )


def validate_layout(table: ProfileTable, layout: DeviceLayout) -> list[Assignment]:
    """Resolve and place ``layout`` on an empty GPU; raise :class:`InvalidArgument` if it cannot."""
    wanted = resolve_profiles(table, layout)
    return solve(table, wanted) if wanted else []
