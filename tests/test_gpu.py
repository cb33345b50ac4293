"""GPU stages on CPU against fakes that mirror torch.cuda.Event and pynvml (tests/fakes.py), torch's real
CPU paths, and real CUDA where a device exists (skipped, visibly, where it does not)."""

from __future__ import annotations

import logging
import time

import pynvml
import pytest
import torch

import stagetrace
from fakes import FakeCudaBackend, FakeGpu, FakeNvml, FakeTensor, fake_model, fake_uuid
from stagetrace import conventions as c
from stagetrace.gpu import attach_gpu


@pytest.fixture
def gpu_world(make_harness):
    def make(nvml=None, virtual_clock=False, **kwargs):
        """``virtual_clock``: device times exactly as launched, whatever the host's load (tests/fakes.py)."""
        h = make_harness(gpu=False, **kwargs)
        backend = FakeCudaBackend(FakeGpu(virtual_clock=virtual_clock))
        support = attach_gpu(
            h.handle.runtime, backend=backend, nvml=nvml, nvml_enabled=nvml is not None, nvml_poll_interval_s=0.02
        )
        support.timer.anchor_interval_s = 0.05
        return h, backend.gpu, support

    return make


def wait_for_sampler(support, timeout_s: float = 5) -> None:
    """NVML starts on the helper thread after the first GPU stage."""
    deadline = time.monotonic() + timeout_s
    while not support.samplers and time.monotonic() < deadline:
        time.sleep(0.02)


def classic_pipeline(gpu: FakeGpu):
    x = stagetrace.h2d(FakeTensor(gpu, 4 << 20, pinned=True), "cuda:0")
    with stagetrace.gpu_stage("infer"):
        y = fake_model(x, ms=40)
    return stagetrace.d2h(y)


def test_gpu_time_charged_to_the_stage_that_did_the_work(gpu_world):
    h, gpu, _ = gpu_world(virtual_clock=True)
    with stagetrace.pipeline("request"):
        classic_pipeline(gpu)
    v = h.wait_verdicts(1)[0]
    assert v.bottleneck == "infer"
    assert 38 <= v.breakdown["infer"] <= 48
    assert v.breakdown["d2h"] < 5  # its host call waited ~40 ms for inference; that wait is not its own
    spans = {s.name: s for s in h.spans()}
    assert spans["d2h"].attributes[c.GPU_DURATION_MS] < 5
    assert spans["infer"].attributes[c.GPU_DURATION_MS] >= 38
    assert gpu.sync_calls == 0 and gpu.elapsed_on_incomplete == 0


def test_the_classic_host_timer_blames_d2h_in_the_same_pipeline(gpu_world):
    _h, gpu, _ = gpu_world()
    profiler = stagetrace.InferencePipelineProfiler()
    profiler.start()
    x = FakeTensor(gpu, 4 << 20, pinned=True).to("cuda:0", non_blocking=True)
    profiler.record_stage("h2d")
    y = fake_model(x, ms=40)
    profiler.record_stage("infer")
    y.to("cpu")
    profiler.record_stage("d2h")
    assert profiler.analyze_and_report()["bottleneck_stage"] == "d2h"


def test_gpu_spans_are_placed_where_the_gpu_ran_them(gpu_world):
    h, gpu, support = gpu_world()
    with stagetrace.pipeline("warm"):  # first GPU use: anchors start from here
        classic_pipeline(gpu)
    h.wait_verdicts(1)
    deadline = time.monotonic() + 5
    while not support.timer._anchors and time.monotonic() < deadline:
        h.flush()
        time.sleep(0.02)
    assert support.timer._anchors, "no clock anchor was taken"
    time.sleep(0.06)
    with stagetrace.pipeline("request"):
        classic_pipeline(gpu)
    h.wait_verdicts(2)
    spans = {s.name: s for s in h.spans() if s.context.trace_id == h.by_name("request")[0].context.trace_id}
    infer = spans["infer"]
    host_ms = infer.attributes[c.HOST_DURATION_MS]
    placed_ms = (infer.end_time - infer.start_time) / 1e6
    assert host_ms < 10 and 38 <= placed_ms <= 48  # the launch was quick; the kernels ran 40 ms
    assert infer.start_time >= spans["h2d"].start_time
    assert spans["d2h"].start_time >= infer.end_time - 2_000_000  # the copy ran after the kernels


