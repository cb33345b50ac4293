"""Which exporters the ``OTEL_*`` variables select (destinations/env.py), as the OpenTelemetry specification
defines them: names, separators and case, the default protocol and the per-signal overrides, and the
errors that name what is wrong; and what of them the user chose where a distro set defaults first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

from stagetrace.destinations.env import (
    DISTRO_DEFAULTS_VARIABLE,
    EXPORT_VARIABLES,
    Selection,
    inherited_defaults,
    metric_readers,
    metric_selection,
    parse_environ,
    remember_distro_defaults,
    set_since_start,
    span_exporters,
    span_selection,
    starting_environment,
    users_environment,
)
from stagetrace.destinations.files import JsonLinesMetricExporter, JsonLinesSpanExporter

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


def span_exporters_from_env(path=None):
    selection = span_selection()
    return None if selection is None else span_exporters(selection, path or Path("traces.jsonl"))


def metric_readers_from_env(path=None):
    selection = metric_selection()
    return None if selection is None else metric_readers(selection, path or Path("metrics.jsonl"))


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
    assert span_selection() is None and metric_selection() is None


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
    assert (span_selection() is not None) is (expected is not None)


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
        ({"OTEL_METRICS_EXPORTER": "file"}, [JsonLinesMetricExporter]),
        ({"OTEL_METRICS_EXPORTER": "none"}, []),
    ],
)
def test_metric_readers(env, expected, monkeypatch):
    assert reader_exporter_types(monkeypatch, env) == expected
    assert (metric_selection() is not None) is (expected is not None)


def test_unknown_names_and_protocols_are_errors_that_say_what_to_use(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(
        ValueError, match=r"^OTEL_TRACES_EXPORTER: unknown exporter 'zipkin' \(use otlp, console, file, none\)$"
    ):
        span_exporters_from_env()
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    with pytest.raises(
        ValueError, match=r"^OTEL_METRICS_EXPORTER: unknown exporter 'prometheus' \(use otlp, console, file, none\)$"
    ):
        metric_selection()
    monkeypatch.delenv("OTEL_METRICS_EXPORTER")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://x:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "thrift")
    expected = r"^OTEL_EXPORTER_OTLP_PROTOCOL must be one of grpc, http/protobuf; got 'thrift'$"
    with pytest.raises(ValueError, match=expected):
        span_selection()
    metric_selection()  # the traces' own protocol does not concern metrics


@pytest.mark.parametrize("signal", ["TRACES", "METRICS"])
def test_a_signals_own_protocol_variable_is_checked_by_every_entry_point_of_that_signal_only(monkeypatch, signal):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://x:4317")
    monkeypatch.setenv(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "thrift")
    own, other = (span_selection, metric_selection) if signal == "TRACES" else (metric_selection, span_selection)
    with pytest.raises(ValueError, match="got 'thrift'"):
        own()
    assert other() == Selection(("otlp",), "http/protobuf")


def test_none_beside_another_metric_exporter_keeps_the_other(monkeypatch):
    assert reader_exporter_types(monkeypatch, {"OTEL_METRICS_EXPORTER": "none,console"}) == [ConsoleMetricExporter]


def test_the_file_exporters_write_where_the_application_said(tmp_path):
    """The path is the application's (named after its pid), whichever process builds the exporter."""
    given = tmp_path / "traces-ranker-42.jsonl"
    (exporter,) = span_exporters(Selection(("file",)), given)
    (reader,) = metric_readers(Selection(("file",)), tmp_path / "metrics-ranker-42.jsonl")
    try:
        assert exporter.path == given and reader._exporter.path == tmp_path / "metrics-ranker-42.jsonl"
    finally:
        exporter.shutdown()
        reader.shutdown()


