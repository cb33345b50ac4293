"""What each rule says, word for word, and which stage it names when several qualify: the message is what
a user reads in Jaeger and in the log line, so its numbers and its choice of stage are part of the rule."""

from __future__ import annotations

from trace_builders import MS, cpu, run

from stagetrace.analysis import BatchInfo, StageSample, TraceSignals
from stagetrace.analysis.signals import ProcessLoad


def only(found: dict, code: str):
    d = found[code]
    return d.message, d.stage


def evidence(found: dict, code: str) -> str | None:
    return found[code].evidence


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
        cpu("small", 0, 40, cpu_ms=18, blocked_ms=20, runqueue_ms=2),
        cpu("big", 40, 100, cpu_ms=7, blocked_ms=50, runqueue_ms=3),
    ]
    gil = run(two, signals=TraceSignals(gil_pressure_ms=6.25))
    assert only(gil, "GIL_CONTENTION") == (
        "'big' was blocked 50.0 ms of its 60.0 ms while the GIL was contended (GIL monitor wake-up lag 6.2 ms)",
        "big",
    )
    lock = run(two, signals=TraceSignals(gil_pressure_ms=0.25))  # no slice counts: the GIL measured free decides
    assert only(lock, "LOCK_OR_IO_WAIT") == (
        "'big' was off-CPU 50.0 ms of its 60.0 ms: a lock, queue or I/O wait",
        "big",
    )
    assert evidence(lock, "LOCK_OR_IO_WAIT") == "the GIL was free meanwhile (GIL monitor wake-up lag 0.2 ms)"
    crowded = [cpu("small", 0, 40, cpu_ms=25, runqueue_ms=15), cpu("big", 40, 100, cpu_ms=30, runqueue_ms=30)]
    assert only(run(crowded), "CPU_OVERSUBSCRIBED") == (
        "'big' waited 30.0 ms of its 60.0 ms for a CPU (run queue)",
        "big",
    )


def test_a_wait_proven_longer_than_any_gil_wait_is_a_lock_wait_whatever_the_sampler_says():
    lookup = [cpu("lookup", 0, 20, cpu_ms=1, blocked_ms=15, not_gil_ms=9.5)]
    for signals in (TraceSignals(), TraceSignals(gil_pressure_ms=1.2), TraceSignals(gil_pressure_ms=6.0)):
        found = run(lookup, total_ms=25, signals=signals)
        assert only(found, "LOCK_OR_IO_WAIT") == (
            "'lookup' was off-CPU 15.0 ms of its 20.0 ms: a lock, queue or I/O wait",
            "lookup",
        )
        assert (
            evidence(found, "LOCK_OR_IO_WAIT") == "at least 9.5 ms of it in waits longer than a wait for the GIL lasts"
        )
        assert "GIL_CONTENTION" not in found and "OFF_CPU_WAIT" not in found  # one cause per stage: the proven one
    # One cause per stage: the proven one. The rest of its blocked time may or may not have been the GIL.
    mixed = [cpu("parse", 0, 50, cpu_ms=10, blocked_ms=40, not_gil_ms=20)]
    found = run(mixed, signals=TraceSignals(gil_pressure_ms=6.0))
    assert "LOCK_OR_IO_WAIT" in found and "GIL_CONTENTION" not in found
    beside = [*mixed, cpu("tokenize", 50, 100, cpu_ms=20, blocked_ms=30, not_gil_ms=0.0)]
    found = run(beside, signals=TraceSignals(gil_pressure_ms=6.0))
    assert found["LOCK_OR_IO_WAIT"].stage == "parse" and found["GIL_CONTENTION"].stage == "tokenize"


