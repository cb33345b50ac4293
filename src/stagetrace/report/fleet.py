"""The report's aggregation as SQL over the ClickHouse exporter's trace table, and the folding of what comes
back into the file report's ``Aggregator``s, one per group. Pure: SQL text out, rows in; the connection and
the order of the queries live in ``report.clickhouse``.

What runs in ClickHouse: every trace whose root span carries stagetrace's verdict (what stagetrace's
exporter writes on every kept trace) is read from that one row: its stages and their times, bottleneck,
diagnoses, GPU utilisation. Those rows become *facts* (one per trace, stage, bottleneck, diagnosis) that
ClickHouse groups and counts: each latency fact is counted into the bucket of the report's quantile sketch
(``QuantileSketch.bucket_key``, computed in SQL), so what comes back is a few rows per stage and bucket,
whatever the number of traces, and the quantiles are read by the same code as the file report's.

Traces without such a root (a verdict on a span that has a parent: a service called by another; or stage
spans without any verdict, from another SDK) are what the file report recomputes from the spans; their
spans are streamed back, one trace at a time, to the same Python analysis (``report.traces``).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any, NamedTuple

from stagetrace import conventions as c
from stagetrace.report.aggregate import Aggregator, BatchSummary, BatchWaitSummary
from stagetrace.report.otel_schema import DEFAULT_DATABASE, DEFAULT_TRACES_TABLE
from stagetrace.report.sketch import ZERO_BELOW, Bucket, QuantileSketch

NO_GROUP = ""  # the group of every trace when the report is not grouped, and of traces without the attribute
# Spans of one trace may start a little before or after its root's window (a child after the root's start,
# a root just before the window's start for a child inside it): trace-wide reads widen the window by this.
TRACE_SLACK_NS = 3600 * 1_000_000_000


@dataclass(frozen=True)
class Source:
    """Where the traces are: the exporter's ``database`` and ``traces_table_name`` options."""

    database: str = DEFAULT_DATABASE
    table: str = DEFAULT_TRACES_TABLE

    @property
    def sql(self) -> str:
        return f"{quote_identifier(self.database)}.{quote_identifier(self.table)}"

    def __str__(self) -> str:
        return f"{self.database}.{self.table}"


@dataclass(frozen=True)
class Filters:
    """Which traces: roots starting in [since, until) (epoch ns, open when None), of one service (the
    exporter's ServiceName), one route (``http.route`` on the root); grouped by a resource attribute."""

    since_ns: int | None = None
    until_ns: int | None = None
    service: str | None = None
    route: str | None = None
    group_by: str | None = None


# --- SQL text ---------------------------------------------------------------------------------------------


def quote_string(value: str) -> str:
    """A ClickHouse string literal (backslash and quote escaped): values go into the SQL text, so one
    code path serves both clients (chDB's and clickhouse-connect's parameter binding differ)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def quote_identifier(name: str) -> str:
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


def _has(key: str) -> str:
    return f"mapContains(SpanAttributes, {quote_string(key)})"


def _attr(key: str) -> str:
    return f"SpanAttributes[{quote_string(key)}]"


def _conditions(filters: Filters, *, slack_ns: int = 0, service: bool = True) -> list[str]:
    out = []
    if filters.since_ns is not None:
        out.append(f"Timestamp >= fromUnixTimestamp64Nano(toInt64({int(filters.since_ns) - slack_ns}))")
    if filters.until_ns is not None:
        out.append(f"Timestamp < fromUnixTimestamp64Nano(toInt64({int(filters.until_ns) + slack_ns}))")
    if service and filters.service is not None:
        out.append(f"ServiceName = {quote_string(filters.service)}")
    return out


def _where(*conditions: str | list[str]) -> str:
    flat = [x for cond in conditions for x in ([cond] if isinstance(cond, str) else cond)]
    return "WHERE " + " AND ".join(flat) if flat else ""


def group_expression(filters: Filters) -> str:
    return f"ResourceAttributes[{quote_string(filters.group_by)}]" if filters.group_by else quote_string(NO_GROUP)


def bucket_expression(value: str, sketch: QuantileSketch) -> str:
    """``QuantileSketch.bucket_key`` in SQL (``log`` is the natural logarithm in both); NULL for zeros."""
    return f"if({value} <= {ZERO_BELOW!r}, NULL, toInt32(ceil(log({value}) / {sketch.log_gamma!r})))"


def columns_sql(source: Source) -> str:
    return (
        f"SELECT name, type FROM system.columns WHERE database = {quote_string(source.database)} "
        f"AND table = {quote_string(source.table)}"
    )


def candidate_tables_sql() -> str:
    """Tables that look like an exporter's trace table, to name in the error for a wrong one."""
    return (
        "SELECT database, table FROM system.columns WHERE name = 'SpanAttributes' "
        "GROUP BY database, table ORDER BY database, table LIMIT 20"
    )


