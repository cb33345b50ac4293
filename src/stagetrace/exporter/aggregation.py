"""The contract's metrics aggregated by stagetrace, and handed to the SDK's metric readers as ``MetricsData``.

The SDK's synchronous instruments pay, per observation, an attribute set turned into a frozenset key, two
locks, an exemplar filter reading the context and a reservoir: ~15 % of the exporter process's CPU under
load. Here an observation is a dict lookup by a ready-made attribute tuple, a ``bisect`` and a few
additions under one lock. What a reader receives is what the SDK would have produced from the same
observations (``tests/test_aggregation.py`` compares the two): the same names, units, descriptions, bucket
edges and attributes, cumulative or delta as the reader asks, last-in-bucket exemplars for kept traces
only, reset at every collection.

Each reader gets its own ``MetricStore``, in the temporality it prefers, so two readers collecting on their
own schedules never see each other's resets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from time import time_ns
from typing import Any

from opentelemetry.sdk.metrics import Exemplar as SdkExemplar
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricReader,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from stagetrace._compat import reader_prefers_delta, set_reader_collect
from stagetrace._version import __version__
from stagetrace.analysis.streams import GapHistogram
from stagetrace.conventions import INSTRUMENTATION_NAME
from stagetrace.exporter.metrics import (
    INSTRUMENTS,
    Addition,
    ContractMetrics,
    Exemplar,
    Instrument,
    Key,
    Merge,
    Observation,
)

_SCOPE = InstrumentationScope(INSTRUMENTATION_NAME, __version__)
_INF = float("inf")


class _Histogram:
    """One attribute set's explicit-bucket histogram (compiled, its count, sum and extremes are C numbers:
    ``aggregation.pxd``)."""

    __slots__ = ("buckets", "count", "counts", "exemplars", "max", "min", "start_ns", "sum")

    def __init__(self, buckets: tuple[float, ...], start_ns: int) -> None:
        self.buckets = buckets  # the instrument's edges as floats (MetricStore.edges), read at every observation
        self.counts = [0] * (len(buckets) + 1)
        self.count = 0
        self.sum = 0.0
        self.min = _INF
        self.max = -_INF
        self.exemplars: dict[int, tuple[float, int, int, int]] | None = None  # bucket -> value, time, ids
        self.start_ns = start_ns


class _Number:
    """One attribute set's counter total (a gauge's last value is kept as the plain value: its points have no
    start time)."""

    __slots__ = ("start_ns", "value")

    def __init__(self, value: float, start_ns: int) -> None:
        self.value = value
        self.start_ns = start_ns


class MetricStore:
    """The observations one reader has not collected yet (delta), or all of them (cumulative), per
    instrument and attribute tuple."""

    def __init__(self, delta_kinds: frozenset[str], now_ns: int) -> None:
        self.delta_kinds = delta_kinds  # instrument kinds the reader wants as deltas
        self.points: dict[Instrument, dict[Key, Any]] = {inst: {} for inst in INSTRUMENTS}
        # Each histogram's edges as floats, made once: compiled, a float's value is read in C where an int is
        # converted at each comparison, and a value compares with them exactly as with the ints.
        self.edges = {inst: tuple(map(float, inst.buckets)) for inst in INSTRUMENTS}
        self.last_collection_ns = now_ns

    def observe(self, inst: Instrument, key: Key, value: float, exemplar: Exemplar | None) -> None:
        table = self.points[inst]
        h = table.get(key)
        if h is None:
            h = table[key] = _Histogram(self.edges[inst], time_ns())
        # bisect_left by hand: a call to it costs more than its four steps over a dozen edges (C ones, compiled)
        buckets = h.buckets
        index, hi = 0, len(buckets)
        while index < hi:
            mid = (index + hi) >> 1
            edge = buckets[mid]
            if edge < value:
                index = mid + 1
            else:
                hi = mid
        h.counts[index] += 1
        h.count += 1
        h.sum += value
        if value < h.min:
            h.min = value
        if value > h.max:
            h.max = value
        if exemplar is not None:
            if h.exemplars is None:
                h.exemplars = {}
            h.exemplars[index] = (value, time_ns(), exemplar[0], exemplar[1])  # the bucket's last one

    def merge(self, inst: Instrument, key: Key, histogram: GapHistogram) -> None:
        """Many values at once, already counted on ``inst``'s buckets (a stream's gaps). Nothing counted adds
        no point (the SDK, given no value, has none)."""
        n = sum(histogram.counts)
        if not n:
            return
        table = self.points[inst]
        h = table.get(key)
        if h is None:
            h = table[key] = _Histogram(self.edges[inst], time_ns())
        for index, count in enumerate(histogram.counts):
            h.counts[index] += count
        h.count += n
        h.sum += histogram.sum_ms
        if histogram.min_ms < h.min:
            h.min = histogram.min_ms
        if histogram.max_ms > h.max:
            h.max = histogram.max_ms

    def add(self, inst: Instrument, key: Key, amount: float) -> None:
        table = self.points[inst]
        n = table.get(key)
        if n is None:
            table[key] = _Number(amount, time_ns())
        else:
            n.value += amount

    def set(self, inst: Instrument, key: Key, value: float) -> None:
        self.points[inst][key] = value  # the last value wins

    def collect(self, now_ns: int) -> list[Metric]:
        """The points as the SDK's reader would receive them; a delta store starts afresh."""
        metrics = []
        previous_ns = self.last_collection_ns
        self.last_collection_ns = now_ns
        for inst in INSTRUMENTS:
            table = self.points[inst]
            if not table:
                continue
            delta = inst.kind in self.delta_kinds
            if delta:
                self.points[inst] = {}
            metrics.append(
                Metric(
                    name=inst.name,
                    description=inst.description,
                    unit=inst.unit,
                    data=_data(inst, table, delta, previous_ns, now_ns),
                )
            )
        return metrics


