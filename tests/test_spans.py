"""Span materialisation (``exporter.spans``), field by field: pure functions, so each value is checked
exactly against a record built by hand."""

from __future__ import annotations

import pytest
from opentelemetry.trace import SpanKind, StatusCode

import stagetrace
from stagetrace import conventions as c
from stagetrace.analysis import BatchInfo, Diagnosis, Verdict
from stagetrace.common import wire
from stagetrace.exporter import spans as sp
from stagetrace.settings import MAX_LINKS_PER_SPAN

F = wire.SPAN_INDEX
MS = 1_000_000


def record(name="decode", kind="cpu", start_ms=0.0, end_ms=10.0, **fields):
    base = {f: None for f in wire.STAGE_FIELDS}
    base.update(
        name=name,
        kind=kind,
        span_id=0xA,
        parent_span_id=0xB,
        parent_stage_id=0,
        start_ns=int(start_ms * MS),
        end_ns=int(end_ms * MS),
        on_event_loop=False,
    )
    base.update(fields)
    return wire.ShippedStage(tuple(base[f] for f in wire.STAGE_FIELDS))


def test_a_stage_span_carries_its_times_ids_and_kind():
    span = sp.stage_span(record(on_event_loop=True), 0x1234, 5 * MS, 1, "k=v")
    assert span[F["name"]] == "decode" and span[F["trace_id"]] == 0x1234
    assert (span[F["span_id"]], span[F["parent_span_id"]]) == (0xA, 0xB)
    assert span[F["parent_is_remote"]] is False
    assert span[F["kind"]] == SpanKind.INTERNAL.value
    assert (span[F["start_ns"]], span[F["end_ns"]]) == (5 * MS, 15 * MS)
    assert span[F["status_code"]] == StatusCode.UNSET.value and span[F["status_description"]] == ""
    assert span[F["events"]] == () and span[F["links"]] == ()
    assert (span[F["flags"]], span[F["trace_state"]], span[F["dropped_attributes"]]) == (1, "k=v", 0)
    assert (span[F["dropped_events"]], span[F["dropped_links"]]) == (0, 0)
    assert (span[F["scope_name"]], span[F["scope_version"]]) == (c.INSTRUMENTATION_NAME, stagetrace.__version__)
    assert span[F["attributes"]] == {c.STAGE: "decode", c.STAGE_KIND: "cpu", c.ON_EVENT_LOOP: True}


def test_a_failed_stage_has_the_exception_event_and_an_error_status_cut_to_256_characters():
    message = "x" * 300
    span = sp.stage_span(record(error=("ValueError", message, "Traceback ...")), 1, 0, 1, "")
    ((name, ts, attrs),) = span[F["events"]]
    assert (name, ts) == ("exception", 10 * MS)
    assert attrs == {
        "exception.type": "ValueError",
        "exception.message": message,
        "exception.stacktrace": "Traceback ...",
    }
    assert span[F["status_code"]] == StatusCode.ERROR.value
    assert span[F["status_description"]] == f"ValueError: {message}"[:256]
    assert len(span[F["status_description"]]) == 256


def wait_with(**batch):
    return record("infer.queue", "wait", 0, 20, batch=BatchInfo(**{**BASE_BATCH, **batch}))


BASE_BATCH = dict(id="b1", size=3, items=7, member_index=1, member_items=2, max_size=0)


@pytest.mark.parametrize(
    "error", ["ValueError", ("ValueError", "m"), ("ValueError", "m", 3), ["ValueError", "m", "tb"]]
)
def test_a_stage_record_whose_error_is_not_type_message_and_traceback_is_malformed(error):
    """Read as such where the record is read (the whole trace skipped and counted), not half-way through building
    its spans after its verdict was counted."""
    with pytest.raises(ValueError, match="error must be"):
        record(error=error)
    assert record(error=("ValueError", "m", "tb")).error == ("ValueError", "m", "tb")


