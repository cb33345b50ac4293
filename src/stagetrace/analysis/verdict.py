"""What stagetrace concluded about one trace: the verdict, built from an analysis and its diagnoses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from stagetrace.analysis.breakdown import TraceAnalysis
from stagetrace.analysis.diagnosis import Diagnosis
from stagetrace.analysis.offload import OffloadedCall
from stagetrace.analysis.signals import TraceSignals
from stagetrace.analysis.streams import StreamSummary, StreamThresholds, judge_phases
from stagetrace.conventions import SLOW_TOTAL, UNTRACKED


@dataclass(frozen=True)
class Verdict:
    """What stagetrace concluded about one trace; ``on_verdict`` callbacks receive it.

    ``breakdown`` maps stage name to milliseconds (exclusive, GPU time for GPU stages), in pipeline order.
    ``bottleneck`` is the stage with the most time, or ``untracked`` when time in no stage exceeds every
    stage; ``ratio`` is its share of ``total_ms`` in 0..1.

    No slots, so that ``build_verdict`` can set its fields as one dict: the exporter makes one for every trace,
    and the generated ``__init__`` of a frozen dataclass sets each of its fields through ``object.__setattr__``
    in interpreted code.
    """

    trace_id: str
    root_name: str
    total_ms: float
    breakdown: Mapping[str, float]
    bottleneck: str | None
    ratio: float
    slow: bool
    slow_threshold_ms: float
    untracked_ms: float
    diagnoses: tuple[Diagnosis, ...] = ()
    # why it is slow (conventions.SLOW_REASONS: total for a response, first_chunk or gap for a stream); None
    # when it is not
    slow_reason: str | None = None
    first_chunk_threshold_ms: float | None = None  # a streamed response's thresholds (StreamThresholds)
    gap_threshold_ms: float | None = None
    route: str | None = None
    gpu_utilization: float | None = None
    sampled: bool = True
    stage_kinds: Mapping[str, str] = field(default_factory=dict)
    gil_pressure_ms: float | None = None
    cpu_pressure_ms: float | None = None
    loop_lag_ms: float | None = None
    loop_held_ms: float | None = None
    blocked_by: tuple[str, ...] | None = None  # what held the loop while this request waited for it
    delayed_requests: int | None = None  # other requests on its loop while its own sync stages held it
    stream: StreamSummary | None = None  # its response streamed: chunks, time to the first, gaps, phases
    gen_ai: Mapping[str, Any] | None = None  # the generative model it served (gen_ai.* attributes), if said
    offloads: tuple[OffloadedCall, ...] = ()  # the calls it handed to process pools, as the rules read them
    # the process's load over the trace (TraceSignals.load): its CPUs, the CPUs it used, its threads running or
    # queued for a CPU, the requests in flight (on average)
    process_cpus: int | None = None
    process_cpus_used: float | None = None
    process_runnable: float | None = None
    requests_in_flight: float | None = None
    # Whether the diagnosis rules ran on it (past the exporter's CPU budget, on a share of traces:
    # ``exporter/diagnosis_budget.py``), how many traces its diagnoses count for in the diagnosis counter (1 /
    # its chance of being diagnosed; 0 where they did not run), and the share of traces diagnosed at the time.
    diagnosed: bool = True
    diagnosis_weight: float = 1.0
    diagnosis_sample_rate: float = 1.0

    @property
    def bottleneck_ms(self) -> float:
        if self.bottleneck == UNTRACKED:
            return self.untracked_ms
        return self.breakdown.get(self.bottleneck, 0.0) if self.bottleneck is not None else 0.0

    @property
    def diagnosis_codes(self) -> tuple[str, ...]:
        return tuple(d.code for d in self.diagnoses)

    @property
    def slowness(self) -> float:
        """How far past its threshold the phase that judges the trace went (``slowness``)."""
        return slowness(self.total_ms, self.slow_threshold_ms, self.stream, self.first_chunk_threshold_ms,
                        self.gap_threshold_ms)  # fmt: skip


def slowness(
    total_ms: float,
    slow_threshold_ms: float,
    stream: StreamSummary | None,
    first_chunk_threshold_ms: float | None,
    gap_threshold_ms: float | None,
) -> float:
    """How far past its threshold the phase that judges a trace went (1.0: at it): the total over the slow
    threshold for a response, and for a stream judged by its phases the larger of its first chunk over that
    threshold and its gaps' p99 over theirs. What ranks traces by how slow their clients found them: a 20 s
    stream that flowed at a healthy pace ranks under a 3 s one whose gaps stalled, however long it lasted. A
    threshold under 1 ms counts as 1 ms."""
    if stream is not None and first_chunk_threshold_ms is not None and gap_threshold_ms is not None:
        first = stream.first_chunk_ms / max(first_chunk_threshold_ms, 1.0)
        gaps = (stream.gap_p99_ms or 0.0) / max(gap_threshold_ms, 1.0)
        return max(first, gaps)
    return total_ms / max(slow_threshold_ms, 1.0)


class Judgement(NamedTuple):
    """A trace judged before its diagnosis (``judge``): whether it was slow and why, how far past its threshold
    (``slowness``), its headline, and a stream's thresholds. What the keep decision needs first."""

    slow: bool
    reason: str | None
    slowness: float
    bottleneck: str | None
    ratio: float
    first_chunk_threshold_ms: float | None
    gap_threshold_ms: float | None


