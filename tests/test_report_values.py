"""The report's figures on hand-computed inputs: the quantile sketch's bucket formula, counts sent back
already bucketed (as ClickHouse sends them) and merges; the aggregator of parts merged into the aggregator of
the whole, with parts chosen so that a field merged wrongly (dropped, doubled, taken from the wrong side)
gives another answer; the table of calls handed to process pools, weighted."""

from __future__ import annotations

import math
from typing import Any

import pytest

from stagetrace.analysis import Verdict
from stagetrace.analysis.diagnosis import Diagnosis
from stagetrace.analysis.offload import OffloadedCall, OffloadInfo
from stagetrace.analysis.streams import StreamSummary
from stagetrace.report.aggregate import Aggregator, Counted, OffloadSummary, Tally
from stagetrace.report.sketch import Bucket, QuantileSketch

GAMMA = 1.01 / 0.99  # the bucket growth of alpha = 1 %: (1 + alpha) / (1 - alpha)


def midpoint(key: int) -> float:
    """What the sketch reads back for a value of bucket ``key``: the bucket's midpoint, 2 gamma^k / (gamma + 1)."""
    return 2 * GAMMA**key / (GAMMA + 1)


# --- the sketch ------------------------------------------------------------------------------------------------


def test_a_value_s_bucket_is_the_ceiling_of_its_log_in_base_gamma_and_zeros_have_none():
    s = QuantileSketch()
    assert s.log_gamma == pytest.approx(math.log(GAMMA), rel=1e-12)
    # ln(100) / ln(1.0202...) = 230.26: bucket 231; 1 is bucket 0; gamma itself closes bucket 1; ln(0.5) / ... =
    # -34.66: bucket -34
    assert [s.bucket_key(v) for v in (100.0, 1.0, GAMMA, GAMMA * 1.0001, 0.5)] == [231, 0, 1, 2, -34]
    assert s.bucket_key(1e-9) is None and s.bucket_key(0.0) is None and s.bucket_key(-3.0) is None
    assert s.bucket_key(2e-9) == math.ceil(math.log(2e-9) / math.log(GAMMA))  # just over the zero mark


def test_quantiles_read_the_bucket_of_the_rank_q_times_n_minus_1_clamped_to_the_values_seen():
    s = QuantileSketch()
    for v in (0.0, 0.0, 1.0, 2.0, 3.0, 100.0):
        s.add(v)
    assert (s.count, s.zeros, s.sum, s.min, s.max) == (6, 2, 106.0, 0.0, 100.0)
    assert s.quantile(0.0) == 0.0 and s.quantile(0.3) == 0.0  # ranks 0 and 1.5: among the two zeros
    assert s.quantile(0.4) == midpoint(0) == pytest.approx(0.99)  # rank 2: the value 1, bucket 0
    assert s.quantile(0.5) == midpoint(0)  # rank 2.5: the first bucket whose count passes it, still the 1's
    assert s.quantile(0.6) == midpoint(s.bucket_key(2.0)) == midpoint(35)  # rank 3: the value 2
    assert s.quantile(1.0) == 100.0  # bucket 231's midpoint (100.4) clamped to the largest value seen
    assert s.mean == pytest.approx(106 / 6)
    assert QuantileSketch().quantile(0.5) == 0.0 and QuantileSketch().mean == 0.0
    one = QuantileSketch()
    one.add(7.0)
    assert one.quantile(0.0) == one.quantile(1.0) == 7.0  # rank 0 of one value: itself, clamped


def test_weights_count_as_that_many_values():
    s = QuantileSketch()
    s.add(1.0, weight=3)
    s.add(50.0, weight=1)
    assert (s.count, s.sum) == (4, 53.0)
    assert s.quantile(0.5) == 1.0  # rank 1.5 of 4: within the three 1s (bucket 0's midpoint, 0.99, clamped up)
    assert s.quantile(1.0) == midpoint(s.bucket_key(50.0))  # rank 3: the 50's bucket (49.90, within 1 %)


