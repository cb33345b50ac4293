"""Process signals joined to a trace's window (exporter/signals.py), with controlled samples: the event-loop
lag a request reports is the stall it lived through, not a neighbour's."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagetrace.common import wire
from stagetrace.common.wire import flatten
from stagetrace.exporter import signals as compiled_or_source
from stagetrace.exporter.signals import LagSeries, max_loop_lag_ms

MS = 1_000_000


def series(*samples: tuple[float, float]) -> LagSeries:
    """(wake-up time in ms, lag in ms) pairs."""
    s = LagSeries()
    s.extend_flat(flatten((int(t * MS), lag) for t, lag in samples))
    return s


def test_a_stall_that_ended_before_the_request_began_is_not_its_lag():
    # the loop stalled 149 ms, from 1000 to 1149; a 12 ms request from 1160 to 1172
    s = series((1149, 149.0), (1200, 0.2))
    assert max_loop_lag_ms(s, 1160 * MS, 1172 * MS) == 0.0  # the next sample, at 1200, says 0.2 ms: after it


def test_only_the_part_of_a_stall_inside_the_request_counts():
    # stalled from 1000 to 1149; the request ran 1100-1300: it lived 49 ms of the stall
    s = series((1149, 149.0), (1200, 0.1))
    assert max_loop_lag_ms(s, 1100 * MS, 1300 * MS) == 49.0


def test_a_stall_reported_after_the_request_ended_still_counts_for_it():
    # the request 1000-1050 was held from 1020 to its end; the monitor woke at 1080, after the stall
    s = series((990, 0.1), (1080, 60.0))
    assert max_loop_lag_ms(s, 1000 * MS, 1050 * MS) == 30.0


def test_a_stall_after_the_request_is_not_its_lag_and_no_sample_means_not_measured():
    s = series((1100, 20.0), (1300, 0.5))  # the stall 1080-1100, after the request 1000-1050
    assert max_loop_lag_ms(s, 1000 * MS, 1050 * MS) == 0.0
    assert max_loop_lag_ms(s, 1400 * MS, 1410 * MS) is None


def test_the_worst_stall_in_the_window_is_reported():
    s = series((1010, 5.0), (1100, 40.0), (1150, 1.0), (1300, 2.0))
    assert max_loop_lag_ms(s, 1000 * MS, 1200 * MS) == 40.0


def test_gil_pressure_is_the_mean_within_the_requests_own_window_and_needs_three_wake_ups():
    from stagetrace.exporter.signals import sampler_mean_ms

    # a neighbour's contention (5 ms lags) before the request; the request 1000-1050 saw the GIL free
    s = series(*[(900 + 10 * i, 5.0) for i in range(10)], (1010, 0.1), (1020, 0.2), (1030, 0.1), (1040, 0.2))
    assert sampler_mean_ms(s, 1000 * MS, 1050 * MS, period_s=0.010) == 0.15
    assert sampler_mean_ms(s, 1000 * MS, 1015 * MS, period_s=0.010) is None  # two wake-ups: not measured
    # a sampler held back 30 ms from inside the window reports after it: that wait was the request's too
    held = series((1010, 0.1), (1020, 0.2), (1062, 30.0), (1072, 0.1))
    assert sampler_mean_ms(held, 1000 * MS, 1040 * MS, period_s=0.010) == pytest.approx(10.1)
    # one wake-up held back three periods is a measurement; two quick ones are not
    assert sampler_mean_ms(series((1045, 30.0)), 1000 * MS, 1040 * MS, period_s=0.010) == 30.0
    assert sampler_mean_ms(series((1010, 0.1), (1020, 0.2)), 1000 * MS, 1040 * MS, period_s=0.010) is None
    # the wake-up one period after the end still reports on the window
    assert sampler_mean_ms(s, 1005 * MS, 1030 * MS, period_s=0.010) == pytest.approx(0.15)


def test_one_wake_up_held_back_a_whole_switch_interval_is_a_measurement_of_contention():
    """A free GIL lets a woken sampler through in ~0.1 ms; only a holder running Python through its interval
    makes it wait 5 ms. A 20 ms request spans about two of the sampler's periods, too few to average."""
    from stagetrace.exporter.signals import sampler_mean_ms

    one = series((1012, 6.0))
    assert sampler_mean_ms(one, 1000 * MS, 1020 * MS, period_s=0.010) is None  # without the proof: too few
    assert sampler_mean_ms(one, 1000 * MS, 1020 * MS, period_s=0.010, proof_ms=5.0) == 6.0
    quick = series((1005, 0.1), (1015, 4.9))  # nothing waited a whole interval: still not measured
    assert sampler_mean_ms(quick, 1000 * MS, 1020 * MS, period_s=0.010, proof_ms=5.0) is None


def test_the_other_threads_totals_are_read_between_readings_that_bracket_the_stage():
    from stagetrace.exporter.signals import cumulative_change, resolve_others

    total = series((1000, 10.0), (1010, 12.0), (1020, 15.0), (1030, 21.0))  # cumulative ms
    assert cumulative_change(total, 1005 * MS, 1015 * MS) == 5.0  # 1000 -> 1020: never less than inside
    assert cumulative_change(total, 1010 * MS, 1020 * MS) == 3.0  # readings at the edges count as bracketing
    assert cumulative_change(total, 995 * MS, 1015 * MS) is None  # no reading before the stage
    assert cumulative_change(total, 1005 * MS, 1035 * MS) is None  # none after it (yet)

    cpu = series((1000, 100.0), (1020, 112.0))

    def stage(start_ns=5 * MS, end_ns=15 * MS, **fields):
        st = wire.ShippedStage.added("parse", "cpu", 1, 2, start_ns, end_ns)
        for name, value in fields.items():
            setattr(st, name, value)
        return st

    blocked = stage(blocked_ms=6.0, runqueue_ms=1.5, cpu_ms=4.0)
    resolve_others(blocked, total, cpu, offset_ns=1000 * MS)  # the stage's own 1.5 ms and 4 ms are not another's
    assert blocked.others_runqueue_ms == 3.5 and blocked.others_cpu_ms == 8.0
    late = stage(blocked_ms=6.0, runqueue_ms=0.0, cpu_ms=4.0, start_ns=25 * MS, end_ns=28 * MS)
    resolve_others(late, total, cpu, offset_ns=1000 * MS)  # the CPU total has no reading after it yet
    assert late.others_runqueue_ms == 6.0 and late.others_cpu_ms is None
    unresolved = stage(blocked_ms=None)
    resolve_others(unresolved, total, cpu, offset_ns=1000 * MS)  # no CPU figures: nothing to bound
    assert unresolved.others_runqueue_ms is None and unresolved.others_cpu_ms is None
    running = stage(blocked_ms=0.0, runqueue_ms=0.0, cpu_ms=10.0)
    resolve_others(running, total, cpu, offset_ns=1000 * MS)  # never blocked: no blocked time to bound
    assert running.others_runqueue_ms is None and running.others_cpu_ms is None


