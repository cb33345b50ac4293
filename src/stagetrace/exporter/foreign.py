"""Other instrumentations' spans read as stages (``conventions.FOREIGN_STAGES``): FastAPI's operation spans
become stages of the request with their own span kept (its scope, attributes and status), marked with the
stage attributes. Pure functions of the shipped records."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry.trace import StatusCode

from stagetrace import conventions as c
from stagetrace.common import wire

_ERROR = StatusCode.ERROR.value
_FAILED = ("error", "", "")  # the stage failed; its exception events stay on its own span, exported as it is


def foreign_kind(span: wire.WireSpan) -> str | None:
    """The stage kind of a span that is read as a stage, or None."""
    return c.FOREIGN_STAGES.get((span.scope_name, span.name))


def split_foreign_stages(
    spans: Iterable[wire.WireSpan], offset: int
) -> tuple[list[tuple[wire.ShippedStage, wire.WireSpan]], list[wire.WireSpan]]:
    """(stage read from the span, the span) for each span read as a stage; and the other spans."""
    stages, others = [], []
    for span in spans:
        kind = foreign_kind(span)
        if kind is None:
            others.append(span)
            continue
        stage = wire.ShippedStage.added(
            span.name,
            kind,
            span.span_id,
            span.parent_span_id,
            span.start_ns - offset,  # onto the stages' perf-counter clock
            span.end_ns - offset,
        )
        if span.status_code == _ERROR:
            stage.error = _FAILED
        stages.append((stage, span))
    return stages, others


def link_enclosing_stages(stages: Sequence[Any], spans: Iterable[wire.WireSpan]) -> None:
    """Point each stage's ``parent_stage_id`` at its nearest enclosing stage through the other spans of the
    trace: a stage inside a span read as a stage was recorded without knowing it was one."""
    parent_of = {span.span_id: span.parent_span_id for span in spans}
    stage_ids = {st.span_id for st in stages}
    for st in stages:
        p = st.parent_span_id
        walked: set[int] = set()  # a malformed trace may hold a cycle of parents
        while p and p not in stage_ids and p in parent_of and p not in walked:
            walked.add(p)
            p = parent_of[p]
        if p in stage_ids and p != st.span_id:
            st.parent_stage_id = p


def as_stage_span(span: wire.WireSpan, kind: str, extra: dict[str, Any] | None = None) -> wire.WireSpan:
    """The span itself, with the attributes of a stage span."""
    attributes = {**span.attributes, c.STAGE: span.name, c.STAGE_KIND: kind}
    if extra:
        attributes.update(extra)
    return wire.replace_span(span, attributes=attributes)
