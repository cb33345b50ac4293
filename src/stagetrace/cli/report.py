"""``stagetrace report PATH... [--json] [--html FILE]``: summarise exported traces; ``stagetrace report
--clickhouse URL`` does the same where a fleet keeps them (the Collector's ClickHouse exporter's table)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from stagetrace.report.aggregate import Aggregator
from stagetrace.report.collect import Window, aggregate_files
from stagetrace.report.loader import expand_paths
from stagetrace.report.render import html_report, text_report
from stagetrace.settings import DEFAULT_SLOW_THRESHOLD_MS

TITLE = "stagetrace report"


def run_report(
    paths: list[str],
    *,
    as_json: bool = False,
    html_path: str | None = None,
    slow_threshold_ms: float = DEFAULT_SLOW_THRESHOLD_MS,
    route: str | None = None,
    since: str | None = None,
    until: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """The report over files; ``since`` / ``until`` keep the traces whose root started in that window."""
    from stagetrace.report.fleet import parse_time

    out, err = out or sys.stdout, err or sys.stderr
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        print(f"stagetrace report: no such file or directory: {', '.join(missing)}", file=err)
        return 2
    if not expand_paths(paths):
        print("stagetrace report: no trace files found (expected OTLP JSON lines, *.jsonl)", file=err)
        return 2
    try:
        window = Window(parse_time(since) if since else None, parse_time(until) if until else None)
    except ValueError as e:
        print(f"stagetrace report: {e}", file=err)
        return 2
    agg, counts = aggregate_files(paths, slow_threshold_ms, err, route, window=window)
    summary: dict[str, Any] = agg.summary()
    summary["input"] = counts
    read = (
        f"read {counts['spans']} spans and {counts['metric_lines']} metrics exports from {counts['files']} files "
        f"({counts['malformed']} malformed lines)"
    )
    if not window.open and counts["metric_lines"]:
        read += "; the metrics' counts cover all time, not --since/--until, and are left out"
    _emit(summary, agg, None, read, as_json=as_json, html_path=html_path, out=out, err=err)
    return 0


def run_clickhouse_report(
    url: str,
    *,
    database: str | None = None,
    table: str | None = None,
    since: str | None = None,
    until: str | None = None,
    service: str | None = None,
    route: str | None = None,
    group_by: str | None = None,
    as_json: bool = False,
    html_path: str | None = None,
    slow_threshold_ms: float = DEFAULT_SLOW_THRESHOLD_MS,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """The report over a ClickHouse trace table; 2 with one line on ``err`` when it cannot be read (server
    unreachable, no such table, another schema, the extra not installed), never a traceback."""
    from stagetrace.report.clickhouse import ClickHouseError, aggregate_clickhouse, connect
    from stagetrace.report.fleet import Filters, Source, parse_time
    from stagetrace.report.otel_schema import DEFAULT_DATABASE, DEFAULT_TRACES_TABLE

    out, err = out or sys.stdout, err or sys.stderr
    try:
        filters = Filters(
            since_ns=parse_time(since) if since else None,
            until_ns=parse_time(until) if until else None,
            service=service,
            route=route,
            group_by=group_by,
        )
    except ValueError as e:
        print(f"stagetrace report: {e}", file=err)
        return 2
    source = Source(database or DEFAULT_DATABASE, table or DEFAULT_TRACES_TABLE)
    try:
        conn = connect(url)
    except (ClickHouseError, RuntimeError) as e:  # RuntimeError: the extra is not installed (require())
        print(f"stagetrace report: {e}", file=err)
        return 2
    try:
        report = aggregate_clickhouse(conn, source, filters, slow_threshold_ms, err)
    except ClickHouseError as e:
        print(f"stagetrace report: {e}", file=err)
        return 2
    finally:
        conn.close()
    for note in report.notes:
        print(f"stagetrace report: {note}", file=err)
    summary: dict[str, Any] = report.overall.summary()
    summary["input"] = report.input_counts()
    summary["example_traces"] = report.example_traces()
    groups = None
    if group_by:
        summary["group_by"] = group_by
        groups = summary["groups"] = report.group_summaries()
    counts = summary["input"]
    read = (
        f"read {counts['traces_from_stored_verdicts']} stored verdicts and recomputed "
        f"{counts['traces_recomputed_from_spans']} traces from their spans, of {counts['spans']} spans in {source}"
    )
    _emit(summary, report.overall, groups, read, as_json=as_json, html_path=html_path, out=out, err=err)
    return 0


def _emit(
    summary: dict[str, Any],
    agg: Aggregator,
    groups: dict[str, dict[str, Any]] | None,
    read: str,
    *,
    as_json: bool,
    html_path: str | None,
    out: TextIO,
    err: TextIO,
) -> None:
    if as_json:
        json.dump(summary, out, indent=2)
        out.write("\n")
    else:
        print(text_report(summary, TITLE, groups), file=out)
        print(f"\n{read}", file=out)
    if html_path:
        Path(html_path).write_text(html_report(summary, agg.slowest(), TITLE, groups), encoding="utf-8")
        print(f"wrote {html_path}", file=err if as_json else out)
