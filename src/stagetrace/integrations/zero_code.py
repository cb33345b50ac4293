"""Zero-code: ``opentelemetry-instrument uvicorn app:app`` with stagetrace installed gives stage spans and
verdicts. Loaded through the ``opentelemetry_instrumentor`` entry point, after any distro or configurator
has built the SDK: stagetrace then wraps that provider's processors (``attach``); with no SDK configured
it configures itself from the ``OTEL_*`` variables (or the embedded default). It never registers a
configurator of its own, so a user's distro keeps working.

Either way it reads the user's choices, not a distro's defaults (``env.users_environment``): with nothing
chosen, the traces and metrics go to the embedded default's JSON lines files, as without a distro, instead
of to a collector on localhost that the distro assumed. It records those defaults for the processes the
application starts (``env.remember_distro_defaults``): a process manager's workers (``uvicorn --workers``,
gunicorn) start with the distro's values in their environment, and must not take them for the user's.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from opentelemetry import metrics as metrics_api
from opentelemetry import trace as trace_api
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]
from opentelemetry.sdk.trace import TracerProvider

from stagetrace import _state
from stagetrace._safety import logger, report_internal_error
from stagetrace.destinations.env import remember_distro_defaults, users_environment
from stagetrace.integrations.asgi import install_request_signals, uninstall_request_signals
from stagetrace.integrations.threads import propagate_context_to_threads, stop_propagating_context
from stagetrace.settings import auto_stages_from_env, disabled_from_env


class StagetraceInstrumentor(BaseInstrumentor):
    _handle: Any = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()

    def _instrument(self, **kwargs: Any) -> None:
        if disabled_from_env():
            return
        from stagetrace.configuration import attach, configure

        if _state.runtime is None:
            try:
                remember_distro_defaults()
            except Exception:  # the record is for the workers: without it, this process still works
                report_internal_error("recording the distro's defaults")
            users = users_environment()
            provider = kwargs.get("tracer_provider") or trace_api.get_tracer_provider()
            if isinstance(provider, TracerProvider):
                meter_provider = kwargs.get("meter_provider") or metrics_api.get_meter_provider()
                self._handle = attach(provider, meter_provider, environ=users)
                logger.info("stagetrace: attached to the configured TracerProvider")
            else:
                self._handle = configure(environ=users)
        install_request_signals()
        propagate_context_to_threads()
        if auto_stages_from_env():
            from stagetrace.integrations import auto_stages

            auto_stages.instrument()

    def _uninstrument(self, **kwargs: Any) -> None:
        uninstall_request_signals()
        stop_propagating_context()
        from stagetrace.integrations import auto_stages

        auto_stages.uninstrument()
        if self._handle is not None:
            self._handle.shutdown()
            self._handle = None
