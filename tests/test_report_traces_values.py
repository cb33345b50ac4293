"""The figures ``stagetrace report`` reads off one trace (``report/traces.py``), pinned on hand-computed inputs at
their edges: which span is the global root, a stored verdict's fields read back by their table's types, a
verdict recomputed from the stages (nesting through other spans, late stages, composites, the root's signals
and threshold), the calls handed to process pools, how many requests a trace stands for, the waterfall's bars,
and a batch's figures. Every expected value is written from the convention's text (``conventions.py``, the
functions' docstrings), not from the code's own second path."""

from __future__ import annotations

from typing import Any

from otlp_lines import MS, T1
from stagetrace import conventions as c
from stagetrace.analysis import DiagnosisThresholds
from stagetrace.analysis.offload import OffloadedCall, OffloadInfo
from stagetrace.analysis.streams import StreamSummary
from stagetrace.report.loader import Span
from stagetrace.report.traces import (
    adjusted_count,
    batch_execution,
    batch_waits,
    global_root,
    verdict_for_trace,
    waterfall,
)

ROOT = "a" * 16


def sid(n: int) -> str:
    """The n-th span id, as OTLP writes it (16 hex digits)."""
    return f"{n:016x}"


def at(span_id: str, parent: str, name: str, start_ms: float, end_ms: float, attrs: dict[str, Any] | None = None,
       service: str = "svc") -> Span:  # fmt: skip
    """A span of trace T1 as the loader reads it back, its times in ms (whole and half ms are exact in ns)."""
    return Span(T1, span_id, parent, name, int(start_ms * MS), int(end_ms * MS), attributes=dict(attrs or {}),
                service=service)  # fmt: skip


def staged(span_id: str, parent: str, name: str, start_ms: float, end_ms: float, **attrs: Any) -> Span:
    """A stage span: its stage name (the span's name unless ``stage`` says another) and the attributes given."""
    return at(span_id, parent, name, start_ms, end_ms, {c.STAGE: attrs.pop("stage", name), **attrs})


# --- the global root ------------------------------------------------------------------------------------------


def test_the_global_root_is_the_span_without_a_parent_even_when_another_starts_before_it():
    """A child whose clock runs 5 ms behind (it starts before its root) and an orphan whose parent was never
    exported, starting first: the verdict and the waterfall hang off the root, not off either of them."""
    root = at(ROOT, "", "POST /gen", 10, 100)
    skewed = at("b" * 16, ROOT, "decode", 5, 20)
    orphan = at("c" * 16, "f" * 16, "model", 0, 50)
    assert global_root([skewed, root]) is root  # no orphan: still the root, not the earliest span
    assert global_root([orphan, skewed, root]) is root


def test_without_a_root_the_global_root_is_the_earliest_orphan_not_its_earlier_child():
    """The root's service exported nothing: the span whose parent is missing stands for it, even where its own
    child starts before it (clock skew); where every parent is present (a cycle), the earliest span."""
    orphan = at("b" * 16, "f" * 16, "POST /infer", 10, 100)
    child = at("c" * 16, "b" * 16, "infer", 5, 20)
    assert global_root([child, orphan]) is orphan
    first, second = at("1" * 16, "2" * 16, "x", 3, 9), at("2" * 16, "1" * 16, "y", 4, 9)
    assert global_root([second, first]) is first


def test_of_two_roots_starting_together_the_longer_is_the_global_root():
    """Two spans without a parent start at 0 ms: the one that lasts longer (100 ms, not 50 ms) holds the other."""
    short, long = at("1" * 16, "", "short", 0, 50), at("2" * 16, "", "long", 0, 100)
    assert global_root([short, long]) is long
    assert global_root([long, short]) is long
    assert global_root([at("3" * 16, "", "later", 1, 200), short]) is short  # the earlier start first


# --- a stored verdict read back -------------------------------------------------------------------------------


def stored_root(attrs: dict[str, Any], end_ms: float = 20) -> Span:
    return at(ROOT, "", "POST /gen", 0, end_ms, {c.TOTAL_MS: float(end_ms), **attrs})


def test_a_code_stored_without_its_event_and_unknown_to_the_rules_has_no_advice():
    """Another writer's own code, without a diagnosis event: its advice is empty, not the text "None"."""
    v = verdict_for_trace([stored_root({c.DIAGNOSIS: ["MY_RULE"]})])
    ((code, message, advice, stage),) = [(d.code, d.message, d.advice, d.stage) for d in v.diagnoses]
    assert (code, message, advice, stage) == ("MY_RULE", "", "", None)