def test_built_with_no_argument_the_files_are_named_after_the_service_and_this_process(monkeypatch, tmp_path):
    """As OpenTelemetry's configurator builds them from ``OTEL_*_EXPORTER=file``."""
    monkeypatch.setenv("STAGETRACE_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("OTEL_SERVICE_NAME", "ranker")
    assert JsonLinesSpanExporter().path == tmp_path / f"traces-ranker-{os.getpid()}.jsonl"
    assert JsonLinesMetricExporter().path == tmp_path / f"metrics-ranker-{os.getpid()}.jsonl"


def test_variables_set_after_the_start_are_a_distros_not_the_users(monkeypatch):
    """A distro's defaults are set in os.environ after the process started; the user's were there at the
    start (in the environment, or from ``opentelemetry-instrument``'s options)."""
    start = {"OTEL_METRICS_EXPORTER": "console", "OTEL_SERVICE_NAME": "ranker"}
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")  # the distro's default
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")  # the distro's default
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "console")  # the user's
    assert set_since_start(start) == {"OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL"}
    users = users_environment(start)
    assert "OTEL_TRACES_EXPORTER" not in users and users["OTEL_METRICS_EXPORTER"] == "console"
    assert span_selection(users) is None and metric_selection(users) == Selection(("console",))
    assert set_since_start({**start, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == set()


def test_a_worker_started_with_the_distros_defaults_still_knows_them_for_defaults(monkeypatch):
    """A process manager's workers (``uvicorn --workers``, gunicorn) start with the values the distro set in
    the first process already in their environment: the first process records them, variable and value, and
    a worker takes a variable for the user's only where the record does not name it or its value differs."""
    for var in EXPORT_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(DISTRO_DEFAULTS_VARIABLE, "")  # no record yet; removed again at the end
    first_start = {"OTEL_METRICS_EXPORTER": "otlp"}  # the user's, the same value as the distro's default
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")  # the distro's
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")  # the distro's
    distros = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    assert remember_distro_defaults(first_start) == distros
    assert json.loads(os.environ[DISTRO_DEFAULTS_VARIABLE]) == distros == inherited_defaults()

    worker_start = dict(os.environ)  # a worker: all of it inherited, the record too
    users = users_environment(worker_start)
    assert span_selection(users) is None  # not the user's: the embedded default, as in the first process
    assert metric_selection(users) == Selection(("otlp",), "http/protobuf")  # the user's, the protocol not
    assert DISTRO_DEFAULTS_VARIABLE not in users
    assert remember_distro_defaults(worker_start) == distros  # handed on to the worker's own children

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")  # the user's, set before starting the worker
    assert span_selection(users_environment(dict(os.environ))) == Selection(("console",))

    for record in ("not json", "[1]", '{"OTEL_TRACES_EXPORTER": 1}', '{"OTEL_SERVICE_NAME": "x"}'):
        monkeypatch.setenv(DISTRO_DEFAULTS_VARIABLE, record)  # not a record: every variable is the user's
        assert inherited_defaults() == {}
        assert users_environment(dict(os.environ))["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"

    monkeypatch.setenv(DISTRO_DEFAULTS_VARIABLE, json.dumps(distros))
    for var in distros:
        monkeypatch.delenv(var)
    assert remember_distro_defaults(dict(os.environ)) == {}  # none left: no record for the children
    assert DISTRO_DEFAULTS_VARIABLE not in os.environ


def test_the_starting_environment_is_what_the_process_began_with():
    probe = (
        "import os, json; from stagetrace.destinations.env import starting_environment; "
        "os.environ['LATER'] = '1'; start = starting_environment(); "
        "print(json.dumps([start.get('EARLY'), 'LATER' in start]))"
    )
    env = {**os.environ, "EARLY": "yes"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == ["yes", False]
    assert starting_environment() is not None  # Linux: /proc/self/environ


def test_the_environ_files_entries_are_split_on_nuls_and_their_first_equals_sign():
    raw = b"OTEL_RESOURCE_ATTRIBUTES=a=1,b=2\0EMPTY=\0NO_SIGN\0PATH=/usr/bin\0"
    assert parse_environ(raw) == {"OTEL_RESOURCE_ATTRIBUTES": "a=1,b=2", "EMPTY": "", "PATH": "/usr/bin"}
    assert parse_environ(b"") == {}
    assert parse_environ("CAF\u00c9=\u00e9t\u00e9\0".encode()) == {"CAF\u00c9": "\u00e9t\u00e9"}


def test_without_a_starting_environment_given_the_processes_own_is_read(monkeypatch):
    start = starting_environment()
    if start is None or "OTEL_TRACES_EXPORTER" in start:
        pytest.skip("needs /proc/self/environ without OTEL_TRACES_EXPORTER")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")  # set after the start, as a distro does
    assert "OTEL_TRACES_EXPORTER" in set_since_start()


def test_a_file_exporter_built_for_a_forked_child_asks_its_path_again(tmp_path, monkeypatch):
    """The application computes the file's path (named after its pid) and hands the exporter a factory for
    the path a forked child must use; the exporter asks it once its pid has changed."""
    import stagetrace.destinations.files as files

    parent, child = tmp_path / "traces-1.jsonl", tmp_path / "traces-2.jsonl"
    (spans,) = span_exporters(Selection(("file",)), parent, path_factory=lambda: child)
    metrics_child = tmp_path / "m-2.jsonl"
    (reader,) = metric_readers(Selection(("file",)), tmp_path / "m-1.jsonl", path_factory=lambda: metrics_child)
    try:
        assert spans.path == parent
        real_pid = os.getpid()
        monkeypatch.setattr(files.os, "getpid", lambda: real_pid + 1)  # as in the child after fork()
        spans._lines.write(b"{}\n")
        assert spans.path == child and child.read_bytes() == b"{}\n" and not parent.exists()
        from stagetrace._compat import metric_exporter_of

        metrics = metric_exporter_of(reader)
        metrics._lines.write(b"{}\n")
        assert metrics_child.read_bytes() == b"{}\n"
    finally:
        monkeypatch.undo()
        reader.shutdown()
