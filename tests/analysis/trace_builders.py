"""Stage samples and a one-call diagnosis, shared by the rule tests."""

from __future__ import annotations

from stagetrace.analysis import DiagnosisThresholds, StageSample, TraceSignals, analyse_trace, diagnose

MS = 1_000_000


def run(stages, total_ms=100, signals=TraceSignals(), thresholds=DiagnosisThresholds()):
    """The diagnoses of a trace of ``stages`` under a root of ``total_ms``, by code."""
    a = analyse_trace(0, int(total_ms * MS), stages, 200)
    return {d.code: d for d in diagnose(a, stages, signals, thresholds)}


def cpu(name, start, end, **kw):
    """A stage from ``start`` to ``end`` ms (kind ``cpu`` unless ``kind=`` says otherwise)."""
    return StageSample(name, kw.pop("kind", "cpu"), int(start * MS), int(end * MS), **kw)
