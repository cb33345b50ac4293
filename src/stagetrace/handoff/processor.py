"""The span processor: notices local roots starting and ending, collects the other spans of each trace it
holds, and hands the finished trace to the helper thread. It exports nothing itself: every span of a held
trace reaches the exporter with the trace, so that the keep decision, made after the verdict, covers them
all. Spans of traces it does not hold go to the exporter on their own.

Processors that live in the application (an attached user's chain, exporter objects passed to
``configure``) still see every span start, so that processors which enrich spans at start keep working.
"""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from stagetrace._compat import running_loop_or_none
from stagetrace._safety import report_internal_error
from stagetrace.capture.arrival import take_arrival


def is_local_root(span: ReadableSpan) -> bool:
    parent = span.parent
    return parent is None or parent.is_remote


class StagetraceSpanProcessor(SpanProcessor):
    def __init__(self, *, registry: Any, shipper: Any, local: SpanProcessor | None, shutdown_timeout_s: float) -> None:
        self.registry = registry
        self.shipper = shipper
        self.local = local
        self.shutdown_timeout_s = shutdown_timeout_s
        self._lookup = registry.lookup_function()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        try:
            if is_local_root(span):
                ctx = span.context
                # A root opened on an event loop's thread: its request waits whenever that loop is held, and
                # may have waited before this span began (its task's arrival, capture/arrival.py).
                on_loop = running_loop_or_none() is not None
                self.registry.open(
                    ctx.trace_id,
                    ctx.span_id,
                    span.start_time,
                    ctx.trace_flags,
                    ctx.trace_state,
                    threading.get_ident() if on_loop else 0,
                    take_arrival() if on_loop else None,
                )
        except Exception:
            report_internal_error("span processor on_start")
        if self.local is not None:
            try:
                self.local.on_start(span, parent_context)
            except Exception:
                report_internal_error("export processor on_start")

    def on_end(self, span: ReadableSpan) -> None:
        try:
            ctx = span.context
            if is_local_root(span):
                trace = self.registry.close(ctx.trace_id, ctx.span_id)
                if trace is not None:
                    trace.root_ended = True
                    self.shipper.submit_trace(trace, span)
                    return
            else:
                trace = self._lookup(ctx.trace_id)
                if trace is not None:
                    with trace.lock:
                        if not trace.closed and len(trace.others) < trace.max_others:
                            trace.others.append(span)
                            return
            self.shipper.submit_lone_span(span)
        except Exception:
            report_internal_error("span processor on_end")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return self.shipper.flush(timeout_millis / 1000)
        except Exception:
            report_internal_error("force_flush")
            return False

    def shutdown(self) -> None:
        try:
            self.shipper.shutdown(self.shutdown_timeout_s)
        except Exception:
            report_internal_error("shipper shutdown")
        if self.local is not None:
            try:
                self.local.shutdown()
            except Exception:
                report_internal_error("export processor shutdown")
