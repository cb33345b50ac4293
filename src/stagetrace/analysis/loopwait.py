"""The event-loop wait: the part of a request's time when its event loop was busy running other requests'
synchronous stages and the request itself was in none of its own stages.

A stage that runs synchronously on the loop thread holds the loop for its whole duration; every other
request on that loop that was ready to run then had to wait. The request's own stages are its own time
(a stage on a worker thread is work, not waiting), so what is left inside its window, under another
request's blocking stage, is time it spent waiting for the loop. Pure interval arithmetic: no clocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


class LoopBlock(NamedTuple):
    """A synchronous stage that held an event loop (perf-counter ns of its process)."""

    start_ns: int
    end_ns: int
    thread: int  # the loop's thread
    trace_id: int
    name: str


def blocker_entry(stage: str, trace_id: str) -> str:
    """An entry of ``stagetrace.blocked_by``: ``stage@trace_id`` (the trace id in hex)."""
    return f"{stage}@{trace_id}"


def split_blocker(entry: str) -> tuple[str, str]:
    """``(stage, trace_id)`` of a ``blocked_by`` entry; a stage name may hold an ``@``, a trace id not."""
    stage, _, trace_id = entry.rpartition("@")
    return stage, trace_id


@dataclass(frozen=True, slots=True)
class LoopWait:
    """One stretch of a request waiting for its loop, and what held the loop meanwhile (longest first)."""

    start_ns: int
    end_ns: int
    blockers: tuple[tuple[str, int, int], ...] = field(default=())  # (stage name, trace id, ns held)


def _merge(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for s, e in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(e, merged[-1][1]))
        else:
            merged.append((s, e))
    return merged


def _subtract(intervals: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``intervals`` minus ``holes``, both merged and sorted."""
    out: list[tuple[int, int]] = []
    j = 0
    for s, e in intervals:
        while j < len(holes) and holes[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(holes) and holes[k][0] < e:
            hs, he = holes[k]
            if hs > cur:
                out.append((cur, hs))
            cur = max(cur, he)
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def loop_waits(
    window: tuple[int, int],
    own_stages: Iterable[tuple[int, int]],
    blocks: Sequence[LoopBlock],
    trace_id: int,
    *,
    min_ns: int = 0,
) -> list[LoopWait]:
    """The stretches of ``window`` covered by other traces' blocking stages and by none of ``own_stages``.

    Stretches shorter than ``min_ns`` are dropped (scheduling noise between two blockers); each stretch
    names the blocks that overlap it, with how long each held the loop within it.
    """
    start, end = window
    others = [b for b in blocks if b.trace_id != trace_id and b.end_ns > start and b.start_ns < end]
    if not others:
        return []
    busy = _merge((max(b.start_ns, start), min(b.end_ns, end)) for b in others)
    waiting = _subtract(busy, _merge(own_stages))
    out = []
    for s, e in waiting:
        if e - s < min_ns:
            continue
        held = [(b.name, b.trace_id, min(e, b.end_ns) - max(s, b.start_ns)) for b in others]
        blockers = tuple(sorted((h for h in held if h[2] > 0), key=lambda h: -h[2]))
        out.append(LoopWait(s, e, blockers))
    return out


class Arrival(NamedTuple):
    """When a request reached its server (perf-counter ns), and, when only a bound is known of how long its
    bytes waited before that, the bound. (A named tuple made through ``tuple.__new__``: the exporter makes one
    for every trace served on an event loop, where a frozen dataclass's ``__init__`` and a named tuple's own
    ``__new__`` are Python code.)"""

    start_ns: int
    bound_ns: int | None = None


_new_arrival = tuple.__new__


def request_arrival(
    task_created_ns: int,
    received_ms_ago: int,
    blocks: Sequence[LoopBlock],
    trace_id: int,
    *,
    adjacent_ns: int,
) -> Arrival:
    """The arrival of a request whose task was created at ``task_created_ns``.

    ``received_ms_ago`` (the socket's own reading at that moment, ms, -1 if none) moves the arrival back to
    the bytes' arrival when other requests' blocks held the loop in between: the loop could not read them.
    Otherwise the loop read them at once and a reading of a few ms is the clock's grain, not a wait. With no
    reading, the blocks that ended just before the task was created (each within ``adjacent_ns`` of the next)
    bound how long the bytes may have waited: reported as a bound, never counted as a stage.
    """
    others = [b for b in blocks if b.trace_id != trace_id and b.start_ns < task_created_ns]
    if received_ms_ago >= 0:
        received = task_created_ns - received_ms_ago * 1_000_000
        for b in others:  # (a loop: compiled, a generator in any() is an object and a resumption a block)
            if b.end_ns > received:
                return _new_arrival(Arrival, (received, None))
        return _new_arrival(Arrival, (task_created_ns, None))
    edge, earliest = task_created_ns, None
    for b in sorted(others, key=lambda b: -b.end_ns):
        if edge - b.end_ns > adjacent_ns:
            break
        earliest = b.start_ns if earliest is None else min(earliest, b.start_ns)
        edge = min(edge, b.start_ns)
    return _new_arrival(Arrival, (task_created_ns, None if earliest is None else task_created_ns - earliest))
