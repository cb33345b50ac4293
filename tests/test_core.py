"""The core API against a real SDK pipeline with in-memory export."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags

import stagetrace
from conftest import both_modes
from stagetrace import conventions as c

export_mode = both_modes  # every test here runs with the exporter in a process and on a thread


def test_decorated_and_nested_stages_become_children_of_the_pipeline(harness):
    @stagetrace.stage("decode")
    def decode():
        time.sleep(0.01)

    with stagetrace.pipeline("batch"):
        decode()
        with stagetrace.stage("postprocess"), stagetrace.stage("json"):
            time.sleep(0.002)

    spans = {s.name: s for s in harness.spans()}
    root = spans["batch"]
    assert spans["decode"].parent.span_id == root.context.span_id
    assert spans["postprocess"].parent.span_id == root.context.span_id
    assert spans["json"].parent.span_id == spans["postprocess"].context.span_id
    assert {s.context.trace_id for s in spans.values()} == {root.context.trace_id}
    for name in ("decode", "postprocess", "json"):
        assert spans[name].attributes[c.STAGE] == name
        assert spans[name].attributes[c.STAGE_KIND] == "cpu"
        assert root.start_time <= spans[name].start_time <= spans[name].end_time <= root.end_time
    assert root.attributes[c.BOTTLENECK_STAGE] == "decode"
    assert 0 < root.attributes[c.BOTTLENECK_RATIO] <= 1
    assert root.attributes[c.STAGES] == ("decode", "postprocess", "json")
    assert len(root.attributes[c.STAGES_MS]) == 3
    assert root.attributes[c.SLOW] is False
    assert root.attributes[c.UNTRACKED_MS] >= 0


def test_stage_times_are_true_timestamps(harness):
    with stagetrace.pipeline("p"), stagetrace.stage("sleep"):
        time.sleep(0.03)
    span = harness.by_name("sleep")[0]
    assert 28e6 <= span.end_time - span.start_time <= 200e6


def test_foreign_span_inside_a_stage_is_its_child(harness):
    with stagetrace.pipeline("p"), stagetrace.stage("infer"), harness.tracer.start_as_current_span("db.query"):
        with stagetrace.stage("inner"):
            pass
    spans = {s.name: s for s in harness.spans()}
    assert spans["db.query"].parent.span_id == spans["infer"].context.span_id
    assert spans["inner"].parent.span_id == spans["db.query"].context.span_id
    v = harness.verdicts[0]
    # inner is nested in infer through the foreign span: still exclusive time
    assert v.breakdown["infer"] + v.breakdown["inner"] <= v.total_ms + 1e-6


def test_async_decorator_and_async_with(harness):
    @stagetrace.stage
    async def fetch():
        await asyncio.sleep(0.005)

    async def main():
        async with stagetrace.pipeline("req"):
            await fetch()
            async with stagetrace.stage("post", kind="io"):
                await asyncio.sleep(0.001)

    asyncio.run(main())
    spans = {s.name: s for s in harness.spans()}
    assert spans["fetch"].parent.span_id == spans["req"].context.span_id
    assert spans["post"].attributes[c.STAGE_KIND] == "io"


def test_exception_is_recorded_and_reraised_unchanged(harness):
    err = KeyError("missing")
    with pytest.raises(KeyError) as info, stagetrace.pipeline("p"), stagetrace.stage("decode"):
        raise err
    assert info.value is err
    span = harness.by_name("decode")[0]
    assert span.status.status_code is StatusCode.ERROR
    assert span.events[0].name == "exception"
    assert span.events[0].attributes["exception.type"] == "KeyError"
    assert harness.by_name("p")[0].status.status_code is StatusCode.ERROR

    @stagetrace.stage("boom")
    def boom():
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        boom()


def test_stage_outside_any_trace_opens_its_own_root(harness):
    with stagetrace.stage("standalone"):
        time.sleep(0.03)  # long beside the implicit root's own start and end, which a loaded host stretches
    spans = harness.spans()
    roots = [s for s in spans if s.parent is None]
    assert [r.name for r in roots] == ["standalone"]
    assert roots[0].attributes[c.BOTTLENECK_STAGE] == "standalone"
    assert len(harness.verdicts) == 1


def test_server_span_is_the_local_root_and_route_threshold_applies(make_harness):
    h = make_harness(slow_threshold_ms=1000, route_slow_thresholds_ms={"/predict": 5})
    with h.tracer.start_as_current_span("GET /predict", kind=SpanKind.SERVER, attributes={"http.route": "/predict"}):
        with stagetrace.stage("decode"):
            time.sleep(0.01)
    root = h.by_name("GET /predict")[0]
    assert root.attributes[c.SLOW] is True
    assert root.attributes[c.SLOW_THRESHOLD_MS] == 5
    assert h.verdicts[0].route == "/predict"


def test_span_with_remote_parent_is_a_local_root(harness):
    remote = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    ctx = trace.set_span_in_context(NonRecordingSpan(remote))
    with harness.tracer.start_as_current_span("server", context=ctx), stagetrace.stage("work"):
        pass
    root = harness.by_name("server")[0]
    assert root.context.trace_id == 0xABC
    assert c.BOTTLENECK_STAGE in root.attributes
    assert harness.by_name("work")[0].parent.span_id == root.context.span_id


def test_slow_trace_logs_one_warning(make_harness, caplog):
    h = make_harness(slow_threshold_ms=5)
    with caplog.at_level(logging.WARNING, logger="stagetrace"):
        with stagetrace.pipeline("job"), stagetrace.stage("decode"):
            time.sleep(0.02)
        h.flush()
    lines = [r.getMessage() for r in caplog.records if "slow trace" in r.getMessage()]
    assert len(lines) == 1
    assert "bottleneck decode" in lines[0] and "trace_id=" in lines[0]


def test_metrics_recorded_for_every_request_even_unsampled(make_harness):
    h = make_harness(sampler=ALWAYS_OFF)
    for _ in range(3):
        with stagetrace.pipeline("p"), stagetrace.stage("decode"):
            pass
    assert h.spans() == []  # nothing exported
    assert len(h.verdicts) == 3 and not h.verdicts[0].sampled
    points = h.metric_points(c.METRIC_STAGE_DURATION)
    assert sum(p.count for p in points if p.attributes[c.STAGE] == "decode") == 3
    assert sum(p.count for p in h.metric_points(c.METRIC_TRACE_DURATION)) == 3
    assert sum(p.value for p in h.metric_points(c.METRIC_BOTTLENECK)) == 3


def test_metric_attributes_follow_the_contract(make_harness):
    h = make_harness(slow_threshold_ms=1)
    with h.tracer.start_as_current_span("GET /x", kind=SpanKind.SERVER, attributes={"http.route": "/x"}):
        with stagetrace.stage("decode"):
            time.sleep(0.005)
        time.sleep(0.030)  # in no stage: UNTRACKED_TIME fires, so the diagnosis metric has a point to check
    (stage_point,) = h.metric_points(c.METRIC_STAGE_DURATION)
    assert dict(stage_point.attributes) == {c.STAGE: "decode", c.STAGE_KIND: "cpu", c.HTTP_ROUTE: "/x"}
    (trace_point,) = h.metric_points(c.METRIC_TRACE_DURATION)
    assert dict(trace_point.attributes) == {c.HTTP_ROUTE: "/x", c.SLOW: True, c.SLOW_REASON: c.SLOW_TOTAL}
    (bottleneck_point,) = h.metric_points(c.METRIC_BOTTLENECK)
    # 30 ms in no stage against a 5 ms stage: the headline is the untracked time, not the stage
    assert dict(bottleneck_point.attributes) == {c.STAGE: c.UNTRACKED}
    diagnosis_points = h.metric_points(c.METRIC_DIAGNOSIS)
    assert all(set(p.attributes) == {c.DIAGNOSIS_CODE} for p in diagnosis_points)
    codes = {p.attributes[c.DIAGNOSIS_CODE] for p in diagnosis_points}
    assert "UNTRACKED_TIME" in codes
    # the stage sleeps: off-CPU with the GIL free; on a host short of CPUs the wait may go undetermined or be
    # a wait for a CPU, never the GIL
    assert codes <= {"UNTRACKED_TIME", "LOCK_OR_IO_WAIT", "OFF_CPU_WAIT", "CPU_OVERSUBSCRIBED", "SERVICE_AT_CAPACITY"}


def test_untracked_time_diagnosis_is_a_root_event(harness):
    with stagetrace.pipeline("p"):
        with stagetrace.stage("small"):
            time.sleep(0.002)
        time.sleep(0.03)
    root = harness.by_name("p")[0]
    # named (a loaded host may add a wait for a CPU in 'small' beside it: not this test's matter)
    assert "UNTRACKED_TIME" in root.attributes[c.DIAGNOSIS]
    (event,) = [
        e for e in root.events
        if e.name == c.DIAGNOSIS_EVENT and e.attributes[c.DIAGNOSIS_EVENT_CODE] == "UNTRACKED_TIME"
    ]  # fmt: skip
    assert event.attributes[c.DIAGNOSIS_EVENT_ADVICE]


def test_stage_ending_after_its_root_is_exported_but_not_in_the_verdict(harness):
    import threading

    from opentelemetry import context

    entered, root_done, finished = threading.Event(), threading.Event(), threading.Event()

    def background(ctx):
        token = context.attach(ctx)
        with stagetrace.stage("background"):
            entered.set()
            root_done.wait(5)  # still running when the response (the root) has ended
        with stagetrace.stage("after"):  # starts after the root ended
            pass
        context.detach(token)
        finished.set()

    with stagetrace.pipeline("req"):
        t = threading.Thread(target=background, args=(context.get_current(),))
        t.start()
        entered.wait(5)
    harness.flush()
    root_done.set()
    finished.wait(5)
    t.join()
    root = harness.by_name("req")[0]
    for name in ("background", "after"):
        span = harness.by_name(name)[0]
        assert span.parent.span_id == root.context.span_id
        assert span.context.trace_id == root.context.trace_id
    assert harness.by_name("background")[0].attributes[c.LATE] is True
    assert harness.verdicts[0].breakdown == {}


@pytest.mark.internal_errors_expected
def test_on_verdict_callback_errors_are_contained(make_harness):
    seen = []

    def bad(v):
        raise RuntimeError("user bug")

    h = make_harness(on_verdict=[bad, seen.append])
    with stagetrace.pipeline("p"), stagetrace.stage("a"):
        pass
    h.flush()
    assert len(seen) == 1


def test_set_attribute_on_a_stage(harness):
    with stagetrace.pipeline("p"), stagetrace.stage("infer") as s:
        s.set_attribute("batch.size", 8)
    assert harness.by_name("infer")[0].attributes["batch.size"] == 8


def test_reused_stage_object_in_nested_with(harness):
    s = stagetrace.stage("again")
    with stagetrace.pipeline("p"), s, s:
        pass
    spans = harness.by_name("again")
    assert len(spans) == 2
    assert {sp.parent.span_id for sp in spans} == {
        harness.by_name("p")[0].context.span_id,
        spans[0].context.span_id,
    } or {sp.parent.span_id for sp in spans} == {harness.by_name("p")[0].context.span_id, spans[1].context.span_id}


def test_pipeline_inside_a_trace_is_a_plain_child(harness):
    with harness.tracer.start_as_current_span("server"), stagetrace.pipeline("inner"), stagetrace.stage("a"):
        pass
    harness.flush()
    assert len(harness.verdicts) == 1 and harness.verdicts[0].root_name == "server"
    assert harness.by_name("inner")[0].parent is not None


def test_inference_pipeline_profiler_keeps_the_classic_contract(harness):
    profiler = stagetrace.InferencePipelineProfiler(slow_threshold_ms=5)
    profiler.start()
    time.sleep(0.01)
    profiler.record_stage("decode")
    time.sleep(0.002)
    profiler.record_stage("infer")
    report = profiler.analyze_and_report()
    assert set(report) == {
        "total_latency_ms",
        "stage_breakdown_ms",
        "bottleneck_stage",
        "bottleneck_ratio_pct",
        "is_slow_request",
    }
    assert report["bottleneck_stage"] == "decode"
    assert list(report["stage_breakdown_ms"]) == ["decode", "infer"]
    assert 0 < report["bottleneck_ratio_pct"] <= 100
    assert report["is_slow_request"] is True
    spans = {s.name: s for s in harness.spans()}
    assert spans["decode"].parent.span_id == spans["inference"].context.span_id
    assert spans["decode"].end_time - spans["decode"].start_time >= 9e6
    assert spans["inference"].attributes[c.BOTTLENECK_STAGE] == "decode"


def test_profiler_works_without_configure():
    from stagetrace import _state

    assert _state.runtime is None
    p = stagetrace.InferencePipelineProfiler()
    p.start()
    p.record_stage("a")
    assert p.analyze_and_report()["bottleneck_stage"] == "a"


def test_cpu_accounting_is_skipped_for_stage_names_that_run_short(harness):
    rt = harness.handle.runtime
    seen = []  # (what the name's recent runs said before a run, the clock that run read)
    for _ in range(20):  # a run the host slows (a collection, a preemption) keeps the name measured a while
        before = rt.recent_stage_ms.get("tiny")
        with stagetrace.pipeline("p"):
            with stagetrace.stage("tiny") as tiny:
                pass
            with stagetrace.stage("long") as long_:
                end = time.perf_counter() + 0.003
                while time.perf_counter() < end:
                    pass
        assert isinstance(long_.cpu_start, bytes) and long_.cpu_end is not None  # schedstat for long names
        seen.append((before, type(tiny.cpu_start)))
        if type(tiny.cpu_start) is int:
            break
    assert seen[0] == (None, bytes)  # a name not seen yet is measured in full
    # each run chose by its name's recent runs: the cheap thread CPU clock only below 0.5 ms
    assert all((kind is int) == (before is not None and before < 0.5) for before, kind in seen)
    assert seen[-1][1] is int, seen
    assert rt.recent_stage_ms["long"] >= 0.5
    spans = [s for s in harness.spans() if s.name == "long"]
    assert all(c.CPU_MS in s.attributes and c.RUNQUEUE_MS in s.attributes for s in spans)


def test_a_usually_short_stage_that_runs_long_still_gets_cpu_and_blocked_time(harness):
    import threading

    lock = threading.Lock()
    for _ in range(5):
        with stagetrace.pipeline("warm"), stagetrace.stage("lookup"), lock:
            pass  # fast while the lock is free: the name counts as short
    lock.acquire()
    threading.Timer(0.02, lock.release).start()
    with stagetrace.pipeline("contended"), stagetrace.stage("lookup"), lock:
        pass  # this time it waits 20 ms on the lock
    span = next(s for s in harness.spans() if s.name == "lookup" and s.end_time - s.start_time > 10e6)
    assert span.attributes[c.BLOCKED_MS] > 10
    assert span.attributes[c.CPU_MS] < 5


def test_latency_histograms_carry_exemplars_pointing_at_the_trace(harness):
    with stagetrace.pipeline("p"), stagetrace.stage("decode"):
        # long enough to stay the bottleneck (the stage point's exemplar is the bottleneck's) however long a
        # loaded host takes over the root's own start and end
        time.sleep(0.030)
    assert harness.handle.runtime.shipper.flush(10)
    # Exemplars come with the first collection after the measurement (as a periodic exporter sends them):
    # collect exactly once, without the provider flush that would collect first.
    points = {
        m.name: m.data.data_points
        for rm in harness.reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    root = harness.by_name("p")[0]
    (trace_point,) = points[c.METRIC_TRACE_DURATION]
    assert {e.trace_id for e in trace_point.exemplars} == {root.context.trace_id}
    (stage_point,) = points[c.METRIC_STAGE_DURATION]  # the bottleneck stage
    assert {e.trace_id for e in stage_point.exemplars} == {root.context.trace_id}


def test_a_verdicts_trace_id_is_formatted_as_opentelemetry_formats_it():
    """The exporter formats a trace id with ``%`` where OpenTelemetry's ``format_trace_id`` calls ``format``:
    the same string for any int, ids past 128 bits and negative ones included."""
    from stagetrace.exporter.core import format_trace_id as ours

    for trace_id in (0, 1, 0xABC, 2**64 + 7, 2**128 - 1, 2**128 + 3, -5, 195183392535125720877340007460409715101):
        assert ours(trace_id) == trace.format_trace_id(trace_id), trace_id
