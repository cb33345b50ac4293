"""The figures exporter/signals.py computes, pinned on inputs worked out by hand (issue "Tests that see a wrong
value"): a stage's CPU figures, the other threads' share beside it, the process's load over a window, GIL
pressure, loop lag, and the series that hold the samples (past their bounds, inserted out of order).

Each expected value is the arithmetic in its comment, never the module's formula run a second time. Inputs sit
on the edges (exactly at a bound, one past it, empty, one) and carry more decimals than a figure keeps, so a
wrong bound, constant, default or rounding gives a different answer."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import compiled_only, run_compiled
from stagetrace.analysis.loopwait import LoopBlock
from stagetrace.analysis.model import CompressedInfo
from stagetrace.analysis.signals import ProcessLoad
from stagetrace.common import wire
from stagetrace.common.schedstat import GIL_WAIT_MARGIN_MS
from stagetrace.exporter.signals import (
    LagSeries,
    LoopBlockSeries,
    _nearest,
    cumulative_change,
    max_loop_lag_ms,
    process_load,
    resolve_cpu,
    resolve_others,
    sampler_mean_ms,
)
from stagetrace.settings import GIL_MIN_SAMPLES, MIN_CPU_ACCOUNTED_NS

MS = 1_000_000  # ns

# The hand arithmetic below reads these as literals.
assert GIL_WAIT_MARGIN_MS == 1.5 and GIL_MIN_SAMPLES == 3 and MIN_CPU_ACCOUNTED_NS == MS


def series(*samples: tuple[int, float]) -> LagSeries:
    """(epoch ns, value) pairs, shipped flat as the samplers ship them."""
    s = LagSeries()
    s.extend_flat([x for pair in samples for x in pair])
    return s


def schedstat(cpu_ns: int, rq_ns: int, slices: int) -> bytes:
    """A read of /proc/thread-self/schedstat: on-CPU ns, run-queue ns, times scheduled in."""
    return f"{cpu_ns} {rq_ns} {slices}\n".encode()


def stage(wall_ns: int, cpu_start: Any, cpu_end: Any, *, start_ns: int = 10 * MS) -> wire.ShippedStage:
    st = wire.ShippedStage.added("parse", "cpu", 1, 2, start_ns, start_ns + wall_ns)
    st.cpu_start, st.cpu_end = cpu_start, cpu_end
    return st


def figures(st: wire.ShippedStage) -> tuple[float | None, ...]:
    return st.cpu_ms, st.runqueue_ms, st.blocked_ms, st.not_gil_ms


# --- a stage's CPU figures (resolve_cpu) -----------------------------------------------------------------


def test_each_cpu_figure_keeps_three_decimals_of_its_unrounded_value():
    """A figure a user reads to the microsecond: rounded once, to 3 decimals of a ms, and blocked time from
    the unrounded parts (rounding each first would move it by a microsecond)."""
    st = stage(10 * MS, schedstat(1_000_000_000, 2_000_000_000, 10), schedstat(1_001_234_567, 2_002_345_678, 12))
    resolve_cpu(st, 0.1234)
    # on-CPU 1.234567 ms -> 1.235; run queue 2.345678 ms -> 2.346
    # blocked 10 - 1.234567 - 2.345678 = 6.419755 -> 6.42 (not 10 - 1.235 - 2.346 = 6.419)
    # two slices, a GIL wait at most 0.1234 + 1.5 = 1.6234 ms a stretch: 6.42 > 2 * 1.6234, so at most one
    # stretch was the GIL: 6.42 - 1.6234 = 4.7966 -> 4.797 was not
    assert figures(st) == (1.235, 2.346, 6.42, 4.797)


def test_a_stage_of_exactly_one_millisecond_gets_figures_under_a_millisecond_and_one_ns_shorter_none():
    """The 1 ms floor includes 1 ms itself, and the figures of such a stage are each under a millisecond: none
    is clamped to zero."""
    readings = schedstat(0, 0, 1), schedstat(500_000, 250_000, 2)
    at = stage(1_000_000, *readings)
    resolve_cpu(at, 5.0)
    # 0.5 ms on CPU, 0.25 queued, 1 - 0.5 - 0.25 = 0.25 blocked; one stretch of 0.25 ms fits a GIL wait (6.5)
    assert figures(at) == (0.5, 0.25, 0.25, 0.0)
    under = stage(999_999, *readings)
    resolve_cpu(under, 5.0)
    assert figures(under) == (None, None, None, None)


def test_readings_that_went_backwards_count_as_nothing_and_the_whole_wall_is_blocked():
    """A counter lower at the end than at the start (a reading of another thread) is no time, not negative
    time, and not a millisecond either."""
    st = stage(10 * MS, schedstat(5_000_000, 3_000_000, 4), schedstat(4_000_000, 2_000_000, 5))
    resolve_cpu(st, None)
    # -1 ms on CPU and -1 ms queued: 0 each; blocked 10 - 0 - 0 = 10
    assert figures(st) == (0.0, 0.0, 10.0, None)


def test_more_cpu_and_run_queue_time_than_wall_time_is_no_blocked_time():
    st = stage(10 * MS, schedstat(0, 0, 1), schedstat(8 * MS, 4 * MS, 3))
    resolve_cpu(st, 5.0)
    # 10 - 8 - 4 = -2: nothing blocked (not -2, not 1); nothing blocked proves nothing
    assert figures(st) == (8.0, 4.0, 0.0, 0.0)


def test_a_long_stage_keeps_its_wall_time_to_the_microsecond():
    """Wall ns to ms is a division by exactly 1e6: one part per million short shows on a second."""
    st = stage(1_000 * MS, schedstat(0, 0, 1), schedstat(300 * MS, 200 * MS, 2))
    resolve_cpu(st, None)
    # 1000 - 300 - 200 = 500 (a wall read 1 ppm short, 999.999 ms, would leave 499.999)
    assert figures(st) == (300.0, 200.0, 500.0, None)


def test_a_thread_cpu_clock_gives_on_cpu_time_and_leaves_the_run_queue_inside_blocked_time():
    """Where schedstat is missing the readings are thread CPU ns: no run-queue figure, no slices, so no proof
    of a wait that was not the GIL even with the GIL's bound known."""
    st = stage(1_500 * MS, 5_000_000_000, 6_000_000_000)
    resolve_cpu(st, 5.0)
    # 6e9 - 5e9 = 1e9 ns = 1000 ms on CPU (not 6e9 + 5e9, nor 1 ppm short: 999.999); blocked 1500 - 1000 = 500
    assert figures(st) == (1000.0, None, 500.0, None)
    fine = stage(10 * MS, 7_000_000, 8_234_567)
    resolve_cpu(fine, None)
    # 1.234567 ms -> 1.235; blocked 10 - 1.234567 = 8.765433 -> 8.765
    assert figures(fine) == (1.235, None, 8.765, None)


