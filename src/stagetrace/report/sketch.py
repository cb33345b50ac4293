"""A log-bucketed quantile sketch: constant memory per stage however many traces are read, relative error
bounded by the bucket growth factor (1% here), mergeable."""

from __future__ import annotations

import math


class QuantileSketch:
    """Values > 0 land in bucket ``ceil(log(v) / log(gamma))``; a quantile is read back as the bucket's
    midpoint, within ``alpha`` relative error. Zero and negatives are counted apart."""

    __slots__ = ("_buckets", "_log_gamma", "alpha", "count", "max", "min", "sum", "zeros")

    def __init__(self, alpha: float = 0.01) -> None:
        self.alpha = alpha
        self._log_gamma = math.log((1 + alpha) / (1 - alpha))
        self._buckets: dict[int, int] = {}
        self.count = 0
        self.zeros = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf

    def add(self, value: float) -> None:
        self.count += 1
        self.sum += value
        self.min = min(self.min, value)
        self.max = max(self.max, value)
        if value <= 1e-9:
            self.zeros += 1
            return
        key = math.ceil(math.log(value) / self._log_gamma)
        self._buckets[key] = self._buckets.get(key, 0) + 1

    def quantile(self, q: float) -> float:
        if not self.count:
            return 0.0
        rank = q * (self.count - 1)
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
