"""The GPU path against what real hardware would do to it, on CPU: CUDA never initialised by stagetrace,
no trace waiting for an idle GPU's NVML, no CUDA event leaked, clock anchors with an error bar, queries
under the event's device and never during a graph capture."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest

import stagetrace
from fakes import FakeCudaBackend, FakeGpu, FakeNvml, FakeNvmlDevice, FakeTensor, FakeTorch, fake_model, fake_uuid
from stagetrace import conventions as c
from stagetrace.gpu import attach_gpu
from stagetrace.gpu import backend as backend_module
from stagetrace.gpu.backend import TorchCudaBackend, mapped_function, nvml_uuid
from stagetrace.gpu.events import CaptureGuard, CudaEventTimer, EventPool
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


@pytest.mark.parametrize(
    ("name", "visible", "expected"),
    [
        ("NVIDIA H200", "", "GPU-"),
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "", "MIG-"),  # CUDA's name for a MIG instance
        ("NVIDIA H100 80GB HBM3", "MIG-4b7c2d10-9e3f-5a1c-8d2b-6e5f4a3b2c10", "MIG-"),
        ("NVIDIA H100 80GB HBM3", "0,1", "GPU-"),
    ],
)
def test_torchs_bare_uuid_is_mapped_to_nvmls_form(name, visible, expected):
    raw = fake_uuid(0)  # what str(torch.cuda.get_device_properties(0).uuid) prints: bare 8-4-4-4-12 hex
    assert nvml_uuid(raw, device_name=name, visible_devices=visible) == expected + raw
    assert nvml_uuid("MIG-" + raw) == "MIG-" + raw and nvml_uuid("GPU-" + raw) == "GPU-" + raw


def test_backend_reads_the_uuid_and_name_torch_reports(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    torch = FakeTorch(device_name="NVIDIA A100-SXM4-40GB MIG 1g.5gb")
    torch.initialized = True
    assert TorchCudaBackend(torch).device_uuid(0) == "MIG-" + fake_uuid(0)
    assert TorchCudaBackend(FakeTorch()).device_uuid(0) == "GPU-" + fake_uuid(0)


@pytest.mark.parametrize(
    ("devices", "device_name", "message"),
    [
        # the instance's name says MIG: the sampler is given MIG-<hex> and never asks NVML for a handle
        ([FakeNvmlDevice("MIG-" + fake_uuid(0), mig_instance=True)], "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "MIG"),
        # it does not: NVML does not know GPU-<hex> but knows MIG-<hex>
        ([FakeNvmlDevice("GPU-" + fake_uuid(7)), FakeNvmlDevice("MIG-" + fake_uuid(0), mig_instance=True)],
         "NVIDIA H100 80GB HBM3", "MIG"),
        # neither form known: an NVML error, as before
        ([FakeNvmlDevice("GPU-" + fake_uuid(7))], "NVIDIA H100 80GB HBM3", "NVML error"),
    ],
)  # fmt: skip
def test_a_mig_instance_from_torch_gets_the_mig_message(make_harness, caplog, devices, device_name, message):
    from stagetrace import _safety

    _safety._warned.clear()
    h = make_harness(gpu=False)
    backend = FakeCudaBackend(device_name=device_name)
    support = attach_gpu(h.handle.runtime, backend=backend, nvml=FakeNvml(devices=devices), nvml_poll_interval_s=0.02)
    with caplog.at_level("WARNING", logger="stagetrace"):
        for _ in range(3):
            with stagetrace.pipeline("r"), stagetrace.gpu_stage("infer"):
                fake_model(FakeTensor(backend.gpu, 8), ms=1)
            h.wait_verdicts(1)
            h.flush()
    warnings = [r.getMessage() for r in caplog.records if "GPU utilisation off" in r.getMessage()]
    assert support.samplers == {}
    assert len(warnings) == 1 and message in warnings[0]
    if message == "MIG":
        assert "NVML error" not in warnings[0]


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


def spinning_thread(stop: threading.Event) -> threading.Thread:
    """A pure-Python CPU-bound thread: it gives the GIL up only when asked to, every switch interval."""

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    return t


def test_clock_anchors_survive_a_cpu_bound_python_thread():
    """FakeEvent.record, like torch's binding, releases the GIL around its C part; here that part lasts
    100 us (as cudaEventRecord can while another thread's launches hold the driver's lock), long enough for
    the pure-Python thread beside it to take the GIL, which it then keeps for a switch interval (5 ms). A
    window holding such a record can never be under 50 us: the anchor's record is made with the GIL held."""
    backend = FakeCudaBackend(FakeGpu(record_c_us=100))
    timer = CudaEventTimer(backend, EventPool(backend), CaptureGuard())
    stop = threading.Event()
    spinner = spinning_thread(stop)
    try:
        for _ in range(10):
            timer._calibrate(0)
    finally:
        stop.set()
        spinner.join()
    anchors = timer.anchors(0)
    assert anchors, f"no anchor kept beside a CPU-bound thread ({timer.anchors_rejected} rejected)"
    assert all(a.error_ns * 2 <= timer.anchor_max_window_ns for a in anchors)
    assert timer.records_holding_gil >= len(anchors) and timer.records_through_torch == 0


