"""One table per fact: the field tables in ``conventions`` cover every record that carries the fields, and a
verdict written to a span reads back the same (the exporter and ``stagetrace report`` share the tables)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from stagetrace import conventions as c
from stagetrace.analysis import Diagnosis, StageSample, Verdict
from stagetrace.capture.records import StageRecord, pack_stage_record
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
        assert field in wire.STAGE_FIELDS or field in wire.DERIVED_STAGE_FIELDS, field
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
    assert tuple(wire.ShippedStage.__annotations__) == wire.STAGE_FIELDS + wire.DERIVED_STAGE_FIELDS


def test_a_capture_record_packs_as_every_wire_field_read_one_by_one():
    # pack_stage_record reads the rarely set fields as one tuple of their class defaults where nothing set any
    # of them: the same tuple as reading every field, fresh or with any of them set.
    runtime = SimpleNamespace()
    rarely_set = [f for f in wire.STAGE_FIELDS if f not in StageRecord.__slots__]
    assert rarely_set == list(wire.STAGE_FIELDS[-len(rarely_set) :])  # what record_packer asks of the table
    for field in [None, *rarely_set]:
        rec = StageRecord("decode", "cpu", runtime, None, trace_id=1, span_id=2, parent_span_id=3, parent_stage_id=0)
        rec.start_ns, rec.end_ns, rec.cpu_start, rec.cpu_end = 10, 20, b"1 2 3", b"4 5 6"
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


def test_a_record_packer_reads_every_field_of_any_other_record():
    # a trace's stages hold composites and arrived stages beside capture records: slots only, no __dict__
    other = SimpleNamespace(**{f: f for f in wire.STAGE_FIELDS})
    assert pack_stage_record(other) == wire.STAGE_FIELDS
