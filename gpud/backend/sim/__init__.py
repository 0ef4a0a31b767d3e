"""A simulated GPU node: a fake ``pynvml`` module plus the controls a test or operator needs.

``SimNode`` is what ``gpud --simulate H100-SXM5-80GB:8`` runs on. Its ``.nvml`` behaves like
``pynvml`` for the products in :mod:`gpud.backend.products`, so the real adapter
(:class:`gpud.backend.nvml.NvmlBackend`) runs on it unchanged. ``.faults`` injects failures,
``.workloads`` runs simulated processes, ``.jobs`` runs workload models behind the jobs' host
processes (:mod:`gpud.backend.sim.jobmodels`), ``reset(gpu)`` is ``nvidia-smi --gpu-reset -i N``,
``reboot()`` stands for a node reboot or driver reload. With ``state_file`` the driver's MIG
state and the injected faults outlive the daemon process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from gpud.backend import products
from gpud.backend.sim.fakenvml import FakeNvml, NVMLError_InUse, SimulatedCrash
from gpud.backend.sim.faults import FaultInjector
from gpud.backend.sim.jobmodels import JobDevice, JobWorkloads
from gpud.backend.sim.workloads import Workload, Workloads
from gpud.errors import ConfigError, DeviceNotFound, InUse

__all__ = [
    "DEFAULT_SPEC",
    "FakeNvml",
    "FaultInjector",
    "JobDevice",
    "JobWorkloads",
    "SimNode",
    "SimulatedCrash",
    "Workload",
    "Workloads",
    "parse_simulate_spec",
    "products",
]

DEFAULT_SPEC: Final = "H100-SXM5-80GB:8"
MAX_GPUS: Final = 64


def parse_simulate_spec(spec: str | None) -> list[tuple[str, int]]:
    """``"H100-SXM5-80GB:8,A100-SXM4-40GB:2"`` -> ``[("H100-SXM5-80GB", 8), ...]``.

    Product names are gpud keys or NVML names, in any case ("nvidia h100 80gb hbm3:2");
    the count defaults to 1. An empty spec means ``H100-SXM5-80GB:8``.
    """
    text = (spec or "").strip() or DEFAULT_SPEC
    out: list[tuple[str, int]] = []
    total = 0
    for part in text.split(","):
        item = part.strip()
        if not item:
            continue
        name, sep, count_text = item.rpartition(":")
        if not sep:
            name, count_text = item, "1"
        product = products.lookup(name.strip())
        if product is None:
            known = ", ".join(products.PRODUCTS)
            raise ConfigError(f"unknown simulated GPU product {name.strip()!r}; known: {known}")
        try:
            count = int(count_text)
        except ValueError:
            raise ConfigError(
                f"GPU count {count_text!r} for {product.key} is not a number"
            ) from None
        if count < 1:
            raise ConfigError(f"GPU count for {product.key} must be at least 1, not {count}")
        total += count
        out.append((product.key, count))
    if not out:
        raise ConfigError("no simulated GPUs given")
    if total > MAX_GPUS:
        raise ConfigError(f"{total} simulated GPUs is more than a node holds (at most {MAX_GPUS})")
    return out


class SimNode:
    """A node of simulated GPUs, listed in the order of ``spec``."""

    def __init__(
        self,
        spec: list[tuple[str, int]],
        *,
        state_file: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        seed: int = 0,
        proc_root: Path = Path("/proc"),
    ) -> None:
        gpus: list[products.ProductSpec] = []
        for name, count in spec:
            product = products.lookup(name)
            if product is None:
                raise ConfigError(
                    f"unknown simulated GPU product {name!r}; known: {', '.join(products.PRODUCTS)}"
                )
            gpus.extend([product] * count)
        self.spec = [(p, n) for p, n in spec]
        self.nvml = FakeNvml(gpus, state_file=state_file, clock=clock, sleep=sleep, seed=seed)
        self.faults = FaultInjector(self.nvml)
        self.workloads = Workloads(self.nvml, proc_root=proc_root)
        self.jobs = JobWorkloads(self.workloads, proc_root=proc_root)
        # the declared processes whose host process exited while no daemon ran: ended
        # now, reported by the daemon once its event log is open (:meth:`take_ended`)
        self._ended = self.workloads.end_exited()

    def take_ended(self) -> list[Workload]:
        """The declared processes that ended when the node was set up, their host process
        having exited while no daemon ran (one per GPU); each is returned once."""
        ended, self._ended = self._ended, []
        return ended

    @property
    def gpu_count(self) -> int:
        return self.nvml.sim_gpu_count

    def reboot(self) -> None:
        """Reboot / driver reload: MIG instances, processes and faults go, pending MIG mode
        applies."""
        self.nvml.sim_reboot()

    def reset(self, gpu: int) -> None:
        """``nvidia-smi --gpu-reset -i N``, as the NVML adapter's reset runner: see
        :meth:`FakeNvml.sim_reset`. Raises :class:`gpud.errors.InUse` while a process runs
        on the GPU, :class:`gpud.errors.DeviceNotFound` for no such GPU."""
        if not 0 <= gpu < self.nvml.sim_gpu_count:
            raise DeviceNotFound(f"no GPU {gpu} (the node has {self.gpu_count})", gpu=gpu)
        try:
            self.nvml.sim_reset(gpu)
        except NVMLError_InUse as err:
            raise InUse(
                f"GPU {gpu} cannot be reset: in use by another client (processes run on it)",
                gpu=gpu,
                call="nvidia-smi --gpu-reset",
            ) from err
