"""Before and after: two sets of traces compared, stage by stage, with how sure the difference is. Pure:
per-trace facts in (``TraceFacts``, from files or a fleet's table), a comparison out.

For each stage its p50/p95/p99 per request before and after and the change in each, for the request's own
latency the same, and for each bottleneck stage and diagnosis code the share of requests before and after.
Each change gets a 95 % interval from a bootstrap over traces (both sets resampled, with replacement,
``resamples`` times; a trace's weight, its adjusted count, carried into every weighted statistic), and is
called significant when an interval at the family-wise level excludes no change: with many figures
compared at once, some 95 % intervals exclude zero by chance alone, so the decision uses Bonferroni's
level (0.05 over the number of figures) while the 95 % interval is the one shown.

Memory is bounded: each side keeps a uniform sample of at most ``max_traces`` traces (reservoir sampling),
and says how many it read.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

QUANTILES = (0.5, 0.95, 0.99)
LEVEL = 0.95


class TraceFacts(NamedTuple):
    """What the comparison reads of one trace: its latency, each stage's time (ms), its bottleneck, its
    diagnosis codes, and its weight (the adjusted count)."""

    total_ms: float
    stages: dict[str, float]
    bottleneck: str | None
    codes: tuple[str, ...]
    weight: float = 1.0


@dataclass
class Side:
    """One side's traces: a uniform sample of at most ``max_traces`` of them."""

    max_traces: int = 20_000
    seed: int = 0
    traces: list[TraceFacts] = field(default_factory=list)
    seen: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def add(self, facts: TraceFacts) -> None:
        self.seen += 1
        if len(self.traces) < self.max_traces:
            self.traces.append(facts)
            return
        at = self._rng.randrange(self.seen)
        if at < self.max_traces:
            self.traces[at] = facts


