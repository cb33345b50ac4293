"""A stream's summary, phases and GenAI latencies pinned on hand-computed inputs: every figure the verdict,
the span attributes and the GenAI metrics read, at its edges (one chunk, two, a stage across the first chunk
or past the last, a threshold met exactly), never against a second copy of the code's formula."""

from __future__ import annotations

import pytest
from trace_builders import MS, cpu

from stagetrace import conventions as c
from stagetrace.analysis import StageSample
from stagetrace.analysis.streams import (
    GapHistogram,
    StreamFields,
    StreamSummary,
    StreamThresholds,
    gen_ai_latencies,
    judge_phases,
    quantile,
    stream_fields,
    summarise_stream,
)

BUCKETS = len(c.MS_BUCKETS) + 1


def counts(*gaps_ms: float) -> tuple[int, ...]:
    """The gaps counted on the contract's buckets, written out by hand: bucket i holds gaps <= MS_BUCKETS[i]."""
    out = [0] * BUCKETS
    for gap in gaps_ms:
        out[next((i for i, edge in enumerate(c.MS_BUCKETS) if gap <= edge), len(c.MS_BUCKETS))] += 1
    return tuple(out)


# Root at 1 ms; chunks at 4, 5, 7 and 10 ms: gaps 1, 2 and 3 ms (sampled out of order), 0.5 ms awaiting send.
ROOT_NS = 1 * MS
FOUR_CHUNKS = StreamFields(
    chunks=4,
    first_ns=4 * MS,
    last_ns=10 * MS,
    gap_counts=counts(1, 2, 3),
    gap_sum_ns=6 * MS,
    gap_min_ns=1 * MS,
    gap_max_ns=3 * MS,
    gap_sample=(3 * MS, 1 * MS, 2 * MS),
    send_wait_ns=MS // 2,
    disconnected=True,
)
STAGES = [
    cpu("queue", 1.0, 1.5, kind="wait"),  # wholly before the first chunk
    cpu("prefill", 1.5, 3.5, kind="gpu"),  # wholly before
    cpu("decode", 3.5, 9.5, kind="gpu"),  # across the first chunk: 0.5 of its 6 ms before, 5.5 between
    cpu("detokenize", 9.8, 10.5),  # across the last chunk: 0.2 of its 0.7 ms between, the rest after
]
CHARGED = [0.5, 2.0, 6.0, 0.7]


def test_every_figure_of_a_four_chunk_stream():
    s = summarise_stream(ROOT_NS, FOUR_CHUNKS, STAGES, CHARGED)
    assert s.chunks == 4
    assert s.first_chunk_ms == pytest.approx(3.0, abs=1e-9)  # 4 ms - the root's 1 ms
    assert s.streaming_ms == pytest.approx(6.0, abs=1e-9)  # 10 ms - 4 ms
    assert s.gap_p50_ms == pytest.approx(2.0, abs=1e-9)  # the median of 1, 2, 3
    assert s.gap_p99_ms == pytest.approx(2.98, abs=1e-9)  # 2 + (3 - 2) x (0.99 x 2 - 1), numpy's linear rule
    assert s.gap_max_ms == pytest.approx(3.0, abs=1e-9)
    assert s.send_wait_ms == pytest.approx(0.5, abs=1e-9)
    assert s.disconnected is True
    assert s.first_chunk_breakdown == pytest.approx({"queue": 0.5, "prefill": 2.0, "decode": 0.5})
    assert s.gap_breakdown == pytest.approx({"decode": 5.5, "detokenize": 0.2})
    assert (s.first_chunk_bottleneck, s.gap_bottleneck) == ("prefill", "decode")
    assert s.gaps == GapHistogram(counts(1, 2, 3), 6.0, 1.0, 3.0)


def test_two_chunks_have_one_gap_and_one_chunk_has_none():
    two = FOUR_CHUNKS._replace(
        chunks=2, last_ns=9 * MS, gap_counts=counts(5), gap_sum_ns=5 * MS, gap_min_ns=5 * MS, gap_max_ns=5 * MS,
        gap_sample=(5 * MS,), disconnected=False,
    )  # fmt: skip
    s = summarise_stream(ROOT_NS, two, STAGES, CHARGED)
    assert (s.gap_p50_ms, s.gap_p99_ms, s.gap_max_ms) == pytest.approx((5.0, 5.0, 5.0), abs=1e-9)
    assert s.gaps == GapHistogram(counts(5), 5.0, 5.0, 5.0) and s.disconnected is False
    one = FOUR_CHUNKS._replace(
        chunks=1, last_ns=4 * MS, gap_counts=counts(), gap_sum_ns=0, gap_min_ns=0, gap_max_ns=0, gap_sample=()
    )
    s = summarise_stream(ROOT_NS, one, STAGES, CHARGED)
    assert (s.chunks, s.streaming_ms) == (1, 0.0)
    assert (s.gap_p50_ms, s.gap_p99_ms, s.gap_max_ms, s.gaps) == (None, None, None, None)
    assert s.gap_breakdown == {} and s.gap_bottleneck is None  # nothing lies between a first and a last chunk


