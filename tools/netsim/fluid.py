"""Bandwidth sharing: max-min water-filling with strict priority and per-level minimum shares.

The model is HTB's: every priority level is a class with a guaranteed rate (its minimum
share of each link) and the whole link as ceiling. First every level gets max-min fair
rates inside its guarantees; then, in priority order, each level borrows what is left,
again max-min among its own flows. Flows are elastic (they take whatever they are given),
as long-lived TCP or RDMA transfers are.

Flows with the same path and level always get the same rate under max-min, so callers pass
*classes* -- (path, level, weight) where weight counts the flows -- and get back one rate
per flow of each class. That keeps the cost proportional to the number of distinct
(path, level) pairs rather than to the number of flows.
"""

from __future__ import annotations

from collections.abc import Sequence

# Residual capacities below this (bytes/s) count as zero; float error otherwise leaves
# crumbs that would create pointless extra filling rounds.
_EPS = 1e-6


def waterfill(
    paths: Sequence[Sequence[int]],
    weights: Sequence[float],
    capacity: Sequence[float],
) -> list[float]:
    """Max-min fair per-flow rates for classes of flows sharing links.

    ``paths[i]`` lists the link indices class ``i`` crosses, ``weights[i]`` how many flows
    it holds; ``capacity[l]`` is what link ``l`` has left. Returns each class's per-flow
    rate (progressive filling: raise every unfrozen flow equally, freeze the flows of the
    first link to fill, repeat).
    """
    n = len(paths)
    rates = [0.0] * n
    if n == 0:
        return rates
    cap = list(capacity)
    load = [0.0] * len(cap)  # unfrozen weight per link
    users: dict[int, list[int]] = {}
    for i, path in enumerate(paths):
        w = weights[i]
        for link in path:
            load[link] += w
            users.setdefault(link, []).append(i)
    frozen = [False] * n
    left = n
    while left:
        best = -1
        best_share = 0.0
        for link in users:
            w = load[link]
            if w <= 0:
                continue
            share = max(cap[link], 0.0) / w
            if best < 0 or share < best_share:
                best, best_share = link, share
        if best < 0:
            break
        for i in users[best]:
            if frozen[i]:
                continue
            frozen[i] = True
            left -= 1
            rates[i] = best_share
            w = weights[i]
            amount = best_share * w
            for link in paths[i]:
                cap[link] -= amount
                load[link] -= w
        del users[best]
    return rates


def allocate(
    paths: Sequence[Sequence[int]],
    weights: Sequence[float],
    levels: Sequence[int],
    capacity: Sequence[float],
    shares: Sequence[float] = (),
) -> list[float]:
    """Per-flow rates under strict priority across levels (0 first) with minimum shares.

    ``shares[k]`` is the fraction of every link that level ``k`` is guaranteed (missing or
    zero: none). With a single level this is plain max-min water-filling.
    """
    n = len(paths)
    rates = [0.0] * n
    if n == 0:
        return rates
    by_level: dict[int, list[int]] = {}
    for i, lv in enumerate(levels):
        by_level.setdefault(lv, []).append(i)
    residual = list(capacity)
    order = sorted(by_level)
    if len(order) == 1:
        return waterfill(paths, weights, capacity)
    # Guarantees first: each level alone inside its share of every link.
    for lv in order:
        share = shares[lv] if lv < len(shares) else 0.0
        if share <= 0:
            continue
        members = by_level[lv]
        got = waterfill(
            [paths[i] for i in members],
            [weights[i] for i in members],
            [c * share for c in capacity],
        )
        for i, r in zip(members, got, strict=True):
            rates[i] = r
            amount = r * weights[i]
            for link in paths[i]:
                residual[link] -= amount
    # Then what is left, strictly by priority.
    for lv in order:
        members = by_level[lv]
        live = [max(c, 0.0) if c > _EPS else 0.0 for c in residual]
        extra = waterfill([paths[i] for i in members], [weights[i] for i in members], live)
        for i, r in zip(members, extra, strict=True):
            if r <= 0:
                continue
            rates[i] += r
            amount = r * weights[i]
            for link in paths[i]:
                residual[link] -= amount
    return rates
