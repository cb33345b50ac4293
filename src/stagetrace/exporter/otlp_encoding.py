"""Wire spans (``common.wire`` span tuples) straight to an OTLP ``ExportTraceServiceRequest`` in protobuf
bytes: the message the SDK's OTLP exporters send, without building an SDK span or a protobuf object per span.

The SDK's path for a kept span is a ``ReadableSpan`` from the tuple, a ``pb2.Span`` per span, a ``pb2``
message per attribute, then serialisation: about three quarters of what the exporter process spent on an
exported trace (``benchmarks/e2e.py --instructions``, ``stagetrace-all`` against the default). Here each
field is written as the protobuf wire format defines it (varints, fixed64, length-delimited), with the
encodings that repeat (attribute keys, the resource, each instrumentation scope) kept. The output parses to
the same message as the SDK's encoder gives for the same spans, field for field: the SDK's choices are kept
(span flags carry only the parent's remote bits, links carry no trace state, the status is always
present), and ``tests/test_otlp_encoding.py`` compares the two on every kind of value a span can hold.

Pure: bytes in memory, no I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from stagetrace.common import wire

# Protobuf wire types
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5

# The SDK's span flags: whether the parent's remoteness is known (always), and whether it was remote.
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200

_pack_double = struct.Struct("<d").pack
_pack_fixed64 = struct.Struct("<Q").pack
_pack_fixed32 = struct.Struct("<I").pack


def _tag(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


_ONE_BYTE = tuple(bytes((i,)) for i in range(0x80))  # the varints of 0..127, one byte each


def _varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return _ONE_BYTE[value]
    if value < 0:
        value += 1 << 64  # int64: two's complement, ten bytes
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len_field(tag: bytes, payload: bytes) -> bytes:
    n = len(payload)
    return tag + (_ONE_BYTE[n] if n < 0x80 else _varint(n)) + payload


# Tags, by message (opentelemetry/proto/trace/v1/trace.proto, common/v1/common.proto, resource/v1/resource.proto)
_REQUEST_RESOURCE_SPANS = _tag(1, _LEN)
_RS_RESOURCE, _RS_SCOPE_SPANS, _RS_SCHEMA_URL = _tag(1, _LEN), _tag(2, _LEN), _tag(3, _LEN)
_SS_SCOPE, _SS_SPANS = _tag(1, _LEN), _tag(2, _LEN)
_SCOPE_NAME, _SCOPE_VERSION = _tag(1, _LEN), _tag(2, _LEN)
_RESOURCE_ATTRIBUTES = _tag(1, _LEN)
_SPAN_TRACE_ID, _SPAN_SPAN_ID = _tag(1, _LEN), _tag(2, _LEN)
_SPAN_TRACE_STATE, _SPAN_PARENT = _tag(3, _LEN), _tag(4, _LEN)
_SPAN_NAME, _SPAN_KIND = _tag(5, _LEN), _tag(6, _VARINT)
_SPAN_START, _SPAN_END = _tag(7, _FIXED64), _tag(8, _FIXED64)
_SPAN_ATTRIBUTE, _SPAN_DROPPED_ATTRIBUTES = _tag(9, _LEN), _tag(10, _VARINT)
_SPAN_EVENT, _SPAN_DROPPED_EVENTS = _tag(11, _LEN), _tag(12, _VARINT)
_SPAN_LINK, _SPAN_DROPPED_LINKS = _tag(13, _LEN), _tag(14, _VARINT)
_SPAN_STATUS, _SPAN_FLAGS = _tag(15, _LEN), _tag(16, _FIXED32)
_EVENT_TIME, _EVENT_NAME, _EVENT_ATTRIBUTE = _tag(1, _FIXED64), _tag(2, _LEN), _tag(3, _LEN)
_LINK_TRACE_ID, _LINK_SPAN_ID = _tag(1, _LEN), _tag(2, _LEN)
_LINK_ATTRIBUTE, _LINK_FLAGS = _tag(4, _LEN), _tag(6, _FIXED32)
_STATUS_MESSAGE, _STATUS_CODE = _tag(2, _LEN), _tag(3, _VARINT)
_KV_KEY, _KV_VALUE = _tag(1, _LEN), _tag(2, _LEN)
_ANY_STRING, _ANY_BOOL, _ANY_INT = _tag(1, _LEN), _tag(2, _VARINT), _tag(3, _VARINT)
_ANY_DOUBLE, _ANY_ARRAY, _ANY_KVLIST, _ANY_BYTES = _tag(4, _FIXED64), _tag(5, _LEN), _tag(6, _LEN), _tag(7, _LEN)
_ARRAY_VALUE = _KVLIST_VALUE = _tag(1, _LEN)  # ArrayValue.values, KeyValueList.values
_STATUS_ERROR = 2  # StatusCode.ERROR: the only status whose description the SDK keeps

_EMPTY_STATUS = _len_field(_SPAN_STATUS, b"")
_FLAGS_LOCAL_PARENT = _SPAN_FLAGS + _pack_fixed32(_HAS_IS_REMOTE)
_FLAGS_REMOTE_PARENT = _SPAN_FLAGS + _pack_fixed32(_HAS_IS_REMOTE | _IS_REMOTE)
_LINK_FLAGS_BY_REMOTE = {  # a link's context: local, remote (wire.LINK_REMOTE is OTLP's own bit)
    0: _LINK_FLAGS + _pack_fixed32(_HAS_IS_REMOTE),
    wire.LINK_REMOTE: _LINK_FLAGS + _pack_fixed32(_HAS_IS_REMOTE | _IS_REMOTE),
}
_KINDS = {kind: _SPAN_KIND + _varint(kind + 1) for kind in range(5)}  # SpanKind.value -> OTLP's enum (+1)
_BOOLS = {True: _ANY_BOOL + b"\x01", False: _ANY_BOOL + b"\x00"}


def _any_value(value: Any) -> bytes:
    """An ``AnyValue``'s fields (oneof members are written even when they hold their type's zero)."""
    kind = type(value)
    if kind is str:
        return _len_field(_ANY_STRING, value.encode("utf-8"))
    if kind is bool:
        return _BOOLS[value]
    if kind is int:
        return _ANY_INT + _varint(value)
    if kind is float:
        return _ANY_DOUBLE + _pack_double(value)
    if value is None:
        return b""
    if isinstance(value, bool):
        return _BOOLS[bool(value)]
    if isinstance(value, str):
        return _len_field(_ANY_STRING, str(value).encode("utf-8"))
    if isinstance(value, int):
        return _ANY_INT + _varint(int(value))
    if isinstance(value, float):
        return _ANY_DOUBLE + _pack_double(float(value))
    if isinstance(value, bytes):
        return _len_field(_ANY_BYTES, bytes(value))
    if isinstance(value, Mapping):
        return _len_field(_ANY_KVLIST, b"".join(_key_value(_KVLIST_VALUE, str(k), v) for k, v in value.items()))
    if isinstance(value, Sequence):
        return _len_field(_ANY_ARRAY, b"".join(map(_array_element, value)))
    raise TypeError(f"cannot encode a {kind.__name__} attribute value")


class _KeyCodec:
    """What one attribute key's ``KeyValue`` fields start with under one tag, worked out once: a span's
    attributes are mostly stagetrace's own keys with numbers, whose whole field is then a prefix and eight
    bytes (a double)."""

    __slots__ = ("double_prefix", "false", "key_then_value", "tag", "true")

    def __init__(self, tag: bytes, key: str) -> None:
        self.tag = tag
        self.key_then_value = _len_field(_KV_KEY, key.encode("utf-8")) + _KV_VALUE
        # KeyValue{key, value: AnyValue{double}}: the value's length is 9 (a tag and eight bytes)
        self.double_prefix = tag + _varint(len(self.key_then_value) + 10) + self.key_then_value + b"\x09" + _ANY_DOUBLE
        self.true = self.field(_BOOLS[True])
        self.false = self.field(_BOOLS[False])

    def field(self, any_value: bytes) -> bytes:
        """The whole ``KeyValue`` field, given its value's ``AnyValue`` fields."""
        n = len(any_value)
        body = self.key_then_value + (_ONE_BYTE[n] if n < 0x80 else _varint(n)) + any_value
        n = len(body)
        return self.tag + (_ONE_BYTE[n] if n < 0x80 else _varint(n)) + body


