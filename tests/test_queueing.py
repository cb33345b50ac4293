"""QUEUEING judged by what the request lived, whatever the order of arrival: a request that waited because
every worker was spoken for is queueing; a wait for a free worker to wake up (dispatch latency) is not.
Burst, steady and trickle arrivals against a real uvicorn with a 4-token anyio limiter, and an executor
driven in-process."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time

import anyio.to_thread
import pytest
from fastapi import FastAPI
from opentelemetry.trace import format_trace_id

import stagetrace
from servers import run_scenario
from stagetrace import conventions as c
from stagetrace.integrations._common import Occupancy

TOKENS = 4
STAGE_MS = 100
QUEUED_MS = 50  # a request that waited this long with 4 tokens and 100 ms requests waited for a token


def limited_app() -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        anyio.to_thread.current_default_thread_limiter().total_tokens = TOKENS
        yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/infer")
    def infer():
        with stagetrace.stage("infer", kind="io"):
            time.sleep(STAGE_MS / 1000)
        return {}

    return app


def split(harness, verdicts):
    """(requests that waited at least half a request for a token, requests whose wait was marked as not
    behind a full pool). How many land in each depends on arrival times; what each must say does not."""
    saturated = {
        format_trace_id(s.context.trace_id): s.attributes.get(c.QUEUE_SATURATED)
        for s in harness.by_name("threadpool.wait")
    }
    queued = [v for v in verdicts if v.breakdown.get("threadpool.wait", 0.0) >= QUEUED_MS]
    free = [v for v in verdicts if saturated.get(v.trace_id) is not True]
    return queued, free


@pytest.mark.slow  # over 1.4 s on its own: out of the quick loop
def test_a_burst_is_queueing_for_every_request_that_waited_for_a_token(harness):
    verdicts = run_scenario(harness, limited_app(), "/infer", n=16, concurrency=16)
    queued, free = split(harness, verdicts)
    assert len(queued) >= 8  # arriving together, most of the burst waits behind the first four
    assert all("QUEUEING" in v.diagnosis_codes for v in queued)
    assert len(free) >= TOKENS and not any("QUEUEING" in v.diagnosis_codes for v in free)
    d = next(d for d in queued[0].diagnoses if d.code == "QUEUEING")
    assert d.stage == "threadpool.wait"


@pytest.mark.slow  # over 1.4 s on its own: out of the quick loop
def test_steady_arrivals_above_capacity_are_queueing(harness):
    verdicts = run_scenario(harness, limited_app(), "/infer", n=24, concurrency=2 * TOKENS)
    queued, free = split(harness, verdicts)
    assert len(queued) >= TOKENS  # eight clients, four tokens: requests keep finding every token taken
    assert all("QUEUEING" in v.diagnosis_codes for v in queued)
    assert not any("QUEUEING" in v.diagnosis_codes for v in free)


@pytest.mark.parametrize(
    "concurrency",
    [pytest.param(TOKENS, id="steady-at-capacity"), pytest.param(1, id="trickle", marks=pytest.mark.slow)],
)
def test_arrivals_within_capacity_never_queue(harness, concurrency):
    # Each client sends its next request after the response, so a token is always free: any wait is
    # dispatch latency, however long the GIL or the host makes it.
    verdicts = run_scenario(harness, limited_app(), "/infer", n=12, concurrency=concurrency)
    assert not any("QUEUEING" in v.diagnosis_codes for v in verdicts)
    saturated = [s for s in harness.by_name("threadpool.wait") if s.attributes.get(c.QUEUE_SATURATED)]
    assert saturated == []


def occurrence_flags(waits):
    """Each occurrence's QUEUE_SATURATED (None: absent, not known) in the order they were recorded: the real
    stages, then those folded into the composite, which carries the flag they share."""
    real = [s for s in waits if c.COMPRESSED_COUNT not in s.attributes and not s.attributes.get(c.COMPRESSED_SLOWEST)]
    flags = [s.attributes.get(c.QUEUE_SATURATED) for s in sorted(real, key=lambda s: s.start_time)]
    for composite in (s for s in waits if c.COMPRESSED_COUNT in s.attributes):
        flags += [composite.attributes.get(c.QUEUE_SATURATED)] * composite.attributes[c.COMPRESSED_COUNT]
    return flags


@pytest.fixture
def threads_patched():
    from stagetrace.integrations.threads import propagate_context_to_threads, stop_propagating_context

    propagate_context_to_threads()
    yield
    stop_propagating_context()


@pytest.mark.parametrize("state_readable", [True, False], ids=["pool-state-read", "pool-state-unreadable"])
def test_an_executor_burst_marks_exactly_the_tasks_beyond_its_workers_as_queued(
    harness, threads_patched, monkeypatch, state_readable
):
    """Our own count decides; the pool's internals (read through ``_compat``) only cover tasks submitted
    before stagetrace was on, so a pool whose internals cannot be read is judged the same."""
    if not state_readable:
        monkeypatch.setattr("stagetrace.integrations.threads.executor_saturated", lambda pool: None)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="infer")
    try:
        with stagetrace.pipeline("job"):
            futures = [pool.submit(time.sleep, 0.03) for _ in range(6)]
            concurrent.futures.wait(futures)
        (v,) = harness.wait_verdicts(1)
    finally:
        pool.shutdown()
    flags = occurrence_flags(harness.by_name("infer.wait"))
    # the first two tasks started new workers (a wait stage only if dispatch took 0.5 ms or more), 30 ms
    # before the other four found a worker
    assert flags[-4:] == [True] * 4 and not any(flags[:-4])
    assert "QUEUEING" in v.diagnosis_codes


@pytest.mark.parametrize("floor_ns, recorded", [(0, True), (10**12, False)], ids=["floor-zero", "floor-huge"])
def test_the_wait_floor_is_read_at_each_submission(harness, threads_patched, monkeypatch, floor_ns, recorded):
    """The noise floor is looked up when a task is submitted (a default argument bound at import would
    ignore the change, and tests that lower it would race a 0.5 ms dispatch)."""
    monkeypatch.setattr("stagetrace.integrations.threads.MIN_WAIT_NS", floor_ns)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="floor")
    try:
        with stagetrace.pipeline("job"):
            pool.submit(int).result(timeout=5)
        harness.wait_verdicts(1)
    finally:
        pool.shutdown()
    assert bool(harness.by_name("floor.wait")) is recorded


def test_cancelled_and_failed_submissions_leave_the_count(harness, threads_patched):
    from stagetrace.integrations.threads import OCCUPANCY

    gate = concurrent.futures.Future()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    with stagetrace.pipeline("job"):
        running = pool.submit(gate.result)
        queued = pool.submit(gate.result)
        assert len(OCCUPANCY) == 1
        assert queued.cancel()
        gate.set_result(None)
        running.result(timeout=5)
    pool.shutdown()
    with pytest.raises(RuntimeError), stagetrace.pipeline("late"):
        pool.submit(time.sleep, 0)  # after shutdown: refused, and not counted
    assert len(OCCUPANCY) == 0


def test_occupancy_counts_per_pool_and_forgets_empty_pools():
    occ = Occupancy()
    a, b = object(), object()
    assert [occ.enter(a), occ.enter(a), occ.enter(b)] == [0, 1, 0]
    occ.leave(a)
    assert occ.enter(a) == 1
    occ.leave(a), occ.leave(a), occ.leave(b)
    assert len(occ) == 0
    occ.leave(a)  # an extra leave never goes negative
    assert occ.enter(a) == 0


def test_a_streams_hops_to_the_thread_pool_say_whether_the_pool_was_full(harness):
    """A sync generator's ``next()`` runs on the thread pool at each chunk: a hop that found every token
    taken (here by a sync endpoint holding the only one) is queueing, the hops after it, with the token
    free, are not, however long a busy host makes them wait for a CPU (unflagged, a loaded CI host read
    them as QUEUEING). Past the first few, the hops fold into a composite that keeps the flag they share."""
    import threading

    from fastapi.responses import StreamingResponse
    from fastapi.testclient import TestClient

    @contextlib.asynccontextmanager
    async def lifespan(app):
        anyio.to_thread.current_default_thread_limiter().total_tokens = 1
        yield

    app = FastAPI(lifespan=lifespan)
    holding = threading.Event()

    @app.get("/hold")
    def hold():
        holding.set()
        time.sleep(0.3)
        return {}

    @app.get("/stream")
    def stream():
        return StreamingResponse(iter("abcdef"), media_type="text/plain")

    stagetrace.instrument_fastapi(app)
    with TestClient(app) as client:
        holder = threading.Thread(target=client.get, args=("/hold",))
        holder.start()
        assert holding.wait(5)
        assert client.get("/stream").text == "abcdef"
        holder.join()
    harness.wait_verdicts(2)
    (stream_trace,) = {s.context.trace_id for s in harness.by_name("GET /stream")}
    hops = sorted(
        (s for s in harness.by_name("threadpool.wait") if s.context.trace_id == stream_trace),
        key=lambda s: s.start_time,
    )  # the composite starts with its first folded occurrence: after the real ones
    # eight hops: the sync endpoint, which waited for /hold's token, then six chunks and the generator's end,
    # the last five folded
    assert occurrence_flags(hops) == [True] + [False] * 7
    assert sum(c.COMPRESSED_COUNT in s.attributes for s in hops) == 1
    assert (hops[0].end_time - hops[0].start_time) / 1e6 >= 150


def test_a_composite_keeps_the_flag_its_occurrences_share_and_none_once_they_differ():
    from stagetrace.capture.records import Repeat, StageRecord

    def occurrence(flag):
        rec = StageRecord.__new__(StageRecord)
        rec.start_ns, rec.end_ns, rec.error, rec.on_event_loop, rec.queue_saturated = 0, 10, None, False, flag
        return rec

    def folded(*flags):
        composite = Repeat.started("threadpool.wait", "wait", 1, 0, 2)
        for flag in flags:
            composite.fold(occurrence(flag))
        return composite.queue_saturated

    assert (folded(False, False), folded(True, True), folded(None, None)) == (False, True, None)
    assert folded(False, True) is None and folded(True, False, True) is None and folded(False, None, False) is None
