"""A discrete-event simulation of one node's admission queue, on a simulated clock.

It drives the daemon's own code: :func:`gpud.admission.queue.admission_pass` decides what
starts, :class:`gpud.admission.placement_fit.PlacementFit` what fits. Jobs arrive, queue,
start on the devices the pass gives them, and hold them for their service time.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpud.admission.estimate import Record
from gpud.admission.model import Demand, FitCheck, Holding, Request, Unfeasible
from gpud.admission.queue import Queued, admission_pass


@dataclass(frozen=True, slots=True)
class SimJob:
    id: str
    request_class: str
    request: Request
    arrival: float
    service: float


@dataclass(slots=True)
class Outcome:
    records: list[Record]
    unfeasible: list[str]  # job ids
    queue_area: float  # integral of the queue length over [start, end]
    start: float
    end: float
    pass_seconds: list[float] = field(default_factory=list)


def simulate(
    jobs: Sequence[SimJob], fit: FitCheck, *, backfill: bool = True, until: float | None = None
) -> Outcome:
    """Run ``jobs`` (any order) to completion, or to ``until``."""
    ordered = sorted(jobs, key=lambda j: (j.arrival, j.id))
    by_id = {j.id: j for j in ordered}
    events: list[tuple[float, int, int, str]] = []  # (time, kind, seq, job id); 0 = end first
    for seq, job in enumerate(ordered):
        heapq.heappush(events, (job.arrival, 1, seq, job.id))
    demands: dict[Request, Demand | Unfeasible] = {}
    queue: list[Queued] = []
    holdings: dict[str, Holding] = {}
    started: dict[str, float] = {}
    ended: dict[str, float] = {}
    unfeasible: list[str] = []
    start = ordered[0].arrival if ordered else 0.0
    now = start
    area = 0.0
    seq = len(ordered)
    pass_seconds: list[float] = []
    while events:
        t, kind, _, job_id = heapq.heappop(events)
        if until is not None and t > until:
            area += len(queue) * (until - now)
            now = until
            break
        area += len(queue) * (t - now)
        now = t
        job = by_id[job_id]
        if kind == 0:
            del holdings[job_id]
            ended[job_id] = now
        else:
            queue.append(Queued(job.id, job.request, seq, now))
            seq += 1
        # Everything that happens at one instant is admitted in one pass.
        if events and events[0][0] == now:
            continue
        t0 = time.perf_counter()
        result = admission_pass(
            queue, fit, list(holdings.values()), backfill=backfill, demands=demands
        )
        pass_seconds.append(time.perf_counter() - t0)
        if result.unfeasible:
            unfeasible.extend(result.unfeasible)
        gone = set(result.unfeasible)
        for s in result.starts:
            gone.add(s.id)
            started[s.id] = now
            holdings[s.id] = Holding(s.id, s.devices, by_id[s.id].request.per_device, name=s.id)
            heapq.heappush(events, (now + by_id[s.id].service, 0, seq, s.id))
            seq += 1
        if gone:
            queue = [q for q in queue if q.id not in gone]
    records = [
        Record(j.id, j.request_class, j.arrival, started.get(j.id), ended.get(j.id))
        for j in ordered
        if j.id not in set(unfeasible) and (until is None or j.arrival <= until)
    ]
    return Outcome(records, unfeasible, area, start, now, pass_seconds)
