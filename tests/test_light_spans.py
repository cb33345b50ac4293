"""Other instrumentations' spans inside a held trace are light spans (``capture/light_spans.py``), built as
SDK spans only in the exporter: what an exporter receives must be what the SDK exports for the same calls.

Each scenario runs twice, against a plain SDK ``TracerProvider`` and against stagetrace, under the same span
limits and sampler, and the exported spans are compared field by field (ids mapped to names, since ids are
random)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    get_current_span,
    use_span,
)

import stagetrace
from conftest import both_modes, rules_that_cannot_fire
from stagetrace import conventions as c
from stagetrace.capture.light_spans import LightSpan
from stagetrace.capture.tracer import CaptureTracer

export_mode = both_modes
T0 = 1_700_000_000_000_000_000
MS = 1_000_000
OTHER = SpanContext(0xABC, 0xDEF, True, TraceFlags(1), TraceState([("k", "v")]))
LIMITS = {
    "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "5",
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": "6",
    "OTEL_SPAN_EVENT_COUNT_LIMIT": "2",
    "OTEL_SPAN_LINK_COUNT_LIMIT": "2",
    "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT": "2",
    "OTEL_LINK_ATTRIBUTE_COUNT_LIMIT": "1",
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "4",
}


class Opaque:
    """A value OpenTelemetry cannot keep as it is (it keeps its ``str``)."""

    def __str__(self) -> str:
        return "opaque"


def every_call(tracer: Any) -> None:
    """The span API, every method, with values the limits and the attribute rules act on."""
    root = tracer.start_span("request", start_time=T0)
    with use_span(root, end_on_exit=False):
        a = tracer.start_span(
            "client",
            kind=SpanKind.CLIENT,
            attributes={"n": 1, "text": "abcdefghij", "seq": ["abcdefgh", "b"], "": 2, "f": 1.5},
            links=[Link(OTHER, {"l1": 1, "l2": 2}), Link(SpanContext(0, 0, False)), Link(OTHER)],
            start_time=T0 + 1 * MS,
        )
        for i in range(6):
            a.set_attribute(f"k{i}", i)  # past the count limit: the oldest go
        a.set_attribute("k3", "again")  # an existing key moves to the end, nothing dropped
        a.set_attribute(None, 1)  # type: ignore[arg-type]
        a.set_attributes({"b": b"bytes", "none": None, "map": {"x": "long value", "y": [1, 2]}, "obj": Opaque()})
        a.add_event("e1", {"p": 1, "q": 2, "r": "long value"}, timestamp=T0 + 2 * MS)
        a.add_event("e2", timestamp=T0 + 3 * MS)
        a.add_event("e3", {"p": 3}, timestamp=T0 + 4 * MS)  # past the event limit: e1 goes
        a.add_link(OTHER, {"late": True, "dropped": 1})
        a.add_link(SpanContext(0, 0, False))  # invalid, no attributes: ignored
        a.update_name("client renamed")
        a.set_status(StatusCode.ERROR, "first")
        a.set_status(Status(StatusCode.ERROR, "second"), "ignored description")
        a.set_status(StatusCode.UNSET)
        a.record_exception(ValueError("boom"), attributes={"extra": 1}, timestamp=T0 + 5 * MS)
        a.end(end_time=T0 + 6 * MS)
        a.end(end_time=T0 + 7 * MS)  # a second end: a warning, nothing changes
        a.set_attribute("late", 1)
        a.add_event("late", timestamp=T0 + 7 * MS)
        a.set_status(StatusCode.OK)

        with stagetrace.stage("decode"):
            with tracer.start_as_current_span("inside a stage", start_time=T0 + 8 * MS, end_on_exit=False) as b:
                b.set_status(Status(StatusCode.OK))
                b.set_status(StatusCode.ERROR, "after OK: ignored")
                with tracer.start_as_current_span("nested", start_time=T0 + 9 * MS, end_on_exit=False) as c:
                    c.set_attribute("depth", 2)
                c.end(end_time=T0 + 10 * MS)
            b.end(end_time=T0 + 11 * MS)

        try:
            with tracer.start_as_current_span(
                "raises", start_time=T0 + 12 * MS, set_status_on_exception=True, end_on_exit=False
            ) as d:
                raise KeyError("missing")
        except KeyError:
            pass
        d.end(end_time=T0 + 13 * MS)

        quiet = tracer.start_span("no exception event", start_time=T0 + 14 * MS, record_exception=False)
        try:
            with use_span(quiet, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                raise RuntimeError("not recorded")
        except RuntimeError:
            pass
        quiet.end(end_time=T0 + 15 * MS)

        explicit = tracer.start_span("explicit parent", context=Context(), start_time=T0 + 16 * MS)  # a new root
        explicit.end(end_time=T0 + 17 * MS)
    root.end(end_time=T0 + 100 * MS)


def scripted(timestamp: int) -> int | None:
    """A time the script set, or None for one read from the clock (an exception recorded on exit)."""
    return timestamp if T0 <= timestamp <= T0 + 1000 * MS else None


def exported(spans: list[Any]) -> list[dict[str, Any]]:
    """The spans as plain values, parents by name, the local roots' verdict attributes left out."""
    names = {s.context.span_id: s.name for s in spans}
    out = []
    for s in spans:
        if s.name == "decode":
            continue  # a stage: stagetrace's own span, which the plain SDK run does not have
        is_root = s.parent is None or s.parent.is_remote
        parent = names.get(s.parent.span_id) if s.parent is not None else None
        if parent == "decode":
            parent = "request"  # its stage's parent, in the plain SDK run
        out.append(
            {
                "name": s.name,
                "parent": parent,
                "kind": s.kind,
                "start": s.start_time,
                "end": s.end_time,
                "attributes": None if is_root else dict(s.attributes),
                "events": [(e.name, scripted(e.timestamp), dict(e.attributes)) for e in s.events],
                "links": [
                    (link.context.trace_id, link.context.span_id, dict(link.attributes or {})) for link in s.links
                ],
                "status": (s.status.status_code, s.status.description),
                "dropped": (s.dropped_attributes, s.dropped_events, s.dropped_links),
                "scope": (s.instrumentation_scope.name, s.instrumentation_scope.version),
                "flags": int(s.context.trace_flags),
                "trace_state": s.context.trace_state.to_header() if s.context.trace_state else "",
            }
        )
    return sorted(out, key=lambda d: (d["start"], d["name"]))


