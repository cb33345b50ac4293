"""Per-stage overhead, measured side by side in one run (issue 2, item 9).

    python benchmarks/overhead.py [--pipelines 2000] [--stages 8] [--rounds 5]

(a) the classic dict profiler: two perf_counter_ns calls and a dict store per stage;
(b) one OpenTelemetry SDK span per stage (start_as_current_span) with BatchSpanProcessor and a no-op exporter;
(c) stagetrace's hot path: `with stagetrace.stage(...)` on the request thread (thread CPU time);
(d) stagetrace's total CPU per stage over all processes: the hot path and the helper thread in this process,
    plus the exporter process (analysis, verdict, metrics, span building, OTLP encoding and sending of the
    kept traces to a local sink that drops them), default sampling; /proc/<pid>/stat, 10 ms ticks.
Each is the median over interleaved rounds of (time with K stages - time with 0 stages) / (pipelines * K),
so the per-pipeline root cost is subtracted. Targets: (c) <= 0.1 x (b); (d) <= 0.5 x (b). Timings are
CPU time, which is steadier than wall time on a shared VM.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

os.environ.setdefault("OTEL_BSP_MAX_QUEUE_SIZE", "1000000")
os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "200")

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

import stagetrace


class NoopExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


STAGE_NAMES = ["receive", "decode", "resize", "to_tensor", "h2d", "infer", "d2h", "postprocess", "json", "log"]


def classic(pipelines: int, k: int) -> None:
    pc = time.perf_counter_ns
    names = STAGE_NAMES[:k]
    for _ in range(pipelines):
        d: dict[str, float] = {}
        t0 = pc()
        for name in names:
            s = pc()
            d[name] = (pc() - s) / 1e6
        d["total"] = (pc() - t0) / 1e6


def make_sdk_body(tracer) -> Callable[[int, int], None]:
    def body(pipelines: int, k: int) -> None:
        names = STAGE_NAMES[:k]
        for _ in range(pipelines):
            with tracer.start_as_current_span("request"):
                for name in names:
                    with tracer.start_as_current_span(name):
                        pass

    return body


def stagetrace_body(pipelines: int, k: int) -> None:
    stages = [stagetrace.stage(n) for n in STAGE_NAMES[:k]]
    for _ in range(pipelines):
        with stagetrace.pipeline("request"):
            for s in stages:
                with s:
                    pass


def per_stage_us(clock: Callable[[], int], body, pipelines: int, k: int, settle: Callable[[], None]) -> float:
    def timed(kk: int) -> int:
        settle()
        gc.collect()
        t0 = clock()
        body(pipelines, kk)
        settle()
        return clock() - t0

    return (timed(k) - timed(0)) / (pipelines * k) / 1000


def encode_one_span_us(sample: int = 4096) -> float:
    tp = TracerProvider(shutdown_on_exit=False)
    tracer = tp.get_tracer("bench")
    spans = []
    for name in STAGE_NAMES * (sample // len(STAGE_NAMES)):
        s = tracer.start_span(name, attributes={"stagetrace.stage": name, "stagetrace.stage.kind": "cpu"})
        s.end()
        spans.append(s)
    t0 = time.process_time_ns()
    for i in range(0, len(spans), 512):
        encode_spans(spans[i : i + 512]).SerializeToString()
    return (time.process_time_ns() - t0) / len(spans) / 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipelines", type=int, default=2000)
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    p, k = args.pipelines, args.stages

    sdk_tp = TracerProvider(shutdown_on_exit=False)
    sdk_bsp = BatchSpanProcessor(NoopExporter())
    sdk_tp.add_span_processor(sdk_bsp)
    sdk_body = make_sdk_body(sdk_tp.get_tracer("bench"))

    import subprocess

    from e2e import _free_port
    from proctree import process_cpu_s, tree_cpu_s

    from stagetrace.testing.load import wait_for_port

    sink_port = _free_port()
    here = os.path.dirname(os.path.abspath(__file__))
    sink = subprocess.Popen([sys.executable, os.path.join(here, "e2e.py"), "sink", str(sink_port)])
    wait_for_port(sink_port, sink, timeout_s=30)
    os.environ.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{sink_port}", OTEL_METRICS_EXPORTER="none")
    handle = stagetrace.configure("bench", set_global=False)

    def all_processes_ns() -> int:
        """This process and the exporter process, not the sink."""
        return int((tree_cpu_s(os.getpid()) - process_cpu_s(sink.pid)) * 1e9)

    def no_settle() -> None:
        pass

    def sdk_settle() -> None:
        sdk_bsp.force_flush()

    def st_settle() -> None:
        handle.force_flush(60)

    results: dict[str, list[float]] = {"a": [], "b": [], "c": [], "c0": [], "d": []}
    cpu_signals = handle.runtime.cpu_signals

    def without_cpu_accounting(pipelines: int, k: int) -> None:
        handle.runtime.cpu_signals = None
        try:
            stagetrace_body(pipelines, k)
        finally:
            handle.runtime.cpu_signals = cpu_signals

    thread_cpu = time.thread_time_ns
    for _ in range(args.rounds):
        results["a"].append(per_stage_us(thread_cpu, classic, p, k, no_settle))
        results["b"].append(per_stage_us(thread_cpu, sdk_body, p, k, sdk_settle))
        results["c"].append(per_stage_us(thread_cpu, stagetrace_body, p, k, no_settle))
        results["c0"].append(per_stage_us(thread_cpu, without_cpu_accounting, p, k, no_settle))
        st_settle()
        results["d"].append(per_stage_us(all_processes_ns, stagetrace_body, p, k, st_settle))
    encode = statistics.median(encode_one_span_us() for _ in range(3))
    handle.shutdown()
    sdk_tp.shutdown()
    sink.terminate()

    med = {key: statistics.median(v) for key, v in results.items()}
    b = med["b"]
    rows = [
        ("a", "classic dict profiler (request thread)", med["a"]),
        ("b", "OTel SDK span + BatchSpanProcessor, no-op exporter (request thread)", b),
        ("c", "stagetrace hot path (request thread), CPU accounting on (default)", med["c"]),
        ("c0", "stagetrace hot path, timestamps only (Settings(cpu_signals=False))", med["c0"]),
        ("d", "stagetrace total, all processes (exporter: verdict, metrics, export)", med["d"]),
        ("", "SDK OTLP protobuf encoding of one span (reference)", encode),
    ]
    print(
        f"stagetrace overhead per stage: {p} pipelines x {k} stages, {args.rounds} rounds, median; "
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    print(f"{'':3} {'variant':68} {'us/stage':>9} {'x (b)':>7}")
    for key, label, us in rows:
        print(f"{key:3} {label:68} {us:9.2f} {us / b:7.3f}")
    for key in ("c", "c0"):
        verdict = "PASS" if med[key] <= 0.1 * b else "FAIL"
        print(f"target ({key}) <= 0.1 x (b): {verdict} ({med[key] / b:.3f} x)")
    print(f"target (d) <= 0.5 x (b): {'PASS' if med['d'] <= 0.5 * b else 'FAIL'} ({med['d'] / b:.3f} x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
