"""How many traces the exporter diagnoses: every one while it keeps within its CPU budget, a share past it.

Every trace gets its verdict (breakdown, bottleneck, ratio, slow flag, error) and its metrics at any load;
the diagnosis rules are the part of a verdict that grows with trouble (at saturation every stage is long and
blocked enough for the CPU rules to run) and the part that can be estimated from a sample. The exporter's
budget is a share of what the application itself uses (``Settings.exporter_cpu_budget``: the exporter's
CPU at most that share of the application process's, and never less than ``MIN_CPU`` of one CPU): what
stagetrace costs a service short of CPU is then bounded by what the service does, at any load. While the
exporter keeps within it every trace is diagnosed; past it, each window's share of traces diagnosed is set
so that the diagnoses fit what the rest of the exporter's work leaves of the budget, never under
``MIN_SHARE``:

- a trace is *chosen* on its trace id (a hash independent of the healthy share's and of a head sampler's),
  so its chance of being diagnosed is the share, and its diagnoses count ``1 / share`` times in the
  ``stagetrace.diagnosis`` counter (OpenTelemetry's adjusted count): the counter's sums stay unbiased;
- each *kind* of trace (route or root name, and bottleneck stage: what is known before the rules run) has
  its first ``FLOOR_PER_KIND`` traces of every window diagnosed whatever the share, counting once each: a
  rare kind is never left undiagnosed by a frequent one's load;
- a trace the export budget may keep (slow, errored or the healthy sample, while the budget has tokens for
  it) is always diagnosed, counting once: every kept trace carries its diagnoses.

A trace's chance of being diagnosed is thus 1 where the floor or the keep decision chose it, the share
otherwise; both are settled before its rules run and say nothing of what they would find, which is what
keeps the weighted counts unbiased.

Pure: the caller passes the clocks (``tick``) and the time each diagnosis took (``spent``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from stagetrace.analysis.verdict import EVERY_TRACE, DiagnosisChoice
from stagetrace.exporter.budget import Kind

MIN_SHARE = 0.01  # never fewer than 1 trace in 100 diagnosed, however far past its budget the exporter is
MIN_CPU = 0.01  # the budget's floor, in CPUs: an application idle for a window still has its traces diagnosed
FLOOR_PER_KIND = 2  # traces of each kind diagnosed every window, whatever the share
WINDOW_S = 1.0  # how often the share is set again
_MASK = (1 << 64) - 1


def diagnosis_hash(trace_id: int) -> int:
    """64 bits of the trace id, mixed (splitmix64's finalizer over both halves): independent of the healthy
    share's hash and of a ``TraceIdRatioBased`` head sampler's, which read the low 64 bits linearly."""
    x = (trace_id ^ (trace_id >> 64)) & _MASK
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def in_diagnosis_share(trace_id: int, share: float) -> bool:
    return share >= 1.0 or diagnosis_hash(trace_id) < int(share * (1 << 64))


class CpuClocks(NamedTuple):
    """CPU seconds so far: the exporter's (its process, or the thread it runs on) and the application's."""

    exporter_s: float
    application_s: float


# (through tuple.__new__: the named tuple's own __new__ is Python code, and past the budget every trace gets one)
_new_choice = tuple.__new__


class DiagnosisBudget:
    """``cpu_share`` None: no budget, every trace diagnosed."""

    def __init__(self, cpu_share: float | None, now: float, clocks: CpuClocks, *, max_kinds: int = 1024) -> None:
        self.cpu_share = cpu_share
        self.share = 1.0
        self._max_kinds = max_kinds
        self._window_start, self._window_clocks = now, clocks
        self._window = 0  # counts windows, so that a kind's floor restarts with each
        self._floors: OrderedDict[Kind, tuple[int, int]] = OrderedDict()  # kind -> (window, chosen in it)
        self._traces = 0  # this window's: traces offered,
        self._diagnosed = 0  # diagnosed,
        self._diagnosis_ns = 0  # and the CPU their rules took

    def choose(self, kind: Kind, trace_id: int, *, kept: bool) -> DiagnosisChoice:
        """Whether to diagnose a trace, and what its diagnoses then count for (weight 0: not diagnosed).
        ``kept``: the export budget may keep it without its diagnoses (slow, errored, the healthy sample, with
        tokens left)."""
        self._traces += 1
        share = self.share
        if share >= 1.0:
            return EVERY_TRACE
        if kept:
            return _new_choice(DiagnosisChoice, (1.0, share))
        window, chosen = self._floors.get(kind, (-1, 0))
        if window != self._window:
            chosen = 0
        if chosen < FLOOR_PER_KIND:
            self._floors[kind] = (self._window, chosen + 1)
            self._floors.move_to_end(kind)
            if len(self._floors) > self._max_kinds:
                self._floors.popitem(last=False)
            return _new_choice(DiagnosisChoice, (1.0, share))
        if in_diagnosis_share(trace_id, share):
            return _new_choice(DiagnosisChoice, (1.0 / share, share))
        return _new_choice(DiagnosisChoice, (0.0, share))

    def spent(self, cpu_ns: int) -> None:
        """A diagnosis took ``cpu_ns`` of the exporter's CPU."""
        self._diagnosed += 1
        self._diagnosis_ns += cpu_ns

    def tick(self, now: float, clocks: CpuClocks) -> None:
        """At most once a window: the share of the next, from the CPU the exporter and the application used
        over the last and what the exporter's diagnoses took of it. The diagnoses may have what the rest of
        the exporter's work leaves of the budget; a window with nothing diagnosed keeps the share it had."""
        elapsed = now - self._window_start
        if elapsed < WINDOW_S:
            return
        before = self._window_clocks
        used = max(0.0, clocks.exporter_s - before.exporter_s) / elapsed  # CPUs, this window
        application = max(0.0, clocks.application_s - before.application_s) / elapsed
        diagnosing = self._diagnosis_ns / 1e9 / elapsed
        if self.cpu_share is not None and self._diagnosed:
            budget = max(MIN_CPU, self.cpu_share * application)
            wanted = diagnosing / self._diagnosed * self._traces  # every trace diagnosed
            room = budget - (used - diagnosing)
            # (diagnoses the CPU clock saw take no time cost nothing: every trace, even with no room left)
            target = 1.0 if wanted <= max(0.0, room) else max(MIN_SHARE, room / wanted)
            # Down at once (the budget holds within a window), up by half the way (no swing with the load).
            self.share = target if target < self.share else min(1.0, self.share + (target - self.share) / 2)
        self._window_start, self._window_clocks = now, clocks
        self._window += 1
        self._traces = self._diagnosed = self._diagnosis_ns = 0
