"""``stage()`` and ``pipeline()``: the only stagetrace code on the request path.

A stage entry allocates a span id, makes a non-recording span with that id the current span (so spans
that other instrumentations open inside the stage become its children) and takes timestamps. Nothing else:
the span itself is built later, in the exporter.
"""

from __future__ import annotations

import functools
import inspect
import random
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from opentelemetry.context import Context, attach, create_key, detach, get_current
from opentelemetry.trace import Status, StatusCode, set_span_in_context

from stagetrace import _state
from stagetrace._compat import SPAN_KEY as _SPAN_KEY
from stagetrace._compat import running_loop_or_none as _get_running_loop
from stagetrace._compat import runtime_context_var, span_context_is_a_plain_tuple
from stagetrace._safety import report_internal_error, warn_once
from stagetrace.capture.light_spans import LightSpan
from stagetrace.capture.loopblocks import note_loop_block
from stagetrace.capture.records import FOLDED_FIELDS, StageRecord, count_repeat, folding_repeat
from stagetrace.conventions import RESERVED_STAGE_NAMES, STAGE_KINDS
from stagetrace.settings import (
    CPU_ACCOUNTING_MIN_MS,
    LOOP_BLOCK_MIN_NS,
    MAX_STAGE_NAME_LENGTH,
    MAX_TRACKED_STAGE_NAMES,
)

F = TypeVar("F", bound=Callable[..., Any])

_STAGE_KEY = create_key("stagetrace-stage")
_ROOT_KEY = create_key("stagetrace-root")

_perf_ns = time.perf_counter_ns
_thread_time_ns = time.thread_time_ns
_getrandbits = random.getrandbits  # reseeded in forked children by the random module


_UNPACK_SPAN_CONTEXT = span_context_is_a_plain_tuple()
_CV = runtime_context_var()
_get_context: Callable[[], Any]  # a Context (a dict of context keys to values)
_set_context: Callable[[Context], Any]
_cv_reset: Callable[[Any], Any]
if _CV is not None:
    _get_context = _CV.get
    _set_context = _CV.set
    _cv_reset = _CV.reset
else:  # pragma: no cover - exercised only with a custom runtime context
    _get_context = get_current
    _set_context = attach
    _cv_reset = detach

# The current OpenTelemetry context read, set and reset the way a stage entry does (the ContextVar directly,
# when ``direct_context``), for the tracer's light path.
current_context = _get_context
set_current_context = _set_context
reset_current_context = _cv_reset
direct_context = _CV is not None


def validate_stage_name(name: object) -> str:
    """A clear error for what cannot be a name; sanitising for what merely should not be one.

    Names become span names and metric attribute values, so control characters are replaced and overlong
    names are cut rather than rejected: a dynamic name must never break a request.
    """
    if not isinstance(name, str):
        raise TypeError(f"stage name must be a str, got {type(name).__name__}")
    cleaned = name.strip()
    if not cleaned.isprintable():  # one C call for the usual name; the per-character pass only to repair one
        cleaned = "".join(ch if ch.isprintable() else "?" for ch in cleaned)
    if not cleaned:
        raise ValueError("stage name must be a non-empty string")
    if cleaned in RESERVED_STAGE_NAMES:
        raise ValueError(f"{cleaned!r} is reserved: stagetrace names its own part of the verdict so")
    if len(cleaned) > MAX_STAGE_NAME_LENGTH:
        warn_once(f"long-name:{cleaned[:32]}", "stagetrace: stage name cut to %d characters", MAX_STAGE_NAME_LENGTH)
        cleaned = cleaned[:MAX_STAGE_NAME_LENGTH]
    return cleaned


def validate_kind(kind: object) -> str:
    if kind not in STAGE_KINDS:
        raise ValueError(f"stage kind must be one of {', '.join(STAGE_KINDS)}; got {kind!r}")
    return str(kind)


def describe_exception(exc: BaseException) -> tuple[str, str, str]:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return type(exc).__qualname__, str(exc)[:1024], tb[-8192:]


class _ActiveRoot:
    """A local root that stagetrace opened (``pipeline()`` or a stage outside any trace)."""

    __slots__ = ("owner", "span", "token")

    def __init__(self, owner: Any, span: Any) -> None:
        self.owner = owner
        self.span = span
        self.token: Any = None


