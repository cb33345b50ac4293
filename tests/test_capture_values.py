"""The capture records' own values: what a stage keeps of the attributes it is given, and a composite's
figures as its occurrences fold in."""

from __future__ import annotations

from stagetrace.capture.records import (
    KEEP_REPEATS,
    MAX_ATTRIBUTE_VALUE_LENGTH,
    MAX_STAGE_ATTRIBUTES,
    Repeat,
    StageRecord,
    clean_attribute_value,
)


def record() -> StageRecord:
    return StageRecord("decode", "cpu", None, None, 1, 2, 0, 0)  # type: ignore[arg-type]  # no runtime read


def test_set_attributes_sets_each_pair_as_set_attribute_would():
    rec = record()
    rec.set_attributes({"image.width": 640, "codec": "jpeg", "bad": object(), "": 1})
    assert rec.attributes == {"image.width": 640, "codec": "jpeg"}  # the unexportable value and empty key dropped
    rec.set_attributes({"codec": "png"})
    assert rec.attributes == {"image.width": 640, "codec": "png"}  # a key set again takes the new value


def test_a_stage_keeps_at_most_its_attribute_bound_and_still_updates_the_keys_it_has():
    rec = record()
    rec.set_attributes({f"k{i}": i for i in range(MAX_STAGE_ATTRIBUTES + 3)})
    assert rec.attributes is not None and len(rec.attributes) == MAX_STAGE_ATTRIBUTES
    rec.set_attribute("k0", "again")
    assert rec.attributes["k0"] == "again" and f"k{MAX_STAGE_ATTRIBUTES}" not in rec.attributes


def test_a_composite_started_folding_sums_its_occurrences_from_the_first():
    """A dynamic batch's composite folds from its first occurrence: 100-130 (30 ns, the slowest so far), 140-150
    (10 ns), a backwards one (0 ns) with an error, 160-190 (30 ns again: a tie is the slowest, the latest)."""
    r = Repeat.started("infer.batch", "cpu", 5, 6, 77)
    assert (r.name, r.kind, r.parent_span_id, r.parent_stage_id, r.span_id) == ("infer.batch", "cpu", 5, 6, 77)
    assert (r.count, r.folded, r.folding) == (KEEP_REPEATS, 0, True)
    assert (r.start_ns, r.end_ns, r.compressed) == (0, 0, (0, 0, 0, 0))
    assert (r.error, r.on_event_loop, r.slowest, r.batch) == (None, False, None, None)
    assert r.add(100, 130) is True
    assert r.add(140, 150) is False
    assert r.add(170, 155, ("ValueError", "m", "tb")) is False
    assert r.add(160, 190, ("OSError", "later", "")) is True
    assert r.compressed == (4, 70, 0, 30) and (r.start_ns, r.end_ns) == (100, 190)
    assert r.error == ("ValueError", "m", "tb")  # the first error stays


def test_a_composite_s_first_occurrence_sets_its_least_even_when_it_is_long():
    r = Repeat.started("step", "cpu", 1, 0, 2)
    r.add(0, 50)
    r.add(60, 100)
    assert r.compressed == (2, 90, 40, 50)  # the least is the second (40), not a 0 left from the start


def test_attribute_values_are_opentelemetry_s_types_with_strings_and_sequences_bounded():
    long = "x" * (MAX_ATTRIBUTE_VALUE_LENGTH + 5)
    assert clean_attribute_value(long) == "x" * MAX_ATTRIBUTE_VALUE_LENGTH
    assert clean_attribute_value(3) == 3 and clean_attribute_value(2.5) == 2.5 and clean_attribute_value(True) is True
    assert clean_attribute_value([1, "a", long]) == (1, "a", "x" * MAX_ATTRIBUTE_VALUE_LENGTH)  # a list: a tuple
    assert clean_attribute_value(tuple(range(130))) == tuple(range(128))  # at most 128 values
    assert clean_attribute_value([1, object()]) is None and clean_attribute_value({"a": 1}) is None
    assert clean_attribute_value(None) is None and clean_attribute_value(object()) is None
    assert clean_attribute_value([]) == ()
