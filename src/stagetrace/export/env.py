"""Exporters from the standard ``OTEL_*`` variables. Returns None when nothing is configured, so that
stagetrace can fall back to its embedded default instead of retrying a collector that is not there."""

from __future__ import annotations

import os

from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter

_TRACE_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_METRIC_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
PROTOCOLS = ("grpc", "http/protobuf")


def _names(var: str, endpoint_vars: tuple[str, ...]) -> list[str] | None:
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        if not any(os.environ.get(v) for v in endpoint_vars):
            return None
        raw = "otlp"
    return [n.strip().lower() for n in raw.split(",") if n.strip()]


def _protocol(signal: str) -> str:
    raw = (
        os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip() or "http/protobuf"  # the specification's default
    if raw not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be one of {', '.join(PROTOCOLS)}; got {raw!r}")
    return raw


def span_exporters_from_env() -> list[SpanExporter] | None:
    names = _names("OTEL_TRACES_EXPORTER", _TRACE_ENDPOINT_VARS)
    if names is None:
        return None
    exporters: list[SpanExporter] = []
    for name in names:
        if name == "none":
            continue
        if name == "otlp":
            if _protocol("TRACES") == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporters.append(OTLPSpanExporter())
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name in ("file", "stagetrace_file"):
            from stagetrace.export.files import JsonLinesSpanExporter, default_traces_path

            exporters.append(JsonLinesSpanExporter(default_traces_path(os.environ.get("OTEL_SERVICE_NAME"))))
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (use otlp, console, file or none)")
    return exporters


def metric_readers_from_env() -> list[MetricReader] | None:
    names = _names("OTEL_METRICS_EXPORTER", _METRIC_ENDPOINT_VARS)
    if names is None:
        return None
    readers: list[MetricReader] = []
    for name in names:
        if name == "none":
            continue
        if name == "otlp":
            if _protocol("METRICS") == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        elif name == "console":
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        else:
            raise ValueError(f"OTEL_METRICS_EXPORTER: unknown exporter {name!r} (use otlp, console or none)")
    return readers
