"""The private attributes of other libraries that stagetrace reads (``stagetrace/_compat.py``): each
assumption checked here, so that a release that moves one fails this test loudly instead of silently
switching a feature off."""

from __future__ import annotations

import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace import SynchronousMultiSpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stagetrace._compat import batch_queue_full, gil_wait_stretch_bound_s, span_processors_under


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


def test_what_a_takeover_reads_of_export_processors_and_metric_readers(caplog):
    """The exporter behind each SDK export processor; a meter provider's readers, a periodic reader's
    exporter; a reader detached exports nothing more and is not shut down twice (no warning at exit)."""
    import logging

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        InMemoryMetricReader,
        MetricExporter,
        MetricExportResult,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from stagetrace._compat import detach_metric_reader, meter_provider_readers, metric_exporter_of, span_exporter_of

    exporter = InMemorySpanExporter()
    batch = BatchSpanProcessor(exporter)
    assert span_exporter_of(batch) is exporter and span_exporter_of(SimpleSpanProcessor(exporter)) is exporter
    assert span_exporter_of(SynchronousMultiSpanProcessor()) is None
    batch.shutdown()

    class Counting(MetricExporter):
        exported = 0
        shut = 0

        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            Counting.exported += 1
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis=10_000):
            return True

        def shutdown(self, timeout_millis=30_000, **kwargs):
            Counting.shut += 1

    periodic = PeriodicExportingMetricReader(Counting(), export_interval_millis=3_600_000)
    memory = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[periodic, memory], shutdown_on_exit=False)
    provider.get_meter("m").create_counter("c").add(1)
    assert meter_provider_readers(provider) == (periodic, memory)
    assert isinstance(metric_exporter_of(periodic), Counting) and metric_exporter_of(memory) is None
    with caplog.at_level(logging.WARNING):
        assert detach_metric_reader(provider, periodic)
        assert meter_provider_readers(provider) == (memory,)
        provider.get_meter("m").create_counter("c").add(1)  # reaches the reader left only
        provider.shutdown()
    assert (Counting.exported, Counting.shut) == (0, 1)  # nothing sent as it shut down, and shut down once
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert not detach_metric_reader(provider, periodic)  # not there any more: nothing done


def test_meter_provider_placeholder_and_sampler_from_env(monkeypatch):
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from stagetrace._compat import meter_provider_is_unset, sampler_from_env

    assert isinstance(meter_provider_is_unset(), bool)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    sampler = sampler_from_env()
    assert isinstance(sampler, ParentBased) and isinstance(sampler._root, TraceIdRatioBased)
    assert sampler._root.rate == 0.25


# --- CPython's GIL: a waiting thread is off the CPU one switch interval at a time at most ----------------

needs_schedstat = pytest.mark.skipif(
    not os.path.exists("/proc/thread-self/schedstat"), reason="needs Linux schedstat (slice counts)"
)


def _measured(fn):
    """Run ``fn`` as a stage on this thread and resolve its CPU figures as the exporter does."""
    from stagetrace.capture.cpu import CpuSignals
    from stagetrace.exporter.signals import resolve_cpu

    cpu = CpuSignals()
    start_ns, before = time.perf_counter_ns(), cpu.read()
    fn()
    after, end_ns = cpu.read(), time.perf_counter_ns()
    stage = SimpleNamespace(
        cpu_start=before, cpu_end=after, start_ns=start_ns, end_ns=end_ns, wall_ms=(end_ns - start_ns) / 1e6,
        compressed=None, cpu_ms=None, runqueue_ms=None, blocked_ms=None, not_gil_ms=None,
    )  # fmt: skip
    bound_s = gil_wait_stretch_bound_s()
    resolve_cpu(stage, None if bound_s is None else bound_s * 1e3)
    return stage


def _spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


@needs_schedstat
def test_the_gil_bound_is_the_switch_interval_on_this_interpreter():
    assert gil_wait_stretch_bound_s() == sys.getswitchinterval()


@needs_schedstat
def test_waits_for_a_contended_gil_are_never_proven_to_be_something_else():
    """A pure-Python stage beside a thread spinning in Python waits for the GIL for tens of ms, in stretches
    of at most one switch interval: if CPython ever waited for the GIL untimed, this would read as a lock."""
    stop = threading.Event()

    def hog() -> None:
        while not stop.is_set():
            pass

    t = threading.Thread(target=hog, daemon=True)
    t.start()
    try:
        stages = [_measured(lambda: _spin(60)) for _ in range(3)]
    finally:
        stop.set()
        t.join()
    assert max(s.blocked_ms for s in stages) > 10.0, [vars(s) for s in stages]  # it did wait for the GIL
    assert all(s.not_gil_ms < 5.0 for s in stages), [vars(s) for s in stages]  # and none of it was proven not


