"""GPU check: one script, a few minutes on one GPU, printing a table (and writing it as JSON with --json).

    python benchmarks/gpu_check.py [--iters 30] [--mib 256] [--json FILE]

Every check can fail where it should:

(a) synchronisations stagetrace adds. The request path (H2D, forward, D2H of --mib MiB each way) runs under
    torch.profiler, plain and instrumented; the CUDA runtime calls that synchronise the host
    (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, synchronous cudaMemcpy) are counted
    on the request thread. The plain run must show its own syncs (the blocking D2H), or the count is void;
    target: 0 added, and no cudaEventQuery on the request thread. The H2D and forward part also runs under
    torch.cuda.set_sync_debug_mode("error"), which trips on stream syncs and synchronous copies.
(b) GPU time per stage against CUPTI: the kernel and memcpy durations that torch.profiler records on the
    device for the same requests are the truth (H2D and D2H: the copy; forward: first kernel start to last
    kernel end). Target: stagetrace's CUDA-event times within 5 % (or 20 us); the classic host timer beside.
(c) hot path per GPU stage in the steady state (events reused from the pool, none created), request-thread
    CPU; target <= 10 us.
(d) a pageable H2D copy is diagnosed (PAGEABLE_H2D); a pinned one is not.
(e) NVML: sample period, timestamp clock, the NVML device matching torch's by UUID, utilisation on a trace.
(f) clock anchors: their error bar on placed GPU spans, and how many calibrations were rejected.
(g) errors stagetrace reported on its own threads (logged and contained): target 0.
Exits 2 with a message when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def truth_per_request(device_events: Iterable[tuple[str, float, float]]) -> list[dict[str, float]]:
    """Device activity (name, start us, duration us), in time order, cut into requests: each request is an
    HtoD memcpy, the kernels after it, and a DtoH memcpy. Returns per request the H2D and D2H copy times
    and the forward's span (first kernel start to last kernel end), in ms."""
    out: list[dict[str, float]] = []
    current: dict[str, Any] | None = None
    for name, start, dur in sorted(device_events, key=lambda e: e[1]):
        lowered = name.lower()
        if "memcpy" in lowered and "htod" in lowered:
            current = {"h2d": dur / 1e3, "k0": None, "k1": None}
        elif current is None:
            continue
        elif "memcpy" in lowered and "dtoh" in lowered:
            if current["k0"] is not None:
                out.append({"h2d": current["h2d"], "infer": (current["k1"] - current["k0"]) / 1e3, "d2h": dur / 1e3})
            current = None
        elif "memcpy" not in lowered and "memset" not in lowered:
            current["k0"] = start if current["k0"] is None else min(current["k0"], start)
            current["k1"] = max(current["k1"] or start + dur, start + dur)
    return out


def within(measured: float, truth: float, pct: float = 5.0, abs_ms: float = 0.02) -> bool:
    return abs(measured - truth) <= max(truth * pct / 100, abs_ms)