def test_a_composite_is_blocked_against_its_longest_occurrence():
    """A composite stage's wall is its longest occurrence (ShippedStage.wall_ms), not first start to last end."""
    st = stage(40 * MS, schedstat(0, 0, 1), schedstat(5 * MS, 1 * MS, 4))
    st.fold(CompressedInfo(occurrences=3, sum_ns=30 * MS, min_ns=6 * MS, max_ns=12 * MS))
    assert st.wall_ms == 12.0
    resolve_cpu(st, None)
    # 12 - 5 - 1 = 6 (the 40 ms span would give 34)
    assert figures(st) == (5.0, 1.0, 6.0, None)


def test_a_stages_wall_time_is_set_once_from_its_times_or_its_longest_occurrence():
    """``ShippedStage.wall_ms`` is kept, not computed at each read: from its times (0 where they run backwards),
    a composite's longest occurrence as it arrives from the wire, and again when the exporter folds one."""
    assert stage(1_234_567, None, None).wall_ms == 1.234567
    assert wire.ShippedStage.added("parse", "cpu", 1, 2, 50 * MS, 40 * MS).wall_ms == 0.0
    shipped: list[Any] = [None] * len(wire.STAGE_FIELDS)
    for name, value in {"name": "parse", "kind": "cpu", "span_id": 1, "parent_span_id": 2, "parent_stage_id": 0,
                        "start_ns": 0, "end_ns": 100 * MS, "on_event_loop": False, "example": False,
                        "compressed": (4, 40 * MS, 5 * MS, 15 * MS)}.items():  # fmt: skip
        shipped[wire.STAGE_FIELDS.index(name)] = value
    assert wire.ShippedStage(tuple(shipped)).wall_ms == 15.0


