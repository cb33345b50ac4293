"""Runs the demo: service, load, tables, HTML report."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import stagetrace
from stagetrace.analysis import Verdict
from stagetrace.report.aggregate import Aggregator
from stagetrace.report.render import html_report, text_report


class _Progress:
    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = 0
        self.errors = 0
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._last_pct = -1

    def tick(self, ok: bool) -> None:
        self.done += 1
        self.errors += not ok
        if not self.enabled:
            return
        pct = self.done * 100 // self.total
        if not self.tty and pct // 25 == self._last_pct // 25 and self.done != self.total:
            return
        self._last_pct = pct
        width = 30
        filled = width * self.done // self.total
        rate = self.done / max(1e-9, time.monotonic() - self.t0)
        line = f"{self.label:<22} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {rate:6.1f} req/s"
        sys.stderr.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _serve(app: Any) -> tuple[Any, threading.Thread, str]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="demo-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the demo server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


class Lived(NamedTuple):
    """What the clients lived, as they timed it (milliseconds)."""

    total: list[float]  # each successful request, to the last byte of its response
    first_event: list[float]  # each streamed one, to its first server-sent event (time to first token)


def _drive(
    url: str,
    path: str,
    requests: int,
    concurrency: int,
    payload: bytes,
    progress: _Progress,
    content_type: str = "application/octet-stream",
) -> Lived:
    """Run the load generator; how long each successful request lived, as its client timed it."""
    lived = Lived([], [])
    with tempfile.NamedTemporaryFile(delete=False, suffix=".bin") as fh:
        fh.write(payload)
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stagetrace.demo.load",
                url,
                path,
                str(requests),
                str(concurrency),
                fh.name,
                content_type,
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            ok = line.startswith("ok")
            if ok:
                fields = line.split()
                lived.total.append(float(fields[1]))
                if len(fields) > 2:
                    lived.first_event.append(float(fields[2]))
            progress.tick(ok)
        proc.wait(timeout=60)
    finally:
        os.unlink(fh.name)
    return lived


def _quantiles(values: list[float]) -> str:
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

    return f"p50 {q(0.50):.1f} ms, p95 {q(0.95):.1f} ms, p99 {q(0.99):.1f} ms"


def _clients_line(lived: Lived) -> str:
    """The latency the clients lived, to read beside the traces' own (they should agree: a trace starts
    when its request reached the server, event-loop wait included); for streams, their first event too."""
    if not lived.total:
        return "as the clients timed them: no request succeeded"
    line = f"as the clients timed them: {_quantiles(lived.total)}"
    if lived.first_event:
        line += f"; first event (time to first token) {_quantiles(lived.first_event)}"
    return line


def _at(summary: dict[str, Any], path: tuple[str, ...]) -> Any:
    """``summary[path[0]][path[1]]...``, or None where any step is missing."""
    value: Any = summary
    for key in path:
        if not isinstance(value, dict) or value.get(key) is None:
            return None
        value = value[key]
    return value


def _top(counts: dict[str, int]) -> str:
    """The most frequent name and its share: ``detokenize 98%``."""
    name = max(counts, key=counts.__getitem__)
    return f"{name} {counts[name] / sum(counts.values()):.0%}"


Row = tuple[str, str, str]


def _row(
    label: str,
    before: dict[str, Any],
    after: dict[str, Any],
    path: tuple[str, ...],
    fmt: str | Callable[[Any], str] = "{:.2f}",
    missing: str = "-",
) -> Row:
    """One line of the before/after table: the value at ``path`` in each summary, formatted."""
    show = fmt.format if isinstance(fmt, str) else fmt
    b, a = (_at(s, path) for s in (before, after))
    return (label, missing if b is None else show(b), missing if a is None else show(a))


def _names(before: dict[str, Any], after: dict[str, Any], key: str) -> list[str]:
    """The names under ``key`` in either summary, in the order they were first seen."""
    return list(dict.fromkeys([*(before.get(key) or {}), *(after.get(key) or {})]))


QS = ("p50", "p99")


def _stream_rows(b: dict[str, Any], a: dict[str, Any]) -> list[Row]:
    """What the streams' clients lived and which stage held each phase; none without streams."""
    if not (b.get("streams") or a.get("streams")):
        return []
    rows = [_row(f"time to first chunk {q} ms", b, a, ("streams", "first_chunk_ms", q), "{:.1f}") for q in QS]
    rows += [_row(f"gap p99 ms, {q} of streams", b, a, ("streams", "gap_p99_ms", q)) for q in QS]
    rows.append(_row("chunks a stream (mean)", b, a, ("streams", "chunks_mean"), "{:.0f}"))
    rows.append(_row("bottleneck to first chunk", b, a, ("streams", "first_chunk_bottlenecks"), _top))
    rows.append(_row("bottleneck between chunks", b, a, ("streams", "gap_bottlenecks"), _top))
    return rows


