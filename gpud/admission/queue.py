"""One admission pass: FIFO, with backfill that cannot delay the head of the queue.

Jobs start in queue order while they fit. The first quotable job that does not fit is the
*head*; jobs behind it may start ahead of it (backfill) only on devices where they are
*harmless* to the head.

The guarantee. gpud does not know how long a job runs, so the usual EASY backfill (start a
small job if it ends before the head's reserved start) cannot be proved here. Instead, let
the head need ``count`` devices of its pool with ``h`` free on each (``h`` and ``b`` below
are per device: see :class:`~gpud.admission.model.Demand`); a device is *usable* by the
head when its load ``L`` satisfies ``L + h <= capacity``. A candidate with demand ``b`` is harmless on device
``d`` when ``d`` is outside the head's pool or cannot ever host the head, or when for
*every* subset ``S`` of the jobs now on ``d``::

    load(S) + h <= capacity   implies   load(S) + b + h <= capacity

Claim: at every later instant, every device usable by the head without the backfilled
jobs is usable with them. Proof, by induction over the backfilled jobs ``B1..Bn`` (in
start order): jobs only leave, so the jobs on ``d`` at a later instant are a subset ``V``
of those there before ``B1`` plus a subset ``W`` of ``B1..Bn``. If ``V`` leaves room for
the head, so does ``V + (W minus Bi)`` by induction; that set is a subset of what was on
``d`` when ``Bi`` started, so harmlessness of ``Bi`` adds ``Bi`` keeping room. Since "the
head fits" only asks for ``count`` usable devices of its pool (monotone), the head fits
whenever it would have fitted without backfill, and so starts no later. Jobs ahead of the
head start in both cases; new arrivals queue behind it. ``tests/unit/test_admission_queue.py``
checks the claim with hypothesis over random nodes, loads, queues and release orders.

Users (MPS on): a job of a known user starts on no device that a job of another known user
holds (a control daemon serves one user at a time), and a backfilled job of another user
than the head's is harmful on every device of the head's pool: it would keep the head off
it for as long as it runs, whatever the memory says.

Harmlessness is decided by enumerating the subsets of the jobs on a device (cheap, after two
shortcuts); a device carrying more than :data:`MAX_SUBSET_JOBS` jobs counts as harmful.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations

from gpud.admission.model import (
    ZERO,
    Demand,
    Device,
    FitCheck,
    Holding,
    Loads,
    Request,
    Unfeasible,
    Vec,
)

MAX_SUBSET_JOBS = 12


@dataclass(frozen=True, slots=True)
class Queued:
    """A queued job, in queue order (``seq``). ``uid``: its user, where MPS serves the
    devices and it is known: it starts on no device a holding of another user is on.
    ``name``: its job's name (None: ``id`` stands for it), counted once on a device however
    many runs of that job hold it."""

    id: str
    request: Request
    seq: int
    enqueued_at: float
    uid: int | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class Start:
    id: str
    devices: tuple[str, ...]
    backfilled: bool


@dataclass(frozen=True, slots=True)
class PassResult:
    starts: list[Start]
    head: str | None  # the first quotable job left waiting
    unfeasible: dict[str, Unfeasible]


def admission_pass(
    queue: Sequence[Queued],
    fit: FitCheck,
    holdings: Sequence[Holding],
    *,
    backfill: bool = True,
    demands: dict[Request, Demand | Unfeasible] | None = None,
) -> PassResult:
    """Which queued jobs start now, and on which devices. ``queue`` is in order; ``demands``
    caches :meth:`FitCheck.demand` across passes (the node's devices must not change)."""
    cache = demands if demands is not None else {}
    loads = Loads.of(holdings)
    capacity = {d.uuid: d for d in fit.devices()}
    starts: list[Start] = []
    unfeasible: dict[str, Unfeasible] = {}
    head: Queued | None = None
    head_demand: Demand | None = None
    # Requests that did not fit since the last start: the loads have not changed since.
    stuck: set[tuple[Request, int | None]] = set()
    for job in queue:
        demand = cache.get(job.request)
        if demand is None:
            demand = cache[job.request] = fit.demand(job.request)
        if isinstance(demand, Unfeasible):
            unfeasible[job.id] = demand
            continue
        shape = (job.request, job.uid)
        if shape in stuck:
            continue
        allowed: set[str] | None = None
        if head_demand is not None and head is not None:
            allowed = _harmless_devices(demand, head_demand, loads, capacity)
            if job.uid is not None and head.uid not in (None, job.uid):
                allowed -= set(head_demand.pool)
        if job.uid is not None:
            others = {u for u, seen in loads.users.items() if any(i != job.uid for i, _ in seen)}
            if others:
                allowed = (set(capacity) if allowed is None else allowed) - others
        if head_demand is not None and allowed is not None and len(allowed) < demand.count:
            stuck.add(shape)
            continue
        devices = fit.place(
            job.request,
            loads.total,
            allowed=allowed,
            names=loads.names,
            users=loads.users,
            uid=job.uid,
        )
        if devices is None:
            stuck.add(shape)
            if head is None:
                head, head_demand = job, demand
                if not backfill:
                    break
            continue
        starts.append(Start(job.id, devices, backfilled=head is not None))
        for uuid in devices:  # per device: an MPS default memory limit differs between them
            loads.add(Holding(job.id, (uuid,), demand.on(uuid), job.uid, name=job.name or job.id))
        stuck.clear()
    return PassResult(starts, head.id if head else None, unfeasible)


def _harmless_devices(
    demand: Demand, head: Demand, loads: Loads, devices: dict[str, Device]
) -> set[str]:
    head_pool = set(head.pool)
    out = set()
    for uuid, device in devices.items():
        if uuid not in head_pool or harmless(
            demand.on(uuid), head.on(uuid), loads.on.get(uuid, []), device.capacity
        ):
            out.add(uuid)
    return out


def harmless(need: Vec, head_need: Vec, jobs: Sequence[Vec], capacity: Vec) -> bool:
    """Whether adding ``need`` to a device holding ``jobs`` keeps it usable by a head needing
    ``head_need`` in every future where it would have been (see the module docstring)."""
    if not head_need.fits_in(capacity) or need.is_zero():
        return True
    total = sum(jobs, ZERO)
    if (total + need + head_need).fits_in(capacity):
        return True
    if not (need + head_need).fits_in(capacity) or len(jobs) > MAX_SUBSET_JOBS:
        return False
    room = capacity - head_need
    return all((load + need).fits_in(room) for load in _subset_loads(jobs) if load.fits_in(room))


def _subset_loads(jobs: Sequence[Vec]) -> Iterator[Vec]:
    for size in range(len(jobs) + 1):
        for subset in combinations(jobs, size):
            yield sum(subset, ZERO)
