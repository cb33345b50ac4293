"""Exported trace files into an ``Aggregator``: the one pass that ``stagetrace report`` and the demo's report
share (loading in ``report.loader``, per-trace verdicts in ``report.traces``, summaries in ``report.aggregate``).
``add_trace`` is the step per trace, which the ClickHouse report (``report.clickhouse``) also runs on the
traces it reads span by span."""

from __future__ import annotations

import sys
from typing import TextIO

from stagetrace.analysis import Verdict
from stagetrace.report.aggregate import Aggregator
from stagetrace.report.loader import Span, read_traces
from stagetrace.report.traces import batch_execution, batch_waits, is_batch_trace, verdict_for_trace, waterfall
from stagetrace.settings import DEFAULT_SLOW_THRESHOLD_MS


def add_trace(
    agg: Aggregator,
    spans: list[Span],
    slow_threshold_ms: float,
    err: TextIO,
    route: str | None = None,
    *,
    batches: bool = True,
) -> Verdict | None:
    """Judge one trace and count it; returns its verdict, None when it was not counted (a batch's own
    trace, another route, or a trace the analysis could not judge: reported on ``err``)."""
    try:
        if is_batch_trace(spans):
            if batches:
                agg.add_batch(*batch_execution(spans))
            return None
        verdict = verdict_for_trace(spans, slow_threshold_ms)
    except Exception as e:  # one odd trace must not stop the report
        print(f"stagetrace report: trace {spans[0].trace_id}: skipped ({type(e).__name__}: {e})", file=err)
        return None
    if route is not None and verdict.route != route:
        return None
    for wait in batch_waits(spans):
        agg.add_batch_wait(*wait)
    agg.add(verdict, waterfall(spans) if agg.would_keep(verdict.total_ms) else None)
    return verdict


def aggregate_files(
    paths: list[str],
    slow_threshold_ms: float = DEFAULT_SLOW_THRESHOLD_MS,
    err: TextIO | None = None,
    route: str | None = None,
    *,
    batches: bool = True,
) -> tuple[Aggregator, dict[str, int]]:
    """Stream trace files into an Aggregator (waterfalls kept for the slowest); ``route`` keeps only traces
    whose global root has that http.route. Batch executions have a trace (and no route) of their own:
    ``batches=False`` leaves them out."""
    err = err or sys.stderr
    agg = Aggregator()

    def on_trace(spans: list[Span]) -> None:
        add_trace(agg, spans, slow_threshold_ms, err, route, batches=batches)

    return agg, read_traces(paths, on_trace, errors=err)
