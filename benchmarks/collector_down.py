"""The request path when the collector is healthy, refusing connections, or slow (issue 7, item 1).

    python benchmarks/collector_down.py [--pipelines 3000] [--rounds 3]

Each variant: stagetrace configured to export OTLP/gRPC to (a) a healthy receiver on 127.0.0.1, (b) a port
where nothing listens, (c) a receiver that takes 2 s per export. The same pipelines (1 root + 4 stages)
run in each; the table shows the request thread's CPU per pipeline and its ratio to the healthy case
(target <= 1.05), the process RSS growth, and what stagetrace counted as dropped.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time

os.environ.setdefault("OTEL_METRICS_EXPORTER", "none")
os.environ.setdefault("OTEL_BSP_MAX_QUEUE_SIZE", "50000")  # holds a healthy burst; drops then mean the collector


def _reserved_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _configure(port: int) -> object:
    os.environ.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_EXPORTER_OTLP_TIMEOUT="5",
    )
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    import stagetrace
    from stagetrace.settings import Settings

    reader = InMemoryMetricReader()
    handle = stagetrace.configure(
        "collector-bench", metric_reader=reader, set_global=False, settings=Settings(shutdown_timeout_s=2.0)
    )
    return handle, reader


def _pipelines(n: int) -> int:
    import stagetrace

    stages = [stagetrace.stage(name) for name in ("decode", "infer", "d2h", "postprocess")]
    t0 = time.thread_time_ns()
    for _ in range(n):
        with stagetrace.pipeline("request"):
            for s in stages:
                with s:
                    pass
    return time.thread_time_ns() - t0


def _dropped(reader: object) -> dict[str, float]:
    out: dict[str, float] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == "stagetrace.dropped":
                    for p in m.data.data_points:
                        out[p.attributes["reason"]] = p.value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipelines", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    from stagetrace.testing import OtlpReceiver

    healthy, slow = OtlpReceiver().start(), OtlpReceiver(export_delay_s=2.0).start()
    variants = {"healthy": healthy.grpc_port, "refusing": _reserved_port(), "slow (2 s/export)": slow.grpc_port}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    rss: dict[str, float] = {}
    dropped: dict[str, dict[str, float]] = {}
    shutdown_s: dict[str, float] = {}
    try:
        for _ in range(args.rounds):
            for name, port in variants.items():
                handle, reader = _configure(port)
                before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                cpu[name].append(_pipelines(args.pipelines) / args.pipelines / 1000)
                handle.runtime.shipper.flush(30)
                rss[name] = max(
                    rss.get(name, 0.0), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
                )
                dropped[name] = _dropped(reader)
                t0 = time.monotonic()
                handle.shutdown()
                shutdown_s[name] = max(shutdown_s.get(name, 0.0), time.monotonic() - t0)
    finally:
        healthy.stop()
        slow.stop()
    base = statistics.median(cpu["healthy"])
    print(f"request path vs collector state: {args.pipelines} pipelines x 4 stages, {args.rounds} rounds, median")
    print(f"{'collector':20} {'us/pipeline':>12} {'x healthy':>10} {'RSS +MB':>8} {'shutdown s':>11}  dropped")
    for name in variants:
        us = statistics.median(cpu[name])
        print(
            f"{name:20} {us:12.1f} {us / base:10.3f} {rss[name]:8.1f} {shutdown_s[name]:11.2f}  {dropped[name] or '-'}"
        )
    worst = max(statistics.median(cpu[n]) / base for n in variants)
    print(f"target request path <= 1.05 x healthy: {'PASS' if worst <= 1.05 else 'FAIL'} ({worst:.3f} x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
