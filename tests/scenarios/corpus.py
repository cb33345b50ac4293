"""The scenarios: for each rule an app whose requests live its cause, and a healthy twin of the same shape
without it. ``lived`` says, from what a request's own verdict measured, whether it lived the cause (a burst
queues only the requests beyond the pool's size); the rule must fire on those. ``allowed`` are codes whose
cause the scenario also creates (a queue behind an underfilled batcher is also QUEUEING)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import stagetrace
from stagetrace.analysis import DiagnosisThresholds, Verdict


@dataclass
class Workload:
    app: Any
    path: str
    running: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext  # background load


@dataclass(frozen=True)
class Scenario:
    name: str
    rule: str | None  # None: a healthy twin, which must fire nothing
    build: Callable[[], Workload]
    twin_of: str | None = None  # on a healthy twin: the rule whose cause it removes
    requests: int = 12
    concurrency: int = 4
    allowed: frozenset[str] = frozenset()
    lived: Callable[[Verdict], bool] = field(default=lambda v: True)
    needs_gpu: bool = False


def busy(ms: float) -> int:
    """Pure-Python CPU work holding the GIL for about ``ms``."""
    end = time.perf_counter() + ms / 1000
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def busy_cpu(ms: float) -> int:
    """Pure-Python work of a fixed ``ms`` of this thread's CPU time: what it waits for (the GIL) adds to its
    wall time, as a tokenizer's fixed work does."""
    end = time.thread_time() + ms / 1000
    n = 0
    while time.thread_time() < end:
        n += 1
    return n


_BLOCK = bytes(range(256)) * 1024


def compress(ms: float) -> int:
    """zlib work, which releases the GIL, for about ``ms`` on one core."""
    end = time.perf_counter() + ms / 1000
    n = 0
    while time.perf_counter() < end:
        n += len(zlib.compress(_BLOCK, 6))
    return n


def fastapi_app(**kwargs: Any) -> Any:
    from fastapi import FastAPI

    return FastAPI(**kwargs)


def background_threads(
    target: Callable[[threading.Event], None], count: int = 1
) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """``count`` threads running ``target(stop)`` for as long as the workload runs."""

    @contextlib.contextmanager
    def running() -> Iterator[None]:
        stop = threading.Event()
        threads = [threading.Thread(target=target, args=(stop,), daemon=True) for _ in range(count)]
        for t in threads:
            t.start()
        try:
            yield
        finally:
            stop.set()
            for t in threads:
                t.join()

    return running


def thread_tokens(n: int) -> Any:
    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        import anyio.to_thread

        anyio.to_thread.current_default_thread_limiter().total_tokens = n
        yield

    return lifespan


# --- EVENT_LOOP_BLOCKED ----------------------------------------------------------------------------------


def loop_blocked(*, blocking: bool) -> Workload:
    app = fastapi_app()

    @app.get("/resize")
    async def resize() -> dict[str, int]:
        await asyncio.sleep(0.005)
        if blocking:
            with stagetrace.stage("resize"):  # sync CPU work on the event loop
                busy(40)
        else:
            async with stagetrace.stage("resize", kind="io"):  # the same time, awaited
                await asyncio.sleep(0.04)
        return {}

    return Workload(app, "/resize")


# --- GIL_CONTENTION / LOCK_OR_IO_WAIT -----------------------------------------------------------------------


def gil_contended(*, hogs: int, work_ms: float = 100, fixed_cpu: bool = False) -> Workload:
    """Each request's pure-Python stage shares the GIL with ``hogs`` threads spinning in Python: by default
    long enough (20 switch intervals) that its share of the GIL is not the luck of a few handoffs; the pairs
    scenario's 20 ms spans about two of the GIL monitor's periods."""
    app = fastapi_app()

    @app.get("/tokenize")
    def tokenize() -> dict[str, int]:
        with stagetrace.stage("tokenize"):
            (busy_cpu if fixed_cpu else busy)(work_ms)  # pure Python: needs the GIL throughout
        return {}

    def spin(stop: threading.Event) -> None:
        x = 0
        while not stop.is_set():
            x += 1

    return Workload(app, "/tokenize", background_threads(spin, hogs))