def _open_root(rt: Any, name: str, owner: Any, *, new_trace: bool = False) -> _ActiveRoot:
    """``new_trace``: a root of its own trace even inside another one (a batch serving many requests must
    not land in whichever request's context its worker inherited)."""
    span = rt.tracer.start_span(name, context=Context() if new_trace else None)
    active = _ActiveRoot(owner, span)
    ctx = set_span_in_context(span)
    values = dict(ctx)
    values[_ROOT_KEY] = active
    active.token = attach(Context(values))
    return active


def _close_root(active: _ActiveRoot, exc: BaseException | None) -> None:
    try:
        detach(active.token)
        if exc is not None and active.span.is_recording():
            active.span.record_exception(exc)
            active.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__qualname__}: {exc}"[:256]))
        active.span.end()
    except Exception:
        report_internal_error("pipeline exit")


def enter_stage(
    name: str, kind: str, owner: Any = None, *, sync: bool = True, foldable: bool = True
) -> StageRecord | None:
    """``sync``: the stage runs without yielding to other tasks (not ``async with``/``async def``), so CPU
    accounting applies and running on the event-loop thread means blocking it. ``foldable``: a repeat of
    its name may fold into a composite (not for stages whose own fields a rule reads occurrence by
    occurrence, such as a queue wait's saturation, or that end outside ``exit_stage``)."""
    rt = _state.runtime
    if rt is None:
        return None
    try:
        ctx = _get_context()
        span = ctx.get(_SPAN_KEY)
        implicit = None
        span_type = type(span)
        if span_type is StageRecord or span_type is LightSpan:  # read the parent directly, no SpanContext
            trace_id, parent_span_id = span.trace_id, span.span_id
            flags, state = span.trace_flags, span.trace_state
        else:
            sc = span.get_span_context() if span is not None else None
            if sc is None or not sc.is_valid:
                # Outside any trace: the stage opens its own local root, so it still shows up with a verdict.
                implicit = _open_root(rt, name, None)
                ctx = _get_context()
                sc = implicit.span.get_span_context()
            if _UNPACK_SPAN_CONTEXT:
                trace_id, parent_span_id, _, flags, state, _ = sc
            else:  # pragma: no cover - a future API layout
                trace_id, parent_span_id, flags, state = sc.trace_id, sc.span_id, sc.trace_flags, sc.trace_state
        trace = rt.lookup_trace(trace_id)
        parent = ctx.get(_STAGE_KEY)
        # A name repeating under one parent past KEEP_REPEATS folds into its composite, whose span id it takes.
        seen = trace.repeats.get(name) if trace is not None and foldable else None
        repeat = folding_repeat(seen, parent_span_id) if seen is not None else None
        rec = StageRecord(
            name,
            kind,
            rt,
            trace,
            trace_id,
            repeat.span_id if repeat is not None else (_getrandbits(64) or 1),
            parent_span_id,
            parent.span_id if parent is not None and parent.trace_id == trace_id else 0,
            flags,
            state,
            owner,
        )
        if repeat is not None:
            rec.repeat = repeat
        if trace is None:
            # A trace whose root stagetrace does not track: the stage is exported on its own.
            rec.perf_to_epoch_ns = time.time_ns() - _perf_ns()
        if implicit is not None:
            rec.implicit_root = implicit
        if sync:
            if _get_running_loop() is not None:
                rec.on_event_loop = True
                if parent is None or not parent.on_event_loop:
                    rec.blocks_loop = True
            signals = rt.cpu_signals
            if signals is not None and repeat is None:  # a folded occurrence: its time only
                # Every sync stage gets the thread's CPU clock (0.3 us), so a stage that turns out long has
                # cpu_ms and blocked_ms even when its name usually runs short. Names that recently ran for
                # 0.5 ms or more also get schedstat (~4.5 us here), which splits out run-queue time.
                if rt.recent_stage_ms.get(name, CPU_ACCOUNTING_MIN_MS) >= CPU_ACCOUNTING_MIN_MS:
                    rec.cpu_start = signals.read()
                else:
                    rec.cpu_start = _thread_time_ns()
        new = Context(ctx)  # one copy, where set_span_in_context + set_value would make two
        dict.__setitem__(new, _SPAN_KEY, rec)
        dict.__setitem__(new, _STAGE_KEY, rec)
        rec.token = _set_context(new)
        rec.start_ns = _perf_ns()
        return rec
    except Exception:
        report_internal_error("stage entry")
        return None


