"""The aggregator's summary (``stagetrace report --json``, the terminal and HTML reports) on hand-computed
inputs, figure by figure and key by key: each value checked against an oracle written from the conventions'
text (the sketch's: the value of weighted rank ``q * (n - 1)``, read as its bucket's midpoint
``2 gamma^k / (gamma + 1)`` with ``k = ceil(ln v / ln gamma)``, clamped to the smallest and largest values
seen; a weighted count whole when it is, else to a tenth), never against the aggregator's own second path.
Values carry more digits than the summary keeps, so that a figure rounded to other places reads otherwise;
edges: nothing read, one trace, a total of 0, of exactly 1 ms, a slowest list at its bound and one past it,
ties; parts and rows fed distinct values so that a figure overwritten instead of added reads otherwise."""

from __future__ import annotations

import math
from typing import Any

import pytest

from stagetrace.analysis.diagnosis import ADVICE, Diagnosis
from stagetrace.analysis.offload import OffloadedCall, OffloadInfo
from stagetrace.report.aggregate import Aggregator, OffloadSummary, as_count
from stagetrace.report.render import diagnosis_sample_line
from test_report_values import GAMMA, call, midpoint, stream, verdict


def reading(values: list[tuple[float, float]], q: float) -> float:
    """The oracle: what a sketch of ``(value, weight)`` pairs reads for the ``q`` quantile. The value whose
    weights, summed in value order, first pass the rank ``q * (n - 1)`` (n: the weights' sum); a zero reads 0,
    another value its bucket's midpoint clamped to [smallest, largest]."""
    ordered = sorted(values)
    rank = q * max(sum(w for _, w in ordered) - 1, 0)
    seen = 0.0
    for value, weight in ordered:
        seen += weight
        if seen > rank:
            if value <= 1e-9:
                return 0.0
            key = math.ceil(math.log(value) / math.log(GAMMA))
            return min(max(midpoint(key), ordered[0][0]), ordered[-1][0])
    return ordered[-1][0]


def ones(*values: float) -> list[tuple[float, float]]:
    return [(v, 1.0) for v in values]


# --- the whole summary, key by key ----------------------------------------------------------------------------


def two_traces() -> Aggregator:
    """t1: 12.34567 ms, decode 3.45678 and infer 8.88889 (its bottleneck), 12.3456 % of a GPU, two findings
    (one of a rule with advice and evidence, one of a code no rule has); t2: 45.67891 ms, slow by its total,
    decode 40.12345 (its bottleneck), 65.4321 % of a GPU. A batcher ran 2, 3 and 8 requests (fill 0.33333, not
    said, 0.5); one batch wait twice (formation 1.23456 and 5.6789, busy 2.34567 and 7.891)."""
    agg = Aggregator()
    agg.add(
        verdict(
            "t1", 12.34567, {"decode": 3.45678, "infer": 8.88889}, gpu_utilization=0.123456,
            diagnoses=(Diagnosis("GPU_STARVED", "t1's finding", "", evidence="t1's evidence"),
                       Diagnosis("NOT_A_RULE", "t1's other finding", "")),
        )
    )  # fmt: skip
    agg.add(verdict("t2", 45.67891, {"decode": 40.12345}, slow=True, gpu_utilization=0.654321))
    for size, fill in ((2, 0.33333), (3, None), (8, 0.5)):
        agg.add_batch("infer.batch", size, fill)
    agg.add_batch_wait("infer.batch.queue", 1.23456, 2.34567)
    agg.add_batch_wait("infer.batch.queue", 5.6789, 7.891)
    return agg


