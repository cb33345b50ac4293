"""Where the exporter's results go: span processors (the SDK's batch processor and its OTLP or file
exporter), metrics, ``on_verdict`` callbacks.

``LocalOutputs`` serves whichever process the consumers live in: the exporter process for what
``OTEL_*`` configures, and the application for what the user passed as objects (an in-memory exporter in
a test, a Prometheus reader, ``on_verdict``), where returned results are delivered.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor

from stagetrace._compat import batch_queue_full
from stagetrace._safety import report_internal_error
from stagetrace.analysis import Verdict
from stagetrace.common import wire
from stagetrace.exporter.metrics import Exemplar, MetricsSink


class NoMetrics:
    """For a process with no metric reader: every call does nothing."""

    def record_stage(self, name: str, kind: str, ms: float, route: str | None) -> None:
        return None

    def record_trace(self, verdict: Verdict, exemplar: Exemplar | None) -> None:
        return None

    def record_batch(self, name: str, size: int, fill: float | None) -> None:
        return None

    def dropped(self, reason: str, count: int = 1) -> None:
        return None

    def gpu_utilization(self, value: float, hw_id: str) -> None:
        return None


class SpanSink(Protocol):
    """Where kept spans (wire tuples) go in this process: an SDK span processor (``SpanForwarder``) or the
    OTLP/HTTP bytes path (``otlp_sink.WireBatchSink``)."""

    def export(self, spans: Sequence[wire.WireSpan]) -> None: ...
    def flush(self, timeout_s: float) -> bool: ...


class _FanOut:
    def __init__(self, sinks: Sequence[SpanSink]) -> None:
        self.sinks = tuple(sinks)

    def export(self, spans: Sequence[wire.WireSpan]) -> None:
        for sink in self.sinks:
            sink.export(spans)

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all([sink.flush(max(0.0, deadline - time.monotonic())) for sink in self.sinks])


def fan_out(sinks: Sequence[SpanSink]) -> SpanSink | None:
    """One sink for several (None for none)."""
    if not sinks:
        return None
    return sinks[0] if len(sinks) == 1 else _FanOut(sinks)


class SpanForwarder:
    """Wire tuples in, SDK spans out to a span processor, with the export-queue drops counted."""

    def __init__(self, processor: SpanProcessor, resource: Resource, on_drop: Callable[[str, int], None]) -> None:
        self.processor = processor
        self.resource = resource
        self._on_drop = on_drop

    def export(self, spans: Sequence[wire.WireSpan]) -> None:
        processor, resource = self.processor, self.resource
        for packed in spans:
            try:
                if batch_queue_full(processor):
                    self._on_drop("export_queue_full", 1)  # the SDK drops it too, with a log line
                processor.on_end(wire.to_readable(packed, resource))
            except Exception:
                report_internal_error("export processor")

    def flush(self, timeout_s: float) -> bool:
        try:
            return bool(self.processor.force_flush(int(timeout_s * 1000)))
        except Exception:
            report_internal_error("export processor flush")
            return False


class LocalOutputs:
    def __init__(
        self,
        *,
        spans: SpanSink | None,
        metrics: MetricsSink,
        callbacks: Sequence[Callable[[Verdict], Any]] = (),
        flush_metrics: Callable[[float], bool] | None = None,
    ) -> None:
        self.spans = spans
        self.metrics = metrics
        self.callbacks = list(callbacks)
        self.wants_verdicts = bool(self.callbacks)
        self._flush_metrics = flush_metrics

    def export(self, spans: Sequence[wire.WireSpan]) -> None:
        if self.spans is not None:
            self.spans.export(spans)

    def verdict(self, verdict: Verdict) -> None:
        for callback in self.callbacks:
            try:
                callback(verdict)
            except Exception:
                report_internal_error(f"on_verdict callback {getattr(callback, '__qualname__', callback)!r}")

    def flush(self, timeout_s: float) -> bool:
        ok = self.spans.flush(timeout_s) if self.spans is not None else True
        if self._flush_metrics is not None:
            try:
                ok = bool(self._flush_metrics(timeout_s)) and ok
            except Exception:
                report_internal_error("metrics flush")
                ok = False
        return ok
