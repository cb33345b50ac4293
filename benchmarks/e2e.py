"""End-to-end cost under load, measured side by side in one run.

    python benchmarks/e2e.py [--requests 1000] [--concurrency 8] [--rounds 3] [--workload both]

The same FastAPI endpoint (6 stages, ~9 ms of work a request) served by uvicorn, each variant in its own
server process on 127.0.0.1:
  uninstrumented    no OpenTelemetry at all;
  contrib-only      the contrib FastAPI instrumentation alone (server span, no stages);
  native-only       FastAPI's own telemetry alone (0.142+: server span and operation spans, no stages),
                    an SDK provider with a BatchSpanProcessor;
  handwritten       the contrib FastAPI instrumentation plus one SDK span per stage (what a user writes
                    today), BatchSpanProcessor;
  stagetrace        stagetrace.instrument_fastapi (FastAPI's own telemetry where FastAPI has it), every
                    signal on, the default local tail sampling (slow, diagnosed and errored traces, and
                    10 % of the healthy ones, exported in full within the export budget);
  stagetrace-contrib the same on the contrib instrumentation (instrument_fastapi(telemetry="contrib"));
  stagetrace-all    the same with STAGETRACE_HEALTHY_SAMPLE=1.0 and STAGETRACE_EXPORT_BUDGET=off (every
                    trace exported);
  stagetrace-thread the default, with STAGETRACE_EXPORT_PROCESS=off (the exporter's work on a thread of
                    the server process).
Two workloads: "gil-free" (zlib compression, which releases the GIL; the thread pool as FastAPI sets it)
and "gil-bound" (pure-Python stage work, one worker thread).
Every instrumented variant exports OTLP/HTTP to the same local sink process (it answers and drops the
bytes; it is not part of any server's process tree), so encoding and sending cost alike. Rounds interleave
the variants; the table shows the median throughput, the pooled p50/p99 latency seen by the client, and
CPU per request from /proc/<pid>/stat: of the server process, and of its whole process tree (the
exporter process included).
Targets (both workloads): stagetrace throughput >= 0.97 x its baseline (native-only where FastAPI has its
own telemetry, else contrib-only) and >= 1.10 x handwritten; stagetrace-contrib's CPU per request added over
contrib-only, whole tree, <= 0.25 x what handwritten adds; stagetrace-all still >= handwritten in
throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from proctree import process_cpu_s, tree_cpu_s

from stagetrace.testing.load import wait_for_port

STAGES = (
    ("decode", 2.0),
    ("resize", 1.5),
    ("to_tensor", 1.0),
    ("infer", 3.0),
    ("postprocess", 1.0),
    ("serialize", 0.5),
)
_BLOCK = os.urandom(64 * 1024)


def gil_free_work(ms: float) -> int:
    """zlib over random bytes for about ``ms`` milliseconds (zlib releases the GIL while it compresses)."""
    total = 0
    for _ in range(max(1, int(ms * _PER_MS["gil-free"]))):
        total += len(zlib.compress(_BLOCK, 1))
    return total


def gil_bound_work(ms: float) -> int:
    """A pure-Python loop for about ``ms`` milliseconds: holds the GIL throughout."""
    total = 0
    for i in range(max(1, int(ms * _PER_MS["gil-bound"]))):
        total += i * i % 7
    return total


WORK = {"gil-free": gil_free_work, "gil-bound": gil_bound_work}


def _calibrate() -> dict[str, float]:
    out = {}
    t0 = time.perf_counter()
    for _ in range(40):
        zlib.compress(_BLOCK, 1)
    out["gil-free"] = 40 / ((time.perf_counter() - t0) * 1000)
    t0 = time.perf_counter()
    n = 0
    for i in range(300_000):
        n += i * i % 7
    out["gil-bound"] = 300_000 / ((time.perf_counter() - t0) * 1000)
    return out


_PER_MS = {"gil-free": 1.0, "gil-bound": 1.0}


def make_app(variant: str, workload: str):
    from fastapi import FastAPI

    work = WORK[workload]
    app = FastAPI()
    if variant == "uninstrumented":

        @app.get("/predict")
        def predict():
            return {"n": sum(work(ms) for _, ms in STAGES)}

    elif variant == "native-only":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        app = FastAPI(telemetry={"tracer_provider": provider, "metrics": False, "logs": False})

        @app.get("/predict")
        def predict():
            return {"n": sum(work(ms) for _, ms in STAGES)}

    elif variant in ("handwritten", "contrib-only"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        tracer = provider.get_tracer("bench")

        if variant == "contrib-only":

            @app.get("/predict")
            def predict():
                return {"n": sum(work(ms) for _, ms in STAGES)}

        else:

            @app.get("/predict")
            def predict():
                n = 0
                for name, ms in STAGES:
                    with tracer.start_as_current_span(name):
                        n += work(ms)
                return {"n": n}

        FastAPIInstrumentor.instrument_app(app, tracer_provider=provider, exclude_spans=["send", "receive"])
    else:
        import stagetrace

        stagetrace.configure("bench")  # OTLP/HTTP to the sink, from the OTEL_* variables
        stages = [(stagetrace.stage(name), ms) for name, ms in STAGES]

        @app.get("/predict")
        def predict():
            n = 0
            for stage, ms in stages:
                with stage:
                    n += work(ms)
            return {"n": n}

        stagetrace.instrument_fastapi(app, telemetry="contrib" if variant == "stagetrace-contrib" else "auto")
    if workload == "gil-bound":

        @app.on_event("startup")
        async def one_worker_thread() -> None:
            import anyio.to_thread

            anyio.to_thread.current_default_thread_limiter().total_tokens = 1

    return app


class _Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that reads each request and drops it (an empty protobuf is a valid reply)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


def sink(port: int) -> None:
    ThreadingHTTPServer(("127.0.0.1", port), _Sink).serve_forever()


def serve(variant: str, workload: str, port: int) -> None:
    import uvicorn

    _PER_MS.update({k: float(v) for k, v in (kv.split("=") for kv in os.environ["E2E_PER_MS"].split(","))})
    app = make_app(variant, workload)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _load(base: str, n: int, concurrency: int) -> tuple[float, list[float]]:
    import httpx

    latencies: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:

        async def one() -> None:
            async with sem:
                t0 = time.perf_counter()
                r = await client.get("/predict")
                latencies.append((time.perf_counter() - t0) * 1000)
                r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - t0), latencies


VARIANT_ENV = {
    "stagetrace-all": {"STAGETRACE_HEALTHY_SAMPLE": "1.0", "STAGETRACE_EXPORT_BUDGET": "off"},
    "stagetrace-thread": {"STAGETRACE_EXPORT_PROCESS": "off"},
}
VARIANTS = (
    "uninstrumented",
    "contrib-only",
    "native-only",
    "handwritten",
    "stagetrace",
    "stagetrace-contrib",
    "stagetrace-all",
    "stagetrace-thread",
)


def start_server(variant: str, workload: str, per_ms: dict[str, float], sink_port: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
    env.update(
        E2E_PER_MS=",".join(f"{k}={v}" for k, v in per_ms.items()),
        # This directory first, then the caller's own path (a checkout being measured rather than the install).
        PYTHONPATH=os.pathsep.join(
            filter(None, (os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")))
        ),
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{sink_port}",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        **VARIANT_ENV.get(variant, {}),
    )
    proc = subprocess.Popen([sys.executable, __file__, "serve", variant, workload, str(port)], env=env)
    wait_for_port(port, proc, timeout_s=30)
    return proc, f"http://127.0.0.1:{port}"


def run_workload(workload: str, args: argparse.Namespace, per_ms: dict[str, float], sink_port: int) -> dict:
    throughput: dict[str, list[float]] = {v: [] for v in VARIANTS}
    latency: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu = {v: {"server": 0.0, "tree": 0.0, "requests": 0} for v in VARIANTS}
    servers = {v: start_server(v, workload, per_ms, sink_port) for v in VARIANTS}
    try:
        for _, base in servers.values():
            asyncio.run(_load(base, 200, args.concurrency))  # warm-up
        time.sleep(1.0)
        for _ in range(args.rounds):
            for v in VARIANTS:
                proc, base = servers[v]
                s0, t0 = process_cpu_s(proc.pid), tree_cpu_s(proc.pid)
                rps, lat = asyncio.run(_load(base, args.requests, args.concurrency))
                time.sleep(0.3)  # what the request left to background threads and the exporter
                cpu[v]["server"] += process_cpu_s(proc.pid) - s0
                cpu[v]["tree"] += tree_cpu_s(proc.pid) - t0
                cpu[v]["requests"] += args.requests
                throughput[v].append(rps)
                latency[v].extend(lat)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    rows = {}
    for v in VARIANTS:
        q = statistics.quantiles(latency[v], n=100)
        n = cpu[v]["requests"]
        rows[v] = {
            "rps": statistics.median(throughput[v]),
            "p50": q[49],
            "p99": q[98],
            "server_ms": cpu[v]["server"] * 1000 / n,
            "tree_ms": cpu[v]["tree"] * 1000 / n,
        }
    return rows


def report(workload: str, rows: dict, args: argparse.Namespace) -> bool:
    base = rows["uninstrumented"]
    print(
        f"\ne2e, {workload} workload: 6 stages (~9 ms a request), {args.requests} requests x {args.rounds} rounds, "
        f"concurrency {args.concurrency}, {os.cpu_count()} CPUs"
    )
    print(
        f"{'variant':18} {'req/s':>7} {'x uninstr.':>10} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'server CPU ms/req':>17} {'tree CPU ms/req':>15} {'tree added ms/req':>17}"
    )
    for v, r in rows.items():
        print(
            f"{v:18} {r['rps']:7.1f} {r['rps'] / base['rps']:10.3f} {r['p50']:7.2f} {r['p99']:7.2f} "
            f"{r['server_ms']:17.3f} {r['tree_ms']:15.3f} {r['tree_ms'] - base['tree_ms']:17.3f}"
        )
    st, contrib, hand, keep_all = rows["stagetrace"], rows["contrib-only"], rows["handwritten"], rows["stagetrace-all"]
    st_contrib, native = rows["stagetrace-contrib"], rows["native-only"]
    added_st = st_contrib["tree_ms"] - contrib["tree_ms"]
    added_hand = hand["tree_ms"] - contrib["tree_ms"]
    checks = [
        (
            "stagetrace throughput >= 0.97 x native-only (its own server span)",
            st["rps"] / native["rps"],
            st["rps"] >= 0.97 * native["rps"],
        ),
        (
            "stagetrace-contrib throughput >= 0.97 x contrib-only",
            st_contrib["rps"] / contrib["rps"],
            st_contrib["rps"] >= 0.97 * contrib["rps"],
        ),
        ("stagetrace throughput >= 1.10 x handwritten", st["rps"] / hand["rps"], st["rps"] >= 1.10 * hand["rps"]),
        (
            "stagetrace-contrib CPU added over contrib-only <= 0.25 x handwritten's (tree)",
            added_st / added_hand if added_hand > 0 else float("nan"),
            added_hand > 0 and added_st <= 0.25 * added_hand,
        ),
        ("stagetrace-all throughput >= handwritten", keep_all["rps"] / hand["rps"], keep_all["rps"] >= hand["rps"]),
    ]
    ok = True
    for label, ratio, passed in checks:
        ok &= passed
        print(f"target {label}: {'PASS' if passed else 'FAIL'} ({ratio:.3f})")
    return ok


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        serve(argv[1], argv[2], int(argv[3]))
        return 0
    if argv[:1] == ["sink"]:
        sink(int(argv[1]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", choices=("gil-free", "gil-bound", "both"), default="both")
    args = ap.parse_args(argv)
    per_ms = _calibrate()
    sink_port = _free_port()
    sink_proc = subprocess.Popen([sys.executable, __file__, "sink", str(sink_port)])
    try:
        wait_for_port(sink_port, sink_proc, timeout_s=30)
        workloads = ("gil-free", "gil-bound") if args.workload == "both" else (args.workload,)
        for workload in workloads:
            report(workload, run_workload(workload, args, per_ms, sink_port), args)
    finally:
        sink_proc.terminate()
        sink_proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