def test_the_summary_of_two_traces_reads_each_figure_to_its_places_under_its_own_key():
    """Every key and value a ``--json`` reader sees, from the oracle: quantiles of two values of weight 1 read
    the smaller one up to p99 (rank 0.99 of 0..1); means are plain; shares are each trace's stage over its
    total, averaged over the 2 requests; an unknown code's advice is empty (not null); the slowest first
    (t2: 45.7/200 against t1's 12.3/200). Milliseconds to 3 places, utilisation and shares to 4, batch sizes
    to 2."""
    got = two_traces().summary()
    # Readings (gamma = 1.01 / 0.99): a value v is in bucket k = ceil(ln v / ln gamma), read as 2 gamma^k / (gamma + 1)
    # clamped to [smallest, largest]. decode 3.45678: k 63, 3.49031 (over the smallest: not clamped); total
    # 12.34567: k 126, 12.3053, clamped up to 12.34567; gpu 0.123456: k -104, 0.123672; size 3: k 55, 2.97423;
    # formation 1.23456: k 11, 1.23363, clamped up; busy 2.34567: k 43, 2.33960, clamped up.
    expected = {
        "traces": 2,
        "slow_traces": 1,
        "requests": 2,
        "slow_requests": 1,
        "slow_reasons": {"total": 1},  # no reason given: slow by its total
        "sampled": False,
        "counted": None,
        "total_ms": {"p50": 12.346, "p95": 12.346, "p99": 12.346},  # ranks 0.5, 0.95, 0.99 of 0..1: the smaller
        "stages": {
            "decode": {
                "kind": "cpu",
                "traces": 2,
                "p50_ms": 3.49,  # 3.49031 to 3 places
                "p95_ms": 3.49,
                "p99_ms": 3.49,
                "mean_ms": 21.79,  # (3.45678 + 40.12345) / 2 = 21.790115
                "mean_share": 0.5792,  # (3.45678 / 12.34567 + 40.12345 / 45.67891) / 2 = (0.28000 + 0.87838) / 2
                "bottleneck_traces": 1,
            },
            "infer": {
                "kind": "cpu",
                "traces": 1,
                "p50_ms": 8.889,  # one value: itself (its bucket's midpoint clamped to it)
                "p95_ms": 8.889,
                "p99_ms": 8.889,
                "mean_ms": 8.889,
                "mean_share": 0.36,  # 8.88889 / 12.34567 = 0.72000, over 2 requests
                "bottleneck_traces": 1,
            },
        },
        "bottlenecks": {"infer": 1, "decode": 1},
        "diagnoses": {"GPU_STARVED": 1, "NOT_A_RULE": 1},
        "diagnosis_sample_rate": 1.0,
        "advice": {"GPU_STARVED": ADVICE["GPU_STARVED"], "NOT_A_RULE": ""},
        "examples": {"GPU_STARVED": "t1's finding", "NOT_A_RULE": "t1's other finding"},
        "evidence": {"GPU_STARVED": "t1's evidence"},
        "gpu_utilization": {"mean": 0.3889, "p50": 0.1237},  # (0.123456 + 0.654321) / 2 = 0.38889; 0.123672
        "batches": {
            "infer.batch": {
                "executions": 3,
                "size_mean": 4.33,  # 13 / 3
                "size_p50": 2.97,  # ranks 1 and 1.9 of 0..2: the 3, 2.97423
                "size_p95": 2.97,
                "fill_mean": 0.4167,  # (0.33333 + 0.5) / 2 = 0.416665: an execution without a fill is no fill of 0
            }
        },
        "batch_waits": {
            "infer.batch.queue": {
                "requests": 2,
                "formation_p50_ms": 1.235,  # 1.23456, the smaller
                "formation_p95_ms": 1.235,
                "busy_p50_ms": 2.346,  # 2.34567
                "busy_p95_ms": 2.346,
            }
        },
        "slowest": [
            {"trace_id": "t2", "root": "POST /x", "total_ms": 45.679, "bottleneck": "decode", "diagnoses": []},
            {
                "trace_id": "t1",
                "root": "POST /x",
                "total_ms": 12.346,
                "bottleneck": "infer",
                "diagnoses": ["GPU_STARVED", "NOT_A_RULE"],
            },
        ],
    }
    assert got == expected
    # the oracle agrees on each reading; p99 is not the largest (a quantile read at another rank reads otherwise)
    decode, total, size = ones(3.45678, 40.12345), ones(12.34567, 45.67891), ones(2, 3, 8)
    for q in (0.5, 0.95, 0.99):
        assert (round(reading(decode, q), 3), round(reading(total, q), 3)) == (3.49, 12.346)
    assert (round(reading(ones(0.123456, 0.654321), 0.5), 4), round(reading(size, 0.95), 2)) == (0.1237, 2.97)
    assert (round(reading(ones(1.23456, 5.6789), 0.95), 3), round(reading(ones(2.34567, 7.891), 0.95), 3)) == (
        1.235,
        2.346,
    )
    largest = (round(reading(decode, 1.0), 4), reading(total, 1.0), round(reading(size, 1.0), 4))
    assert largest == (40.0478, 45.67891, 7.925)  # bucket 185's midpoint; 46.07 clamped down; bucket 104's
    # ties in a count keep the order first seen: infer (t1's) before decode (t2's)
    assert list(got["bottlenecks"]) == ["infer", "decode"] and list(got["diagnoses"]) == ["GPU_STARVED", "NOT_A_RULE"]


