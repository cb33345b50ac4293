"""What each rule says, word for word, and which stage it names when several qualify: the message is what
a user reads in Jaeger and in the log line, so its numbers and its choice of stage are part of the rule."""

from __future__ import annotations

from stagetrace.analysis import BatchInfo, StageSample, TraceSignals
from test_diagnosis import MS, cpu, run


def only(found: dict, code: str):
    d = found[code]
    return d.message, d.stage


def test_pageable_h2d_names_the_largest_copy_and_counts_them():
    stages = [
        StageSample("h2d_a", "h2d", 0, 2 * MS, gpu_ms=2, h2d_bytes=1 << 20, h2d_pinned=False),
        StageSample("h2d_b", "h2d", 2 * MS, 6 * MS, gpu_ms=4, h2d_bytes=4 << 20, h2d_pinned=False),
        StageSample("h2d_c", "h2d", 6 * MS, 7 * MS, gpu_ms=1, h2d_bytes=8 << 20, h2d_pinned=True),
        StageSample("h2d_d", "h2d", 7 * MS, 8 * MS, gpu_ms=1, h2d_bytes=None, h2d_pinned=False),  # size unknown
    ]
    assert only(run(stages), "PAGEABLE_H2D") == (
        "2 host-to-device copies from pageable memory (4.0 MiB in 'h2d_b')",
        "h2d_b",
    )
    assert only(run(stages[:1]), "PAGEABLE_H2D") == (
        "1 host-to-device copy from pageable memory (1.0 MiB in 'h2d_a')",
        "h2d_a",
    )


def test_queueing_sums_the_waits_and_names_the_longest():
    stages = [cpu("a.wait", 0, 15, kind="wait"), cpu("b.wait", 15, 40, kind="wait"), cpu("work", 40, 100)]
    assert only(run(stages), "QUEUEING") == ("the request queued 40.0 ms (40%) in a.wait, b.wait", "b.wait")


def test_queueing_exactly_at_its_thresholds_fires():
    # 10 ms (the minimum) and 20 % (the share) exactly
    found = run([cpu("q", 0, 10, kind="wait"), cpu("w", 10, 50)], total_ms=50)
    assert only(found, "QUEUEING") == ("the request queued 10.0 ms (20%) in q", "q")


def test_a_batch_wait_with_nothing_behind_the_previous_batch_is_not_a_queue():
    formed = BatchInfo("b", 2, 2, 0, 1, 8, formation_ms=30.0, busy_ms=0.0)
    stages = [
        cpu("infer.queue", 0, 30, kind="wait", batch=formed),
        cpu("t.wait", 30, 55, kind="wait"),
        cpu("w", 55, 100),
    ]
    assert only(run(stages), "QUEUEING") == ("the request queued 25.0 ms (25%) in t.wait", "t.wait")


def test_batch_wait_sums_formation_and_names_the_longest():
    common = ("b1", 3, 8, 0, 1, 16)
    stages = [
        cpu("q1", 0, 30, kind="wait", batch=BatchInfo(*common, formation_ms=30.0, busy_ms=0.0)),
        cpu("q2", 30, 50, kind="wait", batch=BatchInfo(*common, formation_ms=20.0, busy_ms=0.0)),
        cpu("w", 50, 100),
    ]
    assert only(run(stages), "BATCH_WAIT") == (
        "the request waited 50.0 ms (50%) in 'q1' for its batch to form (it ran with 8 of 16 items)",
        "q1",
    )
    assert only(run([stages[1], stages[0], stages[2]]), "BATCH_WAIT")[1] == "q1"  # wherever it is listed
    unsized = [cpu("q", 0, 60, kind="wait", batch=BatchInfo("b", 1, 3, 0, 1, 0, formation_ms=60.0, busy_ms=0.0))]
    assert only(run(unsized), "BATCH_WAIT")[0].endswith("(it ran with 3 items)")