def test_readings_that_do_not_make_a_pair_give_no_figures():
    """A missing reading, two of different kinds (the name's history changed between them), or unreadable ones:
    nothing to subtract, and no error."""
    good = schedstat(0, 0, 1)
    for start, end in (
        (None, None),
        (None, good),
        (good, None),
        (1_000, good),
        (good, 5 * MS),
        (1.0, 2.0),
        (b"garbage", b"x y z"),
    ):
        st = stage(10 * MS, start, end)
        resolve_cpu(st, 5.0)
        assert figures(st) == (None, None, None, None), (start, end)


# --- the other threads beside a blocked stage (resolve_others, cumulative_change) ----------------------------


def blocked(runqueue_ms: float | None, cpu_ms: float) -> wire.ShippedStage:
    """A stage from 5 to 15 ms (1005 to 1015 ms on the series' clock, with offset 1000 ms), 4 ms blocked."""
    st = wire.ShippedStage.added("parse", "cpu", 1, 2, 5 * MS, 15 * MS)
    st.blocked_ms, st.runqueue_ms, st.cpu_ms = 4.0, runqueue_ms, cpu_ms
    return st


def test_the_other_threads_share_keeps_three_decimals():
    rq = series((1000 * MS, 10.0), (1020 * MS, 11.23456))
    cpu = series((1000 * MS, 100.0), (1020 * MS, 103.45678))
    st = blocked(runqueue_ms=0.1, cpu_ms=1.2)
    resolve_others(st, rq, cpu, offset_ns=1000 * MS)
    # run queue: 11.23456 - 10 = 1.23456, less the stage's own 0.1: 1.13456 -> 1.135
    # on CPU: 103.45678 - 100 = 3.45678, less the stage's own 1.2: 2.25678 -> 2.257
    assert (st.others_runqueue_ms, st.others_cpu_ms) == (1.135, 2.257)


def test_a_share_under_a_millisecond_is_kept_and_one_the_stage_outgrew_is_zero():
    """Neither share is clamped up to a millisecond; a stage that was never on a CPU (0.0) or has no
    run-queue figure (None: a thread CPU clock) takes nothing off; the stage's own figures exceeding the
    totals (read at other moments) leave zero."""
    rq = series((1000 * MS, 10.0), (1020 * MS, 10.5))
    cpu = series((1000 * MS, 100.0), (1020 * MS, 100.75))
    cases = {
        # 10.5 - 10 = 0.5 queued, none the stage's; 100.75 - 100 = 0.75 on CPU, less 0.25: 0.5
        (0.0, 0.25): (0.5, 0.5),
        (None, 0.25): (0.5, 0.5),
        # never on a CPU: all 0.75 ms were the others'
        (0.0, 0.0): (0.5, 0.75),
        # 0.5 - 2 and 0.75 - 2: below zero, so zero
        (2.0, 2.0): (0.0, 0.0),
    }
    for (own_rq, own_cpu), expected in cases.items():
        st = blocked(runqueue_ms=own_rq, cpu_ms=own_cpu)
        resolve_others(st, rq, cpu, offset_ns=1000 * MS)
        assert (st.others_runqueue_ms, st.others_cpu_ms) == expected, (own_rq, own_cpu)


def test_a_cumulative_series_that_grew_under_a_millisecond_or_fell_back():
    assert cumulative_change(series((0, 10.0), (10 * MS, 10.5)), 0, 10 * MS) == 0.5  # 10.5 - 10
    assert cumulative_change(series((0, 10.0), (10 * MS, 9.0)), 0, 10 * MS) == 0.0  # 9 - 10 < 0: no growth
    assert cumulative_change(LagSeries(), 0, 10 * MS) is None


# --- which reading stands for a window's edge (_nearest) -----------------------------------------------------


def test_the_reading_for_a_windows_start_is_the_one_before_unless_one_just_after_is_nearer():
    times = [0, 10, 30]
    assert _nearest(times, 8, 3, start=True) == 1  # 10 is 2 after, 0 is 8 before: within 3 and nearer
    assert _nearest(times, 8, 2, start=True) == 1  # exactly the tolerance away still stands for it
    assert _nearest(times, 8, 1, start=True) == 0  # one past the tolerance: the reading before
    assert _nearest(times, 5, 5, start=True) == 0  # 5 before, 5 after: a tie goes to the reading outside
    assert _nearest(times, 10, 3, start=True) == 1  # a reading at the start is the one at or before it
    assert _nearest([10, 20], 9, 3, start=True) == 0  # none before: the first, 1 after
    assert _nearest([10, 20], 5, 3, start=True) is None  # none before, the first 5 after: too far
    assert _nearest([10, 20], 25, 3, start=True) == 1  # after every reading: the last
    assert _nearest([], 5, 3, start=True) is None


