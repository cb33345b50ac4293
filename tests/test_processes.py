"""Calls handed to process pools, traced stage by stage: ``ProcessPoolExecutor`` (submit, map,
``run_in_executor``) and ``multiprocessing.Pool`` (apply_async, map, imap) under fork, spawn and forkserver;
the worker's own stages under ``offload.run``, bounded; faults (a worker killed mid-task, what cannot be
pickled, a report after its request ended, a report of another process's call); and a worker that inherited
the runtime by fork recording nothing of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import itertools
import multiprocessing as mp
import os
import pickle
import re
import signal
import threading
import time

import pytest

import stagetrace
from stagetrace import conventions as c
from stagetrace.capture import offload
from stagetrace.settings import KEEP_REPEATS

OFFLOAD_CHILDREN = ("offload.queue", "offload.send", "offload.run", "offload.return")


# --- what the workers run (module level: pickled by reference) -------------------------------------------------


def tokenize(text: str) -> int:
    with stagetrace.stage("tokenize.inner"):
        words = text.split()
    with stagetrace.stage("count"):
        return len(words)


def many_stages(n: int) -> int:
    for _ in range(n):
        with stagetrace.stage("tick"):
            pass
    return n


def fails(message: str) -> None:
    with stagetrace.stage("before_failing"):
        pass
    raise KeyError(message)


def dies() -> None:
    os._exit(3)


def returns_a_lock() -> object:
    return threading.Lock()


def staged_initializer() -> None:
    with stagetrace.stage("initializer.stage"):
        pass


def plain(x: int) -> int:
    with stagetrace.stage("outside.a.request"):
        return x + 1


def probe(x: int) -> int:
    return x


def lock_for(x: int) -> object:
    return threading.Lock()


def zeros(n: int):
    import numpy as np

    return np.zeros((n, n), dtype=np.float32)


def text_of(n: int) -> str:
    return "x" * n


def threads_while_staged(n: int) -> tuple[bool, list[str]]:
    """Whether the call runs on the worker's main thread, and the worker's other threads during it; a stage
    that burns CPU."""
    with stagetrace.stage("worker.busy"):
        sum(i * i for i in range(n))
        main = threading.main_thread()
        return threading.current_thread() is main, [t.name for t in threading.enumerate() if t is not main]


class SlowToPickle:
    """An argument whose pickling takes 150 ms (a large payload's serialisation, as far as time goes)."""

    def __reduce__(self):
        time.sleep(0.15)
        return (SlowToPickle, ())


def trivial(arg: object) -> int:
    return 1


def offloads_again(text: str) -> int:
    """A worker's call that hands work to a pool of its own."""
    with stagetrace.stage("nested.pool"):
        with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
            return pool.submit(tokenize, text).result()


# --- helpers ---------------------------------------------------------------------------------------------------


def attrs(span):
    return dict(span.attributes or {})


def children_of(spans, parent):
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def offload_spans(spans, name):
    return [s for s in spans if s.name == name and attrs(s).get(c.STAGE_KIND) == "offload"]


def assert_offloaded(spans, name, executor, method):
    """The call's stage, its four children in order, the worker's stages under its run; returns the stage."""
    (stage,) = offload_spans(spans, name)[:1]
    a = attrs(stage)
    assert a[c.OFFLOAD_EXECUTOR] == executor and a[c.OFFLOAD_START_METHOD] == method
    assert a[c.OFFLOAD_MAX_WORKERS] == 2 and a[c.OFFLOAD_IN_FLIGHT] >= 1 and a[c.OFFLOAD_WORKER_TASK_SEQ] >= 1
    assert a[c.OFFLOAD_WORKER_PID] != os.getpid() and a[c.OFFLOAD_ARGS_BYTES] > 0 and a[c.OFFLOAD_RESULT_BYTES] > 0
    kids = sorted(children_of(spans, stage), key=lambda s: s.start_time)
    names = [k.name for k in kids]
    assert names[names.index("offload.send") :] == ["offload.send", "offload.run", "offload.return"], names
    assert all(stage.start_time <= k.start_time <= k.end_time <= stage.end_time for k in kids)
    for earlier, later in itertools.pairwise(kids):
        assert earlier.end_time <= later.start_time  # back to back, in order
    (run,) = [k for k in kids if k.name == "offload.run"]
    assert attrs(run)[c.WORKER_PID] == a[c.OFFLOAD_WORKER_PID]
    inner = children_of(spans, run)
    assert {s.name for s in inner} >= {"tokenize.inner", "count"}
    assert all(attrs(s)[c.WORKER_PID] == a[c.OFFLOAD_WORKER_PID] for s in inner)
    assert {s.context.trace_id for s in [stage, *kids, *inner]} == {stage.context.trace_id}
    return stage


@pytest.fixture
def method(request):
    return getattr(request, "param", "fork")


START_METHODS = [
    "fork",
    pytest.param("spawn", marks=pytest.mark.slow),
    pytest.param("forkserver", marks=pytest.mark.slow),
]


# --- ProcessPoolExecutor -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", START_METHODS, indirect=True)
def test_a_process_pool_executors_calls_are_stages_with_the_workers_under_them(harness, method):
    text = "a long text " * 20_000
    with cf.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as pool:
        with stagetrace.pipeline("request"):
            assert pool.submit(tokenize, text).result() == 60_000
            assert list(pool.map(tokenize, ["a b", "c d e"])) == [2, 3]
    (verdict,) = harness.wait_verdicts(1)
    spans = harness.spans()
    stage = assert_offloaded(spans, "tokenize", "ProcessPoolExecutor", method)
    assert len(offload_spans(spans, "tokenize")) == 3  # map: one call a chunk (here one item a chunk)
    assert attrs(stage)[c.OFFLOAD_ARGS_BYTES] >= len(text)
    assert set(OFFLOAD_CHILDREN[1:]) <= set(verdict.breakdown) and "tokenize.inner" in verdict.breakdown
    assert verdict.bottleneck in (*verdict.breakdown, "untracked") and 0 < verdict.ratio <= 1


def test_run_in_executor_from_a_coroutine_is_an_offload_stage(harness):
    async def handler(pool):
        async with stagetrace.pipeline("async request"):
            return await asyncio.get_running_loop().run_in_executor(pool, tokenize, "x y z")

    with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as pool:
        assert asyncio.run(handler(pool)) == 3
    harness.wait_verdicts(1)
    assert_offloaded(harness.spans(), "tokenize", "ProcessPoolExecutor", "fork")


def test_a_numpy_arrays_bytes_are_its_nbytes_and_read_without_pickling_it_twice(harness, monkeypatch):
    np = pytest.importorskip("numpy")
    array = np.zeros((1000, 1000), dtype=np.float32)  # 4 MB
    dumps = []
    real = offload.dumps
    monkeypatch.setattr(offload, "dumps", lambda obj: dumps.append(1) or real(obj))
    with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as pool:
        with stagetrace.pipeline("request"):
            assert pool.submit(np.sum, array).result() == 0
    harness.wait_verdicts(1)
    (stage,) = offload_spans(harness.spans(), "sum")
    assert attrs(stage)[c.OFFLOAD_ARGS_BYTES] >= array.nbytes
    assert len(dumps) == 1  # the arguments once (the result came back as it is: a scalar's few bytes)


def test_a_results_bytes_are_measured_as_the_arguments_are(harness, monkeypatch):
    """``result_bytes`` as ``args_bytes``: an array's ``nbytes`` where they say more than its pickle (here a
    reducer sends arrays as a handle of a few bytes, as shared-memory tensors go), the pickled size of a plain
    object."""
    np = pytest.importorskip("numpy")
    from multiprocessing.reduction import ForkingPickler

    monkeypatch.setitem(ForkingPickler._extra_reducers, np.ndarray, lambda a: (np.zeros, (a.shape, a.dtype.str)))
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:  # forked: the reducer with it
        with stagetrace.pipeline("request"):
            assert pool.submit(zeros, 1000).result().nbytes == 4_000_000
            assert pool.submit(text_of, 50_000).result() == "x" * 50_000
    harness.wait_verdicts(1)
    spans = harness.spans()
    (array_call,) = offload_spans(spans, "zeros")
    (text_call,) = offload_spans(spans, "text_of")
    assert len(offload.dumps(np.zeros((1000, 1000), dtype=np.float32))) < 1000  # the handle
    assert attrs(array_call)[c.OFFLOAD_RESULT_BYTES] == 4_000_000
    assert attrs(text_call)[c.OFFLOAD_RESULT_BYTES] == len(offload.dumps("x" * 50_000))


# --- multiprocessing.Pool ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", START_METHODS, indirect=True)
def test_a_multiprocessing_pools_calls_are_stages_with_the_workers_under_them(harness, method):
    with mp.get_context(method).Pool(2) as pool:
        with stagetrace.pipeline("request"):
            assert pool.apply_async(tokenize, ("a b c",)).get(timeout=60) == 3
            assert pool.map(tokenize, ["a", "b c", "d e f", "g"], chunksize=2) == [1, 2, 3, 1]
            assert list(pool.imap(tokenize, ["a b"])) == [2]
    harness.wait_verdicts(1)
    spans = harness.spans()
    assert_offloaded(spans, "tokenize", "multiprocessing.Pool", method)
    assert len(offload_spans(spans, "tokenize")) == 1 + 2 + 1  # apply_async, two chunks of map, imap's item


def test_a_thread_pool_is_left_as_it_is(harness):
    with mp.pool.ThreadPool(2) as pool:
        with stagetrace.pipeline("request"):
            assert pool.apply_async(tokenize, ("a b",)).get() == 2
            assert pool.map(tokenize, ["a", "b c"]) == [1, 2]
    harness.wait_verdicts(1)
    spans = harness.spans()
    assert not [s for s in spans if attrs(s).get(c.STAGE_KIND) == "offload"]


# --- the worker's side ----------------------------------------------------------------------------------------


def test_a_worker_loop_of_100000_stages_comes_back_folded(harness):
    with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as pool:
        with stagetrace.pipeline("request"):
            assert pool.submit(many_stages, 100_000).result() == 100_000
    (verdict,) = harness.wait_verdicts(1)
    ticks = harness.by_name("tick")
    assert len(ticks) <= KEEP_REPEATS + 2  # the first few, the composite, its slowest occurrence
    (composite,) = [s for s in ticks if c.COMPRESSED_COUNT in attrs(s)]
    assert attrs(composite)[c.COMPRESSED_COUNT] == 100_000 - KEEP_REPEATS
    assert "tick" in verdict.breakdown


def pause(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def test_a_forked_worker_sends_no_copy_of_the_parents_metrics(tmp_path):
    """A metric reader that lives in the application (``configure(metric_reader=...)``): OpenTelemetry's at-fork
    hook restarts its export thread in every forked worker, which would send the parent's metrics again from
    the worker every interval and once more as it ends. The worker's start shuts it down, exporting nothing."""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, PeriodicExportingMetricReader
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exports = tmp_path / "exports"

    class PidExporter(MetricExporter):
        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            with open(exports, "a") as f:
                f.write(f"{os.getpid()}\n")
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis=10_000):
            return True

        def shutdown(self, timeout_millis=30_000, **kwargs):
            pass

    reader = PeriodicExportingMetricReader(PidExporter(), export_interval_millis=50)
    handle = stagetrace.configure(
        "metrics-in-app", span_exporter=InMemorySpanExporter(), metric_reader=reader, set_global=False
    )
    try:
        with stagetrace.pipeline("before the fork"), stagetrace.stage("work"):
            pass
        assert handle.force_flush(10)  # the parent's metrics hold a trace when the worker is forked
        with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
            with stagetrace.pipeline("request"):
                worker = pool.submit(pause, 0.4).result()  # eight of the reader's intervals in the worker
    finally:
        handle.shutdown()
    pids = set(exports.read_text().split()) if exports.exists() else set()
    assert str(os.getpid()) in pids and str(worker) not in pids, (os.getpid(), worker, pids)


def test_a_forked_worker_records_nothing_outside_a_requests_call(harness):
    with cf.ProcessPoolExecutor(
        2, mp_context=mp.get_context("fork"), initializer=staged_initializer
    ) as pool:  # fmt: skip
        assert pool.submit(plain, 1).result() == 2  # outside any request
        with stagetrace.pipeline("request"):
            assert pool.submit(tokenize, "a b").result() == 2
        assert pool.submit(plain, 2).result() == 3
    harness.wait_verdicts(1)
    names = {s.name for s in harness.spans()}
    assert "tokenize.inner" in names
    assert not names & {"initializer.stage", "outside.a.request"}  # no rootless traces from the workers


@pytest.mark.parametrize("method", START_METHODS[:2], indirect=True)
def test_a_workers_stages_carry_its_cpu_signals_and_it_runs_no_thread_of_stagetraces(harness, method):
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context(method)) as executor:
        with mp.get_context(method).Pool(1) as pool:
            with stagetrace.pipeline("request"):
                threads = [
                    executor.submit(threads_while_staged, 200_000).result(),
                    pool.apply_async(threads_while_staged, (200_000,)).get(timeout=60),
                ]
    for on_main, others in threads:
        # Beside the call, on the worker's main thread, nothing: not stagetrace's threads, nor the SDK's batch
        # span processor's for the harness's exporter, which OpenTelemetry's own at-fork hook restarts in
        # every forked child and the worker's start shuts down again.
        assert on_main and not others, (method, threads)
    harness.wait_verdicts(1)
    busy = harness.by_name("worker.busy")
    assert len(busy) == 2
    for span in busy:
        a = attrs(span)
        assert a[c.WORKER_PID] != os.getpid()
        assert a[c.CPU_MS] > 0 and a[c.RUNQUEUE_MS] >= 0


