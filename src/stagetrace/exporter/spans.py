"""Spans built from shipped records, as wire tuples (``common.wire.WireSpan``) with their true
timestamps: stage spans, and the local root with the verdict.

Pure functions of their inputs: no clocks, no I/O, no global state. The stage span ids were allocated on
the request thread, so spans that other instrumentations created inside a stage already point at them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry.trace import SpanKind, StatusCode

from stagetrace import conventions as c
from stagetrace._version import __version__
from stagetrace.analysis import BatchInfo, Verdict
from stagetrace.analysis.streams import gen_ai_latencies
from stagetrace.common import wire
from stagetrace.common.decimals import round_to
from stagetrace.settings import MAX_LINKS_PER_SPAN


def stage_attributes(stage: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    attrs: dict[str, Any] = {c.STAGE: stage.name, c.STAGE_KIND: stage.kind}
    for field_name, key, _ in c.STAGE_SIGNALS:
        value = getattr(stage, field_name)
        if value is not None:
            attrs[key] = value
    if stage.on_event_loop:
        attrs[c.ON_EVENT_LOOP] = True
    info = stage.offload
    if info is not None:
        for field_name, key, _ in c.OFFLOAD_FIELDS:
            value = getattr(info, field_name)
            if value is not None:
                attrs[key] = value
        if stage.error:
            attrs[c.ERROR_TYPE] = stage.error[0]  # as a failed call's span says it (the worker died: BrokenProcessPool)
    if stage.batch is not None:
        attrs.update(batch_attributes(stage))
    folded = stage.compressed
    if folded is not None:
        attrs[c.COMPRESSED_COUNT] = folded.occurrences
        attrs[c.COMPRESSED_SUM_MS] = round_to(folded.sum_ns / 1e6, 3)
        attrs[c.COMPRESSED_MIN_MS] = round_to(folded.min_ns / 1e6, 3)
        attrs[c.COMPRESSED_MAX_MS] = round_to(folded.max_ns / 1e6, 3)
    elif stage.example:
        attrs[c.COMPRESSED_SLOWEST] = True
    if stage.attributes:
        attrs.update(stage.attributes)
    if extra:
        attrs.update(extra)
    return attrs


def batch_attributes(stage: Any) -> dict[str, Any]:
    """Membership of a batch on a stage of a member's trace: the wait carries its split, the other stages
    the member's amortised share of their time (its items over the batch's)."""
    b = stage.batch
    attrs: dict[str, Any] = {
        c.BATCH_ID: b.id,
        c.BATCH_SIZE: b.size,
        c.BATCH_ITEMS: b.items,
        c.BATCH_INDEX: b.member_index,
    }
    if b.formation_ms is not None:
        attrs[c.BATCH_FORMATION_MS] = round_to(b.formation_ms, 3)
        attrs[c.BATCH_BUSY_MS] = round_to(b.busy_ms or 0.0, 3)
    elif b.items:
        ms = stage.gpu_ms if stage.kind in c.GPU_KINDS and stage.gpu_ms is not None else stage.wall_ms
        attrs[c.BATCH_SHARE_MS] = round_to(ms * b.member_items / b.items, 3)
    if b.is_member_batch_stage and b.max_size:
        attrs[c.BATCH_MAX_SIZE] = b.max_size
        attrs[c.BATCH_FILL] = round_to(b.fill or 0.0, 4)  # BatchInfo.fill: the formula written once
    return attrs


def batch_from_attributes(attributes: Mapping[str, Any], link: tuple[int, int] | None) -> BatchInfo | None:
    """The reverse of ``batch_attributes``, for stages read back from exported spans (``stagetrace report``);
    ``link``: the span's first link, which a member's batch stage has to the batch span."""
    batch_id = attributes.get(c.BATCH_ID)
    if not isinstance(batch_id, str):
        return None

    def number(key: str) -> Any:
        value = attributes.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    formation = number(c.BATCH_FORMATION_MS)
    link_trace_id, link_span_id = link if link is not None else (0, 0)
    return BatchInfo(
        batch_id,
        int(number(c.BATCH_SIZE) or 0),
        int(number(c.BATCH_ITEMS) or 0),
        int(number(c.BATCH_INDEX) or 0),
        1,  # a member's own items are not exported; its share is (stagetrace.batch.share_ms)
        int(number(c.BATCH_MAX_SIZE) or 0),
        link_trace_id,
        link_span_id,
        formation,
        number(c.BATCH_BUSY_MS) if formation is not None else None,
    )


def stage_links(stage: Any, flags: int) -> tuple[Any, ...]:
    """A member's batch stage links to the batch span, so a slow request leads to the batch that served it."""
    b = stage.batch
    if b is None or not b.is_member_batch_stage:
        return ()
    return ((b.link_trace_id, b.link_span_id, flags, "", {}),)


def stage_span(
    stage: Any, trace_id: int, perf_to_epoch_ns: int, flags: int, trace_state: str, extra: dict[str, Any] | None = None
) -> wire.WireSpan:
    """``perf_to_epoch_ns`` moves the stage's perf-counter times onto the epoch clock of its trace."""
    start = stage.start_ns + perf_to_epoch_ns
    end = max(start, stage.end_ns + perf_to_epoch_ns)
    events: tuple[Any, ...] = ()
    status, description = StatusCode.UNSET.value, ""
    if stage.error:
        etype, message, stacktrace = stage.error
        events = (
            (
                "exception",
                end,
                {"exception.type": etype, "exception.message": message, "exception.stacktrace": stacktrace},
            ),
        )
        status, description = StatusCode.ERROR.value, f"{etype}: {message}"[:256]
    return wire.new_span(
        stage.name,
        trace_id,
        stage.span_id,
        stage.parent_span_id,
        False,
        SpanKind.INTERNAL.value,
        start,
        end,
        stage_attributes(stage, extra),
        events,
        stage_links(stage, flags),
        status,
        description,
        c.INSTRUMENTATION_NAME,
        __version__,
        flags,
        trace_state,
        0,
        0,
        0,
    )