def test_the_reading_for_a_windows_end_is_the_one_after_unless_one_just_before_is_nearer():
    times = [0, 20, 30]
    assert _nearest(times, 22, 3, start=False) == 1  # 20 is 2 before, 30 is 8 after: within 3 and nearer
    assert _nearest(times, 22, 2, start=False) == 1  # exactly the tolerance away
    assert _nearest(times, 22, 1, start=False) == 2  # one past it: the reading after
    assert _nearest(times, 25, 5, start=False) == 2  # a tie: the reading outside
    assert _nearest(times, 20, 3, start=False) == 1  # a reading at the end is the one at or after it
    assert _nearest([0, 20], 21, 3, start=False) == 1  # none after: the last, 1 before
    assert _nearest([0, 20], 25, 3, start=False) is None  # none after, the last 5 before: too far
    assert _nearest([10, 20], 5, 3, start=False) == 0  # before every reading: the first
    assert _nearest([], 5, 3, start=False) is None


# --- the process's load over a window (process_load) --------------------------------------------------------


def test_the_load_keeps_three_decimals_and_the_requests_two():
    cpu = series((0, 0.0), (20 * MS, 24.68999))
    rq = series((0, 5.0), (20 * MS, 49.44))
    flying = series((0, 1), (10 * MS, 2), (20 * MS, 2))
    # readings on both edges, 20 ms apart:
    # CPUs used 24.68999 / 20 = 1.2344995 -> 1.234 (a span 1 ppm short would give 1.2345007 -> 1.235)
    # runnable (24.68999 + (49.44 - 5)) / 20 = 69.12999 / 20 = 3.4564995 -> 3.456
    # requests (1 + 2 + 2) / 3 = 1.666... -> 1.67
    assert process_load(cpu, rq, flying, 0, 20 * MS, cpus=4) == ProcessLoad(4, 1.234, 3.456, 1.67)


def test_a_load_under_a_millisecond_of_cpu_is_kept_and_a_total_that_fell_is_none_used():
    rq = series((0, 0.0), (20 * MS, 0.0))
    small = series((0, 0.0), (20 * MS, 0.5))
    # 0.5 ms over 20 ms: 0.025 CPUs
    assert process_load(small, rq, LagSeries(), 0, 20 * MS, cpus=2) == ProcessLoad(2, 0.025, 0.025, None)
    fell = series((0, 7.0), (20 * MS, 3.0))  # 3 - 7 < 0: nothing used
    assert process_load(fell, rq, LagSeries(), 0, 20 * MS, cpus=2) == ProcessLoad(2, 0.0, 0.0, None)


def test_a_reading_within_two_ms_of_a_short_windows_start_stands_for_it():
    """A 4 ms window: a quarter of it (1 ms) is less than the 2 ms floor of the tolerance."""

    def load(inner_ns: int) -> ProcessLoad | None:
        cpu = series((5 * MS, 0.0), (inner_ns, 10.0), (14 * MS, 13.0))
        rq = series((5 * MS, 0.0), (inner_ns, 1.0), (14 * MS, 2.0))
        return process_load(cpu, rq, LagSeries(), 10 * MS, 14 * MS, cpus=2)

    # 12 ms is exactly 2 ms after the start (5 ms is 5 before): it stands for it; the span 12 to 14 ms, exactly
    # half the window, is enough. (13 - 10) / 2 = 1.5 CPUs; (3 + (2 - 1)) / 2 = 2.0 runnable
    assert load(12 * MS) == ProcessLoad(2, 1.5, 2.0, None)
    # 1 ns further: the reading at 5 ms, span 9 ms. 13 / 9 = 1.444; (13 + 2) / 9 = 1.667
    assert load(12 * MS + 1) == ProcessLoad(2, 1.444, 1.667, None)


def test_a_reading_within_a_quarter_of_a_long_windows_start_stands_for_it():
    """A 40 ms window: the tolerance is a quarter of it, 10 ms."""

    def cpus_used(inner_ns: int) -> float:
        cpu = series((50 * MS, 0.0), (inner_ns, 10.0), (140 * MS, 41.0))
        rq = series((50 * MS, 0.0), (inner_ns, 0.0), (140 * MS, 0.0))
        load = process_load(cpu, rq, LagSeries(), 100 * MS, 140 * MS, cpus=8)
        assert load is not None and load.runnable == load.cpus_used  # no run-queue time
        return load.cpus_used

    assert cpus_used(109 * MS) == 1.0  # 9 ms in: (41 - 10) / (140 - 109) = 31 / 31
    assert cpus_used(110 * MS) == 1.033  # exactly a quarter in: 31 / 30 = 1.0333...
    assert cpus_used(110 * MS + 1) == 0.456  # 1 ns more: the reading at 50 ms, 41 / 90 = 0.4555...


