"""Generate dashboards/stagetrace.json, the Grafana dashboard of stagetrace's metrics.

    python scripts/build_dashboard.py          # rewrite the committed JSON
    python scripts/build_dashboard.py --check  # exit 1 if the committed JSON differs (the tests run this)

One place defines every panel and query, so the dashboard, its PromQL checks and the README agree. Metric
names are what the Collector's prometheus exporter (and OpenTelemetry's Python Prometheus exporter) make
of stagetrace's OpenTelemetry metrics: units become suffixes (ms -> _milliseconds), counters get _total,
dots become underscores. The GPU gauge is matched with and without the _ratio suffix that only the
Collector adds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "dashboards" / "stagetrace.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$service", http_route=~"$route"'
SVC = 'job=~"$service"'
STAGE = "stagetrace_stage_duration_milliseconds"
TRACE = "stagetrace_trace_duration_milliseconds"
BATCH_SIZE = "stagetrace_batch_size"
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
        "datasource": DS,
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
            description="Share of traces over their slow threshold (stagetrace.slow=true).",
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
            "Slow-trace rate",
            "timeseries",
            (0, 22, 12, 8),
            [
                target(
                    f'(sum by (http_route) (rate({TRACE}_count{{{SEL}, stagetrace_slow="true"}}[{RATE}])) or '
                    f"sum by (http_route) (rate({TRACE}_count{{{SEL}}}[{RATE}])) * 0)"
                    f" / sum by (http_route) (rate({TRACE}_count{{{SEL}}}[{RATE}]))",
                    "{{http_route}}",
                )
            ],
            unit="percentunit",
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
            description="Traces per second on which each rule fired. The advice is in each trace's root span.",
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


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date: run python scripts/build_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
