"""The records that cross from the application to the exporter: one table per record type, plain tuples
on the wire.

A stage crosses as the tuple of its ``STAGE_FIELDS`` (``pack_stage`` and, for a capture record,
``record_packer``: expressions compiled from the table), a span as the tuple of ``SPAN_FIELDS``. Both ends
index by these tables, so a field is added in one place. Everything here is plain data (ints, floats, strings, bytes,
tuples, dicts) so that ``marshal`` encodes it in C and the exporter can rebuild it without trusting the
sender's code.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from stagetrace.analysis.stage_record import STAGE_FIELDS, ShippedStage
from stagetrace.analysis.streams import StreamFields, stream_fields
from stagetrace.conventions import BATCH_INDEX, BATCH_ITEMS

# --- message kinds ------------------------------------------------------------------------------------
# application -> exporter
CONFIG = "C"  # (CONFIG, config dict): the first message a new exporter receives
TRACE = "T"  # (TRACE, *ShippedTrace fields in their order)
LONE_STAGE = "S"  # (LONE_STAGE, trace_id, flags, trace_state, perf_to_epoch_ns, late, stage)
LONE_SPAN = "P"  # (LONE_SPAN, span): a span of a trace whose local root stagetrace is not holding
SIGNAL = "G"  # (SIGNAL, series name, (epoch_ns, value, epoch_ns, value, ...))
LOOP_BLOCKS = "B"  # (LOOP_BLOCKS, ((start perf ns, end perf ns, loop thread, trace_id, stage name), ...))
METRIC = "M"  # (METRIC, method, args): a metric event raised in the application (drops, NVML gauge)
FLUSH = "F"  # (FLUSH, seq, timeout_s) -> answered with (FLUSH, seq, ok)
# exporter -> application
SPANS = "X"  # (SPANS, (span, ...)): kept spans for exporters that live in the application
VERDICT = "V"  # (VERDICT, Verdict) for on_verdict callbacks
LOG = "L"  # (LOG, level, message)
ACK = "A"  # (ACK, records handled so far)

# --- stages -------------------------------------------------------------------------------------------
# A stage crosses as the tuple of its STAGE_FIELDS and is read back as a ShippedStage: both defined with the
# record the analysis reads (``analysis.stage_record``), re-exported here for both ends of the channel.


def _function_from_source(source: str, name: str, namespace: dict[str, Any]) -> Any:
    """The function ``name`` defined by ``source``, compiled once from a field table (as ``dataclasses``
    writes ``__init__``): one expression over named fields where a loop over the table costs a call a field.
    Named after this module and the function, so that a traceback through it says where it came from."""
    namespace["__name__"] = __name__
    exec(compile(source, f"<{__name__}.{name}, generated>", "exec"), namespace)
    return namespace[name]


pack_stage: Callable[[Any], tuple[Any, ...]] = _function_from_source(
    f"def pack_stage(r):\n    return ({', '.join(f'r.{name}' for name in STAGE_FIELDS)},)\n", "pack_stage", {}
)
"""Anything with these attributes as its wire tuple: one attribute read a field (a capture record has its own,
``record_packer``)."""


def _all_slots(record_type: type) -> set[str]:
    """The slot names of a class and its bases (a ``__slots__`` may be one string)."""
    names: set[str] = set()
    for klass in record_type.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names.update([slots] if isinstance(slots, str) else slots)
    return names


def record_packer(record_type: type) -> Callable[[Any], tuple[Any, ...]]:
    """``pack_stage`` for a record type whose last ``STAGE_FIELDS`` are class-level defaults (plain values),
    stored on an instance (in its ``__dict__``) only when set, and whose others are slots. For every stage on
    the helper thread: a read of a field left to its class default takes the interpreter's generic lookup
    (the instance, then the class), ~180 instructions each, 13 a stage. So an instance of it reads its slots
    one each and the defaulted fields as one constant tuple where its ``__dict__`` is empty (nearly every
    stage of a CPU-only service), or from its ``__dict__`` with their defaults where something was set there
    (a stage of a GPU service, one on an event loop); anything else packs as every field. ValueError unless
    the fields not in its slots are the table's last ones, each a plain value on the class."""
    slots = _all_slots(record_type)
    leading = tuple(name for name in STAGE_FIELDS if name in slots)
    rest = STAGE_FIELDS[len(leading) :]
    if STAGE_FIELDS[: len(leading)] != leading:
        raise ValueError(f"{record_type.__name__}: its class-level defaults must be the last STAGE_FIELDS")
    defaults = tuple(inspect.getattr_static(record_type, name) for name in rest)
    for name, default in zip(rest, defaults, strict=True):
        if hasattr(type(default), "__get__"):  # a property or method would ship as itself, which marshal refuses
            raise ValueError(f"{record_type.__name__}.{name}: a class-level default must be a plain value")
    fast = ", ".join(f"r.{name}" for name in leading)
    from_dict = ", ".join(f"get({name!r}, DEFAULTS[{i}])" for i, name in enumerate(rest))
    every = ", ".join(f"r.{name}" for name in STAGE_FIELDS)
    source = (
        "def pack_record(r):\n"
        "    if type(r) is RECORD:\n"
        "        set_here = r.__dict__\n"
        "        if not set_here:\n"
        f"            return ({fast},) + DEFAULTS\n"
        "        get = set_here.get\n"
        f"        return ({fast}, {from_dict})\n"
        f"    return ({every},)\n"
    )
    return _function_from_source(source, "pack_record", {"RECORD": record_type, "DEFAULTS": defaults})