def test_a_span_under_half_the_window_is_not_read():
    """A 6 ms window (tolerance 2 ms): readings 1.9 ms inside each edge span 2.2 ms, under 3."""
    cpu = series((101_900_000, 0.0), (104_100_000, 2.0))
    rq = series((101_900_000, 0.0), (104_100_000, 0.0))
    assert process_load(cpu, rq, LagSeries(), 100 * MS, 106 * MS, cpus=2) is None
    # 1.5 ms inside each edge: exactly 3 ms, half of it, is read: 3 / 3 = 1.0
    cpu = series((101_500_000, 0.0), (104_500_000, 3.0))
    rq = series((101_500_000, 0.0), (104_500_000, 0.0))
    assert process_load(cpu, rq, LagSeries(), 100 * MS, 106 * MS, cpus=2) == ProcessLoad(2, 1.0, 1.0, None)


def test_a_span_of_twice_the_window_and_50_ms_is_read_and_one_ns_more_is_not():
    """A 10 ms window, 100 to 110 ms, with the readings 30 ms outside it on each side (tolerance 2.5 ms)."""

    def load(last_ns: int) -> ProcessLoad | None:
        cpu = series((70 * MS, 0.0), (last_ns, 35.0))
        rq = series((70 * MS, 0.0), (last_ns, 0.0))
        return process_load(cpu, rq, LagSeries(), 100 * MS, 110 * MS, cpus=2)

    assert load(140 * MS) == ProcessLoad(2, 0.5, 0.5, None)  # 140 - 70 = 70 = 2 * 10 + 50 ms; 35 / 70 = 0.5
    assert load(140 * MS + 1) is None  # 70 ms and 1 ns


def test_a_window_without_two_readings_for_its_edges_is_not_read():
    cpu = series((0, 0.0), (10 * MS, 5.0), (20 * MS, 10.0))
    rq = series((0, 0.0), (10 * MS, 1.0), (20 * MS, 2.0))
    none = LagSeries()
    assert process_load(cpu, rq, none, 10 * MS, 10 * MS, cpus=2) is None  # no length: one reading for both edges
    assert process_load(cpu, rq, none, 0, 100 * MS, cpus=2) is None  # the last reading 80 ms before the end (25)
    assert process_load(cpu, rq, none, -100 * MS, 20 * MS, cpus=2) is None  # the first 100 ms after the start (30)
    assert process_load(cpu, none, none, 0, 20 * MS, cpus=2) is None  # no run-queue readings
    assert process_load(none, rq, none, 0, 20 * MS, cpus=2) is None  # no CPU readings
    assert process_load(cpu, rq, none, 0, 20 * MS, cpus=None) is None  # the CPUs not known
    assert process_load(cpu, rq, none, 0, 20 * MS, cpus=2) == ProcessLoad(2, 0.5, 0.6, None)  # 10/20, 12/20


# --- GIL pressure (sampler_mean_ms) --------------------------------------------------------------------------


def test_exactly_three_wake_ups_are_a_measurement_and_the_mean_keeps_three_decimals():
    s = series((1010 * MS, 0.1), (1020 * MS, 0.2), (1030 * MS, 0.2))
    # GIL_MIN_SAMPLES wake-ups (their 0.5 ms is far from 3 periods' 30 ms): (0.1 + 0.2 + 0.2) / 3 = 0.1666...
    assert sampler_mean_ms(s, 1000 * MS, 1040 * MS, period_s=0.01) == 0.167


def test_one_wake_up_that_waited_exactly_the_proof_is_a_measurement():
    one = series((1012 * MS, 5.0))
    assert sampler_mean_ms(one, 1000 * MS, 1020 * MS, period_s=0.01, proof_ms=5.0) == 5.0
    assert sampler_mean_ms(one, 1000 * MS, 1020 * MS, period_s=0.01, proof_ms=5.001) is None


