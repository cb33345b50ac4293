"""The GPU path against what real hardware would do to it, on CPU: CUDA never initialised by stagetrace,
no trace waiting for an idle GPU's NVML, no CUDA event leaked, clock anchors with an error bar, queries
under the event's device and never during a graph capture."""

from __future__ import annotations

import threading
import time

import pytest

import stagetrace
from fakes import FakeCudaBackend, FakeGpu, FakeNvml, FakeTensor, FakeTorch, fake_model
from stagetrace import conventions as c
from stagetrace.gpu import attach_gpu
from stagetrace.gpu.backend import TorchCudaBackend
from stagetrace.gpu.nvml import NvmlSampler
from stagetrace.settings import Settings


def drops(h) -> dict[str, int]:
    return {p.attributes[c.DROP_REASON]: p.value for p in h.metric_points(c.METRIC_DROPPED)}


# --- item 2: never initialise CUDA ----------------------------------------------------------------------


def test_nothing_gpu_side_happens_before_the_application_initialises_cuda(make_harness):
    torch = FakeTorch()
    h = make_harness(gpu=False)
    support = attach_gpu(h.handle.runtime, backend=TorchCudaBackend(torch), nvml_enabled=False)
    # a gunicorn --preload master, or the first request before the model moved to the GPU
    with stagetrace.pipeline("before"):
        with stagetrace.gpu_stage("warmup"):
            pass
        with stagetrace.gpu_stage("on-cuda", device="cuda"):
            pass
        stagetrace.d2h(torch.tensor(4096))
    h.flush()
    assert torch.violations == []
    assert not support.backend.usable()
    # the application's first copy initialises CUDA; pinned-ness is asked after it
    with stagetrace.pipeline("first-copy"):
        stagetrace.h2d(torch.tensor(1 << 20, pinned=True), "cuda")
        with stagetrace.gpu_stage("infer"):
            torch.gpu.default_stream.enqueue(5)
    spans = {s.name: s for s in h.spans()}
    assert torch.violations == []
    assert spans["h2d"].attributes[c.H2D_PINNED] is True
    assert c.GPU_DURATION_MS in spans["infer"].attributes  # timed with events once CUDA is in use
    assert c.GPU_DURATION_MS not in spans["warmup"].attributes  # wall time before


def test_backend_reports_unknown_instead_of_initialising():
    torch = FakeTorch()
    backend = TorchCudaBackend(torch)
    assert backend.usable() is False
    assert backend.device_index("cuda") is None  # the current device is unknown without initialising
    assert backend.device_index("cuda:2") == 2
    assert backend.device_index("cpu") is None
    assert backend.is_pinned(torch.tensor(8, pinned=True)) is None
    assert torch.violations == []
    torch.initialized = True
    assert backend.usable() and backend.device_index("cuda") == 0 and backend.is_pinned(torch.tensor(8)) is False


# --- item 3: no trace waits for NVML ---------------------------------------------------------------------


def test_an_idle_gpu_does_not_hold_traces_back(make_harness):
    nvml = FakeNvml(utilization=0.0, period_ms=20, idle=True)  # the driver's sample buffer stops filling
    h = make_harness(gpu=False)
    support = attach_gpu(
        h.handle.runtime, backend=FakeCudaBackend(), nvml=nvml, nvml_enabled=True, nvml_poll_interval_s=0.05
    )
    with stagetrace.pipeline("first"):
        with stagetrace.gpu_stage("infer"):
            pass
    deadline = time.monotonic() + 5
    while not support.samplers and time.monotonic() < deadline:
        time.sleep(0.02)
    assert support.samplers
    t0 = time.monotonic()
    for _ in range(5):
        with stagetrace.pipeline("cpu-only"):
            with stagetrace.stage("decode"):
                time.sleep(0.002)
    verdicts = h.wait_verdicts(6, timeout=5)
    waited = time.monotonic() - t0
    assert len(verdicts) == 6
    assert waited < 2.0  # about two polls, not the 30 s GPU timeout
    assert "gpu_event_timeout" not in drops(h)
    assert nvml.calls.count("nvmlDeviceGetUtilizationRates") >= 1  # the idle stand-in
    assert verdicts[-1].gpu_utilization == 0.0


