"""CUDA-event timing that never synchronises.

Events come from a per-device pool and are recorded on the stage's stream on the request thread. Only the
helper thread reads them, and only after ``query()`` says they completed; ``elapsed_time`` is never called on an
incomplete event. Wall-clock placement comes from calibration anchors: an event recorded on an idle side
stream whose completion the helper thread observes, so ``t(E) = t(anchor) + anchor.elapsed_time(E)``. The
anchor's record is made with the GIL held where the backend can (``record_holding_gil``), so that a CPU-bound
Python thread cannot put a switch interval inside its window.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
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
    pending event is never re-recorded. An event that cannot be read (a stage dropped at a bound, a trace
    timed out waiting for its events) is discarded: its count is given back, so the pool stays bounded by
    ``max_events`` outstanding events per device and never silently runs dry."""

    def __init__(self, backend: Any, max_events: int = 8192) -> None:
        self.backend = backend
        self.max_events = max_events
        self._free: dict[int, deque[Any]] = {}
        self._outstanding: dict[int, int] = {}  # created and not discarded: in the free list or in use
        self._lock = threading.Lock()

    def acquire(self, device: int) -> Any | None:
        free = self._free.get(device)
        if free:
            try:
                return free.pop()
            except IndexError:
                pass
        with self._lock:
            if self._outstanding.get(device, 0) >= self.max_events:
                return None
            self._outstanding[device] = self._outstanding.get(device, 0) + 1
        try:
            return self.backend.new_event(device)
        except Exception:
            self.discard(device, 1)
            raise

    def release(self, device: int, *events: Any) -> None:
        """Completed events, back for reuse."""
        free = self._free.setdefault(device, deque())
        for ev in events:
            if ev is not None:
                free.append(ev)

    def discard(self, device: int, count: int) -> None:
        """``count`` events that will not come back (dropped with their stage; CUDA frees a pending event
        once the device has completed it)."""
        if count:
            with self._lock:
                self._outstanding[device] = max(0, self._outstanding.get(device, 0) - count)

    def outstanding(self, device: int) -> int:
        return self._outstanding.get(device, 0)

    def free(self, device: int) -> int:
        return len(self._free.get(device, ()))