def test_a_stored_verdict_s_fields_of_the_wrong_type_read_as_absent():
    """Each field is read as the type ``conventions.VERDICT_FIELDS`` gives it, else absent: a bottleneck that
    is a number, a slow flag that is a string, a CPU count that is a string or a boolean, a list of blockers
    that is empty or holds a number."""
    wrong = verdict_for_trace([stored_root({c.BOTTLENECK_STAGE: 5, c.SLOW: "true", c.PROCESS_CPUS: True,
                                            c.BLOCKED_BY: []})])  # fmt: skip
    assert (wrong.bottleneck, wrong.slow, wrong.process_cpus, wrong.blocked_by) == (None, False, None, None)
    assert wrong.diagnosis_sample_rate == 1.0  # not said (written before the CPU budget): every trace diagnosed
    mixed = verdict_for_trace([stored_root({c.PROCESS_CPUS: "4", c.BLOCKED_BY: ["resize@" + "9" * 32, 3]})])
    assert (mixed.process_cpus, mixed.blocked_by) == (None, None)
    right = verdict_for_trace([stored_root({c.BOTTLENECK_STAGE: "decode", c.SLOW: True, c.PROCESS_CPUS: 4,
                                            c.BLOCKED_BY: ["resize@" + "9" * 32],
                                            c.DIAGNOSIS_SAMPLE_RATE: 0.25})])  # fmt: skip
    assert (right.bottleneck, right.slow, right.process_cpus, right.blocked_by, right.diagnosis_sample_rate) == (
        "decode", True, 4, ("resize@" + "9" * 32,), 0.25,
    )  # fmt: skip


def test_a_stored_stream_missing_its_durations_reads_them_as_zero_and_a_dropped_client_as_disconnected():
    """Three chunks, the first at 12.5 ms, a gap p50 of 4 ms, no duration or send wait stored, the client gone
    (error.type ConnectionError): 0 ms each, disconnected, no phase split (empty, as the stages are not read)."""
    said = {c.STREAM_CHUNKS: 3, c.STREAM_FIRST_CHUNK_MS: 12.5, "stagetrace.stream.gap_p50_ms": 4.0}
    v = verdict_for_trace([stored_root({**said, c.ERROR_TYPE: c.CLIENT_DISCONNECTED})])
    assert v.stream == StreamSummary(
        chunks=3, first_chunk_ms=12.5, streaming_ms=0.0, gap_p50_ms=4.0, gap_p99_ms=None, gap_max_ms=None,
        send_wait_ms=0.0, disconnected=True, first_chunk_bottleneck=None, gap_bottleneck=None,
        first_chunk_breakdown={}, gap_breakdown={}, gaps=None,
    )  # fmt: skip
    one = verdict_for_trace([stored_root({c.STREAM_CHUNKS: 1, c.ERROR_TYPE: "TimeoutError"})]).stream
    assert one is not None and (one.first_chunk_ms, one.streaming_ms, one.disconnected) == (0.0, 0.0, False)
    assert verdict_for_trace([stored_root({c.STREAM_CHUNKS: 0})]).stream is None  # no chunk: not streamed


def offload_stage(span_id: str, name: str, start_ms: float, end_ms: float, **facts: Any) -> Span:
    attrs = {c.STAGE_KIND: "offload", **{key: facts[field] for field, key, _ in c.OFFLOAD_FIELDS if field in facts}}
    return staged(span_id, ROOT, name, start_ms, end_ms, **attrs)


