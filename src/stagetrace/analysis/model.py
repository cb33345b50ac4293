"""The stage as the analysis reads it: plain data shared by the analysis, the exporter and the report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol


class BatchInfo(NamedTuple):
    """What a stage knows about the dynamic batch it belongs to (``stagetrace.batch()``).

    The request's wait stage carries it with the wait split into ``formation_ms`` and ``busy_ms``; the
    member's batch stage carries the link to the batch span; the batch's inner stages, as they appear in
    a member's trace, carry the membership only. Crosses the channel as a plain tuple in this order.
    """

    id: str  # shared by every member, the batch span's id in hex
    size: int  # member requests
    items: int  # items in the whole batch
    member_index: int  # this member's place in the batch (`index` would shadow tuple.index)
    member_items: int  # this member's items
    max_size: int  # the batcher's max size in items; 0 when not given
    link_trace_id: int = 0  # the batch span, on the member's batch stage only
    link_span_id: int = 0
    formation_ms: float | None = None  # on the wait stage: waiting for the batch to form ...
    busy_ms: float | None = None  # ... and for the batcher's previous batch to finish

    @property
    def fill(self) -> float | None:
        return self.items / self.max_size if self.max_size else None

    @property
    def is_member_batch_stage(self) -> bool:
        return self.link_span_id != 0


class CompressedInfo(NamedTuple):
    """A composite stage: the occurrences of one stage name under one parent folded into it (after the first
    few, which stay stages of their own). Crosses the channel as a plain tuple in this order."""

    occurrences: int  # folded in
    sum_ns: int  # their time summed (each occurrence's own wall time)
    min_ns: int
    max_ns: int


def compressed_info(value: Any) -> CompressedInfo | None:
    """A shipped compressed tuple as ``CompressedInfo``; a clear error for one of the wrong shape."""
    if value is None or isinstance(value, CompressedInfo):
        return value
    if not isinstance(value, tuple) or len(value) != 4 or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError("malformed compressed field")
    return CompressedInfo(*value)


def occurrences_ms(stage: StageLike) -> float:
    """All its occurrences' time: a composite's summed time, any other stage's wall time (a rule summing
    a kind of time reads this; one that judges a single stage reads ``wall_ms``, a composite's longest)."""
    folded = stage.compressed
    return folded.sum_ns / 1e6 if folded is not None else stage.wall_ms


def batch_info(value: Any) -> BatchInfo | None:
    """A shipped batch tuple as ``BatchInfo``; a clear error for one of the wrong shape."""
    if value is None or isinstance(value, BatchInfo):
        return value
    if not isinstance(value, tuple) or not 6 <= len(value) <= len(BatchInfo._fields):
        raise ValueError("malformed batch field")
    return BatchInfo(*value)


class StageLike(Protocol):
    """What the analysis reads of a stage: ``StageSample`` (the report), the exporter's ``ShippedStage``,
    anything with these fields (perf-counter or epoch ns, consistent within one trace)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def start_ns(self) -> int: ...
    @property
    def end_ns(self) -> int: ...
    @property
    def span_id(self) -> int: ...
    @property
    def parent_stage_id(self) -> int: ...
    @property
    def gpu_ms(self) -> float | None: ...
    @property
    def cpu_ms(self) -> float | None: ...
    @property
    def blocked_ms(self) -> float | None: ...
    @property
    def runqueue_ms(self) -> float | None: ...
    @property
    def not_gil_ms(self) -> float | None: ...
    @property
    def others_runqueue_ms(self) -> float | None: ...
    @property
    def others_cpu_ms(self) -> float | None: ...
    @property
    def on_event_loop(self) -> bool: ...
    @property
    def h2d_bytes(self) -> int | None: ...
    @property
    def h2d_pinned(self) -> bool | None: ...
    @property
    def gpu_utilization(self) -> float | None: ...
    @property
    def queue_saturated(self) -> bool | None: ...
    @property
    def batch(self) -> BatchInfo | None: ...
    @property
    def wall_ms(self) -> float: ...
    @property
    def compressed(self) -> CompressedInfo | None: ...
    @property
    def worker_pid(self) -> int | None: ...
    @property
    def offload(self) -> Any: ...  # analysis.offload.OffloadInfo on a call handed to a process pool


@dataclass(slots=True, eq=False)
class StageSample:
    """One finished occurrence of a stage.

    The analysis reads these fields by name, so the exporter passes its ``ShippedStage``s directly
    (same names, perf-counter time base) and the report builds these from exported spans (epoch
    time base); only consistency within one trace matters.

    ``parent_stage_id`` is the span id of the nearest enclosing *stage* (not any span), so that exclusive
    time is right even when another instrumentation's span sits between two stages. Not frozen: one is
    built per stage, and a frozen dataclass's __init__ costs several times more.
    """

    name: str
    kind: str
    start_ns: int
    end_ns: int
    span_id: int = 0
    parent_stage_id: int = 0
    gpu_ms: float | None = None
    cpu_ms: float | None = None
    blocked_ms: float | None = None
    runqueue_ms: float | None = None
    not_gil_ms: float | None = None  # of blocked_ms, at least this much was not a wait for the GIL
    others_runqueue_ms: float | None = None  # the process's other threads' run-queue wait meanwhile
    others_cpu_ms: float | None = None  # and their on-CPU time
    on_event_loop: bool = False
    h2d_bytes: int | None = None
    h2d_pinned: bool | None = None
    gpu_utilization: float | None = None
    queue_saturated: bool | None = None  # for wait stages: was the pool full when the request queued?
    batch: BatchInfo | None = None  # for stages of a dynamic batch
    compressed: CompressedInfo | None = None  # a composite of repeated occurrences
    example: bool = False  # a composite's slowest occurrence, exported beside it (never analysed)
    worker_pid: int | None = None  # it ran in this pool worker process (an offload's run and its stages)
    offload: Any = None  # analysis.offload.OffloadInfo, on a call handed to a process pool

    @property
    def wall_ms(self) -> float:
        """Its time on the wall; a composite's longest occurrence (what a rule about one stage reads)."""
        if self.compressed is not None:
            return self.compressed.max_ns / 1e6
        return max(0, self.end_ns - self.start_ns) / 1e6