@dataclass
class Anchor:
    event: Any
    epoch_ns: int  # wall time at which the event completed on the GPU (the middle of the window)
    host_perf_ns: int  # perf_counter_ns when it was recorded
    error_ns: int  # half the window in which it completed: the placement's error bar


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

    @contextlib.contextmanager
    def quiet(self) -> Iterator[bool]:
        """``with guard.quiet() as free:`` the CUDA calls made under it while ``free`` cannot overlap a
        capture's start: ``capture_begin`` takes the same lock before it begins, so the check and the
        calls are one atomic step."""
        with self._lock:
            yield self._active == 0

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
    """The helper thread's side: ``ready`` and ``resolve`` per stage, plus clock anchors.

    Every CUDA call here runs under the event's device (``backend.on_device``) and under the capture
    guard (``guard.quiet``), from a thread in thread-local capture mode where the runtime allows it."""

    def __init__(
        self,
        backend: Any,
        pool: EventPool,
        guard: CaptureGuard,
        anchor_interval_s: float = 2.0,
        anchor_attempts: int = 8,
        anchor_max_window_ns: int = 50_000,
        anchor_budget_ns: int = 2_000_000,
    ) -> None:
        self.backend = backend
        self.pool = pool
        self.guard = guard
        self.anchor_interval_s = anchor_interval_s
        self.anchor_attempts = anchor_attempts
        self.anchor_max_window_ns = anchor_max_window_ns
        self.anchor_budget_ns = anchor_budget_ns  # of the helper thread's time per calibration
        self._anchors: dict[int, deque[Anchor]] = {}
        self._side_streams: dict[int, Any] = {}
        self._last_anchor: dict[int, float] = {}
        self.devices_seen: set[int] = set()
        self.anchors_rejected = 0  # calibrations whose best window was too wide to trust
        self.records_holding_gil = 0  # anchor records made with the GIL held (the others went through torch)
        self.records_through_torch = 0
        self.thread_local_capture: bool | None = None  # None: not tried yet on the helper thread

    def _prepare_thread(self) -> None:
        if self.thread_local_capture is None:
            try:
                self.thread_local_capture = bool(self.backend.use_thread_local_capture_mode())
            except Exception:
                self.thread_local_capture = False

    # --- readiness and resolution (helper thread) ----------------------------------------------------
    def ready(self, rec: Any) -> bool:
        g = rec.gpu
        if g is None or g.end is None:
            return True
        self._prepare_thread()
        with self.guard.quiet() as free:
            if not free:
                return False
            try:
                with self.backend.on_device(g.device):
                    return bool(g.end.query() and g.start.query())
            except Exception:
                return True  # a broken event: resolve() reports it and falls back to wall time

    def resolve(self, rec: Any, perf_to_epoch_ns: int) -> dict[str, Any]:
        """GPU time and GPU-side placement (perf-counter ns) of a completed stage; {} if unusable. Its
        events go back to the pool when read, and are discarded when they cannot be (still pending after the
        wait timed out, a capture running, an error): an event is never left behind."""
        g = rec.gpu
        if g is None:
            return {}
        if g.end is None:
            self.forget(g)
            return {}
        out: dict[str, Any] = {}
        self._prepare_thread()
        read = False
        with self.guard.quiet() as free:
            try:
                if free:
                    with self.backend.on_device(g.device):
                        if g.end.query() and g.start.query():
                            ms = float(g.start.elapsed_time(g.end))
                            out["gpu_ms"] = max(0.0, ms)
                            placed = self.place(g.device, g.start, g.host_start_ns)
                            if placed is not None:
                                start_epoch, error_ns = placed
                                start_perf = start_epoch - perf_to_epoch_ns
                                out["gpu_start_ns"] = start_perf
                                out["gpu_end_ns"] = start_perf + int(out["gpu_ms"] * 1e6)
                                out["placement_error_ns"] = error_ns
                            read = True
            except (RuntimeError, ValueError):
                report_internal_error("CUDA event resolution")
        if read:
            self.pool.release(g.device, g.start, g.end)
        else:
            self.pool.discard(g.device, 2)
        rec.gpu = None
        return out

    def forget(self, g: GpuTiming) -> None:
        """A stage's events that will never be read (its stage was dropped)."""
        self.pool.discard(g.device, 1 if g.end is None else 2)

    # --- clock anchors --------------------------------------------------------------------------------
    def place(self, device: int, event: Any, host_perf_ns: int) -> tuple[int, int] | None:
        """(epoch ns at which ``event`` completed, error bar in ns): the newest anchor recorded before it,
        plus the elapsed GPU time between them. None without an anchor (the span keeps its host times)."""
        for anchor in reversed(self._anchors.get(device, ())):
            if anchor.host_perf_ns <= host_perf_ns:
                try:
                    return anchor.epoch_ns + int(float(anchor.event.elapsed_time(event)) * 1e6), anchor.error_ns
                except (RuntimeError, ValueError):
                    return None
        return None

    def maybe_calibrate(self) -> None:
        """Every ``anchor_interval_s`` per device seen: take a new clock anchor (``_calibrate``)."""
        if self.guard.capturing or not self.backend.usable():
            return
        now = time.monotonic()
        for device in list(self.devices_seen):
            if now - self._last_anchor.get(device, 0.0) < self.anchor_interval_s:
                continue
            self._last_anchor[device] = now
            self._prepare_thread()
            try:
                with self.guard.quiet() as free:
                    if free:
                        with self.backend.on_device(device):
                            self._calibrate(device)
            except Exception:
                report_internal_error("CUDA clock calibration")

    def anchors(self, device: int) -> tuple[Anchor, ...]:
        """The clock anchors kept for ``device``, oldest first."""
        return tuple(self._anchors.get(device, ()))

    def _calibrate(self, device: int) -> None:
        """Record a pooled event on a dedicated idle stream and watch it complete with ``query()`` (never
        synchronize); the tightest of several attempts is kept, and only if its window is under
        ``anchor_max_window_ns``. An attempt that finds the event still pending when the budget is spent
        ends the calibration (the device is too busy to answer fast)."""
        stream = self._side_streams.get(device)
        if stream is None:
            stream = self._side_streams[device] = self.backend.new_side_stream(device)
        best: Anchor | None = None
        budget_end = time.perf_counter_ns() + self.anchor_budget_ns
        for _ in range(self.anchor_attempts):
            event = self.pool.acquire(device)
            if event is None:
                break
            attempt = self._anchor_attempt(event, stream, budget_end)
            if attempt is None:
                self.pool.discard(device, 1)  # still pending: it cannot be reused
                break
            if best is None or attempt.error_ns < best.error_ns:
                if best is not None:
                    self.pool.release(device, best.event)
                best = attempt
            else:
                self.pool.release(device, event)
            if best.error_ns * 2 <= self.anchor_max_window_ns // 4 or time.perf_counter_ns() > budget_end:
                break
        if best is None or best.error_ns * 2 > self.anchor_max_window_ns:
            self.anchors_rejected += 1
            if best is not None:
                self.pool.release(device, best.event)
            return
        anchors = self._anchors.setdefault(device, deque(maxlen=4))
        if len(anchors) == anchors.maxlen:
            self.pool.release(device, anchors[0].event)
        anchors.append(best)

    def _anchor_attempt(self, event: Any, stream: Any, budget_end: int) -> Anchor | None:
        """One observation of ``event`` completing on the idle side stream, or None if it was still pending
        when the budget ran out. The window runs from the last moment the event was seen pending (at first,
        just before its record) to the first moment it was seen complete; nothing in it waits for the GIL.
        ``Event.record`` releases the GIL, and a CPU-bound Python thread beside this one then keeps it for a
        switch interval: the record is made with the GIL held where the backend can. torch creates the CUDA
        event at its first record, so a new event is recorded once through torch first, outside the window."""
        backend = self.backend
        if not backend.event_created(event):
            event.record(stream)
            while not event.query():
                if time.perf_counter_ns() > budget_end:
                    return None
        host_perf = time.perf_counter_ns()
        low = time.time_ns()
        if backend.record_holding_gil(event, stream):
            self.records_holding_gil += 1
        else:
            event.record(stream)
            self.records_through_torch += 1
        while True:
            polled = time.time_ns()
            if event.query():
                break
            low = max(low, polled)  # it was still pending after this instant
            if time.perf_counter_ns() > budget_end:
                return None
        high = time.time_ns()
        return Anchor(event, (low + high) // 2, host_perf, (high - low) // 2)