def trace_state_header(state: TraceState | None) -> str:
    """A trace state as it crosses to the exporter: its W3C header (empty for none)."""
    return state.to_header() if state else ""


# W3C trace flags as the plain int marshal takes: ``flags & FLAGS_MASK`` is one C operation, where ``int()`` of
# the SDK's int subclass goes through the type's call (~1.4 k instructions, on the helper thread for every span).
FLAGS_MASK = 0xFF
# A link's flags as they cross to the exporter: the linked context's W3C trace flags in the low byte, and
# whether it is remote in the bit OTLP itself uses for that (``SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK``).
LINK_REMOTE = 0x200


def link_flags(context: SpanContext) -> int:
    return (context.trace_flags & FLAGS_MASK) | (LINK_REMOTE if context.is_remote else 0)


_SPAN_ID_FIELD, _EXAMPLE_FIELD = STAGE_FIELDS.index("span_id"), STAGE_FIELDS.index("example")


def as_example(packed_stage: tuple[Any, ...], span_id: int) -> tuple[Any, ...]:
    """The slowest occurrence of a composite, packed, as the example span: an id of its own (its
    occurrence shared the composite's) and marked, so that its time is not counted twice."""
    out = list(packed_stage)
    out[_SPAN_ID_FIELD], out[_EXAMPLE_FIELD] = span_id, True
    return tuple(out)


class ShippedTrace(NamedTuple):
    """A TRACE message as the exporter reads it: the fields in their order on the channel, checked."""

    trace_id: int
    flags: int
    state: str  # W3C trace state header
    offset: int  # perf_to_epoch_ns of the trace
    dropped_stages: int
    gpu_utilization: float | None
    root: WireSpan
    stages: list[ShippedStage]
    others: list[WireSpan]
    loop_thread: int  # the event loop's thread its root started on, or 0
    worker_runs: tuple[int, ...]  # start, end, ...: perf ns its code ran on worker threads
    task_created_ns: int  # perf ns its root's task was created (capture/arrival.py), or 0
    received_ms_ago: int  # at that moment, ms since the request's socket last received data, or -1
    stream: StreamFields | None  # its response streamed (capture/streams.py)
    gen_ai: dict[str, Any] | None  # the generative model it served, as stagetrace.generation() said


def _trace_message_builder() -> Callable[..., tuple[Any, ...]]:
    """``trace_message``: a TRACE message from its fields by name (``ShippedTrace``'s, as the sender has them:
    spans and stages still plain tuples), in the order ``ShippedTrace`` gives them; every field required.
    Compiled once from the table (as ``pack_stage``), keyword-only parameters in its order: the
    helper thread's once-a-trace construction, where a ``**fields`` dict mapped back to a tuple took a third of
    the time of packing the trace's spans."""
    names = ", ".join(ShippedTrace._fields)
    source = f"def trace_message(*, {names}):\n    return (TRACE, {names})\n"
    built: Callable[..., tuple[Any, ...]] = _function_from_source(source, "trace_message", {"TRACE": TRACE})
    built.__doc__ = _trace_message_builder.__doc__
    return built


