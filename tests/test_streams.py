"""Streams and repeated stages: a stage name repeating under one parent folds into a composite after the
first few (bounded memory, every occurrence counted in the verdict), and a streamed response's root says
what its client lived (chunks, time to the first, gaps, a slow consumer, a disconnect), with a verdict for
each phase, the stream rules and the stream and GenAI metrics."""

from __future__ import annotations

import asyncio
import io
import math
import random
import socket
import threading
import time
from collections import Counter

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from harness import free_port
from opentelemetry.trace import get_current_span

import stagetrace
from stagetrace import _state
from stagetrace import conventions as c
from stagetrace.analysis import DiagnosisThresholds, StageSample, TraceSignals, analyse_trace, diagnose
from stagetrace.analysis.breakdown import TraceAnalysis
from stagetrace.analysis.model import CompressedInfo
from stagetrace.analysis.streams import StreamFields, StreamSummary, quantile, summarise_stream
from stagetrace.capture.stage import _perf_ns, add_stage
from stagetrace.common import wire
from stagetrace.exporter.core import fold_repeated
from stagetrace.settings import KEEP_REPEATS

MS = 1_000_000


def occurrences(names_and_ms):
    """Stages one after another, recorded with exact times in the current trace, once they have happened."""
    at = _perf_ns()
    time.sleep(sum(ms for _, ms in names_and_ms) / 1e3 + 0.001)
    for name, ms in names_and_ms:
        add_stage(name, "cpu", at, at + int(ms * MS))
        at += int(ms * MS)


# --- compression ---------------------------------------------------------------------------------------------


def test_a_repeated_stage_keeps_its_first_few_a_composite_and_its_slowest(harness):
    durations = [0.5] * 1000
    durations[700] = 9.0  # the slowest, folded: kept as the example
    with stagetrace.pipeline("stream"):
        occurrences([("decode_step", ms) for ms in durations])
    (v,) = harness.wait_verdicts(1)
    assert v.breakdown["decode_step"] == pytest.approx(sum(durations), abs=1e-6)  # every occurrence counted
    spans = harness.by_name("decode_step")
    composite = [s for s in spans if c.COMPRESSED_COUNT in s.attributes]
    examples = [s for s in spans if s.attributes.get(c.COMPRESSED_SLOWEST)]
    assert len(spans) == KEEP_REPEATS + 2 and len(composite) == 1 and len(examples) == 1
    (composite,), (example,) = composite, examples
    assert composite.attributes[c.COMPRESSED_COUNT] == 1000 - KEEP_REPEATS
    assert composite.attributes[c.COMPRESSED_SUM_MS] == pytest.approx(sum(durations[KEEP_REPEATS:]), abs=1e-3)
    assert composite.attributes[c.COMPRESSED_MIN_MS] == pytest.approx(0.5)
    assert composite.attributes[c.COMPRESSED_MAX_MS] == pytest.approx(9.0)
    assert (example.end_time - example.start_time) / MS == pytest.approx(9.0)
    assert example.context.span_id != composite.context.span_id
    assert example.parent.span_id == composite.parent.span_id  # beside it, under the same parent


@pytest.mark.slow
def test_the_verdict_counts_every_occurrence_however_folded(harness):
    """Random sequences of three names (25 of them, fixed seed): every occurrence's time in the breakdown."""
    rng = random.Random(7)
    for _ in range(25):
        names_and_ms = [(rng.choice("abc"), round(rng.uniform(0.01, 5.0), 3)) for _ in range(rng.randint(1, 60))]
        harness.verdicts.clear()
        with stagetrace.pipeline("p"):
            occurrences(names_and_ms)
        (v,) = harness.wait_verdicts(1)
        expected: dict[str, float] = {}
        for name, ms in names_and_ms:
            expected[name] = expected.get(name, 0.0) + int(ms * MS) / MS
        assert v.breakdown == pytest.approx(expected, abs=1e-6)
        assert sum(v.breakdown.values()) + v.untracked_ms == pytest.approx(v.total_ms, abs=1e-6)


def test_nested_repeats_fold_level_by_level_and_the_breakdown_adds_up(harness):
    with stagetrace.pipeline("stream"):
        for _ in range(60):
            with stagetrace.stage("token"):
                with stagetrace.stage("decode_step"):
                    pass
                with stagetrace.stage("detokenize"):
                    pass
    (v,) = harness.wait_verdicts(1)
    assert set(v.breakdown) == {"token", "decode_step", "detokenize"}
    assert sum(v.breakdown.values()) + v.untracked_ms == pytest.approx(v.total_ms, abs=1e-3)
    spans = harness.spans()
    counts = {}
    for s in spans:
        counts[s.name] = counts.get(s.name, 0) + s.attributes.get(c.COMPRESSED_COUNT, 1) * (
            not s.attributes.get(c.COMPRESSED_SLOWEST)
        )
    assert counts["token"] == 60 and counts["decode_step"] == 60 and counts["detokenize"] == 60
    assert len(spans) <= 1 + 3 * (2 * KEEP_REPEATS + 2)  # never one span per occurrence
    ids = {s.context.span_id for s in spans}
    assert all(s.parent is None or s.parent.span_id in ids for s in spans)  # no span points at a folded one


