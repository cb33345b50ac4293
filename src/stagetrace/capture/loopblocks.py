"""Sync stages that held an event loop, noted on the loop's thread when they end and shipped to the exporter,
which finds in them what every other request on that loop was waiting for (``analysis.loopwait``).

Only the outermost sync stage on the loop is noted (a nested one holds the loop inside it already), and
only from ``LOOP_BLOCK_MIN_NS``: shorter ones delay nobody measurably.
"""

from __future__ import annotations

import threading
from typing import Any

from stagetrace.capture.samplers import DrainQueue
from stagetrace.conventions import DELAYED_REQUESTS

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
