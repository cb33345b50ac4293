"""The private attributes of other libraries that stagetrace reads (``stagetrace/_compat.py``): each
assumption checked here, so that a release that moves one fails this test loudly instead of silently
switching a feature off."""

from __future__ import annotations

from opentelemetry.sdk.trace import SynchronousMultiSpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stagetrace._compat import batch_queue_full, span_processors_under


def test_batch_span_processor_queue_is_where_compat_reads_it():
    bsp = BatchSpanProcessor(InMemorySpanExporter(), max_queue_size=3, max_export_batch_size=1)
    try:
        batch = bsp._batch_processor
        assert hasattr(batch, "_queue") and batch._max_queue_size == 3
        assert not batch_queue_full(bsp)
        batch._queue.extend([object()] * 3)
        assert batch_queue_full(bsp)
        batch._queue.clear()
    finally:
        bsp.shutdown()


def test_multi_processors_are_looked_through():
    inner = BatchSpanProcessor(InMemorySpanExporter(), max_queue_size=1, max_export_batch_size=1)
    multi = SynchronousMultiSpanProcessor()
    multi.add_span_processor(inner)
    try:
        assert isinstance(multi._span_processors, tuple)
        assert span_processors_under(multi) == [inner]
        inner._batch_processor._queue.append(object())
        assert batch_queue_full(multi)  # counted through a multi-processor too (attach(), two exporters)
        inner._batch_processor._queue.clear()
    finally:
        multi.shutdown()