@needs_schedstat
def test_a_wait_for_a_lock_held_by_a_sleeping_thread_is_proven_not_the_gil():
    lock = threading.Lock()
    held = threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            time.sleep(0.05)

    t = threading.Thread(target=holder)
    t.start()
    held.wait()
    stage = _measured(lambda: lock.acquire() and lock.release())  # type: ignore[func-returns-value]
    t.join()
    assert stage.blocked_ms > 30.0 and stage.not_gil_ms > 0.5 * stage.blocked_ms, vars(stage)


def test_what_light_spans_read_of_the_sdk_tracer(monkeypatch):
    """``capture/tracer.py`` reads the SDK tracer's limits, scope, configurator switch and self-metrics,
    asks ParentBased for its delegates and changes the tracer's class in place."""
    from opentelemetry.sdk.trace import SpanLimits, Tracer, TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased

    from stagetrace._compat import (
        become_capture_tracer,
        clean_attribute_value_as_sdk,
        follows_local_parent,
        tracer_counts_its_spans,
        tracer_enabled_check,
        tracer_scope,
        tracer_span_limits,
    )

    limits = SpanLimits(max_span_attributes=3)
    tracer = TracerProvider(span_limits=limits, shutdown_on_exit=False).get_tracer("lib", "1.0")
    assert tracer_span_limits(tracer) is limits
    assert (tracer_scope(tracer).name, tracer_scope(tracer).version) == ("lib", "1.0")
    assert tracer_enabled_check(tracer)() is True
    assert tracer_counts_its_spans(tracer) is False
    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    counting = TracerProvider(shutdown_on_exit=False).get_tracer("lib")
    assert tracer_counts_its_spans(counting) is True

    assert follows_local_parent(ParentBased(ALWAYS_ON)) and follows_local_parent(ParentBased(ALWAYS_OFF))
    assert not follows_local_parent(ParentBased(ALWAYS_ON, local_parent_sampled=TraceIdRatioBased(0.5)))
    assert not follows_local_parent(ParentBased(ALWAYS_ON, local_parent_not_sampled=ALWAYS_ON))
    assert not follows_local_parent(ALWAYS_ON)

    assert clean_attribute_value_as_sdk("abcdef", 3) == "abc"
    assert clean_attribute_value_as_sdk(["ab", 1], None) == ("ab", 1)
    assert clean_attribute_value_as_sdk({"k": ["x"]}, None) == {"k": ("x",)}

    class Sub(Tracer):
        pass

    assert become_capture_tracer(tracer, Sub) and type(tracer) is Sub
    assert not become_capture_tracer(tracer, Sub)  # already changed: not exactly the SDK's class


def test_what_the_aggregation_reads_of_a_metric_reader():
    """``exporter/aggregation.py`` reads a reader's temporality preference and wraps its collect callback."""
    from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
    from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader

    from stagetrace._compat import reader_prefers_delta, set_reader_collect

    assert reader_prefers_delta(InMemoryMetricReader()) == frozenset()
    delta = InMemoryMetricReader(preferred_temporality={Histogram: AggregationTemporality.DELTA})
    assert reader_prefers_delta(delta) == {"histogram"}
    both = InMemoryMetricReader(
        preferred_temporality={Histogram: AggregationTemporality.DELTA, Counter: AggregationTemporality.DELTA}
    )
    assert reader_prefers_delta(both) == {"histogram", "counter"}

    reader = InMemoryMetricReader()
    with pytest.raises(TypeError, match="registered"):
        set_reader_collect(reader, lambda data: data)  # not yet registered with a provider
    MeterProvider(metric_readers=[reader], shutdown_on_exit=False).get_meter("m").create_counter("c").add(1)
    seen = []
    set_reader_collect(reader, lambda data: seen.append(data) or data)
    data = reader.get_metrics_data()
    assert seen and seen[0] is data and data.resource_metrics[0].scope_metrics[0].metrics[0].name == "c"


