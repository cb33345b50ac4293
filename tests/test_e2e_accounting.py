"""The paired co-run's accounting by thread (benchmarks/e2e.py): each thread's CPU in ns, not clock ticks."""

from __future__ import annotations

import os
import threading
import time

import pytest


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="needs Linux schedstat")
def test_the_co_runs_threads_are_read_finer_than_a_clock_tick():
    """A tick (10 ms) over a co-run's few hundred requests rounded each thread's CPU by up to 0.03 ms a request
    and the dozen threads' sum, which "other" is taken from, by ten times that: read from schedstat, no
    thread's figure is a whole number of ticks."""
    import e2e

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    threads = [threading.Thread(target=spin) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.05)
        figures = e2e._thread_cpu_s(os.getpid())
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert {t.native_id for t in threads} <= set(figures)
    assert not all(abs(s * 100 - round(s * 100)) < 1e-9 for s in figures.values()), figures
    assert figures[threading.get_native_id()] == pytest.approx(time.thread_time(), abs=0.05)
