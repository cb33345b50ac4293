"""The exporter's figures and decisions pinned on hand-computed inputs: which traces are kept (``exporter/keep``),
what the budget reads from the settings and what a kept trace weighs (``exporter/budget``), what reaches the
SDK's instruments and the recorders (``exporter/metrics``), and the points stagetrace's own aggregation hands a
reader (``exporter/aggregation``). Every expected value is worked out in the test (the comments show the
arithmetic) or read from an independent oracle (the OpenTelemetry SDK fed the same observations), never from a
second copy of the code's own formula. Inputs sit at the edges: empty, one, exactly on a boundary, just past
it, and past the bound of each bounded structure, with more than one key passing through so that a wrong
merge or a wrong eviction gives another answer."""

from __future__ import annotations

from collections import deque
from time import time_ns
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from stagetrace import conventions as c
from stagetrace.analysis import Verdict
from stagetrace.analysis.diagnosis import Diagnosis
from stagetrace.analysis.offload import OffloadedCall, OffloadInfo
from stagetrace.analysis.streams import GapHistogram, StreamSummary
from stagetrace.conventions import MS_BUCKETS
from stagetrace.exporter.aggregation import AggregatedMetrics, MetricStore
from stagetrace.exporter.budget import AdjustedCounts, BudgetLimits, own_weight
from stagetrace.exporter.keep import Keep, PendingBatches, RecentDecisions, decide, in_healthy_share
from stagetrace.exporter.metrics import (
    DROPPED,
    GPU_UTILIZATION,
    STAGE_DURATION,
    ContractMetrics,
    MetricsRecorder,
    SdkInstruments,
    TeeMetrics,
    exemplar_context,
    replay,
    representative_values,
)
from stagetrace.settings import Settings

RESOURCE = Resource.create({"service.name": "export-values-test"})
HALF = 1 << 63  # 2^63: half of the 64-bit trace ids

# --- keep.py: the healthy share, the decision, the recent decisions, the batches waiting ---------------------


def test_the_healthy_share_compares_the_mixed_low_64_bits_with_the_share_of_2_64():
    """mixed = id * 0x9E3779B97F4A7C15 mod 2^64, kept when mixed < share * 2^64. By hand: id 0 mixes to 0, the
    smallest value; 2^63 times an odd constant is 2^63 mod 2^64, exactly the threshold of a share of 0.5 (out:
    strictly below), in just past it; id 1 mixes to the constant itself, 2^64 / the golden ratio = 0.6180...
    of 2^64 (in at 0.62, out at 0.61); id 2 to 2 * 0.6180 - 1 = 0.2361 of it (in at 0.24, out at 0.23)."""
    assert in_healthy_share(0, 0.5) is True
    assert in_healthy_share(HALF, 0.5) is False  # mixed == the threshold
    assert in_healthy_share(HALF, 0.5 + 2**-53) is True  # the next share up: threshold 2^63 + 2^11
    assert (in_healthy_share(1, 0.62), in_healthy_share(1, 0.61)) == (True, False)
    assert (in_healthy_share(2, 0.24), in_healthy_share(2, 0.23)) == (True, False)
    assert in_healthy_share((5 << 64) | 1, 0.61) is False and in_healthy_share((5 << 64) | 1, 0.62) is True  # low bits
    # mixed first: a TraceIdRatioBased head sampler at 0.5 keeps id 1 (its low bits 1 < 2^63), the share does not
    assert TraceIdRatioBased(0.5).should_sample(None, 1, "r").decision.is_sampled()
    assert in_healthy_share(1, 0.5) is False


@pytest.mark.parametrize(
    ("share", "expected"),
    [(1.0, True), (1.5, True), (0.0, False), (-0.5, False)],
)
def test_a_share_of_one_keeps_every_trace_and_a_share_of_zero_none(share, expected):
    """Exactly at the ends and past them: ids 0 (mixed 0, kept by any share above 0), 1 and 2^63."""
    assert [in_healthy_share(t, share) for t in (0, 1, HALF)] == [expected] * 3


def verdict(**changes: Any) -> Verdict:
    fields: dict[str, Any] = dict(
        trace_id="ab" * 16, root_name="r", total_ms=20.0, breakdown={"s": 20.0}, bottleneck="s", ratio=1.0,
        slow=False, slow_threshold_ms=200.0, untracked_ms=0.0,
    )  # fmt: skip
    fields.update(changes)
    return Verdict(**fields)


def streamed() -> StreamSummary:
    counts = [0] * 20
    counts[9], counts[10] = 9, 1  # MS_BUCKETS[9] = 100: (50, 100]; MS_BUCKETS[10] = 200: (100, 200]
    return StreamSummary(
        chunks=11, first_chunk_ms=250.0, streaming_ms=960.0, gap_p50_ms=90.0, gap_p99_ms=150.0, gap_max_ms=150.0,
        send_wait_ms=0.0, disconnected=False, first_chunk_bottleneck="prefill", gap_bottleneck="decode",
        first_chunk_breakdown={"prefill": 50.0}, gap_breakdown={"decode": 900.0},
        gaps=GapHistogram(tuple(counts), 960.0, 90.0, 150.0),
    )  # fmt: skip


def test_decide_ranks_unsampled_then_error_slow_diagnosed_and_the_healthy_share_on_the_trace_id():
    """The head sampler wins, then an error, slowness, a diagnosis; a healthy trace is kept when its id is in
    the share: at 0.5, id 0 (mixed 0) is, id 2^63 (mixed 2^63, the threshold) is not."""
    codes = (Diagnosis("X", "m", "a"),)
    everything = verdict(slow=True, diagnoses=codes)
    assert decide(verdict(sampled=False, slow=True), errored=True, healthy_share=1.0, trace_id=0) is Keep.UNSAMPLED
    assert decide(everything, errored=True, healthy_share=0.5, trace_id=HALF) is Keep.ERROR
    assert decide(everything, errored=False, healthy_share=0.5, trace_id=HALF) is Keep.SLOW
    assert decide(verdict(diagnoses=codes), errored=False, healthy_share=0.5, trace_id=HALF) is Keep.DIAGNOSED
    assert decide(verdict(), errored=False, healthy_share=0.5, trace_id=0) is Keep.HEALTHY_SAMPLE
    assert decide(verdict(), errored=False, healthy_share=0.5, trace_id=HALF) is Keep.DROPPED
    assert decide(verdict(), errored=False, healthy_share=0.61, trace_id=1) is Keep.DROPPED  # 0.6180 of 2^64
    assert decide(verdict(), errored=False, healthy_share=0.62, trace_id=1) is Keep.HEALTHY_SAMPLE