def test_batch_attributes_of_a_wait_carry_its_split_rounded_to_microseconds():
    attrs = sp.batch_attributes(wait_with(formation_ms=1.23456, busy_ms=2.34567))
    assert attrs == {
        c.BATCH_ID: "b1",
        c.BATCH_SIZE: 3,
        c.BATCH_ITEMS: 7,
        c.BATCH_INDEX: 1,
        c.BATCH_FORMATION_MS: 1.235,
        c.BATCH_BUSY_MS: 2.346,
    }
    assert sp.batch_attributes(wait_with(formation_ms=1.0, busy_ms=None))[c.BATCH_BUSY_MS] == 0.0


@pytest.mark.parametrize(
    ("kind", "gpu_ms", "share"),
    [("gpu", 7.0, 2.0), ("cpu", 7.0, 2.857), ("gpu", None, 2.857)],
    ids=["gpu-time", "cpu-stage-ignores-gpu-ms", "gpu-stage-without-events"],
)
def test_a_batch_stage_carries_the_members_share_of_its_time(kind, gpu_ms, share):
    # 10 ms of wall time (7 ms on the GPU), this member's 2 of the batch's 7 items
    stage = record("forward", kind, 0, 10, gpu_ms=gpu_ms, batch=BatchInfo(**BASE_BATCH))
    assert sp.batch_attributes(stage)[c.BATCH_SHARE_MS] == share


def test_only_a_members_batch_stage_with_a_max_size_carries_max_size_and_fill():
    head = record("infer", "cpu", batch=BatchInfo(**{**BASE_BATCH, "max_size": 16}, link_trace_id=1, link_span_id=2))
    attrs = sp.batch_attributes(head)
    assert (attrs[c.BATCH_MAX_SIZE], attrs[c.BATCH_FILL]) == (16, 0.4375)
    head3 = record("infer", "cpu", batch=BatchInfo(**{**BASE_BATCH, "max_size": 3}, link_trace_id=1, link_span_id=2))
    assert sp.batch_attributes(head3)[c.BATCH_FILL] == 2.3333  # 7 items over a max of 3, four digits
    inner = record("forward", "cpu", batch=BatchInfo(**{**BASE_BATCH, "max_size": 16}))
    assert c.BATCH_MAX_SIZE not in sp.batch_attributes(inner) and c.BATCH_FILL not in sp.batch_attributes(inner)
    no_max = record("infer", "cpu", batch=BatchInfo(**BASE_BATCH, link_trace_id=1, link_span_id=2))
    assert c.BATCH_FILL not in sp.batch_attributes(no_max)
    assert sp.stage_links(head, 1) == ((1, 2, 1, "", {}),)
    assert sp.stage_links(inner, 1) == ()


@pytest.mark.parametrize(
    "batch",
    [
        BatchInfo("b1", 3, 7, 2, 1, 0, formation_ms=1.5, busy_ms=0.25),
        BatchInfo("b1", 3, 7, 2, 1, 16, 0xAB, 0xCD),
        BatchInfo("b1", 3, 7, 0, 1, 0),
    ],
    ids=["wait", "member-batch-stage", "inner-stage"],
)
def test_batch_attributes_read_back_to_the_same_batch(batch):
    stage = record("s", "cpu", batch=batch)
    link = (batch.link_trace_id, batch.link_span_id) if batch.link_span_id else None
    assert sp.batch_from_attributes(sp.batch_attributes(stage), link) == batch


def test_batch_attributes_of_the_wrong_types_read_as_absent():
    attrs = {c.BATCH_ID: "b", c.BATCH_SIZE: True, c.BATCH_ITEMS: "7", c.BATCH_BUSY_MS: 3.0}
    assert sp.batch_from_attributes(attrs, None) == BatchInfo("b", 0, 0, 0, 1, 0, 0, 0, None, None)
    assert sp.batch_from_attributes({c.BATCH_ID: 5}, None) is None


