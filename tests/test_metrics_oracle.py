"""The contract's metrics pinned on hand-computed values, not against a second path of the same code: what
each event observes (``exporter/metrics.ContractMetrics``, shared by both ways of aggregating, so an oracle
that compares the two cannot see a wrong value here), written from the conventions' text."""

from __future__ import annotations

from typing import Any

import pytest

from stagetrace import conventions as c
from stagetrace.analysis import Verdict
from stagetrace.analysis.diagnosis import Diagnosis
from stagetrace.analysis.streams import GapHistogram, StreamSummary
from stagetrace.exporter.metrics import ContractMetrics, gen_ai_observations, representative_values


class Recorded(ContractMetrics):
    """Every observation, addition and gauge as (metric name, attributes, value)."""

    def __init__(self, max_stage_names: int = 256) -> None:
        super().__init__(max_stage_names)
        self.observed: list[tuple[str, dict[str, Any], float]] = []
        self.exemplars: list[tuple[str, Any]] = []
        self.added: list[tuple[str, dict[str, Any], int]] = []
        self.set_to: list[tuple[str, dict[str, Any], float]] = []

    def _observe(self, instrument, key, value, exemplar):
        self.observed.append((instrument.name, dict(key), value))
        self.exemplars.append((instrument.name, exemplar))

    def _add(self, instrument, key, amount):
        self.added.append((instrument.name, dict(key), amount))

    def _set(self, instrument, key, value):
        self.set_to.append((instrument.name, dict(key), value))

    def values(self, name: str) -> list[tuple[dict[str, Any], float]]:
        return [(attrs, v) for n, attrs, v in self.observed if n == name]


def verdict(**changes: Any) -> Verdict:
    fields: dict[str, Any] = dict(
        trace_id="t", root_name="POST /generate", total_ms=1250.0, breakdown={"prefill": 50.0, "decode": 900.0},
        bottleneck="decode", ratio=0.72, slow=False, slow_threshold_ms=200.0, untracked_ms=300.0,
        stage_kinds={"prefill": "gpu", "decode": "gpu"}, route="/generate",
    )  # fmt: skip
    fields.update(changes)
    return Verdict(**fields)


def stream(**changes: Any) -> StreamSummary:
    fields: dict[str, Any] = dict(
        chunks=11, first_chunk_ms=250.0, streaming_ms=1000.0, gap_p50_ms=100.0, gap_p99_ms=100.0, gap_max_ms=100.0,
        send_wait_ms=0.0, disconnected=False, first_chunk_bottleneck="prefill", gap_bottleneck="decode",
        first_chunk_breakdown={"prefill": 50.0}, gap_breakdown={"decode": 900.0}, gaps=None,
    )  # fmt: skip
    fields.update(changes)
    return StreamSummary(**fields)


GEN_AI = {c.GEN_AI_OPERATION: "text_completion", c.GEN_AI_PROVIDER: "local", c.GEN_AI_REQUEST_MODEL: "tiny"}


def test_gen_ai_server_metrics_follow_the_conventions_text():
    """time_to_first_token: the time to the first token, in seconds; time_per_output_token: the time per
    output token generated after the first one, (last - first) / (tokens - 1); request.duration: the whole
    request. 1250 ms, the first token at 250 ms, 11 tokens: 0.25 s, 0.1 s a token, 1.25 s."""
    by_name = {obs[0].name: (dict(obs[1]), obs[2]) for obs in gen_ai_observations(verdict(gen_ai=GEN_AI), stream())}
    assert by_name[c.METRIC_GEN_AI_TTFT] == (GEN_AI, 0.25)
    assert by_name[c.METRIC_GEN_AI_TPOT] == (GEN_AI, pytest.approx(0.1))
    assert by_name[c.METRIC_GEN_AI_REQUEST_DURATION] == (GEN_AI, 1.25)
    # the tokens the request said it produced win over the chunks (a chunk may carry several)
    said = {**GEN_AI, c.GEN_AI_OUTPUT_TOKENS: 41}
    (tpot,) = [o for o in gen_ai_observations(verdict(gen_ai=said), stream()) if o[0].name == c.METRIC_GEN_AI_TPOT]
    assert tpot[2] == pytest.approx(1.0 / 40)
    assert dict(tpot[1]) == GEN_AI  # the token count is no attribute