def test_a_pool_opened_in_a_forked_worker_is_traced_under_the_workers_stage(harness):
    """A worker forked from the configured process has its patches: a pool it opens during a call is traced
    like the application's, its call an offload stage (with its own children and its worker's stages) under
    the worker's stage."""
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
        with stagetrace.pipeline("request"):
            assert pool.submit(offloads_again, "a b c").result() == 3
    harness.wait_verdicts(1)
    spans = harness.spans()
    (outer,) = offload_spans(spans, "offloads_again")
    (nested_pool,) = harness.by_name("nested.pool")
    (inner,) = offload_spans(spans, "tokenize")
    (outer_run,) = [k for k in children_of(spans, outer) if k.name == "offload.run"]
    assert nested_pool.parent.span_id == outer_run.context.span_id
    assert inner.parent.span_id == nested_pool.context.span_id
    kids = {k.name: k for k in children_of(spans, inner)}
    assert set(OFFLOAD_CHILDREN[1:]) <= set(kids)
    outer_worker, inner_worker = attrs(outer)[c.OFFLOAD_WORKER_PID], attrs(inner)[c.OFFLOAD_WORKER_PID]
    assert len({os.getpid(), outer_worker, inner_worker}) == 3
    assert attrs(kids["offload.run"])[c.WORKER_PID] == inner_worker
    (inner_stage,) = harness.by_name("tokenize.inner")
    assert inner_stage.parent.span_id == kids["offload.run"].context.span_id
    assert attrs(inner_stage)[c.WORKER_PID] == inner_worker


