"""One exported trace (its spans) to a verdict and a waterfall.

A trace whose only verdict sits on its global root keeps that verdict (what the process computed, GPU
timing and signals included). Otherwise (no verdict at all, or several services each with a local verdict)
the verdict is computed over the whole trace from its global root, with the same analysis and rules the
exporter uses.
"""

from __future__ import annotations

from typing import Any

from stagetrace import conventions as c
from stagetrace.analysis import (
    Diagnosis,
    DiagnosisThresholds,
    StageSample,
    TraceSignals,
    Verdict,
    analyse_trace,
    build_verdict,
    diagnose,
)
from stagetrace.analysis.diagnosis import ADVICE
from stagetrace.analysis.model import CompressedInfo
from stagetrace.analysis.offload import OffloadedCall, OffloadInfo, offload_calls
from stagetrace.analysis.signals import ProcessLoad
from stagetrace.analysis.streams import StreamSummary, StreamThresholds, largest, split_phases
from stagetrace.exporter.spans import batch_from_attributes
from stagetrace.report.loader import Span
from stagetrace.settings import DEFAULT_GAP_THRESHOLD_MS, DEFAULT_SLOW_THRESHOLD_MS


def global_root(spans: list[Span]) -> Span:
    ids = {s.span_id for s in spans}
    true_roots = [s for s in spans if not s.parent_span_id]
    orphans = [s for s in spans if s.parent_span_id and s.parent_span_id not in ids]
    candidates = true_roots or orphans or spans
    return min(candidates, key=lambda s: (s.start_ns, -s.end_ns))


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _stored_verdict(root: Span, trace_id: str, spans: list[Span]) -> Verdict:
    a = root.attributes
    names = list(a.get(c.STAGES) or ())
    values = list(a.get(c.STAGES_MS) or ())
    breakdown = dict(zip(names, (float(v) for v in values)))
    messages = {
        ev.get(c.DIAGNOSIS_EVENT_CODE): ev
        for name, ev in root.events
        if name == c.DIAGNOSIS_EVENT and ev.get(c.DIAGNOSIS_EVENT_CODE)
    }
    diagnoses = tuple(
        Diagnosis(
            code=str(code),
            message=str(messages.get(code, {}).get(c.DIAGNOSIS_EVENT_MESSAGE, "")),
            advice=str(messages.get(code, {}).get(c.DIAGNOSIS_EVENT_ADVICE, ADVICE.get(str(code), ""))),
            stage=messages.get(code, {}).get(c.DIAGNOSIS_EVENT_STAGE),
            evidence=messages.get(code, {}).get(c.DIAGNOSIS_EVENT_EVIDENCE),
        )
        for code in a.get(c.DIAGNOSIS) or ()
    )
    fields = {name: _typed(a.get(key), kind) for name, key, kind, _ in c.VERDICT_FIELDS}
    fields["total_ms"] = fields["total_ms"] or (root.end_ns - root.start_ns) / 1e6
    for name in ("ratio", "slow_threshold_ms", "untracked_ms"):
        fields[name] = fields[name] or 0.0
    fields["slow"] = bool(fields["slow"])
    if fields["diagnosis_sample_rate"] is None:  # written before the exporter's CPU budget, or by another hand
        fields["diagnosis_sample_rate"] = 1.0
    return Verdict(
        trace_id=trace_id,
        root_name=root.name,
        breakdown=breakdown,
        diagnoses=diagnoses,
        route=a.get(c.HTTP_ROUTE),
        **fields,
        stage_kinds={
            str(s.attributes[c.STAGE]): str(s.attributes.get(c.STAGE_KIND, "cpu"))
            for s in spans
            if c.STAGE in s.attributes and s.trace_id == trace_id
        },
        stream=stream_from_attributes(root),
        gen_ai=_gen_ai(a),
        offloads=_offloads(spans),
    )


def _offloads(spans: list[Span]) -> tuple[OffloadedCall, ...]:
    """The calls a stored verdict's trace handed to process pools: each offload span's facts and its
    children's times, read as the rules read them (``analysis.offload.offload_calls``)."""
    if not any(c.OFFLOAD_EXECUTOR in s.attributes for s in spans):
        return ()
    samples = [
        StageSample(
            str(s.attributes.get(c.STAGE, s.name)), str(s.attributes.get(c.STAGE_KIND, "cpu")), s.start_ns,
            max(s.start_ns, s.end_ns), int(s.span_id, 16), int(s.parent_span_id, 16) if s.parent_span_id else 0,
            offload=_offload(s.attributes),
        )
        for s in spans
        if c.STAGE in s.attributes
    ]  # fmt: skip
    return tuple(offload_calls(samples))


def stream_from_attributes(root: Span) -> StreamSummary | None:
    """The stream a root's attributes describe (``conventions.STREAM_FIELDS``), without the per-stage split
    of its phases (``split_phases`` adds it where the stages are at hand); None for a response not streamed."""
    a = root.attributes
    fields = {name: _typed(a.get(key), kind) for name, key, kind, _ in c.STREAM_FIELDS}
    if not fields["chunks"]:
        return None
    for name in ("first_chunk_ms", "streaming_ms", "send_wait_ms"):
        fields[name] = fields[name] or 0.0
    return StreamSummary(
        **fields,
        disconnected=a.get(c.ERROR_TYPE) == c.CLIENT_DISCONNECTED,
        first_chunk_breakdown={},
        gap_breakdown={},
        gaps=None,
    )