def verdict(**kw):
    base = dict(
        trace_id="t",
        root_name="GET /x",
        total_ms=100.0,
        breakdown={"decode": 12.3456789, "infer": 40.0},
        bottleneck="infer",
        ratio=0.4,
        slow=False,
        slow_threshold_ms=200.0,
        untracked_ms=47.6543,
        gpu_utilization=0.5,
        loop_lag_ms=3.0,
    )
    base.update(kw)
    return Verdict(**base)


def test_verdict_attributes_round_the_breakdown_to_microseconds():
    attrs = sp.verdict_attributes(verdict())
    assert attrs[c.STAGES] == ("decode", "infer") and attrs[c.STAGES_MS] == (12.346, 40.0)
    assert attrs[c.UNTRACKED_MS] == 47.654 and attrs[c.BOTTLENECK_RATIO] == 0.4


def test_a_verdict_without_a_bottleneck_has_no_ratio_but_every_later_field():
    attrs = sp.verdict_attributes(verdict(breakdown={}, bottleneck=None, ratio=0.0))
    assert c.BOTTLENECK_RATIO not in attrs and c.BOTTLENECK_STAGE not in attrs
    assert attrs[c.GPU_UTILIZATION] == 0.5 and attrs[c.LOOP_LAG_MS] == 3.0  # fields after the ratio
    assert c.STAGES not in attrs and c.DIAGNOSIS not in attrs


def root_span(attributes):
    return wire.WireSpan._make(
        (
            "GET /x",
            1,
            2,
            0,
            False,
            SpanKind.SERVER.value,
            0,
            100 * MS,
            attributes,
            (("earlier", 5, {}),),
            (),
            0,
            "",
            "s",
            "1",
            1,
            "",
            0,
            0,
            0,
        )
    )


QUERY_ATTRS = {"http.target": "/a?b=1?c", "url.full": "http://h/y?z=1", "url.query": "z=1", "http.url": "/plain"}


def test_the_root_loses_its_query_strings_by_default_and_gets_one_event_per_diagnosis():
    d = Diagnosis("QUEUEING", "m", "a", stage="threadpool.wait")
    root = sp.root_with_verdict(root_span(dict(QUERY_ATTRS)), verdict(diagnoses=(d,)))
    attrs = root[F["attributes"]]
    assert (attrs["http.target"], attrs["url.full"], attrs["http.url"]) == ("/a", "http://h/y", "/plain")
    assert "url.query" not in attrs and attrs[c.DIAGNOSIS] == ("QUEUEING",)
    earlier, (name, ts, event) = root[F["events"]]
    assert earlier == ("earlier", 5, {}) and (name, ts) == (c.DIAGNOSIS_EVENT, 100 * MS)
    assert event == {
        c.DIAGNOSIS_EVENT_CODE: "QUEUEING",
        c.DIAGNOSIS_EVENT_MESSAGE: "m",
        c.DIAGNOSIS_EVENT_ADVICE: "a",
        c.DIAGNOSIS_EVENT_STAGE: "threadpool.wait",
    }
    kept = sp.root_with_verdict(root_span(dict(QUERY_ATTRS)), verdict(), keep_query_strings=True)
    assert {k: kept[F["attributes"]][k] for k in QUERY_ATTRS} == QUERY_ATTRS


def test_a_batch_span_keeps_its_links_up_to_the_bound_and_chains_the_rest_on_child_spans():
    def with_links(n):
        root = list(root_span({c.BATCH_ID: "b", "other": 1}))
        root[F["links"]] = tuple((i + 1, i + 1, 1, "", {}) for i in range(n))
        return wire.WireSpan._make(root)

    assert sp.batch_spans(with_links(MAX_LINKS_PER_SPAN), lambda: 99) == [with_links(MAX_LINKS_PER_SPAN)]
    head, more = sp.batch_spans(with_links(MAX_LINKS_PER_SPAN + 1), lambda: 99)
    assert len(head[F["links"]]) == MAX_LINKS_PER_SPAN
    assert more[F["name"]] == "GET /x members" and more[F["span_id"]] == 99 and more[F["parent_span_id"]] == 2
    assert more[F["parent_is_remote"]] is False and more[F["events"]] == ()
    assert more[F["attributes"]] == {c.BATCH_ID: "b"} and len(more[F["links"]]) == 1


