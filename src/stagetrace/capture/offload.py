"""Calls a traced request hands to a process pool, on the application's side: each becomes a stage of kind
``offload`` in the request's trace, with the worker's own stages under it.

At submission (the request's thread) the call is wrapped in an ``OffloadCall`` and noted as pending: its
trace record, its parent span and stage, when it was submitted, the pool's size and load. The wrapper
serialises the call itself when the pool pickles it (a pool thread of this process), timing that and
measuring the payload once; in the worker it unpickles as a ``WorkerCall`` (``capture/worker.py``), and the
result comes back as an ``OffloadResult`` whose unpickling here returns the plain result and hands the
worker's report over, before the pool completes the future: the request never sees a wrapper, and the stage
is in its trace before its code goes on. An exception carries the report as an attribute. A call that never
reported (the worker died, the call could not be sent) ends at its failure, with the error it failed with.

The application process only captures: the offload stage carries its raw readings
(``analysis.offload.OffloadFields``) and the exporter places the four children (queue, send, run, return).
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from stagetrace import _state
from stagetrace._safety import report_internal_error
from stagetrace.analysis.offload import OffloadFields
from stagetrace.capture.stage import Parent, describe_exception, validate_stage_name
from stagetrace.capture.worker import Report, Ticket, note_idle, run_call
from stagetrace.common.wire import STAGE_FIELDS
from stagetrace.settings import MAX_OFFLOADS_IN_FLIGHT

_perf_ns = time.perf_counter_ns
_getrandbits = random.getrandbits
_PROTOCOL = pickle.HIGHEST_PROTOCOL


def dumps(obj: Any) -> bytes:
    """``obj`` pickled as the pool would pickle it (multiprocessing's pickler, with the reducers libraries
    register on it: shared-memory tensors, connections, file descriptors)."""
    buf = io.BytesIO()
    ForkingPickler(buf, _PROTOCOL).dump(obj)
    return buf.getvalue()


def payload_bytes(pickled: int, values: Iterable[Any]) -> int:
    """The bytes a payload moves (a call's arguments, its result): the arrays' and tensors' ``nbytes`` among
    ``values`` where they exceed the pickled size (a reducer that sends a tensor through shared memory
    pickles a handle of a few bytes), the pickled size otherwise. Read from the objects, never by pickling
    them again."""
    arrays = 0
    for value in values:
        nbytes = getattr(value, "nbytes", None)
        if type(nbytes) is int:
            arrays += nbytes
    return max(pickled, arrays)


class ArrivedStage:
    """A stage recorded elsewhere, or after the fact: its wire fields by name, as ``common.wire.pack_stage``
    reads them (a worker's stages, the offload stage itself)."""

    __slots__ = STAGE_FIELDS
    name: str
    start_ns: int
    end_ns: int
    gpu = None  # no CUDA events to resolve here
    gpu_resolved = True

    def __init__(self, fields: tuple[Any, ...]) -> None:
        if len(fields) != len(STAGE_FIELDS):
            raise ValueError(f"a stage record has {len(STAGE_FIELDS)} fields, got {len(fields)}")
        for name, value in zip(STAGE_FIELDS, fields):
            setattr(self, name, value)
        if not isinstance(self.name, str) or type(self.start_ns) is not int or type(self.end_ns) is not int:
            raise ValueError("a stage record needs a str name and int times")


_BLANK: dict[str, Any] = {name: None for name in STAGE_FIELDS} | {
    "parent_stage_id": 0,
    "on_event_loop": False,
    "example": False,
}


class PendingOffload:
    """A call handed to a pool from a traced request, until its worker reports or it fails."""

    __slots__ = (
        "args_bytes",
        "call_id",
        "executor",
        "finished",
        "in_flight",
        "max_workers",
        "metrics",
        "name",
        "parent",
        "pickle_end_ns",
        "pickle_start_ns",
        "pool_key",
        "run_span_id",
        "span_id",
        "start_method",
        "submitted_ns",
        "ticket",
    )

    def __init__(
        self,
        rt: Any,
        parent: Parent,
        name: str,
        executor: str,
        max_workers: int | None,
        start_method: str | None,
        pool_key: int,
    ) -> None:
        self.submitted_ns = _perf_ns()
        self.parent = parent
        self.name = name
        self.executor = executor
        self.max_workers = max_workers
        self.start_method = start_method
        self.pool_key = pool_key
        self.metrics = rt.metrics
        self.call_id = _getrandbits(63)
        self.span_id = _getrandbits(64) or 1
        self.run_span_id = _getrandbits(64) or 1
        self.in_flight = 1
        self.pickle_start_ns: int | None = None
        self.pickle_end_ns: int | None = None
        self.args_bytes: int | None = None
        self.finished = False
        self.ticket = Ticket(
            self.call_id,
            os.getpid(),
            parent.trace_id,
            self.run_span_id,
            parent.trace_flags,
            rt.max_stages_per_trace,
            rt.cpu_signals is not None,
        )

    def fields(self, report: Report | None, result_bytes: int | None) -> OffloadFields:
        called = (self.executor, self.max_workers, self.in_flight, self.start_method, self.run_span_id)
        sent = (self.submitted_ns, self.pickle_start_ns, self.pickle_end_ns, self.args_bytes)
        if report is None:
            return OffloadFields(*called, *sent, *(None,) * 8, result_bytes)
        r = report
        ran = (
            r.worker_pid,
            r.task_seq,
            r.started_ns,
            r.idle_ns,
            r.run_start_ns,
            r.run_end_ns,
            r.cpu_start,
            r.cpu_end,
        )
        return OffloadFields(*called, *sent, *ran, result_bytes)


class InFlight:
    """The pending calls of this process, by call id, bounded (the oldest give way, counted); how many each
    pool has. Cleared in a forked child: a call its parent submitted is not the child's to finish."""

    def __init__(self, limit: int = MAX_OFFLOADS_IN_FLIGHT) -> None:
        self.limit = limit
        self._calls: dict[int, PendingOffload] = {}
        self._per_pool: Counter[int] = Counter()
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._calls = {}
        self._per_pool = Counter()
        self._lock = threading.Lock()

    def add(self, pending: PendingOffload) -> None:
        with self._lock:
            if len(self._calls) >= self.limit:
                oldest = self._calls.pop(next(iter(self._calls)))
                self._per_pool[oldest.pool_key] -= 1
                oldest.finished = True
                oldest.metrics.dropped("offload_in_flight")
            self._calls[pending.call_id] = pending
            self._per_pool[pending.pool_key] += 1
            pending.in_flight = self._per_pool[pending.pool_key]

    def take(self, call_id: int) -> PendingOffload | None:
        with self._lock:
            pending = self._calls.pop(call_id, None)
            if pending is not None:
                self._per_pool[pending.pool_key] -= 1
                if not self._per_pool[pending.pool_key]:
                    del self._per_pool[pending.pool_key]
            return pending

    def __len__(self) -> int:
        return len(self._calls)


IN_FLIGHT = InFlight()


def begin(
    rt: Any,
    parent: Parent,
    fn: Any,
    args: tuple[Any, ...],
    executor: str,
    max_workers: int | None,
    start_method: str | None,
    pool: Any,
    in_flight: int | None = None,
) -> PendingOffload:
    """A call from ``parent`` noted as pending; ``in_flight``: the pool's own count of its calls (this one
    included) where it keeps one, else the traced calls pending in it."""
    pending = PendingOffload(rt, parent, offload_name(fn, args), executor, max_workers, start_method, id(pool))
    IN_FLIGHT.add(pending)
    if in_flight is not None:
        pending.in_flight = in_flight
    return pending


_CHUNK_RUNNERS = frozenset({"mapstar", "starmapstar"})  # multiprocessing.pool's: run a (function, chunk) task


def offload_name(fn: Any, args: tuple[Any, ...] = ()) -> str:
    """The stage's name: the function's, through ``functools.partial`` and the pools' own chunk runners
    (``ProcessPoolExecutor.map``'s ``_process_chunk``, ``Pool.map``'s ``mapstar``), which wrap the user's."""
    if getattr(fn, "__name__", None) in _CHUNK_RUNNERS and args and isinstance(args[0], tuple) and args[0]:
        fn = args[0][0]
    for _ in range(8):
        if not isinstance(fn, functools.partial):
            break
        chunked = getattr(fn.func, "__name__", "") == "_process_chunk" and fn.args
        fn = fn.args[0] if chunked else fn.func
    name = getattr(fn, "__name__", None) or type(fn).__name__
    try:
        return validate_stage_name(str(name))
    except ValueError:
        return "offload"


class OffloadCall:
    """The call as the pool carries it. Pickled (on the pool's thread), it times its own serialisation and
    turns into a ``WorkerCall`` in the worker; called in this process (a pool that does not pickle), it is
    the call unchanged."""

    __slots__ = ("args", "fn", "kwargs", "pending")

    def __init__(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], pending: PendingOffload) -> None:
        self.fn, self.args, self.kwargs, self.pending = fn, args, kwargs, pending

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*self.args, *args, **self.kwargs, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        pending = self.pending
        start = _perf_ns()
        data = dumps((self.fn, self.args, self.kwargs))  # raises what pickling the call itself would raise
        pending.pickle_start_ns, pending.pickle_end_ns = start, _perf_ns()
        pending.args_bytes = payload_bytes(len(data), (*self.args, *self.kwargs.values()))
        return (_arrive, (data, tuple(pending.ticket)))


def _arrive(data: bytes, ticket: tuple[Any, ...]) -> WorkerCall:
    """In the worker, as the task is read: the call."""
    fn, args, kwargs = pickle.loads(data)
    return WorkerCall(fn, args, kwargs, Ticket(*ticket))


class WorkerCall:
    """The call in its worker: run under the request's context (``capture.worker.run_call``), its result
    wrapped to carry the worker's report back; an exception raised as it was, the report attached."""

    __slots__ = ("args", "fn", "kwargs", "ticket")

    def __init__(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ticket: Ticket) -> None:
        self.fn, self.args, self.kwargs, self.ticket = fn, args, kwargs, ticket

    def __call__(self) -> Any:
        ok, value, report = run_call(self.fn, self.args, self.kwargs, self.ticket)
        if ok:
            return value if report is None else OffloadResult(value, report)
        if report is not None:
            try:
                value._stagetrace_offload = ReportCarrier(report)
            except Exception:  # an exception that takes no attributes: its call ends at its failure, unreported
                pass
        raise value


class OffloadResult:
    """A result on its way back: pickled in the worker (timed, measured as the arguments are: its ``nbytes``
    where it is an array or tensor that says more than its pickle, the pickled size otherwise), it unpickles
    here as the plain result, handing the report over first."""

    __slots__ = ("report", "value")

    def __init__(self, value: Any, report: Report) -> None:
        self.value, self.report = value, report

    def __repr__(self) -> str:
        return repr(self.value)  # what a pool's error about the result names (multiprocessing's MaybeEncodingError)

    def __reduce__(self) -> tuple[Any, ...]:
        data = dumps(self.value)  # raises what pickling the result itself would raise
        note_idle()
        return (_returned, (data, tuple(self.report), payload_bytes(len(data), (self.value,))))


class ReportCarrier:
    """A report riding on an exception (as an attribute, which exceptions pickle with them); it unpickles
    here as None, handing the report over."""

    __slots__ = ("report",)

    def __init__(self, report: Report) -> None:
        self.report = report

    def __reduce__(self) -> tuple[Any, ...]:
        return (_carried, (tuple(self.report),))


def _returned(data: bytes, report: tuple[Any, ...], result_bytes: int) -> Any:
    value = pickle.loads(data)
    deliver(report, result_bytes)
    return value


def _carried(report: tuple[Any, ...]) -> None:
    deliver(report, None)
    return None


def deliver(report: tuple[Any, ...], result_bytes: int | None) -> None:
    """A worker's report, in this process (the pool's result thread): the call's stages into its trace."""
    try:
        r = Report(*report)
    except TypeError:
        _dropped("offload_malformed")
        return
    try:
        if r.parent_pid != os.getpid():
            _dropped("offload_unknown")
            return
        pending = IN_FLIGHT.take(r.call_id)
        if pending is None or pending.finished:
            _dropped("offload_unknown")
            return
        finish(pending, r, result_bytes, r.error)
    except Exception:
        report_internal_error("offload report")


def failed(pending: PendingOffload, exc: BaseException) -> None:
    """The call failed without its worker's report (the worker died, the call could not be sent, cancelled)."""
    try:
        if IN_FLIGHT.take(pending.call_id) is not None and not pending.finished:
            finish(pending, None, None, describe_exception(exc))
    except Exception:
        report_internal_error("offload failure")


def abandon(pending: PendingOffload) -> None:
    """The pool refused the call at submission: it raised to the caller, and is no stage."""
    if IN_FLIGHT.take(pending.call_id) is not None:
        pending.finished = True


def finish(pending: PendingOffload, report: Report | None, result_bytes: int | None, error: Any) -> None:
    """The offload stage (its raw readings for the exporter) and the worker's stages into the request's trace,
    unless the trace was shipped meanwhile (counted, never attached to another)."""
    pending.finished = True
    done = _perf_ns()
    parent = pending.parent
    values = dict(_BLANK)
    values.update(
        name=pending.name,
        kind="offload",
        span_id=pending.span_id,
        parent_span_id=parent.span_id,
        parent_stage_id=parent.stage_id,
        start_ns=pending.submitted_ns,
        end_ns=done,
        error=error,
        offload=tuple(pending.fields(report, result_bytes)),
    )
    stage = ArrivedStage(tuple(values[name] for name in STAGE_FIELDS))
    workers: list[ArrivedStage] = []
    dropped = 0
    if report is not None:
        dropped = report.dropped_stages if type(report.dropped_stages) is int else 0
        for fields in report.stages if isinstance(report.stages, tuple) else ():
            try:
                workers.append(ArrivedStage(fields))
            except (ValueError, TypeError):
                pending.metrics.dropped("offload_malformed")
    trace = parent.trace
    with trace.lock:
        late = trace.closed
        if not late:
            room = pending.ticket.max_stages - len(trace.stages)
            if room <= 0:
                trace.dropped_stages += 1 + len(workers) + dropped
            else:
                trace.stages.append(stage)
                trace.stages.extend(workers[: room - 1])
                trace.dropped_stages += max(0, len(workers) - (room - 1)) + dropped
    if late:
        pending.metrics.dropped("offload_late", 1 + len(workers))


def _dropped(reason: str) -> None:
    rt = _state.runtime
    if rt is not None:
        rt.metrics.dropped(reason)


__all__ = [
    "IN_FLIGHT",
    "ArrivedStage",
    "InFlight",
    "OffloadCall",
    "OffloadResult",
    "PendingOffload",
    "WorkerCall",
    "abandon",
    "begin",
    "deliver",
    "dumps",
    "failed",
    "finish",
    "offload_name",
    "payload_bytes",
]
