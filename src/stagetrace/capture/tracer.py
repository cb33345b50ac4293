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

from opentelemetry.context import Context, attach, detach, set_value
from opentelemetry.sdk.trace import RandomIdGenerator, SpanProcessor, Tracer, TracerProvider
from opentelemetry.trace import Link as _Link
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util.types import Attributes

from stagetrace import _state
from stagetrace._compat import (
    SPAN_KEY,
    become_capture_tracer,
    follows_local_parent,
    tracer_counts_its_spans,
    tracer_enabled_check,
    tracer_scope,
    tracer_span_limits,
)
from stagetrace._safety import logger, report_internal_error
from stagetrace.capture.head_sampler import LocalRootRecordingSampler
from stagetrace.capture.light_spans import LightSpan, start_links
from stagetrace.capture.records import StageRecord
from stagetrace.capture.stage import current_context, direct_context, reset_current_context, set_current_context

_SAMPLED = TraceFlags.SAMPLED
_RANDOM = TraceFlags.RANDOM_TRACE_ID
# A child's flags: sampled or not, and the parent's random-trace-id bit, as the SDK's tracer sets them.
_FLAGS = {bits: TraceFlags(bits) for bits in range(4)}
_getrandbits = random.getrandbits


class _Rules:
    """What a tracer's light spans need, read once per tracer."""

    __slots__ = ("enabled", "follows_parent", "id_generator", "limits", "random_ids", "scope")

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
        self.enabled = tracer_enabled_check(tracer)


class CaptureTracer(Tracer):
    """An SDK tracer (it is one: everything but these two methods is the SDK's) whose ``start_span`` takes
    the light path inside held traces."""

    _capture_provider: CaptureTracerProvider
    _capture_rules: _Rules

    def start_as_current_span(  # type: ignore[override]
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[_Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> CurrentSpan:
        """What the SDK's does (``start_span`` and ``use_span``), as one small context manager instead of two
        generator-based ones: half of what a span inside a trace costs its thread."""
        return CurrentSpan(
            self,
            (name, context, kind, attributes, links, start_time, record_exception, set_status_on_exception),
            end_on_exit,
        )

    def sdk_start_as_current_span(self, *args: Any) -> Any:
        return super().start_as_current_span(*args)

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
        """The span, or None for the SDK's path (a trace stagetrace does not hold)."""
        parent: Any = (context if context is not None else current_context()).get(SPAN_KEY)
        parent_type = type(parent)
        if parent_type is StageRecord or parent_type is LightSpan:
            trace = parent.trace
            if trace is None:
                return None
            trace_id, parent_id = parent.trace_id, parent.span_id
            parent_flags, state = parent.trace_flags, parent.trace_state
        elif parent is None:
            return self._light_root(
                rt,
                name,
                context,
                kind,
                attributes,
                links,
                start_time,
                (record_exception, set_status_on_exception),
                None,
            )
        else:
            sc = parent.get_span_context()
            if not isinstance(sc, SpanContext):
                return None
            if not sc.is_valid or sc.is_remote:
                remote = sc if sc.is_valid else None
                return self._light_root(
                    rt,
                    name,
                    context,
                    kind,
                    attributes,
                    links,
                    start_time,
                    (record_exception, set_status_on_exception),
                    remote,
                )
            trace = rt.lookup_trace(sc.trace_id)
            if trace is None:
                return None
            trace_id, parent_id, parent_flags, state = sc.trace_id, sc.span_id, sc.trace_flags, sc.trace_state
        rules = self._capture_rules
        if not rules.enabled():
            return None
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
        )
        if not record_exception:
            span.record_exception_on_exit = False
        if not set_status_on_exception:
            span.status_on_exit = False
        if initial:
            span.put_initial(initial)
        if links:
            start_links(span, links)
        return span

    def _light_root(
        self,
        rt: Any,
        name: str,
        context: Context | None,
        kind: SpanKind,
        attributes: Attributes,
        links: Sequence[_Link] | None,
        start_time: int | None,
        on_exception: tuple[bool, bool],
        remote: SpanContext | None,
    ) -> Span | None:
        """A local root (of a new trace, or under a remote parent) as a light span: sampled as the SDK samples
        it, its trace record opened by the span processor at once, as for an SDK root."""
        rules = self._capture_rules
        if not rules.enabled():
            return None
        ids = rules.id_generator
        if remote is None:
            trace_id, parent_id = ids.generate_trace_id(), 0
            random_bit = _RANDOM if ids.is_trace_id_random() else 0
        else:
            trace_id, parent_id = remote.trace_id, remote.span_id
            random_bit = remote.trace_flags & _RANDOM
        result = self.sampler.should_sample(context, trace_id, name, kind, attributes, links)
        flags = _FLAGS[(_SAMPLED if result.decision.is_sampled() else 0) | random_bit]
        span_id = (_getrandbits(64) or 1) if rules.random_ids else ids.generate_span_id()
        if not result.decision.is_recording():
            return NonRecordingSpan(SpanContext(trace_id, span_id, False, flags, result.trace_state))
        span = LightSpan(
            name,
            trace_id,
            span_id,
            parent_id,
            flags,
            result.trace_state,
            kind,
            start_time if start_time is not None else _time_ns(),
            rules.limits,
            rules.scope,
            None,
            rt,
        )
        span.is_root = True
        if remote is not None:
            span.parent_is_remote = True
        record_exception, set_status_on_exception = on_exception
        if not record_exception:
            span.record_exception_on_exit = False
        if not set_status_on_exception:
            span.status_on_exit = False
        if result.attributes:
            span.put_initial(result.attributes)
        if links:
            start_links(span, links)
        rt.processor.on_start(span, context)  # opens its trace record (or counts the registry full)
        span.trace = rt.lookup_trace(trace_id)
        return span


class CurrentSpan:
    """``with tracer.start_as_current_span(...)``: the span started and made current on entry; on exit the
    context restored, an ``Exception`` recorded and the status set (as ``trace.use_span`` does: not for
    other ``BaseException``s), and the span ended. Used as a decorator, it is the SDK's own (which calls
    ``start_span`` on every call, so the decorated function's spans are light too)."""

    __slots__ = ("arguments", "end_on_exit", "span", "token", "tracer")

    def __init__(self, tracer: CaptureTracer, arguments: tuple[Any, ...], end_on_exit: bool) -> None:
        self.tracer = tracer
        self.arguments = arguments
        self.end_on_exit = end_on_exit
        self.span: Any = None
        self.token: Any = None

    def __enter__(self) -> Span:
        span = self.span = self.tracer.start_span(*self.arguments)
        if type(span) is LightSpan and direct_context:
            ctx = Context(current_context())  # one copy, where set_value would make two
            dict.__setitem__(ctx, SPAN_KEY, span)
            self.token = set_current_context(ctx)
        else:
            self.token = attach(set_value(SPAN_KEY, span))
        return span

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        span = self.span
        try:
            reset_current_context(self.token)
        except ValueError:  # the token was made in another context: the API's detach logs it
            detach(self.token)
        try:
            if isinstance(exc, Exception) and span.is_recording():
                _, _, _, _, _, _, record_exception, set_status_on_exception = self.arguments
                if record_exception:
                    span.record_exception(exc)
                if set_status_on_exception:
                    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        finally:
            if self.end_on_exit:
                span.end()

    def __call__(self, func: Any) -> Any:
        name, context, kind, attributes, links, start_time, record_exception, set_status = self.arguments
        return self.tracer.sdk_start_as_current_span(
            name, context, kind, attributes, links, start_time, record_exception, set_status, self.end_on_exit
        )(func)


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
