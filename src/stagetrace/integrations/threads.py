"""Context into worker threads, and the wait for a worker as a stage.

``ThreadPoolExecutor.submit`` (and so ``loop.run_in_executor``) runs the function in a copy of the
submitter's context, so stages in workers land in the request's trace. (``asyncio.to_thread`` and
starlette's ``run_in_threadpool`` already copy it.) Inside a trace, the time between submission and a
worker picking the task up becomes a ``wait`` stage named after the pool (``<thread_name_prefix>.wait``),
noting whether every worker was spoken for at submission (``Occupancy``), so QUEUEING can be told apart
from dispatch latency whatever the order of arrival.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import re
import time
from typing import Any

from opentelemetry.trace import get_current_span

from stagetrace import _state
from stagetrace._compat import executor_max_workers, executor_saturated, executor_thread_name_prefix
from stagetrace.capture.loopblocks import note_worker_run
from stagetrace.capture.stage import add_stage
from stagetrace.integrations._common import Occupancy, Patch
from stagetrace.settings import MIN_WAIT_NS

_UNNAMED_POOL = re.compile(r"ThreadPoolExecutor-\d+")


def _wait_stage_name(pool: Any) -> str:
    """``<thread_name_prefix>.wait``; unnamed pools (prefix ``ThreadPoolExecutor-<n>``, unique per pool)
    share ``executor.wait`` so stage names stay low-cardinality."""
    prefix = executor_thread_name_prefix(pool)
    if not prefix or _UNNAMED_POOL.fullmatch(prefix):
        prefix = "executor"
    return f"{prefix}.wait"


OCCUPANCY = Occupancy()


def _saturated_at_submit(pool: Any) -> bool | None:
    """Counts this task in; True when every worker was already spoken for (it will queue)."""
    before = OCCUPANCY.enter(pool)
    size = executor_max_workers(pool)
    if size is not None and before >= size:
        return True
    return executor_saturated(pool)  # tasks submitted before stagetrace was on are not in the count


def _make_submit(original: Any) -> Any:
    @functools.wraps(original)
    def submit(self: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        ctx = contextvars.copy_context()
        if _state.runtime is None:
            return original(self, ctx.run, fn, *args, **kwargs)
        saturated = _saturated_at_submit(self)
        try:
            if not get_current_span().get_span_context().is_valid:
                future = original(self, ctx.run, fn, *args, **kwargs)
            else:
                future = original(self, ctx.run, timed_wait(fn, _wait_stage_name(self), saturated), *args, **kwargs)
        except BaseException:
            OCCUPANCY.leave(self)
            raise
        future.add_done_callback(lambda _: OCCUPANCY.leave(self))  # also when cancelled before it ran
        return future

    return submit


def timed_wait(fn: Any, name: str, saturated: bool | None, min_ns: int | None = None) -> Any:
    """``fn`` recording, on the worker, the wait from now until a worker picked it up (if ``min_ns`` or more).

    The floor defaults to ``MIN_WAIT_NS`` read now, not when this module was imported, so a changed floor
    (a test, an embedding application) takes effect on the next submission."""
    submitted = time.perf_counter_ns()
    if min_ns is None:
        min_ns = MIN_WAIT_NS

    def timed(*a: Any, **k: Any) -> Any:
        started = time.perf_counter_ns()
        if started - submitted >= min_ns:
            add_stage(name, "wait", submitted, started, queue_saturated=saturated)
        try:
            return fn(*a, **k)
        finally:
            note_worker_run(_state.runtime, started)

    return timed


SUBMIT = Patch(concurrent.futures.ThreadPoolExecutor, "submit", _make_submit)


def propagate_context_to_threads() -> None:
    SUBMIT.apply()


def stop_propagating_context() -> None:
    SUBMIT.restore()