def test_a_chunk_before_the_roots_start_reads_as_zero_not_negative():
    early = FOUR_CHUNKS._replace(first_ns=ROOT_NS - 2 * MS)  # a clock read on another thread, a hair early
    assert summarise_stream(ROOT_NS, early, [], []).first_chunk_ms == 0.0


@pytest.mark.parametrize(
    ("q", "expected"),
    [(0.0, 10.0), (0.5, 25.0), (0.25, 17.5), (0.9, 37.0), (1.0, 40.0)],  # 10, 20, 30, 40 by hand
)
def test_quantiles_interpolate_between_the_nearest_values(q, expected):
    assert quantile([10, 20, 30, 40], q) == pytest.approx(expected)


def test_the_quantile_of_one_value_is_that_value():
    assert quantile([7], 0.0) == quantile([7], 0.99) == quantile([7], 1.0) == 7.0


def summary(first_chunk_ms=3.0, streaming_ms=6.0, gap_p99_ms=2.0, before=None, between=None):
    before = {"prefill": 2.0, "queue": 0.5} if before is None else before
    between = {"decode": 4.5} if between is None else between
    return StreamSummary(
        3, first_chunk_ms, streaming_ms, 1.0, gap_p99_ms, 2.5, 0.0, False,
        max(before, key=before.get) if before else None, max(between, key=between.get) if between else None,
        before, between, None,
    )  # fmt: skip


def test_a_first_chunk_exactly_at_its_threshold_is_not_slow_and_a_hair_past_it_is():
    at = StreamThresholds(first_chunk_ms=3.0, gap_ms=100.0)
    assert judge_phases(summary(first_chunk_ms=3.0), at) == (None, None, 0.0)
    judged = judge_phases(summary(first_chunk_ms=3.001), at)
    assert judged.reason == c.SLOW_FIRST_CHUNK and judged.bottleneck == "prefill"
    assert judged.ratio == pytest.approx(2.0 / 3.001)  # the bottleneck's share of the phase


def test_gaps_exactly_at_their_threshold_are_not_slow_and_a_hair_past_them_are():
    at = StreamThresholds(first_chunk_ms=100.0, gap_ms=2.0)
    assert judge_phases(summary(gap_p99_ms=2.0), at).reason is None
    judged = judge_phases(summary(gap_p99_ms=2.001), at)
    assert (judged.reason, judged.bottleneck) == (c.SLOW_GAP, "decode")
    assert judged.ratio == pytest.approx(4.5 / 6.0)  # of the streaming phase, not of the first chunk's


def test_a_slow_first_chunk_heads_the_verdict_before_slow_gaps():
    both = judge_phases(summary(first_chunk_ms=50.0, gap_p99_ms=50.0), StreamThresholds(10.0, 10.0))
    assert both.reason == c.SLOW_FIRST_CHUNK


def test_a_single_chunk_stream_is_judged_by_its_first_chunk_alone():
    assert judge_phases(summary(gap_p99_ms=None), StreamThresholds(100.0, 0.0)).reason is None


def test_the_headline_share_is_capped_at_the_whole_phase_and_a_phase_in_no_stage_is_untracked():
    over = judge_phases(summary(first_chunk_ms=2.0, before={"prefill": 2.5}), StreamThresholds(1.0, 100.0))
    assert over.ratio == 1.0  # a stage charged more than the phase (its overlap with others) owns all of it
    exact = judge_phases(summary(first_chunk_ms=2.0, before={"prefill": 1.0}), StreamThresholds(1.0, 100.0))
    assert exact.ratio == pytest.approx(0.5)
    empty = judge_phases(summary(first_chunk_ms=2.0, before={}), StreamThresholds(1.0, 100.0))
    assert (empty.reason, empty.bottleneck, empty.ratio) == (c.SLOW_FIRST_CHUNK, c.UNTRACKED, 1.0)
    short = judge_phases(summary(first_chunk_ms=0.8, before={"prefill": 0.4}), StreamThresholds(0.5, 100.0))
    assert short.ratio == pytest.approx(0.5)  # a phase under a millisecond still has its shares
    instant = judge_phases(summary(streaming_ms=0.0, gap_p99_ms=5.0), StreamThresholds(100.0, 1.0))
    assert (instant.bottleneck, instant.ratio) == ("decode", 0.0)  # no phase to take a share of


