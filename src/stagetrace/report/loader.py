"""Stream OTLP JSON lines (stagetrace's own files and the Collector's file exporter output) into traces.

Memory does not grow with the input: spans are joined per trace inside a bounded window of open traces;
a trace is complete when no span of it arrived for ``idle_lines`` lines, or when the window is full and it
is the oldest. Spans of one trace from several services, files and lines are joined as long as they arrive
within that window (files are read one after the other, in the order given). A malformed line is reported
as ``FILE:LINE: reason`` and skipped; the rest is still used.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO


@dataclass(slots=True)
class Span:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    start_ns: int
    end_ns: int
    kind: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    service: str = ""
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)


class MalformedLine(ValueError):
    pass


def _hex_id(value: Any, length: int) -> str:
    """OTLP JSON ids are hex; protobuf's generic JSON mapping writes base64. Accept both."""
    if not isinstance(value, str):
        raise MalformedLine(f"id is not a string: {value!r}")
    if len(value) == length and all(ch in "0123456789abcdefABCDEF" for ch in value):
        return value.lower()
    if not value:
        return ""
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedLine(f"bad id {value[:40]!r}") from None
    if len(raw) * 2 != length:
        raise MalformedLine(f"bad id length {value[:40]!r}")
    return raw.hex()


SPAN_KINDS = ("UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")  # OTLP's SpanKind, by number


def _span_kind(value: Any) -> int:
    """OTLP JSON writes the kind as its number; protobuf's generic JSON mapping by name (SPAN_KIND_SERVER)."""
    if isinstance(value, str) and value.startswith("SPAN_KIND_"):
        name = value.removeprefix("SPAN_KIND_")
        if name in SPAN_KINDS:
            return SPAN_KINDS.index(name)
        raise MalformedLine(f"unknown span kind {value[:40]!r}")
    return int(value or 0)


def any_value(v: Any) -> Any:
    """An OTLP AnyValue ({"stringValue": ...}, {"intValue": "12"}, {"arrayValue": {...}}) as Python."""
    if not isinstance(v, dict) or not v:
        return None
    key, val = next(iter(v.items()))
    if key == "stringValue":
        return str(val)
    if key == "intValue":
        return int(val)
    if key == "doubleValue":
        return float(val)
    if key == "boolValue":
        return bool(val)
    if key == "arrayValue":
        return tuple(any_value(x) for x in (val or {}).get("values", []))
    if key == "kvlistValue":
        return {kv.get("key"): any_value(kv.get("value")) for kv in (val or {}).get("values", [])}
    if key == "bytesValue":
        return str(val)
    return None


def attributes_of(items: Any) -> dict[str, Any]:
    """An OTLP attribute list (``[{"key": ..., "value": {...}}]``) as a dict of Python values."""
    if not items:
        return {}
    if not isinstance(items, list):
        raise MalformedLine("attributes is not a list")
    return {kv["key"]: any_value(kv.get("value")) for kv in items if isinstance(kv, dict) and "key" in kv}


def parse_line(line: str) -> dict[str, Any]:
    """One OTLP JSON export: a trace export (``resourceSpans``) or a metrics export (``resourceMetrics``)."""
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as e:
        raise MalformedLine(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(doc, dict) or ("resourceSpans" not in doc and "resourceMetrics" not in doc):
        raise MalformedLine("not an OTLP trace or metrics export (no resourceSpans or resourceMetrics)")
    return doc


def spans_from_line(line: str) -> list[Span]:
    doc = parse_line(line)
    if "resourceSpans" not in doc:
        raise MalformedLine("not an OTLP trace export (no resourceSpans)")
    return spans_of(doc)


def spans_of(doc: dict[str, Any]) -> list[Span]:
    out: list[Span] = []
    try:
        for rs in doc["resourceSpans"] or ():
            resource = attributes_of((rs.get("resource") or {}).get("attributes"))
            service = str(resource.get("service.name", ""))
            for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or ():
                for sp in ss.get("spans") or ():
                    out.append(
                        Span(
                            trace_id=_hex_id(sp["traceId"], 32),
                            span_id=_hex_id(sp["spanId"], 16),
                            parent_span_id=_hex_id(sp.get("parentSpanId", ""), 16),
                            name=str(sp.get("name", "")),
                            start_ns=int(sp["startTimeUnixNano"]),
                            end_ns=int(sp["endTimeUnixNano"]),
                            kind=_span_kind(sp.get("kind", 0)),
                            attributes=attributes_of(sp.get("attributes")),
                            events=[
                                (str(e.get("name", "")), attributes_of(e.get("attributes")))
                                for e in sp.get("events") or ()
                            ],
                            service=service,
                            links=[
                                (_hex_id(lk["traceId"], 32), _hex_id(lk["spanId"], 16)) for lk in sp.get("links") or ()
                            ],
                        )
                    )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, MalformedLine):
            raise
        raise MalformedLine(f"malformed span ({type(e).__name__}: {e})") from None
    return out