def test_without_a_gil_held_record_anchors_fall_back_to_torchs_and_are_rejected_when_wide():
    """Where the CUDA runtime cannot be reached, the window holds torch's record, and a record that stays
    in C past the bound is not trusted: no placement rather than a wrong one."""
    backend = FakeCudaBackend(FakeGpu(record_c_us=100), gil_held_record=False)
    timer = CudaEventTimer(backend, EventPool(backend), CaptureGuard())
    for _ in range(3):
        timer._calibrate(0)
    assert timer.records_through_torch >= 3 and timer.records_holding_gil == 0
    assert timer.anchors(0) == () and timer.anchors_rejected == 3


def test_gpu_spans_are_placed_beside_a_cpu_bound_python_thread(make_harness):
    """An application with a pure-Python CPU-bound thread (a tokenizer, JSON) still gets GPU placement."""
    h = make_harness(gpu=False)
    backend = FakeCudaBackend(FakeGpu(record_c_us=100))
    support = attach_gpu(h.handle.runtime, backend=backend, nvml_enabled=False)
    support.timer.anchor_interval_s = 0.01
    stop = threading.Event()
    spinner = spinning_thread(stop)
    try:
        with stagetrace.pipeline("warm"), stagetrace.gpu_stage("infer"):
            pass
        wait_for_anchor(h, support)
        with stagetrace.pipeline("r"), stagetrace.gpu_stage("infer"):
            fake_model(FakeTensor(backend.gpu, 8), ms=5)
        h.wait_verdicts(2)
    finally:
        stop.set()
        spinner.join()
    placed = h.by_name("infer")[-1].attributes
    assert c.HOST_DURATION_MS in placed, f"not placed ({support.timer.anchors_rejected} anchors rejected)"
    assert placed[c.GPU_PLACEMENT_ERROR_US] <= 25


def test_the_gil_held_record_falls_back_to_torchs_and_keeps_the_runtimes_last_error_clean(monkeypatch):
    """``record_holding_gil`` calls cudaEventRecord on torch's own handles; a failed call is not an anchor
    and its error is cleared from the runtime's per-thread state (a later torch call would raise it)."""
    calls: list[tuple[str, tuple]] = []
    status = {"cudaEventRecord": 0}

    def cudart(name, argtypes, hold_gil=False):
        assert hold_gil or name == "cudaGetLastError"
        return lambda *args: calls.append((name, args)) or status.get(name, 0)

    monkeypatch.setattr(backend_module, "_cudart_function", cudart)
    torch = FakeTorch()
    torch.initialized = True
    backend = TorchCudaBackend(torch)
    stream = torch.cuda.Stream()
    event = torch.cuda.Event(enable_timing=True)
    assert not backend.event_created(event) and backend.record_holding_gil(event, stream) is False
    event.record(stream)  # torch creates the CUDA event at its first record
    assert backend.event_created(event) and backend.record_holding_gil(event, stream) is True
    assert calls == [("cudaEventRecord", (event.cuda_event, stream.cuda_stream))]
    status["cudaEventRecord"] = 400  # cudaErrorInvalidResourceHandle
    assert backend.record_holding_gil(event, stream) is False
    assert [name for name, _ in calls[1:]] == ["cudaEventRecord", "cudaGetLastError"]


def test_a_function_called_holding_the_gil_lets_no_python_thread_run():
    """What ``record_holding_gil`` rests on: ``mapped_function(..., hold_gil=True)`` (ctypes.PyDLL) keeps
    the GIL through the C call. A 20 ms sleep in libc made that way lets a spinning thread take no step;
    with a long switch interval (0.25 s) nothing else can take the GIL from this thread meanwhile."""
    usleep = mapped_function("libc.so", "usleep", [ctypes.c_uint], hold_gil=True)
    if usleep is None:
        pytest.skip("no libc.so mapped into this process")
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=spin, daemon=True)
    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.25)
    try:
        t.start()
        while count[0] == 0:
            time.sleep(0.001)  # the spinner runs; this thread then takes the GIL back for a fresh interval
        before = count[0]
        usleep(20_000)
        after = count[0]
    finally:
        stop.set()
        sys.setswitchinterval(previous)
        t.join()
    assert after == before


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
