"""The built-in scenario set.

Written from the shapes that matter for shared training traffic -- heterogeneous
compute/communication ratios and flow counts, 1 to 4 shared links, 2 to 32 jobs, staggered
arrivals and departures, a job joining a saturated link, jobs that do not declare their
contention-free time, few priority levels -- not from how any policy fares on them. The
larger clusters are drawn from a seeded generator, so they are the same on every run.
Two later groups: ``phase-*``, identical jobs started in step, written for CASSINI's time
shifts to win (per-flow sharing keeps them in step); ``gpus-*``, jobs of 4 to 128 GPUs, for
Crux's GPU-intensity ranking.
``python -m tools.netsim export DIR`` writes them as scenario files.

Units: links in Gbit/s (100 Gbit/s = 12.5 GB/s), flow sizes in bytes.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from tools.netsim.scenario import Scenario, from_dict

GB = 1e9
DURATION_S = 600.0
WARMUP_S = 60.0


def _scenario(
    name: str, description: str, links: Mapping[str, float], jobs: list[dict[str, Any]], **kw: Any
) -> Scenario:
    raw: dict[str, Any] = {
        "name": name,
        "description": description,
        "levels": kw.pop("levels", 8),
        "update_interval_s": 1.0,
        "duration_s": kw.pop("duration_s", DURATION_S),
        "warmup_s": WARMUP_S,
        "links": {k: {"gbps": v} for k, v in links.items()},
        "jobs": jobs,
    }
    return from_dict(raw)


def _job(
    job_id: str, compute_s: float, flows: list[tuple[float, list[str], int]], **extra: Any
) -> dict[str, Any]:
    return {
        "id": job_id,
        "compute_s": compute_s,
        "flows": [{"bytes": b, "path": p, "count": c} for b, p, c in flows],
        **extra,
    }


def pair_one_link() -> Scenario:
    return _scenario(
        "pair-one-link",
        "two jobs, one 100G link: a communication-heavy job and a balanced one",
        {"link": 100},
        [
            _job("comm-heavy", 0.2, [(4 * GB, ["link"], 1)]),
            _job("balanced", 0.5, [(2 * GB, ["link"], 1)]),
        ],
    )


def flow_count_skew() -> Scenario:
    return _scenario(
        "flow-count-skew",
        "four jobs with the same bytes per iteration split into 1, 2, 4 and 8 flows",
        {"link": 100},
        [_job(f"flows-{n}", 0.4, [(4 * GB / n, ["link"], n)]) for n in (1, 2, 4, 8)],
    )


def ratio_mix() -> Scenario:
    ratios = [0.1, 0.25, 0.5, 1.0, 2.0, 4.0]  # compute time / contention-free comm time
    jobs = []
    for i, ratio in enumerate(ratios):
        comm_bytes = 2.5 * GB
        comm_s = comm_bytes / 12.5e9
        jobs.append(
            _job(f"r{ratio:g}", round(ratio * comm_s, 4), [(comm_bytes, ["link"], 1 + i % 3)])
        )
    return _scenario(
        "ratio-mix-6",
        "six jobs on one link, compute/communication ratio from 0.1 to 4",
        {"link": 100},
        jobs,
    )


def two_tors() -> Scenario:
    return _scenario(
        "two-tors",
        "four jobs, two racks joined by a spine (3 links)",
        {"tor1": 100, "tor2": 100, "spine": 200},
        [
            _job("llm-a", 0.30, [(4 * GB, ["tor1", "spine"], 1), (4 * GB, ["tor1"], 1)]),
            _job("llm-b", 0.50, [(3 * GB, ["tor2", "spine"], 2), (1 * GB, ["tor2"], 1)]),
            _job("cv-c", 0.15, [(1 * GB, ["tor1"], 4)]),
            _job("rec-d", 0.05, [(2 * GB, ["tor1", "spine", "tor2"], 2)]),
        ],
    )


def staggered() -> Scenario:
    jobs = []
    for i in range(8):
        jobs.append(
            _job(
                f"s{i}",
                [0.2, 0.6, 0.3, 1.0, 0.15, 0.4, 0.8, 0.25][i],
                [([3, 1, 2, 4, 1.5, 2.5, 3.5, 1][i] * GB, ["link"], [1, 2, 4, 1, 8, 2, 1, 4][i])],
                start_s=40.0 * i,
            )
        )
    return _scenario(
        "staggered-8",
        "eight jobs on one link, one arriving every 40 s",
        {"link": 100},
        jobs,
    )


def churn() -> Scenario:
    links = {"tor1": 100, "tor2": 100}
    jobs = [
        _job("base-1", 0.4, [(3 * GB, ["tor1"], 2)]),
        _job("base-2", 0.3, [(2 * GB, ["tor2"], 1), (1 * GB, ["tor1", "tor2"], 1)]),
        _job("short-1", 0.2, [(2 * GB, ["tor1"], 4)], start_s=30.0, stop_s=200.0),
        _job("short-2", 0.6, [(4 * GB, ["tor1", "tor2"], 1)], start_s=100.0, stop_s=350.0),
        _job("batch-1", 0.25, [(1.5 * GB, ["tor2"], 2)], start_s=150.0, iterations=300),
        _job("batch-2", 0.1, [(2 * GB, ["tor1"], 1)], start_s=220.0, iterations=400),
        _job("late-1", 0.5, [(3 * GB, ["tor2"], 1)], start_s=300.0),
        _job("late-2", 0.35, [(2.5 * GB, ["tor1", "tor2"], 2)], start_s=360.0, stop_s=520.0),
        _job("late-3", 0.8, [(1 * GB, ["tor1"], 8)], start_s=420.0),
        _job("late-4", 0.2, [(1 * GB, ["tor2"], 1)], start_s=480.0),
    ]
    return _scenario(
        "churn-10",
        "ten jobs on two links with arrivals, fixed-length runs and departures",
        links,
        jobs,
    )


def late_joiner() -> Scenario:
    jobs = [_job(f"busy-{i}", 0.2 + 0.1 * i, [(3 * GB, ["link"], 1 + i % 4)]) for i in range(6)]
    jobs.append(_job("newcomer", 0.3, [(2 * GB, ["link"], 1)], start_s=240.0))
    return _scenario(
        "late-joiner",
        "six jobs saturate a link; a seventh joins at 240 s",
        {"link": 100},
        jobs,
    )


def overlap_mix() -> Scenario:
    links = {"a": 100, "b": 100}
    jobs = [
        _job(
            f"ov{int(o * 100)}",
            0.4,
            [(3 * GB, ["a"] if i % 2 else ["a", "b"], 1 + i % 2)],
            overlap=o,
        )
        for i, o in enumerate([0.0, 0.2, 0.4, 0.6, 0.8, 0.9])
    ]
    return _scenario(
        "overlap-mix",
        "six jobs overlapping 0 to 90% of their communication with compute, two links",
        links,
        jobs,
    )


def elephants_mice() -> Scenario:
    jobs = [
        _job("llm-1", 1.0, [(8 * GB, ["tor1", "spine"], 4)]),
        _job("llm-2", 1.2, [(6 * GB, ["tor2", "spine"], 8)]),
    ]
    for i in range(6):
        tor = "tor1" if i % 2 == 0 else "tor2"
        jobs.append(_job(f"small-{i}", 0.1 + 0.05 * i, [(0.5 * GB, [tor, "spine"], 1)]))
    return _scenario(
        "elephants-mice",
        "two large LLM jobs and six small jobs across two ToRs and a spine",
        {"tor1": 100, "tor2": 100, "spine": 200},
        jobs,
    )


def intensity_split() -> Scenario:
    jobs = []
    for i in range(3):
        jobs.append(_job(f"dense-{i}", 1.5, [(2 * GB, ["link"], 1)]))
    for i in range(3):
        jobs.append(_job(f"chatty-{i}", 0.1, [(2 * GB, ["link"], 2)]))
    return _scenario(
        "intensity-split",
        "three GPU-intensive and three communication-bound jobs on one link",
        {"link": 100},
        jobs,
    )


def uniform() -> Scenario:
    return _scenario(
        "uniform-8",
        "eight identical jobs on one link",
        {"link": 100},
        [_job(f"u{i}", 0.3, [(2 * GB, ["link"], 2)]) for i in range(8)],
    )


def learned_ideal() -> Scenario:
    jobs = [
        _job(f"nodecl-{i}", c, [(b * GB, ["link"], n)], declare_ideal=False, start_s=s)
        for i, (c, b, n, s) in enumerate(
            [
                (0.2, 3, 1, 0),
                (0.5, 2, 2, 0),
                (0.3, 4, 1, 20),
                (1.0, 1, 4, 20),
                (0.1, 2, 1, 50),
                (0.6, 3, 2, 90),
            ]
        )
    ]
    return _scenario(
        "learned-ideal-6",
        "six jobs that do not declare their contention-free time (the policy learns it)",
        {"link": 100},
        jobs,
    )


def phase_pair() -> Scenario:
    # Identical jobs started together: with 1 s iterations, half of it communication, they
    # fit on the link only if their communication phases take turns.
    return _scenario(
        "phase-pair",
        "two identical jobs started together, communication half of each 1 s iteration",
        {"link": 100},
        [_job(name, 0.5, [(6.25 * GB, ["link"], 1)]) for name in ("twin-a", "twin-b")],
    )


def phase_harmonic() -> Scenario:
    # Periods 1 s and 2 s (harmonic), 75% of the link on average; pairs start in step.
    return _scenario(
        "phase-harmonic-4",
        "two pairs of identical jobs with 1 s and 2 s iterations, 75% of one link on average",
        {"link": 100},
        [
            _job(name, compute, [(3.125 * GB / 2, ["link"], 2)])
            for name, compute in [
                ("fast-a", 0.75),
                ("fast-b", 0.75),
                ("slow-a", 1.75),
                ("slow-b", 1.75),
            ]
        ],
    )


def phase_racks() -> Scenario:
    # Two racks; each rack's identical pair fits its ToR only taking turns; all four cross
    # the spine, which has room for two at once.
    return _scenario(
        "phase-racks",
        "two identical pairs on two ToRs and a spine, 0.8 s iterations, in step",
        {"tor1": 100, "tor2": 100, "spine": 200},
        [
            _job(name, compute, [(size * GB, [tor, "spine"], 1)])
            for name, compute, size, tor in [
                ("r1-a", 0.45, 4.375, "tor1"),
                ("r1-b", 0.45, 4.375, "tor1"),
                ("r2-a", 0.4, 5.0, "tor2"),
                ("r2-b", 0.4, 5.0, "tor2"),
            ]
        ],
    )


def gpus_mix() -> Scenario:
    # Crux ranks by GPUs x compute per byte on the bottleneck: the big jobs win.
    specs = [(64, 0.8, 3.0, 8), (32, 0.6, 2.0, 4), (16, 0.3, 2.0, 2), (8, 0.2, 1.5, 1)]
    specs += [(8, 0.5, 1.0, 1), (4, 0.1, 2.5, 2)]
    return _scenario(
        "gpus-mix-6",
        "six jobs of 4 to 64 GPUs on one link",
        {"link": 100},
        [
            _job(f"g{g}-{i}", c, [(b * GB / n, ["link"], n)], gpus=g)
            for i, (g, c, b, n) in enumerate(specs)
        ],
    )


def cluster(
    name: str,
    n_jobs: int,
    seed: int,
    *,
    levels: int = 8,
    churn_jobs: bool = False,
    gpus: bool = False,
) -> Scenario:
    """A leaf-spine cluster: three ToR links and a spine, jobs drawn from a seeded RNG."""
    rng = random.Random(seed)
    tors = ["tor1", "tor2", "tor3"]
    links = {"tor1": 100.0, "tor2": 100.0, "tor3": 100.0, "spine": 200.0}
    jobs = []
    for i in range(n_jobs):
        home = rng.choice(tors)
        compute = round(10 ** rng.uniform(-1.0, 0.2), 3)  # 0.1 .. 1.6 s
        n_flows = rng.choice([1, 1, 2, 2, 3])
        flows: list[tuple[float, list[str], int]] = []
        for _ in range(n_flows):
            size = round(10 ** rng.uniform(-0.5, 0.6), 2) * GB  # 0.3 .. 4 GB
            if rng.random() < 0.5:
                path = [home]
            else:
                other = rng.choice([t for t in tors if t != home])
                path = [home, "spine", other]
            flows.append((size, path, rng.choice([1, 2, 4, 8])))
        extra: dict[str, Any] = {}
        if churn_jobs and rng.random() < 0.4:
            start = round(rng.uniform(0, 300), 1)
            extra["start_s"] = start
            if rng.random() < 0.5:
                extra["stop_s"] = round(start + rng.uniform(150, 300), 1)
        if gpus:
            extra["gpus"] = rng.choice([8, 8, 16, 32, 64, 128])
        jobs.append(_job(f"j{i:02d}", compute, flows, **extra))
    return _scenario(
        name,
        f"{n_jobs} jobs on a 3-ToR leaf-spine (4 links), seeded draw {seed}"
        + (", with arrivals and departures" if churn_jobs else "")
        + (", 8 to 128 GPUs per job" if gpus else "")
        + (f", {levels} levels" if levels != 8 else ""),
        links,
        jobs,
        levels=levels,
    )


BUILTIN: dict[str, Callable[[], Scenario]] = {
    "pair-one-link": pair_one_link,
    "flow-count-skew": flow_count_skew,
    "ratio-mix-6": ratio_mix,
    "two-tors": two_tors,
    "staggered-8": staggered,
    "churn-10": churn,
    "late-joiner": late_joiner,
    "overlap-mix": overlap_mix,
    "elephants-mice": elephants_mice,
    "intensity-split": intensity_split,
    "uniform-8": uniform,
    "learned-ideal-6": learned_ideal,
    "cluster-16": lambda: cluster("cluster-16", 16, seed=16),
    "cluster-16-k4": lambda: cluster("cluster-16-k4", 16, seed=17, levels=4),
    "cluster-24-churn": lambda: cluster("cluster-24-churn", 24, seed=24, churn_jobs=True),
    "cluster-32": lambda: cluster("cluster-32", 32, seed=32),
    "phase-pair": phase_pair,
    "phase-harmonic-4": phase_harmonic,
    "phase-racks": phase_racks,
    "gpus-mix-6": gpus_mix,
    "gpus-cluster-12": lambda: cluster("gpus-cluster-12", 12, seed=12, gpus=True),
}


def builtin(name: str) -> Scenario:
    try:
        return BUILTIN[name]()
    except KeyError:
        raise KeyError(f"no built-in scenario {name!r}; try: {', '.join(BUILTIN)}") from None


def all_builtin() -> list[Scenario]:
    return [make() for make in BUILTIN.values()]
