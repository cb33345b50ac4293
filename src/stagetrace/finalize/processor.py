"""The span processor: notices local roots starting and ending, holds each finished root back until the
finalizer has put the verdict on it, and passes every other span straight through.

It wraps the exporting processor (the logfire pattern) because the SDK freezes a span's attributes before
any processor sees it: the verdict can only reach the exported root through a rebuilt span.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from stagetrace._safety import report_internal_error


def is_local_root(span: ReadableSpan) -> bool:
    parent = span.parent
    return parent is None or parent.is_remote


class StagetraceSpanProcessor(SpanProcessor):
    def __init__(self, *, registry: Any, finalizer: Any, downstream: SpanProcessor, shutdown_timeout_s: float) -> None:
        self.registry = registry
        self.finalizer = finalizer
        self.downstream = downstream
        self.shutdown_timeout_s = shutdown_timeout_s

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        try:
            if is_local_root(span):
                ctx = span.context
                self.registry.open(ctx.trace_id, ctx.span_id, span.start_time, ctx.trace_flags, ctx.trace_state)
        except Exception:
            report_internal_error("span processor on_start")
        try:
            self.downstream.on_start(span, parent_context)
        except Exception:
            report_internal_error("export processor on_start")

    def on_end(self, span: ReadableSpan) -> None:
        try:
            if is_local_root(span):
                ctx = span.context
                trace = self.registry.close(ctx.trace_id, ctx.span_id)
                if trace is not None and self.finalizer.submit_trace(trace, span):
                    return
        except Exception:
            report_internal_error("span processor on_end")
        try:
            self.downstream.on_end(span)
        except Exception:
            report_internal_error("export processor on_end")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            ok = self.finalizer.flush(timeout_millis / 1000)
            return self.downstream.force_flush(timeout_millis) and ok
        except Exception:
            report_internal_error("force_flush")
            return False

    def shutdown(self) -> None:
        try:
            self.finalizer.shutdown(self.shutdown_timeout_s)
        except Exception:
            report_internal_error("finalizer shutdown")
        try:
            self.downstream.shutdown()
        except Exception:
            report_internal_error("export processor shutdown")