@pytest.mark.slow
def test_a_pool_opened_in_a_spawned_worker_is_part_of_the_workers_time(harness):
    """A spawned worker starts without stagetrace's patches: a pool it opens runs its calls bare, inside the
    worker's own stage."""
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        with stagetrace.pipeline("request"):
            assert pool.submit(offloads_again, "a b c").result() == 3
    harness.wait_verdicts(1)
    spans = harness.spans()
    assert [s.name for s in spans if attrs(s).get(c.STAGE_KIND) == "offload"] == ["offloads_again"]
    assert harness.by_name("nested.pool") and not harness.by_name("tokenize.inner")


def test_outside_a_request_the_pool_gets_the_call_itself(harness):
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
        slow = pool.submit(many_stages, 300_000)  # holds the only worker: the next call stays pending
        bare = pool.submit(plain, 1)
        with stagetrace.pipeline("request"):
            traced = pool.submit(plain, 2)
            calls = [item.fn for item in pool._pending_work_items.values()]
            assert traced.result() == 3
        assert (slow.result(), bare.result()) == (300_000, 2)
    assert plain in calls and any(isinstance(fn, offload.OffloadCall) for fn in calls)
    assert not offload.IN_FLIGHT


# --- the verdict -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("executor", ["ProcessPoolExecutor", "multiprocessing.Pool"])
def test_a_request_whose_time_went_to_pickling_has_offload_send_as_its_bottleneck(harness, executor):
    ctx = mp.get_context("fork")
    with cf.ProcessPoolExecutor(1, mp_context=ctx) as pool, ctx.Pool(1) as mp_pool:
        assert pool.submit(probe, 1).result() == 1  # the worker started: no cold start in the request
        with stagetrace.pipeline("request"):
            if executor == "ProcessPoolExecutor":
                assert pool.submit(trivial, SlowToPickle()).result() == 1
            else:
                assert mp_pool.apply_async(trivial, (SlowToPickle(),)).get(timeout=30) == 1
    (verdict,) = harness.wait_verdicts(1)
    assert verdict.bottleneck == "offload.send", (verdict.bottleneck, verdict.breakdown)
    assert verdict.breakdown["offload.send"] >= 150


