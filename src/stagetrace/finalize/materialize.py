"""Turn captured records into ``ReadableSpan`` objects with their true timestamps.

Pure functions of their inputs: no clocks, no I/O, no global state. The span ids were allocated on the
request thread, so spans created by other instrumentations inside a stage already point at these ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from stagetrace import conventions as c
from stagetrace._version import __version__
from stagetrace.analysis import Verdict
from stagetrace.capture.records import StageRecord

SCOPE = InstrumentationScope(c.INSTRUMENTATION_NAME, __version__)


def apply_gpu_fields(rec: StageRecord, gpu: Mapping[str, Any] | None) -> None:
    """Copy what GPU support resolved onto the record. With a clock anchor the stage moves to where its GPU
    work really ran, and its host-side duration is kept as an attribute."""
    if not gpu:
        return
    if "gpu_start_ns" in gpu:
        rec.set_attribute(c.HOST_DURATION_MS, round(rec.wall_ms, 3))
        rec.start_ns, rec.end_ns = gpu["gpu_start_ns"], gpu["gpu_end_ns"]
    if "gpu_ms" in gpu:
        rec.gpu_ms = gpu["gpu_ms"]
    if "gpu_utilization" in gpu:
        rec.gpu_utilization = gpu["gpu_utilization"]
        rec.set_attribute(c.GPU_UTILIZATION_MIN, gpu["gpu_utilization_min"])
        rec.set_attribute(c.GPU_UTILIZATION_MAX, gpu["gpu_utilization_max"])
    if "gpu_memory_used" in gpu:
        rec.set_attribute(c.GPU_MEMORY_USED, gpu["gpu_memory_used"])


_SIGNAL_ATTRIBUTES = (
    ("cpu_ms", c.CPU_MS),
    ("blocked_ms", c.BLOCKED_MS),
    ("runqueue_ms", c.RUNQUEUE_MS),
    ("gpu_ms", c.GPU_DURATION_MS),
    ("h2d_bytes", c.H2D_BYTES),
    ("h2d_pinned", c.H2D_PINNED),
    ("gpu_utilization", c.GPU_UTILIZATION),
    ("queue_saturated", c.QUEUE_SATURATED),
)


def stage_attributes(rec: StageRecord, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    attrs: dict[str, Any] = {c.STAGE: rec.name, c.STAGE_KIND: rec.kind}
    extras = rec.__dict__  # signals live here only once set; most stages have none
    if extras:
        for field_name, key in _SIGNAL_ATTRIBUTES:
            value = extras.get(field_name)
            if value is not None:
                attrs[key] = value
    if rec.on_event_loop:
        attrs[c.ON_EVENT_LOOP] = True
    if rec.attributes:
        attrs.update(rec.attributes)
    if extra:
        attrs.update(extra)
    return attrs


_UNSET = Status(StatusCode.UNSET)


def _valid_span_context(trace_id: int, span_id: int, flags: TraceFlags, state: TraceState | None) -> SpanContext:
    """SpanContext for ids that are valid by construction (a tracked trace, ids from getrandbits or 1);
    skips re-validation when SpanContext has its known tuple layout."""
    if _TUPLE_LAYOUT:
        return tuple.__new__(SpanContext, (trace_id, span_id, False, flags, state or _EMPTY_STATE, True))
    return SpanContext(trace_id, span_id, False, flags, state)  # pragma: no cover


_EMPTY_STATE = TraceState()
_probe = SpanContext(0xA, 0xB, False, TraceFlags(1))
_TUPLE_LAYOUT = tuple(_probe) == (0xA, 0xB, False, _probe.trace_flags, _probe.trace_state, True)


def _error_parts(rec: StageRecord, end_ns: int) -> tuple[Status, tuple[Event, ...]]:
    if rec.error is None:
        return _UNSET, ()
    etype, message, stacktrace = rec.error
    event = Event(
        "exception",
        {"exception.type": etype, "exception.message": message, "exception.stacktrace": stacktrace},
        timestamp=end_ns,
    )
    return Status(StatusCode.ERROR, f"{etype}: {message}"[:256]), (event,)


def stage_span(
    rec: StageRecord,
    perf_to_epoch_ns: int,
    *,
    trace_flags: TraceFlags,
    trace_state: TraceState | None,
    resource: Resource,
    attributes: dict[str, Any],
) -> ReadableSpan:
    """``perf_to_epoch_ns`` moves the record's perf-counter times onto the epoch clock of its trace."""
    start = rec.start_ns + perf_to_epoch_ns
    end = max(start, rec.end_ns + perf_to_epoch_ns)
    status, events = _error_parts(rec, end)
    return ReadableSpan(
        name=rec.name,
        context=_valid_span_context(rec.trace_id, rec.span_id, trace_flags, trace_state),
        parent=_valid_span_context(rec.trace_id, rec.parent_span_id, trace_flags, trace_state),
        resource=resource,
        attributes=attributes,
        events=events,
        kind=SpanKind.INTERNAL,
        status=status,
        start_time=start,
        end_time=end,
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
        attrs[c.STAGES] = tuple(verdict.breakdown)
        attrs[c.STAGES_MS] = tuple(round(v, 3) for v in verdict.breakdown.values())
    if verdict.bottleneck is not None:
        attrs[c.BOTTLENECK_STAGE] = verdict.bottleneck
        attrs[c.BOTTLENECK_RATIO] = round(verdict.ratio, 4)
    if verdict.diagnoses:
        attrs[c.DIAGNOSIS] = verdict.diagnosis_codes
    if verdict.gpu_utilization is not None:
        attrs[c.GPU_UTILIZATION] = round(verdict.gpu_utilization, 4)
    if verdict.gil_pressure_ms is not None:
        attrs[c.GIL_PRESSURE_MS] = verdict.gil_pressure_ms
    if verdict.loop_lag_ms is not None:
        attrs[c.LOOP_LAG_MS] = verdict.loop_lag_ms
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


class RebuiltSpan(ReadableSpan):
    """A rebuilt root that keeps the original's dropped-attribute count.

    Its attributes are a plain dict: the originals were validated by the SDK and the verdict's are built
    clean, so re-validating them through BoundedAttributes would only cost time.
    """

    _dropped_attributes = 0

    @property
    def dropped_attributes(self) -> int:
        return self._dropped_attributes


# Attributes where HTTP instrumentations put the query string (old and new semantic conventions).
_QUERY_BEARING = ("http.target", "http.url", "url.full")
_QUERY_ONLY = ("url.query",)


def strip_query_strings(attributes: dict[str, Any]) -> None:
    """Query strings carry user data (ids, tokens, search terms); they are not kept unless the user opts
    in (``Settings(record_query_strings=True)``)."""
    for key in _QUERY_BEARING:
        value = attributes.get(key)
        if isinstance(value, str) and "?" in value:
            attributes[key] = value.split("?", 1)[0]
    for key in _QUERY_ONLY:
        attributes.pop(key, None)


def root_with_verdict(root: ReadableSpan, verdict: Verdict, keep_query_strings: bool = False) -> ReadableSpan:
    """The finished local root, rebuilt with the verdict attributes and diagnosis events.

    Rebuilding is the supported way: the SDK freezes a span's attributes before any processor sees it.
    """
    attributes: dict[str, Any] = dict(root.attributes or {})
    if not keep_query_strings:
        strip_query_strings(attributes)
    attributes.update(verdict_attributes(verdict))
    events: Sequence[Event] = tuple(root.events) + diagnosis_events(verdict, root.end_time or 0)
    rebuilt = RebuiltSpan(
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
    rebuilt._dropped_attributes = root.dropped_attributes
    return rebuilt