def _compare(before: dict[str, Any], after: dict[str, Any]) -> str:
    b, a = before, after
    rows = [_row("traces", b, a, ("traces",), "{}")]
    rows += [_row(f"request {q} ms", b, a, ("total_ms", q), "{:.1f}") for q in ("p50", "p95", "p99")]
    rows.append(_row("slow traces", b, a, ("slow_traces",), "{}"))
    rows += [
        _row(f"  slow by {label}", b, a, ("slow_reasons", reason), "{}", missing="0")
        for reason, label in (("first_chunk", "first chunk"), ("gap", "gaps"))
        if reason in (b.get("slow_reasons") or {}) or reason in (a.get("slow_reasons") or {})
    ]
    rows += _stream_rows(b, a)
    rows += [_row(f"  {name} p50 ms", b, a, ("stages", name, "p50_ms")) for name in _names(b, a, "stages")]
    for name in _names(b, a, "batches"):
        rows.append(_row(f"  {name} batch size (mean)", b, a, ("batches", name, "size_mean"), "{:.1f}"))
        rows.append(_row(f"  {name} batch fill (mean)", b, a, ("batches", name, "fill_mean"), "{:.0%}"))
    for name in _names(b, a, "batch_waits"):
        for key, label in (("formation_p50_ms", "forming"), ("busy_p50_ms", "behind previous")):
            rows.append(_row(f"  {name} {label} p50 ms", b, a, ("batch_waits", name, key)))
    rows += [_row(f"  {code}", b, a, ("diagnoses", code), "{}", missing="0") for code in _names(b, a, "diagnoses")]
    w = max(len(r[0]) for r in rows)
    lines = [f"{'':{w}}  {'before':>10}  {'after (--optimized)':>20}"]
    lines += [f"{label:{w}}  {b:>10}  {a:>20}" for label, b, a in rows]
    return "\n".join(lines)


def _compared(traces: Path, pipeline: str) -> str:
    """The two runs as ``stagetrace report --compare`` reads them: each figure's change with its interval, and
    whether it is beyond noise."""
    from stagetrace.demo import pipelines
    from stagetrace.report.collect import facts_from_files
    from stagetrace.report.compare import compare
    from stagetrace.report.render import before_after_text

    before, after = pipelines.ROUTES[(pipeline, False)], pipelines.ROUTES[(pipeline, True)]
    sides = [facts_from_files([str(traces)], route=route, err=sys.stderr)[0] for route in (before, after)]
    comparison = compare(*sides, before_label=before, after_label=after)
    return before_after_text(comparison.summary(), "stagetrace report --compare")