# --- faults ------------------------------------------------------------------------------------------------


def test_an_exception_in_the_worker_is_raised_as_it_was_and_its_stages_come_with_it(harness):
    with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as pool:
        with pytest.raises(KeyError, match="no such token"):
            with stagetrace.pipeline("request"):
                pool.submit(fails, "no such token").result()
    harness.wait_verdicts(1)
    spans = harness.spans()
    (stage,) = offload_spans(spans, "fails")
    assert stage.status.is_ok is False and attrs(stage)[c.ERROR_TYPE] == "KeyError"
    assert harness.by_name("before_failing")


def test_a_worker_killed_mid_task_gives_the_stage_its_error_and_the_request_its_verdict(harness):
    with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as pool:
        with pytest.raises(cf.process.BrokenProcessPool):
            with stagetrace.pipeline("request"):
                pool.submit(dies).result()
    (verdict,) = harness.wait_verdicts(1)
    (stage,) = offload_spans(harness.spans(), "dies")
    assert stage.status.is_ok is False and attrs(stage)[c.ERROR_TYPE] == "BrokenProcessPool"
    assert not children_of(harness.spans(), stage)  # no report: nothing to place
    assert "dies" in verdict.breakdown and not offload.IN_FLIGHT


def _failure(call):
    """What a call raised, its addresses left out (two runs' objects are never at one address)."""
    try:
        call()
    except Exception as e:
        return type(e), re.sub(r"0x[0-9a-f]+", "0x...", str(e))
    return None