def test_the_process_totals_grow_with_every_thread_on_real_threads():
    """Real threads on this host: spinning threads, more than the CPUs, add to both totals; the reader's own
    on-CPU time counts too; closing forgets every thread."""
    import threading

    from stagetrace.capture.cpu import ProcessSchedTotals

    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("needs Linux schedstat")
    reader = ProcessSchedTotals(threading.get_native_id(), relist_every=1)
    assert reader.available
    rq_before, cpu_before = reader.totals_ms()
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    threads = [threading.Thread(target=spin) for _ in range((os.cpu_count() or 1) + 2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)  # more runnable threads than CPUs: they queue
        rq_during, cpu_during = reader.totals_ms()
    finally:
        stop.set()
        for t in threads:
            t.join()
    own = time.thread_time()
    while time.thread_time() - own < 0.05:  # the reader's own work
        pass
    rq_after, cpu_after = reader.totals_ms()
    assert rq_during > rq_before and rq_after >= rq_during
    assert cpu_during > cpu_before and cpu_after - cpu_during >= 40.0
    reader.close()
    assert reader._fds == reader._clocks == reader._last_clock == {}


def test_the_exporter_reads_the_other_threads_beside_the_stages_the_blocked_cause_rules_look_at():
    """Two window queries a stage: only on CPU stages long and blocked enough for a rule to look at them
    (every trace would pay them otherwise, for a few microseconds of blocked time on most stages)."""
    from stagetrace.common import wire
    from stagetrace.exporter import signals as sig
    from stagetrace.exporter.core import ExporterCore
    from stagetrace.exporter.outputs import LocalOutputs, NoMetrics
    from stagetrace.settings import Settings

    core = ExporterCore(Settings(), LocalOutputs(spans=None, metrics=NoMetrics()))
    core.series[sig.PROCESS_RUN_QUEUE_SERIES].extend_flat((1000 * MS, 10.0, 1100 * MS, 14.0))
    core.series[sig.PROCESS_CPU_SERIES].extend_flat((1000 * MS, 100.0, 1100 * MS, 160.0))

    def stage(kind: str, wall_ms: int, cpu_ms: int) -> wire.ShippedStage:
        st = wire.ShippedStage.added("tokenize", kind, 1, 2, 10 * MS, (10 + wall_ms) * MS)
        st.cpu_start, st.cpu_end = b"0 0 1\n", f"{cpu_ms * MS} 0 40\n".encode()  # on-CPU ns, run-queue ns, slices
        return st

    blocked = stage("cpu", 40, 20)  # 20 ms of 40 blocked
    barely = stage("cpu", 40, 38)  # 2 ms: under blocked_min_ms
    short = stage("cpu", 4, 1)  # shorter than min_stage_ms
    io = stage("io", 40, 1)  # not a CPU stage
    core._resolve_cpu([blocked, barely, short, io], offset=1000 * MS)
    assert (blocked.others_runqueue_ms, blocked.others_cpu_ms) == (4.0, 40.0)  # the stage's own 20 ms left out
    for other in (barely, short, io):
        assert other.blocked_ms and other.others_runqueue_ms is None and other.others_cpu_ms is None


def busy_then_parked(done: threading.Event, stop: threading.Event) -> None:
    """A thread's body: 50 ms on a CPU, then ``done`` and parked until ``stop`` (its CPU in the next reading)."""
    start = time.thread_time()
    while time.thread_time() - start < 0.05:
        pass
    done.set()
    stop.wait(10)


def test_a_thread_started_between_two_readings_is_in_the_second():
    """A worker started for a request runs its stage at once: its CPU must be in the reading after it, or
    the stage's own CPU would be missing from the total the other threads' time is taken from."""
    from stagetrace.capture.cpu import ProcessSchedTotals

    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("needs Linux schedstat")
    reader = ProcessSchedTotals(threading.get_native_id(), relist_every=1000)
    _, before = reader.totals_ms()
    done, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=busy_then_parked, args=(done, stop))
    worker.start()
    try:
        assert done.wait(10)
        _, after = reader.totals_ms()
    finally:
        stop.set()
        worker.join()
    assert after - before >= 45.0
    reader.close()