def expand_paths(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".jsonl", ".json", ".1")))
        else:
            files.append(p)
    return files


class TraceJoiner:
    """Joins spans into traces within a bounded window; ``on_trace(spans)`` gets each completed trace."""

    def __init__(self, on_trace: Callable[[list[Span]], None], max_open: int = 20_000, idle_lines: int = 50_000):
        self.on_trace = on_trace
        self.max_open = max_open
        self.idle_lines = idle_lines
        self._open: OrderedDict[str, tuple[int, list[Span]]] = OrderedDict()
        self._line = 0
        self.spans = 0

    def add(self, spans: list[Span]) -> None:
        self._line += 1
        for span in spans:
            self.spans += 1
            entry = self._open.pop(span.trace_id, None)
            bucket = entry[1] if entry else []
            bucket.append(span)
            self._open[span.trace_id] = (self._line, bucket)  # most recently touched last
        self._expire()

    def _expire(self) -> None:
        while self._open:
            trace_id, (last, bucket) = next(iter(self._open.items()))
            if len(self._open) > self.max_open or self._line - last > self.idle_lines:
                del self._open[trace_id]
                self.on_trace(bucket)
            else:
                break

    def finish(self) -> None:
        while self._open:
            _, (_, bucket) = self._open.popitem(last=False)
            self.on_trace(bucket)


def read_traces(
    paths: Iterable[str | os.PathLike[str]],
    on_trace: Callable[[list[Span]], None],
    errors: TextIO | None = None,
    on_metrics: Callable[[dict[str, Any]], None] | None = None,
    **window: Any,
) -> dict[str, int]:
    """Stream every file; returns counts (files, lines, spans, metric_lines, malformed). Metrics exports
    (the exporter's metrics file beside its traces) go to ``on_metrics``, whose ValueError, KeyError or
    TypeError makes the line malformed."""
    errors = errors or sys.stderr
    joiner = TraceJoiner(on_trace, **window)
    counts = {"files": 0, "lines": 0, "spans": 0, "metric_lines": 0, "malformed": 0}
    for path in expand_paths(paths):
        counts["files"] += 1
        try:
            for lineno, line in _lines(path):
                if not line.strip():
                    continue
                counts["lines"] += 1
                try:
                    doc = parse_line(line)
                    if "resourceSpans" in doc:
                        joiner.add(spans_of(doc))
                        continue
                    counts["metric_lines"] += 1
                    if on_metrics is not None:
                        try:
                            on_metrics(doc)
                        except (ValueError, KeyError, TypeError, AttributeError) as e:
                            raise MalformedLine(f"malformed metrics ({type(e).__name__}: {e})") from None
                except MalformedLine as e:
                    counts["malformed"] += 1
                    print(f"{path}:{lineno}: {e}", file=errors)
        except OSError as e:
            print(f"{path}: cannot read: {e.strerror or e}", file=errors)
            counts["malformed"] += 1
    joiner.finish()
    counts["spans"] = joiner.spans
    return counts


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        yield from enumerate(fh, 1)
