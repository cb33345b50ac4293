"""CPU-side signals: per-stage on-CPU / run-queue / blocked time, GIL pressure and event-loop lag.

Per stage (sync stages only: an async stage shares its thread with other tasks), the hot path takes two raw
reads of ``/proc/thread-self/schedstat`` (on-CPU ns, run-queue wait ns) and nothing else; the exporter
parses them (``exporter.signals.resolve_cpu``). ``blocked = wall - on-CPU - run-queue``: time the thread
was off-CPU and not waiting for a CPU, i.e. waiting for the GIL, a lock, I/O or a sleep. Elsewhere than
Linux, thread CPU time only.

GIL pressure: a sampler thread sleeps ``period`` and records how late it woke up, minus its own run-queue
time over the sleep (the OS's share of the delay on a busy or oversubscribed host), leaving the wait for
the GIL. A CPU-bound Python thread holding the GIL makes it wait up to the switch interval (5 ms); with
the GIL free the remainder is ~0.1 ms. Event-loop lag: a task on each instrumented loop does the same
with ``asyncio.sleep``. Both only append (time, lag) pairs to a bounded buffer; the helper thread ships
them and the exporter joins them to each trace's window.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import sys
import threading
import time
from collections import deque
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
    GIL held); the exporter parses them."""

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
        pread: Any = self._pread  # set whenever schedstat is read (see __init__)
        n = pread(holder.fd, holder.buf, 64, 0)
        return holder.buf.raw[:n] if n > 0 else None


class SampleBuffer:
    """(epoch ns, value) pairs waiting to be shipped; bounded, the oldest dropped first when nobody drains."""

    def __init__(self, max_samples: int = 8192) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=max_samples)

    def add(self, value: float) -> None:
        self._samples.append((time.time_ns(), value))

    def drain(self) -> list[tuple[int, float]]:
        out, pop = [], self._samples.popleft
        try:
            while True:
                out.append(pop())
        except IndexError:
            return out


class GilPressureSampler:
    """Always-on, one thread: about ``1/period`` wake-ups per second, each a few microseconds."""

    def __init__(self, period_s: float = 0.010, max_samples: int = 8192) -> None:
        self.period_s = period_s
        self.series = SampleBuffer(max_samples)
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

    def stop(self) -> None:
        self._stop.set()


class LoopLagMonitor:
    """One monitor task per event loop, started by the web integrations on the loop's first request."""

    def __init__(self, interval_s: float = 0.050, max_samples: int = 8192) -> None:
        self.interval_s = interval_s
        self.series = SampleBuffer(max_samples)
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
