"""A streamed response read as what its client lived: the time to its first chunk, the gaps between chunks,
the wait on a slow consumer, and which stage dominated each phase (before the first chunk, between chunks).

Pure: the stream's fields as captured (``capture/streams.py``) and the trace's stages with their charged
time in, a summary out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from stagetrace.analysis.model import StageLike
from stagetrace.conventions import MS_BUCKETS, SLOW_FIRST_CHUNK, SLOW_GAP, UNTRACKED


class StreamFields(NamedTuple):
    """A stream as it crosses the channel (perf-counter ns, like the stages), in this order."""

    chunks: int  # body chunks handed to the server
    first_ns: int  # when the first was
    last_ns: int  # when the last was
    gap_counts: tuple[int, ...]  # gaps between consecutive chunks, counted on conventions.MS_BUCKETS
    gap_sum_ns: int
    gap_min_ns: int
    gap_max_ns: int
    gap_sample: tuple[int, ...]  # every gap up to a bound, a uniform sample beyond
    send_wait_ns: int  # awaiting send(): the server (a slow consumer) held the application back
    disconnected: bool  # the client went away mid-stream


def stream_fields(value: Any) -> StreamFields | None:
    """A shipped stream tuple as ``StreamFields``; a clear error for one of the wrong shape."""
    if value is None or isinstance(value, StreamFields):
        return value
    if not isinstance(value, tuple) or len(value) != len(StreamFields._fields):
        raise ValueError("malformed stream record")
    fields = StreamFields(*value)
    ints = (fields.chunks, fields.first_ns, fields.last_ns, fields.gap_sum_ns, fields.gap_min_ns, fields.gap_max_ns)
    if not all(type(v) is int for v in ints) or fields.chunks < 1:
        raise ValueError("malformed stream record")
    if not isinstance(fields.gap_counts, tuple) or not isinstance(fields.gap_sample, tuple):
        raise ValueError("malformed stream record")
    if len(fields.gap_counts) != len(MS_BUCKETS) + 1 or (fields.chunks > 1) != bool(fields.gap_sample):
        raise ValueError("malformed stream record: its gaps do not match its chunks")
    return fields


class GapHistogram(NamedTuple):
    """A stream's gaps between chunks, every one of them, on the contract's millisecond buckets: what the
    ``stagetrace.stream.chunk_gap`` histogram takes in one go."""

    counts: tuple[int, ...]
    sum_ms: float
    min_ms: float
    max_ms: float


class StreamSummary(NamedTuple):
    """What the verdict says of a stream (milliseconds)."""

    chunks: int
    first_chunk_ms: float  # the root's start to the first chunk
    streaming_ms: float  # the first chunk to the last
    gap_p50_ms: float | None  # None with a single chunk
    gap_p99_ms: float | None
    gap_max_ms: float | None
    send_wait_ms: float
    disconnected: bool
    first_chunk_bottleneck: str | None  # the stage with the most time before the first chunk
    gap_bottleneck: str | None  # ... and between the first chunk and the last
    first_chunk_breakdown: dict[str, float]  # stage name -> ms before the first chunk
    gap_breakdown: dict[str, float]  # stage name -> ms between the first chunk and the last
    gaps: GapHistogram | None  # None with a single chunk


def quantile(ordered: Sequence[int], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated between the two nearest (as numpy's default)."""
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def split_phases(
    first_ns: int, last_ns: int, stages: Sequence[StageLike], charged_ms: Sequence[float | None]
) -> tuple[dict[str, float], dict[str, float]]:
    """Each stage's charged time split between the time to the first chunk and the time from the first chunk
    to the last, in proportion to how much of its interval lies in each: (before, between), name -> ms."""
    before: dict[str, float] = {}
    between: dict[str, float] = {}
    for st, ms in zip(stages, charged_ms):
        if not ms:
            continue
        start, end = st.start_ns, max(st.end_ns, st.start_ns)
        span = end - start
        share_before = 1.0 if end <= first_ns else 0.0 if start >= first_ns else (first_ns - start) / span
        if share_before > 0:
            before[st.name] = before.get(st.name, 0.0) + ms * share_before
        # Its share of the stream's span (none for a stage wholly before the first chunk or from the last on);
        # an instant (a GPU stage's host side) between the two chunks is wholly there.
        inside = (min(end, last_ns) - max(start, first_ns)) / span if span else float(first_ns < start < last_ns)
        if inside > 0:
            between[st.name] = between.get(st.name, 0.0) + ms * min(1.0, inside)
    return before, between


def largest(breakdown: Mapping[str, float]) -> str | None:
    """The stage with the most time in a phase's breakdown (None for an empty one)."""
    return max(breakdown, key=breakdown.__getitem__) if breakdown else None