class ErrorCounter(logging.Handler):
    """Errors stagetrace logged from its own threads (internal errors are contained and logged)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.threadName}: {record.getMessage()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--mib", type=int, default=256, help="size of each copy")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to measure (run this on a GPU machine)")
        return 2
    from torch.profiler import ProfilerActivity, profile

    import stagetrace
    from stagetrace import conventions as c
    from stagetrace.analysis import Verdict

    errors = ErrorCounter()
    logging.getLogger("stagetrace").addHandler(errors)
    dev = torch.device("cuda:0")
    torch.manual_seed(0)
    rows_n = args.mib * 2**20 // (4096 * 4)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).to(dev).eval()
    pinned = torch.randn(rows_n, 4096).pin_memory()
    pageable = torch.randn(rows_n, 4096)

    def plain(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(x.to(dev, non_blocking=True)).to("cpu")

    with torch.no_grad():
        for _ in range(3):
            plain(pinned)
    torch.cuda.synchronize()

    verdicts: list[Verdict] = []
    handle = stagetrace.configure("gpu-check", on_verdict=verdicts.append, traces_path="/tmp/gpu-check.jsonl")
    support = handle.runtime.gpu

    def traced(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), stagetrace.pipeline("request"):
            xd = stagetrace.h2d(x, dev)
            with stagetrace.gpu_stage("infer"):
                y = model(xd)
            return stagetrace.d2h(y)

    for _ in range(3):
        traced(pinned)
    handle.force_flush(60)
    rows: list[tuple[str, str, str, bool]] = []  # (check, result, target, passed)

    # (a) added synchronisations, counted on the request thread
    def profiled(fn: Any, n: int) -> Any:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn(pinned)
            torch.cuda.synchronize()
        return prof

    me = threading.get_ident()

    def host_calls(prof: Any) -> dict[str, int]:
        counts = dict.fromkeys((*SYNC_CALLS, "cudaEventQuery"), 0)
        for evt in prof.events():
            if evt.name in counts and getattr(evt, "thread", me) in (me, threading.get_native_id()):
                counts[evt.name] += 1
        return counts

    n = 10
    base = host_calls(profiled(plain, n))
    verdicts.clear()
    traced_prof = profiled(traced, n)
    inst = host_calls(traced_prof)
    handle.force_flush(60)
    base_syncs = sum(base[s] for s in SYNC_CALLS)
    for name in SYNC_CALLS:
        added = inst[name] - base[name]
        rows.append(
            (f"(a) {name} per {n} requests: plain / stagetrace", f"{base[name]} / {inst[name]}", "0 added", added <= 0)
        )
    rows.append(
        ("(a) the plain run's own syncs were seen (the count is not void)", str(base_syncs), ">= 1", base_syncs >= 1)
    )
    rows.append(
        ("(a) cudaEventQuery on the request thread", str(inst["cudaEventQuery"]), "0", inst["cudaEventQuery"] == 0)
    )
    sync_error = "none"
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad(), stagetrace.pipeline("sync-debug"):
            xd = stagetrace.h2d(pinned, dev)
            with stagetrace.gpu_stage("infer"):
                model(xd)
    except RuntimeError as e:
        sync_error = str(e).splitlines()[0][:60]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    rows.append(("(a) set_sync_debug_mode('error') on H2D + forward", sync_error, "none", sync_error == "none"))

    # (b) GPU time per stage against CUPTI's device records of the same requests
    device_events = [
        (e.name, e.time_range.start, e.time_range.elapsed_us())
        for e in traced_prof.events()
        if str(getattr(e, "device_type", "")).endswith("CUDA")
    ]
    truth = truth_per_request(device_events)
    requests = [v for v in verdicts if v.root_name == "request"]
    rows.append(
        (
            "(b) requests matched: CUPTI / stagetrace",
            f"{len(truth)} / {len(requests)}",
            f"{n} / {n}",
            len(truth) == len(requests) == n,
        )
    )
    classic = stagetrace.InferencePipelineProfiler()
    host: dict[str, list[float]] = {"h2d": [], "infer": [], "d2h": []}
    with torch.no_grad():
        for _ in range(n):
            torch.cuda.synchronize()
            classic.start()
            xd = pinned.to(dev, non_blocking=True)
            classic.record_stage("h2d")
            y = model(xd)
            classic.record_stage("infer")
            y.to("cpu")
            classic.record_stage("d2h")
            for k, v in classic.analyze_and_report()["stage_breakdown_ms"].items():
                host[k].append(v)
    for k in ("h2d", "infer", "d2h"):
        if not truth or not requests:
            rows.append((f"(b) {k}", "no data", "within 5 %", False))
            continue
        t = statistics.median(r[k] for r in truth)
        m = statistics.median(v.breakdown.get(k, 0.0) for v in requests)
        rows.append(
            (
                f"(b) {k} ms: CUPTI / stagetrace / classic host timer",
                f"{t:.3f} / {m:.3f} ({(m - t) / t * 100:+.1f} %) / {statistics.median(host[k]):.3f}",
                "within 5 % (or 20 us)",
                within(m, t),
            )
        )

    # (c) hot path per GPU stage, steady state: 20 pipelines of 100 stages (under the per-trace bound)
    def hot(pipelines: int) -> int:
        spent = 0
        for _ in range(pipelines):
            with stagetrace.pipeline("hot"):
                t0 = time.thread_time_ns()
                for _ in range(100):
                    with stagetrace.gpu_stage("noop"):
                        pass
                spent += time.thread_time_ns() - t0
        return spent

    with torch.no_grad():
        torch.cuda.synchronize()
        for _ in range(3):  # warm: the pool then holds the events 20 pipelines in flight need
            hot(20)
            handle.force_flush(60)
        created = support.pool.outstanding(0)
        spent_ns = hot(20)
        handle.force_flush(60)
    per_stage_us = spent_ns / 2000 / 1000
    rows.append(
        (
            "(c) hot path per gpu_stage, steady state (request-thread CPU, us)",
            f"{per_stage_us:.2f}",
            "<= 10",
            per_stage_us <= 10,
        )
    )
    rows.append(
        (
            "(c) events created while measuring",
            str(support.pool.outstanding(0) - created),
            "0",
            support.pool.outstanding(0) == created,
        )
    )

    # (d) pageable copy diagnosed, pinned not
    verdicts.clear()
    with torch.no_grad(), stagetrace.pipeline("pageable"):
        stagetrace.h2d(pageable, dev)
    with torch.no_grad(), stagetrace.pipeline("pinned"):
        stagetrace.h2d(pinned, dev)
    handle.force_flush(60)
    codes = {v.root_name: v.diagnosis_codes for v in verdicts}
    ok = "PAGEABLE_H2D" in codes.get("pageable", ()) and "PAGEABLE_H2D" not in codes.get("pinned", ())
    rows.append(("(d) PAGEABLE_H2D on the pageable copy, not on the pinned one", str(codes), "pageable only", ok))

    # (e) NVML
    sampler = next(iter(support.samplers.values()), None) if support else None
    if sampler is None:
        rows.append(("(e) NVML", "no sampler running", "sampler running", False))
    else:
        rows.append(
            (
                "(e) NVML sample period (ms) / timestamp clock",
                f"{sampler.period_us / 1000:.1f} / {sampler.clock}",
                "",
                True,
            )
        )
        torch_uuid = support.backend.device_uuid(0)
        rows.append(
            (
                "(e) NVML device = torch device (UUID)",
                f"{sampler.device_uuid == torch_uuid} ({torch_uuid})",
                "True",
                sampler.device_uuid == torch_uuid,
            )
        )
        rows.append(
            (
                "(e) NVML utilisation on the last trace",
                str(verdicts[-1].gpu_utilization if verdicts else None),
                "a value",
                bool(verdicts) and verdicts[-1].gpu_utilization is not None,
            )
        )

    # (f) anchors
    import json as _json

    errors_us = []
    with open("/tmp/gpu-check.jsonl") as fh:
        for line in fh:
            for rs in _json.loads(line).get("resourceSpans", ()):
                for ss in rs.get("scopeSpans", ()):
                    for sp in ss.get("spans", ()):
                        for kv in sp.get("attributes", ()):
                            if kv["key"] == c.GPU_PLACEMENT_ERROR_US:
                                errors_us.append(float(kv["value"].get("doubleValue", 0)))
    rows.append(
        (
            "(f) placed GPU spans / their error bar p50 / max (us) / rejected calibrations",
            f"{len(errors_us)} / {statistics.median(errors_us) if errors_us else '-'} / "
            f"{max(errors_us) if errors_us else '-'} / {support.timer.anchors_rejected}",
            "placed, <= 50",
            bool(errors_us) and max(errors_us) <= 50,
        )
    )
    rows.append(
        (
            "(f) helper thread in thread-local capture mode",
            str(support.timer.thread_local_capture),
            "True",
            bool(support.timer.thread_local_capture),
        )
    )
    handle.shutdown()

    # (g) errors on stagetrace's own threads
    rows.append(
        (
            "(g) errors stagetrace logged (contained)",
            str(len(errors.messages)) + (f": {errors.messages[0][:60]}" if errors.messages else ""),
            "0",
            not errors.messages,
        )
    )

    print(f"stagetrace GPU check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.mib} MiB copies")
    width = max(len(r[0]) for r in rows)
    print(f"{'check':{width}}  {'result':44}  {'target':22}  ok")
    for name, result, target, passed in rows:
        print(f"{name:{width}}  {result:44}  {target:22}  {'yes' if passed else 'NO'}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([{"check": r[0], "result": r[1], "target": r[2], "ok": r[3]} for r in rows], fh, indent=1)
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