def test_recent_decisions_hold_their_bound_and_forget_the_oldest():
    """Two at most: at exactly two both are known; the third forgets the first decided, not the newest. A
    trace never decided (or forgotten) counts as kept, one decided as dropped does not."""
    decisions = RecentDecisions(max_traces=2)
    decisions.remember(10, kept=False)
    decisions.remember(11, kept=True)
    assert (decisions.known(10), decisions.known(11)) == (False, True)  # exactly at the bound
    decisions.remember(12, kept=False)
    assert (decisions.known(10), decisions.known(11), decisions.known(12)) == (None, True, False)
    assert decisions.kept(12) is False and decisions.kept(11) is True
    assert decisions.kept(10) is True and decisions.kept(99) is True  # forgotten, never seen: kept


def test_recent_decisions_remember_65_536_traces_by_default():
    """65,536 decisions are all kept in mind; the 65,537th forgets the first."""
    decisions = RecentDecisions()
    for trace_id in range(65_536):
        decisions.remember(trace_id, kept=False)
    assert decisions.known(0) is False
    decisions.remember(65_536, kept=False)
    assert (decisions.known(0), decisions.known(1), decisions.known(65_536)) == (None, False, False)


def batches(wait_s: float = 5.0, max_pending: int = 8) -> tuple[RecentDecisions, PendingBatches]:
    decisions = RecentDecisions()
    return decisions, PendingBatches(decisions, wait_s=wait_s, max_pending=max_pending)


def test_a_batch_decided_at_once_is_remembered_under_its_own_trace_id():
    """No traced member: the batch's own fallback. A member already kept: kept. Every member already dropped:
    dropped, spans and all. In each case nothing waits and the batch's decision is remembered."""
    decisions, pending = batches()
    assert pending.offer(200, [], ["a"], now=0.0, fallback=False) == [] and decisions.known(200) is False
    assert pending.offer(201, [], ["b"], now=0.0, fallback=True) == ["b"] and decisions.known(201) is True
    decisions.remember(1, kept=True)
    assert pending.offer(202, [2, 1], ["c"], now=0.0, fallback=False) == ["c"] and decisions.known(202) is True
    decisions.remember(3, kept=False)
    decisions.remember(4, kept=False)
    assert pending.offer(203, [3, 4], ["d"], now=0.0, fallback=True) == [] and decisions.known(203) is False
    assert len(pending) == 0


def test_a_batch_waits_for_its_undecided_members_only():
    """Member 5 already dropped, member 6 not decided: the batch waits for 6 alone, and goes with it."""
    decisions, pending = batches()
    decisions.remember(5, kept=False)
    assert pending.offer(300, [5, 6], ["e"], now=0.0, fallback=True) == [] and len(pending) == 1
    assert pending.member_decided(6, kept=False) == [] and decisions.known(300) is False and len(pending) == 0


def test_expiry_settles_every_batch_whose_deadline_has_come_in_arrival_order():
    """Wait 5 s: offered at 0, 1, 2, the deadlines are 5, 6, 7. At 6 the first two fall back (kept, kept), their
    spans together in order; the third, not due, waits; at exactly its deadline, 7, it goes (dropped)."""
    decisions, pending = batches()
    pending.offer(400, [40], ["a1", "a2"], now=0.0, fallback=True)
    pending.offer(401, [41], ["b1"], now=1.0, fallback=True)
    pending.offer(402, [42], ["c1"], now=2.0, fallback=False)
    assert pending.expire(now=4.999) == [] and len(pending) == 3
    assert pending.expire(now=6.0) == ["a1", "a2", "b1"] and len(pending) == 1
    assert (decisions.known(400), decisions.known(401), decisions.known(402)) == (True, True, None)
    assert pending.expire(now=7.0) == [] and decisions.known(402) is False and len(pending) == 0
    assert pending.member_decided(40, kept=True) == []  # too late: the batch went on its fallback


def test_an_expired_batch_that_falls_back_to_kept_exports_at_exactly_its_deadline():
    decisions, pending = batches(wait_s=5.0)
    pending.offer(500, [50], ["s"], now=10.0, fallback=True)  # deadline 10 + 5 = 15
    assert pending.expire(now=15.0) == ["s"] and decisions.known(500) is True


def test_settling_one_batch_keeps_a_shared_member_waiting_for_the_other():
    """Member 60 is in batch 600 (offered at 0) and again in batch 601 (at 1): its decision now belongs to
    601. When 600 expires at 5 (dropped), 60 still settles 601, which is kept with it."""
    decisions, pending = batches(wait_s=5.0)
    pending.offer(600, [60], ["x"], now=0.0, fallback=False)
    pending.offer(601, [60, 61], ["y"], now=1.0, fallback=False)
    assert pending.expire(now=5.0) == [] and decisions.known(600) is False
    assert pending.member_decided(60, kept=True) == ["y"] and decisions.known(601) is True


def test_1024_batches_wait_by_default_and_the_1025th_settles_the_oldest():
    """At exactly 1,024 waiting nothing is settled; one more settles the first on its fallback (kept)."""
    decisions = RecentDecisions()
    pending = PendingBatches(decisions, wait_s=5.0)
    for i in range(1024):
        assert pending.offer(10_000 + i, [i], [f"b{i}"], now=0.0, fallback=i == 0) == []
    assert len(pending) == 1024 and decisions.known(10_000) is None
    assert pending.offer(20_000, [5000], ["last"], now=0.0, fallback=False) == ["b0"]
    assert len(pending) == 1024 and decisions.known(10_000) is True


def test_a_settled_batch_leaves_no_member_waiting_on_it():
    """The member map is bounded by the batches waiting: a batch settled by expiry or by the bound on waiting
    batches takes its undecided members' entries with it (``_by_member`` is that map)."""
    _, pending = batches(wait_s=5.0, max_pending=1)
    pending.offer(700, [70, 71], ["p"], now=0.0, fallback=True)
    assert pending.offer(701, [72], ["q"], now=1.0, fallback=False) == ["p"]  # past the bound of 1: 700 settles
    assert pending._by_member == {72: 701}
    assert pending.expire(now=6.0) == [] and pending._by_member == {} and len(pending) == 0


# --- budget.py: the limits from the settings, what a kept trace stands for -----------------------------------


def test_the_budget_limits_are_the_settings_own_values():
    """Every field read from its setting (values unlike the defaults, so a default cannot pass for them)."""
    settings = Settings(
        export_budget_per_s=7.0,
        export_budget_burst=3.0,
        signature_budget_per_s=0.5,
        signature_budget_burst=2.0,
        max_budget_signatures=9,
    )
    assert BudgetLimits.from_settings(settings) == BudgetLimits(
        per_s=7.0, burst=3.0, signature_per_s=0.5, signature_burst=2.0, max_signatures=9
    )
    assert BudgetLimits.from_settings(Settings(export_budget_per_s=None)).per_s is None  # no budget


