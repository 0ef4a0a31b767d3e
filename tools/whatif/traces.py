"""Job traces the what-if tool replays, read into simulation jobs.

gpud's own history (``gpuctl jobs history --json``)
    One record per run: ``queued_unix_seconds`` is the arrival, ``ended - started`` the
    service time, ``placement`` the request (``gpu_count``, ``mig_profile``, ``devices``,
    ``memory_limit_bytes``, ``threads_percent``). Runs that have not ended are skipped.

Alibaba PAI (``pai_task_table.csv`` of alibaba/clusterdata ``cluster-trace-gpu-v2020``)
    Columns ``job_name, task_name, inst_num, status, start_time, end_time, plan_cpu,
    plan_mem, plan_gpu, gpu_type`` (the published file has no header; a header row naming
    them is accepted). Field mapping, per row:

    - arrival: ``start_time`` (seconds; the trace records no submit time, so replay asks
      for the GPUs when the task actually started);
    - service time: ``end_time - start_time``;
    - request, per instance (``inst_num`` jobs of the same shape arrive together):
      ``plan_gpu`` is in percent of one GPU. ``>= 100``: ``ceil(plan_gpu / 100)`` whole GPUs,
      each taken whole (all its memory); ``< 100``: an MPS share of one GPU, with that
      percentage of its threads and of its memory;
    - skipped: rows whose status is not ``Terminated``, or that lack times or ``plan_gpu``
      (CPU-only tasks).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpud.admission.model import Request
from tools.admission.sim import SimJob

PAI_COLUMNS = (
    "job_name",
    "task_name",
    "inst_num",
    "status",
    "start_time",
    "end_time",
    "plan_cpu",
    "plan_mem",
    "plan_gpu",
    "gpu_type",
)


class TraceError(ValueError):
    """The trace cannot be read: names the file and, where it can, the line."""


@dataclass(frozen=True, slots=True)
class Trace:
    jobs: list[SimJob]
    skipped: int


def load(path: Path, *, fmt: str = "auto", gpu_memory_bytes: int) -> Trace:
    """Read ``path`` as ``gpud`` (history JSON) or ``pai`` (task CSV); ``auto`` goes by the
    first character. ``gpu_memory_bytes`` sizes whole-GPU and fractional PAI requests."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise TraceError(f"{path}: cannot read: {err.strerror}") from err
    if fmt == "auto":
        fmt = "gpud" if text.lstrip().startswith("{") else "pai"
    if fmt == "gpud":
        return gpud_history(text, path=str(path))
    if fmt == "pai":
        return pai_tasks(text, path=str(path), gpu_memory_bytes=gpu_memory_bytes)
    raise TraceError(f"{path}: unknown trace format {fmt!r} (gpud, pai)")


def gpud_history(text: str, *, path: str = "<history>") -> Trace:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise TraceError(f"{path}: not JSON: {err}") from err
    records = doc.get("records") if isinstance(doc, dict) else None
    if not isinstance(records, list):
        raise TraceError(f"{path}: expected {{'records': [...]}} (gpuctl jobs history --json)")
    jobs: list[SimJob] = []
    skipped = 0
    for i, r in enumerate(records):
        # a run still going has no end: `gpuctl jobs history --json` writes it as null
        if not isinstance(r, dict) or r.get("ended_unix_seconds") is None:
            skipped += 1
            continue
        try:
            request = _placement(r.get("placement", {}))
            arrival = float(r["queued_unix_seconds"])
            service = float(r["ended_unix_seconds"]) - float(r["started_unix_seconds"])
        except (KeyError, TypeError, ValueError) as err:
            raise TraceError(f"{path}: records[{i}]: {err}") from err
        jobs.append(
            SimJob(
                f"{r.get('job', 'job')}#{i}",
                request.describe(),
                request,
                arrival,
                max(service, 0.0),
            )
        )
    return Trace(jobs, skipped)


def _placement(p: dict[str, Any]) -> Request:
    def num(key: str) -> int | None:
        value = p.get(key)
        return int(value) if value is not None else None

    return Request(
        devices=tuple(p.get("devices", ())),
        mig_profile=p.get("mig_profile"),
        gpu_count=num("gpu_count"),
        memory_bytes=num("memory_limit_bytes"),
        threads_percent=num("threads_percent"),
    )


def pai_tasks(text: str, *, path: str = "<pai>", gpu_memory_bytes: int) -> Trace:
    rows = list(csv.reader(text.splitlines()))
    if rows and rows[0] and rows[0][0] == "job_name":
        header = rows[0]
        missing = [
            c
            for c in ("inst_num", "status", "start_time", "end_time", "plan_gpu")
            if c not in header
        ]
        if missing:
            raise TraceError(f"{path}: header lacks {', '.join(missing)}")
        rows = rows[1:]
        start = 2
    else:
        header = list(PAI_COLUMNS)
        start = 1
    col = {name: i for i, name in enumerate(header)}
    jobs: list[SimJob] = []
    skipped = 0
    for line, row in enumerate(rows, start=start):
        if not row:
            continue
        if len(row) < len(col):
            raise TraceError(f"{path}:{line}: {len(row)} fields, expected {len(col)}")
        fields = {name: row[i].strip() for name, i in col.items()}
        try:
            begin, end = float(fields["start_time"]), float(fields["end_time"])
            plan_gpu = float(fields["plan_gpu"])
            instances = int(float(fields["inst_num"] or 1))
        except ValueError:
            skipped += 1
            continue
        if (
            fields["status"] != "Terminated"
            or not plan_gpu > 0
            or not end >= begin
            or math.isnan(plan_gpu)
        ):
            skipped += 1
            continue
        request = pai_request(plan_gpu, gpu_memory_bytes)
        for k in range(max(instances, 1)):
            jobs.append(
                SimJob(
                    f"{fields['job_name']}/{fields['task_name']}/{k}",
                    request.describe(),
                    request,
                    begin,
                    end - begin,
                )
            )
    return Trace(jobs, skipped)


def pai_request(plan_gpu: float, gpu_memory_bytes: int) -> Request:
    if plan_gpu >= 100:
        return Request(gpu_count=math.ceil(plan_gpu / 100), memory_bytes=gpu_memory_bytes)
    share = max(1, min(100, round(plan_gpu)))
    return Request(gpu_count=1, memory_bytes=gpu_memory_bytes * share // 100, threads_percent=share)


def describe_formats() -> Sequence[str]:
    return ("gpud", "pai")