def test_a_stored_verdict_s_offloaded_calls_have_their_children_s_times():
    """A call to a pool of 2 found 3 calls in flight: its children under it queued 1-4 ms, sent 4-6, ran 6-13
    and returned 13-14 (3, 2, 7 and 1 ms); a second call whose worker never reported has only its queue (2 ms)
    and is read as not reported; a run exported without its parent (a root of its own, starting after the
    request's root) is no call's, not even that of the call whose span id is 1."""
    facts = dict(executor="ProcessPoolExecutor", max_workers=2, in_flight=3, args_bytes=100, result_bytes=40,
                 start_method="fork", worker_pid=77, worker_task_seq=2)  # fmt: skip
    call = offload_stage("1" * 16, "tokenize", 1, 15, **facts)
    call.name = "submit tokenize"  # the stage's name is its attribute's, not the span's
    times = ((c.OFFLOAD_QUEUE_STAGE, 1, 4), (c.OFFLOAD_SEND_STAGE, 4, 6), (c.OFFLOAD_RUN_STAGE, 6, 13),
             (c.OFFLOAD_RETURN_STAGE, 13, 14))  # fmt: skip
    children = [staged(sid(0x20 + i), "1" * 16, name, a, b) for i, (name, a, b) in enumerate(times)]
    lost = offload_stage(sid(1), "embed", 15, 19, executor="multiprocessing.Pool")
    lost_queue = staged("7" * 16, sid(1), c.OFFLOAD_QUEUE_STAGE, 15, 17)
    stray = staged("c" * 16, "", c.OFFLOAD_RUN_STAGE, 5, 6)
    v = verdict_for_trace([stored_root({}), call, *children, lost, lost_queue, stray])
    assert v.offloads == (
        OffloadedCall("tokenize", OffloadInfo(**facts), 3.0, 2.0, 7.0, 1.0, True),
        OffloadedCall("embed", OffloadInfo("multiprocessing.Pool"), 2.0, 0.0, 0.0, 0.0, False),
    )
    assert v.offloads[0].saturated  # 3 in flight > 2 workers
    assert verdict_for_trace([stored_root({}), stray]).offloads == ()  # no call handed to a pool


# --- a verdict recomputed from the stages --------------------------------------------------------------------


SIGNALS = {
    c.GPU_UTILIZATION: 0.25, c.GIL_PRESSURE_MS: 3.5, c.CPU_PRESSURE_MS: 4.5, c.LOOP_LAG_MS: 6.5,
    c.LOOP_HELD_MS: 1.5, c.PROCESS_CPUS: 4, c.PROCESS_CPUS_USED: 2.5, c.PROCESS_RUNNABLE: 3.0,
    c.REQUESTS_IN_FLIGHT: 1.5,
}  # fmt: skip


def on_the_loop(**root_attrs: Any) -> list[Span]:
    """A root of 80 ms (no verdict on it) and a sync stage 'resize' (span 'blocking_call', no kind) that ran
    10-40 ms (30 ms) on the event-loop thread."""
    return [
        at(ROOT, "", "POST /gen", 0, 80, root_attrs),
        staged("b" * 16, ROOT, "blocking_call", 10, 40, stage="resize", **{c.ON_EVENT_LOOP: True}),
    ]


def test_a_recomputed_verdict_carries_the_root_s_signals_route_model_and_threshold():
    """The root's signals as they were measured; 80 ms is over the root's own 50 ms threshold (slow) though the
    default is 200 ms; 'resize' is charged its 30 ms, a stage without a kind is a CPU stage, the rest (50 ms)
    is in no stage and heads the verdict (50 / 80 = 0.625); the 30 ms stage on the loop is >= 20 ms."""
    spans = on_the_loop(**SIGNALS, **{c.HTTP_ROUTE: "/gen", c.GEN_AI_REQUEST_MODEL: "tiny", c.SLOW_THRESHOLD_MS: 50.0})
    v = verdict_for_trace(spans)
    assert (v.trace_id, v.root_name, v.route, v.gen_ai) == (T1, "POST /gen", "/gen", {c.GEN_AI_REQUEST_MODEL: "tiny"})
    assert (v.total_ms, v.slow, v.slow_threshold_ms) == (80.0, True, 50.0)
    assert (v.breakdown, dict(v.stage_kinds)) == ({"resize": 30.0}, {"resize": "cpu"})
    assert (v.bottleneck, v.untracked_ms, v.ratio) == (c.UNTRACKED, 50.0, 0.625)
    assert (v.gpu_utilization, v.gil_pressure_ms, v.cpu_pressure_ms, v.loop_lag_ms, v.loop_held_ms) == (
        0.25, 3.5, 4.5, 6.5, 1.5,
    )  # fmt: skip
    assert (v.process_cpus, v.process_cpus_used, v.process_runnable, v.requests_in_flight) == (4, 2.5, 3.0, 1.5)
    (blocked,) = [d for d in v.diagnoses if d.code == "EVENT_LOOP_BLOCKED"]
    assert blocked.stage == "resize" and "30.0 ms" in blocked.message


