"""``configure()``: tracing and metrics set up the OpenTelemetry way, with stagetrace's processor in front
of the exporters. Standard ``OTEL_*`` variables win where OpenTelemetry defines them."""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry import metrics as metrics_api
from opentelemetry import trace as trace_api
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import PROCESS_PID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, SynchronousMultiSpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import Sampler

from stagetrace import _state
from stagetrace._compat import (
    ProcessorChain,
    meter_provider_is_unset,
    processors_of,
    sampler_from_env,
    set_processors,
)
from stagetrace._safety import logger
from stagetrace.analysis import DiagnosisThresholds, Verdict
from stagetrace.capture.head_sampler import LocalRootRecordingSampler
from stagetrace.capture.tracer import CaptureTracerProvider
from stagetrace.common.wire import plain
from stagetrace.destinations.env import (
    metric_export_from_env,
    metric_readers_from_env,
    span_export_from_env,
    span_exporters_from_env,
)
from stagetrace.destinations.files import JsonLinesSpanExporter, default_traces_path
from stagetrace.destinations.shutdown import shutdown_within
from stagetrace.runtime import Runtime
from stagetrace.settings import Settings, disabled_from_env, slow_threshold_from_env

_lock = threading.Lock()
_current_handle: StagetraceHandle | None = None


