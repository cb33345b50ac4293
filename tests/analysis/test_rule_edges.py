"""Edges of the analysis and the rules: zero-length and sub-millisecond traces, stages exactly at the root's
end, exact thresholds, several candidates where the rule must pick the right one, and stages of the wrong
kind. Each test pins one decision the mutation run showed no other test pinned."""

from __future__ import annotations

import pytest
from trace_builders import MS, cpu, run

from stagetrace.analysis import (
    BatchInfo,
    DiagnosisThresholds,
    StageSample,
    TraceAnalysis,
    TraceSignals,
    analyse_trace,
    build_verdict,
    diagnose,
)


def codes(found: dict) -> set[str]:
    return set(found)


def analysis(total_ms: float, breakdown: dict[str, float], untracked_ms: float = 0.0, kinds=None) -> TraceAnalysis:
    """A hand-built analysis (no charged_ms): diagnose() then looks at every stage it is given."""
    return TraceAnalysis(
        total_ms=total_ms,
        breakdown=breakdown,
        bottleneck=max(breakdown, key=breakdown.__getitem__) if breakdown else None,
        ratio=0.0,
        slow=False,
        slow_threshold_ms=200,
        untracked_ms=untracked_ms,
        stage_kinds=kinds or {},
    )


# --- the breakdown -------------------------------------------------------------------------------------


def test_a_stage_starting_exactly_at_the_roots_end_is_after_the_request_and_does_not_hide_later_stages():
    stages = [cpu("after", 10, 20), cpu("within", 2, 8)]  # listed first, the post-response stage
    a = analyse_trace(0, 10 * MS, stages, 200)
    assert a.breakdown == {"within": pytest.approx(6.0)}
    assert a.charged_ms == (None, pytest.approx(6.0))


def test_a_zero_length_root_keeps_its_stages_unclipped():
    a = analyse_trace(5 * MS, 5 * MS, [cpu("a", 0, 10)], 200)
    assert a.breakdown == {"a": pytest.approx(10.0)} and a.total_ms == 0.0 and a.ratio == 0.0