@pytest.mark.parametrize(
    ("keep", "share", "weight"),
    [
        (Keep.HEALTHY_SAMPLE, 0.5, 2.0),  # kept one in two: stands for 1 / 0.5 = 2
        (Keep.HEALTHY_SAMPLE, 0.2, 5.0),  # 1 / 0.2 = 5
        (Keep.HEALTHY_SAMPLE, 1.0, 1.0),  # every healthy trace kept
        (Keep.HEALTHY_SAMPLE, 1.5, 1.0),  # past 1 is every trace too (``in_healthy_share``): still 1
        (Keep.HEALTHY_SAMPLE, 0.0, 1.0),  # no share (none would be kept): 1, never a division by zero
        (Keep.DIAGNOSED, 0.5, 1.0),  # kept for what it says, not sampled: 1
        (Keep.ERROR, 0.2, 1.0),
    ],
)
def test_a_trace_s_own_weight_at_the_ends_of_the_share(keep, share, weight):
    assert own_weight(keep, share) == weight


def test_carried_weights_add_up_per_signature_and_are_handed_over_once():
    """Left out 2 then 0.5 of signature a: its next kept trace (own weight 1) stands for 1 + 2 + 0.5 = 3.5, the
    one after it for its own 1 only. Another signature's carry is its own (b: 1 + 4 = 5)."""
    adjusted = AdjustedCounts(max_signatures=4)
    a, b = ("a", "", ()), ("b", "", ())
    adjusted.left_out(a, 2.0)
    adjusted.left_out(b, 4.0)
    adjusted.left_out(a, 0.5)
    assert adjusted.kept(a, 1.0) == 3.5 and adjusted.kept(a, 1.0) == 1.0
    assert adjusted.kept(b, 1.0) == 5.0


def test_carried_weights_hold_their_bound_and_forget_the_least_recently_left_out():
    """Two signatures at most: at exactly two both carry; a left out again, then c: b (the least recently left
    out) is forgotten, a carries 3 + 1 = 4 (kept: 1 + 4 = 5), c carries 2 (kept: 1 + 2 = 3)."""
    adjusted = AdjustedCounts(max_signatures=2)
    a, b, c_ = ("a", "", ()), ("b", "", ()), ("c", "", ())
    adjusted.left_out(a, 3.0)
    adjusted.left_out(b, 2.0)
    assert adjusted.kept(b, 1.0) == 3.0  # exactly at the bound: b still carries its 2
    adjusted.left_out(b, 2.0)
    adjusted.left_out(a, 1.0)
    adjusted.left_out(c_, 2.0)
    assert (adjusted.kept(a, 1.0), adjusted.kept(b, 1.0), adjusted.kept(c_, 1.0)) == (5.0, 1.0, 3.0)


def test_carried_weights_remember_1024_signatures_by_default():
    """1,024 signatures carry; the 1,025th forgets the first (kept then: its own 1 alone, not 1 + 2)."""
    adjusted = AdjustedCounts()
    sigs = [(f"r{i}", "", ()) for i in range(1025)]
    for sig in sigs[:1024]:
        adjusted.left_out(sig, 2.0)
    assert adjusted.kept(sigs[0], 1.0) == 3.0
    adjusted.left_out(sigs[0], 2.0)  # back, now the most recent: sigs[1] is the oldest
    adjusted.left_out(sigs[1024], 2.0)
    assert (adjusted.kept(sigs[1], 1.0), adjusted.kept(sigs[2], 1.0), adjusted.kept(sigs[0], 1.0)) == (1.0, 3.0, 3.0)


# --- metrics.py: exemplars, the recorder, the tee, the SDK's instruments ------------------------------------


def test_an_exemplar_context_carries_the_kept_trace_s_local_sampled_span():
    ctx = exemplar_context((0xABC, 0xDEF))
    assert ctx is not None
    span_context = trace.get_current_span(ctx).get_span_context()
    assert (span_context.trace_id, span_context.span_id) == (0xABC, 0xDEF)
    assert span_context.is_remote is False and span_context.trace_flags.sampled is True
    # ids that cannot name a span (0 is never a valid id): no context, like no exemplar at all
    assert exemplar_context((0, 0xDEF)) is None and exemplar_context((0xABC, 0)) is None
    assert exemplar_context(None) is None


def test_the_recorder_keeps_each_call_with_its_arguments_in_order_and_replays_them():
    recorder = MetricsRecorder()
    v = verdict()
    recorder.record_stage("decode", "cpu", 1.5, "/r")
    recorder.record_trace(v, (1, 2))
    recorder.record_batch("infer", 4, 0.5)
    recorder.dropped("channel_full")  # the default count: 1
    recorder.dropped("channel_full", 0)  # nothing dropped: no call
    recorder.gpu_utilization(0.25, "GPU-0")
    calls = recorder.take()
    assert calls == [
        ("record_stage", ("decode", "cpu", 1.5, "/r")),
        ("record_trace", (v, (1, 2))),
        ("record_batch", ("infer", 4, 0.5)),
        ("dropped", ("channel_full", 1)),
        ("gpu_utilization", (0.25, "GPU-0")),
    ]
    assert recorder.take() == []  # taken: gone
    again = MetricsRecorder()
    replay(again, [*calls, ("no_such_method", (1,))])  # an unknown name (a malformed message) is ignored
    assert again.take() == calls


def test_a_call_recorded_while_the_recorder_is_taken_stays_for_the_next_take():
    """Another thread's call landing mid-take is neither lost nor taken twice (the deque stands in for it)."""

    class AppendsDuringTake(deque):  # type: ignore[type-arg]
        def popleft(self) -> Any:
            item = super().popleft()
            if item[0] == "record_stage":
                self.append(("dropped", ("late", 1)))
            return item

    recorder = MetricsRecorder()
    recorder.calls = AppendsDuringTake()
    recorder.record_stage("decode", "cpu", 1.5, "/r")
    recorder.record_batch("infer", 2, None)
    assert recorder.take() == [("record_stage", ("decode", "cpu", 1.5, "/r")), ("record_batch", ("infer", 2, None))]
    assert recorder.take() == [("dropped", ("late", 1))]
    assert recorder.take() == []


def test_the_tee_gives_every_call_to_each_sink():
    first, second = MetricsRecorder(), MetricsRecorder()
    tee = TeeMetrics(first, second)
    v = verdict()
    tee.record_stage("s", "io", 2.0, None)
    tee.record_trace(v, None)
    tee.record_batch("b", 2, None)
    tee.dropped("budget")  # the default count: 1
    tee.dropped("budget", 3)
    tee.gpu_utilization(0.5, "GPU-1")
    expected = [
        ("record_stage", ("s", "io", 2.0, None)),
        ("record_trace", (v, None)),
        ("record_batch", ("b", 2, None)),
        ("dropped", ("budget", 1)),
        ("dropped", ("budget", 3)),
        ("gpu_utilization", (0.5, "GPU-1")),
    ]
    assert first.take() == expected and second.take() == expected


def stagetrace_points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    """stagetrace's metrics (its instrumentation scope) as the reader received them: name -> data points."""
    out: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            if sm.scope.name == c.INSTRUMENTATION_NAME:
                for m in sm.metrics:
                    out[m.name] = list(m.data.data_points)
    return out