def exit_stage(rec: StageRecord | None, exc: BaseException | None, end_ns: int | None = None) -> None:
    if rec is None:
        return
    end = _perf_ns() if end_ns is None else end_ns
    try:
        rec.end_ns = end
        rt = rec.runtime
        if rec.blocks_loop and end - rec.start_ns >= LOOP_BLOCK_MIN_NS:
            note_loop_block(rt, rec, end)
        try:
            _cv_reset(rec.token)
        except ValueError:  # token made in another context (P10): the API's detach logs it
            detach(rec.token)
        start = rec.cpu_start
        if start is not None:
            rec.cpu_end = _thread_time_ns() if type(start) is int else rt.cpu_signals.read()
        if rt.cpu_signals is not None and rec.repeat is None:
            recent = rt.recent_stage_ms
            ms = (end - rec.start_ns) / 1e6
            previous = recent.get(rec.name)
            if previous is not None:
                recent[rec.name] = max(ms, previous * 0.5)  # a long run keeps the name measured a while
            elif len(recent) < MAX_TRACKED_STAGE_NAMES:
                recent[rec.name] = ms
        if exc is not None:
            rec.error = describe_exception(exc)
        trace = rec.trace
        if trace is not None:
            with trace.lock:
                if not trace.closed:
                    if rec.repeat is not None:
                        rec.repeat.fold(rec)  # with its host time: a folded occurrence records no CUDA events
                    elif len(trace.stages) < rt.max_stages_per_trace:
                        trace.stages.append(rec)
                        count_repeat(trace, rec, _getrandbits)
                    else:
                        trace.dropped_stages += 1
                        if rec.gpu is not None:
                            rt.gpu.forget(rec)  # its CUDA events go back to the pool's count
                    trace = None
        if trace is not None or rec.trace is None:
            if rec.repeat is not None:  # it would have folded, but its trace is gone: a span of its own
                rec.span_id, rec.repeat = _getrandbits(64) or 1, None
            rt.shipper.submit_lone_stage(rec)  # after the root ended (background work), or untracked
        if rec.implicit_root is not None:
            _close_root(rec.implicit_root, exc)
    except Exception:
        report_internal_error("stage exit")


class Stage:
    """What ``stagetrace.stage()`` returns: a decorator and a (sync or async) context manager."""

    __slots__ = ("kind", "name")

    def __init__(self, name: str | None, kind: str) -> None:
        self.name = None if name is None else validate_stage_name(name)
        self.kind = validate_kind(kind)

    # --- context manager -----------------------------------------------------------------------------
    def __enter__(self) -> StageRecord | _NullStage:
        if self.name is None:
            raise ValueError("stagetrace.stage() needs a name when used as a context manager")
        return enter_stage(self.name, self.kind, self) or NULL_STAGE

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if _state.runtime is None and exc is None:
            return
        rec = _get_context().get(_STAGE_KEY)
        if rec is not None and rec.owner is self and not rec.end_ns:
            exit_stage(rec, exc)

    async def __aenter__(self) -> StageRecord | _NullStage:
        if self.name is None:
            raise ValueError("stagetrace.stage() needs a name when used as a context manager")
        return enter_stage(self.name, self.kind, self, sync=False) or NULL_STAGE

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)

    # --- decorator -----------------------------------------------------------------------------------
    def __call__(self, fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"stagetrace.stage() decorates a function, got {type(fn).__name__}")
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"stagetrace.stage() cannot decorate the generator {fn.__qualname__}: it would time only the "
                "generator's creation. Use `with stagetrace.stage(...)` inside it instead."
            )
        name = self.name or validate_stage_name(getattr(fn, "__name__", "stage"))
        kind = self.kind

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                rec = enter_stage(name, kind, None, sync=False)
                try:
                    result = await fn(*args, **kwargs)
                except BaseException as e:
                    exit_stage(rec, e)
                    raise
                exit_stage(rec, None)
                return result

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            rec = enter_stage(name, kind)
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                exit_stage(rec, e)
                raise
            exit_stage(rec, None)
            return result

        return wrapper  # type: ignore[return-value]


