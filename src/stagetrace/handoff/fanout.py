"""A dynamic batch's stages as they appear in each member's trace, built on the helper thread when the
member's trace is shipped.

A member's trace gets, for each batch that served it: its wait stage (ended when the batch started), one
stage named after the batch covering the batch's run (linked to the batch span), and under it a view of
each of the batch's stages. A view shares its source record (so CUDA events are read once, for every
member) and has its own span id: the source's id mixed with the member's, so that the nesting inside the
batch maps over without a lookup table. A member is charged the wall time it experienced; its amortised
share is an attribute (``exporter.spans``).
"""

from __future__ import annotations

from typing import Any

from stagetrace.analysis.model import BatchInfo
from stagetrace.capture.records import Repeat, StageRecord, TraceRecord
from stagetrace.common.wire import STAGE_FIELDS, pack_stage
from stagetrace.conventions import BATCH_ABANDONED

_ID_MASK = (1 << 64) - 1


_MEMBER_FIELDS = tuple(STAGE_FIELDS.index(f) for f in ("span_id", "parent_span_id", "parent_stage_id", "batch"))


class MemberView:
    """One batch stage in one member's trace: the source's fields, with this member's ids and batch info."""

    __slots__ = ("batch", "packed_sources", "parent_span_id", "parent_stage_id", "source", "source_offset", "span_id")

    def __init__(
        self,
        source: StageRecord,
        source_offset: int,
        span_id: int,
        parent_span_id: int,
        parent_stage_id: int,
        batch: tuple[Any, ...],
        packed_sources: dict[int, list[Any]],
    ) -> None:
        self.packed_sources = packed_sources  # the batch's cache of packed source stages
        self.source = source
        self.source_offset = source_offset  # the batch trace's clock offset, for resolving GPU events
        self.span_id = span_id
        self.parent_span_id = parent_span_id
        self.parent_stage_id = parent_stage_id
        self.batch = batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def pack(self) -> tuple[Any, ...]:
        """The wire tuple: the source's, packed once per batch (after its CUDA events were read), with this
        member's four fields put in."""
        source, packed = self.source, self.packed_sources
        fields = packed.get(source.span_id)
        if fields is None:
            fields = packed[source.span_id] = list(pack_stage(source))
        out = fields.copy()
        i_span, i_parent, i_stage, i_batch = _MEMBER_FIELDS
        out[i_span], out[i_parent], out[i_stage], out[i_batch] = (
            self.span_id,
            self.parent_span_id,
            self.parent_stage_id,
            self.batch,
        )
        return tuple(out)


def pack_member_stage(stage: Any) -> tuple[Any, ...]:
    """A member trace's stage as its wire tuple; a view reuses its source's packing."""
    if type(stage) is MemberView:
        return stage.pack()
    return pack_stage(stage)


class MemberBatchStage:
    """The stage named after the batch in a member's trace: the batch's run as this request lived it."""

    __slots__ = (
        "attributes",
        "batch",
        "end_ns",
        "error",
        "kind",
        "name",
        "parent_span_id",
        "parent_stage_id",
        "span_id",
        "start_ns",
    )
    # fields a batch stage never measures itself (its inner stages do)
    cpu_start = cpu_end = gpu = gpu_ms = gpu_utilization = h2d_bytes = h2d_pinned = queue_saturated = None
    compressed = worker_pid = offload = None
    on_event_loop = example = False

    def __init__(self, name: str, kind: str, span_id: int, parent: StageRecord, start_ns: int, end_ns: int) -> None:
        self.name = name
        self.kind = kind
        self.span_id = span_id
        self.parent_span_id = parent.parent_span_id
        self.parent_stage_id = parent.parent_stage_id
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.error: tuple[str, str, str] | None = None
        self.attributes: dict[str, Any] | None = None
        self.batch: tuple[Any, ...] | None = None


def _mix(span_id: int, member_span_id: int) -> int:
    return (span_id ^ member_span_id) & _ID_MASK or 1


def batch_source_stages(batch: Any) -> list[StageRecord]:
    """The batch's finished stages (those still running are not part of a member shipped now)."""
    trace = batch.trace
    if trace is None:
        return []
    with trace.lock:
        stages = list(trace.stages)
    return [s for s in stages if s.end_ns and (type(s) is not Repeat or s.folded)]


def gpu_sources(trace: TraceRecord) -> list[StageRecord]:
    """Stages of the batches that served this trace, for the CUDA-event readiness check."""
    out: list[StageRecord] = []
    seen: set[int] = set()
    for ticket in trace.memberships or ():
        batch = ticket.batch
        if batch is not None and id(batch) not in seen:
            seen.add(id(batch))
            out.extend(s for s in batch_source_stages(batch) if s.gpu is not None)
    return out


def member_stages(tickets: list[Any], root_end_perf_ns: int, on_abandoned: Any) -> list[Any]:
    """The stages a member trace gets from its tickets. ``tickets`` were copied when the trace closed, so no
    batch changes them any more; a ticket no batch took ends its wait with the request, marked abandoned."""
    out: list[Any] = []
    seen: set[int] = set()
    for ticket in tickets:
        wait = ticket.wait
        batch = ticket.batch
        if batch is None or ticket.member is None:
            wait.end_ns = max(wait.start_ns, root_end_perf_ns)
            wait.set_attribute(BATCH_ABANDONED, True)
            on_abandoned()
            out.append(wait)
            continue
        out.append(wait)
        if id(batch) in seen:  # another ticket of this request in the same batch: one membership
            continue
        seen.add(id(batch))
        out.extend(_batch_views(batch, ticket.member, wait, root_end_perf_ns))
    return out


def _batch_views(batch: Any, member: tuple[int, int, int], wait: StageRecord, root_end_perf_ns: int) -> list[Any]:
    index, member_items, member_span_id = member
    common = (batch.id, batch.size, batch.items, index, member_items, batch.max_size or 0)
    ended = bool(batch.end_ns)
    head = MemberBatchStage(
        batch.name,
        batch.kind,
        member_span_id,
        wait,
        batch.start_ns,
        batch.end_ns if ended else max(batch.start_ns, root_end_perf_ns),
    )
    head.batch = tuple(BatchInfo(*common, link_trace_id=batch.trace_id, link_span_id=batch.span_id))
    if ended:
        head.error = batch.error
    out: list[Any] = [head]
    sources = batch_source_stages(batch)
    if not sources:
        return out
    inner = tuple(BatchInfo(*common))
    root_span_id = batch.span_id
    source_ids = {s.span_id for s in sources}
    offset = batch.trace.perf_to_epoch_ns
    packed = batch.packed_sources
    for s in sources:
        stage_parent = _mix(s.parent_stage_id, member_span_id) if s.parent_stage_id else member_span_id
        if s.parent_span_id == root_span_id:
            parent = member_span_id
        elif s.parent_span_id in source_ids:
            parent = _mix(s.parent_span_id, member_span_id)
        else:  # under another instrumentation's span inside the batch: hang it on its nearest stage
            parent = stage_parent
        out.append(MemberView(s, offset, _mix(s.span_id, member_span_id), parent, stage_parent, inner, packed))
    return out
