"""What attributing a dynamic batch to its requests costs, side by side in one run.

    python benchmarks/batching.py [--requests 4000] [--batch 16] [--rounds 3]

Requests go through batches of ``--batch``: each request opens its server-like root span and its wait; the
worker runs one batch of three stages (h2d, forward, d2h); the roots end. Variants, each in its own process
exporting OTLP/HTTP to the same local sink (which drops what it gets):

  uninstrumented  the same loop, no tracing: the floor that is subtracted;
  hand-written    OpenTelemetry SDK by hand, what stagetrace replaces: per request a root and a wait span,
                  and per member a copy of the batch's span and its three stages (the batch's timings
                  repeated on every member, Triton-style), plus one batch span linking the members;
                  BatchSpanProcessor, OTLP/HTTP;
  stagetrace      ``enqueue()`` / ``batch()``, default tail sampling (10 % of healthy traces exported);
  stagetrace-all  the same, every trace exported.

Reported per request: CPU of the application process, and of its whole process tree (the exporter process
included), from /proc/<pid>/stat, minus the uninstrumented floor; the median over interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from proctree import process_cpu_s, tree_cpu_s

VARIANTS = ("uninstrumented", "hand-written", "stagetrace", "stagetrace-all")
STAGES = ("h2d", "forward", "d2h")


EVERY_TRACE = {"STAGETRACE_HEALTHY_SAMPLE": "1.0", "STAGETRACE_EXPORT_BUDGET": "off"}  # stagetrace-all


def _work() -> None:
    sum(range(50))  # a token amount of work per stage


def run_uninstrumented(requests: int, batch: int) -> None:
    for _ in range(requests // batch):
        members = [object() for _ in range(batch)]
        for _ in STAGES:
            _work()
        del members


def run_handwritten(requests: int, batch: int, tracer) -> None:
    from opentelemetry.trace import Link, set_span_in_context

    for _ in range(requests // batch):
        roots, waits = [], []
        for _ in range(batch):
            root = tracer.start_span("request")
            roots.append(root)
            waits.append(tracer.start_span("infer.queue", context=set_span_in_context(root)))
        batch_start = time.time_ns()
        for w in waits:
            w.end(end_time=batch_start)
        links = [Link(r.get_span_context()) for r in roots]
        batch_span = tracer.start_span("infer", links=links, start_time=batch_start)
        times = []
        for name in STAGES:
            t0 = time.time_ns()
            with tracer.start_as_current_span(name, context=set_span_in_context(batch_span)):
                _work()
            times.append((name, t0, time.time_ns()))
        batch_span.end()
        batch_end = time.time_ns()
        for i, root in enumerate(roots):  # the batch's timings, repeated on every member
            head = tracer.start_span(
                "infer", context=set_span_in_context(root), start_time=batch_start, attributes={"batch.index": i}
            )
            for name, t0, t1 in times:
                tracer.start_span(name, context=set_span_in_context(head), start_time=t0).end(end_time=t1)
            head.end(end_time=batch_end)
            root.end()


def run_stagetrace(requests: int, batch: int, tracer) -> None:
    from opentelemetry.trace import use_span

    import stagetrace

    for _ in range(requests // batch):
        roots, tickets = [], []
        for _ in range(batch):
            root = tracer.start_span("request")
            with use_span(root, end_on_exit=False):
                tickets.append(stagetrace.enqueue("infer.queue"))
            roots.append(root)
        with stagetrace.batch("infer", tickets, max_size=batch):
            for name in STAGES:
                with stagetrace.stage(name, kind="gpu" if name == "forward" else "cpu"):
                    _work()
        for root in roots:
            root.end()


def child(variant: str, requests: int, batch: int, rounds: int) -> None:
    """Runs one variant: a warm-up, then ``rounds`` timed runs, printing the CPU of each as JSON."""
    flush = lambda: None  # noqa: E731
    if variant == "uninstrumented":
        body = lambda n: run_uninstrumented(n, batch)  # noqa: E731
    elif variant == "hand-written":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        tracer = provider.get_tracer("bench")
        body = lambda n: run_handwritten(n, batch, tracer)  # noqa: E731
        flush = lambda: provider.force_flush()  # noqa: E731
    else:
        import stagetrace

        handle = stagetrace.configure("bench", set_global=False)
        tracer = handle.tracer_provider.get_tracer("bench")
        body = lambda n: run_stagetrace(n, batch, tracer)  # noqa: E731
        flush = lambda: handle.force_flush(60)  # noqa: E731
    body(requests // 4)
    flush()
    time.sleep(0.5)
    pid = os.getpid()
    for _ in range(rounds):
        app0, tree0 = process_cpu_s(pid), tree_cpu_s(pid)
        body(requests)
        flush()
        time.sleep(0.3)  # the exporter's last batch
        flush()
        print(json.dumps({"app_s": process_cpu_s(pid) - app0, "tree_s": tree_cpu_s(pid) - tree0}), flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        child(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    from harness import free_port, wait_for_port

    port = free_port()
    sink_proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "e2e.py"), "sink", str(port)])
    results: dict[str, dict[str, list[float]]] = {v: {"app": [], "tree": []} for v in VARIANTS}
    try:
        wait_for_port(port, sink_proc, timeout_s=30)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}", OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
        for _ in range(args.rounds):  # interleaved: each variant once per round, in its own process
            for v in VARIANTS:
                venv = dict(env, **(EVERY_TRACE if v == "stagetrace-all" else {}))
                name = "stagetrace" if v == "stagetrace-all" else v
                out = subprocess.run(
                    [sys.executable, __file__, "child", name, str(args.requests), str(args.batch), "1"],
                    env=venv,
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=True,
                )
                row = json.loads(out.stdout.strip().splitlines()[-1])
                results[v]["app"].append(row["app_s"])
                results[v]["tree"].append(row["tree_s"])
    finally:
        sink_proc.terminate()
        sink_proc.wait(timeout=10)
    per_req = {v: {k: statistics.median(x) / args.requests * 1e6 for k, x in r.items()} for v, r in results.items()}
    floor = per_req["uninstrumented"]
    hand = {k: per_req["hand-written"][k] - floor[k] for k in ("app", "tree")}
    print(f"{args.requests} requests in batches of {args.batch}, 3 batch stages; median of {args.rounds} rounds")
    print("| variant | app CPU µs/req | x hand-written | tree CPU µs/req | x hand-written |")
    print("|---|---:|---:|---:|---:|")
    for v in VARIANTS[1:]:
        app = per_req[v]["app"] - floor["app"]
        tree = per_req[v]["tree"] - floor["tree"]
        print(f"| {v} | {app:.1f} | {app / hand['app']:.3f} | {tree:.1f} | {tree / hand['tree']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