def test_blocked_time_beside_a_free_gil_is_a_lock_wait_even_on_a_host_short_of_cpus():
    """A holder the scheduler preempted keeps the GIL, so the sampler's wake-ups would wait for it too: with
    them finding the GIL free, the blocked time was not behind a GIL holder, however short of CPUs the host
    was (measured: a lock held across zlib work, two requests at a time, the stage's own run-queue wait 25-40 %
    of its time off the CPU, was named CPU_OVERSUBSCRIBED on most requests). The stage's own wait for a CPU
    is named on its own when it is long."""
    quiet = [cpu("lookup", 0, 32, cpu_ms=21.8, blocked_ms=10, runqueue_ms=0.2, not_gil_ms=0.0)]
    found = run(quiet, total_ms=34, signals=TraceSignals(gil_pressure_ms=0.1))
    assert set(found) == {"LOCK_OR_IO_WAIT"}
    assert found["LOCK_OR_IO_WAIT"].message.endswith("off-CPU 10.0 ms of its 32.0 ms: a lock, queue or I/O wait")
    assert evidence(found, "LOCK_OR_IO_WAIT") == "the GIL was free meanwhile (GIL monitor wake-up lag 0.1 ms)"
    crowded = [cpu("compress", 0, 32, cpu_ms=18, blocked_ms=10, runqueue_ms=4, not_gil_ms=0.0)]
    assert set(run(crowded, total_ms=34, signals=TraceSignals(gil_pressure_ms=0.1))) == {"LOCK_OR_IO_WAIT"}
    long_wait = [cpu("compress", 0, 32, cpu_ms=2, blocked_ms=24, runqueue_ms=6, not_gil_ms=18.5)]
    found = run(long_wait, total_ms=34, signals=TraceSignals(gil_pressure_ms=0.1))
    assert set(found) == {"LOCK_OR_IO_WAIT"}
    assert evidence(found, "LOCK_OR_IO_WAIT") == "at least 18.5 ms of it in waits longer than a wait for the GIL lasts"
    # ... and a long wait for a CPU of its own is named beside it
    queued = [cpu("compress", 0, 32, cpu_ms=5, blocked_ms=14, runqueue_ms=13, not_gil_ms=0.0)]
    assert set(run(queued, total_ms=34, signals=TraceSignals(gil_pressure_ms=0.1))) == {
        "LOCK_OR_IO_WAIT",
        "CPU_OVERSUBSCRIBED",
    }
    # without a free GIL's reading, a long wait on a host short of CPUs stays undetermined (a lock, or a GIL
    # handoff to a thread stuck in the run queue)
    unknown = run(long_wait, total_ms=34, signals=TraceSignals(gil_pressure_ms=0.7))
    assert set(unknown) == {"OFF_CPU_WAIT"}


def test_short_waits_beside_a_free_gil_while_its_would_be_holders_queued_name_no_cause():
    """The GIL monitor samples the GIL every few ms and misses holders that take it briefly (threads compressing
    with zlib, each between two calls). When the process's other threads spent at least half their time in the
    run queue, such holders preempted explain short waits as well as a lock does (measured: 8 requests
    compressing beside 4 threads compressing on 2 CPUs, the GIL monitor reading 0.06-0.3 ms, named
    LOCK_OR_IO_WAIT on 8 of 48 requests while the other threads queued 250 ms beside 70-95 ms on a CPU)."""
    crowded = cpu("compress", 0, 32, cpu_ms=18, blocked_ms=10, runqueue_ms=4, not_gil_ms=0.0)
    free = TraceSignals(gil_pressure_ms=0.1)
    crowded.others_cpu_ms, crowded.others_runqueue_ms = 68.0, 258.0
    found = run([crowded], total_ms=34, signals=free)
    assert set(found) == {"OFF_CPU_WAIT"}
    assert evidence(found, "OFF_CPU_WAIT") == (
        "the host was short of CPUs meanwhile (its own run-queue wait 4.0 ms), and there a wait can be for a GIL "
        "holder the scheduler preempted: the process's other threads, the GIL's would-be holders, waited 258.0 ms "
        "for a CPU beside 68.0 ms on one"
    )
    crowded.others_cpu_ms, crowded.others_runqueue_ms = 60.0, 59.0  # just under half their time queued
    assert set(run([crowded], total_ms=34, signals=free)) == {"LOCK_OR_IO_WAIT"}
    # waits longer than any wait for the GIL are a lock's, however the other threads fared
    long_wait = cpu("compress", 0, 32, cpu_ms=2, blocked_ms=24, runqueue_ms=6, not_gil_ms=18.5)
    long_wait.others_cpu_ms, long_wait.others_runqueue_ms = 68.0, 258.0
    assert set(run([long_wait], total_ms=34, signals=free)) == {"LOCK_OR_IO_WAIT"}