def run_demo(
    *,
    requests: int | None = None,
    concurrency: int = 8,
    pipeline: str = "image",
    optimized: bool = False,
    out_dir: str = "stagetrace-out",
    slow_threshold_ms: float | None = None,
    progress: bool = True,
    pool_workers: int | None = None,
) -> int:
    """``pool_workers``: the text pipeline's tokenizer pool (None: a worker a CPU)."""
    import torch

    from stagetrace.demo import pipelines

    requests = requests or pipelines.DEFAULT_REQUESTS[pipeline]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("traces-stagetrace-demo-*.jsonl*"), *out.glob("metrics-stagetrace-demo-*.jsonl*")]:
        old.unlink()
    traces_path = out / f"traces-stagetrace-demo-{os.getpid()}.jsonl"
    aggregators: dict[str, Aggregator] = {}

    def on_verdict(v: Verdict) -> None:
        if v.route in aggregators:
            aggregators[v.route].add(v)

    env_exporter = any(os.environ.get(k) for k in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # first: the llm engine measures this machine for its SLO
    app = pipelines.build_app(device, pipeline, pool_workers=pool_workers)
    handle = stagetrace.configure(
        "stagetrace-demo",
        slow_threshold_ms=slow_threshold_ms,
        on_verdict=on_verdict,
        traces_path=None if env_exporter else traces_path,
        # Every trace kept, so that the report written from them covers every request (the production
        # default keeps slow, diagnosed and errored traces and 10 % of the rest, within an export budget).
        settings=stagetrace.Settings(
            healthy_sample=1.0,
            export_budget_per_s=None,
            route_gap_thresholds_ms=dict(getattr(app.state, "gap_thresholds_ms", {})),
        ),
    )
    stagetrace.instrument_fastapi(app)
    payload, content_type = pipelines.make_payload(pipeline)
    server, thread, url = _serve(app)
    summaries: dict[bool, dict[str, Any]] = {}
    clients: dict[bool, Lived] = {}
    try:
        print(
            f"stagetrace demo: {pipeline} pipeline on {device.type}, service at {url}, "
            f"{requests} requests, {concurrency} in flight",
            file=sys.stderr,
        )
        gaps = getattr(app.state, "gap_thresholds_ms", {})
        if gaps:
            first = handle.runtime.settings.stream_thresholds_for(None).first_chunk_ms if handle.runtime else 0.0
            print(
                f"a stream is slow when its first chunk takes over {first:.0f} ms or its gaps' p99 over "
                f"{max(gaps.values()):.1f} ms (4 of this machine's fullest engine rounds)",
                file=sys.stderr,
            )
        for fixed in [False, True] if optimized else [False]:
            route = pipelines.ROUTES[(pipeline, fixed)]
            aggregators[route] = Aggregator()
            bar = _Progress(requests, "optimized" if fixed else "baseline", progress)
            clients[fixed] = _drive(url, route, requests, concurrency, payload, bar, content_type)
            handle.force_flush()
            summaries[fixed] = aggregators[route].summary()
            if bar.errors:
                print(f"{bar.errors} requests failed", file=sys.stderr)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    handle.shutdown()
    route = pipelines.ROUTES[(pipeline, False)]
    agg = aggregators[route]
    if handle.traces_path is not None and handle.traces_path.exists():
        # From the exported traces, as `stagetrace report` reads them: the slowest traces get waterfalls, and
        # the batch executions (traces of their own, seen by no verdict) give the batch tables.
        from stagetrace.report.collect import aggregate_files

        for fixed, summary in summaries.items():
            # The llm engine batches in both runs, and batch executions (with no route) cannot be told apart
            # by run: only the requests' own batch waits are read for it.
            batches = fixed and pipeline != "llm"
            from_file, _ = aggregate_files(
                [str(handle.traces_path)], route=pipelines.ROUTES[(pipeline, fixed)], err=sys.stderr, batches=batches
            )
            summary.update({k: v for k, v in from_file.summary().items() if k in ("batches", "batch_waits")})
            if not fixed:
                agg = from_file
    print(text_report(summaries[False], f"stagetrace demo ({pipeline}, {route})"))
    print(_clients_line(clients[False]))
    if optimized:
        print()
        print(text_report(summaries[True], f"stagetrace demo ({pipeline}, {pipelines.ROUTES[(pipeline, True)]})"))
        print(_clients_line(clients[True]))
        print("\nBefore and after\n" + _compare(summaries[False], summaries[True]))
        if handle.traces_path is not None and handle.traces_path.exists():
            print()
            print(_compared(handle.traces_path, pipeline))
    html_path = out / "report.html"
    title = f"stagetrace demo: {pipeline} pipeline"
    html_path.write_text(html_report(agg.summary(), agg.slowest(), title), encoding="utf-8")
    print()
    if handle.traces_path:
        print(f"traces (OTLP JSON lines): {handle.traces_path}")
        print(f"  summarise them again with: stagetrace report {handle.traces_path.parent}")
    print(f"HTML report: {html_path}")
    return 0