def test_the_process_totals_count_each_change_once_and_leave_out_the_readers_run_queue(monkeypatch):
    """On faked threads (a CPU clock each; schedstat: on-CPU ns, run-queue ns, slices): a thread's first reading
    counts its whole past, later ones their growth, both from its file as a stage's own are; a thread whose
    clock did not move is not read (not scheduled in: nothing to add yet) but for every relist_every-th
    reading; a thread that went drops out without taking anything back; a clock that went back is a new thread
    with the TID, read afresh; the reader's run-queue wait is its own signal, not another thread's."""
    from stagetrace.capture import cpu as cpu_module

    clocks = {11: 5_000_000, 22: 2_000_000}  # 11 reads; 22 is another thread
    files = {11: b"5000000 1000000 3\n", 22: b"2000000 4000000 7\n"}
    reads = []
    reader = cpu_module.ProcessSchedTotals(11, relist_every=1000, skip_clocks_when_busy=False)  # (the next test)

    def relist() -> None:  # the real one, but for the fds (forgetting a thread closes its fd)
        reader._fds = {tid: tid for tid in files}
        reader._clocks = {tid: tid for tid in files}
        for tid in set(reader._last_cpu) - set(files):
            for last in (reader._last_clock, reader._last_cpu, reader._last_run_queue):
                last.pop(tid, None)

    def clock_ns(clock):
        if clock not in clocks:
            raise OSError(22, "Invalid argument")  # as the kernel answers for a thread that went
        return clocks[clock]

    def pread(fd, buf, size, offset):
        reads.append(fd)
        raw = files[fd]
        ctypes.memmove(buf, raw, len(raw))
        return len(raw)

    monkeypatch.setattr(reader, "_relist", relist)
    reader._pread, reader._clock_ns = pread, clock_ns
    assert reader.totals_ms() == (4.0, 7.0)  # whole pasts: 22's run-queue, both threads' on-CPU
    clocks[11], clocks[22] = 9_100_000, 2_600_000  # (the clocks run ahead of the files: never read for counts)
    files[11], files[22] = b"9000000 3000000 4\n", b"2500000 6000000 8\n"
    assert reader.totals_ms() == (6.0, 11.5)  # +2 ms queued (22's; 11's is its own), +4 and +0.5 ms on-CPU
    reads.clear()
    clocks[11], files[11] = 9_600_000, b"9500000 3000000 5\n"
    assert reader.totals_ms() == (6.0, 12.0) and reads == [11]  # 22 did not run: not read, nothing added
    files[22] = b"2600000 6500000 9\n"  # moved to another CPU while queued: a wait added, its clock still
    reader._calls = 1000  # every relist_every-th reading reads every thread
    assert reader.totals_ms() == (6.5, 12.1) and 22 in reads
    del clocks[22]  # 22 went: its clock says so before any relist
    clocks[11], files[11] = 10_100_000, b"10000000 3000000 6\n"
    assert reader.totals_ms() == (6.5, 12.6) and 22 not in reader._clocks  # its counts stay, nothing more
    clocks[22], files[22] = 3_000_000, b"3000000 500000 1\n"  # a new thread, listed at the next relist
    reader._python_threads = -1
    assert reader.totals_ms() == (7.0, 15.6)  # its whole past
    clocks[22], files[22] = 1_000_000, b"1000000 200000 1\n"  # its TID taken by another new thread
    assert reader.totals_ms() == (7.0, 15.6) and 22 not in reader._clocks  # forgotten (its count fell), not taken back
    assert reader.totals_ms() == (7.2, 16.6)  # relisted at the next reading: its whole past
    files[22], clocks[22] = b"bad", 2_000_000  # an unreadable file is dropped, never an error
    assert reader.totals_ms() == (7.2, 16.6) and 22 not in reader._clocks


def test_a_saturated_process_is_read_without_its_threads_clocks(monkeypatch):
    """On faked threads: where the last reading found two thirds of the threads or more run, the next reads
    every file and no clock (each clock would only precede its file's read); once most are parked the clocks
    come back and a parked thread costs a clock read alone. Counts are the same either way."""
    from stagetrace.capture import cpu as cpu_module

    clocks = {11: 1_000_000, 22: 1_000_000, 33: 1_000_000}
    files = {tid: b"1000000 0 1\n" for tid in clocks}
    reads, clock_reads = [], []
    reader = cpu_module.ProcessSchedTotals(11, relist_every=1000)

    def relist() -> None:
        reader._fds = {tid: tid for tid in files}
        reader._clocks = {tid: tid for tid in files}

    def clock_ns(clock):
        clock_reads.append(clock)
        return clocks[clock]

    def pread(fd, buf, size, offset):
        reads.append(fd)
        ctypes.memmove(buf, files[fd], len(files[fd]))
        return len(files[fd])

    def run(tids, ms=1):  # the threads in tids run for ms
        for tid in tids:
            clocks[tid] += ms * 1_000_000
            cpu, rq, slices = (int(f) for f in files[tid].split())
            files[tid] = f"{cpu + ms * 1_000_000} {rq} {slices + 1}\n".encode()

    def reading():
        reads.clear()
        clock_reads.clear()
        return reader.totals_ms()

    monkeypatch.setattr(reader, "_relist", relist)
    reader._pread, reader._clock_ns = pread, clock_ns
    assert reading() == (0.0, 3.0) and reads == [11, 22, 33] and clock_reads == []  # the first lists: all read
    run([11, 22, 33])
    assert reading() == (0.0, 6.0) and reads == [11, 22, 33] and clock_reads == []  # busy: no clock read
    run([11])  # 22 and 33 parked
    assert reading() == (0.0, 7.0) and reads == [11, 22, 33] and clock_reads == []  # found parked, reading them
    run([11])
    assert reading() == (0.0, 8.0) and clock_reads == [11, 22, 33]  # the clocks back (first taken: all read)
    run([11])
    assert reading() == (0.0, 9.0) and reads == [11] and clock_reads == [11, 22, 33]  # parked: a clock each
    clocks[33] -= 1  # a clock that went back: another thread with the TID, read afresh after a relist
    run([11])
    assert reading() == (0.0, 10.0) and 33 not in reader._clocks and reader._python_threads == -1


def test_the_kernel_counts_the_process_threads_for_the_totals_and_a_thread_started_outside_python_is_read():
    """The totals look for threads started outside Python (not in ``threading.active_count``) by the link count
    of ``/proc/self/task``, threads + 2, where listing the directory cost ~100 us at saturation: the count must
    hold on Linux (else every reading lists), and such a thread's CPU be in the reading after it ran."""
    import _thread

    from stagetrace.capture.cpu import ProcessSchedTotals, _open_thread_count

    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("needs Linux schedstat")
    parked = threading.Event()
    beside = threading.Thread(target=parked.wait, args=(30,), daemon=True)  # (a count is only trusted with two)
    beside.start()
    fd, holds = _open_thread_count()
    os.close(fd)
    assert holds, "/proc/self/task's link count is no longer the threads + 2: the totals list every reading"
    reader = ProcessSchedTotals(threading.get_native_id(), relist_every=1)
    relists = []
    listing = reader._relist
    reader._relist = lambda: (relists.append(1), listing())  # type: ignore[method-assign]
    _, before = reader.totals_ms()
    for _ in range(10):  # no thread started or ended: the kernel's count says so, nothing is listed again
        reader.totals_ms()
    assert len(relists) <= 3, relists  # the first; any thread another test left ending meanwhile
    relists.clear()
    python_threads = threading.active_count()
    done, stop = threading.Event(), threading.Event()
    _thread.start_new_thread(busy_then_parked, (done, stop))
    try:
        assert done.wait(10) and threading.active_count() == python_threads  # unseen by threading
        _, after = reader.totals_ms()
    finally:
        stop.set()
    assert after - before >= 45.0 and relists  # found by the count, the Python threads unchanged
    parked.set()
    reader.close()
    assert reader._tasks_fd == -1 and reader._fds == {}
    assert reader.totals_ms() == reader.totals_ms() and reader._fds == {}  # after close: the last totals, no files


