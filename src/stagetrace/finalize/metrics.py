"""The contract's metrics, recorded by the finalizer for every request whether or not its trace was sampled
(principle 7). Attribute values stay low-cardinality: stage names are capped, the overflow counted."""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry.context import Context
from opentelemetry.metrics import Meter
from opentelemetry.trace import NonRecordingSpan, SpanContext, set_span_in_context

from stagetrace import conventions as c
from stagetrace.analysis import Verdict

OVERFLOW_STAGE = "_other"
_NO_SPAN = Context()

# Bucket edges in ms for the latency histograms: request pipelines live between ~0.1 ms stages and
# multi-second slow traces.
MS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 200, 300, 500, 750, 1000, 1500, 2500, 5000, 10000)


def exemplar_context(span_context: SpanContext | None) -> Context | None:
    """A context carrying the trace's span so that histogram exemplars link to it (Grafana -> Jaeger)."""
    if span_context is None or not span_context.is_valid:
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

    def record_stage(self, name: str, kind: str, ms: float, route: str | None, ctx: Context | None = None) -> None:
        # An explicit empty context: the exemplar filter then finds no span at once, without reading the
        # finalizer thread's current context.
        self._stage_duration.record(ms, self._stage_attrs(name, kind, route), context=ctx or _NO_SPAN)

    def record_trace(self, verdict: Verdict, ctx: Context | None) -> None:
        """One stage observation per stage name per request (its share of the breakdown, occurrences
        summed), so a stage's percentiles are per request like the trace's. The exemplar, which links a
        latency panel to the trace in Jaeger, goes on the trace duration and on the bottleneck stage: the
        traces worth opening from a stage panel are the ones that stage slowed down."""
        route = verdict.route
        kinds = verdict.stage_kinds
        for name, ms in verdict.breakdown.items():
            self.record_stage(name, kinds.get(name, "cpu"), ms, route, ctx if name == verdict.bottleneck else None)
        attrs: dict[str, Any] = {c.SLOW: verdict.slow}
        if route:
            attrs[c.HTTP_ROUTE] = route
        self._trace_duration.record(verdict.total_ms, attrs, context=ctx)
        if verdict.bottleneck is not None:
            self._bottleneck.add(1, {c.STAGE: self._stage_label(verdict.bottleneck)})
        for code in verdict.diagnosis_codes:
            self._diagnosis.add(1, {c.DIAGNOSIS_CODE: code})

    def dropped(self, reason: str, count: int = 1) -> None:
        if count:
            self._dropped.add(count, {c.DROP_REASON: reason})

    def gpu_utilization(self, value: float, hw_id: str) -> None:
        self._gpu_utilization.set(value, {c.HW_ID: hw_id})
