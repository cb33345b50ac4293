"""Process pools: each call a traced request hands to one is a stage of kind ``offload`` (``capture/offload.py``).

Patched at class level, so pools made before ``configure()`` are covered: ``ProcessPoolExecutor.submit`` (and
so ``map`` and ``loop.run_in_executor``), ``multiprocessing.Pool.apply_async`` (and so ``apply``) and the task
generation behind ``map_async``, ``imap``, ``imap_unordered`` and ``starmap`` (``map`` and ``starmap`` too):
one offload stage per task, a chunk of items where the pool chunks them, ended at its failure (a task that
could not be sent, a result that could not come back) as ``apply_async``'s are. The pools' worker entry
points are wrapped too, so a worker forked from a configured process drops the runtime it inherited at its
start (its initializer included) rather than at its first call. Thread pools (``multiprocessing.pool.ThreadPool``) are
left as they are. Outside a traced request a patched call costs a lookup and a branch and changes nothing.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib
import multiprocessing.pool
import threading
from collections.abc import Iterator
from typing import Any

from stagetrace import _state
from stagetrace._compat import (
    MP_POOL_TASKS,
    MP_POOL_WORKER,
    PROCESS_POOL_WORKER,
    mp_pool_facts,
    process_pool_facts,
    watch_mp_job_outcomes,
)
from stagetrace._safety import report_internal_error
from stagetrace.capture import offload
from stagetrace.capture.stage import current_parent
from stagetrace.capture.worker import enter_worker_mode, watch_task_queue
from stagetrace.integrations._common import Patch

_PROCESS_POOL = "ProcessPoolExecutor"
_MP_POOL = "multiprocessing.Pool"
_REPLAYED = "_helper_reraises_exception"  # the task that re-raises an iterable's own error: not the user's call


def _begin(pool: Any, executor: str, fn: Any, args: tuple[Any, ...]) -> offload.PendingOffload | None:
    rt = _state.runtime
    if rt is None:
        return None
    try:
        parent = current_parent(rt)
        if parent is None:
            return None
        return _begin_at(rt, parent, pool, executor, fn, args)
    except Exception:
        report_internal_error("offload submission")
        return None


def _begin_at(rt: Any, parent: Any, pool: Any, executor: str, fn: Any, args: tuple[Any, ...]) -> offload.PendingOffload:
    if executor == _PROCESS_POOL:
        size, holding, method = process_pool_facts(pool)
        in_flight = None if holding is None else holding + 1
    else:
        (size, method), in_flight = mp_pool_facts(pool), None
    return offload.begin(rt, parent, fn, args, executor, size, method, pool, in_flight)


def _make_submit(original: Any) -> Any:
    @functools.wraps(original)
    def submit(self: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        pending = _begin(self, _PROCESS_POOL, fn, args)
        if pending is None:
            return original(self, fn, *args, **kwargs)
        try:
            future = original(self, offload.OffloadCall(fn, args, kwargs, pending))
        except BaseException:
            offload.abandon(pending)
            raise
        _watch(future, pending)
        return future

    return submit


def _watch(future: Any, pending: offload.PendingOffload) -> None:
    """A call that fails without its worker's report (the pool broke, its arguments could not be sent) ends
    at its failure, before the future wakes its waiters (or, where the pool failed it before this wrapper was
    in place, as it completes); a cancelled one when it is cancelled. ``failed`` is idempotent."""
    set_exception = future.set_exception

    def failing(exc: BaseException) -> None:
        offload.failed(pending, exc)
        set_exception(exc)

    def done(f: Any) -> None:
        if f.cancelled():
            offload.failed(pending, concurrent.futures.CancelledError())
        elif f.exception() is not None:
            offload.failed(pending, f.exception())

    future.set_exception = failing
    future.add_done_callback(done)


def _make_apply_async(original: Any) -> Any:
    @functools.wraps(original)
    def apply_async(
        self: Any,
        func: Any,
        args: tuple[Any, ...] = (),
        kwds: dict[str, Any] | None = None,
        callback: Any = None,
        error_callback: Any = None,
    ) -> Any:
        kwds = {} if kwds is None else kwds
        pending = None if isinstance(self, multiprocessing.pool.ThreadPool) else _begin(self, _MP_POOL, func, args)
        if pending is None:
            return original(self, func, args, kwds, callback, error_callback)

        def on_error(exc: BaseException) -> None:
            offload.failed(pending, exc)
            if error_callback is not None:
                error_callback(exc)

        try:
            return original(
                self, offload.OffloadCall(func, tuple(args), dict(kwds), pending), (), {}, callback, on_error
            )
        except BaseException:
            offload.abandon(pending)
            raise

    return apply_async


def _make_task_generation(original: Any) -> Any:
    @functools.wraps(original)
    def guarded_task_generation(self: Any, result_job: Any, func: Any, iterable: Any) -> Iterator[Any]:
        tasks = original(self, result_job, func, iterable)
        rt = _state.runtime
        if rt is None or isinstance(self, multiprocessing.pool.ThreadPool):
            return tasks
        try:
            parent = current_parent(rt)  # here, in the caller's thread: the tasks are made on the pool's
            if parent is None:
                return tasks
            calls = _watch_job(self, result_job)
        except Exception:
            report_internal_error("offload submission")
            return tasks
        if calls is None:
            return tasks
        return _offloaded_tasks(tasks, rt, parent, self, calls)

    return guarded_task_generation


def _watch_job(pool: Any, job: Any) -> dict[int, offload.PendingOffload] | None:
    """The job's traced calls by task index, each ended at its failure where its worker's report did not end
    it: a task the pool could not send (a function or argument that cannot be pickled), a result its worker
    could not send back. The pool hands every task's outcome to the job's result (``_compat``): watched on
    this job alone, it is the failure hook ``apply_async`` has in its error callback. None where the pool
    holds no result for the job (an empty map: no tasks) or its layout differs."""
    calls: dict[int, offload.PendingOffload] = {}

    def outcome(index: int, value: Any) -> None:
        try:
            pending = calls.pop(index, None)
            if pending is not None and not value[0]:
                offload.failed(pending, value[1])  # idempotent: a call whose report came is already ended
        except Exception:
            report_internal_error("offload failure")

    return calls if watch_mp_job_outcomes(pool, job, outcome) else None


def _offloaded_tasks(
    tasks: Iterator[Any], rt: Any, parent: Any, pool: Any, calls: dict[int, offload.PendingOffload]
) -> Iterator[Any]:
    for job, index, fn, args, kwds in tasks:
        if getattr(fn, "__name__", "") == _REPLAYED:
            yield job, index, fn, args, kwds
            continue
        try:
            call: Any = offload.OffloadCall(fn, args, kwds, _begin_at(rt, parent, pool, _MP_POOL, fn, args))
            calls[index] = call.pending  # before the pool has the task: its outcome cannot come first
        except Exception:
            report_internal_error("offload submission")
            call = None
        yield (job, index, call, (), {}) if call is not None else (job, index, fn, args, kwds)


def _make_worker_entry(original: Any) -> Any:
    @functools.wraps(original)
    def worker_entry(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return original(*args, **kwargs)  # a ThreadPool's worker thread, in this very process
        try:
            worker = enter_worker_mode()
            if args:  # the pool's task queue (call_queue, inqueue) comes first in both pools' entry points
                watch_task_queue(worker, args[0])
        except Exception:
            report_internal_error("pool worker start")
        return original(*args, **kwargs)

    return worker_entry


def _module_patch(where: tuple[str, str], make: Any) -> Patch:
    module, name = where
    return Patch(importlib.import_module(module), name, make)


PATCHES = (
    Patch(concurrent.futures.ProcessPoolExecutor, "submit", _make_submit),
    Patch(multiprocessing.pool.Pool, "apply_async", _make_apply_async),
    Patch(multiprocessing.pool.Pool, MP_POOL_TASKS, _make_task_generation),
    _module_patch(PROCESS_POOL_WORKER, _make_worker_entry),
    _module_patch(MP_POOL_WORKER, _make_worker_entry),
)


def trace_process_pools() -> None:
    for patch in PATCHES:
        patch.apply()


def stop_tracing_process_pools() -> None:
    for patch in PATCHES:
        patch.restore()


__all__ = ["stop_tracing_process_pools", "trace_process_pools"]
