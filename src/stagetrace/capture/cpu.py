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
_TASKS = "/proc/self/task"
_perf_ns = time.perf_counter_ns


def _has_schedstat() -> bool:
    return sys.platform.startswith("linux") and os.path.exists(_SCHEDSTAT)


class _ThreadFd:
    """The calling thread's schedstat fd and read buffer; the fd closes when the holder goes (a stage's: with
    the thread's locals), or at ``close()``."""

    __slots__ = ("buf", "fd")

    def __init__(self) -> None:
        self.fd = os.open(_SCHEDSTAT, os.O_RDONLY)
        self.buf = ctypes.create_string_buffer(64)

    def close(self) -> None:
        fd, self.fd = self.fd, -1  # (never closed twice: the number may be another file's by then)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        self.close()


def _gil_holding_pread() -> Any:
    """libc's pread through ctypes.PyDLL, which keeps the GIL during the call. ``os.pread`` releases it
    around the syscall, so every stage boundary would offer the GIL to any waiting thread: a handoff per
    boundary under load (measured: ~6 us a stage in benchmarks/overhead.py, against ~2.5 us this way).

    No ``argtypes``: each call would convert its four arguments through their types' ``from_param``, 8.5 k
    instructions a call where this takes 5.1 k (icount), 7.7 k fewer a stage long enough to read schedstat
    (``benchmarks/overhead.py``'s counted "stages of 0.6 ms"). Callers pass the fd as a Python int (a C int)
    and the size and offset as the typed constants ``LINE_SIZE`` and ``FROM_START``; the result, at most 64
    here, fits the default C int return."""
    try:
        return ctypes.PyDLL(None)["pread"]
    except (OSError, AttributeError):
        return None


LINE_SIZE = ctypes.c_size_t(64)  # a schedstat line is three decimal counts: 64 bytes hold it
# off_t as a C long: so it is on 64-bit Linux (glibc and musl) and for 32-bit glibc's ``pread``; 32-bit musl's
# off_t is 64 bits, where a read at a wrong offset returns nothing and the readings are left out, as before.
FROM_START = ctypes.c_long(0)


class CpuSignals:
    """Per-stage CPU accounting: ``read()`` on the request thread at entry and exit (one syscall each, the
    GIL held); the exporter parses them."""

    def __init__(self) -> None:
        self.schedstat = _has_schedstat()
        self._local = threading.local()
        self._pread = _gil_holding_pread() if self.schedstat else None
        if self._pread is None:
            self.read = time.thread_time_ns  # type: ignore[method-assign]  # no run-queue split here

    def read(self) -> Any:
        try:
            holder = self._local.holder
        except AttributeError:
            holder = self._local.holder = _ThreadFd()
        pread: Any = self._pread  # set whenever schedstat is read (see __init__)
        n = pread(holder.fd, holder.buf, LINE_SIZE, FROM_START)
        return holder.buf.raw[:n] if n > 0 else None


class OwnRunQueue(_ThreadFd):
    """The calling thread's run-queue wait and times scheduled in, read at each of the GIL monitor's wake-ups:
    one GIL-holding ``pread`` on a file opened on that thread, parsed at once (the monitor needs the numbers,
    a stage only the raw line). Each wake-up at saturation runs with cold caches, so the fewer objects and
    calls it touches the less it costs (``benchmarks/monitor_cost.py``)."""

    __slots__ = ("_pread",)

    def __init__(self, pread: Any) -> None:
        super().__init__()
        self._pread = pread

    @classmethod
    def open(cls) -> OwnRunQueue | None:
        """On the thread to be read; None where the kernel has no schedstat or libc no ``pread``."""
        pread = _gil_holding_pread() if _has_schedstat() else None
        if pread is None:
            return None
        try:
            return cls(pread)
        except OSError:
            return None

    def read(self) -> tuple[int, int | None]:
        """(cumulative run-queue wait in ns, times scheduled in; None where the kernel gives two fields)."""
        buf = self.buf
        n = self._pread(self.fd, buf, LINE_SIZE, FROM_START)
        if n <= 0:
            return 0, None
        fields = buf[:n].split()  # type: ignore[attr-defined]  # a c_char array's slice is bytes
        return int(fields[1]), int(fields[2]) if len(fields) > 2 else None


def thread_cpu_clock(tid: int) -> int:
    """The clock id of a thread's CPU time by its TID, for ``time.clock_gettime_ns``: Linux's
    ``MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)``, as glibc and musl build it in ``pthread_getcpuclockid``
    (which takes a pthread, so only reaches Python's own threads). A kernel ABI; ``ProcessSchedTotals`` checks
    it against ``time.pthread_getcpuclockid`` on its own thread before it relies on it."""
    return (~tid << 3) | 6


def _thread_cpu_clocks_hold() -> bool:
    try:
        clock = time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return False
    return clock == thread_cpu_clock(threading.get_native_id())