def test_gen_ai_latencies_from_the_conventions_text():
    """vLLM's and SGLang's request attributes, in seconds: time to first token, end to end, the queue (waits
    before the first token), prefill (model stages before it) and decode (model stages after it)."""
    s = summarise_stream(ROOT_NS, FOUR_CHUNKS, STAGES, CHARGED)
    kinds = {"queue": "wait", "prefill": "gpu", "decode": "gpu", "detokenize": "cpu"}
    got = gen_ai_latencies(s, kinds, total_ms=12.0, model_kinds=frozenset({"gpu"}))
    assert got.time_to_first_token == pytest.approx(0.003)
    assert got.e2e == pytest.approx(0.012)
    assert got.time_in_queue == pytest.approx(0.0005)
    assert got.time_in_model_prefill == pytest.approx(0.0025)  # prefill's 2 ms and decode's 0.5 ms before it
    assert got.time_in_model_decode == pytest.approx(0.0055)  # decode's 5.5 ms; detokenize is not the model
    cpu_model = gen_ai_latencies(s, kinds, total_ms=12.0, model_kinds=frozenset({"cpu"}))
    assert cpu_model.time_in_model_prefill == 0.0 and cpu_model.time_in_model_decode == pytest.approx(0.0002)


def test_a_shipped_stream_tuple_is_checked_field_by_field():
    assert stream_fields(None) is None
    assert stream_fields(FOUR_CHUNKS) is FOUR_CHUNKS
    assert stream_fields(tuple(FOUR_CHUNKS)) == FOUR_CHUNKS
    bad = {
        "a list": list(FOUR_CHUNKS),
        "too short": tuple(FOUR_CHUNKS)[:-1],
        "no chunk": tuple(FOUR_CHUNKS._replace(chunks=0)),
        "a float time": tuple(FOUR_CHUNKS._replace(first_ns=4.0 * MS)),
        "a float max": tuple(FOUR_CHUNKS._replace(gap_max_ns=3.0 * MS)),
        "counts as a list": tuple(FOUR_CHUNKS._replace(gap_counts=list(FOUR_CHUNKS.gap_counts))),
        "sample as a list": tuple(FOUR_CHUNKS._replace(gap_sample=list(FOUR_CHUNKS.gap_sample))),
        "counts on other buckets": tuple(FOUR_CHUNKS._replace(gap_counts=(3,))),
        "chunks without gaps": tuple(FOUR_CHUNKS._replace(gap_sample=())),
        "two chunks without their gap": tuple(FOUR_CHUNKS._replace(chunks=2, gap_sample=())),
        "a gap without a second chunk": tuple(FOUR_CHUNKS._replace(chunks=1)),
    }
    for why, value in bad.items():
        with pytest.raises(ValueError, match=r"^malformed stream record") as raised:
            stream_fields(value)
        assert raised.value.args, why
    assert stream_fields(tuple(FOUR_CHUNKS._replace(chunks=1, gap_sample=()))).chunks == 1


def test_a_name_s_occurrences_add_up_in_each_phase_and_uncharged_stages_are_passed_over():
    """Two decodes before the first chunk (0.5 and 1 ms) and two between (2 and 3 ms), an uncharged stage between
    them; an instant GPU stage (its host side takes no time) between the chunks, one at the first chunk's
    moment and one at the last's: each phase holds each name's sum, the instants only where strictly inside."""
    stages = [
        cpu("decode", 1.0, 1.5), cpu("idle", 1.5, 2.0), cpu("decode", 2.0, 3.0),
        cpu("decode", 5.0, 7.0), cpu("decode", 7.0, 10.0),
        cpu("h2d", 6.0, 6.0, kind="h2d"), cpu("h2d.first", 4.0, 4.0, kind="h2d"),
        cpu("h2d.last", 10.0, 10.0, kind="h2d"),
    ]  # fmt: skip
    charged = [0.5, None, 1.0, 2.0, 3.0, 0.25, 0.1, 0.1]
    s = summarise_stream(ROOT_NS, FOUR_CHUNKS, stages, charged)
    assert s.first_chunk_breakdown == {"decode": 1.5, "h2d.first": 0.1}
    assert s.gap_breakdown == {"decode": 5.0, "h2d": 0.25}


# --- the stream rules at their edges, with their messages' numbers ---------------------------------------------

STREAM_STAGES = [
    StageSample("decode", "gpu", 10 * MS, 40 * MS), cpu("detokenize", 40, 80), cpu("sample", 80, 90),
]  # fmt: skip


