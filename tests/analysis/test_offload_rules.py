"""Work handed to a process pool: the four stretches of a call from its readings (hand-computed), and the four
offload rules at their edges, each beside a healthy twin; the CPU rules judge a worker's stages with the
worker's signals, never the parent's."""

from __future__ import annotations

import pytest
from trace_builders import MS, cpu, offload, run

from stagetrace.analysis import TraceSignals
from stagetrace.analysis.offload import (
    OffloadFields,
    OffloadInfo,
    OffloadSplit,
    offload_calls,
    offload_fields,
    offload_info,
    split_offload,
)
from stagetrace.analysis.signals import ProcessLoad


def fields(**changes):
    """A call submitted at 100 ms: pickled 101-103 ms on a pool thread, the worker free since 90 ms, running it
    106-150 ms; done (the result read back) at 160 ms."""
    base = dict(
        executor="ProcessPoolExecutor", max_workers=2, in_flight=1, start_method="fork", run_span_id=7,
        submitted_ns=100 * MS, pickle_start_ns=101 * MS, pickle_end_ns=103 * MS, args_bytes=5000, worker_pid=42,
        worker_task_seq=3, worker_started_ns=0, worker_idle_ns=90 * MS,
        run_start_ns=106 * MS, run_end_ns=150 * MS, run_cpu_start=None, run_cpu_end=None, result_bytes=80,
    )  # fmt: skip
    base.update(changes)
    return OffloadFields(**base)


def ms_split(split: OffloadSplit) -> list[tuple[float, float]]:
    return [(a / MS, b / MS) for a, b in split]


def test_a_call_to_an_idle_worker_is_all_send_before_its_run():
    # send = pickling 2 ms + from 103 ms (pickled; the worker was free) to the run at 106 ms (the pipe and the
    # worker's reading) = 5 ms of the 6 ms before the run: 1 ms of queue (the pool's own hand-over)
    assert ms_split(split_offload(fields(), 160 * MS)) == [(100, 101), (101, 106), (106, 150), (150, 160)]


def test_a_call_whose_worker_was_busy_queued_until_it_was_free():
    # the worker was busy until 130 ms: the bytes waited in the pipe for it, queueing; send = 2 + (132 - 130) ms
    busy = fields(worker_idle_ns=130 * MS, run_start_ns=132 * MS, run_end_ns=150 * MS)
    assert ms_split(split_offload(busy, 160 * MS)) == [(100, 128), (128, 132), (132, 150), (150, 160)]


def test_a_call_not_pickled_here_has_no_serialisation_and_readings_out_of_order_are_clamped_into_it():
    unpickled = fields(pickle_start_ns=None, pickle_end_ns=None, worker_idle_ns=None)
    assert ms_split(split_offload(unpickled, 160 * MS)) == [(100, 100), (100, 106), (106, 150), (150, 160)]
    skewed = fields(run_start_ns=95 * MS, run_end_ns=170 * MS)  # clocks that are not one
    assert ms_split(split_offload(skewed, 160 * MS)) == [(100, 100), (100, 100), (100, 160), (160, 160)]


def test_half_a_reading_is_none_and_a_worker_free_only_after_the_run_began_adds_nothing():
    # a serialisation with no end is not counted: from the submission to the run is all the pipe's (send)
    assert ms_split(split_offload(fields(pickle_end_ns=None), 160 * MS))[:2] == [(100, 100), (100, 106)]
    # a serialisation that ended before it began counts 0 ms, its end still the moment the bytes were ready
    backwards = fields(pickle_start_ns=104 * MS, pickle_end_ns=103 * MS)
    assert ms_split(split_offload(backwards, 160 * MS))[:2] == [(100, 103), (103, 106)]
    # the worker's idle reading after its run began (another clock): no time from it to the run, pickling only
    late_idle = fields(worker_idle_ns=107 * MS)
    assert ms_split(split_offload(late_idle, 160 * MS))[:2] == [(100, 104), (104, 106)]


def test_the_offload_span_s_facts_are_the_record_s_field_by_field():
    info = offload_info(fields(in_flight=3, start_method="spawn", result_bytes=81))
    assert info == OffloadInfo("ProcessPoolExecutor", 2, 3, 5000, 81, "spawn", 42, 3)


def test_a_call_its_worker_never_reported_has_no_stretches():
    assert split_offload(fields(run_start_ns=None, run_end_ns=None), 160 * MS) is None
    assert split_offload(fields(run_end_ns=None), 160 * MS) is None  # half a run is none
    assert split_offload(fields(run_start_ns=None), 160 * MS) is None


