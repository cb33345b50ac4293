"""CPU-side signals: per-stage on-CPU / run-queue / blocked time, GIL pressure and event-loop lag.

Per stage (sync stages only: an async stage shares its thread with other tasks), the hot path takes two raw
reads of ``/proc/thread-self/schedstat`` (on-CPU ns, run-queue wait ns) and nothing else; the finalizer
parses them. ``blocked = wall - on-CPU - run-queue``: time the thread was off-CPU and not waiting for a
CPU, i.e. waiting for the GIL, a lock, I/O or a sleep. Elsewhere than Linux, thread CPU time only.

GIL pressure: a sampler thread sleeps ``period`` and records how late it woke up, minus its own run-queue
time over the sleep (the OS's share of the delay on a busy or oversubscribed host), leaving the wait for
the GIL. A CPU-bound Python thread holding the GIL makes it wait up to the switch interval (5 ms); with
the GIL free the remainder is ~0.1 ms. Event-loop lag: a task on each instrumented loop does the same
with ``asyncio.sleep``.
"""

from __future__ import annotations

import asyncio
import bisect
import ctypes
import os
import statistics
import sys
import threading
import time
from typing import Any

from stagetrace._safety import report_internal_error

_SCHEDSTAT = "/proc/thread-self/schedstat"
_perf_ns = time.perf_counter_ns


class _ThreadFd:
    """The thread's schedstat fd and read buffer; the fd closes when the thread's locals go away."""

    __slots__ = ("buf", "fd")

    def __init__(self) -> None:
        self.fd = os.open(_SCHEDSTAT, os.O_RDONLY)
        self.buf = ctypes.create_string_buffer(64)

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def _gil_holding_pread() -> Any:
    """libc's pread through ctypes.PyDLL, which keeps the GIL during the call. ``os.pread`` releases it
    around the syscall, so every stage boundary would offer the GIL to any waiting thread: a handoff per
    boundary under load (measured: ~6 us a stage in benchmarks/overhead.py, against ~2.5 us this way)."""
    try:
        fn = ctypes.PyDLL(None).pread
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    fn.restype = ctypes.c_ssize_t
    return fn


class CpuSignals:
    """Per-stage CPU accounting: ``read()`` on the request thread at entry and exit (one syscall each, the
    GIL held), ``resolve(rec)`` in the finalizer."""

    def __init__(self) -> None:
        self.schedstat = sys.platform.startswith("linux") and os.path.exists(_SCHEDSTAT)
        self._local = threading.local()
        self._pread = _gil_holding_pread() if self.schedstat else None
        if self._pread is None:
            self.read = time.thread_time_ns  # type: ignore[method-assign]  # no run-queue split here

    def run_queue_ns(self) -> int:
        """This thread's cumulative run-queue wait (schedstat's second field)."""
        raw = self.read()
        return int(raw.split()[1]) if raw else 0

    def read(self) -> Any:
        try:
            holder = self._local.holder
        except AttributeError:
            holder = self._local.holder = _ThreadFd()
        n = self._pread(holder.fd, holder.buf, 64, 0)
        return holder.buf.raw[:n] if n > 0 else None

    @staticmethod
    def resolve(rec: Any) -> None:
        """Turn the two raw readings into cpu_ms / runqueue_ms / blocked_ms on the record."""
        start, end = rec.cpu_start, rec.cpu_end
        if start is None or end is None:
            return
        wall_ms = rec.wall_ms
        if isinstance(start, int) != isinstance(end, int):
            return  # readings of two kinds (the name's history changed in between): no comparable pair
        if isinstance(start, bytes):
            s_cpu, s_rq, _ = start.split()
            e_cpu, e_rq, _ = end.split()
            cpu_ms = (int(e_cpu) - int(s_cpu)) / 1e6
            rq_ms = (int(e_rq) - int(s_rq)) / 1e6
            rec.runqueue_ms = round(max(0.0, rq_ms), 3)
        else:  # thread CPU clock only: run-queue time cannot be told apart and stays inside blocked_ms
            cpu_ms, rq_ms = (end - start) / 1e6, 0.0
        rec.cpu_ms = round(max(0.0, cpu_ms), 3)
        rec.blocked_ms = round(max(0.0, wall_ms - cpu_ms - rq_ms), 3)


