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
step grows while the sign of its excess demand holds and halves when it flips; a step that
would raise the dual (the prices' steps overshooting together, or two of them cycling round
the clearing point) is not taken, and all steps halve: every step taken lowers the smooth,
convex dual, so the prices settle on any stationary market.

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

    def _market(
        self,
        options: Mapping[str, Sequence[Option]],
        prices: Mapping[Key, float],
        capacity: Mapping[Key, float],
    ) -> tuple[dict[Key, float], float]:
        """The smoothed usage of each priced resource at ``prices``, and the value there of
        the dual these prices minimize, ``sum(p * cap) + sum_jobs T * log(1 + sum_o
        exp(value_o / T))`` (waiting is worth 0): its gradient is ``cap - usage``."""
        usage = dict.fromkeys(capacity, 0.0)
        t = max(self.temperature, 1e-9)
        dual = sum(prices[key] * cap for key, cap in capacity.items())
        for opts in options.values():
            values = self._values(opts, prices)
            top = max(0.0, *values) if values else 0.0
            e = [math.exp((v - top) / t) for v in values]
            z = math.exp(-top / t) + sum(e)
            dual += top + t * math.log(z)
            for o, x in zip(opts, e, strict=True):
                for r, d in o.demand.items():
                    key = (o.gpu, r)
                    if key in usage:
                        usage[key] += x / z * d
        return usage, dual

    def solve(
        self, options: Mapping[str, Sequence[Option]], capacity: Mapping[Key, float]
    ) -> PriceResult:
        """Settle prices for ``options`` against ``capacity`` (free capacity per key)."""
        prices = {k: self.prices.get(k, 0.0) for k in capacity}
        steps = dict.fromkeys(capacity, self.step)
        last = dict.fromkeys(capacity, 0.0)
        usage, dual = self._market(options, prices, capacity)
        residual = math.inf
        iterations = 0
        for k in range(1, self.max_iterations + 1):
            iterations = k
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
            trial, kept = dict(prices), (dict(steps), dict(last))
            for key, cap in capacity.items():
                g = usage[key] - cap
                p = trial[key]
                if g < 0 and p <= 0.0:
                    continue  # idle and free: nothing to correct
                # Each price keeps its own step: longer while the sign of its excess demand
                # holds, halved when it flips (the price overshot the clearing point).
                if g * last[key] < 0:
                    steps[key] *= self.damping
                elif g * last[key] > 0:
                    steps[key] *= 1.0 + self.damping / 2
                last[key] = g
                trial[key] = max(0.0, p + steps[key] * min(1.0, max(-1.0, g)))
                if trial[key] == 0.0:
                    # Free again: the next excess starts from the first step. Kept, the long
                    # step that brought the price down threw it far past the clearing
                    # point, and the price swung between 0 and ever larger values.
                    steps[key], last[key] = self.step, 0.0
            trial_usage, trial_dual = self._market(options, trial, capacity)
            if trial_dual > dual + 1e-12 * max(1.0, abs(dual)):
                # Uphill: the steps overshot together (each price's own sign can hold
                # while two of them cycle round the clearing point). Shorter steps from the
                # same prices; every accepted step lowers the dual, so the prices settle.
                steps = {key: s * self.damping for key, s in kept[0].items()}
                last = kept[1]
                continue
            prices, usage, dual = trial, trial_usage, trial_dual
        self.prices.update(prices)
        return PriceResult(
            choices={job: self._choose(opts, prices) for job, opts in options.items()},
            prices=dict(prices),
            iterations=iterations,
            residual=residual,
            converged=residual <= self.tolerance,
        )
