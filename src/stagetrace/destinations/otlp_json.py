"""OTLP JSON, the format of the Collector's file exporter: one ``ExportTraceServiceRequest`` (or
``ExportMetricsServiceRequest``) per line, lowerCamelCase keys, hex trace and span ids, enums as integers."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.metrics.export import MetricsData
from opentelemetry.sdk.trace import ReadableSpan

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _b64_to_hex(value: str) -> str:
    return base64.b64decode(value).hex()


def _fix_ids(obj: dict[str, Any]) -> None:
    for key in _ID_KEYS:
        if key in obj:
            obj[key] = _b64_to_hex(obj[key])
    for link in obj.get("links", ()):
        _fix_ids(link)


def spans_to_otlp_json(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    doc = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    for rs in doc.get("resourceSpans", ()):
        for ss in rs.get("scopeSpans", ()):
            for span in ss.get("spans", ()):
                _fix_ids(span)
    return doc


def spans_to_otlp_json_line(spans: Sequence[ReadableSpan]) -> str:
    return json.dumps(spans_to_otlp_json(spans), separators=(",", ":")) + "\n"


def metrics_to_otlp_json_line(data: MetricsData) -> str:
    """Exemplars carry trace and span ids too: hex, as on spans."""
    doc = MessageToDict(encode_metrics(data), use_integers_for_enums=True)
    for rm in doc.get("resourceMetrics", ()):
        for sm in rm.get("scopeMetrics", ()):
            for metric in sm.get("metrics", ()):
                for kind in ("sum", "gauge", "histogram", "exponentialHistogram"):
                    for point in metric.get(kind, {}).get("dataPoints", ()):
                        for exemplar in point.get("exemplars", ()):
                            _fix_ids(exemplar)
    return json.dumps(doc, separators=(",", ":")) + "\n"