def test_gil_waits_the_other_threads_run_queue_cannot_explain_are_gil_contention_on_a_crowded_host():
    """Every wait on a preempted GIL holder (or on the GIL handed to a thread still queued for a CPU) is
    run-queue time of another thread of the process: when the blocked time less all of theirs meanwhile
    still matters, the host's shortage does not explain it."""
    stage = cpu("tokenize", 0, 40, cpu_ms=11, blocked_ms=20, runqueue_ms=2.5, not_gil_ms=0.0)
    signals = TraceSignals(gil_pressure_ms=3.7, cpu_pressure_ms=0.2)  # contended, under a whole interval
    assert set(run([stage], total_ms=42, signals=signals)) == {"OFF_CPU_WAIT"}  # not told: could be preemption
    stage.others_runqueue_ms = 4.0  # at most 4 ms of the 20 behind preempted threads
    found = run([stage], total_ms=42, signals=signals)
    assert set(found) == {"GIL_CONTENTION"}
    assert found["GIL_CONTENTION"].stage == "tokenize"
    stage.others_runqueue_ms = 16.0  # preemption could account for all but 4 ms: no cause named from that
    assert set(run([stage], total_ms=42, signals=signals)) == {"OFF_CPU_WAIT"}


def test_blocked_time_longer_than_the_other_threads_ran_is_not_gil_contention():
    """Only a thread on a CPU or queued for one holds the GIL, so a stage cannot have waited for it longer than
    the process's other threads spent there. A stage of pure Python alone in its process keeps the GIL busy
    itself (the GIL monitor waits on it: pressure of most of a switch interval); a hypervisor taking its CPU
    leaves it blocked with no run queue to show (CI named GIL_CONTENTION on a healthy twin's 100 ms stage,
    most likely so)."""
    stage = cpu("tokenize", 0, 100, cpu_ms=72, blocked_ms=27, runqueue_ms=1, not_gil_ms=0.0)
    contended = TraceSignals(gil_pressure_ms=4.6, cpu_pressure_ms=0.2)
    assert set(run([stage], total_ms=102, signals=contended)) == {"GIL_CONTENTION"}  # not measured: as before
    stage.others_cpu_ms, stage.others_runqueue_ms = 3.0, 0.5
    found = run([stage], total_ms=102, signals=contended)
    assert set(found) == {"OFF_CPU_WAIT"}
    assert only(found, "OFF_CPU_WAIT") == (
        "'tokenize' was off-CPU 27.0 ms of its 100.0 ms, for the GIL or for a lock or I/O; the signals cannot "
        "tell which",
        "tokenize",
    )
    assert evidence(found, "OFF_CPU_WAIT") == (
        "at most 3.5 ms of it was for the GIL (the process's other threads ran 3.0 ms and waited 0.5 ms for a CPU "
        "meanwhile, the only time one of them can hold it), and the rest was a lock or I/O, or the hypervisor of a "
        "virtual machine taking the CPU, which no run queue shows"
    )
    # a host short of CPUs, where the GIL monitor's long waits would otherwise name the GIL
    held = TraceSignals(gil_pressure_ms=8.0, cpu_pressure_ms=1.5)
    assert "GIL_CONTENTION" not in run([stage], total_ms=102, signals=held)
    # a thread beside it that ran as long as the stage waited: contention it is, counted up to their time
    stage.others_cpu_ms = 26.0
    found = run([stage], total_ms=102, signals=contended)
    assert set(found) == {"GIL_CONTENTION"}
    assert only(found, "GIL_CONTENTION")[0].startswith("'tokenize' was blocked 26.5 ms of its 100.0 ms")