def test_a_call_not_pickled_here_to_a_worker_free_since_103_ms_sent_from_then_exactly():
    # no serialisation: nothing of it counts (not even a nanosecond); the 3 ms from 103 ms to the run are send
    split = split_offload(fields(pickle_start_ns=None, pickle_end_ns=None, worker_idle_ns=103 * MS), 160 * MS)
    assert split[:2] == ((100 * MS, 103 * MS), (103 * MS, 106 * MS))


def test_a_shipped_offload_tuple_is_checked_field_by_field():
    good = fields()
    assert offload_fields(tuple(good)) == good and offload_fields(None) is None and offload_fields(good) is good
    for bad in (list(good), tuple(good)[:-1], tuple(good._replace(submitted_ns=1.5)), tuple(good._replace(executor=3)),
                tuple(good._replace(worker_pid="42")), tuple(good._replace(start_method=5))):  # fmt: skip
        with pytest.raises(ValueError, match=r"^malformed offload record$"):
            offload_fields(bad)


def test_an_offloads_children_are_read_back_by_their_parent_stage():
    stages = [*offload(queue=12.5, send=3.25, run=40, ret=2, in_flight=3), cpu("post", 57.75, 60)]
    (call,) = offload_calls(stages)
    assert (call.name, call.queue_ms, call.send_ms, call.run_ms, call.return_ms) == ("tokenize", 12.5, 3.25, 40, 2)
    assert call.saturated and call.transfer_ms == 5.25 and call.payload_bytes == 1000


# --- the rules at their edges, each beside a healthy twin ---------------------------------------------------


def test_pool_saturated_needs_every_worker_busy_and_a_quarter_of_the_request():
    # 100 ms requests: 25 ms queued is exactly a quarter; every worker busy when 3 calls share 2 workers
    assert run(offload(queue=25, run=74, in_flight=3)).get("POOL_SATURATED")
    assert "POOL_SATURATED" not in run(offload(queue=24.9, run=74.1, in_flight=3))
    assert "POOL_SATURATED" not in run(offload(queue=40, run=59, in_flight=2))  # a free worker: not saturation
    small = run(offload(queue=9.9, run=20, in_flight=3), total_ms=30)  # a third of a short request, under 10 ms
    assert "POOL_SATURATED" not in small
    found = run(offload(queue=30, run=69, in_flight=5))["POOL_SATURATED"]
    assert found.stage == "tokenize" and "30.0 ms" in found.message and "5 calls" in found.evidence
    assert "QUEUEING" not in run(offload(queue=30, run=69, in_flight=5))  # the pool's queue is not a thread pool's


def test_the_queue_of_several_saturated_calls_adds_up():
    calls = offload(queue=15, run=30, in_flight=3) + offload(
        "tokenize", queue=15, run=33, start=50, span_id=950, in_flight=4
    )
    found = run(calls, total_ms=100)
    assert "30.0 ms over 2 calls" in found["POOL_SATURATED"].message


def test_ipc_bound_by_its_share_of_the_request_or_by_megabytes_a_call():
    assert "IPC_BOUND" in run(offload(send=15, ret=10, run=74))  # 25 ms of 100
    assert "IPC_BOUND" not in run(offload(send=15, ret=9.9, run=74.1))
    heavy = run(offload(send=4, ret=1, run=94, args_bytes=1 << 20))  # 5 ms moving a MiB: IPC_BOUND whatever its share
    assert "1.0 MiB there" in heavy["IPC_BOUND"].evidence
    assert "IPC_BOUND" not in run(offload(send=3.9, ret=1, run=94, args_bytes=1 << 20))  # under 5 ms: not worth it
    assert "IPC_BOUND" not in run(offload(send=4, ret=1, run=94, args_bytes=(1 << 20) - 1))


def test_worker_oversubscribed_from_the_workers_own_run_queue():
    waited = offload(run=40, run_fields={"runqueue_ms": 12.0, "cpu_ms": 28.0})  # 30 % of the run
    assert run(waited)["WORKER_OVERSUBSCRIBED"].stage == "offload.run"
    assert "WORKER_OVERSUBSCRIBED" not in run(offload(run=40, run_fields={"runqueue_ms": 11.9, "cpu_ms": 28.0}))
    load = TraceSignals(load=ProcessLoad(cpus=2, cpus_used=2.0, runnable=3.0, requests=1.0))
    evidence = run(waited, signals=load)["WORKER_OVERSUBSCRIBED"].evidence
    assert evidence == "2 workers beside the application's 3.0 threads running or waiting for a CPU, on 2 CPUs"


