"""Admission's devices, from what the daemon sees or from a product and a MIG layout.

The second form lets the what-if tool and the benchmark describe nodes gpud does not run
on: ``H100-SXM5-80GB`` x 8 with GPUs 6 and 7 split ``7x 1g.10gb``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from gpud.admission.model import Device, Vec
from gpud.backend.products import lookup
from gpud.errors import InvalidArgument
from gpud.mig.layout import DeviceLayout
from gpud.shared import MAX_THREADS_PERCENT

if TYPE_CHECKING:
    # annotations alone: loading the MPS manager would load the store and the daemon's
    # threads and programs into the pure policy that imports this module
    from gpud.mps.manager import MpsTarget

MIB = 1 << 20


def from_targets(
    targets: Sequence[MpsTarget],
    products: Mapping[int, str] = {},
    default_memory: Mapping[str, int] = {},
    default_threads: Mapping[str, int] = {},
) -> list[Device]:
    """The devices the daemon's MPS manager knows (one per GPU, or per MIG device), each
    with its MPS default pinned memory limit (``default_memory[uuid]``, where it has one)
    and thread share (``default_threads[uuid]``).

    A GPU never read since gpud started (lost, hung: UUID "", memory 0, as ``nvidia-smi``
    cannot list it either) has the framebuffer of its product as last seen
    (``products[index]``), or else an unknown size: it may well answer again."""
    out = []
    for t in targets:
        if t.uuid:
            capacity = Vec(t.memory_total_bytes, MAX_THREADS_PERCENT)
            out.append(
                Device(
                    t.uuid,
                    t.gpu,
                    t.mig,
                    t.profile,
                    capacity,
                    default_memory=default_memory.get(t.uuid),
                    default_threads=default_threads.get(t.uuid),
                )
            )
            continue
        spec = lookup(products.get(t.gpu, ""))
        memory = spec.memory_mib * MIB if spec is not None else 0
        out.append(
            Device(
                t.uuid,
                t.gpu,
                t.mig,
                spec.key if spec is not None else t.profile,
                Vec(memory, MAX_THREADS_PERCENT),
                size_known=spec is not None,
            )
        )
    return out


def synthetic(product: str, gpus: int, layouts: Mapping[int, DeviceLayout] = {}) -> list[Device]:
    """``gpus`` GPUs of ``product`` (a key of the simulated node's product table), each
    whole or split as ``layouts[index]`` says. UUIDs are ``GPU-<i>`` and ``MIG-<i>-<j>``."""
    out: list[Device] = []
    for gpu in range(gpus):
        out.extend(gpu_devices(product, gpu, layouts.get(gpu)))
    return out


def gpu_devices(product: str, gpu: int, layout: DeviceLayout | None) -> list[Device]:
    """The devices GPU ``gpu`` of ``product`` has under ``layout`` (None: whole)."""
    spec = lookup(product)
    if spec is None:
        raise InvalidArgument(f"unknown product {product!r}", field="product")
    if layout is None or not layout.mig_enabled:
        return [
            Device(
                f"GPU-{gpu}", gpu, None, spec.key, Vec(spec.memory_mib * MIB, MAX_THREADS_PERCENT)
            )
        ]
    memory = {p.name: p.memory_mib * MIB for p in spec.mig_profiles}
    out = []
    for j, profile in enumerate(layout.profiles()):
        name = profile.gi_name
        if name not in memory:
            raise InvalidArgument(f"{spec.key} has no MIG profile {name}", field="mig-devices")
        out.append(
            Device(f"MIG-{gpu}-{j}", gpu, j, str(profile), Vec(memory[name], MAX_THREADS_PERCENT))
        )
    return out
