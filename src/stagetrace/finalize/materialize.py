"""Turn captured records into ``ReadableSpan`` objects with their true timestamps.

Pure functions of their inputs: no clocks, no I/O, no global state. The span ids were allocated on the
request thread, so spans created by other instrumentations inside a stage already point at these ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from stagetrace import conventions as c
from stagetrace._version import __version__
from stagetrace.analysis import StageSample, Verdict
from stagetrace.capture.records import StageRecord

SCOPE = InstrumentationScope(c.INSTRUMENTATION_NAME, __version__)


def to_sample(rec: StageRecord, perf_to_epoch_ns: int, gpu: Mapping[str, Any] | None = None) -> StageSample:
    """``gpu`` carries what the GPU timer resolved: gpu_ms, start/end placement, bytes, pinned."""
    start, end = rec.start_ns + perf_to_epoch_ns, rec.end_ns + perf_to_epoch_ns
    cpu = rec.cpu if isinstance(rec.cpu, dict) else {}
    gpu = gpu or {}
    return StageSample(
        name=rec.name,
        kind=rec.kind,
        start_ns=start,
        end_ns=max(start, end),
        stage_id=rec.span_id,
        parent_stage_id=rec.parent_stage_id,
        gpu_ms=gpu.get("gpu_ms"),
        cpu_ms=cpu.get("cpu_ms"),
        blocked_ms=cpu.get("blocked_ms"),
        runqueue_ms=cpu.get("runqueue_ms"),
        on_event_loop=rec.on_event_loop,
        h2d_bytes=gpu.get("bytes"),
        h2d_pinned=gpu.get("pinned"),
        gpu_utilization=gpu.get("utilization"),
    )


def stage_attributes(rec: StageRecord, sample: StageSample, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    attrs: dict[str, Any] = {c.STAGE: rec.name, c.STAGE_KIND: rec.kind}
    if rec.attributes:
        attrs.update(rec.attributes)
    for key, value in (
        (c.CPU_MS, sample.cpu_ms),
        (c.BLOCKED_MS, sample.blocked_ms),
        (c.RUNQUEUE_MS, sample.runqueue_ms),
        (c.GPU_DURATION_MS, sample.gpu_ms),
        (c.H2D_BYTES, sample.h2d_bytes),
        (c.H2D_PINNED, sample.h2d_pinned),
        (c.GPU_UTILIZATION, sample.gpu_utilization),
    ):
        if value is not None:
            attrs[key] = value
    if sample.on_event_loop:
        attrs[c.ON_EVENT_LOOP] = True
    if extra:
        attrs.update(extra)
    return attrs


def _error_parts(rec: StageRecord, end_ns: int) -> tuple[Status, tuple[Event, ...]]:
    if rec.error is None:
        return Status(StatusCode.UNSET), ()
    etype, message, stacktrace = rec.error
    event = Event(
        "exception",
        {"exception.type": etype, "exception.message": message, "exception.stacktrace": stacktrace},
        timestamp=end_ns,
    )
    return Status(StatusCode.ERROR, f"{etype}: {message}"[:256]), (event,)


def stage_span(
    rec: StageRecord,
    sample: StageSample,
    *,
    trace_flags: TraceFlags,
    trace_state: TraceState | None,
    resource: Resource,
    attributes: Mapping[str, Any],
) -> ReadableSpan:
    status, events = _error_parts(rec, sample.end_ns)
    return ReadableSpan(
        name=rec.name,
        context=SpanContext(rec.trace_id, rec.span_id, False, trace_flags, trace_state),
        parent=SpanContext(rec.trace_id, rec.parent_span_id, False, trace_flags, trace_state),
        resource=resource,
        attributes=dict(attributes),
        events=events,
        kind=SpanKind.INTERNAL,
        status=status,
        start_time=sample.start_ns,
        end_time=sample.end_ns,
        instrumentation_scope=SCOPE,
    )


def verdict_attributes(verdict: Verdict) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        c.TOTAL_MS: round(verdict.total_ms, 3),
        c.SLOW: verdict.slow,
        c.SLOW_THRESHOLD_MS: verdict.slow_threshold_ms,
        c.UNTRACKED_MS: round(verdict.untracked_ms, 3),
    }
    if verdict.breakdown:
        attrs[c.STAGES] = list(verdict.breakdown)
        attrs[c.STAGES_MS] = [round(v, 3) for v in verdict.breakdown.values()]
    if verdict.bottleneck is not None:
        attrs[c.BOTTLENECK_STAGE] = verdict.bottleneck
        attrs[c.BOTTLENECK_RATIO] = round(verdict.ratio, 4)
    if verdict.diagnoses:
        attrs[c.DIAGNOSIS] = list(verdict.diagnosis_codes)
    if verdict.gpu_utilization is not None:
        attrs[c.GPU_UTILIZATION] = round(verdict.gpu_utilization, 4)
    return attrs


def diagnosis_events(verdict: Verdict, timestamp_ns: int) -> tuple[Event, ...]:
    events = []
    for d in verdict.diagnoses:
        attrs = {
            c.DIAGNOSIS_EVENT_CODE: d.code,
            c.DIAGNOSIS_EVENT_MESSAGE: d.message,
            c.DIAGNOSIS_EVENT_ADVICE: d.advice,
        }
        if d.stage:
            attrs[c.DIAGNOSIS_EVENT_STAGE] = d.stage
        events.append(Event(c.DIAGNOSIS_EVENT, attrs, timestamp=timestamp_ns))
    return tuple(events)


def root_with_verdict(root: ReadableSpan, verdict: Verdict) -> ReadableSpan:
    """The finished local root, rebuilt with the verdict attributes and diagnosis events.

    Rebuilding is the supported way: the SDK freezes a span's attributes before any processor sees it.
    """
    merged: dict[str, Any] = dict(root.attributes or {})
    merged.update(verdict_attributes(verdict))
    attributes = BoundedAttributes(maxlen=None, attributes=merged, immutable=True)
    attributes.dropped = root.dropped_attributes
    events: Sequence[Event] = tuple(root.events) + diagnosis_events(verdict, root.end_time or 0)
    return ReadableSpan(
        name=root.name,
        context=root.context,
        parent=root.parent,
        resource=root.resource,
        attributes=attributes,
        events=events,
        links=root.links,
        kind=root.kind,
        status=root.status,
        start_time=root.start_time,
        end_time=root.end_time,
        instrumentation_scope=root.instrumentation_scope,
    )
