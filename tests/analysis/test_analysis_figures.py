"""The figures a user reads off one trace, pinned on hand-computed inputs where the mutation run showed no other
test pinned them: a stage's exclusive time under two composites, the breakdown's pipeline order, a blocked
stage's cause at the edges of its thresholds, a stream's headline when no stage ran in its slow phase, the
event-loop wait past several own stages, how slow a trace is (``slowness``) and why (``judge``), and an
offloaded call's stretches when it never queued. Every expected value is worked out in the docstring or the
comment beside it, never by a second path of the code."""

from __future__ import annotations

import pytest
from test_rule_edges import analysis
from test_stream_values import summary
from trace_builders import MS, cpu, offload

from stagetrace import conventions as c
from stagetrace.analysis import DiagnosisThresholds, TraceSignals, analyse_trace
from stagetrace.analysis.causes import GIL, PREEMPTED_HOLDERS, UNDETERMINED, blocked_cause
from stagetrace.analysis.loopwait import LoopBlock, LoopWait, loop_waits
from stagetrace.analysis.model import CompressedInfo
from stagetrace.analysis.offload import OffloadedCall, offload_calls
from stagetrace.analysis.streams import StreamThresholds, judge_phases
from stagetrace.analysis.verdict import judge, slowness

# --- the breakdown -------------------------------------------------------------------------------------


def test_a_stage_is_charged_its_time_less_the_summed_occurrences_of_both_composites_under_it():
    """A 100 ms stage P with two composites under it: ``a`` (5 occurrences, 20 ms summed) and ``b`` (30 ms
    summed). P is charged 100 - 20 - 30 = 50 ms exactly: each composite's sum adds to what is already folded
    under the same parent (not to another parent's, which would leave P 70 ms), starting from nothing (a
    start of 1 ns would charge it 49.999999 ms, a difference only an exact comparison sees)."""
    stages = [
        cpu("P", 0, 100, span_id=1),
        cpu("a", 0, 50, span_id=2, parent_stage_id=1, compressed=CompressedInfo(5, 20 * MS, MS, 5 * MS)),
        cpu("b", 50, 100, span_id=3, parent_stage_id=1, compressed=CompressedInfo(5, 30 * MS, MS, 7 * MS)),
    ]
    a = analyse_trace(0, 100 * MS, stages, 200)
    assert a.breakdown == {"P": 50.0, "a": 20.0, "b": 30.0}
    assert a.charged_ms == (50.0, 20.0, 30.0)


def test_stages_listed_as_they_ended_are_broken_down_in_the_order_they_started():
    """The exporter lists a child before its parent (children end first): ``alpha`` 10-20 ms under ``zeta``
    0-50 ms. The breakdown reads in pipeline order, zeta then alpha: names chosen so that the alphabetical
    order (a sort by name, or no sort at all) is the other one."""
    stages = [cpu("alpha", 10, 20, span_id=2, parent_stage_id=1), cpu("zeta", 0, 50, span_id=1)]
    a = analyse_trace(0, 100 * MS, stages, 200)
    assert list(a.breakdown) == ["zeta", "alpha"]
    assert a.breakdown == {"zeta": 40.0, "alpha": 10.0}


# --- a blocked stage's cause ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "signals", "thresholds", "cause"),
    [
        pytest.param(
            # queued 10 of 50 ms off the CPU (20 %: not CPUs to spare); blocked 40 less the other threads' 10 ms
            # queued still matters (30 >= 25), so judged on that remainder: 40 - 10 proven not the GIL = 30 GIL-
            # shaped, less the 10 preempted = 20 < 25: not GIL waits, though the GIL monitor read 2 ms (without
            # taking the preempted 10 off, 30 would be)
            cpu("s", 0, 100, blocked_ms=40.0, runqueue_ms=10.0, not_gil_ms=10.0, others_runqueue_ms=10.0),
            TraceSignals(gil_pressure_ms=2.0),
            DiagnosisThresholds(),
            UNDETERMINED,
            id="remainder-less-the-preempted-is-no-gil-wait",
        ),
        pytest.param(
            # CPUs to spare (never queued, the GIL monitor neither): all 25.5 ms blocked are GIL-shaped, half a ms
            # past the 25 % share; nothing preempted is taken off (1 ms taken off leaves 24.5, under it)
            cpu("s", 0, 100, blocked_ms=25.5, runqueue_ms=0.0),
            TraceSignals(gil_pressure_ms=2.0, cpu_pressure_ms=0.0),
            DiagnosisThresholds(),
            GIL,
            id="cpus-to-spare-just-past-the-share",
        ),
        pytest.param(
            # queued 20 of 60 ms off the CPU: short of CPUs; of 40 ms blocked, 20 proven long waits (under the
            # 25 ms share: no lock) and 20 GIL-shaped (under it too: no GIL wait). Neither cause is proven, so
            # no preempted holders either, though the stage queued for a CPU
            cpu("s", 0, 100, blocked_ms=40.0, runqueue_ms=20.0, not_gil_ms=20.0),
            TraceSignals(),
            DiagnosisThresholds(),
            UNDETERMINED,
            id="neither-proven-nor-gil-shaped",
        ),
        pytest.param(
            # never queued itself, but the GIL monitor waited 3 ms for a CPU (host out of CPUs); its 5 ms GIL
            # reading is a whole interval yet under 2 x 3 = 6 ms: the CPU shortage, not holders running Python
            cpu("s", 0, 100, blocked_ms=40.0, runqueue_ms=0.0),
            TraceSignals(gil_pressure_ms=5.0, cpu_pressure_ms=3.0),
            DiagnosisThresholds(),
            PREEMPTED_HOLDERS,
            id="gil-reading-under-twice-the-cpu-wait",
        ),
        pytest.param(
            # an edge only a non-default threshold reaches (by default a GIL held 5 ms is never under 2 x 1 ms): a
            # 1 ms whole interval, the GIL monitor read 1.5 ms and its wait for a CPU was not measured (counts 0,
            # not 1 ms); queued 5 of 45 ms off the CPU, under the 25 % that names preempted holders: GIL
            cpu("s", 0, 100, blocked_ms=40.0, runqueue_ms=5.0),
            TraceSignals(gil_pressure_ms=1.5),
            DiagnosisThresholds(gil_held_ms=1.0),
            GIL,
            id="held-with-no-cpu-reading",
        ),
    ],
)
def test_a_blocked_stage_s_cause_at_the_edges_of_its_thresholds(stage, signals, thresholds, cause):
    """Each case sits where one term of the classifier decides: what preemption takes off the GIL-shaped time,
    the share of the stage's time, a cause proven neither way, and the GIL monitor's reading against its wait
    for a CPU (``gil_over_cpu``)."""
    assert blocked_cause(stage, signals, thresholds) is cause


