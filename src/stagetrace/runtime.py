"""Wires the application-side parts for one configured process: the registry of traces in flight, the span
processor, the helper thread and its transport to the exporter, the samplers, and the consumers that live
in the application (exporter objects, metric readers, ``on_verdict``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

from stagetrace._compat import detach_metric_reader
from stagetrace._safety import report_internal_error
from stagetrace._version import __version__
from stagetrace.analysis import Verdict
from stagetrace.capture.cpu import CpuSignals
from stagetrace.capture.loopblocks import LoopBlockBuffer
from stagetrace.capture.monitors import GilPressureMonitor, LoopLagMonitor
from stagetrace.capture.registry import TraceRegistry
from stagetrace.conventions import INSTRUMENTATION_NAME
from stagetrace.exporter.aggregation import AggregatedMetrics
from stagetrace.exporter.core import ExporterCore
from stagetrace.exporter.metrics import MetricsRecorder, MetricsSink, SdkInstruments
from stagetrace.exporter.outputs import LocalOutputs, NoMetrics, SpanForwarder
from stagetrace.exporter.signals import (
    GIL_SERIES,
    IN_FLIGHT_SERIES,
    LOOP_HELD_SERIES,
    LOOP_SERIES,
    PROCESS_CPU_SERIES,
    PROCESS_RUN_QUEUE_SERIES,
    RUN_QUEUE_SERIES,
)
from stagetrace.handoff.processor import StagetraceSpanProcessor
from stagetrace.handoff.shipper import Shipper, Transport
from stagetrace.handoff.transport import InlineTransport, ProcessTransport
from stagetrace.settings import Settings

ExporterConfig = Callable[[], dict[str, Any]]


class Runtime:
    """``local``: the span processor for exporters that live in the application (None: all export happens
    in the exporter). ``exporter_config``: what the exporter process builds (its own exporters and metric
    readers, what to send back); unused with ``Settings(export_process=False)``, where the exporter's work
    runs on the helper thread against the application's own processors and readers."""

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider,
        meter_provider: Any,
        local: SpanProcessor | None,
        local_metrics: bool,
        settings: Settings,
        metric_readers: Sequence[MetricReader] = (),
        on_verdict: Sequence[Callable[[Verdict], Any]] = (),
        exporter_config: ExporterConfig | None = None,
        install: bool = True,
    ) -> None:
        """``install=False``: the caller puts ``self.processor`` in front of the provider's processors.
        ``metric_readers``: the readers of ``meter_provider``, already registered with it, when stagetrace
        built it: they collect stagetrace's own aggregation; otherwise (``local_metrics`` on a provider it did
        not build) the metrics are the SDK's instruments on its meter."""
        self.settings = settings
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self._local_spans = local  # the application's own span exporters' processor, if any
        self._metric_readers = tuple(metric_readers)
        self.metrics = MetricsRecorder()  # metric events raised in the application, shipped to the exporter
        self.registry = TraceRegistry(settings.max_traces_in_flight, settings.trace_ttl_s, self.metrics.dropped)
        app_metrics: MetricsSink = NoMetrics()
        if metric_readers:
            aggregated = AggregatedMetrics(tracer_provider.resource, settings.max_stage_names)
            aggregated.attach_readers(metric_readers)
            app_metrics = aggregated
        elif local_metrics:
            meter = meter_provider.get_meter(INSTRUMENTATION_NAME, __version__)
            app_metrics = SdkInstruments(meter, settings.max_stage_names)
        self.local = LocalOutputs(
            spans=SpanForwarder(local, tracer_provider.resource, app_metrics.dropped) if local is not None else None,
            metrics=app_metrics,
            callbacks=on_verdict,
        )
        self.exporter_config = exporter_config
        self.gil_sampler = None
        if settings.gil_sampler_period_s:
            in_flight = self.registry.count_function()
            self.gil_sampler = GilPressureMonitor(settings.gil_sampler_period_s, in_flight=in_flight)
            self.registry.idle_wake = self.gil_sampler.wake
        self.loop_monitor = LoopLagMonitor(settings.loop_lag_interval_s, gil_wait_bound_s=settings.gil_wait_bound_s)
        sources: dict[str, Any] = {LOOP_SERIES: self.loop_monitor.series, LOOP_HELD_SERIES: self.loop_monitor.held}
        if self.gil_sampler is not None:
            sources[GIL_SERIES] = self.gil_sampler.series
            sources[RUN_QUEUE_SERIES] = self.gil_sampler.run_queue
            sources[PROCESS_RUN_QUEUE_SERIES] = self.gil_sampler.process_run_queue
            sources[PROCESS_CPU_SERIES] = self.gil_sampler.process_cpu
            sources[IN_FLIGHT_SERIES] = self.gil_sampler.in_flight
        self.loop_blocks = LoopBlockBuffer()
        self.requests_on_loop = self.registry.on_loop
        self.shipper = Shipper(
            settings=settings,
            transport_factory=self._transport,
            app_metrics=self.metrics,
            registry=self.registry,
            signal_sources=sources,
            loop_blocks=self.loop_blocks,
            before_signals=self.gil_sampler.note_process_totals if self.gil_sampler is not None else None,
            signals_cover=self.gil_sampler.covers if self.gil_sampler is not None else None,
        )
        self.processor = StagetraceSpanProcessor(
            registry=self.registry,
            shipper=self.shipper,
            local=local,
            shutdown_timeout_s=settings.shutdown_timeout_s,
        )
        if install:
            tracer_provider.add_span_processor(self.processor)
        self.tracer = tracer_provider.get_tracer(INSTRUMENTATION_NAME, __version__)
        self.max_stages_per_trace = settings.max_stages_per_trace
        self.lookup_trace = self.registry.lookup_function()
        self.gpu: Any = None  # GpuSupport, when attached
        self.cpu_signals = CpuSignals() if settings.cpu_signals else None
        self.recent_stage_ms: dict[str, float] = {}  # per stage name, for adaptive CPU accounting
        if self.gil_sampler is not None:
            self.gil_sampler.ensure_running()  # warm before the first request; restarted after a fork
            self.shipper.on_thread_start.append(self.gil_sampler.ensure_running)
        self.shipper.start()  # the exporter starts now, not on the first request

    @property
    def exporter_pid(self) -> int | None:
        proc = getattr(self.shipper.transport, "proc", None)
        return proc.pid if proc is not None else None  # after a fork: None until this process starts its own

    def _transport(self, shipper: Shipper) -> Transport:
        if self.settings.export_process and self.exporter_config is not None:
            return ProcessTransport(
                shipper,
                settings=self.settings,
                config=self.exporter_config,
                local=self.local,
                app_metrics=self.metrics,
            )
        return InlineTransport(shipper, ExporterCore(self.settings, self.local))

    def stand_down(self) -> None:
        """In a process pool's worker forked from this process: nothing here ships, samples or exports (the
        worker's calls report to the parent through their results, ``capture/worker.py``). The SDK's own
        export threads for the exporters and readers that live in the application (a ``span_exporter`` or
        ``metric_reader`` given to ``configure()``, or no exporter process) were restarted in the worker by
        OpenTelemetry's at-fork hooks: they are shut down here, exporting nothing (the span queue was emptied
        at the fork; a reader's last collection is made a no-op: the worker would send copies of the parent's
        metrics)."""
        self.shipper.stand_down()
        if self.gil_sampler is not None:
            self.gil_sampler.stop()  # its thread did not survive the fork; this keeps it from restarting
        try:
            if self._local_spans is not None:
                self._local_spans.shutdown()
            for reader in self._metric_readers:
                detach_metric_reader(self.meter_provider, reader)
        except Exception:
            report_internal_error("standing down the SDK's export threads in a worker")

    def shutdown_samplers(self) -> None:
        if self.gil_sampler is not None:
            self.gil_sampler.stop()
        if self.gpu is not None:
            self.gpu.shutdown()