def sdk_instruments(max_stage_names: int | None = None) -> tuple[SdkInstruments, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], resource=RESOURCE, shutdown_on_exit=False)
    meter = provider.get_meter(c.INSTRUMENTATION_NAME)
    sdk = SdkInstruments(meter) if max_stage_names is None else SdkInstruments(meter, max_stage_names)
    return sdk, reader


def exemplars_of(point: Any) -> list[tuple[float, int, int]]:
    return [(e.value, e.trace_id, e.span_id) for e in point.exemplars]


def test_an_observation_without_an_exemplar_never_links_to_the_thread_s_current_span():
    """The SDK's instruments read the thread's current context when given none (or an empty one, which is
    falsy): a span of the application current where the events are replayed would become an exemplar of a
    trace that may not have been exported. With a sampled span current: no exemplar without one given, nor
    for ids that cannot name a span; the given one where it is."""
    sdk, reader = sdk_instruments()
    current = NonRecordingSpan(SpanContext(0x111, 0x222, False, TraceFlags(TraceFlags.SAMPLED)))
    token = otel_context.attach(trace.set_span_in_context(current))
    try:
        sdk.record_stage("plain", "cpu", 1.0, None)
        sdk._observe(STAGE_DURATION, ((c.STAGE, "invalid"),), 1.0, (0, 0))
        sdk._observe(STAGE_DURATION, ((c.STAGE, "kept"),), 1.0, (0x333, 0x444))
    finally:
        otel_context.detach(token)
    points = {p.attributes[c.STAGE]: p for p in stagetrace_points(reader)[c.METRIC_STAGE_DURATION]}
    assert exemplars_of(points["plain"]) == [] and exemplars_of(points["invalid"]) == []
    assert exemplars_of(points["kept"]) == [(1.0, 0x333, 0x444)]


def test_one_exemplar_observed_twice_in_a_row_links_both_buckets():
    """The same kept trace on two observations in a row (its trace duration and its bottleneck stage): 3 ms
    in (2.5, 5], 7 ms in (5, 10]; each bucket's exemplar is that trace."""
    sdk, reader = sdk_instruments()
    key = ((c.STAGE, "s"),)
    sdk._observe(STAGE_DURATION, key, 3.0, (0x55, 0x66))
    sdk._observe(STAGE_DURATION, key, 7.0, (0x55, 0x66))
    (point,) = stagetrace_points(reader)[c.METRIC_STAGE_DURATION]
    assert exemplars_of(point) == [(3.0, 0x55, 0x66), (7.0, 0x55, 0x66)]


def test_the_sdk_s_instruments_cap_stage_names_at_256_by_default():
    """256 names are themselves; the 257th becomes ``_other`` and is counted once as dropped."""
    sdk, reader = sdk_instruments()
    for i in range(257):
        sdk.record_stage(f"s{i}", "cpu", 1.0, None)
    points = stagetrace_points(reader)
    labels = sorted(p.attributes[c.STAGE] for p in points[c.METRIC_STAGE_DURATION])
    assert len(labels) == 257 and "_other" in labels and "s255" in labels and "s256" not in labels
    (dropped,) = points[c.METRIC_DROPPED]
    assert (dict(dropped.attributes), dropped.value) == ({c.DROP_REASON: "stage_name_cardinality"}, 1)


def test_the_sdk_s_instruments_reuse_an_attribute_dict_for_at_most_8_per_stage_name():
    """With 2 stage names, 8 * 2 = 16 attribute sets are made once and reused; the 17th is made afresh at
    every call (the cache is full), still with the right attributes."""
    sdk, _ = sdk_instruments(max_stage_names=2)
    keys = [((c.DROP_REASON, f"r{i}"),) for i in range(17)]
    made = [sdk._attrs(key) for key in keys]
    assert made[0] is sdk._attrs(keys[0]) and made[15] is sdk._attrs(keys[15])
    assert made[16] is not sdk._attrs(keys[16]) and sdk._attrs(keys[16]) == {c.DROP_REASON: "r16"}
    assert [m[c.DROP_REASON] for m in made] == [f"r{i}" for i in range(17)]


