"""Scenario files: links, jobs and their per-iteration flows.

A scenario is JSON::

    {"name": "two-tors", "levels": 8, "update_interval_s": 1.0, "duration_s": 600,
     "warmup_s": 60,
     "links": {"tor1": {"gbps": 100}, "spine": {"gbps": 200}},
     "jobs": [{"id": "llm-a", "start_s": 0, "compute_s": 0.30,
               "flows": [{"bytes": 4e9, "path": ["tor1", "spine"]},
                         {"bytes": 4e9, "path": ["tor1"]}]}]}

Optional ``leveller``: the daemon's traffic knobs for this scenario (``threshold``,
``hysteresis``, ``max_age_s``, ``min_share``, ``progress_window_s``,
``progress_long_weight``, ``group_tolerance``; defaults: gpud's ``[traffic]`` defaults).

Per job, optional: ``overlap`` (0..1, the fraction of the contention-free communication
hidden under compute), ``stop_s``, ``iterations`` (stop after that many), ``gpus`` (scales
the compute work Crux ranks by; default 1), ``declare_ideal`` (default true: the job tells
the daemon its contention-free iteration time; false: the daemon learns it). Per flow,
optional ``count``: that many parallel flows of ``bytes`` each on the same path (NCCL
channels, parallel TCP connections), each sharing links as a flow of its own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ScenarioError(ValueError):
    """A scenario file is malformed; ``where`` names the offending field."""

    def __init__(self, message: str, *, where: str = "") -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where


@dataclass(frozen=True)
class FlowSpec:
    bytes: float
    path: tuple[str, ...]
    count: int = 1


@dataclass(frozen=True)
class JobSpec:
    id: str
    compute_s: float
    flows: tuple[FlowSpec, ...]
    start_s: float = 0.0
    overlap: float = 0.0
    stop_s: float | None = None
    iterations: int | None = None
    gpus: int = 1
    declare_ideal: bool = True


@dataclass(frozen=True)
class Scenario:
    name: str
    links: Mapping[str, float]  # link -> capacity in Gbit/s
    jobs: tuple[JobSpec, ...]
    levels: int = 8
    update_interval_s: float = 1.0
    duration_s: float = 600.0
    warmup_s: float = 60.0
    description: str = ""
    leveller: Mapping[str, float] = field(default_factory=dict)

    def link_bytes_per_s(self, link: str) -> float:
        return self.links[link] * 1e9 / 8

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (what :func:`from_dict` reads back)."""
        jobs: list[dict[str, Any]] = []
        for j in self.jobs:
            d: dict[str, Any] = {"id": j.id, "start_s": j.start_s, "compute_s": j.compute_s}
            if j.overlap:
                d["overlap"] = j.overlap
            if j.stop_s is not None:
                d["stop_s"] = j.stop_s
            if j.iterations is not None:
                d["iterations"] = j.iterations
            if j.gpus != 1:
                d["gpus"] = j.gpus
            if not j.declare_ideal:
                d["declare_ideal"] = False
            d["flows"] = [
                {
                    "bytes": f.bytes,
                    "path": list(f.path),
                    **({"count": f.count} if f.count != 1 else {}),
                }
                for f in j.flows
            ]
            jobs.append(d)
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out.update(
            levels=self.levels,
            update_interval_s=self.update_interval_s,
            duration_s=self.duration_s,
            warmup_s=self.warmup_s,
            links={name: {"gbps": gbps} for name, gbps in self.links.items()},
        )
        if self.leveller:
            out["leveller"] = dict(self.leveller)
        out["jobs"] = jobs
        return out


