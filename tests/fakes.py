"""Fakes that mirror the real APIs' signatures, errors and GIL behaviour, for testing the CUDA and NVML paths
on CPU (and for the GPU session's ``--dry-run``).

FakeGpu simulates an asynchronous device driven by real time: work enqueued on a stream runs after the
work before it; an event completes when the simulated stream reaches it; a blocking copy really waits.
FakeEvent raises what torch.cuda.Event raises (torch 2.13, c10/cuda/CUDAEvent.h) and, like torch's binding
(torch/csrc/cuda/Event.cpp), releases the GIL in ``record`` and ``synchronize`` and holds it in ``query``.
A global-mode graph capture is invalidated by an unsafe call (an event query or a synchronisation) from
another thread that is not in thread-local or relaxed capture mode, as CUDA does; ``capture_end`` then
raises. FakeNvml raises the real pynvml.NVMLError subclasses from nvidia-ml-py and keeps a device table with
UUIDs in NVML's forms. FakeProfiler returns torch.profiler's ``FunctionEvent`` fields for the runtime calls
and device activity of a FakeGpu, with the thread ids kineto gives them (see its docstring).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import itertools
import os
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, NamedTuple

import pynvml

from stagetrace.gpu.backend import CAPTURE_MODE_GLOBAL, CAPTURE_MODE_THREAD_LOCAL, nvml_uuid

_handles = itertools.count(0x7F00_0000_1000, 0x40)  # cudaEvent_t / cudaStream_t stand-ins


_libc = ctypes.CDLL(None)  # ctypes.CDLL releases the GIL around every call


def release_gil(c_us: int = 0) -> None:
    """A C call made with the GIL released, as torch's binding makes ``cudaEventRecord`` under
    ``pybind11::gil_scoped_release``, lasting about ``c_us`` (0: a bare system call). A thread waiting for
    the GIL (a CPU-bound Python thread) takes it if it wakes meanwhile, and then this one waits up to a
    switch interval (5 ms) to get it back."""
    if c_us:
        _libc.usleep(c_us)
    else:
        _libc.getpid()


def wait_until(gpu: FakeGpu, t: int) -> None:
    """A host thread blocked in a CUDA call until the device reaches ``t``: the GIL released all along,
    and back within microseconds of it (a sleep alone overshoots by the timer's slack, 50 us or more)."""
    while (remaining := t - gpu.now()) > 300_000:
        time.sleep((remaining - 250_000) / 1e9)
    while gpu.now() < t:
        os.sched_yield()  # releases the GIL


def fake_uuid(index: int) -> str:
    """The UUID of fake device ``index`` as torch prints it: CUDA's 16 bytes as bare 8-4-4-4-12 hex."""
    return f"{0x4B7C2D10 + index:08x}-9e3f-5a1c-8d2b-{0x6E5F4A3B2C10 + index:012x}"


class FakeGpu:
    """``virtual_clock=True``: the device's time stands still until a host waits for its work
    (``FakeStream.wait_host`` moves it to the stream's tail), so kernels' timings are exactly what was
    launched, whatever the host's load. The default follows real time, as a device does.
    ``record_c_us``: how long ``Event.record`` stays in C with the GIL released (0: a bare system call). A
    longer one (the driver's lock taken by another thread's launches) lets a waiting thread take the GIL."""

    def __init__(self, *, virtual_clock: bool = False, record_c_us: int = 0) -> None:
        self.base = time.perf_counter_ns()
        self.virtual_clock = virtual_clock
        self.record_c_us = record_c_us
        self.virtual_now = 0
        self.sync_calls = 0
        self.elapsed_on_incomplete = 0
        self.queries_during_capture = 0
        self.capturing = False
        self.capturing_thread: int | None = None
        self.capture_invalidated = False
        self.events_created = 0
        self.default_stream = FakeStream(self)
        self.current = threading.local()  # the calling thread's current device (torch.cuda.device)
        self.queries_off_device = 0  # queries made while another device was current (would open a context)
        self.thread_local_capture_threads: set[int] = set()  # idents that left global mode (for assertions)
        self._capture_mode = threading.local()  # the calling thread's cudaStreamCaptureMode, dying with it
        self.sync_debug = "default"  # torch.cuda.set_sync_debug_mode: process-wide, "error" raises on any thread
        self.profiler: FakeProfiler | None = None

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

    def capture_mode(self) -> int:
        """The calling thread's stream-capture mode (global until it exchanges it)."""
        return getattr(self._capture_mode, "value", CAPTURE_MODE_GLOBAL)

    def exchange_capture_mode(self, mode: int) -> int:
        """``cudaThreadExchangeStreamCaptureMode`` for the calling thread: returns the previous mode."""
        ident = threading.get_ident()
        previous = self.capture_mode()
        self._capture_mode.value = mode
        if mode == CAPTURE_MODE_GLOBAL:
            self.thread_local_capture_threads.discard(ident)
        else:
            self.thread_local_capture_threads.add(ident)
        return previous

    def unsafe_call(self, name: str, *, linked: bool = False) -> None:
        """A runtime call that CUDA prohibits during another thread's global-mode capture unless the calling
        thread is in thread-local or relaxed mode: it invalidates the capture."""
        if (
            self.capturing
            and threading.get_ident() != self.capturing_thread
            and self.capture_mode() == CAPTURE_MODE_GLOBAL
        ):
            self.capture_invalidated = True
        self.runtime_call(name, linked=linked)

    def runtime_call(self, name: str, *, linked: bool = False) -> None:
        """What CUPTI sees of a CUDA runtime call (recorded while a FakeProfiler runs)."""
        if self.profiler is not None:
            self.profiler.runtime_call(name, linked)

    def check_sync_debug(self) -> None:
        """``set_sync_debug_mode("error")``: a synchronising operation raises, whichever thread makes it."""
        if self.sync_debug == "error":
            raise RuntimeError("called a synchronizing CUDA operation")


class FakeStream:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.tail = 0  # simulated time at which the stream's queued work finishes
        self.cuda_stream = next(_handles)  # the cudaStream_t, as torch.cuda.Stream.cuda_stream

    def enqueue(self, ms: float, name: str = "fake_gemm_kernel") -> None:
        start = max(self.tail, self.gpu.now())
        self.tail = start + int(ms * 1e6)
        if self.gpu.profiler is not None:
            self.gpu.profiler.device_activity(name, start, self.tail, self.cuda_stream)

    def synchronize(self) -> None:  # present so a test would catch a call; stagetrace must never make one
        self.gpu.sync_calls += 1
        self.gpu.check_sync_debug()
        self.gpu.unsafe_call("cudaStreamSynchronize")
        self.wait_host()

    def wait_host(self) -> None:
        if self.gpu.virtual_clock:
            self.gpu.virtual_now = max(self.gpu.virtual_now, self.tail)
            return
        wait_until(self.gpu, self.tail)


class FakeEvent:
    def __init__(self, gpu: FakeGpu, enable_timing: bool = False, device: int = 0) -> None:
        self.gpu = gpu
        self.device = device
        self.enable_timing = enable_timing
        self._t: int | None = None
        self._handle = 0  # torch creates the CUDA event at the first record
        gpu.events_created += 1

    @property
    def cuda_event(self) -> int:
        """The cudaEvent_t, 0 until the first record created it (torch.cuda.Event.cuda_event)."""
        return self._handle

    def record(self, stream: FakeStream | None = None) -> None:
        """Enqueued on the stream, then the GIL is taken back, as torch's binding does."""
        self.record_holding_gil(stream or self.gpu.current_stream())
        release_gil(self.gpu.record_c_us)

    def record_holding_gil(self, stream: FakeStream) -> None:
        """``cudaEventRecord`` called with the GIL held (what ``record_holding_gil`` of a backend does)."""
        if not self._handle:
            self._handle = next(_handles)
        self._t = max(stream.tail, self.gpu.now())
        self.gpu.runtime_call("cudaEventRecord")

    def query(self) -> bool:
        if self.gpu.capturing and threading.get_ident() != self.gpu.capturing_thread:
            self.gpu.queries_during_capture += 1
        if getattr(self.gpu.current, "device", 0) != self.device:
            self.gpu.queries_off_device += 1
        self.gpu.unsafe_call("cudaEventQuery")
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
        self.gpu.unsafe_call("cudaEventSynchronize")
        if self._t is not None:
            if self.gpu.virtual_clock:
                self.gpu.virtual_now = max(self.gpu.virtual_now, self._t)
            wait_until(self.gpu, self._t)
        release_gil()


class FakeCUDAGraph:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu

    def capture_begin(self, *args: Any, **kwargs: Any) -> None:
        self.gpu.capturing = True
        self.gpu.capturing_thread = threading.get_ident()
        self.gpu.capture_invalidated = False

    def capture_end(self) -> None:
        invalidated = self.gpu.capture_invalidated
        self.gpu.capturing = False
        self.gpu.capturing_thread = None
        self.gpu.capture_invalidated = False
        if invalidated:  # what torch raises when cudaStreamEndCapture reports the invalidation
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


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
    """The TorchCudaBackend interface over FakeGpu. ``record_holding_gil`` works here (as it does where the
    CUDA runtime is found), so clock anchors take the GIL-held path; ``gil_held_record=False`` gives the
    fallback through ``Event.record``."""

    def __init__(
        self,
        gpu: FakeGpu | None = None,
        usable: bool = True,
        *,
        device_name: str = "NVIDIA H200",
        gil_held_record: bool = True,
    ) -> None:
        self.gpu = gpu or FakeGpu()
        self._usable = usable
        self.device_name = device_name
        self.gil_held_record = gil_held_record
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

    def event_created(self, event: FakeEvent) -> bool:
        return bool(event.cuda_event)

    def record_holding_gil(self, event: FakeEvent, stream: FakeStream) -> bool:
        if not (self.gil_held_record and event.cuda_event):
            return False
        event.record_holding_gil(stream)
        return True

    def is_pinned(self, tensor: Any) -> bool | None:
        return bool(tensor.is_pinned()) if self._usable else None

    def use_thread_local_capture_mode(self) -> bool:
        self.gpu.exchange_capture_mode(CAPTURE_MODE_THREAD_LOCAL)
        return True

    def is_capturing(self) -> bool:
        return self.gpu.capturing and threading.get_ident() == self.gpu.capturing_thread

    def graph_class(self) -> Any:
        return self.Graph

    def device_uuid(self, device_index: int) -> str:
        return nvml_uuid(fake_uuid(device_index), device_name=self.device_name)

    def default_device(self) -> int:
        return 0


class FakeTensor:
    """The torch.Tensor surface stagetrace and the fake model use. A copy is an op (``aten::to``): the
    runtime calls it makes are linked to it in a FakeProfiler's records."""

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
        gpu = self.gpu
        stream = gpu.current_stream()
        gbps = 20.0 if self.pinned or self.device.type == "cuda" else 6.0
        ms = self.nbytes / (gbps * 1e9) * 1e3
        if target.type == "cuda" and self.device.type == "cpu":
            blocking = not (non_blocking and self.pinned)  # pageable or blocking: the driver's staging copy
            if blocking:
                gpu.check_sync_debug()
            gpu.runtime_call("cudaMemcpyAsync", linked=True)
            source = "Pinned" if self.pinned else "Pageable"
            stream.enqueue(ms, f"Memcpy HtoD ({source} -> Device)")
            if blocking:
                gpu.unsafe_call("cudaStreamSynchronize", linked=True)
                stream.wait_host()
        elif target.type == "cpu" and self.device.type == "cuda":
            if not non_blocking:
                gpu.check_sync_debug()
            gpu.runtime_call("cudaMemcpyAsync", linked=True)
            stream.enqueue(ms, "Memcpy DtoH (Device -> Pageable)")
            if not non_blocking:
                gpu.unsafe_call("cudaStreamSynchronize", linked=True)
                stream.wait_host()  # a blocking D2H waits for everything queued before it
        return FakeTensor(
            gpu,
            self.nbytes,
            f"{target.type}:{target.index}" if target.index is not None else target.type,
            pinned=False,
        )


def fake_model(x: FakeTensor, ms: float = 40.0) -> FakeTensor:
    """Launches ``ms`` of kernels on the current stream and returns at once, like a real forward pass."""
    x.gpu.runtime_call("cudaLaunchKernel", linked=True)
    x.gpu.current_stream().enqueue(ms)
    return FakeTensor(x.gpu, 4096, "cuda:0")


class FakeNvmlDevice(NamedTuple):
    """One device in FakeNvml's table, its UUID in NVML's form (``GPU-<hex>`` or ``MIG-<hex>``)."""

    uuid: str
    name: str = "NVIDIA H200"
    pci: tuple[int, int, int] = (0, 0x19, 0)  # domain, bus, device
    mig_instance: bool = False


class FakeNvml:
    """The pynvml (nvidia-ml-py) functions stagetrace calls, raising the real NVMLError subclasses.
    ``devices``: NVML's enumeration (default: fake device 0 as a whole GPU). Utilisation follows
    ``set_utilization`` over time: each buffered sample carries the value set when it was taken."""

    NVMLError = pynvml.NVMLError
    NVML_GPU_UTILIZATION_SAMPLES = pynvml.NVML_GPU_UTILIZATION_SAMPLES
    NVML_ERROR_NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
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
        devices: list[FakeNvmlDevice] | None = None,
    ) -> None:
        self.idle = idle  # like the real driver: no samples are buffered while the GPU is idle
        self.period_us = int(period_ms * 1000)
        self.samples_supported = samples_supported
        self.init_error = init_error
        self.mig = mig  # MIG mode enabled on the GPU (nvmlDeviceGetMigMode)
        self.clock = clock
        self.devices = devices if devices is not None else [FakeNvmlDevice("GPU-" + fake_uuid(0))]
        self.calls: list[str] = []
        self.threads: set[int] = set()
        self._start_us = self._now_us()
        self._timeline: list[tuple[int, float]] = [(0, utilization)]  # (from µs, value)

    @property
    def utilization(self) -> float:
        return self._timeline[-1][1]

    @utilization.setter
    def utilization(self, value: float) -> None:
        self.set_utilization(value)

    def set_utilization(self, value: float) -> None:
        self._timeline.append((self._now_us(), value))

    def _value_at(self, ts_us: int) -> float:
        value = self._timeline[0][1]
        for since, v in self._timeline:
            if since > ts_us:
                break
            value = v
        return value

    def _now_us(self) -> int:
        if self.clock == "monotonic":
            return time.monotonic_ns() // 1000
        return time.time_ns() // 1000

    def _called(self, name: str) -> None:
        self.calls.append(name)
        self.threads.add(threading.get_ident())

    def _device(self, handle: Any) -> FakeNvmlDevice:
        for dev in self.devices:
            if dev.uuid == handle:
                return dev
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlInit(self) -> None:
        self._called("nvmlInit")
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlDeviceGetCount(self) -> int:
        self._called("nvmlDeviceGetCount")
        return sum(1 for d in self.devices if not d.mig_instance)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        """NVML answers NOT_FOUND for a well-formed UUID it does not know (a MIG instance's ``MIG-`` UUID
        given as ``GPU-``), INVALID_ARGUMENT for one it cannot parse."""
        self._called("nvmlDeviceGetHandleByUUID")
        if not uuid.startswith(("GPU-", "MIG-")):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for dev in self.devices:
            if dev.uuid == uuid:
                return dev.uuid
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self._called("nvmlDeviceGetHandleByIndex")
        gpus = [d for d in self.devices if not d.mig_instance]
        if not 0 <= index < len(gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpus[index].uuid

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        self._called("nvmlDeviceGetUUID")
        return self._device(handle).uuid

    def nvmlDeviceGetName(self, handle: str) -> str:
        self._called("nvmlDeviceGetName")
        return self._device(handle).name

    def nvmlDeviceGetPciInfo(self, handle: str) -> Any:
        """nvmlPciInfo_t: ``busId`` is a ctypes char array, bytes in Python."""
        self._called("nvmlDeviceGetPciInfo")
        domain, bus, device = self._device(handle).pci
        return SimpleNamespace(
            domain=domain, bus=bus, device=device, busId=f"{domain:08X}:{bus:02X}:{device:02X}.0".encode()
        )

    def nvmlDeviceIsMigDeviceHandle(self, handle: str) -> int:
        self._called("nvmlDeviceIsMigDeviceHandle")
        return int(self._device(handle).mig_instance)

    def nvmlDeviceGetMigMode(self, handle: str) -> list[int]:
        self._called("nvmlDeviceGetMigMode")
        return [1, 1] if self.mig else [0, 0]

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
            value = round(self._value_at(ts) * 100)
            out.append(SimpleNamespace(timeStamp=ts, sampleValue=SimpleNamespace(uiVal=value)))
            ts += self.period_us
        if not out:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return 1, out

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        self._called("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=round(self.utilization * 100), memory=10)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        self._called("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=141 << 30, used=120 << 30, free=21 << 30)


class FakeDeviceType(enum.Enum):
    """torch.autograd.DeviceType's members that a profile holds here (``str()`` ends with the name)."""

    CPU = 0
    CUDA = 1


class FakeInterval(NamedTuple):
    """torch.autograd.profiler_util.Interval: µs since the profile began."""

    start: float
    end: float

    def elapsed_us(self) -> float:
        return self.end - self.start


class FakeFunctionEvent(NamedTuple):
    """The fields of torch.autograd.profiler_util.FunctionEvent that a check reads."""

    name: str
    thread: int
    device_resource_id: int
    device_type: FakeDeviceType
    time_range: FakeInterval


class FakeProfiler:
    """torch.profiler.profile over a FakeGpu: ``with FakeProfiler(gpu) as prof:`` then ``prof.events()``.

    Thread ids as kineto gives them (pytorch/kineto CuptiActivityProfiler::handleRuntimeActivity and
    torch/csrc/profiler/collection.cpp TransferEvents::setKinetoTID): ``thread`` is the profiler's own
    thread counter (``RecordFunction::currentThreadId()``, from 1), of the op a runtime call was made in, or
    of the thread that collected the profile for a call made outside any op (``Event.query``,
    ``Event.record``: no op); ``device_resource_id`` of a runtime call is CUPTI's thread, the system thread
    id for a thread that recorded an op under the profiler and the low 32 bits of ``pthread_self()``
    (``threading.get_ident()``) for any other; of device activity, its stream."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self._lock = threading.Lock()
        self._rf_ids: dict[int, int] = {}  # thread ident -> profiler thread id (threads that recorded an op)
        self._native: dict[int, int] = {}
        self._calls: list[tuple[str, int, bool, int]] = []  # name, ident, linked, device time
        self._activity: list[tuple[str, int, int, int]] = []  # name, start, end, stream
        self._markers: list[tuple[str, int, int, int]] = []  # name, ident, start, end
        self._collector: int | None = None
        self._start = 0

    def __enter__(self) -> FakeProfiler:
        self._start = self.gpu.now()
        self.gpu.profiler = self
        return self

    def __exit__(self, *exc: Any) -> None:
        self.gpu.profiler = None
        self._collector = self._register(threading.get_ident())

    def _register(self, ident: int) -> int:
        """The calling thread (``ident``) recorded an op: it gets a profiler thread id, and CUPTI's records
        of it carry its system thread id."""
        with self._lock:
            if ident not in self._rf_ids:
                self._rf_ids[ident] = len(self._rf_ids) + 1
                self._native[ident] = threading.get_native_id()
            return self._rf_ids[ident]

    def runtime_call(self, name: str, linked: bool) -> None:
        ident = threading.get_ident()
        if linked:
            self._register(ident)
        with self._lock:
            self._calls.append((name, ident, linked, self.gpu.now()))

    def device_activity(self, name: str, start: int, end: int, stream: int) -> None:
        with self._lock:
            self._activity.append((name, start, end, stream))

    @contextlib.contextmanager
    def record_function(self, name: str) -> Iterator[None]:
        """torch.profiler.record_function: an op on the calling thread, from enter to exit."""
        ident = threading.get_ident()
        self._register(ident)
        start = self.gpu.now()
        try:
            yield
        finally:
            with self._lock:
                self._markers.append((name, ident, start, self.gpu.now()))

    def _us(self, t: int) -> float:
        return (t - self._start) / 1000

    def events(self) -> list[FakeFunctionEvent]:
        collector = self._collector or 0
        out = []
        for name, ident, start, end in self._markers:
            out.append(
                FakeFunctionEvent(
                    name,
                    self._rf_ids[ident],
                    self._native[ident],
                    FakeDeviceType.CPU,
                    FakeInterval(self._us(start), self._us(end)),
                )
            )
        for name, ident, linked, t in self._calls:
            thread = self._rf_ids[ident] if linked else collector
            resource = self._native.get(ident, _int32(ident))
            out.append(
                FakeFunctionEvent(name, thread, resource, FakeDeviceType.CPU, FakeInterval(self._us(t), self._us(t)))
            )
        for name, start, end, stream in self._activity:
            out.append(
                FakeFunctionEvent(name, 0, stream, FakeDeviceType.CUDA, FakeInterval(self._us(start), self._us(end)))
            )
        return out


def _int32(value: int) -> int:
    low = value & 0xFFFFFFFF
    return low - (1 << 32) if low >= 1 << 31 else low


class FakeTorch:
    """The ``torch`` surface ``TorchCudaBackend`` uses, over a FakeGpu, that notes every call that would
    initialise CUDA or its driver before the application did (``torch.cuda.is_available`` runs cuInit,
    ``current_device`` torch's lazy init, ``Tensor.is_pinned`` can create a context). A CUDA copy
    initialises it, as in torch."""

    def __init__(self, gpu: FakeGpu | None = None, *, device_name: str = "NVIDIA H200") -> None:
        self.gpu = gpu or FakeGpu()
        self.device_name = device_name
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
        """``uuid`` is a ``_CUuuid`` whose ``str()`` is bare 8-4-4-4-12 hex (torch/csrc/cuda/Module.cpp)."""
        self._torch.guard("get_device_properties")
        return SimpleNamespace(uuid=_FakeCUuuid(fake_uuid(index)), name=self._torch.device_name)

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


class _FakeCUuuid:
    def __init__(self, text: str) -> None:
        self._text = text

    def __str__(self) -> str:
        return self._text


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
