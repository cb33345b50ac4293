"""OTLP JSON lines written by hand, as stagetrace and the Collector's file exporter write them: shared by
the report's tests (files and ClickHouse)."""

from __future__ import annotations

import json

from stagetrace import conventions as c

MS = 1_000_000


def kv(key, value):
    if isinstance(value, bool):
        v = {"boolValue": value}
    elif isinstance(value, int):
        v = {"intValue": str(value)}
    elif isinstance(value, float):
        v = {"doubleValue": value}
    elif isinstance(value, (list, tuple)):
        v = {"arrayValue": {"values": [kv("", x)["value"] for x in value]}}
    else:
        v = {"stringValue": value}
    return {"key": key, "value": v}


def span(trace, sid, parent, name, start_ms, end_ms, attrs=None, kind=1):
    return {
        "traceId": trace,
        "spanId": sid,
        "parentSpanId": parent,
        "name": name,
        "kind": kind,
        "startTimeUnixNano": str(1_700_000_000_000 * MS + int(start_ms * MS)),
        "endTimeUnixNano": str(1_700_000_000_000 * MS + int(end_ms * MS)),
        "attributes": [kv(k, v) for k, v in (attrs or {}).items()],
    }


def line(service, spans):
    return json.dumps(
        {
            "resourceSpans": [
                {
                    "resource": {"attributes": [kv("service.name", service)]},
                    "scopeSpans": [{"scope": {"name": "x"}, "spans": spans}],
                }
            ]
        }
    )


def stage(trace, sid, parent, name, start, end, kind="cpu"):
    return span(trace, sid, parent, name, start, end, {c.STAGE: name, c.STAGE_KIND: kind})


T1 = "0af7651916cd43dd8448eb211c80319c"
