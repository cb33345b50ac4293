"""The trace table of the OpenTelemetry Collector's ClickHouse exporter (contrib ``clickhouse`` exporter):
its DDL, the columns ``stagetrace report --clickhouse`` reads, and the conversions both ways between its rows
and stagetrace's spans. Pure: no connection here.

The exporter stores every attribute as a string in ``Map(LowCardinality(String), String)`` columns, written
by pdata's ``Value.AsString()``: strings as they are, ints in decimal, doubles in the shortest form that
reads back exactly (JavaScript's number format), booleans as ``true``/``false``, arrays and maps as JSON.
``attribute_value`` reads such a string back as the typed value stagetrace wrote, so a span read from
ClickHouse is the span the file report reads from OTLP JSON; ``exporter_rows`` goes the other way, for
loading stagetrace's OTLP JSON lines into the exporter's table (tests, benchmarks).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from decimal import Decimal
from typing import Any

from stagetrace import conventions as c
from stagetrace.report.loader import MalformedLine, Span, _hex_id, attributes_of

DEFAULT_DATABASE = "default"  # the exporter's `database` option
DEFAULT_TRACES_TABLE = "otel_traces"  # the exporter's `traces_table_name` option

# The exporter's CREATE TABLE for traces, from open-telemetry/opentelemetry-collector-contrib,
# exporter/clickhouseexporter/internal/sqltemplates/traces_table.sql (commit f92a5763, Apache-2.0), with its
# placeholders filled for a single node: engine MergeTree(), no TTL, no ON CLUSTER. The exporter also
# creates `<table>_trace_id_ts` and a materialized view for lookups by trace id, which the report does not
# read. The 2024 schema before it had no ScopeName/ScopeVersion columns and a signed Duration; the report
# reads both.
TRACES_TABLE_DDL = """\
CREATE TABLE IF NOT EXISTS {database}.{table} (
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    Duration UInt64 CODEC(ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    Events Nested (
        Timestamp DateTime64(9),
        Name LowCardinality(String),
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    Links Nested (
        TraceId String,
        SpanId String,
        TraceState String,
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_res_attr_key mapKeys(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_res_attr_value mapValues(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_value mapValues(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1
) ENGINE = MergeTree()
PARTITION BY toDate(Timestamp)
ORDER BY (ServiceName, SpanName, toDateTime(Timestamp))
SETTINGS index_granularity=8192, ttl_only_drop_parts = 1
"""

_STRING = ("String", "LowCardinality(String)")
_ATTRIBUTE_MAP = ("Map(LowCardinality(String), String)", "Map(String, String)")
_INTEGER = ("UInt64", "Int64")
# What the report reads: column -> the types it accepts (the exporter's, current and previous schema).
REQUIRED_COLUMNS: Mapping[str, tuple[str, ...]] = {
    "Timestamp": ("DateTime64(9)",),
    "TraceId": _STRING,
    "SpanId": _STRING,
    "ParentSpanId": _STRING,
    "SpanName": _STRING,
    "SpanKind": _STRING,
    "ServiceName": _STRING,
    "ResourceAttributes": _ATTRIBUTE_MAP,
    "SpanAttributes": _ATTRIBUTE_MAP,
    "Duration": _INTEGER,
    "Events.Name": tuple(f"Array({t})" for t in _STRING),
    "Events.Attributes": tuple(f"Array({t})" for t in _ATTRIBUTE_MAP),
    "Links.TraceId": ("Array(String)",),
    "Links.SpanId": ("Array(String)",),
}


def schema_problems(columns: Mapping[str, str]) -> list[str]:
    """What keeps the report from reading a table with these columns (name -> ClickHouse type); empty
    when it can. Names the exporter's JSON schema (``json: true``) for what it is."""
    if columns.get("SpanAttributes", "").startswith("JSON"):
        return [
            "the table uses the exporter's JSON schema (option `json: true`: attributes in JSON columns); "
            "the report reads the default schema (attributes in Map(LowCardinality(String), String) columns)"
        ]
    problems = []
    for name, accepted in REQUIRED_COLUMNS.items():
        found = columns.get(name)
        if found is None:
            problems.append(f"no column {name}")
        elif found not in accepted:
            problems.append(f"column {name} is {found}, expected {' or '.join(accepted)}")
    return problems


# --- ClickHouse rows -> stagetrace spans ------------------------------------------------------------------

# Span kinds as the exporter writes them (traceutil.SpanKindStr) -> OTLP's numbers.
SPAN_KINDS = {"Unspecified": 0, "Internal": 1, "Server": 2, "Client": 3, "Producer": 4, "Consumer": 5}
_KIND_NAMES = {v: k for k, v in SPAN_KINDS.items()}
_STATUS_NAMES = {0: "Unset", 1: "Ok", 2: "Error"}

# stagetrace attributes whose values are strings even when they look like numbers (a batch id is a hex span
# id, which may be all digits; a stage may be named "2").
STRING_KEYS = frozenset(
    {
        c.STAGE,
        c.STAGE_KIND,
        c.BATCH_ID,
        c.BOTTLENECK_STAGE,
        c.DIAGNOSIS_EVENT_CODE,
        c.DIAGNOSIS_EVENT_MESSAGE,
        c.DIAGNOSIS_EVENT_ADVICE,
        c.DIAGNOSIS_EVENT_STAGE,
    }
)


def attribute_value(key: str, text: str) -> Any:
    """An attribute as stagetrace wrote it, from the exporter's string: stagetrace's numbers, booleans and
    arrays come back typed; every other attribute stays the string the table holds (the report reads
    only stagetrace's attributes and ``http.route``)."""
    if key in STRING_KEYS or not key.startswith("stagetrace.") or not text:
        return text
    first = text[0]
    if not (first in "-[" or first.isdigit() or text in ("true", "false")):
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if isinstance(value, list):
        return tuple(value)
    return value if isinstance(value, (int, float, bool)) else text


def decoded_attributes(attributes: Mapping[str, str]) -> dict[str, Any]:
    return {k: attribute_value(k, v) for k, v in attributes.items()}


def span_from_row(
    trace_id: str,
    span_id: str,
    parent_span_id: str,
    name: str,
    kind: str,
    service: str,
    start_ns: int,
    duration_ns: int,
    attributes: Mapping[str, str],
    event_names: list[str],
    event_attributes: list[Mapping[str, str]],
    link_trace_ids: list[str],
    link_span_ids: list[str],
) -> Span:
    """One row of the exporter's table as the span the file report reads from OTLP JSON."""
    return Span(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent_span_id,
        name=name,
        start_ns=int(start_ns),
        end_ns=int(start_ns) + max(0, int(duration_ns)),
        kind=SPAN_KINDS.get(kind, 0),
        attributes=decoded_attributes(attributes),
        events=[(n, decoded_attributes(a)) for n, a in zip(event_names, event_attributes)],
        service=service,
        links=list(zip(link_trace_ids, link_span_ids)),
    )


# --- OTLP JSON -> the exporter's rows (what the Collector would insert) -----------------------------------


def go_float(value: float) -> str:
    """A double as pdata's ``AsString`` writes it (ES6 number formatting, as Go's encoding/json)."""
    if math.isnan(value) or math.isinf(value):
        return "json: unsupported value: " + ("NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf"))
    shortest = Decimal(repr(value))  # the shortest digits that read back exactly, as Go's -1 precision
    magnitude = abs(value)
    if magnitude != 0 and (magnitude < 1e-6 or magnitude >= 1e21):
        return f"{shortest:e}"  # 1e-7, 1.5e+21: Go's form once it drops the exponent's leading zero
    text = format(shortest, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _go_json(value: Any) -> str:
    """JSON as Go's encoding/json writes it for an attribute's array or map (HTML characters escaped)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return go_float(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_go_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_go_json(str(k))}:{_go_json(v)}" for k, v in sorted(value.items())) + "}"
    if value is None:
        return "null"
    text = json.dumps(str(value), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def exporter_string(value: Any) -> str:
    """An attribute value (as ``loader.any_value`` reads it from OTLP JSON) as the exporter stores it."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return _go_json(value)


def _timestamp(ns: int) -> str:
    """DateTime64(9) text that ClickHouse parses exactly, whatever the session's time zone."""
    return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


def _strings(attributes: Mapping[str, Any]) -> dict[str, str]:
    return {k: exporter_string(v) for k, v in attributes.items()}


def exporter_rows(document: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The rows the exporter inserts for one OTLP JSON export request (one line of stagetrace's file), as
    JSONEachRow objects for the table of ``TRACES_TABLE_DDL``. Raises ``MalformedLine`` like the loader."""
    try:
        for rs in document.get("resourceSpans") or ():
            resource = attributes_of((rs.get("resource") or {}).get("attributes"))
            service = resource.get("service.name")
            for ss in rs.get("scopeSpans") or ():
                scope = ss.get("scope") or {}
                for sp in ss.get("spans") or ():
                    start, end = int(sp["startTimeUnixNano"]), int(sp["endTimeUnixNano"])
                    events = sp.get("events") or ()
                    links = sp.get("links") or ()
                    status = sp.get("status") or {}
                    yield {
                        "Timestamp": _timestamp(start),
                        "TraceId": _hex_id(sp["traceId"], 32),
                        "SpanId": _hex_id(sp["spanId"], 16),
                        "ParentSpanId": _hex_id(sp.get("parentSpanId", ""), 16),
                        "TraceState": str(sp.get("traceState", "")),
                        "SpanName": str(sp.get("name", "")),
                        "SpanKind": _KIND_NAMES.get(int(sp.get("kind", 0) or 0), "Unspecified"),
                        "ServiceName": service if isinstance(service, str) else "",
                        "ResourceAttributes": _strings(resource),
                        "ScopeName": str(scope.get("name", "")),
                        "ScopeVersion": str(scope.get("version", "")),
                        "SpanAttributes": _strings(attributes_of(sp.get("attributes"))),
                        "Duration": max(0, end - start),
                        "StatusCode": _STATUS_NAMES.get(int(status.get("code", 0) or 0), "Unset"),
                        "StatusMessage": str(status.get("message", "")),
                        "Events.Timestamp": [_timestamp(int(e.get("timeUnixNano", start))) for e in events],
                        "Events.Name": [str(e.get("name", "")) for e in events],
                        "Events.Attributes": [_strings(attributes_of(e.get("attributes"))) for e in events],
                        "Links.TraceId": [_hex_id(lk["traceId"], 32) for lk in links],
                        "Links.SpanId": [_hex_id(lk["spanId"], 16) for lk in links],
                        "Links.TraceState": [str(lk.get("traceState", "")) for lk in links],
                        "Links.Attributes": [_strings(attributes_of(lk.get("attributes"))) for lk in links],
                    }
    except MalformedLine:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise MalformedLine(f"malformed span ({type(e).__name__}: {e})") from None
