"""The exporter process's start-up time and memory, per export configuration, in one run.

    python benchmarks/exporter_footprint.py [--traces 20000]

For each configuration, in a fresh application process: the time from ``configure()`` until the first
trace's verdict is back (the exporter started, imported what it needs and answered), then the exporter's
RSS after ``--traces`` traces (6 stages each) and again after as many more (flat means bounded).
Configurations: the embedded JSON lines file (nothing configured), OTLP/HTTP and OTLP/gRPC to a port where
nothing listens (the exporters retry and drop; memory must stay bounded all the same).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

_CHILD = """
import json, os, sys, time
import stagetrace
n = int(sys.argv[1])
verdicts = []
t0 = time.perf_counter()
h = stagetrace.configure("footprint", on_verdict=verdicts.append, traces_path=sys.argv[2])
with stagetrace.pipeline("first"), stagetrace.stage("s"):
    pass
while not verdicts:  # no flush: with a collector down, a flush would wait for the exporter's retries
    time.sleep(0.001)
startup = time.perf_counter() - t0

def rss_mb(pid):
    with open(f"/proc/{pid}/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith("VmRSS")) / 1024

done = [1]

def run(k):
    for _ in range(k):
        with stagetrace.pipeline("p"):
            for name in ("decode", "resize", "to_tensor", "infer", "postprocess", "serialize"):
                with stagetrace.stage(name):
                    pass
    while len(verdicts) < done[0] + k:  # every verdict back: the exporter has seen them all
        time.sleep(0.01)
    done[0] += k

run(n)
first = rss_mb(h.exporter_pid)
run(n)
second = rss_mb(h.exporter_pid)
print(json.dumps({"startup_s": startup, "rss_mb": [first, second], "app_rss_mb": rss_mb(os.getpid()),
                  "verdicts": len(verdicts)}))
h.shutdown()
"""


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=int, default=20_000)
    args = ap.parse_args(argv)
    port = _unused_port()
    configs = {
        "embedded JSON lines file": {},
        "OTLP/HTTP, collector down": {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"},
        "OTLP/gRPC, collector down": {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
        },
    }
    print(f"exporter process footprint: {args.traces} traces x 2, 6 stages each, default sampling")
    print(f"{'export':28} {'ready after configure s':>24} {'exporter RSS MB':>17} {'after 2x':>9} {'app RSS MB':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, extra in configs.items():
            env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
            env.update(extra, OTEL_METRICS_EXPORTER="none")
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, str(args.traces), os.path.join(tmp, "t.jsonl")],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            if out.returncode != 0:
                print(f"{label:28} failed: {out.stderr[-500:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"{label:28} {r['startup_s']:24.2f} {r['rss_mb'][0]:17.1f} {r['rss_mb'][1]:9.1f} "
                f"{r['app_rss_mb']:11.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
