"""Process signals joined to traces in the exporter: CPU figures from a stage's raw clock readings, and the
GIL-pressure and event-loop-lag series that the application's samplers ship as (time, value) pairs.

Pure bookkeeping: no threads, no clocks of its own; the exporter feeds it and asks windows of it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from typing import Any

from stagetrace.analysis.causes import blocked_enough
from stagetrace.analysis.loopwait import LoopBlock
from stagetrace.analysis.signals import ProcessLoad, TraceSignals
from stagetrace.analysis.thresholds import DiagnosisThresholds
from stagetrace.common.decimals import round_to
from stagetrace.common.schedstat import not_gil_ms, schedstat_delta
from stagetrace.settings import GIL_MIN_SAMPLES, MIN_CPU_ACCOUNTED_NS

try:  # compiled by Cython, ``cython.compiled`` is True; from the sources it is False, or there is no Cython
    import cython

    _COMPILED = bool(cython.compiled)
except ImportError:
    _COMPILED = False

# A series' times are epoch ns in [0, 2**63), what OTLP's own timestamps hold (``LagSeries`` skips a sample past
# them as malformed): compiled, the window searches compare them as C long longs (``index_left``).
TIME_END_NS = 1 << 63

GIL_SERIES = "gil"
RUN_QUEUE_SERIES = "runqueue"  # the GIL monitor's run-queue wait per wake-up
LOOP_SERIES = "loop"
LOOP_HELD_SERIES = "loopheld"  # per loop-lag wake-up: the part of the stall work on the loop's thread explains
# At the GIL monitor's reads of the process's totals (capture.cpu.ProcessSchedTotals), cumulative ms: the other
# threads' run-queue wait so far, and every thread's on-CPU time so far.
PROCESS_RUN_QUEUE_SERIES = "procrq"
PROCESS_CPU_SERIES = "proccpu"
IN_FLIGHT_SERIES = "inflight"  # at the same reads: the traces in flight
SERIES = (
    GIL_SERIES,
    RUN_QUEUE_SERIES,
    LOOP_SERIES,
    LOOP_HELD_SERIES,
    PROCESS_RUN_QUEUE_SERIES,
    PROCESS_CPU_SERIES,
    IN_FLIGHT_SERIES,
)


def resolve_cpu(stage: Any, gil_wait_bound_ms: float | None = None) -> None:
    """Turn a stage's two raw readings (schedstat bytes, or thread CPU ns) into cpu_ms / runqueue_ms /
    blocked_ms, and not_gil_ms where schedstat counts slices and ``gil_wait_bound_ms`` is known. Only stages
    of at least 1 ms: below that the split is scheduler noise, no rule looks at it, and each attribute costs
    encoding on every span."""
    start, end = stage.cpu_start, stage.cpu_end
    kind = type(start)
    if start is None or kind is not type(end):
        return  # no pair, or readings of two kinds (the name's history changed in between): none comparable
    wall_ns = stage.end_ns - stage.start_ns
    if wall_ns < MIN_CPU_ACCOUNTED_NS:
        return
    # (every stage of every trace comes through here: comparisons, not max(), and one rounding a figure)
    wall_ms = stage.wall_ms if stage.compressed is not None else wall_ns / 1e6
    cpu_ms: float
    rq_ms: float
    slices: int | None = None
    if kind is bytes:
        try:
            cpu_ms, rq_ms, slices = schedstat_delta(start, end)
        except (ValueError, AttributeError, IndexError):
            return
        if rq_ms < 0:
            rq_ms = 0.0
        stage.runqueue_ms = round_to(rq_ms, 3)
    elif kind is int:  # thread CPU clock only: run-queue time stays inside blocked_ms
        cpu_ms, rq_ms = (end - start) / 1e6, 0.0
    else:
        return
    if cpu_ms < 0:
        cpu_ms = 0.0
    stage.cpu_ms = round_to(cpu_ms, 3)
    blocked = wall_ms - cpu_ms - rq_ms
    stage.blocked_ms = blocked = round_to(blocked, 3) if blocked > 0 else 0.0
    if slices is not None and gil_wait_bound_ms is not None:
        stage.not_gil_ms = round_to(not_gil_ms(blocked, slices, gil_wait_bound_ms), 3)


def resolve_stages(
    stages: Sequence[Any],
    series: Mapping[str, LagSeries],
    offset_ns: int,
    gil_wait_bound_ms: float | None,
    th: DiagnosisThresholds,
) -> None:
    """The stages' CPU figures from their raw readings (``resolve_cpu``), and the other threads' time beside
    each that the blocked-cause rules look at (``resolve_others``: two window queries a stage, so only for
    the stages those rules judge; on the others, every trace would pay them)."""
    run_queue, cpu = series[PROCESS_RUN_QUEUE_SERIES], series[PROCESS_CPU_SERIES]
    for stage in stages:
        resolve_cpu(stage, gil_wait_bound_ms)
        # a worker's stage: this process's other threads were not beside it (its own process was)
        if stage.blocked_ms and stage.worker_pid is None and blocked_enough(stage, th):
            resolve_others(stage, run_queue, cpu, offset_ns)


def resolve_others(stage: Any, run_queue: LagSeries, cpu: LagSeries, offset_ns: int) -> None:
    """Set a blocked stage's ``others_runqueue_ms`` and ``others_cpu_ms``: the process's other threads'
    run-queue wait and on-CPU time from the GIL monitor's last reading before the stage to its first one
    after (so never less than over the stage itself), less the stage's own. Each is left None when no pair of
    readings brackets the stage. The exporter asks it for the stages the blocked-cause rules look at."""
    if not stage.blocked_ms:  # blocked stages only: both bound blocked time
        return
    start_ns, end_ns = stage.start_ns + offset_ns, stage.end_ns + offset_ns
    if len(run_queue) and (total := cumulative_change(run_queue, start_ns, end_ns)) is not None:
        stage.others_runqueue_ms = round_to(max(0.0, total - (stage.runqueue_ms or 0.0)), 3)
    if len(cpu) and (total := cumulative_change(cpu, start_ns, end_ns)) is not None:
        stage.others_cpu_ms = round_to(max(0.0, total - (stage.cpu_ms or 0.0)), 3)


def index_left(times: list[int], at_ns: int) -> int:
    """``bisect_left(times, at_ns)`` over a series' times. Compiled, a C loop reading them as C long longs, that
    gallops back from the series' end before it bisects: a trace's windows lie among the last few samples (they
    arrive as it finishes), where a bisect would start from the middle of the series. (A call of the stdlib's
    bisect from compiled code, a Python comparison a step, cost about 1 k instructions, and a trace asks for
    fourteen window bounds.) ``at_ns`` may be any int (a trace's own times are not bounded)."""
    if not _COMPILED:
        return bisect_left(times, at_ns)
    lo, hi, step = 0, len(times), 1
    if at_ns < 0:
        return 0
    if at_ns >= TIME_END_NS:
        return hi
    at = at_ns
    while hi - step > 0:  # every time from hi on is at or past ``at``
        t = times[hi - step]
        if t < at:
            lo = hi - step + 1
            break
        hi -= step
        step <<= 1
    while lo < hi:
        mid = (lo + hi) >> 1
        t = times[mid]
        if t < at:
            lo = mid + 1
        else:
            hi = mid
    return lo


def index_right(times: list[int], at_ns: int) -> int:
    """``bisect_right(times, at_ns)`` over a series' times: over ints, the first past ``at_ns`` is the first at
    or past ``at_ns + 1`` (``index_left``'s search, compiled)."""
    if not _COMPILED:
        return bisect_right(times, at_ns)
    return index_left(times, at_ns + 1)


def cumulative_change(series: LagSeries, start_ns: int, end_ns: int) -> float | None:
    """How much a cumulative series grew from its last sample at or before ``start_ns`` to its first at or
    after ``end_ns``; None without both."""
    times = series._times
    before = index_right(times, start_ns) - 1
    after = index_left(times, end_ns)
    if before < 0 or after >= len(times):
        return None
    values = series._values
    grew = values[after] - values[before]
    return grew if grew > 0.0 else 0.0


def _nearest(times: list[int], at_ns: int, tolerance_ns: int, *, start: bool) -> int | None:
    """The index of the reading that stands for ``at_ns``: the one on the window's outer side (the last at or
    before a start, the first at or after an end), unless the one just inside is within ``tolerance_ns`` of
    it and nearer: a process idle before a burst (no trace in flight, no readings) or after it would
    otherwise spread the window's CPU use over the idle time."""
    if start:
        outer = index_right(times, at_ns) - 1
        inner = outer + 1
    else:
        outer = index_left(times, at_ns)
        inner = outer - 1
    n = len(times)
    found = outer if 0 <= outer < n else None
    if 0 <= inner < n:
        distance = abs(times[inner] - at_ns)
        # the inner one only if strictly nearer (a tie: the outer one)
        if distance <= tolerance_ns and (found is None or distance < abs(times[outer] - at_ns)):
            found = inner
    return found


def process_load(
    cpu: LagSeries, run_queue: LagSeries, in_flight: LagSeries, start_ns: int, end_ns: int, cpus: int | None
) -> ProcessLoad | None:
    """What the process asked of the host's CPUs over a window: between the GIL monitor's readings that stand
    for its start and its end (``_nearest``), the CPUs its threads used (on-CPU time over the span), the threads
    running or queued for a CPU on average (on-CPU plus run-queue time over the span: the monitor's own run
    queue left out, as it was read), and the traces in flight at those readings, on average. None without
    such readings (a span under half the window's, or over twice it plus 50 ms, says too little of it), or
    without the CPU count."""
    if cpus is None or not len(cpu):  # (no run-queue readings: cumulative_change below says None)
        return None
    times = cpu.times
    window_ns = end_ns - start_ns
    tolerance_ns = max(2_000_000, window_ns // 4)
    first = _nearest(times, start_ns, tolerance_ns, start=True)
    last = _nearest(times, end_ns, tolerance_ns, start=False)
    if first is None or last is None or last <= first:
        return None
    span_ns = times[last] - times[first]
    if span_ns < window_ns / 2 or span_ns > 2 * window_ns + 50_000_000:
        return None
    span_ms = span_ns / 1e6
    used_ms = max(0.0, cpu.values[last] - cpu.values[first])
    queued_ms = cumulative_change(run_queue, times[first], times[last])
    if queued_ms is None:
        return None
    counts = in_flight.window(times[first], times[last])
    # (positional, in the fields' order: keyword construction runs the named tuple's Python __new__)
    return _new_load(
        ProcessLoad,
        (
            cpus,
            round_to(used_ms / span_ms, 3),
            round_to((used_ms + queued_ms) / span_ms, 3),
            round_to(sum(counts) / len(counts), 2) if counts else None,
        ),
    )


_new_load = tuple.__new__


_EXACT_INT = frozenset({int})  # exact types: a bool or an int subclass goes the checked way
_EXACT_NUMBER = frozenset({int, float})


def trace_signals(
    series: Mapping[str, LagSeries],
    start_ns: int,
    end_ns: int,
    period_s: float,
    gil_wait_bound_ms: float | None,
    cpus: int | None,
    gpu_utilization: Any,
    blocked_by: tuple[str, ...],
) -> TraceSignals:
    """The process's signals over a trace's window (epoch ns), from the series its samplers shipped: what the
    diagnosis rules read beside the stages (the stream's summary is the caller's, where the response streamed).
    ``period_s``: the GIL monitor's; ``gil_wait_bound_ms``: the longest a GIL wait lasts, where known."""
    gil, run_queue = series[GIL_SERIES], series[RUN_QUEUE_SERIES]
    loop, held = series[LOOP_SERIES], series[LOOP_HELD_SERIES]
    load = process_load(
        series[PROCESS_CPU_SERIES], series[PROCESS_RUN_QUEUE_SERIES], series[IN_FLIGHT_SERIES], start_ns, end_ns, cpus
    )
    # (positional, in the fields' order: keyword construction runs the named tuple's Python __new__)
    return _new_signals(
        TraceSignals,
        (
            gpu_utilization if isinstance(gpu_utilization, (int, float)) else None,
            sampler_mean_ms(gil, start_ns, end_ns, period_s, GIL_MIN_SAMPLES, gil_wait_bound_ms)
            if gil._times
            else None,
            sampler_mean_ms(run_queue, start_ns, end_ns, period_s) if run_queue._times else None,
            max_loop_lag_ms(loop, start_ns, end_ns) if loop._times else None,
            max_loop_lag_ms(held, start_ns, end_ns) if held._times else None,
            blocked_by,
            None,  # stream
            load,
        ),
    )


_new_signals = tuple.__new__


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
        """``(t0, v0, t1, v1, ...)`` as shipped; out-of-order or malformed pairs (a time outside [0, 2**63): see
        ``TIME_END_NS``) are skipped."""
        times, values = self._times, self._values
        if _COMPILED:  # a pair at a time is a C loop here (signals.pxd), cheaper than the checks below
            self._extend_checked(flat)
            self._trim()
            return
        new_times, new_values = flat[0::2], flat[1::2]
        floats = None
        if (
            len(new_times) == len(new_values)
            and _EXACT_INT.issuperset(map(type, new_times))
            and _EXACT_NUMBER.issuperset(map(type, new_values))
            and (not times or not new_times or new_times[0] >= times[-1])
            and all(map(int.__le__, new_times, new_times[1:]))
            and (not new_times or (new_times[0] >= 0 and new_times[-1] < TIME_END_NS))
        ):
            # As the samplers ship them, every wake-up of each (one message a series a helper-thread pass):
            # checked and appended in C, not a pair at a time.
            try:
                floats = list(map(float, new_values))
            except OverflowError:  # an int no float holds: a malformed pair, which the checked way skips
                pass
        if floats is None:
            self._extend_checked(flat)
        else:
            times.extend(new_times)
            values.extend(floats)
        self._trim()

    def _trim(self) -> None:
        times = self._times
        if len(times) > self._max:
            half = len(times) - self._max // 2
            del times[:half], self._values[:half]

    def _extend_checked(self, flat: Sequence[Any]) -> None:
        times, values = self._times, self._values
        for i in range(0, len(flat) - 1, 2):
            t, v = flat[i], flat[i + 1]
            if not isinstance(t, int) or not isinstance(v, (int, float)):
                continue
            if t < 0 or t >= TIME_END_NS or (times and t < times[-1]):
                continue
            try:
                value = float(v)
            except OverflowError:
                continue
            times.append(t)
            values.append(value)

    @property
    def times(self) -> list[int]:
        return self._times

    @property
    def values(self) -> list[float]:
        return self._values

    def window(self, start_ns: int, end_ns: int) -> list[float]:
        times = self._times
        return self._values[index_left(times, start_ns) : index_right(times, end_ns)]


def sampler_mean_ms(
    series: LagSeries,
    start_ns: int,
    end_ns: int,
    period_s: float,
    min_samples: int = GIL_MIN_SAMPLES,
    proof_ms: float | None = None,
) -> float | None:
    """Mean of the GIL monitor's wake-ups (their GIL wait, or their run-queue wait) within the trace's own
    window, or None (not measured) with fewer than ``min_samples`` wake-ups in it, unless those few waited
    ``min_samples`` periods or more between them, or one of them waited ``proof_ms`` (for the GIL: a whole
    switch interval, which only a holder running Python through its interval makes a waiter wait).

    A woken sampler either gets the GIL at once (reads zero) or waits out a holder's switch interval (5 ms), so
    a few wake-ups already tell contention from a free GIL; one or two do not, and then the verdict does not
    guess between GIL contention and a lock wait. Only the request's own window counts: a look-back before
    it read a neighbour's load (a server's start-up, another request's burst) as this request's contention.
    """
    times, values = series._times, series._values
    n = len(times)
    lo = index_left(times, start_ns)
    hi = index_right(times, end_ns + int(period_s * 1e9))
    # Later wake-ups whose wait began inside the window are the request's too: a sampler held back for long
    # (the GIL or the CPUs taken for the whole request) reports only once it gets through.
    while hi < n and times[hi] - values[hi] * 1e6 <= end_ns:
        hi += 1
    if hi <= lo:
        return None
    # the wake-ups' sum, left to right (as ``sum`` adds floats before Python 3.12, whose compensated sum may
    # differ in the last bit: both builds add the same way here), and the longest as ``max`` gives it; a loop,
    # on C doubles where compiled
    total = 0.0
    longest = values[lo]
    for i in range(lo, hi):
        lag = values[i]
        total += lag
        if lag > longest:
            longest = lag
    # Few wake-ups that waited long are a measurement too: a free GIL cannot hold a sampler back for periods.
    measured = (
        hi - lo >= min_samples
        or total >= min_samples * period_s * 1e3
        or (proof_ms is not None and longest >= proof_ms)
    )
    return round_to(total / (hi - lo), 3) if measured else None


def max_loop_lag_ms(series: LagSeries, start_ns: int, end_ns: int) -> float | None:
    """The longest stall of the event loop that the request itself lived through, in ms.

    A sample ``(t, lag)`` says the loop could not run from ``t - lag`` to ``t`` (the monitor woke that
    late). Only the part of that stretch inside the request's window counts, so a stall that ended before
    the request began, or began after it ended, is not the request's. The first sample after the window is
    read too: the monitor reports a stall only once the loop is free again. None when no sample reaches the
    window (a short request between two wake-ups of the monitor: not measured, rather than a neighbour's).
    """
    times, values = series._times, series._values
    lo = index_left(times, start_ns)
    hi = min(len(times), index_right(times, end_ns) + 1)
    if lo >= hi:
        return None
    worst = 0
    for i in range(lo, hi):
        t = times[i]
        began = t - int(values[i] * 1e6)
        held = (t if t < end_ns else end_ns) - (began if began > start_ns else start_ns)
        if held > worst:
            worst = held
    return round_to(worst / 1e6, 3)


class LoopBlockSeries:
    """Sync stages that held an event loop, per loop thread, in the order they ended, so that the blocks
    overlapping a window are a bisect plus a short walk (blocks on one thread do not overlap). Bounded by
    dropping the oldest half of a thread's blocks when it holds ``max_blocks``."""

    def __init__(self, max_blocks: int = 8192) -> None:
        self._max = max_blocks
        self._ends: dict[int, list[int]] = {}
        self._blocks: dict[int, list[LoopBlock]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count  # (asked for every trace: kept, not summed over the threads)

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
            at = bisect_right(ends, end)
            ends.insert(at, end)
            blocks.insert(at, LoopBlock(start, end, thread, trace_id, name))
            self._count += 1
            if len(ends) > self._max:
                half = len(ends) - self._max // 2
                del ends[:half], blocks[:half]
                self._count -= half

    def overlapping(self, thread: int, start_ns: int, end_ns: int) -> list[LoopBlock]:
        ends = self._ends.get(thread)
        if not ends:
            return []
        blocks = self._blocks[thread]
        out = []
        for block in blocks[bisect_right(ends, start_ns) :]:
            if block.start_ns >= end_ns:
                break
            out.append(block)
        return out
