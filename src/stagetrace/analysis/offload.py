"""Work handed to another process (a process pool), read as what the request lived: the wait for a worker,
the arguments' way there, the worker's own time, the result's way back.

Pure: the offload's readings as captured (``capture/offload.py`` in the application, ``capture/worker.py``
in the worker, both on the host's monotonic clock, which every process reads alike) in, the four stretches
out. The worker's idle time before the task tells queueing from transfer: the task's bytes sat in the pipe
either because no worker was free (queueing) or on their way to one that was (transfer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from stagetrace import conventions as c

QUEUE, SEND, RUN, RETURN = c.OFFLOAD_QUEUE_STAGE, c.OFFLOAD_SEND_STAGE, c.OFFLOAD_RUN_STAGE, c.OFFLOAD_RETURN_STAGE
CHILD_KINDS = {QUEUE: "wait", SEND: "io", RUN: "cpu", RETURN: "io"}  # in the order they happen


class OffloadFields(NamedTuple):
    """One offloaded call as it crosses the channel (perf-counter ns), in this order. None: not measured (the
    worker never reported: it died, or the call failed before it ran)."""

    executor: str  # "ProcessPoolExecutor", "multiprocessing.Pool"
    max_workers: int | None
    in_flight: int  # calls in the pool at submission, this one included
    start_method: str | None  # fork, spawn, forkserver
    run_span_id: int  # the span the worker's own stages nest under (offload.run)
    submitted_ns: int  # on the request's thread
    pickle_start_ns: int | None  # the arguments' serialisation, on a pool thread of this process
    pickle_end_ns: int | None
    args_bytes: int | None
    worker_pid: int | None
    worker_task_seq: int | None  # 1: the worker's first task
    worker_started_ns: int | None  # when the worker process started
    worker_idle_ns: int | None  # when the worker was last free before this task (its previous task's end)
    run_start_ns: int | None  # ... and began running it
    run_end_ns: int | None
    run_cpu_start: Any  # the worker thread's CPU readings around the run (as a stage's cpu_start / cpu_end)
    run_cpu_end: Any
    result_bytes: int | None


_INT_OR_NONE = (
    "max_workers",
    "pickle_start_ns",
    "pickle_end_ns",
    "args_bytes",
    "worker_pid",
    "worker_task_seq",
    "worker_started_ns",
    "worker_idle_ns",
    "run_start_ns",
    "run_end_ns",
    "result_bytes",
)


def offload_fields(value: Any) -> OffloadFields | None:
    """A shipped offload tuple as ``OffloadFields``; a clear error for one of the wrong shape."""
    if value is None or isinstance(value, OffloadFields):
        return value
    if not isinstance(value, tuple) or len(value) != len(OffloadFields._fields):
        raise ValueError("malformed offload record")
    fields = OffloadFields(*value)
    if not isinstance(fields.executor, str) or not all(
        type(v) is int for v in (fields.in_flight, fields.run_span_id, fields.submitted_ns)
    ):
        raise ValueError("malformed offload record")
    if not all(getattr(fields, name) is None or type(getattr(fields, name)) is int for name in _INT_OR_NONE):
        raise ValueError("malformed offload record")
    if fields.start_method is not None and not isinstance(fields.start_method, str):
        raise ValueError("malformed offload record")
    return fields


class OffloadInfo(NamedTuple):
    """What the offload stage's span says of the call (``conventions.OFFLOAD_FIELDS``) and the rules read."""

    executor: str
    max_workers: int | None = None
    in_flight: int | None = None
    args_bytes: int | None = None
    result_bytes: int | None = None
    start_method: str | None = None
    worker_pid: int | None = None
    worker_task_seq: int | None = None


def offload_info(fields: OffloadFields) -> OffloadInfo:
    return OffloadInfo(
        fields.executor,
        fields.max_workers,
        fields.in_flight,
        fields.args_bytes,
        fields.result_bytes,
        fields.start_method,
        fields.worker_pid,
        fields.worker_task_seq,
    )


