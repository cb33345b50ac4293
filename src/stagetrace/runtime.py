"""Wires the parts for one configured process: registry, finalizer, processor, metrics, tracer."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

from stagetrace._version import __version__
from stagetrace.analysis import Verdict
from stagetrace.capture.registry import TraceRegistry
from stagetrace.conventions import INSTRUMENTATION_NAME
from stagetrace.finalize.finalizer import Finalizer
from stagetrace.finalize.metrics import StagetraceMetrics
from stagetrace.finalize.processor import StagetraceSpanProcessor
from stagetrace.settings import Settings

_getrandbits = random.getrandbits  # reseeded after fork by the random module itself


class Runtime:
    def __init__(
        self,
        *,
        tracer_provider: TracerProvider,
        meter_provider: MeterProvider,
        downstream: SpanProcessor,
        settings: Settings,
        on_verdict: Sequence[Callable[[Verdict], Any]] = (),
    ) -> None:
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
        tracer_provider.add_span_processor(self.processor)
        self.tracer = tracer_provider.get_tracer(INSTRUMENTATION_NAME, __version__)
        self.max_stages_per_trace = settings.max_stages_per_trace
        self.lookup_trace = self.registry.lookup_function()
        self.cpu_signals: Any = None  # set by the CPU-signal sampler when enabled
        self.gpu: Any = None  # GpuSupport, when attached

    @staticmethod
    def new_span_id() -> int:
        span_id = _getrandbits(64)
        while not span_id:
            span_id = _getrandbits(64)
        return span_id
