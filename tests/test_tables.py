"""One table per fact: the field tables in ``conventions`` cover every record that carries the fields, and a
verdict written to a span reads back the same (the exporter and ``stagetrace report`` share the tables)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace import SpanLimits
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from stagetrace import conventions as c
from stagetrace.analysis import Diagnosis, StageSample, Verdict, stage_record
from stagetrace.capture.light_spans import LightSpan
from stagetrace.capture.records import Repeat, StageRecord, pack_stage_record
from stagetrace.common import wire
from stagetrace.exporter import spans as sp
from stagetrace.report.loader import Span
from stagetrace.report.traces import _sample, _stored_verdict


def test_every_record_carries_every_stage_signal():
    sample_fields = {f.name for f in dataclasses.fields(StageSample)}
    shipped = set(wire.ShippedStage.__slots__)
    for field, _, _ in c.STAGE_SIGNALS:
        assert field in sample_fields, field
        assert field in shipped, field
        # captured on the request thread, or derived in the exporter from the raw CPU readings
        assert field in wire.STAGE_FIELDS or field in stage_record.DERIVED_STAGE_FIELDS, field
        assert field in wire.STAGE_FIELDS or not hasattr(StageRecord, field), field
    assert {f for f, _, _, _ in c.VERDICT_FIELDS} <= {f.name for f in dataclasses.fields(Verdict)}


def test_stage_signals_round_trip_through_span_attributes():
    original = StageSample(
        "decode", "cpu", 0, 5_000_000, span_id=7, cpu_ms=3.5, blocked_ms=1.0, runqueue_ms=0.5, not_gil_ms=0.25,
        gpu_ms=None,
        h2d_bytes=4096, h2d_pinned=False, gpu_utilization=0.25, queue_saturated=True,
    )  # fmt: skip
    shipped = SimpleNamespace(**{f.name: getattr(original, f.name) for f in dataclasses.fields(original)})
    attrs = sp.stage_attributes(SimpleNamespace(**vars(shipped), attributes=None))
    span = Span("t" * 32, format(7, "016x"), "", "decode", 0, 5_000_000, attributes=attrs)
    read = _sample(span, "")
    for field, _, _ in c.STAGE_SIGNALS:
        assert getattr(read, field) == getattr(original, field), field


def test_a_verdict_reads_back_as_written():
    verdict = Verdict(
        trace_id="a" * 32,
        root_name="POST /predict",
        total_ms=123.4567,
        breakdown={"decode": 100.0, "infer": 20.0},
        bottleneck="decode",
        ratio=0.81,
        slow=False,
        slow_threshold_ms=200.0,
        untracked_ms=3.4567,
        diagnoses=(Diagnosis("UNTRACKED_TIME", "m", "a"),),
        gpu_utilization=0.5,
        gil_pressure_ms=1.5,
        cpu_pressure_ms=2.25,
        loop_lag_ms=None,
        blocked_by=("decode@" + "e" * 32, "resize@" + "f" * 32),
        delayed_requests=3,
        stage_kinds={"decode": "cpu", "infer": "gpu"},
    )
    attrs = sp.verdict_attributes(verdict)
    assert c.LOOP_LAG_MS not in attrs  # not measured: not on the span
    root = Span("a" * 32, "b" * 16, "", "POST /predict", 0, 123_456_700, attributes=attrs)
    stages = [
        Span("a" * 32, "c" * 16, "b" * 16, "decode", 0, 1, attributes={c.STAGE: "decode", c.STAGE_KIND: "cpu"}),
        Span("a" * 32, "d" * 16, "b" * 16, "infer", 0, 1, attributes={c.STAGE: "infer", c.STAGE_KIND: "gpu"}),
    ]
    read = _stored_verdict(root, "a" * 32, [root, *stages])
    for field, _, _, digits in c.VERDICT_FIELDS:
        expected = getattr(verdict, field)
        if isinstance(expected, float) and digits is not None:
            expected = round(expected, digits)
        assert getattr(read, field) == expected, field
    assert read.breakdown == verdict.breakdown and read.diagnosis_codes == ("UNTRACKED_TIME",)
    assert read.stage_kinds == verdict.stage_kinds


def test_shipped_stage_types_every_wire_field_and_every_derived_one():
    fields = wire.STAGE_FIELDS + stage_record.DERIVED_STAGE_FIELDS
    assert tuple(wire.ShippedStage.__annotations__) == (*fields, "wall_ms")
    # the .pxd that makes it a C type where the exporter is compiled declares the same members
    pxd = Path(stage_record.__file__).with_suffix(".pxd").read_text()
    assert tuple(re.findall(r"^    cdef public object (\w+)$", pxd, re.M)) == fields
    assert re.findall(r"^    cdef public double (\w+)$", pxd, re.M) == ["wall_ms"]


def test_a_shipped_stage_assigns_its_fields_in_the_order_of_the_table():
    """``ShippedStage.__init__`` writes its fields out (so that compiled, each is a store into the C type's
    member): in the order of STAGE_FIELDS, every derived field set to None."""
    tree = ast.parse(Path(stage_record.__file__).read_text())
    init = next(
        node
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name == "ShippedStage"
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and node.name == "__init__"
    )
    unpacked = next(s for s in init.body if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Tuple)).targets[
        0
    ]
    assert tuple(t.attr for t in unpacked.elts) == wire.STAGE_FIELDS
    set_none = [
        t.attr
        for s in init.body
        if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant) and s.value.value is None
        for t in s.targets
    ]
    assert tuple(set_none) == stage_record.DERIVED_STAGE_FIELDS


def _decode_stage() -> StageRecord:
    rec = StageRecord(
        "decode", "cpu", SimpleNamespace(), None, trace_id=1, span_id=2, parent_span_id=3, parent_stage_id=0
    )
    rec.start_ns, rec.end_ns, rec.cpu_start, rec.cpu_end = 10, 20, b"1 2 3", b"4 5 6"
    return rec


@pytest.mark.parametrize("set_first", [None, "gpu_resolved"])  # nothing else, or a name that is not shipped
def test_a_capture_record_packs_as_every_wire_field_read_one_by_one(set_first):
    # pack_stage_record reads the rarely set fields as one tuple of their class defaults where the record's
    # __dict__ is empty, from it where not: the same tuple as reading every field, with any of them set or none.
    rarely_set = [f for f in wire.STAGE_FIELDS if f not in StageRecord.__slots__]
    assert rarely_set == list(wire.STAGE_FIELDS[-len(rarely_set) :])  # what record_packer asks of the table
    for field in [None, *rarely_set]:
        rec = _decode_stage()
        if set_first is not None:
            setattr(rec, set_first, True)
        if field is not None:
            setattr(rec, field, ("set", field))
        packed = pack_stage_record(rec)
        assert packed == tuple(getattr(rec, f) for f in wire.STAGE_FIELDS), field
        assert packed == wire.pack_stage(rec)
        if field is not None:
            assert packed[wire.STAGE_FIELDS.index(field)] == ("set", field)


def test_a_record_packer_needs_the_defaults_last():
    class Shuffled:
        __slots__ = wire.STAGE_FIELDS[1:]
        name = "a class-level default before the slots"

    with pytest.raises(ValueError, match="Shuffled: its class-level defaults must be the last STAGE_FIELDS"):
        wire.record_packer(Shuffled)


class _WithGpuTime(StageRecord):
    __slots__ = ()

    @property
    def gpu_ms(self) -> float:
        return 1.5


def test_a_record_packer_refuses_a_default_that_is_not_a_plain_value():
    # the constant tuple would carry the property itself, which marshal refuses: the trace would go as its root
    with pytest.raises(ValueError, match=r"_WithGpuTime\.gpu_ms: a class-level default must be a plain value"):
        wire.record_packer(_WithGpuTime)


def test_a_record_packer_reads_every_field_of_any_other_record():
    # a trace's stages hold composites (slots only, no __dict__, a property) and arrived stages beside capture
    # records; a subclass may compute a field: none of them takes the capture record's shortcut
    composite = Repeat(_decode_stage(), 3)
    subclassed = _WithGpuTime("decode", "cpu", SimpleNamespace(), None, 1, 2, 3, 0)
    for other in (composite, subclassed):
        assert pack_stage_record(other) == tuple(getattr(other, f) for f in wire.STAGE_FIELDS)
    assert pack_stage_record(subclassed)[wire.STAGE_FIELDS.index("gpu_ms")] == 1.5


def test_a_light_span_packs_each_rarely_set_field_in_its_place():
    span = LightSpan(
        "root", 1, 2, 0, TraceFlags(1), None, SpanKind.SERVER, 100, SpanLimits(), InstrumentationScope("lib", "1.0"),
        None, None,
    )  # fmt: skip
    span.end_time = 200
    fresh = dict(zip(wire.SPAN_FIELDS, span.wire_tuple(), strict=True))
    assert (fresh["parent_is_remote"], fresh["events"], fresh["links"], fresh["status_code"]) == (False, (), (), 0)
    assert (fresh["dropped_attributes"], fresh["dropped_events"], fresh["dropped_links"]) == (0, 0, 0)
    span.parent_is_remote = True
    span._events = [("e", 150, {})]
    span._links = [(SpanContext(5, 6, False), {"k": "v"})]
    span._status = Status(StatusCode.ERROR, "bad")
    span.dropped_attributes, span.dropped_events, span.dropped_links = 1, 2, 3
    packed = dict(zip(wire.SPAN_FIELDS, span.wire_tuple(), strict=True))
    assert packed["parent_is_remote"] is True
    assert packed["events"] == (("e", 150, {}),)
    assert packed["links"] == ((5, 6, 0, "", {"k": "v"}),)
    assert (packed["status_code"], packed["status_description"]) == (StatusCode.ERROR.value, "bad")
    assert (packed["dropped_attributes"], packed["dropped_events"], packed["dropped_links"]) == (1, 2, 3)
    assert (packed["scope_name"], packed["scope_version"], packed["flags"]) == ("lib", "1.0", 1)
    assert type(packed["flags"]) is int and type(packed["kind"]) is int  # plain, for marshal


def test_a_scopes_name_and_version_are_its_own_even_where_a_gone_scopes_id_is_remembered():
    """Read once a scope and remembered by id: an entry whose scope is not this one (an id a gone scope had)
    is replaced, never read as this scope's; a span without a scope crosses as two empty strings."""
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from stagetrace.common import wire

    gone, scope = InstrumentationScope("gone", "1.0"), InstrumentationScope("fastapi", None)
    wire._SCOPE_FIELDS[id(scope)] = (gone, ("gone", "1.0"))
    assert wire.scope_fields(scope) == ("fastapi", "")
    assert wire.scope_fields(scope) == ("fastapi", "") and wire._SCOPE_FIELDS[id(scope)][0] is scope
    assert wire.scope_fields(None) == ("", "")