class OffloadSplit(NamedTuple):
    """The call's four stretches, back to back from submission to the result's arrival, (start, end) ns
    each: ``queue`` the wait for a worker, ``send`` the arguments' serialisation, transfer and
    deserialisation, ``run`` the worker's time, ``ret`` the result's way back."""

    queue: tuple[int, int]
    send: tuple[int, int]
    run: tuple[int, int]
    ret: tuple[int, int]


def split_offload(f: OffloadFields, done_ns: int) -> OffloadSplit | None:
    """The stretches of a call that ended at ``done_ns`` (the result read back, or the failure seen), or None
    where the worker never reported (no run to place). Worker readings outside the call (clocks that are not
    one, a report of another call) are clamped into it, in order.

    The serialisation happened on a pool thread while the call may still have queued; its length counts
    as ``send``, and so does everything from when a worker was free to read the bytes (the later of the
    serialisation's end and the worker's previous task's end) to the run's start: their time in the pipe
    and their deserialisation in the worker. The rest of the wait before the run is ``queue``."""
    if f.run_start_ns is None or f.run_end_ns is None:
        return None
    start = f.submitted_ns
    end = max(done_ns, start)

    def within(t: int) -> int:
        return min(max(t, start), end)

    run_start = within(f.run_start_ns)
    run_end = max(within(f.run_end_ns), run_start)
    pickling = 0
    ready = start
    if f.pickle_start_ns is not None and f.pickle_end_ns is not None:
        pickling = max(0, f.pickle_end_ns - f.pickle_start_ns)
        ready = max(ready, f.pickle_end_ns)
    if f.worker_idle_ns is not None:
        ready = max(ready, f.worker_idle_ns)
    send_ns = min(run_start - start, pickling + max(0, run_start - ready))
    queue_end = run_start - send_ns
    return OffloadSplit((start, queue_end), (queue_end, run_start), (run_start, run_end), (run_end, end))


class OffloadedCall(NamedTuple):
    """An offload stage as the rules read it: its facts and its children's times (ms, 0 for a child it lacks)."""

    name: str
    info: OffloadInfo
    queue_ms: float
    send_ms: float
    run_ms: float
    return_ms: float
    reported: bool = True  # its worker reported (its children were placed): the times above were measured

    @property
    def saturated(self) -> bool:
        """Every worker was busy when it was submitted (it found more calls than workers, itself included)."""
        i = self.info
        return i.in_flight is not None and i.max_workers is not None and i.in_flight > i.max_workers

    @property
    def transfer_ms(self) -> float:
        return self.send_ms + self.return_ms

    @property
    def payload_bytes(self) -> int:
        return max(self.info.args_bytes or 0, self.info.result_bytes or 0)


def offload_calls(stages: Sequence[Any]) -> list[OffloadedCall]:
    """The trace's offload stages with their children's times (a stage has ``offload``, its children name it
    as their parent stage)."""
    calls = [st for st in stages if st.offload is not None and isinstance(st.offload, OffloadInfo)]
    if not calls:
        return []
    children: dict[int, dict[str, float]] = {st.span_id: {} for st in calls}
    for st in stages:
        times = children.get(st.parent_stage_id)
        if times is not None and st.name in CHILD_KINDS:
            times[st.name] = times.get(st.name, 0.0) + max(0, st.end_ns - st.start_ns) / 1e6
    out = []
    for st in calls:
        t = children[st.span_id]
        out.append(
            OffloadedCall(
                st.name,
                st.offload,
                t.get(QUEUE, 0.0),
                t.get(SEND, 0.0),
                t.get(RUN, 0.0),
                t.get(RETURN, 0.0),
                RUN in t,
            )
        )
    return out


__all__ = [
    "CHILD_KINDS",
    "QUEUE",
    "RETURN",
    "RUN",
    "SEND",
    "OffloadFields",
    "OffloadInfo",
    "OffloadSplit",
    "OffloadedCall",
    "offload_calls",
    "offload_fields",
    "offload_info",
    "split_offload",
]
