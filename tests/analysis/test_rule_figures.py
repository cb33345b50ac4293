"""The figures a finding reports, on hand-computed traces: the ms and shares in each message and evidence, the
stage it names when two compete (each pair chosen so that the wrong pick reads differently), a zero measured
as zero (not as a missing reading), and each rule exactly at its floor. A 100 ms root unless a case says."""

from __future__ import annotations

import pytest
from trace_builders import cpu, offload, run

from stagetrace.analysis import BatchInfo, DiagnosisThresholds, TraceSignals
from stagetrace.analysis.signals import ProcessLoad
from stagetrace.analysis.streams import StreamSummary
from stagetrace.conventions import EVENT_LOOP_WAIT


def figures(found: dict, code: str) -> tuple[str, str | None, str | None]:
    d = found[code]
    return d.message, d.stage, d.evidence


def saturated(name="tokenize", queue=30.0, run=69.0, **kw):
    """A call to a pool of 2 workers with 3 calls in it (this one included): every worker busy."""
    return offload(name, queue=queue, run=run, in_flight=3, **kw)


def first_task(name="tokenize", queue=80.0, run=19.0, **kw):
    """A call that was its worker's first task, to a pool with a worker to spare: its queue is the start."""
    return offload(name, queue=queue, run=run, seq=1, **kw)


def without_start_method(stages):
    """The same call from an executor that does not say how its workers start (a pool built elsewhere)."""
    stages[0].offload = stages[0].offload._replace(start_method=None)
    return stages


OFF_CPU = "'s' was off-CPU 50.0 ms of its 100.0 ms, for the GIL or for a lock or I/O; the signals cannot tell which"
SHORT_OF_CPUS = (
    "the host was short of CPUs meanwhile (its own run-queue wait 0.0 ms, woken threads 1.5 ms), and there a wait "
    "can be for a GIL holder the scheduler preempted"
)
PREEMPTED = (
    "its off-CPU waits were as short as GIL handoffs, and a GIL holder preempted by the scheduler keeps the other "
    "threads waiting"
)
WOKEN = "the process's woken threads waited 2.0 ms on average for a CPU"


# --- OFF_CPU_WAIT: measured zeros read as zeros --------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "signals", "why"),
    [
        pytest.param(
            cpu("s", 0, 100, blocked_ms=50, cpu_ms=50, others_cpu_ms=0.0, others_runqueue_ms=0.0),
            TraceSignals(),
            "at most 0.0 ms of it was for the GIL (the process's other threads ran 0.0 ms and waited 0.0 ms for a "
            "CPU meanwhile, the only time one of them can hold it), and the rest was a lock or I/O, or the hypervisor "
            "of a virtual machine taking the CPU, which no run queue shows",
            id="alone-in-its-process",
        ),
        pytest.param(
            cpu("s", 0, 100, blocked_ms=50, runqueue_ms=0.0, cpu_ms=50),
            TraceSignals(cpu_pressure_ms=1.5),
            SHORT_OF_CPUS,
            id="host-short-own-queue-zero",
        ),
        pytest.param(
            cpu("s", 0, 100, blocked_ms=50, runqueue_ms=0.0, cpu_ms=50, others_cpu_ms=0.0, others_runqueue_ms=30.0),
            TraceSignals(cpu_pressure_ms=1.5),
            f"{SHORT_OF_CPUS}: the process's other threads, the GIL's would-be holders, waited 30.0 ms for a CPU "
            "beside 0.0 ms on one",
            id="holders-queued-never-ran",
        ),
    ],
)
def test_off_cpu_wait_evidence_reports_measured_zeros_as_zero(stage, signals, why):
    """A reading of 0 ms is the point of the evidence (no other thread could have held the GIL; the stage itself
    never queued; its would-be holders never got a CPU): printed as anything else it argues the other way."""
    assert figures(run([stage], signals=signals), "OFF_CPU_WAIT") == (OFF_CPU, "s", why)


# --- CPU_OVERSUBSCRIBED / SERVICE_AT_CAPACITY: which stage lost most to the CPUs -------------------------