def test_a_long_stream_holds_one_record_per_name(harness):
    """100,000 occurrences: the trace in flight holds the first few and one composite, not 100,000 records."""
    with stagetrace.pipeline("stream"):
        for _ in range(100_000):
            with stagetrace.stage("chunk"):
                pass
        in_flight = _state.runtime.lookup_trace(get_current_span().get_span_context().trace_id)
        assert len(in_flight.stages) == KEEP_REPEATS + 1 and len(in_flight.repeats) == 1
    harness.wait_verdicts(1)
    (composite,) = [s for s in harness.by_name("chunk") if c.COMPRESSED_COUNT in s.attributes]
    assert composite.attributes[c.COMPRESSED_COUNT] == 100_000 - KEEP_REPEATS


def test_stages_in_sync_and_async_generators_fold(harness):
    def frames():
        for i in range(50):
            with stagetrace.stage("frame"):
                yield i

    async def tokens():
        for i in range(50):
            with stagetrace.stage("token"):
                await asyncio.sleep(0)
            yield i

    async def consume():
        return [t async for t in tokens()]

    with stagetrace.pipeline("gen"):
        assert sum(frames()) == sum(range(50))
        assert asyncio.run(consume()) == list(range(50))
    harness.wait_verdicts(1)
    for name in ("frame", "token"):
        spans = harness.by_name(name)
        folded = [s.attributes[c.COMPRESSED_COUNT] for s in spans if c.COMPRESSED_COUNT in s.attributes]
        assert folded == [50 - KEEP_REPEATS] and len(spans) == KEEP_REPEATS + 2


def test_a_failed_occurrence_marks_the_composite_and_nothing_before_it_is_lost(harness):
    def gen():
        for i in range(10):
            with stagetrace.stage("step"):
                if i == 7:
                    raise ValueError("bad token")
            yield i

    with pytest.raises(ValueError), stagetrace.pipeline("stream"):
        list(gen())
    harness.wait_verdicts(1)
    spans = harness.by_name("step")
    composite = next(s for s in spans if c.COMPRESSED_COUNT in s.attributes)
    assert composite.attributes[c.COMPRESSED_COUNT] == 8 - KEEP_REPEATS  # 8 ran: 0..7, the last failed
    assert composite.status.status_code.name == "ERROR"
    assert any(e.name == "exception" for e in composite.events)


# --- the analysis of composites (pure) -----------------------------------------------------------------------


