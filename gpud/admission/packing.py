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

from gpud.admission.model import Demand, Device
from gpud.admission.placement_fit import mig_slices


@dataclass(frozen=True, slots=True)
class Packing:
    """``k_eff`` is None for a request that sets no limit: it shares and never waits."""

    k_eff: int | None
    vector: dict[str, int]  # dimension -> jobs of this class the node holds on it alone
    binding: str | None
    pool_size: int


def pack(demand: Demand, devices: Mapping[str, Device]) -> Packing:
    need = demand.per_device
    pool = [devices[u] for u in demand.pool]
    per_dim: dict[str, int] = {}
    if need.memory:
        per_dim["memory"] = sum(d.capacity.memory // need.memory for d in pool) // demand.count
    if need.threads:
        per_dim["threads"] = sum(d.capacity.threads // need.threads for d in pool) // demand.count
    if not per_dim:
        return Packing(None, {}, None, len(pool))
    copies = [
        min(
            d.capacity.memory // need.memory if need.memory else 1 << 30,
            d.capacity.threads // need.threads if need.threads else 1 << 30,
        )
        for d in pool
    ]
    if max(copies) <= 1:
        # Takes its devices whole: the device units bind as much as memory or threads.
        if pool and pool[0].is_mig:
            slices = sum(mig_slices(d.profile) or 1 for d in pool)
            per_dim["mig_slices"] = slices // (mig_slices(pool[0].profile) or 1) // demand.count
        else:
            per_dim["gpus"] = len(pool) // demand.count
    k_eff = sum(copies) // demand.count
    binding = min(per_dim, key=lambda dim: per_dim[dim])
    return Packing(k_eff, per_dim, binding, len(pool))
