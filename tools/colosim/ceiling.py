"""What packing could reach on a training GPU, with the hidden model known exactly.

``python -m tools.colosim ceiling [--mix production] [--max-jobs 4] [--floor 0.5]`` prints,
for the training types of a mix under the simulator's true interference model (uncapped
MPS, memory ignored, no services):

- the utilization of one job alone (what exclusive allocation reaches per busy GPU);
- random packing: k jobs drawn from the mix share a GPU (mean utilization and throughput);
- an oracle's fluid optimum: the best distribution over job sets of up to ``max_jobs``, with
  every job at or above ``floor`` of its alone speed, that consumes the classes in the
  proportions they arrive (a backlog must eventually run all of them). Solved by a
  subgradient on per-class prices over the set values; deterministic.

No policy sees this: it is an upper bound to set the policy's figures against.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tools.colosim.truth import Member, TrueInterference
from tools.colosim.workloads import MIXES, TRAIN_TYPES


@dataclass(frozen=True)
class _Set:
    types: tuple[str, ...]
    util: float
    throughput: float
    slowest: float
    rate: Mapping[str, float]  # progress per class


def _members(combo: Sequence[str]) -> list[Member]:
    """One co-runner per job of ``combo`` (class names), as the hidden model sees it."""
    return [
        Member(
            n, TRAIN_TYPES[n].sm, TRAIN_TYPES[n].bw, TRAIN_TYPES[n].cpu, gamma=TRAIN_TYPES[n].gamma
        )
        for n in combo
    ]


def _sets(model: TrueInterference, names: list[str], max_jobs: int) -> list[_Set]:
    out = []
    for k in range(1, max_jobs + 1):
        for combo in itertools.combinations_with_replacement(names, k):
            speeds = model.speeds(_members(combo))
            rate: dict[str, float] = {}
            for n, v in zip(combo, speeds, strict=True):
                rate[n] = rate.get(n, 0.0) + v
            out.append(
                _Set(
                    combo,
                    sum(TRAIN_TYPES[n].sm * v for n, v in zip(combo, speeds, strict=True)),
                    sum(speeds),
                    min(speeds),
                    rate,
                )
            )
    return out


def ceiling(
    mix: str = "production", max_jobs: int = 4, floor: float = 0.5, seed: int = 0
) -> dict[str, Any]:
    """The report ``ceiling`` prints (see the module docstring)."""
    model = TrueInterference(seed=seed)
    weights = MIXES[mix]
    names = sorted(weights)
    total = sum(weights.values())
    share = {n: weights[n] / total for n in names}
    alone = sum(share[n] * TRAIN_TYPES[n].sm for n in names)
    rng = random.Random(1)
    random_k = {}
    for k in range(1, max_jobs + 1):
        utils, tputs = [], []
        for _ in range(4000):
            combo = rng.choices(names, [weights[n] for n in names], k=k)
            speeds = model.speeds(_members(combo))
            utils.append(sum(TRAIN_TYPES[n].sm * v for n, v in zip(combo, speeds, strict=True)))
            tputs.append(sum(speeds))
        random_k[str(k)] = {
            "util": round(statistics.fmean(utils), 3),
            "util_x_alone": round(statistics.fmean(utils) / alone, 2),
            "throughput": round(statistics.fmean(tputs), 3),
        }
    sets = [s for s in _sets(model, names, max_jobs) if s.slowest >= floor]
    prices = dict.fromkeys(names, 0.0)
    util = tput = 0.0
    rate = dict.fromkeys(names, 0.0)
    iterations = 3000
    for it in range(1, iterations + 1):
        best = max(sets, key=lambda s: s.util - sum(prices[n] * v for n, v in s.rate.items()))
        a = 1.0 / it
        util = (1 - a) * util + a * best.util
        tput = (1 - a) * tput + a * best.throughput
        for n in names:
            rate[n] = (1 - a) * rate[n] + a * best.rate.get(n, 0.0)
        for n in names:
            # Over-consumed against the arrival mix: dearer.
            prices[n] += 0.5 / math.sqrt(it) * (rate[n] - share[n] * tput)
    return {
        "mix": mix,
        "alone_util": round(alone, 3),
        "random": random_k,
        "oracle": {
            "max_jobs": max_jobs,
            "floor": floor,
            "util": round(util, 3),
            "util_x_alone": round(util / alone, 2),
            "throughput": round(tput, 3),
            "worst_class_vs_mix": round(min(rate[n] / (share[n] * tput) for n in names), 2),
        },
    }
