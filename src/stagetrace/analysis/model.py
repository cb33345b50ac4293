"""Plain data shared by the analysis, the exporter and the report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagetrace.analysis.breakdown import TraceAnalysis
    from stagetrace.analysis.diagnosis import Diagnosis, TraceSignals


@dataclass(slots=True, eq=False)
class StageSample:
    """One finished occurrence of a stage.

    The analysis reads these fields by name, so the exporter passes its ``ShippedStage``s directly
    (same names, perf-counter time base) and the report builds these from exported spans (epoch
    time base); only consistency within one trace matters.

    ``parent_stage_id`` is the span id of the nearest enclosing *stage* (not any span), so that exclusive
    time is right even when another instrumentation's span sits between two stages. Not frozen: one is
    built per stage, and a frozen dataclass's __init__ costs several times more.
    """

    name: str
    kind: str
    start_ns: int
    end_ns: int
    span_id: int = 0
    parent_stage_id: int = 0
    gpu_ms: float | None = None
    cpu_ms: float | None = None
    blocked_ms: float | None = None
    runqueue_ms: float | None = None
    on_event_loop: bool = False
    h2d_bytes: int | None = None
    h2d_pinned: bool | None = None
    gpu_utilization: float | None = None
    queue_saturated: bool | None = None  # for wait stages: was the pool full when the request queued?

    @property
    def wall_ms(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e6


@dataclass(frozen=True, slots=True)
class Verdict:
    """What stagetrace concluded about one trace; ``on_verdict`` callbacks receive it.

    ``breakdown`` maps stage name to milliseconds (exclusive, GPU time for GPU stages), in pipeline order.
    ``ratio`` is the bottleneck's share of ``total_ms`` in 0..1.
    """

    trace_id: str
    root_name: str
    total_ms: float
    breakdown: Mapping[str, float]
    bottleneck: str | None
    ratio: float
    slow: bool
    slow_threshold_ms: float
    untracked_ms: float
    diagnoses: tuple[Diagnosis, ...] = ()
    route: str | None = None
    gpu_utilization: float | None = None
    sampled: bool = True
    stage_kinds: Mapping[str, str] = field(default_factory=dict)
    gil_pressure_ms: float | None = None
    loop_lag_ms: float | None = None

    @property
    def diagnosis_codes(self) -> tuple[str, ...]:
        return tuple(d.code for d in self.diagnoses)


def build_verdict(
    *,
    trace_id: str,
    root_name: str,
    analysis: TraceAnalysis,
    diagnoses: tuple[Diagnosis, ...],
    route: str | None = None,
    signals: TraceSignals | None = None,
    sampled: bool = True,
) -> Verdict:
    return Verdict(
        trace_id=trace_id,
        root_name=root_name,
        total_ms=analysis.total_ms,
        breakdown=analysis.breakdown,
        bottleneck=analysis.bottleneck,
        ratio=analysis.ratio,
        slow=analysis.slow,
        slow_threshold_ms=analysis.slow_threshold_ms,
        untracked_ms=analysis.untracked_ms,
        diagnoses=diagnoses,
        route=route,
        gpu_utilization=signals.gpu_utilization if signals else None,
        gil_pressure_ms=signals.gil_pressure_ms if signals else None,
        loop_lag_ms=signals.loop_lag_ms if signals else None,
        sampled=sampled,
        stage_kinds=analysis.stage_kinds,
    )