def composite(name, start_ms, end_ms, sid, parent=0, count=10, sum_ms=5.0, kind="cpu"):
    return StageSample(
        name,
        kind,
        int(start_ms * MS),
        int(end_ms * MS),
        sid,
        parent,
        compressed=CompressedInfo(count, int(sum_ms * MS), MS // 10, MS),
    )


def test_a_composite_is_charged_its_summed_time_less_its_childrens():
    stages = [
        StageSample("token", "cpu", 0, 10 * MS, 1),
        composite("token", 10, 100, 2, sum_ms=60.0),
        StageSample("decode", "gpu", 11 * MS, 14 * MS, 3, 2),  # a real child of the composite
        composite("decode", 15, 99, 4, parent=2, sum_ms=30.0, kind="gpu"),
    ]
    a = analyse_trace(0, 100 * MS, stages, 200)
    assert a.breakdown["decode"] == pytest.approx(33.0)
    assert a.breakdown["token"] == pytest.approx(10.0 + 60.0 - 3.0 - 30.0)
    # covered: the real token (10) and the outermost composite's sum (60); its children count nothing more
    assert a.untracked_ms == pytest.approx(30.0)


def test_a_real_stage_with_a_composite_child_loses_the_composites_time():
    stages = [StageSample("request", "cpu", 0, 50 * MS, 1), composite("chunk", 5, 45, 2, parent=1, sum_ms=20.0)]
    a = analyse_trace(0, 50 * MS, stages, 200)
    assert a.breakdown == pytest.approx({"request": 30.0, "chunk": 20.0})
    assert a.untracked_ms == pytest.approx(0.0)


def test_the_exporter_folds_its_own_repeated_stages_too():
    waits = [
        wire.ShippedStage.added("event_loop.wait", "wait", i + 1, 9, i * 10 * MS, (i * 10 + 1 + i) * MS)
        for i in range(8)
    ]
    for i, w in enumerate(waits):
        w.attributes = {c.BLOCKED_BY: (f"decode@{i}",)}
    folded = fold_repeated(waits, lambda: 77)
    real, comp, example = folded[:KEEP_REPEATS], folded[KEEP_REPEATS], folded[KEEP_REPEATS + 1]
    assert len(folded) == KEEP_REPEATS + 2 and real == waits[:KEEP_REPEATS]
    assert comp.compressed == CompressedInfo(5, sum(1 + i for i in range(3, 8)) * MS, 4 * MS, 8 * MS)
    assert comp.span_id == 77 and comp.attributes[c.BLOCKED_BY] == tuple(f"decode@{i}" for i in range(3, 8))
    assert example is waits[-1] and example.example
    assert fold_repeated(waits[:KEEP_REPEATS], lambda: 1) == waits[:KEEP_REPEATS]


# --- streams: the summary and the rules (pure) ---------------------------------------------------------------


def fields(chunks=11, first_ms=30.0, gap_ms=2.0, send_wait_ms=0.0, stall_ms=None, disconnected=False):
    gaps = [int(gap_ms * MS)] * (chunks - 1)
    if stall_ms is not None:
        gaps[-1] = int(stall_ms * MS)
    first = int(first_ms * MS)
    counts = [0] * (len(c.MS_BUCKETS) + 1)
    return StreamFields(
        chunks, first, first + sum(gaps), tuple(counts), sum(gaps), min(gaps), max(gaps), tuple(gaps),
        int(send_wait_ms * MS), disconnected,
    )  # fmt: skip


def test_the_stream_summary_splits_each_stage_between_its_phases():
    stages = [StageSample("prefill", "gpu", 0, 30 * MS, 1), StageSample("decode", "gpu", 25 * MS, 50 * MS, 2)]
    a = analyse_trace(0, 50 * MS, stages, 200)
    s = summarise_stream(0, fields(chunks=11, first_ms=30.0, gap_ms=2.0), stages, a.charged_ms)
    assert s.first_chunk_ms == pytest.approx(30.0) and s.streaming_ms == pytest.approx(20.0)
    assert s.first_chunk_breakdown == pytest.approx({"prefill": 30.0, "decode": 5.0})
    assert s.gap_breakdown == pytest.approx({"decode": 20.0})
    assert (s.first_chunk_bottleneck, s.gap_bottleneck) == ("prefill", "decode")
    assert s.gap_p50_ms == pytest.approx(2.0) and s.gap_max_ms == pytest.approx(2.0)


def test_quantiles_interpolate_like_numpys_default():
    assert quantile([10, 20, 30, 40], 0.5) == 25 and quantile([10, 20, 30, 40], 0.99) == pytest.approx(39.7)
    assert quantile([7], 0.99) == 7


def summary(**kw) -> StreamSummary:
    base = dict(
        chunks=21, first_chunk_ms=30.0, streaming_ms=100.0, gap_p50_ms=5.0, gap_p99_ms=6.0, gap_max_ms=6.0,
        send_wait_ms=0.0, disconnected=False, first_chunk_bottleneck="prefill", gap_bottleneck="detokenize",
        first_chunk_breakdown={"prefill": 30.0}, gap_breakdown={"detokenize": 60.0, "decode": 30.0}, gaps=None,
    )  # fmt: skip
    base.update(kw)
    return StreamSummary(**base)


def codes(stream: StreamSummary, **thresholds) -> tuple[str, ...]:
    a = TraceAnalysis(130.0, {"prefill": 30.0, "decode": 30.0, "detokenize": 60.0}, "detokenize", 0.46, False, 200.0,
                      10.0, {"prefill": "gpu", "decode": "gpu", "detokenize": "cpu"})  # fmt: skip
    th = DiagnosisThresholds(**thresholds)
    return tuple(
        d.code for d in diagnose(a, [], TraceSignals(stream=stream), th) if d.code.startswith(("STREAM", "SLOW"))
    )


def test_stream_cpu_bound_fires_when_a_cpu_stage_outweighs_the_model_step_between_chunks():
    assert codes(summary()) == ("STREAM_CPU_BOUND",)
    assert codes(summary(), stream_cpu_share=0.61) == ()  # 60 % of the gaps, under the threshold
    assert codes(summary(gap_breakdown={"detokenize": 60.0, "decode": 61.0})) == ()  # the model's step is larger
    assert codes(summary(chunks=7)) == ()  # too short a stream to say


def test_slow_consumer_fires_on_the_wait_for_send_at_its_edges():
    assert "SLOW_CONSUMER" in codes(summary(send_wait_ms=25.0))
    assert "SLOW_CONSUMER" not in codes(summary(send_wait_ms=24.9))  # under 25 % of the streaming time
    assert "SLOW_CONSUMER" not in codes(summary(send_wait_ms=25.0, streaming_ms=60.0), slow_consumer_min_ms=30.0)


def test_a_stall_far_beyond_the_streams_own_gaps_fires():
    assert "STREAM_STALL" in codes(summary(gap_max_ms=100.0, gap_p50_ms=5.0))
    assert "STREAM_STALL" not in codes(summary(gap_max_ms=99.9, gap_p50_ms=5.0))  # under 100 ms
    assert "STREAM_STALL" not in codes(summary(gap_max_ms=100.0, gap_p50_ms=10.1))  # under 10x the median
    assert codes(summary(gap_max_ms=500.0), **{"stream_min_chunks": math.inf}) == ()


def test_malformed_stream_records_are_clear_errors():
    from stagetrace.analysis.streams import stream_fields

    assert stream_fields(None) is None
    with pytest.raises(ValueError, match="stream"):
        stream_fields((1, 2))
    with pytest.raises(ValueError, match="stream"):
        stream_fields(fields()._replace(chunks=0)[:])


# --- streams on a FastAPI app --------------------------------------------------------------------------------


def llm_app(tokens=40, gap_s=0.001, slow_detokenize=False):
    app = FastAPI()

    @app.get("/generate")
    def generate():
        stagetrace.generation("tiny-gpt", provider="local")
        with stagetrace.stage("prefill", kind="gpu"):
            time.sleep(0.02)

        def body():
            for i in range(tokens):
                with stagetrace.stage("decode_step", kind="gpu"):
                    time.sleep(gap_s)
                with stagetrace.stage("detokenize"):
                    time.sleep(gap_s * 3 if slow_detokenize else 0)
                yield f"data: {i}\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


@pytest.mark.parametrize("telemetry", ["native", "contrib"])
def test_a_streamed_response_carries_its_stream_on_the_root(make_harness, telemetry):
    h = make_harness(settings=stagetrace.Settings(thresholds=DiagnosisThresholds(stream_min_chunks=8)))
    app = llm_app(tokens=40, slow_detokenize=True)
    stagetrace.instrument_fastapi(app, telemetry=telemetry)
    body = TestClient(app).get("/generate").text
    assert body.count("data:") == 40
    (v,) = h.wait_verdicts(1)
    (root,) = h.roots()
    a = root.attributes
    assert a[c.STREAM_CHUNKS] == 40
    assert a[c.STREAM_FIRST_CHUNK_MS] >= v.breakdown["prefill"]
    assert a["stagetrace.stream.first_chunk.bottleneck"] == "prefill"
    assert a["stagetrace.stream.gap.bottleneck"] == "detokenize"
    assert (
        0 < a["stagetrace.stream.gap_p50_ms"] <= a["stagetrace.stream.gap_p99_ms"] <= a["stagetrace.stream.gap_max_ms"]
    )
    assert "STREAM_CPU_BOUND" in v.diagnosis_codes
    # the generative model it said it serves, and the latencies vLLM writes
    assert a[c.GEN_AI_REQUEST_MODEL] == "tiny-gpt" and a[c.GEN_AI_PROVIDER] == "local"
    assert a[c.GEN_AI_LATENCY_TTFT] == pytest.approx(a[c.STREAM_FIRST_CHUNK_MS] / 1e3, abs=1e-5)
    assert a[c.GEN_AI_LATENCY_E2E] == pytest.approx(v.total_ms / 1e3, abs=1e-5)
    assert a[c.GEN_AI_LATENCY_DECODE] > 0 and a[c.GEN_AI_LATENCY_PREFILL] > 0
    # each thread-pool hop of the generator is a wait stage, folded
    assert v.breakdown.get("threadpool.wait", 0) > 0
    assert len(h.spans()) < 40  # not a span a stage a token


def test_stream_and_gen_ai_metrics(make_harness):
    h = make_harness()
    app = llm_app(tokens=12)
    stagetrace.instrument_fastapi(app)
    TestClient(app).get("/generate")
    h.wait_verdicts(1)
    (first,) = h.metric_points(c.METRIC_STREAM_FIRST_CHUNK)
    (gaps,) = h.metric_points(c.METRIC_STREAM_CHUNK_GAP)
    assert first.count == 1 and gaps.count == 11 and gaps.explicit_bounds == c.MS_BUCKETS
    (ttft,) = h.metric_points(c.METRIC_GEN_AI_TTFT)
    (tpot,) = h.metric_points(c.METRIC_GEN_AI_TPOT)
    (duration,) = h.metric_points(c.METRIC_GEN_AI_REQUEST_DURATION)
    assert ttft.explicit_bounds == c.GEN_AI_TTFT_BUCKETS and tpot.explicit_bounds == c.GEN_AI_TPOT_BUCKETS
    assert duration.explicit_bounds == c.GEN_AI_DURATION_BUCKETS
    assert ttft.sum == pytest.approx(first.sum / 1e3) and ttft.sum < duration.sum
    assert dict(ttft.attributes) == {c.GEN_AI_OPERATION: "text_completion", c.GEN_AI_PROVIDER: "local",
                                     c.GEN_AI_REQUEST_MODEL: "tiny-gpt"}  # fmt: skip


def test_generation_rejects_what_cannot_be_a_model():
    with pytest.raises(ValueError, match="model"):
        stagetrace.generation("")
    with pytest.raises(ValueError, match="output_tokens"):
        stagetrace.generation("m", output_tokens=-1)
    with pytest.raises(TypeError, match="provider"):
        stagetrace.generation("m", provider=3)  # type: ignore[arg-type]
    stagetrace.generation("m")  # outside any request: nothing to say it of, no error


def test_a_client_that_goes_away_mid_stream_marks_the_root_and_leaks_nothing(make_harness):
    """On a real uvicorn (in this process, 127.0.0.1): the client reads three chunks and closes."""
    import uvicorn

    h = make_harness()
    app = llm_app(tokens=2000, gap_s=0.002)
    stagetrace.instrument_fastapi(app)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /generate HTTP/1.1\r\nHost: t\r\n\r\n")
            got = b""
            while got.count(b"data:") < 3:
                got += sock.recv(4096)
        h.wait_verdicts(1, timeout=30)
    finally:
        server.should_exit = True
        thread.join(10)
    (root,) = h.roots()
    assert root.attributes[c.ERROR_TYPE] == c.CLIENT_DISCONNECTED
    assert root.status.status_code.name == "ERROR"
    assert 3 <= root.attributes[c.STREAM_CHUNKS] < 2000
    assert len(_state.runtime.registry) == 0  # no trace left in flight


def _otlp_json_lines(spans) -> str:
    """The spans as one line of OTLP JSON (protobuf's JSON mapping: base64 ids), as a Collector's file
    exporter writes them."""
    from google.protobuf.json_format import MessageToJson
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return MessageToJson(encode_spans(spans), indent=None)


def _without_stored_verdict(line: str) -> str:
    import json

    doc = json.loads(line)
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                span["attributes"] = [kv for kv in span.get("attributes", []) if kv["key"] != c.TOTAL_MS]
    return json.dumps(doc)


@pytest.mark.parametrize("stored", [True, False], ids=["stored verdict", "recomputed from the spans"])
def test_the_report_reads_streams_and_composites_back(make_harness, tmp_path, stored):
    import io
    import json

    from stagetrace.cli.report import run_report

    h = make_harness(settings=stagetrace.Settings(thresholds=DiagnosisThresholds(stream_min_chunks=8)))
    app = llm_app(tokens=40, slow_detokenize=True)
    stagetrace.instrument_fastapi(app)
    client = TestClient(app)
    for _ in range(3):
        assert client.get("/generate").text.count("data:") == 40
    verdicts = h.wait_verdicts(3)
    line = _otlp_json_lines(h.spans())
    (tmp_path / "t.jsonl").write_text((line if stored else _without_stored_verdict(line)) + "\n")
    out, err = io.StringIO(), io.StringIO()
    assert run_report([str(tmp_path / "t.jsonl")], as_json=True, out=out, err=err) == 0
    doc = json.loads(out.getvalue())
    assert doc["traces"] == 3, err.getvalue()
    # every occurrence of a folded stage counted, as the exporter's verdict counted it
    mean_decode = sum(v.breakdown["decode_step"] for v in verdicts) / 3
    assert doc["stages"]["decode_step"]["mean_ms"] == pytest.approx(mean_decode, rel=0.02)
    streams = doc["streams"]
    assert streams["streams"] == 3 and streams["chunks_mean"] == 40 and streams["disconnected"] == 0
    # as the exporter judged each stream (on a loaded host a first chunk can wait longest for a worker thread,
    # or a gap's CPU share fall under the rule's: the report must say what the verdicts said, whatever that was)
    gaps = Counter(v.stream.gap_bottleneck for v in verdicts)
    assert streams["gap_bottlenecks"] == dict(gaps) and gaps["detokenize"] >= 2  # the slow detokenizer shows
    assert streams["first_chunk_bottlenecks"] == dict(Counter(v.stream.first_chunk_bottleneck for v in verdicts))
    first = sorted(v.stream.first_chunk_ms for v in verdicts)
    assert streams["first_chunk_ms"]["p50"] == pytest.approx(first[1], rel=0.02)
    cpu_bound = sum("STREAM_CPU_BOUND" in v.diagnosis_codes for v in verdicts)
    assert cpu_bound >= 1 and doc["diagnoses"].get("STREAM_CPU_BOUND") == cpu_bound
    text = io.StringIO()
    assert run_report([str(tmp_path / "t.jsonl")], out=text, err=io.StringIO()) == 0
    assert "Streams (3, 40 chunks on average, 0 disconnected)" in text.getvalue()
    assert "bottleneck between chunks" in text.getvalue()


@pytest.mark.parametrize("telemetry", ["native", "contrib"])
def test_a_generator_that_raises_mid_stream_ends_the_root_with_the_error_and_keeps_its_stages(make_harness, telemetry):
    h = make_harness()
    app = FastAPI()

    @app.get("/generate")
    def generate():
        def body():
            for i in range(30):
                with stagetrace.stage("decode_step"):
                    time.sleep(0.0005)
                    if i == 20:
                        raise RuntimeError("the model fell over")
                yield f"data: {i}\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    stagetrace.instrument_fastapi(app, telemetry=telemetry)
    with pytest.raises(RuntimeError, match="fell over"):
        TestClient(app).get("/generate")
    (v,) = h.wait_verdicts(1)
    (root,) = h.roots()
    assert root.status.status_code.name == "ERROR"
    assert root.attributes[c.STREAM_CHUNKS] == 20  # every chunk sent before it
    steps = [s for s in h.by_name("decode_step") if not s.attributes.get(c.COMPRESSED_SLOWEST)]
    counted = sum(s.attributes.get(c.COMPRESSED_COUNT, 1) for s in steps)
    assert counted == 21  # every occurrence, the failed one included
    assert any(s.status.status_code.name == "ERROR" for s in steps)
    assert v.breakdown["decode_step"] >= 21 * 0.5
    assert len(_state.runtime.registry) == 0  # no trace left in flight


def test_a_name_repeated_under_a_second_parent_folds_there_too(harness):
    with stagetrace.pipeline("generate"):
        for _ in range(2):
            with stagetrace.stage("fetch"):  # twice under the root ...
                pass
        with stagetrace.stage("stream"):
            for _ in range(50):
                with stagetrace.stage("fetch"):  # ... then fifty times under another parent
                    pass
    harness.wait_verdicts(1)
    fetches = harness.by_name("fetch")
    composites = [s for s in fetches if c.COMPRESSED_COUNT in s.attributes]
    assert [s.attributes[c.COMPRESSED_COUNT] for s in composites] == [50 - KEEP_REPEATS]
    assert len(fetches) == 2 + KEEP_REPEATS + 2  # the root's two, the stream's first three, composite, slowest


def test_a_folded_occurrence_that_held_the_event_loop_is_still_blamed(harness):
    async def main():
        with stagetrace.pipeline("render-all"):
            for i in range(8):
                with stagetrace.stage("render"):  # sync work on the loop's thread
                    time.sleep(0.06 if i == 6 else 0.001)  # the long one folds (past the first three)
                await asyncio.sleep(0)

    asyncio.run(main())
    (v,) = harness.wait_verdicts(1)
    d = next((d for d in v.diagnoses if d.code == "EVENT_LOOP_BLOCKED"), None)
    assert d is not None and d.stage == "render", v.diagnoses


# --- a stream is slow by its phases, not its length ---------------------------------------------------------


def _judged(stream, first_ms=200.0, gap_ms=100.0, total_ms=130.0):
    from stagetrace.analysis import build_verdict
    from stagetrace.analysis.streams import StreamThresholds

    kinds = {"prefill": "gpu", "decode": "gpu", "detokenize": "cpu"}
    breakdown = {"prefill": 30.0, "decode": 30.0, "detokenize": 60.0}
    a = TraceAnalysis(total_ms, breakdown, "detokenize", 0.46, total_ms > 200.0, 200.0, 10.0, kinds)
    return build_verdict(
        trace_id="t", root_name="POST /generate", analysis=a, diagnoses=(), signals=TraceSignals(stream=stream),
        stream_thresholds=StreamThresholds(first_ms, gap_ms),
    )  # fmt: skip


def test_a_stream_is_slow_by_its_first_chunk_or_its_gaps_at_their_thresholds_edges():
    at_edge = _judged(summary(first_chunk_ms=200.0, gap_p99_ms=100.0))
    assert not at_edge.slow and at_edge.slow_reason is None  # exactly at both: not over either
    first = _judged(summary(first_chunk_ms=200.1, gap_p99_ms=100.0, first_chunk_breakdown={"prefill": 110.0}))
    assert (first.slow, first.slow_reason) == (True, c.SLOW_FIRST_CHUNK)
    assert (first.bottleneck, first.ratio) == ("prefill", pytest.approx(110.0 / 200.1))  # the first chunk's headline
    gaps = _judged(summary(first_chunk_ms=200.0, gap_p99_ms=100.1))
    assert (gaps.slow, gaps.slow_reason) == (True, c.SLOW_GAP)
    assert (gaps.bottleneck, gaps.ratio) == ("detokenize", pytest.approx(0.6))  # the gaps' headline: 60 of 100 ms
    both = _judged(summary(first_chunk_ms=300.0, gap_p99_ms=150.0))
    assert both.slow_reason == c.SLOW_FIRST_CHUNK  # the first chunk is what the client waits for first
    single = _judged(summary(chunks=1, gap_p99_ms=None, first_chunk_ms=20.0))
    assert not single.slow  # one chunk: no gaps to judge
    assert (first.first_chunk_threshold_ms, first.gap_threshold_ms) == (200.0, 100.0)


def test_a_slow_phase_spent_in_no_stage_is_headed_untracked():
    """As the trace's own headline: a first chunk whose time went to no stage is not headed by the stage that
    ran most before it, still less by one that ran between chunks."""
    waited = _judged(summary(first_chunk_ms=300.0, first_chunk_breakdown={"prefill": 30.0}))
    assert waited.slow_reason == c.SLOW_FIRST_CHUNK
    assert (waited.bottleneck, waited.ratio) == (c.UNTRACKED, pytest.approx(270.0 / 300.0))
    nothing = _judged(summary(first_chunk_ms=300.0, first_chunk_breakdown={}))
    assert (nothing.bottleneck, nothing.ratio) == (c.UNTRACKED, 1.0)  # no stage before it at all
    even = _judged(summary(first_chunk_ms=300.0, first_chunk_breakdown={"prefill": 150.0}))
    assert even.bottleneck == "prefill"  # untracked must exceed the stage, as for the trace
    gaps = _judged(summary(gap_p99_ms=150.0, streaming_ms=1000.0, gap_breakdown={"detokenize": 300.0}))
    assert (gaps.slow_reason, gaps.bottleneck, gaps.ratio) == (c.SLOW_GAP, c.UNTRACKED, pytest.approx(0.7))


def test_a_trace_ranks_by_how_far_its_judging_phase_went_past_its_threshold():
    """``Verdict.slowness``: what the export budget's slowest-of-the-minute and the report's slowest traces rank
    by. A 20 s stream that flowed ranks under a short one whose gaps stalled; a response by its total."""
    long_healthy = _judged(summary(first_chunk_ms=40.0, gap_p99_ms=25.0), total_ms=20_040.0)
    stalled = _judged(summary(first_chunk_ms=40.0, gap_p99_ms=300.0), total_ms=3_000.0)
    late_first = _judged(summary(first_chunk_ms=500.0, gap_p99_ms=25.0), total_ms=900.0)
    assert long_healthy.slowness == pytest.approx(max(40.0 / 200.0, 25.0 / 100.0))
    assert stalled.slowness == pytest.approx(3.0) and late_first.slowness == pytest.approx(2.5)
    assert _judged(None, total_ms=500.0).slowness == pytest.approx(2.5)  # not streamed: 500 ms over 200 ms
    single = _judged(summary(chunks=1, gap_p99_ms=None, first_chunk_ms=20.0), total_ms=20.0)
    assert single.slowness == pytest.approx(0.1)  # no gaps: its first chunk alone


def test_the_budgets_slowest_of_the_minute_is_the_slowest_phase_not_the_longest_stream():
    """One signature, a budget with no tokens left: only the slowest-of-the-minute slot lets a trace through.
    A 20 s healthy stream first, then 3 s streams whose gaps stalled: they are slower, and they get through
    (by length the healthy one held the minute and every stalled one was refused)."""
    from stagetrace.exporter.budget import BudgetLimits, ExportBudget
    from stagetrace.exporter.keep import Keep

    budget = ExportBudget(BudgetLimits(per_s=0.001, burst=10.0, signature_per_s=0.001, signature_burst=0.0), 0.0)
    budget.global_bucket.tokens = 0.0
    sig = ("POST /generate", "decode", ())
    long_healthy = _judged(summary(first_chunk_ms=40.0, gap_p99_ms=25.0), total_ms=20_040.0)
    stalled = _judged(summary(first_chunk_ms=40.0, gap_p99_ms=300.0), total_ms=3_000.0)
    assert budget.admit(Keep.HEALTHY_SAMPLE, sig, long_healthy.slowness, 1.0).kept  # the minute's first
    assert budget.admit(Keep.SLOW, sig, stalled.slowness, 2.0) is Keep.SLOW  # 12 x slower: the minute's slowest
    assert budget.admit(Keep.SLOW, sig, stalled.slowness, 3.0) is Keep.BUDGET  # no slower than the last one


def test_the_reports_slowest_traces_rank_by_slowness():
    from stagetrace.report.aggregate import Aggregator

    agg = Aggregator(keep_slowest=1)
    long_healthy = _judged(summary(first_chunk_ms=40.0, gap_p99_ms=25.0), total_ms=20_040.0)
    stalled = _judged(summary(first_chunk_ms=40.0, gap_p99_ms=300.0), total_ms=3_000.0)
    agg.add(stalled)
    assert not agg.would_keep(long_healthy)
    agg.add(long_healthy)
    assert [v for v, _ in agg.slowest()] == [stalled]


def test_a_long_healthy_stream_is_not_slow_however_long_it_lasts():
    """1,000 chunks at a healthy 20 ms a chunk: 20 s, a hundred times the slow threshold, and not slow."""
    long = _judged(summary(chunks=1000, first_chunk_ms=40.0, streaming_ms=20_000.0, gap_p99_ms=25.0), total_ms=20_040.0)
    assert not long.slow and long.slow_reason is None
    assert long.bottleneck == "detokenize"  # a healthy stream keeps the whole trace's headline
    response = _judged(None, total_ms=20_040.0)  # the same length not streamed: slow by its total
    assert (response.slow, response.slow_reason) == (True, c.SLOW_TOTAL)


def test_stream_thresholds_per_route_over_the_global_ones(monkeypatch):
    from stagetrace.analysis.streams import StreamThresholds

    s = stagetrace.Settings(slow_threshold_ms=300.0, route_slow_thresholds_ms={"/chat": 500.0})
    assert s.stream_thresholds_for("/x") == StreamThresholds(300.0, 100.0)  # the first chunk: the slow threshold
    assert s.stream_thresholds_for("/chat") == StreamThresholds(500.0, 100.0)
    s = stagetrace.Settings(
        stream_first_chunk_threshold_ms=800.0, stream_gap_threshold_ms=40.0,
        route_first_chunk_thresholds_ms={"/chat": 2000.0}, route_gap_thresholds_ms={"/x": 25.0},
    )  # fmt: skip
    assert s.stream_thresholds_for("/chat") == StreamThresholds(2000.0, 40.0)
    assert s.stream_thresholds_for("/x") == StreamThresholds(800.0, 25.0)
    assert s.stream_thresholds_for(None) == StreamThresholds(800.0, 40.0)
    monkeypatch.setenv("STAGETRACE_STREAM_FIRST_CHUNK_MS", "1500")
    monkeypatch.setenv("STAGETRACE_STREAM_GAP_MS", "60")
    assert stagetrace.Settings().stream_thresholds_for(None) == StreamThresholds(1500.0, 60.0)
    monkeypatch.setenv("STAGETRACE_STREAM_GAP_MS", "soon")
    with pytest.raises(ValueError, match="STAGETRACE_STREAM_GAP_MS"):
        stagetrace.Settings()
    monkeypatch.delenv("STAGETRACE_STREAM_GAP_MS")
    with pytest.raises(ValueError, match="route_gap_thresholds_ms"):
        stagetrace.Settings(route_gap_thresholds_ms={"/x": 0}).validate()


def test_slow_streams_are_judged_kept_logged_and_counted_by_their_phase(make_harness, caplog):
    """A stream whose gaps are slow, one whose first chunk is, and a long healthy one, through the exporter:
    the root says why, the keep decision keeps the slow ones only (no healthy share here), the log line says
    which phase, and the trace duration metric counts them by reason."""
    import logging

    settings = stagetrace.Settings(
        healthy_sample=0.0, export_budget_per_s=None, slow_threshold_ms=50.0,
        route_first_chunk_thresholds_ms={"/first": 15.0}, stream_gap_threshold_ms=20.0,
    )  # fmt: skip
    h = make_harness(settings=settings)
    app = FastAPI()

    def streamed(first_s, gap_s, chunks):
        def body():
            with stagetrace.stage("prefill", kind="io"):  # (not cpu: no CPU rule fires, nothing is diagnosed)
                time.sleep(first_s)
            for i in range(chunks):
                if i:
                    with stagetrace.stage("decode_step", kind="io"):
                        time.sleep(gap_s)
                yield f"data: {i}\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    # The healthy long stream's 2 ms gaps are 18 ms under the gap threshold: a busy host's hiccup does not
    # make one of its 59 gaps slow (with 6 ms it did, on a host loaded by other work).
    app.get("/gaps")(lambda: streamed(0.0, 0.03, 10))
    app.get("/first")(lambda: streamed(0.03, 0.001, 10))
    app.get("/long")(lambda: streamed(0.0, 0.002, 60))  # 120 ms of chunks, over the 50 ms slow threshold
    stagetrace.instrument_fastapi(app)
    client = TestClient(app)
    with caplog.at_level(logging.WARNING, logger="stagetrace"):
        for path in ("/gaps", "/first", "/long"):
            client.get(path)
        verdicts = {v.route: v for v in h.wait_verdicts(3)}
        h.flush()
    assert (verdicts["/gaps"].slow_reason, verdicts["/first"].slow_reason) == (c.SLOW_GAP, c.SLOW_FIRST_CHUNK)
    assert not verdicts["/long"].slow and verdicts["/long"].total_ms > 50.0
    kept = {r.attributes[c.HTTP_ROUTE]: r.attributes for r in h.roots()}
    assert set(kept) == {"/gaps", "/first"}, {route: a.get(c.DIAGNOSIS) for route, a in kept.items()}
    assert kept["/gaps"][c.SLOW_REASON] == c.SLOW_GAP and kept["/gaps"][c.STREAM_GAP_THRESHOLD_MS] == 20.0
    assert (
        kept["/first"][c.SLOW_REASON] == c.SLOW_FIRST_CHUNK
        and kept["/first"][c.STREAM_FIRST_CHUNK_THRESHOLD_MS] == 15.0
    )
    said = [r.getMessage() for r in caplog.records if "slow stream" in r.getMessage()]
    assert any(m.startswith("stagetrace: slow stream GET /gaps /gaps: gaps p99 ") and "> 20 ms; bottleneck decode_step"
               in m for m in said), said  # fmt: skip
    assert any(m.startswith("stagetrace: slow stream GET /first /first: first chunk ") and "> 15 ms; bottleneck prefill"
               in m for m in said), said  # fmt: skip
    assert (verdicts["/gaps"].bottleneck, verdicts["/first"].bottleneck) == ("decode_step", "prefill")
    points = {
        (p.attributes[c.HTTP_ROUTE], p.attributes[c.SLOW], p.attributes.get(c.SLOW_REASON)): p.count
        for p in h.metric_points(c.METRIC_TRACE_DURATION)
    }
    assert points == {
        ("/gaps", True, c.SLOW_GAP): 1,
        ("/first", True, c.SLOW_FIRST_CHUNK): 1,
        ("/long", False, None): 1,
    }


def test_the_report_counts_slow_streams_by_their_phase(tmp_path):
    from otlp_lines import kv, line, span
    from stagetrace.cli.report import run_report

    def root(i, reason):
        attrs = {c.TOTAL_MS: 900.0, c.SLOW: reason is not None, c.STREAM_CHUNKS: 20, c.STREAM_FIRST_CHUNK_MS: 10.0}
        if reason:
            attrs[c.SLOW_REASON] = reason
        return line("svc", [span(f"{i:032x}", "a" * 16, "", "GET /g", 0, 900, attrs, kind=2)])

    lines = [root(1, c.SLOW_GAP), root(2, c.SLOW_GAP), root(3, c.SLOW_FIRST_CHUNK), root(4, None)]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    out = io.StringIO()
    assert run_report([str(tmp_path / "t.jsonl")], out=out) == 0
    text = out.getvalue().splitlines()
    assert text[0] == "stagetrace report: 4 traces, 3 slow (75%)"
    assert text[1] == "slow by the gaps 2 (50%), the time to the first chunk 1 (25%)"
    html = tmp_path / "r.html"
    assert run_report([str(tmp_path / "t.jsonl")], html_path=str(html), out=io.StringIO()) == 0
    assert f'<p class="slow-reasons">{text[1]}</p>' in html.read_text()
    assert kv  # (the helper module's other names)
