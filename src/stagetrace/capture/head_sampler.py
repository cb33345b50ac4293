"""Sampling that keeps metrics whole: a local root the wrapped sampler would drop is recorded but not
exported (RECORD_ONLY), so the exporter still sees the request and records its metrics.
Only local roots are promoted; their children follow the parent-based decision, so this costs one
recording span per unsampled request, not one per span."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind, TraceState, get_current_span
from opentelemetry.util.types import Attributes


class LocalRootRecordingSampler(Sampler):
    def __init__(self, base: Sampler) -> None:
        self.base = base

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        result = self.base.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
        if result.decision is Decision.DROP:
            parent = get_current_span(parent_context).get_span_context()
            if not parent.is_valid or parent.is_remote:
                return SamplingResult(Decision.RECORD_ONLY, result.attributes, result.trace_state)
        return result

    def get_description(self) -> str:
        return f"LocalRootRecording{{{self.base.get_description()}}}"
