"""The exporter past saturation: does it keep within its CPU budget, do the metrics count every request, does
export keep within its budget?

    python benchmarks/saturation.py [--seconds 10] [--budgets 0.05,off]

The e2e endpoint (``benchmarks/e2e.py``: 6 stages, ~9 ms of work a request, GIL-free) served by uvicorn with
stagetrace on the contrib path and the embedded default (traces and metrics to JSON lines files), in its own
process tree on CPU 0; its clients, each on a keep-alive connection, on the other CPUs. The load that
saturates the service is the fewest clients at which its throughput stops rising (found first: doubling the
clients from 1 until the rate grows by under 10 %); then the service is driven by 2 x and 10 x that many
clients for ``--seconds`` each, with each ``--budgets`` value of ``STAGETRACE_EXPORTER_CPU_BUDGET``.

Per run: requests answered; the exporter's CPU (the tree less the server process) against the application's
and against its budget (that share of the application's CPU, at least 1 % of a CPU); the share of traces the
diagnosis rules ran on (``stagetrace.traces.diagnosed`` over the traces the metrics counted); whether the
metrics counted every request answered; the traces exported a second against the export budget (20 a second
and bursts of 40, so at most 20 a second plus 2 bursts over the run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import free_port, wait_for_port
from proctree import process_cpu_s, tree_cpu_s

HERE = Path(__file__).parent
EXPORT_BUDGET_PER_S, EXPORT_BURST = 20.0, 40.0


def start(out_dir: Path, budget: str, per_ms: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
    env.update(
        E2E_PER_MS=per_ms,
        E2E_THREADS_FILE=str(out_dir / "threads.json"),
        PYTHONPATH=os.pathsep.join(filter(None, (str(HERE), os.environ.get("PYTHONPATH")))),
        STAGETRACE_OUTPUT_DIR=str(out_dir),
        STAGETRACE_EXPORTER_CPU_BUDGET=budget,
    )
    pin = (lambda: os.sched_setaffinity(0, {0})) if (os.cpu_count() or 1) > 1 else None
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "e2e.py"), "serve", "stagetrace-contrib", "gil-free", str(port)],
        env=env,
        preexec_fn=pin,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,  # the slow-trace log: every request is slow past saturation
    )
    wait_for_port(port, proc, timeout_s=60)
    return proc, port


def drive(port: int, clients: int, seconds: float) -> int:
    """Requests answered by ``clients`` keep-alive connections in ``seconds``."""
    from stagetrace.demo.load import TimedConnection

    answered = [0] * clients
    stop_at = time.monotonic() + seconds

    def client(i: int) -> None:
        conn = TimedConnection("127.0.0.1", port, timeout_s=120)
        while time.monotonic() < stop_at:
            status, _ = conn.exchange("GET", "/predict")
            answered[i] += status == 200

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(answered)


def counter_total(metrics_file: Path, name: str) -> float:
    """A cumulative counter's latest total, summed over its attribute sets (the embedded default's file)."""
    latest: dict[str, float] = {}
    for line in metrics_file.read_text().splitlines():
        for rm in json.loads(line).get("resourceMetrics", ()):
            for sm in rm.get("scopeMetrics", ()):
                for m in sm.get("metrics", ()):
                    if m["name"] == name:
                        for p in m["sum"]["dataPoints"]:
                            key = json.dumps(p.get("attributes", []), sort_keys=True)
                            latest[key] = float(p.get("asInt", p.get("asDouble", 0)))
    return sum(latest.values())


def histogram_count(metrics_file: Path, name: str) -> int:
    latest: dict[str, int] = {}
    for line in metrics_file.read_text().splitlines():
        for rm in json.loads(line).get("resourceMetrics", ()):
            for sm in rm.get("scopeMetrics", ()):
                for m in sm.get("metrics", ()):
                    if m["name"] == name:
                        for p in m["histogram"]["dataPoints"]:
                            latest[json.dumps(p.get("attributes", []), sort_keys=True)] = int(p.get("count", 0))
    return sum(latest.values())


def kept_traces(out_dir: Path) -> int:
    from stagetrace import conventions as c
    from stagetrace.report.loader import spans_from_line

    return sum(
        1
        for path in out_dir.glob("traces-*.jsonl")
        for line in path.read_text().splitlines()
        for span in spans_from_line(line)
        if c.TOTAL_MS in span.attributes
    )


def run(clients: int, seconds: float, budget: str, per_ms: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="saturation-") as scratch:
        out_dir = Path(scratch)
        proc, port = start(out_dir, budget, per_ms)
        try:
            warm = drive(port, clients, 2.0)  # every rule's path taken, the exporter's share settled
            server0, tree0 = process_cpu_s(proc.pid), tree_cpu_s(proc.pid)
            answered = drive(port, clients, seconds)
            server, tree = process_cpu_s(proc.pid) - server0, tree_cpu_s(proc.pid) - tree0
        finally:
            proc.send_signal(signal.SIGTERM)  # a graceful shutdown flushes the metrics and the traces
            proc.wait(timeout=60)
        metrics = next(out_dir.glob("metrics-*.jsonl"))
        counted = histogram_count(metrics, "stagetrace.trace.duration")
        diagnosed = counter_total(metrics, "stagetrace.traces.diagnosed")
        exporter = tree - server
        budget_cpu = max(0.01 * seconds, float(budget) * server) if budget != "off" else float("inf")
        return {
            "clients": clients,
            "rps": answered / seconds,
            "exporter_share": exporter / server if server else 0.0,
            "within": exporter <= budget_cpu * 1.1,  # a window's reaction: the budget holds a second at a time
            "diagnosed": diagnosed / counted if counted else 0.0,
            "counted_all": counted == warm + answered,
            "kept_per_s": kept_traces(out_dir) / (seconds + 2.0),
        }


def saturating_clients(per_ms: str) -> tuple[int, float]:
    """The fewest clients at which throughput stops rising (under 10 % more for twice the clients)."""
    with tempfile.TemporaryDirectory(prefix="saturation-") as scratch:
        proc, port = start(Path(scratch), "off", per_ms)
        try:
            drive(port, 2, 1.0)
            clients, rate = 1, drive(port, 1, 3.0) / 3.0
            while clients < 64:
                more = drive(port, 2 * clients, 3.0) / 3.0
                if more < 1.1 * rate:
                    return clients, rate
                clients, rate = 2 * clients, more
            return clients, rate
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--budgets", default="0.05,off", help="STAGETRACE_EXPORTER_CPU_BUDGET values, comma-separated")
    args = ap.parse_args(argv)
    import e2e

    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, set(range(1, os.cpu_count() or 1)))  # the clients off the server's CPU
    per_ms = ",".join(f"{k}={v}" for k, v in e2e._calibrate().items())
    clients, rate = saturating_clients(per_ms)
    print(f"saturation: {clients} clients, {rate:.0f} requests a second (e2e gil-free endpoint, server on CPU 0)")
    print(
        "| load | exporter CPU budget | requests/s | exporter CPU / application's | within budget | "
        "traces diagnosed | metrics counted every request | traces exported/s (budget 20) |"
    )
    print("|---|---|---:|---:|---|---:|---|---:|")
    ok = True
    for factor in (2, 10):
        for budget in args.budgets.split(","):
            r = run(clients * factor, args.seconds, budget, per_ms)
            export_ok = r["kept_per_s"] <= EXPORT_BUDGET_PER_S + 2 * EXPORT_BURST / (args.seconds + 2.0)
            ok &= bool(r["counted_all"]) and export_ok and (budget == "off" or bool(r["within"]))
            print(
                f"| {factor} x ({clients * factor} clients) | {budget} | {r['rps']:.0f} | {r['exporter_share']:.3f} | "
                f"{'yes' if r['within'] else 'no'} | {r['diagnosed']:.0%} | {'yes' if r['counted_all'] else 'NO'} | "
                f"{r['kept_per_s']:.1f}{'' if export_ok else ' (over)'} |"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
