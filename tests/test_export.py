"""Export over the wire: OTLP gRPC and HTTP chosen from the standard OTEL_* variables, received by a real
OTLP server on 127.0.0.1; and the embedded default when nothing is configured."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

import stagetrace
from stagetrace import conventions as c

OTEL_VARS = [k for k in os.environ if k.startswith("OTEL_")]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in OTEL_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")


def run_pipeline():
    with stagetrace.pipeline("predict"):
        with stagetrace.stage("decode"):
            time.sleep(0.003)
        with stagetrace.stage("infer"):
            time.sleep(0.001)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_stage_spans_and_verdict_arrive_on_the_wire(protocol, otlp_receiver, monkeypatch):
    endpoint = otlp_receiver.grpc_endpoint if protocol == "grpc" else otlp_receiver.http_endpoint
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "wire-test")
    handle = stagetrace.configure("ignored-because-env-wins", set_global=False)
    try:
        assert handle.traces_path is None
        run_pipeline()
        handle.force_flush(10)
        sink = otlp_receiver.sink
        assert sink.wait_for(lambda s: len(s.spans) >= 3)
        spans = {s.name: s for s in sink.spans}
        root = spans["predict"]
        assert root.resource["service.name"] == "wire-test"
        # what the spans on the wire show (sleeps a loaded host stretches: 1 ms can outlast 3, and the root's
        # own time in no stage can outlast both)
        ms = {name: (spans[name].end_ns - spans[name].start_ns) / 1e6 for name in ("decode", "infer")}
        longest = max(ms, key=ms.__getitem__)
        expected = c.UNTRACKED if root.attributes[c.UNTRACKED_MS] > ms[longest] else longest
        assert root.attributes[c.BOTTLENECK_STAGE] == expected, (ms, root.attributes)
        assert 0 < root.attributes[c.BOTTLENECK_RATIO] <= 1
        assert root.attributes[c.SLOW] is False
        assert root.attributes[c.STAGES] == ("decode", "infer")
        assert c.UNTRACKED_MS in root.attributes
        for name in ("decode", "infer"):
            assert spans[name].parent_span_id == root.span_id
            assert spans[name].trace_id == root.trace_id
            assert spans[name].attributes[c.STAGE] == name
        assert sink.wait_for(lambda s: c.METRIC_STAGE_DURATION in s.metric_names, timeout=10)
        assert {c.METRIC_TRACE_DURATION, c.METRIC_BOTTLENECK} <= sink.metric_names
    finally:
        handle.shutdown()


def test_traces_exporter_none_exports_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("STAGETRACE_OUTPUT_DIR", str(tmp_path))
    seen = []
    handle = stagetrace.configure("svc", on_verdict=seen.append, set_global=False)
    run_pipeline()
    handle.force_flush(5)
    handle.shutdown()
    assert len(seen) == 1 and list(tmp_path.iterdir()) == []


def test_unknown_protocol_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        stagetrace.configure(set_global=False)


def test_embedded_default_writes_otlp_json_lines(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("STAGETRACE_OUTPUT_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="stagetrace"):
        handle = stagetrace.configure("local-svc", set_global=False)
    assert handle.traces_path is not None and handle.traces_path.parent == tmp_path
    run_pipeline()
    handle.force_flush(5)
    handle.shutdown()
    lines = handle.traces_path.read_text().splitlines()
    spans = [
        span
        for line in lines
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
    ]
    by_name = {s["name"]: s for s in spans}
    assert set(by_name) == {"predict", "decode", "infer"}
    root = by_name["predict"]
    assert len(root["traceId"]) == 32 and len(root["spanId"]) == 16  # hex ids, as the Collector writes
    assert by_name["decode"]["parentSpanId"] == root["spanId"]
    attrs = {a["key"]: a["value"] for a in root["attributes"]}
    # decode is meant to be the longest stage; on a loaded host a stage or the time between them can outlast it
    ms = {name: (int(s["endTimeUnixNano"]) - int(s["startTimeUnixNano"])) / 1e6 for name, s in by_name.items()}
    longest = max(("decode", "infer"), key=ms.__getitem__)
    expected = longest if ms[longest] >= ms["predict"] - ms["decode"] - ms["infer"] else c.UNTRACKED
    assert attrs[c.BOTTLENECK_STAGE] == {"stringValue": expected}
    assert str(handle.traces_path) in caplog.text


def test_nothing_configured_means_no_connection_attempts(tmp_path):
    """With no collector and no OTEL_* settings, a run prints no export errors at all."""
    code = (
        "import time, stagetrace\n"
        "h = stagetrace.configure('quiet')\n"
        "with stagetrace.pipeline('p'):\n"
        "    with stagetrace.stage('s'): time.sleep(0.001)\n"
        "h.force_flush(); h.shutdown()\n"
        "print(h.traces_path)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["STAGETRACE_OUTPUT_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Failed to export" not in out.stderr and "Connection refused" not in out.stderr
    assert "UNAVAILABLE" not in out.stderr and out.stderr.strip() == ""
    assert os.path.getsize(out.stdout.strip()) > 0


def test_json_lines_file_rotates_at_its_cap(tmp_path):
    from stagetrace.destinations.files import JsonLinesSpanExporter

    exporter = JsonLinesSpanExporter(tmp_path / "t.jsonl", max_bytes=4000)
    handle = stagetrace.configure("rot", span_exporter=exporter, set_global=False)
    for _ in range(60):
        run_pipeline()
        handle.force_flush(5)
    handle.shutdown()
    assert (tmp_path / "t.jsonl").stat().st_size <= 4000 + 3000
    assert (tmp_path / "t.jsonl.1").exists()