def test_counts_sent_back_bucketed_read_as_the_values_themselves():
    """A database buckets 0, 0, 2, 2.01 (one bucket: 2 and 2.01 share key 35) and 9 (key 110) and sends the counts
    back; the sketch reads the same count, sum, extremes and quantiles as one that saw the values; a bucket
    of nothing adds nothing."""
    values = (0.0, 0.0, 2.0, 2.01, 9.0)
    direct = QuantileSketch()
    for v in values:
        direct.add(v)
    k2, k9 = direct.bucket_key(2.0), direct.bucket_key(9.0)
    assert k2 == direct.bucket_key(2.01) == 35 and k9 == 110
    sent = QuantileSketch()
    for bucket in (Bucket(None, 2, 0.0, 0.0, 0.0), Bucket(35, 2, 4.01, 2.0, 2.01), Bucket(110, 1, 9.0, 9.0, 9.0),
                   Bucket(7, 0, 99.0, -5.0, 500.0)):  # fmt: skip
        sent.add_bucket(bucket)
    assert (sent.count, sent.zeros, sent.sum, sent.min, sent.max) == (5, 2, pytest.approx(13.01), 0.0, 9.0)
    assert [sent.quantile(q) for q in (0.25, 0.5, 0.75, 1.0)] == [direct.quantile(q) for q in (0.25, 0.5, 0.75, 1.0)]
    assert sent.quantile(0.5) == midpoint(35)  # rank 2: the first value of bucket 35


def test_sketches_of_parts_merge_into_the_sketch_of_the_whole():
    """[0, 5, 50] and [1, 2, 500] (weights 1, 2, 1 and 1, 1, 3): count, zeros, sum and extremes add up, and the
    quantiles are those of one sketch fed all six; sketches of another accuracy do not merge."""
    a, b, whole = QuantileSketch(), QuantileSketch(), QuantileSketch()
    for sketch, pairs in ((a, ((0.0, 1), (5.0, 2), (50.0, 1))), (b, ((1.0, 1), (2.0, 1), (500.0, 3)))):
        for value, weight in pairs:
            sketch.add(value, weight)
            whole.add(value, weight)
    a.merge(b)
    assert (a.count, a.zeros, a.sum, a.min, a.max) == (9, 1, 1563.0, 0.0, 500.0)
    assert [a.quantile(q / 8) for q in range(9)] == [whole.quantile(q / 8) for q in range(9)]
    assert a.quantile(0.5) == midpoint(a.bucket_key(5.0))  # rank 4 of 9: 0, 1, 2, 5, 5 -> the second 5
    with pytest.raises(ValueError, match="different accuracy"):
        a.merge(QuantileSketch(alpha=0.02))


# --- the aggregator --------------------------------------------------------------------------------------------


def verdict(trace_id: str, total_ms: float, breakdown: dict[str, float], **changes: Any) -> Verdict:
    fields: dict[str, Any] = dict(
        trace_id=trace_id, root_name="POST /x", total_ms=total_ms, breakdown=breakdown,
        bottleneck=max(breakdown, key=breakdown.__getitem__), ratio=0.5, slow=False, slow_threshold_ms=200.0,
        untracked_ms=0.0,
    )  # fmt: skip
    fields.update(changes)
    return Verdict(**fields)


def stream(first_ms: float, gap_p99_ms: float | None, chunks: int, bottleneck: str) -> StreamSummary:
    return StreamSummary(
        chunks=chunks, first_chunk_ms=first_ms, streaming_ms=1000.0, gap_p50_ms=gap_p99_ms, gap_p99_ms=gap_p99_ms,
        gap_max_ms=gap_p99_ms, send_wait_ms=0.0, disconnected=chunks < 5, first_chunk_bottleneck="prefill",
        gap_bottleneck=bottleneck, first_chunk_breakdown={}, gap_breakdown={}, gaps=None,
    )  # fmt: skip


