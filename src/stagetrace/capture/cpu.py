"""Per-stage CPU readings on the request thread: on-CPU / run-queue time, read raw.

Per stage (sync stages only: an async stage shares its thread with other tasks), the hot path takes two raw
reads of ``/proc/thread-self/schedstat`` (on-CPU ns, run-queue wait ns) and nothing else; the exporter
parses them (``exporter.signals.resolve_cpu``). ``blocked = wall - on-CPU - run-queue``: time the thread
was off-CPU and not waiting for a CPU, i.e. waiting for the GIL, a lock, I/O or a sleep. Elsewhere than
Linux, thread CPU time only. The background monitors (GIL pressure, loop lag) are in ``capture.monitors``.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from typing import Any

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


class ProcessRunQueue:
    """The run-queue wait of the process's threads, summed, for the GIL monitor's wake-ups.

    On a host short of CPUs a wait for the GIL can be a wait for a holder the scheduler preempted (or for the
    thread the GIL was handed to, still in the run queue). Every such stretch is run-queue time of some thread
    of the process, so the sum over a stage's window bounds how much of its blocked time preemption can
    explain (``exporter.signals.others_runqueue_ms``). The total only grows: each thread's positive change is
    added, a new thread's whole past counted once (too much, never too little), a thread that has gone drops
    out. The thread list is re-read every ``relist_every`` calls; one ``pread`` per thread otherwise.
    """

    def __init__(self, exclude_tid: int, relist_every: int = 10) -> None:
        self._exclude = exclude_tid
        self._relist_every = relist_every
        self._calls = 0
        self._fds: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._total_ns = 0
        self._buf = ctypes.create_string_buffer(64)
        self._pread = _gil_holding_pread()
        self._lock = threading.Lock()  # read on the sampler's thread and the helper thread
        self.available = self._pread is not None and os.path.isdir("/proc/self/task")

    def total_ms(self) -> float:
        with self._lock:
            return self._read_total_ms()

    def _read_total_ms(self) -> float:
        if self._calls % self._relist_every == 0:
            self._relist()
        self._calls += 1
        pread: Any = self._pread
        buf = self._buf
        for tid, fd in list(self._fds.items()):
            n = pread(fd, buf, 64, 0)
            if n <= 0:
                self._forget(tid)
                continue
            try:
                rq = int(buf.raw[:n].split()[1])
            except (IndexError, ValueError):
                self._forget(tid)
                continue
            self._total_ns += max(0, rq - self._last.get(tid, 0))
            self._last[tid] = rq
        return self._total_ns / 1e6

    def _relist(self) -> None:
        try:
            tids = {int(name) for name in os.listdir("/proc/self/task")} - {self._exclude}
        except (OSError, ValueError):
            return
        for tid in set(self._fds) - tids:
            self._forget(tid)
        for tid in tids - set(self._fds):
            try:
                self._fds[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                continue

    def _forget(self, tid: int) -> None:
        fd = self._fds.pop(tid, None)
        self._last.pop(tid, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            for tid in list(self._fds):
                self._forget(tid)