def sdk_run(script: Callable[[Any], None], sampler: Sampler | None = None) -> list[dict[str, Any]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler, shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    script(provider.get_tracer("some.library", "2.0"))
    provider.shutdown()
    return exported(list(exporter.get_finished_spans()))


def stagetrace_run(make_harness: Any, script: Callable[[Any], None], **kwargs: Any) -> list[dict[str, Any]]:
    h = make_harness(thresholds=rules_that_cannot_fire(), **kwargs)  # no diagnosis event on the root
    tracer = h.handle.tracer_provider.get_tracer("some.library", "2.0")
    assert type(tracer) is CaptureTracer
    script(tracer)
    return exported(h.spans())


def test_every_call_exports_what_the_sdk_exports(make_harness, monkeypatch, caplog):
    for name, value in LIMITS.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING):
        expected = sdk_run(every_call)
        sdk_warnings = sorted((r.name, r.getMessage()) for r in caplog.records)
        caplog.clear()
        got = stagetrace_run(make_harness, every_call)
        light_warnings = sorted((r.name, r.getMessage()) for r in caplog.records)
    assert [s["name"] for s in got] == [s["name"] for s in expected]
    for mine, theirs in zip(got, expected):
        assert mine == theirs, mine["name"]
    assert light_warnings == sdk_warnings  # the same misuse warned of, in the same words
    client = next(s for s in got if s["name"] == "client renamed")
    assert client["dropped"][0] > 0 and client["dropped"][1] == 2  # the limits acted