def test_the_oracle_reads_the_known_bucket_midpoints():
    """The oracle itself on values whose readings are known: a single value reads itself (clamped), the
    smaller of two reads its bucket's midpoint clamped up to it or the midpoint, within 1 %."""
    assert reading(ones(8.88889), 0.5) == 8.88889
    assert reading(ones(0.0, 5.0), 0.5) == 0.0 and reading(ones(0.0, 5.0), 1.0) == 5.0
    assert reading([(1.0, 1), (4.0, 3)], 0.5) == reading(ones(4.0), 0.5) == 4.0  # rank 1.5 of 4: a 4
    for v in (3.45678, 12.34567, 0.123456, 1.23456):
        assert reading(ones(v, 100.0), 0.5) == pytest.approx(v, rel=0.01)


def test_an_empty_summary_reads_nothing_as_zero_and_leaves_the_optional_tables_out():
    got = Aggregator().summary()
    assert got == {
        "traces": 0, "slow_traces": 0, "requests": 0, "slow_requests": 0, "slow_reasons": {}, "sampled": False,
        "counted": None, "total_ms": {"p50": 0.0, "p95": 0.0, "p99": 0.0}, "stages": {}, "bottlenecks": {},
        "diagnoses": {}, "diagnosis_sample_rate": 1.0, "advice": {}, "examples": {}, "evidence": {},
        "slowest": [],
    }  # fmt: skip


def test_a_stage_filled_by_a_loader_without_requests_is_a_cpu_stage_of_no_share():
    """The fleet loader creates a stage by name (``stage(name)``) and fills its counts: its kind is cpu unless
    said; with no request read, its mean share is 0, not a division by zero nor 1."""
    agg = Aggregator()
    s = agg.stage("decode")
    s.traces, s.share_sum = 3, 1.5
    assert agg.stage("decode") is s and agg.stage("decode", "gpu").kind == "cpu"  # the kind first given stays
    row = agg.summary()["stages"]["decode"]
    assert (row["kind"], row["traces"], row["mean_share"], row["bottleneck_traces"]) == ("cpu", 3, 0.0, 0)
    agg.requests = 2  # the loader's trace counts: 1.5 shares over 2 requests
    assert agg.summary()["stages"]["decode"]["mean_share"] == 0.75


# --- weighted counts ------------------------------------------------------------------------------------------


def test_a_weighted_count_is_whole_when_it_is_else_to_a_tenth():
    assert as_count(0.0) == 0 and isinstance(as_count(0.0), int)
    assert as_count(3.0) == 3 and isinstance(as_count(3.0), int)
    assert as_count(2.37) == 2.4  # not 2 (cut), 2.37 (two places) nor 1
    assert as_count(2.04) == 2.0 and isinstance(as_count(2.04), float)  # an estimate still reads as one