def test_h2d_notes_bytes_and_pinning_and_flags_pageable_copies(gpu_world):
    h, gpu, _ = gpu_world()
    with stagetrace.pipeline("pinned"):
        stagetrace.h2d(FakeTensor(gpu, 8 << 20, pinned=True), "cuda:0")
    with stagetrace.pipeline("pageable"):
        stagetrace.h2d(FakeTensor(gpu, 8 << 20, pinned=False), "cuda:0")
    h.wait_verdicts(2)
    by_root = {v.root_name: v for v in h.verdicts}
    assert "PAGEABLE_H2D" not in by_root["pinned"].diagnosis_codes
    assert "PAGEABLE_H2D" in by_root["pageable"].diagnosis_codes
    copies = sorted(h.by_name("h2d"), key=lambda s: s.start_time)
    assert [s.attributes[c.H2D_PINNED] for s in copies] == [True, False]
    assert all(s.attributes[c.H2D_BYTES] == 8 << 20 for s in copies)
    root = h.by_name("pageable")[0]
    (event,) = [e for e in root.events if e.attributes.get(c.DIAGNOSIS_EVENT_CODE) == "PAGEABLE_H2D"]
    assert "pin_memory" in event.attributes[c.DIAGNOSIS_EVENT_ADVICE]
    assert (
        sum(p.value for p in h.metric_points(c.METRIC_DIAGNOSIS) if p.attributes[c.DIAGNOSIS_CODE] == "PAGEABLE_H2D")
        == 1
    )


@pytest.mark.slow  # over 1.4 s on its own: out of the quick loop
def test_events_are_pooled_not_created_per_stage(gpu_world):
    h, gpu, support = gpu_world()
    for _ in range(30):
        with stagetrace.pipeline("r"):
            classic_pipeline(gpu)
        h.flush()
    # 6 per pipeline in flight, reused once read; plus the clock anchors (4 kept, a few per calibration)
    assert support.pool.outstanding(0) <= 12 + 4 + support.timer.anchor_attempts
    assert len(h.verdicts) == 30


def test_no_event_is_queried_during_a_cuda_graph_capture(gpu_world):
    h, gpu, support = gpu_world()
    with stagetrace.pipeline("before-capture"):
        x = stagetrace.h2d(FakeTensor(gpu, 1 << 20, pinned=True), "cuda:0")
        with stagetrace.gpu_stage("infer"):
            fake_model(x, ms=30)
    graph = support.backend.Graph()
    graph.capture_begin()  # another thread captures while the helper thread has events to read
    assert support.guard.capturing
    time.sleep(0.1)
    assert h.verdicts == []  # parked, not queried
    graph.capture_end()
    h.wait_verdicts(1)
    assert gpu.queries_during_capture == 0
    assert h.verdicts[0].bottleneck == "infer"


def test_stage_inside_a_capture_on_this_thread_records_no_events(gpu_world):
    h, _gpu, support = gpu_world()
    graph = support.backend.Graph()
    graph.capture_begin()
    with stagetrace.pipeline("captured"), stagetrace.gpu_stage("infer"):
        pass
    graph.capture_end()
    spans = {s.name: s for s in h.spans()}
    assert c.GPU_DURATION_MS not in spans["infer"].attributes  # wall time, no event recorded in the graph


def test_nvml_utilisation_per_stage_and_per_trace(gpu_world):
    nvml = FakeNvml(utilization=0.1, period_ms=20)
    h, gpu, support = gpu_world(nvml=nvml)
    with stagetrace.pipeline("warm"):
        classic_pipeline(gpu)
    h.wait_verdicts(1)
    wait_for_sampler(support)
    with stagetrace.pipeline("request"):
        with stagetrace.stage("decode"):
            time.sleep(0.12)  # CPU-side work dominates while the GPU idles at 10%
        classic_pipeline(gpu)
    v = h.wait_verdicts(2)[-1]
    assert v.gpu_utilization == pytest.approx(0.1, abs=0.01)
    assert "GPU_STARVED" in v.diagnosis_codes
    spans = {s.name: s for s in h.spans() if s.context.trace_id == int(v.trace_id, 16)}
    infer = spans["infer"].attributes
    assert infer[c.GPU_UTILIZATION] == pytest.approx(0.1, abs=0.01)
    assert infer[c.GPU_UTILIZATION_MIN] <= infer[c.GPU_UTILIZATION] <= infer[c.GPU_UTILIZATION_MAX]
    assert infer[c.GPU_MEMORY_USED] == 120 << 30
    assert spans["request"].attributes[c.GPU_UTILIZATION] == pytest.approx(0.1, abs=0.01)
    gauge = h.metric_points(c.METRIC_GPU_UTILIZATION)
    assert gauge and gauge[0].attributes[c.HW_ID] == "GPU-" + fake_uuid(0)  # NVML's form of torch's UUID
    import threading

    assert threading.main_thread().ident not in nvml.threads  # NVML never runs on a request thread


@pytest.mark.parametrize(
    ("nvml", "message"),
    [
        (FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), "NVML error"),
        (FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED), "NVML error"),
        (FakeNvml(mig=True), "MIG"),
    ],
)
def test_nvml_failures_switch_utilisation_off_with_one_warning(gpu_world, caplog, nvml, message):
    from stagetrace import _safety

    _safety._warned.clear()
    h, gpu, support = gpu_world(nvml=nvml)
    with caplog.at_level(logging.WARNING, logger="stagetrace"):
        for _ in range(3):
            with stagetrace.pipeline("r"):
                classic_pipeline(gpu)
            h.wait_verdicts(1)
            h.flush()
    assert support.samplers == {}
    warnings = [r for r in caplog.records if "GPU utilisation off" in r.getMessage()]
    assert len(warnings) == 1 and message in warnings[0].getMessage()
    assert h.verdicts[-1].bottleneck == "infer"  # event timing still works