@pytest.mark.parametrize(
    ("stages", "signals", "expected"),
    [
        pytest.param(
            [cpu("a", 0, 100, runqueue_ms=40, cpu_ms=60), cpu("b", 0, 100, blocked_ms=50, runqueue_ms=30, cpu_ms=20)],
            TraceSignals(),
            (
                "'b' waited 30.0 ms of its 100.0 ms for a CPU (run queue), and 50.0 ms more for GIL holders the "
                "scheduler preempted",
                "b",
                PREEMPTED,
            ),
            id="queue-plus-preempted-holders-beats-queue-alone",
        ),
        pytest.param(
            [
                cpu("a", 0, 100, runqueue_ms=50.5, cpu_ms=49.5),
                cpu("b", 0, 100, blocked_ms=50, runqueue_ms=0.0, cpu_ms=50),
            ],
            TraceSignals(cpu_pressure_ms=2.0),
            ("'a' waited 50.5 ms of its 100.0 ms for a CPU (run queue)", "a", WOKEN),
            id="a-zero-queue-adds-nothing-to-preempted-holders",
        ),
        pytest.param(
            [cpu("a", 0, 100, runqueue_ms=40, blocked_ms=20, cpu_ms=40), cpu("b", 0, 100, runqueue_ms=50, cpu_ms=50)],
            TraceSignals(),
            ("'b' waited 50.0 ms of its 100.0 ms for a CPU (run queue)", "b", None),
            id="blocked-time-not-on-holders-does-not-count",
        ),
        pytest.param(
            [
                cpu("a", 0, 100, runqueue_ms=40, cpu_ms=60),
                cpu("b", 0, 100, blocked_ms=40.5, runqueue_ms=0.0, cpu_ms=59.5),
            ],
            TraceSignals(cpu_pressure_ms=2.0),
            (
                "'b' waited 0.0 ms of its 100.0 ms for a CPU (run queue), and 40.5 ms more for GIL holders the "
                "scheduler preempted",
                "b",
                f"{PREEMPTED}; {WOKEN}",
            ),
            id="preempted-holders-alone-beat-a-shorter-queue",
        ),
    ],
)
def test_cpu_oversubscribed_names_the_stage_that_lost_the_most(stages, signals, expected):
    """What a stage lost to the CPUs is its own run queue plus, only where the cause was preempted GIL holders,
    that time too; each pair is close enough that a key which drops, subtracts or pads either part names the
    other stage, and a stage that measured no run queue must read 0.0 ms, not 1.0."""
    assert figures(run(stages, signals=signals), "CPU_OVERSUBSCRIBED") == expected


def test_cpu_oversubscribed_by_threads_with_no_request_count_says_so_plainly():
    """Where the load read no requests in flight, the evidence leaves that clause out rather than filling it."""
    load = ProcessLoad(cpus=2, cpus_used=2.0, runnable=3.0, requests=None)
    found = run([cpu("a", 0, 100, runqueue_ms=40, cpu_ms=60)], signals=TraceSignals(load=load))
    assert figures(found, "CPU_OVERSUBSCRIBED") == (
        "'a' waited 40.0 ms of its 100.0 ms for a CPU (run queue)",
        "a",
        "3.0 of the process's threads were running or waiting for a CPU on average, on 2 CPUs: threads beside the "
        "requests' own (intra-op pools of torch, BLAS or OpenMP, worker pools) outnumber the CPUs",
    )


def test_service_at_capacity_keeps_the_time_lost_to_preempted_holders():
    """At capacity the stage's wait behind preempted GIL holders is most of what it lost (50 of 80 ms): the
    finding must still say so."""
    load = ProcessLoad(cpus=2, cpus_used=2.0, runnable=4.0, requests=4.0)
    found = run([cpu("b", 0, 100, blocked_ms=50, runqueue_ms=30, cpu_ms=20)], signals=TraceSignals(load=load))
    assert figures(found, "SERVICE_AT_CAPACITY") == (
        "'b' waited 30.0 ms of its 100.0 ms for a CPU (run queue), and 50.0 ms more for GIL holders the scheduler "
        "preempted, with 4.0 requests in flight on 2 CPUs",
        "b",
        "the process used 2.0 CPUs, and 4.0 of its threads were running or waiting for a CPU on average: about one "
        "a request, so the requests themselves, not threads beside them, outnumber the CPUs",
    )


