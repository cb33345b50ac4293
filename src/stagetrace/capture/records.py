"""Mutable records filled on the request thread and packed by the helper thread.

Plain ``__slots__`` classes, not dataclasses: they are created once per stage on the hot path and must be
cheap to build.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from opentelemetry.trace import NonRecordingSpan, SpanContext

from stagetrace.common.wire import as_example, record_packer
from stagetrace.settings import (
    KEEP_REPEATS,
    MAX_ATTRIBUTE_VALUE_LENGTH,
    MAX_OTHER_SPANS_PER_TRACE,
    MAX_STAGE_ATTRIBUTES,
)

_SCALARS = (str, bool, int, float)


def clean_attribute_value(value: Any) -> Any:
    """OpenTelemetry's attribute types, with strings cut to a bound; None for anything else."""
    if isinstance(value, str):
        return value[:MAX_ATTRIBUTE_VALUE_LENGTH]
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, _SCALARS) for v in value):
        return tuple(v[:MAX_ATTRIBUTE_VALUE_LENGTH] if isinstance(v, str) else v for v in value[:128])
    return None


class LoneStageSink(Protocol):
    def submit_lone_stage(self, rec: StageRecord) -> None: ...


class DropCounter(Protocol):
    def dropped(self, reason: str, count: int = 1) -> None: ...


class CaptureRuntime(Protocol):
    """What the request path reads of the configured runtime (``stagetrace.runtime.Runtime``): the seam
    between capture and everything after it."""

    tracer: Any  # the SDK tracer that opens local roots (pipeline(), a stage outside any trace, a batch)
    max_stages_per_trace: int
    cpu_signals: Any  # capture.cpu.CpuSignals, or None with Settings(cpu_signals=False)
    recent_stage_ms: dict[str, float]

    @property
    def shipper(self) -> LoneStageSink: ...
    @property
    def metrics(self) -> DropCounter: ...

    gpu: Any  # gpu.GpuSupport once attached (its request-path side: start, finish, forget, backend)

    def lookup_trace(self, trace_id: int) -> TraceRecord | None: ...

    loop_blocks: Any  # capture.loopblocks.LoopBlockBuffer: sync stages that held an event loop

    def requests_on_loop(self, thread: int) -> int: ...


class SpanContextOnDemand:
    """The ``SpanContext`` of a capture record, built the first time something asks for it (a child span
    opened by another instrumentation): most records are never asked. Shared by stages and light spans,
    whose span base classes give them a ``__dict__`` anyway, where ``_span_context`` goes once built."""

    trace_id: int
    span_id: int
    trace_flags: Any
    trace_state: Any
    _span_context: SpanContext | None = None

    def get_span_context(self) -> SpanContext:
        sc = self._span_context
        if sc is None:
            sc = self._span_context = SpanContext(
                self.trace_id, self.span_id, False, self.trace_flags, self.trace_state
            )
        return sc


