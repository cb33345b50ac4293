"""The stage record the exporter analyses: a stage's fields in their order on the wire, by name, and what the
exporter derives from them.

The exporter builds one for every stage of every trace and its analysis reads each many times, so where
Cython compiles the exporter (``stagetrace._compiled``) this class is a C type (``stage_record.pxd``): the
analysis modules that declare their stages as one read a field as a C struct member, where a read through
the interpreter's generic attribute lookup costs about eighty instructions. There every stage the analysis
judges is one of these (the exporter makes no other kind); from the sources the analysis reads any
``StageLike`` (``StageSample`` in the report and the classic profiler).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stagetrace.analysis.model import BatchInfo, CompressedInfo, batch_info, compressed_info
from stagetrace.analysis.offload import offload_fields

# A stage crosses the channel as the tuple of these fields, in this order (``common.wire``).
STAGE_FIELDS = (
    "name",
    "kind",
    "span_id",
    "parent_span_id",
    "parent_stage_id",
    "start_ns",
    "end_ns",
    "cpu_start",
    "cpu_end",
    "on_event_loop",
    "error",
    "attributes",
    "gpu_ms",
    "gpu_utilization",
    "h2d_bytes",
    "h2d_pinned",
    "queue_saturated",
    "batch",
    "compressed",  # a composite of repeated occurrences: (count, summed ns, least ns, most ns); else None
    "example",  # the slowest occurrence of a composite: exported, but its time is the composite's
    "worker_pid",  # the stage ran in this pool worker process (offload.run's stages); None: in the application
    "offload",  # a call handed to a process pool: analysis.offload.OffloadFields as a plain tuple; else None
)
# What the exporter derives from a stage's raw CPU readings (``exporter.signals.resolve_cpu``).
DERIVED_STAGE_FIELDS = ("cpu_ms", "runqueue_ms", "blocked_ms", "not_gil_ms", "others_runqueue_ms", "others_cpu_ms")


class ShippedStage:
    """A stage as the exporter sees it: the wire fields by name, plus what the exporter derives from them
    (CPU figures from the raw clock readings). The analysis reads stages by these field names."""

    __slots__ = (*STAGE_FIELDS, *DERIVED_STAGE_FIELDS, "wall_ms")
    # the STAGE_FIELDS, typed (tests/test_tables.py checks that the two lists agree)
    name: str
    kind: str
    span_id: int
    parent_span_id: int
    parent_stage_id: int
    start_ns: int
    end_ns: int
    cpu_start: Any
    cpu_end: Any
    on_event_loop: bool
    error: tuple[str, str, str] | None
    attributes: dict[str, Any] | None
    gpu_ms: float | None
    gpu_utilization: float | None
    h2d_bytes: int | None
    h2d_pinned: bool | None
    queue_saturated: bool | None
    batch: BatchInfo | None
    compressed: CompressedInfo | None
    example: bool
    worker_pid: int | None
    offload: Any  # OffloadFields as shipped; OffloadInfo once the exporter placed its children (exporter/offload.py)
    # the DERIVED_STAGE_FIELDS, None until the exporter resolves them (exporter/signals.py)
    cpu_ms: float | None
    runqueue_ms: float | None
    blocked_ms: float | None
    not_gil_ms: float | None
    others_runqueue_ms: float | None
    others_cpu_ms: float | None
    # Its time on the wall, a composite's longest occurrence (what a rule about one stage reads): set once, where
    # a property ran its arithmetic at every read (about twenty a trace); ``fold`` keeps it true for a composite.
    wall_ms: float

    def __init__(self, fields: Sequence[Any]) -> None:
        if type(fields) is not tuple and type(fields) is not list:  # (a dict would unpack its keys, read its values)
            raise ValueError(f"a stage record is a tuple, not a {type(fields).__name__}")
        if len(fields) != len(STAGE_FIELDS):
            raise ValueError(f"a stage record has {len(STAGE_FIELDS)} fields, got {len(fields)}")
        # The fields written out in the order of STAGE_FIELDS (tests/test_tables.py holds the two together):
        # compiled, each is a store into the C type's member; from the sources, the interpreter's store to a
        # slot. (Generated from the table with exec, as before, the compiled type's stores ran in the
        # interpreter through its generic attribute path.)
        (
            self.name,
            self.kind,
            self.span_id,
            self.parent_span_id,
            self.parent_stage_id,
            self.start_ns,
            self.end_ns,
            self.cpu_start,
            self.cpu_end,
            self.on_event_loop,
            self.error,
            self.attributes,
            self.gpu_ms,
            self.gpu_utilization,
            self.h2d_bytes,
            self.h2d_pinned,
            self.queue_saturated,
            self.batch,
            self.compressed,
            self.example,
            self.worker_pid,
            self.offload,
        ) = fields
        self.cpu_ms = self.runqueue_ms = self.blocked_ms = self.not_gil_ms = None
        self.others_runqueue_ms = self.others_cpu_ms = None
        # (checked on the fields just set: compiled, each is a C member read, where an item of the record is a
        # module global's index and a generic subscript)
        if not isinstance(self.name, str) or type(self.start_ns) is not int or type(self.end_ns) is not int:
            raise ValueError("a stage record needs a str name and int times")
        if self.batch is not None:
            self.batch = batch_info(self.batch)
        # its wall time: a composite's longest occurrence, any other stage's times (none where they run backwards)
        if self.compressed is not None:
            folded = compressed_info(self.compressed)
            self.compressed = folded
            wall_ns = folded.max_ns if folded is not None else 0
        else:
            wall_ns = self.end_ns - self.start_ns
        try:
            self.wall_ms = wall_ns / 1e6 if wall_ns > 0 else 0.0
        except OverflowError:
            raise ValueError("a stage record's times are further apart than a float holds") from None
        if self.offload is not None:
            self.offload = offload_fields(self.offload)
        if self.worker_pid is not None and type(self.worker_pid) is not int:
            raise ValueError("a stage record's worker pid must be an int")
        if self.error is not None and not _is_error(self.error):
            raise ValueError("a stage record's error must be (type, message, traceback) strings")

    @classmethod
    def added(cls, name: str, kind: str, span_id: int, parent_span_id: int, start_ns: int, end_ns: int) -> ShippedStage:
        """A stage the exporter adds itself (an event-loop wait, another instrumentation's span read as a
        stage): the fields it knows, the rest as a stage that measured nothing else."""
        values: list[Any] = list(_ADDED_STAGE)
        values[_NAME], values[_KIND], values[_SPAN_ID], values[_PARENT_SPAN_ID] = name, kind, span_id, parent_span_id
        values[_START], values[_END] = start_ns, end_ns
        return cls(values)

    def fold(self, compressed: CompressedInfo) -> None:
        """Make it the composite of ``compressed``'s occurrences (its wall time then the longest one's)."""
        self.compressed = compressed
        self.wall_ms = compressed.max_ns / 1e6

    def __repr__(self) -> str:
        return f"ShippedStage({self.name!r}, kind={self.kind!r})"


def _is_error(value: Any) -> bool:
    return type(value) is tuple and len(value) == 3 and all(type(part) is str for part in value)


_NAME, _KIND, _SPAN_ID, _PARENT_SPAN_ID, _START, _END = (
    STAGE_FIELDS.index(f) for f in ("name", "kind", "span_id", "parent_span_id", "start_ns", "end_ns")
)
# A stage with nothing measured: no parent stage, not on the event loop, every optional field unset.
_ADDED_STAGE = tuple(
    0 if f == "parent_stage_id" else False if f in ("on_event_loop", "example") else None for f in STAGE_FIELDS
)
