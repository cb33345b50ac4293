"""FastAPI: the contrib instrumentation's server span is the trace's local root (and carries the verdict);
stagetrace adds the thread-pool wait, the event-loop lag monitor and context propagation to workers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stagetrace.integrations._common import ensure_configured, require
from stagetrace.integrations.asgi import install_request_signals
from stagetrace.integrations.threads import propagate_context_to_threads


def instrument_fastapi(app: Any, *, exclude_spans: Sequence[str] = ("send", "receive"), **kwargs: Any) -> Any:
    """Instrument one FastAPI app. ``exclude_spans`` drops the per-message ``http send/receive`` spans
    (they cost ~0.1-0.3 ms a request and say little); other keyword arguments go to
    ``FastAPIInstrumentor.instrument_app`` (e.g. ``excluded_urls``, ``server_request_hook``)."""
    module = require("opentelemetry.instrumentation.fastapi", "stagetrace.instrument_fastapi()", "fastapi")
    rt = ensure_configured()
    if rt is None:
        return app
    module.FastAPIInstrumentor.instrument_app(
        app,
        tracer_provider=rt.tracer_provider,
        meter_provider=rt.meter_provider,
        exclude_spans=list(exclude_spans),
        **kwargs,
    )
    install_request_signals()
    propagate_context_to_threads()
    return app