def test_a_wake_up_whose_wait_began_exactly_at_the_windows_end_is_the_windows():
    """Past one period after the end, a wake-up counts if its wait began by the end: to the nanosecond."""
    inside = ((1010 * MS, 0.1), (1020 * MS, 0.2), (1030 * MS, 0.3))
    held = series(*inside, (1070 * MS, 30.0))  # 1070 - 30 = 1040: the end
    assert sampler_mean_ms(held, 1000 * MS, 1040 * MS, period_s=0.01) == 7.65  # (0.1 + 0.2 + 0.3 + 30) / 4
    later = series(*inside, (1070 * MS + 10, 30.0))  # its wait began 10 ns after the end
    assert sampler_mean_ms(later, 1000 * MS, 1040 * MS, period_s=0.01) == 0.2  # (0.1 + 0.2 + 0.3) / 3


def test_the_wake_up_one_period_after_the_end_counts_and_one_ns_later_does_not():
    s = series((1010 * MS, 0.3), (1020 * MS, 0.3), (1030 * MS, 0.3), (2040 * MS, 0.1), (2040 * MS + 1, 0.0))
    # a 1 s period: up to 1040 + 1000 = 2040 ms exactly; (0.3 * 3 + 0.1) / 4 = 0.25 (with the next: 1.0 / 5)
    assert sampler_mean_ms(s, 1000 * MS, 1040 * MS, period_s=1.0) == 0.25


# --- event-loop lag (max_loop_lag_ms) ------------------------------------------------------------------------


def test_a_stall_keeps_its_length_to_the_microsecond():
    s = series((1020 * MS, 12.3456789))  # inside the request: 12_345_678 ns (whole ns) -> 12.346 ms
    assert max_loop_lag_ms(s, 1000 * MS, 1050 * MS) == 12.346
    long = series((3000 * MS, 2000.0))  # a 2 s stall, 1000 to 3000 ms, inside a 5 s request
    assert max_loop_lag_ms(long, 0, 5000 * MS) == 2000.0  # 1 ppm off either way would read 2000.002 or 1999.998


def test_a_stall_ending_at_the_windows_end_counts_and_only_the_first_sample_after_it_is_read():
    """The monitor's first wake-up after the window reports a stall still going at its end; it also shows the
    loop ran then, so a later sample's stall began after it, whatever its lag says."""
    s = series((1010 * MS, 1.0), (1050 * MS, 20.0), (1060 * MS, 0.5), (1100 * MS, 80.0))
    # 1030 to 1050: 20 ms; the first after, 1059.5 to 1060, is outside; 1100's reach back to 1020 is not read
    assert max_loop_lag_ms(s, 1000 * MS, 1050 * MS) == 20.0
    s = series((1010 * MS, 1.0), (1060 * MS, 0.5), (1100 * MS, 80.0))
    assert max_loop_lag_ms(s, 1000 * MS, 1050 * MS) == 1.0  # 1009 to 1010


# --- the series themselves -----------------------------------------------------------------------------------


def test_a_default_series_holds_8192_samples_and_drops_the_oldest_half_past_them():
    s = LagSeries()
    s.extend_flat([x for i in range(8192) for x in (i, 1.0)])
    assert len(s) == 8192
    s.extend_flat((8192, 2.0))
    # 8193 > 8192: the oldest 8193 - 8192 // 2 = 4097 go, times 0..4096; 4096 stay
    assert (len(s), s.times[0], s.times[-1], s.values[-1]) == (4096, 4097, 8192, 2.0)


def test_a_batch_out_of_order_by_one_pair_is_read_a_pair_at_a_time():
    s = LagSeries()
    s.extend_flat((1, 0.5, 0, 0.25, 2, 0.75))  # 0 comes after 1: skipped, 2 kept
    assert (s.times, s.values) == ([1, 2], [0.5, 0.75])


def test_loop_blocks_keep_every_field_and_a_malformed_entry_skips_only_itself():
    blocks = LoopBlockSeries()
    blocks.extend(
        [
            "not a block",
            (1, 2, 3),
            (10 * MS, 20 * MS, 7, 99, "parse"),
            (1.0, 2, 7, 1, "float start"),
            (30 * MS, 40 * MS, 7, 98, None),
            [25 * MS, 28 * MS, 7, 97, "tokenize"],
        ]
    )
    assert len(blocks) == 2
    assert blocks.overlapping(7, 0, 100 * MS) == [
        LoopBlock(10 * MS, 20 * MS, 7, 99, "parse"),
        LoopBlock(25 * MS, 28 * MS, 7, 97, "tokenize"),
    ]