class Census(NamedTuple):
    """What the window holds, in one pass over its spans' attribute keys: the plan of the report and the
    counts it prints."""

    spans: int
    roots: int
    verdict_roots: int
    nested_verdicts: int  # verdicts on spans with a parent: traces the report recomputes from their spans
    batch_roots: int
    batch_waits: int
    stage_spans: int
    first_ns: int
    last_ns: int


def census_sql(source: Source, filters: Filters) -> str:
    root = "ParentSpanId = ''"
    return f"""SELECT count(), countIf({root}), countIf({root} AND {_has(c.TOTAL_MS)}),
  countIf(NOT ({root}) AND {_has(c.TOTAL_MS)}), countIf({root} AND {_has(c.BATCH_ID)}),
  countIf({_has(c.BATCH_FORMATION_MS)}), countIf({_has(c.STAGE)}),
  toString(toUnixTimestamp64Nano(min(Timestamp))), toString(toUnixTimestamp64Nano(max(Timestamp)))
FROM {source.sql} {_where(_conditions(filters))}"""


def census_from_row(row: Sequence[Any]) -> Census:
    return Census(*(int(x or 0) for x in row))


def verdicts_sql(source: Source, filters: Filters) -> str:
    """One row per trace read from its stored verdict: roots carrying ``stagetrace.total_ms`` in the window,
    less traces that also have a verdict on a span with a parent (those are recomputed from their spans,
    as the file report does). ``total`` falls back to the root's duration like ``traces._stored_verdict``."""
    total = f"toFloat64OrZero({_attr(c.TOTAL_MS)})"
    adjusted = f"toFloat64OrZero({_attr(c.SAMPLING_ADJUSTED_COUNT)})"  # the requests the trace stands for
    route = [f"{_attr(c.HTTP_ROUTE)} = {quote_string(filters.route)}"] if filters.route is not None else []
    wide = _conditions(filters, slack_ns=TRACE_SLACK_NS)
    nested = f"SELECT TraceId FROM {source.sql} {_where(_has(c.TOTAL_MS), f'ParentSpanId != {EMPTY}', wide)}"
    diagnosis_events = (
        f"arrayFilter((a, n) -> n = {quote_string(c.DIAGNOSIS_EVENT)}, `Events.Attributes`, `Events.Name`)"
    )
    return f"""SELECT TraceId AS trace_id, {group_expression(filters)} AS grp,
  if({total} != 0, {total}, Duration / 1e6) AS total,
  {_attr(c.SLOW)} = 'true' AS slow,
  {_attr(c.SLOW_REASON)} AS slow_reason,
  JSONExtract({_attr(c.STAGES)}, 'Array(String)') AS names_all,
  JSONExtract({_attr(c.STAGES_MS)}, 'Array(Float64)') AS values_all,
  least(length(names_all), length(values_all)) AS n_stages,
  arraySlice(names_all, 1, n_stages) AS names,
  arraySlice(values_all, 1, n_stages) AS values,
  {_attr(c.BOTTLENECK_STAGE)} AS bottleneck,
  if({adjusted} > 0, {adjusted}, 1.) AS w,
  ifNull(toFloat64OrNull({_attr(c.DIAGNOSIS_SAMPLE_RATE)}), 1.) AS diagnosis_rate,
  toFloat64OrNull({_attr(c.GPU_UTILIZATION)}) AS gpu,
  JSONExtract({_attr(c.DIAGNOSIS)}, 'Array(String)') AS codes,
  {diagnosis_events} AS diagnosis_events
FROM {source.sql}
{_where(_has(c.TOTAL_MS), "ParentSpanId = ''", _conditions(filters), route, f"TraceId NOT IN ({nested})")}"""