@pytest.mark.skipif(not hasattr(os, "fork") or not os.path.exists("/proc/thread-self/schedstat"), reason="Linux")
def test_a_forked_child_drops_the_parents_reader_of_the_totals():
    """The reader holds the parent's threads' files: in a child, the helper's reading before the child's own
    sampler starts would sum the parent's threads. The child drops it (and its files); the parent keeps its."""
    from stagetrace.capture.monitors import GilPressureMonitor

    sampler = GilPressureMonitor(0.005, in_flight=lambda: 1)
    sampler.ensure_running()
    try:
        deadline = time.monotonic() + 10
        while sampler._process is None and time.monotonic() < deadline:
            time.sleep(0.01)
        parents = sampler._process
        assert parents is not None
        pid = os.fork()
        if pid == 0:  # the child: exit at once with what it found
            ok = sampler._process is None and parents._closed and parents._fds == {}
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert sampler._process is parents and not parents._closed and parents._fds
    finally:
        sampler.stop()


def test_a_threads_cpu_clock_is_built_from_its_tid_as_the_c_library_builds_it():
    """The totals read every thread's CPU clock by TID (native threads too, which pthread_getcpuclockid cannot
    reach): the id must be the one the C library gives for a thread, and read that thread's CPU time."""
    from stagetrace.capture.cpu import thread_cpu_clock

    if not hasattr(time, "pthread_getcpuclockid") or not sys.platform.startswith("linux"):
        pytest.skip("Linux thread CPU clocks")
    ids, done = [], threading.Event()

    def worker() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.05:
            pass
        ids.append((time.pthread_getcpuclockid(threading.get_ident()), threading.get_native_id()))
        done.wait(10)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not ids and time.monotonic() < deadline:
            time.sleep(0.01)
        pthread_clock, tid = ids[0]
        assert thread_cpu_clock(tid) == pthread_clock
        assert time.clock_gettime_ns(thread_cpu_clock(tid)) >= 50_000_000  # the worker's, read from here
    finally:
        done.set()
        thread.join()


# --- how much of a stage's blocked time was provably not the GIL ------------------------------------------


def test_blocked_time_within_one_gil_wait_per_slice_proves_nothing():
    from stagetrace.common.schedstat import GIL_WAIT_MARGIN_MS, not_gil_ms

    bound = 5.0 + GIL_WAIT_MARGIN_MS
    assert not_gil_ms(0.0, 0, 5.0) == 0.0
    assert not_gil_ms(30.0, 0, 5.0) == 0.0  # never scheduled out: no stretch to judge
    assert not_gil_ms(bound, 1, 5.0) == 0.0  # one stretch as long as a GIL wait can be
    assert not_gil_ms(3 * bound, 3, 5.0) == 0.0


def test_blocked_time_beyond_a_gil_wait_per_slice_is_proven_a_wait_of_another_kind():
    from stagetrace.common.schedstat import GIL_WAIT_MARGIN_MS, not_gil_ms

    bound = 5.0 + GIL_WAIT_MARGIN_MS
    assert not_gil_ms(40.0, 1, 5.0) == 40.0  # one stretch of 40 ms: no GIL wait lasts that long
    # two stretches, 14 ms: at most one was a GIL wait, so the rest was not the GIL
    assert not_gil_ms(14.0, 2, 5.0) == pytest.approx(14.0 - bound)
    assert not_gil_ms(3 * bound + 0.01, 3, 5.0) == pytest.approx(bound + 0.01)
    assert not_gil_ms(9.0, 1, 0.0) == 9.0  # no GIL at all: none of it was a GIL wait


@given(
    gil_waits=st.lists(st.floats(0.0, 5.5), max_size=12),
    other_waits=st.lists(st.floats(0.0, 100.0), max_size=6),
    extra_slices=st.integers(0, 10),
)
def test_not_gil_never_claims_more_than_the_waits_that_were_not_the_gil(gil_waits, other_waits, extra_slices):
    """Any mix of GIL waits (each within the switch interval and its margin) and other waits, with at least
    one slice per stretch (preemptions add more): the proven part never exceeds the other waits."""
    from stagetrace.common.schedstat import not_gil_ms

    blocked = sum(gil_waits) + sum(other_waits)
    slices = len(gil_waits) + len(other_waits) + extra_slices
    assert not_gil_ms(blocked, slices, 5.0) <= sum(other_waits) + 1e-9


def test_resolve_cpu_reads_the_slice_count_from_schedstat():
    from stagetrace.common.schedstat import GIL_WAIT_MARGIN_MS
    from stagetrace.exporter.signals import resolve_cpu

    def stage(start: bytes, end: bytes):
        st = wire.ShippedStage.added("parse", "cpu", 1, 2, 0, 50 * MS)
        st.cpu_start, st.cpu_end = start, end
        return st

    # 50 ms: 5 on-CPU, 5 in the run queue, 40 off-CPU in one stretch (two slices: start and after the wait)
    one_wait = stage(b"1000000000 2000000000 10\n", b"1005000000 2005000000 12\n")
    resolve_cpu(one_wait, 5.0)
    assert (one_wait.cpu_ms, one_wait.runqueue_ms, one_wait.blocked_ms) == (5.0, 5.0, 40.0)
    assert one_wait.not_gil_ms == pytest.approx(40.0 - (5.0 + GIL_WAIT_MARGIN_MS))
    many = stage(b"1000000000 2000000000 10\n", b"1005000000 2005000000 20\n")  # ten stretches of 4 ms
    resolve_cpu(many, 5.0)
    assert many.blocked_ms == 40.0 and many.not_gil_ms == 0.0
    unknown = stage(b"1000000000 2000000000 10\n", b"1005000000 2005000000 12\n")
    resolve_cpu(unknown, None)  # no known bound (not CPython): no proof either way
    assert unknown.blocked_ms == 40.0 and unknown.not_gil_ms is None
    two_fields = stage(b"1000000000 2000000000\n", b"1005000000 2005000000\n")
    resolve_cpu(two_fields, 5.0)
    assert two_fields.blocked_ms == 40.0 and two_fields.not_gil_ms is None


# --- how much of a loop stall work on the loop's own thread explains -------------------------------------


