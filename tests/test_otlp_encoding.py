"""The OTLP bytes the exporter process sends for kept spans (``exporter/otlp_encoding.py``) are, byte for
byte, what the SDK's own encoder makes of the same spans; and the batching sink that sends them
(``exporter/otlp_sink.py``) batches, flushes, bounds and counts as the SDK's batch processor does."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from stagetrace.common import wire
from stagetrace.exporter.otlp_encoding import TraceRequestEncoder
from stagetrace.exporter.otlp_sink import WireBatchSink

RESOURCE = {"service.name": "enc-test", "service.version": "1.2", "host.cpus": 2, "deployment.canary": False}


def sdk_spans(calls, limits: SpanLimits | None = None):
    """The SDK's own finished spans for ``calls(tracer_provider)``."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource(RESOURCE), span_limits=limits or SpanLimits())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    calls(provider)
    provider.shutdown()
    return exporter.get_finished_spans()


def assert_same_bytes(spans) -> None:
    ours = TraceRequestEncoder(spans[0].resource.attributes).encode([wire.pack_span(s) for s in spans])
    theirs = encode_spans(spans).SerializeToString()
    if ours != theirs:  # the parsed messages say where they differ
        assert ExportTraceServiceRequest.FromString(ours) == ExportTraceServiceRequest.FromString(theirs)
    assert ours == theirs


def every_kind_of_span(provider) -> None:
    tracer = provider.get_tracer("app", "3.1")
    other = provider.get_tracer("other-lib")  # a second scope, without a version
    remote = SpanContext(0x1234, 0x5678, True, TraceFlags(1), TraceState([("vendor", "a1"), ("z", "0")]))
    with tracer.start_as_current_span("root", context=set_span_in_context(NonRecordingSpan(remote))) as root:
        root.set_attributes(
            {
                "str": "text",
                "empty": "",
                "unicode": "zürich ✓",
                "true": True,
                "false": False,
                "int": 42,
                "zero": 0,
                "negative": -7,
                "big": 2**62,
                "most negative": -(2**63),
                "float": 1.5,
                "float zero": 0.0,
                "negative float": -2.25,
                "strs": ("a", "", "c"),
                "ints": (1, -2, 3),
                "floats": (0.5, 0.0),
                "bools": (True, False),
                "empty seq": (),
            }
        )
        root.add_event("plain")
        root.add_event("with attributes", {"n": 1, "s": "x"}, timestamp=123)
        for kind in SpanKind:
            with tracer.start_as_current_span(f"kind {kind.name}", kind=kind):
                pass
        with other.start_as_current_span("failed") as failed:
            failed.record_exception(ValueError("bad input"))
            failed.set_status(Status(StatusCode.ERROR, "bad input"))
        with tracer.start_as_current_span("ok") as ok:
            ok.set_status(Status(StatusCode.OK))
        with tracer.start_as_current_span("error without description") as err:
            err.set_status(Status(StatusCode.ERROR))
        link = Link(SpanContext(0xABC, 0xDEF, False, TraceFlags(1)), {"batch.index": 3})
        with tracer.start_as_current_span("linked", links=[link, Link(remote)]):
            pass
    with tracer.start_as_current_span("new root, no parent"):
        pass


def test_every_kind_of_span_encodes_to_the_sdks_bytes():
    assert_same_bytes(sdk_spans(every_kind_of_span))


def test_spans_whose_limits_dropped_things_keep_their_counts():
    def calls(provider):
        with provider.get_tracer("app").start_as_current_span("limited") as span:
            for i in range(5):
                span.set_attribute(f"a{i}", i)
                span.add_event(f"e{i}")
                span.add_link(SpanContext(0x1, i + 1, False, TraceFlags(1)))

    limits = SpanLimits(max_span_attributes=2, max_events=2, max_links=2)
    (span,) = sdk_spans(calls, limits)
    assert (span.dropped_attributes, span.dropped_events, span.dropped_links) == (3, 3, 3)
    assert_same_bytes([span])


def test_stagetraces_own_spans_encode_to_the_sdks_bytes(make_harness):
    """Stage spans (a failed one with its exception event), other instrumentations' spans and the root
    with its verdict, as the exporter builds them from the wire, against the SDK's encoder of the same."""
    import stagetrace

    h = make_harness()
    with h.tracer.start_as_current_span("request"):
        with stagetrace.stage("decode"):
            time.sleep(0.002)
        with pytest.raises(KeyError), stagetrace.stage("lookup", kind="io"):
            raise KeyError("missing")
        with h.tracer.start_as_current_span("db.query", attributes={"db.system": "sqlite"}):
            pass
    spans = h.spans()
    assert {"request", "decode", "lookup", "db.query"} <= {s.name for s in spans}
    assert_same_bytes(spans)


attribute_values = st.one_of(
    st.text(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.lists(st.text(), max_size=4).map(tuple),
    st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=4).map(tuple),
    st.lists(st.floats(allow_nan=False), max_size=4).map(tuple),
    st.lists(st.booleans(), max_size=4).map(tuple),
)


@pytest.mark.slow  # over 1.4 s on its own: out of the quick loop
@settings(max_examples=150, deadline=None)
@given(attributes=st.dictionaries(st.text(min_size=1), attribute_values, max_size=6), name=st.text())
def test_any_attributes_encode_to_the_sdks_bytes(attributes, name):
    def calls(provider):
        with provider.get_tracer("prop").start_as_current_span(name, attributes=attributes) as span:
            span.add_event("e", attributes)

    assert_same_bytes(sdk_spans(calls))


