"""Fakes that mirror the real APIs' signatures and errors, for testing the CUDA and NVML paths on CPU.

FakeGpu simulates an asynchronous device driven by real time: work enqueued on a stream runs after the
work before it; an event completes when the simulated stream reaches it; a blocking copy really waits.
FakeEvent raises what torch.cuda.Event raises (torch 2.13, c10/cuda/CUDAEvent.h). FakeNvml raises the real
pynvml.NVMLError subclasses from nvidia-ml-py.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pynvml


class FakeGpu:
    """``virtual_clock=True``: the device's time stands still until a host waits for its work
    (``FakeStream.wait_host`` moves it to the stream's tail), so kernels' timings are exactly what was
    launched, whatever the host's load. The default follows real time, as a device does."""

    def __init__(self, *, virtual_clock: bool = False) -> None:
        self.base = time.perf_counter_ns()
        self.virtual_clock = virtual_clock
        self.virtual_now = 0
        self.sync_calls = 0
        self.elapsed_on_incomplete = 0
        self.queries_during_capture = 0
        self.capturing = False
        self.capturing_thread: int | None = None
        self.events_created = 0
        self.default_stream = FakeStream(self)
        self.current = threading.local()  # the calling thread's current device (torch.cuda.device)
        self.queries_off_device = 0  # queries made while another device was current (would open a context)
        self.thread_local_capture_threads: set[int] = set()

    def now(self) -> int:
        if self.virtual_clock:
            return self.virtual_now
        return time.perf_counter_ns() - self.base

    def current_stream(self) -> FakeStream:
        """The calling thread's current stream (``torch.cuda.stream(s)``), else the default stream."""
        return getattr(self.current, "stream", None) or self.default_stream

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        """``torch.cuda.device(index)``: the calling thread's current device, restored on exit."""
        previous = getattr(self.current, "device", 0)
        self.current.device = index
        try:
            yield
        finally:
            self.current.device = previous

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        previous = getattr(self.current, "stream", None)
        self.current.stream = stream
        try:
            yield
        finally:
            self.current.stream = previous


class FakeStream:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.tail = 0  # simulated time at which the stream's queued work finishes

    def enqueue(self, ms: float) -> None:
        start = max(self.tail, self.gpu.now())
        self.tail = start + int(ms * 1e6)

    def synchronize(self) -> None:  # present so a test would catch a call; stagetrace must never make one
        self.gpu.sync_calls += 1
        self.wait_host()

    def wait_host(self) -> None:
        if self.gpu.virtual_clock:
            self.gpu.virtual_now = max(self.gpu.virtual_now, self.tail)
            return
        while self.gpu.now() < self.tail:
            time.sleep(0.0005)


class FakeEvent:
    def __init__(self, gpu: FakeGpu, enable_timing: bool = False, device: int = 0) -> None:
        self.gpu = gpu
        self.device = device
        self.enable_timing = enable_timing
        self._t: int | None = None
        gpu.events_created += 1

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.gpu.current_stream()
        self._t = max(stream.tail, self.gpu.now())

    def query(self) -> bool:
        if self.gpu.capturing and threading.get_ident() != self.gpu.capturing_thread:
            self.gpu.queries_during_capture += 1
        if getattr(self.gpu.current, "device", 0) != self.device:
            self.gpu.queries_off_device += 1
        if self._t is None:
            return True  # torch: "Always returns True if the Event was not recorded"
        return self.gpu.now() >= self._t

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise ValueError("Both events must be created with argument 'enable_timing=True'.")
        if self._t is None or end._t is None:
            raise ValueError("Both events must be recorded before calculating elapsed time.")
        if not (self.gpu.now() >= self._t and self.gpu.now() >= end._t):
            self.gpu.elapsed_on_incomplete += 1
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end._t - self._t) / 1e6

    def synchronize(self) -> None:
        self.gpu.sync_calls += 1


class FakeCUDAGraph:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu

    def capture_begin(self, *args: Any, **kwargs: Any) -> None:
        self.gpu.capturing = True
        self.gpu.capturing_thread = threading.get_ident()

    def capture_end(self) -> None:
        self.gpu.capturing = False
        self.gpu.capturing_thread = None


class FakeDevice(SimpleNamespace):
    pass


def parse_device(device: Any) -> FakeDevice:
    dev = getattr(device, "device", device)
    if isinstance(dev, FakeDevice):
        return dev
    text = str(dev)
    kind, _, index = text.partition(":")
    return FakeDevice(type=kind, index=int(index) if index else (0 if kind == "cuda" else None))


