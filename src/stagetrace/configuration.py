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
    detach_metric_reader,
    meter_provider_is_unset,
    meter_provider_readers,
    processors_of,
    sampler_from_env,
    set_processors,
)
from stagetrace._safety import logger
from stagetrace.analysis import DiagnosisThresholds, Verdict
from stagetrace.capture.head_sampler import LocalRootRecordingSampler
from stagetrace.capture.tracer import CaptureTracerProvider
from stagetrace.common.wire import plain
from stagetrace.destinations.distro import plan_takeover
from stagetrace.destinations.env import (
    EMBEDDED_DEFAULT,
    Selection,
    files_for_metrics,
    metric_readers,
    metric_selection,
    span_exporters,
    span_selection,
)
from stagetrace.destinations.files import default_metrics_path, default_traces_path, metrics_beside
from stagetrace.destinations.shutdown import shutdown_within
from stagetrace.runtime import Runtime
from stagetrace.settings import Settings, disabled_from_env, slow_threshold_from_env

_lock = threading.Lock()
_current_handle: StagetraceHandle | None = None


class StagetraceHandle:
    """What ``configure()`` returns. ``traces_path`` / ``metrics_path`` are set when traces / metrics go to
    a JSON lines file (the embedded default, or ``OTEL_*_EXPORTER=file``)."""

    def __init__(
        self,
        runtime: Runtime | None,
        tracer_provider: TracerProvider | None = None,
        meter_provider: Any = None,
        traces_path: Path | None = None,
        detach: Callable[[], None] | None = None,
        exporters: Sequence[SpanExporter] = (),
        metrics_path: Path | None = None,
    ) -> None:
        """``detach``: for a handle from ``attach()``, undoes the wrapping instead of shutting providers down."""
        self.runtime = runtime
        self._detach = detach
        self._exporters = list(exporters)
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.traces_path = traces_path
        self.metrics_path = metrics_path
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
    environ: Mapping[str, str] | None = None,
) -> StagetraceHandle:
    """Set up stage tracing for this process and return a handle with ``force_flush()`` and ``shutdown()``.

    With no ``span_exporter`` and no ``OTEL_TRACES_EXPORTER`` / ``OTEL_EXPORTER_OTLP_*ENDPOINT`` in the
    environment, traces and metrics go to OTLP JSON lines files (``traces_path``, or ``./stagetrace-out/``)
    that ``stagetrace report`` reads, and slow traces are logged; nothing tries to reach a collector.
    Calling it again replaces the previous configuration. ``STAGETRACE_DISABLED=true`` makes it, and every
    stage, a no-op. ``environ``: where the exporter variables are read (default ``os.environ``; the zero-code
    path passes the user's, without a distro's defaults).
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
        os.environ if environ is None else environ,
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
            spans=plan.for_exporter_process()[0],
            metrics=plan.for_exporter_process()[1],
            traces_path=plan.process_traces_path(),
            metrics_path=plan.process_metrics_path(),
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
    handle = StagetraceHandle(
        runtime,
        tracer_provider,
        meter_provider,
        plan.file_path,
        exporters=plan.app_exporters,
        metrics_path=plan.metrics_file_path,
    )
    _flush_at_process_exit(handle)
    _replace_handle(handle)
    _state.runtime = runtime
    _trace_process_pools(runtime.settings)
    if set_global:
        _set_globals(tracer_provider, meter_provider)
    if plan.file_path is not None:
        why = "no exporter configured" if plan.spans is EMBEDDED_DEFAULT else "OTEL_TRACES_EXPORTER=file"
        logger.info("stagetrace: %s; writing OTLP JSON lines to %s", why, plan.file_path)
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
    (``app_*``) and receive what concerns them; what ``OTEL_*`` selects, or the embedded JSON lines files
    when nothing is configured, is built by the exporter process (``spans`` / ``metrics``), or in the
    application when ``Settings(export_process=False)``."""

    app_exporters: list[SpanExporter]
    app_readers: list[MetricReader]
    spans: Selection | None  # what the exporter process builds for spans (None: nothing)
    metrics: Selection | None
    traces_path: str | os.PathLike[str] | None  # given (configure()'s argument), else the default's
    service: str | None
    metrics_path: str | os.PathLike[str] | None = None
    built_here: bool = False  # Settings(export_process=False): spans and metrics are in app_*

    def for_exporter_process(self) -> tuple[Selection | None, Selection | None]:
        return (None, None) if self.built_here else (self.spans, self.metrics)

    @property
    def traces_factory(self) -> Callable[[], Path] | None:
        """For a file the application writes itself: its path again in a forked child (None: the path given)."""
        return None if self.traces_path else lambda: default_traces_path(self.service)

    @property
    def metrics_factory(self) -> Callable[[], Path] | None:
        return None if self.metrics_path else lambda: default_metrics_path(self.service)

    def process_traces_path(self) -> Path:
        """Asked in the process the exporter serves: a forked worker gets a file of its own (its pid)."""
        return Path(self.traces_path) if self.traces_path else default_traces_path(self.service)

    def process_metrics_path(self) -> Path:
        return Path(self.metrics_path) if self.metrics_path else default_metrics_path(self.service)

    @property
    def file_path(self) -> Path | None:
        """The traces file, when one is written (the embedded default, or ``OTEL_TRACES_EXPORTER=file``)."""
        return self.process_traces_path() if self.spans is not None and self.spans.writes_file else None

    @property
    def metrics_file_path(self) -> Path | None:
        return self.process_metrics_path() if self.metrics is not None and self.metrics.writes_file else None