def lock_waited(*, held: bool) -> Workload:
    app = fastapi_app()
    lock = threading.Lock()

    @app.get("/lookup")
    def lookup() -> dict[str, int]:
        with stagetrace.stage("cache_lookup"), lock:
            busy(1)
        return {}

    def holder(stop: threading.Event) -> None:
        while not stop.is_set():
            with lock:
                time.sleep(0.06)  # holds the lock with the GIL free
            time.sleep(0.001)

    return Workload(app, "/lookup", background_threads(holder, 1 if held else 0))


def waited_for_the_lock(v: Verdict) -> bool:
    return v.breakdown.get("cache_lookup", 0.0) >= 10.0  # 1 ms of work: 9 ms or more behind the holder


def lock_held_across_gil_free_work() -> Workload:
    """Each request holds a lock across 20 ms of zlib work, which releases the GIL: two at a time, one waits
    for the other's, with the GIL free all along."""
    app = fastapi_app()
    lock = threading.Lock()

    @app.get("/pack")
    def pack() -> dict[str, int]:
        with stagetrace.stage("pack"), lock:
            return {"n": compress(20)}

    return Workload(app, "/pack")


def waited_enough_to_matter(stage: str, work_ms: float) -> Callable[[Verdict], bool]:
    """Whether a request's ``stage``, of ``work_ms`` of its own work, waited long enough that the rules call the
    wait significant: ``blocked_min_ms`` and ``blocked_share`` of the stage (the thresholds' defaults). A
    shorter wait is one the rules rightly stay silent on (a 20 ms stage that waited 5.2 ms, 21 % of it), so
    counting it as lived would measure the thresholds, not whether the cause is told."""
    th = DiagnosisThresholds()
    floor_ms = max(work_ms + th.blocked_min_ms, work_ms / (1 - th.blocked_share))
    return lambda v: v.breakdown.get(stage, 0.0) >= floor_ms


waited_for_the_other_request = waited_enough_to_matter("pack", 20.0)  # behind the other request's lock
waited_for_the_gil = waited_enough_to_matter("tokenize", 20.0)  # 20 ms of Python's CPU, then the GIL's waits


# --- CPU_OVERSUBSCRIBED --------------------------------------------------------------------------------------


def oversubscribed(*, threads: int, background: int) -> Workload:
    """Requests compress on up to ``threads`` worker threads while ``background`` threads of the process
    compress all along: with more of them than cores, every request's stage waits for a CPU, not only those
    of a burst's peak."""
    app = fastapi_app(lifespan=thread_tokens(threads))

    @app.get("/compress")
    def compress_endpoint() -> dict[str, int]:
        with stagetrace.stage("compress"):
            return {"n": compress(30)}  # releases the GIL: as many run at once as there are threads

    def compressing(stop: threading.Event) -> None:
        while not stop.is_set():
            compress(5)

    return Workload(app, "/compress", background_threads(compressing, background))


# --- QUEUEING --------------------------------------------------------------------------------------------------


def queued(*, tokens: int) -> Workload:
    app = fastapi_app(lifespan=thread_tokens(tokens))

    @app.get("/infer")
    def infer() -> dict[str, int]:
        with stagetrace.stage("infer", kind="io"):
            time.sleep(0.1)
        return {}

    return Workload(app, "/infer")


def waited_for_a_worker(v: Verdict) -> bool:
    return v.breakdown.get("threadpool.wait", 0.0) >= 50.0  # half a request: it waited for a token


# --- BATCH_WAIT / BATCH_UNDERFILLED ------------------------------------------------------------------------------


