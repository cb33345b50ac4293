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


def test_the_current_span_lives_under_the_key_compat_names():
    from opentelemetry.trace import NonRecordingSpan, SpanContext, get_current_span, set_span_in_context

    from stagetrace._compat import SPAN_KEY

    span = NonRecordingSpan(SpanContext(1, 2, False))
    ctx = set_span_in_context(span)
    assert ctx.get(SPAN_KEY) is span
    assert get_current_span(ctx) is span


def test_the_default_runtime_context_is_a_contextvar_compat_can_use():
    from opentelemetry import context as otel_context

    from stagetrace._compat import runtime_context_var

    var = runtime_context_var()
    assert var is not None, "OpenTelemetry's default runtime context changed: the hot path fell back to attach()"
    token = otel_context.attach(otel_context.set_value("compat-probe", 7))
    try:
        assert var.get().get("compat-probe") == 7  # the var holds what attach() set
    finally:
        otel_context.detach(token)


def test_span_context_unpacks_as_a_tuple():
    from stagetrace._compat import span_context_is_a_plain_tuple

    assert span_context_is_a_plain_tuple(), "SpanContext's tuple layout changed: the hot path reads properties"


def test_running_loop_or_none():
    import asyncio

    from stagetrace._compat import running_loop_or_none

    assert running_loop_or_none() is None

    async def inside() -> object:
        return running_loop_or_none()

    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(inside()) is loop
    finally:
        loop.close()


def test_executor_saturation_reads_the_pools_bookkeeping():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from stagetrace._compat import executor_max_workers, executor_saturated, executor_thread_name_prefix

    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="compat")
    gate = threading.Event()
    try:
        assert executor_thread_name_prefix(pool) == "compat"
        assert executor_max_workers(pool) == 2
        assert executor_saturated(pool) is False
        pool.submit(gate.wait)
        assert executor_saturated(pool) is False  # a second worker is still to start
        pool.submit(gate.wait)
        pool.submit(gate.wait)  # queued behind the two busy workers
        assert executor_saturated(pool) is True
    finally:
        gate.set()
        pool.shutdown()


def test_processor_chain_of_an_sdk_tracer_provider():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from stagetrace._compat import ProcessorChain, processors_of, set_processors

    provider = TracerProvider()
    first = SimpleSpanProcessor(InMemorySpanExporter())
    provider.add_span_processor(first)
    chain = ProcessorChain(provider)
    with chain.locked():
        assert chain.processors == (first,)
        chain.processors = ()
    assert provider._active_span_processor._span_processors == ()
    multi = SynchronousMultiSpanProcessor()
    set_processors(multi, (first,))
    assert processors_of(multi) == (first,)
    import pytest

    with pytest.raises(TypeError, match="standard processor chain"):
        ProcessorChain(object())  # type: ignore[arg-type]


def test_meter_provider_placeholder_and_sampler_from_env(monkeypatch):
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from stagetrace._compat import meter_provider_is_unset, sampler_from_env

    assert isinstance(meter_provider_is_unset(), bool)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    sampler = sampler_from_env()
    assert isinstance(sampler, ParentBased) and isinstance(sampler._root, TraceIdRatioBased)
    assert sampler._root.rate == 0.25