# --- EVENT_LOOP_BLOCKED --------------------------------------------------------------------------------


def test_a_loop_wait_with_a_named_holder_is_blamed_on_it_though_the_loop_thread_itself_idled():
    """The loop monitor saw its own thread idle (0 ms held), yet another request's sync stage is named as
    the holder: the 30 ms wait is that stage's, and the finding says whose."""
    signals = TraceSignals(blocked_by=("slow@abc",), loop_held_ms=0.0, loop_lag_ms=30.0)
    found = run([cpu(EVENT_LOOP_WAIT, 0, 30, kind="wait")], signals=signals)
    assert figures(found, "EVENT_LOOP_BLOCKED") == (
        "the request waited 30.0 ms (30%) for the event loop while other requests' sync stages held it",
        EVENT_LOOP_WAIT,
        "held longest by 'slow' of trace abc",
    )


def test_work_holding_the_loop_exactly_the_lag_threshold_is_reported():
    """Edge: 50 ms held is event_loop_lag_ms exactly, and the floor is inclusive."""
    found = run([cpu("handler", 0, 40)], signals=TraceSignals(loop_held_ms=50.0, loop_lag_ms=50.0))
    assert figures(found, "EVENT_LOOP_BLOCKED") == (
        "work on the event-loop thread held the loop 50.0 ms during the request (lag 50.0 ms)",
        None,
        None,
    )


# --- the offload rules: one call's figures --------------------------------------------------------------

SATURATED_EVIDENCE = "3 calls were in the pool for its 2 workers when it was submitted"


def test_pool_saturated_reports_one_calls_wait_and_share():
    """One call: no "over 1 calls", and the share is the wait over the root (30 of 100 ms)."""
    assert figures(run(saturated()), "POOL_SATURATED") == (
        "'tokenize' waited 30.0 ms (30% of the request) for a worker of its ProcessPoolExecutor",
        "tokenize",
        SATURATED_EVIDENCE,
    )


@pytest.mark.parametrize(
    ("second_queue", "message"),
    [
        pytest.param(
            0.0, "'tokenize' waited 30.0 ms (30% of the request) for a worker of its ProcessPoolExecutor", id="no-wait"
        ),
        pytest.param(
            0.5,
            "'tokenize' waited 30.5 ms over 2 calls (30% of the request) for a worker of its ProcessPoolExecutor",
            id="half-a-ms",
        ),
    ],
)
def test_pool_saturated_counts_every_call_that_queued_and_no_other(second_queue, message):
    """A second call submitted to the same full pool that got a worker at once did not queue, and is not one of
    the calls that waited; one that waited half a millisecond is."""
    stages = saturated(queue=30, run=30) + saturated("b", queue=second_queue, run=10, start=62, span_id=950)
    assert figures(run(stages), "POOL_SATURATED") == (message, "tokenize", SATURATED_EVIDENCE)


def test_pool_saturated_exactly_at_its_floor_fires():
    """Edge: 10 ms queued is pool_saturated_min_ms exactly (and 25 % of a 40 ms root, the share exactly)."""
    found = run(saturated(queue=10, run=29), total_ms=40)
    assert figures(found, "POOL_SATURATED")[0] == (
        "'tokenize' waited 10.0 ms (25% of the request) for a worker of its ProcessPoolExecutor"
    )


IPC_MESSAGE = (
    "handing 'tokenize' its arguments and taking its result back took 25.0 ms (25% of the request): 15.0 ms "
    "there, 10.0 ms back"
)


