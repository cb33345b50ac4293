"""FastAPI: the server span is the trace's local root (and carries the verdict); stagetrace adds the
thread-pool wait, the event-loop lag monitor and context propagation to workers.

Two sources for that server span. FastAPI 0.142+ has telemetry of its own (``FastAPI(telemetry=...)``,
operation spans for dependencies, endpoint, serialization and background tasks): where the installed
FastAPI has it, stagetrace uses it, points it at stagetrace's providers when the app did not name its
own, and reads its operation spans as stages (``conventions.FOREIGN_STAGES``). Older FastAPI, an app
already instrumented by the contrib ``FastAPIInstrumentor``, or ``telemetry="contrib"`` use the contrib
middleware (with which FastAPI switches its own telemetry off).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry import metrics as metrics_api
from opentelemetry import trace as trace_api

from stagetrace._compat import fastapi_contrib_instrumented, fastapi_telemetry_config
from stagetrace.integrations._common import ensure_configured, require
from stagetrace.integrations.asgi import install_request_signals
from stagetrace.integrations.threads import propagate_context_to_threads

TELEMETRY_SOURCES = ("auto", "native", "contrib")


def instrument_fastapi(
    app: Any, *, telemetry: str = "auto", exclude_spans: Sequence[str] = ("send", "receive"), **kwargs: Any
) -> Any:
    """Instrument one FastAPI app.

    ``telemetry``: ``"auto"`` uses FastAPI's own telemetry where the installed FastAPI has it (and the app
    has not switched its tracing off or been instrumented by the contrib package), else the contrib
    instrumentation; ``"native"`` or ``"contrib"`` choose. ``exclude_spans`` and other keyword arguments
    are the contrib ``FastAPIInstrumentor.instrument_app``'s (``exclude_spans`` drops its per-message
    ``http send/receive`` spans; e.g. ``excluded_urls``, ``server_request_hook``): passing any of the
    latter selects the contrib path under ``"auto"``.
    """
    if telemetry not in TELEMETRY_SOURCES:
        raise ValueError(f"telemetry must be one of {', '.join(TELEMETRY_SOURCES)}; got {telemetry!r}")
    config = fastapi_telemetry_config(app)
    if telemetry == "native" and config is None:
        raise RuntimeError(
            "stagetrace.instrument_fastapi(telemetry='native') needs FastAPI 0.142 or later, whose apps have "
            "telemetry of their own; use telemetry='contrib' (or 'auto') with this FastAPI"
        )
    if telemetry == "native" and kwargs:
        raise TypeError(f"options of the contrib instrumentation with telemetry='native': {', '.join(kwargs)}")
    native = config is not None and (
        telemetry == "native"
        or (
            telemetry == "auto" and not kwargs and config.get("tracing", True) and not fastapi_contrib_instrumented(app)
        )
    )
    module = (
        None
        if native
        else require("opentelemetry.instrumentation.fastapi", "stagetrace.instrument_fastapi()", "fastapi")
    )
    rt = ensure_configured()
    if rt is None:
        return app
    if native:
        assert config is not None
        # The app's own choice of providers wins; otherwise FastAPI would use the global ones, which
        # stagetrace does not own with configure(set_global=False).
        if config.get("tracer_provider") is None and trace_api.get_tracer_provider() is not rt.tracer_provider:
            config["tracer_provider"] = rt.tracer_provider
        meter_provider = rt.meter_provider
        unset = config.get("meter_provider") is None
        if meter_provider is not None and unset and metrics_api.get_meter_provider() is not meter_provider:
            config["meter_provider"] = meter_provider
        config["tracing"] = True
    else:
        assert module is not None
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