def _gen_ai(attributes: dict[str, Any]) -> dict[str, Any] | None:
    said = {key: attributes[key] for key in c.GEN_AI_METRIC_ATTRIBUTES if key in attributes}
    return said or None


def _with_phases(stream: StreamSummary, root_start_ns: int, samples: list[StageSample], charged: Any) -> StreamSummary:
    first = root_start_ns + int(stream.first_chunk_ms * 1e6)
    before, between = split_phases(first, first + int(stream.streaming_ms * 1e6), samples, charged)
    return stream._replace(
        first_chunk_breakdown=before,
        gap_breakdown=between,
        first_chunk_bottleneck=largest(before),
        gap_bottleneck=largest(between),
    )


def _stored_load(attributes: dict[str, Any]) -> ProcessLoad | None:
    """The process's load a root's verdict was judged on (the CPU rules read it again where the verdict is
    recomputed)."""
    cpus = _typed(attributes.get(c.PROCESS_CPUS), int)
    used, runnable = _float(attributes.get(c.PROCESS_CPUS_USED)), _float(attributes.get(c.PROCESS_RUNNABLE))
    if cpus is None or used is None or runnable is None:
        return None
    return ProcessLoad(cpus, used, runnable, _float(attributes.get(c.REQUESTS_IN_FLIGHT)))


def _typed(value: Any, kind: type) -> Any:
    """An attribute value read back as the type its table says, or None when it is not one."""
    if kind is float:
        return _float(value)
    if kind is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if kind is tuple:  # an array of strings (OTLP JSON reads back as a list)
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
        return tuple(value) if ok and value else None
    return value if isinstance(value, kind) else None


def _compressed(a: dict[str, Any]) -> CompressedInfo | None:
    count = _typed(a.get(c.COMPRESSED_COUNT), int)
    if not count:
        return None
    keys = (c.COMPRESSED_SUM_MS, c.COMPRESSED_MIN_MS, c.COMPRESSED_MAX_MS)
    ns = [int((_float(a.get(key)) or 0.0) * 1e6) for key in keys]
    return CompressedInfo(count, *ns)


def _offload(a: dict[str, Any]) -> OffloadInfo | None:
    """An offload stage's facts of its call, read back by the table that wrote them."""
    if _typed(a.get(c.OFFLOAD_EXECUTOR), str) is None:
        return None
    return OffloadInfo(**{name: _typed(a.get(key), kind) for name, key, kind in c.OFFLOAD_FIELDS})


def _sample(span: Span, parent_stage: str) -> StageSample:
    a = span.attributes
    return StageSample(
        name=str(a.get(c.STAGE, span.name)),
        kind=str(a.get(c.STAGE_KIND, "cpu")),
        start_ns=span.start_ns,
        end_ns=max(span.start_ns, span.end_ns),
        span_id=int(span.span_id, 16),
        parent_stage_id=int(parent_stage, 16) if parent_stage else 0,
        on_event_loop=bool(a.get(c.ON_EVENT_LOOP, False)),
        **{name: _typed(a.get(key), kind) for name, key, kind in c.STAGE_SIGNALS},
        batch=batch_from_attributes(a, (int(span.links[0][0], 16), int(span.links[0][1], 16)) if span.links else None),
        compressed=_compressed(a),
        offload=_offload(a),
    )


def verdict_for_trace(
    spans: list[Span],
    slow_threshold_ms: float = DEFAULT_SLOW_THRESHOLD_MS,
    thresholds: DiagnosisThresholds | None = None,
) -> Verdict:
    root = global_root(spans)
    trace_id = root.trace_id
    with_verdict = [s for s in spans if c.TOTAL_MS in s.attributes]
    if len(with_verdict) == 1 and with_verdict[0] is root:
        return _stored_verdict(root, trace_id, spans)
    by_id = {s.span_id: s for s in spans}
    samples = []
    for s in spans:
        if c.STAGE not in s.attributes or s is root or s.attributes.get(c.LATE):
            continue
        if s.attributes.get(c.COMPRESSED_SLOWEST):
            continue  # a composite's slowest occurrence, shown beside it and counted in it
        parent, hops = by_id.get(s.parent_span_id), 0
        while parent is not None and c.STAGE not in parent.attributes and hops < 256:
            parent, hops = by_id.get(parent.parent_span_id), hops + 1
        samples.append(_sample(s, parent.span_id if parent is not None and c.STAGE in parent.attributes else ""))
    threshold = _float(root.attributes.get(c.SLOW_THRESHOLD_MS)) or slow_threshold_ms
    analysis = analyse_trace(root.start_ns, root.end_ns, samples, threshold)
    stream = stream_from_attributes(root)
    signals = TraceSignals(
        stream=_with_phases(stream, root.start_ns, samples, analysis.charged_ms) if stream else None,
        gpu_utilization=_float(root.attributes.get(c.GPU_UTILIZATION)),
        gil_pressure_ms=_float(root.attributes.get(c.GIL_PRESSURE_MS)),
        cpu_pressure_ms=_float(root.attributes.get(c.CPU_PRESSURE_MS)),
        loop_lag_ms=_float(root.attributes.get(c.LOOP_LAG_MS)),
        loop_held_ms=_float(root.attributes.get(c.LOOP_HELD_MS)),
        load=_stored_load(root.attributes),
    )
    route = root.attributes.get(c.HTTP_ROUTE)
    return build_verdict(
        trace_id=trace_id,
        root_name=root.name,
        analysis=analysis,
        diagnoses=diagnose(analysis, samples, signals, thresholds or DiagnosisThresholds()),
        route=route if isinstance(route, str) else None,
        signals=signals,
        gen_ai=_gen_ai(root.attributes),
        stream_thresholds=_stream_thresholds(root.attributes, threshold) if stream else None,
        offloads=tuple(offload_calls(samples)),
    )


