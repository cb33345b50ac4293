"""Background monitors of the process's CPU-side signals: GIL pressure (a thread) and event-loop lag (a task
per loop). Both only append (epoch ns, lag ms) pairs to a bounded buffer; the helper thread ships them and
the exporter joins them to each trace's window (``exporter.signals``).

GIL pressure: the sampler thread sleeps ``period`` and records how late it woke up, minus its own run-queue
time over the sleep (the OS's share of the delay on a busy or oversubscribed host, kept as a series of its
own), leaving the wait for the GIL. A CPU-bound Python thread holding the GIL makes it wait up to the switch
interval (5 ms). A wait for the GIL sleeps on the GIL's condition and ends with the thread scheduled in
again, so a wake-up scheduled in only once (the timer's) waited for no GIL whatever its lag, and reads zero:
timer slack and a virtual machine's stolen time (no run-queue time on these kernels) stay out of GIL
pressure. (A stopped and continued process is woken by the signals: that lag still reads as a wait.)
Event-loop lag: a task on each instrumented loop does the same with ``asyncio.sleep``.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from stagetrace._safety import report_internal_error
from stagetrace.capture.cpu import CpuSignals, OwnRunQueue, ProcessSchedTotals
from stagetrace.common.schedstat import loop_held_ms

_perf_ns = time.perf_counter_ns
_sleep = time.sleep  # (module-level, so that a test can run the GIL monitor on a fake clock)
IDLE_CHECK_S = 1.0  # an idle sampler looks again this often even unwoken (a missed wake costs at most this)
# The process's run-queue total is read at every wake-up that follows one which waited (for the GIL or a CPU)
# at least this long, and at least every PROCESS_READ_EVERY wake-ups otherwise: one read per thread, most of a
# wake-up's cost (benchmarks/idle_cost.py), and quiet stretches only widen a bracket by what hardly grew.
CONTENDED_LAG_NS = 500_000
CONTENDED_RUN_QUEUE_NS = 100_000
PROCESS_READ_EVERY = 5
T = TypeVar("T")


class DrainQueue(Generic[T]):
    """Items waiting for the helper thread; bounded, the oldest dropped first when nobody drains. Appends
    and pops of a deque are atomic, so producers on any thread need no lock."""

    def __init__(self, max_items: int = 8192) -> None:
        self._items: deque[T] = deque(maxlen=max_items)
        self.put: Callable[[T], None] = self._items.append  # (the deque's own: no Python frame a put)

    def drain(self) -> list[T]:
        out, pop = [], self._items.popleft
        try:
            while True:
                out.append(pop())
        except IndexError:
            return out


class SampleBuffer(DrainQueue[tuple[int, float]]):
    """(epoch ns, value) pairs waiting to be shipped."""

    def add(self, value: float) -> None:
        self._items.append((time.time_ns(), value))


class GilPressureMonitor:
    """One thread: about ``1/period`` wake-ups per second while a trace is in flight. Beside the GIL wait,
    each wake-up's run-queue wait is kept (``run_queue``): how long a thread made runnable waited for a CPU,
    the host's oversubscription as any thread of the process meets it; and the process's scheduler totals so
    far (cumulative ms, ``capture.cpu.ProcessSchedTotals``): the other threads' run-queue wait
    (``process_run_queue``), which bounds how much of a stage's blocked time preempted GIL holders can
    explain, and every thread's on-CPU time (``process_cpu``), which bounds how much of it the GIL can; with
    them, the traces in flight (``in_flight``): together, how many requests the process's CPU use served. Those
    cost a read per thread, so they are taken at the wake-ups after one that waited (where the bounds matter)
    and every ``PROCESS_READ_EVERY`` otherwise: a quiet wake-up costs a sleep and one read of its own
    schedstat.

    Samples only count inside a trace's window, so with none in flight (``in_flight() == 0``) the thread
    sleeps on ``wake`` until the registry opens a trace (``TraceRegistry.idle_wake``): an idle server pays
    no wake-ups, a busy one one ``Event.is_set`` per request."""

    def __init__(
        self, period_s: float = 0.010, max_samples: int = 8192, in_flight: Callable[[], int] | None = None
    ) -> None:
        self.period_s = period_s
        self.series = SampleBuffer(max_samples)
        self.run_queue = SampleBuffer(max_samples)
        self.process_run_queue = SampleBuffer(max_samples)
        self.process_cpu = SampleBuffer(max_samples)
        self.in_flight = SampleBuffer(max_samples)  # traces in flight at each reading of the totals
        self._process: ProcessSchedTotals | None = None  # made on the sampler's thread (its run-queue left out)
        self._totals_lock = threading.Lock()  # a reading and its samples, in order, from either thread
        self.wake = threading.Event()
        self._in_flight = in_flight
        self._stopping = False  # (a plain attribute: the loop reads it at every wake-up, with no call)
        self._thread: threading.Thread | None = None
        self._pid = 0
        self.idle_waits = 0  # times the thread went to sleep with nothing in flight
        self.process_reads = 0  # readings of the process's totals taken at wake-ups
        self.wakeups = 0  # wake-ups with a trace in flight (each a sample)
        self.last_wake_ns = 0  # epoch ns of the last wake-up, or of going idle (every trace ended by then)
        _MONITORS.add(self)

    def ensure_running(self) -> None:
        if self._thread is not None and self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="stagetrace-gil", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # One function, its names bound once: at saturation each wake-up runs with cold caches, and each call
        # and attribute it touches costs (benchmarks/monitor_cost.py). The reading of the process's totals
        # is due at the first wake-up of a busy stretch, at every wake-up after one that waited (for the GIL
        # or for a CPU) and every PROCESS_READ_EVERY otherwise (``unread``: wake-ups since the last).
        period = self.period_s
        period_ns = period * 1e9
        own = OwnRunQueue.open()
        reading = own.read if own is not None else None
        process = ProcessSchedTotals(threading.get_native_id()) if own is not None else None
        self._process = process if process is not None and process.available else None
        in_flight, wake = self._in_flight, self.wake
        add_gil_wait, add_run_queue = self.series.put, self.run_queue.put
        perf_ns, time_ns, sleep, every = _perf_ns, time.time_ns, _sleep, PROCESS_READ_EVERY
        # Each wake-up's lag runs from the end of the previous one, so that it also counts the GIL waits of
        # the loop's own few lines: under heavy contention each of them can wait a switch interval, and a
        # lag timed from just before the sleep would leave those stretches (tens of ms) in no sample.
        rq0, slices0, t0, unread = 0, None, 0, every
        try:
            while not self._stopping:
                if in_flight is not None and not in_flight():
                    if t0 and self._process is not None:
                        # the first wake-up with nothing in flight: a reading just after the last trace's end, so that
                        # the readings bracket it closely and not across the idle time until the next burst
                        self._note_process_totals(self._process)
                        self.process_reads += 1
                    wake.clear()  # before the check: a trace opened from here on sets it again
                    if not in_flight():
                        self.idle_waits += 1
                        self.last_wake_ns = time_ns()
                        wake.wait(IDLE_CHECK_S)
                    t0, unread = 0, every
                    continue
                if not t0:
                    rq0, slices0 = reading() if reading is not None else (0, None)
                    t0 = perf_ns()
                read_ns = 0
                if unread >= every and self._process is not None:
                    read_start = perf_ns()
                    self._note_process_totals(self._process)
                    read_ns = perf_ns() - read_start
                    self.process_reads += 1
                    unread = 0
                sleep(period)
                t1 = perf_ns()
                now = time_ns()
                lag_ns = t1 - t0 - period_ns
                rq_ns = 0
                if reading is not None:
                    # The OS's part of the delay (waiting for a CPU after the timer fired) is this thread's
                    # run-queue time; what remains is the wait for the GIL, if it slept on the GIL at all: a
                    # wake-up scheduled in only once (the timer's) did not (kernels without the count: it may have).
                    rq1, slices1 = reading()
                    rq_ns = rq1 - rq0
                    lag_ns -= rq_ns
                    add_run_queue((now, rq_ns / 1e6 if rq_ns > 0 else 0.0))
                    gil_ns = 0.0 if slices0 is not None and slices1 is not None and slices1 - slices0 <= 1 else lag_ns
                    rq0, slices0 = rq1, slices1
                else:
                    gil_ns = lag_ns
                t0 = t1
                self.wakeups += 1
                add_gil_wait((now, gil_ns / 1e6 if gil_ns > 0 else 0.0))
                self.last_wake_ns = now
                # Any lateness brings the next reading of the totals forward (a stage's bounds are read between
                # the readings around it: a quiet stretch read only every few wake-ups would widen them); the
                # reading's own time is in this lag, and must not make the next wake-up read again.
                lag_ns -= read_ns
                unread = every if lag_ns >= CONTENDED_LAG_NS or rq_ns >= CONTENDED_RUN_QUEUE_NS else unread + 1
        except Exception:  # the thread ends; the application goes on, its traces judged without it
            report_internal_error("GIL pressure monitor")
        finally:
            self._process = None
            if process is not None:
                process.close()
            if own is not None:
                own.close()

    def covers(self, epoch_ns: int) -> bool:
        """Whether the readings so far reach ``epoch_ns`` (always, with the thread not running): a trace that
        ended then can be judged on them. A sampler held back by the GIL reports its wait only once through."""
        thread = self._thread
        if thread is None or self._pid != os.getpid() or self._stopping or not thread.is_alive():
            return True
        return self.last_wake_ns >= epoch_ns

    def note_process_totals(self) -> None:
        """One more reading of the process's totals, now (the helper thread's, before it ships traces): the
        sampler's own next wake-up may come after the traces have gone, and a stage is judged only between a
        reading before it and one after it."""
        process = self._process
        if process is not None:
            self._note_process_totals(process)

    def _note_process_totals(self, process: ProcessSchedTotals) -> None:
        with self._totals_lock:  # cumulative series: a later sample never carries an earlier reading
            run_queue_ms, cpu_ms = process.totals_ms()
            now = time.time_ns()
            self.process_run_queue.put((now, run_queue_ms))
            self.process_cpu.put((now, cpu_ms))
            if self._in_flight is not None:  # beside the totals: how many requests shared those CPUs
                self.in_flight.put((now, self._in_flight()))

    def stop(self) -> None:
        self._stopping = True
        self.wake.set()

    def _after_fork_in_child(self) -> None:
        """The parent's reader of the totals holds the parent's threads' files: a reading in the child (the
        helper's, before the child's sampler starts and makes its own) would sum the parent's threads. It is
        dropped and its files closed; the lock a thread not in the child may have held is replaced."""
        process, self._process = self._process, None
        self._totals_lock = threading.Lock()
        if process is not None:
            process.abandon()


_MONITORS: weakref.WeakSet[GilPressureMonitor] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for monitor in list(_MONITORS):
        try:
            monitor._after_fork_in_child()
        except Exception:  # the child goes on; its monitor starts afresh on first use
            report_internal_error("GIL pressure monitor after fork")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class LoopLagMonitor:
    """One monitor task per event loop, started by the web integrations on the loop's first request."""

    def __init__(
        self, interval_s: float = 0.050, max_samples: int = 8192, gil_wait_bound_s: float | None = None
    ) -> None:
        self.interval_s = interval_s
        self.series = SampleBuffer(max_samples)
        # Per wake-up, how much of the stall work on the loop's thread explains (``exporter.signals.loop_held_ms``,
        # from two schedstat reads on that thread, 20 a second): none when the thread was starved instead.
        self.held = SampleBuffer(max_samples)
        self._gil_bound_ms = None if gil_wait_bound_s is None else gil_wait_bound_s * 1e3
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
        cpu = CpuSignals()
        read = cpu.read if cpu.schedstat and cpu._pread is not None else None
        try:
            while True:
                t0, before = loop.time(), read() if read else None
                await asyncio.sleep(interval)
                elapsed_ms = (loop.time() - t0) * 1e3
                lag_ms = max(0.0, elapsed_ms - interval * 1e3)
                self.series.add(lag_ms)
                if read is not None:
                    held = loop_held_ms(lag_ms, elapsed_ms, interval * 1e3, before, read(), self._gil_bound_ms)
                    if held is not None:
                        self.held.add(held)
        except asyncio.CancelledError:
            self._loops.discard(id(loop))
            raise
        except Exception:
            report_internal_error("event-loop lag monitor")