def streaming(**changes):
    """21 chunks (20 gaps) over 100 ms: decode 30 ms (GPU), detokenize 40 ms and sample 10 ms (CPU) between them."""
    fields = dict(
        chunks=21, first_chunk_ms=10.0, streaming_ms=100.0, gap_p50_ms=4.0, gap_p99_ms=5.0, gap_max_ms=5.0,
        send_wait_ms=0.0, disconnected=False, first_chunk_bottleneck=None, gap_bottleneck="detokenize",
        first_chunk_breakdown={}, gap_breakdown={"decode": 30.0, "detokenize": 40.0, "sample": 10.0}, gaps=None,
    )  # fmt: skip
    fields.update(changes)
    return StreamSummary(**fields)


def fired(code, **changes):
    from trace_builders import run

    from stagetrace.analysis import TraceSignals

    return run(STREAM_STAGES, signals=TraceSignals(stream=streaming(**changes))).get(code)


def test_stream_cpu_bound_at_its_share_with_the_model_s_step_beside_it():
    found = fired("STREAM_CPU_BOUND")  # 40 ms of 100: exactly the 40 % share
    assert found.stage == "detokenize"
    assert found.message == (
        "detokenize took 40% of the time between chunks (2.00 ms a chunk), more than the model's own step "
        "(1.50 ms a chunk)"
    )
    assert fired("STREAM_CPU_BOUND", gap_breakdown={"decode": 30.0, "detokenize": 39.9}) is None  # under the share
    assert fired("STREAM_CPU_BOUND", gap_breakdown={"decode": 40.0, "detokenize": 40.0}) is None  # no more than it
    alone = fired("STREAM_CPU_BOUND", gap_breakdown={"detokenize": 50.0, "sample": 10.0})
    assert alone.message == "detokenize took 50% of the time between chunks (2.50 ms a chunk)"  # no model stage


def test_the_stream_rules_read_streams_of_at_least_eight_chunks_that_lasted():
    assert fired("STREAM_CPU_BOUND", chunks=8).message.endswith("(5.71 ms a chunk), more than the model's own step "
                                                              "(4.29 ms a chunk)")  # fmt: skip
    assert fired("STREAM_CPU_BOUND", chunks=7) is None
    assert fired("STREAM_CPU_BOUND", streaming_ms=0.0) is None
    brief = fired("STREAM_CPU_BOUND", streaming_ms=0.5, gap_breakdown={"decode": 0.1, "detokenize": 0.4})
    assert brief is not None and brief.message.startswith("detokenize took 80%")  # half a millisecond still reads
    assert fired("SLOW_CONSUMER", chunks=7, send_wait_ms=50.0) is None
    assert fired("SLOW_CONSUMER", chunks=8, send_wait_ms=50.0) is not None
    assert fired("SLOW_CONSUMER", streaming_ms=0.0, send_wait_ms=50.0) is None
    assert fired("STREAM_STALL", chunks=7, gap_max_ms=150.0) is None
    assert fired("STREAM_STALL", chunks=8, gap_max_ms=150.0) is not None


def test_slow_consumer_at_its_minimum_and_its_share():
    at = fired("SLOW_CONSUMER", send_wait_ms=25.0)  # 25 ms of 100: the 25 % share, over the 20 ms minimum
    assert at.message == (
        "the stream waited 25.0 ms (25% of its 100.0 ms between first and last chunk) for its client to take the chunks"
    )
    assert fired("SLOW_CONSUMER", send_wait_ms=24.9) is None
    assert fired("SLOW_CONSUMER", send_wait_ms=20.0, streaming_ms=80.0) is not None  # the minimum, at the share
    assert fired("SLOW_CONSUMER", send_wait_ms=19.9, streaming_ms=79.6) is None


def test_stream_stall_at_its_minimum_and_its_factor():
    at = fired("STREAM_STALL", gap_max_ms=100.0, gap_p50_ms=10.0)  # 100 ms: the minimum, 10x the median
    assert at.message == "one gap between chunks lasted 100.0 ms, 10 times the stream's median gap (10.00 ms)"
    assert fired("STREAM_STALL", gap_max_ms=100.0, gap_p50_ms=10.01) is None  # under 10x
    assert fired("STREAM_STALL", gap_max_ms=99.9, gap_p50_ms=1.0) is None  # under the minimum
    fine = fired("STREAM_STALL", gap_max_ms=100.0, gap_p50_ms=0.5)
    assert fine.message == "one gap between chunks lasted 100.0 ms, 200 times the stream's median gap (0.50 ms)"
