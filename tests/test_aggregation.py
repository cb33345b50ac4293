"""stagetrace's own metric aggregation (``exporter/aggregation.py``) against the SDK's instruments fed the
same events: a reader must receive the same metrics, cumulative or delta, exemplars included."""

from __future__ import annotations

import math
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from stagetrace import conventions as c
from stagetrace.analysis import Verdict
from stagetrace.analysis.diagnosis import Diagnosis
from stagetrace.analysis.offload import OffloadedCall, OffloadInfo
from stagetrace.analysis.streams import GapHistogram, StreamSummary
from stagetrace.exporter.aggregation import AggregatedMetrics
from stagetrace.exporter.metrics import INSTRUMENTS, SdkInstruments

RESOURCE = Resource.create({"service.name": "aggregation-test"})


def verdict(i: int, **changes: Any) -> Verdict:
    """A verdict whose values cross buckets, routes and codes as ``i`` changes."""
    fields: dict[str, Any] = {
        "breakdown": {"decode": 0.3 * (i % 7) + 0.05, "infer": 11.0 + i, "post": 1.0 if i % 2 else 250.0},
        "stage_kinds": {"decode": "cpu", "infer": "gpu", "post": "cpu"},
        "total_ms": 15.0 + 3 * i,
        "bottleneck": "infer" if i % 3 else "post",
        "route": "/a" if i % 2 else None,
        "slow": i % 4 == 0,
        "diagnoses": (Diagnosis("CPU_PREPROCESSING_BOUND", "m", "a"),) if i % 5 == 0 else (),
        "trace_id": f"{i:032x}",
        "root_name": "request",
        "ratio": 0.5,
        "slow_threshold_ms": 200.0,
        "untracked_ms": 1.0,
    }
    fields.update(changes)
    return Verdict(**fields)


def stream(i: int) -> StreamSummary:
    """A stream whose gaps sit on bucket edges (1 ms), so that the SDK's one-value-at-a-time recording of
    a merged histogram (each value at its bucket's upper edge) aggregates exactly what the counts say."""
    gaps = 5 + i
    counts = [0] * (len(c.MS_BUCKETS) + 1)
    counts[c.MS_BUCKETS.index(1)] = gaps
    return StreamSummary(
        chunks=gaps + 1, first_chunk_ms=2.0 + i, streaming_ms=float(gaps), gap_p50_ms=1.0, gap_p99_ms=1.0,
        gap_max_ms=1.0, send_wait_ms=0.0, disconnected=i % 4 == 3, first_chunk_bottleneck="decode",
        gap_bottleneck="infer", first_chunk_breakdown={}, gap_breakdown={},
        gaps=GapHistogram(tuple(counts), float(gaps), 1.0, 1.0),
    )  # fmt: skip


def feed(sink: Any, rounds: range) -> None:
    for i in rounds:
        exemplar = (0x1000 + i, 0x2000 + i) if i % 2 == 0 else None  # kept traces only
        sink.record_trace(verdict(i), exemplar)
        if i % 2:  # a streamed response of a generative model
            gen_ai = {c.GEN_AI_REQUEST_MODEL: "m", c.GEN_AI_OPERATION: "chat"}
            sink.record_trace(verdict(i, stream=stream(i), gen_ai=gen_ai, route="/gen"), exemplar)
        if i % 3 == 1:  # a request that handed a call to a process pool (its result lost one round in four)
            info = OffloadInfo("ProcessPoolExecutor", 2, 1 + i % 4, 4**i, None if i % 4 == 1 else 2**i)
            sink.record_trace(verdict(i, offloads=(OffloadedCall("tokenize", info, 0.5 * i, 1.0, 5.0, 0.2),)), None)
        sink.record_stage("late", "cpu", 0.7 * i, None)
        sink.record_batch("infer", 1 + i % 9, (1 + i % 9) / 8 if i % 3 else None)
        sink.dropped("channel_full", i % 3)
        sink.gpu_utilization(0.1 * (i % 10), "GPU-uuid-0")


