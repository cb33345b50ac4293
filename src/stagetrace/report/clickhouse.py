"""``stagetrace report --clickhouse URL``: the report over the trace table of the OpenTelemetry Collector's
ClickHouse exporter, aggregated where the traces are (HTA's split: this module loads, ``report.fleet``
builds the SQL and folds its answers, ``report.aggregate`` and ``report.render`` are the file report's).

``URL`` is ``http(s)://[user:password@]host:port`` (a ClickHouse server, through clickhouse-connect) or
``chdb:PATH`` (a chDB database directory, the same engine in this process). Both clients are the optional
extra ``stagetrace[clickhouse]``, imported only here, when such a report runs.

Python's memory does not grow with the table: ClickHouse sends back per-bucket counts, the slowest few
traces and, for traces without a stored verdict, their spans one trace at a time.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol, TextIO

from stagetrace.report.aggregate import Aggregator, StreamsSummary
from stagetrace.report.collect import add_trace, judge_trace, trace_facts
from stagetrace.report.compare import Side, TraceFacts
from stagetrace.report.fleet import (
    Census,
    Filters,
    GroupReport,
    Source,
    StagePlaces,
    VerdictRow,
    candidate_tables_sql,
    census_from_row,
    census_sql,
    columns_sql,
    fact_row,
    facts_sql,
    fold_facts,
    kinds_sql,
    order_stages,
    recompute_sql,
    slowest_sql,
    spans_sql,
    verdicts_sql,
)
from stagetrace.report.loader import Span
from stagetrace.report.otel_schema import exporter_rows, schema_problems, span_from_row
from stagetrace.report.sketch import QuantileSketch
from stagetrace.report.traces import adjusted_count, global_root, verdict_for_trace, waterfall
from stagetrace.settings import DEFAULT_SLOW_THRESHOLD_MS

EXTRA = "clickhouse"
FORMAT = "JSONCompactEachRow"  # one JSON array a row, the same bytes from chDB and from a server


class ClickHouseError(Exception):
    """Why the report cannot read the table, in one line a person can act on (no traceback)."""


class Connection(Protocol):
    """SQL in, the answer as JSONCompactEachRow bytes in chunks of whole or partial lines; ``execute`` for
    statements that answer nothing (DDL, INSERT with its data inline)."""

    def stream(self, sql: str) -> Iterator[bytes]: ...

    def execute(self, sql: str) -> None: ...

    def close(self) -> None: ...


# What a connection failure's long text (urllib3's, through clickhouse-connect) comes down to.
_NETWORK_REASONS = (
    (re.compile(r"Connection refused", re.I), "connection refused (is ClickHouse listening there?)"),
    (re.compile(r"Name or service not known|nodename nor servname|getaddrinfo failed", re.I), "unknown host"),
    (re.compile(r"timed out", re.I), "timed out"),
)


def _reason(error: BaseException) -> str:
    """The first line of a client's or server's error, without the stack trace ClickHouse appends."""
    text = str(error).strip() or type(error).__name__
    for pattern, reason in _NETWORK_REASONS:
        if pattern.search(text):
            return reason
    return text.splitlines()[0][:400]


class ChdbConnection:
    """A chDB session on a database directory (one directory per process: chDB's embedded server)."""

    def __init__(self, path: str) -> None:
        from stagetrace.integrations._common import require

        if not os.path.isdir(os.path.join(path, "metadata")):
            raise ClickHouseError(f"{path} is not a chDB database directory (it has no metadata/ folder)")
        session = require("chdb.session", "stagetrace report --clickhouse chdb:PATH", EXTRA)
        try:
            self._session = session.Session(path)
        except Exception as e:  # chDB raises RuntimeError subclasses with the engine's message
            raise ClickHouseError(f"cannot open chDB database {path}: {_reason(e)}") from None

    def stream(self, sql: str) -> Iterator[bytes]:
        try:
            with self._session.send_query(sql, FORMAT) as result:
                for chunk in result:
                    yield chunk.bytes()
        except Exception as e:
            raise ClickHouseError(f"query failed: {_reason(e)}") from None

    def execute(self, sql: str) -> None:
        try:
            self._session.query(sql)
        except Exception as e:
            raise ClickHouseError(f"statement failed: {_reason(e)}") from None

    def close(self) -> None:
        self._session.close()


class HttpConnection:
    """A ClickHouse server over HTTP(S) through clickhouse-connect (uncompressed: the answers are small)."""

    def __init__(self, url: str, *, timeout_s: float = 10.0) -> None:
        from stagetrace.integrations._common import require

        clickhouse_connect = require("clickhouse_connect", "stagetrace report --clickhouse http(s)://...", EXTRA)
        logging.getLogger("clickhouse_connect").addHandler(logging.NullHandler())  # errors come back as ours
        try:
            self._client = clickhouse_connect.get_client(
                dsn=url, compress=False, connect_timeout=timeout_s, send_receive_timeout=300
            )
        except Exception as e:  # OperationalError (unreachable), DatabaseError (authentication), ValueError (URL)
            raise ClickHouseError(f"cannot connect to ClickHouse at {_safe_url(url)}: {_reason(e)}") from None

    def stream(self, sql: str) -> Iterator[bytes]:
        try:
            stream = self._client.raw_stream(sql, fmt=FORMAT)  # no settings: a readonly=1 user may read
            try:
                yield from stream
            finally:
                stream.close()
        except Exception as e:
            raise ClickHouseError(f"query failed: {_reason(e)}") from None

    def execute(self, sql: str) -> None:
        try:
            self._client.command(sql)
        except Exception as e:
            raise ClickHouseError(f"statement failed: {_reason(e)}") from None

    def close(self) -> None:
        self._client.close()


def _safe_url(url: str) -> str:
    """The URL without its password, for messages."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        user = rest.split("@", 1)[0].split(":", 1)[0]
        rest = f"{user}:***@{rest.split('@', 1)[1]}"
    return scheme + sep + rest


def connect(url: str) -> Connection:
    """A connection for ``chdb:PATH`` or ``http(s)://...``; ClickHouseError when it cannot be had."""
    if url.startswith("chdb:"):
        path = url[len("chdb:") :]
        return ChdbConnection(path[2:] if path.startswith("//") else path)
    if url.startswith(("http://", "https://")):
        return HttpConnection(url)
    raise ClickHouseError(f"unsupported ClickHouse URL {url!r}: use http(s)://host:8123 or chdb:PATH")


def rows(conn: Connection, sql: str) -> Iterator[list[Any]]:
    """The answer's rows, decoded line by line as the chunks arrive."""
    pending = b""
    for chunk in conn.stream(sql):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
    if pending.strip():
        yield json.loads(pending)


def check_table(conn: Connection, source: Source) -> None:
    """ClickHouseError unless ``source`` is a trace table of the exporter's schema the report can read."""
    columns = {str(name): str(kind) for name, kind in rows(conn, columns_sql(source))}
    if not columns:
        found = [f"{db}.{table}" for db, table in rows(conn, candidate_tables_sql())]
        hint = f"tables with a SpanAttributes column: {', '.join(found)}" if found else "no table has one"
        raise ClickHouseError(
            f"no table {source} (the exporter's `database` and `traces_table_name`: --database, --traces-table); {hint}"
        )
    problems = schema_problems(columns)
    if problems:
        raise ClickHouseError(
            f"{source} is not a trace table of the OpenTelemetry Collector's ClickHouse exporter in a schema "
            f"this report reads: {'; '.join(problems)}"
        )


def _traces(span_rows: Iterable[Sequence[Any]]) -> Iterator[tuple[list[Span], dict[str, str]]]:
    """Rows ordered by trace (``fleet.SPAN_COLUMNS`` plus the group value) as one trace at a time, with each
    span's group value by span id."""
    spans: list[Span] = []
    group_of: dict[str, str] = {}
    for row in span_rows:
        span = span_from_row(*row[:13])
        if spans and span.trace_id != spans[0].trace_id:
            yield spans, group_of
            spans, group_of = [], {}
        spans.append(span)
        group_of[span.span_id] = str(row[13] or "")
    if spans:
        yield spans, group_of


@dataclass
class FleetReport:
    """What ``aggregate_clickhouse`` found: the whole, each group, and what it read, recomputed and skipped."""

    source: Source
    filters: Filters
    census: Census
    overall: Aggregator
    groups: dict[str, GroupReport]
    recomputed: int = 0
    skipped_roots: int = 0
    notes: list[str] = field(default_factory=list)

    def example_traces(self) -> dict[str, str]:
        """Per diagnosis, the slowest trace that has it, across groups."""
        return {code: trace_id for code, (_, trace_id, _) in _best_examples(self.groups).items()}

    def group_summaries(self) -> dict[str, dict[str, Any]]:
        """Each group's summary (the file report's shape, without waterfalls) with its slowest trace and the
        slowest trace of each of its diagnoses, by group value."""
        out = {}
        for value in sorted(self.groups):
            g = self.groups[value]
            summary = {k: v for k, v in g.aggregator.summary().items() if k != "slowest"}
            summary["slowest_trace"] = g.slowest[1] or None
            summary["example_traces"] = g.example_traces()
            out[value] = summary
        return out

    def input_counts(self) -> dict[str, Any]:
        n = self.census
        verdicts = sum(g.aggregator.traces for g in self.groups.values()) - self.recomputed
        return {
            "source": str(self.source),
            "spans": n.spans,
            "traces_from_stored_verdicts": verdicts,
            "traces_recomputed_from_spans": self.recomputed,
            "batch_executions": n.batch_roots,
            "root_spans_without_stagetrace": self.skipped_roots,
        }


def aggregate_clickhouse(
    conn: Connection,
    source: Source,
    filters: Filters,
    slow_threshold_ms: float = DEFAULT_SLOW_THRESHOLD_MS,
    err: TextIO | None = None,
    keep_slowest: int = 10,
) -> FleetReport:
    """The report of the traces in ``source`` that ``filters`` select, one ``Aggregator`` per group."""
    err = err or sys.stderr
    check_table(conn, source)
    (census_row,) = rows(conn, census_sql(source, filters))  # one row: the whole answer read
    census = census_from_row(census_row)
    sketch = QuantileSketch()
    fact_rows = rows(
        conn, facts_sql(source, filters, sketch, batches=census.batch_roots > 0, waits=census.batch_waits > 0)
    )
    groups = fold_facts(fact_row(r) for r in fact_rows)
    recomputed, rooted = 0, 0
    if census.nested_verdicts or census.stage_spans:
        recomputed, rooted = _recompute(conn, source, filters, groups, slow_threshold_ms, err)
    names = sorted({name for g in groups.values() for name in g.aggregator.stages})
    kinds = {str(name): str(kind) for name, kind in rows(conn, kinds_sql(source, filters, names))} if names else {}
    overall, places = Aggregator(keep_slowest), StagePlaces()
    streamed: float = 0
    for g in groups.values():
        # The SQL does not aggregate streams yet: a stream section of the recomputed traces alone would
        # misstate the fleet, so there is none (the report says so).
        streamed += g.aggregator.streams.streams
        g.aggregator.streams = StreamsSummary()
        order_stages(g.aggregator, g.places, kinds)
        overall.merge(g.aggregator)
        places.merge(g.places)
    order_stages(overall, places, kinds)
    for code, (_, _, value) in _best_examples(groups).items():  # the message of the example shown
        message = groups[value].aggregator.messages.get(code)
        if message is not None:
            overall.messages[code] = message
    _add_slowest(conn, source, filters, overall, slow_threshold_ms, keep_slowest)
    report = FleetReport(source, filters, census, overall, groups, recomputed)
    report.skipped_roots = max(0, census.roots - census.verdict_roots - census.batch_roots - rooted)
    report.notes = _notes(report)
    if streamed:
        report.notes.append("streamed responses are summarised by the file report only (no stream section here)")
    return report


def facts_from_clickhouse(
    conn: Connection,
    source: Source,
    filters: Filters,
    group: str | None = None,
    slow_threshold_ms: float = DEFAULT_SLOW_THRESHOLD_MS,
    err: TextIO | None = None,
    max_traces: int = 20_000,
) -> Side:
    """One side of a comparison: each trace's facts, from its stored verdict (one row a trace) or, where it
    has none on its root, from its spans; ``group``: only traces of that value of ``filters.group_by``."""
    err = err or sys.stderr
    check_table(conn, source)
    side = Side(max_traces=max_traces)
    for raw in rows(conn, verdicts_sql(source, filters)):
        row = VerdictRow(*raw)
        if group is not None and str(row.grp or "") != group:
            continue
        stages = {str(n): float(v) for n, v in zip(row.names, row.values)}
        codes = tuple(str(code) for code in row.codes or ())
        side.add(TraceFacts(float(row.total), stages, str(row.bottleneck) or None, codes, float(row.w)))
    for spans, group_of in _traces(rows(conn, recompute_sql(source, filters))):
        if group is not None and group_of.get(global_root(spans).span_id, "") != group:
            continue
        verdict = judge_trace(spans, slow_threshold_ms, err, filters.route)
        if verdict is not None:
            side.add(trace_facts(verdict, adjusted_count(spans)))
    return side


def _best_examples(groups: dict[str, GroupReport]) -> dict[str, tuple[float, str, str]]:
    """Per diagnosis: (total ms, trace id, group) of the slowest trace with it."""
    best: dict[str, tuple[float, str, str]] = {}
    for value, g in groups.items():
        for code, (total, trace_id) in g.examples.items():
            best[code] = max(best.get(code, (total, trace_id, value)), (total, trace_id, value))
    return best


def _recompute(
    conn: Connection,
    source: Source,
    filters: Filters,
    groups: dict[str, GroupReport],
    slow_threshold_ms: float,
    err: TextIO,
) -> tuple[int, int]:
    """Traces without a stored verdict on their root, judged from their spans by the file report's code;
    returns (traces counted, traces read that have a root span)."""
    counted, rooted = 0, 0
    for spans, group_of in _traces(rows(conn, recompute_sql(source, filters))):
        group = group_of.get(global_root(spans).span_id, "")
        g = groups.get(group)
        if g is None:
            g = groups[group] = GroupReport()
        rooted += any(not s.parent_span_id for s in spans)  # a stagetrace trace, whatever its route
        verdict = add_trace(g.aggregator, spans, slow_threshold_ms, err, filters.route, batches=True)
        if verdict is None:
            continue
        counted += 1
        for place, stage in enumerate(verdict.breakdown, 1):
            g.places.add(stage, place, 1)
        g.slowest = max(g.slowest, (verdict.total_ms, verdict.trace_id))
        for code in verdict.diagnosis_codes:
            if (verdict.total_ms, verdict.trace_id) > g.examples.get(code, (float("-inf"), "")):
                g.examples[code] = (verdict.total_ms, verdict.trace_id)
    return counted, rooted


def _add_slowest(
    conn: Connection, source: Source, filters: Filters, agg: Aggregator, slow_threshold_ms: float, keep: int
) -> None:
    """The slowest traces with stored verdicts, read whole (their verdict and waterfall for the page)."""
    ids = [str(trace_id) for trace_id, _ in rows(conn, slowest_sql(source, filters, keep))]
    if not ids:
        return
    for spans, _ in _traces(rows(conn, spans_sql(source, filters, ids))):
        verdict = verdict_for_trace(spans, slow_threshold_ms)
        agg.keep_if_slowest(verdict, waterfall(spans))


def _notes(report: FleetReport) -> list[str]:
    """What a reader should know about the input: nothing there, nothing of stagetrace's, what was skipped."""
    n, notes = report.census, []
    window = _window_text(report.filters)
    if n.spans == 0:
        notes.append(f"no spans in {report.source}{window}")
    elif not (n.verdict_roots or n.nested_verdicts or n.stage_spans or n.batch_roots):
        notes.append(
            f"none of the {n.spans} spans in {report.source}{window} carries stagetrace's attributes "
            "(stagetrace.total_ms on a root, stagetrace.stage on a stage): is the service exporting through "
            "this Collector, with stagetrace configured?"
        )
    if report.skipped_roots:
        notes.append(
            f"skipped {report.skipped_roots} traces whose root span has no stagetrace verdict and whose spans "
            "have no stagetrace stages (other services' traces)"
        )
    return notes


def _window_text(filters: Filters) -> str:
    def fmt(ns: int) -> str:
        return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat(timespec="seconds")

    parts = []
    if filters.since_ns is not None:
        parts.append(f" since {fmt(filters.since_ns)}")
    if filters.until_ns is not None:
        parts.append(f" until {fmt(filters.until_ns)}")
    if filters.service is not None:
        parts.append(f" for service {filters.service}")
    return "".join(parts)


# --- loading OTLP JSON lines into the exporter's table (tests, benchmarks, trying the report on files) ----


def insert_otlp_lines(
    conn: Connection,
    source: Source,
    lines: Iterable[str],
    *,
    batch_rows: int = 5000,
    transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> int:
    """Insert stagetrace's OTLP JSON lines as the exporter would (its rows, ``otel_schema.exporter_rows``);
    ``transform`` may change each row first (tests give spans a resource attribute). Returns rows inserted."""
    batch: list[str] = []
    inserted = 0

    def flush() -> None:
        if batch:
            conn.execute(f"INSERT INTO {source.sql} FORMAT JSONEachRow\n" + "\n".join(batch))
            batch.clear()

    for line in lines:
        if not line.strip():
            continue
        for row in exporter_rows(json.loads(line)):
            batch.append(json.dumps(transform(row) if transform else row))
            inserted += 1
            if len(batch) >= batch_rows:
                flush()
    flush()
    return inserted
