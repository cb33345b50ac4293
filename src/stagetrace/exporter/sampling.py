"""Local tail sampling: which traces are exported in full, decided after the verdict.

Metrics cover every request; a full trace is worth its export cost when it says something: it was slow,
a rule fired, something failed, or it belongs to the share of healthy traces kept as a baseline. The
healthy share is decided on the trace id (a deterministic function of it, like OpenTelemetry's
``TraceIdRatioBased``), so every service running stagetrace with the same share keeps the same healthy
traces and a kept trace stays whole across services. The user's head sampler still wins: a trace it
dropped is never exported.
"""

from __future__ import annotations

from collections import OrderedDict
from enum import Enum

from stagetrace.analysis import Verdict

_ID_MASK = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # an odd constant: multiplication by it permutes the 64-bit values


class Keep(str, Enum):
    """Why a trace was exported in full (or that it was not)."""

    UNSAMPLED = "unsampled"  # the head sampler dropped it: metrics only
    SLOW = "slow"
    DIAGNOSED = "diagnosed"
    ERROR = "error"
    HEALTHY_SAMPLE = "healthy_sample"
    DROPPED = "dropped"  # a healthy trace outside the sampled share

    @property
    def kept(self) -> bool:
        return self not in (Keep.UNSAMPLED, Keep.DROPPED)


def in_healthy_share(trace_id: int, share: float) -> bool:
    if share >= 1.0:
        return True
    if share <= 0.0:
        return False
    # Mixed first, so that the share is independent of a TraceIdRatioBased head sampler, which compares
    # the same low 64 bits unmixed.
    mixed = ((trace_id & _ID_MASK) * _MIX) & _ID_MASK
    return mixed < int(share * (1 << 64))


def decide(verdict: Verdict, *, errored: bool, healthy_share: float, trace_id: int) -> Keep:
    if not verdict.sampled:
        return Keep.UNSAMPLED
    if verdict.slow:
        return Keep.SLOW
    if verdict.diagnoses:
        return Keep.DIAGNOSED
    if errored:
        return Keep.ERROR
    if in_healthy_share(trace_id, healthy_share):
        return Keep.HEALTHY_SAMPLE
    return Keep.DROPPED


class RecentDecisions:
    """The decision for recently finished traces, so that spans arriving after their trace's root (work
    after the response, late ``http send`` spans) follow it. Bounded; an unknown trace is kept."""

    def __init__(self, max_traces: int = 65_536) -> None:
        self._max = max_traces
        self._kept: OrderedDict[int, bool] = OrderedDict()

    def remember(self, trace_id: int, kept: bool) -> None:
        self._kept[trace_id] = kept
        if len(self._kept) > self._max:
            self._kept.popitem(last=False)

    def kept(self, trace_id: int) -> bool:
        return self._kept.get(trace_id, True)