def call(queue_ms: float, seq: int, in_flight: int, args: int, result: int | None, executor: str) -> OffloadedCall:
    return OffloadedCall("tokenize", OffloadInfo(executor, 2, in_flight, args, result, worker_task_seq=seq),
                         queue_ms, 1.0, 10.0, 0.5)  # fmt: skip


def part_a() -> Aggregator:
    agg = Aggregator(keep_slowest=2)
    agg.add(
        verdict(
            "a1", 300.0, {"decode": 200.0, "infer": 100.0}, slow=True, slow_reason="gap",
            diagnoses=(Diagnosis("X", "a1's finding", "advice", evidence="a1's evidence"),),
            stream=stream(40.0, 120.0, 11, "decode"), gpu_utilization=0.25,
            offloads=(call(4.0, 1, 1, 100, 80, "ProcessPoolExecutor"),),
        ),
        weight=2,
    )  # fmt: skip
    agg.add(verdict("a2", 50.0, {"decode": 30.0, "infer": 20.0}, gpu_utilization=0.75))
    agg.add_batch("infer.batch", 4, 0.5)
    agg.counted = Counted(10, 2)
    return agg


def part_b() -> Aggregator:
    agg = Aggregator(keep_slowest=2)
    agg.add(
        verdict(
            "b1", 900.0, {"infer": 600.0, "post": 300.0}, slow=True, slow_reason="total",
            diagnoses=(Diagnosis("X", "b1's finding", "advice", evidence="b1's evidence"), Diagnosis("Y", "y", "")),
            stream=stream(10.0, None, 3, "infer"), stage_kinds={"infer": "gpu"},
            offloads=(call(9.0, 2, 3, 400, None, "multiprocessing.Pool"),),
        )
    )  # fmt: skip
    agg.add(verdict("b2", 120.0, {"post": 120.0}))
    agg.add_batch("infer.batch", 8, 1.0)
    agg.add_batch_wait("infer.batch.queue", 2.0, 6.0)
    agg.counted = Counted(5, 1)
    return agg


def test_parts_merged_are_the_whole_figure_by_figure():
    """Two parts of four traces (one weighing 2): merged, every figure of the summary is that of one aggregator
    fed all four, and the hand-computed ones are: 5 requests of 4 traces, 3 slow (2 by the gaps, 1 by the
    total), the exact counts summed, X's example and evidence from the part merged into, the two slowest."""
    merged = part_a()
    merged.merge(part_b())
    (b1, _), (b2, _) = part_b().slowest()
    whole = part_a()  # the same traces fed one by one: b's two verdicts, batch and batch wait added to a
    whole.add(b1)
    whole.add(b2)
    whole.add_batch("infer.batch", 8, 1.0)
    whole.add_batch_wait("infer.batch.queue", 2.0, 6.0)
    whole.counted = Counted(15, 3)
    got = merged.summary()
    assert got == whole.summary()
    assert (got["traces"], got["requests"], got["slow_traces"], got["slow_requests"]) == (4, 5, 2, 3)
    assert got["slow_reasons"] == {"gap": 2, "total": 1} and got["counted"] == {"requests": 15, "slow": 3}
    assert got["diagnoses"] == {"X": 3, "Y": 1} and got["bottlenecks"] == {"decode": 3, "infer": 1, "post": 1}
    assert got["examples"]["X"] == "a1's finding" and got["evidence"] == {"X": "a1's evidence"}
    stages = got["stages"]
    assert {n: s["traces"] for n, s in stages.items()} == {"decode": 2, "infer": 3, "post": 2}
    assert stages["infer"]["kind"] == "cpu"  # the kind first seen (a's), not b's "gpu"
    assert stages["decode"]["mean_ms"] == pytest.approx((200 * 2 + 30) / 3, abs=1e-3)
    # decode's share: 200/300 of a1 (weight 2) and 30/50 of a2, over 5 requests
    assert stages["decode"]["mean_share"] == pytest.approx(round((2 * 200 / 300 + 30 / 50) / 5, 4))
    assert [s["trace_id"] for s in got["slowest"]] == ["b1", "a1"]
    assert got["gpu_utilization"]["mean"] == pytest.approx((0.25 * 2 + 0.75) / 3, abs=1e-4)
    assert got["batches"]["infer.batch"]["executions"] == 2 and got["batches"]["infer.batch"]["size_mean"] == 6.0
    assert got["batches"]["infer.batch"]["fill_mean"] == 0.75
    assert got["batch_waits"]["infer.batch.queue"]["requests"] == 1
    streams = got["streams"]
    assert streams["streams"] == 3 and streams["disconnected"] == 1  # a1 twice, b1's 3 chunks: disconnected
    assert streams["chunks_mean"] == pytest.approx((11 * 2 + 3) / 3, abs=0.05)
    assert streams["gap_bottlenecks"] == {"decode": 2, "infer": 1} and streams["gap_p99_ms"]["p50"] == pytest.approx(
        120.0, rel=0.01
    )  # b1 has no gaps: only a1's, twice
    offload = got["offloads"]["tokenize"]
    assert offload["executor"] == "ProcessPoolExecutor"  # the first seen
    assert (offload["calls"], offload["first_tasks"], offload["saturated"]) == (3, 2, 1)
    assert offload["args_bytes_mean"] == round((100 * 2 + 400) / 3)
    assert offload["result_bytes_mean"] == round(80 * 2 / 3)  # the lost result counts as nothing