def judge(
    analysis: TraceAnalysis, stream: StreamSummary | None, stream_thresholds: StreamThresholds | None
) -> Judgement:
    """``stream_thresholds``: how a streamed response (``stream``) is judged slow, by its phases and not its
    length; without them, or for a response not streamed, by its total (``analysis.slow``)."""
    bottleneck, ratio = analysis.bottleneck, analysis.ratio
    if stream is not None and stream_thresholds is not None:
        phases = judge_phases(stream, stream_thresholds)
        if phases.bottleneck is not None:
            bottleneck, ratio = phases.bottleneck, phases.ratio
        first, gap = stream_thresholds.first_chunk_ms, stream_thresholds.gap_ms
        how_slow = slowness(analysis.total_ms, analysis.slow_threshold_ms, stream, first, gap)
        return _new_judgement(
            Judgement, (phases.reason is not None, phases.reason, how_slow, bottleneck, ratio, first, gap)
        )
    how_slow = slowness(analysis.total_ms, analysis.slow_threshold_ms, None, None, None)
    reason = SLOW_TOTAL if analysis.slow else None
    # (through tuple.__new__: the named tuple's own __new__ is Python code, run for every trace)
    return _new_judgement(Judgement, (analysis.slow, reason, how_slow, bottleneck, ratio, None, None))


_new_judgement = tuple.__new__


class DiagnosisChoice(NamedTuple):
    """How a trace's diagnosis was chosen (``exporter/diagnosis_budget.py``): what its diagnoses count for in the
    diagnosis counter (1 / its chance of being diagnosed; 0: the rules did not run on it), and the share of
    traces diagnosed at the time."""

    weight: float
    share: float

    @property
    def diagnosed(self) -> bool:
        return self.weight > 0


EVERY_TRACE = DiagnosisChoice(1.0, 1.0)


def build_verdict(
    *,
    trace_id: str,
    root_name: str,
    analysis: TraceAnalysis,
    diagnoses: tuple[Diagnosis, ...],
    route: str | None = None,
    signals: TraceSignals | None = None,
    sampled: bool = True,
    delayed_requests: int | None = None,
    gen_ai: Mapping[str, Any] | None = None,
    stream_thresholds: StreamThresholds | None = None,
    offloads: tuple[OffloadedCall, ...] = (),
    judged: Judgement | None = None,
    diagnosis: DiagnosisChoice = EVERY_TRACE,
) -> Verdict:
    """``stream_thresholds``: how a streamed response (``signals.stream``) is judged slow (``judge``; ``judged``
    where the caller judged it already). ``diagnosis``: how its diagnosis was chosen (``diagnoses`` empty where
    the rules did not run on it)."""
    stream = signals.stream if signals else None
    if judged is None:
        judged = judge(analysis, stream, stream_thresholds)
    load = signals.load if signals else None
    # Its fields set as one dict (a frozen dataclass's __init__ sets each through object.__setattr__ in
    # interpreted code): every field, in the fields' order (tests/analysis/test_rule_edges.py holds it).
    verdict: Verdict = _NEW(Verdict)
    _SET(
        verdict,
        "__dict__",
        {
            "trace_id": trace_id,
            "root_name": root_name,
            "total_ms": analysis.total_ms,
            "breakdown": analysis.breakdown,
            "bottleneck": judged.bottleneck,
            "ratio": judged.ratio,
            "slow": judged.slow,
            "slow_threshold_ms": analysis.slow_threshold_ms,
            "untracked_ms": analysis.untracked_ms,
            "diagnoses": diagnoses,
            "slow_reason": judged.reason,
            "first_chunk_threshold_ms": judged.first_chunk_threshold_ms,
            "gap_threshold_ms": judged.gap_threshold_ms,
            "route": route,
            "gpu_utilization": signals.gpu_utilization if signals else None,
            "sampled": sampled,
            "stage_kinds": analysis.stage_kinds,
            "gil_pressure_ms": signals.gil_pressure_ms if signals else None,
            "cpu_pressure_ms": signals.cpu_pressure_ms if signals else None,
            "loop_lag_ms": signals.loop_lag_ms if signals else None,
            "loop_held_ms": signals.loop_held_ms if signals else None,
            "blocked_by": (signals.blocked_by or None) if signals else None,
            "delayed_requests": delayed_requests,
            "stream": stream,
            "gen_ai": gen_ai or None,
            "offloads": offloads,
            "process_cpus": load.cpus if load else None,
            "process_cpus_used": load.cpus_used if load else None,
            "process_runnable": load.runnable if load else None,
            "requests_in_flight": load.requests if load else None,
            "diagnosed": diagnosis.diagnosed,
            "diagnosis_weight": diagnosis.weight,
            "diagnosis_sample_rate": diagnosis.share,
        },
    )
    return verdict


_NEW, _SET = object.__new__, object.__setattr__