def test_a_mig_device_gets_the_mig_message(caplog):
    from stagetrace import _safety

    _safety._warned.clear()
    sampler = NvmlSampler("MIG-4b7c2d1e-0000-1111-2222-333344445555", nvml=FakeNvml())
    with caplog.at_level("WARNING", logger="stagetrace"):
        assert sampler.start() is False
    assert "MIG" in caplog.text and "NVML error" not in caplog.text


# --- item 4: no event leaks -----------------------------------------------------------------------------


@pytest.mark.slow
def test_100000_gpu_stages_with_drops_and_timeouts_keep_the_pool_bounded(make_harness):
    settings = Settings(max_stages_per_trace=6, gpu_wait_timeout_s=0.05, max_parked=50)
    h = make_harness(gpu=False, settings=settings)
    backend = FakeCudaBackend()
    support = attach_gpu(h.handle.runtime, backend=backend, nvml_enabled=False)
    gpu = backend.gpu
    stages = 0
    for i in range(10_000):
        with stagetrace.pipeline("r"):
            for j in range(10):  # 4 of every 10 are past the per-trace cap: dropped with their events
                with stagetrace.gpu_stage(f"s{j}"):
                    if i % 50 == 0 and j == 0:
                        gpu.default_stream.enqueue(10_000)  # never completes in time: the trace times out
                stages += 1
        if i % 50 == 0:
            gpu.default_stream.tail = 0  # the "device" recovers for the next traces
        if i % 200 == 199:
            h.flush()  # a paced producer: the helper thread keeps up (an overrun one falls back to wall time)
            in_use = support.pool.outstanding(0) - support.pool.free(0)
            assert in_use <= 4 + 12  # the kept clock anchors, and at most the timed-out trace's events
    h.flush()
    assert stages == 100_000
    found = drops(h)
    assert found["stages_per_trace"] == 40_000
    assert found.get("gpu_event_timeout", 0) + found.get("gpu_parked_full", 0) >= 1
    assert "gpu_events" not in found  # the pool never ran dry
    # Events are reused: what was ever created is what 200 traces in flight need, plus the pending events of
    # the timed-out traces (discarded and counted, since a pending event cannot be re-recorded), plus the
    # anchors; not 100,000 stages' worth.
    timed_out = found.get("gpu_event_timeout", 0) + found.get("gpu_parked_full", 0)
    assert gpu.events_created <= 200 * 12 + timed_out * 12 + 100
    assert gpu.events_created < 6_000


def test_events_of_traces_evicted_or_dropped_at_the_queue_return_to_the_pool(make_harness):
    h = make_harness(gpu=False)
    backend = FakeCudaBackend()
    support = attach_gpu(h.handle.runtime, backend=backend, nvml_enabled=False)
    shipper = h.handle.runtime.shipper
    rec_count_before = support.pool.outstanding(0)
    span = h.tracer.start_span("never-ends")
    from opentelemetry.trace import use_span

    with use_span(span, end_on_exit=False):
        with stagetrace.gpu_stage("infer"):
            pass
    assert support.pool.outstanding(0) == rec_count_before + 2
    evicted = h.handle.runtime.registry.evict_expired(now=time.monotonic() + 10_000)
    for trace in evicted:
        shipper.forget_gpu((trace, None))
    assert support.pool.outstanding(0) == rec_count_before


# --- items 5 and 6: anchors, device guard, graph capture ---------------------------------------------------


def wait_for_anchor(h, support, timeout_s: float = 5.0) -> None:
    """Clock anchors are taken on the helper thread, every ``anchor_interval_s`` once a device is in use."""
    deadline = time.monotonic() + timeout_s
    while not support.timer._anchors.get(0) and time.monotonic() < deadline:
        h.flush()
        time.sleep(0.02)


