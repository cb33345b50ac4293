"""Context into worker threads, and the wait for a worker as a stage.

``ThreadPoolExecutor.submit`` (and so ``loop.run_in_executor``) runs the function in a copy of the
submitter's context, so stages in workers land in the request's trace. (``asyncio.to_thread`` and
starlette's ``run_in_threadpool`` already copy it.) Inside a trace, the time between submission and a
worker picking the task up becomes a ``wait`` stage named after the pool (``<thread_name_prefix>.wait``),
noting whether every worker was busy, so QUEUEING can be told apart from dispatch latency.
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
from stagetrace._compat import executor_saturated, executor_thread_name_prefix
from stagetrace.capture.stage import add_stage
from stagetrace.integrations._common import Patch
from stagetrace.settings import MIN_WAIT_NS

_UNNAMED_POOL = re.compile(r"ThreadPoolExecutor-\d+")


def _wait_stage_name(pool: Any) -> str:
    """``<thread_name_prefix>.wait``; unnamed pools (prefix ``ThreadPoolExecutor-<n>``, unique per pool)
    share ``executor.wait`` so stage names stay low-cardinality."""
    prefix = executor_thread_name_prefix(pool)
    if not prefix or _UNNAMED_POOL.fullmatch(prefix):
        prefix = "executor"
    return f"{prefix}.wait"


def _make_submit(original: Any) -> Any:
    @functools.wraps(original)
    def submit(self: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        ctx = contextvars.copy_context()
        if _state.runtime is None or not get_current_span().get_span_context().is_valid:
            return original(self, ctx.run, fn, *args, **kwargs)
        name = _wait_stage_name(self)
        saturated = executor_saturated(self)
        submitted = time.perf_counter_ns()

        def timed(*a: Any, **k: Any) -> Any:
            started = time.perf_counter_ns()
            if started - submitted >= MIN_WAIT_NS:
                add_stage(name, "wait", submitted, started, queue_saturated=saturated)
            return fn(*a, **k)

        return original(self, ctx.run, timed, *args, **kwargs)

    return submit


SUBMIT = Patch(concurrent.futures.ThreadPoolExecutor, "submit", _make_submit)


def propagate_context_to_threads() -> None:
    SUBMIT.apply()


def stop_propagating_context() -> None:
    SUBMIT.restore()
