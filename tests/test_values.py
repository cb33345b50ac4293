"""The verdict's numbers, end to end, against traces whose true values are known by construction: in memory,
over the wire with nothing but ``OTEL_EXPORTER_OTLP_ENDPOINT`` set (the default protocol), and from the
classic profiler. The stage times are set, not slept: each check has one right answer."""

from __future__ import annotations

import time

import pytest
from opentelemetry.trace import use_span

import stagetrace
from conftest import both_modes
from stagetrace import _state as stagetrace_state
from stagetrace import conventions as c
from stagetrace.capture.stage import enter_stage, exit_stage

export_mode = both_modes
MS = 1_000_000
TOL = 0.05  # ms: the stages are placed on the root's own perf-counter origin; rounding is all that is left

# The trace: a 100 ms root; decode 5-15, infer 20-70 with kernel 30-40 nested in it, post 80-90, and a stage
# running from 95 past the root's end (clipped to 100). Bottleneck: infer (not the first stage), exclusive
# 40 ms; untracked: 100 minus the union of [5,15] [20,70] [80,90] [95,100] = 25 ms.
EXPECTED = {"decode": 10.0, "infer": 40.0, "kernel": 10.0, "post": 10.0, "tail": 5.0}


def constructed_trace(tracer, *, with_foreign_span: bool = False) -> None:
    """The trace above, its stages' times set on a clock read once at the root's start. With
    ``with_foreign_span``, kernel sits under another instrumentation's span inside infer: its nearest
    enclosing stage is still infer."""
    root = tracer.start_span("request")
    # The origin is the perf-counter reading the root's trace record was opened with, not a clock read after
    # it: a descheduling in between would shift every stage against the root's end.
    record = stagetrace_state.runtime.lookup_trace(root.get_span_context().trace_id)
    p0 = root.start_time - record.perf_to_epoch_ns
    with use_span(root, end_on_exit=False):

        def stage(name: str, start_ms: float, end_ms: float, inner=None) -> None:
            rec = enter_stage(name, "cpu", sync=False)
            assert rec is not None
            rec.start_ns = p0 + int(start_ms * MS)
            if inner is not None:
                inner()
            exit_stage(rec, None, p0 + int(end_ms * MS))

        def kernel() -> None:
            if with_foreign_span:
                with tracer.start_as_current_span("http.client"):
                    stage("kernel", 30, 40)
            else:
                stage("kernel", 30, 40)

        stage("decode", 5, 15)
        stage("infer", 20, 70, kernel)
        stage("post", 80, 90)
        stage("tail", 95, 130)
    start_epoch = root.start_time
    root.end(end_time=start_epoch + 100 * MS)


def check_verdict(breakdown: dict, bottleneck: str, ratio: float, untracked: float, total: float) -> None:
    assert list(breakdown) == list(EXPECTED)  # pipeline order
    for name, ms in EXPECTED.items():
        assert breakdown[name] == pytest.approx(ms, abs=TOL), name
    assert bottleneck == "infer"
    assert ratio == pytest.approx(0.40, abs=0.001)
    assert untracked == pytest.approx(25.0, abs=TOL)
    assert total == pytest.approx(100.0, abs=TOL)


def check_root_attributes(a) -> None:
    """The same values, as the root span carries them (in memory or decoded from the wire)."""
    breakdown = dict(zip(a[c.STAGES], a[c.STAGES_MS]))
    check_verdict(breakdown, a[c.BOTTLENECK_STAGE], a[c.BOTTLENECK_RATIO], a[c.UNTRACKED_MS], a[c.TOTAL_MS])


@pytest.mark.parametrize("with_foreign_span", [False, True])
def test_verdict_values_in_memory(make_harness, with_foreign_span):
    h = make_harness(slow_threshold_ms=60)
    constructed_trace(h.tracer, with_foreign_span=with_foreign_span)
    (v,) = h.wait_verdicts(1)
    check_verdict(v.breakdown, v.bottleneck, v.ratio, v.untracked_ms, v.total_ms)
    assert v.slow is True and v.slow_threshold_ms == 60
    (root,) = h.by_name("request")
    a = root.attributes
    check_root_attributes(a)
    assert a[c.SLOW] is True
    # the stage metric gets the same values, one observation per stage per request
    points = {p.attributes[c.STAGE]: p.sum for p in h.metric_points(c.METRIC_STAGE_DURATION)}
    for name, ms in EXPECTED.items():
        assert points[name] == pytest.approx(ms, abs=TOL), name