def test_a_recomputed_verdict_judges_by_the_thresholds_given_and_the_root_s_threshold_at_its_edge():
    """The event-loop rule under a 40 ms minimum does not fire for a 30 ms stage; 80 ms against the root's
    threshold of exactly 80 ms is not over it, nor against the default 200 ms; with no threshold on the root,
    the one given (50 ms) judges it slow."""
    codes = verdict_for_trace(on_the_loop(), thresholds=DiagnosisThresholds(event_loop_stage_ms=40.0)).diagnosis_codes
    assert "EVENT_LOOP_BLOCKED" not in codes
    at_edge = verdict_for_trace(on_the_loop(**{c.SLOW_THRESHOLD_MS: 80.0}), slow_threshold_ms=50.0)
    assert (at_edge.slow, at_edge.slow_threshold_ms) == (False, 80.0)
    by_default = verdict_for_trace(on_the_loop())
    assert (by_default.slow, by_default.slow_threshold_ms) == (False, 200.0)
    given = verdict_for_trace(on_the_loop(), slow_threshold_ms=50.0)
    assert (given.slow, given.slow_threshold_ms) == (True, 50.0)


def test_a_recomputed_verdict_leaves_out_what_the_root_does_not_say_or_says_wrongly():
    """No signals on the root: none on the verdict; a route that is a number: no route; a load without the
    CPUs used (or without the runnable threads): no load at all; a stage not on the loop: no loop finding."""
    spans = on_the_loop(**{c.HTTP_ROUTE: 5, c.PROCESS_CPUS: 4, c.PROCESS_RUNNABLE: 3.0, c.REQUESTS_IN_FLIGHT: 1.0})
    del spans[1].attributes[c.ON_EVENT_LOOP]
    v = verdict_for_trace(spans)
    assert (v.route, v.gen_ai, v.gpu_utilization, v.gil_pressure_ms, v.loop_lag_ms) == (None, None, None, None, None)
    assert (v.process_cpus, v.process_cpus_used, v.process_runnable, v.requests_in_flight) == (None,) * 4
    assert "EVENT_LOOP_BLOCKED" not in v.diagnosis_codes
    no_runnable = on_the_loop(**{c.PROCESS_CPUS: 4, c.PROCESS_CPUS_USED: 2.5})
    assert verdict_for_trace(no_runnable).process_cpus is None
    load = {c.PROCESS_CPUS: 4, c.PROCESS_CPUS_USED: 2.5, c.PROCESS_RUNNABLE: 3.0}
    no_requests = verdict_for_trace(on_the_loop(**load))
    assert (no_requests.process_cpus, no_requests.requests_in_flight) == (4, None)  # requests are optional


def nested_through(hops: int) -> list[Span]:
    """'infer' (0-100 ms) and, ``hops`` spans of another instrumentation below it, 'kernel' (20-60 ms)."""
    chain = [at(sid(0x1000 + i), sid(0x1000 + i - 1) if i else "b" * 16, f"middleware{i}", 0, 100) for i in range(hops)]
    return [
        at(ROOT, "", "POST /infer", 0, 100),
        staged("b" * 16, ROOT, "infer", 0, 100),
        *chain,
        staged("c" * 16, chain[-1].span_id if chain else "b" * 16, "kernel", 20, 60),
    ]


def test_a_stage_under_other_spans_is_nested_in_the_stage_above_them_up_to_256_spans_apart():
    """'kernel' nested in 'infer': infer is charged 100 - 40 = 60 ms, kernel 40 ms; 1 span or 256 spans
    between them (the walk's bound) still nest; 257 spans apart, kernel is read as a top-level stage, and
    infer keeps its 100 ms (kernel still 40)."""
    for hops in (0, 1, 255, 256):
        assert verdict_for_trace(nested_through(hops)).breakdown == {"infer": 60.0, "kernel": 40.0}, hops
    assert verdict_for_trace(nested_through(257)).breakdown == {"infer": 100.0, "kernel": 40.0}


def test_a_top_level_stage_whose_span_id_is_1_holds_no_other_stage():
    """Two stages straight under the root, 'load' (span id 1, 0-50 ms) and 'fetch' (20-40 ms, at the same
    time): neither is the other's parent, so each is charged its own wall time, 50 and 20 ms."""
    spans = [
        at(ROOT, "", "GET /", 0, 100),
        staged(sid(1), ROOT, "load", 0, 50),
        staged("b" * 16, ROOT, "fetch", 20, 40),
    ]
    assert verdict_for_trace(spans).breakdown == {"load": 50.0, "fetch": 20.0}


