"""Exported trace files into an ``Aggregator``: the one pass that ``stagetrace report`` and the demo's report
share (loading in ``report.loader``, per-trace verdicts in ``report.traces``, summaries in ``report.aggregate``).
``add_trace`` is the step per trace, which the ClickHouse report (``report.clickhouse``) also runs on the
traces it reads span by span."""

from __future__ import annotations

import sys
from typing import NamedTuple, TextIO

from stagetrace.analysis import Verdict
from stagetrace.report.aggregate import Aggregator
from stagetrace.report.compare import Side, TraceFacts
from stagetrace.report.loader import Span, read_traces
from stagetrace.report.metric_totals import TraceCounts
from stagetrace.report.traces import (
    adjusted_count,
    batch_execution,
    batch_waits,
    global_root,
    is_batch_trace,
    verdict_for_trace,
    waterfall,
)
from stagetrace.settings import DEFAULT_SLOW_THRESHOLD_MS


class Window(NamedTuple):
    """Traces whose global root starts in [since, until) (epoch ns; open where None)."""

    since_ns: int | None = None
    until_ns: int | None = None

    @property
    def open(self) -> bool:
        return self.since_ns is None and self.until_ns is None

    def holds(self, start_ns: int) -> bool:
        return (self.since_ns is None or start_ns >= self.since_ns) and (
            self.until_ns is None or start_ns < self.until_ns
        )


ALL_TIME = Window()


def judge_trace(
    spans: list[Span],
    slow_threshold_ms: float,
    err: TextIO,
    route: str | None = None,
    *,
    window: Window = ALL_TIME,
) -> Verdict | None:
    """One trace's verdict; None when it is not a request to count: outside the window, a batch's own
    trace, another route, or a trace the analysis could not judge (reported on ``err``)."""
    try:
        if not window.open and not window.holds(global_root(spans).start_ns):
            return None
        if is_batch_trace(spans):
            return None
        verdict = verdict_for_trace(spans, slow_threshold_ms)
    except Exception as e:  # one odd trace must not stop the report
        print(f"stagetrace report: trace {spans[0].trace_id}: skipped ({type(e).__name__}: {e})", file=err)
        return None
    return None if route is not None and verdict.route != route else verdict


def add_trace(
    agg: Aggregator,
    spans: list[Span],
    slow_threshold_ms: float,
    err: TextIO,
    route: str | None = None,
    *,
    batches: bool = True,
    window: Window = ALL_TIME,
) -> Verdict | None:
    """Judge one trace and count it, weighted by its adjusted count (a batch's own trace counted as a batch
    execution, unless ``batches`` is False); returns its verdict, None when it was not counted."""
    try:
        if batches and (window.open or window.holds(global_root(spans).start_ns)) and is_batch_trace(spans):
            agg.add_batch(*batch_execution(spans))
            return None
    except Exception as e:  # one odd trace must not stop the report
        print(f"stagetrace report: trace {spans[0].trace_id}: skipped ({type(e).__name__}: {e})", file=err)
        return None
    verdict = judge_trace(spans, slow_threshold_ms, err, route, window=window)
    if verdict is None:
        return None
    for wait in batch_waits(spans):
        agg.add_batch_wait(*wait)
    weight = adjusted_count(spans)
    agg.add(verdict, waterfall(spans) if agg.would_keep(verdict) else None, weight)
    return verdict


def aggregate_files(
    paths: list[str],
    slow_threshold_ms: float = DEFAULT_SLOW_THRESHOLD_MS,
    err: TextIO | None = None,
    route: str | None = None,
    *,
    batches: bool = True,
    window: Window = ALL_TIME,
) -> tuple[Aggregator, dict[str, int]]:
    """Stream trace files into an Aggregator (waterfalls kept for the slowest); ``route`` keeps only traces
    whose global root has that http.route, ``window`` those whose root started in it. Batch executions have
    a trace (and no route) of their own: ``batches=False`` leaves them out. Metrics files among the paths
    give the exact request and slow counts (``Aggregator.counted``), over all time only: a cumulative count
    cannot be cut to a window."""
    err = err or sys.stderr
    agg = Aggregator()
    totals = TraceCounts()

    def on_trace(spans: list[Span]) -> None:
        add_trace(agg, spans, slow_threshold_ms, err, route, batches=batches, window=window)

    counts = read_traces(paths, on_trace, errors=err, on_metrics=totals.add)
    if window.open:
        agg.counted = totals.counted(route)
    return agg, counts


def trace_facts(verdict: Verdict, weight: float) -> TraceFacts:
    return TraceFacts(verdict.total_ms, dict(verdict.breakdown), verdict.bottleneck, verdict.diagnosis_codes, weight)


def facts_from_files(
    paths: list[str],
    slow_threshold_ms: float = DEFAULT_SLOW_THRESHOLD_MS,
    err: TextIO | None = None,
    route: str | None = None,
    *,
    window: Window = ALL_TIME,
    max_traces: int = 20_000,
) -> tuple[Side, dict[str, int]]:
    """One side of a comparison from trace files: each request's facts (batch executions left out), at most
    ``max_traces`` of them (a uniform sample beyond)."""
    errors = err or sys.stderr
    side = Side(max_traces=max_traces)

    def on_trace(spans: list[Span]) -> None:
        verdict = judge_trace(spans, slow_threshold_ms, errors, route, window=window)
        if verdict is not None:
            side.add(trace_facts(verdict, adjusted_count(spans)))

    return side, read_traces(paths, on_trace, errors=errors)
