"""Each diagnosis rule fires on its own signature and stays quiet on a healthy trace."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_builders import MS, cpu, offload, run

from conftest import rules_that_cannot_fire
from stagetrace.analysis import BatchInfo, DiagnosisThresholds, StageSample, TraceSignals, analyse_trace
from stagetrace.analysis.diagnosis import ADVICE, RULE_CODES, RULES
from stagetrace.analysis.signals import ProcessLoad
from stagetrace.analysis.streams import StreamSummary

HEALTHY = [cpu("decode", 0, 30, cpu_ms=29, blocked_ms=0.5, runqueue_ms=0.5), cpu("post", 30, 95, cpu_ms=64)]


def test_healthy_trace_fires_nothing():
    assert run(HEALTHY, signals=TraceSignals(gpu_utilization=0.9, gil_pressure_ms=0.1, loop_lag_ms=1)) == {}


class RecordingThresholds:
    """DiagnosisThresholds that note which fields are read."""

    def __init__(self, real: DiagnosisThresholds) -> None:
        self._real = real
        self.read: set[str] = set()

    def __getattr__(self, name: str):
        self.read.add(name)
        return getattr(self._real, name)


KINDS = ("cpu", "io", "wait", "gpu", "h2d", "d2h")


@st.composite
def traces(draw):
    """Stages and signals of every kind the rules read, with values around their thresholds."""
    ms = st.floats(0, 400, allow_nan=False) | st.none()
    stages = []
    for i in range(draw(st.integers(0, 6))):
        start = draw(st.integers(0, 300))
        end = start + draw(st.integers(0, 300))
        batch = None
        if draw(st.booleans()):
            batch = BatchInfo(
                "b",
                4,
                draw(st.integers(1, 16)),
                0,
                1,
                draw(st.sampled_from((0, 8, 16))),
                *draw(st.sampled_from(((0, 0), (1, 2)))),
                draw(ms),
                draw(ms),
            )
        stages.append(
            StageSample(
                draw(st.sampled_from(("decode", "infer", "event_loop.wait", f"s{i}"))),
                draw(st.sampled_from(KINDS)),
                start * MS,
                end * MS,
                i + 1,
                blocked_ms=draw(ms),
                runqueue_ms=draw(ms),
                not_gil_ms=draw(ms),
                others_runqueue_ms=draw(ms),
                others_cpu_ms=draw(ms),
                on_event_loop=draw(st.booleans()),
                queue_saturated=draw(st.sampled_from((None, True, False))),
                h2d_bytes=draw(st.sampled_from((None, 1 << 20))),
                h2d_pinned=draw(st.sampled_from((None, False, True))),
                gpu_ms=draw(ms),
                batch=batch,
            )
        )
    stream = None
    if draw(st.booleans()):
        stream = StreamSummary(
            draw(st.integers(1, 100)),
            10.0,
            draw(st.floats(0, 300)),
            draw(ms),
            draw(ms),
            draw(ms),
            draw(st.floats(0, 300)),
            False,
            None,
            None,
            {},
            {"decode": draw(st.floats(0, 300))},
            None,
        )
    signals = TraceSignals(
        gpu_utilization=draw(st.floats(0, 1) | st.none()),
        gil_pressure_ms=draw(st.floats(0, 10) | st.none()),
        cpu_pressure_ms=draw(st.floats(0, 10) | st.none()),
        loop_lag_ms=draw(ms),
        loop_held_ms=draw(ms),
        stream=stream,
    )
    return stages, signals


@settings(max_examples=300, deadline=None)
@given(traces())
def test_each_rule_reads_only_the_thresholds_it_declares(trace):
    stages, signals = trace
    analysis = analyse_trace(0, 400 * MS, stages, 200)
    for rule in RULES:
        th = RecordingThresholds(DiagnosisThresholds())
        rule.check(analysis, stages, signals, th)  # type: ignore[arg-type]
        assert th.read <= set(rule.thresholds), (rule.code, th.read - set(rule.thresholds))


def test_every_threshold_belongs_to_a_rule_and_every_rule_has_advice():
    declared = {name for rule in RULES for name in rule.thresholds}
    fields = set(DiagnosisThresholds.__dataclass_fields__)
    assert declared == fields, (declared - fields, fields - declared)
    assert all(rule.advice.strip() and rule.code.isupper() for rule in RULES)
    assert len({rule.code for rule in RULES}) == len(RULES)


def test_gpu_starved_needs_low_utilisation_and_cpu_majority():
    stages = [cpu("decode", 0, 80), StageSample("infer", "gpu", 80 * MS, 90 * MS, gpu_ms=10)]
    found = run(stages, signals=TraceSignals(gpu_utilization=0.12))
    assert "GPU_STARVED" in found and found["GPU_STARVED"].stage == "decode"
    assert "GPU_STARVED" not in run(stages, signals=TraceSignals(gpu_utilization=0.8))
    assert "GPU_STARVED" not in run(stages)  # no NVML: no claim


def test_pageable_h2d_only_for_real_device_copies():
    pageable = StageSample("h2d", "h2d", 0, 5 * MS, gpu_ms=4.0, h2d_bytes=4 << 20, h2d_pinned=False)
    assert "PAGEABLE_H2D" in run([pageable])
    pinned = StageSample("h2d", "h2d", 0, 5 * MS, gpu_ms=1.0, h2d_bytes=4 << 20, h2d_pinned=True)
    assert "PAGEABLE_H2D" not in run([pinned])
    cpu_only = StageSample("h2d", "h2d", 0, 5 * MS, gpu_ms=None, h2d_bytes=4 << 20, h2d_pinned=False)
    assert "PAGEABLE_H2D" not in run([cpu_only])


def test_blocked_stage_is_gil_contention_or_lock_wait_by_gil_pressure():
    blocked = [cpu("tokenize", 0, 50, cpu_ms=10, blocked_ms=38, runqueue_ms=2)]
    gil = run(blocked, signals=TraceSignals(gil_pressure_ms=6.5))
    assert "GIL_CONTENTION" in gil and "LOCK_OR_IO_WAIT" not in gil
    lock = run(blocked, signals=TraceSignals(gil_pressure_ms=0.1))
    assert "LOCK_OR_IO_WAIT" in lock and "GIL_CONTENTION" not in lock
    assert lock["LOCK_OR_IO_WAIT"].stage == "tokenize"


def test_short_stages_never_trigger_per_stage_rules():
    tiny = [cpu("tiny", 0, 2, cpu_ms=0.1, blocked_ms=1.9, runqueue_ms=1.5)]
    assert run(tiny, total_ms=3, signals=TraceSignals(gil_pressure_ms=9)) == {}


def test_cpu_oversubscribed_from_runqueue_share():
    assert "CPU_OVERSUBSCRIBED" in run([cpu("resize", 0, 40, cpu_ms=20, blocked_ms=2, runqueue_ms=18)])


def test_event_loop_blocked_by_sync_stage_on_loop_or_by_lag():
    assert "EVENT_LOOP_BLOCKED" in run([cpu("decode", 0, 40, on_event_loop=True)])
    assert "EVENT_LOOP_BLOCKED" not in run([cpu("decode", 0, 10, on_event_loop=True)])
    assert "EVENT_LOOP_BLOCKED" in run(HEALTHY, signals=TraceSignals(loop_lag_ms=120))


def test_queueing_from_wait_stages():
    found = run([cpu("threadpool.wait", 0, 40, kind="wait"), cpu("work", 40, 100)])
    assert found["QUEUEING"].stage == "threadpool.wait"
    assert "QUEUEING" not in run([cpu("threadpool.wait", 0, 2, kind="wait"), cpu("work", 2, 100)])


def test_a_wait_while_the_pool_had_capacity_is_not_queueing():
    saturated = [cpu("threadpool.wait", 0, 40, kind="wait", queue_saturated=True), cpu("work", 40, 100)]
    assert "QUEUEING" in run(saturated)
    free = [cpu("threadpool.wait", 0, 40, kind="wait", queue_saturated=False), cpu("work", 40, 100)]
    assert "QUEUEING" not in run(free)


def test_blocked_stage_without_gil_measurement_is_not_blamed_on_a_lock():
    blocked = [cpu("tokenize", 0, 50, cpu_ms=10, blocked_ms=38, runqueue_ms=2)]
    assert {"GIL_CONTENTION", "LOCK_OR_IO_WAIT"}.isdisjoint(run(blocked))


def test_untracked_time_needs_stages_and_a_large_share():
    assert "UNTRACKED_TIME" in run([cpu("decode", 0, 20)])
    assert "UNTRACKED_TIME" not in run([])  # a trace with no stages is not a stagetrace pipeline


def test_thresholds_are_configurable():
    stages = [cpu("decode", 0, 20)]
    assert "UNTRACKED_TIME" not in run(stages, thresholds=DiagnosisThresholds(untracked_share=0.9))


def firing_cases():
    """One trace per rule that fires it (the messages' test and the unreachable thresholds' test)."""
    return {
        "GPU_STARVED": ([cpu("decode", 0, 80)], TraceSignals(gpu_utilization=0.1)),
        "PAGEABLE_H2D": (
            [StageSample("h2d", "h2d", 0, MS, gpu_ms=1, h2d_bytes=1 << 20, h2d_pinned=False)],
            TraceSignals(),
        ),
        "GIL_CONTENTION": ([cpu("t", 0, 50, blocked_ms=40)], TraceSignals(gil_pressure_ms=5)),
        "LOCK_OR_IO_WAIT": ([cpu("t", 0, 50, blocked_ms=40)], TraceSignals(gil_pressure_ms=0.1)),
        "OFF_CPU_WAIT": ([cpu("t", 0, 50, blocked_ms=40)], TraceSignals()),
        "CPU_OVERSUBSCRIBED": ([cpu("t", 0, 50, runqueue_ms=30)], TraceSignals()),
        "SERVICE_AT_CAPACITY": (
            [cpu("t", 0, 50, runqueue_ms=30)],
            TraceSignals(load=ProcessLoad(cpus=2, cpus_used=2.0, runnable=8.5, requests=8.0)),
        ),
        "EVENT_LOOP_BLOCKED": ([cpu("t", 0, 50, on_event_loop=True)], TraceSignals()),
        "QUEUEING": ([cpu("q", 0, 50, kind="wait")], TraceSignals()),
        "UNTRACKED_TIME": ([cpu("t", 0, 5)], TraceSignals()),
        "BATCH_WAIT": (batch_member(formation=60, busy=0), TraceSignals()),
        "BATCH_UNDERFILLED": (batch_member(formation=5, busy=30, items=2, gpu_ms=8), TraceSignals()),
        "STREAM_CPU_BOUND": (STREAM_STAGES, TraceSignals(stream=streamed())),
        "SLOW_CONSUMER": (STREAM_STAGES, TraceSignals(stream=streamed(send_wait_ms=40.0))),
        "STREAM_STALL": (STREAM_STAGES, TraceSignals(stream=streamed(gap_max_ms=150.0))),
        "POOL_SATURATED": (offload(queue=40, in_flight=5), TraceSignals()),
        "IPC_BOUND": (offload(send=20, ret=10), TraceSignals()),
        "WORKER_OVERSUBSCRIBED": (offload(run=40, run_fields={"runqueue_ms": 20.0}), TraceSignals()),
        "WORKER_COLD_START": (offload(queue=60, seq=1), TraceSignals()),
    }


# A stream: a GPU decode step and a CPU detokenize per chunk, the latter the larger.
STREAM_STAGES = [StageSample("decode", "gpu", 10 * MS, 40 * MS), cpu("detokenize", 40, 95)]


def streamed(**changes):
    fields = dict(
        chunks=21, first_chunk_ms=10.0, streaming_ms=85.0, gap_p50_ms=4.0, gap_p99_ms=5.0, gap_max_ms=5.0,
        send_wait_ms=0.0, disconnected=False, first_chunk_bottleneck=None, gap_bottleneck="detokenize",
        first_chunk_breakdown={}, gap_breakdown={"decode": 30.0, "detokenize": 55.0}, gaps=None,
    )  # fmt: skip
    fields.update(changes)
    if changes:  # a consumer or a stall alone: the CPU stage no larger than the model's step
        fields["gap_breakdown"] = {"decode": 50.0, "detokenize": 35.0}
    return StreamSummary(**fields)


@pytest.mark.parametrize("code", RULE_CODES)
def test_diagnosis_message_is_specific(code):
    stages, sig = firing_cases()[code]
    d = run(stages, signals=sig)[code]
    assert any(ch.isdigit() for ch in d.message)
    assert d.advice == ADVICE[code]


@pytest.mark.parametrize("code", RULE_CODES)
def test_the_unreachable_thresholds_silence_every_rule(code):
    stages, sig = firing_cases()[code]
    assert run(stages, signals=sig, thresholds=rules_that_cannot_fire()) == {}


def batch_member(*, formation, busy, items=8, max_size=16, gpu_ms=None, run_ms=40, total_ms=100):
    """A member's stages as the exporter sees them: its wait (formation then the previous batch's run), the
    batch stage, and the batch's GPU stage under it; the request's own work fills the rest."""
    wait_end = formation + busy
    common = ("b1", 3, items, 0, 1, max_size)
    wait = cpu("infer.queue", 0, wait_end, kind="wait", batch=BatchInfo(*common, formation_ms=formation, busy_ms=busy))
    head = cpu(
        "infer", wait_end, wait_end + run_ms, span_id=7, batch=BatchInfo(*common, link_trace_id=5, link_span_id=6)
    )
    forward = cpu(
        "forward",
        wait_end + 1,
        wait_end + run_ms - 1,
        kind="gpu",
        gpu_ms=gpu_ms,
        parent_stage_id=7,
        batch=BatchInfo(*common),
    )
    post = cpu("post", wait_end + run_ms, total_ms)
    return [wait, head, forward, post]


def test_batch_wait_fires_when_forming_the_batch_dominates():
    assert "BATCH_WAIT" in run(batch_member(formation=45, busy=0))
    assert "BATCH_WAIT" not in run(batch_member(formation=35, busy=0))  # 35 % < 40 %
    assert "BATCH_WAIT" not in run(batch_member(formation=8, busy=0, run_ms=2, total_ms=12))  # under 10 ms
    assert "BATCH_WAIT" in run(batch_member(formation=35, busy=0), thresholds=DiagnosisThresholds(batch_wait_share=0.3))


def test_a_batch_wait_is_queueing_only_for_the_time_behind_the_previous_batch():
    forming = run(batch_member(formation=50, busy=0))
    assert "QUEUEING" not in forming and forming["BATCH_WAIT"].stage == "infer.queue"
    behind = run(batch_member(formation=5, busy=30))
    assert "QUEUEING" in behind and "BATCH_WAIT" not in behind
    assert "30.0 ms" in behind["QUEUEING"].message


def test_batch_underfilled_needs_small_batches_a_queue_and_an_idle_gpu():
    # 2 of 16 items while the request queued 30 ms behind the previous batch, GPU stage busy 95 % of the run
    busy_gpu = batch_member(formation=5, busy=30, items=2, gpu_ms=38)
    assert "BATCH_UNDERFILLED" not in run(busy_gpu)  # the GPU is the limit, not the batcher
    idle_gpu = batch_member(formation=5, busy=30, items=2, gpu_ms=8)
    found = run(idle_gpu)
    assert found["BATCH_UNDERFILLED"].stage == "infer"
    assert "2 of 16 items (12%)" in found["BATCH_UNDERFILLED"].message
    assert "BATCH_UNDERFILLED" in run(busy_gpu, signals=TraceSignals(gpu_utilization=0.1))  # NVML says idle
    assert "BATCH_UNDERFILLED" not in run(batch_member(formation=5, busy=30, items=8, gpu_ms=8))  # half full
    assert "BATCH_UNDERFILLED" not in run(batch_member(formation=35, busy=0, items=2, gpu_ms=8))  # no queue
    assert "BATCH_UNDERFILLED" not in run(batch_member(formation=5, busy=30, items=2, max_size=0, gpu_ms=8))


# Every rule's thresholds, each tested just below and at (or just above) its default.
BOUNDARIES = [
    # (code, stages below, signals below, stages at, signals at)
    ("EVENT_LOOP_BLOCKED", HEALTHY, TraceSignals(loop_lag_ms=49.9), HEALTHY, TraceSignals(loop_lag_ms=50.0)),
    (
        "EVENT_LOOP_BLOCKED",
        [cpu("decode", 0, 19.9, on_event_loop=True)],
        TraceSignals(),
        [cpu("decode", 0, 20.0, on_event_loop=True)],
        TraceSignals(),
    ),
    (
        "QUEUEING",
        [cpu("q", 0, 19.9, kind="wait"), cpu("w", 19.9, 100)],  # 19.9 % of the request
        TraceSignals(),
        [cpu("q", 0, 20.1, kind="wait"), cpu("w", 20.1, 100)],
        TraceSignals(),
    ),
    ("UNTRACKED_TIME", [cpu("d", 0, 50.1)], TraceSignals(), [cpu("d", 0, 49.9)], TraceSignals()),
    (
        "GPU_STARVED",
        [cpu("decode", 0, 80)],
        TraceSignals(gpu_utilization=0.30),
        [cpu("decode", 0, 80)],
        TraceSignals(gpu_utilization=0.29),
    ),
    (
        "GPU_STARVED",  # CPU-side stages must hold more than half of the request
        [cpu("decode", 0, 50), StageSample("infer", "gpu", 50 * MS, 100 * MS, gpu_ms=50)],
        TraceSignals(gpu_utilization=0.1),
        [cpu("decode", 0, 51), StageSample("infer", "gpu", 51 * MS, 100 * MS, gpu_ms=49)],
        TraceSignals(gpu_utilization=0.1),
    ),
    (
        "PAGEABLE_H2D",
        [StageSample("h2d", "h2d", 0, MS, gpu_ms=1, h2d_bytes=64 * 1024 - 1, h2d_pinned=False)],
        TraceSignals(),
        [StageSample("h2d", "h2d", 0, MS, gpu_ms=1, h2d_bytes=64 * 1024, h2d_pinned=False)],
        TraceSignals(),
    ),
    (
        "GIL_CONTENTION",
        [cpu("t", 0, 50, blocked_ms=40)],
        TraceSignals(gil_pressure_ms=0.99),
        [cpu("t", 0, 50, blocked_ms=40)],
        TraceSignals(gil_pressure_ms=1.0),
    ),
    (
        "LOCK_OR_IO_WAIT",  # blocked at least 25 % of the stage and 5 ms
        [cpu("t", 0, 50, blocked_ms=12.49)],
        TraceSignals(gil_pressure_ms=0.1),
        [cpu("t", 0, 50, blocked_ms=12.5)],
        TraceSignals(gil_pressure_ms=0.1),
    ),
    (
        "CPU_OVERSUBSCRIBED",  # run queue at least 30 % of the stage and 5 ms
        [cpu("t", 0, 16, runqueue_ms=4.9)],
        TraceSignals(),
        [cpu("t", 0, 16, runqueue_ms=5.0)],
        TraceSignals(),
    ),
]


@pytest.mark.parametrize(("code", "below", "sig_below", "at", "sig_at"), BOUNDARIES, ids=lambda v: str(v)[:20])
def test_each_threshold_on_both_sides(code, below, sig_below, at, sig_at):
    assert code not in run(below, signals=sig_below)
    assert code in run(at, signals=sig_at)


def test_event_loop_blocked_is_never_about_a_gpu_stage():
    gpu_on_loop = [StageSample("infer", "gpu", 0, 40 * MS, gpu_ms=40, on_event_loop=True)]
    assert "EVENT_LOOP_BLOCKED" not in run(gpu_on_loop)


def test_the_cpu_rules_classify_each_stage_once_a_trace_and_name_what_they_named_alone(monkeypatch):
    """Four rules read each CPU stage's blocked cause; ``diagnose`` classifies it once for all of them. The
    memo must not change a verdict: each rule run alone on the plain stages names the same stage."""
    from stagetrace.analysis import causes, diagnosis

    stages = [
        cpu("gil", 0, 30, blocked_ms=20, runqueue_ms=0.5, cpu_ms=9.5),
        cpu("lock", 30, 60, blocked_ms=20, runqueue_ms=0.5, cpu_ms=9.5, not_gil_ms=18),
        cpu("queued", 60, 90, blocked_ms=4, runqueue_ms=20, cpu_ms=6),
    ]
    signals = TraceSignals(gil_pressure_ms=5)
    classified = []
    real = causes.blocked_cause
    counting = lambda s, sig, th: classified.append(s.name) or real(s, sig, th)  # noqa: E731
    monkeypatch.setattr(causes, "blocked_cause", counting)
    monkeypatch.setattr(diagnosis, "blocked_cause", counting, raising=False)  # wherever a rule reads it from
    found = run(stages, signals=signals)
    assert sorted(classified) == ["gil", "lock", "queued"]
    assert {"GIL_CONTENTION", "LOCK_OR_IO_WAIT", "CPU_OVERSUBSCRIBED"} <= set(found)
    analysis = analyse_trace(0, 100 * MS, stages, 200)
    for rule in diagnosis.RULES:
        if rule.requires - {diagnosis.Signal.STAGE_CPU}:
            continue  # GPU or stream signals this trace lacks: diagnose skips the rule
        alone = rule.check(analysis, stages, signals, DiagnosisThresholds())
        said = found.get(rule.code)
        assert (alone and (alone.message, alone.stage)) == (said and (said.message, said.stage)), rule.code


def test_judged_stages_classify_again_for_other_signals_or_thresholds():
    from stagetrace.analysis.causes import GIL, LOCK, JudgedStages, blocked_causes

    th = DiagnosisThresholds()
    blocked = cpu("t", 0, 50, cpu_ms=10, blocked_ms=38, runqueue_ms=2)
    stages = JudgedStages([blocked], TraceSignals(gil_pressure_ms=6.5), th)
    assert blocked_causes(stages, stages.signals, th) == ((stages[0], GIL),)
    assert blocked_causes(stages, TraceSignals(gil_pressure_ms=0.1), th) == ((stages[0], LOCK),)
    assert blocked_causes(stages, stages.signals, DiagnosisThresholds.silent()) == ()
    assert blocked_causes(stages, stages.signals, th) == ((stages[0], GIL),)  # the memo, as it was made
