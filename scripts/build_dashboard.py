"""Generate dashboards/stagetrace.json, the Grafana dashboard of stagetrace's metrics, and
dashboards/stagetrace-fleet.json, the one of the verdicts stored in ClickHouse.

    python scripts/build_dashboard.py          # rewrite the committed JSON
    python scripts/build_dashboard.py --check  # exit 1 if the committed JSON differs (the tests run this)

One place defines every panel and query, so the dashboard, its PromQL checks and the README agree. Metric
names are what the Collector's prometheus exporter (and OpenTelemetry's Python Prometheus exporter) make
of stagetrace's OpenTelemetry metrics: units become suffixes (ms -> _milliseconds), counters get _total,
dots become underscores. The GPU gauge is matched with and without the _ratio suffix that only the
Collector adds.

The fleet dashboard reads the trace table of the Collector's clickhouse exporter (database otel, table
otel_traces: the stack's collector config) through Grafana's ClickHouse data source: the verdict stagetrace
writes on each kept trace's root span. Its SQL is run against chDB by the tests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "dashboards" / "stagetrace.json"
FLEET_OUT = OUT.with_name("stagetrace-fleet.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
CH_DS = {"type": "grafana-clickhouse-datasource", "uid": "${datasource}"}
TRACES = "otel.otel_traces"
SEL = 'job=~"$service", http_route=~"$route"'
SVC = 'job=~"$service"'
STAGE = "stagetrace_stage_duration_milliseconds"
TRACE = "stagetrace_trace_duration_milliseconds"
BATCH_SIZE = "stagetrace_batch_size"
FIRST_CHUNK = "stagetrace_stream_first_chunk_duration_milliseconds"
CHUNK_GAP = "stagetrace_stream_chunk_gap_milliseconds"
GEN_AI_TTFT = "gen_ai_server_time_to_first_token_seconds"
OFFLOAD_QUEUE = "stagetrace_offload_queue_duration_milliseconds"
OFFLOAD_TRANSFER = "stagetrace_offload_transfer_size_bytes"
GEN_AI_TPOT = "gen_ai_server_time_per_output_token_seconds"
BATCH_FILL = "stagetrace_batch_fill(_ratio)?"  # unit "1": the Collector adds _ratio, the Python exporter does not
RATE = "$__rate_interval"
JAEGER_SLOW_SEARCH = "http://127.0.0.1:16686/search?service=${service}&tags=%7B%22stagetrace.slow%22%3A%22true%22%7D"


def target(expr: str, legend: str = "", ref: str = "A", exemplar: bool = False, instant: bool = False) -> dict:
    return {
        "datasource": DS,
        "expr": expr,
        "legendFormat": legend or "__auto",
        "refId": ref,
        "exemplar": exemplar,
        "instant": instant,
        "range": not instant,
    }


def panel(pid: int, title: str, kind: str, grid: tuple[int, int, int, int], targets: list[dict], **kw: Any) -> dict:
    x, y, w, h = grid
    defaults: dict[str, Any] = {"unit": kw.pop("unit", "short")}
    if kw.pop("stacked", False):
        defaults["custom"] = {"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 60, "lineWidth": 1}
    if kw.pop("bars", False):
        defaults.setdefault("custom", {}).update({"drawStyle": "bars", "fillOpacity": 80})
    return {
        "id": pid,
        "type": kind,
        "title": title,
        "description": kw.pop("description", ""),
        "datasource": kw.pop("datasource", DS),
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": kw.pop("overrides", [])},
        "options": kw.pop(
            "options",
            {"legend": {"displayMode": "table", "placement": "right", "calcs": ["mean"]}, "tooltip": {"mode": "multi"}},
        ),
    }


def quantiles(metric: str, by: str, sel: str) -> list[dict]:
    return [
        target(
            f"histogram_quantile({q}, sum by (le{by}) (rate({metric}_bucket{{{sel}}}[{RATE}])))",
            f"p{int(q * 100)}{' {{' + by.strip(', ') + '}}' if by else ''}",
            ref,
            exemplar=True,
        )
        for q, ref in ((0.5, "A"), (0.95, "B"), (0.99, "C"))
    ]


def build() -> dict:
    stat_opts = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "colorMode": "value",
        "graphMode": "area",
        "textMode": "auto",
    }
    share_total = f"scalar(sum(rate({TRACE}_sum{{{SEL}}}[{RATE}])))"
    panels = [
        panel(
            1,
            "Requests / s",
            "stat",
            (0, 0, 6, 4),
            [target(f"sum(rate({TRACE}_count{{{SEL}}}[{RATE}]))", "req/s")],
            unit="reqps",
            options=stat_opts,
        ),
        panel(
            2,
            "Slow traces",
            "stat",
            (6, 0, 6, 4),
            [
                target(
                    f'(sum(rate({TRACE}_count{{{SEL}, stagetrace_slow="true"}}[{RATE}])) or vector(0))'
                    f" / sum(rate({TRACE}_count{{{SEL}}}[{RATE}]))",
                    "slow",
                )
            ],
            unit="percentunit",
            options=stat_opts,
            description="Share of traces slow (stagetrace.slow=true): a response over its slow threshold; a "
            "streamed response by its phases, its first chunk or its gaps' p99 over theirs, not by its length.",
        ),
        panel(
            3,
            "Request p99",
            "stat",
            (12, 0, 6, 4),
            [target(f"histogram_quantile(0.99, sum by (le) (rate({TRACE}_bucket{{{SEL}}}[{RATE}])))", "p99")],
            unit="ms",
            options=stat_opts,
        ),
        panel(
            4,
            "Most frequent bottleneck",
            "stat",
            (18, 0, 6, 4),
            [
                target(
                    f"topk(1, sum by (stagetrace_stage) (increase(stagetrace_bottleneck_total{{{SVC}}}[$__range])))",
                    "{{stagetrace_stage}}",
                    instant=True,
                )
            ],
            options={**stat_opts, "textMode": "name"},
            description="The stage that most often held the most time of a trace; 'untracked' when time in no "
            "stage exceeded every stage (add stages there), 'event_loop.wait' when requests mostly waited for "
            "their event loop while other requests' sync stages held it.",
        ),
        panel(
            5,
            "Stage latency p50 / p95 / p99 (per request)",
            "timeseries",
            (0, 4, 12, 9),
            quantiles(STAGE, ", stagetrace_stage", SEL),
            unit="ms",
            description="Time charged to each stage per request: exclusive wall time, GPU time for GPU stages. "
            "Exemplars link to traces in Jaeger.",
        ),
        panel(
            6,
            "Request latency p50 / p95 / p99",
            "timeseries",
            (12, 4, 12, 9),
            quantiles(TRACE, "", SEL),
            unit="ms",
            description="Duration of each trace's local root. Click an exemplar to open the trace.",
        ),
        panel(
            7,
            "Share of request time per stage",
            "timeseries",
            (0, 13, 12, 9),
            [
                target(
                    f"sum by (stagetrace_stage) (rate({STAGE}_sum{{{SEL}}}[{RATE}])) / {share_total}",
                    "{{stagetrace_stage}}",
                )
            ],
            unit="percentunit",
            stacked=True,
            description="Stacked: what fills the requests. The gap to 100% is untracked time.",
        ),
        panel(
            8,
            "Bottleneck stage (share of traces)",
            "barchart",
            (12, 13, 12, 9),
            [
                target(
                    f"sum by (stagetrace_stage) (increase(stagetrace_bottleneck_total{{{SVC}}}[$__range]))"
                    f" / scalar(sum(increase(stagetrace_bottleneck_total{{{SVC}}}[$__range])))",
                    "{{stagetrace_stage}}",
                    instant=True,
                )
            ],
            unit="percentunit",
            options={
                "orientation": "horizontal",
                "showValue": "always",
                "legend": {"showLegend": False},
                "xField": "stagetrace_stage",
            },
            description="Per trace, the stage with the most time; 'untracked' counts traces where time in no "
            "stage exceeded every stage.",
            overrides=[
                {
                    "matcher": {"id": "byName", "options": "untracked"},
                    "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "gray"}}],
                }
            ],
        ),
        panel(
            9,
            "Slow-trace rate, by route and by reason",
            "timeseries",
            (0, 22, 12, 8),
            [
                target(
                    f'(sum by (http_route) (rate({TRACE}_count{{{SEL}, stagetrace_slow="true"}}[{RATE}])) or '
                    f"sum by (http_route) (rate({TRACE}_count{{{SEL}}}[{RATE}])) * 0)"
                    f" / sum by (http_route) (rate({TRACE}_count{{{SEL}}}[{RATE}]))",
                    "{{http_route}}",
                ),
                target(
                    f"sum by (stagetrace_slow_reason) "
                    f'(rate({TRACE}_count{{{SEL}, stagetrace_slow="true"}}[{RATE}]))'
                    f" / scalar(sum(rate({TRACE}_count{{{SEL}}}[{RATE}])))",
                    "slow by {{stagetrace_slow_reason}}",
                    ref="B",
                ),
            ],
            unit="percentunit",
            description="The share of each route's traces that were slow, and of all traces what made them "
            "slow: total (a response's duration), first_chunk or gap (a streamed response's time to the first "
            "chunk, else its gaps' p99).",
        ),
        panel(
            10,
            "Diagnoses over time",
            "timeseries",
            (12, 22, 12, 8),
            [target(f"sum by (code) (rate(stagetrace_diagnosis_total{{{SVC}}}[{RATE}]))", "{{code}}")],
            unit="short",
            stacked=True,
            bars=True,
            description="Traces per second on which each rule fired. The advice is in each trace's root span. "
            "Past the exporter's CPU budget (Settings.exporter_cpu_budget) the rules run on a share of traces and "
            "each diagnosed trace adds 1 / its chance of being diagnosed: the series are then estimates (the "
            "panel 'Traces diagnosed' says how large a share).",
        ),
        panel(
            11,
            "GPU utilisation beside CPU-side stages",
            "timeseries",
            (0, 30, 12, 8),
            [
                target(f'avg by (hw_id) ({{__name__=~"stagetrace_gpu_utilization(_ratio)?", {SVC}}})', "GPU {{hw_id}}"),
                target(
                    f'sum(rate({STAGE}_sum{{{SEL}, stagetrace_stage_kind=~"cpu|io|wait"}}[{RATE}])) / {share_total}',
                    "CPU-side share of request time",
                    "B",
                ),
            ],
            unit="percentunit",
            description="Low GPU utilisation while CPU-side stages hold most of the time: GPU_STARVED.",
        ),
        panel(
            12,
            "Dropped by stagetrace (bounds reached)",
            "timeseries",
            (12, 30, 12, 8),
            [target(f"sum by (reason) (rate(stagetrace_dropped_total{{{SVC}}}[{RATE}]))", "{{reason}}")],
            unit="short",
            description="Non-zero means a bound (traces in flight, stage names, queue) was hit.",
        ),
        panel(
            13,
            "Batch size p50 / p95 (requests per execution)",
            "timeseries",
            (0, 38, 12, 8),
            quantiles(BATCH_SIZE, ", stagetrace_stage", SVC)[:2],
            unit="short",
            description="Requests served by each execution of a dynamic batcher (stagetrace.batch()), per batch "
            "name. Small batches under a queue: BATCH_UNDERFILLED.",
        ),
        panel(
            14,
            "Batch fill (items / max size)",
            "timeseries",
            (12, 38, 12, 8),
            [
                target(
                    f'sum by (stagetrace_stage) (rate({{__name__=~"{BATCH_FILL}_sum", {SVC}}}[{RATE}]))'
                    f' / sum by (stagetrace_stage) (rate({{__name__=~"{BATCH_FILL}_count", {SVC}}}[{RATE}]))',
                    "{{stagetrace_stage}}",
                )
            ],
            unit="percentunit",
            description="Mean fill of each batcher's executions, where the batcher's max size is given. A low fill "
            "while requests wait in the batch queue means the batcher, not the GPU, limits throughput.",
        ),
        panel(
            15,
            "Streams: time to first chunk p50 / p99, by the stage that dominated it",
            "timeseries",
            (0, 46, 12, 8),
            [
                target(
                    f"histogram_quantile({q}, sum by (le, stagetrace_stream_first_chunk_bottleneck) "
                    f"(rate({FIRST_CHUNK}_bucket{{{SEL}}}[{RATE}])))",
                    f"p{int(q * 100)} {{{{stagetrace_stream_first_chunk_bottleneck}}}}",
                    ref,
                    exemplar=True,
                )
                for q, ref in ((0.5, "A"), (0.99, "B"))
            ],
            unit="ms",
            description="Streamed responses: the root's start to the first body chunk handed to the server, by "
            "stagetrace.stream.first_chunk.bottleneck (the stage with the most time before it).",
        ),
        panel(
            16,
            "Streams: gap between chunks p99, by the stage that dominated the gaps",
            "timeseries",
            (12, 46, 12, 8),
            [
                target(
                    "histogram_quantile(0.99, sum by (le, stagetrace_stream_gap_bottleneck) "
                    f"(rate({CHUNK_GAP}_bucket{{{SEL}}}[{RATE}])))",
                    "p99 {{stagetrace_stream_gap_bottleneck}}",
                )
            ],
            unit="ms",
            description="Every gap between consecutive chunks, by stagetrace.stream.gap.bottleneck. A CPU stage "
            "here (detokenize, JSON) rather than the model's step: STREAM_CPU_BOUND.",
        ),
        panel(
            17,
            "Streams: chunks / s",
            "timeseries",
            (0, 54, 12, 8),
            [
                target(
                    f"sum(rate({CHUNK_GAP}_count{{{SEL}}}[{RATE}])) + sum(rate({FIRST_CHUNK}_count{{{SEL}}}[{RATE}]))",
                    "chunks/s",
                )
            ],
            unit="short",
            description="Body chunks (tokens, frames) sent a second: each stream's first chunk and every gap after it.",
        ),
        panel(
            18,
            "GenAI: time to first token and per output token p99",
            "timeseries",
            (12, 54, 12, 8),
            [
                target(
                    "histogram_quantile(0.99, sum by (le, gen_ai_request_model) "
                    f"(rate({metric}_bucket{{{SVC}}}[{RATE}])))",
                    f"{label} {{{{gen_ai_request_model}}}}",
                    ref,
                )
                for metric, label, ref in ((GEN_AI_TTFT, "TTFT p99", "A"), (GEN_AI_TPOT, "TPOT p99", "B"))
            ],
            unit="s",
            description="OpenTelemetry's GenAI server metrics, for requests that said what they serve "
            "(stagetrace.generation()).",
        ),
        panel(
            19,
            "Process pools: wait for a worker p50 / p99, by function",
            "timeseries",
            (0, 62, 12, 8),
            [
                target(
                    f"histogram_quantile({q}, sum by (le, stagetrace_stage) "
                    f"(rate({OFFLOAD_QUEUE}_bucket{{{SVC}}}[{RATE}])))",
                    f"p{round(q * 100)} {{{{stagetrace_stage}}}}",
                    ref,
                )
                for q, ref in ((0.5, "A"), (0.99, "B"))
            ],
            unit="ms",
            description="Calls a request handed to a process pool: their offload.queue, the wait for a worker. "
            "Growing while every worker is busy: POOL_SATURATED; a worker's first task: WORKER_COLD_START.",
        ),
        panel(
            20,
            "Process pools: bytes moved a call, by direction",
            "timeseries",
            (12, 62, 12, 8),
            [
                target(
                    f"sum by (stagetrace_stage, direction) (rate({OFFLOAD_TRANSFER}_sum{{{SVC}}}[{RATE}])) / "
                    f"sum by (stagetrace_stage, direction) (rate({OFFLOAD_TRANSFER}_count{{{SVC}}}[{RATE}]))",
                    "{{stagetrace_stage}} {{direction}}",
                )
            ],
            unit="bytes",
            description="What each call sends its worker (its arguments) and gets back (its result). Megabytes "
            "a call: IPC_BOUND (send encoded bytes, paths or shared memory).",
        ),
        panel(
            21,
            "Traces diagnosed (share of all traces)",
            "timeseries",
            (0, 70, 12, 8),
            [
                target(
                    f"sum(rate(stagetrace_traces_diagnosed_total{{{SVC}}}[{RATE}])) / "
                    f"sum(rate({TRACE}_count{{{SVC}}}[{RATE}]))",
                    "diagnosed",
                )
            ],
            unit="percentunit",
            description="The share of traces the diagnosis rules ran on: 100 % while the exporter keeps within "
            "its CPU budget; under it, the diagnosis counts above are estimates from that share (every trace still "
            "has its breakdown, bottleneck, slow flag and metrics, and every kept trace its diagnoses).",
        ),
    ]
    return {
        "uid": "stagetrace",
        "title": "stagetrace: stage breakdown",
        "description": "Where inference requests spend their time, by pipeline stage (stagetrace metrics).",
        "tags": ["stagetrace", "inference", "opentelemetry"],
        "schemaVersion": 42,
        "version": 1,
        "editable": False,
        "graphTooltip": 1,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [
            {
                "title": "Slow traces in Jaeger",
                "type": "link",
                "url": JAEGER_SLOW_SEARCH,
                "tooltip": "Search Jaeger for traces tagged stagetrace.slow=true",
                "icon": "external link",
                "targetBlank": True,
                "asDropdown": False,
                "includeVars": False,
                "keepTime": False,
                "tags": [],
            }
        ],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Data source",
                    "current": {"text": "Prometheus", "value": "prometheus"},
                    "hide": 0,
                },
                {
                    "name": "service",
                    "type": "query",
                    "label": "Service",
                    "datasource": DS,
                    "query": {"query": f"label_values({TRACE}_count, job)", "refId": "service"},
                    "definition": f"label_values({TRACE}_count, job)",
                    "refresh": 2,
                    "multi": True,
                    "includeAll": True,
                    "allValue": ".*",
                    "sort": 1,
                    "hide": 0,
                },
                {
                    "name": "route",
                    "type": "query",
                    "label": "Route",
                    "datasource": DS,
                    "query": {"query": f'label_values({TRACE}_count{{job=~"$service"}}, http_route)', "refId": "route"},
                    "definition": f'label_values({TRACE}_count{{job=~"$service"}}, http_route)',
                    "refresh": 2,
                    "multi": True,
                    "includeAll": True,
                    "allValue": ".*",
                    "sort": 1,
                    "hide": 0,
                },
            ]
        },
        "panels": panels,
    }


# --- the fleet: verdicts stored in ClickHouse ---------------------------------------------------------------

# The roots that carry stagetrace's verdict, in the dashboard's time range and services.
VERDICT_ROOTS = "ParentSpanId = '' AND mapContains(SpanAttributes, 'stagetrace.total_ms')"
VERDICTS = (
    f"FROM {TRACES} WHERE $__timeFilter(Timestamp) AND ServiceName IN (${{service:singlequote}}) AND {VERDICT_ROOTS}"
)
SERVICES = (
    f"SELECT DISTINCT ServiceName FROM {TRACES} WHERE $__timeFilter(Timestamp) AND {VERDICT_ROOTS} ORDER BY ServiceName"
)
VERSION = "ResourceAttributes['service.version']"
KEPT = (
    "Stored verdicts describe the traces stagetrace kept (every slow, diagnosed or errored one and a share of "
    "healthy ones), not every request: the stagetrace dashboard's metrics count every request."
)


def ch_target(sql: str, ref: str = "A", table: bool = True) -> dict:
    """A query of Grafana's ClickHouse data source (SQL editor); table or time series."""
    return {
        "datasource": CH_DS,
        "editorType": "sql",
        "queryType": "table" if table else "timeSeries",
        "format": 1 if table else 0,
        "rawSql": sql,
        "refId": ref,
    }