def test_gil_waits_on_a_stage_that_also_waited_for_a_cpu_are_the_oversubscriptions():
    stage = [cpu("compress", 0, 31, cpu_ms=9, blocked_ms=12, runqueue_ms=10, not_gil_ms=0.0)]
    found = run(stage, total_ms=40, signals=TraceSignals(gil_pressure_ms=2.1))
    assert set(found) == {"CPU_OVERSUBSCRIBED"}
    assert only(found, "CPU_OVERSUBSCRIBED") == (
        "'compress' waited 10.0 ms of its 31.0 ms for a CPU (run queue), and 12.0 ms more for GIL holders the "
        "scheduler preempted",
        "compress",
    )
    assert evidence(found, "CPU_OVERSUBSCRIBED") == (
        "its off-CPU waits were as short as GIL handoffs, and a GIL holder preempted by the scheduler keeps the "
        "other threads waiting"
    )
    queued_only = [cpu("compress", 0, 31, cpu_ms=19, blocked_ms=2, runqueue_ms=10, not_gil_ms=0.0)]
    assert only(run(queued_only, total_ms=40), "CPU_OVERSUBSCRIBED")[0].endswith("for a CPU (run queue)")


def test_gil_waits_while_the_host_was_out_of_cpus_are_the_oversubscriptions_too():
    """The stage itself barely queued for a CPU, but the sampler's wake-ups did: its GIL holders were being
    preempted, so its GIL-like waits are named CPU_OVERSUBSCRIBED, not GIL contention."""
    stage = [cpu("compress", 0, 31, cpu_ms=11.5, blocked_ms=19, runqueue_ms=0.5, not_gil_ms=0.0)]
    starved = TraceSignals(gil_pressure_ms=2.0, cpu_pressure_ms=3.5)
    found = run(stage, total_ms=40, signals=starved)
    assert set(found) == {"CPU_OVERSUBSCRIBED"}
    assert only(found, "CPU_OVERSUBSCRIBED") == (
        "'compress' waited 0.5 ms of its 31.0 ms for a CPU (run queue), and 19.0 ms more for GIL holders the "
        "scheduler preempted",
        "compress",
    )
    assert evidence(found, "CPU_OVERSUBSCRIBED") == (
        "its off-CPU waits were as short as GIL handoffs, and a GIL holder preempted by the scheduler keeps the "
        "other threads waiting; the process's woken threads waited 3.5 ms on average for a CPU"
    )
    spare = TraceSignals(gil_pressure_ms=2.0, cpu_pressure_ms=0.99)  # CPUs to spare: the GIL it is
    assert set(run(stage, total_ms=40, signals=spare)) == {"GIL_CONTENTION"}
    # GIL waits of most of a switch interval, far longer than the waits for a CPU: holders running Python
    held = TraceSignals(gil_pressure_ms=8.0, cpu_pressure_ms=3.5)
    assert set(run(stage, total_ms=40, signals=held)) == {"GIL_CONTENTION"}
    # ... unless the stage's own wake-ups queued for a CPU too: its waits are the oversubscription's
    queued = [cpu("compress", 0, 31, cpu_ms=6, blocked_ms=15, runqueue_ms=10, not_gil_ms=0.0)]
    assert set(run(queued, total_ms=40, signals=held)) == {"CPU_OVERSUBSCRIBED"}
    # ... even when its GIL waits dwarf the sampler's waits for a CPU: the scheduler favours the sleeping
    # sampler, so its queueing understates the host's; the oversubscription is named first
    dwarfed = TraceSignals(gil_pressure_ms=20.0, cpu_pressure_ms=1.0)
    near = TraceSignals(gil_pressure_ms=3.8, cpu_pressure_ms=2.2)  # long, but under twice the wait for a CPU
    assert set(run(queued, total_ms=40, signals=dwarfed)) == {"CPU_OVERSUBSCRIBED"}
    # ... unless the process's other threads, the would-be holders, mostly ran meanwhile: holders running
    # Python through their intervals (measured: two 20 ms pure-Python requests at a time beside a thread
    # spinning in Python, one of 150 named CPU_OVERSUBSCRIBED with these figures)
    pair = cpu("tokenize", 0, 34.5, cpu_ms=20, blocked_ms=10.5, runqueue_ms=3.9, not_gil_ms=0.0)
    measured = TraceSignals(gil_pressure_ms=26.0, cpu_pressure_ms=0.65)
    assert set(run([pair], total_ms=36, signals=measured)) == {"CPU_OVERSUBSCRIBED"}  # not read: as before
    pair.others_cpu_ms, pair.others_runqueue_ms = 78.3, 10.0
    found = run([pair], total_ms=36, signals=measured)
    assert set(found) == {"GIL_CONTENTION"}
    assert found["GIL_CONTENTION"].message.startswith("'tokenize' was blocked 10.5 ms of its 34.5 ms")
    assert set(run([pair], total_ms=36, signals=near)) == {"CPU_OVERSUBSCRIBED"}  # not whole intervals
    pair.others_runqueue_ms = 78.3  # half their time queued: preempted holders
    assert set(run([pair], total_ms=36, signals=measured)) == {"CPU_OVERSUBSCRIBED"}
    # Only the GIL monitor's wake-ups waited for a CPU, the stage barely did, and its other threads mostly ran:
    # no holder was preempted for long, and a GIL reading between free and contended tells nothing (measured:
    # a lock held across zlib work, 22.3 ms blocked, the GIL monitor at 0.67 ms and 2.6 ms for a CPU, the other
    # threads queued 26 ms beside 79 ms on a CPU, was named CPU_OVERSUBSCRIBED)
    pack = cpu("pack", 0, 35.8, cpu_ms=13.1, blocked_ms=22.3, runqueue_ms=0.3, not_gil_ms=0.0)
    between = TraceSignals(gil_pressure_ms=0.67, cpu_pressure_ms=2.56)
    assert set(run([pack], total_ms=43, signals=between)) == {"CPU_OVERSUBSCRIBED"}  # not read: as before
    pack.others_cpu_ms, pack.others_runqueue_ms = 79.4, 26.0
    assert set(run([pack], total_ms=43, signals=between)) == {"OFF_CPU_WAIT"}
    pack.others_runqueue_ms = 80.0
    assert set(run([pack], total_ms=43, signals=between)) == {"CPU_OVERSUBSCRIBED"}
    assert set(run(stage, total_ms=40, signals=near)) == {"CPU_OVERSUBSCRIBED"}