class FakeCudaBackend:
    """The TorchCudaBackend interface over FakeGpu."""

    def __init__(self, gpu: FakeGpu | None = None, usable: bool = True) -> None:
        self.gpu = gpu or FakeGpu()
        self._usable = usable
        graph_gpu = self.gpu

        class Graph(FakeCUDAGraph):
            def __init__(self) -> None:
                super().__init__(graph_gpu)

        self.Graph = Graph

    def usable(self) -> bool:
        return self._usable

    def device_index(self, device: Any) -> int | None:
        dev = parse_device(device)
        return dev.index if dev.type == "cuda" else None

    def current_stream(self, device_index: int | None = None) -> FakeStream:
        return self.gpu.current_stream()

    def new_side_stream(self, device_index: int) -> FakeStream:
        return FakeStream(self.gpu)

    def new_event(self, device_index: int) -> FakeEvent:
        return FakeEvent(self.gpu, enable_timing=True, device=device_index)

    def on_device(self, device_index: int) -> Any:
        return self.gpu.device(device_index)

    def is_pinned(self, tensor: Any) -> bool | None:
        return bool(tensor.is_pinned()) if self._usable else None

    def use_thread_local_capture_mode(self) -> bool:
        self.gpu.thread_local_capture_threads.add(threading.get_ident())
        return True

    def is_capturing(self) -> bool:
        return self.gpu.capturing and threading.get_ident() == self.gpu.capturing_thread

    def graph_class(self) -> Any:
        return self.Graph

    def device_uuid(self, device_index: int) -> str:
        return f"GPU-fake-{device_index}"

    def default_device(self) -> int:
        return 0


class FakeTensor:
    """The torch.Tensor surface stagetrace and the fake model use."""

    def __init__(self, gpu: FakeGpu, nbytes: int, device: str = "cpu", pinned: bool = False) -> None:
        self.gpu = gpu
        self.nbytes = nbytes
        self.device = parse_device(device)
        self.pinned = pinned

    def numel(self) -> int:
        return self.nbytes // 4

    def element_size(self) -> int:
        return 4

    def is_pinned(self) -> bool:
        return self.pinned

    def to(self, device: Any, non_blocking: bool = False) -> FakeTensor:
        target = parse_device(device)
        stream = self.gpu.default_stream
        gbps = 20.0 if self.pinned or self.device.type == "cuda" else 6.0
        if target.type == "cuda" and self.device.type == "cpu":
            stream.enqueue(self.nbytes / (gbps * 1e9) * 1e3)
            if not (non_blocking and self.pinned):
                stream.wait_host()  # pageable or blocking: the host waits (the driver's staging copy)
        elif target.type == "cpu" and self.device.type == "cuda":
            stream.enqueue(self.nbytes / (gbps * 1e9) * 1e3)
            if not non_blocking:
                stream.wait_host()  # a blocking D2H waits for everything queued before it
        return FakeTensor(
            self.gpu,
            self.nbytes,
            f"{target.type}:{target.index}" if target.index is not None else target.type,
            pinned=False,
        )


def fake_model(x: FakeTensor, ms: float = 40.0) -> FakeTensor:
    """Launches ``ms`` of kernels on the current stream and returns at once, like a real forward pass."""
    x.gpu.current_stream().enqueue(ms)
    return FakeTensor(x.gpu, 4096, "cuda:0")


