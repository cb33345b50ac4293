"""stagetrace: stage-level OpenTelemetry tracing for AI inference services.

    import stagetrace
    stagetrace.configure("detector", slow_threshold_ms=200)

    @stagetrace.stage("decode")
    def decode(raw: bytes): ...

Integrations (FastAPI, Flask, torch) are imported lazily, so the core needs only OpenTelemetry.
"""

from __future__ import annotations

from typing import Any

from stagetrace._version import __version__
from stagetrace.analysis import Diagnosis, DiagnosisThresholds, Verdict
from stagetrace.capture.batch import Ticket, batch, enqueue
from stagetrace.capture.stage import current_stage, pipeline, stage
from stagetrace.capture.streams import generation
from stagetrace.configuration import StagetraceHandle, configure
from stagetrace.profiler import InferencePipelineProfiler
from stagetrace.settings import Settings

__all__ = [
    "Diagnosis",
    "DiagnosisThresholds",
    "InferencePipelineProfiler",
    "Settings",
    "StagetraceHandle",
    "Ticket",
    "Verdict",
    "__version__",
    "batch",
    "configure",
    "current_stage",
    "d2h",
    "enqueue",
    "generation",
    "gpu_stage",
    "h2d",
    "instrument_fastapi",
    "instrument_flask",
    "pipeline",
    "stage",
]


def __getattr__(name: str) -> Any:
    # Lazy: these pull in torch or web frameworks only when a user asks for them.
    if name in ("gpu_stage", "h2d", "d2h"):
        from stagetrace.capture import gpu

        for each in ("gpu_stage", "h2d", "d2h"):  # once: the module's __getattr__ is not asked again
            globals()[each] = getattr(gpu, each)
        return globals()[name]
    if name == "instrument_fastapi":
        from stagetrace.integrations.fastapi import instrument_fastapi

        return instrument_fastapi
    if name == "instrument_flask":
        from stagetrace.integrations.flask import instrument_flask

        return instrument_flask
    raise AttributeError(f"module 'stagetrace' has no attribute {name!r}")
