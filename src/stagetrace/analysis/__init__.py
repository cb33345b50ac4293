"""Pure analysis: stage samples in, breakdown / bottleneck / diagnoses out. No I/O, no threads, no clocks,
so the exporter and `stagetrace report` share one implementation and tests need no fixtures."""

from stagetrace.analysis.breakdown import TraceAnalysis, analyse_trace, union_length_ns
from stagetrace.analysis.causes import BlockedCause, blocked_cause
from stagetrace.analysis.diagnosis import RULES, Diagnosis, DiagnosisRule, diagnose
from stagetrace.analysis.model import BatchInfo, StageLike, StageSample, batch_info
from stagetrace.analysis.signals import ProcessLoad, TraceSignals
from stagetrace.analysis.thresholds import DiagnosisThresholds
from stagetrace.analysis.verdict import Verdict, build_verdict

__all__ = [
    "RULES",
    "BatchInfo",
    "BlockedCause",
    "Diagnosis",
    "DiagnosisRule",
    "DiagnosisThresholds",
    "ProcessLoad",
    "StageLike",
    "StageSample",
    "TraceAnalysis",
    "TraceSignals",
    "Verdict",
    "analyse_trace",
    "batch_info",
    "blocked_cause",
    "build_verdict",
    "diagnose",
    "union_length_ns",
]