def test_a_loop_thread_at_its_bound_keeps_every_block_and_one_more_drops_the_oldest_ended_half():
    """Blocks shipped out of order are kept in the order they ended, and the bound drops the earliest ended,
    not the first shipped; another thread's blocks are not touched."""
    blocks = LoopBlockSeries(max_blocks=4)
    blocks.extend([(0, MS, 8, 1, "other")])
    for end in (30, 10, 50, 20):
        blocks.extend([((end - 1) * MS, end * MS, 7, end, "b")])
    ends = lambda: [b.end_ns // MS for b in blocks.overlapping(7, 0, 100 * MS)]  # noqa: E731
    assert ends() == [10, 20, 30, 50]  # four: all kept
    blocks.extend([(39 * MS, 40 * MS, 7, 40, "b")])
    # five > 4: the 5 - 4 // 2 = 3 that ended first (10, 20, 30) go, not the first three shipped (30, 10, 50)
    assert ends() == [40, 50] and len(blocks) == 3
    assert blocks.overlapping(8, 0, 100 * MS) == [LoopBlock(0, MS, 8, 1, "other")]


def test_a_default_loop_thread_holds_8192_blocks():
    blocks = LoopBlockSeries()
    blocks.extend([(i, i + 1, 7, i, "b") for i in range(8192)])
    assert len(blocks) == 8192
    blocks.extend([(8192, 8193, 7, 8192, "b")])
    # 8193 > 8192: 8193 - 4096 = 4097 go, starts 0..4096
    assert len(blocks) == 4096 and blocks.overlapping(7, 0, 10**9)[0].start_ns == 4097


def test_a_block_that_ended_at_the_windows_start_or_began_at_its_end_does_not_overlap_it():
    blocks = LoopBlockSeries()
    blocks.extend(
        [(0, 10 * MS, 7, 1, "a"), (10 * MS, 20 * MS, 7, 2, "b"), (20 * MS, 30 * MS, 7, 3, "c"), (0, 99 * MS, 8, 4, "d")]
    )
    names = lambda start, end: [b.name for b in blocks.overlapping(7, start, end)]  # noqa: E731
    assert names(10 * MS, 20 * MS) == ["b"]
    assert names(10 * MS + 1, 20 * MS - 1) == ["b"]
    assert names(10 * MS - 1, 20 * MS + 1) == ["a", "b", "c"]
    assert blocks.overlapping(9, 0, 100 * MS) == []


def test_two_schedstat_readings_read_back_as_cpu_ms_runqueue_ms_and_slices():
    import pytest

    from stagetrace.common.schedstat import schedstat_delta

    # 3,500,000 - 1,000,000 ns on the CPU = 2.5 ms; 1,250,000 - 250,000 ns queued = 1.0 ms; 9 - 4 slices
    assert schedstat_delta(b"1000000 250000 4\n", b"3500000 1250000 9\n") == (2.5, 1.0, 5)
    # a kernel giving two fields: no slice count; one reading with three and one with two: none either
    assert schedstat_delta(b"0 0", b"2000000 0") == (2.0, 0.0, None)
    assert schedstat_delta(b"0 0 1", b"2000000 0") == (2.0, 0.0, None)
    for start, end in ((b"1", b"2 3"), (b"1 2", b""), (b"1 x 3", b"2 3 4")):
        with pytest.raises(ValueError):
            schedstat_delta(start, end)


SCHEDSTAT_BYTES = st.binary(max_size=40) | st.lists(
    st.sampled_from([b"0", b"7", b"12345", b"999999999999999999", b"1000000000000000000", b" ", b"\t", b"\n",
                     b"\x0b", b"\x1c", b"x", b"-1", b"+1", b"1_0", b"\xa0"]),
    max_size=8,
).map(b"".join)  # fmt: skip


def _fields_or_refusal(read, reading):
    try:
        return read(reading)
    except ValueError:
        return "refused"


@given(SCHEDSTAT_BYTES)
def test_a_schedstat_reading_is_read_the_same_by_a_walk_over_its_bytes_as_by_split(reading):
    """Compiled, the exporter reads a reading's fields by a walk over its bytes; from the sources, by ``split``
    and ``int``: both take the same readings (up to three fields of at most 18 digits, split on ASCII
    whitespace) and refuse the same (signs, underscores, other bytes, a field of 19 digits)."""
    from stagetrace.common import schedstat

    by_split = _fields_or_refusal(schedstat._fields_by_split, reading)
    assert by_split == _fields_or_refusal(schedstat._fields_by_bytes, reading), reading
    if by_split != "refused":
        fields = reading.split()
        assert by_split == (int(fields[0]), int(fields[1]), int(fields[2]) if len(fields) > 2 else -1)


def test_what_a_schedstat_reading_may_hold():
    from stagetrace.common import schedstat

    for read in (schedstat._fields_by_split, schedstat._fields_by_bytes):
        assert read(b"  12\t34\n") == (12, 34, -1)
        assert read(b"1 2 3 anything after the third") == (1, 2, 3)
        assert read(b"999999999999999999 0 0") == (10**18 - 1, 0, 0)
        for bad in (b"", b"12", b"1 -2", b"+1 2", b"1_0 2", b"1 2 x", b"1000000000000000000 0", b"1\xa02 3"):
            with pytest.raises(ValueError):
                read(bad)


@compiled_only("stagetrace.common.schedstat")
def test_the_compiled_schedstat_reads_by_its_walk_and_as_the_sources_do():
    readings = [b"1000000 250000 4\n", b"3500000 1250000 9\n", b"0 0", b"2000000 0", b"1 x 3", b"1", b"  5 6 7 8 "]
    script = (
        f"readings = {readings!r}\n"
        "def result(start, end):\n"
        "    try:\n"
        "        return schedstat.schedstat_delta(start, end)\n"
        "    except ValueError:\n"
        "        return 'refused'\n"
        "print(repr([result(a, b) for a in readings for b in readings]))\n"
    )
    out = run_compiled("stagetrace.common.schedstat", script)

    def result(start, end):
        try:
            return schedstat_delta(start, end)
        except ValueError:
            return "refused"

    from stagetrace.common.schedstat import schedstat_delta

    assert out.strip() == repr([result(a, b) for a in readings for b in readings])


def test_a_series_skips_samples_whose_time_is_outside_what_an_int64_holds():
    """A series' times are what OTLP's timestamps hold, [0, 2**63): a sample outside is malformed and skipped,
    by both of ``extend_flat``'s ways (the checked one and the one that appends a whole message at once)."""
    from stagetrace.exporter.signals import TIME_END_NS, LagSeries

    checked = LagSeries()
    checked.extend_flat([-1, 1.0, 5, 2.0, TIME_END_NS, 3.0, 7, 4.0])  # out of range: the pair-at-a-time way
    assert (checked.times, checked.values) == ([5, 7], [2.0, 4.0])
    whole = LagSeries()
    whole.extend_flat([5, 1.0, TIME_END_NS - 1, 2.0])
    whole.extend_flat([TIME_END_NS - 1, 3.0, TIME_END_NS, 4.0])  # sorted, exact types: the last one still out
    assert (whole.times, whole.values) == ([5, TIME_END_NS - 1, TIME_END_NS - 1], [1.0, 2.0, 3.0])


# Window bounds past either end of what a series' times hold (a trace's own times are not bounded), and a few
# in between: what a search must answer as bisect does.
_EDGE_BOUNDS = [-(2**70), -1, 0, 1, 2**62, 2**63 - 1, 2**63, 2**64 + 5, 10**30]


@compiled_only("stagetrace.exporter.signals")
def test_the_compiled_window_search_gallops_to_what_bisect_finds():
    """Compiled, ``index_left``/``index_right`` are a C walk back from the series' end and a bisect (no call of
    the stdlib's): the same index as bisect for every bound, duplicates, an empty series and past either end."""
    script = (
        "import random\n"
        "from bisect import bisect_left, bisect_right\n"
        "rng = random.Random(7)\n"
        f"edges = {_EDGE_BOUNDS!r}\n"
        "wrong = []\n"
        "for n in list(range(12)) + [100, 1000]:\n"
        "    for _ in range(40):\n"
        "        base = rng.choice([0, 1_796_000_000_000_000_000, 2**63 - 10**6])\n"
        "        times = sorted(base + rng.randrange(0, 50) * 1000 for _ in range(n))\n"
        "        bounds = edges + [t + d for t in times[:5] + times[-5:] for d in (-1, 0, 1)]\n"
        "        for at in bounds:\n"
        "            got = (signals.index_left(times, at), signals.index_right(times, at))\n"
        "            if got != (bisect_left(times, at), bisect_right(times, at)):\n"
        "                wrong.append((n, at, got))\n"
        "print(len(wrong), wrong[:3])\n"
    )
    assert run_compiled("stagetrace.exporter.signals", script).strip() == "0 []"