def _open_thread_count(tries: int = 5) -> tuple[int, bool]:
    """``/proc/self/task`` opened, and whether its link count is the process's threads + 2 (Linux sets it so
    in ``proc_task_getattr``): checked against a listing of the directory, taken between two counts that
    agree, up to ``tries`` times (a thread starting or ending meanwhile spoils a try; where every try is
    spoiled, a later relist whose listing agrees settles it, ``ProcessSchedTotals._relist``)."""
    try:
        fd = os.open(_TASKS, os.O_RDONLY | os.O_DIRECTORY)
    except (OSError, AttributeError):
        return -1, False
    for _ in range(tries):
        try:
            count_before = os.fstat(fd).st_nlink
            if _count_matches_listing(fd, len(os.listdir(_TASKS)), count_before):
                return fd, True
        except OSError:
            break
    return fd, False


def _count_matches_listing(fd: int, listed: int, count_before: int) -> bool:
    """Whether the link count read before a listing and after it both equal the listing's threads + 2, for a
    process with more than one thread (a count that did not follow the threads would still match one)."""
    return listed > 1 and count_before == os.fstat(fd).st_nlink == listed + 2


class ProcessSchedTotals:
    """The process's threads' scheduler counts, summed, for the GIL monitor's wake-ups: two bounds on how much
    of a stage's blocked time waits for the GIL can explain.

    - ``run_queue_ms``: the run-queue wait of every thread but the reader's. On a host short of CPUs a wait
      for the GIL can be a wait for a holder the scheduler preempted (or for the thread the GIL was handed to,
      still in the run queue). Every such stretch is run-queue time of some thread of the process, so the sum
      over a stage's window bounds how much of its blocked time preemption can explain
      (``exporter.signals.others_runqueue_ms``).
    - ``cpu_ms``: the on-CPU time of every thread, the reader's included. Only a thread on a CPU or queued for
      one holds the GIL (short of a C call that blocks without releasing it), so the other threads' on-CPU
      and run-queue time over a stage's window is the most of its blocked time the GIL can explain at all
      (``exporter.signals.others_cpu_ms``): a stage blocked longer than that waited for something else, even
      where the GIL monitor found the GIL busy (held by the stage's own thread, or its wake-ups late for a
      reason that is not the GIL, such as the hypervisor taking the CPU).

    Both only grow: each thread's positive change is added, a new thread's whole past counted once (too much,
    never too little), a thread that has gone drops out. The thread list is re-read when the number of Python
    threads changed (``threading.active_count``: no syscall, and none that lets the GIL go mid-reading) and,
    for threads started outside Python, at every ``relist_every``-th reading where the kernel's count of the
    process's threads differs from the list's (the link count of ``/proc/self/task``, threads + 2: one
    ``fstat``, where listing the directory cost ~100 us at saturation; checked against a listing when made,
    and listed every time where it does not hold). A thread found only at a later reading would leave its
    time out of the windows before then: a worker thread started for a request, its own stage's CPU missing
    from the total the stage's is taken from.

    Each thread costs one ``clock_gettime`` of its CPU clock (``thread_cpu_clock``), and only a thread whose
    clock moved since the last reading a ``pread`` of its schedstat; both counts come from that file, as a
    stage's own do (``CpuSignals.read``), so that the other threads' share, the total less the stage's own, is
    never taken from two clocks that run apart (the clock includes a running thread's current slice, the file
    only up to its last tick). The kernel adds a wait for a CPU to a thread's count as it is scheduled in (or
    taken off a run queue to move to another CPU), so a thread whose clock did not move has at most the wait
    of a move still to add, and it is counted at the first reading after the thread runs again; every
    ``relist_every``-th reading reads every thread, which bounds that delay. So the parked threads of a pool
    cost a system call each and no file read (``benchmarks/monitor_cost.py``). Where the last reading found
    two thirds of the threads or more run (a saturated process: each clock read only to be followed by the
    file's), the next reads every file and no clock, and a thread whose on-CPU count did not grow counts as
    parked for the next choice. Both calls keep the GIL, so no thread that needs it runs while a reading is
    taken. A thread whose clock or on-CPU count went back, or whose file can no longer be read, is a new
    thread with a dead one's TID, or none: it is read afresh (its file reopened) from the next reading."""

    def __init__(self, reader_tid: int, relist_every: int = 10, *, skip_clocks_when_busy: bool = True) -> None:
        self._reader = reader_tid
        self._relist_every = relist_every
        self._calls = 0
        self._python_threads = -1  # threading.active_count() at the last relist
        self._skip_clocks_when_busy = skip_clocks_when_busy
        self._busy = False  # the last reading found a third of the threads or fewer parked: skip the clocks
        self._tasks_fd, self._thread_count_holds = _open_thread_count()
        self._closed = False
        self._fds: dict[int, int] = {}
        self._clocks: dict[int, int] = {}  # thread: its CPU clock's id, for every thread in _fds
        self._last_clock: dict[int, int] = {}  # thread: its CPU clock at its last read
        self._last_cpu: dict[int, int] = {}
        self._last_run_queue: dict[int, int] = {}
        self._run_queue_ns = 0
        self._cpu_ns = 0
        self._buf = ctypes.create_string_buffer(64)
        self._pread = _gil_holding_pread()
        self._clock_ns = time.clock_gettime_ns
        self._lock = threading.Lock()  # read on the sampler's thread and the helper thread
        self.available = self._pread is not None and os.path.isdir(_TASKS) and _thread_cpu_clocks_hold()

    def totals_ms(self) -> tuple[float, float]:
        """(the other threads' run-queue wait, every thread's on-CPU time), cumulative ms; after ``close()``, the
        last totals (a reading then would reopen files nobody closes)."""
        with self._lock:
            if self._closed:
                return self._run_queue_ns / 1e6, self._cpu_ns / 1e6
            return self._read_totals_ms()

    def _read_totals_ms(self) -> tuple[float, float]:
        python_threads = threading.active_count()
        every_thread = self._calls % self._relist_every == 0
        if python_threads != self._python_threads or (every_thread and not self._same_threads()):
            self._python_threads = python_threads
            self._relist()
            every_thread = True
        self._calls += 1
        # (one pass a thread, at every contended wake-up under load: no tuples, no max(), one copy of the line)
        pread: Any = self._pread
        clock_ns, buf, reader, fds = self._clock_ns, self._buf, self._reader, self._fds
        last_clock, last_cpu, last_run_queue = self._last_clock, self._last_cpu, self._last_run_queue
        cpu_ns, run_queue_ns = self._cpu_ns, self._run_queue_ns
        check_clocks = not (every_thread or self._busy)
        parked = 0
        for tid, clock in list(self._clocks.items()):
            if check_clocks:
                try:
                    now = clock_ns(clock)
                except OSError:  # gone
                    self._forget(tid)
                    continue
                before = last_clock.get(tid, -1)
                if now <= before:
                    parked += 1
                    if now < before:  # a new thread with a gone one's TID: the next relist opens its file
                        self._forget(tid, relist=True)
                    continue  # not scheduled in since the last read: its counts are as they were
                last_clock[tid] = now
            n = pread(fds[tid], buf, LINE_SIZE, FROM_START)
            if n <= 0:  # gone (a reused TID is another task: its old file reads nothing)
                self._forget(tid, relist=True)
                continue
            fields = buf[:n].split(None, 2)  # type: ignore[attr-defined]  # a c_char array's slice is bytes
            try:
                cpu, rq = int(fields[0]), int(fields[1])
            except (ValueError, IndexError):
                self._forget(tid)
                continue
            grew = cpu - last_cpu.get(tid, 0)
            if grew > 0:
                cpu_ns += grew
            elif grew < 0:  # counts never fall: another thread with the TID, read afresh after a relist
                self._forget(tid, relist=True)
                continue
            else:  # its count as it was: parked (or on the CPU for less than a tick), for the next choice
                parked += 1
            last_cpu[tid] = cpu
            if tid != reader:
                grew = rq - last_run_queue.get(tid, 0)
                if grew > 0:
                    run_queue_ns += grew
                last_run_queue[tid] = rq
        self._busy = self._skip_clocks_when_busy and parked * 3 <= len(fds)
        self._cpu_ns, self._run_queue_ns = cpu_ns, run_queue_ns
        return run_queue_ns / 1e6, cpu_ns / 1e6

    def _same_threads(self) -> bool:
        """Whether the kernel counts as many threads in the process as the list holds (where that count can be
        trusted; else False, and the directory is listed)."""
        if not self._thread_count_holds:
            return False
        try:
            return os.fstat(self._tasks_fd).st_nlink - 2 == len(self._fds)
        except OSError:
            return False

    def _relist(self) -> None:
        settle = not self._thread_count_holds and self._tasks_fd >= 0
        try:
            count_before = os.fstat(self._tasks_fd).st_nlink if settle else -1
        except OSError:
            settle = False
        try:
            tids = {int(name) for name in os.listdir(_TASKS)}
        except (OSError, ValueError):
            return
        if settle:
            try:
                self._thread_count_holds = _count_matches_listing(self._tasks_fd, len(tids), count_before)
            except OSError:
                pass
        for tid in set(self._fds) - tids:
            self._forget(tid)
        for tid in tids - set(self._fds):
            try:
                self._fds[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                continue
            self._clocks[tid] = thread_cpu_clock(tid)

    def _forget(self, tid: int, *, relist: bool = False) -> None:
        """A thread dropped with its file; ``relist``: gone or replaced by another with its TID, so the thread
        list is read again at the next reading."""
        if relist:
            self._python_threads = -1
        fd = self._fds.pop(tid, None)
        self._clocks.pop(tid, None)
        self._last_clock.pop(tid, None)
        self._last_cpu.pop(tid, None)
        self._last_run_queue.pop(tid, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            self._close_files()

    def abandon(self) -> None:
        """In a forked child: its files, the parent's threads', closed without the lock, which a thread that
        is not in the child may have held at the fork."""
        self._lock = threading.Lock()
        self._close_files()

    def _close_files(self) -> None:
        self._closed = True
        for tid in list(self._fds):
            self._forget(tid)
        fd, self._tasks_fd, self._thread_count_holds = self._tasks_fd, -1, False
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