class VerdictRow(NamedTuple):
    """A row of ``verdicts_sql``, its columns in order."""

    trace_id: str
    grp: str
    total: float
    slow: bool
    slow_reason: str
    names_all: list[str]
    values_all: list[float]
    n_stages: int
    names: list[str]
    values: list[float]
    bottleneck: str
    w: float
    diagnosis_rate: float
    gpu: float | None
    codes: list[str]
    diagnosis_events: list[Any]


EMPTY = "''"
FACT_TYPE = "Tuple(String, String, Float64, Float64, UInt8, UInt32, Tuple(String, String))"


def _fact(
    kind: str, name: str, value: str, share: str = "0", bottleneck: str = "0", pos: str = "0", example: str = ""
) -> str:
    """One fact as a typed tuple: (kind, name, value, share of the trace, is the bottleneck, position in the
    pipeline, (trace id, message) to show as its example)."""
    example = example or f"(trace_id, {EMPTY})"
    fields = f"{quote_string(kind)}, {name}, {value}, {share}, {bottleneck}, {pos}, {example}"
    return f"CAST(({fields}), {quote_string(FACT_TYPE)})"


# Facts whose value goes into a quantile sketch (the others are only counted).
SKETCHED = ("trace", "gpu", "stage", "batch.size", "batch.fill", "wait.formation", "wait.busy")