def test_samples_api_not_supported_falls_back_to_rates(gpu_world):
    nvml = FakeNvml(utilization=0.55, samples_supported=False)
    h, gpu, support = gpu_world(nvml=nvml)
    with stagetrace.pipeline("warm"):
        classic_pipeline(gpu)
    h.wait_verdicts(1)
    wait_for_sampler(support)
    time.sleep(0.1)
    assert "nvmlDeviceGetUtilizationRates" in nvml.calls
    sampler = support.samplers[0]
    stats = sampler.window(time.time_ns() - 200_000_000, time.time_ns())
    assert stats is not None and stats.mean == pytest.approx(0.55)


def test_cpu_only_torch_paths_record_bytes_and_fall_back_to_wall_time(harness):
    x = torch.zeros(1000, dtype=torch.float32)
    with stagetrace.pipeline("cpu-only"):
        y = stagetrace.h2d(x, "cpu")
        # The device named: on a machine with CUDA in use, the default device would (rightly) be timed on it.
        with stagetrace.gpu_stage("infer", device="cpu"):
            z = y * 2
        out = stagetrace.d2h(z)
    assert torch.equal(out, x * 2)
    spans = {s.name: s for s in harness.spans()}
    assert spans["h2d"].attributes[c.H2D_BYTES] == 4000
    # pinned-ness is asked only once the application initialised CUDA (is_pinned() can create a context)
    assert c.H2D_PINNED not in spans["h2d"].attributes
    assert spans["h2d"].attributes[c.STAGE_KIND] == "h2d"
    assert c.GPU_DURATION_MS not in spans["infer"].attributes
    assert spans["d2h"].attributes["stagetrace.d2h.bytes"] == 4000
    assert "PAGEABLE_H2D" not in harness.verdicts[0].diagnosis_codes  # no real device copy, no claim


def test_gpu_stage_as_decorator_and_errors_propagate(harness):
    @stagetrace.gpu_stage("forward")
    def forward(t):
        return t + 1

    with stagetrace.pipeline("p"):
        assert forward(torch.ones(2)).tolist() == [2.0, 2.0]
    with pytest.raises(RuntimeError, match="Invalid device"), stagetrace.pipeline("bad"):
        stagetrace.h2d(torch.ones(2), "no-such-device")
    assert {"forward", "h2d"} <= {s.name for s in harness.spans()}


def cuda(test):
    """The ``cuda`` marker, and a visible skip without a device (``pytest -m cuda`` selects these)."""
    needs = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
    return pytest.mark.cuda(needs(test))


@cuda
def test_real_cuda_pipeline_adds_no_synchronisation(harness):
    dev = torch.device("cuda:0")
    model = torch.nn.Linear(1024, 1024).to(dev)
    x = torch.randn(256, 1024).pin_memory()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with stagetrace.pipeline("cuda"):
            xd = stagetrace.h2d(x, dev)
            with stagetrace.gpu_stage("infer"):
                y = model(xd)
        torch.cuda.set_sync_debug_mode("default")
        stagetrace.d2h(y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    v = harness.wait_verdicts(1)[0]
    assert v.breakdown["infer"] > 0


@cuda
def test_real_cuda_events_resolve(harness):
    dev = torch.device("cuda:0")
    a = torch.randn(4096, 4096, device=dev)
    with stagetrace.pipeline("mm"), stagetrace.gpu_stage("matmul"):
        for _ in range(10):
            a = a @ a
            a = a / a.norm()
    spans = {s.name: s for s in harness.spans()}
    assert spans["matmul"].attributes[c.GPU_DURATION_MS] > 0


def test_a_batch_gpu_stage_is_read_once_and_charged_to_every_member(gpu_world):
    h, gpu, support = gpu_world()
    resolved = []
    original = support.timer.resolve
    support.timer.resolve = lambda rec, offset: resolved.append(rec.name) or original(rec, offset)
    from opentelemetry.trace import use_span

    roots, tickets = [], []
    for _ in range(4):
        span = h.tracer.start_span("request")
        with use_span(span, end_on_exit=False):
            tickets.append(stagetrace.enqueue("infer.queue"))
        roots.append(span)
    with stagetrace.batch("infer", tickets, max_size=8):
        x = stagetrace.h2d(FakeTensor(gpu, 1 << 20, pinned=True), "cuda:0")
        with stagetrace.gpu_stage("forward"):
            fake_model(x, ms=30)
    for span in roots:
        span.end()
    verdicts = h.wait_verdicts(4)
    assert len(verdicts) == 4
    for v in verdicts:
        assert 28 <= v.breakdown["forward"] <= 40  # GPU time from the events, in every member
    assert sorted(resolved) == ["forward", "h2d"]  # each stage's events read once, not once per member
    forwards = [s for s in h.spans() if s.name == "forward"]
    assert len(forwards) == 5 and len({s.attributes[c.GPU_DURATION_MS] for s in forwards}) == 1
    assert gpu.sync_calls == 0