def test_a_loop_stall_while_the_process_was_starved_is_not_blamed_on_work_on_the_loop():
    stage = [cpu("d", 0, 90)]
    # what work on the loop's own thread explains of the stall decides, where it was measured
    held = run(stage, signals=TraceSignals(loop_lag_ms=73.25, loop_held_ms=61.5, gil_pressure_ms=9.0))
    assert only(held, "EVENT_LOOP_BLOCKED") == (
        "work on the event-loop thread held the loop 61.5 ms during the request (lag 73.2 ms)",
        None,
    )
    starved = TraceSignals(loop_lag_ms=73.25, loop_held_ms=12.0)  # the thread waited for the GIL or a CPU
    assert "EVENT_LOOP_BLOCKED" not in run(stage, signals=starved)
    # without that measurement, a stall on a host short of CPUs is not blamed on the loop either
    assert "EVENT_LOOP_BLOCKED" in run(stage, signals=TraceSignals(loop_lag_ms=73.25, gil_pressure_ms=0.2))
    short = TraceSignals(loop_lag_ms=73.25, cpu_pressure_ms=1.0)
    assert "EVENT_LOOP_BLOCKED" not in run(stage, signals=short)
    queued = [cpu("d", 0, 90, cpu_ms=50, runqueue_ms=30)]  # the request's own stage waited for a CPU
    assert "EVENT_LOOP_BLOCKED" not in run(queued, signals=TraceSignals(loop_lag_ms=73.25, gil_pressure_ms=0.2))
    own = [cpu("d", 0, 90, on_event_loop=True)]  # a sync stage of its own on the loop is named all the same
    assert "EVENT_LOOP_BLOCKED" in run(own, signals=starved)


