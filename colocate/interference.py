"""Interference predictor: how much a job slows down next to others on one GPU.

Features are what NVML and psutil show for each job when it runs alone (or the best
estimate so far): SM activity (``nvmlDeviceGetUtilizationRates().gpu`` or the per-process
SM utilization), memory-controller utilization (the ``.memory`` field), PCIe and NVLink
throughput as a fraction of the link, memory footprint as a fraction of the device, and on
the host the CPU use of the job's process tree (in cores, over the host's cores) and its
RSS. Co-runners are folded into one aggregate neighbour (their activities add up), so the
same pairwise model serves a GPU with three jobs.

The target is ``-ln(speed_shared / speed_alone)``, a non-negative log-slowdown, modelled
as a linear function of contention features: SM over-subscription ``ln(max(1, a_i+a_j))``,
bandwidth over-subscription, the neighbour's bandwidth (cache and DRAM thrash), link and
host-CPU over-subscription. The weights start from a physical prior (proportional sharing
of over-subscribed SMs) and are refined online by recursive least squares with
forgetting, from slowdowns gpud observes. The running mean absolute error of the predicted
speed factor is exposed.

What it learned is a plain, versioned dict (:meth:`InterferencePredictor.to_dict`, JSON-safe)
that :meth:`InterferencePredictor.from_dict` validates and restores exactly: the same
predictions and margins after a round trip.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any


@dataclass(frozen=True)
class JobFeatures:
    """One job's footprint alone on a GPU, each in [0, 1] unless stated.

    ``sm``: SM activity. ``mem_bw``: memory-controller utilization. ``pcie``/``nvlink``:
    link throughput over link capacity. ``mem_frac``: device memory used over total.
    ``host_cpu``: CPU use of the process tree over the host's cores. ``rss_frac``: RSS over
    host memory.
    """

    sm: float
    mem_bw: float
    pcie: float = 0.0
    nvlink: float = 0.0
    mem_frac: float = 0.0
    host_cpu: float = 0.0
    rss_frac: float = 0.0
    presence: float = 1.0
    key: str = ""

    def scaled(self, factor: float) -> JobFeatures:
        """The footprint of the job running at ``factor`` of its speed (a cap or a duty cycle)."""
        f = max(0.0, min(1.0, factor))
        return JobFeatures(
            sm=self.sm * f,
            mem_bw=self.mem_bw * f,
            pcie=self.pcie * f,
            nvlink=self.nvlink * f,
            mem_frac=self.mem_frac,
            host_cpu=self.host_cpu * f,
            rss_frac=self.rss_frac,
            presence=self.presence * f,
            key=self.key,
        )


def aggregate(features: Iterable[JobFeatures]) -> JobFeatures:
    """Co-runners as one neighbour: activities and throughputs add up."""
    fs = list(features)
    return JobFeatures(
        sm=sum(f.sm for f in fs),
        mem_bw=sum(f.mem_bw for f in fs),
        pcie=sum(f.pcie for f in fs),
        nvlink=sum(f.nvlink for f in fs),
        mem_frac=sum(f.mem_frac for f in fs),
        host_cpu=sum(f.host_cpu for f in fs),
        rss_frac=sum(f.rss_frac for f in fs),
        presence=sum(f.presence for f in fs),
    )


def _over(x: float) -> float:
    return math.log(max(1.0, x))


def pair_features(me: JobFeatures, other: JobFeatures) -> tuple[float, ...]:
    return (
        other.presence,
        _over(me.sm + other.sm),
        _over(me.mem_bw + other.mem_bw),
        other.mem_bw * me.mem_bw,
        other.sm * me.sm,
        _over(me.pcie + other.pcie) + _over(me.nvlink + other.nvlink),
        _over(me.host_cpu + other.host_cpu),
        _over(me.rss_frac + other.rss_frac),
    )


# Prior: over-subscribed SMs are shared in proportion (weight 1 on ln of the demand), the
# same for bandwidth, a little thrash from a heavy neighbour, a cost per co-runner (context
# switches, cache and TLB refills: Gavel's pairs lose about a third of their speed when
# nothing is over-subscribed, more than the demand terms explain).
PRIOR_WEIGHTS: tuple[float, ...] = (0.15, 1.0, 0.8, 0.3, 0.05, 0.6, 0.6, 1.0)

# How well a pair of job classes is known: the fewest observations of any (job, neighbour)
# pair in a prediction. Residuals are kept per bucket, so the margin a prediction carries
# is the error of predictions like it.
PAIR_BUCKETS: tuple[int, ...] = (0, 1, 30)
# How margins() and margin_errors() name each bucket.
STANDINGS: tuple[str, ...] = tuple(f"{lo}+" if lo else "0" for lo in PAIR_BUCKETS)

# Errors a margin needs before its quantile stands on its own; a bucket with fewer is scant.
QUANTILE_ERRORS = 30
# How long a scant bucket keeps an error (seconds of the predictor's clock); 0: for good.
SCANT_MEMORY_S = 900.0


STATE_KIND = "colocate.InterferencePredictor"
STATE_VERSION = 1


@dataclass
class PredictorStats:
    samples: int
    mean_abs_error: float
    mean_error: float


@dataclass
class _Pair:
    bias: float = 0.0  # learned log-slowdown the features do not explain
    n: int = 0


class InterferencePredictor:
    """Online linear model of log-slowdown; see the module docstring."""

    def __init__(
        self,
        prior: Sequence[float] = PRIOR_WEIGHTS,
        *,
        prior_strength: float = 20.0,
        forgetting: float = 0.995,
        error_decay: float = 0.05,
        pair_shrink: float = 5.0,
        pair_memory: int = 200,
        error_window: int = 400,
        scant_memory_s: float = SCANT_MEMORY_S,
    ) -> None:
        n = len(prior)
        self.weights = list(prior)
        # Inverse of the prior's confidence: a small P keeps the prior until data outweighs it.
        self._p = [[(1.0 / prior_strength if i == j else 0.0) for j in range(n)] for i in range(n)]
        self._lambda = forgetting
        self._p_cap = 1.0 / prior_strength
        self._decay = error_decay
        self._samples = 0
        self._mae = 0.0
        self._me = 0.0
        self._pairs: dict[tuple[str, str], _Pair] = {}
        self._shrink = pair_shrink
        self._pair_memory = pair_memory
        self._resid: list[deque[float]] = [deque(maxlen=error_window) for _ in PAIR_BUCKETS]
        self._quantiles: dict[tuple[int, float], float] = {}
        self._fresh = [0 for _ in PAIR_BUCKETS]
        # The predictor's own clock (seconds it was advanced), each error's time on it.
        self._clock_s = 0.0
        self._stamps: list[deque[float]] = [deque(maxlen=error_window) for _ in PAIR_BUCKETS]
        self.scant_memory_s = scant_memory_s

    # -- prediction -----------------------------------------------------------------------
    def _keys(self, me: JobFeatures, others: Sequence[JobFeatures]) -> list[tuple[str, str]] | None:
        if not me.key or any(not o.key for o in others):
            return None
        return [(me.key, o.key) for o in others]

    def _bucket(self, keys: list[tuple[str, str]] | None) -> int:
        if not keys:
            return 0
        n = min(self._pairs[k].n if k in self._pairs else 0 for k in keys)
        return max(i for i, lo in enumerate(PAIR_BUCKETS) if n >= lo)

    def _raw(self, me: JobFeatures, others: Sequence[JobFeatures]) -> float:
        x = pair_features(me, aggregate(others))
        ls = sum(w * v for w, v in zip(self.weights, x, strict=True))
        for k, o in zip(self._keys(me, others) or (), others, strict=False):
            pair = self._pairs.get(k)
            if pair is not None:
                ls += pair.bias * min(1.0, o.presence)
        return ls

    def log_slowdown(self, me: JobFeatures, others: Sequence[JobFeatures]) -> float:
        if not others:
            return 0.0
        return max(0.0, self._raw(me, others))

    def speed(self, me: JobFeatures, others: Sequence[JobFeatures]) -> float:
        """Predicted speed next to ``others`` over speed alone, in (0, 1]."""
        return math.exp(-self.log_slowdown(me, others))

    def margin(self, me: JobFeatures, others: Sequence[JobFeatures], quantile: float) -> float:
        """How much slower than predicted (in log-speed) the job runs in ``quantile`` of
        recent predictions like this one: same standing of its pairs (never seen, seen a
        little, well known). 0 when predictions like it were never worse than observed, or
        when the few errors of predictions like it are older than ``scant_memory_s``
        (:meth:`advance`)."""
        if not others:
            return 0.0
        b = self._bucket(self._keys(me, others))
        # A bucket with too few residuals borrows the next less-known one's: never a smaller
        # margin for less evidence.
        while b > 0 and len(self._resid[b]) < QUANTILE_ERRORS:
            b -= 1
        key = (b, quantile)
        if key not in self._quantiles:
            r = sorted(self._resid[b])
            self._quantiles[key] = (
                max(0.0, r[min(len(r) - 1, int(quantile * len(r)))]) if r else 0.0
            )
        return self._quantiles[key]

    def margins(self, quantile: float = 0.9) -> dict[str, float]:
        """The margin at ``quantile`` for each standing of a prediction's pairs, by the
        fewest observations of any of its pairs ("0", "1+", "30+")."""
        out = {}
        for standing, resid in zip(STANDINGS, self._resid, strict=True):
            r = sorted(resid)
            if r:
                out[standing] = max(0.0, r[min(len(r) - 1, int(quantile * len(r)))])
        return out

    def margin_errors(self) -> dict[str, int]:
        """How many errors each margin of :meth:`margins` stands on, by the same keys: a
        margin on a handful is one unlucky pair more than a quantile."""
        return {standing: len(r) for standing, r in zip(STANDINGS, self._resid, strict=True) if r}

    def speed_bound(
        self, me: JobFeatures, others: Sequence[JobFeatures], quantile: float = 0.9
    ) -> float:
        """A speed the job reaches or beats in ``quantile`` of predictions like this one."""
        return self.speed_and_bound(me, others, quantile)[1]

    def speed_and_bound(
        self, me: JobFeatures, others: Sequence[JobFeatures], quantile: float = 0.9
    ) -> tuple[float, float]:
        """:meth:`speed` and :meth:`speed_bound`, from one prediction."""
        if not others:
            return 1.0, 1.0
        ls = self.log_slowdown(me, others)
        return math.exp(-ls), math.exp(-ls - self.margin(me, others, quantile))

    # -- learning -------------------------------------------------------------------------
    def advance(self, seconds: float) -> None:
        """Move the predictor's clock on by ``seconds`` (the time between two ticks of the
        loop that feeds it). With ``scant_memory_s`` above 0, a bucket with fewer than
        ``QUANTILE_ERRORS`` errors forgets those older than that: a margin on scant
        evidence, such as the one error of the first never-seen pair a node tried, otherwise
        stands for good, since a margin that keeps new pairs off brings no errors to narrow
        it. Off by default: the pairs tried again at margin 0 are a risk too (see
        docs/colocate.md)."""
        if not seconds > 0 or not math.isfinite(seconds):
            return
        self._clock_s += seconds
        if not self.scant_memory_s:
            return
        oldest = self._clock_s - self.scant_memory_s
        for b, (resid, stamps) in enumerate(zip(self._resid, self._stamps, strict=True)):
            if len(resid) >= QUANTILE_ERRORS or not stamps or stamps[0] >= oldest:
                continue
            while stamps and stamps[0] < oldest:
                stamps.popleft()
                resid.popleft()
            self._quantiles = {k: v for k, v in self._quantiles.items() if k[0] != b}

    def observe(self, me: JobFeatures, others: Sequence[JobFeatures], speed: float) -> None:
        """Learn from one observed speed factor (shared throughput over alone throughput)."""
        if not others or not (0.0 < speed <= 1.5):
            return
        predicted = self.speed(me, others)
        err = predicted - speed
        self._samples += 1
        d = self._decay if self._samples > 1 else 1.0
        self._mae = (1 - d) * self._mae + d * abs(err)
        self._me = (1 - d) * self._me + d * err
        y = -math.log(min(1.0, speed))
        keys = self._keys(me, others)
        # The error of this prediction, before learning from it, for the margins.
        b = self._bucket(keys)
        self._resid[b].append(y - self.log_slowdown(me, others))
        self._stamps[b].append(self._clock_s)
        self._fresh[b] += 1
        if self._fresh[b] >= 20 or len(self._resid[b]) <= QUANTILE_ERRORS:
            self._fresh[b] = 0
            self._quantiles = {k: v for k, v in self._quantiles.items() if k[0] != b}
        pair_part = self._raw(me, others) - sum(
            w * v for w, v in zip(self.weights, pair_features(me, aggregate(others)), strict=True)
        )
        self._fit(pair_features(me, aggregate(others)), y - pair_part)
        if keys:
            resid = y - self._raw(me, others)
            weights = [1.0 / (self._pairs.get(k, _Pair()).n + self._shrink) for k in keys]
            total = 1.0 + sum(weights)
            for k, w, o in zip(keys, weights, others, strict=True):
                pair = self._pairs.setdefault(k, _Pair())
                pair.bias += resid * w / total * min(1.0, o.presence)
                pair.n = min(pair.n + 1, self._pair_memory)

    def _fit(self, x: tuple[float, ...], y: float) -> None:
        """One recursive-least-squares step of the shared weights towards target ``y``."""
        n = len(x)
        # Forgetting inflates P where the data carry no information; stop at the prior's
        # confidence so that an idle feature cannot make the model jumpy.
        lam = self._lambda if max(self._p[i][i] for i in range(n)) < self._p_cap else 1.0
        px = [sum(self._p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = lam + sum(x[i] * px[i] for i in range(n))
        gain = [v / denom for v in px]
        resid = y - sum(w * v for w, v in zip(self.weights, x, strict=True))
        self.weights = [w + g * resid for w, g in zip(self.weights, gain, strict=True)]
        self._p = [[(self._p[i][j] - gain[i] * px[j]) / lam for j in range(n)] for i in range(n)]

    def stats(self) -> PredictorStats:
        return PredictorStats(self._samples, self._mae, self._me)

    # -- what outlives the process ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Everything it learned and how it learns, as JSON-safe values (lists, str, int,
        finite floats); :meth:`from_dict` restores it exactly."""
        window = self._resid[0].maxlen
        return {
            "kind": STATE_KIND,
            "version": STATE_VERSION,
            "params": {
                "forgetting": self._lambda,
                "p_cap": self._p_cap,
                "error_decay": self._decay,
                "pair_shrink": self._shrink,
                "pair_memory": self._pair_memory,
                "error_window": window,
                "scant_memory_s": self.scant_memory_s,
            },
            "weights": list(self.weights),
            "p": [list(row) for row in self._p],
            "samples": self._samples,
            "mae": self._mae,
            "me": self._me,
            "pairs": [[a, b, p.bias, p.n] for (a, b), p in sorted(self._pairs.items())],
            "residuals": [list(r) for r in self._resid],
            "clock_s": self._clock_s,
            "stamps": [list(st) for st in self._stamps],
            "fresh": list(self._fresh),
            "quantiles": [[b, q, v] for (b, q), v in sorted(self._quantiles.items())],
        }

    @classmethod
    def from_dict(cls, data: object) -> InterferencePredictor:
        """The predictor :meth:`to_dict` described. Raises ``ValueError`` naming the field
        for anything else: another kind or version, a missing field, a wrong type or length
        (a model with another number of features), a number out of range or not finite."""
        d = _mapping(data, "state")
        if d.get("kind") != STATE_KIND:
            raise ValueError(f"kind {d.get('kind')!r} is not {STATE_KIND!r}")
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"version {d.get('version')!r}: this one reads {STATE_VERSION}")
        params = _mapping(d.get("params"), "params")
        forgetting = _number(params.get("forgetting"), "params.forgetting", 0.0, 1.0)
        p_cap = _number(params.get("p_cap"), "params.p_cap", 0.0, math.inf)
        decay = _number(params.get("error_decay"), "params.error_decay", 0.0, 1.0)
        shrink = _number(params.get("pair_shrink"), "params.pair_shrink", 0.0, math.inf)
        memory = _count(params.get("pair_memory"), "params.pair_memory", 1)
        window = _count(params.get("error_window"), "params.error_window", 1)
        scant = _number(
            params.get("scant_memory_s", SCANT_MEMORY_S), "params.scant_memory_s", 0.0, 1e9
        )
        if forgetting == 0.0 or p_cap == 0.0 or decay == 0.0:
            raise ValueError("params: forgetting, p_cap and error_decay must be above 0")
        n = len(PRIOR_WEIGHTS)
        weights = [
            _number(w, f"weights[{i}]")
            for i, w in enumerate(_items(d.get("weights"), "weights", n))
        ]
        p = [
            [_number(v, f"p[{i}][{j}]") for j, v in enumerate(_items(row, f"p[{i}]", n))]
            for i, row in enumerate(_items(d.get("p"), "p", n))
        ]
        out = cls(
            weights,
            forgetting=forgetting,
            error_decay=decay,
            pair_shrink=shrink,
            pair_memory=memory,
            error_window=window,
            scant_memory_s=scant,
        )
        out._p, out._p_cap = p, p_cap
        out._samples = _count(d.get("samples"), "samples", 0)
        out._mae = _number(d.get("mae"), "mae", 0.0, math.inf)
        out._me = _number(d.get("me"), "me")
        for i, item in enumerate(_items(d.get("pairs"), "pairs")):
            a, b, bias, count = _items(item, f"pairs[{i}]", 4)
            if not isinstance(a, str) or not isinstance(b, str) or not a or not b:
                raise ValueError(f"pairs[{i}]: job classes must be non-empty strings")
            if (a, b) in out._pairs:
                raise ValueError(f"pairs[{i}]: ({a!r}, {b!r}) given twice")
            out._pairs[(a, b)] = _Pair(
                _number(bias, f"pairs[{i}].bias"), _count(count, f"pairs[{i}].n", 0, memory)
            )
        buckets = len(PAIR_BUCKETS)
        for b, values in enumerate(_items(d.get("residuals"), "residuals", buckets)):
            kept = _items(values, f"residuals[{b}]")
            if len(kept) > window:
                raise ValueError(f"residuals[{b}]: {len(kept)} errors, the window is {window}")
            out._resid[b].extend(_number(v, f"residuals[{b}][{k}]") for k, v in enumerate(kept))
        out._clock_s = _number(d.get("clock_s", 0.0), "clock_s", 0.0, math.inf)
        # Absent from files written before errors had times: every kept error is fresh.
        stamps = d.get("stamps")
        per_bucket = [None] * buckets if stamps is None else _items(stamps, "stamps", buckets)
        for b, times in enumerate(per_bucket):
            field = f"stamps[{b}]"
            kept_times = (
                [out._clock_s] * len(out._resid[b])
                if times is None
                else [
                    _number(v, f"{field}[{k}]", 0.0, out._clock_s)
                    for k, v in enumerate(_items(times, field, len(out._resid[b])))
                ]
            )
            if any(a > c for a, c in pairwise(kept_times)):
                raise ValueError(f"{field}: the times of the errors go backwards")
            out._stamps[b].extend(kept_times)
        out._fresh = [
            _count(v, f"fresh[{b}]", 0)
            for b, v in enumerate(_items(d.get("fresh"), "fresh", buckets))
        ]
        for i, item in enumerate(_items(d.get("quantiles"), "quantiles")):
            b, q, v = _items(item, f"quantiles[{i}]", 3)
            key = (
                _count(b, f"quantiles[{i}].bucket", 0, buckets - 1),
                _number(q, f"quantiles[{i}].q", 0.0, 1.0),
            )
            out._quantiles[key] = _number(v, f"quantiles[{i}].margin", 0.0, math.inf)
        return out


def _mapping(value: object, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{field}: an object expected, not {type(value).__name__}")
    return value


def _items(value: object, field: str, length: int | None = None) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{field}: a list expected, not {type(value).__name__}")
    if length is not None and len(value) != length:
        raise ValueError(f"{field}: {len(value)} items, {length} expected")
    return value


def _number(value: object, field: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    # bool is an int to Python, not a number to JSON
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{field}: a number expected, not {type(value).__name__}")
    try:
        x = float(value)
    except OverflowError:  # an int JSON holds with more digits than a float's range
        raise ValueError(f"{field}: out of range (outside [{lo}, {hi}])") from None
    if not math.isfinite(x) or not lo <= x <= hi:
        raise ValueError(f"{field}: {value!r} is not a finite number within [{lo}, {hi}]")
    return x


def _count(value: object, field: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field}: an integer expected, not {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        top = hi if hi is not None else "inf"
        raise ValueError(f"{field}: {value} outside [{lo}, {top}]")
    return value