# --- a stream's headline -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stream", "thresholds", "reason"),
    [
        (summary(first_chunk_ms=0.8, before={}), StreamThresholds(0.5, 100.0), c.SLOW_FIRST_CHUNK),
        (summary(streaming_ms=0.8, gap_p99_ms=0.4, between={}), StreamThresholds(100.0, 0.3), c.SLOW_GAP),
    ],
    ids=["first-chunk", "gaps"],
)
def test_a_slow_sub_millisecond_phase_in_no_stage_is_headed_by_untracked_time(stream, thresholds, reason):
    """A slow phase of 0.8 ms in which no stage ran: all of it untracked, the headline ``untracked`` at a ratio
    of 1.0. With no stage the stage side counts 0 ms; counted 1 ms, it would outweigh the 0.8 ms untracked and
    the slow phase would have no headline at all."""
    assert judge_phases(stream, thresholds) == (reason, c.UNTRACKED, 1.0)


# --- the event-loop wait --------------------------------------------------------------------------------------


def test_a_wait_after_several_of_the_request_s_own_stages_is_found_past_all_of_them():
    """Own stages at 0-1 and 2-3 ns, both over before another request's block at 10-20 ns: the wait is all of
    10-20, held by that block. Every own stage that ended before the block is stepped past once; a scan that
    went back to the second one each time would never end. (No pytest-timeout in this suite: the case finishes
    at once on the code, and a mutant that loops is stopped by the mutation run's own timeout.)"""
    waits = loop_waits((0, 100), [(0, 1), (2, 3)], [LoopBlock(10, 20, 1, 99, "x")], 7)
    assert waits == [LoopWait(10, 20, (("x", 99, 10),))]


# --- how slow, and why -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # a stream: its first chunk over a 1.5 ms threshold (over the 1 ms floor: not 2 ms)
        ((0.0, 1000.0, summary(first_chunk_ms=3.0, gap_p99_ms=None), 1.5, 1000.0), 2.0),
        # one chunk (no gaps: they count 0, not 1 ms): the first chunk alone, 1 ms of 1000
        ((0.0, 1000.0, summary(first_chunk_ms=1.0, gap_p99_ms=None), 1000.0, 100.0), 0.001),
        # the gaps' p99 over a 1.5 ms threshold
        ((0.0, 1000.0, summary(first_chunk_ms=0.0, gap_p99_ms=3.0), 1000.0, 1.5), 2.0),
        # a response: its total over a 1.5 ms threshold
        ((3.0, 1.5, None, None, None), 2.0),
        # a threshold under 1 ms counts as 1 ms
        ((3.0, 0.5, None, None, None), 3.0),
    ],
    ids=["first-chunk", "one-chunk", "gaps", "total", "floor"],
)
def test_slowness_is_the_phase_over_its_threshold_at_thresholds_near_the_1_ms_floor(args, expected):
    """Thresholds between 1 and 2 ms: a floor of anything over 1 ms would read them as 2 ms. Edge cases by their
    thresholds (production ones are hundreds of ms)."""
    assert slowness(*args) == expected


def test_a_long_stream_that_flowed_ranks_by_its_phases_not_its_length():
    """4 s over a 200 ms threshold (20x as a response), streamed with its first chunk at 3 ms (threshold 6 ms)
    and its gaps' p99 at 2 ms (threshold 8 ms): judged by its phases, slowness max(0.5, 0.25) = 0.5, not slow."""
    judged = judge(analysis(4000.0, {"decode": 4000.0}), summary(), StreamThresholds(6.0, 8.0))
    assert judged == (False, None, 0.5, "decode", 0.0, 6.0, 8.0)


def test_a_response_under_its_threshold_has_no_reason():
    """Not streamed and not slow (100 ms of 200): no reason, slowness 0.5."""
    assert judge(analysis(100.0, {"decode": 100.0}), None, None) == (False, None, 0.5, "decode", 0.0, None, None)


# --- offloaded calls ------------------------------------------------------------------------------------------


def test_a_call_that_never_queued_and_ran_no_measurable_time_has_zero_stretches_not_none():
    """A call with a 0 ns run and no queue, send or return child (the exporter leaves zero-length ones out): its
    stretches are 0.0 ms each, numbers the rules add and compare (a missing queue is 0, not None, nor 1 ms; a
    0 ns run is 0 ms, not 1 ns), and the worker reported it."""
    stages = offload(queue=0.0, send=0.0, run=0.0, ret=0.0)
    [call] = offload_calls(stages)
    assert call == OffloadedCall("tokenize", stages[0].offload, 0.0, 0.0, 0.0, 0.0, True)