def test_gpu_spans_are_placed_with_an_error_bar(make_harness):
    h = make_harness(gpu=False)
    backend = FakeCudaBackend()
    support = attach_gpu(h.handle.runtime, backend=backend, nvml_enabled=False)
    support.timer.anchor_interval_s = 0.01
    with stagetrace.pipeline("warm"):
        with stagetrace.gpu_stage("infer"):
            pass
    wait_for_anchor(h, support)
    with stagetrace.pipeline("r"):
        x = stagetrace.h2d(FakeTensor(backend.gpu, 1 << 20, pinned=True), "cuda:0")
        with stagetrace.gpu_stage("infer"):
            fake_model(x, ms=20)
    spans = [s for s in h.spans() if s.name == "infer"]
    placed = spans[-1].attributes
    assert c.HOST_DURATION_MS in placed
    assert 0 <= placed[c.GPU_PLACEMENT_ERROR_US] <= 50  # only tight anchors are kept


def test_a_wide_anchor_window_is_rejected_not_used(make_harness):
    h = make_harness(gpu=False)
    backend = FakeCudaBackend()
    support = attach_gpu(h.handle.runtime, backend=backend, nvml_enabled=False)
    support.timer.anchor_max_window_ns = 0  # no window can be this tight
    support.timer.anchor_interval_s = 0.01
    with stagetrace.pipeline("r"):
        with stagetrace.gpu_stage("infer"):
            fake_model(FakeTensor(backend.gpu, 8), ms=5)
    deadline = time.monotonic() + 5
    while support.timer.anchors_rejected == 0 and time.monotonic() < deadline:
        h.flush()
        time.sleep(0.02)
    assert support.timer.anchors_rejected >= 1 and not support.timer._anchors.get(0)
    (infer,) = h.by_name("infer")
    assert c.GPU_DURATION_MS in infer.attributes and c.HOST_DURATION_MS not in infer.attributes


def test_a_placement_past_the_trace_end_is_moved_back_not_dropped(make_harness):
    h = make_harness(gpu=False)
    backend = FakeCudaBackend()
    support = attach_gpu(h.handle.runtime, backend=backend, nvml_enabled=False)
    skew_ns = 50_000_000  # an anchor 50 ms off, as a wide window under contention could make it

    place = support.timer.place
    support.timer.place = lambda d, e, p: (lambda r: r and (r[0] + skew_ns, r[1]))(place(d, e, p))
    support.timer.anchor_interval_s = 0.01
    with stagetrace.pipeline("warm"):
        with stagetrace.gpu_stage("w"):
            pass
    wait_for_anchor(h, support)
    with stagetrace.pipeline("r"):
        with stagetrace.gpu_stage("infer"):
            fake_model(FakeTensor(backend.gpu, 8), ms=2)
        backend.gpu.default_stream.wait_host()
    verdict = h.wait_verdicts(2)[-1]
    assert "infer" in verdict.breakdown  # still in the verdict
    infer = h.by_name("infer")[-1]
    assert infer.attributes[c.GPU_PLACEMENT_CLAMPED] is True


def test_queries_run_under_the_events_device_in_thread_local_capture_mode(make_harness):
    h = make_harness(gpu=False)
    backend = FakeCudaBackend()
    attach_gpu(h.handle.runtime, backend=backend, nvml_enabled=False)
    for _ in range(5):
        with stagetrace.pipeline("r"):
            with stagetrace.gpu_stage("infer", device="cuda:1"):
                pass
    assert len(h.wait_verdicts(5)) == 5
    assert backend.gpu.queries_off_device == 0
    helper = h.handle.runtime.shipper._thread
    assert backend.gpu.thread_local_capture_threads == {helper.ident}


