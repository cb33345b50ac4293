"""Per-stage CPU readings on the request thread: on-CPU / run-queue time, read raw.

Per stage (sync stages only: an async stage shares its thread with other tasks), the hot path takes two raw
reads of ``/proc/thread-self/schedstat`` (on-CPU ns, run-queue wait ns) and nothing else; the exporter
parses them (``exporter.signals.resolve_cpu``). ``blocked = wall - on-CPU - run-queue``: time the thread
was off-CPU and not waiting for a CPU, i.e. waiting for the GIL, a lock, I/O or a sleep. Elsewhere than
Linux, thread CPU time only. The background samplers (GIL pressure, loop lag) are in ``capture.samplers``.
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
