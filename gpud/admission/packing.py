"""The vector-packing reduction: how many jobs of one request class the node can run at
once (its effective server count ``k_eff``), and which resource binds.

A class asks for the same demand vector on ``count`` distinct devices of its pool. On one
device of capacity ``c`` it packs ``min_r floor(c_r / d_r)`` times over the dimensions it
asks for (MPS pinned memory, MPS thread share); a request that takes a device whole also
counts device units: GPUs for whole-GPU requests, compute slices for MIG requests (a
``3g.40gb`` device is 3 of a GPU's 7 slices). ``k_eff = floor(sum of per-device copies /
count)``; the vector ``k`` holds the same count per dimension alone, and the binding
dimension is the one with the smallest count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpud.admission.model import Demand, Device, Vec, mig_slices


@dataclass(frozen=True, slots=True)
class Packing:
    """``k_eff`` is None for a request that sets no limit: it shares and never waits."""

    k_eff: int | None
    vector: dict[str, int]  # dimension -> jobs of this class the node holds on it alone
    binding: str | None
    pool_size: int


def pack(demand: Demand, devices: Mapping[str, Device]) -> Packing:
    pool = [devices[u] for u in demand.pool]
    # per device: a request without a memory limit asks for each device's MPS default one
    copies_by_dim = [_copies(d.capacity, demand.on(d.uuid)) for d in pool]
    per_dim: dict[str, int] = {}
    for i, dim in enumerate(("memory", "threads")):
        on_dim = [c[i] for c in copies_by_dim]
        if any(n is not None for n in on_dim):
            held = _held(on_dim, demand.count)
            if held is not None:
                per_dim[dim] = held
    # a device where it asks for nothing (no MPS default there) holds any number of them
    copies = [min((n for n in c if n is not None), default=None) for c in copies_by_dim]
    k_eff = _held(copies, demand.count)
    if k_eff is None or not per_dim:
        return Packing(None, {}, None, len(pool))
    if all(n is not None and n <= 1 for n in copies):
        # Takes its devices whole: the device units bind as much as memory or threads.
        if pool and pool[0].is_mig:
            slices = sum(mig_slices(d.profile) or 1 for d in pool)
            per_dim["mig_slices"] = slices // (mig_slices(pool[0].profile) or 1) // demand.count
        else:
            per_dim["gpus"] = len(pool) // demand.count
    binding = min(per_dim, key=lambda dim: per_dim[dim])
    return Packing(k_eff, per_dim, binding, len(pool))


def _held(copies: list[int | None], count: int) -> int | None:
    """Jobs of ``count`` devices each that devices holding ``copies`` each run at once; None
    (any number: it shares and never waits) where ``count`` of them hold any number (None).
    Each job needs a place on ``count - unbounded`` of the others at least."""
    unbounded = sum(1 for n in copies if n is None)
    if unbounded >= count:
        return None
    return sum(n for n in copies if n is not None) // (count - unbounded)


def _copies(capacity: Vec, need: Vec) -> tuple[int | None, int | None]:
    """How many of ``need`` fit in ``capacity`` by memory and by threads (None: not asked)."""
    return (
        capacity.memory // need.memory if need.memory else None,
        capacity.threads // need.threads if need.threads else None,
    )