def test_no_query_overlaps_a_capture_that_starts_while_traces_resolve(make_harness):
    h = make_harness(gpu=False)
    backend = FakeCudaBackend()
    support = attach_gpu(h.handle.runtime, backend=backend, nvml_enabled=False)
    with stagetrace.pipeline("first"):
        with stagetrace.gpu_stage("infer"):
            pass  # installs the capture guard
    stop = threading.Event()

    def capturer() -> None:
        graph_cls = backend.graph_class()
        while not stop.is_set():
            g = graph_cls()
            g.capture_begin()
            time.sleep(0.002)
            g.capture_end()
            time.sleep(0.003)  # captures come and go (lazy cudagraph captures on new shapes)

    t = threading.Thread(target=capturer)
    t.start()
    try:
        for _ in range(200):
            with stagetrace.pipeline("r"):
                with stagetrace.gpu_stage("infer"):
                    pass
        h.wait_verdicts(201)
    finally:
        stop.set()
        t.join()
    assert backend.gpu.queries_during_capture == 0
    assert len(h.verdicts) == 201
    assert support.guard.capturing is False


# --- item 7: what a GPU stage's time means under concurrency ---------------------------------------------


@pytest.mark.parametrize("per_request_streams", [False, True])
def test_concurrent_requests_on_one_stream_bracket_each_others_kernels(make_harness, per_request_streams):
    """Two requests launch 20 ms of kernels each, interleaved. On the shared default stream, the first one's
    end event lands after the second's kernels: its stage reads ~40 ms. On a stream per request each reads
    its own ~20 ms. (The README's "GPU stages under concurrency".) The device's clock is virtual: a host
    thread descheduled between its event and its launch would otherwise be device time, as on a real GPU."""
    h = make_harness(gpu=False)
    backend = FakeCudaBackend(FakeGpu(virtual_clock=True))
    attach_gpu(h.handle.runtime, backend=backend, nvml_enabled=False)
    gpu = backend.gpu
    launched = threading.Barrier(2)
    both = threading.Barrier(2)

    def request(first: bool) -> None:
        from fakes import FakeStream

        stream = FakeStream(gpu) if per_request_streams else gpu.default_stream
        with gpu.stream(stream), stagetrace.pipeline("first" if first else "second"):
            if not first:
                launched.wait()  # the second launches after the first
            with stagetrace.gpu_stage("infer"):
                fake_model(FakeTensor(gpu, 8), ms=20)
                if first:
                    launched.wait()
                    both.wait()  # the first records its end event after the second launched
            if not first:
                both.wait()
            stream.wait_host()

    threads = [threading.Thread(target=request, args=(f,)) for f in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    verdicts = {v.root_name: v.breakdown["infer"] for v in h.wait_verdicts(2)}
    assert verdicts["second"] == pytest.approx(20)
    if per_request_streams:
        assert verdicts["first"] == pytest.approx(20)
    else:
        assert verdicts["first"] == pytest.approx(40)  # its events bracket the second request's kernels too


# --- item 8: the first GPU run's own logic, checked here -------------------------------------------------


def _benchmark_module(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_cuts_cupti_records_into_requests():
    gpu_check = _benchmark_module("gpu_check")
    events = []
    for i in range(3):  # per request: a copy in, two kernels with a launch gap, a copy out; a memset ignored
        t = i * 1000.0
        events += [
            ("Memcpy HtoD (Pinned -> Device)", t, 100.0),
            ("ampere_sgemm_128x64_tn", t + 110, 200.0),
            ("Memset (Device)", t + 312, 1.0),
            ("void elementwise_kernel", t + 320, 30.0),
            ("Memcpy DtoH (Device -> Pageable)", t + 360, 80.0),
        ]
    events.append(("Memcpy DtoH (Device -> Pageable)", 5000.0, 10.0))  # a stray copy outside a request
    out = gpu_check.truth_per_request(reversed(events))
    assert out == [{"h2d": 0.1, "infer": 0.24, "d2h": 0.08}] * 3
    assert gpu_check.within(1.04, 1.0) and not gpu_check.within(1.06, 1.0)
    assert gpu_check.within(0.03, 0.015)  # 20 us of slack for tiny stages


def test_gpu_session_script_is_valid_and_runs_its_steps_in_order():
    import re
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    steps = re.findall(r"^step (\S+) (\d+) ", script.read_text(), flags=re.M)
    assert [s for s, _ in steps] == ["env", "nvml", "cuda-tests", "anchors", "capture", "dtype", "gpu-check"]
    assert sum(int(limit) for _, limit in steps) < 600  # every step bounded, the whole within one 10-minute device call