def test_the_named_tuples_built_positionally_have_the_fields_in_the_order_their_builders_write():
    """``exporter.signals.trace_signals`` and ``exporter.signals.process_load`` build these with ``tuple.__new__``, the
    values in the fields' order (keyword construction runs the named tuple's Python ``__new__``)."""
    from stagetrace.analysis.signals import ProcessLoad, TraceSignals

    assert TraceSignals._fields == (
        "gpu_utilization", "gil_pressure_ms", "cpu_pressure_ms", "loop_lag_ms", "loop_held_ms", "blocked_by",
        "stream", "load",
    )  # fmt: skip
    assert ProcessLoad._fields == ("cpus", "cpus_used", "runnable", "requests")


def test_a_stage_record_of_another_shape_is_refused_before_it_is_read():
    """A record whose fields are not a tuple (as shipped) or a list is malformed: a dict of the right length
    would fill the stage with its keys while its checks read its values."""
    import pytest

    from stagetrace.common import wire

    good = list(wire.ShippedStage.added("s", "cpu", 1, 2, 3, 4).__getattribute__(f) for f in wire.STAGE_FIELDS)
    assert wire.ShippedStage(tuple(good)).name == "s"
    for shape in (dict(enumerate(good)), set(range(len(good))), "x" * len(good)):
        with pytest.raises(ValueError, match="a stage record is a tuple"):
            wire.ShippedStage(shape)


