"""Exporters from the standard ``OTEL_*`` variables. Returns None when nothing is configured, so that
stagetrace can fall back to its embedded default instead of retrying a collector that is not there."""

from __future__ import annotations

import os
from pathlib import Path

from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter

_TRACE_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_METRIC_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
PROTOCOLS = ("grpc", "http/protobuf")


def _names(var: str, endpoint_vars: tuple[str, ...]) -> list[str] | None:
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return ["otlp"] if any(os.environ.get(v) for v in endpoint_vars) else None
    return [n.strip().lower() for n in raw.split(",") if n.strip()]


def _protocol(signal: str) -> str:
    raw = (
        os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip() or "http/protobuf"  # the specification's default
    if raw not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be one of {', '.join(PROTOCOLS)}; got {raw!r}")
    return raw


_SPAN_EXPORTERS = ("otlp", "console", "file", "stagetrace_file", "none")
_METRIC_EXPORTERS = ("otlp", "console", "none")


def _checked_names(var: str, endpoint_vars: tuple[str, ...], known: tuple[str, ...], signal: str) -> list[str] | None:
    names = _names(var, endpoint_vars)
    for name in names or ():
        if name not in known:
            raise ValueError(
                f"{var}: unknown exporter {name!r} (use {', '.join(k for k in known if k != 'stagetrace_file')})"
            )
        if name == "otlp":
            _protocol(signal)
    return names


def span_export_from_env() -> bool:
    """Do the ``OTEL_*`` variables configure trace export? Checks them (a clear error for a bad value, in
    the application, at ``configure()``) without building an exporter."""
    return _checked_names("OTEL_TRACES_EXPORTER", _TRACE_ENDPOINT_VARS, _SPAN_EXPORTERS, "TRACES") is not None


def metric_export_from_env() -> bool:
    return _checked_names("OTEL_METRICS_EXPORTER", _METRIC_ENDPOINT_VARS, _METRIC_EXPORTERS, "METRICS") is not None


def span_exporters_from_env(file_path: Path | None = None) -> list[SpanExporter] | None:
    """``file_path``: where the ``file`` exporter writes (default: ``default_traces_path`` for this process)."""
    names = _checked_names("OTEL_TRACES_EXPORTER", _TRACE_ENDPOINT_VARS, _SPAN_EXPORTERS, "TRACES")
    if names is None:
        return None
    exporters: list[SpanExporter] = []
    for name in names:  # "none" adds nothing
        if name == "otlp":
            if _protocol("TRACES") == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans

                exporters.append(GrpcSpans())
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans

                exporters.append(HttpSpans())
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name in ("file", "stagetrace_file"):
            from stagetrace.destinations.files import JsonLinesSpanExporter, default_traces_path

            path = file_path or default_traces_path(os.environ.get("OTEL_SERVICE_NAME"))
            exporters.append(JsonLinesSpanExporter(path))
    return exporters


def metric_readers_from_env() -> list[MetricReader] | None:
    names = _checked_names("OTEL_METRICS_EXPORTER", _METRIC_ENDPOINT_VARS, _METRIC_EXPORTERS, "METRICS")
    if names is None:
        return None
    readers: list[MetricReader] = []
    for name in names:  # "none" adds nothing
        if name == "otlp":
            if _protocol("METRICS") == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics

                readers.append(PeriodicExportingMetricReader(GrpcMetrics()))
            else:
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics

                readers.append(PeriodicExportingMetricReader(HttpMetrics()))
        elif name == "console":
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
    return readers
