"""End-to-end overhead under load (issue 4, item 7), measured side by side in one run.

    python benchmarks/e2e.py [--requests 1500] [--concurrency 8] [--rounds 3]

The same FastAPI endpoint (6 stages of real CPU work, ~9 ms a request) served by uvicorn in three variants,
each in its own server process on 127.0.0.1:
  uninstrumented   no OpenTelemetry at all;
  contrib-only     the contrib FastAPI instrumentation alone (server span and HTTP metrics, no stages),
                   to show what any OpenTelemetry FastAPI setup pays before stages;
  handwritten      the contrib FastAPI instrumentation plus one SDK span per stage (what a user writes
                   today), BatchSpanProcessor;
  stagetrace       stagetrace.instrument_fastapi with every signal on (CPU accounting, GIL sampler,
                   loop-lag monitor), stages as stagetrace.stage;
  stagetrace-nocpu the same with per-stage CPU accounting off (Settings(cpu_signals=False)).
Both the hand-written and the stagetrace variants have an SDK MeterProvider, so the contrib HTTP metrics cost
the same in both.
Both instrumented variants export through an exporter that does the OTLP protobuf encoding and drops the
bytes (no network), so export CPU is counted alike. Rounds interleave the variants; the table shows the
median throughput and the pooled p50/p99 latency seen by the client.
Targets: stagetrace throughput >= handwritten, and >= 0.93 x uninstrumented.
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


def cpu_work(ms: float) -> int:
    """Real CPU work (zlib over random bytes) for about ``ms`` milliseconds, calibrated once."""
    n = max(1, int(ms * _PER_MS))
    total = 0
    for _ in range(n):
        total += len(zlib.compress(_BLOCK, 1))
    return total


def _calibrate() -> float:
    t0 = time.perf_counter()
    for _ in range(40):
        zlib.compress(_BLOCK, 1)
    return 40 / ((time.perf_counter() - t0) * 1000)


_PER_MS = 1.0


def make_app(variant: str):
    from fastapi import FastAPI

    app = FastAPI()
    if variant == "uninstrumented":

        @app.get("/predict")
        def predict():
            return {"n": sum(cpu_work(ms) for _, ms in STAGES)}

    elif variant in ("handwritten", "contrib-only"):
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from overhead import EncodingExporter

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(EncodingExporter()))
        tracer = provider.get_tracer("bench")

        if variant == "contrib-only":

            @app.get("/predict")
            def predict():
                return {"n": sum(cpu_work(ms) for _, ms in STAGES)}

        else:

            @app.get("/predict")
            def predict():
                n = 0
                for name, ms in STAGES:
                    with tracer.start_as_current_span(name):
                        n += cpu_work(ms)
                return {"n": n}

        FastAPIInstrumentor.instrument_app(app, tracer_provider=provider, exclude_spans=["send", "receive"])
    else:
        from overhead import EncodingExporter

        import stagetrace

        stagetrace.configure("bench", span_exporter=EncodingExporter())
        stages = [(stagetrace.stage(name), ms) for name, ms in STAGES]

        @app.get("/predict")
        def predict():
            n = 0
            for stage, ms in stages:
                with stage:
                    n += cpu_work(ms)
            return {"n": n}

        stagetrace.instrument_fastapi(app)
    return app


def serve(variant: str, port: int) -> None:
    import uvicorn

    global _PER_MS
    _PER_MS = float(os.environ["E2E_PER_MS"])
    uvicorn.run(make_app(variant), host="127.0.0.1", port=port, log_level="warning", access_log=False)


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


def start_server(variant: str, per_ms: float) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = dict(
        os.environ,
        E2E_PER_MS=str(per_ms),
        PYTHONPATH=os.path.dirname(os.path.abspath(__file__)),
        STAGETRACE_OUTPUT_DIR="/tmp/stagetrace-e2e",
    )
    proc = subprocess.Popen([sys.executable, __file__, "serve", variant, str(port)], env=env)
    wait_for_port(port, proc, timeout_s=30)
    return proc, f"http://127.0.0.1:{port}"


VARIANTS = ("uninstrumented", "contrib-only", "handwritten", "stagetrace", "stagetrace-nocpu")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        serve(argv[1], int(argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    per_ms = _calibrate()
    throughput: dict[str, list[float]] = {v: [] for v in VARIANTS}
    latency: dict[str, list[float]] = {v: [] for v in VARIANTS}
    servers = {v: start_server(v, per_ms) for v in VARIANTS}
    try:
        for _, base in servers.values():
            asyncio.run(_load(base, 200, args.concurrency))  # warm-up
        for _ in range(args.rounds):
            for v in VARIANTS:
                rps, lat = asyncio.run(_load(servers[v][1], args.requests, args.concurrency))
                throughput[v].append(rps)
                latency[v].extend(lat)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    base_rps = statistics.median(throughput["uninstrumented"])
    hand_rps = statistics.median(throughput["handwritten"])
    print(
        f"e2e: 6-stage FastAPI pipeline (~9 ms CPU a request), {args.requests} requests x {args.rounds} rounds, "
        f"concurrency {args.concurrency}, {os.cpu_count()} CPUs"
    )
    print(f"{'variant':16} {'req/s':>8} {'x uninstr.':>10} {'p50 ms':>8} {'p99 ms':>8}")
    for v in VARIANTS:
        rps = statistics.median(throughput[v])
        q = statistics.quantiles(latency[v], n=100)
        print(f"{v:16} {rps:8.1f} {rps / base_rps:10.3f} {q[49]:8.2f} {q[98]:8.2f}")
    st = statistics.median(throughput["stagetrace"])
    print(f"target stagetrace >= handwritten: {'PASS' if st >= hand_rps else 'FAIL'} ({st / hand_rps:.3f} x)")
    print(
        f"target stagetrace >= 0.93 x uninstrumented: {'PASS' if st >= 0.93 * base_rps else 'FAIL'} "
        f"({st / base_rps:.3f} x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
