"""The benchmark's node and job mix: mixed request sizes, service-time CV from 0.5 to 2.

``pools`` (the default) -- node: 8x H100-SXM5-80GB; GPUs 0-4 whole, GPU 5 split 7x 1g.10gb, GPU 6 3x 2g.20gb, GPU 7
2x 3g.40gb. Requests: a whole GPU (80 GB), a 3g.40gb device, a 1g.10gb device, and MPS
shares of a 2g.20gb device (10 GB, 50 % of its threads). Each class's arrival rate puts
every pool at the target utilisation; arrivals are Poisson, service times gamma-distributed.

``shared``: 8 whole GPUs shared by requests of different sizes (one GPU, two GPUs, an MPS
half of a GPU), 50/30/20 % of the load. Here servers free up in pieces and a large head of
the queue idles the GPUs it waits for: the quote's packing efficiency, measured from the
history, accounts for it (README: "Admission queue").
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from gpud.admission.model import Device, Request
from gpud.admission.node import synthetic
from gpud.admission.packing import pack
from gpud.admission.placement_fit import PlacementFit
from gpud.mig.layout import DeviceLayout
from tools.admission.sim import SimJob

MIB = 1 << 20
H100 = "H100-SXM5-80GB"
H100_MEMORY = 81559 * MIB


@dataclass(frozen=True, slots=True)
class JobClass:
    name: str
    request: Request
    mean_service_s: float
    cv: float
    load_share: float  # of its pool's load


CLASSES = (
    JobClass("1gpu", Request(gpu_count=1, memory_bytes=H100_MEMORY), 600.0, 1.0, 1.0),
    JobClass("3g.40gb", Request(mig_profile="3g.40gb", memory_bytes=40448 * MIB), 1200.0, 0.5, 1.0),
    JobClass("1g.10gb", Request(mig_profile="1g.10gb", memory_bytes=9984 * MIB), 300.0, 2.0, 1.0),
    JobClass(
        "2g.20gb/2",
        Request(mig_profile="2g.20gb", memory_bytes=10048 * MIB, threads_percent=50),
        450.0,
        1.5,
        1.0,
    ),
)


SHARED_CLASSES = (
    JobClass("1gpu", Request(gpu_count=1, memory_bytes=H100_MEMORY), 600.0, 1.0, 0.5),
    JobClass("2gpu", Request(gpu_count=2, memory_bytes=H100_MEMORY), 900.0, 0.5, 0.3),
    JobClass(
        "half",
        Request(gpu_count=1, memory_bytes=H100_MEMORY // 2, threads_percent=50),
        400.0,
        1.5,
        0.2,
    ),
)
MIXES = {"pools": CLASSES, "shared": SHARED_CLASSES}


def shared_node() -> list[Device]:
    return synthetic(H100, 8)


def bench_node() -> list[Device]:
    return synthetic(
        H100,
        8,
        {
            5: DeviceLayout.of(True, {"1g.10gb": 7}),
            6: DeviceLayout.of(True, {"2g.20gb": 3}),
            7: DeviceLayout.of(True, {"3g.40gb": 2}),
        },
    )


def arrival_rates(
    devices: Sequence[Device], rho: float, classes: Sequence[JobClass] = CLASSES
) -> dict[str, float]:
    """Per-class Poisson rates putting each pool at utilisation ``rho``."""
    fit = PlacementFit(devices)
    by_uuid = {d.uuid: d for d in devices}
    rates = {}
    for c in classes:
        demand = fit.demand(c.request)
        assert not isinstance(demand, type(None))
        k = pack(demand, by_uuid).k_eff  # type: ignore[arg-type]
        assert k
        rates[c.name] = rho * c.load_share * k / c.mean_service_s
    return rates


def generate(
    devices: Sequence[Device],
    rho: float,
    jobs: int,
    seed: int,
    classes: Sequence[JobClass] = CLASSES,
) -> list[SimJob]:
    rng = random.Random(seed)
    rates = arrival_rates(devices, rho, classes)
    total = sum(rates.values())
    names = list(rates)
    weights = [rates[n] / total for n in names]
    by_name = {c.name: c for c in classes}
    out = []
    t = 0.0
    for i in range(jobs):
        t += rng.expovariate(total)
        c = by_name[rng.choices(names, weights)[0]]
        shape = 1.0 / c.cv**2
        service = rng.gammavariate(shape, c.mean_service_s / shape)
        out.append(SimJob(f"j{i}", c.name, c.request, t, service))
    return out