def weighted_quantile(values: Sequence[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of (value, weight) pairs: the smallest value below which at least ``q`` of the
    weight lies (with weights of 1, the nearest-rank quantile). None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    total = sum(w for _, w in ordered)
    target = q * total
    seen = 0.0
    for value, weight in ordered:
        seen += weight
        if seen >= target - 1e-12:
            return value
    return ordered[-1][0]


class Change(NamedTuple):
    """One figure before and after: the change (after - before), its 95 % interval, and whether the
    family-wise interval excludes no change."""

    figure: str
    before: float | None
    after: float | None
    change: float | None
    low: float | None
    high: float | None
    significant: bool

    @property
    def relative(self) -> float | None:
        if self.before is None or self.change is None or self.before == 0:
            return None
        return self.change / self.before


def _interval(diffs: list[float], level: float) -> tuple[float, float]:
    ordered = sorted(diffs)
    tail = (1 - level) / 2
    low = ordered[max(0, math.floor(tail * (len(ordered) - 1)))]
    high = ordered[min(len(ordered) - 1, math.ceil((1 - tail) * (len(ordered) - 1)))]
    return low, high


class Figure(NamedTuple):
    """A figure as the bootstrap reads it: each trace's value (None: the trace has none, as a stage it did not
    run), and whether the figure is a quantile of those values or the share of traces whose value is 1."""

    name: str
    values: Callable[[TraceFacts], float | None]
    quantile: float | None  # None: a share


def _statistic(figure: Figure, values: Sequence[float | None], weights: Sequence[float]) -> float | None:
    if figure.quantile is None:
        total = sum(weights)
        return sum(w for v, w in zip(values, weights) if v) / total if total else None
    return weighted_quantile([(v, w) for v, w in zip(values, weights) if v is not None], figure.quantile)


def _differences_python(
    figures: Sequence[Figure], before: Sequence[TraceFacts], after: Sequence[TraceFacts], resamples: int, seed: int
) -> list[list[float]]:
    rng = random.Random(seed)
    columns = [([f.values(t) for t in before], [f.values(t) for t in after]) for f in figures]
    wb, wa = [t.weight for t in before], [t.weight for t in after]
    diffs: list[list[float]] = [[] for _ in figures]
    for _ in range(resamples):
        ib = [rng.randrange(len(before)) for _ in before]
        ia = [rng.randrange(len(after)) for _ in after]
        sb, sa = [wb[i] for i in ib], [wa[i] for i in ia]
        for k, (figure, (vb, va)) in enumerate(zip(figures, columns)):
            x = _statistic(figure, [vb[i] for i in ib], sb)
            y = _statistic(figure, [va[i] for i in ia], sa)
            if x is not None and y is not None:
                diffs[k].append(y - x)
    return diffs


def _differences_numpy(
    np: Any, figures: Sequence[Figure], before: Sequence[TraceFacts], after: Sequence[TraceFacts], resamples: int,
    seed: int,
) -> list[list[float]]:  # fmt: skip
    """The same resampling, vectorised: every resample's statistic of a figure in one pass of arrays."""
    rng = np.random.default_rng(seed)

    def resampled(side: Sequence[TraceFacts]) -> tuple[Any, Any]:
        index = rng.integers(0, len(side), size=(resamples, len(side)))
        return index, np.asarray([t.weight for t in side], dtype=float)[index]

    (ib, wb), (ia, wa) = resampled(before), resampled(after)

    def statistics(figure: Figure, side: Sequence[TraceFacts], index: Any, weights: Any) -> Any:
        raw = np.asarray([np.nan if (v := figure.values(t)) is None else float(v) for t in side])[index]
        present = ~np.isnan(raw)
        w = np.where(present, weights, 0.0)
        if figure.quantile is None:
            total = weights.sum(axis=1)
            return np.where(total > 0, (w * np.nan_to_num(raw)).sum(axis=1) / np.where(total > 0, total, 1), np.nan)
        order = np.argsort(np.where(present, raw, np.inf), axis=1, kind="stable")
        values = np.take_along_axis(raw, order, axis=1)
        cumulative = np.cumsum(np.take_along_axis(w, order, axis=1), axis=1)
        target = figure.quantile * cumulative[:, -1:] - 1e-12
        at = np.minimum((cumulative < target).sum(axis=1), raw.shape[1] - 1)
        out = values[np.arange(resamples), at]
        return np.where(cumulative[:, -1] > 0, out, np.nan)

    diffs = []
    for figure in figures:
        d = statistics(figure, after, ia, wa) - statistics(figure, before, ib, wb)
        diffs.append([float(x) for x in d[~np.isnan(d)]])
    return diffs


def bootstrap(
    figures: Sequence[Figure],
    before: Sequence[TraceFacts],
    after: Sequence[TraceFacts],
    *,
    resamples: int = 1000,
    seed: int = 0,
    level: float = LEVEL,
    vectorised: bool | None = None,
) -> list[Change]:
    """Each figure's change with its interval: the same resamples for every figure (so the intervals are
    comparable), a figure missing on a side (a stage that did not run) reported without an interval.
    ``vectorised``: numpy's arrays where numpy is installed (None: when it is), plain Python otherwise."""
    diffs: list[list[float]] = [[] for _ in figures]
    if before and after:
        np = _numpy() if vectorised is not False else None
        if vectorised and np is None:
            raise RuntimeError("vectorised=True needs numpy")
        if np is not None:
            diffs = _differences_numpy(np, figures, before, after, resamples, seed)
        else:
            diffs = _differences_python(figures, before, after, resamples, seed)
    family_level = 1 - (1 - level) / max(1, len(figures))
    out = []
    wb, wa = [t.weight for t in before], [t.weight for t in after]
    for figure, d in zip(figures, diffs):
        x = _statistic(figure, [figure.values(t) for t in before], wb) if before else None
        y = _statistic(figure, [figure.values(t) for t in after], wa) if after else None
        change = None if x is None or y is None else y - x
        if change is None or len(d) < resamples // 2:  # a figure most resamples could not compute: no interval
            out.append(Change(figure.name, x, y, change, None, None, False))
            continue
        low, high = _interval(d, level)
        family_low, family_high = _interval(d, family_level)
        out.append(Change(figure.name, x, y, change, low, high, family_low > 0 or family_high < 0))
    return out


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


@dataclass
class Comparison:
    """``stages``: per stage, its quantiles' changes; ``latency``: the request's; ``bottlenecks`` and
    ``diagnoses``: shares of requests. ``before_label`` / ``after_label`` say what each side was."""

    before_label: str
    after_label: str
    before_traces: int
    after_traces: int
    latency: list[Change]
    stages: dict[str, list[Change]]
    bottlenecks: list[Change]
    diagnoses: list[Change]
    resamples: int

    def all_changes(self) -> Iterable[Change]:
        yield from self.latency
        for changes in self.stages.values():
            yield from changes
        yield from self.bottlenecks
        yield from self.diagnoses

    def summary(self) -> dict[str, Any]:
        """The ``--json`` shape."""

        def row(ch: Change) -> dict[str, Any]:
            return {
                "before": _round(ch.before),
                "after": _round(ch.after),
                "change": _round(ch.change),
                "interval_95": None if ch.low is None else [_round(ch.low), _round(ch.high)],
                "significant": ch.significant,
            }

        return {
            "before": {"label": self.before_label, "traces": self.before_traces},
            "after": {"label": self.after_label, "traces": self.after_traces},
            "resamples": self.resamples,
            "latency_ms": {ch.figure: row(ch) for ch in self.latency},
            "stages": {name: {ch.figure: row(ch) for ch in changes} for name, changes in self.stages.items()},
            "bottleneck_share": {ch.figure: row(ch) for ch in self.bottlenecks},
            "diagnosis_rate": {ch.figure: row(ch) for ch in self.diagnoses},
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _names(sides: Iterable[Sequence[TraceFacts]], pick: Callable[[TraceFacts], Iterable[str]]) -> list[str]:
    seen: dict[str, None] = {}
    for traces in sides:
        for t in traces:
            seen.update(dict.fromkeys(pick(t)))
    return list(seen)


def _total(t: TraceFacts) -> float:
    return t.total_ms


def _stage_ms(name: str) -> Callable[[TraceFacts], float | None]:
    return lambda t: t.stages.get(name)


def _is_bottleneck(name: str) -> Callable[[TraceFacts], float]:
    return lambda t: float(t.bottleneck == name)


def _has_code(code: str) -> Callable[[TraceFacts], float]:
    return lambda t: float(code in t.codes)


def compare(
    before: Side,
    after: Side,
    *,
    before_label: str = "before",
    after_label: str = "after",
    resamples: int = 1000,
    seed: int = 0,
    vectorised: bool | None = None,
) -> Comparison:
    b, a = before.traces, after.traces
    labels = {q: f"p{round(q * 100)}" for q in QUANTILES}
    stage_names = _names((b, a), lambda t: t.stages)
    bottlenecks = _names((b, a), lambda t: [t.bottleneck] if t.bottleneck else [])
    codes = _names((b, a), lambda t: t.codes)
    figures = [Figure(f"latency {labels[q]}", _total, q) for q in QUANTILES]
    figures += [Figure(f"stage {name} {labels[q]}", _stage_ms(name), q) for name in stage_names for q in QUANTILES]
    figures += [Figure(f"bottleneck {name}", _is_bottleneck(name), None) for name in bottlenecks]
    figures += [Figure(f"diagnosis {code}", _has_code(code), None) for code in codes]
    changes = iter(bootstrap(figures, b, a, resamples=resamples, seed=seed, vectorised=vectorised))
    latency = [next(changes)._replace(figure=labels[q]) for q in QUANTILES]
    stages = {name: [next(changes)._replace(figure=labels[q]) for q in QUANTILES] for name in stage_names}
    bottleneck_changes = [next(changes)._replace(figure=name) for name in bottlenecks]
    diagnosis_changes = [next(changes)._replace(figure=code) for code in codes]
    return Comparison(
        before_label, after_label, before.seen, after.seen, latency, stages, bottleneck_changes, diagnosis_changes,
        resamples,
    )  # fmt: skip
