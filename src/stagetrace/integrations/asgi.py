"""Request signals for ASGI servers (FastAPI/Starlette): the wait for a worker thread as a ``wait`` stage,
the event-loop lag monitor started on each loop's first request, and the task factory that notes when each
request reached the server (``capture/arrival.py``), from the lifespan's start on."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from opentelemetry.context import Context, attach, detach, get_current
from opentelemetry.trace import get_current_span

from stagetrace import _state
from stagetrace.capture import streams
from stagetrace.capture.arrival import ensure_task_factory
from stagetrace.capture.records import StageRecord
from stagetrace.integrations._common import Patch
from stagetrace.integrations.threads import OCCUPANCY, timed_wait

THREADPOOL_WAIT_STAGE = "threadpool.wait"


async def _on_worker(run: Any, limiter: Any, min_ns: int | None, func: Any, *args: Any, **kwargs: Any) -> Any:
    """``run(func, *args, **kwargs)`` on anyio's default thread pool (``limiter``, None where it cannot be
    read), its wait for a worker a ``threadpool.wait`` stage that says whether every token was spoken for when
    it asked: a wait behind a full pool is QUEUEING, a wait for a free worker to get a CPU (a busy host) is not."""
    if limiter is None:
        return await run(timed_wait(func, THREADPOOL_WAIT_STAGE, None, min_ns), *args, **kwargs)
    saturated = _limiter_saturated(limiter, OCCUPANCY.enter(limiter))
    try:
        # The wrapped function runs on the worker, in the request's copied context.
        return await run(timed_wait(func, THREADPOOL_WAIT_STAGE, saturated, min_ns), *args, **kwargs)
    finally:
        OCCUPANCY.leave(limiter)  # the token goes back in this same step of the loop


def _make_run_in_threadpool(original: Any) -> Any:
    @functools.wraps(original)
    async def run_in_threadpool(func: Any, *args: Any, **kwargs: Any) -> Any:
        if _state.runtime is None:
            return await original(func, *args, **kwargs)
        return await _on_worker(original, _default_limiter(), None, func, *args, **kwargs)

    return run_in_threadpool


def _default_limiter() -> Any:
    try:
        import anyio.to_thread

        return anyio.to_thread.current_default_thread_limiter()
    except Exception:
        return None


def _limiter_saturated(limiter: Any, before: int) -> bool | None:
    """Was every token of the anyio thread limiter spoken for when the request asked for one: by the
    requests counted before it (anyio yields before taking a token, so in a burst the limiter's own
    count lags), or by other users of the limiter?"""
    try:
        total = limiter.total_tokens
        return before >= total or limiter.borrowed_tokens >= total
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
            from stagetrace.configuration import current_handle

            handle = current_handle()
            if handle is not None:
                await asyncio.to_thread(handle.force_flush, 10.0)
        return message

    return wrapped


_SCOPE_MARK = "stagetrace.entered"  # FastAPI.__call__ and Starlette.__call__ are both wrapped: act once


def _make_app_call(original: Any) -> Any:
    @functools.wraps(original)
    async def __call__(self: Any, scope: Any, receive: Any, send: Any) -> Any:
        rt = _state.runtime
        if rt is None or scope.get(_SCOPE_MARK):
            return await original(self, scope, receive, send)
        scope[_SCOPE_MARK] = True
        # From the server's start (lifespan) or a loop's first request on, each request's task notes when
        # it was created, so its trace can begin when it reached the server.
        ensure_task_factory(asyncio.get_running_loop())
        if scope.get("type") == "lifespan":
            return await original(self, scope, _flushing_on_shutdown(receive), send)
        rt.loop_monitor.ensure_running()
        if scope.get("type") == "http":
            send, receive = streams.observe(rt, send, receive)  # a streamed body's chunks, timed
        if scope.get("type") in ("http", "websocket") and leaked_context(get_current()):
            token = attach(Context())
            try:
                return await original(self, scope, receive, send)
            finally:
                detach(token)
        return await original(self, scope, receive, send)

    return __call__


def _make_iterate_in_threadpool(original: Any) -> Any:
    """Starlette's ``StreamingResponse`` runs each ``next()`` of a sync generator on the thread pool: each
    hop's wait for a worker is a ``threadpool.wait`` stage (folded with the others past the first few), so
    a stream's time between chunks is in stages, not untracked, each saying whether the pool was full."""

    @functools.wraps(original)
    async def iterate_in_threadpool(iterator: Any) -> Any:
        if _state.runtime is None:
            async for item in original(iterator):
                yield item
            return
        import anyio.to_thread

        as_iterator = iter(iterator)
        run, limiter = anyio.to_thread.run_sync, _default_limiter()  # (the loop's: once a stream, not a chunk)
        while True:
            try:  # every hop, however short, is a stage: they fold
                yield await _on_worker(run, limiter, 0, _next_or_stop, as_iterator)
            except _Exhausted:
                break

    return iterate_in_threadpool


class _Exhausted(Exception):
    """StopIteration cannot cross a coroutine (it becomes a RuntimeError): the generator's end, carried."""


def _next_or_stop(iterator: Any) -> Any:
    try:
        return next(iterator)
    except StopIteration:
        raise _Exhausted from None


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
    try:
        import starlette.responses as responses

        patches.append(Patch(responses, "iterate_in_threadpool", _make_iterate_in_threadpool))
    except ImportError:
        pass
    try:
        # FastAPI's own telemetry starts its server span in FastAPI.__call__, before Starlette's: the
        # leaked-context check has to come first there.
        import fastapi.applications as fastapi_apps

        if "__call__" in vars(fastapi_apps.FastAPI):
            patches.append(Patch(fastapi_apps.FastAPI, "__call__", _make_app_call))
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
