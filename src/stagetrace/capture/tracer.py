"""The tracer provider ``configure()`` builds and points FastAPI at: an SDK ``TracerProvider`` whose tracers
start a ``LightSpan`` (``capture/light_spans.py``) for a span inside a trace stagetrace holds, and an SDK
span for everything else (local roots, spans of traces it does not hold).

The light path is taken only while the provider's processors are stagetrace's alone (then no processor in
the application would see the span before the exporter process does): adding one, or
``Settings(light_spans=False)``, gives every span the SDK's path.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from time import time_ns as _time_ns
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import RandomIdGenerator, SpanProcessor, Tracer, TracerProvider
from opentelemetry.trace import Link as _Link
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags
from opentelemetry.util.types import Attributes

from stagetrace import _state
from stagetrace._compat import (
    SPAN_KEY,
    become_capture_tracer,
    follows_local_parent,
    tracer_counts_its_spans,
    tracer_enabled,
    tracer_scope,
    tracer_span_limits,
)
from stagetrace._safety import logger, report_internal_error
from stagetrace.capture.light_spans import LightSpan, start_links
from stagetrace.capture.records import StageRecord
from stagetrace.capture.stage import current_context
from stagetrace.handoff.sampler import LocalRootRecordingSampler

_SAMPLED = TraceFlags.SAMPLED
_RANDOM = TraceFlags.RANDOM_TRACE_ID
# A child's flags: sampled or not, and the parent's random-trace-id bit, as the SDK's tracer sets them.
_FLAGS = {bits: TraceFlags(bits) for bits in range(4)}
_getrandbits = random.getrandbits


class _Rules:
    """What a tracer's light spans need, read once per tracer."""

    __slots__ = ("follows_parent", "id_generator", "limits", "random_ids", "scope")

    def __init__(self, tracer: Tracer) -> None:
        sampler = tracer.sampler
        base = sampler.base if isinstance(sampler, LocalRootRecordingSampler) else sampler
        # Children of a local parent under the default parent-based sampler follow the parent's flag; any
        # other sampler is asked for every span, as the SDK asks it.
        self.follows_parent = follows_local_parent(base)
        self.limits = tracer_span_limits(tracer)
        self.scope = tracer_scope(tracer)
        self.id_generator = tracer.id_generator
        self.random_ids = type(tracer.id_generator) is RandomIdGenerator


class CaptureTracer(Tracer):
    """An SDK tracer (it is one: ``start_as_current_span`` and everything else are the SDK's) whose
    ``start_span`` takes the light path inside held traces."""

    _capture_provider: CaptureTracerProvider
    _capture_rules: _Rules

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[_Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> Span:
        rt = self._capture_provider.capture
        if rt is not None and rt is _state.runtime:
            try:
                span = self._light_span(
                    rt, name, context, kind, attributes, links, start_time, record_exception, set_status_on_exception
                )
            except Exception:
                report_internal_error("light span start")
                span = None
            if span is not None:
                return span
        return super().start_span(
            name, context, kind, attributes, links, start_time, record_exception, set_status_on_exception
        )

    def _light_span(
        self,
        rt: Any,
        name: str,
        context: Context | None,
        kind: SpanKind,
        attributes: Attributes,
        links: Sequence[_Link] | None,
        start_time: int | None,
        record_exception: bool,
        set_status_on_exception: bool,
    ) -> Span | None:
        """The span, or None for the SDK's path (a local root, or a trace stagetrace does not hold)."""
        parent: Any = (context if context is not None else current_context()).get(SPAN_KEY)
        parent_type = type(parent)
        if parent_type is StageRecord or parent_type is LightSpan:
            trace = parent.trace
            if trace is None:
                return None
            trace_id, parent_id = parent.trace_id, parent.span_id
            parent_flags, state = parent.trace_flags, parent.trace_state
        elif parent is None:
            return None
        else:
            sc = parent.get_span_context()
            if not isinstance(sc, SpanContext) or not sc.is_valid or sc.is_remote:
                return None
            trace = rt.lookup_trace(sc.trace_id)
            if trace is None:
                return None
            trace_id, parent_id, parent_flags, state = sc.trace_id, sc.span_id, sc.trace_flags, sc.trace_state
        if not tracer_enabled(self):
            return None
        rules = self._capture_rules
        random_bit = (parent_flags or 0) & _RANDOM
        if rules.follows_parent:
            sampled = bool((parent_flags or 0) & _SAMPLED)
            recording = sampled
            initial = attributes
        else:
            result = self.sampler.should_sample(context, trace_id, name, kind, attributes, links)
            sampled = result.decision.is_sampled()
            recording = result.decision.is_recording()
            initial = result.attributes
            state = result.trace_state
        flags = _FLAGS[(_SAMPLED if sampled else 0) | random_bit]
        span_id = (_getrandbits(64) or 1) if rules.random_ids else rules.id_generator.generate_span_id()
        if not recording:
            return NonRecordingSpan(SpanContext(trace_id, span_id, False, flags, state))
        span = LightSpan(
            name,
            trace_id,
            span_id,
            parent_id,
            flags,
            state,
            kind,
            start_time if start_time is not None else _time_ns(),
            rules.limits,
            rules.scope,
            trace,
            rt,
            record_exception,
            set_status_on_exception,
        )
        if initial:
            span.put_initial(initial)
        if links:
            start_links(span, links)
        return span


class CaptureTracerProvider(TracerProvider):
    """The SDK's provider, with tracers that record light spans once ``bind`` names the runtime whose
    traces they belong to."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.capture: Any = None  # the Runtime whose held traces get light spans; None: the SDK's path
        self._added: list[SpanProcessor] = []

    def bind(self, runtime: Any, *, light_spans: bool) -> None:
        """Light spans for ``runtime``'s traces, if its processor is the only one and nothing asks for SDK
        spans (``Settings(light_spans=False)``)."""
        self.capture = runtime if light_spans and self._added == [runtime.processor] else None

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        self._added.append(span_processor)
        if self.capture is not None and span_processor is not self.capture.processor:
            self.capture = None
            logger.info(
                "stagetrace: a span processor was added to stagetrace's tracer provider; spans inside traces "
                "are now SDK spans, so that it sees them"
            )

    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        tracer = super().get_tracer(*args, **kwargs)
        if type(tracer) is Tracer and not tracer_counts_its_spans(tracer):
            try:
                # Its state first, then its class: another thread may get it from the cache at any moment.
                tracer._capture_rules = _Rules(tracer)  # type: ignore[attr-defined]
                tracer._capture_provider = self  # type: ignore[attr-defined]
                become_capture_tracer(tracer, CaptureTracer)
            except Exception:
                report_internal_error("tracer set-up")
        return tracer
