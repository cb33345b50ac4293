"""When a request reached its server, for the wait before its server span.

A request whose event loop is held by other requests' synchronous work waits twice before its framework
opens a server span: first as bytes in its socket (the loop cannot read them), then as a ready task in the
loop's queue (the server has read them and created the request's task, which cannot run yet). Neither is in
any span. A task factory on the loop notes, for every task, when it was created and, for the ASGI servers
whose request socket it can reach (uvicorn), how long ago the socket last received data (Linux
``TCP_INFO``: the request's bytes, on a keep-alive connection). The values ride in the task's own context
(``TASK_ARRIVAL``), so the local root, opened later inside that task, reads them without any lookup; the
exporter turns them into an ``event_loop.wait`` stage and moves the root's start back to the arrival.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from typing import Any

from stagetrace._compat import asgi_request_socket, socket_received_ms_ago
from stagetrace._safety import report_internal_error

# (perf-counter ns when the task was created, ms since its socket last received data or -1 when unknown)
TASK_ARRIVAL: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "stagetrace_task_arrival", default=None
)

_perf_ns = time.perf_counter_ns
_MARK = "_stagetrace_arrival"


def ensure_task_factory(loop: asyncio.AbstractEventLoop) -> None:
    """Note arrivals on ``loop`` from now on, chained to any task factory already set (and set again if
    someone replaced it since). Cheap when it is in place: one call and an attribute read."""
    try:
        current = loop.get_task_factory()
        if getattr(current, _MARK, False):
            return
        loop.set_task_factory(arrival_factory(current))
    except Exception:
        report_internal_error("task factory")


def arrival_factory(previous: Callable[..., Any] | None) -> Callable[..., Any]:
    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        given = kwargs.get("context")
        context = given
        try:
            sock = asgi_request_socket(coro)
            arrival = (_perf_ns(), socket_received_ms_ago(sock) if sock is not None else -1)
            if context is None:
                context = contextvars.copy_context()
            context.run(TASK_ARRIVAL.set, arrival)
        except Exception:  # never in the way of a task
            context = given
        if previous is not None:
            if given is None and context is not None:
                # A factory written before tasks took a context: the task copies the current one, this.
                return context.run(previous, loop, coro, **kwargs)
            return previous(loop, coro, **kwargs)
        if context is not None:
            kwargs["context"] = context
        return asyncio.Task(coro, loop=loop, **kwargs)

    setattr(factory, _MARK, True)
    return factory


def take_arrival() -> tuple[int, int] | None:
    """The current task's arrival, once: a task that serves several requests in turn (a websocket, a server
    that reuses tasks) gives it to the first root only."""
    arrival = TASK_ARRIVAL.get()
    if arrival is not None:
        TASK_ARRIVAL.set(None)
    return arrival