def _plan_export(
    settings: Settings,
    service: str | None,
    user_exporters: list[SpanExporter],
    user_readers: list[MetricReader],
    traces_path: str | os.PathLike[str] | None,
    environ: Mapping[str, str],
) -> _ExportPlan:
    spans = None if user_exporters else span_selection(environ) or EMBEDDED_DEFAULT
    metrics = None if user_readers else metric_selection(environ)
    if metrics is None and not user_readers and files_for_metrics(spans):
        metrics = EMBEDDED_DEFAULT
    metrics_path = metrics_beside(Path(traces_path)) if traces_path else None
    plan = _ExportPlan(user_exporters, user_readers, spans, metrics, traces_path, service, metrics_path)
    if not settings.export_process:  # built here, the exporter process's share too
        if spans is not None:
            plan.app_exporters = span_exporters(spans, plan.process_traces_path(), path_factory=plan.traces_factory)
        if metrics is not None:
            plan.app_readers = metric_readers(metrics, plan.process_metrics_path(), path_factory=plan.metrics_factory)
        plan.built_here = True
    return plan


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
    spans: Selection | None,
    metrics: Selection | None,
    traces_path: Path,
    metrics_path: Path,
    return_spans: bool,
    return_metrics: bool,
    return_verdicts: bool,
) -> dict[str, Any]:
    """What a new exporter process needs, computed in the process it serves: a forked worker's exporter
    describes that worker (the provider refreshes ``process.pid`` after a fork) and writes its own files.
    The exporters are named, as the application read them, not read again from the exporter's own
    environment (where a distro's defaults would be)."""
    return {
        "settings": plain(settings.to_dict()),
        "resource": plain(dict(tracer_provider.resource.attributes)),
        "spans": None if spans is None else [list(spans.names), spans.protocol],
        "metrics": None if metrics is None else [list(metrics.names), metrics.protocol],
        "traces_path": str(traces_path),
        "metrics_path": str(metrics_path),
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
    environ: Mapping[str, str] | None = None,
) -> StagetraceHandle:
    """Put stagetrace in front of an existing SDK TracerProvider's processors (a user's distro, configurator
    or own setup): their exporters then receive the verdict-bearing roots and the stage spans. Nothing of
    theirs is replaced; ``handle.shutdown()`` restores the processors as they were.

    ``environ`` (the zero-code path: the user's variables, ``destinations.env.users_environment``): what a
    distro built from its own defaults rather than the user's choice, and stagetrace's own JSON lines
    exporters, move to stagetrace (``destinations.distro``): it writes the JSON lines files itself."""
    chain = ProcessorChain(tracer_provider)
    settings = settings or Settings(slow_threshold_ms=slow_threshold_from_env())
    settings.validate()
    callbacks = _as_list(on_verdict)
    downstream = SynchronousMultiSpanProcessor()
    meters = meter_provider or metrics_api.get_meter_provider()
    with chain.locked():
        takeover = plan_takeover(chain.processors, meter_provider_readers(meters), environ or os.environ, os.environ)
        set_processors(downstream, takeover.kept_processors)
        chain.processors = takeover.kept_processors
    for taken in takeover.taken_processors:
        taken.shutdown()
    readers_left = len(meter_provider_readers(meters)) - len(takeover.taken_readers)
    for reader in takeover.taken_readers:
        if not detach_metric_reader(meters, reader):
            readers_left += 1  # it stays where it is
    service = tracer_provider.resource.attributes.get(SERVICE_NAME)
    plan = _ExportPlan(
        [],
        [],
        EMBEDDED_DEFAULT if takeover.spans_file else None,
        EMBEDDED_DEFAULT if takeover.metrics_file else None,
        takeover.traces_path,
        service if isinstance(service, str) else None,
        takeover.metrics_path,
    )
    local_metrics = readers_left > 0 or not isinstance(meters, MeterProvider)  # a provider not the SDK's: as before
    if not settings.export_process:  # the files written here, beside the provider's own exporters
        if plan.spans is not None:
            for exporter in span_exporters(plan.spans, plan.process_traces_path(), path_factory=plan.traces_factory):
                downstream.add_span_processor(BatchSpanProcessor(exporter))
        add_reader = getattr(meters, "add_metric_reader", None)  # the SDK's, 1.4x on
        if plan.metrics is not None and callable(add_reader):
            for reader in metric_readers(plan.metrics, plan.process_metrics_path(), path_factory=plan.metrics_factory):
                add_reader(reader)
                local_metrics = True
        plan.built_here = True

    def exporter_config() -> dict[str, Any]:
        spans, metrics = plan.for_exporter_process()
        return _exporter_config(
            tracer_provider,
            settings,
            spans=spans,
            metrics=metrics,
            traces_path=plan.process_traces_path(),
            metrics_path=plan.process_metrics_path(),
            return_spans=bool(processors_of(downstream)),
            return_metrics=local_metrics,
            return_verdicts=bool(callbacks),
        )

    runtime = Runtime(
        tracer_provider=tracer_provider,
        meter_provider=meters,
        local=downstream,
        local_metrics=local_metrics,
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
    handle = StagetraceHandle(
        runtime, tracer_provider, meter_provider, plan.file_path, detach=detach, metrics_path=plan.metrics_file_path
    )
    _replace_handle(handle)
    _state.runtime = runtime
    _trace_process_pools(runtime.settings)
    if plan.file_path is not None:
        logger.info("stagetrace: writing OTLP JSON lines to %s", plan.file_path)
    return handle


def _trace_process_pools(settings: Settings) -> None:
    if settings.process_pools:
        from stagetrace.integrations.processes import trace_process_pools

        trace_process_pools()


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