def test_what_the_arrival_reads_of_asgi_servers_and_sockets():
    """``capture/arrival.py`` recognises uvicorn's and hypercorn's request coroutines and reads a socket's
    ``TCP_INFO``; a release that moves either fails here (and the real-server tests in test_arrival.py)."""
    import inspect
    import socket

    import hypercorn.asyncio.run
    import uvicorn.protocols.http.h11_impl as h11_impl

    from stagetrace._compat import _request_coroutine_codes, socket_received_ms_ago

    places = set(_request_coroutine_codes().values())
    assert places == {"cycle", "spawner"}
    assert "transport" in inspect.signature(h11_impl.RequestResponseCycle.__init__).parameters
    assert "writer" in inspect.getsource(hypercorn.asyncio.run).split("async def _server_callback", 1)[1][:200]

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    try:
        client.sendall(b"x")
        time.sleep(0.05)
        assert 40 <= socket_received_ms_ago(conn) <= 1000
        assert socket_received_ms_ago(object()) == -1
    finally:
        for s in (client, conn, server):
            s.close()


def test_what_the_otlp_bytes_path_reads_of_the_sdks_http_exporter(otlp_receiver, caplog):
    """``otlp_http_sender`` sends encoded bytes through the SDK's own HTTP client, after its size limit; it
    declines every other exporter, so those get SDK spans as before."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans

    from stagetrace._compat import otlp_http_sender
    from stagetrace.exporter.otlp_encoding import TraceRequestEncoder

    endpoint = f"{otlp_receiver.http_endpoint}/v1/traces"
    exporter = HttpSpans(endpoint=endpoint)
    send = otlp_http_sender(exporter)
    assert send is not None, "the SDK's OTLP/HTTP exporter no longer has _client.export / _max_request_size"
    span = (
        "sent", 0xA1, 0xB2, 0, False, 0, 1_000, 2_000, {"k": "v"}, (), (), 0, "", "test", "", 1, "", 0, 0, 0,
    )  # fmt: skip
    assert send(TraceRequestEncoder({"service.name": "compat"}).encode([span])) is True
    assert otlp_receiver.sink.wait_for(lambda s: [x.name for x in s.spans] == ["sent"])
    (received,) = otlp_receiver.sink.spans
    assert received.attributes == {"k": "v"} and received.resource == {"service.name": "compat"}

    small = HttpSpans(endpoint=endpoint, max_request_size=10)
    assert otlp_http_sender(small)(b"x" * 11) is False  # type: ignore[misc]
    assert "exceeds max_request_size" in caplog.text
    exporter.shutdown()
    assert send(b"") is False  # a shut-down exporter sends nothing

    class OwnEncoding(HttpSpans):
        pass

    assert otlp_http_sender(OwnEncoding(endpoint=endpoint)) is None
    assert otlp_http_sender(GrpcSpans(endpoint="http://127.0.0.1:1", insecure=True)) is None
    assert otlp_http_sender(InMemorySpanExporter()) is None


def test_the_process_pools_bookkeeping_is_where_compat_reads_it():
    """``process_pool_facts`` and ``mp_pool_facts`` (an offload's size, calls held, start method), the pools'
    worker entry points and map's task generation, which ``integrations/processes.py`` wraps."""
    import importlib
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from stagetrace._compat import MP_POOL_TASKS, MP_POOL_WORKER, PROCESS_POOL_WORKER, mp_pool_facts, process_pool_facts

    for module, name in (PROCESS_POOL_WORKER, MP_POOL_WORKER):
        assert callable(getattr(importlib.import_module(module), name)), (module, name)
    assert callable(getattr(multiprocessing.pool.Pool, MP_POOL_TASKS))
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=2, mp_context=ctx) as pool:
        assert process_pool_facts(pool) == (2, 0, "fork")
    with ctx.Pool(2) as mp_pool:
        assert mp_pool_facts(mp_pool) == (2, "fork")


def test_a_multiprocessing_jobs_outcomes_are_where_compat_watches_them():
    """``watch_mp_job_outcomes``: every task's outcome of one job, the failures included, before the pool
    records it, and the job's result unchanged."""
    import multiprocessing
    import pickle

    from stagetrace._compat import watch_mp_job_outcomes

    seen = []
    with multiprocessing.get_context("fork").Pool(1) as pool:
        result = pool.map_async(abs, [-1, -2])
        assert watch_mp_job_outcomes(pool, result._job, lambda index, value: seen.append((index, value[0])))
        assert result.get(timeout=30) == [1, 2]
        failing = pool.map_async(abs, [lambda: 0])  # cannot be pickled: its task fails on the pool's task thread
        watch_mp_job_outcomes(pool, failing._job, lambda index, value: seen.append((index, value[0])))
        with pytest.raises((pickle.PicklingError, AttributeError)):
            failing.get(timeout=30)
    assert watch_mp_job_outcomes(object(), 0, lambda index, value: None) is False
