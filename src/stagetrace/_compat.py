"""Every use of another library's private attributes, in one place, each assumption checked by
``tests/test_compat.py`` so that an OpenTelemetry or Python release that moves one fails loudly there instead
of silently switching a feature off. Where a public API does the job (at the cost it can afford), the
caller uses it instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any

from opentelemetry import attributes as _otel_attributes
from opentelemetry import context as otel_context
from opentelemetry import metrics as metrics_api
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags, propagation

_logger = logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter")  # the exporter's own logger

# --- the API's context: read and set on every stage entry and exit ---------------------------------------

# The context key under which the API keeps the current span. ``trace.get_current_span(ctx)`` reads it
# publicly, but a stage entry needs the raw value (and sets it in a copied context) without the extra calls.
SPAN_KEY: str = propagation._SPAN_KEY


def runtime_context_var() -> ContextVar[Any] | None:
    """The ContextVar behind OpenTelemetry's default runtime context (``_RUNTIME_CONTEXT._current_context``),
    when that is what is in use: reading and setting it directly skips two wrapper layers on every stage
    entry and exit (about a third of the hot path). None with any other runtime context (then the public
    ``attach``/``detach`` are used)."""
    runtime_context = getattr(otel_context, "_RUNTIME_CONTEXT", None)
    try:
        from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
    except ImportError:  # pragma: no cover - a layout change in a future API; test_compat fails first
        return None
    if type(runtime_context) is ContextVarsRuntimeContext:
        var = getattr(runtime_context, "_current_context", None)
        return var if isinstance(var, ContextVar) else None
    return None


def span_context_is_a_plain_tuple() -> bool:
    """SpanContext is a tuple (trace_id, span_id, is_remote, trace_flags, trace_state, is_valid); unpacking
    it is one C-level operation where five property reads are five Python calls. Checked, not assumed."""
    probe = SpanContext(0xA, 0xB, False, TraceFlags(1))
    return isinstance(probe, tuple) and len(probe) == 6 and tuple(probe[:3]) == (0xA, 0xB, False) and probe[5]


# ``asyncio.get_running_loop()`` raises when there is none; a stage entry asks on every sync stage, and
# the exception costs more than the whole entry. ``_get_running_loop`` (in ``asyncio.events.__all__``)
# returns None instead.
running_loop_or_none: Callable[[], asyncio.AbstractEventLoop | None] = asyncio.events._get_running_loop


# --- the SDK's span processor chain ------------------------------------------------------------------------


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


class ProcessorChain:
    """A TracerProvider's own processor chain (``_active_span_processor``: its ``_span_processors`` tuple and
    ``_lock``), for ``attach()``, which puts stagetrace in front of the processors already there. The SDK
    has no public way to insert a processor first or to remove one."""

    def __init__(self, provider: TracerProvider) -> None:
        multi = getattr(provider, "_active_span_processor", None)
        if not isinstance(getattr(multi, "_span_processors", None), tuple) or not hasattr(multi, "_lock"):
            raise TypeError("stagetrace.attach() needs an SDK TracerProvider with the standard processor chain")
        self._multi: Any = multi

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._multi._lock:
            yield

    @property
    def processors(self) -> tuple[SpanProcessor, ...]:
        return tuple(self._multi._span_processors)

    @processors.setter
    def processors(self, value: tuple[SpanProcessor, ...]) -> None:
        self._multi._span_processors = tuple(value)


def span_exporter_of(processor: SpanProcessor) -> Any:
    """The exporter an SDK export processor sends to: a ``BatchSpanProcessor``'s (``_batch_processor``'s
    ``_exporter``) or a ``SimpleSpanProcessor``'s (``span_exporter``); None for any other processor."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    if isinstance(processor, BatchSpanProcessor):
        return getattr(getattr(processor, "_batch_processor", None), "_exporter", None)
    if isinstance(processor, SimpleSpanProcessor):
        return getattr(processor, "span_exporter", None)
    return None