def test_a_workers_wait_for_a_cpu_is_never_called_the_applications():
    inner = cpu("inner", 2, 42, runqueue_ms=20.0, worker_pid=4242, parent_stage_id=903)
    found = run([*offload(run=41), inner])
    assert "WORKER_OVERSUBSCRIBED" in found and "CPU_OVERSUBSCRIBED" not in found
    # the run that holds it waited longer (its readings span the whole call): the worker's own stage is named
    waited = run([*offload(run=41, run_fields={"runqueue_ms": 25.0, "cpu_ms": 15.0}), inner])["WORKER_OVERSUBSCRIBED"]
    assert waited.stage == "inner" and "'inner' in worker 4242 waited 20.0 ms of its 40.0 ms" in waited.message
    assert "SERVICE_AT_CAPACITY" not in run(
        [*offload(run=41), inner], signals=TraceSignals(load=ProcessLoad(cpus=2, cpus_used=2, runnable=8, requests=8))
    )
    # the same stage in the application is the application's oversubscription
    here = cpu("inner", 2, 42, runqueue_ms=20.0)
    assert "CPU_OVERSUBSCRIBED" in run([here])


def test_a_blocked_worker_stage_is_not_gil_contention_however_contended_the_applications_gil_was():
    blocked = cpu("inner", 2, 42, blocked_ms=35.0, worker_pid=4242, parent_stage_id=903)
    found = run([*offload(run=41), blocked], signals=TraceSignals(gil_pressure_ms=8.0))
    assert "GIL_CONTENTION" not in found and "OFF_CPU_WAIT" in found  # its own process's GIL was not measured
    assert "GIL_CONTENTION" in run([cpu("inner", 2, 42, blocked_ms=35.0)], signals=TraceSignals(gil_pressure_ms=8.0))


def test_worker_cold_start_for_a_workers_first_task_not_for_a_busy_pool():
    assert "WORKER_COLD_START" in run(offload(queue=50, run=49, seq=1))
    assert "WORKER_COLD_START" not in run(offload(queue=49.9, run=49, seq=1))  # under 50 ms
    assert "WORKER_COLD_START" not in run(offload(queue=60, run=39, seq=2))  # a warm worker
    busy = run(offload(queue=60, run=39, seq=1, in_flight=3))  # its first task, but it queued behind others
    assert "WORKER_COLD_START" not in busy and "POOL_SATURATED" in busy
    slow = run(offload(queue=60, run=1000, seq=1), total_ms=1062)  # 6 % of a long request: not the story
    assert "WORKER_COLD_START" not in slow
    found = run(offload(queue=80, run=19, seq=1))["WORKER_COLD_START"]
    assert found.message.startswith("'tokenize' was the first task of worker 4242, started by fork")


def test_a_healthy_offload_fires_nothing():
    assert run(offload(queue=0.5, send=0.4, run=90, ret=0.3, run_fields={"runqueue_ms": 1.0, "cpu_ms": 88.0})) == {}


@pytest.mark.parametrize(
    ("n", "shown"),
    [(0, "0 B"), (100, "100 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (2**15, "32.0 KiB"),
     (2**20 - 1, "1024.0 KiB"), (2**20, "1.0 MiB"), (5 * 2**20 + 2**19, "5.5 MiB")],
)  # fmt: skip
def test_a_payload_size_reads_in_bytes_kib_or_mib_from_each_unit_s_first_value(n, shown):
    from stagetrace.analysis.diagnosis import _size

    assert _size(n) == shown


def test_worker_oversubscribed_names_the_worker_stage_that_waited_longest_and_reads_its_edges():
    # two of the worker's own stages waited (12 and 20 ms, each 30 % or more of its 40 ms): the longer is named
    a = cpu("a", 2, 42, runqueue_ms=12.0, worker_pid=4242, parent_stage_id=903)
    b = cpu("b", 42, 82, runqueue_ms=20.0, worker_pid=4242, parent_stage_id=903)
    found = run([*offload(run=81), a, b], total_ms=100)["WORKER_OVERSUBSCRIBED"]
    assert found.stage == "b" and found.evidence is None  # no load read: no evidence, not an empty one
    # a stage exactly min_stage_ms (5 ms) long is judged; a pool whose size is unknown gives no evidence
    short = cpu("c", 2, 7, runqueue_ms=5.0, worker_pid=4242, parent_stage_id=903)
    load = TraceSignals(load=ProcessLoad(cpus=2, cpus_used=2.0, runnable=3.0, requests=1.0))
    unknown = run([*offload(run=6, max_workers=None), short], signals=load)["WORKER_OVERSUBSCRIBED"]
    assert unknown.stage == "c" and unknown.evidence is None
