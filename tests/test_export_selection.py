"""Which exporters the ``OTEL_*`` variables select (destinations/env.py), as the OpenTelemetry specification
defines them: names, separators and case, the default protocol and the per-signal overrides, and the
errors that name what is wrong."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

from stagetrace.destinations.env import (
    metric_export_from_env,
    metric_readers_from_env,
    span_export_from_env,
    span_exporters_from_env,
)
from stagetrace.destinations.files import JsonLinesSpanExporter

VARS = (
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)


def span_types(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    exporters = span_exporters_from_env()
    try:
        return None if exporters is None else [type(e) for e in exporters]
    finally:
        for e in exporters or ():
            e.shutdown()


def reader_exporter_types(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    readers = metric_readers_from_env()
    try:
        return None if readers is None else [type(r._exporter) for r in readers]
    finally:
        for r in readers or ():
            r.shutdown()


def test_nothing_configured_selects_nothing():
    assert span_exporters_from_env() is None and metric_readers_from_env() is None
    assert span_export_from_env() is False and metric_export_from_env() is False


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, [HttpSpans]),  # the default protocol
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, [HttpSpans]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, [GrpcSpans]),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",  # the signal's own variable wins
            },
            [GrpcSpans],
        ),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, [HttpSpans]),
        ({"OTEL_TRACES_EXPORTER": " CONSOLE , otlp "}, [ConsoleSpanExporter, HttpSpans]),
        ({"OTEL_TRACES_EXPORTER": "none"}, []),
        ({"OTEL_TRACES_EXPORTER": "none,console"}, [ConsoleSpanExporter]),
        ({"OTEL_TRACES_EXPORTER": "file"}, [JsonLinesSpanExporter]),
        ({"OTEL_TRACES_EXPORTER": "stagetrace_file"}, [JsonLinesSpanExporter]),
        ({"OTEL_TRACES_EXPORTER": " "}, None),  # blank, and no endpoint: nothing configured
    ],
)
def test_span_exporters(env, expected, tmp_path, monkeypatch):
    monkeypatch.setenv("STAGETRACE_OUTPUT_DIR", str(tmp_path))
    assert span_types(monkeypatch, env) == expected
    assert span_export_from_env() is (expected is not None)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, [HttpMetrics]),
        ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://127.0.0.1:4318/v1/metrics"}, [HttpMetrics]),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc"},
            [GrpcMetrics],
        ),
        ({"OTEL_METRICS_EXPORTER": "Console"}, [ConsoleMetricExporter]),
        ({"OTEL_METRICS_EXPORTER": "none"}, []),
    ],
)
def test_metric_readers(env, expected, monkeypatch):
    assert reader_exporter_types(monkeypatch, env) == expected
    assert metric_export_from_env() is (expected is not None)


def test_unknown_names_and_protocols_are_errors_that_say_what_to_use(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(
        ValueError, match=r"^OTEL_TRACES_EXPORTER: unknown exporter 'zipkin' \(use otlp, console, file, none\)$"
    ):
        span_exporters_from_env()
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    with pytest.raises(
        ValueError, match=r"^OTEL_METRICS_EXPORTER: unknown exporter 'prometheus' \(use otlp, console, none\)$"
    ):
        metric_export_from_env()
    monkeypatch.delenv("OTEL_METRICS_EXPORTER")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://x:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "thrift")
    expected = r"^OTEL_EXPORTER_OTLP_PROTOCOL must be one of grpc, http/protobuf; got 'thrift'$"
    with pytest.raises(ValueError, match=expected):
        span_export_from_env()
    metric_export_from_env()  # the traces' own protocol does not concern metrics


@pytest.mark.parametrize("signal", ["TRACES", "METRICS"])
def test_a_signals_own_protocol_variable_is_checked_by_every_entry_point_of_that_signal_only(monkeypatch, signal):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://x:4317")
    monkeypatch.setenv(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "thrift")
    own, other = (
        [(span_export_from_env, span_exporters_from_env), (metric_export_from_env, metric_readers_from_env)]
        if signal == "TRACES"
        else [(metric_export_from_env, metric_readers_from_env), (span_export_from_env, span_exporters_from_env)]
    )
    for entry in own:
        with pytest.raises(ValueError, match="got 'thrift'"):
            entry()
    assert other[0]() is True


def test_none_beside_another_metric_exporter_keeps_the_other(monkeypatch):
    assert reader_exporter_types(monkeypatch, {"OTEL_METRICS_EXPORTER": "none,console"}) == [ConsoleMetricExporter]


def test_the_file_exporter_writes_under_the_service_name(monkeypatch, tmp_path):
    monkeypatch.setenv("STAGETRACE_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("OTEL_SERVICE_NAME", "ranker")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "file")
    (exporter,) = span_exporters_from_env()
    try:
        assert exporter.path.parent == tmp_path and exporter.path.name.startswith("traces-ranker-")
    finally:
        exporter.shutdown()