def facts_sql(source: Source, filters: Filters, sketch: QuantileSketch, *, batches: bool, waits: bool) -> str:
    """Every fact of the window, grouped by (group, fact, name, sketch bucket) with the weighted count (each
    trace's adjusted count), weighted sum, min, max, weighted share sum and bottleneck count, sum of
    positions in the pipeline, the slowest example (trace id, message) and the unweighted count: a few rows
    per stage and bucket, however many traces there are. Batch executions and batch waits weigh 1."""
    message = (
        f"arrayFirst(a -> a[{quote_string(c.DIAGNOSIS_EVENT_CODE)}] = x, diagnosis_events)"
        f"[{quote_string(c.DIAGNOSIS_EVENT_MESSAGE)}]"
    )
    share = "if(total > 0, least(1., ms / total), 0.)"
    verdict_facts = f"""SELECT grp, trace_id, w, arrayJoin(arrayConcat(
    [{_fact("trace", EMPTY, "total")}],
    if(slow, [{_fact("slow", "slow_reason", "total")}], []),
    if(isNull(gpu), [], [{_fact("gpu", EMPTY, "assumeNotNull(gpu)")}]),
    if(bottleneck = '', [], [{_fact("bottleneck", "bottleneck", "total")}]),
    if(diagnosis_rate < 1, [{_fact("diagnosis.rate", EMPTY, "diagnosis_rate")}], []),
    arrayMap(x -> {_fact("diagnosis", "x", "total", example=f"(trace_id, {message})")}, codes),
    arrayMap((x, ms, i) -> {_fact("stage", "x", "ms", share, "x = bottleneck", "i")},
      names, values, arrayEnumerate(names))
  )) AS f FROM ({verdicts_sql(source, filters)})"""
    parts = [verdict_facts]
    group = group_expression(filters)
    if batches:  # a batch's own trace: its root is the batch span (traces.is_batch_trace)
        size = f"ifNull(toInt64OrNull({_attr(c.BATCH_SIZE)}), 0)"
        fill = f"toFloat64OrNull({_attr(c.BATCH_FILL)})"
        parts.append(
            f"""SELECT {group} AS grp, TraceId AS trace_id, 1. AS w, arrayJoin(arrayConcat(
    [{_fact("batch.size", "SpanName", size)}],
    if(isNull({fill}), [], [{_fact("batch.fill", "SpanName", f"assumeNotNull({fill})")}]))) AS f
  FROM {source.sql} {_where(_has(c.BATCH_ID), "ParentSpanId = ''", _conditions(filters))}"""
        )
    if waits:  # batch waits of the traces read from stored verdicts (recomputed traces add their own)
        wide = _conditions(filters, slack_ns=TRACE_SLACK_NS, service=False)
        stage = f"if({_has(c.STAGE)}, {_attr(c.STAGE)}, SpanName)"
        formation = f"toFloat64OrNull({_attr(c.BATCH_FORMATION_MS)})"
        busy = f"ifNull(toFloat64OrNull({_attr(c.BATCH_BUSY_MS)}), 0.)"
        parts.append(
            f"""SELECT {group} AS grp, TraceId AS trace_id, 1. AS w, arrayJoin([
    {_fact("wait.formation", stage, f"assumeNotNull({formation})")},
    {_fact("wait.busy", stage, busy)}]) AS f
  FROM {source.sql} {_where(_has(c.BATCH_FORMATION_MS), f"isNotNull({formation})", wide)}
  AND TraceId IN (SELECT trace_id FROM ({verdicts_sql(source, filters)}))"""
        )
    sketched = ", ".join(quote_string(k) for k in SKETCHED)
    value = "f.3"
    return f"""SELECT grp, f.1 AS fact, f.2 AS name,
  if(fact IN ({sketched}), {bucket_expression(value, sketch)}, NULL) AS bucket,
  sum(w), sum({value} * w), min({value}), max({value}), sum(f.4 * w), sum(f.5 * w), sum(f.6), argMax(f.7, {value}),
  max({value}), count()
FROM ({" UNION ALL ".join(parts)})
GROUP BY grp, fact, name, bucket"""


def slowest_sql(source: Source, filters: Filters, keep: int) -> str:
    return f"SELECT trace_id, total FROM ({verdicts_sql(source, filters)}) ORDER BY total DESC LIMIT {int(keep)}"


def kinds_sql(source: Source, filters: Filters, stages: Iterable[str]) -> str:
    """The kind of each stage from one of its spans: a stage span is named after its stage, and the table
    is ordered by span name, so each ``LIMIT 1`` reads a granule or so instead of every stage span."""
    wide = _conditions(filters, slack_ns=TRACE_SLACK_NS)
    selects = [
        f"(SELECT {quote_string(name)}, {_attr(c.STAGE_KIND)} FROM {source.sql} "
        f"{_where(f'SpanName = {quote_string(name)}', f'{_attr(c.STAGE)} = {quote_string(name)}', wide)} LIMIT 1)"
        for name in stages
    ]
    return " UNION ALL ".join(selects)


SPAN_COLUMNS = """TraceId, SpanId, ParentSpanId, SpanName, SpanKind, ServiceName,
  toString(toUnixTimestamp64Nano(Timestamp)), toString(Duration), SpanAttributes, `Events.Name`, `Events.Attributes`,
  `Links.TraceId`, `Links.SpanId`"""


def spans_sql(source: Source, filters: Filters, trace_ids: Sequence[str]) -> str:
    """Every span of a few traces (the examples), with each span's group value last."""
    ids = ", ".join(quote_string(t) for t in trace_ids) or "''"
    return f"""SELECT {SPAN_COLUMNS}, {group_expression(filters)} FROM {source.sql}
{_where(f"TraceId IN ({ids})", _conditions(filters, slack_ns=TRACE_SLACK_NS, service=False))} ORDER BY TraceId"""