class _LagSeries:
    """(epoch ns, lag ms) samples in two parallel lists, bounded by trimming the oldest half when full, so
    a window query is a bisect plus a slice rather than a copy of the whole history."""

    def __init__(self, max_samples: int) -> None:
        self._max = max_samples
        self._times: list[int] = []
        self._lags: list[float] = []
        self._lock = threading.Lock()

    def add(self, lag_ms: float) -> None:
        with self._lock:
            self._times.append(time.time_ns())
            self._lags.append(lag_ms)
            if len(self._times) > self._max:
                half = len(self._times) // 2
                del self._times[:half], self._lags[:half]

    def window(self, start_ns: int, end_ns: int, slack_ns: int) -> list[float]:
        with self._lock:
            lo = bisect.bisect_left(self._times, start_ns - slack_ns)
            hi = bisect.bisect_right(self._times, end_ns + slack_ns)
            return self._lags[lo:hi]


class GilPressureSampler:
    """Always-on, one thread: about ``1/period`` wake-ups per second, each a few microseconds."""

    min_window_s = 0.5

    def __init__(self, period_s: float = 0.010, max_samples: int = 8192) -> None:
        self.period_s = period_s
        self.series = _LagSeries(max_samples)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def ensure_running(self) -> None:
        if self._thread is not None and self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="stagetrace-gil", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        period = self.period_s
        cpu = CpuSignals()
        run_queue = cpu.run_queue_ns if cpu.schedstat and cpu._pread is not None else None
        while not self._stop.is_set():
            rq0 = run_queue() if run_queue else 0
            t0 = _perf_ns()
            time.sleep(period)
            lag_ns = _perf_ns() - t0 - period * 1e9
            if run_queue:
                # The OS's part of the delay (waiting for a CPU after the timer fired) is this thread's
                # run-queue time; what remains is the wait for the GIL.
                lag_ns -= run_queue() - rq0
            self.series.add(max(0.0, lag_ns / 1e6))

    def pressure_ms(self, start_ns: int, end_ns: int) -> float | None:
        """Mean wake-up lag over the trace, or over the last ``min_window_s`` before its end if the trace
        is shorter. A woken sampler either gets the GIL at once or waits out a whole switch interval, so
        single wake-ups say little; GIL pressure is a process-level condition that changes slowly, and a
        mean over ~100 wake-ups is steady."""
        start_ns = min(start_ns, end_ns - int(self.min_window_s * 1e9))
        lags = self.series.window(start_ns, end_ns, int(self.period_s * 2e9))
        return round(statistics.fmean(lags), 3) if lags else None

    def stop(self) -> None:
        self._stop.set()


class LoopLagMonitor:
    """One monitor task per event loop, started by the web integrations on the loop's first request."""

    def __init__(self, interval_s: float = 0.050, max_samples: int = 8192) -> None:
        self.interval_s = interval_s
        self.series = _LagSeries(max_samples)
        self._loops: set[int] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    def ensure_running(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        key = id(loop)
        if key in self._loops:
            return
        self._loops.add(key)
        task = loop.create_task(self._run(), name="stagetrace-loop-lag")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.interval_s
        try:
            while True:
                t0 = loop.time()
                await asyncio.sleep(interval)
                self.series.add(max(0.0, (loop.time() - t0 - interval) * 1e3))
        except asyncio.CancelledError:
            self._loops.discard(id(loop))
            raise
        except Exception:
            report_internal_error("event-loop lag monitor")

    def max_lag_ms(self, start_ns: int, end_ns: int) -> float | None:
        lags = self.series.window(start_ns, end_ns, int(self.interval_s * 2e9))
        return round(max(lags), 3) if lags else None


class CpuSignalSources:
    """The trace-level signals for the finalizer: GIL pressure and event-loop lag over the trace window."""

    def __init__(self, gil: GilPressureSampler | None, loop: LoopLagMonitor | None) -> None:
        self.gil = gil
        self.loop = loop

    def __call__(self, trace: Any, root: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        start, end = root.start_time or 0, root.end_time or 0
        if self.gil is not None:
            value = self.gil.pressure_ms(start, end)
            if value is not None:
                out["gil_pressure_ms"] = value
        if self.loop is not None:
            value = self.loop.max_lag_ms(start, end)
            if value is not None:
                out["loop_lag_ms"] = value
        return out