trace_message = _trace_message_builder()


def unpack_trace(msg: Sequence[Any]) -> ShippedTrace:
    """A TRACE message's fields (without the kind), checked: ValueError for one of the wrong shape."""
    if len(msg) != len(ShippedTrace._fields) + 1:
        raise ValueError(f"a trace message has {len(ShippedTrace._fields) + 1} fields, got {len(msg)}")
    sent = msg[1:]
    t: ShippedTrace = _as_shipped_trace(ShippedTrace, sent)
    ints = (t.trace_id, t.offset, t.flags, t.loop_thread, t.task_created_ns, t.received_ms_ago)
    if not all(type(v) is int for v in ints):
        raise ValueError("malformed trace header")
    if not isinstance(t.worker_runs, tuple) or not all(isinstance(v, int) for v in t.worker_runs):
        raise ValueError("malformed worker runs")
    if t.gen_ai is not None and not isinstance(t.gen_ai, dict):
        raise ValueError("malformed gen_ai record")
    # The root, stages, other spans and stream are still the sender's tuples until built here: read from the
    # message, not through the record, whose annotations name what they become (mypyc would check them).
    fields = list(sent)
    fields[_TRACE_ROOT] = check_span(fields[_TRACE_ROOT])
    fields[_TRACE_STAGES] = [ShippedStage(st) for st in fields[_TRACE_STAGES]]
    fields[_TRACE_OTHERS] = [check_span(span) for span in fields[_TRACE_OTHERS]]
    fields[_TRACE_STREAM] = stream_fields(fields[_TRACE_STREAM])
    return _as_shipped_trace(ShippedTrace, fields)  # what _replace does, without its per-field Python loop


_as_shipped_trace = tuple.__new__
_TRACE_ROOT, _TRACE_STAGES, _TRACE_OTHERS, _TRACE_STREAM = (
    ShippedTrace._fields.index(name) for name in ("root", "stages", "others", "stream")
)


# --- spans --------------------------------------------------------------------------------------------
class WireSpan(NamedTuple):
    """A span as the exporter process reads it: the fields of its wire tuple by name. On the channel it is a
    plain tuple in this order (``marshal`` takes no subclasses): ``pack_span`` and ``LightSpan.wire_tuple`` make
    one, ``check_span`` reads one back as this."""

    name: str
    trace_id: int
    span_id: int
    parent_span_id: int  # 0: no parent
    parent_is_remote: bool
    kind: int  # SpanKind value
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: tuple[tuple[str, int, dict[str, Any]], ...]  # (name, timestamp_ns, attributes)
    links: tuple[tuple[int, int, int, str, dict[str, Any]], ...]  # (trace_id, span_id, link_flags, state, attrs)
    status_code: int  # StatusCode value
    status_description: str
    scope_name: str
    scope_version: str
    flags: int
    trace_state: str  # W3C header form
    dropped_attributes: int
    dropped_events: int
    dropped_links: int


SPAN_FIELDS = WireSpan._fields
# A WireSpan from a tuple in its order, in one C call (``WireSpan._make`` and keyword construction run Python
# code: the exporter makes one per span of every trace, and one per stage span it builds).
_as_wire_span = tuple.__new__
# For the encoder's index reads on its hot path (annotated: mypyc, which benchmarks/exporter_cost.py tries,
# infers no type for it across modules)
SPAN_INDEX: dict[str, int] = {name: i for i, name in enumerate(SPAN_FIELDS)}
_SPAN_COUNTS = tuple(SPAN_INDEX[f] for f in ("dropped_attributes", "dropped_events", "dropped_links"))
_LINKS = SPAN_INDEX["links"]


def parse_trace_state(header: str) -> TraceState | None:
    return TraceState.from_header([header]) if header else None


