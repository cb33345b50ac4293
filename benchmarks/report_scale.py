"""`stagetrace report` over one million spans: time and peak memory (issue 6, item 4).

    python benchmarks/report_scale.py [--spans 1000000]

Writes an OTLP JSON lines file of synthetic traces (1 root + 7 stages, 50 spans a line, traces spread
over neighbouring lines as a Collector's file exporter writes them), then runs `stagetrace report --json`
on it in a child process and reads its peak RSS. A second run on a quarter of the input shows that memory
does not grow with the input.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

STAGES = ("decode", "resize", "to_tensor", "h2d", "infer", "d2h", "postprocess")


def kv(key: str, value: object) -> dict:
    return {"key": key, "value": {"stringValue": value} if isinstance(value, str) else {"doubleValue": value}}


def write_input(path: str, spans: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    traces = spans // (len(STAGES) + 1)
    base = 1_700_000_000_000_000_000
    batch: list[dict] = []
    written = 0
    with open(path, "w") as fh:
        for t in range(traces):
            tid = f"{t:032x}"
            root = f"{t:015x}0"
            start = base + t * 10_000_000
            cursor = start + 100_000
            spans_of_trace = [
                {
                    "traceId": tid,
                    "spanId": root,
                    "name": "POST /predict",
                    "kind": 2,
                    "startTimeUnixNano": str(start),
                    "endTimeUnixNano": "",
                    "attributes": [kv("http.route", "/predict")],
                }
            ]
            for i, name in enumerate(STAGES):
                dur = int(rng.expovariate(1 / 2_000_000)) + 50_000
                spans_of_trace.append(
                    {
                        "traceId": tid,
                        "spanId": f"{t:015x}{i + 1}",
                        "parentSpanId": root,
                        "name": name,
                        "kind": 1,
                        "startTimeUnixNano": str(cursor),
                        "endTimeUnixNano": str(cursor + dur),
                        "attributes": [kv("stagetrace.stage", name), kv("stagetrace.stage.kind", "cpu")],
                    }
                )
                cursor += dur + 10_000
            spans_of_trace[0]["endTimeUnixNano"] = str(cursor + 200_000)
            batch.extend(spans_of_trace)
            written += len(spans_of_trace)
            if len(batch) >= 50:
                fh.write(
                    json.dumps(
                        {
                            "resourceSpans": [
                                {
                                    "resource": {"attributes": [kv("service.name", "svc")]},
                                    "scopeSpans": [{"spans": batch}],
                                }
                            ]
                        }
                    )
                    + "\n"
                )
                batch = []
        if batch:
            fh.write(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": batch}]}]}) + "\n")
    return written


def run_report(path: str) -> tuple[float, float, dict]:
    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out = subprocess.run(
        [sys.executable, "-m", "stagetrace.cli.main", "report", path, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    elapsed = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return elapsed, max(peak_kib, before) / 1024, json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=1_000_000)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for spans in (args.spans // 4, args.spans):  # the smaller first: RUSAGE_CHILDREN keeps the maximum
            path = os.path.join(tmp, f"spans-{spans}.jsonl")
            n = write_input(path, spans)
            size_mb = os.path.getsize(path) / 2**20
            elapsed, peak_mb, doc = run_report(path)
            rows.append((n, size_mb, elapsed, peak_mb, doc["traces"]))
    print(f"stagetrace report over OTLP JSON lines; python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print(f"{'spans':>10} {'input MB':>9} {'traces':>8} {'seconds':>8} {'spans/s':>9} {'peak RSS MB':>12}")
    for n, size_mb, elapsed, peak_mb, traces in rows:
        print(f"{n:>10} {size_mb:9.1f} {traces:>8} {elapsed:8.1f} {n / elapsed:9.0f} {peak_mb:12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
