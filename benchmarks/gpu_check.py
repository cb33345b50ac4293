"""GPU check (issue 3, item 7): one script, a few minutes on one GPU, printing a table.

    python benchmarks/gpu_check.py [--iters 50]

(a) synchronisations stagetrace adds: the instrumented request path runs under
    torch.cuda.set_sync_debug_mode("error"), and torch.profiler counts cudaStreamSynchronize,
    cudaDeviceSynchronize, cudaEventSynchronize and cudaMemcpy (non-async) calls, instrumented vs not;
    target: 0 added.
(b) on an H2D -> model -> D2H pipeline, GPU time per stage from stagetrace against a ground truth taken with
    explicit synchronisation around each stage (separate runs), target within 5%; the classic host-timer
    profiler's numbers beside them.
(c) microseconds of hot path per GPU stage (request thread CPU), target <= 10.
(d) a pageable H2D copy detected (PAGEABLE_H2D).
(e) NVML: sample period and the clock its timestamps use.
Exits 2 with a message when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to measure (run this on a GPU machine)")
        return 2
    import stagetrace
    from stagetrace.analysis import Verdict

    dev = torch.device("cuda:0")
    torch.manual_seed(0)
    model = (
        torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU()) for _ in range(8)])
        .to(dev)
        .eval()
    )
    pinned = torch.randn(512, 4096).pin_memory()
    pageable = torch.randn(512, 4096)
    with torch.no_grad():
        for _ in range(5):
            model(pinned.to(dev)).cpu()
    torch.cuda.synchronize()

    verdicts: list[Verdict] = []
    handle = stagetrace.configure("gpu-check", on_verdict=verdicts.append, traces_path="/tmp/gpu-check.jsonl")

    def plain(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            xd = x.to(dev, non_blocking=True)
            y = model(xd)
            return y.to("cpu")

    def traced(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), stagetrace.pipeline("request"):
            xd = stagetrace.h2d(x, dev)
            with stagetrace.gpu_stage("infer"):
                y = model(xd)
            return stagetrace.d2h(y)

    rows: list[tuple[str, str, str]] = []

    # (a) added synchronisations
    traced(pinned)
    handle.force_flush()
    torch.cuda.synchronize()
    sync_error = "none"
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad(), stagetrace.pipeline("request"):
            xd = stagetrace.h2d(pinned, dev)
            with stagetrace.gpu_stage("infer"):
                y = model(xd)
    except RuntimeError as e:
        sync_error = str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    y.cpu()
    names = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")

    def count_syncs(fn) -> dict[str, int]:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn(pinned)
            torch.cuda.synchronize()
        counts = dict.fromkeys(names, 0)
        for evt in prof.events():
            if evt.name in counts:
                counts[evt.name] += 1
        return counts

    base, inst = count_syncs(plain), count_syncs(traced)
    handle.force_flush()
    added = {n: inst[n] - base[n] for n in names}
    rows.append(("(a) sync_debug_mode=error on the request path", sync_error, "no error"))
    for n in names:
        rows.append(
            (f"(a) {n} per 10 requests: plain / stagetrace / added", f"{base[n]} / {inst[n]} / {added[n]}", "0")
        )

    # (b) GPU time per stage vs an explicit-synchronise ground truth
    def ground_truth() -> dict[str, float]:
        out: dict[str, list[float]] = {"h2d": [], "infer": [], "d2h": []}
        with torch.no_grad():
            for _ in range(args.iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                xd = pinned.to(dev, non_blocking=True)
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                y = model(xd)
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                y.to("cpu")
                torch.cuda.synchronize()
                t3 = time.perf_counter()
                out["h2d"].append((t1 - t0) * 1e3)
                out["infer"].append((t2 - t1) * 1e3)
                out["d2h"].append((t3 - t2) * 1e3)
        return {k: statistics.median(v) for k, v in out.items()}

    truth = ground_truth()
    verdicts.clear()
    for _ in range(args.iters):
        traced(pinned)
    handle.force_flush(60)
    measured = {k: statistics.median(v.breakdown[k] for v in verdicts if k in v.breakdown) for k in truth}
    classic = stagetrace.InferencePipelineProfiler()
    host: dict[str, list[float]] = {"h2d": [], "infer": [], "d2h": []}
    with torch.no_grad():
        for _ in range(args.iters):
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
        err = abs(measured[k] - truth[k]) / truth[k] * 100 if truth[k] else 0.0
        rows.append(
            (
                f"(b) {k} ms: ground truth / stagetrace / classic host timer",
                f"{truth[k]:.3f} / {measured[k]:.3f} ({err:.1f}%) / {statistics.median(host[k]):.3f}",
                "stagetrace within 5%",
            )
        )

    # (c) hot path per GPU stage
    with torch.no_grad():
        xd = pinned.to(dev)
        torch.cuda.synchronize()
        n = 2000
        with stagetrace.pipeline("hot"):
            t0 = time.thread_time_ns()
            for _ in range(n):
                with stagetrace.gpu_stage("noop"):
                    pass
            t1 = time.thread_time_ns()
        handle.force_flush(60)
    rows.append(("(c) hot path per gpu_stage (request thread CPU, us)", f"{(t1 - t0) / n / 1000:.2f}", "<= 10"))

    # (d) pageable copy detected
    verdicts.clear()
    with torch.no_grad(), stagetrace.pipeline("pageable"):
        stagetrace.h2d(pageable, dev)
    handle.force_flush(60)
    rows.append(("(d) pageable H2D diagnosed", str("PAGEABLE_H2D" in verdicts[-1].diagnosis_codes), "True"))

    # (e) NVML
    gpu = handle.runtime.gpu
    sampler = next(iter(gpu.samplers.values()), None) if gpu else None
    if sampler is None:
        rows.append(("(e) NVML", "not available", "sampler running"))
    else:
        rows.append(
            ("(e) NVML sample period (ms) / timestamp clock", f"{sampler.period_us / 1000:.1f} / {sampler.clock}", "")
        )
        rows.append(("(e) NVML utilisation on the last trace", str(verdicts[-1].gpu_utilization), ""))
    handle.shutdown()

    print(f"stagetrace GPU check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, iters={args.iters}")
    width = max(len(r[0]) for r in rows)
    print(f"{'check':{width}}  {'result':34}  target")
    for name, result, target in rows:
        print(f"{name:{width}}  {result:34}  {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
