"""Per-trace breakdown, bottleneck and slow flag (the README's "Analysis semantics")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

from stagetrace.analysis.model import StageLike
from stagetrace.conventions import GPU_KINDS, UNTRACKED


class TraceAnalysis(NamedTuple):
    """A trace's breakdown (a named tuple, not a frozen dataclass: one is made for every trace, and a tuple
    is made in a third of the time)."""

    total_ms: float
    breakdown: dict[str, float]
    bottleneck: str | None
    ratio: float
    slow: bool
    slow_threshold_ms: float
    untracked_ms: float
    stage_kinds: Mapping[str, str] = MappingProxyType({})
    # per input sample, the time charged to it (exclusive wall, or GPU time); None for post-response stages
    charged_ms: tuple[float | None, ...] = ()


def union_length_ns(intervals: Iterable[tuple[int, int]]) -> int:
    """Length covered by the union of half-open intervals; empty or reversed intervals count as zero."""
    ordered = [iv for iv in intervals if iv[1] > iv[0]]  # (a list: a generator costs more, compiled)
    n = len(ordered)
    if not n:
        return 0
    # Sorted only where they are not in order of start already (a trace's stages nearly always are): a sort
    # compares tuples, an equality test and an ordering a pair.
    for i in range(1, n):
        if ordered[i][0] < ordered[i - 1][0]:
            ordered.sort()
            break
    total = 0
    cur_start, cur_end = ordered[0]
    for i in range(1, n):
        start, end = ordered[i]
        if start > cur_end:
            total += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    return total + cur_end - cur_start


def analyse_trace(
    root_start_ns: int,
    root_end_ns: int,
    stages: Sequence[StageLike],
    slow_threshold_ms: float,
    *,
    untracked_headline: bool = True,
) -> TraceAnalysis:
    """Break a local root's time down by stage.

    - A stage is charged its exclusive wall time: its interval minus the union of its direct child stages'
      intervals (clipped to it). A GPU stage with a CUDA-event duration is charged that GPU time instead,
      so a D2H that waited on the host for inference kernels is not blamed for the wait.
    - A composite (``compressed``: the occurrences of a repeated stage folded into one) is charged its
      occurrences' summed time less its children's; a stage with composite children loses their summed
      time too. Occurrences are sequential within their parent, so their sum is their union.
    - Stages that start after the root ended (background work after the response) are not part of the
      request's latency and are left out of the breakdown.
    - Occurrences of one name add up; the breakdown is in pipeline order (first start).
    - Untracked time is the root's duration minus the union of all stage intervals within it (a composite
      counts its summed time, its descendants nothing more).
    - The bottleneck is the stage with the most time, or ``untracked`` when time in no stage exceeds it (a
      headline must not name a stage that explains a sliver of the request). No stages: no bottleneck.
      ``untracked_headline=False`` keeps it among the stages (the classic profiler's report, whose callers
      index the breakdown with it).
    """
    root_end_ns = max(root_end_ns, root_start_ns)
    total_ns = root_end_ns - root_start_ns
    total_ms = total_ns / 1e6

    # Each stage's interval clipped to the root; None for stages after the root ended.
    clipped: list[tuple[int, int] | None] = []
    children: dict[int, list[tuple[int, int]]] = {}
    folded_children: dict[int, int] = {}  # parent stage span id -> its composite children's summed ns
    composites = False
    for st in stages:
        start, end = st.start_ns, st.end_ns
        if total_ns:
            if start >= root_end_ns:
                clipped.append(None)
                continue
            if start < root_start_ns:
                start = root_start_ns
            if end > root_end_ns:
                end = root_end_ns
        iv = (start, end)
        clipped.append(iv)
        folded = st.compressed
        if folded is not None:
            composites = True
            if st.parent_stage_id:
                folded_children[st.parent_stage_id] = folded_children.get(st.parent_stage_id, 0) + folded.sum_ns
        elif st.parent_stage_id:
            siblings = children.get(st.parent_stage_id)
            if siblings is None:
                children[st.parent_stage_id] = [iv]
            else:
                siblings.append(iv)

    breakdown: dict[str, float] = {}
    kinds: dict[str, str] = {}
    charged: list[float | None] = []
    # Stages nearly always come in order of start: then the order names first appear in is pipeline order,
    # and no name's first start need be kept (checked as they come; the rare other case is sorted below).
    in_order, previous_start = True, None
    for st, maybe_iv in zip(stages, clipped):
        if maybe_iv is None:
            charged.append(None)
            continue
        gpu_ms = st.gpu_ms
        if gpu_ms is not None and st.kind in GPU_KINDS:
            ms = gpu_ms if gpu_ms > 0 else 0.0
        else:
            folded = st.compressed
            if folded is None:
                start, end = maybe_iv
                own = end - start
                kids = children.get(st.span_id) if children and st.span_id else None
                if kids and own > 0:
                    own -= union_length_ns([(max(a, start), min(b, end)) for a, b in kids])
            else:  # its real children lie inside its occurrences, which the interval does not bound
                own = folded.sum_ns - sum([b - a for a, b in children.get(st.span_id, ())])
            if composites:
                own -= folded_children.get(st.span_id, 0)
            ms = own / 1e6 if own > 0 else 0.0
        charged.append(ms)
        name = st.name
        if previous_start is not None and st.start_ns < previous_start:
            in_order = False
        previous_start = st.start_ns
        if name in breakdown:
            breakdown[name] += ms
        else:
            breakdown[name] = ms
            kinds[name] = st.kind
    if not in_order:
        breakdown = _in_pipeline_order(breakdown, stages, clipped)
    if composites:
        covered = _covered_with_composites(stages, clipped)
    else:
        covered = union_length_ns([iv for iv in clipped if iv is not None])
    untracked_ms = max(0, total_ns - covered) / 1e6
    # the first stage with the most time (as max() with a key gives it, without a call a stage)
    bottleneck, bottleneck_ms = None, 0.0
    for name, ms in breakdown.items():
        if bottleneck is None or ms > bottleneck_ms:
            bottleneck, bottleneck_ms = name, ms
    if untracked_headline and bottleneck is not None and untracked_ms > bottleneck_ms:
        bottleneck, bottleneck_ms = UNTRACKED, untracked_ms
    ratio = 0.0
    if bottleneck is not None and total_ms > 0:
        ratio = min(1.0, max(0.0, bottleneck_ms / total_ms))
    # (positional, in the fields' order: keyword construction runs the named tuple's Python __new__)
    return _new_analysis(
        TraceAnalysis,
        (total_ms, breakdown, bottleneck, ratio, total_ms > slow_threshold_ms, slow_threshold_ms, untracked_ms,
         kinds, tuple(charged)),
    )  # fmt: skip


_new_analysis = tuple.__new__


def _in_pipeline_order(
    breakdown: dict[str, float], stages: Sequence[StageLike], clipped: Sequence[tuple[int, int] | None]
) -> dict[str, float]:
    """The breakdown ordered by each name's first start (ties as they came), for stages not in order of start."""
    first_start: dict[str, int] = {}
    for st, iv in zip(stages, clipped):
        if iv is not None and (st.name not in first_start or st.start_ns < first_start[st.name]):
            first_start[st.name] = st.start_ns
    starts = list(first_start.values())
    if starts == sorted(starts):
        return breakdown
    order = sorted([(first_start[name], i, name) for i, name in enumerate(breakdown)])
    return {name: breakdown[name] for _, _, name in order}


def _covered_with_composites(stages: Sequence[StageLike], clipped: Sequence[tuple[int, int] | None]) -> int:
    """The root time some stage covers, where composites stand for their occurrences: the union of the
    real stages outside any composite, plus each outermost composite's summed time (its occurrences are
    sequential, and the real stages beside them ran at other times). It may exceed the root's duration: the
    caller clamps the untracked time at 0."""
    by_id = {st.span_id: st for st in stages if st.span_id}

    def under_composite(st: StageLike) -> bool:
        parent, hops = st.parent_stage_id, 0
        while parent and hops < 64:  # a malformed trace may hold a cycle
            above = by_id.get(parent)
            if above is None:
                return False
            if above.compressed is not None:
                return True
            parent, hops = above.parent_stage_id, hops + 1
        return False

    real: list[tuple[int, int]] = []
    folded = 0
    for st, iv in zip(stages, clipped):
        if iv is None or under_composite(st):
            continue
        if st.compressed is not None:
            folded += st.compressed.sum_ns
        else:
            real.append(iv)
    return union_length_ns(real) + folded
