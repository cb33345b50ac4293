"""Flask: the contrib instrumentation's server span is the trace's local root (and carries the verdict)."""

from __future__ import annotations

from typing import Any

from stagetrace.integrations._common import ensure_configured, require
from stagetrace.integrations.threads import propagate_context_to_threads


def instrument_flask(app: Any, **kwargs: Any) -> Any:
    """Instrument one Flask app; keyword arguments go to ``FlaskInstrumentor.instrument_app``."""
    module = require("opentelemetry.instrumentation.flask", "stagetrace.instrument_flask()", "flask")
    rt = ensure_configured()
    if rt is None:
        return app
    module.FlaskInstrumentor.instrument_app(
        app, tracer_provider=rt.tracer_provider, meter_provider=rt.meter_provider, **kwargs
    )
    propagate_context_to_threads()
    return app
