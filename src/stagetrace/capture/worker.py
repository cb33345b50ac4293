"""A process pool's worker, running a call a traced request handed it (``capture/offload.py``).

The worker runs no SDK, no thread and no exporter. During the call, stagetrace's capture runs against a
``WorkerRuntime``: the call's stages (``stagetrace.stage()``, automatic stages) fold and are bounded as on the
request path, into a trace record of the call alone, under the request's trace id and the ``offload.run``
span; after it they travel back with the result (or the exception) as wire tuples. Outside a call the worker
records nothing: a worker forked from a configured process drops the runtime it inherited, which would
otherwise start an exporter of its own and export the worker's stages as rootless traces.
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

from opentelemetry.context import Context, attach, detach
from opentelemetry.trace import NoOpTracer, TraceFlags, set_span_in_context

from stagetrace import _state
from stagetrace.capture.cpu import CpuSignals
from stagetrace.capture.records import StageRecord, TraceRecord, pack_stages
from stagetrace.capture.stage import describe_exception
from stagetrace.conventions import OFFLOAD_RUN_STAGE

_perf_ns = time.perf_counter_ns
_thread_time_ns = time.thread_time_ns


class Ticket(NamedTuple):
    """What a call carries to its worker: which call (``call_id``, of the process ``parent_pid``), the
    context as W3C traceparent fields (never pickled OpenTelemetry objects), and how the request path
    records (its stage bound, whether it reads CPU clocks)."""

    call_id: int
    parent_pid: int
    trace_id: int
    run_span_id: int
    trace_flags: int
    max_stages: int
    cpu_signals: bool


class Report(NamedTuple):
    """What the worker says of a call, back with its result or exception (perf-counter ns, the host's
    monotonic clock: the parent reads the same one)."""

    call_id: int
    parent_pid: int
    worker_pid: int
    task_seq: int  # 1: the worker's first task
    started_ns: int  # when the worker process started
    idle_ns: int  # when the worker was last free before this task
    run_start_ns: int
    run_end_ns: int
    cpu_start: Any
    cpu_end: Any
    stages: tuple[tuple[Any, ...], ...]  # the call's own stages, as wire tuples
    dropped_stages: int  # past the stage bound, or left running past the call
    error: tuple[str, str, str] | None  # the call raised: type, message, traceback


class WorkerRuntime:
    """What capture reads of a runtime (``capture.records.CaptureRuntime``), in a worker during one call: the
    call's trace record is the only one it knows; what would be shipped is counted as lost."""

    tracer = NoOpTracer()  # a stage in a thread the call started without its context opens no root here
    gpu = None

    def __init__(self, max_stages: int, cpu_signals: bool) -> None:
        self.max_stages_per_trace = max_stages
        self.cpu_signals = CpuSignals() if cpu_signals else None
        self.recent_stage_ms: dict[str, float] = {}
        # The call's trace record, the only one it knows: a dict's own get is the lookup, as on the request
        # path (a method of this class would cost a stage a Python call).
        self._current: dict[int, TraceRecord] = {}
        self.lookup_trace = self._current.get
        self.lost = 0
        self.shipper = self.metrics = self.loop_blocks = self

    def begin(self, trace: TraceRecord) -> None:
        self._current.clear()
        self._current[trace.trace_id] = trace

    def end(self) -> None:
        self._current.clear()

    def submit_lone_stage(self, rec: Any) -> None:
        self.lost += 1  # outside the call: no request to tell

    def dropped(self, reason: str, count: int = 1) -> None:
        self.lost += count

    def put(self, block: Any) -> None:
        """A loop block: no request of this process waits on a worker's event loop."""

    def requests_on_loop(self, thread: int) -> int:
        return 0