def otlp_http_sender(exporter: object) -> Callable[[bytes], bool] | None:
    """For the SDK's OTLP/HTTP span exporter: a function that sends an already encoded
    ``ExportTraceServiceRequest`` through the exporter's own HTTP client (``_client.export``: its endpoint,
    headers, compression, timeout, retries and TLS), after the exporter's own size limit
    (``_max_request_size``) and shut-down check (``_shutdown``). None for any other exporter (a subclass
    included: it may encode differently) or a version whose internals differ; the caller then gives the
    exporter SDK spans as before."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        return None
    if type(exporter) is not OTLPSpanExporter:
        return None
    client_export = getattr(getattr(exporter, "_client", None), "export", None)
    max_size = getattr(exporter, "_max_request_size", None)
    if not callable(client_export) or not isinstance(max_size, int) or not hasattr(exporter, "_shutdown"):
        return None
    http_exporter: Any = exporter

    def send(data: bytes) -> bool:
        if http_exporter._shutdown:
            return False
        if 0 < max_size < len(data):
            _logger.warning(
                "Dropping span batch: serialized size %d bytes exceeds max_request_size %d bytes.", len(data), max_size
            )
            return False
        return bool(client_export(data).success)

    return send


def set_processors(multi: Any, processors: tuple[SpanProcessor, ...]) -> None:
    """Give a SynchronousMultiSpanProcessor this exact tuple of processors (its ``_span_processors``)."""
    with multi._lock:
        multi._span_processors = tuple(processors)


def processors_of(multi: Any) -> tuple[SpanProcessor, ...]:
    """A SynchronousMultiSpanProcessor's own processors, one level (its ``_span_processors``)."""
    return tuple(multi._span_processors)


def sampler_from_env() -> Sampler:
    """The sampler ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` name, as the SDK's TracerProvider
    would build it (``sampling._get_from_env_or_default``; the SDK has no public function for it)."""
    from opentelemetry.sdk.trace import sampling

    return sampling._get_from_env_or_default()


# --- the SDK's tracer: light spans for the spans inside held traces (capture/tracer.py) -----------------

clean_attribute_value_as_sdk: Callable[[Any, int | None], Any] = _otel_attributes._clean_attribute_value
"""OpenTelemetry's own attribute cleaning (``opentelemetry.attributes._clean_attribute_value``: which types
are kept, sequences made tuples, strings cut, with its warnings), so a light span keeps exactly what an SDK
span keeps. The public ``BoundedAttributes`` does the same at ten times the cost."""


def become_capture_tracer(tracer: Any, cls: type) -> bool:
    """Make an SDK ``Tracer`` an instance of ``cls``, a subclass that adds no state of its own, in place: the
    provider keeps it in its cache (``_tracers``) and updates it (resource after a fork, tracer
    configurator), which a wrapper would miss. False when it is not exactly the SDK's class."""
    if type(tracer) is not SdkTracer or not issubclass(cls, SdkTracer):
        return False
    tracer.__class__ = cls
    return True


def tracer_span_limits(tracer: Any) -> SpanLimits:
    """The provider's span limits the tracer applies (``_span_limits``)."""
    limits = tracer._span_limits
    if not isinstance(limits, SpanLimits):  # pragma: no cover - a layout change; test_compat fails first
        raise TypeError("unexpected span limits")
    return limits


def tracer_scope(tracer: Any) -> InstrumentationScope:
    """The tracer's instrumentation scope (``_instrumentation_scope``)."""
    scope = tracer._instrumentation_scope
    if not isinstance(scope, InstrumentationScope):  # pragma: no cover - a layout change; test_compat fails first
        raise TypeError("unexpected instrumentation scope")
    return scope


def tracer_enabled_check(tracer: Any) -> Callable[[], bool]:
    """The tracer's own "am I enabled" check (``_is_enabled``, SDK 1.38+, which follows the provider's tracer
    configurator, even when it changes later); always true on an SDK without one. A disabled tracer's spans
    are non-recording."""
    is_enabled = getattr(tracer, "_is_enabled", None)
    return is_enabled if callable(is_enabled) else _always_true


def _always_true() -> bool:
    return True


def tracer_counts_its_spans(tracer: Any) -> bool:
    """Does the tracer record the SDK's own span metrics (``_tracer_metrics``, on with
    ``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED``)? Those count SDK spans: such a tracer keeps them."""
    from opentelemetry.sdk.trace._tracer_metrics import NoOpTracerMetrics

    metrics = getattr(tracer, "_tracer_metrics", None)
    return metrics is not None and not isinstance(metrics, NoOpTracerMetrics)