def test_what_cannot_be_pickled_raises_exactly_what_it_raised_before(harness):
    def unpicklable_call(pool):
        return lambda: pool.submit(lambda: 1).result()

    def unpicklable_result(pool):
        return lambda: pool.submit(returns_a_lock).result()

    for make in (unpicklable_call, unpicklable_result):
        with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
            bare = _failure(make(pool))  # outside a request: the pool's own error
            with stagetrace.pipeline("request"):
                traced = _failure(make(pool))
        assert bare is not None and traced == bare, (make.__name__, bare, traced)
    with mp.get_context("fork").Pool(1) as pool:
        bare = _failure(lambda: pool.apply_async(returns_a_lock).get(timeout=30))
        with stagetrace.pipeline("request"):
            traced = _failure(lambda: pool.apply_async(returns_a_lock).get(timeout=30))
    assert bare is not None and traced == bare
    assert not offload.IN_FLIGHT, [(p.name, p.executor) for p in offload.IN_FLIGHT._calls.values()]


MAPS = {
    "map": lambda pool, fn, items: pool.map(fn, items),
    "map_async": lambda pool, fn, items: pool.map_async(fn, items).get(timeout=30),
    "imap": lambda pool, fn, items: list(pool.imap(fn, items)),
    "imap_unordered": lambda pool, fn, items: list(pool.imap_unordered(fn, items, chunksize=2)),
    "starmap": lambda pool, fn, items: pool.starmap(fn, [(x,) for x in items]),
}


@pytest.mark.parametrize("call", MAPS)
def test_a_map_task_that_cannot_be_sent_ends_its_call_with_the_error(harness, call):
    """A task of map, imap and the rest whose argument cannot be pickled: the error raised is the pool's own,
    the call's stage ends with it (error status, ``error.type``), nothing stays in flight, and the next call
    counts only itself."""
    run = MAPS[call]
    items = ["a b", threading.Lock()]  # the second task cannot be sent
    with mp.get_context("fork").Pool(2) as pool:
        bare = _failure(lambda: run(pool, tokenize, items))
        with stagetrace.pipeline("request"):
            traced = _failure(lambda: run(pool, tokenize, items))
            left = [(p.name, p.executor) for p in offload.IN_FLIGHT._calls.values()]
            assert pool.apply_async(probe, (1,)).get(timeout=30) == 1
    assert bare is not None and traced == bare, (bare, traced)
    assert not left
    harness.wait_verdicts(1)
    spans = harness.spans()
    failed = [s for s in offload_spans(spans, "tokenize") if not s.status.is_ok]
    assert len(failed) == 1 and attrs(failed[0])[c.ERROR_TYPE] == bare[0].__name__ == "TypeError"
    (after,) = offload_spans(spans, "probe")
    assert attrs(after)[c.OFFLOAD_IN_FLIGHT] == 1


@pytest.mark.parametrize("call", ["map", "imap"])
def test_a_map_result_that_cannot_be_sent_back_ends_its_call_with_the_error(harness, call):
    run = MAPS[call]
    with mp.get_context("fork").Pool(1) as pool:
        bare = _failure(lambda: run(pool, lock_for, [1]))
        with stagetrace.pipeline("request"):
            traced = _failure(lambda: run(pool, lock_for, [1]))
            left = len(offload.IN_FLIGHT)
    assert bare is not None and traced == bare and bare[0].__name__ == "MaybeEncodingError"
    assert not left
    harness.wait_verdicts(1)
    (stage,) = offload_spans(harness.spans(), "lock_for")
    assert stage.status.is_ok is False and attrs(stage)[c.ERROR_TYPE] == "MaybeEncodingError"