def load(path: str | Path) -> Scenario:
    """Read and validate a scenario file."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ScenarioError(f"not valid JSON: {err}", where=str(p)) from err
    return from_dict(raw)


def from_dict(raw: Any) -> Scenario:
    """Validate a parsed scenario; every error names the field."""
    if not isinstance(raw, dict):
        raise ScenarioError("a scenario is a JSON object")
    name = _str(raw, "name", "")
    links_raw = raw.get("links")
    if not isinstance(links_raw, dict) or not links_raw:
        raise ScenarioError("needs at least one link", where="links")
    links: dict[str, float] = {}
    for lname, lraw in links_raw.items():
        where = f"links.{lname}"
        if not isinstance(lraw, dict):
            raise ScenarioError("a link is an object with gbps", where=where)
        links[str(lname)] = _pos(lraw, "gbps", where)
    jobs_raw = raw.get("jobs")
    if not isinstance(jobs_raw, list) or not jobs_raw:
        raise ScenarioError("needs at least one job", where="jobs")
    jobs: list[JobSpec] = []
    seen: set[str] = set()
    for i, jraw in enumerate(jobs_raw):
        jobs.append(_job(jraw, f"jobs[{i}]", links))
        if jobs[-1].id in seen:
            raise ScenarioError(f"duplicate job id {jobs[-1].id!r}", where=f"jobs[{i}].id")
        seen.add(jobs[-1].id)
    scenario = Scenario(
        name=name,
        links=links,
        jobs=tuple(jobs),
        levels=int(_num(raw, "levels", "", default=8)),
        update_interval_s=_pos(raw, "update_interval_s", "", default=1.0),
        duration_s=_pos(raw, "duration_s", "", default=600.0),
        warmup_s=_num(raw, "warmup_s", "", default=60.0),
        description=str(raw.get("description", "")),
        leveller=_knobs(raw.get("leveller", {})),
    )
    if not 2 <= scenario.levels <= 8:
        raise ScenarioError("must be in [2, 8]", where="levels")
    if not 0 <= scenario.warmup_s < scenario.duration_s:
        raise ScenarioError("must be in [0, duration_s)", where="warmup_s")
    return scenario


def _job(raw: Any, where: str, links: Mapping[str, float]) -> JobSpec:
    if not isinstance(raw, dict):
        raise ScenarioError("a job is an object", where=where)
    job_id = _str(raw, "id", where)
    flows_raw = raw.get("flows", [])
    if not isinstance(flows_raw, list):
        raise ScenarioError("a list of flows", where=f"{where}.flows")
    flows: list[FlowSpec] = []
    for k, fraw in enumerate(flows_raw):
        fwhere = f"{where}.flows[{k}]"
        if not isinstance(fraw, dict):
            raise ScenarioError("a flow is an object", where=fwhere)
        path = fraw.get("path")
        if not isinstance(path, list) or not path:
            raise ScenarioError("a non-empty list of link names", where=f"{fwhere}.path")
        for hop in path:
            if hop not in links:
                raise ScenarioError(f"unknown link {hop!r}", where=f"{fwhere}.path")
        if len(set(path)) != len(path):
            raise ScenarioError("a path crosses each link once", where=f"{fwhere}.path")
        count = int(_num(fraw, "count", fwhere, default=1))
        if count < 1:
            raise ScenarioError("must be >= 1", where=f"{fwhere}.count")
        flows.append(FlowSpec(bytes=_pos(fraw, "bytes", fwhere), path=tuple(path), count=count))
    compute = _num(raw, "compute_s", where, default=0.0)
    if compute < 0:
        raise ScenarioError("must be >= 0", where=f"{where}.compute_s")
    if compute == 0 and not flows:
        raise ScenarioError("a job needs compute or flows", where=where)
    overlap = _num(raw, "overlap", where, default=0.0)
    if not 0 <= overlap <= 1:
        raise ScenarioError("must be in [0, 1]", where=f"{where}.overlap")
    start = _num(raw, "start_s", where, default=0.0)
    if start < 0:
        raise ScenarioError("must be >= 0", where=f"{where}.start_s")
    stop = raw.get("stop_s")
    if stop is not None:
        stop = _num(raw, "stop_s", where)
        if stop <= start:
            raise ScenarioError("must be > start_s", where=f"{where}.stop_s")
    iterations = raw.get("iterations")
    if iterations is not None:
        iterations = int(_num(raw, "iterations", where))
        if iterations < 1:
            raise ScenarioError("must be >= 1", where=f"{where}.iterations")
    gpus = int(_num(raw, "gpus", where, default=1))
    if gpus < 1:
        raise ScenarioError("must be >= 1", where=f"{where}.gpus")
    declare = raw.get("declare_ideal", True)
    if not isinstance(declare, bool):
        raise ScenarioError("must be true or false", where=f"{where}.declare_ideal")
    return JobSpec(
        id=job_id,
        compute_s=compute,
        flows=tuple(flows),
        start_s=start,
        overlap=overlap,
        stop_s=stop,
        iterations=iterations,
        gpus=gpus,
        declare_ideal=declare,
    )


LEVELLER_KNOBS = (
    "threshold",
    "hysteresis",
    "max_age_s",
    "min_share",
    "progress_window_s",
    "progress_long_weight",
    "group_tolerance",
)


def _knobs(raw: Any) -> dict[str, float]:
    if not isinstance(raw, dict):
        raise ScenarioError("an object of traffic knobs", where="leveller")
    out: dict[str, float] = {}
    for key in raw:
        if key not in LEVELLER_KNOBS:
            raise ScenarioError(
                f"unknown knob {key!r}; known: {', '.join(LEVELLER_KNOBS)}", where="leveller"
            )
        value = _num(raw, key, "leveller")
        if value < 0:
            raise ScenarioError("must be >= 0", where=f"leveller.{key}")
        out[key] = value
    return out


def _str(raw: Mapping[str, Any], key: str, where: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value:
        raise ScenarioError("a non-empty string", where=_join(where, key))
    return value


def _num(raw: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ScenarioError("a finite number", where=_join(where, key))
    return float(value)


def _pos(raw: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    value = _num(raw, key, where, default)
    if value <= 0:
        raise ScenarioError("must be > 0", where=_join(where, key))
    return value


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
