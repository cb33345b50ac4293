"""Other instrumentations' spans read as stages (``conventions.FOREIGN_STAGES``): FastAPI's operation spans
become stages of the request with their own span kept (its scope, attributes and status), marked with the
stage attributes. Pure functions of the shipped records."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry.trace import StatusCode

from stagetrace import conventions as c
from stagetrace.common import wire

_SCOPE = wire.SPAN_INDEX["scope_name"]
_PARENT = wire.SPAN_INDEX["parent_span_id"]
_ERROR = StatusCode.ERROR.value
_FAILED = ("error", "", "")  # the stage failed; its exception events stay on its own span, exported as it is


def foreign_kind(span: Sequence[Any]) -> str | None:
    """The stage kind of a span that is read as a stage, or None."""
    return c.FOREIGN_STAGES.get((span[_SCOPE], span[wire.SPAN_NAME]))


def split_foreign_stages(
    spans: Iterable[tuple[Any, ...]], offset: int
) -> tuple[list[tuple[wire.ShippedStage, tuple[Any, ...]]], list[tuple[Any, ...]]]:
    """(stage read from the span, the span) for each span read as a stage; and the other spans."""
    stages, others = [], []
    for span in spans:
        kind = foreign_kind(span)
        if kind is None:
            others.append(span)
            continue
        stage = wire.ShippedStage.added(
            span[wire.SPAN_NAME],
            kind,
            span[wire.SPAN_ID],
            span[_PARENT],
            span[wire.SPAN_START] - offset,  # onto the stages' perf-counter clock
            span[wire.SPAN_END] - offset,
        )
        if span[wire.SPAN_STATUS] == _ERROR:
            stage.error = _FAILED
        stages.append((stage, span))
    return stages, others


def link_enclosing_stages(stages: Sequence[Any], spans: Iterable[Sequence[Any]]) -> None:
    """Point each stage's ``parent_stage_id`` at its nearest enclosing stage through the other spans of the
    trace: a stage inside a span read as a stage was recorded without knowing it was one."""
    parent_of = {span[wire.SPAN_ID]: span[_PARENT] for span in spans}
    stage_ids = {st.span_id for st in stages}
    for st in stages:
        p = st.parent_span_id
        walked: set[int] = set()  # a malformed trace may hold a cycle of parents
        while p and p not in stage_ids and p in parent_of and p not in walked:
            walked.add(p)
            p = parent_of[p]
        if p in stage_ids and p != st.span_id:
            st.parent_stage_id = p


def as_stage_span(span: tuple[Any, ...], kind: str, extra: dict[str, Any] | None = None) -> tuple[Any, ...]:
    """The span itself, with the attributes of a stage span."""
    attributes = {**span[wire.SPAN_ATTRIBUTES], c.STAGE: span[wire.SPAN_NAME], c.STAGE_KIND: kind}
    if extra:
        attributes.update(extra)
    return wire.replace_span(span, attributes=attributes)