@pytest.mark.parametrize(
    ("tokens", "chunks", "expected"),
    [
        (None, 2, 1.0),  # two chunks: one token after the first, (1.25 - 0.25) / 1
        (None, 1, None),  # one token: no time per output token
        (1, 11, None),  # said one token: none either, whatever the chunks
        (0, 11, 0.1),  # a count that cannot be (0, negative, a bool): the chunks count
        (True, 11, 0.1),
        (-3, 11, 0.1),
    ],
)
def test_time_per_output_token_at_its_edges(tokens, chunks, expected):
    gen_ai = GEN_AI if tokens is None else {**GEN_AI, c.GEN_AI_OUTPUT_TOKENS: tokens}
    found = [o[2] for o in gen_ai_observations(verdict(gen_ai=gen_ai), stream(chunks=chunks)) if o[0] == o[0]
             and o[0].name == c.METRIC_GEN_AI_TPOT]  # fmt: skip
    assert found == ([] if expected is None else [pytest.approx(expected)])


def test_a_failed_stream_counts_its_duration_with_the_error_and_nothing_else():
    out = gen_ai_observations(verdict(gen_ai=GEN_AI), stream(disconnected=True))
    assert [(o[0].name, dict(o[1]), o[2]) for o in out] == [
        (c.METRIC_GEN_AI_REQUEST_DURATION, {**GEN_AI, c.ERROR_TYPE: c.CLIENT_DISCONNECTED}, 1.25)
    ]


def test_a_trace_observes_each_stage_its_duration_its_bottleneck_and_its_codes():
    m = Recorded()
    v = verdict(
        slow=True, slow_reason=c.SLOW_GAP, diagnoses=(Diagnosis("STREAM_CPU_BOUND", "m", "a"), Diagnosis("X", "m", "a"))
    )
    m.record_trace(v, exemplar=(5, 6))
    assert m.values(c.METRIC_STAGE_DURATION) == [
        ({c.STAGE: "prefill", c.STAGE_KIND: "gpu", c.HTTP_ROUTE: "/generate"}, 50.0),
        ({c.STAGE: "decode", c.STAGE_KIND: "gpu", c.HTTP_ROUTE: "/generate"}, 900.0),
    ]
    assert m.values(c.METRIC_TRACE_DURATION) == [
        ({c.SLOW: True, c.SLOW_REASON: c.SLOW_GAP, c.HTTP_ROUTE: "/generate"}, 1250.0)
    ]
    # the exemplar on the trace and on the bottleneck stage only: the traces worth opening from that stage
    assert m.exemplars == [(c.METRIC_STAGE_DURATION, None), (c.METRIC_STAGE_DURATION, (5, 6)),
                           (c.METRIC_TRACE_DURATION, (5, 6))]  # fmt: skip
    assert m.added == [
        (c.METRIC_DIAGNOSIS, {c.DIAGNOSIS_CODE: "STREAM_CPU_BOUND"}, 1),
        (c.METRIC_DIAGNOSIS, {c.DIAGNOSIS_CODE: "X"}, 1),
        (c.METRIC_TRACES_DIAGNOSED, {}, 1),
        (c.METRIC_BOTTLENECK, {c.STAGE: "decode"}, 1),
    ]
    assert all(type(n) is int for _, _, n in m.added)  # every trace diagnosed: the counters stay integers


def test_a_trace_diagnosed_as_one_of_a_share_adds_what_it_stands_for_and_one_left_undiagnosed_nothing():
    """Past the exporter's CPU budget (OpenTelemetry's adjusted count): a trace diagnosed with a chance of 1 in
    4 adds 4 to each code it carries and 1 to the diagnosed traces; one the rules did not run on adds to
    neither, and still to its duration and bottleneck."""
    sampled, undiagnosed = Recorded(), Recorded()
    codes = (Diagnosis("STREAM_CPU_BOUND", "m", "a"),)
    sampled.record_trace(verdict(diagnoses=codes, diagnosis_weight=4.0, diagnosis_sample_rate=0.25), exemplar=None)
    assert sampled.added[:2] == [
        (c.METRIC_DIAGNOSIS, {c.DIAGNOSIS_CODE: "STREAM_CPU_BOUND"}, 4.0),
        (c.METRIC_TRACES_DIAGNOSED, {}, 1),
    ]
    undiagnosed.record_trace(verdict(diagnosed=False, diagnosis_weight=0.0, diagnosis_sample_rate=0.25), exemplar=None)
    assert [name for name, _, _ in undiagnosed.added] == [c.METRIC_BOTTLENECK]
    assert undiagnosed.values(c.METRIC_TRACE_DURATION) != []


