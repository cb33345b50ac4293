"""The contract's metrics, recorded for every request whether or not its trace was sampled or kept.
Attribute values stay low-cardinality: stage names are capped, the overflow counted.

Every call takes plain values (the exemplar as trace and span ids), so that the same calls can be replayed
in the application for metric readers that live there (``MetricsRecorder``)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Protocol

from opentelemetry.context import Context
from opentelemetry.metrics import Meter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from stagetrace import conventions as c
from stagetrace.analysis import Verdict

OVERFLOW_STAGE = "_other"
_NO_SPAN = Context()

# Bucket edges in ms for the latency histograms: request pipelines live between ~0.1 ms stages and
# multi-second slow traces.
MS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 200, 300, 500, 750, 1000, 1500, 2500, 5000, 10000)


SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
FILL_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)

Exemplar = tuple[int, int]  # (trace id, span id) of a kept trace's root


def exemplar_context(exemplar: Exemplar | None) -> Context | None:
    """A context carrying the trace's span so that histogram exemplars link to it (Grafana -> Jaeger)."""
    if exemplar is None:
        return None
    span_context = SpanContext(exemplar[0], exemplar[1], False, TraceFlags(TraceFlags.SAMPLED))
    if not span_context.is_valid:
        return None
    return set_span_in_context(NonRecordingSpan(span_context))


class StagetraceMetrics:
    def __init__(self, meter: Meter, max_stage_names: int = 256) -> None:
        # Buckets as the instrument's advisory, so they apply on providers stagetrace did not build too.
        self._stage_duration = meter.create_histogram(
            c.METRIC_STAGE_DURATION,
            unit="ms",
            description="Time charged to a pipeline stage per request (exclusive wall, or GPU)",
            explicit_bucket_boundaries_advisory=MS_BUCKETS,
        )
        self._trace_duration = meter.create_histogram(
            c.METRIC_TRACE_DURATION,
            unit="ms",
            description="Duration of a trace's local root",
            explicit_bucket_boundaries_advisory=MS_BUCKETS,
        )
        self._bottleneck = meter.create_counter(
            c.METRIC_BOTTLENECK, unit="{trace}", description="Traces whose bottleneck was this stage"
        )
        self._diagnosis = meter.create_counter(
            c.METRIC_DIAGNOSIS, unit="{trace}", description="Traces on which a diagnosis rule fired"
        )
        self._dropped = meter.create_counter(
            c.METRIC_DROPPED, unit="{item}", description="Items stagetrace dropped to stay within its bounds"
        )
        self._gpu_utilization = meter.create_gauge(
            c.METRIC_GPU_UTILIZATION, unit="1", description="GPU utilisation sampled through NVML"
        )
        self._batch_size = meter.create_histogram(
            c.METRIC_BATCH_SIZE,
            unit="{request}",
            description="Requests served by one execution of a dynamic batcher",
            explicit_bucket_boundaries_advisory=SIZE_BUCKETS,
        )
        self._batch_fill = meter.create_histogram(
            c.METRIC_BATCH_FILL,
            unit="1",
            description="Items in a batch over the batcher's max size",
            explicit_bucket_boundaries_advisory=FILL_BUCKETS,
        )
        self._max_stage_names = max_stage_names
        self._stage_names: set[str] = set()
        self._attr_cache: dict[tuple[str, str, str | None], dict[str, Any]] = {}
        self._names_lock = threading.Lock()

    def _stage_label(self, name: str) -> str:
        if name in self._stage_names:
            return name
        with self._names_lock:
            if len(self._stage_names) < self._max_stage_names:
                self._stage_names.add(name)
                return name
        self.dropped("stage_name_cardinality")
        return OVERFLOW_STAGE

    def _stage_attrs(self, name: str, kind: str, route: str | None) -> dict[str, Any]:
        key = (name, kind, route)
        attrs = self._attr_cache.get(key)
        if attrs is None:
            attrs = {c.STAGE: self._stage_label(name), c.STAGE_KIND: kind}
            if route:
                attrs[c.HTTP_ROUTE] = route
            if len(self._attr_cache) < 4 * self._max_stage_names:
                self._attr_cache[key] = attrs
        return attrs

    def record_stage(self, name: str, kind: str, ms: float, route: str | None) -> None:
        self._record_stage(name, kind, ms, route, None)

    def _record_stage(self, name: str, kind: str, ms: float, route: str | None, ctx: Context | None) -> None:
        # An explicit empty context: the exemplar filter then finds no span at once, without reading the
        # thread's current context.
        self._stage_duration.record(ms, self._stage_attrs(name, kind, route), context=ctx or _NO_SPAN)

    def record_trace(self, verdict: Verdict, exemplar: Exemplar | None) -> None:
        """One stage observation per stage name per request (its share of the breakdown, occurrences
        summed), so a stage's percentiles are per request like the trace's. The exemplar, which links a
        latency panel to the trace in Jaeger, goes on the trace duration and on the bottleneck stage: the
        traces worth opening from a stage panel are the ones that stage slowed down. ``exemplar`` is given
        only for traces that were kept, so an exemplar never points at a trace that was not exported."""
        ctx = exemplar_context(exemplar)
        route = verdict.route
        kinds = verdict.stage_kinds
        for name, ms in verdict.breakdown.items():
            self._record_stage(name, kinds.get(name, "cpu"), ms, route, ctx if name == verdict.bottleneck else None)
        attrs: dict[str, Any] = {c.SLOW: verdict.slow}
        if route:
            attrs[c.HTTP_ROUTE] = route
        self._trace_duration.record(verdict.total_ms, attrs, context=ctx)
        if verdict.bottleneck is not None:
            b = verdict.bottleneck
            self._bottleneck.add(1, {c.STAGE: b if b == c.UNTRACKED else self._stage_label(b)})
        for code in verdict.diagnosis_codes:
            self._diagnosis.add(1, {c.DIAGNOSIS_CODE: code})

    def record_batch(self, name: str, size: int, fill: float | None) -> None:
        attrs = {c.STAGE: self._stage_label(name)}
        self._batch_size.record(size, attrs, context=_NO_SPAN)
        if fill is not None:
            self._batch_fill.record(fill, attrs, context=_NO_SPAN)

    def dropped(self, reason: str, count: int = 1) -> None:
        if count:
            self._dropped.add(count, {c.DROP_REASON: reason})

    def gpu_utilization(self, value: float, hw_id: str) -> None:
        self._gpu_utilization.set(value, {c.HW_ID: hw_id})


