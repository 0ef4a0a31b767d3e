"""Elastic shadow prices: the node-wide allocation as per-job choices under prices.

Every (GPU, resource) pair has a price. Each job picks the option (a GPU and a
configuration) that maximizes its utility minus the priced resources it would use, or
none when every option costs more than it is worth. Prices then move by a damped projected
subgradient on the dual: up where the chosen options over-use a resource, down (never
below zero) where it is left idle with a positive price. The step shrinks as
``step / sqrt(k)`` and each new price is blended with the old one (``damping``), so on a
stationary input the prices settle; the result reports the iterations and the residual
(the largest relative over-use or complementary-slackness gap).

The prices only guide: the planner enforces hard constraints (memory) afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

RESOURCES: tuple[str, ...] = ("sm", "mem", "bw")

Key = tuple[int, str]


@dataclass(frozen=True)
class Option:
    """One way to run a job: on ``gpu``, with ``demand`` per resource (capacity units)."""

    gpu: int
    utility: float
    demand: Mapping[str, float]
    tag: object = None


@dataclass(frozen=True)
class PriceResult:
    choices: Mapping[str, int | None]  # job -> index into its options, None: wait
    prices: Mapping[Key, float]
    iterations: int
    residual: float
    converged: bool


@dataclass
class ShadowPrices:
    """Prices kept between planning passes (a warm start settles in a few iterations)."""

    step: float = 0.6
    damping: float = 0.5
    max_iterations: int = 40
    tolerance: float = 0.02
    prices: dict[Key, float] = field(default_factory=dict)
    # The step keeps shrinking across passes while the same jobs compete, so that indivisible
    # choices (a job either fits or not) cannot make the prices oscillate for ever.
    _rounds: int = 0
    _market: frozenset[str] = frozenset()

    def _choose(self, options: Sequence[Option], prices: Mapping[Key, float]) -> int | None:
        best, best_value = None, 0.0
        for i, o in enumerate(options):
            cost = sum(prices.get((o.gpu, r), 0.0) * d for r, d in o.demand.items())
            value = o.utility - cost
            if value > best_value + 1e-12:
                best, best_value = i, value
        return best

    def solve(
        self, options: Mapping[str, Sequence[Option]], capacity: Mapping[Key, float]
    ) -> PriceResult:
        """Settle prices for ``options`` against ``capacity`` (free capacity per key)."""
        prices = {k: self.prices.get(k, 0.0) for k in capacity}
        market = frozenset(options)
        if market != self._market:
            self._market, self._rounds = market, 0
        choices: dict[str, int | None] = {}
        residual = math.inf
        iterations = 0
        for k in range(1, self.max_iterations + 1):
            iterations = k
            choices = {job: self._choose(opts, prices) for job, opts in options.items()}
            usage = dict.fromkeys(capacity, 0.0)
            for job, idx in choices.items():
                if idx is None:
                    continue
                o = options[job][idx]
                for r, d in o.demand.items():
                    key = (o.gpu, r)
                    if key in usage:
                        usage[key] += d
            residual = 0.0
            moved = 0.0
            self._rounds += 1
            step = self.step / math.sqrt(self._rounds)
            for key, cap in capacity.items():
                g = (usage[key] - cap) / max(cap, 1e-6) if cap > 0 else usage[key]
                p = prices[key]
                residual = max(residual, g if g > 0 else (p * -g if p > 0 else 0.0))
                target = max(0.0, p + step * g)
                new = (1.0 - self.damping) * p + self.damping * target
                moved = max(moved, abs(new - p))
                prices[key] = new
            if residual <= self.tolerance and moved <= self.tolerance:
                break
        self.prices.update(prices)
        return PriceResult(
            choices=choices,
            prices=dict(prices),
            iterations=iterations,
            residual=residual,
            converged=residual <= self.tolerance,
        )