# An array element holding a double: ArrayValue.values' tag, length 9, the AnyValue's double tag.
_DOUBLE_ELEMENT = _ARRAY_VALUE + b"\x09" + _ANY_DOUBLE


def _array_element(value: Any) -> bytes:
    if type(value) is float:
        return _DOUBLE_ELEMENT + _pack_double(value)
    return _len_field(_ARRAY_VALUE, _any_value(value))


_CODECS: dict[tuple[bytes, str], _KeyCodec] = {}  # by (tag, key)
_MAX_CODECS = 4096


def _codec(tag: bytes, key: str) -> _KeyCodec:
    codec = _CODECS.get((tag, key))
    if codec is None:
        codec = _KeyCodec(tag, key)
        if len(_CODECS) < _MAX_CODECS:
            _CODECS[(tag, key)] = codec
    return codec


def _key_value(tag: bytes, key: str, value: Any) -> bytes:
    codec = _codec(tag, key)
    kind = type(value)
    if kind is float:
        return codec.double_prefix + _pack_double(value)
    if kind is bool:
        return codec.true if value else codec.false
    return codec.field(_any_value(value))


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> list[bytes]:
    """The attributes as repeated ``KeyValue`` fields under ``tag``; a value that cannot be encoded is left
    out, as the SDK's encoder does (it logs each one). The common kinds of value are written inline: this
    loop is most of the cost of an exported span."""
    if not attributes:
        return []
    out = []
    codecs, varint, one_byte = _CODECS, _varint, _ONE_BYTE  # (a one-byte length is looked up)
    for key, value in attributes.items():
        try:
            codec = codecs.get((tag, key)) or _codec(tag, key)
            kind = type(value)
            if kind is float:
                out.append(codec.double_prefix + _pack_double(value))
                continue
            if kind is bool:
                out.append(codec.true if value else codec.false)
                continue
            if kind is str:
                text = value.encode("utf-8")
                n = len(text)
                any_value = _ANY_STRING + (one_byte[n] if n < 0x80 else varint(n)) + text
            elif kind is int:
                any_value = _ANY_INT + varint(value)
            else:
                any_value = _any_value(value)
        except (TypeError, ValueError, UnicodeError):
            continue
        out.append(codec.field(any_value))
    return out


