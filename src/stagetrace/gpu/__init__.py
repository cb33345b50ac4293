"""GPU support: CUDA-event timing, clock anchors, CUDA-graph safety and NVML utilisation per span.

Attached by ``configure()`` (``gpu=None`` means "if the application uses CUDA"); every part switches itself
off with one warning when torch, CUDA or NVML is missing, and the stages fall back to wall time.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from stagetrace import conventions as c
from stagetrace._safety import report_internal_error, warn_once
from stagetrace.gpu.backend import TorchCudaBackend
from stagetrace.gpu.events import CaptureGuard, CudaEventTimer, EventPool, GpuTiming
from stagetrace.gpu.nvml import NvmlSampler


class GpuSupport:
    def __init__(
        self,
        runtime: Any,
        *,
        backend: Any = None,
        nvml: Any = None,
        nvml_poll_interval_s: float = 0.5,
        nvml_enabled: bool = True,
    ) -> None:
        self.runtime = runtime
        self.backend = backend or TorchCudaBackend()
        self.pool = EventPool(self.backend)
        self.guard = CaptureGuard()
        self.timer = CudaEventTimer(self.backend, self.pool, self.guard)
        self.nvml = nvml
        self.nvml_enabled = nvml_enabled
        self.nvml_poll_interval_s = nvml_poll_interval_s
        self.samplers: dict[int, NvmlSampler] = {}
        self._pending_devices: set[int] = set()
        self._lock = threading.Lock()
        self._guard_installed = False

    @property
    def in_use(self) -> bool:
        """Whether any stage ever recorded CUDA events (then NVML samples that device too): until one does, the
        helper thread has nothing of GPU support's to do for a trace, and skips it."""
        return bool(self.timer.devices_seen)

    # --- hot path (request thread) --------------------------------------------------------------------
    def start(self, rec: Any, device: int | None) -> None:
        """Record the start event on the device's current stream; stays on wall time if CUDA is not in use
        by the application yet, the device is not CUDA, or a graph capture is running on this thread."""
        backend = self.backend
        if device is None or not backend.usable() or backend.is_capturing():
            return
        if device not in self.timer.devices_seen:
            self._first_use(device)
        event = self.pool.acquire(device)
        if event is None:
            self.runtime.metrics.dropped("gpu_events")
            return
        stream = backend.current_stream(device)
        event.record(stream)
        rec.gpu = GpuTiming(device, stream, event, time.perf_counter_ns())

    def finish(self, rec: Any) -> None:
        g = rec.gpu
        if g is None:
            return
        event = self.pool.acquire(g.device)
        if event is None:
            self.runtime.metrics.dropped("gpu_events")
            rec.gpu = None
            return
        event.record(g.stream)
        g.end = event

    def _first_use(self, device: int) -> None:
        with self._lock:
            if device in self.timer.devices_seen:
                return
            self.timer.devices_seen.add(device)
            self._pending_devices.add(device)  # NVML starts on the helper thread, not here
            if not self._guard_installed:
                self._guard_installed = True
                self.guard.install(self.backend.graph_class())

    # --- helper thread -----------------------------------------------------------------------------
    def tick(self) -> None:
        if self._pending_devices:
            with self._lock:
                pending, self._pending_devices = self._pending_devices, set()
            for device in pending:
                self._start_sampler(device)
        self.timer.maybe_calibrate()

    def _start_sampler(self, device: int) -> None:
        if not self.nvml_enabled:
            return
        metrics = self.runtime.metrics
        sampler = NvmlSampler(
            self.backend.device_uuid(device),
            device,
            poll_interval_s=self.nvml_poll_interval_s,
            nvml=self.nvml,
            on_value=metrics.gpu_utilization,
            on_drop=metrics.dropped,
        )
        try:
            if sampler.start():
                self.samplers[device] = sampler
        except Exception:
            report_internal_error("NVML start")

    def ready(self, stages: Any, end_epoch_ns: int | None) -> bool:
        """The stages' CUDA events have completed, and NVML's sample for the trace's end has arrived or
        will not come soon: a trace waits for utilisation at most about two sample periods
        (``NvmlSampler.settled``), never for an idle GPU's silence."""
        for rec in stages:
            if rec.gpu is not None and not self.timer.ready(rec):
                return False
        if end_epoch_ns is not None:
            for sampler in self.samplers.values():
                if not sampler.settled(end_epoch_ns):
                    return False
        return True

    def forget(self, rec: Any) -> None:
        """A stage dropped before its events were read (a bound reached): its events are discarded."""
        g = rec.gpu
        if g is not None:
            rec.gpu = None
            self.timer.forget(g)

    def resolve(self, rec: Any, perf_to_epoch_ns: int) -> dict[str, Any]:
        out = self.timer.resolve(rec, perf_to_epoch_ns) if rec.gpu is not None else {}
        sampler = self._sampler_for(rec)
        if sampler is not None:
            start = out.get("gpu_start_ns", rec.start_ns) + perf_to_epoch_ns
            end = out.get("gpu_end_ns", rec.end_ns) + perf_to_epoch_ns
            stats = sampler.window(start, end)
            if stats is not None:
                out["gpu_utilization"] = round(stats.mean, 4)
                out["gpu_utilization_min"] = stats.min
                out["gpu_utilization_max"] = stats.max
            if sampler.memory_used_bytes is not None:
                out["gpu_memory_used"] = sampler.memory_used_bytes
        return out

    def apply(self, rec: Any, perf_to_epoch_ns: int, not_after_ns: int | None = None) -> None:
        """Resolve the stage's CUDA events and NVML window into numbers on the record. With a clock anchor
        the stage moves to where its GPU work really ran (its host-side duration and the anchor's error bar
        kept as attributes). ``not_after_ns`` (perf ns, the trace's end): a placement that the anchor's
        error pushed past it is moved back to end there, so the stage is never lost from the verdict."""
        gpu = self.resolve(rec, perf_to_epoch_ns)
        if not gpu:
            return
        if "gpu_start_ns" in gpu:
            rec.set_attribute(c.HOST_DURATION_MS, round(rec.wall_ms, 3))
            rec.set_attribute(c.GPU_PLACEMENT_ERROR_US, round(gpu["placement_error_ns"] / 1000, 1))
            start, end = gpu["gpu_start_ns"], gpu["gpu_end_ns"]
            if not_after_ns is not None and rec.start_ns < not_after_ns <= start:
                start, end = max(rec.start_ns, not_after_ns - (end - start)), not_after_ns
                rec.set_attribute(c.GPU_PLACEMENT_CLAMPED, True)
            rec.start_ns, rec.end_ns = start, end
        if "gpu_ms" in gpu:
            rec.gpu_ms = gpu["gpu_ms"]
        if "gpu_utilization" in gpu:
            rec.gpu_utilization = gpu["gpu_utilization"]
            rec.set_attribute(c.GPU_UTILIZATION_MIN, gpu["gpu_utilization_min"])
            rec.set_attribute(c.GPU_UTILIZATION_MAX, gpu["gpu_utilization_max"])
        if "gpu_memory_used" in gpu:
            rec.set_attribute(c.GPU_MEMORY_USED, gpu["gpu_memory_used"])

    def _sampler_for(self, rec: Any) -> NvmlSampler | None:
        if not self.samplers:
            return None
        if rec.gpu is not None and rec.gpu.device in self.samplers:
            return self.samplers[rec.gpu.device]
        return next(iter(self.samplers.values()))

    def trace_utilization(self, start_epoch_ns: int, end_epoch_ns: int) -> float | None:
        windows = [s.window(start_epoch_ns, end_epoch_ns) for s in self.samplers.values() if s.enabled]
        means = [w.mean for w in windows if w is not None]
        return sum(means) / len(means) if means else None

    def shutdown(self) -> None:
        for sampler in self.samplers.values():
            sampler.stop()
        self.guard.uninstall()


def attach_gpu(runtime: Any, *, required: bool = False, **kwargs: Any) -> GpuSupport | None:
    """Give the runtime GPU support; with ``required`` a missing piece is a warning rather than silence."""
    try:
        support = GpuSupport(runtime, **kwargs)
    except Exception:
        report_internal_error("GPU support")
        return None
    if required and not support.backend.usable():
        warn_once(
            "gpu-unavailable",
            "stagetrace: gpu=True but CUDA is not available or not initialised yet; "
            "GPU stages use wall time until the application initialises CUDA",
        )
    previous = runtime.gpu
    if previous is not None:
        previous.shutdown()
    runtime.gpu = support
    runtime.shipper.gpu = support
    return support


__all__ = ["GpuSupport", "attach_gpu"]