def test_on_a_host_a_little_short_of_cpus_only_whole_interval_gil_waits_name_the_gil():
    """The stage queued a little (15 % of its time off the CPU): GIL waits of a whole switch interval are
    holders running Python; shorter ones may be holders the scheduler preempted, and no cause is named."""
    stage = [cpu("compress", 0, 41, cpu_ms=2.5, blocked_ms=33, runqueue_ms=5.5, not_gil_ms=0.0)]
    found = run(stage, total_ms=50, signals=TraceSignals(gil_pressure_ms=3.7, cpu_pressure_ms=0.7))
    assert set(found) == {"OFF_CPU_WAIT"}
    assert evidence(found, "OFF_CPU_WAIT") == (
        "the host was short of CPUs meanwhile (its own run-queue wait 5.5 ms, woken threads 0.7 ms), and there a "
        "wait can be for a GIL holder the scheduler preempted"
    )
    assert set(run(stage, total_ms=50, signals=TraceSignals(gil_pressure_ms=23.0, cpu_pressure_ms=0.7))) == {
        "GIL_CONTENTION"
    }
    assert set(run(stage, total_ms=50, signals=TraceSignals(gil_pressure_ms=3.7, cpu_pressure_ms=2.0))) == {
        "CPU_OVERSUBSCRIBED"
    }


def test_untracked_time_on_a_host_short_of_cpus_says_so():
    stages = [cpu("compress", 0, 30, cpu_ms=10, runqueue_ms=18)]
    quiet = run([cpu("compress", 0, 30, cpu_ms=29)], total_ms=70)
    assert quiet["UNTRACKED_TIME"].message == "40.0 ms (57%) of the request is in no stage"
    assert quiet["UNTRACKED_TIME"].evidence is None
    starved = run(stages, total_ms=70)["UNTRACKED_TIME"]
    assert starved.message == "40.0 ms (57%) of the request is in no stage"
    assert starved.evidence == "the host was short of CPUs meanwhile, and code in no stage waits for one too"


def test_a_blocked_stage_without_a_gil_reading_says_what_was_measured():
    stage = [cpu("tokenize", 0, 64, cpu_ms=38.5, blocked_ms=25, runqueue_ms=0.5, not_gil_ms=0.0)]
    found = run(stage, total_ms=76)
    assert set(found) == {"OFF_CPU_WAIT"}
    assert only(found, "OFF_CPU_WAIT") == (
        "'tokenize' was off-CPU 25.0 ms of its 64.0 ms, for the GIL or for a lock or I/O; the signals cannot "
        "tell which",
        "tokenize",
    )
    assert evidence(found, "OFF_CPU_WAIT") == "the request spanned too few GIL-monitor wake-ups to measure GIL pressure"


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
        "the request waited 30.0 ms (30%) for the event loop while other requests' sync stages held it",
        "event_loop.wait",
    )
    assert evidence(found, "EVENT_LOOP_BLOCKED") == f"held longest by 'resize' of trace {'a' * 32} and 1 more"
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
    assert one["EVENT_LOOP_BLOCKED"].message.endswith("while other requests' sync stages held it")
    assert evidence(one, "EVENT_LOOP_BLOCKED") == f"held longest by 'resize image' of trace {'c' * 32}"
    unnamed = run(waits)  # blockers not known: the wait is still measured
    assert unnamed["EVENT_LOOP_BLOCKED"].message.endswith("while other requests' sync stages held it")
    assert evidence(unnamed, "EVENT_LOOP_BLOCKED") is None
    # ... unless the loop monitor saw the loop's thread do no work meanwhile: starved (of the GIL, of a CPU),
    # not held, and no `def` or offload would help
    assert "EVENT_LOOP_BLOCKED" not in run(waits, signals=TraceSignals(loop_held_ms=0.0, loop_lag_ms=70.0))
    assert "EVENT_LOOP_BLOCKED" in run(waits, signals=TraceSignals(loop_held_ms=20.0, loop_lag_ms=70.0))


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
    for pressure in (0.5, 0.75, 0.99):
        found = run(blocked, signals=TraceSignals(gil_pressure_ms=pressure))
        assert "GIL_CONTENTION" not in found and "LOCK_OR_IO_WAIT" not in found, pressure
        assert evidence(found, "OFF_CPU_WAIT") == (
            f"GIL pressure {pressure:.1f} ms lies between a free GIL (< 0.5 ms) and a contended one (>= 1 ms)"
        )
    assert "LOCK_OR_IO_WAIT" in run(blocked, signals=TraceSignals(gil_pressure_ms=0.49))


def _load(runnable, requests, *, cpus=2, used=2.0):
    return TraceSignals(load=ProcessLoad(cpus=cpus, cpus_used=used, runnable=runnable, requests=requests))


