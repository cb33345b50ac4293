"""Tables for the terminal and a self-contained HTML page (inline CSS and SVG, no network access)."""

from __future__ import annotations

import html
import textwrap
from collections.abc import Mapping
from typing import Any

from stagetrace.analysis.loopwait import split_blocker
from stagetrace.conventions import UNTRACKED

KIND_COLORS = {
    "cpu": "#4e79a7",
    "io": "#59a14f",
    "wait": "#e15759",
    "h2d": "#f28e2b",
    "gpu": "#76b7b2",
    "d2h": "#edc948",
    "span": "#bab0ac",
}


def _table(headers: list[str], rows: list[list[str]], align: str) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, align))

    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


def _weighted(summary: Mapping[str, Any]) -> float:
    """The denominator of every share: the requests the kept traces stand for (their adjusted counts)."""
    return float(summary.get("requests") or summary["traces"])


def _about(summary: Mapping[str, Any]) -> str:
    return "about " if summary.get("sampled") else ""


def _n(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def counts_line(summary: Mapping[str, Any]) -> str:
    """How many requests the report speaks of: the traces read, and when they are a sample, how many
    requests they stand for (their adjusted counts: an estimate), or how many the metrics counted (exact)."""
    kept, slow = summary["traces"], summary["slow_traces"]
    counted = summary.get("counted")
    if counted:
        total, slow_total, about = counted["requests"], counted["slow"], ""
    else:
        total, slow_total, about = _weighted(summary), float(summary.get("slow_requests", slow)), _about(summary)
    share = f" ({slow_total / total:.0%})" if total else ""
    if not summary.get("sampled") and (not counted or counted["requests"] == kept):
        return f"{kept} traces, {slow} slow{share}"
    line = f"{kept} kept of {about}{_n(total)} requests, {about}{_n(slow_total)} slow{share}"
    if counted:
        line += " (counted by the metrics)"
    if summary.get("sampled"):
        line += "; every figure below weighted by each kept trace's adjusted count"
    return line


SLOW_REASON_LABELS = {"total": "its duration", "first_chunk": "the time to the first chunk", "gap": "the gaps"}


def diagnosis_sample_line(summary: Mapping[str, Any]) -> str | None:
    """Where the exporter was past its CPU budget when some of these traces were kept: its rules ran on a share
    of traces, so the diagnosis counts (the metrics' and those weighted here) are estimates."""
    rate = summary.get("diagnosis_sample_rate", 1.0)
    if rate >= 1.0:
        return None
    return (
        f"past the exporter's CPU budget the rules ran on as few as {rate:.0%} of the traces: the diagnosis "
        "counts are estimates (every kept trace was diagnosed)"
    )


def slow_reasons_line(summary: Mapping[str, Any]) -> str | None:
    """What made the slow ones slow, where streams are among them: a response by its duration, a stream by
    its time to the first chunk or its gaps (never by its length)."""
    reasons = summary.get("slow_reasons") or {}
    if not reasons or set(reasons) == {"total"}:
        return None
    n = _weighted(summary)
    parts = [f"{SLOW_REASON_LABELS.get(r, r)} {_n(count)} ({count / n:.0%})" for r, count in reasons.items()]
    return "slow by " + ", ".join(parts)


def text_report(
    summary: dict[str, Any], title: str = "stagetrace", groups: Mapping[str, dict[str, Any]] | None = None
) -> str:
    """The terminal report; with ``groups`` (group value -> that group's summary) a comparison follows."""
    if not summary["traces"]:
        return f"{title}: no traces"
    n = _weighted(summary)
    out = [f"{title}: {counts_line(summary)}"]
    reasons = slow_reasons_line(summary)
    if reasons:
        out.append(reasons)
    t = summary["total_ms"]
    out.append(f"request latency: p50 {t['p50']:.1f} ms, p95 {t['p95']:.1f} ms, p99 {t['p99']:.1f} ms")
    if "gpu_utilization" in summary:
        g = summary["gpu_utilization"]
        out.append(f"GPU utilisation over traces: mean {g['mean']:.0%}, p50 {g['p50']:.0%}")
    stages = summary["stages"]
    rows = [
        [
            name,
            s["kind"],
            f"{s['p50_ms']:.2f}",
            f"{s['p95_ms']:.2f}",
            f"{s['p99_ms']:.2f}",
            f"{s['mean_share']:.0%}",
            f"{s['bottleneck_traces'] / n:.0%}",
        ]
        for name, s in stages.items()
    ]
    out += ["", "Stages (time charged per request, in pipeline order)"]
    out.append(_table(["stage", "kind", "p50 ms", "p95 ms", "p99 ms", "mean share", "bottleneck"], rows, "llrrrrr"))
    if summary["bottlenecks"]:
        out += ["", "Bottleneck stage (share of traces)"]
        width = 40
        labels = {name: f"{name} (in no stage)" if name == UNTRACKED else name for name in summary["bottlenecks"]}
        label_width = max(18, *map(len, labels.values()))
        for name, count in summary["bottlenecks"].items():
            bar = "#" * max(1, round(width * count / n))
            out.append(f"  {labels[name]:<{label_width}} {bar:<{width}} {count / n:6.1%}  ({_n(count)})")
    out += batch_lines(summary)
    out += stream_lines(summary)
    out += offload_lines(summary)
    out += ["", "Diagnoses"]
    sampled_note = diagnosis_sample_line(summary)
    if sampled_note:
        out.append(f"  ({sampled_note})")
    if not summary["diagnoses"]:
        out.append("  none fired")
    for code, count in summary["diagnoses"].items():
        example = f"{summary['examples'].get(code, '')}{_trace_note(summary, code)}"
        counted_as = f"{_about(summary)}{_n(count)} requests" if summary.get("sampled") else f"{count} traces"
        out.append(f"  {code}  {counted_as} ({count / n:.0%}), e.g. {example}")
        evidence = summary.get("evidence", {}).get(code)
        if evidence:
            out += textwrap.wrap(f"evidence: {evidence}", 100, initial_indent="      ", subsequent_indent="        ")
        for line in textwrap.wrap(summary["advice"].get(code, ""), 100):
            out.append(f"      {line}")
    if groups:
        out += comparison_lines(groups, summary.get("group_by", "group"))
    return "\n".join(out)


# --- comparison across groups (the ClickHouse report's --group-by) --------------------------------------

GROUP_HEADERS = ["traces", "slow", "p50 ms", "p99 ms", "top bottleneck", "top diagnosis", "slowest trace"]
MAX_GROUP_COLUMNS = 8  # stage tables with more groups than this are left to the HTML page and --json


def group_label(value: str) -> str:
    return value if value else "(none)"


def _top(counts: Mapping[str, float], n: float) -> str:
    if not counts or not n:
        return "-"
    name, count = max(counts.items(), key=lambda item: (item[1], item[0]))
    return f"{name} {count / n:.0%}"


def group_rows(groups: Mapping[str, dict[str, Any]]) -> list[list[str]]:
    """One row per group: size, slow share, latency, the bottleneck and diagnosis most often seen, and the
    slowest trace to open."""
    rows = []
    for value, g in groups.items():
        n = _weighted(g) if g["traces"] else 0
        rows.append(
            [
                group_label(value),
                str(g["traces"]),
                f"{g.get('slow_requests', g['slow_traces']) / n:.0%}" if n else "-",
                f"{g['total_ms']['p50']:.1f}",
                f"{g['total_ms']['p99']:.1f}",
                _top(g["bottlenecks"], n),
                _top(g["diagnoses"], n),
                g.get("slowest_trace") or "-",
            ]
        )
    return rows


def stage_p99_rows(groups: Mapping[str, dict[str, Any]], stages: list[str]) -> list[list[str]]:
    """p99 of each stage (rows) in each group (columns); '-' where a group never ran the stage."""
    return [
        [stage] + [f"{g['stages'][stage]['p99_ms']:.2f}" if stage in g["stages"] else "-" for g in groups.values()]
        for stage in stages
    ]


def diagnosis_rows(groups: Mapping[str, dict[str, Any]]) -> list[list[str]]:
    """Share of each group's traces with each diagnosis."""
    codes = sorted({code for g in groups.values() for code in g["diagnoses"]})
    return [
        [code] + [f"{g['diagnoses'].get(code, 0) / _weighted(g):.0%}" if g["traces"] else "-" for g in groups.values()]
        for code in codes
    ]


def _stage_order(groups: Mapping[str, dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for g in groups.values():
        seen.update(dict.fromkeys(g["stages"]))
    return list(seen)


def comparison_lines(groups: Mapping[str, dict[str, Any]], group_by: str) -> list[str]:
    out = ["", f"By {group_by} ({len(groups)} group{'s' if len(groups) != 1 else ''})"]
    out.append(_table([group_by, *GROUP_HEADERS], group_rows(groups), "lrrrrlll"))
    labels = [group_label(v) for v in groups]
    if len(groups) > MAX_GROUP_COLUMNS:
        out.append(f"  (p99 by stage and diagnoses by group: {len(groups)} groups, see --html or --json)")
        return out
    out += ["", f"Stage p99 ms by {group_by}"]
    out.append(_table(["stage", *labels], stage_p99_rows(groups, _stage_order(groups)), "l" + "r" * len(labels)))
    rows = diagnosis_rows(groups)
    if rows:
        out += ["", f"Diagnoses (share of traces) by {group_by}"]
        out.append(_table(["diagnosis", *labels], rows, "l" + "r" * len(labels)))
    return out


def comparison_html(groups: Mapping[str, dict[str, Any]], group_by: str) -> str:
    labels = [group_label(v) for v in groups]
    parts = [f"<h2>By {_esc(group_by)}</h2>", _html_table("groups", [group_by, *GROUP_HEADERS], group_rows(groups))]
    parts.append(f"<h3>Stage p99 ms by {_esc(group_by)}</h3>")
    parts.append(_html_table("group-stages", ["stage", *labels], stage_p99_rows(groups, _stage_order(groups))))
    rows = diagnosis_rows(groups)
    if rows:
        parts.append(f"<h3>Diagnoses (share of traces) by {_esc(group_by)}</h3>")
        parts.append(_html_table("group-diagnoses", ["diagnosis", *labels], rows))
    return "".join(parts)


def batch_rows(summary: dict[str, Any]) -> tuple[list[list[str]], list[list[str]]]:
    """Rows of the batch tables: per batcher (executions, size, fill) and per batch wait (its split)."""
    batches = [
        [
            name,
            str(b["executions"]),
            f"{b['size_mean']:.1f}",
            f"{b['size_p50']:.0f}",
            f"{b['size_p95']:.0f}",
            f"{b['fill_mean']:.0%}" if b["fill_mean"] is not None else "-",
        ]
        for name, b in summary.get("batches", {}).items()
    ]
    waits = [
        [
            name,
            str(w["requests"]),
            f"{w['formation_p50_ms']:.2f}",
            f"{w['formation_p95_ms']:.2f}",
            f"{w['busy_p50_ms']:.2f}",
            f"{w['busy_p95_ms']:.2f}",
        ]
        for name, w in summary.get("batch_waits", {}).items()
    ]
    return batches, waits


BATCH_HEADERS = ["batch", "executions", "mean size", "p50 size", "p95 size", "mean fill"]
WAIT_HEADERS = ["wait", "requests", "forming p50 ms", "forming p95 ms", "behind p50 ms", "behind p95 ms"]


def batch_lines(summary: dict[str, Any]) -> list[str]:
    batches, waits = batch_rows(summary)
    out: list[str] = []
    if batches:
        out += ["", "Batches (requests per execution; fill = items / max size)"]
        out.append(_table(BATCH_HEADERS, batches, "lrrrrr"))
    if waits:
        out += ["", "Batch waits (forming the batch / behind the previous batch)"]
        out.append(_table(WAIT_HEADERS, waits, "lrrrrr"))
    return out


STREAM_HEADERS = ["streamed responses", "p50", "p95", "p99"]


def stream_rows(summary: dict[str, Any]) -> tuple[list[list[str]], list[list[str]]]:
    """Rows of the stream tables: what the clients lived (time to the first chunk, each stream's gap p99,
    chunks a second) and, per stage, how many streams it dominated before the first chunk and between chunks."""
    st = summary.get("streams")
    if not st:
        return [], []
    lived = [
        [label, *(f"{q[key]:.2f}" for key in ("p50", "p95", "p99"))]
        for label, q in (
            ("time to first chunk ms", st["first_chunk_ms"]),
            ("gap p99 ms (per stream)", st["gap_p99_ms"]),
            ("chunks a second", st["chunks_per_s"]),
        )
        if q
    ]
    stages = sorted(set(st["first_chunk_bottlenecks"]) | set(st["gap_bottlenecks"]))
    phases = [
        [name, str(st["first_chunk_bottlenecks"].get(name, 0)), str(st["gap_bottlenecks"].get(name, 0))]
        for name in stages
    ]
    return lived, phases


PHASE_HEADERS = ["stage", "bottleneck to first chunk", "bottleneck between chunks"]


def _stream_title(summary: dict[str, Any]) -> str:
    st = summary["streams"]
    return f"Streams ({st['streams']}, {st['chunks_mean']:.0f} chunks on average, {st['disconnected']} disconnected)"


def stream_lines(summary: dict[str, Any]) -> list[str]:
    lived, phases = stream_rows(summary)
    if not lived and not phases:
        return []
    out = ["", _stream_title(summary), _table(STREAM_HEADERS, lived, "lrrr")]
    if phases:
        out.append(_table(PHASE_HEADERS, phases, "lrr"))
    return out


OFFLOAD_HEADERS = [
    "offloaded call", "pool", "calls", "queue p50 ms", "queue p95 ms", "send p50 ms", "run p50 ms",
    "return p50 ms", "args", "result", "first tasks", "saturated",
]  # fmt: skip
OFFLOAD_TITLE = "Calls handed to process pools (queue: waiting for a worker; send / return: the data's way)"


def _bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n:.0f} B"


def offload_rows(summary: dict[str, Any]) -> list[list[str]]:
    return [
        [
            name, o["executor"], _n(o["calls"]), f"{o['queue_p50_ms']:.2f}", f"{o['queue_p95_ms']:.2f}",
            f"{o['send_p50_ms']:.2f}", f"{o['run_p50_ms']:.2f}", f"{o['return_p50_ms']:.2f}",
            _bytes(o["args_bytes_mean"]), _bytes(o["result_bytes_mean"]), _n(o["first_tasks"]), _n(o["saturated"]),
        ]
        for name, o in summary.get("offloads", {}).items()
    ]  # fmt: skip


def offload_lines(summary: dict[str, Any]) -> list[str]:
    rows = offload_rows(summary)
    return ["", OFFLOAD_TITLE, _table(OFFLOAD_HEADERS, rows, "llrrrrrrrrrr")] if rows else []


def _html_table(table_id: str, headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_esc(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f'<table id="{table_id}"><tr>{head}</tr>{body}</table>'


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _bar_svg(items: list[tuple[str, float, str]], width: int = 640, bar_h: int = 22) -> str:
    """Horizontal bars; items are (label, value 0..1, color)."""
    h = bar_h * len(items) + 8
    parts = [f'<svg class="bars" width="{width}" height="{h}" role="img" xmlns="http://www.w3.org/2000/svg">']
    label_w, max_w = 170, width - 250
    for i, (label, value, color) in enumerate(items):
        y = 4 + i * bar_h
        w = max(1.0, value * max_w)
        parts.append(f'<text x="0" y="{y + 15}" class="lbl">{_esc(label)}</text>')
        parts.append(f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{bar_h - 6}" fill="{color}"/>')
        parts.append(f'<text x="{label_w + w + 6:.1f}" y="{y + 15}" class="val">{value:.1%}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _trace_note(summary: dict[str, Any], code: str) -> str:
    trace = summary.get("example_traces", {}).get(code)
    return f" (trace {trace})" if trace else ""


def _evidence_html(evidence: str | None) -> str:
    return f'<p class="evidence">evidence: {_esc(evidence)}</p>' if evidence else ""


def _blocked_by_html(blocked_by: tuple[str, ...] | None) -> str:
    """Who held the event loop while the request waited for it: each stage and its trace, longest first."""
    if not blocked_by:
        return ""
    items = "".join(
        f'<li><span class="code">{_esc(name)}</span> of trace {_esc(trace_id)}</li>'
        for name, trace_id in map(split_blocker, blocked_by)
    )
    return (
        f'<div class="blocked-by"><p>The event loop was held, while this request waited, by:</p><ol>{items}</ol></div>'
    )


def _waterfall_svg(spans: list[dict[str, Any]], width: int = 900) -> str:
    if not spans:
        return "<p>No spans kept for this trace.</p>"
    total = max(s["end_ms"] for s in spans) or 1.0
    row, label_w = 18, 220
    h = row * len(spans) + 24
    scale = (width - label_w - 70) / total
    parts = [f'<svg class="waterfall" width="{width}" height="{h}" xmlns="http://www.w3.org/2000/svg">']
    for i, s in enumerate(spans):
        y = i * row
        x = label_w + max(0.0, s["start_ms"]) * scale
        w = max(1.0, (s["end_ms"] - s["start_ms"]) * scale)
        color = KIND_COLORS.get(s["kind"], KIND_COLORS["span"])
        name = ("  " * s["depth"]) + s["name"]
        parts.append(f'<text x="0" y="{y + 13}" class="lbl">{_esc(name[:34])}</text>')
        merged = f" ({s['spans']} overlapping spans, their union)" if s.get("spans", 1) > 1 else ""
        parts.append(
            f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row - 5}" fill="{color}">'
            f"<title>{_esc(s['name'])}: {s['end_ms'] - s['start_ms']:.2f} ms{merged}</title></rect>"
        )
        parts.append(f'<text x="{x + w + 4:.1f}" y="{y + 13}" class="val">{s["end_ms"] - s["start_ms"]:.1f}</text>')
    parts.append(f'<text x="{label_w}" y="{h - 4}" class="axis">0 ms</text>')
    parts.append(f'<text x="{width - 60}" y="{h - 4}" class="axis">{total:.1f} ms</text></svg>')
    return "".join(parts)


CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1000px;color:#222}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
.kpi{display:inline-block;margin:6px 18px 6px 0;padding:8px 14px;background:#f4f6f8;border-radius:6px}
.kpi b{display:block;font-size:20px} table{border-collapse:collapse;margin:8px 0}
td,th{padding:4px 10px;border-bottom:1px solid #eee;text-align:right} td:first-child,th:first-child{text-align:left}
.lbl{font-size:12px;fill:#333} .val,.axis{font-size:11px;fill:#666} .code{font-family:monospace;font-weight:bold}
.advice{color:#444;margin:2px 0 12px 0} .legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px}
.evidence{color:#555;margin:2px 0 2px 12px;font-size:13px}
"""


def html_report(
    summary: dict[str, Any],
    slowest: list[tuple[Any, list[dict[str, Any]]]],
    title: str,
    groups: Mapping[str, dict[str, Any]] | None = None,
) -> str:
    """The self-contained page; with ``groups`` (group value -> summary) the comparison across them."""
    n = _weighted(summary) or 1
    t = summary["total_ms"]
    stages = summary["stages"]
    counted = summary.get("counted")
    slow = counted["slow"] if counted else summary.get("slow_requests", summary["slow_traces"])
    requests = counted["requests"] if counted else n
    about = "" if counted else _about(summary)
    kpis = [
        ("traces", f"{summary['traces']}"),
        *([("requests", f"{about}{_n(requests)}")] if requests != summary["traces"] else []),
        ("slow traces", f"{about}{_n(slow)} ({slow / (requests or 1):.0%})"),
        ("p50 latency", f"{t['p50']:.1f} ms"),
        ("p99 latency", f"{t['p99']:.1f} ms"),
    ]
    if "gpu_utilization" in summary:
        kpis.append(("GPU utilisation", f"{summary['gpu_utilization']['mean']:.0%}"))
    body = [f"<h1>{_esc(title)}</h1>", "<div>"]
    body += [f'<div class="kpi" data-kpi="{_esc(k)}">{_esc(k)}<b>{_esc(v)}</b></div>' for k, v in kpis]
    body.append("</div>")
    body.append(f'<p class="counts">{_esc(counts_line(summary))}</p>')
    reasons = slow_reasons_line(summary)
    if reasons:
        body.append(f'<p class="slow-reasons">{_esc(reasons)}</p>')
    legend = "".join(f'<span style="background:{c}"></span>{k}' for k, c in KIND_COLORS.items() if k != "span")
    body.append(f'<p class="legend">stage kinds:{legend}</p>')
    body.append("<h2>Stage breakdown (mean share of request time)</h2>")
    body.append(_bar_svg([(k, s["mean_share"], KIND_COLORS.get(s["kind"], "#888")) for k, s in stages.items()]))
    rows = "".join(
        f"<tr><td>{_esc(k)}</td><td>{_esc(s['kind'])}</td><td>{s['p50_ms']:.2f}</td><td>{s['p95_ms']:.2f}</td>"
        f"<td>{s['p99_ms']:.2f}</td><td>{s['mean_share']:.1%}</td><td>{s['bottleneck_traces']}</td></tr>"
        for k, s in stages.items()
    )
    body.append(
        '<table id="stages"><tr><th>stage</th><th>kind</th><th>p50 ms</th><th>p95 ms</th><th>p99 ms</th>'
        f"<th>mean share</th><th>bottleneck in</th></tr>{rows}</table>"
    )
    body.append("<h2>Bottleneck distribution</h2>")
    body.append(
        _bar_svg(
            [
                (k, v / n, KIND_COLORS.get(stages.get(k, {}).get("kind", ""), "#888"))
                for k, v in summary["bottlenecks"].items()
            ]
        )
    )
    batches, waits = batch_rows(summary)
    if batches or waits:
        body.append("<h2>Batches</h2>")
        if batches:
            body.append(_html_table("batches", BATCH_HEADERS, batches))
        if waits:
            body.append(_html_table("batch-waits", WAIT_HEADERS, waits))
    lived, phases = stream_rows(summary)
    if lived or phases:
        body.append(f"<h2>{_esc(_stream_title(summary))}</h2>")
        body.append(_html_table("streams", STREAM_HEADERS, lived))
        if phases:
            body.append(_html_table("stream-phases", PHASE_HEADERS, phases))
    offloaded = offload_rows(summary)
    if offloaded:
        body.append(f"<h2>{_esc(OFFLOAD_TITLE)}</h2>")
        body.append(_html_table("offloads", OFFLOAD_HEADERS, offloaded))
    body.append("<h2>Diagnoses</h2>")
    sampled_note = diagnosis_sample_line(summary)
    if sampled_note:
        body.append(f'<p class="diagnosis-sample">{_esc(sampled_note)}</p>')
    if not summary["diagnoses"]:
        body.append("<p>No diagnosis fired.</p>")
    unit = "requests" if summary.get("sampled") else "traces"
    for code, count in summary["diagnoses"].items():
        body.append(
            f'<p><span class="code">{_esc(code)}</span> in {_esc(_n(count))} {unit} ({count / n:.0%}): '
            f"{_esc(summary['examples'].get(code, ''))}{_esc(_trace_note(summary, code))}</p>"
            f"{_evidence_html(summary.get('evidence', {}).get(code))}"
            f'<p class="advice">{_esc(summary["advice"].get(code, ""))}</p>'
        )
    if groups:
        body.append(comparison_html(groups, summary.get("group_by", "group")))
    body.append("<h2>Slowest traces</h2>")
    for verdict, spans in slowest:
        codes = ", ".join(verdict.diagnosis_codes) or "no diagnosis"
        body.append(
            f'<h3 class="trace">{_esc(verdict.root_name)} {verdict.total_ms:.1f} ms: bottleneck '
            f"{_esc(verdict.bottleneck)} ({verdict.ratio:.0%}); {_esc(codes)}</h3>"
            f'<p class="tid">trace {_esc(verdict.trace_id)}</p>{_blocked_by_html(verdict.blocked_by)}'
            f"{_waterfall_svg(spans)}"
        )
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_esc(title)}</title>'
        f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>"
    )


# --- before and after (stagetrace report --compare) ----------------------------------------------------------


def _signed(value: float | None, unit: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value:+.{digits}f}{unit}"


def _plain(value: float | None, unit: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _verdict(row: Mapping[str, Any]) -> str:
    if row["interval_95"] is None:
        return "-"
    return "significant" if row["significant"] else "within noise"


def _ms_rows(rows: Mapping[str, Mapping[str, Any]], label: str) -> list[list[str]]:
    out = []
    for figure, r in rows.items():
        interval = r["interval_95"]
        relative = f" ({r['change'] / r['before']:+.0%})" if r["change"] is not None and r["before"] else ""
        out.append(
            [
                f"{label} {figure}".strip(),
                _plain(r["before"]),
                _plain(r["after"]),
                _signed(r["change"]) + relative,
                "-" if interval is None else f"[{interval[0]:+.2f}, {interval[1]:+.2f}]",
                _verdict(r),
            ]
        )
    return out


def _share_rows(rows: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    out = []
    for name, r in rows.items():
        interval = r["interval_95"]
        out.append(
            [
                name,
                _plain(None if r["before"] is None else 100 * r["before"], " %", 0),
                _plain(None if r["after"] is None else 100 * r["after"], " %", 0),
                _signed(None if r["change"] is None else 100 * r["change"], " pts", 0),
                "-" if interval is None else f"[{100 * interval[0]:+.0f}, {100 * interval[1]:+.0f}] pts",
                _verdict(r),
            ]
        )
    return out


COMPARE_HEADERS = ["", "before", "after", "change", "95 % interval", ""]


def before_after_sections(summary: Mapping[str, Any]) -> list[tuple[str, str, list[list[str]]]]:
    """(id, title, rows) of each table of a comparison's ``--json`` summary."""
    stage_rows = [row for name, figures in summary["stages"].items() for row in _ms_rows(figures, name)]
    return [
        ("compare-latency", "Request latency (ms)", _ms_rows(summary["latency_ms"], "request")),
        ("compare-stages", "Stages (ms per request that ran them)", stage_rows),
        ("compare-bottlenecks", "Bottleneck (share of requests)", _share_rows(summary["bottleneck_share"])),
        ("compare-diagnoses", "Diagnoses (share of requests)", _share_rows(summary["diagnosis_rate"])),
    ]


def _compare_title(summary: Mapping[str, Any]) -> str:
    b, a = summary["before"], summary["after"]
    return (
        f"{b['label']} ({b['traces']} traces) against {a['label']} ({a['traces']} traces); 95 % intervals from "
        f"{summary['resamples']} bootstrap resamples, significant where the family-wise interval excludes no "
        "change"
    )


def before_after_text(summary: Mapping[str, Any], title: str = "stagetrace report --compare") -> str:
    out = [f"{title}: {_compare_title(summary)}"]
    for _, heading, rows in before_after_sections(summary):
        if rows:
            out += ["", heading, _table(COMPARE_HEADERS, rows, "lrrrrl")]
    return "\n".join(out)


def before_after_html(summary: Mapping[str, Any], title: str = "stagetrace report --compare") -> str:
    body = [f"<h1>{_esc(title)}</h1>", f'<p class="counts">{_esc(_compare_title(summary))}</p>']
    for table_id, heading, rows in before_after_sections(summary):
        if rows:
            body.append(f"<h2>{_esc(heading)}</h2>")
            body.append(_html_table(table_id, COMPARE_HEADERS, rows))
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_esc(title)}</title>'
        f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>"
    )