def _schedstat(cpu_ms: float, rq_ms: float, slices: int) -> bytes:
    return f"{int(cpu_ms * 1e6)} {int(rq_ms * 1e6)} {slices}\n".encode()


def test_a_stall_the_loop_thread_spent_running_or_in_a_blocking_call_is_held_by_work_on_it():
    from stagetrace.common.schedstat import GIL_WAIT_MARGIN_MS, loop_held_ms

    start = _schedstat(0, 0, 10)
    # 50 ms sleep asked, 130 ms elapsed: 10 ms idle, then 120 ms of CPU on the loop thread. A lower bound: how
    # long the loop idled is not known, so the whole interval is taken off the 120 ms
    assert loop_held_ms(80.0, 130.0, 50.0, start, _schedstat(120, 0, 12), 5.0) == 70.0
    # 10 ms idle, then a 120 ms blocking call: 129 ms off the CPU in 3 stretches, at most 2 of them GIL waits
    gil_waits_at_most = 2 * (5.0 + GIL_WAIT_MARGIN_MS)
    assert loop_held_ms(80.0, 130.0, 50.0, start, _schedstat(1, 0, 13), 5.0) == pytest.approx(
        1 + 129 - gil_waits_at_most - 50
    )


def test_a_stall_the_loop_thread_spent_waiting_for_the_gil_or_a_cpu_is_not():
    from stagetrace.common.schedstat import loop_held_ms

    start = _schedstat(0, 0, 10)
    # 40 ms idle (one stretch), then 90 ms of GIL waits of a few ms each (30 stretches), 5 ms of CPU
    assert loop_held_ms(80.0, 135.0, 50.0, start, _schedstat(5, 0, 41), 5.0) == 0.0
    # 20 ms idle, then 100 ms in the run queue
    assert loop_held_ms(70.0, 125.0, 50.0, start, _schedstat(5, 100, 13), 5.0) == 0.0
    # not measurable: no slice counts, or no known GIL bound
    assert loop_held_ms(80.0, 130.0, 50.0, b"0 0\n", b"120000000 0\n", 5.0) is None
    assert loop_held_ms(80.0, 130.0, 50.0, start, _schedstat(120, 0, 12), None) is None


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="needs Linux schedstat")
def test_the_loop_monitor_tells_work_on_the_loop_from_an_idle_loop():
    """On a real event loop: CPU work and a blocking call on the loop's thread hold the loop; an idle loop
    lags by no more than its timer."""
    import asyncio

    from stagetrace.capture.monitors import LoopLagMonitor

    def spin(ms: float) -> None:  # ms of this thread's CPU time: on a loaded host it holds the loop longer
        end = time.thread_time() + ms / 1000
        while time.thread_time() < end:
            pass

    async def scenario(monitor: LoopLagMonitor, block) -> float:
        monitor.ensure_running()
        await asyncio.sleep(0.12)  # a couple of quiet wake-ups
        block()
        await asyncio.sleep(0.12)  # the wake-up that reports the stall
        held = [v for _, v in monitor.held.drain()]
        for task in list(monitor._tasks):
            task.cancel()
        return max(held)

    sleep_ms = lambda ms: time.sleep(ms / 1000)  # noqa: E731
    for block in (lambda: spin(150), lambda: sleep_ms(150)):
        monitor = LoopLagMonitor(0.05, gil_wait_bound_s=sys.getswitchinterval())
        assert asyncio.run(scenario(monitor, block)) >= 50.0
    idle = LoopLagMonitor(0.05, gil_wait_bound_s=sys.getswitchinterval())
    assert asyncio.run(scenario(idle, lambda: None)) < 10.0