@pytest.mark.parametrize(
    ("sizes", "evidence"),
    [
        pytest.param({}, "1000 B there and 100 B back a call", id="sizes-read"),
        pytest.param({"args_bytes": None, "result_bytes": None}, None, id="sizes-unknown"),
    ],
)
def test_ipc_bound_reports_the_transfer_and_the_sizes_it_read(sizes, evidence):
    """15 ms there and 10 ms back of a 100 ms request; the evidence gives both sizes, or nothing where the
    executor read neither."""
    found = run(offload(send=15, ret=10, run=74, **sizes))
    assert figures(found, "IPC_BOUND") == (IPC_MESSAGE, "tokenize", evidence)


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        pytest.param(
            first_task(),
            "'tokenize' was the first task of worker 4242, started by fork, and waited 80.0 ms (80% of the request) "
            "for it to start",
            id="start-method-read",
        ),
        pytest.param(
            without_start_method(first_task()),
            "'tokenize' was the first task of worker 4242, and waited 80.0 ms (80% of the request) for it to start",
            id="start-method-unknown",
        ),
    ],
)
def test_worker_cold_start_reports_the_wait_and_how_the_worker_started(stages, message):
    """80 ms of a 100 ms request waiting for a worker to start, and how it was started where that is known."""
    assert figures(run(stages), "WORKER_COLD_START") == (message, "tokenize", None)


@pytest.mark.parametrize(
    ("stages", "code", "message", "evidence"),
    [
        pytest.param(
            # 'a' (30 ms) sorts before 'b' (5 ms) and is listed after it: only the wait picks 'a'
            saturated("b", queue=5, run=10) + saturated("a", queue=30, run=20, start=17, span_id=950),
            "POOL_SATURATED",
            "'a' waited 35.0 ms over 2 calls (35% of the request) for a worker of its ProcessPoolExecutor",
            SATURATED_EVIDENCE,
            id="POOL_SATURATED-queued-longest",
        ),
        pytest.param(
            # 'a' (25 ms) sorts before 'b' (5 ms) and is listed after it: only the transfer picks 'a'
            offload("b", send=3, ret=2, run=20) + offload("a", send=15, ret=10, run=20, start=27, span_id=950),
            "IPC_BOUND",
            "handing 'a' its arguments and taking its result back took 30.0 ms (30% of the request): 15.0 ms "
            "there, 10.0 ms back",
            "1000 B there and 100 B back a call",
            id="IPC_BOUND-transfer-took-longest",
        ),
        pytest.param(
            # 'b' waited 10 ms (under the 50 ms floor), 'a' 60 ms: judged on 'b' (the call listed first) nothing
            # fires
            first_task("b", queue=10, run=10) + first_task("a", queue=60, run=10, start=22, span_id=950),
            "WORKER_COLD_START",
            "'a' was the first task of worker 4242, started by fork, and waited 60.0 ms (60% of the request) for "
            "it to start",
            None,
            id="WORKER_COLD_START-waited-longest",
        ),
    ],
)
def test_an_offload_rule_names_the_call_its_figure_picks_of_two(stages, code, message, evidence):
    """Two calls of one request, the one the rule's figure picks listed second and named first in order: a
    pick by list position or by name shows as the other call (or no finding)."""
    assert figures(run(stages), code) == (message, "a", evidence)


def test_worker_cold_start_exactly_at_its_share_fires():
    """Edge: 50 ms of a 200 ms root is cold_start_share (a quarter) exactly, and cold_start_min_ms too."""
    found = run(first_task(queue=50, run=100), total_ms=200)
    assert figures(found, "WORKER_COLD_START")[0] == (
        "'tokenize' was the first task of worker 4242, started by fork, and waited 50.0 ms (25% of the request) for "
        "it to start"
    )


# --- degenerate roots: zero-length and sub-millisecond --------------------------------------------------


@pytest.mark.parametrize(
    "stages",
    [
        pytest.param(saturated(), id="POOL_SATURATED"),
        pytest.param(offload(send=15, ret=10, run=74), id="IPC_BOUND"),
        pytest.param(first_task(), id="WORKER_COLD_START"),
    ],
)
def test_a_zero_length_root_gets_no_offload_finding(stages):
    """Edge: a root of 0 ns (a clock that did not advance) keeps its stages, and has no share to report: the
    offload rules must stay quiet, not divide by it."""
    assert run(stages, total_ms=0).keys().isdisjoint({"POOL_SATURATED", "IPC_BOUND", "WORKER_COLD_START"})


SUB_MS_STREAM = StreamSummary(
    chunks=8, first_chunk_ms=1.0, streaming_ms=1.0, gap_p50_ms=0.1, gap_p99_ms=0.2, gap_max_ms=0.2, send_wait_ms=0.5,
    disconnected=False, first_chunk_bottleneck=None, gap_bottleneck=None, first_chunk_breakdown={}, gap_breakdown={},
    gaps=(),
)  # fmt: skip


