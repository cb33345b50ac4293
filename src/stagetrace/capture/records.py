"""Mutable records filled on the request thread and read by the finalizer.

Plain ``__slots__`` classes, not dataclasses: they are created once per stage on the hot path and must be
cheap to build.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class StageRecord:
    """One stage occurrence. Times are ``perf_counter_ns``; the finalizer converts them to epoch time."""

    __slots__ = (
        "attributes",
        "cpu",
        "end_ns",
        "error",
        "gpu",
        "implicit_root",
        "kind",
        "name",
        "on_event_loop",
        "owner",
        "parent_span_id",
        "parent_stage_id",
        "perf_to_epoch_ns",
        "runtime",
        "span_id",
        "start_ns",
        "token",
        "trace",
        "trace_flags",
        "trace_id",
        "trace_state",
    )

    def __init__(
        self,
        name: str,
        kind: str,
        runtime: Any,
        trace: TraceRecord | None,
        trace_id: int,
        span_id: int,
        parent_span_id: int,
        parent_stage_id: int,
    ) -> None:
        self.name = name
        self.kind = kind
        self.runtime = runtime
        self.trace = trace
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_span_id = parent_span_id
        self.parent_stage_id = parent_stage_id
        self.start_ns = 0
        self.end_ns = 0
        self.error: tuple[str, str, str] | None = None
        self.attributes: dict[str, Any] | None = None
        self.gpu: Any = None  # GPU timing handle (CUDA events), resolved off-thread
        self.cpu: Any = None  # CPU signal snapshot (thread CPU, schedstat) at entry, then deltas
        self.token: Any = None
        self.perf_to_epoch_ns = 0  # set for stages outside a tracked trace
        self.trace_flags: Any = None
        self.trace_state: Any = None
        self.owner: Any = None  # the stage object that opened it, so `with` exits find their own record
        self.implicit_root: Any = None  # the root this stage opened because it ran outside any trace
        self.on_event_loop = False

    def set_attribute(self, key: str, value: Any) -> None:
        if self.attributes is None:
            self.attributes = {}
        self.attributes[key] = value


class TraceRecord:
    """The local part of one trace, keyed by trace id in the registry while its local root is open."""

    __slots__ = (
        "closed",
        "created_monotonic",
        "dropped_stages",
        "lock",
        "perf_to_epoch_ns",
        "request_signals",
        "root_span_id",
        "shadowed",
        "stages",
        "trace_flags",
        "trace_id",
        "trace_state",
    )

    def __init__(
        self,
        trace_id: int,
        root_span_id: int,
        root_start_epoch_ns: int,
        trace_flags: Any = None,
        trace_state: Any = None,
    ) -> None:
        self.trace_id = trace_id
        self.trace_flags = trace_flags
        self.trace_state = trace_state
        self.root_span_id = root_span_id
        # One offset per trace, taken when its root starts: aligns stage timestamps to the root's clock.
        self.perf_to_epoch_ns = root_start_epoch_ns - time.perf_counter_ns()
        self.created_monotonic = time.monotonic()
        self.stages: list[StageRecord] = []
        self.dropped_stages = 0
        self.closed = False
        self.lock = threading.Lock()
        self.shadowed: TraceRecord | None = None  # an outer local root of the same trace id in this process
        self.request_signals: dict[str, Any] | None = None  # queue wait, loop lag ... set by integrations
