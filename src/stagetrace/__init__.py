"""stagetrace: stage-level OpenTelemetry tracing for AI inference services.

    import stagetrace
    stagetrace.configure("detector", slow_threshold_ms=200)

    @stagetrace.stage("decode")
    def decode(raw: bytes): ...

Integrations (FastAPI, Flask, torch) are imported lazily, so the core needs only OpenTelemetry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stagetrace import _compiled
from stagetrace._version import __version__

_compiled.install()  # the sources of the exporter's compiled modules, but in an exporter process allowed them

if TYPE_CHECKING:
    from stagetrace.analysis import Diagnosis, DiagnosisThresholds, Verdict
    from stagetrace.capture.batch import Ticket, batch, enqueue
    from stagetrace.capture.gpu import d2h, gpu_stage, h2d
    from stagetrace.capture.stage import current_stage, pipeline, stage
    from stagetrace.capture.streams import generation
    from stagetrace.configuration import StagetraceHandle, configure
    from stagetrace.integrations.fastapi import instrument_fastapi
    from stagetrace.integrations.flask import instrument_flask
    from stagetrace.profiler import InferencePipelineProfiler
    from stagetrace.settings import Settings

# Every public name, imported on first use (then kept in the module's globals, so ``__getattr__`` is asked
# once a name): ``import stagetrace`` costs nearly nothing, the exporter process (``python -m
# stagetrace.exporter``) never imports the capture layer, and torch or a web framework is imported only for
# the names that need them.
_PUBLIC = {
    "Diagnosis": "stagetrace.analysis",
    "DiagnosisThresholds": "stagetrace.analysis",
    "Verdict": "stagetrace.analysis",
    "Ticket": "stagetrace.capture.batch",
    "batch": "stagetrace.capture.batch",
    "enqueue": "stagetrace.capture.batch",
    "current_stage": "stagetrace.capture.stage",
    "pipeline": "stagetrace.capture.stage",
    "stage": "stagetrace.capture.stage",
    "generation": "stagetrace.capture.streams",
    "StagetraceHandle": "stagetrace.configuration",
    "configure": "stagetrace.configuration",
    "InferencePipelineProfiler": "stagetrace.profiler",
    "Settings": "stagetrace.settings",
    "gpu_stage": "stagetrace.capture.gpu",
    "h2d": "stagetrace.capture.gpu",
    "d2h": "stagetrace.capture.gpu",
    "instrument_fastapi": "stagetrace.integrations.fastapi",
    "instrument_flask": "stagetrace.integrations.flask",
}

__all__ = [  # written out for linters and type checkers; the same names as _PUBLIC (tests/test_layers.py)
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
    module_name = _PUBLIC.get(name)
    if module_name is None:
        raise AttributeError(f"module 'stagetrace' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