def test_counts_merge_from_a_part_that_has_them_into_one_that_has_none():
    merged = Aggregator()
    merged.merge(part_a())
    assert merged.counted == Counted(10, 2)
    merged.merge(Aggregator())  # a part without counts leaves them as they are
    assert merged.counted == Counted(10, 2)


def test_tallies_add_name_by_name():
    a, b = Tally(), Tally()
    a["x"] += 1.5
    b["x"] += 2
    b["y"] += 0.5
    a.add_all(b)
    assert dict(a) == {"x": 3.5, "y": 0.5} and dict(b) == {"x": 2, "y": 0.5}


def test_an_offload_table_row_weighs_its_calls_and_reads_their_quantiles():
    """Queue 1 ms (weight 1) and 3 ms (weight 2): 3 calls; the p50 (rank 1 of 3) and p95 are the 3 ms bucket; a
    call that found more calls than workers is saturated, a worker's first task is counted; an empty row
    divides by one, not zero."""
    row = OffloadSummary()
    row.add(call(1.0, 1, 2, 300, 30, "ProcessPoolExecutor"))
    row.add(call(3.0, 5, 3, 600, 60, "ProcessPoolExecutor"), weight=2)
    got = row.summary()
    assert got["calls"] == 3 and got["first_tasks"] == 1 and got["saturated"] == 2
    assert got["queue_p50_ms"] == got["queue_p95_ms"] == round(midpoint(QuantileSketch().bucket_key(3.0)), 3)
    # every call sent for 1 ms, ran 10 ms, returned in 0.5 ms: the buckets' midpoints clamped to the one value
    assert (got["send_p50_ms"], got["run_p50_ms"], got["return_p50_ms"]) == (1.0, 10.0, 0.5)
    assert (got["args_bytes_mean"], got["result_bytes_mean"]) == (500, 50)
    empty = OffloadSummary().summary()
    assert empty["calls"] == 0 and empty["args_bytes_mean"] == 0 and empty["queue_p50_ms"] == 0.0
    other = OffloadSummary()
    other.add(call(20.0, 1, 1, 900, None, "multiprocessing.Pool"))
    row.merge(other)
    merged = row.summary()
    assert merged["executor"] == "ProcessPoolExecutor" and merged["calls"] == 4 and merged["first_tasks"] == 2
    assert merged["args_bytes_mean"] == round((300 + 1200 + 900) / 4) and merged["saturated"] == 2
    # queue 1, 3, 3, 20: the p95 (rank 2.85 of 4) is still the 3 ms bucket, the largest is the 20 ms one
    assert merged["queue_p95_ms"] == round(midpoint(QuantileSketch().bucket_key(3.0)), 3)
    assert row.queue.quantile(1.0) == midpoint(QuantileSketch().bucket_key(20.0)) and row.queue.max == 20.0