# --- other instrumentations' spans read as stages (exporter/foreign.py) ------------------------------------


def foreign_span(name, span_id, parent, start_ms, end_ms, scope="fastapi", status=StatusCode.UNSET.value):
    span = list(root_span({"code.function.name": "app.dep"}))
    span[F["name"]], span[F["span_id"]], span[F["parent_span_id"]] = name, span_id, parent
    span[F["start_ns"]], span[F["end_ns"]] = int(start_ms * MS), int(end_ms * MS)
    span[F["scope_name"]], span[F["status_code"]], span[F["kind"]] = scope, status, SpanKind.INTERNAL.value
    span[F["events"]] = ()
    return wire.WireSpan._make(span)


def test_fastapis_operation_spans_are_read_as_stages_on_the_stages_clock():
    from stagetrace.exporter.foreign import split_foreign_stages

    deps = foreign_span("fastapi.dependencies", 0xD, 0x1, 10, 15)
    failed = foreign_span("fastapi.serialization", 0xE, 0x1, 20, 22, status=StatusCode.ERROR.value)
    endpoint = foreign_span("fastapi.endpoint", 0xF, 0x1, 15, 20)
    lookalike = foreign_span("fastapi.dependencies", 0x10, 0x1, 0, 1, scope="someone.else")
    stages, others = split_foreign_stages([deps, failed, endpoint, lookalike], offset=5 * MS)
    assert others == [endpoint, lookalike]  # the envelope of the user's code, and another scope's span
    (d, d_span), (s, s_span) = stages
    assert (d.name, d.kind, d.span_id, d.parent_span_id) == ("fastapi.dependencies", "cpu", 0xD, 0x1)
    assert (d.start_ns, d.end_ns, d.parent_stage_id, d.on_event_loop, d.error) == (5 * MS, 10 * MS, 0, False, None)
    assert d_span is deps and s.error is not None and s_span is failed


def test_stages_inside_a_span_read_as_a_stage_are_linked_to_it_through_other_spans():
    from stagetrace.exporter.foreign import link_enclosing_stages

    def stage(name, span_id, parent, parent_stage=0):
        added = wire.ShippedStage.added(name, "cpu", span_id, parent, 0, 1)
        added.parent_stage_id = parent_stage
        return added

    deps = stage("fastapi.dependencies", 0xD, 0x1)
    auth = stage("auth", 0xA, 0xC)  # under a client span, under the dependencies
    outer = stage("decode", 0xB, 0x1)
    client = foreign_span("http.client", 0xC, 0xD, 0, 1, scope="httpx")
    looped = [foreign_span("a", 0x20, 0x21, 0, 1, scope="x"), foreign_span("b", 0x21, 0x20, 0, 1, scope="x")]
    lost = stage("lost", 0xE, 0x20, parent_stage=0xB)
    link_enclosing_stages([deps, auth, outer, lost], [client, *looped])
    assert (auth.parent_stage_id, deps.parent_stage_id, outer.parent_stage_id) == (0xD, 0, 0)
    assert lost.parent_stage_id == 0xB  # a cycle of foreign parents ends the walk; the recorded parent stays


def test_a_span_read_as_a_stage_keeps_its_own_attributes_and_gains_the_stage_ones():
    from stagetrace.exporter.foreign import as_stage_span

    span = foreign_span("fastapi.background_task", 0xD, 0x1, 0, 3)
    out = as_stage_span(span, "cpu", {c.LATE: True})
    assert out[F["attributes"]] == {
        "code.function.name": "app.dep",
        c.STAGE: "fastapi.background_task",
        c.STAGE_KIND: "cpu",
        c.LATE: True,
    }
    assert out[F["scope_name"]] == "fastapi" and out[F["span_id"]] == 0xD
    assert as_stage_span(span, "cpu")[F["attributes"]][c.STAGE_KIND] == "cpu"