def follows_local_parent(sampler: Any) -> bool:
    """Is ``sampler`` a ``ParentBased`` whose local-parent delegates are the defaults (``_local_parent_sampled``
    always on, ``_local_parent_not_sampled`` always off, ``StaticSampler._decision``)? Then a child of a local
    parent is sampled exactly when its parent is, and the sampler need not be asked per span."""
    from opentelemetry.sdk.trace.sampling import Decision, ParentBased, StaticSampler

    if not isinstance(sampler, ParentBased):
        return False
    sampled = getattr(sampler, "_local_parent_sampled", None)
    not_sampled = getattr(sampler, "_local_parent_not_sampled", None)
    return (
        type(sampled) is StaticSampler
        and type(not_sampled) is StaticSampler
        and getattr(sampled, "_decision", None) is Decision.RECORD_AND_SAMPLE
        and getattr(not_sampled, "_decision", None) is Decision.DROP
    )


# --- the SDK's metric readers: stagetrace's own aggregation collected with the provider's (exporter/aggregation.py)


def reader_prefers_delta(reader: Any) -> frozenset[str]:
    """The instrument kinds ("histogram", "counter", "gauge") a reader wants as deltas
    (``_instrument_class_temporality``, keyed by the SDK's instrument classes); the rest cumulative."""
    from opentelemetry.sdk.metrics._internal.instrument import _Counter, _Gauge, _Histogram
    from opentelemetry.sdk.metrics.export import AggregationTemporality

    preferences = getattr(reader, "_instrument_class_temporality", None)
    if not isinstance(preferences, dict):
        raise TypeError("stagetrace needs an SDK MetricReader (it reads the reader's temporality preference)")
    kinds = {"histogram": _Histogram, "counter": _Counter, "gauge": _Gauge}
    return frozenset(kind for kind, cls in kinds.items() if preferences.get(cls) is AggregationTemporality.DELTA)


def set_reader_collect(reader: Any, merge: Callable[[Any], Any]) -> None:
    """Make ``reader.collect()`` return ``merge(what its meter provider collected)``: the reader's collect
    callback (``_collect``, set by the provider through ``_set_collect_callback``) wrapped. The reader must
    already be registered with its provider."""
    provider_collect = getattr(reader, "_collect", None)
    if provider_collect is None or not hasattr(reader, "_set_collect_callback"):
        raise TypeError("stagetrace needs an SDK MetricReader registered with a MeterProvider")

    def collect(metric_reader: Any, timeout_millis: float = 10_000) -> Any:
        return merge(provider_collect(metric_reader, timeout_millis=timeout_millis))

    reader._set_collect_callback(collect)


def meter_provider_readers(provider: Any) -> tuple[Any, ...]:
    """The readers an SDK MeterProvider was made with (``_metric_readers``); () for any other provider."""
    readers = getattr(provider, "_metric_readers", None)
    return tuple(readers) if isinstance(readers, (list, tuple)) else ()


def metric_exporter_of(reader: Any) -> Any:
    """A ``PeriodicExportingMetricReader``'s exporter (``_exporter``); None for any other reader."""
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    return getattr(reader, "_exporter", None) if isinstance(reader, PeriodicExportingMetricReader) else None


def detach_metric_reader(provider: Any, reader: Any) -> bool:
    """Take ``reader`` out of an SDK MeterProvider and shut it down, exporting nothing more: its ``collect``
    made a no-op first (a periodic reader collects and exports once more as it shuts down, and
    ``remove_metric_reader`` has already unregistered it by then: a warning), then the public
    ``remove_metric_reader`` (measurements stop reaching it), then out of the list the provider's own
    ``shutdown`` walks (``_metric_readers``, which ``remove_metric_reader`` leaves as it was: the reader
    would be shut down a second time, with a warning, at exit). False, changing nothing, where the SDK
    lacks either."""
    remove = getattr(provider, "remove_metric_reader", None)
    readers = getattr(provider, "_metric_readers", None)
    if not callable(remove) or not isinstance(readers, (list, tuple)) or reader not in readers:
        return False
    reader.collect = _collect_nothing
    remove(reader)
    provider._metric_readers = tuple(r for r in readers if r is not reader)
    return True


def _collect_nothing(timeout_millis: float = 10_000) -> None:
    return None


# --- the API's global meter provider ---------------------------------------------------------------------


def meter_provider_is_unset() -> bool:
    """Is the global meter provider still the API's placeholder (``_internal._ProxyMeterProvider``)? Setting
    it twice only logs a warning, so stagetrace asks before it sets."""
    proxy = getattr(getattr(metrics_api, "_internal", None), "_ProxyMeterProvider", None)
    return proxy is not None and isinstance(metrics_api.get_meter_provider(), proxy)