def test_a_healthy_trace_without_a_route_and_an_untracked_headline():
    m = Recorded()
    m.record_trace(verdict(route=None, bottleneck=c.UNTRACKED, stage_kinds={}), None)
    assert m.values(c.METRIC_TRACE_DURATION) == [({c.SLOW: False}, 1250.0)]
    assert m.values(c.METRIC_STAGE_DURATION)[0][0] == {c.STAGE: "prefill", c.STAGE_KIND: "cpu"}  # kind unknown: cpu
    # diagnosed, with nothing found; untracked is never capped away
    assert m.added == [(c.METRIC_TRACES_DIAGNOSED, {}, 1), (c.METRIC_BOTTLENECK, {c.STAGE: c.UNTRACKED}, 1)]
    m.record_trace(verdict(slow=True, slow_reason=None), None)  # a slow verdict from before the reasons
    assert m.values(c.METRIC_TRACE_DURATION)[-1][0][c.SLOW_REASON] == c.SLOW_TOTAL


def test_stage_names_past_the_cap_become_one_label_counted_once_a_name_kind_and_route():
    m = Recorded(max_stage_names=2)
    m.record_stage("a", "cpu", 1.0, None)
    m.record_stage("b", "cpu", 2.0, None)
    m.record_stage("c", "cpu", 3.0, None)  # the third name: over the cap
    m.record_stage("a", "io", 4.0, "/r")  # a name already seen stays itself, with another kind and route
    m.record_stage("c", "cpu", 5.0, None)  # the same capped attributes again: not counted again
    m.record_stage("c", "cpu", 6.0, "/r")  # on another route: counted
    labels = [(attrs[c.STAGE], v) for attrs, v in m.values(c.METRIC_STAGE_DURATION)]
    assert labels == [("a", 1.0), ("b", 2.0), ("_other", 3.0), ("a", 4.0), ("_other", 5.0), ("_other", 6.0)]
    assert m.added == [(c.METRIC_DROPPED, {c.DROP_REASON: "stage_name_cardinality"}, 1)] * 2
    assert m.values(c.METRIC_STAGE_DURATION)[3][0] == {c.STAGE: "a", c.STAGE_KIND: "io", c.HTTP_ROUTE: "/r"}


def test_a_stream_observes_its_first_chunk_and_merges_its_gaps_by_phase_bottleneck():
    m = Recorded()
    counts = (0,) * len(c.MS_BUCKETS) + (0,)
    gaps = GapHistogram(counts, 0.0, 0.0, 0.0)
    m.record_trace(verdict(stream=stream(gaps=gaps, first_chunk_bottleneck=None)), (1, 2))
    (first,) = m.values(c.METRIC_STREAM_FIRST_CHUNK)
    assert first == ({c.HTTP_ROUTE: "/generate", c.STREAM_FIRST_CHUNK_BOTTLENECK: c.UNTRACKED}, 250.0)
    assert m.values(c.METRIC_STREAM_CHUNK_GAP) == []  # an empty histogram merges nothing
    assert m.values(c.METRIC_GEN_AI_TTFT) == []  # no generative model said: no GenAI metrics


def test_representative_values_stand_for_each_bucket_at_its_upper_edge():
    buckets = (1.0, 5.0, 10.0)
    h = GapHistogram((2, 0, 1, 3), 60.0, 0.5, 40.0)  # 2 in (0, 1], 1 in (5, 10], 3 over 10 (max 40)
    assert representative_values(buckets, h, 100) == [1.0, 1.0, 10.0, 40.0, 40.0, 40.0]
    small = GapHistogram((0, 1, 0, 0), 3.0, 3.0, 3.0)  # the one value under its bucket's edge: its own max
    assert representative_values(buckets, small, 100) == [3.0]
    assert representative_values(buckets, GapHistogram((0, 0, 0, 0), 0.0, 0.0, 0.0), 100) == []
    many = GapHistogram((10, 0, 10, 0), 0.0, 0.5, 8.0)
    assert representative_values(buckets, many, 10) == [1.0] * 5 + [8.0] * 5  # scaled to the limit
    assert representative_values(buckets, many, 20) == [1.0] * 10 + [8.0] * 10  # exactly at it: all


def test_batch_gpu_and_drop_events():
    m = Recorded()
    m.record_batch("infer.batch", 6, 0.75)
    m.record_batch("infer.batch", 1, None)
    m.gpu_utilization(0.4, "GPU-1")
    m.dropped("budget", 0)  # nothing dropped: no point
    m.dropped("budget", 3)
    assert m.values(c.METRIC_BATCH_SIZE) == [({c.STAGE: "infer.batch"}, 6), ({c.STAGE: "infer.batch"}, 1)]
    assert m.values(c.METRIC_BATCH_FILL) == [({c.STAGE: "infer.batch"}, 0.75)]
    assert m.set_to == [(c.METRIC_GPU_UTILIZATION, {c.HW_ID: "GPU-1"}, 0.4)]
    assert m.added == [(c.METRIC_DROPPED, {c.DROP_REASON: "budget"}, 3)]
