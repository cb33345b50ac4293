"""Per-trace breakdown, bottleneck and slow flag (DESIGN.md, "Analysis semantics")."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from stagetrace.analysis.model import StageSample
from stagetrace.conventions import GPU_KINDS


@dataclass(frozen=True, slots=True)
class TraceAnalysis:
    total_ms: float
    breakdown: dict[str, float]
    bottleneck: str | None
    ratio: float
    slow: bool
    slow_threshold_ms: float
    untracked_ms: float
    stage_kinds: dict[str, str] = field(default_factory=dict)
    # per input sample, the time charged to it (exclusive wall, or GPU time); None for post-response stages
    charged_ms: tuple[float | None, ...] = ()


def union_length_ns(intervals: Iterable[tuple[int, int]]) -> int:
    """Length covered by the union of half-open intervals; empty or reversed intervals count as zero."""
    ordered = sorted((s, e) for s, e in intervals if e > s)
    total = 0
    cur_start = cur_end = None
    for s, e in ordered:
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        elif e > cur_end:
            cur_end = e
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _clip(start: int, end: int, lo: int, hi: int) -> tuple[int, int]:
    return max(start, lo), min(end, hi)


def analyse_trace(
    root_start_ns: int,
    root_end_ns: int,
    stages: Sequence[StageSample],
    slow_threshold_ms: float,
) -> TraceAnalysis:
    """Break a local root's time down by stage.

    - A stage is charged its exclusive wall time: its interval minus the union of its direct child stages'
      intervals (clipped to it). A GPU stage with a CUDA-event duration is charged that GPU time instead,
      so a D2H that waited on the host for inference kernels is not blamed for the wait.
    - Stages that start after the root ended (background work after the response) are not part of the
      request's latency and are left out of the breakdown.
    - Occurrences of one name add up; the breakdown is in pipeline order (first start).
    - Untracked time is the root's duration minus the union of all stage intervals within it.
    """
    root_end_ns = max(root_end_ns, root_start_ns)
    total_ns = root_end_ns - root_start_ns
    total_ms = total_ns / 1e6

    in_request = [s.start_ns < root_end_ns or total_ns == 0 for s in stages]
    children: dict[int, list[tuple[int, int]]] = {}
    for s, inside in zip(stages, in_request):
        if inside and s.parent_stage_id:
            children.setdefault(s.parent_stage_id, []).append((s.start_ns, s.end_ns))

    breakdown: dict[str, float] = {}
    first_start: dict[str, int] = {}
    kinds: dict[str, str] = {}
    charged: list[float | None] = []
    for s, inside in zip(stages, in_request):
        if not inside:
            charged.append(None)
            continue
        if s.kind in GPU_KINDS and s.gpu_ms is not None:
            ms = max(0.0, s.gpu_ms)
        else:
            start, end = (
                _clip(s.start_ns, s.end_ns, root_start_ns, root_end_ns)
                if total_ns
                else (
                    s.start_ns,
                    s.end_ns,
                )
            )
            own = max(0, end - start)
            kids = children.get(s.stage_id) if s.stage_id else None
            if kids and own:
                own -= union_length_ns(_clip(a, b, start, end) for a, b in kids)
            ms = max(0, own) / 1e6
        charged.append(ms)
        breakdown[s.name] = breakdown.get(s.name, 0.0) + ms
        if s.name not in first_start or s.start_ns < first_start[s.name]:
            first_start[s.name] = s.start_ns
        kinds.setdefault(s.name, s.kind)

    ordered = dict(sorted(breakdown.items(), key=lambda kv: first_start[kv[0]]))
    bottleneck = max(ordered, key=ordered.__getitem__) if ordered else None
    ratio = 0.0
    if bottleneck is not None and total_ms > 0:
        ratio = min(1.0, max(0.0, ordered[bottleneck] / total_ms))

    covered = union_length_ns(
        _clip(s.start_ns, s.end_ns, root_start_ns, root_end_ns) for s, inside in zip(stages, in_request) if inside
    )
    untracked_ms = max(0, total_ns - covered) / 1e6
    return TraceAnalysis(
        total_ms=total_ms,
        breakdown=ordered,
        bottleneck=bottleneck,
        ratio=ratio,
        slow=total_ms > slow_threshold_ms,
        slow_threshold_ms=slow_threshold_ms,
        untracked_ms=untracked_ms,
        stage_kinds=kinds,
        charged_ms=tuple(charged),
    )
