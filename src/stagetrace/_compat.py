"""Every read of another library's private attributes, in one place, each checked by
``tests/test_compat.py`` so that an OpenTelemetry or Python release that moves them fails loudly there
instead of silently switching a feature off."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace import SpanProcessor


def span_processors_under(processor: SpanProcessor) -> list[SpanProcessor]:
    """The processors a multi-span processor fans out to (``_span_processors``), else the processor."""
    children = getattr(processor, "_span_processors", None)
    if isinstance(children, tuple):
        out: list[SpanProcessor] = []
        for child in children:
            out.extend(span_processors_under(child))
        return out
    return [processor]


def batch_queue_full(processor: SpanProcessor) -> bool:
    """Is any BatchSpanProcessor under ``processor`` at its queue limit? A collector that is down or slow
    fills it, and the SDK then drops spans (with only a log line): stagetrace counts them."""
    for p in span_processors_under(processor):
        batch = getattr(p, "_batch_processor", None)
        queue: Any = getattr(batch, "_queue", None)
        limit = getattr(batch, "_max_queue_size", None)
        if queue is not None and limit is not None and len(queue) >= limit:
            return True
    return False
