"""The exporter's metric recording: the SDK's instruments against stagetrace's own aggregation, side by side.

    python benchmarks/metrics_cost.py [--traces 20000] [--rounds 5]

Each variant records the same verdicts (six stages, a route, an exemplar on every other trace, a
diagnosis on one in five): per trace, six stage-duration observations, one trace duration, one
bottleneck count and the diagnoses, as the exporter process records every trace. A periodic reader
collects (cumulative, as OTLP does by default) every 1,000 traces, as the exporter's reader does on its
schedule. Reported: CPU time of this thread per observation (the median of interleaved rounds) and the
ratio. Target: stagetrace's aggregation <= 2 us an observation.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from stagetrace.analysis import Verdict
from stagetrace.analysis.diagnosis import Diagnosis
from stagetrace.exporter.aggregation import AggregatedMetrics
from stagetrace.exporter.metrics import SdkInstruments

STAGES = ("receive", "decode", "resize", "to_tensor", "infer", "postprocess")
RESOURCE = Resource.create({"service.name": "metrics-cost"})


def verdicts(n: int) -> list[Verdict]:
    out = []
    for i in range(n):
        breakdown = {name: 0.2 + ((i * 7 + j * 13) % 97) * 0.5 for j, name in enumerate(STAGES)}
        out.append(
            Verdict(
                trace_id=f"{i:032x}",
                root_name="POST /predict",
                total_ms=sum(breakdown.values()) + 1.0,
                breakdown=breakdown,
                bottleneck=max(breakdown, key=lambda k: breakdown[k]),
                ratio=0.4,
                slow=i % 10 == 0,
                slow_threshold_ms=200.0,
                untracked_ms=1.0,
                diagnoses=(Diagnosis("CPU_PREPROCESSING_BOUND", "m", "a"),) if i % 5 == 0 else (),
                route="/predict",
                stage_kinds=dict.fromkeys(STAGES, "cpu"),
            )
        )
    return out


def observations_per_trace(v: Verdict) -> int:
    return len(v.breakdown) + 1 + 1 + len(v.diagnoses)


def run(sink: object, reader: InMemoryMetricReader, items: list[Verdict]) -> int:
    """Thread CPU ns to record them all, collecting every 1,000 traces."""
    record = sink.record_trace  # type: ignore[attr-defined]
    gc.collect()
    t0 = time.thread_time_ns()
    for i, v in enumerate(items):
        record(v, (i + 1, i + 1) if i % 2 == 0 else None)
        if i % 1000 == 999:
            reader.collect()
    return time.thread_time_ns() - t0


def sdk_variant() -> tuple[object, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], resource=RESOURCE, shutdown_on_exit=False)
    return SdkInstruments(provider.get_meter("stagetrace")), reader


def own_variant() -> tuple[object, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    MeterProvider(metric_readers=[reader], resource=RESOURCE, shutdown_on_exit=False)
    sink = AggregatedMetrics(RESOURCE)
    sink.attach_readers([reader])
    return sink, reader


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    items = verdicts(args.traces)
    observations = sum(observations_per_trace(v) for v in items)
    results: dict[str, list[float]] = {"sdk": [], "own": []}
    for _ in range(args.rounds):
        for name, make in (("sdk", sdk_variant), ("own", own_variant)):
            sink, reader = make()
            results[name].append(run(sink, reader, items) / observations / 1000)
    sdk, own = statistics.median(results["sdk"]), statistics.median(results["own"])
    print(
        f"metric recording: {args.traces} traces, {observations / args.traces:.1f} observations a trace, "
        f"{args.rounds} rounds, median; python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    print(f"{'variant':58} {'us/observation':>15} {'x SDK':>7}")
    print(f"{'SDK instruments (histograms, counters, exemplar filter)':58} {sdk:15.2f} {1.0:7.3f}")
    print(f"{'stagetrace aggregation (exporter/aggregation.py)':58} {own:15.2f} {own / sdk:7.3f}")
    print(f"target: <= 2 us an observation: {'PASS' if own <= 2.0 else 'FAIL'} ({own:.2f} us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