# --- the standard library's ThreadPoolExecutor ------------------------------------------------------------


def executor_saturated(pool: ThreadPoolExecutor) -> bool | None:
    """Every worker started and busy, or started and tasks already queued (``_work_queue``, ``_threads``,
    ``_max_workers``, ``_idle_semaphore``): the executor has no public view of its load. While it still
    starts threads a queued task is about to get a new one, so that is not saturation. None when the
    layout differs."""
    try:
        if len(pool._threads) < pool._max_workers:
            return False
        idle: threading.Semaphore = pool._idle_semaphore
        return pool._work_queue.qsize() > 0 or idle._value == 0
    except AttributeError:
        return None


def executor_max_workers(pool: ThreadPoolExecutor) -> int | None:
    """The pool's size (``_max_workers``), or None when the layout differs."""
    size = getattr(pool, "_max_workers", None)
    return size if isinstance(size, int) else None


def executor_thread_name_prefix(pool: ThreadPoolExecutor) -> str:
    """The ``thread_name_prefix`` the pool was made with (``_thread_name_prefix``), or ''."""
    return str(getattr(pool, "_thread_name_prefix", "") or "")


# --- the standard library's process pools ------------------------------------------------------------------


def process_pool_facts(pool: Any) -> tuple[int | None, int | None, str | None]:
    """A ``ProcessPoolExecutor``'s size (``_max_workers``), the calls it holds (``_pending_work_items``: queued
    and running) and its start method (``_mp_context``); None for what the layout does not have."""
    size = getattr(pool, "_max_workers", None)
    pending = getattr(pool, "_pending_work_items", None)
    return (
        size if isinstance(size, int) else None,
        len(pending) if isinstance(pending, dict) else None,
        _start_method(getattr(pool, "_mp_context", None)),
    )


def mp_pool_facts(pool: Any) -> tuple[int | None, str | None]:
    """A ``multiprocessing.Pool``'s size (``_processes``) and start method (``_ctx``)."""
    size = getattr(pool, "_processes", None)
    return size if isinstance(size, int) else None, _start_method(getattr(pool, "_ctx", None))


def watch_mp_job_outcomes(pool: Any, job: int, on_outcome: Callable[[int, Any], None]) -> bool:
    """Have ``on_outcome(index, (ok, value))`` called with each task's outcome of one ``multiprocessing.Pool``
    job before the pool records it: the pool hands every outcome to the job's result in its ``_cache``
    (``_set(index, (ok, value))``; on its task thread for a task it could not send, on its result thread for
    a worker's report). False where the layout differs (nothing wrapped)."""
    cache = getattr(pool, "_cache", None)
    result: Any = cache.get(job) if isinstance(cache, dict) else None
    set_outcome = getattr(result, "_set", None)
    if set_outcome is None:
        return False

    def outcome(index: int, value: Any) -> None:
        on_outcome(index, value)
        set_outcome(index, value)

    result._set = outcome
    return True


def _start_method(ctx: Any) -> str | None:
    try:
        method = ctx.get_start_method() if ctx is not None else None
    except Exception:
        return None
    return method if isinstance(method, str) else None


# Where the pools start their workers (looked up when a worker process is made, so a wrapper put there runs
# first in every worker started afterwards), and where multiprocessing.Pool makes the tasks of map, imap and
# starmap (in the caller's thread: the generator runs later, on the pool's task thread).
PROCESS_POOL_WORKER = ("concurrent.futures.process", "_process_worker")
MP_POOL_WORKER = ("multiprocessing.pool", "worker")
MP_POOL_TASKS = "_guarded_task_generation"


# --- FastAPI's own telemetry (0.142+) ----------------------------------------------------------------------


def fastapi_telemetry_config(app: Any) -> dict[str, Any] | None:
    """The telemetry settings an app's native telemetry reads on every request (``app._telemetry``, the
    same dict as ``app._native_telemetry.config``): where ``FastAPI(telemetry=...)`` put them. None when the
    installed FastAPI has no native telemetry or the layout differs."""
    config = getattr(app, "_telemetry", None)
    if not isinstance(config, dict) or "tracer_provider" not in config:
        return None
    native = getattr(app, "_native_telemetry", None)
    return config if getattr(native, "config", None) is config else None