def test_late_stages_and_composites_slowest_occurrences_are_not_charged_and_a_composite_counts_its_sum():
    """Root 100 ms: 'decode' 0-40 (40 ms); 'flush' marked late (50-150): left out; 'step', 3 occurrences
    folded with a sum of 12 ms (its slowest, 6 ms, exported beside it, not counted twice); 'pad', a composite
    of 2 whose sum was not stored: 0 ms; 'warm', a count of 0 (no composite): its wall time, 5 ms. Untracked:
    100 - (40 + 5) - 12 - 0 = 43 ms."""
    spans = [
        at(ROOT, "", "POST /gen", 0, 100),
        staged("1" * 16, ROOT, "decode", 0, 40),
        staged("2" * 16, ROOT, "flush", 50, 150, **{c.LATE: True}),
        staged("3" * 16, ROOT, "step", 40, 60, **{c.COMPRESSED_COUNT: 3, c.COMPRESSED_SUM_MS: 12.0,
                                                 c.COMPRESSED_MIN_MS: 2.0, c.COMPRESSED_MAX_MS: 6.0}),
        staged("4" * 16, ROOT, "step", 50, 56, **{c.COMPRESSED_SLOWEST: True}),
        staged("5" * 16, ROOT, "pad", 60, 70, **{c.COMPRESSED_COUNT: 2}),
        staged("6" * 16, ROOT, "warm", 70, 75, **{c.COMPRESSED_COUNT: 0}),
    ]  # fmt: skip
    v = verdict_for_trace(spans)
    assert v.breakdown == {"decode": 40.0, "step": 12.0, "pad": 0.0, "warm": 5.0}
    assert v.untracked_ms == 43.0


# --- how many requests a trace stands for ---------------------------------------------------------------------


def test_the_adjusted_count_is_the_global_root_s_else_the_largest_local_root_s_else_one():
    """The global root's 4 wins over a local root's 10; without one on the global root, the larger of the
    local roots' 2 and 5 (a span that is no local root, saying 9, is not read); nothing said: 1."""
    root = at(ROOT, "", "POST /chat", 0, 100, {c.TOTAL_MS: 100.0, c.SAMPLING_ADJUSTED_COUNT: 4.0})
    local = at("b" * 16, ROOT, "POST /gen", 10, 90, {c.TOTAL_MS: 80.0, c.SAMPLING_ADJUSTED_COUNT: 10.0})
    assert adjusted_count([root, local]) == 4.0
    plain = at(ROOT, "", "POST /chat", 0, 100)
    locals_ = [at(sid(0x10 + w), ROOT, "POST /gen", 10, 90, {c.TOTAL_MS: 80.0, c.SAMPLING_ADJUSTED_COUNT: float(w)})
               for w in (2, 5)]  # fmt: skip
    stray = at("e" * 16, ROOT, "db", 20, 30, {c.SAMPLING_ADJUSTED_COUNT: 9.0})
    assert adjusted_count([plain, *locals_, stray]) == 5.0
    assert adjusted_count([plain]) == 1.0
    assert adjusted_count([plain, stray]) == 1.0


def test_an_adjusted_count_under_one_counts_as_one_request():
    """A trace stands for at least itself: 0.5 reads 1, exactly 1 reads 1, 1.5 reads 1.5."""
    for said, read in ((0.5, 1.0), (1.0, 1.0), (1.5, 1.5)):
        assert adjusted_count([at(ROOT, "", "GET /", 0, 10, {c.SAMPLING_ADJUSTED_COUNT: said})]) == read, said


# --- the waterfall --------------------------------------------------------------------------------------------


def test_a_waterfall_bar_is_its_span_relative_to_the_global_root_in_ms_to_the_microsecond():
    """The root at 10 ms, 1000 ms long; its child (another service) from 1.234567 ms after it to 90 ms, no
    stage kind (a span); the child's stage (gpu) 2.345678 ms to 40.0456 ms: rounded to 3 digits (1.235, 2.346,
    40.046), at depths 0, 1, 2; the root's 'log' child from 600 to 700 ms (whole milliseconds stay whole)."""
    t0 = 10 * MS
    spans = [
        Span(T1, ROOT, "", "POST /chat", t0, t0 + 1000 * MS, service="gateway"),
        Span(T1, "d" * 16, ROOT, "log", t0 + 600 * MS, t0 + 700 * MS, service="gateway"),
        Span(T1, "b" * 16, ROOT, "POST /infer", t0 + 1_234_567, t0 + 90 * MS, service="model"),
        Span(T1, "c" * 16, "b" * 16, "infer", t0 + 2_345_678, t0 + 40_045_600, service="model",
             attributes={c.STAGE: "infer", c.STAGE_KIND: "gpu"}),
    ]  # fmt: skip
    assert waterfall(spans) == [
        {"name": "POST /chat", "service": "gateway", "kind": "span", "start_ms": 0.0, "end_ms": 1000.0, "depth": 0,
         "spans": 1},
        {"name": "POST /infer", "service": "model", "kind": "span", "start_ms": 1.235, "end_ms": 90.0, "depth": 1,
         "spans": 1},
        {"name": "infer", "service": "model", "kind": "gpu", "start_ms": 2.346, "end_ms": 40.046, "depth": 2,
         "spans": 1},
        {"name": "log", "service": "gateway", "kind": "span", "start_ms": 600.0, "end_ms": 700.0, "depth": 1,
         "spans": 1},
    ]  # fmt: skip


