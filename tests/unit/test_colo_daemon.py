"""gpud.colo (the loop on snapshots, metrics) and gpud.client.colo (directives)."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from colocate import InterferencePredictor, JobFeatures, JobView
from gpud.backend.port import MemoryInfo, PcieThroughput, Utilization
from gpud.client.colo import (
    CALL_TIMEOUT_S,
    DIRECTIVE_HOLD_S,
    REPORT_BACKOFF_MAX_S,
    Latency,
    Throttle,
    _close_at_exit,
)
from gpud.colo.metrics import ColoMetrics
from gpud.colo.service import (
    ADVICE_REUSE_S,
    FORGET_AFTER_S,
    MAX_JOB_PROCESSES,
    NAME_TTL_S,
    PROMISE_S,
    STATE_FILE_VERSION,
    Advice,
    ColoService,
    Directive,
    RunningJob,
    read_boot_id,
)
from gpud.config import ColocateConfig
from gpud.errors import FailedPrecondition, InvalidArgument, NotFound
from gpud.events import EventLog
from gpud.files import STATE_FILE_MODE, write_atomically
from gpud.telemetry.snapshot import GpuSample, Snapshot
from gpud.v1 import colo_pb2
from tests.unit.api_support import GIB, identity


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def snapshot(n: int = 2, used_gib: float = 30) -> Snapshot:
    return Snapshot(
        wall_time=0.0,
        monotonic=0.0,
        tick_seconds=0.01,
        gpus=tuple(
            GpuSample(
                identity=identity(i),
                healthy=True,
                reason="",
                sampled_at=0.0,
                memory=MemoryInfo(80 * GIB, int(used_gib * GIB), int((80 - used_gib) * GIB)),
                utilization=Utilization(0.3, 0.2),
                # 1.26 GB/s into the GPU: 0.02 of an H100's Gen5 x16 link
                pcie=PcieThroughput(0.2e9, 1.26e9),
            )
            for i in range(n)
        ),
    )


def scraped(svc: ColoService) -> CollectorRegistry:
    """A registry whose every read is a scrape of ``svc``'s metrics, as /metrics makes."""
    reg = CollectorRegistry()

    class Source:
        def collect(self) -> object:
            return ColoMetrics(svc)()

    reg.register(Source())  # type: ignore[arg-type]
    return reg


def kept_loop(
    tmp_path: Path,
    jobs: list[RunningJob],
    clock: Clock,
    write: Callable[[Path, str], None] | None = None,
    registered: Callable[[], Mapping[str, float | None]] | None = None,
    *,
    running: Callable[[], list[RunningJob]] | None = None,
) -> ColoService:
    """A loop that keeps its state in ``tmp_path/colo.json`` (written by ``write``, where
    given): a new one picks it up (what it holds of jobs ``registered`` does not list, or
    lists registered at another time, dropped, where given). It reads who runs from
    ``running`` where given, else ``jobs``."""
    return ColoService(
        ColocateConfig(),
        EventLog(tmp_path / "e.jsonl"),
        running=running or (lambda: jobs),
        clock=clock,
        state_file=tmp_path / "colo.json",
        write=write,
        registered=registered,
    )


def removing_loop(
    tmp_path: Path, jobs: list[RunningJob], clock: Clock
) -> tuple[ColoService, list[str]]:
    """A :func:`kept_loop` whose wall clock is ``clock``, and a list of jobs to remove: one
    put in it is removed (`gpuctl jobs rm --force`) during the loop's next read of the
    reservations, which still lists it (begun before the removal committed); later reads
    do not."""
    removing: list[str] = []

    def running() -> list[RunningJob]:
        listed = list(jobs)  # read before the removal committed
        while removing:
            job = removing.pop()
            svc.job_removed(job, force=True)()
            jobs[:] = [r for r in jobs if r.name != job]
        return listed

    svc = ColoService(
        ColocateConfig(),
        EventLog(tmp_path / "e.jsonl"),
        running=running,
        clock=clock,
        state_file=tmp_path / "colo.json",
        wall=clock,
    )
    return svc, removing


def promising_loop(
    tmp_path: Path, running: list[RunningJob] | Callable[[], list[RunningJob]], clock: Clock
) -> ColoService:
    """A loop on ``running`` (a list of jobs, or a callable) whose wall clock (what
    reservations are stamped with) is ``clock``, as is its own."""
    return ColoService(
        ColocateConfig(),
        EventLog(tmp_path / "e.jsonl"),
        running=running if callable(running) else lambda: list(running),
        clock=clock,
        wall=clock,
    )


@pytest.fixture
def service(tmp_path: Path) -> tuple[ColoService, Clock, list[RunningJob]]:
    clock = Clock()
    jobs = [
        RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=20 * GIB),
        RunningJob("train", "training", 0, threads_percent=50, memory_bytes=10 * GIB),
    ]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "events.jsonl"), running=lambda: jobs, clock=clock
    )
    return svc, clock, jobs


def test_guard_throttles_training_within_one_tick_and_the_job_is_told(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    svc, clock, _ = service
    svc.tick(snapshot())
    assert svc.throttle_point("train", 10).duty == 1.0
    svc.report_latency("chat", [0.05] * 98 + [0.095] * 2)  # p99 95 ms: within 20% of 100
    svc.tick(snapshot())
    d = svc.throttle_point("train", 10)
    assert d.duty == 0.5 and not d.evict and "SLO guard" in d.reason
    view = svc.show()
    (g,) = view.guards
    assert g.action == "throttle" and g.p99_ms == pytest.approx(95.0)
    (said,) = svc._events.recent(kind_prefix="colo.throttle")
    assert said.fields == {"job": "chat", "gpu": 0, "uuid": identity(0).uuid}
    # Calm latencies: additive recovery.
    clock.t += 60
    svc.report_latency("chat", [0.01] * 100)
    svc.tick(snapshot())
    assert svc.throttle_point("train", 1).duty == pytest.approx(0.6)


def test_a_services_guard_is_made_before_any_step_reads_it(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """The guard step finds each service's guard made by the tick's first step, whether or
    not SLO attainment was counted before it."""
    svc, _, jobs = service
    svc._ensure_guards(jobs)
    assert set(svc._guards) == {"chat"} and svc._guards["chat"].slo_s == pytest.approx(0.1)
    duty, evict = svc._guard_step(jobs, {0: list(jobs)}, {}, {})
    assert duty == {0: 1.0} and evict == {}


def test_guard_evicts_training_when_the_slo_cannot_be_held(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    svc, clock, jobs = service
    for _ in range(60):  # each cut is measured (MIN_FRESH_SAMPLES) before the next
        clock.t += 1
        svc.report_latency("chat", [0.5] * 10)
        svc.tick(snapshot())
        if svc.throttle_point("train", 1).evict:
            break
    d = svc.throttle_point("train", 1)
    assert d.evict and "evict" in d.reason
    guard = [e.fields for e in svc._events.recent(kind_prefix="colo.evict") if "gpu" in e.fields]
    assert guard == [{"job": "chat", "gpu": 0, "uuid": identity(0).uuid}]
    # The training has not left yet (it checkpoints): it stays evicted, whatever the
    # guard, which started afresh, makes of the next latencies.
    for latency in (0.5, 0.01):
        for _ in range(5):
            clock.t += 1
            svc.report_latency("chat", [latency] * 30)
            svc.tick(snapshot())
            assert svc.throttle_point("train", 1) == d
    # and `gpuctl colo show` says so, not what the guard, afresh, makes of the latencies
    from gpud.colo.api import ColoServicer

    shown = {p.job: p for p in ColoServicer(svc, snapshots=snapshot)._show().placements}
    assert shown["train"].evict and shown["train"].duty == 0.0
    assert shown["train"].reason == d.reason
    assert not shown["chat"].evict
    jobs[:] = [j for j in jobs if j.name != "train"]  # it left
    svc.tick(snapshot())
    jobs.append(RunningJob("train", "training", 0, threads_percent=50, memory_bytes=10 * GIB))
    svc.tick(snapshot())  # run again later, it gets what the plan says
    assert not svc.throttle_point("train", 1).evict


def test_the_guard_protects_a_service_that_serves_a_request_a_second(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A service of little traffic (a request a second: ten in the 10 s latency window)
    over its SLO beside training gets the training throttled, and evicted at the floor:
    the guard waits for enough requests at a duty, not for them to fit in the window."""
    svc, clock, _ = service
    duties = []
    for _ in range(600):
        clock.t += 1
        svc.report_latency("chat", [0.5])  # 500 ms against a 100 ms SLO
        svc.tick(snapshot())
        d = svc.throttle_point("train", 1)
        duties.append(d.duty)
        if d.evict:
            break
    assert duties[25] < 1.0  # cut once its first 20 requests were in
    assert d.evict and "over SLO" in d.reason


def test_the_guard_holds_the_slo_the_service_runs_with_now(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A service registered again with another SLO (`gpuctl jobs rm`, `jobs add
    --slo-p99-ms`, run again within the hour the loop remembers it) is guarded against
    the new SLO, not the one its guard was made with."""
    svc, clock, jobs = service
    clock.t += 1
    svc.report_latency("chat", [0.095] * 30)  # within 20 % of 100 ms
    svc.tick(snapshot())
    assert svc.duty("train") == 0.5
    jobs[:] = [j for j in jobs if j.name != "chat"]  # it stops; registered again
    clock.t += 60
    svc.tick(snapshot())
    jobs.append(RunningJob("chat", "inference", 0, slo_p99_ms=1000.0, memory_bytes=20 * GIB))
    for _ in range(3):
        clock.t += 5
        svc.report_latency("chat", [0.095] * 30)  # well under 1 s
        svc.tick(snapshot())
    (g,) = svc.show().guards
    assert g.slo_ms == 1000.0 and g.action == "recover"
    assert svc.duty("train") > 0.5


def test_a_loop_switched_off_throttles_and_evicts_nothing_any_more(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A reload with `[colocate] enabled = false`: no guard runs, so no training stays held
    at the duty one set, or evicted, by a loop that is off; on again, it plans afresh."""
    svc, clock, _ = service
    clock.t += 1
    svc.report_latency("chat", [0.095] * 30)
    svc.tick(snapshot())
    assert svc.throttle_point("train", 1).duty == 0.5
    svc.configure(ColocateConfig(enabled=False))
    clock.t += 5
    svc.tick(snapshot())
    d = svc.throttle_point("train", 1)
    assert d.duty == 1.0 and not d.evict and "off" in d.reason
    assert svc.duty("train") == 1.0
    svc.configure(ColocateConfig())
    clock.t += 5
    svc.report_latency("chat", [0.095] * 30)
    svc.tick(snapshot())
    assert svc.throttle_point("train", 1).duty < 1.0


def test_a_reloaded_min_duty_is_the_floor_at_once(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """Raising `colocate.min_duty` (SIGHUP) lifts training held under the new floor at the
    next tick, whatever the latencies: no guard keeps a duty below it."""
    svc, clock, _ = service
    for _ in range(30):  # 1 -> 0.5 -> 0.25 -> 0.125, each cut measured before the next
        clock.t += 1
        svc.report_latency("chat", [0.095] * 30)
        svc.tick(snapshot())
        svc.throttle_point("train", 1)
        if svc.duty("train") < 0.2:
            break
    assert svc.duty("train") < 0.2
    svc.configure(ColocateConfig(min_duty=0.5))
    clock.t += 1
    svc.report_latency("chat", [0.07] * 30)  # within the band: the guard holds
    svc.tick(snapshot())
    assert svc.duty("train") == 0.5
    (g,) = svc.show().guards
    assert g.duty == 0.5


def throttled(
    tmp_path: Path, clock: Clock, write: Callable[[Path, str], None] | None = None
) -> tuple[ColoService, list[RunningJob]]:
    """A :func:`kept_loop` (colo.json written by ``write``, where given) whose service
    `chat` reports latencies near its SLO tick after tick, until its guard holds `train`,
    beside it, under a duty of 0.2."""
    jobs = [
        RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=20 * GIB),
        RunningJob("train", "training", 0, memory_bytes=10 * GIB),
    ]
    svc = kept_loop(tmp_path, jobs, clock, write=write)
    throttle(svc, clock)
    return svc, jobs


def throttle(svc: ColoService, clock: Clock) -> None:
    """`chat` reports latencies near its SLO tick after tick, until its guard holds `train`
    under a duty of 0.2."""
    for _ in range(30):
        clock.t += 1
        svc.report_latency("chat", [0.095] * 30)
        svc.tick(snapshot())
        if svc.duty("train") < 0.2:
            break
    assert svc.duty("train") < 0.2


def test_a_min_duty_raised_across_a_restart_is_the_floor_at_once(tmp_path: Path) -> None:
    """gpud restarted with a higher `colocate.min_duty`: the guard it restores from its
    state file holds training at no less than the new floor."""
    clock = Clock()
    _, jobs = throttled(tmp_path, clock)
    again = ColoService(
        ColocateConfig(min_duty=0.5),
        EventLog(tmp_path / "e.jsonl"),
        running=lambda: jobs,
        clock=clock,
        state_file=tmp_path / "colo.json",
    )
    clock.t += 1
    again.tick(snapshot())
    assert again.duty("train") == 0.5


def test_memory_over_the_limit_evicts_training(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    svc, _, jobs = service
    jobs[1] = RunningJob("train", "training", 0, memory_bytes=10 * GIB, memory_used=70 * GIB)
    svc.tick(snapshot(used_gib=79))
    assert svc.throttle_point("train", 1).evict


def test_a_job_removed_and_added_again_while_gpud_runs_is_not_told_the_removed_ones_eviction(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """`train` is evicted for the GPU's memory, `gpuctl jobs rm --force train`, then
    `gpuctl jobs add train` and a small run of it: that run is another workload, told to
    run at full duty, not to leave for what the removed one used."""
    svc, clock, jobs = service
    jobs[1] = RunningJob(
        "train", "training", 0, memory_bytes=10 * GIB, memory_used=70 * GIB, registered_at=1.0
    )
    svc.tick(snapshot(used_gib=79))
    assert svc.throttle_point("train", 1).evict
    svc.job_removed("train", force=True)()
    jobs[1] = RunningJob(
        "train",
        "training",
        0,
        memory_bytes=5 * GIB,
        memory_used=5 * GIB,
        reserved_at=clock.t + 1,
        registered_at=2.0,
    )
    clock.t += 5
    svc.tick(snapshot(used_gib=25))
    told = svc.throttle_point("train", 1)
    assert not told.evict and told.duty == 1.0, told


def test_memory_over_the_limit_evicts_the_training_job_that_came_last(tmp_path: Path) -> None:
    """The newest by when the loop first saw it run, not by name."""
    clock = Clock()
    jobs = [RunningJob("a-first", "training", 0, memory_bytes=10 * GIB, memory_used=30 * GIB)]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "events.jsonl"), running=lambda: jobs, clock=clock
    )
    svc.tick(snapshot(used_gib=30))
    clock.t += 5
    jobs.append(RunningJob("z-later", "training", 0, memory_bytes=10 * GIB, memory_used=49 * GIB))
    svc.tick(snapshot(used_gib=79))
    assert svc.throttle_point("z-later", 1).evict
    assert not svc.throttle_point("a-first", 1).evict


def test_a_job_that_stops_and_runs_again_comes_last(tmp_path: Path) -> None:
    clock = Clock()
    first = RunningJob("a-first", "training", 0, memory_bytes=10 * GIB, memory_used=30 * GIB)
    later = RunningJob("z-later", "training", 0, memory_bytes=10 * GIB, memory_used=30 * GIB)
    jobs = [first]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "events.jsonl"), running=lambda: jobs, clock=clock
    )
    svc.tick(snapshot(used_gib=30))
    clock.t += 5
    jobs.append(later)
    svc.tick(snapshot(used_gib=60))
    jobs[:] = [later]  # a-first stops (it was evicted elsewhere, or restarted)
    clock.t += 5
    svc.tick(snapshot(used_gib=30))
    clock.t += 5
    jobs[:] = [later, dataclasses.replace(first, memory_used=49 * GIB)]
    svc.tick(snapshot(used_gib=79))
    assert svc.throttle_point("a-first", 1).evict
    assert not svc.throttle_point("z-later", 1).evict


def test_advise_places_on_a_free_gpu_and_checks_input(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    svc, _, _ = service
    a = svc.advise("new", memory_bytes=8 * GIB, snapshot=snapshot())
    assert a.gpu == 1 and a.sm_share == 1.0 and a.mig_profile is None and "free" in a.reason
    assert a.memory_limit_bytes >= 8 * GIB and a.predicted_speed == 1.0
    assert a.device == identity(1).uuid
    with pytest.raises(InvalidArgument):
        svc.advise("new", kind="batch", snapshot=snapshot())
    with pytest.raises(InvalidArgument):
        svc.report_latency("chat", [float("nan")])


def test_runs_asking_together_are_not_all_told_one_gpu_is_free(tmp_path: Path) -> None:
    """Five gpuctl runs ask before any has reserved: the first is given the free GPU, and
    the others are told what the GPU holds once it runs there (here: it would slow below
    1/2 beside it), not that it is free, which had them all reserve it and share it under
    the slowdown cap. The place counts until the run's reservation shows (then as that),
    or PROMISE_S; an operator's question (``gpuctl colo advise``) holds nothing."""
    clock = Clock()
    jobs = [RunningJob("big", "training", 0, memory_bytes=30 * GIB)]
    svc = promising_loop(tmp_path, jobs, clock)
    snap = snapshot(used_gib=0)
    ask = {"memory_bytes": 30 * GIB, "snapshot": snap}
    assert svc.advise("look", **ask).gpu == 1  # type: ignore[arg-type]
    told = [svc.advise(f"r{i}", reserving=True, **ask) for i in range(5)]  # type: ignore[arg-type]
    assert told[0].gpu == 1 and "free" in told[0].reason
    for t in told[1:]:
        assert t.gpu == -1 and "r0 would slow below 1/2" in t.reason, t.reason
    # r0 reserved
    jobs.append(RunningJob("r0", "training", 1, memory_bytes=30 * GIB, reserved_at=clock.t))
    assert svc.advise("r1", reserving=True, **ask).gpu == -1  # type: ignore[arg-type]
    jobs.pop()  # r0's reservation went (its run ended)
    assert svc.advise("r1", reserving=True, **ask).gpu == 1  # type: ignore[arg-type]
    clock.t += PROMISE_S + 1  # r1 never reserved
    assert svc.advise("r2", reserving=True, **ask).gpu == 1  # type: ignore[arg-type]


def test_two_runs_of_one_job_are_not_both_told_one_gpu_is_free(tmp_path: Path) -> None:
    """A place promised to a run counts for the runs of its own job too (three `gpuctl
    run sweep` asking together were all told GPU 1 is free); a run asking again with the
    id it was told is not barred by its own place."""
    clock = Clock()
    jobs = [RunningJob("big", "training", 0, memory_bytes=30 * GIB)]
    svc = promising_loop(tmp_path, jobs, clock)
    ask = {"memory_bytes": 30 * GIB, "snapshot": snapshot(used_gib=0)}
    told = [svc.advise("sweep", reserving=True, **ask) for _ in range(3)]  # type: ignore[arg-type]
    assert (told[0].gpu, told[0].reason) == (1, "GPU 1 is free: exclusive")
    for t in told[1:]:
        assert t.gpu == -1 and "sweep (" in t.reason, t.reason
    waits = svc.advise("sweep", waiting=True, **ask)  # type: ignore[arg-type]
    assert waits.gpu == -1
    jobs.append(RunningJob("sweep", "training", 1, memory_bytes=30 * GIB, reserved_at=clock.t))
    jobs.pop(0)  # big ended: GPU 0 is free, GPU 1 holds the first run's reservation
    again = svc.advise("sweep", waiting=True, waiter_id=waits.waiter_id, **ask)  # type: ignore[arg-type]
    assert (again.gpu, again.reason) == (0, "GPU 0 is free: exclusive")
    # its place, promised to it, bars others, not itself
    assert svc.advise("other", reserving=True, **ask).gpu == -1  # type: ignore[arg-type]
    assert svc.advise("sweep", waiting=True, waiter_id=waits.waiter_id, **ask).gpu == 0  # type: ignore[arg-type]


def test_a_place_promised_to_a_job_running_elsewhere_holds_until_its_run_reserves(
    tmp_path: Path,
) -> None:
    """A job that runs on GPU 0 already, a second run of which is given GPU 1: the place
    holds until a reservation of the job made since shows (the one on GPU 0 is older), or
    PROMISE_S; the next asker is not told GPU 1 is free meanwhile."""
    clock = Clock()
    jobs = [RunningJob("sweep", "training", 0, memory_bytes=30 * GIB, reserved_at=clock.t)]
    svc = promising_loop(tmp_path, jobs, clock)
    ask = {"memory_bytes": 30 * GIB, "snapshot": snapshot(used_gib=0)}
    clock.t += 5
    assert svc.advise("sweep", reserving=True, **ask).gpu == 1  # type: ignore[arg-type]
    other = svc.advise("other", reserving=True, **ask)  # type: ignore[arg-type]
    assert other.gpu == -1 and "sweep would slow below 1/2" in other.reason, other.reason
    clock.t += 1
    jobs.append(RunningJob("sweep", "training", 1, memory_bytes=30 * GIB, reserved_at=clock.t))
    assert svc.advise("other", reserving=True, **ask).gpu == -1  # type: ignore[arg-type]
    jobs.pop()  # that run ended: its place is not promised still
    assert svc.advise("other", reserving=True, **ask).gpu == 1  # type: ignore[arg-type]
    clock.t += PROMISE_S + 1  # "other" never reserved
    assert svc.advise("third", reserving=True, **ask).gpu == 1  # type: ignore[arg-type]


def test_a_promised_place_is_planned_with_what_its_job_showed_alone(tmp_path: Path) -> None:
    """A job that ran alone before (SMs 0.3 busy, not the prior's 0.8) asks again while
    both GPUs are busy: the place it is promised is predicted with its own footprint, as
    the loop predicts it once it runs there, and so is that place when the job's next run
    asks (planned under the first run's id) -- not with the prior, with which an unknown
    job is told to wait."""
    clock = Clock()
    sweep = RunningJob("sweep", "training", 0, memory_bytes=10 * GIB, reserved_at=clock.t)
    jobs = [dataclasses.replace(sweep, memory_used=9 * GIB)]
    svc = promising_loop(tmp_path, jobs, clock)
    for _ in range(6):
        svc.throttle_point("sweep", 10)
        svc.tick(snapshot())
        clock.t += 1
    assert svc._jobs["sweep"].learned("") is not None
    jobs[:] = [
        RunningJob("big", "training", 0, memory_bytes=20 * GIB),
        RunningJob("big2", "training", 1, memory_bytes=20 * GIB),
    ]
    ask = {"memory_bytes": 10 * GIB, "snapshot": snapshot(used_gib=20)}
    assert svc.advise("fresh", **ask).gpu == -1  # type: ignore[arg-type]
    first = svc.advise("sweep", reserving=True, **ask)  # type: ignore[arg-type]
    assert first.gpu == 0 and first.predicted_speed > 0.5
    second = svc.advise("sweep", reserving=True, **ask)  # type: ignore[arg-type]
    assert second.gpu == 1
    planned = svc._advice_pass[2].predicted_speed  # type: ignore[index]
    (promised,) = [speed for name, speed in planned.items() if name.startswith("sweep (")]
    assert promised == pytest.approx(first.predicted_speed)
    # what the loop predicts once the first run reserved its place and runs there
    share = round(first.sm_share * 100)
    jobs.append(
        RunningJob(
            "sweep", "training", 0, threads_percent=share, memory_bytes=10 * GIB, reserved_at=1
        )
    )
    plan = svc.tick(snapshot(used_gib=30))
    assert plan is not None
    assert plan.predicted_speed["sweep"] == pytest.approx(first.predicted_speed)


def promised_speed(tmp_path: Path, end: list[tuple[float, bool]], **alone: Any) -> Advice:
    """The advice a run of "sweep" is given beside busy GPUs after it ran alone on GPU 0
    (SMs 0.3 busy, twelve ticks), then for ``end``: (its SMs, whether its processes still
    ran) a tick. ``alone``: how it ran there (RunningJob fields)."""
    clock = Clock()
    sweep = RunningJob(
        "sweep", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB, reserved_at=clock.t
    )
    sweep = dataclasses.replace(sweep, **alone)
    jobs = [sweep]
    svc = promising_loop(tmp_path, jobs, clock)
    for sm, running in [(0.3, True)] * 12 + end:
        jobs[:] = [sweep if running else dataclasses.replace(sweep, memory_used=0)]
        svc.throttle_point("sweep", 10)
        svc.tick(busy_snapshot({0: (sm, sm * 2 / 3), 1: (sm, sm * 2 / 3)}))
        clock.t += 1
    jobs[:] = [
        RunningJob("big", "training", 0, memory_bytes=20 * GIB),
        RunningJob("big2", "training", 1, memory_bytes=20 * GIB),
    ]
    return svc.advise(
        "sweep", reserving=True, memory_bytes=10 * GIB, snapshot=snapshot(used_gib=20)
    )


def test_what_a_job_showed_alone_is_not_its_runs_end(tmp_path: Path) -> None:
    """A run's last ticks alone (its checkpoint: SMs 0.1 busy; its reservation held after
    its processes left: nothing busy) do not stand for its footprint: advice predicts its
    place much as it does from what it showed while it worked, not at 1.00, and does not
    tell it to wait where an unknown job is placed."""
    worked = promised_speed(tmp_path / "a", [])
    assert worked.gpu == 0 and 0.5 < worked.predicted_speed < 1.0
    checkpoint = promised_speed(tmp_path / "b", [(0.1, True)] * 2)
    assert checkpoint.gpu == 0
    assert checkpoint.predicted_speed == pytest.approx(worked.predicted_speed, abs=0.1)
    left = promised_speed(tmp_path / "c", [(0.0, False)] * 2)
    assert (left.gpu, left.predicted_speed) == (0, pytest.approx(worked.predicted_speed))
    # a job that only ever idled alone is advised as one never seen
    fresh = learned_then_asked(tmp_path / "d", {})
    idled = learned_then_asked(tmp_path / "e", {0: (0.01, 0.0)})
    assert (idled.gpu, idled.reason) == (fresh.gpu, fresh.reason)


def test_a_footprint_shown_at_a_partial_share_is_not_the_whole_gpus(tmp_path: Path) -> None:
    """A job that ran alone at a 30% MPS share (its SMs 0.3 busy: all it was let use) is
    not planned as if that were its footprint on a whole GPU (nor its knee): its advice
    is the prior's, as for a job never seen."""
    fresh = promised_speed(tmp_path / "a", [], name="other")
    partial = promised_speed(tmp_path / "b", [], threads_percent=30)
    assert (partial.gpu, partial.predicted_speed) == (fresh.gpu, fresh.predicted_speed)


def learned_then_asked(
    tmp_path: Path, util: dict[int, tuple[float, float]], *, before_asking: str = "", **ask: Any
) -> Advice:
    """The advice "sweep" is given (``ask``: more of the question) beside busy GPUs after it
    ran alone, six ticks, on the GPUs of ``util`` (their SMs and memory controllers busy as
    given); ``before_asking``: "rm", the job is removed (``gpuctl jobs rm``) first."""
    clock = Clock()
    jobs = [
        RunningJob("sweep", "training", g, memory_bytes=10 * GIB, memory_used=9 * GIB) for g in util
    ]
    svc = promising_loop(tmp_path, jobs, clock)
    for _ in range(6):
        svc.throttle_point("sweep", 10)
        svc.tick(busy_snapshot({0: (0.0, 0.0), 1: (0.0, 0.0), **util}))
        clock.t += 1
    jobs[:] = [
        RunningJob("big", "training", 0, memory_bytes=20 * GIB),
        RunningJob("big2", "training", 1, memory_bytes=20 * GIB),
    ]
    if before_asking == "rm":
        svc.job_removed("sweep", force=False)()
    return svc.advise("sweep", memory_bytes=10 * GIB, snapshot=snapshot(used_gib=20), **ask)


def test_a_job_added_again_is_not_planned_with_what_the_removed_one_showed(
    tmp_path: Path,
) -> None:
    """`gpuctl jobs rm sweep` then `gpuctl jobs add sweep` (another workload under the
    name): its runs are advised as a job never seen, not with the footprint the removed
    one showed alone."""
    fresh = learned_then_asked(tmp_path / "a", {})
    shown = learned_then_asked(tmp_path / "b", {0: (0.3, 0.2)})
    assert fresh.gpu == -1 and shown.gpu == 0
    readded = learned_then_asked(tmp_path / "c", {0: (0.3, 0.2)}, before_asking="rm")
    assert (readded.gpu, readded.reason) == (fresh.gpu, fresh.reason)


def test_advice_plans_a_job_on_several_gpus_with_the_most_it_showed_on_any(
    tmp_path: Path,
) -> None:
    """A job that showed SMs 0.3 busy on GPU 0 and 0.5 on GPU 1 is advised as one that
    showed 0.5 (its new run's GPU is not known), not as what its first GPU showed."""
    both = learned_then_asked(tmp_path / "a", {0: (0.3, 0.2), 1: (0.5, 0.4)})
    most = learned_then_asked(tmp_path / "b", {1: (0.5, 0.4)})
    least = learned_then_asked(tmp_path / "c", {0: (0.3, 0.2)})
    assert (least.gpu, least.predicted_speed) != (most.gpu, most.predicted_speed)
    assert (both.gpu, both.predicted_speed, both.reason) == (
        most.gpu,
        most.predicted_speed,
        most.reason,
    )


def test_a_removed_job_holds_no_promised_place(tmp_path: Path) -> None:
    """`gpuctl jobs rm --force` takes back the place advice promised a run of the job,
    and a waiting run whose job is removed while its question is planned is promised
    nothing: the next asker is told the GPU is free."""
    clock = Clock()
    jobs = [
        RunningJob("big", "training", 0, memory_bytes=30 * GIB),
        RunningJob("blocker", "training", 1, memory_bytes=70 * GIB),
    ]
    removing: list[ColoService] = []

    def running() -> list[RunningJob]:
        if removing:  # the removal commits while the question is planned
            removing.pop().job_removed("w", force=True)()
        return jobs

    svc = promising_loop(tmp_path, running, clock)
    ask = {"memory_bytes": 30 * GIB, "snapshot": snapshot(used_gib=0)}
    w = svc.advise("w", waiting=True, **ask)  # type: ignore[arg-type]
    assert w.gpu == -1
    jobs.pop()  # the blocker ended: GPU 1 is free
    removing.append(svc)
    with pytest.raises(NotFound):
        svc.advise("w", waiting=True, waiter_id=w.waiter_id, **ask)  # type: ignore[arg-type]
    assert svc.advise("next", **ask).reason == "GPU 1 is free: exclusive"  # type: ignore[arg-type]
    assert svc.advise("r", reserving=True, **ask).gpu == 1  # type: ignore[arg-type]
    assert svc.advise("next", **ask).gpu == -1  # type: ignore[arg-type]
    svc.job_removed("r", force=True)()
    assert svc.advise("next", **ask).reason == "GPU 1 is free: exclusive"  # type: ignore[arg-type]


def test_runs_waiting_for_advice_are_listed_while_they_ask(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A gpuctl run told to wait is listed, with how long and why, while it keeps asking;
    not an operator's question, not once it is placed, not once it stops asking."""
    svc, clock, _ = service
    snap = snapshot()
    svc.tick(snap)
    big = {"memory_bytes": 70 * GIB, "snapshot": snap}
    svc.advise("asked", **big)  # type: ignore[arg-type]
    assert svc.advise("big", waiting=True, **big).gpu == -1  # type: ignore[arg-type]
    clock.t += 5.0
    svc.advise("big", waiting=True, **big)  # type: ignore[arg-type]
    ((job, waited, why, _, _),) = svc.show().waiting
    assert job == "big" and waited == pytest.approx(5.0) and "memory" in why
    (family,) = [m for m in ColoMetrics(svc)() if m.name == "gpud_colo_waiting_jobs"]
    assert [s.value for s in family.samples] == [1.0]
    clock.t += 11.0  # it stopped asking (Ctrl-C, killed)
    assert svc.show().waiting == ()
    svc.advise("big", waiting=True, **big)  # type: ignore[arg-type]
    assert svc.advise("big", waiting=True, memory_bytes=8 * GIB, snapshot=snap).gpu == 1
    assert svc.show().waiting == ()


def test_what_frees_goes_to_the_run_that_waited_first_whichever_asks_first(
    tmp_path: Path,
) -> None:
    """Runs waiting for advice are served in the order they came, not in the order their
    polls happen to land: a later run that asks first is told to wait."""
    clock = Clock()
    jobs = [
        RunningJob("a", "training", 0, memory_bytes=60 * GIB, memory_used=60 * GIB),
        RunningJob("b", "training", 1, memory_bytes=60 * GIB, memory_used=60 * GIB),
    ]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=clock
    )
    full = snapshot(used_gib=60)
    ask = {"memory_bytes": 40 * GIB, "waiting": True}
    assert svc.advise("older", snapshot=full, **ask).gpu == -1  # type: ignore[arg-type]
    clock.t += 1.0
    assert svc.advise("newer", snapshot=full, **ask).gpu == -1  # type: ignore[arg-type]
    clock.t += 1.0
    jobs.pop(0)  # GPU 0 frees
    freed = Snapshot(0.0, 0.0, (snapshot(used_gib=0).gpus[0], full.gpus[1]), 0.01)
    later = svc.advise("newer", snapshot=freed, **ask)  # type: ignore[arg-type]
    assert later.gpu == -1 and later.reason == "its options went to jobs ahead of it: older"
    # an operator's question is answered behind the runs that wait too
    assert svc.advise("asked", memory_bytes=40 * GIB, snapshot=freed).gpu == -1
    # listed in the order they are served
    assert [w.job for w in svc.show().waiting] == ["older", "newer"]
    assert svc.advise("older", snapshot=freed, **ask).gpu == 0  # type: ignore[arg-type]
    # once it is placed (its reservation is the jobs service's), the next in line is served
    jobs.insert(0, RunningJob("older", "training", 0, memory_bytes=40 * GIB))
    assert [w.job for w in svc.show().waiting] == ["newer"]


def test_the_waiting_runs_keep_their_order_through_a_restart(tmp_path: Path) -> None:
    """A gpud that restarted knows no waiter: each takes its place by how long it says it
    has waited, not by which asks again first."""
    clock = Clock()
    jobs = [
        RunningJob("a", "training", 0, memory_bytes=60 * GIB, memory_used=60 * GIB),
        RunningJob("b", "training", 1, memory_bytes=60 * GIB, memory_used=60 * GIB),
    ]
    svc = ColoService(  # just started
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=clock
    )
    full = snapshot(used_gib=60)
    ask = {"memory_bytes": 40 * GIB, "waiting": True, "snapshot": full}
    assert svc.advise("newer", waited_s=5.0, **ask).gpu == -1  # type: ignore[arg-type]
    clock.t += 1.0
    assert svc.advise("older", waited_s=12.0, **ask).gpu == -1  # type: ignore[arg-type]
    assert [w.job for w in svc.show().waiting] == ["older", "newer"]
    jobs.pop(0)  # GPU 0 frees
    freed = Snapshot(0.0, 0.0, (snapshot(used_gib=0).gpus[0], full.gpus[1]), 0.01)
    ask["snapshot"] = freed
    later = svc.advise("newer", waited_s=6.0, **ask)  # type: ignore[arg-type]
    assert later.gpu == -1 and later.reason == "its options went to jobs ahead of it: older"


def test_runs_that_wait_and_ask_together_share_one_planning_pass(tmp_path: Path) -> None:
    """Each question plans every run that waits: the polls of a round, on the same
    telemetry within a second, are answered by one pass."""
    clock = Clock()
    jobs = [RunningJob("a", "training", 0, memory_bytes=60 * GIB, memory_used=60 * GIB)]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=clock
    )
    full = snapshot(1, used_gib=60)
    names = [f"run{i}" for i in range(6)]
    for name in names:
        assert svc.advise(name, memory_bytes=40 * GIB, snapshot=full, waiting=True).gpu == -1
        clock.t += 0.1
    clock.t += 2.0
    before = svc.advice_passes
    told = [svc.advise(n, memory_bytes=40 * GIB, snapshot=full, waiting=True) for n in names]
    assert svc.advice_passes == before + 1
    assert {t.reason for t in told} == {
        "GPU 0: memory: needs 47104 MiB, 7168 MiB free under the limit"
    }
    clock.t += ADVICE_REUSE_S  # a second later the next round plans again
    svc.advise(names[0], memory_bytes=40 * GIB, snapshot=full, waiting=True)
    assert svc.advice_passes == before + 2


def test_a_run_that_waited_long_is_advised_first_and_has_a_gpu_held(tmp_path: Path) -> None:
    """A gpuctl run that needs a GPU alone waits while later runs keep taking the room
    beside the jobs there; once it has waited ``head_hold_s``, the GPU with the fewest
    jobs is held for it: later runs are advised elsewhere (or to wait), and it is told
    which GPU it waits for."""
    clock = Clock()
    jobs = two_jobs_alone()
    svc = ColoService(
        ColocateConfig(head_hold_s=600.0),
        EventLog(tmp_path / "e.jsonl"),
        running=lambda: jobs,
        clock=clock,
    )
    snap = snapshot(used_gib=10)
    for _ in range(5):  # each alone: the loop learns they keep 30 % of the SMs busy
        svc.tick(snap)
        clock.t += 5.0
    big = {"memory_bytes": 70 * GIB, "snapshot": snap, "waiting": True}
    small = {"memory_bytes": 8 * GIB, "sm_activity": 0.1, "snapshot": snap}
    assert svc.advise("big", **big).gpu == -1  # type: ignore[arg-type]
    assert svc.advise("small", **small).gpu == 0  # type: ignore[arg-type]
    for _ in range(120):  # it keeps asking, every 5 s
        clock.t += 5.0
        told = svc.advise("big", **big)  # type: ignore[arg-type]
    assert told.gpu == -1 and told.reason.startswith("GPU 0 held for it (waited 600 s): ")
    ((_, waited, why, _, _),) = svc.show().waiting
    assert waited == pytest.approx(600.0) and why == told.reason
    assert svc.advise("small", **small).gpu == 1  # type: ignore[arg-type]
    a = jobs.pop(0)  # GPU 0 drains
    drained = snapshot(used_gib=0)
    assert svc.advise("small", **{**small, "snapshot": drained}).gpu == 1  # type: ignore[arg-type]
    assert svc.advise("big", **{**big, "snapshot": drained}).gpu == 0  # type: ignore[arg-type]
    assert svc.show().waiting == ()
    # a run that stopped asking holds nothing
    jobs.insert(0, a)
    svc.advise("big", **big)  # type: ignore[arg-type]
    clock.t += 11.0
    assert svc.advise("small", **small).gpu == 0  # type: ignore[arg-type]


def two_jobs_alone() -> list[RunningJob]:
    return [
        RunningJob("a", "training", 0, memory_bytes=10 * GIB, memory_used=10 * GIB),
        RunningJob("b", "training", 1, memory_bytes=20 * GIB, memory_used=20 * GIB),
    ]


def big_outgrows_gpu_0(svc: ColoService, jobs: list[RunningJob], clock: Clock) -> None:
    """The loop learns ``two_jobs_alone``, then "big" joins GPU 0 and outgrows its memory:
    the loop evicts it (the newest training job there)."""
    for _ in range(5):
        svc.tick(snapshot(used_gib=10))
        clock.t += 5.0
    jobs.append(RunningJob("big", "training", 0, memory_bytes=50 * GIB, memory_used=68 * GIB))
    svc.tick(snapshot(used_gib=78))
    assert svc.throttle_point("big", 1).evict


def test_a_run_of_a_job_the_loop_evicted_has_a_gpu_held_at_once(tmp_path: Path) -> None:
    """A job evicted to protect others (here: the GPU's memory) is not sent to the back:
    when it runs again and fits nowhere, a GPU is held for it from its first question."""
    clock = Clock()
    jobs = two_jobs_alone()
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=clock
    )
    big_outgrows_gpu_0(svc, jobs, clock)
    jobs.pop()  # it checkpoints and leaves
    clock.t += 5.0
    snap = snapshot(used_gib=10)
    svc.tick(snap)
    again = {"memory_bytes": 70 * GIB, "snapshot": snap, "waiting": True}
    told = svc.advise("big", **again)  # type: ignore[arg-type]
    assert told.gpu == -1 and told.reason.startswith("GPU 0 held for it (evicted): "), told
    small = {"memory_bytes": 8 * GIB, "sm_activity": 0.1, "snapshot": snap}
    assert svc.advise("small", **small).gpu == 1  # type: ignore[arg-type]


def test_an_eviction_and_the_gpu_held_for_its_next_run_outlive_restarts(tmp_path: Path) -> None:
    """gpud restarts while an evicted job checkpoints: the eviction stands until it has
    left; gpud restarts again before the job runs again: its run still has a GPU held."""
    clock = Clock()
    jobs = two_jobs_alone()
    svc = kept_loop(tmp_path, jobs, clock)
    big_outgrows_gpu_0(svc, jobs, clock)
    svc = kept_loop(tmp_path, jobs, clock)  # restarted while it checkpoints
    svc.tick(snapshot(used_gib=78))
    told = svc.throttle_point("big", 1)
    assert told.evict and "memory" in told.reason, told
    jobs.pop()  # it leaves
    clock.t += 5.0
    snap = snapshot(used_gib=10)
    svc.tick(snap)
    assert json.loads((tmp_path / "colo.json").read_text())["evicted"] == ["big"]
    svc = kept_loop(tmp_path, jobs, clock)  # restarted before it runs again
    svc.tick(snap)
    again = {"memory_bytes": 70 * GIB, "snapshot": snap, "waiting": True}
    told_run = svc.advise("big", **again)  # type: ignore[arg-type]
    assert told_run.reason.startswith("GPU 0 held for it (evicted): "), told_run
    jobs.append(RunningJob("big", "training", 0, memory_bytes=70 * GIB))  # it runs again
    svc.tick(snap)
    assert not svc.throttle_point("big", 1).evict
    assert json.loads((tmp_path / "colo.json").read_text())["evicted"] == []


def test_a_removal_before_the_first_tick_after_a_restart_keeps_what_the_file_held(
    tmp_path: Path,
) -> None:
    """gpud restarts while `big`, evicted for GPU 0's memory, checkpoints, and `gpuctl jobs
    rm --force a` comes before the loop's first tick: colo.json still holds `big` and `b`
    as running, `big`'s eviction with them, and gpud killed again before that tick still
    tells `big` to leave."""
    clock = Clock()
    jobs = two_jobs_alone()
    svc = kept_loop(tmp_path, jobs, clock)
    big_outgrows_gpu_0(svc, jobs, clock)
    before = json.loads((tmp_path / "colo.json").read_text())["jobs"]
    assert before["big"]["evict"]
    svc = kept_loop(tmp_path, jobs, clock)  # restarted while it checkpoints
    svc.job_removed("a", force=True)()
    jobs[:] = [r for r in jobs if r.name != "a"]
    after = json.loads((tmp_path / "colo.json").read_text())["jobs"]
    assert after == {n: j for n, j in before.items() if n != "a"}
    svc = kept_loop(tmp_path, jobs, clock)  # killed again before its first tick
    told = svc.throttle_point("big", 1)
    assert told.evict and "memory" in told.reason, told


@pytest.mark.parametrize("still", ["loop off", "no snapshot"])
def test_a_removal_while_the_loop_stands_still_writes_a_job_that_ended_as_ended(
    tmp_path: Path, still: str
) -> None:
    """gpud restarts with `a`, `b` and `c` running as colo.json wrote them; the loop stands
    still (`[colocate] enabled = false`, or no snapshot yet); `b` ends and a tick reads who
    runs; then `gpuctl jobs rm --force a`: colo.json writes `b` as ended (how long ago it
    ran, so that a restart forgets it in time), `c` as running."""
    clock = Clock()
    jobs = [*two_jobs_alone(), RunningJob("c", "training", 1, memory_bytes=8 * GIB)]
    svc = kept_loop(tmp_path, jobs, clock)
    for _ in range(3):
        svc.tick(snapshot(used_gib=10))
        clock.t += 5.0
    assert not any(
        "idle_s" in j for j in json.loads((tmp_path / "colo.json").read_text())["jobs"].values()
    )
    svc = kept_loop(tmp_path, jobs, clock)  # restarted
    if still == "loop off":
        svc.configure(ColocateConfig(enabled=False))
    jobs[:] = [r for r in jobs if r.name != "b"]  # it ends
    clock.t += 5.0
    svc.tick(snapshot(used_gib=10) if still == "loop off" else None)
    svc.job_removed("a", force=True)()
    written = json.loads((tmp_path / "colo.json").read_text())["jobs"]
    assert "a" not in written
    assert written["b"]["idle_s"] == 5.0
    assert "idle_s" not in written["c"]


def test_a_removal_after_a_planning_tick_and_a_still_one_writes_a_job_that_ended_as_ended(
    tmp_path: Path,
) -> None:
    """`a`, `b` and `c` run and the loop plans; `b` ends and the next tick stands still (no
    snapshot); then `gpuctl jobs rm --force a`: colo.json writes `b` as ended (how long ago
    it ran), not as running from the planning tick before."""
    clock = Clock()
    jobs = [*two_jobs_alone(), RunningJob("c", "training", 1, memory_bytes=8 * GIB)]
    svc = kept_loop(tmp_path, jobs, clock)
    svc.tick(snapshot(used_gib=10))
    jobs[:] = [r for r in jobs if r.name != "b"]  # it ends
    clock.t += 5.0
    svc.tick(None)
    svc.job_removed("a", force=True)()
    written = json.loads((tmp_path / "colo.json").read_text())["jobs"]
    assert "a" not in written
    assert written["b"]["idle_s"] == 5.0
    assert "idle_s" not in written["c"]


def counted(writes: list[str]) -> Callable[[Path, str], None]:
    """colo.json's writer, each text it writes kept in ``writes``."""

    def write(path: Path, text: str) -> None:
        writes.append(text)
        write_atomically(path, text)

    return write


def refused_while(full: threading.Event) -> Callable[[Path, str], None]:
    """colo.json's writer, its writes refused as by a full disk while ``full`` is set."""

    def write(path: Path, text: str) -> None:
        if full.is_set():
            raise OSError(28, "No space left on device")
        write_atomically(path, text)

    return write


def test_the_stop_writes_the_predictors_clock_once_and_no_more(tmp_path: Path) -> None:
    """Ticks seconds apart move the predictor's clock, which they write once a minute: the
    stop writes it, so that the next start takes up the predictor where this gpud left
    it; asked again with nothing changed since, it writes nothing."""
    clock = Clock()
    jobs = two_jobs_alone()
    writes: list[str] = []
    svc = kept_loop(tmp_path, jobs, clock, write=counted(writes))
    snap = snapshot(used_gib=10)
    for _ in range(3):
        svc.tick(snap)
        clock.t += 5.0
    svc.tick(snap)
    held = svc.predictor.to_dict()["clock_s"]
    assert json.loads((tmp_path / "colo.json").read_text())["predictor"]["clock_s"] < held
    svc.save_at_stop()
    assert json.loads((tmp_path / "colo.json").read_text())["predictor"]["clock_s"] == held
    again = kept_loop(tmp_path, jobs, clock)
    assert again.predictor.to_dict()["clock_s"] == held
    written = len(writes)
    svc.save_at_stop()
    assert len(writes) == written


def test_a_guards_duty_a_reload_lifted_before_the_stop_is_what_the_file_keeps(
    tmp_path: Path,
) -> None:
    """`colocate.min_duty` raised (SIGHUP) lifts a guard's duty at once, between ticks;
    `systemctl stop gpud` before the next tick: colo.json holds the lifted duty."""
    svc, _ = throttled(tmp_path, Clock())
    guard_duty = json.loads((tmp_path / "colo.json").read_text())["jobs"]["chat"]["guard_duty"]
    assert guard_duty < 0.2
    svc.configure(ColocateConfig(min_duty=0.5))
    svc.save_at_stop()
    guard_duty = json.loads((tmp_path / "colo.json").read_text())["jobs"]["chat"]["guard_duty"]
    assert guard_duty == 0.5


def test_the_stop_writes_nothing_with_the_loop_off(tmp_path: Path) -> None:
    """`[colocate] enabled = false` (reloaded): the stop leaves colo.json as it was."""
    clock = Clock()
    writes: list[str] = []
    svc = kept_loop(tmp_path, two_jobs_alone(), clock, write=counted(writes))
    svc.tick(snapshot(used_gib=10))
    svc.configure(ColocateConfig(enabled=False))
    clock.t += 5.0
    svc.tick(snapshot(used_gib=10))
    written = len(writes)
    svc.save_at_stop()
    assert len(writes) == written


def stop_ends_before(svc: ColoService, wait_s: float, release: Callable[[], None]) -> bool:
    """Whether ``svc.save_at_stop(wait_s)``, on a thread of its own, ends before
    ``release`` lets go of what holds it up (joined generously: it ends in its
    ``wait_s``); ``release`` is called, and the stop joined, whatever the answer."""
    stopper = threading.Thread(target=lambda: svc.save_at_stop(wait_s))
    try:
        stopper.start()
        stopper.join(30.0)
        return not stopper.is_alive()
    finally:
        release()
        stopper.join()


def test_a_stop_kept_from_the_loops_lock_says_so_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A co-location tick (one the stop gave up waiting for) or an API call holds the
    loop's lock past the time the stop gives colo.json: the stop leaves the file, and the
    log names it and why, within that time."""
    svc = kept_loop(tmp_path, two_jobs_alone(), Clock())
    svc.tick(snapshot(used_gib=10))
    held, let_go = threading.Event(), threading.Event()

    def hold() -> None:
        with svc._lock:
            held.set()
            let_go.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    caplog.set_level(logging.WARNING)

    def release() -> None:
        let_go.set()
        holder.join()

    assert stop_ends_before(svc, 0.2, release)
    assert (
        f"co-location state {tmp_path / 'colo.json'} not written at the stop (a co-location"
        " tick or call held its lock for 0.2 s): the next start reads what it held before"
    ) in caplog.text


def test_a_start_that_stops_before_its_first_tick_writes_nothing(tmp_path: Path) -> None:
    """gpud starts on a colo.json (a guard's duty, a job that ended) and stops again before
    its loop ticks, as one that fails at start does again and again: the file holds what
    it would write, and is left as it is."""
    clock = Clock()
    svc, jobs = throttled(tmp_path, clock)
    jobs.append(RunningJob("old", "training", 1, memory_bytes=10 * GIB))
    svc.tick(snapshot())
    jobs.pop()
    clock.t += 5.0
    svc.tick(snapshot())
    svc.save_at_stop()
    assert "idle_s" in json.loads((tmp_path / "colo.json").read_text())["jobs"]["old"]
    writes: list[str] = []
    again = kept_loop(tmp_path, jobs, clock, write=counted(writes))
    assert again.duty("train") < 0.2
    clock.t += 5.0
    again.save_at_stop()
    assert writes == []


def test_the_stop_writes_how_long_ago_an_ended_job_ran_while_the_loop_stood_still(
    tmp_path: Path,
) -> None:
    """A job ended, then the loop stood still (no telemetry) for two minutes, its
    predictor's clock with it: the stop writes the ended job's ``idle_s`` as it is, so that
    the next start forgets the job when this gpud would have, not two minutes later."""
    clock = Clock()
    jobs = two_jobs_alone()
    svc = kept_loop(tmp_path, jobs, clock)
    for _ in range(3):
        svc.tick(snapshot(used_gib=10))
        clock.t += 5.0
    jobs.pop()
    svc.tick(snapshot(used_gib=10))
    svc.save_at_stop()
    idle = json.loads((tmp_path / "colo.json").read_text())["jobs"]["b"]["idle_s"]
    clock.t += 120.0
    svc.tick(None)
    svc.save_at_stop()
    assert json.loads((tmp_path / "colo.json").read_text())["jobs"]["b"]["idle_s"] == idle + 120


def test_a_switch_off_is_written_once_and_a_restart_keeps_it(tmp_path: Path) -> None:
    """`[colocate] enabled = false` (reloaded) while a guard throttles training: the
    switch-off is written once, at the tick that makes it. Started again with co-location
    on, the training runs at full duty and the guard starts afresh; started again with it
    still off, the switch-off is not said again."""
    clock = Clock()
    writes: list[str] = []
    svc, jobs = throttled(tmp_path, clock, write=counted(writes))
    svc.configure(ColocateConfig(enabled=False))
    written = len(writes)
    for _ in range(3):
        clock.t += 5.0
        svc.tick(snapshot())
    assert len(writes) == written + 1
    saved = json.loads((tmp_path / "colo.json").read_text())["jobs"]
    assert saved["train"]["duty"] is None
    assert saved["chat"]["guard_duty"] == 1.0
    on = kept_loop(tmp_path, jobs, clock)
    assert on.duty("train") == 1.0
    events = EventLog(tmp_path / "off.jsonl")
    off = ColoService(
        ColocateConfig(enabled=False),
        events,
        running=lambda: jobs,
        clock=clock,
        state_file=tmp_path / "colo.json",
    )
    off.tick(snapshot())
    assert off.duty("train") == 1.0
    assert events.recent(10, "colo.duty") == []


def stopped_switched_off(
    svc: ColoService, tmp_path: Path, jobs: list[RunningJob], clock: Clock
) -> dict[str, Any]:
    """``svc`` stops (`systemctl stop gpud`): colo.json holds `train` at no duty of the
    loop's, and a restart with co-location on runs it at full duty. The jobs the file
    holds."""
    svc.save_at_stop()
    saved: dict[str, Any] = json.loads((tmp_path / "colo.json").read_text())["jobs"]
    assert saved["train"]["duty"] is None
    assert kept_loop(tmp_path, jobs, clock).duty("train") == 1.0
    return saved


def test_a_switch_off_then_a_stop_before_any_tick_writes_it(tmp_path: Path) -> None:
    """`[colocate] enabled = false` (reloaded) while a guard throttles training, then
    `systemctl stop gpud` before the loop ticks again: the training is told full duty from
    the reload, the stop writes the switch-off, and a restart with co-location on runs the
    training at full duty, its guard afresh."""
    clock = Clock()
    svc, jobs = throttled(tmp_path, clock)
    svc.configure(ColocateConfig(enabled=False))
    assert svc.throttle_point("train", 1).duty == 1.0
    saved = stopped_switched_off(svc, tmp_path, jobs, clock)
    assert saved["chat"]["guard_duty"] == 1.0 and saved["chat"]["guard_breaches"] == 0
    assert "guard_company" not in saved["chat"]


def test_a_start_with_the_loop_off_that_stops_before_any_tick_writes_the_switch_off(
    tmp_path: Path,
) -> None:
    """gpud stopped while a guard throttles training, started again with `[colocate]
    enabled = false`, and stopped before its loop ticks: the training is told full duty
    from the start, and a restart with co-location on runs it at full duty."""
    clock = Clock()
    _, jobs = throttled(tmp_path, clock)
    off = ColoService(
        ColocateConfig(enabled=False),
        EventLog(tmp_path / "off.jsonl"),
        running=lambda: jobs,
        clock=clock,
        state_file=tmp_path / "colo.json",
    )
    assert off.throttle_point("train", 1).duty == 1.0
    stopped_switched_off(off, tmp_path, jobs, clock)


def test_a_tick_under_way_when_a_reload_switches_the_loop_off_throttles_nothing(
    tmp_path: Path,
) -> None:
    """A tick reads who runs as a reload switches co-location off: it plans nothing, so
    the training stays at full duty, and the stop writes the switch-off."""
    clock = Clock()
    jobs = [
        RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=20 * GIB),
        RunningJob("train", "training", 0, memory_bytes=10 * GIB),
    ]
    off = threading.Event()

    def running() -> list[RunningJob]:
        if off.is_set():
            svc.configure(ColocateConfig(enabled=False))  # the reload, as the tick reads
        return jobs

    svc = kept_loop(tmp_path, jobs, clock, running=running)
    throttle(svc, clock)
    off.set()
    clock.t += 1
    svc.report_latency("chat", [0.095] * 30)
    assert svc.tick(snapshot()) is None
    assert svc.throttle_point("train", 1).duty == 1.0
    stopped_switched_off(svc, tmp_path, jobs, clock)


def test_a_switch_off_leaves_no_guard_paused_by_a_fault_behind(tmp_path: Path) -> None:
    """A guard paused by GPU 0's hang, beside the training it held at duty 0.5, when a
    reload switches co-location off: colo.json keeps neither the pause nor the training
    the guard's duty was set beside, and a restart with co-location on, GPU 0 answering,
    starts the guard afresh: it acts at its first tick on latencies reported before it."""
    jobs = paused_then_killed(tmp_path)
    clock = Clock()
    svc = kept_loop(tmp_path, jobs, clock)
    svc.configure(ColocateConfig(enabled=False))
    clock.t += 1
    svc.tick(snapshot())
    saved = json.loads((tmp_path / "colo.json").read_text())["jobs"]["chat"]
    assert "guard_paused" not in saved and "guard_company" not in saved
    again = kept_loop(tmp_path, jobs, Clock())
    again.report_latency("chat", [0.095] * 100)
    again.tick(snapshot())
    assert again.duty("train") == 0.5


def test_a_guard_paused_by_a_hang_does_not_act_on_its_latencies_once_switched_on_again(
    tmp_path: Path,
) -> None:
    """GPU 0 hangs under a service and the training beside it, the service reporting
    200 ms through the hang (its guard paused, the training at full duty); a reload
    switches co-location off, GPU 0 answers, a reload switches it on again: the fresh
    guard does not cut the training for the hang's latencies the window still holds; it
    acts on those reported since."""
    svc, clock, _ = chat_beside_training(tmp_path)
    hung = gpu0_faulty("not answering: a driver call is out")
    clock.t += 1
    svc.report_latency("chat", [0.2] * 100)
    svc.tick(hung)
    assert svc.duty("train") == 1.0
    svc.configure(ColocateConfig(enabled=False))
    for snap in (hung, snapshot()):  # off: a tick hung, one answering
        clock.t += 1
        svc.tick(snap)
    svc.configure(ColocateConfig())
    duties = []
    for reported in (None, 0.095):  # on again: nothing new, then the training's doing
        clock.t += 1.5
        if reported is not None:
            svc.report_latency("chat", [reported] * 100)
        svc.tick(snapshot())
        duties.append(svc.duty("train"))
    assert duties == [1.0, 0.5]


def test_latencies_a_service_reports_while_the_loop_is_off_do_not_move_its_guard(
    tmp_path: Path,
) -> None:
    """A reload switches co-location off; GPU 0 then hangs under a service and the training
    beside it, the service reporting 200 ms against its 100 ms SLO through the hang (no
    tick of the off loop sees it); GPU 0 answers, a reload switches co-location on: the
    guard does not cut the training for latencies reported while the loop was off, and
    acts on those reported since it was switched on."""
    svc, clock, _ = chat_beside_training(tmp_path)
    svc.configure(ColocateConfig(enabled=False))
    hung = gpu0_faulty("not answering: a driver call is out")
    for snap in (hung, hung, snapshot()):  # off: the hang, then GPU 0 answering
        clock.t += 1
        svc.report_latency("chat", [0.2] * 100)
        svc.tick(snap)
    svc.configure(ColocateConfig())
    for _ in range(2):  # on again, nothing new reported
        clock.t += 1
        svc.tick(snapshot())
        assert svc.duty("train") == 1.0
    (g,) = svc.show().guards
    assert g.p99_ms == pytest.approx(200.0) and g.p99_at_duty_ms is None
    clock.t += 1
    svc.report_latency("chat", [0.095] * 100)  # the training's doing
    svc.tick(snapshot())
    assert svc.duty("train") == 0.5


def test_a_quiet_service_switched_on_is_guarded_once_twenty_requests_came_since(
    tmp_path: Path,
) -> None:
    """A service of little traffic (8 requests in 5 s) reported 200 ms while co-location
    was off and GPU 0 hung: switched on again, its guard holds until 20 requests came since
    (up to 6 latency windows back), then acts on those alone, at the tick that has them."""
    svc, clock, _ = chat_beside_training(tmp_path)
    svc.configure(ColocateConfig(enabled=False))
    clock.t += 5
    svc.report_latency("chat", [0.2] * 8)
    svc.tick(gpu0_faulty("not answering: a driver call is out"))
    svc.configure(ColocateConfig())
    duties = []
    for _ in range(3):
        clock.t += 5
        svc.report_latency("chat", [0.095] * 8)
        svc.tick(snapshot())
        duties.append(svc.duty("train"))
    assert duties == [1.0, 1.0, 0.5]


def test_latencies_reported_within_a_second_of_the_switch_on_do_not_move_the_guard(
    tmp_path: Path,
) -> None:
    """A report from a client that says no age, half a second after a reload switched
    co-location on, may hold requests served while it was off: the guard acts on reports
    from a second after the switch-on only."""
    svc, clock, _ = chat_beside_training(tmp_path)
    svc.configure(ColocateConfig(enabled=False))
    clock.t += 5
    svc.configure(ColocateConfig())
    clock.t += 0.5
    svc.report_latency("chat", [0.2] * 100)
    for step in (0.6, 0.9):
        clock.t += step
        svc.tick(snapshot())
        assert svc.duty("train") == 1.0


def test_a_service_switched_on_is_learned_from_its_latencies_since_only(tmp_path: Path) -> None:
    """A service reported slow requests while co-location was off (a GPU hang, say): once
    switched on, the speed it is seen at beside the training, and taught to the predictor,
    comes from the requests it served since."""
    svc, clock = chat_measured_alone_beside_training(tmp_path)
    svc.tick(snapshot())
    svc.configure(ColocateConfig(enabled=False))
    for _ in range(4):
        clock.t += 1
        svc.report_latency("chat", mm1_latencies(150.0, 100.0))
        svc.tick(snapshot())
    svc.configure(ColocateConfig())
    seen = []
    for _ in range(12):  # past the 10 s window
        clock.t += 1
        svc.report_latency("chat", mm1_latencies(360.0, 100.0))
        svc.tick(snapshot())
        seen.append(svc.show().observed_speed.get("chat"))
    assert seen[-1] == pytest.approx(360.0 / 400.0, rel=1e-3)
    assert all(s is None or s == pytest.approx(360.0 / 400.0, rel=1e-3) for s in seen)
    assert svc.duty("train") == 1.0


def test_a_quiet_services_batch_held_across_a_switch_on_is_judged_by_when_it_was_served(
    tmp_path: Path,
) -> None:
    """gpud.client sends a batch at the next request a second after its last send: a
    quiet service's two slow requests, served while co-location was off and GPU 0 hung,
    wait in it until a request 9 s after the switch-on. Sent first, on their own, with
    their age, they are no part of what the guard acts on: the 50 ms requests since,
    within the 100 ms SLO, leave the training at full duty."""
    svc, clock, _ = chat_beside_training(tmp_path)
    svc.configure(ColocateConfig(enabled=False))
    clock.t += 70
    lat = slow_while_gpu0_hangs(svc, clock)
    svc.configure(ColocateConfig())
    clock.t += 9
    assert quiet_requests(svc, lat, clock) == [1.0] * 18
    (g,) = svc.show().guards
    assert g.p99_at_duty_ms is None  # 18 requests since: not yet judged


def test_a_quiet_services_batch_held_through_a_hang_is_judged_by_when_it_was_served(
    tmp_path: Path,
) -> None:
    """A quiet service's two slow requests, served while GPU 0 hung under it, wait in its
    client until a request 3 s after the GPU answers again: sent with their age they count
    from the hang, before its guard's pause ended, and the guard does not cut the training
    for them."""
    svc, clock, _ = chat_beside_training(tmp_path)
    lat = slow_while_gpu0_hangs(svc, clock)
    svc.tick(snapshot())  # answering: the guard acts on what is served from a second on
    clock.t += 3
    assert quiet_requests(svc, lat, clock) == [1.0] * 18


def slow_while_gpu0_hangs(svc: ColoService, clock: Clock) -> Latency:
    """A quiet service's client, holding two 200 ms requests served while a tick found GPU
    0 hung (not sent: none came a second after): a second later."""
    lat = Latency("chat", clock=clock, send=svc.report_latency, flush_every_s=1.0, background=False)
    lat.observe(0.2)
    lat.observe(0.2)
    svc.tick(gpu0_faulty("not answering: a driver call is out"))
    clock.t += 1
    return lat


def quiet_requests(svc: ColoService, lat: Latency, clock: Clock) -> list[float]:
    """18 requests of 50 ms, 1.1 s apart, a tick after each: the training's duties."""
    duties = []
    for _ in range(18):
        lat.observe(0.05)
        svc.tick(snapshot())
        duties.append(svc.duty("train"))
        clock.t += 1.1
    return duties


def test_a_latency_report_of_an_impossible_age_is_refused_naming_the_field(
    tmp_path: Path,
) -> None:
    svc, _, _ = chat_beside_training(tmp_path)
    for age in (-1.0, math.nan, math.inf, 1e9):
        with pytest.raises(InvalidArgument, match=r"job chat: latency report age_s .* outside"):
            svc.report_latency("chat", [0.01], age)
    assert len(svc._latencies("chat", float("-inf"))) == 100  # the helper's own


def test_a_held_batch_and_the_next_report_close_after_it_are_no_surge_in_load(
    tmp_path: Path,
) -> None:
    """A quiet service's two requests, held through 10.5 s of quiet, go when the next
    comes; the report after it arrives a millisecond later. Its load stays what the
    requests were, a couple a second, not one request over that millisecond."""
    svc, clock, _ = chat_beside_training(tmp_path)
    t0 = clock.t

    def send(job: str, seconds: list[float], age_s: float | None) -> None:
        svc.report_latency(job, seconds, age_s)
        clock.t += 0.001

    lat = Latency("chat", clock=clock, send=send, flush_every_s=1.0, background=False)
    loads = []
    for t in (0.0, 0.5, 11.0, 11.5, 12.6):
        clock.t = t0 + t
        lat.observe(0.01)
        loads.append(svc.load("chat"))
    # two requests a second at the most, never one over the millisecond between reports
    assert max(loads[2:]) <= 2.0 and loads[-1] > 0.5, loads


def test_two_reports_a_millisecond_apart_read_as_a_report_periods_requests(
    tmp_path: Path,
) -> None:
    """Reports close together (what several replicas under one job can send) are counted
    over a report period at least, not over the millisecond between them."""
    svc, clock, _ = chat_beside_training(tmp_path)
    clock.t += 20
    svc.report_latency("chat", [0.01] * 2)
    clock.t += 0.001
    svc.report_latency("chat", [0.01])
    assert svc.load("chat") == pytest.approx(1.0)


def test_a_busy_services_guard_cuts_at_the_pace_of_its_reports(tmp_path: Path) -> None:
    """100 requests a second through gpud.client, at 300 ms from 2 s on (the SLO is 100
    ms), a tick a second: each report holds a second's requests, counted from its arrival,
    so the guard halves the training's duty every other second from the first slow
    report, as it waits for a report made at the duty it set."""
    svc, clock, _ = chat_beside_training(tmp_path)
    t0 = clock.t
    lat = Latency("chat", clock=clock, send=svc.report_latency, flush_every_s=1.0, background=False)
    cuts = []
    for step in range(1, 1201):
        clock.t = t0 + step / 100
        lat.observe(0.3 if step > 200 else 0.01)
        if step % 100 == 0:
            before = svc.duty("train")
            svc.tick(snapshot())
            if svc.duty("train") < before:
                cuts.append(step // 100)
    assert cuts == [3, 5, 7, 9, 11]


def test_a_held_batch_from_a_second_replica_is_counted_no_earlier_than_the_jobs_reports(
    tmp_path: Path,
) -> None:
    """Replica A reported a 50 ms request 40 s ago and 19 more from 30 s to 3 s ago;
    replica B's client then sends one 2 s request held 50 s. The job's latencies stay in
    time order: B's request counts from A's newest report, so the 20 latest the p99 of a
    quiet service reads are the 20 stamped last (A's oldest left out), and a guard's
    judgement from 3.5 s ago holds both requests reported since."""
    svc, clock, _ = chat_beside_training(tmp_path)
    t0 = clock.t + 60
    for ago in [40.0] + [30.0 - 1.5 * i for i in range(19)]:
        clock.t = t0 - ago
        svc.report_latency("chat", [0.05])
    clock.t = t0
    svc.report_latency("chat", [2.0], 50.0)
    stamps = [t for t, _ in svc._jobs["chat"].latency]
    assert stamps == sorted(stamps)
    assert stamps[-1] == pytest.approx(t0 - 3.0)
    assert svc.p99("chat", since=t0 - 3.5, min_samples=2) == 2.0


def test_a_switch_off_refused_by_a_full_disk_is_written_once_the_disk_has_room(
    tmp_path: Path,
) -> None:
    """`[colocate] enabled = false` (reloaded) while a guard throttles training, and the
    disk full at the tick that switches the loop off: a later tick, the disk freed, writes
    the switch-off, so a restart with co-location on runs the training at full duty."""
    clock = Clock()
    full = threading.Event()
    svc, jobs = throttled(tmp_path, clock, write=refused_while(full))
    assert json.loads((tmp_path / "colo.json").read_text())["jobs"]["train"]["duty"] < 0.2
    full.set()
    svc.configure(ColocateConfig(enabled=False))
    clock.t += 5.0
    svc.tick(snapshot())
    full.clear()
    for _ in range(3):
        clock.t += 5.0
        svc.tick(snapshot())
    assert stopped_switched_off(svc, tmp_path, jobs, clock)["chat"]["guard_duty"] == 1.0


def test_a_switch_off_the_disk_refused_to_its_last_tick_is_written_at_the_stop(
    tmp_path: Path,
) -> None:
    """The disk full from the tick that switches the loop off to the last before the stop,
    freed then: the stop writes the switch-off (with the loop off it writes nothing else)."""
    clock = Clock()
    full = threading.Event()
    svc, jobs = throttled(tmp_path, clock, write=refused_while(full))
    full.set()
    svc.configure(ColocateConfig(enabled=False))
    for _ in range(2):
        clock.t += 5.0
        svc.tick(snapshot())
    full.clear()
    stopped_switched_off(svc, tmp_path, jobs, clock)


def test_a_loop_switched_off_on_and_off_again_keeps_the_second_switch_off(
    tmp_path: Path,
) -> None:
    """Off (a reload), on again, the guard throttling training anew, then off once more:
    colo.json ends with the training's duty lifted and the guard reset, as a restart with
    co-location on then runs it."""
    clock = Clock()
    svc, jobs = throttled(tmp_path, clock)
    svc.configure(ColocateConfig(enabled=False))
    clock.t += 5.0
    svc.tick(snapshot())
    svc.configure(ColocateConfig())
    throttle(svc, clock)
    assert json.loads((tmp_path / "colo.json").read_text())["jobs"]["train"]["duty"] < 0.2
    svc.configure(ColocateConfig(enabled=False))
    clock.t += 5.0
    svc.tick(snapshot())
    saved = json.loads((tmp_path / "colo.json").read_text())["jobs"]
    assert saved["train"]["duty"] is None
    assert saved["chat"]["guard_duty"] == 1.0
    assert kept_loop(tmp_path, jobs, clock).duty("train") == 1.0


def clock_unwritten(
    tmp_path: Path, clock: Clock, write: Callable[[Path, str], None]
) -> ColoService:
    """A :func:`kept_loop` of two jobs alone (colo.json written by ``write``) whose
    predictor's clock moved on since the file was last written: the stop has it to write."""
    svc = kept_loop(tmp_path, two_jobs_alone(), clock, write=write)
    for _ in range(3):
        svc.tick(snapshot(used_gib=10))
        clock.t += 5.0
    svc.tick(snapshot(used_gib=10))
    return svc


def test_a_stop_whose_write_hangs_says_so_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No tick writes, and the stop's own write of colo.json does not end (a disk that
    stopped answering): the stop leaves it within the time it gives the file, and the log
    names the file and why."""
    clock = Clock()
    hang, entered, released, done = (threading.Event() for _ in range(4))

    def write(path: Path, text: str) -> None:
        if hang.is_set():
            entered.set()
            released.wait()
        write_atomically(path, text)
        done.set()

    svc = clock_unwritten(tmp_path, clock, write)
    hang.set()
    done.clear()
    caplog.set_level(logging.WARNING)

    def release() -> None:
        released.set()
        done.wait(30.0)

    assert stop_ends_before(svc, 0.3, release)
    assert entered.is_set()
    assert (
        f"co-location state {tmp_path / 'colo.json'} not written at the stop (the stop's"
        " write of it still runs after 0.3 s): the next start reads what it held before"
    ) in caplog.text


def test_a_stop_whose_write_had_not_begun_by_its_deadline_says_so_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The stop's write thread has not come to its write of colo.json when the time the
    stop gives the file runs out (held before it, as a thread not yet run is): the log
    names the file and says the stop's write had not begun, not that it still runs; let
    go, the thread writes it."""
    done = threading.Event()

    def write(path: Path, text: str) -> None:
        write_atomically(path, text)
        done.set()

    svc = clock_unwritten(tmp_path, Clock(), write)
    done.clear()
    caplog.set_level(logging.WARNING)

    def release() -> None:
        svc._pending_lock.release()
        done.wait(30.0)

    svc._pending_lock.acquire()
    assert stop_ends_before(svc, 0.2, release)
    assert (
        f"co-location state {tmp_path / 'colo.json'} not written at the stop (the stop's"
        " write of it had not begun after 0.2 s): the next start reads what it held before"
    ) in caplog.text
    assert "still runs" not in caplog.text
    assert done.is_set()


def stopped_behind_a_hung_tick(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, then: Exception | None = None
) -> list[Exception]:
    """Two jobs alone, a third joining; the tick that sees it writes colo.json, a write
    that does not end (a disk that stopped answering) when the stop, given 0.3 s, comes:
    the stop leaves its state to that writer, and the log says another write of the file
    still runs, not the stop's own. Let go once the stop has given up, the write ends by
    raising ``then``, where given, else by writing. What the tick raised."""
    clock = Clock()
    jobs = two_jobs_alone()
    hang, entered, released = (threading.Event() for _ in range(3))

    def write(path: Path, text: str) -> None:
        if hang.is_set():
            hang.clear()
            entered.set()
            released.wait()
            if then is not None:
                raise then
        write_atomically(path, text)

    svc = kept_loop(tmp_path, jobs, clock, write=write)
    svc.tick(snapshot(used_gib=10))
    jobs.append(RunningJob("c", "training", 1, memory_bytes=8 * GIB))
    hang.set()
    clock.t += 5.0
    raised: list[Exception] = []

    def tick() -> None:
        try:
            svc.tick(snapshot(used_gib=10))
        except Exception as err:
            raised.append(err)

    ticker = threading.Thread(target=tick)
    ticker.start()
    entered.wait(30.0)
    caplog.set_level(logging.WARNING)

    def release() -> None:
        released.set()
        ticker.join()

    assert stop_ends_before(svc, 0.3, release)
    assert (
        f"co-location state {tmp_path / 'colo.json'} not written at the stop (another write"
        " of it still runs after 0.3 s): the next start reads what it held before"
    ) in caplog.text
    return raised


def test_a_stop_behind_a_ticks_write_that_hangs_says_another_write_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tick's write of colo.json does not end when the stop comes: the log says another
    write of the file still runs, not the stop's own; once it ends, the file holds the
    stop's state."""
    assert stopped_behind_a_hung_tick(tmp_path, caplog) == []
    assert "c" in json.loads((tmp_path / "colo.json").read_text())["jobs"]


def test_a_ticks_write_that_hangs_then_raises_still_writes_the_state_the_stop_left_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tick's write of colo.json hangs when the stop comes, which leaves its state to
    that writer; the write then raises what no failed write does (a fault of the
    writer's own): the writer still writes the stop's state, so colo.json holds what the
    stop knew, and the tick is told of the error."""
    raised = stopped_behind_a_hung_tick(tmp_path, caplog, RuntimeError("writer broke"))
    assert [str(err) for err in raised] == ["writer broke"]
    assert "c" in json.loads((tmp_path / "colo.json").read_text())["jobs"]


def test_a_stop_whose_write_raises_says_the_write_failed_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The stop's own write of colo.json raises what no failed write does (a fault of the
    writer's own): the log names the file and the error, and the stop says the write
    failed, not that one still runs."""
    clock = Clock()
    broken = threading.Event()

    def write(path: Path, text: str) -> None:
        if broken.is_set():
            raise RuntimeError("writer broke")
        write_atomically(path, text)

    svc = clock_unwritten(tmp_path, clock, write)
    broken.set()
    caplog.set_level(logging.WARNING)
    hooked: list[threading.ExceptHookArgs] = []
    was, threading.excepthook = threading.excepthook, hooked.append
    try:
        svc.save_at_stop(1.0)
    finally:
        threading.excepthook = was
    path = tmp_path / "colo.json"
    assert hooked == []
    assert f"co-location state {path} not written: RuntimeError: writer broke" in caplog.text
    assert (
        f"co-location state {path} not written at the stop (RuntimeError: writer broke): the"
        " next start reads what it held before"
    ) in caplog.text
    assert "still runs" not in caplog.text


def test_metrics(service: tuple[ColoService, Clock, list[RunningJob]]) -> None:
    svc, _, _ = service
    svc.report_latency("chat", [0.02] * 50)
    svc.tick(snapshot())
    reg = scraped(svc)
    assert reg.get_sample_value("gpud_colo_sm_share_ratio", {"job": "train"}) == 0.5
    assert reg.get_sample_value("gpud_colo_duty_ratio", {"job": "train"}) == 1.0
    assert reg.get_sample_value("gpud_colo_guard_p99_latency_seconds", {"job": "chat"}) == 0.02
    assert reg.get_sample_value("gpud_colo_slo_attainment_ratio", {"job": "chat"}) == 1.0
    assert reg.get_sample_value("gpud_colo_predictor_samples") == 0.0


def test_a_scrape_reads_no_store_until_a_reservation_goes(tmp_path: Path) -> None:
    """`/metrics` and `gpuctl colo show` show the last pass's jobs that still hold a
    reservation: which do is known from that pass until the jobs service says some went
    (its freed hook), read once then, so a scrape reads no store; a release while the pass
    or that read runs leaves it to be read again, never a run shown placed that ended."""
    from collections.abc import Iterator
    from contextlib import contextmanager
    from sqlite3 import Connection

    from gpud.jobs.placement import Reservations
    from gpud.store import StateStore

    class CountingStore(StateStore):
        calls = 0

        @contextmanager
        def transaction(self) -> Iterator[Connection]:
            self.calls += 1
            with super().transaction() as conn:
                yield conn

    store = CountingStore(tmp_path / "state")
    reservations = Reservations(store)
    held = [
        reservations.add(j, ["GPU-x"], threads_percent=None, memory_bytes=None,
                         client_priority=0, holder_pid=None)
        for j in ("train", "chat")
    ]  # fmt: skip
    freed: list[object] = []

    def holding() -> set[str]:
        names = {r.job for r in reservations.held()}
        if freed:  # a release committed while this was read
            reservations.release(held[0].id)
            svc.reservations_freed()
            freed.clear()
        return names

    jobs = [
        RunningJob("train", "training", 0, threads_percent=50, memory_bytes=10 * GIB),
        RunningJob("chat", "inference", 0, slo_p99_ms=50.0, memory_bytes=10 * GIB),
    ]
    svc = ColoService(
        ColocateConfig(),
        EventLog(tmp_path / "e.jsonl"),
        running=lambda: jobs,
        holding=holding,
        clock=Clock(),
    )
    svc.tick(snapshot())
    reg = scraped(svc)
    before = store.calls
    for _ in range(100):
        assert reg.get_sample_value("gpud_colo_sm_share_ratio", {"job": "train"}) == 0.5
        assert {r.name for r in svc.show().running} == {"train", "chat"}
    assert store.calls == before
    freed.append(True)  # "train" ends while the next read runs
    svc.reservations_freed()
    assert {r.name for r in svc.show().running} == {"train", "chat"}  # read before it went
    assert {r.name for r in svc.show().running} == {"chat"}  # read again: it went
    assert reg.get_sample_value("gpud_colo_sm_share_ratio", {"job": "train"}) is None
    read = store.calls
    for _ in range(100):
        svc.show()
    assert store.calls == read
    store.close()


def test_config_ranges_name_the_key() -> None:
    import dataclasses

    from gpud.config import Config, validate
    from gpud.errors import ConfigError

    bad = dataclasses.replace(Config(), colocate=ColocateConfig(min_duty=0.0))
    with pytest.raises(ConfigError, match=r"colocate\.min_duty"):
        validate(bad, path="gpud.toml")


def test_the_peak_is_held_at_the_duty_the_guard_can_reach(tmp_path: Path) -> None:
    """The guard never throttles below min_duty: a peak_duty under it counts as min_duty."""
    config = ColocateConfig(peak_duty=0.01, min_duty=0.2)
    svc = ColoService(config, EventLog(tmp_path / "e.jsonl"), running=list)
    assert svc._planner.params.peak_duty == 0.2
    svc.configure(ColocateConfig(peak_duty=0.5))
    assert svc._planner.params.peak_duty == 0.5


@pytest.mark.parametrize("end", [0, 1])
def test_every_colocate_value_the_config_accepts_starts_the_loop(tmp_path: Path, end: int) -> None:
    """validate() is the gate: a value it lets through must not stop the daemon at start
    (the guard and the planner refuse a margin or a headroom of half)."""
    import dataclasses

    from gpud.config import RANGE, Config, validate

    for f in dataclasses.fields(ColocateConfig):
        if RANGE not in f.metadata:
            continue
        value = f.metadata[RANGE][end]
        config = ColocateConfig(**{f.name: value})
        validate(dataclasses.replace(Config(), colocate=config), path="gpud.toml")
        svc = ColoService(config, EventLog(tmp_path / "e.jsonl"), running=list)
        assert svc.tick(snapshot()) is not None, (f.name, value)


def test_throttle_point_sleeps_the_duty_cycle() -> None:
    clock = Clock()
    slept: list[float] = []
    calls: list[tuple[str, int]] = []

    def call(job: str, iterations: int) -> tuple[float, bool, str]:
        calls.append((job, iterations))
        return 0.25, False, "guard"

    def sleep(s: float) -> None:
        slept.append(s)
        clock.t += s

    t = Throttle("train", clock=clock, sleep=sleep, call=call, report_every_s=0.0)
    t.point()  # first iteration: nothing to measure yet
    clock.t += 1.0  # an iteration of 1 s
    assert t.point() == pytest.approx(3.0)  # 1 s of work per 4 s: duty 0.25
    assert sum(slept) == pytest.approx(3.0) and max(slept) <= 1.0  # slept in slices
    # the first point's iteration goes with the next report: none of its time was slept
    assert calls[:2] == [("train", 0), ("train", 2)]


def test_throttle_point_returns_an_eviction_at_once() -> None:
    """gpud evicts with duty 0 (0.01 as the client bounds it): the call that brings the
    eviction returns without sleeping, so the job sees ``directive()`` and leaves now, not
    after 99 iterations' time holding the memory or SMs it was evicted for; a job that
    goes on regardless is held at that duty."""
    clock = Clock()
    slept: list[float] = []
    told = [(1.0, False, "no SLO pressure"), (0.0, True, "GPU 0 memory over its limit")]

    def sleep(s: float) -> None:
        slept.append(s)
        clock.t += s

    t = Throttle("train", clock=clock, sleep=sleep, call=lambda j, i: told[0], report_every_s=0.0)
    t.point()
    clock.t += 1.0
    t.point()
    told.pop(0)  # gpud evicts it
    clock.t += 1.0  # an iteration of 1 s
    assert t.point() == 0.0
    assert (t.evict, t.reason) == (True, "GPU 0 memory over its limit") and slept == []
    clock.t += 1.0  # it ignores the eviction and iterates again
    t.point()
    assert sum(slept) == pytest.approx(99.0)


def test_throttle_point_keeps_going_without_a_daemon() -> None:
    def down(job: str, iterations: int) -> tuple[float, bool, str]:
        raise OSError("no socket")

    t = Throttle("train", call=down, sleep=lambda s: None)
    assert t.point() == 0.0 and t.duty == 1.0


def test_a_throttle_from_a_gpud_that_stopped_answering_lapses_after_its_hold() -> None:
    """gpud killed (kill -9, a crash loop, systemctl stop) while the guard held a training
    job at duty 0.05: the job keeps that duty through a restart's worth of silence
    (``hold_s``), the service still protected, then runs at full speed, not 20 times slower
    for as long as gpud stays away; once gpud answers again (asked within the back-off of
    the failed calls) its directive holds again."""
    clock = Clock()
    slept: list[float] = []
    told: list[tuple[float, bool, str] | None] = [(0.05, False, "SLO guard")]

    def call(job: str, iterations: int) -> tuple[float, bool, str]:
        if told[0] is None:
            raise OSError("no socket")
        return told[0]

    def sleep(s: float) -> None:
        slept.append(s)
        clock.t += s

    t = Throttle("train", clock=clock, sleep=sleep, call=call, report_every_s=0.0, hold_s=30.0)
    t.point()
    told[0] = None  # gpud is gone
    clock.t += 1.0
    t.point()
    assert t.duty == 0.05 and sum(slept) == pytest.approx(19.0)  # held through a restart
    clock.t += 20.0  # past the hold since gpud last answered
    assert t.point() == 0.0
    assert t.duty == 1.0 and not t.evict
    assert "gpud has not answered for 40 s" in t.reason, t.reason
    told[0] = (0.5, False, "SLO guard")  # back: asked again once the back-off ran out
    clock.t += REPORT_BACKOFF_MAX_S
    assert t.point() == pytest.approx(REPORT_BACKOFF_MAX_S)
    assert t.duty == 0.5


def test_a_gpud_that_never_answers_costs_the_training_loop_a_bounded_number_of_waits() -> None:
    """gpud stopped (SIGSTOP, a deadlock) accepts each call and answers none: each call
    waits its timeout. The calls are spaced out after each failure, so 50 ms iterations for
    10 minutes wait on at most a few dozen calls, not one a second for ever; once gpud
    answers again it is asked every ``report_every_s`` again."""
    clock = Clock()
    answering = [True]
    calls: list[float] = []

    def call(job: str, iterations: int) -> tuple[float, bool, str]:
        calls.append(clock.t)
        if not answering[0]:
            clock.t += CALL_TIMEOUT_S  # the call waits its whole timeout, then fails
            raise TimeoutError("deadline exceeded")
        return 0.5, False, "SLO guard"

    def sleep(s: float) -> None:
        clock.t += s

    t = Throttle("train", clock=clock, sleep=sleep, call=call, report_every_s=1.0, hold_s=60.0)
    t.point()
    answering[0] = False
    calls.clear()
    for _ in range(12000):  # 10 minutes of 50 ms iterations
        clock.t += 0.05
        t.point()
    assert len(calls) <= 600 / REPORT_BACKOFF_MAX_S + 6, len(calls)
    assert t.duty == 1.0 and "directive lapsed" in t.reason  # past the hold, full duty
    answering[0] = True
    calls.clear()
    for _ in range(2 * int(REPORT_BACKOFF_MAX_S) * 20):
        clock.t += 0.05
        t.point()
    assert t.duty == 0.5 and len(calls) >= REPORT_BACKOFF_MAX_S - 1, len(calls)


def test_a_directive_outlives_the_slowest_restart_the_unit_allows_gpud() -> None:
    """A deadlocked gpud answers nothing until its watchdog (WatchdogSec) runs out, then
    systemd stops it within TimeoutStopSec, waits RestartSec and gives the start
    TimeoutStartSec: a directive held for less would let throttled training run at full
    speed beside an unprotected service through a slow restart."""
    unit = (Path(__file__).parents[2] / "systemd" / "gpud.service").read_text()

    def seconds(key: str) -> float:
        match = re.search(rf"^{key}=(\d+)s$", unit, re.MULTILINE)
        assert match, key
        return float(match.group(1))

    budget = sum(
        seconds(key) for key in ("WatchdogSec", "TimeoutStopSec", "RestartSec", "TimeoutStartSec")
    )
    assert budget <= DIRECTIVE_HOLD_S, (DIRECTIVE_HOLD_S, budget)


def test_a_gpud_back_inside_the_hold_is_asked_before_the_directive_lapses() -> None:
    """gpud away from 0.5 s to 125 s after it last answered, inside a hold of 150 s: the
    backed-off calls (at 1, 3, 7, ... 121 s, then 151 s) would all miss it, but one call is
    tried just before the hold runs out, so training at duty 0.05 never runs at full speed
    beside the service its restored guard protects."""
    clock = Clock()
    start = clock.t

    def call(job: str, iterations: int) -> tuple[float, bool, str]:
        if 0.5 < clock.t - start < 125.0:
            raise OSError("no socket")
        return 0.05, False, "SLO guard"

    def sleep(s: float) -> None:
        clock.t += s

    t = Throttle("train", clock=clock, sleep=sleep, call=call, hold_s=150.0)
    duties = []
    while clock.t - start < 200.0:
        clock.t += 0.05  # an iteration
        t.point()
        duties.append(t.duty)
    assert set(duties) == {0.05} and not t.evict, t.reason


def test_a_directive_that_lapses_says_so_once_on_the_jobs_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    clock = Clock()
    told: list[tuple[float, bool, str] | None] = [(0.05, False, "SLO guard")]

    def call(job: str, iterations: int) -> tuple[float, bool, str]:
        if told[0] is None:
            raise OSError("no socket")
        return told[0]

    t = Throttle("train", clock=clock, sleep=lambda s: None, call=call, hold_s=30.0)
    t.point()
    told[0] = None
    for _ in range(200):
        clock.t += 1.0
        t.point()
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "gpud.client: job train: gpud has not answered for 31 s: its directive lapsed, "
        "running at full duty until it answers"
    ], err


@pytest.mark.parametrize("every", [float("nan"), float("inf"), -1.0])
def test_a_report_interval_that_is_no_number_of_seconds_is_refused_naming_it(
    every: float,
) -> None:
    """A NaN or infinite interval would never come round: the job would report nothing,
    and gpud would never throttle or evict it."""
    with pytest.raises(ValueError, match="Throttle report_every_s must be a finite number"):
        Throttle("train", call=lambda j, i: (1.0, False, ""), report_every_s=every)


@pytest.mark.parametrize("every", [float("nan"), -1.0, -0.0001])
def test_a_latency_flush_interval_that_is_no_number_of_seconds_is_refused_naming_it(
    every: float,
) -> None:
    """A NaN interval never comes round, a negative one means nothing. (An infinite one
    is a choice: reports only when flushed or a batch fills.)"""
    with pytest.raises(ValueError, match="Latency flush_every_s must be a number of seconds"):
        Latency("chat", send=lambda j, s, a: None, flush_every_s=every)


@pytest.mark.parametrize("argument", ["max_batch", "max_pending"])
@pytest.mark.parametrize("count", [0, -1, 2.5, 8.0, True])
def test_a_latency_count_that_is_no_whole_number_is_refused_naming_it(
    argument: str, count: object
) -> None:
    with pytest.raises(ValueError, match=f"Latency {argument} must be a whole number >= 1"):
        Latency("chat", send=lambda j, s, a: None, **{argument: count})


@pytest.mark.parametrize("argument", ["max_batch", "max_pending"])
def test_a_latency_count_of_any_integer_type_is_taken(argument: str) -> None:
    """A count read from numpy (a config array, a computed batch size) is a whole number."""
    lat = Latency("chat", send=lambda j, s, a: None, **{argument: numpy.int64(3)})
    assert lat.close(timeout=30)


@pytest.mark.parametrize("hold", [float("nan"), -1.0])
def test_a_hold_that_is_no_number_of_seconds_is_refused_naming_it(hold: float) -> None:
    with pytest.raises(ValueError, match="Throttle hold_s must be a number of seconds >= 0"):
        Throttle("train", call=lambda j, i: (1.0, False, ""), hold_s=hold)


@pytest.mark.parametrize("lifted", [False, True])
def test_a_job_held_at_the_floor_sees_its_directive_lapse_or_lift_within_its_sleep(
    lifted: bool,
) -> None:
    """An evicted job that goes on with 2 s iterations sleeps 198 s at duty 0.01: gpud
    gone 5 s into that sleep, the directive lapses at the hold (30 s), not after the whole
    sleep; gpud lifting the eviction mid-sleep is heard within a slice."""
    clock = Clock()
    start = clock.t

    def call(job: str, iterations: int) -> tuple[float, bool, str]:
        if clock.t - start > 5.0:
            if lifted:
                return 1.0, False, "no SLO pressure"
            raise OSError("no socket")
        return 0.0, True, "GPU 0 memory over its limit"

    def sleep(s: float) -> None:
        clock.t += s

    t = Throttle("train", clock=clock, sleep=sleep, call=call, report_every_s=1.0, hold_s=30.0)
    t.point()  # the eviction, returned at once
    clock.t += 2.0  # it goes on: an iteration of 2 s
    slept = t.point()
    assert t.duty == 1.0 and not t.evict, t.reason
    assert slept <= (5.0 if lifted else 35.0), slept


def test_an_eviction_from_a_gpud_that_stopped_answering_lapses_after_its_hold() -> None:
    """An eviction stands while gpud may be restarting, then lapses with it: a job that
    went on iterating is not held at duty 0.01 by a gpud that is no longer there."""
    clock = Clock()
    told: list[tuple[float, bool, str] | None] = [(0.0, True, "GPU 0 memory over its limit")]

    def call(job: str, iterations: int) -> tuple[float, bool, str]:
        if told[0] is None:
            raise OSError("no socket")
        return told[0]

    t = Throttle(
        "train", clock=clock, sleep=lambda s: None, call=call, report_every_s=0.0, hold_s=30.0
    )
    t.point()
    told[0] = None
    clock.t += 29.0
    t.point()
    assert t.evict and t.duty == 0.01
    clock.t += 2.0
    t.point()
    assert not t.evict and t.duty == 1.0


def test_latency_batches_and_says_the_age_of_a_batch_held_through_a_quiet_spell_only() -> None:
    """A second's requests go in one report with the request that sends it, saying no age
    (gpud counts it from its arrival). A batch whose newest request finished more than a
    second before the next one was held through a quiet spell: it goes alone, saying when
    its earliest request began, and that next request goes right after it."""
    clock = Clock()
    sent: list[tuple[str, list[float], float | None]] = []
    lat = Latency(
        "chat",
        clock=clock,
        send=lambda j, s, a: sent.append((j, s, a)),
        flush_every_s=1.0,
        background=False,
    )
    lat.observe(0.01)
    clock.t += 0.5
    lat.observe(0.02)
    clock.t += 0.75
    lat.observe(0.03)
    assert sent == [("chat", [0.01, 0.02, 0.03], None)]
    clock.t += 0.5
    lat.observe(0.04)
    clock.t += 9.5
    lat.observe(0.05)
    assert sent[1:] == [("chat", [0.04], pytest.approx(9.54)), ("chat", [0.05], None)]
    clock.t += 0.25
    lat.flush()  # nothing held
    assert len(sent) == 3


def test_a_busy_service_reports_once_a_second_none_split_off(
    tmp_path: Path,
) -> None:
    """100 requests a second for 5 s make five reports of 100, each counted from its
    arrival: none of a single request sent apart from the second before it."""
    clock = Clock()
    sent: list[tuple[int, float | None]] = []
    lat = Latency(
        "chat",
        clock=clock,
        send=lambda j, s, a: sent.append((len(s), a)),
        flush_every_s=1.0,
        background=False,
    )
    t0 = clock.t
    for step in range(1, 501):
        clock.t = t0 + step / 100
        lat.observe(0.01)
    assert sent == [(100, None)] * 5


def test_latency_reports_an_age_of_a_day_at_most() -> None:
    clock = Clock()
    sent: list[float] = []
    lat = Latency("chat", clock=clock, send=lambda j, s, a: sent.append(a), flush_every_s=1.0)
    lat.observe(0.01)
    clock.t += 2 * 86400
    lat.close()
    assert sent == [86400.0]


class HungGpud:
    """A gpud that accepts latency reports and answers none until ``answer`` is set: a
    call on the serving thread is a whole call's deadline waited there (counted, then
    failed as the deadline would fail it); one on the sender thread waits for ``answer``."""

    def __init__(self, clock: Clock) -> None:
        self.serving = threading.get_ident()
        self.clock = clock
        self.waits_on_serving_thread = 0
        self.calling = threading.Event()  # the sender thread is in a call
        self.answer = threading.Event()
        self.sent: list[tuple[list[float], float | None]] = []

    def __call__(self, job: str, seconds: list[float], age_s: float | None) -> None:
        if threading.get_ident() == self.serving:
            self.waits_on_serving_thread += 1
            self.clock.t += CALL_TIMEOUT_S
            raise TimeoutError("deadline exceeded")
        self.calling.set()
        self.answer.wait()
        self.sent.append((seconds, age_s))


def test_a_hung_gpud_costs_the_serving_thread_no_wait_and_says_how_many_it_dropped() -> None:
    """A gpud stopped mid-call (SIGSTOP, a deadlock) holds the sender thread, never the
    request being served: 20 requests 1.1 s apart make 20 reports and not one waits for
    gpud. The reports behind the hung call are bounded (max_pending): the oldest go and
    are counted; those that gpud gets once it answers say how long ago their requests
    began, as they were not sent when made."""
    clock = Clock()
    gpud = HungGpud(clock)
    lat = Latency("chat", clock=clock, send=gpud, flush_every_s=1.0, max_pending=4)
    clock.t += 1.1
    lat.observe(0.01)  # the first report: gpud takes the call and answers nothing
    assert gpud.waits_on_serving_thread == 0
    assert gpud.calling.wait(timeout=30)  # a guard against a hang, not a measurement
    for _ in range(19):
        clock.t += 1.1
        lat.observe(0.01)
    assert gpud.waits_on_serving_thread == 0
    gpud.answer.set()
    assert lat.close(timeout=30)
    # the first (its call hung), then the newest 4 of the 19 behind it: 15 dropped
    assert [len(s) for s, _ in gpud.sent] == [1] * 5
    assert lat.dropped == 15
    # made at 3.3, 2.2, 1.1 and 0 s before gpud answered, 10 ms requests
    ages = [age for _, age in gpud.sent]
    assert ages == [None, pytest.approx(3.31), pytest.approx(2.21), pytest.approx(1.11), None]


def test_a_latency_closed_and_reporting_again_sends_through_a_new_thread() -> None:
    clock = Clock()
    sent: list[list[float]] = []
    lat = Latency("chat", clock=clock, send=lambda j, s, a: sent.append(s), flush_every_s=0)
    lat.observe(0.01)
    assert lat.close(timeout=30)
    lat.observe(0.02)
    assert lat.close(timeout=30)
    assert sent == [[0.01], [0.02]] and lat.dropped == 0


def test_a_forked_server_worker_reports_through_a_sender_thread_of_its_own() -> None:
    """A pre-forking server (gunicorn --preload) makes its ``Latency`` before the fork:
    the parent's sender thread is not in the worker, which reports through its own."""
    read, write = os.pipe()

    def send(job: str, seconds: list[float], age_s: float | None) -> None:
        os.write(write, f"{os.getpid()} {len(seconds)}\n".encode())

    lat = Latency("chat", clock=Clock(), send=send, flush_every_s=0)
    lat.observe(0.01)
    assert lat.flush(timeout=30)  # the parent's thread runs on
    child = os.fork()
    if child == 0:  # the worker: exits at once, whatever happens
        try:
            lat.observe(0.02)
            os._exit(0 if lat.close(timeout=30) else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(child, 0)
    assert lat.close(timeout=30)
    os.close(write)
    with os.fdopen(read) as lines:
        sent = lines.read().splitlines()
    assert os.waitstatus_to_exitcode(status) == 0
    assert sent == [f"{os.getpid()} 1", f"{child} 1"]


def test_a_worker_forked_while_the_servers_latency_first_sends_reports_through_grpc(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A pre-forking server's worker forked as the parent's sender made its first call:
    had the sender been importing gRPC then, the worker's grpc would stay half-imported
    and every report of the worker's would be dropped."""
    from gpud.api import ApiServer
    from gpud.colo.api import ColoServicer
    from tests.unit.api_support import ServerThread, fork_mid_grpc_import, short_dir

    svc, _, _ = service
    snap = snapshot()
    with short_dir() as d:
        path = d / "gpud.sock"
        with ServerThread(
            ApiServer(path, servicers=[ColoServicer(svc, snapshots=lambda: snap).register])
        ):
            run = fork_mid_grpc_import(
                path,
                make='lat = gpud.client.Latency("chat", socket=sock, flush_every_s=0)'
                "; lat.observe(0.01)",
                sent="lat.flush(timeout=0.05)",
                child="lat.observe(0.02);"
                " os._exit(0 if lat.close(timeout=10) and lat.dropped == 0 else 1)",
            )
    assert run.returncode == 0, run.stderr[-3000:]


def test_a_worker_forked_while_another_thread_imports_grpc_gets_an_inert_latency() -> None:
    """A pre-forking server's worker forked while a thread of the server (not the
    Latency's) was inside grpc's import: the worker's import of grpc would wait for good on
    that module's lock; its Latency is inert and says why instead, its reports dropped."""
    from tests.unit.api_support import fork_mid_grpc_import, short_dir

    with short_dir() as d:
        run = fork_mid_grpc_import(
            d / "gpud.sock",
            make='threading.Thread(target=lambda: __import__("grpc"), daemon=True).start()',
            sent="False",
            child='lat = gpud.client.Latency("chat", socket=sock, flush_every_s=0);'
            " lat.observe(0.01); lat.close(timeout=1);"
            ' os._exit(0 if lat.last_error.startswith("gRPC was half-imported at a fork")'
            " and lat.dropped == 1 and threading.active_count() == 1 else 1)",
        )
    assert run.returncode == 0, run.stderr[-3000:]


def test_reports_a_service_made_are_sent_at_exit_without_a_close(tmp_path: Path) -> None:
    """A service that exits without close() still has its reports sent: the interpreter's
    exit closes every live Latency."""
    script = (
        "import sys\n"
        "from gpud.client.colo import Latency\n"
        "def send(job, seconds, age_s):\n"
        "    print(job, len(seconds), flush=True)\n"
        "lat = Latency('chat', send=send, flush_every_s=0)\n"
        "for _ in range(5):\n"
        "    lat.observe(0.01)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,  # a guard against a hang, not a measurement
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["chat 1"] * 5


def test_a_latency_whose_thread_cannot_start_sends_that_report_itself_and_never_raises() -> None:
    """Where no thread can start (the pids cgroup's limit; interpreter shutdown on 3.12+)
    observe() sends that report on its own thread, once, and tries a thread again at the
    next."""
    sent: list[list[float]] = []
    tries: list[str] = []

    def start(target: Callable[[], None], name: str) -> None:
        tries.append(name)
        raise RuntimeError("can't start new thread")

    lat = Latency(
        "chat", clock=Clock(), send=lambda j, s, a: sent.append(s), flush_every_s=0, start=start
    )
    lat.observe(0.01)
    lat.observe(0.02)
    assert sent == [[0.01], [0.02]] and tries == ["gpud-latency-chat"] * 2
    assert lat.close(timeout=30) and lat.dropped == 0


@pytest.mark.parametrize("background", [True, False])
def test_reports_sent_at_exit_to_a_gpud_that_never_answers_wait_one_calls_deadline_in_all(
    background: bool,
) -> None:
    """Eight services, each holding a report at exit, their sends made on the exiting
    thread (no thread starts at shutdown on 3.12+; or ``background=False``), to a gpud
    that accepts each call and answers none: the exit waits one call's deadline in all, not
    one each; the reports past it are dropped and counted."""
    clock = Clock()
    start_t = clock.t
    by_job: dict[str, Latency] = {}
    waited: list[float] = []

    def send(job: str, seconds: list[float], age_s: float | None) -> None:
        timeout = by_job[job].call_timeout()  # the call waits its whole deadline, unanswered
        waited.append(timeout)
        clock.t += timeout
        raise TimeoutError("deadline exceeded")

    def start(target: Callable[[], None], name: str) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    for i in range(8):
        by_job[f"chat{i}"] = Latency(
            f"chat{i}", clock=clock, send=send, start=start, background=background
        )
        by_job[f"chat{i}"].observe(0.01)
    _close_at_exit(by_job.values(), clock)
    assert clock.t - start_t <= CALL_TIMEOUT_S
    assert sum(waited) == pytest.approx(CALL_TIMEOUT_S)
    assert [lat.dropped for lat in by_job.values()] == [1] * 8


def fork_and_exit_code(child: Callable[[], bool]) -> int:
    """The exit code of a forked child that runs ``child`` (0: True, 1: False, 2: it
    raised; killed by SIGALRM if it hangs 30 s, a guard, not a measurement)."""
    pid = os.fork()
    if pid == 0:
        try:
            signal.alarm(30)
            os._exit(0 if child() else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_child_reports_its_own_iterations_not_its_parents() -> None:
    """A training process forks (a data loader) with 4 iterations not yet reported and
    another thread in throttle_point() (the process-wide lock held): the child reports
    only the iteration it made, and its own throttle_point() does not wait for the
    parent's lock."""
    from gpud.client import colo

    clock = Clock()
    reported: list[int] = []

    def call(job: str, iterations: int) -> tuple[float, bool, str]:
        reported.append(iterations)
        return 1.0, False, ""

    t = Throttle("train", clock=clock, call=call, report_every_s=10.0)
    for _ in range(4):
        t.point()  # the first asks at once, reporting none: all 4 wait
    assert reported == [0] and t._pending == 4

    def child() -> bool:
        clock.t += 10.0
        t.point()
        held = colo._default_lock[0].locked() or "process" in colo._default
        return reported == [0, 1] and not held

    colo._default["process"] = t
    try:
        with colo._default_lock[0]:
            code = fork_and_exit_code(child)
    finally:
        colo._default.clear()
    assert code == 0


def test_a_child_forked_while_the_parents_latency_was_locked_reports_all_the_same() -> None:
    """A fork while another thread of the parent is in observe() (its lock held) gives the
    child a lock of its own: its reports do not wait for a thread it does not have."""
    sent: list[list[float]] = []
    lat = Latency("chat", clock=Clock(), send=lambda j, s, a: sent.append(s), flush_every_s=0)
    lat._lock.acquire()
    try:

        def child() -> bool:
            lat.observe(0.02)
            return lat.close(timeout=30) and sent == [[0.02]]

        code = fork_and_exit_code(child)
    finally:
        lat._lock.release()
    assert code == 0


def sending_into_a_hung_call() -> tuple[HungGpud, Latency]:
    """A Latency sending each request alone, its first report's call taken by a gpud that
    answers once ``gpud.answer`` is set."""
    clock = Clock()
    gpud = HungGpud(clock)
    lat = Latency("chat", clock=clock, send=gpud, flush_every_s=0)
    lat.observe(0.01)
    assert gpud.calling.wait(timeout=30)  # a guard against a hang, not a measurement
    return gpud, lat


def test_a_child_forked_during_a_hung_call_flushes_and_closes_at_once() -> None:
    """The parent's sender thread, in a call gpud does not answer, with reports waiting
    behind it, is not in the child: its flush() and close() do not wait for them."""
    gpud, lat = sending_into_a_hung_call()
    lat.observe(0.02)
    try:
        code = fork_and_exit_code(
            lambda: lat.flush(timeout=5) and lat.close(timeout=5) and lat.dropped == 0
        )
    finally:
        gpud.answer.set()
    assert code == 0
    assert lat.close(timeout=30) and [s for s, _ in gpud.sent] == [[0.01], [0.02]]


def test_a_forked_child_does_not_send_what_its_parent_held() -> None:
    """The batch the parent held at the fork is the parent's to send: the child's first
    report holds its own requests alone."""
    clock = Clock()
    sent: list[list[float]] = []
    lat = Latency("chat", clock=clock, send=lambda j, s, a: sent.append(s), flush_every_s=1.0)
    lat.observe(0.01)  # held: a second has not passed

    def child() -> bool:
        lat.observe(0.02)
        return lat.close(timeout=30) and sent == [[0.02]]

    assert fork_and_exit_code(child) == 0
    assert lat.close(timeout=30) and sent == [[0.01]]


def test_an_idle_sender_thread_ends_and_its_latency_is_collected() -> None:
    """A sender thread with nothing to send for ``idle_s`` ends, holding its Latency only
    weakly: a service that makes one per model and drops them keeps no thread for each.
    The next report starts another thread."""
    threads: list[threading.Thread] = []

    def start(target: Callable[[], None], name: str) -> None:
        threads.append(threading.Thread(target=target, name=name, daemon=True))
        threads[-1].start()

    sent: list[list[float]] = []
    lat = Latency(
        "chat",
        clock=Clock(),
        send=lambda j, s, a: sent.append(s),
        flush_every_s=0,
        idle_s=0,
        start=start,
    )
    lat.observe(0.01)
    threads[0].join(timeout=30)  # a guard against a hang, not a measurement
    assert not threads[0].is_alive() and sent == [[0.01]]
    lat.observe(0.02)
    assert lat.close(timeout=30) and sent == [[0.01], [0.02]] and len(threads) == 2
    threads[1].join(timeout=30)
    collected = weakref.ref(lat)
    del lat
    gc.collect()
    assert collected() is None


def test_a_latency_that_seldom_sends_on_its_own_sends_each_flush() -> None:
    """An infinite ``flush_every_s`` (reports only when flushed): the sender thread waits
    for the next flush however long (past the longest wait Python takes), and sends it."""
    sent: list[list[float]] = []
    lat = Latency(
        "chat", clock=Clock(), send=lambda j, s, a: sent.append(s), flush_every_s=math.inf
    )
    for seconds in (0.01, 0.02):
        lat.observe(seconds)
        assert lat.flush(timeout=30)
    assert lat.close(timeout=30) and sent == [[0.01], [0.02]] and lat.dropped == 0


def test_a_latency_that_only_sends_when_flushed_says_the_age_of_a_batch_held_for_minutes() -> None:
    """An infinite ``flush_every_s``: a spike held through ten quiet minutes, flushed or
    followed by another request, goes saying its age (as with a 60 s interval), so gpud
    does not read it as what the GPU does now."""
    clock = Clock()
    sent: list[tuple[list[float], float | None]] = []
    lat = Latency(
        "chat",
        clock=clock,
        send=lambda j, s, a: sent.append((s, a)),
        flush_every_s=math.inf,
        background=False,
    )
    lat.observe(0.5)
    clock.t += 600.0
    lat.flush()
    lat.observe(0.5)
    clock.t += 600.0
    lat.observe(0.01)
    assert sent == [([0.5], 600.5), ([0.5], 600.5), ([0.01], None)], sent


def test_without_batching_a_report_sent_within_a_calls_deadline_says_no_age() -> None:
    """With ``flush_every_s=0`` a report that waits behind a call is late only past the
    call's deadline: one that waited half a second is counted from its arrival."""
    gpud, lat = sending_into_a_hung_call()
    lat.observe(0.02)
    gpud.clock.t += CALL_TIMEOUT_S / 2
    gpud.answer.set()
    assert lat.close(timeout=30)
    assert gpud.sent == [([0.01], None), ([0.02], None)]


def test_a_flush_after_a_close_that_timed_out_waits_for_the_call_still_in_gpud() -> None:
    """A close() that timed out leaves its thread's call in gpud; the next thread's calls
    done, flush() still says a call is in flight until that one ends."""
    gpud, lat = sending_into_a_hung_call()
    assert not lat.close(timeout=0)
    quick: list[list[float]] = []
    lat._send = lambda j, s, a: quick.append(s)
    lat.observe(0.02)
    assert not lat.flush(timeout=1) and quick == [[0.02]]
    gpud.answer.set()
    assert lat.close(timeout=30) and gpud.sent == [([0.01], None)]


def test_reports_left_waiting_by_a_close_that_timed_out_are_counted_as_dropped() -> None:
    """close() ends the sender thread: the reports waiting behind a call gpud does not
    answer are never sent, and ``dropped`` says so (the call in flight, answered later,
    is delivered and not counted)."""
    gpud, lat = sending_into_a_hung_call()
    lat.observe(0.02)
    lat.observe(0.03)
    lat.observe(0.04)
    assert not lat.close(timeout=0)
    assert lat.dropped == 3
    gpud.answer.set()
    assert lat.flush(timeout=30) and gpud.sent == [([0.01], None)] and lat.dropped == 3


def test_a_report_handed_over_between_a_closes_flush_and_its_end_is_sent_not_dropped() -> None:
    """close() drops only what a flush that ran out of time left waiting: a report another
    thread handed to the sender after the flush had delivered everything is sent."""
    sent: list[list[float]] = []
    senders: list[Callable[[], None]] = []

    class RacedLatency(Latency):
        def flush(self, timeout: float = 2 * CALL_TIMEOUT_S) -> bool:
            done = super().flush(timeout)
            self.observe(0.02)  # another serving thread, just after the flush returned
            return done

    lat = RacedLatency(
        "chat",
        clock=Clock(),
        send=lambda j, s, a: sent.append(s),
        flush_every_s=0,
        idle_s=0,
        start=lambda target, name: senders.append(target),
    )
    assert lat.close(timeout=0) and lat.dropped == 0
    assert len(senders) == 1
    senders[0]()  # the sender thread, run here: it sends the report, then ends
    assert sent == [[0.02]] and lat.dropped == 0


def test_a_closed_latency_that_only_sends_when_flushed_ends_its_thread_after_a_late_report() -> (
    None
):
    """An infinite ``flush_every_s`` (its thread waits idle as long as Python waits): a
    report handed over between close()'s flush and its end is sent, and the thread then
    ends rather than waiting idle, which a non-daemon thread would do holding the
    interpreter's exit."""
    sent: list[list[float]] = []
    threads: list[threading.Thread] = []

    def start(target: Callable[[], None], name: str) -> None:
        threads.append(threading.Thread(target=target, name=name, daemon=True))
        threads[-1].start()

    class RacedLatency(Latency):
        def flush(self, timeout: float = 2 * CALL_TIMEOUT_S) -> bool:
            done = super().flush(timeout)
            self.observe(0.02)  # another serving thread, just after the flush returned
            return done

    answer = threading.Event()  # gpud answers once close() returned: the report still waits

    def send(job: str, seconds: list[float], age_s: float | None) -> None:
        answer.wait(timeout=30)  # a guard against a hang, not a measurement
        sent.append(seconds)

    lat = RacedLatency(
        "chat", clock=Clock(), send=send, flush_every_s=math.inf, max_batch=1, start=start
    )
    assert lat.close(timeout=30) and len(threads) == 1
    answer.set()
    threads[0].join(timeout=30)  # a guard against a hang, not a measurement
    assert not threads[0].is_alive() and sent == [[0.02]] and lat.dropped == 0
    lat.observe(0.04)  # reports after the close go through a thread of their own
    assert lat.close(timeout=30) and len(threads) == 2 and sent[-1] == [0.04]


def test_a_clock_that_fails_on_the_sender_thread_drops_that_report_and_the_thread_goes_on() -> None:
    """A clock that raises where the sender thread reads it costs that one report, counted
    in ``dropped``: the thread is not left dead with a call counted in flight."""
    serving = threading.get_ident()
    fails = [True, False]  # the sender thread's first read raises, its second does not

    def clock() -> float:
        if threading.get_ident() != serving and fails.pop(0):
            raise OSError("clock_gettime failed")
        return 100.0

    sent: list[list[float]] = []
    lat = Latency("chat", clock=clock, send=lambda j, s, a: sent.append(s), flush_every_s=0)
    lat.observe(0.01)
    assert lat.flush(timeout=30) and lat.dropped == 1
    lat.observe(0.02)
    assert lat.close(timeout=30) and sent == [[0.02]]


def test_one_absurd_latency_does_not_cost_the_guard_the_rest_of_its_batch(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A service that measures with a clock that steps (a negative latency), divides by
    zero (NaN) or reports garbage (over an hour, inf) still has its other requests of that
    second heard: gpud refuses a report holding any sample out of range, so the client
    drops such a sample and sends the rest."""
    svc, _, _ = service
    lat = Latency("chat", clock=Clock(), send=svc.report_latency, flush_every_s=1.0)
    for s in [0.02] * 50 + [-0.001, math.nan, math.inf, 1e9, 0.095]:
        lat.observe(s)
    lat.close()
    assert svc._latencies("chat", float("-inf")) == [0.02] * 50 + [0.095]


def test_gpuctl_colo_show_and_advise_over_grpc(
    service: tuple[ColoService, Clock, list[RunningJob]], capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from gpud.api import ApiServer
    from gpud.cli.main import main
    from gpud.colo.api import ColoServicer
    from tests.unit.api_support import ServerThread, short_dir

    svc, clock, _ = service
    snap = snapshot()
    svc.report_latency("chat", [0.095] * 100)
    svc.tick(snap)
    with short_dir() as d:
        path = d / "gpud.sock"
        servicer = ColoServicer(svc, snapshots=lambda: snap)
        with ServerThread(ApiServer(path, servicers=[servicer.register])):
            assert main(["--socket", str(path), "colo", "show"], env={}) == 0
            text = capsys.readouterr().out
            assert "train" in text and "throttle" in text and "SLO guard" in text
            assert main(["--socket", str(path), "--json", "colo", "show"], env={}) == 0
            shown = json.loads(capsys.readouterr().out)
            assert {p["job"] for p in shown["placements"]} == {"chat", "train"}
            assert shown["guards"][0]["action"] == "throttle"
            # the p99 it acted on, of the reports before its cut: none since
            assert shown["guards"][0]["p99_ms"] == pytest.approx(95.0)
            assert shown["guards"][0]["p99_at_duty_ms"] is None
            assert (
                main(["--socket", str(path), "colo", "advise", "new", "--memory", "8GiB"], env={})
                == 0
            )
            assert "GPU 1" in capsys.readouterr().out
            assert main(["--socket", str(path), "colo", "advise", "x" * 200], env={}) != 0
            # What the predictor's margins are, and what the last advice refused.
            me, other = JobFeatures(sm=0.5, mem_bw=0.3), JobFeatures(sm=0.6, mem_bw=0.4)
            for _ in range(5):
                svc.predictor.observe(me, [other], 0.7)
            svc.advise("big", memory_bytes=70 * GIB, snapshot=snap)
            assert main(["--socket", str(path), "colo", "show"], env={}) == 0
            text = capsys.readouterr().out
            assert "predictor p90 margins (log-speed): pairs seen 0 times" in text
            assert "(on 5 errors)" in text  # the five observations above, of unnamed jobs
            assert (
                "options refused when advising big: 1 by memory on GPUs with 0 jobs, 4 by memory"
                in text
            ), text
            assert main(["--socket", str(path), "--json", "colo", "show"], env={}) == 0
            shown = json.loads(capsys.readouterr().out)
            assert set(shown["predictor_margins"]) <= {"0", "1+", "30+"}
            assert shown["predictor_margins"] and shown["refused_job"] == "big"
            assert shown["predictor_margin_errors"]["0"] == 5
            assert {"residents": 2, "check": "memory", "count": 4} in shown["refused"]
            # Once the cut reached the training, fast replies: the p99 the guard acts on
            # is theirs, while the window's still holds the slow ones.
            clock.t += 2.0
            svc.report_latency("chat", [0.03] * 30)
            assert main(["--socket", str(path), "colo", "show"], env={}) == 0
            text = capsys.readouterr().out
            assert "P99 JUDGED" in text and "30.0 ms     95.0 ms" in text, text


def test_advice_for_a_registered_job_takes_its_declared_memory(
    service: tuple[ColoService, Clock, list[RunningJob]], capsys: pytest.CaptureFixture[str]
) -> None:
    """``gpuctl jobs add big --memory 70GiB`` then ``gpuctl run --job big``: the advice
    weighs the 70 GiB it was registered with, unless the request says otherwise."""
    import json

    from gpud.api import ApiServer
    from gpud.cli.main import main
    from gpud.colo.api import ColoServicer, Registered
    from tests.unit.api_support import ServerThread, short_dir

    svc, _, _ = service
    snap = snapshot()
    svc.tick(snap)
    known = {"big": Registered("training", None, 70 * GIB)}
    with short_dir() as d:
        path = d / "gpud.sock"
        servicer = ColoServicer(svc, snapshots=lambda: snap, registered=known.get)
        with ServerThread(ApiServer(path, servicers=[servicer.register])):

            def advise(*argv: str) -> dict[str, object]:
                assert main(["--socket", str(path), "--json", "colo", "advise", *argv], env={}) == 0
                data: dict[str, object] = json.loads(capsys.readouterr().out)
                return data

            registered = advise("big")
            assert registered["gpu"] == -1 and "memory" in str(registered["reason"]), registered
            assert advise("big", "--memory", "8GiB")["gpu"] == 1
            assert advise("small")["gpu"] == 1


def test_advice_reads_the_registry_off_the_event_loop(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """The registry is in the state store, which a long transaction may hold: the API keeps
    answering other calls meanwhile."""
    import threading

    import grpc

    from gpud.api import ApiServer
    from gpud.colo.api import ColoServicer, Registered
    from gpud.v1 import colo_pb2, colo_pb2_grpc
    from tests.unit.api_support import ServerThread, short_dir

    svc, _, _ = service
    snap = snapshot()
    svc.tick(snap)
    reading, go = threading.Event(), threading.Event()

    def registered(job: str) -> Registered | None:
        reading.set()
        go.wait(10)  # as a store transaction held elsewhere would
        return None

    with short_dir() as d:
        path = d / "gpud.sock"
        servicer = ColoServicer(svc, snapshots=lambda: snap, registered=registered)
        with (
            ServerThread(ApiServer(path, servicers=[servicer.register])),
            grpc.insecure_channel(f"unix:{path}") as channel,
        ):
            stub = colo_pb2_grpc.ColocationStub(channel)
            asked = stub.Advise.future(colo_pb2.AdviseRequest(job="a"), timeout=20)
            try:
                assert reading.wait(10)
                stub.ShowColo(colo_pb2.ShowColoRequest(), timeout=5)
            finally:
                go.set()
            assert asked.result().gpu >= -1


def test_absurd_colo_requests_are_refused_and_change_nothing(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """What a buggy or hostile client sends over gRPC: INVALID_ARGUMENT or NOT_FOUND with
    the job and the value, and the loop's state as it was."""
    import grpc

    from gpud.api import ApiServer
    from gpud.colo.api import ColoServicer
    from gpud.v1 import colo_pb2, colo_pb2_grpc
    from tests.unit.api_support import ServerThread, short_dir

    svc, _, jobs = service
    snap = snapshot()
    svc.report_latency("chat", [0.01] * 50)
    svc.throttle_point("train", 10)
    svc.tick(snap)
    before = (svc.p99("chat"), svc.load("chat"), svc.duty("train"), svc.show().guards)
    nan, inf = float("nan"), float("inf")
    bad: list[tuple[str, object, grpc.StatusCode, str]] = [
        (
            "ReportLatency",
            colo_pb2.ReportLatencyRequest(job="chat", seconds=[0.01, nan]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "job chat: latency sample nan",
        ),
        (
            "ReportLatency",
            colo_pb2.ReportLatencyRequest(job="chat", seconds=[-0.5]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "job chat: latency sample -0.5",
        ),
        (
            "ReportLatency",
            colo_pb2.ReportLatencyRequest(job="chat", seconds=[inf]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "job chat: latency sample inf",
        ),
        (
            "ReportLatency",
            colo_pb2.ReportLatencyRequest(job="chat", seconds=[1e300]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "outside [0, 3600] seconds",
        ),
        (
            "ReportLatency",
            colo_pb2.ReportLatencyRequest(job="chat", seconds=[0.01], age_s=nan),
            grpc.StatusCode.INVALID_ARGUMENT,
            "job chat: latency report age_s nan s outside [0, 86400] seconds",
        ),
        (
            "ReportLatency",
            colo_pb2.ReportLatencyRequest(job="chat", seconds=[0.01], age_s=-2.0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "job chat: latency report age_s -2.0 s outside",
        ),
        (
            "ReportLatency",
            colo_pb2.ReportLatencyRequest(job="chat", seconds=[0.01] * 5000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "seconds: has 5000 entries, more than 4096",
        ),
        (
            "ReportLatency",
            colo_pb2.ReportLatencyRequest(job="ghost", seconds=[0.01]),
            grpc.StatusCode.NOT_FOUND,
            "job ghost holds no reservation",
        ),
        (
            "ReportLatency",
            colo_pb2.ReportLatencyRequest(job="x" * 200, seconds=[0.01]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "job: 'xxxx",
        ),
        (
            "ReportLatency",
            colo_pb2.ReportLatencyRequest(job="", seconds=[0.01]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "job: '': letters, digits",
        ),
        (
            "ThrottlePoint",
            colo_pb2.ThrottlePointRequest(job="train", iterations=2**64 - 1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "job train: 18446744073709551615 iterations",
        ),
        (
            "ThrottlePoint",
            colo_pb2.ThrottlePointRequest(job="ghost", iterations=1),
            grpc.StatusCode.NOT_FOUND,
            "job ghost holds no reservation",
        ),
        *(
            (
                "Advise",
                colo_pb2.AdviseRequest(job="n", kind="inference", slo_p99_ms=slo),
                grpc.StatusCode.INVALID_ARGUMENT,
                f"slo_p99_ms: {words} ms is outside 0.01..3600000 ms",
            )
            # a p99 of a microsecond is no service's: refused, not placed "free: exclusive";
            # the refused value is written in full (not 3.6e+06, which reads as in range)
            for slo, words in (
                (nan, "nan"),
                (inf, "inf"),
                (-inf, "-inf"),
                (-5.0, "-5"),
                (0.0, "0"),
                (1e-3, "0.001"),
                (0.0099, "0.0099"),
                (3_600_001.0, "3600001"),
                (3_600_000.5, "3600000.5"),
                (1e308, "1e+308"),
            )
        ),
        (
            "Advise",
            colo_pb2.AdviseRequest(job="n", kind="inference", peak_load=inf),
            grpc.StatusCode.INVALID_ARGUMENT,
            "peak_load: inf requests/s is outside [0, 1e+07] (job n)",
        ),
        (
            "Advise",
            colo_pb2.AdviseRequest(job="n", waiting=True, waited_s=nan),
            grpc.StatusCode.INVALID_ARGUMENT,
            "waited_s: must be a number of seconds",
        ),
        (
            "Advise",
            colo_pb2.AdviseRequest(job="n", waiting=True, waited_s=-1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "waited_s: must be a number of seconds",
        ),
        (
            "Advise",
            colo_pb2.AdviseRequest(job="n", kind="inference", peak_load=-1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "peak_load: -1.0 requests/s is outside",
        ),
        (
            "Advise",
            colo_pb2.AdviseRequest(job="n", sm_activity=nan),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sm_activity: nan is outside (0, 1] (job n)",
        ),
        (
            "Advise",
            colo_pb2.AdviseRequest(job="n", kind="x" * 1000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "kind: must be training or inference, not 'xxx",
        ),
    ]
    with short_dir() as d:
        path = d / "gpud.sock"
        servicer = ColoServicer(svc, snapshots=lambda: snap)
        with (
            ServerThread(ApiServer(path, servicers=[servicer.register])),
            grpc.insecure_channel(f"unix:{path}") as channel,
        ):
            stub = colo_pb2_grpc.ColocationStub(channel)
            for method, request, code, message in bad:
                with pytest.raises(grpc.RpcError) as err:
                    getattr(stub, method)(request, timeout=10)
                assert err.value.code() == code, (method, request)  # type: ignore[attr-defined]
                assert message in err.value.details(), err.value.details()  # type: ignore[attr-defined]
            stub.ShowColo(colo_pb2.ShowColoRequest(), timeout=10)
            after = (svc.p99("chat"), svc.load("chat"), svc.duty("train"), svc.show().guards)
            # a busy service's second of latencies, as gpud.client.Latency sends it
            full = colo_pb2.ReportLatencyRequest(job="chat", seconds=[0.02] * 4096)
            stub.ReportLatency(full, timeout=10)
            # a job that has just started, before the loop's next tick, is heard
            jobs.append(RunningJob("new", "training", 1))
            assert stub.ThrottlePoint(colo_pb2.ThrottlePointRequest(job="new"), timeout=10)
    assert after == before
    assert svc._latencies("chat", float("-inf")) == [0.02] * 4096  # the window keeps 4096
    assert "ghost" not in svc._jobs and "n" not in svc._jobs


def test_advice_takes_the_slos_jobs_add_takes_and_no_shorter_than_it_can_measure(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """One range for `gpuctl jobs add --slo-p99-ms` and for advice (`gpuctl colo advise`,
    `gpuctl run`): its floor is no shorter than the p99 of a service whose median the loop
    would still measure (M/M/1: a p99 is ln 100 / ln 2 medians)."""
    from gpud.colo.service import MIN_MEDIAN_LATENCY_S
    from gpud.errors import InvalidArgument
    from gpud.shared import MAX_SLO_MS, MIN_SLO_MS

    assert MIN_MEDIAN_LATENCY_S * math.log(100) / math.log(2) <= MIN_SLO_MS / 1e3
    svc, _, _ = service
    snap = snapshot()
    svc.tick(snap)
    for slo in (MIN_SLO_MS, 50.0, MAX_SLO_MS):
        assert svc.advise("edge", kind="inference", slo_p99_ms=slo, snapshot=snap).reason
    for slo in (1e-3, 0.0, -1.0, math.nan, math.inf, MAX_SLO_MS * 1.01):
        with pytest.raises(InvalidArgument) as info:
            svc.advise("edge", kind="inference", slo_p99_ms=slo, snapshot=snap)
        assert info.value.field == "slo_p99_ms", slo
        assert "outside 0.01..3600000 ms" in str(info.value)


def test_advice_refuses_a_bad_field_naming_it_first(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """Every refused Advise field is named as check_slo_ms names slo_p99_ms: the gRPC
    INVALID_ARGUMENT behind `gpuctl colo advise` starts with the field's name."""

    svc, _, _ = service
    snap = snapshot()
    svc.tick(snap)
    nan, inf = math.nan, math.inf
    bad: list[tuple[str, dict[str, Any]]] = [
        ("kind", {"kind": "batch"}),
        *(("sm_activity", {"sm_activity": v}) for v in (nan, inf, -0.5, 0.0, 1.5)),
        *(("peak_load", {"peak_load": v}) for v in (nan, inf, -1.0, 1e8)),
        ("slo_p99_ms", {"kind": "inference", "slo_p99_ms": nan}),
    ]
    for field, kwargs in bad:
        with pytest.raises(InvalidArgument) as info:
            svc.advise("edge", snapshot=snap, **kwargs)
        assert info.value.field == field, kwargs
        assert str(info.value).startswith(f"{field}: "), str(info.value)
    assert svc.advise("edge", sm_activity=1.0, peak_load=1e7, snapshot=snap).reason


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(slo=st.floats() | st.floats(0.0, 0.02) | st.floats(3.5e6, 3.7e6))
def test_any_slo_the_api_is_sent_is_taken_in_range_or_refused_naming_the_field(
    slo: float,
) -> None:
    """What the gRPC path behind `gpuctl colo advise` and `gpuctl run` does with any p99 SLO
    (NaN, infinities, subnormals, negatives, both edges): advice within 0.01 ms .. an
    hour, INVALID_ARGUMENT naming slo_p99_ms outside it, never a placement."""
    import asyncio

    from gpud.colo.api import ColoServicer
    from gpud.shared import MAX_SLO_MS, MIN_SLO_MS
    from gpud.v1 import colo_pb2

    snap = snapshot()
    svc = ColoService(ColocateConfig(), EventLog(None), running=list, clock=Clock())
    servicer = ColoServicer(svc, snapshots=lambda: snap)
    request = colo_pb2.AdviseRequest(job="n", kind="inference", slo_p99_ms=slo)
    if MIN_SLO_MS <= slo <= MAX_SLO_MS:
        assert asyncio.run(servicer.Advise(request, None)).reason
    else:
        with pytest.raises(InvalidArgument) as info:
            asyncio.run(servicer.Advise(request, None))
        assert info.value.field == "slo_p99_ms"
        assert str(info.value).startswith("slo_p99_ms: ")


def memory_held(svc: ColoService, jobs: list[RunningJob]) -> Snapshot:
    """Both GPUs' memory held by a job each, ticked: a newcomer that asks waits."""
    jobs[:] = [
        RunningJob("a", "training", 0, memory_bytes=75 * GIB),
        RunningJob("b", "training", 1, memory_bytes=75 * GIB),
    ]
    snap = snapshot()
    svc.tick(snap)
    return snap


def test_a_run_waiting_for_co_location_is_stopped_by_jobs_rm_force_alone(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """`gpuctl jobs rm` of a job whose `gpuctl run` waits for advice (not registered yet:
    it registers at its reservation): the loop knows the job; without --force the removal
    is refused, naming --force; with it, once the removal committed, the waiting run's next
    question is NotFound and it is no longer listed. A run of that name that starts waiting later is another run."""
    from gpud.errors import FailedPrecondition, NotFound

    svc, clock, jobs = service
    snap = memory_held(svc, jobs)

    def ask(job: str, waited_s: float) -> str:
        a = svc.advise(job, snapshot=snap, waiting=True, waited_s=waited_s)
        assert a.gpu == -1, a  # every GPU's memory is held
        return a.reason

    ask("w", 0.0)
    assert svc.waiting_kind("w") == "training" and svc.waiting_kind("other") is None
    svc.job_removed("other", False)  # nothing of it waits: nothing to refuse
    with pytest.raises(FailedPrecondition, match=r"waiting for co-location.*--force w"):
        svc.job_removed("w", False)
    clock.t += 1.0
    ask("w", 1.0)  # still waiting
    committed = svc.job_removed("w", True)
    assert [w.job for w in svc.waiting()] == ["w"]  # until the removal committed
    committed()
    assert svc.waiting() == [] and svc.waiting_kind("w") is None
    clock.t += 1.5
    with pytest.raises(NotFound, match="job w was removed"):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=2.5)
    # a run started after the removal waits as any other
    ask("w", 0.5)
    assert [w.job for w in svc.waiting()] == ["w"]


def test_a_run_waiting_for_co_location_has_an_id_that_takes_it_out(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A run told to wait is told an id, the same at every question, and listed with it;
    `gpuctl queue --leave ID` takes it out: its next question is LeftQueue (a NotFound, so
    that an older gpuctl stops as for a removed job), nothing of it is listed, and a run of
    that name started later waits as any other, with another id."""
    from gpud.errors import LeftQueue, NotFound

    svc, clock, jobs = service
    snap = memory_held(svc, jobs)

    def ask(job: str, waited_s: float, waiter_id: str | None = None) -> str:
        a = svc.advise(job, snapshot=snap, waiting=True, waited_s=waited_s, waiter_id=waiter_id)
        assert a.gpu == -1 and len(a.waiter_id) == 12, a  # every GPU's memory is held
        return a.waiter_id

    assert svc.advise("asked", snapshot=snap).waiter_id == ""  # an operator's question
    first = ask("w", 0.0)
    clock.t += 1.0
    assert ask("w", 1.0) == first and ask("other", 0.0) != first
    listed = svc.waiting()[0]
    assert (listed.job, listed.id) == ("w", first)
    assert svc.leave("0123456789ab") is None  # no run waits with it (a queue entry's)
    left = svc.leave(first)
    assert left is not None and (left.job, left.id, left.waited_s) == ("w", first, 1.0)
    assert [w.job for w in svc.waiting()] == ["other"] and svc.waiting_kind("w") is None
    with pytest.raises(FailedPrecondition, match="it left it already"):  # once
        svc.leave(first)
    (event,) = svc._events.recent(kind_prefix="colo.leave")
    assert event.fields["entry"] == first and "gpuctl queue --leave" in event.message
    clock.t += 1.5
    with pytest.raises(LeftQueue, match=f"job w left the wait for co-location \\({first}"):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=2.5, waiter_id=first)
    assert issubclass(LeftQueue, NotFound)
    assert [w.job for w in svc.waiting()] == ["other"]
    # a run started after it waits as any other
    assert ask("w", 0.5) != first


def test_two_runs_of_one_job_wait_as_two_entries(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """Two `gpuctl run`s of one job waiting at once are two waiters, as they would be two
    queue entries: each its own id (gpuctl makes one up for its first question), both
    listed, served first come first, and `gpuctl queue --leave ID` takes out that one only.
    An operator's question leaves them be."""
    from gpud.colo.service import new_waiter_id
    from gpud.errors import FailedPrecondition, LeftQueue

    svc, clock, jobs = service
    snap = memory_held(svc, jobs)

    def ask(waiter_id: str, snapshot: Snapshot = snap) -> Advice:
        return svc.advise("w", snapshot=snapshot, waiting=True, waiter_id=waiter_id)

    first, second = new_waiter_id(), new_waiter_id()
    assert ask(first).waiter_id == first
    clock.t += 1.0
    assert ask(second).waiter_id == second
    clock.t += 1.0
    assert (ask(first).waiter_id, ask(second).waiter_id) == (first, second)
    svc.advise("w", snapshot=snap)  # not a waiting run's question
    assert [(w.job, w.id, w.waited_s) for w in svc.waiting()] == [
        ("w", first, 2.0),
        ("w", second, 1.0),
    ]
    with pytest.raises(FailedPrecondition, match=f"\\({first}, {second}, for 2 s\\)"):
        svc.job_removed("w", False)
    jobs.pop(0)  # GPU 0 frees: room for one of them, the first
    freed = Snapshot(0.0, 0.0, (snapshot(used_gib=0).gpus[0], snap.gpus[1]), 0.01)
    later = ask(second, freed)
    assert later.gpu == -1
    assert later.reason == f"its options went to jobs ahead of it: w ({first})"
    left = svc.leave(first)
    assert left is not None and left.id == first
    assert [w.id for w in svc.waiting()] == [second]
    with pytest.raises(LeftQueue, match=first):
        ask(first, freed)
    assert ask(second, freed).gpu == 0  # the other run still waits, now first in line
    assert svc.waiting() == []
    # a gpuctl that predates the ids asks without one: known by its job, and told it left
    snap = memory_held(svc, jobs)
    old = svc.advise("x", snapshot=snap, waiting=True).waiter_id
    clock.t += 1.0
    assert svc.advise("x", snapshot=snap, waiting=True, waited_s=1.0).waiter_id == old
    assert svc.leave(old) is not None
    with pytest.raises(LeftQueue, match=old):
        svc.advise("x", snapshot=snap, waiting=True, waited_s=2.0)


def test_a_waiting_run_keeps_its_id_through_a_restart_and_goes_when_it_stops_asking(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A gpud that restarted knows no waiter: the run that says the id it was told keeps
    it (unless another run holds it, or it is not an id). A run that stops asking (its
    gpuctl killed) is dropped at the next tick though nobody lists the waiters, and an
    event says so, as for a queued entry whose holder is gone."""
    svc, clock, jobs = service
    snap = memory_held(svc, jobs)
    told = "00aa11bb22cc"

    def ask(job: str, waiter_id: str | None) -> str:
        a = svc.advise(job, snapshot=snap, waiting=True, waited_s=30.0, waiter_id=waiter_id)
        assert a.gpu == -1, a
        return a.waiter_id

    assert ask("w", told) == told
    assert ask("x", told) not in (told, "")  # held by w
    assert ask("y", "not an id") not in ("not an id", "")
    clock.t += 3.0
    ask("w", told)
    clock.t += 9.0  # x and y stopped asking 12 s ago, w 9 s ago
    svc.tick(snap)
    assert [w.job for w in svc._waiting.values()] == ["w"]
    gone = svc._events.recent(kind_prefix="colo.leave")
    assert sorted(e.fields["job"] for e in gone) == ["x", "y"]
    assert all("its gpuctl run stopped asking 12 s ago" in e.message for e in gone)


def test_a_run_stopped_past_its_drop_is_told_of_its_leave_when_it_asks_again(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A waiting run stopped (Ctrl-Z) and taken out meanwhile (`gpuctl queue --leave`),
    then dropped for its silence: continued a minute later, its next question is
    LeftQueue. gpud had forgotten the leave after 10 s and let it wait again, to start
    what the operator took out."""
    from gpud.errors import LeftQueue

    svc, clock, jobs = service
    snap = memory_held(svc, jobs)
    wid = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    clock.t += 3.0
    assert svc.leave(wid) is not None
    clock.t += 60.0
    svc.tick(snap)
    with pytest.raises(LeftQueue, match=wid):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=63.0, waiter_id=wid)
    assert svc.waiting() == []


def test_a_run_stopped_past_its_drop_is_told_its_job_was_removed_when_it_asks_again(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A waiting run stopped (Ctrl-Z) and dropped for its silence, its job removed
    (`gpuctl jobs rm --force`) before or after the drop: continued, its next question
    is NotFound, nothing started. gpud had forgotten the removal after 10 s (or never
    told a run it no longer listed) and let it wait again, to register the job anew."""
    from gpud.errors import NotFound

    svc, clock, jobs = service
    snap = memory_held(svc, jobs)
    before = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    after = svc.advise("x", snapshot=snap, waiting=True).waiter_id
    clock.t += 3.0
    svc.job_removed("w", True)()  # while it is listed still
    clock.t += 30.0
    svc.tick(snap)  # both dropped: silent 33 s
    assert svc.waiting() == []
    svc.job_removed("x", True)()  # after its drop
    clock.t += 30.0
    for job, wid in (("w", before), ("x", after)):
        with pytest.raises(NotFound, match=f"job {job} was removed"):
            svc.advise(job, snapshot=snap, waiting=True, waited_s=63.0, waiter_id=wid)
    assert svc.waiting() == []


def test_a_run_stopped_past_its_drop_waits_again_behind_the_runs_that_came_meanwhile(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A waiting run stopped (Ctrl-Z) past its drop, continued: it waits again under its
    id, from then on, behind a run that began waiting while gpud listed it no more. It
    took back its first place by the time it counted (the stop included), ahead of the
    run gpud had served first meanwhile."""
    svc, clock, jobs = service
    snap = memory_held(svc, jobs)
    stopped = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    clock.t += 20.0
    svc.tick(snap)  # dropped: silent 20 s
    meanwhile = svc.advise("x", snapshot=snap, waiting=True).waiter_id
    for _ in range(8):  # it asks every 5 s
        clock.t += 5.0
        assert svc.advise("x", snapshot=snap, waiting=True, waiter_id=meanwhile).gpu == -1
    again = svc.advise("w", snapshot=snap, waiting=True, waited_s=60.0, waiter_id=stopped)
    assert again.gpu == -1 and again.waiter_id == stopped
    assert [(w.id, w.waited_s) for w in svc.waiting()] == [(meanwhile, 40.0), (stopped, 0.0)]


def test_a_run_that_asks_late_because_gpud_answered_slowly_keeps_its_place(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A waiting run whose next question starts 10.5 s after its last (gpud slow to
    answer the one before): it keeps its place ahead of a run that came after it, and no
    `colo.leave` says it stopped asking. Its own question dropped it, said it had left and
    listed it again from then, behind the other."""
    svc, clock, jobs = service
    snap = memory_held(svc, jobs)
    first = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    clock.t += 5.0
    second = svc.advise("x", snapshot=snap, waiting=True).waiter_id
    clock.t += 5.5
    again = svc.advise("w", snapshot=snap, waiting=True, waited_s=10.5, waiter_id=first)
    assert again.gpu == -1 and again.waiter_id == first
    assert [(w.id, w.waited_s) for w in svc.waiting()] == [(first, 10.5), (second, 5.5)]
    assert svc._events.recent(kind_prefix="colo.leave") == []


def test_a_run_dropped_while_its_question_was_planned_keeps_its_place_at_its_next(
    tmp_path: Path,
) -> None:
    """A listing that drops a waiting run while that run's question is planned (its
    last question 11 s before): the question lists it again, and its next question finds
    it listed, in its place ahead of a run that came after it. The next question found
    the drop still remembered and sent it behind that run."""
    clock = Clock()
    jobs: list[RunningJob] = []
    during: list[Callable[[], object]] = []

    def running() -> list[RunningJob]:
        while during:
            during.pop()()
        return jobs

    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "events.jsonl"), running=running, clock=clock
    )
    snap = memory_held(svc, jobs)
    first = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    clock.t += 5.0
    second = svc.advise("x", snapshot=snap, waiting=True).waiter_id
    clock.t += 4.0

    def listed_later() -> None:
        clock.t += 2.0
        svc.waiting()  # `first` silent 11 s: dropped

    during.append(listed_later)
    svc.advise("w", snapshot=snap, waiting=True, waited_s=9.0, waiter_id=first)
    assert not during
    clock.t += 2.0
    svc.advise("x", snapshot=snap, waiting=True, waiter_id=second)
    svc.advise("w", snapshot=snap, waiting=True, waited_s=13.0, waiter_id=first)
    assert [w.id for w in svc.waiting()] == [first, second]


def test_the_runs_remembered_dropped_or_taken_out_are_capped_the_oldest_forgotten_first(
    tmp_path: Path,
) -> None:
    """With room for three, five waiting runs taken out (`gpuctl queue --leave`) and
    five dropped for their silence: the last three taken out are told so when they ask
    again, the first two wait again; the last three dropped can still be taken out, the
    first two are not known. Every one was kept for a day, however many."""
    from gpud.errors import LeftQueue

    clock = Clock()
    jobs: list[RunningJob] = []
    svc = ColoService(
        ColocateConfig(),
        EventLog(tmp_path / "events.jsonl"),
        running=lambda: jobs,
        clock=clock,
        remember=3,
    )
    snap = memory_held(svc, jobs)
    left = [svc.advise(f"l{i}", snapshot=snap, waiting=True).waiter_id for i in range(5)]
    for wid in left:
        clock.t += 1.0
        assert svc.leave(wid) is not None
    dropped = [svc.advise(f"d{i}", snapshot=snap, waiting=True).waiter_id for i in range(5)]
    clock.t += 11.0
    assert svc.waiting() == []  # dropped, in the order they came
    for i, wid in enumerate(left):
        if i < 2:
            assert svc.advise(f"l{i}", snapshot=snap, waiting=True, waiter_id=wid).gpu == -1
        else:
            with pytest.raises(LeftQueue, match=wid):
                svc.advise(f"l{i}", snapshot=snap, waiting=True, waiter_id=wid)
    assert [svc.leave(wid) is not None for wid in dropped] == [False, False, True, True, True]


def test_an_id_of_another_jobs_run_taken_out_does_not_hide_its_leave(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A run of another job that asks with the id of a run taken out (read off `gpuctl
    queue`) is given an id of its own; the run taken out is told so when it asks again.
    The other took that id and the run taken out waited again under a new one."""
    from gpud.errors import LeftQueue

    svc, clock, jobs = service
    snap = memory_held(svc, jobs)
    wid = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    clock.t += 20.0
    svc.tick(snap)  # dropped: silent 20 s
    forged = svc.advise("x", snapshot=snap, waiting=True, waiter_id=wid)
    assert forged.waiter_id != wid
    assert svc.leave(wid) is not None
    again = svc.advise("x", snapshot=snap, waiting=True, waiter_id=wid)
    assert again.waiter_id not in (wid, forged.waiter_id)
    with pytest.raises(LeftQueue, match=wid):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=20.0, waiter_id=wid)


def test_a_run_dropped_while_stopped_is_taken_out_by_queue_leave_and_told_so(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """`gpuctl queue --leave ID` of a run stopped (Ctrl-Z) and dropped for its silence:
    it is taken out (`colo.leave`), and when continued its next question is LeftQueue,
    nothing started. The leave answered that no run waited with that id, and the run
    waited again once continued."""
    from gpud.errors import LeftQueue

    svc, clock, jobs = service
    snap = memory_held(svc, jobs)
    wid = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    clock.t += 20.0
    svc.tick(snap)  # dropped: silent 20 s
    out = svc.leave(wid)
    assert out is not None and out.job == "w" and out.id == wid
    (said,) = [e for e in svc._events.recent(kind_prefix="colo.leave") if "--leave" in e.message]
    assert said.fields["entry"] == wid
    clock.t += 60.0
    with pytest.raises(LeftQueue, match=wid):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=80.0, waiter_id=wid)
    assert svc.waiting() == []


def test_a_second_leave_of_a_run_out_of_the_wait_says_it_left_already_and_who_took_it_out(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A second `gpuctl queue --leave ID` of a run taken out of the wait for co-location
    was answered NotFound, as for an id never given; it is refused saying the run left
    already, when, and whether an operator or the run's own stop took it out. The run
    stopping is answered as it is, as a queue entry's is."""
    svc, clock, jobs = service
    snap = memory_held(svc, jobs)
    wid = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    assert svc.leave(wid) is not None
    clock.t += 5.0
    with pytest.raises(FailedPrecondition) as again:
        svc.leave(wid)
    assert str(again.value) == (
        f"job w ({wid}) did not leave the wait for co-location: it left it already, 5 s ago:"
        " gpuctl queue --leave took it out"
    )
    stopping = svc.leave(wid, stopped_by="SIGINT")
    assert stopping is not None and stopping.job == "w" and "5 s ago" in stopping.reason
    other = svc.advise("v", snapshot=snap, waiting=True).waiter_id
    assert svc.leave(other, stopped_by="SIGTERM") is not None
    with pytest.raises(FailedPrecondition, match=r"0 s ago: its gpuctl run was stopped$"):
        svc.leave(other)
    assert svc.leave("0123456789ab") is None  # never given: NotFound, as before


def test_a_leave_long_after_a_run_left_the_wait_knows_it_no_more(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A run that left the wait for co-location as it stopped is kept a minute (for a
    question on its way), a run an operator took out a day: a second leave an hour later
    said "it left it already, 3600 s ago: its gpuctl run was stopped" (only an advice or a
    new leave dropped what was past its time, and a leave read first). It is unknown now,
    as an id never given is; one an operator took out is still said to have left."""
    svc, clock, jobs = service
    snap = memory_held(svc, jobs)
    stopped = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    taken = svc.advise("v", snapshot=snap, waiting=True).waiter_id
    assert svc.leave(stopped, stopped_by="SIGTERM") is not None
    assert svc.leave(taken) is not None
    clock.t += 3600.0
    assert svc.leave(stopped) is None
    with pytest.raises(FailedPrecondition, match=r"3600 s ago: gpuctl queue --leave took it out$"):
        svc.leave(taken)


def test_a_run_dropped_while_stopped_is_told_its_job_was_removed_by_a_plain_rm_as_it_was(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """`gpuctl jobs rm JOB` (no --force) of a job whose only run waiting was stopped and
    dropped for its silence: allowed (no run waits), and the run, continued, is told the
    job was removed by `gpuctl jobs rm`. It was told of a `--force` no one gave."""
    svc, clock, jobs = service
    snap = memory_held(svc, jobs)
    wid = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    clock.t += 20.0
    svc.tick(snap)
    svc.job_removed("w", False)()
    with pytest.raises(NotFound, match=r"removed \(gpuctl jobs rm\) while"):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=20.0, waiter_id=wid)


class Restarts:
    """A gpud's co-location loop started again over one colo.json, on the loop's clock and
    Unix time the test moves, on a boot the test names."""

    def __init__(self, tmp_path: Path, remember: int = 10_000) -> None:
        self.tmp_path = tmp_path
        self.clock, self.wall = Clock(), Clock()
        self.wall.t = 1_700_000_000.0
        self.boot: str | None = "0b0b0b0b-0000-4000-8000-000000000001"
        self.jobs: list[RunningJob] = []
        self.remember = remember
        self.write: Callable[[Path, str], None] | None = None
        self.leave_write_s = 2.0

    @property
    def file(self) -> Path:
        return self.tmp_path / "colo.json"

    def start(self) -> tuple[ColoService, Snapshot]:
        svc = ColoService(
            ColocateConfig(),
            EventLog(self.tmp_path / "events.jsonl"),
            running=lambda: self.jobs,
            clock=self.clock,
            wall=self.wall,
            state_file=self.file,
            remember=self.remember,
            boot_id=lambda: self.boot,
            write=self.write,
            leave_write_s=self.leave_write_s,
        )
        return svc, memory_held(svc, self.jobs)


def test_a_run_taken_out_or_removed_while_stopped_is_told_so_after_a_gpud_restart(
    tmp_path: Path,
) -> None:
    """A waiting run taken out (`gpuctl queue --leave`) and another whose job was removed
    (`gpuctl jobs rm --force`), both stopped (Ctrl-Z) meanwhile: gpud restarts, and when
    they ask again, continued, the first is LeftQueue and the second NotFound, nothing
    started. gpud forgot both with the restart, and each waited again at the head."""
    from gpud.errors import LeftQueue

    host = Restarts(tmp_path)
    svc, snap = host.start()
    left = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    removed = svc.advise("x", snapshot=snap, waiting=True).waiter_id
    host.clock.t += 3.0  # each began to wait 3 s before it was taken out
    assert svc.leave(left) is not None
    svc.job_removed("x", True)()
    svc.tick(snap)
    host.clock.t += 60.0
    host.wall.t += 60.0
    svc, snap = host.start()
    with pytest.raises(LeftQueue, match=left):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=63.0, waiter_id=left)
    with pytest.raises(NotFound, match=r"job x was removed \(gpuctl jobs rm --force\)"):
        svc.advise("x", snapshot=snap, waiting=True, waited_s=63.0, waiter_id=removed)
    assert svc.waiting() == []
    # a run that begins to wait after the restart is another run
    assert svc.advise("x", snapshot=snap, waiting=True).gpu == -1


@pytest.mark.parametrize("step_s", [-3600.0, 2 * 86400.0])
def test_a_removal_outlives_a_restart_as_old_as_it_is_whatever_the_wall_clock_did(
    tmp_path: Path, step_s: float
) -> None:
    """The wall clock stepped back an hour, or on two days (NTP, a suspend), between a
    removal under a waiting run and a gpud restart on the same boot: the run that waited
    before the removal is still told of it, a run that began to wait after it is not, and
    colo.json holds the removal as it came. A step back made the saved removal look as if
    it had just come (renewed at each restart), and a later run was refused as removed; a
    step on past a day forgot it."""
    host = Restarts(tmp_path)
    svc, snap = host.start()
    before = svc.advise("x", snapshot=snap, waiting=True).waiter_id
    host.clock.t += 20.0
    svc.tick(snap)  # dropped: stopped (Ctrl-Z)
    svc.job_removed("x", True)()
    removed_at = host.clock.t
    host.clock.t += 30.0
    host.wall.t += 30.0 + step_s
    svc, snap = host.start()
    later = svc.advise("x", snapshot=snap, waiting=True, waited_s=10.0)
    assert later.gpu == -1 and later.waiter_id != before  # it waits: another run
    with pytest.raises(NotFound, match="job x was removed"):
        svc.advise("x", snapshot=snap, waiting=True, waited_s=50.0, waiter_id=before)
    svc.tick(snap)
    (saved,) = json.loads(host.file.read_text())["removed"].values()
    assert saved[2] == removed_at


def test_leaves_and_removals_colo_json_holds_are_read_back_as_written_on_the_same_boot(
    tmp_path: Path,
) -> None:
    """A leave and a removal under a waiting run, written to colo.json, then gpud restarted
    on the same boot with the wall clock stepped back an hour: each is read back as it was
    written (its job, Unix time, how it came and the loop's clock), and the next write
    holds them unchanged."""
    host = Restarts(tmp_path)
    svc, snap = host.start()
    left = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    svc.advise("x", snapshot=snap, waiting=True)
    host.clock.t += 3.0
    assert svc.leave(left) is not None
    svc.job_removed("x", True)()
    svc.tick(snap)
    written = json.loads(host.file.read_text())
    assert written["boot_id"] == host.boot
    assert written["left"] == {left: ["w", host.wall.t, True, host.clock.t]}  # asked without an ID
    assert written["removed"] == {"x": [host.wall.t, True, host.clock.t]}
    host.clock.t += 10.0
    host.wall.t -= 3600.0
    svc, snap = host.start()
    svc.tick(snap)
    again = json.loads(host.file.read_text())
    assert (again["left"], again["removed"]) == (written["left"], written["removed"])


def test_an_operators_leave_answers_once_colo_json_holds_it_while_the_tick_was_writing(
    tmp_path: Path,
) -> None:
    """`gpuctl queue --leave ID` while the loop's tick is mid-write of colo.json: the
    leave answers once the file holds it (the tick's writer writes it straight after its
    own), so a kill -9 of gpud after the answer does not lose it. It answered at once,
    the leave left to the tick's writer, not yet on disk."""
    import threading

    host = Restarts(tmp_path)
    host.leave_write_s = 600.0  # what is tested is the order, not how long
    svc, snap = host.start()
    wid = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    held, release = threading.Event(), threading.Event()

    def slow_write(path: Path, text: str) -> None:
        if not release.is_set():
            held.set()
            release.wait()
        write_atomically(path, text)

    svc._write = slow_write
    host.jobs.append(RunningJob("c", "training", 0, memory_bytes=GIB))
    ticker = threading.Thread(target=svc.tick, args=(snap,))
    ticker.start()
    assert held.wait(60.0)
    on_disk: list[dict[str, Any]] = []

    def leave() -> None:
        assert svc.leave(wid) is not None
        on_disk.append(json.loads(host.file.read_text()))

    leaver = threading.Thread(target=leave)
    leaver.start()
    leaver.join(1.0)  # the old leave answered meanwhile; this one waits for the write
    release.set()
    leaver.join()
    ticker.join()
    (saved,) = on_disk
    assert wid in saved.get("left", {})


def test_an_operators_leave_colo_json_cannot_hold_is_done_and_said_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`gpuctl queue --leave ID` with colo.json not writable (a full disk): the run is
    taken out all the same, and the log says, naming the file and the run, that a gpud
    restart before the next write forgets it."""
    from gpud.errors import LeftQueue

    host = Restarts(tmp_path)
    svc, snap = host.start()
    wid = svc.advise("w", snapshot=snap, waiting=True).waiter_id

    def full(path: Path, text: str) -> None:
        raise OSError(28, "No space left on device")

    svc._write = full
    assert svc.leave(wid) is not None
    with pytest.raises(LeftQueue, match=wid):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=3.0, waiter_id=wid)
    said = [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "WARNING" and f"the leave of {wid}" in r.getMessage()
    ]
    assert len(said) == 1
    assert str(host.file) in said[0] and "No space left on device" in said[0]


def test_a_boot_id_that_cannot_be_read_is_none_and_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """/proc/sys/kernel/random/boot_id not readable: no boot id, and the log says where
    and why, and that leaves and removals are read by Unix time. It said nothing."""
    missing = tmp_path / "boot_id"
    assert read_boot_id(missing) is None
    (said,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert str(missing) in said and "read by Unix time" in said


def test_a_gpud_that_cannot_read_its_boots_id_keeps_leaves_across_a_restart_by_unix_time(
    tmp_path: Path,
) -> None:
    """The boot's id not known: colo.json names no boot and no loop clock, and after a
    restart a leave and a removal are read by their Unix times."""
    from gpud.errors import LeftQueue

    host = Restarts(tmp_path)
    host.boot = None
    svc, snap = host.start()
    left = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    removed = svc.advise("x", snapshot=snap, waiting=True).waiter_id
    host.clock.t += 3.0
    assert svc.leave(left) is not None
    svc.job_removed("x", True)()
    svc.tick(snap)
    data = json.loads(host.file.read_text())
    assert not {"boot_id", "left_clock", "removed_clock"} & data.keys()
    host.clock.t = 5.0  # the loop's clock of another process means nothing here
    host.wall.t += 60.0
    svc, snap = host.start()
    with pytest.raises(LeftQueue, match=left):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=63.0, waiter_id=left)
    with pytest.raises(NotFound, match="job x was removed"):
        svc.advise("x", snapshot=snap, waiting=True, waited_s=63.0, waiter_id=removed)


def test_a_boot_id_in_colo_json_that_is_not_a_string_is_named_and_read_by_unix_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """colo.json's boot_id not a string (a hand edit): the log names the file and the
    field, and its leaves are read by their Unix times."""
    from gpud.errors import LeftQueue

    host = Restarts(tmp_path)
    host.file.write_text(
        json.dumps(
            {
                "version": STATE_FILE_VERSION,
                "jobs": {},
                "boot_id": 7,
                "left": {"0123456789ab": ["w", host.wall.t - 60.0, False, 1.0]},
            }
        )
    )
    svc, snap = host.start()
    with pytest.raises(LeftQueue, match="0123456789ab"):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=90.0, waiter_id="0123456789ab")
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(str(host.file) in m and "boot_id" in m for m in said)


def test_the_leaves_and_removals_of_another_boot_are_forgotten(tmp_path: Path) -> None:
    """colo.json written on another boot: no gpuctl run waiting then asks now, and a
    run with an id of then waits as any run does."""
    host = Restarts(tmp_path)
    svc, snap = host.start()
    left = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    assert svc.leave(left) is not None
    svc.tick(snap)
    assert left in json.loads(host.file.read_text())["left"]
    host.boot = "0b0b0b0b-0000-4000-8000-000000000002"
    svc, snap = host.start()
    assert svc.advise("w", snapshot=snap, waiting=True, waiter_id=left).waiter_id == left


def test_leaves_and_removals_saved_by_unix_time_alone_are_read_none_from_the_future(
    tmp_path: Path,
) -> None:
    """A colo.json whose leaves and removals name no boot (the layout before it did) is
    still read by their Unix times: one as old as a minute holds; one later than now (the
    wall clock stepped back since) is dropped, not taken as just come."""
    from gpud.errors import LeftQueue

    host = Restarts(tmp_path)
    then, ahead = host.wall.t - 60.0, host.wall.t + 3600.0
    host.file.write_text(
        json.dumps(
            {
                "version": STATE_FILE_VERSION,
                "jobs": {},
                "left": {
                    "0123456789ab": ["w", then, False, None],
                    "0123456789cd": ["v", ahead, False, None],
                },
                "removed": {"x": [then, True, None], "y": [ahead, True, None]},
            }
        )
    )
    svc, snap = host.start()
    with pytest.raises(LeftQueue, match="0123456789ab"):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=90.0, waiter_id="0123456789ab")
    with pytest.raises(NotFound, match="job x was removed"):
        svc.advise("x", snapshot=snap, waiting=True, waited_s=90.0)
    # a minute's wait began after what the wall clock dates an hour from now
    assert svc.advise("v", snapshot=snap, waiting=True, waiter_id="0123456789cd").gpu == -1
    assert svc.advise("y", snapshot=snap, waiting=True, waited_s=60.0).gpu == -1


def test_a_leave_or_removal_dated_after_now_is_said_in_the_log_as_not_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A leave dated an hour from now by Unix time and a removal ahead of the loop's clock
    on this boot: each is logged, naming its key, as not kept. Both were dropped without
    a word, though an entry not read is said to be logged."""
    host = Restarts(tmp_path)
    host.clock.t = 100.0
    host.file.write_text(
        json.dumps(
            {
                "version": STATE_FILE_VERSION,
                "boot_id": host.boot,
                "jobs": {},
                "left": {"0123456789cd": ["v", host.wall.t + 3600.0, False, None]},
                "removed": {"y": [host.wall.t, True, 500.0]},
            }
        )
    )
    with caplog.at_level(logging.INFO, logger="gpud.colo.service"):
        host.start()
    said = [r.getMessage() for r in caplog.records if "not kept" in r.getMessage()]
    assert len(said) == 2
    assert any("left.0123456789cd" in m and "dated after now" in m for m in said)
    assert any("removed.y" in m and "dated after now" in m for m in said)


def test_a_leave_of_the_wrong_shape_is_said_to_want_either_shape_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A leave or removal of neither shape: the error names both the one an older gpud
    wrote and this one's, the clock optional. It named the new shape alone."""
    host = Restarts(tmp_path)
    host.file.write_text(
        json.dumps(
            {
                "version": STATE_FILE_VERSION,
                "jobs": {},
                "left": {"0123456789cd": ["v"]},
                "removed": {"y": [1.0]},
            }
        )
    )
    host.start()
    said = " ".join(r.getMessage() for r in caplog.records if r.levelname == "ERROR")
    assert "[job, Unix time, anonymous(, clock)] expected" in said
    assert "[Unix time, forced(, clock)] expected" in said


def test_leaves_and_removals_an_older_gpud_wrote_without_the_loops_clock_hold_after_an_upgrade(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """colo.json as a gpud from before the loop's clock was kept wrote it (no boot_id, a
    leave as [job, Unix time, anonymous], a removal as [Unix time, forced]), then this gpud
    started on it: the run taken out of the wait is still told it left, the run of the
    removed job that it was removed, and nothing is logged as not read."""
    from gpud.errors import LeftQueue

    host = Restarts(tmp_path)
    then = host.wall.t - 60.0
    host.file.write_text(
        json.dumps(
            {
                "version": STATE_FILE_VERSION,
                "jobs": {},
                "left": {"0123456789ab": ["w", then, False]},
                "removed": {"x": [then, True]},
            }
        )
    )
    svc, snap = host.start()
    with pytest.raises(LeftQueue, match="0123456789ab"):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=90.0, waiter_id="0123456789ab")
    with pytest.raises(NotFound, match="job x was removed"):
        svc.advise("x", snapshot=snap, waiting=True, waited_s=90.0)
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


def test_a_run_taken_out_is_told_so_after_a_restart_before_the_next_tick(
    tmp_path: Path,
) -> None:
    """`gpuctl queue --leave ID` of a stopped run, then gpud restarted before its loop's
    next tick (up to an hour): continued, the run is LeftQueue. The leave was written at
    the next tick alone, and the run waited again and could start."""
    from gpud.errors import LeftQueue

    host = Restarts(tmp_path)
    svc, snap = host.start()
    wid = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    host.clock.t += 3.0
    assert svc.leave(wid) is not None
    host.clock.t += 10.0
    svc, snap = host.start()
    with pytest.raises(LeftQueue, match=wid):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=13.0, waiter_id=wid)


def test_a_bad_leave_or_removal_in_colo_json_is_skipped_and_the_rest_is_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A leave or a removal colo.json holds that is not read (a hand edit, a bug) is
    logged, naming the file and its key, and skipped, the file as read copied to
    colo.json.skipped: the other leaves, the jobs' duties and the predictor are kept. The
    whole file was set aside and all it held forgotten."""
    from gpud.errors import LeftQueue

    host = Restarts(tmp_path)
    then = host.wall.t - 60.0
    host.file.write_text(
        json.dumps(
            {
                "version": STATE_FILE_VERSION,
                "jobs": {"train": {"duty": 0.5, "alone_rate": 10.0}},
                "left": {
                    "0123456789ab": ["w", then, False, None],
                    "0123456789cd": ["v", "then", False, None],
                },
                "removed": {"x": [1.0]},
            }
        )
    )
    svc, snap = host.start()
    assert svc._jobs["train"].alone_rate == 10.0
    assert not (tmp_path / "colo.json.unreadable").exists()
    with pytest.raises(LeftQueue, match="0123456789ab"):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=90.0, waiter_id="0123456789ab")
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(said) == 2
    assert all(str(host.file) in m for m in said)
    assert any("left.0123456789cd" in m for m in said)
    assert any("removed.x" in m for m in said)
    copy = tmp_path / "colo.json.skipped"
    assert all(f"copied to {copy}" in m for m in said) and copy.exists()


def write_with_huge_ints(path: Path, state: dict[str, Any]) -> None:
    """``state`` written as JSON, each "HUGE" in it an int of 400 digits: JSON holds one, a
    float cannot."""
    path.write_text(json.dumps(state).replace('"HUGE"', "1" + "0" * 400))


def test_a_leave_dated_by_an_int_too_large_for_a_float_is_skipped_and_gpud_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A leave in colo.json whose Unix time is an int of 400 digits (a hand edit: JSON
    holds it, a float cannot): that leave is logged as out of range, naming its key, and
    skipped; the other leave and the jobs are read and the loop is made. gpud did not
    start: the OverflowError went past what reads the file."""
    from gpud.errors import LeftQueue

    host = Restarts(tmp_path)
    then = host.wall.t - 60.0
    left = {"0123456789ab": ["w", then, False, None], "0123456789cd": ["v", "HUGE", False]}
    write_with_huge_ints(
        host.file,
        {"version": STATE_FILE_VERSION, "jobs": {"train": {"alone_rate": 10.0}}, "left": left},
    )
    svc, snap = host.start()
    assert svc._jobs["train"].alone_rate == 10.0
    with pytest.raises(LeftQueue, match="0123456789ab"):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=90.0, waiter_id="0123456789ab")
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(said) == 1
    assert "left.0123456789cd" in said[0] and "out of range" in said[0]


def test_a_job_idle_for_an_int_too_large_for_a_float_is_skipped_not_gpud(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A job in colo.json whose idle_s is an int of 400 digits: that job is not read, the
    error naming the file and jobs.NAME.idle_s, and the loop is made with the other job
    read. gpud did not start: the OverflowError went past what reads the file."""
    host = Restarts(tmp_path)
    train = {"alone_rate": 10.0, "idle_s": "HUGE"}
    jobs = {"train": train, "other": {"alone_rate": 4.0, "idle_s": 30.0}}
    write_with_huge_ints(host.file, {"version": STATE_FILE_VERSION, "jobs": jobs})
    svc, _ = host.start()
    assert "train" not in svc._jobs and svc._jobs["other"].alone_rate == 4.0
    (said,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert str(host.file) in said and "jobs.train.idle_s" in said and "out of range" in said
    assert not (tmp_path / "colo.json.unreadable").exists()


def test_one_bad_job_in_colo_json_costs_that_job_alone_not_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Four jobs in colo.json, one with a value out of its range after values of its that
    read well (a duty, then a negative breach count of its guard): that job is logged,
    naming the file and jobs.NAME.FIELD, and read as one gpud has not seen (full duty, no
    guard, not evicted though the file's evicted list names it); the other three keep
    their duty, eviction, rate and guard, the predictor is kept, and no file is set
    aside. The next save writes the file without the bad job. The whole file was set
    aside and every job's state forgotten."""
    state = tmp_path / "colo.json"
    predictor = InterferencePredictor()
    predictor.observe(JobFeatures(0.5, 0.3), [JobFeatures(0.4, 0.2)], 0.8)
    jobs = {
        "train": {"kind": "training", "duty": 0.5, "alone_rate": 10.0},
        "big": {"kind": "training", "evict": "memory over its limit", "alone_rate": 5.0},
        "bad": {
            "kind": "inference",
            "alone_rate": 3.0,
            "duty": 0.25,
            "guard_duty": 0.5,
            "slo_s": 0.05,
            "guard_breaches": -1,
            "guard_paused": True,
        },
        "chat": {"kind": "inference", "guard_duty": 0.5, "slo_s": 0.05, "idle_s": 10.0},
    }
    state.write_text(
        json.dumps(
            {
                "version": STATE_FILE_VERSION,
                "jobs": jobs,
                "evicted": ["big", "bad"],
                "predictor": predictor.to_dict(),
            }
        )
    )
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=list, state_file=state
    )
    assert svc.duty("train") == 0.5 and svc._jobs["train"].alone_rate == 10.0
    assert svc._directives["big"].evict and svc._jobs["big"].evicted
    assert svc._guards["chat"].duty == 0.5
    assert "bad" not in svc._jobs and svc.duty("bad") == 1.0
    assert "bad" not in svc._guards and "bad" not in svc._paused_services
    assert svc.predictor.stats().samples == 1
    (said,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert str(state) in said and "jobs.bad.guard_breaches" in said
    assert not (tmp_path / "colo.json.unreadable").exists()
    svc.tick(snapshot())
    written = json.loads(state.read_text())
    assert sorted(written["jobs"]) == ["big", "chat", "train"]
    assert written["evicted"] == ["big"]


def loaded(state: Path, text: str) -> ColoService:
    """A loop made over colo.json holding ``text``, who runs read from no one."""
    state.write_text(text)
    return ColoService(
        ColocateConfig(), EventLog(state.with_name("e.jsonl")), running=list, state_file=state
    )


def test_an_alone_config_that_names_no_mps_share_skips_its_job_not_gpud(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A job's alone_config in colo.json that is no MPS share nor MIG instance (400 ones
    and a percent sign, a superscript two, 0 %, 150 %, a word): that job alone is not read,
    the error naming jobs.NAME.alone_config, and the loop is made with the other job. gpud
    did not start on the 400 ones (the share's division overflowed past what reads the
    file), and "²%" was refused naming no field."""
    state = tmp_path / "colo.json"
    for config in ("1" * 400 + "%", "²%", "0%", "150%", "50%, fast", "fast", ""):
        caplog.clear()
        jobs = {"other": {"duty": 0.5}, "train": {"alone_rate": 10.0, "alone_config": config}}
        svc = loaded(state, json.dumps({"version": STATE_FILE_VERSION, "jobs": jobs}))
        assert "train" not in svc._jobs and svc.duty("other") == 0.5, config
        (said,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert str(state) in said and "jobs.train.alone_config:" in said, config
        assert len(said) < 600, config
    for config in ("30%", "30%, 100%", "MIG 3g.40gb", "MIG 1g.10gb, 50%"):
        jobs = {"train": {"alone_rate": 10.0, "alone_config": config}}
        svc = loaded(state, json.dumps({"jobs": jobs}))
        assert svc._jobs["train"].alone_config == config


def test_an_evicted_list_not_read_takes_back_no_eviction_told_and_keeps_its_names(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """colo.json's evicted is a text, or a list with an entry that is no name: the
    evictions the jobs' own entries keep are still told, and the error says so rather than
    that no eviction is kept; in a list, the names are read (a GPU held for their next
    run), the other entries alone skipped."""
    state = tmp_path / "colo.json"
    jobs = {"big": {"kind": "training", "evict": "memory over its limit"}, "b": {"duty": 0.5}}
    svc = loaded(state, json.dumps({"jobs": jobs, "evicted": "big"}))
    assert svc._directives["big"].evict and not svc._jobs["big"].evicted
    (said,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "evicted not read" in said and "no eviction is kept" not in said
    assert "evictions already told stand" in said
    caplog.clear()
    svc = loaded(state, json.dumps({"jobs": jobs, "evicted": ["big", 1, None]}))
    assert svc._directives["big"].evict and svc._jobs["big"].evicted
    (said,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "evicted entries skipped" in said and "[1, None]" in said
    svc.tick(snapshot())
    assert json.loads(state.read_text())["evicted"] == ["big"]


def test_a_skipped_entry_is_kept_in_a_copy_of_the_file_as_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A job of colo.json not read: the file as read is copied, once, to colo.json.skipped
    (byte for byte, with the state file's mode) and each error names the copy; the next
    save writes colo.json with the jobs read. The save wrote over the entry, which nothing
    kept but a log line. A whole file not read is still renamed to colo.json.unreadable,
    with no copy."""
    state = tmp_path / "colo.json"
    text = json.dumps(
        {
            "jobs": {
                "train": {"kind": "training", "duty": 0.5, "alone_rate": 10.0},
                "bad": {"duty": 7},
                "worse": {"alone_rate": -1},
            },
            "evicted": [3],
        }
    )
    svc = loaded(state, text)
    copy = tmp_path / "colo.json.skipped"
    assert copy.read_bytes() == text.encode()
    assert copy.stat().st_mode & 0o777 == STATE_FILE_MODE
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(said) == 3 and all(f"the file as read is copied to {copy}" in s for s in said)
    svc.tick(snapshot())
    assert sorted(json.loads(state.read_text())["jobs"]) == ["train"]
    assert copy.read_bytes() == text.encode()
    assert not (tmp_path / "colo.json.unreadable").exists()
    copy.unlink()
    loaded(state, "{not json")
    assert (tmp_path / "colo.json.unreadable").read_text() == "{not json"
    assert not copy.exists()


def test_a_footprint_at_a_jobs_top_level_is_named_by_its_field(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file from before footprints were kept per device holds a job's at its top level:
    a bad value there is named jobs.NAME.sm, not jobs.NAME.devices..sm."""
    loaded(tmp_path / "colo.json", '{"jobs": {"train": {"sm": NaN, "mem_bw": 0.1}}}')
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "(jobs.train.sm: nan outside [0, 1])" in record.getMessage()


def test_a_predictor_number_too_large_for_a_float_restarts_the_predictor_not_gpud(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """colo.json's interference predictor with a clock of 400 digits: the predictor
    starts afresh, logged as out of range, the jobs' state kept. gpud did not start."""
    host = Restarts(tmp_path)
    predictor = {**InterferencePredictor().to_dict(), "clock_s": "HUGE"}
    state = {"version": STATE_FILE_VERSION, "jobs": {"train": {"alone_rate": 10.0}}}
    write_with_huge_ints(host.file, {**state, "predictor": predictor})
    svc, _ = host.start()
    assert svc._jobs["train"].alone_rate == 10.0
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("clock_s" in m and "out of range" in m for m in said)


def test_a_run_that_left_as_it_stopped_is_kept_a_minute_and_not_written(
    tmp_path: Path,
) -> None:
    """A waiting run that takes itself out as it stops (Ctrl-C, SIGTERM: its process
    exits): a question of it already on its way is LeftQueue, but it is kept a minute, in
    gpud alone: colo.json does not hold it, and it takes no place of an operator's leave
    among those remembered. Kept a day and written as an operator's leave, such runs
    filled the file and pushed out the leaves an operator gave."""
    from gpud.errors import LeftQueue

    host = Restarts(tmp_path, remember=1)
    svc, snap = host.start()
    taken = svc.advise("w", snapshot=snap, waiting=True).waiter_id
    own = svc.advise("v", snapshot=snap, waiting=True).waiter_id
    host.clock.t += 3.0
    assert svc.leave(taken) is not None
    assert svc.leave(own, stopped_by="SIGTERM") is not None
    with pytest.raises(LeftQueue, match=own):
        svc.advise("v", snapshot=snap, waiting=True, waited_s=3.0, waiter_id=own)
    svc.tick(snap)
    assert list(json.loads(host.file.read_text())["left"]) == [taken]
    host.clock.t += 61.0
    assert svc.advise("v", snapshot=snap, waiting=True, waiter_id=own).waiter_id == own
    with pytest.raises(LeftQueue, match=taken):
        svc.advise("w", snapshot=snap, waiting=True, waited_s=64.0, waiter_id=taken)


def test_what_the_loop_holds_of_a_job_gone_is_forgotten_after_a_while(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    from gpud.colo.service import FORGET_AFTER_S

    svc, clock, jobs = service
    svc.report_latency("chat", [0.095] * 100)
    svc.tick(snapshot())
    assert svc._guards and "chat" in svc._jobs
    jobs[:] = [j for j in jobs if j.name != "chat"]  # the service ended
    clock.t += FORGET_AFTER_S / 2
    svc.tick(snapshot())
    assert "chat" in svc._jobs  # it may run again under its name
    clock.t += FORGET_AFTER_S
    svc.tick(snapshot())
    assert set(svc._jobs) == {"train"} and not svc._guards


def test_process_wide_directive_without_a_daemon(tmp_path: Path) -> None:
    from gpud.client import colo

    colo._default.clear()
    colo._default["process"] = Throttle(
        "train", socket=str(tmp_path / "none.sock"), call=lambda j, i: (0.5, True, "memory")
    )
    colo.throttle_point()
    assert colo.directive() == (0.5, True, "memory")
    colo._default.clear()


def two_jobs_on_gpu0(tmp_path: Path) -> tuple[ColoService, Clock, list[RunningJob]]:
    clock = Clock()
    jobs = [RunningJob("train", "training", 0, memory_bytes=10 * GIB, memory_used=10 * GIB)]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "events.jsonl"), running=lambda: jobs, clock=clock
    )
    return svc, clock, jobs


def test_observed_speed_takes_the_throttle_out_and_teaches_the_predictor(
    tmp_path: Path,
) -> None:
    svc, clock, jobs = two_jobs_on_gpu0(tmp_path)
    # Alone: 10 iterations per second at full duty.
    for _ in range(5):
        svc.throttle_point("train", 10)
        svc.tick(snapshot())
        clock.t += 1
    assert svc.show().observed_speed == {}
    alone = svc._features(jobs[0])  # what it showed alone: the GPU's readings
    assert (alone.sm, alone.mem_bw) == (0.3, 0.2)
    assert alone.pcie == pytest.approx(0.02, rel=1e-3)
    # An inference service joins; the guard holds the training at duty 0.5 and it makes 4
    # iterations a second: 8 per second of running time, so interference cost 20%.
    jobs.append(RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=8 * GIB))
    svc.report_latency("chat", [0.09] * 100)  # p99 within the margin: throttle
    svc.tick(snapshot())
    assert svc.duty("train") == 0.5
    for _ in range(4):
        clock.t += 1
        svc.throttle_point("train", 4)
        svc.tick(snapshot())
    view = svc.show()
    assert view.observed_speed["train"] == pytest.approx(0.8)
    assert view.predictor_samples >= 1


def test_a_throttled_jobs_rate_is_not_read_from_the_reports_between_its_sleeps_slices(
    tmp_path: Path,
) -> None:
    """Training of 2 s iterations held at duty 0.1 sleeps 18 s after each, asking gpud
    each second of it with no iteration done: gpud reads its speed from its iterations
    alone (0.5 per second of running time), never 0 or more from a window inside a sleep,
    which would show a false slowdown, or learn a rate alone of 0."""
    clock = Clock()
    jobs = [RunningJob("train", "training", 0, memory_bytes=10 * GIB)]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "events.jsonl"), running=lambda: jobs, clock=clock
    )
    svc._directives["train"] = Directive(0.1, False, "SLO guard")
    rates: list[float | None] = []

    def ticks(seconds: float) -> None:
        """``seconds`` pass, the loop's rate read at each whole second of them."""
        end = clock.t + seconds
        while clock.t < end - 1e-9:
            clock.t = min(end, math.floor(clock.t + 1.0))
            rates.append(svc._rate(svc._jobs["train"], clock.t))

    def call(job: str, iterations: int) -> tuple[float, bool, str]:
        return dataclasses.astuple(svc.throttle_point(job, iterations))

    t = Throttle("train", clock=clock, sleep=ticks, call=call)
    t.point()
    for _ in range(6):
        ticks(2.0)  # an iteration
        t.point()
    assert t.duty == 0.1 and len(rates) >= 100
    wrong = [r for r in rates if r is not None and not 0.45 <= r <= 0.55]
    assert wrong == [], wrong
    # its iteration and sleep (20 s) outlast the rate's window (10 s): read over the last
    assert any(r is not None for r in rates), rates


def test_a_duty_told_in_the_middle_of_a_sleep_counts_from_then_in_the_rate(
    tmp_path: Path,
) -> None:
    """Training of 10 s iterations at duty 0.5 is told 0.1 one slice (1 s) into its sleep:
    it sleeps 90 s in all, so it runs 10 s in 100 (0.1 iterations per second of running
    time). Charged at 0.5 for the whole sleep it would read five times slower; the one slice
    slept before the change is charged at 0.5 (0.096)."""
    clock = Clock()
    jobs = [RunningJob("train", "training", 0, memory_bytes=10 * GIB)]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "events.jsonl"), running=lambda: jobs, clock=clock
    )
    svc._directives["train"] = Directive(0.5, False, "SLO guard")
    rates: dict[float, float | None] = {}  # the loop's rate read as each slice begins

    def sleep(seconds: float) -> None:
        rates[clock.t] = svc._rate(svc._jobs["train"], clock.t)
        clock.t += seconds
        svc._directives["train"] = Directive(0.1, False, "SLO guard")  # after its first slice

    def call(job: str, iterations: int) -> tuple[float, bool, str]:
        return dataclasses.astuple(svc.throttle_point(job, iterations))

    t = Throttle("train", clock=clock, sleep=sleep, call=call)
    t.point()
    clock.t += 10.0  # an iteration, then its sleep
    assert t.point() == pytest.approx(90.0)
    clock.t += 10.0  # the next iteration, read as its sleep begins
    t.point()
    assert rates[210.0] == pytest.approx(0.1, rel=0.05)


def test_a_job_stalled_before_its_first_iteration_is_learned_nothing_alone(
    tmp_path: Path,
) -> None:
    """Training that called its first throttle point and compiles for 30 s (its SMs 0.05
    busy) is a job that reports making no progress, not one that never reports: nothing is
    learned alone from the compile; from its iterations (SMs 0.6) it is."""
    clock = Clock()
    r = RunningJob("long", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB)
    svc = kept_loop(tmp_path, [r], clock)
    svc.throttle_point("long", 0)
    for _ in range(30):
        svc.tick(busy_snapshot({0: (0.05, 0.0)}))
        clock.t += 1
    assert svc._jobs["long"].learned("GPU 0") is None
    for _ in range(60):
        svc.throttle_point("long", 1)
        svc.tick(busy_snapshot({0: (0.6, 0.4)}))
        clock.t += 1
    learned = svc._jobs["long"].learned("GPU 0")
    assert learned is not None and learned.sm == pytest.approx(0.6)


def colo_show(resp: colo_pb2.ShowColoResponse, *, json_output: bool = False) -> str:
    """What ``gpuctl colo show`` prints of ``resp``."""
    import argparse
    import io

    from gpud.cli.colo import run_show
    from gpud.cli.context import Context
    from gpud.cli.output import Output

    class Answer(Context):
        def stub(self, stub_class: Any) -> Any:
            return self

        ShowColo = None  # the stub method run_show names

        def call(self, method: Any, request: object) -> Any:
            return resp

    text = io.StringIO()
    ctx = Answer(
        socket_path=Path("/run/gpud/gpud.sock"),
        timeout=2.0,
        output=Output(json_output=json_output, stream=text),
    )
    assert run_show(ctx, argparse.Namespace()) == 0
    return text.getvalue()


def test_a_job_on_a_gpu_that_does_not_answer_has_no_speed_shown(tmp_path: Path) -> None:
    """Training slowed to 0.8 by a service beside it on GPU 0, which then is lost: no
    speed, predicted or observed, is shown for what runs there (not 1.00, not the last
    one measured) until it answers again."""
    from gpud.colo.api import ColoServicer

    svc, clock, jobs = two_jobs_on_gpu0(tmp_path)
    for _ in range(5):
        svc.throttle_point("train", 10)
        svc.tick(snapshot())
        clock.t += 1
    jobs.append(RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=8 * GIB))
    svc.report_latency("chat", [0.09] * 100)
    svc.tick(snapshot())
    for _ in range(4):
        clock.t += 1
        svc.throttle_point("train", 4)
        svc.tick(snapshot())
    shown = {p.job: p for p in ColoServicer(svc, snapshots=snapshot)._show().placements}
    assert shown["train"].observed_speed == pytest.approx(0.8)
    assert shown["train"].HasField("predicted_speed")

    lost = gpu0_lost()
    clock.t += 1
    svc.throttle_point("train", 4)
    svc.tick(lost)
    resp = ColoServicer(svc, snapshots=lambda: lost)._show()
    for p in resp.placements:
        assert not p.HasField("predicted_speed") and not p.HasField("observed_speed")
        assert p.reason == "GPU 0 lost (memory): left alone until it answers"
    (row,) = [line for line in colo_show(resp).splitlines() if line.startswith("train")]
    assert row.split()[5:7] == ["-", "-"]  # PREDICTED, OBSERVED
    data = json.loads(colo_show(resp, json_output=True))
    assert {(p["predicted_speed"], p["observed_speed"]) for p in data["placements"]} == {
        (None, None)
    }


def test_a_rate_alone_at_another_share_is_no_yardstick_for_slowdown(tmp_path: Path) -> None:
    """Alone, the job made 10 iterations a second with every SM. Run again with half of
    them beside another job, its 4 a second are not a slowdown of 0.4 from its company:
    the share took some of it. Nothing is learned until it was measured alone at that share
    (and what it ran at is kept across restarts)."""
    clock = Clock()
    jobs = [RunningJob("train", "training", 0, memory_bytes=10 * GIB)]
    svc = kept_loop(tmp_path, jobs, clock)
    for _ in range(5):
        svc.throttle_point("train", 10)
        svc.tick(snapshot())
        clock.t += 1
    assert svc._jobs["train"].alone_config == "100%"
    svc = kept_loop(tmp_path, jobs, clock)  # the daemon restarts
    assert svc._jobs["train"].alone_config == "100%"
    jobs[:] = [
        dataclasses.replace(jobs[0], threads_percent=50),  # its next run
        RunningJob("other", "training", 0, memory_bytes=10 * GIB),
    ]
    for _ in range(6):
        clock.t += 1
        svc.throttle_point("train", 4)
        svc.throttle_point("other", 4)
        svc.tick(snapshot())
    assert "train" not in svc.show().observed_speed
    assert svc.predictor.stats().samples == 0


def training_on_two_gpus(tmp_path: Path, clock: Clock, *, service_gpu: int) -> ColoService:
    """A loop that sees training on GPUs 0 and 1 and a service (SLO 100 ms) beside it on
    ``service_gpu``."""
    jobs = [
        RunningJob("train", "training", 0, memory_bytes=10 * GIB),
        RunningJob("train", "training", 1, memory_bytes=10 * GIB),
        RunningJob("chat", "inference", service_gpu, slo_p99_ms=100.0, memory_bytes=20 * GIB),
    ]
    return ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=clock
    )


def test_a_job_the_plan_left_out_has_no_predicted_speed_shown(tmp_path: Path) -> None:
    """A healthy GPU whose memory reading is missing is left out of the plan, and so is
    what runs there: no predicted speed is shown for it (not a made-up 1.00)."""
    from gpud.colo.api import ColoServicer

    svc, _, jobs = two_jobs_on_gpu0(tmp_path)
    jobs.append(RunningJob("other", "training", 1, memory_bytes=10 * GIB))
    snap = snapshot()
    unread = Snapshot(
        snap.wall_time,
        snap.monotonic,
        (snap.gpus[0]._replace(memory=None), snap.gpus[1]),
        snap.tick_seconds,
    )
    plan = svc.tick(unread)
    assert plan is not None and "train" not in plan.predicted_speed
    shown = {p.job: p for p in ColoServicer(svc, snapshots=lambda: unread)._show().placements}
    assert not shown["train"].HasField("predicted_speed")
    assert shown["other"].HasField("predicted_speed")


def gpu0_lost() -> Snapshot:
    """Two GPUs, GPU 0 lost."""
    lost = snapshot()
    gpu0 = lost.gpus[0]._replace(healthy=False, reason="GPU lost (memory): call failed")
    return Snapshot(lost.wall_time, lost.monotonic, (gpu0, lost.gpus[1]), lost.tick_seconds)


def test_a_lost_gpu_under_a_job_on_two_gpus_leaves_the_guard_on_the_other_at_work(
    tmp_path: Path,
) -> None:
    """Training on GPUs 0 and 1, a service beside it on GPU 1: GPU 0 stops answering (its
    processes may well go on). The service's guard still throttles the training, and what
    a guard on the lost GPU had set stands until it answers again."""
    clock = Clock()
    svc = training_on_two_gpus(tmp_path, clock, service_gpu=1)
    svc.tick(snapshot())
    assert svc.duty("train") == 1.0
    lost = gpu0_lost()
    clock.t += 1
    svc.report_latency("chat", [0.095] * 30)  # within 20 % of its 100 ms SLO
    svc.tick(lost)
    (g,) = svc.show().guards
    assert g.action == "throttle"
    assert svc.duty("train") == 0.5


def test_a_guard_paused_on_a_lost_gpu_still_holds_a_job_on_two_gpus(tmp_path: Path) -> None:
    """Training on GPUs 0 and 1, throttled for a service beside it on GPU 0, which then
    stops answering: the plan for GPU 1 alone would let it run at full speed, but the cut
    the paused guard made stands until GPU 0 answers again."""
    clock = Clock()
    svc = training_on_two_gpus(tmp_path, clock, service_gpu=0)
    clock.t += 1
    svc.report_latency("chat", [0.095] * 30)
    svc.tick(snapshot())
    assert svc.duty("train") == 0.5
    lost = gpu0_lost()
    for _ in range(3):
        clock.t += 5
        svc.tick(lost)
        d = svc.throttle_point("train", 1)
        assert d.duty == 0.5 and "paused on GPU 0" in d.reason
    clock.t += 5
    svc.report_latency("chat", [0.01] * 30)
    svc.tick(snapshot())  # it answers: its guard goes on from where it was
    assert svc.duty("train") >= 0.5


def test_a_jobs_rates_alone_at_two_shares_give_its_knee(tmp_path: Path) -> None:
    """Alone with every SM it made 10 iterations a second, alone with half of them (a
    later run) 8: its shape's knee is what the two show (0.8 of its speed at half the SMs:
    knee 0.65), not the SM activity it showed (0.3); kept across a restart."""
    clock = Clock()
    jobs = [RunningJob("train", "training", 0, memory_bytes=10 * GIB, memory_used=10 * GIB)]
    svc = kept_loop(tmp_path, jobs, clock)

    def alone(rate: int) -> None:
        for _ in range(6):
            svc.throttle_point("train", rate)
            svc.tick(snapshot())
            clock.t += 1

    alone(10)
    assert svc._view(jobs[0]).shape.curve.knee == pytest.approx(0.3)  # its SM activity
    jobs[0] = dataclasses.replace(jobs[0], threads_percent=50)
    alone(8)
    assert svc._jobs["train"].alone_rates == {1.0: pytest.approx(10.0), 0.5: pytest.approx(8.0)}
    assert svc._view(jobs[0]).shape.curve.knee == pytest.approx(0.65)
    svc = kept_loop(tmp_path, jobs, clock)  # the daemon restarts
    assert svc._view(jobs[0]).shape.curve.knee == pytest.approx(0.65)


def test_the_guard_waits_for_latencies_at_the_duty_it_set(tmp_path: Path) -> None:
    svc, clock, jobs = two_jobs_on_gpu0(tmp_path)
    jobs.append(RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=8 * GIB))
    svc.report_latency("chat", [0.095] * 100)
    svc.tick(snapshot())
    assert svc.duty("train") == 0.5  # at once, within the tick
    # The spike is still in the window, but nothing was measured at duty 0.5 yet: hold.
    clock.t += 0.5
    svc.tick(snapshot())
    assert svc.duty("train") == 0.5
    # Latencies at the new duty are fine: recovery, not another cut.
    clock.t += 1.0
    svc.report_latency("chat", [0.01] * 100)
    clock.t += 0.1
    svc.tick(snapshot())
    assert svc.duty("train") == pytest.approx(0.6)


def gpu0_faulty(reason: str) -> Snapshot:
    """The default snapshot with GPU 0 unhealthy for ``reason``."""
    snap = snapshot()
    gpu0 = snap.gpus[0]._replace(healthy=False, reason=reason)
    return Snapshot(snap.wall_time, snap.monotonic, (gpu0, snap.gpus[1]), snap.tick_seconds)


def chat_beside_training(tmp_path: Path) -> tuple[ColoService, Clock, list[RunningJob]]:
    """A service of a 100 ms SLO joins the training on GPU 0, well within it: one tick."""
    svc, clock, jobs = two_jobs_on_gpu0(tmp_path)
    jobs.append(RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=8 * GIB))
    svc.report_latency("chat", [0.01] * 100)
    svc.tick(snapshot())
    assert svc.duty("train") == 1.0
    return svc, clock, jobs


def test_a_faulty_gpu_is_left_out_and_its_jobs_keep_their_directives(tmp_path: Path) -> None:
    svc, clock, jobs = two_jobs_on_gpu0(tmp_path)
    jobs.append(RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=8 * GIB))
    svc.report_latency("chat", [0.095] * 100)
    svc.tick(snapshot())
    assert svc.duty("train") == 0.5
    lost = gpu0_faulty("GPU lost (memory): call failed")
    for _ in range(5):
        clock.t += 2
        svc.report_latency("chat", [0.5] * 100)  # what it reports means nothing now
        svc.tick(lost)
    assert svc.duty("train") == 0.5
    view = svc.show()
    assert view.faulty == {0: "lost (memory)"}
    (g,) = view.guards
    assert g.action == "hold" and "paused: GPU 0 lost" in g.reason
    from gpud.colo.api import ColoServicer

    shown = {p.job: p for p in ColoServicer(svc, snapshots=lambda: lost)._show().placements}
    assert shown["train"].reason == "GPU 0 lost (memory): left alone until it answers"
    # No advice puts a new job on it.
    assert svc.advise("new", memory_bytes=GIB, snapshot=lost).gpu == 1


def paused_then_killed(tmp_path: Path) -> list[RunningJob]:
    """A service's guard holds the training beside it on GPU 0 at duty 0.5; GPU 0 hangs
    (the guard pauses, the service reports 200 ms through it) and gpud is killed -9: the
    jobs, as colo.json was last written for them."""
    clock = Clock()
    jobs = [
        RunningJob("train", "training", 0, memory_bytes=10 * GIB, memory_used=10 * GIB),
        RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=8 * GIB),
    ]
    svc = kept_loop(tmp_path, jobs, clock)
    svc.report_latency("chat", [0.095] * 100)
    svc.tick(snapshot())
    assert svc.duty("train") == 0.5
    clock.t += 1
    svc.report_latency("chat", [0.2] * 100)
    svc.tick(gpu0_faulty("not answering: a driver call is out"))
    assert "paused" in svc.show().guards[0].reason
    return jobs


def test_a_guard_paused_at_a_kill_holds_its_training_and_resumes_once_the_gpu_answers(
    tmp_path: Path,
) -> None:
    """gpud killed -9 while GPU 0 hangs under a service and the training its guard holds
    at duty 0.5: the restarted loop keeps the training at 0.5 while the GPU hangs (not a
    tick at full duty), says the guard is paused, and once the GPU answers takes the guard
    up again: not on the hang's latencies, on those reported since. The restart's first
    tick finds the GPU hung, which pauses the guard whether or not colo.json kept its
    pause: what the kept pause itself holds is the next test's."""
    jobs = paused_then_killed(tmp_path)
    clock = Clock()  # the host's monotonic clock, as a new gpud reads it
    again = kept_loop(tmp_path, jobs, clock)
    assert again.throttle_point("train", 10).duty == 0.5  # before its first tick
    hung = gpu0_faulty("not answering: a driver call is out")
    for _ in range(3):
        clock.t += 1
        again.report_latency("chat", [0.2] * 100)
        again.tick(hung)
        assert again.duty("train") == 0.5
        assert again.show().guards[0].reason.startswith("paused: GPU 0 not answering")
    clock.t += 1
    again.tick(snapshot())  # it answers: the window still holds the hang's 200 ms
    assert again.duty("train") == 0.5
    assert "paused" not in again.show().guards[0].reason
    clock.t += 1.5
    again.report_latency("chat", [0.01] * 100)  # well within the SLO now
    again.tick(snapshot())
    assert again.duty("train") == pytest.approx(0.6)


def test_a_guard_paused_at_a_kill_does_not_act_on_the_hangs_latencies_after_it(
    tmp_path: Path,
) -> None:
    """gpud killed -9 while GPU 0 hangs under a service; the GPU answers again before the
    restarted loop's first tick, which finds the hang's 200 ms reported since the start:
    the guard, paused when gpud was killed, does not cut the training for them; it acts on
    latencies reported from a second after that tick."""
    jobs = paused_then_killed(tmp_path)
    clock = Clock()
    again = kept_loop(tmp_path, jobs, clock)
    clock.t += 1
    again.report_latency("chat", [0.2] * 100)  # sent in the hang's last second
    clock.t += 1
    again.tick(snapshot())
    assert again.duty("train") == 0.5
    clock.t += 1.5
    again.report_latency("chat", [0.095] * 100)  # the training's doing now
    again.tick(snapshot())
    assert again.duty("train") == 0.25


def test_a_removal_before_the_first_tick_after_a_restart_keeps_a_paused_guard(
    tmp_path: Path,
) -> None:
    """gpud killed -9 while GPU 0 hangs under a service whose guard holds the training at
    duty 0.5; `gpuctl jobs rm --force train` comes before the restarted loop's first tick:
    colo.json still holds the service as running, its guard's duty and its pause, for gpud
    killed again before that tick."""
    jobs = paused_then_killed(tmp_path)
    before = json.loads((tmp_path / "colo.json").read_text())["jobs"]
    assert before["chat"]["guard_paused"] and before["chat"]["guard_duty"] == 0.5
    again = kept_loop(tmp_path, jobs, Clock())
    again.job_removed("train", force=True)()
    after = json.loads((tmp_path / "colo.json").read_text())["jobs"]
    assert after == {"chat": before["chat"]}


def test_a_service_over_its_slo_on_a_hung_gpu_counts_against_its_attainment(
    tmp_path: Path,
) -> None:
    """GPU 0 stops answering while its service reports latencies over its SLO: the guard
    stays paused (training keeps its duty), but the misses count in the attainment and the
    guard's reason says that p99 is over the SLO."""
    svc, clock, _ = chat_beside_training(tmp_path)
    hung = gpu0_faulty("not answering: a driver call is out")
    for _ in range(3):
        clock.t += 11  # past the latency window: each tick sees only the new reports
        svc.report_latency("chat", [0.2] * 100)
        svc.tick(hung)
    assert svc.duty("train") == 1.0
    (g,) = svc.show().guards
    assert g.action == "hold" and g.attainment == pytest.approx(0.25)
    assert g.reason == "paused: GPU 0 not answering; p99 200.0 ms over SLO 100.0 ms"
    reg = scraped(svc)
    assert reg.get_sample_value("gpud_colo_slo_attainment_ratio", {"job": "chat"}) == 0.25


def test_a_guard_back_from_a_hung_gpu_does_not_act_on_the_hangs_latencies(
    tmp_path: Path,
) -> None:
    """GPU 0 hangs under a service and a training job; the service reports 200 ms through
    the hang. When the GPU answers again the guard does not cut the training for those
    latencies (the hang's, not the training's): it waits for ones reported since, and acts
    on them."""
    svc, clock, _ = chat_beside_training(tmp_path)
    hung = gpu0_faulty("not answering: a driver call is out")
    for _ in range(3):
        clock.t += 1
        svc.report_latency("chat", [0.2] * 100)
        svc.tick(hung)
    clock.t += 1
    svc.tick(snapshot())  # it answers: the window still holds the hang's 200 ms
    assert svc.duty("train") == 1.0
    clock.t += 1.5
    svc.report_latency("chat", [0.095] * 100)  # the training's doing now
    svc.tick(snapshot())
    assert svc.duty("train") == 0.5


def test_a_guard_back_from_a_hung_gpu_waits_from_its_answer_at_a_slow_tick(
    tmp_path: Path,
) -> None:
    """The loop ticks every 5 s while the service reports 200 ms each second through three
    hung ticks: the first tick that finds GPU 0 answering still sees 4 s of reports sent
    during the hang, newer than the last hung tick. The guard waits for latencies reported
    from a second after that tick, and acts on them."""
    svc, clock, _ = chat_beside_training(tmp_path)
    hung = gpu0_faulty("not answering: a driver call is out")
    for second in range(1, 21):
        clock.t += 1
        svc.report_latency("chat", [0.2] * 25)
        if second % 5 == 0:
            svc.tick(hung if second < 20 else snapshot())
    assert svc.duty("train") == 1.0
    clock.t += 1.5
    svc.report_latency("chat", [0.095] * 100)  # the training's doing now
    svc.tick(snapshot())
    assert svc.duty("train") == 0.5


def test_misses_of_a_service_hung_since_before_gpud_started_show(tmp_path: Path) -> None:
    """GPU 0 hangs before gpud starts, with no guard saved for its service: the misses it
    reports count, and `gpuctl colo show` and the attainment metric show them."""
    svc, _, jobs = two_jobs_on_gpu0(tmp_path)
    jobs.append(RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=8 * GIB))
    svc.report_latency("chat", [0.2] * 100)
    svc.tick(gpu0_faulty("not answering: a driver call is out"))
    (g,) = svc.show().guards
    assert (g.job, g.action, g.attainment) == ("chat", "hold", 0.0)
    assert g.reason == "paused: GPU 0 not answering; p99 200.0 ms over SLO 100.0 ms"
    reg = scraped(svc)
    assert reg.get_sample_value("gpud_colo_slo_attainment_ratio", {"job": "chat"}) == 0.0


def test_a_tick_sorts_each_services_window_once(tmp_path: Path) -> None:
    """A service's whole-window p99 (a sort of its window, under the loop's lock) is read
    once a tick, for its attainment and its guard both."""
    svc, clock, _ = chat_beside_training(tmp_path)
    whole: list[str] = []
    p99 = svc.p99

    def counted(job: str, *, since: float = float("-inf"), min_samples: int = 1) -> float | None:
        if since == float("-inf") and min_samples == 1:
            whole.append(job)
        return p99(job, since=since, min_samples=min_samples)

    svc.p99 = counted  # type: ignore[method-assign]
    clock.t += 1
    svc.report_latency("chat", [0.01] * 100)
    svc.tick(snapshot())
    assert whole == ["chat"]


def test_a_refusal_names_the_faulty_gpus_beside_the_busy_ones(tmp_path: Path) -> None:
    """Training on GPU 0, GPU 1 lost: a job that GPU 0 refuses is told why there, and that
    GPU 1, free as it looks, is lost (not only what holds GPU 0)."""
    clock = Clock()
    svc = ColoService(
        ColocateConfig(),
        EventLog(tmp_path / "e.jsonl"),
        running=lambda: [RunningJob("train", "training", 1, memory_bytes=10 * GIB)],
        clock=clock,
    )
    lost = snapshot(3)
    gpu1 = lost.gpus[1]._replace(healthy=False, reason="GPU lost (memory): call failed")
    gpu2 = lost.gpus[2]._replace(
        healthy=False,
        reason="not answering: a driver call is outstanding; last seen as NVIDIA H100 80GB HBM3"
        " GPU-2 at "
        "00000000:5D:00.0",
    )
    lost = Snapshot(lost.wall_time, lost.monotonic, (lost.gpus[0], gpu1, gpu2), 0.01)
    svc.tick(lost)
    assert svc.show().faulty == {1: "lost (memory)", 2: "not answering"}
    a = svc.advise("big", memory_bytes=60 * GIB, snapshot=lost)
    assert a.gpu == -1
    assert a.reason.startswith("GPU 0: memory: ") and a.reason.endswith(
        "; GPU 1 unhealthy: GPU lost (memory); GPU 2 unhealthy: not answering"
    ), a.reason
    # healthy again: the refusal names GPU 0 alone
    assert "unhealthy" not in svc.advise("big", memory_bytes=60 * GIB, snapshot=snapshot()).reason


def mig_gpu(index: int, *profiles: tuple[str, int, int]) -> GpuSample:
    """An H100 in MIG mode whose instances are free (read, no process): two 1g.10gb, or one
    per (profile, GiB, SMs) given."""
    from gpud.backend.port import MigMode
    from tests.unit.api_support import mig

    devices = []
    for n, (profile, gib, sms) in enumerate(profiles or (("1g.10gb", 10, 16),) * 2):
        m = mig(index, n)
        ident = dataclasses.replace(
            m.identity, profile_name=profile, memory_total_bytes=gib * GIB, multiprocessor_count=sms
        )
        devices.append(
            m._replace(identity=ident, memory=MemoryInfo(gib * GIB, 0, gib * GIB), processes=())
        )
    return GpuSample(
        identity=identity(index),
        healthy=True,
        reason="",
        sampled_at=0.0,
        memory=MemoryInfo(80 * GIB, 0, 80 * GIB),
        mig_mode=MigMode(current=True, pending=True),
        mig_devices=tuple(devices),
    )


def test_mig_devices_of_one_gpu_instance_share_its_memory_as_nvml_reads_it(
    tmp_path: Path,
) -> None:
    """GPU 0's 3g.40gb GPU instance is split into a 1c.3g.40gb and a 2c.3g.40gb compute
    instance, each a MIG device that reads the instance's memory: 39 GiB of 40 used, where
    the service in one and the training job in the other report 28 between them. The
    instance is over its limit: the training job is evicted, the reason naming its device."""
    gpu = mig_gpu(0, ("1c.3g.40gb", 40, 16), ("2c.3g.40gb", 40, 32))
    devices = tuple(
        m._replace(
            identity=dataclasses.replace(m.identity, gpu_instance_id=1, compute_instance_id=n),
            memory=MemoryInfo(40 * GIB, 39 * GIB, GIB),
        )
        for n, m in enumerate(gpu.mig_devices)
    )
    c1, c2 = (m.identity for m in devices)
    snap = snapshot()
    snap = Snapshot(
        snap.wall_time, snap.monotonic, (gpu._replace(mig_devices=devices),), snap.tick_seconds
    )
    jobs = [
        RunningJob(
            "chat",
            "inference",
            0,
            slo_p99_ms=100.0,
            memory_bytes=8 * GIB,
            memory_used=8 * GIB,
            device=c1.uuid,
            mig_profile=c1.profile_name,
        ),
        RunningJob(
            "train",
            "training",
            0,
            memory_bytes=20 * GIB,
            memory_used=20 * GIB,
            device=c2.uuid,
            mig_profile=c2.profile_name,
        ),
    ]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "events.jsonl"), running=lambda: jobs, clock=Clock()
    )
    plan = svc.tick(snap)
    assert plan is not None
    (ev,) = [d for d in plan.directives if d.evict]
    assert ev.job_id == "train"
    assert ev.reason.startswith(f"GPU 0 MIG instance 2c.3g.40gb ({c2.uuid}) memory 39936 MiB")


def test_a_mig_device_that_reads_0_bytes_of_memory_does_not_take_its_jobs_run_peak_for_0(
    tmp_path: Path,
) -> None:
    """While GPU 0's 3g.40gb device said its memory was 0 bytes, train's processes there
    held 30 GiB: the size is unknown, not a bound of 0, so the run's peak is 30 GiB when
    the device reads 40 GiB again and train uses 5 GiB."""
    sized = mig_gpu(0, ("3g.40gb", 40, 60))
    (m,) = sized.mig_devices
    zero = sized._replace(
        mig_devices=(m._replace(identity=dataclasses.replace(m.identity, memory_total_bytes=0)),)
    )
    job = RunningJob(
        "train",
        "training",
        0,
        memory_bytes=4 * GIB,
        memory_used=30 * GIB,
        device=m.identity.uuid,
        mig_profile="3g.40gb",
        reserved_at=100.0,
    )
    jobs = [job]
    clock = Clock()
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=clock
    )
    svc.tick(Snapshot(0.0, 0.0, (zero,), 0.01))
    jobs[0] = dataclasses.replace(job, memory_used=5 * GIB)
    clock.t += 5
    svc.tick(Snapshot(0.0, 5.0, (sized,), 0.01))
    assert svc._view(jobs[0]).shape.observed_peak_bytes == 30 * GIB


def test_a_tight_slo_gets_a_free_mig_instance_and_training_one_that_keeps_its_pace(
    tmp_path: Path,
) -> None:
    from tests.unit.api_support import mig

    running: list[RunningJob] = [RunningJob("busy", "training", 0, memory_bytes=60 * GIB)]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: running, clock=Clock()
    )
    base = snapshot(1, used_gib=60)
    snap = Snapshot(0.0, 0.0, (base.gpus[0], mig_gpu(1)), 0.01)
    a = svc.advise("chat", kind="inference", slo_p99_ms=20, memory_bytes=4 * GIB, snapshot=snap)
    assert a.gpu == 1 and a.mig_profile == "1g.10gb"
    assert a.device == mig(1, 0).identity.uuid and "MIG" in a.reason
    # A 1g.10gb instance would cut a training job to a seventh of its SMs: it waits.
    t = svc.advise("train2", memory_bytes=8 * GIB, snapshot=snap)
    assert t.gpu == -1 and t.reason.startswith("GPU 0: memory")  # GPU 0 is full
    assert t.reason.endswith(
        "GPU 1: in MIG mode: no free instance (1g.10gb) holds its 9420 MiB and gives it 1/2 "
        "of its speed on a whole GPU"
    )
    # A 4g.40gb instance keeps its pace (its prior needs every SM: 64 of 132 give 0.54).
    big = Snapshot(
        0.0, 0.0, (base.gpus[0], mig_gpu(1, ("1g.10gb", 10, 16), ("4g.40gb", 40, 64))), 0.01
    )
    t = svc.advise("train2", memory_bytes=8 * GIB, snapshot=big)
    assert (t.gpu, t.mig_profile, t.device) == (1, "4g.40gb", mig(1, 1).identity.uuid)
    assert t.reason == (
        "GPU 1 is in MIG mode: MIG instance 4g.40gb, predicted speed 0.54 of its speed on a "
        "whole GPU"
    )
    # One that needs fewer SMs takes the smallest instance that keeps its full pace.
    light = svc.advise("train3", memory_bytes=8 * GIB, sm_activity=0.1, snapshot=big)
    assert light.mig_profile == "1g.10gb", light.reason
    # An instance a process of no known job runs in is not free.
    m0, m1 = big.gpus[1].mig_devices
    held = big.gpus[1]._replace(mig_devices=(m0, m1._replace(processes=mig(1, 0).processes)))
    t = svc.advise(
        "train2", memory_bytes=8 * GIB, snapshot=dataclasses.replace(big, gpus=(base.gpus[0], held))
    )
    assert t.gpu == -1


def test_on_a_node_all_in_mig_mode_a_job_no_instance_serves_never_fits(tmp_path: Path) -> None:
    running: list[RunningJob] = []
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: running, clock=Clock()
    )
    snap = Snapshot(0.0, 0.0, (mig_gpu(0),), 0.01)
    t = svc.advise("train", memory_bytes=8 * GIB, snapshot=snap)
    assert t.gpu == -1 and t.reason == (
        "never fits on this node: every healthy GPU is in MIG mode, and no MIG instance there "
        "(1g.10gb) holds its 9420 MiB and gives it 1/2 of its speed on a whole GPU"
    )
    # Taken instances count: one could free up.
    snap = Snapshot(0.0, 0.0, (mig_gpu(0, ("1g.10gb", 10, 16), ("4g.40gb", 40, 64)),), 0.01)
    running[:] = [
        RunningJob(
            "other",
            "training",
            0,
            memory_bytes=8 * GIB,
            device=snap.gpus[0].mig_devices[1].identity.uuid,
            mig_profile="4g.40gb",
        )
    ]
    t = svc.advise("train", memory_bytes=8 * GIB, snapshot=snap)
    assert t.gpu == -1 and t.reason == (
        "GPU 0: in MIG mode: no free instance (1g.10gb) holds its 9420 MiB and gives it 1/2 of "
        "its speed on a whole GPU"
    )


def test_a_second_tight_service_gets_the_other_free_mig_instance(tmp_path: Path) -> None:
    from tests.unit.api_support import mig

    first = mig(1, 0).identity
    running = [
        RunningJob(
            "chat",
            "inference",
            1,
            slo_p99_ms=20,
            memory_bytes=4 * GIB,
            device=first.uuid,
            mig_profile=first.profile_name,
        )
    ]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: running, clock=Clock()
    )
    snap = Snapshot(0.0, 0.0, (mig_gpu(1),), 0.01)
    a = svc.advise("search", kind="inference", slo_p99_ms=20, memory_bytes=4 * GIB, snapshot=snap)
    assert a.gpu == 1 and a.mig_profile == "1g.10gb" and a.device == mig(1, 1).identity.uuid


def test_a_service_without_a_declared_shape_shares_with_training(tmp_path: Path) -> None:
    running = [RunningJob("train", "training", 0, memory_bytes=10 * GIB)]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: running, clock=Clock()
    )
    snap = snapshot(1, used_gib=10)
    a = svc.advise("chat", kind="inference", slo_p99_ms=100, memory_bytes=8 * GIB, snapshot=snap)
    assert a.gpu == 0 and "shares GPU 0 with train" in a.reason, a.reason
    # And training may join a running service that declared only its SLO and peak.
    running[:] = [
        RunningJob("chat", "inference", 0, slo_p99_ms=100, memory_bytes=8 * GIB, peak_load=5)
    ]
    t = svc.advise("train", memory_bytes=10 * GIB, sm_activity=0.2, snapshot=snap)
    assert t.gpu == 0 and "shares GPU 0 with chat" in t.reason, t.reason
    # The prior holds the SMs its peak needs: training gets what is left of them.
    assert t.sm_share <= 0.5


def test_gpuctl_jobs_explains_each_jobs_co_location(
    service: tuple[ColoService, Clock, list[RunningJob]], capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from gpud.api import ApiServer
    from gpud.cli.main import main
    from gpud.colo.api import ColoServicer
    from gpud.v1 import jobs_pb2, jobs_pb2_grpc
    from tests.unit.api_support import ServerThread, short_dir

    class Jobs(jobs_pb2_grpc.JobsServicer):
        async def ListJobs(
            self, request: jobs_pb2.ListJobsRequest, context: Any
        ) -> jobs_pb2.ListJobsResponse:
            return jobs_pb2.ListJobsResponse(
                jobs=[
                    jobs_pb2.Job(name="chat", kind=jobs_pb2.JOB_KIND_INFERENCE, slo_p99_ms=100),
                    jobs_pb2.Job(name="idle", kind=jobs_pb2.JOB_KIND_TRAINING),
                    jobs_pb2.Job(name="train", kind=jobs_pb2.JOB_KIND_TRAINING),
                ]
            )

    svc, _, _ = service
    snap = snapshot()
    svc.report_latency("chat", [0.095] * 100)
    svc.tick(snap)
    with short_dir() as d:
        path = d / "gpud.sock"
        servicers = [
            ColoServicer(svc, snapshots=lambda: snap).register,
            lambda server: jobs_pb2_grpc.add_JobsServicer_to_server(Jobs(), server),
        ]
        with ServerThread(ApiServer(path, servicers=servicers)):
            assert main(["--socket", str(path), "jobs"], env={}) == 0
            lines = capsys.readouterr().out.splitlines()
            assert lines[0].split()[-4:] == ["ON", "SHARE", "DUTY", "GUARD"]
            rows = {line.split()[0]: line for line in lines[1:]}
            assert "GPU 0" in rows["train"] and "50%" in rows["train"]
            assert "throttled for chat" in rows["train"]
            assert "throttle p99 95.0/100 ms" in rows["chat"]
            assert rows["idle"].rstrip().endswith("-")
            assert main(["--socket", str(path), "--json", "jobs", "ls"], env={}) == 0
            shown = {j["name"]: j for j in json.loads(capsys.readouterr().out)["jobs"]}
            assert shown["idle"]["colo"] is None
            train = shown["train"]["colo"]
            assert train["gpu"] == 0 and train["duty"] == 0.5 and train["sm_share"] == 0.5
            assert train["throttled_by"] == ["chat"]
            assert shown["chat"]["colo"]["guard"]["action"] == "throttle"


def test_gpuctl_jobs_says_a_training_job_is_evicted_rather_than_throttled() -> None:
    from gpud.cli.jobs import colo_row

    entry = {
        "gpu": 0,
        "mig_profile": None,
        "sm_share": 1.0,
        "kind": "training",
        "duty": 0.0,
        "guard": None,
        "evict": True,
        "throttled_by": ["chat"],
    }
    assert colo_row(entry) == ("GPU 0", "100%", "0%", "evicted: checkpoint and leave")


class Restartable:
    """A loop with a state file, and the jobs it sees: ``start()`` again is a restart."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.clock = Clock()
        self.jobs = [
            RunningJob("train", "training", 0, memory_bytes=10 * GIB, memory_used=10 * GIB)
        ]

    def start(self) -> ColoService:
        return ColoService(
            ColocateConfig(),
            EventLog(self.tmp_path / "events.jsonl"),
            running=lambda: self.jobs,
            clock=self.clock,
            state_file=self.tmp_path / "colo.json",
        )

    def alone_then_throttled(self, svc: ColoService) -> None:
        """Training alone at 10 iterations a second, then a service joins and its guard
        halves the training's duty."""
        for _ in range(5):
            svc.throttle_point("train", 10)
            svc.tick(snapshot())
            self.clock.t += 1
        self.jobs.append(RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=8 * GIB))
        svc.report_latency("chat", [0.095] * 100)
        svc.tick(snapshot())
        assert svc.duty("train") == 0.5


def test_what_the_loop_learned_outlives_a_restart(tmp_path: Path) -> None:
    node = Restartable(tmp_path)
    start, clock, jobs = node.start, node.clock, node.jobs
    node.alone_then_throttled(start())

    again = start()  # the daemon was killed and restarted; the jobs ran on
    assert again.duty("train") == 0.5  # not full duty until the guard cuts again
    assert again._features(jobs[0]).pcie == pytest.approx(0.02, rel=1e-3)  # its footprint
    again.tick(snapshot())
    assert again.duty("train") == 0.5
    for _ in range(4):
        clock.t += 1
        again.throttle_point("train", 4)
        again.tick(snapshot())
    assert again.show().observed_speed["train"] == pytest.approx(0.8)  # alone rate kept


def test_a_guard_restored_beside_other_training_starts_at_peak_duty(tmp_path: Path) -> None:
    """Its duty was learned beside another job (the one beside it ended while gpud was
    down): no evidence about this pair, so the guard starts at peak_duty, not at 0.5."""
    node = Restartable(tmp_path)
    node.alone_then_throttled(node.start())
    node.jobs[0] = RunningJob("other", "training", 0, memory_bytes=10 * GIB)
    again = node.start()
    again.tick(snapshot())
    assert again.duty("other") == 0.25  # ColocateConfig().peak_duty
    (g,) = again.show().guards
    assert g.duty == 0.25
    (said,) = again._events.recent(kind_prefix="colo.guard")
    assert said.message == (
        "job chat: its guard starts afresh at duty 0.25 (colocate.peak_duty), not 0.50: that "
        "duty was set beside train on GPU 0, the training beside it now is other on GPU 0"
    )


def test_a_guard_restored_beside_the_same_training_keeps_its_duty(tmp_path: Path) -> None:
    node = Restartable(tmp_path)
    node.alone_then_throttled(node.start())
    saved = json.loads((tmp_path / "colo.json").read_text())["jobs"]["chat"]
    assert saved["guard_company"] == [["GPU 0", "train"]] and saved["guard_breaches"] == 0
    again = node.start()
    again.tick(snapshot())
    assert again.duty("train") == 0.5
    assert not again._events.recent(kind_prefix="colo.guard")


def test_a_service_back_within_the_hour_keeps_its_duty_only_beside_the_same_training(
    tmp_path: Path,
) -> None:
    node = Restartable(tmp_path)
    node.alone_then_throttled(svc := node.start())
    chat = node.jobs.pop()  # the service stops; the training runs on at full duty
    node.clock.t += 60
    svc.tick(snapshot())
    assert svc.duty("train") == 1.0
    node.jobs.append(chat)  # back, beside the same training: its duty at once
    node.clock.t += 60
    svc.tick(snapshot())
    assert svc.duty("train") == 0.5
    node.jobs.pop()
    node.clock.t += 60
    svc.tick(snapshot())
    # back beside another job: what it learned beside "train" says nothing of this pair
    node.jobs[0] = RunningJob("other", "training", 0, memory_bytes=10 * GIB)
    node.jobs.append(chat)
    node.clock.t += 60
    svc.tick(snapshot())
    assert svc.duty("other") == 0.25


def test_a_service_back_on_another_gpu_starts_its_guard_afresh(tmp_path: Path) -> None:
    """The same training, run again on GPU 1, and the service back beside it there: a
    duty learned on GPU 0 is no evidence about GPU 1."""
    node = Restartable(tmp_path)
    node.alone_then_throttled(svc := node.start())
    chat = node.jobs.pop()
    node.jobs[0] = dataclasses.replace(node.jobs[0], gpu=1)
    node.clock.t += 60
    svc.tick(snapshot())
    node.jobs.append(dataclasses.replace(chat, gpu=1))
    node.clock.t += 60
    svc.tick(snapshot())
    assert svc.duty("train") == 0.25
    (said,) = svc._events.recent(kind_prefix="colo.guard")
    assert "set beside train on GPU 0" in said.message and "train on GPU 1" in said.message
    assert said.fields == {"job": "chat", "gpu": 1, "uuid": identity(1).uuid}


def test_a_breach_at_the_floor_counts_across_a_restart(tmp_path: Path) -> None:
    """At the floor and over the SLO once before the restart: once more after it evicts,
    as it would have without the restart."""
    node = Restartable(tmp_path)
    svc = node.start()
    node.jobs.append(RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=8 * GIB))
    for _ in range(60):
        node.clock.t += 1
        svc.report_latency("chat", [0.5] * 30)
        svc.tick(snapshot())
        if svc._guards["chat"].breaches_at_floor:
            break
    assert svc._guards["chat"].breaches_at_floor == 1 and svc.duty("train") == 0.05
    again = node.start()
    node.clock.t += 2
    again.report_latency("chat", [0.5] * 30)
    again.tick(snapshot())
    assert again.throttle_point("train", 1).evict


def test_latencies_from_before_a_new_duty_reaches_training_wait_across_a_restart(
    tmp_path: Path,
) -> None:
    """gpud cut the duty and was killed before the training read it: what the service
    reports until then still shows the old duty, and is not cut for again."""
    node = Restartable(tmp_path)
    node.alone_then_throttled(node.start())  # cut to 0.5 at this instant
    node.clock.t += 0.3
    again = node.start()
    node.clock.t += 0.3
    again.report_latency("chat", [0.095] * 100)  # still at full duty
    again.tick(snapshot())
    assert again.duty("train") == 0.5


def test_an_older_state_file_keeps_its_guards_duty(tmp_path: Path) -> None:
    """Written before a guard's company was kept: taken as the same company."""
    (tmp_path / "colo.json").write_text(
        json.dumps(
            {
                "jobs": {
                    "train": {"duty": 0.25},
                    "chat": {"guard_duty": 0.25, "slo_s": 0.1},
                }
            }
        )
    )
    node = Restartable(tmp_path)
    node.jobs.append(RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=8 * GIB))
    svc = node.start()
    svc.tick(snapshot())
    assert svc.duty("train") == 0.25 and svc.show().guards[0].duty == 0.25


def test_the_predictor_outlives_a_restart_and_predicts_the_same(tmp_path: Path) -> None:
    node = Restartable(tmp_path)
    start, clock, jobs = node.start, node.clock, node.jobs
    node.alone_then_throttled(svc := start())
    for _ in range(6):
        clock.t += 1
        svc.throttle_point("train", 4)
        svc.tick(snapshot())
    learned = svc.predictor.stats().samples
    assert learned >= 3

    again = start()  # killed and restarted: the predictor is what it was
    assert again.predictor is not svc.predictor
    assert again.predictor.to_dict() == svc.predictor.to_dict()
    me = svc._view(jobs[0]).footprint()
    others = [svc._view(jobs[1]).footprint()]
    assert again.predictor.speed(me, others) == svc.predictor.speed(me, others)
    assert again.predictor.speed_bound(me, others) == svc.predictor.speed_bound(me, others)
    assert again.show().predictor_samples == learned
    # the planner predicts with the restored predictor, not a fresh one
    assert again.tick(snapshot()) is not None
    assert again._planner.predictor is again.predictor


def test_an_unreadable_state_file_starts_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "colo.json"
    full = json.dumps({"jobs": {"train": {"duty": 0.5, "alone_rate": 10.0}}})
    for text in (
        "{not json",
        "[1, 2]",
        '{"something": "else"}',
        "",  # created, never written: a host crash before the data reached the disk
        full[: len(full) // 2],  # truncated
        "\0" * 64,
    ):
        state.write_text(text)
        caplog.clear()
        svc = ColoService(
            ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=list, state_file=state
        )
        assert svc.duty("train") == 1.0 and svc.predictor.stats().samples == 0
        (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
        assert str(state) in record.getMessage() and "starting afresh" in record.getMessage()
        # kept for the operator: the loop's next save writes a fresh file in its place
        aside = tmp_path / "colo.json.unreadable"
        assert f"kept as {aside}" in record.getMessage()
        assert aside.read_text() == text and not state.exists()
        assert svc.tick(snapshot()) is not None  # and the loop runs
    # not a file at all
    state.unlink()
    state.mkdir()
    caplog.clear()
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=list, state_file=state
    )
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert str(state) in record.getMessage() and "starting afresh" in record.getMessage()


def test_a_job_entry_not_read_is_skipped_and_the_rest_of_the_state_file_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A job of colo.json with a value out of its range or of another type is logged,
    naming the file and the job's key, and starts afresh; the other job keeps its duty,
    and the file is not set aside. So is an evicted list that is not one of names: no
    eviction is kept, the jobs are."""
    state = tmp_path / "colo.json"
    job = '{"jobs": {"other": {"duty": 0.5}, "train": %s}}'
    for text in (
        '{"jobs": {"other": {"duty": 0.5}, "train": 5}}',
        '{"jobs": {"other": {"duty": 0.5}, "train": {"devices": {"GPU-0": 5}}}}',
        job % '{"duty": NaN}',
        job % '{"duty": 0.5, "alone_rate": -3}',
        job % '{"duty": 0.5, "alone_rate": Infinity}',
        job % '{"duty": "fast"}',
        job % '{"duty": true}',
        job % '{"duty": 7}',
        job % '{"devices": {"GPU-0": {"sm": 2.0, "mem_bw": 0.1}}}',
        job % '{"devices": {"GPU-0": {"sm": -0.5, "mem_bw": 0.1}}}',
        job % '{"devices": {"GPU-0": {"sm": 0.5}}}',
        job % '{"devices": [1, 2]}',
        job % '{"guard_duty": 0.5, "slo_s": -1}',
        job % '{"guard_duty": 1e308, "slo_s": 0.05}',
        job % '{"guard_duty": 0.5, "slo_s": 0.05, "guard_breaches": -1}',
        job % '{"guard_duty": 0.5, "slo_s": 0.05, "guard_breaches": 1.5}',
        job % '{"guard_duty": 0.5, "slo_s": 0.05, "guard_wait_s": 3600}',
        job % '{"guard_duty": 0.5, "slo_s": 0.05, "guard_company": ["GPU 0"]}',
        job % '{"guard_duty": 0.5, "slo_s": 0.05, "guard_company": [["GPU 0", 3]]}',
        job % '{"evict": true}',
        job % '{"alone_rate": 10.0, "alone_config": 100}',
        job % '{"alone_rates": {"half": 8.0}}',
        job % '{"alone_rates": {"1.5": 8.0}}',
        job % '{"alone_rates": [8.0]}',
        '{"jobs": {"other": {"duty": 0.5}}, "evicted": "big"}',
        '{"jobs": {"other": {"duty": 0.5}}, "evicted": [1]}',
    ):
        state.write_text(text)
        caplog.clear()
        svc = ColoService(
            ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=list, state_file=state
        )
        assert svc.duty("train") == 1.0 and "train" not in svc._jobs, text
        assert svc.duty("other") == 0.5, text
        (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
        said = record.getMessage()
        assert str(state) in said and ("jobs.train" in said or "evicted" in said), text
        assert not (tmp_path / "colo.json.unreadable").exists()
        assert svc.tick(snapshot()) is not None
        written = json.loads(state.read_text())  # without what was not read
        assert "train" not in written["jobs"] and written["evicted"] == [], text
        state.unlink()


def test_a_state_file_of_another_version_starts_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """colo.json says its layout: one a later gpud wrote (gpud downgraded) is not read as
    this one's, whose fields may mean other things there, but said and kept aside (one
    without a "jobs" object too: the version is what it says first); a file written
    before the layout was kept reads as this one's, and each save says it."""
    state = tmp_path / "colo.json"
    body = '"jobs": {"train": {"duty": 0.5, "alone_rate": 10.0}}'
    for version, rest in [
        *((v, body) for v in ("2", '"1"', "true", "1.0", "null")),
        *(("2", other) for other in ('"jobs": []', '"services": {}')),
    ]:
        text = f'{{"version": {version}, {rest}}}'
        state.write_text(text)
        caplog.clear()
        svc = ColoService(
            ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=list, state_file=state
        )
        assert svc.duty("train") == 1.0
        (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
        assert (
            f"not read (version {json.loads(version)!r}: this gpud reads version {STATE_FILE_VERSION})"
            in record.getMessage()
        )
        assert (tmp_path / "colo.json.unreadable").read_text() == text
    for text in (f'{{"version": 1, {body}}}', f"{{{body}}}"):
        state.write_text(text)
        svc = ColoService(
            ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=list, state_file=state
        )
        assert svc.duty("train") == 0.5
    svc.tick(snapshot())
    assert json.loads(state.read_text())["version"] == STATE_FILE_VERSION


def test_an_unreadable_state_file_is_an_event(tmp_path: Path) -> None:
    """Evictions and guards forgotten: an event an operator can alert on, as an unreadable
    critical-XID state is (gpu.xid_state_unreadable), not only a log line."""
    state = tmp_path / "colo.json"
    state.write_text("{not json")
    events = EventLog(None)
    ColoService(ColocateConfig(), events, running=list, state_file=state)
    (event,) = events.recent(kind_prefix="colo.")
    assert event.kind == "colo.state_unreadable"
    assert event.fields == {"path": str(state), "kept": str(tmp_path / "colo.json.unreadable")}
    assert event.message.startswith(f"co-location state {state} not read (")
    assert event.message.endswith(f"starting afresh; the file is kept as {event.fields['kept']}")


def test_a_megabyte_key_in_colo_json_is_named_shortened_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hostile colo.json whose keys are a megabyte each (a job with a bad value, a
    waiting run taken out that is not a list, a job no longer registered, a device): each
    error or line naming the key names its start and its length, never the whole key. A
    megabyte key was a megabyte journal line."""
    caplog.set_level(logging.INFO)
    long = "j" * 1_000_000
    state = tmp_path / "colo.json"
    jobs = {
        long + "1": {"alone_rate": -1.0},
        long + "2": {"devices": {long + "d": {"sm": 2.0, "mem_bw": 0.1}}},
        long + "3": {"alone_rate": 4.0},
    }
    left = {long + "4": "x"}
    state.write_text(json.dumps({"version": STATE_FILE_VERSION, "jobs": jobs, "left": left}))
    kept_loop(tmp_path, [], Clock(), registered=dict)
    said = [r.getMessage() for r in caplog.records if "co-location state" in r.getMessage()]
    assert len(said) == 4, [s[:200] for s in said]
    assert all(len(s) < 2000 for s in said), [len(s) for s in said]
    assert all("(1000001 characters)" in s for s in said)


def test_a_megabyte_version_in_colo_json_is_shortened_in_its_event(tmp_path: Path) -> None:
    """A colo.json whose version is a megabyte string: not read, and the
    colo.state_unreadable event (and the error) repeat its start and its length, not the
    megabyte."""
    state = tmp_path / "colo.json"
    state.write_text(json.dumps({"version": "v" * 1_000_000, "jobs": {}}))
    events = EventLog(None)
    ColoService(ColocateConfig(), events, running=list, state_file=state)
    (event,) = events.recent(kind_prefix="colo.")
    assert event.kind == "colo.state_unreadable" and len(event.message) < 2000
    assert "(1000000 characters): this gpud reads version" in event.message


def test_a_bad_value_in_the_state_file_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "colo.json"
    state.write_text('{"jobs": {"train": {"devices": {"GPU-0": {"sm": NaN, "mem_bw": 0.1}}}}}')
    ColoService(ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=list, state_file=state)
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "jobs.train.devices.GPU-0.sm: nan outside [0, 1]" in record.getMessage()


def test_a_state_file_gpud_cannot_write_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    jobs = [RunningJob("train", "training", 0, memory_bytes=10 * GIB)]
    state = tmp_path / "gone" / "colo.json"  # its directory removed under gpud
    svc = ColoService(
        ColocateConfig(),
        EventLog(tmp_path / "e.jsonl"),
        running=lambda: jobs,
        clock=clock,
        state_file=state,
    )
    for i in range(3):
        clock.t += 1
        svc.throttle_point("train", 10 * i)
        assert svc.tick(snapshot()) is not None
    warned = [r for r in caplog.records if "not written" in r.getMessage()]
    assert len(warned) == 1 and str(state) in warned[0].getMessage()
    assert not any(tmp_path.glob("**/*.tmp"))


def test_a_service_with_an_infinite_slo_does_not_stop_the_state_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Registered before SLOs were bounded: no guard, and colo.json still written."""
    clock = Clock()
    state = tmp_path / "colo.json"
    jobs = [
        RunningJob("chat", "inference", 0, slo_p99_ms=math.inf, memory_bytes=8 * GIB),
        RunningJob("train", "training", 0, memory_bytes=10 * GIB),
    ]
    svc = ColoService(
        ColocateConfig(),
        EventLog(tmp_path / "e.jsonl"),
        running=lambda: jobs,
        clock=clock,
        state_file=state,
    )
    for _ in range(3):
        clock.t += 1
        svc.report_latency("chat", [0.5] * 30)
        assert svc.tick(snapshot()) is not None
    assert not svc.show().guards
    assert set(json.loads(state.read_text())["jobs"]) == {"chat", "train"}
    assert not [r for r in caplog.records if "not written" in r.getMessage()]


@pytest.mark.parametrize("latency", [5e-324, 1e-300])
def test_a_service_reporting_vanishing_latencies_does_not_stop_the_state_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, latency: float
) -> None:
    """A client whose timer reads (nearly) nothing: no service rate, and colo.json kept."""
    clock = Clock()
    state = tmp_path / "colo.json"
    jobs = [RunningJob("chat", "inference", 0, memory_bytes=8 * GIB)]
    svc = kept_loop(tmp_path, jobs, clock)
    for _ in range(5):
        clock.t += 1
        svc.report_latency("chat", [latency] * 30)
        assert svc.tick(snapshot()) is not None
    assert svc.service_rate("chat") is None
    assert json.loads(state.read_text())["jobs"]["chat"]["alone_rate"] is None
    assert not [r for r in caplog.records if "not written" in r.getMessage()]


WRITER = """
import sys
from pathlib import Path

from gpud.files import STATE_FILE_MODE, write_atomically

path = Path(sys.argv[1])
print("ready", flush=True)
i = 0
while True:
    i += 1
    write_atomically(path, '{"n": %d, "pad": "%s"}' % (i, "x" * (1 << 20)))
"""


def test_a_kill_while_writing_leaves_the_old_file_or_the_new(tmp_path: Path) -> None:
    """gpud killed with SIGKILL mid-write: colo.json is whole, one version or the next."""
    import random
    import subprocess
    import sys

    state = tmp_path / "colo.json"
    rng = random.Random(7)
    seen = set()
    for _ in range(5):
        with subprocess.Popen(
            [sys.executable, "-c", WRITER, str(state)], stdout=subprocess.PIPE, text=True
        ) as writer:
            try:
                assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
                time.sleep(rng.uniform(0.0, 0.3))
            finally:
                writer.kill()
        if state.exists():
            data = json.loads(state.read_text())  # whole: parses
            assert len(data["pad"]) == 1 << 20
            seen.add(data["n"])
    assert seen  # it wrote, and was killed between or inside writes


def test_an_invalid_predictor_starts_afresh_and_the_jobs_state_is_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "colo.json"
    predictor = InterferencePredictor().to_dict()
    predictor["weights"] = predictor["weights"][:3]  # a model with other features
    state.write_text(json.dumps({"jobs": {"train": {"duty": 0.5}}, "predictor": predictor}))
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=list, state_file=state
    )
    assert svc.duty("train") == 0.5
    assert svc.predictor.to_dict() == InterferencePredictor().to_dict()
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    message = record.getMessage()
    assert str(state) in message and "weights: 3 items, 8 expected" in message


def mm1_latencies(mu: float, load: float, n: int = 100) -> list[float]:
    """``n`` response times of an M/M/1 queue at these rates, as evenly spread quantiles of
    its exponential distribution (rate ``mu - load``): the median is ln 2 / (mu - load)."""
    return [-math.log(1.0 - (i + 0.5) / n) / (mu - load) for i in range(n)]


def test_an_inference_services_observed_speed_from_latency_and_load(tmp_path: Path) -> None:
    from gpud.colo.api import ColoServicer

    clock = Clock()
    jobs = [RunningJob("chat", "inference", 0, slo_p99_ms=500.0, memory_bytes=8 * GIB)]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=clock
    )

    def second(mu: float) -> None:  # a second of 100 requests/s served at rate mu
        clock.t += 1
        svc.report_latency("chat", mm1_latencies(mu, 100.0))
        svc.tick(snapshot())

    for _ in range(5):  # alone it serves 400 requests/s (measured after 2 s to settle)
        second(400.0)
    assert svc.service_rate("chat") == pytest.approx(400.0, rel=1e-3)
    assert svc.show().observed_speed == {}
    # Training joins: the service slows to 320 requests/s; its load is unchanged.
    jobs.append(RunningJob("train", "training", 0, memory_bytes=10 * GIB))
    samples = svc.predictor.stats().samples
    for _ in range(4):
        second(320.0)
    view = svc.show()
    assert view.observed_speed["chat"] == pytest.approx(0.8, rel=1e-3)
    assert view.predictor_samples > samples  # the predictor learned from it
    assert svc.duty("train") == 1.0  # p99 21 ms, far under the SLO: no throttling

    reg = scraped(svc)
    observed = reg.get_sample_value("gpud_colo_observed_speed_ratio", {"job": "chat"})
    assert observed == pytest.approx(0.8, rel=1e-3)
    predicted = reg.get_sample_value("gpud_colo_predicted_speed_ratio", {"job": "chat"})
    assert predicted is not None and 0.0 < predicted <= 1.0
    # what gpuctl colo show (table and --json) prints
    shown = {p.job: p for p in ColoServicer(svc, snapshots=snapshot)._show().placements}
    assert shown["chat"].observed_speed == pytest.approx(0.8, rel=1e-3)
    assert shown["chat"].predicted_speed == pytest.approx(predicted)
    assert not shown["train"].HasField("observed_speed")  # never ran alone


def test_a_services_rate_at_its_share_is_the_measured_one_else_its_shapes(
    tmp_path: Path,
) -> None:
    from colocate.shapes import prior_service_rate

    clock = Clock()
    chat = RunningJob("chat", "inference", 0, slo_p99_ms=500.0, memory_bytes=8 * GIB)
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: [chat], clock=clock
    )
    # nothing reported yet: the prior of a 500 ms SLO on a whole GPU
    assert svc.rate_at_share(chat) == pytest.approx(prior_service_rate(0.5))
    for _ in range(3):
        clock.t += 1
        svc.report_latency("chat", mm1_latencies(400.0, 100.0))
    assert svc.rate_at_share(chat) == pytest.approx(400.0, rel=1e-3)  # what it shows


def chat_measured_alone_beside_training(tmp_path: Path) -> tuple[ColoService, Clock]:
    """A service of a 100 ms SLO that served 400 requests/s alone, on GPU 0 with training
    (not yet ticked)."""
    from gpud.colo.service import _JobState

    clock = Clock()
    jobs = [
        RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=8 * GIB),
        RunningJob("train", "training", 0, memory_bytes=10 * GIB),
    ]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=clock
    )
    svc._jobs["chat"] = _JobState(alone_rate=400.0)  # as measured alone before
    return svc, clock


def test_a_service_measures_its_speed_at_the_duty_its_guard_set(tmp_path: Path) -> None:
    svc, clock = chat_measured_alone_beside_training(tmp_path)
    svc.tick(snapshot())  # the company is new: measuring starts once it settled (2 s)
    clock.t += 1
    svc.report_latency("chat", [0.095] * 100)  # near the SLO, next to training at full duty
    svc.tick(snapshot())
    assert svc.duty("train") == 0.5  # the guard halved the training's duty
    assert "chat" not in svc.show().observed_speed
    clock.t += 1  # requests until the cut reached the training (1 s): no speed from them
    svc.report_latency("chat", mm1_latencies(360.0, 100.0))
    svc.tick(snapshot())
    assert "chat" not in svc.show().observed_speed
    clock.t += 1
    svc.report_latency("chat", mm1_latencies(360.0, 100.0))
    svc.tick(snapshot())
    assert svc.show().observed_speed["chat"] == pytest.approx(360.0 / 400.0, rel=1e-3)


def jobless_loop(tmp_path: Path, clock: Clock) -> ColoService:
    """A loop with a 10 s latency window that sees no job running: for reports alone."""
    return ColoService(
        ColocateConfig(latency_window_s=10.0),
        EventLog(tmp_path / "e.jsonl"),
        running=lambda: [],
        clock=clock,
    )


@pytest.mark.parametrize("phase", [0.0, 0.5])
def test_load_is_the_request_rate_whatever_the_window_holds(tmp_path: Path, phase: float) -> None:
    """Reports come once a second (gpud.client flushes each second); a 10 s window then
    holds eleven or ten of them depending on the tick's phase, and a busy service's reports
    fill the per-job buffer (4096) long before the window ends. The load is the rate all
    the same, from the second report on."""
    clock = Clock()
    svc = jobless_loop(tmp_path, clock)
    seen: dict[int, list[float]] = {100: [], 1000: []}
    for second in range(1, 31):
        clock.t = 100.0 + second
        svc.report_latency("steady", [0.01] * 100)  # 100 requests/s
        svc.report_latency("busy", [0.01] * 1000)  # 1000 requests/s: 4 s fill the buffer
        clock.t += phase
        if second >= 2:  # started less than a window ago, and long after
            seen[100].append(svc.load("steady"))
            seen[1000].append(svc.load("busy"))
    assert seen[100] == pytest.approx([100.0] * 29)
    assert seen[1000] == pytest.approx([1000.0] * 29)
    # one report so far: it stands for the second before it
    svc.report_latency("new", [0.01] * 50)
    assert svc.load("new") == pytest.approx(50.0)
    # reports stopped: the load falls as the silence grows, and is 0 once the window passed
    clock.t += 5.0
    assert 0.0 < svc.load("steady") < 100.0
    clock.t += 10.0
    assert svc.load("steady") == 0.0


def test_the_load_of_a_service_busier_than_the_latency_buffer_is_its_request_rate(
    tmp_path: Path,
) -> None:
    """A service serving 10 000 requests a second sends more latencies each second than the
    per-job buffer keeps (4096; gpud.client flushes every 4096): its load is still the
    requests it served per second, not what the buffer still holds of them."""
    clock = Clock()
    svc = jobless_loop(tmp_path, clock)
    seen = []
    for second in range(1, 21):
        for part, n in enumerate((4096, 4096, 1808)):
            clock.t = 100.0 + second + part * 0.4
            svc.report_latency("busy", [0.001] * n)
        if second >= 3:
            seen.append(svc.load("busy"))
    assert seen == pytest.approx([10_000.0] * 18, rel=0.1)


def test_a_service_is_planned_with_the_footprint_it_showed_at_that_load(tmp_path: Path) -> None:
    """What a service shows alone already reflects the load it had; the planner scales a
    service's features by its utilization of now, so the loop keeps them at full load: at
    the load it was measured at it is planned with what it showed, at twice that load with
    twice as much."""
    clock = Clock()
    jobs = [
        RunningJob(
            "chat",
            "inference",
            0,
            slo_p99_ms=500.0,
            memory_bytes=8 * GIB,
            memory_used=8 * GIB,
            peak_load=100,
        )
    ]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=clock
    )
    for _ in range(12):  # 80 requests/s: about half the rate it is taken to serve
        clock.t += 1
        svc.report_latency("chat", [0.01] * 80)
        svc.tick(snapshot())  # alone on GPU 0: SMs 0.3, memory controller 0.2 busy
    view = svc._view(jobs[0])
    rho = view.activity()
    assert 0.45 < rho < 0.55
    assert view.features.sm == pytest.approx(0.3 / rho)  # kept at full load
    measured = view.footprint()
    assert (measured.sm, measured.mem_bw) == pytest.approx((0.3, 0.2))
    assert measured.pcie == pytest.approx(0.02, rel=1e-3)
    doubled = dataclasses.replace(view, load=2 * view.load).footprint()
    assert (doubled.sm, doubled.mem_bw) == pytest.approx((0.6, 0.4))


def busy_snapshot(util: dict[int, tuple[float, float]]) -> Snapshot:
    """GPUs whose SMs and memory controllers are busy as given, by index."""
    base = snapshot(len(util))
    return dataclasses.replace(
        base,
        gpus=tuple(g._replace(utilization=Utilization(*util[g.identity.index])) for g in base.gpus),
    )


def test_a_training_job_on_two_gpus_next_to_a_service_on_one(tmp_path: Path) -> None:
    """A training job holds GPUs 0 and 1 and shows another footprint on each; a service
    joins it on GPU 0. The planner sees the job on each GPU with that GPU's footprint; the
    guard on GPU 0 holds the whole job at its duty; the job's one rate, over the rate it had
    alone on both, is its observed speed, which the predictor learns with its footprint
    and company on GPU 0; what it shows on GPU 1 meanwhile is not taken for its footprint;
    and the footprints per GPU outlive a restart."""
    clock = Clock()
    jobs = [
        RunningJob(
            "train", "training", g, memory_bytes=10 * GIB, memory_used=10 * GIB, device=f"GPU-{g}"
        )
        for g in (0, 1)
    ]

    def start() -> ColoService:
        return kept_loop(tmp_path, jobs, clock)

    svc = start()
    snap = busy_snapshot({0: (0.3, 0.2), 1: (0.5, 0.4)})
    for _ in range(5):  # alone on both: 10 iterations a second
        svc.throttle_point("train", 10)
        svc.tick(snap)
        clock.t += 1
    footprints = {r.gpu: svc._view(r).footprint() for r in jobs}
    assert (footprints[0].sm, footprints[0].mem_bw) == (0.3, 0.2)
    assert (footprints[1].sm, footprints[1].mem_bw) == (0.5, 0.4)
    assert svc._jobs["train"].alone_rate == pytest.approx(10.0)

    seen: list[tuple[JobFeatures, list[JobFeatures], float]] = []
    learn = svc.predictor.observe

    def observe(me: JobFeatures, others: list[JobFeatures], speed: float) -> None:
        seen.append((me, list(others), speed))
        learn(me, others, speed)

    svc.predictor.observe = observe  # type: ignore[method-assign]
    jobs.append(
        RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=8 * GIB, device="GPU-0")
    )
    svc.report_latency("chat", [0.09] * 100)  # p99 within the margin: throttle
    svc.tick(snap)
    assert svc.duty("train") == 0.5  # the job runs at one pace: GPU 0's guard sets it
    for _ in range(4):  # 4 iterations a second at duty 0.5: 8 per second of running time
        clock.t += 1
        svc.throttle_point("train", 4)
        svc.tick(snap)
    assert svc.show().observed_speed["train"] == pytest.approx(0.8)
    assert seen
    for me, others, speed in seen:
        assert (me.sm, me.mem_bw) == pytest.approx((0.15, 0.1))  # GPU 0's, at duty 0.5
        assert len(others) == 1 and speed == pytest.approx(0.8)
    assert svc._features(jobs[1]).sm == 0.5  # GPU 1 alone, but at GPU 0's pace: not learned
    assert svc._jobs["train"].alone_rate == pytest.approx(10.0)

    again = start()  # the daemon restarts: the footprints per GPU are kept
    assert [again._features(r).sm for r in jobs[:2]] == [0.3, 0.5]


def test_a_footprint_kept_per_job_before_serves_each_of_its_gpus(tmp_path: Path) -> None:
    state = tmp_path / "colo.json"
    state.write_text(json.dumps({"jobs": {"train": {"sm": 0.4, "mem_bw": 0.3, "pcie": 0.1}}}))
    jobs = [RunningJob("train", "training", g, device=f"GPU-{g}") for g in (0, 1)]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, state_file=state
    )
    assert [(svc._features(r).sm, svc._features(r).pcie) for r in jobs] == [(0.4, 0.1)] * 2


def test_the_kind_and_share_a_footprint_was_shown_at_outlive_a_restart(tmp_path: Path) -> None:
    """colo.json keeps the kind a job ran as and the MPS share each footprint was shown
    at: after a restart a footprint shown at 30% is still not advised as a whole GPU's, nor
    training's as a service's; a run of the name as a service learns afresh."""
    clock = Clock()
    jobs = [
        RunningJob("sweep", "training", 0, threads_percent=30, memory_bytes=10 * GIB),
        RunningJob("whole", "training", 1, memory_bytes=10 * GIB, memory_used=GIB),
    ]
    jobs[0] = dataclasses.replace(jobs[0], memory_used=GIB)
    svc = kept_loop(tmp_path, jobs, clock)
    for _ in range(6):
        svc.tick(snapshot())
        clock.t += 1
    saved = json.loads((tmp_path / "colo.json").read_text())["jobs"]
    assert saved["sweep"]["kind"] == "training"
    assert saved["sweep"]["devices"]["GPU 0"]["share"] == 0.3
    again = kept_loop(tmp_path, jobs, clock)
    assert again._jobs["sweep"].alone("training") is None  # not a whole GPU's
    assert again._jobs["whole"].alone("training") is not None
    assert again._jobs["whole"].alone("inference") is None
    jobs[1] = dataclasses.replace(jobs[1], kind="inference", slo_p99_ms=100.0)  # another run
    again.tick(snapshot())
    assert again._jobs["whole"].kind == "inference"
    assert again._jobs["whole"].learned("GPU 1") is None


def test_a_service_on_two_gpus_is_guarded_once_a_tick_on_both(tmp_path: Path) -> None:
    clock = Clock()
    jobs = [
        *(RunningJob("chat", "inference", g, slo_p99_ms=100.0, device=f"GPU-{g}") for g in (0, 1)),
        RunningJob("a", "training", 0, memory_bytes=10 * GIB, device="GPU-0"),
        RunningJob("b", "training", 1, memory_bytes=10 * GIB, device="GPU-1"),
    ]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=clock
    )
    svc.report_latency("chat", [0.09] * 100)  # p99 within the margin: one cut
    svc.tick(snapshot())
    assert (svc.duty("a"), svc.duty("b")) == (0.5, 0.5)
    assert svc.show().guards[0].duty == 0.5


def test_processes_of_no_job_keep_their_memory_and_their_gpu_is_not_free(
    tmp_path: Path,
) -> None:
    """GPU 0 holds 40 GiB of another user's process, GPU 1 nothing: a new job goes to GPU
    1; with GPU 1 taken too, it goes beside the stranger (predicted slower), and one that
    would not fit beside its memory waits."""
    strangers = {0: 1}
    running: list[RunningJob] = []
    svc = ColoService(
        ColocateConfig(),
        EventLog(tmp_path / "e.jsonl"),
        running=lambda: running,
        strangers=lambda: strangers,
        clock=Clock(),
    )
    snap = snapshot(2, used_gib=0)
    busy = snap.gpus[0]._replace(memory=MemoryInfo(80 * GIB, 40 * GIB, 40 * GIB))
    snap = Snapshot(0.0, 0.0, (busy, snap.gpus[1]), 0.01)
    first = svc.advise("a", memory_bytes=20 * GIB, snapshot=snap)
    assert first.gpu == 1 and "free" in first.reason
    strangers[1] = 2
    beside = svc.advise("a", memory_bytes=20 * GIB, snapshot=snap)
    assert beside.predicted_speed < 1.0 and "does not know" in beside.reason
    big = svc.advise("b", memory_bytes=60 * GIB, snapshot=snap)
    assert big.gpu == 1  # GPU 0's stranger holds 40 GiB of its 80
    strangers[1] = 0
    running.append(RunningJob("c", "training", 1, memory_bytes=60 * GIB, memory_used=60 * GIB))
    snap = Snapshot(
        0.0,
        0.0,
        (busy, snap.gpus[1]._replace(memory=MemoryInfo(80 * GIB, 60 * GIB, 20 * GIB))),
        0.01,
    )
    waits = svc.advise("b", memory_bytes=60 * GIB, snapshot=snap)
    assert waits.gpu == -1 and "GPU 0: memory" in waits.reason


def test_a_service_on_two_gpus_shows_its_guard_where_the_training_is(tmp_path: Path) -> None:
    running = [
        RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=20 * GIB),
        RunningJob("chat", "inference", 1, slo_p99_ms=100.0, memory_bytes=20 * GIB),
        RunningJob("train", "training", 1, threads_percent=50, memory_bytes=10 * GIB),
    ]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: running, clock=Clock()
    )
    svc.report_latency("chat", [0.05] * 100)
    svc.tick(snapshot())
    (guard,) = svc.show().guards
    assert guard.job == "chat" and guard.gpu == 1


def test_after_a_restart_the_job_reserved_last_came_last(tmp_path: Path) -> None:
    """A new loop sees every running job at once: their reservations give the order."""
    clock = Clock()
    jobs = [
        RunningJob(
            "a-later", "training", 0, memory_bytes=10 * GIB, memory_used=49 * GIB, reserved_at=200.0
        ),
        RunningJob(
            "z-first", "training", 0, memory_bytes=10 * GIB, memory_used=30 * GIB, reserved_at=100.0
        ),
    ]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "events.jsonl"), running=lambda: jobs, clock=clock
    )
    svc.tick(snapshot(used_gib=79))
    assert svc.throttle_point("a-later", 1).evict
    assert not svc.throttle_point("z-first", 1).evict


def test_the_predictor_ages_with_the_loop_and_not_while_gpud_is_down(tmp_path: Path) -> None:
    clock = Clock()
    jobs = [RunningJob("train", "training", 0, memory_bytes=10 * GIB, memory_used=10 * GIB)]

    svc = kept_loop(tmp_path, jobs, clock)
    written = []
    for _ in range(20):
        svc.tick(snapshot())
        written.append(json.loads((tmp_path / "colo.json").read_text())["predictor"]["clock_s"])
        clock.t += 5
    assert svc.predictor.to_dict()["clock_s"] == 95.0
    # The clock alone moving on is written once a minute, not every tick.
    assert len(set(written)) <= 3 and written[-1] == 65.0
    clock.t += 3600  # gpud is down for an hour; a new one starts from the file
    later = kept_loop(tmp_path, jobs, clock)
    later.tick(snapshot())
    clock.t += 5
    later.tick(snapshot())
    assert later.predictor.to_dict()["clock_s"] == 70.0
    # Nor while the loop is disabled (a reload with [colocate] enabled = false).
    later.configure(ColocateConfig(enabled=False))
    for _ in range(10):
        clock.t += 60
        assert later.tick(snapshot()) is None
    later.configure(ColocateConfig())
    later.tick(snapshot())
    clock.t += 5
    later.tick(snapshot())
    assert later.predictor.to_dict()["clock_s"] == 75.0


def test_the_scant_margin_memory_is_the_configured_one_also_after_a_restart(
    tmp_path: Path,
) -> None:
    jobs = [RunningJob("train", "training", 0, memory_bytes=10 * GIB)]
    svc = kept_loop(tmp_path, jobs, Clock())
    assert svc.predictor.scant_memory_s == 900.0  # the default
    svc.configure(ColocateConfig(scant_margin_memory_s=600.0))  # a reload
    assert svc.predictor.scant_memory_s == 600.0
    svc.tick(snapshot())
    again = ColoService(
        ColocateConfig(scant_margin_memory_s=900.0),
        EventLog(tmp_path / "e.jsonl"),
        running=lambda: jobs,
        state_file=tmp_path / "colo.json",
    )
    assert again.predictor.scant_memory_s == 900.0


def beside_30gib_on_gpu0(tmp_path: Path, defaults: dict[int, int]) -> tuple[ColoService, Snapshot]:
    """A loop (ticked once) with job ``a`` holding 30 GiB on GPU 0, whose GPUs have the MPS
    default memory limits ``defaults`` holds when asked (per GPU index)."""
    jobs = [RunningJob("a", "training", 0, memory_bytes=30 * GIB, memory_used=30 * GIB)]
    svc = ColoService(
        ColocateConfig(),
        EventLog(tmp_path / "e.jsonl"),
        running=lambda: jobs,
        clock=Clock(),
        default_memory=lambda: defaults,
    )
    snap = snapshot(used_gib=30)
    svc.tick(snap)
    return svc, snap


def test_advice_for_a_run_without_memory_plans_each_gpus_mps_default(tmp_path: Path) -> None:
    """``gpuctl mps set --gpu 1 --memory 60GiB``: a run that sets no --memory is pinned to
    60 GiB there and reserved at it, so advice plans it at 60 GiB on GPU 1, where 30 GiB
    are in use, not at the 8 GiB it assumes where a GPU has no default."""
    defaults: dict[int, int] = {1: 60 * GIB}
    svc, snap = beside_30gib_on_gpu0(tmp_path, defaults)
    refused = svc.advise("new", snapshot=snap)
    assert refused.gpu == -1, refused
    # a run that sets its memory is planned at it, defaults or not
    assert svc.advise("new", memory_bytes=8 * GIB, snapshot=snap).gpu == 1
    defaults.clear()
    assert svc.advise("new", snapshot=snap).gpu == 1


def test_advice_names_the_memory_limit_the_runs_mps_client_gets(tmp_path: Path) -> None:
    """Advice's memory limit is what the run's MPS client is pinned to, as `gpuctl mps show`
    has it: its --memory, else the GPU's MPS default, else none; not the plan's size with
    its growth margin (46GiB for a 40GiB default)."""
    defaults: dict[int, int] = {1: 40 * GIB}
    svc, snap = beside_30gib_on_gpu0(tmp_path, defaults)
    advice = svc.advise("new", snapshot=snap)
    assert advice.gpu == 1 and advice.memory_limit_bytes == 40 * GIB
    assert svc.advise("new", memory_bytes=20 * GIB, snapshot=snap).memory_limit_bytes == 20 * GIB
    defaults.clear()
    assert svc.advise("new", snapshot=snap).memory_limit_bytes == 0  # none: not pinned


def test_advice_reads_the_mps_defaults_outside_the_loops_lock(tmp_path: Path) -> None:
    """The defaults come from the state store, whose lock a job removal holds while it
    calls the loop's removal hook (which takes the loop's lock): read under the loop's
    lock, an advice and a removal at once would wait on each other for good."""
    import threading

    free: list[bool] = []

    def take() -> None:
        free.append(svc._lock.acquire(timeout=0.5))
        if free[-1]:
            svc._lock.release()

    def defaults() -> dict[int, int]:
        taker = threading.Thread(target=take)
        taker.start()
        taker.join()
        return {1: 60 * GIB}

    svc = ColoService(
        ColocateConfig(),
        EventLog(tmp_path / "e.jsonl"),
        running=lambda: [],
        clock=Clock(),
        default_memory=defaults,
    )
    snap = snapshot(used_gib=30)
    svc.tick(snap)
    svc.advise("new", snapshot=snap)
    assert free == [True]


def test_advice_keeps_a_run_off_a_gpu_whose_mps_server_serves_another_user(
    tmp_path: Path,
) -> None:
    """An MPS control daemon serves one user at a time: a run of user 1001 is not advised
    GPU 0, where a job of user 1000 runs (the jobs service would refuse it there), but at
    once GPU 1, which only its own user's jobs share; a run of user 1000, or of no known
    user, may still go to GPU 0. A GPU every user's job is barred from makes the run wait,
    saying whose server it is."""
    slo = {"slo_p99_ms": 100.0, "memory_bytes": 10 * GIB}
    jobs = [
        RunningJob("a", "inference", 0, uid=1000, **slo),  # type: ignore[arg-type]
        RunningJob("b", "inference", 1, uid=1001, **slo),  # type: ignore[arg-type]
    ]
    names = {1000: "alice", 1001: "bob"}
    svc = ColoService(
        ColocateConfig(),
        EventLog(tmp_path / "e.jsonl"),
        running=lambda: jobs,
        clock=Clock(),
        name_of=lambda uid: names.get(uid, str(uid)),
    )
    snap = snapshot(used_gib=10)
    svc.tick(snap)
    ask = {"memory_bytes": 8 * GIB, "snapshot": snap}
    assert svc.advise("anyone", **ask).gpu == 0  # type: ignore[arg-type]
    assert svc.advise("alice-2", uid=1000, **ask).gpu == 0  # type: ignore[arg-type]
    bob = svc.advise("bob-2", uid=1001, **ask)  # type: ignore[arg-type]
    assert (bob.gpu, bob.device) == (1, identity(1).uuid)
    jobs[1] = dataclasses.replace(jobs[1], uid=1000)  # both GPUs serve alice now
    bob = svc.advise("bob-2", uid=1001, waiting=True, **ask)  # type: ignore[arg-type]
    assert bob.gpu == -1
    assert bob.reason == (
        "GPU 0: shared under MPS by jobs of user alice (a), and an MPS control daemon serves"
        " one user at a time; GPU 1: shared under MPS by jobs of user alice (b), and an MPS"
        " control daemon serves one user at a time"
    )
    assert svc.show().refused == {(1, "user"): 2}


def test_two_waiting_runs_of_different_users_are_not_both_advised_one_gpu(
    tmp_path: Path,
) -> None:
    """Two `gpuctl run`s of different users wait while GPU 0 is full; it frees, and the
    next question plans both in one pass: the first to come is advised GPU 0, and the
    other, planned after it, waits, naming the first's user, rather than being advised
    the same GPU's MPS server (whose other user's client would hang there)."""
    names = {1000: "alice", 1001: "bob"}
    jobs = [RunningJob("big", "training", 0, memory_bytes=70 * GIB, memory_used=70 * GIB)]
    clock = Clock()
    svc = ColoService(
        ColocateConfig(),
        EventLog(tmp_path / "e.jsonl"),
        running=lambda: jobs,
        clock=clock,
        name_of=lambda uid: names.get(uid, str(uid)),
    )
    full = snapshot(n=1, used_gib=70)
    svc.tick(full)
    ask = {"memory_bytes": 8 * GIB, "sm_activity": 0.1, "waiting": True}
    assert svc.advise("a", uid=1000, snapshot=full, **ask).gpu == -1  # type: ignore[arg-type]
    clock.t += 1
    b = svc.advise("b", uid=1001, snapshot=full, **ask)  # type: ignore[arg-type]
    assert b.gpu == -1
    jobs.clear()  # big ended: GPU 0 is free, and could hold both
    free = snapshot(n=1, used_gib=1)
    clock.t += 2 * ADVICE_REUSE_S
    svc.tick(free)
    again = svc.advise("b", uid=1001, snapshot=free, waiter_id=b.waiter_id, **ask)  # type: ignore[arg-type]
    assert again.gpu == -1
    assert "GPU 0: shared under MPS by jobs of user alice (a)" in again.reason
    assert svc.advise("a", uid=1000, snapshot=free, **ask).gpu == 0  # type: ignore[arg-type]


def alice_on_gpu_0(
    tmp_path: Path, clock: Clock, name_of: Callable[[int], str], *, ticked: bool = True
) -> ColoService:
    """A loop on one GPU where user 1000's inference service "a" runs under MPS; ticked:
    it has seen that GPU (``snapshot(n=1, used_gib=10)``)."""
    slo = {"slo_p99_ms": 100.0, "memory_bytes": 10 * GIB}
    jobs = [RunningJob("a", "inference", 0, uid=1000, **slo)]  # type: ignore[arg-type]
    svc = ColoService(
        ColocateConfig(),
        EventLog(tmp_path / "e.jsonl"),
        running=lambda: jobs,
        clock=clock,
        name_of=name_of,
    )
    if ticked:
        svc.tick(snapshot(n=1, used_gib=10))
    return svc


def test_user_names_are_looked_up_outside_the_loops_lock(tmp_path: Path) -> None:
    """A question names the users of the GPUs it may not share: their names are looked
    up (pwd, maybe LDAP behind it) with the loop's lock free, so a slow user database
    holds back no tick, show or other question meanwhile."""
    import threading

    free: list[bool] = []

    def slow_name(uid: int) -> str:
        def take() -> None:
            free.append(svc._lock.acquire(timeout=0.5))
            if free[-1]:
                svc._lock.release()

        taker = threading.Thread(target=take)  # another thread: the lock is re-entrant
        taker.start()
        taker.join()
        return {1000: "alice"}.get(uid, str(uid))

    svc = alice_on_gpu_0(tmp_path, Clock(), slow_name)
    snap = snapshot(n=1, used_gib=10)
    bob = svc.advise("b", uid=1001, memory_bytes=8 * GIB, snapshot=snap)
    assert bob.gpu == -1 and "user alice (a)" in bob.reason
    assert free and all(free)


def test_user_names_are_looked_up_once_a_minute_and_not_without_telemetry(
    tmp_path: Path,
) -> None:
    """Every waiting run asks every few seconds, and each question names the users of
    every whole GPU's MPS server: a UID's name is looked up once, and again after
    NAME_TTL_S (a user renamed); a question answered "no telemetry yet" looks up none."""
    asked: list[int] = []

    def name_of(uid: int) -> str:
        asked.append(uid)
        return {1000: "alice"}.get(uid, str(uid))

    clock = Clock()
    svc = alice_on_gpu_0(tmp_path, clock, name_of, ticked=False)
    ask = {"memory_bytes": 8 * GIB, "uid": 1001, "waiting": True}
    assert svc.advise("b", snapshot=None, **ask).reason == "no telemetry yet"  # type: ignore[arg-type]
    assert asked == []
    snap = snapshot(n=1, used_gib=10)
    svc.tick(snap)
    for _ in range(5):
        clock.t += 5
        bob = svc.advise("b", snapshot=snap, **ask)  # type: ignore[arg-type]
        assert bob.gpu == -1 and "user alice (a)" in bob.reason
    assert sorted(asked) == [1000, 1001]
    clock.t += NAME_TTL_S
    svc.advise("b", snapshot=snap, **ask)  # type: ignore[arg-type]
    assert sorted(asked) == [1000, 1000, 1001, 1001]


def test_gpuctl_colo_advise_answers_for_the_callers_user(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpuctl colo advise` asks as a `gpuctl run` from the same shell would: with its PID,
    which gpud turns into its user; the GPU another user's MPS server holds is not advised."""
    import json
    import os

    from gpud.api import ApiServer
    from gpud.cli.main import main
    from gpud.colo.api import ColoServicer
    from tests.unit.api_support import ServerThread, short_dir

    slo = {"slo_p99_ms": 100.0, "memory_bytes": 10 * GIB}
    jobs = [
        RunningJob("a", "inference", 0, uid=1000, **slo),  # type: ignore[arg-type]
        RunningJob("b", "inference", 1, uid=1001, **slo),  # type: ignore[arg-type]
    ]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=Clock()
    )
    snap = snapshot(used_gib=10)
    svc.tick(snap)
    asked: list[tuple[int | None, int | None]] = []

    def run_uid(pid: int | None, namespace: int | None) -> int | None:
        asked.append((pid, namespace))
        return None if pid is None else 1001  # injected: the caller is user 1001

    with short_dir() as d:
        path = d / "gpud.sock"
        servicer = ColoServicer(svc, snapshots=lambda: snap, run_uid=run_uid)
        with ServerThread(ApiServer(path, servicers=[servicer.register])):
            assert main(["--socket", str(path), "--json", "colo", "advise", "new"], env={}) == 0
    assert json.loads(capsys.readouterr().out)["gpu"] == 1
    assert [pid for pid, _ in asked] == [os.getpid()]


def test_a_waiting_run_is_listed_with_its_user(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `gpuctl run` waiting for co-location is listed with its user where its question
    named the holder's PID (`gpuctl colo show`, its --json, `gpuctl queue`'s USER column);
    a waiter asking without one is listed with none."""
    from gpud.api import ApiServer
    from gpud.cli.main import main
    from gpud.cli.queue import waiter_row
    from gpud.colo.api import ColoServicer
    from gpud.jobs.placement import user_name
    from gpud.v1 import colo_pb2
    from tests.unit.api_support import ServerThread, short_dir

    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: [], clock=Clock()
    )
    snap = snapshot()
    svc.tick(snap)
    big = {"memory_bytes": 70 * GIB, "snapshot": snap, "waiting": True}
    assert svc.advise("big", uid=1001, **big).gpu == -1  # type: ignore[arg-type]
    assert svc.advise("anon", **big).gpu == -1  # type: ignore[arg-type]
    with short_dir() as d:
        path = d / "gpud.sock"
        servicer = ColoServicer(svc, snapshots=lambda: snap, run_uid=lambda pid, ns: None)
        with ServerThread(ApiServer(path, servicers=[servicer.register])):
            assert main(["--socket", str(path), "colo", "show"], env={}) == 0
            text = capsys.readouterr().out
            assert main(["--socket", str(path), "--json", "colo", "show"], env={}) == 0
            doc = json.loads(capsys.readouterr().out)
    name = user_name(1001)
    assert f"waiting for a GPU (gpuctl run): big for 0 ms (user {name}): " in text
    assert "waiting for a GPU (gpuctl run): anon for 0 ms: " in text
    waiting = {w["job"]: w for w in doc["waiting"]}
    assert (waiting["big"]["holder_uid"], waiting["big"]["holder_user"]) == (1001, name)
    assert waiting["anon"]["holder_uid"] is None
    shown = colo_pb2.ColoWaiter(job="big", id="0123456789ab", holder_uid=1001, holder_user=name)
    assert waiter_row(shown)[3] == name
    assert waiter_row(colo_pb2.ColoWaiter(job="anon"))[3] == "-"


def alone_at(
    tmp_path: Path,
    readings: list[tuple[int, float]],
    *,
    config: ColocateConfig | None = None,
    step_s: float = 1.0,
    loop: type[ColoService] = ColoService,
    **job: Any,
) -> tuple[ColoService, RunningJob]:
    """A ``loop`` after "sweep" ran alone on GPU 0 a tick per (its MPS thread percentage,
    its SMs busy) of ``readings``, ``step_s`` apart; ``job``: more of how it ran."""
    clock = Clock()
    base = RunningJob(
        "sweep", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB, reserved_at=1.0
    )
    base = dataclasses.replace(base, **job)
    jobs = [base]
    svc = loop(
        config or ColocateConfig(),
        EventLog(tmp_path / "e.jsonl"),
        running=lambda: jobs,
        clock=clock,
        wall=clock,
        state_file=tmp_path / "colo.json",
    )
    for percent, sm in readings:
        jobs[:] = [dataclasses.replace(base, threads_percent=percent)]
        svc.throttle_point("sweep", 10)
        clock.t += 0.05  # progress made just before each tick: its rate is measured
        svc.throttle_point("sweep", 10)
        svc.tick(busy_snapshot({0: (sm, sm * 2 / 3)}))
        clock.t += step_s - 0.05
    return svc, jobs[0]


def test_a_job_alone_at_a_partial_share_is_planned_with_what_it_showed(tmp_path: Path) -> None:
    """Training alone at a 30% MPS share with its SMs 0.3 busy is planned by the loop at
    that footprint (its knee: what it showed), not at a fraction of it."""
    svc, r = alone_at(tmp_path, [(30, 0.3)] * 7)
    assert svc._view(r).footprint().sm == pytest.approx(0.3, abs=0.01)


def test_a_run_at_a_partial_share_keeps_the_whole_gpus_footprint(tmp_path: Path) -> None:
    """A job alone on a whole GPU (SMs 0.5), then at a 30% share beside no one (SMs 0.3):
    the loop plans the running one at 0.3, advice a new run with 0.5, and both outlive a
    restart."""
    svc, r = alone_at(tmp_path, [(100, 0.5)] * 7 + [(30, 0.3)] * 7)
    whole = svc._jobs["sweep"].alone("training")
    assert whole is not None and whole.sm == pytest.approx(0.5)
    assert svc._view(r).footprint().sm == pytest.approx(0.3, abs=0.01)
    saved = json.loads((tmp_path / "colo.json").read_text())["jobs"]["sweep"]["devices"]
    assert saved["GPU 0"]["share"] == 0.3 and saved["GPU 0"]["whole"]["sm"] == pytest.approx(0.5)
    again = kept_loop(tmp_path, [r], Clock())
    whole = again._jobs["sweep"].alone("training")
    assert whole is not None and whole.sm == pytest.approx(0.5)
    assert again._view(r).footprint().sm == pytest.approx(0.3, abs=0.01)


def test_a_footprint_weighs_each_reading_by_the_time_it_stands_for(tmp_path: Path) -> None:
    """The first readings (a warm-up: SMs 0.05, four of them learned once its rate is
    measured) count no more than those after them (0.9): the footprint is their mean while
    they are few; later a reading moves it by the time it stands for, not by a fixed step a
    tick."""
    svc, _ = alone_at(tmp_path / "a", [(100, 0.05)] * 7 + [(100, 0.9)] * 7)
    assert svc._jobs["sweep"].learned("GPU 0").sm == pytest.approx((4 * 0.05 + 7 * 0.9) / 11)
    # ticks a minute apart: a new reading weighs 1 - exp(-60/50) of it
    minute = ColocateConfig(tick_s=60.0)
    svc, _ = alone_at(tmp_path / "b", [(100, 0.3)] * 20 + [(100, 0.9)], config=minute, step_s=60.0)
    assert svc._jobs["sweep"].learned("GPU 0").sm == pytest.approx(
        0.3 + 0.6 * (1 - math.exp(-60 / 50))
    )
    # ticks a tenth of a second apart: it hardly moves
    fast = ColocateConfig(tick_s=0.1)
    svc, _ = alone_at(tmp_path / "c", [(100, 0.3)] * 400 + [(100, 0.9)], config=fast, step_s=0.1)
    assert svc._jobs["sweep"].learned("GPU 0").sm == pytest.approx(0.3, abs=0.005)


def test_a_removed_job_is_not_learned_again_from_its_last_reports(tmp_path: Path) -> None:
    """`gpuctl jobs rm` commits while a tick's list of reservations still holds the job,
    and its processes, stopping, still report: nothing of it is kept; a run of the job
    added again (reserved after the removal) is learned afresh."""
    clock = Clock()
    old = RunningJob("sweep", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB)
    old = dataclasses.replace(old, reserved_at=clock.t)
    jobs = [old]
    svc, removing = removing_loop(tmp_path, jobs, clock)
    for _ in range(6):
        svc.throttle_point("sweep", 10)
        svc.tick(busy_snapshot({0: (0.3, 0.2)}))
        clock.t += 1
    removing.append("sweep")
    clock.t += 1
    svc.tick(busy_snapshot({0: (0.3, 0.2)}))  # its list still holds the job
    assert svc.throttle_point("sweep", 10).duty == 1.0
    svc.report_latency("sweep", [0.01])
    assert "sweep" not in svc._jobs
    assert "sweep" not in json.loads((tmp_path / "colo.json").read_text())["jobs"]
    jobs[:] = [dataclasses.replace(old, reserved_at=clock.t)]
    clock.t += 1
    for _ in range(6):
        svc.throttle_point("sweep", 10)
        svc.tick(busy_snapshot({0: (0.5, 0.2)}))
        clock.t += 1
    assert svc._jobs["sweep"].learned("GPU 0").sm == pytest.approx(0.5)


def test_a_quiet_service_keeps_the_footprint_an_older_file_held(tmp_path: Path) -> None:
    """A footprint kept per job (an older colo.json) of a service that serves nothing
    alone now: it is learned nothing anew, and keeps what the file held."""
    state = tmp_path / "colo.json"
    state.write_text(json.dumps({"jobs": {"chat": {"sm": 0.4, "mem_bw": 0.3}}}))
    r = RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_used=9 * GIB)
    clock = Clock()
    svc = kept_loop(tmp_path, [r], clock)
    for _ in range(4):
        svc.tick(busy_snapshot({0: (0.01, 0.0)}))
        clock.t += 1
    assert svc._features(r).sm == 0.4


def test_an_older_files_footprint_is_at_the_share_its_rate_was(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A colo.json from before shares were kept: a job whose rate alone was at 30% showed
    its footprint at that share (not advised as a whole GPU's); a share of 0 is no share:
    that job is not read."""
    state = tmp_path / "colo.json"
    f = {"sm": 0.3, "mem_bw": 0.2}
    state.write_text(
        json.dumps(
            {
                "jobs": {
                    "part": {"alone_config": "30%", "devices": {"GPU 0": f}},
                    "full": {"alone_config": "100%", "devices": {"GPU 0": f}},
                    "two": {"alone_config": "30%, 30%", "devices": {"GPU 0": f, "GPU 1": f}},
                    "odd": {"alone_config": "100%, 30%", "devices": {"GPU 0": f, "GPU 1": f}},
                }
            }
        )
    )
    svc = kept_loop(tmp_path, [], Clock())
    assert svc._jobs["part"].alone("training") is None
    assert svc._jobs["full"].alone("training") is not None
    # on two devices at 30% each: at that share; at shares that differ, no whole GPU's
    assert svc._jobs["two"].alone("training") is None
    assert svc._jobs["two"].devices["GPU 1"].share == 0.3
    assert svc._jobs["odd"].alone("training") is None
    state.write_text(json.dumps({"jobs": {"zero": {"devices": {"GPU 0": {**f, "share": 0}}}}}))
    svc = ColoService(ColocateConfig(), EventLog(None), running=list, state_file=state)
    assert "zero" not in svc._jobs
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "jobs.zero.devices.GPU 0.share" in record.getMessage()


def test_a_job_none_of_whose_processes_are_seen_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Alone for a minute with none of its processes seen on the device (NVML attributes
    no memory to them): the log says it learns no footprint, once a run."""
    caplog.set_level(logging.INFO, logger="gpud.colo.service")
    svc, _ = alone_at(tmp_path, [(100, 0.5)] * 70, memory_used=0)
    said = [r for r in caplog.records if "no footprint learned" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in said] == [
        (
            logging.INFO,
            "job sweep alone on GPU 0 for 60 s with none of its processes seen: "
            "no footprint learned",
        )
    ]
    assert svc._jobs["sweep"].learned("GPU 0") is None


def test_training_of_long_iterations_is_learned_alone(tmp_path: Path) -> None:
    """Training reporting once per iteration of 15 s, alone with its SMs 0.6 busy, ticks a
    second apart: its footprint is learned (it makes progress at its pace); once it has
    reported nothing for over twice its pace (30 s: a checkpoint), it is learned nothing
    more."""
    clock = Clock()
    r = RunningJob("long", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB)
    svc = kept_loop(tmp_path, [r], clock)
    for t in range(60):
        if t % 15 == 0:
            svc.throttle_point("long", 1)
        svc.tick(busy_snapshot({0: (0.6, 0.4)}))
        clock.t += 1
    learned = svc._jobs["long"].learned("GPU 0")
    assert learned is not None and learned.sm == pytest.approx(0.6)
    # its checkpoint (SMs 0.05 busy): 15 s after its last report, reports still due
    for _ in range(30):
        svc.tick(busy_snapshot({0: (0.05, 0.0)}))
        clock.t += 1
    stale = svc._jobs["long"].learned("GPU 0")
    assert stale is not None and stale.sm < 0.6
    for _ in range(20):
        svc.tick(busy_snapshot({0: (0.05, 0.0)}))
        clock.t += 1
    assert svc._jobs["long"].learned("GPU 0") == stale


def test_a_duty_told_to_a_stalled_job_is_no_progress_to_learn_from(tmp_path: Path) -> None:
    """Training making an iteration a second alone (SMs 0.6), then checkpointing (SMs
    0.05) for 40 s, told another duty 15 s into it (a report of no iteration, kept for its
    rate): the duty is no iteration, and nothing is learned alone from the checkpoint once
    10 s passed without one."""
    clock = Clock()
    r = RunningJob("long", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB)
    svc = kept_loop(tmp_path, [r], clock)
    for _ in range(60):
        svc.throttle_point("long", 1)
        svc.tick(busy_snapshot({0: (0.6, 0.4)}))
        clock.t += 1
    for _ in range(12):  # the checkpoint's first seconds, its iterations' pace within them
        svc.tick(busy_snapshot({0: (0.05, 0.0)}))
        clock.t += 1
    stale = svc._jobs["long"].learned("GPU 0")
    for t in range(28):
        if t == 3:
            svc._directives["long"] = Directive(0.5, False, "SLO guard")
            svc.throttle_point("long", 0)
        svc.tick(busy_snapshot({0: (0.05, 0.0)}))
        clock.t += 1
    assert svc._jobs["long"].learned("GPU 0") == stale


class ViewsSeen(ColoService):
    """A loop that keeps each view it made of a job, with the job."""

    seen: list[tuple[RunningJob, JobView]]

    def _view(
        self, r: RunningJob, names: Mapping[int, str] | None = None, profile: str | None = None
    ) -> JobView:
        view = super()._view(r, names, profile)
        self.__dict__.setdefault("seen", []).append((r, view))
        return view


def test_a_running_job_with_a_place_promised_is_advised_at_its_share(tmp_path: Path) -> None:
    """A job alone at 30% on GPU 0 (SMs 0.3 there; 0.9 once on the whole GPU) while a second
    run of it holds a place promised on GPU 1: advice plans the running one at 0.3, the
    promised place at 0.9."""
    svc, _ = alone_at(
        tmp_path, [(100, 0.9)] * 7 + [(30, 0.3)] * 7, loop=ViewsSeen, memory_bytes=10 * GIB
    )
    ask = {"memory_bytes": 10 * GIB, "snapshot": busy_snapshot({0: (0.3, 0.2), 1: (0.0, 0.0)})}
    assert svc.advise("sweep", reserving=True, **ask).gpu == 1  # type: ignore[arg-type]
    assert isinstance(svc, ViewsSeen)
    svc.seen.clear()
    svc.advise("other", **ask)  # type: ignore[arg-type]
    planned = {j.gpu: (j.name, v.footprint().sm) for j, v in svc.seen}
    assert planned[0][0] == "sweep" and planned[0][1] == pytest.approx(0.3, abs=0.01)
    assert planned[1][0] == "sweep" and planned[1][1] == pytest.approx(0.9, abs=0.01)


def ran_alone(svc: ColoService, clock: Clock, sm: float, ticks: int) -> ColoService:
    """``svc`` after "sweep" made progress alone on GPU 0, its SMs ``sm`` busy, ``ticks``
    ticks a second apart."""
    for _ in range(ticks):
        svc.throttle_point("sweep", 10)
        svc.tick(busy_snapshot({0: (sm, sm * 2 / 3)}))
        clock.t += 1
    return svc


def test_a_job_that_ended_keeps_its_footprint_across_a_restart(tmp_path: Path) -> None:
    """A job that ran alone on a whole GPU (SMs 0.5) and ended: a restart keeps what it
    showed, for advice to plan its next run with, and forgets it an hour after it last
    ran, as it would have without the restart."""
    clock = Clock()
    jobs = [RunningJob("sweep", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB)]
    svc = ran_alone(kept_loop(tmp_path, jobs, clock), clock, 0.5, 8)
    jobs.clear()  # it ended
    clock.t += 600
    svc.tick(busy_snapshot({0: (0.0, 0.0)}))
    clock = Clock()
    again = kept_loop(tmp_path, [], clock)
    whole = again._jobs["sweep"].alone("training")
    assert whole is not None and whole.sm == pytest.approx(0.5)
    assert again._directives.get("sweep") is None
    clock.t += FORGET_AFTER_S - 500
    again.tick(busy_snapshot({0: (0.0, 0.0)}))
    assert "sweep" not in again._jobs


def test_an_ended_job_kept_in_the_file_does_not_rewrite_it_every_tick(tmp_path: Path) -> None:
    """How long ago an ended job ran grows each tick; alone, it does not rewrite colo.json
    each tick (a flushed write and rename every few seconds for an hour after each job)."""
    clock = Clock()
    jobs = [RunningJob("sweep", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB)]
    svc = ran_alone(kept_loop(tmp_path, jobs, clock), clock, 0.5, 8)
    jobs.clear()  # it ended
    clock.t += 5
    svc.tick(busy_snapshot({0: (0.0, 0.0)}))
    written = (tmp_path / "colo.json").stat().st_ino
    for _ in range(5):
        clock.t += 5
        svc.tick(busy_snapshot({0: (0.0, 0.0)}))
    assert (tmp_path / "colo.json").stat().st_ino == written
    assert "sweep" in json.loads((tmp_path / "colo.json").read_text())["jobs"]


def test_a_job_added_again_is_no_more_removed_without_telemetry(tmp_path: Path) -> None:
    """A job removed and added again while the loop has no telemetry (or is off): its
    throttle points get its duty, not "job removed", and its reports are kept; so too
    when the wall clock stepped back before it was added again."""
    for step in (1.0, -100.0):
        clock = Clock()
        old = RunningJob("sweep", "training", 0, memory_bytes=10 * GIB, reserved_at=clock.t)
        jobs = [old]
        svc = promising_loop(tmp_path / str(step), jobs, clock)
        svc.tick(busy_snapshot({0: (0.3, 0.2)}))
        svc.job_removed("sweep", force=True)()
        clock.t += step
        jobs[:] = [dataclasses.replace(old, reserved_at=clock.t)]
        svc.tick(None)
        assert svc.throttle_point("sweep", 10).reason != "job removed"
        svc.report_latency("sweep", [0.01])
        assert svc._jobs["sweep"].latency


def test_a_removed_job_is_gone_from_the_file_at_once(tmp_path: Path) -> None:
    """`gpuctl jobs rm` of a job the loop learned: colo.json no longer holds it once the
    removal committed, before any tick (a kill -9 then does not bring it back)."""
    clock = Clock()
    jobs = [RunningJob("sweep", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB)]
    svc = ran_alone(kept_loop(tmp_path, jobs, clock), clock, 0.3, 6)
    assert "sweep" in json.loads((tmp_path / "colo.json").read_text())["jobs"]
    svc.job_removed("sweep", force=True)()
    assert "sweep" not in json.loads((tmp_path / "colo.json").read_text())["jobs"]
    assert "sweep" not in kept_loop(tmp_path, [], Clock())._jobs


def test_a_job_removed_before_the_file_was_written_is_forgotten_at_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """gpud killed between the commit of `gpuctl jobs rm` and colo.json's write: the file
    still holds the job, the registry no longer does. The restart drops it (and the
    duty its guard set), so a job added again under its name is planned afresh; the
    other jobs' state is kept."""
    caplog.set_level(logging.INFO)
    clock = Clock()
    jobs = [RunningJob("sweep", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB)]
    ran_alone(kept_loop(tmp_path, jobs, clock), clock, 0.3, 6)  # the last write holds it
    with_it = kept_loop(tmp_path, [], Clock(), registered=lambda: {"sweep": None})
    assert "sweep" in with_it._jobs
    again = kept_loop(tmp_path, [], Clock(), registered=lambda: {"other": None})
    assert "sweep" not in again._jobs and "sweep" not in again._directives
    assert any("no longer registered, forgotten: sweep" in r.getMessage() for r in caplog.records)


def test_a_job_added_again_while_colo_json_could_not_be_written_is_planned_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`gpuctl jobs rm` on a full disk (colo.json's write fails, tried again each tick),
    the job added again under its name and run, gpud killed -9 before a write succeeds:
    the file holds the removed job's alone rate, footprint and duty under the name the
    registry lists. The restart tells the two registrations apart and plans the new one
    afresh; the one registered when the file was written keeps what it showed."""
    caplog.set_level(logging.INFO)
    clock = Clock()
    first, second = 1_700_000_000.25, 1_700_000_900.5  # jobs.created_at of each
    old = RunningJob(
        "sweep", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB, registered_at=first
    )
    jobs = [old]
    full = False

    def write(path: Path, text: str) -> None:
        if full:
            raise OSError(28, "No space left on device")
        write_atomically(path, text)

    svc = ran_alone(kept_loop(tmp_path, jobs, clock, write=write), clock, 0.5, 8)
    assert svc._jobs["sweep"].alone_rate is not None
    full = True
    svc.job_removed("sweep", force=True)()
    jobs[:] = [dataclasses.replace(old, registered_at=second)]
    ran_alone(svc, clock, 0.2, 3)  # killed -9 here: no write landed since the removal
    saved = json.loads((tmp_path / "colo.json").read_text())["jobs"]["sweep"]
    assert saved["registered_at"] == first and saved["alone_rate"] is not None

    again = kept_loop(tmp_path, [], Clock(), registered=lambda: {"sweep": second})
    assert "sweep" not in again._jobs and "sweep" not in again._directives
    assert any(
        "registered again since its last write" in r.getMessage() and "sweep" in r.getMessage()
        for r in caplog.records
    )
    same = kept_loop(tmp_path, [], Clock(), registered=lambda: {"sweep": first})
    assert same._jobs["sweep"].alone_rate == saved["alone_rate"]


def test_a_colo_json_that_names_no_registration_is_taken_as_the_jobs_registered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A colo.json an earlier gpud wrote keeps no job's registration: each job it holds
    that the registry lists is taken as the one registered, kept without a word above
    info, and written with its registration once it runs."""
    caplog.set_level(logging.INFO)
    clock = Clock()
    jobs = [RunningJob("sweep", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB)]
    ran_alone(kept_loop(tmp_path, jobs, clock), clock, 0.5, 8)
    state = tmp_path / "colo.json"
    data = json.loads(state.read_text())
    for job in data["jobs"].values():
        job.pop("registered_at", None)
    state.write_text(json.dumps(data))
    caplog.clear()
    clock = Clock()
    jobs[:] = [dataclasses.replace(jobs[0], registered_at=1_700_000_000.0)]
    again = kept_loop(tmp_path, jobs, clock, registered=lambda: {"sweep": 1_700_000_000.0})
    assert again._jobs["sweep"].alone_rate is not None
    assert not [r for r in caplog.records if r.levelno > logging.INFO]
    ran_alone(again, clock, 0.5, 1)
    saved = json.loads(state.read_text())["jobs"]["sweep"]
    assert saved["registered_at"] == 1_700_000_000.0


def test_a_removal_does_not_wait_for_a_tick_write_in_progress(tmp_path: Path) -> None:
    """`gpuctl jobs rm` commits while a tick writes the state it built (the job still in
    it) slowly, a long fsync: the removal's hook, run under the jobs service's placement
    lock, returns at once, and its state is written straight after the tick's; the
    tick's older state never lands over it (a kill -9 then does not bring the job
    back)."""
    import threading

    clock = Clock()
    jobs = [RunningJob("sweep", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB)]
    state = tmp_path / "colo.json"
    ticking, go = threading.Event(), threading.Event()
    tick = threading.Thread(target=lambda: svc.tick(busy_snapshot({0: (0.6, 0.4)})))

    def write(path: Path, text: str) -> None:
        if threading.current_thread() is tick and not go.is_set():
            ticking.set()  # the tick's write: held until the removal returned
            go.wait(10)
        write_atomically(path, text)

    svc = ran_alone(kept_loop(tmp_path, jobs, clock, write), clock, 0.3, 6)
    tick.start()
    try:
        assert ticking.wait(5)
        removal = threading.Thread(target=svc.job_removed("sweep", force=True))
        removal.start()
        removal.join(3)
        assert not removal.is_alive()  # it did not wait for the tick's write
        assert "sweep" in json.loads(state.read_text())["jobs"]  # not written yet
    finally:
        go.set()
    tick.join(5)
    assert not tick.is_alive()
    assert "sweep" not in json.loads(state.read_text())["jobs"]
    assert "sweep" not in kept_loop(tmp_path, [], Clock())._jobs


def test_an_older_state_is_not_written_over_a_newer_one(tmp_path: Path) -> None:
    """Two states built in turn, the newer written first (a removal's, while the tick that
    built the older one had not written it yet): the older one is not written."""
    clock = Clock()
    jobs = [RunningJob("sweep", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB)]
    svc = ran_alone(kept_loop(tmp_path, jobs, clock), clock, 0.3, 6)
    with svc._lock:
        older = svc._state(r.name for r in jobs)
        svc._jobs.pop("sweep")
        newer = svc._state([])
    svc._save(newer)
    svc._save(older)
    assert "sweep" not in json.loads((tmp_path / "colo.json").read_text())["jobs"]


def test_a_minute_alone_unseen_is_counted_anew_after_company(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A job alone 40 s with none of its processes seen, then beside another job on its
    device, then alone and unseen 40 s again: never a minute alone, nothing said."""
    caplog.set_level(logging.INFO, logger="gpud.colo.service")
    clock = Clock()
    sweep = RunningJob("sweep", "training", 0, memory_bytes=10 * GIB, memory_used=0)
    other = RunningJob("other", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB)
    jobs = [sweep]
    svc = kept_loop(tmp_path, jobs, clock)
    for company in [[]] * 40 + [[other]] * 10 + [[]] * 40:
        jobs[:] = [sweep, *company]
        svc.tick(busy_snapshot({0: (0.5, 0.3)}))
        clock.t += 1
    assert not [r for r in caplog.records if "no footprint learned" in r.getMessage()]


def test_a_job_reserved_and_removed_between_two_ticks_stays_removed(tmp_path: Path) -> None:
    """A job reserved after the last tick and removed (`gpuctl jobs rm --force`) while the
    next tick reads the reservations, before the removal committed: the loop never knew its
    reservation, yet it is neither planned, learned, kept in colo.json nor guarded; a run
    of it added again later is."""
    clock = Clock()
    other = RunningJob("other", "training", 1, memory_bytes=10 * GIB, reserved_at=clock.t)
    jobs = [other]
    svc, removing = removing_loop(tmp_path, jobs, clock)
    svc.tick(busy_snapshot({0: (0.0, 0.0), 1: (0.3, 0.2)}))
    clock.t += 1
    sweep = RunningJob(
        "sweep", "training", 0, memory_bytes=10 * GIB, memory_used=9 * GIB, reserved_at=clock.t
    )
    jobs.append(sweep)
    clock.t += 1
    removing.append("sweep")
    plan = svc.tick(busy_snapshot({0: (0.3, 0.2), 1: (0.3, 0.2)}))
    assert plan is not None
    assert "sweep" not in {p.job_id for p in plan.placements}
    assert "sweep" not in svc._jobs
    assert "sweep" not in json.loads((tmp_path / "colo.json").read_text())["jobs"]
    assert svc.throttle_point("sweep", 10).reason == "job removed"
    clock.t += 1
    jobs.append(dataclasses.replace(sweep, reserved_at=clock.t))  # added again
    svc.tick(busy_snapshot({0: (0.3, 0.2), 1: (0.3, 0.2)}))
    assert svc.throttle_point("sweep", 10).reason != "job removed"
    assert "sweep" in svc._jobs


def test_a_held_batch_after_a_switch_off_cleared_the_latencies_keeps_the_reports_in_order(
    tmp_path: Path,
) -> None:
    """A switch-off clears what a service paused by a hang reported, not when it reported:
    a batch held from before that report, arriving after, is counted no earlier than it,
    so the load still counts its requests."""
    svc, clock, _ = chat_beside_training(tmp_path)
    clock.t += 1
    svc.report_latency("chat", [0.2])
    svc.tick(gpu0_faulty("not answering: a driver call is out"))
    svc.configure(ColocateConfig(enabled=False))
    clock.t += 3
    svc.report_latency("chat", [0.01], age_s=12.5)
    stamps = [t for t, _ in svc._jobs["chat"].reports]
    assert stamps == sorted(stamps), stamps


def test_a_service_whose_memory_fell_back_keeps_its_peak_reserved_beside_new_work(
    tmp_path: Path,
) -> None:
    """An inference service of no declared memory (no MPS limit holds it) grew its cache to
    60 GiB of GPU 0, then fell back to 10 GiB: a 30 GiB training job is not advised GPU 0,
    where the service's next growth would meet it over the 80 GiB; it waits, saying the
    memory. A new run of the service starts afresh, from what it uses."""
    service = RunningJob("chat", "inference", 0, slo_p99_ms=500.0, memory_used=60 * GIB)
    jobs = [service]
    clock = Clock()
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=clock
    )
    svc.tick(snapshot(n=1, used_gib=60))
    jobs[0] = dataclasses.replace(service, memory_used=10 * GIB)
    clock.t += 5
    snap = snapshot(n=1, used_gib=10)
    svc.tick(snap)
    advice = svc.advise("train", memory_bytes=30 * GIB, snapshot=snap)
    assert advice.gpu == -1, advice
    assert "memory" in advice.reason, advice.reason
    jobs.clear()  # its run ended
    clock.t += 5
    svc.tick(snapshot(n=1, used_gib=0))
    jobs.append(dataclasses.replace(service, memory_used=10 * GIB))
    clock.t += 5
    svc.tick(snap)
    assert svc.advise("train", memory_bytes=30 * GIB, snapshot=snap).gpu == 0


def chat_then_at_10_gib(
    tmp_path: Path, then: RunningJob, first: Snapshot | None = None
) -> tuple[ColoService, Snapshot]:
    """A loop that saw ``then`` at a tick on ``first`` (GPU 0 at 60 GiB used), then, 5 s
    on, the same run (or ``then``'s next, by its reserved_at) using 10 GiB: the loop and
    that second snapshot."""
    jobs = [then]
    clock = Clock()
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=clock
    )
    svc.tick(first or snapshot(n=1, used_gib=60))
    jobs[0] = dataclasses.replace(then, memory_used=10 * GIB)
    clock.t += 5
    snap = snapshot(n=1, used_gib=10)
    svc.tick(snap)
    return svc, snap


CHAT = RunningJob("chat", "inference", 0, slo_p99_ms=500.0, memory_used=60 * GIB)


def test_a_new_run_started_between_two_ticks_does_not_inherit_the_last_runs_peak(
    tmp_path: Path,
) -> None:
    """chat's run reserved at 100 grew to 60 GiB; it stopped and a new run reserved at 103,
    using 10 GiB, before the loop's next tick saw it gone: the new run is planned at what
    it uses, and a 30 GiB training job is placed beside it."""
    jobs = [dataclasses.replace(CHAT, reserved_at=100.0)]
    clock = Clock()
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "e.jsonl"), running=lambda: jobs, clock=clock
    )
    svc.tick(snapshot(n=1, used_gib=60))
    jobs[0] = dataclasses.replace(CHAT, memory_used=10 * GIB, reserved_at=103.0)
    clock.t += 5
    snap = snapshot(n=1, used_gib=10)
    svc.tick(snap)
    advice = svc.advise("train", memory_bytes=30 * GIB, snapshot=snap)
    assert advice.gpu == 0, advice


def test_a_reading_over_the_devices_memory_counts_as_the_whole_device_not_for_the_run(
    tmp_path: Path,
) -> None:
    """NVML once said chat's processes hold 1 TiB of an 80 GiB GPU (a bad reading): the
    run's peak is the device's 80 GiB, not a terabyte kept for the rest of the run."""
    svc, snap = chat_then_at_10_gib(tmp_path, dataclasses.replace(CHAT, memory_used=1 << 40))
    plan = svc.tick(snap)
    assert plan is not None
    assert plan.memory_reserved[0] <= 80 * GIB * 1.15, plan.memory_reserved


def test_a_reading_from_a_gpu_that_is_not_healthy_is_no_peak_of_its_run(
    tmp_path: Path,
) -> None:
    """While GPU 0 did not answer, chat's reading said 1 TiB: once the GPU answers again
    at 10 GiB, a 30 GiB training job is placed beside it."""
    sick = snapshot(n=1, used_gib=10)
    sick = dataclasses.replace(
        sick, gpus=(sick.gpus[0]._replace(healthy=False, reason="GPU not answering"),)
    )
    svc, snap = chat_then_at_10_gib(
        tmp_path, dataclasses.replace(CHAT, memory_used=1 << 40), first=sick
    )
    advice = svc.advise("train", memory_bytes=30 * GIB, snapshot=snap)
    assert advice.gpu == 0, advice


def test_a_refusal_for_memory_names_the_job_held_at_its_runs_peak(tmp_path: Path) -> None:
    """nvidia-smi shows 70 GiB free where the plan counts chat at the 60 GiB its run took:
    the refusal says whose peak holds the room, not only how little is free."""
    svc, snap = chat_then_at_10_gib(tmp_path, CHAT)
    advice = svc.advise("train", memory_bytes=30 * GIB, snapshot=snap)
    assert advice.gpu == -1, advice
    assert "chat holds its run's peak 60 GiB (now 10 GiB)" in advice.reason, advice.reason


def _training_progress(
    tmp_path: Path, points: list[tuple[float, int, float]], since: float = 0.0
) -> tuple[ColoService, Any]:
    """A service whose job ``train`` reported ``points`` (time, iterations, duty told),
    its company settled at ``since``."""
    jobs = [RunningJob("train", "training", 0, memory_bytes=10 * GIB)]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "events.jsonl"), running=lambda: jobs, clock=Clock()
    )
    svc.throttle_point("train", 0)
    st = svc._jobs["train"]
    st.progress.clear()
    st.progress.extend(points)
    st.since = since
    return svc, st


def test_a_checkpoint_between_two_iterations_is_not_read_as_the_job_crawling(
    tmp_path: Path,
) -> None:
    """An iteration a second, then a 300 s checkpoint, then a second an iteration again:
    read from the last iteration before the checkpoint it would crawl at 0.007 a second."""
    points = [(float(t), t, 1.0) for t in range(1, 51)]
    points += [(350.0 + t, 50 + t, 1.0) for t in range(1, 11)]
    svc, st = _training_progress(tmp_path, points)
    rates = [svc._rate(st, now) for now in (351.5, 355.5, 359.5)]
    assert all(r is None or r == pytest.approx(1.0) for r in rates), rates


def test_a_rate_is_read_from_no_iteration_before_the_jobs_company_changed(
    tmp_path: Path,
) -> None:
    """20 s iterations; a service joined at 90 (settled at 92): read at 106 from the
    iteration that ended at 85 it would mix 5 s alone into a sample of interference."""
    points = [(65.0, 1, 1.0), (85.0, 2, 1.0), (105.0, 3, 1.0)]
    svc, st = _training_progress(tmp_path, points, since=92.0)
    assert svc._rate(st, 106.0) is None
    st.progress.append((125.0, 4, 1.0))
    assert svc._rate(st, 126.0) == pytest.approx(0.05)


def test_a_rate_is_read_from_an_iterations_end_not_from_a_duty_told_in_its_sleep(
    tmp_path: Path,
) -> None:
    """10 s iterations at duty 0.1 (a 90 s sleep), told 0.5 after 50 s of sleep (the rest of
    it then 0): read from the duty's point, the next iteration alone would read 0.2."""
    points = [(100.0, 1, 0.1), (150.0, 1, 0.5), (160.0, 2, 0.5)]
    svc, st = _training_progress(tmp_path, points)
    assert svc._rate(st, 165.0) == pytest.approx(0.1)


@pytest.mark.parametrize("end_seen", [True, False])
def test_a_training_job_that_ran_ended_and_runs_again_reads_no_rate_of_its_last_run(
    tmp_path: Path, end_seen: bool
) -> None:
    """An iteration a second; the run ends and `gpuctl run` starts the job again 4 s
    later (a tick sees it gone, or the new run begins between two ticks: another
    reservation). Read across the gap from the last run's iterations it would run at 0.6
    a second: its rate is read from the new run's own iterations only, once they settled."""
    clock = Clock()
    jobs = [RunningJob("train", "training", 0, memory_bytes=10 * GIB, reserved_at=clock.t)]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "events.jsonl"), running=lambda: jobs, clock=clock
    )
    svc.tick(snapshot())
    svc.throttle_point("train", 0)
    for _ in range(20):
        clock.t += 1.0
        svc.throttle_point("train", 1)
        svc.tick(snapshot())
    st = svc._jobs["train"]
    assert svc._rate(st, clock.t) == pytest.approx(1.0)
    clock.t += 0.5
    if end_seen:
        jobs = []
        svc.tick(snapshot())
        assert not st.reporting and not st.progress
    clock.t += 2.0
    jobs = [RunningJob("train", "training", 0, memory_bytes=10 * GIB, reserved_at=clock.t)]
    clock.t += 1.5
    svc.throttle_point("train", 0)  # the new run's first point
    rates = []  # as each tick, every 3 s, reads them
    for _ in range(12):
        clock.t += 1.0
        svc.throttle_point("train", 1)
        if clock.t % 3 == 0:
            svc.tick(snapshot())
            rates.append(svc._rate(svc._jobs["train"], clock.t))
    assert all(r is None or r == pytest.approx(1.0) for r in rates), rates
    assert rates[0] is None and rates[-1] == pytest.approx(1.0), rates


def test_a_guard_switched_on_shows_the_p99_it_judges_and_that_it_measures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The loop off while a service beside training ran at 150 ms, then switched on: the
    window still holds those, which the guard does not judge. `gpuctl colo show` puts the
    p99 it judges (none yet) beside the SLO, the window's apart, and says it measures,
    not that no training is on its GPU."""
    from gpud.api import ApiServer
    from gpud.cli.main import main
    from gpud.colo.api import ColoServicer
    from tests.unit.api_support import ServerThread, short_dir

    clock = Clock()
    jobs = [
        RunningJob("chat", "inference", 0, slo_p99_ms=100.0, memory_bytes=20 * GIB),
        RunningJob("train", "training", 0, threads_percent=50, memory_bytes=10 * GIB),
    ]
    svc = ColoService(
        ColocateConfig(enabled=False),
        EventLog(tmp_path / "events.jsonl"),
        running=lambda: jobs,
        clock=clock,
    )
    for _ in range(10):
        clock.t += 1.0
        svc.report_latency("chat", [0.15] * 10)
        svc.tick(snapshot())
    svc.configure(ColocateConfig())
    for _ in range(4):
        clock.t += 1.0
        svc.report_latency("chat", [0.05] * 3)
        svc.tick(snapshot())
    (g,) = svc.show().guards
    assert g.p99_ms == pytest.approx(150.0) and g.p99_at_duty_ms is None
    assert g.reason == "measuring: 6 of the 20 latencies it judges on", g.reason
    snap = snapshot()
    with short_dir() as d:
        path = d / "gpud.sock"
        with ServerThread(
            ApiServer(path, servicers=[ColoServicer(svc, snapshots=lambda: snap).register])
        ):
            assert main(["--socket", str(path), "colo", "show"], env={}) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("SERVICE"))
    header, row = lines[at], lines[at + 1]
    assert header.split()[3:7] == ["P99", "JUDGED", "P99", "WINDOW"], header
    judged = row[header.index("P99 JUDGED") : header.index("P99 WINDOW")].strip()
    window = row[header.index("P99 WINDOW") : header.index("TRAINING DUTY")].strip()
    assert (judged, window) == ("-", "150.0 ms"), row


def test_a_guard_switched_off_and_on_again_says_it_measures_not_its_last_cut(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A guard that cut the training's duty, the loop then switched off and on again: its
    duty is back at 1.0 and it judges none of the window's older latencies, so its row
    says it measures, not the cut it made before the switch."""
    svc, clock, _ = service
    for _ in range(10):
        clock.t += 1.0
        svc.report_latency("chat", [0.095] * 10)
        svc.tick(snapshot())
    (g,) = svc.show().guards
    assert g.action == "throttle" and g.duty < 1.0, (g.action, g.duty)
    svc.configure(ColocateConfig(enabled=False))
    svc.tick(snapshot())
    svc.configure(ColocateConfig())
    clock.t += 1.0
    svc.tick(snapshot())
    (g,) = svc.show().guards
    assert (g.action, g.duty) == ("hold", 1.0), (g.action, g.duty)
    assert g.reason.startswith("measuring: "), g.reason


def quiet_service_guard(
    service: tuple[ColoService, Clock, list[RunningJob]], every_s: float, reports: int
) -> Any:
    """The guard row of a service beside training, the loop on, that served one request of
    50 ms every ``every_s`` seconds, ``reports`` times, a tick after each."""
    svc, clock, _ = service
    for _ in range(reports):
        clock.t += every_s
        svc.report_latency("chat", [0.05])
        svc.tick(snapshot())
    (g,) = svc.show().guards
    return g


def test_a_quiet_service_counts_toward_its_guard_as_far_back_as_the_guard_reaches(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A request every 2 s: 5 in a 10 s latency window, but the guard judges on the latest
    20 up to six windows back, so after 30 s it has 15 of them, not 5."""
    g = quiet_service_guard(service, every_s=2.0, reports=15)
    assert g.reason == "measuring: 15 of the 20 latencies it judges on", g.reason


def test_a_service_too_quiet_for_its_guard_says_it_is_not_guarded(
    service: tuple[ColoService, Clock, list[RunningJob]],
) -> None:
    """A request every 4 s: 16 in the six windows (60 s) the guard reaches back, never the
    20 it judges on: its row says so rather than that it measures."""
    g = quiet_service_guard(service, every_s=4.0, reports=25)
    assert g.reason == "not guarded: too few requests (16 in the last 60 s)", g.reason
    assert (g.action, g.duty) == ("hold", 1.0)


def training_run_and_jobs(tmp_path: Path) -> tuple[ColoService, Clock, list[RunningJob]]:
    """A service with one training job running since now under one reservation, ticked,
    and the jobs it sees running."""
    clock = Clock()
    jobs = [RunningJob("train", "training", 0, memory_bytes=10 * GIB, reserved_at=clock.t)]
    svc = ColoService(
        ColocateConfig(), EventLog(tmp_path / "events.jsonl"), running=lambda: jobs, clock=clock
    )
    svc.tick(snapshot())
    return svc, clock, jobs


def training_run(tmp_path: Path) -> tuple[ColoService, Clock]:
    """A service with one training job running since now under one reservation, ticked."""
    svc, clock, _ = training_run_and_jobs(tmp_path)
    return svc, clock


def test_a_training_process_started_again_within_its_run_reads_no_rate_of_the_last_one(
    tmp_path: Path,
) -> None:
    """An iteration a second; the process ends and another starts 4 s later under the same
    reservation (a wrapper that starts it again): read across the gap from the last
    process's iterations it would run at 0.6 a second."""
    svc, clock = training_run(tmp_path)
    svc.throttle_point("train", 0, process="a")
    for _ in range(20):
        clock.t += 1.0
        svc.throttle_point("train", 1, process="a")
        svc.tick(snapshot())
    clock.t += 4.0
    svc.throttle_point("train", 0, process="b")  # the new process's first point
    rates = []
    for _ in range(4):
        clock.t += 1.0
        svc.throttle_point("train", 1, process="b")
        svc.tick(snapshot())
        rates.append(svc._rate(svc._jobs["train"], clock.t))
    assert rates == [None, 1.0, 1.0, 1.0], rates


def test_ranks_of_one_job_starting_and_retrying_beside_each_other_forget_no_progress(
    tmp_path: Path,
) -> None:
    """Two ranks under one job name, an iteration a second each: the second starts 5 s
    after the first, and the first's call is then sent again (timed out on its side, its
    back-off); neither is read as a process started again, so the job's progress runs on."""
    svc, clock = training_run(tmp_path)
    svc.throttle_point("train", 0, process="rank0")
    for second in range(1, 21):
        clock.t += 1.0
        svc.throttle_point("train", 1, process="rank0")
        if second == 5:
            svc.throttle_point("train", 0, process="rank1")  # its first point
        if second > 5:
            svc.throttle_point("train", 1, process="rank1")
        if second == 10:
            svc.throttle_point("train", 0, process="rank0")  # sent again after a timeout
        svc.tick(snapshot())
    st = svc._jobs["train"]
    assert st.progress[0][0] == 101.0 and st.progress[-1][1] == 35, list(st.progress)


def test_a_new_run_of_a_job_keeps_none_of_the_last_runs_process_ids(tmp_path: Path) -> None:
    """A run's processes are its own: one that ends and another that begins between two
    ticks leave the next run no process ids to read its first process as a rank beside."""
    svc, clock, jobs = training_run_and_jobs(tmp_path)
    svc.throttle_point("train", 0, process="a")
    clock.t += 1.0
    jobs[0] = dataclasses.replace(jobs[0], reserved_at=clock.t)  # ended and reserved again
    svc.tick(snapshot())
    assert svc._jobs["train"].processes == {}


def test_a_job_keeps_a_bounded_number_of_process_ids(tmp_path: Path) -> None:
    """A process id the client makes anew at each point (or thousands of ranks) costs gpud
    at most MAX_JOB_PROCESSES ids, the one that reported longest ago dropped first."""
    svc, _ = training_run(tmp_path)
    for i in range(MAX_JOB_PROCESSES + 10):
        svc.throttle_point("train", 1, process=f"p{i}")
    svc.throttle_point("train", 1, process=f"p{MAX_JOB_PROCESSES + 9}")
    seen = svc._jobs["train"].processes
    assert len(seen) == MAX_JOB_PROCESSES and "p9" not in seen and "p10" in seen


def test_a_process_id_longer_than_gpud_keeps_is_refused_naming_the_job(
    tmp_path: Path,
) -> None:
    svc, _ = training_run(tmp_path)
    with pytest.raises(InvalidArgument, match="job train: throttle point process id of 65"):
        svc.throttle_point("train", 1, process="x" * 65)


def test_a_throttle_sends_one_process_id_through_retries_and_a_forked_child_its_own() -> None:
    """gpud away at the first point: the call tried again carries the same id (gpud must
    not read a rank's retry as a process started again); a forked child's differ."""
    sent: list[str] = []
    answers = [False, True, True]

    class Stub:
        def ThrottlePoint(
            self, request: colo_pb2.ThrottlePointRequest, **_: object
        ) -> colo_pb2.ThrottlePointResponse:
            sent.append(request.process)
            if not answers.pop(0):
                raise TimeoutError("deadline exceeded")
            return colo_pb2.ThrottlePointResponse(duty=1.0)

    clock = Clock()
    t = Throttle("train", clock=clock, sleep=lambda s: None, report_every_s=0)
    t._channel._stub = Stub()
    for _ in range(3):
        t.point()
        clock.t += 3.0  # past the back-off after the failed call (2 s)
    assert len(sent) == 3 and len(set(sent)) == 1 and sent[0], sent
    t._forked()  # as os.register_at_fork runs it in the child
    t._channel._stub = Stub()
    answers.append(True)
    t.point()
    assert len(sent) == 4 and sent[3] not in ("", sent[0]), sent


def test_a_run_that_reserved_and_ended_between_two_questions_holds_no_place(
    tmp_path: Path,
) -> None:
    """A `gpuctl run` whose command ends at once (not found, a quick exit) reserves the
    place it was given and releases it before any list of reservations shows it: the next
    run of its job is told the GPU is free, not that it would slow below 1/2 beside that
    ended run until PROMISE_S has passed."""
    clock = Clock()
    jobs = [RunningJob("big", "training", 0, memory_bytes=30 * GIB)]
    svc = promising_loop(tmp_path, jobs, clock)
    ask = {"memory_bytes": 30 * GIB, "snapshot": snapshot(used_gib=0)}
    first = svc.advise("sweep", reserving=True, **ask)  # type: ignore[arg-type]
    assert (first.gpu, first.reason) == (1, "GPU 1 is free: exclusive")
    svc.reservation_made("sweep", clock.t)  # and released before the next question
    clock.t += 1
    again = svc.advise("sweep", reserving=True, **ask)  # type: ignore[arg-type]
    assert (again.gpu, again.reason) == (1, "GPU 1 is free: exclusive")
    # a reservation made before a place was promised stands for none
    svc.reservation_made("sweep", clock.t - 1)
    assert svc.advise("other", reserving=True, **ask).gpu == -1  # type: ignore[arg-type]


def test_a_reservation_of_one_of_two_runs_of_a_job_stands_for_the_place_on_its_own_gpu(
    tmp_path: Path,
) -> None:
    """Two runs of one job were given GPUs 1 and 2; the second reserves GPU 2 and ends
    before the next question. Its reservation stands for its own place, not the first
    run's (the earliest): GPU 2 is free again, GPU 1 still held for the first run. Taken
    for the first run's, GPU 1 was told free to another job, and GPU 2 stayed held for a
    run that had ended."""
    clock = Clock()
    jobs = [RunningJob("big", "training", 0, memory_bytes=30 * GIB)]
    svc = promising_loop(tmp_path, jobs, clock)
    ask = {"memory_bytes": 30 * GIB, "snapshot": snapshot(n=3, used_gib=0)}
    a = svc.advise("sweep", reserving=True, **ask)  # type: ignore[arg-type]
    clock.t += 1
    b = svc.advise("sweep", reserving=True, **ask)  # type: ignore[arg-type]
    assert (a.gpu, b.gpu) == (1, 2)
    svc.reservation_made("sweep", clock.t, [b.device])  # and released before the next question
    clock.t += 1
    other = svc.advise("other", reserving=True, **ask)  # type: ignore[arg-type]
    assert (other.gpu, other.reason) == (2, "GPU 2 is free: exclusive")


def test_a_reservation_told_to_the_loop_waits_for_no_planning_pass(tmp_path: Path) -> None:
    """The jobs service tells of a reservation while it holds its placement lock: the
    loop takes it without its own lock, which a planning pass holds through its event
    writes, so a Reserve never waits on a pass; the next question counts it."""
    clock = Clock()
    svc = promising_loop(tmp_path, [RunningJob("big", "training", 0, memory_bytes=30 * GIB)], clock)
    ask = {"memory_bytes": 30 * GIB, "snapshot": snapshot(used_gib=0)}
    assert svc.advise("sweep", reserving=True, **ask).gpu == 1  # type: ignore[arg-type]
    told = threading.Thread(target=svc.reservation_made, args=("sweep", clock.t, ()))
    with svc._lock:  # a planning pass under way
        told.start()
        told.join(timeout=30)  # a hang guard only
        taken = not told.is_alive()
    told.join()
    assert taken
    clock.t += 1
    again = svc.advise("sweep", reserving=True, **ask)  # type: ignore[arg-type]
    assert (again.gpu, again.reason) == (1, "GPU 1 is free: exclusive")


def test_reservations_no_run_asks_about_keep_the_notice_queue_near_empty(
    tmp_path: Path,
) -> None:
    """Pinned runs and queue starts reserve without asking for advice: their notices stand
    for no promise, and the loop keeps none of them; once a run was promised a place, the
    notices kept are only those of the last PROMISE_S, and still count for it."""
    clock = Clock()
    svc = promising_loop(tmp_path, [RunningJob("big", "training", 0, memory_bytes=30 * GIB)], clock)
    for _ in range(300):
        svc.reservation_made("pinned", clock.t, ["GPU-x"])
        clock.t += 1
    assert len(svc._made) == 0
    ask = {"memory_bytes": 30 * GIB, "snapshot": snapshot(used_gib=0)}
    assert svc.advise("sweep", reserving=True, **ask).gpu == 1  # type: ignore[arg-type]
    for _ in range(300):
        clock.t += 1
        svc.reservation_made("pinned", clock.t, ["GPU-x"])
    assert len(svc._made) <= PROMISE_S + 1
    svc.reservation_made("sweep", clock.t)  # the promise lapsed: nothing to stand for
    again = svc.advise("sweep", reserving=True, **ask)  # type: ignore[arg-type]
    assert (again.gpu, again.reason) == (1, "GPU 1 is free: exclusive")
    svc.reservation_made("sweep", clock.t)  # and released before the next question
    clock.t += 1
    assert svc.advise("other", reserving=True, **ask).gpu == 1  # type: ignore[arg-type]
    assert len(svc._made) == 0
