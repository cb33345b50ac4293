"""CUDA-event timing that never synchronises.

Events come from a per-device pool and are recorded on the stage's stream on the request thread. Only the
helper thread reads them, and only after ``query()`` says they completed; ``elapsed_time`` is never called on an
incomplete event. Wall-clock placement comes from calibration anchors: an event recorded on an idle side
stream whose completion the helper thread observes, so ``t(E) = t(anchor) + anchor.elapsed_time(E)``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from stagetrace._safety import report_internal_error


class GpuTiming:
    """What a GPU stage carries to the helper thread: its events, stream and copy metadata."""

    __slots__ = ("device", "end", "host_start_ns", "start", "stream")

    def __init__(self, device: int, stream: Any, start: Any, host_start_ns: int) -> None:
        self.device = device
        self.stream = stream
        self.start = start
        self.end: Any = None
        self.host_start_ns = host_start_ns  # perf_counter_ns when the start event was recorded


class EventPool:
    """Reusable timing events per device; an event returns to the pool only once it has been read, so a
    pending event is never re-recorded. Bounded: past ``max_events`` a stage falls back to wall time."""

    def __init__(self, backend: Any, max_events: int = 8192) -> None:
        self.backend = backend
        self.max_events = max_events
        self._free: dict[int, deque[Any]] = {}
        self._created: dict[int, int] = {}
        self._lock = threading.Lock()

    def acquire(self, device: int) -> Any | None:
        free = self._free.get(device)
        if free:
            try:
                return free.pop()
            except IndexError:
                pass
        with self._lock:
            if self._created.get(device, 0) >= self.max_events:
                return None
            self._created[device] = self._created.get(device, 0) + 1
        return self.backend.new_event(device)

    def release(self, device: int, *events: Any) -> None:
        free = self._free.setdefault(device, deque())
        for ev in events:
            if ev is not None:
                free.append(ev)

    def created(self, device: int) -> int:
        return self._created.get(device, 0)


@dataclass
class Anchor:
    event: Any
    epoch_ns: int  # wall time at which the event completed on the GPU
    host_perf_ns: int  # perf_counter_ns when it was recorded


class CaptureGuard:
    """Counts CUDA-graph captures in progress by wrapping ``CUDAGraph.capture_begin/capture_end``: querying
    an event from another thread during a global-mode capture can invalidate the capture."""

    def __init__(self) -> None:
        self._active = 0
        self._lock = threading.Lock()
        self._patched: tuple[Any, Any, Any] | None = None

    @property
    def capturing(self) -> bool:
        return self._active > 0

    def install(self, graph_cls: Any) -> None:
        if graph_cls is None or self._patched is not None:
            return
        begin, end = graph_cls.capture_begin, graph_cls.capture_end
        guard = self

        def capture_begin(graph: Any, *args: Any, **kwargs: Any) -> Any:
            with guard._lock:
                guard._active += 1
            try:
                return begin(graph, *args, **kwargs)
            except BaseException:
                with guard._lock:
                    guard._active -= 1
                raise

        def capture_end(graph: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return end(graph, *args, **kwargs)
            finally:
                with guard._lock:
                    guard._active = max(0, guard._active - 1)

        graph_cls.capture_begin, graph_cls.capture_end = capture_begin, capture_end
        self._patched = (graph_cls, begin, end)

    def uninstall(self) -> None:
        if self._patched is not None:
            graph_cls, begin, end = self._patched
            graph_cls.capture_begin, graph_cls.capture_end = begin, end
            self._patched = None


class CudaEventTimer:
    """The helper thread's side: ``ready`` and ``resolve`` per stage, plus clock anchors."""

    def __init__(
        self,
        backend: Any,
        pool: EventPool,
        guard: CaptureGuard,
        anchor_interval_s: float = 2.0,
        anchor_spin_s: float = 0.002,
    ) -> None:
        self.backend = backend
        self.pool = pool
        self.guard = guard
        self.anchor_interval_s = anchor_interval_s
        self.anchor_spin_s = anchor_spin_s
        self._anchors: dict[int, deque[Anchor]] = {}
        self._side_streams: dict[int, Any] = {}
        self._last_anchor: dict[int, float] = {}
        self.devices_seen: set[int] = set()

    # --- readiness and resolution (helper thread) ----------------------------------------------------
    def ready(self, rec: Any) -> bool:
        g = rec.gpu
        if g is None or g.end is None:
            return True
        if self.guard.capturing:
            return False
        try:
            return bool(g.end.query() and g.start.query())
        except Exception:
            return True  # a broken event: resolve() reports it and falls back to wall time

    def resolve(self, rec: Any, perf_to_epoch_ns: int) -> dict[str, Any]:
        """GPU time and GPU-side placement (perf-counter ns) of a completed stage; {} if unusable."""
        g = rec.gpu
        if g is None or g.end is None:
            return {}
        out: dict[str, Any] = {}
        try:
            if g.end.query() and g.start.query():
                ms = float(g.start.elapsed_time(g.end))
                out["gpu_ms"] = max(0.0, ms)
                start_epoch = self.place(g.device, g.start, g.host_start_ns)
                if start_epoch is not None:
                    start_perf = start_epoch - perf_to_epoch_ns
                    out["gpu_start_ns"] = start_perf
                    out["gpu_end_ns"] = start_perf + int(out["gpu_ms"] * 1e6)
                self.pool.release(g.device, g.start, g.end)
        except (RuntimeError, ValueError):
            report_internal_error("CUDA event resolution")
        return out

    # --- clock anchors --------------------------------------------------------------------------------
    def place(self, device: int, event: Any, host_perf_ns: int) -> int | None:
        """Epoch ns at which ``event`` completed: the newest anchor recorded before it, plus the elapsed
        GPU time between them. None without an anchor (the span keeps its host timestamps)."""
        for anchor in reversed(self._anchors.get(device, ())):
            if anchor.host_perf_ns <= host_perf_ns:
                try:
                    return anchor.epoch_ns + int(float(anchor.event.elapsed_time(event)) * 1e6)
                except (RuntimeError, ValueError):
                    return None
        return None

    def maybe_calibrate(self) -> None:
        """Every ``anchor_interval_s`` per device seen: record an event on an idle side stream and spin
        briefly on ``query()`` (never synchronize) to learn when it completed on the wall clock."""
        if self.guard.capturing or not self.backend.usable():
            return
        now = time.monotonic()
        for device in list(self.devices_seen):
            if now - self._last_anchor.get(device, 0.0) < self.anchor_interval_s:
                continue
            self._last_anchor[device] = now
            try:
                self._calibrate(device)
            except Exception:
                report_internal_error("CUDA clock calibration")

    def _calibrate(self, device: int) -> None:
        stream = self._side_streams.get(device)
        if stream is None:
            stream = self._side_streams[device] = self.backend.new_side_stream(device)
        event = self.backend.new_event(device)
        host_perf = time.perf_counter_ns()
        before = time.time_ns()
        event.record(stream)
        deadline = time.perf_counter() + self.anchor_spin_s
        while not event.query():
            if time.perf_counter() > deadline:
                return  # the device is too busy to answer fast: keep the previous anchor
        after = time.time_ns()
        anchors = self._anchors.setdefault(device, deque(maxlen=4))
        anchors.append(Anchor(event, (before + after) // 2, host_perf))