# --- a trace read back from its file --------------------------------------------------------------------------


def test_a_trace_read_back_has_the_verdict_the_exporter_gave_it_stored_or_recomputed(tmp_path):
    """A pipeline of a CPU stage, an I/O stage, a stage repeated past folding, a failing stage, an offloaded
    call and 200 ms in no stage, exported to a file: its stored verdict reads back as the exporter's own (the
    on_verdict callback's), field by field; with the verdict's attributes taken off the root, the report
    recomputes from the stages and finds the same breakdown, bottleneck, kinds and calls."""
    import concurrent.futures as cf
    import multiprocessing as mp
    import time

    import stagetrace
    from stagetrace import conventions as c
    from stagetrace.report.loader import read_traces
    from stagetrace.report.traces import verdict_for_trace

    verdicts: list[Verdict] = []
    handle = stagetrace.configure(
        "round-trip", traces_path=tmp_path / "t.jsonl", on_verdict=verdicts.append, slow_threshold_ms=1,
        set_global=False,
    )  # fmt: skip
    try:
        with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
            assert pool.submit(len, "warm").result() == 4  # started: the call below is no cold start
            with stagetrace.pipeline("job"):
                with stagetrace.stage("decode"):
                    sum(i * i for i in range(200_000))
                with stagetrace.stage("infer", kind="io"):
                    time.sleep(0.003)
                for _ in range(8):
                    with stagetrace.stage("step"):
                        pass
                try:
                    with stagetrace.stage("post"):
                        raise ValueError("bad")
                except ValueError:
                    pass
                assert pool.submit(len, "abc").result() == 3
                time.sleep(0.2)  # in no stage: a diagnosis (UNTRACKED_TIME), its message and evidence read back
        assert handle.force_flush(30)
    finally:
        handle.shutdown()
    (exported,) = verdicts
    assert exported.diagnoses and exported.process_cpus
    traces: list[list[Any]] = []
    read_traces([tmp_path / "t.jsonl"], traces.append)
    (spans,) = traces
    stored = verdict_for_trace(spans)
    for name in ("trace_id", "root_name", "bottleneck", "slow", "slow_reason", "route", "diagnosis_codes",
                 "process_cpus"):  # fmt: skip
        assert getattr(stored, name) == getattr(exported, name), name
    for name in ("total_ms", "ratio", "slow_threshold_ms", "untracked_ms", "process_cpus_used", "process_runnable"):
        assert getattr(stored, name) == pytest.approx(getattr(exported, name), abs=1e-3), name
    assert stored.breakdown == pytest.approx(dict(exported.breakdown), abs=1e-3)
    assert dict(stored.stage_kinds) == {**exported.stage_kinds} and stored.stage_kinds["len"] == "offload"
    assert stored.diagnoses == exported.diagnoses  # code, message, advice, stage, evidence
    assert [(o.name, o.info) for o in stored.offloads] == [(o.name, o.info) for o in exported.offloads]
    assert stored.offloads[0].run_ms == pytest.approx(exported.offloads[0].run_ms, abs=1e-3)
    root = next(s for s in spans if s.attributes.get(c.TOTAL_MS) is not None)
    del root.attributes[c.TOTAL_MS]
    recomputed = verdict_for_trace(spans)
    assert recomputed.breakdown == pytest.approx(dict(exported.breakdown), abs=1e-3)
    assert (recomputed.bottleneck, recomputed.slow) == (exported.bottleneck, exported.slow)
    assert recomputed.untracked_ms == pytest.approx(exported.untracked_ms, abs=1e-3)
    assert [(o.name, o.info) for o in recomputed.offloads] == [(o.name, o.info) for o in exported.offloads]
    assert set(recomputed.stage_kinds) == set(exported.stage_kinds)


