"""Replay a trace through gpud's admission (queue, backfill, placement) on a simulated
clock, for a node described by product, GPU count and an optional mig-parted layout."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpud.admission.model import Device
from gpud.admission.node import MIB, synthetic
from gpud.admission.placement_fit import PlacementFit
from gpud.admission.wws import WEIGHTS, percentile, wws
from gpud.backend.port import GpuIdentity
from gpud.backend.products import lookup
from gpud.errors import InvalidArgument
from gpud.mig.layout import load_config, resolve
from tools.admission.sim import SimJob, simulate


@dataclass(frozen=True, slots=True)
class NodeSpec:
    product: str
    gpus: int
    mig_file: Path | None = None
    mig_config: str | None = None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"product": self.product, "gpus": self.gpus}
        if self.mig_file is not None:
            out["mig_config"] = f"{self.mig_file}:{self.mig_config}"
        return out

    def devices(self) -> list[Device]:
        spec = lookup(self.product)
        if spec is None:
            raise InvalidArgument(f"unknown product {self.product!r}", field="product")
        if self.gpus < 1:
            raise InvalidArgument(f"{self.gpus} GPUs: need at least 1", field="gpus")
        layouts = {}
        if self.mig_file is not None:
            if not self.mig_config:
                raise InvalidArgument("give the config name with -c", field="mig-config")
            identities = [
                GpuIdentity(
                    i,
                    f"GPU-{i}",
                    spec.nvml_name,
                    spec.key,
                    "",
                    spec.pci_device_id,
                    spec.memory_mib * MIB,
                    spec.mig_capable,
                )
                for i in range(self.gpus)
            ]
            layouts = resolve(load_config(self.mig_file).config(self.mig_config), identities)
        return synthetic(self.product, self.gpus, layouts)


@dataclass(frozen=True, slots=True)
class Replay:
    waits: list[float]
    unfeasible: int
    jobs: int

    def summary(self, mean_service_s: float) -> dict[str, float]:
        u = self.unfeasible / self.jobs if self.jobs else 0.0
        return {
            "mean_wait_s": statistics.fmean(self.waits) if self.waits else 0.0,
            "p95_wait_s": percentile(self.waits, 0.95),
            "unfeasible_fraction": u,
            "wws": wws(self.waits, mean_service_s=mean_service_s, unfeasible_fraction=u),
        }


def replay(jobs: Sequence[SimJob], node: NodeSpec, *, backfill: bool = True) -> Replay:
    out = simulate(jobs, PlacementFit(node.devices()), backfill=backfill)
    waits = [r.wait_s for r in out.records if r.wait_s is not None]
    return Replay(waits, len(out.unfeasible), len(jobs))


def compare(
    jobs: Sequence[SimJob], as_is: NodeSpec, modified: NodeSpec
) -> tuple[dict[str, Any], Replay, Replay]:
    mean_service = statistics.fmean(j.service for j in jobs) if jobs else 0.0
    before = replay(jobs, as_is)
    after = replay(jobs, modified)
    result = {
        "jobs": len(jobs),
        "mean_service_s": mean_service,
        "wws_weights": list(WEIGHTS),
        "as_is": {**as_is.describe(), **before.summary(mean_service)},
        "modified": {**modified.describe(), **after.summary(mean_service)},
    }
    return result, before, after