def test_roots_and_spans_inside_held_traces_are_light_and_untracked_ones_sdk_spans(make_harness):
    h = make_harness(settings=stagetrace.Settings(max_traces_in_flight=2))
    tracer = h.handle.tracer_provider.get_tracer("lib")
    seen = {}
    with tracer.start_as_current_span("request") as root:
        seen["root"] = type(root)
        with tracer.start_as_current_span("child") as child:
            seen["child"] = type(child)
            with stagetrace.stage("decode"), tracer.start_as_current_span("in stage") as inner:
                seen["in stage"] = type(inner)
        with tracer.start_as_current_span("new root", context=Context()) as other:
            seen["new root"] = type(other)
            # a third trace in flight is past the registry's bound: not held, so the SDK's path
            with tracer.start_as_current_span("untracked", context=Context()) as untracked:
                with tracer.start_as_current_span("untracked child") as untracked_child:
                    seen["untracked child"] = type(untracked_child)
                seen["untracked"] = type(untracked)
    remote = NonRecordingSpan(SpanContext(0x1234, 0x99, True, TraceFlags(1)))
    with use_span(remote), tracer.start_as_current_span("server") as server:
        seen["under a remote parent"] = type(server)
        assert server.parent.span_id == 0x99 and server.parent.is_remote
    for name in ("root", "child", "in stage", "new root", "untracked", "under a remote parent"):
        assert seen[name] is LightSpan, name
    assert seen["untracked child"] is not LightSpan
    spans = {s.name: s for s in h.spans()}
    assert {"request", "child", "in stage", "decode", "new root", "server", "untracked", "untracked child"} <= set(
        spans
    )
    exported_server = spans["server"]
    assert exported_server.parent.span_id == 0x99 and exported_server.parent.is_remote
    assert exported_server.context.trace_id == 0x1234 and c.TOTAL_MS in exported_server.attributes


class NamingSampler(Sampler):
    """Drops spans called "drop me", keeps the rest with an attribute of its own and a trace-state entry."""

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        if name == "drop me":
            return SamplingResult(Decision.DROP)
        state = get_current_span(parent_context).get_span_context().trace_state or TraceState()
        return SamplingResult(
            Decision.RECORD_AND_SAMPLE, {**(attributes or {}), "sampled.by": "name"}, state.add("s", "1")
        )

    def get_description(self) -> str:
        return "NamingSampler"


def sampled_calls(tracer: Any) -> None:
    root = tracer.start_span("request", start_time=T0)
    with use_span(root, end_on_exit=False):
        kept = tracer.start_span("kept", attributes={"a": 1}, start_time=T0 + MS)
        with use_span(kept, end_on_exit=False):
            dropped = tracer.start_span("drop me", start_time=T0 + 2 * MS)
            assert not dropped.is_recording()
            with use_span(dropped):
                tracer.start_span("under a dropped span", start_time=T0 + 3 * MS).end(end_time=T0 + 4 * MS)
        kept.end(end_time=T0 + 5 * MS)
    root.end(end_time=T0 + 10 * MS)


@pytest.mark.parametrize(
    "sampler",
    [NamingSampler(), ParentBased(ALWAYS_ON, local_parent_sampled=NamingSampler())],
    ids=["custom", "parent-based-with-custom-delegate"],
)
def test_the_head_sampler_decides_each_light_span_as_it_decides_sdk_spans(make_harness, sampler):
    expected = sdk_run(sampled_calls, sampler)
    got = stagetrace_run(make_harness, sampled_calls, sampler=sampler)
    assert got == expected
    assert "drop me" not in {s["name"] for s in got}


def test_children_of_an_unsampled_root_are_not_recorded(make_harness):
    """The default parent-based rule, taken without asking the sampler: an unsampled root (recorded by
    stagetrace for its metrics) has non-recording children, as with the SDK."""
    h = make_harness(sampler=ParentBased(TraceIdRatioBased(0.0)))
    tracer = h.handle.tracer_provider.get_tracer("lib")
    with tracer.start_as_current_span("request") as root:
        assert root.is_recording() and not root.get_span_context().trace_flags.sampled
        with tracer.start_as_current_span("child") as child:
            assert not child.is_recording() and not child.get_span_context().trace_flags.sampled
            assert child.get_span_context().trace_id == root.get_span_context().trace_id
    assert [s.name for s in h.spans() if s.name == "child"] == []
    assert len(h.wait_verdicts(1)) == 1


def test_a_processor_added_to_the_provider_gets_sdk_spans_from_then_on(make_harness, caplog):
    h = make_harness()
    provider = h.handle.tracer_provider
    tracer = provider.get_tracer("lib")
    with tracer.start_as_current_span("request"), tracer.start_as_current_span("before") as before:
        assert type(before) is LightSpan
    seen = InMemorySpanExporter()
    with caplog.at_level(logging.INFO, logger="stagetrace"):
        provider.add_span_processor(SimpleSpanProcessor(seen))
    assert "a span processor was added" in caplog.text
    with tracer.start_as_current_span("request"), tracer.start_as_current_span("after") as after:
        assert type(after) is not LightSpan
    assert "after" in {s.name for s in seen.get_finished_spans()}
    assert {"before", "after"} <= {s.name for s in h.spans()}