# --- values at their edges: folded stages, a stream's root, the wire's checks -----------------------------------


def test_a_folded_stage_says_how_many_it_folds_and_their_sum_least_and_most_to_the_microsecond():
    folded = record("decode_step", compressed=(97, 123_456_789, 1_000_400, 2_345_678))
    attrs = sp.stage_span(folded, 1, 0, 1, "")[F["attributes"]]
    assert attrs["stagetrace.compressed.count"] == 97
    assert attrs["stagetrace.compressed.sum_ms"] == 123.457  # 123.456789 ms to three places
    assert attrs["stagetrace.compressed.min_ms"] == 1.0  # 1.0004 ms
    assert attrs["stagetrace.compressed.max_ms"] == 2.346
    assert "stagetrace.compressed.slowest" not in attrs
    slowest = sp.stage_span(record("decode_step", example=True), 1, 0, 1, "")[F["attributes"]]
    assert slowest["stagetrace.compressed.slowest"] is True and "stagetrace.compressed.count" not in slowest
    plain = sp.stage_span(record("decode_step"), 1, 0, 1, "")[F["attributes"]]
    assert not any(k.startswith("stagetrace.compressed.") for k in plain)


def test_a_stages_own_attributes_and_the_callers_extra_ones_are_kept_and_the_extra_ones_win():
    st = record(attributes={"model": "a", "shared": 1})
    attrs = sp.stage_attributes(st, {"shared": 2, "extra": True})
    assert (attrs["model"], attrs["shared"], attrs["extra"]) == ("a", 2, True)
    assert attrs[c.STAGE] == "decode" and attrs[c.STAGE_KIND] == "cpu"


def streamed(**kw):
    from stagetrace.analysis.streams import StreamSummary

    base = dict(
        chunks=12, first_chunk_ms=45.67891, streaming_ms=220.0004, gap_p50_ms=18.0, gap_p99_ms=31.23456,
        gap_max_ms=40.5, send_wait_ms=0.25, disconnected=False, first_chunk_bottleneck="prefill",
        gap_bottleneck="decode", first_chunk_breakdown={"queue": 5.0, "prefill": 38.0},
        gap_breakdown={"decode": 200.0, "detokenize": 15.0}, gaps=None,
    )  # fmt: skip
    base.update(kw)
    return StreamSummary(**base)


def test_a_streamed_roots_attributes_are_its_summary_to_the_microsecond():
    attrs = sp.verdict_attributes(verdict(stream=streamed()))
    assert attrs["stagetrace.stream.chunks"] == 12
    assert attrs["stagetrace.stream.first_chunk_ms"] == 45.679
    assert attrs["stagetrace.stream.duration_ms"] == 220.0
    assert attrs["stagetrace.stream.gap_p50_ms"] == 18.0 and attrs["stagetrace.stream.gap_p99_ms"] == 31.235
    assert attrs["stagetrace.stream.gap_max_ms"] == 40.5 and attrs["stagetrace.stream.send_wait_ms"] == 0.25
    assert attrs["stagetrace.stream.first_chunk.bottleneck"] == "prefill"
    assert attrs["stagetrace.stream.gap.bottleneck"] == "decode"
    assert not any(k.startswith("gen_ai.") for k in attrs)  # not a generative request: no GenAI latencies
    one = sp.verdict_attributes(verdict(stream=streamed(chunks=1, gap_p50_ms=None, gap_p99_ms=None, gap_max_ms=None)))
    assert one["stagetrace.stream.chunks"] == 1 and "stagetrace.stream.gap_p99_ms" not in one
    assert "stagetrace.stream.chunks" not in sp.verdict_attributes(verdict())