def _plain_attributes(attributes: Any) -> dict[str, Any]:
    return dict(attributes) if attributes else {}


# A span's kind and status code cross as their enum members' ``_value_`` (the attribute the enum module keeps
# a member's value in): a plain read, where ``.value`` is a Python descriptor call and a dict keyed by members
# calls the enum's Python ``__hash__`` (~1.3 k instructions, on the helper thread for every span).


# by id; each entry holds its scope, so that no other object can take the id while the entry is there
_SCOPE_FIELDS: dict[int, tuple[InstrumentationScope, tuple[str, str]]] = {}


def scope_fields(scope: InstrumentationScope | None) -> tuple[str, str]:
    """An instrumentation scope's name and version ("" for none), read once a scope: both are properties, a
    Python call each, for every span a scope (a handful in a process) gives."""
    if scope is None:
        return "", ""
    known = _SCOPE_FIELDS.get(id(scope))
    if known is None or known[0] is not scope:
        if len(_SCOPE_FIELDS) >= 1024:  # scopes made per call somewhere: stay bounded
            _SCOPE_FIELDS.clear()
        known = _SCOPE_FIELDS[id(scope)] = (scope, (scope.name, scope.version or ""))
    return known[1]


def pack_span(span: ReadableSpan) -> tuple[Any, ...]:
    """An SDK span as its wire tuple (``WireSpan``'s fields in order, a plain tuple for ``marshal``). Runs on
    the application's helper thread, never a request thread."""
    ctx = span.context
    parent = span.parent
    scope_name, scope_version = scope_fields(span.instrumentation_scope)
    status = span.status
    return (
        span.name,
        ctx.trace_id,
        ctx.span_id,
        parent.span_id if parent is not None else 0,
        bool(parent.is_remote) if parent is not None else False,
        span.kind._value_,
        span.start_time or 0,
        span.end_time or 0,
        _plain_attributes(span.attributes),
        tuple((e.name, e.timestamp, _plain_attributes(e.attributes)) for e in span.events),
        tuple(
            (
                link.context.trace_id,
                link.context.span_id,
                link_flags(link.context),
                trace_state_header(link.context.trace_state),
                _plain_attributes(link.attributes),
            )
            for link in span.links
        ),
        status.status_code._value_,
        status.description or "",
        scope_name,
        scope_version,
        ctx.trace_flags & FLAGS_MASK,
        trace_state_header(ctx.trace_state),
        span.dropped_attributes,
        span.dropped_events,
        span.dropped_links,
    )


def member_link(trace_id: int, span_id: int, flags: int, trace_state: str, index: int, items: int) -> tuple[Any, ...]:
    """A link from a batch span to one member's batch stage, in the span tuple's link layout."""
    return (trace_id, span_id, flags, trace_state, {BATCH_INDEX: index, BATCH_ITEMS: items})


class RebuiltSpan(ReadableSpan):
    """A span rebuilt from its wire tuple, keeping the original's counts of what its limits dropped. Its
    attributes are a plain dict: they were validated by the SDK (or built clean) where the span was made."""

    _dropped_attributes = 0
    _dropped_events = 0
    _dropped_links = 0

    @property
    def dropped_attributes(self) -> int:
        return self._dropped_attributes

    @property
    def dropped_events(self) -> int:
        return self._dropped_events

    @property
    def dropped_links(self) -> int:
        return self._dropped_links


