"""Elastic shadow prices: the node-wide allocation as per-job choices under prices.

Every (GPU, resource) pair has a price. Each job picks the option (a GPU and a
configuration) that maximizes its utility minus the priced resources it would use, or
none when every option costs more than it is worth.

A job's choice is indivisible, so usage jumps as prices cross a job's indifference point
and a plain subgradient on it oscillates for ever. Prices therefore move on each job's
*smoothed* demand: a logit over its options and waiting (``temperature`` in utility
units), which is the gradient of the entropy-regularized dual -- smooth, so a damped
projected step settles: ``p <- max(0, p + step * (use - cap))``, blended with the old price
by ``damping``. The reported choice is still each job's best option at the final prices.
The residual is the largest over-use of a resource by the smoothed demand, or
complementary-slackness gap (a positive price on a resource left idle, price times the
idle capacity), in capacity units; converged when it is within ``tolerance``. Each price's
step grows while the sign of its excess demand holds and halves when it flips; when the
residual has not improved for ``RESTART_AFTER`` iterations (two prices' steps can cycle
around the clearing point, each halving and regrowing in turn), the steps start afresh
from where the prices are.

The prices only guide: the planner enforces hard constraints (memory) afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

RESOURCES: tuple[str, ...] = ("sm", "mem", "bw")
# Iterations without the residual improving after which the steps start afresh.
RESTART_AFTER = 30

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

    step: float = 0.05
    damping: float = 0.5
    temperature: float = 0.05
    max_iterations: int = 60
    tolerance: float = 0.02
    prices: dict[Key, float] = field(default_factory=dict)

    def _values(self, options: Sequence[Option], prices: Mapping[Key, float]) -> list[float]:
        return [
            o.utility - sum(prices.get((o.gpu, r), 0.0) * d for r, d in o.demand.items())
            for o in options
        ]

    def _choose(self, options: Sequence[Option], prices: Mapping[Key, float]) -> int | None:
        best, best_value = None, 0.0
        for i, value in enumerate(self._values(options, prices)):
            if value > best_value + 1e-12:
                best, best_value = i, value
        return best

    def _demand(self, options: Sequence[Option], prices: Mapping[Key, float]) -> list[float]:
        """Logit weights of each option (waiting has value 0 and takes the rest)."""
        values = self._values(options, prices)
        top = max(0.0, *values) if values else 0.0
        t = max(self.temperature, 1e-9)
        e = [math.exp((v - top) / t) for v in values]
        z = math.exp(-top / t) + sum(e)
        return [x / z for x in e]

    def solve(
        self, options: Mapping[str, Sequence[Option]], capacity: Mapping[Key, float]
    ) -> PriceResult:
        """Settle prices for ``options`` against ``capacity`` (free capacity per key)."""
        prices = {k: self.prices.get(k, 0.0) for k in capacity}
        steps = dict.fromkeys(capacity, self.step)
        last = dict.fromkeys(capacity, 0.0)
        residual = math.inf
        best, since_best = math.inf, 0
        iterations = 0
        for k in range(1, self.max_iterations + 1):
            iterations = k
            usage = dict.fromkeys(capacity, 0.0)
            for opts in options.values():
                for o, w in zip(opts, self._demand(opts, prices), strict=True):
                    for r, d in o.demand.items():
                        key = (o.gpu, r)
                        if key in usage:
                            usage[key] += w * d
            residual = max(
                (
                    usage[key] - cap
                    if usage[key] > cap
                    else min(prices[key], 1.0) * (cap - usage[key])
                    for key, cap in capacity.items()
                ),
                default=0.0,
            )
            if residual <= self.tolerance:
                break  # settled: a warm start on the same market leaves the prices alone
            if residual < best - self.tolerance / 10:
                best, since_best = residual, 0
            else:
                since_best += 1
            if since_best >= RESTART_AFTER:
                # The steps of two prices can settle into a cycle around the clearing
                # point (each halves and regrows in turn): start them afresh from where
                # the prices are, as the next pass would.
                steps, last = dict.fromkeys(capacity, self.step), dict.fromkeys(capacity, 0.0)
                best, since_best = residual, 0
            for key, cap in capacity.items():
                g = usage[key] - cap
                p = prices[key]
                if g < 0 and p <= 0.0:
                    continue  # idle and free: nothing to correct
                # Each price keeps its own step: longer while the sign of its excess demand
                # holds, halved when it flips (the price overshot the clearing point).
                if g * last[key] < 0:
                    steps[key] *= self.damping
                elif g * last[key] > 0:
                    steps[key] *= 1.0 + self.damping / 2
                last[key] = g
                prices[key] = max(0.0, p + steps[key] * min(1.0, max(-1.0, g)))
                if prices[key] == 0.0:
                    # Free again: the next excess starts from the first step. Kept, the long
                    # step that brought the price down threw it far past the clearing
                    # point, and the price swung between 0 and ever larger values.
                    steps[key], last[key] = self.step, 0.0
        self.prices.update(prices)
        return PriceResult(
            choices={job: self._choose(opts, prices) for job, opts in options.items()},
            prices=dict(prices),
            iterations=iterations,
            residual=residual,
            converged=residual <= self.tolerance,
        )
