"""Pure analysis: the README's "Analysis semantics", one behaviour per test."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetrace.analysis import StageSample, analyse_trace, union_length_ns

MS = 1_000_000


def s(name, start_ms, end_ms, sid=0, parent=0, kind="cpu", gpu_ms=None):
    return StageSample(name, kind, int(start_ms * MS), int(end_ms * MS), sid, parent, gpu_ms=gpu_ms)


def test_union_length_merges_overlaps_and_ignores_empty():
    assert union_length_ns([(0, 10), (5, 15), (20, 30), (25, 26), (40, 40), (50, 45)]) == 25
    assert union_length_ns([]) == 0


def test_breakdown_bottleneck_ratio_and_untracked():
    a = analyse_trace(0, 100 * MS, [s("decode", 0, 60), s("infer", 60, 90)], slow_threshold_ms=200)
    assert a.total_ms == 100
    assert a.breakdown == {"decode": 60, "infer": 30}
    assert a.bottleneck == "decode"
    assert a.ratio == pytest.approx(0.6)
    assert a.untracked_ms == pytest.approx(10)
    assert a.slow is False


def test_nested_stage_time_is_exclusive():
    # post 10..50 contains json 20..40: post is charged 20 ms, json 20 ms
    stages = [s("post", 10, 50, sid=1), s("json", 20, 40, sid=2, parent=1)]
    a = analyse_trace(0, 60 * MS, stages, 200)
    assert a.breakdown == {"post": 20, "json": 20}
    assert a.untracked_ms == pytest.approx(20)


def test_concurrent_children_subtract_their_union_once():
    stages = [s("fanout", 0, 50, sid=1), s("a", 10, 30, sid=2, parent=1), s("b", 20, 40, sid=3, parent=1)]
    a = analyse_trace(0, 50 * MS, stages, 200)
    assert a.breakdown["fanout"] == pytest.approx(20)  # 50 - union(10..40)
    assert a.breakdown["a"] == a.breakdown["b"] == pytest.approx(20)


def test_repeated_names_add_up_and_keep_pipeline_order():
    stages = [s("tok", 0, 5), s("infer", 5, 25), s("tok", 25, 40)]
    a = analyse_trace(0, 40 * MS, stages, 200)
    assert list(a.breakdown) == ["tok", "infer"]
    assert a.breakdown["tok"] == pytest.approx(20)
    assert a.bottleneck == "tok"


def test_overlapping_stages_from_threads_sum_per_name_but_untracked_uses_union():
    stages = [s("decode", 0, 40), s("decode", 0, 40), s("decode", 10, 50)]
    a = analyse_trace(0, 100 * MS, stages, 200)
    assert a.breakdown["decode"] == pytest.approx(120)
    assert a.ratio == 1.0  # capped: the share of wall time cannot exceed the whole
    assert a.untracked_ms == pytest.approx(50)


def test_gpu_stage_is_charged_its_gpu_time_not_host_wait():
    # the d2h host call blocked 40 ms waiting for inference kernels, its own copy took 1 ms on the GPU
    stages = [s("infer", 0, 2, kind="gpu", gpu_ms=41), s("d2h", 2, 43, kind="d2h", gpu_ms=1)]
    a = analyse_trace(0, 45 * MS, stages, 200)
    assert a.breakdown == {"infer": 41, "d2h": 1}
    assert a.bottleneck == "infer"


def test_stage_after_root_end_is_not_request_latency():
    stages = [s("handle", 0, 10), s("background", 12, 200)]
    a = analyse_trace(0, 11 * MS, stages, 50)
    assert "background" not in a.breakdown
    assert a.charged_ms[1] is None
    assert a.slow is False


def test_slow_flag_is_strictly_greater_than_threshold():
    assert analyse_trace(0, 200 * MS, [], 200).slow is False
    assert analyse_trace(0, 200 * MS + 1, [], 200).slow is True


def test_no_stages_means_no_bottleneck_and_all_untracked():
    a = analyse_trace(0, 30 * MS, [], 200)
    assert a.bottleneck is None and a.ratio == 0.0 and a.untracked_ms == pytest.approx(30)


def test_untracked_is_the_headline_when_it_exceeds_every_stage():
    # 100 ms request, stages of 10 and 5 ms: 85 ms in no stage
    stages = [StageSample("decode", "cpu", 0, 10 * MS, 1), StageSample("infer", "cpu", 50 * MS, 55 * MS, 2)]
    a = analyse_trace(0, 100 * MS, stages, 200)
    assert (a.bottleneck, a.ratio, a.untracked_ms) == ("untracked", pytest.approx(0.85), pytest.approx(85))
    assert "untracked" not in a.breakdown  # the breakdown stays stages only


def test_a_stage_that_equals_untracked_time_keeps_the_headline():
    # 20 ms request: 10 ms stage, 10 ms in no stage; the stage wins a tie
    a = analyse_trace(0, 20 * MS, [StageSample("decode", "cpu", 0, 10 * MS, 1)], 200)
    assert (a.bottleneck, a.ratio) == ("decode", pytest.approx(0.5))
    a = analyse_trace(0, 20 * MS + 1000, [StageSample("decode", "cpu", 0, 10 * MS, 1)], 200)
    assert a.bottleneck == "untracked"


def test_untracked_is_a_reserved_stage_name():
    import stagetrace

    with pytest.raises(ValueError, match="reserved"):
        stagetrace.stage("untracked")


intervals = st.tuples(st.integers(0, 10_000), st.integers(0, 10_000)).map(lambda t: (min(t), max(t)))


@st.composite
def traces(draw):
    root = draw(intervals)
    n = draw(st.integers(0, 12))
    stages = []
    for i in range(n):
        a, b = draw(intervals)
        parent = draw(st.integers(0, i)) if i and draw(st.booleans()) else 0
        kind = draw(st.sampled_from(["cpu", "io", "wait", "gpu", "h2d", "d2h"]))
        gpu = draw(st.one_of(st.none(), st.floats(0, 50, allow_nan=False)))
        stages.append(
            StageSample(draw(st.sampled_from("abcde")), kind, a * MS // 1000, b * MS // 1000, i + 1, parent, gpu)
        )
    return root, stages


@settings(max_examples=300, deadline=None)
@given(traces(), st.floats(0.001, 1e4, allow_nan=False))
def test_invariants_hold_for_any_trace(trace, threshold):
    (r0, r1), stages = trace
    a = analyse_trace(r0 * MS // 1000, r1 * MS // 1000, stages, threshold)
    assert 0.0 <= a.ratio <= 1.0
    assert a.untracked_ms >= 0
    assert a.untracked_ms <= a.total_ms + 1e-9
    assert all(v >= 0 for v in a.breakdown.values())
    # wall-time stages can only exceed the total through overlap: bounded by the sum of their intervals
    wall_sum = sum(x.wall_ms for x in stages) + sum(x.gpu_ms or 0 for x in stages)
    assert sum(a.breakdown.values()) <= wall_sum + 1e-6
    if a.breakdown:
        largest = max(a.breakdown.values())
        if a.untracked_ms > largest:
            assert a.bottleneck == "untracked"
            assert a.ratio == pytest.approx(min(1.0, a.untracked_ms / a.total_ms))
        else:
            assert a.bottleneck in a.breakdown
            assert a.breakdown[a.bottleneck] == largest
    else:
        assert a.bottleneck is None


def test_union_length_takes_intervals_in_any_order_and_of_any_sequence_type():
    """Sorted only where they are not in order of start already: the same length either way."""
    ordered = [(0, 10), (5, 15), (20, 30), (25, 26)]
    assert union_length_ns(ordered) == union_length_ns(ordered[::-1]) == 25
    assert union_length_ns([[20, 30], [0, 10], [5, 15]]) == 25
    assert union_length_ns(iv for iv in [(3, 4), (0, 1)]) == 2


def test_stages_out_of_order_of_start_still_give_the_breakdown_in_pipeline_order():
    """The breakdown is ordered by each name's first start, however the stages arrive: in order of start (read
    as they come), or not (sorted, ties as they came)."""
    in_order = [s("decode", 0, 10), s("infer", 10, 30), s("decode", 30, 35), s("json", 35, 40)]
    shuffled = [in_order[2], in_order[3], in_order[1], in_order[0]]
    for stages in (in_order, shuffled):
        a = analyse_trace(0, 50 * MS, stages, 200)
        assert list(a.breakdown) == ["decode", "infer", "json"]
        assert a.breakdown == {"decode": 15, "infer": 20, "json": 5}
    tie = analyse_trace(0, 50 * MS, [s("b", 5, 10), s("a", 0, 5), s("c", 0, 3)], 200)
    assert list(tie.breakdown) == ["a", "c", "b"]  # a and c start together: as they came