def test_slow_flag_on_both_sides_of_the_threshold(make_harness):
    fast = make_harness(slow_threshold_ms=100.5)
    constructed_trace(fast.tracer)
    assert fast.wait_verdicts(1)[0].slow is False
    fast.handle.shutdown()
    slow = make_harness(slow_threshold_ms=99.5)
    constructed_trace(slow.tracer)
    assert slow.wait_verdicts(1)[0].slow is True


def test_verdict_values_over_the_wire_with_only_the_endpoint_set(otlp_receiver, monkeypatch, tmp_path):
    """Only OTEL_EXPORTER_OTLP_ENDPOINT: the OpenTelemetry default protocol (http/protobuf) must be used, or
    nothing arrives at this HTTP endpoint."""
    for var in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.http_endpoint)
    monkeypatch.setenv("STAGETRACE_OUTPUT_DIR", str(tmp_path))
    handle = stagetrace.configure("values-wire", slow_threshold_ms=200, set_global=False)
    try:
        constructed_trace(handle.tracer_provider.get_tracer("t"))
        assert handle.force_flush(10)
        sink = otlp_receiver.sink
        assert sink.wait_for(lambda s: any(x.name == "request" for x in s.spans), timeout=10)
    finally:
        handle.shutdown()
    (root,) = [s for s in sink.spans if s.name == "request"]
    a = root.attributes
    check_root_attributes(a)
    assert a[c.SLOW] is False
    assert list(tmp_path.iterdir()) == []  # an endpoint was configured: no fallback file


class ScriptedClock:
    """perf_counter_ns returning the next scripted millisecond mark."""

    def __init__(self, marks_ms: list[float]) -> None:
        self.marks = [int(m * MS) for m in marks_ms]

    def perf_counter_ns(self) -> int:
        return self.marks.pop(0)


@pytest.mark.parametrize(("threshold", "slow"), [(99.0, True), (101.0, False)])
def test_classic_profiler_report_values(monkeypatch, threshold, slow):
    from stagetrace import profiler as profiler_module

    # start at 1 s; decode ends 30 ms later, infer at 80, post at 90; the report is taken at 100
    monkeypatch.setattr(profiler_module, "time", ScriptedClock([1000, 1030, 1080, 1090, 1100]))
    p = stagetrace.InferencePipelineProfiler(slow_threshold_ms=threshold)
    p.start()
    for name in ("decode", "infer", "post"):
        p.record_stage(name)
    report = p.analyze_and_report()
    assert report == {
        "total_latency_ms": 100.0,
        "stage_breakdown_ms": {"decode": 30.0, "infer": 50.0, "post": 10.0},
        "bottleneck_stage": "infer",
        "bottleneck_ratio_pct": 50.0,
        "is_slow_request": slow,
    }


def test_untracked_headline_on_the_span_the_metric_and_the_log_line(make_harness, caplog):
    """A 100 ms request whose only stage took 10 ms: the headline is the 90 ms in no stage."""
    h = make_harness(slow_threshold_ms=50)
    with caplog.at_level("WARNING", logger="stagetrace"):
        root = h.tracer.start_span("request")
        p0 = time.perf_counter_ns()
        with use_span(root, end_on_exit=False):
            rec = enter_stage("decode", "cpu", sync=False)
            assert rec is not None
            rec.start_ns = p0 + 5 * MS
            exit_stage(rec, None, p0 + 15 * MS)
        root.end(end_time=root.start_time + 100 * MS)
        (v,) = h.wait_verdicts(1)
    assert (v.bottleneck, v.bottleneck_ms) == (c.UNTRACKED, pytest.approx(90.0, abs=TOL))
    assert dict(v.breakdown) == {"decode": pytest.approx(10.0, abs=TOL)}
    a = h.by_name("request")[0].attributes
    assert a[c.BOTTLENECK_STAGE] == c.UNTRACKED
    assert a[c.BOTTLENECK_RATIO] == pytest.approx(0.90, abs=0.001)
    (point,) = h.metric_points(c.METRIC_BOTTLENECK)
    assert dict(point.attributes) == {c.STAGE: c.UNTRACKED}
    (line,) = [r.getMessage() for r in caplog.records if "slow trace" in r.getMessage()]
    assert "bottleneck untracked 90% (90.0 ms)" in line