def summarise_stream(
    root_start_ns: int, stream: StreamFields, stages: Sequence[StageLike], charged_ms: Sequence[float | None]
) -> StreamSummary:
    """``stages`` with ``charged_ms`` as the analysis charged them (``TraceAnalysis.charged_ms``); a stage's
    charge is split between the phases in proportion to how much of its interval lies in each."""
    first, last = stream.first_ns, stream.last_ns
    before, between = split_phases(first, last, stages, charged_ms)
    sample = sorted(stream.gap_sample)
    gaps = stream.chunks > 1  # then the sample holds at least one gap (stream_fields checks it)
    return StreamSummary(
        chunks=stream.chunks,
        first_chunk_ms=max(0, first - root_start_ns) / 1e6,
        streaming_ms=max(0, last - first) / 1e6,
        gap_p50_ms=quantile(sample, 0.5) / 1e6 if gaps else None,
        gap_p99_ms=quantile(sample, 0.99) / 1e6 if gaps else None,
        gap_max_ms=stream.gap_max_ns / 1e6 if gaps else None,
        send_wait_ms=stream.send_wait_ns / 1e6,
        disconnected=stream.disconnected,
        first_chunk_bottleneck=largest(before),
        gap_bottleneck=largest(between),
        first_chunk_breakdown=before,
        gap_breakdown=between,
        gaps=GapHistogram(stream.gap_counts, stream.gap_sum_ns / 1e6, stream.gap_min_ns / 1e6, stream.gap_max_ns / 1e6)
        if gaps
        else None,
    )


class StreamThresholds(NamedTuple):
    """When a streamed response is slow: its time to the first chunk over ``first_chunk_ms``, or the p99 of
    its gaps between chunks over ``gap_ms`` (the route's, else the global: ``Settings.stream_thresholds_for``)."""

    first_chunk_ms: float
    gap_ms: float


class PhaseJudgement(NamedTuple):
    """A stream judged by its phases: why it is slow (None: it is not), and the stage its slow phase spent
    most on with that stage's share of the phase (the verdict's headline)."""

    reason: str | None
    bottleneck: str | None
    ratio: float


def judge_phases(stream: StreamSummary, thresholds: StreamThresholds) -> PhaseJudgement:
    """A stream is slow by its time to the first chunk (first) or its gaps' p99, never by its length: a
    1,000-token answer at a healthy 20 ms a token lasts 20 s. A slow first chunk is headed by the first
    chunk's bottleneck, slow gaps by the gaps' bottleneck, each read as the trace's is: ``untracked`` when the
    phase's time in no stage exceeds every stage's (a first chunk that waited in no stage is not headed by a
    stage that ran between chunks); a healthy stream has no headline of its own."""
    if stream.first_chunk_ms > thresholds.first_chunk_ms:
        return _headline(SLOW_FIRST_CHUNK, stream.first_chunk_breakdown, stream.first_chunk_ms)
    if stream.gap_p99_ms is not None and stream.gap_p99_ms > thresholds.gap_ms:
        return _headline(SLOW_GAP, stream.gap_breakdown, stream.streaming_ms)
    return PhaseJudgement(None, None, 0.0)


def _headline(reason: str, breakdown: Mapping[str, float], phase_ms: float) -> PhaseJudgement:
    name = largest(breakdown)
    name_ms = breakdown[name] if name is not None else 0.0
    untracked_ms = phase_ms - sum(breakdown.values())
    if untracked_ms > name_ms:
        name, name_ms = UNTRACKED, untracked_ms
    ratio = min(1.0, name_ms / phase_ms) if name is not None and phase_ms > 0 else 0.0
    return PhaseJudgement(reason, name, ratio)


class GenAiLatencies(NamedTuple):
    """A generative request's latencies as vLLM and SGLang write them on their request spans (seconds):
    the waits before its first chunk (``wait`` stages), the model's steps before it (prefill) and after it
    (decode), by stage kind."""

    time_to_first_token: float
    e2e: float
    time_in_queue: float
    time_in_model_prefill: float
    time_in_model_decode: float


def gen_ai_latencies(
    stream: StreamSummary, stage_kinds: Mapping[str, str], total_ms: float, model_kinds: frozenset[str]
) -> GenAiLatencies:
    def seconds(breakdown: Mapping[str, float], kinds: frozenset[str]) -> float:
        return sum(ms for name, ms in breakdown.items() if stage_kinds.get(name) in kinds) / 1e3

    return GenAiLatencies(
        time_to_first_token=stream.first_chunk_ms / 1e3,
        e2e=total_ms / 1e3,
        time_in_queue=seconds(stream.first_chunk_breakdown, frozenset({"wait"})),
        time_in_model_prefill=seconds(stream.first_chunk_breakdown, model_kinds),
        time_in_model_decode=seconds(stream.gap_breakdown, model_kinds),
    )