def test_requests_of_fractional_weights_read_to_a_tenth_and_say_they_are_sampled():
    """A slow trace kept for 1.37 requests and a healthy one for 1: 2.37 requests (2.4), 1.37 slow (1.4) by its
    gaps, its stage the bottleneck of 1.4; a kept trace weighing 3 makes 4 requests of 2 traces, whole."""
    agg = Aggregator()
    agg.add(verdict("s", 300.0, {"decode": 300.0}, slow=True, slow_reason="gap"), weight=1.37)
    agg.add(verdict("h", 100.0, {"infer": 100.0}))
    got = agg.summary()
    assert (got["traces"], got["requests"], got["slow_traces"], got["slow_requests"]) == (2, 2.4, 1, 1.4)
    assert got["slow_reasons"] == {"gap": 1.4} and got["bottlenecks"] == {"decode": 1.4, "infer": 1}
    assert got["stages"]["decode"]["bottleneck_traces"] == 1.4 and got["sampled"] is True
    # decode is all of s's 300 ms: a share of 1 weighing 1.37 over 2.37 requests
    assert got["stages"]["decode"]["mean_share"] == round(1.37 / 2.37, 4) == 0.5781
    whole = Aggregator()
    whole.add(verdict("a", 10.0, {"x": 10.0}), weight=3)
    whole.add(verdict("b", 10.0, {"x": 10.0}))
    got = whole.summary()
    assert (got["requests"], got["sampled"]) == (4, True) and isinstance(got["requests"], int)


# --- a stage's share of its trace at the total's edges ---------------------------------------------------------


@pytest.mark.parametrize(
    ("total_ms", "stage_ms", "share"),
    [
        (0.0, 0.25, 0.0),  # a total of 0 (another writer's root): nothing to share, not a division by zero
        (1.0, 0.25, 0.25),  # exactly 1 ms: 0.25 / 1
        (0.5, 0.25, 0.5),  # under 1 ms: still shared, 0.25 / 0.5
        (2.0, 3.0, 1.0),  # a stage longer than its trace (overlapping work) counts as all of it, not 1.5
    ],
)
def test_a_stage_s_share_is_its_time_over_its_trace_s_total_at_the_edges(total_ms, stage_ms, share):
    agg = Aggregator()
    agg.add(verdict("t", total_ms, {"s": stage_ms}))
    assert agg.summary()["stages"]["s"]["mean_share"] == share


# --- the slowest list -----------------------------------------------------------------------------------------


def test_the_slowest_list_holds_ten_by_default_and_the_eleventh_pushes_out_the_least_slow():
    """Totals 110, 120, ..., 210 ms (over 200 ms: slowness 0.55 to 1.05), read from the fastest: ten kept,
    the 110 ms one out; read from the slowest, the same ten."""
    for order in (range(11), range(10, -1, -1)):
        agg = Aggregator()
        for i in order:
            agg.add(verdict(f"t{i}", 110.0 + 10 * i, {"s": 1.0}))
        assert [v.trace_id for v, _ in agg.slowest()] == [f"t{i}" for i in range(10, 0, -1)]
        assert len(agg.summary()["slowest"]) == 10


def test_a_trace_as_slow_as_the_last_kept_does_not_push_it_out():
    """Room for 2: 300 ms then 200 ms kept; another 200 ms (as slow as the least) is not kept, the first
    keeps its place and its waterfall; 250 ms pushes the 200 ms out; ``would_keep`` agrees each time."""
    agg = Aggregator(keep_slowest=2)
    agg.add(verdict("a", 300.0, {"s": 1.0}))
    agg.add(verdict("b", 200.0, {"s": 1.0}), [{"name": "b's"}])
    tie = verdict("c", 200.0, {"s": 1.0})
    assert not agg.would_keep(tie)
    agg.add(tie, [{"name": "c's"}])
    assert [(v.trace_id, w) for v, w in agg.slowest()] == [("a", []), ("b", [{"name": "b's"}])]
    faster = verdict("d", 250.0, {"s": 1.0})
    assert agg.would_keep(faster)
    agg.add(faster)
    assert [v.trace_id for v, _ in agg.slowest()] == ["a", "d"]