def test_a_report_after_its_request_ended_is_counted_and_dropped(harness):
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
        with stagetrace.pipeline("request"):
            future = pool.submit(many_stages, 200_000)  # not awaited: the request ends first
        (verdict,) = harness.wait_verdicts(1)
        assert future.result() == 200_000
    assert "many_stages" not in verdict.breakdown
    dropped = {
        p.attributes[c.DROP_REASON]: p.value for p in harness.metric_points(c.METRIC_DROPPED) if p.value
    }  # fmt: skip
    assert dropped.get("offload_late", 0) >= 1


def test_a_report_of_a_call_this_process_did_not_submit_is_counted_and_dropped(harness):
    from stagetrace.capture.worker import Report

    other = Report(12345, os.getpid() + 1, 2, 1, 0, 0, 1, 2, None, None, (), 0, None)
    unknown = other._replace(parent_pid=os.getpid())
    assert pickle.loads(pickle.dumps(offload.ReportCarrier(other))) is None
    offload.deliver(tuple(unknown), None)
    offload.deliver(("not", "a", "report"), None)
    dropped = {p.attributes[c.DROP_REASON]: p.value for p in harness.metric_points(c.METRIC_DROPPED) if p.value}
    assert dropped.get("offload_unknown", 0) == 2 and dropped.get("offload_malformed", 0) == 1