def test_a_waterfall_s_depth_stops_at_32():
    """A chain of 35 spans, each the child of the one before: depths 0 to 32, then 32 for the two below."""
    chain = [at(sid(0x100 + i), sid(0x100 + i - 1) if i else "", f"s{i}", i, 100) for i in range(35)]
    assert [b["depth"] for b in waterfall(chain)] == [*range(33), 32, 32]


def test_a_waterfall_draws_the_first_200_bars_by_default_and_still_merges_past_its_limit():
    """The root and 200 separate 'step' spans (i to i + 0.5 ms): 200 bars, the root and the first 199 steps.
    With a limit of 2: the root and 'a' (0-10 ms); 'b' (2-4 ms) is past the limit, not drawn, and an 'a' that
    overlaps the first (5-20 ms) still widens it to 20 ms. Spans that only touch (0-10, 10-20) are two bars."""
    steps = [at(sid(0x100 + i), ROOT, "step", i, i + 0.5) for i in range(200)]
    bars = waterfall([at(ROOT, "", "GET /", 0, 300), *steps])
    assert len(bars) == 200 and bars[-1]["start_ms"] == 198.0
    spans = [at(ROOT, "", "GET /", 0, 100), at("1" * 16, ROOT, "a", 0, 10), at("2" * 16, ROOT, "a", 5, 20),
             at("3" * 16, ROOT, "b", 2, 4)]  # fmt: skip
    drawn = [(b["name"], b["end_ms"], b["spans"]) for b in waterfall(spans, limit=2)]
    assert drawn == [("GET /", 100.0, 1), ("a", 20.0, 2)]
    assert [b["name"] for b in waterfall(spans, limit=1)] == ["GET /"]
    touching = [at(ROOT, "", "GET /", 0, 100), at("1" * 16, ROOT, "a", 0, 10), at("2" * 16, ROOT, "a", 10, 20)]
    drawn = [(b["start_ms"], b["end_ms"], b["spans"]) for b in waterfall(touching)]
    assert drawn == [(0.0, 100.0, 1), (0.0, 10.0, 1), (10.0, 20.0, 1)]


# --- batches --------------------------------------------------------------------------------------------------


def test_a_batch_trace_reads_its_name_members_and_fill_and_nothing_for_what_it_lacks():
    """3 members, 0.75 full; a size that is not an integer (a string) or is missing: 0 members; no fill: none."""
    batch = {c.BATCH_ID: "b" * 16, c.BATCH_SIZE: 3, c.BATCH_FILL: 0.75}
    assert batch_execution([at(ROOT, "", "infer.batch", 0, 10, batch)]) == ("infer.batch", 3, 0.75)
    assert batch_execution([at(ROOT, "", "infer.batch", 0, 10, {**batch, c.BATCH_SIZE: "3"})])[1] == 0
    assert batch_execution([at(ROOT, "", "infer.batch", 0, 10, {c.BATCH_ID: "b" * 16})]) == ("infer.batch", 0, None)


def test_batch_waits_read_formation_and_busy_time_and_count_a_missing_busy_time_as_zero():
    """A wait formed 10 ms and busy 50 ms; another (its stage named by its span) formed 2.5 ms with no busy time:
    0 ms; a span without a formation time is no batch wait."""
    spans = [
        at(ROOT, "", "request", 0, 100),
        staged("1" * 16, ROOT, "wait_span", 0, 60, stage="infer.queue", **{c.BATCH_FORMATION_MS: 10.0,
                                                                         c.BATCH_BUSY_MS: 50.0}),
        at("2" * 16, ROOT, "embed.queue", 0, 5, {c.BATCH_FORMATION_MS: 2.5}),
        staged("3" * 16, ROOT, "infer", 60, 100),
    ]  # fmt: skip
    assert batch_waits(spans) == [("infer.queue", 10.0, 50.0), ("embed.queue", 2.5, 0.0)]
