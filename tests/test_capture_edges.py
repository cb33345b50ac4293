"""The capture records' figures at their edges, on hand-computed inputs: a repeated stage's composite (count,
summed, least and most time, its example, its first error) as occurrences fold in under one or several
parents, and a streamed response's chunk figures (time to the first chunk, the gaps, their histogram and
sample, the wait on ``send``, a disconnect) as the server is handed each chunk. Clocks and random ids are
injected: no assertion reads a real clock. The expected figures are worked out in the comments or by a plain
oracle written here (builtins over the list of occurrences or gaps), never by a second path of the code."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.span import TraceState

from stagetrace import _state
from stagetrace.analysis.streams import StreamFields
from stagetrace.capture import records, streams
from stagetrace.capture.records import (
    KEEP_REPEATS,
    Repeat,
    StageRecord,
    TraceRecord,
    count_repeat,
    folding_repeat,
    pack_stages,
)
from stagetrace.capture.streams import GAP_SAMPLE_SIZE, StreamStats, observe
from stagetrace.common.wire import STAGE_FIELDS, pack_stage
from stagetrace.conventions import (
    GEN_AI_OPERATION,
    GEN_AI_OUTPUT_TOKENS,
    GEN_AI_PROVIDER,
    GEN_AI_REQUEST_MODEL,
    MS_BUCKETS,
)
from test_capture_values import record

MS = 1_000_000
TRACE_ID = 0xABC


def wire(packed: tuple[Any, ...]) -> dict[str, Any]:
    """A packed stage by field name."""
    return dict(zip(STAGE_FIELDS, packed))


# --- a stage record and its span context ------------------------------------------------------------------


def test_a_child_span_of_a_stage_gets_the_stage_s_ids_flags_and_vendor_state_as_a_local_context():
    """What another instrumentation's child span inherits: the stage's trace and span id, sampled flag and
    the caller's tracestate (vendor entries), and ``is_remote`` False (the stage runs in this process)."""
    state = TraceState([("vendor", "v1")])
    rec = StageRecord("decode", "cpu", None, None, 0x11, 0x22, 0, 0, TraceFlags(1), state)  # type: ignore[arg-type]
    sc = rec.get_span_context()
    assert (sc.trace_id, sc.span_id, sc.trace_flags, sc.trace_state) == (0x11, 0x22, 1, state)
    assert sc.is_remote is False
    assert sc.trace_state.get("vendor") == "v1"
    assert rec.get_span_context() is sc  # built once


def test_a_stage_that_never_ran_ships_no_time_and_no_cpu_readings():
    """Edge: a record nothing has timed yet. 0 ns from 0 to 0 (wall 0.0 ms), and no CPU readings: None on the
    wire, the "no reading" of the wire contract (what resolve_cpu tests for)."""
    rec = record()
    assert rec.wall_ms == 0.0
    shipped = wire(pack_stage(rec))
    assert (shipped["start_ns"], shipped["end_ns"], shipped["cpu_start"], shipped["cpu_end"]) == (0, 0, None, None)


# --- repeated stages: counting, the composite, folding --------------------------------------------------------


class Ids:
    """Random span ids on demand, from a fixed list (0 included: an id the code must never ship)."""

    def __init__(self, *ids: int) -> None:
        self.ids = list(ids)

    def __call__(self, bits: int) -> int:
        assert bits == 64
        return self.ids.pop(0)


def run_stage(
    trace: TraceRecord,
    name: str,
    parent: int,
    start: int,
    end: int,
    ids: Ids,
    *,
    kind: str = "cpu",
    parent_stage_id: int = 0,
    error: tuple[str, str, str] | None = None,
    on_loop: bool = False,
) -> StageRecord:
    """One occurrence through the protocol capture/stage.py follows: at entry, fold if the name's composite
    under this parent already folds (taking its span id); at exit, fold, or keep it as a stage and count it."""
    repeat = folding_repeat(trace.repeats.get(name), parent)
    span_id = repeat.span_id if repeat is not None else 1000 + len(trace.stages)
    rec = StageRecord(name, kind, None, trace, TRACE_ID, span_id, parent, parent_stage_id)  # type: ignore[arg-type]
    rec.start_ns, rec.end_ns, rec.error, rec.on_event_loop = start, end, error, on_loop
    if repeat is not None:
        rec.repeat = repeat
        repeat.fold(rec)
    else:
        trace.stages.append(rec)
        count_repeat(trace, rec, ids)
    return rec