def _in_forked_child(child, timeout_s: int = 60):
    """``child()``'s return value (JSON), run in a child forked with os.fork (killed if it hangs); what it
    raised fails the test here."""
    import json
    import traceback

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        try:
            os.close(read)
            signal.alarm(timeout_s)
            try:
                out = {"value": child()}
            except BaseException:
                out = {"error": traceback.format_exc()}
            os.write(write, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    assert data, "the forked child died or hung"
    out = json.loads(data)
    assert "error" not in out, out["error"]
    return out["value"]


@pytest.mark.slow  # over 1.4 s on its own: out of the quick loop
def test_a_pool_made_in_a_forked_child_never_reaches_another_request(harness):
    """A child forked inside a request inherits its context, not the request: a pool it makes gets its calls
    bare under that context (nothing pending, no stage in the parent's request). In a request of its own, a
    call whose report comes after that request ended is counted (``offload_late``) and dropped, not attached
    to the child's next request."""
    from opentelemetry import context

    from stagetrace import _state
    from stagetrace.capture.stage import current_parent

    def child():
        rt = _state.runtime
        drops = []
        real_dropped = rt.metrics.dropped
        rt.metrics.dropped = lambda reason, count=1: drops.append((reason, count)) or real_dropped(reason, count)
        with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
            inherited = pool.submit(tokenize, "a b")
            bare = [type(item.fn).__name__ for item in pool._pending_work_items.values()]
            pending_bare = len(offload.IN_FLIGHT)
            assert inherited.result() == 2
            context.attach(context.Context())  # from here on the child serves requests of its own
            with stagetrace.pipeline("child request"):
                late = pool.submit(many_stages, 200_000)  # not awaited: the child's request ends first
            with stagetrace.pipeline("next child request"):
                trace = current_parent(rt).trace
                assert pool.submit(probe, 1).result() == 1  # after the late call: its report came first
                late_done = late.done()
                with trace.lock:
                    names = [st.name for st in trace.stages]
        return {
            "bare": bare, "pending_bare": pending_bare, "late_done": late_done, "names": names,
            "late": sum(n for reason, n in drops if reason == "offload_late"), "in_flight": len(offload.IN_FLIGHT),
        }  # fmt: skip

    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
        with stagetrace.pipeline("request"):
            assert pool.submit(tokenize, "c d e").result() == 3
            seen = _in_forked_child(child)
    assert seen["bare"] == ["function"] and seen["pending_bare"] == 0
    assert seen["late_done"] and "many_stages" not in seen["names"] and "probe" in seen["names"]
    assert seen["late"] >= 1 and seen["in_flight"] == 0
    (verdict,) = harness.wait_verdicts(1)  # the parent's request alone, with its own call alone
    assert "tokenize" in verdict.breakdown and not {"many_stages", "probe"} & set(verdict.breakdown)
    spans = harness.spans()
    assert [s.name for s in spans if attrs(s).get(c.STAGE_KIND) == "offload"] == ["tokenize"]
    assert not {"many_stages", "probe"} & {s.name for s in spans}
    assert len(harness.by_name("tokenize.inner")) == 1


def test_a_forked_child_starts_with_no_calls_in_flight_and_a_free_table(harness):
    """The parent's pending calls are not the child's to finish: the child's table is empty, its lock free even
    where a thread of the parent held it at the fork; the parent's call still reaches its request."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with offload.IN_FLIGHT._lock:
            held.set()
            release.wait(30)

    def child():
        table = offload.IN_FLIGHT
        free = table._lock.acquire(timeout=5)
        return {"calls": len(table), "pools": len(table._per_pool), "free": free}

    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
        with stagetrace.pipeline("request"):
            future = pool.submit(many_stages, 1000)
            holder = threading.Thread(target=hold)
            holder.start()
            assert held.wait(10)
            try:
                in_flight = len(offload.IN_FLIGHT._calls)
                seen = _in_forked_child(child)
            finally:
                release.set()
                holder.join()
            assert future.result() == 1000
    assert in_flight >= 1 and seen == {"calls": 0, "pools": 0, "free": True}
    (verdict,) = harness.wait_verdicts(1)
    assert "many_stages" in verdict.breakdown and not offload.IN_FLIGHT


def test_the_report_has_a_table_of_the_calls_handed_to_process_pools(tmp_path):
    import io
    import json

    from stagetrace.cli.report import run_report

    handle = stagetrace.configure("offloading", traces_path=tmp_path / "traces.jsonl", set_global=False)
    try:
        with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as pool:
            for _ in range(3):
                with stagetrace.pipeline("request"):
                    pool.submit(tokenize, "a b c " * 1000).result()
        assert handle.force_flush(30)
    finally:
        handle.shutdown()
    out = io.StringIO()
    assert run_report([str(tmp_path)], as_json=True, out=out, err=io.StringIO()) == 0
    row = json.loads(out.getvalue())["offloads"]["tokenize"]
    assert row["executor"] == "ProcessPoolExecutor" and row["calls"] == 3
    assert row["args_bytes_mean"] >= 6000 and row["result_bytes_mean"] > 0 and row["run_p50_ms"] >= 0
    stages = set(json.loads(out.getvalue())["stages"])
    assert {"tokenize", "offload.send", "offload.run", "offload.return", "tokenize.inner"} <= stages
    text = io.StringIO()
    assert run_report([str(tmp_path)], out=text, err=io.StringIO()) == 0
    table = text.getvalue().split("Calls handed to process pools")[1]
    line = next(ln for ln in table.splitlines() if ln.startswith("tokenize "))
    assert line.split()[1:3] == ["ProcessPoolExecutor", "3"]


def resize_image(n: int) -> tuple[int, int]:
    from PIL import Image

    return Image.new("RGB", (n, n)).resize((n // 2, n // 2)).size


def instrument_automatic_stages() -> None:
    from stagetrace.integrations import auto_stages

    auto_stages.instrument()


@pytest.mark.parametrize("method", START_METHODS[:2], indirect=True)
def test_zero_code_stages_in_a_worker_nest_under_its_run(harness, method):
    """A forked worker inherits the automatic stages' patches; a spawned one gets them from the pool's
    initializer. Either way PIL's resize in the worker is a stage under the call's run, marked as the worker's."""
    from stagetrace.integrations import auto_stages

    auto_stages.instrument()
    try:
        initializer = instrument_automatic_stages if method == "spawn" else None
        with cf.ProcessPoolExecutor(1, mp_context=mp.get_context(method), initializer=initializer) as pool:
            with stagetrace.pipeline("request"):
                assert pool.submit(resize_image, 64).result() == (32, 32)
    finally:
        auto_stages.uninstrument()
    spans = harness.spans()
    (run,) = [s for s in spans if s.name == "offload.run"]
    (resize,) = [s for s in spans if s.name == "resize"]
    assert resize.parent.span_id == run.context.span_id
    assert attrs(resize)[c.WORKER_PID] == attrs(run)[c.WORKER_PID] != os.getpid()


BEFORE_CONFIGURE = """
import concurrent.futures as cf, multiprocessing as mp, os, sys

def tokenize(text):
    import stagetrace
    with stagetrace.stage("tokenize.inner"):
        return len(text.split())

if __name__ == "__main__":
    executor = cf.ProcessPoolExecutor(2, mp_context=mp.get_context(sys.argv[2]))
    pool = mp.get_context(sys.argv[2]).Pool(2)
    assert executor.submit(os.getpid).result() and pool.apply_async(os.getpid).get()  # started and warm
    import stagetrace  # only now

    handle = stagetrace.configure("early-pools", traces_path=sys.argv[1], set_global=False)
    with stagetrace.pipeline("request"):
        assert executor.submit(tokenize, "a b c").result() == 3
        assert pool.apply_async(tokenize, ("d e",)).get() == 2
    assert handle.force_flush(30)
    handle.shutdown()
    executor.shutdown()
    pool.close()
    pool.join()
"""


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_pools_made_and_warmed_before_configure_are_traced(tmp_path, start_method):
    """In a process of its own (the patches are process-wide): both kinds of pool made, their workers started,
    before stagetrace is imported; each call in the request is still an offload stage with the worker's own
    stage under its run."""
    import json
    import subprocess
    import sys

    script, traces = tmp_path / "early.py", tmp_path / "traces.jsonl"
    script.write_text(BEFORE_CONFIGURE)
    done = subprocess.run(
        [sys.executable, str(script), str(traces), start_method], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    spans = [
        s for line in traces.read_text().splitlines() for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"] for s in ss["spans"]
    ]  # fmt: skip

    def attributes(span):
        return {a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", ())}

    calls = {attributes(s).get(c.OFFLOAD_EXECUTOR) for s in spans if attributes(s).get(c.STAGE_KIND) == "offload"}
    assert calls == {"ProcessPoolExecutor", "multiprocessing.Pool"}
    runs = {s["spanId"] for s in spans if s["name"] == "offload.run"}
    inner = [s for s in spans if s["name"] == "tokenize.inner"]
    assert len(runs) == 2 and len(inner) == 2 and {s["parentSpanId"] for s in inner} == runs


# --- the service: a FastAPI app on uvicorn handing work to process pools -----------------------------


def regex_tokenize(text: str) -> int:
    import re as regex

    with stagetrace.stage("tokenize.inner"):
        return len(regex.findall(r"\w+(?:'\w+)*|[^\w\s]", text))


def array_mean(array) -> float:
    return float(array.mean())


@pytest.mark.slow
def test_a_fastapi_service_handing_work_to_process_pools_gets_verdicts_about_the_pools(harness):
    """The first-contact service: an ``async def`` endpoint awaiting ``run_in_executor`` on a process pool (a
    regex over 200 KB), one handing it a 20 MB array, a ``def`` endpoint calling ``Pool.apply_async().get()``;
    six clients. The verdicts are about the pools (their queue, the transfer), never a lock or the event
    loop for the wait on the pool, and no worker's stage is a trace of its own."""
    np = pytest.importorskip("numpy")
    from fastapi import FastAPI

    from servers import hit, serve

    text = "the quick brown fox's jump, " * 7_300  # ~200 KB
    array = np.ones(5_000_000, dtype=np.float32)  # 20 MB
    executor = cf.ProcessPoolExecutor(2, mp_context=mp.get_context("fork"))
    pool = mp.get_context("fork").Pool(2)
    app = FastAPI()

    @app.get("/tokenize")
    async def tokenize_route():
        return {"n": await asyncio.get_running_loop().run_in_executor(executor, regex_tokenize, text)}

    @app.get("/array")
    async def array_route():
        return {"mean": await asyncio.get_running_loop().run_in_executor(executor, array_mean, array)}

    @app.get("/apply")
    def apply_route():
        return {"n": pool.apply_async(regex_tokenize, (text,)).get(timeout=60)}

    stagetrace.instrument_fastapi(app)
    try:
        with serve(app) as base:
            for path in ("/tokenize", "/array", "/apply"):
                assert hit(base, path, 12, 6) == [200] * 12
        verdicts = harness.wait_verdicts(36, timeout=60)
    finally:
        executor.shutdown()
        pool.terminate()
    spans = harness.spans()
    assert not [s for s in spans if s.name == "tokenize.inner" and s.parent is None]  # no rootless worker traces
    by_route: dict[str, list] = {}
    for v in verdicts:
        by_route.setdefault(v.route, []).append(v)
    offload_children = {"offload.queue", "offload.send", "offload.run", "offload.return", "tokenize.inner"}
    for route, got in by_route.items():
        assert all(set(v.breakdown) & offload_children for v in got), route
        codes = {code for v in got for code in v.diagnosis_codes}
        assert not codes & {"LOCK_OR_IO_WAIT", "EVENT_LOOP_BLOCKED"}, (route, codes)
    array_codes = {code for v in by_route["/array"] for code in v.diagnosis_codes}
    assert "IPC_BOUND" in array_codes  # 20 MB a call
    tokenize_codes = {code for v in by_route["/tokenize"] for code in v.diagnosis_codes}
    assert "POOL_SATURATED" in tokenize_codes  # six clients, two workers
    assert any(v.bottleneck == "offload.queue" for v in by_route["/tokenize"])