class _NullStage:
    """Returned by ``with stage(...)`` when stagetrace is off, so ``s.set_attribute`` always works."""

    __slots__ = ()

    def set_attribute(self, key: str, value: Any) -> None:
        return None


NULL_STAGE = _NullStage()


def stage(name: str | Callable[..., Any] | None = None, kind: str = "cpu") -> Any:
    """Time a pipeline stage as a child span of the current trace.

    Works as ``@stage``, ``@stage("decode")``, ``with stage("decode"):`` and ``async with``. The name
    defaults to the decorated function's name; ``kind`` is one of cpu, io, wait, h2d, gpu, d2h.
    """
    if callable(name) and not isinstance(name, str):
        return Stage(None, kind)(name)
    return Stage(name, kind)


class Pipeline:
    """What ``stagetrace.pipeline()`` returns: a local root for code that has no server span."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = validate_stage_name(name)

    def __enter__(self) -> Pipeline:
        rt = _state.runtime
        if rt is not None:
            try:
                _open_root(rt, self.name, self)
            except Exception:
                report_internal_error("pipeline entry")
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        active = get_current().get(_ROOT_KEY)
        if isinstance(active, _ActiveRoot) and active.owner is self:
            _close_root(active, exc)

    async def __aenter__(self) -> Pipeline:
        return self.__enter__()

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)

    def __call__(self, fn: F) -> F:
        name = self.name
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                async with Pipeline(name):
                    return await fn(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with Pipeline(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


def pipeline(name: str) -> Pipeline:
    """A local root (and verdict) for batch jobs and plain PyTorch loops; inside an existing trace it is
    an ordinary child span and the verdict stays on the trace's local root."""
    return Pipeline(name)


def add_stage(name: str, kind: str, start_ns: int, end_ns: int, **fields: Any) -> None:
    """Record a stage that already happened (``perf_counter_ns`` times), e.g. a queue wait that an
    integration measured, in the current trace (outside any trace it records nothing). ``fields`` set
    analysis fields such as queue_saturated."""
    span = _get_context().get(_SPAN_KEY)
    if span is None or not span.get_span_context().is_valid:
        return
    foldable = all(v is None for k, v in fields.items() if k not in FOLDED_FIELDS)
    rec = enter_stage(name, kind, None, sync=False, foldable=foldable)
    if rec is not None:
        rec.start_ns = start_ns
        for key, value in fields.items():
            setattr(rec, key, value)
        exit_stage(rec, None, end_ns)


class Parent(NamedTuple):
    """Where something that happens later, elsewhere (a call handed to a process pool), belongs: the
    request's trace record and the span and stage current now."""

    trace: Any  # capture.records.TraceRecord
    trace_id: int
    span_id: int
    stage_id: int  # the innermost open stage of this trace, 0 for none
    trace_flags: int


def current_parent(rt: Any) -> Parent | None:
    """The current context's place in a trace this process holds; None outside one (a lookup and a branch)."""
    ctx = _get_context()
    span = ctx.get(_SPAN_KEY)
    if span is None:
        return None
    span_type = type(span)
    if span_type is StageRecord or span_type is LightSpan:
        trace_id, span_id, flags = span.trace_id, span.span_id, span.trace_flags
    else:
        sc = span.get_span_context()
        if not sc.is_valid:
            return None
        trace_id, span_id, flags = sc.trace_id, sc.span_id, sc.trace_flags
    trace = rt.lookup_trace(trace_id)
    if trace is None:
        return None
    stage = ctx.get(_STAGE_KEY)
    stage_id = stage.span_id if stage is not None and stage.trace_id == trace_id else 0
    return Parent(trace, trace_id, span_id, stage_id, int(flags) if flags is not None else 0)


def current_stage() -> StageRecord | None:
    """The innermost open stage of the current context, for integrations that add attributes to it."""
    rec = get_current().get(_STAGE_KEY)
    return rec if isinstance(rec, StageRecord) else None


__all__ = ["Pipeline", "Stage", "current_stage", "pipeline", "stage"]