def test_traces_equally_slow_are_listed_the_one_read_last_first():
    """Three 120 ms traces with room for three: the list is in a fixed order, the latest read first (each
    offer is numbered in the order read: slowness, then that number, decide the rank); merged into another
    aggregator, the other's are offered after its own, so read later."""
    agg = Aggregator(keep_slowest=3)
    for name in ("x", "y", "z"):
        agg.add(verdict(name, 120.0, {"s": 1.0}))
    assert [v.trace_id for v, _ in agg.slowest()] == ["z", "y", "x"]
    whole = Aggregator(keep_slowest=4)
    whole.add(verdict("w", 120.0, {"s": 1.0}))
    whole.merge(agg)
    assert [v.trace_id for v, _ in whole.slowest()] == ["z", "y", "x", "w"]


# --- streams and calls handed to pools, added one by one -------------------------------------------------------


def test_disconnected_streams_add_up_within_one_aggregator():
    """A stream of 3 chunks (disconnected: under 5) weighing 2, then one of 11 (finished): 2 disconnected of
    3 streams, not the last one's 0; a third, disconnected, makes 3 of 4."""
    agg = Aggregator()
    agg.add(verdict("a", 100.0, {"s": 1.0}, stream=stream(5.0, 2.0, 3, "s")), weight=2)
    agg.add(verdict("b", 100.0, {"s": 1.0}, stream=stream(5.0, 2.0, 11, "s")))
    got = agg.summary()["streams"]
    assert (got["streams"], got["disconnected"]) == (3, 2)
    assert got["chunks_mean"] == 5.7  # (3 * 2 + 11) / 3 = 5.67
    agg.add(verdict("c", 100.0, {"s": 1.0}, stream=stream(5.0, 2.0, 4, "s")))
    assert agg.summary()["streams"]["disconnected"] == 3


def test_the_streams_table_weighs_each_stream_s_first_chunk_gaps_and_rate():
    """a: 11 chunks over 2000 ms (10 / 2 s = 5 chunks/s), first chunk 12.34567 ms, gap p99 3.21098 ms, weight 1;
    b: 3 chunks (disconnected) over 0.7 ms (2 / 0.0007 s = 2857.14 chunks/s), 50.56789 ms, 30.12345 ms, weight 2.
    Three streams: every quantile (rank 1, 1.9, 1.98 of 0..2) is b's, not a's (rank 0.5 of 0..1, each weighing
    1). b's first chunk and gap read their buckets' midpoints (50.911, 30.267) clamped down to themselves; its
    rate bucket 398's midpoint, 2836.185 (within 1 %)."""
    agg = Aggregator()
    a = stream(12.34567, 3.21098, 11, "decode")._replace(streaming_ms=2000.0)
    b = stream(50.56789, 30.12345, 3, "infer")._replace(streaming_ms=0.7)
    agg.add(verdict("a", 100.0, {"s": 1.0}, stream=a))
    agg.add(verdict("b", 100.0, {"s": 1.0}, stream=b), weight=2)
    assert agg.summary()["streams"] == {
        "streams": 3,
        "chunks_mean": 5.7,  # (11 + 3 * 2) / 3 = 5.67
        "first_chunk_ms": {"p50": 50.568, "p95": 50.568, "p99": 50.568},
        "gap_p99_ms": {"p50": 30.123, "p95": 30.123, "p99": 30.123},
        "chunks_per_s": {"p50": 2836.185, "p95": 2836.185, "p99": 2836.185},
        "disconnected": 2,
        "first_chunk_bottlenecks": {"prefill": 3},
        "gap_bottlenecks": {"infer": 2, "decode": 1},
    }
    for values, read in (([(12.34567, 1), (50.56789, 2)], 50.568), ([(3.21098, 1), (30.12345, 2)], 30.123),
                         ([(5.0, 1), (2 / 0.0007, 2)], 2836.185)):  # fmt: skip
        assert [round(reading(values, q), 3) for q in (0.5, 0.95, 0.99)] == [read] * 3  # the oracle agrees