# --- merges into a part that already holds the same names (a wrong merge that overwrites shows here) -----------


def test_sketches_sharing_zeros_and_buckets_add_them():
    a, b = QuantileSketch(), QuantileSketch()
    for sketch in (a, b):
        sketch.add(0.0)
        sketch.add(5.0)
    a.merge(b)
    assert (a.count, a.zeros) == (4, 2)
    assert a.quantile(0.0) == a.quantile(1 / 3) == 0.0 and a.quantile(2 / 3) == 5.0  # bucket 81, clamped to 5
    sent = QuantileSketch()
    for bucket in (Bucket(None, 1, 0.0, 0.0, 0.0), Bucket(None, 2, 0.0, 0.0, 0.0), Bucket(81, 1, 5.0, 5.0, 5.0),
                   Bucket(81, 3, 15.0, 5.0, 5.0), Bucket(200, 1, 54.6, 54.6, 54.6)):  # fmt: skip
        sent.add_bucket(bucket)
    assert (sent.count, sent.zeros, sent.sum) == (8, 3, pytest.approx(74.6))
    # ranks 2, 3 and 6 of 0..7: the last zero, then bucket 81 (four values) to its last
    assert (sent.quantile(2 / 7), sent.quantile(3 / 7), sent.quantile(6 / 7)) == (0.0, midpoint(81), midpoint(81))


def one_part(trace_id: str, code: str, evidence: str | None) -> Aggregator:
    """A part of one request (weight 1): infer its bottleneck, a disconnected stream, a batch wait, a saturated
    call handed to a pool that moved 100 bytes each way, a diagnosis with or without evidence."""
    agg = Aggregator(keep_slowest=4)
    agg.add(
        verdict(
            trace_id, 100.0, {"infer": 60.0, "decode": 40.0},
            diagnoses=(Diagnosis(code, f"{trace_id}'s", "", evidence=evidence),), stream=stream(5.0, 2.0, 4, "infer"),
            offloads=(call(3.0, 2, 3, 100, 100, "ProcessPoolExecutor"),),
        ),
        [{"name": trace_id, "start_ms": 0.0, "end_ms": 100.0, "depth": 0, "kind": "cpu"}],
    )  # fmt: skip
    agg.add_batch_wait("infer.batch.queue", 1.0, 2.0)
    return agg


def test_parts_holding_the_same_names_merge_by_adding_each_figure():
    merged = one_part("p1", "Z", None)
    other = one_part("p2", "W", "p2's evidence")
    other.add(verdict("p3", 50.0, {"post": 50.0}, stage_kinds={"post": "io"}))
    merged.merge(other)
    got = merged.summary()
    assert got["stages"]["infer"]["bottleneck_traces"] == 2 and got["bottlenecks"]["infer"] == 2
    assert got["stages"]["post"]["kind"] == "io"  # a stage only the other part had keeps its kind
    assert got["batch_waits"]["infer.batch.queue"]["requests"] == 2
    assert got["streams"]["streams"] == 2 and got["streams"]["disconnected"] == 2
    row = got["offloads"]["tokenize"]
    assert (row["calls"], row["saturated"], row["args_bytes_mean"], row["result_bytes_mean"]) == (2, 2, 100, 100)
    assert got["evidence"] == {"W": "p2's evidence"}  # a code only the other part saw: its example and evidence
    assert got["examples"] == {"Z": "p1's", "W": "p2's"}
    slowest = {v.trace_id: (w[0]["name"] if w else None) for v, w in merged.slowest()}
    assert slowest == {"p1": "p1", "p2": "p2", "p3": None}  # the other part's waterfalls come with its traces