def _stream_thresholds(attributes: dict[str, Any], slow_threshold_ms: float) -> StreamThresholds:
    """Those the exporter judged the stream by (on its root), else the defaults."""
    first = _float(attributes.get(c.STREAM_FIRST_CHUNK_THRESHOLD_MS))
    gap = _float(attributes.get(c.STREAM_GAP_THRESHOLD_MS))
    return StreamThresholds(first or slow_threshold_ms, gap or DEFAULT_GAP_THRESHOLD_MS)


def adjusted_count(spans: list[Span]) -> float:
    """How many requests the trace stands for: the adjusted count on its global root, else the largest on
    any of its local roots (several services each kept their part), else 1 (exported without sampling)."""
    found = [_float(s.attributes.get(c.SAMPLING_ADJUSTED_COUNT)) for s in spans if c.TOTAL_MS in s.attributes]
    on_root = _float(global_root(spans).attributes.get(c.SAMPLING_ADJUSTED_COUNT))
    weight = on_root if on_root is not None else max((w for w in found if w is not None), default=1.0)
    return weight if weight >= 1.0 else 1.0


def waterfall(spans: list[Span], limit: int = 200) -> list[dict[str, Any]]:
    """Spans relative to the global root, with their depth, for drawing (the first ``limit`` by start).
    Spans of one name under one parent that overlap (a composite and the slowest occurrence it shows, the
    ``event_loop.wait`` stretches of one request) are drawn as their union, one bar (``spans``: how many),
    as the verdict counts them: their bars would add up to more time than the trace lasted."""
    root = global_root(spans)
    by_id = {s.span_id: s for s in spans}
    out: list[dict[str, Any]] = []
    open_bars: dict[tuple[str, str, str], dict[str, Any]] = {}  # (service, parent, name) -> the bar drawn last
    for s in sorted(spans, key=lambda x: x.start_ns):
        start_ms, end_ms = round((s.start_ns - root.start_ns) / 1e6, 3), round((s.end_ns - root.start_ns) / 1e6, 3)
        key = (s.service, s.parent_span_id, s.name)
        bar = open_bars.get(key)
        if bar is not None and start_ms < bar["end_ms"]:
            bar["end_ms"] = max(bar["end_ms"], end_ms)
            bar["spans"] += 1
            continue
        if len(out) >= limit:
            continue
        depth, parent = 0, by_id.get(s.parent_span_id)
        while parent is not None and depth < 32:
            depth, parent = depth + 1, by_id.get(parent.parent_span_id)
        bar = {
            "name": s.name,
            "service": s.service,
            "kind": s.attributes.get(c.STAGE_KIND, "span"),
            "start_ms": start_ms,
            "end_ms": end_ms,
            "depth": depth,
            "spans": 1,
        }
        open_bars[key] = bar
        out.append(bar)
    return out


def is_batch_trace(spans: list[Span]) -> bool:
    """A batch's own trace (``stagetrace.batch()``): its root is the batch span. It has no verdict; its
    stages are charged in its members' traces."""
    return c.BATCH_ID in global_root(spans).attributes


def batch_execution(spans: list[Span]) -> tuple[str, int, float | None]:
    """(batch name, members, fill) of a batch trace."""
    a = global_root(spans).attributes
    size = a.get(c.BATCH_SIZE)
    return global_root(spans).name, size if isinstance(size, int) else 0, _float(a.get(c.BATCH_FILL))


def batch_waits(spans: list[Span]) -> list[tuple[str, float, float]]:
    """(wait stage, formation ms, busy ms) for each batch wait in a member's trace."""
    out = []
    for s in spans:
        formation = _float(s.attributes.get(c.BATCH_FORMATION_MS))
        if formation is not None:
            out.append(
                (str(s.attributes.get(c.STAGE, s.name)), formation, _float(s.attributes.get(c.BATCH_BUSY_MS)) or 0.0)
            )
    return out