def test_a_generative_streams_root_has_vllms_latencies_in_seconds():
    gen_ai = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m"}
    kinds = {"queue": "wait", "prefill": "gpu", "decode": "gpu", "detokenize": "cpu"}
    root = sp.root_with_verdict(
        root_span({"gen_ai.request.model": "set by the app"}),
        verdict(total_ms=265.6789, stream=streamed(), gen_ai=gen_ai, stage_kinds=kinds),
    )
    attrs = root[F["attributes"]]
    assert attrs["gen_ai.latency.time_to_first_token"] == 0.045679  # 45.67891 ms, to the microsecond
    assert attrs["gen_ai.latency.e2e"] == 0.265679
    assert attrs["gen_ai.latency.time_in_queue"] == 0.005
    assert attrs["gen_ai.latency.time_in_model_prefill"] == 0.038
    assert attrs["gen_ai.latency.time_in_model_decode"] == 0.2  # detokenize is not the model's
    assert attrs["gen_ai.operation.name"] == "chat"  # the request's own gen_ai attributes
    assert attrs["gen_ai.request.model"] == "set by the app"  # ... never over what the root already says
    assert root[F["status_code"]] == StatusCode.UNSET.value and "error.type" not in attrs


def test_a_stream_the_client_left_is_an_error_of_type_connection_error_unless_the_root_says_otherwise():
    gone = sp.root_with_verdict(root_span({}), verdict(stream=streamed(disconnected=True)))
    assert gone[F["status_code"]] == StatusCode.ERROR.value
    assert gone[F["attributes"]]["error.type"] == "ConnectionError"
    typed = sp.root_with_verdict(root_span({"error.type": "500"}), verdict(stream=streamed(disconnected=True)))
    assert typed[F["attributes"]]["error.type"] == "500" and typed[F["status_code"]] == StatusCode.ERROR.value


def test_the_keep_decisions_extra_attributes_land_on_the_root_and_query_strings_stay_when_asked():
    extra = {"stagetrace.sampling.adjusted_count": 4.0}
    root = sp.root_with_verdict(root_span(dict(QUERY_ATTRS)), verdict(), keep_query_strings=True, extra=extra)
    attrs = root[F["attributes"]]
    assert attrs["stagetrace.sampling.adjusted_count"] == 4.0
    assert attrs["http.target"] == "/a?b=1?c" and attrs["url.query"] == "z=1"
    assert (root[F["name"]], root[F["start_ns"]], root[F["end_ns"]]) == ("GET /x", 0, 100 * MS)


def test_a_diagnosis_with_evidence_carries_it_on_its_event_and_one_without_has_none():
    with_evidence = Diagnosis("CPU_OVERSUBSCRIBED", "m", "a", evidence="12 threads on 2 CPUs")
    bare = Diagnosis("UNTRACKED_TIME", "m2", "a2")
    (_, _, first), (_, _, second) = sp.diagnosis_events(verdict(diagnoses=(with_evidence, bare)), 7)
    assert first[c.DIAGNOSIS_EVENT_EVIDENCE] == "12 threads on 2 CPUs"
    assert c.DIAGNOSIS_EVENT_EVIDENCE not in second and c.DIAGNOSIS_EVENT_STAGE not in second


@pytest.mark.parametrize(
    "value",
    [[1, 2, 3, 4], (1, 2, 3), (1, 2, 3, 4, 5), (1, 2.0, 3, 4), (1, 2, -1, 4), (True, 2, 3, 4), (1, "2", 3, 4)],
)
def test_a_malformed_folded_field_is_a_clear_error(value):
    from stagetrace.analysis.model import compressed_info

    with pytest.raises(ValueError, match=r"^malformed compressed field$"):
        compressed_info(value)