def test_an_offload_row_weighs_each_stretch_and_counts_what_it_lacks_as_nothing():
    """send 1, 2 and 4 ms (weights 1, 1, 2): the p50 (rank 1.5 of 4) is the 2 ms bucket, not the largest; run and
    return alike; a call without its arguments' size adds none; both calls over the pool's size are saturated."""
    row = OffloadSummary()
    for send, weight, args in ((1.0, 1, 300), (2.0, 1, None), (4.0, 2, 600)):
        info = OffloadInfo("ProcessPoolExecutor", 2, 3, args, 10, worker_task_seq=2)
        row.add(OffloadedCall("tokenize", info, 0.0, send, send * 10, send / 2), weight)
    got = row.summary()
    key = QuantileSketch().bucket_key
    assert got["send_p50_ms"] == round(midpoint(key(2.0)), 3)
    assert got["run_p50_ms"] == round(midpoint(key(20.0)), 3) and got["return_p50_ms"] == round(midpoint(0), 3)
    assert got["args_bytes_mean"] == round((300 + 2 * 600) / 4) and got["saturated"] == 4 and got["calls"] == 4


def test_a_stored_verdict_written_by_another_hand_reads_with_its_gaps_filled():
    """A root another writer stored (a Collector's processor, an older stagetrace): a total of 0 (read from the
    span, 40 ms), no ratio, threshold or untracked time (0), its route and model; two codes, one with its event
    (message, advice, stage), the other without (its message empty, its advice the rule's own, no stage), an
    event of another name carrying a code (not a diagnosis); a stage span without a kind (cpu)."""
    from stagetrace import conventions as c
    from stagetrace.analysis.diagnosis import ADVICE
    from stagetrace.report.loader import Span
    from stagetrace.report.traces import verdict_for_trace

    root = Span(
        "ab" * 16, "01" * 8, "", "POST /gen", 1_000_000_000, 1_040_000_000,
        attributes={
            c.TOTAL_MS: 0, c.STAGES: ["decode"], c.STAGES_MS: [30.0], c.BOTTLENECK_STAGE: "decode",
            c.DIAGNOSIS: ["X", "UNTRACKED_TIME"], c.HTTP_ROUTE: "/gen", c.GEN_AI_REQUEST_MODEL: "tiny",
        },
        events=[
            (c.DIAGNOSIS_EVENT, {c.DIAGNOSIS_EVENT_CODE: "X", c.DIAGNOSIS_EVENT_MESSAGE: "x's finding",
                                 c.DIAGNOSIS_EVENT_ADVICE: "x's advice", c.DIAGNOSIS_EVENT_STAGE: "decode"}),
            ("exception", {c.DIAGNOSIS_EVENT_CODE: "UNTRACKED_TIME", c.DIAGNOSIS_EVENT_MESSAGE: "not a diagnosis"}),
        ],
    )  # fmt: skip
    stage = Span("ab" * 16, "02" * 8, "01" * 8, "decode", 1_000_000_000, 1_030_000_000, attributes={c.STAGE: "decode"})
    v = verdict_for_trace([root, stage])
    assert (v.total_ms, v.ratio, v.slow_threshold_ms, v.untracked_ms) == (40.0, 0.0, 0.0, 0.0)
    assert (v.route, v.gen_ai, dict(v.stage_kinds), v.breakdown) == (
        "/gen", {c.GEN_AI_REQUEST_MODEL: "tiny"}, {"decode": "cpu"}, {"decode": 30.0},
    )  # fmt: skip
    x, untracked = v.diagnoses
    assert (x.code, x.message, x.advice, x.stage) == ("X", "x's finding", "x's advice", "decode")
    assert (untracked.code, untracked.message, untracked.advice, untracked.stage) == (
        "UNTRACKED_TIME", "", ADVICE["UNTRACKED_TIME"], None,
    )  # fmt: skip