def test_a_sub_millisecond_root_still_has_a_ratio():
    a = analyse_trace(0, MS // 2, [StageSample("a", "cpu", 0, 400_000, 1)], 200)
    assert a.ratio == pytest.approx(0.8)


def test_a_negative_gpu_time_is_charged_as_zero():
    a = analyse_trace(0, 10 * MS, [StageSample("k", "gpu", 0, 5 * MS, 1, gpu_ms=-1.0)], 200)
    assert a.breakdown == {"k": 0.0}


def test_one_nanosecond_stages_are_charged_exactly():
    parent = StageSample("p", "cpu", 0, 1, 1)
    child = StageSample("c", "cpu", 0, 1, 2, parent_stage_id=1)
    alone = StageSample("q", "cpu", 5, 6, 3)
    a = analyse_trace(0, 10, [parent, child, alone], 200)
    assert a.breakdown == {"p": 0.0, "c": 1e-6, "q": 1e-6}


# --- rules ---------------------------------------------------------------------------------------------


def test_only_cpu_stages_of_at_least_the_minimum_length_are_judged_blocked():
    io = cpu("fetch", 0, 50, kind="io", cpu_ms=1, blocked_ms=49)
    assert "LOCK_OR_IO_WAIT" not in run([io], signals=TraceSignals(gil_pressure_ms=0.1))
    exactly = cpu("t", 0, 5, cpu_ms=0, blocked_ms=5)  # 5 ms, the minimum
    assert "LOCK_OR_IO_WAIT" in run([exactly], total_ms=6, signals=TraceSignals(gil_pressure_ms=0.1))


def test_gil_pressure_exactly_at_its_threshold_is_contention_not_a_lock_wait():
    blocked = [cpu("t", 0, 50, cpu_ms=10, blocked_ms=40)]
    found = run(blocked, signals=TraceSignals(gil_pressure_ms=DiagnosisThresholds().gil_pressure_ms))
    assert "GIL_CONTENTION" in found and "LOCK_OR_IO_WAIT" not in found


def test_run_queue_time_is_compared_with_a_share_of_the_stage():
    # 20 ms waiting for a CPU in a 100 ms stage: above the 5 ms floor, below 30 % of the stage
    stage = [cpu("t", 0, 100, cpu_ms=80, blocked_ms=0, runqueue_ms=20)]
    assert "CPU_OVERSUBSCRIBED" not in run(stage, total_ms=110, signals=TraceSignals(gil_pressure_ms=0.1))


def test_gpu_starved_names_no_stage_when_the_largest_stage_is_on_the_gpu():
    stages = [cpu("a", 0, 30), cpu("b", 30, 60), StageSample("k", "gpu", 60 * MS, 95 * MS, gpu_ms=35)]
    found = run(stages, signals=TraceSignals(gpu_utilization=0.1))
    assert found["GPU_STARVED"].stage is None


def test_rules_that_divide_by_the_total_stay_silent_on_a_zero_length_trace():
    stages = [
        cpu("decode", 0, 50),
        cpu("q", 0, 20, kind="wait"),
        cpu("b", 0, 20, kind="wait", batch=BatchInfo("b", 2, 2, 0, 1, 8, formation_ms=20.0, busy_ms=0.0)),
    ]
    a = analyse_trace(0, 0, stages, 200)
    found = diagnose(a, stages, TraceSignals(gpu_utilization=0.05))
    assert found == ()


def test_sub_millisecond_totals_are_judged_like_any_other():
    # a stage that overran its 0.5 ms root: the rules read the stages as given
    a = analysis(0.5, {"decode": 0.3, "q": 0.2}, kinds={"decode": "cpu"})
    waits = [StageSample("q", "wait", 0, 12 * MS)]
    assert [d.code for d in diagnose(a, waits)] == ["QUEUEING"]
    assert "GPU_STARVED" in {d.code for d in diagnose(a, [cpu("decode", 0, 0.3)], TraceSignals(gpu_utilization=0.1))}
    formed = StageSample("b", "wait", 0, 12 * MS, batch=BatchInfo("b", 2, 2, 0, 1, 8, formation_ms=12.0, busy_ms=0.0))
    assert "BATCH_WAIT" in {d.code for d in diagnose(a, [formed])}


def test_queueing_counts_short_waits_and_needs_both_the_minimum_and_the_share():
    many = [cpu(f"w{i}", i, i + 0.8, kind="wait") for i in range(15)]  # 12 ms in 0.8 ms waits
    assert "QUEUEING" in run([*many, cpu("x", 15, 40)], total_ms=40)
    half = [cpu("q", 0, 5, kind="wait"), cpu("x", 5, 10)]  # 50 % of the request, but only 5 ms
    assert "QUEUEING" not in run(half, total_ms=10)


def test_queueing_names_the_wait_with_the_most_time_not_the_last_name():
    stages = [cpu("a.wait", 0, 30, kind="wait"), cpu("z.wait", 30, 42, kind="wait"), cpu("x", 42, 100)]
    assert run(stages)["QUEUEING"].stage == "a.wait"


def underfilled_trace(*, head_ms: float, gpu_ms: float, fill_items: int = 2, queued: float = 20.0, heads=None):
    wait = cpu("q", 0, 25, kind="wait", batch=BatchInfo("b", 2, fill_items, 0, 1, 16, formation_ms=5.0, busy_ms=queued))
    head = cpu("infer", 25, 25 + head_ms, batch=BatchInfo("b", 2, fill_items, 0, 1, 16, 1, 2))
    kernel = StageSample("fwd", "gpu", 25 * MS, 26 * MS, gpu_ms=gpu_ms, batch=BatchInfo("b", 2, fill_items, 0, 1, 16))
    return [wait, *(heads or [head]), kernel]


def test_batch_underfilled_thresholds_hold_exactly():
    th = DiagnosisThresholds()
    # queued exactly the queueing minimum: fires
    assert "BATCH_UNDERFILLED" in run(underfilled_trace(head_ms=10, gpu_ms=1, queued=th.queueing_ms))
    # GPU stages exactly half the batch's run: not underfilled by that test
    assert "BATCH_UNDERFILLED" not in run(underfilled_trace(head_ms=10, gpu_ms=5))
    # utilisation exactly at the starvation threshold is not low
    at = TraceSignals(gpu_utilization=th.gpu_starved_utilization)
    assert "BATCH_UNDERFILLED" not in run(underfilled_trace(head_ms=10, gpu_ms=8), signals=at)
    # a zero-length batch run: no GPU share to speak of, so it is the batcher's time that is wasted
    assert "BATCH_UNDERFILLED" in run(underfilled_trace(head_ms=0, gpu_ms=1))


def test_a_sub_millisecond_batch_run_has_a_gpu_share():
    assert "BATCH_UNDERFILLED" not in run(underfilled_trace(head_ms=0.5, gpu_ms=0.4))


def test_batch_underfilled_looks_past_a_head_that_does_not_qualify():
    full = cpu("full", 25, 35, batch=BatchInfo("f", 2, 16, 0, 1, 16, 1, 2))
    busy_gpu = cpu("gpu_bound", 25, 35, batch=BatchInfo("g", 2, 2, 0, 1, 16, 1, 3))
    kernel_g = StageSample("fwd", "gpu", 25 * MS, 35 * MS, gpu_ms=9.0, batch=BatchInfo("g", 2, 2, 0, 1, 16))
    idle = cpu("infer", 25, 35, batch=BatchInfo("b", 2, 2, 0, 1, 16, 1, 4))
    stages = [*underfilled_trace(head_ms=10, gpu_ms=1, heads=[full, busy_gpu, idle]), kernel_g]
    assert run(stages)["BATCH_UNDERFILLED"].stage == "infer"


def test_batch_underfilled_counts_only_measured_queueing():
    waits = [
        cpu(f"q{i}", i, i + 1, kind="wait", batch=BatchInfo("b", 2, 2, 0, 1, 16, formation_ms=1.0, busy_ms=None))
        for i in range(12)
    ]
    head = cpu("infer", 20, 30, batch=BatchInfo("b", 2, 2, 0, 1, 16, 1, 2))
    assert "BATCH_UNDERFILLED" not in run([*waits, head])


def test_untracked_time_exactly_at_both_thresholds_fires():
    th = DiagnosisThresholds()
    # 20 ms of a 40 ms request: the share (50 %) exactly, above the minimum
    assert "UNTRACKED_TIME" in run([cpu("a", 0, 20)], total_ms=40)
    # 10 ms (the minimum) of a 15 ms request
    assert th.untracked_min_ms == 10 and "UNTRACKED_TIME" in run([cpu("a", 0, 5)], total_ms=15)


def test_stages_after_the_response_are_left_out_of_every_rule():
    late = StageSample("cleanup", "cpu", 120 * MS, 180 * MS, on_event_loop=True)
    assert "EVENT_LOOP_BLOCKED" not in run([cpu("a", 0, 90), late])


def test_a_hand_built_analysis_is_judged_on_every_stage_it_is_given():
    a = analysis(100.0, {"q": 50.0, "w": 50.0})
    found = diagnose(a, [cpu("q", 0, 50, kind="wait"), cpu("w", 50, 100)])
    assert [d.code for d in found] == ["QUEUEING"]


def test_the_verdict_carries_its_trace_and_signals():
    a = analyse_trace(0, 10 * MS, [cpu("a", 0, 8)], 200)
    signals = TraceSignals(gpu_utilization=0.25, gil_pressure_ms=1.5, loop_lag_ms=7.0)
    v = build_verdict(trace_id="abc", root_name="r", analysis=a, diagnoses=(), signals=signals)
    assert (v.trace_id, v.root_name, v.sampled) == ("abc", "r", True)
    assert (v.gpu_utilization, v.gil_pressure_ms, v.loop_lag_ms) == (0.25, 1.5, 7.0)
    assert v.stage_kinds == {"a": "cpu"}
    bare = build_verdict(trace_id="abc", root_name="r", analysis=a, diagnoses=())
    assert (bare.gpu_utilization, bare.gil_pressure_ms, bare.loop_lag_ms) == (None, None, None)


def test_a_verdict_built_as_one_dict_is_the_frozen_dataclass_with_every_field_set():
    """build_verdict sets a verdict's fields as one dict (analysis/verdict.py): exactly the dataclass's fields,
    in their order (a field left out, misnamed or added fails here), the class's own equality, hash, frozenness
    and pickling intact, on both paths (tests/test_compiled.py runs the compiled one against the same traces)."""
    import dataclasses
    import pickle

    from stagetrace.analysis import Verdict

    a = analysis(10.0, {"a": 6.0}, untracked_ms=4.0, kinds={"a": "cpu"})
    v = build_verdict(trace_id="abc", root_name="r", analysis=a, diagnoses=(), route="/x")
    assert list(vars(v)) == [f.name for f in dataclasses.fields(Verdict)]
    fields = {f.name: getattr(v, f.name) for f in dataclasses.fields(Verdict)}
    assert v == Verdict(**fields) and type(v) is Verdict
    assert (v.total_ms, v.untracked_ms, v.route, v.process_cpus, v.stage_kinds) == (10.0, 4.0, "/x", None, {"a": "cpu"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.route = "/y"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.__dict__ = {}  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(v)) == v
    assert dataclasses.replace(v, route="/y").route == "/y" and v.route == "/x"


def test_a_diagnosis_found_by_the_rules_is_the_frozen_dataclass_with_every_field_set():
    """diagnose sets a diagnosis's fields as one dict (analysis/diagnosis.py): exactly its fields, in order."""
    import dataclasses
    import pickle

    from stagetrace.analysis import Diagnosis, diagnose

    a = analysis(100.0, {"a": 5.0}, untracked_ms=95.0, kinds={"a": "cpu"})
    (found,) = [d for d in diagnose(a, [cpu("a", 0, 5)]) if d.code == "UNTRACKED_TIME"]
    assert list(vars(found)) == [f.name for f in dataclasses.fields(Diagnosis)]
    assert found == Diagnosis(**vars(found)) and type(found) is Diagnosis
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.code = "X"  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(found)) == found


def test_a_shipped_batch_field_must_be_a_tuple_of_six_to_ten_values():
    from stagetrace.analysis.model import batch_info

    assert batch_info(("b", 2, 2, 0, 1, 8)) == BatchInfo("b", 2, 2, 0, 1, 8)
    assert batch_info(("b", 2, 2, 0, 1, 8, 1, 2, 3.0, 4.0)).busy_ms == 4.0
    for bad in (["b", 2, 2, 0, 1, 8, 1], ("b", 2, 2, 0, 1), ("b", 2, 2, 0, 1, 8, 1, 2, 3.0, 4.0, 5)):
        with pytest.raises(ValueError, match=r"^malformed batch field$"):
            batch_info(bad)


def test_a_copy_of_unknown_size_never_meets_a_size_threshold():
    unknown = StageSample("h2d", "h2d", 0, 5 * MS, gpu_ms=4.0, h2d_bytes=None, h2d_pinned=False)
    assert "PAGEABLE_H2D" not in run([unknown], thresholds=DiagnosisThresholds(pageable_min_bytes=1))


def test_batch_underfilled_names_the_gpu_share_when_utilisation_was_measured_but_not_low():
    found = run(underfilled_trace(head_ms=10, gpu_ms=1), signals=TraceSignals(gpu_utilization=0.8))
    assert found["BATCH_UNDERFILLED"].message.endswith("; GPU stages 10% of its run")


def test_the_verdict_carries_what_held_the_loop_and_whom_it_delayed():
    a = analyse_trace(0, 10 * MS, [cpu("a", 0, 8)], 200)
    signals = TraceSignals(blocked_by=("resize@t1",))
    v = build_verdict(trace_id="t", root_name="r", analysis=a, diagnoses=(), signals=signals, delayed_requests=3)
    assert (v.blocked_by, v.delayed_requests) == (("resize@t1",), 3)
    none = build_verdict(trace_id="t", root_name="r", analysis=a, diagnoses=(), signals=TraceSignals())
    assert (none.blocked_by, none.delayed_requests) == (None, None)


def test_a_stage_exactly_min_stage_ms_long_and_blocked_is_looked_at_and_one_a_hair_shorter_is_not():
    from stagetrace.analysis.causes import blocked_enough

    th = DiagnosisThresholds()  # min_stage_ms 5, blocked at least 5 ms and 25 % of the stage
    assert blocked_enough(cpu("tokenize", 0, th.min_stage_ms, blocked_ms=5.0), th)
    assert not blocked_enough(cpu("tokenize", 0, th.min_stage_ms - 0.001, blocked_ms=5.0), th)
    assert not blocked_enough(cpu("tokenize", 0, 20, blocked_ms=4.999), th)  # under blocked_min_ms
    assert not blocked_enough(cpu("tokenize", 0, 20, kind="io", blocked_ms=20.0), th)  # only CPU stages


def test_the_gil_holders_are_preempted_only_when_they_had_time_and_half_of_it_queued():
    from stagetrace.analysis.causes import holders_preempted

    th = DiagnosisThresholds()
    assert holders_preempted(cpu("s", 0, 10), th) is None  # not read
    assert holders_preempted(cpu("s", 0, 10, others_cpu_ms=0.0, others_runqueue_ms=0.0), th) is False  # no time
    assert holders_preempted(cpu("s", 0, 10, others_cpu_ms=0.0, others_runqueue_ms=0.5), th) is True  # half a ms
    assert holders_preempted(cpu("s", 0, 10, others_cpu_ms=5.0, others_runqueue_ms=5.0), th) is True  # exactly half
    assert holders_preempted(cpu("s", 0, 10, others_cpu_ms=5.0, others_runqueue_ms=4.9), th) is False


def test_a_batch_field_is_read_once_and_none_stays_none():
    from stagetrace.analysis.model import batch_info

    info = BatchInfo("ab" * 8, 3, 8, 0, 2, 16, formation_ms=1.5, busy_ms=0.5)
    assert batch_info(None) is None and batch_info(info) is info and batch_info(tuple(info)) == info
    with pytest.raises(ValueError, match=r"^malformed batch field$"):
        batch_info((1, 2))


def test_composites_cover_their_summed_occurrences_and_what_runs_under_them_is_not_counted_again():
    """A 100 ms root: a late stage (after the root: not covering it), decode 0-10 ms, a composite of 50 steps
    (30 ms summed, its host interval 10-90 ms) with a stage under it and one under that, post 90-95 ms, a
    second composite of 5 ms summed at 95-100 ms: covered = 10 + 5 (real) + 30 + 5 (folded), untracked 50 ms."""
    from stagetrace.analysis.model import CompressedInfo

    stages = [
        cpu("late", 120, 130),
        cpu("decode", 0, 10),
        cpu("step", 10, 90, span_id=7, compressed=CompressedInfo(50, 30 * MS, MS // 2, MS)),
        cpu("inner", 20, 25, span_id=8, parent_stage_id=7),
        cpu("inner.deeper", 21, 22, span_id=9, parent_stage_id=8),
        cpu("post", 90, 95),
        cpu("tok", 95, 100, span_id=10, compressed=CompressedInfo(5, 5 * MS, MS, MS)),
    ]
    a = analyse_trace(0, 100 * MS, stages, 200)
    assert a.untracked_ms == pytest.approx(50.0, abs=1e-9)
    wide = cpu("step", 10, 90, span_id=7, compressed=CompressedInfo(50, 95 * MS, MS, 3 * MS))
    more = [*stages[:2], wide, *stages[3:]]
    assert analyse_trace(0, 100 * MS, more, 200).untracked_ms == 0.0  # covered past the root: none untracked


def test_a_rule_summing_a_kind_of_time_reads_a_composite_s_occurrences():
    from stagetrace.analysis.model import CompressedInfo, occurrences_ms

    assert occurrences_ms(cpu("wait", 0, 4, compressed=CompressedInfo(9, 12_345_678, MS, 2 * MS))) == 12.345678
    assert occurrences_ms(cpu("wait", 0, 4)) == 4.0


@pytest.mark.parametrize(
    "signals",
    [TraceSignals(loop_lag_ms=500.0), TraceSignals(loop_held_ms=500.0, loop_lag_ms=500.0, blocked_by=("decode@1",))],
    ids=["lag", "held"],
)
def test_the_unreachable_thresholds_silence_the_event_loop_rule_by_lag_and_by_a_held_wait(signals):
    wait = cpu("event_loop.wait", 0, 90, kind="wait")
    assert run([wait, cpu("t", 90, 95)], signals=signals, thresholds=DiagnosisThresholds.silent()) == {}
    assert "EVENT_LOOP_BLOCKED" in run([wait, cpu("t", 90, 95)], signals=signals)


def test_the_share_of_a_stage_s_time_off_cpu_spent_queued_for_one():
    from stagetrace.analysis.causes import queued_share

    assert queued_share(cpu("s", 0, 10)) == 0.0  # neither read: no time off the CPU, no share (not 0 / 0)
    assert queued_share(cpu("s", 0, 10, runqueue_ms=3.0)) == 1.0
    assert queued_share(cpu("s", 0, 10, blocked_ms=4.0)) == 0.0
    assert queued_share(cpu("s", 0, 10, runqueue_ms=1.0, blocked_ms=3.0)) == 0.25
    assert queued_share(cpu("s", 0, 10, runqueue_ms=0.25, blocked_ms=0.25)) == 0.5  # under a millisecond off it


def test_a_host_short_of_cpus_and_one_with_cpus_to_spare_at_their_edges():
    from stagetrace.analysis.causes import cpus_to_spare, queued_for_cpu, short_of_cpus

    th = DiagnosisThresholds()
    at_quiet = cpu("s", 0, 20, runqueue_ms=1.0, blocked_ms=9.0)  # 1 ms queued: the minimum, 10 % of its time off
    assert short_of_cpus([at_quiet], TraceSignals(), th) and not cpus_to_spare(at_quiet, TraceSignals(), th)
    under = cpu("s", 0, 20, runqueue_ms=0.99, blocked_ms=8.91)  # 10 % still, under the 1 ms minimum
    assert not short_of_cpus([under], TraceSignals(), th)
    quiet = cpu("s", 0, 20, runqueue_ms=1.0, blocked_ms=9.1)  # just under 10 %
    assert not short_of_cpus([quiet], TraceSignals(), th) and cpus_to_spare(quiet, TraceSignals(), th)
    pressed = TraceSignals(cpu_pressure_ms=1.0)  # the GIL monitor's wake-ups waited 1 ms for a CPU: the edge
    assert short_of_cpus([], pressed, th) and not cpus_to_spare(quiet, pressed, th)
    assert cpus_to_spare(quiet, TraceSignals(cpu_pressure_ms=0.99), th)
    assert queued_for_cpu(cpu("s", 0, 20, runqueue_ms=1.0, blocked_ms=3.0), th)  # 1 ms and 25 %: both edges
    assert not queued_for_cpu(cpu("s", 0, 20, runqueue_ms=1.0, blocked_ms=3.01), th)
    assert not queued_for_cpu(cpu("s", 0, 20, runqueue_ms=0.99, blocked_ms=2.97), th)


def test_the_gil_explainable_part_of_a_stage_s_blocked_time():
    from stagetrace.analysis.causes import blocked_ms, gil_explainable_ms

    assert gil_explainable_ms(cpu("s", 0, 20, blocked_ms=10.0, not_gil_ms=4.0)) == 6.0  # all but the proven
    assert gil_explainable_ms(cpu("s", 0, 20)) == 0.0
    # at most the other threads' time on a CPU (2 ms) and queued for one (unread: none)
    assert gil_explainable_ms(cpu("s", 0, 20, blocked_ms=10.0, others_cpu_ms=2.0)) == 2.0
    assert gil_explainable_ms(cpu("s", 0, 20, blocked_ms=10.0, others_cpu_ms=2.0, others_runqueue_ms=1.5)) == 3.5
    assert blocked_ms(cpu("s", 0, 20)) == 0.0 and blocked_ms(cpu("s", 0, 20, blocked_ms=2.5)) == 2.5


def test_a_stage_whose_parent_is_missing_or_in_a_cycle_is_covered_as_a_real_stage():
    """Beside a composite (10 ms summed), a stage whose parent stage is not in the trace (an orphan, 0-20 ms)
    and two that name each other as parents (a malformed trace, 30-40 ms): neither is under the composite."""
    from stagetrace.analysis.model import CompressedInfo

    stages = [
        cpu("step", 50, 90, span_id=7, compressed=CompressedInfo(20, 10 * MS, MS // 2, MS)),
        cpu("orphan", 0, 20, span_id=8, parent_stage_id=999),
        cpu("a", 30, 40, span_id=9, parent_stage_id=10),
        cpu("b", 30, 40, span_id=10, parent_stage_id=9),
    ]
    assert analyse_trace(0, 100 * MS, stages, 200).untracked_ms == pytest.approx(100 - 20 - 10 - 10, abs=1e-9)