class MetricsSink(Protocol):
    """Where the exporter's metric events go: the SDK instruments (``StagetraceMetrics``), a recorder for
    replay in the application, or both."""

    def record_stage(self, name: str, kind: str, ms: float, route: str | None) -> None: ...
    def record_trace(self, verdict: Verdict, exemplar: Exemplar | None) -> None: ...
    def record_batch(self, name: str, size: int, fill: float | None) -> None: ...
    def dropped(self, reason: str, count: int = 1) -> None: ...
    def gpu_utilization(self, value: float, hw_id: str) -> None: ...


METRIC_METHODS = frozenset({"record_stage", "record_trace", "record_batch", "dropped", "gpu_utilization"})


class MetricsRecorder:
    """Keeps each call as ``(method, args)``, to be replayed on the application's own metrics."""

    def __init__(self) -> None:
        # A deque: request threads, samplers and the helper thread append while another thread takes.
        self.calls: deque[tuple[str, tuple[Any, ...]]] = deque()

    def record_stage(self, *args: Any) -> None:
        self.calls.append(("record_stage", args))

    def record_trace(self, *args: Any) -> None:
        self.calls.append(("record_trace", args))

    def record_batch(self, *args: Any) -> None:
        self.calls.append(("record_batch", args))

    def dropped(self, reason: str, count: int = 1) -> None:
        if count:
            self.calls.append(("dropped", (reason, count)))

    def gpu_utilization(self, *args: Any) -> None:
        self.calls.append(("gpu_utilization", args))

    def take(self) -> list[tuple[str, tuple[Any, ...]]]:
        calls, pop = [], self.calls.popleft
        while self.calls:
            calls.append(pop())
        return calls


def replay(sink: MetricsSink, calls: list[tuple[str, tuple[Any, ...]]]) -> None:
    """Apply recorded calls; an unknown method name (a malformed message) is ignored."""
    for method, args in calls:
        if method in METRIC_METHODS:
            getattr(sink, method)(*args)


class TeeMetrics:
    """Every call to each of several sinks."""

    def __init__(self, *sinks: MetricsSink) -> None:
        self.sinks = sinks

    def record_stage(self, *args: Any) -> None:
        for s in self.sinks:
            s.record_stage(*args)

    def record_trace(self, *args: Any) -> None:
        for s in self.sinks:
            s.record_trace(*args)

    def record_batch(self, *args: Any) -> None:
        for s in self.sinks:
            s.record_batch(*args)

    def dropped(self, reason: str, count: int = 1) -> None:
        for s in self.sinks:
            s.dropped(reason, count)

    def gpu_utilization(self, *args: Any) -> None:
        for s in self.sinks:
            s.gpu_utilization(*args)