@pytest.mark.parametrize(
    ("chunks", "streaming_ms", "rate"),
    [
        (11, 2000.0, 5.0),  # 10 chunks after the first over 2 s (one value: read as itself)
        (2, 1.0, 1000.0),  # 1 ms, the boundary: 1 / 0.001 s
        (2, 0.5, 2000.0),  # under 1 ms: still a rate, 1 / 0.0005 s
        (1, 5.0, None),  # one chunk (a stored verdict that says it streamed 5 ms): no rate, not 0 chunks/s
        (3, 0.0, None),  # all chunks at once: no time to divide by
    ],
)
def test_a_stream_s_rate_is_its_chunks_after_the_first_over_its_streaming_seconds(chunks, streaming_ms, rate):
    agg = Aggregator()
    agg.add(verdict("a", 100.0, {"s": 1.0}, stream=stream(5.0, None, chunks, "s")._replace(streaming_ms=streaming_ms)))
    got = agg.summary()["streams"]
    assert got["chunks_per_s"] == (None if rate is None else {"p50": rate, "p95": rate, "p99": rate})
    assert got["gap_p99_ms"] is None  # no stream said its gaps


def test_a_batcher_that_never_said_how_full_it_ran_has_no_fill_not_a_fill_of_0():
    agg = Aggregator()
    agg.add_batch("infer.batch", 4, None)
    agg.add_batch("infer.batch", 6, None)
    row = agg.summary()["batches"]["infer.batch"]
    # ranks 0.5 and 0.95 of 0..1: the 4, bucket 70's midpoint 4.0148 (between 4 and 6: not clamped)
    assert row == {"executions": 2, "size_mean": 5.0, "size_p50": 4.01, "size_p95": 4.01, "fill_mean": None}


def test_each_stretch_of_a_call_handed_to_a_pool_is_weighed_by_its_trace():
    """Two calls: 1 ms to send, 10 to run, 0.5 to return (weight 1) and 4, 40, 2 ms (weight 3): 4 calls, the
    p50 of each stretch (rank 1.5 of 0..3) is the heavier call's, not the lighter one's (it would be, each
    weighing 1: rank 0.5 of 0..1)."""
    row = OffloadSummary()
    info = OffloadInfo("ProcessPoolExecutor", 2, 1, 100, 10, worker_task_seq=2)
    row.add(OffloadedCall("tokenize", info, 0.0, 1.0, 10.0, 0.5))
    row.add(OffloadedCall("tokenize", info, 0.0, 4.0, 40.0, 2.0), weight=3)
    got = row.summary()
    assert got["calls"] == 4
    # 4 and 40 ms: their buckets' midpoints (4.0003, 40.0038) clamped to the largest; 2 ms: its bucket's midpoint
    # 1.9937 (under the largest, over the smallest, 0.5)
    assert (got["send_p50_ms"], got["run_p50_ms"], got["return_p50_ms"]) == (4.0, 40.0, 1.994)
    assert got["return_p50_ms"] == round(reading([(0.5, 1), (2.0, 3)], 0.5), 3)