def batched(*, max_wait_s: float, per_batch_ms: float) -> Workload:
    from stagetrace.demo.batcher import DynamicBatcher

    app = fastapi_app()
    holder: dict[str, DynamicBatcher] = {}

    def run_batch(items: list[Any]) -> list[Any]:
        with stagetrace.stage("prepare", kind="io"):
            time.sleep(per_batch_ms / 1000)  # per-batch host work (waiting on I/O), whatever the batch's size
        return items

    @app.get("/classify")
    async def classify() -> dict[str, int]:
        return {"n": await holder["batcher"].submit(1)}

    @contextlib.contextmanager
    def running() -> Iterator[None]:
        holder["batcher"] = DynamicBatcher(run_batch, name="classify.batch", max_size=16, max_wait_s=max_wait_s)
        try:
            yield
        finally:
            holder["batcher"].close()

    return Workload(app, "/classify", running)


def queued_behind_a_batch(v: Verdict) -> bool:
    return v.breakdown.get("classify.batch.queue", 0.0) >= 20.0


# --- UNTRACKED_TIME --------------------------------------------------------------------------------------------


def untracked(*, staged: bool) -> Workload:
    app = fastapi_app()

    @app.get("/render")
    async def render() -> dict[str, int]:
        with stagetrace.stage("lookup"):
            busy(2)
        if staged:
            async with stagetrace.stage("render", kind="io"):
                await asyncio.sleep(0.03)
        else:
            await asyncio.sleep(0.03)  # in no stage
        return {}

    return Workload(app, "/render")


# --- GPU_STARVED / PAGEABLE_H2D (need a CUDA device and NVML) ---------------------------------------------


def gpu_starved(*, starved: bool) -> Workload:
    import torch

    app = fastapi_app()
    weights = torch.randn(4096, 4096, device="cuda")

    @app.get("/infer")
    def infer() -> dict[str, int]:
        with stagetrace.stage("decode"):
            busy(60 if starved else 2)  # the CPU side feeding the GPU
        x = stagetrace.h2d(torch.randn(256, 4096).pin_memory(), "cuda")
        with stagetrace.gpu_stage("forward"):
            for _ in range(1 if starved else 40):
                x = torch.tanh(x @ weights)
        return {"n": int(stagetrace.d2h(x[:1, :1]).item() != 0)}

    return Workload(app, "/infer")


def pageable_copy(*, pinned: bool) -> Workload:
    import torch

    app = fastapi_app()

    @app.get("/copy")
    def copy() -> dict[str, int]:
        host = torch.randn(1024, 1024)  # 4 MiB
        if pinned:
            host = host.pin_memory()
        x = stagetrace.h2d(host, "cuda")
        with stagetrace.gpu_stage("forward"):
            y = x * 2
        return {"n": int(stagetrace.d2h(y[:1, :1]).item() != 0)}

    return Workload(app, "/copy")


def twins(
    rule: str,
    broken: tuple[str, Callable[[], Workload], int, int],
    healthy: tuple[str, Callable[[], Workload], int, int],
    **extra: Any,
) -> tuple[Scenario, Scenario]:
    """A scenario and its healthy twin: (name, build, requests, concurrency) each."""
    name, build, requests, concurrency = broken
    twin_name, twin_build, twin_requests, twin_concurrency = healthy
    gpu = bool(extra.get("needs_gpu", False))
    return (
        Scenario(name, rule, build, requests=requests, concurrency=concurrency, **extra),
        Scenario(
            twin_name,
            None,
            twin_build,
            requests=twin_requests,
            concurrency=twin_concurrency,
            twin_of=rule,
            needs_gpu=gpu,
        ),
    )


