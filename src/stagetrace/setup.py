"""``configure()``: tracing and metrics set up the OpenTelemetry way, with stagetrace's processor in front
of the exporters. Standard ``OTEL_*`` variables win where OpenTelemetry defines them."""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import metrics as metrics_api
from opentelemetry import trace as trace_api
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, SynchronousMultiSpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import Sampler, _get_from_env_or_default

from stagetrace import _state
from stagetrace._safety import logger
from stagetrace.analysis import DiagnosisThresholds, Verdict
from stagetrace.export.env import metric_readers_from_env, span_exporters_from_env
from stagetrace.export.files import JsonLinesSpanExporter, default_traces_path
from stagetrace.finalize.sampler import LocalRootRecordingSampler
from stagetrace.runtime import Runtime
from stagetrace.settings import Settings, env_flag, slow_threshold_from_env

_lock = threading.Lock()
_current_handle: StagetraceHandle | None = None


class StagetraceHandle:
    """What ``configure()`` returns. ``traces_path`` is set when traces go to the embedded JSON lines file."""

    def __init__(
        self,
        runtime: Runtime | None,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        traces_path: Path | None = None,
        detach: Callable[[], None] | None = None,
        exporters: Sequence[SpanExporter] = (),
    ) -> None:
        """``detach``: for a handle from ``attach()``, undoes the wrapping instead of shutting providers down."""
        self.runtime = runtime
        self._detach = detach
        self._exporters = list(exporters)
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.traces_path = traces_path
        self._shut = False

    @property
    def enabled(self) -> bool:
        return self.runtime is not None

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Finish every trace that has ended and push spans and metrics out. Never call it per request."""
        if self.runtime is None or self._shut:
            return True
        ok = self.tracer_provider.force_flush(int(timeout_s * 1000))
        flush_metrics = getattr(self.meter_provider, "force_flush", None)  # absent on the API's proxy provider
        return bool(flush_metrics(int(timeout_s * 1000)) if flush_metrics else True) and ok

    def shutdown(self, timeout_s: float | None = None) -> None:
        global _current_handle
        if self._shut:
            return
        self._shut = True
        if self.runtime is None:
            return
        self.runtime.shutdown_samplers()
        if _state.runtime is self.runtime:
            _state.runtime = None
        if timeout_s is not None:
            self.runtime.settings.shutdown_timeout_s = timeout_s
        deadline_s = self.runtime.settings.shutdown_timeout_s
        if self._detach is not None:
            self.runtime.finalizer.shutdown(deadline_s)
            self._detach()
        else:
            self._shutdown_providers(deadline_s)
        with _lock:
            if _current_handle is self:
                _current_handle = None

    def _shutdown_providers(self, deadline_s: float) -> None:
        """Within the deadline, even when the collector is down and the exporter is retrying: past it the
        exporters are told to stop (abandoning what is unsent) and shutdown returns."""

        def run() -> None:
            try:
                self.tracer_provider.shutdown()
                self.meter_provider.shutdown(timeout_millis=int(deadline_s * 1000))
            except Exception:
                logger.debug("stagetrace: provider shutdown failed", exc_info=True)

        worker = threading.Thread(target=run, name="stagetrace-shutdown", daemon=True)
        worker.start()
        worker.join(deadline_s)
        if worker.is_alive():
            logger.warning(
                "stagetrace: shutdown exceeded %.1f s (collector unreachable?); unsent spans dropped", deadline_s
            )
            for exporter in self._exporters:
                try:
                    exporter.shutdown()
                except Exception:
                    logger.debug("stagetrace: exporter shutdown failed", exc_info=True)
            worker.join(1.0)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _resource(service_name: str | None, extra: Mapping[str, Any] | None) -> Resource:
    attrs: dict[str, Any] = dict(extra or {})
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over arguments (OpenTelemetry's rule).
    if service_name and not os.environ.get("OTEL_SERVICE_NAME"):
        env_attrs = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
        if "service.name=" not in env_attrs:
            attrs[SERVICE_NAME] = service_name
    return Resource.create(attrs)


def configure(
    service_name: str | None = None,
    *,
    slow_threshold_ms: float | None = None,
    span_exporter: SpanExporter | Sequence[SpanExporter] | None = None,
    metric_reader: MetricReader | Sequence[MetricReader] | None = None,
    gpu: bool | None = None,
    on_verdict: Callable[[Verdict], Any] | Sequence[Callable[[Verdict], Any]] | None = None,
    route_slow_thresholds_ms: Mapping[str, float] | None = None,
    thresholds: DiagnosisThresholds | None = None,
    sampler: Sampler | None = None,
    resource_attributes: Mapping[str, Any] | None = None,
    traces_path: str | os.PathLike[str] | None = None,
    set_global: bool = True,
    settings: Settings | None = None,
) -> StagetraceHandle:
    """Set up stage tracing for this process and return a handle with ``force_flush()`` and ``shutdown()``.

    With no ``span_exporter`` and no ``OTEL_TRACES_EXPORTER`` / ``OTEL_EXPORTER_OTLP_*ENDPOINT`` in the
    environment, traces go to an OTLP JSON lines file (``traces_path``, or ``./stagetrace-out/``) that
    ``stagetrace report`` reads, and slow traces are logged; nothing tries to reach a collector.
    Calling it again replaces the previous configuration. ``STAGETRACE_DISABLED=true`` makes it, and every
    stage, a no-op.
    """
    if env_flag("STAGETRACE_DISABLED") or env_flag("OTEL_SDK_DISABLED"):
        logger.info("stagetrace: disabled by environment; stages are no-ops")
        _replace_handle(None)
        return StagetraceHandle(None)

    settings = settings or Settings()
    settings.slow_threshold_ms = (
        float(slow_threshold_ms)
        if slow_threshold_ms is not None
        else slow_threshold_from_env(settings.slow_threshold_ms)
    )
    if route_slow_thresholds_ms:
        settings.route_slow_thresholds_ms = {str(k): float(v) for k, v in route_slow_thresholds_ms.items()}
    if thresholds is not None:
        if not isinstance(thresholds, DiagnosisThresholds):
            raise TypeError("thresholds must be a stagetrace.DiagnosisThresholds")
        settings.thresholds = thresholds
    settings.validate()
    callbacks = _as_list(on_verdict)
    for cb in callbacks:
        if not callable(cb):
            raise TypeError(f"on_verdict must be callable, got {type(cb).__name__}")

    resource = _resource(service_name, resource_attributes)
    exporters = _as_list(span_exporter)
    path: Path | None = None
    if not exporters:
        from_env = span_exporters_from_env()
        if from_env is None:
            service = resource.attributes.get(SERVICE_NAME)
            path = Path(traces_path) if traces_path else default_traces_path(service)
            factory = None if traces_path else (lambda: default_traces_path(service))
            exporters = [JsonLinesSpanExporter(path, path_factory=factory)]
        else:
            exporters = from_env
    readers = _as_list(metric_reader)
    if not readers:
        readers = metric_readers_from_env() or []

    tracer_provider = TracerProvider(
        resource=resource,
        sampler=LocalRootRecordingSampler(sampler or _get_from_env_or_default()),
        shutdown_on_exit=False,
    )
    exporting: list[SpanProcessor] = [BatchSpanProcessor(e) for e in exporters]
    if len(exporting) == 1:
        downstream: SpanProcessor = exporting[0]
    else:
        downstream = SynchronousMultiSpanProcessor()
        for p in exporting:
            downstream.add_span_processor(p)
    meter_provider = MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)
    runtime = Runtime(
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        downstream=downstream,
        settings=settings,
        on_verdict=callbacks,
    )
    if gpu is not False:
        _enable_gpu(runtime, required=gpu is True)
    handle = StagetraceHandle(runtime, tracer_provider, meter_provider, path, exporters=exporters)
    _flush_at_process_exit(handle)
    _replace_handle(handle)
    _state.runtime = runtime
    if set_global:
        _set_globals(tracer_provider, meter_provider)
    if path is not None:
        logger.info("stagetrace: no exporter configured; writing OTLP JSON lines to %s", path)
    return handle


def attach(
    tracer_provider: TracerProvider,
    meter_provider: Any = None,
    *,
    on_verdict: Callable[[Verdict], Any] | Sequence[Callable[[Verdict], Any]] | None = None,
    settings: Settings | None = None,
    gpu: bool | None = None,
) -> StagetraceHandle:
    """Put stagetrace in front of an existing SDK TracerProvider's processors (a user's distro, configurator
    or own setup): their exporters then receive the verdict-bearing roots and the stage spans. Nothing of
    theirs is replaced; ``handle.shutdown()`` restores the processors as they were."""
    multi = getattr(tracer_provider, "_active_span_processor", None)
    if not isinstance(getattr(multi, "_span_processors", None), tuple) or not hasattr(multi, "_lock"):
        raise TypeError("stagetrace.attach() needs an SDK TracerProvider with the standard processor chain")
    settings = settings or Settings(slow_threshold_ms=slow_threshold_from_env())
    settings.validate()
    downstream = SynchronousMultiSpanProcessor()
    runtime = Runtime(
        tracer_provider=tracer_provider,
        meter_provider=meter_provider or metrics_api.get_meter_provider(),
        downstream=downstream,
        settings=settings,
        on_verdict=_as_list(on_verdict),
        install=False,
    )
    with multi._lock:
        original = multi._span_processors
        downstream._span_processors = original
        multi._span_processors = (runtime.processor,)

    def detach() -> None:
        with multi._lock:
            current = multi._span_processors
            added_since = tuple(p for p in current if p is not runtime.processor)
            multi._span_processors = downstream._span_processors + added_since

    if gpu is not False:
        _enable_gpu(runtime, required=gpu is True)
    handle = StagetraceHandle(runtime, tracer_provider, meter_provider, None, detach=detach)
    _replace_handle(handle)
    _state.runtime = runtime
    return handle


def _enable_gpu(runtime: Runtime, required: bool) -> None:
    """Hook for the GPU timer and NVML sampler (stagetrace.gpu); absent pieces switch off with a warning."""
    from stagetrace.gpu import attach_gpu

    attach_gpu(runtime, required=required)


def _replace_handle(handle: StagetraceHandle | None) -> None:
    global _current_handle
    with _lock:
        previous, _current_handle = _current_handle, handle
    if previous is not None:
        previous.shutdown()


def _set_globals(tracer_provider: TracerProvider, meter_provider: MeterProvider) -> None:
    """Install as the global providers unless something else already is (OpenTelemetry allows it once)."""
    if isinstance(trace_api.get_tracer_provider(), trace_api.ProxyTracerProvider):
        trace_api.set_tracer_provider(tracer_provider)
    else:
        logger.debug("stagetrace: a global TracerProvider is already set; stagetrace uses its own")
    if isinstance(metrics_api.get_meter_provider(), metrics_api._internal._ProxyMeterProvider):
        metrics_api.set_meter_provider(meter_provider)


def _flush_at_process_exit(handle: StagetraceHandle) -> None:
    """multiprocessing children end with os._exit, skipping atexit; its own exit hooks still run."""
    import multiprocessing.util

    multiprocessing.util.Finalize(handle, handle.shutdown, exitpriority=10)


def current_handle() -> StagetraceHandle | None:
    return _current_handle


@atexit.register
def _shutdown_at_exit() -> None:
    handle = _current_handle
    if handle is not None:
        try:
            handle.shutdown()
        except Exception:
            logging.getLogger("stagetrace").debug("shutdown at exit failed", exc_info=True)