def new_trace() -> TraceRecord:
    return TraceRecord(TRACE_ID, 1, 0)


def test_a_trace_record_keeps_its_root_s_flags_and_vendor_state_and_opened_off_a_loop_is_on_loop_0():
    """What ships with a stage that ends after its trace went (the lone stage's flags and tracestate header) and
    with a batch member's link: the root's, as given. A record opened with no loop thread (a pool worker's run)
    is on loop 0, 'none': it is never counted among a loop's requests."""
    state = TraceState([("vendor", "v1")])
    t = TraceRecord(TRACE_ID, 1, 0, TraceFlags(1), state)
    assert (t.trace_flags, t.trace_state, t.loop_thread) == (1, state, 0)
    assert t.trace_state.to_header() == "vendor=v1"


def test_below_keep_repeats_a_name_is_counted_but_nothing_folds_or_ships_as_a_composite():
    """Edge: KEEP_REPEATS - 1 occurrences (2 of 3): both ship as real stages, no composite; the name's count
    is 2, so the third occurrence is still a real stage (it starts the composite, test below)."""
    assert KEEP_REPEATS == 3  # the figures below are worked out for 3
    t, ids = new_trace(), Ids()
    run_stage(t, "decode", 5, 0, 10, ids)
    run_stage(t, "decode", 5, 20, 30, ids)
    r = t.repeats["decode"]
    assert (r.count, r.folded) == (2, 0)
    assert [wire(p)["start_ns"] for p in pack_stages(t.stages)] == [0, 20]  # the two occurrences, no composite
    assert folding_repeat(r, 5) is None


def test_a_composite_s_figures_after_folds_with_a_backwards_clock_a_tie_and_two_errors(monkeypatch):
    """KEEP_REPEATS (3) real occurrences, then five folded (ns): A 1000-1040 (40), B 1100-1130 (30, error E1),
    C 1200-1150 (ends before it starts: 0, error E2), D 1300-1340 (40, ties A: the latest is the slowest),
    E 1400-1401 (1). Folded 5; summed 40+30+0+40+1 = 111; least 0 (C); most 40; first start 1000 (A); last end
    1401 (E); the first error E1; the example is D (1300-1340). The random ids come out 0 for the composite
    and its example: both ship as 1."""
    monkeypatch.setattr(records, "_new_span_id", Ids(0))
    t, ids = new_trace(), Ids(0)
    e1, e2 = ("ValueError", "first", ""), ("OSError", "second", "")
    for start in (0, 100, 200):
        run_stage(t, "step", 5, start, start + 50, ids, kind="gpu", parent_stage_id=7)
    folded = [(1000, 1040, None), (1100, 1130, e1), (1200, 1150, e2), (1300, 1340, None), (1400, 1401, None)]
    recs = [run_stage(t, "step", 5, s, e, ids, kind="gpu", parent_stage_id=7, error=err) for s, e, err in folded]
    ns = [max(0, e - s) for s, e, _ in folded]  # the oracle: each occurrence's own time
    assert (len(ns), sum(ns), min(ns), max(ns)) == (5, 111, 0, 40)

    packed = pack_stages(t.stages)
    assert len(packed) == 3 + 2  # the real ones, the composite, its example
    real, (composite, example) = packed[:3], packed[3:]
    assert [wire(p)["start_ns"] for p in real] == [0, 100, 200]
    c, x = wire(composite), wire(example)
    assert (c["name"], c["kind"], c["parent_span_id"], c["parent_stage_id"], c["span_id"]) == ("step", "gpu", 5, 7, 1)
    assert c["compressed"] == (5, 111, 0, 40)
    assert (c["start_ns"], c["end_ns"], c["error"]) == (1000, 1401, e1)
    assert c["on_event_loop"] is False and c["example"] is False
    assert (x["start_ns"], x["end_ns"], x["span_id"], x["example"]) == (1300, 1340, 1, True)
    assert t.repeats["step"].slowest is recs[3]