def test_a_call_whose_argument_size_is_unknown_adds_no_bytes():
    """One call without its arguments' size and a result of 0 bytes: both means 0, not 1; the executor is the
    first call's; a row of no calls reads 0 bytes."""
    row = OffloadSummary()
    row.add(call(2.0, 1, 1, None, 0, "multiprocessing.Pool"))
    got = row.summary()
    assert (got["calls"], got["args_bytes_mean"], got["result_bytes_mean"]) == (1, 0, 0)
    assert (got["executor"], got["first_tasks"], got["saturated"]) == ("multiprocessing.Pool", 1, 0)
    row.add(call(2.0, 2, 3, 7, 5, "ProcessPoolExecutor"), weight=0.5)
    got = row.summary()  # 7 bytes weighing 0.5 over 1.5 calls: 2.33, read whole
    assert (got["calls"], got["args_bytes_mean"], got["result_bytes_mean"]) == (1.5, 2, 2)
    assert (got["executor"], got["first_tasks"], got["saturated"]) == ("multiprocessing.Pool", 1, 0.5)


# --- when the diagnosis counts are estimates --------------------------------------------------------------------


def rated(trace_id: str, rate: float, code: str = "GPU_STARVED", diagnosis_weight: float = 1.0) -> Any:
    return verdict(
        trace_id, 100.0, {"s": 100.0}, diagnoses=(Diagnosis(code, f"{trace_id}'s", ""),),
        diagnosis_sample_rate=rate, diagnosis_weight=diagnosis_weight,
    )  # fmt: skip


def test_the_diagnosis_sample_rate_is_the_least_any_kept_trace_was_diagnosed_at():
    """Nothing read, or every trace diagnosed (rate 1, the boundary): 1.0, no line; 0.5 then 0.25 then 1.0:
    0.25 (the least, not the last); the report then says the counts are estimates, at 25 %."""
    agg = Aggregator()
    assert agg.summary()["diagnosis_sample_rate"] == 1.0
    agg.add(rated("a", 1.0))
    assert agg.summary()["diagnosis_sample_rate"] == 1.0 and diagnosis_sample_line(agg.summary()) is None
    for trace_id, rate in (("b", 0.5), ("c", 0.25), ("d", 1.0)):
        agg.add(rated(trace_id, rate))
    got = agg.summary()
    assert got["diagnosis_sample_rate"] == 0.25 and got["diagnoses"] == {"GPU_STARVED": 4}
    assert "as few as 25% of the traces" in diagnosis_sample_line(got)
    just_under = Aggregator()
    just_under.add(rated("e", 0.999))
    assert just_under.summary()["diagnosis_sample_rate"] == 0.999 and diagnosis_sample_line(just_under.summary())


def test_parts_diagnosed_at_different_rates_merge_to_the_least_either_way():
    """A part diagnosed at 0.5 and one at 0.2: merged in either order, 0.2; a part all diagnosed leaves a
    lower rate as it is."""
    for first, second in ((0.5, 0.2), (0.2, 0.5)):
        merged, other = Aggregator(), Aggregator()
        merged.add(rated("a", first))
        other.add(rated("b", second))
        merged.merge(other)
        assert merged.summary()["diagnosis_sample_rate"] == 0.2
    lower, full = Aggregator(), Aggregator()
    lower.add(rated("a", 0.3))
    full.add(rated("b", 1.0))
    lower.merge(full)
    assert lower.summary()["diagnosis_sample_rate"] == 0.3


def test_a_kept_trace_s_diagnoses_count_for_its_requests_not_for_its_diagnosis_weight():
    """Every kept trace was diagnosed (the report's line says so): its findings count for the requests it
    stands for (weight 2), not for the diagnosis counter's 1 / rate (4, of a rate of 0.25)."""
    agg = Aggregator()
    agg.add(rated("a", 0.25, diagnosis_weight=4.0), weight=2)
    agg.add(rated("b", 1.0, code="NOT_A_RULE"))
    got = agg.summary()
    assert got["diagnoses"] == {"GPU_STARVED": 2, "NOT_A_RULE": 1} and got["diagnosis_sample_rate"] == 0.25