def verdict_attributes(verdict: Verdict) -> dict[str, Any]:
    """The verdict on the local root, by ``conventions.VERDICT_FIELDS`` (``report.traces`` reads it back by
    the same table), plus the breakdown and the diagnosis codes."""
    attrs: dict[str, Any] = {}
    for field_name, key, _, digits in c.VERDICT_FIELDS:
        value = getattr(verdict, field_name)
        if field_name == "ratio" and verdict.bottleneck is None:
            continue  # a ratio of no bottleneck says nothing
        if value is not None:
            attrs[key] = round_to(value, digits) if digits is not None else value
    if verdict.breakdown:
        attrs[c.STAGES] = tuple(verdict.breakdown)
        attrs[c.STAGES_MS] = tuple(round_to(v, 3) for v in verdict.breakdown.values())
    if verdict.diagnoses:
        attrs[c.DIAGNOSIS] = verdict.diagnosis_codes
    stream = verdict.stream
    if stream is not None:
        for field_name, key, _, digits in c.STREAM_FIELDS:
            value = getattr(stream, field_name)
            if value is not None:
                attrs[key] = round_to(value, digits) if digits is not None else value
        if verdict.gen_ai:
            latencies = gen_ai_latencies(stream, verdict.stage_kinds, verdict.total_ms, c.GPU_KINDS)
            attrs.update(zip(GEN_AI_LATENCY_KEYS, (round_to(v, 6) for v in latencies)))
    return attrs


GEN_AI_LATENCY_KEYS = (
    c.GEN_AI_LATENCY_TTFT,
    c.GEN_AI_LATENCY_E2E,
    c.GEN_AI_LATENCY_QUEUE,
    c.GEN_AI_LATENCY_PREFILL,
    c.GEN_AI_LATENCY_DECODE,
)  # in GenAiLatencies' order


def diagnosis_events(verdict: Verdict, timestamp_ns: int) -> tuple[Any, ...]:
    events = []
    for d in verdict.diagnoses:
        attrs = {
            c.DIAGNOSIS_EVENT_CODE: d.code,
            c.DIAGNOSIS_EVENT_MESSAGE: d.message,
            c.DIAGNOSIS_EVENT_ADVICE: d.advice,
        }
        if d.stage:
            attrs[c.DIAGNOSIS_EVENT_STAGE] = d.stage
        if d.evidence:
            attrs[c.DIAGNOSIS_EVENT_EVIDENCE] = d.evidence
        events.append((c.DIAGNOSIS_EVENT, timestamp_ns, attrs))
    return tuple(events)


# Attributes where HTTP instrumentations put the query string (old and new semantic conventions).
_QUERY_BEARING = ("http.target", "http.url", "url.full")
_QUERY_ONLY = ("url.query",)


def strip_query_strings(attributes: dict[str, Any]) -> None:
    """Query strings carry user data (ids, tokens, search terms); they are not kept unless the user opts
    in (``Settings(record_query_strings=True)``)."""
    for key in _QUERY_BEARING:
        value = attributes.get(key)
        if isinstance(value, str) and "?" in value:
            attributes[key] = value.partition("?")[0]
    for key in _QUERY_ONLY:
        attributes.pop(key, None)


def root_with_verdict(
    root: wire.WireSpan,
    verdict: Verdict,
    *,
    keep_query_strings: bool = False,
    extra: dict[str, Any] | None = None,
) -> wire.WireSpan:
    """The local root's wire tuple with the verdict attributes (and ``extra``: what the keep decision adds)
    and one event per diagnosis."""
    attributes = dict(root.attributes)
    if not keep_query_strings:
        strip_query_strings(attributes)
    attributes.update(verdict_attributes(verdict))
    if extra:
        attributes.update(extra)
    if verdict.gen_ai:
        attributes.update({k: v for k, v in verdict.gen_ai.items() if k not in attributes})
    changes: dict[str, Any] = {}
    if verdict.stream is not None and verdict.stream.disconnected:
        attributes.setdefault(c.ERROR_TYPE, c.CLIENT_DISCONNECTED)  # as FastAPI's own telemetry marks it
        changes["status_code"] = StatusCode.ERROR.value
    events = tuple(root.events) + diagnosis_events(verdict, root.end_ns)
    return wire.replace_span(root, attributes=attributes, events=events, **changes)


def batch_spans(root: wire.WireSpan, new_span_id: Callable[[], int]) -> list[wire.WireSpan]:
    """The batch span with its links to every member, in chunks: the span keeps the first
    ``MAX_LINKS_PER_SPAN``; each further chunk goes on a child span ``<name> members``."""
    links = root.links
    if len(links) <= MAX_LINKS_PER_SPAN:
        return [root]
    out = [wire.replace_span(root, links=links[:MAX_LINKS_PER_SPAN])]
    attributes = {k: v for k, v in root.attributes.items() if k == c.BATCH_ID}
    for first in range(MAX_LINKS_PER_SPAN, len(links), MAX_LINKS_PER_SPAN):
        out.append(
            wire.replace_span(
                root,
                name=f"{root.name} members",
                span_id=new_span_id(),
                parent_span_id=root.span_id,
                parent_is_remote=False,
                attributes=dict(attributes),
                events=(),
                links=links[first : first + MAX_LINKS_PER_SPAN],
            )
        )
    return out
