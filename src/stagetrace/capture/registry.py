"""Traces in flight: trace id -> TraceRecord, bounded in count and age."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from stagetrace.capture.records import TraceRecord


class TraceRegistry:
    """Lookups are lock-free dict reads (the stage hot path); inserts and removals take a lock.

    ``on_drop(reason, count)`` is told of every trace that is not tracked or evicted, so the counts become
    the ``stagetrace.dropped`` metric.
    """

    def __init__(self, max_traces: int, ttl_s: float, on_drop: Callable[[str, int], None]) -> None:
        if max_traces < 1:
            raise ValueError("max_traces must be >= 1")
        self.max_traces = max_traces
        self.ttl_s = ttl_s
        self._on_drop = on_drop
        self._traces: dict[int, TraceRecord] = {}
        self._on_loop: dict[int, int] = {}  # loop thread -> traces in flight whose root started on it
        self._lock = threading.Lock()
        # Set whenever a trace opens: a sampler that only measures while traces are in flight waits on it.
        self.idle_wake: threading.Event | None = None

    def __len__(self) -> int:
        return len(self._traces)

    def count_function(self) -> Callable[[], int]:
        """The bound ``dict.__len__``, for the GIL monitor's check at each wake-up: no Python frame, where
        ``len(registry)`` runs this class's ``__len__``; valid for the same reason as ``lookup_function``'s."""
        return self._traces.__len__

    def lookup_function(self) -> Callable[[int], TraceRecord | None]:
        """The bound ``dict.get`` for the hot path; stays valid because the dict is never replaced."""
        return self._traces.get

    def open(
        self,
        trace_id: int,
        root_span_id: int,
        root_start_epoch_ns: int,
        trace_flags: Any = None,
        trace_state: Any = None,
        loop_thread: int = 0,
        arrival: tuple[int, int] | None = None,
    ) -> TraceRecord | None:
        rec = TraceRecord(trace_id, root_span_id, root_start_epoch_ns, trace_flags, trace_state, loop_thread)
        if arrival is not None:
            rec.arrival = arrival
        with self._lock:
            if len(self._traces) >= self.max_traces:
                full = True
            else:
                full = False
                rec.shadowed = self._traces.get(trace_id)
                self._traces[trace_id] = rec
                if loop_thread:
                    self._on_loop[loop_thread] = self._on_loop.get(loop_thread, 0) + 1
        if full:
            self._on_drop("traces_in_flight", 1)
            return None
        wake = self.idle_wake
        if wake is not None and not wake.is_set():
            wake.set()
        return rec

    def close(self, trace_id: int, root_span_id: int) -> TraceRecord | None:
        """Remove and return the record whose local root is ``root_span_id``, if it is tracked."""
        with self._lock:
            rec = self._traces.get(trace_id)
            prev = None
            while rec is not None and rec.root_span_id != root_span_id:
                prev, rec = rec, rec.shadowed
            if rec is None:
                return None
            if prev is None:
                if rec.shadowed is not None:
                    self._traces[trace_id] = rec.shadowed
                else:
                    del self._traces[trace_id]
            else:
                prev.shadowed = rec.shadowed
            rec.shadowed = None
            self._left_loop(rec)
            return rec

    def _left_loop(self, rec: TraceRecord) -> None:
        """Under the lock: one trace fewer in flight on its loop."""
        if rec.loop_thread:
            left = self._on_loop.get(rec.loop_thread, 0) - 1
            if left > 0:
                self._on_loop[rec.loop_thread] = left
            else:
                self._on_loop.pop(rec.loop_thread, None)

    def on_loop(self, thread: int) -> int:
        """Traces in flight whose root started on the event loop of ``thread`` (a lock-free read)."""
        return self._on_loop.get(thread, 0)

    def evict_expired(self, now: float | None = None) -> list[TraceRecord]:
        """Drop roots that never ended (leaked spans, crashed handlers) after ``ttl_s``."""
        now = time.monotonic() if now is None else now
        cutoff = now - self.ttl_s
        evicted: list[TraceRecord] = []
        with self._lock:
            for tid in [t for t, r in self._traces.items() if r.created_monotonic < cutoff]:
                rec: TraceRecord | None = self._traces.pop(tid)
                while rec is not None:
                    evicted.append(rec)
                    self._left_loop(rec)
                    rec = rec.shadowed
        if evicted:
            self._on_drop("trace_timeout", len(evicted))
        return evicted

    def clear(self) -> None:
        with self._lock:
            self._traces.clear()
            self._on_loop.clear()
