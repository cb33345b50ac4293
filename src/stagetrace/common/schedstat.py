"""Linux scheduler counters (``/proc/thread-self/schedstat``: on-CPU ns, run-queue ns, times scheduled in)
read back into what a stage or the event loop's thread lived: shared by the application's loop monitor
and the exporter's CPU figures. Pure."""

from __future__ import annotations

from typing import Any

from stagetrace.common.decimals import round_to

# A woken thread is off-CPU a little past its timer (timer slack, the wake-up path) and, in a GIL handoff, past
# the other thread's wake-up on another CPU, which on a virtual machine can take most of a millisecond
# (measured: a pure-Python stage beside a thread spinning in Python, 35.5 ms blocked in 6 schedulings, 5.9 ms a
# stretch, on one VM for minutes at a time; a 0.5 ms margin proved 8 ms of it "not the GIL"). The margin added
# to the GIL's switch interval before an off-CPU stretch counts as longer than any wait for the GIL.
GIL_WAIT_MARGIN_MS = 1.5


try:  # compiled by Cython, ``cython.compiled`` is True; from the sources it is False, or there is no Cython
    import cython

    _COMPILED = bool(cython.compiled)
except ImportError:
    _COMPILED = False

# A field of more digits is refused: no count the kernel keeps for a thread reaches it (10**18 ns is 31 years on a
# CPU), and compiled, a C long long holds every count of 18 digits.
_MAX_DIGITS = 18


def schedstat_delta(start: bytes, end: bytes) -> tuple[float, float, int | None]:
    """On-CPU ms, run-queue ms and times scheduled in (None where the kernel gives only two fields) between
    two reads of a thread's schedstat (each exact ``bytes``: the callers check); ValueError on anything else.

    Every stage of every trace comes here (two readings a stage). Compiled, a walk over the bytes in C
    integers reads them (``_fields_by_bytes``, typed by ``schedstat.pxd``: no list, no bytes object, no
    ``int()`` parse); from the sources, ``split`` and ``int`` do, which the interpreter runs faster than a walk.
    Both take the same readings and refuse the same (tests/test_signal_values.py holds them to each other)."""
    if _COMPILED:
        s0, s1, s2 = _fields_by_bytes(start)
        e0, e1, e2 = _fields_by_bytes(end)
    else:
        s0, s1, s2 = _fields_by_split(start)
        e0, e1, e2 = _fields_by_split(end)
    slices = e2 - s2 if s2 >= 0 and e2 >= 0 else None
    return (e0 - s0) / 1e6, (e1 - s1) / 1e6, slices


def _fields_by_split(reading: bytes) -> tuple[int, int, int]:
    """A reading's first three fields (the third -1 where there are two): whitespace-separated runs of at most
    ``_MAX_DIGITS`` ASCII digits; what follows the third is not read. ValueError on anything else."""
    fields = reading.split()
    n = len(fields)
    if n < 2:
        raise ValueError("a schedstat reading has at least two fields")
    first, second = fields[0], fields[1]
    third = fields[2] if n > 2 else b"0"
    for field in (first, second, third):
        if not field.isdigit() or len(field) > _MAX_DIGITS:
            raise ValueError(f"a schedstat field is a count: {field!r}")
    return int(first), int(second), int(third) if n > 2 else -1


def _fields_by_bytes(reading: bytes) -> tuple[int, int, int]:
    """``_fields_by_split`` by a walk over the bytes: slow in the interpreter, C arithmetic where compiled."""
    first = second = value = digits = field = 0
    third = -1
    n = len(reading)
    data = reading  # (compiled: the bytes' own buffer, read without a bounds check or a Python int a byte)
    for i in range(n + 1):
        byte = data[i] if i < n else 32  # a last field ends at whitespace too (no padded copy to allocate)
        if 48 <= byte <= 57:  # an ASCII digit
            if digits == _MAX_DIGITS:
                raise ValueError(f"a schedstat field is a count of at most {_MAX_DIGITS} digits")
            value = value * 10 + (byte - 48)
            digits += 1
        elif byte == 32 or 9 <= byte <= 13:  # ASCII whitespace, as ``bytes.split()`` takes it
            if digits:
                if field == 0:
                    first = value
                elif field == 1:
                    second = value
                else:
                    third = value
                    break  # what follows the third is not read
                field += 1
                value = digits = 0
        else:
            raise ValueError(f"a schedstat field is a count: {reading!r}")
    if field < 2:  # (a break above is at the third)
        raise ValueError("a schedstat reading has at least two fields")
    return first, second, third


def not_gil_ms(blocked_ms: float, slices: int, gil_wait_bound_ms: float) -> float:
    """The least of ``blocked_ms`` that cannot have been a wait for the GIL.

    A thread waiting for the GIL sleeps at most ``gil_wait_bound_ms`` at a stretch (the switch interval:
    ``_compat.gil_wait_stretch_bound_s``), and every stretch off the CPU ends with the thread scheduled in
    again, which schedstat counts (``slices``, at least one per stretch). So if the blocked time exceeds
    ``slices`` such stretches, one stretch at least was a wait of another kind (a lock, I/O, a sleep), and at
    most ``slices - 1`` were GIL waits: everything beyond those is not the GIL. A proof from the stage's own
    readings, however few wake-ups the GIL-pressure monitor took in its window; 0 when the readings are
    consistent with GIL waits alone. Where there is no GIL (``gil_wait_bound_ms`` 0), none of it was.
    """
    if gil_wait_bound_ms <= 0:
        return blocked_ms
    interval = gil_wait_bound_ms + GIL_WAIT_MARGIN_MS
    if slices < 1 or blocked_ms <= slices * interval:
        return 0.0
    return blocked_ms - (slices - 1) * interval


def loop_held_ms(
    lag_ms: float, elapsed_ms: float, interval_ms: float, start: Any, end: Any, gil_wait_bound_ms: float | None
) -> float | None:
    """How much of an event-loop stall work on the loop's own thread explains, from that thread's schedstat
    readings over the monitor's sleep (``elapsed_ms``, of which ``interval_ms`` was the sleep asked for).

    Work held the loop if its thread ran (on-CPU time) or sat in a blocking call (off the CPU in stretches
    longer than any GIL wait: ``not_gil_ms``). A thread that waited for the GIL or for a CPU did neither:
    the stall was the process starving the loop, not work on it. The monitor's own idle wait is a long
    stretch too, at most the interval, so the interval is taken off: a lower bound. None without schedstat
    slices or a known GIL bound (then the lag alone is what is known).
    """
    if type(start) is not bytes or type(end) is not bytes or gil_wait_bound_ms is None:  # (as resolve_cpu)
        return None
    try:
        cpu_ms, rq_ms, slices = schedstat_delta(start, end)
    except ValueError:
        return None
    if slices is None:
        return None
    blocked_ms = max(0.0, elapsed_ms - cpu_ms - rq_ms)
    in_calls_ms = not_gil_ms(blocked_ms, slices, gil_wait_bound_ms)
    return round_to(min(lag_ms, max(0.0, cpu_ms + in_calls_ms - interval_ms)), 3)