class WorkerProcess:
    """This process as a pool's worker: its pid, when it started, its tasks so far and when it was last free
    (exact where its task queue is watched: every task counted, free from each wait for the next; else the
    traced calls only, free from the last result sent), its runtime."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.started_ns = process_started_ns()
        self.tasks = 0
        self.watched = False
        self.idle_since_ns = _perf_ns()
        self._runtime: WorkerRuntime | None = None

    def runtime(self, max_stages: int, cpu_signals: bool) -> WorkerRuntime:
        rt = self._runtime
        if rt is None or rt.max_stages_per_trace != max_stages or (rt.cpu_signals is not None) != cpu_signals:
            rt = self._runtime = WorkerRuntime(max_stages, cpu_signals)
        return rt


_worker: WorkerProcess | None = None


def enter_worker_mode() -> WorkerProcess:
    """This process is a pool's worker from now on: the runtime it inherited by fork (its parent's) stands down
    (no exporter, no rootless traces), and capture records only during the calls a request handed it."""
    global _worker
    worker = _worker
    if worker is not None and worker.pid == os.getpid():
        return worker
    inherited = _state.runtime
    if inherited is not None and not isinstance(inherited, WorkerRuntime):
        stand_down = getattr(inherited, "stand_down", None)
        if stand_down is not None:
            stand_down()
    _state.runtime = None
    worker = _worker = WorkerProcess()
    return worker


def watch_task_queue(worker: WorkerProcess, queue: Any) -> None:
    """Count every task the worker takes from its pool's queue (``get``, where the pool reads it; a traced
    call's unpickling runs inside), noting when the worker began waiting for it: the moment it was free."""
    get = queue.get

    def watched_get(*args: Any, **kwargs: Any) -> Any:
        worker.idle_since_ns = _perf_ns()
        item = get(*args, **kwargs)
        worker.tasks += 1
        return item

    queue.get = watched_get
    worker.watched = True


def process_started_ns() -> int:
    """When this process started, on the perf-counter clock (Linux: its start in ``/proc/self/stat``, clock
    ticks since boot, against the boot clock now); now where that cannot be read."""
    now = _perf_ns()
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
        age_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - age_ns if 0 <= age_ns < 10**15 else now


def in_worker_mode() -> bool:
    worker = _worker
    return worker is not None and worker.pid == os.getpid()


def note_idle() -> None:
    """The worker is free again (its result is on its way): the next task's wait in the pipe is transfer.
    (Where the task queue is watched, the wait for the next task says so exactly.)"""
    worker = _worker
    if worker is not None and not worker.watched:
        worker.idle_since_ns = _perf_ns()


def run_call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ticket: Ticket) -> Any:
    """Run ``fn`` as the offloaded call ``ticket`` names; returns ``(True, result, report)`` or
    ``(False, exception, report)``. The call runs exactly as it would without stagetrace: a failure of
    stagetrace's own bookkeeping runs it bare and reports nothing (``report`` None)."""
    try:
        worker = enter_worker_mode()
        if not worker.watched:
            worker.tasks += 1
        seq, idle = worker.tasks, worker.idle_since_ns
        rt = worker.runtime(ticket.max_stages, ticket.cpu_signals)
        trace = TraceRecord(ticket.trace_id, ticket.run_span_id, time.time_ns())
        # The call's run as the current span: a record of stagetrace's own (a non-recording span to the API),
        # so that the call's stages read their parent's ids directly, as under a stage of the request path. It
        # is the span and not the stage of the context: the exporter makes the outermost stages the run's.
        run = StageRecord(
            OFFLOAD_RUN_STAGE,
            "cpu",
            rt,
            trace,
            ticket.trace_id,
            ticket.run_span_id,
            0,
            0,
            TraceFlags(ticket.trace_flags),
        )
        token = attach(set_span_in_context(run, Context()))
    except Exception:
        return _bare(fn, args, kwargs)
    rt.begin(trace)
    lost_before = rt.lost
    _state.runtime = rt  # type: ignore[assignment]  # a CaptureRuntime, which is all capture reads of it
    signals = rt.cpu_signals
    cpu_start = signals.read() if signals is not None else _thread_time_ns()
    run_start = _perf_ns()
    try:
        outcome: tuple[bool, Any] = (True, fn(*args, **kwargs))
    except BaseException as exc:  # handed back to the pool exactly as raised
        outcome = (False, exc)
    run_end = _perf_ns()
    try:
        cpu_end = signals.read() if signals is not None else _thread_time_ns()
        _state.runtime = None
        rt.end()
        detach(token)
        with trace.lock:
            trace.closed = True
            stages = list(trace.stages)
        packed = pack_stages(stages)  # marked as the worker's where they are placed (exporter/offload.py)
        error = None if outcome[0] else describe_exception(outcome[1])
        report: Report | None = Report(
            ticket.call_id, ticket.parent_pid, worker.pid, seq, worker.started_ns, idle,
            run_start, run_end,
            cpu_start, cpu_end, packed, trace.dropped_stages + rt.lost - lost_before, error,
        )  # fmt: skip
    except Exception:
        _state.runtime = None
        report = None
    if not outcome[0] and not worker.watched:
        note_idle()
    return outcome[0], outcome[1], report


def _bare(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any, None]:
    try:
        return True, fn(*args, **kwargs), None
    except BaseException as exc:
        return False, exc, None


__all__ = [
    "Report",
    "Ticket",
    "WorkerProcess",
    "WorkerRuntime",
    "enter_worker_mode",
    "in_worker_mode",
    "run_call",
    "watch_task_queue",
]
