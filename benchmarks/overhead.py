"""Per-stage overhead, measured side by side in one run.

    python benchmarks/overhead.py [--pipelines 2000] [--stages 8] [--rounds 5]
    python benchmarks/overhead.py --instructions [--pipelines 150]   # valgrind: instructions, per thread

(a) the classic dict profiler: two perf_counter_ns calls and a dict store per stage;
(b) one OpenTelemetry SDK span per stage (start_as_current_span) with BatchSpanProcessor and a no-op exporter;
(c) stagetrace's hot path: `with stagetrace.stage(...)` on the request thread (thread CPU time);
(d) stagetrace's total CPU per stage over all processes: the hot path and the helper thread in this process,
    plus the exporter process (analysis, verdict, metrics, span building, OTLP encoding and sending of the
    kept traces to a local sink that drops them), default sampling; /proc/<pid>/stat, 10 ms ticks.
Each is the median over interleaved rounds of (time with K stages - time with 0 stages) / (pipelines * K),
so the per-pipeline root cost is subtracted. Targets: (c) <= 0.1 x (b); (d) <= 0.5 x (b). Timings are
CPU time, which is steadier than wall time on a shared VM.

``--instructions`` counts CPU instructions instead (valgrind's callgrind, one count per thread and per
process), which move well under 1 % between runs where CPU times move 20 %: each variant runs a root and
five children N and 2N times, so start-up cancels, and once more with no children, so the root cancels.
"stages of 0.6 ms": stages long enough to read their thread's schedstat at entry and exit (shorter ones read
the thread's CPU clock), each asleep for the 0.6 ms (a call, counted with the stage).
Counted apart: the request thread, the application's other threads (the helper thread: packing and the
pipe; the GIL monitor is off, since it wakes on wall time, which valgrind stretches) and the exporter
process (analysis, metrics, spans and OTLP encoding of every trace, sent to a sink that drops them).
Needs ``apt-get install valgrind``.
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


# --- instruction counts (--instructions) ------------------------------------------------------------------

CHILDREN = 5
LONG_STAGE_S = 0.0006  # past CPU_ACCOUNTING_MIN_MS (0.5 ms): the stage reads schedstat
INSTRUCTION_VARIANTS = {
    # name: (label, children are stages or spans, STAGETRACE_LIGHT_SPANS)
    "sdk": ("OTel SDK: root + spans, BatchSpanProcessor, no-op exporter", "spans", None),
    "stages": ("stagetrace: root + stages", "stages", "on"),
    # A stage of 0.5 ms or more (here 0.6 ms asleep) also reads its thread's schedstat at entry and exit, where
    # a shorter one reads the thread's CPU clock: the counted difference is the stage's own, the sleep costs
    # a call.
    "stages-long": ("stagetrace: root + stages of 0.6 ms (schedstat read)", "stages-long", "on"),
    "light": ("stagetrace: root + other instrumentations' spans (light spans)", "spans", "on"),
    "sdk-spans": ("stagetrace: root + other instrumentations' spans, STAGETRACE_LIGHT_SPANS=off", "spans", "off"),
}


def instruction_workload(variant: str, children: int, pipelines: int) -> None:
    """One counted run: ``pipelines`` roots with ``children`` children each, everything flushed and shut
    down (with a deadline long enough for valgrind's pace)."""
    _, kind, light = INSTRUCTION_VARIANTS[variant]
    names = STAGE_NAMES[:children]
    if light is None:
        provider = TracerProvider(shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(NoopExporter()))

        def finish() -> None:
            provider.shutdown()

    else:
        from stagetrace.handoff import shipper

        # The helper thread works when the flush asks, not on its wall-clock schedule (which valgrind
        # stretches): its count is then its work, packing and writing, not its wake-ups.
        shipper.FLUSH_POLL_S = 1.0  # type: ignore[attr-defined]
        os.environ["STAGETRACE_LIGHT_SPANS"] = light
        settings = stagetrace.Settings(
            gil_sampler_period_s=0,
            healthy_sample=1.0,
            export_budget_per_s=None,
            poll_interval_s=3600.0,
            shutdown_timeout_s=600.0,  # the exporter ends on its own, so that its count is written
        )
        handle = stagetrace.configure("bench", set_global=False, settings=settings)
        provider = handle.tracer_provider

        def finish() -> None:
            handle.force_flush(600)
            handle.shutdown()

    tracer = provider.get_tracer("bench")
    stages = [stagetrace.stage(n) for n in names]
    # Everything made so far (the interpreter's modules, the set-up) moves out of the collector's generations:
    # a full collection traverses it all, several million instructions landing in whichever thread and run
    # triggers one, which moved a figure by 2-3 k a stage between runs of the same code. The workload's own
    # objects are still collected, and counted, as before.
    gc.collect()
    gc.freeze()
    for _ in range(pipelines):
        with tracer.start_as_current_span("request"):
            if kind == "stages":
                for st in stages:
                    with st:
                        pass
            elif kind == "stages-long":
                for st in stages:
                    with st:
                        time.sleep(LONG_STAGE_S)
            else:
                for name in names:
                    with tracer.start_as_current_span(name):
                        pass
    finish()
    sys.stdout.flush()
    os._exit(0)


def _callgrind_counts(directory: str) -> dict[str, int]:
    """Instructions of the workload's main thread, its other threads, and its child processes, from
    callgrind's per-thread files (``cg.<pid>-<thread>``, thread 1 the main thread)."""
    import glob

    per_pid: dict[int, dict[int, int]] = {}
    commands: dict[int, str] = {}
    for path in glob.glob(os.path.join(directory, "cg.*")):
        pid, dash, thread = path.rsplit("cg.", 1)[1].partition("-")
        if not dash:
            continue  # the per-process file, empty with --separate-threads
        total = 0
        with open(path) as f:
            for line in f:
                if line.startswith("cmd:"):
                    commands[int(pid)] = line
                elif line.startswith("summary:"):
                    total = int(line.split()[1])
        per_pid.setdefault(int(pid), {})[int(thread)] = total
    # the workload's process by its command (the lowest pid is not it once pids wrap around)
    app = next(pid for pid, cmd in commands.items() if "--workload" in cmd)
    threads = per_pid.pop(app)
    return {
        "request": threads.get(1, 0),
        "helper": sum(v for t, v in threads.items() if t != 1),
        "exporter": sum(sum(t.values()) for t in per_pid.values()),
    }


def count_instructions(variant: str, children: int, pipelines: int, env: dict[str, str]) -> dict[str, int]:
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        command = [
            "valgrind",
            "--tool=callgrind",
            "--separate-threads=yes",
            "--trace-children=yes",
            f"--callgrind-out-file={directory}/cg.%p",
            f"--log-file={directory}/vg.%p",
            sys.executable,
            os.path.abspath(__file__),
            "--workload",
            variant,
            "--children",
            str(children),
            "--pipelines",
            str(pipelines),
        ]
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        return _callgrind_counts(directory)


def instructions_main(pipelines: int) -> int:
    import shutil
    import subprocess
    import tempfile

    if shutil.which("valgrind") is None:
        print("--instructions needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    from harness import free_port, wait_for_port

    sink_port = free_port()
    here = os.path.dirname(os.path.abspath(__file__))
    sink = subprocess.Popen([sys.executable, os.path.join(here, "e2e.py"), "sink", str(sink_port)])
    out_dir = tempfile.mkdtemp(prefix="stagetrace-icount-")
    env = dict(
        os.environ,
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{sink_port}",
        OTEL_METRICS_EXPORTER="none",
        STAGETRACE_OUTPUT_DIR=out_dir,
        PYTHONHASHSEED="0",
    )
    try:
        wait_for_port(sink_port, sink, timeout_s=30)
        per_unit: dict[tuple[str, int], dict[str, float]] = {}
        for variant in INSTRUCTION_VARIANTS:
            for children in (0, CHILDREN):
                if children == 0 and variant not in ("sdk", "stages"):
                    continue  # stagetrace's root is the same in every stagetrace variant
                small = count_instructions(variant, children, pipelines, env)
                large = count_instructions(variant, children, 2 * pipelines, env)
                per_unit[(variant, children)] = {k: (large[k] - small[k]) / pipelines for k in small}
    finally:
        sink.terminate()
        shutil.rmtree(out_dir, ignore_errors=True)

    def per_child(variant: str, part: str) -> float:
        root = per_unit[("sdk" if variant == "sdk" else "stages", 0)][part]
        return (per_unit[(variant, CHILDREN)][part] - root) / CHILDREN

    sdk_child = per_child("sdk", "request")
    stage = per_child("stages", "request")
    print(
        f"instructions per child span or stage (callgrind; {pipelines} and {2 * pipelines} pipelines of a root "
        f"and {CHILDREN} children, less the root alone), python {sys.version.split()[0]}"
    )
    print(f"{'variant':72} {'request':>9} {'x SDK':>6} {'x stage':>8} {'helper':>8} {'exporter':>9}")
    for variant, (label, _, _) in INSTRUCTION_VARIANTS.items():
        req = per_child(variant, "request")
        print(
            f"{label:72} {req / 1e3:8.1f}k {req / sdk_child:6.2f} {req / stage:8.2f} "
            f"{per_child(variant, 'helper') / 1e3:7.1f}k {per_child(variant, 'exporter') / 1e3:8.1f}k"
        )
    root_st = per_unit[("stages", 0)]
    root_sdk = per_unit[("sdk", 0)]
    print(
        f"root alone: stagetrace {root_st['request'] / 1e3:.1f}k request / {root_st['helper'] / 1e3:.1f}k helper / "
        f"{root_st['exporter'] / 1e3:.1f}k exporter; SDK {root_sdk['request'] / 1e3:.1f}k request"
    )
    light = per_child("light", "request")
    print(
        f"target: a stage <= 0.2 x an SDK span: {'PASS' if stage <= 0.2 * sdk_child else 'FAIL'} "
        f"({stage / sdk_child:.2f} x)"
    )
    print(
        f"target: another instrumentation's span <= 1.5 x a stage: {'PASS' if light <= 1.5 * stage else 'FAIL'} "
        f"({light / stage:.2f} x)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipelines", type=int, default=2000)
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--instructions", action="store_true", help="count instructions under valgrind instead")
    ap.add_argument("--workload", choices=sorted(INSTRUCTION_VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--children", type=int, default=CHILDREN, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.workload:
        instruction_workload(args.workload, args.children, args.pipelines)
    if args.instructions:
        return instructions_main(args.pipelines if args.pipelines != 2000 else 150)
    p, k = args.pipelines, args.stages

    sdk_tp = TracerProvider(shutdown_on_exit=False)
    sdk_bsp = BatchSpanProcessor(NoopExporter())
    sdk_tp.add_span_processor(sdk_bsp)
    sdk_body = make_sdk_body(sdk_tp.get_tracer("bench"))

    import subprocess

    from harness import free_port, wait_for_port
    from proctree import process_cpu_s, tree_cpu_s

    sink_port = free_port()
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
