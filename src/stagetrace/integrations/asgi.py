"""Request signals for ASGI servers (FastAPI/Starlette): the wait for a worker thread as a ``wait`` stage,
and the event-loop lag monitor started on each loop's first request."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from opentelemetry.context import Context, attach, detach, get_current
from opentelemetry.trace import get_current_span

from stagetrace import _state
from stagetrace.capture.records import StageRecord
from stagetrace.capture.stage import add_stage
from stagetrace.integrations._common import Patch
from stagetrace.settings import MIN_WAIT_NS

THREADPOOL_WAIT_STAGE = "threadpool.wait"


def _make_run_in_threadpool(original: Any) -> Any:
    @functools.wraps(original)
    async def run_in_threadpool(func: Any, *args: Any, **kwargs: Any) -> Any:
        if _state.runtime is None:
            return await original(func, *args, **kwargs)
        saturated = _pool_saturated()
        submitted = time.perf_counter_ns()

        def timed(*a: Any, **k: Any) -> Any:
            # Runs on the worker, in the request's copied context: the wait ends when a thread picks it up.
            started = time.perf_counter_ns()
            if started - submitted >= MIN_WAIT_NS:
                add_stage(THREADPOOL_WAIT_STAGE, "wait", submitted, started, queue_saturated=saturated)
            return func(*a, **k)

        return await original(timed, *args, **kwargs)

    return run_in_threadpool


def _pool_saturated() -> bool | None:
    """Was every worker token of the anyio thread limiter taken when the request asked for one?"""
    try:
        import anyio.to_thread

        stats = anyio.to_thread.current_default_thread_limiter().statistics()
        return stats.borrowed_tokens >= stats.total_tokens or stats.tasks_waiting > 0
    except Exception:
        return None


def leaked_context(ctx: Context) -> bool:
    """Is the current span one that already ended? Then it leaked into this request: with uvicorn, a large
    body pauses reading, the app resumes it from inside its request task, and asyncio registers the new
    reader callback with a copy of that task's context, so every later request on the keep-alive connection
    starts inside the previous request's (finished) server span and would become its child."""
    span = get_current_span(ctx)
    if not span.get_span_context().is_valid:
        return False
    end = getattr(span, "end_time", None)
    if end is None and isinstance(span, StageRecord):
        end = span.end_ns or None
    return end is not None


def _flushing_on_shutdown(receive: Any) -> Any:
    """Flush when the server announces shutdown: worker processes (uvicorn --workers, gunicorn) may end
    without running atexit handlers, which would lose every span still batched."""

    async def wrapped() -> Any:
        message = await receive()
        if message.get("type") == "lifespan.shutdown":
            from stagetrace.setup import current_handle

            handle = current_handle()
            if handle is not None:
                await asyncio.to_thread(handle.force_flush, 10.0)
        return message

    return wrapped


def _make_app_call(original: Any) -> Any:
    @functools.wraps(original)
    async def __call__(self: Any, scope: Any, receive: Any, send: Any) -> Any:
        rt = _state.runtime
        if rt is None:
            return await original(self, scope, receive, send)
        if scope.get("type") == "lifespan":
            return await original(self, scope, _flushing_on_shutdown(receive), send)
        rt.loop_monitor.ensure_running()
        if scope.get("type") in ("http", "websocket") and leaked_context(get_current()):
            token = attach(Context())
            try:
                return await original(self, scope, receive, send)
            finally:
                detach(token)
        return await original(self, scope, receive, send)

    return __call__


def asgi_patches() -> list[Patch]:
    """FastAPI calls ``run_in_threadpool`` through these module globals for sync endpoints and dependencies."""
    patches: list[Patch] = []
    try:
        import fastapi.dependencies.utils as deps_utils
        import fastapi.routing as routing

        patches += [
            Patch(routing, "run_in_threadpool", _make_run_in_threadpool),
            Patch(deps_utils, "run_in_threadpool", _make_run_in_threadpool),
        ]
    except ImportError:
        pass
    try:
        import starlette.applications as apps

        patches.append(Patch(apps.Starlette, "__call__", _make_app_call))
    except ImportError:
        pass
    return patches


_PATCHES: list[Patch] = []


def install_request_signals() -> None:
    if not _PATCHES:
        _PATCHES.extend(asgi_patches())
    for p in _PATCHES:
        p.apply()


def uninstall_request_signals() -> None:
    for p in _PATCHES:
        p.restore()