WAITED = [cpu("forward", 0, 60, cpu_ms=20, runqueue_ms=35)]


def test_a_wait_for_a_cpu_names_the_requests_when_they_outnumber_the_cpus():
    """8 requests at once on 2 CPUs, a thread each (torch.set_num_threads(1) changed little): the service at
    capacity, which capping intra-op threads does not change (CPU_OVERSUBSCRIBED advised it on 97-99 % of
    such traces)."""
    found = run(WAITED, total_ms=70, signals=_load(8.6, 8.0))
    assert set(found) == {"SERVICE_AT_CAPACITY"}
    assert only(found, "SERVICE_AT_CAPACITY") == (
        "'forward' waited 35.0 ms of its 60.0 ms for a CPU (run queue), with 8.0 requests in flight on 2 CPUs",
        "forward",
    )
    assert evidence(found, "SERVICE_AT_CAPACITY") == (
        "the process used 2.0 CPUs, and 8.6 of its threads were running or waiting for a CPU on average: about one "
        "a request, so the requests themselves, not threads beside them, outnumber the CPUs"
    )


def test_a_wait_for_a_cpu_names_threads_beside_the_requests_when_they_outnumber_them():
    found = run(WAITED, total_ms=70, signals=_load(9.0, 2.0))
    assert set(found) == {"CPU_OVERSUBSCRIBED"}
    assert only(found, "CPU_OVERSUBSCRIBED") == (
        "'forward' waited 35.0 ms of its 60.0 ms for a CPU (run queue)",
        "forward",
    )
    assert evidence(found, "CPU_OVERSUBSCRIBED") == (
        "9.0 of the process's threads were running or waiting for a CPU on average for 2.0 requests in flight, on 2 "
        "CPUs: threads beside the requests' own (intra-op pools of torch, BLAS or OpenMP, worker pools) outnumber "
        "the CPUs"
    )


def test_a_wait_for_a_cpu_names_other_processes_when_the_process_fits_its_cpus():
    found = run(WAITED, total_ms=70, signals=_load(1.5, 1.0, used=0.9))
    assert set(found) == {"CPU_OVERSUBSCRIBED"}
    assert evidence(found, "CPU_OVERSUBSCRIBED") == (
        "the process used 0.9 of its 2 CPUs and its threads asked for 1.5 on average: other processes on the host "
        "took the CPUs"
    )


def test_the_shapes_of_a_cpu_wait_at_their_edges():
    def codes(runnable, requests, cpus=2):
        return set(run(WAITED, total_ms=70, signals=_load(runnable, requests, cpus=cpus)))

    assert codes(2.0, 8.0) == {"CPU_OVERSUBSCRIBED"}  # runnable exactly the CPUs: they fit, other processes
    assert codes(2.01, 8.0) == {"SERVICE_AT_CAPACITY"}
    assert codes(3.0, 2.0) == {"CPU_OVERSUBSCRIBED"}  # requests exactly the CPUs: not beyond them
    assert codes(3.0, 2.01) == {"SERVICE_AT_CAPACITY"}  # beyond, and most of the runnable threads
    assert codes(8.0, 4.0) == {"SERVICE_AT_CAPACITY"}  # exactly half the runnable threads: capacity_requests_share
    assert codes(8.0, 3.99) == {"CPU_OVERSUBSCRIBED"}
    assert codes(8.0, None) == {"CPU_OVERSUBSCRIBED"}  # requests not read: threads
    assert set(run(WAITED, total_ms=70)) == {"CPU_OVERSUBSCRIBED"}  # no load read: as before
    assert evidence(run(WAITED, total_ms=70), "CPU_OVERSUBSCRIBED") is None


def test_at_capacity_but_no_stage_waited_for_a_cpu_is_no_diagnosis():
    """The healthy twin: the same load, a stage that ran (no run-queue wait worth naming)."""
    ran = [cpu("forward", 0, 60, cpu_ms=57, runqueue_ms=2)]
    assert not {"SERVICE_AT_CAPACITY", "CPU_OVERSUBSCRIBED"} & set(run(ran, total_ms=62, signals=_load(8.6, 8.0)))
