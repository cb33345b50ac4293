"""Other instrumentations' spans at stage cost: the span a tracer from stagetrace's provider starts inside
a trace stagetrace holds (FastAPI's operation spans, the contrib ASGI middleware's send and receive spans,
httpx, a database client, the user's own ``tracer.start_as_current_span``).

An SDK span costs its request thread a lock, two bounded containers, the processor chain at start and end
and a ``ReadableSpan`` copy at the end (about three stages' worth of instructions). ``LightSpan`` records
the same calls into plain fields and is handed to the trace record when it ends, like a stage; the helper
thread packs it into the wire tuple an SDK span would have become, and the exporter process builds the SDK
span only if the trace is kept. What an exporter receives does not change: the provider's span limits,
OpenTelemetry's attribute rules (the SDK's own cleaning function), events, links, status rules, recorded
exceptions and the head sampler's decision are applied here exactly as the SDK applies them, and
``tests/test_light_spans.py`` compares both span by span.

A local root is a light span too: the span processor opens its trace record at its start and hands the
trace on at its end, as for an SDK root. Spans of traces stagetrace does not hold, and every span once a
processor other than stagetrace's is added to the provider, take the SDK's own path.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Mapping, Sequence
from time import time_ns
from types import MappingProxyType
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, SpanLimits
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from stagetrace._compat import clean_attribute_value_as_sdk
from stagetrace._safety import report_internal_error
from stagetrace.capture.records import SpanContextOnDemand
from stagetrace.common.wire import FLAGS_MASK, link_flags, scope_fields, trace_state_header

# The SDK's own logger and messages, so that a misuse reads the same whichever span class caught it.
_sdk_logger = logging.getLogger("opentelemetry.sdk.trace")
_attributes_logger = logging.getLogger("opentelemetry.attributes")

_PLAIN = frozenset((bool, int, float))


def cleaned_attributes(
    attributes: Mapping[str, Any] | None, max_count: int | None, max_length: int | None
) -> tuple[dict[str, Any], int]:
    """Attributes as the SDK's ``BoundedAttributes`` keeps them (cleaned, the oldest dropped past the
    count), and how many it dropped. For events and links, which are rare: the SDK's class itself."""
    if not attributes:
        return {}, 0
    bounded = BoundedAttributes(max_count, attributes, immutable=True, max_value_len=max_length)
    return bounded.copy(), bounded.dropped  # type: ignore[return-value]


def _valid_link(context: SpanContext | None, attributes: Any) -> bool:
    """The SDK's rule: a link needs a valid context, or at least attributes or a trace state to carry."""
    return bool(context and (context.is_valid or (attributes or context.trace_state)))


def _append_bounded(items: list[Any], item: Any, max_len: int | None) -> int:
    """The SDK's ``BoundedList.append``: past ``max_len`` the oldest goes. How many were dropped (0 or 1)."""
    if max_len is not None and len(items) >= max_len:
        if max_len == 0:
            return 1
        del items[0]
        items.append(item)
        return 1
    items.append(item)
    return 0