SCENARIOS: tuple[Scenario, ...] = (
    *twins(
        "EVENT_LOOP_BLOCKED",
        ("event-loop-blocked", lambda: loop_blocked(blocking=True), 12, 4),
        ("event-loop-free", lambda: loop_blocked(blocking=False), 12, 4),
    ),
    *twins(
        "GIL_CONTENTION",
        ("gil-contended", lambda: gil_contended(hogs=1), 8, 1),
        ("gil-free", lambda: gil_contended(hogs=0), 8, 1),
    ),
    # Two requests at a time beside the hog: each also waits for the other's pure-Python stage (its twin is
    # gil-free: alone, a request's stage waits for nothing). The framework's own code around the stage waits
    # for the GIL too, in no stage.
    Scenario(
        "gil-contended-pairs",
        "GIL_CONTENTION",
        lambda: gil_contended(hogs=1, work_ms=20, fixed_cpu=True),
        requests=15,
        concurrency=2,
        allowed=frozenset({"UNTRACKED_TIME"}),
        lived=waited_for_the_gil,
    ),
    *twins(
        "LOCK_OR_IO_WAIT",
        ("lock-waited", lambda: lock_waited(held=True), 10, 2),
        ("lock-free", lambda: lock_waited(held=False), 10, 2),
        lived=waited_for_the_lock,
    ),
    *twins(
        "LOCK_OR_IO_WAIT",
        ("lock-across-gil-free-work", lambda: lock_held_across_gil_free_work(), 15, 2),
        ("lock-uncontended", lambda: lock_held_across_gil_free_work(), 8, 1),
        lived=waited_for_the_other_request,
    ),
    *twins(
        "CPU_OVERSUBSCRIBED",
        # two requests at a time on two CPUs, beside six threads of the process compressing all along (as an
        # intra-op pool would): the threads beside the requests outnumber the CPUs
        ("cpu-oversubscribed", lambda: oversubscribed(threads=2, background=6), 16, 2),
        ("cpu-within-cores", lambda: oversubscribed(threads=1, background=0), 8, 1),
        allowed=frozenset({"UNTRACKED_TIME"}),  # the server's own code, in no stage, waits for a CPU too
    ),
    *twins(
        "SERVICE_AT_CAPACITY",
        # eight requests at a time, one thread each, on two CPUs, nothing else running: the requests themselves
        ("service-at-capacity", lambda: oversubscribed(threads=8, background=0), 24, 8),
        ("service-within-capacity", lambda: oversubscribed(threads=8, background=0), 8, 1),
        allowed=frozenset({"UNTRACKED_TIME"}),
    ),
    *twins(
        "QUEUEING",
        ("queue-burst", lambda: queued(tokens=4), 16, 16),
        ("queue-within-capacity", lambda: queued(tokens=4), 12, 4),
        lived=waited_for_a_worker,
    ),
    *twins(
        "BATCH_WAIT",
        ("batch-slow-to-form", lambda: batched(max_wait_s=0.06, per_batch_ms=2), 8, 1),
        ("batch-forms-fast", lambda: batched(max_wait_s=0.001, per_batch_ms=2), 8, 1),
    ),
    *twins(
        "BATCH_UNDERFILLED",
        ("batch-underfilled", lambda: batched(max_wait_s=0.0, per_batch_ms=40), 24, 6),
        ("batch-underfilled-unloaded", lambda: batched(max_wait_s=0.0, per_batch_ms=40), 6, 1),
        allowed=frozenset({"QUEUEING"}),  # the queue behind the batcher is one
        lived=queued_behind_a_batch,
    ),
    *twins(
        "UNTRACKED_TIME",
        ("untracked-time", lambda: untracked(staged=False), 12, 4),
        ("all-tracked", lambda: untracked(staged=True), 12, 4),
    ),
    *twins(
        "GPU_STARVED",
        ("gpu-starved", lambda: gpu_starved(starved=True), 12, 1),
        ("gpu-fed", lambda: gpu_starved(starved=False), 12, 1),
        needs_gpu=True,
    ),
    *twins(
        "PAGEABLE_H2D",
        ("pageable-h2d", lambda: pageable_copy(pinned=False), 12, 1),
        ("pinned-h2d", lambda: pageable_copy(pinned=True), 12, 1),
        needs_gpu=True,
    ),
)
