"""``stagetrace report PATH... [--json] [--html FILE]``: summarise exported traces."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from stagetrace.report.aggregate import Aggregator
from stagetrace.report.loader import Span, expand_paths, read_traces
from stagetrace.report.render import html_report, text_report
from stagetrace.report.traces import batch_execution, batch_waits, is_batch_trace, verdict_for_trace, waterfall
from stagetrace.settings import DEFAULT_SLOW_THRESHOLD_MS


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
        try:
            if is_batch_trace(spans):
                if batches:
                    agg.add_batch(*batch_execution(spans))
                return
            verdict = verdict_for_trace(spans, slow_threshold_ms)
        except Exception as e:  # one odd trace must not stop the report
            print(f"stagetrace report: trace {spans[0].trace_id}: skipped ({type(e).__name__}: {e})", file=err)
            return
        if route is not None and verdict.route != route:
            return
        for wait in batch_waits(spans):
            agg.add_batch_wait(*wait)
        agg.add(verdict, waterfall(spans) if agg.would_keep(verdict.total_ms) else None)

    return agg, read_traces(paths, on_trace, errors=err)


def run_report(
    paths: list[str],
    *,
    as_json: bool = False,
    html_path: str | None = None,
    slow_threshold_ms: float = DEFAULT_SLOW_THRESHOLD_MS,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        print(f"stagetrace report: no such file or directory: {', '.join(missing)}", file=err)
        return 2
    if not expand_paths(paths):
        print("stagetrace report: no trace files found (expected OTLP JSON lines, *.jsonl)", file=err)
        return 2
    agg, counts = aggregate_files(paths, slow_threshold_ms, err)
    summary: dict[str, Any] = agg.summary()
    summary["input"] = counts
    if as_json:
        json.dump(summary, out, indent=2)
        out.write("\n")
    else:
        print(text_report(summary, "stagetrace report"), file=out)
        print(
            f"\nread {counts['spans']} spans from {counts['files']} files ({counts['malformed']} malformed lines)",
            file=out,
        )
    if html_path:
        Path(html_path).write_text(html_report(summary, agg.slowest(), "stagetrace report"), encoding="utf-8")
        print(f"wrote {html_path}", file=err if as_json else out)
    return 0