def build_fleet() -> dict:
    stage_p99 = (
        "SELECT stage_ms.1 AS stage, version, count() AS traces, round(quantile(0.5)(stage_ms.2), 2) AS p50_ms, "
        "round(quantile(0.99)(stage_ms.2), 2) AS p99_ms FROM ("
        f"SELECT {VERSION} AS version, "
        "JSONExtract(SpanAttributes['stagetrace.stages'], 'Array(String)') AS names, "
        "JSONExtract(SpanAttributes['stagetrace.stages_ms'], 'Array(Float64)') AS values, "
        f"least(length(names), length(values)) AS n {VERDICTS}"
        ") ARRAY JOIN arrayZip(arraySlice(names, 1, n), arraySlice(values, 1, n)) AS stage_ms "
        "GROUP BY stage, version ORDER BY stage, version"
    )
    request_p99 = (
        f"SELECT $__timeInterval(Timestamp) AS time, {VERSION} AS version, "
        "quantile(0.99)(toFloat64OrZero(SpanAttributes['stagetrace.total_ms'])) AS p99_ms "
        f"{VERDICTS} GROUP BY time, version ORDER BY time"
    )
    bottlenecks = (
        f"SELECT {VERSION} AS version, SpanAttributes['stagetrace.bottleneck.stage'] AS bottleneck, "
        "count() AS traces, round(traces / sum(traces) OVER (PARTITION BY version), 4) AS share "
        f"{VERDICTS} GROUP BY version, bottleneck ORDER BY version, traces DESC"
    )
    diagnoses = (
        "SELECT version, code, count() AS traces FROM ("
        f"SELECT {VERSION} AS version, JSONExtract(SpanAttributes['stagetrace.diagnosis'], 'Array(String)') AS codes "
        f"{VERDICTS}) ARRAY JOIN codes AS code GROUP BY version, code ORDER BY version, traces DESC"
    )
    table_opts = {"showHeader": True, "cellHeight": "sm"}
    panels = [
        panel(
            1,
            "Stage p50 / p99 by service.version (stored verdicts)",
            "table",
            (0, 0, 12, 10),
            [ch_target(stage_p99)],
            datasource=CH_DS,
            options=table_opts,
            description="Time charged to each stage per trace, from the breakdown on each kept trace's root "
            f"(stagetrace.stages / stagetrace.stages_ms), compared across versions. {KEPT}",
        ),
        panel(
            2,
            "Request p99 by service.version (stored verdicts)",
            "timeseries",
            (12, 0, 12, 10),
            [ch_target(request_p99, table=False)],
            datasource=CH_DS,
            unit="ms",
            description=f"stagetrace.total_ms of kept traces' roots. {KEPT}",
        ),
        panel(
            3,
            "Bottleneck by service.version",
            "table",
            (0, 10, 12, 9),
            [ch_target(bottlenecks)],
            datasource=CH_DS,
            options=table_opts,
            description=f"stagetrace.bottleneck.stage: the stage that held the most time of each trace. {KEPT}",
        ),
        panel(
            4,
            "Diagnoses by service.version",
            "table",
            (12, 10, 12, 9),
            [ch_target(diagnoses)],
            datasource=CH_DS,
            options=table_opts,
            description="Kept traces on which each rule fired (stagetrace.diagnosis). For a report with "
            "examples: stagetrace report --clickhouse URL --database otel --group-by service.version",
        ),
    ]
    return {
        "uid": "stagetrace-fleet",
        "title": "stagetrace: fleet (stored verdicts in ClickHouse)",
        "description": "stagetrace's verdicts as the Collector's clickhouse exporter stores them, compared across "
        "service versions.",
        "tags": ["stagetrace", "inference", "clickhouse"],
        "schemaVersion": 42,
        "version": 1,
        "editable": False,
        "graphTooltip": 1,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "1m",
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "grafana-clickhouse-datasource",
                    "label": "Data source",
                    "current": {"text": "ClickHouse", "value": "clickhouse"},
                    "hide": 0,
                },
                {
                    "name": "service",
                    "type": "query",
                    "label": "Service",
                    "datasource": CH_DS,
                    "query": {
                        "editorType": "sql",
                        "rawSql": SERVICES,
                    },
                    "definition": "services with stored verdicts",
                    "refresh": 2,
                    "multi": True,
                    "includeAll": True,
                    "sort": 1,
                    "hide": 0,
                },
            ]
        },
        "panels": panels,
    }


DASHBOARDS = ((OUT, build), (FLEET_OUT, build_fleet))


def render(builder=build) -> str:
    return json.dumps(builder(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    stale = []
    for path, builder in DASHBOARDS:
        text = render(builder)
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
            continue
        path.write_text(text)
        print(f"wrote {path}")
    for path in stale:
        print(f"{path} is out of date: run python scripts/build_dashboard.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
