"""Probes for a first GPU session (benchmarks/gpu_session.sh runs them in order), each printing what it saw.

    python benchmarks/gpu_probes.py nvml      # NVML idle vs loaded: sample period, timestamp clock, UUID match
    python benchmarks/gpu_probes.py anchors   # clock-anchor windows with 0 and 2 busy Python threads
    python benchmarks/gpu_probes.py capture   # global-mode graph captures on one thread, gpu_stage pipelines on another
    python benchmarks/gpu_probes.py dtype     # automatic copy stages leave Tensor.to / Module.to results unchanged

Each exits 0 when what it checks holds, 1 when not, 2 without a CUDA device.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from typing import Any


def _load(torch: Any, seconds: float) -> None:
    a = torch.randn(4096, 4096, device="cuda")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a = a @ a
            a = a / a.norm()
        torch.cuda.synchronize()


def probe_nvml(torch: Any) -> int:
    from stagetrace.gpu.backend import TorchCudaBackend
    from stagetrace.gpu.nvml import NvmlSampler

    torch.zeros(1, device="cuda")
    uuid = TorchCudaBackend(torch).device_uuid(0)
    sampler = NvmlSampler(uuid, 0, poll_interval_s=0.1)
    started = sampler.start()
    print(f"torch device UUID {uuid}; NVML sampler started: {started}")
    if not started:
        return 1
    time.sleep(1.5)
    idle = sampler.window(time.time_ns() - 1_000_000_000, time.time_ns())
    t0 = time.time_ns()
    _load(torch, 2.0)
    t1 = time.time_ns()
    time.sleep(0.5)
    loaded = sampler.window(t0, t1)
    sampler.stop()
    print(f"sample period {sampler.period_us / 1000:.1f} ms, timestamp clock {sampler.clock}")
    print(f"idle window: {idle}")
    print(f"loaded window: {loaded}")
    ok = loaded is not None and loaded.mean > 0.5 and (idle is None or idle.mean < loaded.mean)
    return 0 if ok else 1


def probe_anchors(torch: Any) -> int:
    import stagetrace

    handle = stagetrace.configure("anchor-probe", set_global=False, traces_path="/tmp/anchor-probe.jsonl")
    torch.zeros(1, device="cuda")
    with stagetrace.pipeline("first"), stagetrace.gpu_stage("first"):
        torch.ones(1, device="cuda")
    handle.force_flush()
    timer = handle.runtime.gpu.timer
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    result = 0
    for busy in (0, 2):
        threads = [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
        for t in threads:
            t.start()
        errors: list[float] = []
        rejected0 = timer.anchors_rejected
        for _ in range(200):
            before = len(timer._anchors.get(0, ()))
            last = timer._anchors[0][-1] if before else None
            timer._calibrate(0)
            anchors = timer._anchors.get(0, ())
            if anchors and anchors[-1] is not last:
                errors.append(anchors[-1].error_ns / 1000)
        stop.set()
        for t in threads:
            t.join()
        stop.clear()
        rejected = timer.anchors_rejected - rejected0
        if errors:
            errors.sort()
            p90 = errors[int(len(errors) * 0.9) - 1]
            print(
                f"{busy} busy threads: {len(errors)} anchors kept, {rejected} rejected; error bar p50 "
                f"{statistics.median(errors):.1f} us, p90 {p90:.1f} us, max {errors[-1]:.1f} us"
            )
        else:
            print(f"{busy} busy threads: no anchor kept, {rejected} rejected")
            result = 1
    handle.shutdown()
    return result


def probe_capture(torch: Any) -> int:
    import stagetrace

    handle = stagetrace.configure("capture-probe", set_global=False, traces_path="/tmp/capture-probe.jsonl")
    model = torch.nn.Linear(1024, 1024).cuda()
    static_in = torch.randn(64, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    failures: list[str] = []
    stop = threading.Event()

    def capturer() -> None:
        n = 0
        while not stop.is_set() and n < 200:
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g, capture_error_mode="global"):
                    model(static_in)
                g.replay()
            except Exception as e:  # what this probe looks for
                failures.append(f"capture {n}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            n += 1

    def pipelines() -> None:
        x = torch.randn(64, 1024).pin_memory()
        while not stop.is_set():
            with torch.no_grad(), stagetrace.pipeline("request"):
                xd = stagetrace.h2d(x, "cuda")
                with stagetrace.gpu_stage("infer"):
                    y = model(xd)
                stagetrace.d2h(y)

    workers = [threading.Thread(target=pipelines, daemon=True)]
    cap = threading.Thread(target=capturer)
    for t in workers:
        t.start()
    cap.start()
    cap.join(120)
    stop.set()
    for t in workers:
        t.join(10)
    handle.force_flush(30)
    support = handle.runtime.gpu
    print(f"thread-local capture mode on the helper thread: {support.timer.thread_local_capture}")
    print(f"capture failures: {len(failures)}")
    for f in failures[:5]:
        print("  " + f)
    handle.shutdown()
    return 0 if not failures else 1


def probe_dtype(torch: Any) -> int:
    import stagetrace
    from stagetrace.integrations import auto_stages

    handle = stagetrace.configure("dtype-probe", set_global=False, traces_path="/tmp/dtype-probe.jsonl")
    cases = [
        ("t.to('cuda', torch.float16)", lambda t: t.to("cuda", torch.float16)),
        ("t.to('cuda', non_blocking=True)", lambda t: t.to("cuda", non_blocking=True)),
        (
            "t.to(torch.device('cuda'), torch.bfloat16, True)",
            lambda t: t.to(torch.device("cuda"), torch.bfloat16, True),
        ),
        ("t.to('cuda', memory_format=channels_last)", lambda t: t.to("cuda", memory_format=torch.channels_last)),
        ("t.to('cuda', copy=True)", lambda t: t.to("cuda", copy=True)),
    ]
    src = torch.randn(2, 3, 8, 8).pin_memory()

    def describe(out: Any) -> tuple[Any, ...]:
        return (out.dtype, out.device.type, out.is_contiguous(memory_format=torch.channels_last), out.shape)

    expected = {name: describe(fn(src)) for name, fn in cases}
    m_expected = torch.nn.Linear(4, 4).to("cuda", torch.float16).weight.dtype
    auto_stages.instrument()
    bad = []
    try:
        with stagetrace.pipeline("dtype"):
            for name, fn in cases:
                got = describe(fn(src))
                if got != expected[name]:
                    bad.append(f"{name}: {got} != {expected[name]}")
            m_got = torch.nn.Linear(4, 4).to("cuda", torch.float16).weight.dtype
            if m_got != m_expected:
                bad.append(f"Module.to('cuda', float16): {m_got} != {m_expected}")
    finally:
        auto_stages.uninstrument()
        handle.shutdown()
    print(f"{len(cases) + 1} call shapes checked, {len(bad)} differ")
    for b in bad:
        print("  " + b)
    return 0 if not bad else 1


PROBES = {"nvml": probe_nvml, "anchors": probe_anchors, "capture": probe_capture, "dtype": probe_dtype}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in PROBES:
        print(__doc__)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_probes {args[0]}: no CUDA device")
        return 2
    return PROBES[args[0]](torch)


if __name__ == "__main__":
    sys.exit(main())