def test_a_stage_whose_times_no_float_holds_is_malformed_and_counted_as_one():
    """Its wall time is set as it is made: times further apart than a float holds are refused there as malformed
    (a ValueError the exporter counts), not an overflow that would escape the exporter's handling."""
    import pytest

    from stagetrace.common import wire
    from stagetrace.exporter.core import ExporterCore
    from stagetrace.exporter.metrics import MetricsRecorder
    from stagetrace.exporter.outputs import LocalOutputs
    from stagetrace.settings import Settings

    with pytest.raises(ValueError, match="further apart than a float holds"):
        wire.ShippedStage.added("s", "cpu", 1, 2, 0, 10**400)
    assert wire.ShippedStage.added("s", "cpu", 1, 2, 10**400, 0).wall_ms == 0.0  # backwards: no time, no float
    composite = [getattr(wire.ShippedStage.added("s", "cpu", 1, 2, 0, 1), f) for f in wire.STAGE_FIELDS]
    composite[wire.STAGE_FIELDS.index("compressed")] = (2, 10**400, 1, 10**400)  # its longest occurrence too
    with pytest.raises(ValueError, match="further apart than a float holds"):
        wire.ShippedStage(tuple(composite))

    class Spans:
        exported = 0

        def export(self, spans: object) -> None:
            self.exported += 1

        def flush(self, timeout_s: float) -> bool:
            return True

    recorder, sink = MetricsRecorder(), Spans()
    core = ExporterCore(Settings(healthy_sample=1.0), LocalOutputs(spans=sink, metrics=recorder))
    root = ("GET /", 7, 2, 0, False, 1, 0, 10, {}, (), (), 0, "", "s", "1", 1, "", 0, 0, 0)
    for end_ns, malformed in ((5, False), (10**400, True)):  # the same trace well formed first: it gets a verdict
        stage = [getattr(wire.ShippedStage.added("s", "cpu", 1, 2, 0, 1), f) for f in wire.STAGE_FIELDS]
        stage[wire.STAGE_FIELDS.index("end_ns")] = end_ns
        # (trace id, flags, state, offset, dropped stages, GPU, root, stages, others, loop thread, worker runs,
        # task created, received ms ago, stream, gen_ai)
        core.handle_or_count((wire.TRACE, 7, 1, "", 0, 0, None, root, (tuple(stage),), (), 0, (), 0, -1, None, None))
        calls = recorder.take()
        assert (("dropped", ("malformed_record", 1)) in calls) is malformed
        assert any(method == "record_trace" for method, _ in calls) is not malformed
    assert sink.exported == 1  # the well-formed one's spans only
