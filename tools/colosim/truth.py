"""The hidden, true interference model of the simulator. Policies never see it.

On one GPU under MPS, member i runs with an SM cap ``share_i`` and a duty ``d_i`` (a
training job's throttle; for an inference service, its busy fraction). Its speed over
alone-on-the-whole-GPU is::

    rel_i   = min(1, share_i / sm_i) ** gamma_i                       (its shape)
    D       = sum_j min(sm_j, share_j) * d_j                          (SM demand)
    B       = sum_j bw_j * rel_j * d_j                                (bandwidth demand)
    C       = sum_j cpu_j * d_j                                       (host CPU demand)
    speed_i = rel_i * d_i / max(1, D) / max(1, B) ** (bw_i / (bw_i + sm_i))
              * prod_{j != i} (1 - kappa_ij * d_j) / max(1, C) ** (cpu_i / (cpu_i + 0.1))

with a pair term ``kappa_ij = kappa0 + kappa1 * bw_i * bw_j + eps_ij`` for cache and DRAM
thrash, ``eps_ij`` a per-type-pair draw (seeded, half-normal) that no feature reveals.

Calibration (docs/colocate.md): for every pair of training types uncapped (share 1, d 1),
the combined normalized throughput speed_a + speed_b has median 1.37 and about a fifth of
pairs below 1.0, as Gavel's V100 measurements of job pairs sharing a GPU under MPS
(gavel_phys_throughputs.json, "v100_unconsolidated": median 1.367, 21.8% below 1.0).
:func:`calibration` computes those two figures; a unit test holds them.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from tools.colosim.workloads import TRAIN_TYPES

# Gavel, V100, pairs under MPS without SM limits ("v100_unconsolidated", 330 feasible pairs).
GAVEL_V100_MEDIAN = 1.367
GAVEL_V100_BELOW_ONE = 0.218


@dataclass(frozen=True)
class Member:
    key: str
    sm: float
    bw: float
    cpu: float
    share: float = 1.0
    duty: float = 1.0
    gamma: float = 0.85
    throttled: bool = True  # training: duty slows it; inference: duty is only its footprint


@dataclass(frozen=True)
class TrueInterference:
    seed: int = 0
    kappa0: float = 0.14
    kappa1: float = 0.5
    sigma: float = 0.1

    def pair_term(self, a: str, b: str) -> float:
        x, y = sorted((a, b))
        digest = hashlib.blake2b(f"{self.seed}:{x}:{y}".encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "big") + 0.5) / 2.0**64
        # Half-normal through the inverse error function's cheap cousin: |N(0,1)| quantile.
        z = math.sqrt(2.0) * _erfinv(u)
        return self.sigma * abs(z)

    def speeds(self, members: Sequence[Member]) -> list[float]:
        rel = [min(1.0, m.share / m.sm) ** m.gamma if m.sm > 0 else 1.0 for m in members]
        demand = sum(min(m.sm, m.share) * m.duty for m in members)
        bw = sum(m.bw * r * m.duty for m, r in zip(members, rel, strict=True))
        cpu = sum(m.cpu * m.duty for m in members)
        out = []
        for i, m in enumerate(members):
            s = rel[i] * (m.duty if m.throttled else 1.0)
            s /= max(1.0, demand)
            s /= max(1.0, bw) ** (m.bw / (m.bw + m.sm)) if m.bw + m.sm > 0 else 1.0
            s /= max(1.0, cpu) ** (m.cpu / (m.cpu + 0.1))
            for j, o in enumerate(members):
                if j != i:
                    kappa = self.kappa0 + self.kappa1 * m.bw * o.bw + self.pair_term(m.key, o.key)
                    s *= max(0.05, 1.0 - min(0.9, kappa) * o.duty)
            out.append(s)
        return out


def _erfinv(u: float) -> float:
    """Inverse of erf on [0, 1) by bisection (only used for a few hundred draws)."""
    lo, hi = 0.0, 6.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if math.erf(mid) < u:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def calibration(model: TrueInterference | None = None) -> tuple[float, float]:
    """(median combined normalized throughput, fraction below 1.0) over all type pairs."""
    m = model or TrueInterference()
    names = sorted(TRAIN_TYPES)
    combined = []
    for i, a in enumerate(names):
        for b in names[i:]:
            ta, tb = TRAIN_TYPES[a], TRAIN_TYPES[b]
            sa, sb = m.speeds(
                [
                    Member(a, ta.sm, ta.bw, ta.cpu, gamma=ta.gamma),
                    Member(b, tb.sm, tb.bw, tb.cpu, gamma=tb.gamma),
                ]
            )
            combined.append(sa + sb)
    return statistics.median(combined), sum(c < 1.0 for c in combined) / len(combined)
