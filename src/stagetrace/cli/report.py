"""``stagetrace report PATH... [--json] [--html FILE]``: summarise exported traces; ``stagetrace report
--clickhouse URL`` does the same where a fleet keeps them (the Collector's ClickHouse exporter's table)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from stagetrace.report.aggregate import Aggregator
from stagetrace.report.collect import Window, aggregate_files
from stagetrace.report.compare import Comparison, compare
from stagetrace.report.loader import expand_paths
from stagetrace.report.render import before_after_html, before_after_text, html_report, text_report
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


def _emit_comparison(comparison: Comparison, *, as_json: bool, html_path: str | None, out: TextIO, err: TextIO) -> None:
    summary = comparison.summary()
    if as_json:
        json.dump(summary, out, indent=2)
        out.write("\n")
    else:
        print(before_after_text(summary, f"{TITLE} --compare"), file=out)
    if html_path:
        Path(html_path).write_text(before_after_html(summary, f"{TITLE} --compare"), encoding="utf-8")
        print(f"wrote {html_path}", file=err if as_json else out)


def run_compare(
    before: str,
    after: str,
    *,
    resamples: int = 1000,
    as_json: bool = False,
    html_path: str | None = None,
    slow_threshold_ms: float = DEFAULT_SLOW_THRESHOLD_MS,
    route: str | None = None,
    since: str | None = None,
    until: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``stagetrace report --compare BEFORE AFTER`` over files or directories of OTLP JSON lines."""
    from stagetrace.report.collect import facts_from_files
    from stagetrace.report.fleet import parse_time

    out, err = out or sys.stdout, err or sys.stderr
    for side in (before, after):
        if not Path(side).exists():
            print(f"stagetrace report: no such file or directory: {side}", file=err)
            return 2
        if not expand_paths([side]):
            print(f"stagetrace report: no trace files in {side} (expected OTLP JSON lines, *.jsonl)", file=err)
            return 2
    try:
        window = Window(parse_time(since) if since else None, parse_time(until) if until else None)
    except ValueError as e:
        print(f"stagetrace report: {e}", file=err)
        return 2
    sides = [facts_from_files([side], slow_threshold_ms, err, route, window=window)[0] for side in (before, after)]
    empty = [label for label, side in zip((before, after), sides) if not side.seen]
    if empty:
        print(f"stagetrace report: no traces to compare in {', '.join(empty)}", file=err)
        return 2
    comparison = compare(sides[0], sides[1], before_label=before, after_label=after, resamples=resamples)
    _emit_comparison(comparison, as_json=as_json, html_path=html_path, out=out, err=err)
    return 0


def parse_window(text: str) -> tuple[int | None, int | None]:
    """``SINCE..UNTIL`` (either may be empty) as epoch ns; ValueError saying what it accepts."""
    from stagetrace.report.fleet import parse_time

    since, sep, until = text.partition("..")
    if not sep:
        raise ValueError(f"cannot read window {text!r}: use SINCE..UNTIL, e.g. 2h..1h or 2026-12-01T10:00..")
    return (parse_time(since) if since.strip() else None, parse_time(until) if until.strip() else None)


def run_clickhouse_compare(
    url: str,
    before: str,
    after: str,
    *,
    database: str | None = None,
    table: str | None = None,
    service: str | None = None,
    group_by: str | None = None,
    resamples: int = 1000,
    as_json: bool = False,
    html_path: str | None = None,
    slow_threshold_ms: float = DEFAULT_SLOW_THRESHOLD_MS,
    route: str | None = None,
    since: str | None = None,
    until: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``--compare`` where a fleet keeps its traces: two windows (``SINCE..UNTIL``), or with ``--group-by``
    two values of that resource attribute (within ``--since``/``--until``)."""
    from stagetrace.report.clickhouse import ClickHouseError, connect, facts_from_clickhouse
    from stagetrace.report.fleet import Filters, Source, parse_time
    from stagetrace.report.otel_schema import DEFAULT_DATABASE, DEFAULT_TRACES_TABLE

    out, err = out or sys.stdout, err or sys.stderr
    sides: list[tuple[Filters, str | None]]
    try:
        if group_by:
            window = (parse_time(since) if since else None, parse_time(until) if until else None)
            sides = [(Filters(*window, service, route, group_by), value) for value in (before, after)]
        else:
            if since or until:
                raise ValueError("with --compare, each side is its own window (SINCE..UNTIL): no --since/--until")
            sides = [(Filters(*parse_window(side), service, route), None) for side in (before, after)]
    except ValueError as e:
        print(f"stagetrace report: {e}", file=err)
        return 2
    source = Source(database or DEFAULT_DATABASE, table or DEFAULT_TRACES_TABLE)
    try:
        conn = connect(url)
    except (ClickHouseError, RuntimeError) as e:
        print(f"stagetrace report: {e}", file=err)
        return 2
    try:
        facts = [facts_from_clickhouse(conn, source, f, group, slow_threshold_ms, err) for f, group in sides]
    except ClickHouseError as e:
        print(f"stagetrace report: {e}", file=err)
        return 2
    finally:
        conn.close()
    labels = [f"{group_by}={v}" if group_by else f"window {v}" for v in (before, after)]
    empty = [label for label, side in zip(labels, facts) if not side.seen]
    if empty:
        print(f"stagetrace report: no traces to compare in {', '.join(empty)} of {source}", file=err)
        return 2
    comparison = compare(facts[0], facts[1], before_label=labels[0], after_label=labels[1], resamples=resamples)
    _emit_comparison(comparison, as_json=as_json, html_path=html_path, out=out, err=err)
    return 0
