"""The capture records' own values: what a stage keeps of the attributes it is given."""

from __future__ import annotations

from stagetrace.capture.records import MAX_STAGE_ATTRIBUTES, StageRecord


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
