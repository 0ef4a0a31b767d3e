"""Unfeasible requests, and the MIG layouts that would make them feasible.

A request is *quotable* when some state of the node hosts it (its demand fits the empty
node): under a stable load its wait is finite. Otherwise it is *unfeasible*: no wait makes
it start without changing the node. When the operator names a mig-parted file
(``[admission] mig_config``), each of its named configs is tried on the node's GPUs (GPUs a
config does not match keep their devices): the configs under which the request becomes
feasible are the remedy offered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from gpud.admission.model import Demand, Device, FitCheck, Request, Unfeasible
from gpud.admission.node import gpu_devices
from gpud.backend.port import GpuIdentity
from gpud.errors import GpudError
from gpud.mig.layout import DeviceLayout, MigConfigFile, resolve


def resolve_configs(
    file: MigConfigFile, gpus: Sequence[GpuIdentity]
) -> dict[str, dict[int, DeviceLayout]]:
    """Every named config of a mig-parted file, resolved on ``gpus``; configs that do not
    apply to this node (no GPU matches, or a GPU index it lacks) are left out."""
    out = {}
    for name, entries in file.configs.items():
        try:
            layouts = resolve(entries, gpus)
        except GpudError:
            continue
        if layouts:
            out[name] = layouts
    return out


def with_layouts(
    devices: Sequence[Device], layouts: Mapping[int, DeviceLayout], products: Mapping[int, str]
) -> list[Device]:
    """The node's devices if GPU ``i`` were laid out as ``layouts[i]`` (product ``products[i]``)."""
    out: list[Device] = []
    gpus = sorted({d.gpu for d in devices} | set(layouts))
    for gpu in gpus:
        if gpu in layouts and gpu in products:
            out.extend(gpu_devices(products[gpu], gpu, layouts[gpu]))
        else:
            out.extend(d for d in devices if d.gpu == gpu)
    return out


def remedies(
    request: Request,
    devices: Sequence[Device],
    configs: Mapping[str, Mapping[int, DeviceLayout]],
    products: Mapping[int, str],
    fit_for: Callable[[Sequence[Device]], FitCheck],
) -> list[str]:
    """Names of the configs (of a mig-parted file, resolved per GPU) that host ``request``."""
    out = []
    for name, layouts in sorted(configs.items()):
        try:
            candidate = with_layouts(devices, layouts, products)
        except GpudError:
            continue  # a layout this product cannot take
        if isinstance(fit_for(candidate).demand(request), Demand):
            out.append(name)
    return out


def classify(
    request: Request,
    fit: FitCheck,
    *,
    configs: Mapping[str, Mapping[int, DeviceLayout]] = {},
    products: Mapping[int, str] = {},
    fit_for: Callable[[Sequence[Device]], FitCheck] | None = None,
    config_file: str = "",
) -> Demand | Unfeasible:
    """The request's demand (quotable), or why it is unfeasible with a remedy if one exists."""
    demand = fit.demand(request)
    if isinstance(demand, Demand) or fit_for is None or not configs:
        return demand
    names = remedies(request, fit.devices(), configs, products, fit_for)
    if not names:
        return Unfeasible(demand.reason, f"no config of {config_file or 'the MIG file'} hosts it")
    where = f" -f {config_file}" if config_file else ""
    return Unfeasible(
        demand.reason,
        f"feasible under MIG config {', '.join(repr(n) for n in names)}"
        f" (gpuctl mig apply{where} -c {names[0]})",
    )