def test_batch_wait_exactly_at_its_thresholds_fires():
    at_share = [cpu("q", 0, 40, kind="wait", batch=BatchInfo("b", 1, 1, 0, 1, 4, formation_ms=40.0, busy_ms=0.0))]
    assert "BATCH_WAIT" in run(at_share)
    at_min = [cpu("q", 0, 10, kind="wait", batch=BatchInfo("b", 1, 1, 0, 1, 4, formation_ms=10.0, busy_ms=0.0))]
    assert "BATCH_WAIT" in run(at_min, total_ms=20)


def test_cpu_side_rules_name_the_worst_stage():
    two = [
        cpu("small", 0, 40, cpu_ms=5, blocked_ms=20, runqueue_ms=15),
        cpu("big", 40, 100, cpu_ms=5, blocked_ms=50, runqueue_ms=30),
    ]
    gil = run(two, signals=TraceSignals(gil_pressure_ms=6.25))
    assert only(gil, "GIL_CONTENTION") == (
        "'big' was blocked 50.0 ms of its 60.0 ms while the GIL was contended (sampler wake-up lag 6.2 ms)",
        "big",
    )
    lock = run(two, signals=TraceSignals(gil_pressure_ms=0.5))
    assert only(lock, "LOCK_OR_IO_WAIT") == (
        "'big' was off-CPU 50.0 ms of its 60.0 ms with the GIL free: a lock, queue or I/O wait",
        "big",
    )
    assert only(lock, "CPU_OVERSUBSCRIBED") == ("'big' waited 30.0 ms of its 60.0 ms for a CPU (run queue)", "big")


def test_event_loop_blocked_names_the_longest_sync_stage_or_the_lag():
    stages = [cpu("parse", 0, 25, on_event_loop=True), cpu("decode", 25, 65, on_event_loop=True)]
    assert only(run(stages), "EVENT_LOOP_BLOCKED") == (
        "sync stage 'decode' ran 40.0 ms on the event-loop thread",
        "decode",
    )
    lag = run([cpu("d", 0, 90)], signals=TraceSignals(loop_lag_ms=73.25))
    assert only(lag, "EVENT_LOOP_BLOCKED") == ("event-loop lag reached 73.2 ms during the request", None)


def test_gpu_starved_and_untracked_messages():
    starved = run(
        [cpu("decode", 0, 70), StageSample("infer", "gpu", 70 * MS, 80 * MS, gpu_ms=10)],
        signals=TraceSignals(gpu_utilization=0.12),
    )
    assert only(starved, "GPU_STARVED") == (
        "GPU utilisation was 12% while CPU-side stages held 70% of the 100.0 ms request",
        "decode",
    )
    gpu_bound = run(
        [cpu("decode", 0, 20), StageSample("infer", "gpu", 20 * MS, 25 * MS, gpu_ms=10), cpu("post", 25, 90)],
        signals=TraceSignals(gpu_utilization=0.1),
    )
    assert gpu_bound["GPU_STARVED"].stage == "post"  # the bottleneck, when it is CPU-side
    gpu_heavy = run(
        [cpu("decode", 0, 55), StageSample("infer", "gpu", 55 * MS, 60 * MS, gpu_ms=40)],
        signals=TraceSignals(gpu_utilization=0.1),
    )
    assert gpu_heavy["GPU_STARVED"].stage == "decode"
    untracked = run([cpu("decode", 0, 30)])
    assert only(untracked, "UNTRACKED_TIME") == ("70.0 ms (70%) of the request is in no stage", None)


def test_batch_underfilled_message():
    common = ("b1", 3, 2, 0, 1, 16)
    stages = [
        cpu("infer.queue", 0, 35, kind="wait", batch=BatchInfo(*common, formation_ms=5.0, busy_ms=30.0)),
        cpu("infer", 35, 75, span_id=7, batch=BatchInfo(*common, link_trace_id=5, link_span_id=6)),
        cpu("forward", 36, 74, kind="gpu", gpu_ms=8, parent_stage_id=7, batch=BatchInfo(*common)),
        cpu("post", 75, 100),
    ]
    assert only(run(stages), "BATCH_UNDERFILLED") == (
        "batch 'infer' ran 2 of 16 items (12%) while the request queued 30.0 ms behind the previous batch; "
        "GPU stages 20% of its run",
        "infer",
    )
    idle = run(stages, signals=TraceSignals(gpu_utilization=0.05))
    assert idle["BATCH_UNDERFILLED"].message.endswith("; GPU utilisation 5%")


