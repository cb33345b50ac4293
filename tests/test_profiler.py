"""The classic ``InferencePipelineProfiler``: its report's values and types, its misuse errors, its spans
when stagetrace is configured, and its warning when it is not."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import format_trace_id, use_span

import stagetrace
from stagetrace import conventions as c
from stagetrace import profiler as profiler_module

MS = 1_000_000


class ScriptedClock:
    """perf_counter_ns returning the next scripted nanosecond mark."""

    def __init__(self, marks_ns: list[int]) -> None:
        self.marks = list(marks_ns)

    def perf_counter_ns(self) -> int:
        return self.marks.pop(0)


def scripted(monkeypatch, *marks_ms: float) -> None:
    monkeypatch.setattr(profiler_module, "time", ScriptedClock([int(m * MS) for m in marks_ms]))


def test_threshold_must_be_positive():
    with pytest.raises(ValueError, match=r"^slow_threshold_ms must be > 0$"):
        stagetrace.InferencePipelineProfiler(slow_threshold_ms=0)
    assert stagetrace.InferencePipelineProfiler(slow_threshold_ms=0.5).slow_threshold_ms == 0.5


def test_marks_and_reports_before_start_are_errors():
    p = stagetrace.InferencePipelineProfiler()
    assert p.stage_breakdown_ms == {}
    with pytest.raises(RuntimeError, match=r"^InferencePipelineProfiler\.record_stage\(\) called before start\(\)$"):
        p.record_stage("a")
    with pytest.raises(
        RuntimeError, match=r"^InferencePipelineProfiler\.analyze_and_report\(\) called before start\(\)$"
    ):
        p.analyze_and_report()


def test_report_values_keep_microseconds_and_repeated_marks_add_up(monkeypatch):
    # start at 1 s; decode 30.1234564 ms, infer 50.0000006, decode again 10, report at 100.1234570
    scripted(monkeypatch, 1000, 1030.1234564, 1080.123457, 1090.123457, 1100.123457)
    p = stagetrace.InferencePipelineProfiler(slow_threshold_ms=100)
    p.start()
    for name in ("decode", "infer", "decode"):
        p.record_stage(name)
    assert p.stage_breakdown_ms == {"decode": pytest.approx(40.1234564), "infer": pytest.approx(50.0000006)}
    report = p.analyze_and_report()
    assert report == {
        "total_latency_ms": 100.123,
        "stage_breakdown_ms": {"decode": 40.123, "infer": 50.0},
        "bottleneck_stage": "infer",
        "bottleneck_ratio_pct": 49.94,  # 50.0000006 / 100.123457
        "is_slow_request": True,
    }


def test_the_classic_report_names_a_recorded_stage_even_when_most_time_is_after_the_last_mark(monkeypatch):
    scripted(monkeypatch, 1000, 1010, 1100)
    p = stagetrace.InferencePipelineProfiler()
    p.start()
    p.record_stage("decode")
    assert p.analyze_and_report()["bottleneck_stage"] == "decode"


def test_unconfigured_slow_reports_log_the_classic_warning(monkeypatch, caplog):
    scripted(monkeypatch, 1000, 1150, 1250)
    p = stagetrace.InferencePipelineProfiler(slow_threshold_ms=200)
    p.start()
    p.record_stage("infer")
    with caplog.at_level(logging.WARNING, logger="stagetrace"):
        p.analyze_and_report()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == "slow request 250.0 ms > 200 ms; bottleneck infer 60.0%"  # no trace: no trace id


def test_unconfigured_inside_another_tracer_s_span_the_warning_names_its_trace(monkeypatch, caplog):
    span = TracerProvider().get_tracer("t").start_span("outer")
    scripted(monkeypatch, 1000, 1250, 1250)
    p = stagetrace.InferencePipelineProfiler(slow_threshold_ms=200)
    with use_span(span, end_on_exit=True), caplog.at_level(logging.WARNING, logger="stagetrace"):
        p.start()
        p.record_stage("infer")
        p.analyze_and_report()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.endswith(f"; bottleneck infer 100.0% trace_id={format_trace_id(span.get_span_context().trace_id)}")


def test_configured_stages_become_cpu_spans_between_the_marks_and_reports_repeat(harness, caplog):
    p = stagetrace.InferencePipelineProfiler(slow_threshold_ms=0.001)
    with caplog.at_level(logging.WARNING, logger="stagetrace"):
        p.start()
        p.record_stage("decode")
        p.record_stage("infer")
        first = p.analyze_and_report()
        p.start()
        p.record_stage("decode")
        second = p.analyze_and_report()  # the profiler is reusable: a second run, a second trace
    assert first["is_slow_request"] and second["is_slow_request"]
    assert not any(r.getMessage().startswith("slow request") for r in caplog.records)  # the exporter logs instead
    harness.wait_verdicts(2)
    roots = harness.by_name("inference")
    assert len(roots) == 2
    decode, infer = sorted(
        (s for s in harness.spans() if s.context.trace_id == roots[0].context.trace_id and c.STAGE in s.attributes),
        key=lambda s: s.start_time,
    )
    assert (decode.name, infer.name) == ("decode", "infer")
    assert decode.attributes[c.STAGE_KIND] == infer.attributes[c.STAGE_KIND] == "cpu"
    assert decode.end_time == infer.start_time  # a stage runs from the previous mark to its own
    assert infer.end_time > infer.start_time


def test_configured_inside_an_existing_trace_the_stages_join_it_without_a_root_of_their_own(harness):
    with harness.tracer.start_as_current_span("request"):
        p = stagetrace.InferencePipelineProfiler()
        p.start()
        p.record_stage("decode")
        p.analyze_and_report()
    harness.wait_verdicts(1)
    assert harness.by_name("inference") == []
    (request,) = harness.by_name("request")
    assert harness.by_name("decode")[0].parent.span_id == request.context.span_id


def test_a_profiler_reused_inside_a_trace_after_a_run_of_its_own(harness):
    p = stagetrace.InferencePipelineProfiler()
    p.start()
    p.record_stage("decode")
    p.analyze_and_report()  # its own "inference" root
    with harness.tracer.start_as_current_span("request"):
        p.start()  # inside a trace now: no root of its own
        p.record_stage("decode")
        assert p.analyze_and_report()["bottleneck_stage"] == "decode"
    harness.wait_verdicts(2)
    assert len(harness.by_name("inference")) == 1