class StageRecord(SpanContextOnDemand, NonRecordingSpan):
    """One stage occurrence, and the stage's own non-recording span while it runs.

    Being the span itself saves building a SpanContext and a wrapper per stage: the SpanContext is made
    only if something (a foreign instrumentation opening a child span) asks for it. Times are
    ``perf_counter_ns``; the exporter converts them to epoch time. Attributes set on it through the span
    API (``trace.get_current_span().set_attribute``) land on the stage span.
    """

    __slots__ = (
        "cpu_end",
        "cpu_start",
        "end_ns",
        "kind",
        "name",
        "owner",
        "parent_span_id",
        "parent_stage_id",
        "runtime",
        "span_id",
        "start_ns",
        "token",
        "trace",
        "trace_flags",
        "trace_id",
        "trace_state",
    )

    # Rarely set: class-level defaults, so the hot path does not pay to initialise them. (The base class
    # gives instances a __dict__, which holds them once set.)
    error: tuple[str, str, str] | None = None
    attributes: dict[str, Any] | None = None
    gpu: Any = None  # GPU timing handle (CUDA events), resolved on the helper thread
    perf_to_epoch_ns = 0  # set for stages outside a tracked trace
    implicit_root: Any = None  # the root this stage opened because it ran outside any trace
    on_event_loop = False
    blocks_loop = False  # on the loop thread and not inside another stage that already holds it
    # Shipped fields (common.wire.STAGE_FIELDS) beyond times and ids, filled in by the integrations and
    # by the GPU timer on the helper thread.
    gpu_ms: float | None = None
    h2d_bytes: int | None = None
    h2d_pinned: bool | None = None
    gpu_utilization: float | None = None
    queue_saturated: bool | None = None
    batch: tuple[Any, ...] | None = None  # analysis.BatchInfo as a plain tuple, on stages of a batch
    gpu_resolved = False  # CUDA events already read (a batch's stage is shipped with every member)
    repeat: Repeat | None = None  # the composite this occurrence folds into (decided at its entry)
    compressed: tuple[int, int, int, int] | None = None  # on a composite: occurrences, summed, least, most ns
    example = False  # the slowest of a composite's occurrences, shipped for export only
    worker_pid: int | None = None  # set on the stages a pool's worker recorded (capture/worker.py)
    offload: tuple[Any, ...] | None = None  # analysis.offload.OffloadFields, on a call handed to a process pool

    def __init__(
        self,
        name: str,
        kind: str,
        runtime: CaptureRuntime,
        trace: TraceRecord | None,
        trace_id: int,
        span_id: int,
        parent_span_id: int,
        parent_stage_id: int,
        trace_flags: Any = None,
        trace_state: Any = None,
        owner: Any = None,
    ) -> None:
        self.name = name
        self.kind = kind
        self.runtime = runtime
        self.trace = trace
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_span_id = parent_span_id
        self.parent_stage_id = parent_stage_id
        self.trace_flags = trace_flags
        self.trace_state = trace_state
        self.owner = owner  # the stage object that opened it, so `with` exits find their own record
        self.cpu_start: Any = None  # raw CPU readings (schedstat bytes or thread CPU ns), parsed off-thread
        self.cpu_end: Any = None
        self.start_ns = 0
        self.end_ns = 0
        self.token: Any = None

    @property
    def wall_ms(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e6

    # --- the non-recording span API (get_span_context: SpanContextOnDemand) --------------------------
    def set_attribute(self, key: str, value: Any) -> None:
        attrs = self.attributes
        if attrs is None:
            attrs = self.attributes = {}
        if not isinstance(key, str) or not key or (key not in attrs and len(attrs) >= MAX_STAGE_ATTRIBUTES):
            return
        cleaned = clean_attribute_value(value)
        if cleaned is not None:
            attrs[key] = cleaned

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def __repr__(self) -> str:
        return f"StageRecord({self.name!r}, kind={self.kind!r}, span_id={self.span_id:016x})"


# The helper thread's packing of a stage: the rarely set wire fields read as one tuple of their defaults where
# the record's __dict__ is empty, from it with their defaults where not (common.wire.record_packer).
pack_stage_record = record_packer(StageRecord)


# The fields set on a recorded stage (``capture.stage.add_stage``) that a composite aggregates over the
# occurrences it folds; a stage with any other set is never folded, so that its own value is not lost.
FOLDED_FIELDS = frozenset({"queue_saturated"})


class Repeat:
    """A stage name's occurrences under one parent span in one trace. The first ``KEEP_REPEATS`` stay real
    stages; from then on every occurrence folds into this record at its exit (its time summed, the least
    and the most kept, the slowest occurrence kept whole as an example), so a stream of any length holds
    one record per name and parent: the composite, shipped as a stage of its own. An occurrence folds if
    the composite existed when it began, so that its children (and their repeats) attach to the composite's
    span id, which all its occurrences share. Changed only under the trace's lock."""

    __slots__ = (
        "batch",
        "count",
        "end_ns",
        "error",
        "folded",
        "folding",
        "kind",
        "max_ns",
        "min_ns",
        "name",
        "on_event_loop",
        "parent_span_id",
        "parent_stage_id",
        "queue_saturated",
        "slowest",
        "span_id",
        "start_ns",
        "sum_ns",
    )

    # The shipped fields (common.wire.STAGE_FIELDS) a composite has no value for; no CUDA events of its own.
    cpu_start = cpu_end = attributes = gpu_ms = gpu_utilization = h2d_bytes = h2d_pinned = None
    gpu = worker_pid = offload = None
    example = False
    gpu_resolved = True

    def __init__(self, first: StageRecord, count: int) -> None:
        self.name = first.name
        self.kind = first.kind
        self.parent_span_id = first.parent_span_id
        self.parent_stage_id = first.parent_stage_id
        self.count = count  # real occurrences so far
        self.folded = 0  # occurrences folded in
        self.folding = False
        self.span_id = 0
        self.start_ns = self.end_ns = self.sum_ns = self.min_ns = self.max_ns = 0
        self.slowest: StageRecord | None = None
        self.error: tuple[str, str, str] | None = None
        self.batch: tuple[Any, ...] | None = None  # a folded batch wait's: its formation and busy time summed
        self.on_event_loop = False  # an occurrence ran sync on the event loop (EVENT_LOOP_BLOCKED reads it)
        # The folded occurrences' shared flag, None once they differ (a wait's time then counts as queued). Only
        # a wait stage carries one (the integrations that record waits set it): any other folds without a read
        # of it, which on a record that never set it is a lookup through its class.
        self.queue_saturated: bool | None = None

    @property
    def compressed(self) -> tuple[int, int, int, int]:
        return (self.folded, self.sum_ns, self.min_ns, self.max_ns)

    @classmethod
    def started(cls, name: str, kind: str, parent_span_id: int, parent_stage_id: int, span_id: int) -> Repeat:
        """A composite that folds from its first occurrence on (one whose real occurrences are kept elsewhere,
        as a dynamic batch's first memberships are)."""
        self = cls.__new__(cls)
        self.name, self.kind = name, kind
        self.parent_span_id, self.parent_stage_id = parent_span_id, parent_stage_id
        self.count, self.folded, self.folding, self.span_id = KEEP_REPEATS, 0, True, span_id
        self.start_ns = self.end_ns = self.sum_ns = self.min_ns = self.max_ns = 0
        self.slowest = None
        self.error = None
        self.batch = None
        self.on_event_loop = False
        self.queue_saturated = None
        return self

    def fold(self, rec: StageRecord) -> None:
        """``add`` for an occurrence recorded as a stage, which becomes the example when it is the slowest
        (written out: it runs for every folded occurrence on the request thread)."""
        start, end = rec.start_ns, rec.end_ns
        ns = end - start if end > start else 0
        self.folded += 1
        if self.folded == 1:
            self.start_ns, self.min_ns = start, ns
            if self.kind == "wait":
                self.queue_saturated = rec.queue_saturated
        elif self.kind == "wait" and rec.queue_saturated is not self.queue_saturated:
            self.queue_saturated = None
        self.sum_ns += ns
        if end > self.end_ns:
            self.end_ns = end
        if ns < self.min_ns:
            self.min_ns = ns
        if rec.error is not None and self.error is None:
            self.error = rec.error
        if rec.on_event_loop:
            self.on_event_loop = True
        if ns >= self.max_ns:
            self.max_ns = ns
            self.slowest = rec

    def add(self, start: int, end: int, error: tuple[str, str, str] | None = None) -> bool:
        """One occurrence folded in; True when it is the slowest so far."""
        ns = end - start if end > start else 0
        self.folded += 1
        if self.folded == 1:
            self.start_ns, self.min_ns = start, ns
        self.sum_ns += ns
        if end > self.end_ns:
            self.end_ns = end
        if ns < self.min_ns:
            self.min_ns = ns
        if error is not None and self.error is None:
            self.error = error
        if ns >= self.max_ns:
            self.max_ns = ns
            return True
        return False


def folding_repeat(seen: Any, parent_span_id: int) -> Repeat | None:
    """The composite that an occurrence of a name starting now under ``parent_span_id`` folds into, from
    what ``TraceRecord.repeats`` holds for the name: the parent of its only occurrence so far (an int), its
    ``Repeat`` under one parent, or a dict of those by parent."""
    if type(seen) is Repeat:
        return seen if seen.folding and seen.parent_span_id == parent_span_id else None
    if type(seen) is dict:
        found = seen.get(parent_span_id)
        return found if type(found) is Repeat and found.folding else None
    return None


def count_repeat(trace: TraceRecord, rec: StageRecord, new_span_id: Any) -> None:
    """Under the trace's lock, after ``rec`` was kept as a real stage: one more occurrence of its name under
    its parent; the one that reaches ``KEEP_REPEATS`` starts the composite (appended to the trace's stages
    once, with a span id of its own) that later occurrences fold into."""
    name, parent = rec.name, rec.parent_span_id
    seen = trace.repeats.get(name)
    if seen is None:
        trace.repeats[name] = parent
        return
    if type(seen) is int:
        if seen != parent:
            trace.repeats[name] = {seen: 1, parent: 1}
            return
        seen = trace.repeats[name] = Repeat(rec, 1)
    elif type(seen) is Repeat and seen.parent_span_id != parent:  # a second parent: one count per parent
        trace.repeats[name] = {seen.parent_span_id: seen, parent: 1}
        return
    elif type(seen) is dict:
        found = seen.get(parent)
        if type(found) is not Repeat:
            if found is None:
                seen[parent] = 1
                return
            found = seen[parent] = Repeat(rec, found)
        seen = found
    repeat: Repeat = seen
    repeat.count += 1
    if repeat.count == KEEP_REPEATS and not repeat.folding:
        repeat.span_id = new_span_id(64) or 1  # before folding is set: enter_stage reads it without the lock
        repeat.folding = True
        trace.stages.append(repeat)  # type: ignore[arg-type]  # a stage to the shipper, as a composite


def pack_stages(
    stages: list[Any], pack: Callable[[Any], tuple[Any, ...]] = pack_stage_record
) -> tuple[tuple[Any, ...], ...]:
    """A trace's stages as wire tuples: a composite of repeated occurrences (once anything folded into it)
    with its slowest occurrence as the example span, one not folded into yet left out (its occurrences are
    stages of their own). A trace without composites, the usual one, is packed in one pass (no loop here)."""
    if Repeat not in map(type, stages):
        return tuple(map(pack, stages))
    out = []
    for rec in stages:
        if type(rec) is not Repeat:
            out.append(pack(rec))
        elif rec.folded:
            out.append(pack(rec))
            if rec.slowest is not None:
                out.append(as_example(pack(rec.slowest), _new_span_id(64) or 1))
    return tuple(out)


_new_span_id = random.getrandbits  # for the example span of a composite (its occurrence shared the composite's id)


class TraceRecord:
    """The local part of one trace, keyed by trace id in the registry while its local root is open."""

    max_others = MAX_OTHER_SPANS_PER_TRACE  # other instrumentations' spans held with the trace

    __slots__ = (
        "arrival",
        "batch",
        "closed",
        "created_monotonic",
        "dropped_stages",
        "gen_ai",
        "lock",
        "loop_thread",
        "member_folds",
        "memberships",
        "others",
        "perf_to_epoch_ns",
        "repeats",
        "root_ended",
        "root_span_id",
        "shadowed",
        "stages",
        "stream",
        "trace_flags",
        "trace_id",
        "trace_state",
        "worker_runs",
    )

    def __init__(
        self,
        trace_id: int,
        root_span_id: int,
        root_start_epoch_ns: int,
        trace_flags: Any = None,
        trace_state: Any = None,
        loop_thread: int = 0,
    ) -> None:
        self.trace_id = trace_id
        self.loop_thread = loop_thread  # the thread of the event loop its root started on; 0: none
        # When its request reached the server, if its root opened in a task that noted it (capture/arrival.py):
        # (task created, perf ns; ms since the request's socket last received data, or -1).
        self.arrival: tuple[int, int] | None = None
        self.trace_flags = trace_flags
        self.trace_state = trace_state
        self.root_span_id = root_span_id
        # One offset per trace, taken when its root starts: aligns stage timestamps to the root's clock.
        self.perf_to_epoch_ns = root_start_epoch_ns - time.perf_counter_ns()
        self.created_monotonic = time.monotonic()
        self.stages: list[StageRecord] = []
        # Stage names seen so far, by name: what ``folding_repeat`` / ``count_repeat`` read and keep.
        self.repeats: dict[str, Any] = {}
        self.others: list[Any] = []  # other instrumentations' spans of this trace (SDK ReadableSpans)
        self.dropped_stages = 0
        self.closed = False  # shipped: stages ending from now on go on their own
        self.root_ended = False  # the request is over: a batch starting now is too late to serve it
        self.lock = threading.Lock()
        self.shadowed: TraceRecord | None = None  # an outer local root of the same trace id in this process
        self.batch: Any = None  # the Batch whose span is this trace's root (stagetrace.batch())
        self.memberships: list[Any] | None = None  # batches this trace's requests were served by
        # Past KEEP_REPEATS memberships of one wait name under one parent, the rest fold (capture/batch.py).
        self.member_folds: dict[tuple[str, int], Any] | None = None
        self.worker_runs: list[int] | None = None  # start, end, ...: its code ran on worker threads then
        self.stream: Any = None  # capture.streams.StreamStats, once its response streams
        self.gen_ai: dict[str, Any] | None = None  # what generative model it serves (stagetrace.generation)
