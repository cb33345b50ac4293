"""Pure analysis: stage samples in, breakdown / bottleneck / diagnoses out. No I/O, no threads, no clocks,
so the exporter and `stagetrace report` share one implementation and tests need no fixtures."""

from stagetrace.analysis.breakdown import TraceAnalysis, analyse_trace, union_length_ns
from stagetrace.analysis.diagnosis import (
    Diagnosis,
    DiagnosisThresholds,
    TraceSignals,
    diagnose,
)
from stagetrace.analysis.model import BatchInfo, StageLike, StageSample, batch_info
from stagetrace.analysis.verdict import Verdict, build_verdict

__all__ = [
    "BatchInfo",
    "Diagnosis",
    "DiagnosisThresholds",
    "StageLike",
    "StageSample",
    "TraceAnalysis",
    "TraceSignals",
    "Verdict",
    "analyse_trace",
    "batch_info",
    "build_verdict",
    "diagnose",
    "union_length_ns",
]