class LightSpan(SpanContextOnDemand, trace_api.Span):
    """A recording span that lives on the request thread as plain fields.

    It is also readable (``name``, ``attributes``, ``events``, ``status``, ...), like the SDK's span, for
    code that looks at the span it is given.
    """

    __slots__ = (
        "_attributes",
        "end_time",
        "instrumentation_scope",
        "kind",
        "limits",
        "name",
        "parent_span_id",
        "runtime",
        "span_id",
        "start_time",
        "trace",
        "trace_flags",
        "trace_id",
        "trace_state",
    )

    # Rarely set: class-level defaults, so a span's start does not pay to initialise them (the base class
    # gives instances a __dict__, which holds them once set).
    dropped_attributes = 0
    dropped_events = 0
    dropped_links = 0
    _events: list[tuple[str, int, dict[str, Any]]] | None = None
    _links: list[tuple[SpanContext, dict[str, Any]]] | None = None
    _status: Status | None = None
    record_exception_on_exit = True  # False when started with record_exception=False
    status_on_exit = True  # False when started with set_status_on_exception=False
    is_root = False  # a local root: the span processor opens and closes its trace record
    parent_is_remote = False  # its parent came from another process (a traceparent header)

    def __init__(
        self,
        name: str,
        trace_id: int,
        span_id: int,
        parent_span_id: int,
        trace_flags: TraceFlags,
        trace_state: TraceState | None,
        kind: SpanKind,
        start_time: int,
        limits: SpanLimits,
        scope: InstrumentationScope,
        trace: Any,
        runtime: Any,
    ) -> None:
        self.name = name
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_span_id = parent_span_id
        self.trace_flags = trace_flags
        self.trace_state = trace_state
        self.kind = kind
        self.start_time = start_time
        self.end_time: int | None = None
        self.limits = limits
        self.instrumentation_scope = scope
        self.trace = trace  # the TraceRecord of the held trace it belongs to
        self.runtime = runtime
        self._attributes: dict[str, Any] = {}

    # --- what the span API promises ---------------------------------------------------------------------
    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self.end_time is not None:
            _sdk_logger.warning("Setting attribute on ended span.")
            return
        self._put(key, value)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self.end_time is not None:
            _sdk_logger.warning("Setting attribute on ended span.")
            return
        for key, value in attributes.items():
            self._put(key, value)

    def _put(self, key: Any, value: Any) -> None:
        """``BoundedAttributes.__setitem__`` on a plain dict: the same checks, cleaning and eviction."""
        limits = self.limits
        if limits.max_span_attributes == 0:
            self.dropped_attributes += 1
            return
        if not key or not isinstance(key, str):
            _attributes_logger.warning("invalid key `%s`. must be non-empty string. Dropping key from attributes.", key)
            self.dropped_attributes += 1
            return
        max_length = limits.max_span_attribute_length
        if type(value) in _PLAIN or (type(value) is str and (max_length is None or len(value) <= max_length)):
            self._store(key, value)
        else:
            self._store(key, clean_attribute_value_as_sdk(value, max_length))

    def put_initial(self, attributes: Mapping[str, Any]) -> None:
        """``BoundedAttributes._set_items``: the attributes given at start (or by the sampler)."""
        limits = self.limits
        if limits.max_span_attributes == 0:
            self.dropped_attributes += len(attributes)
            return
        max_length = limits.max_span_attribute_length
        for key, value in attributes.items():
            if (
                type(key) is not str
                or not key
                or not (
                    type(value) in _PLAIN or (type(value) is str and (max_length is None or len(value) <= max_length))
                )
            ):
                cleaned: Mapping[str, Any] = clean_attribute_value_as_sdk(attributes, max_length)
                self.dropped_attributes += len(attributes) - len(cleaned)
                break
        else:
            cleaned = attributes
        for key, value in cleaned.items():
            self._store(key, value)

    def _store(self, key: str, value: Any) -> None:
        attrs = self._attributes
        if key in attrs:
            del attrs[key]
        else:
            max_count = self.limits.max_span_attributes
            if max_count is not None and len(attrs) >= max_count:
                _attributes_logger.warning(
                    "Attributes dict is full. Dropping the oldest key-value pair from attributes to make space "
                    "for the new key-value pair."
                )
                del attrs[next(iter(attrs))]
                self.dropped_attributes += 1
        attrs[key] = value

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None) -> None:
        limits = self.limits
        attrs, _ = cleaned_attributes(attributes, limits.max_event_attributes, limits.max_attribute_length)
        if self.end_time is not None:
            _sdk_logger.warning("Tried calling %s on an ended span.", "_add_event")
            return
        if self._events is None:
            self._events = []
        event = (name, time_ns() if timestamp is None else timestamp, attrs)
        self.dropped_events += _append_bounded(self._events, event, limits.max_events)

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if not _valid_link(context, attributes):
            return
        if self.end_time is not None:
            _sdk_logger.warning("Tried calling %s on an ended span.", "_add_link")
            return
        self._append_link(context, attributes)

    def _append_link(self, context: SpanContext, attributes: Mapping[str, Any] | None) -> None:
        limits = self.limits
        attrs, _ = cleaned_attributes(attributes, limits.max_link_attributes, limits.max_attribute_length)
        if self._links is None:
            self._links = []
        self.dropped_links += _append_bounded(self._links, (context, attrs), limits.max_links)

    def update_name(self, name: str) -> None:
        if self.end_time is not None:
            _sdk_logger.warning("Tried calling %s on an ended span.", "update_name")
            return
        self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        """The SDK's rules: OK is final, UNSET is ignored, a description goes with an ERROR code only."""
        if self.end_time is not None:
            _sdk_logger.warning("Tried calling %s on an ended span.", "set_status")
            return
        current = self._status
        if current is not None and current.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            if status.status_code is StatusCode.UNSET:
                return
            if description is not None:
                _sdk_logger.warning(
                    "Description %s ignored. Use either `Status` or `(StatusCode, Description)`", description
                )
            self._status = status
        elif isinstance(status, StatusCode):
            if status is StatusCode.UNSET:
                return
            self._status = Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        module = type(exception).__module__
        qualname = type(exception).__qualname__
        event_attributes: dict[str, Any] = {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            event_attributes.update(attributes)
        self.add_event("exception", event_attributes, timestamp)

    def __exit__(self, exc_type: Any, exc_val: BaseException | None, exc_tb: Any) -> None:
        if exc_val is not None and self.end_time is None:
            if self.record_exception_on_exit:
                self.record_exception(exc_val, escaped=True)
            if self.status_on_exit:
                self.set_status(Status(StatusCode.ERROR, f"{type(exc_val).__name__}: {exc_val}"))
        self.end()

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            _sdk_logger.warning("Calling end() on an ended span.")
            return
        self.end_time = time_ns() if end_time is None else end_time
        if self.is_root:
            self.runtime.processor.on_end(self)  # closes the trace record and hands the trace on
            return
        try:
            trace = self.trace
            with trace.lock:
                if not trace.closed and len(trace.others) < trace.max_others:
                    trace.others.append(self)
                    return
            self.runtime.shipper.submit_lone_span(self)  # its trace already left, or holds too many
        except Exception:
            report_internal_error("span end")

    # --- readable, like the SDK's span ------------------------------------------------------------------
    @property
    def attributes(self) -> Mapping[str, Any]:
        return MappingProxyType(self._attributes)

    @property
    def events(self) -> tuple[Event, ...]:
        return tuple(Event(name, attrs, timestamp=ts) for name, ts, attrs in self._events or ())

    @property
    def links(self) -> tuple[trace_api.Link, ...]:
        return tuple(trace_api.Link(ctx, attrs) for ctx, attrs in self._links or ())

    @property
    def status(self) -> Status:
        return self._status or Status(StatusCode.UNSET)

    @property
    def context(self) -> SpanContext:
        return self.get_span_context()

    @property
    def parent(self) -> SpanContext | None:
        if not self.parent_span_id:
            return None
        return SpanContext(
            self.trace_id, self.parent_span_id, self.parent_is_remote, self.trace_flags, self.trace_state
        )

    # --- the wire ---------------------------------------------------------------------------------------
    def wire_tuple(self) -> tuple[Any, ...]:
        """This span as ``common.wire.WireSpan``, as ``wire.pack_span`` makes one of an SDK span.
        Called on the helper thread, once a span. Its rarely set fields are class-level defaults until set
        (then in its ``__dict__``, as a root's flag and SpanContext are): read from there with their defaults,
        or as one constant tuple where nothing is set, not each through the interpreter's generic lookup
        (the instance, then the class), a few hundred instructions each."""
        set_here = self.__dict__
        remote, events, links, status, dropped_attributes, dropped_events, dropped_links = (
            [set_here.get(name, default) for name, default in _RARELY_SET] if set_here else _RARELY_SET_DEFAULTS
        )
        scope_name, scope_version = scope_fields(self.instrumentation_scope)
        return (
            self.name,
            self.trace_id,
            self.span_id,
            self.parent_span_id,
            remote,
            self.kind._value_,  # (common.wire, above pack_span, says why not .value)
            self.start_time,
            self.end_time or 0,
            dict(self._attributes),
            tuple(events) if events else (),
            tuple(
                (ctx.trace_id, ctx.span_id, link_flags(ctx), trace_state_header(ctx.trace_state), attrs)
                for ctx, attrs in links
            )
            if links
            else (),  # (no generator made for a span without links, as nearly every one is)
            status.status_code._value_ if status is not None else _UNSET,
            (status.description or "") if status is not None else "",
            scope_name,
            scope_version,
            self.trace_flags & FLAGS_MASK,
            trace_state_header(self.trace_state),
            dropped_attributes,
            dropped_events,
            dropped_links,
        )

    def __repr__(self) -> str:
        return f'LightSpan(name="{self.name}", span_id={self.span_id:016x})'


_UNSET = StatusCode.UNSET.value
# LightSpan's rarely set fields and their class-level defaults, in the order wire_tuple reads them
_RARELY_SET = tuple(
    (name, getattr(LightSpan, name))
    for name in (
        "parent_is_remote",
        "_events",
        "_links",
        "_status",
        "dropped_attributes",
        "dropped_events",
        "dropped_links",
    )
)
_RARELY_SET_DEFAULTS = tuple(default for _, default in _RARELY_SET)


def start_links(span: LightSpan, links: Sequence[trace_api.Link] | None) -> None:
    """The links given at start, as the SDK keeps them (``Span._new_links``): valid ones, the last
    ``max_links``."""
    for link in links or ():
        if link and _valid_link(link.context, link.attributes):
            span._append_link(link.context, link.attributes)