class StagetraceHandle:
    """What ``configure()`` returns. ``traces_path`` is set when traces go to the embedded JSON lines file."""

    def __init__(
        self,
        runtime: Runtime | None,
        tracer_provider: TracerProvider | None = None,
        meter_provider: Any = None,
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

    @property
    def exporter_pid(self) -> int | None:
        """The exporter process of this process, when one runs."""
        return self.runtime.exporter_pid if self.runtime is not None else None

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Finish every trace that has ended: analysed, exported, and its verdict delivered. Never call it
        per request."""
        if self.runtime is None or self._shut:
            return True
        ok = self.runtime.shipper.flush(timeout_s)
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
            self.runtime.shipper.shutdown(deadline_s)
            self._detach()
        else:
            provider, meters = self.tracer_provider, self.meter_provider
            assert provider is not None  # a handle that owns its providers has them
            steps: list[Callable[[], Any]] = [provider.shutdown]
            if meters is not None:
                steps.append(lambda: meters.shutdown(timeout_millis=int(deadline_s * 1000)))
            shutdown_within(deadline_s, steps, [e.shutdown for e in self._exporters])
        with _lock:
            if _current_handle is self:
                _current_handle = None


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _resource(service_name: str | None, extra: Mapping[str, Any] | None) -> Resource:
    # The application's pid: spans and metrics describe it, whichever process exports them.
    attrs: dict[str, Any] = {PROCESS_PID: os.getpid(), **(extra or {})}
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
    if disabled_from_env():
        logger.info("stagetrace: disabled by environment; stages are no-ops")
        _replace_handle(None)
        return StagetraceHandle(None)
    settings = _settings_for(settings, slow_threshold_ms, route_slow_thresholds_ms, thresholds)
    callbacks = _checked_callbacks(on_verdict)
    resource = _resource(service_name, resource_attributes)
    service_attr = resource.attributes.get(SERVICE_NAME)
    plan = _plan_export(
        settings,
        service_attr if isinstance(service_attr, str) else None,
        _as_list(span_exporter),
        _as_list(metric_reader),
        traces_path,
    )
    tracer_provider = CaptureTracerProvider(
        resource=resource,
        sampler=LocalRootRecordingSampler(sampler or sampler_from_env()),
        shutdown_on_exit=False,
    )
    # Only where a reader lives in the application: a MeterProvider without one would still build and clean a
    # measurement for every record another instrumentation makes (the contrib ASGI middleware: four a
    # request) and throw it away. Without one, instrumentations use the global provider, which the user may
    # still set.
    meter_provider = (
        MeterProvider(metric_readers=plan.app_readers, resource=resource, shutdown_on_exit=False)
        if plan.app_readers
        else None
    )

    def exporter_config() -> dict[str, Any]:
        return _exporter_config(
            tracer_provider,
            settings,
            spans=plan.spans_mode,
            metrics=plan.metrics_mode,
            traces_path=plan.process_traces_path(),
            return_spans=bool(plan.app_exporters),
            return_metrics=bool(plan.app_readers),
            return_verdicts=bool(callbacks),
        )

    runtime = Runtime(
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        local=_batching(plan.app_exporters),
        local_metrics=bool(plan.app_readers),
        metric_readers=plan.app_readers,
        settings=settings,
        on_verdict=callbacks,
        exporter_config=exporter_config,
    )
    tracer_provider.bind(runtime, light_spans=settings.light_spans)
    if gpu is not False:
        _enable_gpu(runtime, required=gpu is True)
    handle = StagetraceHandle(runtime, tracer_provider, meter_provider, plan.file_path, exporters=plan.app_exporters)
    _flush_at_process_exit(handle)
    _replace_handle(handle)
    _state.runtime = runtime
    if set_global:
        _set_globals(tracer_provider, meter_provider)
    if plan.file_path is not None:
        logger.info("stagetrace: no exporter configured; writing OTLP JSON lines to %s", plan.file_path)
    return handle


def _settings_for(
    settings: Settings | None,
    slow_threshold_ms: float | None,
    route_slow_thresholds_ms: Mapping[str, float] | None,
    thresholds: DiagnosisThresholds | None,
) -> Settings:
    """The settings with ``configure()``'s own arguments applied (they win over the environment), checked."""
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
    return settings.validate()


def _checked_callbacks(on_verdict: Any) -> list[Callable[[Verdict], Any]]:
    callbacks = _as_list(on_verdict)
    for cb in callbacks:
        if not callable(cb):
            raise TypeError(f"on_verdict must be callable, got {type(cb).__name__}")
    return callbacks


@dataclass
class _ExportPlan:
    """Where spans and metrics go. Exporter objects and readers the user passed stay in the application
    (``app_*``) and receive what concerns them; what ``OTEL_*`` configures, or the embedded JSON lines file
    when nothing is configured, is built by the exporter process (``*_mode``), or in the application when
    ``Settings(export_process=False)``."""

    app_exporters: list[SpanExporter]
    app_readers: list[MetricReader]
    spans_mode: str  # what the exporter process builds for spans: "none", "file" or "env"
    metrics_mode: str  # "none" or "env"
    file_path: Path | None  # the embedded default's file, when it applies
    traces_path: str | os.PathLike[str] | None
    service: str | None

    def process_traces_path(self) -> Path:
        """Asked in the process the exporter serves: a forked worker gets a file of its own (its pid)."""
        return Path(self.traces_path) if self.traces_path else default_traces_path(self.service)


def _plan_export(
    settings: Settings,
    service: str | None,
    user_exporters: list[SpanExporter],
    user_readers: list[MetricReader],
    traces_path: str | os.PathLike[str] | None,
) -> _ExportPlan:
    file_default = not user_exporters and not span_export_from_env()
    path = (Path(traces_path) if traces_path else default_traces_path(service)) if file_default else None
    app_exporters, app_readers = user_exporters, user_readers
    if not settings.export_process:
        app_exporters = user_exporters or span_exporters_from_env() or []
        if file_default:
            factory = None if traces_path else (lambda: default_traces_path(service))
            app_exporters = [JsonLinesSpanExporter(path or default_traces_path(service), path_factory=factory)]
        app_readers = user_readers or metric_readers_from_env() or []
    return _ExportPlan(
        app_exporters=app_exporters,
        app_readers=app_readers,
        spans_mode="none" if user_exporters else ("file" if file_default else "env"),
        metrics_mode="none" if user_readers else ("env" if metric_export_from_env() else "none"),
        file_path=path,
        traces_path=traces_path,
        service=service,
    )


def _batching(exporters: Sequence[SpanExporter]) -> SpanProcessor | None:
    processors: list[SpanProcessor] = [BatchSpanProcessor(e) for e in exporters]
    if len(processors) <= 1:
        return processors[0] if processors else None
    multi = SynchronousMultiSpanProcessor()
    for p in processors:
        multi.add_span_processor(p)
    return multi


def _exporter_config(
    tracer_provider: TracerProvider,
    settings: Settings,
    *,
    spans: str,
    metrics: str,
    traces_path: Path,
    return_spans: bool,
    return_metrics: bool,
    return_verdicts: bool,
) -> dict[str, Any]:
    """What a new exporter process needs, computed in the process it serves: a forked worker's exporter
    describes that worker (the provider refreshes ``process.pid`` after a fork) and writes its own file."""
    return {
        "settings": plain(settings.to_dict()),
        "resource": plain(dict(tracer_provider.resource.attributes)),
        "spans": spans,
        "metrics": metrics,
        "traces_path": str(traces_path),
        "return_spans": return_spans,
        "return_metrics": return_metrics,
        "return_verdicts": return_verdicts,
    }


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
    chain = ProcessorChain(tracer_provider)
    settings = settings or Settings(slow_threshold_ms=slow_threshold_from_env())
    settings.validate()
    callbacks = _as_list(on_verdict)
    downstream = SynchronousMultiSpanProcessor()
    meters = meter_provider or metrics_api.get_meter_provider()

    def exporter_config() -> dict[str, Any]:
        return _exporter_config(
            tracer_provider,
            settings,
            spans="none",
            metrics="none",
            traces_path=default_traces_path(None),
            return_spans=True,
            return_metrics=True,
            return_verdicts=bool(callbacks),
        )

    with chain.locked():
        set_processors(downstream, chain.processors)
    runtime = Runtime(
        tracer_provider=tracer_provider,
        meter_provider=meters,
        local=downstream,
        local_metrics=True,
        settings=settings,
        on_verdict=callbacks,
        exporter_config=exporter_config,
        install=False,
    )
    with chain.locked():
        chain.processors = (runtime.processor,)

    def detach() -> None:
        with chain.locked():
            added_since = tuple(p for p in chain.processors if p is not runtime.processor)
            chain.processors = processors_of(downstream) + added_since

    if gpu is not False:
        _enable_gpu(runtime, required=gpu is True)
    handle = StagetraceHandle(runtime, tracer_provider, meter_provider, None, detach=detach)
    _replace_handle(handle)
    _state.runtime = runtime
    return handle


def _enable_gpu(runtime: Runtime, *, required: bool) -> None:
    """Hook for the GPU timer and NVML sampler (stagetrace.gpu); absent pieces switch off with a warning."""
    from stagetrace.gpu import attach_gpu

    attach_gpu(runtime, required=required)


def _replace_handle(handle: StagetraceHandle | None) -> None:
    global _current_handle
    with _lock:
        previous, _current_handle = _current_handle, handle
    if previous is not None:
        previous.shutdown()


def _set_globals(tracer_provider: TracerProvider, meter_provider: MeterProvider | None) -> None:
    """Install as the global providers unless something else already is (OpenTelemetry allows it once)."""
    if isinstance(trace_api.get_tracer_provider(), trace_api.ProxyTracerProvider):
        trace_api.set_tracer_provider(tracer_provider)
    else:
        logger.debug("stagetrace: a global TracerProvider is already set; stagetrace uses its own")
    if meter_provider is not None and meter_provider_is_unset():
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