def fastapi_contrib_instrumented(app: Any) -> bool:
    """Has the contrib ``FastAPIInstrumentor`` instrumented this app (``_is_instrumented_by_opentelemetry``)?"""
    return bool(getattr(app, "_is_instrumented_by_opentelemetry", False))


# --- when a request reached its server (capture/arrival.py) -----------------------------------------------

_REQUEST_CODES: dict[Any, str] | None = None


def _request_coroutine_codes() -> dict[Any, str]:
    """The code of the coroutine each ASGI server makes a task of for each request, and where that task's
    socket is: uvicorn's ``RequestResponseCycle.run_asgi`` (httptools and h11; the cycle's ``transport``),
    hypercorn's ``task_group._handle`` (the connection's ``writer``, a local of the task that spawns it)."""
    found: dict[Any, str] = {}
    places = (
        ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle", "run_asgi", "cycle"),
        ("uvicorn.protocols.http.h11_impl", "RequestResponseCycle", "run_asgi", "cycle"),
        ("hypercorn.asyncio.task_group", None, "_handle", "spawner"),
    )
    for module, owner, function, where in places:
        try:
            scope: Any = __import__(module, fromlist=["_"])
        except Exception:  # not installed, or an optional dependency of it missing
            continue
        if owner is not None:
            scope = getattr(scope, owner, None)
        code = getattr(getattr(scope, function, None), "__code__", None)
        if code is not None:
            found[code] = where
    return found


def asgi_request_socket(coro: Any) -> Any:
    """The socket of the request a new task will serve, when the task is an ASGI server's request coroutine:
    uvicorn's (its ``self``, the request cycle, in ``cr_frame.f_locals``, has the connection's
    ``transport``) or hypercorn's (spawned by the connection's own task, whose coroutine has the connection's
    ``writer`` among its locals). None for any other coroutine, or when the layout differs."""
    global _REQUEST_CODES
    codes = _REQUEST_CODES
    if codes is None:
        codes = _REQUEST_CODES = _request_coroutine_codes()
    where = codes.get(getattr(coro, "cr_code", None))
    if where is None:
        return None
    if where == "cycle":
        frame = getattr(coro, "cr_frame", None)
        owner = getattr(frame.f_locals.get("self"), "transport", None) if frame is not None else None
    else:
        spawner = asyncio.current_task()
        frame = getattr(spawner.get_coro(), "cr_frame", None) if spawner is not None else None
        owner = frame.f_locals.get("writer") if frame is not None else None
    get_extra_info = getattr(owner, "get_extra_info", None)
    return get_extra_info("socket") if get_extra_info is not None else None


_TCP_INFO_LAST_DATA_RECV = 52  # struct tcp_info: 8 bytes of u8 fields, then u32s; tcpi_last_data_recv is the 12th


def socket_received_ms_ago(sock: Any) -> int:
    """Milliseconds since the socket last received data (Linux ``TCP_INFO``'s ``tcpi_last_data_recv``, in
    jiffies: a few ms of resolution), or -1 where the platform or socket cannot say."""
    import socket
    import struct

    tcp_info = getattr(socket, "TCP_INFO", None)
    if tcp_info is None:
        return -1
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, tcp_info, 104)
    except (OSError, AttributeError, TypeError):
        return -1
    if len(raw) < _TCP_INFO_LAST_DATA_RECV + 4:
        return -1
    return int(struct.unpack_from("=I", raw, _TCP_INFO_LAST_DATA_RECV)[0])


# --- the interpreter's GIL: how long one wait for it can last --------------------------------------------


def gil_wait_stretch_bound_s() -> float | None:
    """The longest a thread waiting for the GIL stays off the CPU in one stretch, in seconds, for
    ``exporter.signals.not_gil_ms``: 0.0 where there is no GIL (a free-threaded build with it disabled), None
    where it is not known (another implementation than CPython).

    CPython's ``take_gil`` waits on a condition with the switch interval as its timeout, then asks the
    holder to drop the GIL and waits again, so each stretch ends within one interval. (The thread made to
    drop the GIL waits, untimed, until the one that asked takes it: immediate while there are free CPUs,
    and on a host without any the stage's own run-queue wait says so.) ``tests/test_compat.py`` checks
    this on real threads.
    """
    if sys.implementation.name != "cpython":
        return None
    is_gil_enabled = getattr(sys, "_is_gil_enabled", None)  # 3.13+
    if is_gil_enabled is not None and not is_gil_enabled():
        return 0.0
    return sys.getswitchinterval()
