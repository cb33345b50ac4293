"""A log-bucketed quantile sketch: constant memory per stage however many traces are read, relative error
bounded by the bucket growth factor (1% here), mergeable.

The bucket of a value is a plain formula (``bucket_key``), so a database can bucket values itself and send
back only the counts (``add_bucket``): the ClickHouse report and the file report then read their quantiles
through the same code, from the same buckets.

A value may stand for several (``weight``: a sampled trace's adjusted count): counts, sums and quantiles
are then weighted, so that a sample's quantiles estimate those of everything it was drawn from."""

from __future__ import annotations

import math
from typing import NamedTuple

# Values at or below this count as zero (a stage that took no time): they have no logarithm.
ZERO_BELOW = 1e-9


class Bucket(NamedTuple):
    """``n`` values counted elsewhere into one bucket (their weights' sum): ``key`` None for the zeros, else
    ``bucket_key(value)``; ``total`` their weighted sum."""

    key: int | None
    n: float
    total: float
    low: float
    high: float


class QuantileSketch:
    """Values > 0 land in bucket ``ceil(log(v) / log(gamma))``; a quantile is read back as the bucket's
    midpoint, within ``alpha`` relative error. Zero and negatives are counted apart."""

    __slots__ = ("_buckets", "_log_gamma", "alpha", "count", "max", "min", "sum", "zeros")

    def __init__(self, alpha: float = 0.01) -> None:
        self.alpha = alpha
        self._log_gamma = math.log((1 + alpha) / (1 - alpha))
        self._buckets: dict[int, float] = {}
        self.count: float = 0  # the weights' sum: the number of values when each weighs 1
        self.zeros: float = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf

    @property
    def log_gamma(self) -> float:
        """The divisor of the bucket formula, for code that buckets values outside Python (SQL)."""
        return self._log_gamma

    def bucket_key(self, value: float) -> int | None:
        return None if value <= ZERO_BELOW else math.ceil(math.log(value) / self._log_gamma)

    def add(self, value: float, weight: float = 1) -> None:
        # inline (no Bucket record): the file report calls this for every stage of every trace
        self.count += weight
        self.sum += value * weight
        self.min = min(self.min, value)
        self.max = max(self.max, value)
        if value <= ZERO_BELOW:
            self.zeros += weight
            return
        key = math.ceil(math.log(value) / self._log_gamma)
        self._buckets[key] = self._buckets.get(key, 0) + weight

    def add_bucket(self, bucket: Bucket) -> None:
        """Count ``bucket.n`` values already bucketed (by ``bucket_key``'s formula) with their sum and
        extremes: what a database sends back instead of the values."""
        if bucket.n <= 0:
            return
        self.count += bucket.n
        self.sum += bucket.total
        self.min = min(self.min, bucket.low)
        self.max = max(self.max, bucket.high)
        if bucket.key is None:
            self.zeros += bucket.n
        else:
            self._buckets[bucket.key] = self._buckets.get(bucket.key, 0) + bucket.n

    def merge(self, other: QuantileSketch) -> None:
        """Add another sketch's values (same ``alpha``): sketches of groups make the sketch of the whole."""
        if other.alpha != self.alpha:
            raise ValueError(f"cannot merge sketches of different accuracy ({other.alpha} into {self.alpha})")
        self.count += other.count
        self.zeros += other.zeros
        self.sum += other.sum
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        for key, n in other._buckets.items():
            self._buckets[key] = self._buckets.get(key, 0) + n

    def quantile(self, q: float) -> float:
        """The value below which ``q`` of the weight lies (with weights of 1: the value of rank ``q * (n - 1)``,
        counting from 0)."""
        if not self.count:
            return 0.0
        rank = q * max(self.count - 1, 0)
        if rank < self.zeros:
            return 0.0
        seen = self.zeros
        for key in sorted(self._buckets):
            seen += self._buckets[key]
            if seen > rank:
                gamma = math.exp(self._log_gamma)
                value = 2 * gamma**key / (gamma + 1)
                return min(max(value, self.min), self.max)
        return self.max

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0