def test_a_folded_field_of_zeros_and_of_its_own_type_is_read_as_is():
    from stagetrace.analysis.model import CompressedInfo, compressed_info

    assert compressed_info((0, 0, 0, 0)) == CompressedInfo(0, 0, 0, 0)
    info = CompressedInfo(3, 30, 5, 15)
    assert compressed_info(info) is info and compressed_info(None) is None


def test_a_stage_span_has_the_callers_extra_attributes_its_batch_s_and_its_link_with_the_trace_s_flags():
    member = record("infer", batch=BatchInfo(**{**BASE_BATCH, "max_size": 16}, link_trace_id=7, link_span_id=8))
    span = sp.stage_span(member, 1, 0, 3, "", extra={c.LATE: True})
    attrs = span[F["attributes"]]
    assert attrs[c.LATE] is True and attrs[c.BATCH_ID] == BASE_BATCH["id"] and attrs[c.BATCH_MAX_SIZE] == 16
    assert span[F["links"]] == ((7, 8, 3, "", {}),)  # the trace's flags (3), not the default


def test_a_member_batch_stage_of_an_empty_batch_has_a_fill_of_zero():
    empty = record(
        "infer", batch=BatchInfo(**{**BASE_BATCH, "items": 0, "max_size": 16}, link_trace_id=1, link_span_id=2)
    )
    assert sp.batch_attributes(empty)[c.BATCH_FILL] == 0.0


def test_a_folded_stage_of_seconds_keeps_milliseconds_to_three_places():
    # 10 s summed, the least 2 s and the most 3 s: a wrong divisor shows at this size; 1.234567 ms keeps three places
    folded = record("decode_step", compressed=(3, 10_000_000_000, 2_000_000_000, 3_000_000_000))
    attrs = sp.stage_span(folded, 1, 0, 1, "")[F["attributes"]]
    assert (attrs[c.COMPRESSED_SUM_MS], attrs[c.COMPRESSED_MIN_MS], attrs[c.COMPRESSED_MAX_MS]) == (
        10_000.0, 2_000.0, 3_000.0,
    )  # fmt: skip
    small = sp.stage_span(record("s", compressed=(2, 2_469_134, 1_234_567, 1_234_567)), 1, 0, 1, "")[F["attributes"]]
    assert small[c.COMPRESSED_MIN_MS] == 1.235 and type(small[c.COMPRESSED_MIN_MS]) is float


def test_an_offload_stage_carries_its_call_s_facts_and_a_failed_call_its_error_type():
    from stagetrace.analysis.offload import OffloadInfo

    def placed(**fields):  # as exporter/offload.py leaves it: the call's facts in place of its raw readings
        stage = record("tokenize", "offload", **fields)
        stage.offload = OffloadInfo("ProcessPoolExecutor", 2, 3, 5000, None, "spawn", 42, 1)
        return stage

    attrs = sp.stage_span(placed(), 1, 0, 1, "")[F["attributes"]]
    assert {k: v for k, v in attrs.items() if k.startswith("stagetrace.offload.")} == {
        c.OFFLOAD_EXECUTOR: "ProcessPoolExecutor",
        c.OFFLOAD_MAX_WORKERS: 2,
        c.OFFLOAD_IN_FLIGHT: 3,
        c.OFFLOAD_ARGS_BYTES: 5000,
        c.OFFLOAD_START_METHOD: "spawn",
        c.OFFLOAD_WORKER_PID: 42,
        c.OFFLOAD_WORKER_TASK_SEQ: 1,
    }  # fmt: skip  (no result came back: no result_bytes)
    assert c.ERROR_TYPE not in attrs
    broken = placed(error=("BrokenProcessPool", "a worker died", ""))
    assert sp.stage_span(broken, 1, 0, 1, "")[F["attributes"]][c.ERROR_TYPE] == "BrokenProcessPool"
    failed_stage = sp.stage_span(record("decode", error=("ValueError", "m", "")), 1, 0, 1, "")[F["attributes"]]
    assert c.ERROR_TYPE not in failed_stage  # a stage of the application's own says it in its exception event