def encode_span(span: Sequence[Any]) -> bytes:
    """One wire span as a ``Span`` message's fields."""
    (
        name,
        trace_id,
        span_id,
        parent_span_id,
        parent_is_remote,
        kind,
        start_ns,
        end_ns,
        attributes,
        events,
        links,
        status_code,
        status_description,
        _scope_name,
        _scope_version,
        _flags,
        trace_state,
        dropped_attributes,
        dropped_events,
        dropped_links,
    ) = span
    parts = [
        _SPAN_TRACE_ID + b"\x10" + trace_id.to_bytes(16, "big"),
        _SPAN_SPAN_ID + b"\x08" + span_id.to_bytes(8, "big"),
    ]
    if trace_state:
        parts.append(_len_field(_SPAN_TRACE_STATE, trace_state.encode("utf-8")))
    if parent_span_id:
        parts.append(_SPAN_PARENT + b"\x08" + parent_span_id.to_bytes(8, "big"))
    if name:
        parts.append(_len_field(_SPAN_NAME, name.encode("utf-8")))
    parts.append(_KINDS.get(kind, _KINDS[0]))
    if start_ns:
        parts.append(_SPAN_START + _pack_fixed64(start_ns))
    if end_ns:
        parts.append(_SPAN_END + _pack_fixed64(end_ns))
    parts += _attributes(_SPAN_ATTRIBUTE, attributes)
    if dropped_attributes:
        parts.append(_SPAN_DROPPED_ATTRIBUTES + _varint(dropped_attributes))
    for event_name, timestamp, event_attributes in events:
        event = [_EVENT_TIME + _pack_fixed64(timestamp)] if timestamp else []
        if event_name:
            event.append(_len_field(_EVENT_NAME, event_name.encode("utf-8")))
        event += _attributes(_EVENT_ATTRIBUTE, event_attributes)
        parts.append(_len_field(_SPAN_EVENT, b"".join(event)))
    if dropped_events:
        parts.append(_SPAN_DROPPED_EVENTS + _varint(dropped_events))
    for link_trace_id, link_span_id, link_flags, _link_state, link_attributes in links:
        link = [
            _LINK_TRACE_ID + b"\x10" + link_trace_id.to_bytes(16, "big"),
            _LINK_SPAN_ID + b"\x08" + link_span_id.to_bytes(8, "big"),
            *_attributes(_LINK_ATTRIBUTE, link_attributes),
            _LINK_FLAGS_BY_REMOTE[link_flags & wire.LINK_REMOTE],
        ]
        parts.append(_len_field(_SPAN_LINK, b"".join(link)))
    if dropped_links:
        parts.append(_SPAN_DROPPED_LINKS + _varint(dropped_links))
    if status_code:
        status = _STATUS_CODE + _varint(status_code)
        if status_code == _STATUS_ERROR and status_description:
            status = _len_field(_STATUS_MESSAGE, status_description.encode("utf-8")) + status
        parts.append(_len_field(_SPAN_STATUS, status))
    else:
        parts.append(_EMPTY_STATUS)
    parts.append(_FLAGS_REMOTE_PARENT if parent_span_id and parent_is_remote else _FLAGS_LOCAL_PARENT)
    return b"".join(parts)