class Observed(ContractMetrics):
    """The contract's events as (metric name, attributes, value), with the base class's own defaults."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seen: list[tuple[str, dict[str, Any], float]] = []

    def _observe(self, instrument, key, value, exemplar):
        self.seen.append((instrument.name, dict(key), value))

    def _add(self, instrument, key, amount):
        self.seen.append((instrument.name, dict(key), amount))

    def _set(self, instrument, key, value):
        self.seen.append((instrument.name, dict(key), value))

    def of(self, name: str) -> list[tuple[dict[str, Any], float]]:
        return [(attrs, value) for n, attrs, value in self.seen if n == name]


def test_the_contract_caps_stage_names_at_256_by_default():
    m = Observed()
    for i in range(257):
        m.record_stage(f"s{i}", "cpu", 1.0, None)
    labels = [attrs[c.STAGE] for attrs, _ in m.of(c.METRIC_STAGE_DURATION)]
    assert labels[255] == "s255" and labels[256] == "_other" and len(set(labels)) == 257
    assert m.of(c.METRIC_DROPPED) == [({c.DROP_REASON: "stage_name_cardinality"}, 1)]


def test_a_capped_stage_is_counted_once_until_the_key_cache_is_full_then_at_each_event():
    """One stage name allowed, so 4 * 1 = 4 attribute keys are remembered: a's four (kind, route) keys fill the
    cache; b is over the cap and its key cannot be remembered, so each of its two events counts a drop."""
    m = Observed(1)
    for kind, route in (("cpu", None), ("io", None), ("gpu", None), ("cpu", "/r")):
        m.record_stage("a", kind, 1.0, route)
    m.record_stage("b", "cpu", 1.0, None)
    m.record_stage("b", "cpu", 1.0, None)
    assert m.of(c.METRIC_DROPPED) == [({c.DROP_REASON: "stage_name_cardinality"}, 1)] * 2
    assert [attrs[c.STAGE] for attrs, _ in m.of(c.METRIC_STAGE_DURATION)] == ["a"] * 4 + ["_other"] * 2


def test_the_bottleneck_counter_caps_stage_names_but_never_untracked():
    """One stage name allowed, taken by "prefill": a trace whose bottleneck is untracked counts "untracked"
    (no name spent, nothing dropped); one whose bottleneck is "decode" (over the cap) counts "_other"."""
    m = Observed(1)
    m.record_trace(verdict(breakdown={"prefill": 5.0}, bottleneck=c.UNTRACKED), None)
    assert m.of(c.METRIC_BOTTLENECK) == [({c.STAGE: c.UNTRACKED}, 1)] and m.of(c.METRIC_DROPPED) == []
    m.record_trace(verdict(breakdown={"prefill": 5.0}, bottleneck="decode"), None)
    assert m.of(c.METRIC_BOTTLENECK)[-1] == ({c.STAGE: "_other"}, 1)


def test_a_streamed_generative_request_observes_its_first_chunk_and_the_gen_ai_server_metrics():
    """1250 ms in all, the first chunk at 250 ms, 11 chunks (no token count said): first chunk 250 ms with its
    phase's bottleneck (prefill); request duration 1.25 s, time to first token 0.25 s, time per output token
    (1.25 - 0.25) / (11 - 1) = 0.1 s (the convention's text)."""
    m = Observed()
    gen_ai = {c.GEN_AI_OPERATION: "chat", c.GEN_AI_REQUEST_MODEL: "m"}
    m.record_trace(verdict(total_ms=1250.0, stream=streamed(), gen_ai=gen_ai), None)
    assert m.of(c.METRIC_STREAM_FIRST_CHUNK) == [({c.STREAM_FIRST_CHUNK_BOTTLENECK: "prefill"}, 250.0)]
    assert m.of(c.METRIC_GEN_AI_REQUEST_DURATION) == [(gen_ai, 1.25)]
    assert m.of(c.METRIC_GEN_AI_TTFT) == [(gen_ai, 0.25)]
    assert m.of(c.METRIC_GEN_AI_TPOT) == [(gen_ai, pytest.approx(0.1))]


def test_a_stream_s_gaps_reach_the_sdk_s_instruments_at_their_buckets_upper_edges():
    """The SDK's instruments take one value at a time: 9 gaps in (50, 100] become 9 values of 100, the one in
    (100, 200] its bucket's edge capped at the stream's max, min(200, 150) = 150. count 10, sum 9 * 100 + 150
    = 1050, min 100, max 150, and the gaps' phase bottleneck as the attribute."""
    sdk, reader = sdk_instruments()
    sdk.record_trace(verdict(stream=streamed()), None)
    (gaps,) = stagetrace_points(reader)[c.METRIC_STREAM_CHUNK_GAP]
    assert dict(gaps.attributes) == {c.STREAM_GAP_BOTTLENECK: "decode"}
    assert (gaps.count, gaps.sum, gaps.min, gaps.max) == (10, 1050.0, 100.0, 150.0)
    assert (gaps.bucket_counts[9], gaps.bucket_counts[10], sum(gaps.bucket_counts)) == (9, 1, 10)


def test_the_sdk_s_instruments_carry_the_contract_s_units_and_descriptions():
    """A histogram, a counter and a gauge as the reader receives them, against the contract's table."""
    sdk, reader = sdk_instruments()
    sdk.record_stage("s", "cpu", 1.0, None)
    sdk.dropped("budget", 1)
    sdk.gpu_utilization(0.5, "GPU-0")
    data = reader.get_metrics_data()
    got = {
        m.name: (m.unit, m.description) for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }
    for inst in (STAGE_DURATION, DROPPED, GPU_UTILIZATION):
        assert got[inst.name] == (inst.unit, inst.description)


def test_representative_values_of_nothing_and_of_one():
    """No value counted: none to record; one value in the overflow bucket: the histogram's own max."""
    buckets = (1.0, 5.0)
    assert representative_values(buckets, GapHistogram((0, 0, 0), 0.0, 0.0, 0.0), 10) == []
    assert representative_values(buckets, GapHistogram((0, 0, 1), 8.0, 8.0, 8.0), 10) == [8.0]
    assert representative_values(buckets, GapHistogram((0, 0, 1), 8.0, 8.0, 8.0), 1) == [8.0]  # exactly the limit


# --- aggregation.py: the points a reader receives ------------------------------------------------------------

EVERY_KIND_DELTA = frozenset({"histogram", "counter", "gauge"})


def only_point(metrics: list[Any], name: str) -> Any:
    (metric,) = [m for m in metrics if m.name == name]
    (point,) = metric.data.data_points
    return point


def test_observations_on_and_just_past_bucket_edges_land_where_the_sdk_puts_them():
    """An explicit bucket holds values up to and including its upper edge. MS_BUCKETS' first edges are 0.1,
    0.25, 0.5, 1 and its last 10000: 0.0 and 0.1 count in bucket 0, 0.1000001 in bucket 1, 1 (an integer edge)
    in bucket 3, 10000 in bucket 18 (the last bounded one), 10001 in the overflow, 19. count 6, sum 0 + 0.1 +
    0.1000001 + 1 + 10000 + 10001 = 20002.2000001, min 0, max 10001. The SDK fed the same values agrees."""
    values = (0.1, 0.0, 0.1000001, 1, 10000, 10001)
    counts = [0] * 20
    counts[0], counts[1], counts[3], counts[18], counts[19] = 2, 1, 1, 1, 1
    store = MetricStore(frozenset(), now_ns=0)
    key = ((c.STAGE, "edge"), (c.STAGE_KIND, "cpu"))
    for value in values:
        store.observe(STAGE_DURATION, key, value, None)
    point = only_point(store.collect(1), c.METRIC_STAGE_DURATION)
    assert (point.count, tuple(point.bucket_counts), point.min, point.max) == (6, tuple(counts), 0.0, 10001)
    assert point.sum == pytest.approx(20002.2000001, abs=1e-9) and tuple(point.explicit_bounds) == MS_BUCKETS
    assert dict(point.attributes) == {c.STAGE: "edge", c.STAGE_KIND: "cpu"}
    sdk, reader = sdk_instruments()
    for value in values:
        sdk.record_stage("edge", "cpu", value, None)
    (theirs,) = stagetrace_points(reader)[c.METRIC_STAGE_DURATION]
    assert (theirs.count, tuple(theirs.bucket_counts), theirs.min, theirs.max) == (6, tuple(counts), 0.0, 10001)
    assert theirs.sum == pytest.approx(point.sum, abs=1e-9)


def test_one_observation_is_its_own_count_sum_min_and_max():
    store = MetricStore(frozenset(), now_ns=0)
    store.observe(STAGE_DURATION, (), 2.5, None)  # on the edge 2.5: bucket 4
    point = only_point(store.collect(1), c.METRIC_STAGE_DURATION)
    assert (point.count, point.sum, point.min, point.max, list(point.bucket_counts).index(1)) == (1, 2.5, 2.5, 2.5, 4)
    assert sum(point.bucket_counts) == 1


def test_nothing_observed_collects_nothing():
    assert MetricStore(frozenset(), now_ns=0).collect(1) == []


def test_a_merged_histogram_adds_to_what_was_observed_on_the_same_attributes():
    """Observed 1.0 (bucket 3, (0.5, 1]) and 7.0 (bucket 6, (5, 10]); then a stream's gaps merged: 3 in bucket
    3 and 1 in the overflow, sum 2.4 + 12000 = 12002.4, min 0.6, max 12000; then 2 more in bucket 0, sum 0.1,
    min 0.05, max 0.06. Bucket 3 holds 1 + 3 = 4, bucket 0 2, bucket 6 1, the overflow 1; count 2 + 4 + 2 = 8,
    sum 1 + 7 + 12002.4 + 0.1 = 12010.5, min 0.05 (the second merge's), max 12000 (the first's). A merge of
    nothing counted adds no point at all (as the SDK, fed no value, has none)."""
    store = MetricStore(frozenset(), now_ns=0)
    gaps_key = ((c.STREAM_GAP_BOTTLENECK, "decode"),)
    store.observe(STAGE_DURATION, gaps_key, 1.0, None)
    store.observe(STAGE_DURATION, gaps_key, 7.0, None)
    first = [0] * 20
    first[3], first[19] = 3, 1
    store.merge(STAGE_DURATION, gaps_key, GapHistogram(tuple(first), 12002.4, 0.6, 12000.0))
    second = [0] * 20
    second[0] = 2
    store.merge(STAGE_DURATION, gaps_key, GapHistogram(tuple(second), 0.1, 0.05, 0.06))
    store.merge(STAGE_DURATION, ((c.STREAM_GAP_BOTTLENECK, "none"),), GapHistogram((0,) * 20, 0.0, 0.0, 0.0))
    point = only_point(store.collect(1), c.METRIC_STAGE_DURATION)
    expected = [0] * 20
    expected[0], expected[3], expected[6], expected[19] = 2, 4, 1, 1
    assert (point.count, tuple(point.bucket_counts), point.min, point.max) == (8, tuple(expected), 0.05, 12000.0)
    assert point.sum == pytest.approx(12010.5, abs=1e-9)


def test_a_merge_into_a_new_point_is_the_histogram_itself():
    """Two gaps of 3 and 4 ms, both in (2.5, 5]: count 2, sum 7, min 3, max 4; the series starts at the merge."""
    store = MetricStore(frozenset(), now_ns=0)
    counts = [0] * 20
    counts[5] = 2  # (2.5, 5]
    before = time_ns()
    store.merge(STAGE_DURATION, (), GapHistogram(tuple(counts), 7.0, 3.0, 4.0))
    after = time_ns()
    point = only_point(store.collect(1), c.METRIC_STAGE_DURATION)
    assert (point.count, tuple(point.bucket_counts), point.sum, point.min, point.max) == (2, tuple(counts), 7, 3, 4)
    assert before <= point.start_time_unix_nano <= after and point.time_unix_nano == 1


def test_counters_add_up_per_attributes_and_a_delta_store_starts_afresh_at_each_collection():
    """Cumulative: 2 + 3 = 5, then + 1 = 6, from the series' start. Delta: 5, then 1, starting where the
    previous collection ended; a collection with nothing new has no point."""
    cumulative, delta = MetricStore(frozenset(), now_ns=100), MetricStore(EVERY_KIND_DELTA, now_ns=100)
    for store in (cumulative, delta):
        store.add(DROPPED, ((c.DROP_REASON, "a"),), 2)
        store.add(DROPPED, ((c.DROP_REASON, "b"),), 7)
        store.add(DROPPED, ((c.DROP_REASON, "a"),), 3)
    by_reason = {dict(p.attributes)[c.DROP_REASON]: p for p in cumulative.collect(200)[0].data.data_points}
    assert (by_reason["a"].value, by_reason["b"].value) == (5, 7)
    (first,) = delta.collect(200)
    assert first.data.aggregation_temporality is AggregationTemporality.DELTA and first.data.is_monotonic is True
    assert sorted(
        (dict(p.attributes)[c.DROP_REASON], p.value, p.start_time_unix_nano) for p in first.data.data_points
    ) == [
        ("a", 5, 100),
        ("b", 7, 100),
    ]
    for store in (cumulative, delta):
        store.add(DROPPED, ((c.DROP_REASON, "a"),), 1)
    (later,) = cumulative.collect(300)
    assert sorted((dict(p.attributes)[c.DROP_REASON], p.value) for p in later.data.data_points) == [("a", 6), ("b", 7)]
    assert later.data.aggregation_temporality is AggregationTemporality.CUMULATIVE
    point = only_point(delta.collect(300), c.METRIC_DROPPED)
    assert (point.value, point.start_time_unix_nano, point.time_unix_nano) == (1, 200, 300)
    assert delta.collect(400) == []


def test_a_gauge_is_its_last_value_per_attributes_as_the_sdk_s():
    """GPU-0 set to 0.4 then 0.7: 0.7; GPU-1 set to 0.2: 0.2; a later 0.0 (a falsy value) is kept as 0.0. The
    SDK's synchronous gauge fed the same calls reads the same."""
    calls = [(0.4, "GPU-0"), (0.2, "GPU-1"), (0.7, "GPU-0")]
    store = MetricStore(frozenset(), now_ns=0)
    for value, hw in calls:
        store.set(GPU_UTILIZATION, ((c.HW_ID, hw),), value)
    (metric,) = store.collect(1)
    mine = {p.attributes[c.HW_ID]: p.value for p in metric.data.data_points}
    assert mine == {"GPU-0": 0.7, "GPU-1": 0.2}
    assert all(p.start_time_unix_nano is None for p in metric.data.data_points)
    sdk, reader = sdk_instruments()
    for value, hw in calls:
        sdk.gpu_utilization(value, hw)
    assert {p.attributes[c.HW_ID]: p.value for p in stagetrace_points(reader)[c.METRIC_GPU_UTILIZATION]} == mine
    store.set(GPU_UTILIZATION, ((c.HW_ID, "GPU-0"),), 0.0)
    assert {p.attributes[c.HW_ID]: p.value for p in store.collect(2)[0].data.data_points} == {
        "GPU-0": 0.0,
        "GPU-1": 0.2,
    }


def test_exemplars_are_each_bucket_s_last_in_bucket_order_once_per_collection():
    """3 ms with trace A then 4 ms with trace B in (2.5, 5], 0.05 ms with C in (0, 0.1], 4.5 ms with none:
    the exemplars are C's (bucket 0) then B's (bucket 5, the last with one), as the SDK's; the next
    collection, cumulative, has the counts still and no exemplar."""
    observations = [(3.0, (0xA, 0x1)), (4.0, (0xB, 0x2)), (0.05, (0xC, 0x3)), (4.5, None)]
    reader = InMemoryMetricReader()
    MeterProvider(metric_readers=[reader], resource=RESOURCE, shutdown_on_exit=False)
    own = AggregatedMetrics(RESOURCE)
    own.attach_readers([reader])
    sdk, sdk_reader = sdk_instruments()
    for sink in (own, sdk):
        for value, exemplar in observations:
            sink._observe(STAGE_DURATION, ((c.STAGE, "s"),), value, exemplar)
    (point,) = stagetrace_points(reader)[c.METRIC_STAGE_DURATION]
    assert exemplars_of(point) == [(0.05, 0xC, 0x3), (4.0, 0xB, 0x2)]
    (theirs,) = stagetrace_points(sdk_reader)[c.METRIC_STAGE_DURATION]
    assert exemplars_of(theirs) == exemplars_of(point)
    assert (point.count, point.bucket_counts[0], point.bucket_counts[5]) == (4, 1, 3)
    (again,) = stagetrace_points(reader)[c.METRIC_STAGE_DURATION]
    assert again.count == 4 and exemplars_of(again) == []


def test_a_trace_s_events_reach_every_reader_of_the_aggregation():
    """One streamed trace (stages 50 and 900 ms, total 1250 ms, slow, one code, bottleneck decode; first chunk at
    250 ms; 10 gaps, 9 in (50, 100] and 1 in (100, 200], sum 9 * 90 + 150 = 960 ms, min 90, max 150, the gaps'
    bottleneck decode), one batch, one drop, one GPU value, through two readers: each receives the same
    figures, counted once."""
    readers = [InMemoryMetricReader(), InMemoryMetricReader()]
    MeterProvider(metric_readers=readers, resource=RESOURCE, shutdown_on_exit=False)
    own = AggregatedMetrics(RESOURCE)
    own.attach_readers(readers)
    v = verdict(
        breakdown={"prefill": 50.0, "decode": 900.0}, total_ms=1250.0, bottleneck="decode", slow=True,
        slow_reason=c.SLOW_TOTAL, diagnoses=(Diagnosis("X", "m", "a"),), stream=streamed(),
    )  # fmt: skip
    own.record_trace(v, (0x77, 0x88))
    own.record_batch("infer", 3, 0.75)
    own.dropped("budget", 2)
    own.gpu_utilization(0.5, "GPU-0")
    for reader in readers:
        points = stagetrace_points(reader)
        stages = {p.attributes[c.STAGE]: (p.count, p.sum) for p in points[c.METRIC_STAGE_DURATION]}
        assert stages == {"prefill": (1, 50.0), "decode": (1, 900.0)}
        (total,) = points[c.METRIC_TRACE_DURATION]
        assert (total.count, total.sum, exemplars_of(total)) == (1, 1250.0, [(1250.0, 0x77, 0x88)])
        assert [(p.attributes[c.DIAGNOSIS_CODE], p.value) for p in points[c.METRIC_DIAGNOSIS]] == [("X", 1)]
        assert [(p.attributes[c.STAGE], p.value) for p in points[c.METRIC_BOTTLENECK]] == [("decode", 1)]
        assert [(p.count, p.sum) for p in points[c.METRIC_BATCH_SIZE]] == [(1, 3)]
        assert [(p.count, p.sum) for p in points[c.METRIC_BATCH_FILL]] == [(1, 0.75)]
        assert [p.value for p in points[c.METRIC_DROPPED]] == [2]
        assert [p.value for p in points[c.METRIC_GPU_UTILIZATION]] == [0.5]
        (first_chunk,) = points[c.METRIC_STREAM_FIRST_CHUNK]
        assert (first_chunk.count, first_chunk.sum) == (1, 250.0)
        (gaps,) = points[c.METRIC_STREAM_CHUNK_GAP]
        assert dict(gaps.attributes) == {c.STREAM_GAP_BOTTLENECK: "decode"}
        assert (gaps.count, gaps.sum, gaps.min, gaps.max) == (10, 960.0, 90.0, 150.0)
        assert (gaps.bucket_counts[9], gaps.bucket_counts[10], sum(gaps.bucket_counts)) == (9, 1, 10)


def test_point_times_units_and_temporality_as_a_reader_receives_them():
    """A store made at 100 ns, one observation, one addition and one gauge value, collected at 500 then at 900 ns
    after one more of each. Cumulative: a point starts when its series began (a clock reading between before
    and after the first call) and ends at the collection. Delta: it starts where the previous collection ended
    (100, then 500), and holds only what came since. A gauge point has no start; nothing set since the last
    delta collection: no gauge point."""
    before = time_ns()
    cumulative, delta = MetricStore(frozenset(), now_ns=100), MetricStore(EVERY_KIND_DELTA, now_ns=100)
    for store in (cumulative, delta):
        store.observe(STAGE_DURATION, (), 1.0, None)
        store.add(DROPPED, (), 2)
        store.set(GPU_UTILIZATION, (), 0.5)
    after = time_ns()
    first = {True: {m.name: m for m in delta.collect(500)}, False: {m.name: m for m in cumulative.collect(500)}}
    for is_delta, metrics in first.items():
        assert sorted(metrics) == sorted([c.METRIC_STAGE_DURATION, c.METRIC_DROPPED, c.METRIC_GPU_UTILIZATION])
        for inst in (STAGE_DURATION, DROPPED, GPU_UTILIZATION):
            assert (metrics[inst.name].unit, metrics[inst.name].description) == (inst.unit, inst.description)
        temporality = AggregationTemporality.DELTA if is_delta else AggregationTemporality.CUMULATIVE
        assert metrics[c.METRIC_STAGE_DURATION].data.aggregation_temporality is temporality
        assert metrics[c.METRIC_DROPPED].data.aggregation_temporality is temporality
        (hist,) = metrics[c.METRIC_STAGE_DURATION].data.data_points
        (count,) = metrics[c.METRIC_DROPPED].data.data_points
        (gauge,) = metrics[c.METRIC_GPU_UTILIZATION].data.data_points
        for point in (hist, count, gauge):
            assert point.time_unix_nano == 500 and point.exemplars == []
        if is_delta:
            assert hist.start_time_unix_nano == count.start_time_unix_nano == 100
        else:
            assert before <= hist.start_time_unix_nano <= after and before <= count.start_time_unix_nano <= after
        assert gauge.start_time_unix_nano is None and (hist.count, count.value, gauge.value) == (1, 2, 0.5)
    started = first[False][c.METRIC_STAGE_DURATION].data.data_points[0].start_time_unix_nano
    for store in (cumulative, delta):
        store.observe(STAGE_DURATION, (), 2.0, None)
        store.add(DROPPED, (), 3)
    later = {m.name: m.data.data_points[0] for m in cumulative.collect(900)}
    assert (later[c.METRIC_STAGE_DURATION].count, later[c.METRIC_STAGE_DURATION].sum) == (2, 3.0)
    assert later[c.METRIC_STAGE_DURATION].start_time_unix_nano == started
    assert later[c.METRIC_DROPPED].value == 5 and later[c.METRIC_GPU_UTILIZATION].value == 0.5
    since = {m.name: m.data.data_points[0] for m in delta.collect(900)}
    assert sorted(since) == sorted([c.METRIC_STAGE_DURATION, c.METRIC_DROPPED])  # no gauge set since
    hist = since[c.METRIC_STAGE_DURATION]
    assert (hist.count, hist.sum, hist.min, hist.max, hist.start_time_unix_nano, hist.time_unix_nano) == (
        1, 2.0, 2.0, 2.0, 500, 900,
    )  # fmt: skip
    assert (since[c.METRIC_DROPPED].value, since[c.METRIC_DROPPED].start_time_unix_nano) == (3, 500)


def test_an_exemplar_is_stamped_when_observed_and_comes_back_after_a_collection():
    """An exemplar carries no filtered attributes (the point's attributes are all its series'), the time of its
    observation, and after a collection emptied the exemplars the next observation with one records it."""
    store = MetricStore(frozenset(), now_ns=0)
    before = time_ns()
    store.observe(STAGE_DURATION, (), 3.0, (0xA, 0x1))
    after = time_ns()
    (exemplar,) = only_point(store.collect(1), c.METRIC_STAGE_DURATION).exemplars
    assert exemplar.filtered_attributes == {} and before <= exemplar.time_unix_nano <= after
    assert (exemplar.value, exemplar.trace_id, exemplar.span_id) == (3.0, 0xA, 0x1)
    store.observe(STAGE_DURATION, (), 0.2, (0xB, 0x2))  # (0.1, 0.25]: bucket 1
    point = only_point(store.collect(2), c.METRIC_STAGE_DURATION)
    assert exemplars_of(point) == [(0.2, 0xB, 0x2)] and point.count == 2


def aggregated(
    provider_resource: Resource = RESOURCE, own_resource: Resource = RESOURCE, delta: bool = False, **own: Any
) -> tuple[AggregatedMetrics, InMemoryMetricReader, MeterProvider]:
    preferred = None
    if delta:
        from opentelemetry.sdk.metrics import Counter, Histogram

        preferred = {Counter: AggregationTemporality.DELTA, Histogram: AggregationTemporality.DELTA}
    reader = InMemoryMetricReader(preferred_temporality=preferred)
    provider = MeterProvider(metric_readers=[reader], resource=provider_resource, shutdown_on_exit=False)
    metrics = AggregatedMetrics(own_resource, **own)
    metrics.attach_readers([reader])
    return metrics, reader, provider


def test_the_aggregation_s_metrics_go_under_its_resource_or_beside_the_provider_s_own():
    """The provider collecting nothing of its own: one resource, the aggregation's, with stagetrace's scope. The
    provider with a counter of its own: its resource, its scope first and stagetrace's after it. Schema URLs
    empty, as the SDK's own."""
    mine = Resource.create({"service.name": "mine"})
    metrics, reader, provider = aggregated(provider_resource=RESOURCE, own_resource=mine)
    metrics.dropped("budget", 2)
    (rm,) = reader.get_metrics_data().resource_metrics
    assert rm.resource is mine and rm.schema_url == ""
    (sm,) = rm.scope_metrics
    assert (sm.scope.name, sm.schema_url, [m.name for m in sm.metrics]) == (
        c.INSTRUMENTATION_NAME,
        "",
        [c.METRIC_DROPPED],
    )
    provider.get_meter("app").create_counter("app.requests").add(4)
    metrics.dropped("budget", 1)
    (rm,) = reader.get_metrics_data().resource_metrics
    assert rm.resource.attributes["service.name"] == "export-values-test" and rm.schema_url == ""
    assert [(sm.scope.name, [m.name for m in sm.metrics]) for sm in rm.scope_metrics] == [
        ("app", ["app.requests"]),
        (c.INSTRUMENTATION_NAME, [c.METRIC_DROPPED]),
    ]
    assert rm.scope_metrics[1].schema_url == ""
    assert [p.value for p in rm.scope_metrics[1].metrics[0].data.data_points] == [3]  # cumulative: 2 + 1


def test_a_reader_s_points_are_stamped_by_the_clock_from_its_attachment():
    """A delta reader: its first point starts when it was attached (a clock reading between before and after
    attach_readers), its points end at a clock reading of their collection."""
    before = time_ns()
    metrics, reader, _ = aggregated(delta=True)
    attached = time_ns()
    metrics.record_stage("s", "cpu", 1.0, None)
    collecting = time_ns()
    (point,) = stagetrace_points(reader)[c.METRIC_STAGE_DURATION]
    collected = time_ns()
    assert before <= point.start_time_unix_nano <= attached and collecting <= point.time_unix_nano <= collected


def test_the_aggregation_caps_stage_names_at_256_by_default():
    """256 names are themselves; the 257th becomes ``_other`` and is counted once as dropped."""
    metrics, reader, _ = aggregated()
    for i in range(257):
        metrics.record_stage(f"s{i}", "cpu", 1.0, None)
    points = stagetrace_points(reader)
    labels = {p.attributes[c.STAGE] for p in points[c.METRIC_STAGE_DURATION]}
    assert len(labels) == 257 and "_other" in labels and "s255" in labels and "s256" not in labels
    assert [(p.attributes[c.DROP_REASON], p.value) for p in points[c.METRIC_DROPPED]] == [("stage_name_cardinality", 1)]


def test_an_offloaded_call_gives_its_queue_wait_and_each_payload_s_size_by_executor_and_function():
    """Two calls of 'tokenize' to one pool (queued 3 and 40 ms; 2 KiB sent, 5 MiB back; then 300 B sent, its
    result lost) and one of 'resize' whose worker never reported: the queue histogram holds the two measured
    waits (bucket (2.5, 5] and (25, 50]) and none for the call without a report; the sizes land on the byte
    buckets by direction, a result that never came back adding no 'return' value."""
    reader = InMemoryMetricReader()
    MeterProvider(metric_readers=[reader], resource=RESOURCE, shutdown_on_exit=False)
    own = AggregatedMetrics(RESOURCE)
    own.attach_readers([reader])
    pool = "ProcessPoolExecutor"
    calls = (
        OffloadedCall("tokenize", OffloadInfo(pool, 2, 3, 2048, 5 * 2**20), 3.0, 0.5, 10.0, 4.0),
        OffloadedCall("tokenize", OffloadInfo(pool, 2, 1, 300, None), 40.0, 0.1, 1.0, 0.0),
        OffloadedCall("resize", OffloadInfo(pool, 2, 1, 100, None), 0.0, 0.0, 0.0, 0.0, reported=False),
    )
    own.record_trace(verdict(offloads=calls), None)
    points = stagetrace_points(reader)
    (queue,) = points[c.METRIC_OFFLOAD_QUEUE]
    assert dict(queue.attributes) == {c.OFFLOAD_EXECUTOR: pool, c.STAGE: "tokenize"}
    assert (queue.count, queue.sum, queue.min, queue.max) == (2, 43.0, 3.0, 40.0)
    assert queue.bucket_counts[MS_BUCKETS.index(5)] == 1 and queue.bucket_counts[MS_BUCKETS.index(50)] == 1
    sizes = {
        (p.attributes[c.STAGE], p.attributes[c.DIRECTION]): (p.count, p.sum, list(p.bucket_counts))
        for p in points[c.METRIC_OFFLOAD_TRANSFER]
    }
    buckets = [0] * (len(c.BYTE_BUCKETS) + 1)
    sent = list(buckets)
    sent[c.BYTE_BUCKETS.index(1024)] = 1  # 300 B in (0, 1 KiB]
    sent[c.BYTE_BUCKETS.index(4096)] = 1  # 2 KiB in (1, 4 KiB]
    back = list(buckets)
    back[c.BYTE_BUCKETS.index(16 * 2**20)] = 1  # 5 MiB in (4, 16 MiB]
    assert sizes == {
        ("tokenize", "send"): (2, 2348.0, sent),
        ("tokenize", "return"): (1, 5.0 * 2**20, back),
        ("resize", "send"): (1, 100.0, [1, *buckets[1:]]),
    }