def test_a_composite_whose_first_fold_is_its_longest_keeps_that_start_and_its_least_from_later_folds():
    """Edge: the first folded occurrence sets start and least. Folds 500-590 (90), 600-620 (20), 700-760 (60):
    start 500, least 20, most 90, summed 170; the example is the first (90 ns)."""
    t, ids = new_trace(), Ids(9)
    for start in (0, 100, 200):
        run_stage(t, "step", 5, start, start + 10, ids)
    run_stage(t, "step", 5, 500, 590, ids)
    run_stage(t, "step", 5, 600, 620, ids)
    run_stage(t, "step", 5, 700, 760, ids)
    r = t.repeats["step"]
    assert (r.compressed, r.start_ns, r.end_ns, r.span_id) == ((3, 170, 20, 90), 500, 760, 9)
    assert (r.slowest.start_ns, r.slowest.end_ns) == (500, 590)


def test_a_composite_of_zero_length_occurrences_still_has_an_example():
    """Edge: every folded occurrence 0 ns (a coarse clock): most 0, and the first still becomes the example."""
    t, ids = new_trace(), Ids(9)
    for start in (0, 100, 200):
        run_stage(t, "tick", 5, start, start + 10, ids)
    run_stage(t, "tick", 5, 300, 300, ids)
    run_stage(t, "tick", 5, 400, 400, ids)
    packed = pack_stages(t.stages)
    assert len(packed) == 3 + 2  # the three real ones, the composite, its example
    assert wire(packed[3])["compressed"] == (2, 0, 0, 0)
    assert (wire(packed[4])["start_ns"], wire(packed[4])["example"]) == (400, True)  # a tie: the latest


def test_an_occurrence_on_the_event_loop_marks_its_composite_and_others_do_not():
    t, ids = new_trace(), Ids(9)
    for start in (0, 100, 200):
        run_stage(t, "s", 5, start, start + 10, ids)
    run_stage(t, "s", 5, 300, 310, ids)
    assert t.repeats["s"].on_event_loop is False
    run_stage(t, "s", 5, 400, 410, ids, on_loop=True)
    run_stage(t, "s", 5, 500, 510, ids)
    assert t.repeats["s"].on_event_loop is True  # stays once one occurrence held the loop