def metrics_of(reader: InMemoryMetricReader) -> dict[str, Any]:
    """Each stagetrace metric as comparable plain values (times left out: the two runs read the clock at
    different moments)."""
    out: dict[str, Any] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            if sm.scope.name != c.INSTRUMENTATION_NAME:
                continue
            for m in sm.metrics:
                points = []
                for p in m.data.data_points:
                    attrs = tuple(sorted(p.attributes.items()))
                    if hasattr(p, "bucket_counts"):
                        exemplars = sorted(
                            (e.trace_id, e.span_id, e.value, dict(e.filtered_attributes or {})) for e in p.exemplars
                        )
                        points.append(
                            (
                                attrs,
                                p.count,
                                round(p.sum, 9),
                                tuple(p.bucket_counts),
                                tuple(p.explicit_bounds),
                                p.min,
                                p.max,
                                exemplars,
                            )
                        )
                    else:
                        points.append((attrs, p.value))
                out[m.name] = {
                    "unit": m.unit,
                    "description": m.description,
                    "type": type(m.data).__name__,
                    "temporality": getattr(m.data, "aggregation_temporality", None),
                    "monotonic": getattr(m.data, "is_monotonic", None),
                    "points": sorted(points, key=repr),
                }
    return out


def two_readers(
    temporality: AggregationTemporality | None,
) -> tuple[Any, Any, InMemoryMetricReader, InMemoryMetricReader]:
    preferred = {cls: temporality for cls in _instrument_classes()} if temporality else None
    sdk_reader = InMemoryMetricReader(preferred_temporality=preferred)
    own_reader = InMemoryMetricReader(preferred_temporality=preferred)
    sdk_provider = MeterProvider(metric_readers=[sdk_reader], resource=RESOURCE, shutdown_on_exit=False)
    sdk = SdkInstruments(sdk_provider.get_meter(c.INSTRUMENTATION_NAME), max_stage_names=3)
    MeterProvider(metric_readers=[own_reader], resource=RESOURCE, shutdown_on_exit=False)
    own = AggregatedMetrics(RESOURCE, max_stage_names=3)
    own.attach_readers([own_reader])
    return sdk, own, sdk_reader, own_reader


def _instrument_classes() -> list[type]:
    from opentelemetry.sdk.metrics import Counter, Histogram, ObservableGauge, UpDownCounter
    from opentelemetry.sdk.metrics._internal.instrument import Gauge

    return [Counter, Histogram, UpDownCounter, ObservableGauge, Gauge]


@pytest.mark.parametrize("temporality", [None, AggregationTemporality.DELTA, AggregationTemporality.CUMULATIVE])
def test_a_reader_receives_what_the_sdk_would_have_aggregated(temporality):
    sdk, own, sdk_reader, own_reader = two_readers(temporality)
    for rounds in (range(0, 12), range(12, 13), range(13, 13), range(13, 30)):  # the third collects nothing new
        feed(sdk, rounds)
        feed(own, rounds)
        theirs, mine = metrics_of(sdk_reader), metrics_of(own_reader)
        assert sorted(mine) == sorted(theirs)
        for name in theirs:
            assert mine[name] == theirs[name], name


def test_every_instrument_of_the_contract_is_exported_with_its_buckets():
    _, own, _, own_reader = two_readers(None)
    feed(own, range(0, 10))
    own.dropped("budget", 2)
    got = metrics_of(own_reader)
    assert sorted(got) == sorted(inst.name for inst in INSTRUMENTS)
    for inst in INSTRUMENTS:
        assert got[inst.name]["unit"] == inst.unit
        if inst.buckets:
            assert all(p[4] == inst.buckets for p in got[inst.name]["points"])
    names = {dict(p[0])[c.STAGE] for p in got[c.METRIC_STAGE_DURATION]["points"]}
    assert "_other" in names and len(names) == 4  # three names, then the overflow label, counted
    dropped = dict((dict(p[0])[c.DROP_REASON], p[1]) for p in got[c.METRIC_DROPPED]["points"])
    assert dropped["stage_name_cardinality"] > 0 and dropped["budget"] == 2


def test_the_provider_s_own_metrics_are_collected_beside_stagetrace_s():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], resource=RESOURCE, shutdown_on_exit=False)
    provider.get_meter("app").create_counter("app.requests").add(3)
    own = AggregatedMetrics(RESOURCE)
    own.attach_readers([reader])
    own.dropped("budget", 1)
    data = reader.get_metrics_data()
    (rm,) = data.resource_metrics
    scopes = {sm.scope.name: [m.name for m in sm.metrics] for sm in rm.scope_metrics}
    assert scopes == {"app": ["app.requests"], c.INSTRUMENTATION_NAME: [c.METRIC_DROPPED]}


