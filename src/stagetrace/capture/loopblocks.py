"""Sync stages that held an event loop, noted on the loop's thread when they end and shipped to the exporter,
which finds in them what every other request on that loop was waiting for (``analysis.loopwait``).

Only the outermost sync stage on the loop is noted (a nested one holds the loop inside it already), and
only from ``LOOP_BLOCK_MIN_NS``: shorter ones delay nobody measurably.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from opentelemetry.trace import get_current_span

from stagetrace.capture.monitors import DrainQueue
from stagetrace.conventions import DELAYED_REQUESTS
from stagetrace.settings import MAX_WORKER_RUNS

_get_ident = threading.get_ident


class LoopBlockBuffer(DrainQueue[tuple[int, int, int, int, str]]):
    """(start ns, end ns, loop thread, trace id, stage name) tuples waiting to be shipped."""


def note_loop_block(rt: Any, rec: Any, end_ns: int) -> None:
    """On the loop's thread, as the stage ends: the other requests in flight on this loop could not run
    while it did (``stagetrace.delayed_requests`` on the stage), and the interval goes to the exporter."""
    thread = _get_ident()
    trace = rec.trace
    others = rt.requests_on_loop(thread) - (1 if trace is not None and trace.loop_thread == thread else 0)
    if others > 0:
        rec.set_attribute(DELAYED_REQUESTS, others)
    rt.loop_blocks.put((rec.start_ns, end_ns, thread, rec.trace_id, rec.name))


def note_worker_run(rt: Any, started_ns: int) -> None:
    """On a worker thread, after a request's function ran there: the request was busy with its own work
    from ``started_ns`` to now, not waiting for its loop (it may have no stage of its own there). ``rt``:
    the runtime (None: not configured), passed in so that this module, which the runtime imports, does not
    import the runtime's holder."""
    if rt is None:
        return
    trace = rt.lookup_trace(get_current_span().get_span_context().trace_id)
    if trace is None:
        return
    end_ns = time.perf_counter_ns()
    with trace.lock:
        if trace.closed:
            return
        runs = trace.worker_runs
        if runs is None:
            trace.worker_runs = [started_ns, end_ns]
        elif len(runs) < 2 * MAX_WORKER_RUNS:
            runs += (started_ns, end_ns)
