"""Wires the parts for one configured process: registry, finalizer, processor, metrics, tracer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

from stagetrace._version import __version__
from stagetrace.analysis import Verdict
from stagetrace.capture.cpu import CpuSignals, CpuSignalSources, GilPressureSampler, LoopLagMonitor
from stagetrace.capture.registry import TraceRegistry
from stagetrace.conventions import INSTRUMENTATION_NAME
from stagetrace.finalize.finalizer import Finalizer
from stagetrace.finalize.metrics import StagetraceMetrics
from stagetrace.finalize.processor import StagetraceSpanProcessor
from stagetrace.settings import Settings


class Runtime:
    def __init__(
        self,
        *,
        tracer_provider: TracerProvider,
        meter_provider: MeterProvider,
        downstream: SpanProcessor,
        settings: Settings,
        on_verdict: Sequence[Callable[[Verdict], Any]] = (),
        install: bool = True,
    ) -> None:
        """``install=False``: the caller puts ``self.processor`` in front of the provider's processors."""
        self.settings = settings
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.metrics = StagetraceMetrics(
            meter_provider.get_meter(INSTRUMENTATION_NAME, __version__), settings.max_stage_names
        )
        self.registry = TraceRegistry(settings.max_traces_in_flight, settings.trace_ttl_s, self.metrics.dropped)
        self.finalizer = Finalizer(
            downstream=downstream,
            metrics=self.metrics,
            settings=settings,
            resource=tracer_provider.resource,
            registry=self.registry,
            on_verdict=on_verdict,
        )
        self.processor = StagetraceSpanProcessor(
            registry=self.registry,
            finalizer=self.finalizer,
            downstream=downstream,
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
        self.gil_sampler = GilPressureSampler(settings.gil_sampler_period_s) if settings.gil_sampler_period_s else None
        self.loop_monitor = LoopLagMonitor(settings.loop_lag_interval_s)
        if self.gil_sampler is not None:
            self.gil_sampler.ensure_running()  # warm before the first request; restarted after a fork
            self.finalizer.on_thread_start.append(self.gil_sampler.ensure_running)
        self.finalizer.signal_sources["cpu"] = CpuSignalSources(self.gil_sampler, self.loop_monitor)

    def shutdown_samplers(self) -> None:
        if self.gil_sampler is not None:
            self.gil_sampler.stop()
        if self.gpu is not None:
            self.gpu.shutdown()