def test_the_gil_sampler_sleeps_while_no_trace_is_in_flight_and_wakes_with_the_first():
    from stagetrace.capture.monitors import GilPressureMonitor
    from stagetrace.capture.registry import TraceRegistry

    registry = TraceRegistry(16, 60.0, lambda reason, n: None)
    sampler = GilPressureMonitor(0.002, in_flight=registry.__len__)
    registry.idle_wake = sampler.wake
    sampler.ensure_running()
    try:
        time.sleep(0.1)
        assert sampler.series.drain() == [] and sampler.idle_waits >= 1  # idle: no wake-ups, no samples
        registry.open(1, 2, time.time_ns())
        deadline = time.monotonic() + 5
        samples = []
        while len(samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
            samples += sampler.series.drain()
        assert len(samples) >= 3  # a trace in flight: sampling at its period
        registry.close(1, 2)
        time.sleep(0.05)
        sampler.series.drain()
        time.sleep(0.1)
        assert sampler.series.drain() == []  # idle again
    finally:
        sampler.stop()


# --- a trace waits for the GIL monitor's first wake-up after its end ------------------------------------------


def test_a_trace_waits_for_the_samplers_reading_after_its_end_with_what_came_after_it(monkeypatch):
    """A sampler held back by the GIL reports that wait only once through: a trace shipped before then would
    be judged without it (no GIL pressure on the requests that lived the most). The helper thread holds such a
    trace, and everything after it in order, until the readings reach its end or SIGNALS_WAIT_S passes."""
    from types import SimpleNamespace

    from stagetrace.handoff import shipper as shipper_module
    from stagetrace.handoff.shipper import Shipper
    from stagetrace.settings import SIGNALS_WAIT_S, Settings

    reached = {"ns": 100}
    shipper = Shipper(
        settings=Settings(),
        transport_factory=lambda s: None,  # never started here
        app_metrics=None,
        registry=SimpleNamespace(clear=lambda: None),
        signals_cover=lambda end_ns: reached["ns"] >= end_ns,
    )
    clock = {"now": 50.0}
    monkeypatch.setattr(shipper_module.time, "monotonic", lambda: clock["now"])
    covered = ("trace-a", SimpleNamespace(end_time=90))
    waiting = ("trace-b", SimpleNamespace(end_time=150))
    lone = object()  # a lone stage or span: no end of its own to wait for, but it keeps its place
    assert shipper._through_gate([covered, waiting, lone], final=False) == [covered]
    later = ("trace-c", SimpleNamespace(end_time=120))
    assert shipper._through_gate([later], final=False) == []  # behind the one still waiting
    reached["ns"] = 130  # the sampler woke after c ended, not yet after b: both still wait
    assert shipper._through_gate([], final=False) == []
    reached["ns"] = 160
    assert shipper._through_gate([], final=False) == [waiting, lone, later]
    # a sampler that never reports again: the trace goes once it has waited SIGNALS_WAIT_S
    stuck = ("trace-d", SimpleNamespace(end_time=10**12))
    assert shipper._through_gate([stuck], final=False) == []
    clock["now"] += SIGNALS_WAIT_S + 0.001
    assert shipper._through_gate([], final=False) == [stuck]
    # at shutdown nothing waits
    assert shipper._through_gate([("trace-e", SimpleNamespace(end_time=10**12))], final=True)


def test_the_gil_sampler_covers_a_trace_once_it_woke_after_its_end_or_went_idle():
    from stagetrace.capture.monitors import GilPressureMonitor
    from stagetrace.capture.registry import TraceRegistry

    registry = TraceRegistry(16, 60.0, lambda reason, n: None)
    sampler = GilPressureMonitor(0.005, in_flight=registry.__len__)
    registry.idle_wake = sampler.wake
    assert sampler.covers(time.time_ns() + 10**12)  # not running: nothing to wait for
    sampler.ensure_running()
    try:
        registry.open(1, 2, time.time_ns())
        end = time.time_ns()
        deadline = time.monotonic() + 5
        while not sampler.covers(end) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert sampler.covers(end) and not sampler.covers(time.time_ns() + 10**12)
        idle_before = sampler.idle_waits
        registry.close(1, 2)
        closed = time.time_ns()
        deadline = time.monotonic() + 5
        while sampler.idle_waits == idle_before and time.monotonic() < deadline:
            time.sleep(0.005)
        assert sampler.covers(closed)  # gone idle: every trace that ended before then is covered
        before = len(sampler.process_run_queue.drain())
        assert len(sampler.process_cpu.drain()) == before
        sampler.note_process_totals()  # the helper thread's own reading, before it ships
        assert len(sampler.process_run_queue.drain()) == 1 and before >= 1
        assert len(sampler.process_cpu.drain()) == 1
    finally:
        sampler.stop()
    deadline = time.monotonic() + 5
    while sampler._thread is not None and sampler._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sampler.covers(time.time_ns() + 10**12)  # stopped: nothing to wait for


def run_on_fake_clock(monkeypatch, wakeups, *, reading_ns=0, idle_after=frozenset()):
    """The GIL monitor's loop, on this thread, against a fake clock, its own schedstat and the process's totals
    faked. ``wakeups``: for each sleep, (ns late beyond the run-queue wait, run-queue ns, times scheduled in,
    or None for a kernel that gives no count); a reading of the totals takes ``reading_ns``; after each
    wake-up in ``idle_after`` the last trace ends and a new one opens before the monitor goes to sleep.
    Returns the monitor and, for each sleep, how many readings of the totals came before it."""
    from stagetrace.capture import monitors

    clock, own = {"ns": 10**12}, {"rq": 0, "slices": 0}
    readings, per_sleep, flying = [0], [], []

    def in_flight():
        if not flying:
            return 1
        count = flying.pop()
        if not count:
            clock["ns"] += 10**9  # a second idle: no lag of the next stretch's first wake-up
        return count

    sampler = monitors.GilPressureMonitor(0.01, in_flight=in_flight)
    append_gil_wait = sampler.series.put

    def gil_wait_in_order(sample):  # a trace is judged once last_wake_ns reaches its end: samples first
        assert sampler.last_wake_ns < sample[0]
        append_gil_wait(sample)

    sampler.series.put = gil_wait_in_order

    class FakeOwnRunQueue:
        @classmethod
        def open(cls):
            return cls()

        def read(self):
            return own["rq"], own["slices"]

        def close(self):
            pass

    class FakeProcess:
        available = True

        def __init__(self, tid):
            pass

        def totals_ms(self):
            clock["ns"] += reading_ns
            readings[0] += 1
            return 0.0, 0.0

        def close(self):
            pass

    def sleep(seconds):
        per_sleep.append(readings[0])
        readings[0] = 0
        late, rq, slices = wakeups[len(per_sleep) - 1]
        clock["ns"] += int(seconds * 1e9) + late + rq
        own["rq"] += rq
        own["slices"] = None if slices is None else own["slices"] + slices
        if len(per_sleep) - 1 in idle_after:
            flying.extend([1, 0])  # popped from the end: nothing in flight, then a trace open again
        if len(per_sleep) == len(wakeups):
            sampler.stop()

    monkeypatch.setattr(monitors, "OwnRunQueue", FakeOwnRunQueue)
    monkeypatch.setattr(monitors, "ProcessSchedTotals", FakeProcess)
    monkeypatch.setattr(monitors, "_perf_ns", lambda: clock["ns"])
    monkeypatch.setattr(monitors, "_sleep", sleep)
    sampler._run()
    return sampler, per_sleep


def test_the_process_totals_are_read_after_every_wait_and_every_fifth_quiet_wake_up(monkeypatch):
    from stagetrace.capture.monitors import CONTENDED_LAG_NS, CONTENDED_RUN_QUEUE_NS, PROCESS_READ_EVERY

    quiet = (CONTENDED_LAG_NS - 1, CONTENDED_RUN_QUEUE_NS - 1, 1)
    _, reads = run_on_fake_clock(monkeypatch, [quiet] * 20)
    assert [i for i, n in enumerate(reads) if n] == list(range(0, 20, PROCESS_READ_EVERY))  # the first, then 5th
    waited_for_the_gil, waited_for_a_cpu = (CONTENDED_LAG_NS, 0, 2), (0, CONTENDED_RUN_QUEUE_NS, 1)
    script = [quiet, waited_for_the_gil, quiet, waited_for_a_cpu, quiet, quiet]
    _, reads = run_on_fake_clock(monkeypatch, script)
    assert reads == [1, 0, 1, 0, 1, 0]  # the wake-up after either kind of wait reads
    # back from idle: a reading as the last trace ends, and the first wake-up of the new stretch reads again;
    # the idle time is no wake-up's lag
    sampler, reads = run_on_fake_clock(monkeypatch, [(0, 0, 2)] * 4, idle_after={1})
    assert reads == [1, 0, 2, 0] and {v for _, v in sampler.series.drain()} == {0.0}


def test_a_sampler_beside_a_thread_holding_the_gil_reads_the_run_queue_at_most_wake_ups():
    from stagetrace.capture.monitors import GilPressureMonitor

    sampler = GilPressureMonitor(0.005, in_flight=lambda: 1)
    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("needs Linux schedstat")
    stop = threading.Event()

    def hold_the_gil() -> None:
        while not stop.is_set():
            sum(range(1000))

    holder = threading.Thread(target=hold_the_gil, daemon=True)
    holder.start()
    sampler.ensure_running()
    try:
        deadline = time.monotonic() + 10
        wakes = 0
        while wakes < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
            wakes += len(sampler.series.drain())
    finally:
        sampler.stop()
        stop.set()
        holder.join(5)
    # every wake-up waited a switch interval for the GIL, so each read the total for the next
    assert wakes >= 30 and sampler.process_reads >= 0.8 * wakes


def test_a_slow_reading_of_the_run_queue_does_not_make_the_next_wake_up_read_again(monkeypatch):
    """On a fake clock: every wake-up on time, no run-queue wait, and a reading of the other threads that
    takes 3 ms (forty threads read cold). Its time is in the next lag; it must not count as a wait."""
    from stagetrace.capture.monitors import PROCESS_READ_EVERY

    sampler, reads = run_on_fake_clock(monkeypatch, [(0, 0, 1)] * 40, reading_ns=3_000_000)
    assert [i for i, n in enumerate(reads) if n] == list(range(0, 40, PROCESS_READ_EVERY))
    assert sampler.process_reads == len(range(0, 40, PROCESS_READ_EVERY)) and sampler.wakeups == 40


def test_a_late_wake_up_scheduled_in_once_is_no_gil_wait(monkeypatch):
    """On a fake clock: each wake-up 3 ms late beyond 1 ms of run-queue wait. Scheduled in once (the timer's
    wake-up only: the hypervisor took the CPU, or the process was stopped), it never slept on the GIL, so it
    records no GIL wait; scheduled in twice, or on a kernel that gives no count, it may have, and the lag
    stands. The run-queue wait is kept as its own series either way."""

    def series(slices):
        sampler, _ = run_on_fake_clock(monkeypatch, [(3_000_000, 1_000_000, slices)] * 10)
        return {v for _, v in sampler.series.drain()}, {v for _, v in sampler.run_queue.drain()}

    assert series(1) == ({0.0}, {1.0})
    assert series(2) == ({3.0}, {1.0})
    assert series(None) == ({3.0}, {1.0})


def test_a_failing_reading_ends_the_gil_monitor_contained_with_its_files_closed(monkeypatch):
    """An error inside the monitor's loop (here its own schedstat read) is reported as an internal error, not
    raised into the thread's excepthook; its files are closed and the shipper stops waiting for it."""
    from stagetrace.capture import monitors

    reported, closed = [], []
    sampler = monitors.GilPressureMonitor(0.001, in_flight=lambda: 1)

    class FakeProcess:
        available = True

        def __init__(self, tid):
            pass

        def totals_ms(self):
            return 0.0, 0.0

        def close(self):
            closed.append(self)

    class FailingOwnRunQueue:
        calls = 0

        @classmethod
        def open(cls):
            return cls()

        def read(self):
            FailingOwnRunQueue.calls += 1
            if FailingOwnRunQueue.calls == 3:
                raise ValueError("a schedstat line this kernel should not write")
            return 0, 1

        def close(self):
            closed.append(self)

    monkeypatch.setattr(monitors, "OwnRunQueue", FailingOwnRunQueue)
    monkeypatch.setattr(monitors, "ProcessSchedTotals", FakeProcess)
    monkeypatch.setattr(monitors, "report_internal_error", reported.append)
    sampler.ensure_running()
    sampler._thread.join(5)
    assert not sampler._thread.is_alive() and reported == ["GIL pressure monitor"]
    assert sorted(type(c).__name__ for c in closed) == ["FailingOwnRunQueue", "FakeProcess"]
    assert sampler.covers(time.time_ns() + 10**12) and sampler._process is None


def test_a_gil_monitor_alone_in_its_process_reads_a_free_gil_as_no_wait():
    """No other thread wants the GIL, so no wake-up waits for it: the timer's lateness (slack, the wake-up path,
    a hypervisor's stolen time: 0.05-0.5 ms a wake-up on a virtual machine) is kept out of GIL pressure, on real
    threads and a real kernel. Preempted wake-ups may keep some; most read zero."""
    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("needs Linux schedstat")
    child = subprocess.run([sys.executable, "-c", LONE_SAMPLER], capture_output=True, text=True, timeout=60, check=True)
    lags = json.loads(child.stdout)
    assert len(lags) >= 50
    assert sorted(lags)[len(lags) // 2] == 0.0, sorted(lags)


LONE_SAMPLER = """
import json, time
from stagetrace.capture.monitors import GilPressureMonitor
sampler = GilPressureMonitor(0.005, in_flight=lambda: 1)
sampler.ensure_running()
time.sleep(0.6)  # asleep: the GIL is free
sampler.stop()
print(json.dumps([lag for _, lag in sampler.series.drain()]))
"""


def pairwise_reference(batches: list[tuple[object, ...]]) -> tuple[list[int], list[float]]:
    """extend_flat's contract, a pair at a time: malformed pairs, and pairs older than the last kept, skipped."""
    times: list[int] = []
    values: list[float] = []
    for flat in batches:
        for t, v in zip(flat[0::2], flat[1::2]):
            if isinstance(t, int) and isinstance(v, (int, float)) and not (times and t < times[-1]):
                times.append(t)
                values.append(float(v))
    return times, values


_sample_time = st.one_of(st.integers(0, 50), st.sampled_from([True, "7", None, 3.0]))
_sample_value = st.one_of(st.integers(0, 9), st.floats(0, 9), st.sampled_from([False, "x", None]))


_sampler_batch = st.lists(st.tuples(st.integers(0, 50), st.floats(0, 9)), max_size=5).map(
    lambda pairs: tuple(x for pair in sorted(pairs) for x in pair)
)


@given(
    st.lists(
        st.one_of(_sampler_batch, st.lists(st.one_of(_sample_time, _sample_value), max_size=9).map(tuple)),
        max_size=6,
    )
)
def test_a_series_keeps_every_well_formed_pair_in_order_whatever_the_batches_hold(batches):
    """Batches as the samplers ship them take a fast path; any batch with a malformed or out-of-order pair
    (or an odd length) is read a pair at a time. Both keep exactly what the pairwise contract keeps."""
    s = LagSeries()
    for flat in batches:
        s.extend_flat(flat)
    assert (s.times, s.values) == pairwise_reference(batches)
    assert all(type(v) is float for v in s.values)


def test_a_full_series_drops_its_oldest_half_on_either_path():
    fast, checked = LagSeries(max_samples=8), LagSeries(max_samples=8)
    for i in range(5):
        fast.extend_flat((2 * i, 1.0, 2 * i + 1, 2.0))
        checked.extend_flat((2 * i, 1.0, 2 * i + 1, 2.0, "malformed"))
    assert fast.times == checked.times == [6, 7, 8, 9]


@pytest.mark.skipif(
    not compiled_or_source.__file__.endswith(".py"),
    reason="compiled, every batch is read a pair at a time, in C (signals.pxd)",
)
def test_a_batch_as_the_samplers_ship_it_is_not_read_a_pair_at_a_time(monkeypatch):
    s = LagSeries()
    monkeypatch.setattr(s, "_extend_checked", lambda flat: pytest.fail(f"read a pair at a time: {flat}"))
    s.extend_flat((1, 1.0, 2, 2))
    s.extend_flat((2, 0.5, 7, 3.25))
    assert (s.times, s.values) == ([1, 2, 2, 7], [1.0, 2.0, 0.5, 3.25])


def test_a_value_no_float_holds_is_skipped_and_leaves_the_series_whole():
    s = LagSeries()
    s.extend_flat((1, 10**400, 2, 1.0))
    s.extend_flat((3, 2.0, 4, -(10**400)))
    assert (s.times, s.values) == ([2, 3], [1.0, 2.0])


# --- the process's load over a trace (CPU_OVERSUBSCRIBED / SERVICE_AT_CAPACITY) -------------------------------

MS_NS = 1_000_000


def _series(points):
    s = LagSeries()
    s.extend_flat(flatten([(int(t * MS_NS), v) for t, v in points]))
    return s


def test_the_process_load_is_read_between_the_readings_that_stand_for_the_window():
    from stagetrace.exporter.signals import process_load

    # cumulative ms: 2 CPUs' worth of on-CPU time a ms from 0 to 30, 6 threads' run-queue time
    cpu = _series([(0, 0.0), (10, 20.0), (20, 40.0), (30, 60.0)])
    rq = _series([(0, 0.0), (10, 40.0), (20, 80.0), (30, 120.0)])
    in_flight = _series([(0, 8), (10, 8), (20, 6), (30, 2)])
    load = process_load(cpu, rq, in_flight, 5 * MS_NS, 25 * MS_NS, cpus=2)  # ties: the readings outside
    assert load == (2, 2.0, 6.0, 6.0)
    assert process_load(cpu, rq, in_flight, 10 * MS_NS, 20 * MS_NS, cpus=2) == (2, 2.0, 6.0, 7.0)  # on readings
    assert process_load(cpu, rq, in_flight, 10 * MS_NS, 20 * MS_NS, cpus=None) is None  # CPUs not known
    assert process_load(cpu, rq, LagSeries(), 10 * MS_NS, 20 * MS_NS, cpus=2).requests is None
    assert process_load(LagSeries(), rq, in_flight, 10 * MS_NS, 20 * MS_NS, cpus=2) is None


def test_idle_time_before_or_after_a_burst_is_left_out_of_its_load():
    """The last reading before a trace may be from before the process went idle (a second ago): the one
    just after the trace began, within a quarter of it, stands for its start instead; likewise at its end."""
    from stagetrace.exporter.signals import process_load

    cpu = _series([(-1000, 0.0), (1, 0.0), (41, 80.0), (1500, 80.0)])
    rq = _series([(-1000, 0.0), (1, 0.0), (41, 200.0), (1500, 200.0)])
    load = process_load(cpu, rq, LagSeries(), 0, 40 * MS_NS, cpus=2)
    assert (load.cpus_used, load.runnable) == (2.0, 7.0)
    # a reading too far inside (more than a quarter of the window) does not stand for the start, and then the
    # span with the idle second in it says too little of the window: not read
    late = _series([(-1000, 0.0), (15, 0.0), (41, 80.0)])
    assert process_load(late, _series([(-1000, 0.0), (15, 0.0), (41, 1.0)]), LagSeries(), 0, 40 * MS_NS, 2) is None


def test_the_monitor_notes_the_requests_in_flight_with_each_reading_and_one_reading_as_it_goes_idle():
    from stagetrace.capture.monitors import GilPressureMonitor

    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("needs Linux schedstat")
    flying = [3]
    sampler = GilPressureMonitor(0.005, in_flight=lambda: flying[0])
    sampler.ensure_running()
    try:
        deadline = time.monotonic() + 5
        while sampler.process_reads < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        reads = sampler.process_reads
        flying[0] = 0  # the last trace ended: the next wake-up reads once more, then sleeps
        deadline = time.monotonic() + 5
        while sampler.idle_waits < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
    finally:
        sampler.stop()
    counts = [v for _, v in sampler.in_flight.drain()]
    totals = sampler.process_cpu.drain()
    assert len(counts) == len(totals) >= reads + 1  # one count a reading
    assert counts[-1] == 0 and set(counts[:-1]) <= {3, 0}  # the reading on going idle saw none in flight


def test_the_cpus_a_process_may_use_are_its_affinity_less_a_cgroup_quota(tmp_path):
    from stagetrace.common.cpus import quota_cpus, usable_cpus

    v2, missing = tmp_path / "cpu.max", (tmp_path / "none", tmp_path / "none")
    v2.write_text("150000 100000\n")
    assert quota_cpus(v2, missing) == 1.5
    assert usable_cpus(v2, missing) == min(2, len(os.sched_getaffinity(0)))  # 1.5 CPUs: two may run at once
    v2.write_text("max 100000\n")
    assert quota_cpus(v2, missing) is None and usable_cpus(v2, missing) == len(os.sched_getaffinity(0))
    quota, period = tmp_path / "q", tmp_path / "p"
    quota.write_text("50000"), period.write_text("100000")
    assert quota_cpus(tmp_path / "absent", (quota, period)) == 0.5
    assert usable_cpus(tmp_path / "absent", (quota, period)) == 1
    quota.write_text("-1")
    assert quota_cpus(tmp_path / "absent", (quota, period)) is None