def test_nothing_observed_collects_only_the_provider_s_metrics():
    reader = InMemoryMetricReader()
    MeterProvider(metric_readers=[reader], resource=RESOURCE, shutdown_on_exit=False)
    AggregatedMetrics(RESOURCE).attach_readers([reader])
    data = reader.get_metrics_data()
    assert data is None or all(
        sm.scope.name != c.INSTRUMENTATION_NAME for rm in data.resource_metrics for sm in rm.scope_metrics
    )


def test_two_readers_collect_independently():
    delta = InMemoryMetricReader(
        preferred_temporality={cls: AggregationTemporality.DELTA for cls in _instrument_classes()}
    )
    cumulative = InMemoryMetricReader()
    MeterProvider(metric_readers=[delta, cumulative], resource=RESOURCE, shutdown_on_exit=False)
    own = AggregatedMetrics(RESOURCE)
    own.attach_readers([delta, cumulative])
    own.dropped("budget", 2)
    assert metrics_of(delta)[c.METRIC_DROPPED]["points"] == [(((c.DROP_REASON, "budget"),), 2)]
    own.dropped("budget", 1)
    assert metrics_of(delta)[c.METRIC_DROPPED]["points"] == [(((c.DROP_REASON, "budget"),), 1)]
    assert metrics_of(cumulative)[c.METRIC_DROPPED]["points"] == [(((c.DROP_REASON, "budget"),), 3)]


def test_a_reader_that_is_not_the_sdk_s_is_a_clear_error():
    with pytest.raises(TypeError, match="SDK MetricReader"):
        AggregatedMetrics(RESOURCE).attach_readers([object()])  # type: ignore[list-item]


def test_values_on_the_bucket_edges_fall_as_the_sdk_puts_them():
    """An explicit bucket holds values up to and including its upper edge (OpenTelemetry's rule)."""
    sdk, own, sdk_reader, own_reader = two_readers(None)
    for sink in (sdk, own):
        for value in (0.1, 0.1000001, 10, 10000, 10001, 0.0, math.nextafter(5, 0)):
            sink.record_stage("edge", "cpu", value, None)
    assert metrics_of(own_reader) == metrics_of(sdk_reader)


def test_point_times_follow_the_temporality():
    """Delta points start where the previous collection ended; cumulative ones where the series began."""
    deltas = {cls: AggregationTemporality.DELTA for cls in _instrument_classes()}
    delta, cumulative = InMemoryMetricReader(preferred_temporality=deltas), InMemoryMetricReader()
    MeterProvider(metric_readers=[delta, cumulative], resource=RESOURCE, shutdown_on_exit=False)
    own = AggregatedMetrics(RESOURCE)
    own.attach_readers([delta, cumulative])

    def point(reader: InMemoryMetricReader) -> Any:
        (rm,) = reader.get_metrics_data().resource_metrics
        (sm,) = rm.scope_metrics
        (m,) = sm.metrics
        (p,) = m.data.data_points
        return p

    own.record_stage("s", "cpu", 1.0, None)
    first_delta, first_cumulative = point(delta), point(cumulative)
    own.record_stage("s", "cpu", 2.0, None)
    second_delta, second_cumulative = point(delta), point(cumulative)
    assert second_delta.start_time_unix_nano == first_delta.time_unix_nano
    assert second_delta.count == 1 and second_cumulative.count == 2
    assert second_cumulative.start_time_unix_nano == first_cumulative.start_time_unix_nano
    assert first_cumulative.start_time_unix_nano <= first_cumulative.time_unix_nano < second_cumulative.time_unix_nano


def test_prometheus_scrapes_the_aggregation():
    """A pull reader (Prometheus) collects on each scrape, through the same path."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import REGISTRY, generate_latest

    import stagetrace

    reader = PrometheusMetricReader()
    handle = stagetrace.configure("prometheus-test", metric_reader=reader, set_global=False)
    try:
        for _ in range(3):
            with stagetrace.pipeline("request"), stagetrace.stage("decode"):
                pass
        assert handle.force_flush(10)
        lines = generate_latest(REGISTRY).decode().splitlines()
    finally:
        handle.shutdown()
    count = [line for line in lines if line.startswith("stagetrace_stage_duration_milliseconds_count")]
    assert count and 'stagetrace_stage="decode"' in count[0] and count[0].endswith(" 3.0")
