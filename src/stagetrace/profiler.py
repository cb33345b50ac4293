"""``InferencePipelineProfiler``: the classic dict-of-timings profiler's API, kept so that existing scripts
run with only their import changed. It returns the same report synchronously and its stages also become
spans, analysed by the same code as every other trace."""

from __future__ import annotations

import logging
import time
from typing import Any

from opentelemetry.trace import format_trace_id, get_current_span

from stagetrace import _state
from stagetrace.analysis import StageSample, analyse_trace
from stagetrace.capture.stage import Pipeline, add_stage, validate_stage_name
from stagetrace.settings import DEFAULT_SLOW_THRESHOLD_MS

logger = logging.getLogger("stagetrace")


class InferencePipelineProfiler:
    """``start()``, then ``record_stage(name)`` at the end of each stage (a stage runs from the previous mark),
    then ``analyze_and_report()``."""

    def __init__(self, slow_threshold_ms: float = DEFAULT_SLOW_THRESHOLD_MS) -> None:
        if not slow_threshold_ms > 0:
            raise ValueError("slow_threshold_ms must be > 0")
        self.slow_threshold_ms = float(slow_threshold_ms)
        self._pipeline: Pipeline | None = None
        self._start_ns = 0
        self._mark_ns = 0
        self._samples: list[StageSample] = []
        self.stage_breakdown_ms: dict[str, float] = {}

    def start(self) -> None:
        self._samples = []
        self.stage_breakdown_ms = {}
        if _state.runtime is not None and not get_current_span().get_span_context().is_valid:
            self._pipeline = Pipeline("inference")
            self._pipeline.__enter__()
        self._start_ns = self._mark_ns = time.perf_counter_ns()

    def record_stage(self, stage_name: str) -> None:
        name = validate_stage_name(stage_name)
        if not self._start_ns:
            raise RuntimeError("InferencePipelineProfiler.record_stage() called before start()")
        now = time.perf_counter_ns()
        self._samples.append(StageSample(name=name, kind="cpu", start_ns=self._mark_ns, end_ns=now))
        self.stage_breakdown_ms[name] = self.stage_breakdown_ms.get(name, 0.0) + (now - self._mark_ns) / 1e6
        self._emit_span(name, self._mark_ns, now)
        self._mark_ns = now

    def _emit_span(self, name: str, start_ns: int, end_ns: int) -> None:
        add_stage(name, "cpu", start_ns, end_ns)  # the stage ran between the marks, not just now

    def analyze_and_report(self) -> dict[str, Any]:
        if not self._start_ns:
            raise RuntimeError("InferencePipelineProfiler.analyze_and_report() called before start()")
        end = time.perf_counter_ns()
        # The classic report names a recorded stage: callers index stage_breakdown_ms with it.
        analysis = analyse_trace(self._start_ns, end, self._samples, self.slow_threshold_ms, untracked_headline=False)
        trace_id = get_current_span().get_span_context().trace_id
        if self._pipeline is not None:
            self._pipeline.__exit__(None, None, None)
            self._pipeline = None
        report = {
            "total_latency_ms": round(analysis.total_ms, 3),
            "stage_breakdown_ms": {k: round(v, 3) for k, v in analysis.breakdown.items()},
            "bottleneck_stage": analysis.bottleneck,
            "bottleneck_ratio_pct": round(analysis.ratio * 100, 2),
            "is_slow_request": analysis.slow,
        }
        if analysis.slow and _state.runtime is None:
            # Configured runs log through the exporter; keep the classic warning otherwise.
            logger.warning(
                "slow request %.1f ms > %.0f ms; bottleneck %s %.1f%%%s",
                analysis.total_ms,
                self.slow_threshold_ms,
                analysis.bottleneck,
                analysis.ratio * 100,
                f" trace_id={format_trace_id(trace_id)}" if trace_id else "",
            )
        return report