def test_a_name_under_three_parents_starts_each_parent_s_composite_at_its_own_keep_repeats_th_occurrence():
    """Parents in the order A B C A A A B B C C C: each parent's count is kept apart, so a composite starts at
    the occurrence that makes its own parent's count KEEP_REPEATS (3): A's third (index 4), B's third (index 7),
    C's third (index 9); A's fourth (index 5) and C's fourth (index 10) fold into theirs. A count that starts
    wrong when the second or third parent appears (one too many, or the name's count restarted) moves a
    composite to another index."""
    A, B, C = 10, 20, 30
    parents = [A, B, C, A, A, A, B, B, C, C, C]
    t, ids = new_trace(), Ids(101, 102, 103)
    composites_after: list[int] = []
    for i, p in enumerate(parents):
        run_stage(t, "tok", p, 100 * i, 100 * i + 10 + i, ids)
        composites_after.append(sum(type(s) is Repeat for s in t.stages))
    # the oracle: a plain counter per parent; the occurrence that makes a parent's count 3 starts its composite
    seen: Counter[int] = Counter()
    starts = []
    for i, p in enumerate(parents):
        seen[p] += 1
        if seen[p] == KEEP_REPEATS:
            starts.append(i)
    assert starts == [4, 7, 9]
    assert composites_after == [0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    by_parent = {r.parent_span_id: r for r in t.stages if type(r) is Repeat}
    # folded: A's 4th (index 5, 10+5 = 15 ns); C's 4th (index 10, 20 ns); B none yet
    assert {p: (r.span_id, r.compressed) for p, r in by_parent.items()} == {
        A: (101, (1, 15, 15, 15)),
        B: (102, (0, 0, 0, 0)),
        C: (103, (1, 20, 20, 20)),
    }
    real = [s for s in t.stages if type(s) is not Repeat]
    assert len(real) == 3 * KEEP_REPEATS
    # B folded nothing: it ships no composite; A and C ship theirs with an example each
    assert len(pack_stages(t.stages)) == 9 + 2 * 2


# --- a stream's chunks -----------------------------------------------------------------------------------


def handed(times_and_waits: list[tuple[int, int]]) -> StreamStats:
    stats = StreamStats()
    for at, waited in times_and_waits:
        stats.chunk_handed(at, waited)
    return stats


def bucket_of(gap_ns: int) -> int:
    """The oracle for the gap histogram: the first bucket whose upper edge (MS_BUCKETS, ms, inclusive) holds
    the gap, the overflow bucket past the last edge. A linear scan, in ms."""
    for i, edge in enumerate(MS_BUCKETS):
        if gap_ns / MS <= edge:
            return i
    return len(MS_BUCKETS)


def test_no_chunk_ships_no_stream_and_one_chunk_ships_no_gap():
    assert StreamStats().packed() is None
    one = StreamFields(*handed([(40 * MS, 3)]).packed())
    assert (one.chunks, one.first_ns, one.last_ns, one.send_wait_ns) == (1, 40 * MS, 40 * MS, 3)
    assert (one.gap_sum_ns, one.gap_min_ns, one.gap_max_ns, one.gap_sample) == (0, 0, 0, ())
    assert sum(one.gap_counts) == 0 and len(one.gap_counts) == len(MS_BUCKETS) + 1


def test_two_chunks_ship_their_one_gap_as_least_most_and_sum():
    two = StreamFields(*handed([(10 * MS, 1), (17 * MS, 2)]).packed())
    assert (two.gap_sum_ns, two.gap_min_ns, two.gap_max_ns, two.gap_sample) == (7 * MS, 7 * MS, 7 * MS, (7 * MS,))
    assert two.send_wait_ns == 3


def test_gap_figures_when_the_first_gap_is_the_least_and_gaps_grow():
    """Chunks at 100, 105, 112, 121 ms: gaps 5, 7, 9 ms. Summed 21, least 5 (the first), most 9; waits on send
    1 + 2 + 4 + 8 = 15 ns; time to the first chunk: 100 ms after a root that started at 0."""
    stats = handed([(100 * MS, 1), (105 * MS, 2), (112 * MS, 4), (121 * MS, 8)])
    f = StreamFields(*stats.packed())
    assert (f.chunks, f.first_ns, f.last_ns) == (4, 100 * MS, 121 * MS)
    assert (f.gap_sum_ns, f.gap_min_ns, f.gap_max_ns) == (21 * MS, 5 * MS, 9 * MS)
    assert f.gap_sample == (5 * MS, 7 * MS, 9 * MS)
    assert f.send_wait_ns == 15
    # 5 ms sits on an edge (the "<= 5" bucket, index 5); 7 and 9 in "<= 10" (index 6)
    assert [(i, n) for i, n in enumerate(f.gap_counts) if n] == [(5, 1), (6, 2)]


def test_gaps_on_a_bucket_edge_count_in_it_and_one_ns_past_it_in_the_next():
    """Gaps 0; 0.1 ms exactly (the first edge); 0.1 ms + 1 ns; 10 s exactly (the last edge); 10 s + 1 ns
    (overflow). Least 0, most 10 s + 1 ns."""
    gaps = [0, 100_000, 100_001, 10_000 * MS, 10_000 * MS + 1]
    at, times = 0, [(0, 0)]
    for g in gaps:
        at += g
        times.append((at, 0))
    f = StreamFields(*handed(times).packed())
    expected = [0] * (len(MS_BUCKETS) + 1)
    for g in gaps:
        expected[bucket_of(g)] += 1
    assert [bucket_of(g) for g in gaps] == [0, 0, 1, len(MS_BUCKETS) - 1, len(MS_BUCKETS)]
    assert list(f.gap_counts) == expected
    assert (f.gap_min_ns, f.gap_max_ns, f.gap_sum_ns) == (0, 10_000 * MS + 1, sum(gaps))


def test_the_gap_sample_holds_every_gap_up_to_its_bound_then_replaces_by_the_random_slot(monkeypatch):
    """GAP_SAMPLE_SIZE (1024) gaps: all kept, in order. The 1025th gap (at 1025 chunks so far) draws slot
    int(r * 1025); r = 1024.5 / 1025 gives slot 1024, one past the sample: not kept. The 1026th (1026 chunks
    so far) draws r = 0: slot 0, replacing the first gap. Gap i is 1000 + i ns; the sum and extremes cover
    every gap, kept in the sample or not."""
    draws = [1024.5 / 1025, 0.0]
    monkeypatch.setattr(streams, "_random", lambda: draws.pop(0))
    gaps = [1000 + i for i in range(GAP_SAMPLE_SIZE + 2)]
    stats, at = StreamStats(), 0
    stats.chunk_handed(at, 0)
    for g in gaps[:GAP_SAMPLE_SIZE]:
        at += g
        stats.chunk_handed(at, 0)
    assert stats.gap_sample == gaps[:GAP_SAMPLE_SIZE] and draws == [1024.5 / 1025, 0.0]  # no draw yet
    at += gaps[GAP_SAMPLE_SIZE]
    stats.chunk_handed(at, 0)
    assert stats.gap_sample == gaps[:GAP_SAMPLE_SIZE]  # slot 1024: left out
    at += gaps[GAP_SAMPLE_SIZE + 1]
    stats.chunk_handed(at, 0)
    assert draws == []
    assert stats.gap_sample == [gaps[-1], *gaps[1:GAP_SAMPLE_SIZE]]
    f = StreamFields(*stats.packed())
    assert (f.chunks, f.gap_sum_ns, f.gap_min_ns, f.gap_max_ns) == (1027, sum(gaps), 1000, 2025)


# --- a stream through the ASGI wrappers ---------------------------------------------------------------------


class Clock:
    """perf_counter_ns, from a list of readings."""

    def __init__(self, *readings: int) -> None:
        self.readings = list(readings)

    def __call__(self) -> int:
        return self.readings.pop(0)


def request_span() -> Any:
    return otel_trace.use_span(NonRecordingSpan(SpanContext(TRACE_ID, 0x1, False)), end_on_exit=False)


def serve(rt: Any, sent: list[Any], received: list[Any], in_request: bool = True) -> tuple[list[Any], list[Any]]:
    """The messages through observe()'s wrappers, as an ASGI app sends them and a server answers receive()."""
    out: list[Any] = []
    got: list[Any] = []
    answers = list(received)

    async def send(message: Any) -> None:
        out.append(message)

    async def receive() -> Any:
        return answers.pop(0)

    async def app() -> None:
        timed_send, noting_receive = observe(rt, send, receive)
        for m in sent:
            if m == "receive":
                got.append(await noting_receive())
            else:
                await timed_send(m)

    if in_request:
        with request_span():
            asyncio.run(app())
    else:
        asyncio.run(app())
    return out, got


START = {"type": "http.response.start", "status": 200}


def body(data: bytes, more: bool) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


def test_a_stream_through_send_carries_its_chunks_gaps_and_waits_and_ends_complete(monkeypatch):
    """Chunk "a" handed at 100 (send returns at 103: waited 3), an empty body (no chunk: one clock read, 105),
    "b" at 110-111, the last "c" at 125-130. Chunks 3 (the empty one is none), first 100, last 125, gaps 10 and
    15 (summed 25, least 10, most 15), waited 3 + 1 + 5 = 9. A disconnect after the last chunk is the server's
    end of the exchange, not a client gone."""
    monkeypatch.setattr(streams, "_perf_ns", Clock(100, 103, 105, 110, 111, 125, 130))
    t = new_trace()
    rt = SimpleNamespace(lookup_trace={TRACE_ID: t}.get)
    sent = [START, body(b"a", True), body(b"", True), body(b"b", True), body(b"c", False), "receive"]
    out, got = serve(rt, sent, [{"type": "http.disconnect"}])
    assert out == [m for m in sent if m != "receive"]  # every message reaches the server unchanged
    assert got == [{"type": "http.disconnect"}]
    f = StreamFields(*t.stream.packed())
    assert (f.chunks, f.first_ns, f.last_ns, f.send_wait_ns) == (3, 100, 125, 9)
    assert (f.gap_sum_ns, f.gap_min_ns, f.gap_max_ns, f.gap_sample) == (25, 10, 15, (10, 15))
    assert f.disconnected is False


@pytest.mark.parametrize(
    ("message", "gone"),
    [({"type": "http.disconnect"}, True), ({"type": "http.request", "body": b"", "more_body": False}, False)],
)
def test_a_client_gone_mid_stream_is_marked_and_any_other_message_is_not(monkeypatch, message, gone):
    monkeypatch.setattr(streams, "_perf_ns", Clock(100, 101))
    t = new_trace()
    rt = SimpleNamespace(lookup_trace={TRACE_ID: t}.get)
    serve(rt, [START, body(b"a", True), "receive"], [message])
    assert t.stream.chunks == 1 and t.stream.disconnected is gone


def test_a_send_that_fails_as_the_client_went_away_counts_the_chunk_marks_the_stream_and_reraises(monkeypatch):
    """Chunk "a" at 100-102; "b" handed at 110, the server's send raises at 114 (connection reset): two chunks,
    the gap 10, waited 2 + 4 = 6, disconnected; the application sees the same OSError."""
    monkeypatch.setattr(streams, "_perf_ns", Clock(100, 102, 110, 114))
    t = new_trace()
    rt = SimpleNamespace(lookup_trace={TRACE_ID: t}.get)
    gone = ConnectionResetError("peer gone")

    async def send(message: Any) -> None:
        if message.get("body") == b"b":
            raise gone

    async def app() -> None:
        timed_send, _ = observe(rt, send, None)
        await timed_send(START)
        await timed_send(body(b"a", True))
        await timed_send(body(b"b", True))

    with request_span(), pytest.raises(ConnectionResetError) as raised:
        asyncio.run(app())
    assert raised.value is gone
    f = StreamFields(*t.stream.packed())
    assert (f.chunks, f.gap_sum_ns, f.send_wait_ns, f.disconnected) == (2, 10, 6, True)


def test_a_failure_attaching_a_stream_is_contained_reported_and_the_response_still_sent(monkeypatch):
    def lookup(trace_id: int) -> Any:
        raise RuntimeError("registry gone")

    reported: list[str] = []
    monkeypatch.setattr(streams, "report_internal_error", reported.append)
    sent = [START, body(b"a", True), body(b"b", False)]
    out, _ = serve(SimpleNamespace(lookup_trace=lookup), sent, [])
    assert out == sent and reported == ["stream timing"]


def test_a_stream_outside_any_request_is_not_timed_even_by_a_runtime_that_answers_every_id(monkeypatch):
    """No current span (the invalid context, trace id 0): the registry is not asked, nothing is attached."""
    monkeypatch.setattr(streams, "_perf_ns", Clock())  # no reading may be taken
    t = new_trace()
    asked: list[int] = []
    rt = SimpleNamespace(lookup_trace=lambda tid: asked.append(tid) or t)
    sent = [START, body(b"a", True), body(b"b", False)]
    out, _ = serve(rt, sent, [], in_request=False)
    assert out == sent and asked == [] and t.stream is None


# --- generation() --------------------------------------------------------------------------------------


def test_generation_s_errors_name_the_argument_and_the_type_given():
    with pytest.raises(ValueError, match=r"^stagetrace\.generation\(\) needs the model's name, a non-empty str$"):
        streams.generation("")
    with pytest.raises(TypeError, match=r"^provider must be a str, got int$"):
        streams.generation("m", provider=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^operation must be a str, got int$"):
        streams.generation("m", operation=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^response_model must be a str, got bytes$"):
        streams.generation("m", response_model=b"x")  # type: ignore[arg-type]


def test_generation_said_twice_merges_and_a_later_none_erases_nothing(monkeypatch):
    """First the model and provider, then the tokens: the root carries all four (operation defaulted)."""
    t = new_trace()
    monkeypatch.setattr(_state, "runtime", SimpleNamespace(lookup_trace={TRACE_ID: t}.get))
    with request_span():
        streams.generation("tiny", provider="local")
        streams.generation("tiny", output_tokens=7)
    assert t.gen_ai == {
        GEN_AI_REQUEST_MODEL: "tiny",
        GEN_AI_OPERATION: "text_completion",
        GEN_AI_PROVIDER: "local",
        GEN_AI_OUTPUT_TOKENS: 7,
    }


def test_generation_takes_zero_output_tokens_and_refuses_minus_one(monkeypatch):
    """Edge: 0 tokens (a response cut before any token) is a count; -1, just past it, is refused."""
    t = new_trace()
    monkeypatch.setattr(_state, "runtime", SimpleNamespace(lookup_trace={TRACE_ID: t}.get))
    with request_span():
        streams.generation("tiny", output_tokens=0)
        with pytest.raises(ValueError, match=r"^output_tokens must be an int >= 0, got -1$"):
            streams.generation("tiny", output_tokens=-1)
    assert t.gen_ai == {GEN_AI_REQUEST_MODEL: "tiny", GEN_AI_OPERATION: "text_completion", GEN_AI_OUTPUT_TOKENS: 0}


def test_a_failure_inside_generation_is_contained_and_reported_under_its_name(monkeypatch):
    def lookup(trace_id: int) -> Any:
        raise RuntimeError("registry gone")

    reported: list[str] = []
    monkeypatch.setattr(streams, "report_internal_error", reported.append)
    monkeypatch.setattr(_state, "runtime", SimpleNamespace(lookup_trace=lookup))
    with request_span():
        streams.generation("tiny")  # the application never sees the error
    assert reported == ["stagetrace.generation"]