def test_light_spans_can_be_switched_off(make_harness, monkeypatch):
    monkeypatch.setenv("STAGETRACE_LIGHT_SPANS", "off")
    h = make_harness()
    tracer = h.handle.tracer_provider.get_tracer("lib")
    with tracer.start_as_current_span("request"), tracer.start_as_current_span("child") as child:
        assert type(child) is not LightSpan
    assert "child" in {s.name for s in h.spans()}


def test_a_bad_switch_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("STAGETRACE_LIGHT_SPANS", "sometimes")
    with pytest.raises(ValueError, match="STAGETRACE_LIGHT_SPANS must be on or off"):
        stagetrace.Settings()


def test_a_span_that_ends_after_its_trace_is_exported_on_its_own(make_harness):
    h = make_harness()
    tracer = h.handle.tracer_provider.get_tracer("lib")
    with tracer.start_as_current_span("request"):
        background = tracer.start_span("background")
        assert type(background) is LightSpan
    h.flush()
    background.set_attribute("done", True)
    background.end()
    (span,) = h.by_name("background")
    assert span.attributes["done"] is True


def test_after_shutdown_spans_take_the_sdk_path(make_harness):
    h = make_harness()
    tracer = h.handle.tracer_provider.get_tracer("lib")
    with tracer.start_as_current_span("request") as root:
        h.handle.shutdown()
        with tracer.start_as_current_span("child") as child:
            assert type(child) is not LightSpan
    assert root is not None


def test_readable_like_an_sdk_span(make_harness):
    h = make_harness()
    tracer = h.handle.tracer_provider.get_tracer("lib")
    with tracer.start_as_current_span("request"), tracer.start_as_current_span("child", attributes={"a": 1}) as s:
        s.add_event("e", {"k": 1}, timestamp=5)
        s.add_link(OTHER, {"l": 1})
        assert dict(s.attributes) == {"a": 1} and s.name == "child" and s.is_recording()
        assert [(e.name, e.timestamp, dict(e.attributes)) for e in s.events] == [("e", 5, {"k": 1})]
        assert [link.context.span_id for link in s.links] == [OTHER.span_id]
        assert s.status.status_code is StatusCode.UNSET
        assert s.context is s.get_span_context()
    assert not s.is_recording()


@pytest.mark.internal_errors_expected
def test_a_failing_light_path_falls_back_to_the_sdk(make_harness, monkeypatch):
    h = make_harness()
    tracer = h.handle.tracer_provider.get_tracer("lib")

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("planted")

    with tracer.start_as_current_span("request"):
        monkeypatch.setattr(CaptureTracer, "_light_span", broken)
        with tracer.start_as_current_span("child") as child:
            assert type(child) is not LightSpan
    assert "child" in {s.name for s in h.spans()}


def test_the_light_path_is_the_default_sampler_s_own(make_harness):
    """The default sampler (parent-based, always on) is not asked per span; an always-off root sampler
    still gives a recorded root and unrecorded children."""
    h = make_harness(sampler=ParentBased(ALWAYS_OFF))
    tracer = h.handle.tracer_provider.get_tracer("lib")
    assert tracer._capture_rules.follows_parent
    with tracer.start_as_current_span("request"), tracer.start_as_current_span("child") as child:
        assert not child.is_recording()


def decorated_calls(tracer: Any) -> None:
    import asyncio

    @tracer.start_as_current_span("sync work", start_time=T0 + MS)
    def work(x: int) -> int:
        get_current_span().set_attribute("x", x)
        return x * 2

    @tracer.start_as_current_span("async work", start_time=T0 + 2 * MS)
    async def async_work() -> str:
        await asyncio.sleep(0)
        get_current_span().set_attribute("awaited", True)
        return "done"

    root = tracer.start_span("request", start_time=T0)
    with use_span(root, end_on_exit=False):
        assert work(21) == 42
        assert asyncio.run(async_work()) == "done"
    root.end(end_time=T0 + 10 * MS)


def test_start_as_current_span_as_a_decorator_exports_what_the_sdk_exports(make_harness):
    expected = sdk_run(decorated_calls)
    got = stagetrace_run(make_harness, decorated_calls)
    for span in expected + got:
        span["end"] = None  # the decorated functions end on the clock
    assert got == expected
    assert {s["name"] for s in got} == {"request", "sync work", "async work"}
