"""Faults and bad input: a collector that is down, slow or comes back; shutdown within a deadline; drops
counted; fuzzed OTLP input; attribute values too large; stages never closed."""

from __future__ import annotations

import gc
import io
import json
import os
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import stagetrace
from conftest import both_modes
from stagetrace import conventions as c
from stagetrace.report.loader import MalformedLine, read_traces, spans_from_line
from stagetrace.settings import Settings
from stagetrace.testing import OtlpReceiver

export_mode = both_modes  # every test here runs with the exporter in a process and on a thread

OTEL_VARS = [k for k in os.environ if k.startswith("OTEL_")]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in OTEL_VARS:
        monkeypatch.delenv(k, raising=False)


def reserved_port() -> int:
    """A port nothing listens on (connections are refused) that a receiver can bind later."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grpc_to(monkeypatch, port: int, timeout_s: int) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", str(timeout_s))
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")


def run_pipelines(n: int, tag: str = "r") -> None:
    for _ in range(n):
        with stagetrace.pipeline(tag), stagetrace.stage("decode"):
            pass


@pytest.mark.slow
def test_collector_down_verdicts_still_flow_and_shutdown_meets_its_deadline(monkeypatch):
    grpc_to(monkeypatch, reserved_port(), timeout_s=30)  # the exporter alone would retry for 30 s
    verdicts = []
    handle = stagetrace.configure(
        "down", on_verdict=verdicts.append, set_global=False, settings=Settings(shutdown_timeout_s=1.0)
    )
    run_pipelines(50)
    handle.force_flush(1)  # the export part cannot succeed; the verdicts arrive before it is tried
    assert len(verdicts) == 50  # analysis does not depend on export
    t0 = time.monotonic()
    handle.shutdown()
    assert time.monotonic() - t0 < 15  # bounded by the deadline, not by the exporter's retries


@pytest.mark.slow
def test_export_resumes_when_the_collector_comes_back(monkeypatch):
    port = reserved_port()
    grpc_to(monkeypatch, port, timeout_s=1)
    handle = stagetrace.configure("flaky", set_global=False, settings=Settings(shutdown_timeout_s=2.0))
    receiver = None
    try:
        run_pipelines(10, "while-down")
        handle.force_flush(5)  # fails: nothing listens
        receiver = OtlpReceiver(grpc_port=port).start()
        # gRPC reconnects with a backoff, and the SDK drops a batch that failed rather than retrying it:
        # keep the traffic going until new traces arrive.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            run_pipelines(10, "after-return")
            handle.force_flush(5)
            if sum(1 for s in receiver.sink.spans if s.name == "after-return") >= 10:
                break
            time.sleep(0.5)
        roots = [s for s in receiver.sink.spans if s.name == "after-return"]
        assert len(roots) >= 10
        assert all(c.BOTTLENECK_STAGE in r.attributes for r in roots)
    finally:
        handle.shutdown()
        if receiver is not None:
            receiver.stop()


@pytest.mark.slow
def test_a_slow_collector_fills_the_export_queue_and_the_drops_are_counted(monkeypatch):
    receiver = OtlpReceiver(export_delay_s=2.0).start()
    try:
        grpc_to(monkeypatch, receiver.grpc_port, timeout_s=10)
        monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "20")
        monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "10")
        reader = InMemoryMetricReader()
        verdicts = []
        handle = stagetrace.configure(
            "slow",
            metric_reader=reader,
            on_verdict=verdicts.append,
            set_global=False,
            settings=Settings(shutdown_timeout_s=1.0),
        )
        run_pipelines(200)
        handle.force_flush(10)
        assert len(verdicts) == 200  # nothing lost but spans the full export queue could not take
        data = reader.get_metrics_data()
        dropped = sum(
            p.value
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.name == c.METRIC_DROPPED
            for p in m.data.data_points
            if p.attributes[c.DROP_REASON] == "export_queue_full"
        )
        assert dropped > 0
        handle.shutdown()
    finally:
        receiver.stop()


def test_attribute_values_too_large_or_of_bad_types_are_contained(harness):
    with stagetrace.pipeline("p"), stagetrace.stage("s") as s:
        s.set_attribute("huge", "x" * 1_000_000)
        s.set_attribute("obj", object())
        s.set_attribute("nested", [[1, 2], 3])
        s.set_attribute(42, "bad key")
        for i in range(500):
            s.set_attribute(f"k{i}", i)
    (span,) = harness.by_name("s")
    assert len(span.attributes["huge"]) == 4096
    assert "obj" not in span.attributes and "nested" not in span.attributes
    assert sum(1 for k in span.attributes if k.startswith("k")) < 100  # capped


def test_stages_never_closed_are_contained(harness):
    def generator():
        with stagetrace.stage("streamed"):
            yield 1
            yield 2

    with stagetrace.pipeline("p"):
        g = generator()
        next(g)  # the stage opened and never closes: the generator is abandoned
    del g
    gc.collect()
    with stagetrace.pipeline("after"), stagetrace.stage("fine"):
        pass
    names = [s.name for s in harness.spans()]
    assert "fine" in names and "after" in names  # later traces are unaffected
    assert [v.root_name for v in harness.verdicts] == ["p", "after"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.text(max_size=200),
        json_values.map(json.dumps),
        st.dictionaries(st.just("resourceSpans"), json_values).map(json.dumps),
    )
)
def test_the_otlp_reader_never_crashes_on_any_line(line):
    try:
        spans = spans_from_line(line)
    except MalformedLine:
        return
    assert isinstance(spans, list)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(max_size=80), min_size=1, max_size=20))
def test_malformed_lines_are_reported_with_file_and_line_and_the_rest_is_used(tmp_path_factory, lines):
    good = json.dumps(
        {
            "resourceSpans": [
                {
                    "scopeSpans": [
                        {
                            "spans": [
                                {
                                    "traceId": "0" * 31 + "1",
                                    "spanId": "0" * 15 + "1",
                                    "name": "root",
                                    "startTimeUnixNano": "1",
                                    "endTimeUnixNano": "2",
                                }
                            ]
                        }
                    ]
                }
            ]
        }
    )
    path = tmp_path_factory.mktemp("fuzz") / "t.jsonl"
    path.write_text("\n".join([*lines, good]) + "\n")
    err, traces = io.StringIO(), []
    counts = read_traces([path], traces.append, errors=err)
    assert len(traces) == 1 and traces[0][0].name == "root"
    for ln in err.getvalue().splitlines():
        assert ln.startswith(f"{path}:")
    assert counts["malformed"] == len(err.getvalue().splitlines())