class StableResource(Resource):
    """A Resource whose hash is computed once. The SDK's OTLP encoder groups spans by resource and hashes
    it for every span, and ``Resource.__hash__`` serialises the attributes to JSON each time (measured: a
    large share of the exporter's encoding time). A resource never changes after it is built."""

    def __init__(self, attributes: Any, schema_url: str | None = None) -> None:
        super().__init__(attributes, schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


_scopes: dict[tuple[str, str], InstrumentationScope] = {}
_KINDS = {k.value: k for k in SpanKind}
_STATUS_CODES = {s.value: s for s in StatusCode}
_UNSET = Status(StatusCode.UNSET)


def _scope(name: str, version: str) -> InstrumentationScope:
    key = (name, version)
    scope = _scopes.get(key)
    if scope is None:
        scope = InstrumentationScope(name, version or None)
        if len(_scopes) < 1024:
            _scopes[key] = scope
    return scope


def to_readable(packed: Sequence[Any], resource: Resource) -> ReadableSpan:
    """The wire tuple as an SDK span, ready for any span processor or exporter."""
    p: WireSpan = packed if type(packed) is WireSpan else _as_wire_span(WireSpan, packed)
    trace_id, flags, state_header = p.trace_id, p.flags, p.trace_state
    trace_flags = TraceFlags(flags)
    state = parse_trace_state(state_header)
    code = _STATUS_CODES.get(p.status_code, StatusCode.UNSET)
    parent = p.parent_span_id
    span = RebuiltSpan(
        name=p.name,
        context=SpanContext(trace_id, p.span_id, False, trace_flags, state),
        parent=SpanContext(trace_id, parent, p.parent_is_remote, trace_flags, state) if parent else None,
        resource=resource,
        attributes=p.attributes,
        events=tuple(Event(n, a, timestamp=ts) for n, ts, a in p.events),
        links=tuple(
            Link(SpanContext(t, s, bool(f & LINK_REMOTE), TraceFlags(f & FLAGS_MASK), parse_trace_state(st)), a)
            for t, s, f, st, a in p.links
        ),
        kind=_KINDS.get(p.kind, SpanKind.INTERNAL),
        status=_UNSET if code is StatusCode.UNSET else Status(code, p.status_description or None),
        start_time=p.start_ns,
        end_time=p.end_ns,
        instrumentation_scope=_scope(p.scope_name, p.scope_version),
    )
    span._dropped_attributes = p.dropped_attributes
    span._dropped_events = p.dropped_events
    span._dropped_links = p.dropped_links
    return span


def check_span(packed: Any) -> WireSpan:
    """A span tuple from the channel, checked enough that building it cannot fail later, by name."""
    if not isinstance(packed, tuple) or len(packed) != len(SPAN_FIELDS):
        raise ValueError("malformed span record")
    span: WireSpan = packed if type(packed) is WireSpan else _as_wire_span(WireSpan, packed)
    if not isinstance(span.name, str) or not isinstance(span.trace_id, int):
        raise ValueError("malformed span record")
    if not isinstance(span.start_ns, int) or not isinstance(span.end_ns, int):
        raise ValueError("malformed span record")
    if not isinstance(span.attributes, dict) or not isinstance(span.events, tuple):
        raise ValueError("malformed span record")
    if not all(type(packed[i]) is int for i in _SPAN_COUNTS):
        raise ValueError("malformed span record")
    return span


def new_span(*fields: Any) -> WireSpan:
    """A WireSpan from its fields in ``WireSpan``'s order (positional: the exporter builds one per stage span,
    and keyword construction runs Python code per field)."""
    return _as_wire_span(WireSpan, fields)


def replace_span(span: WireSpan, **changes: Any) -> WireSpan:
    """The span with some fields changed (by name)."""
    fields = list(span)
    for name, value in changes.items():
        fields[SPAN_INDEX[name]] = value
    return _as_wire_span(WireSpan, fields)


def with_links(packed: tuple[Any, ...], links: tuple[Any, ...]) -> tuple[Any, ...]:
    """A span tuple still to be sent (a plain tuple, for ``marshal``) with other links."""
    out = list(packed)
    out[_LINKS] = links
    return tuple(out)


def plain(value: Any) -> Any:
    """``value`` with subclasses of the plain types (IntEnum, TraceFlags, str enums) made plain, so that
    ``marshal`` accepts it; anything it cannot hold becomes its ``str``."""
    if value is None or type(value) in (str, int, float, bool, bytes):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bytes):
        return bytes(value)
    if isinstance(value, (tuple, list)):
        return tuple(plain(v) for v in value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return str(value)


def flatten(samples: Iterable[tuple[int, float]]) -> tuple[Any, ...]:
    """(time, value) samples as one flat tuple, the way a series crosses the channel."""
    out: list[Any] = []
    for t, v in samples:
        out.append(t)
        out.append(v)
    return tuple(out)