def _data(inst: Instrument, table: dict[Key, Any], delta: bool, previous_ns: int, now_ns: int) -> Any:
    temporality = AggregationTemporality.DELTA if delta else AggregationTemporality.CUMULATIVE
    if inst.kind == "histogram":
        return Histogram(
            data_points=[_histogram_point(inst, key, h, delta, previous_ns, now_ns) for key, h in table.items()],
            aggregation_temporality=temporality,
        )
    if inst.kind == "counter":
        return Sum(
            data_points=[
                NumberDataPoint(
                    attributes=dict(key),
                    start_time_unix_nano=previous_ns if delta else n.start_ns,
                    time_unix_nano=now_ns,
                    value=n.value,
                )
                for key, n in table.items()
            ],
            aggregation_temporality=temporality,
            is_monotonic=True,
        )
    return Gauge(
        data_points=[
            NumberDataPoint(
                attributes=dict(key),
                start_time_unix_nano=None,  # type: ignore[arg-type]  # as the SDK's own gauge points
                time_unix_nano=now_ns,
                value=value,
            )
            for key, value in table.items()
        ]
    )


def _histogram_point(
    inst: Instrument, key: Key, h: _Histogram, delta: bool, previous_ns: int, now_ns: int
) -> HistogramDataPoint:
    exemplars = []
    if h.exemplars:
        for index in sorted(h.exemplars):
            value, at_ns, trace_id, span_id = h.exemplars[index]
            exemplars.append(SdkExemplar({}, value, at_ns, span_id, trace_id))
        h.exemplars = None  # exemplars are per collection, in both temporalities
    return HistogramDataPoint(
        attributes=dict(key),
        start_time_unix_nano=previous_ns if delta else h.start_ns,
        time_unix_nano=now_ns,
        count=h.count,
        sum=h.sum,
        bucket_counts=tuple(h.counts),
        explicit_bounds=inst.buckets,
        min=h.min,
        max=h.max,
        exemplars=exemplars,
    )


class AggregatedMetrics(ContractMetrics):
    """The contract's metrics aggregated here, collected by the SDK readers given to ``attach_readers``
    alongside whatever else their meter provider collects."""

    def __init__(self, resource: Resource, max_stage_names: int = 256) -> None:
        super().__init__(max_stage_names)
        self._resource = resource
        self._stores: tuple[MetricStore, ...] = ()
        self._lock = threading.Lock()

    def attach_readers(self, readers: Iterable[MetricReader]) -> None:
        """Each reader, once registered with its meter provider, also collects these metrics."""
        for reader in readers:
            store = MetricStore(reader_prefers_delta(reader), time_ns())
            self._stores += (store,)
            set_reader_collect(reader, self._collector(store))

    def _collector(self, store: MetricStore) -> Callable[[MetricsData | None], MetricsData | None]:
        def collect(data: MetricsData | None) -> MetricsData | None:
            with self._lock:
                metrics = store.collect(time_ns())
            if not metrics:
                return data
            scope = ScopeMetrics(scope=_SCOPE, metrics=metrics, schema_url="")
            if data is None or not data.resource_metrics:
                return MetricsData(resource_metrics=[ResourceMetrics(self._resource, [scope], schema_url="")])
            first, *rest = data.resource_metrics
            merged = ResourceMetrics(first.resource, [*first.scope_metrics, scope], first.schema_url)
            return MetricsData(resource_metrics=[merged, *rest])

        return collect

    def _observe(self, instrument: Instrument, key: Key, value: float, exemplar: Exemplar | None) -> None:
        with self._lock:
            for store in self._stores:
                store.observe(instrument, key, value, exemplar)

    def _add(self, instrument: Instrument, key: Key, amount: float) -> None:
        with self._lock:
            for store in self._stores:
                store.add(instrument, key, amount)

    def _set(self, instrument: Instrument, key: Key, value: float) -> None:
        with self._lock:
            for store in self._stores:
                store.set(instrument, key, value)

    def _record_all(self, observations: list[Observation], additions: list[Addition], merges: list[Merge]) -> None:
        with self._lock:
            for store in self._stores:
                record_into(store, observations, additions, merges)


def record_into(
    store: MetricStore, observations: list[Observation], additions: list[Addition], merges: list[Merge]
) -> None:
    """A trace's observations, counts and merged histograms into one reader's store (compiled, ``store`` is a C
    type and each call into it a C call: ``aggregation.pxd``)."""
    for instrument, key, value, exemplar in observations:
        store.observe(instrument, key, value, exemplar)
    for instrument, key, amount in additions:
        store.add(instrument, key, amount)
    for instrument, key, histogram in merges:
        store.merge(instrument, key, histogram)
