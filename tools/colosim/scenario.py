"""Scenarios: GPUs, a training workload, inference services, and the hidden interference.

A scenario is JSON::

    {"name": "prod-backlog", "gpus": {"product": "H100-SXM5-80GB", "count": 8, "memory_gib": 80},
     "duration_s": 10800, "tick_s": 5, "load": 2.8, "mix": "production",
     "mean_work_s": 1800, "under_declare": 0.1,
     "services": [{"name": "chat", "type": "llm-chat", "mean_load": 0.35,
                   "diurnal_amp": 0.4, "period_s": 7200, "bursts_per_h": 2,
                   "burst_factor": 1.4, "burst_s": 120}],
     "interference_seed": 0}

``load`` is the offered training work over what exclusive allocation can serve (the GPUs
left after one per service): arrivals are Poisson at ``load * gpus_for_training /
mean_work_s`` over ``duration_s``. Work per job (seconds alone on a whole GPU) is
log-normal with mean ``mean_work_s`` (sigma ``work_sigma``), job types are drawn from
``mix`` (a name in workloads.MIXES or {type: weight}). A fraction ``declared_shapes`` of
jobs declare their SM activity and bandwidth alone, off by a log-normal error (sigma 0.25)
as an offline profile on other hardware would be. ``under_declare`` is the fraction of
jobs whose memory grows past what they declare (to 1.25-1.4x) at run time. A service's
``mean_load`` is a fraction of what one whole GPU sustains within its SLO; the load is
diurnal (``diurnal_amp``, ``period_s``) with Poisson bursts. ``jobs`` may list jobs
explicitly instead: ``[{"id", "type", "arrival_s", "work_s", "mem_factor"}]``.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.colosim.workloads import MIXES, SERVICE_TYPES, TRAIN_TYPES, TrainType

P99 = math.log(100.0)


class ScenarioError(ValueError):
    """A scenario file is malformed; ``where`` names the offending field."""

    def __init__(self, message: str, *, where: str = "") -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    type: str
    mean_load: float = 0.35
    diurnal_amp: float = 0.4
    period_s: float = 7200.0
    bursts_per_h: float = 2.0
    burst_factor: float = 1.4
    burst_s: float = 120.0

    @property
    def capacity(self) -> float:
        """Request rate one whole GPU sustains within the SLO."""
        t = SERVICE_TYPES[self.type]
        return t.mu - P99 / t.slo_s

    @property
    def peak_load(self) -> float:
        """What the service is provisioned for: diurnal peak times a burst."""
        return self.mean_load * self.capacity * (1 + self.diurnal_amp) * self.burst_factor


@dataclass(frozen=True)
class JobSpec:
    id: str
    type: str
    arrival_s: float
    work_s: float
    mem_factor: float = 1.0  # peak memory over the declared memory
    # What the job declares of its shape (SM activity and bandwidth alone), with the error
    # of an offline profile; None: declared nothing.
    declared_sm: float | None = None
    declared_bw: float | None = None

    @property
    def ttype(self) -> TrainType:
        return TRAIN_TYPES[self.type]


@dataclass(frozen=True)
class Trace:
    jobs: tuple[JobSpec, ...]
    bursts: Mapping[str, tuple[tuple[float, float], ...]]
    noise_seed: int


@dataclass(frozen=True)
class Scenario:
    name: str
    gpu_count: int
    duration_s: float
    load: float
    services: tuple[ServiceSpec, ...] = ()
    product: str = "H100-SXM5-80GB"
    gpu_memory_gib: float = 80.0
    tick_s: float = 5.0
    mix: Mapping[str, float] = field(default_factory=lambda: dict(MIXES["production"]))
    mean_work_s: float = 1800.0
    work_sigma: float = 0.8
    under_declare: float = 0.1
    declared_shapes: float = 0.8
    interference_seed: int = 0
    description: str = ""
    jobs: tuple[JobSpec, ...] | None = None

    @property
    def regime(self) -> str:
        return "stable" if self.load <= 1.0 else "backlog"

    @property
    def training_gpus(self) -> int:
        return max(1, self.gpu_count - len(self.services))

    def trace(self, seed: int) -> Trace:
        """The seeded trace every policy runs on."""
        rng = random.Random(f"{self.name}:{seed}")
        bursts: dict[str, tuple[tuple[float, float], ...]] = {}
        horizon = self.duration_s * max(8.0, 4.0 * self.load)
        for s in self.services:
            out, t = [], 0.0
            rate = s.bursts_per_h / 3600.0
            while rate > 0:
                t += rng.expovariate(rate)
                if t > horizon:
                    break
                out.append((t, t + s.burst_s))
            bursts[s.name] = tuple(out)
        if self.jobs is not None:
            return Trace(self.jobs, bursts, rng.randrange(1 << 30))
        names = sorted(self.mix)
        weights = [self.mix[n] for n in names]
        rate = self.load * self.training_gpus / self.mean_work_s
        mu = math.log(self.mean_work_s) - self.work_sigma**2 / 2
        jobs: list[JobSpec] = []
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= self.duration_s:
                break
            kind = rng.choices(names, weights)[0]
            work = min(8 * self.mean_work_s, max(120.0, rng.lognormvariate(mu, self.work_sigma)))
            grow = rng.uniform(1.25, 1.4) if rng.random() < self.under_declare else 1.0
            grow *= TRAIN_TYPES[kind].growth
            tt = TRAIN_TYPES[kind]
            declares = rng.random() < self.declared_shapes
            err_sm, err_bw = math.exp(rng.gauss(0, 0.25)), math.exp(rng.gauss(0, 0.25))
            jobs.append(
                JobSpec(
                    f"j{len(jobs):04d}",
                    kind,
                    round(t, 3),
                    round(work, 1),
                    grow,
                    declared_sm=min(1.0, tt.sm * err_sm) if declares else None,
                    declared_bw=min(1.0, tt.bw * err_bw) if declares else None,
                )
            )
        return Trace(tuple(jobs), bursts, rng.randrange(1 << 30))


def _num(
    d: Mapping[str, Any], key: str, default: float, lo: float, hi: float, *, where: str
) -> float:
    v = d.get(key, default)
    if not isinstance(v, int | float) or isinstance(v, bool) or not lo <= v <= hi:
        raise ScenarioError(f"{key} must be a number in [{lo}, {hi}], got {v!r}", where=where)
    return float(v)


def parse(data: Mapping[str, Any], where: str = "scenario") -> Scenario:
    if not isinstance(data, Mapping):
        raise ScenarioError("must be a JSON object", where=where)
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ScenarioError("name must be a non-empty string", where=where)
    gpus = data.get("gpus", {})
    if not isinstance(gpus, Mapping):
        raise ScenarioError("gpus must be an object", where=where)
    mix_raw = data.get("mix", "production")
    if isinstance(mix_raw, str):
        if mix_raw not in MIXES:
            raise ScenarioError(f"unknown mix {mix_raw!r} (known: {', '.join(MIXES)})", where=where)
        mix = dict(MIXES[mix_raw])
    elif isinstance(mix_raw, Mapping):
        mix = {}
        for k in mix_raw:
            if k not in TRAIN_TYPES:
                raise ScenarioError(f"unknown training type {k!r}", where=f"{where}.mix")
            mix[k] = _num(mix_raw, k, 0, 0, 1e6, where=f"{where}.mix")
    else:
        raise ScenarioError("mix must be a name or an object", where=where)
    services = []
    for i, s in enumerate(data.get("services", [])):
        w = f"{where}.services[{i}]"
        if not isinstance(s, Mapping) or s.get("type") not in SERVICE_TYPES:
            raise ScenarioError(f"type must be one of {', '.join(SERVICE_TYPES)}", where=w)
        services.append(
            ServiceSpec(
                name=str(s.get("name", f"svc{i}")),
                type=str(s["type"]),
                mean_load=_num(s, "mean_load", 0.35, 0.0, 1.0, where=w),
                diurnal_amp=_num(s, "diurnal_amp", 0.4, 0.0, 1.0, where=w),
                period_s=_num(s, "period_s", 7200, 60, 1e7, where=w),
                bursts_per_h=_num(s, "bursts_per_h", 2, 0, 120, where=w),
                burst_factor=_num(s, "burst_factor", 1.4, 1.0, 5.0, where=w),
                burst_s=_num(s, "burst_s", 120, 1, 3600, where=w),
            )
        )
    jobs: tuple[JobSpec, ...] | None = None
    if "jobs" in data:
        listed: list[JobSpec] = []
        for i, j in enumerate(data["jobs"]):
            w = f"{where}.jobs[{i}]"
            if not isinstance(j, Mapping) or j.get("type") not in TRAIN_TYPES:
                raise ScenarioError(f"type must be one of {', '.join(TRAIN_TYPES)}", where=w)
            listed.append(
                JobSpec(
                    id=str(j.get("id", f"j{i:04d}")),
                    type=str(j["type"]),
                    arrival_s=_num(j, "arrival_s", 0, 0, 1e8, where=w),
                    work_s=_num(j, "work_s", 600, 1, 1e8, where=w),
                    mem_factor=_num(j, "mem_factor", 1.0, 0.1, 10, where=w),
                )
            )
        jobs = tuple(listed)
    count = int(_num(gpus, "count", 8, 1, 64, where=f"{where}.gpus"))
    if len(services) >= count:
        raise ScenarioError("needs more GPUs than services", where=where)
    return Scenario(
        name=name,
        description=str(data.get("description", "")),
        gpu_count=count,
        product=str(gpus.get("product", "H100-SXM5-80GB")),
        gpu_memory_gib=_num(gpus, "memory_gib", 80, 1, 1024, where=f"{where}.gpus"),
        duration_s=_num(data, "duration_s", 10800, 60, 1e7, where=where),
        tick_s=_num(data, "tick_s", 5, 0.5, 600, where=where),
        load=_num(data, "load", 0.7, 0.0, 20.0, where=where),
        mix=mix,
        mean_work_s=_num(data, "mean_work_s", 1800, 10, 1e7, where=where),
        work_sigma=_num(data, "work_sigma", 0.8, 0.0, 3.0, where=where),
        under_declare=_num(data, "under_declare", 0.1, 0.0, 1.0, where=where),
        declared_shapes=_num(data, "declared_shapes", 0.8, 0.0, 1.0, where=where),
        interference_seed=int(_num(data, "interference_seed", 0, 0, 2**31, where=where)),
        services=tuple(services),
        jobs=jobs,
    )


def load(path: Path) -> Scenario:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ScenarioError(str(err), where=str(path)) from err
    return parse(data, where=str(path))