def recompute_sql(source: Source, filters: Filters) -> str:
    """Every span of the traces the report recomputes from spans, ordered by trace: those with a verdict on
    a span with a parent, and those with stage spans but no verdict at all (and not a batch's own trace)."""
    wide = _conditions(filters, slack_ns=TRACE_SLACK_NS, service=False)
    judged = f"{_has(c.TOTAL_MS)} OR ({_has(c.BATCH_ID)} AND ParentSpanId = {EMPTY})"
    nested_verdict = _where(_has(c.TOTAL_MS), f"ParentSpanId != {EMPTY}", _conditions(filters))
    nested = f"SELECT TraceId FROM {source.sql} {nested_verdict}"
    unjudged = (
        f"SELECT TraceId FROM {source.sql} {_where(_has(c.STAGE), _conditions(filters))} "
        f"AND TraceId NOT IN (SELECT TraceId FROM {source.sql} {_where(judged, wide)})"
    )
    candidates = f"{nested} UNION DISTINCT {unjudged}"
    return f"""SELECT {SPAN_COLUMNS}, {group_expression(filters)} FROM {source.sql}
{_where(f"TraceId IN ({candidates})", wide)} ORDER BY TraceId"""


# --- rows -> aggregators ----------------------------------------------------------------------------------


class FactRow(NamedTuple):
    group: str
    fact: str
    name: str
    bucket: int | None
    n: float  # facts in the row, weighted by their traces' adjusted counts
    total: float
    low: float
    high: float
    share: float
    bottlenecks: float
    positions: int  # sum of the stage's 1-based places in its traces' breakdowns
    example: tuple[str, str]  # (trace id, message) of the fact's largest value
    largest: float
    kept: int  # facts in the row, unweighted (the kept traces)


class StagePlaces:
    """Where each stage sits in the pipeline, on average over the traces that ran it: the order of the
    stage tables. (The file report lists stages as it first meets them, which for a fixed pipeline is the
    same order; a stage that runs at different places, like event_loop.wait, sits at its usual place.)"""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[int, int]] = {}

    def add(self, stage: str, places: int, traces: int) -> None:
        total, n = self._sums.get(stage, (0, 0))
        self._sums[stage] = (total + places, n + traces)

    def merge(self, other: StagePlaces) -> None:
        for stage, (total, n) in other._sums.items():
            self.add(stage, total, n)

    def order(self, stages: Iterable[str]) -> list[str]:
        def mean(stage: str) -> float:
            total, n = self._sums.get(stage, (0, 0))
            return total / n if n else math.inf

        return sorted(stages, key=lambda stage: (mean(stage), stage))


@dataclass
class GroupReport:
    """One group's aggregate and its examples: the slowest trace, and the slowest trace of each diagnosis."""

    aggregator: Aggregator = field(default_factory=Aggregator)
    slowest: tuple[float, str] = (-math.inf, "")
    examples: dict[str, tuple[float, str]] = field(default_factory=dict)
    places: StagePlaces = field(default_factory=StagePlaces)

    def example_traces(self) -> dict[str, str]:
        return {code: trace_id for code, (_, trace_id) in self.examples.items()}


def fact_row(row: Sequence[Any]) -> FactRow:
    example = row[11] or ("", "")
    return FactRow(
        str(row[0] or ""),
        str(row[1]),
        str(row[2] or ""),
        None if row[3] is None else int(row[3]),
        float(row[4] or 0.0),
        float(row[5] or 0.0),
        float(row[6] if row[6] is not None else 0.0),
        float(row[7] if row[7] is not None else 0.0),
        float(row[8] or 0.0),
        float(row[9] or 0.0),
        int(row[10] or 0),
        (str(example[0]), str(example[1])),
        float(row[12] if row[12] is not None else 0.0),
        int(row[13] or 0),
    )