def test_a_value_the_sdk_cannot_encode_is_left_out_as_the_sdk_leaves_it_out():
    span = wire.check_span(wire.pack_span(sdk_spans(lambda p: p.get_tracer("x").start_span("s").end())[0]))
    attributes = span.attributes | {"kept": 1, "object": object()}
    odd = wire.replace_span(span, attributes=attributes)
    message = ExportTraceServiceRequest.FromString(TraceRequestEncoder(RESOURCE).encode([odd]))
    (encoded,) = message.resource_spans[0].scope_spans[0].spans
    assert [kv.key for kv in encoded.attributes] == ["kept"]


def test_a_key_or_value_that_is_not_utf8_is_left_out_and_the_rest_encoded():
    span = wire.check_span(wire.pack_span(sdk_spans(lambda p: p.get_tracer("x").start_span("s").end())[0]))
    attributes = {"kept": 1.5, "lone\ud800": 2.0, "text": "a\udfffb", "also": True}
    odd = wire.replace_span(span, attributes=attributes)
    message = ExportTraceServiceRequest.FromString(TraceRequestEncoder(RESOURCE).encode([odd]))
    (encoded,) = message.resource_spans[0].scope_spans[0].spans
    assert [(kv.key, kv.value.WhichOneof("value")) for kv in encoded.attributes] == [
        ("kept", "double_value"),
        ("also", "bool_value"),
    ]


# --- the sink -----------------------------------------------------------------------------------------------


class Collector:
    def __init__(self, ok: bool = True, delay_s: float = 0.0) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.ok = ok
        self.delay_s = delay_s
        self.lock = threading.Lock()

    def send(self, data: bytes) -> bool:
        time.sleep(self.delay_s)
        with self.lock:
            self.requests.append(ExportTraceServiceRequest.FromString(data))
        return self.ok

    def span_names(self) -> list[str]:
        return [s.name for r in self.requests for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]


def packed(n: int, sampled: bool = True) -> list[tuple]:
    spans = sdk_spans(lambda p: [p.get_tracer("t").start_span(f"s{i}").end() for i in range(n)])
    out = [wire.check_span(wire.pack_span(s)) for s in spans]  # as the exporter receives them
    if not sampled:
        out = [wire.replace_span(s, flags=0) for s in out]
    return out


def make_sink(collector: Collector, drops: list, **kwargs) -> WireBatchSink:
    return WireBatchSink(collector.send, TraceRequestEncoder(RESOURCE), lambda r, n: drops.append((r, n)), **kwargs)


def test_the_sink_sends_full_batches_at_once_and_the_rest_on_its_schedule():
    collector, drops = Collector(), []
    sink = make_sink(collector, drops, max_export_batch_size=4, schedule_delay_s=0.3, max_queue_size=100)
    try:
        sink.export(packed(9))
        deadline = time.monotonic() + 5
        while len(collector.span_names()) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [len(r.resource_spans[0].scope_spans[0].spans) for r in collector.requests] == [4, 4]
        assert sink.flush(5)  # the ninth goes at once when flushed, not at the end of the delay
        assert len(collector.span_names()) == 9
        assert drops == []
    finally:
        sink.shutdown(5)


def test_a_flush_waits_for_a_batch_in_flight_and_a_full_queue_drops_and_counts():
    collector, drops = Collector(delay_s=0.2), []
    sink = make_sink(collector, drops, max_export_batch_size=2, schedule_delay_s=10, max_queue_size=4)
    try:
        sink.export(packed(2))  # a full batch: the worker takes it and is slowed by the collector
        time.sleep(0.05)
        sink.export(packed(6))  # 4 fit in the queue, 2 are dropped
        assert drops == [("export_queue_full", 2)]
        assert sink.flush(5)
        assert len(collector.span_names()) == 6
    finally:
        sink.shutdown(5)


def test_spans_of_unsampled_traces_are_not_sent():
    collector, drops = Collector(), []
    sink = make_sink(collector, drops, schedule_delay_s=10)
    try:
        sink.export(packed(2, sampled=False) + packed(1))
        assert sink.flush(5)
        assert collector.span_names() == ["s0"]
    finally:
        sink.shutdown(5)


def test_a_span_that_cannot_be_encoded_is_dropped_and_counted_the_rest_sent():
    collector, drops = Collector(), []
    sink = make_sink(collector, drops, schedule_delay_s=10)
    good = packed(2)
    bad = wire.replace_span(good[0], name="bad", span_id=-1)  # not an unsigned 64-bit id
    try:
        sink.export([good[0], bad, good[1]])
        assert sink.flush(5)
        assert collector.span_names() == ["s0", "s1"]
        assert drops == [("unencodable", 1)]
    finally:
        sink.shutdown(5)


def test_a_failing_collector_neither_raises_nor_blocks_a_flush_past_its_timeout():
    collector, drops = Collector(ok=False), []
    sink = make_sink(collector, drops, schedule_delay_s=10)
    sink.export(packed(3))
    assert sink.flush(5)  # sent and refused: the exporter logs it, as on the SDK's path
    stuck = make_sink(Collector(delay_s=2.0), [], schedule_delay_s=10)
    stuck.export(packed(1))
    t0 = time.monotonic()
    assert not stuck.flush(0.2)
    assert time.monotonic() - t0 < 1.5
    stuck.abandon()
    sink.shutdown(5)


@pytest.mark.parametrize("value", ["abc", "0", "-5"])
def test_bad_batch_settings_fall_back_to_the_sdks_defaults(monkeypatch, value, caplog):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", value)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "250")
    sink = make_sink(Collector(), [])
    try:
        assert sink.max_queue_size == 2048 and sink.schedule_delay_s == 0.25
        assert "OTEL_BSP_MAX_QUEUE_SIZE" in caplog.text
    finally:
        sink.shutdown(1)
