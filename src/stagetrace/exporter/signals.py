"""Process signals joined to traces in the exporter: CPU figures from a stage's raw clock readings, and the
GIL-pressure and event-loop-lag series that the application's samplers ship as (time, value) pairs.

Pure bookkeeping: no threads, no clocks of its own; the exporter feeds it and asks windows of it.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from stagetrace.analysis.loopwait import LoopBlock
from stagetrace.settings import GIL_MIN_SAMPLES, MIN_CPU_ACCOUNTED_NS

GIL_SERIES = "gil"
LOOP_SERIES = "loop"


def resolve_cpu(stage: Any) -> None:
    """Turn a stage's two raw readings (schedstat bytes, or thread CPU ns) into cpu_ms / runqueue_ms /
    blocked_ms. Only stages of at least 1 ms: below that the split is scheduler noise, no rule looks at it,
    and each attribute costs encoding on every span."""
    start, end = stage.cpu_start, stage.cpu_end
    if start is None or end is None or stage.end_ns - stage.start_ns < MIN_CPU_ACCOUNTED_NS:
        return
    if isinstance(start, int) != isinstance(end, int):
        return  # readings of two kinds (the name's history changed in between): no comparable pair
    wall_ms = stage.wall_ms
    if isinstance(start, bytes):
        try:
            s_cpu, s_rq = start.split()[:2]
            e_cpu, e_rq = end.split()[:2]
            cpu_ms = (int(e_cpu) - int(s_cpu)) / 1e6
            rq_ms = (int(e_rq) - int(s_rq)) / 1e6
        except (ValueError, AttributeError):
            return
        stage.runqueue_ms = round(max(0.0, rq_ms), 3)
    elif isinstance(start, int):  # thread CPU clock only: run-queue time stays inside blocked_ms
        cpu_ms, rq_ms = (end - start) / 1e6, 0.0
    else:
        return
    stage.cpu_ms = round(max(0.0, cpu_ms), 3)
    stage.blocked_ms = round(max(0.0, wall_ms - cpu_ms - rq_ms), 3)


class LagSeries:
    """(epoch ns, lag ms) samples, bounded by trimming the oldest half when full, so that a window query
    is a bisect plus a slice."""

    def __init__(self, max_samples: int = 8192) -> None:
        self._max = max_samples
        self._times: list[int] = []
        self._values: list[float] = []

    def __len__(self) -> int:
        return len(self._times)

    def extend_flat(self, flat: Sequence[Any]) -> None:
        """``(t0, v0, t1, v1, ...)`` as shipped; out-of-order or malformed pairs are skipped."""
        times, values = self._times, self._values
        for i in range(0, len(flat) - 1, 2):
            t, v = flat[i], flat[i + 1]
            if not isinstance(t, int) or not isinstance(v, (int, float)):
                continue
            if times and t < times[-1]:
                continue
            times.append(t)
            values.append(float(v))
        if len(times) > self._max:
            half = len(times) - self._max // 2
            del times[:half], values[:half]

    @property
    def times(self) -> list[int]:
        return self._times

    @property
    def values(self) -> list[float]:
        return self._values

    def window(self, start_ns: int, end_ns: int) -> list[float]:
        lo = bisect.bisect_left(self._times, start_ns)
        hi = bisect.bisect_right(self._times, end_ns)
        return self._values[lo:hi]


def gil_pressure_ms(
    series: LagSeries, start_ns: int, end_ns: int, period_s: float, min_samples: int = GIL_MIN_SAMPLES
) -> float | None:
    """Mean sampler wake-up lag within the trace's own window, or None (not measured) with fewer than
    ``min_samples`` wake-ups in it.

    A woken sampler either gets the GIL at once (~0.1 ms) or waits out a holder's switch interval (5 ms), so
    a few wake-ups already tell contention from a free GIL; one or two do not, and then the verdict does not
    guess between GIL contention and a lock wait. Only the request's own window counts: a look-back before
    it read a neighbour's load (a server's start-up, another request's burst) as this request's contention.
    """
    lags = series.window(start_ns, end_ns + int(period_s * 1e9))
    return round(statistics.fmean(lags), 3) if len(lags) >= min_samples else None


def max_loop_lag_ms(series: LagSeries, start_ns: int, end_ns: int) -> float | None:
    """The longest stall of the event loop that the request itself lived through, in ms.

    A sample ``(t, lag)`` says the loop could not run from ``t - lag`` to ``t`` (the monitor woke that
    late). Only the part of that stretch inside the request's window counts, so a stall that ended before
    the request began, or began after it ended, is not the request's. The first sample after the window is
    read too: the monitor reports a stall only once the loop is free again. None when no sample reaches the
    window (a short request between two wake-ups of the monitor: not measured, rather than a neighbour's).
    """
    times, values = series.times, series.values
    lo = bisect.bisect_left(times, start_ns)
    hi = min(len(times), bisect.bisect_right(times, end_ns) + 1)
    if lo >= hi:
        return None
    worst = 0
    for t, lag_ms in zip(times[lo:hi], values[lo:hi]):
        overlap = min(t, end_ns) - max(t - int(lag_ms * 1e6), start_ns)
        worst = max(worst, overlap)
    return round(worst / 1e6, 3)


def flatten(samples: Iterable[tuple[int, float]]) -> tuple[Any, ...]:
    out: list[Any] = []
    for t, v in samples:
        out.append(t)
        out.append(v)
    return tuple(out)


class LoopBlockSeries:
    """Sync stages that held an event loop, per loop thread, in the order they ended, so that the blocks
    overlapping a window are a bisect plus a short walk (blocks on one thread do not overlap). Bounded by
    dropping the oldest half of a thread's blocks when it holds ``max_blocks``."""

    def __init__(self, max_blocks: int = 8192) -> None:
        self._max = max_blocks
        self._ends: dict[int, list[int]] = {}
        self._blocks: dict[int, list[LoopBlock]] = {}

    def __len__(self) -> int:
        return sum(map(len, self._ends.values()))

    def extend(self, shipped: Sequence[Any]) -> None:
        """``((start, end, thread, trace_id, name), ...)`` as shipped; malformed entries are skipped."""
        for item in shipped:
            if not isinstance(item, (tuple, list)) or len(item) != 5:
                continue
            start, end, thread, trace_id, name = item
            if not all(isinstance(v, int) for v in (start, end, thread, trace_id)) or not isinstance(name, str):
                continue
            ends = self._ends.setdefault(thread, [])
            blocks = self._blocks.setdefault(thread, [])
            at = bisect.bisect_right(ends, end)
            ends.insert(at, end)
            blocks.insert(at, LoopBlock(start, end, thread, trace_id, name))
            if len(ends) > self._max:
                half = len(ends) - self._max // 2
                del ends[:half], blocks[:half]

    def overlapping(self, thread: int, start_ns: int, end_ns: int) -> list[LoopBlock]:
        ends = self._ends.get(thread)
        if not ends:
            return []
        blocks = self._blocks[thread]
        out = []
        for block in blocks[bisect.bisect_right(ends, start_ns) :]:
            if block.start_ns >= end_ns:
                break
            out.append(block)
        return out