class TraceRequestEncoder:
    """Wire spans of one resource to ``ExportTraceServiceRequest`` bytes: spans grouped by instrumentation
    scope in the order scopes first appear, as the SDK's encoder groups them."""

    def __init__(self, resource_attributes: Mapping[str, Any], schema_url: str = "") -> None:
        resource = b"".join(_attributes(_RESOURCE_ATTRIBUTES, resource_attributes))
        self._resource = _len_field(_RS_RESOURCE, resource)
        self._schema_url = _len_field(_RS_SCHEMA_URL, schema_url.encode("utf-8")) if schema_url else b""
        self._scopes: dict[tuple[str, str], bytes] = {}

    def _scope(self, name: str, version: str) -> bytes:
        key = (name, version)
        encoded = self._scopes.get(key)
        if encoded is None:
            scope = _len_field(_SCOPE_NAME, name.encode("utf-8")) if name else b""
            if version:
                scope += _len_field(_SCOPE_VERSION, version.encode("utf-8"))
            encoded = _len_field(_SS_SCOPE, scope)
            if len(self._scopes) < 1024:
                self._scopes[key] = encoded
        return encoded

    def encode(self, spans: Iterable[Sequence[Any]]) -> bytes:
        by_scope: dict[tuple[str, str], list[bytes]] = {}
        for span in spans:
            key = (span[_SCOPE_NAME_INDEX], span[_SCOPE_VERSION_INDEX])
            encoded = _len_field(_SS_SPANS, encode_span(span))
            group = by_scope.get(key)
            if group is None:
                by_scope[key] = [encoded]
            else:
                group.append(encoded)
        if not by_scope:
            return b""
        scope_spans = b"".join(
            _len_field(_RS_SCOPE_SPANS, self._scope(*key) + b"".join(group)) for key, group in by_scope.items()
        )
        resource_spans = self._resource + scope_spans + self._schema_url
        return _len_field(_REQUEST_RESOURCE_SPANS, resource_spans)


_SCOPE_NAME_INDEX = wire.SPAN_INDEX["scope_name"]
_SCOPE_VERSION_INDEX = wire.SPAN_INDEX["scope_version"]