def test_event_loop_blocked_on_a_request_that_waited_names_what_held_its_loop():
    waits = [cpu("event_loop.wait", 0, 10, kind="wait"), cpu("event_loop.wait", 40, 60, kind="wait")]
    held = TraceSignals(blocked_by=("resize@" + "a" * 32, "decode@" + "b" * 32))
    found = run([*waits, cpu("work", 60, 100)], signals=held)
    assert only(found, "EVENT_LOOP_BLOCKED") == (
        "the request waited 30.0 ms (30%) for the event loop while other requests' sync stages held it: "
        f"'resize' of trace {'a' * 32} and 1 more",
        "event_loop.wait",
    )
    assert "QUEUEING" not in found  # no worker pool to grow: the loop wait is not a queue


def test_event_loop_blocked_names_the_requests_own_stage_when_it_held_the_loop_longer_than_it_waited():
    stages = [
        cpu("event_loop.wait", 0, 30, kind="wait"),
        cpu("resize", 30, 70, on_event_loop=True),
        cpu("post", 70, 100),
    ]
    assert only(run(stages), "EVENT_LOOP_BLOCKED") == (
        "sync stage 'resize' ran 40.0 ms on the event-loop thread",
        "resize",
    )


def test_an_event_loop_wait_fires_from_its_minimum_and_share():
    def waited(wait_ms, total_ms):
        stages = [cpu("event_loop.wait", 0, wait_ms, kind="wait"), cpu("w", wait_ms, total_ms)]
        return "EVENT_LOOP_BLOCKED" in run(stages, total_ms=total_ms)

    assert waited(20, 100) and not waited(19.9, 99.5)  # 20 ms, 20 %
    assert not waited(25, 200)  # 12.5 % of the request


def test_the_loop_wait_message_names_a_single_blocker_whole_even_with_spaces_in_its_name():
    waits = [cpu("event_loop.wait", 0, 30, kind="wait"), cpu("work", 30, 100)]
    one = run(waits, signals=TraceSignals(blocked_by=("resize image@" + "c" * 32,)))
    assert one["EVENT_LOOP_BLOCKED"].message.endswith(f"held it: 'resize image' of trace {'c' * 32}")
    unnamed = run(waits)  # blockers not known: the wait is still measured
    assert unnamed["EVENT_LOOP_BLOCKED"].message.endswith("while other requests' sync stages held it")


def test_a_wait_as_long_as_the_requests_own_blocking_stage_names_its_own_stage():
    stages = [
        cpu("event_loop.wait", 0, 30, kind="wait"),
        cpu("resize", 30, 60, on_event_loop=True),
        cpu("post", 60, 100),
    ]
    assert only(run(stages), "EVENT_LOOP_BLOCKED")[1] == "resize"


def test_the_loop_wait_rule_on_zero_and_sub_millisecond_totals():
    from stagetrace.analysis import TraceAnalysis, diagnose

    def analysis(total_ms):
        return TraceAnalysis(total_ms, {"event_loop.wait": 25.0}, "event_loop.wait", 1.0, False, 200.0, 0.0)

    wait = [cpu("event_loop.wait", 0, 25, kind="wait")]
    assert diagnose(analysis(0.0), wait) == ()
    (d,) = diagnose(analysis(0.5), wait)  # a wait that overran a sub-millisecond root still counts
    assert d.stage == "event_loop.wait"


def test_between_a_free_and_a_contended_gil_the_blocked_stage_is_not_given_a_cause():
    blocked = [cpu("t", 0, 50, cpu_ms=10, blocked_ms=40)]
    for pressure in (1.0, 1.25, 1.49):
        found = run(blocked, signals=TraceSignals(gil_pressure_ms=pressure))
        assert "GIL_CONTENTION" not in found and "LOCK_OR_IO_WAIT" not in found, pressure
    assert "LOCK_OR_IO_WAIT" in run(blocked, signals=TraceSignals(gil_pressure_ms=0.99))