@pytest.mark.parametrize(
    ("stages", "total_ms", "change", "signals", "code", "message"),
    [
        pytest.param(
            saturated(queue=0.6, send=0.1, run=0.2, ret=0.1),
            1,
            {"pool_saturated_min_ms": 0.5},
            TraceSignals(),
            "POOL_SATURATED",
            "'tokenize' waited 0.6 ms (60% of the request) for a worker of its ProcessPoolExecutor",
            id="POOL_SATURATED",
        ),
        pytest.param(
            offload(send=0.3, ret=0.3, run=0.3),
            1,
            {"ipc_min_ms": 0.5},
            TraceSignals(),
            "IPC_BOUND",
            "handing 'tokenize' its arguments and taking its result back took 0.6 ms (60% of the request): 0.3 ms "
            "there, 0.3 ms back",
            id="IPC_BOUND",
        ),
        pytest.param(
            first_task(queue=0.6, send=0.1, run=0.2, ret=0.1),
            1,
            {"cold_start_min_ms": 0.5},
            TraceSignals(),
            "WORKER_COLD_START",
            "'tokenize' was the first task of worker 4242, started by fork, and waited 0.6 ms (60% of the request) for "
            "it to start",
            id="WORKER_COLD_START",
        ),
        pytest.param(
            [cpu("a", 0, 0.2)],
            1,
            {"untracked_min_ms": 0.5},
            TraceSignals(),
            "UNTRACKED_TIME",
            "0.8 ms (80%) of the request is in no stage",
            id="UNTRACKED_TIME",
        ),
        pytest.param(
            [cpu("a", 0, 2)],
            3,
            {"slow_consumer_min_ms": 0.2},
            TraceSignals(stream=SUB_MS_STREAM),
            "SLOW_CONSUMER",
            "the stream waited 0.5 ms (50% of its 1.0 ms between first and last chunk) for its client to take the "
            "chunks",
            id="SLOW_CONSUMER",
        ),
    ],
)
def test_a_one_millisecond_request_is_judged_like_any_other(stages, total_ms, change, signals, code, message):
    """Edge: a 1 ms root (or stream) with the rule's floor lowered below its default, as a service of sub-ms
    requests would set it: nothing about a 1 ms length is degenerate, and the rule must fire on its share."""
    found = run(stages, total_ms=total_ms, signals=signals, thresholds=DiagnosisThresholds(**change))
    assert found[code].message == message


# --- BATCH_WAIT: a batch already formed ---------------------------------------------------------------


def batch_waits(*formations: float):
    """A request's waits for its batch, back to back from 0 ms, each for a batch of 1 of 4 items with nothing
    behind the previous batch; a batch already formed on arrival waited 0 ms for it (a 0.1 ms hand-over)."""
    stages, t = [], 0.0
    for i, formed in enumerate(formations):
        batch = BatchInfo(f"b{i}", 1, 1, 0, 1, 4, formation_ms=formed, busy_ms=0.0)
        stages.append(cpu(f"step{i}", t, t + max(formed, 0.1), kind="wait", batch=batch, span_id=10 + i))
        t += max(formed, 0.1)
    return stages


@pytest.mark.parametrize(
    ("formations", "message", "stage"),
    [
        pytest.param(
            (0.0, 10.0),
            "the request waited 10.0 ms (50%) in 'step1' for its batch to form (it ran with 1 of 4 items)",
            "step1",
            id="adds-nothing",
        ),
        pytest.param(
            (0.0,) + (0.9,) * 12,
            "the request waited 10.8 ms (54%) in 'step1' for its batch to form (it ran with 1 of 4 items)",
            "step1",
            id="is-not-the-longest",
        ),
    ],
)
def test_a_batch_formed_on_arrival_waited_nothing_for_it(formations, message, stage):
    """A decode loop on a 20 ms root whose first step found its batch formed: that 0 ms is a reading, not a
    missing one, so it adds nothing to the sum and loses to every step that waited (12 steps of 0.9 ms)."""
    assert figures(run(batch_waits(*formations), total_ms=20), "BATCH_WAIT") == (message, stage, None)