class FakeNvml:
    """The pynvml (nvidia-ml-py) functions stagetrace calls, raising the real NVMLError subclasses."""

    NVMLError = pynvml.NVMLError
    NVML_GPU_UTILIZATION_SAMPLES = pynvml.NVML_GPU_UTILIZATION_SAMPLES
    NVML_ERROR_NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE

    def __init__(
        self,
        utilization: float = 0.12,
        period_ms: float = 20.0,
        samples_supported: bool = True,
        init_error: int | None = None,
        mig: bool = False,
        clock: str = "epoch",
        idle: bool = False,
    ) -> None:
        self.utilization = utilization
        self.idle = idle  # like the real driver: no samples are buffered while the GPU is idle
        self.period_us = int(period_ms * 1000)
        self.samples_supported = samples_supported
        self.init_error = init_error
        self.mig = mig
        self.clock = clock
        self.calls: list[str] = []
        self.threads: set[int] = set()
        self._start_us = self._now_us()

    def _now_us(self) -> int:
        if self.clock == "monotonic":
            return time.monotonic_ns() // 1000
        return time.time_ns() // 1000

    def _called(self, name: str) -> None:
        self.calls.append(name)
        self.threads.add(threading.get_ident())

    def nvmlInit(self) -> None:
        self._called("nvmlInit")
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self._called("nvmlDeviceGetHandleByUUID")
        if not uuid.startswith("GPU-"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return uuid

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self._called("nvmlDeviceGetHandleByIndex")
        return f"GPU-{index}"

    def nvmlDeviceGetMigMode(self, handle: str) -> tuple[int, int]:
        self._called("nvmlDeviceGetMigMode")
        return (1, 1) if self.mig else (0, 0)

    def nvmlDeviceGetSamples(self, handle: str, sampling_type: int, last_seen: int) -> tuple[int, list[Any]]:
        self._called("nvmlDeviceGetSamples")
        if not self.samples_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if self.idle:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        now = self._now_us()
        ts = max(last_seen, self._start_us) + self.period_us
        out = []
        while ts <= now:
            out.append(SimpleNamespace(timeStamp=ts, sampleValue=SimpleNamespace(uiVal=int(self.utilization * 100))))
            ts += self.period_us
        if not out:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return 1, out

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        self._called("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=int(self.utilization * 100), memory=10)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        self._called("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=141 << 30, used=120 << 30, free=21 << 30)


class FakeTorch:
    """The ``torch`` surface ``TorchCudaBackend`` uses, over a FakeGpu, that notes every call that would
    initialise CUDA or its driver before the application did (``torch.cuda.is_available`` runs cuInit,
    ``current_device`` torch's lazy init, ``Tensor.is_pinned`` can create a context). A CUDA copy
    initialises it, as in torch."""

    def __init__(self, gpu: FakeGpu | None = None) -> None:
        self.gpu = gpu or FakeGpu()
        self.initialized = False
        self.violations: list[str] = []
        self.cuda = _FakeTorchCuda(self)

    def device(self, dev: Any, index: int | None = None) -> FakeDevice:
        if index is not None:
            return FakeDevice(type=dev, index=index)
        parsed = parse_device(dev)
        return FakeDevice(type=parsed.type, index=None) if str(dev) == "cuda" else parsed

    def guard(self, name: str) -> None:
        if not self.initialized:
            self.violations.append(name)

    def tensor(self, nbytes: int, pinned: bool = False) -> FakeTorchTensor:
        return FakeTorchTensor(self, nbytes, pinned)


class _FakeTorchCuda:
    def __init__(self, torch: FakeTorch) -> None:
        self._torch = torch
        gpu = torch.gpu

        class Graph(FakeCUDAGraph):
            def __init__(self) -> None:
                super().__init__(gpu)

        self.CUDAGraph = Graph

    def is_initialized(self) -> bool:
        return self._torch.initialized

    def is_available(self) -> bool:
        self._torch.guard("is_available")
        return True

    def current_device(self) -> int:
        self._torch.guard("current_device")
        return 0

    def get_device_properties(self, index: int) -> Any:
        self._torch.guard("get_device_properties")
        return SimpleNamespace(uuid=f"fake-{index}")

    def current_stream(self, device: int | None = None) -> FakeStream:
        self._torch.guard("current_stream")
        return self._torch.gpu.default_stream

    def Stream(self, device: int | None = None) -> FakeStream:
        self._torch.guard("Stream")
        return FakeStream(self._torch.gpu)

    def ExternalStream(self, handle: int, device: Any = None) -> FakeStream:
        self._torch.guard("ExternalStream")
        return FakeStream(self._torch.gpu)

    def Event(self, enable_timing: bool = False) -> FakeEvent:
        self._torch.guard("Event")
        return FakeEvent(
            self._torch.gpu, enable_timing=enable_timing, device=getattr(self._torch.gpu.current, "device", 0)
        )

    def device(self, index: int) -> Any:
        self._torch.guard("device")
        return self._torch.gpu.device(index)

    def is_current_stream_capturing(self) -> bool:
        gpu = self._torch.gpu
        return gpu.capturing and threading.get_ident() == gpu.capturing_thread


class FakeTorchTensor:
    def __init__(self, torch: FakeTorch, nbytes: int, pinned: bool) -> None:
        self.torch = torch
        self.nbytes = nbytes
        self.pinned = pinned

    def numel(self) -> int:
        return self.nbytes // 4

    def element_size(self) -> int:
        return 4

    def is_pinned(self) -> bool:
        self.torch.guard("Tensor.is_pinned")
        return self.pinned

    def to(self, device: Any, non_blocking: bool = False) -> FakeTorchTensor:
        if parse_device(device).type == "cuda":
            self.torch.initialized = True  # the application's first CUDA call initialises it
            self.torch.gpu.default_stream.enqueue(0.05)
        return FakeTorchTensor(self.torch, self.nbytes, False)