def fold_facts(rows: Iterable[FactRow], groups: dict[str, GroupReport] | None = None) -> dict[str, GroupReport]:
    """Fill one ``Aggregator`` per group from fact rows, as ``Aggregator.add`` would have from the traces."""
    groups = {} if groups is None else groups
    for f in rows:
        g = groups.get(f.group)
        if g is None:
            g = groups[f.group] = GroupReport()
        agg = g.aggregator
        bucket = Bucket(f.bucket, f.n, f.total, f.low, f.high)
        if f.fact == "trace":
            agg.traces += f.kept
            agg.requests += f.n
            agg.total.add_bucket(bucket)
            g.slowest = max(g.slowest, (f.largest, f.example[0]))
        elif f.fact == "slow":
            agg.slow_traces += f.kept
            agg.slow_requests += f.n
            agg.slow_reasons[f.name or c.SLOW_TOTAL] += f.n  # before the reasons: by its total
        elif f.fact == "gpu":
            agg.gpu_utilization.add_bucket(bucket)
        elif f.fact == "stage":
            s = agg.stage(f.name)
            s.latency.add_bucket(bucket)
            s.traces += f.kept
            s.share_sum += f.share
            s.bottleneck += f.bottlenecks
            g.places.add(f.name, f.positions, f.kept)
        elif f.fact == "bottleneck":
            agg.bottlenecks[f.name] += f.n
        elif f.fact == "diagnosis.rate":  # diagnosed as one of a share: the report says its counts are estimates
            agg.diagnosis_sample_rate = min(agg.diagnosis_sample_rate, f.low)
        elif f.fact == "diagnosis":
            agg.diagnoses[f.name] += f.n
            if (f.largest, f.example[0]) > g.examples.get(f.name, (-math.inf, "")):
                g.examples[f.name] = (f.largest, f.example[0])
                agg.messages[f.name] = f.example[1]
        elif f.fact in ("batch.size", "batch.fill"):
            b = agg.batches.setdefault(f.name, BatchSummary())
            if f.fact == "batch.size":
                b.executions += f.kept
                b.size.add_bucket(bucket)
            else:
                b.fill.add_bucket(bucket)
        elif f.fact in ("wait.formation", "wait.busy"):
            w = agg.batch_waits.setdefault(f.name, BatchWaitSummary())
            if f.fact == "wait.formation":
                w.requests += f.kept
                w.formation.add_bucket(bucket)
            else:
                w.busy.add_bucket(bucket)
    return groups


def order_stages(agg: Aggregator, places: StagePlaces, kinds: Mapping[str, str]) -> None:
    """Stages in pipeline order, with their kinds."""
    agg.stages = {name: agg.stages[name] for name in places.order(agg.stages)}
    for name, s in agg.stages.items():
        if name in kinds:
            s.kind = kinds[name]


# --- the time window --------------------------------------------------------------------------------------

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_time(text: str, now_ns: int | None = None) -> int:
    """Epoch ns from ``90m``/``24h``/``7d``/``2w`` (that long before now), an ISO 8601 date or time
    (UTC unless it names a zone) or epoch seconds. Raises ValueError with what it accepts."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    m = _RELATIVE.match(text)
    if m:
        return now_ns - int(float(m.group(1)) * _UNIT_S[m.group(2)] * 1_000_000_000)
    stripped = text.strip()
    if re.fullmatch(r"\d{9,}(\.\d+)?", stripped):
        return int(Decimal(stripped) * 1_000_000_000)  # exact to the nanosecond, as the table's timestamps
    try:
        moment = datetime.fromisoformat(stripped.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"cannot read time {text!r}: use a duration before now (90m, 24h, 7d), an ISO 8601 date or time "
            "(2026-11-30, 2026-11-30T12:00:00Z) or epoch seconds"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1_000_000) * 1000
